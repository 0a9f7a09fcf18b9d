//! Rebalancing recommendations over a window: the rules, the money and the confidence.
//!
//! Input: per allocation, per GPU, what the window's `gpu_samples` say (held, known and
//! idle time; p95 SM activity and memory; the per-minute spread), with the price in force
//! at the window's end. The server gathers it with SQL and hands it here; the replays
//! (see [`crate::replay`]) run on series the server fetches for the proposals this
//! module makes.
//!
//! | kind | rule (defaults) | window savings |
//! | --- | --- | --- |
//! | `reclaim` | the allocation was idle ≥ 80% of its known time | its idle GPU-time × price |
//! | `right-size` | a job of ≥ 2 GPUs left some idle ≥ 90% of their known time | replay: GPU-time released × price |
//! | `pack` | single-GPU workloads whose p95 SM and p95 memory fit a MIG slice, bin-packed (FFD) per host and GPU class; ≥ 1 GPU freed | replay: GPU-time freed × price |
//! | `downsize` | p95 SM < 0.2 and p95 memory ≤ 10 GB on a card ≥ 70 GiB, not packed | held time × price × (7 − g)/7 of the slice that fits |
//! | `spot` | an interruptible allocation priced on-demand, with a spot price for its model | held time × (on-demand − spot) |
//! | `rebalance-quota` | a team stranding GPUs ≥ 50% of the window while another team has work queued | the stranded GPU-time × price (capacity) |
//!
//! Monthly savings = window savings × 730 h / window hours (the design brief's rule),
//! exact micro-dollars, rounded to cents once for display. The caller passes as
//! `window_us` the part of its window that holds data (the server: from the first sample
//! window to the last), so a young installation is extrapolated from what it saw.
//!
//! # Live holders
//!
//! An item about a holder's allocation says whether the holder still holds the GPU when
//! the run's window ends (`holder_live`), by the ledger's rule for an open allocation
//! ([`crate::run_ended`]): a (GPU, holder) pair is live when no window of another holder
//! or of nobody came after the holder's newest window on that GPU, and that newest window
//! ended at most [`crate::OPEN_RUN_STALE_US`] (10 min) before the window's end. The
//! caller decides it per GPU ([`GpuUse::holder_live`]); an item is live when any of its
//! GPUs is (`pack`: when every workload it packs is). An ended item keeps its figures as
//! history, says when its holder's newest window ended (`holder_ended_at`), and is never
//! counted in the monthly headline ([`monthly_totals`]).
//!
//! `savings_kind` is `cash` where releasing the GPU stops a bill (on-demand and spot
//! cloud rates) and `capacity` where it frees a GPU that is paid for anyway (on-prem
//! amortisation, committed-use rates).
//!
//! # Confidence
//!
//! `confidence = coverage × 1 / (1 + cv)`, rounded to 0.01, where `coverage` is the
//! share of the held time with a signal (known ÷ held: gaps and signal-less windows lower
//! it), and `cv` is the coefficient of variation (population standard deviation ÷ mean)
//! across the window's minutes of the figure the rule decides on — the idle share for
//! `reclaim`, `right-size` and `rebalance-quota`, the mean SM activity for `pack` and
//! `downsize`, none for `spot` (cv 0: interruptibility is a label, not a measurement). A
//! steady, fully observed workload scores near 1; a bursty or patchily observed one
//! scores lower. It is never a constant.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;
use serde_json::{Value, json};

use crate::mig::{self, MigProfile};
use crate::money::{Cents, Micros, MoneyError, Ratio, cost_of_duration, monthly_savings};
use crate::pack::{self, Item};
use crate::pricebook::PriceKind;
use crate::replay::{self, Outcome, Workload};

/// Thresholds of the rules (`[recommend]` in the server's config).
#[derive(Clone, Debug, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RecommendConfig {
    /// Reclaim when idle ÷ known ≥ this.
    pub reclaim_idle_fraction: f64,
    /// A job's GPU counts as unused when its idle ÷ known ≥ this.
    pub right_size_idle_fraction: f64,
    /// Ignore (allocation, GPU) pairs held less than this share of the longest-held
    /// GPU's time in the window (the window itself once history covers it).
    pub min_held_fraction: f64,
    /// Downsize: p95 SM below, p95 memory at most, on cards with at least this memory.
    pub downsize_max_sm: f64,
    pub downsize_max_memory_bytes: i64,
    pub downsize_min_card_bytes: i64,
    /// Rebalance: a team whose stranded GPU-time is at least this share of the window,
    /// per GPU it holds.
    pub rebalance_stranded_fraction: f64,
}

impl Default for RecommendConfig {
    fn default() -> Self {
        RecommendConfig {
            reclaim_idle_fraction: 0.8,
            right_size_idle_fraction: 0.9,
            min_held_fraction: 0.1,
            downsize_max_sm: 0.2,
            downsize_max_memory_bytes: 10_000_000_000,
            downsize_min_card_bytes: 70 << 30,
            rebalance_stranded_fraction: 0.5,
        }
    }
}

/// The price in force for a GPU at the window's end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Price {
    pub per_hour: Micros,
    pub kind: PriceKind,
    /// The model's spot rate, when the price book has one.
    pub spot_per_hour: Option<Micros>,
}

/// Mean and population standard deviation of a per-minute figure.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Spread {
    pub mean: f64,
    pub std: f64,
}

impl Spread {
    /// `std / mean`; 1 (maximal doubt) when the mean is not positive.
    pub fn cv(self) -> f64 {
        if self.mean > 0.0 && self.std.is_finite() { self.std / self.mean } else { 1.0 }
    }
}

