//! Windows, not points: readings become one row per GPU per window.
//!
//! Every reading carries the time it describes. The [`Aggregator`] assigns it to the
//! epoch-aligned window `(end - window, end]` that contains that time and keeps count,
//! sum, min, max and last per field. A window closes once the clock has passed its end by
//! the allowed lateness (driver sample buffers deliver readings a little after the fact);
//! a reading for a window already closed is dropped and counted, never reopened, so a
//! closed row is final.

use std::collections::BTreeMap;
use std::time::Duration;

use apron_common::{Field, FieldStats, GpuHolder, GpuIdentity, GpuWindow, UnixMicros};

use crate::sampler::{Readings, Slot};

/// Count, sum, min, max and last of one field's readings in one window. Shared with the
/// simulator's history generator so that live and generated rows aggregate identically.
#[derive(Clone, Copy, Debug)]
pub struct FieldAcc {
    count: u32,
    sum: f64,
    min: f64,
    max: f64,
    last: f64,
    last_at: UnixMicros,
}

impl FieldAcc {
    pub const EMPTY: FieldAcc = FieldAcc {
        count: 0,
        sum: 0.0,
        min: f64::INFINITY,
        max: f64::NEG_INFINITY,
        last: 0.0,
        last_at: UnixMicros(i64::MIN),
    };

    pub fn add(&mut self, value: f64, at: UnixMicros) {
        self.sum = if self.count == 0 { value } else { self.sum + value };
        self.count += 1;
        self.min = self.min.min(value);
        self.max = self.max.max(value);
        // Readings can arrive out of order across samplers; "last" is by time.
        if at >= self.last_at {
            self.last = value;
            self.last_at = at;
        }
    }

    /// `None` when there was no reading: the column is NULL.
    pub fn stats(&self) -> Option<FieldStats> {
        (self.count > 0).then(|| FieldStats {
            count: self.count,
            mean: self.sum / f64::from(self.count),
            min: self.min,
            max: self.max,
            last: self.last,
        })
    }
}

#[derive(Clone, Default)]
struct SlotAcc {
    fields: Vec<FieldAcc>,
    lost: bool,
    touched: bool,
}

impl SlotAcc {
    fn field(&mut self, f: Field) -> &mut FieldAcc {
        if self.fields.is_empty() {
            self.fields = vec![FieldAcc::EMPTY; Field::COUNT];
        }
        &mut self.fields[f.index()]
    }
}

/// Turns readings into closed windows.
pub struct Aggregator {
    window: Duration,
    lateness: Duration,
    inventory: Vec<GpuIdentity>,
    open: BTreeMap<UnixMicros, Vec<SlotAcc>>,
    /// End of the newest closed window; readings at or before it are late.
    closed_until: Option<UnixMicros>,
    late_readings: u64,
    /// Windows that began before this instant are only partly observed (the agent
    /// started inside them); they are not emitted.
    started: Option<UnixMicros>,
    /// Per slot: who holds the GPU, as attribution last answered; copied into every
    /// window that closes until the next answer.
    owners: Vec<Option<GpuHolder>>,
    /// Until attribution first answers, closed windows wait here (at most `owner_wait`),
    /// so that the first seconds after a start are not shipped as "nobody holds it" —
    /// which would split an allocation's idle run in two.
    owner_wait: Option<Duration>,
    owners_known: bool,
    held: Vec<GpuWindow>,
}

impl Aggregator {
    pub fn new(inventory: Vec<GpuIdentity>, window: Duration, lateness: Duration) -> Self {
        Self {
            window,
            lateness,
            inventory,
            open: BTreeMap::new(),
            closed_until: None,
            late_readings: 0,
            started: None,
            owners: Vec::new(),
            owner_wait: None,
            owners_known: true,
            held: Vec::new(),
        }
    }

    /// Holds closed windows until the first [`Aggregator::set_owners`], for at most
    /// `wait` after their end (then they go out with no owner: attribution may be off or
    /// failing, and data must not stall).
    pub fn awaiting_owners(mut self, wait: Duration) -> Self {
        self.owner_wait = Some(wait);
        self.owners_known = false;
        self
    }

    /// Drops the partial window the agent starts in: a row always covers a whole window.
    pub fn starting_at(mut self, started: UnixMicros) -> Self {
        self.started = Some(started);
        self
    }

    pub fn inventory(&self) -> &[GpuIdentity] {
        &self.inventory
    }

    /// Who holds each GPU (by slot) from now on: windows closed after this call carry it.
    /// The agent calls this after every processes tick (attribution's refresh), so a
    /// window's owner is at most one processes interval (plus lateness) old.
    pub fn set_owners(&mut self, owners: Vec<Option<GpuHolder>>) {
        if !self.owners_known {
            // The windows held since the start get the first answer.
            for row in &mut self.held {
                let slot = self.inventory.iter().position(|g| g.gpu_uuid == row.gpu.gpu_uuid);
                row.owner = slot.and_then(|i| owners.get(i).cloned().flatten());
            }
            self.owners_known = true;
        }
        self.owners = owners;
    }

