//! Time-varying readings: utilisation, the sample buffer, memory, power, energy,
//! temperature, clocks, PCIe and memory-health counters.

use super::{export, nonnull, out};
use crate::codes;
use crate::driver::{self, Grid, PCIE_WINDOW_NS};
use crate::model::GpuModel;
use crate::timeline::M;
use nvml_wrapper_sys::bindings::{
    nvmlClockId_t, nvmlClockType_t, nvmlDevice_t, nvmlEccCounterType_t, nvmlMemory_t, nvmlMemory_v2_t,
    nvmlMemoryErrorType_t, nvmlPcieUtilCounter_t, nvmlSample_t, nvmlSamplingType_t, nvmlTemperature_v1_t,
    nvmlTemperatureSensors_t, nvmlUtilization_t, nvmlValueType_t,
};
use std::ffi::{c_uint, c_ulonglong};

/// NVML_STRUCT_VERSION(Memory, 2): the size of the struct in the low bits, 2 << 24.
pub const MEMORY_V2_VERSION: u32 = (size_of::<nvmlMemory_v2_t>() as u32) | (2 << 24);
/// NVML_STRUCT_VERSION(Temperature, 1).
pub const TEMPERATURE_V1_VERSION: u32 = (size_of::<nvmlTemperature_v1_t>() as u32) | (1 << 24);
/// NVML_VALUE_TYPE_UNSIGNED_INT.
const VALUE_UINT: nvmlValueType_t = 1;

fn clock(g: &GpuModel, kind: nvmlClockType_t, now: i64) -> Result<u32, codes::Ret> {
    let m = match kind {
        0 | 1 | 3 => M::SmClock,
        2 => M::MemClock,
        _ => return Err(codes::INVALID_ARGUMENT),
    };
    Ok(g.timeline.at(m, now).round() as u32)
}

