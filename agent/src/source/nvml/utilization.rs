//! Utilisation from the driver's sample buffer (`nvmlDeviceGetSamples`).
//!
//! The driver records a utilisation sample every sample period (1/6 s to 1 s by
//! product), each the busy fraction of the period ending at its timestamp. Reading the
//! buffer with the last-seen timestamp returns every sample since the previous read, so
//! activity between polls is not lost — unlike a point read of
//! `nvmlDeviceGetUtilizationRates`, which is what dcgm-exporter serves every 30 s.
//!
//! An idle GPU's buffer goes empty (the driver records nothing, and answers NOT_FOUND):
//! that means 0, not missing. So the sampler tracks the driver's period and fills the
//! slots the driver skipped with zeros, up to one period before now (a later slot may
//! still be recorded). Where the buffer is unsupported it falls back to the point read.
//! MIG instances have no utilisation in NVML; GPM gives their activity.

use std::sync::Arc;
use std::time::Duration;

use apron_common::{Field, UnixMicros};
use nvml_wrapper::enum_wrappers::device::Sampling;
use nvml_wrapper::error::NvmlError;

use super::thermal::sample_value;
use super::{Guard, NvmlShared, Outcome};
use crate::sampler::{FieldGroup, Readings, Sampler, SamplerError, Slot};

/// The period real drivers use on data-centre parts, until samples show otherwise.
const DEFAULT_PERIOD_US: i64 = 166_667;
const MIN_PERIOD_US: i64 = 10_000;
const MAX_PERIOD_US: i64 = 1_000_000;

/// Per (GPU, buffer) bookkeeping.
#[derive(Clone, Copy, Debug)]
pub struct BufferCursor {
    /// Timestamp of the newest sample taken (µs), passed back as lastSeenTimeStamp.
    last_seen: i64,
    /// Every slot up to here has a reading (real or zero-filled).
    filled_until: i64,
    /// The driver's sample period: the smallest gap between recent real samples (busy
    /// stretches record every period; idle stretches leave multiples of it).
    period: i64,
    gaps: [i64; 16],
    gap_next: usize,
    /// `last_seen` is a real sample's timestamp, not the start time.
    seen_real: bool,
}

impl BufferCursor {
    /// A cursor whose zero-fill grid continues the driver's: `newest` is the newest
    /// sample already in the buffer at start (if any), whose timestamp fixes the grid's
    /// phase. Without it the first zero-filled slots would sit off the driver's grid and a
    /// window could count one slot twice when activity starts.
    pub fn anchored(start: UnixMicros, newest: Option<i64>) -> Self {
        let mut c = Self::new(start);
        if let Some(ts) = newest.filter(|&ts| ts <= start.0) {
            let p = c.period;
            c.filled_until = ts + (start.0 - ts) / p * p;
            c.last_seen = ts;
        }
        c
    }

    pub fn new(start: UnixMicros) -> Self {
        Self {
            last_seen: start.0,
            filled_until: start.0,
            period: DEFAULT_PERIOD_US,
            gaps: [0; 16],
            gap_next: 0,
            seen_real: false,
        }
    }

    /// The lastSeenTimeStamp to ask the driver with: past every slot already accounted
    /// for, real or zero-filled. A slot is only zero-filled a full period after it ends,
    /// when the driver would long have recorded it, so nothing real is skipped — and an
    /// idle GPU's buffer is not re-read from the start on every tick.
    pub fn query_from(&self) -> u64 {
        u64::try_from(self.last_seen.max(self.filled_until)).unwrap_or(0)
    }

    /// Takes new samples `(timestamp µs, value as a ratio)`, oldest first, plus zeros for
    /// the periods the driver skipped because the GPU was idle; emits readings in order.
    pub fn take(&mut self, samples: &[(i64, f64)], now: UnixMicros, mut emit: impl FnMut(i64, f64)) {
        for &(ts, v) in samples {
            if ts <= self.last_seen.max(self.filled_until) {
                continue;
            }
            if self.seen_real {
                self.learn(ts - self.last_seen);
            }
            self.seen_real = true;
            self.fill_zeros(ts - self.period / 2, &mut emit);
            emit(ts, v);
            self.last_seen = ts;
            self.filled_until = ts;
        }
        // Whatever the driver has not recorded by one period ago, it skipped: idle.
        self.fill_zeros(now.0 - self.period, &mut emit);
    }

    fn learn(&mut self, gap: i64) {
        if !(MIN_PERIOD_US..=MAX_PERIOD_US + MAX_PERIOD_US / 10).contains(&gap) {
            return;
        }
        self.gaps[self.gap_next % self.gaps.len()] = gap;
        self.gap_next += 1;
        if let Some(min) = self.gaps.iter().copied().filter(|&g| g > 0).min() {
            self.period = min.clamp(MIN_PERIOD_US, MAX_PERIOD_US);
        }
    }

