//! Who may hold a connection: clients still logging in and logged-in sessions are
//! counted apart, so that sockets that never log in cannot take what a login needs.
//!
//! - Logging in (TLS, startup, password): at most `[pg] max_preauth_connections` at
//!   once. One more is never refused: the oldest still logging in is closed instead
//!   (a login takes milliseconds, an idle socket holds on for `auth_timeout`, so the
//!   oldest is the one least likely to be a client about to finish).
//! - Logged in: at most `[pg] max_connections` sessions, at most
//!   `max_connections_per_user` of them one user's. A login over either is refused
//!   with FATAL 53300 before `AuthenticationOk`, after its password was checked.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pgwire::error::{ErrorInfo, PgWireError};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

use super::{PgLimits, PgStats};

#[derive(Debug, Default)]
struct Waiting {
    next: u64,
    /// Connections logging in, oldest first; each is told when it must make way.
    queue: BTreeMap<u64, Arc<Notify>>,
}

/// A warning at most once a minute (a flood would fill the log), with how many there
/// were since.
#[derive(Debug, Default)]
struct Throttle {
    last: Option<Instant>,
    unreported: u64,
}

impl Throttle {
    fn note(&mut self) -> Option<u64> {
        self.unreported += 1;
        if self.last.is_some_and(|t| t.elapsed() < Duration::from_secs(60)) {
            return None;
        }
        self.last = Some(Instant::now());
        Some(std::mem::take(&mut self.unreported))
    }
}

#[derive(Debug)]
pub struct Slots {
    max_preauth: usize,
    max_connections: usize,
    max_per_user: usize,
    stats: Arc<PgStats>,
    waiting: Mutex<Waiting>,
    sessions: Arc<Semaphore>,
    per_user: Mutex<HashMap<String, usize>>,
    evictions: Mutex<Throttle>,
    refusals: Mutex<Throttle>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A connection's place among those logging in; dropped when it has logged in or closed.
#[derive(Debug)]
pub struct Ticket {
    id: u64,
    /// Notified when this connection must make way for a newer one.
    pub evicted: Arc<Notify>,
    slots: Arc<Slots>,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        lock(&self.slots.waiting).queue.remove(&self.id);
    }
}

/// A logged-in session's place, held while the connection lives.
#[derive(Debug)]
pub struct Login {
    _permit: OwnedSemaphorePermit,
    user: String,
    slots: Arc<Slots>,
}

impl Drop for Login {
    fn drop(&mut self) {
        let mut per_user = lock(&self.slots.per_user);
        if let Some(n) = per_user.get_mut(&self.user) {
            *n -= 1;
            if *n == 0 {
                per_user.remove(&self.user);
            }
        }
    }
}

impl Slots {
    pub fn new(limits: &PgLimits) -> Slots {
        Slots {
            max_preauth: limits.session.max_preauth_connections.max(1),
            max_connections: limits.max_connections,
            max_per_user: limits.session.per_user(limits.max_connections),
            stats: limits.stats.clone(),
            waiting: Mutex::default(),
            sessions: Arc::new(Semaphore::new(limits.max_connections)),
            per_user: Mutex::default(),
            evictions: Mutex::default(),
            refusals: Mutex::default(),
        }
    }

    /// A new connection's place among those logging in; when they are
    /// `max_preauth_connections` already, the oldest is told to close.
    pub fn admit(self: &Arc<Self>) -> Ticket {
        let evicted = Arc::new(Notify::new());
        let mut waiting = lock(&self.waiting);
        if waiting.queue.len() >= self.max_preauth
            && let Some((_, oldest)) = waiting.queue.pop_first()
        {
            // A stored permit: the connection sees it at its next look, even if it is
            // not waiting on it right now.
            oldest.notify_one();
            self.stats.preauth_evicted.fetch_add(1, Ordering::Relaxed);
            if let Some(n) = lock(&self.evictions).note() {
                tracing::warn!(
                    evicted = n,
                    "pg: {} connections were logging in at once (pg.max_preauth_connections); closing the oldest \
                     to make room for new ones",
                    self.max_preauth
                );
            }
        }
        let id = waiting.next;
        waiting.next += 1;
        waiting.queue.insert(id, evicted.clone());
        Ticket { id, evicted, slots: self.clone() }
    }

    /// A session for `user`, whose password was right; FATAL 53300 naming the limit when
    /// there is no room.
    pub fn login(self: &Arc<Self>, user: &str) -> Result<Login, PgWireError> {
        let mut per_user = lock(&self.per_user);
        let mine = per_user.get(user).copied().unwrap_or(0);
        let refused = if mine >= self.max_per_user {
            Some(format!(
                "too many connections for role \"{user}\": it has {mine} open, the limit \
                 (pg.max_connections_per_user)"
            ))
        } else {
            match self.sessions.clone().try_acquire_owned() {
                Ok(permit) => {
                    per_user.insert(user.to_owned(), mine + 1);
                    return Ok(Login { _permit: permit, user: user.to_owned(), slots: self.clone() });
                }
                Err(_) => Some(format!(
                    "sorry, too many clients already: {} sessions are open, the limit (pg.max_connections)",
                    self.max_connections
                )),
            }
        };
        drop(per_user);
        let message = refused.unwrap_or_default();
        self.stats.rejected.fetch_add(1, Ordering::Relaxed);
        if let Some(n) = lock(&self.refusals).note() {
            tracing::warn!(refused = n, "pg: refusing logins: {message}");
        }
        Err(PgWireError::UserError(Box::new(ErrorInfo::new("FATAL".to_owned(), "53300".to_owned(), message))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pg::PgSessionLimits;

    fn slots(max_connections: usize, per_user: usize, preauth: usize) -> Arc<Slots> {
        let limits = PgLimits {
            max_connections,
            session: PgSessionLimits {
                max_connections_per_user: Some(per_user),
                max_preauth_connections: preauth,
                ..PgSessionLimits::default()
            },
            ..PgLimits::default()
        };
        Arc::new(Slots::new(&limits))
    }

    #[tokio::test]
    async fn the_oldest_login_in_progress_makes_way() {
        let s = slots(10, 10, 2);
        let (a, b) = (s.admit(), s.admit());
        let c = s.admit();
        // a was told (the permit is stored), b and c were not.
        tokio::time::timeout(Duration::from_secs(1), a.evicted.notified()).await.expect("a evicted");
        assert!(tokio::time::timeout(Duration::from_millis(50), b.evicted.notified()).await.is_err());
        drop(a);
        assert_eq!(lock(&s.waiting).queue.len(), 2);
        drop((b, c));
        assert!(lock(&s.waiting).queue.is_empty());
        assert_eq!(s.stats.preauth_evicted.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn sessions_are_capped_per_user_and_in_all() {
        let s = slots(3, 2, 10);
        let a1 = s.login("a").expect("a1");
        let _a2 = s.login("a").expect("a2");
        let e = s.login("a").expect_err("a3");
        let text = format!("{:?}", ErrorInfo::from(e));
        assert!(text.contains("53300") && text.contains("pg.max_connections_per_user"), "{text}");
        let _b1 = s.login("b").expect("b1");
        let e = s.login("b").expect_err("all three taken");
        let text = format!("{:?}", ErrorInfo::from(e));
        assert!(text.contains("53300") && text.contains("pg.max_connections"), "{text}");
        drop(a1);
        let _b2 = s.login("b").expect("room again");
        assert_eq!(s.stats.rejected.load(Ordering::Relaxed), 2);
    }
}
