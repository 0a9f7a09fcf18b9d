//! `gpu_samples_1m`: the one definition of the per-minute rollup, and the SQL table that
//! serves it — stored (materialized) minutes where they are current, the rest computed
//! live from `gpu_samples`.
//!
//! # Definition
//!
//! One row per GPU (`gpu_uuid`) per minute. `time` is the minute's START: a
//! `gpu_samples` window ending at `t` belongs to the minute `[m, m + 60 s)` with `m` =
//! `t` rounded DOWN to the minute (a window ending exactly at 12:01:00 is in the minute
//! 12:01:00, one ending at 12:00:59.5 in 12:00:00). So every window of a minute row has
//! `date_trunc('hour', time)` (or `'day'`) equal to the row's: hourly and daily groups
//! of `gpu_samples_1m` hold exactly the windows the same groups of `gpu_samples` hold,
//! and rollup day E comes from raw day E alone. (Versions before 2026-12-05 labelled a
//! minute by its end, `(m − 60 s, m]`; see [`Labels`] for how stored rows move over.)
//!
//! - identity: `gpu_uuid` (grouped), and any value of `cluster`, `host`, `gpu_index`,
//!   `gpu_model`, `parent_gpu_uuid`, `mig_profile` in the minute (constant per GPU;
//!   `max` is taken so the answer is deterministic);
//! - `window_s` = 60; `samples` = windows in the minute; `covered_s` = sum of their
//!   `window_s`. A window longer than a minute is attributed whole to the minute of its
//!   end, so `covered_s` can exceed 60 there (and the minutes it also spans show less);
//! - per measurement `c` of [`Field::ALL`]: `c_mean` = avg(c) (NULLs ignored, NULL if
//!   none; Float64), `c_min`, `c_max` (at the raw column's exact type); for activity
//!   fields also `c_max_mean` and `c_max_max` over the window maxima (`c_max`).
//!
//! Column names and order are exactly `Table::GpuSamples1m.schema()`; the SQL is
//! generated from the field catalogue ([`rollup_sql`]).
//!
//! # Serving
//!
//! ```text
//!  SELECT … FROM gpu_samples_1m WHERE time >= X        (a base table to users)
//!    RollupTable::scan: W = watermark(raw snapshot, stored days, rollup.json)
//!      stored  gpu_samples_1m files   WHERE time <  W           (materialized, current)
//!      UNION ALL
//!      live    rollup_sql over gpu_samples for minutes >= W    (prunes raw partitions)
//! ```
//!
//! `W` is the start of the earliest day that raw data affects and whose stored rollup is
//! missing or not current; a stored day is current when no raw file of days E−1/E exists
//! that its materialization did not read (recorded in `<data_dir>/derived/rollup.json`,
//! see [`RollupState`]) and no raw row of the day is still only in memory. Raw files that
//! disappeared (retention) do not make a day stale. Without a state file the stored days
//! are trusted. The stored table is registered only in the table's private planning
//! session, never in the users' catalog.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use apron_common::wire::{ROLLUP_SUFFIXES, Table, max_column};
use apron_common::{Field, UnixMicros};
use async_trait::async_trait;
use datafusion::arrow::array::{Array, RecordBatch, TimestampMicrosecondArray};
use datafusion::arrow::compute::kernels::aggregate::{max, min};
use datafusion::arrow::datatypes::{Field as ArrowField, Schema, SchemaRef};
use datafusion::catalog::{Session, TableProvider};
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::{Column, DataFusionError, Result};
use datafusion::datasource::TableType;
use datafusion::execution::SessionStateBuilder;
use datafusion::execution::context::SessionContext;
use datafusion::logical_expr::utils::conjunction;
use datafusion::logical_expr::{Expr, LogicalPlanBuilder, TableProviderFilterPushDown};
use datafusion::physical_plan::ExecutionPlan;
use serde::{Deserialize, Serialize};

use crate::provider::ApronTable;
use crate::prune::{MICROS_PER_DAY, TimeRange, time_range};
use crate::source::{DataFile, TableSource};

pub const MINUTE_US: i64 = 60_000_000;
/// The raw table the rollup reads.
pub const RAW: &str = "gpu_samples";
/// The rollup's SQL name.
pub const NAME: &str = "gpu_samples_1m";
/// The stored rows' name inside the private planning session (never in the users').
pub const STORED: &str = "gpu_samples_1m_stored";
/// The materializer's state, relative to the data directory.
pub const STATE_FILE: &str = "derived/rollup.json";

