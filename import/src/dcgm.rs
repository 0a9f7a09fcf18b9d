//! dcgm-exporter's vocabulary: which metric names become which [`Field`] (with the unit
//! conversion to Apron's base units), and how a series' labels name a GPU, a MIG
//! instance, a host and the pod holding the GPU.
//!
//! The metric table is the inverse of the agent's dcgm-exporter-compatible exposition
//! (`agent/src/exposition.rs`), so a history scraped from either exporter imports alike.

use apron_common::{Field, GpuIdentity, GpuUuid, HostName};

use crate::{ImportOptions, reason};

/// One dcgm-exporter metric and the field it fills.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MetricMapping {
    /// dcgm-exporter's metric name, e.g. `DCGM_FI_DEV_GPU_UTIL`.
    pub name: &'static str,
    pub field: Field,
    /// Multiplier from dcgm-exporter's unit to the field's base unit (% → ratio: 0.01,
    /// MiB → bytes: 1048576, mJ → J: 0.001).
    pub scale: f64,
}

impl MetricMapping {
    /// `raw` (dcgm-exporter's unit) in the field's base unit.
    pub fn to_base(&self, raw: f64) -> f64 {
        // Dividing by 100 gives the correctly rounded ratio (35 % → 0.35 as written);
        // multiplying by 0.01 is off by an ulp for some percentages.
        if self.scale < 1.0 { raw / self.scale.recip() } else { raw * self.scale }
    }
}

const MIB: f64 = 1_048_576.0;

const fn m(name: &'static str, field: Field, scale: f64) -> MetricMapping {
    MetricMapping { name, field, scale }
}

/// Every dcgm-exporter metric the importer maps. Names not listed are counted under
/// [`reason::NOT_MAPPED`].
pub const MAPPINGS: &[MetricMapping] = &[
    m("DCGM_FI_DEV_GPU_UTIL", Field::GpuUtil, 0.01),
    m("DCGM_FI_DEV_MEM_COPY_UTIL", Field::MemCopyUtil, 0.01),
    m("DCGM_FI_DEV_ENC_UTIL", Field::EncUtil, 0.01),
    m("DCGM_FI_DEV_DEC_UTIL", Field::DecUtil, 0.01),
    m("DCGM_FI_DEV_FB_USED", Field::FbUsedBytes, MIB),
    m("DCGM_FI_DEV_FB_FREE", Field::FbFreeBytes, MIB),
    m("DCGM_FI_DEV_FB_RESERVED", Field::FbReservedBytes, MIB),
    m("DCGM_FI_DEV_FB_TOTAL", Field::FbTotalBytes, MIB),
    m("DCGM_FI_DEV_POWER_USAGE", Field::PowerWatts, 1.0),
    m("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", Field::EnergyJoules, 0.001),
    m("DCGM_FI_DEV_GPU_TEMP", Field::GpuTempC, 1.0),
    m("DCGM_FI_DEV_MEMORY_TEMP", Field::MemTempC, 1.0),
    m("DCGM_FI_DEV_SM_CLOCK", Field::SmClockMhz, 1.0),
    m("DCGM_FI_DEV_MEM_CLOCK", Field::MemClockMhz, 1.0),
    m("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", Field::ClocksEventReasons, 1.0),
    m("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", Field::ClocksEventReasons, 1.0),
    m("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", Field::PcieReplays, 1.0),
    m("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", Field::EccSbeTotal, 1.0),
    m("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", Field::EccDbeTotal, 1.0),
    m("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", Field::RemappedRowsCorrectable, 1.0),
    m("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", Field::RemappedRowsUncorrectable, 1.0),
    m("DCGM_FI_DEV_ROW_REMAP_FAILURE", Field::RowRemapFailure, 1.0),
    m("DCGM_FI_DEV_XID_ERRORS", Field::XidLast, 1.0),
    m("DCGM_FI_PROF_GR_ENGINE_ACTIVE", Field::GrEngineActive, 1.0),
    m("DCGM_FI_PROF_SM_ACTIVE", Field::SmActive, 1.0),
    m("DCGM_FI_PROF_SM_OCCUPANCY", Field::SmOccupancy, 1.0),
    m("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", Field::TensorActive, 1.0),
    m("DCGM_FI_PROF_DRAM_ACTIVE", Field::DramActive, 1.0),
    m("DCGM_FI_PROF_PIPE_FP64_ACTIVE", Field::Fp64Active, 1.0),
    m("DCGM_FI_PROF_PIPE_FP32_ACTIVE", Field::Fp32Active, 1.0),
    m("DCGM_FI_PROF_PIPE_FP16_ACTIVE", Field::Fp16Active, 1.0),
    m("DCGM_FI_PROF_PCIE_TX_BYTES", Field::PcieTxBytesPerS, 1.0),
    m("DCGM_FI_PROF_PCIE_RX_BYTES", Field::PcieRxBytesPerS, 1.0),
    m("DCGM_FI_PROF_NVLINK_TX_BYTES", Field::NvlinkTxBytesPerS, 1.0),
    m("DCGM_FI_PROF_NVLINK_RX_BYTES", Field::NvlinkRxBytesPerS, 1.0),
];

