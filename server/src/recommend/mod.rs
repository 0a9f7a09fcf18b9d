//! Recommendations over a window: SQL gathers what each allocation did with each GPU,
//! hour by hour, `apron_cost::recommend` applies the rules, and pack / right-size
//! proposals are replayed minute by minute over the same stored samples.
//!
//! ```text
//!  window (to − w, to]
//!   gpu_samples ─► per (GPU, owner) and hour: held / known / idle seconds, DDSketches
//!                  of SM activity and memory, per-minute idle share and SM moments
//!                  (per hour: the GPU list, one query per GPU slice, coverage and
//!                  MIG parents; whole hours kept and read again only when they
//!                  change, see [`hours`])
//!   merged over the window ─► p95s, spreads, the owner of the latest window
//!   owners ─► teams, workload kinds, interruptible (the ledger's resolution)
//!   price book ─► $/GPU-hour at `to` (+ the model's spot rate)
//!   apron_cost::recommend::plan ─► reclaim, right-size, pack, downsize, spot
//!   proposals ─► per-minute series of their members (from the stored hours' minute
//!                files and the edges, read for up to REPLAY_MEMBERS_PER_READ members
//!                at a time) ─► replay ─► savings
//! ```
//!
//! Every figure is in the item's `evidence`, with the SQL that reproduces it. The
//! `recommendations` table holds the latest run over `[recommend] window` (default 7d),
//! refreshed every `[recommend] interval`; the API computes any window on demand.
//! `rebalance-quota` needs pending work from the scheduler, which no source reports yet,
//! so the rule runs with an empty queue and produces nothing until one does.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use apron_common::UnixMicros;
use apron_cost::GpuKey;
use apron_cost::recommend::{self, AllocationUse, GpuUse, Price, RecommendConfig, Recommendation};
use apron_cost::replay::{Bucket, Workload};
use apron_query::{QueryEngine, SnapshotTable};
use datafusion::arrow::array::{
    Array, ArrayRef, AsArray, BooleanArray, Decimal128Array, Float64Array, Int64Array, RecordBatch, StringArray,
    TimestampMicrosecondArray,
};
use datafusion::arrow::datatypes::{DataType, Field, Int64Type, Schema, SchemaRef, TimeUnit};
use datafusion::arrow::error::ArrowError;
use serde::Deserialize;

use crate::ledger::Ledger;
use crate::sqlutil::{SqlError, gpus_excluded_sql, mig_parent_uuids, sql_str, strings, ts};

pub(crate) mod hours;
use hours::{Coverage, Hours, HoursError, Piece, Usage};

