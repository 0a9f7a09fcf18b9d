//! The table provider: one SQL table = its Parquet files UNION its memtable batches.
//!
//! ```text
//!  scan(projection, filters, limit)
//!    source.snapshot(table)                      files + batches, no row in both
//!    time_range(filters, time column)            e.g. time >= '2026-11-19'
//!    ├─ files whose date= day overlaps ──► DataSourceExec(Parquet)
//!    │     predicate = AND(filters): row-group statistics, page index, row filters
//!    │     output ordering (gpu_uuid, time) when each partition reads one file
//!    └─ batches whose time span overlaps ──► rows within the time and gpu_uuid bounds
//!          ──► projected columns widened to the table's types (the memtable holds
//!          decimals unscaled and strings as dictionaries) ──► DataSourceExec(memory),
//!          sorted by the same keys when the projection has them
//!    UnionExec (or the one side that has data, or EmptyExec)
//! ```
//!
//! Filters are answered `Inexact`: DataFusion keeps its own filter above the scan and
//! hands us the filters for pruning. The memtable part is only narrowed here by bounds
//! that are never tighter than the filters (`prune::time_range`, `prune::key_range`), so
//! the per-GPU-chunk queries of the evaluators copy and sort their chunk's rows only.
//!
//! The Hive `date` partition column is not exposed: it is derived from `time` (the UTC
//! day), the memtable has no such column, and filters on `time` prune partitions anyway.
//! DuckDB/pyarrow readers with `hive_partitioning` do see it as `date`.

use std::fmt;
use std::sync::Arc;

use apron_collector::schema::widen;
use async_trait::async_trait;
use datafusion::arrow::array::{Array, ArrayRef, AsArray, BooleanArray, StringArray, TimestampMicrosecondArray};
use datafusion::arrow::compute::filter_record_batch;
use datafusion::arrow::compute::kernels::aggregate::{max, min};
use datafusion::arrow::compute::kernels::boolean::and;
use datafusion::arrow::compute::kernels::cmp::{gt_eq, lt_eq};
use datafusion::arrow::compute::{SortColumn, SortOptions, concat_batches, lexsort_to_indices, take_record_batch};
use datafusion::arrow::datatypes::TimestampMicrosecondType;
use datafusion::arrow::datatypes::{SchemaRef, TimeUnit};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::catalog::{Session, TableProvider};
use datafusion::common::{DataFusionError, Result, project_schema};
use datafusion::datasource::TableType;
use datafusion::datasource::listing::PartitionedFile;
use datafusion::datasource::memory::MemorySourceConfig;
use datafusion::datasource::object_store::ObjectStoreUrl;
use datafusion::datasource::physical_plan::parquet::CachedParquetFileReaderFactory;
use datafusion::datasource::physical_plan::{FileGroup, FileScanConfigBuilder, ParquetSource};
use datafusion::datasource::source::DataSourceExec;
use datafusion::logical_expr::utils::conjunction;
use datafusion::logical_expr::{Expr, TableProviderFilterPushDown};
use datafusion::object_store::path::Path as ObjectPath;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::{LexOrdering, PhysicalSortExpr};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::empty::EmptyExec;
use datafusion::physical_plan::union::UnionExec;

use crate::prune::{KeyRange, TimeRange, key_range, time_range};
use crate::source::{DataFile, TableSource};
use apron_common::wire::Table;

/// Up to this many files per partition slot, each file gets its own partition, so the
/// declared sort order holds per partition and DataFusion merges sorted streams instead
/// of sorting. With more files they are packed into `target_partitions` groups (a group
/// of several overlapping files is not sorted; DataFusion then drops the ordering).
const ORDERED_FILES_PER_PARTITION: usize = 4;

/// The ascending order the persister writes (and the memtable scan produces):
/// non-null key columns, so NULLS LAST is as true as FIRST and matches SQL's `ASC`.
const ASC: SortOptions = SortOptions { descending: false, nulls_first: false };

/// One stored table, read through a [`TableSource`].
pub struct ApronTable {
    table: Table,
    schema: SchemaRef,
    source: Arc<dyn TableSource>,
}

