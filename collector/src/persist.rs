//! The Parquet persister: a frozen memtable becomes sorted, day-partitioned files.
//!
//! Layout: `<data>/<table>/date=YYYY-MM-DD/<uuid v7>.parquet` (Hive-style, so DuckDB,
//! pyarrow, Spark and Trino discover the partitions unchanged; v7 UUIDs sort by creation
//! time). A file is first written as `.<uuid>.parquet.tmp` in the same directory —
//! hidden from `*.parquet` globs and from pyarrow's discovery — fsynced, and only then
//! renamed ([`publish`]) and the directory fsynced, so a crash never leaves a half file
//! under a final name. The store decides *when* to publish (see `store.rs`).
//!
//! File format (see also [`crate::schema`] for the column types):
//! - rows sorted by (`gpu_uuid`, `time`), declared as `sorting_columns` in every row
//!   group so query engines can skip sorts;
//! - ZSTD (`[storage] zstd_level`); row groups of at most 100k rows; an offset index
//!   for every column; page-level statistics (the column index) for `time` and the
//!   identity columns, row-group statistics for measurements;
//! - `time` and integer-backed measurements (decimals, Int32/Int64): DELTA_BINARY_PACKED,
//!   dictionary off — sorted series make small deltas; or, with `[storage]
//!   reading_encoding = "byte_stream_split"`, BYTE_STREAM_SPLIT for the readings of
//!   activity and gauge fields, whose noisy deltas are as wide as their values (see
//!   [`column_encoding`]);
//! - identity columns (`host`, `gpu_uuid`, `gpu_model`, `cluster`, `gpu_index`, `pid`,
//!   process names, pods, …) and `window_s`: dictionary (RLE_DICTIONARY), which
//!   collapses to almost nothing once rows are grouped by GPU.

use std::fs::{self, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use apron_common::FieldKind;
use apron_common::wire::Table;
use arrow_array::cast::AsArray;
use arrow_array::types::{Int64Type, TimestampMicrosecondType};
use arrow_array::{ArrayRef, RecordBatch};
use arrow_ord::sort::{SortColumn, lexsort_to_indices};
use arrow_schema::{ArrowError, DataType};
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, Encoding, ZstdLevel};
use parquet::errors::ParquetError;
use parquet::file::metadata::{KeyValue, SortingColumn};
use parquet::file::properties::{EnabledStatistics, WriterProperties};
use parquet::schema::types::ColumnPath;

use crate::fsutil::{self, date_string, day_of_micros};
use crate::schema::{reading_field, storage_schema, widen};

/// Version of the on-disk layout, written into each file's key-value metadata.
pub const STORAGE_VERSION: &str = "1";

/// A row group is cut at this estimated encoded size, if not at `row_group_rows` first:
/// the writer holds the group being built, so its memory is bounded in bytes whatever a
/// table's width (`gpu_samples_1m` has ~250 columns). Measured on a rollup of 1,000 GPUs
/// (docs/benchmarks.md, 2026-12-06), it changed the peak by nothing measurable; it is a
/// bound, not a saving.
pub const ROW_GROUP_MAX_BYTES: usize = 32 << 20;

/// Integer-typed columns that identify rather than measure: dictionary, not delta.
const IDENTITY_INTEGERS: &[&str] = &["gpu_index", "pid"];

/// Tuning of the files written.
#[derive(Clone, Copy, Debug)]
pub struct PersistOptions {
    pub row_group_rows: usize,
    pub zstd_level: i32,
    pub reading_encoding: ReadingEncoding,
}

