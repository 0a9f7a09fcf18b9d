//! Live alerts: stranded allocations, zombie memory, unallocated busy GPUs, lost GPUs
//! and XID errors, evaluated from the query layer and delivered to Alertmanager and a
//! webhook.
//!
//! ```text
//!  every [alerts] interval (30 s):
//!    gpu_samples windows of the lookback (the longest stranded_after + max_idle_gap +
//!    the longest other hold + 10 min), read `gpus_per_query` GPUs at a time (memory follows
//!    that, not the fleet), owners resolved to teams as the ledger does, prices from
//!    the price book
//!      └─► apron_cost::alert::Tracker, carried from pass to pass: a pass reads only
//!          the windows since the previous pass (less OVERLAP, for windows still in
//!          flight from agents) and feeds them on; the whole lookback is read again
//!          (the tracker rebuilt) on the first pass, every REBUILD_EVERY, when ingest
//!          reports rows older than the carried read (late and backfilled data count
//!          like live data), when a fed GPU turns out to be a MIG parent, or without a
//!          change feed; idle runs reaching back to the lookback's start are followed
//!          further back (up to 7 d), all of a pass's new ones with one query, remembered
//!      └─► conditions ─► [alerts.exempt] ─► Lifecycle
//!    ─► <data>/derived/alerts.json (episodes + delivery marks, so a restart neither
//!       loses nor repeats an alert), the `alerts` table, /metrics
//!    ─► Alertmanager (API v2): every firing alert each pass (endsAt = now + 4 intervals,
//!       so a dead Apron's alerts expire) and each resolved one until acknowledged
//!    ─► webhook (Slack-compatible `text` + the alert as `apron`): each transition once
//! ```
//!
//! The alert and the hourly `stranded_s` use the same rules (the classifier's idle test,
//! `stranded_after` with its team and workload-kind overrides and `max_idle_gap` from
//! `[cost.classify]`, and the one idle-run rule of `apron_cost::idlerun`, which the
//! look further back below states in SQL).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use apron_collector::changes::{ChangeFeed, Changed};
use apron_common::UnixMicros;
use apron_common::wire::Table;
use apron_cost::GpuKey;
use apron_cost::alert::{
    AlertRecord, AlertRules, AlertState, Exemptions, GpuMeta, HolderFacts, Lifecycle, Sample, Tracker,
};
use apron_query::{QueryEngine, SnapshotTable};
use datafusion::arrow::array::{
    Array, ArrayRef, AsArray, Decimal128Array, Float64Array, Int64Array, RecordBatch, StringArray,
    TimestampMicrosecondArray,
};
use datafusion::arrow::datatypes::{
    DataType, Field, Float64Type, Int64Type, Schema, SchemaRef, TimeUnit, TimestampMicrosecondType,
};
use serde::Deserialize;

use crate::deliver::DeliveryError;
use crate::ledger::Ledger;
use crate::schedule::WebhookConfig;
use crate::sqlutil::{
    OWNER_COLUMNS_SQL, SqlError, mig_parent_uuids, owner_at, run_key, sql_str, str_list, strings, ts,
};
use crate::statefile::FileError;

