//! The cost ledger: `gpu_samples` windows (with who held each GPU) → the `allocations`
//! and `gpu_cost_hourly` partitions, priced by the price book, recomputed from new data
//! only.
//!
//! ```text
//!  every [cost] interval (default 5m), one pass at a time:
//!    take the store's change feed: per (table, day), the span of row times ingested
//!    for each UTC day D with raw gpu_samples (files or memtable) within raw retention:
//!      computed by this process (a memo; today and yesterday):
//!        unseen = min(newest time read last time, earliest ingested time that can
//!                 affect D)            — nothing: skip (a past day's open runs: refresh)
//!        F      = floor_h(unseen − S)  — hours ≥ F are recomputed, earlier ones kept
//!      otherwise (first pass since start-up, or the day's files / price book /
//!      thresholds changed): F = D, the whole day — over more than `catch_up_step`
//!        (2 h) in steps: the passes the clock would have run at D + 2 h, D + 4 h, …,
//!        now, each step's rows held in memory for the next, stored after the last
//!      per GPU (MIG parents excluded: instances carry cost), windows in
//!        (F − S, min(D + 1 d + S, now)]   S = the longest stranded_after + max_idle_gap
//!                                          (the context, ClassifyConfig::context_us)
//!      → apron_cost::classify over [F, now's hour] (holders from the owner columns,
//!        teams resolved in the brief's order, static GPU/host maps as dedicated
//!        allocations) → apron_cost::hourly_cost → gpu_cost_hourly rows
//!      → apron_cost::holder_runs that start in D → allocations rows (end_time from a
//!        forward look when the run outlives the window; NULL while still held;
//!        held_through: the end of the run's newest window seen), merged with the
//!        stored runs that began before the windows read
//!      Store::replace_partition(gpu_cost_hourly, D) (kept hours + new) and (allocations, D),
//!      once per pass and day
//! ```
//!
//! Why the context S: a window's state depends only on data within S of it (the
//! classifier's `recompute_plan` proves it; S includes `max_idle_gap` because an idle run
//! continues across a gap that short, `apron_cost::idlerun`), so a day computed with S
//! either side is exact, and so are the hours from F on when nothing before `unseen`
//! changed. A pass
//! over today reads about 2·S plus an hour of windows per GPU instead of the whole day;
//! `server/tests/server/incremental.rs` checks, on a 27-hour trace with late batches,
//! silent and new GPUs, MIG and process owners, that the rows equal a whole computation.
//! Money is exact micro-dollars from the classifier's exact microseconds; nothing is a
//! float once classified. A GPU whose model has no price gets NULL money (reported,
//! never $0).
//!
//! This module orchestrates: it reads through the engine, calls `apron_cost`'s rules
//! (owners, classification, runs, prices) and writes partitions. `rows` builds the two
//! tables' Arrow batches; `metrics` serves the stored totals on `/metrics`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use apron_collector::changes::{ChangeFeed, Changed};
use apron_collector::{Store, Table};
use apron_common::UnixMicros;
use apron_cost::{
    ClassifyConfig, GpuKey, Holder, HolderId, PROCESS_SAMPLE_REACH_US, PriceBook, ProcessUsers, Resolved, TeamConfig,
    Window,
};
use apron_query::{QueryEngine, TableSource};

use crate::sqlutil::{
    OWNER_COLUMNS_SQL, Owner, SqlError, gpus_excluded_sql, owner_at, run_key, sql_str, str_list, strings, ts,
};
use datafusion::arrow::array::{Array, AsArray, RecordBatch};
use datafusion::arrow::datatypes::{Float64Type, TimestampMicrosecondType};
use serde::{Deserialize, Serialize};

const DAY_US: i64 = 86_400_000_000;

/// `[cost]`: the ledger's settings.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CostConfig {
    pub enabled: bool,
    #[serde(with = "apron_common::duration::at_least_1s")]
    pub interval: Duration,
    /// The price book (TOML). None: every hour's money is NULL (unpriced), seconds are
    /// still classified.
    pub price_book: Option<PathBuf>,
    /// Idle / under-used thresholds and `stranded_after` (with overrides).
    pub classify: ClassifyConfig,
    /// Team resolution maps, workload-kind and interruptible rules.
    pub teams: TeamConfig,
    /// GPUs whose windows one query reads (fewer when their windows would exceed
    /// `windows_per_query` at one per second): one scan serves them all.
    pub gpus_per_query: usize,
    /// The most 1-second windows one query reads: what bounds a pass's memory (~200 B
    /// per window while a slice is read and parsed: 250,000 ≈ 50 MB). A whole day is
    /// 86,400 windows per GPU (2 GPUs a query); a catch-up step reads ~3.5 h per GPU
    /// (19 GPUs), an incremental pass ~1.5 h (the full `gpus_per_query`).
    pub windows_per_query: u64,
    /// A day computed whole over more than this (the first pass after a start-up or a
    /// restore, a new price book) is caught up in steps of this length, each reading
    /// only its own hours' files — a day at once makes every query read every file of
    /// the day (tier-0 files hold every GPU for a few minutes) — and stored once, after
    /// the last step, so that a report never sees part of a day. At least
    /// `max(2 × S, S + 1 h)`, S the longest `stranded_after` (each step reads again
    /// from an hour boundary S before the step before's end); `0s`: a day at once.
    #[serde(with = "apron_common::duration")]
    pub catch_up_step: Duration,
}

impl Default for CostConfig {
    fn default() -> Self {
        CostConfig {
            enabled: true,
            interval: Duration::from_secs(300),
            price_book: None,
            classify: ClassifyConfig::default(),
            teams: TeamConfig::default(),
            gpus_per_query: 64,
            windows_per_query: 250_000,
            catch_up_step: Duration::from_secs(2 * 3600),
        }
    }
}

/// What one pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LedgerReport {
    /// `(date, gpu_cost_hourly rows, allocations rows)` of the days recomputed.
    pub computed: Vec<(String, usize, usize)>,
    /// How each day in `computed` was computed (same order).
    pub plans: Vec<Plan>,
    pub errors: Vec<String>,
}

/// How much of a day a pass computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    /// Nothing changed.
    Nothing,
    /// Every hour and allocation (first pass over the day since start-up, or its
    /// inputs changed in a way the rows kept cannot absorb).
    Whole,
    /// The hours from `from_us` on, and the allocations they touch.
    From(Incremental),
    /// Only the open allocations of a past day (their holder may have let go since).
    OpenRuns,
}

impl Plan {
    /// For the log: `whole`, `from 14:00`, `open runs`.
    pub fn describe(&self) -> String {
        match self {
            Plan::Nothing => "nothing".into(),
            Plan::Whole => "whole".into(),
            Plan::From(i) => format!("from {}", &UnixMicros(i.from_us).to_rfc3339()[11..16]),
            Plan::OpenRuns => "open runs".into(),
        }
    }
}

/// `<data>/derived/cost.json`: per day, the raw files it was computed from.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
struct LedgerState {
    /// Price book version and settings the days were computed with.
    key: String,
    days: BTreeMap<i64, Vec<(String, u64)>>,
}