impl fmt::Debug for ApronTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ApronTable").field("table", &self.table.name()).finish()
    }
}

/// What one scan read and skipped, for logs and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScanStats {
    pub files: usize,
    pub files_pruned: usize,
    pub batches: usize,
    pub batches_pruned: usize,
}

impl ApronTable {
    pub fn new(table: Table, schema: SchemaRef, source: Arc<dyn TableSource>) -> ApronTable {
        ApronTable { table, schema, source }
    }

    pub fn table(&self) -> Table {
        self.table
    }

    pub fn source(&self) -> &Arc<dyn TableSource> {
        &self.source
    }

    /// Indices (in the table schema) of the longest prefix of the sort order that is in
    /// `columns` — the ordering a projection can still declare.
    fn sort_prefix(&self, columns: &[usize]) -> Vec<usize> {
        self.table
            .sort_order()
            .iter()
            .map_while(|name| self.schema.index_of(name).ok().filter(|i| columns.contains(i)))
            .collect()
    }

    /// The declared ordering over `keys` (table-schema indices), in `schema`'s indices.
    fn ordering(&self, keys: &[usize], schema: &SchemaRef) -> Option<LexOrdering> {
        let exprs = keys.iter().map(|&k| {
            let name = self.schema.field(k).name();
            let idx = schema.index_of(name).ok()?;
            Some(PhysicalSortExpr::new(Arc::new(Column::new(name, idx)), ASC))
        });
        LexOrdering::new(exprs.collect::<Option<Vec<_>>>()?)
    }

    fn parquet_scan(
        &self,
        state: &dyn Session,
        files: Vec<DataFile>,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let remote = self.source.object_store();
        let url = match &remote {
            Some((url, store)) => {
                let url = ObjectStoreUrl::parse(url)?;
                // Idempotent; registered here so every session over this source has it.
                state.runtime_env().register_object_store(url.as_ref(), store.clone());
                url
            }
            None => ObjectStoreUrl::local_filesystem(),
        };
        let mut source = ParquetSource::new(self.schema.clone())
            .with_table_parquet_options(state.table_options().parquet.clone())
            // Evaluate filters while decoding (late materialisation), cheapest first,
            // and skip pages by the page index the persister writes.
            .with_pushdown_filters(true)
            .with_reorder_filters(true)
            .with_enable_page_index(true)
            // Footers and page indexes are cached across queries (files are immutable
            // and never reuse a name).
            .with_parquet_file_reader_factory(Arc::new(CachedParquetFileReaderFactory::new(
                state.runtime_env().object_store(&url)?,
                state.runtime_env().cache_manager.get_file_metadata_cache(),
            )));
        if let Some(filter) = conjunction(filters.to_vec()) {
            let df_schema = datafusion::common::DFSchema::try_from(self.schema.as_ref().clone())?;
            source = source.with_predicate(state.create_physical_expr(filter, &df_schema)?);
        }

        let mut parts = Vec::with_capacity(files.len());
        for f in files {
            let location = if remote.is_some() {
                ObjectPath::from(f.path.to_string_lossy().as_ref())
            } else {
                let path = std::path::absolute(&f.path).map_err(DataFusionError::IoError)?;
                ObjectPath::from_absolute_path(&path).map_err(|e| DataFusionError::External(Box::new(e)))?
            };
            let mut pf = PartitionedFile::new(String::new(), f.bytes);
            pf.object_meta.location = location;
            parts.push(pf);
        }
        let target = state.config().target_partitions().max(1);
        let groups: Vec<FileGroup> = if parts.len() <= target * ORDERED_FILES_PER_PARTITION {
            parts.into_iter().map(|p| FileGroup::new(vec![p])).collect()
        } else {
            pack(parts, target).into_iter().map(FileGroup::new).collect()
        };
        let all: Vec<usize> = (0..self.schema.fields().len()).collect();
        let keys = self.sort_prefix(&all);
        let mut config = FileScanConfigBuilder::new(url, Arc::new(source))
            .with_file_groups(groups)
            .with_limit(limit)
            .with_projection_indices(projection.cloned())?;
        if let Some(ordering) = self.ordering(&keys, &self.schema) {
            config = config.with_output_ordering(vec![ordering]);
        }
        Ok(DataSourceExec::from_data_source(config.build()))
    }

