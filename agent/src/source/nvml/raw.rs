//! The few NVML calls `nvml-wrapper` 0.13 does not wrap, through its own sys bindings.
//!
//! - `nvmlDeviceGetGpuInstanceId` (a MIG instance's GPU instance id: dcgm-exporter's
//!   `GPU_I_ID` label and the argument of `nvmlGpmMigSampleGet`),
//! - `nvmlDeviceGetRemappedRows`,
//! - `nvmlDeviceGetFieldValues` with a scope id (NVLink throughput summed over all links
//!   needs `scopeId = UINT_MAX`; the wrapper always sends scope 0 = link 0);
//! - `nvmlDeviceGetSamples` into a reused buffer (the wrapper asks for the count first,
//!   doubling the calls of the most frequent sampler);
//! - `nvmlGpmSampleGet` / `nvmlGpmMigSampleGet` into an existing sample (the wrapper
//!   allocates and frees one per call);
//! - `nvmlGpmMetricsGet` reading only the values (the wrapper copies every metric's
//!   name, description and unit into new strings on every call — most of the GPM
//!   sampler's cost, measured under callgrind).
//!
//! The library is opened a second time with the same path; `dlopen` hands back the same
//! already-loaded object, so this costs a symbol table, not a second driver.

use std::ffi::OsStr;
use std::mem;

use nvml_wrapper::error::{NvmlError, nvml_sym, nvml_try};
use nvml_wrapper_sys::bindings::{
    NVML_GPM_METRICS_GET_VERSION, NvmlLib, nvmlDevice_t, nvmlFieldValue_t, nvmlGpmMetricsGet_t, nvmlGpmSample_t,
    nvmlSample_t,
};

/// Entries of the reused sample buffer: real drivers keep about 120 samples.
const SAMPLE_BUFFER: usize = 128;

/// A field read with a scope: `(field id, scope id)`.
pub type ScopedField = (u32, u32);

pub struct RawNvml {
    lib: NvmlLib,
}

// SAFETY: NvmlLib holds a libloading::Library and plain function pointers; NVML's
// functions are documented thread-safe.
unsafe impl Send for RawNvml {}
unsafe impl Sync for RawNvml {}

impl RawNvml {
    pub fn open(path: &OsStr) -> Result<Self, NvmlError> {
        // SAFETY: loading NVML runs no initialisers that conflict with nvml-wrapper's
        // handle to the same library; both only call exported functions.
        let lib = unsafe { NvmlLib::new(path) }?;
        Ok(Self { lib })
    }

    /// # Safety
    /// `device` must be a live handle from the same NVML (a `Device::handle()`).
    pub unsafe fn gpu_instance_id(&self, device: nvmlDevice_t) -> Result<u32, NvmlError> {
        let sym = nvml_sym(self.lib.nvmlDeviceGetGpuInstanceId.as_ref())?;
        let mut id = 0u32;
        // SAFETY: per the function contract; `id` outlives the call.
        nvml_try(unsafe { sym(device, &mut id) })?;
        Ok(id)
    }

    /// `(correctable, uncorrectable, pending, failure)` remapped-row state.
    ///
    /// # Safety
    /// As [`Self::gpu_instance_id`].
    pub unsafe fn remapped_rows(&self, device: nvmlDevice_t) -> Result<(u32, u32, bool, bool), NvmlError> {
        let sym = nvml_sym(self.lib.nvmlDeviceGetRemappedRows.as_ref())?;
        let (mut c, mut u, mut p, mut f) = (0u32, 0u32, 0u32, 0u32);
        // SAFETY: four out-pointers to locals.
        nvml_try(unsafe { sym(device, &mut c, &mut u, &mut p, &mut f) })?;
        Ok((c, u, p != 0, f != 0))
    }

    /// New driver samples of `sampling` (an `nvmlSamplingType_t`) since `last_seen` µs, as
    /// `(timestamp µs, value)`, into `out` (cleared first). NOT_FOUND means none.
    ///
    /// # Safety
    /// As [`Self::gpu_instance_id`].
    pub unsafe fn samples_into(
        &self,
        device: nvmlDevice_t,
        sampling: u32,
        last_seen: u64,
        buf: &mut Vec<nvmlSample_t>,
        out: &mut Vec<(i64, f64)>,
    ) -> Result<(), NvmlError> {
        let sym = nvml_sym(self.lib.nvmlDeviceGetSamples.as_ref())?;
        out.clear();
        if buf.len() < SAMPLE_BUFFER {
            // SAFETY: nvmlSample_t is plain old data; all-zero is valid.
            buf.resize(SAMPLE_BUFFER, unsafe { mem::zeroed() });
        }
        loop {
            let mut value_type = 0;
            let mut count = u32::try_from(buf.len()).unwrap_or(u32::MAX);
            // SAFETY: `buf` holds `count` entries for the driver to fill.
            let r = unsafe { sym(device, sampling, last_seen, &mut value_type, &mut count, buf.as_mut_ptr()) };
            match nvml_try(r) {
                Ok(()) => {}
                Err(NvmlError::InsufficientSize(_)) if buf.len() < SAMPLE_BUFFER * 16 => {
                    let grown = buf.len() * 2;
                    // SAFETY: as above.
                    buf.resize(grown, unsafe { mem::zeroed() });
                    continue;
                }
                Err(e) => return Err(e),
            }
            for s in buf.iter().take(count as usize) {
                // SAFETY: the union member to read is chosen by `value_type`.
                let v = unsafe {
                    match value_type {
                        0 => s.sampleValue.dVal,
                        1 => f64::from(s.sampleValue.uiVal),
                        2 | 3 => s.sampleValue.ullVal as f64,
                        4 => s.sampleValue.sllVal as f64,
                        5 => f64::from(s.sampleValue.siVal),
                        6 => f64::from(s.sampleValue.usVal),
                        other => return Err(NvmlError::UnexpectedVariant(other)),
                    }
                };
                out.push((i64::try_from(s.timeStamp).unwrap_or(i64::MAX), v));
            }
            return Ok(());
        }
    }

