//! Who holds a GPU, for costing: one owner type for every step of the design brief's
//! order, and its resolution to a team, a workload kind and interruptibility.
//!
//! The order, for each window (`docs/cost.md`):
//!
//! 1. the holder the window carries — a pod or a Slurm job, as the agent saw it
//!    ([`apron_common::GpuHolder`], the owner columns of `gpu_samples`);
//! 2. else a static map entry (`[cost.teams] gpus`, then `hosts`): a dedicated
//!    allocation, owner `static:<team>` ([`TeamConfig::static_owner`]);
//! 3. else a process of a Unix user that `[cost.teams] users` maps to a team, sampled at
//!    most [`PROCESS_SAMPLE_REACH_US`] before the window ended ([`ProcessUsers`]);
//! 4. else nobody: the window is unallocated.
//!
//! Team, kind and interruptible then follow from the owner's facts alone
//! ([`TeamConfig::resolve`]).

use std::collections::BTreeMap;

use apron_common::{GpuHolder, HolderKind};

use crate::team::{AllocationFacts, TeamConfig};

/// How far back a process sample still speaks for a window: the agent samples the
/// process list every few seconds, not every window.
pub const PROCESS_SAMPLE_REACH_US: i64 = 10_000_000;

/// The `owner_kind` of an allocation: a scheduler's holder, or one the cost ledger
/// assigned from its maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum OwnerKind {
    /// A pod or a Slurm job, as the windows carry it.
    Holder(HolderKind),
    /// A `[cost.teams] gpus` / `hosts` entry: a dedicated allocation.
    Static,
    /// A process of a mapped Unix user on a GPU nobody held.
    Process,
}

impl OwnerKind {
    pub const ALL: [OwnerKind; 4] = [
        OwnerKind::Holder(HolderKind::Pod),
        OwnerKind::Holder(HolderKind::SlurmJob),
        OwnerKind::Static,
        OwnerKind::Process,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            OwnerKind::Holder(k) => k.as_str(),
            OwnerKind::Static => "static",
            OwnerKind::Process => "process",
        }
    }

    /// The `allocations.source` of an allocation of this kind: the system that said so.
    pub const fn source(self) -> &'static str {
        match self {
            OwnerKind::Holder(HolderKind::Pod) => "kubernetes",
            OwnerKind::Holder(HolderKind::SlurmJob) => "slurm",
            OwnerKind::Static => "static",
            OwnerKind::Process => "process",
        }
    }

    /// The kind an `owner_kind` column value names; `None` for a value no part of Apron
    /// writes.
    pub fn parse(s: &str) -> Option<OwnerKind> {
        OwnerKind::ALL.into_iter().find(|k| k.as_str() == s)
    }
}

/// One holder's facts: the owner columns of `gpu_samples` and `allocations`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Owner {
    pub kind: OwnerKind,
    pub owner: String,
    pub namespace: Option<String>,
    pub job_id: Option<String>,
    pub user: Option<String>,
    pub account: Option<String>,
    pub partition: Option<String>,
    pub qos: Option<String>,
    /// Labels and selected annotations as JSON object text (the `pod_labels` column).
    pub labels: Option<String>,
}

impl Owner {
    fn bare(kind: OwnerKind, owner: String) -> Owner {
        Owner {
            kind,
            owner,
            namespace: None,
            job_id: None,
            user: None,
            account: None,
            partition: None,
            qos: None,
            labels: None,
        }
    }

    /// The labels as a map (the column holds a JSON object; non-string values and text
    /// that is not an object give no labels).
    pub fn label_map(&self) -> BTreeMap<String, String> {
        self.labels
            .as_deref()
            .and_then(|l| serde_json::from_str::<BTreeMap<String, serde_json::Value>>(l).ok())
            .map(|m| m.into_iter().filter_map(|(k, v)| v.as_str().map(|s| (k, s.to_owned()))).collect())
            .unwrap_or_default()
    }