/// Why an alert pass failed (the pass is retried at the next interval).
#[derive(Debug, thiserror::Error)]
pub enum AlertsError {
    #[error(transparent)]
    Sql(#[from] SqlError),
    #[error("saving the alert state: {0}")]
    State(#[from] FileError),
    #[error("building the alerts table: {0}")]
    Arrow(#[from] datafusion::arrow::error::ArrowError),
}

/// `[alerts]`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AlertsConfig {
    pub enabled: bool,
    #[serde(deserialize_with = "apron_common::duration::at_least_1s::deserialize")]
    pub interval: Duration,
    /// How long resolved alerts stay listed (API, table).
    #[serde(deserialize_with = "apron_common::duration::at_least_1s::deserialize")]
    pub keep_resolved: Duration,
    pub rules: AlertRules,
    pub exempt: Exemptions,
    pub alertmanager: Option<AlertmanagerConfig>,
    pub webhook: Option<WebhookConfig>,
    /// GPUs whose lookback windows one query of a pass reads: a pass holds this many
    /// GPUs' rows at once (32 × a 2 h lookback at 1 s ≈ 230 k rows), whatever the fleet.
    pub gpus_per_query: usize,
    /// Carry the evaluation from pass to pass and read only the windows since the
    /// previous pass (the whole lookback again hourly and whenever late data arrives);
    /// `false` reads the whole lookback every pass.
    pub incremental: bool,
}

impl Default for AlertsConfig {
    fn default() -> Self {
        AlertsConfig {
            enabled: true,
            interval: Duration::from_secs(30),
            keep_resolved: Duration::from_secs(24 * 3600),
            rules: AlertRules::default(),
            exempt: Exemptions::default(),
            alertmanager: None,
            webhook: None,
            gpus_per_query: 32,
            incremental: true,
        }
    }
}

/// `[alerts.alertmanager]`: one or more Alertmanagers (all of an HA cluster).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AlertmanagerConfig {
    /// Base URLs, e.g. `http://alertmanager:9093`.
    pub urls: Vec<String>,
    #[serde(default = "default_timeout", deserialize_with = "apron_common::duration::at_least_1s::deserialize")]
    pub timeout: Duration,
}

fn default_timeout() -> Duration {
    Duration::from_secs(10)
}

/// `<data>/derived/alerts.json`.
pub const STATE_FILE: &str = "derived/alerts.json";

/// Windows an incremental pass reads again before the previous pass's end: agents ship
/// every few seconds, so a window may become visible after a pass whose `now` it
/// precedes. One arriving later than this is reported by the change feed and makes the
/// next pass read the whole lookback.
const OVERLAP_US: i64 = 5 * 60 * 1_000_000;

/// The longest an evaluator carries its tracker before reading the whole lookback again
/// (bounds what a MIG reconfiguration or a rule the feed cannot see would leave stale).
const REBUILD_EVERY_US: i64 = 3_600 * 1_000_000;

/// How far back an idle run that reaches the lookback's start is followed.
const WEEK_US: i64 = 7 * 86_400_000_000;

/// Idle runs whose start one query looks for: each brings a VALUES row and its GPU to
/// the IN list; the query scans their week once, whatever the count.
const RUN_STARTS_PER_QUERY: usize = 1024;

/// What an incremental pass resumes from.
struct Carried {
    tracker: Tracker,
    /// The `now` of the pass that fed the tracker: every window up to it that was visible
    /// then has been fed.
    read_to: i64,
    /// When the whole lookback was last read.
    rebuilt_at: i64,
    parents: BTreeSet<String>,
    last_process: BTreeMap<String, i64>,
}

impl Carried {
    /// Whether a pass at `now_us` whose lookback starts at `from` may resume from here,
    /// given what ingest wrote since (`None`: no change feed, so never).
    fn resumes(&self, now_us: i64, from: i64, changed: Option<&Changed>) -> bool {
        let Some(changed) = changed else { return false };
        let resume = self.read_to - OVERLAP_US;
        now_us >= self.read_to
            && resume >= from
            && now_us - self.rebuilt_at < REBUILD_EVERY_US
            && [Table::GpuSamples, Table::GpuProcesses]
                .into_iter()
                .all(|t| changed.days(t).all(|(_, span)| span.min_us > resume))
    }
}

/// How a pass read its windows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PassKind {
    /// The whole lookback (tracker rebuilt).
    #[default]
    Whole,
    /// Only the windows since the previous pass.
    Incremental,
}

#[derive(Default)]
struct State {
    lifecycle: Lifecycle,
    carried: Option<Carried>,
    holders: BTreeMap<(String, String, String), Arc<HolderFacts>>,
    /// Starts of idle runs older than the lookback, by (GPU, owner kind, owner): found
    /// once, kept while the run lasts.
    run_starts: BTreeMap<(String, String, String), i64>,
}

/// What one evaluation did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct EvalReport {
    pub how: PassKind,
    pub windows: usize,
    pub fired: Vec<String>,
    pub resolved: Vec<String>,
}

/// The evaluator and its receivers.
pub struct Alerts {
    engine: Arc<QueryEngine>,
    ledger: Arc<Ledger>,
    config: AlertsConfig,
    state: Mutex<State>,
    table: Arc<SnapshotTable>,
    metrics: AlertMetrics,
    /// What ingest wrote since the last pass; `None` reads the whole lookback each pass.
    changes: Option<ChangeFeed>,
    path: PathBuf,
    /// One pass at a time (evaluation + delivery).
    pass: tokio::sync::Mutex<()>,
    kick: tokio::sync::Notify,
}

impl std::fmt::Debug for Alerts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Alerts").field("config", &self.config).finish()
    }
}

fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

