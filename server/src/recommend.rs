//! Recommendations over a window: SQL gathers what each allocation did with each GPU,
//! `apron_cost::recommend` applies the rules, and pack / right-size proposals are
//! replayed minute by minute over the same stored samples.
//!
//! ```text
//!  window (to − w, to]
//!   gpu_samples ─► per (GPU, owner): held / known / idle seconds, p95 SM activity and
//!                  memory, per-minute idle share and SM spread          (2 queries)
//!   owners ─► teams, workload kinds, interruptible (the ledger's resolution)
//!   price book ─► $/GPU-hour at `to` (+ the model's spot rate)
//!   apron_cost::recommend::plan ─► reclaim, right-size, pack, downsize, spot
//!   proposals ─► per-minute series of their members (1 query each) ─► replay ─► savings
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
use apron_cost::recommend::{self, AllocationUse, GpuUse, Price, RecommendConfig, Recommendation, Spread};
use apron_cost::replay::{Bucket, Workload};
use apron_query::{QueryEngine, SnapshotTable};
use datafusion::arrow::array::{
    Array, ArrayRef, AsArray, Decimal128Array, Float64Array, Int64Array, RecordBatch, StringArray,
    TimestampMicrosecondArray,
};
use datafusion::arrow::datatypes::{
    DataType, Field, Float64Type, Int64Type, Schema, SchemaRef, TimeUnit, TimestampMicrosecondType,
};
use datafusion::arrow::error::ArrowError;
use serde::Deserialize;

use crate::ledger::Ledger;
use crate::sqlutil::{
    OWNER_COLUMNS_SQL, SqlError, gpus_excluded_sql, mig_parent_uuids, owner_at, sql_str, strings, ts,
};

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
    /// A run reads the window this many GPUs at a time, so its memory follows this, not
    /// the fleet's size (the per-minute spread alone is GPUs × minutes groups).
    pub gpus_per_query: usize,
    pub rules: RecommendConfig,
}

