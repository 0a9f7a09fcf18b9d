//! The fleet model: inventory, one timeline per GPU, and their evaluation at any instant.
//!
//! Every value is a pure function of (seed, GPU, time): the phase comes from the GPU's
//! cycle, the SM load from the phase's shape, noise from a hash of the 100 ms bucket.
//! Power and energy come from one integral: the *structural* power (phase base power plus
//! load × span, without per-sample noise) integrated in closed form, so energy at any
//! instant costs a few operations, and a power reading — the mean over the last second,
//! as NVML's is — is exactly ΔE/Δt of the counter. Temperature follows the mean power of
//! the last minute, which gives it thermal inertia for free.

use std::collections::HashMap;

use apron_common::{ClusterName, Field, GpuIdentity, GpuUuid, HostName, UnixMicros};

use super::config::{SimConfig, SimError};
use super::model::{Spec, pci_bus_id};
use super::rng::{hash2, hash3, lane, mix};
use super::scenario::{self, DAY, HOUR, Memory, Mix, Owner, PhaseKind, Plan, SEC, Scenario, Shape};
use crate::sampler::FieldGroup;

const MIB: f64 = 1_048_576.0;
/// Utilisation and GPM noise changes every 100 ms, NVML's finest utilisation period.
const BUCKET: i64 = 100_000;
/// Driver reloads (node reboots) every 90 days, staggered per node: energy and error
/// counters count from there, as NVML's do.
const UPTIME: i64 = 90 * DAY;
/// How long before falling off the bus the GPU logs XID 79.
const XID_LEAD: i64 = 20 * SEC;
/// In backfill, the `fell-off-the-bus` GPUs are lost for this long before the source
/// start; the agent's start (a GPU reset) brings them back until `lost_gpu_after`.
pub(crate) const LOST_BEFORE_START: i64 = 2 * HOUR;
/// PIDs stay below Linux's default `pid_max` on 64-bit hosts.
const PID_MAX: u32 = 4_194_304;
const PID_BASE: u32 = 1000;

/// NVML clocks event reasons.
pub(crate) const CLOCKS_GPU_IDLE: f64 = 1.0;
pub(crate) const CLOCKS_SW_POWER_CAP: f64 = 4.0;
/// XID 79: GPU has fallen off the bus.
pub(crate) const XID_FELL_OFF_THE_BUS: f64 = 79.0;

// Salts keep the hash streams of different purposes apart.
const SALT_UUID: u64 = 0x55_55_49_44;
const SALT_GPU: u64 = 0x47_50_55;
const SALT_GROUP: u64 = 0x47_52_50;
const SALT_BOOT: u64 = 0x42_4f_4f_54;
const SALT_NOISE: u64 = 0x4e_4f_49_53;
const SALT_BURST: u64 = 0x42_55_52_53;
const SALT_POWER: u64 = 0x50_57_52;

/// One phase of a GPU's cycle, resolved against its model.
#[derive(Debug)]
pub(crate) struct Phase {
    pub kind: PhaseKind,
    /// Start within the cycle, µs.
    start: i64,
    len: i64,
    /// Which allocation of the cycle holds the GPU (consecutive allocated phases share one).
    pub alloc: Option<u32>,
    /// Start of that allocation within the cycle.
    alloc_start: i64,
    pub process: bool,
    shape: Shape,
    mem_mib: f64,
    ramp: bool,
    base_w: f64,
    span_w: f64,
    /// Structural energy from the cycle start to this phase's start, J.
    before_j: f64,
}

#[derive(Debug)]
pub(crate) struct Timeline {
    cycle: i64,
    offset: i64,
    pub persistent: bool,
    phases: Vec<Phase>,
    cycle_j: f64,
}

/// A position on a timeline.
#[derive(Clone, Copy)]
pub(crate) struct At<'a> {
    /// Cycle number.
    pub k: i64,
    idx: usize,
    pub phase: &'a Phase,
    /// µs into the phase.
    x: i64,
}

