//! Power draw (`nvmlDeviceGetPowerUsage`, mW) and the energy counter
//! (`nvmlDeviceGetTotalEnergyConsumption`, mJ since the driver loaded).

use std::sync::Arc;

use apron_common::Field;

use super::NvmlShared;
use super::per_device::{PerDevice, Scope};
use crate::sampler::FieldGroup;

pub struct PowerSampler;

impl PowerSampler {
    #[allow(clippy::new_ret_no_self)]
    pub fn new(shared: Arc<NvmlShared>) -> PerDevice<()> {
        PerDevice::new(FieldGroup::Power, Scope::Physical, shared, (), |_, _, slot, gpu, now, guard, out| {
            if let Some(mw) = guard.call(slot, "nvmlDeviceGetPowerUsage", out, || gpu.device.power_usage()) {
                out.push(slot, Field::PowerWatts, f64::from(mw) / 1e3, now);
            }
            if let Some(mj) =
                guard.call(slot, "nvmlDeviceGetTotalEnergyConsumption", out, || gpu.device.total_energy_consumption())
            {
                out.push(slot, Field::EnergyJoules, mj as f64 / 1e3, now);
            }
        })
    }
}
