//! The workload scenarios: who holds a GPU, what runs on it, and how busy it is over time.
//!
//! A scenario is a *plan*: a cycle of phases (e.g. training: warm up, run for days, end,
//! two hours with nothing, the next run), how each phase is allocated and how its SMs are
//! loaded. [`super::fleet`] turns plans into timelines and evaluates them at any instant.

use serde::{Deserialize, Serialize};

use super::rng::{lane, pick};

pub(crate) const SEC: i64 = 1_000_000;
pub(crate) const MIN: i64 = 60 * SEC;
pub(crate) const HOUR: i64 = 60 * MIN;
pub(crate) const DAY: i64 = 24 * HOUR;

/// A named workload scenario (`sim.scenarios` uses the kebab-case names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scenario {
    Training,
    InferenceBursty,
    NotebookStranded,
    NotebookIdleResume,
    MultiGpuUnderused,
    SmallInference,
    UnallocatedIdle,
    FellOffTheBus,
}

impl Scenario {
    pub const ALL: [Scenario; 8] = [
        Scenario::Training,
        Scenario::InferenceBursty,
        Scenario::NotebookStranded,
        Scenario::NotebookIdleResume,
        Scenario::MultiGpuUnderused,
        Scenario::SmallInference,
        Scenario::UnallocatedIdle,
        Scenario::FellOffTheBus,
    ];

    /// The built-in layout, applied node-major and cycling: with 8 GPUs per node, even
    /// nodes get the first row and odd nodes the second, so two nodes show everything.
    #[rustfmt::skip]
    pub const DEFAULT_LAYOUT: [Scenario; 16] = {
        use Scenario::*;
        [
            // Even nodes.
            Training, Training, SmallInference, SmallInference,
            NotebookStranded, InferenceBursty, UnallocatedIdle, FellOffTheBus,
            // Odd nodes.
            Training, Training, MultiGpuUnderused, MultiGpuUnderused,
            MultiGpuUnderused, MultiGpuUnderused, InferenceBursty, UnallocatedIdle,
        ]
    };

    pub const fn name(self) -> &'static str {
        match self {
            Scenario::Training => "training",
            Scenario::InferenceBursty => "inference-bursty",
            Scenario::NotebookStranded => "notebook-stranded",
            Scenario::NotebookIdleResume => "notebook-idle-resume",
            Scenario::MultiGpuUnderused => "multi-gpu-underused",
            Scenario::SmallInference => "small-inference",
            Scenario::UnallocatedIdle => "unallocated-idle",
            Scenario::FellOffTheBus => "fell-off-the-bus",
        }
    }

    /// Consecutive GPUs of one node with this scenario form one job of at most this many.
    pub(crate) const fn max_group(self) -> usize {
        match self {
            Scenario::Training => 8,
            Scenario::MultiGpuUnderused => 4,
            _ => 1,
        }
    }
}

/// What a GPU is doing in a phase of its scenario.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PhaseKind {
    /// A training job loading data and compiling: low load, memory filling up.
    Warmup,
    /// Steady work (training, batch); short checkpoint pauses inside.
    Run,
    /// Between jobs: nothing allocated, nothing running.
    Gap,
    /// A long-lived service answering traffic.
    Serving,
    /// A notebook in use: short bursts while someone runs cells.
    Active,
    /// Allocated, a process holds memory, no kernels run.
    Stranded,
    /// Never allocated.
    Idle,
}

/// How busy the SMs are inside a phase, before per-sample noise.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Shape {
    Idle,
    /// `level` all the time except a pause of `dip_len` at the end of every `dip_every`
    /// (a checkpoint written while the GPU waits on storage); `dip_every == 0`: no pauses.
    Steady {
        level: f64,
        dip_every: i64,
        dip_len: i64,
    },
    /// One burst of `burst` at `level` in every `block`, at a random place in the block:
    /// gaps between bursts vary from zero to twice `block - burst`, while the busy time
    /// per block stays exact, which keeps the energy integral in closed form.
    Bursty {
        block: i64,
        burst: i64,
        level: f64,
    },
}

