//! The in-memory table: per table, the batches stored since the last persist.
//!
//! Batches are immutable Arrow `RecordBatch`es in the storage schema
//! ([`crate::schema`]), so a snapshot is a vector of `Arc` clones and is queryable
//! at once. The memtable never sorts; the persister does that once, off the ingest
//! path.
//!
//! Two things keep its byte count honest, because ingest back-pressure
//! (`[storage] memtable_max_bytes`) and the persist trigger act on it:
//! - bytes are counted per distinct allocation, not per column: a column the IPC
//!   reader did not have to decompress is a slice of the whole message buffer, and
//!   `RecordBatch::get_array_memory_size` counts that buffer once per column (15–25×
//!   too much for the small batches agents send);
//! - small batches are coalesced: once the batches below [`COALESCE_ROWS`] at the tail
//!   add up to that many rows, they are copied into one right-sized batch, so a
//!   thousand 8-row requests do not pin a thousand message buffers.

use std::collections::{HashMap, HashSet};

use apron_common::wire::Table;
use arrow_array::cast::AsArray;
use arrow_array::types::TimestampMicrosecondType;
use arrow_array::{Array, RecordBatch};
use arrow_data::ArrayData;

/// Batches with fewer rows wait at the tail of their table until together they have
/// this many, then become one batch.
pub const COALESCE_ROWS: usize = 8192;

/// Row, byte and time-range counts of one table's buffer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TableStats {
    pub batches: usize,
    pub rows: usize,
    /// Bytes of the distinct Arrow allocations the batches hold.
    pub bytes: usize,
    /// Smallest and largest `time`, µs since the epoch (UTC).
    pub min_time: Option<i64>,
    pub max_time: Option<i64>,
}

#[derive(Clone, Debug, Default)]
struct TableBuffer {
    /// Oldest first; the last `small` of them have fewer than [`COALESCE_ROWS`] rows.
    batches: Vec<RecordBatch>,
    /// Bytes of each batch in `batches` (same order).
    sizes: Vec<usize>,
    /// How many batches at the tail have fewer than [`COALESCE_ROWS`] rows, their
    /// rows, and how many of those were never coalesced.
    small: usize,
    small_rows: usize,
    fresh: usize,
    stats: TableStats,
}

/// Batches per table.
#[derive(Clone, Debug, Default)]
pub struct Memtable {
    tables: HashMap<Table, TableBuffer>,
}

impl Memtable {
    pub fn new() -> Memtable {
        Memtable::default()
    }

    /// Adds batches (in the storage schema) to `table`.
    pub fn insert(&mut self, table: Table, batches: Vec<RecordBatch>) {
        let buf = self.tables.entry(table).or_default();
        for batch in batches {
            if batch.num_rows() == 0 {
                continue;
            }
            let s = &mut buf.stats;
            s.rows += batch.num_rows();
            if let Some((lo, hi)) = time_range(&batch, table.time_column()) {
                s.min_time = Some(s.min_time.map_or(lo, |m| m.min(lo)));
                s.max_time = Some(s.max_time.map_or(hi, |m| m.max(hi)));
            }
            buf.push(batch);
        }
    }

    /// The batches of `table` (cheap: `Arc` clones of the column buffers).
    pub fn snapshot(&self, table: Table) -> Vec<RecordBatch> {
        self.tables.get(&table).map(|b| b.batches.clone()).unwrap_or_default()
    }

    pub fn stats(&self, table: Table) -> TableStats {
        self.tables.get(&table).map(|b| b.stats).unwrap_or_default()
    }

    /// Arrow bytes across all tables (the persist trigger and the back-pressure budget).
    pub fn bytes(&self) -> usize {
        self.tables.values().map(|b| b.stats.bytes).sum()
    }

    pub fn rows(&self) -> usize {
        self.tables.values().map(|b| b.stats.rows).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.rows() == 0
    }

    /// The tables that hold rows.
    pub fn tables(&self) -> Vec<Table> {
        let mut t: Vec<Table> = self.tables.iter().filter(|(_, b)| b.stats.rows > 0).map(|(t, _)| *t).collect();
        t.sort_by_key(|t| t.name());
        t
    }
}

/// Fresh (never coalesced) small batches at the tail that are merged into one even
/// before they reach [`COALESCE_ROWS`] together, so the batch count stays small too.
const COALESCE_BATCHES: usize = 64;

impl TableBuffer {
    fn push(&mut self, batch: RecordBatch) {
        let rows = batch.num_rows();
        if rows >= COALESCE_ROWS {
            self.close_tail();
            self.append(batch);
            return;
        }
        self.append(batch);
        self.small += 1;
        self.fresh += 1;
        self.small_rows += rows;
        if self.small_rows >= COALESCE_ROWS {
            self.close_tail();
        } else if self.fresh >= COALESCE_BATCHES {
            // The merged batch stays small: it is one of the tail's small batches, but
            // no longer fresh, so each row is copied about twice in all.
            if self.coalesce(self.fresh) {
                self.small -= self.fresh - 1;
            }
            self.fresh = 0;
        }
    }

    /// Merges the small tail into one batch and starts a new tail.
    fn close_tail(&mut self) {
        self.coalesce(self.small);
        self.small = 0;
        self.small_rows = 0;
        self.fresh = 0;
    }

    fn append(&mut self, batch: RecordBatch) {
        let size = allocated_bytes(&batch);
        self.stats.bytes += size;
        self.stats.batches += 1;
        self.sizes.push(size);
        self.batches.push(batch);
    }