export! {
    fn nvmlDeviceGetUtilizationRates(device: nvmlDevice_t, utilization: *mut nvmlUtilization_t) [cx] {
        let d = cx.dev(device)?;
        nonnull(utilization)?;
        let (gpu, memory) = driver::utilization(&d, cx.now)?;
        out(utilization, nvmlUtilization_t { gpu, memory })
    }

    fn nvmlDeviceGetEncoderUtilization(device: nvmlDevice_t, utilization: *mut c_uint, period_us: *mut c_uint) [cx] {
        let d = cx.dev(device)?;
        nonnull(utilization)?;
        nonnull(period_us)?;
        d.utilization_supported()?;
        let grid = Grid::of(d.gpu);
        let v = grid.mean(d.timeline(), M::EncUtil, grid.last(cx.now));
        out(utilization, v.round() as u32)?;
        out(period_us, grid.period_us() as u32)
    }

    fn nvmlDeviceGetDecoderUtilization(device: nvmlDevice_t, utilization: *mut c_uint, period_us: *mut c_uint) [cx] {
        let d = cx.dev(device)?;
        nonnull(utilization)?;
        nonnull(period_us)?;
        d.utilization_supported()?;
        let grid = Grid::of(d.gpu);
        let v = grid.mean(d.timeline(), M::DecUtil, grid.last(cx.now));
        out(utilization, v.round() as u32)?;
        out(period_us, grid.period_us() as u32)
    }

    /// The driver's ring buffer. A null `samples` asks for the count and succeeds
    /// (pynvml insists on SUCCESS there); nothing newer than `last_seen` is
    /// NOT_FOUND. A short buffer gets the oldest samples, so a caller that passes
    /// the last timestamp it saw picks up the rest next time.
    fn nvmlDeviceGetSamples(
        device: nvmlDevice_t,
        kind: nvmlSamplingType_t,
        last_seen: c_ulonglong,
        value_type: *mut nvmlValueType_t,
        count: *mut c_uint,
        samples: *mut nvmlSample_t,
    ) [cx] {
        let d = cx.dev(device)?;
        nonnull(value_type)?;
        nonnull(count)?;
        let found = driver::samples(&d, kind, cx.now, last_seen)?;
        if found.is_empty() {
            return Err(codes::NOT_FOUND);
        }
        out(value_type, VALUE_UINT)?;
        if samples.is_null() {
            return out(count, found.len() as c_uint);
        }
        let n = (count.read_unaligned() as usize).min(found.len());
        if n == 0 {
            out(count, found.len() as c_uint)?;
            return Err(codes::INSUFFICIENT_SIZE);
        }
        for (i, (ts, v)) in found.iter().take(n).enumerate() {
            samples.add(i).write_unaligned(nvmlSample_t { timeStamp: *ts, sampleValue: super::fields::uint_value(*v) });
        }
        out(count, n as c_uint)
    }

    /// v1 semantics (since R510): `used` includes the driver-reserved memory.
    fn nvmlDeviceGetMemoryInfo(device: nvmlDevice_t, memory: *mut nvmlMemory_t) [cx] {
        let d = cx.dev(device)?;
        let (total, reserved, used) = driver::memory(&d, cx.now);
        let used = used + reserved;
        out(memory, nvmlMemory_t { total, free: total - used, used })
    }

    fn nvmlDeviceGetMemoryInfo_v2(device: nvmlDevice_t, memory: *mut nvmlMemory_v2_t) [cx] {
        let d = cx.dev(device)?;
        nonnull(memory)?;
        if memory.read_unaligned().version != MEMORY_V2_VERSION {
            return Err(codes::ARGUMENT_VERSION_MISMATCH);
        }
        let (total, reserved, used) = driver::memory(&d, cx.now);
        out(memory, nvmlMemory_v2_t { version: MEMORY_V2_VERSION, total, reserved, free: total - reserved - used, used })
    }

    /// Instantaneous board power at the call, in mW.
    fn nvmlDeviceGetPowerUsage(device: nvmlDevice_t, power: *mut c_uint) [cx] {
        let d = cx.dev(device)?;
        d.whole_gpu()?;
        out(power, (d.gpu.timeline.at(M::PowerW, cx.now) * 1000.0).round() as u32)
    }

    /// mJ: the integral of the power timeline since the epoch, so it agrees with
    /// the power readings exactly.
    fn nvmlDeviceGetTotalEnergyConsumption(device: nvmlDevice_t, energy: *mut c_ulonglong) [cx] {
        let d = cx.dev(device)?;
        d.whole_gpu()?;
        out(energy, driver::cumulative(&d.gpu.timeline, M::PowerW, cx.now, 1e-3))
    }

    fn nvmlDeviceGetTemperature(device: nvmlDevice_t, sensor: nvmlTemperatureSensors_t, temp: *mut c_uint) [cx] {
        let d = cx.dev(device)?;
        d.whole_gpu()?;
        if sensor != 0 {
            return Err(codes::INVALID_ARGUMENT);
        }
        out(temp, d.gpu.timeline.at(M::TempC, cx.now).round() as u32)
    }

    /// The versioned form (R535+); nvitop prefers it when the symbol exists.
    fn nvmlDeviceGetTemperatureV(device: nvmlDevice_t, temperature: *mut nvmlTemperature_v1_t) [cx] {
        let d = cx.dev(device)?;
        d.whole_gpu()?;
        nonnull(temperature)?;
        let req = temperature.read_unaligned();
        if req.version != TEMPERATURE_V1_VERSION {
            return Err(codes::ARGUMENT_VERSION_MISMATCH);
        }
        if req.sensorType != 0 {
            return Err(codes::INVALID_ARGUMENT);
        }
        let t = d.gpu.timeline.at(M::TempC, cx.now).round() as i32;
        out(temperature, nvmlTemperature_v1_t { temperature: t, ..req })
    }

    /// GRAPHICS and SM share a clock domain on compute boards; VIDEO follows it too.
    fn nvmlDeviceGetClockInfo(device: nvmlDevice_t, kind: nvmlClockType_t, mhz: *mut c_uint) [cx] {
        let d = cx.dev(device)?;
        d.whole_gpu()?;
        nonnull(mhz)?;
        out(mhz, clock(d.gpu, kind, cx.now)?)
    }

    fn nvmlDeviceGetClock(device: nvmlDevice_t, kind: nvmlClockType_t, id: nvmlClockId_t, mhz: *mut c_uint) [cx] {
        let d = cx.dev(device)?;
        d.whole_gpu()?;
        nonnull(mhz)?;
        let v = match id {
            0 => clock(d.gpu, kind, cx.now)?,
            1..=3 => match kind {
                2 => d.gpu.max_mem_clock_mhz,
                _ => d.gpu.max_sm_clock_mhz,
            },
            _ => return Err(codes::INVALID_ARGUMENT),
        };
        out(mhz, v)
    }

    fn nvmlDeviceGetCurrentClocksThrottleReasons(device: nvmlDevice_t, reasons: *mut c_ulonglong) [cx] {
        let d = cx.dev(device)?;
        d.whole_gpu()?;
        out(reasons, d.gpu.timeline.at(M::Throttle, cx.now) as u64)
    }

    fn nvmlDeviceGetCurrentClocksEventReasons(device: nvmlDevice_t, reasons: *mut c_ulonglong) [cx] {
        let d = cx.dev(device)?;
        d.whole_gpu()?;
        out(reasons, d.gpu.timeline.at(M::Throttle, cx.now) as u64)
    }

    /// KB/s (1024 bytes) over the driver's 20 ms measurement window ending now.
    fn nvmlDeviceGetPcieThroughput(device: nvmlDevice_t, counter: nvmlPcieUtilCounter_t, value: *mut c_uint) [cx] {
        let d = cx.dev(device)?;
        d.whole_gpu()?;
        let m = match counter {
            0 => M::PcieTx,
            1 => M::PcieRx,
            _ => return Err(codes::INVALID_ARGUMENT),
        };
        let rate = d.gpu.timeline.mean(m, cx.now - PCIE_WINDOW_NS, cx.now);
        out(value, (rate / 1024.0).round() as u32)
    }

    fn nvmlDeviceGetPcieReplayCounter(device: nvmlDevice_t, value: *mut c_uint) [cx] {
        let d = cx.dev(device)?;
        d.whole_gpu()?;
        let v = GpuModel::counter(d.gpu.health.pcie_replay, cx.rt()?.init_ns, cx.now);
        out(value, v as c_uint)
    }

    fn nvmlDeviceGetTotalEccErrors(
        device: nvmlDevice_t,
        error_type: nvmlMemoryErrorType_t,
        counter_type: nvmlEccCounterType_t,
        counts: *mut c_ulonglong,
    ) [cx] {
        let d = cx.dev(device)?;
        d.whole_gpu()?;
        if !d.gpu.ecc_enabled {
            return Err(codes::NOT_SUPPORTED);
        }
        let h = &d.gpu.health;
        let c = match (error_type, counter_type) {
            (0, 0) => h.ecc_sbe_volatile,
            (1, 0) => h.ecc_dbe_volatile,
            (0, 1) => h.ecc_sbe_aggregate,
            (1, 1) => h.ecc_dbe_aggregate,
            _ => return Err(codes::INVALID_ARGUMENT),
        };
        out(counts, GpuModel::counter(c, cx.rt()?.init_ns, cx.now))
    }

    /// Row remapping exists on A100 and later only.
    fn nvmlDeviceGetRemappedRows(
        device: nvmlDevice_t,
        corr: *mut c_uint,
        unc: *mut c_uint,
        pending: *mut c_uint,
        failure: *mut c_uint,
    ) [cx] {
        let d = cx.dev(device)?;
        d.whole_gpu()?;
        if d.gpu.arch_code() < 7 {
            return Err(codes::NOT_SUPPORTED);
        }
        for p in [corr, unc, pending, failure] {
            nonnull(p)?;
        }
        let init = cx.rt()?.init_ns;
        let h = &d.gpu.health;
        out(corr, GpuModel::counter(h.remapped_corr, init, cx.now) as c_uint)?;
        out(unc, GpuModel::counter(h.remapped_unc, init, cx.now) as c_uint)?;
        out(pending, c_uint::from(h.remapped_pending))?;
        out(failure, c_uint::from(h.remapped_failure))
    }
}
