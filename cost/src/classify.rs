//! Every GPU-second classified into exactly one state, per hour and team.
//!
//! # Input
//!
//! One GPU's [`Window`]s in time order. A window covers `(end_us − window_us, end_us]` and
//! carries the window maxima/means of `gpu_samples` plus its holder: an opaque
//! [`HolderId`], an index into the caller's list of [`Holder`]s (allocations with their
//! team and workload kind). A window whose start lies before the previous window's end is
//! clipped to start there (sources are de-duplicated upstream; this only defends).
//!
//! # Observation of a window
//!
//! - **idle** when `sm_active_max < idle_sm_active_max` (default 0.01) where SM activity is
//!   reported, else when `gpu_util_max <= idle_gpu_util_max` (default 0, i.e. `== 0`);
//! - **busy** when the deciding signal is above those thresholds; busy time is also
//!   **under-used** when `sm_active_mean < underused_sm_active_mean` (default 0.2). Without
//!   `sm_active_mean` busy time is never called under-used (no evidence);
//! - **unknown** when it has neither signal (NaN counts as absent). Time covered by no
//!   window at all (gaps, and everything outside the data) is unknown too.
//!
//! # States (exclusive; `underused` is a part of `active`)
//!
//! | holder | observation | state |
//! | --- | --- | --- |
//! | some | busy | `active` (+ `underused`) |
//! | some | idle | `stranded` if its idle run reaches `stranded_after`, else `allocated_idle` |
//! | none | busy | `unallocated_busy` |
//! | none | idle | `unallocated_idle` (never stranded: nobody holds it) |
//! | any | unknown | `unknown` |
//!
//! An **idle run** is a stretch of idle windows of the same holder, as the one rule in
//! [`crate::idlerun`] defines it: a gap (missing windows, or windows of the holder with
//! no signal) of at most `max_idle_gap` (default 2 min) inside it does not end it; a
//! longer gap, busy time or a change of holder does. Its length runs from its first idle
//! window's start to its last one's end, gaps included, and it is stranded **in full,
//! from its start**, when that length reaches (`>=`) the holder's `stranded_after`. The
//! gap's own seconds stay **unknown**: only the run's idle windows become stranded or
//! allocated idle.
//!
//! `stranded_after` is the default (30m), unless overridden for the holder's team
//! (`stranded_after_team`) or workload kind (`stranded_after_kind`); **the team override
//! wins when both apply**, because a team's policy is an explicit decision of the people who
//! own that work, whereas kind defaults are fleet-wide conventions.
//!
//! # Teams
//!
//! Time with a holder belongs to the holder's team (unknown time too, when the window that
//! carries no signal names a holder). Time with no holder, including gaps between windows,
//! belongs to [`UNALLOCATED`]. Callers that know an allocation through a sample gap (they
//! always do: `allocations` is independent of samples) should pass signal-less windows
//! carrying the holder, so that the team sees its own unknown time.
//!
//! # Incremental recompute
//!
//! See [`recompute_plan`]: the class of an instant depends only on data within the
//! largest `stranded_after` plus `max_idle_gap` on either side
//! ([`ClassifyConfig::context_us`]), which bounds both the hours to recompute after late
//! data and the context to read for them.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize};

use crate::idlerun::{Activity, IdleRun, IdleRuns};
use crate::time::{US_PER_HOUR, hour_ceil, hour_floor};

/// The team of time no allocation holds.
pub const UNALLOCATED: &str = "unallocated";

/// Why a classification could not be done.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ClassifyError {
    #[error(
        "window {index} ends at {end_us}, before the previous window's end {prev_end_us}: windows must be in time order"
    )]
    OutOfOrder { index: usize, end_us: i64, prev_end_us: i64 },
    #[error("window {index} names holder {holder}, but only {holders} holders were given")]
    UnknownHolder { index: usize, holder: usize, holders: usize },
    #[error("range [{from_us}, {to_us}) must be non-empty and start and end on UTC hour boundaries")]
    BadRange { from_us: i64, to_us: i64 },
    #[error("config: {0}")]
    Config(String),
}

/// An opaque allocation key: an index into the caller's holder list.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct HolderId(pub usize);

/// What the classifier needs to know about an allocation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    pub team: String,
    pub workload_kind: Option<String>,
}

/// One `gpu_samples` window of one GPU (or MIG instance).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Window {
    pub end_us: i64,
    pub window_us: i64,
    pub sm_active_max: Option<f64>,
    pub gpu_util_max: Option<f64>,
    pub sm_active_mean: Option<f64>,
    pub holder: Option<HolderId>,
}