/// One GPU as one allocation used it in the window.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuUse {
    pub gpu_uuid: String,
    pub host: String,
    pub cluster: Option<String>,
    pub gpu_model: String,
    pub mig_profile: Option<String>,
    pub fb_total_bytes: Option<i64>,
    pub held_us: i64,
    pub known_us: i64,
    pub idle_us: i64,
    /// p95 of SM activity (GPM `sm_active`, else `gpu_util`) and of memory used.
    pub p95_sm: Option<f64>,
    pub p95_mem_bytes: Option<i64>,
    /// Per-minute idle share and mean SM activity.
    pub idle_spread: Spread,
    pub sm_spread: Spread,
    pub price: Option<Price>,
    /// Whether the holder still held this GPU at the window's end (the ledger's rule for
    /// an open allocation, see the module's "Live holders").
    pub holder_live: bool,
    /// The end of the holder's newest window on this GPU in the window, µs.
    pub last_held_us: i64,
}

impl GpuUse {
    fn idle_fraction(&self) -> f64 {
        if self.known_us > 0 { self.idle_us as f64 / self.known_us as f64 } else { 0.0 }
    }
}

/// One allocation (owner) and the GPUs it held in the window.
#[derive(Clone, Debug, PartialEq)]
pub struct AllocationUse {
    pub owner_kind: String,
    pub owner: String,
    pub team: String,
    pub workload_kind: Option<String>,
    pub interruptible: bool,
    pub gpus: Vec<GpuUse>,
}

/// Work a scheduler reports as waiting for GPUs.
#[derive(Clone, Debug, PartialEq)]
pub struct Pending {
    pub team: String,
    pub gpus: u32,
    /// How long it has waited, at the window's end.
    pub waited_us: i64,
}

/// What a recommendation proposes, when a replay decides its savings.
#[derive(Clone, Debug, PartialEq)]
pub enum Proposal {
    /// Co-locate `members` ((allocation, GPU) indices) on `bins.len()` GPUs with these slices.
    Pack { members: Vec<(usize, usize)>, slices: Vec<MigProfile>, bins: Vec<Vec<usize>> },
    /// Keep `keep` of allocation `alloc`'s GPUs.
    RightSize { alloc: usize, keep: usize },
}

/// A recommendation.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Recommendation {
    pub id: String,
    pub kind: &'static str,
    pub team: String,
    pub owner: String,
    pub owner_kind: String,
    pub cluster: Option<String>,
    pub host: String,
    pub gpu_model: String,
    pub gpus: Vec<String>,
    /// Whether the holder still holds the GPU(s) at the window's end; an ended item is
    /// history, never counted in [`monthly_totals`].
    pub holder_live: bool,
    /// When the holder no longer does: the end of its newest window (RFC 3339); `None`
    /// while live.
    pub holder_ended_at: Option<String>,
    /// The same, µs, for the `recommendations` table.
    #[serde(skip)]
    pub holder_ended_us: Option<i64>,
    pub window_savings_usd: Cents,
    pub monthly_savings_usd: Cents,
    /// Exact, for the `recommendations` table.
    #[serde(skip)]
    pub window_savings: Micros,
    #[serde(skip)]
    pub monthly_savings: Micros,
    pub savings_kind: &'static str,
    pub confidence: f64,
    pub summary: String,
    pub evidence: BTreeMap<String, Value>,
    pub replay: Option<Outcome>,
    #[serde(skip)]
    pub proposal: Option<Proposal>,
}

fn savings_kind(kind: PriceKind) -> &'static str {
    match kind {
        PriceKind::OnDemand | PriceKind::Spot => "cash",
        PriceKind::OnPrem | PriceKind::Committed => "capacity",
    }
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// `coverage × 1/(1 + cv)`, rounded to 0.01.
pub fn confidence(known_us: i64, held_us: i64, cv: f64) -> f64 {
    let coverage = if held_us > 0 { (known_us as f64 / held_us as f64).clamp(0.0, 1.0) } else { 0.0 };
    round2(coverage / (1.0 + cv.max(0.0)))
}

/// A stable id: FNV-1a of the kind and the GPUs and owners it is about.
fn rec_id(kind: &str, parts: &[&str]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in kind.bytes().chain(parts.iter().flat_map(|p| p.bytes().chain(std::iter::once(0)))) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{kind}-{h:016x}")
}

fn hours(us: i64) -> f64 {
    us as f64 / 3.6e9
}

fn mixed<'a>(values: impl Iterator<Item = &'a str>) -> String {
    let set: BTreeSet<&str> = values.collect();
    set.into_iter().collect::<Vec<_>>().join(",")
}

/// The rules over a window of `window_us` ending at `end_us`. Pack and right-size come back
/// with a [`Proposal`] and no savings yet: run [`finish`] with their replay.
/// What the rules share while planning: the inputs, the GPUs earlier rules took, and
/// the recommendations so far.
struct Planner<'a> {
    allocs: &'a [AllocationUse],
    pending: &'a [Pending],
    cfg: &'a RecommendConfig,
    window_us: i64,
    /// GPUs held for less than this are too short-lived to judge.
    min_held: i64,
    /// (allocation, GPU) pairs a rule already recommended on.
    taken: BTreeSet<(usize, usize)>,
    out: Vec<Recommendation>,
}

