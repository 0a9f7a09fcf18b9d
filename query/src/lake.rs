//! The whole lake as a [`TableSource`]: every shard's published Parquet files in one
//! S3-compatible bucket, for `apron serve` in the query role (no memtable, no WAL).
//!
//! ```text
//!  bucket/<prefix>/<table>/date=D/shard=S/<uuid>.parquet   (each collector, its shard)
//!  bucket/<prefix>/_apron/shards/<S>.json                  (each collector's status:
//!        │ LIST _apron/shards/ + one GET per shard,          its live files, rollup
//!        │ at most every `refresh`                           records, alerts)
//!        ▼
//!  LakeSource::snapshot(table): the files the shards' statuses list (no batches)
//!  LakeSource::rollup_state():  the shards' rollup records, merged
//!  LakeSource::shards():        each shard's status and whether it is stale
//! ```
//!
//! The statuses, not a LIST of the tables, say which files make up the lake: a
//! collector's compaction publishes a merged file before its inputs go (they stay for
//! its `superseded_grace`, 5 min by default, hidden from its own listings by a local
//! journal), so a LIST would see both and count rows twice. A status lists the files the
//! collector itself reads at that moment, so each shard's part is a consistent set, and
//! the inputs it no longer lists stay readable for the grace (keep `heartbeat +
//! refresh` plus the longest query well under it). Reading them costs one small GET per
//! shard per refresh (about 150 bytes per file: a shard's files are bounded by its
//! retention and compaction, not by the rows in them), never a LIST of history.
//!
//! Freshness: a row acknowledged by a collector is in a file after its next persist (at
//! most `[cluster] freshness`), in its status at the next heartbeat, and visible here
//! after the next refresh: `freshness + heartbeat + refresh` in all (45 s by default).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use apron_collector::schema::storage_schema;
use apron_collector::{Remote, Table};
use apron_common::UnixMicros;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::object_store::ObjectStore;
use serde::{Deserialize, Serialize};

use crate::rollup::{DayState, Labels, RollupState};
use crate::source::{DataFile, SourceError, TableSnapshot, TableSource};

/// Where each collector keeps its status, under the lake's prefix.
pub const STATUS_DIR: &str = "_apron/shards";

/// The object key (relative to the lake's prefix) of `shard`'s status.
pub fn status_key(shard: &str) -> String {
    format!("{STATUS_DIR}/{shard}.json")
}

/// What a collector publishes about its shard every heartbeat: when, its live files,
/// the rollup's record of what each stored `gpu_samples_1m` day read, and its alerts
/// (episodes as the collector keeps them; the query tier merges them).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ShardStatus {
    pub shard: String,
    /// The collector's identity (kept in its data directory): two collectors claiming
    /// one shard are told apart by it.
    #[serde(default)]
    pub instance: String,
    /// The collector's clock when it wrote this (µs).
    pub updated_us: i64,
    /// Rows acknowledged but not yet in the lake when it wrote this (they are in its WAL).
    #[serde(default)]
    pub memtable_rows: u64,
    /// Every published file of every table of the shard, as the collector reads them.
    #[serde(default)]
    pub files: Vec<StatusFile>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollup: Option<RollupState>,
    #[serde(default)]
    pub alerts: Vec<serde_json::Value>,
}

/// One file of a shard's status.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusFile {
    pub table: String,
    /// `YYYY-MM-DD` of its `date=` partition.
    pub date: String,
    /// The object key (relative to the bucket).
    pub key: String,
    pub bytes: u64,
}

/// How the lake is read ([`LakeSource`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LakeConfig {
    /// The shards' statuses (and so the files) are re-read at most this often.
    pub refresh: Duration,
    /// A shard whose status is older than this is stale (its collector is down or cut
    /// off from the bucket): its rows up to its last persist are still answered.
    pub stale_after: Duration,
}

impl Default for LakeConfig {
    fn default() -> LakeConfig {
        LakeConfig { refresh: Duration::from_secs(5), stale_after: Duration::from_secs(60) }
    }
}

/// One shard as the query tier sees it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ShardView {
    pub shard: String,
    /// When its collector last wrote its status (RFC 3339).
    pub updated: String,
    pub stale: bool,
    /// Rows its collector had acknowledged but not yet persisted then.
    pub memtable_rows: u64,
    pub files: usize,
}