/// The window end → minute label expression: `t` rounded down to the minute.
/// (`date_bin` answers in ns; the table is µs.)
const MINUTE_START: &str = "arrow_cast(date_bin(INTERVAL '1 minute', w.time), 'Timestamp(Microsecond, Some(\"UTC\"))')";

/// Minutes by their label (start time): `[from, to)` in µs; `None` is unbounded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Minutes {
    pub from: Option<i64>,
    pub to: Option<i64>,
}

impl Minutes {
    pub const ALL: Minutes = Minutes { from: None, to: None };

    /// The minutes of UTC day `day`'s partition (00:00:00 … 23:59:00).
    pub fn day(day: i64) -> Minutes {
        Minutes { from: Some(day * MICROS_PER_DAY), to: Some((day + 1) * MICROS_PER_DAY) }
    }

    /// The minutes whose label may lie in `range` (inclusive µs bounds of `time`).
    pub fn covering(range: TimeRange) -> Minutes {
        Minutes { from: range.min.map(ceil_minute), to: range.max.map(|m| floor_minute(m).saturating_add(MINUTE_US)) }
    }

    pub fn intersect(self, o: Minutes) -> Minutes {
        let pick = |a: Option<i64>, b: Option<i64>, f: fn(i64, i64) -> i64| match (a, b) {
            (Some(a), Some(b)) => Some(f(a, b)),
            (a, b) => a.or(b),
        };
        Minutes { from: pick(self.from, o.from, i64::max), to: pick(self.to, o.to, i64::min) }
    }
}

/// `t` rounded down to the minute.
pub fn floor_minute(t: i64) -> i64 {
    t.div_euclid(MINUTE_US) * MINUTE_US
}

/// `t` rounded up to the minute.
pub fn ceil_minute(t: i64) -> i64 {
    let f = floor_minute(t);
    if f == t { t } else { f.saturating_add(MINUTE_US) }
}

fn lit(us: i64) -> String {
    format!("'{}'", UnixMicros(us).to_rfc3339())
}

/// The output columns of the rollup, in `Table::GpuSamples1m.schema()` order, as
/// `(expression over the raw rows aliased w, name)`.
pub fn rollup_columns() -> Vec<(String, String)> {
    let mut cols: Vec<(String, String)> = [
        ("minute", "time"),
        ("CAST(60 AS DOUBLE)", "window_s"),
        ("max(w.cluster)", "cluster"),
        ("max(w.host)", "host"),
        ("w.gpu_uuid", "gpu_uuid"),
        ("max(w.gpu_index)", "gpu_index"),
        ("max(w.gpu_model)", "gpu_model"),
        ("max(w.parent_gpu_uuid)", "parent_gpu_uuid"),
        ("max(w.mig_profile)", "mig_profile"),
        ("count(*)", "samples"),
        ("sum(w.window_s)", "covered_s"),
    ]
    .into_iter()
    .map(|(e, n)| (e.to_owned(), n.to_owned()))
    .collect();
    let aggregate = |c: &str, suffix: &str| match suffix {
        "_mean" => format!("CAST(avg(w.{c}) AS DOUBLE)"),
        "_min" => format!("min(w.{c})"),
        _ => format!("max(w.{c})"),
    };
    for &f in Field::ALL {
        let c = f.column();
        for suffix in ROLLUP_SUFFIXES {
            cols.push((aggregate(c, suffix), format!("{c}{suffix}")));
        }
        if let Some(m) = max_column(f) {
            for suffix in ["_mean", "_max"] {
                cols.push((aggregate(&m, suffix), format!("{m}{suffix}")));
            }
        }
    }
    cols
}

/// The rollup of `gpu_samples` for the minutes `minutes`, as DataFusion SQL. The bounds
/// become bounds on the raw `time` (the minute `m` reads windows ending in
/// `[m, m + 60 s)`), so only the raw partitions needed are read.
pub fn rollup_sql(minutes: Minutes) -> String {
    rollup_sql_of(minutes, None)
}

/// GPUs `first ..= last` (by UUID): the slice of the fleet one step of a materialization
/// reads, so its memory follows the slice, not the fleet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuSlice<'a> {
    pub first: &'a str,
    pub last: &'a str,
}

