//! PCIe throughput (`nvmlDeviceGetPcieThroughput`, KB/s over a 20 ms driver window per
//! direction — the slowest common call, hence its own thread and 1 s default).

use std::sync::Arc;

use apron_common::Field;
use nvml_wrapper::enum_wrappers::device::PcieUtilCounter;

use super::NvmlShared;
use super::per_device::{PerDevice, Scope};
use crate::sampler::FieldGroup;

pub struct PcieSampler;

impl PcieSampler {
    #[allow(clippy::new_ret_no_self)]
    pub fn new(shared: Arc<NvmlShared>) -> PerDevice<()> {
        PerDevice::new(FieldGroup::Pcie, Scope::Physical, shared, (), |_, _, slot, gpu, now, guard, out| {
            let dirs = [
                (PcieUtilCounter::Send, Field::PcieTxBytesPerS, "nvmlDeviceGetPcieThroughput(TX)"),
                (PcieUtilCounter::Receive, Field::PcieRxBytesPerS, "nvmlDeviceGetPcieThroughput(RX)"),
            ];
            for (counter, field, what) in dirs {
                if let Some(kbps) = guard.call(slot, what, out, || gpu.device.pcie_throughput(counter)) {
                    out.push(slot, field, f64::from(kbps) * 1024.0, now);
                }
            }
        })
    }
}
