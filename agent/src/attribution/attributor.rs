//! [`Attributor`]: joins the parsed facts into answers about processes and GPUs.

use std::collections::{BTreeSet, HashMap};
use std::error::Error;
use std::io;
use std::sync::{Mutex, MutexGuard, PoisonError};

use apron_common::{GpuHolder, GpuIdentity, ProcessRow};

use super::cgroup::{self, CgroupFacts};
use super::podresources::{DeviceMap, Holder};
use super::slurm::{self, SlurmJob};
use super::{AttributionConfig, HostView, users};

/// Failed `List()` calls after which the last answer is dropped: a kubelet restart should
/// not turn allocated GPUs into unallocated ones, but a dead kubelet must not pin pods to
/// GPUs for ever.
const KEEP_STALE_PODS_FOR: u32 = 3;

/// Who a GPU process belongs to, as far as the node can tell.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProcessAttribution {
    pub container_id: Option<String>,
    /// Known from the cgroup even when pod-resources cannot name the pod.
    pub pod_uid: Option<String>,
    pub pod: Option<String>,
    pub namespace: Option<String>,
    pub container: Option<String>,
    pub job_id: Option<String>,
    pub user: Option<String>,
}

/// What the driver says about one GPU process, before attribution.
#[derive(Clone, Debug, PartialEq)]
pub struct ProcessSample {
    pub pid: u32,
    pub name: Option<String>,
    pub fb_used_bytes: Option<i64>,
    pub sm_util: Option<f64>,
}

impl ProcessAttribution {
    /// The `gpu_processes` row for `sample` on `gpu` at `time`.
    pub fn into_row(self, time: apron_common::UnixMicros, gpu: &GpuIdentity, sample: ProcessSample) -> ProcessRow {
        ProcessRow {
            time,
            host: gpu.host.clone(),
            gpu_uuid: gpu.gpu_uuid.clone(),
            pid: sample.pid,
            process_name: sample.name,
            user: self.user,
            fb_used_bytes: sample.fb_used_bytes,
            sm_util: sample.sm_util,
            container_id: self.container_id,
            pod: self.pod,
            namespace: self.namespace,
            container: self.container,
            pod_uid: self.pod_uid,
            job_id: self.job_id,
        }
    }
}

/// Answers "whose is this process / GPU?" from a [`HostView`]'s facts.
///
/// Call [`refresh`](Self::refresh) once per process-sampling tick, then
/// [`process`](Self::process) per GPU process and [`gpu_owner`](Self::gpu_owner) per GPU,
/// from any thread.
pub struct Attributor {
    host: Box<dyn HostView>,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    devices: DeviceMap,
    failed_lists: u32,
    /// Per PID, kept while the PID is looked up at least once per refresh: a process's
    /// cgroup and uid do not change. (A PID reused between two ticks keeps the old
    /// answer until it is missed for a tick; NVML's process list makes that rare.)
    pids: HashMap<u32, CachedPid>,
    /// Per GPU UUID, for one refresh: `gpu_owner` may be asked every window.
    slurm: HashMap<String, Option<SlurmOwner>>,
    /// Problems met since the last refresh, and those the last refresh reported.
    problems: BTreeSet<String>,
    reported: BTreeSet<String>,
}

struct CachedPid {
    facts: PidFacts,
    seen: bool,
}

#[derive(Clone)]
struct PidFacts {
    /// `None` when the cgroup file could not be read (unknown, unlike "no pod").
    cgroup: Option<CgroupFacts>,
    uid: Option<u32>,
    user: Option<String>,
}

#[derive(Clone)]
struct SlurmOwner {
    job: SlurmJob,
    /// The file's user name, else its uid's name in passwd, else the uid.
    user: Option<String>,
}

impl Attributor {
    /// `config` is taken for the attribution knobs that do not belong to a host (none yet);
    /// the host's paths are in its own copy.
    pub fn new(_config: &AttributionConfig, host: Box<dyn HostView>) -> Self {
        Self { host, state: Mutex::new(State::default()) }
    }

