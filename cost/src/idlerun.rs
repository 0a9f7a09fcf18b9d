//! The idle-run rule, written once: what makes a stretch of idle windows one run.
//!
//! The ledger's classifier ([`crate::classify`]) prices a run that reaches `stranded_after`
//! as stranded in full from its start; the alert tracker ([`crate::alert`]) raises
//! `stranded_allocation` for the same runs; the alert evaluator's look further back than
//! its lookback (`server/src/alerts.rs`) follows the same rule in SQL. All of them feed
//! windows to [`IdleRuns`] (or, for the SQL, state the rule as [`IdleRuns::feed`] does), so
//! a GPU-second is stranded in `gpu_cost_hourly` exactly when an alert counts it.
//!
//! # The rule
//!
//! An **idle run** is a stretch of idle windows of **one holder** (the same allocation, or
//! nobody) in time order:
//!
//! - an idle window of the run's holder continues the run when it starts at most
//!   `max_idle_gap` ([`crate::ClassifyConfig::max_idle_gap`], default 2 min) after the end
//!   of the run's last idle window — the time between, missing windows (an agent restart)
//!   or windows without an activity signal, is a **gap** inside the run;
//! - a **busy** window ends the run;
//! - a window of **another holder** (or of nobody, for a held run) ends the run, whether
//!   it is idle, busy or signal-less: a change of holder is known even without a signal;
//! - a window **without an activity signal** of the run's holder counts as gap time,
//!   exactly like missing windows: it neither ends nor extends the run;
//! - a gap **longer than `max_idle_gap`** ends the run at its last idle window; the next
//!   idle window starts a new one.
//!
//! A run's length is from the start of its first idle window to the end of its last one,
//! gaps included: a 10-hour stranded run that an agent restart interrupts for 40 s is
//! still a 10-hour run after it. The gap's own seconds are never idle: the classifier
//! keeps them **unknown** (not priced), and the alert's idle figures end at the run's last
//! idle window.
//!
//! # Why 2 minutes by default
//!
//! An agent restart (a new binary, a crash restarted by systemd or a DaemonSet pod
//! recreated on the node) leaves seconds to about a minute without windows; `apron up`'s
//! first live window follows the seeded history within seconds. A collector outage
//! leaves no gap at all (agents spool and ship late). Two minutes covers the restarts
//! with room, and equals `[alerts.rules] stale_after`, the silence after which the
//! alerts stop trusting a GPU's data. A longer silence — a node reboot, an agent down
//! for good — is genuinely unobserved: the GPU may have worked meanwhile, so it ends
//! the run rather than let unobserved time stretch a stranded claim. The bound also
//! widens the context the incremental ledger reads by itself
//! ([`crate::ClassifyConfig::context_us`]), another reason to keep it small.

/// What a window says about activity, for run tracking.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activity {
    Idle,
    Busy,
    /// Neither activity signal (or a GPU reported lost): gap time.
    NoSignal,
}

impl Activity {
    /// From the classifier's `Some(idle)` / `None` answer.
    pub fn from_idle(idle: Option<bool>) -> Activity {
        match idle {
            Some(true) => Activity::Idle,
            Some(false) => Activity::Busy,
            None => Activity::NoSignal,
        }
    }
}

/// An idle run: its holder, the start of its first idle window and the end of its last.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdleRun<H> {
    pub holder: H,
    pub start_us: i64,
    pub end_us: i64,
}

impl<H> IdleRun<H> {
    /// From its start to the end of its last idle window, gaps included.
    pub fn len_us(&self) -> i64 {
        self.end_us - self.start_us
    }
}

/// One GPU's idle runs, fed window by window in time order. `H` identifies a holder
/// (equal = the same allocation; `None`-like values stand for nobody).
#[derive(Clone, Debug)]
pub struct IdleRuns<H> {
    max_gap_us: i64,
    open: Option<IdleRun<H>>,
}

impl<H: PartialEq> IdleRuns<H> {
    /// `max_gap_us`: the longest gap a run continues across (negative counts as 0).
    pub fn new(max_gap_us: i64) -> IdleRuns<H> {
        IdleRuns { max_gap_us: max_gap_us.max(0), open: None }
    }

