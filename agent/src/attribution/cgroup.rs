//! `/proc/<pid>/cgroup` → container ID, pod UID and Slurm job ID.
//!
//! The file has one `hierarchy-id:controllers:path` line per hierarchy: several under
//! cgroup v1, a single `0::/path` under v2, both in hybrid mode. Container runtimes and
//! Slurm encode their identities in the path; the forms understood are
//!
//! | who | path |
//! | --- | --- |
//! | kubelet, cgroupfs driver | `/kubepods/burstable/pod<uid>/<container-id>` |
//! | kubelet, systemd driver | `/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid with _>.slice/cri-containerd-<id>.scope` |
//! | containerd, systemd cgroups on v1 | `/system.slice/containerd.service/kubepods-…-pod<uid>.slice:cri-containerd:<id>` |
//! | CRI-O, Docker, Podman | `crio-<id>.scope`, `docker-<id>.scope`, `/docker/<id>`, `libpod-<id>.scope` |
//! | Slurm, cgroup v1 | `/slurm/uid_<uid>/job_<jobid>/step_<step>/task_<n>` |
//! | Slurm, cgroup v2 | `/system.slice/slurmstepd.scope/job_<jobid>/step_<step>/user/task_<n>` |

/// What a process's cgroup path tells about it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CgroupFacts {
    /// 64-hex container ID (containerd, CRI-O, Docker, Podman).
    pub container_id: Option<String>,
    /// Kubernetes pod UID, with dashes (`1234abcd-5678-…`), or the 32-hex hash of a
    /// static pod.
    pub pod_uid: Option<String>,
    /// Slurm job ID.
    pub slurm_job_id: Option<String>,
}

impl CgroupFacts {
    pub fn is_empty(&self) -> bool {
        self.container_id.is_none() && self.pod_uid.is_none() && self.slurm_job_id.is_none()
    }
}

/// Parses the contents of `/proc/<pid>/cgroup`. Lines that are not `id:controllers:path`
/// are skipped: the file comes from the kernel, and an odd line should not hide the others.
pub fn parse(text: &str) -> CgroupFacts {
    let mut paths: Vec<(u8, &str)> = text
        .lines()
        .filter_map(|line| {
            let mut parts = line.splitn(3, ':');
            let (_id, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
            Some((rank(controllers), path.trim()))
        })
        .collect();
    // Under v1 every hierarchy has its own path and some (cpuset, freezer) may sit at the
    // root; the ones below are where kubelet and slurmd always place a process.
    paths.sort_by_key(|&(rank, _)| rank);
    paths.into_iter().map(|(_, path)| parse_path(path)).find(|facts| !facts.is_empty()).unwrap_or_default()
}

/// Preference of a hierarchy's path: lower is better.
fn rank(controllers: &str) -> u8 {
    let has = |name: &str| controllers.split(',').any(|c| c == name);
    if has("memory") {
        0
    } else if has("cpu") || has("cpuacct") {
        1
    } else if has("pids") {
        2
    } else if has("name=systemd") {
        3
    } else if controllers.is_empty() {
        // The v2 unified hierarchy (`0::/path`).
        4
    } else {
        5
    }
}

/// Parses one cgroup path.
fn parse_path(path: &str) -> CgroupFacts {
    // `:` separates the unit name from the runtime's suffix in containerd's systemd form
    // on v1 (`…pod<uid>.slice:cri-containerd:<id>`), so it splits like `/` does.
    let tokens: Vec<&str> = path
        .split(['/', ':'])
        .map(|t| t.trim_end_matches(".scope").trim_end_matches(".slice"))
        .filter(|t| !t.is_empty())
        .collect();

    let in_kubepods = tokens.iter().any(|t| t.starts_with("kubepods"));
    let in_slurm = tokens.iter().any(|t| t.starts_with("slurm") || t.contains("slurmstepd"));

    CgroupFacts {
        // The deepest match: a container's own scope sits below its pod's.
        container_id: tokens.iter().rev().find_map(|t| container_id(t)),
        pod_uid: in_kubepods.then(|| tokens.iter().find_map(|t| pod_uid(t))).flatten(),
        slurm_job_id: in_slurm.then(|| tokens.iter().find_map(|t| slurm_job(t))).flatten(),
    }
}

/// `cri-containerd-<id>`, `crio-<id>`, `docker-<id>`, `libpod-<id>` or a bare `<id>`.
fn container_id(token: &str) -> Option<String> {
    let id = token.rsplit('-').next().unwrap_or(token);
    (id.len() == 64 && id.bytes().all(|b| b.is_ascii_hexdigit())).then(|| id.to_ascii_lowercase())
}

/// `pod<uid>` (cgroupfs driver) or `kubepods[-<qos>]-pod<uid_with_underscores>` (systemd
/// driver, which cannot use `-` inside a unit name component).
fn pod_uid(token: &str) -> Option<String> {
    let raw = match token.strip_prefix("pod") {
        Some(rest) => rest,
        None => &token[token.rfind("-pod")? + "-pod".len()..],
    };
    let uid = raw.replace('_', "-").to_ascii_lowercase();
    is_pod_uid(&uid).then_some(uid)
}

/// A UUID (`8-4-4-4-12` hex) or, for static pods, the kubelet's 32-hex config hash.
fn is_pod_uid(s: &str) -> bool {
    let b = s.as_bytes();
    match b.len() {
        32 => b.iter().all(u8::is_ascii_hexdigit),
        36 => b.iter().enumerate().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => *c == b'-',
            _ => c.is_ascii_hexdigit(),
        }),
        _ => false,
    }
}