/// The mapping of a metric name. A `_total` suffix is also accepted: an OpenMetrics
/// exposition (and so Prometheus' TSDB) names the samples of a counter family
/// `<family>_total`, which is how the energy and replay counters can arrive.
pub fn mapping(name: &str) -> Option<&'static MetricMapping> {
    let find = |n: &str| MAPPINGS.iter().find(|m| m.name == n);
    find(name).or_else(|| name.strip_suffix("_total").and_then(find))
}

/// The GPU UUID the importer gives a MIG instance: dcgm-exporter labels an instance
/// with its parent's UUID and the GPU instance id (`GPU_I_ID`), never the instance's
/// own `MIG-…` UUID, so one is derived deterministically. It cannot collide with an
/// NVML MIG UUID (those hold no `/`).
pub fn mig_instance_uuid(parent_uuid: &str, gpu_instance_id: u32) -> String {
    format!("MIG-{parent_uuid}/{gpu_instance_id}")
}

/// The pod a series' labels name as holding the GPU.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct PodRef {
    pub namespace: Option<String>,
    pub pod: Option<String>,
    pub container: Option<String>,
}

/// What one series' name and labels resolve to.
#[derive(Debug)]
pub(crate) struct Resolved {
    pub mapping: &'static MetricMapping,
    pub identity: GpuIdentity,
    pub owner: Option<PodRef>,
}

/// Resolves a series; `Err` is the reason its samples are skipped. `name` is the
/// metric name when the input writes it outside the label set; otherwise the
/// `__name__` label is used.
pub(crate) fn resolve(
    name: Option<&str>,
    labels: &[(&str, &str)],
    opts: &ImportOptions,
) -> Result<Resolved, &'static str> {
    // Prometheus treats an empty label value as an absent label.
    let get = |key: &str| labels.iter().find(|(k, _)| *k == key).map(|(_, v)| *v).filter(|v| !v.is_empty());
    let name = name.or_else(|| get("__name__")).ok_or(reason::NO_NAME)?;
    let mapping = mapping(name).ok_or(reason::NOT_MAPPED)?;
    let uuid = get("UUID").ok_or(reason::NO_UUID)?;
    let parent = GpuUuid::new(uuid).map_err(|_| reason::BAD_LABEL)?;
    let host = host(&get, opts)?;
    let mut identity = GpuIdentity::gpu(
        host,
        parent.clone(),
        get("gpu").and_then(|g| g.parse().ok()).unwrap_or(0),
        get("modelName").unwrap_or_default(),
    );
    identity.cluster = opts.cluster.clone();
    identity.pci_bus_id = get("pci_bus_id").unwrap_or_default().to_owned();
    identity.minor_number = get("device").and_then(|d| d.strip_prefix("nvidia")).and_then(|n| n.parse().ok());
    if let Some(gi) = get("GPU_I_ID") {
        let gi: u32 = gi.parse().map_err(|_| reason::BAD_LABEL)?;
        identity.gpu_uuid = GpuUuid::new(mig_instance_uuid(parent.as_str(), gi)).map_err(|_| reason::BAD_LABEL)?;
        identity.parent_gpu_uuid = Some(parent);
        identity.mig_profile = get("GPU_I_PROFILE").map(str::to_owned);
        identity.mig_gpu_instance_id = Some(gi);
    }
    let owner = owner(&get);
    Ok(Resolved { mapping, identity, owner })
}

fn host<'a>(get: &impl Fn(&str) -> Option<&'a str>, opts: &ImportOptions) -> Result<HostName, &'static str> {
    if let Some(h) = &opts.host_override {
        return Ok(h.clone());
    }
    // dcgm-exporter renamed `Hostname` to `hostname` after 4.5.3; `instance` is the
    // scrape target Prometheus adds, which names the host unless it is an address.
    let candidates = [get("Hostname"), get("hostname"), get("instance").map(instance_host)];
    match candidates.into_iter().flatten().find_map(|c| HostName::new(c).ok()) {
        Some(h) => Ok(h),
        None => HostName::new("unknown").map_err(|_| reason::BAD_LABEL),
    }
}

/// The host part of a Prometheus `instance` (`host:port`, `[v6]:port`, or a bare host).
fn instance_host(instance: &str) -> &str {
    if let Some(rest) = instance.strip_prefix('[') {
        return rest.split_once(']').map_or(instance, |(h, _)| h);
    }
    match instance.split_once(':') {
        // More than one colon without brackets is a bare IPv6 address.
        Some((h, port)) if !port.contains(':') => h,
        _ => instance,
    }
}