impl Timeline {
    #[inline]
    pub(crate) fn at(&self, t: i64) -> At<'_> {
        let u = t.saturating_add(self.offset);
        let (k, pos) = (u.div_euclid(self.cycle), u.rem_euclid(self.cycle));
        // Phases are few (≤ 5) and start at 0, so the search always lands on one.
        let idx = self.phases.partition_point(|p| p.start <= pos).saturating_sub(1);
        let phase = &self.phases[idx];
        At { k, idx, phase, x: pos - phase.start }
    }

    /// Absolute start of allocation `at` belongs to.
    pub(crate) fn alloc_start(&self, at: &At<'_>) -> i64 {
        at.k * self.cycle - self.offset + at.phase.alloc_start
    }
}

/// How the `fell-off-the-bus` GPU is lost: `[before.0, before.1)` and from `after` on.
#[derive(Clone, Copy, Debug)]
struct Lost {
    before: (i64, i64),
    after: i64,
}

#[derive(Clone, Copy, Debug)]
struct Health {
    sbe_base: f64,
    /// One more corrected ECC error every this long since boot; 0: none.
    sbe_every: i64,
    remapped: f64,
    replay_every: i64,
}

/// One simulated GPU.
#[derive(Debug)]
pub(crate) struct Gpu {
    pub spec: &'static Spec,
    pub scenario: Scenario,
    pub group: usize,
    seed: u64,
    pub timeline: Timeline,
    mix: Mix,
    boot_offset: i64,
    ambient_c: f64,
    lost: Option<Lost>,
    health: Health,
}

/// GPUs that one job holds together (one pod, one Slurm job), or a single GPU.
#[derive(Debug)]
pub(crate) struct Group {
    pub scenario: Scenario,
    pub slots: Vec<usize>,
    pub seed: u64,
    pub owner: Owner,
}

/// One allocation of a group: a pod's life or a Slurm job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Incarnation {
    /// Seeds the names and IDs of this allocation.
    pub key: u64,
    /// When it started; `None` for a persistent allocation.
    pub start: Option<i64>,
}

/// A process as NVML lists it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct SimProcess {
    pub pid: u32,
    pub name: &'static str,
    pub fb_used_bytes: i64,
    pub sm_util: f64,
}

/// The simulated fleet.
#[derive(Debug)]
pub struct Fleet {
    start: i64,
    inventory: Vec<GpuIdentity>,
    by_uuid: HashMap<GpuUuid, usize>,
    pub(crate) gpus: Vec<Gpu>,
    pub(crate) groups: Vec<Group>,
    pid_span: u32,
}

