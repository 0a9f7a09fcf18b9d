//! Which days of which tables received rows since a reader last looked.
//!
//! Derived tables (the cost ledger above all) are recomputed from stored samples. To keep
//! that work proportional to new data rather than to the day or the history, a deriver
//! subscribes to a [`ChangeFeed`] and, before each pass, [`ChangeFeed::take`]s what was
//! written since the previous one: per (table, UTC day), the earliest and latest row
//! time. That is enough to bound what to recompute (the classifier's
//! `recompute_plan`), and it stays tiny whatever the ingest rate: one entry per clock
//! hour touched. Spans are kept per hour so that a late batch for 02:00 and live rows at
//! 14:00 mark two hours, not the twelve between them (the recommender's stored hours
//! read the feed by hour, the ledger by day: [`Changed::day`] is the union of its hours).
//!
//! Order matters for the reader: a batch is recorded *after* it is visible in the
//! memtable, so a reader that takes the changes and then reads the store sees every row
//! it was not told about, and at worst recomputes a row it already saw.
//!
//! Only rows that enter through ingest are recorded: persist and compaction move rows
//! without changing them, and a feed starts empty when it subscribes (the subscriber
//! treats what is stored at that moment as unseen). WAL replay happens at open, before
//! anyone can subscribe.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError, Weak};

use apron_common::wire::Table;
use arrow_array::RecordBatch;
use arrow_array::cast::AsArray;
use arrow_array::types::TimestampMicrosecondType;

const DAY_US: i64 = 86_400_000_000;
const HOUR_US: i64 = 3_600_000_000;

/// The earliest and latest row time written to one day, µs since the epoch (UTC).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TimeSpan {
    pub min_us: i64,
    pub max_us: i64,
}

impl TimeSpan {
    fn widen(&mut self, other: TimeSpan) {
        self.min_us = self.min_us.min(other.min_us);
        self.max_us = self.max_us.max(other.max_us);
    }
}

/// What was written: per table and clock hour (hours since the epoch), the span of row
/// times.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Changed {
    hours: BTreeMap<(Table, i64), TimeSpan>,
}

impl Changed {
    /// Adds the rows of `batches` (any schema with the table's time column).
    pub fn record(&mut self, table: Table, batches: &[RecordBatch]) {
        for b in batches {
            let Some(time) =
                b.column_by_name(table.time_column()).and_then(|c| c.as_primitive_opt::<TimestampMicrosecondType>())
            else {
                continue;
            };
            // Rows of a batch mostly share an hour: widen one span, touch the map per hour.
            let mut run: Option<(i64, TimeSpan)> = None;
            for t in time.iter().flatten() {
                let hour = t.div_euclid(HOUR_US);
                match &mut run {
                    Some((h, span)) if *h == hour => span.widen(TimeSpan { min_us: t, max_us: t }),
                    _ => {
                        if let Some((_, span)) = run.take() {
                            self.add(table, span);
                        }
                        run = Some((hour, TimeSpan { min_us: t, max_us: t }));
                    }
                }
            }
            if let Some((_, span)) = run {
                self.add(table, span);
            }
        }
    }

    fn add(&mut self, table: Table, span: TimeSpan) {
        self.hours.entry((table, span.min_us.div_euclid(HOUR_US))).and_modify(|s| s.widen(span)).or_insert(span);
    }

    /// Folds `other` in (a reader that could not use what it took puts it back).
    pub fn merge(&mut self, other: Changed) {
        for ((table, hour), span) in other.hours {
            self.hours.entry((table, hour)).and_modify(|s| s.widen(span)).or_insert(span);
        }
    }

    /// The span written to `table` on `day` (days since the epoch), if any.
    pub fn day(&self, table: Table, day: i64) -> Option<TimeSpan> {
        let per_day = DAY_US / HOUR_US;
        self.hours.range((table, day * per_day)..(table, (day + 1) * per_day)).map(|(_, s)| *s).reduce(|mut a, b| {
            a.widen(b);
            a
        })
    }

    /// Days of `table` that received rows, oldest first, with the span of each.
    pub fn days(&self, table: Table) -> impl Iterator<Item = (i64, TimeSpan)> + '_ {
        let mut days: Vec<(i64, TimeSpan)> = Vec::new();
        for (_, span) in self.hours(table) {
            let day = span.min_us.div_euclid(DAY_US);
            match days.last_mut() {
                Some((d, s)) if *d == day => s.widen(span),
                _ => days.push((day, span)),
            }
        }
        days.into_iter()
    }

    /// Clock hours of `table` that received rows (by their start, µs), oldest first; each
    /// span lies within its hour.
    pub fn hours(&self, table: Table) -> impl Iterator<Item = (i64, TimeSpan)> + '_ {
        self.hours.range((table, i64::MIN)..=(table, i64::MAX)).map(|((_, h), s)| (*h * HOUR_US, *s))
    }

    pub fn is_empty(&self) -> bool {
        self.hours.is_empty()
    }
}

/// One subscriber's accumulated changes; see the module docs.
#[derive(Debug)]
pub struct ChangeFeed {
    pending: Arc<Mutex<Changed>>,
}

