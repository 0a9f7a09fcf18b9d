//! Process and GPU attribution: who is using a GPU, as the node can tell.
//!
//! The agent only ever sees [`Attributor`]; where the facts come from is a [`HostView`]:
//! the real host ([`RealHost`]: procfs, Slurm prolog files, the kubelet pod-resources
//! socket) or the simulator, which produces the same raw facts (cgroup file contents,
//! prolog file text, pod-resources answers) so that both go through the same parsing code.
//!
//! Data flow, once per process-sampling tick:
//!
//! ```text
//!  raw facts (HostView)               parsing                    maps (Attributor)         answers
//!  ─────────────────────────────      ─────────────────────      ──────────────────────    ─────────────────────
//!  pod-resources List() ──────────►  podresources::DeviceMap ──► device id → holders  ─┐
//!  /proc/<pid>/cgroup   ──────────►  cgroup::parse          ──┐                         ├► process(gpu, pid)
//!  /proc/<pid>/status + passwd ───►  users::{real_uid, …}   ──┴► pid → PidFacts (cache) ┤
//!  Slurm per-GPU file   ──────────►  slurm::parse_gpu_file  ───► gpu → SlurmJob (cache) ┴► gpu_owner(gpu)
//! ```
//!
//! Pod-resources knows which pod holds a device but not its processes; cgroups know
//! which pod (by UID) and container a process is in but not the pod's name. The
//! [`Attributor`] joins the two per GPU. Teams are never resolved here: the server maps
//! pods, namespaces, Slurm accounts and users to teams.

mod attributor;
mod cgroup;
mod config;
mod host;
#[cfg(feature = "kubernetes")]
pub mod kube;
mod podresources;
mod slurm;
mod users;

use std::io;

use apron_common::GpuIdentity;

pub use attributor::{Attributor, ProcessAttribution, ProcessSample};
pub use config::{AttributionConfig, KubernetesConfig};
pub use host::RealHost;
#[cfg(feature = "kubernetes")]
pub use podresources::PodResourcesError;
#[cfg(all(feature = "kubernetes", any(test, feature = "test-support")))]
#[doc(hidden)]
pub use podresources::fake_kubelet;
pub use podresources::is_gpu_resource;

/// One container's devices as the kubelet pod-resources `List()` reports them.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct PodDevices {
    pub namespace: String,
    pub pod: String,
    pub container: String,
    pub resource_name: String,
    /// Device IDs: GPU UUIDs (or MIG UUIDs) as the NVIDIA device plugin reports them.
    pub device_ids: Vec<String>,
}

/// The raw facts a host offers about processes and schedulers.
pub trait HostView: Send + Sync {
    /// Contents of `/proc/<pid>/cgroup`.
    fn cgroup(&self, pid: u32) -> io::Result<String>;
    /// Contents of `/proc/<pid>/status` (for the real uid).
    fn status(&self, pid: u32) -> io::Result<String>;
    /// The user name of a uid (`/etc/passwd`), if known.
    fn user_name(&self, uid: u32) -> Option<String>;
    /// Text of the per-GPU Slurm file for this GPU, if one exists: our prolog's file or
    /// jobstats' `/run/gpustat/<index>` ("jobid uid").
    fn slurm_gpu_file(&self, gpu: &GpuIdentity) -> io::Result<Option<String>>;
    /// The kubelet's pod-resources `List()` answer; `Ok(None)` where there is no kubelet.
    fn pod_resources(&self) -> io::Result<Option<Vec<PodDevices>>>;
    /// A pod's labels (and selected annotations) as JSON object text, where known (the
    /// API server's answer, cached; see [`kube`]). Must not block on the network.
    fn pod_labels(&self, _namespace: &str, _pod: &str) -> Option<String> {
        None
    }
}

#[cfg(test)]
pub(crate) mod test_support {
    use apron_common::{GpuIdentity, GpuUuid, HostName};

    /// A GPU (or, with `parent`, a MIG instance of it) for lookups.
    pub fn gpu(uuid: &str, index: u32, parent: Option<&str>) -> GpuIdentity {
        GpuIdentity {
            cluster: None,
            host: HostName::new("gpu01").expect("host name"),
            gpu_uuid: GpuUuid::new(uuid).expect("uuid"),
            gpu_index: index,
            gpu_model: "NVIDIA H100 80GB HBM3".into(),
            pci_bus_id: "00000000:18:00.0".into(),
            minor_number: Some(index),
            parent_gpu_uuid: parent.map(|p| GpuUuid::new(p).expect("parent uuid")),
            mig_profile: parent.map(|_| "1g.10gb".into()),
            mig_gpu_instance_id: parent.map(|_| 7),
        }
    }
}
