//! DCGM-style profiling fields through NVML GPM (Hopper and newer).
//!
//! GPM metrics are computed by the driver from two samples: each tick takes a new
//! sample and asks for the metrics between it and the previous one, so each reading is
//! the mean over the tick (≥ 100 ms apart: NVML's internal refresh rate). MIG instances
//! are sampled through their parent with `nvmlGpmMigSampleGet`. Devices without GPM
//! (Ampere and older) leave these fields NULL.

use std::sync::Arc;

use apron_common::{Field, UnixMicros};
use nvml_wrapper::enums::gpm::GpmMetricId;
use nvml_wrapper::gpm::{GpmSample, gpm_metrics_get};

use super::{Guard, NvmlShared};
use crate::sampler::{FieldGroup, Phase, Readings, Sampler, SamplerError};

const MIB: f64 = 1024.0 * 1024.0;

/// GPM metric → field and scale to base units (GPM reports utilisation in percent and
/// bandwidth in MiB/s).
const METRICS: &[(GpmMetricId, Field, f64)] = &[
    (GpmMetricId::GraphicsUtil, Field::GrEngineActive, 0.01),
    (GpmMetricId::SmUtil, Field::SmActive, 0.01),
    (GpmMetricId::SmOccupancy, Field::SmOccupancy, 0.01),
    (GpmMetricId::AnyTensorUtil, Field::TensorActive, 0.01),
    (GpmMetricId::DramBwUtil, Field::DramActive, 0.01),
    (GpmMetricId::Fp64Util, Field::Fp64Active, 0.01),
    (GpmMetricId::Fp32Util, Field::Fp32Active, 0.01),
    (GpmMetricId::Fp16Util, Field::Fp16Active, 0.01),
    (GpmMetricId::PcieTxPerSec, Field::PcieTxBytesPerS, MIB),
    (GpmMetricId::PcieRxPerSec, Field::PcieRxBytesPerS, MIB),
    (GpmMetricId::NvlinkTotalTxPerSec, Field::NvlinkTxBytesPerS, MIB),
    (GpmMetricId::NvlinkTotalRxPerSec, Field::NvlinkRxBytesPerS, MIB),
];

/// Less than this apart, the driver's counters have not refreshed.
const MIN_SPACING_US: i64 = 100_000;

/// The middle of `(from, to]`, where a reading that describes that interval belongs.
pub fn midpoint(from: UnixMicros, to: UnixMicros) -> UnixMicros {
    UnixMicros(from.0 + (to.0 - from.0) / 2)
}

/// The last sample of a GPU and when it was taken, plus a spare sample to refill next.
struct Baseline {
    sample: GpmSample<'static>,
    at: UnixMicros,
    spare: Option<GpmSample<'static>>,
}

pub struct GpmSampler {
    shared: Arc<NvmlShared>,
    guard: Guard,
    previous: Vec<Option<Baseline>>,
    ids: Vec<GpmMetricId>,
    /// The same ids as NVML numbers, for the raw call.
    raw_ids: Vec<u32>,
    /// Reused result buffer.
    values: Vec<Result<f64, nvml_wrapper::error::NvmlError>>,
    /// Support found missing at start, reported with the first tick.
    startup_issues: Vec<crate::sampler::Issue>,
}

impl GpmSampler {
    pub fn new(shared: Arc<NvmlShared>) -> Self {
        let n = shared.gpus.len();
        let mut guard = Guard::default();
        let mut probe = Readings::default();
        for (slot, gpu) in shared.slots() {
            let device = gpu.mig_parent.as_ref().map_or(&gpu.device, |(p, _)| p);
            let supported = guard.call(slot, "nvmlGpmQueryDeviceSupport", &mut probe, || device.gpm_support());
            if supported == Some(false) {
                // GPM needs Hopper or newer.
                guard.record(
                    slot,
                    "nvmlGpmQueryDeviceSupport",
                    &mut probe,
                    &nvml_wrapper::error::NvmlError::NotSupported,
                );
            }
        }
        Self {
            shared,
            guard,
            previous: (0..n).map(|_| None).collect(),
            ids: METRICS.iter().map(|m| m.0).collect(),
            raw_ids: METRICS.iter().map(|m| m.0.as_c()).collect(),
            values: Vec::with_capacity(METRICS.len()),
            startup_issues: probe.issues,
        }
    }
}

