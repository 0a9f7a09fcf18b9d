//! `/metrics`: the agent's state, encoded at scrape time with `prometheus-client`.
//!
//! The sampling side updates one [`AgentState`] as windows close; a [`MetricsCollector`]
//! registered with the registry encodes that state on each scrape. Encoding from a
//! snapshot (instead of keeping long-lived metric handles) means a pod that leaves or a
//! GPU that is lost drops its series at once, with no stale label sets.
//!
//! Three kinds of family, per the metric contract (docs/metrics.md):
//! - dcgm-exporter-compatible gauges with dcgm-exporter's names, units and camelCase
//!   labels, so existing dashboards work unchanged;
//! - native `apron_gpu_*` families in base units with snake_case labels, including busy
//!   time as counters so `rate()` is exact at any scrape interval;
//! - `apron_agent_*` self-metrics.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, MutexGuard};

use apron_common::{Field, GpuIdentity, GpuWindow, ProcessRow, UnixMicros};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric as _};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::sampler::{FieldGroup, IssueKind, Slot};
use crate::selfstats;

const MIB: f64 = 1024.0 * 1024.0;

/// Who holds a GPU, for the `pod`/`namespace`/`container` labels.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OwnerLabels {
    pub pod: Option<String>,
    pub namespace: Option<String>,
    pub container: Option<String>,
}

/// Per-GPU state kept between windows.
#[derive(Debug, Default)]
pub struct GpuState {
    pub last: Option<GpuWindow>,
    /// ∫ gpu_util dt over windows with a utilisation reading.
    pub busy_seconds: f64,
    pub sm_active_seconds: f64,
    pub tensor_active_seconds: f64,
    /// Window seconds with a reading of each signal, so rate(busy)/rate(observed) is the
    /// exact utilisation over known time even across gaps.
    pub util_observed_seconds: f64,
    pub sm_observed_seconds: f64,
    pub lost: bool,
    /// The last XID ever seen (dcgm-exporter's semantics for DCGM_FI_DEV_XID_ERRORS).
    pub xid_last: Option<f64>,
    pub owner: OwnerLabels,
    /// Per field (by index): the end of the window its reading in `last` came from.
    pub field_time_us: Vec<i64>,
}

/// Bookkeeping per sampler.
#[derive(Debug, Default, Clone)]
pub struct SamplerStats {
    pub interval_seconds: f64,
    pub runs: u64,
    pub errors: u64,
    pub duration_seconds_total: f64,
    pub last_duration_seconds: f64,
    pub up: bool,
}

/// Batches and rows a table has had acknowledged.
#[derive(Debug, Default, Clone, Copy)]
pub struct TableShipped {
    pub batches: u64,
    pub rows: u64,
}

/// Shipping to the collector (`crate::ship`); present only when a collector is set.
#[derive(Debug, Default, Clone)]
pub struct ShipStats {
    /// Acknowledged batches and rows per table.
    pub sent: BTreeMap<&'static str, TableShipped>,
    /// Acknowledgements that said the collector already had the batch.
    pub duplicates: u64,
    /// Attempts that failed and will be retried.
    pub retries: u64,
    /// Batches the collector refused for good (moved to `rejected/`).
    pub rejected_batches: u64,
    /// Batches written to the spool.
    pub spooled_batches: u64,
    pub spool_bytes: u64,
    pub spool_files: u64,
    /// Batches (rows) dropped because the spool was full or could not be written.
    pub spool_dropped_batches: u64,
    pub spool_dropped_rows: u64,
    /// Unix seconds of the last acknowledgement.
    pub last_success_time: Option<f64>,
    /// Seconds from request to acknowledgement, summed over acknowledged batches.
    pub ack_seconds: f64,
    /// Whether the collector took the last request (2xx or a final 4xx), `None` before
    /// the first; false while requests fail and are retried.
    pub collector_up: Option<bool>,
}