/// How readings of activity and gauge fields (`gpu_util`, `power_watts`, PCIe bytes/s,
/// …) are encoded in Parquet (`[storage] reading_encoding`); see [`column_encoding`].
/// Both store the same values and types; files of both kinds mix in one partition.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReadingEncoding {
    /// DELTA_BINARY_PACKED: read by every engine that reads Parquet v2 pages.
    #[default]
    Delta,
    /// BYTE_STREAM_SPLIT: about 16 % smaller files, but integer columns in it are read
    /// only by newer engines (DuckDB 2.0 and later — 1.5 refuses them —, Arrow C++ and
    /// pyarrow 16, Spark 4 / parquet-java 1.14, arrow-rs 53), so it is chosen, not the
    /// default: a lake that older readers open must keep `delta`.
    ByteStreamSplit,
}

impl PersistOptions {
    /// Level 3 → 9 makes the storage benchmark's files 2 % smaller, a persist 5–15 %
    /// slower and the server's peak RSS 22 MiB larger (docs/benchmarks.md, "Storage
    /// encodings"): while memory is the tighter limit, 3.
    pub const DEFAULT_ZSTD_LEVEL: i32 = 3;
}

impl Default for PersistOptions {
    fn default() -> Self {
        PersistOptions {
            row_group_rows: 100_000,
            zstd_level: Self::DEFAULT_ZSTD_LEVEL,
            reading_encoding: ReadingEncoding::Delta,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    #[error("persist: {op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("persist: parquet: {0}")]
    Parquet(#[from] ParquetError),
    #[error("persist: arrow: {0}")]
    Arrow(#[from] ArrowError),
    /// The rows given cannot be written as asked (out of order, outside the day) or their
    /// producer failed.
    #[error("persist: rows: {0}")]
    Rows(String),
    /// The store is shutting down: a merge stopped between two of its steps, leaving
    /// nothing behind (it is planned again after the restart).
    #[error("persist: stopped for shutdown")]
    Stopped,
}

impl PersistError {
    fn io(op: &'static str, path: &Path, source: io::Error) -> PersistError {
        PersistError::Io { op, path: path.to_path_buf(), source }
    }

    pub fn is_storage_full(&self) -> bool {
        match self {
            PersistError::Io { source, .. } => crate::wal::is_full(source),
            PersistError::Parquet(ParquetError::External(e)) => {
                e.downcast_ref::<io::Error>().is_some_and(crate::wal::is_full)
            }
            _ => false,
        }
    }
}

/// A published Parquet file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PersistedFile {
    pub table: Table,
    /// The partition, `YYYY-MM-DD` (UTC).
    pub date: String,
    pub path: PathBuf,
    pub bytes: u64,
}

/// A file written under its temporary name, not yet visible.
#[derive(Clone, Debug)]
pub struct StagedFile {
    pub tmp: PathBuf,
    pub file: PersistedFile,
    pub rows: usize,
}

/// `<data>/<table>`.
pub fn table_dir(data_dir: &Path, table: Table) -> PathBuf {
    data_dir.join(table.name())
}

/// The encoding of an integer-backed column, with no dictionary; `None` for columns
/// left to the writer's default (dictionary, which suits identity and strings).
///
/// - `time` and cumulative counters, codes and flags: DELTA_BINARY_PACKED. Sorted by
///   (GPU, time), their steps are small or zero, which delta bit-packing reduces to a
///   few bits (energy in mJ: 6× smaller than byte-stream-split).
/// - Readings of activity and gauge fields (`gpu_util`, `power_watts`,
///   `pcie_rx_bytes_per_s`, …, their `_max` and rollup extremes): as `readings` says.
///   With [`ReadingEncoding::ByteStreamSplit`]: a reading jumps by noise from one window
///   to the next, so a delta is as wide as the value and bit-packing saves little;
///   split into byte planes, the high bytes are nearly constant along a series and the
///   low bytes of coarse readings (PCIe in KiB/s, utilisation in whole percent)
///   repeat, and zstd finds both. Measured on the storage benchmark's dataset: 2–34 %
///   smaller per column, 0.447 → 0.378 bytes per value in all (docs/benchmarks.md,
///   "Storage encodings").
pub fn column_encoding(table: Table, name: &str, data_type: &DataType, readings: ReadingEncoding) -> Option<Encoding> {
    if matches!(data_type, DataType::Timestamp(..)) {
        return Some(Encoding::DELTA_BINARY_PACKED);
    }
    if IDENTITY_INTEGERS.contains(&name)
        || !matches!(data_type, DataType::Int32 | DataType::Int64 | DataType::Decimal128(..=18, _))
    {
        return None;
    }
    let reading =
        reading_field(table, name).is_some_and(|f| matches!(f.kind(), FieldKind::Activity | FieldKind::Gauge));
    Some(match (reading, readings) {
        (true, ReadingEncoding::ByteStreamSplit) => Encoding::BYTE_STREAM_SPLIT,
        _ => Encoding::DELTA_BINARY_PACKED,
    })
}

/// The writer properties for `table`.
pub fn writer_properties(table: Table, options: &PersistOptions) -> Result<WriterProperties, ParquetError> {
    let schema = storage_schema(table);
    let index = |name: &str| -> Result<i32, ParquetError> {
        let i = schema.index_of(name).map_err(|e| ParquetError::General(e.to_string()))?;
        i32::try_from(i).map_err(|e| ParquetError::General(e.to_string()))
    };
    let sorting = table
        .sort_order()
        .iter()
        .map(|c| Ok(SortingColumn { column_idx: index(c)?, descending: false, nulls_first: false }))
        .collect::<Result<Vec<_>, ParquetError>>()?;
    let mut b = WriterProperties::builder()
        .set_compression(Compression::ZSTD(ZstdLevel::try_new(options.zstd_level)?))
        .set_max_row_group_row_count(Some(options.row_group_rows.max(1)))
        .set_max_row_group_bytes(Some(ROW_GROUP_MAX_BYTES))
        .set_statistics_enabled(EnabledStatistics::Page)
        .set_sorting_columns(Some(sorting))
        .set_created_by(format!("apron-collector {}", env!("CARGO_PKG_VERSION")))
        .set_key_value_metadata(Some(vec![
            KeyValue::new("apron.table".to_owned(), table.name().to_owned()),
            KeyValue::new("apron.storage_version".to_owned(), STORAGE_VERSION.to_owned()),
        ]));
    for f in schema.fields() {
        if let Some(encoding) = column_encoding(table, f.name(), f.data_type(), options.reading_encoding) {
            let path = ColumnPath::from(f.name().as_str());
            b = b.set_column_dictionary_enabled(path.clone(), false).set_column_encoding(path.clone(), encoding);
            // Queries select by time and identity, which keep page statistics (the
            // column index) to skip pages; a measurement's min/max per page would rarely
            // skip one and costs bytes in every file, so it keeps row-group statistics.
            if f.name() != table.time_column() {
                b = b.set_column_statistics_enabled(path, EnabledStatistics::Chunk);
            }
        }
    }
    Ok(b.build())
}

/// Writes `batches` of `table` as one temp file per UTC day, rows sorted by
/// (`gpu_uuid`, time). Nothing is visible until [`publish`]; on error, the temp files
/// written so far are removed.
///
/// Memory: only the sort keys are copied whole; rows are gathered from `batches`
/// [`GATHER_ROWS`] at a time, so a persist adds one such chunk and the writer's encoded
/// row group to what the memtable already holds (not two copies of it, as a
/// concat-then-sort would).
pub fn stage_table(
    data_dir: &Path,
    table: Table,
    batches: &[RecordBatch],
    options: &PersistOptions,
) -> Result<Vec<StagedFile>, PersistError> {
    let mut staged: Vec<StagedFile> = Vec::new();
    let result = (|| {
        let order = SortedRows::of(table, batches)?;
        let sources = SortedRows::sources(batches);
        for (day, rows) in order.days() {
            let parts = SortedRows::gather(&sources, rows).map(|p| p.map_err(Into::into));
            staged.push(stage_rows(data_dir, table, &date_string(day), parts, options)?);
        }
        Ok(())
    })();
    if let Err(e) = result {
        for s in &staged {
            let _ = fs::remove_file(&s.tmp);
        }
        return Err(e);
    }
    Ok(staged)
}

/// Rows copied at a time when a persist or merge gathers rows into sorted order.
pub(crate) const GATHER_ROWS: usize = 8_192;

/// The persist order of a set of batches: (batch, row) positions sorted by (UTC day,
/// `gpu_uuid`, time). Positions count only the non-empty batches, in order.
pub(crate) struct SortedRows {
    positions: Vec<(usize, usize)>,
    days: Vec<i64>,
}

impl SortedRows {
    pub(crate) fn of(table: Table, batches: &[RecordBatch]) -> Result<SortedRows, PersistError> {
        let batches = SortedRows::sources(batches);
        let mut origin = Vec::new();
        for (i, b) in batches.iter().enumerate() {
            origin.extend((0..b.num_rows()).map(|r| (i, r)));
        }
        if origin.is_empty() {
            return Ok(SortedRows { positions: Vec::new(), days: Vec::new() });
        }
        let column = |name: &str| -> Result<ArrayRef, PersistError> {
            let parts = batches
                .iter()
                .map(|b| {
                    b.column_by_name(name)
                        .map(|c| c.as_ref())
                        .ok_or_else(|| ArrowError::SchemaError(format!("no column \"{name}\"")))
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok(arrow_select::concat::concat(&parts)?)
        };
        let time = column(table.time_column())?;
        let time_values = time
            .as_primitive_opt::<TimestampMicrosecondType>()
            .ok_or_else(|| ArrowError::SchemaError(format!("no Timestamp(µs) column \"{}\"", table.time_column())))?;
        let day_values = time_values.unary::<_, Int64Type>(day_of_micros);
        let keys = [Arc::new(day_values.clone()) as ArrayRef, column("gpu_uuid")?, time];
        let sorted = lexsort_to_indices(&keys.map(|values| SortColumn { values, options: None }), None)?;
        let positions = sorted.values().iter().map(|&i| origin[i as usize]).collect();
        let days = sorted.values().iter().map(|&i| day_values.value(i as usize)).collect();
        Ok(SortedRows { positions, days })
    }

    /// The batches positions point into: the non-empty ones, in order.
    pub(crate) fn sources(batches: &[RecordBatch]) -> Vec<&RecordBatch> {
        batches.iter().filter(|b| b.num_rows() > 0).collect()
    }

    /// The rows at `positions` of `sources`, gathered [`GATHER_ROWS`] at a time: the only
    /// copy of the data a sorted write makes is one such chunk. The Parquet writer still
    /// cuts row groups of `row_group_rows`; it holds the group being built encoded and
    /// compressed, a small fraction of its Arrow size (a 100,000-row group of
    /// `gpu_samples` is ~80 MB as Arrow).
    pub(crate) fn gather<'a>(
        sources: &'a [&'a RecordBatch],
        positions: &'a [(usize, usize)],
    ) -> impl Iterator<Item = Result<RecordBatch, ArrowError>> + 'a {
        positions.chunks(GATHER_ROWS).map(|chunk| arrow_select::interleave::interleave_record_batch(sources, chunk))
    }

    /// Each day (days since the epoch) and its positions, in order.
    pub(crate) fn days(&self) -> impl Iterator<Item = (i64, &[(usize, usize)])> {
        self.days.chunk_by(|a, b| a == b).scan(0, |start, run| {
            let from = *start;
            *start += run.len();
            Some((run[0], &self.positions[from..*start]))
        })
    }
}

/// Writes `batches` of `table` as one sorted temp file in the `date=` partition of
/// `day` (`date` is its name; no rows is an empty file), gathering a row group at a time
/// like [`stage_table`]. `Ok(None)` when a row lies outside the day.
pub fn stage_day(
    data_dir: &Path,
    table: Table,
    date: &str,
    day: i64,
    batches: &[RecordBatch],
    options: &PersistOptions,
) -> Result<Option<StagedFile>, PersistError> {
    let order = SortedRows::of(table, batches)?;
    if order.days.iter().any(|&d| d != day) {
        return Ok(None);
    }
    let sources = SortedRows::sources(batches);
    let parts = SortedRows::gather(&sources, &order.positions).map(|p| p.map_err(Into::into));
    stage_rows(data_dir, table, date, parts, options).map(Some)
}

/// Writes `parts` — storage-schema rows already in persist order (`gpu_uuid`, time),
/// handed over one batch at a time — as one temp file in the `date=` partition of `day`.
/// Memory is one part plus the writer's row group, whatever the partition's size. A part
/// out of order or outside the day, or a producer's error, fails the write and the temp
/// file is removed.
pub fn stage_sorted(
    data_dir: &Path,
    table: Table,
    date: &str,
    day: i64,
    parts: impl Iterator<Item = Result<RecordBatch, PersistError>>,
    options: &PersistOptions,
) -> Result<StagedFile, PersistError> {
    let mut last: Option<(String, i64)> = None;
    let checked = parts.map(move |part| {
        let part = part?;
        last = in_order(table, day, &part, last.take())?;
        Ok(part)
    });
    stage_rows(data_dir, table, date, checked, options)
}

/// Checks that `part`'s rows are in day `day` and follow `last` in (`gpu_uuid`, time)
/// order; returns the part's last key.
fn in_order(
    table: Table,
    day: i64,
    part: &RecordBatch,
    last: Option<(String, i64)>,
) -> Result<Option<(String, i64)>, PersistError> {
    let n = part.num_rows();
    if n == 0 {
        return Ok(last);
    }
    let column =
        |name: &str| part.column_by_name(name).ok_or_else(|| PersistError::Rows(format!("no column \"{name}\"")));
    let uuid = column("gpu_uuid")?
        .as_string_opt::<i32>()
        .ok_or_else(|| PersistError::Rows("gpu_uuid is not a string column".into()))?;
    let time = column(table.time_column())?
        .as_primitive_opt::<TimestampMicrosecondType>()
        .ok_or_else(|| PersistError::Rows(format!("{} is not a Timestamp(µs) column", table.time_column())))?;
    let mut prev: Option<(&str, i64)> = last.as_ref().map(|(u, t)| (u.as_str(), *t));
    for r in 0..n {
        let key = (uuid.value(r), time.value(r));
        if day_of_micros(key.1) != day {
            return Err(PersistError::Rows(format!("{} at {} µs lies outside the partition's day", key.0, key.1)));
        }
        if let Some(p) = prev
            && p > key
        {
            return Err(PersistError::Rows(format!(
                "{} at {} µs comes after {} at {} µs: not in (gpu_uuid, time) order",
                key.0, key.1, p.0, p.1
            )));
        }
        prev = Some(key);
    }
    Ok(prev.map(|(u, t)| (u.to_owned(), t)))
}

/// Writes `parts` (sorted, all in `date`, produced one at a time) as one temp file in
/// the partition; the temp file is removed on error.
fn stage_rows(
    data_dir: &Path,
    table: Table,
    date: &str,
    parts: impl Iterator<Item = Result<RecordBatch, PersistError>>,
    options: &PersistOptions,
) -> Result<StagedFile, PersistError> {
    let props = writer_properties(table, options)?;
    let dir = table_dir(data_dir, table).join(format!("date={date}"));
    fsutil::create_dir_durable(&dir).map_err(|e| PersistError::io("create directory", &dir, e))?;
    let id = uuid::Uuid::now_v7();
    let tmp = dir.join(format!(".{id}.parquet.tmp"));
    let path = dir.join(format!("{id}.parquet"));
    let schema = storage_schema(table);
    let result = (|| {
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(|e| PersistError::io("create", &tmp, e))?;
        let mut w = ArrowWriter::try_new(file, schema.clone(), Some(props))?;
        let mut rows = 0;
        for part in parts {
            // Memtable rows arrive in the memory schema; one chunk is widened at a time.
            let part = widen(&part?, &schema)?;
            rows += part.num_rows();
            w.write(&part)?;
        }
        let file = w.into_inner()?;
        file.sync_all().map_err(|e| PersistError::io("fsync", &tmp, e))?;
        Ok((rows, file.metadata().map_err(|e| PersistError::io("stat", &tmp, e))?.len()))
    })();
    match result {
        Ok((rows, bytes)) => {
            Ok(StagedFile { tmp, rows, file: PersistedFile { table, date: date.to_owned(), path, bytes } })
        }
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// Renames temp files to their final names and fsyncs their directories. Idempotent:
/// a pair whose temp file is gone was done before a crash.
pub fn publish(renames: &[(PathBuf, PathBuf)]) -> Result<(), PersistError> {
    let mut dirs = Vec::new();
    for (tmp, path) in renames {
        match fs::rename(tmp, path) {
            Ok(()) => {}
            // Done before a crash — or the file was since compacted away; either way
            // there is nothing left to publish.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                if !path.exists() {
                    tracing::warn!(path = %path.display(), "a file to publish is gone");
                }
            }
            Err(e) => return Err(PersistError::io("rename", tmp, e)),
        }
        if let Some(dir) = path.parent()
            && !dirs.contains(&dir)
        {
            dirs.push(dir);
        }
    }
    for dir in dirs {
        fsutil::sync_dir(dir).map_err(|e| PersistError::io("sync directory", dir, e))?;
    }
    Ok(())
}

/// The published files of `table`, in path order (partition, then creation time).
/// Inputs of a committed compaction are left out: their rows are in its output.
pub fn list_files(data_dir: &Path, table: Table) -> Result<Vec<PersistedFile>, PersistError> {
    let mut out = Vec::new();
    for (date, dir) in partitions(data_dir, table)? {
        let superseded = crate::compact::read_journal(&dir)?.map(|j| j.inputs).unwrap_or_default();
        for entry in fs::read_dir(&dir).map_err(|e| PersistError::io("list", &dir, e))? {
            let entry = entry.map_err(|e| PersistError::io("list", &dir, e))?;
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with('.') || !name.ends_with(".parquet") || superseded.iter().any(|s| *s == name) {
                continue;
            }
            let bytes = entry.metadata().map_err(|e| PersistError::io("stat", &entry.path(), e))?.len();
            out.push(PersistedFile { table, date: date.clone(), path: entry.path(), bytes });
        }
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}

/// Removes temp files a crashed persist left behind (never published, so never
/// counted: their rows are still in the WAL). Returns how many.
pub fn remove_temp_files(data_dir: &Path, table: Table) -> Result<usize, PersistError> {
    let mut removed = 0;
    for (_, dir) in partitions(data_dir, table)? {
        for entry in fs::read_dir(&dir).map_err(|e| PersistError::io("list", &dir, e))? {
            let entry = entry.map_err(|e| PersistError::io("list", &dir, e))?;
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with('.') && name.ends_with(".parquet.tmp") {
                fs::remove_file(entry.path()).map_err(|e| PersistError::io("remove", &entry.path(), e))?;
                removed += 1;
            }
        }
    }
    Ok(removed)
}

/// `(date, dir)` of each `date=YYYY-MM-DD` partition of `table`.
pub(crate) fn partitions(data_dir: &Path, table: Table) -> Result<Vec<(String, PathBuf)>, PersistError> {
    let root = table_dir(data_dir, table);
    let entries = match fs::read_dir(&root) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(PersistError::io("list", &root, e)),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| PersistError::io("list", &root, e))?;
        let name = entry.file_name();
        if let Some(date) = name.to_str().and_then(|n| n.strip_prefix("date="))
            && entry.path().is_dir()
        {
            out.push((date.to_owned(), entry.path()));
        }
    }
    out.sort();
    Ok(out)
}

#[cfg(test)]
mod tests;
