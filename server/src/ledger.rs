//! The cost ledger: `gpu_samples` windows (with who held each GPU) → the `allocations`
//! and `gpu_cost_hourly` partitions, priced by the price book, recomputed when a day's
//! inputs change.
//!
//! ```text
//!  every [cost] interval (default 5m), one pass at a time:
//!    for each UTC day D with raw gpu_samples (files or memtable) within raw retention:
//!      dirty = rows of D−1..D+1 still in memory, or their raw files differ from
//!              <data>/derived/cost.json, or the price book / thresholds changed
//!      per GPU (MIG parents excluded: instances carry cost), windows in
//!        (D − S, min(D + 1 d + S, now)]   S = the longest stranded_after (context)
//!      → apron_cost::classify (holders from the owner columns, teams resolved in the
//!        brief's order, static GPU/host maps as dedicated allocations)
//!      → apron_cost::hourly_cost → gpu_cost_hourly rows of D's hours up to now
//!      → runs of one holder that start in D → allocations rows (end_time from a
//!        forward look when the run outlives the window; NULL while still held;
//!        held_through: the end of the run's newest window seen)
//!      Store::replace_partition(gpu_cost_hourly, D) and (allocations, D)
//! ```
//!
//! Why the context S: a window's state depends only on data within S of it (the
//! classifier's `recompute_plan` proves it), so a day computed with S either side is
//! exact. Money is exact micro-dollars from the classifier's exact microseconds; nothing
//! is a float once classified. A GPU whose model has no price gets NULL money (reported,
//! never $0).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use apron_collector::{Store, Table};
use apron_common::UnixMicros;
use apron_cost::team::AllocationFacts;
use apron_cost::{ClassifyConfig, GpuKey, Holder, HolderId, PriceBook, TeamConfig, Window};
use apron_query::{QueryEngine, TableSource};
use datafusion::arrow::array::{
    Array, ArrayRef, AsArray, BooleanArray, Decimal128Array, RecordBatch, StringArray, TimestampMicrosecondArray,
};
use datafusion::arrow::datatypes::{Float64Type, TimestampMicrosecondType};
use serde::{Deserialize, Serialize};

const DAY_US: i64 = 86_400_000_000;
/// How far back a process sample still speaks for a window (the agent samples processes
/// every 5 s by default).
const PROCESS_SAMPLE_REACH_US: i64 = 10_000_000;

/// `[cost]`: the ledger's settings.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CostConfig {
    pub enabled: bool,
    #[serde(deserialize_with = "humantime_duration")]
    pub interval: Duration,
    /// The price book (TOML). None: every hour's money is NULL (unpriced), seconds are
    /// still classified.
    pub price_book: Option<PathBuf>,
    /// Idle / under-used thresholds and `stranded_after` (with overrides).
    pub classify: ClassifyConfig,
    /// Team resolution maps, workload-kind and interruptible rules.
    pub teams: TeamConfig,
}

impl Default for CostConfig {
    fn default() -> Self {
        CostConfig {
            enabled: true,
            interval: Duration::from_secs(300),
            price_book: None,
            classify: ClassifyConfig::default(),
            teams: TeamConfig::default(),
        }
    }
}

pub(crate) fn humantime_duration<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let s = String::deserialize(d)?;
    let v = humantime::parse_duration(&s).map_err(serde::de::Error::custom)?;
    if v < Duration::from_secs(1) {
        return Err(serde::de::Error::custom("at least 1s"));
    }
    Ok(v)
}

/// What one pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LedgerReport {
    /// `(date, gpu_cost_hourly rows, allocations rows)` of the days recomputed.
    pub computed: Vec<(String, usize, usize)>,
    pub errors: Vec<String>,
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
    pass: tokio::sync::Mutex<()>,
    /// Asks the running loop for a pass now (e.g. when a backfill has landed).
    kick: tokio::sync::Notify,
}

/// One holder's facts as the windows carry them (the owner columns).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Owner {
    pub(crate) kind: String,
    pub(crate) owner: String,
    pub(crate) namespace: Option<String>,
    pub(crate) job_id: Option<String>,
    pub(crate) user: Option<String>,
    pub(crate) account: Option<String>,
    pub(crate) partition: Option<String>,
    pub(crate) qos: Option<String>,
    pub(crate) labels: Option<String>,
}