#[derive(Default)]
struct Statuses {
    read_at: Option<Instant>,
    by_shard: Arc<BTreeMap<String, ShardStatus>>,
}

/// The lake as a table source; see the module docs.
pub struct LakeSource {
    /// Reads the statuses; its connections are its own runtime's.
    remote: Remote,
    /// What the query engine reads the files through: a client of its own, so a
    /// connection the engine's runtime drives is never one a status read waits on from
    /// a blocked engine thread (that would deadlock).
    files: Remote,
    config: LakeConfig,
    statuses: Mutex<Statuses>,
}

impl std::fmt::Debug for LakeSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LakeSource").field("remote", &self.remote).field("config", &self.config).finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl LakeSource {
    /// `remote` and `files`: two clients of the same bucket ([`Remote::open`] twice).
    pub fn new(remote: Remote, files: Remote, config: LakeConfig) -> LakeSource {
        LakeSource { remote, files, config, statuses: Mutex::new(Statuses::default()) }
    }

    pub fn config(&self) -> &LakeConfig {
        &self.config
    }

    /// The shards' statuses, re-read when older than `refresh`.
    fn statuses(&self) -> Result<Arc<BTreeMap<String, ShardStatus>>, SourceError> {
        let now = Instant::now();
        let mut st = lock(&self.statuses);
        if st.read_at.is_none_or(|t| now.duration_since(t) >= self.config.refresh) {
            let mut by_shard = BTreeMap::new();
            for (key, bytes) in self.remote.get_all_small(STATUS_DIR).map_err(lake_error)? {
                match serde_json::from_slice::<ShardStatus>(&bytes) {
                    Ok(s) if key == status_key(&s.shard) => {
                        by_shard.insert(s.shard.clone(), s);
                    }
                    Ok(s) => tracing::warn!(key, shard = s.shard, "a shard status under another shard's name; ignored"),
                    Err(e) => tracing::warn!(key, error = %e, "an unreadable shard status; ignored"),
                }
            }
            st.by_shard = Arc::new(by_shard);
            st.read_at = Some(now);
        }
        Ok(st.by_shard.clone())
    }

    /// Every shard with a status, and whether it is stale (its status older than
    /// `stale_after`, by this server's clock).
    pub fn shards(&self) -> Result<Vec<ShardView>, SourceError> {
        Ok(views(&*self.statuses()?, UnixMicros::now().0, self.config.stale_after))
    }

    /// The names of the stale shards ([`LakeSource::shards`]); empty when the statuses
    /// cannot be read (the query's own read of the bucket then fails on its own).
    pub fn stale_shards(&self) -> Vec<String> {
        self.shards().map(|v| v.into_iter().filter(|s| s.stale).map(|s| s.shard).collect()).unwrap_or_default()
    }

    /// Every shard's published alert episodes (as its collector keeps them), with their
    /// shard.
    pub fn alerts(&self) -> Result<Vec<(String, serde_json::Value)>, SourceError> {
        Ok(self.statuses()?.values().flat_map(|s| s.alerts.iter().map(|a| (s.shard.clone(), a.clone()))).collect())
    }
}

/// Each shard as seen at `now_us`: stale when its status is older than `stale_after`.
fn views(statuses: &BTreeMap<String, ShardStatus>, now_us: i64, stale_after: Duration) -> Vec<ShardView> {
    let stale_us = i64::try_from(stale_after.as_micros()).unwrap_or(i64::MAX);
    statuses
        .values()
        .map(|s| ShardView {
            shard: s.shard.clone(),
            updated: UnixMicros(s.updated_us).to_rfc3339(),
            stale: now_us.saturating_sub(s.updated_us) > stale_us,
            memtable_rows: s.memtable_rows,
            files: s.files.len(),
        })
        .collect()
}

fn lake_error(e: apron_collector::StorageError) -> SourceError {
    SourceError::Lake(e.to_string())
}

