//! GPM (GPU Performance Monitoring, Hopper and later): sample buffers and metrics
//! computed between two of them.
//!
//! Units follow nvml.h: `*_UTIL` metrics are percentages 0.0–100.0, byte rates
//! are MiB/s. Two samples less than 100 ms apart (nvml.h asks for more, because
//! of the internal refresh rate) get NVML_ERROR_INVALID_ARGUMENT per metric.

use super::{export, nonnull, out};
use crate::codes::{self, Ret};
use crate::driver::{self, GPM_MIN_INTERVAL_NS};
use crate::state::{GPM_SAMPLES, GpmSample, GpmSnap, lock};
use nvml_wrapper_sys::bindings::{
    NVML_GPM_METRICS_GET_VERSION, NVML_GPM_SUPPORT_VERSION, nvmlDevice_t, nvmlGpmMetric_t,
    nvmlGpmMetricId_t_NVML_GPM_METRIC_MAX, nvmlGpmMetricsGet_t, nvmlGpmSample_st, nvmlGpmSample_t, nvmlGpmSupport_t,
};
use std::ffi::{c_char, c_uint};

/// Fills a sample the caller allocated with `nvmlGpmSampleAlloc`.
fn fill(sample: nvmlGpmSample_t, snap: GpmSnap) -> Result<(), Ret> {
    let mut reg = lock(&GPM_SAMPLES);
    let s = reg.get_or_insert_default().get_mut(&(sample as usize)).ok_or(codes::INVALID_ARGUMENT)?;
    s.snap = Some(snap);
    Ok(())
}

fn snap_of(sample: nvmlGpmSample_t) -> Result<GpmSnap, Ret> {
    let mut reg = lock(&GPM_SAMPLES);
    let s = reg.get_or_insert_default().get(&(sample as usize)).ok_or(codes::INVALID_ARGUMENT)?;
    s.snap.clone().ok_or(codes::INVALID_ARGUMENT)
}

export! {
    /// Succeeds on every GPU and says whether GPM exists (pre-Hopper: 0), as the
    /// driver does; a wrong struct version is ARGUMENT_VERSION_MISMATCH.
    fn nvmlGpmQueryDeviceSupport(device: nvmlDevice_t, support: *mut nvmlGpmSupport_t) [cx] {
        let d = cx.dev(device)?;
        nonnull(support)?;
        if support.read_unaligned().version != NVML_GPM_SUPPORT_VERSION {
            return Err(codes::ARGUMENT_VERSION_MISMATCH);
        }
        out(support, nvmlGpmSupport_t {
            version: NVML_GPM_SUPPORT_VERSION,
            isSupportedDevice: c_uint::from(d.gpu.gpm_supported()),
        })
    }

    fn nvmlGpmSampleAlloc(sample: *mut nvmlGpmSample_t) [cx] {
        cx.rt()?;
        nonnull(sample)?;
        let boxed = Box::new(GpmSample::default());
        let ptr = (&*boxed as *const GpmSample).cast_mut().cast::<nvmlGpmSample_st>();
        lock(&GPM_SAMPLES).get_or_insert_default().insert(ptr as usize, boxed);
        out(sample, ptr)
    }

    /// Freeing an unknown or already-freed sample is INVALID_ARGUMENT, not a crash.
    fn nvmlGpmSampleFree(sample: nvmlGpmSample_t) [_cx] {
        lock(&GPM_SAMPLES)
            .get_or_insert_default()
            .remove(&(sample as usize))
            .map(drop)
            .ok_or(codes::INVALID_ARGUMENT)
    }

    /// Whole-GPU sample. MIG device handles are NOT_SUPPORTED: per-instance data
    /// comes from `nvmlGpmMigSampleGet` on the parent.
    fn nvmlGpmSampleGet(device: nvmlDevice_t, sample: nvmlGpmSample_t) [cx] {
        let d = cx.dev(device)?;
        if d.mig.is_some() || !d.gpu.gpm_supported() {
            return Err(codes::NOT_SUPPORTED);
        }
        fill(sample, GpmSnap { rt: cx.rt_arc()?.clone(), gpu: d.gpu_idx, gi: None, t_ns: cx.now })
    }

    fn nvmlGpmMigSampleGet(device: nvmlDevice_t, gpu_instance_id: c_uint, sample: nvmlGpmSample_t) [cx] {
        let d = cx.dev(device)?;
        if d.mig.is_some() || !d.gpu.gpm_supported() || !d.gpu.mig_mode {
            return Err(codes::NOT_SUPPORTED);
        }
        driver::find_mig(d.gpu, gpu_instance_id).ok_or(codes::INVALID_ARGUMENT)?;
        fill(sample, GpmSnap { rt: cx.rt_arc()?.clone(), gpu: d.gpu_idx, gi: Some(gpu_instance_id), t_ns: cx.now })
    }

    fn nvmlGpmMetricsGet(request: *mut nvmlGpmMetricsGet_t) [cx] {
        cx.rt()?;
        nonnull(request)?;
        // Field-wise access: the caller's array may be shorter than this header's
        // (older headers had 98 entries), so only the first `numMetrics` are touched.
        let version = (&raw const (*request).version).read_unaligned();
        if version != NVML_GPM_METRICS_GET_VERSION {
            return Err(codes::ARGUMENT_VERSION_MISMATCH);
        }
        let n = (&raw const (*request).numMetrics).read_unaligned() as usize;
        if n > nvmlGpmMetricId_t_NVML_GPM_METRIC_MAX as usize {
            return Err(codes::INVALID_ARGUMENT);
        }
        let s1 = snap_of((&raw const (*request).sample1).read_unaligned())?;
        let s2 = snap_of((&raw const (*request).sample2).read_unaligned())?;
        if !std::sync::Arc::ptr_eq(&s1.rt, &s2.rt) || s1.gpu != s2.gpu || s1.gi != s2.gi {
            return Err(codes::INVALID_ARGUMENT);
        }
        let gpu = s1.rt.model.gpus.get(s1.gpu).ok_or(codes::INVALID_ARGUMENT)?;
        let (t1, t2) = (s1.t_ns.min(s2.t_ns), s1.t_ns.max(s2.t_ns));
        let metrics = (&raw mut (*request).metrics).cast::<nvmlGpmMetric_t>();
        for i in 0..n {
            let p = metrics.add(i);
            let mut m = p.read_unaligned();
            let info = driver::gpm_info(m.metricId);
            m.value = 0.0;
            m.nvmlReturn = match &info {
                None => codes::NOT_SUPPORTED,
                Some(_) if t2 - t1 < GPM_MIN_INTERVAL_NS => codes::INVALID_ARGUMENT,
                Some(info) => match driver::gpm_metric(gpu, s1.gi, info.kind, t1, t2) {
                    Ok(v) => {
                        m.value = v;
                        codes::SUCCESS
                    }
                    Err(e) => e,
                },
            };
            let names = info.map(|i| (i.short, i.long, i.unit));
            let ptr = |s: Option<&'static std::ffi::CStr>| s.map_or(std::ptr::null_mut(), |s| s.as_ptr().cast_mut()) as *mut c_char;
            m.metricInfo.shortName = ptr(names.as_ref().map(|n| n.0));
            m.metricInfo.longName = ptr(names.as_ref().map(|n| n.1));
            m.metricInfo.unit = ptr(names.as_ref().map(|n| n.2));
            p.write_unaligned(m);
        }
        Ok(())
    }
}
