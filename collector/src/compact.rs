//! Compaction and retention: the small files that persists leave in a day partition
//! are merged in size tiers, a finished day once into one sorted file, and partitions
//! past their retention go.
//!
//! A persist every 10 minutes leaves ~144 files per table per day (a 1,000-GPU fleet
//! filling the memtable: ~500); readers pay per file (footers, row groups too small for
//! the page index to pay off). Merges work in tiers, so that compaction's work follows
//! new data and not the size of the day: a file's [`Level`] is in its name — a
//! persist's file is tier 0, a merge of tier-n files is tier n + 1 — and when one tier of
//! a partition holds more than `compaction_max_files` files, those files (and only those)
//! are merged. Each row is rewritten once per tier it climbs (log base
//! `compaction_max_files` of the persists per day: 1–2 times), where merging the whole
//! partition each time rewrote the morning's rows at every merge of the day. Once the
//! day is over (plus `compaction_delay`, so late batches of the day are usually in), its
//! files are merged once into one [`Level::Day`] file; data that comes later still is
//! tiered beside it and never rewrites the day again.
//!
//! Memory stays bounded whatever the day's size: inputs are read from local files a row
//! group at a time (an object store's are downloaded to scratch files first, in
//! pieces), the merge first counts rows per GPU (reading only `gpu_uuid`), then handles
//! contiguous GPU ranges of at most `max_rows_in_memory` rows at a time, reading from
//! each input only the row groups whose `gpu_uuid` statistics overlap the range. Inputs
//! are sorted by (`gpu_uuid`, `time`), so the ranges come out in order and the output
//! is sorted too.
//!
//! Crash safety (local directory): the output is written as a hidden temp file and
//! fsynced; then a journal `<partition>/.compaction.json` naming the inputs and the
//! output is written atomically — the commit point — and the output renamed into
//! place. From the commit on, [`list_files`](crate::persist::list_files) hides the
//! inputs (so `apron sql --data` never counts a row twice) while they stay on disk for
//! `superseded_grace`, letting queries that planned before the swap finish; then they
//! and the journal are deleted. A crash before the commit leaves an orphan temp file
//! (removed at start-up); after it, start-up finishes the rename and the deletions.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use apron_common::wire::Table;
use arrow_arith::boolean::and;
use arrow_array::cast::AsArray;
use arrow_array::{Array, RecordBatch, StringArray};
use arrow_ord::cmp::{gt_eq, lt_eq};
use parquet::arrow::ArrowWriter;
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::{ArrowPredicateFn, ArrowReaderOptions, ParquetRecordBatchReaderBuilder, RowFilter};
use parquet::file::metadata::{PageIndexPolicy, RowGroupMetaData};
use parquet::file::statistics::Statistics;
use serde::{Deserialize, Serialize};

use crate::fsutil::{self, MICROS_PER_DAY};
use crate::persist::{
    PersistError, PersistOptions, PersistedFile, SortedRows, StagedFile, table_dir, writer_properties,
};
use crate::schema::storage_schema;
use crate::storage::{LocalCopy, Storage};

/// The journal of a committed compaction, inside its partition directory.
pub const JOURNAL: &str = ".compaction.json";

/// A partition's files to merge.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub table: Table,
    pub date: String,
    pub inputs: Vec<PersistedFile>,
    /// The level of the merged file (it names the file).
    pub output: Level,
}

/// How far a file's rows have come through compaction, read from its file name: a
/// persist writes `<id>.parquet` (tier 0), a merge of tier-n files `<id>.t<n+1>.parquet`,
/// the merge of a finished day `<id>.day.parquet`. Names without a marker (files of
/// earlier versions, derived partitions) are tier 0. Every name ends in `.parquet`, so the
/// lake stays a plain Hive layout for other readers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Tier(u32),
    Day,
}

impl Level {
    pub fn of(path: &Path) -> Level {
        let name = file_name(path);
        let stem = name.strip_suffix(".parquet").unwrap_or(&name);
        match stem.rsplit_once('.').map(|(_, marker)| marker) {
            Some("day") => Level::Day,
            Some(marker) => marker.strip_prefix('t').and_then(|n| n.parse().ok()).map_or(Level::Tier(0), Level::Tier),
            None => Level::Tier(0),
        }
    }