    /// Replaces the last `n` batches by one right-sized copy. False when nothing was
    /// merged (fewer than two, or the copy failed — then they simply stay apart).
    fn coalesce(&mut self, n: usize) -> bool {
        if n < 2 || n > self.batches.len() {
            return false;
        }
        let from = self.batches.len() - n;
        let schema = self.batches[from].schema();
        let merged = match arrow_select::concat::concat_batches(&schema, &self.batches[from..]) {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(error = %e, "memtable: could not coalesce small batches; they stay apart");
                return false;
            }
        };
        let freed: usize = self.sizes.drain(from..).sum();
        self.batches.truncate(from);
        self.stats.bytes -= freed;
        self.stats.batches -= n;
        self.append(merged);
        true
    }
}

/// Bytes of the distinct allocations behind `batch`: each buffer's whole capacity,
/// once, however many columns slice it.
pub fn allocated_bytes(batch: &RecordBatch) -> usize {
    let mut seen = HashSet::new();
    let mut total = 0;
    for column in batch.columns() {
        total += data_bytes(&column.to_data(), &mut seen);
    }
    total
}

fn data_bytes(data: &ArrayData, seen: &mut HashSet<usize>) -> usize {
    let mut total = 0;
    let nulls = data.nulls().map(|n| n.buffer());
    for b in data.buffers().iter().chain(nulls) {
        if seen.insert(b.data_ptr().as_ptr() as usize) {
            total += b.capacity();
        }
    }
    for child in data.child_data() {
        total += data_bytes(child, seen);
    }
    total
}

/// Min and max of the table's time column, ignoring nulls.
fn time_range(batch: &RecordBatch, column: &str) -> Option<(i64, i64)> {
    let time = batch.column_by_name(column)?.as_primitive_opt::<TimestampMicrosecondType>()?;
    let mut range: Option<(i64, i64)> = None;
    for t in time.iter().flatten() {
        range = Some(range.map_or((t, t), |(lo, hi)| (lo.min(t), hi.max(t))));
    }
    range
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::{Int64Array, TimestampMicrosecondArray};
    use arrow_schema::{DataType, Field, Schema, TimeUnit};

    use super::*;

    fn batch(times: &[i64]) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("time", DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())), false),
            Field::new("v", DataType::Int64, true),
        ]));
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(TimestampMicrosecondArray::from(times.to_vec()).with_timezone("UTC")),
                Arc::new(Int64Array::from(times.to_vec())),
            ],
        )
        .expect("batch")
    }

    fn all_times(m: &Memtable, t: Table) -> Vec<i64> {
        m.snapshot(t)
            .iter()
            .flat_map(|b| b.column(0).as_primitive::<TimestampMicrosecondType>().values().to_vec())
            .collect()
    }

    #[test]
    fn counts_rows_bytes_and_time_range() {
        let mut m = Memtable::new();
        assert!(m.is_empty());
        m.insert(Table::GpuSamples, vec![batch(&[5, 3, 9]), batch(&[]), batch(&[1])]);
        m.insert(Table::GpuProcesses, vec![batch(&[100])]);
        let s = m.stats(Table::GpuSamples);
        assert_eq!((s.batches, s.rows, s.min_time, s.max_time), (2, 4, Some(1), Some(9)));
        assert!(s.bytes > 0 && m.bytes() > s.bytes);
        assert_eq!(m.snapshot(Table::GpuSamples).len(), 2);
        assert_eq!(m.tables(), vec![Table::GpuProcesses, Table::GpuSamples]);
        assert_eq!(m.rows(), 5);
    }

    #[test]
    fn a_buffer_shared_by_columns_counts_once() {
        // Both columns slice one allocation, as the IPC reader's columns slice the
        // message buffer: counted once, not once per column.
        let values: Vec<i64> = (0..1000).collect();
        let whole = Int64Array::from(values);
        let schema = Arc::new(Schema::new(vec![
            Field::new("a", DataType::Int64, false),
            Field::new("b", DataType::Int64, false),
        ]));
        let b = RecordBatch::try_new(schema, vec![Arc::new(whole.slice(0, 10)), Arc::new(whole.slice(10, 10))])
            .expect("batch");
        assert_eq!(allocated_bytes(&b), whole.values().inner().capacity());
        assert!(b.get_array_memory_size() >= 2 * allocated_bytes(&b));
    }

    #[test]
    fn small_batches_coalesce_in_order_and_the_count_follows() {
        let mut m = Memtable::new();
        let mut expect: Vec<i64> = Vec::new();
        let mut t = 0;
        // 8-row batches, as agents send: merged every 64, then into one at 8192 rows.
        for _ in 0..(COALESCE_ROWS / 8 + 70) {
            let times: Vec<i64> = (t..t + 8).collect();
            t += 8;
            expect.extend(&times);
            m.insert(Table::GpuSamples, vec![batch(&times)]);
        }
        let s = m.stats(Table::GpuSamples);
        assert_eq!(s.rows, expect.len());
        assert_eq!(all_times(&m, Table::GpuSamples), expect, "order and rows kept");
        // One full batch, one merged run of 64, and the 6 fresh ones since.
        assert_eq!(s.batches, 1 + 1 + 6, "{s:?}");
        assert_eq!(s.batches, m.snapshot(Table::GpuSamples).len());
        let counted: usize = m.snapshot(Table::GpuSamples).iter().map(allocated_bytes).sum();
        assert_eq!(s.bytes, counted, "the running count equals a recount");
        // A large batch closes the small tail first, so order is kept.
        let big: Vec<i64> = (t..t + COALESCE_ROWS as i64).collect();
        expect.extend(&big);
        m.insert(Table::GpuSamples, vec![batch(&big)]);
        assert_eq!(all_times(&m, Table::GpuSamples), expect);
        assert_eq!(m.stats(Table::GpuSamples).batches, 3);
    }
}
