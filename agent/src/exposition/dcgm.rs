//! The dcgm-exporter-compatible gauges: dcgm-exporter's names, units and camelCase
//! labels, so existing dashboards work unchanged (docs/metrics.md).

use apron_common::{Field, GpuIdentity};
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType;

use super::{AgentState, Labels, OwnerLabels, family, push_owner};

const MIB: f64 = 1024.0 * 1024.0;

/// A dcgm-exporter family: name, source field, scale from base units, help.
struct DcgmFamily {
    name: &'static str,
    field: Field,
    scale: f64,
    help: &'static str,
}

const fn dcgm(name: &'static str, field: Field, scale: f64, help: &'static str) -> DcgmFamily {
    DcgmFamily { name, field, scale, help }
}

/// dcgm-exporter's names and units (%, MiB, W, MHz, mJ). Counters whose names would
/// need a `_total` suffix are gauges under the exact dcgm-exporter name.
const DCGM_FAMILIES: &[DcgmFamily] = &[
    dcgm("DCGM_FI_DEV_GPU_UTIL", Field::GpuUtil, 100.0, "GPU utilization (in %)."),
    dcgm("DCGM_FI_DEV_MEM_COPY_UTIL", Field::MemCopyUtil, 100.0, "Memory utilization (in %)."),
    dcgm("DCGM_FI_DEV_ENC_UTIL", Field::EncUtil, 100.0, "Encoder utilization (in %)."),
    dcgm("DCGM_FI_DEV_DEC_UTIL", Field::DecUtil, 100.0, "Decoder utilization (in %)."),
    dcgm("DCGM_FI_DEV_FB_FREE", Field::FbFreeBytes, 1.0 / MIB, "Framebuffer memory free (in MiB)."),
    dcgm("DCGM_FI_DEV_FB_USED", Field::FbUsedBytes, 1.0 / MIB, "Framebuffer memory used (in MiB)."),
    dcgm("DCGM_FI_DEV_FB_RESERVED", Field::FbReservedBytes, 1.0 / MIB, "Framebuffer memory reserved (in MiB)."),
    dcgm("DCGM_FI_DEV_FB_TOTAL", Field::FbTotalBytes, 1.0 / MIB, "Framebuffer memory total (in MiB)."),
    dcgm("DCGM_FI_DEV_POWER_USAGE", Field::PowerWatts, 1.0, "Power draw (in W)."),
    dcgm(
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        Field::EnergyJoules,
        1000.0,
        "Total energy consumption since boot (in mJ). A gauge under dcgm-exporter's exact name; see apron_gpu_energy_joules_total for the counter.",
    ),
    dcgm("DCGM_FI_DEV_GPU_TEMP", Field::GpuTempC, 1.0, "GPU temperature (in C)."),
    dcgm("DCGM_FI_DEV_MEMORY_TEMP", Field::MemTempC, 1.0, "Memory temperature (in C)."),
    dcgm("DCGM_FI_DEV_SM_CLOCK", Field::SmClockMhz, 1.0, "SM clock frequency (in MHz)."),
    dcgm("DCGM_FI_DEV_MEM_CLOCK", Field::MemClockMhz, 1.0, "Memory clock frequency (in MHz)."),
    dcgm(
        "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
        Field::ClocksEventReasons,
        1.0,
        "Current clock throttle reasons (bitmask).",
    ),
    dcgm(
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
        Field::PcieReplays,
        1.0,
        "Total number of PCIe retries. A gauge under dcgm-exporter's exact name.",
    ),
    dcgm("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", Field::EccSbeTotal, 1.0, "Total single-bit persistent ECC errors."),
    dcgm("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", Field::EccDbeTotal, 1.0, "Total double-bit persistent ECC errors."),
    dcgm(
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
        Field::RemappedRowsCorrectable,
        1.0,
        "Number of remapped rows for correctable errors.",
    ),
    dcgm(
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        Field::RemappedRowsUncorrectable,
        1.0,
        "Number of remapped rows for uncorrectable errors.",
    ),
    dcgm("DCGM_FI_DEV_ROW_REMAP_FAILURE", Field::RowRemapFailure, 1.0, "Whether remapping of rows has failed."),
    dcgm("DCGM_FI_PROF_GR_ENGINE_ACTIVE", Field::GrEngineActive, 1.0, "Ratio of time the graphics engine is active."),
    dcgm("DCGM_FI_PROF_SM_ACTIVE", Field::SmActive, 1.0, "The ratio of cycles an SM has at least 1 warp assigned."),
    dcgm("DCGM_FI_PROF_SM_OCCUPANCY", Field::SmOccupancy, 1.0, "The ratio of number of warps resident on an SM."),
    dcgm(
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
        Field::TensorActive,
        1.0,
        "Ratio of cycles the tensor (HMMA) pipe is active.",
    ),
    dcgm(
        "DCGM_FI_PROF_DRAM_ACTIVE",
        Field::DramActive,
        1.0,
        "Ratio of cycles the device memory interface is active sending or receiving data.",
    ),
    dcgm("DCGM_FI_PROF_PIPE_FP64_ACTIVE", Field::Fp64Active, 1.0, "Ratio of cycles the fp64 pipes are active."),
    dcgm("DCGM_FI_PROF_PIPE_FP32_ACTIVE", Field::Fp32Active, 1.0, "Ratio of cycles the fp32 pipes are active."),
    dcgm("DCGM_FI_PROF_PIPE_FP16_ACTIVE", Field::Fp16Active, 1.0, "Ratio of cycles the fp16 pipes are active."),
    dcgm(
        "DCGM_FI_PROF_PCIE_TX_BYTES",
        Field::PcieTxBytesPerS,
        1.0,
        "The rate of data transmitted over the PCIe bus - including both protocol headers and data payloads - in bytes per second.",
    ),
    dcgm(
        "DCGM_FI_PROF_PCIE_RX_BYTES",
        Field::PcieRxBytesPerS,
        1.0,
        "The rate of data received over the PCIe bus - including both protocol headers and data payloads - in bytes per second.",
    ),
    dcgm(
        "DCGM_FI_PROF_NVLINK_TX_BYTES",
        Field::NvlinkTxBytesPerS,
        1.0,
        "The rate of data transmitted over NVLink, in bytes per second.",
    ),
    dcgm(
        "DCGM_FI_PROF_NVLINK_RX_BYTES",
        Field::NvlinkRxBytesPerS,
        1.0,
        "The rate of data received over NVLink, in bytes per second.",
    ),
];