    /// Re-reads pod-resources, forgets per-refresh caches and PIDs not looked up since the
    /// last refresh, and returns the problems that are new since the last refresh (a
    /// persisting problem is returned once; one that clears and comes back, again).
    pub fn refresh(&self) -> Vec<String> {
        // Without the lock: the call may take up to its timeout, and lookups from other
        // threads keep answering from the last map meanwhile.
        let listing = self.host.pod_resources();
        let mut state = self.lock();
        let mut problems = std::mem::take(&mut state.problems);
        match listing {
            Ok(pods) => {
                state.devices = pods.map(|pods| DeviceMap::new(&pods)).unwrap_or_default();
                state.failed_lists = 0;
            }
            Err(e) => {
                problems.insert(format!("kubelet pod-resources List() failed: {}", chain(&e)));
                state.failed_lists += 1;
                if state.failed_lists >= KEEP_STALE_PODS_FOR {
                    state.devices = DeviceMap::default();
                }
            }
        }
        state.slurm.clear();
        state.pids.retain(|_, pid| std::mem::replace(&mut pid.seen, false));
        let new = problems.difference(&state.reported).cloned().collect();
        state.reported = problems;
        new
    }

    /// Who process `pid`, running on `gpu`, belongs to.
    pub fn process(&self, gpu: &GpuIdentity, pid: u32) -> ProcessAttribution {
        let facts = self.pid_facts(pid);
        let mut state = self.lock();
        let slurm = state.slurm_owner(&*self.host, gpu);
        // Pod-resources names the GPU's holder, not the process's pod: a process whose
        // cgroup shows it outside any pod (a host shell, a daemon) is not the holder's.
        let outside_pods = facts.cgroup.as_ref().is_some_and(|c| c.pod_uid.is_none());
        let cgroup = facts.cgroup.unwrap_or_default();
        let pod = if outside_pods { PodFields::default() } else { PodFields::of(&state.devices.holders(gpu)) };

        let user = facts.user.or_else(|| match (&slurm, facts.uid) {
            // Not in passwd (LDAP users): the prolog's name for the same uid, else the uid.
            (Some(s), Some(uid)) if s.job.uid == Some(uid) && s.job.user.is_some() => s.job.user.clone(),
            (_, Some(uid)) => Some(uid.to_string()),
            // No status (the process is hidden or gone): whoever holds the GPU.
            (Some(s), None) => s.user.clone(),
            (None, None) => None,
        });
        ProcessAttribution {
            container_id: cgroup.container_id,
            pod_uid: cgroup.pod_uid,
            pod: pod.pod,
            namespace: pod.namespace,
            container: pod.container,
            job_id: cgroup.slurm_job_id.or_else(|| slurm.map(|s| s.job.job_id)),
            user,
        }
    }