/// The shards' rollup records as one: each stored day's inputs are the union of the
/// shards' (a raw file belongs to one shard, so the union is what all stored rows of
/// the day read). A day stored by one shard but not yet by another is then stale, and
/// served live from raw, as on one server.
pub fn merge_rollup_states<'a>(states: impl IntoIterator<Item = &'a RollupState>) -> RollupState {
    let mut merged = RollupState { labels: Labels::Start, days: BTreeMap::new(), relabelling: None };
    for s in states {
        if s.labels != Labels::Start {
            // A shard still moving old minute labels: trust none of its days.
            merged.labels = s.labels;
        }
        for (day, d) in &s.days {
            let m = merged.days.entry(*day).or_insert_with(|| DayState {
                inputs: Vec::new(),
                materialized_us: d.materialized_us,
                rows: 0,
            });
            m.inputs.extend(d.inputs.iter().cloned());
            m.inputs.sort();
            m.inputs.dedup();
            m.rows += d.rows;
            m.materialized_us = m.materialized_us.min(d.materialized_us);
        }
    }
    merged
}

impl TableSource for LakeSource {
    fn schema(&self, table: &str) -> Option<SchemaRef> {
        Table::from_name(table).map(storage_schema)
    }

    fn snapshot(&self, table: &str) -> Result<TableSnapshot, SourceError> {
        let Some(t) = Table::from_name(table) else { return Ok(TableSnapshot::default()) };
        let files = self
            .statuses()?
            .values()
            .flat_map(|s| s.files.iter())
            .filter(|f| f.table == t.name())
            .map(|f| DataFile { day: apron_common::parse_date(&f.date), path: f.key.clone().into(), bytes: f.bytes })
            .collect();
        Ok(TableSnapshot { batches: Vec::new(), files })
    }

    fn object_store(&self) -> Option<(String, Arc<dyn ObjectStore>)> {
        Some(self.files.store())
    }

    fn rollup_state(&self) -> Option<Result<RollupState, SourceError>> {
        Some(self.statuses().map(|s| merge_rollup_states(s.values().filter_map(|s| s.rollup.as_ref()))))
    }

    fn merges_shards(&self) -> bool {
        true
    }

    fn stale_shards(&self) -> Vec<String> {
        LakeSource::stale_shards(self)
    }
}

/// The stored rows' name inside [`MergedCostTable`]'s private planning session.
const COST_SHARDS: &str = "gpu_cost_hourly_shards";

/// Seconds a collector saw of a GPU-hour (every class but `unknown_s`).
const KNOWN_SECONDS: &str = "active_s + allocated_idle_s + stranded_s + unallocated_idle_s + unallocated_busy_s";

/// `gpu_cost_hourly` on a query server: the shards' rows, with each GPU-hour's
/// "no data here" rows counted once.
///
/// A collector writes every hour of the day for each GPU it saw that day, hours without
/// its samples as unknown seconds (no money). A GPU that moved between shards is seen by
/// both, so each would claim the hours the other holds, or both the hours neither does.
/// For each (hour, GPU): the rows with seconds some shard saw are kept; when no shard
/// saw any, one unknown-only row (the first by host, then team). One server holding all
/// the samples writes the same rows (the cluster test checks it line by line). Only a
/// GPU-hour split between two shards differs: each keeps its unknown seconds for the
/// other's part (money is unaffected: unknown seconds are not priced).
pub struct MergedCostTable {
    schema: SchemaRef,
    planner: datafusion::execution::context::SessionContext,
}

impl std::fmt::Debug for MergedCostTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MergedCostTable").finish()
    }
}

impl MergedCostTable {
    pub fn new(source: Arc<dyn TableSource>, schema: SchemaRef) -> datafusion::common::Result<MergedCostTable> {
        let state = datafusion::execution::SessionStateBuilder::new().with_default_features().build();
        let planner = datafusion::execution::context::SessionContext::new_with_state(state);
        let shards = crate::provider::ApronTable::new(Table::GpuCostHourly, schema.clone(), source);
        planner.register_table(COST_SHARDS, Arc::new(shards))?;
        Ok(MergedCostTable { schema, planner })
    }