    /// Feeds the window `(start_us, end_us]` of `holder`. Returns the run this window
    /// ended, if any. After an [`Activity::Idle`] window the window is part of the open
    /// run ([`IdleRuns::open`]).
    pub fn feed(&mut self, start_us: i64, end_us: i64, holder: H, activity: Activity) -> Option<IdleRun<H>> {
        let same = self.open.as_ref().is_some_and(|r| r.holder == holder);
        match activity {
            Activity::Idle => {
                if let Some(r) = self.open.as_mut()
                    && same
                    && start_us - r.end_us <= self.max_gap_us
                {
                    r.end_us = r.end_us.max(end_us);
                    return None;
                }
                self.open.replace(IdleRun { holder, start_us, end_us })
            }
            Activity::Busy => self.open.take(),
            Activity::NoSignal if same => None,
            Activity::NoSignal => self.open.take(),
        }
    }

    /// The run still open: it may continue with the next idle window.
    pub fn open(&self) -> Option<&IdleRun<H>> {
        self.open.as_ref()
    }

    /// The open run if it can still continue after data up to `latest_us` (the newest
    /// window's end): `None` once more than `max_idle_gap` has passed since its last idle
    /// window without one.
    pub fn current(&self, latest_us: i64) -> Option<&IdleRun<H>> {
        self.open.as_ref().filter(|r| latest_us - r.end_us <= self.max_gap_us)
    }

    /// Moves the open run's start back to `start_us` (a run found to have begun before
    /// the first window fed).
    pub fn extend_start(&mut self, start_us: i64) {
        if let Some(r) = self.open.as_mut() {
            r.start_us = r.start_us.min(start_us);
        }
    }

    /// Ends the data: the open run, if any.
    pub fn finish(&mut self) -> Option<IdleRun<H>> {
        self.open.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: i64 = 1_000_000;

    fn feed_all(runs: &mut IdleRuns<u8>, w: &[(i64, i64, u8, Activity)]) -> Vec<IdleRun<u8>> {
        let mut ended: Vec<IdleRun<u8>> = w.iter().filter_map(|&(s, e, h, a)| runs.feed(s * S, e * S, h, a)).collect();
        ended.extend(runs.finish());
        ended
    }

    #[test]
    fn a_gap_up_to_the_bound_continues_the_run_a_longer_one_ends_it() {
        use Activity::*;
        let mut runs = IdleRuns::new(120 * S);
        // Idle 0–100, 40 s missing, idle 140–200, 120 s of signal-less windows of the same
        // holder (gap time), idle 320–400: one run 0–400 (gaps inside).
        let got = feed_all(
            &mut runs,
            &[(0, 100, 1, Idle), (140, 200, 1, Idle), (200, 320, 1, NoSignal), (320, 400, 1, Idle)],
        );
        assert_eq!(got, [IdleRun { holder: 1, start_us: 0, end_us: 400 * S }]);
        // 121 s missing: two runs.
        let got = feed_all(&mut runs, &[(0, 100, 1, Idle), (221, 300, 1, Idle)]);
        assert_eq!(
            got,
            [
                IdleRun { holder: 1, start_us: 0, end_us: 100 * S },
                IdleRun { holder: 1, start_us: 221 * S, end_us: 300 * S }
            ]
        );
    }

    #[test]
    fn busy_time_and_another_holder_end_the_run_even_without_a_signal() {
        use Activity::*;
        let mut runs = IdleRuns::new(120 * S);
        let got = feed_all(
            &mut runs,
            &[
                (0, 10, 1, Idle),
                (10, 11, 1, Busy),
                (11, 20, 1, Idle),
                (20, 21, 2, NoSignal), // another holder, no signal: ends the run
                (21, 30, 1, Idle),
                (30, 40, 2, Idle), // another holder's idle: a run of its own
            ],
        );
        let r = |h, s: i64, e: i64| IdleRun { holder: h, start_us: s * S, end_us: e * S };
        assert_eq!(got, [r(1, 0, 10), r(1, 11, 20), r(1, 21, 30), r(2, 30, 40)]);
    }

    #[test]
    fn a_run_is_current_until_the_bound_passes_without_idle_data() {
        let mut runs = IdleRuns::new(120 * S);
        runs.feed(0, 100 * S, 7u8, Activity::Idle);
        runs.feed(100 * S, 220 * S, 7u8, Activity::NoSignal);
        assert_eq!(runs.current(220 * S).map(IdleRun::len_us), Some(100 * S));
        runs.feed(220 * S, 221 * S, 7u8, Activity::NoSignal);
        assert_eq!(runs.current(221 * S), None, "121 s without an idle window: over");
        runs.extend_start(-50 * S);
        assert_eq!(runs.open().map(|r| r.start_us), Some(-50 * S));
    }
}