    fn fill_zeros(&mut self, until: i64, emit: &mut impl FnMut(i64, f64)) {
        while self.filled_until + self.period <= until {
            self.filled_until += self.period;
            emit(self.filled_until, 0.0);
        }
    }
}

/// (wrapper enum, `nvmlSamplingType_t`, field, call name).
const BUFFERS: [(Sampling, u32, Field, &str); 4] = [
    (Sampling::GpuUtilization, 1, Field::GpuUtil, "nvmlDeviceGetSamples(GPU_UTILIZATION)"),
    (Sampling::MemoryUtilization, 2, Field::MemCopyUtil, "nvmlDeviceGetSamples(MEMORY_UTILIZATION)"),
    (Sampling::EncoderUtilization, 3, Field::EncUtil, "nvmlDeviceGetSamples(ENC_UTILIZATION)"),
    (Sampling::DecoderUtilization, 4, Field::DecUtil, "nvmlDeviceGetSamples(DEC_UTILIZATION)"),
];

pub struct UtilizationSampler {
    shared: Arc<NvmlShared>,
    guard: Guard,
    cursors: Vec<[Option<BufferCursor>; 4]>,
    samples: Vec<(i64, f64)>,
    /// Reused driver buffer for the raw call.
    buf: Vec<nvml_wrapper_sys::bindings::nvmlSample_t>,
    /// When the secondary buffers (memory, encoder, decoder) were last drained.
    secondary_at: Option<UnixMicros>,
}

/// The memory-copy, encoder and decoder buffers are drained once per window, this long
/// after each window end: by then the driver has recorded (or, idle, skipped) every slot
/// of the window that ended, and the window is still open (it closes later, see
/// `lateness` in lib.rs). They are buffers, about 20 s deep, so nothing is lost; it saves
/// three calls per GPU on most ticks. `gpu_util` — the idle signal — is drained every tick.
const SECONDARY_DELAY_US: i64 = 350_000;

/// Whether a drain point `k × window + delay` lies in `(last, now]`. Windows under a
/// second drain every tick.
fn secondary_due(last: Option<UnixMicros>, now: UnixMicros, window: Duration) -> bool {
    let w = i64::try_from(window.as_micros()).unwrap_or(i64::MAX);
    let Some(last) = last else { return true };
    if w < 1_000_000 {
        return true;
    }
    let latest_point = (now.0 - SECONDARY_DELAY_US).div_euclid(w) * w + SECONDARY_DELAY_US;
    last.0 < latest_point
}

impl UtilizationSampler {
    pub fn new(shared: Arc<NvmlShared>) -> Self {
        let n = shared.gpus.len();
        Self {
            shared,
            guard: Guard::default(),
            cursors: vec![[None; 4]; n],
            samples: Vec::new(),
            buf: Vec::new(),
            secondary_at: None,
        }
    }

    /// The point read, for drivers or devices without the sample buffer.
    fn fallback(&mut self, slot: Slot, now: UnixMicros, out: &mut Readings) {
        let gpu = &self.shared.gpus[slot];
        if let Some(u) = self.guard.call(slot, "nvmlDeviceGetUtilizationRates", out, || gpu.device.utilization_rates())
        {
            out.push(slot, Field::GpuUtil, f64::from(u.gpu) / 100.0, now);
            out.push(slot, Field::MemCopyUtil, f64::from(u.memory) / 100.0, now);
        }
    }
}

impl Sampler for UtilizationSampler {
    fn group(&self) -> FieldGroup {
        FieldGroup::Utilization
    }