impl GpuSlice<'_> {
    fn filter(self) -> String {
        let quote = |s: &str| format!("'{}'", s.replace('\'', "''"));
        format!("gpu_uuid >= {} AND gpu_uuid <= {}", quote(self.first), quote(self.last))
    }
}

/// Day `day`'s rows labelled by their start, made from stored rows labelled by their end
/// ([`Labels::End`]) for the GPUs of `slice`: the end-labelled minutes `(E 00:00, E+1
/// 00:00]`, each moved back one minute, in partition order. `with_next`: the row
/// labelled E+1 00:00, stored in day E+1's partition, is still end-labelled (it becomes
/// E 23:59); otherwise that minute is left out.
pub fn relabel_sql(day: i64, with_next: bool, slice: GpuSlice<'_>) -> String {
    let columns: Vec<String> = rollup_columns()
        .into_iter()
        .map(|(_, n)| if n == "time" { format!("{n} - INTERVAL '1 minute' AS {n}") } else { n })
        .collect();
    let (from, to) = (day.saturating_mul(MICROS_PER_DAY), day.saturating_add(1).saturating_mul(MICROS_PER_DAY));
    format!(
        "SELECT {} FROM {NAME} WHERE time > {} AND time {} {} AND {} ORDER BY gpu_uuid, time",
        columns.join(", "),
        lit(from),
        if with_next { "<=" } else { "<" },
        lit(to),
        slice.filter()
    )
}

/// [`rollup_sql`] for the GPUs of `slice` only, in the order a partition is stored
/// (`gpu_uuid`, `time`), so slices taken in UUID order can be written as they come.
pub fn slice_sql(minutes: Minutes, slice: GpuSlice<'_>) -> String {
    format!("{} ORDER BY gpu_uuid, time", rollup_sql_of(minutes, Some(slice)))
}

/// The bounds on raw `time` that the rollup of `minutes` reads (`TRUE` for all).
pub fn raw_filter(minutes: Minutes) -> String {
    let bounds = raw_bounds(minutes);
    if bounds.is_empty() { "TRUE".to_owned() } else { bounds.join(" AND ") }
}

fn raw_bounds(minutes: Minutes) -> Vec<String> {
    let mut bounds = Vec::new();
    // Minutes from `from` to `to` (minute boundaries) ⇔ window ends in [from, to).
    if let Some(from) = minutes.from {
        bounds.push(format!("time >= {}", lit(from)));
    }
    if let Some(to) = minutes.to {
        bounds.push(format!("time < {}", lit(to)));
    }
    bounds
}

fn rollup_sql_of(minutes: Minutes, slice: Option<GpuSlice<'_>>) -> String {
    let select: Vec<String> = rollup_columns().into_iter().map(|(e, n)| format!("{e} AS {n}")).collect();
    let mut bounds = raw_bounds(minutes);
    bounds.extend(slice.map(GpuSlice::filter));
    let filter = if bounds.is_empty() { String::new() } else { format!(" WHERE {}", bounds.join(" AND ")) };
    format!(
        "SELECT {} FROM (SELECT *, {MINUTE_START} AS minute FROM {RAW} AS w{filter}) AS w GROUP BY w.gpu_uuid, minute",
        select.join(", ")
    )
}

/// Where the live part starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LiveFrom {
    /// Every day raw data affects is stored and current: stored rows only.
    Nothing,
    /// Stored rows before this instant (a day start), live minutes from it on.
    Time(i64),
    /// Nothing stored can be trusted: everything live.
    Everything,
}

/// The `gpu_samples_1m` table's SQL: stored minutes before the watermark, live ones from
/// it, both limited to `minutes`.
pub fn view_sql(live: LiveFrom, minutes: Minutes) -> String {
    let mut stored = Vec::new();
    if let Some(from) = minutes.from {
        stored.push(format!("time >= {}", lit(from)));
    }
    if let Some(to) = minutes.to {
        stored.push(format!("time < {}", lit(to)));
    }
    let stored_sql = |extra: Option<i64>| {
        let mut b = stored.clone();
        if let Some(w) = extra {
            b.push(format!("time < {}", lit(w)));
        }
        let filter = if b.is_empty() { String::new() } else { format!(" WHERE {}", b.join(" AND ")) };
        format!("SELECT * FROM {STORED}{filter}")
    };
    match live {
        LiveFrom::Nothing => stored_sql(None),
        LiveFrom::Everything => rollup_sql(minutes),
        LiveFrom::Time(w) => format!(
            "{} UNION ALL {}",
            stored_sql(Some(w)),
            rollup_sql(minutes.intersect(Minutes { from: Some(w), to: None }))
        ),
    }
}