    /// The file name of a file of this level with id `id`.
    pub fn file_name(self, id: &str) -> String {
        match self {
            Level::Tier(0) => format!("{id}.parquet"),
            Level::Tier(n) => format!("{id}.t{n}.parquet"),
            Level::Day => format!("{id}.day.parquet"),
        }
    }
}

impl std::fmt::Display for Level {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Level::Tier(n) => write!(f, "tier {n}"),
            Level::Day => f.write_str("day"),
        }
    }
}

/// The record that makes a compaction happen or not: file names within the partition.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Journal {
    pub inputs: Vec<String>,
    pub output_tmp: String,
    pub output: String,
}

/// When files are merged.
#[derive(Clone, Copy, Debug)]
pub struct Policy {
    /// A finished day is merged into one file this long after its end (µs).
    pub delay_us: i64,
    /// A tier of a partition with more files than this is merged into the next tier.
    pub max_files: usize,
}

/// The most files one tier merge reads: twice the trigger, so that a tier in step is
/// merged whole (it has just passed `max_files`) and a backlog goes in a few merges.
const fn max_merge_inputs(max_files: usize) -> usize {
    max_files.saturating_mul(2)
}

/// Whether a finished day with these files still gets its day merge (no day file yet and
/// more than one file): the rule [`plan`] applies, for readers that would rather wait
/// for the merge than read the day twice.
pub fn awaits_day_merge<'a>(paths: impl IntoIterator<Item = &'a Path>) -> bool {
    let (mut files, mut has_day) = (0usize, false);
    for p in paths {
        files += 1;
        has_day |= Level::of(p) == Level::Day;
    }
    !has_day && files >= 2
}

/// The merges due at `now_us`, at most one per partition, oldest partition first: a
/// finished day without its day file merges all its files into one; otherwise the
/// lowest tier holding more than `max_files` files merges those files.
pub fn plan(files: &[PersistedFile], now_us: i64, policy: Policy) -> Vec<Plan> {
    let mut by_partition: BTreeMap<(&str, &str), Vec<PersistedFile>> = BTreeMap::new();
    for f in files {
        by_partition.entry((f.table.name(), f.date.as_str())).or_default().push(f.clone());
    }
    by_partition
        .into_iter()
        .filter_map(|((_, date), inputs)| {
            let day_end = fsutil::parse_day(date)?.checked_add(1)?.checked_mul(MICROS_PER_DAY)?;
            let finished = day_end.saturating_add(policy.delay_us) <= now_us;
            let table = inputs[0].table;
            if finished && awaits_day_merge(inputs.iter().map(|f| f.path.as_path())) {
                return Some(Plan { table, date: date.to_owned(), inputs, output: Level::Day });
            }
            let mut tiers: BTreeMap<u32, Vec<PersistedFile>> = BTreeMap::new();
            for f in inputs {
                if let Level::Tier(n) = Level::of(&f.path) {
                    tiers.entry(n).or_default().push(f);
                }
            }
            let max_files = policy.max_files.max(1);
            let (n, mut inputs) = tiers.into_iter().find(|(_, files)| files.len() > max_files)?;
            // A tier that fell behind (a burst, a server that was down) is merged a
            // bounded batch at a time, oldest first (v7 ids sort by creation): each merge
            // stays as long as a normal one, and the next pass takes the rest.
            if inputs.len() > max_merge_inputs(max_files) {
                inputs.sort_by(|a, b| a.path.cmp(&b.path));
                inputs.truncate(max_merge_inputs(max_files));
            }
            Some(Plan { table, date: date.to_owned(), inputs, output: Level::Tier(n.saturating_add(1)) })
        })
        .collect()
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> PersistError + 'a {
    move |source| PersistError::Io { op, path: path.to_path_buf(), source }
}

/// A reader of a local input: the parquet reader fetches the footer and the page index
/// (when the file has one), then only the pages of the row groups and rows asked for.
fn open_reader(path: &Path) -> Result<ParquetRecordBatchReaderBuilder<fs::File>, PersistError> {
    let file = fs::File::open(path).map_err(io_err("open", path))?;
    let options = ArrowReaderOptions::new().with_page_index_policy(PageIndexPolicy::Optional);
    Ok(ParquetRecordBatchReaderBuilder::try_new_with_options(file, options)?)
}