impl Alerts {
    /// Loads the stored episodes (a missing or unreadable file starts empty, logged).
    pub fn new(
        engine: Arc<QueryEngine>,
        ledger: Arc<Ledger>,
        config: AlertsConfig,
        data_dir: &std::path::Path,
        table: Arc<SnapshotTable>,
        metrics: AlertMetrics,
        changes: Option<ChangeFeed>,
    ) -> Alerts {
        let path = data_dir.join(STATE_FILE);
        let lifecycle = match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|e| {
                tracing::warn!(path = %path.display(), error = %e, "alerts: unreadable state; starting empty");
                Lifecycle::default()
            }),
            Err(_) => Lifecycle::default(),
        };
        let a = Alerts {
            engine,
            ledger,
            config,
            state: Mutex::new(State { lifecycle, ..State::default() }),
            table,
            metrics,
            changes,
            path,
            pass: tokio::sync::Mutex::new(()),
            kick: tokio::sync::Notify::new(),
        };
        a.publish();
        a
    }

    pub fn config(&self) -> &AlertsConfig {
        &self.config
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Every episode (firing first, then resolved, newest first).
    pub fn list(&self) -> Vec<AlertRecord> {
        let mut v = self.lock().lifecycle.alerts.clone();
        v.sort_by(|a, b| {
            (a.state != AlertState::Firing)
                .cmp(&(b.state != AlertState::Firing))
                .then(b.starts_at_us.cmp(&a.starts_at_us))
        });
        v
    }

    async fn query(&self, sql: &str) -> Result<Vec<RecordBatch>, AlertsError> {
        Ok(crate::sqlutil::batches(&self.engine, sql).await?)
    }

    /// Evaluates as if the clock read `now_us` (the data's clock: tests replay history).
    pub async fn evaluate_at(&self, now_us: i64) -> Result<EvalReport, AlertsError> {
        let classify = self.ledger.classify_config().clone();
        let rules = &self.config.rules;
        let hold = [rules.zombie_after, rules.unallocated_busy_after, rules.xid_hold, rules.stale_after]
            .into_iter()
            .map(micros)
            .max()
            .unwrap_or(0);
        let from = now_us - (classify.context_us() + hold + 600_000_000);
        // Take the changes before reading: a row they do not mention is visible below.
        let changed = self.changes.as_ref().map(ChangeFeed::take);
        let carried = self.lock().carried.take().filter(|c| c.resumes(now_us, from, changed.as_ref()));
        let (mut carried, read_from, parents) = match carried {
            Some(c) => {
                let read_from = c.read_to - OVERLAP_US;
                // MIG parents: their activity is their instances'; the instances carry the
                // alerts. A GPU already fed that turns out to be a parent: read it all again.
                let new = mig_parent_uuids(&self.engine, &range_sql(read_from, now_us)).await?;
                if new.iter().any(|p| !c.parents.contains(p) && c.tracker.last_end(p).is_some()) {
                    (None, from, mig_parent_uuids(&self.engine, &range_sql(from, now_us)).await?)
                } else {
                    let parents = c.parents.iter().chain(&new).cloned().collect();
                    (Some(c), read_from, parents)
                }
            }
            None => (None, from, mig_parent_uuids(&self.engine, &range_sql(from, now_us)).await?),
        };
        let range = range_sql(read_from, now_us);
        let gpus = strings(
            &self.engine,
            &format!("SELECT DISTINCT gpu_uuid FROM gpu_samples WHERE {range} ORDER BY gpu_uuid"),
        )
        .await?;
        let procs = self
            .query(&format!("SELECT gpu_uuid, max(time) FROM gpu_processes WHERE {range} GROUP BY gpu_uuid"))
            .await?;
        let mut last_process: BTreeMap<String, i64> =
            carried.as_mut().map(|c| std::mem::take(&mut c.last_process)).unwrap_or_default();
        last_process.retain(|_, t| *t > from);
        for b in &procs {
            let (g, t) = (b.column(0).as_string::<i32>(), b.column(1).as_primitive::<TimestampMicrosecondType>());
            for r in 0..b.num_rows() {
                if !t.is_null(r) {
                    let newest = last_process.entry(g.value(r).to_owned()).or_insert(i64::MIN);
                    *newest = (*newest).max(t.value(r));
                }
            }
        }
        let mut report = EvalReport::default();
        let (mut tracker, rebuilt_at) = match carried {
            Some(c) => {
                report.how = PassKind::Incremental;
                (c.tracker, c.rebuilt_at)
            }
            None => (Tracker::default(), now_us),
        };
        // A GPU silent for the whole lookback is gone, as a rebuild would not see it.
        tracker.prune(now_us, now_us - from);
        let mut prices: BTreeMap<String, Option<apron_cost::Micros>> = BTreeMap::new();
        // The lookback's rows a few GPUs at a time: memory follows the chunk, not the fleet.
        for chunk in gpus.chunks(self.config.gpus_per_query.max(1)) {
            let (Some(lo), Some(hi)) = (chunk.first(), chunk.last()) else { continue };
            let batches = self
                .query(&format!(
                    "SELECT gpu_uuid, time, window_s, \"host\", \"cluster\", gpu_model, parent_gpu_uuid, mig_profile, \
                     CAST(sm_active_max AS DOUBLE), CAST(gpu_util_max AS DOUBLE), CAST(fb_used_bytes AS BIGINT), \
                     gpu_lost, CAST(xid_last AS BIGINT), {OWNER_COLUMNS_SQL} FROM gpu_samples WHERE {range} \
                     AND gpu_uuid >= {} AND gpu_uuid <= {} ORDER BY gpu_uuid, time",
                    sql_str(lo),
                    sql_str(hi)
                ))
                .await?;
            let mut st = self.lock();
            for b in &batches {
                let s = |i: usize| b.column(i).as_string::<i32>();
                let f = |i: usize| b.column(i).as_primitive::<Float64Type>();
                let int = |i: usize| b.column(i).as_primitive::<Int64Type>();
                let (uuid, time, window) = (s(0), b.column(1).as_primitive::<TimestampMicrosecondType>(), f(2));
                let (sm, util, fb, lost, xid) = (f(8), f(9), int(10), b.column(11).as_boolean(), int(12));
                for r in 0..b.num_rows() {
                    let gpu = uuid.value(r);
                    if parents.contains(gpu) {
                        continue;
                    }
                    let host = s(3).value(r);
                    let cluster = (!s(4).is_null(r)).then(|| s(4).value(r).to_owned());
                    let model = s(5).value(r);
                    let mig = (!s(7).is_null(r)).then(|| s(7).value(r));
                    let owner = owner_at(b, 13, r).or_else(|| self.ledger.teams().static_owner(gpu, host));
                    let holder = owner.map(|o| {
                        let key = (o.kind.as_str().to_owned(), o.owner.clone(), gpu.to_owned());
                        if let Some(h) = st.holders.get(&key) {
                            return h.clone();
                        }
                        let resolved = self.ledger.teams().resolve(gpu, host, o);
                        let h = Arc::new(HolderFacts::from(&resolved));
                        st.holders.insert(key, h.clone());
                        h
                    });
                    let price = *prices.entry(gpu.to_owned()).or_insert_with(|| {
                        let key = GpuKey { model_name: model, mig_profile: mig, cluster: cluster.as_deref() };
                        self.ledger.quote(&key, now_us).map(|q| q.usd_per_gpu_hour)
                    });
                    let opt = |a: &Float64Array| (!a.is_null(r)).then(|| a.value(r));
                    let sample = Sample {
                        end_us: time.value(r),
                        window_us: (window.value(r) * 1e6).round() as i64,
                        sm_active_max: opt(sm),
                        gpu_util_max: opt(util),
                        fb_used_bytes: (!fb.is_null(r)).then(|| fb.value(r)),
                        lost: !lost.is_null(r) && lost.value(r),
                        xid: (!xid.is_null(r)).then(|| xid.value(r)),
                        holder,
                    };
                    let meta = GpuMeta {
                        gpu_uuid: gpu.to_owned(),
                        host: host.to_owned(),
                        cluster,
                        gpu_model: model.to_owned(),
                        usd_per_hour: price,
                    };
                    tracker.feed(meta, &sample, &classify);
                    report.windows += 1;
                }
            }
        }
        self.extend_runs(&mut tracker).await?;
        let keep = micros(self.config.keep_resolved);
        let conditions: Vec<_> = tracker
            .conditions(now_us, &classify, rules, &last_process)
            .into_iter()
            .filter(|c| self.config.exempt.allows(c))
            .collect();
        let mut st = self.lock();
        st.carried = Some(Carried { tracker, read_to: now_us, rebuilt_at, parents, last_process });
        st.holders.retain(|_, h| Arc::strong_count(h) > 1);
        for t in st.lifecycle.update(&conditions, now_us, keep) {
            match t {
                apron_cost::alert::Transition::Fired(id) => {
                    if let Some(a) = st.lifecycle.get(&id) {
                        tracing::warn!(kind = %a.kind, team = %a.team, host = %a.host, summary = %a.summary, "alert firing");
                    }
                    report.fired.push(id);
                }
                apron_cost::alert::Transition::Resolved(id) => {
                    if let Some(a) = st.lifecycle.get(&id) {
                        tracing::info!(kind = %a.kind, team = %a.team, host = %a.host, "alert resolved");
                    }
                    report.resolved.push(id);
                }
            }
        }
        drop(st);
        self.publish();
        self.save()?;
        Ok(report)
    }

    /// Follows idle runs that reach back to the lookback's start to where they began, by
    /// the one idle-run rule (`apron_cost::idlerun`, in SQL): the start of the latest
    /// earlier idle window of the holder (within 7 days) that heads a run — whose
    /// previous window (signal-less windows of the holder are gap time, left out) is busy
    /// or someone else's, or ended more than `max_idle_gap` before it.
    async fn extend_runs(&self, tracker: &mut Tracker) -> Result<(), AlertsError> {
        type Key = (String, String, String);
        let runs: Vec<(String, Key, bool, i64)> = tracker
            .open_runs()
            .into_iter()
            .map(|(gpu, holder, first)| {
                let (kind, owner) =
                    holder.as_ref().map_or((String::new(), String::new()), |h| (h.owner_kind.clone(), h.owner.clone()));
                (gpu.clone(), (gpu, kind, owner), holder.is_some(), first)
            })
            .collect();
        let todo: Vec<&(String, Key, bool, i64)> = {
            let st = self.lock();
            runs.iter().filter(|r| !st.run_starts.contains_key(&r.1)).collect()
        };
        // Where each new run began: one scan per RUN_STARTS_PER_QUERY runs — one query
        // per run read each GPU's week separately (at 1,000 GPUs the first pass after a
        // burst took minutes), and their answers are remembered while the run lasts.
        let idle = self.ledger.classify_config().idle_sql();
        for chunk in todo.chunks(RUN_STARTS_PER_QUERY) {
            let (Some(lo), Some(hi)) = (chunk.iter().map(|r| r.3).min(), chunk.iter().map(|r| r.3).max()) else {
                continue;
            };
            let values: Vec<String> = chunk
                .iter()
                .map(|(_, (g, k, w), held, first)| {
                    format!("({}, {}, {}, {held}, {first})", sql_str(g), sql_str(k), sql_str(w))
                })
                .collect();
            // The run's windows: same holder (or nobody, for a run nobody holds) and idle;
            // the holder's signal-less windows are gap time and left out (idlerun).
            let holder = "CASE WHEN o.held THEN s.owner_kind = o.k AND s.owner = o.w ELSE s.owner IS NULL END";
            let same = format!("coalesce(({holder}) AND {idle}, false)");
            let gap_time = format!("coalesce(({holder}) AND ({idle}) IS NULL, false)");
            let start = "CAST(s.time AS BIGINT) - CAST(round(s.window_s * 1000000) AS BIGINT)";
            // Every window up to the first one fed (its start is `first_us`, included so
            // that a long gap just before it is seen), each with the previous one's end and
            // kind; a head is an idle window of the holder after a window of another kind
            // or after more than max_idle_gap; the run began at the latest head.
            let found = self
                .query(&format!(
                    "SELECT g, k, w, max(CASE WHEN same AND (prev_same IS NULL OR NOT prev_same \
                     OR st - prev_end > {max_gap}) THEN st END) \
                     FROM (SELECT o.g AS g, o.k AS k, o.w AS w, {same} AS same, {start} AS st, \
                     lag(CAST(s.time AS BIGINT)) OVER (PARTITION BY o.g, o.k, o.w ORDER BY s.time) AS prev_end, \
                     lag({same}) OVER (PARTITION BY o.g, o.k, o.w ORDER BY s.time) AS prev_same \
                     FROM gpu_samples s JOIN (VALUES {}) AS o(g, k, w, held, first_us) ON s.gpu_uuid = o.g \
                     WHERE s.gpu_uuid IN ({}) AND s.time <= {} AND s.time > {} \
                     AND {start} <= o.first_us AND CAST(s.time AS BIGINT) > o.first_us - {WEEK_US} \
                     AND NOT {gap_time}) AS r \
                     GROUP BY g, k, w",
                    values.join(", "),
                    str_list(chunk.iter().map(|r| r.0.as_str())),
                    // The first window fed ends after `first_us` by its length (≤ 1 h).
                    ts(hi + 3_600_000_000),
                    ts(lo - WEEK_US),
                    max_gap = self.ledger.classify_config().max_idle_gap_us(),
                ))
                .await?;
            let mut starts: BTreeMap<Key, i64> = BTreeMap::new();
            for b in &found {
                let head = b.column(3).as_primitive::<Int64Type>();
                for r in 0..b.num_rows() {
                    if !head.is_null(r) {
                        starts.insert(run_key(b, r), head.value(r));
                    }
                }
            }
            let mut st = self.lock();
            for (_, key, _, first) in chunk {
                st.run_starts.insert(key.clone(), starts.get(key).copied().unwrap_or(*first));
            }
        }
        let mut st = self.lock();
        for (gpu, key, _, first) in &runs {
            tracker.extend_idle(gpu, st.run_starts.get(key).copied().unwrap_or(*first));
        }
        let seen: BTreeSet<&Key> = runs.iter().map(|r| &r.1).collect();
        st.run_starts.retain(|k, _| seen.contains(k));
        Ok(())
    }

    /// Refreshes the table and /metrics from the episodes.
    fn publish(&self) {
        publish_records(&self.list(), &self.table, &self.metrics);
    }

    fn save(&self) -> Result<(), FileError> {
        let lifecycle = self.lock().lifecycle.clone();
        crate::statefile::save_json(&self.path, &lifecycle)
    }

    /// Delivers to the receivers; `wall_now_us` is the real clock (Alertmanager expires
    /// alerts by it). Returns one line per receiver attempt.
    pub async fn deliver(&self, wall_now_us: i64) -> Vec<Result<String, DeliveryError>> {
        let mut outcomes = Vec::new();
        if let Some(am) = &self.config.alertmanager {
            for url in &am.urls {
                let receiver = format!("alertmanager:{url}");
                let batch: Vec<AlertRecord> = self
                    .list()
                    .into_iter()
                    .filter(|a| {
                        a.state == AlertState::Firing || a.delivered.get(&receiver) != Some(&AlertState::Resolved)
                    })
                    .collect();
                if batch.is_empty() {
                    continue;
                }
                let expires = wall_now_us + 4 * micros(self.config.interval);
                let body: Vec<serde_json::Value> = batch.iter().map(|a| alertmanager_alert(a, expires)).collect();
                let endpoint = format!("{}/api/v2/alerts", url.trim_end_matches('/'));
                let r = crate::deliver::post_json(
                    endpoint.clone(),
                    serde_json::to_vec(&body).unwrap_or_default(),
                    am.timeout,
                    None,
                )
                .await;
                self.metrics.delivery(&receiver, r.is_ok());
                match r {
                    Ok(_) => {
                        self.mark(&receiver, &batch);
                        outcomes.push(Ok(format!("{} alert(s) to {endpoint}", batch.len())));
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "alerts: Alertmanager delivery failed; retried next pass");
                        outcomes.push(Err(e));
                    }
                }
            }
        }
        if let Some(w) = &self.config.webhook {
            let token = match w.token_file.as_ref().map(|p| crate::deliver::read_secret("token_file", p)).transpose() {
                Ok(t) => t,
                Err(e) => {
                    outcomes.push(Err(e));
                    None
                }
            };
            let pending: Vec<AlertRecord> =
                self.list().into_iter().filter(|a| a.delivered.get("webhook") != Some(&a.state)).collect();
            for a in pending.iter().rev() {
                let body = webhook_body(a);
                let r = crate::deliver::post_json(
                    w.url.clone(),
                    serde_json::to_vec(&body).unwrap_or_default(),
                    w.timeout,
                    token.clone(),
                )
                .await;
                self.metrics.delivery("webhook", r.is_ok());
                match r {
                    Ok(_) => {
                        self.mark("webhook", std::slice::from_ref(a));
                        outcomes.push(Ok(format!("{} {} to the webhook", a.id, state_str(a.state))));
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "alerts: webhook delivery failed; retried next pass");
                        outcomes.push(Err(e));
                        break;
                    }
                }
            }
        }
        if let Err(e) = self.save() {
            tracing::warn!(error = %e, "alerts: saving delivery marks");
        }
        outcomes
    }

    fn mark(&self, receiver: &str, sent: &[AlertRecord]) {
        let mut st = self.lock();
        for s in sent {
            if let Some(a) = st.lifecycle.alerts.iter_mut().find(|a| a.id == s.id) {
                a.delivered.insert(receiver.to_owned(), s.state);
            }
        }
    }

    /// Asks the running loop for a pass now (e.g. after a seeded history landed, so a
    /// first start never shows "nothing firing" beside stranded GPUs).
    pub fn kick(&self) {
        self.kick.notify_one();
    }

    /// Evaluates and delivers every `interval`, and when kicked, until dropped.
    pub async fn run(self: Arc<Self>) {
        let mut tick = tokio::time::interval(self.config.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = self.kick.notified() => {}
            }
            let _one = self.pass.lock().await;
            let now = UnixMicros::now().0;
            let started = std::time::Instant::now();
            match self.evaluate_at(now).await {
                // Debug: a pass runs every 30 s (`APRON_LOG=info,apron::alerts=debug`).
                Ok(r) => tracing::debug!(
                    how = ?r.how,
                    windows = r.windows,
                    fired = r.fired.len(),
                    resolved = r.resolved.len(),
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "alert pass"
                ),
                Err(e) => tracing::warn!(error = %e, "alerts: evaluation failed; retried next pass"),
            }
            self.deliver(now).await;
        }
    }
}