/// One raw file a materialization read.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct InputFile {
    /// `<day>/<file name>`.
    pub name: String,
    pub bytes: u64,
}

/// The raw files rollup day `day` reads now: those of raw day `day`.
pub fn inputs(raw: &[DataFile], day: i64) -> Vec<InputFile> {
    let mut v: Vec<InputFile> = raw
        .iter()
        .filter(|f| f.day == Some(day))
        .map(|f| InputFile {
            name: format!(
                "{}/{}",
                f.day.unwrap_or_default(),
                f.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
            ),
            bytes: f.bytes,
        })
        .collect();
    v.sort();
    v
}

/// What one materialized day read.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DayState {
    pub inputs: Vec<InputFile>,
    /// When it was materialized (µs).
    pub materialized_us: i64,
    pub rows: usize,
}

/// How the stored minute rows are labelled.
///
/// State files written before 2026-12-05 have no `labels` and read as [`Labels::End`].
/// The materializer moves such a directory over once: it forgets every day's record
/// ([`Labels::Relabelling`]), so days raw data still covers are re-rolled from raw, and
/// it rewrites each older stored day with every row moved back one minute (the old
/// minute `(m − 60 s, m]` becomes `[m − 60 s, m)`: the same windows but the one ending
/// exactly at `m − 60 s`), recording each day as it is done; then [`Labels::Start`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Labels {
    /// Minutes by their end: no stored day can be trusted by the query layer.
    End,
    /// Being moved over: a stored day is labelled by its start once it has a record.
    Relabelling,
    /// Minutes by their start.
    #[default]
    Start,
}

impl Labels {
    fn legacy() -> Labels {
        Labels::End
    }
}

/// `<data_dir>/derived/rollup.json`: per materialized date, the raw files it read.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RollupState {
    #[serde(default = "Labels::legacy")]
    pub labels: Labels,
    pub days: BTreeMap<i64, DayState>,
    /// While [`Labels::Relabelling`]: the day being rewritten and its files before, so a
    /// restart can tell whether that rewrite was committed (moving a day twice would put
    /// it two minutes off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub relabelling: Option<(i64, Vec<String>)>,
}

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a rollup state file: {source}")]
    Parse {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
}

impl RollupState {
    /// Reads the state; a missing file is an empty state.
    pub fn load(path: &Path) -> Result<RollupState, StateError> {
        match std::fs::read(path) {
            Ok(bytes) => {
                serde_json::from_slice(&bytes).map_err(|source| StateError::Parse { path: path.to_path_buf(), source })
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(RollupState::default()),
            Err(source) => Err(StateError::Io { path: path.to_path_buf(), source }),
        }
    }

    /// Writes the state atomically (temp file, fsync, rename, fsync the directory).
    pub fn save(&self, path: &Path) -> Result<(), StateError> {
        let io = |source| StateError::Io { path: path.to_path_buf(), source };
        let bytes = serde_json::to_vec_pretty(self).map_err(|e| io(e.into()))?;
        let dir = path.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(io)?;
        apron_collector::write_atomic(path, &bytes).map_err(io)
    }
}

/// A rollup day's standing against the raw data now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DayStatus {
    /// Stored and no raw input is newer than the stored rows.
    Current,
    /// Not stored.
    Missing,
    /// Stored, but raw files it did not read exist (late data, compaction), or stored
    /// without a record of what it read, or labelled by minute ends ([`Labels::End`]).
    Stale,
    /// Raw rows of the day are still only in memory (not in any file yet).
    InMemory,
}

/// The raw data now, as far as the rollup cares.
#[derive(Clone, Debug, Default)]
pub struct RawView {
    pub files: Vec<DataFile>,
    /// Rollup days touched by raw rows still in memory.
    pub memory_days: BTreeSet<i64>,
}

