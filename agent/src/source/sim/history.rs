//! Backfill at full speed: `gpu_samples` rows and `gpu_processes` rows for any past span,
//! built straight from the model.
//!
//! A window row holds exactly what the live agent's aggregator would have made of the
//! samplers' readings: each field group is evaluated at the instants its sampler would
//! have ticked (multiples of its interval inside `(end - window, end]`; 10 utilisation
//! samples, 4 GPM samples and one of each other group per 1 s window by default), and
//! the readings are folded into count/mean/min/max/last the same way. Nothing is
//! allocated per reading; each row costs the `GpuWindow` itself.
//!
//! Each row's owner is what the live agent would attach: the agent's [`Attributor`] over
//! a history [`SimHost`], refreshed at the processes sampler's last tick at or before the
//! window's end (every 5 s by default), so stranded notebooks and Slurm jobs that run
//! nothing still show who holds them.

use std::time::Duration;

use apron_common::{Field, GpuHolder, GpuWindow, ProcessRow, UnixMicros};

use super::fleet::{Fleet, SimProcess};
use super::host::SimHost;
use super::sampler::process_rows;
use crate::attribution::{AttributionConfig, Attributor};
use crate::runtime::next_tick;
use crate::sampler::{FieldGroup, Phase, Readings};
use crate::window::FieldAcc;

fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

/// The first multiple of `step` strictly after `t`.
fn first_after(t: i64, step: i64) -> i64 {
    t.div_euclid(step).saturating_add(1).saturating_mul(step)
}

/// `gpu_samples` rows for every GPU and every window ending in `(start, end]`, oldest
/// window first and GPUs in slot order within a window. See [`super::SimSource::history`].
pub struct History<'a> {
    fleet: &'a Fleet,
    window: Duration,
    window_us: i64,
    next_end: i64,
    last_end: i64,
    slot: usize,
    /// Per entry of `WINDOW_GROUPS`: sampling interval in µs; 0 = not sampled.
    intervals: [i64; FieldGroup::WINDOW.len()],
    /// Ownership as the live agent sees it: an attributor over a host of its own, asked
    /// at each processes tick (every `owners_every` µs; 0 = no processes sampler, no
    /// owners), and its answer per slot as of the tick at `owners_at`.
    host: SimHost,
    attribution: Attributor,
    owners_every: i64,
    owners_at: Option<i64>,
    owners: Vec<Option<GpuHolder>>,
}

impl<'a> History<'a> {
    pub(crate) fn new(fleet: &'a Fleet, host: SimHost, start: UnixMicros, end: UnixMicros, window: Duration) -> Self {
        let window_us = micros(window).max(1);
        Self {
            fleet,
            window,
            window_us,
            next_end: first_after(start.0, window_us),
            last_end: end.0,
            slot: 0,
            intervals: std::array::from_fn(|i| micros(FieldGroup::WINDOW[i].default_interval())),
            host: host.clone(),
            attribution: Attributor::new(&AttributionConfig::default(), Box::new(host)),
            owners_every: micros(FieldGroup::Processes.default_interval()),
            owners_at: None,
            owners: Vec::new(),
        }
    }

    /// Uses the agent's sampling plan instead of the default intervals: `interval(group)`
    /// is the group's interval, `None` for a group that is not sampled.
    pub fn intervals(mut self, interval: impl Fn(FieldGroup) -> Option<Duration>) -> Self {
        for (i, g) in FieldGroup::WINDOW.iter().enumerate() {
            self.intervals[i] = interval(*g).map_or(0, |d| micros(d).max(1));
        }
        self.owners_every = interval(FieldGroup::Processes).map_or(0, |d| micros(d).max(1));
        self
    }

    /// Moves the owners to the processes tick at or before `end` (a no-op within a tick).
    fn update_owners(&mut self, end: i64) {
        if self.owners_every == 0 {
            self.owners.clear();
            return;
        }
        let every = Duration::from_micros(self.owners_every.unsigned_abs());
        let tick = next_tick(UnixMicros(end - self.owners_every), every, Phase::Mid).0;
        if self.owners_at == Some(tick) {
            return;
        }
        self.owners_at = Some(tick);
        self.host.set_time(UnixMicros(tick));
        // The simulator's facts are well-formed: refresh reports no problems worth keeping.
        let _ = self.attribution.refresh();
        self.owners = self.fleet.inventory().iter().map(|gpu| self.attribution.gpu_owner(gpu)).collect();
    }