impl Shape {
    /// The load at `x` µs into the phase; `offset(b)` is where block `b`'s burst starts.
    #[inline]
    pub(crate) fn level_at(&self, x: i64, offset: impl Fn(i64) -> i64) -> f64 {
        match *self {
            Shape::Idle => 0.0,
            Shape::Steady { level, dip_every, dip_len } => {
                if dip_every > 0 && x.rem_euclid(dip_every) >= dip_every - dip_len { 0.0 } else { level }
            }
            Shape::Bursty { block, burst, level } => {
                let o = offset(x.div_euclid(block));
                let r = x.rem_euclid(block);
                if r >= o && r < o + burst { level } else { 0.0 }
            }
        }
    }

    /// ∫ load over `[0, x)`, in load·µs.
    #[inline]
    pub(crate) fn integral(&self, x: i64, offset: impl Fn(i64) -> i64) -> f64 {
        match *self {
            Shape::Idle => 0.0,
            Shape::Steady { level, dip_every, dip_len } => {
                if dip_every <= 0 {
                    return level * x as f64;
                }
                let busy = dip_every - dip_len;
                let (n, r) = (x.div_euclid(dip_every), x.rem_euclid(dip_every));
                level * (n * busy + r.min(busy)) as f64
            }
            Shape::Bursty { block, burst, level } => {
                let (n, r) = (x.div_euclid(block), x.rem_euclid(block));
                let o = offset(n);
                let partial = (r.min(o + burst) - o).max(0);
                level * (n * burst + partial) as f64
            }
        }
    }
}

/// Memory a phase's processes hold.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Memory {
    None,
    /// A fraction of the board's memory (frameworks that size themselves to the card).
    Fraction(f64),
    /// A fixed amount, MiB (capped at 95% of a smaller card).
    Mib(f64),
}

/// One phase of a plan.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PhasePlan {
    pub kind: PhaseKind,
    pub len: i64,
    pub allocated: bool,
    pub process: bool,
    pub shape: Shape,
    pub memory: Memory,
    /// Memory grows linearly from 10% to full over the phase (model loading).
    pub ramp: bool,
}

/// How a unit of SM load shows up in the other counters.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Mix {
    /// `gpu_util` per unit of SM activity: a kernel that occupies few SMs still counts
    /// the whole sample period as busy, so this is above 1 (saturating at 100%).
    pub util: f64,
    pub occupancy: f64,
    pub tensor: f64,
    pub dram: f64,
    pub fp64: f64,
    pub fp32: f64,
    pub fp16: f64,
    /// Bytes/s at load 1.
    pub pcie_rx: f64,
    pub pcie_tx: f64,
    pub nvlink: f64,
    /// Fraction of (limit − context power) drawn at load 1.
    pub power: f64,
    /// Relative per-sample noise on the load.
    pub noise: f64,
}

/// A scenario's plan for one GPU of its job.
#[derive(Clone, Debug)]
pub(crate) struct Plan {
    pub phases: Vec<PhasePlan>,
    /// One allocation for all time (a Deployment's pod), rather than one per cycle.
    pub persistent: bool,
    /// Phases follow the UTC clock (daily traffic), rather than a random offset.
    pub utc_aligned: bool,
    pub mix: Mix,
}

