//! The driver behaviours being modelled, as plain functions of (model, time):
//! the utilisation sample ring buffer, memory accounting, counters and GPM.
//! The FFI layer only validates arguments and copies these results out.

use crate::codes::{self, Ret};
use crate::model::{GpuModel, MIB, MIG_MAX_SLICES, MigModel, ProcModel};
use crate::state::Dev;
use crate::timeline::{M, NS_PER_S, Timeline};

/// PCIe throughput is measured by the driver over a 20 ms window per direction.
pub const PCIE_WINDOW_NS: i64 = 20_000_000;
/// "The interval between two nvmlGpmSampleGet() calls should be greater than 100ms
/// due to the internal sample refresh rate" (nvml.h).
pub const GPM_MIN_INTERVAL_NS: i64 = 100_000_000;

/// The sample grid: the driver records sample `k` at `k × period` (µs since the
/// epoch), and its value is the mean over the period that ends there.
#[derive(Debug, Clone, Copy)]
pub struct Grid {
    period_us: i64,
    depth: i64,
}

impl Grid {
    pub fn of(gpu: &GpuModel) -> Grid {
        Grid {
            period_us: i64::try_from(gpu.sample_period_us).unwrap_or(i64::MAX / 2_000),
            depth: i64::from(gpu.sample_buffer_depth),
        }
    }

    pub fn period_us(&self) -> i64 {
        self.period_us
    }

    /// The latest recorded sample at `now` (ns).
    pub fn last(&self, now: i64) -> i64 {
        now.div_euclid(self.period_us * 1_000)
    }

    /// The samples still in the ring buffer with a timestamp after `last_seen_us`,
    /// oldest first.
    pub fn newer_than(&self, now: i64, last_seen_us: u64) -> std::ops::RangeInclusive<i64> {
        let last = self.last(now);
        let oldest = last - self.depth + 1;
        let after = i64::try_from(last_seen_us).map_or(i64::MAX, |ts| ts / self.period_us + 1);
        oldest.max(after)..=last
    }

    pub fn timestamp_us(&self, k: i64) -> u64 {
        u64::try_from(k * self.period_us).unwrap_or(0)
    }

    /// `[start, end]` in ns of the period sample `k` averages.
    pub fn span(&self, k: i64) -> (i64, i64) {
        let end = k * self.period_us * 1_000;
        (end - self.period_us * 1_000, end)
    }

    pub fn mean(&self, tl: &Timeline, m: M, k: i64) -> f64 {
        let (a, b) = self.span(k);
        tl.mean(m, a, b)
    }
}

/// What a `nvmlDeviceGetSamples` sampling type reads, and whether the driver skips
/// idle periods for it: utilisation buffers record nothing while the engine is
/// idle (they run dry on an idle GPU), power and clock buffers record always.
pub fn sample_source(kind: u32) -> Result<(Option<M>, bool, bool), Ret> {
    // (metric or None for an engine this model never runs, skip idle, utilisation type)
    Ok(match kind {
        0 => (Some(M::PowerW), false, false),
        1 => (Some(M::GpuUtil), true, true),
        2 => (Some(M::MemUtil), true, true),
        3 => (Some(M::EncUtil), true, true),
        4 => (Some(M::DecUtil), true, true),
        5 => (Some(M::SmClock), false, false),
        6 => (Some(M::MemClock), false, false),
        7 => return Err(codes::NOT_SUPPORTED),
        8 | 9 => (None, true, true),
        _ => return Err(codes::INVALID_ARGUMENT),
    })
}

/// The buffered samples of one type newer than `last_seen_us`: (timestamp µs, value).
pub fn samples(dev: &Dev<'_>, kind: u32, now: i64, last_seen_us: u64) -> Result<Vec<(u64, u32)>, Ret> {
    let (metric, skip_idle, is_util) = sample_source(kind)?;
    if is_util {
        dev.utilization_supported()?;
    } else {
        dev.whole_gpu()?;
    }
    let Some(metric) = metric else {
        return Ok(Vec::new());
    };
    let grid = Grid::of(dev.gpu);
    let tl = dev.timeline();
    let scale = if metric == M::PowerW { 1000.0 } else { 1.0 };
    Ok(grid
        .newer_than(now, last_seen_us)
        .filter_map(|k| {
            let v = grid.mean(tl, metric, k) * scale;
            if skip_idle && v < 1e-9 {
                return None;
            }
            Some((grid.timestamp_us(k), v.round() as u32))
        })
        .collect())
}