    fn memory_scan(
        &self,
        state: &dyn Session,
        batches: Vec<RecordBatch>,
        projection: Option<&Vec<usize>>,
        limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let columns: Vec<usize> = match projection {
            Some(p) => p.clone(),
            None => (0..self.schema.fields().len()).collect(),
        };
        let projected = project_schema(&self.schema, Some(&columns))?;
        let keys = self.sort_prefix(&columns);
        // Memtable batches hold decimals unscaled (the memory schema); only the projected
        // columns are widened to the table's types, one batch at a time.
        let narrow = |b: &RecordBatch| b.project(&columns);
        let partitions = if keys.is_empty() || limit.is_some() {
            // No order to offer (or a LIMIT without ORDER BY): spread the batches over
            // the partitions as they are.
            let target = state.config().target_partitions().max(1).min(batches.len()).max(1);
            let mut parts = vec![Vec::new(); target];
            for (i, b) in batches.iter().enumerate() {
                parts[i % target].push(widen(&narrow(b)?, &projected)?);
            }
            parts
        } else {
            // Sort the (small, at most one persist interval of) memtable rows by the
            // persisted order, so the union keeps the files' ordering and an ORDER BY /
            // GROUP BY on it needs no full sort. Only the projected columns are copied,
            // never the whole memtable.
            let narrow = batches.iter().map(narrow).collect::<std::result::Result<Vec<_>, _>>()?;
            let Some(first) = narrow.first() else {
                return Ok(Arc::new(EmptyExec::new(projected)));
            };
            let all = concat_batches(&first.schema(), &narrow)?;
            drop(narrow);
            let sort: Vec<SortColumn> = keys
                .iter()
                .filter_map(|k| columns.iter().position(|c| c == k))
                .map(|i| SortColumn { values: all.column(i).clone(), options: Some(ASC) })
                .collect();
            let indices = lexsort_to_indices(&sort, None)?;
            vec![vec![widen(&take_record_batch(&all, &indices)?, &projected)?]]
        };
        let mut mem = MemorySourceConfig::try_new(&partitions, projected.clone(), None)?.with_limit(limit);
        if partitions.len() == 1
            && !keys.is_empty()
            && limit.is_none()
            && let Some(ordering) = self.ordering(&keys, &projected)
        {
            mem = mem.try_with_sort_information(vec![ordering])?;
        }
        Ok(DataSourceExec::from_data_source(mem))
    }

    /// The memtable rows whose time and `gpu_uuid` the filters' bounds can match (a
    /// superset of the rows the filters keep: DataFusion re-checks each), before any
    /// copy or sort: an evaluator that reads its GPUs a chunk at a time sorts the
    /// chunk's rows, not the whole memtable's, on every query.
    fn rows_in(&self, batches: Vec<RecordBatch>, range: TimeRange, uuids: &KeyRange) -> Result<Vec<RecordBatch>> {
        if range.is_all() && uuids.is_all() {
            return Ok(batches);
        }
        let mut out = Vec::with_capacity(batches.len());
        for b in batches {
            let mut mask: Option<BooleanArray> = None;
            let mut narrow = |m: BooleanArray| -> Result<()> {
                mask = Some(match mask.take() {
                    Some(prev) => and(&prev, &m)?,
                    None => m,
                });
                Ok(())
            };
            if !range.is_all()
                && let Some(time) = b
                    .column_by_name(self.table.time_column())
                    .and_then(|c| c.as_primitive_opt::<TimestampMicrosecondType>())
            {
                narrow(time.iter().map(|t| Some(t.is_some_and(|t| range.contains(&t)))).collect())?;
            }
            if let Some(uuid) = b.column_by_name("gpu_uuid") {
                if let Some(lo) = &uuids.min {
                    narrow(gt_eq(uuid, &StringArray::new_scalar(lo))?)?;
                }
                if let Some(hi) = &uuids.max {
                    narrow(lt_eq(uuid, &StringArray::new_scalar(hi))?)?;
                }
            }
            let kept = match mask {
                Some(m) if m.true_count() < b.num_rows() => filter_record_batch(&b, &m)?,
                _ => b,
            };
            if kept.num_rows() > 0 {
                out.push(kept);
            }
        }
        Ok(out)
    }

