//! `sim`: a seeded, deterministic simulated GPU fleet.
//!
//! The simulator stands in for NVML on machines without GPUs (`apron up` on a laptop,
//! CI, demos) and seeds a fresh install with history. It shows the three kinds of waste
//! Apron exists to find — unallocated idle, stranded allocations, under-used allocations
//! — next to healthy work and a failing GPU, on real model names and realistic figures.
//!
//! # Parts and data flow
//!
//! ```text
//!  SimConfig ──► Fleet (fleet.rs): inventory, one Timeline per GPU (phases from scenario.rs,
//!                │                 figures from model.rs), evaluated at any instant t
//!                ├──► SimSampler (sampler.rs): any FieldGroup at the tick's `now`
//!                ├──► History / ProcessHistory (history.rs): backfill rows straight from the model
//!                └──► SimHost (host.rs): cgroup/status/passwd/Slurm/pod-resources text
//!                          └──► Attributor (the agent's, same parsing as a real host)
//! ```
//!
//! **Every value is a pure function of (seed, GPU, time).** There is no simulation state
//! to step: randomness is a hash of its coordinates (`rng.rs`), phases come from a cycle
//! with a per-job offset, and energy is a closed-form integral of the modelled power. So
//! the live samplers, a backfill of last week, and a test can all evaluate any instant,
//! in any order, and agree. Only the lost-GPU scenario depends on the source's start.
//! Job cycles count from the epoch with a seeded offset per job, or, when
//! [`SimConfig::phase_origin`] is set (`apron up` sets it 10 h before a data
//! directory's first start), from that instant: then every scenario is in a known phase
//! at a known time, whenever the fleet runs.
//!
//! # Scenarios
//!
//! The default fleet (2 nodes × 8 GPUs; models cycle by node: H100 80GB, A100 80GB,
//! A100 40GB, L4) applies [`Scenario::DEFAULT_LAYOUT`]: node 0 = training ×2,
//! small-inference ×2, notebook-stranded, inference-bursty, unallocated-idle,
//! fell-off-the-bus; node 1 = training ×2, multi-gpu-underused ×4, inference-bursty,
//! unallocated-idle. Consecutive `training` GPUs on a node are one pod (up to 8), and
//! consecutive `multi-gpu-underused` GPUs one Slurm job (up to 4).
//!
//! | scenario | allocation | activity (SM) | what Apron should detect |
//! | --- | --- | --- | --- |
//! | `training` | pod `ml-research/train-<model>-<id>`, container `trainer`, Guaranteed QoS; one worker process per GPU | 72 h cycle: 10 min warm-up at 0.3 while memory fills to ~90%, ~70 h at 0.80–0.88 ±6% with a 45 s checkpoint pause (0) every 30 min, then 2 h unallocated before the next run | active; short allocated-idle runs at checkpoints; NVLink traffic within multi-GPU pods; power-capped clocks on hot boards |
//! | `inference-bursty` | long-lived pod `inference/chat-vllm-…`, container `vllm` | one burst at 0.7 in every 10 s, at a random place; busy seconds per block follow the UTC day (1 s at night, 5 s 09–17 h); 50% of memory | active with many idle 1 s windows; idle runs of seconds are allocated-idle, never stranded |
//! | `notebook-stranded` | pod `data-science/jupyter-<user>-<id>`, container `notebook` | 4-day cycle: 45 min of 6 s bursts every 30 s, then ~3.7 days with the kernel alive holding ~30 GB and SM 0, then 6 h unallocated | **stranded** (idle ≥ 30 min while allocated, counted from the idle run's start) |
//! | `notebook-idle-resume` (not in the default layout) | long-lived pod `data-science/jupyter-<user>-<id>`, container `notebook` | 3 h cycle: 1 h of 6 s bursts every 30 s, then 2 h with the kernel holding ~30 GB at SM 0, then work resumes | stranded 30 min into each idle stretch; the alert resolves when work resumes |
//! | `multi-gpu-underused` | Slurm job (user `carol`, account `vision`, partition `gpu`, QoS `normal`), Apron prolog file (jobstats' `"<jobid> <uid>"` for every second such job); one process on all 4 GPUs | 48 h cycle: 40 h with GPU 1 of 4 at ~0.6 and the other 3 holding 612 MiB at 0, then 8 h unallocated | 3 of 4 GPUs stranded: "did not use 3 of 4 allocated GPUs" |
//! | `small-inference` | long-lived pod `search/embedder-…`, container `triton` | steady 0.045 ±30% (SM < 0.06, `gpu_util` < 10%), 4–8 GiB | under-used: a packing / MIG candidate (< 10% SM, < 10 GB) |
//! | `unallocated-idle` | none | no process, 0, P8 clocks, idle power | unallocated idle |
//! | `fell-off-the-bus` | long-lived pod `analytics/feature-etl-…`, container `etl` | steady 0.55; XID 79 in the 20 s before it is lost; lost from `lost_gpu_after` after the source start, and in the 2 h before the start (so a backfill ending at the start shows it) | `lost` rows with NULL fields, XID 79, an alert |
//!
//! Backfill is lost-consistent with live: the GPU is lost in `[start − 2 h, start)`, the
//! agent's start "resets" it, and it falls off again at `start + lost_gpu_after`.
//!
//! # What each field group reads
//!
//! Utilisation ratios at integer-percent resolution; GPM (Hopper only — other models
//! report the group unsupported and produce no readings) at 0.01%; memory in whole MiB
//! (used = 1 MiB driver state + the processes'); power as the mean of the last second at
//! mW resolution and energy (mJ) since the driver loaded, so ΔE = Σ P·Δt; temperature
//! follows the last minute's mean power; clocks with NVML's event reasons (`GpuIdle`
//! 0x1 when no kernel runs, `SwPowerCap` 0x4 above 85% of the limit); PCIe in whole KiB/s;
//! NVLink on SXM boards only; health counters (ECC, remapped rows, PCIe replays) from
//! the driver load, plus `xid_last` = 79 before a GPU falls off the bus; processes as
//! NVML lists them, attributed by the agent's [`Attributor`] from [`SimHost`]'s facts.
//! Driver reloads happen every 90 days per node (staggered), resetting the counters.

