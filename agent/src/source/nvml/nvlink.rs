//! NVLink throughput, all links (`NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX/RX` with scope
//! UINT_MAX). The driver gives cumulative KiB; the rate is the difference between ticks.
//! GPM's NVLink rates, where present, are the finer source for the same columns.

use std::sync::Arc;

use apron_common::{Field, UnixMicros};
use nvml_wrapper::error::NvmlError;
use nvml_wrapper_sys::bindings::field_id::{
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
};

use super::NvmlShared;
use super::gpm::midpoint;
use super::per_device::{PerDevice, Scope};
use crate::sampler::FieldGroup;

const ALL_LINKS: u32 = u32::MAX;

/// Previous cumulative `(tx KiB, rx KiB, at µs)` per slot.
pub type Previous = Vec<Option<(u64, u64, i64)>>;

pub struct NvlinkSampler;

impl NvlinkSampler {
    #[allow(clippy::new_ret_no_self)]
    pub fn new(shared: Arc<NvmlShared>) -> PerDevice<Previous> {
        let n = shared.gpus.len();
        PerDevice::new(
            FieldGroup::Nvlink,
            Scope::Physical,
            shared,
            vec![None; n],
            |prev, shared, slot, gpu, now, guard, out| {
                let what = "nvmlDeviceGetFieldValues(NVLINK_THROUGHPUT_DATA)";
                let fields = [
                    (NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, ALL_LINKS),
                    (NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, ALL_LINKS),
                ];
                let Some(raw) = shared.raw.as_ref() else {
                    let _ = guard.call(slot, what, out, || Err::<(), _>(NvmlError::FunctionNotFound));
                    return;
                };
                // SAFETY: the handle is live for the life of the process (NVML is never shut down).
                let Some(values) =
                    guard.call(slot, what, out, || unsafe { raw.field_values_u64(gpu.device.handle(), &fields) })
                else {
                    return;
                };
                let (tx, rx) = match (&values[0], &values[1]) {
                    (Ok(tx), Ok(rx)) => (*tx, *rx),
                    (Err(e), _) | (_, Err(e)) => {
                        guard.record(slot, what, out, e);
                        return;
                    }
                };
                if let Some((ptx, prx, pat)) = prev[slot] {
                    let dt = (now.0 - pat) as f64 / 1e6;
                    if dt > 0.0 && tx >= ptx && rx >= prx {
                        // A rate over (previous tick, now]: it belongs at the midpoint.
                        let at = midpoint(UnixMicros(pat), now);
                        out.push(slot, Field::NvlinkTxBytesPerS, (tx - ptx) as f64 * 1024.0 / dt, at);
                        out.push(slot, Field::NvlinkRxBytesPerS, (rx - prx) as f64 * 1024.0 / dt, at);
                    }
                }
                prev[slot] = Some((tx, rx, now.0));
            },
        )
        .on_boundaries()
    }
}