/// The SQL time range `(from, to]` of `gpu_samples` / `gpu_processes` windows.
fn range_sql(from: i64, to: i64) -> String {
    format!("time > {} AND time <= {}", ts(from), ts(to))
}

fn state_str(s: AlertState) -> &'static str {
    match s {
        AlertState::Firing => "firing",
        AlertState::Resolved => "resolved",
    }
}

fn alertname(kind: &str) -> String {
    let camel: String = kind
        .split('_')
        .map(|w| {
            let mut c = w.chars();
            c.next().map(|f| f.to_ascii_uppercase().to_string() + c.as_str()).unwrap_or_default()
        })
        .collect();
    format!("Apron{camel}")
}

fn human(secs: f64) -> String {
    let s = secs.max(0.0) as i64;
    match (s / 3600, s % 3600 / 60) {
        (0, m) => format!("{m}m"),
        (h, m) => format!("{h}h{m:02}m"),
    }
}

fn dollars(micros: i64) -> String {
    apron_cost::Micros(micros).to_cents().to_string()
}

/// The Alertmanager API v2 form of an episode.
fn alertmanager_alert(a: &AlertRecord, firing_expires_us: i64) -> serde_json::Value {
    let mut labels = serde_json::Map::new();
    let mut put = |k: &str, v: Option<&str>| {
        if let Some(v) = v.filter(|v| !v.is_empty()) {
            labels.insert(k.to_owned(), v.into());
        }
    };
    let name = alertname(&a.kind);
    put("alertname", Some(&name));
    put("kind", Some(&a.kind));
    put("severity", Some(&a.severity));
    put("team", Some(&a.team));
    put("host", Some(&a.host));
    put("gpu", Some(&a.gpu_uuids.join(",")));
    put("owner", a.owner.as_deref());
    put("owner_kind", a.owner_kind.as_deref());
    put("workload_kind", a.workload_kind.as_deref());
    put("cluster", a.cluster.as_deref());
    let mut annotations = serde_json::Map::new();
    annotations.insert("summary".into(), a.summary.clone().into());
    annotations.insert("idle_duration".into(), human(a.idle_s).into());
    annotations.insert("idle_seconds".into(), format!("{:.0}", a.idle_s).into());
    if let Some(c) = a.cost_micros {
        annotations.insert("cost_usd".into(), dollars(c).into());
    }
    annotations.insert("gpus_stranded".into(), format!("{}/{}", a.gpus_stranded, a.gpus_total).into());
    annotations.insert("apron_alert_id".into(), a.id.clone().into());
    let ends = match a.state {
        AlertState::Firing => firing_expires_us,
        AlertState::Resolved => a.ends_at_us.unwrap_or(a.updated_at_us),
    };
    serde_json::json!({
        "labels": labels,
        "annotations": annotations,
        "startsAt": UnixMicros(a.starts_at_us).to_rfc3339(),
        "endsAt": UnixMicros(ends).to_rfc3339(),
    })
}

