//! `apron-agent probe`: what this driver and these GPUs support, and what each NVML
//! call costs.
//!
//! Every call the samplers make is tried on every GPU a few times; the report gives the
//! outcome (ok or the NVML error) and the wall time per call. It is the first thing to
//! run on a new fleet, and how `docs/hardware.md` was produced.

use std::time::{Duration, Instant};

use nvml_wrapper::enum_wrappers::device::{
    Clock, EccCounter, MemoryError, PcieUtilCounter, Sampling, TemperatureSensor,
};
use nvml_wrapper::enums::gpm::GpmMetricId;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::gpm::gpm_metrics_get;
use nvml_wrapper::structs::device::FieldId;
use nvml_wrapper_sys::bindings::field_id::NVML_FI_DEV_MEMORY_TEMP;
use serde::Serialize;

use super::{NvmlGpu, NvmlSource};

/// One call on one GPU.
#[derive(Debug, Clone, Serialize)]
pub struct CallReport {
    pub gpu_uuid: String,
    pub call: &'static str,
    /// `ok`, or the NVML error.
    pub outcome: String,
    pub calls: u32,
    pub mean_us: f64,
    pub min_us: f64,
    /// A short rendering of the value, for a human reading the report.
    pub value: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct ProbeReport {
    pub driver_version: Option<String>,
    pub gpus: Vec<apron_common::GpuIdentity>,
    pub calls: Vec<CallReport>,
}

fn time<T: std::fmt::Debug>(
    gpu: &NvmlGpu,
    call: &'static str,
    repeats: u32,
    mut f: impl FnMut() -> Result<T, NvmlError>,
) -> CallReport {
    let (mut total, mut min) = (Duration::ZERO, Duration::MAX);
    let mut last = None;
    for _ in 0..repeats {
        let t = Instant::now();
        let r = f();
        let d = t.elapsed();
        total += d;
        min = min.min(d);
        let stop = r.is_err();
        last = Some(r);
        if stop {
            break;
        }
    }
    let calls = repeats.max(1);
    let (outcome, value) = match last {
        Some(Ok(v)) => ("ok".to_owned(), truncate(format!("{v:?}"))),
        Some(Err(e)) => (e.to_string(), String::new()),
        None => ("not run".to_owned(), String::new()),
    };
    CallReport {
        gpu_uuid: gpu.identity.gpu_uuid.to_string(),
        call,
        outcome,
        calls,
        mean_us: total.as_secs_f64() * 1e6 / f64::from(calls),
        min_us: min.as_secs_f64() * 1e6,
        value,
    }
}

fn truncate(mut s: String) -> String {
    if s.len() > 120 {
        let mut cut = 117;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push_str("...");
    }
    s
}

/// Runs every sampler call `repeats` times on every GPU and MIG instance.
pub fn probe(source: &NvmlSource, repeats: u32) -> ProbeReport {
    let shared = &source.shared;
    let nvml = shared.nvml;
    let mut calls = Vec::new();
    for gpu in &shared.gpus {
        let d = &gpu.device;
        let mut c = |r: CallReport| calls.push(r);
        c(time(gpu, "nvmlDeviceGetSamples(GPU_UTILIZATION)", repeats, || {
            d.samples(Sampling::GpuUtilization, None).map(|s| s.len())
        }));
        c(time(gpu, "nvmlDeviceGetUtilizationRates", repeats, || d.utilization_rates().map(|u| (u.gpu, u.memory))));
        c(time(gpu, "nvmlDeviceGetEncoderUtilization", repeats, || d.encoder_utilization().map(|u| u.utilization)));
        c(time(gpu, "nvmlDeviceGetMemoryInfo", repeats, || d.memory_info().map(|m| (m.used, m.total))));
        c(time(gpu, "nvmlDeviceGetPowerUsage", repeats, || d.power_usage()));
        c(time(gpu, "nvmlDeviceGetTotalEnergyConsumption", repeats, || d.total_energy_consumption()));
        c(time(gpu, "nvmlDeviceGetTemperature", repeats, || d.temperature(TemperatureSensor::Gpu)));
        c(time(gpu, "nvmlDeviceGetFieldValues(MEMORY_TEMP)", repeats, || {
            d.field_values_for(&[FieldId(NVML_FI_DEV_MEMORY_TEMP)])
                .and_then(|v| v.into_iter().next().ok_or(NvmlError::Unknown)?)
                .and_then(|s| s.value)
        }));
        c(time(gpu, "nvmlDeviceGetClockInfo(SM)", repeats, || d.clock_info(Clock::SM)));
        c(time(gpu, "nvmlDeviceGetCurrentClocksThrottleReasons", repeats, || {
            d.current_throttle_reasons().map(|r| r.bits())
        }));
        c(time(gpu, "nvmlDeviceGetPcieThroughput(TX)", repeats.min(3), || d.pcie_throughput(PcieUtilCounter::Send)));
        c(time(gpu, "nvmlDeviceGetTotalEccErrors", repeats, || {
            d.total_ecc_errors(MemoryError::Corrected, EccCounter::Aggregate)
        }));
        c(time(gpu, "nvmlDeviceGetPcieReplayCounter", repeats, || d.pcie_replay_counter()));
        if let Some(raw) = &shared.raw {
            // SAFETY: the handle is live for the life of the process.
            c(time(gpu, "nvmlDeviceGetRemappedRows", repeats, || unsafe { raw.remapped_rows(d.handle()) }));
        }
        c(time(gpu, "nvmlDeviceGetComputeRunningProcesses", repeats, || {
            d.running_compute_processes().map(|p| p.len())
        }));
        c(time(gpu, "nvmlDeviceGetProcessUtilization", repeats, || d.process_utilization_stats(None).map(|p| p.len())));
        c(time(gpu, "nvmlDeviceGetMigMode", 1, || d.mig_mode().map(|m| (m.current, m.pending))));
        let gpm_device = gpu.mig_parent.as_ref().map_or(d, |(p, _)| p);
        c(time(gpu, "nvmlGpmQueryDeviceSupport", 1, || gpm_device.gpm_support()));
        let sample = || match &gpu.mig_parent {
            Some((parent, gi)) => parent.gpm_mig_sample(*gi),
            None => d.gpm_sample(),
        };
        let first = sample();
        c(time(gpu, "nvmlGpmSampleGet", 1, || first.as_ref().map(|_| ()).map_err(clone_err)));
        if let Ok(first) = first {
            std::thread::sleep(Duration::from_millis(120));
            if let Ok(second) = sample() {
                let ids = [
                    GpmMetricId::SmUtil,
                    GpmMetricId::SmOccupancy,
                    GpmMetricId::AnyTensorUtil,
                    GpmMetricId::DramBwUtil,
                ];
                c(time(gpu, "nvmlGpmMetricsGet", 1, || {
                    gpm_metrics_get(nvml, &first, &second, &ids).map(|v| {
                        v.into_iter()
                            .map(|r| r.map(|m| (m.value * 100.0).round() / 100.0).map_err(|e| e.to_string()))
                            .collect::<Vec<_>>()
                    })
                }));
            }
        }
    }
    ProbeReport { driver_version: source.driver_version.clone(), gpus: source.inventory.clone(), calls }
}

/// NvmlError is not Clone; the probe only needs its text and kind.
fn clone_err(e: &NvmlError) -> NvmlError {
    match e {
        NvmlError::NotSupported => NvmlError::NotSupported,
        NvmlError::GpuLost => NvmlError::GpuLost,
        NvmlError::FailedToLoadSymbol(s) => NvmlError::FailedToLoadSymbol(s.clone()),
        NvmlError::NoPermission => NvmlError::NoPermission,
        _ => NvmlError::Unknown,
    }
}

/// The report as an aligned text table.
pub fn render_table(report: &ProbeReport) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(out, "driver {}", report.driver_version.as_deref().unwrap_or("?"));
    for g in &report.gpus {
        let _ = writeln!(
            out,
            "gpu {} {} {}{}",
            g.gpu_index,
            g.gpu_uuid,
            g.gpu_model,
            g.mig_profile.as_ref().map(|p| format!(" MIG {p}")).unwrap_or_default()
        );
    }
    let _ = writeln!(out, "\n{:<44} {:<44} {:>10} {:>10}  outcome / value", "gpu", "call", "mean µs", "min µs");
    for c in &report.calls {
        let what = if c.outcome == "ok" { c.value.clone() } else { c.outcome.clone() };
        let _ = writeln!(out, "{:<44} {:<44} {:>10.1} {:>10.1}  {}", c.gpu_uuid, c.call, c.mean_us, c.min_us, what);
    }
    out
}
