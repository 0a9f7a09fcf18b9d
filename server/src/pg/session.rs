//! What one connection holds through the extended protocol, counted as it is asked for
//! and refused before it is stored: prepared statements (`[pg] max_statements`), portals
//! (`max_portals`, suspended ones included), and their bytes — statement texts, bound
//! values, the buffered rest of a suspended portal's result — against
//! `max_session_bytes` per connection and, beyond each connection's first
//! [`OWN_BYTES`], against `max_total_session_bytes` for all connections together.
//!
//! pgwire's own store (`MemPortalStore`) cannot be listed or bounded, so the handlers
//! keep this ledger beside it: every Parse, Bind, Execute, Close and Sync that changes
//! the store changes the ledger the same way (`super::Queries`).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use pgwire::error::{ErrorInfo, PgWireError};

use super::{PgSessionLimits, PgStats};

/// A connection's first bytes are its own: they do not draw on
/// `max_total_session_bytes`, so connections that fill the shared total cannot stop
/// another from preparing its statements (a driver's statement cache is far smaller).
pub const OWN_BYTES: usize = 2 << 20;
/// What a statement holds beyond its text and name (its columns and parameter types).
pub const STATEMENT_OVERHEAD: usize = 512;
/// What a portal holds beyond its values and its statement's text.
pub const PORTAL_OVERHEAD: usize = 256;

/// pgwire's name for the unnamed statement and portal, as messages say it.
fn shown(name: &str) -> String {
    if name == pgwire::api::DEFAULT_NAME { "unnamed".to_owned() } else { format!("\"{name}\"") }
}

fn refuse(code: &str, message: String) -> PgWireError {
    PgWireError::UserError(Box::new(ErrorInfo::new("ERROR".to_owned(), code.to_owned(), message)))
}

#[derive(Debug, Default, Clone, Copy)]
struct PortalBytes {
    /// Values, name and overhead.
    bound: usize,
    /// The rest of a suspended portal's result (0 when it is not suspended).
    result: usize,
    /// The statement it was bound from (a portal keeps its statement alive).
    statement: Option<u64>,
}

#[derive(Debug, Clone, Copy)]
struct StatementBytes {
    id: u64,
    bytes: usize,
}

/// One connection's statements and portals, in bytes.
#[derive(Debug)]
pub struct Ledger {
    limits: PgSessionLimits,
    stats: Arc<PgStats>,
    statements: HashMap<String, StatementBytes>,
    portals: HashMap<String, PortalBytes>,
    /// Portals bound from each statement, by statement id.
    bound_from: HashMap<u64, usize>,
    /// Statements closed or replaced while portals still kept them: their bytes, until
    /// the last of those portals goes.
    kept: HashMap<u64, usize>,
    next_id: u64,
    held: usize,
}

impl Ledger {
    pub fn new(limits: PgSessionLimits, stats: Arc<PgStats>) -> Ledger {
        Ledger {
            limits,
            stats,
            statements: HashMap::new(),
            portals: HashMap::new(),
            bound_from: HashMap::new(),
            kept: HashMap::new(),
            next_id: 0,
            held: 0,
        }
    }

    /// Bytes held now.
    #[cfg(test)]
    pub fn held(&self) -> usize {
        self.held
    }

    /// The part of `held` that draws on the shared total.
    fn shared(&self, held: usize) -> usize {
        held.saturating_sub(OWN_BYTES.min(self.limits.max_session_bytes))
    }