/// Thresholds and stranded policy (TOML, `deny_unknown_fields`, durations humantime).
///
/// ```toml
/// idle_sm_active_max = 0.01
/// idle_gpu_util_max = 0.0
/// underused_sm_active_mean = 0.2
/// stranded_after = "30m"
/// stranded_after_team = { research = "2h" }
/// stranded_after_kind = { notebook = "1h", inference = "4h" }
/// max_idle_gap = "2m"
/// ```
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClassifyConfig {
    pub idle_sm_active_max: f64,
    pub idle_gpu_util_max: f64,
    pub underused_sm_active_mean: f64,
    #[serde(deserialize_with = "de_duration")]
    pub stranded_after: Duration,
    #[serde(deserialize_with = "de_duration_map")]
    pub stranded_after_team: BTreeMap<String, Duration>,
    #[serde(deserialize_with = "de_duration_map")]
    pub stranded_after_kind: BTreeMap<String, Duration>,
    /// The longest gap (missing windows, or windows without a signal) an idle run
    /// continues across ([`crate::idlerun`]); default 2 min, `"0s"`: only back-to-back
    /// windows.
    #[serde(deserialize_with = "de_duration")]
    pub max_idle_gap: Duration,
}

impl Default for ClassifyConfig {
    fn default() -> Self {
        ClassifyConfig {
            idle_sm_active_max: 0.01,
            idle_gpu_util_max: 0.0,
            underused_sm_active_mean: 0.2,
            stranded_after: Duration::from_secs(30 * 60),
            stranded_after_team: BTreeMap::new(),
            stranded_after_kind: BTreeMap::new(),
            max_idle_gap: DEFAULT_MAX_IDLE_GAP,
        }
    }
}

/// `max_idle_gap`'s default: why 2 minutes is said in [`crate::idlerun`].
pub const DEFAULT_MAX_IDLE_GAP: Duration = Duration::from_secs(120);

/// A window's activity signal that the idle rule reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Signal {
    /// The window's maximum SM activity (DCGM's `SM_ACTIVE`, or GPM), ratio 0–1.
    SmActiveMax,
    /// The window's maximum NVML utilisation (a coarser, sampled signal), ratio 0–1.
    GpuUtilMax,
}

impl Signal {
    /// The `gpu_samples` column that carries the signal.
    pub const fn column(self) -> &'static str {
        match self {
            Signal::SmActiveMax => "sm_active_max",
            Signal::GpuUtilMax => "gpu_util_max",
        }
    }

    fn of(self, w: &Window) -> Option<f64> {
        match self {
            Signal::SmActiveMax => w.sm_active_max,
            Signal::GpuUtilMax => w.gpu_util_max,
        }
    }
}

/// How a signal compares with its threshold when the window is idle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cmp {
    Below,
    AtMost,
}

/// One step of the idle rule: idle when `signal` `cmp` `threshold`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct IdleTest {
    pub signal: Signal,
    pub cmp: Cmp,
    pub threshold: f64,
}

impl IdleTest {
    pub fn holds(&self, v: f64) -> bool {
        match self.cmp {
            Cmp::Below => v < self.threshold,
            Cmp::AtMost => v <= self.threshold,
        }
    }
}

impl ClassifyConfig {
    /// The idle rule, the one definition behind [`window_is_idle`] and
    /// [`ClassifyConfig::idle_sql`]: the first test whose signal the window has decides;
    /// a window with neither signal is unknown.
    pub fn idle_rule(&self) -> [IdleTest; 2] {
        [
            IdleTest { signal: Signal::SmActiveMax, cmp: Cmp::Below, threshold: self.idle_sm_active_max },
            IdleTest { signal: Signal::GpuUtilMax, cmp: Cmp::AtMost, threshold: self.idle_gpu_util_max },
        ]
    }

    /// The idle rule as an SQL expression over a `gpu_samples` row: true (idle), false
    /// (busy) or NULL (no signal), generated from [`ClassifyConfig::idle_rule`]. Stored
    /// signals are never NaN, so `IS NOT NULL` is the classifier's "finite"; thresholds
    /// are finite ([`ClassifyConfig::validate`]), so `{}` writes a valid literal.
    pub fn idle_sql(&self) -> String {
        let arms: Vec<String> = self
            .idle_rule()
            .iter()
            .map(|t| {
                let (c, op) = (t.signal.column(), if t.cmp == Cmp::Below { "<" } else { "<=" });
                format!("WHEN {c} IS NOT NULL THEN CAST({c} AS DOUBLE) {op} {}", t.threshold)
            })
            .collect();
        format!("(CASE {} END)", arms.join(" "))
    }
}