/// `job_<id>`: Slurm names job cgroups by the numeric job ID (array tasks get their own).
fn slurm_job(token: &str) -> Option<String> {
    let id = token.strip_prefix("job_")?;
    (!id.is_empty() && id.bytes().all(|b| b.is_ascii_digit())).then(|| id.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    const CID: &str = "4f5c2a9e0b1d8c7a6f5e4d3c2b1a09f8e7d6c5b4a39281706f5e4d3c2b1a0f9e";
    const UID: &str = "8d6c3a5c-1f2b-4a4e-9b1c-2f1e0c9d7a11";

    fn facts(container: Option<&str>, pod: Option<&str>, job: Option<&str>) -> CgroupFacts {
        CgroupFacts {
            container_id: container.map(str::to_owned),
            pod_uid: pod.map(str::to_owned),
            slurm_job_id: job.map(str::to_owned),
        }
    }

    #[test]
    fn parses_real_cgroup_files() {
        let cases: &[(&str, String, CgroupFacts)] = &[
            (
                "v2, kubelet systemd driver, containerd",
                format!(
                    "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod8d6c3a5c_1f2b_4a4e_9b1c_2f1e0c9d7a11.slice/cri-containerd-{CID}.scope\n"
                ),
                facts(Some(CID), Some(UID), None),
            ),
            (
                "v2, guaranteed QoS (no QoS slice), CRI-O",
                format!("0::/kubepods.slice/kubepods-pod8d6c3a5c_1f2b_4a4e_9b1c_2f1e0c9d7a11.slice/crio-{CID}.scope\n"),
                facts(Some(CID), Some(UID), None),
            ),
            (
                "v1, kubelet cgroupfs driver (memory line preferred over the root cpuset)",
                format!(
                    "12:cpuset:/\n11:memory:/kubepods/besteffort/pod{UID}/{CID}\n\
                     10:pids:/kubepods/besteffort/pod{UID}/{CID}\n\
                     4:cpu,cpuacct:/kubepods/besteffort/pod{UID}/{CID}\n\
                     1:name=systemd:/kubepods/besteffort/pod{UID}/{CID}\n0::/\n"
                ),
                facts(Some(CID), Some(UID), None),
            ),
            (
                "v1, containerd with systemd cgroups (colon form)",
                format!(
                    "11:memory:/system.slice/containerd.service/kubepods-burstable-pod8d6c3a5c_1f2b_4a4e_9b1c_2f1e0c9d7a11.slice:cri-containerd:{CID}\n"
                ),
                facts(Some(CID), Some(UID), None),
            ),
            (
                "v2, static pod (32-hex config hash as UID)",
                format!(
                    "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod3f1d0b2c9e8a7f6b5c4d3e2f1a0b9c8d.slice/cri-containerd-{CID}.scope\n"
                ),
                facts(Some(CID), Some("3f1d0b2c9e8a7f6b5c4d3e2f1a0b9c8d"), None),
            ),
            (
                "v2, cgroup namespace of another container (relative path)",
                format!(
                    "0::/../../kubepods-besteffort-pod8d6c3a5c_1f2b_4a4e_9b1c_2f1e0c9d7a11.slice/cri-containerd-{CID}.scope\n"
                ),
                facts(Some(CID), Some(UID), None),
            ),
            ("v2, plain Docker", format!("0::/system.slice/docker-{CID}.scope\n"), facts(Some(CID), None, None)),
            (
                "v1, plain Docker",
                format!("13:memory:/docker/{CID}\n1:name=systemd:/docker/{CID}\n"),
                facts(Some(CID), None, None),
            ),
            (
                "v1, Slurm task/cgroup",
                "11:freezer:/slurm/uid_1000/job_4242/step_0\n\
                 10:memory:/slurm/uid_1000/job_4242/step_0/task_0\n\
                 5:devices:/slurm/uid_1000/job_4242/step_0/task_0\n\
                 1:name=systemd:/system.slice/slurmd.service\n"
                    .to_owned(),
                facts(None, None, Some("4242")),
            ),
            (
                "v2, Slurm",
                "0::/system.slice/slurmstepd.scope/job_4242/step_0/user/task_0\n".to_owned(),
                facts(None, None, Some("4242")),
            ),
            (
                "v2, Slurm with multiple slurmd (node-prefixed scope)",
                "0::/system.slice/gpu07_slurmstepd.scope/job_77/step_batch/user/task_0\n".to_owned(),
                facts(None, None, Some("77")),
            ),
            (
                "v2, login session",
                "0::/user.slice/user-1000.slice/session-3.scope\n".to_owned(),
                CgroupFacts::default(),
            ),
            (
                "a job_ segment outside Slurm is not a job",
                "0::/user.slice/user-1000.slice/job_12.scope\n".to_owned(),
                CgroupFacts::default(),
            ),
            (
                "a pod-like segment outside kubepods is not a pod",
                format!("0::/machine.slice/pod{UID}.slice\n"),
                CgroupFacts::default(),
            ),
            ("empty", String::new(), CgroupFacts::default()),
            ("garbage", "not a cgroup file\n::\n".to_owned(), CgroupFacts::default()),
        ];
        for (name, text, want) in cases {
            assert_eq!(&parse(text), want, "{name}");
        }
    }

    #[test]
    fn container_id_needs_64_hex() {
        assert_eq!(container_id("cri-containerd-abc"), None);
        assert_eq!(container_id(&format!("docker-{}", &CID[..63])), None);
        assert_eq!(container_id(&CID.to_uppercase()).as_deref(), Some(CID));
    }

    #[test]
    fn pod_uid_forms() {
        assert_eq!(pod_uid(&format!("pod{UID}")).as_deref(), Some(UID));
        assert_eq!(pod_uid("kubepods-besteffort-pod8d6c3a5c_1f2b_4a4e_9b1c_2f1e0c9d7a11").as_deref(), Some(UID));
        assert_eq!(pod_uid("kubepods-burstable"), None);
        assert_eq!(pod_uid("pods"), None);
        assert_eq!(pod_uid("pod8d6c3a5c-1f2b-4a4e-9b1c"), None);
    }
}