/// The plan for GPU `rank` of a job of `size` GPUs; `h` varies levels between jobs.
pub(crate) fn plan(scenario: Scenario, rank: usize, size: usize, h: u64) -> Plan {
    let u = |l: u32| (lane(h, l) + 1.0) / 2.0;
    let phase =
        |kind, len, shape, memory| PhasePlan { kind, len, allocated: true, process: true, shape, memory, ramp: false };
    let gap = |len| PhasePlan {
        kind: PhaseKind::Gap,
        len,
        allocated: false,
        process: false,
        shape: Shape::Idle,
        memory: Memory::None,
        ramp: false,
    };
    match scenario {
        Scenario::Training => {
            let level = 0.80 + 0.08 * u(0);
            let memory = Memory::Fraction(0.86 + 0.06 * u(1));
            let warmup = PhasePlan { ramp: true, ..phase(PhaseKind::Warmup, 10 * MIN, steady(0.3), memory) };
            let run = Shape::Steady { level, dip_every: 30 * MIN, dip_len: 45 * SEC };
            Plan {
                phases: vec![warmup, phase(PhaseKind::Run, 70 * HOUR - 10 * MIN, run, memory), gap(2 * HOUR)],
                persistent: false,
                utc_aligned: false,
                mix: Mix {
                    util: 1.18,
                    occupancy: 0.52,
                    tensor: 0.62,
                    dram: 0.48,
                    fp64: 0.0,
                    fp32: 0.16,
                    fp16: 0.06,
                    pcie_rx: 2.5e9,
                    pcie_tx: 0.4e9,
                    // All-reduce traffic only between GPUs of the same job.
                    nvlink: if size > 1 { 140e9 } else { 0.0 },
                    power: 1.0,
                    noise: 0.06,
                },
            }
        }
        Scenario::InferenceBursty => {
            // Daily traffic in UTC: busy seconds per 10 s block by hour of day.
            let hours: [(i64, f64); 5] = [(7, 1.0), (2, 2.5), (8, 5.0), (4, 3.0), (3, 1.5)];
            let memory = Memory::Fraction(0.5);
            let phases = hours
                .iter()
                .map(|&(h, busy_s)| {
                    let burst = (busy_s * SEC as f64) as i64;
                    phase(PhaseKind::Serving, h * HOUR, Shape::Bursty { block: 10 * SEC, burst, level: 0.7 }, memory)
                })
                .collect();
            Plan {
                phases,
                persistent: true,
                utc_aligned: true,
                mix: Mix {
                    util: 1.3,
                    occupancy: 0.35,
                    tensor: 0.45,
                    dram: 0.62,
                    fp64: 0.0,
                    fp32: 0.1,
                    fp16: 0.05,
                    pcie_rx: 0.25e9,
                    pcie_tx: 0.12e9,
                    nvlink: 0.0,
                    power: 0.8,
                    noise: 0.15,
                },
            }
        }
        Scenario::NotebookStranded | Scenario::NotebookIdleResume => {
            // ~30 GB (decimal) held by the kernel: a model loaded, then forgotten.
            let memory = Memory::Mib(28_600.0 + (400.0 * u(0)).round());
            let active = Shape::Bursty { block: 30 * SEC, burst: 6 * SEC, level: 0.45 };
            let resumes = scenario == Scenario::NotebookIdleResume;
            Plan {
                phases: if resumes {
                    // A long-lived notebook server: an hour of work, two hours left
                    // open (stranded after 30 min), then its user comes back.
                    vec![
                        phase(PhaseKind::Active, HOUR, active, memory),
                        phase(PhaseKind::Stranded, 2 * HOUR, Shape::Idle, memory),
                    ]
                } else {
                    vec![
                        phase(PhaseKind::Active, 45 * MIN, active, memory),
                        phase(PhaseKind::Stranded, 4 * DAY - 45 * MIN - 6 * HOUR, Shape::Idle, memory),
                        gap(6 * HOUR),
                    ]
                },
                persistent: resumes,
                utc_aligned: false,
                mix: Mix {
                    util: 1.4,
                    occupancy: 0.3,
                    tensor: 0.3,
                    dram: 0.35,
                    fp64: 0.0,
                    fp32: 0.25,
                    fp16: 0.05,
                    pcie_rx: 0.5e9,
                    pcie_tx: 0.05e9,
                    nvlink: 0.0,
                    power: 0.7,
                    noise: 0.2,
                },
            }
        }
        Scenario::MultiGpuUnderused => {
            // One process opens a context on every allocated GPU but computes on the first.
            let (shape, memory) = if rank == 0 {
                (steady(0.58 + 0.08 * u(0)), Memory::Fraction(0.55))
            } else {
                (Shape::Idle, Memory::Mib(612.0))
            };
            Plan {
                phases: vec![phase(PhaseKind::Run, 40 * HOUR, shape, memory), gap(8 * HOUR)],
                persistent: false,
                utc_aligned: false,
                mix: Mix {
                    util: 1.3,
                    occupancy: 0.4,
                    tensor: 0.5,
                    dram: 0.45,
                    fp64: 0.0,
                    fp32: 0.2,
                    fp16: 0.05,
                    pcie_rx: 1.2e9,
                    pcie_tx: 0.1e9,
                    nvlink: 0.0,
                    power: 0.9,
                    noise: 0.1,
                },
            }
        }
        Scenario::SmallInference => {
            // Under 10% SM even at the top of its noise, under 10 GB: a packing candidate.
            let memory = Memory::Mib(4096.0 + (4096.0 * u(0)).round());
            Plan {
                phases: vec![phase(PhaseKind::Serving, DAY, steady(0.045), memory)],
                persistent: true,
                utc_aligned: false,
                mix: Mix {
                    util: 1.6,
                    occupancy: 0.25,
                    tensor: 0.3,
                    dram: 0.4,
                    fp64: 0.0,
                    fp32: 0.2,
                    fp16: 0.05,
                    pcie_rx: 30e6,
                    pcie_tx: 10e6,
                    nvlink: 0.0,
                    power: 0.9,
                    noise: 0.3,
                },
            }
        }
        Scenario::UnallocatedIdle => Plan {
            phases: vec![PhasePlan { kind: PhaseKind::Idle, ..gap(DAY) }],
            persistent: false,
            utc_aligned: false,
            mix: Mix::default(),
        },
        Scenario::FellOffTheBus => Plan {
            phases: vec![phase(PhaseKind::Run, DAY, steady(0.55), Memory::Fraction(0.4))],
            persistent: true,
            utc_aligned: false,
            mix: Mix {
                util: 1.4,
                occupancy: 0.35,
                tensor: 0.1,
                dram: 0.6,
                fp64: 0.0,
                fp32: 0.45,
                fp16: 0.0,
                pcie_rx: 3e9,
                pcie_tx: 1e9,
                nvlink: 0.0,
                power: 0.75,
                noise: 0.15,
            },
        },
    }
}