impl RawView {
    pub fn new(files: Vec<DataFile>, batches: &[RecordBatch]) -> RawView {
        let mut memory_days = BTreeSet::new();
        for b in batches {
            let Some((lo, hi)) = b.column_by_name("time").and_then(time_span) else { continue };
            for d in lo.div_euclid(MICROS_PER_DAY)..=hi.div_euclid(MICROS_PER_DAY) {
                memory_days.insert(d);
            }
        }
        RawView { files, memory_days }
    }

    /// The rollup days raw data affects: raw day r feeds rollup day r alone; `None` if
    /// a raw file's day is unknown.
    pub fn affected_days(&self) -> Option<BTreeSet<i64>> {
        let mut days = self.memory_days.clone();
        for f in &self.files {
            days.insert(f.day?);
        }
        Some(days)
    }

    /// How stored rollup day `day` stands. `state` `None`: no record kept, stored days
    /// are trusted.
    pub fn status(&self, day: i64, stored: &BTreeSet<i64>, state: Option<&RollupState>) -> DayStatus {
        if self.memory_days.contains(&day) {
            return DayStatus::InMemory;
        }
        if !stored.contains(&day) {
            return DayStatus::Missing;
        }
        let Some(state) = state else { return DayStatus::Current };
        if state.labels == Labels::End {
            return DayStatus::Stale;
        }
        let Some(recorded) = state.days.get(&day) else { return DayStatus::Stale };
        if inputs(&self.files, day).iter().all(|f| recorded.inputs.binary_search(f).is_ok()) {
            DayStatus::Current
        } else {
            DayStatus::Stale
        }
    }

    /// The watermark: live from the earliest affected day that is not current.
    pub fn live_from(&self, stored: &BTreeSet<i64>, state: Option<&RollupState>) -> LiveFrom {
        let Some(days) = self.affected_days() else { return LiveFrom::Everything };
        match days.into_iter().find(|&d| self.status(d, stored, state) != DayStatus::Current) {
            Some(d) => LiveFrom::Time(d.saturating_mul(MICROS_PER_DAY)),
            None => LiveFrom::Nothing,
        }
    }
}

/// Min and max of a Timestamp(µs) column.
fn time_span(col: &Arc<dyn Array>) -> Option<(i64, i64)> {
    let ts = col.as_any().downcast_ref::<TimestampMicrosecondArray>()?;
    Some((min(ts)?, max(ts)?))
}

/// The stored days of `gpu_samples_1m` (its files' partitions).
pub fn stored_days(files: &[DataFile]) -> BTreeSet<i64> {
    files.iter().filter_map(|f| f.day).collect()
}

/// The `gpu_samples_1m` table: stored minutes below the watermark, live ones above (see
/// the module docs). Planned afresh at each scan, so every query sees the data as of its
/// start.
pub struct RollupTable {
    /// The declared schema: the storage schema, every column nullable (the live part's
    /// aggregates are nullable to the planner).
    schema: SchemaRef,
    source: Arc<dyn TableSource>,
    state_path: Option<PathBuf>,
    /// A private session holding `gpu_samples` and the stored rows ([`STORED`]).
    planner: SessionContext,
}

impl fmt::Debug for RollupTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RollupTable").field("state_path", &self.state_path).finish()
    }
}

impl RollupTable {
    /// `None` when the source lacks `gpu_samples` or `gpu_samples_1m`.
    pub fn new(source: Arc<dyn TableSource>, state_path: Option<PathBuf>) -> Result<Option<RollupTable>> {
        let (Some(raw), Some(stored)) = (source.schema(RAW), source.schema(NAME)) else { return Ok(None) };
        let state = SessionStateBuilder::new().with_default_features().build();
        let planner = SessionContext::new_with_state(state);
        planner.register_table(RAW, Arc::new(ApronTable::new(Table::GpuSamples, raw, source.clone())))?;
        planner
            .register_table(STORED, Arc::new(ApronTable::new(Table::GpuSamples1m, stored.clone(), source.clone())))?;
        let fields: Vec<ArrowField> = stored.fields().iter().map(|f| f.as_ref().clone().with_nullable(true)).collect();
        Ok(Some(RollupTable { schema: Arc::new(Schema::new(fields)), source, state_path, planner }))
    }