/// `nvmlDeviceGetUtilizationRates`: the last complete sample period.
pub fn utilization(dev: &Dev<'_>, now: i64) -> Result<(u32, u32), Ret> {
    dev.utilization_supported()?;
    let grid = Grid::of(dev.gpu);
    let k = grid.last(now);
    let tl = dev.timeline();
    Ok((grid.mean(tl, M::GpuUtil, k).round() as u32, grid.mean(tl, M::MemUtil, k).round() as u32))
}

/// One sample per process active in the newest period after `last_seen_us` in which
/// the GPU was busy: (pid, timestamp µs, sm %, mem %).
pub fn process_utilization(dev: &Dev<'_>, now: i64, last_seen_us: u64) -> Result<Vec<(u32, u64, u32, u32)>, Ret> {
    dev.utilization_supported()?;
    let grid = Grid::of(dev.gpu);
    let tl = dev.timeline();
    let busy = grid.newer_than(now, last_seen_us).rev().find_map(|k| {
        let (g, m) = (grid.mean(tl, M::GpuUtil, k), grid.mean(tl, M::MemUtil, k));
        (g > 1e-9 || m > 1e-9).then_some((k, g, m))
    });
    let Some((k, g, m)) = busy else {
        return Ok(Vec::new());
    };
    Ok(dev
        .gpu
        .processes
        .iter()
        .filter(|p| p.sm_share * g > 1e-9 || p.mem_share * m > 1e-9)
        .map(|p| (p.pid, grid.timestamp_us(k), (p.sm_share * g).round() as u32, (p.mem_share * m).round() as u32))
        .collect())
}

fn used_bytes(tl: &Timeline, cap: u64, now: i64) -> u64 {
    ((tl.at(M::FbUsedMib, now) * MIB).round() as u64).min(cap)
}

/// (total, reserved, used) bytes as `nvmlMemory_v2_t` reports them.
pub fn memory(dev: &Dev<'_>, now: i64) -> (u64, u64, u64) {
    match dev.mig {
        Some((_, m)) => (m.memory_bytes, 0, used_bytes(&m.timeline, m.memory_bytes, now)),
        None => {
            let g = dev.gpu;
            let cap = g.total_bytes - g.reserved_bytes;
            // With MIG on, the parent's framebuffer is whatever its instances use.
            let used = if g.mig_mode {
                g.mig.iter().map(|m| used_bytes(&m.timeline, m.memory_bytes, now)).sum::<u64>().min(cap)
            } else {
                used_bytes(&g.timeline, cap, now)
            };
            (g.total_bytes, g.reserved_bytes, used)
        }
    }
}

/// Cumulative ∫ m dt from the epoch to `now`, divided by `unit`, truncated.
pub fn cumulative(tl: &Timeline, m: M, now: i64, unit: f64) -> u64 {
    (tl.integral(m, 0, now) / unit).floor().max(0.0) as u64
}

/// Processes visible through `dev`: its own, and on a MIG parent every instance's
/// (tagged with their GPU/compute instance ids; `u32::MAX` when not on MIG).
pub fn processes(dev: &Dev<'_>) -> Vec<(ProcModel, u32, u32)> {
    match dev.mig {
        Some((_, m)) => m.processes.iter().map(|p| (p.clone(), m.gi_id, m.ci_id)).collect(),
        None => {
            let mut v: Vec<_> = dev.gpu.processes.iter().map(|p| (p.clone(), u32::MAX, u32::MAX)).collect();
            for m in &dev.gpu.mig {
                v.extend(m.processes.iter().map(|p| (p.clone(), m.gi_id, m.ci_id)));
            }
            v
        }
    }
}

pub fn find_mig(gpu: &GpuModel, gi: u32) -> Option<&MigModel> {
    gpu.mig.iter().find(|m| m.gi_id == gi)
}

/// What a GPM metric id measures.
#[derive(Debug, Clone, Copy)]
pub enum GpmKind {
    /// A 0–1 activity ratio, reported ×100 as a percentage.
    Ratio(M),
    /// An engine utilisation already in percent.
    Percent(M),
    /// An engine this model never runs (always 0 %).
    Idle,
    /// A byte rate, reported in MiB/s as nvml.h documents.
    Bytes(M),
    /// One NVLink link's share of a byte rate.
    LinkBytes(M, u32),
}

pub struct GpmInfo {
    pub kind: GpmKind,
    pub short: &'static std::ffi::CStr,
    pub long: &'static std::ffi::CStr,
    pub unit: &'static std::ffi::CStr,
}