/// Rows per GPU over all `inputs`, reading only the `gpu_uuid` column.
fn rows_per_gpu(inputs: &[LocalCopy]) -> Result<BTreeMap<String, usize>, PersistError> {
    let mut counts = BTreeMap::new();
    for f in inputs {
        let builder = open_reader(f.path())?;
        let index = builder.schema().index_of("gpu_uuid")?;
        let mask = ProjectionMask::roots(builder.parquet_schema(), [index]);
        for batch in builder.with_projection(mask).build()? {
            let batch = batch?;
            let uuids = string_column(&batch, 0)?;
            for i in 0..uuids.len() {
                *counts.entry(uuids.value(i).to_owned()).or_insert(0) += 1;
            }
        }
    }
    Ok(counts)
}

fn string_column(batch: &RecordBatch, i: usize) -> Result<&StringArray, PersistError> {
    batch.column(i).as_string_opt::<i32>().ok_or_else(|| {
        PersistError::Arrow(arrow_schema::ArrowError::SchemaError("gpu_uuid is not a Utf8 column".into()))
    })
}

/// Bytes a decoded string value is assumed to take (UUIDs, host and model names are
/// 10–40 bytes; the margin covers longer ones and per-batch buffer slack).
const STRING_VALUE_BYTES: usize = 64;

/// Decoded Arrow bytes of one row of `table`'s storage schema: fixed widths exactly,
/// strings at [`STRING_VALUE_BYTES`] plus their offset, a validity bit rounded up to a
/// byte. Dictionary columns count their keys (values are shared).
pub fn row_bytes(table: Table) -> usize {
    storage_schema(table)
        .fields()
        .iter()
        .map(|f| {
            let value = match f.data_type() {
                arrow_schema::DataType::Dictionary(key, _) => key.primitive_width().unwrap_or(8),
                arrow_schema::DataType::Boolean => 1,
                t => t.primitive_width().unwrap_or(4 + STRING_VALUE_BYTES),
            };
            value + usize::from(f.is_nullable())
        })
        .sum()
}

/// Rows of `table` a merge may hold for a budget of `bytes` (at least one).
pub fn rows_within(table: Table, bytes: usize) -> usize {
    (bytes / row_bytes(table).max(1)).max(1)
}

/// Contiguous ranges `[lo, hi]` of GPU UUIDs, each with at most `max_rows` rows (a single
/// GPU with more rows is a range of its own).
fn gpu_ranges(counts: &BTreeMap<String, usize>, max_rows: usize) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut current: Option<(String, String, usize)> = None;
    for (uuid, &n) in counts {
        current = match current.take() {
            Some((lo, _, rows)) if rows + n <= max_rows => Some((lo, uuid.clone(), rows + n)),
            Some((lo, hi, _)) => {
                out.push((lo, hi));
                Some((uuid.clone(), uuid.clone(), n))
            }
            None => Some((uuid.clone(), uuid.clone(), n)),
        };
    }
    out.extend(current.map(|(lo, hi, _)| (lo, hi)));
    out
}

/// Whether a row group may hold a GPU UUID in `[lo, hi]` (true when it has no statistics).
fn may_overlap(rg: &RowGroupMetaData, column: usize, lo: &str, hi: &str) -> bool {
    let Some(Statistics::ByteArray(s)) = rg.column(column).statistics() else { return true };
    let (Some(min), Some(max)) = (s.min_opt(), s.max_opt()) else { return true };
    match (min.as_utf8(), max.as_utf8()) {
        (Ok(min), Ok(max)) => min <= hi && max >= lo,
        _ => true,
    }
}