    /// The SQL this table runs.
    pub fn sql(&self) -> String {
        let columns: Vec<String> = self.schema.fields().iter().map(|f| format!("\"{}\"", f.name())).collect();
        let columns = columns.join(", ");
        format!(
            "SELECT {columns} FROM (\
               SELECT *, \
                 max(known__) OVER (PARTITION BY hour, gpu_uuid) AS any_known__, \
                 row_number() OVER (PARTITION BY hour, gpu_uuid ORDER BY host, team) AS nth__ \
               FROM (SELECT *, CAST(({KNOWN_SECONDS}) > 0 AS INT) AS known__ FROM {COST_SHARDS})) \
             WHERE known__ = 1 OR (any_known__ = 0 AND nth__ = 1)"
        )
    }
}

#[async_trait::async_trait]
impl datafusion::catalog::TableProvider for MergedCostTable {
    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    fn table_type(&self) -> datafusion::datasource::TableType {
        datafusion::datasource::TableType::Base
    }

    fn supports_filters_pushdown(
        &self,
        filters: &[&datafusion::logical_expr::Expr],
    ) -> datafusion::common::Result<Vec<datafusion::logical_expr::TableProviderFilterPushDown>> {
        // Applied above the merge (a filter on `hour` or `gpu_uuid`, the merge's
        // partition, is pushed on to the files by the optimizer); DataFusion re-checks.
        Ok(vec![datafusion::logical_expr::TableProviderFilterPushDown::Inexact; filters.len()])
    }

    async fn scan(
        &self,
        state: &dyn datafusion::catalog::Session,
        projection: Option<&Vec<usize>>,
        filters: &[datafusion::logical_expr::Expr],
        limit: Option<usize>,
    ) -> datafusion::common::Result<Arc<dyn datafusion::physical_plan::ExecutionPlan>> {
        let plan = self.planner.state().create_logical_plan(&self.sql()).await?;
        crate::rollup::plan_as_table(state, plan, Table::GpuCostHourly.name(), &self.schema, projection, filters, limit)
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rollup::InputFile;

    fn day(inputs: &[&str], rows: usize) -> DayState {
        DayState {
            inputs: inputs.iter().map(|n| InputFile { name: (*n).to_owned(), bytes: 1 }).collect(),
            materialized_us: 5,
            rows,
        }
    }

    #[test]
    fn merged_rollup_days_read_every_shards_inputs() {
        let a = RollupState {
            labels: Labels::Start,
            days: BTreeMap::from([(1, day(&["1/a1", "1/a2"], 10))]),
            relabelling: None,
        };
        let b = RollupState {
            labels: Labels::Start,
            days: BTreeMap::from([(1, day(&["1/b1"], 4)), (2, day(&["2/b2"], 3))]),
            relabelling: None,
        };
        let m = merge_rollup_states([&a, &b]);
        assert_eq!(m.labels, Labels::Start);
        let names: Vec<&str> = m.days[&1].inputs.iter().map(|i| i.name.as_str()).collect();
        assert_eq!(names, ["1/a1", "1/a2", "1/b1"]);
        assert_eq!((m.days[&1].rows, m.days[&2].rows), (14, 3));
        let legacy = RollupState { labels: Labels::End, ..RollupState::default() };
        assert_eq!(merge_rollup_states([&a, &legacy]).labels, Labels::End);
    }

    #[test]
    fn a_shard_is_stale_once_its_status_is_older_than_stale_after() {
        let status =
            |shard: &str, updated_us| ShardStatus { shard: shard.into(), updated_us, ..ShardStatus::default() };
        let all =
            BTreeMap::from([("a".to_owned(), status("a", 100_000_000)), ("b".to_owned(), status("b", 39_000_000))]);
        let v = views(&all, 100_000_000, Duration::from_secs(60));
        let stale: Vec<(&str, bool)> = v.iter().map(|s| (s.shard.as_str(), s.stale)).collect();
        assert_eq!(stale, [("a", false), ("b", true)]);
        assert_eq!(v[0].updated, "1970-01-01T00:01:40.000000Z");
        // Exactly stale_after old is not yet stale.
        assert!(!views(&all, 99_000_000, Duration::from_secs(60))[1].stale);
    }

    #[test]
    fn status_keys_and_json() {
        assert_eq!(status_key("rack-a"), "_apron/shards/rack-a.json");
        let s: ShardStatus = serde_json::from_str(r#"{"shard":"a","updated_us":7}"#).expect("minimal status");
        assert!(s.alerts.is_empty() && s.rollup.is_none());
    }
}