    /// Moves the connection's bytes from `held` to `new`, or refuses (53200) naming the
    /// limit in the way; `what` says what was asked for.
    fn set_held(&mut self, new: usize, what: &dyn Fn() -> String) -> Result<(), PgWireError> {
        let (old_shared, new_shared) = (self.shared(self.held), self.shared(new));
        if new > self.held && new > self.limits.max_session_bytes {
            self.stats.session_refusals.fetch_add(1, Ordering::Relaxed);
            return Err(refuse(
                "53200",
                format!(
                    "cannot {}: this connection would hold {new} bytes of statements, bound values and suspended \
                     results, over its limit of {} bytes (pg.max_session_bytes); close statements or portals \
                     (or read the suspended one to its end) first",
                    what(),
                    self.limits.max_session_bytes
                ),
            ));
        }
        if new_shared > old_shared {
            let add = new_shared - old_shared;
            let max = self.limits.max_total_session_bytes;
            let total = &self.stats.held_bytes;
            let taken = total.fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
                let sum = t.checked_add(add)?;
                (sum <= max).then_some(sum)
            });
            if let Err(t) = taken {
                self.stats.session_refusals.fetch_add(1, Ordering::Relaxed);
                return Err(refuse(
                    "53200",
                    format!(
                        "cannot {}: the server's PostgreSQL connections hold {t} bytes together beyond their own \
                         first {} bytes, and {add} more would pass the limit of {max} bytes \
                         (pg.max_total_session_bytes); try again later",
                        what(),
                        OWN_BYTES.min(self.limits.max_session_bytes),
                    ),
                ));
            }
        } else if old_shared > new_shared {
            self.stats.held_bytes.fetch_sub(old_shared - new_shared, Ordering::AcqRel);
        }
        self.held = new;
        Ok(())
    }

    /// Gives back `bytes` (never refused).
    fn release(&mut self, bytes: usize) {
        let _ = self.set_held(self.held - bytes, &String::new);
    }

    /// The bytes of a statement leaving the name it had: given back, or kept while
    /// portals still hold it.
    fn retire(&mut self, old: StatementBytes) {
        if self.bound_from.get(&old.id).is_some_and(|n| *n > 0) {
            self.kept.insert(old.id, old.bytes);
        } else {
            self.release(old.bytes);
        }
    }

    /// One portal fewer holds statement `id`.
    fn unbind(&mut self, id: Option<u64>) {
        let Some(id) = id else { return };
        let left = self.bound_from.get_mut(&id).map(|n| {
            *n -= 1;
            *n
        });
        if left == Some(0) {
            self.bound_from.remove(&id);
            if let Some(bytes) = self.kept.remove(&id) {
                self.release(bytes);
            }
        }
    }

    /// Parse of `bytes` under `name` (replacing what was there), if the limits allow.
    /// `commit: false` only checks.
    pub fn statement(&mut self, name: &str, bytes: usize, commit: bool) -> Result<(), PgWireError> {
        let old = self.statements.get(name).copied();
        if old.is_none() && self.statements.len() >= self.limits.max_statements {
            self.stats.session_refusals.fetch_add(1, Ordering::Relaxed);
            return Err(refuse(
                "54000",
                format!(
                    "cannot prepare statement {}: this connection already has {} prepared statements, the limit \
                     (pg.max_statements); close some (Close, DEALLOCATE) first",
                    shown(name),
                    self.statements.len()
                ),
            ));
        }
        // What the old one gives back now (nothing while portals keep it).
        let freed = old.filter(|o| !self.bound_from.contains_key(&o.id)).map_or(0, |o| o.bytes);
        let new = self.held - freed + bytes;
        let what = || format!("prepare statement {} ({bytes} bytes)", shown(name));
        if !commit {
            return self.check(new, &what);
        }
        self.set_held(new, &what)?;
        let id = self.next_id;
        self.next_id += 1;
        if let Some(old) = self.statements.insert(name.to_owned(), StatementBytes { id, bytes })
            && self.bound_from.contains_key(&old.id)
        {
            // Still counted: its portals keep it.
            self.kept.insert(old.id, old.bytes);
        }
        Ok(())
    }

    /// [`Ledger::set_held`] without moving anything.
    fn check(&mut self, new: usize, what: &dyn Fn() -> String) -> Result<(), PgWireError> {
        let held = self.held;
        self.set_held(new, what)?;
        self.set_held(held, what)
    }

    pub fn forget_statement(&mut self, name: &str) {
        if let Some(old) = self.statements.remove(name) {
            self.retire(old);
        }
    }

    pub fn has_statement(&self, name: &str) -> bool {
        self.statements.contains_key(name)
    }

    pub fn statement_names(&self) -> Vec<String> {
        self.statements.keys().cloned().collect()
    }

    /// Bind of a portal holding `bytes` (values, name) under `name` from statement
    /// `statement` (replacing what was there, its suspended result too), if the limits
    /// allow.
    pub fn portal(&mut self, name: &str, statement: &str, bytes: usize) -> Result<(), PgWireError> {
        let old = self.portals.get(name).copied();
        if old.is_none() && self.portals.len() >= self.limits.max_portals {
            self.stats.session_refusals.fetch_add(1, Ordering::Relaxed);
            return Err(refuse(
                "54000",
                format!(
                    "cannot bind portal {}: this connection already has {} open portals (suspended ones \
                     included), the limit (pg.max_portals); close some, or Sync to close the unnamed one, first",
                    shown(name),
                    self.portals.len()
                ),
            ));
        }
        let bytes = bytes + PORTAL_OVERHEAD;
        let what = || format!("bind portal {} ({bytes} bytes of values)", shown(name));
        let old_bytes = old.map_or(0, |p| p.bound + p.result);
        self.set_held(self.held - old_bytes + bytes, &what)?;
        let id = self.statements.get(statement).map(|s| s.id);
        if let Some(id) = id {
            *self.bound_from.entry(id).or_default() += 1;
        }
        if let Some(old) = self.portals.insert(name.to_owned(), PortalBytes { bound: bytes, result: 0, statement: id })
        {
            self.unbind(old.statement);
        }
        Ok(())
    }

    /// The rest of portal `name`'s result, `bytes`, stays buffered for the next Execute,
    /// if the limits allow.
    pub fn suspend(&mut self, name: &str, bytes: usize) -> Result<(), PgWireError> {
        let old = self.portals.get(name).copied().unwrap_or_default();
        let what = || {
            format!(
                "keep the rest of portal {}'s result ({bytes} bytes) for the next Execute; read it whole \
                 (Execute with no row limit) or ask for less",
                shown(name)
            )
        };
        self.set_held(self.held - old.result + bytes, &what)?;
        self.portals.insert(name.to_owned(), PortalBytes { result: bytes, ..old });
        Ok(())
    }

    /// Portal `name` holds no result any more (read to its end, or never suspended).
    pub fn finished(&mut self, name: &str) {
        if let Some(p) = self.portals.get_mut(name)
            && p.result > 0
        {
            let result = std::mem::take(&mut p.result);
            self.release(result);
        }
    }

    pub fn suspended(&self, name: &str) -> bool {
        self.portals.get(name).is_some_and(|p| p.result > 0)
    }

    pub fn forget_portal(&mut self, name: &str) {
        if let Some(p) = self.portals.remove(name) {
            self.release(p.bound + p.result);
            self.unbind(p.statement);
        }
    }

    pub fn portal_names(&self) -> Vec<String> {
        self.portals.keys().cloned().collect()
    }
}