    /// What team resolution knows of this owner on `gpu_uuid` at `host`.
    pub fn facts(&self, gpu_uuid: &str, host: &str) -> AllocationFacts {
        AllocationFacts {
            labels: self.label_map(),
            namespace: self.namespace.clone(),
            slurm_account: self.account.clone(),
            slurm_partition: self.partition.clone(),
            slurm_qos: self.qos.clone(),
            gpu_uuid: Some(gpu_uuid.to_owned()),
            host: Some(host.to_owned()),
            unix_user: self.user.clone(),
            markers: Vec::new(),
        }
    }
}

impl From<&GpuHolder> for Owner {
    fn from(h: &GpuHolder) -> Owner {
        Owner {
            kind: OwnerKind::Holder(h.kind),
            owner: h.owner.clone(),
            namespace: h.namespace.clone(),
            job_id: h.job_id.clone(),
            user: h.user.clone(),
            account: h.account.clone(),
            partition: h.partition.clone(),
            qos: h.qos.clone(),
            labels: h.pod_labels.clone(),
        }
    }
}

/// An owner with its team, workload kind and interruptibility.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    pub owner: Owner,
    pub team: String,
    pub workload_kind: Option<String>,
    pub interruptible: bool,
}

impl TeamConfig {
    /// Step 2 of the order: the static map's dedicated allocation of a GPU nobody holds
    /// (`gpus` before `hosts`).
    pub fn static_owner(&self, gpu_uuid: &str, host: &str) -> Option<Owner> {
        let team = self.gpus.get(gpu_uuid).or_else(|| self.hosts.get(host))?;
        Some(Owner::bare(OwnerKind::Static, format!("static:{team}")))
    }

    /// The team, workload kind and interruptibility of `owner` on `gpu_uuid` at `host`.
    pub fn resolve(&self, gpu_uuid: &str, host: &str, owner: Owner) -> Resolved {
        let facts = owner.facts(gpu_uuid, host);
        Resolved {
            team: self.resolve_team(&facts).team,
            workload_kind: self.workload_kind(&facts),
            interruptible: self.interruptible(&facts),
            owner,
        }
    }
}

/// Step 3 of the order: the process samples of one GPU whose Unix user the team map
/// knows, in time order. Users the map does not know are dropped, so their compute stays
/// unallocated busy.
#[derive(Debug, Clone, Default)]
pub struct ProcessUsers {
    samples: Vec<(i64, String)>,
}