    /// Windows still to come.
    fn windows_left(&self) -> u64 {
        if self.next_end > self.last_end { 0 } else { ((self.last_end - self.next_end) / self.window_us + 1) as u64 }
    }

    fn row(&self, slot: usize, end: i64) -> Option<GpuWindow> {
        let gpu = self.fleet.inventory().get(slot)?;
        let mut acc = [FieldAcc::EMPTY; Field::COUNT];
        let mut lost = false;
        for (i, &group) in FieldGroup::WINDOW.iter().enumerate() {
            let every = self.intervals[i];
            if every == 0 {
                continue;
            }
            // The live samplers' tick grid (mid-interval, epoch-aligned).
            let mut t =
                next_tick(UnixMicros(end - self.window_us), Duration::from_micros(every.unsigned_abs()), Phase::Mid).0;
            while t <= end {
                let alive =
                    self.fleet.sample(slot, group, t, &mut |f: Field, v: f64| acc[f.index()].add(v, UnixMicros(t)));
                lost |= !alive;
                t += every;
            }
        }
        let mut row = GpuWindow::new(UnixMicros(end), self.window, gpu.clone());
        row.lost = lost;
        row.owner = self.owners.get(slot).cloned().flatten();
        for (out, a) in row.fields.iter_mut().zip(acc.iter()) {
            *out = a.stats();
        }
        Some(row)
    }
}

impl Iterator for History<'_> {
    type Item = GpuWindow;

    fn next(&mut self) -> Option<GpuWindow> {
        let slots = self.fleet.inventory().len();
        if slots == 0 || self.next_end > self.last_end {
            return None;
        }
        if self.slot == 0 {
            self.update_owners(self.next_end);
        }
        let row = self.row(self.slot, self.next_end);
        self.slot += 1;
        if self.slot == slots {
            self.slot = 0;
            self.next_end = self.next_end.saturating_add(self.window_us);
        }
        row
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let slots = self.fleet.inventory().len() as u64;
        let n = (self.windows_left() * slots).saturating_sub(self.slot as u64);
        let n = usize::try_from(n).unwrap_or(usize::MAX);
        (n, Some(n))
    }
}

/// `gpu_processes` rows at every multiple of `every` in `(start, end]`, attributed by an
/// [`Attributor`] over `host`. See [`super::SimSource::process_history`].
pub struct ProcessHistory<'a> {
    fleet: &'a Fleet,
    host: &'a SimHost,
    attribution: &'a Attributor,
    every: i64,
    next: i64,
    end: i64,
    readings: Readings,
    scratch: Vec<SimProcess>,
    pending: std::vec::IntoIter<ProcessRow>,
}

impl<'a> ProcessHistory<'a> {
    pub(crate) fn new(
        fleet: &'a Fleet,
        host: &'a SimHost,
        attribution: &'a Attributor,
        start: UnixMicros,
        end: UnixMicros,
        every: Duration,
    ) -> Self {
        let every = micros(every).max(1);
        Self {
            fleet,
            host,
            attribution,
            every,
            next: first_after(start.0, every),
            end: end.0,
            readings: Readings::default(),
            scratch: Vec::new(),
            pending: Vec::new().into_iter(),
        }
    }
}

impl Iterator for ProcessHistory<'_> {
    type Item = ProcessRow;

    fn next(&mut self) -> Option<ProcessRow> {
        loop {
            if let Some(row) = self.pending.next() {
                return Some(row);
            }
            if self.next > self.end {
                return None;
            }
            let t = UnixMicros(self.next);
            self.next = self.next.saturating_add(self.every);
            self.host.set_time(t);
            self.readings.clear();
            process_rows(self.fleet, self.attribution, t, &mut self.scratch, &mut self.readings);
            self.pending = std::mem::take(&mut self.readings.processes).into_iter();
        }
    }
}