impl Fleet {
    /// Builds the fleet of `config`; `cluster` (the agent's own setting) wins over
    /// `config.cluster`. `start` anchors the lost-GPU scenario only (job cycles count
    /// from `config.phase_origin`, or the epoch).
    pub fn new(config: &SimConfig, cluster: Option<ClusterName>, start: UnixMicros) -> Result<Self, SimError> {
        config.validate()?;
        let cluster = cluster.or_else(|| config.cluster.clone());
        let seed = config.seed;
        let per_node = config.gpus_per_node as usize;
        let total = config.nodes as usize * per_node;

        let mut inventory = Vec::with_capacity(total);
        let mut boot_offsets = Vec::with_capacity(config.nodes as usize);
        let mut specs = Vec::with_capacity(total);
        for node in 0..config.nodes {
            let host = HostName::new(config.host_name(node))
                .map_err(|e| SimError::HostPrefix { value: config.host_prefix.clone(), reason: e.to_string() })?;
            let model = config.models[node as usize % config.models.len()];
            boot_offsets.push((hash2(seed, SALT_BOOT, u64::from(node)) % (UPTIME / SEC) as u64) as i64 * SEC);
            for index in 0..config.gpus_per_node {
                let h = hash2(seed, SALT_UUID, (u64::from(node) << 8) | u64::from(index));
                let uuid = gpu_uuid(h);
                inventory.push(GpuIdentity {
                    cluster: cluster.clone(),
                    host: host.clone(),
                    gpu_uuid: GpuUuid::new(uuid).map_err(|e| SimError::HostPrefix {
                        value: config.host_prefix.clone(),
                        reason: e.to_string(),
                    })?,
                    gpu_index: index,
                    gpu_model: model.name().to_owned(),
                    pci_bus_id: pci_bus_id(index),
                    minor_number: Some(index),
                    parent_gpu_uuid: None,
                    mig_profile: None,
                    mig_gpu_instance_id: None,
                });
                specs.push(model.spec());
            }
        }

        // Consecutive GPUs of a node with a multi-GPU scenario form one job.
        let mut groups: Vec<Group> = Vec::new();
        let mut ordinals = [0usize; Scenario::ALL.len()];
        for slot in 0..total {
            let scenario = config.scenario_at(slot);
            let same_node_as_last = slot % per_node != 0;
            if let Some(g) = groups.last_mut()
                && same_node_as_last
                && g.scenario == scenario
                && g.slots.len() < scenario.max_group()
            {
                g.slots.push(slot);
                continue;
            }
            let gseed = hash2(seed, SALT_GROUP, slot as u64);
            let ordinal = &mut ordinals[scenario as usize];
            groups.push(Group {
                scenario,
                slots: vec![slot],
                seed: gseed,
                owner: scenario::owner(scenario, *ordinal, gseed),
            });
            *ordinal += 1;
        }

        let mut gpus = Vec::with_capacity(total);
        for (gi, group) in groups.iter().enumerate() {
            for (rank, &slot) in group.slots.iter().enumerate() {
                let spec = specs[slot];
                let plan = scenario::plan(group.scenario, rank, group.slots.len(), group.seed);
                let gpu_seed = hash2(seed, SALT_GPU, slot as u64);
                let h = mix(gpu_seed);
                let lost = (group.scenario == Scenario::FellOffTheBus).then(|| {
                    let after = i64::try_from(config.lost_gpu_after.as_micros()).unwrap_or(i64::MAX);
                    Lost { before: (start.0 - LOST_BEFORE_START, start.0), after: start.0.saturating_add(after) }
                });
                gpus.push(Gpu {
                    spec,
                    scenario: group.scenario,
                    group: gi,
                    seed: gpu_seed,
                    timeline: timeline(&plan, spec, group.seed, mix(h), config.phase_origin),
                    mix: plan.mix,
                    boot_offset: boot_offsets[slot / per_node],
                    ambient_c: 3.0 * lane(h, 0),
                    lost,
                    health: Health {
                        sbe_base: if h.is_multiple_of(5) { ((h >> 8) % 4) as f64 } else { 0.0 },
                        sbe_every: if (h >> 16).is_multiple_of(8) { 6 * HOUR } else { 0 },
                        remapped: if (h >> 24).is_multiple_of(6) { 1.0 } else { 0.0 },
                        replay_every: if (h >> 32).is_multiple_of(6) { 3 * HOUR } else { 0 },
                    },
                });
            }
        }
        let pid_span = ((PID_MAX - PID_BASE) / total.max(1) as u32).max(1);
        let by_uuid = inventory.iter().enumerate().map(|(slot, g)| (g.gpu_uuid.clone(), slot)).collect();
        Ok(Self { start: start.0, inventory, by_uuid, gpus, groups, pid_span })
    }

    pub fn inventory(&self) -> &[GpuIdentity] {
        &self.inventory
    }

    /// The instant the lost-GPU scenario counts from.
    pub fn start(&self) -> UnixMicros {
        UnixMicros(self.start)
    }

    /// The slot of the GPU with `uuid`.
    pub fn slot_of(&self, uuid: &GpuUuid) -> Option<usize> {
        self.by_uuid.get(uuid).copied()
    }

    pub fn scenario(&self, slot: usize) -> Option<Scenario> {
        self.gpus.get(slot).map(|g| g.scenario)
    }

    /// What GPU `slot` is doing at `t`.
    pub fn phase(&self, slot: usize, t: UnixMicros) -> Option<PhaseKind> {
        self.gpus.get(slot).map(|g| g.timeline.at(t.0).phase.kind)
    }