impl Sampler for GpmSampler {
    fn group(&self) -> FieldGroup {
        FieldGroup::Gpm
    }

    fn phase(&self) -> Phase {
        Phase::Boundary
    }

    fn sample(&mut self, now: UnixMicros, out: &mut Readings) -> Result<(), SamplerError> {
        let nvml = self.shared.nvml;
        out.issues.append(&mut self.startup_issues);
        for (slot, gpu) in self.shared.slots() {
            if !self.guard.supported(slot, "nvmlGpmQueryDeviceSupport") {
                continue;
            }
            // Refill the spare sample when there is one (no allocation per tick); the
            // wrapper allocates a fresh one otherwise.
            let spare = self.previous[slot].as_mut().and_then(|p| p.spare.take());
            let sample = match (spare, &self.shared.raw) {
                (Some(spare), Some(raw)) => {
                    let (device, gi) = match &gpu.mig_parent {
                        Some((parent, gi)) => (parent, Some(*gi)),
                        None => (&gpu.device, None),
                    };
                    // SAFETY: live handles from this NVML; `spare` was allocated by it.
                    let filled = unsafe { raw.gpm_sample_into(device.handle(), gi, spare.handle()) };
                    match filled {
                        Ok(()) => Some(spare),
                        Err(e) => {
                            self.guard.record(slot, "nvmlGpmSampleGet", out, &e);
                            None
                        }
                    }
                }
                _ => match &gpu.mig_parent {
                    Some((parent, gi)) => {
                        self.guard.call(slot, "nvmlGpmMigSampleGet", out, || parent.gpm_mig_sample(*gi))
                    }
                    None => self.guard.call(slot, "nvmlGpmSampleGet", out, || gpu.device.gpm_sample()),
                },
            };
            let Some(sample) = sample else {
                self.previous[slot] = None;
                continue;
            };
            let Some(Baseline { sample: prev, at: prev_at, .. }) = self.previous[slot].take() else {
                self.previous[slot] = Some(Baseline { sample, at: now, spare: None });
                continue;
            };
            if now.0 - prev_at.0 < MIN_SPACING_US {
                // Too soon (a delayed tick); keep the older sample as the baseline.
                self.previous[slot] = Some(Baseline { sample: prev, at: prev_at, spare: Some(sample) });
                continue;
            }
            let results = match &self.shared.raw {
                // SAFETY: both samples are live and filled, allocated by this NVML.
                Some(raw) => self.guard.call(slot, "nvmlGpmMetricsGet", out, || unsafe {
                    raw.gpm_metrics_into(prev.handle(), sample.handle(), &self.raw_ids, &mut self.values)
                        .map(|()| std::mem::take(&mut self.values))
                }),
                None => {
                    let ids = &self.ids;
                    self.guard.call(slot, "nvmlGpmMetricsGet", out, || {
                        gpm_metrics_get(nvml, &prev, &sample, ids)
                            .map(|v| v.into_iter().map(|r| r.map(|m| m.value)).collect::<Vec<_>>())
                    })
                }
            };
            if let Some(results) = results {
                // The values are means over (prev, now]: they belong at its midpoint.
                let at = midpoint(prev_at, now);
                for (result, &(_, field, scale)) in results.iter().zip(METRICS) {
                    // A metric the device lacks (e.g. NVLink on a PCIe card) stays NULL.
                    if let Ok(v) = result {
                        out.push(slot, field, v * scale, at);
                    }
                }
                self.values = results;
            }
            self.previous[slot] = Some(Baseline { sample, at: now, spare: Some(prev) });
        }
        Ok(())
    }
}
