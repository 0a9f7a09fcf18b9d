//! The agent state as one OTLP `ExportMetricsServiceRequest`: the mapping from Apron's
//! fields to OpenTelemetry names (`docs/otlp.md` is the table).
//!
//! Names follow OpenTelemetry's hardware semantic conventions (`hw.gpu.*`, `hw.*`;
//! status "development") where one exists, `apron.gpu.*` otherwise. Units are UCUM
//! (`1` for ratios, `By`, `W`, `J`, `Cel`, `Hz`, `s`). Values are the same ones `/metrics`
//! shows: the last closed window per GPU (each data point is stamped with that window's
//! end) and the busy-time integrals; cumulative sums start at the agent's start.
//!
//! One `ResourceMetrics` per host of the inventory (a real agent has one; the simulator
//! runs a fleet of hosts): the conventions put the host in the resource, and the
//! GPU (`hw.id`, …) and its holder (`k8s.pod.name`, …) on each data point.

use std::collections::HashMap;

use apron_common::{Field, GpuIdentity, GpuWindow, UnixMicros};
use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
use opentelemetry_proto::tonic::common::v1::{AnyValue, InstrumentationScope, KeyValue, any_value};
use opentelemetry_proto::tonic::metrics::v1::{
    AggregationTemporality, Gauge, Metric, NumberDataPoint, ResourceMetrics, ScopeMetrics, Sum, metric,
    number_data_point,
};
use opentelemetry_proto::tonic::resource::v1::Resource;

use crate::exposition::{AgentState, GpuState, OwnerLabels};

/// The OpenTelemetry instrument a metric is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Instrument {
    Gauge,
    /// A monotonic cumulative sum.
    Counter,
    /// A non-monotonic cumulative sum.
    UpDownCounter,
}

/// One metric: its name, UCUM unit, instrument and description.
#[derive(Debug)]
pub struct Spec {
    pub name: &'static str,
    pub unit: &'static str,
    pub instrument: Instrument,
    pub description: &'static str,
}

const fn spec(name: &'static str, unit: &'static str, instrument: Instrument, description: &'static str) -> Spec {
    Spec { name, unit, instrument, description }
}

use Instrument::{Counter, Gauge as G, UpDownCounter as UpDown};

pub const HW_GPU_UTILIZATION: Spec = spec("hw.gpu.utilization", "1", G, "Fraction of time spent in a specific task.");
pub const HW_GPU_MEMORY_USAGE: Spec = spec("hw.gpu.memory.usage", "By", UpDown, "GPU memory used.");
pub const HW_GPU_MEMORY_LIMIT: Spec = spec("hw.gpu.memory.limit", "By", UpDown, "Size of the GPU memory.");
pub const HW_GPU_MEMORY_UTILIZATION: Spec = spec("hw.gpu.memory.utilization", "1", G, "Fraction of GPU memory used.");
pub const HW_POWER: Spec = spec("hw.power", "W", G, "Instantaneous power consumed by the component.");
pub const HW_ENERGY: Spec = spec("hw.energy", "J", Counter, "Energy consumed by the component.");
pub const HW_TEMPERATURE: Spec = spec("hw.temperature", "Cel", G, "Temperature in degrees Celsius.");
pub const HW_ERRORS: Spec = spec("hw.errors", "{error}", Counter, "Number of errors encountered by the component.");
pub const HW_STATUS: Spec =
    spec("hw.status", "1", UpDown, "Operational status: 1 (true) or 0 (false) for each of the possible states.");

pub const UTILIZATION_MAX: Spec =
    spec("apron.gpu.utilization.max", "1", G, "Highest utilisation reading in the window (idleness is decided on it).");
pub const MEMORY_COPY_UTILIZATION: Spec = spec(
    "apron.gpu.memory_copy.utilization",
    "1",
    G,
    "Fraction of time device memory was being read or written (NVML utilization.memory).",
);
pub const GR_ENGINE_ACTIVE: Spec =
    spec("apron.gpu.gr_engine_active", "1", G, "Fraction of time the graphics or compute engine was active (GPM).");
pub const SM_ACTIVE: Spec =
    spec("apron.gpu.sm_active", "1", G, "Fraction of cycles an SM had at least one warp assigned (GPM).");
pub const SM_ACTIVE_MAX: Spec = spec("apron.gpu.sm_active.max", "1", G, "Highest SM activity reading in the window.");
pub const SM_OCCUPANCY: Spec =
    spec("apron.gpu.sm_occupancy", "1", G, "Warps resident on an SM relative to the maximum (GPM).");