    /// Splits a snapshot into what the filters' time range can match.
    fn prune(
        &self,
        files: Vec<DataFile>,
        batches: Vec<RecordBatch>,
        range: TimeRange,
    ) -> (Vec<DataFile>, Vec<RecordBatch>, ScanStats) {
        let mut stats = ScanStats::default();
        let (files, skipped): (Vec<_>, Vec<_>) =
            files.into_iter().partition(|f| f.day.is_none_or(|d| range.overlaps_day(d)));
        stats.files = files.len();
        stats.files_pruned = skipped.len();
        let time_idx = self.schema.index_of(self.table.time_column()).ok();
        let (batches, skipped): (Vec<_>, Vec<_>) = batches.into_iter().filter(|b| b.num_rows() > 0).partition(|b| {
            match time_idx.and_then(|i| time_span(b.column(i))) {
                Some((lo, hi)) => range.overlaps(&lo, &hi),
                None => true,
            }
        });
        stats.batches = batches.len();
        stats.batches_pruned = skipped.len();
        (files, batches, stats)
    }
}

/// Min and max of a Timestamp(µs) column, `None` if it is another type or all null.
fn time_span(col: &ArrayRef) -> Option<(i64, i64)> {
    if !matches!(col.data_type(), datafusion::arrow::datatypes::DataType::Timestamp(TimeUnit::Microsecond, _)) {
        return None;
    }
    let ts = col.as_any().downcast_ref::<TimestampMicrosecondArray>()?;
    Some((min(ts)?, max(ts)?))
}

/// Packs files into `n` groups of similar total size (largest first into the lightest).
fn pack(mut files: Vec<PartitionedFile>, n: usize) -> Vec<Vec<PartitionedFile>> {
    files.sort_by_key(|f| std::cmp::Reverse(f.object_meta.size));
    let mut groups: Vec<(u64, Vec<PartitionedFile>)> = (0..n).map(|_| (0, Vec::new())).collect();
    for f in files {
        if let Some(g) = groups.iter_mut().min_by_key(|g| g.0) {
            g.0 += f.object_meta.size;
            g.1.push(f);
        }
    }
    groups.into_iter().map(|g| g.1).filter(|g| !g.is_empty()).collect()
}

#[async_trait]
impl TableProvider for ApronTable {
    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    fn supports_filters_pushdown(&self, filters: &[&Expr]) -> Result<Vec<TableProviderFilterPushDown>> {
        // Inexact: used for pruning and Parquet row filters; DataFusion re-checks rows.
        Ok(vec![TableProviderFilterPushDown::Inexact; filters.len()])
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let snapshot = self.source.snapshot(self.table.name()).map_err(|e| DataFusionError::External(Box::new(e)))?;
        let range = time_range(filters, self.table.time_column());
        let (files, batches, stats) = self.prune(snapshot.files, snapshot.batches, range);
        tracing::debug!(table = self.table.name(), ?range, ?stats, "scan");

        let mut inputs = Vec::with_capacity(2);
        if !files.is_empty() {
            inputs.push(self.parquet_scan(state, files, projection, filters, limit)?);
        }
        let batches = self.rows_in(batches, range, &key_range(filters, "gpu_uuid"))?;
        if !batches.is_empty() {
            inputs.push(self.memory_scan(state, batches, projection, limit)?);
        }
        if inputs.is_empty() {
            return Ok(Arc::new(EmptyExec::new(project_schema(&self.schema, projection)?)));
        }
        UnionExec::try_new(inputs)
    }
}