pub const STATE_FILE: &str = "derived/cost.json";

/// The ledger over a store and its engine.
#[derive(Debug)]
pub struct Ledger {
    store: Arc<Store>,
    engine: Arc<QueryEngine>,
    config: CostConfig,
    book: Option<PriceBook>,
    /// One pass at a time; it holds the memos of the recent days it computed.
    pass: tokio::sync::Mutex<BTreeMap<i64, DayMemo>>,
    /// What ingest wrote since the last pass.
    feed: ChangeFeed,
    /// Asks the running loop for a pass now (e.g. when a backfill has landed).
    kick: tokio::sync::Notify,
}

/// Where a GPU is and what it is: from its first window in a day's range.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct GpuMeta {
    host: String,
    cluster: Option<String>,
    model: String,
    mig_profile: Option<String>,
}

/// One GPU's windows of the context range.
struct GpuWindows {
    meta: GpuMeta,
    windows: Vec<Window>,
    holders: Vec<Resolved>,
}

/// What this process remembers of a recent day it computed, so the next pass can
/// recompute only the hours that new data can change. Lost on restart (the first pass
/// then computes the day whole, as without it); one entry per GPU, for two days.
#[derive(Debug, Clone, Default)]
struct DayMemo {
    /// The data bound (newest window time read) and the hours bound of the last
    /// computation.
    hi_us: i64,
    to_us: i64,
    /// GPUs (and MIG parents with windows of their own) seen in the day's range, with
    /// their first window's metadata: a GPU listed here gets rows for every hour even
    /// when it has no window in the part read again (its hours are then unknown).
    meta: BTreeMap<String, GpuMeta>,
    /// MIG parents and their instances (uuid, profile) seen in the day's range.
    parents: BTreeMap<String, BTreeSet<(String, Option<String>)>>,
    /// `allocations` rows of the day left open (`end_time` NULL).
    open: usize,
}

/// Hours `[from_us, to)` of a day are recomputed; everything before is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Incremental {
    pub from_us: i64,
    /// Every window and process sample older than this was read by the computation
    /// whose rows are stored.
    pub unseen_from_us: i64,
}

/// A day as a pass sees it: `[day_start, day_end)`; windows are read up to `hi` (S
/// past the day, or now) and hours priced up to `to_us` (the end of now's hour).
#[derive(Debug, Clone, Copy)]
struct Bounds {
    day_start: i64,
    day_end: i64,
    hi: i64,
    to_us: i64,
}

