//! Maintenance: deleting superseded files after their grace, retention, compaction —
//! and the background thread that runs them every `maintenance_interval`.
//!
//! Order matters: superseded files first (a partition with a pending journal is never
//! merged again, since a second journal would lose the first's list), then retention
//! (no point merging a partition about to go), then compaction, oldest partition first.

use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use apron_common::wire::Table;
use arrow_array::RecordBatch;

use super::{Inner, TABLES, lock, now_us};
use crate::compact::{self, JOURNAL, Plan, Policy};
use crate::error::StoreError;
use crate::persist::{self, PersistError, PersistOptions, PersistedFile, StagedFile};
use crate::schema::to_storage;

/// A partition merged into one file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Compacted {
    pub table: Table,
    pub date: String,
    /// The merged file's level: a tier, or the finished day's one file.
    pub level: compact::Level,
    pub inputs: usize,
    pub rows: usize,
    pub bytes_before: u64,
    pub bytes_after: u64,
}

/// What one maintenance pass did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MaintenanceReport {
    pub compacted: Vec<Compacted>,
    /// `(table, date)` of partitions deleted by retention.
    pub expired: Vec<(Table, String)>,
    /// Superseded input files deleted after their grace.
    pub superseded_removed: usize,
    /// Failures; each leaves its partition as it was, to be tried at the next pass.
    pub errors: Vec<String>,
}

/// A committed compaction whose inputs are kept until `due`.
pub(super) struct Pending {
    due: Instant,
    partition: PathBuf,
}

impl Inner {
    pub(super) fn maintain(&self, now_us: i64, now: Instant) -> MaintenanceReport {
        let _one_at_a_time = lock(&self.maintain_lock);
        let mut report = MaintenanceReport::default();
        self.finish_superseded(now, &mut report);
        self.expire(now_us, &mut report);
        self.compact(now_us, now, &mut report);
        report
    }

    fn finish_superseded(&self, now: Instant, report: &mut MaintenanceReport) {
        let due: Vec<Pending> = {
            let mut pending = lock(&self.pending);
            let (due, keep) = std::mem::take(&mut *pending).into_iter().partition(|p| p.due <= now);
            *pending = keep;
            due
        };
        for p in due {
            let _commit = lock(&self.commit_lock);
            match compact::finish(&self.storage, &p.partition) {
                Ok(n) => report.superseded_removed += n,
                Err(e) => {
                    report.errors.push(e.to_string());
                    lock(&self.pending).push(p);
                }
            }
        }
    }

    fn expire(&self, now_us: i64, report: &mut MaintenanceReport) {
        let data = &self.config.data_dir;
        for table in TABLES {
            let retention = if table.shipped() { self.config.retention_raw } else { self.config.retention_derived };
            let retention = i64::try_from(retention.as_micros()).unwrap_or(i64::MAX);
            // Published files' partitions and local ones (journals, temp files).
            let mut dates: Vec<String> =
                lock(&self.state).files.get(&table).into_iter().flatten().map(|f| f.date.clone()).collect();
            match crate::persist::partitions(data, table) {
                Ok(local) => dates.extend(local.into_iter().map(|(d, _)| d)),
                Err(e) => report.errors.push(e.to_string()),
            }
            for date in compact::expired(dates.iter().map(String::as_str), now_us, retention) {
                // Out of every listing first, then off the disk.
                let _commit = lock(&self.commit_lock);
                lock(&self.state).files.entry(table).or_default().retain(|f| f.date != date);
                let dir = compact::partition_dir(data, table, &date);
                lock(&self.pending).retain(|p| p.partition != dir);
                match self.storage.drop_partition(table, &date) {
                    Ok(()) => report.expired.push((table, date)),
                    Err(e) => report.errors.push(e.to_string()),
                }
            }
        }
    }

    /// Rows one step of a merge may decode: the smaller of the two budgets.
    fn merge_rows(&self, table: Table) -> usize {
        compact::rows_within(table, self.config.compaction_memory_bytes).min(self.config.compaction_memory_rows)
    }