    fn sample(&mut self, now: UnixMicros, out: &mut Readings) -> Result<(), SamplerError> {
        let secondary = secondary_due(self.secondary_at, now, self.shared.window);
        if secondary {
            self.secondary_at = Some(now);
        }
        for slot in 0..self.shared.gpus.len() {
            let gpu = &self.shared.gpus[slot];
            if gpu.is_mig_instance() {
                continue;
            }
            let mut buffer_ok = false;
            for (i, (sampling, raw_type, field, what)) in BUFFERS.into_iter().enumerate() {
                if !self.guard.supported(slot, what) || (i > 0 && !secondary) {
                    continue;
                }
                if self.cursors[slot][i].is_none() {
                    // The whole buffer once, only to learn the driver's grid phase.
                    // SAFETY: the handle is live for the life of the process.
                    let newest = match &self.shared.raw {
                        Some(raw) => unsafe {
                            raw.samples_into(gpu.device.handle(), raw_type, 0, &mut self.buf, &mut self.samples)
                        }
                        .ok()
                        .and_then(|()| self.samples.iter().map(|s| s.0).max()),
                        None => None,
                    };
                    self.cursors[slot][i] = Some(BufferCursor::anchored(now, newest));
                }
                let Some(cursor) = self.cursors[slot][i].as_mut() else { continue };
                let from = cursor.query_from();
                let result = match &self.shared.raw {
                    // One call into a reused buffer instead of count-then-fill.
                    // SAFETY: the handle is live for the life of the process.
                    Some(raw) => unsafe {
                        raw.samples_into(gpu.device.handle(), raw_type, from, &mut self.buf, &mut self.samples)
                    },
                    None => gpu.device.samples(sampling, from).map(|samples| {
                        self.samples.clear();
                        self.samples.extend(samples.iter().map(|s| (s.timestamp as i64, sample_value(&s.value))));
                    }),
                };
                match result {
                    Ok(()) => {
                        for s in &mut self.samples {
                            s.1 /= 100.0;
                        }
                        self.samples.sort_by_key(|s| s.0);
                    }
                    // NOT_FOUND: nothing new since last seen — an idle GPU.
                    Err(NvmlError::NotFound) => self.samples.clear(),
                    Err(e) => {
                        if self.guard.record(slot, what, out, &e) == Outcome::Lost {
                            break;
                        }
                        continue;
                    }
                }
                if i == 0 {
                    buffer_ok = true;
                }
                cursor.take(&self.samples, now, |ts, v| out.push(slot, field, v, UnixMicros(ts)));
            }
            if !buffer_ok && !out.lost.contains(&slot) && !self.guard.supported(slot, BUFFERS[0].3) {
                self.fallback(slot, now, out);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(cursor: &mut BufferCursor, samples: &[(i64, f64)], now: i64) -> Vec<(i64, f64)> {
        let mut v = Vec::new();
        cursor.take(samples, UnixMicros(now), |t, x| v.push((t, x)));
        v
    }

    #[test]
    fn idle_buffer_reads_as_zeros_on_the_driver_grid() {
        let p = DEFAULT_PERIOD_US;
        let mut c = BufferCursor::new(UnixMicros(0));
        // One second with nothing recorded: the slots ending at or before now − period
        // are certainly skipped (4 of them); the last two may still be recorded.
        let out = run(&mut c, &[], 1_000_000);
        assert_eq!(out.len(), 4);
        assert!(out.iter().all(|&(_, v)| v == 0.0));
        assert_eq!(out[0].0, p);
    }

    #[test]
    fn real_samples_pass_through_and_gaps_fill() {
        let p = DEFAULT_PERIOD_US;
        let mut c = BufferCursor::new(UnixMicros(0));
        let out = run(&mut c, &[(p, 1.0), (2 * p, 0.5), (5 * p, 1.0)], 5 * p + 10);
        // p, 2p real; 3p, 4p zero-filled; 5p real.
        assert_eq!(out, vec![(p, 1.0), (2 * p, 0.5), (3 * p, 0.0), (4 * p, 0.0), (5 * p, 1.0)]);
        // Re-reading the same samples yields nothing new.
        assert!(run(&mut c, &[(5 * p, 1.0)], 5 * p + 20).is_empty());
    }

    #[test]
    fn secondary_buffers_drain_once_per_window_after_its_end() {
        let w = Duration::from_secs(1);
        let at = |ms: i64| UnixMicros(10_000_000 + ms * 1000);
        assert!(secondary_due(None, at(0), w));
        assert!(!secondary_due(Some(at(350)), at(450), w));
        assert!(!secondary_due(Some(at(350)), at(1349), w));
        assert!(secondary_due(Some(at(350)), at(1350), w));
        assert!(secondary_due(Some(at(900)), at(1400), w), "the first tick past the drain point");
        assert!(secondary_due(Some(at(0)), at(100), Duration::from_millis(500)), "short windows drain every tick");
    }

    #[test]
    fn anchored_cursor_fills_on_the_driver_grid() {
        let p = DEFAULT_PERIOD_US;
        // The newest buffered sample was at 3p; the agent starts at 10p + 5.
        let mut c = BufferCursor::anchored(UnixMicros(10 * p + 5), Some(3 * p));
        let out = run(&mut c, &[], 13 * p + 10);
        assert_eq!(out, vec![(11 * p, 0.0), (12 * p, 0.0)]);
    }

    #[test]
    fn learns_a_slower_period() {
        let mut c = BufferCursor::new(UnixMicros(0));
        let mut t = 0;
        for _ in 0..40 {
            t += 1_000_000;
            let _ = run(&mut c, &[(t, 0.3)], t + 1);
        }
        assert!((c.period - 1_000_000).abs() < 50_000, "period {}", c.period);
        // With a 1 s driver period, a 0.5 s silence is not an idle slot yet.
        assert!(run(&mut c, &[], t + 500_000).is_empty());
    }
}