pub const TENSOR_ACTIVE: Spec =
    spec("apron.gpu.tensor_active", "1", G, "Fraction of cycles any tensor pipe was active (GPM).");
pub const DRAM_ACTIVE: Spec =
    spec("apron.gpu.dram_active", "1", G, "Fraction of cycles the memory interface was busy (GPM).");
pub const FP64_ACTIVE: Spec = spec("apron.gpu.fp64_active", "1", G, "Fraction of cycles the FP64 pipe was active.");
pub const FP32_ACTIVE: Spec = spec("apron.gpu.fp32_active", "1", G, "Fraction of cycles the FP32 pipe was active.");
pub const FP16_ACTIVE: Spec = spec("apron.gpu.fp16_active", "1", G, "Fraction of cycles the FP16 pipe was active.");
pub const MEMORY_FREE: Spec = spec("apron.gpu.memory.free", "By", UpDown, "Framebuffer memory free.");
pub const MEMORY_RESERVED: Spec =
    spec("apron.gpu.memory.reserved", "By", UpDown, "Framebuffer memory reserved by the driver and firmware.");
pub const CLOCK_SM: Spec = spec("apron.gpu.clock.sm", "Hz", G, "SM clock frequency.");
pub const CLOCK_MEMORY: Spec = spec("apron.gpu.clock.memory", "Hz", G, "Memory clock frequency.");
pub const PCIE_THROUGHPUT: Spec = spec("apron.gpu.pcie.throughput", "By/s", G, "PCIe throughput.");
pub const NVLINK_THROUGHPUT: Spec = spec("apron.gpu.nvlink.throughput", "By/s", G, "NVLink throughput, all links.");
pub const CLOCKS_EVENT_REASONS: Spec =
    spec("apron.gpu.clocks_event_reasons", "1", G, "NVML clocks event (throttle) reasons bitmask.");
pub const ROW_REMAP_PENDING: Spec =
    spec("apron.gpu.row_remap.pending", "1", G, "1 when a row remap is pending (needs a GPU reset).");
pub const ROW_REMAP_FAILURE: Spec = spec("apron.gpu.row_remap.failure", "1", G, "1 when a row remap has failed.");
pub const XID_LAST: Spec = spec("apron.gpu.xid.last", "1", G, "The last XID error code seen on the GPU.");
pub const PCIE_REPLAYS: Spec =
    spec("apron.gpu.pcie.replays", "{replay}", Counter, "PCIe replays since the driver loaded.");
pub const REMAPPED_ROWS: Spec = spec("apron.gpu.remapped_rows", "{row}", Counter, "Rows remapped.");
pub const BUSY_TIME: Spec =
    spec("apron.gpu.busy_time", "s", Counter, "Seconds a kernel was running: the integral of utilisation over time.");
pub const SM_ACTIVE_TIME: Spec =
    spec("apron.gpu.sm_active_time", "s", Counter, "SM-active seconds: the integral of sm_active over time (GPM).");
pub const TENSOR_ACTIVE_TIME: Spec = spec(
    "apron.gpu.tensor_active_time",
    "s",
    Counter,
    "Tensor-active seconds: the integral of tensor_active over time (GPM).",
);
pub const OBSERVED_TIME: Spec = spec(
    "apron.gpu.observed_time",
    "s",
    Counter,
    "Seconds with readings of a signal; rate(busy_time)/rate(observed_time) is utilisation over known time.",
);
pub const PROCESS_MEMORY_USAGE: Spec =
    spec("apron.gpu.process.memory.usage", "By", UpDown, "GPU memory used by a process.");
pub const PROCESS_SM_UTILIZATION: Spec = spec(
    "apron.gpu.process.sm_utilization",
    "1",
    G,
    "A process's SM utilisation from the driver's per-process samples.",
);