    fn compact(&self, now_us: i64, now: Instant, report: &mut MaintenanceReport) {
        let policy = Policy {
            delay_us: i64::try_from(self.config.compaction_delay.as_micros()).unwrap_or(i64::MAX),
            max_files: self.config.compaction_max_files.max(1),
        };
        let options = self.persist_options();
        let stopping = || lock(&self.signal).shutdown;
        for table in TABLES {
            let files = lock(&self.state).files.get(&table).cloned().unwrap_or_default();
            for plan in compact::plan(&files, now_us, policy) {
                if stopping() {
                    return;
                }
                let partition = compact::partition_dir(&self.config.data_dir, table, &plan.date);
                if partition.join(JOURNAL).exists() {
                    continue; // the last merge's inputs are still in their grace
                }
                let started = Instant::now();
                // The merge runs without the commit lock; its commit takes it, and checks
                // that no replacement of the partition's files came in between.
                let result = compact::merge(&self.storage, &plan, &options, self.merge_rows(plan.table), &stopping)
                    .and_then(|staged| {
                        let _commit = lock(&self.commit_lock);
                        if partition.join(JOURNAL).exists() || !self.listed(&plan) {
                            let _ = std::fs::remove_file(&staged.tmp);
                            return Ok(None);
                        }
                        let output = self.commit_and_swap(&plan, &staged, partition, now)?;
                        Ok(Some((staged, output)))
                    });
                let (staged, output) = match result {
                    Ok(Some(done)) => done,
                    Ok(None) => {
                        tracing::info!(
                            table = table.name(),
                            date = %plan.date,
                            "a compaction's inputs were replaced while it merged; dropped"
                        );
                        continue;
                    }
                    Err(PersistError::Stopped) => {
                        tracing::info!(table = table.name(), date = %plan.date, "compaction stopped for shutdown");
                        return;
                    }
                    Err(e) => {
                        report.errors.push(format!("compacting {} {}: {e}", table.name(), plan.date));
                        continue;
                    }
                };
                let c = Compacted {
                    table,
                    date: plan.date.clone(),
                    level: plan.output,
                    inputs: plan.inputs.len(),
                    rows: staged.rows,
                    bytes_before: plan.inputs.iter().map(|f| f.bytes).sum(),
                    bytes_after: output.bytes,
                };
                tracing::info!(
                    table = table.name(),
                    date = %c.date,
                    level = %c.level,
                    inputs = c.inputs,
                    rows = c.rows,
                    bytes_before = c.bytes_before,
                    bytes_after = c.bytes_after,
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "compacted a partition"
                );
                report.compacted.push(c);
            }
        }
        if self.config.superseded_grace.is_zero() {
            self.finish_superseded(now, report);
        }
    }
}