/// Why recommendations could not be computed (the table keeps its last set).
#[derive(Debug, thiserror::Error)]
pub enum RecommendError {
    #[error(transparent)]
    Sql(#[from] SqlError),
    #[error("window {}: must be positive (and under 292,000 years)", humantime::format_duration(*.0))]
    BadWindow(Duration),
    #[error("expected {expected} (in: {sql})")]
    Shape { sql: String, expected: &'static str },
    #[error("pricing: {0}")]
    Money(#[from] apron_cost::money::MoneyError),
    #[error("building the recommendations table: {0}")]
    Arrow(#[from] ArrowError),
    #[error("the stored hours: {0}")]
    Hours(#[from] HoursError),
}

impl RecommendError {
    /// The engine's error, when one of the run's queries failed (its limit decides the
    /// answer's status: 504, 507, 503).
    pub fn query_error(&self) -> Option<&apron_query::QueryError> {
        match self {
            RecommendError::Sql(SqlError::Query { source, .. }) => Some(source),
            _ => None,
        }
    }
}

/// Why an on-demand run ([`Recommender::on_demand`]) gave no answer.
#[derive(Debug, thiserror::Error)]
pub enum OnDemandError {
    /// `[recommend] on_demand_max_concurrent` runs are in progress already.
    #[error(
        "{running} on-demand recommendation run(s) already in progress ([recommend] on_demand_max_concurrent); retry in a few seconds"
    )]
    Busy { running: usize },
    #[error(transparent)]
    Failed(#[from] RecommendError),
}

/// How long a client is asked to wait when every on-demand run slot is taken.
pub const ON_DEMAND_RETRY_AFTER_S: u64 = 5;

/// Finished on-demand sets kept (the newest; each for `[recommend] on_demand_cache`).
const ON_DEMAND_CACHED: usize = 8;

/// A window's figures per (GPU, owner), what its windows cover, and the MIG parents
/// left out of them.
struct Gathered {
    usage: BTreeMap<hours::Key, Usage>,
    coverage: Option<Coverage>,
    parents: BTreeSet<String>,
    /// The edges' per-minute series (read with them, at most two hours).
    edge_minutes: Vec<RecordBatch>,
    /// The stored hours holding the rest of the window's minutes; `None` when an hour
    /// could not be kept, and replays read their members from raw windows.
    minute_hours: Option<Vec<i64>>,
}

/// How many proposal members' series one read of the window's minute files collects: a
/// week is 10,080 minutes of ~56 bytes per member, so 128 members hold ≤ ~70 MB, and
/// the hours' files are read once per that many members instead of once per proposal.
const REPLAY_MEMBERS_PER_READ: usize = 128;

impl Gathered {
    fn add(
        &mut self,
        coverage: Option<Coverage>,
        parents: &BTreeSet<String>,
        batches: &[RecordBatch],
    ) -> Result<(), HoursError> {
        self.coverage = Coverage::merge(self.coverage, coverage);
        self.parents.extend(parents.iter().cloned());
        hours::fold(batches, &mut self.usage)
    }
}

/// `[recommend]`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RecommendSettings {
    pub enabled: bool,
    /// The window of the `recommendations` table.
    #[serde(deserialize_with = "apron_common::duration::at_least_1s::deserialize")]
    pub window: Duration,
    #[serde(deserialize_with = "apron_common::duration::at_least_1s::deserialize")]
    pub interval: Duration,
    /// A run reads each hour this many GPUs at a time, so its memory follows this, not
    /// the fleet's size (the per-minute spread alone is GPUs × 60 groups).
    pub gpus_per_query: usize,
    /// `GET /api/v1/recommendations` answers a window asked for again within this with
    /// the set already computed for it (0s: every request computes).
    #[serde(deserialize_with = "apron_common::duration::deserialize")]
    pub on_demand_cache: Duration,
    /// On-demand runs (the API's, fleet-wide on the server's reserved query slots) at
    /// once, whoever asks; a request beyond is 503 `busy` with `Retry-After` (at least 1).
    pub on_demand_max_concurrent: usize,
    pub rules: RecommendConfig,
}

impl Default for RecommendSettings {
    fn default() -> Self {
        RecommendSettings {
            enabled: true,
            window: Duration::from_secs(7 * 86_400),
            interval: Duration::from_secs(900),
            gpus_per_query: 1024,
            on_demand_cache: Duration::from_secs(60),
            on_demand_max_concurrent: 1,
            rules: RecommendConfig::default(),
        }
    }
}

/// One run's answer.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RecommendationSet {
    pub window: String,
    /// The hours of the window that hold data: monthly savings are the window's
    /// savings × 730 / these hours, so a young installation is not under-extrapolated.
    pub covered_hours: f64,
    pub from: String,
    pub to: String,
    pub generated_at: String,
    /// Sum of the live items' monthly savings, by savings kind (the headline).
    pub monthly_savings_usd: BTreeMap<&'static str, apron_cost::Cents>,
    /// The items whose holder still holds the GPU(s) at `to` (`holder_live`).
    pub recommendations: Vec<Recommendation>,
    /// The items whose holder had released the GPU(s) by `to` (`holder_live` false,
    /// `holder_ended_at`): history, in no total.
    pub ended: Vec<Recommendation>,
    #[serde(skip)]
    pub from_us: i64,
    #[serde(skip)]
    pub to_us: i64,
    #[serde(skip)]
    pub generated_at_us: i64,
}

/// The recommender over the server's engine and ledger.
pub struct Recommender {
    engine: Arc<QueryEngine>,
    ledger: Arc<Ledger>,
    settings: RecommendSettings,
    table: Arc<SnapshotTable>,
    kick: tokio::sync::Notify,
    /// Opened by the first run (it follows the store's changes from then on).
    hours: tokio::sync::Mutex<Option<Hours>>,
    /// Pieces (edges and hours) read from raw windows so far.
    pieces_read: std::sync::atomic::AtomicU64,
    /// Proposals replayed from raw windows (an hour's minutes could not be kept).
    raw_replays: std::sync::atomic::AtomicU64,
    /// On-demand runs in progress ([`Recommender::on_demand`]).
    on_demand_runs: Arc<tokio::sync::Semaphore>,
    /// Finished on-demand sets: (window, when finished, set), newest last.
    on_demand_sets: std::sync::Mutex<Vec<(Duration, std::time::Instant, Arc<RecommendationSet>)>>,
    /// On-demand runs started so far.
    on_demand_started: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for Recommender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recommender").field("settings", &self.settings).finish()
    }
}

impl Recommender {
    pub fn new(
        engine: Arc<QueryEngine>,
        ledger: Arc<Ledger>,
        settings: RecommendSettings,
        table: Arc<SnapshotTable>,
    ) -> Recommender {
        let runs = settings.on_demand_max_concurrent.max(1);
        Recommender {
            engine,
            ledger,
            settings,
            table,
            on_demand_runs: Arc::new(tokio::sync::Semaphore::new(runs)),
            on_demand_sets: std::sync::Mutex::new(Vec::new()),
            on_demand_started: std::sync::atomic::AtomicU64::new(0),
            kick: tokio::sync::Notify::new(),
            hours: tokio::sync::Mutex::new(None),
            pieces_read: std::sync::atomic::AtomicU64::new(0),
            raw_replays: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Asks the running loop for a refresh now (e.g. after a backfill landed).
    pub fn kick(&self) {
        self.kick.notify_one();
    }

    pub fn settings(&self) -> &RecommendSettings {
        &self.settings
    }

    /// How many pieces (raw edges and whole hours) runs have read from raw windows: a
    /// run reads its two edges and the hours not stored or changed since.
    pub fn pieces_read(&self) -> u64 {
        self.pieces_read.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How many proposals runs have replayed from raw windows over their whole window
    /// (0 while every hour's minutes could be kept).
    pub fn raw_replays(&self) -> u64 {
        self.raw_replays.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How many on-demand runs have started (cached answers start none).
    pub fn on_demand_started(&self) -> u64 {
        self.on_demand_started.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Recommendations for the window ending now, for a client (`GET
    /// /api/v1/recommendations`): the set computed for the same window within
    /// `[recommend] on_demand_cache`, else a new run — at most
    /// `on_demand_max_concurrent` at once, server-wide. A run is fleet-wide on the
    /// server's reserved query slots whoever asks (the caller filters it), so clients
    /// must not be able to start them without bound.
    pub async fn on_demand(&self, window: Duration) -> Result<Arc<RecommendationSet>, OnDemandError> {
        if let Some(set) = self.cached(window) {
            return Ok(set);
        }
        let running = self.settings.on_demand_max_concurrent.max(1);
        let Ok(_run) = self.on_demand_runs.clone().try_acquire_owned() else {
            return Err(OnDemandError::Busy { running });
        };
        // A run of the same window may have finished while this one waited for the slot.
        if let Some(set) = self.cached(window) {
            return Ok(set);
        }
        self.on_demand_started.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let set = Arc::new(self.compute(window, UnixMicros::now().0).await?);
        if !self.settings.on_demand_cache.is_zero() {
            let mut sets = self.on_demand_sets.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let ttl = self.settings.on_demand_cache;
            sets.retain(|(w, at, _)| *w != window && at.elapsed() < ttl);
            sets.push((window, std::time::Instant::now(), set.clone()));
            let over = sets.len().saturating_sub(ON_DEMAND_CACHED);
            sets.drain(..over);
        }
        Ok(set)
    }

    /// The set of an on-demand run of `window` finished within `on_demand_cache`.
    fn cached(&self, window: Duration) -> Option<Arc<RecommendationSet>> {
        let ttl = self.settings.on_demand_cache;
        let sets = self.on_demand_sets.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        sets.iter().rev().find(|(w, at, _)| *w == window && at.elapsed() < ttl).map(|(_, _, set)| set.clone())
    }

    async fn query(&self, sql: &str) -> Result<Vec<RecordBatch>, RecommendError> {
        Ok(crate::sqlutil::batches(&self.engine, sql).await?)
    }

    /// The filter every query of a run shares: held windows of the range, no lost ones,
    /// no MIG parents (their instances are the workloads).
    fn base_filter(range: &str, parents: &BTreeSet<String>) -> String {
        format!("{range} AND owner IS NOT NULL AND NOT gpu_lost{}", gpus_excluded_sql(parents))
    }

    /// Recommendations for `(to − window, to]`.
    pub async fn compute(&self, window: Duration, to_us: i64) -> Result<RecommendationSet, RecommendError> {
        let window_us = i64::try_from(window.as_micros()).map_err(|_| RecommendError::BadWindow(window))?;
        if window_us <= 0 {
            return Err(RecommendError::BadWindow(window));
        }
        let from_us = to_us - window_us;
        let (started, read_before, raw_before) = (std::time::Instant::now(), self.pieces_read(), self.raw_replays());
        // Held to the end of the replays: the minute files they read stay as gathered.
        let mut stored = self.hours.lock().await;
        let gathered = self.gather(&mut stored, from_us, to_us).await?;
        let gathered_at = started.elapsed();
        // Monthly figures extrapolate from the hours the data covers, not from the
        // window asked for: 24 h of history under a 7 d window is 24 h of evidence.
        let covered_us = gathered.coverage.and_then(|c| c.within(from_us, to_us)).unwrap_or(window_us);
        let range = format!("time > {} AND time <= {}", ts(from_us), ts(to_us));
        let filter = Self::base_filter(&range, &gathered.parents);
        let newest = self.newest_windows(to_us).await?;
        let mut allocs: BTreeMap<(String, String), AllocationUse> = BTreeMap::new();
        for ((gpu, kind, holder), u) in gathered.usage {
            let Some(owner) = u.owner else { continue };
            let (holder_live, last_held_us) = holding_live(&newest, (&gpu, &kind, &holder), u.last_us, to_us);
            let gk = GpuKey { model_name: &u.model, mig_profile: u.mig.as_deref(), cluster: u.cluster.as_deref() };
            let price = self.ledger.quote(&gk, to_us).map(|q| Price {
                per_hour: q.usd_per_gpu_hour,
                kind: q.kind,
                spot_per_hour: self.ledger.price_book().and_then(|book| book.spot_price_at(&gk, to_us).ok().flatten()),
            });
            let us = |s: f64| (s * 1e6).round() as i64;
            let g = GpuUse {
                gpu_uuid: gpu.clone(),
                host: u.host.clone(),
                cluster: u.cluster.clone(),
                gpu_model: u.model.clone(),
                mig_profile: u.mig.clone(),
                fb_total_bytes: u.fb_total,
                held_us: us(u.held_s),
                known_us: us(u.known_s),
                idle_us: us(u.idle_s),
                p95_sm: Usage::quantile(u.sm.as_ref(), 0.95).or_else(|| Usage::quantile(u.util.as_ref(), 0.95)),
                p95_mem_bytes: Usage::quantile(u.mem.as_ref(), 0.95).map(|v| v.round() as i64),
                idle_spread: u.idle_minutes.spread(),
                sm_spread: u.sm_minutes.spread(),
                price,
                holder_live,
                last_held_us,
            };
            let entry = allocs.entry((owner.kind.as_str().to_owned(), owner.owner.clone())).or_insert_with(|| {
                let resolved = self.ledger.teams().resolve(&gpu, &u.host, owner.clone());
                AllocationUse {
                    owner_kind: owner.kind.as_str().to_owned(),
                    owner: owner.owner.clone(),
                    team: resolved.team,
                    workload_kind: resolved.workload_kind,
                    interruptible: resolved.interruptible,
                    gpus: Vec::new(),
                }
            });
            entry.gpus.push(g);
        }
        let allocs: Vec<AllocationUse> = allocs.into_values().collect();
        let mut items = recommend::plan(&allocs, &[], &self.settings.rules, covered_us)?;
        let members: Vec<Vec<(usize, usize)>> = items
            .iter()
            .map(|r| r.proposal.as_ref().map(|p| recommend::replay_members(&allocs, p)).unwrap_or_default())
            .collect();
        let key = |&(a, g): &(usize, usize)| -> hours::Key {
            (allocs[a].gpus[g].gpu_uuid.clone(), allocs[a].owner_kind.clone(), allocs[a].owner.clone())
        };
        let workload = |&(a, g): &(usize, usize), buckets: Vec<Bucket>| Workload {
            name: format!("{} on {}", allocs[a].owner, allocs[a].gpus[g].gpu_uuid),
            buckets,
        };
        let mut replayed = 0;
        // Proposals in groups of about REPLAY_MEMBERS_PER_READ members; each group's
        // series come from one read of the window's minutes.
        let mut start = 0;
        while start < items.len() {
            let (mut end, mut n) = (start, 0);
            while end < items.len() && (end == start || n + members[end].len() <= REPLAY_MEMBERS_PER_READ) {
                n += members[end].len();
                end += 1;
            }
            let wanted: BTreeSet<hours::Key> = members[start..end].iter().flatten().map(key).collect();
            let series = match &gathered.minute_hours {
                Some(hs) if !wanted.is_empty() => {
                    self.stored_series(stored.as_ref(), &gathered.edge_minutes, hs, &wanted)
                }
                _ => None,
            };
            for (r, m) in items[start..end].iter_mut().zip(&members[start..end]) {
                if m.is_empty() {
                    continue;
                }
                replayed += m.len();
                let raw;
                let by_key = match series.as_ref() {
                    Some(by_key) => by_key,
                    None => {
                        self.raw_replays.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        raw = self.raw_series(&m.iter().map(key).collect(), &filter).await?;
                        &raw
                    }
                };
                let workloads: Vec<Workload> =
                    m.iter().map(|mg| workload(mg, by_key.get(&key(mg)).cloned().unwrap_or_default())).collect();
                recommend::finish(r, &allocs, &workloads, covered_us)?;
            }
            start = end;
        }
        drop(stored);
        for (r, m) in items.iter_mut().zip(&members) {
            let pairs: Vec<(String, String, String)> = match &r.proposal {
                Some(_) => m.iter().map(key).collect(),
                None => r.gpus.iter().map(|g| (g.clone(), r.owner_kind.clone(), r.owner.clone())).collect(),
            };
            r.evidence.insert("sql".into(), serde_json::Value::String(self.evidence_sql(&pairs, from_us, to_us)));
        }
        // Where a run's time goes: the pieces read from raw windows, the whole run's
        // gathering (those reads, and the stored hours folded), the proposals' replays.
        tracing::info!(
            window = %humantime::format_duration(window),
            pieces_read = self.pieces_read() - read_before,
            gather_ms = gathered_at.as_millis() as u64,
            replayed_members = replayed,
            replays_from_raw = self.raw_replays() - raw_before,
            replay_ms = (started.elapsed() - gathered_at).as_millis() as u64,
            "recommendations computed"
        );
        items.sort_by(|a, b| b.monthly_savings.cmp(&a.monthly_savings).then(a.id.cmp(&b.id)));
        // Items whose holder no longer holds the GPU are history: listed apart, never in
        // the headline.
        let (items, ended): (Vec<Recommendation>, Vec<Recommendation>) = items.into_iter().partition(|r| r.holder_live);
        let totals = savings_totals(&items);
        let now = UnixMicros::now().0;
        Ok(RecommendationSet {
            window: humantime::format_duration(window).to_string(),
            covered_hours: (covered_us as f64 / 3.6e9 * 1e6).round() / 1e6,
            from: UnixMicros(from_us).to_rfc3339(),
            to: UnixMicros(to_us).to_rfc3339(),
            generated_at: UnixMicros(now).to_rfc3339(),
            monthly_savings_usd: totals,
            recommendations: items,
            ended,
            from_us,
            to_us,
            generated_at_us: now,
        })
    }

    /// The window's figures per (GPU, owner): whole hours from the stored hours
    /// (computing those not yet stored), the edges from raw windows.
    async fn gather(&self, guard: &mut Option<Hours>, from_us: i64, to_us: i64) -> Result<Gathered, RecommendError> {
        let (edges, whole) = hours::split(from_us, to_us);
        let mut g = Gathered {
            usage: BTreeMap::new(),
            coverage: None,
            parents: BTreeSet::new(),
            edge_minutes: Vec::new(),
            minute_hours: Some(Vec::new()),
        };
        for (lo, hi) in edges {
            let piece = self.piece(lo, hi).await?;
            g.add(piece.coverage, &piece.parents, &piece.batches)?;
            g.edge_minutes.extend(piece.minutes);
        }
        if guard.is_none() {
            match Hours::open(self.ledger.store()) {
                Ok(h) => *guard = Some(h),
                // Without a place for them every run reads its window whole, as before.
                Err(e) => tracing::warn!(error = %e, "recommendations: cannot keep hours; reading the window whole"),
            }
        }
        if let Some(stored) = guard.as_mut() {
            stored.invalidate();
        }
        for &h in &whole {
            if let Some(stored) = guard.as_mut().filter(|s| s.has(h)) {
                match stored.read(h) {
                    Ok(batches) => {
                        let (coverage, parents) = stored.meta(h);
                        g.add(coverage, parents, &batches)?;
                        if let Some(hs) = g.minute_hours.as_mut() {
                            hs.push(h);
                        }
                        continue;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, hour = %UnixMicros(h).to_rfc3339(), "recommendations: a stored hour is unreadable; reading it again");
                        stored.forget(h);
                    }
                }
            }
            let piece = self.piece(h, h + hours::HOUR_US).await?;
            g.add(piece.coverage, &piece.parents, &piece.batches)?;
            match guard.as_mut().map(|stored| stored.put(h, piece)) {
                Some(Ok(())) => {
                    if let Some(hs) = g.minute_hours.as_mut() {
                        hs.push(h);
                    }
                }
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "recommendations: cannot keep an hour; it is read again next run");
                    g.minute_hours = None;
                }
                // The minutes of an hour not kept are not held in memory either (a
                // week of them would be the whole fleet's): replays read raw windows.
                None => g.minute_hours = None,
            }
        }
        // MIG parents of any piece are left out of the whole window (their instances are
        // the workloads), as a single query over the window would.
        let parents = std::mem::take(&mut g.parents);
        g.usage.retain(|(gpu, _, _), _| !parents.contains(gpu));
        g.parents = parents;
        Ok(g)
    }

    /// The partial of `(lo, hi]` (within one hour), `gpus_per_query` GPUs at a time.
    async fn piece(&self, lo: i64, hi: i64) -> Result<Piece, RecommendError> {
        self.pieces_read.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let range = format!("time > {} AND time <= {}", ts(lo), ts(hi));
        let idle = self.ledger.classify_config().idle_sql();
        let gpus = strings(
            &self.engine,
            &format!(
                "SELECT DISTINCT gpu_uuid FROM gpu_samples WHERE {range} AND owner IS NOT NULL AND NOT gpu_lost ORDER BY gpu_uuid"
            ),
        )
        .await?;
        let (mut batches, mut minutes) = (Vec::new(), Vec::new());
        for chunk in gpus.chunks(self.settings.gpus_per_query.max(1)) {
            let (Some(first), Some(last)) = (chunk.first(), chunk.last()) else { continue };
            let slice = format!(" AND gpu_uuid >= {} AND gpu_uuid <= {}", sql_str(first), sql_str(last));
            batches.extend(self.query(&hours::partial_sql(&range, &slice, &idle)).await?);
            minutes.extend(self.query(&hours::minutes_sql(&range, &slice, &idle)).await?);
        }
        let sql = format!(
            "SELECT CAST(min(time) AS BIGINT), CAST(max(time) AS BIGINT), CAST(max(window_s) * 1000000 AS BIGINT) \
             FROM gpu_samples WHERE {range}"
        );
        let mut coverage = None;
        for b in self.query(&sql).await? {
            let col = |i: usize| b.column(i).as_primitive_opt::<Int64Type>();
            let (Some(first), Some(last), Some(window)) = (col(0), col(1), col(2)) else {
                return Err(RecommendError::Shape { sql, expected: "three BIGINT columns" });
            };
            if b.num_rows() > 0 && !first.is_null(0) && !last.is_null(0) {
                coverage = Some(Coverage {
                    first_us: first.value(0),
                    last_us: last.value(0),
                    window_us: if window.is_null(0) { 0 } else { window.value(0) },
                });
            }
        }
        let parents = mig_parent_uuids(&self.engine, &range).await?;
        Ok(Piece { batches, minutes, coverage, parents })
    }

    /// Each GPU's newest window in `[to − OPEN_RUN_STALE_US, to]` and its holder (held
    /// or not, lost or not, as the ledger's forward look reads them): what decides whether
    /// a holding is still live at `to` ([`holding_live`]). One small read, whatever the
    /// window.
    async fn newest_windows(&self, to_us: i64) -> Result<Newest, RecommendError> {
        let sql = format!(
            "SELECT DISTINCT ON (gpu_uuid) gpu_uuid, CAST(time AS BIGINT), owner_kind, owner FROM gpu_samples \
             WHERE time >= {} AND time <= {} ORDER BY gpu_uuid, time DESC, owner_kind, owner",
            ts(to_us - apron_cost::OPEN_RUN_STALE_US),
            ts(to_us)
        );
        let mut out = Newest::new();
        for b in self.query(&sql).await? {
            // Whatever string type the store gives (dictionary, view): plain strings.
            let utf8 = |i: usize| datafusion::arrow::compute::cast(b.column(i), &DataType::Utf8).ok();
            let (gpu, kind, owner) = (utf8(0), utf8(2), utf8(3));
            let s = |c: &Option<ArrayRef>| c.as_ref().and_then(|c| c.as_string_opt::<i32>().cloned());
            let (Some(gpu), Some(end), Some(kind), Some(owner)) =
                (s(&gpu), b.column(1).as_primitive_opt::<Int64Type>(), s(&kind), s(&owner))
            else {
                return Err(RecommendError::Shape { sql, expected: "gpu_uuid, BIGINT time, owner_kind, owner" });
            };
            for r in (0..b.num_rows()).filter(|&r| !gpu.is_null(r) && !end.is_null(r)) {
                let holder = (!kind.is_null(r) && !owner.is_null(r))
                    .then(|| (kind.value(r).to_owned(), owner.value(r).to_owned()));
                out.insert(gpu.value(r).to_owned(), (end.value(r), holder));
            }
        }
        Ok(out)
    }

    /// The SQL that reproduces an item's held / known / idle figures and its p95s (the
    /// window's sketch is the merge of its hours', bucket for bucket).
    fn evidence_sql(&self, pairs: &[(String, String, String)], from_us: i64, to_us: i64) -> String {
        let which = pairs_sql(pairs);
        format!(
            "SELECT gpu_uuid, owner, sum(window_s) AS held_s, \
             sum(CASE WHEN {} THEN window_s ELSE 0 END) AS known_s, \
             sum(CASE WHEN {} THEN window_s ELSE 0 END) AS idle_s, \
             ddsketch_quantile(ddsketch(CAST(sm_active AS DOUBLE)), 0.95) AS p95_sm_active, \
             ddsketch_quantile(ddsketch(CAST(fb_used_bytes AS DOUBLE)), 0.95) AS p95_fb_used_bytes \
             FROM gpu_samples WHERE time > {} AND time <= {} AND NOT gpu_lost AND ({}) GROUP BY gpu_uuid, owner ORDER BY gpu_uuid",
            hours::KNOWN_SQL,
            self.ledger.classify_config().idle_sql(),
            ts(from_us),
            ts(to_us),
            which
        )
    }

    /// The per-minute series of the (GPU, owner) pairs in `wanted`, from the edges' rows
    /// and the stored hours `hours_read`, each in time order; `None` (after a warning)
    /// when a stored hour cannot be read, and the replays read raw windows instead.
    fn stored_series(
        &self,
        stored: Option<&Hours>,
        edges: &[RecordBatch],
        hours_read: &[i64],
        wanted: &BTreeSet<hours::Key>,
    ) -> Option<BTreeMap<hours::Key, Vec<Bucket>>> {
        let stored = stored?;
        let mut out = BTreeMap::new();
        let mut read = || -> Result<(), HoursError> {
            hours::fold_minutes(edges.iter().cloned().map(Ok), wanted, &mut out)?;
            for &h in hours_read {
                hours::fold_minutes(stored.read_minutes(h)?, wanted, &mut out)?;
            }
            Ok(())
        };
        if let Err(e) = read() {
            tracing::warn!(error = %e, "recommendations: stored minutes unreadable; replaying from raw windows");
            return None;
        }
        hours::sort_series(&mut out);
        Some(out)
    }

    /// Per-minute series of the (GPU, owner) pairs in `wanted` read from raw windows
    /// over the run's `filter` (the whole window), each in time order.
    async fn raw_series(
        &self,
        wanted: &BTreeSet<hours::Key>,
        filter: &str,
    ) -> Result<BTreeMap<hours::Key, Vec<Bucket>>, RecommendError> {
        let idle = self.ledger.classify_config().idle_sql();
        let pairs: Vec<hours::Key> = wanted.iter().cloned().collect();
        // The same rows as a piece's minutes, over the window.
        let range = format!("{filter} AND ({})", pairs_sql(&pairs));
        let batches = self.query(&hours::minutes_sql(&range, "", &idle)).await?;
        let mut out = BTreeMap::new();
        hours::fold_minutes(batches.into_iter().map(Ok), wanted, &mut out)?;
        hours::sort_series(&mut out);
        Ok(out)
    }

    /// Computes the table's window ending at `to_us` and publishes it.
    pub async fn refresh_at(&self, to_us: i64) -> Result<usize, RecommendError> {
        let set = self.compute(self.settings.window, to_us).await?;
        // Hours before the table's window are kept only until the next refresh (an
        // on-demand run over a longer window may have stored them).
        if let Some(h) = self.hours.lock().await.as_mut() {
            h.evict_before(hours::floor_hour(set.from_us));
        }
        let n = set.recommendations.len();
        self.table.replace(vec![recommendations_batch(&set)?]);
        Ok(n)
    }

    /// Refreshes the table every `interval` until dropped.
    pub async fn run(self: Arc<Self>) {
        let mut tick = tokio::time::interval(self.settings.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = self.kick.notified() => {}
            }
            let started = std::time::Instant::now();
            match self.refresh_at(UnixMicros::now().0).await {
                Ok(n) => tracing::info!(
                    recommendations = n,
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "recommendations refreshed"
                ),
                Err(e) => tracing::warn!(error = %e, "recommendations: refresh failed; retried next interval"),
            }
        }
    }
}

/// `(gpu_uuid = … AND owner_kind = … AND owner = …) OR …` for `pairs`: the rows of
/// those (GPU, owner) pairs.
fn pairs_sql(pairs: &[hours::Key]) -> String {
    let which: Vec<String> = pairs
        .iter()
        .map(|(g, k, o)| {
            format!("(gpu_uuid = {} AND owner_kind = {} AND owner = {})", sql_str(g), sql_str(k), sql_str(o))
        })
        .collect();
    which.join(" OR ")
}

/// Monthly savings summed by savings kind, live holders' items only.
fn savings_totals(items: &[Recommendation]) -> BTreeMap<&'static str, apron_cost::Cents> {
    recommend::monthly_totals(items)
}

/// Each GPU's newest window at most [`apron_cost::OPEN_RUN_STALE_US`] before `to`:
/// (its end, its holder's (owner kind, owner); `None`: nobody's).
type Newest = BTreeMap<String, (i64, Option<(String, String)>)>;

/// Whether a holding — `(gpu, owner kind, owner)`, whose newest window in the run's window
/// ended at `last_us` — is still held at `to_us`, and the end of its newest window: the
/// ledger's rule for an open allocation ([`apron_cost::run_ended`]). Live when its GPU's
/// newest window of the last [`apron_cost::OPEN_RUN_STALE_US`] is its own; ended when a
/// later window is another holder's or nobody's (a hand-over, a release), or when the
/// GPU has no window that recent (the holder, or the node, went silent).
fn holding_live(newest: &Newest, (gpu, kind, owner): (&str, &str, &str), last_us: i64, to_us: i64) -> (bool, i64) {
    match newest.get(gpu) {
        Some((end, Some((k, o)))) if k == kind && o == owner => {
            let last = last_us.max(*end);
            (!apron_cost::run_ended(false, last, to_us), last)
        }
        Some((end, _)) if *end > last_us => (false, last_us),
        _ => (!apron_cost::run_ended(false, last_us, to_us), last_us),
    }
}

impl RecommendationSet {
    /// Keeps the items `keep` accepts (a team's own), totals recomputed from them.
    pub fn retain(&mut self, keep: impl Fn(&Recommendation) -> bool) {
        self.recommendations.retain(|r| keep(r));
        self.ended.retain(|r| keep(r));
        self.monthly_savings_usd = savings_totals(&self.recommendations);
    }
}

/// The `recommendations` table's columns (documented in docs/metrics.md).
pub fn schema() -> SchemaRef {
    let ts = |name: &str| Field::new(name, DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())), false);
    let s = |name: &str, nullable| Field::new(name, DataType::Utf8, nullable);
    Arc::new(Schema::new(vec![
        ts("generated_at"),
        ts("window_start"),
        ts("window_end"),
        s("id", false),
        s("kind", false),
        s("team", false),
        s("owner_kind", false),
        s("owner", false),
        s("cluster", true),
        s("host", false),
        s("gpu_model", false),
        s("gpu_uuids", false),
        Field::new("gpu_count", DataType::Int64, false),
        Field::new("window_savings_usd", apron_common::wire::MONEY, false),
        Field::new("monthly_savings_usd", apron_common::wire::MONEY, false),
        s("savings_kind", false),
        Field::new("confidence", DataType::Float64, false),
        s("summary", false),
        s("evidence", false),
        s("replay", true),
        Field::new("covered_hours", DataType::Float64, false),
        // Whether the holder still holds the GPU(s) at `window_end`; when not, the end of
        // its newest window (an ended item is history: not in the headline).
        Field::new("holder_live", DataType::Boolean, false),
        Field::new("holder_ended_at", DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())), true),
    ]))
}