/// The owner columns of `gpu_samples`, quoted (`partition` is an SQL keyword), in the
/// order [`owner_at`] reads them.
pub(crate) const OWNER_COLUMNS_SQL: &str = "\"owner_kind\", \"owner\", \"namespace\", \"job_id\", \"owner_user\", \"account\", \"partition\", \"qos\", \"pod_labels\"";

/// The owner of row `r`, from the [`OWNER_COLUMNS_SQL`] columns starting at `first`;
/// `None` when nobody holds the GPU (or the columns are not strings).
pub(crate) fn owner_at(b: &RecordBatch, first: usize, r: usize) -> Option<Owner> {
    let s = |i: usize| b.column(first + i).as_string_opt::<i32>();
    let opt = |i: usize| s(i).filter(|c| !c.is_null(r)).map(|c| c.value(r).to_owned());
    Some(Owner {
        kind: opt(0)?,
        owner: opt(1)?,
        namespace: opt(2),
        job_id: opt(3),
        user: opt(4),
        account: opt(5),
        partition: opt(6),
        qos: opt(7),
        labels: opt(8),
    })
}

impl Owner {
    /// The labels as a map (the column holds a JSON object; non-string values are skipped).
    pub(crate) fn label_map(&self) -> BTreeMap<String, String> {
        self.labels
            .as_deref()
            .and_then(|l| serde_json::from_str::<BTreeMap<String, serde_json::Value>>(l).ok())
            .map(|m| m.into_iter().filter_map(|(k, v)| v.as_str().map(|s| (k, s.to_owned()))).collect())
            .unwrap_or_default()
    }
}

/// A resolved holder: its owner, team, kind, whether interruptible.
#[derive(Debug, Clone)]
pub(crate) struct Resolved {
    pub(crate) owner: Owner,
    pub(crate) team: String,
    pub(crate) workload_kind: Option<String>,
    pub(crate) interruptible: bool,
}

/// One GPU's windows of the context range.
struct GpuWindows {
    host: String,
    cluster: Option<String>,
    model: String,
    mig_profile: Option<String>,
    windows: Vec<Window>,
    holders: Vec<Resolved>,
}