/// Every metric this module can emit, in emission order.
pub const ALL: &[&Spec] = &[
    &HW_GPU_UTILIZATION,
    &UTILIZATION_MAX,
    &MEMORY_COPY_UTILIZATION,
    &GR_ENGINE_ACTIVE,
    &SM_ACTIVE,
    &SM_ACTIVE_MAX,
    &SM_OCCUPANCY,
    &TENSOR_ACTIVE,
    &DRAM_ACTIVE,
    &FP64_ACTIVE,
    &FP32_ACTIVE,
    &FP16_ACTIVE,
    &HW_GPU_MEMORY_USAGE,
    &HW_GPU_MEMORY_LIMIT,
    &HW_GPU_MEMORY_UTILIZATION,
    &MEMORY_FREE,
    &MEMORY_RESERVED,
    &HW_POWER,
    &HW_ENERGY,
    &HW_TEMPERATURE,
    &CLOCK_SM,
    &CLOCK_MEMORY,
    &PCIE_THROUGHPUT,
    &NVLINK_THROUGHPUT,
    &CLOCKS_EVENT_REASONS,
    &ROW_REMAP_PENDING,
    &ROW_REMAP_FAILURE,
    &XID_LAST,
    &HW_ERRORS,
    &PCIE_REPLAYS,
    &REMAPPED_ROWS,
    &HW_STATUS,
    &BUSY_TIME,
    &SM_ACTIVE_TIME,
    &TENSOR_ACTIVE_TIME,
    &OBSERVED_TIME,
    &PROCESS_MEMORY_USAGE,
    &PROCESS_SM_UTILIZATION,
];

/// Which statistic of the window a data point carries.
#[derive(Clone, Copy)]
enum Stat {
    Mean,
    Max,
    Last,
}

/// A per-GPU metric read from one field of the last window.
struct FromField {
    spec: &'static Spec,
    field: Field,
    stat: Stat,
    scale: f64,
    /// An attribute that tells series of one metric apart (`hw.gpu.task`, …).
    extra: Option<(&'static str, &'static str)>,
    /// Integer-valued (bytes, codes, counts) rather than a ratio or a level.
    int: bool,
    /// Carries the holder's attributes (`k8s.*`), as the native `/metrics` families do;
    /// device counters and states do not.
    owner: bool,
}

const fn f(
    spec: &'static Spec,
    field: Field,
    stat: Stat,
    extra: Option<(&'static str, &'static str)>,
    int: bool,
    owner: bool,
) -> FromField {
    FromField { spec, field, stat, scale: 1.0, extra, int, owner }
}

const TASK: &str = "hw.gpu.task";
const DIRECTION: &str = "network.io.direction";

const FROM_FIELDS: &[FromField] = &[
    f(&HW_GPU_UTILIZATION, Field::GpuUtil, Stat::Mean, Some((TASK, "general")), false, true),
    f(&HW_GPU_UTILIZATION, Field::EncUtil, Stat::Mean, Some((TASK, "encoder")), false, true),
    f(&HW_GPU_UTILIZATION, Field::DecUtil, Stat::Mean, Some((TASK, "decoder")), false, true),
    f(&UTILIZATION_MAX, Field::GpuUtil, Stat::Max, None, false, true),
    f(&MEMORY_COPY_UTILIZATION, Field::MemCopyUtil, Stat::Mean, None, false, true),
    f(&GR_ENGINE_ACTIVE, Field::GrEngineActive, Stat::Mean, None, false, true),
    f(&SM_ACTIVE, Field::SmActive, Stat::Mean, None, false, true),
    f(&SM_ACTIVE_MAX, Field::SmActive, Stat::Max, None, false, true),
    f(&SM_OCCUPANCY, Field::SmOccupancy, Stat::Mean, None, false, true),
    f(&TENSOR_ACTIVE, Field::TensorActive, Stat::Mean, None, false, true),
    f(&DRAM_ACTIVE, Field::DramActive, Stat::Mean, None, false, true),
    f(&FP64_ACTIVE, Field::Fp64Active, Stat::Mean, None, false, true),
    f(&FP32_ACTIVE, Field::Fp32Active, Stat::Mean, None, false, true),
    f(&FP16_ACTIVE, Field::Fp16Active, Stat::Mean, None, false, true),
    f(&HW_GPU_MEMORY_USAGE, Field::FbUsedBytes, Stat::Mean, None, true, true),
    f(&HW_GPU_MEMORY_LIMIT, Field::FbTotalBytes, Stat::Last, None, true, true),
    f(&MEMORY_FREE, Field::FbFreeBytes, Stat::Mean, None, true, true),
    f(&MEMORY_RESERVED, Field::FbReservedBytes, Stat::Last, None, true, true),
    f(&HW_POWER, Field::PowerWatts, Stat::Mean, None, false, true),
    FromField { scale: 1e6, ..f(&CLOCK_SM, Field::SmClockMhz, Stat::Mean, None, false, true) },
    FromField { scale: 1e6, ..f(&CLOCK_MEMORY, Field::MemClockMhz, Stat::Mean, None, false, true) },
    f(&PCIE_THROUGHPUT, Field::PcieTxBytesPerS, Stat::Mean, Some((DIRECTION, "transmit")), false, true),
    f(&PCIE_THROUGHPUT, Field::PcieRxBytesPerS, Stat::Mean, Some((DIRECTION, "receive")), false, true),
    f(&NVLINK_THROUGHPUT, Field::NvlinkTxBytesPerS, Stat::Mean, Some((DIRECTION, "transmit")), false, true),
    f(&NVLINK_THROUGHPUT, Field::NvlinkRxBytesPerS, Stat::Mean, Some((DIRECTION, "receive")), false, true),
    f(&CLOCKS_EVENT_REASONS, Field::ClocksEventReasons, Stat::Last, None, true, true),
    f(&ROW_REMAP_PENDING, Field::RowRemapPending, Stat::Last, None, true, true),
    f(&ROW_REMAP_FAILURE, Field::RowRemapFailure, Stat::Last, None, true, true),
    // Device counters (since the driver loaded), no holder.
    f(&HW_ENERGY, Field::EnergyJoules, Stat::Last, None, false, false),
    f(&HW_ERRORS, Field::EccSbeTotal, Stat::Last, Some(("error.type", "corrected")), true, false),
    f(&HW_ERRORS, Field::EccDbeTotal, Stat::Last, Some(("error.type", "uncorrected")), true, false),
    f(&PCIE_REPLAYS, Field::PcieReplays, Stat::Last, None, true, false),
    f(&REMAPPED_ROWS, Field::RemappedRowsCorrectable, Stat::Last, Some((REMAP_CAUSE, "correctable")), true, false),
    f(&REMAPPED_ROWS, Field::RemappedRowsUncorrectable, Stat::Last, Some((REMAP_CAUSE, "uncorrectable")), true, false),
];

