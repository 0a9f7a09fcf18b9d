//! Library lifecycle, system queries and device enumeration.

use super::{EXPORTED, export, in_str, out, out_str};
use crate::codes::{self, Ret};
use crate::model::parse_bus_id;
use crate::state;
use nvml_wrapper_sys::bindings::nvmlDevice_t;
use std::ffi::{c_char, c_int, c_uint};

export! {
    /// The pre-5.319 entry point; pynvml and old tools still resolve it.
    fn nvmlInit() [_cx] {
        match state::init(EXPORTED) { codes::SUCCESS => Ok(()), e => Err(e) }
    }

    fn nvmlInit_v2() [_cx] {
        match state::init(EXPORTED) { codes::SUCCESS => Ok(()), e => Err(e) }
    }

    /// Flags (NO_GPUS, NO_ATTACH) change nothing here: there is no attach step to skip.
    fn nvmlInitWithFlags(_flags: c_uint) [_cx] {
        match state::init(EXPORTED) { codes::SUCCESS => Ok(()), e => Err(e) }
    }

    fn nvmlShutdown() [_cx] {
        match state::shutdown() { codes::SUCCESS => Ok(()), e => Err(e) }
    }

    fn nvmlSystemGetDriverVersion(version: *mut c_char, length: c_uint) [cx] {
        out_str(version, length, &cx.rt()?.model.driver_version)
    }

    fn nvmlSystemGetNVMLVersion(version: *mut c_char, length: c_uint) [cx] {
        out_str(version, length, &cx.rt()?.model.nvml_version)
    }

    fn nvmlSystemGetCudaDriverVersion(version: *mut c_int) [cx] {
        out(version, cx.rt()?.model.cuda_driver_version)
    }

    fn nvmlSystemGetCudaDriverVersion_v2(version: *mut c_int) [cx] {
        out(version, cx.rt()?.model.cuda_driver_version)
    }

    /// Names come from the scenario's GPU processes; other pids are NOT_FOUND, as for
    /// a pid that has exited.
    fn nvmlSystemGetProcessName(pid: c_uint, name: *mut c_char, length: c_uint) [cx] {
        let rt = cx.rt()?;
        let found = rt
            .model
            .gpus
            .iter()
            .flat_map(|g| g.processes.iter().chain(g.mig.iter().flat_map(|m| m.processes.iter())))
            .find(|p| p.pid == pid)
            .ok_or(codes::NOT_FOUND)?;
        if length == 0 {
            return Err(codes::INVALID_ARGUMENT);
        }
        // The driver truncates long names to the buffer rather than failing.
        let mut s = found.name.as_str();
        while s.len() + 1 > length as usize {
            let mut cut = s.len() - 1;
            while !s.is_char_boundary(cut) {
                cut -= 1;
            }
            s = &s[..cut];
        }
        out_str(name, length, s)
    }

    /// The v1 count skipped devices without permission; here all are accessible.
    fn nvmlDeviceGetCount(count: *mut c_uint) [cx] {
        out(count, cx.rt()?.model.gpus.len() as c_uint)
    }

    fn nvmlDeviceGetCount_v2(count: *mut c_uint) [cx] {
        out(count, cx.rt()?.model.gpus.len() as c_uint)
    }

    fn nvmlDeviceGetHandleByIndex(index: c_uint, device: *mut nvmlDevice_t) [cx] {
        by_index(cx, index, device)
    }

    fn nvmlDeviceGetHandleByIndex_v2(index: c_uint, device: *mut nvmlDevice_t) [cx] {
        by_index(cx, index, device)
    }

    /// Accepts GPU and MIG UUIDs, like drivers since R470.
    fn nvmlDeviceGetHandleByUUID(uuid: *const c_char, device: *mut nvmlDevice_t) [cx] {
        let rt = cx.rt()?;
        let want = in_str(uuid)?;
        for (i, g) in rt.model.gpus.iter().enumerate() {
            let h = if g.uuid == want {
                state::handle(i, None)
            } else if let Some(j) = g.mig.iter().position(|m| m.uuid == want) {
                state::handle(i, Some(j))
            } else {
                continue;
            };
            if rt.is_lost(g, cx.now) {
                return Err(codes::GPU_IS_LOST);
            }
            return out(device, h);
        }
        Err(codes::NOT_FOUND)
    }

    fn nvmlDeviceGetHandleByPciBusId(bus_id: *const c_char, device: *mut nvmlDevice_t) [cx] {
        by_bus_id(cx, bus_id, device)
    }

    fn nvmlDeviceGetHandleByPciBusId_v2(bus_id: *const c_char, device: *mut nvmlDevice_t) [cx] {
        by_bus_id(cx, bus_id, device)
    }
}

/// `nvmlErrorString` returns a pointer, not a status, so it sits outside `export!`.
///
/// # Safety
/// Always safe: the result is a static NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlErrorString(result: Ret) -> *const c_char {
    codes::message(result).as_ptr()
}

fn by_index(cx: &super::Call, index: c_uint, device: *mut nvmlDevice_t) -> Result<(), Ret> {
    let rt = cx.rt()?;
    let g = rt.model.gpus.get(index as usize).ok_or(codes::INVALID_ARGUMENT)?;
    if rt.is_lost(g, cx.now) {
        return Err(codes::GPU_IS_LOST);
    }
    // SAFETY: `out` checks for null; validity is the caller's contract.
    unsafe { out(device, state::handle(index as usize, None)) }
}

fn by_bus_id(cx: &super::Call, bus_id: *const c_char, device: *mut nvmlDevice_t) -> Result<(), Ret> {
    let rt = cx.rt()?;
    // SAFETY: the caller passes a C string or null (checked).
    let want = parse_bus_id(unsafe { in_str(bus_id) }?).ok_or(codes::INVALID_ARGUMENT)?;
    let i = rt.model.gpus.iter().position(|g| (g.domain, g.bus, g.device) == want).ok_or(codes::NOT_FOUND)?;
    if rt.is_lost(&rt.model.gpus[i], cx.now) {
        return Err(codes::GPU_IS_LOST);
    }
    // SAFETY: as above.
    unsafe { out(device, state::handle(i, None)) }
}