    /// Whether GPU `slot` answers GPU_IS_LOST at `t`.
    pub fn is_lost(&self, slot: usize, t: UnixMicros) -> bool {
        self.gpus.get(slot).is_some_and(|g| g.is_lost(t.0))
    }

    /// The NVML call that fails with NOT_SUPPORTED for `group` on `slot`, and why.
    pub(crate) fn unsupported(&self, slot: usize, group: FieldGroup) -> Option<(&'static str, String)> {
        let spec = self.gpus.get(slot)?.spec;
        match group {
            FieldGroup::Gpm if !spec.gpm => {
                Some(("nvmlGpmQueryDeviceSupport", format!("{} has no GPM (Hopper and newer only)", spec.name)))
            }
            FieldGroup::Nvlink if spec.nvlink_bytes_per_s.is_none() => {
                Some(("nvmlDeviceGetNvLinkState", format!("{} has no NVLink", spec.name)))
            }
            FieldGroup::Thermal if spec.hbm_offset_c.is_none() => Some((
                "nvmlDeviceGetFieldValues(MEMORY_TEMP)",
                format!("{} has no memory temperature sensor", spec.name),
            )),
            _ => None,
        }
    }

    /// Reads `group` of GPU `slot` at `t`, calling `emit` with each value in base units at
    /// device resolution. Returns false when the GPU is lost at `t` (nothing emitted).
    #[inline]
    pub(crate) fn sample(&self, slot: usize, group: FieldGroup, t: i64, emit: &mut impl FnMut(Field, f64)) -> bool {
        let Some(g) = self.gpus.get(slot) else { return true };
        if g.is_lost(t) {
            return false;
        }
        let (spec, m) = (g.spec, &g.mix);
        match group {
            FieldGroup::Utilization => {
                let (_, load, h) = g.load(t);
                emit(Field::GpuUtil, pct(load * m.util));
                emit(Field::MemCopyUtil, pct(load * m.dram * 0.9 * (1.0 + 0.05 * lane(h, 1))));
                emit(Field::EncUtil, 0.0);
                emit(Field::DecUtil, 0.0);
            }
            FieldGroup::Gpm if spec.gpm => {
                let (_, load, h) = g.load(t);
                let jit = |l: u32| 1.0 + 0.05 * lane(h, l);
                emit(Field::GrEngineActive, ratio(load * m.util * 0.97));
                emit(Field::SmActive, ratio(load));
                emit(Field::SmOccupancy, ratio(load * m.occupancy * jit(1)));
                emit(Field::TensorActive, ratio(load * m.tensor * jit(2)));
                emit(Field::DramActive, ratio(load * m.dram * jit(3)));
                emit(Field::Fp64Active, ratio(load * m.fp64));
                emit(Field::Fp32Active, ratio(load * m.fp32 * jit(2)));
                emit(Field::Fp16Active, ratio(load * m.fp16 * jit(3)));
            }
            FieldGroup::Memory => {
                let used = g.mem_used_mib(t);
                emit(Field::FbUsedBytes, used * MIB);
                emit(Field::FbFreeBytes, (spec.memory_mib - spec.reserved_mib - used) * MIB);
                emit(Field::FbReservedBytes, spec.reserved_mib * MIB);
                emit(Field::FbTotalBytes, spec.memory_mib * MIB);
            }
            FieldGroup::Power => {
                emit(Field::PowerWatts, g.power_w(t));
                emit(Field::EnergyJoules, (g.energy_j(t) * 1000.0).floor() / 1000.0);
            }
            FieldGroup::Thermal => {
                let frac =
                    ((g.joules(t - 60 * SEC, t) / 60.0 - spec.idle_w) / (spec.limit_w - spec.idle_w)).clamp(0.0, 1.2);
                let die = spec.temp_idle_c + g.ambient_c + spec.temp_rise_c * frac;
                emit(Field::GpuTempC, die.round());
                if let Some(offset) = spec.hbm_offset_c {
                    emit(Field::MemTempC, (die + offset + 3.0 * frac).round());
                }
            }
            FieldGroup::Clocks => {
                let (at, load, _) = g.load(t);
                let busy = load > 0.0;
                let capped = busy && g.joules(t - SEC, t) >= 0.85 * spec.limit_w;
                let held = busy || at.phase.process;
                let sm = match (held, capped) {
                    (false, _) => spec.sm_idle_mhz,
                    (true, true) => spec.sm_capped_mhz,
                    (true, false) => spec.sm_max_mhz,
                };
                emit(Field::SmClockMhz, sm);
                emit(Field::MemClockMhz, if held { spec.mem_max_mhz } else { spec.mem_idle_mhz });
                let reasons = if !busy {
                    CLOCKS_GPU_IDLE
                } else if capped {
                    CLOCKS_SW_POWER_CAP
                } else {
                    0.0
                };
                emit(Field::ClocksEventReasons, reasons);
            }
            FieldGroup::Pcie => {
                let (at, load, h) = g.load(t);
                let trickle = if at.phase.process { 2e6 } else { 20e3 };
                let kib = |v: f64| (v.min(spec.pcie_bytes_per_s) / 1024.0).round() * 1024.0;
                emit(Field::PcieTxBytesPerS, kib((load * m.pcie_tx + trickle / 4.0) * (1.0 + 0.1 * lane(h, 2))));
                emit(Field::PcieRxBytesPerS, kib((load * m.pcie_rx + trickle) * (1.0 + 0.1 * lane(h, 3))));
            }
            FieldGroup::Nvlink => {
                if let Some(max) = spec.nvlink_bytes_per_s {
                    let (_, load, h) = g.load(t);
                    let bw = |l: u32| (load * m.nvlink * (1.0 + 0.05 * lane(h, l))).clamp(0.0, max).round();
                    emit(Field::NvlinkTxBytesPerS, bw(1));
                    emit(Field::NvlinkRxBytesPerS, bw(2));
                }
            }
            FieldGroup::Health => {
                let up = t - g.boot(t);
                let every = |e: i64| if e > 0 { up.div_euclid(e) as f64 } else { 0.0 };
                emit(Field::EccSbeTotal, g.health.sbe_base + every(g.health.sbe_every));
                emit(Field::EccDbeTotal, 0.0);
                emit(Field::RemappedRowsCorrectable, g.health.remapped);
                emit(Field::RemappedRowsUncorrectable, 0.0);
                emit(Field::RowRemapPending, 0.0);
                emit(Field::RowRemapFailure, 0.0);
                emit(Field::PcieReplays, every(g.health.replay_every));
                if g.xid_pending(t) {
                    emit(Field::XidLast, XID_FELL_OFF_THE_BUS);
                }
            }
            FieldGroup::Gpm | FieldGroup::Processes => {}
        }
        true
    }