pub(crate) fn de_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let s = String::deserialize(d)?;
    humantime::parse_duration(&s).map_err(serde::de::Error::custom)
}

fn de_duration_map<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<String, Duration>, D::Error> {
    let m = BTreeMap::<String, String>::deserialize(d)?;
    m.into_iter()
        .map(|(k, v)| humantime::parse_duration(&v).map(|d| (k, d)).map_err(serde::de::Error::custom))
        .collect()
}

pub(crate) fn duration_us(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

impl ClassifyConfig {
    /// Parses the TOML shape shown on the type and checks it.
    pub fn from_toml(text: &str) -> Result<ClassifyConfig, ClassifyError> {
        let c: ClassifyConfig = toml::from_str(text).map_err(|e| ClassifyError::Config(e.to_string()))?;
        c.validate()?;
        Ok(c)
    }

    /// Thresholds must be finite ratios and every `stranded_after` positive.
    pub fn validate(&self) -> Result<(), ClassifyError> {
        for (name, v) in [
            ("idle_sm_active_max", self.idle_sm_active_max),
            ("idle_gpu_util_max", self.idle_gpu_util_max),
            ("underused_sm_active_mean", self.underused_sm_active_mean),
        ] {
            if !v.is_finite() || v < 0.0 {
                return Err(ClassifyError::Config(format!("{name} must be a finite number >= 0")));
            }
        }
        let all = std::iter::once(&self.stranded_after)
            .chain(self.stranded_after_team.values())
            .chain(self.stranded_after_kind.values());
        if all.into_iter().any(|d| d.is_zero()) {
            return Err(ClassifyError::Config("every stranded_after must be positive".into()));
        }
        Ok(())
    }

    /// `stranded_after` for a holder, in µs: team override, else kind override, else default.
    pub fn stranded_after_us(&self, holder: &Holder) -> i64 {
        let d = self
            .stranded_after_team
            .get(&holder.team)
            .or_else(|| holder.workload_kind.as_ref().and_then(|k| self.stranded_after_kind.get(k)))
            .unwrap_or(&self.stranded_after);
        duration_us(*d)
    }

    /// The largest `stranded_after` any holder can get: the context radius of a class.
    pub fn max_stranded_after_us(&self) -> i64 {
        std::iter::once(&self.stranded_after)
            .chain(self.stranded_after_team.values())
            .chain(self.stranded_after_kind.values())
            .map(|d| duration_us(*d))
            .max()
            .unwrap_or(0)
    }

    /// `max_idle_gap` in µs.
    pub fn max_idle_gap_us(&self) -> i64 {
        duration_us(self.max_idle_gap)
    }

    /// The context radius of a class ([`recompute_plan`]): the largest `stranded_after`
    /// plus `max_idle_gap` (a run's link across a gap is seen only with the gap's far
    /// side).
    pub fn context_us(&self) -> i64 {
        self.max_stranded_after_us().saturating_add(self.max_idle_gap_us())
    }
}

/// The exclusive states of `gpu_cost_hourly`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    Active,
    AllocatedIdle,
    Stranded,
    UnallocatedIdle,
    UnallocatedBusy,
    Unknown,
}

impl State {
    pub const ALL: [State; 6] = [
        State::Active,
        State::AllocatedIdle,
        State::Stranded,
        State::UnallocatedIdle,
        State::UnallocatedBusy,
        State::Unknown,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            State::Active => "active",
            State::AllocatedIdle => "allocated_idle",
            State::Stranded => "stranded",
            State::UnallocatedIdle => "unallocated_idle",
            State::UnallocatedBusy => "unallocated_busy",
            State::Unknown => "unknown",
        }
    }

    /// Whether the state is priced as idle (`idle_cost_usd`).
    pub fn is_idle(self) -> bool {
        matches!(self, State::AllocatedIdle | State::Stranded | State::UnallocatedIdle)
    }
}

/// A classified stretch of time `[start_us, end_us)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    pub start_us: i64,
    pub end_us: i64,
    pub state: State,
    /// Only ever true for `Active`.
    pub underused: bool,
    pub holder: Option<HolderId>,
}