fn steady(level: f64) -> Shape {
    Shape::Steady { level, dip_every: 0, dip_len: 0 }
}

/// Kubernetes QoS class, which decides the cgroup path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Qos {
    Guaranteed,
    Burstable,
}

/// Who holds a scenario's GPUs.
#[derive(Clone, Debug)]
pub(crate) enum Owner {
    None,
    Pod {
        namespace: &'static str,
        /// Pod name without the per-incarnation suffix.
        stem: String,
        container: &'static str,
        qos: Qos,
        /// The uid the container's process runs as.
        uid: u32,
        /// Notebook pods are named after a user chosen per session.
        notebook: bool,
    },
    Slurm {
        user: &'static str,
        uid: u32,
        account: &'static str,
        partition: &'static str,
        qos: &'static str,
        /// Princeton jobstats' `"<jobid> <uid>"` file instead of Apron's prolog file.
        jobstats: bool,
    },
}

/// Host users (`/etc/passwd` of the simulated nodes). Container users (uid 1000 in
/// Jupyter and Triton images) are deliberately absent, as on a real host.
pub(crate) const PASSWD: &[(u32, &str)] =
    &[(0, "root"), (1001, "alice"), (1002, "bob"), (1003, "carol"), (1004, "dmitri"), (1005, "ines")];

pub(crate) const NOTEBOOK_USERS: &[&str] = &["alice", "bob", "chen", "dana", "erik", "fatima"];

const SLURM_USERS: &[(&str, u32, &str)] =
    &[("carol", 1003, "vision"), ("dmitri", 1004, "nlp"), ("ines", 1005, "speech")];