    /// The allocation holding `group` at `t`, if any.
    pub(crate) fn incarnation(&self, group: usize, t: i64) -> Option<Incarnation> {
        let grp = self.groups.get(group)?;
        let primary = self.gpus.get(*grp.slots.first()?)?;
        let tl = &primary.timeline;
        let at = tl.at(t);
        let alloc = at.phase.alloc?;
        Some(if tl.persistent {
            Incarnation { key: hash2(grp.seed, 0, u64::from(alloc)), start: None }
        } else {
            Incarnation { key: hash2(grp.seed, at.k as u64, u64::from(alloc)), start: Some(tl.alloc_start(&at)) }
        })
    }

    /// The PID of the process on `slot` during `inc`. One process spans all GPUs of a
    /// `multi-gpu-underused` job; a training job runs one worker per GPU.
    pub(crate) fn pid(&self, slot: usize, inc: &Incarnation) -> u32 {
        let owner_slot = match self.gpus.get(slot) {
            Some(g) if g.scenario == Scenario::MultiGpuUnderused => {
                self.groups.get(g.group).and_then(|grp| grp.slots.first().copied()).unwrap_or(slot)
            }
            _ => slot,
        };
        // Each slot owns a disjoint PID range, so PIDs never collide across GPUs.
        PID_BASE
            + owner_slot as u32 * self.pid_span
            + (mix(inc.key ^ owner_slot as u64) % u64::from(self.pid_span)) as u32
    }