impl Inner {
    pub(super) fn replace_partition(
        &self,
        table: Table,
        date: &str,
        batches: &[RecordBatch],
    ) -> Result<PersistedFile, StoreError> {
        let (day, bad) = Self::derived_day(table, date)?;
        let storage = batches
            .iter()
            .map(|b| to_storage(table, b))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| bad(e.to_string()))?;
        let staged = persist::stage_day(&self.config.data_dir, table, date, day, &storage, &self.persist_options())?
            .ok_or_else(|| bad(format!("rows outside the day in column {}", table.time_column())))?;
        self.commit_replacement(table, date, staged)
    }

    /// [`Inner::replace_partition`] from rows already in persist order, written as they
    /// come: the partition is never whole in memory.
    pub(super) fn replace_partition_sorted<E: std::fmt::Display>(
        &self,
        table: Table,
        date: &str,
        parts: impl Iterator<Item = Result<RecordBatch, E>>,
    ) -> Result<PersistedFile, StoreError> {
        let (day, bad) = Self::derived_day(table, date)?;
        let storage = parts.map(|part| {
            let part = part.map_err(|e| PersistError::Rows(e.to_string()))?;
            to_storage(table, &part).map_err(|e| PersistError::Rows(e.to_string()))
        });
        let staged = persist::stage_sorted(&self.config.data_dir, table, date, day, storage, &self.persist_options())
            .map_err(|e| match e {
            PersistError::Rows(detail) => bad(detail),
            e => e.into(),
        })?;
        self.commit_replacement(table, date, staged)
    }

    /// The day of a derived table's partition, and how its errors read.
    fn derived_day(table: Table, date: &str) -> Result<(i64, impl Fn(String) -> StoreError), StoreError> {
        let owned = date.to_owned();
        let bad = move |detail: String| StoreError::Derived { table: table.name(), date: owned.clone(), detail };
        if table.shipped() {
            return Err(bad("only derived tables are replaced".into()));
        }
        let day = crate::fsutil::parse_day(date).ok_or_else(|| bad("not a YYYY-MM-DD date".into()))?;
        Ok((day, bad))
    }

    pub(super) fn persist_options(&self) -> PersistOptions {
        PersistOptions {
            row_group_rows: self.config.row_group_rows,
            zstd_level: self.config.zstd_level,
            reading_encoding: self.config.reading_encoding,
        }
    }

    /// Publishes `staged` in place of the partition's files, one replacement at a time.
    /// Staging happens before the lock (it may take as long as its producer), so a long
    /// materialization does not hold up compaction or retention; and a compaction holds
    /// the lock only while it commits, so the writer does not wait for a merge either
    /// (a merge whose inputs this replaced is dropped at its commit).
    fn commit_replacement(&self, table: Table, date: &str, staged: StagedFile) -> Result<PersistedFile, StoreError> {
        let _one_at_a_time = lock(&self.commit_lock);
        let partition = compact::partition_dir(&self.config.data_dir, table, date);
        // A previous replacement still in its grace: its old files go now, so the new
        // journal cannot hide its record of them.
        if partition.join(JOURNAL).exists() {
            lock(&self.pending).retain(|p| p.partition != partition);
            if let Err(e) = compact::finish(&self.storage, &partition) {
                let _ = std::fs::remove_file(&staged.tmp);
                return Err(e.into());
            }
        }
        let inputs: Vec<PersistedFile> =
            lock(&self.state).files.get(&table).into_iter().flatten().filter(|f| f.date == date).cloned().collect();
        let plan = Plan { table, date: date.to_owned(), inputs, output: compact::Level::of(&staged.file.path) };
        Ok(self.commit_and_swap(&plan, &staged, partition, Instant::now())?)
    }

    /// The commit of a merge or a replacement, under the commit lock: the journal and
    /// the published output, the listing swapped, the inputs' removal scheduled.
    fn commit_and_swap(
        &self,
        plan: &Plan,
        staged: &StagedFile,
        partition: PathBuf,
        now: Instant,
    ) -> Result<PersistedFile, PersistError> {
        compact::commit(&self.storage, plan, staged)?;
        let output = self.storage.published(staged.file.clone());
        self.swap(plan, &output);
        lock(&self.pending).push(Pending { due: now + self.config.superseded_grace, partition });
        Ok(output)
    }

    /// Whether every input of `plan` is still listed (no replacement took them away).
    fn listed(&self, plan: &Plan) -> bool {
        let st = lock(&self.state);
        let list = st.files.get(&plan.table).map(Vec::as_slice).unwrap_or_default();
        plan.inputs.iter().all(|i| list.iter().any(|f| f.path == i.path))
    }

    /// Makes `output` visible in place of `plan.inputs`, in one step for readers.
    fn swap(&self, plan: &Plan, output: &PersistedFile) {
        let mut st = lock(&self.state);
        let list = st.files.entry(plan.table).or_default();
        list.retain(|f| !plan.inputs.iter().any(|i| i.path == f.path));
        list.push(output.clone());
        list.sort_by(|a, b| a.path.cmp(&b.path));
    }
}

/// Start-up: finishes compactions a crash interrupted (before temp files are cleared).
pub(super) fn recover(storage: &crate::storage::Storage) -> Result<usize, PersistError> {
    TABLES.into_iter().map(|t| compact::recover(storage, t)).sum()
}

pub(super) fn spawn_background(inner: Arc<Inner>) -> io::Result<JoinHandle<()>> {
    std::thread::Builder::new().name("apron-maintain".into()).spawn(move || background(&inner))
}

fn background(inner: &Inner) {
    let interval = inner.config.maintenance_interval.max(Duration::from_millis(100));
    loop {
        {
            let mut sig = lock(&inner.signal);
            let until = Instant::now() + interval;
            while !sig.shutdown && Instant::now() < until {
                let left = until.saturating_duration_since(Instant::now());
                sig = inner.wake.wait_timeout(sig, left).unwrap_or_else(std::sync::PoisonError::into_inner).0;
            }
            if sig.shutdown {
                return;
            }
        }
        let r = inner.maintain(now_us(), Instant::now());
        for e in &r.errors {
            tracing::warn!(error = %e, "maintenance step failed; retried at the next pass");
        }
        if !r.expired.is_empty() {
            tracing::info!(partitions = r.expired.len(), "retention removed partitions");
        }
    }
}
