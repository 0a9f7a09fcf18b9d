//! The native `apron_gpu_*` families: base units, snake_case labels, and busy time as
//! counters so that `rate()` is exact at any scrape interval (docs/metrics.md).

use std::collections::BTreeMap;

use apron_common::{Field, GpuIdentity};
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType;

use super::{AgentState, GpuState, Labels, OwnerLabels, Series, family, push_owner};

/// Which statistic of the last window a native gauge shows.
#[derive(Clone, Copy)]
enum Stat {
    Mean,
    Max,
    Last,
}

struct NativeGauge {
    name: &'static str,
    field: Field,
    stat: Stat,
    scale: f64,
    help: &'static str,
}

const fn native(name: &'static str, field: Field, stat: Stat, scale: f64, help: &'static str) -> NativeGauge {
    NativeGauge { name, field, stat, scale, help }
}

/// The native gauges as `(name, field, from the window's maximum, scale from the base
/// unit)`: what `apron_gpu_*` series a window's columns make. The server's Prometheus
/// remote read serves `gpu_samples` under these names and labels.
pub fn native_gauges() -> impl Iterator<Item = (&'static str, Field, bool, f64)> {
    NATIVE_GAUGES.iter().map(|n| (n.name, n.field, matches!(n.stat, Stat::Max), n.scale))
}

/// Native gauges, base units, from the last closed window.
const NATIVE_GAUGES: &[NativeGauge] = &[
    native(
        "apron_gpu_util_ratio",
        Field::GpuUtil,
        Stat::Mean,
        1.0,
        "Mean fraction of time a kernel was running, last window.",
    ),
    native(
        "apron_gpu_util_max_ratio",
        Field::GpuUtil,
        Stat::Max,
        1.0,
        "Highest utilisation reading in the last window.",
    ),
    native(
        "apron_gpu_mem_copy_util_ratio",
        Field::MemCopyUtil,
        Stat::Mean,
        1.0,
        "Mean fraction of time device memory was read or written, last window.",
    ),
    native("apron_gpu_enc_util_ratio", Field::EncUtil, Stat::Mean, 1.0, "Mean encoder utilisation, last window."),
    native("apron_gpu_dec_util_ratio", Field::DecUtil, Stat::Mean, 1.0, "Mean decoder utilisation, last window."),
    native(
        "apron_gpu_gr_engine_active_ratio",
        Field::GrEngineActive,
        Stat::Mean,
        1.0,
        "Mean graphics/compute engine activity (GPM), last window.",
    ),
    native("apron_gpu_sm_active_ratio", Field::SmActive, Stat::Mean, 1.0, "Mean SM activity (GPM), last window."),
    native(
        "apron_gpu_sm_active_max_ratio",
        Field::SmActive,
        Stat::Max,
        1.0,
        "Highest SM activity reading (GPM) in the last window.",
    ),
    native(
        "apron_gpu_sm_occupancy_ratio",
        Field::SmOccupancy,
        Stat::Mean,
        1.0,
        "Mean SM occupancy (GPM), last window.",
    ),
    native(
        "apron_gpu_tensor_active_ratio",
        Field::TensorActive,
        Stat::Mean,
        1.0,
        "Mean tensor pipe activity (GPM), last window.",
    ),
    native(
        "apron_gpu_dram_active_ratio",
        Field::DramActive,
        Stat::Mean,
        1.0,
        "Mean DRAM interface activity (GPM), last window.",
    ),
    native(
        "apron_gpu_fp64_active_ratio",
        Field::Fp64Active,
        Stat::Mean,
        1.0,
        "Mean FP64 pipe activity (GPM), last window.",
    ),
    native(
        "apron_gpu_fp32_active_ratio",
        Field::Fp32Active,
        Stat::Mean,
        1.0,
        "Mean FP32 pipe activity (GPM), last window.",
    ),
    native(
        "apron_gpu_fp16_active_ratio",
        Field::Fp16Active,
        Stat::Mean,
        1.0,
        "Mean FP16 pipe activity (GPM), last window.",
    ),
    native(
        "apron_gpu_memory_used_bytes",
        Field::FbUsedBytes,
        Stat::Mean,
        1.0,
        "Framebuffer memory used, mean of the last window.",
    ),
    native(
        "apron_gpu_memory_free_bytes",
        Field::FbFreeBytes,
        Stat::Mean,
        1.0,
        "Framebuffer memory free, mean of the last window.",
    ),
    native(
        "apron_gpu_memory_reserved_bytes",
        Field::FbReservedBytes,
        Stat::Last,
        1.0,
        "Framebuffer memory reserved by the driver.",
    ),
    native("apron_gpu_memory_total_bytes", Field::FbTotalBytes, Stat::Last, 1.0, "Framebuffer memory installed."),
    native("apron_gpu_power_watts", Field::PowerWatts, Stat::Mean, 1.0, "Power draw, mean of the last window."),
    native("apron_gpu_temperature_celsius", Field::GpuTempC, Stat::Mean, 1.0, "GPU die temperature."),
    native("apron_gpu_memory_temperature_celsius", Field::MemTempC, Stat::Mean, 1.0, "Memory temperature."),
    native("apron_gpu_sm_clock_hertz", Field::SmClockMhz, Stat::Mean, 1e6, "SM clock frequency."),
    native("apron_gpu_memory_clock_hertz", Field::MemClockMhz, Stat::Mean, 1e6, "Memory clock frequency."),
    native(
        "apron_gpu_pcie_transmit_bytes_per_second",
        Field::PcieTxBytesPerS,
        Stat::Mean,
        1.0,
        "PCIe transmit throughput.",
    ),
    native(
        "apron_gpu_pcie_receive_bytes_per_second",
        Field::PcieRxBytesPerS,
        Stat::Mean,
        1.0,
        "PCIe receive throughput.",
    ),
    native(
        "apron_gpu_nvlink_transmit_bytes_per_second",
        Field::NvlinkTxBytesPerS,
        Stat::Mean,
        1.0,
        "NVLink transmit throughput, all links.",
    ),
    native(
        "apron_gpu_nvlink_receive_bytes_per_second",
        Field::NvlinkRxBytesPerS,
        Stat::Mean,
        1.0,
        "NVLink receive throughput, all links.",
    ),
    native(
        "apron_gpu_clocks_event_reasons",
        Field::ClocksEventReasons,
        Stat::Last,
        1.0,
        "NVML clocks event (throttle) reasons bitmask.",
    ),
    native("apron_gpu_row_remap_pending", Field::RowRemapPending, Stat::Last, 1.0, "1 when a row remap is pending."),
    native("apron_gpu_row_remap_failure", Field::RowRemapFailure, Stat::Last, 1.0, "1 when a row remap has failed."),
];

