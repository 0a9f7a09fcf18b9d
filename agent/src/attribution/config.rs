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
    #[serde(with = "humantime_duration")]
    pub pod_resources_timeout: Duration,
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
        }
    }
}

/// `#[serde(with)]` adapter: a humantime string (`500ms`, `10s`) as a [`Duration`].
pub(crate) mod humantime_duration {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, de::Error as _};

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(deserializer)?;
        humantime::parse_duration(&text).map_err(|e| D::Error::custom(format!("invalid duration {text:?}: {e}")))
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
