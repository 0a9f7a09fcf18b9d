//! Team, workload kind and interruptibility of an allocation.
//!
//! **Team resolution order (the design brief's, exactly):**
//!
//! 1. pod label: the first of `label_keys` present with a non-empty value. Default keys:
//!    `team`; then Run:ai's project labels `project` and `runai/project` (Run:ai labels a
//!    workload's pods with its project, and its metrics carry `project`). Kubeflow's unit
//!    of tenancy is the Profile, whose **namespace** is the team, so Kubeflow is served by
//!    step 2; its labels (`app.kubernetes.io/part-of`, `notebook-name`, …) name apps, not
//!    owners, and are therefore not defaults — add keys to `label_keys` if a site uses one;
//! 2. namespace → team map;
//! 3. Slurm account → team map;
//! 4. static GPU UUID → team map, then host → team map (a dedicated allocation: the GPU is
//!    the team's whether or not it runs anything);
//! 5. Unix user → team map;
//! 6. else [`UNASSIGNED`].
//!
//! Time no allocation holds belongs to [`crate::classify::UNALLOCATED`]; that name is
//! reserved: a label carrying it is skipped and a map naming it is refused.
//!
//! # TOML shape (`deny_unknown_fields`)
//!
//! ```toml
//! label_keys = ["team", "project", "runai/project"]
//! namespaces = { jupyter-alice = "ml", inference = "platform" }
//! slurm_accounts = { vision = "vision" }
//! gpus = { "GPU-3f2a…" = "research" }
//! hosts = { "dgx-07" = "research" }
//! users = { carol = "vision" }
//!
//! [[workload_kind]]            # first matching rule wins; all given selectors must match
//! kind = "notebook"
//! label = "notebook-name"      # label key present (any value) …
//! [[workload_kind]]
//! kind = "inference"
//! label = "app.kubernetes.io/component"
//! label_value = "inference" # … or with this value
//! [[workload_kind]]
//! kind = "batch"
//! partition = "cpu-gpu"        # Slurm partition
//! qos = "low"                  # and QoS
//!
//! [[interruptible]]            # first matching rule wins; default: not interruptible
//! qos = "preemptible"
//! [[interruptible]]
//! marker = "checkpointing"     # a marker the agent reports (e.g. a checkpoint hook)
//! ```

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::classify::UNALLOCATED;

/// The team of an allocation nothing maps.
pub const UNASSIGNED: &str = "unassigned";

/// Why a team config was refused.
#[derive(Debug, thiserror::Error)]
pub enum TeamError {
    #[error("team config TOML: {0}")]
    Toml(#[from] toml::de::Error),
    #[error("team config: {map} entry {key:?} maps to {team:?}, which is empty or reserved")]
    BadTeam { map: &'static str, key: String, team: String },
    #[error("team config: {section} rule {index} has no selector (label, partition, qos or marker)")]
    EmptyRule { section: &'static str, index: usize },
}

fn default_label_keys() -> Vec<String> {
    ["team", "project", "runai/project"].iter().map(|s| (*s).to_owned()).collect()
}

/// Selectors shared by the two rule kinds: every given one must match.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KindRule {
    pub kind: String,
    pub label: Option<String>,
    pub label_value: Option<String>,
    pub partition: Option<String>,
    pub qos: Option<String>,
    pub marker: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InterruptibleRule {
    #[serde(default = "yes")]
    pub interruptible: bool,
    pub label: Option<String>,
    pub label_value: Option<String>,
    pub partition: Option<String>,
    pub qos: Option<String>,
    pub marker: Option<String>,
}

fn yes() -> bool {
    true
}

/// The team / kind / interruptible configuration.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TeamConfig {
    pub label_keys: Vec<String>,
    pub namespaces: BTreeMap<String, String>,
    pub slurm_accounts: BTreeMap<String, String>,
    pub gpus: BTreeMap<String, String>,
    pub hosts: BTreeMap<String, String>,
    pub users: BTreeMap<String, String>,
    pub workload_kind: Vec<KindRule>,
    pub interruptible: Vec<InterruptibleRule>,
}

impl TeamConfig {
    /// No map and no rule: every GPU resolves by its labels alone.
    pub fn is_empty(&self) -> bool {
        self.namespaces.is_empty()
            && self.slurm_accounts.is_empty()
            && self.gpus.is_empty()
            && self.hosts.is_empty()
            && self.users.is_empty()
            && self.workload_kind.is_empty()
            && self.interruptible.is_empty()
    }
}

impl Default for TeamConfig {
    fn default() -> Self {
        TeamConfig {
            label_keys: default_label_keys(),
            namespaces: BTreeMap::new(),
            slurm_accounts: BTreeMap::new(),
            gpus: BTreeMap::new(),
            hosts: BTreeMap::new(),
            users: BTreeMap::new(),
            workload_kind: Vec::new(),
            interruptible: Vec::new(),
        }
    }
}

/// What is known about an allocation (any field may be missing).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AllocationFacts {
    pub labels: BTreeMap<String, String>,
    pub namespace: Option<String>,
    pub slurm_account: Option<String>,
    pub slurm_partition: Option<String>,
    pub slurm_qos: Option<String>,
    pub gpu_uuid: Option<String>,
    pub host: Option<String>,
    pub unix_user: Option<String>,
    /// Markers an agent found (e.g. `checkpointing`).
    pub markers: Vec<String>,
}

/// Which step of the order decided the team.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "via", content = "key", rename_all = "snake_case")]
pub enum TeamSource {
    Label(String),
    Namespace,
    SlurmAccount,
    Gpu,
    Host,
    User,
    Unassigned,
}

/// A resolved team and how.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Resolution {
    pub team: String,
    pub source: TeamSource,
}

