//! [`SimHost`]: the raw facts a simulated node offers to attribution.
//!
//! The simulator never says "this process belongs to team X". It writes what a real node
//! would: `/proc/<pid>/cgroup` text with kubelet or slurmstepd paths, `/proc/<pid>/status`
//! with the process's uid, `/etc/passwd` names, Slurm per-GPU prolog files and the
//! kubelet's pod-resources answer — and the agent's [`Attributor`](crate::attribution::Attributor)
//! parses them exactly as it parses a real host's.
//!
//! Facts change over time (jobs start and end), and [`HostView`]'s calls carry no time,
//! so a `SimHost` has a time cursor: whoever drives an `Attributor` over it sets the
//! cursor first ([`SimHost::set_time`]). Clones share the cursor.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use apron_common::{GpuIdentity, UnixMicros};

use super::fleet::{Fleet, Incarnation};
use super::rng::{hex, k8s_suffix, pick, uuid};
use super::scenario::{NOTEBOOK_USERS, Owner, PASSWD, Qos, process_name};
use crate::attribution::{HostView, PodDevices};

/// A simulated node's procfs, passwd, Slurm files and kubelet, at the cursor's time.
#[derive(Clone, Debug)]
pub struct SimHost {
    fleet: Arc<Fleet>,
    now: Arc<AtomicI64>,
}

impl SimHost {
    pub(crate) fn new(fleet: Arc<Fleet>, now: UnixMicros) -> Self {
        Self { fleet, now: Arc::new(AtomicI64::new(now.0)) }
    }

    /// Moves the cursor: every answer from now on describes instant `t`.
    pub fn set_time(&self, t: UnixMicros) {
        self.now.store(t.0, Ordering::Release);
    }

    pub fn time(&self) -> UnixMicros {
        UnixMicros(self.now.load(Ordering::Acquire))
    }

    fn not_found(pid: u32) -> io::Error {
        io::Error::new(io::ErrorKind::NotFound, format!("no process {pid}"))
    }
}

/// Names and IDs of one allocation of a job, derived from its incarnation key.
pub(crate) struct Names {
    pub pod: String,
    pub pod_uid: String,
    pub container_id: String,
}

pub(crate) fn names(owner: &Owner, inc: &Incarnation) -> Option<Names> {
    let Owner::Pod { stem, notebook, .. } = owner else { return None };
    let suffix = k8s_suffix(inc.key, 5);
    let pod = if *notebook {
        let user = pick(inc.key >> 7, NOTEBOOK_USERS).unwrap_or("user");
        format!("{stem}-{user}-{suffix}")
    } else {
        format!("{stem}-{suffix}")
    };
    Some(Names { pod, pod_uid: uuid(inc.key ^ 1), container_id: hex(inc.key ^ 2, 4) })
}

/// Slurm job ids grow with submission time, about one job a minute across the cluster.
pub(crate) fn slurm_job_id(group: usize, inc: &Incarnation) -> u64 {
    let start_s = inc.start.unwrap_or(0).div_euclid(1_000_000);
    1_000_000 + (start_s - 1_700_000_000).rem_euclid(1_000_000_000) as u64 / 60 * 8 + (group % 8) as u64
}

impl HostView for SimHost {
    fn cgroup(&self, pid: u32) -> io::Result<String> {
        let t = self.time().0;
        let (slot, inc) = self.fleet.find_pid(pid, t).ok_or_else(|| Self::not_found(pid))?;
        let group = &self.fleet.groups[self.fleet.gpus[slot].group];
        Ok(match &group.owner {
            Owner::Pod { qos, .. } => {
                let n = names(&group.owner, &inc).ok_or_else(|| Self::not_found(pid))?;
                let uid = n.pod_uid.replace('-', "_");
                match qos {
                    Qos::Guaranteed => {
                        format!("0::/kubepods.slice/kubepods-pod{uid}.slice/cri-containerd-{}.scope\n", n.container_id)
                    }
                    Qos::Burstable => format!(
                        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid}.slice/cri-containerd-{}.scope\n",
                        n.container_id
                    ),
                }
            }
            Owner::Slurm { .. } => format!(
                "0::/system.slice/slurmstepd.scope/job_{}/step_0/user/task_0\n",
                slurm_job_id(self.fleet.gpus[slot].group, &inc)
            ),
            Owner::None => "0::/user.slice/user-0.slice/session-1.scope\n".to_owned(),
        })
    }

    fn status(&self, pid: u32) -> io::Result<String> {
        let t = self.time().0;
        let (slot, _) = self.fleet.find_pid(pid, t).ok_or_else(|| Self::not_found(pid))?;
        let gpu = &self.fleet.gpus[slot];
        let uid = match &self.fleet.groups[gpu.group].owner {
            Owner::Pod { uid, .. } | Owner::Slurm { uid, .. } => *uid,
            Owner::None => 0,
        };
        let comm = process_name(gpu.scenario).1;
        // Workers are children of a launcher (torchrun, tini, slurmstepd) one PID below.
        let ppid = pid.saturating_sub(1).max(1);
        Ok(format!(
            "Name:\t{comm}\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t{pid}\nNgid:\t0\nPid:\t{pid}\n\
             PPid:\t{ppid}\nTracerPid:\t0\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\nGid:\t{uid}\t{uid}\t{uid}\t{uid}\n\
             FDSize:\t256\nGroups:\t{uid}\nThreads:\t48\n"
        ))
    }

    fn user_name(&self, uid: u32) -> Option<String> {
        PASSWD.iter().find(|(u, _)| *u == uid).map(|(_, name)| (*name).to_owned())
    }

    fn slurm_gpu_file(&self, gpu: &GpuIdentity) -> io::Result<Option<String>> {
        let t = self.time().0;
        let Some(slot) = self.fleet.slot_of(&gpu.gpu_uuid) else { return Ok(None) };
        let gi = self.fleet.gpus[slot].group;
        let group = &self.fleet.groups[gi];
        let Owner::Slurm { user, uid, account, partition, qos, jobstats } = &group.owner else { return Ok(None) };
        let Some(inc) = self.fleet.incarnation(gi, t) else { return Ok(None) };
        let job = slurm_job_id(gi, &inc);
        Ok(Some(if *jobstats {
            format!("{job} {uid}\n")
        } else {
            let start = inc.start.unwrap_or(0).div_euclid(1_000_000);
            format!(
                "# written by apron's Slurm prolog, removed by its epilog\njob_id={job}\nuser={user}\nuid={uid}\n\
                 account={account}\npartition={partition}\nqos={qos}\ngpu_uuid={}\nstart_time={start}\n",
                gpu.gpu_uuid
            )
        }))
    }

    fn pod_resources(&self) -> io::Result<Option<Vec<PodDevices>>> {
        let t = self.time().0;
        let inventory = self.fleet.inventory();
        let mut answer = Vec::new();
        for (gi, group) in self.fleet.groups.iter().enumerate() {
            let Owner::Pod { namespace, container, .. } = &group.owner else { continue };
            let Some(inc) = self.fleet.incarnation(gi, t) else { continue };
            let Some(n) = names(&group.owner, &inc) else { continue };
            answer.push(PodDevices {
                namespace: (*namespace).to_owned(),
                pod: n.pod,
                container: (*container).to_owned(),
                resource_name: "nvidia.com/gpu".to_owned(),
                device_ids: group
                    .slots
                    .iter()
                    .filter_map(|&s| inventory.get(s))
                    .map(|g| g.gpu_uuid.to_string())
                    .collect(),
            });
        }
        Ok(Some(answer))
    }
}