/// One recommendation kind: adds its recommendations to the planner.
type Rule = fn(&mut Planner<'_>) -> Result<(), MoneyError>;

/// Every recommendation kind, in the order they claim GPUs: a GPU that `reclaim` or
/// `right-size` recommends on is not also packed or downsized, and a packed one is not
/// downsized (`spot` and `rebalance-quota` look at every allocation). The one list a
/// new kind is added to (`docs/architecture.md`, "How to add a recommendation kind").
const RULES: &[(&str, Rule)] = &[
    ("reclaim", reclaim),
    ("right-size", right_size),
    ("pack", pack),
    ("downsize", downsize),
    ("spot", spot),
    ("rebalance-quota", rebalance_quota),
];

/// The recommendations of a window: each rule of [`RULES`] in turn.
pub fn plan(
    allocs: &[AllocationUse],
    pending: &[Pending],
    cfg: &RecommendConfig,
    window_us: i64,
) -> Result<Vec<Recommendation>, MoneyError> {
    // Relative to the longest-held GPU rather than the window, so a young installation
    // (less history than the window) still gets recommendations.
    let longest = allocs.iter().flat_map(|a| a.gpus.iter().map(|g| g.held_us)).max().unwrap_or(0);
    let min_held = (longest.min(window_us) as f64 * cfg.min_held_fraction) as i64;
    let mut p = Planner { allocs, pending, cfg, window_us, min_held, taken: BTreeSet::new(), out: Vec::new() };
    for (_, rule) in RULES {
        rule(&mut p)?;
    }
    for r in p.out.iter_mut().filter(|r| !r.holder_live) {
        let when = r.holder_ended_at.as_deref().unwrap_or("?");
        r.summary.push_str(&format!(" — ended: the holder released the GPU(s) by {when} (history, not counted)"));
    }
    Ok(p.out)
}

/// Whether an item's holder still holds its GPUs, and if not, since when (the end of a
/// holder's newest window): with `every` false (one holder) the item is live when any of
/// its GPUs is — the holder still holds part of what it is about — and ended at the
/// newest of the GPUs' last windows; with `every` true (`pack`: the plan needs each of
/// its workloads) it is live when every GPU is, and ended at the first ended workload's
/// last window. No GPUs: live (nothing says a holder ended).
pub fn holder_status<'a>(gpus: impl IntoIterator<Item = &'a GpuUse>, every: bool) -> (bool, Option<i64>) {
    let (mut any, mut all, mut newest, mut first_ended) = (false, true, None::<i64>, None::<i64>);
    let mut seen = false;
    for g in gpus {
        seen = true;
        any |= g.holder_live;
        all &= g.holder_live;
        newest = Some(newest.map_or(g.last_held_us, |t| t.max(g.last_held_us)));
        if !g.holder_live {
            first_ended = Some(first_ended.map_or(g.last_held_us, |t| t.min(g.last_held_us)));
        }
    }
    match (seen, every) {
        (false, _) => (true, None),
        (true, false) if any => (true, None),
        (true, false) => (false, newest),
        (true, true) if all => (true, None),
        (true, true) => (false, first_ended),
    }
}

/// The headline: the items' monthly savings summed by savings kind, live holders' items
/// only (an ended holder's savings are history: releasing what is already released
/// saves nothing).
pub fn monthly_totals<'a>(items: impl IntoIterator<Item = &'a Recommendation>) -> BTreeMap<&'static str, Cents> {
    let mut totals: BTreeMap<&'static str, Cents> = BTreeMap::new();
    for r in items.into_iter().filter(|r| r.holder_live) {
        let e = totals.entry(r.savings_kind).or_insert(Cents::ZERO);
        *e = *e + r.monthly_savings_usd;
    }
    totals
}

fn base(a: &AllocationUse, kind: &'static str, gpus: &[&GpuUse]) -> Recommendation {
    let (live, ended) = holder_status(gpus.iter().copied(), false);
    base_with(a, kind, gpus, live, ended)
}

fn base_with(
    a: &AllocationUse,
    kind: &'static str,
    gpus: &[&GpuUse],
    holder_live: bool,
    ended_us: Option<i64>,
) -> Recommendation {
    Recommendation {
        id: rec_id(kind, &gpus.iter().map(|g| g.gpu_uuid.as_str()).chain([a.owner.as_str()]).collect::<Vec<_>>()),
        kind,
        team: a.team.clone(),
        owner: a.owner.clone(),
        owner_kind: a.owner_kind.clone(),
        cluster: gpus.first().and_then(|g| g.cluster.clone()),
        host: mixed(gpus.iter().map(|g| g.host.as_str())),
        gpu_model: mixed(gpus.iter().map(|g| g.gpu_model.as_str())),
        gpus: gpus.iter().map(|g| g.gpu_uuid.clone()).collect(),
        holder_live,
        holder_ended_at: ended_us.map(|t| apron_common::UnixMicros(t).to_rfc3339()),
        holder_ended_us: ended_us,
        window_savings_usd: Cents::ZERO,
        monthly_savings_usd: Cents::ZERO,
        window_savings: Micros::ZERO,
        monthly_savings: Micros::ZERO,
        savings_kind: gpus.iter().find_map(|g| g.price.as_ref()).map_or("capacity", |p| savings_kind(p.kind)),
        confidence: 0.0,
        summary: String::new(),
        evidence: BTreeMap::new(),
        replay: None,
        proposal: None,
    }
}

/// `reclaim`: an allocation idle most of its known time.
fn reclaim(p: &mut Planner<'_>) -> Result<(), MoneyError> {
    let (allocs, cfg, min_held, window_us) = (p.allocs, p.cfg, p.min_held, p.window_us);
    for (ai, a) in allocs.iter().enumerate() {
        let gpus: Vec<&GpuUse> = a.gpus.iter().filter(|g| g.held_us >= min_held).collect();
        if gpus.is_empty() {
            continue;
        }
        let (held, known, idle) =
            gpus.iter().fold((0, 0, 0), |s, g| (s.0 + g.held_us, s.1 + g.known_us, s.2 + g.idle_us));
        let idle_fraction = if known > 0 { idle as f64 / known as f64 } else { 0.0 };
        let cv = gpus.iter().map(|g| g.idle_spread.cv()).fold(0.0, f64::max);
        if known > 0 && idle_fraction >= cfg.reclaim_idle_fraction {
            let mut r = base(a, "reclaim", &gpus);
            let mut saved = Micros::ZERO;
            for g in &gpus {
                if let Some(price) = &g.price {
                    saved = saved
                        .checked_add(cost_of_duration(price.per_hour, g.idle_us)?)
                        .ok_or(MoneyError::Overflow("reclaim"))?;
                }
            }
            r.set_savings(saved, window_us)?;
            r.confidence = confidence(known, held, cv);
            r.summary = format!(
                "{} {} held {} GPU(s) idle {:.0}% of the time ({:.1} of {:.1} GPU-hours): release them",
                a.owner_kind,
                a.owner,
                gpus.len(),
                idle_fraction * 100.0,
                hours(idle),
                hours(held)
            );
            r.evidence = figures(&gpus, held, known, idle);
            for g in &gpus {
                p.taken.insert((ai, a.gpus.iter().position(|x| x.gpu_uuid == g.gpu_uuid).unwrap_or(0)));
            }
            p.out.push(r);
        }
    }
    Ok(())
}