    /// Readings that arrived for windows already closed, since start.
    pub fn late_readings(&self) -> u64 {
        self.late_readings
    }

    fn slot_acc(&mut self, end: UnixMicros, slot: Slot) -> Option<&mut SlotAcc> {
        if slot >= self.inventory.len() {
            return None;
        }
        let n = self.inventory.len();
        let slots = self.open.entry(end).or_insert_with(|| vec![SlotAcc::default(); n]);
        slots.get_mut(slot)
    }

    fn is_late(&self, end: UnixMicros) -> bool {
        self.closed_until.is_some_and(|c| end <= c)
    }

    /// Adds one sampler tick's readings. `now` stamps lost-GPU reports.
    pub fn add(&mut self, readings: &Readings, now: UnixMicros) {
        for r in &readings.values {
            let end = r.at.window_end(self.window);
            if self.is_late(end) {
                self.late_readings += 1;
                continue;
            }
            if let Some(acc) = self.slot_acc(end, r.slot) {
                acc.touched = true;
                acc.field(r.field).add(r.value, r.at);
            }
        }
        let end = now.window_end(self.window);
        if !self.is_late(end) {
            for &slot in &readings.lost {
                if let Some(acc) = self.slot_acc(end, slot) {
                    acc.lost = true;
                    acc.touched = true;
                }
            }
        }
    }

    /// When the oldest open window may close, if any is open.
    pub fn next_close(&self) -> Option<UnixMicros> {
        self.open.keys().next().map(|end| end.plus(self.lateness))
    }