/// The rows of local file `path` whose GPU UUID is in `[lo, hi]`.
///
/// A persist's file holds every GPU, and a range is a few of them: decoding each
/// overlapping row group whole and filtering afterwards decoded every row group once
/// per range (a 256-GPU day in ~85 ranges: ~30× the day's rows). So `gpu_uuid` alone is
/// decoded first, as a row filter, and the other columns only for the rows it keeps —
/// with the page index loaded, pages holding none of them are not even read.
fn read_range(path: &Path, lo: &str, hi: &str) -> Result<Vec<RecordBatch>, PersistError> {
    let builder = open_reader(path)?;
    let leaf = builder
        .parquet_schema()
        .columns()
        .iter()
        .position(|c| c.path().string() == "gpu_uuid")
        .ok_or_else(|| PersistError::Arrow(arrow_schema::ArrowError::SchemaError("no gpu_uuid column".into())))?;
    let groups: Vec<usize> = (0..builder.metadata().num_row_groups())
        .filter(|&i| may_overlap(builder.metadata().row_group(i), leaf, lo, hi))
        .collect();
    if groups.is_empty() {
        return Ok(Vec::new());
    }
    let key = ProjectionMask::leaves(builder.parquet_schema(), [leaf]);
    let (lo, hi) = (lo.to_owned(), hi.to_owned());
    let in_range = ArrowPredicateFn::new(key, move |batch: RecordBatch| {
        let uuids = batch.column(0);
        // A null uuid compares null, which the filter drops.
        and(&gt_eq(uuids, &StringArray::new_scalar(&lo))?, &lt_eq(uuids, &StringArray::new_scalar(&hi))?)
    });
    let mut out = Vec::new();
    for batch in builder.with_row_groups(groups).with_row_filter(RowFilter::new(vec![Box::new(in_range)])).build()? {
        let batch = batch?;
        if batch.num_rows() > 0 {
            out.push(batch);
        }
    }
    Ok(out)
}