fn recommendations_batch(set: &RecommendationSet) -> Result<RecordBatch, ArrowError> {
    // Live items first, then the ended ones (history), each flagged.
    let items: Vec<&Recommendation> = set.recommendations.iter().chain(&set.ended).collect();
    let items = &items;
    let n = items.len();
    let strs = |f: &dyn Fn(&Recommendation) -> Option<String>| -> ArrayRef {
        Arc::new(items.iter().map(|r| f(r)).collect::<StringArray>())
    };
    let tsc = |v: i64| -> ArrayRef { Arc::new(TimestampMicrosecondArray::from(vec![v; n]).with_timezone("UTC")) };
    let money = |f: &dyn Fn(&Recommendation) -> i64| -> Result<ArrayRef, ArrowError> {
        Ok(Arc::new(
            items
                .iter()
                .map(|r| Some(i128::from(f(r))))
                .collect::<Decimal128Array>()
                .with_precision_and_scale(18, 6)?,
        ))
    };
    let cols: Vec<ArrayRef> = vec![
        tsc(set.generated_at_us),
        tsc(set.from_us),
        tsc(set.to_us),
        strs(&|r| Some(r.id.clone())),
        strs(&|r| Some(r.kind.to_owned())),
        strs(&|r| Some(r.team.clone())),
        strs(&|r| Some(r.owner_kind.clone())),
        strs(&|r| Some(r.owner.clone())),
        strs(&|r| r.cluster.clone()),
        strs(&|r| Some(r.host.clone())),
        strs(&|r| Some(r.gpu_model.clone())),
        strs(&|r| Some(r.gpus.join(","))),
        Arc::new(items.iter().map(|r| Some(r.gpus.len() as i64)).collect::<Int64Array>()),
        money(&|r| r.window_savings.0)?,
        money(&|r| r.monthly_savings.0)?,
        strs(&|r| Some(r.savings_kind.to_owned())),
        Arc::new(items.iter().map(|r| Some(r.confidence)).collect::<Float64Array>()),
        strs(&|r| Some(r.summary.clone())),
        strs(&|r| serde_json::to_string(&r.evidence).ok()),
        strs(&|r| r.replay.as_ref().and_then(|o| serde_json::to_string(o).ok())),
        Arc::new(Float64Array::from(vec![set.covered_hours; n])),
        Arc::new(items.iter().map(|r| Some(r.holder_live)).collect::<BooleanArray>()),
        Arc::new(items.iter().map(|r| r.holder_ended_us).collect::<TimestampMicrosecondArray>().with_timezone("UTC")),
    ];
    RecordBatch::try_new(schema(), cols)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: i64 = 60_000_000;

    #[test]
    fn a_holding_is_live_while_its_gpu_newest_window_is_its_own_and_recent() {
        let to = 1_000 * MIN;
        let holder = |k: &str, o: &str| Some((k.to_owned(), o.to_owned()));
        let newest: Newest = BTreeMap::from([
            // Still held: its own window a minute ago.
            ("GPU-a".to_owned(), (to - MIN, holder("pod", "ds/nb"))),
            // Handed over: another job's window after the pod's last.
            ("GPU-b".to_owned(), (to - MIN, holder("slurm_job", "42"))),
            // Released: a window of nobody after the pod's last.
            ("GPU-c".to_owned(), (to - 2 * MIN, None)),
        ]);
        assert_eq!(holding_live(&newest, ("GPU-a", "pod", "ds/nb"), to - MIN, to), (true, to - MIN));
        assert_eq!(holding_live(&newest, ("GPU-b", "pod", "ds/nb"), to - 5 * MIN, to), (false, to - 5 * MIN));
        assert_eq!(holding_live(&newest, ("GPU-c", "pod", "ds/nb"), to - 3 * MIN, to), (false, to - 3 * MIN));
        // Silent: no window of the GPU in the last 10 minutes (the ledger's
        // OPEN_RUN_STALE_US); 10 minutes exactly is still held, as in the ledger.
        assert_eq!(holding_live(&newest, ("GPU-d", "pod", "ds/nb"), to - 10 * MIN - 1, to), (false, to - 10 * MIN - 1));
        assert_eq!(holding_live(&newest, ("GPU-d", "pod", "ds/nb"), to - 10 * MIN, to), (true, to - 10 * MIN));
    }

    fn item(kind: &'static str, live: bool, monthly_cents: i64) -> Recommendation {
        Recommendation {
            id: format!("{kind}-{live}"),
            kind,
            team: "t".into(),
            owner: "o".into(),
            owner_kind: "pod".into(),
            cluster: None,
            host: "h".into(),
            gpu_model: "m".into(),
            gpus: vec!["GPU-a".into()],
            holder_live: live,
            holder_ended_at: (!live).then(|| UnixMicros(MIN).to_rfc3339()),
            holder_ended_us: (!live).then_some(MIN),
            window_savings_usd: apron_cost::Cents(monthly_cents),
            monthly_savings_usd: apron_cost::Cents(monthly_cents),
            window_savings: apron_cost::Micros(monthly_cents * 10_000),
            monthly_savings: apron_cost::Micros(monthly_cents * 10_000),
            savings_kind: "cash",
            confidence: 1.0,
            summary: String::new(),
            evidence: BTreeMap::new(),
            replay: None,
            proposal: None,
        }
    }

    #[test]
    fn the_table_flags_ended_items_and_the_headline_leaves_them_out() {
        let mut set = RecommendationSet {
            window: "1h".into(),
            covered_hours: 1.0,
            from: String::new(),
            to: String::new(),
            generated_at: String::new(),
            monthly_savings_usd: BTreeMap::new(),
            recommendations: vec![item("reclaim", true, 100)],
            ended: vec![item("right-size", false, 1_000)],
            from_us: 0,
            to_us: 60 * MIN,
            generated_at_us: 60 * MIN,
        };
        set.retain(|_| true);
        assert_eq!(set.monthly_savings_usd, BTreeMap::from([("cash", apron_cost::Cents(100))]));
        let b = recommendations_batch(&set).expect("batch");
        assert_eq!(b.num_rows(), 2);
        let live = b.column_by_name("holder_live").expect("holder_live").as_boolean();
        let ended = b.column_by_name("holder_ended_at").expect("holder_ended_at");
        let ended = ended.as_primitive::<datafusion::arrow::datatypes::TimestampMicrosecondType>();
        assert_eq!((live.value(0), ended.is_null(0)), (true, true));
        assert_eq!((live.value(1), ended.value(1)), (false, MIN));
        let json = serde_json::to_value(&set).expect("json");
        assert_eq!(json["ended"][0]["holder_live"], false);
        assert_eq!(json["recommendations"][0]["holder_ended_at"], serde_json::Value::Null);
    }
}
