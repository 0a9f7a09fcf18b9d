//! Identity and mostly static properties of a device.
//!
//! MIG device handles answer identity (UUID, name, PCI of the parent,
//! architecture) but not board-level properties, which are NOT_SUPPORTED on them.

use super::{export, out, out_str};
use crate::codes;
use crate::model::GpuModel;
use crate::timeline::M;
use nvml_wrapper_sys::bindings::{
    nvmlBAR1Memory_t, nvmlBrandType_t, nvmlClockType_t, nvmlComputeMode_t, nvmlDevice_t, nvmlDeviceArchitecture_t,
    nvmlEnableState_t, nvmlPciInfo_t, nvmlPstates_t, nvmlTemperatureThresholds_t,
};
use std::ffi::{c_char, c_int, c_uint, c_ulonglong};

fn pci_info(g: &GpuModel) -> nvmlPciInfo_t {
    let mut p = nvmlPciInfo_t {
        busIdLegacy: [0; 16],
        domain: g.domain,
        bus: g.bus,
        device: g.device,
        pciDeviceId: g.pci_device_id,
        pciSubSystemId: g.pci_subsystem_id,
        busId: [0; 32],
    };
    for (dst, src) in p.busIdLegacy.iter_mut().zip(g.bus_id_legacy().bytes().take(15)) {
        *dst = src as c_char;
    }
    for (dst, src) in p.busId.iter_mut().zip(g.bus_id().bytes().take(31)) {
        *dst = src as c_char;
    }
    p
}

/// nvidia-smi's P-state: P0 while anything runs, P8 (idle) otherwise.
fn pstate(g: &GpuModel, now: i64) -> nvmlPstates_t {
    let busy = g.timeline.at(M::GpuUtil, now) > 0.0 || g.mig.iter().any(|m| m.timeline.at(M::GpuUtil, now) > 0.0);
    if busy { 0 } else { 8 }
}