/// Merges `plan.inputs` into one sorted file, written under a hidden temp name in the
/// partition directory (fsynced, not yet visible). On error nothing is left behind.
/// `stop` is asked before each step (one range of GPUs): a merge of a finished day at
/// 1,000 GPUs takes minutes, and shutdown must not wait for it
/// ([`PersistError::Stopped`]).
pub fn merge(
    storage: &Storage,
    plan: &Plan,
    options: &PersistOptions,
    max_rows_in_memory: usize,
    stop: &dyn Fn() -> bool,
) -> Result<StagedFile, PersistError> {
    let schema = storage_schema(plan.table);
    let dir = partition_dir(storage.data_dir(), plan.table, &plan.date);
    fsutil::create_dir_durable(&dir).map_err(io_err("create directory", &dir))?;
    // Inputs are read from disk a row group at a time, never held whole: a finished
    // day of 1,000 GPUs is gigabytes of Parquet. (Downloads are deleted on drop.)
    let inputs = plan.inputs.iter().map(|f| storage.local_copy(f, &dir)).collect::<Result<Vec<_>, _>>()?;
    for (f, copy) in plan.inputs.iter().zip(&inputs) {
        let file_schema = open_reader(copy.path())?.schema().clone();
        if file_schema.fields() != schema.fields() {
            return Err(PersistError::Arrow(arrow_schema::ArrowError::SchemaError(format!(
                "{} does not have the current storage schema; not compacted",
                f.path.display()
            ))));
        }
    }
    let id = uuid::Uuid::now_v7().to_string();
    let name = plan.output.file_name(&id);
    let tmp = dir.join(format!(".{name}.tmp"));
    let path = dir.join(name);
    let result = (|| {
        let counts = rows_per_gpu(&inputs)?;
        let file = fs::OpenOptions::new().write(true).create_new(true).open(&tmp).map_err(io_err("create", &tmp))?;
        let mut w = ArrowWriter::try_new(file, schema.clone(), Some(writer_properties(plan.table, options)?))?;
        let mut rows = 0;
        for (lo, hi) in gpu_ranges(&counts, max_rows_in_memory.max(1)) {
            if stop() {
                return Err(PersistError::Stopped);
            }
            let mut parts = Vec::new();
            for copy in &inputs {
                parts.extend(read_range(copy.path(), &lo, &hi)?);
            }
            // Sorted by (day, gpu_uuid, time): one day here, so (gpu_uuid, time). Only
            // the keys are sorted; rows are gathered a small chunk at a time.
            let order = SortedRows::of(plan.table, &parts)?;
            let sources = SortedRows::sources(&parts);
            for (_, positions) in order.days() {
                for group in SortedRows::gather(&sources, positions) {
                    let group = group?;
                    rows += group.num_rows();
                    w.write(&group)?;
                }
            }
        }
        let file = w.into_inner()?;
        file.sync_all().map_err(io_err("fsync", &tmp))?;
        let bytes = file.metadata().map_err(io_err("stat", &tmp))?.len();
        Ok(StagedFile {
            tmp: tmp.clone(),
            rows,
            file: PersistedFile { table: plan.table, date: plan.date.clone(), path: path.clone(), bytes },
        })
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

fn file_name(p: &Path) -> String {
    p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

/// The local directory of a partition (journals and temp files live there whatever
/// the storage).
pub fn partition_dir(data_dir: &Path, table: Table, date: &str) -> PathBuf {
    table_dir(data_dir, table).join(format!("date={date}"))
}

/// Commits a merge: writes the journal (the commit point), publishes the output. The
/// inputs stay, hidden from listings, until [`finish`].
pub fn commit(storage: &Storage, plan: &Plan, staged: &StagedFile) -> Result<Journal, PersistError> {
    let dir = partition_dir(storage.data_dir(), plan.table, &plan.date);
    let journal = Journal {
        inputs: plan.inputs.iter().map(|f| file_name(&f.path)).collect(),
        output_tmp: file_name(&staged.tmp),
        output: file_name(&staged.file.path),
    };
    let bytes = serde_json::to_vec_pretty(&journal).map_err(|e| PersistError::Io {
        op: "encode journal",
        path: dir.join(JOURNAL),
        source: io::Error::other(e),
    })?;
    let path = dir.join(JOURNAL);
    if let Err(e) = fsutil::write_atomic(&path, &bytes) {
        let _ = fs::remove_file(&staged.tmp);
        return Err(PersistError::Io { op: "write journal", path, source: e });
    }
    storage.publish(&[(dir.join(&journal.output_tmp), dir.join(&journal.output))])?;
    Ok(journal)
}

/// Deletes a committed compaction's inputs, then its journal (`partition` is the local
/// directory). Idempotent.
pub fn finish(storage: &Storage, partition: &Path) -> Result<usize, PersistError> {
    let path = partition.join(JOURNAL);
    let Some(j) = read_journal(partition)? else { return Ok(0) };
    storage.publish(&[(partition.join(&j.output_tmp), partition.join(&j.output))])?;
    for name in &j.inputs {
        storage.remove(partition, name)?;
    }
    fsutil::sync_dir(partition).map_err(io_err("sync directory", partition))?;
    fs::remove_file(&path).map_err(io_err("remove", &path))?;
    Ok(j.inputs.len())
}

/// The journal of a partition, if a compaction there is committed and not finished.
pub fn read_journal(partition: &Path) -> Result<Option<Journal>, PersistError> {
    let path = partition.join(JOURNAL);
    match fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| PersistError::Io {
            op: "parse journal",
            path,
            source: io::Error::new(io::ErrorKind::InvalidData, e),
        }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(PersistError::Io { op: "read", path, source: e }),
    }
}

/// Start-up: finishes every committed compaction of `table` (nothing reads yet, so the
/// inputs can go at once). Must run before temp files are removed: an output may still
/// have its temp name. Returns the number of partitions finished.
pub fn recover(storage: &Storage, table: Table) -> Result<usize, PersistError> {
    let mut n = 0;
    for (_, dir) in crate::persist::partitions(storage.data_dir(), table)? {
        if dir.join(JOURNAL).exists() {
            finish(storage, &dir)?;
            n += 1;
        }
    }
    Ok(n)
}

/// The dates among `dates` whose day ended `retention_us` or more before `now_us`.
pub fn expired<'a>(dates: impl IntoIterator<Item = &'a str>, now_us: i64, retention_us: i64) -> Vec<String> {
    let mut out: Vec<String> = dates
        .into_iter()
        .filter(|date| {
            fsutil::parse_day(date)
                .is_some_and(|day| (day + 1).saturating_mul(MICROS_PER_DAY).saturating_add(retention_us) <= now_us)
        })
        .map(str::to_owned)
        .collect();
    out.sort();
    out.dedup();
    out
}

#[cfg(test)]
mod tests;