/// `right-size`: a multi-GPU job that left some of its GPUs idle.
fn right_size(p: &mut Planner<'_>) -> Result<(), MoneyError> {
    let (allocs, cfg, min_held) = (p.allocs, p.cfg, p.min_held);
    for (ai, a) in allocs.iter().enumerate() {
        // An allocation reclaimed whole is not also right-sized.
        if (0..a.gpus.len()).any(|gi| p.taken.contains(&(ai, gi))) {
            continue;
        }
        let gpus: Vec<&GpuUse> = a.gpus.iter().filter(|g| g.held_us >= min_held).collect();
        if gpus.is_empty() {
            continue;
        }
        let (held, known, idle) =
            gpus.iter().fold((0, 0, 0), |s, g| (s.0 + g.held_us, s.1 + g.known_us, s.2 + g.idle_us));
        if gpus.len() >= 2 {
            let unused: Vec<&GpuUse> = gpus
                .iter()
                .copied()
                .filter(|g| g.known_us > 0 && g.idle_fraction() >= cfg.right_size_idle_fraction)
                .collect();
            if !unused.is_empty() && unused.len() < gpus.len() {
                let keep = gpus.len() - unused.len();
                let mut r = base(a, "right-size", &gpus);
                r.confidence = confidence(known, held, unused.iter().map(|g| g.idle_spread.cv()).fold(0.0, f64::max));
                r.summary = format!(
                    "{} {} used {keep} of {} allocated GPUs; {} idle ≥ {:.0}% of the time: request {keep}",
                    a.owner_kind,
                    a.owner,
                    gpus.len(),
                    unused.len(),
                    cfg.right_size_idle_fraction * 100.0
                );
                r.evidence = figures(&gpus, held, known, idle);
                r.evidence.insert("unused_gpus".into(), json!(unused.iter().map(|g| &g.gpu_uuid).collect::<Vec<_>>()));
                r.evidence.insert("keep".into(), json!(keep));
                r.proposal = Some(Proposal::RightSize { alloc: ai, keep });
                for (gi, _) in a.gpus.iter().enumerate() {
                    p.taken.insert((ai, gi));
                }
                p.out.push(r);
            }
        }
    }

    Ok(())
}