    /// Refills an existing GPM sample from the device (or, with `gpu_instance`, one of
    /// its MIG instances).
    ///
    /// # Safety
    /// `device` as above; `sample` must be a live sample allocated by this NVML.
    pub unsafe fn gpm_sample_into(
        &self,
        device: nvmlDevice_t,
        gpu_instance: Option<u32>,
        sample: nvmlGpmSample_t,
    ) -> Result<(), NvmlError> {
        // SAFETY: per the function contracts.
        nvml_try(unsafe {
            match gpu_instance {
                Some(gi) => nvml_sym(self.lib.nvmlGpmMigSampleGet.as_ref())?(device, gi, sample),
                None => nvml_sym(self.lib.nvmlGpmSampleGet.as_ref())?(device, sample),
            }
        })
    }

    /// GPM metrics between two samples: `ids` are `nvmlGpmMetricId_t` values; `out`
    /// gets one result per id, in order.
    ///
    /// # Safety
    /// `sample1` and `sample2` must be live samples allocated by this NVML and filled.
    pub unsafe fn gpm_metrics_into(
        &self,
        sample1: nvmlGpmSample_t,
        sample2: nvmlGpmSample_t,
        ids: &[u32],
        out: &mut Vec<Result<f64, NvmlError>>,
    ) -> Result<(), NvmlError> {
        let sym = nvml_sym(self.lib.nvmlGpmMetricsGet.as_ref())?;
        // SAFETY: plain old data; all-zero is valid. Boxed: the struct is ~8 KiB.
        let mut req: Box<nvmlGpmMetricsGet_t> = Box::new(unsafe { mem::zeroed() });
        if ids.len() > req.metrics.len() {
            return Err(NvmlError::InvalidArg);
        }
        req.version = NVML_GPM_METRICS_GET_VERSION;
        req.numMetrics = u32::try_from(ids.len()).map_err(|_| NvmlError::InvalidArg)?;
        req.sample1 = sample1;
        req.sample2 = sample2;
        for (m, &id) in req.metrics.iter_mut().zip(ids) {
            m.metricId = id;
        }
        // SAFETY: `req` is a valid request the driver fills in place.
        nvml_try(unsafe { sym(&mut *req) })?;
        out.clear();
        out.extend(req.metrics.iter().take(ids.len()).map(|m| nvml_try(m.nvmlReturn).map(|()| m.value)));
        Ok(())
    }

    /// Reads scoped fields as unsigned 64-bit values; each entry keeps its own result.
    ///
    /// # Safety
    /// As [`Self::gpu_instance_id`].
    pub unsafe fn field_values_u64(
        &self,
        device: nvmlDevice_t,
        fields: &[ScopedField],
    ) -> Result<Vec<Result<u64, NvmlError>>, NvmlError> {
        let sym = nvml_sym(self.lib.nvmlDeviceGetFieldValues.as_ref())?;
        let mut values: Vec<nvmlFieldValue_t> = fields
            .iter()
            .map(|&(id, scope)| {
                // SAFETY: nvmlFieldValue_t is plain old data; all-zero is valid.
                let mut v: nvmlFieldValue_t = unsafe { mem::zeroed() };
                v.fieldId = id;
                v.scopeId = scope;
                v
            })
            .collect();
        let count = i32::try_from(values.len()).map_err(|_| NvmlError::InvalidArg)?;
        // SAFETY: `values` holds `count` initialised entries for the driver to fill.
        nvml_try(unsafe { sym(device, count, values.as_mut_ptr()) })?;
        Ok(values
            .iter()
            .map(|v| {
                nvml_try(v.nvmlReturn)?;
                // SAFETY: the union member to read is chosen by `valueType`.
                Ok(unsafe {
                    match v.valueType {
                        0 => v.value.dVal.max(0.0) as u64,
                        1 => u64::from(v.value.uiVal),
                        2 | 3 => v.value.ullVal,
                        4 => v.value.sllVal.max(0) as u64,
                        5 => v.value.siVal.max(0) as u64,
                        6 => u64::from(v.value.usVal),
                        _ => return Err(NvmlError::UnexpectedVariant(v.valueType)),
                    }
                })
            })
            .collect())
    }
}