    /// The GPU (and its job's allocation) whose process has `pid` at `t`.
    pub(crate) fn find_pid(&self, pid: u32, t: i64) -> Option<(usize, Incarnation)> {
        let slot = (pid.checked_sub(PID_BASE)? / self.pid_span) as usize;
        let g = self.gpus.get(slot)?;
        let inc = self.incarnation(g.group, t)?;
        (g.timeline.at(t).phase.process && self.pid(slot, &inc) == pid).then_some((slot, inc))
    }

    /// NVML's process list of `slot` at `t` into `out`; false when the GPU is lost.
    pub(crate) fn processes(&self, slot: usize, t: i64, out: &mut Vec<SimProcess>) -> bool {
        let Some(g) = self.gpus.get(slot) else { return true };
        if g.is_lost(t) {
            return false;
        }
        let (at, load, _) = g.load(t);
        if !at.phase.process {
            return true;
        }
        let Some(inc) = self.incarnation(g.group, t) else { return true };
        out.push(SimProcess {
            pid: self.pid(slot, &inc),
            name: scenario::process_name(g.scenario).0,
            // The driver's own footprint (1 MiB) is not the process's.
            fb_used_bytes: ((g.mem_used_mib(t) - 1.0).max(0.0) * MIB) as i64,
            sm_util: pct(load * g.mix.util),
        });
        true
    }
}

impl Gpu {
    fn is_lost(&self, t: i64) -> bool {
        self.lost.is_some_and(|l| (t >= l.before.0 && t < l.before.1) || t >= l.after)
    }

    fn xid_pending(&self, t: i64) -> bool {
        self.lost.is_some_and(|l| {
            (t >= l.before.0 - XID_LEAD && t < l.before.0) || (t >= l.after.saturating_sub(XID_LEAD) && t < l.after)
        })
    }

    #[inline]
    fn burst_offset(&self, at: &At<'_>, block_no: i64) -> i64 {
        match at.phase.shape {
            Shape::Bursty { block, burst, .. } => {
                let slots = ((block - burst) / BUCKET + 1).max(1) as u64;
                let h = hash3(self.seed ^ SALT_BURST, at.k as u64, at.idx as u64, block_no as u64);
                (h % slots) as i64 * BUCKET
            }
            _ => 0,
        }
    }

    /// Position, SM load with noise (0–1) and the noise hash of the 100 ms bucket at `t`.
    #[inline]
    pub(crate) fn load(&self, t: i64) -> (At<'_>, f64, u64) {
        let at = self.timeline.at(t);
        let level = at.phase.shape.level_at(at.x, |b| self.burst_offset(&at, b));
        let h = hash2(self.seed, SALT_NOISE, t.div_euclid(BUCKET) as u64);
        let load = if level > 0.0 { (level * (1.0 + self.mix.noise * lane(h, 0))).clamp(0.0, 1.0) } else { 0.0 };
        (at, load, h)
    }

    /// Cycle number and structural energy since that cycle's start at `t`.
    #[inline]
    fn cumulative(&self, t: i64) -> (i64, f64) {
        let at = self.timeline.at(t);
        let p = at.phase;
        let load_us = p.shape.integral(at.x, |b| self.burst_offset(&at, b));
        (at.k, p.before_j + (p.base_w * at.x as f64 + p.span_w * load_us) / 1e6)
    }

    /// Structural energy over `[a, b)`, J.
    #[inline]
    fn joules(&self, a: i64, b: i64) -> f64 {
        let ((ka, ja), (kb, jb)) = (self.cumulative(a), self.cumulative(b));
        (kb - ka) as f64 * self.timeline.cycle_j + jb - ja
    }

    fn boot(&self, t: i64) -> i64 {
        (t - self.boot_offset).div_euclid(UPTIME) * UPTIME + self.boot_offset
    }

    /// NVML's total energy counter: joules since the driver loaded.
    fn energy_j(&self, t: i64) -> f64 {
        self.joules(self.boot(t), t)
    }