impl Drop for Ledger {
    fn drop(&mut self) {
        let shared = self.shared(self.held);
        if shared > 0 {
            self.stats.held_bytes.fetch_sub(shared, Ordering::AcqRel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> PgSessionLimits {
        PgSessionLimits {
            max_statements: 3,
            max_portals: 2,
            max_session_bytes: 10_000,
            max_total_session_bytes: 1 << 30,
            ..PgSessionLimits::default()
        }
    }

    fn code(e: PgWireError) -> String {
        match e {
            PgWireError::UserError(info) => format!("{} {}", info.code, info.message),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn statements_and_portals_are_counted_and_refused_past_the_limits() {
        let stats = Arc::new(PgStats::default());
        let mut l = Ledger::new(limits(), stats.clone());
        for n in ["a", "b", "c"] {
            l.statement(n, 100, true).expect("fits");
        }
        // Replacing a name is not one more.
        l.statement("b", 200, true).expect("replaces");
        assert_eq!(l.held(), 400);
        let e = code(l.statement("d", 100, true).expect_err("a fourth"));
        assert!(e.starts_with("54000") && e.contains("pg.max_statements"), "{e}");
        l.forget_statement("a");
        l.statement("d", 100, true).expect("room again");
        assert_eq!(l.held(), 400);

        let p = 1000 - PORTAL_OVERHEAD;
        l.portal("p", "b", p).expect("fits");
        l.portal("q", "c", p).expect("fits");
        assert_eq!(l.held(), 2400);
        let e = code(l.portal("r", "c", 10).expect_err("a third"));
        assert!(e.starts_with("54000") && e.contains("pg.max_portals"), "{e}");
        // A suspended result counts, and is given back when read to its end.
        let e = code(l.suspend("p", 8_000).expect_err("over the connection's bytes"));
        assert!(e.starts_with("53200") && e.contains("pg.max_session_bytes"), "{e}");
        assert_eq!(l.held(), 2400, "nothing was taken");
        l.suspend("p", 5_000).expect("fits");
        assert!(l.suspended("p"));
        assert_eq!(l.held(), 7400);
        l.finished("p");
        assert_eq!(l.held(), 2400);
        // A check alone takes nothing.
        l.statement("e", 100, false).expect_err("count");
        l.statement("b", 300, false).expect("fits");
        assert_eq!(l.held(), 2400);

        // A statement closed or replaced while a portal holds it stays counted until
        // the portal goes.
        l.forget_statement("b");
        assert_eq!(l.held(), 2400, "portal p keeps b");
        l.statement("c", 50, true).expect("replaces c, which q keeps");
        assert_eq!(l.held(), 2450);
        l.forget_portal("q");
        assert_eq!(l.held(), 1350, "q and the old c it kept go");
        l.portal("p", "d", p).expect("re-bound from d");
        assert_eq!(l.held(), 1150, "b goes with p's old binding");
        l.forget_portal("p");
        l.forget_statement("c");
        l.forget_statement("d");
        assert_eq!(l.held(), 0);
    }

    #[test]
    fn bytes_past_a_connections_own_draw_on_the_shared_total() {
        let stats = Arc::new(PgStats::default());
        let limits = PgSessionLimits {
            max_session_bytes: 64 << 20,
            max_total_session_bytes: 10 << 20,
            ..PgSessionLimits::default()
        };
        let mut a = Ledger::new(limits.clone(), stats.clone());
        let mut b = Ledger::new(limits.clone(), stats.clone());
        a.statement("s", OWN_BYTES, true).expect("its own");
        assert_eq!(stats.held_bytes(), 0);
        a.portal("p", "s", (8 << 20) - PORTAL_OVERHEAD).expect("shared");
        assert_eq!(stats.held_bytes(), 8 << 20);
        let e = code(b.portal("p", "", OWN_BYTES + (3 << 20)).expect_err("the shared total is spent"));
        assert!(e.starts_with("53200") && e.contains("pg.max_total_session_bytes"), "{e}");
        // b's own bytes are still its own.
        b.statement("s", OWN_BYTES, true).expect("its own");
        drop(a);
        assert_eq!(stats.held_bytes(), 0, "a connection's bytes go back when it closes");
        b.portal("p", "", (3 << 20) - PORTAL_OVERHEAD).expect("room again");
        assert_eq!(stats.held_bytes(), 3 << 20);
    }
}