    /// The SQL this table runs now for `minutes`.
    pub fn plan_sql(&self, minutes: Minutes) -> Result<String> {
        let ext = |e: Box<dyn std::error::Error + Send + Sync>| DataFusionError::External(e);
        let raw = self.source.snapshot(RAW).map_err(|e| ext(Box::new(e)))?;
        let stored = self.source.snapshot(NAME).map_err(|e| ext(Box::new(e)))?;
        let state = match (self.source.rollup_state(), &self.state_path) {
            (Some(s), _) => Some(s.map_err(|e| ext(Box::new(e)))?),
            (None, Some(p)) => Some(RollupState::load(p).map_err(|e| ext(Box::new(e)))?),
            (None, None) => None,
        };
        let view = RawView::new(raw.files, &raw.batches);
        let live = view.live_from(&stored_days(&stored.files), state.as_ref());
        tracing::debug!(?live, ?minutes, "gpu_samples_1m plan");
        Ok(view_sql(live, minutes))
    }
}

#[async_trait]
impl TableProvider for RollupTable {
    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    fn supports_filters_pushdown(&self, filters: &[&Expr]) -> Result<Vec<TableProviderFilterPushDown>> {
        // Used to bound the minutes read; DataFusion re-checks the rows.
        Ok(vec![TableProviderFilterPushDown::Inexact; filters.len()])
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let minutes = Minutes::covering(time_range(filters, "time"));
        let sql = self.plan_sql(minutes)?;
        let plan = self.planner.state().create_logical_plan(&sql).await?;
        plan_as_table(state, plan, NAME, &self.schema, projection, filters, limit).await
    }
}

/// The physical plan of `plan` served as table `name` (of `schema`): the scan's
/// `filters` (which name the users' table) applied to it, then its `projection` and
/// `limit`. For tables that are SQL over other tables (this one, and a query server's
/// merged shards, `crate::lake`).
pub(crate) async fn plan_as_table(
    state: &dyn Session,
    plan: datafusion::logical_expr::LogicalPlan,
    name: &str,
    schema: &SchemaRef,
    projection: Option<&Vec<usize>>,
    filters: &[Expr],
    limit: Option<usize>,
) -> Result<Arc<dyn ExecutionPlan>> {
    let mut b = LogicalPlanBuilder::from(plan).alias(name)?;
    // The filters name the users' table; here its columns are this alias's.
    let unqualified: Vec<Expr> = filters
        .iter()
        .map(|f| {
            f.clone()
                .transform(|e| match e {
                    Expr::Column(c) => Ok(Transformed::yes(Expr::Column(Column::new(Some(name), c.name)))),
                    other => Ok(Transformed::no(other)),
                })
                .map(|t| t.data)
        })
        .collect::<Result<_>>()?;
    if let Some(filter) = conjunction(unqualified) {
        b = b.filter(filter)?;
    }
    let columns: Vec<usize> = match projection {
        Some(p) => p.clone(),
        None => (0..schema.fields().len()).collect(),
    };
    b = b.project(columns.iter().map(|&i| Expr::Column(Column::new(Some(name), schema.field(i).name().clone()))))?;
    if let Some(n) = limit {
        b = b.limit(0, Some(n))?;
    }
    state.create_physical_plan(&b.build()?).await
}

