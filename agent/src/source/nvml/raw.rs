//! The few NVML calls `nvml-wrapper` 0.13 does not wrap, through its own sys bindings.
//!
//! - `nvmlDeviceGetGpuInstanceId` (a MIG instance's GPU instance id: dcgm-exporter's
//!   `GPU_I_ID` label and the argument of `nvmlGpmMigSampleGet`),
//! - `nvmlDeviceGetRemappedRows`,
//! - `nvmlDeviceGetFieldValues` with a scope id (NVLink throughput summed over all links
//!   needs `scopeId = UINT_MAX`; the wrapper always sends scope 0 = link 0).
//!
//! The library is opened a second time with the same path; `dlopen` hands back the same
//! already-loaded object, so this costs a symbol table, not a second driver.

use std::ffi::OsStr;
use std::mem;

use nvml_wrapper::error::{NvmlError, nvml_sym, nvml_try};
use nvml_wrapper_sys::bindings::{NvmlLib, nvmlDevice_t, nvmlFieldValue_t};

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