/// A counter family read from the device: name, field, help, extra label.
type DeviceCounter = (&'static str, Field, &'static str, Option<(&'static str, &'static str)>);

/// Native counters read from the device, as of the last window.
const NATIVE_DEVICE_COUNTERS: &[DeviceCounter] = &[
    ("apron_gpu_energy_joules", Field::EnergyJoules, "Energy consumed since the driver loaded.", None),
    ("apron_gpu_pcie_replays", Field::PcieReplays, "PCIe replays since the driver loaded.", None),
    ("apron_gpu_ecc_errors", Field::EccSbeTotal, "ECC errors, aggregate.", Some(("type", "corrected"))),
    ("apron_gpu_ecc_errors", Field::EccDbeTotal, "ECC errors, aggregate.", Some(("type", "uncorrected"))),
    ("apron_gpu_remapped_rows", Field::RemappedRowsCorrectable, "Rows remapped.", Some(("cause", "correctable"))),
    ("apron_gpu_remapped_rows", Field::RemappedRowsUncorrectable, "Rows remapped.", Some(("cause", "uncorrectable"))),
];

/// Reads one integrated counter from a GPU's state; `None` before its signal was seen.
type IntegralFn = fn(&GpuState) -> Option<f64>;

fn native_labels(g: &GpuIdentity, owner: Option<&OwnerLabels>) -> Labels {
    let mut l: Labels = vec![
        ("gpu_uuid".into(), g.gpu_uuid.to_string()),
        ("gpu_index".into(), g.gpu_index.to_string()),
        ("gpu_model".into(), g.gpu_model.clone()),
        ("hostname".into(), g.host.to_string()),
        ("pci_bus_id".into(), g.pci_bus_id.clone()),
    ];
    if let Some(c) = &g.cluster {
        l.push(("cluster".into(), c.to_string()));
    }
    if let Some(p) = &g.parent_gpu_uuid {
        l.push(("parent_gpu_uuid".into(), p.to_string()));
    }
    if let Some(p) = &g.mig_profile {
        l.push(("mig_profile".into(), p.clone()));
    }
    if let Some(o) = owner {
        push_owner(&mut l, o);
    }
    l
}