pub fn gpm_info(id: u32) -> Option<GpmInfo> {
    use GpmKind::*;
    let (kind, short, long, unit) = match id {
        1 => (Ratio(M::GrActive), c"GRAPHICS_UTIL", c"Graphics engine activity", c"%"),
        2 => (Ratio(M::SmActive), c"SM_UTIL", c"SM activity", c"%"),
        3 => (Ratio(M::SmOccupancy), c"SM_OCCUPANCY", c"SM occupancy", c"%"),
        4 => (Ratio(M::IntActive), c"INTEGER_UTIL", c"Integer pipe activity", c"%"),
        5 => (Ratio(M::TensorActive), c"ANY_TENSOR_UTIL", c"Any tensor pipe activity", c"%"),
        6 => (Ratio(M::TensorDfma), c"DFMA_TENSOR_UTIL", c"DFMA tensor pipe activity", c"%"),
        7 => (Ratio(M::TensorHmma), c"HMMA_TENSOR_UTIL", c"HMMA tensor pipe activity", c"%"),
        9 => (Ratio(M::TensorImma), c"IMMA_TENSOR_UTIL", c"IMMA tensor pipe activity", c"%"),
        10 => (Ratio(M::DramActive), c"DRAM_BW_UTIL", c"DRAM bandwidth utilization", c"%"),
        11 => (Ratio(M::Fp64), c"FP64_UTIL", c"FP64 pipe activity", c"%"),
        12 => (Ratio(M::Fp32), c"FP32_UTIL", c"FP32 pipe activity", c"%"),
        13 => (Ratio(M::Fp16), c"FP16_UTIL", c"FP16 pipe activity", c"%"),
        20 => (Bytes(M::PcieTx), c"PCIE_TX_PER_SEC", c"PCIe traffic from this GPU", c"MiB/sec"),
        21 => (Bytes(M::PcieRx), c"PCIE_RX_PER_SEC", c"PCIe traffic to this GPU", c"MiB/sec"),
        30..=37 => (Percent(M::DecUtil), c"NVDEC_UTIL", c"NVDEC utilization", c"%"),
        40..=47 => (Idle, c"NVJPG_UTIL", c"NVJPG utilization", c"%"),
        50 | 51 => (Idle, c"NVOFA_UTIL", c"NVOFA utilization", c"%"),
        60 => (Bytes(M::NvlinkRx), c"NVLINK_TOTAL_RX_PER_SEC", c"NvLink read bandwidth for all links", c"MiB/sec"),
        61 => (Bytes(M::NvlinkTx), c"NVLINK_TOTAL_TX_PER_SEC", c"NvLink write bandwidth for all links", c"MiB/sec"),
        62..=97 => {
            let link = (id - 62) / 2;
            if id.is_multiple_of(2) {
                (LinkBytes(M::NvlinkRx, link), c"NVLINK_RX_PER_SEC", c"NvLink read bandwidth for one link", c"MiB/sec")
            } else {
                (LinkBytes(M::NvlinkTx, link), c"NVLINK_TX_PER_SEC", c"NvLink write bandwidth for one link", c"MiB/sec")
            }
        }
        _ => return None,
    };
    Some(GpmInfo { kind, short, long, unit })
}

/// One GPM metric between two samples of the same source (`gi` = MIG GPU instance).
pub fn gpm_metric(gpu: &GpuModel, gi: Option<u32>, kind: GpmKind, t1: i64, t2: i64) -> Result<f64, Ret> {
    let secs = (t2 - t1) as f64 / NS_PER_S;
    let mig = match gi {
        Some(id) => Some(find_mig(gpu, id).ok_or(codes::INVALID_ARGUMENT)?),
        None => None,
    };
    // A whole-GPU sample under MIG sees every instance's SMs: activity is the
    // SM-weighted mean over instances (unassigned slices idle). Byte traffic is a
    // device-level quantity on the parent.
    let activity = |m: M| -> f64 {
        match mig {
            Some(inst) => inst.timeline.integral(m, t1, t2),
            None if gpu.mig_mode => gpu
                .mig
                .iter()
                .map(|i| i.timeline.integral(m, t1, t2) * f64::from(i.gi_slices) / f64::from(MIG_MAX_SLICES))
                .sum(),
            None => gpu.timeline.integral(m, t1, t2),
        }
    };
    let traffic = |m: M| -> f64 { mig.map_or(&gpu.timeline, |i| &i.timeline).integral(m, t1, t2) };
    Ok(match kind {
        GpmKind::Ratio(m) => activity(m) / secs * 100.0,
        GpmKind::Percent(m) => activity(m) / secs,
        GpmKind::Idle => 0.0,
        GpmKind::Bytes(m) => traffic(m) / secs / MIB,
        GpmKind::LinkBytes(m, link) => {
            if link >= gpu.nvlink_links {
                return Err(codes::NOT_SUPPORTED);
            }
            traffic(m) / secs / MIB / f64::from(gpu.nvlink_links)
        }
    })
}