impl ProcessUsers {
    /// `samples` are `(sample time µs, user)` in any order.
    pub fn new<'a>(teams: &TeamConfig, samples: impl IntoIterator<Item = (i64, &'a str)>) -> ProcessUsers {
        let mut samples: Vec<(i64, String)> =
            samples.into_iter().filter(|(_, u)| teams.users.contains_key(*u)).map(|(t, u)| (t, u.to_owned())).collect();
        samples.sort();
        ProcessUsers { samples }
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// The owner of a window nobody held that ended at `end_us`: the user of the latest
    /// sample at or before the end, if it is at most [`PROCESS_SAMPLE_REACH_US`] old
    /// (of two users sampled at the same instant, the greater name, deterministically).
    pub fn owner_at(&self, end_us: i64) -> Option<Owner> {
        let i = self.samples.partition_point(|(t, _)| *t <= end_us);
        let (t, user) = &self.samples[i.checked_sub(1)?];
        if end_us - t > PROCESS_SAMPLE_REACH_US {
            return None;
        }
        let mut o = Owner::bare(OwnerKind::Process, user.clone());
        o.user = Some(user.clone());
        Some(o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn teams() -> TeamConfig {
        TeamConfig::from_toml(
            r#"
            namespaces = { ml = "research" }
            slurm_accounts = { physics = "sim" }
            gpus = { "GPU-a" = "vision" }
            hosts = { "node-1" = "infra", "node-2" = "speech" }
            users = { alice = "nlp", bob = "speech" }
            interruptible = [{ label = "preemptible", label_value = "true" }]
            "#,
        )
        .expect("team config")
    }

    #[test]
    fn owner_kinds_round_trip_through_their_column_spelling() {
        for k in [
            OwnerKind::Holder(HolderKind::Pod),
            OwnerKind::Holder(HolderKind::SlurmJob),
            OwnerKind::Static,
            OwnerKind::Process,
        ] {
            assert_eq!(OwnerKind::parse(k.as_str()), Some(k));
        }
        assert_eq!(OwnerKind::parse("daemonset"), None);
        assert_eq!(OwnerKind::Holder(HolderKind::Pod).source(), "kubernetes");
        assert_eq!(OwnerKind::Holder(HolderKind::SlurmJob).source(), "slurm");
    }

    #[test]
    fn a_pod_resolves_by_label_then_namespace_and_carries_its_interruptibility() {
        let mut pod = GpuHolder::pod(Some("ml".into()), Some("train-0".into()), None);
        let r = teams().resolve("GPU-z", "node-9", Owner::from(&pod));
        assert_eq!((r.team.as_str(), r.interruptible), ("research", false));
        pod.pod_labels = Some(r#"{"team":"vision-labelled","preemptible":"true","n":3}"#.into());
        let r = teams().resolve("GPU-z", "node-9", Owner::from(&pod));
        assert_eq!((r.team.as_str(), r.interruptible), ("vision-labelled", true));
        assert_eq!(r.owner.kind.as_str(), "pod");
        assert_eq!(r.owner.owner, "ml/train-0");
    }

    #[test]
    fn a_slurm_job_resolves_by_account() {
        let mut job = GpuHolder::slurm_job("4711");
        job.account = Some("physics".into());
        let r = teams().resolve("GPU-z", "node-9", Owner::from(&job));
        assert_eq!((r.team.as_str(), r.owner.owner.as_str(), r.owner.kind.as_str()), ("sim", "4711", "slurm_job"));
    }

    #[test]
    fn static_maps_prefer_the_gpu_entry_to_the_host_entry() {
        let t = teams();
        let by_gpu = t.static_owner("GPU-a", "node-1").expect("gpu entry");
        assert_eq!((by_gpu.kind, by_gpu.owner.as_str()), (OwnerKind::Static, "static:vision"));
        assert_eq!(t.resolve("GPU-a", "node-1", by_gpu).team, "vision");
        let by_host = t.static_owner("GPU-b", "node-1").expect("host entry");
        assert_eq!(by_host.owner, "static:infra");
        assert_eq!(t.resolve("GPU-b", "node-1", by_host).team, "infra");
        assert_eq!(t.static_owner("GPU-b", "node-3"), None);
    }

    #[test]
    fn a_process_speaks_for_ten_seconds_after_its_sample_and_only_for_mapped_users() {
        let t = teams();
        // alice at 100 s, an unmapped user at 115 s, bob at 130 s.
        let p = ProcessUsers::new(&t, [(130_000_000, "bob"), (100_000_000, "alice"), (115_000_000, "mallory")]);
        let at = |s: i64| p.owner_at(s * 1_000_000).map(|o| o.owner);
        assert_eq!(at(99), None, "before any sample");
        assert_eq!(at(100).as_deref(), Some("alice"), "at the sample");
        assert_eq!(at(110).as_deref(), Some("alice"), "10 s after: still in reach");
        assert_eq!(at(111), None, "11 s after: out of reach; mallory is not mapped");
        assert_eq!(at(120), None, "mallory's sample does not extend alice's reach");
        assert_eq!(at(135).as_deref(), Some("bob"));
        let bob = p.owner_at(135_000_000).expect("bob");
        assert_eq!((bob.kind, bob.user.as_deref()), (OwnerKind::Process, Some("bob")));
        assert_eq!(t.resolve("GPU-z", "node-9", bob).team, "speech");
        assert!(ProcessUsers::new(&t, [(1, "mallory")]).is_empty());
    }
}