/// A stranded idle run, in full (clipped only to the data given, not to the range): from
/// its first idle window's start to its last one's end, short gaps inside included.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StrandedRun {
    pub holder: HolderId,
    pub start_us: i64,
    pub end_us: i64,
}

/// Microseconds per state (exclusive) plus `underused` (a part of `active`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct StateMicros {
    pub active: i64,
    pub allocated_idle: i64,
    pub stranded: i64,
    pub unallocated_idle: i64,
    pub unallocated_busy: i64,
    pub unknown: i64,
    pub underused: i64,
}

impl StateMicros {
    pub fn add(&mut self, state: State, underused: bool, us: i64) {
        *self.slot(state) += us;
        if underused && state == State::Active {
            self.underused += us;
        }
    }

    fn slot(&mut self, state: State) -> &mut i64 {
        match state {
            State::Active => &mut self.active,
            State::AllocatedIdle => &mut self.allocated_idle,
            State::Stranded => &mut self.stranded,
            State::UnallocatedIdle => &mut self.unallocated_idle,
            State::UnallocatedBusy => &mut self.unallocated_busy,
            State::Unknown => &mut self.unknown,
        }
    }

    pub fn get(&self, state: State) -> i64 {
        match state {
            State::Active => self.active,
            State::AllocatedIdle => self.allocated_idle,
            State::Stranded => self.stranded,
            State::UnallocatedIdle => self.unallocated_idle,
            State::UnallocatedBusy => self.unallocated_busy,
            State::Unknown => self.unknown,
        }
    }

    /// Sum of the exclusive states (not `underused`).
    pub fn total(&self) -> i64 {
        State::ALL.iter().map(|s| self.get(*s)).sum()
    }

    /// Every second except unknown.
    pub fn known(&self) -> i64 {
        self.total() - self.unknown
    }

    pub fn idle(&self) -> i64 {
        self.allocated_idle + self.stranded + self.unallocated_idle
    }
}

/// One `(hour, team)` cell of one GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HourTeam {
    pub hour_us: i64,
    pub team: String,
    pub micros: StateMicros,
}