/// Everything `/metrics` shows. Updated by the sampling side, read by scrapes.
#[derive(Debug, Default)]
pub struct AgentState {
    pub source: &'static str,
    pub driver_version: Option<String>,
    pub start_time: f64,
    pub gpus: Vec<(GpuIdentity, GpuState)>,
    pub samplers: BTreeMap<FieldGroup, SamplerStats>,
    /// (sampler, call, GPU slot) found unsupported; each is logged once.
    pub unsupported: BTreeSet<(FieldGroup, &'static str, Option<Slot>)>,
    pub processes: Vec<ProcessRow>,
    pub windows_total: u64,
    pub late_readings: u64,
    pub dropped_windows: u64,
    pub ship: Option<ShipStats>,
    /// Pod labels from the API server; `None` where the agent does not ask it.
    #[cfg(feature = "kubernetes")]
    pub kubernetes: Option<crate::attribution::kube::KubeStats>,
}

impl AgentState {
    pub fn new(source: &'static str, driver_version: Option<String>, inventory: &[GpuIdentity]) -> Self {
        Self {
            source,
            driver_version,
            start_time: UnixMicros::now().as_secs_f64(),
            gpus: inventory.iter().map(|g| (g.clone(), GpuState::default())).collect(),
            ..Self::default()
        }
    }

    /// Folds closed windows into the per-GPU state and counters.
    pub fn apply_windows(&mut self, rows: &[GpuWindow]) {
        for row in rows {
            self.windows_total += 1;
            let Some((_, st)) = self.gpus.iter_mut().find(|(g, _)| g.gpu_uuid == row.gpu.gpu_uuid) else {
                continue;
            };
            let w = row.window_secs();
            st.lost = row.lost;
            if let Some(u) = row.value(Field::GpuUtil) {
                st.busy_seconds += u * w;
                st.util_observed_seconds += w;
            }
            if let Some(s) = row.value(Field::SmActive) {
                st.sm_active_seconds += s * w;
                st.sm_observed_seconds += w;
            }
            if let Some(t) = row.value(Field::TensorActive) {
                st.tensor_active_seconds += t * w;
            }
            if let Some(x) = row.value(Field::XidLast) {
                st.xid_last = Some(x);
            }
            // A field whose sampler runs slower than the window (health every 10 s, say)
            // keeps its last reading on /metrics for up to a minute, so the family does
            // not vanish between its readings and Prometheus never sees it flap to stale.
            let mut merged = row.clone();
            st.field_time_us.resize(merged.fields.len(), i64::MIN);
            for (i, f) in merged.fields.iter_mut().enumerate() {
                if f.is_some() {
                    st.field_time_us[i] = row.time.0;
                } else if !row.lost && row.time.0.saturating_sub(st.field_time_us[i]) <= HOLD_LAST_US {
                    *f = st.last.as_ref().and_then(|p| p.fields.get(i).cloned().flatten());
                }
            }
            st.last = Some(merged);
        }
    }

    pub fn record_issue(&mut self, group: FieldGroup, what: &'static str, kind: IssueKind, slot: Option<Slot>) -> bool {
        kind == IssueKind::Unsupported && self.unsupported.insert((group, what, slot))
    }
}

/// How long a slow sampler's last reading stays on /metrics without a new one.
const HOLD_LAST_US: i64 = 60_000_000;

/// Shared handle to the agent state.
#[derive(Clone, Debug, Default)]
pub struct SharedState(Arc<Mutex<AgentState>>);

impl SharedState {
    pub fn new(state: AgentState) -> Self {
        Self(Arc::new(Mutex::new(state)))
    }