export! {
    fn nvmlDeviceGetUUID(device: nvmlDevice_t, uuid: *mut c_char, length: c_uint) [cx] {
        let d = cx.dev(device)?;
        out_str(uuid, length, d.mig.map_or(&d.gpu.uuid, |(_, m)| &m.uuid))
    }

    fn nvmlDeviceGetName(device: nvmlDevice_t, name: *mut c_char, length: c_uint) [cx] {
        let d = cx.dev(device)?;
        out_str(name, length, d.mig.map_or(&d.gpu.name, |(_, m)| &m.name))
    }

    fn nvmlDeviceGetPciInfo(device: nvmlDevice_t, pci: *mut nvmlPciInfo_t) [cx] {
        out(pci, pci_info(cx.dev(device)?.gpu))
    }

    fn nvmlDeviceGetPciInfo_v2(device: nvmlDevice_t, pci: *mut nvmlPciInfo_t) [cx] {
        out(pci, pci_info(cx.dev(device)?.gpu))
    }

    fn nvmlDeviceGetPciInfo_v3(device: nvmlDevice_t, pci: *mut nvmlPciInfo_t) [cx] {
        out(pci, pci_info(cx.dev(device)?.gpu))
    }

    fn nvmlDeviceGetIndex(device: nvmlDevice_t, index: *mut c_uint) [cx] {
        let d = cx.dev(device)?;
        d.whole_gpu()?;
        out(index, d.gpu.index)
    }

    fn nvmlDeviceGetMinorNumber(device: nvmlDevice_t, minor: *mut c_uint) [cx] {
        let d = cx.dev(device)?;
        d.whole_gpu()?;
        out(minor, d.gpu.minor_number)
    }

    fn nvmlDeviceGetArchitecture(device: nvmlDevice_t, arch: *mut nvmlDeviceArchitecture_t) [cx] {
        out(arch, cx.dev(device)?.gpu.arch_code())
    }

    fn nvmlDeviceGetCudaComputeCapability(device: nvmlDevice_t, major: *mut c_int, minor: *mut c_int) [cx] {
        let (ma, mi) = cx.dev(device)?.gpu.compute_capability;
        super::nonnull(minor)?;
        out(major, ma)?;
        out(minor, mi)
    }

    fn nvmlDeviceGetSerial(device: nvmlDevice_t, serial: *mut c_char, length: c_uint) [cx] {
        let d = cx.dev(device)?;
        d.whole_gpu()?;
        out_str(serial, length, &d.gpu.serial)
    }

    fn nvmlDeviceGetBoardPartNumber(device: nvmlDevice_t, part: *mut c_char, length: c_uint) [cx] {
        let d = cx.dev(device)?;
        d.whole_gpu()?;
        out_str(part, length, "692-2G520-0200-000")
    }

    fn nvmlDeviceGetVbiosVersion(device: nvmlDevice_t, version: *mut c_char, length: c_uint) [cx] {
        let d = cx.dev(device)?;
        d.whole_gpu()?;
        out_str(version, length, "96.00.99.00.01")
    }

    fn nvmlDeviceGetBrand(device: nvmlDevice_t, brand: *mut nvmlBrandType_t) [cx] {
        cx.dev(device)?;
        // NVML_BRAND_NVIDIA: what data-centre boards report since R520.
        out(brand, 14)
    }

    fn nvmlDeviceGetNumGpuCores(device: nvmlDevice_t, cores: *mut c_uint) [cx] {
        let d = cx.dev(device)?;
        let sms = d.mig.map_or(d.gpu.sm_count, |(_, m)| m.sm_count);
        // 128 FP32 cores per SM on Ampere GA10x/Ada/Hopper, 64 on GA100.
        let per_sm = if d.gpu.compute_capability == (8, 0) { 64 } else { 128 };
        out(cores, sms * per_sm)
    }

    fn nvmlDeviceGetMemoryBusWidth(device: nvmlDevice_t, width: *mut c_uint) [cx] {
        let d = cx.dev(device)?;
        d.whole_gpu()?;
        let bits = match d.gpu.arch_code() {
            9 | 10 => 5120,
            8 => 192,
            _ => 5120,
        };
        out(width, bits)
    }

    fn nvmlDeviceGetPowerManagementLimit(device: nvmlDevice_t, limit: *mut c_uint) [cx] {
        let d = cx.dev(device)?;
        d.whole_gpu()?;
        out(limit, d.gpu.power_limit_mw)
    }

    fn nvmlDeviceGetPowerManagementDefaultLimit(device: nvmlDevice_t, limit: *mut c_uint) [cx] {
        let d = cx.dev(device)?;
        d.whole_gpu()?;
        out(limit, d.gpu.power_default_limit_mw)
    }

    fn nvmlDeviceGetEnforcedPowerLimit(device: nvmlDevice_t, limit: *mut c_uint) [cx] {
        let d = cx.dev(device)?;
        d.whole_gpu()?;
        out(limit, d.gpu.power_limit_mw)
    }

    fn nvmlDeviceGetPowerManagementMode(device: nvmlDevice_t, mode: *mut nvmlEnableState_t) [cx] {
        cx.dev(device)?.whole_gpu()?;
        out(mode, 1)
    }

    fn nvmlDeviceGetPersistenceMode(device: nvmlDevice_t, mode: *mut nvmlEnableState_t) [cx] {
        cx.dev(device)?.whole_gpu()?;
        out(mode, 1)
    }

    fn nvmlDeviceGetComputeMode(device: nvmlDevice_t, mode: *mut nvmlComputeMode_t) [cx] {
        cx.dev(device)?.whole_gpu()?;
        out(mode, 0)
    }

    fn nvmlDeviceGetDisplayMode(device: nvmlDevice_t, mode: *mut nvmlEnableState_t) [cx] {
        cx.dev(device)?.whole_gpu()?;
        out(mode, 0)
    }

    fn nvmlDeviceGetDisplayActive(device: nvmlDevice_t, active: *mut nvmlEnableState_t) [cx] {
        cx.dev(device)?.whole_gpu()?;
        out(active, 0)
    }

    fn nvmlDeviceGetEccMode(device: nvmlDevice_t, current: *mut nvmlEnableState_t, pending: *mut nvmlEnableState_t) [cx] {
        let d = cx.dev(device)?;
        d.whole_gpu()?;
        let on = u32::from(d.gpu.ecc_enabled);
        super::nonnull(pending)?;
        out(current, on)?;
        out(pending, on)
    }

    /// Data-centre boards are passively cooled: no fans to report.
    fn nvmlDeviceGetNumFans(device: nvmlDevice_t, fans: *mut c_uint) [cx] {
        cx.dev(device)?.whole_gpu()?;
        super::nonnull(fans)?;
        Err(codes::NOT_SUPPORTED)
    }

    fn nvmlDeviceGetFanSpeed(device: nvmlDevice_t, speed: *mut c_uint) [cx] {
        cx.dev(device)?.whole_gpu()?;
        super::nonnull(speed)?;
        Err(codes::NOT_SUPPORTED)
    }

    fn nvmlDeviceGetFanSpeed_v2(device: nvmlDevice_t, _fan: c_uint, speed: *mut c_uint) [cx] {
        cx.dev(device)?.whole_gpu()?;
        super::nonnull(speed)?;
        Err(codes::NOT_SUPPORTED)
    }

    fn nvmlDeviceGetPerformanceState(device: nvmlDevice_t, state: *mut nvmlPstates_t) [cx] {
        let d = cx.dev(device)?;
        d.whole_gpu()?;
        out(state, pstate(d.gpu, cx.now))
    }

    fn nvmlDeviceGetPowerState(device: nvmlDevice_t, state: *mut nvmlPstates_t) [cx] {
        let d = cx.dev(device)?;
        d.whole_gpu()?;
        out(state, pstate(d.gpu, cx.now))
    }

    fn nvmlDeviceGetMaxClockInfo(device: nvmlDevice_t, kind: nvmlClockType_t, clock: *mut c_uint) [cx] {
        let d = cx.dev(device)?;
        d.whole_gpu()?;
        let v = match kind {
            0 | 1 => d.gpu.max_sm_clock_mhz,
            2 => d.gpu.max_mem_clock_mhz,
            3 => d.gpu.max_sm_clock_mhz * 9 / 10,
            _ => return Err(codes::INVALID_ARGUMENT),
        };
        out(clock, v)
    }

    fn nvmlDeviceGetTemperatureThreshold(device: nvmlDevice_t, kind: nvmlTemperatureThresholds_t, temp: *mut c_uint) [cx] {
        cx.dev(device)?.whole_gpu()?;
        // Shutdown, slowdown, memory max, GPU max: H100 SXM values.
        let v = match kind {
            0 => 92,
            1 => 89,
            2 => 95,
            3 => 87,
            _ => return Err(codes::NOT_SUPPORTED),
        };
        out(temp, v)
    }

    fn nvmlDeviceGetCurrPcieLinkGeneration(device: nvmlDevice_t, generation: *mut c_uint) [cx] {
        let d = cx.dev(device)?;
        d.whole_gpu()?;
        out(generation, if d.gpu.arch_code() >= 9 { 5 } else { 4 })
    }

    fn nvmlDeviceGetMaxPcieLinkGeneration(device: nvmlDevice_t, generation: *mut c_uint) [cx] {
        let d = cx.dev(device)?;
        d.whole_gpu()?;
        out(generation, if d.gpu.arch_code() >= 9 { 5 } else { 4 })
    }

    fn nvmlDeviceGetCurrPcieLinkWidth(device: nvmlDevice_t, width: *mut c_uint) [cx] {
        cx.dev(device)?.whole_gpu()?;
        out(width, 16)
    }

    fn nvmlDeviceGetMaxPcieLinkWidth(device: nvmlDevice_t, width: *mut c_uint) [cx] {
        cx.dev(device)?.whole_gpu()?;
        out(width, 16)
    }

    fn nvmlDeviceGetBAR1MemoryInfo(device: nvmlDevice_t, bar1: *mut nvmlBAR1Memory_t) [cx] {
        let d = cx.dev(device)?;
        d.whole_gpu()?;
        // Resizable BAR on data-centre boards maps the whole framebuffer.
        let total = d.gpu.total_bytes.next_power_of_two();
        let used = 32 * 1024 * 1024;
        out(bar1, nvmlBAR1Memory_t { bar1Total: total, bar1Free: total - used, bar1Used: used })
    }

    fn nvmlDeviceGetSupportedClocksEventReasons(device: nvmlDevice_t, reasons: *mut c_ulonglong) [cx] {
        cx.dev(device)?.whole_gpu()?;
        out(reasons, 0x1FF)
    }

    fn nvmlDeviceGetSupportedClocksThrottleReasons(device: nvmlDevice_t, reasons: *mut c_ulonglong) [cx] {
        cx.dev(device)?.whole_gpu()?;
        out(reasons, 0x1FF)
    }

    fn nvmlDeviceGetNvLinkState(device: nvmlDevice_t, link: c_uint, active: *mut nvmlEnableState_t) [cx] {
        let d = cx.dev(device)?;
        d.whole_gpu()?;
        if d.gpu.nvlink_links == 0 {
            return Err(codes::NOT_SUPPORTED);
        }
        if link >= 18 {
            return Err(codes::INVALID_ARGUMENT);
        }
        out(active, u32::from(link < d.gpu.nvlink_links))
    }
}