impl Default for RecommendSettings {
    fn default() -> Self {
        RecommendSettings {
            enabled: true,
            window: Duration::from_secs(7 * 86_400),
            interval: Duration::from_secs(900),
            gpus_per_query: 64,
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
    /// Sum of the items' monthly savings, by savings kind.
    pub monthly_savings_usd: BTreeMap<&'static str, apron_cost::Cents>,
    pub recommendations: Vec<Recommendation>,
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
        Recommender { engine, ledger, settings, table, kick: tokio::sync::Notify::new() }
    }

    /// Asks the running loop for a refresh now (e.g. after a backfill landed).
    pub fn kick(&self) {
        self.kick.notify_one();
    }

    pub fn settings(&self) -> &RecommendSettings {
        &self.settings
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
        // Monthly figures extrapolate from the hours the data covers, not from the
        // window asked for: 24 h of history under a 7 d window is 24 h of evidence.
        let covered_us = self.covered(from_us, to_us).await?.unwrap_or(window_us);
        let idle = self.ledger.classify_config().idle_sql();
        let range = format!("time > {} AND time <= {}", ts(from_us), ts(to_us));
        let parents = mig_parent_uuids(&self.engine, &range).await?;
        let filter = Self::base_filter(&range, &parents);
        let gpus = strings(
            &self.engine,
            &format!("SELECT DISTINCT gpu_uuid FROM gpu_samples WHERE {filter} ORDER BY gpu_uuid"),
        )
        .await?;
        let known = "(sm_active_max IS NOT NULL OR gpu_util_max IS NOT NULL)";
        let per_gpu_sql = |slice: &str| {
            format!(
                "SELECT gpu_uuid, owner_kind, owner, max(\"host\"), max(\"cluster\"), max(gpu_model), max(mig_profile), \
             max(CAST(fb_total_bytes AS BIGINT)), \
             sum(window_s), sum(CASE WHEN {known} THEN window_s ELSE 0 END), sum(CASE WHEN {idle} THEN window_s ELSE 0 END), \
             approx_percentile_cont(0.95) WITHIN GROUP (ORDER BY CAST(sm_active AS DOUBLE)), \
             approx_percentile_cont(0.95) WITHIN GROUP (ORDER BY CAST(gpu_util AS DOUBLE)), \
             approx_percentile_cont(0.95) WITHIN GROUP (ORDER BY CAST(fb_used_bytes AS DOUBLE)) \
             FROM gpu_samples WHERE {slice} GROUP BY gpu_uuid, owner_kind, owner ORDER BY gpu_uuid, owner_kind, owner"
            )
        };
        let owners_sql = |slice: &str| {
            format!(
                "SELECT DISTINCT ON (gpu_uuid, owner_kind, owner) gpu_uuid, \"host\", {OWNER_COLUMNS_SQL} \
             FROM gpu_samples WHERE {slice} ORDER BY gpu_uuid, owner_kind, owner, time DESC"
            )
        };
        let spread_sql = |slice: &str| {
            format!(
                "SELECT gpu_uuid, owner_kind, owner, avg(idle_share), stddev_pop(idle_share), avg(sm), stddev_pop(sm) FROM (\
             SELECT gpu_uuid, owner_kind, owner, date_bin(INTERVAL '1 minute', time - INTERVAL '1 microsecond') AS minute, \
             sum(CASE WHEN {idle} THEN window_s ELSE 0 END) / nullif(sum(CASE WHEN {known} THEN window_s ELSE 0 END), 0) AS idle_share, \
             avg(CAST(coalesce(sm_active, gpu_util) AS DOUBLE)) AS sm \
             FROM gpu_samples WHERE {slice} GROUP BY 1, 2, 3, 4) GROUP BY 1, 2, 3"
            )
        };
        let (mut per_gpu, mut owners, mut spread) = (Vec::new(), Vec::new(), Vec::new());
        // A few GPUs at a time: memory follows the slice, not the fleet.
        for chunk in gpus.chunks(self.settings.gpus_per_query.max(1)) {
            let (Some(lo), Some(hi)) = (chunk.first(), chunk.last()) else { continue };
            let slice = format!("{filter} AND gpu_uuid >= {} AND gpu_uuid <= {}", sql_str(lo), sql_str(hi));
            per_gpu.extend(self.query(&per_gpu_sql(&slice)).await?);
            owners.extend(self.query(&owners_sql(&slice)).await?);
            spread.extend(self.query(&spread_sql(&slice)).await?);
        }

        type Key = (String, String, String);
        let key_at = |b: &RecordBatch, r: usize| -> Key {
            let s = |i: usize| b.column(i).as_string::<i32>().value(r).to_owned();
            (s(0), s(1), s(2))
        };
        let mut owner_rows: BTreeMap<(String, String, String), crate::sqlutil::Owner> = BTreeMap::new();
        let mut hosts: BTreeMap<String, String> = BTreeMap::new();
        for b in &owners {
            for r in 0..b.num_rows() {
                let gpu = b.column(0).as_string::<i32>().value(r).to_owned();
                hosts.insert(gpu.clone(), b.column(1).as_string::<i32>().value(r).to_owned());
                if let Some(o) = owner_at(b, 2, r) {
                    owner_rows.insert((gpu, o.kind.as_str().to_owned(), o.owner.clone()), o);
                }
            }
        }
        let mut spreads: BTreeMap<Key, (Spread, Spread)> = BTreeMap::new();
        for b in &spread {
            let f = |i: usize, r: usize| {
                let c = b.column(i).as_primitive::<Float64Type>();
                if c.is_null(r) { 0.0 } else { c.value(r) }
            };
            for r in 0..b.num_rows() {
                spreads.insert(
                    key_at(b, r),
                    (Spread { mean: f(3, r), std: f(4, r) }, Spread { mean: f(5, r), std: f(6, r) }),
                );
            }
        }
        let mut allocs: BTreeMap<(String, String), AllocationUse> = BTreeMap::new();
        for b in &per_gpu {
            let s = |i: usize| b.column(i).as_string::<i32>();
            let f = |i: usize| b.column(i).as_primitive::<Float64Type>();
            let opt_f = |i: usize, r: usize| (!f(i).is_null(r)).then(|| f(i).value(r));
            for r in 0..b.num_rows() {
                let key = key_at(b, r);
                let Some(owner) = owner_rows.get(&key).cloned() else { continue };
                let (gpu, host) = (key.0.clone(), s(3).value(r).to_owned());
                let cluster = (!s(4).is_null(r)).then(|| s(4).value(r).to_owned());
                let model = s(5).value(r).to_owned();
                let mig = (!s(6).is_null(r)).then(|| s(6).value(r).to_owned());
                let total = b.column(7).as_primitive::<Int64Type>();
                let gk = GpuKey { model_name: &model, mig_profile: mig.as_deref(), cluster: cluster.as_deref() };
                let price = self.ledger.quote(&gk, to_us).map(|q| Price {
                    per_hour: q.usd_per_gpu_hour,
                    kind: q.kind,
                    spot_per_hour: self
                        .ledger
                        .price_book()
                        .and_then(|book| book.spot_price_at(&gk, to_us).ok().flatten()),
                });
                let us = |i: usize| (f(i).value(r) * 1e6).round() as i64;
                let (idle_spread, sm_spread) = spreads.get(&key).copied().unwrap_or_default();
                let g = GpuUse {
                    gpu_uuid: gpu.clone(),
                    host: host.clone(),
                    cluster,
                    gpu_model: model,
                    mig_profile: mig,
                    fb_total_bytes: (!total.is_null(r)).then(|| total.value(r)),
                    held_us: us(8),
                    known_us: us(9),
                    idle_us: us(10),
                    p95_sm: opt_f(11, r).or_else(|| opt_f(12, r)),
                    p95_mem_bytes: opt_f(13, r).map(|v| v.round() as i64),
                    idle_spread,
                    sm_spread,
                    price,
                };
                let entry = allocs.entry((owner.kind.as_str().to_owned(), owner.owner.clone())).or_insert_with(|| {
                    let resolved = self.ledger.teams().resolve(&gpu, &host, owner.clone());
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
        }
        let allocs: Vec<AllocationUse> = allocs.into_values().collect();
        let mut items = recommend::plan(&allocs, &[], &self.settings.rules, covered_us)?;
        for r in &mut items {
            let members = match &r.proposal {
                Some(p) => recommend::replay_members(&allocs, p),
                None => Vec::new(),
            };
            if !members.is_empty() {
                let series = self.series(&allocs, &members, &filter).await?;
                recommend::finish(r, &allocs, &series, covered_us)?;
            }
            let pairs: Vec<(String, String, String)> = match &r.proposal {
                Some(_) => members
                    .iter()
                    .map(|(a, g)| {
                        (allocs[*a].gpus[*g].gpu_uuid.clone(), allocs[*a].owner_kind.clone(), allocs[*a].owner.clone())
                    })
                    .collect(),
                None => r.gpus.iter().map(|g| (g.clone(), r.owner_kind.clone(), r.owner.clone())).collect(),
            };
            r.evidence.insert("sql".into(), serde_json::Value::String(self.evidence_sql(&pairs, from_us, to_us)));
        }
        items.sort_by(|a, b| b.monthly_savings.cmp(&a.monthly_savings).then(a.id.cmp(&b.id)));
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
            from_us,
            to_us,
            generated_at_us: now,
        })
    }

    /// How much of `(from, to]` the fleet's samples cover: from the start of the first
    /// window in it (its end less the longest window) to the end of the last (`None`
    /// when it holds no sample).
    async fn covered(&self, from_us: i64, to_us: i64) -> Result<Option<i64>, RecommendError> {
        let sql = format!(
            "SELECT CAST(min(time) AS BIGINT), CAST(max(time) AS BIGINT), CAST(max(window_s) * 1000000 AS BIGINT) \
             FROM gpu_samples WHERE time > {} AND time <= {}",
            ts(from_us),
            ts(to_us)
        );
        let batches = self.query(&sql).await?;
        let Some(b) = batches.iter().find(|b| b.num_rows() > 0) else { return Ok(None) };
        let col = |i: usize| b.column(i).as_primitive::<Int64Type>();
        let (first, last, window) = (col(0), col(1), col(2));
        if first.is_null(0) || last.is_null(0) {
            return Ok(None);
        }
        let start = first.value(0) - if window.is_null(0) { 0 } else { window.value(0) };
        let span = last.value(0).min(to_us) - start.max(from_us);
        Ok((span > 0).then_some(span))
    }

    /// The SQL that reproduces an item's held / known / idle figures.
    fn evidence_sql(&self, pairs: &[(String, String, String)], from_us: i64, to_us: i64) -> String {
        let which: Vec<String> = pairs
            .iter()
            .map(|(g, k, o)| {
                format!("(gpu_uuid = {} AND owner_kind = {} AND owner = {})", sql_str(g), sql_str(k), sql_str(o))
            })
            .collect();
        format!(
            "SELECT gpu_uuid, owner, sum(window_s) AS held_s, \
             sum(CASE WHEN sm_active_max IS NOT NULL OR gpu_util_max IS NOT NULL THEN window_s ELSE 0 END) AS known_s, \
             sum(CASE WHEN {} THEN window_s ELSE 0 END) AS idle_s, \
             approx_percentile_cont(0.95) WITHIN GROUP (ORDER BY CAST(sm_active AS DOUBLE)) AS p95_sm_active, \
             approx_percentile_cont(0.95) WITHIN GROUP (ORDER BY CAST(fb_used_bytes AS DOUBLE)) AS p95_fb_used_bytes \
             FROM gpu_samples WHERE time > {} AND time <= {} AND NOT gpu_lost AND ({}) GROUP BY gpu_uuid, owner ORDER BY gpu_uuid",
            self.ledger.classify_config().idle_sql(),
            ts(from_us),
            ts(to_us),
            which.join(" OR ")
        )
    }

    /// Per-minute series of `members`, in their order.
    async fn series(
        &self,
        allocs: &[AllocationUse],
        members: &[(usize, usize)],
        filter: &str,
    ) -> Result<Vec<Workload>, RecommendError> {
        let idle = self.ledger.classify_config().idle_sql();
        let which: Vec<String> = members
            .iter()
            .map(|(a, g)| {
                let (a, g) = (&allocs[*a], &allocs[*a].gpus[*g]);
                format!(
                    "(gpu_uuid = {} AND owner_kind = {} AND owner = {})",
                    sql_str(&g.gpu_uuid),
                    sql_str(&a.owner_kind),
                    sql_str(&a.owner)
                )
            })
            .collect();
        let sql = format!(
            "SELECT gpu_uuid, owner_kind, owner, \
             CAST(date_bin(INTERVAL '1 minute', time - INTERVAL '1 microsecond') AS TIMESTAMP) AS minute, \
             bool_or(NOT coalesce({idle}, true)), avg(CAST(coalesce(sm_active, gpu_util) AS DOUBLE)), \
             max(CAST(fb_used_bytes AS BIGINT)), least(sum(window_s), 60.0) \
             FROM gpu_samples WHERE {filter} AND ({}) GROUP BY 1, 2, 3, 4 ORDER BY 4",
            which.join(" OR ")
        );
        let batches = self.query(&sql).await?;
        let mut by_key: BTreeMap<(String, String, String), Vec<Bucket>> = BTreeMap::new();
        for b in &batches {
            let s = |i: usize| b.column(i).as_string::<i32>();
            let minute = b.column(3).as_primitive_opt::<TimestampMicrosecondType>();
            let minute_ns = b.column(3).as_primitive_opt::<datafusion::arrow::datatypes::TimestampNanosecondType>();
            let busy = b.column(4).as_boolean();
            let sm = b.column(5).as_primitive::<Float64Type>();
            let mem = b.column(6).as_primitive::<Int64Type>();
            let held = b.column(7).as_primitive::<Float64Type>();
            for r in 0..b.num_rows() {
                let start_us = match (minute, minute_ns) {
                    (Some(m), _) => m.value(r),
                    (None, Some(m)) => m.value(r) / 1000,
                    _ => return Err(RecommendError::Shape { sql: sql.clone(), expected: "a timestamp minute column" }),
                };
                by_key
                    .entry((s(0).value(r).to_owned(), s(1).value(r).to_owned(), s(2).value(r).to_owned()))
                    .or_default()
                    .push(Bucket {
                        start_us,
                        len_us: (held.value(r) * 1e6).round() as i64,
                        held: true,
                        busy: !busy.is_null(r) && busy.value(r),
                        sm: (!sm.is_null(r)).then(|| sm.value(r)),
                        mem_bytes: (!mem.is_null(r)).then(|| mem.value(r)),
                    });
            }
        }
        Ok(members
            .iter()
            .map(|(a, g)| {
                let (a, g) = (&allocs[*a], &allocs[*a].gpus[*g]);
                Workload {
                    name: format!("{} on {}", a.owner, g.gpu_uuid),
                    buckets: by_key
                        .remove(&(g.gpu_uuid.clone(), a.owner_kind.clone(), a.owner.clone()))
                        .unwrap_or_default(),
                }
            })
            .collect())
    }

    /// Computes the table's window ending at `to_us` and publishes it.
    pub async fn refresh_at(&self, to_us: i64) -> Result<usize, RecommendError> {
        let set = self.compute(self.settings.window, to_us).await?;
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

/// Monthly savings summed by savings kind.
fn savings_totals(items: &[Recommendation]) -> BTreeMap<&'static str, apron_cost::Cents> {
    let mut totals: BTreeMap<&'static str, apron_cost::Cents> = BTreeMap::new();
    for r in items {
        let e = totals.entry(r.savings_kind).or_insert(apron_cost::Cents::ZERO);
        *e = *e + r.monthly_savings_usd;
    }
    totals
}

impl RecommendationSet {
    /// Keeps the items `keep` accepts (a team's own), totals recomputed from them.
    pub fn retain(&mut self, keep: impl Fn(&Recommendation) -> bool) {
        self.recommendations.retain(|r| keep(r));
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
    ]))
}

fn recommendations_batch(set: &RecommendationSet) -> Result<RecordBatch, ArrowError> {
    let items = &set.recommendations;
    let n = items.len();
    let strs = |f: &dyn Fn(&Recommendation) -> Option<String>| -> ArrayRef {
        Arc::new(items.iter().map(f).collect::<StringArray>())
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
    ];
    RecordBatch::try_new(schema(), cols)
}