fn selector_matches(
    f: &AllocationFacts,
    label: &Option<String>,
    label_value: &Option<String>,
    partition: &Option<String>,
    qos: &Option<String>,
    marker: &Option<String>,
) -> bool {
    let label_ok = match (label, label_value) {
        (None, _) => true,
        (Some(k), None) => f.labels.contains_key(k),
        (Some(k), Some(v)) => f.labels.get(k) == Some(v),
    };
    label_ok
        && partition.as_ref().is_none_or(|p| f.slurm_partition.as_ref() == Some(p))
        && qos.as_ref().is_none_or(|q| f.slurm_qos.as_ref() == Some(q))
        && marker.as_ref().is_none_or(|m| f.markers.contains(m))
}

impl TeamConfig {
    pub fn from_toml(text: &str) -> Result<TeamConfig, TeamError> {
        let c: TeamConfig = toml::from_str(text)?;
        c.validate()?;
        Ok(c)
    }

    /// Map values must be real team names; every rule needs a selector.
    pub fn validate(&self) -> Result<(), TeamError> {
        for (map, m) in [
            ("namespaces", &self.namespaces),
            ("slurm_accounts", &self.slurm_accounts),
            ("gpus", &self.gpus),
            ("hosts", &self.hosts),
            ("users", &self.users),
        ] {
            for (k, v) in m {
                if v.trim().is_empty() || v == UNALLOCATED {
                    return Err(TeamError::BadTeam { map, key: k.clone(), team: v.clone() });
                }
            }
        }
        for (index, r) in self.workload_kind.iter().enumerate() {
            if r.label.is_none() && r.partition.is_none() && r.qos.is_none() && r.marker.is_none() {
                return Err(TeamError::EmptyRule { section: "workload_kind", index });
            }
        }
        for (index, r) in self.interruptible.iter().enumerate() {
            if r.label.is_none() && r.partition.is_none() && r.qos.is_none() && r.marker.is_none() {
                return Err(TeamError::EmptyRule { section: "interruptible", index });
            }
        }
        Ok(())
    }

    /// The team, in the documented order.
    pub fn resolve_team(&self, f: &AllocationFacts) -> Resolution {
        let usable = |v: &String| !v.trim().is_empty() && v != UNALLOCATED;
        for k in &self.label_keys {
            if let Some(v) = f.labels.get(k).filter(|v| usable(v)) {
                return Resolution { team: v.clone(), source: TeamSource::Label(k.clone()) };
            }
        }
        let lookup = |m: &BTreeMap<String, String>, key: &Option<String>| key.as_ref().and_then(|k| m.get(k)).cloned();
        let steps = [
            (lookup(&self.namespaces, &f.namespace), TeamSource::Namespace),
            (lookup(&self.slurm_accounts, &f.slurm_account), TeamSource::SlurmAccount),
            (lookup(&self.gpus, &f.gpu_uuid), TeamSource::Gpu),
            (lookup(&self.hosts, &f.host), TeamSource::Host),
            (lookup(&self.users, &f.unix_user), TeamSource::User),
        ];
        for (team, source) in steps {
            if let Some(team) = team {
                return Resolution { team, source };
            }
        }
        Resolution { team: UNASSIGNED.to_owned(), source: TeamSource::Unassigned }
    }

    /// The first matching `workload_kind` rule's kind.
    pub fn workload_kind(&self, f: &AllocationFacts) -> Option<String> {
        self.workload_kind
            .iter()
            .find(|r| selector_matches(f, &r.label, &r.label_value, &r.partition, &r.qos, &r.marker))
            .map(|r| r.kind.clone())
    }