/// A Slack-compatible body (`text`) carrying the episode as `apron`.
fn webhook_body(a: &AlertRecord) -> serde_json::Value {
    let cost = a.cost_micros.map(|c| format!(" — ${} burnt so far", dollars(c))).unwrap_or_default();
    let text = match a.state {
        AlertState::Firing => format!("[FIRING] {}: {}{cost}", alertname(&a.kind), a.summary),
        AlertState::Resolved => format!("[RESOLVED] {}: {}{cost}", alertname(&a.kind), a.summary),
    };
    serde_json::json!({ "text": text, "apron": api_alert(a) })
}

/// Sets the `alerts` table and the alert families of `/metrics` to `alerts` (this
/// server's episodes, or on a query server every shard's).
pub(crate) fn publish_records(alerts: &[AlertRecord], table: &SnapshotTable, metrics: &AlertMetrics) {
    match alerts_batch(alerts) {
        Ok(b) => table.replace(vec![b]),
        Err(e) => tracing::warn!(error = %e, "alerts table"),
    }
    metrics.set(alerts.iter().filter(|a| a.state == AlertState::Firing).cloned().collect());
}

/// The `GET /api/v1/alerts` form of an episode.
pub fn api_alert(a: &AlertRecord) -> serde_json::Value {
    serde_json::json!({
        "id": a.id,
        "kind": a.kind,
        "severity": a.severity,
        "state": state_str(a.state),
        "team": a.team,
        "cluster": a.cluster,
        "host": a.host,
        "gpu_uuids": a.gpu_uuids,
        "owner_kind": a.owner_kind,
        "owner": a.owner,
        "workload_kind": a.workload_kind,
        "starts_at": UnixMicros(a.starts_at_us).to_rfc3339(),
        "ends_at": a.ends_at_us.map(|e| UnixMicros(e).to_rfc3339()),
        "updated_at": UnixMicros(a.updated_at_us).to_rfc3339(),
        "idle_s": a.idle_s,
        "cost_usd": a.cost_micros.map(|c| apron_cost::Micros(c).to_cents()),
        "gpus_stranded": a.gpus_stranded,
        "gpus_total": a.gpus_total,
        "summary": a.summary,
    })
}