/// (cluster, host, GPU class) → the single-GPU workloads not yet taken whose p95 SM and
/// memory fit a MIG slice smaller than the whole GPU: (allocation, GPU, slice).
type Group = (Option<String>, String, &'static str);

fn slice_candidates(p: &Planner<'_>) -> BTreeMap<Group, Vec<(usize, usize, MigProfile)>> {
    let (allocs, min_held) = (p.allocs, p.min_held);
    let mut groups: BTreeMap<Group, Vec<(usize, usize, MigProfile)>> = BTreeMap::new();
    for (ai, a) in allocs.iter().enumerate() {
        let live: Vec<usize> = (0..a.gpus.len()).filter(|&gi| a.gpus[gi].held_us >= min_held).collect();
        if live.len() != 1 || p.taken.contains(&(ai, live[0])) {
            continue;
        }
        let g = &a.gpus[live[0]];
        if g.mig_profile.is_some() {
            continue; // already a slice
        }
        let (Some(sm), Some(mem)) = (g.p95_sm, g.p95_mem_bytes) else { continue };
        let Some(profiles) = mig::profiles_for(&g.gpu_model, g.fb_total_bytes) else { continue };
        let Some(slice) = mig::smallest_fitting(profiles, sm, mem) else { continue };
        if slice.compute >= 7 {
            continue;
        }
        let class = profiles.last().map_or("", |p| p.name);
        groups.entry((g.cluster.clone(), g.host.clone(), class)).or_default().push((ai, live[0], slice));
    }
    groups
}

/// `pack`: single-GPU workloads of one host and GPU class that fit onto fewer GPUs as
/// MIG slices (first-fit decreasing).
fn pack(p: &mut Planner<'_>) -> Result<(), MoneyError> {
    let allocs = p.allocs;
    let groups = slice_candidates(p);
    for ((_, host, _), members) in &groups {
        let items: Vec<Item> = members.iter().map(|(_, _, s)| Item { compute: s.compute, memory: s.memory }).collect();
        let bins = pack::first_fit_decreasing(&items, pack::CAPACITY);
        if bins.len() < members.len() {
            let gpus: Vec<&GpuUse> = members.iter().map(|(ai, gi, _)| &allocs[*ai].gpus[*gi]).collect();
            let first = &allocs[members[0].0];
            let (live, ended) = holder_status(gpus.iter().copied(), true);
            let mut r = base_with(first, "pack", &gpus, live, ended);
            r.team = mixed(members.iter().map(|(ai, _, _)| allocs[*ai].team.as_str()));
            r.owner = mixed(members.iter().map(|(ai, _, _)| allocs[*ai].owner.as_str()));
            r.owner_kind = mixed(members.iter().map(|(ai, _, _)| allocs[*ai].owner_kind.as_str()));
            r.id = rec_id("pack", &gpus.iter().map(|g| g.gpu_uuid.as_str()).collect::<Vec<_>>());
            let (held, known) = gpus.iter().fold((0, 0), |s, g| (s.0 + g.held_us, s.1 + g.known_us));
            r.confidence = confidence(known, held, gpus.iter().map(|g| g.sm_spread.cv()).fold(0.0, f64::max));
            let freed = members.len() - bins.len();
            let plan: Vec<Value> = members
                .iter()
                .map(|(ai, gi, s)| {
                    let g = &allocs[*ai].gpus[*gi];
                    json!({"owner": allocs[*ai].owner, "gpu_uuid": g.gpu_uuid, "p95_sm_active": g.p95_sm,
                           "p95_fb_used_bytes": g.p95_mem_bytes, "mig_profile": s.name})
                })
                .collect();
            r.summary = format!(
                "{} workloads on {host} fit MIG slices ({}): pack them onto {} GPU(s), freeing {freed}",
                members.len(),
                members.iter().map(|(_, _, s)| s.name).collect::<Vec<_>>().join(", "),
                bins.len()
            );
            r.evidence = figures(&gpus, held, known, gpus.iter().map(|g| g.idle_us).sum());
            r.evidence.insert("workloads".into(), Value::Array(plan));
            r.evidence.insert("bins".into(), json!(bins));
            r.evidence.insert("gpus_freed".into(), json!(freed));
            r.proposal = Some(Proposal::Pack {
                members: members.iter().map(|(ai, gi, _)| (*ai, *gi)).collect(),
                slices: members.iter().map(|(_, _, s)| *s).collect(),
                bins,
            });
            for (ai, gi, _) in members {
                p.taken.insert((*ai, *gi));
            }
            p.out.push(r);
        }
    }
    Ok(())
}

/// `downsize`: a light single-GPU workload on a large card that a slice would hold.
fn downsize(p: &mut Planner<'_>) -> Result<(), MoneyError> {
    let (allocs, cfg, window_us) = (p.allocs, p.cfg, p.window_us);
    let groups = slice_candidates(p);
    for members in groups.values() {
        for &(ai, gi, slice) in members {
            if p.taken.contains(&(ai, gi)) {
                continue;
            }
            let (a, g) = (&allocs[ai], &allocs[ai].gpus[gi]);
            let (Some(sm), Some(mem), Some(total)) = (g.p95_sm, g.p95_mem_bytes, g.fb_total_bytes) else { continue };
            if !(sm < cfg.downsize_max_sm
                && mem <= cfg.downsize_max_memory_bytes
                && total >= cfg.downsize_min_card_bytes)
            {
                continue;
            }
            let mut r = base(a, "downsize", &[g]);
            if let Some(price) = &g.price {
                let share = Ratio::new(i128::from(7 - slice.compute), 7).unwrap_or(Ratio::ZERO);
                let rate = price.per_hour.to_ratio().checked_mul(share).and_then(Ratio::to_micros);
                let rate = rate.ok_or(MoneyError::Overflow("downsize"))?;
                r.set_savings(cost_of_duration(rate, g.held_us)?, window_us)?;
            }
            r.confidence = confidence(g.known_us, g.held_us, g.sm_spread.cv());
            r.summary = format!(
                "{} {} uses p95 {:.0}% SM and {:.1} GB of a {:.0} GB card: a {} slice (or a smaller GPU) holds it",
                a.owner_kind,
                a.owner,
                sm * 100.0,
                mem as f64 / 1e9,
                total as f64 / 1e9,
                slice.name
            );
            r.evidence = figures(&[g], g.held_us, g.known_us, g.idle_us);
            r.evidence.insert("mig_profile".into(), json!(slice.name));
            p.out.push(r);
        }
    }

    Ok(())
}

/// `spot`: interruptible work on on-demand rates where the book has a spot price.
fn spot(p: &mut Planner<'_>) -> Result<(), MoneyError> {
    let (allocs, min_held, window_us) = (p.allocs, p.min_held, p.window_us);
    for a in allocs.iter().filter(|a| a.interruptible) {
        let gpus: Vec<&GpuUse> = a.gpus.iter().filter(|g| g.held_us >= min_held).collect();
        let mut saved = Micros::ZERO;
        let mut rates = Vec::new();
        for g in &gpus {
            let Some(price) = &g.price else { continue };
            let Some(spot) = price.spot_per_hour.filter(|s| price.kind == PriceKind::OnDemand && *s < price.per_hour)
            else {
                continue;
            };
            let diff = price.per_hour.checked_sub(spot).ok_or(MoneyError::Overflow("spot"))?;
            saved = saved.checked_add(cost_of_duration(diff, g.held_us)?).ok_or(MoneyError::Overflow("spot"))?;
            rates.push(json!({"gpu_uuid": g.gpu_uuid, "on_demand_usd_per_hour": price.per_hour.to_string(), "spot_usd_per_hour": spot.to_string()}));
        }
        if rates.is_empty() {
            continue;
        }
        let mut r = base(a, "spot", &gpus);
        r.savings_kind = "cash";
        r.set_savings(saved, window_us)?;
        let (held, known) = gpus.iter().fold((0, 0), |s, g| (s.0 + g.held_us, s.1 + g.known_us));
        r.confidence = confidence(known, held, 0.0);
        r.summary =
            format!("{} {} is interruptible and runs at on-demand rates: move it to spot", a.owner_kind, a.owner);
        r.evidence = figures(&gpus, held, known, gpus.iter().map(|g| g.idle_us).sum());
        r.evidence.insert("rates".into(), Value::Array(rates));
        p.out.push(r);
    }

    Ok(())
}

/// `rebalance-quota`: a team stranding GPUs while another team's work waits.
fn rebalance_quota(p: &mut Planner<'_>) -> Result<(), MoneyError> {
    let (allocs, pending, cfg, min_held, window_us) = (p.allocs, p.pending, p.cfg, p.min_held, p.window_us);
    let mut by_team: BTreeMap<&str, (i64, i64, i64, Vec<&GpuUse>, f64)> = BTreeMap::new();
    for a in allocs {
        for g in a.gpus.iter().filter(|g| g.held_us >= min_held) {
            let e = by_team.entry(a.team.as_str()).or_default();
            e.0 += g.held_us;
            e.1 += g.known_us;
            e.2 += g.idle_us;
            e.3.push(g);
            e.4 = e.4.max(g.idle_spread.cv());
        }
    }
    for (team, (held, known, idle, gpus, cv)) in &by_team {
        let stranded_gpus = *idle as f64 / window_us as f64;
        if stranded_gpus < cfg.rebalance_stranded_fraction {
            continue;
        }
        let waiting: Vec<&Pending> = pending.iter().filter(|w| w.team != *team && w.gpus > 0).collect();
        if waiting.is_empty() {
            continue;
        }
        let give = (stranded_gpus.floor() as u32).max(1);
        let a = AllocationUse {
            owner_kind: "team".into(),
            owner: (*team).to_owned(),
            team: (*team).to_owned(),
            workload_kind: None,
            interruptible: false,
            gpus: Vec::new(),
        };
        let mut r = base(&a, "rebalance-quota", gpus);
        let mut saved = Micros::ZERO;
        for g in gpus {
            if let Some(price) = &g.price {
                saved = saved
                    .checked_add(cost_of_duration(price.per_hour, g.idle_us)?)
                    .ok_or(MoneyError::Overflow("rebalance"))?;
            }
        }
        r.savings_kind = "capacity";
        r.set_savings(saved, window_us)?;
        r.confidence = confidence(*known, *held, *cv);
        r.summary = format!(
            "team {team} left {stranded_gpus:.1} GPUs idle on average while {} waited: move {give} GPU(s) of quota",
            waiting.iter().map(|w| format!("{} ({} GPUs)", w.team, w.gpus)).collect::<Vec<_>>().join(", ")
        );
        r.evidence = figures(gpus, *held, *known, *idle);
        r.evidence.insert(
            "pending".into(),
            json!(
                waiting
                    .iter()
                    .map(|w| json!({"team": w.team, "gpus": w.gpus, "waited_s": w.waited_us / 1_000_000}))
                    .collect::<Vec<_>>()
            ),
        );
        p.out.push(r);
    }
    Ok(())
}

fn figures(gpus: &[&GpuUse], held: i64, known: i64, idle: i64) -> BTreeMap<String, Value> {
    let mut e = BTreeMap::new();
    e.insert("held_gpu_hours".into(), json!(round6(hours(held))));
    e.insert("known_gpu_hours".into(), json!(round6(hours(known))));
    e.insert("idle_gpu_hours".into(), json!(round6(hours(idle))));
    let per_gpu: Vec<Value> = gpus
        .iter()
        .map(|g| {
            json!({
                "gpu_uuid": g.gpu_uuid, "host": g.host, "gpu_model": g.gpu_model,
                "held_s": g.held_us as f64 / 1e6, "known_s": g.known_us as f64 / 1e6, "idle_s": g.idle_us as f64 / 1e6,
                "p95_sm_active": g.p95_sm, "p95_fb_used_bytes": g.p95_mem_bytes,
                "usd_per_gpu_hour": g.price.as_ref().map(|p| p.per_hour.to_string()),
                "price_kind": g.price.as_ref().map(|p| p.kind.as_str()),
            })
        })
        .collect();
    e.insert("gpus".into(), Value::Array(per_gpu));
    e
}

fn round6(x: f64) -> f64 {
    (x * 1e6).round() / 1e6
}

impl Recommendation {
    fn set_savings(&mut self, window: Micros, window_us: i64) -> Result<(), MoneyError> {
        self.window_savings = window;
        self.monthly_savings = monthly_savings(window, window_us)?;
        self.window_savings_usd = window.to_cents();
        self.monthly_savings_usd = self.monthly_savings.to_cents();
        Ok(())
    }
}

/// The workloads a proposal replays, by (allocation, GPU); the caller fetches their
/// per-minute series and passes them to [`finish`] in this order.
pub fn replay_members(allocs: &[AllocationUse], p: &Proposal) -> Vec<(usize, usize)> {
    match p {
        Proposal::Pack { members, .. } => members.clone(),
        Proposal::RightSize { alloc, .. } => {
            (0..allocs.get(*alloc).map_or(0, |a| a.gpus.len())).map(|g| (*alloc, g)).collect()
        }
    }
}

/// Completes a pack or right-size recommendation with its replay: the savings are the
/// replay's GPU-time saved at the first member's price; the replay's collisions go in.
pub fn finish(
    r: &mut Recommendation,
    allocs: &[AllocationUse],
    series: &[Workload],
    window_us: i64,
) -> Result<(), MoneyError> {
    let Some(p) = r.proposal.clone() else { return Ok(()) };
    let members = replay_members(allocs, &p);
    let outcome = match &p {
        Proposal::Pack { slices, bins, .. } => {
            replay::replay_placement(series, bins, &replay::Sharing::Mig { slices: slices.clone() })
        }
        Proposal::RightSize { keep, .. } => replay::replay_right_size(series, *keep),
    };
    let price = members.iter().find_map(|(a, g)| allocs.get(*a)?.gpus.get(*g)?.price.as_ref());
    if let Some(price) = price {
        r.set_savings(cost_of_duration(price.per_hour, outcome.gpu_us_saved)?, window_us)?;
    }
    r.evidence.insert("replay_gpu_hours_saved".into(), json!(round6(hours(outcome.gpu_us_saved))));
    r.evidence.insert("replay_collisions".into(), json!(outcome.collisions.len()));
    if !outcome.collisions.is_empty() {
        r.summary.push_str(&format!(
            " — the replay found {} collision interval(s) ({:.0} min)",
            outcome.collisions.len(),
            outcome.collision_us as f64 / 6e7
        ));
    }
    r.replay = Some(outcome);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::Bucket;

    const HOUR: i64 = 3_600_000_000;
    const MIN: i64 = 60_000_000;

    fn price(usd: &str, kind: PriceKind) -> Option<Price> {
        Some(Price { per_hour: Micros::parse(usd).expect("price"), kind, spot_per_hour: None })
    }

    fn gpu(uuid: &str, host: &str, model: &str, held: i64, idle: i64) -> GpuUse {
        GpuUse {
            gpu_uuid: uuid.into(),
            host: host.into(),
            cluster: None,
            gpu_model: model.into(),
            mig_profile: None,
            fb_total_bytes: Some(80 << 30),
            held_us: held,
            known_us: held,
            idle_us: idle,
            p95_sm: Some(0.7),
            p95_mem_bytes: Some(60 << 30),
            idle_spread: Spread { mean: 1.0, std: 0.0 },
            sm_spread: Spread { mean: 0.5, std: 0.1 },
            price: price("3.60", PriceKind::OnDemand),
            holder_live: true,
            last_held_us: held,
        }
    }

    fn alloc(owner: &str, team: &str, gpus: Vec<GpuUse>) -> AllocationUse {
        AllocationUse {
            owner_kind: "pod".into(),
            owner: owner.into(),
            team: team.into(),
            workload_kind: None,
            interruptible: false,
            gpus,
        }
    }

    #[test]
    fn reclaim_prices_the_idle_time_and_scales_to_a_month() {
        // 1 h window; held 1 h, idle 54 min (90%) at $3.60/h → $3.24; × 730 = $2365.20.
        let a = alloc("ds/jupyter", "data-science", vec![gpu("GPU-a", "n0", "NVIDIA H100 80GB HBM3", HOUR, 54 * MIN)]);
        let recs = plan(&[a], &[], &RecommendConfig::default(), HOUR).expect("plan");
        assert_eq!(recs.len(), 1);
        let r = &recs[0];
        assert_eq!((r.kind, r.savings_kind), ("reclaim", "cash"));
        assert_eq!(r.window_savings, Micros(3_240_000));
        assert_eq!(r.monthly_savings, Micros(2_365_200_000));
        assert_eq!(r.monthly_savings_usd, Cents(236_520));
        // Fully known, steady idle share: confidence 1.
        assert_eq!(r.confidence, 1.0);
        // 80% idle at 3/4 coverage with a bursty idle share (cv 0.5): 0.75 / 1.5 = 0.5.
        let mut g = gpu("GPU-b", "n0", "NVIDIA H100 80GB HBM3", HOUR, 36 * MIN);
        g.known_us = 45 * MIN;
        g.idle_spread = Spread { mean: 0.8, std: 0.4 };
        let recs = plan(&[alloc("x", "t", vec![g])], &[], &RecommendConfig::default(), HOUR).expect("plan");
        assert_eq!((recs[0].kind, recs[0].confidence), ("reclaim", 0.5));
    }

    #[test]
    fn an_item_is_live_while_its_holder_holds_any_of_its_gpus_a_pack_while_all_do() {
        let at = |live: bool, last: i64| {
            let mut g = gpu("GPU-a", "n0", "NVIDIA H100 80GB HBM3", HOUR, HOUR);
            (g.holder_live, g.last_held_us) = (live, last);
            g
        };
        let (live, gone_early, gone_late) = (at(true, 60 * MIN), at(false, 10 * MIN), at(false, 20 * MIN));
        // One holder: live while it holds one of the GPUs; else ended at its newest window.
        assert_eq!(holder_status([&live, &gone_early], false), (true, None));
        assert_eq!(holder_status([&gone_late, &gone_early], false), (false, Some(20 * MIN)));
        // A pack needs every workload: one ended makes it history, from the first end.
        assert_eq!(holder_status([&live, &gone_late, &gone_early], true), (false, Some(10 * MIN)));
        assert_eq!(holder_status([&live, &live], true), (true, None));
        // Nothing to judge by: live.
        assert_eq!(holder_status(std::iter::empty::<&GpuUse>(), false), (true, None));
    }

    #[test]
    fn the_headline_counts_only_live_holders() {
        // Two notebooks idle 54 of 60 minutes at $3.60/h ($2365.20/month each); the
        // second's pod ended 20 minutes before the window's end.
        let idle = |u: &str, live: bool| {
            let mut g = gpu(u, "n0", "NVIDIA H100 80GB HBM3", HOUR, 54 * MIN);
            (g.holder_live, g.last_held_us) = (live, if live { HOUR } else { 40 * MIN });
            g
        };
        let allocs = [
            alloc("ds/live", "data-science", vec![idle("GPU-a", true)]),
            alloc("ds/gone", "data-science", vec![idle("GPU-b", false)]),
        ];
        let recs = plan(&allocs, &[], &RecommendConfig::default(), HOUR).expect("plan");
        assert_eq!(recs.len(), 2);
        let (live, gone) = (&recs[0], &recs[1]);
        assert_eq!((live.owner.as_str(), live.holder_live, live.holder_ended_at.as_deref()), ("ds/live", true, None));
        assert_eq!(
            (gone.owner.as_str(), gone.holder_live, gone.holder_ended_us, gone.holder_ended_at.as_deref()),
            ("ds/gone", false, Some(40 * MIN), Some("1970-01-01T00:40:00.000000Z"))
        );
        // Its figures stay (history) and its summary says it ended …
        assert_eq!(gone.monthly_savings_usd, Cents(236_520));
        assert!(
            gone.summary.contains("ended: the holder released the GPU(s) by 1970-01-01T00:40:00"),
            "{}",
            gone.summary
        );
        assert!(!live.summary.contains("ended"), "{}", live.summary);
        // … but only the live one counts.
        assert_eq!(monthly_totals(&recs), BTreeMap::from([("cash", Cents(236_520))]));
        let serialised = serde_json::to_value(gone).expect("json");
        assert_eq!(
            (&serialised["holder_live"], &serialised["holder_ended_at"]),
            (&json!(false), &json!("1970-01-01T00:40:00.000000Z"))
        );
        assert_eq!(serde_json::to_value(live).expect("json")["holder_ended_at"], Value::Null);
        // A pack whose member ended is history too.
        let small = |u: &str, live: bool| {
            let mut g = gpu(u, "n2", "NVIDIA H100 80GB HBM3", HOUR, 0);
            (g.p95_sm, g.p95_mem_bytes, g.holder_live) = (Some(0.05), Some(6 << 30), live);
            g
        };
        let allocs =
            [alloc("s/a", "search", vec![small("GPU-p", true)]), alloc("s/b", "search", vec![small("GPU-q", false)])];
        let recs = plan(&allocs, &[], &RecommendConfig::default(), HOUR).expect("plan");
        assert_eq!((recs[0].kind, recs[0].holder_live), ("pack", false));
        assert!(monthly_totals(&recs).is_empty());
    }

    #[test]
    fn right_size_waits_for_its_replay_and_uses_its_saving() {
        let busy = gpu("GPU-0", "n1", "NVIDIA A100-SXM4-80GB", HOUR, 0);
        let idle = |u: &str| gpu(u, "n1", "NVIDIA A100-SXM4-80GB", HOUR, HOUR);
        let a = alloc("slurm:42", "vision", vec![busy, idle("GPU-1"), idle("GPU-2"), idle("GPU-3")]);
        let allocs = [a];
        let mut recs = plan(&allocs, &[], &RecommendConfig::default(), HOUR).expect("plan");
        assert_eq!(recs.len(), 1);
        let r = &mut recs[0];
        assert_eq!(r.kind, "right-size");
        assert_eq!(r.proposal, Some(Proposal::RightSize { alloc: 0, keep: 1 }));
        let members = replay_members(&allocs, r.proposal.as_ref().expect("proposal"));
        let series: Vec<Workload> = members
            .iter()
            .map(|(_, g)| Workload {
                name: format!("g{g}"),
                buckets: (0..60)
                    .map(|m| Bucket {
                        start_us: m * MIN,
                        len_us: MIN,
                        held: true,
                        busy: *g == 0,
                        sm: None,
                        mem_bytes: None,
                    })
                    .collect(),
            })
            .collect();
        finish(r, &allocs, &series, HOUR).expect("finish");
        // 3 GPUs released for 60 minutes = 3 GPU-hours × $3.60 = $10.80; × 730 = $7884.
        assert_eq!(r.window_savings, Micros(10_800_000));
        assert_eq!(r.monthly_savings, Micros(7_884_000_000));
        assert!(r.replay.as_ref().is_some_and(|o| o.collisions.is_empty()));
    }

    #[test]
    fn pack_groups_co_located_slices_and_leaves_the_rest_to_downsize() {
        let small = |u: &str, host: &str, mem: i64| {
            let mut g = gpu(u, host, "NVIDIA H100 80GB HBM3", HOUR, 0);
            g.p95_sm = Some(0.05);
            g.p95_mem_bytes = Some(mem);
            g
        };
        let allocs = vec![
            alloc("search/emb-a", "search", vec![small("GPU-a", "n0", 6 << 30)]),
            alloc("search/emb-b", "search", vec![small("GPU-b", "n0", 8 << 30)]),
            // Alone on its host: nothing to pack with, but downsizable.
            alloc("search/emb-c", "search", vec![small("GPU-c", "n1", 7 << 30)]),
        ];
        let recs = plan(&allocs, &[], &RecommendConfig::default(), HOUR).expect("plan");
        let kinds: Vec<_> = recs.iter().map(|r| (r.kind, r.gpus.clone())).collect();
        assert_eq!(
            kinds,
            vec![("pack", vec!["GPU-a".to_owned(), "GPU-b".to_owned()]), ("downsize", vec!["GPU-c".to_owned()])]
        );
        match &recs[0].proposal {
            Some(Proposal::Pack { slices, bins, .. }) => {
                assert_eq!(slices.iter().map(|s| s.name).collect::<Vec<_>>(), ["1g.10gb", "1g.10gb"]);
                assert_eq!(bins, &vec![vec![0, 1]]);
            }
            other => panic!("{other:?}"),
        }
        // Downsize to 1g.10gb: $3.60 × 6/7 for 1 h = $3.085714; × 730 = $2252.571429 (→ $2252.57).
        assert_eq!(recs[1].window_savings, Micros(3_085_714));
        assert_eq!(recs[1].monthly_savings_usd, Cents(225_257));
    }

    #[test]
    fn spot_and_rebalance_quota() {
        let mut g = gpu("GPU-s", "n0", "NVIDIA A100-SXM4-80GB", HOUR, 0);
        g.price = Some(Price {
            per_hour: Micros(4_000_000),
            kind: PriceKind::OnDemand,
            spot_per_hour: Some(Micros(1_500_000)),
        });
        let mut a = alloc("batch/etl", "analytics", vec![g]);
        a.interruptible = true;
        // A team stranding 2 GPUs for the whole hour while another waits for 4.
        let stranded = alloc(
            "ds/nb",
            "data-science",
            vec![
                gpu("GPU-x", "n1", "NVIDIA H100 80GB HBM3", HOUR, HOUR),
                gpu("GPU-y", "n1", "NVIDIA H100 80GB HBM3", HOUR, HOUR),
            ],
        );
        let pending = [Pending { team: "research".into(), gpus: 4, waited_us: 20 * MIN }];
        let recs = plan(&[a, stranded], &pending, &RecommendConfig::default(), HOUR).expect("plan");
        let spot = recs.iter().find(|r| r.kind == "spot").expect("spot");
        // ($4.00 − $1.50) × 1 h = $2.50.
        assert_eq!(spot.window_savings, Micros(2_500_000));
        let q = recs.iter().find(|r| r.kind == "rebalance-quota").expect("rebalance");
        // 2 GPU-hours stranded × $3.60 = $7.20, capacity.
        assert_eq!(
            (q.team.as_str(), q.window_savings, q.savings_kind),
            ("data-science", Micros(7_200_000), "capacity")
        );
        assert!(q.summary.contains("move 2 GPU(s)"), "{}", q.summary);
        // No queue, no rebalance.
        let recs = plan(&[], &[], &RecommendConfig::default(), HOUR).expect("plan");
        assert!(recs.is_empty());
    }
}