const REMAP_CAUSE: &str = "apron.gpu.remap.cause";

/// The service this agent is, for the resource and the instrumentation scope.
pub const SERVICE_NAME: &str = "apron-agent";
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

fn kv(key: &str, value: any_value::Value) -> KeyValue {
    KeyValue { key: key.to_owned(), value: Some(AnyValue { value: Some(value) }) }
}

fn s(key: &str, value: impl Into<String>) -> KeyValue {
    kv(key, any_value::Value::StringValue(value.into()))
}

fn i(key: &str, value: i64) -> KeyValue {
    kv(key, any_value::Value::IntValue(value))
}

fn nanos(t: UnixMicros) -> u64 {
    u64::try_from(t.0).unwrap_or(0).saturating_mul(1000)
}

/// `hw.name`: `gpu<index>`, and `gpu<index>-gi<id>` for a MIG instance.
fn hw_name(g: &GpuIdentity) -> String {
    match g.mig_gpu_instance_id {
        Some(gi) => format!("gpu{}-gi{gi}", g.gpu_index),
        None => format!("gpu{}", g.gpu_index),
    }
}

/// The GPU's attributes (`hw.*`, Apron's identity extras).
fn gpu_attrs(g: &GpuIdentity, driver: Option<&str>) -> Vec<KeyValue> {
    let mut a = vec![
        s("hw.id", g.gpu_uuid.as_str()),
        s("hw.type", "gpu"),
        s("hw.name", hw_name(g)),
        s("hw.vendor", "NVIDIA"),
        s("hw.model", g.gpu_model.clone()),
    ];
    if let Some(d) = driver {
        a.push(s("hw.driver_version", d));
    }
    if let Some(p) = &g.parent_gpu_uuid {
        a.push(s("hw.parent", p.as_str()));
    }
    a.push(i("apron.gpu.index", i64::from(g.gpu_index)));
    if !g.pci_bus_id.is_empty() {
        a.push(s("apron.gpu.pci_bus_id", g.pci_bus_id.clone()));
    }
    if let Some(p) = &g.mig_profile {
        a.push(s("apron.gpu.mig.profile", p.clone()));
    }
    a
}

/// Who holds the GPU: the pod (as `/metrics` labels it) and a Slurm job.
fn owner_attrs(a: &mut Vec<KeyValue>, owner: &OwnerLabels, window: Option<&GpuWindow>) {
    for (k, v) in [
        ("k8s.namespace.name", &owner.namespace),
        ("k8s.pod.name", &owner.pod),
        ("k8s.container.name", &owner.container),
    ] {
        if let Some(v) = v {
            a.push(s(k, v.clone()));
        }
    }
    if let Some(job) = window.and_then(|w| w.owner.as_ref()).and_then(|h| h.job_id.as_ref()) {
        a.push(s("apron.slurm.job_id", job.clone()));
    }
}