/// The `alerts` table's columns (documented in docs/metrics.md).
pub fn schema() -> SchemaRef {
    let ts = |name: &str, nullable| {
        Field::new(name, DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())), nullable)
    };
    let s = |name: &str, nullable| Field::new(name, DataType::Utf8, nullable);
    Arc::new(Schema::new(vec![
        s("id", false),
        s("kind", false),
        s("severity", false),
        s("state", false),
        s("team", false),
        s("cluster", true),
        s("host", false),
        s("gpu_uuids", false),
        s("owner_kind", true),
        s("owner", true),
        s("workload_kind", true),
        ts("starts_at", false),
        ts("ends_at", true),
        ts("updated_at", false),
        Field::new("idle_s", DataType::Float64, false),
        Field::new("cost_usd", apron_common::wire::MONEY, true),
        Field::new("gpus_stranded", DataType::Int64, false),
        Field::new("gpus_total", DataType::Int64, false),
        s("summary", false),
    ]))
}

fn alerts_batch(alerts: &[AlertRecord]) -> Result<RecordBatch, datafusion::arrow::error::ArrowError> {
    let strs = |f: &dyn Fn(&AlertRecord) -> Option<String>| -> ArrayRef {
        Arc::new(alerts.iter().map(f).collect::<StringArray>())
    };
    let tss = |f: &dyn Fn(&AlertRecord) -> Option<i64>| -> ArrayRef {
        Arc::new(alerts.iter().map(f).collect::<TimestampMicrosecondArray>().with_timezone("UTC"))
    };
    let cols: Vec<ArrayRef> = vec![
        strs(&|a| Some(a.id.clone())),
        strs(&|a| Some(a.kind.clone())),
        strs(&|a| Some(a.severity.clone())),
        strs(&|a| Some(state_str(a.state).to_owned())),
        strs(&|a| Some(a.team.clone())),
        strs(&|a| a.cluster.clone()),
        strs(&|a| Some(a.host.clone())),
        strs(&|a| Some(a.gpu_uuids.join(","))),
        strs(&|a| a.owner_kind.clone()),
        strs(&|a| a.owner.clone()),
        strs(&|a| a.workload_kind.clone()),
        tss(&|a| Some(a.starts_at_us)),
        tss(&|a| a.ends_at_us),
        tss(&|a| Some(a.updated_at_us)),
        Arc::new(alerts.iter().map(|a| Some(a.idle_s)).collect::<Float64Array>()),
        Arc::new(
            alerts
                .iter()
                .map(|a| a.cost_micros.map(i128::from))
                .collect::<Decimal128Array>()
                .with_precision_and_scale(18, 6)?,
        ),
        Arc::new(alerts.iter().map(|a| Some(a.gpus_stranded as i64)).collect::<Int64Array>()),
        Arc::new(alerts.iter().map(|a| Some(a.gpus_total as i64)).collect::<Int64Array>()),
        strs(&|a| Some(a.summary.clone())),
    ];
    RecordBatch::try_new(schema(), cols)
}