    /// A poisoned lock only means a panic elsewhere mid-update; the numbers are still
    /// the best we have, so keep serving them.
    pub fn lock(&self) -> MutexGuard<'_, AgentState> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

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

type Labels = Vec<(Cow<'static, str>, String)>;
type Series = Vec<(Labels, f64)>;
/// Reads one integrated counter from a GPU's state; `None` before its signal was seen.
type IntegralFn = fn(&GpuState) -> Option<f64>;

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

fn push_owner(l: &mut Labels, owner: &OwnerLabels) {
    for (k, v) in [("pod", &owner.pod), ("namespace", &owner.namespace), ("container", &owner.container)] {
        if let Some(v) = v {
            l.push((k.into(), v.clone()));
        }
    }
}

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

/// Encodes one family from `(labels, value)` pairs; nothing is written for an empty one.
fn family(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    ty: MetricType,
    series: &[(Labels, f64)],
) -> Result<(), std::fmt::Error> {
    if series.is_empty() {
        return Ok(());
    }
    let mut m = enc.encode_descriptor(name, help, None, ty)?;
    for (labels, v) in series {
        let fam = m.encode_family(labels)?;
        match ty {
            MetricType::Counter => prometheus_client::metrics::counter::ConstCounter::new(*v).encode(fam)?,
            _ => prometheus_client::metrics::gauge::ConstGauge::new(*v).encode(fam)?,
        }
    }
    Ok(())
}

/// Encodes [`AgentState`] on every scrape.
#[derive(Debug)]
pub struct MetricsCollector {
    state: SharedState,
}

impl MetricsCollector {
    pub fn new(state: SharedState) -> Self {
        Self { state }
    }
}

impl Collector for MetricsCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let st = self.state.lock();
        let driver = st.driver_version.as_deref();
        let parent_of = |g: &GpuIdentity| {
            g.parent_gpu_uuid.as_ref().and_then(|p| st.gpus.iter().map(|(g, _)| g).find(|x| &x.gpu_uuid == p))
        };
        let live = || st.gpus.iter().filter(|(_, s)| !s.lost);

        for f in DCGM_FAMILIES {
            let series: Vec<_> = live()
                .filter_map(|(g, s)| {
                    let v = s.last.as_ref()?.value(f.field)?;
                    Some((dcgm_labels(g, parent_of(g), &s.owner, driver), v * f.scale))
                })
                .collect();
            family(&mut enc, f.name, f.help, MetricType::Gauge, &series)?;
        }
        let xid: Vec<_> = live()
            .filter(|(_, s)| s.last.is_some())
            .map(|(g, s)| (dcgm_labels(g, parent_of(g), &s.owner, driver), s.xid_last.unwrap_or(0.0)))
            .collect();
        family(
            &mut enc,
            "DCGM_FI_DEV_XID_ERRORS",
            "Value of the last XID error encountered.",
            MetricType::Gauge,
            &xid,
        )?;

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
        family(
            &mut enc,
            "apron_gpu_info",
            "GPUs and MIG instances this agent samples (always 1).",
            MetricType::Gauge,
            &info,
        )?;
        let lost: Vec<_> =
            st.gpus.iter().map(|(g, s)| (native_labels(g, None), if s.lost { 1.0 } else { 0.0 })).collect();
        family(
            &mut enc,
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
            family(&mut enc, n.name, n.help, MetricType::Gauge, &series)?;
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
            family(&mut enc, name, help, MetricType::Counter, &series)?;
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
            &mut enc,
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
            family(&mut enc, name, help, MetricType::Counter, series)?;
        }
        let xid_last: Vec<_> = live().filter_map(|(g, s)| Some((native_labels(g, None), s.xid_last?))).collect();
        family(
            &mut enc,
            "apron_gpu_xid_last",
            "The last XID error code seen on the GPU.",
            MetricType::Gauge,
            &xid_last,
        )?;

        encode_processes(&mut enc, &st)?;
        encode_self(&mut enc, &st)
    }
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

fn encode_self(enc: &mut DescriptorEncoder, st: &AgentState) -> Result<(), std::fmt::Error> {
    let per_sampler = |get: fn(&SamplerStats) -> f64| -> Vec<(Labels, f64)> {
        st.samplers.iter().map(|(g, s)| (vec![("sampler".into(), g.name().to_owned())], get(s))).collect()
    };
    family(
        enc,
        "apron_agent_sampler_runs",
        "Sampler ticks run.",
        MetricType::Counter,
        &per_sampler(|s| s.runs as f64),
    )?;
    family(
        enc,
        "apron_agent_sampler_errors",
        "Sampler ticks that read nothing.",
        MetricType::Counter,
        &per_sampler(|s| s.errors as f64),
    )?;
    family(
        enc,
        "apron_agent_sampler_duration_seconds",
        "Time spent in a sampler, all ticks.",
        MetricType::Counter,
        &per_sampler(|s| s.duration_seconds_total),
    )?;
    family(
        enc,
        "apron_agent_sampler_last_duration_seconds",
        "Duration of the sampler's last tick.",
        MetricType::Gauge,
        &per_sampler(|s| s.last_duration_seconds),
    )?;
    family(
        enc,
        "apron_agent_sampler_up",
        "1 when the sampler's last tick read something.",
        MetricType::Gauge,
        &per_sampler(|s| if s.up { 1.0 } else { 0.0 }),
    )?;
    family(
        enc,
        "apron_agent_sampler_interval_seconds",
        "Configured sampler interval.",
        MetricType::Gauge,
        &per_sampler(|s| s.interval_seconds),
    )?;

    let unsupported: Vec<_> = st
        .unsupported
        .iter()
        .map(|(group, what, slot)| {
            let mut l: Labels = vec![("sampler".into(), group.name().to_owned()), ("call".into(), (*what).to_owned())];
            if let Some((g, _)) = slot.and_then(|s| st.gpus.get(s)) {
                l.push(("gpu_uuid".into(), g.gpu_uuid.to_string()));
            }
            (l, 1.0)
        })
        .collect();
    family(
        enc,
        "apron_agent_unsupported",
        "NVML calls the driver or device does not support; their fields stay NULL.",
        MetricType::Gauge,
        &unsupported,
    )?;
    family(
        enc,
        "apron_agent_windows",
        "GPU windows closed.",
        MetricType::Counter,
        &[(vec![], st.windows_total as f64)],
    )?;
    family(
        enc,
        "apron_agent_late_readings",
        "Readings that arrived after their window closed (dropped).",
        MetricType::Counter,
        &[(vec![], st.late_readings as f64)],
    )?;
    family(
        enc,
        "apron_agent_dropped_windows",
        "Windows a sink could not take (dropped).",
        MetricType::Counter,
        &[(vec![], st.dropped_windows as f64)],
    )?;
    if let Some(ship) = &st.ship {
        encode_ship(enc, ship)?;
    }
    #[cfg(feature = "kubernetes")]
    if let Some(k) = &st.kubernetes {
        encode_kubernetes(enc, k)?;
    }
    let me = selfstats::read();
    if let Some(cpu) = me.cpu_seconds {
        family(
            enc,
            "apron_agent_cpu_seconds",
            "CPU time used by the agent process.",
            MetricType::Counter,
            &[(vec![], cpu)],
        )?;
    }
    if let Some(rss) = me.resident_bytes {
        family(
            enc,
            "apron_agent_resident_memory_bytes",
            "Resident memory of the agent process.",
            MetricType::Gauge,
            &[(vec![], rss)],
        )?;
    }
    family(
        enc,
        "apron_agent_start_time_seconds",
        "Agent start, Unix seconds.",
        MetricType::Gauge,
        &[(vec![], st.start_time)],
    )?;
    let mut build: Labels =
        vec![("version".into(), env!("CARGO_PKG_VERSION").to_owned()), ("source".into(), st.source.to_owned())];
    if let Some(d) = &st.driver_version {
        build.push(("driver_version".into(), d.clone()));
    }
    family(
        enc,
        "apron_agent_build_info",
        "Agent version, GPU source and driver (always 1).",
        MetricType::Gauge,
        &[(build, 1.0)],
    )
}

fn encode_ship(enc: &mut DescriptorEncoder, s: &ShipStats) -> Result<(), std::fmt::Error> {
    let one = |v: f64| -> Series { vec![(vec![], v)] };
    let per_table = |get: fn(&TableShipped) -> u64| -> Series {
        ["gpu_samples", "gpu_processes"]
            .iter()
            .map(|t| {
                let v = s.sent.get(t).map_or(0, get);
                (vec![("table".into(), (*t).to_owned())], v as f64)
            })
            .collect()
    };
    let counters: [(&str, &str, Series); 9] = [
        ("apron_agent_ship_batches", "Batches the collector acknowledged.", per_table(|t| t.batches)),
        ("apron_agent_ship_rows", "Rows in acknowledged batches.", per_table(|t| t.rows)),
        (
            "apron_agent_ship_duplicate_batches",
            "Acknowledged batches the collector already had (a retried request).",
            one(s.duplicates as f64),
        ),
        ("apron_agent_ship_retries", "Requests that failed and are retried.", one(s.retries as f64)),
        (
            "apron_agent_ship_rejected_batches",
            "Batches the collector refused for good (400, 413, 422), kept in the spool's rejected/ directory.",
            one(s.rejected_batches as f64),
        ),
        ("apron_agent_ship_spooled_batches", "Batches written to the on-disk spool.", one(s.spooled_batches as f64)),
        (
            "apron_agent_spool_dropped_batches",
            "Batches dropped, oldest first, because the spool was full (or could not be written).",
            one(s.spool_dropped_batches as f64),
        ),
        ("apron_agent_spool_dropped_rows", "Rows in dropped batches.", one(s.spool_dropped_rows as f64)),
        (
            "apron_agent_ship_ack_duration_seconds",
            "Seconds from request to acknowledgement, summed over acknowledged batches.",
            one(s.ack_seconds),
        ),
    ];
    for (name, help, series) in &counters {
        family(enc, name, help, MetricType::Counter, series)?;
    }
    family(
        enc,
        "apron_agent_spool_bytes",
        "Bytes in the on-disk spool.",
        MetricType::Gauge,
        &one(s.spool_bytes as f64),
    )?;
    family(
        enc,
        "apron_agent_spool_files",
        "Batches in the on-disk spool.",
        MetricType::Gauge,
        &one(s.spool_files as f64),
    )?;
    if let Some(up) = s.collector_up {
        family(
            enc,
            "apron_agent_ship_collector_up",
            "1 when the collector took the last request (acknowledged or refused for good), 0 while requests fail and are retried.",
            MetricType::Gauge,
            &one(if up { 1.0 } else { 0.0 }),
        )?;
    }
    if let Some(t) = s.last_success_time {
        family(
            enc,
            "apron_agent_ship_last_success_time_seconds",
            "When the collector last acknowledged a batch, Unix seconds.",
            MetricType::Gauge,
            &one(t),
        )?;
    }
    Ok(())
}

#[cfg(feature = "kubernetes")]
fn encode_kubernetes(
    enc: &mut DescriptorEncoder,
    k: &crate::attribution::kube::KubeStats,
) -> Result<(), std::fmt::Error> {
    let requests: Series =
        ["ok", "unauthorized", "forbidden", "http_error", "unreachable", "bad_response", "config_error"]
            .iter()
            .map(|r| (vec![("result".into(), (*r).to_owned())], k.requests.get(r).copied().unwrap_or(0) as f64))
            .collect();
    family(
        enc,
        "apron_agent_kubernetes_requests",
        "Lists of this node's pods sent to the Kubernetes API server, by result.",
        MetricType::Counter,
        &requests,
    )?;
    family(
        enc,
        "apron_agent_kubernetes_pods",
        "Pods of this node in the last successful list (their labels go into pod_labels).",
        MetricType::Gauge,
        &[(vec![], k.pods as f64)],
    )?;
    if let Some(t) = k.last_success_time {
        family(
            enc,
            "apron_agent_kubernetes_last_success_time_seconds",
            "When the API server last answered a list, Unix seconds.",
            MetricType::Gauge,
            &[(vec![], t)],
        )?;
    }
    Ok(())
}

/// Builds the registry serving `state`.
pub fn registry(state: SharedState) -> Registry {
    let mut r = Registry::default();
    r.register_collector(Box::new(MetricsCollector::new(state)));
    r
}

/// An exposition format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// OpenMetrics 1.0 text, what Prometheus asks for first.
    OpenMetrics,
    /// Prometheus text 0.0.4, for clients that do not ask for OpenMetrics (curl,
    /// `promtool check metrics`).
    PrometheusText,
}

impl Format {
    /// Content negotiation on the `Accept` header, as Prometheus exporters do it.
    pub fn negotiate(accept: Option<&str>) -> Self {
        match accept {
            Some(a) if a.contains("application/openmetrics-text") => Format::OpenMetrics,
            _ => Format::PrometheusText,
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
            Format::PrometheusText => "text/plain; version=0.0.4; charset=utf-8",
        }
    }
}

/// Renders the registry in `format`.
pub fn render(registry: &Registry, format: Format) -> Result<String, std::fmt::Error> {
    let mut out = String::with_capacity(64 * 1024);
    match format {
        Format::OpenMetrics => prometheus_client::encoding::text::encode(&mut out, registry)?,
        Format::PrometheusText => prometheus_client::encoding::prometheus_text::encode(&mut out, registry)?,
    }
    Ok(out)
}

/// A one-line summary of a window for logs.
pub fn describe(w: &GpuWindow) -> String {
    let mut s = format!("{} {}", w.time.to_rfc3339(), w.gpu.gpu_uuid);
    for f in [Field::GpuUtil, Field::SmActive, Field::PowerWatts] {
        if let Some(v) = w.value(f) {
            let _ = write!(s, " {}={v:.3}", f.column());
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use apron_common::{FieldStats, GpuUuid, HostName};

    use super::*;

    fn gpu(uuid: &str, parent: Option<&str>) -> GpuIdentity {
        GpuIdentity {
            cluster: None,
            host: HostName::new("node-1").expect("valid"),
            gpu_uuid: GpuUuid::new(uuid).expect("valid"),
            gpu_index: 0,
            gpu_model: "NVIDIA H100 80GB HBM3".into(),
            pci_bus_id: "00000000:18:00.0".into(),
            minor_number: Some(0),
            parent_gpu_uuid: parent.map(|p| GpuUuid::new(p).expect("valid")),
            mig_profile: parent.map(|_| "1g.10gb".to_owned()),
            mig_gpu_instance_id: parent.map(|_| 9),
        }
    }

    /// A window with a plausible value in every field (by unit), so the golden file reads
    /// like a real node.
    fn full_window(g: &GpuIdentity) -> GpuWindow {
        let mut w = GpuWindow::new(UnixMicros(10_000_000), std::time::Duration::from_secs(1), g.clone());
        for f in Field::ALL {
            let v = match f.unit() {
                "ratio" => 0.5,
                "bytes" => 40.0 * 1024.0 * 1024.0 * 1024.0,
                "watts" => 350.25,
                "celsius" => 61.0,
                "MHz" => 1980.0,
                "bytes/s" => 1.5e9,
                "joules" => 123_456.789,
                "code" => 79.0,
                "bitmask" => 4.0,
                "bool" => 0.0,
                _ => 3.0,
            };
            w.fields[f.index()] = Some(FieldStats { count: 4, mean: v, min: v * 0.5, max: v * 1.5, last: v });
        }
        w
    }

    fn rendered(format: Format) -> String {
        let parent = gpu("GPU-aaaa", None);
        let mig = gpu("MIG-bbbb", Some("GPU-aaaa"));
        let mut st = AgentState::new("nvml", Some("570.172.08".into()), &[parent.clone(), mig.clone()]);
        st.apply_windows(&[full_window(&parent), full_window(&mig)]);
        st.gpus[0].1.owner = OwnerLabels { pod: Some("p".into()), namespace: Some("ns".into()), container: None };
        st.samplers.insert(FieldGroup::Utilization, SamplerStats { runs: 3, up: true, ..Default::default() });
        st.unsupported.insert((FieldGroup::Gpm, "nvmlGpmSampleGet", Some(1)));
        st.processes.push(ProcessRow {
            time: UnixMicros(0),
            host: parent.host.clone(),
            gpu_uuid: parent.gpu_uuid.clone(),
            pid: 42,
            process_name: Some("python".into()),
            user: Some("alice".into()),
            fb_used_bytes: Some(1 << 30),
            sm_util: Some(0.5),
            container_id: None,
            pod: Some("p".into()),
            namespace: Some("ns".into()),
            container: None,
            pod_uid: None,
            job_id: None,
        });
        let mut ship = ShipStats {
            duplicates: 1,
            retries: 4,
            rejected_batches: 1,
            spooled_batches: 6,
            spool_bytes: 8192,
            spool_files: 2,
            spool_dropped_batches: 1,
            spool_dropped_rows: 16,
            last_success_time: Some(1_700_000_000.5),
            ack_seconds: 0.25,
            collector_up: Some(true),
            ..Default::default()
        };
        ship.sent.insert("gpu_samples", TableShipped { batches: 10, rows: 160 });
        st.ship = Some(ship);
        #[cfg(feature = "kubernetes")]
        {
            let mut k = crate::attribution::kube::KubeStats {
                pods: 12,
                last_success_time: Some(1_700_000_000.25),
                ..Default::default()
            };
            k.requests.insert("ok", 40);
            k.requests.insert("forbidden", 2);
            st.kubernetes = Some(k);
        }
        render(&registry(SharedState::new(st)), format).expect("renders")
    }

    #[test]
    fn every_family_is_documented() {
        let docs = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/metrics.md"))
            .expect("docs/metrics.md");
        let text = rendered(Format::PrometheusText);
        let mut names = BTreeSet::new();
        for line in text.lines().filter_map(|l| l.strip_prefix("# TYPE ")) {
            names.insert(line.split(' ').next().unwrap_or_default().to_owned());
        }
        assert!(names.len() > 60, "{names:?}");
        for n in &names {
            assert!(docs.contains(&format!("`{n}")), "{n} is emitted but not in docs/metrics.md");
        }
    }

    /// The whole exposition for a fixed state, against a reviewed golden file. Lines
    /// about the test process itself (CPU, RSS, start time) vary and are left out.
    /// `UPDATE_GOLDEN=1 cargo test -p apron-agent golden` rewrites the file.
    #[test]
    fn a_slow_samplers_reading_stays_for_a_minute() {
        let g = GpuIdentity::gpu(HostName::new("h").expect("host"), GpuUuid::new("GPU-h").expect("uuid"), 0, "m");
        let mut st = AgentState::new("sim", None, std::slice::from_ref(&g));
        let row = |t: i64, replays: Option<f64>| {
            let mut w = GpuWindow::new(UnixMicros(t * 1_000_000), std::time::Duration::from_secs(1), g.clone());
            w.fields[Field::GpuUtil.index()] = Some(FieldStats { count: 1, mean: 0.5, min: 0.5, max: 0.5, last: 0.5 });
            w.fields[Field::PcieReplays.index()] =
                replays.map(|v| FieldStats { count: 1, mean: v, min: v, max: v, last: v });
            w
        };
        let replays = |st: &AgentState| st.gpus[0].1.last.as_ref().and_then(|w| w.value(Field::PcieReplays));
        st.apply_windows(&[row(100, Some(3.0))]);
        st.apply_windows(&[row(101, None)]);
        assert_eq!(replays(&st), Some(3.0), "held between readings");
        st.apply_windows(&[row(160, None)]);
        assert_eq!(replays(&st), Some(3.0), "60 s after its reading");
        st.apply_windows(&[row(161, None)]);
        assert_eq!(replays(&st), None, "gone when the sampler stopped");
    }

    #[test]
    fn golden_exposition() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/metrics.txt");
        let volatile =
            ["apron_agent_cpu_seconds", "apron_agent_resident_memory_bytes", "apron_agent_start_time_seconds"];
        let text: String = rendered(Format::OpenMetrics)
            .lines()
            .filter(|l| !volatile.iter().any(|v| l.starts_with(v) || l.contains(&format!(" {v}"))))
            .map(|l| format!("{l}\n"))
            .collect();
        if std::env::var_os("UPDATE_GOLDEN").is_some() {
            std::fs::write(path, &text).expect("write golden");
        }
        let golden = std::fs::read_to_string(path).expect("golden file (UPDATE_GOLDEN=1 creates it)");
        assert!(text == golden, "exposition differs from {path}; review and rerun with UPDATE_GOLDEN=1");
    }

    #[test]
    fn dcgm_labels_follow_dcgm_exporter() {
        let text = rendered(Format::OpenMetrics);
        assert!(text.contains(r#"DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-aaaa",pci_bus_id="00000000:18:00.0",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="node-1",DCGM_FI_DRIVER_VERSION="570.172.08",pod="p",namespace="ns"} 50.0"#), "{text}");
        // A MIG instance: the parent's identity plus GPU_I_PROFILE/GPU_I_ID.
        assert!(text.contains(r#"DCGM_FI_PROF_SM_ACTIVE{gpu="0",UUID="GPU-aaaa",pci_bus_id="00000000:18:00.0",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",GPU_I_PROFILE="1g.10gb",GPU_I_ID="9",Hostname="node-1""#), "{text}");
        assert!(text.contains("# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION gauge"));
        assert!(text.contains("apron_gpu_busy_seconds_total{"), "{text}");
        assert!(text.ends_with("# EOF\n"));
    }

    #[test]
    fn counters_integrate_window_means() {
        let g = gpu("GPU-aaaa", None);
        let mut st = AgentState::new("sim", None, std::slice::from_ref(&g));
        let mut w = full_window(&g);
        st.apply_windows(&[w.clone()]);
        w.fields[Field::GpuUtil.index()] = Some(FieldStats { count: 1, mean: 1.0, min: 1.0, max: 1.0, last: 1.0 });
        st.apply_windows(&[w.clone()]);
        w.fields[Field::GpuUtil.index()] = None;
        st.apply_windows(&[w]);
        let s = &st.gpus[0].1;
        assert!((s.busy_seconds - 1.5).abs() < 1e-12);
        assert!((s.util_observed_seconds - 2.0).abs() < 1e-12, "a window without readings is not observed");
    }

    #[test]
    fn lost_gpu_keeps_only_info_and_lost() {
        let g = gpu("GPU-aaaa", None);
        let mut st = AgentState::new("nvml", None, std::slice::from_ref(&g));
        let mut w = full_window(&g);
        st.apply_windows(&[w.clone()]);
        w.lost = true;
        w.fields = vec![None; Field::COUNT];
        st.apply_windows(&[w]);
        let text = render(&registry(SharedState::new(st)), Format::PrometheusText).expect("renders");
        assert!(!text.contains("DCGM_FI_DEV_GPU_UTIL{"), "{text}");
        assert!(text.contains("apron_gpu_lost{") && text.contains("} 1"), "{text}");
    }
}