impl ChangeFeed {
    /// Everything written since the last take (or since subscribing), leaving it empty.
    pub fn take(&self) -> Changed {
        std::mem::take(&mut *self.pending.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Returns changes a pass took but could not act on, so the next take has them.
    pub fn put_back(&self, changed: Changed) {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner).merge(changed);
    }
}

/// The store's list of subscribers. A dropped [`ChangeFeed`] unsubscribes itself.
#[derive(Debug, Default)]
pub(crate) struct Feeds {
    subscribers: Mutex<Vec<Weak<Mutex<Changed>>>>,
}

impl Feeds {
    pub(crate) fn subscribe(&self) -> ChangeFeed {
        let pending = Arc::new(Mutex::new(Changed::default()));
        self.subscribers.lock().unwrap_or_else(PoisonError::into_inner).push(Arc::downgrade(&pending));
        ChangeFeed { pending }
    }

    /// Whether anyone listens (so ingest can skip summarising a batch nobody reads).
    pub(crate) fn active(&self) -> bool {
        let mut subs = self.subscribers.lock().unwrap_or_else(PoisonError::into_inner);
        subs.retain(|w| w.strong_count() > 0);
        !subs.is_empty()
    }

    /// Hands `changed` to every subscriber; call it once the rows are visible to readers.
    pub(crate) fn publish(&self, changed: &Changed) {
        if changed.is_empty() {
            return;
        }
        let subs = self.subscribers.lock().unwrap_or_else(PoisonError::into_inner);
        for s in subs.iter().filter_map(Weak::upgrade) {
            s.lock().unwrap_or_else(PoisonError::into_inner).merge(changed.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::TimestampMicrosecondArray;
    use arrow_schema::{DataType, Field, Schema, TimeUnit};

    fn batch(times: &[i64]) -> RecordBatch {
        let schema = Schema::new(vec![Field::new("time", DataType::Timestamp(TimeUnit::Microsecond, None), false)]);
        RecordBatch::try_new(Arc::new(schema), vec![Arc::new(TimestampMicrosecondArray::from(times.to_vec()))])
            .expect("batch")
    }

    #[test]
    fn spans_per_day_and_table() {
        let feeds = Feeds::default();
        let feed = feeds.subscribe();
        let record = |table, b: RecordBatch| {
            let mut c = Changed::default();
            c.record(table, &[b]);
            feeds.publish(&c);
        };
        // Day 1: 10 s and 20 s in; day 2: 5 s in; the processes table apart.
        record(Table::GpuSamples, batch(&[DAY_US + 20_000_000, 2 * DAY_US + 5_000_000]));
        record(Table::GpuSamples, batch(&[DAY_US + 10_000_000]));
        record(Table::GpuProcesses, batch(&[DAY_US]));
        let c = feed.take();
        assert_eq!(
            c.day(Table::GpuSamples, 1),
            Some(TimeSpan { min_us: DAY_US + 10_000_000, max_us: DAY_US + 20_000_000 })
        );
        assert_eq!(
            c.day(Table::GpuSamples, 2),
            Some(TimeSpan { min_us: 2 * DAY_US + 5_000_000, max_us: 2 * DAY_US + 5_000_000 })
        );
        assert_eq!(c.day(Table::GpuProcesses, 1), Some(TimeSpan { min_us: DAY_US, max_us: DAY_US }));
        assert_eq!(c.days(Table::GpuSamples).count(), 2);
        assert!(feed.take().is_empty(), "a take empties the feed");
        // A late row at 02:00 and a live one at 14:00: two hours, one day.
        let h = HOUR_US;
        record(Table::GpuSamples, batch(&[DAY_US + 14 * h + 5, DAY_US + 2 * h + 7, DAY_US + 14 * h + 9]));
        let c = feed.take();
        let hours: Vec<(i64, TimeSpan)> = c.hours(Table::GpuSamples).collect();
        assert_eq!(
            hours,
            vec![
                (DAY_US + 2 * h, TimeSpan { min_us: DAY_US + 2 * h + 7, max_us: DAY_US + 2 * h + 7 }),
                (DAY_US + 14 * h, TimeSpan { min_us: DAY_US + 14 * h + 5, max_us: DAY_US + 14 * h + 9 }),
            ]
        );
        assert_eq!(
            c.day(Table::GpuSamples, 1),
            Some(TimeSpan { min_us: DAY_US + 2 * h + 7, max_us: DAY_US + 14 * h + 9 })
        );
        assert_eq!(c.days(Table::GpuSamples).collect::<Vec<_>>(), vec![(1, c.day(Table::GpuSamples, 1).expect("day"))]);
    }

    #[test]
    fn put_back_merges_and_subscribers_are_independent() {
        let feeds = Feeds::default();
        let record = |t: i64| {
            let mut c = Changed::default();
            c.record(Table::GpuSamples, &[batch(&[t])]);
            feeds.publish(&c);
        };
        let (a, b) = (feeds.subscribe(), feeds.subscribe());
        record(100);
        let taken = a.take();
        record(50);
        a.put_back(taken);
        assert_eq!(a.take().day(Table::GpuSamples, 0), Some(TimeSpan { min_us: 50, max_us: 100 }));
        assert_eq!(b.take().day(Table::GpuSamples, 0), Some(TimeSpan { min_us: 50, max_us: 100 }));
        drop(b);
        assert!(feeds.active());
        assert_eq!(feeds.subscribers.lock().map(|s| s.len()).unwrap_or(0), 1, "a dropped feed unsubscribes");
        drop(a);
        assert!(!feeds.active());
    }
}
