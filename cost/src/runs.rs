//! Allocation runs: the stretches of one GPU's windows that one holder held without a
//! break, which become `allocations` rows.
//!
//! A run is a maximal sequence of consecutive windows with the same holder in which
//! each window starts no later than a window's length after the previous one ended
//! (the longer of the two windows: a missed sample or two is not the end of a job, and
//! a switch of sampling interval is not either). The first window's start is the run's
//! start; its last window's end is the newest evidence that the holder still held it.

use crate::classify::{HolderId, Window};

/// One run: windows `first..=last` of the slice it was found in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    pub holder: HolderId,
    pub first: usize,
    pub last: usize,
}

impl Run {
    /// The start of the run's first window.
    pub fn start_us(&self, windows: &[Window]) -> i64 {
        windows.get(self.first).map_or(i64::MIN, |w| w.end_us.saturating_sub(w.window_us))
    }

    /// The end of the run's newest window.
    pub fn last_end_us(&self, windows: &[Window]) -> i64 {
        windows.get(self.last).map_or(i64::MIN, |w| w.end_us)
    }
}

/// An open run whose newest window ended longer ago than this is over: the agent
/// reports a GPU's holder with every window, so silence means the job is gone or the
/// node is.
pub const OPEN_RUN_STALE_US: i64 = 10 * 60_000_000;

/// Whether a run is over at `now_us`: another holder's window came after it
/// (`superseded`), or its newest window, ending at `last_end_us`, is older than
/// [`OPEN_RUN_STALE_US`]. A run that is not over is still held (an open allocation).
pub fn run_ended(superseded: bool, last_end_us: i64, now_us: i64) -> bool {
    superseded || now_us.saturating_sub(last_end_us) > OPEN_RUN_STALE_US
}

/// Whether `next` continues `prev` in time (whatever their holders).
pub fn contiguous(prev: &Window, next: &Window) -> bool {
    next.end_us.saturating_sub(next.window_us) <= prev.end_us.saturating_add(prev.window_us.max(next.window_us))
}

/// The runs of held windows in `windows` (time order), oldest first. Windows nobody
/// holds separate runs and belong to none.
pub fn holder_runs(windows: &[Window]) -> Vec<Run> {
    let mut runs = Vec::new();
    let mut i = 0;
    while i < windows.len() {
        let Some(holder) = windows[i].holder else {
            i += 1;
            continue;
        };
        let mut j = i;
        while j + 1 < windows.len() && windows[j + 1].holder == Some(holder) && contiguous(&windows[j], &windows[j + 1])
        {
            j += 1;
        }
        runs.push(Run { holder, first: i, last: j });
        i = j + 1;
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_ends_when_superseded_or_silent_for_ten_minutes() {
        let last = 1_000 * 1_000_000;
        // Held: its newest window is 10 minutes old exactly, nobody followed.
        assert!(!run_ended(false, last, last + 600 * 1_000_000));
        // Silent one microsecond longer: over.
        assert!(run_ended(false, last, last + 600 * 1_000_000 + 1));
        // Another holder's window came after it: over, however recent.
        assert!(run_ended(true, last, last + 1_000_000));
    }

    const S: i64 = 1_000_000;

    fn w(end_s: i64, window_s: i64, holder: Option<usize>) -> Window {
        Window {
            end_us: end_s * S,
            window_us: window_s * S,
            sm_active_max: None,
            gpu_util_max: None,
            sm_active_mean: None,
            holder: holder.map(HolderId),
        }
    }

    #[test]
    fn a_run_ends_at_a_gap_longer_than_a_window_or_a_new_holder() {
        let ws = [
            w(10, 10, Some(0)),
            w(20, 10, Some(0)),
            // Starts at 35: 15 s after 20, more than a 10 s window → a new run.
            w(45, 10, Some(0)),
            w(55, 10, Some(1)),
            w(65, 10, None),
            w(75, 10, Some(1)),
        ];
        let runs = holder_runs(&ws);
        assert_eq!(
            runs,
            vec![
                Run { holder: HolderId(0), first: 0, last: 1 },
                Run { holder: HolderId(0), first: 2, last: 2 },
                Run { holder: HolderId(1), first: 3, last: 3 },
                Run { holder: HolderId(1), first: 5, last: 5 },
            ]
        );
        assert_eq!(runs[0].start_us(&ws), 0);
        assert_eq!(runs[0].last_end_us(&ws), 20 * S);
        assert_eq!(runs[1].start_us(&ws), 35 * S);
    }

    #[test]
    fn one_missed_sample_keeps_the_run_and_the_longer_window_decides() {
        // 10 s windows with one missing (20..30): 30 starts 10 s after 20 ends.
        assert_eq!(holder_runs(&[w(10, 10, Some(0)), w(20, 10, Some(0)), w(40, 10, Some(0))]).len(), 1);
        // A 1 s window then a 60 s one starting 30 s later: within the longer window.
        assert_eq!(holder_runs(&[w(1, 1, Some(0)), w(91, 60, Some(0))]).len(), 1);
        // …but not 61 s later.
        assert_eq!(holder_runs(&[w(1, 1, Some(0)), w(122, 60, Some(0))]).len(), 2);
        assert!(holder_runs(&[w(10, 10, None)]).is_empty());
    }
}