fn dcgm_labels(g: &GpuIdentity, parent: Option<&GpuIdentity>, owner: &OwnerLabels, driver: Option<&str>) -> Labels {
    // dcgm-exporter labels a MIG instance's series with its parent's UUID and index and
    // tells instances apart by GPU_I_ID.
    let base = parent.unwrap_or(g);
    let mut l: Labels = vec![
        ("gpu".into(), base.gpu_index.to_string()),
        ("UUID".into(), base.gpu_uuid.to_string()),
        ("pci_bus_id".into(), base.pci_bus_id.clone()),
        ("device".into(), format!("nvidia{}", base.minor_number.unwrap_or(base.gpu_index))),
        ("modelName".into(), base.gpu_model.clone()),
    ];
    if let Some(p) = &g.mig_profile {
        l.push(("GPU_I_PROFILE".into(), p.clone()));
    }
    if let Some(id) = g.mig_gpu_instance_id {
        l.push(("GPU_I_ID".into(), id.to_string()));
    }
    l.push(("Hostname".into(), g.host.to_string()));
    if let Some(d) = driver {
        l.push(("DCGM_FI_DRIVER_VERSION".into(), d.to_owned()));
    }
    push_owner(&mut l, owner);
    l
}

/// Every dcgm-exporter family of the live GPUs.
pub(super) fn encode(enc: &mut DescriptorEncoder, st: &AgentState) -> Result<(), std::fmt::Error> {
    let driver = st.driver_version.as_deref();
    let parent_of = |g: &GpuIdentity| {
        g.parent_gpu_uuid.as_ref().and_then(|p| st.gpus.iter().map(|(g, _)| g).find(|x| &x.gpu_uuid == p))
    };
    let live = || st.live_gpus();
    for f in DCGM_FAMILIES {
        let series: Vec<_> = live()
            .filter_map(|(g, s)| {
                let v = s.last.as_ref()?.value(f.field)?;
                Some((dcgm_labels(g, parent_of(g), &s.owner, driver), v * f.scale))
            })
            .collect();
        family(enc, f.name, f.help, MetricType::Gauge, &series)?;
    }
    let xid: Vec<_> = live()
        .filter(|(_, s)| s.last.is_some())
        .map(|(g, s)| (dcgm_labels(g, parent_of(g), &s.owner, driver), s.xid_last.unwrap_or(0.0)))
        .collect();
    family(enc, "DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered.", MetricType::Gauge, &xid)?;

    Ok(())
}
