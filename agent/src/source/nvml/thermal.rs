//! GPU die temperature (`nvmlDeviceGetTemperature`) and memory temperature (field
//! `NVML_FI_DEV_MEMORY_TEMP`, HBM parts only).

use std::sync::Arc;

use apron_common::Field;
use nvml_wrapper::enum_wrappers::device::TemperatureSensor;
use nvml_wrapper::enums::device::SampleValue;
use nvml_wrapper::struct_wrappers::device::FieldValueSample;
use nvml_wrapper::structs::device::FieldId;
use nvml_wrapper_sys::bindings::field_id::NVML_FI_DEV_MEMORY_TEMP;

use super::NvmlShared;
use super::per_device::{PerDevice, Scope};
use crate::sampler::FieldGroup;

pub struct ThermalSampler;

pub fn sample_value(v: &SampleValue) -> f64 {
    match *v {
        SampleValue::F64(x) => x,
        SampleValue::U32(x) => f64::from(x),
        SampleValue::U64(x) => x as f64,
        SampleValue::I64(x) => x as f64,
    }
}

impl ThermalSampler {
    #[allow(clippy::new_ret_no_self)]
    pub fn new(shared: Arc<NvmlShared>) -> PerDevice<()> {
        PerDevice::new(FieldGroup::Thermal, Scope::Physical, shared, (), |_, _, slot, gpu, now, guard, out| {
            if let Some(t) =
                guard.call(slot, "nvmlDeviceGetTemperature", out, || gpu.device.temperature(TemperatureSensor::Gpu))
            {
                out.push(slot, Field::GpuTempC, f64::from(t), now);
            }
            let what = "nvmlDeviceGetFieldValues(MEMORY_TEMP)";
            let fields =
                guard.call(slot, what, out, || gpu.device.field_values_for(&[FieldId(NVML_FI_DEV_MEMORY_TEMP)]));
            let Some(first) = fields.and_then(|v| v.into_iter().next()) else { return };
            match first.and_then(|s: FieldValueSample| s.value) {
                Ok(v) => out.push(slot, Field::MemTempC, sample_value(&v), now),
                Err(e) => {
                    guard.record(slot, what, out, &e);
                }
            }
        })
    }
}