/// The classification of one GPU over `[from_us, to_us)`.
#[derive(Clone, Debug, PartialEq)]
pub struct Classified {
    pub from_us: i64,
    pub to_us: i64,
    /// Covers `[from_us, to_us)` exactly, in order, without gaps or overlaps.
    pub spans: Vec<Span>,
    /// Stranded runs that overlap the range (in full).
    pub stranded_runs: Vec<StrandedRun>,
    /// Team per holder index (copied so hourly output needs nothing else).
    teams: Vec<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Obs {
    Unknown,
    Idle,
    Busy { underused: bool },
}

#[derive(Clone, Copy, Debug)]
struct Seg {
    start: i64,
    end: i64,
    obs: Obs,
    holder: Option<HolderId>,
}

/// What a window says about the GPU: `Some(true)` idle, `Some(false)` busy, `None`
/// unknown (no signal) — the classifier's own rule, for callers that track runs live.
pub fn window_is_idle(w: &Window, cfg: &ClassifyConfig) -> Option<bool> {
    match observe(w, cfg) {
        Obs::Unknown => None,
        Obs::Idle => Some(true),
        Obs::Busy { .. } => Some(false),
    }
}

fn finite(v: Option<f64>) -> Option<f64> {
    v.filter(|x| x.is_finite())
}

fn observe(w: &Window, cfg: &ClassifyConfig) -> Obs {
    let Some(idle) = cfg.idle_rule().iter().find_map(|t| finite(t.signal.of(w)).map(|v| t.holds(v))) else {
        return Obs::Unknown;
    };
    if idle {
        return Obs::Idle;
    }
    let underused = finite(w.sm_active_mean).is_some_and(|m| m < cfg.underused_sm_active_mean);
    Obs::Busy { underused }
}

/// Classifies one GPU's windows over the hour-aligned range `[from_us, to_us)`.
///
/// Pass windows from `[from − S, to + S)` (S = [`ClassifyConfig::context_us`])
/// so that runs crossing the range edges are judged right; see [`recompute_plan`].
pub fn classify(
    windows: &[Window],
    holders: &[Holder],
    cfg: &ClassifyConfig,
    from_us: i64,
    to_us: i64,
) -> Result<Classified, ClassifyError> {
    if from_us >= to_us || hour_floor(from_us) != from_us || hour_floor(to_us) != to_us {
        return Err(ClassifyError::BadRange { from_us, to_us });
    }
    // 1. Windows -> contiguous observed segments (gaps stay implicit).
    let mut segs: Vec<Seg> = Vec::with_capacity(windows.len());
    let mut prev_end = i64::MIN;
    for (index, w) in windows.iter().enumerate() {
        if w.end_us < prev_end {
            return Err(ClassifyError::OutOfOrder { index, end_us: w.end_us, prev_end_us: prev_end });
        }
        if let Some(h) = w.holder
            && h.0 >= holders.len()
        {
            return Err(ClassifyError::UnknownHolder { index, holder: h.0, holders: holders.len() });
        }
        if w.window_us <= 0 {
            continue; // covers no time
        }
        let start = w.end_us.saturating_sub(w.window_us).max(prev_end);
        prev_end = w.end_us;
        if start >= w.end_us {
            continue; // wholly inside the previous window
        }
        segs.push(Seg { start, end: w.end_us, obs: observe(w, cfg), holder: w.holder });
    }

    // 2. Idle runs -> per-segment state.
    let mut states: Vec<State> = segs
        .iter()
        .map(|s| match (s.obs, s.holder) {
            (Obs::Unknown, _) => State::Unknown,
            (Obs::Busy { .. }, Some(_)) => State::Active,
            (Obs::Busy { .. }, None) => State::UnallocatedBusy,
            (Obs::Idle, None) => State::UnallocatedIdle,
            (Obs::Idle, Some(_)) => State::AllocatedIdle,
        })
        .collect();
    // The one idle-run rule (crate::idlerun): runs of one holder across short gaps.
    let mut stranded_runs = Vec::new();
    let mut close = |run: IdleRun<Option<HolderId>>, members: &[usize], states: &mut [State]| {
        let Some(h) = run.holder else { return }; // nobody's idle is never stranded
        // `h` was range-checked above.
        let limit = holders.get(h.0).map_or(i64::MAX, |hd| cfg.stranded_after_us(hd));
        if run.len_us() >= limit {
            members.iter().for_each(|&k| states[k] = State::Stranded);
            if run.end_us > from_us && run.start_us < to_us {
                stranded_runs.push(StrandedRun { holder: h, start_us: run.start_us, end_us: run.end_us });
            }
        }
    };
    let mut runs = IdleRuns::new(cfg.max_idle_gap_us());
    let mut members: Vec<usize> = Vec::new();
    for (k, seg) in segs.iter().enumerate() {
        let activity = match seg.obs {
            Obs::Idle => Activity::Idle,
            Obs::Busy { .. } => Activity::Busy,
            Obs::Unknown => Activity::NoSignal,
        };
        if let Some(ended) = runs.feed(seg.start, seg.end, seg.holder, activity) {
            close(ended, &members, &mut states);
            members.clear();
        }
        if activity == Activity::Idle {
            members.push(k);
        }
    }
    if let Some(ended) = runs.finish() {
        close(ended, &members, &mut states);
    }

    // 3. Clip to the range, filling gaps with unknown / no holder, merging equal neighbours.
    let mut spans: Vec<Span> = Vec::new();
    let push = |spans: &mut Vec<Span>, s: Span| {
        if s.start_us >= s.end_us {
            return;
        }
        if let Some(last) = spans.last_mut()
            && last.end_us == s.start_us
            && (last.state, last.underused, last.holder) == (s.state, s.underused, s.holder)
        {
            last.end_us = s.end_us;
            return;
        }
        spans.push(s);
    };
    let mut cursor = from_us;
    for (seg, state) in segs.iter().zip(&states) {
        if seg.end <= from_us {
            continue;
        }
        if seg.start >= to_us {
            break;
        }
        let (s, e) = (seg.start.max(from_us), seg.end.min(to_us));
        if s > cursor {
            push(
                &mut spans,
                Span { start_us: cursor, end_us: s, state: State::Unknown, underused: false, holder: None },
            );
        }
        let underused = matches!(seg.obs, Obs::Busy { underused: true }) && *state == State::Active;
        push(&mut spans, Span { start_us: s, end_us: e, state: *state, underused, holder: seg.holder });
        cursor = e;
    }
    if cursor < to_us {
        push(
            &mut spans,
            Span { start_us: cursor, end_us: to_us, state: State::Unknown, underused: false, holder: None },
        );
    }
    Ok(Classified { from_us, to_us, spans, stranded_runs, teams: holders.iter().map(|h| h.team.clone()).collect() })
}

impl Classified {
    /// The team a span's time belongs to.
    pub fn team_of(&self, holder: Option<HolderId>) -> &str {
        holder.and_then(|h| self.teams.get(h.0)).map_or(UNALLOCATED, String::as_str)
    }