/// The wire form of rollup rows (`Table::GpuSamples1m.schema()`: extremes as Float64,
/// which `Store::replace_partition` converts back to exact storage types).
pub fn to_wire(batch: &RecordBatch) -> Result<RecordBatch> {
    let schema = Table::GpuSamples1m.schema();
    let mut cols = Vec::with_capacity(schema.fields().len());
    for f in schema.fields() {
        let col = batch
            .column_by_name(f.name())
            .ok_or_else(|| DataFusionError::Plan(format!("the rollup result has no column {}", f.name())))?;
        cols.push(datafusion::arrow::compute::cast(col, f.data_type())?);
    }
    Ok(RecordBatch::try_new(schema, cols)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_are_the_wire_schema_in_order() {
        let names: Vec<String> = rollup_columns().into_iter().map(|(_, n)| n).collect();
        let wire: Vec<String> = Table::GpuSamples1m.schema().fields().iter().map(|f| f.name().clone()).collect();
        assert_eq!(names, wire);
    }

    #[test]
    fn sql_bounds_the_raw_time_by_minute_starts() {
        // Day 2026-11-19 = 20776: windows ending in [11-19 00:00:00, 11-20 00:00:00).
        let sql = rollup_sql(Minutes::day(20_776));
        assert!(
            sql.contains("time >= '2026-11-19T00:00:00.000000Z' AND time < '2026-11-20T00:00:00.000000Z'"),
            "{sql}"
        );
        assert!(sql.contains("date_bin(INTERVAL '1 minute', w.time)"), "{sql}");
        assert!(sql.contains("CAST(avg(w.gpu_util) AS DOUBLE) AS gpu_util_mean"), "{sql}");
        assert!(sql.contains("min(w.gpu_util) AS gpu_util_min, max(w.gpu_util) AS gpu_util_max,"), "{sql}");
        assert!(sql.contains("CAST(avg(w.gpu_util_max) AS DOUBLE) AS gpu_util_max_mean"), "{sql}");
        assert!(sql.contains("max(w.gpu_util_max) AS gpu_util_max_max"), "{sql}");
        assert!(!sql.contains("fb_used_bytes_max_max"), "gauges have no window max column: {sql}");
        assert!(sql.ends_with("GROUP BY w.gpu_uuid, minute"), "{sql}");
        assert!(!rollup_sql(Minutes::ALL).contains("WHERE"));
        let slice = slice_sql(Minutes::day(20_776), GpuSlice { first: "GPU-a", last: "GPU-o'k" });
        assert!(slice.contains("AND gpu_uuid >= 'GPU-a' AND gpu_uuid <= 'GPU-o''k') AS w"), "{slice}");
        assert!(slice.ends_with("GROUP BY w.gpu_uuid, minute ORDER BY gpu_uuid, time"), "{slice}");
    }

    #[test]
    fn relabelling_moves_end_labels_back_a_minute() {
        let sql = relabel_sql(20_776, true, GpuSlice { first: "GPU-a", last: "GPU-b" });
        assert!(sql.starts_with("SELECT time - INTERVAL '1 minute' AS time, window_s, cluster,"), "{sql}");
        assert!(
            sql.ends_with(
                "FROM gpu_samples_1m WHERE time > '2026-11-19T00:00:00.000000Z' AND time <= \
                 '2026-11-20T00:00:00.000000Z' AND gpu_uuid >= 'GPU-a' AND gpu_uuid <= 'GPU-b' ORDER BY gpu_uuid, time"
            ),
            "{sql}"
        );
        let last = relabel_sql(20_776, false, GpuSlice { first: "GPU-a", last: "GPU-b" });
        assert!(last.contains("AND time < '2026-11-20T00:00:00.000000Z'"), "{last}");
    }

    #[test]
    fn minutes_cover_their_labels() {
        assert_eq!(floor_minute(-1), -MINUTE_US);
        assert_eq!(floor_minute(MINUTE_US + 1), MINUTE_US);
        assert_eq!(ceil_minute(0), 0);
        assert_eq!(ceil_minute(1), MINUTE_US);
        assert_eq!(ceil_minute(-1), 0);
        assert_eq!(ceil_minute(MINUTE_US), MINUTE_US);
        let m = Minutes::covering(TimeRange { min: Some(30_000_000), max: Some(MINUTE_US) });
        assert_eq!(m, Minutes { from: Some(MINUTE_US), to: Some(2 * MINUTE_US) });
        assert_eq!(Minutes::covering(TimeRange::ALL), Minutes::ALL);
    }

    #[test]
    fn view_sql_splits_at_the_watermark() {
        let w = 20_776 * MICROS_PER_DAY;
        let sql = view_sql(LiveFrom::Time(w), Minutes::ALL);
        assert!(
            sql.starts_with(
                "SELECT * FROM gpu_samples_1m_stored WHERE time < '2026-11-19T00:00:00.000000Z' UNION ALL SELECT"
            ),
            "{sql}"
        );
        assert!(sql.contains("WHERE time >= '2026-11-19T00:00:00.000000Z')"), "{sql}");
        assert_eq!(view_sql(LiveFrom::Nothing, Minutes::ALL), "SELECT * FROM gpu_samples_1m_stored");
        assert_eq!(view_sql(LiveFrom::Everything, Minutes::ALL), rollup_sql(Minutes::ALL));
    }

    fn file(day: i64, name: &str, bytes: u64) -> DataFile {
        DataFile { path: PathBuf::from(format!("/d/gpu_samples/date=x/{name}")), bytes, day: Some(day) }
    }

    #[test]
    fn staleness_and_watermark() {
        let raw = RawView { files: vec![file(10, "a", 1), file(11, "b", 2)], memory_days: BTreeSet::new() };
        // Raw days 10, 11 affect rollup days 10, 11 and no other.
        assert_eq!(raw.affected_days(), Some(BTreeSet::from([10, 11])));
        assert_eq!(inputs(&raw.files, 11), [InputFile { name: "11/b".into(), bytes: 2 }]);
        let stored = BTreeSet::from([10, 11]);
        let mut state = RollupState::default();
        state.days.insert(10, DayState { inputs: inputs(&raw.files, 10), ..Default::default() });
        state.days.insert(11, DayState { inputs: inputs(&raw.files, 11), ..Default::default() });
        assert_eq!(raw.live_from(&stored, Some(&state)), LiveFrom::Nothing);
        assert_eq!(raw.status(12, &stored, Some(&state)), DayStatus::Missing);
        // Rows labelled by minute ends (an old state file) are never current.
        let old = RollupState { labels: Labels::End, ..state.clone() };
        assert_eq!(raw.status(11, &stored, Some(&old)), DayStatus::Stale);
        assert_eq!(raw.live_from(&stored, Some(&old)), LiveFrom::Time(10 * MICROS_PER_DAY));
        // A late file for day 11 (compaction or late data) makes 11 stale.
        let mut late = raw.clone();
        late.files.push(file(11, "c", 3));
        assert_eq!(late.status(11, &stored, Some(&state)), DayStatus::Stale);
        assert_eq!(late.status(10, &stored, Some(&state)), DayStatus::Current);
        assert_eq!(late.live_from(&stored, Some(&state)), LiveFrom::Time(11 * MICROS_PER_DAY));
        // Retention deleting raw day 10 does not make 11 stale.
        let expired = RawView { files: vec![file(11, "b", 2)], memory_days: BTreeSet::new() };
        assert_eq!(expired.status(11, &stored, Some(&state)), DayStatus::Current);
        // Rows only in memory make their day not current.
        let mem = RawView { memory_days: BTreeSet::from([10]), ..raw.clone() };
        assert_eq!(mem.live_from(&stored, Some(&state)), LiveFrom::Time(10 * MICROS_PER_DAY));
        // No state kept: stored days are trusted.
        assert_eq!(raw.status(11, &stored, None), DayStatus::Current);
        assert_eq!(raw.live_from(&stored, None), LiveFrom::Nothing);
    }

    #[tokio::test]
    async fn planned_types_are_the_storage_types() {
        let dir = tempfile::tempdir().expect("tempdir");
        let source = Arc::new(crate::DirectorySource::open(dir.path()).expect("open"));
        let t = RollupTable::new(source, None).expect("new").expect("tables");
        for live in [LiveFrom::Time(0), LiveFrom::Everything, LiveFrom::Nothing] {
            let sql = view_sql(live, Minutes::day(3));
            let plan = t.planner.state().create_logical_plan(&sql).await.expect("plan");
            let got: Vec<(String, String)> =
                plan.schema().fields().iter().map(|f| (f.name().clone(), f.data_type().to_string())).collect();
            let want: Vec<(String, String)> =
                t.schema.fields().iter().map(|f| (f.name().clone(), f.data_type().to_string())).collect();
            assert_eq!(got, want, "{live:?}");
        }
    }

    #[test]
    fn state_round_trips_and_missing_is_empty() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(STATE_FILE);
        assert_eq!(RollupState::load(&path).expect("missing"), RollupState::default());
        let mut s = RollupState::default();
        s.days.insert(
            3,
            DayState { inputs: vec![InputFile { name: "2/x".into(), bytes: 9 }], materialized_us: 1, rows: 2 },
        );
        s.save(&path).expect("save");
        assert_eq!(RollupState::load(&path).expect("load"), s);
        // A state file from before start labels has no `labels`: minutes by their end.
        std::fs::write(&path, r#"{"days": {}}"#).expect("write");
        assert_eq!(RollupState::load(&path).expect("load").labels, Labels::End);
        assert_eq!(RollupState::default().labels, Labels::Start);
    }
}