    /// Mean power over the last second (NVML's power reading), with ±0.2% sensor noise,
    /// at milliwatt resolution.
    fn power_w(&self, t: i64) -> f64 {
        let noise = 0.002 * lane(hash2(self.seed, SALT_POWER, t.div_euclid(SEC) as u64), 0);
        (self.joules(t - SEC, t) * (1.0 + noise) * 1000.0).round() / 1000.0
    }

    /// Framebuffer in use, whole MiB: 1 MiB of driver state plus the processes' memory.
    fn mem_used_mib(&self, t: i64) -> f64 {
        let at = self.timeline.at(t);
        let p = at.phase;
        if !p.process {
            return 1.0;
        }
        let fill = if p.ramp && p.len > 0 { 0.1 + 0.9 * at.x as f64 / p.len as f64 } else { 1.0 };
        1.0 + (p.mem_mib * fill).round()
    }
}

/// Resolves a plan against a model into a timeline with precomputed phase energies.
/// `board` varies power a few percent between boards of the same model, as silicon does.
/// `origin`: the instant the cycle starts (give or take a seeded jitter under an hour);
/// `None`: a seeded offset from the epoch.
fn timeline(plan: &Plan, spec: &Spec, group_seed: u64, board: u64, origin: Option<UnixMicros>) -> Timeline {
    let cycle: i64 = plan.phases.iter().map(|p| p.len).sum::<i64>().max(SEC);
    let offset = match (plan.utc_aligned, origin) {
        (true, _) => 0,
        // Position `jitter` of the cycle at `origin`.
        (false, Some(o)) => (mix(group_seed) % 3600) as i64 * SEC - o.0,
        (false, None) => (mix(group_seed) % (cycle / SEC) as u64) as i64 * SEC,
    };
    let mut phases = Vec::with_capacity(plan.phases.len());
    let (mut start, mut before_j, mut allocs, mut alloc_start) = (0i64, 0.0f64, 0u32, 0i64);
    let mut prev_allocated = false;
    for p in &plan.phases {
        let alloc = p.allocated.then(|| {
            if !prev_allocated {
                allocs += 1;
                alloc_start = start;
            }
            allocs
        });
        prev_allocated = p.allocated;
        let mem_mib = match p.memory {
            Memory::None => 0.0,
            Memory::Fraction(f) => (spec.memory_mib * f).round(),
            Memory::Mib(m) => m.min(0.95 * spec.memory_mib).round(),
        };
        let base_w = (if p.process { spec.context_w } else { spec.idle_w }) * (1.0 + 0.04 * lane(board, 0));
        let span_w = (0.97 * spec.limit_w - spec.context_w) * plan.mix.power * (1.0 + 0.03 * lane(board, 1));
        // Phases hold whole burst blocks, so this integral does not depend on where the
        // bursts fall and every cycle has the same energy.
        let load_us = p.shape.integral(p.len, |_| 0);
        let phase = Phase {
            kind: p.kind,
            start,
            len: p.len,
            alloc,
            alloc_start,
            process: p.process,
            shape: p.shape,
            mem_mib,
            ramp: p.ramp,
            base_w,
            span_w,
            before_j,
        };
        before_j += (base_w * p.len as f64 + span_w * load_us) / 1e6;
        start += p.len;
        phases.push(phase);
    }
    Timeline { cycle, offset, persistent: plan.persistent, phases, cycle_j: before_j }
}

/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` from 128 hashed bits.
fn gpu_uuid(h: u64) -> String {
    let (a, b) = (mix(h), mix(h ^ 0xA5A5_A5A5));
    format!(
        "GPU-{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xFFFF,
        a & 0xFFFF,
        b >> 48,
        b & 0xFFFF_FFFF_FFFF
    )
}

/// A ratio at NVML's integer-percent resolution.
#[inline]
fn pct(x: f64) -> f64 {
    (x.clamp(0.0, 1.0) * 100.0).round() / 100.0
}

/// A ratio at GPM's 0.01% resolution.
#[inline]
fn ratio(x: f64) -> f64 {
    (x.clamp(0.0, 1.0) * 10_000.0).round() / 10_000.0
}