/// How a day's computation failed.
/// What a ledger pass (or building the ledger) can fail with.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("price book {}: {detail}", path.display())]
    PriceBook { path: PathBuf, detail: String },
    #[error("[cost.{section}]: {detail}")]
    Config { section: &'static str, detail: String },
    #[error(transparent)]
    Sql(#[from] SqlError),
    #[error("classifying {uuid}: {detail}")]
    Classify { uuid: String, detail: String },
    #[error("pricing {uuid}: {detail}")]
    Price { uuid: String, detail: String },
    #[error("building {what}: {source}")]
    Arrow {
        what: &'static str,
        #[source]
        source: datafusion::arrow::error::ArrowError,
    },
    #[error("storing {date}: {detail}")]
    Store { date: String, detail: String },
    #[error("saving the ledger state: {0}")]
    State(#[from] crate::statefile::FileError),
}

enum DayError {
    /// What changed cannot be applied to the stored rows (a GPU became a MIG parent):
    /// compute the day whole.
    NeedsFull,
    Failed(LedgerError),
}

impl<E: Into<LedgerError>> From<E> for DayError {
    fn from(e: E) -> DayError {
        DayError::Failed(e.into())
    }
}

/// The memos kept: today's and yesterday's (late data for older days is rare, and the
/// first pass over them computes them whole).
const MEMO_DAYS: i64 = 2;

impl Ledger {
    /// Loads the price book (a bad one is an error: costs would be wrong).
    pub fn new(store: Arc<Store>, engine: Arc<QueryEngine>, config: CostConfig) -> Result<Ledger, LedgerError> {
        let book = match &config.price_book {
            None => {
                if config.enabled {
                    tracing::warn!(
                        "no price book ([cost] price_book): the ledger classifies GPU-seconds but every money \
                         column is NULL (unpriced); deploy/pricebook.example.toml shows the format"
                    );
                }
                None
            }
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .map_err(|e| LedgerError::PriceBook { path: p.clone(), detail: e.to_string() })?;
                let book = PriceBook::from_toml(&text)
                    .map_err(|e| LedgerError::PriceBook { path: p.clone(), detail: e.to_string() })?;
                if book.is_example() {
                    tracing::warn!(
                        path = %p.display(),
                        "the price book is the example one (example = true): dollars are examples, not your rates"
                    );
                }
                Some(book)
            }
        };
        config.classify.validate().map_err(|e| LedgerError::Config { section: "classify", detail: e.to_string() })?;
        config.teams.validate().map_err(|e| LedgerError::Config { section: "teams", detail: e.to_string() })?;
        let feed = store.subscribe_changes();
        Ok(Ledger {
            store,
            engine,
            config,
            book,
            pass: tokio::sync::Mutex::new(BTreeMap::new()),
            feed,
            kick: tokio::sync::Notify::new(),
        })
    }

    /// Day `day`'s bounds as the clock reads `now_us`.
    fn bounds(&self, day: i64, now_us: i64) -> Bounds {
        let s = self.config.classify.context_us();
        let (day_start, day_end) = (day * DAY_US, (day + 1) * DAY_US);
        Bounds {
            day_start,
            day_end,
            hi: (day_end + s).min(now_us.max(day_start)),
            // Hours of D up to the current hour's end.
            to_us: day_end.min(apron_cost::time::hour_ceil(now_us)).max(day_start),
        }
    }

    /// How many GPUs a query over `(lo, hi]` reads at once.
    fn gpus_per_query(&self, lo: i64, hi: i64) -> usize {
        let per_gpu = u64::try_from((hi - lo) / 1_000_000).unwrap_or(0);
        crate::sqlutil::gpus_per_read(self.config.gpus_per_query, self.config.windows_per_query, per_gpu)
    }

    /// Asks the running loop ([`Ledger::run`]) for a pass as soon as it can.
    pub fn kick(&self) {
        self.kick.notify_one();
    }

    /// Thresholds and `stranded_after` policy.
    /// The store the ledger reads (the recommender follows its change feed too).
    pub(crate) fn store(&self) -> &Arc<Store> {
        &self.store
    }

    pub(crate) fn classify_config(&self) -> &ClassifyConfig {
        &self.config.classify
    }

    /// Team maps and rules: who owns what.
    pub(crate) fn teams(&self) -> &TeamConfig {
        &self.config.teams
    }

    /// The price in force for a GPU (or slice) at `t_us`; `None` when unpriced.
    pub(crate) fn quote(&self, key: &GpuKey<'_>, t_us: i64) -> Option<apron_cost::Quote> {
        match self.book.as_ref()?.price_at(key, t_us) {
            Ok(apron_cost::Lookup::Priced(q)) => Some(q),
            _ => None,
        }
    }

    pub fn price_book(&self) -> Option<&PriceBook> {
        self.book.as_ref()
    }

    fn state_path(&self) -> PathBuf {
        self.store.data_dir().join(STATE_FILE)
    }

    fn key(&self) -> String {
        let version = self.book.as_ref().map_or("none", |b| b.version());
        format!("{version}|{:?}|{:?}", self.config.classify, self.config.teams)
    }

    /// One pass as if the clock read `now_us`.
    pub async fn run_once(&self, now_us: i64) -> LedgerReport {
        let mut memos = self.pass.lock().await;
        // Taken before anything is read: a row written from here on is either read by
        // this pass or reported to the next one (or both).
        let changed = self.feed.take();
        let mut report = LedgerReport::default();
        let path = self.state_path();
        let mut state: LedgerState =
            std::fs::read(&path).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default();
        let key = self.key();
        if state.key != key {
            state = LedgerState { key, days: BTreeMap::new() };
            memos.clear();
        }
        let raw = match TableSource::snapshot(self.store.as_ref(), Table::GpuSamples.name()) {
            Ok(r) => r,
            Err(e) => {
                report.errors.push(format!("listing gpu_samples: {e}"));
                return report;
            }
        };
        let mut in_memory = BTreeSet::new();
        for b in &raw.batches {
            if let Some(t) = b.column_by_name("time").and_then(|c| c.as_primitive_opt::<TimestampMicrosecondType>()) {
                for v in t.iter().flatten() {
                    in_memory.insert(v.div_euclid(DAY_US));
                }
            }
        }
        let mut files: BTreeMap<i64, Vec<(String, u64)>> = BTreeMap::new();
        for f in &raw.files {
            if let Some(d) = f.day {
                files.entry(d).or_default().push((f.path.to_string_lossy().into_owned(), f.bytes));
            }
        }
        let retention = i64::try_from(self.store.config().retention_raw.as_micros()).unwrap_or(i64::MAX);
        let oldest = now_us.saturating_sub(retention).div_euclid(DAY_US);
        let today = now_us.div_euclid(DAY_US);
        memos.retain(|d, _| *d > today - MEMO_DAYS);
        let days: BTreeSet<i64> =
            files.keys().chain(in_memory.iter()).copied().filter(|&d| d >= oldest && d * DAY_US <= now_us).collect();
        // Newest first: today's and yesterday's hours are what people look at first (a
        // fresh install's seeded history shows its dollars sooner).
        for day in days.into_iter().rev() {
            let signature: Vec<(String, u64)> =
                (day - 1..=day + 1).flat_map(|d| files.get(&d).cloned().unwrap_or_default()).collect();
            let memory = (day - 1..=day + 1).any(|d| in_memory.contains(&d));
            let memo = memos.remove(&day);
            let plan = match &memo {
                // Computed by this process: only what changed since, from the feed.
                Some(m) => match self.plan(day, now_us, m, &changed) {
                    Plan::Nothing => {
                        memos.insert(day, memo.unwrap_or_default());
                        continue;
                    }
                    p => p,
                },
                // Not since start-up: whole, when its inputs differ from what the
                // stored rows were computed from. Today is never final: its hours
                // advance with the clock.
                None if !memory && day != today && state.days.get(&day) == Some(&signature) => continue,
                None => Plan::Whole,
            };
            let date = crate::derive::date_string(day);
            let started = std::time::Instant::now();
            let mut result = match plan {
                Plan::Whole => self.compute_whole(day, now_us).await,
                _ => self.compute_day(day, now_us, plan, memo.clone(), Prior::Stored).await,
            };
            if matches!(result, Err(DayError::NeedsFull)) {
                result = self.compute_day(day, now_us, Plan::Whole, None, Prior::Stored).await;
            }
            let result = match result {
                Ok((rows, memo)) => self.store_day(&date, rows).await.map(|n| (n, memo)).map_err(DayError::Failed),
                Err(e) => Err(e),
            };
            match result {
                Ok(((cost_rows, alloc_rows), memo)) => {
                    let elapsed_ms = started.elapsed().as_millis() as u64;
                    let how = plan.describe();
                    tracing::info!(%date, %how, cost_rows, alloc_rows, elapsed_ms, "computed gpu_cost_hourly and allocations");
                    report.computed.push((date, cost_rows, alloc_rows));
                    report.plans.push(plan);
                    if !memory {
                        state.days.insert(day, signature);
                    }
                    if day > today - MEMO_DAYS {
                        memos.insert(day, memo);
                    }
                }
                Err(DayError::NeedsFull) => report.errors.push(format!("{date}: could not be computed whole")),
                Err(DayError::Failed(e)) => {
                    // No memo: the next pass computes the day whole, whatever it missed.
                    tracing::warn!(%date, error = %e, "cost ledger: day failed; retried at the next pass");
                    report.errors.push(format!("{date}: {e}"));
                }
            }
        }
        state.days.retain(|d, _| *d >= oldest);
        if let Err(e) = save_state(&path, &state) {
            report.errors.push(e.to_string());
        }
        report
    }

    /// What a day computed by this process needs now. A change at `t` can alter the
    /// state of instants within S of it (`apron_cost::recompute_plan`), so hours from
    /// `floor_h(t − S)` on are recomputed; data newer than the last computation's bound
    /// counts as changed. Process samples speak for windows after them, so they count
    /// at their own time.
    fn plan(&self, day: i64, now_us: i64, memo: &DayMemo, changed: &Changed) -> Plan {
        let s = self.config.classify.context_us();
        let Bounds { day_start, hi, to_us, .. } = self.bounds(day, now_us);
        let mut unseen = memo.hi_us;
        for table in [Table::GpuSamples, Table::GpuProcesses] {
            for d in day - 1..=day + 1 {
                if let Some(span) = changed.day(table, d)
                    && span.max_us > day_start - s - PROCESS_SAMPLE_REACH_US
                    && span.min_us <= hi
                {
                    unseen = unseen.min(span.min_us);
                }
            }
        }
        if unseen >= hi && hi == memo.hi_us && to_us == memo.to_us {
            // Nothing new can change the hours; open allocations of a past day still
            // follow their holder into the next one.
            return if memo.open > 0 && hi < now_us { Plan::OpenRuns } else { Plan::Nothing };
        }
        let from_us = apron_cost::time::hour_floor(unseen.saturating_sub(s)).max(day_start);
        if from_us == day_start {
            return Plan::Whole;
        }
        Plan::From(Incremental { from_us: from_us.min(to_us), unseen_from_us: unseen })
    }

    /// A day computed whole: at once, or — over more than `[cost] catch_up_step` — in
    /// steps, as successive passes would have computed it had the clock stood at each
    /// step's end (the path `server/tests/server/incremental.rs` proves equal to a whole
    /// computation), each step keeping the rows of the one before from memory. Nothing
    /// is stored until the last step.
    async fn compute_whole(&self, day: i64, now_us: i64) -> Result<(DayRows, DayMemo), DayError> {
        let s = self.config.classify.context_us();
        let step = i64::try_from(self.config.catch_up_step.as_micros()).unwrap_or(i64::MAX);
        let Bounds { day_start, hi, .. } = self.bounds(day, now_us);
        // Each step reads again the hours from `floor_h(previous end − S)` and S before
        // them: a step shorter than S + 1 h would go back to midnight every time.
        let step = if step == 0 { step } else { step.max(2 * s).max(s + apron_cost::time::US_PER_HOUR) };
        if step == 0 || hi - day_start <= step {
            return self.compute_day(day, now_us, Plan::Whole, None, Prior::Stored).await;
        }
        let date = crate::derive::date_string(day);
        let started = std::time::Instant::now();
        let (mut rows, mut memo) = self.compute_day(day, day_start + step, Plan::Whole, None, Prior::Stored).await?;
        let mut t = day_start + step;
        while t < now_us {
            // The last step is the pass itself (its clock, its bounds).
            t = if t + step < hi { t + step } else { now_us };
            let plan = self.plan(day, t, &memo, &Changed::default());
            if plan == Plan::Nothing {
                continue;
            }
            let whole = plan == Plan::Whole;
            (rows, memo) = self.compute_day(day, t, plan, (!whole).then_some(memo), Prior::Held(&rows)).await?;
            // Progress: a day of a large fleet takes minutes to catch up.
            let through = UnixMicros(t.min(hi)).to_rfc3339();
            let elapsed_ms = started.elapsed().as_millis() as u64;
            tracing::info!(%date, %through, elapsed_ms, "cost ledger: catching up a day (stored when complete)");
        }
        Ok((rows, memo))
    }

    async fn query(&self, sql: &str) -> Result<Vec<RecordBatch>, LedgerError> {
        Ok(crate::sqlutil::batches(&self.engine, sql).await?)
    }

    /// Recomputes day `day`'s rows of `gpu_cost_hourly` and `allocations` as `plan`
    /// says, starting from `memo` (what this process knew of the day; `None` for a
    /// whole computation) and the rows of `prior`. Returns the day's rows and new memo.
    async fn compute_day(
        &self,
        day: i64,
        now_us: i64,
        plan: Plan,
        memo: Option<DayMemo>,
        prior: Prior<'_>,
    ) -> Result<(DayRows, DayMemo), DayError> {
        let s = self.config.classify.context_us();
        let Bounds { day_start, day_end, hi, to_us } = self.bounds(day, now_us);
        let inc = match (plan, memo) {
            (Plan::From(i), Some(m)) => Some((i, m)),
            (Plan::OpenRuns, Some(m)) => return self.refresh_open_runs(day, hi, now_us, m, prior).await,
            _ => None,
        };
        let from_us = inc.as_ref().map_or(day_start, |(i, _)| i.from_us);
        let (lo, full_lo) = (from_us - s, day_start - s);
        let range = range_sql(lo, hi);
        let mut memo = inc.as_ref().map(|(_, m)| m.clone()).unwrap_or_default();
        let unseen = inc.as_ref().map(|(i, _)| i.unseen_from_us);

        // MIG: an instance seen for the first time changes its parent's free share for
        // the whole day, so such a parent is recomputed whole.
        let mut regrown = BTreeSet::new();
        for (parent, instances) in self.mig_instances(&range).await? {
            let known = memo.parents.contains_key(&parent);
            if unseen.is_some() && !known && memo.meta.contains_key(&parent) {
                // Priced as a GPU of its own until now.
                return Err(DayError::NeedsFull);
            }
            let set = memo.parents.entry(parent.clone()).or_default();
            let before = set.len();
            set.extend(instances);
            if set.len() != before {
                regrown.insert(parent);
            }
        }
        let mut gpus: BTreeSet<String> = memo.meta.keys().cloned().collect();
        gpus.extend(strings(&self.engine, &format!("SELECT DISTINCT gpu_uuid FROM gpu_samples WHERE {range}")).await?);
        let mut cost = CostRows::default();
        let mut allocs = AllocRows::default();
        let (mut kept_cost, mut stored) = (Vec::new(), BTreeMap::new());
        if inc.is_some() {
            kept_cost = self.prior_cost_rows(prior, day_start, from_us, &regrown).await?;
            stored = self.prior_allocations(prior, day_start, day_end).await?;
        }
        let gpus: Vec<String> = gpus.into_iter().filter(|g| !memo.parents.contains_key(g)).collect();
        let mut looks = Vec::new();
        for slice in gpus.chunks(self.gpus_per_query(lo, hi)) {
            for (uuid, g) in self.gpu_windows_slice(slice, lo, hi, &memo.meta).await? {
                // A GPU seen for the first time had no window before the part read: its
                // earlier hours (unknown) are new rows too.
                let mut from = from_us;
                if !memo.meta.contains_key(&uuid) {
                    if g.windows.is_empty() {
                        continue;
                    }
                    memo.meta.insert(uuid.clone(), g.meta.clone());
                    from = day_start;
                }
                if from < to_us {
                    self.cost_rows(&uuid, &g, from, to_us, &mut cost)?;
                }
                let kept = stored.remove(&uuid).unwrap_or_default();
                let day_span = (day_start, day_end);
                self.allocation_rows(&uuid, &g, day_span, (hi, now_us), unseen, kept, &mut allocs, &mut looks).await?;
            }
        }
        self.forward_looks(hi, now_us, &looks, &mut allocs.rows).await?;
        // Rows of GPUs that are MIG parents now (none had windows again): kept as they are.
        allocs.rows.extend(stored.into_values().flatten());
        for parent in memo.parents.keys().cloned().collect::<Vec<_>>() {
            let whole = unseen.is_none() || regrown.contains(&parent);
            let (from, lo) = if whole { (day_start, full_lo) } else { (from_us, lo) };
            if from < to_us {
                self.mig_parent_rows(&parent, &mut memo, lo, hi, from, to_us, &mut cost).await?;
            }
        }
        memo.hi_us = hi;
        memo.to_us = to_us;
        memo.open = allocs.rows.iter().filter(|r| r.end.is_none()).count();
        kept_cost.push(cost.finish()?);
        Ok((DayRows { cost: Some(kept_cost), allocs: allocs.finish()? }, memo))
    }

    /// A past day with nothing new in its range whose open allocations may have ended
    /// (or grown) in the next day: those rows alone are looked up again.
    async fn refresh_open_runs(
        &self,
        day: i64,
        hi: i64,
        now_us: i64,
        mut memo: DayMemo,
        prior: Prior<'_>,
    ) -> Result<(DayRows, DayMemo), DayError> {
        let (day_start, day_end) = (day * DAY_US, (day + 1) * DAY_US);
        let (mut allocs, mut looks) = (AllocRows::default(), Vec::new());
        for (uuid, rows) in self.prior_allocations(prior, day_start, day_end).await? {
            for mut r in rows {
                if r.end.is_none() {
                    (r.end, r.held_through) =
                        run_end_at_list_end(&uuid, &r.owner_kind, &r.owner, r.held_through, hi, now_us, &mut looks);
                }
                allocs.rows.push(r);
            }
        }
        self.forward_looks(hi, now_us, &looks, &mut allocs.rows).await?;
        memo.open = allocs.rows.iter().filter(|r| r.end.is_none()).count();
        // The hours are as they were: stored ones stay, held ones go on.
        let cost = match prior {
            Prior::Stored => None,
            Prior::Held(rows) => rows.cost.clone(),
        };
        Ok((DayRows { cost, allocs: allocs.finish()? }, memo))
    }

    /// Stores a day's rows (each table's partition replaced whole); the rows counted.
    async fn store_day(&self, date: &str, rows: DayRows) -> Result<(usize, usize), LedgerError> {
        let n_cost = rows.cost.iter().flatten().map(RecordBatch::num_rows).sum();
        let n_alloc = rows.allocs.num_rows();
        let mut parts = Vec::with_capacity(2);
        if let Some(cost) = rows.cost {
            parts.push((Table::GpuCostHourly, cost));
        }
        parts.push((Table::Allocations, vec![rows.allocs]));
        self.store_partitions(date.to_owned(), parts).await?;
        Ok((n_cost, n_alloc))
    }

    /// [`Ledger::stored_cost_rows`] from where `prior` says.
    async fn prior_cost_rows(
        &self,
        prior: Prior<'_>,
        day_start: i64,
        before_us: i64,
        skip: &BTreeSet<String>,
    ) -> Result<Vec<RecordBatch>, LedgerError> {
        let held = match prior {
            Prior::Stored => return self.stored_cost_rows(day_start, before_us, skip).await,
            Prior::Held(rows) => rows.cost.iter().flatten(),
        };
        held.map(|b| {
            let (hour, uuid) = (b.column(0).as_primitive::<TimestampMicrosecondType>(), b.column(3).as_string::<i32>());
            let keep: datafusion::arrow::array::BooleanArray = (0..b.num_rows())
                .map(|r| Some((day_start..before_us).contains(&hour.value(r)) && !skip.contains(uuid.value(r))))
                .collect();
            datafusion::arrow::compute::filter_record_batch(b, &keep)
                .map_err(|source| LedgerError::Arrow { what: "the rows kept", source })
        })
        .collect()
    }

    /// [`Ledger::stored_allocations`] from where `prior` says.
    async fn prior_allocations(
        &self,
        prior: Prior<'_>,
        day_start: i64,
        day_end: i64,
    ) -> Result<BTreeMap<String, Vec<AllocRow>>, LedgerError> {
        let Prior::Held(rows) = prior else { return self.stored_allocations(day_start, day_end).await };
        let mut out: BTreeMap<String, Vec<AllocRow>> = BTreeMap::new();
        for r in AllocRow::read(&rows.allocs).into_iter().filter(|r| (day_start..day_end).contains(&r.start)) {
            out.entry(r.gpu_uuid.clone()).or_default().push(r);
        }
        for runs in out.values_mut() {
            runs.sort_by_key(|r| r.start);
        }
        Ok(out)
    }

    /// Replaces the `date` partition of each table, in order, off the async runtime.
    async fn store_partitions(&self, date: String, parts: Vec<(Table, Vec<RecordBatch>)>) -> Result<(), LedgerError> {
        let store = self.store.clone();
        let day = date.clone();
        let stored = tokio::task::spawn_blocking(move || {
            parts.iter().try_for_each(|(table, batches)| store.replace_partition(*table, &day, batches).map(drop))
        })
        .await;
        match stored {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(LedgerError::Store { date, detail: e.to_string() }),
            Err(e) => Err(LedgerError::Store { date, detail: e.to_string() }),
        }
    }

    /// The stored `gpu_cost_hourly` rows of the day's hours before `before_us`, except
    /// those of `skip`, in the table's schema.
    async fn stored_cost_rows(
        &self,
        day_start: i64,
        before_us: i64,
        skip: &BTreeSet<String>,
    ) -> Result<Vec<RecordBatch>, LedgerError> {
        let schema = Table::GpuCostHourly.schema();
        let cols: Vec<String> = schema.fields().iter().map(|f| format!("\"{}\"", f.name())).collect();
        let sql = format!(
            "SELECT {} FROM gpu_cost_hourly WHERE hour >= {} AND hour < {}{}",
            cols.join(", "),
            ts(day_start),
            ts(before_us),
            gpus_excluded_sql(skip)
        );
        self.query(&sql).await?.iter().map(|b| conform(b, &schema)).collect()
    }

    /// The stored `allocations` rows that start in the day, per GPU, oldest first.
    async fn stored_allocations(
        &self,
        day_start: i64,
        day_end: i64,
    ) -> Result<BTreeMap<String, Vec<AllocRow>>, LedgerError> {
        let schema = Table::Allocations.schema();
        let cols: Vec<String> = schema.fields().iter().map(|f| format!("\"{}\"", f.name())).collect();
        let sql = format!(
            "SELECT {} FROM allocations WHERE start_time >= {} AND start_time < {} ORDER BY gpu_uuid, start_time",
            cols.join(", "),
            ts(day_start),
            ts(day_end)
        );
        let mut out: BTreeMap<String, Vec<AllocRow>> = BTreeMap::new();
        for b in self.query(&sql).await? {
            let b = conform(&b, &schema)?;
            for r in AllocRow::read(&b) {
                out.entry(r.gpu_uuid.clone()).or_default().push(r);
            }
        }
        Ok(out)
    }

    /// One GPU's windows in `(lo, hi]` with their holders resolved; its metadata is
    /// `known` (the first window of the day's range) or the first window read.
    async fn gpu_windows(
        &self,
        uuid: &str,
        lo: i64,
        hi: i64,
        known: Option<&GpuMeta>,
    ) -> Result<GpuWindows, LedgerError> {
        let metas: BTreeMap<String, GpuMeta> = known.map(|m| (uuid.to_owned(), m.clone())).into_iter().collect();
        let mut out = self.gpu_windows_slice(&[uuid.to_owned()], lo, hi, &metas).await?;
        Ok(out.pop().map_or_else(
            || GpuWindows { meta: known.cloned().unwrap_or_default(), windows: Vec::new(), holders: Vec::new() },
            |(_, g)| g,
        ))
    }

    /// [`Ledger::gpu_windows`] for several GPUs with one scan: the per-GPU query read
    /// (nearly) everything in range once per GPU — a whole pass over 256 GPUs' day
    /// scanned the day 256 times. In `uuids`' order.
    async fn gpu_windows_slice(
        &self,
        uuids: &[String],
        lo: i64,
        hi: i64,
        known: &BTreeMap<String, GpuMeta>,
    ) -> Result<Vec<(String, GpuWindows)>, LedgerError> {
        let range = range_sql(lo, hi);

        let batches = self
            .query(&format!(
                // Quoted: `cluster` is an SQL keyword. gpu_uuid last: the columns before it
                // are read by position.
                "SELECT time, window_s, CAST(sm_active_max AS DOUBLE), CAST(gpu_util_max AS DOUBLE), \
                 CAST(sm_active AS DOUBLE), \"host\", \"cluster\", \"gpu_model\", \"mig_profile\", {OWNER_COLUMNS_SQL}, \
                 gpu_uuid FROM gpu_samples WHERE gpu_uuid IN ({}) AND {range} ORDER BY gpu_uuid, time",
                str_list(uuids.iter().map(String::as_str))
            ))
            .await?;
        // Each GPU's rows: consecutive (ordered by gpu_uuid), as zero-copy slices.
        let mut per: BTreeMap<String, Vec<RecordBatch>> = BTreeMap::new();
        for b in &batches {
            let ids = b.column(b.num_columns() - 1).as_string::<i32>();
            let mut start = 0;
            while start < b.num_rows() {
                let id = ids.value(start);
                let mut end = start + 1;
                while end < b.num_rows() && ids.value(end) == id {
                    end += 1;
                }
                per.entry(id.to_owned()).or_default().push(b.slice(start, end - start));
                start = end;
            }
        }
        drop(batches);
        let mut out = Vec::with_capacity(uuids.len());
        for uuid in uuids {
            let rows = per.remove(uuid).unwrap_or_default();
            out.push((uuid.clone(), self.parse_windows(uuid, &rows, lo, hi, known.get(uuid)).await?));
        }
        Ok(out)
    }

    async fn parse_windows(
        &self,
        uuid: &str,
        batches: &[RecordBatch],
        lo: i64,
        hi: i64,
        known: Option<&GpuMeta>,
    ) -> Result<GpuWindows, LedgerError> {
        let mut g = GpuWindows { meta: known.cloned().unwrap_or_default(), windows: Vec::new(), holders: Vec::new() };
        let mut index: BTreeMap<Owner, HolderId> = BTreeMap::new();
        for b in batches {
            let time = b.column(0).as_primitive::<TimestampMicrosecondType>();
            let window = b.column(1).as_primitive::<Float64Type>();
            let f = |i: usize| b.column(i).as_primitive::<Float64Type>();
            let (sm_max, util_max, sm_mean) = (f(2), f(3), f(4));
            let s = |i: usize| b.column(i).as_string::<i32>();
            let opt = |i: usize, r: usize| (!s(i).is_null(r)).then(|| s(i).value(r).to_owned());
            for r in 0..b.num_rows() {
                if g.meta.host.is_empty() {
                    g.meta = GpuMeta {
                        host: s(5).value(r).to_owned(),
                        cluster: opt(6, r),
                        model: s(7).value(r).to_owned(),
                        mig_profile: opt(8, r),
                    };
                }
                let val = |a: &datafusion::arrow::array::Float64Array| (!a.is_null(r)).then(|| a.value(r));
                let owner = match owner_at(b, 9, r) {
                    Some(o) => Some(o),
                    // Nobody holds it: a static map entry is a dedicated allocation.
                    None => self.config.teams.static_owner(uuid, &g.meta.host),
                };
                let holder = match owner {
                    None => None,
                    Some(o) => Some(match index.get(&o) {
                        Some(id) => *id,
                        None => {
                            let id = HolderId(g.holders.len());
                            g.holders.push(self.config.teams.resolve(uuid, &g.meta.host, o.clone()));
                            index.insert(o, id);
                            id
                        }
                    }),
                };
                g.windows.push(Window {
                    end_us: time.value(r),
                    window_us: (window.value(r) * 1e6).round() as i64,
                    sm_active_max: val(sm_max),
                    gpu_util_max: val(util_max),
                    sm_active_mean: val(sm_mean),
                    holder,
                });
            }
        }
        // A process sample speaks for the windows after it, so the first windows read
        // need the samples just before them.
        let process_range = range_sql(lo.saturating_sub(PROCESS_SAMPLE_REACH_US), hi);
        self.process_owners(uuid, &process_range, &mut g, &mut index).await?;
        Ok(g)
    }

    /// The last fallback of the brief's order: a window nobody holds, in which a
    /// process of a Unix user that `[cost.teams] users` maps to a team ran, is that
    /// user's (owner kind `process`). A user the map does not know stays unallocated,
    /// so unknown compute is still `unallocated_busy`.
    async fn process_owners(
        &self,
        uuid: &str,
        range: &str,
        g: &mut GpuWindows,
        index: &mut BTreeMap<Owner, HolderId>,
    ) -> Result<(), LedgerError> {
        if self.config.teams.users.is_empty() || g.windows.iter().all(|w| w.holder.is_some()) {
            return Ok(());
        }
        let batches = self
            .query(&format!(
                "SELECT time, \"user\" FROM gpu_processes WHERE gpu_uuid = {} AND {range} AND \"user\" IS NOT NULL",
                sql_str(uuid)
            ))
            .await?;
        let users = ProcessUsers::new(
            &self.config.teams,
            batches.iter().flat_map(|b| {
                let (t, u) = (b.column(0).as_primitive::<TimestampMicrosecondType>(), b.column(1).as_string::<i32>());
                (0..b.num_rows()).map(move |r| (t.value(r), u.value(r)))
            }),
        );
        if users.is_empty() {
            return Ok(());
        }
        for w in g.windows.iter_mut().filter(|w| w.holder.is_none()) {
            let Some(owner) = users.owner_at(w.end_us) else { continue };
            w.holder = Some(match index.get(&owner) {
                Some(id) => *id,
                None => {
                    let id = HolderId(g.holders.len());
                    g.holders.push(self.config.teams.resolve(uuid, &g.meta.host, owner.clone()));
                    index.insert(owner, id);
                    id
                }
            });
        }
        Ok(())
    }

    /// MIG parents in `range` and their instances (uuid, profile).
    async fn mig_instances(
        &self,
        range: &str,
    ) -> Result<BTreeMap<String, BTreeSet<(String, Option<String>)>>, LedgerError> {
        let batches = self
            .query(&format!(
                "SELECT DISTINCT parent_gpu_uuid, gpu_uuid, mig_profile FROM gpu_samples \
                 WHERE {range} AND parent_gpu_uuid IS NOT NULL"
            ))
            .await?;
        let mut out: BTreeMap<String, BTreeSet<(String, Option<String>)>> = BTreeMap::new();
        for b in &batches {
            let (parent, uuid, profile) =
                (b.column(0).as_string::<i32>(), b.column(1).as_string::<i32>(), b.column(2).as_string::<i32>());
            for r in 0..b.num_rows() {
                let p = (!profile.is_null(r)).then(|| profile.value(r).to_owned());
                out.entry(parent.value(r).to_owned()).or_default().insert((uuid.value(r).to_owned(), p));
            }
        }
        Ok(out)
    }

    /// MIG: instances carry cost and state (they are GPUs of their own above); the
    /// parent's capacity that no instance holds is the parent's unallocated idle,
    /// priced at its compute share — `(7 − Σ instance slices)/7` of the parent's price
    /// (the price book's n/7 rule, through the profile `"<free>g.unallocated"`), the
    /// instances being all those seen in the day's range. The parent's own activity
    /// fields describe its instances, so they are not classified.
    #[allow(clippy::too_many_arguments)]
    async fn mig_parent_rows(
        &self,
        parent: &str,
        memo: &mut DayMemo,
        lo: i64,
        hi: i64,
        from: i64,
        to: i64,
        out: &mut CostRows,
    ) -> Result<(), LedgerError> {
        let free =
            apron_cost::mig::free_slices(memo.parents.get(parent).into_iter().flatten().map(|(_, p)| p.as_deref()));
        if free == 0 {
            return Ok(());
        }
        let known = memo.meta.get(parent).cloned();
        let mut g = self.gpu_windows(parent, lo, hi, known.as_ref()).await?;
        let mut from = from;
        if known.is_none() {
            if g.windows.is_empty() {
                return Ok(());
            }
            memo.meta.insert(parent.to_owned(), g.meta.clone());
            from = day_start_of(from);
        }
        g.holders.clear();
        apron_cost::mig::parent_as_free_capacity(&mut g.windows);
        g.meta.mig_profile = Some(apron_cost::mig::unallocated_profile(free));
        self.cost_rows(parent, &g, from, to, out)
    }

    fn cost_rows(&self, uuid: &str, g: &GpuWindows, from: i64, to: i64, out: &mut CostRows) -> Result<(), LedgerError> {
        if to <= from {
            return Ok(());
        }
        let holders: Vec<Holder> =
            g.holders.iter().map(|h| Holder { team: h.team.clone(), workload_kind: h.workload_kind.clone() }).collect();
        let classified = apron_cost::classify(&g.windows, &holders, &self.config.classify, from, to)
            .map_err(|e| LedgerError::Classify { uuid: uuid.to_owned(), detail: e.to_string() })?;
        let m = &g.meta;
        let key = GpuKey { model_name: &m.model, mig_profile: m.mig_profile.as_deref(), cluster: m.cluster.as_deref() };
        match &self.book {
            Some(book) => {
                for row in apron_cost::hourly_cost(&classified, book, &key)
                    .map_err(|e| LedgerError::Price { uuid: uuid.to_owned(), detail: e.to_string() })?
                {
                    out.push(row.hour_us, g, uuid, &row.team, &row.micros, row.money.as_ref());
                }
            }
            None => {
                for h in classified.hourly() {
                    out.push(h.hour_us, g, uuid, &h.team, &h.micros, None);
                }
            }
        }
        Ok(())
    }

    /// The `allocations` rows of one GPU: runs of one holder that start in the day.
    ///
    /// Incremental (`unseen` is `Some`): `g` holds only the windows from just before the
    /// recomputed hours and `kept` the GPU's stored rows. Stored runs that started
    /// before the first window read stay; the first run read is the continuation of the
    /// stored run that already covered its first window, if any (same holder), and
    /// keeps that run's start; if no stored row covers a window that was read before,
    /// its run began before the day. Stored runs still open are closed when a later
    /// window exists or the holder went silent, as a whole computation would.
    #[allow(clippy::too_many_arguments)]
    async fn allocation_rows(
        &self,
        uuid: &str,
        g: &GpuWindows,
        (day_start, day_end): (i64, i64),
        (hi, now_us): (i64, i64),
        unseen: Option<i64>,
        mut kept: Vec<AllocRow>,
        out: &mut AllocRows,
        looks: &mut Vec<ForwardLook>,
    ) -> Result<(), LedgerError> {
        let w = &g.windows;
        let cut = w.first().map_or(i64::MAX, |x| x.end_us - x.window_us);
        // A stored run that starts with the first window read is found again below.
        kept.retain(|r| r.start <= cut);
        for run in apron_cost::holder_runs(w) {
            let resolved = &g.holders[run.holder.0];
            let mut start = run.start_us(w);
            if let (Some(unseen), 0) = (unseen, run.first) {
                let first_end = w[0].end_us;
                match kept.iter().rposition(|r| r.same_holder(resolved) && r.held_through >= first_end) {
                    Some(k) => start = kept.remove(k).start,
                    None if first_end < unseen => continue,
                    None => {}
                }
            }
            if !(day_start..day_end).contains(&start) {
                continue;
            }
            let last = run.last_end_us(w);
            let (end, held) = if run.last + 1 < w.len() {
                (Some(last), last)
            } else {
                run_end_at_list_end(uuid, resolved.owner.kind.as_str(), &resolved.owner.owner, last, hi, now_us, looks)
            };
            out.rows.push(AllocRow::new(uuid, g, (start, end, held), resolved));
        }
        for mut r in kept {
            if r.end.is_none() {
                (r.end, r.held_through) = if w.is_empty() {
                    run_end_at_list_end(uuid, &r.owner_kind, &r.owner, r.held_through, hi, now_us, looks)
                } else {
                    // Windows came after it: it ended with its newest window.
                    let last = self.last_window_of(uuid, &r, cut).await?;
                    (Some(last), last)
                };
            }
            out.rows.push(r);
        }
        out.rows.sort_by(|a, b| (&a.gpu_uuid, a.start).cmp(&(&b.gpu_uuid, b.start)));
        Ok(())
    }

    /// The end of the newest window of `r`'s holder before `before` (an open stored run
    /// that later windows closed; its `held_through` may have been a bound, not a window).
    async fn last_window_of(&self, uuid: &str, r: &AllocRow, before: i64) -> Result<i64, LedgerError> {
        let sql = format!(
            "SELECT max(time) FROM gpu_samples WHERE gpu_uuid = {} AND time >= {} AND time <= {} \
             AND owner_kind = {} AND owner = {}",
            sql_str(uuid),
            ts(r.start),
            ts(before),
            sql_str(&r.owner_kind),
            sql_str(&r.owner)
        );
        Ok(first_ts(&self.query(&sql).await?).unwrap_or(r.held_through))
    }

    /// Ends the runs of `looks` (their windows read up to `after`, a finished day's
    /// bound) from the windows after it, all with two scans per
    /// [`FORWARD_LOOKS_PER_QUERY`] runs — one query per run read every later file once per
    /// run: a finished day of 1,000 GPUs' open runs did not end in 6 minutes. For each:
    /// the newest window of the same owner after `after` and before the first window of
    /// another owner (or anyone's, if none followed) is its `held_through`; it has ended
    /// if another owner's window follows, or if the newest is older than
    /// [`apron_cost::OPEN_RUN_STALE_US`] (silence); else it is still held. The rows of
    /// `rows` the looks stand for (open, same GPU, owner and `held_through`) take the
    /// result.
    async fn forward_looks(
        &self,
        after: i64,
        now_us: i64,
        looks: &[ForwardLook],
        rows: &mut [AllocRow],
    ) -> Result<(), LedgerError> {
        type Key = (String, String, String);
        let mut ends: BTreeMap<Key, (i64, Option<i64>, i64)> = BTreeMap::new();
        for chunk in looks.chunks(FORWARD_LOOKS_PER_QUERY) {
            let keys: BTreeSet<Key> = chunk.iter().map(|l| (l.uuid.clone(), l.kind.clone(), l.owner.clone())).collect();
            let gpus = str_list(keys.iter().map(|k| k.0.as_str()));
            let values = |bound: &dyn Fn(&Key) -> String| -> String {
                keys.iter()
                    .map(|k| format!("({}, {}, {}{})", sql_str(&k.0), sql_str(&k.1), sql_str(&k.2), bound(k)))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let scan = format!("s.gpu_uuid IN ({gpus}) AND s.time > {}", ts(after));
            let same = "s.owner_kind = o.k AND s.owner = o.w";
            // The first window of another owner (or of nobody) after `after`, per run.
            let next = self
                .keyed_times(&format!(
                    "SELECT o.g, o.k, o.w, min(s.time) FROM gpu_samples s JOIN (VALUES {}) AS o(g, k, w) \
                     ON s.gpu_uuid = o.g WHERE {scan} AND NOT coalesce({same}, false) GROUP BY o.g, o.k, o.w",
                    values(&|_| String::new())
                ))
                .await?;
            // The newest window of the run's owner before that.
            let newest = self
                .keyed_times(&format!(
                    "SELECT o.g, o.k, o.w, max(s.time) FROM gpu_samples s JOIN (VALUES {}) AS o(g, k, w, nxt) \
                     ON s.gpu_uuid = o.g WHERE {scan} AND CAST(s.time AS BIGINT) < o.nxt AND {same} \
                     GROUP BY o.g, o.k, o.w",
                    values(&|k| format!(", {}", next.get(k).copied().unwrap_or(i64::MAX)))
                ))
                .await?;
            for l in chunk {
                let key = (l.uuid.clone(), l.kind.clone(), l.owner.clone());
                let last = newest.get(&key).copied().unwrap_or(l.last);
                let ended = apron_cost::run_ended(next.contains_key(&key), last, now_us);
                ends.insert(key, (l.last, ended.then_some(last), last));
            }
        }
        for r in rows.iter_mut().filter(|r| r.end.is_none()) {
            let key = (r.gpu_uuid.clone(), r.owner_kind.clone(), r.owner.clone());
            if let Some(&(looked_from, end, held)) = ends.get(&key)
                && looked_from == r.held_through
            {
                (r.end, r.held_through) = (end, held);
            }
        }
        Ok(())
    }

    /// `(gpu, owner kind, owner) → time` from a query that selects them in that order.
    async fn keyed_times(&self, sql: &str) -> Result<BTreeMap<(String, String, String), i64>, LedgerError> {
        let mut out = BTreeMap::new();
        for b in self.query(sql).await? {
            let t = b.column(3).as_primitive::<TimestampMicrosecondType>();
            for r in (0..b.num_rows()).filter(|&r| !t.is_null(r)) {
                out.insert(run_key(&b, r), t.value(r));
            }
        }
        Ok(out)
    }
}

/// Runs whose end a forward look decides, per query: each brings a VALUES row and its
/// GPU to the IN list; a query scans the windows after the day once, whatever the count.
const FORWARD_LOOKS_PER_QUERY: usize = 1024;

/// An open run at the end of a finished day's windows: whether and when it ended only
/// the windows after the day tell ([`Ledger::forward_looks`], one scan for them all).
struct ForwardLook {
    uuid: String,
    kind: String,
    owner: String,
    /// The end of its newest window read.
    last: i64,
}

/// End and `held_through` of a run whose newest window read (ending at `last`) is the
/// last one read, the data read ending at `hi`: past `hi` (a day before today) the next
/// day's windows say — left open here and queued in `looks`; otherwise it is still
/// held, unless its holder has been silent too long.
fn run_end_at_list_end(
    uuid: &str,
    kind: &str,
    owner: &str,
    last: i64,
    hi: i64,
    now_us: i64,
    looks: &mut Vec<ForwardLook>,
) -> (Option<i64>, i64) {
    if hi < now_us {
        looks.push(ForwardLook { uuid: uuid.to_owned(), kind: kind.to_owned(), owner: owner.to_owned(), last });
        return (None, last);
    }
    (apron_cost::run_ended(false, last, now_us).then_some(last), last)
}

/// A day's rows as computed, before they are stored.
struct DayRows {
    /// `gpu_cost_hourly`; `None`: the stored hours stand (only open runs were looked at).
    cost: Option<Vec<RecordBatch>>,
    allocs: RecordBatch,
}

/// Where a computation finds the rows it keeps (hours before those it recomputes,
/// allocations that began before the windows it reads).
#[derive(Clone, Copy)]
enum Prior<'a> {
    /// The stored partitions: what earlier passes stored.
    Stored,
    /// A catch-up's previous step, not stored yet.
    Held(&'a DayRows),
}

/// Midnight (UTC) of the day of `t`.
fn day_start_of(t: i64) -> i64 {
    t.div_euclid(DAY_US) * DAY_US
}

/// `time > lo AND time <= hi` as SQL.
fn range_sql(lo: i64, hi: i64) -> String {
    format!("time > {} AND time <= {}", ts(lo), ts(hi))
}

/// `b`'s columns cast to `schema`'s types (the engine may hand strings back as views).
fn conform(b: &RecordBatch, schema: &datafusion::arrow::datatypes::SchemaRef) -> Result<RecordBatch, LedgerError> {
    let cols = b
        .columns()
        .iter()
        .zip(schema.fields())
        .map(|(c, f)| datafusion::arrow::compute::cast(c, f.data_type()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| LedgerError::Arrow { what: "a partition's columns", source })?;
    RecordBatch::try_new(schema.clone(), cols).map_err(|source| LedgerError::Arrow { what: "a partition", source })
}

fn first_ts(batches: &[RecordBatch]) -> Option<i64> {
    let b = batches.first()?;
    let c = b.column(0).as_primitive_opt::<TimestampMicrosecondType>()?;
    (b.num_rows() > 0 && !c.is_null(0)).then(|| c.value(0))
}

fn save_state(path: &std::path::Path, state: &LedgerState) -> Result<(), LedgerError> {
    Ok(crate::statefile::save_json(path, state)?)
}
mod metrics;
mod rows;

pub use metrics::CostMetrics;
use rows::{AllocRow, AllocRows, CostRows};

impl Ledger {
    /// Runs a pass every `interval`, refreshing `metrics` after each, until the task is
    /// dropped or aborted.
    pub async fn run(self: Arc<Self>, metrics: CostMetrics) {
        let mut tick = tokio::time::interval(self.config.interval.max(Duration::from_secs(1)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = self.kick.notified() => {}
            }
            let r = self.run_once(UnixMicros::now().0).await;
            for e in &r.errors {
                tracing::warn!(error = %e, "cost ledger");
            }
            if let Err(e) = self.refresh_metrics(&metrics).await {
                tracing::warn!(error = %e, "cost ledger: refreshing /metrics");
            }
        }
    }
}