mod config;
mod fleet;
mod history;
mod host;
mod model;
mod rng;
mod sampler;
mod scenario;

#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::Duration;

use apron_common::{ClusterName, GpuIdentity, UnixMicros};

pub use config::{MAX_GPUS_PER_NODE, MAX_NODES, SimConfig, SimError};
pub use fleet::Fleet;
pub use history::{History, ProcessHistory};
pub use host::SimHost;
pub use model::SimModel;
pub use sampler::SimSampler;
pub use scenario::{PhaseKind, Scenario};

use crate::attribution::{Attributor, HostView};
use crate::sampler::{FieldGroup, Sampler};
use crate::source::GpuSource;

/// The simulated fleet as a [`GpuSource`].
///
/// Live attribution: build the agent's `Attributor` over [`GpuSource::host_view`]; the
/// processes sampler moves that host's time cursor to each tick before refreshing.
pub struct SimSource {
    fleet: Arc<Fleet>,
    /// The host view handed to the live attributor.
    live_host: SimHost,
}

impl SimSource {
    /// A fleet whose lost-GPU scenario counts from now.
    pub fn new(config: &SimConfig, cluster: Option<ClusterName>) -> Result<Self, SimError> {
        Self::starting_at(config, cluster, UnixMicros::now())
    }

    /// A fleet whose lost-GPU scenario counts from `start` (tests, reproducible runs).
    pub fn starting_at(config: &SimConfig, cluster: Option<ClusterName>, start: UnixMicros) -> Result<Self, SimError> {
        let fleet = Arc::new(Fleet::new(config, cluster, start)?);
        let live_host = SimHost::new(fleet.clone(), start);
        Ok(Self { fleet, live_host })
    }

    pub fn fleet(&self) -> &Arc<Fleet> {
        &self.fleet
    }

    /// A host view with its own time cursor, for an attributor that backfills (so that it
    /// never moves the live attributor's cursor).
    pub fn history_host(&self) -> SimHost {
        SimHost::new(self.fleet.clone(), self.fleet.start())
    }

    /// `gpu_samples` rows of every GPU for every `window`-long, epoch-aligned window
    /// ending in `(start, end]`: `GPUs × windows` rows, time-major. Values equal what the
    /// live samplers read at the same instants, aggregated as the agent does; each row's
    /// owner is what the agent's attributor answers at the processes tick before its end.
    pub fn history(&self, start: UnixMicros, end: UnixMicros, window: Duration) -> History<'_> {
        History::new(&self.fleet, self.history_host(), start, end, window)
    }

    /// `gpu_processes` rows every `every` in `(start, end]` (the live default is 5 s).
    /// `attribution` must have been built over `host` (from [`Self::history_host`]):
    /// each tick moves `host`'s cursor, then asks `attribution`.
    pub fn process_history<'a>(
        &'a self,
        host: &'a SimHost,
        attribution: &'a Attributor,
        start: UnixMicros,
        end: UnixMicros,
        every: Duration,
    ) -> ProcessHistory<'a> {
        ProcessHistory::new(&self.fleet, host, attribution, start, end, every)
    }
}

impl GpuSource for SimSource {
    fn kind(&self) -> &'static str {
        "sim"
    }

    fn inventory(&self) -> &[GpuIdentity] {
        self.fleet.inventory()
    }

    fn driver_version(&self) -> Option<String> {
        Some("sim".to_owned())
    }

    fn host_view(&self) -> Option<Box<dyn HostView>> {
        Some(Box::new(self.live_host.clone()))
    }

    fn sampler(&self, group: FieldGroup, attribution: &Arc<Attributor>) -> Option<Box<dyn Sampler>> {
        let attribution = (group == FieldGroup::Processes).then(|| (self.live_host.clone(), attribution.clone()));
        Some(Box::new(SimSampler::new(self.fleet.clone(), group, attribution)))
    }
}
