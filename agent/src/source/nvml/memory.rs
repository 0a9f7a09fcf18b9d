//! Framebuffer memory: used, free, reserved, total (`nvmlDeviceGetMemoryInfo_v2`).
//! MIG instances report their own slice of memory.

use std::sync::Arc;

use apron_common::Field;

use super::NvmlShared;
use super::per_device::{PerDevice, Scope};
use crate::sampler::FieldGroup;

pub struct MemorySampler;

impl MemorySampler {
    #[allow(clippy::new_ret_no_self)]
    pub fn new(shared: Arc<NvmlShared>) -> PerDevice<()> {
        PerDevice::new(FieldGroup::Memory, Scope::All, shared, (), |_, _, slot, gpu, now, guard, out| {
            if let Some(m) = guard.call(slot, "nvmlDeviceGetMemoryInfo", out, || gpu.device.memory_info()) {
                out.push(slot, Field::FbUsedBytes, m.used as f64, now);
                out.push(slot, Field::FbFreeBytes, m.free as f64, now);
                out.push(slot, Field::FbReservedBytes, m.reserved as f64, now);
                out.push(slot, Field::FbTotalBytes, m.total as f64, now);
            }
        })
    }
}
