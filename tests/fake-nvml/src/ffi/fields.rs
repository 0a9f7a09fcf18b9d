//! `nvmlDeviceGetFieldValues`: the batch query. Each value carries its own
//! return code; the call itself fails only for a bad or lost device.

use super::{export, nonnull};
use crate::codes::{self, Ret};
use crate::driver;
use crate::model::GpuModel;
use crate::state::Dev;
use crate::timeline::M;
use nvml_wrapper_sys::bindings::{field_id::*, nvmlDevice_t, nvmlFieldValue_t, nvmlValue_t, nvmlValueType_t};
use std::ffi::c_int;

const UINT: nvmlValueType_t = 1;
const ULL: nvmlValueType_t = 3;

/// A union with all 8 bytes defined, so readers of a wider member see zeros.
pub fn uint_value(v: u32) -> nvmlValue_t {
    let mut u = nvmlValue_t { ullVal: 0 };
    u.uiVal = v;
    u
}

/// NVLink throughput counters are cumulative KiB (nvml.h: "NVLink TX Data
/// throughput in KiB"); `scope` selects a link or, with UINT_MAX, all links.
fn nvlink_kib(g: &GpuModel, m: M, scope: u32, now: i64) -> Result<(nvmlValueType_t, nvmlValue_t), Ret> {
    if g.nvlink_links == 0 {
        return Err(codes::NOT_SUPPORTED);
    }
    let all = driver::cumulative(&g.timeline, m, now, 1024.0);
    let v = match scope {
        u32::MAX => all,
        l if l < g.nvlink_links => all / u64::from(g.nvlink_links),
        _ => return Err(codes::INVALID_ARGUMENT),
    };
    Ok((ULL, nvmlValue_t { ullVal: v }))
}

fn value(d: &Dev<'_>, init_ns: i64, field: u32, scope: u32, now: i64) -> Result<(nvmlValueType_t, nvmlValue_t), Ret> {
    let g = d.gpu;
    if g.unsupported_fields.contains(&field) {
        return Err(codes::NOT_SUPPORTED);
    }
    let uint = |v: u64| Ok((UINT, uint_value(v as u32)));
    let ull = |v: u64| Ok((ULL, nvmlValue_t { ullVal: v }));
    let counter = |c| GpuModel::counter(c, init_ns, now);
    let ecc = |c| {
        if g.ecc_enabled { ull(counter(c)) } else { Err(codes::NOT_SUPPORTED) }
    };
    match field {
        NVML_FI_DEV_ECC_CURRENT | NVML_FI_DEV_ECC_PENDING => uint(u64::from(g.ecc_enabled)),
        NVML_FI_DEV_ECC_SBE_VOL_TOTAL => ecc(g.health.ecc_sbe_volatile),
        NVML_FI_DEV_ECC_DBE_VOL_TOTAL => ecc(g.health.ecc_dbe_volatile),
        NVML_FI_DEV_ECC_SBE_AGG_TOTAL => ecc(g.health.ecc_sbe_aggregate),
        NVML_FI_DEV_ECC_DBE_AGG_TOTAL => ecc(g.health.ecc_dbe_aggregate),
        NVML_FI_DEV_MEMORY_TEMP => uint(g.timeline.at(M::MemTempC, now).round() as u64),
        NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION => ull(driver::cumulative(&g.timeline, M::PowerW, now, 1e-3)),
        NVML_FI_DEV_POWER_INSTANT => uint((g.timeline.at(M::PowerW, now) * 1000.0).round() as u64),
        NVML_FI_DEV_PCIE_REPLAY_COUNTER => ull(counter(g.health.pcie_replay)),
        NVML_FI_DEV_PCIE_REPLAY_ROLLOVER_COUNTER => ull(0),
        NVML_FI_DEV_PCIE_COUNT_TX_BYTES => ull(driver::cumulative(&g.timeline, M::PcieTx, now, 1.0)),
        NVML_FI_DEV_PCIE_COUNT_RX_BYTES => ull(driver::cumulative(&g.timeline, M::PcieRx, now, 1.0)),
        NVML_FI_DEV_NVLINK_LINK_COUNT if g.nvlink_links > 0 => uint(u64::from(g.nvlink_links)),
        NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX => nvlink_kib(g, M::NvlinkTx, scope, now),
        NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX => nvlink_kib(g, M::NvlinkRx, scope, now),
        NVML_FI_DEV_REMAPPED_COR if g.arch_code() >= 7 => uint(counter(g.health.remapped_corr)),
        NVML_FI_DEV_REMAPPED_UNC if g.arch_code() >= 7 => uint(counter(g.health.remapped_unc)),
        NVML_FI_DEV_REMAPPED_PENDING if g.arch_code() >= 7 => uint(u64::from(g.health.remapped_pending)),
        NVML_FI_DEV_REMAPPED_FAILURE if g.arch_code() >= 7 => uint(u64::from(g.health.remapped_failure)),
        _ => Err(codes::NOT_SUPPORTED),
    }
}

export! {
    fn nvmlDeviceGetFieldValues(device: nvmlDevice_t, count: c_int, values: *mut nvmlFieldValue_t) [cx] {
        let d = cx.dev(device)?;
        if count < 0 {
            return Err(codes::INVALID_ARGUMENT);
        }
        if count == 0 {
            return Ok(());
        }
        nonnull(values)?;
        let init_ns = cx.rt()?.init_ns;
        let ts_us = cx.now / 1_000;
        for i in 0..count as usize {
            let p = values.add(i);
            let mut v = p.read_unaligned();
            v.timestamp = ts_us;
            v.latencyUsec = 0;
            // Field values describe the whole board; MIG handles get NOT_SUPPORTED.
            let r = d.whole_gpu().and_then(|()| value(&d, init_ns, v.fieldId, v.scopeId, cx.now));
            match r {
                Ok((ty, val)) => {
                    v.nvmlReturn = codes::SUCCESS;
                    v.valueType = ty;
                    v.value = val;
                }
                Err(code) => v.nvmlReturn = code,
            }
            p.write_unaligned(v);
        }
        Ok(())
    }
}
