//! Running processes and per-process utilisation.
//!
//! List calls follow the driver's two-step convention: a null buffer (or a short
//! one) gets INSUFFICIENT_SIZE with the needed count, an empty list gets SUCCESS
//! with count 0 — nvml-wrapper and pynvml both rely on exactly that.

use super::{Call, export, nonnull, out, out_list};
use crate::codes::{self, Ret};
use crate::driver;
use crate::scenario::ProcessType;
use nvml_wrapper_sys::bindings::{
    nvmlDevice_t, nvmlProcessInfo_v1_t, nvmlProcessInfo_v2_t, nvmlProcessUtilizationSample_t,
};
use std::ffi::{c_uint, c_ulonglong};

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Compute,
    Graphics,
}

fn list(cx: &Call, device: nvmlDevice_t, kind: Kind) -> Result<Vec<nvmlProcessInfo_v2_t>, Ret> {
    let d = cx.dev(device)?;
    Ok(driver::processes(&d)
        .into_iter()
        .filter(|(p, _, _)| match kind {
            Kind::Compute => p.kind != ProcessType::Graphics,
            Kind::Graphics => p.kind != ProcessType::Compute,
        })
        .map(|(p, gi, ci)| nvmlProcessInfo_v2_t {
            pid: p.pid,
            usedGpuMemory: p.used_bytes,
            gpuInstanceId: gi,
            computeInstanceId: ci,
        })
        .collect())
}

fn v1(items: Vec<nvmlProcessInfo_v2_t>) -> Vec<nvmlProcessInfo_v1_t> {
    items.into_iter().map(|p| nvmlProcessInfo_v1_t { pid: p.pid, usedGpuMemory: p.usedGpuMemory }).collect()
}

export! {
    fn nvmlDeviceGetComputeRunningProcesses(device: nvmlDevice_t, count: *mut c_uint, infos: *mut nvmlProcessInfo_v1_t) [cx] {
        out_list(count, infos, &v1(list(cx, device, Kind::Compute)?))
    }

    fn nvmlDeviceGetComputeRunningProcesses_v2(device: nvmlDevice_t, count: *mut c_uint, infos: *mut nvmlProcessInfo_v2_t) [cx] {
        out_list(count, infos, &list(cx, device, Kind::Compute)?)
    }

    fn nvmlDeviceGetComputeRunningProcesses_v3(device: nvmlDevice_t, count: *mut c_uint, infos: *mut nvmlProcessInfo_v2_t) [cx] {
        out_list(count, infos, &list(cx, device, Kind::Compute)?)
    }

    fn nvmlDeviceGetGraphicsRunningProcesses(device: nvmlDevice_t, count: *mut c_uint, infos: *mut nvmlProcessInfo_v1_t) [cx] {
        out_list(count, infos, &v1(list(cx, device, Kind::Graphics)?))
    }

    fn nvmlDeviceGetGraphicsRunningProcesses_v2(device: nvmlDevice_t, count: *mut c_uint, infos: *mut nvmlProcessInfo_v2_t) [cx] {
        out_list(count, infos, &list(cx, device, Kind::Graphics)?)
    }

    fn nvmlDeviceGetGraphicsRunningProcesses_v3(device: nvmlDevice_t, count: *mut c_uint, infos: *mut nvmlProcessInfo_v2_t) [cx] {
        out_list(count, infos, &list(cx, device, Kind::Graphics)?)
    }

    /// No MPS server is modelled.
    fn nvmlDeviceGetMPSComputeRunningProcesses_v3(device: nvmlDevice_t, count: *mut c_uint, infos: *mut nvmlProcessInfo_v2_t) [cx] {
        cx.dev(device)?;
        out_list(count, infos, &[])
    }

    /// One sample per process busy in the newest busy period after `last_seen`;
    /// NOT_FOUND when there is none (an idle GPU), as nvml.h documents.
    fn nvmlDeviceGetProcessUtilization(
        device: nvmlDevice_t,
        utilization: *mut nvmlProcessUtilizationSample_t,
        count: *mut c_uint,
        last_seen: c_ulonglong,
    ) [cx] {
        let d = cx.dev(device)?;
        nonnull(count)?;
        let samples: Vec<_> = driver::process_utilization(&d, cx.now, last_seen)?
            .into_iter()
            .map(|(pid, ts, sm, mem)| nvmlProcessUtilizationSample_t {
                pid,
                timeStamp: ts,
                smUtil: sm,
                memUtil: mem,
                encUtil: 0,
                decUtil: 0,
            })
            .collect();
        if samples.is_empty() {
            out(count, 0)?;
            return Err(codes::NOT_FOUND);
        }
        out_list(count, utilization, &samples)
    }
}
