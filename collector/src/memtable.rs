//! The in-memory table: per table, the batches stored since the last persist.
//!
//! Batches are immutable Arrow `RecordBatch`es in the storage schema
//! ([`crate::schema`]), so a snapshot is a vector of `Arc` clones and is queryable
//! at once. The memtable never sorts or merges; the persister does that once, off the
//! ingest path.

use std::collections::HashMap;

use apron_common::wire::Table;
use arrow_array::RecordBatch;
use arrow_array::cast::AsArray;
use arrow_array::types::TimestampMicrosecondType;

/// Row, byte and time-range counts of one table's buffer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TableStats {
    pub batches: usize,
    pub rows: usize,
    /// Arrow memory held (buffers may be shared between batches, so this over-counts).
    pub bytes: usize,
    /// Smallest and largest `time`, µs since the epoch (UTC).
    pub min_time: Option<i64>,
    pub max_time: Option<i64>,
}

#[derive(Clone, Debug, Default)]
struct TableBuffer {
    batches: Vec<RecordBatch>,
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
            s.batches += 1;
            s.rows += batch.num_rows();
            s.bytes += batch.get_array_memory_size();
            if let Some((lo, hi)) = time_range(&batch, table.time_column()) {
                s.min_time = Some(s.min_time.map_or(lo, |m| m.min(lo)));
                s.max_time = Some(s.max_time.map_or(hi, |m| m.max(hi)));
            }
            buf.batches.push(batch);
        }
    }

    /// The batches of `table` (cheap: `Arc` clones of the column buffers).
    pub fn snapshot(&self, table: Table) -> Vec<RecordBatch> {
        self.tables.get(&table).map(|b| b.batches.clone()).unwrap_or_default()
    }

    pub fn stats(&self, table: Table) -> TableStats {
        self.tables.get(&table).map(|b| b.stats).unwrap_or_default()
    }

    /// Arrow bytes across all tables (the persist-by-size trigger).
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
}
