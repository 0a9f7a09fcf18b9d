//! Clients' query slots, shared fairly between principals.
//!
//! `[query] max_concurrent` slots serve every client. A principal is a team
//! (`team:<name>`) or all unscoped clients together (viewers and admins). Two rules
//! keep one principal from starving the others:
//!
//! - **Share**: a principal holds at most its share of the slots at once
//!   ([`QueryConfig::principal_share`] for unscoped clients, all but one by default;
//!   [`QueryConfig::team_share`] for a team, a quarter by default, at least one).
//! - **The last slot is for a newcomer**: a principal that already holds a slot never
//!   takes the last free one. So while fewer principals are busy than there are slots,
//!   a principal that holds none always finds one at once, however many queries the
//!   busy ones have queued.
//!
//! Why not two semaphores (a share, then a shared slot), as before: a principal waiting
//! in the shared queue with its share permit held still counted as "holding", and a
//! principal's share alone could not see what the others held; two teams with three
//! slow queries each took all four slots and every other principal — viewers, admins,
//! a third team — got `503 busy` for a whole query timeout.
//!
//! Waiting is a [`Notify`]: every release wakes the waiters, each re-checks the rules.
//! Waiters are few (queued queries wait at most `queue_timeout`), so a thundering herd
//! costs nothing that matters.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;

use crate::config::QueryConfig;
use crate::scope::Scope;

/// Why a query could not get a slot in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The principal held its whole share for the whole wait.
    Share { share: usize },
    /// Every slot was taken (or only the newcomers' last one was free).
    Full { max_concurrent: usize },
}

#[derive(Debug)]
struct State {
    free: usize,
    held: HashMap<Scope, usize>,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    released: Notify,
    max_concurrent: usize,
    unscoped_share: usize,
    team_share: usize,
}

/// The clients' slots. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Slots(Arc<Shared>);

/// One held slot, given back on drop.
#[derive(Debug)]
pub struct Slot {
    slots: Arc<Shared>,
    principal: Scope,
}

impl Drop for Slot {
    fn drop(&mut self) {
        {
            let mut state = self.slots.state.lock().unwrap_or_else(PoisonError::into_inner);
            state.free += 1;
            if let Some(n) = state.held.get_mut(&self.principal) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    state.held.remove(&self.principal);
                }
            }
        }
        self.slots.released.notify_waiters();
    }
}

impl Slots {
    pub fn new(config: &QueryConfig) -> Slots {
        let max_concurrent = config.max_concurrent.max(1);
        Slots(Arc::new(Shared {
            state: Mutex::new(State { free: max_concurrent, held: HashMap::new() }),
            released: Notify::new(),
            max_concurrent,
            unscoped_share: config.principal_share(),
            team_share: config.team_share(),
        }))
    }

    /// The share of `principal`.
    pub fn share(&self, principal: &Scope) -> usize {
        match principal {
            Scope::All => self.0.unscoped_share,
            Scope::Team(_) => self.0.team_share,
        }
    }

    /// Takes a slot for `principal`, waiting up to `wait` for one the rules allow.
    pub async fn acquire(&self, principal: &Scope, wait: Duration) -> Result<Slot, Refusal> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            // Registered before the check, so a release between the check and the wait
            // is not missed.
            let released = self.0.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            let refusal = match self.try_acquire(principal) {
                Ok(slot) => return Ok(slot),
                Err(r) => r,
            };
            if tokio::time::timeout_at(deadline, released).await.is_err() {
                return Err(refusal);
            }
        }
    }

    /// Takes a slot for `principal` now, if the rules allow.
    pub fn try_acquire(&self, principal: &Scope) -> Result<Slot, Refusal> {
        let share = self.share(principal);
        let mut state = self.0.state.lock().unwrap_or_else(PoisonError::into_inner);
        let holds = state.held.get(principal).copied().unwrap_or(0);
        if holds >= share {
            return Err(Refusal::Share { share });
        }
        // A principal that holds a slot leaves the last free one to a newcomer.
        let needed = if holds == 0 { 1 } else { 2 };
        if state.free < needed {
            return Err(Refusal::Full { max_concurrent: self.0.max_concurrent });
        }
        state.free -= 1;
        *state.held.entry(principal.clone()).or_insert(0) += 1;
        Ok(Slot { slots: self.0.clone(), principal: principal.clone() })
    }

    /// Slots free now (for tests and diagnostics).
    pub fn free(&self) -> usize {
        self.0.state.lock().unwrap_or_else(PoisonError::into_inner).free
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use apron_common::TeamName;

    fn team(name: &str) -> Scope {
        Scope::Team(TeamName::new(name).expect("team name"))
    }

    fn slots(max_concurrent: usize) -> Slots {
        Slots::new(&QueryConfig { max_concurrent, ..QueryConfig::default() })
    }

    #[test]
    fn three_busy_teams_leave_a_slot_for_a_fourth_principal() {
        let s = slots(4);
        let mut held = Vec::new();
        // Each team tries three queries, one team after another (the worst order).
        for t in ["a", "b", "c"] {
            for _ in 0..3 {
                if let Ok(slot) = s.try_acquire(&team(t)) {
                    held.push(slot);
                }
            }
        }
        assert_eq!(held.len(), 3, "one slot per team by default at 4 slots");
        assert!(s.try_acquire(&Scope::All).is_ok(), "the viewers get the fourth");
        let s = slots(4);
        let _a: Vec<_> = (0..3).filter_map(|_| s.try_acquire(&team("a")).ok()).collect();
        let _b: Vec<_> = (0..3).filter_map(|_| s.try_acquire(&team("b")).ok()).collect();
        let _c: Vec<_> = (0..3).filter_map(|_| s.try_acquire(&team("c")).ok()).collect();
        assert!(s.try_acquire(&team("d")).is_ok(), "or a fourth team");
    }

    #[test]
    fn a_principal_holding_slots_never_takes_the_last() {
        let s = slots(4);
        let viewers: Vec<_> = (0..5).filter_map(|_| s.try_acquire(&Scope::All).ok()).collect();
        assert_eq!(viewers.len(), 3, "all but one");
        assert_eq!(s.try_acquire(&Scope::All).err(), Some(Refusal::Share { share: 3 }));
        let a = s.try_acquire(&team("a")).expect("a newcomer takes the last");
        assert_eq!(s.try_acquire(&team("b")).err(), Some(Refusal::Full { max_concurrent: 4 }));
        drop(a);
        assert_eq!(s.free(), 1);
        let s = slots(8);
        let a: Vec<_> = (0..8).filter_map(|_| s.try_acquire(&team("a")).ok()).collect();
        assert_eq!(a.len(), 2, "a team's share is a quarter of the slots");
        drop(a);
        assert_eq!(s.free(), 8, "every slot comes back");
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_gets_a_released_slot_and_a_refusal_names_why() {
        let s = slots(2);
        let a = s.try_acquire(&team("a")).expect("first");
        let b = s.try_acquire(&team("b")).expect("second");
        let waiter = {
            let s = s.clone();
            tokio::spawn(async move { s.acquire(&team("c"), Duration::from_secs(2)).await })
        };
        tokio::time::sleep(Duration::from_millis(500)).await;
        drop(a);
        assert!(waiter.await.expect("joins").is_ok(), "woken by the release");
        let refused = s.acquire(&team("b"), Duration::from_secs(1)).await;
        assert_eq!(refused.err(), Some(Refusal::Share { share: 1 }));
        drop(b);
    }
}