/// A SQL string literal.
pub(crate) fn sql_str(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// A SQL timestamp literal (RFC 3339, UTC).
pub(crate) fn ts(us: i64) -> String {
    format!("TIMESTAMP '{}'", UnixMicros(us).to_rfc3339())
}

/// The first string column of `sql`'s rows, NULLs left out.
pub(crate) async fn strings(engine: &QueryEngine, sql: &str) -> Result<Vec<String>, String> {
    let result = engine.execute_internal(sql).await.map_err(|e| format!("{e} (in: {sql})"))?;
    let mut out = Vec::new();
    for b in &result.batches {
        let col = b.column(0).as_string_opt::<i32>().ok_or_else(|| format!("not a string column (in: {sql})"))?;
        out.extend(col.iter().flatten().map(str::to_owned));
    }
    Ok(out)
}

/// The MIG parents among the windows of `range`: their activity is their instances',
/// so the evaluators leave them out. Asked first, as a short list, because DataFusion
/// plans `gpu_uuid NOT IN (SELECT parent_gpu_uuid …)` as an anti join that holds every
/// matching window of the outer scan in memory (measured: 1.38 M windows → +500 MiB).
pub(crate) async fn mig_parent_uuids(engine: &QueryEngine, range: &str) -> Result<BTreeSet<String>, String> {
    let sql = format!("SELECT DISTINCT parent_gpu_uuid FROM gpu_samples WHERE {range} AND parent_gpu_uuid IS NOT NULL");
    Ok(strings(engine, &sql).await?.into_iter().collect())
}

/// ` AND gpu_uuid NOT IN ('…', …)` for `gpus`, or nothing when there are none.
pub(crate) fn gpus_excluded_sql(gpus: &BTreeSet<String>) -> String {
    if gpus.is_empty() {
        return String::new();
    }
    let list: Vec<String> = gpus.iter().map(|g| sql_str(g)).collect();
    format!(" AND gpu_uuid NOT IN ({})", list.join(", "))
}

impl Ledger {
    /// Loads the price book (a bad one is an error: costs would be wrong).
    pub fn new(store: Arc<Store>, engine: Arc<QueryEngine>, config: CostConfig) -> Result<Ledger, String> {
        let book = match &config.price_book {
            None => None,
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|e| format!("price book {}: {e}", p.display()))?;
                Some(PriceBook::from_toml(&text).map_err(|e| format!("price book {}: {e}", p.display()))?)
            }
        };
        config.classify.validate().map_err(|e| format!("[cost.classify]: {e}"))?;
        config.teams.validate().map_err(|e| format!("[cost.teams]: {e}"))?;
        Ok(Ledger { store, engine, config, book, pass: tokio::sync::Mutex::new(()), kick: tokio::sync::Notify::new() })
    }

    /// Asks the running loop ([`Ledger::run`]) for a pass as soon as it can.
    pub fn kick(&self) {
        self.kick.notify_one();
    }

    /// Thresholds and `stranded_after` policy.
    pub(crate) fn classify_config(&self) -> &ClassifyConfig {
        &self.config.classify
    }

    /// The classifier's idle test of a `gpu_samples` window in SQL (NULL when the window
    /// has no signal), for the evaluators' queries.
    pub(crate) fn idle_sql(&self) -> String {
        let c = &self.config.classify;
        format!(
            "(CASE WHEN sm_active_max IS NOT NULL THEN CAST(sm_active_max AS DOUBLE) < {} \
             WHEN gpu_util_max IS NOT NULL THEN CAST(gpu_util_max AS DOUBLE) <= {} END)",
            c.idle_sm_active_max, c.idle_gpu_util_max
        )
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
        let _one_pass = self.pass.lock().await;
        let mut report = LedgerReport::default();
        let path = self.state_path();
        let mut state: LedgerState =
            std::fs::read(&path).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default();
        let key = self.key();
        if state.key != key {
            state = LedgerState { key, days: BTreeMap::new() };
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
        let days: BTreeSet<i64> =
            files.keys().chain(in_memory.iter()).copied().filter(|&d| d >= oldest && d * DAY_US <= now_us).collect();
        // Newest first: today's and yesterday's hours are what people look at first (a
        // fresh install's seeded history shows its dollars sooner).
        for day in days.into_iter().rev() {
            let signature: Vec<(String, u64)> =
                (day - 1..=day + 1).flat_map(|d| files.get(&d).cloned().unwrap_or_default()).collect();
            let memory = (day - 1..=day + 1).any(|d| in_memory.contains(&d));
            // Today is never final: its hours advance with the clock.
            let today = day == now_us.div_euclid(DAY_US);
            if !memory && !today && state.days.get(&day) == Some(&signature) {
                continue;
            }
            let date = crate::derive::date_string(day);
            let started = std::time::Instant::now();
            match self.compute_day(day, now_us).await {
                Ok((cost_rows, alloc_rows)) => {
                    tracing::info!(%date, cost_rows, alloc_rows, elapsed_ms = started.elapsed().as_millis() as u64, "computed gpu_cost_hourly and allocations");
                    report.computed.push((date, cost_rows, alloc_rows));
                    if !memory {
                        state.days.insert(day, signature);
                    }
                }
                Err(e) => {
                    tracing::warn!(%date, error = %e, "cost ledger: day failed; retried at the next pass");
                    report.errors.push(format!("{date}: {e}"));
                }
            }
        }
        state.days.retain(|d, _| *d >= oldest);
        if let Err(e) = save_state(&path, &state) {
            report.errors.push(e);
        }
        report
    }

    async fn query(&self, sql: &str) -> Result<Vec<RecordBatch>, String> {
        self.engine.execute_internal(sql).await.map(|r| r.batches).map_err(|e| format!("{e} (in: {sql})"))
    }

    /// Recomputes day `day`'s partitions of `gpu_cost_hourly` and `allocations`.
    async fn compute_day(&self, day: i64, now_us: i64) -> Result<(usize, usize), String> {
        let s = self.config.classify.max_stranded_after_us();
        let day_start = day * DAY_US;
        let day_end = day_start + DAY_US;
        let (lo, hi) = (day_start - s, (day_end + s).min(now_us.max(day_start)));
        // Hours of D up to the current hour's end.
        let to_us = day_end.min(apron_cost::time::hour_ceil(now_us)).max(day_start);
        let range = format!("time > {} AND time <= {}", ts(lo), ts(hi));
        let parents = mig_parent_uuids(&self.engine, &range).await?;
        let gpus = strings(
            &self.engine,
            &format!("SELECT DISTINCT gpu_uuid FROM gpu_samples WHERE {range} ORDER BY gpu_uuid"),
        )
        .await?;
        let mut cost = CostRows::default();
        let mut allocs = AllocRows::default();
        for uuid in gpus.iter().filter(|g| !parents.contains(*g)) {
            let g = self.gpu_windows(uuid, &range).await?;
            if g.windows.is_empty() {
                continue;
            }
            self.cost_rows(uuid, &g, day_start, to_us, &mut cost)?;
            self.allocation_rows(uuid, &g, day_start, day_end, hi, now_us, &mut allocs).await?;
        }
        self.mig_parents(&range, day_start, to_us, &mut cost).await?;
        let date = crate::derive::date_string(day);
        let (n_cost, n_alloc) = (cost.len(), allocs.len());
        let cost_batch = cost.finish()?;
        let alloc_batch = allocs.finish()?;
        let store = self.store.clone();
        tokio::task::spawn_blocking(move || {
            store.replace_partition(Table::GpuCostHourly, &date, &[cost_batch])?;
            store.replace_partition(Table::Allocations, &date, &[alloc_batch])
        })
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("storing: {e}"))?;
        Ok((n_cost, n_alloc))
    }

    async fn gpu_windows(&self, uuid: &str, range: &str) -> Result<GpuWindows, String> {
        let batches = self
            .query(&format!(
                // Quoted: `cluster` is an SQL keyword.
                "SELECT time, window_s, CAST(sm_active_max AS DOUBLE), CAST(gpu_util_max AS DOUBLE), \
                 CAST(sm_active AS DOUBLE), \"host\", \"cluster\", \"gpu_model\", \"mig_profile\", {OWNER_COLUMNS_SQL} \
                 FROM gpu_samples WHERE gpu_uuid = {} AND {range} ORDER BY time",
                sql_str(uuid)
            ))
            .await?;
        let mut g = GpuWindows {
            host: String::new(),
            cluster: None,
            model: String::new(),
            mig_profile: None,
            windows: Vec::new(),
            holders: Vec::new(),
        };
        let mut index: BTreeMap<Owner, HolderId> = BTreeMap::new();
        for b in &batches {
            let time = b.column(0).as_primitive::<TimestampMicrosecondType>();
            let window = b.column(1).as_primitive::<Float64Type>();
            let f = |i: usize| b.column(i).as_primitive::<Float64Type>();
            let (sm_max, util_max, sm_mean) = (f(2), f(3), f(4));
            let s = |i: usize| b.column(i).as_string::<i32>();
            let opt = |i: usize, r: usize| (!s(i).is_null(r)).then(|| s(i).value(r).to_owned());
            for r in 0..b.num_rows() {
                if g.host.is_empty() {
                    g.host = s(5).value(r).to_owned();
                    g.cluster = opt(6, r);
                    g.model = s(7).value(r).to_owned();
                    g.mig_profile = opt(8, r);
                }
                let val = |a: &datafusion::arrow::array::Float64Array| (!a.is_null(r)).then(|| a.value(r));
                let owner = match owner_at(b, 9, r) {
                    Some(o) => Some(o),
                    // Nobody holds it: a static map entry is a dedicated allocation.
                    None => self.static_owner(uuid, &g.host),
                };
                let holder = match owner {
                    None => None,
                    Some(o) => Some(match index.get(&o) {
                        Some(id) => *id,
                        None => {
                            let id = HolderId(g.holders.len());
                            g.holders.push(self.resolve(uuid, &g.host, o.clone()));
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
        self.process_owners(uuid, range, &mut g, &mut index).await?;
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
    ) -> Result<(), String> {
        let users = &self.config.teams.users;
        if users.is_empty() || g.windows.iter().all(|w| w.holder.is_some()) {
            return Ok(());
        }
        let batches = self
            .query(&format!(
                "SELECT time, \"user\" FROM gpu_processes WHERE gpu_uuid = {} AND {range} AND \"user\" IS NOT NULL \
                 ORDER BY time, \"user\"",
                sql_str(uuid)
            ))
            .await?;
        // (sample time, user) of mapped users, in time order.
        let mut samples: Vec<(i64, String)> = Vec::new();
        for b in &batches {
            let (t, u) = (b.column(0).as_primitive::<TimestampMicrosecondType>(), b.column(1).as_string::<i32>());
            for r in 0..b.num_rows() {
                if users.contains_key(u.value(r)) {
                    samples.push((t.value(r), u.value(r).to_owned()));
                }
            }
        }
        if samples.is_empty() {
            return Ok(());
        }
        for w in g.windows.iter_mut().filter(|w| w.holder.is_none()) {
            // The latest process sample at or before the window's end, if recent: the
            // process list is sampled every few seconds, not every window.
            let i = samples.partition_point(|(t, _)| *t <= w.end_us);
            let Some((t, user)) = i.checked_sub(1).map(|i| &samples[i]) else { continue };
            if w.end_us - t > PROCESS_SAMPLE_REACH_US {
                continue;
            }
            let owner = Owner {
                kind: "process".into(),
                owner: user.clone(),
                namespace: None,
                job_id: None,
                user: Some(user.clone()),
                account: None,
                partition: None,
                qos: None,
                labels: None,
            };
            w.holder = Some(match index.get(&owner) {
                Some(id) => *id,
                None => {
                    let id = HolderId(g.holders.len());
                    g.holders.push(self.resolve(uuid, &g.host, owner.clone()));
                    index.insert(owner, id);
                    id
                }
            });
        }
        Ok(())
    }

    /// MIG: instances carry cost and state (they are GPUs of their own above); the
    /// parent's capacity that no instance holds is the parent's unallocated idle,
    /// priced at its compute share — `(7 − Σ instance slices)/7` of the parent's price
    /// (the price book's n/7 rule, through the profile `"<free>g.unallocated"`). The
    /// parent's own activity fields describe its instances, so they are not classified.
    async fn mig_parents(&self, range: &str, from: i64, to: i64, out: &mut CostRows) -> Result<(), String> {
        let batches = self
            .query(&format!(
                "SELECT DISTINCT parent_gpu_uuid, gpu_uuid, mig_profile FROM gpu_samples \
                 WHERE {range} AND parent_gpu_uuid IS NOT NULL ORDER BY parent_gpu_uuid, gpu_uuid"
            ))
            .await?;
        let mut slices: BTreeMap<String, u32> = BTreeMap::new();
        for b in &batches {
            let (parent, profile) = (b.column(0).as_string::<i32>(), b.column(2).as_string::<i32>());
            for r in 0..b.num_rows() {
                let n = (!profile.is_null(r)).then(|| apron_cost::pricebook::mig_slices(profile.value(r))).flatten();
                *slices.entry(parent.value(r).to_owned()).or_default() += u32::from(n.unwrap_or(0));
            }
        }
        for (parent, used) in slices {
            let free = 7u32.saturating_sub(used);
            if free == 0 {
                continue;
            }
            let mut g = self.gpu_windows(&parent, range).await?;
            if g.windows.is_empty() {
                continue;
            }
            g.holders.clear();
            for w in &mut g.windows {
                w.holder = None;
                w.sm_active_max = Some(0.0);
                w.gpu_util_max = Some(0.0);
                w.sm_active_mean = Some(0.0);
            }
            g.mig_profile = Some(format!("{free}g.unallocated"));
            self.cost_rows(&parent, &g, from, to, out)?;
        }
        Ok(())
    }

    pub(crate) fn static_owner(&self, uuid: &str, host: &str) -> Option<Owner> {
        let teams = &self.config.teams;
        let team = teams.gpus.get(uuid).or_else(|| teams.hosts.get(host))?;
        Some(Owner {
            kind: "static".into(),
            owner: format!("static:{team}"),
            namespace: None,
            job_id: None,
            user: None,
            account: None,
            partition: None,
            qos: None,
            labels: None,
        })
    }

    pub(crate) fn resolve(&self, uuid: &str, host: &str, owner: Owner) -> Resolved {
        let labels = owner.label_map();
        let facts = AllocationFacts {
            labels,
            namespace: owner.namespace.clone(),
            slurm_account: owner.account.clone(),
            slurm_partition: owner.partition.clone(),
            slurm_qos: owner.qos.clone(),
            gpu_uuid: Some(uuid.to_owned()),
            host: Some(host.to_owned()),
            unix_user: owner.user.clone(),
            markers: Vec::new(),
        };
        let teams = &self.config.teams;
        Resolved {
            team: teams.resolve_team(&facts).team,
            workload_kind: teams.workload_kind(&facts),
            interruptible: teams.interruptible(&facts),
            owner,
        }
    }

    fn cost_rows(&self, uuid: &str, g: &GpuWindows, from: i64, to: i64, out: &mut CostRows) -> Result<(), String> {
        if to <= from {
            return Ok(());
        }
        let holders: Vec<Holder> =
            g.holders.iter().map(|h| Holder { team: h.team.clone(), workload_kind: h.workload_kind.clone() }).collect();
        let classified = apron_cost::classify(&g.windows, &holders, &self.config.classify, from, to)
            .map_err(|e| format!("classifying {uuid}: {e}"))?;
        let key = GpuKey { model_name: &g.model, mig_profile: g.mig_profile.as_deref(), cluster: g.cluster.as_deref() };
        match &self.book {
            Some(book) => {
                for row in
                    apron_cost::hourly_cost(&classified, book, &key).map_err(|e| format!("pricing {uuid}: {e}"))?
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

    /// Runs of one holder that start in `[day_start, day_end)`.
    #[allow(clippy::too_many_arguments)]
    async fn allocation_rows(
        &self,
        uuid: &str,
        g: &GpuWindows,
        day_start: i64,
        day_end: i64,
        fetched_to: i64,
        now_us: i64,
        out: &mut AllocRows,
    ) -> Result<(), String> {
        let w = &g.windows;
        let mut i = 0;
        while i < w.len() {
            let Some(h) = w[i].holder else {
                i += 1;
                continue;
            };
            let mut j = i;
            // A run: consecutive windows of one holder with no gap longer than a window.
            while j + 1 < w.len()
                && w[j + 1].holder == Some(h)
                && w[j + 1].end_us - w[j + 1].window_us <= w[j].end_us + w[j].window_us
            {
                j += 1;
            }
            let start = w[i].end_us - w[i].window_us;
            if (day_start..day_end).contains(&start)
                && !(i > 0 && w[i - 1].holder == Some(h) && start - w[i - 1].end_us <= w[i].window_us)
            {
                let resolved = &g.holders[h.0];
                let last = w[j].end_us;
                let (end, held) = if j + 1 < w.len() {
                    (Some(last), last)
                } else if fetched_to < now_us {
                    self.run_end(uuid, &resolved.owner, fetched_to).await?
                } else {
                    (None, last)
                };
                let end = match end {
                    // Held to the newest data: still held unless the data is old.
                    None if j + 1 == w.len() && fetched_to >= now_us && now_us - last > 10 * 60_000_000 => Some(last),
                    e => e,
                };
                out.push(uuid, g, (start, end, held), resolved);
            }
            i = j + 1;
        }
        Ok(())
    }

    /// The end of a run that continues past `after`: the last window of the same owner
    /// before the first window of another owner (or none; `None` while still held), and
    /// the end of the newest window of the run seen (its `held_through`).
    async fn run_end(&self, uuid: &str, owner: &Owner, after: i64) -> Result<(Option<i64>, i64), String> {
        let same = format!("owner_kind = {} AND owner = {}", sql_str(&owner.kind), sql_str(&owner.owner));
        let base = format!("gpu_uuid = {} AND time > {}", sql_str(uuid), ts(after));
        let next = self
            .query(&format!("SELECT min(time) FROM gpu_samples WHERE {base} AND NOT coalesce({same}, false)"))
            .await?;
        let before_next = match first_ts(&next) {
            Some(next) => format!(" AND time < {}", ts(next)),
            None => String::new(),
        };
        let last =
            self.query(&format!("SELECT max(time) FROM gpu_samples WHERE {base}{before_next} AND {same}")).await?;
        let last = first_ts(&last).unwrap_or(after);
        Ok((first_ts(&next).map(|_| last), last))
    }
}

fn first_ts(batches: &[RecordBatch]) -> Option<i64> {
    let b = batches.first()?;
    let c = b.column(0).as_primitive_opt::<TimestampMicrosecondType>()?;
    (b.num_rows() > 0 && !c.is_null(0)).then(|| c.value(0))
}

fn save_state(path: &std::path::Path, state: &LedgerState) -> Result<(), String> {
    let bytes = serde_json::to_vec(state).map_err(|e| e.to_string())?;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    apron_collector::write_atomic(path, &bytes).map_err(|e| format!("{}: {e}", path.display()))
}

/// `gpu_cost_hourly` rows being built, in its wire schema.
#[derive(Default)]
struct CostRows {
    hour: Vec<i64>,
    cluster: Vec<Option<String>>,
    host: Vec<String>,
    gpu_uuid: Vec<String>,
    gpu_model: Vec<String>,
    team: Vec<String>,
    seconds: [Vec<i128>; 7],
    money: [Vec<Option<i128>>; 4],
}

impl CostRows {
    fn len(&self) -> usize {
        self.hour.len()
    }

    fn push(
        &mut self,
        hour: i64,
        g: &GpuWindows,
        uuid: &str,
        team: &str,
        m: &apron_cost::StateMicros,
        money: Option<&apron_cost::HourMoney>,
    ) {
        self.hour.push(hour);
        self.cluster.push(g.cluster.clone());
        self.host.push(g.host.clone());
        self.gpu_uuid.push(uuid.to_owned());
        self.gpu_model.push(g.model.clone());
        self.team.push(team.to_owned());
        // Microseconds are the Decimal128(18, 6) seconds' unscaled integer.
        let secs =
            [m.active, m.allocated_idle, m.stranded, m.unallocated_idle, m.unallocated_busy, m.unknown, m.underused];
        for (col, v) in self.seconds.iter_mut().zip(secs) {
            col.push(i128::from(v));
        }
        let cash = money.map(|x| [x.price_per_gpu_hour, x.cost_usd, x.idle_cost_usd, x.stranded_cost_usd]);
        for (k, col) in self.money.iter_mut().enumerate() {
            col.push(cash.map(|c| i128::from(c[k].0)));
        }
    }

    fn finish(self) -> Result<RecordBatch, String> {
        let schema = Table::GpuCostHourly.schema();
        let dec = |v: Vec<Option<i128>>| -> Result<ArrayRef, String> {
            Ok(std::sync::Arc::new(
                Decimal128Array::from(v).with_precision_and_scale(18, 6).map_err(|e| e.to_string())?,
            ))
        };
        let mut cols: Vec<ArrayRef> = vec![
            std::sync::Arc::new(TimestampMicrosecondArray::from(self.hour).with_timezone("UTC")),
            std::sync::Arc::new(StringArray::from(self.cluster)),
            std::sync::Arc::new(StringArray::from(self.host)),
            std::sync::Arc::new(StringArray::from(self.gpu_uuid)),
            std::sync::Arc::new(StringArray::from(self.gpu_model)),
            std::sync::Arc::new(StringArray::from(self.team)),
        ];
        for s in self.seconds {
            cols.push(dec(s.into_iter().map(Some).collect())?);
        }
        for m in self.money {
            cols.push(dec(m)?);
        }
        RecordBatch::try_new(schema, cols).map_err(|e| e.to_string())
    }
}

/// `allocations` rows being built.
#[derive(Default)]
struct AllocRows {
    gpu_uuid: Vec<String>,
    host: Vec<String>,
    start: Vec<i64>,
    end: Vec<Option<i64>>,
    owner_kind: Vec<String>,
    owner: Vec<String>,
    team: Vec<String>,
    workload_kind: Vec<Option<String>>,
    interruptible: Vec<bool>,
    source: Vec<String>,
    cluster: Vec<Option<String>>,
    held_through: Vec<Option<i64>>,
}

impl AllocRows {
    fn len(&self) -> usize {
        self.start.len()
    }

    fn push(&mut self, uuid: &str, g: &GpuWindows, (start, end, held): (i64, Option<i64>, i64), h: &Resolved) {
        self.gpu_uuid.push(uuid.to_owned());
        self.host.push(g.host.clone());
        self.start.push(start);
        self.end.push(end);
        self.owner_kind.push(h.owner.kind.clone());
        self.owner.push(h.owner.owner.clone());
        self.team.push(h.team.clone());
        self.workload_kind.push(h.workload_kind.clone());
        self.interruptible.push(h.interruptible);
        self.source.push(
            match h.owner.kind.as_str() {
                "pod" => "kubernetes",
                "slurm_job" => "slurm",
                other => other,
            }
            .to_owned(),
        );
        self.cluster.push(g.cluster.clone());
        self.held_through.push(Some(end.unwrap_or(held)));
    }

    fn finish(self) -> Result<RecordBatch, String> {
        let t = |v: Vec<Option<i64>>| std::sync::Arc::new(TimestampMicrosecondArray::from(v).with_timezone("UTC"));
        let cols: Vec<ArrayRef> = vec![
            std::sync::Arc::new(StringArray::from(self.gpu_uuid)),
            std::sync::Arc::new(StringArray::from(self.host)),
            t(self.start.into_iter().map(Some).collect()),
            t(self.end),
            std::sync::Arc::new(StringArray::from(self.owner_kind)),
            std::sync::Arc::new(StringArray::from(self.owner)),
            std::sync::Arc::new(StringArray::from(self.team)),
            std::sync::Arc::new(StringArray::from(self.workload_kind)),
            std::sync::Arc::new(BooleanArray::from(self.interruptible)),
            std::sync::Arc::new(StringArray::from(self.source)),
            std::sync::Arc::new(StringArray::from(self.cluster)),
            t(self.held_through),
        ];
        RecordBatch::try_new(Table::Allocations.schema(), cols).map_err(|e| e.to_string())
    }
}

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

/// Totals of the stored `gpu_cost_hourly`, refreshed after every ledger pass, for the
/// server's `/metrics`: `apron_idle_cost_dollars_total{team,kind}` and
/// `apron_gpu_seconds_total{team,state}`. They are sums over the rows the store holds
/// (derived retention, 400 d by default), so a recomputation or retention can lower
/// them; `rate()` over them is still right between such events.
#[derive(Debug, Default, Clone)]
pub struct CostMetrics {
    inner: Arc<std::sync::Mutex<Totals>>,
}

#[derive(Debug, Default)]
struct Totals {
    /// (team, kind) → dollars.
    idle: Vec<(String, &'static str, f64)>,
    /// (team, state) → seconds.
    seconds: Vec<(String, &'static str, f64)>,
}

const STATES: [&str; 7] =
    ["active", "allocated_idle", "stranded", "unallocated_idle", "unallocated_busy", "unknown", "underused"];

impl CostMetrics {
    fn set(&self, totals: Totals) {
        *self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = totals;
    }
}

impl prometheus_client::collector::Collector for CostMetrics {
    fn encode(&self, mut enc: prometheus_client::encoding::DescriptorEncoder) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::MetricType;
        use prometheus_client::metrics::counter::ConstCounter;
        let t = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut d = enc.encode_descriptor(
            "apron_idle_cost_dollars",
            "Idle cost in US dollars by team and kind (allocated_idle, stranded, unallocated_idle), summed over the stored gpu_cost_hourly rows.",
            None,
            MetricType::Counter,
        )?;
        for (team, kind, v) in &t.idle {
            let labels = vec![("team".to_owned(), team.clone()), ("kind".to_owned(), (*kind).to_owned())];
            ConstCounter::new(*v).encode(d.encode_family(&labels)?)?;
        }
        let mut d = enc.encode_descriptor(
            "apron_gpu",
            "GPU time by team and state (exclusive states; underused is a part of active), summed over the stored gpu_cost_hourly rows.",
            Some(&prometheus_client::registry::Unit::Seconds),
            MetricType::Counter,
        )?;
        for (team, state, v) in &t.seconds {
            let labels = vec![("team".to_owned(), team.clone()), ("state".to_owned(), (*state).to_owned())];
            ConstCounter::new(*v).encode(d.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

impl Ledger {
    /// Refreshes `metrics` from the stored `gpu_cost_hourly`.
    pub async fn refresh_metrics(&self, metrics: &CostMetrics) -> Result<(), String> {
        let cols = STATES.map(|s| format!("CAST(sum({s}_s) AS DOUBLE)")).join(", ");
        let sql = format!(
            // The difference in exact decimals, then one conversion to a float.
            "SELECT team, {cols}, CAST(sum(coalesce(idle_cost_usd, 0)) AS DOUBLE), \
             CAST(sum(coalesce(stranded_cost_usd, 0)) AS DOUBLE), \
             CAST(sum(coalesce(idle_cost_usd, 0) - coalesce(stranded_cost_usd, 0)) AS DOUBLE) \
             FROM gpu_cost_hourly GROUP BY team ORDER BY team"
        );
        let mut totals = Totals::default();
        for b in self.query(&sql).await? {
            let team = b.column(0).as_string::<i32>();
            let f = |i: usize, r: usize| {
                let c = b.column(i).as_primitive::<Float64Type>();
                if c.is_null(r) { 0.0 } else { c.value(r) }
            };
            for r in 0..b.num_rows() {
                let name = team.value(r).to_owned();
                for (i, state) in STATES.iter().enumerate() {
                    totals.seconds.push((name.clone(), state, f(1 + i, r)));
                }
                let (idle, stranded, allocated_idle) = (f(8, r), f(9, r), f(10, r));
                // A row is either the `unallocated` team's (all its idle is unallocated
                // idle) or a holder's team (allocated idle + stranded).
                if name == apron_cost::UNALLOCATED {
                    totals.idle.push((name, "unallocated_idle", idle));
                } else {
                    totals.idle.push((name.clone(), "stranded", stranded));
                    totals.idle.push((name, "allocated_idle", allocated_idle));
                }
            }
        }
        metrics.set(totals);
        Ok(())
    }
}