/// The owner of a scenario's job; `ordinal` counts jobs of the same scenario in the fleet.
pub(crate) fn owner(scenario: Scenario, ordinal: usize, h: u64) -> Owner {
    let pod = |namespace, stem: String, container, qos, uid| Owner::Pod {
        namespace,
        stem,
        container,
        qos,
        uid,
        notebook: false,
    };
    let rs = || super::rng::k8s_suffix(h ^ 0x5eed, 10);
    match scenario {
        Scenario::Training => {
            let model = pick(h, &["llama-8b", "vit-huge", "bert-large", "sdxl", "whisper-l"]).unwrap_or("llm");
            pod("ml-research", format!("train-{model}"), "trainer", Qos::Guaranteed, 0)
        }
        Scenario::InferenceBursty => pod("inference", format!("chat-vllm-{}", rs()), "vllm", Qos::Burstable, 0),
        Scenario::NotebookStranded | Scenario::NotebookIdleResume => Owner::Pod {
            namespace: "data-science",
            stem: "jupyter".to_owned(),
            container: "notebook",
            qos: Qos::Burstable,
            uid: 1000,
            notebook: true,
        },
        Scenario::SmallInference => pod("search", format!("embedder-{}", rs()), "triton", Qos::Burstable, 1000),
        Scenario::FellOffTheBus => pod("analytics", format!("feature-etl-{}", rs()), "etl", Qos::Burstable, 0),
        Scenario::MultiGpuUnderused => {
            let (user, uid, account) = SLURM_USERS[ordinal % SLURM_USERS.len()];
            Owner::Slurm { user, uid, account, partition: "gpu", qos: "normal", jobstats: ordinal % 2 == 1 }
        }
        Scenario::UnallocatedIdle => Owner::None,
    }
}

/// The process NVML lists for a scenario (full path where the process runs on the host,
/// as NVML reports it) and its `comm` (the `Name:` of `/proc/<pid>/status`).
pub(crate) fn process_name(scenario: Scenario) -> (&'static str, &'static str) {
    match scenario {
        Scenario::Training | Scenario::InferenceBursty | Scenario::FellOffTheBus => ("python3", "python3"),
        Scenario::NotebookStranded | Scenario::NotebookIdleResume => ("/opt/conda/bin/python", "python"),
        Scenario::MultiGpuUnderused => ("/opt/miniconda3/envs/torch/bin/python", "python"),
        Scenario::SmallInference => ("/opt/tritonserver/bin/tritonserver", "tritonserver"),
        Scenario::UnallocatedIdle => ("", ""),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integral_matches_sum_of_levels() {
        let offset = |b: i64| (b * 37 % 7) * SEC;
        let shapes = [
            Shape::Idle,
            Shape::Steady { level: 0.8, dip_every: 30 * SEC, dip_len: 4 * SEC },
            steady(0.3),
            Shape::Bursty { block: 10 * SEC, burst: 3 * SEC, level: 0.7 },
        ];
        let step = 100_000;
        for shape in shapes {
            let mut sum = 0.0;
            for i in 0..1234 {
                let x = i * step;
                assert!((shape.integral(x, offset) - sum).abs() < 1e-6, "{shape:?} at {x}");
                sum += shape.level_at(x, offset) * step as f64;
            }
        }
    }

    #[test]
    fn plans_tile_their_cycles() {
        for s in Scenario::ALL {
            for rank in 0..2 {
                let p = plan(s, rank, 2, 99);
                let total: i64 = p.phases.iter().map(|ph| ph.len).sum();
                assert!(total > 0 && total % SEC == 0, "{s:?}");
                for ph in &p.phases {
                    if let Shape::Bursty { block, burst, .. } = ph.shape {
                        // Whole blocks per phase keep each phase's energy a constant.
                        assert_eq!(ph.len % block, 0, "{s:?}");
                        assert!(burst <= block);
                    }
                }
                if p.utc_aligned {
                    assert_eq!(total % DAY, 0);
                }
            }
        }
    }
}