    /// Closes every window whose end plus lateness is at or before `now`, oldest first.
    /// GPUs with no reading at all in a window produce no row.
    pub fn close_due(&mut self, now: UnixMicros) -> Vec<GpuWindow> {
        let mut out = Vec::new();
        if self.owners_known
            || self.held.first().is_some_and(|w| w.time.plus(self.owner_wait.unwrap_or_default()) <= now)
        {
            out = std::mem::take(&mut self.held);
            self.owners_known = true;
        }
        while let Some((&end, _)) = self.open.first_key_value() {
            if end.plus(self.lateness) > now {
                break;
            }
            let Some((end, slots)) = self.open.pop_first() else { break };
            self.closed_until = Some(self.closed_until.map_or(end, |c| c.max(end)));
            if self.started.is_some_and(|s| end.minus(self.window) < s) {
                continue;
            }
            for (slot, acc) in slots.into_iter().enumerate() {
                if !acc.touched {
                    continue;
                }
                let mut row = GpuWindow::new(end, self.window, self.inventory[slot].clone());
                row.lost = acc.lost;
                row.owner = self.owners.get(slot).cloned().flatten();
                for (i, a) in acc.fields.iter().enumerate() {
                    row.fields[i] = a.stats();
                }
                if self.owners_known {
                    out.push(row);
                } else {
                    self.held.push(row);
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod owner_wait_tests {
    use apron_common::{GpuUuid, HostName};

    use super::*;

    #[test]
    fn windows_before_the_first_attribution_wait_for_it_or_for_the_limit() {
        let g = GpuIdentity::gpu(HostName::new("h").expect("host"), GpuUuid::new("GPU-0").expect("uuid"), 0, "m");
        let s = 1_000_000;
        let reading = |agg: &mut Aggregator, t: i64| {
            let mut r = Readings::default();
            r.push(0, Field::GpuUtil, 0.5, UnixMicros(t));
            agg.add(&r, UnixMicros(t));
        };
        let holder = GpuHolder::slurm_job("7");
        let mut agg = Aggregator::new(vec![g.clone()], Duration::from_secs(1), Duration::ZERO)
            .awaiting_owners(Duration::from_secs(10));
        reading(&mut agg, s + 500_000);
        reading(&mut agg, 2 * s + 500_000);
        assert!(agg.close_due(UnixMicros(3 * s)).is_empty(), "held until attribution answers");
        agg.set_owners(vec![Some(holder.clone())]);
        let out = agg.close_due(UnixMicros(3 * s));
        assert_eq!(out.len(), 2);
        assert!(out.iter().all(|w| w.owner == Some(holder.clone())));
        // No answer at all: released after the wait, with no owner.
        let mut agg =
            Aggregator::new(vec![g], Duration::from_secs(1), Duration::ZERO).awaiting_owners(Duration::from_secs(10));
        reading(&mut agg, s + 500_000);
        assert!(agg.close_due(UnixMicros(5 * s)).is_empty());
        let out = agg.close_due(UnixMicros(12 * s));
        assert_eq!((out.len(), out[0].owner.clone()), (1, None));
    }
}

#[cfg(test)]
mod tests {
    use apron_common::{GpuUuid, HostName};

    use super::*;

    fn gpu(i: u32) -> GpuIdentity {
        GpuIdentity {
            cluster: None,
            host: HostName::new("h").expect("valid"),
            gpu_uuid: GpuUuid::new(format!("GPU-{i}")).expect("valid"),
            gpu_index: i,
            gpu_model: "NVIDIA H100 80GB HBM3".into(),
            pci_bus_id: "00000000:18:00.0".into(),
            minor_number: Some(i),
            parent_gpu_uuid: None,
            mig_profile: None,
            mig_gpu_instance_id: None,
        }
    }

    const S: i64 = 1_000_000;

    #[test]
    fn readings_land_in_half_open_windows() {
        let mut agg = Aggregator::new(vec![gpu(0)], Duration::from_secs(1), Duration::from_millis(200));
        let mut r = Readings::default();
        // (9, 10] gets 10.0 exactly; 10.000001 belongs to (10, 11].
        r.push(0, Field::GpuUtil, 1.0, UnixMicros(10 * S));
        r.push(0, Field::GpuUtil, 0.0, UnixMicros(9 * S + 500_000));
        r.push(0, Field::GpuUtil, 0.5, UnixMicros(10 * S + 1));
        agg.add(&r, UnixMicros(10 * S));
        assert!(agg.close_due(UnixMicros(10 * S + 199_999)).is_empty());
        let rows = agg.close_due(UnixMicros(10 * S + 200_000));
        assert_eq!(rows.len(), 1);
        let s = rows[0].get(Field::GpuUtil).copied().expect("has util");
        assert_eq!(rows[0].time, UnixMicros(10 * S));
        assert_eq!((s.count, s.mean, s.min, s.max, s.last), (2, 0.5, 0.0, 1.0, 1.0));
        assert_eq!(rows[0].value(Field::PowerWatts), None, "no reading is NULL, not 0");
    }

    #[test]
    fn late_readings_are_counted_not_reopened() {
        let mut agg = Aggregator::new(vec![gpu(0)], Duration::from_secs(1), Duration::ZERO);
        let mut r = Readings::default();
        r.push(0, Field::PowerWatts, 100.0, UnixMicros(5 * S));
        agg.add(&r, UnixMicros(5 * S));
        assert_eq!(agg.close_due(UnixMicros(5 * S)).len(), 1);
        agg.add(&r, UnixMicros(6 * S));
        assert_eq!(agg.late_readings(), 1);
        assert!(agg.close_due(UnixMicros(100 * S)).is_empty());
    }

    #[test]
    fn lost_gpu_yields_a_row_without_values() {
        let mut agg = Aggregator::new(vec![gpu(0), gpu(1)], Duration::from_secs(1), Duration::ZERO);
        let mut r = Readings::default();
        r.push(0, Field::PowerWatts, 100.0, UnixMicros(3 * S - 10));
        r.lost(1);
        agg.add(&r, UnixMicros(3 * S - 10));
        let rows = agg.close_due(UnixMicros(3 * S));
        assert_eq!(rows.len(), 2);
        assert!(!rows[0].lost);
        assert!(rows[1].lost && rows[1].fields.iter().all(Option::is_none));
    }

    #[test]
    fn the_window_the_agent_starts_in_is_not_emitted() {
        let mut agg =
            Aggregator::new(vec![gpu(0)], Duration::from_secs(1), Duration::ZERO).starting_at(UnixMicros(S + 300_000));
        let mut r = Readings::default();
        r.push(0, Field::PowerWatts, 100.0, UnixMicros(S + 400_000));
        r.push(0, Field::PowerWatts, 100.0, UnixMicros(2 * S + 400_000));
        agg.add(&r, UnixMicros(2 * S + 400_000));
        let rows = agg.close_due(UnixMicros(3 * S));
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].time, UnixMicros(3 * S));
    }

    #[test]
    fn windows_carry_the_latest_owner() {
        let mut agg = Aggregator::new(vec![gpu(0), gpu(1)], Duration::from_secs(1), Duration::ZERO);
        let mut r = Readings::default();
        r.push(0, Field::PowerWatts, 100.0, UnixMicros(S - 10));
        r.push(1, Field::PowerWatts, 100.0, UnixMicros(S - 10));
        agg.add(&r, UnixMicros(S - 10));
        let holder = GpuHolder::pod(Some("ns".into()), Some("p".into()), None);
        agg.set_owners(vec![Some(holder.clone()), None]);
        let rows = agg.close_due(UnixMicros(S));
        assert_eq!(rows[0].owner, Some(holder));
        assert_eq!(rows[1].owner, None, "nobody holds GPU 1");
    }

    #[test]
    fn last_is_by_time_not_arrival() {
        let mut agg = Aggregator::new(vec![gpu(0)], Duration::from_secs(1), Duration::ZERO);
        let mut r = Readings::default();
        r.push(0, Field::EnergyJoules, 20.0, UnixMicros(S - 100));
        r.push(0, Field::EnergyJoules, 10.0, UnixMicros(S - 900_000));
        agg.add(&r, UnixMicros(S));
        let rows = agg.close_due(UnixMicros(S));
        assert_eq!(rows[0].value(Field::EnergyJoules), Some(20.0));
    }
}