/// Every native GPU family, and the per-process ones.
pub(super) fn encode(enc: &mut DescriptorEncoder, st: &AgentState) -> Result<(), std::fmt::Error> {
    let driver = st.driver_version.as_deref();
    let live = || st.live_gpus();
    let info: Vec<_> = st
        .gpus
        .iter()
        .map(|(g, _)| {
            let mut l = native_labels(g, None);
            if let Some(d) = driver {
                l.push(("driver_version".into(), d.to_owned()));
            }
            (l, 1.0)
        })
        .collect();
    family(enc, "apron_gpu_info", "GPUs and MIG instances this agent samples (always 1).", MetricType::Gauge, &info)?;
    let lost: Vec<_> = st.gpus.iter().map(|(g, s)| (native_labels(g, None), if s.lost { 1.0 } else { 0.0 })).collect();
    family(
        enc,
        "apron_gpu_lost",
        "1 while the GPU answers GPU_IS_LOST (fallen off the bus).",
        MetricType::Gauge,
        &lost,
    )?;

    for n in NATIVE_GAUGES {
        let series: Vec<_> = live()
            .filter_map(|(g, s)| {
                let stats = s.last.as_ref()?.get(n.field)?;
                let v = match n.stat {
                    Stat::Mean => stats.mean,
                    Stat::Max => stats.max,
                    Stat::Last => stats.last,
                };
                Some((native_labels(g, Some(&s.owner)), v * n.scale))
            })
            .collect();
        family(enc, n.name, n.help, MetricType::Gauge, &series)?;
    }

    // Busy time as counters: integrals over every window since start.
    let counters: [(&str, &str, IntegralFn); 3] = [
        ("apron_gpu_busy_seconds", "Seconds a kernel was running: the integral of gpu_util over time.", |s| {
            (s.util_observed_seconds > 0.0).then_some(s.busy_seconds)
        }),
        ("apron_gpu_sm_active_seconds", "SM-active seconds: the integral of sm_active over time (GPM).", |s| {
            (s.sm_observed_seconds > 0.0).then_some(s.sm_active_seconds)
        }),
        (
            "apron_gpu_tensor_active_seconds",
            "Tensor-active seconds: the integral of tensor_active over time (GPM).",
            |s| (s.sm_observed_seconds > 0.0).then_some(s.tensor_active_seconds),
        ),
    ];
    for (name, help, get) in counters {
        let series: Vec<_> =
            st.gpus.iter().filter_map(|(g, s)| Some((native_labels(g, Some(&s.owner)), get(s)?))).collect();
        family(enc, name, help, MetricType::Counter, &series)?;
    }
    let mut observed = Vec::new();
    for (g, s) in &st.gpus {
        for (signal, secs) in [("gpu_util", s.util_observed_seconds), ("sm_active", s.sm_observed_seconds)] {
            if secs > 0.0 {
                let mut l = native_labels(g, Some(&s.owner));
                l.push(("signal".into(), signal.to_owned()));
                observed.push((l, secs));
            }
        }
    }
    family(
        enc,
        "apron_gpu_observed_seconds",
        "Seconds with readings of a signal; rate(busy)/rate(observed) is utilisation over known time.",
        MetricType::Counter,
        &observed,
    )?;

    let mut by_name: BTreeMap<&str, (&str, Series)> = BTreeMap::new();
    for &(name, field, help, extra) in NATIVE_DEVICE_COUNTERS {
        let entry = by_name.entry(name).or_insert((help, Vec::new()));
        for (g, s) in live() {
            if let Some(v) = s.last.as_ref().and_then(|w| w.value(field)) {
                let mut l = native_labels(g, None);
                if let Some((k, val)) = extra {
                    l.push((k.into(), val.to_owned()));
                }
                entry.1.push((l, v));
            }
        }
    }
    for (name, (help, series)) in &by_name {
        family(enc, name, help, MetricType::Counter, series)?;
    }
    let xid_last: Vec<_> = live().filter_map(|(g, s)| Some((native_labels(g, None), s.xid_last?))).collect();
    family(enc, "apron_gpu_xid_last", "The last XID error code seen on the GPU.", MetricType::Gauge, &xid_last)?;

    encode_processes(enc, st)
}

fn encode_processes(enc: &mut DescriptorEncoder, st: &AgentState) -> Result<(), std::fmt::Error> {
    let mut mem = Vec::new();
    let mut sm = Vec::new();
    for p in &st.processes {
        let mut l: Labels = vec![
            ("gpu_uuid".into(), p.gpu_uuid.to_string()),
            ("hostname".into(), p.host.to_string()),
            ("pid".into(), p.pid.to_string()),
        ];
        let opt = [
            ("process_name", &p.process_name),
            ("user", &p.user),
            ("pod", &p.pod),
            ("namespace", &p.namespace),
            ("container", &p.container),
            ("job_id", &p.job_id),
        ];
        for (k, v) in opt {
            if let Some(v) = v {
                l.push((k.into(), v.clone()));
            }
        }
        if let Some(b) = p.fb_used_bytes {
            mem.push((l.clone(), b as f64));
        }
        if let Some(u) = p.sm_util {
            sm.push((l, u));
        }
    }
    family(enc, "apron_gpu_process_memory_bytes", "GPU memory used by a process.", MetricType::Gauge, &mem)?;
    family(
        enc,
        "apron_gpu_process_sm_util_ratio",
        "A process's SM utilisation from the driver's per-process samples.",
        MetricType::Gauge,
        &sm,
    )
}