    /// Who holds `gpu`, even with no process running on it, as the `gpu_samples`
    /// ownership columns; `None` when nobody does. A pod when pod-resources assigns the
    /// GPU to pods (even where several share it and none is named; a Slurm job on the
    /// same GPU still fills `job_id` and its fields), else the Slurm job. The job's
    /// account, partition and QoS come from Apron's prolog file only: the server maps the
    /// account to a team and partition/QoS to a workload kind.
    pub fn gpu_owner(&self, gpu: &GpuIdentity) -> Option<GpuHolder> {
        let mut state = self.lock();
        let slurm = state.slurm_owner(&*self.host, gpu);
        let holders = state.devices.holders(gpu);
        if holders.is_empty() && slurm.is_none() {
            return None;
        }
        let pod = PodFields::of(&holders);
        let held_by_pod = !holders.is_empty();
        let (job, user) = slurm.map_or((SlurmJob::default(), None), |s| (s.job, s.user));
        drop(state);
        let pod_labels = match (&pod.namespace, &pod.pod) {
            (Some(ns), Some(name)) => self.host.pod_labels(ns, name),
            _ => None,
        };
        let job_id = (!job.job_id.is_empty()).then_some(job.job_id);
        let base = match (&job_id, held_by_pod) {
            (Some(job), false) => GpuHolder::slurm_job(job.clone()),
            _ => GpuHolder::pod(pod.namespace, pod.pod, pod.container),
        };
        Some(GpuHolder {
            job_id,
            user,
            account: job.account,
            partition: job.partition,
            qos: job.qos,
            pod_labels,
            ..base
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is caches and maps; one left half-updated by a panic is still usable.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn pid_facts(&self, pid: u32) -> PidFacts {
        if let Some(cached) = self.lock().pids.get_mut(&pid) {
            cached.seen = true;
            return cached.facts.clone();
        }
        // Read without the lock; a racing lookup of the same PID just reads twice.
        let mut problems = Vec::new();
        let mut read = |what: &str, result: io::Result<String>| {
            result
                .inspect_err(|e| {
                    // A process that exited since NVML listed it is no problem.
                    if e.kind() != io::ErrorKind::NotFound {
                        problems.push(format!("cannot read a GPU process's {what}: {e}"));
                    }
                })
                .ok()
        };
        let cgroup = read("cgroup", self.host.cgroup(pid)).map(|text| cgroup::parse(&text));
        let status = read("status", self.host.status(pid));
        let uid = status.as_deref().and_then(users::real_uid);
        let user = uid.and_then(|uid| self.host.user_name(uid));
        let facts = PidFacts { cgroup, uid, user };

        let mut state = self.lock();
        state.problems.extend(problems);
        // Only complete answers are kept; a failed read is retried on the next tick.
        if facts.cgroup.is_some() && status.is_some() {
            state.pids.insert(pid, CachedPid { facts: facts.clone(), seen: true });
        }
        facts
    }
}

impl State {
    /// The GPU's Slurm job, read at most once per refresh.
    fn slurm_owner(&mut self, host: &dyn HostView, gpu: &GpuIdentity) -> Option<SlurmOwner> {
        let key = gpu.gpu_uuid.as_str();
        if let Some(cached) = self.slurm.get(key) {
            return cached.clone();
        }
        let parsed = host
            .slurm_gpu_file(gpu)
            .map_err(|e| format!("cannot read the Slurm file of GPU {key}: {e}"))
            .and_then(|text| {
                text.map(|text| slurm::parse_gpu_file(&text))
                    .transpose()
                    .map(Option::flatten)
                    .map_err(|e| format!("bad Slurm file for GPU {key}: {e}"))
            });
        let owner = match parsed {
            Ok(job) => job.map(|job| SlurmOwner {
                user: job
                    .user
                    .clone()
                    .or_else(|| job.uid.map(|uid| host.user_name(uid).unwrap_or_else(|| uid.to_string()))),
                job,
            }),
            Err(problem) => {
                self.problems.insert(problem);
                None
            }
        };
        self.slurm.insert(key.to_owned(), owner.clone());
        owner
    }
}

/// The pod labels for a GPU's holders: the holder's when there is one. Time-slicing can
/// give one GPU to several containers; then only what they all share is named, since any
/// single name would be a guess.
#[derive(Default)]
struct PodFields {
    namespace: Option<String>,
    pod: Option<String>,
    container: Option<String>,
}

impl PodFields {
    fn of(holders: &[&Holder]) -> Self {
        let namespace = common(holders.iter().map(|h| &h.namespace));
        // A pod name means something only within its namespace, a container within its pod.
        let pod = namespace.and_then(|_| common(holders.iter().map(|h| &h.pod)));
        let container = pod.and_then(|_| common(holders.iter().map(|h| &h.container)));
        let named = |s: Option<&String>| s.filter(|s| !s.is_empty()).cloned();
        Self { namespace: named(namespace), pod: named(pod), container: named(container) }
    }
}

/// The value all items share; `None` for no items or differing ones.
fn common<'a>(mut items: impl Iterator<Item = &'a String>) -> Option<&'a String> {
    let first = items.next()?;
    items.all(|item| item == first).then_some(first)
}

/// An error with its sources, for a log line that says what actually went wrong. Wrappers
/// that repeat their source's text (hyper, io) are said once.
fn chain(error: &dyn Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        let part = e.to_string();
        if !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        source = e.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;
    use crate::attribution::PodDevices;
    use crate::attribution::test_support::gpu;

    const CID: &str = "4f5c2a9e0b1d8c7a6f5e4d3c2b1a09f8e7d6c5b4a39281706f5e4d3c2b1a0f9e";
    const UID: &str = "8d6c3a5c-1f2b-4a4e-9b1c-2f1e0c9d7a11";

    /// A host made of literals, counting cgroup reads to observe the cache.
    #[derive(Default)]
    struct FakeHost {
        cgroups: HashMap<u32, String>,
        statuses: HashMap<u32, String>,
        slurm: HashMap<String, String>,
        pods: Option<Vec<PodDevices>>,
        list_fails: bool,
        cgroup_reads: Arc<AtomicU32>,
    }

    impl HostView for FakeHost {
        fn cgroup(&self, pid: u32) -> io::Result<String> {
            self.cgroup_reads.fetch_add(1, Ordering::Relaxed);
            if pid == 666 {
                return Err(io::Error::from(io::ErrorKind::PermissionDenied));
            }
            self.cgroups.get(&pid).cloned().ok_or_else(|| io::ErrorKind::NotFound.into())
        }
        fn status(&self, pid: u32) -> io::Result<String> {
            self.statuses.get(&pid).cloned().ok_or_else(|| io::ErrorKind::NotFound.into())
        }
        fn user_name(&self, uid: u32) -> Option<String> {
            (uid == 1001).then(|| "alice".to_owned())
        }
        fn slurm_gpu_file(&self, gpu: &GpuIdentity) -> io::Result<Option<String>> {
            Ok(self.slurm.get(gpu.gpu_uuid.as_str()).cloned())
        }
        fn pod_resources(&self) -> io::Result<Option<Vec<PodDevices>>> {
            if self.list_fails {
                return Err(io::Error::other("kubelet down"));
            }
            Ok(self.pods.clone())
        }
    }

    fn holder(ns: &str, pod: &str, container: &str, ids: &[&str]) -> PodDevices {
        PodDevices {
            namespace: ns.into(),
            pod: pod.into(),
            container: container.into(),
            resource_name: "nvidia.com/gpu".into(),
            device_ids: ids.iter().map(|id| (*id).into()).collect(),
        }
    }

    fn pod_cgroup() -> String {
        format!(
            "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/cri-containerd-{CID}.scope\n",
            UID.replace('-', "_")
        )
    }

    fn host() -> FakeHost {
        let mut host = FakeHost::default();
        host.cgroups.insert(10, pod_cgroup());
        host.statuses.insert(10, "Uid:\t1001\t1001\t1001\t1001\n".into());
        host.cgroups.insert(20, "0::/user.slice/user-1001.slice/session-4.scope\n".into());
        host.statuses.insert(20, "Uid:\t2000\t2000\t2000\t2000\n".into());
        host.cgroups.insert(30, "0::/system.slice/slurmstepd.scope/job_99/step_0/user/task_0\n".into());
        host.statuses.insert(30, "Uid:\t3000\t3000\t3000\t3000\n".into());
        host.cgroups.insert(40, pod_cgroup());
        host.pods = Some(vec![
            holder("ml", "train-0", "main", &["GPU-a"]),
            holder("inf", "serve-1", "srv", &["GPU-shared::0"]),
            holder("inf", "serve-2", "srv", &["GPU-shared::1"]),
        ]);
        host.slurm.insert("GPU-job".into(), "job_id=99\nuser=carol\nuid=3000\naccount=phys\n".into());
        host.slurm.insert("GPU-bad".into(), "job_id=1\nuid=x\n".into());
        host
    }

    fn attributor(host: FakeHost) -> Attributor {
        Attributor::new(&AttributionConfig::default(), Box::new(host))
    }

    #[test]
    fn process_answers() {
        let a = attributor(host());
        assert_eq!(a.refresh(), Vec::<String>::new());
        let named = ProcessAttribution {
            container_id: Some(CID.into()),
            pod_uid: Some(UID.into()),
            pod: Some("train-0".into()),
            namespace: Some("ml".into()),
            container: Some("main".into()),
            job_id: None,
            user: Some("alice".into()),
        };
        let cases = [
            ("pod process on its pod's GPU", gpu("GPU-a", 0, None), 10, named.clone()),
            (
                "pod process on a GPU pod-resources does not list: the UID stays",
                gpu("GPU-z", 5, None),
                10,
                ProcessAttribution { pod: None, namespace: None, container: None, ..named.clone() },
            ),
            (
                "shared GPU: only the common namespace",
                gpu("GPU-shared", 1, None),
                10,
                ProcessAttribution { pod: None, container: None, namespace: Some("inf".into()), ..named.clone() },
            ),
            (
                "host process on a pod's GPU, user not in passwd",
                gpu("GPU-a", 0, None),
                20,
                ProcessAttribution { user: Some("2000".into()), ..ProcessAttribution::default() },
            ),
            (
                "Slurm process: job from the cgroup, user from the prolog for the same uid",
                gpu("GPU-job", 2, None),
                30,
                ProcessAttribution {
                    job_id: Some("99".into()),
                    user: Some("carol".into()),
                    ..ProcessAttribution::default()
                },
            ),
            (
                "cgroup readable, status gone: pod named, user unknown",
                gpu("GPU-a", 0, None),
                40,
                ProcessAttribution { user: None, ..named.clone() },
            ),
            (
                "unknown cgroup (permission denied): the GPU's holder",
                gpu("GPU-a", 0, None),
                666,
                ProcessAttribution {
                    pod: Some("train-0".into()),
                    namespace: Some("ml".into()),
                    container: Some("main".into()),
                    ..ProcessAttribution::default()
                },
            ),
            (
                "unknown process on a Slurm GPU: job and user from the file",
                gpu("GPU-job", 2, None),
                777,
                ProcessAttribution {
                    job_id: Some("99".into()),
                    user: Some("carol".into()),
                    ..ProcessAttribution::default()
                },
            ),
        ];
        for (name, gpu, pid, want) in cases {
            assert_eq!(a.process(&gpu, pid), want, "{name}");
        }
        let problems = a.refresh();
        assert_eq!(
            problems,
            vec!["cannot read a GPU process's cgroup: permission denied".to_owned()],
            "read problems are reported by the next refresh"
        );
    }

    #[test]
    fn gpu_owners() {
        let a = attributor(host());
        a.refresh();
        let pod_owner = GpuHolder::pod(Some("ml".into()), Some("train-0".into()), Some("main".into()));
        let job_owner =
            GpuHolder { user: Some("carol".into()), account: Some("phys".into()), ..GpuHolder::slurm_job("99") };
        let shared = GpuHolder::pod(Some("inf".into()), None, None);
        let cases = [
            (gpu("GPU-a", 0, None), Some(pod_owner)),
            (gpu("GPU-job", 2, None), Some(job_owner)),
            (gpu("GPU-shared", 1, None), Some(shared)),
            (gpu("GPU-free", 3, None), None),
            (gpu("GPU-bad", 4, None), None),
        ];
        for (gpu, want) in cases {
            assert_eq!(a.gpu_owner(&gpu), want, "{}", gpu.gpu_uuid);
        }
        assert_eq!(a.refresh(), vec!["bad Slurm file for GPU GPU-bad: uid \"x\" is not valid".to_owned()]);
    }

    #[test]
    fn caches_pids_until_they_are_missed() {
        let host = host();
        let reads = Arc::clone(&host.cgroup_reads);
        let a = attributor(host);
        let gpu = gpu("GPU-a", 0, None);
        a.refresh();
        a.process(&gpu, 10);
        a.process(&gpu, 10);
        assert_eq!(reads.load(Ordering::Relaxed), 1, "cached within a tick");
        a.refresh();
        a.process(&gpu, 10);
        assert_eq!(reads.load(Ordering::Relaxed), 1, "cached across ticks while seen");
        a.refresh(); // pid 10 not looked up during the last tick
        a.refresh();
        a.process(&gpu, 10);
        assert_eq!(reads.load(Ordering::Relaxed), 2, "evicted once missed");
        a.process(&gpu, 666);
        a.process(&gpu, 666);
        assert_eq!(reads.load(Ordering::Relaxed), 4, "failed reads are not cached");
    }

    #[test]
    fn a_persisting_problem_is_reported_once() {
        let mut failing = host();
        failing.list_fails = true;
        let a = attributor(failing);
        let problems = a.refresh();
        assert_eq!(problems, vec!["kubelet pod-resources List() failed: kubelet down".to_owned()]);
        for _ in 1..KEEP_STALE_PODS_FOR {
            assert_eq!(a.refresh(), Vec::<String>::new(), "a persisting problem is reported once");
        }
    }

    #[test]
    fn keeps_the_last_pod_map_through_a_few_failures() {
        // A host whose kubelet fails after the first call.
        struct Flaky(FakeHost, AtomicU32);
        impl HostView for Flaky {
            fn cgroup(&self, pid: u32) -> io::Result<String> {
                self.0.cgroup(pid)
            }
            fn status(&self, pid: u32) -> io::Result<String> {
                self.0.status(pid)
            }
            fn user_name(&self, uid: u32) -> Option<String> {
                self.0.user_name(uid)
            }
            fn slurm_gpu_file(&self, gpu: &GpuIdentity) -> io::Result<Option<String>> {
                self.0.slurm_gpu_file(gpu)
            }
            fn pod_resources(&self) -> io::Result<Option<Vec<PodDevices>>> {
                match self.1.fetch_add(1, Ordering::Relaxed) {
                    0 => self.0.pod_resources(),
                    _ => Err(io::Error::other("kubelet down")),
                }
            }
        }
        let a = Attributor::new(&AttributionConfig::default(), Box::new(Flaky(host(), AtomicU32::new(0))));
        let gpu = gpu("GPU-a", 0, None);
        a.refresh();
        for _ in 1..KEEP_STALE_PODS_FOR {
            a.refresh();
            assert!(a.gpu_owner(&gpu).is_some(), "kept through a short outage");
        }
        a.refresh();
        assert_eq!(a.gpu_owner(&gpu), None, "dropped after {KEEP_STALE_PODS_FOR} failures");
    }

    #[test]
    fn is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<Attributor>();
    }
}
