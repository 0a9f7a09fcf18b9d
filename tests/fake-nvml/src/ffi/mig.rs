//! MIG: mode, enumeration of MIG device handles and their attributes.

use super::{export, nonnull, out};
use crate::codes;
use crate::model::MAX_MIG_DEVICES;
use crate::state;
use nvml_wrapper_sys::bindings::{nvmlDevice_t, nvmlDeviceAttributes_t};
use std::ffi::c_uint;

fn attributes(cx: &super::Call, device: nvmlDevice_t, attrs: *mut nvmlDeviceAttributes_t) -> Result<(), codes::Ret> {
    let d = cx.dev(device)?;
    // nvml.h: "This API currently only supports MIG device handles."
    let (_, m) = d.mig.ok_or(codes::NOT_SUPPORTED)?;
    // Engine counts scale with the slice count the way A100/H100 profiles do
    // (one copy engine and decoder per slice), which is close, not exact.
    let a = nvmlDeviceAttributes_t {
        multiprocessorCount: m.sm_count,
        sharedCopyEngineCount: m.gi_slices,
        sharedDecoderCount: m.gi_slices,
        sharedEncoderCount: 0,
        sharedJpegCount: m.gi_slices.div_ceil(3),
        sharedOfaCount: u32::from(m.gi_slices == 7),
        gpuInstanceSliceCount: m.gi_slices,
        computeInstanceSliceCount: m.ci_slices,
        memorySizeMB: m.memory_bytes / (1024 * 1024),
    };
    // SAFETY: `out` checks null; validity is the caller's contract.
    unsafe { out(attrs, a) }
}

export! {
    fn nvmlDeviceGetMigMode(device: nvmlDevice_t, current: *mut c_uint, pending: *mut c_uint) [cx] {
        let d = cx.dev(device)?;
        d.whole_gpu()?;
        if !d.gpu.mig_capable {
            return Err(codes::NOT_SUPPORTED);
        }
        nonnull(pending)?;
        out(current, c_uint::from(d.gpu.mig_mode))?;
        out(pending, c_uint::from(d.gpu.mig_mode))
    }

    fn nvmlDeviceGetMaxMigDeviceCount(device: nvmlDevice_t, count: *mut c_uint) [cx] {
        let d = cx.dev(device)?;
        d.whole_gpu()?;
        if !d.gpu.mig_capable {
            return Err(codes::NOT_SUPPORTED);
        }
        out(count, MAX_MIG_DEVICES as c_uint)
    }

    /// Indices without an instance (all of them while MIG is off) are NOT_FOUND.
    fn nvmlDeviceGetMigDeviceHandleByIndex(device: nvmlDevice_t, index: c_uint, mig: *mut nvmlDevice_t) [cx] {
        let d = cx.dev(device)?;
        if d.mig.is_some() {
            return Err(codes::INVALID_ARGUMENT);
        }
        if !d.gpu.mig_capable {
            return Err(codes::NOT_SUPPORTED);
        }
        nonnull(mig)?;
        if index as usize >= MAX_MIG_DEVICES {
            return Err(codes::INVALID_ARGUMENT);
        }
        if index as usize >= d.gpu.mig.len() {
            return Err(codes::NOT_FOUND);
        }
        out(mig, state::handle(d.gpu_idx, Some(index as usize)))
    }

    fn nvmlDeviceIsMigDeviceHandle(device: nvmlDevice_t, is_mig: *mut c_uint) [cx] {
        let d = cx.dev(device)?;
        out(is_mig, c_uint::from(d.mig.is_some()))
    }

    fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig: nvmlDevice_t, device: *mut nvmlDevice_t) [cx] {
        let d = cx.dev(mig)?;
        if d.mig.is_none() {
            return Err(codes::INVALID_ARGUMENT);
        }
        out(device, state::handle(d.gpu_idx, None))
    }

    fn nvmlDeviceGetGpuInstanceId(device: nvmlDevice_t, id: *mut c_uint) [cx] {
        let (_, m) = cx.dev(device)?.mig.ok_or(codes::NOT_SUPPORTED)?;
        out(id, m.gi_id)
    }

    fn nvmlDeviceGetComputeInstanceId(device: nvmlDevice_t, id: *mut c_uint) [cx] {
        let (_, m) = cx.dev(device)?.mig.ok_or(codes::NOT_SUPPORTED)?;
        out(id, m.ci_id)
    }

    fn nvmlDeviceGetAttributes(device: nvmlDevice_t, attrs: *mut nvmlDeviceAttributes_t) [cx] {
        attributes(cx, device, attrs)
    }

    fn nvmlDeviceGetAttributes_v2(device: nvmlDevice_t, attrs: *mut nvmlDeviceAttributes_t) [cx] {
        attributes(cx, device, attrs)
    }
}
