//! SM and memory clocks (`nvmlDeviceGetClockInfo`) and the clocks-event (throttle)
//! reasons bitmask.

use std::sync::Arc;

use apron_common::Field;
use nvml_wrapper::enum_wrappers::device::Clock;

use super::NvmlShared;
use super::per_device::{PerDevice, Scope};
use crate::sampler::FieldGroup;

pub struct ClocksSampler;

impl ClocksSampler {
    #[allow(clippy::new_ret_no_self)]
    pub fn new(shared: Arc<NvmlShared>) -> PerDevice<()> {
        PerDevice::new(FieldGroup::Clocks, Scope::Physical, shared, (), |_, _, slot, gpu, now, guard, out| {
            if let Some(mhz) = guard.call(slot, "nvmlDeviceGetClockInfo(SM)", out, || gpu.device.clock_info(Clock::SM))
            {
                out.push(slot, Field::SmClockMhz, f64::from(mhz), now);
            }
            if let Some(mhz) =
                guard.call(slot, "nvmlDeviceGetClockInfo(MEM)", out, || gpu.device.clock_info(Clock::Memory))
            {
                out.push(slot, Field::MemClockMhz, f64::from(mhz), now);
            }
            if let Some(r) = guard
                .call(slot, "nvmlDeviceGetCurrentClocksThrottleReasons", out, || gpu.device.current_throttle_reasons())
            {
                out.push(slot, Field::ClocksEventReasons, r.bits() as f64, now);
            }
        })
    }
}