/// `/metrics`: `apron_stranded_allocation{team,host,gpu,owner,workload_kind} 1` and
/// `apron_stranded_seconds{…}` per firing stranded allocation, `apron_alerts_firing{kind}`,
/// and `apron_alert_deliveries_total{receiver,outcome}`.
#[derive(Debug, Default, Clone)]
pub struct AlertMetrics {
    inner: Arc<Mutex<MetricsInner>>,
}

#[derive(Debug, Default)]
struct MetricsInner {
    firing: Vec<AlertRecord>,
    deliveries: BTreeMap<(String, &'static str), u64>,
}

impl AlertMetrics {
    fn lock(&self) -> std::sync::MutexGuard<'_, MetricsInner> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn set(&self, firing: Vec<AlertRecord>) {
        self.lock().firing = firing;
    }

    fn delivery(&self, receiver: &str, ok: bool) {
        let receiver = receiver.split(':').next().unwrap_or(receiver).to_owned();
        *self.lock().deliveries.entry((receiver, if ok { "ok" } else { "failed" })).or_default() += 1;
    }
}

impl prometheus_client::collector::Collector for AlertMetrics {
    fn encode(&self, mut enc: prometheus_client::encoding::DescriptorEncoder) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::MetricType;
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        let m = self.lock();
        let stranded: Vec<&AlertRecord> = m.firing.iter().filter(|a| a.kind == "stranded_allocation").collect();
        let labels = |a: &AlertRecord| {
            vec![
                ("team".to_owned(), a.team.clone()),
                ("host".to_owned(), a.host.clone()),
                ("gpu".to_owned(), a.gpu_uuids.join(",")),
                ("owner".to_owned(), a.owner.clone().unwrap_or_default()),
                ("workload_kind".to_owned(), a.workload_kind.clone().unwrap_or_default()),
            ]
        };
        let mut d = enc.encode_descriptor(
            "apron_stranded_allocation",
            "1 for each allocation with GPUs stranded now (idle for its stranded_after).",
            None,
            MetricType::Gauge,
        )?;
        for a in &stranded {
            ConstGauge::new(1i64).encode(d.encode_family(&labels(a))?)?;
        }
        let mut d = enc.encode_descriptor(
            "apron_stranded",
            "How long each stranded allocation's longest idle run has lasted.",
            Some(&prometheus_client::registry::Unit::Seconds),
            MetricType::Gauge,
        )?;
        for a in &stranded {
            ConstGauge::new(a.idle_s).encode(d.encode_family(&labels(a))?)?;
        }
        let mut d =
            enc.encode_descriptor("apron_alerts_firing", "Alerts firing now, by kind.", None, MetricType::Gauge)?;
        for kind in apron_cost::alert::KINDS {
            let n = m.firing.iter().filter(|a| a.kind == kind).count() as i64;
            ConstGauge::new(n).encode(d.encode_family(&[("kind", kind)])?)?;
        }
        let mut d = enc.encode_descriptor(
            "apron_alert_deliveries",
            "Alert deliveries by receiver (alertmanager, webhook) and outcome.",
            None,
            MetricType::Counter,
        )?;
        for ((receiver, outcome), n) in &m.deliveries {
            ConstCounter::new(*n).encode(d.encode_family(&[("receiver", receiver.as_str()), ("outcome", outcome)])?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alertmanager_form_carries_labels_and_dollars() {
        let a = AlertRecord {
            id: "abc".into(),
            key: "stranded_allocation|pod|ds/nb".into(),
            kind: "stranded_allocation".into(),
            severity: "warning".into(),
            state: AlertState::Firing,
            team: "data-science".into(),
            cluster: None,
            host: "n0".into(),
            gpu_uuids: vec!["GPU-a".into()],
            owner_kind: Some("pod".into()),
            owner: Some("ds/nb".into()),
            workload_kind: Some("notebook".into()),
            starts_at_us: 0,
            ends_at_us: None,
            updated_at_us: 3_900_000_000,
            idle_s: 3900.0,
            cost_micros: Some(3_900_000),
            gpus_stranded: 1,
            gpus_total: 2,
            summary: "s".into(),
            delivered: BTreeMap::new(),
        };
        let v = alertmanager_alert(&a, 4_000_000_000);
        assert_eq!(v["labels"]["alertname"], "ApronStrandedAllocation");
        assert_eq!(v["labels"]["gpu"], "GPU-a");
        assert!(v["labels"].get("cluster").is_none());
        assert_eq!(v["annotations"]["idle_duration"], "1h05m");
        assert_eq!(v["annotations"]["cost_usd"], "3.90");
        assert_eq!(v["annotations"]["gpus_stranded"], "1/2");
        assert_eq!(v["endsAt"], "1970-01-01T01:06:40.000000Z");
        assert!(webhook_body(&a)["text"].as_str().is_some_and(|t| t.starts_with("[FIRING] ApronStrandedAllocation")));
        let b = alerts_batch(&[a]).expect("batch");
        assert_eq!(b.num_rows(), 1);
    }
}