    /// Exclusive microseconds per state for every `(hour, team)` of the range, sorted by
    /// hour then team. Every hour's cells add up to exactly 3 600 000 000 µs.
    pub fn hourly(&self) -> Vec<HourTeam> {
        let mut cells: BTreeMap<(i64, &str), StateMicros> = BTreeMap::new();
        for sp in &self.spans {
            let team = self.team_of(sp.holder);
            let mut s = sp.start_us;
            while s < sp.end_us {
                let hour = hour_floor(s);
                let e = sp.end_us.min(hour.saturating_add(US_PER_HOUR));
                cells.entry((hour, team)).or_default().add(sp.state, sp.underused, e - s);
                s = e;
            }
        }
        cells.into_iter().map(|((hour_us, team), micros)| HourTeam { hour_us, team: team.to_owned(), micros }).collect()
    }
}

/// What to recompute after samples in `[changed_from_us, changed_to_us)` changed (late
/// data, a backfill, a corrected holder), and which samples that needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecomputePlan {
    /// Hours `[hours_from_us, hours_to_us)` whose rows may change.
    pub hours_from_us: i64,
    pub hours_to_us: i64,
    /// Windows intersecting `[data_from_us, data_to_us)` are all the context needed.
    pub data_from_us: i64,
    pub data_to_us: i64,
}

/// The incremental-recompute contract.
///
/// **Claim.** Let S = [`ClassifyConfig::context_us`] = M + G, M the largest
/// `stranded_after`, G = `max_idle_gap`. The state of an instant `t` depends only on the
/// windows intersecting `[t − S, t + S]`.
///
/// **Proof.** A state is a function of (a) the observation and holder of the window
/// covering `t` — local — and, only for allocated idle time, (b) whether the idle run
/// containing `t` has length `L = l + r >= S_h`, where `l` / `r` are the run's extents to
/// the left / right of `t` and `S_h <= M` is the holder's threshold. Runs are delimited by
/// local facts ([`crate::idlerun`]): a busy window or another holder's window, which is
/// where the run ends, or a gap longer than G after a run's last idle window. Walking
/// left from `t` through the run: if it reaches past `t − M` then `l >= M`; otherwise its
/// first idle window starts at some `p > t − M`, and what ended it there — a window of
/// another kind, or the absence of a same-holder idle window ending in `[p − G, p)` — lies
/// in `[p − G, p) ⊂ [t − S, t]`, so `l = t − p` is known exactly. The same holds on the
/// right. If either capped extent is M then `L >= M >= S_h` (stranded); otherwise `L` is
/// known exactly. Either way the comparison with `S_h` is decided. ∎
///
/// **Truncated data gives the same answer.** [`classify`] treats the edge of the data it is
/// given as the end of a run. For `t` with `[t − S, t + S]` inside the data a run cut at the
/// left edge `X <= t − S` still has `l >= t − X >= S >= M`, so it is stranded exactly when
/// it would be with all data; likewise on the right.
///
/// **Consequences.** A change inside `[a, b)` can alter the state only of instants in
/// `(a − S, b + S)`, so the hours to recompute are `[floor_h(a − S), ceil_h(b + S))`, and
/// computing those hours needs the windows intersecting `[hours_from − S, hours_to + S)`.
/// A run that keeps growing at the live edge is the special case `b = now`: its hours are
/// rewritten each time until it ends (allocated idle that becomes stranded in full).
pub fn recompute_plan(changed_from_us: i64, changed_to_us: i64, cfg: &ClassifyConfig) -> RecomputePlan {
    let s = cfg.context_us();
    let (a, b) = (changed_from_us.min(changed_to_us), changed_from_us.max(changed_to_us));
    let hours_from_us = hour_floor(a.saturating_sub(s));
    let hours_to_us = hour_ceil(b.saturating_add(s)).max(hours_from_us + US_PER_HOUR);
    RecomputePlan {
        hours_from_us,
        hours_to_us,
        data_from_us: hours_from_us.saturating_sub(s),
        data_to_us: hours_to_us.saturating_add(s),
    }
}

#[cfg(test)]
mod tests;