fn owner<'a>(get: &impl Fn(&str) -> Option<&'a str>) -> Option<PodRef> {
    let make = |pod: &str, ns: &str, ctr: &str| {
        get(pod).map(|p| PodRef {
            namespace: get(ns).map(str::to_owned),
            pod: Some(p.to_owned()),
            container: get(ctr).map(str::to_owned),
        })
    };
    // With `honorLabels: false` Prometheus keeps its own target labels (the exporter's
    // pod) as `pod`/`namespace`/`container` and renames the workload's to `exported_*`.
    if let Some(o) = make("exported_pod", "exported_namespace", "exported_container") {
        return Some(o);
    }
    if let Some(o) = make("pod", "namespace", "container") {
        // Without `exported_pod`, a `pod` naming dcgm-exporter itself is the scrape
        // target's label on a GPU no workload holds, not a holder.
        let p = o.pod.as_deref().unwrap_or_default();
        let exporter = p.starts_with("dcgm-exporter-")
            || p.starts_with("nvidia-dcgm-exporter-")
            || get("Hostname").or_else(|| get("hostname")) == Some(p);
        return (!exporter).then_some(o);
    }
    // dcgm-exporter's pre-2.0 label names.
    make("pod_name", "pod_namespace", "container_name")
}

/// Whether `v` (in the field's base unit) can be a real reading. What falls outside is
/// a DCGM "blank" sentinel (2^31−16, 2^47, 2^63−16 for unsupported or not-yet-read
/// fields) or corrupt data, and would not fit the column's storage type anyway.
pub(crate) fn plausible(field: Field, v: f64) -> bool {
    let (lo, hi) = match field.unit() {
        // DCP ratios come from float division and may overshoot 1 by rounding.
        "ratio" => (0.0, 1.001),
        "watts" => (0.0, 1e6),
        "joules" => (0.0, 1e15),
        "celsius" => (-273.15, 1e4),
        "MHz" => (0.0, 1e6),
        "code" | "bool" | "bitmask" => (0.0, 2_147_483_632.0),
        // Bytes, bytes/s and counts: integers that f64 holds exactly.
        _ => (0.0, 9_007_199_254_740_992.0),
    };
    v >= lo && v < hi
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts() -> ImportOptions {
        ImportOptions::default()
    }

    const BASE: &[(&str, &str)] = &[
        ("gpu", "3"),
        ("UUID", "GPU-aaaa"),
        ("pci_bus_id", "00000000:18:00.0"),
        ("device", "nvidia3"),
        ("modelName", "NVIDIA H100 80GB HBM3"),
        ("Hostname", "node-1"),
    ];

    fn with(extra: &[(&'static str, &'static str)]) -> Vec<(&'static str, &'static str)> {
        let mut v = BASE.to_vec();
        v.extend_from_slice(extra);
        v
    }

    #[test]
    fn names_map_with_units_and_total_suffix() {
        let util = mapping("DCGM_FI_DEV_GPU_UTIL").expect("mapped");
        assert_eq!((util.field, util.scale), (Field::GpuUtil, 0.01));
        assert_eq!(mapping("DCGM_FI_DEV_FB_USED").map(|m| m.scale), Some(1_048_576.0));
        let energy = mapping("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION_total").expect("counter suffix");
        assert_eq!((energy.field, energy.scale), (Field::EnergyJoules, 0.001));
        assert!(mapping("DCGM_FI_DEV_VGPU_LICENSE_STATUS").is_none());
        assert!(mapping("node_cpu_seconds_total").is_none());
        assert_eq!(util.to_base(35.0), 0.35);
        assert_eq!(energy.to_base(119.0), 0.119);
        let mut names: Vec<_> = MAPPINGS.iter().map(|m| m.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), MAPPINGS.len(), "a name mapped twice");
    }

    #[test]
    fn identity_from_labels() {
        let r = resolve(Some("DCGM_FI_DEV_GPU_UTIL"), BASE, &opts()).expect("resolves");
        let g = &r.identity;
        assert_eq!((g.gpu_uuid.as_str(), g.host.as_str(), g.gpu_index), ("GPU-aaaa", "node-1", 3));
        assert_eq!(
            (g.gpu_model.as_str(), g.pci_bus_id.as_str(), g.minor_number),
            ("NVIDIA H100 80GB HBM3", "00000000:18:00.0", Some(3))
        );
        assert!(!g.is_mig() && r.owner.is_none());
        // The name may come from __name__ (tsdb dumps, JSON).
        let named = with(&[("__name__", "DCGM_FI_PROF_SM_ACTIVE")]);
        assert_eq!(resolve(None, &named, &opts()).map(|r| r.mapping.field).ok(), Some(Field::SmActive));
        assert_eq!(resolve(None, BASE, &opts()).err(), Some(reason::NO_NAME));
        assert_eq!(resolve(Some("up"), BASE, &opts()).err(), Some(reason::NOT_MAPPED));
        let no_uuid: Vec<_> = BASE.iter().copied().filter(|(k, _)| *k != "UUID").collect();
        assert_eq!(resolve(Some("DCGM_FI_DEV_GPU_UTIL"), &no_uuid, &opts()).err(), Some(reason::NO_UUID));
    }

    #[test]
    fn mig_instance_is_the_row_gpu() {
        let l = with(&[("GPU_I_PROFILE", "1g.10gb"), ("GPU_I_ID", "9")]);
        let g = resolve(Some("DCGM_FI_PROF_GR_ENGINE_ACTIVE"), &l, &opts()).expect("resolves").identity;
        assert_eq!(g.gpu_uuid.as_str(), "MIG-GPU-aaaa/9");
        assert_eq!(g.parent_gpu_uuid.as_ref().map(GpuUuid::as_str), Some("GPU-aaaa"));
        assert_eq!((g.mig_profile.as_deref(), g.mig_gpu_instance_id, g.gpu_index), (Some("1g.10gb"), Some(9), 3));
        let bad = with(&[("GPU_I_ID", "x")]);
        assert_eq!(resolve(Some("DCGM_FI_PROF_GR_ENGINE_ACTIVE"), &bad, &opts()).err(), Some(reason::BAD_LABEL));
    }

    #[test]
    fn host_falls_back_to_hostname_instance_then_unknown() {
        let l = |pairs: &[(&'static str, &'static str)]| {
            let mut v: Vec<_> = pairs.to_vec();
            v.push(("UUID", "GPU-a"));
            resolve(Some("DCGM_FI_DEV_GPU_UTIL"), &v, &opts()).expect("resolves").identity.host.to_string()
        };
        assert_eq!(l(&[("hostname", "n2"), ("instance", "10.0.0.1:9400")]), "n2");
        assert_eq!(l(&[("instance", "n3.example:9400")]), "n3.example");
        assert_eq!(l(&[("instance", "[fd00::1]:9400")]), "fd00::1");
        assert_eq!(l(&[("instance", "fd00::1")]), "fd00::1");
        assert_eq!(l(&[("Hostname", "")]), "unknown");
        let mut o = opts();
        o.host_override = Some(HostName::new("forced").expect("valid"));
        let r = resolve(Some("DCGM_FI_DEV_GPU_UTIL"), BASE, &o).expect("resolves");
        assert_eq!(r.identity.host.as_str(), "forced");
    }

    #[test]
    fn pod_labels_name_the_holder() {
        let owner = |extra: &[(&'static str, &'static str)]| {
            resolve(Some("DCGM_FI_DEV_GPU_UTIL"), &with(extra), &opts()).expect("resolves").owner
        };
        let p = |ns: &str, pod: &str, c: Option<&str>| {
            Some(PodRef { namespace: Some(ns.into()), pod: Some(pod.into()), container: c.map(Into::into) })
        };
        assert_eq!(
            owner(&[("pod", "train-0"), ("namespace", "ml"), ("container", "main")]),
            p("ml", "train-0", Some("main"))
        );
        // honorLabels: false — the workload's labels are exported_*, the plain ones the exporter's.
        let renamed = [
            ("pod", "nvidia-dcgm-exporter-x1"),
            ("namespace", "gpu-operator"),
            ("exported_pod", "train-0"),
            ("exported_namespace", "ml"),
        ];
        assert_eq!(owner(&renamed), p("ml", "train-0", None));
        assert_eq!(owner(&[("pod", "nvidia-dcgm-exporter-x1"), ("namespace", "gpu-operator")]), None);
        assert_eq!(owner(&[("pod", "node-1"), ("namespace", "gpu-operator")]), None, "the exporter's own pod");
        assert_eq!(owner(&[("pod_name", "old"), ("pod_namespace", "ns")]), p("ns", "old", None));
        assert_eq!(owner(&[("pod", "")]), None);
    }

    #[test]
    fn blank_sentinels_are_implausible() {
        assert!(plausible(Field::GpuUtil, 1.0) && !plausible(Field::GpuUtil, 1.5) && !plausible(Field::GpuUtil, -0.1));
        assert!(!plausible(Field::GpuTempC, 2_147_483_632.0));
        assert!(!plausible(Field::SmClockMhz, 2_147_483_632.0));
        assert!(!plausible(Field::FbUsedBytes, 9.223_372_036_854_776e18 * MIB));
        assert!(!plausible(Field::PowerWatts, 140_737_488_355_328.0));
        assert!(plausible(Field::FbUsedBytes, 80.0 * 1024.0 * MIB));
        assert!(plausible(Field::XidLast, 79.0));
    }
}
