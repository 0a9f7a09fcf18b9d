//! Where the real host keeps its attribution facts (the `[attribution]` config table).

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

/// Paths and limits for [`RealHost`](super::RealHost). The defaults fit an agent that
/// runs on the host (or in a pod with hostPID and the host's `/proc`, `/etc/passwd`,
/// `/run` and the kubelet's pod-resources directory mounted at the same paths).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AttributionConfig {
    /// procfs of the host PID namespace (NVML reports host PIDs).
    pub proc_root: PathBuf,
    /// The host's `passwd(5)` file, for user names.
    pub passwd_path: PathBuf,
    /// Princeton jobstats' directory of `<gpu-index|MIG-UUID>` files ("jobid uid").
    pub slurm_gpu_dir: PathBuf,
    /// Apron's Slurm prolog directory of `<gpu_uuid>` files (`key=value` lines).
    pub apron_slurm_dir: PathBuf,
    /// The kubelet pod-resources socket; a missing socket means no Kubernetes on this node.
    pub pod_resources_socket: PathBuf,
    /// Limit on one pod-resources `List()` call, connection included (humantime: `10s`).
    #[serde(with = "apron_common::duration")]
    pub pod_resources_timeout: Duration,
    /// `[attribution.kubernetes]`: pod labels from the API server.
    pub kubernetes: KubernetesConfig,
}

/// `[attribution.kubernetes]`: where the agent lists its node's pods for their labels
/// (cargo feature `kubernetes`). The agent lists `GET /api/v1/pods?fieldSelector=
/// spec.nodeName=<node_name>` every `refresh`, and at once (at most every 5 s) when
/// pod-resources names a pod it has no labels for. Read-only: get/list/watch on pods.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KubernetesConfig {
    /// `false` turns the API server off even inside a cluster.
    pub enabled: bool,
    /// E.g. `https://kubernetes.default.svc`. Unset: the binary takes the in-cluster
    /// address (`KUBERNETES_SERVICE_HOST`/`_PORT`); none at all: no pod labels.
    pub api_server: Option<String>,
    /// The service-account bearer token, re-read at every request (tokens rotate); a
    /// missing file sends no token (e.g. behind `kubectl proxy`).
    pub token_file: PathBuf,
    /// The cluster CA bundle (PEM) for `https`; a missing file falls back to the
    /// public web PKI roots.
    pub ca_file: PathBuf,
    /// This node's name (`spec.nodeName`). Unset: `NODE_NAME` (downward API) as the
    /// binary reads it, else the agent's host name.
    pub node_name: Option<String>,
    /// Interval between full lists of the node's pods (humantime).
    #[serde(with = "apron_common::duration")]
    pub refresh: Duration,
    /// Limit on one list request, connection included.
    #[serde(with = "apron_common::duration")]
    pub request_timeout: Duration,
    /// Annotations copied into `pod_labels` (labels win on a key collision): exact keys,
    /// or prefixes ending in `/` (every annotation of that prefix).
    pub annotations: Vec<String>,
}

/// The service account's files as Kubernetes mounts them in every pod.
const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

impl Default for KubernetesConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            api_server: None,
            token_file: PathBuf::from(SERVICE_ACCOUNT_DIR).join("token"),
            ca_file: PathBuf::from(SERVICE_ACCOUNT_DIR).join("ca.crt"),
            node_name: None,
            refresh: Duration::from_secs(60),
            request_timeout: Duration::from_secs(10),
            annotations: [
                "team",
                "project",
                "owner",
                "cost-center",
                "runai/",
                "run.ai/",
                "notebooks.kubeflow.org/",
                "kubeflow-resource-stopped",
            ]
            .map(str::to_owned)
            .to_vec(),
        }
    }
}

impl Default for AttributionConfig {
    fn default() -> Self {
        Self {
            proc_root: "/proc".into(),
            passwd_path: "/etc/passwd".into(),
            slurm_gpu_dir: "/run/gpustat".into(),
            apron_slurm_dir: "/run/apron/slurm".into(),
            pod_resources_socket: "/var/lib/kubelet/pod-resources/kubelet.sock".into(),
            // dcgm-exporter's value: the kubelet answers in milliseconds unless it is in trouble.
            pod_resources_timeout: Duration::from_secs(10),
            kubernetes: KubernetesConfig::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_overrides() {
        let empty: AttributionConfig = toml::from_str("").expect("empty table");
        assert_eq!(empty, AttributionConfig::default());

        let set: AttributionConfig =
            toml::from_str("proc_root = \"/host/proc\"\npod_resources_timeout = \"1500ms\"\n").expect("valid table");
        assert_eq!(set.proc_root, PathBuf::from("/host/proc"));
        assert_eq!(set.pod_resources_timeout, Duration::from_millis(1500));
        assert_eq!(set.passwd_path, PathBuf::from("/etc/passwd"));

        let k8s: AttributionConfig = toml::from_str(
            "[kubernetes]\napi_server = \"https://10.0.0.1:443\"\nnode_name = \"gpu01\"\nrefresh = \"30s\"\n",
        )
        .expect("valid table");
        assert_eq!(k8s.kubernetes.api_server.as_deref(), Some("https://10.0.0.1:443"));
        assert_eq!(k8s.kubernetes.refresh, Duration::from_secs(30));
        assert_eq!(k8s.kubernetes.token_file, PathBuf::from("/var/run/secrets/kubernetes.io/serviceaccount/token"));
        assert!(toml::from_str::<AttributionConfig>("[kubernetes]\nwatch = true\n").is_err());
    }

    #[test]
    fn refuses_unknown_fields_and_bad_durations() {
        let unknown = toml::from_str::<AttributionConfig>("team = \"x\"\n");
        assert!(unknown.is_err());
        let bad =
            toml::from_str::<AttributionConfig>("pod_resources_timeout = \"soon\"\n").expect_err("not a duration");
        assert!(bad.to_string().contains("invalid duration \"soon\""), "{bad}");
    }
}
