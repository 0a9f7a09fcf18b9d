//! `[sim]`: the shape of the simulated fleet.

use std::time::Duration;

use apron_common::{ClusterName, HostName, UnixMicros};
use serde::Deserialize;

use super::model::SimModel;
use super::scenario::Scenario;

/// The largest fleet the simulator builds; beyond it, memory and backfill time grow
/// without teaching anything new.
pub const MAX_NODES: u32 = 4096;
/// NVML enumerates at most 16 GPUs on the boards the simulator models.
pub const MAX_GPUS_PER_NODE: u32 = 16;

/// The `[sim]` config table.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SimConfig {
    /// Number of nodes (hosts), 1–4096.
    pub nodes: u32,
    /// GPUs per node, 1–16.
    pub gpus_per_node: u32,
    /// Seeds UUIDs, workload phases and every noise term.
    pub seed: u64,
    /// Cluster label of every GPU (the agent's own `cluster` wins when set).
    pub cluster: Option<ClusterName>,
    /// Host names are `<host_prefix><node number>`.
    pub host_prefix: String,
    /// GPU model of each node, cycling by node: node `n` gets `models[n % len]`.
    pub models: Vec<SimModel>,
    /// Scenario of each GPU in fleet order (node-major), cycling when shorter than the
    /// fleet; `None` for the built-in layout that covers every scenario on two nodes.
    pub scenarios: Option<Vec<Scenario>>,
    /// When the `fell-off-the-bus` GPUs fall off after the source starts (humantime).
    #[serde(deserialize_with = "apron_common::duration::deserialize")]
    pub lost_gpu_after: Duration,
    /// The instant every job's cycle starts from (plus a seeded jitter under an hour),
    /// instead of a seeded offset from the Unix epoch: whoever sets it knows which phase
    /// each scenario is in at any instant. `apron up` sets it for its data directory
    /// (not a config key).
    #[serde(skip)]
    pub phase_origin: Option<UnixMicros>,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            nodes: 2,
            gpus_per_node: 8,
            seed: 42,
            cluster: None,
            host_prefix: "sim-node-".to_owned(),
            models: SimModel::ALL.to_vec(),
            scenarios: None,
            lost_gpu_after: Duration::from_secs(600),
            phase_origin: None,
        }
    }
}

/// Why a `[sim]` table cannot build a fleet.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SimError {
    #[error("sim.{key} = {value} is out of range (allowed: {allowed})")]
    OutOfRange { key: &'static str, value: String, allowed: &'static str },
    #[error("sim.{key} must list at least one entry")]
    Empty { key: &'static str },
    #[error("sim.host_prefix = {value:?} cannot start a host name: {reason}")]
    HostPrefix { value: String, reason: String },
}

impl SimConfig {
    /// Checks every value; the error names the key and what is allowed.
    pub fn validate(&self) -> Result<(), SimError> {
        if !(1..=MAX_NODES).contains(&self.nodes) {
            return Err(SimError::OutOfRange { key: "nodes", value: self.nodes.to_string(), allowed: "1..=4096" });
        }
        if !(1..=MAX_GPUS_PER_NODE).contains(&self.gpus_per_node) {
            return Err(SimError::OutOfRange {
                key: "gpus_per_node",
                value: self.gpus_per_node.to_string(),
                allowed: "1..=16",
            });
        }
        if self.models.is_empty() {
            return Err(SimError::Empty { key: "models" });
        }
        if self.scenarios.as_ref().is_some_and(Vec::is_empty) {
            return Err(SimError::Empty { key: "scenarios" });
        }
        if let Some(bad) = self.host_prefix.chars().find(|c| !(c.is_ascii_alphanumeric() || *c == '-' || *c == '.')) {
            return Err(SimError::HostPrefix {
                value: self.host_prefix.clone(),
                reason: format!("{bad:?} is not a letter, digit, '-' or '.'"),
            });
        }
        HostName::new(self.host_name(self.nodes - 1))
            .map_err(|e| SimError::HostPrefix { value: self.host_prefix.clone(), reason: e.to_string() })?;
        Ok(())
    }

    pub(crate) fn host_name(&self, node: u32) -> String {
        format!("{}{node}", self.host_prefix)
    }

    /// The scenario of the GPU at fleet position `i` (node-major).
    pub(crate) fn scenario_at(&self, i: usize) -> Scenario {
        let list: &[Scenario] = self.scenarios.as_deref().unwrap_or(&Scenario::DEFAULT_LAYOUT);
        list.get(i % list.len().max(1)).copied().unwrap_or(Scenario::UnallocatedIdle)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_parse_from_an_empty_table() {
        let c: SimConfig = toml::from_str("").expect("empty table");
        assert_eq!(c, SimConfig::default());
        assert_eq!(c.validate(), Ok(()));
    }

    #[test]
    fn full_table_parses() {
        let c: SimConfig = toml::from_str(
            "nodes = 8\ngpus_per_node = 4\nseed = 7\ncluster = \"lab\"\nhost_prefix = \"gpu\"\n\
             models = [\"l4\", \"NVIDIA H100 80GB HBM3\"]\n\
             scenarios = [\"training\", \"notebook-stranded\"]\nlost_gpu_after = \"90s\"\n",
        )
        .expect("valid table");
        assert_eq!(c.models, vec![SimModel::L4, SimModel::H100Sxm80]);
        assert_eq!(c.scenario_at(3), Scenario::NotebookStranded);
        assert_eq!(c.lost_gpu_after, Duration::from_secs(90));
        assert_eq!(c.host_name(7), "gpu7");
        assert_eq!(c.validate(), Ok(()));
    }

    #[test]
    fn refuses_unknown_keys_and_values() {
        assert!(toml::from_str::<SimConfig>("gpus = 3\n").is_err());
        assert!(toml::from_str::<SimConfig>("models = [\"v100\"]\n").is_err());
        assert!(toml::from_str::<SimConfig>("scenarios = [\"mining\"]\n").is_err());
        let e = toml::from_str::<SimConfig>("lost_gpu_after = \"soon\"\n").expect_err("bad duration");
        assert!(e.to_string().contains("invalid duration"), "{e}");
    }

    #[test]
    fn errors_name_the_key_and_range() {
        let zero = SimConfig { nodes: 0, ..SimConfig::default() };
        assert_eq!(
            zero.validate().expect_err("zero nodes").to_string(),
            "sim.nodes = 0 is out of range (allowed: 1..=4096)"
        );
        let wide = SimConfig { gpus_per_node: 17, ..SimConfig::default() };
        assert!(wide.validate().expect_err("17 GPUs").to_string().contains("sim.gpus_per_node"));
        let none = SimConfig { models: vec![], ..SimConfig::default() };
        assert_eq!(none.validate(), Err(SimError::Empty { key: "models" }));
        let empty = SimConfig { scenarios: Some(vec![]), ..SimConfig::default() };
        assert_eq!(empty.validate(), Err(SimError::Empty { key: "scenarios" }));
        let space = SimConfig { host_prefix: "sim node".into(), ..SimConfig::default() };
        assert!(matches!(space.validate(), Err(SimError::HostPrefix { .. })));
    }
}