#[derive(Clone, Copy)]
enum Value {
    F(f64),
    I(i64),
}

/// The metrics of one resource (host), in first-emitted order.
#[derive(Default)]
struct Metrics {
    metrics: Vec<Metric>,
    index: HashMap<&'static str, usize>,
}

impl Metrics {
    fn point(&mut self, spec: &'static Spec, attributes: Vec<KeyValue>, value: Value, time: u64, start: u64) {
        let at = *self.index.entry(spec.name).or_insert_with(|| {
            let data = match spec.instrument {
                Instrument::Gauge => metric::Data::Gauge(Gauge { data_points: Vec::new() }),
                Instrument::Counter | Instrument::UpDownCounter => metric::Data::Sum(Sum {
                    data_points: Vec::new(),
                    aggregation_temporality: AggregationTemporality::Cumulative as i32,
                    is_monotonic: spec.instrument == Instrument::Counter,
                }),
            };
            self.metrics.push(Metric {
                name: spec.name.to_owned(),
                description: spec.description.to_owned(),
                unit: spec.unit.to_owned(),
                data: Some(data),
                ..Default::default()
            });
            self.metrics.len() - 1
        });
        let value = Some(match value {
            Value::F(v) => number_data_point::Value::AsDouble(v),
            Value::I(v) => number_data_point::Value::AsInt(v),
        });
        let (points, start) = match self.metrics.get_mut(at).and_then(|m| m.data.as_mut()) {
            Some(metric::Data::Gauge(g)) => (&mut g.data_points, 0),
            Some(metric::Data::Sum(s)) => (&mut s.data_points, start),
            _ => return,
        };
        points.push(NumberDataPoint {
            attributes,
            start_time_unix_nano: start,
            time_unix_nano: time,
            value,
            ..Default::default()
        });
    }
}

fn with(mut base: Vec<KeyValue>, extra: impl IntoIterator<Item = KeyValue>) -> Vec<KeyValue> {
    base.extend(extra);
    base
}

/// Encodes one GPU's data points.
fn gpu_points(out: &mut Metrics, g: &GpuIdentity, st: &GpuState, driver: Option<&str>, now: u64, start: u64) {
    let device = gpu_attrs(g, driver);
    let held = {
        let mut a = device.clone();
        owner_attrs(&mut a, &st.owner, st.last.as_ref());
        a
    };
    let window_time = st.last.as_ref().map_or(now, |w| nanos(w.time));

    let ok = if st.lost { 0 } else { 1 };
    out.point(&HW_STATUS, with(device.clone(), [s("hw.state", "ok")]), Value::I(ok), now, start);
    out.point(&HW_STATUS, with(device.clone(), [s("hw.state", "failed")]), Value::I(1 - ok), now, start);

    // Integrals cover every window since start, a lost GPU's included (as on /metrics).
    if st.util_observed_seconds > 0.0 {
        out.point(&BUSY_TIME, held.clone(), Value::F(st.busy_seconds), window_time, start);
    }
    if st.sm_observed_seconds > 0.0 {
        out.point(&SM_ACTIVE_TIME, held.clone(), Value::F(st.sm_active_seconds), window_time, start);
        out.point(&TENSOR_ACTIVE_TIME, held.clone(), Value::F(st.tensor_active_seconds), window_time, start);
    }
    for (signal, secs) in [("gpu_util", st.util_observed_seconds), ("sm_active", st.sm_observed_seconds)] {
        if secs > 0.0 {
            out.point(
                &OBSERVED_TIME,
                with(held.clone(), [s("apron.signal", signal)]),
                Value::F(secs),
                window_time,
                start,
            );
        }
    }

    // A lost GPU has no measurements, only its status (and the integrals above).
    let Some(w) = st.last.as_ref().filter(|_| !st.lost) else { return };
    for m in FROM_FIELDS {
        let Some(stats) = w.get(m.field) else { continue };
        let v = match m.stat {
            Stat::Mean => stats.mean,
            Stat::Max => stats.max,
            Stat::Last => stats.last,
        } * m.scale;
        let base = if m.owner { &held } else { &device };
        let attrs = with(base.clone(), m.extra.map(|(k, val)| s(k, val)));
        let value = if m.int { Value::I(v.round() as i64) } else { Value::F(v) };
        out.point(m.spec, attrs, value, window_time, start);
    }
    if let (Some(used), Some(total)) = (w.value(Field::FbUsedBytes), w.value(Field::FbTotalBytes))
        && total > 0.0
    {
        out.point(&HW_GPU_MEMORY_UTILIZATION, held.clone(), Value::F(used / total), window_time, start);
    }
    // A temperature sensor is its own component (hw.type = temperature) whose parent is
    // the GPU.
    for (field, location, id) in [(Field::GpuTempC, "GPU_DIE", "gpu"), (Field::MemTempC, "GPU_MEMORY", "memory")] {
        if let Some(c) = w.get(field).map(|x| x.mean) {
            let attrs = vec![
                s("hw.id", format!("{}/temperature/{id}", g.gpu_uuid.as_str())),
                s("hw.type", "temperature"),
                s("hw.name", format!("{} {id} temperature", hw_name(g))),
                s("hw.parent", g.gpu_uuid.as_str()),
                s("hw.temperature.sensor_location", location),
            ];
            out.point(&HW_TEMPERATURE, attrs, Value::F(c), window_time, start);
        }
    }
    if let Some(x) = st.xid_last {
        out.point(&XID_LAST, device, Value::I(x.round() as i64), window_time, start);
    }
}

