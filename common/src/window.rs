//! The records an agent produces: one [`GpuWindow`] per GPU (or MIG instance) per
//! window, and one [`ProcessRow`] per GPU process per process-sampling tick.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::field::Field;
use crate::ids::{ClusterName, GpuUuid, HostName, UnixMicros};

/// Who a GPU is: the identity columns of `gpu_samples`, plus what exposition needs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuIdentity {
    pub cluster: Option<ClusterName>,
    pub host: HostName,
    pub gpu_uuid: GpuUuid,
    /// NVML index of the GPU (of the parent, for a MIG instance).
    pub gpu_index: u32,
    /// NVML model name, e.g. `NVIDIA H100 80GB HBM3`.
    pub gpu_model: String,
    /// PCI bus id, `00000000:18:00.0`.
    pub pci_bus_id: String,
    /// `/dev/nvidia<minor>`; dcgm-exporter's `device` label is `nvidia<minor>`.
    pub minor_number: Option<u32>,
    /// For a MIG instance: its parent GPU.
    pub parent_gpu_uuid: Option<GpuUuid>,
    /// For a MIG instance: the profile, e.g. `1g.10gb`.
    pub mig_profile: Option<String>,
    /// For a MIG instance: the GPU instance id (dcgm-exporter's `GPU_I_ID`).
    pub mig_gpu_instance_id: Option<u32>,
}

impl GpuIdentity {
    /// A whole GPU (no MIG) known only by host, UUID, index and model; the other
    /// identity fields empty.
    pub fn gpu(host: HostName, gpu_uuid: GpuUuid, gpu_index: u32, gpu_model: impl Into<String>) -> Self {
        Self {
            cluster: None,
            host,
            gpu_uuid,
            gpu_index,
            gpu_model: gpu_model.into(),
            pci_bus_id: String::new(),
            minor_number: None,
            parent_gpu_uuid: None,
            mig_profile: None,
            mig_gpu_instance_id: None,
        }
    }

    pub fn is_mig(&self) -> bool {
        self.parent_gpu_uuid.is_some()
    }
}

/// The readings of one field inside one window.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct FieldStats {
    pub count: u32,
    pub mean: f64,
    pub min: f64,
    pub max: f64,
    pub last: f64,
}

impl FieldStats {
    /// A window with exactly one reading.
    pub fn single(v: f64) -> Self {
        Self { count: 1, mean: v, min: v, max: v, last: v }
    }

    /// The value a `gpu_samples` column holds: the mean for measurements, the last
    /// reading for counters and states.
    pub fn value(&self, field: Field) -> f64 {
        match field.aggregation() {
            crate::field::Aggregation::Mean => self.mean,
            crate::field::Aggregation::Last => self.last,
        }
    }
}

/// One `gpu_samples` row: a GPU over the window `(time - window, time]`.
///
/// A field with no reading in the window is absent (`None`): NULL, never 0, and never
/// carried forward from an earlier window.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuWindow {
    /// Window end.
    pub time: UnixMicros,
    #[serde(with = "duration_secs")]
    pub window: Duration,
    pub gpu: GpuIdentity,
    /// Indexed by [`Field::index`].
    pub fields: Vec<Option<FieldStats>>,
    /// True when the GPU answered GPU_IS_LOST in this window.
    pub lost: bool,
    /// Who held the GPU as of the window (a pod through the kubelet's pod-resources, a
    /// Slurm job through the prolog's file), whether or not anything ran on it; `None`
    /// when nobody held it, or when the producer does not attribute (see `docs/agent.md`
    /// for how old the answer may be).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<GpuHolder>,
}

impl GpuWindow {
    pub fn new(time: UnixMicros, window: Duration, gpu: GpuIdentity) -> Self {
        Self { time, window, gpu, fields: vec![None; Field::COUNT], lost: false, owner: None }
    }

    pub fn get(&self, field: Field) -> Option<&FieldStats> {
        self.fields.get(field.index()).and_then(Option::as_ref)
    }

    /// The column value of `field` (mean or last), `None` when there was no reading.
    pub fn value(&self, field: Field) -> Option<f64> {
        self.get(field).map(|s| s.value(field))
    }

    pub fn window_secs(&self) -> f64 {
        self.window.as_secs_f64()
    }
}

/// What holds a GPU: the `owner_kind` column of `gpu_samples`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HolderKind {
    /// A Kubernetes pod (the kubelet's pod-resources assigns the device to it).
    Pod,
    /// A Slurm job (Apron's prolog file, or jobstats' file, names it).
    SlurmJob,
}

impl HolderKind {
    pub const fn as_str(self) -> &'static str {
        match self {
            HolderKind::Pod => "pod",
            HolderKind::SlurmJob => "slurm_job",
        }
    }
}

/// Who held a GPU during a window: the ownership columns of `gpu_samples`. Teams are
/// never resolved here; the server maps labels, namespaces, accounts and users to teams.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuHolder {
    pub kind: HolderKind,
    /// `<namespace>/<pod>` for a pod (`<namespace>/*` when several pods of one namespace
    /// share a time-sliced GPU, `*` when several namespaces do); the job id for a job.
    pub owner: String,
    pub namespace: Option<String>,
    pub pod: Option<String>,
    pub container: Option<String>,
    pub job_id: Option<String>,
    /// The Slurm job's user (the `owner_user` column).
    pub user: Option<String>,
    pub account: Option<String>,
    pub partition: Option<String>,
    pub qos: Option<String>,
    /// The holding pod's labels and selected annotations as JSON object text (labels win
    /// on a key collision); `None` when unknown.
    pub pod_labels: Option<String>,
}

impl GpuHolder {
    /// A pod holder; `owner` is derived from the namespace and pod as documented above.
    pub fn pod(namespace: Option<String>, pod: Option<String>, container: Option<String>) -> Self {
        let owner = match (&namespace, &pod) {
            (Some(ns), Some(pod)) => format!("{ns}/{pod}"),
            (Some(ns), None) => format!("{ns}/*"),
            (None, _) => "*".to_owned(),
        };
        Self {
            kind: HolderKind::Pod,
            owner,
            namespace,
            pod,
            container,
            job_id: None,
            user: None,
            account: None,
            partition: None,
            qos: None,
            pod_labels: None,
        }
    }

    /// A Slurm job holder, owner = the job id.
    pub fn slurm_job(job_id: impl Into<String>) -> Self {
        let job_id = job_id.into();
        Self {
            kind: HolderKind::SlurmJob,
            owner: job_id.clone(),
            namespace: None,
            pod: None,
            container: None,
            job_id: Some(job_id),
            user: None,
            account: None,
            partition: None,
            qos: None,
            pod_labels: None,
        }
    }
}

/// One `gpu_processes` row as the agent sees it. `team` is resolved by the server.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProcessRow {
    pub time: UnixMicros,
    pub host: HostName,
    pub gpu_uuid: GpuUuid,
    pub pid: u32,
    pub process_name: Option<String>,
    pub user: Option<String>,
    pub fb_used_bytes: Option<i64>,
    /// Per-process SM utilisation, ratio 0–1, from the driver's per-process samples.
    pub sm_util: Option<f64>,
    pub container_id: Option<String>,
    pub pod: Option<String>,
    pub namespace: Option<String>,
    pub container: Option<String>,
    pub pod_uid: Option<String>,
    pub job_id: Option<String>,
}

mod duration_secs {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let secs = f64::deserialize(d)?;
        Duration::try_from_secs_f64(secs).map_err(serde::de::Error::custom)
    }
}