    /// The first matching `interruptible` rule's value; `false` when none matches.
    pub fn interruptible(&self, f: &AllocationFacts) -> bool {
        self.interruptible
            .iter()
            .find(|r| selector_matches(f, &r.label, &r.label_value, &r.partition, &r.qos, &r.marker))
            .is_some_and(|r| r.interruptible)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CFG: &str = r#"
namespaces = { jupyter = "ml", shared = "platform" }
slurm_accounts = { vision = "vision-team" }
gpus = { "GPU-1" = "research" }
hosts = { "dgx-07" = "infra" }
users = { carol = "carol-team" }

[[workload_kind]]
kind = "notebook"
label = "notebook-name"
[[workload_kind]]
kind = "inference"
label = "app.kubernetes.io/component"
label_value = "inference"
[[workload_kind]]
kind = "batch"
partition = "gpu"
qos = "low"
[[workload_kind]]
kind = "training"
partition = "gpu"

[[interruptible]]
interruptible = false
qos = "critical"
[[interruptible]]
qos = "low"
[[interruptible]]
marker = "checkpointing"
"#;

    fn cfg() -> TeamConfig {
        TeamConfig::from_toml(CFG).expect("config")
    }

    fn facts() -> AllocationFacts {
        AllocationFacts {
            labels: [("team".to_owned(), "label-team".to_owned()), ("project".to_owned(), "runai-proj".to_owned())]
                .into(),
            namespace: Some("jupyter".into()),
            slurm_account: Some("vision".into()),
            gpu_uuid: Some("GPU-1".into()),
            host: Some("dgx-07".into()),
            unix_user: Some("carol".into()),
            ..AllocationFacts::default()
        }
    }

    #[test]
    fn resolution_follows_the_brief_order_step_by_step() {
        let c = cfg();
        let mut f = facts();
        let mut seen = Vec::new();
        // Remove the deciding fact each round and watch the next step take over.
        loop {
            let r = c.resolve_team(&f);
            seen.push((r.team.clone(), r.source.clone()));
            match r.source {
                TeamSource::Label(k) => {
                    f.labels.remove(&k);
                }
                TeamSource::Namespace => f.namespace = None,
                TeamSource::SlurmAccount => f.slurm_account = None,
                TeamSource::Gpu => f.gpu_uuid = None,
                TeamSource::Host => f.host = None,
                TeamSource::User => f.unix_user = None,
                TeamSource::Unassigned => break,
            }
        }
        let teams: Vec<&str> = seen.iter().map(|(t, _)| t.as_str()).collect();
        assert_eq!(
            teams,
            ["label-team", "runai-proj", "ml", "vision-team", "research", "infra", "carol-team", UNASSIGNED]
        );
        assert_eq!(seen[1].1, TeamSource::Label("project".into()));
    }

    #[test]
    fn runai_prefixed_label_empty_and_reserved_values_are_handled() {
        let c = cfg();
        let f = AllocationFacts {
            labels: [("team".into(), " ".into()), ("runai/project".into(), "p1".into())].into(),
            ..AllocationFacts::default()
        };
        assert_eq!(c.resolve_team(&f).team, "p1");
        let f = AllocationFacts {
            labels: [("team".into(), UNALLOCATED.into())].into(),
            namespace: Some("shared".into()),
            ..AllocationFacts::default()
        };
        assert_eq!(c.resolve_team(&f), Resolution { team: "platform".into(), source: TeamSource::Namespace });
        assert!(TeamConfig::from_toml("users = { bob = \"unallocated\" }").is_err());
        assert!(TeamConfig::from_toml("userz = { bob = \"x\" }").is_err());
        assert!(TeamConfig::from_toml("[[workload_kind]]\nkind = \"x\"\n").is_err());
        assert_eq!(TeamConfig::default().label_keys, ["team", "project", "runai/project"]);
    }

    #[test]
    fn workload_kind_and_interruptible_rules() {
        let c = cfg();
        let nb = AllocationFacts { labels: [("notebook-name".into(), "x".into())].into(), ..Default::default() };
        assert_eq!(c.workload_kind(&nb).as_deref(), Some("notebook"));
        let inf = AllocationFacts {
            labels: [("app.kubernetes.io/component".into(), "inference".into())].into(),
            ..Default::default()
        };
        assert_eq!(c.workload_kind(&inf).as_deref(), Some("inference"));
        let other = AllocationFacts {
            labels: [("app.kubernetes.io/component".into(), "web".into())].into(),
            ..Default::default()
        };
        assert_eq!(c.workload_kind(&other), None);
        let low = AllocationFacts {
            slurm_partition: Some("gpu".into()),
            slurm_qos: Some("low".into()),
            ..Default::default()
        };
        assert_eq!(c.workload_kind(&low).as_deref(), Some("batch"));
        assert!(c.interruptible(&low));
        let normal = AllocationFacts { slurm_partition: Some("gpu".into()), ..Default::default() };
        assert_eq!(c.workload_kind(&normal).as_deref(), Some("training"));
        assert!(!c.interruptible(&normal));
        let crit = AllocationFacts {
            slurm_qos: Some("critical".into()),
            markers: vec!["checkpointing".into()],
            ..Default::default()
        };
        assert!(!c.interruptible(&crit), "first matching rule wins");
        let ckpt = AllocationFacts { markers: vec!["checkpointing".into()], ..Default::default() };
        assert!(c.interruptible(&ckpt));
    }
}