/// The resource of one host.
fn resource(host: &str, g: &GpuIdentity, agent_host: &str, source: &str) -> Resource {
    let mut attributes = vec![
        s("service.name", SERVICE_NAME),
        s("service.namespace", "apron"),
        s("service.version", VERSION),
        s("service.instance.id", agent_host),
        s("host.name", host),
        s("apron.source", source),
    ];
    if let Some(c) = &g.cluster {
        attributes.push(s("apron.cluster", c.to_string()));
    }
    Resource { attributes, ..Default::default() }
}

/// The whole state as one request: one `ResourceMetrics` per host, in inventory order.
/// `agent_host` is the agent's own host name (`service.instance.id`); `now` stamps the
/// data points that have no window (status, before the first window).
pub fn snapshot(st: &AgentState, agent_host: &str, now: UnixMicros) -> ExportMetricsServiceRequest {
    let now = nanos(now);
    let start = (st.start_time * 1e9) as u64;
    let driver = st.driver_version.as_deref();
    let mut hosts: Vec<(String, Resource, Metrics)> = Vec::new();
    let slot = |hosts: &mut Vec<(String, Resource, Metrics)>, host: &str, g: &GpuIdentity| -> usize {
        if let Some(k) = hosts.iter().position(|(h, _, _)| h == host) {
            return k;
        }
        hosts.push((host.to_owned(), resource(host, g, agent_host, st.source), Metrics::default()));
        hosts.len() - 1
    };
    for (g, gs) in &st.gpus {
        let k = slot(&mut hosts, g.host.as_str(), g);
        if let Some((_, _, m)) = hosts.get_mut(k) {
            gpu_points(m, g, gs, driver, now, start);
        }
    }
    for p in &st.processes {
        let Some((g, _)) = st.gpus.iter().find(|(g, _)| g.gpu_uuid == p.gpu_uuid) else { continue };
        let k = slot(&mut hosts, p.host.as_str(), g);
        let Some((_, _, m)) = hosts.get_mut(k) else { continue };
        let mut a = vec![s("hw.id", p.gpu_uuid.as_str()), s("hw.type", "gpu"), i("process.pid", i64::from(p.pid))];
        let optional = [
            ("process.executable.name", &p.process_name),
            ("process.owner", &p.user),
            ("k8s.namespace.name", &p.namespace),
            ("k8s.pod.name", &p.pod),
            ("k8s.container.name", &p.container),
            ("k8s.pod.uid", &p.pod_uid),
            ("container.id", &p.container_id),
            ("apron.slurm.job_id", &p.job_id),
        ];
        for (key, v) in optional {
            if let Some(v) = v {
                a.push(s(key, v.clone()));
            }
        }
        let time = nanos(p.time);
        if let Some(b) = p.fb_used_bytes {
            m.point(&PROCESS_MEMORY_USAGE, a.clone(), Value::I(b), time, start);
        }
        if let Some(u) = p.sm_util {
            m.point(&PROCESS_SM_UTILIZATION, a, Value::F(u), time, start);
        }
    }
    let scope =
        InstrumentationScope { name: SERVICE_NAME.to_owned(), version: VERSION.to_owned(), ..Default::default() };
    ExportMetricsServiceRequest {
        resource_metrics: hosts
            .into_iter()
            .map(|(_, resource, m)| ResourceMetrics {
                resource: Some(resource),
                scope_metrics: vec![ScopeMetrics {
                    scope: Some(scope.clone()),
                    metrics: m.metrics,
                    ..Default::default()
                }],
                ..Default::default()
            })
            .collect(),
    }
}

/// Data points in a request (for logs).
pub fn count_points(req: &ExportMetricsServiceRequest) -> usize {
    req.resource_metrics
        .iter()
        .flat_map(|r| &r.scope_metrics)
        .flat_map(|s| &s.metrics)
        .map(|m| match &m.data {
            Some(metric::Data::Gauge(g)) => g.data_points.len(),
            Some(metric::Data::Sum(s)) => s.data_points.len(),
            _ => 0,
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use apron_common::{FieldStats, GpuUuid, HostName, ProcessRow};

    use super::*;

    fn gpu(host: &str, uuid: &str, index: u32) -> GpuIdentity {
        GpuIdentity::gpu(
            HostName::new(host.to_owned()).expect("host"),
            GpuUuid::new(uuid.to_owned()).expect("uuid"),
            index,
            "NVIDIA H100 80GB HBM3",
        )
    }

    fn window(g: &GpuIdentity, end_us: i64, fields: &[(Field, f64)]) -> GpuWindow {
        let mut w = GpuWindow::new(UnixMicros(end_us), Duration::from_secs(1), g.clone());
        for &(field, v) in fields {
            w.fields[field.index()] = Some(FieldStats { count: 1, mean: v, min: v, max: v, last: v });
        }
        w
    }

    fn attr<'a>(attrs: &'a [KeyValue], key: &str) -> Option<&'a any_value::Value> {
        attrs.iter().find(|a| a.key == key)?.value.as_ref()?.value.as_ref()
    }

    fn str_attr<'a>(attrs: &'a [KeyValue], key: &str) -> Option<&'a str> {
        match attr(attrs, key)? {
            any_value::Value::StringValue(v) => Some(v),
            _ => None,
        }
    }

    fn points<'a>(r: &'a ResourceMetrics, name: &str) -> Vec<&'a NumberDataPoint> {
        r.scope_metrics
            .iter()
            .flat_map(|s| &s.metrics)
            .filter(|m| m.name == name)
            .flat_map(|m| match &m.data {
                Some(metric::Data::Gauge(g)) => g.data_points.iter().collect::<Vec<_>>(),
                Some(metric::Data::Sum(s)) => s.data_points.iter().collect(),
                _ => Vec::new(),
            })
            .collect()
    }

    fn state() -> AgentState {
        let a = gpu("node-a", "GPU-aaaa", 0);
        let b = gpu("node-b", "GPU-bbbb", 0);
        let mut st = AgentState::new("sim", Some("550.54".into()), &[a.clone(), b.clone()]);
        st.start_time = 1_700_000_000.0;
        st.apply_windows(&[
            window(
                &a,
                1_700_000_010_000_000,
                &[
                    (Field::GpuUtil, 0.25),
                    (Field::EncUtil, 0.5),
                    (Field::FbUsedBytes, 1024.0),
                    (Field::FbTotalBytes, 4096.0),
                    (Field::GpuTempC, 40.0),
                    (Field::EnergyJoules, 5.5),
                    (Field::EccDbeTotal, 2.0),
                    (Field::SmClockMhz, 1500.0),
                    (Field::PcieRxBytesPerS, 10.0),
                ],
            ),
            window(&b, 1_700_000_010_000_000, &[(Field::GpuUtil, 1.0)]),
        ]);
        st.gpus[0].1.owner = OwnerLabels { pod: Some("p".into()), namespace: Some("ns".into()), container: None };
        st.gpus[1].1.lost = true;
        st.processes.push(ProcessRow {
            time: UnixMicros(1_700_000_009_000_000),
            host: a.host.clone(),
            gpu_uuid: a.gpu_uuid.clone(),
            pid: 42,
            process_name: Some("python".into()),
            user: Some("alice".into()),
            fb_used_bytes: Some(512),
            sm_util: Some(0.3),
            container_id: None,
            pod: Some("p".into()),
            namespace: Some("ns".into()),
            container: None,
            pod_uid: None,
            job_id: None,
        });
        st
    }

    #[test]
    fn one_resource_per_host_with_the_conventions() {
        let req = snapshot(&state(), "agent-host", UnixMicros(1_700_000_011_000_000));
        assert_eq!(req.resource_metrics.len(), 2);
        let r = &req.resource_metrics[0];
        let res = &r.resource.as_ref().expect("resource").attributes;
        assert_eq!(str_attr(res, "host.name"), Some("node-a"));
        assert_eq!(str_attr(res, "service.name"), Some("apron-agent"));
        assert_eq!(str_attr(res, "service.instance.id"), Some("agent-host"));

        let util = points(r, "hw.gpu.utilization");
        assert_eq!(util.len(), 2, "general and encoder");
        let general = util.iter().find(|p| str_attr(&p.attributes, TASK) == Some("general")).expect("general");
        assert_eq!(general.value, Some(number_data_point::Value::AsDouble(0.25)));
        assert_eq!(general.time_unix_nano, 1_700_000_010_000_000_000, "stamped with the window end");
        assert_eq!(str_attr(&general.attributes, "hw.id"), Some("GPU-aaaa"));
        assert_eq!(str_attr(&general.attributes, "hw.type"), Some("gpu"));
        assert_eq!(str_attr(&general.attributes, "hw.driver_version"), Some("550.54"));
        assert_eq!(str_attr(&general.attributes, "k8s.pod.name"), Some("p"));
        assert_eq!(str_attr(&general.attributes, "k8s.namespace.name"), Some("ns"));

        let mem = points(r, "hw.gpu.memory.usage");
        assert_eq!(mem[0].value, Some(number_data_point::Value::AsInt(1024)));
        assert_eq!(mem[0].start_time_unix_nano, 1_700_000_000_000_000_000, "sums start at the agent's start");
        let frac = points(r, "hw.gpu.memory.utilization");
        assert_eq!(frac[0].value, Some(number_data_point::Value::AsDouble(0.25)));
        let clock = points(r, "apron.gpu.clock.sm");
        assert_eq!(clock[0].value, Some(number_data_point::Value::AsDouble(1.5e9)), "MHz → Hz");
        let energy = points(r, "hw.energy");
        assert!(str_attr(&energy[0].attributes, "k8s.pod.name").is_none(), "device counters carry no holder");
        let errors = points(r, "hw.errors");
        assert_eq!(str_attr(&errors[0].attributes, "error.type"), Some("uncorrected"));
        let temp = points(r, "hw.temperature");
        assert_eq!(str_attr(&temp[0].attributes, "hw.parent"), Some("GPU-aaaa"));
        assert_eq!(str_attr(&temp[0].attributes, "hw.type"), Some("temperature"));
        let pcie = points(r, "apron.gpu.pcie.throughput");
        assert_eq!(str_attr(&pcie[0].attributes, DIRECTION), Some("receive"));
        let busy = points(r, "apron.gpu.busy_time");
        assert_eq!(busy[0].value, Some(number_data_point::Value::AsDouble(0.25)));
        let proc_mem = points(r, "apron.gpu.process.memory.usage");
        assert_eq!(proc_mem[0].value, Some(number_data_point::Value::AsInt(512)));
        assert_eq!(attr(&proc_mem[0].attributes, "process.pid"), Some(&any_value::Value::IntValue(42)));
        assert_eq!(str_attr(&proc_mem[0].attributes, "process.owner"), Some("alice"));

        // The lost GPU: its status and integrals, no measurements.
        let lost = &req.resource_metrics[1];
        assert!(points(lost, "hw.gpu.utilization").is_empty());
        let status = points(lost, "hw.status");
        let failed = status.iter().find(|p| str_attr(&p.attributes, "hw.state") == Some("failed")).expect("failed");
        assert_eq!(failed.value, Some(number_data_point::Value::AsInt(1)));
        assert_eq!(points(lost, "apron.gpu.busy_time").len(), 1);
    }

    #[test]
    fn every_metric_is_documented() {
        let doc =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/otlp.md")).expect("docs/otlp.md");
        for spec in ALL {
            assert!(doc.contains(&format!("`{}`", spec.name)), "{} is not in docs/otlp.md", spec.name);
        }
        for m in FROM_FIELDS {
            assert!(ALL.iter().any(|s| s.name == m.spec.name), "{} missing from ALL", m.spec.name);
        }
    }
}
