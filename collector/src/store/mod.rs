//! The facade the HTTP layer calls: open (with replay), ingest, persist, views.
//!
//! Concurrency, and why it is safe:
//! - `gate` (RwLock): every ingest holds it shared from WAL append to memtable insert;
//!   freezing the memtable for a persist holds it exclusively while it rolls the WAL.
//!   So every record in a WAL segment `<=` the roll point is in the frozen memtable and
//!   every later one in the new active memtable — deleting those segments after the
//!   persist can never drop an acknowledged row.
//! - `state` (Mutex): active and frozen memtables and the persisted-file list, changed
//!   together so a reader never sees a row twice (file and memory) or not at all.
//! - `dedup` (Mutex): seen batches and in-flight reservations.

mod flush;
mod lock;
mod maintain;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, RwLock};
use std::thread::JoinHandle;
use std::time::{SystemTime, UNIX_EPOCH};

use apron_common::wire::{Table, decode_ipc};
use arrow_array::RecordBatch;
use arrow_schema::SchemaRef;

use crate::checkpoint::{Checkpoint, Rename};
use crate::config::StoreConfig;
use crate::dedup::{Dedup, Reservation};
use crate::error::{IngestError, StoreError};
use crate::memtable::{Memtable, TableStats};
use crate::persist::{self, PersistedFile};
use crate::schema::{storage_schema, to_memory};
use crate::wal::{Replay, ReplayReport, StdIo, Wal, WalIo, WalOptions, WalRecord};

pub use flush::PersistReport;
pub use maintain::{Compacted, MaintenanceReport};

/// Longest agent id and epoch accepted (both are stored in every WAL record and in
/// the checkpoint).
const MAX_ID_LEN: usize = 256;

/// One `POST /api/v1/ingest`: the table, the batch identity and the body as received.
#[derive(Clone, Copy, Debug)]
pub struct IngestRequest<'a> {
    pub table: Table,
    pub agent: &'a str,
    /// The agent process's epoch (`x-apron-epoch`; opaque, a UUID v7 from apron-agent).
    pub epoch: &'a str,
    pub sequence: u64,
    /// An Arrow IPC stream in the table's wire schema.
    pub body: &'a [u8],
}

/// The answer to an accepted request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IngestOutcome {
    /// Rows in the request.
    pub rows: usize,
    /// True when this (agent, epoch, sequence) was stored before; nothing was written.
    pub duplicate: bool,
}

/// What start-up found and did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OpenReport {
    pub replay: ReplayReport,
    /// Rows and records put back into the memtable from the WAL.
    pub replayed_rows: usize,
    pub replayed_records: u64,
    /// WAL records skipped as duplicates of stored batches.
    pub replayed_duplicates: u64,
    /// Renames of a committed persist that a crash interrupted, completed now.
    pub renames_completed: usize,
    /// Temp files of an uncommitted persist or compaction, removed.
    pub temp_files_removed: usize,
    /// Committed compactions a crash interrupted, finished now.
    pub compactions_finished: usize,
}

/// A consistent view of one table for the query layer: batches still in memory and the
/// Parquet files, with no row in both.
#[derive(Clone, Debug)]
pub struct TableView {
    /// The storage schema (the files'; the batches are in the memory schema and
    /// [`crate::schema::widen`] to it).
    pub schema: SchemaRef,
    /// In the memory schema: [`crate::schema::widen`] them to `schema` (only the
    /// columns needed, after a projection).
    pub batches: Vec<RecordBatch>,
    pub files: Vec<PersistedFile>,
}

impl TableView {
    /// The memory batches widened whole to the storage schema (a copy of every
    /// column: for tools and tests; a query widens only what it projects).
    pub fn widened(&self) -> Result<Vec<RecordBatch>, arrow_schema::ArrowError> {
        self.batches.iter().map(|b| crate::schema::widen(b, &self.schema)).collect()
    }
}

struct State {
    active: Memtable,
    /// The memtable being persisted (still queryable until its files are visible).
    frozen: Option<Arc<flush::Frozen>>,
    files: HashMap<Table, Vec<PersistedFile>>,
    /// Bytes of accepted batches between their budget check and their memtable insert.
    reserved: usize,
}

impl State {
    /// What the memtable budget counts: rows not yet persisted, in memory or on the way.
    fn held_bytes(&self) -> usize {
        self.active.bytes() + self.frozen.as_ref().map_or(0, |f| f.memtable.bytes()) + self.reserved
    }
}

#[derive(Default)]
struct Signal {
    shutdown: bool,
    /// Set by ingest when the memtable outgrows `persist_max_bytes`.
    kick: bool,
}

struct Inner {
    config: StoreConfig,
    storage: crate::storage::Storage,
    wal: Wal,
    gate: RwLock<()>,
    state: Mutex<State>,
    dedup: Mutex<Dedup>,
    persist_lock: Mutex<()>,
    /// One maintenance pass (retention, compaction) at a time.
    maintain_lock: Mutex<()>,
    /// One change of a partition's file set by a journal at a time: a compaction's
    /// commit, a derived table's replacement, a superseded set's removal, retention.
    /// Held only around the change, never across a merge, so a derived partition's
    /// writer waits for a commit, not for a whole compaction pass.
    commit_lock: Mutex<()>,
    /// Committed compactions whose inputs are in their grace period.
    pending: Mutex<Vec<maintain::Pending>>,
    /// Subscribers to what ingest writes (the cost ledger).
    feeds: crate::changes::Feeds,
    signal: Mutex<Signal>,
    wake: Condvar,
    _lock: lock::DirLock,
}

/// How long an in-process sender ([`Store::ingest_waiting`]) waits out back-pressure
/// before it gives up: a persist at the default budget takes seconds, so a minute means
/// the disk or the persister is stuck, and the caller should say so.
pub const INGEST_PATIENCE: std::time::Duration = std::time::Duration::from_secs(60);

/// The collector's storage: WAL → memtable → Parquet.
pub struct Store {
    inner: Arc<Inner>,
    report: OpenReport,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("data_dir", &self.inner.config.data_dir).finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere must not wedge ingest; the data behind these locks stays valid.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn now_us() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as i64)
}

const TABLES: [Table; 5] = Table::ALL;

impl Store {
    /// Opens (or creates) the store in `config.data_dir`: finishes an interrupted
    /// persist, then replays the WAL through the same path as live writes.
    pub fn open(config: StoreConfig) -> Result<Store, StoreError> {
        Store::open_with_io(config, Arc::new(StdIo))
    }

    /// [`Store::open`] with a custom WAL file seam (fault injection in tests).
    pub fn open_with_io(config: StoreConfig, io: Arc<dyn WalIo>) -> Result<Store, StoreError> {
        config.validate().map_err(StoreError::Config)?;
        let data = config.data_dir.clone();
        crate::fsutil::create_dir_durable(&data).map_err(|source| StoreError::Io {
            op: "create data directory",
            path: data.clone(),
            source,
        })?;
        let dir_lock = lock::DirLock::acquire(&data)?;
        let mut report = OpenReport::default();

        let storage = crate::storage::Storage::open(&data, config.object_store.as_ref())?;
        let checkpoint = Checkpoint::load(&data)?.unwrap_or_else(|| Checkpoint::new(0, Vec::new(), Default::default()));
        let renames = absolute(&data, &checkpoint.publish);
        report.renames_completed = renames.iter().filter(|(from, _)| from.exists()).count();
        storage.publish(&renames)?;
        // Before temp files go: a committed compaction's output may still be one.
        report.compactions_finished = maintain::recover(&storage)?;
        for t in TABLES {
            report.temp_files_removed += persist::remove_temp_files(&data, t)?;
        }

        let mut dedup = Dedup::from_state(checkpoint.dedup);
        let mut active = Memtable::new();
        let wal_dir = data.join("wal");
        let mut replay = Replay::open(&wal_dir, checkpoint.wal_through)?;
        while let Some((_, entry)) = replay.next_entry()? {
            let fail = |detail: String| StoreError::Replay {
                table: entry.table.clone(),
                agent: entry.agent.clone(),
                epoch: entry.epoch.clone(),
                sequence: entry.sequence,
                detail,
            };
            let table = Table::from_name(&entry.table).ok_or_else(|| fail("unknown table".into()))?;
            // The record was validated when it was accepted; the row limit of today's
            // config must not refuse it now.
            let batches =
                decode(table, entry.body.as_slice(), usize::MAX, u64::MAX).map_err(|e| fail(e.to_string()))?;
            let rows = batches.iter().map(RecordBatch::num_rows).sum::<usize>();
            if apply(&mut active, &mut dedup, table, &entry.as_record(), batches) {
                report.replayed_records += 1;
                report.replayed_rows += rows;
            } else {
                report.replayed_duplicates += 1;
            }
        }
        report.replay = replay.report().clone();
        if report.replay.torn_bytes > 0 {
            tracing::warn!(bytes = report.replay.torn_bytes, "dropped a torn WAL tail (never acknowledged)");
        }

        let wal_options = WalOptions { segment_bytes: config.wal_segment_bytes };
        let wal = Wal::open(&wal_dir, wal_options, io, checkpoint.wal_through)?;
        // Segments a crash left behind after their persist committed.
        wal.truncate_through(checkpoint.wal_through)?;
        let mut files = HashMap::new();
        for t in TABLES {
            files.insert(t, storage.list(t)?);
        }
        tracing::info!(
            data_dir = %data.display(),
            replayed_records = report.replayed_records,
            replayed_rows = report.replayed_rows,
            "store opened"
        );

        let inner = Arc::new(Inner {
            config,
            storage,
            wal,
            gate: RwLock::new(()),
            state: Mutex::new(State { active, frozen: None, files, reserved: 0 }),
            dedup: Mutex::new(dedup),
            persist_lock: Mutex::new(()),
            maintain_lock: Mutex::new(()),
            commit_lock: Mutex::new(()),
            pending: Mutex::new(Vec::new()),
            feeds: crate::changes::Feeds::default(),
            signal: Mutex::new(Signal::default()),
            wake: Condvar::new(),
            _lock: dir_lock,
        });
        let spawn_error = |source| StoreError::Io { op: "spawn a background thread", path: data.clone(), source };
        let mut store = Store { inner: inner.clone(), report, threads: Vec::new() };
        store.threads.push(flush::spawn_background(inner.clone()).map_err(spawn_error)?);
        store.threads.push(maintain::spawn_background(inner).map_err(spawn_error)?);
        Ok(store)
    }

    /// What start-up replayed and repaired.
    pub fn open_report(&self) -> &OpenReport {
        &self.report
    }

    pub fn config(&self) -> &StoreConfig {
        &self.inner.config
    }

    /// Validates a batch, makes it durable in the WAL and adds it to the memtable.
    /// Returns only after the fsync; a duplicate is acknowledged without writing.
    pub fn ingest(&self, req: IngestRequest<'_>) -> Result<IngestOutcome, IngestError> {
        self.inner.ingest(req)
    }

    /// [`Store::ingest`] for callers inside the server (import, backfill, remote write)
    /// that would rather wait than answer 503: a batch refused for the memtable budget
    /// is retried as persists free room, for up to `patience`.
    pub fn ingest_waiting(
        &self,
        req: IngestRequest<'_>,
        patience: std::time::Duration,
    ) -> Result<IngestOutcome, IngestError> {
        let deadline = std::time::Instant::now() + patience;
        loop {
            match self.inner.ingest(req) {
                Err(IngestError::Backpressure { .. }) if std::time::Instant::now() < deadline => {
                    let sig = lock(&self.inner.signal);
                    // Woken when a persist publishes; the timeout covers a wake-up missed
                    // between the refusal and this wait.
                    let _ = self.inner.wake.wait_timeout(sig, std::time::Duration::from_millis(200));
                }
                other => return other,
            }
        }
    }

    /// Bytes the memtable budget counts now (rows not yet persisted).
    pub fn held_bytes(&self) -> usize {
        lock(&self.inner.state).held_bytes()
    }

    /// Persists everything in memory now (and a frozen memtable a failed attempt left).
    pub fn persist_now(&self) -> Result<PersistReport, StoreError> {
        self.inner.persist()
    }

    /// Runs one maintenance pass now (superseded files past their grace, retention,
    /// compaction), as the background thread does every `maintenance_interval`.
    pub fn maintain_now(&self) -> MaintenanceReport {
        self.inner.maintain(now_us(), std::time::Instant::now())
    }

    /// [`Store::maintain_now`] as if the wall clock read `now_us` (retention and which
    /// days are finished depend on it).
    pub fn maintain_at(&self, now_us: i64) -> MaintenanceReport {
        self.inner.maintain(now_us, std::time::Instant::now())
    }

    /// Replaces the whole `date` (UTC `YYYY-MM-DD`) partition of a derived table with
    /// `batches` (in the table's [`Table::schema`]; every row's time column in that day).
    /// Atomic for readers: they see the old files or the new one. Derived tables are
    /// recomputed from stored samples, so they bypass the WAL.
    pub fn replace_partition(
        &self,
        table: Table,
        date: &str,
        batches: &[RecordBatch],
    ) -> Result<PersistedFile, StoreError> {
        self.inner.replace_partition(table, date, batches)
    }

    /// [`Store::replace_partition`] from wire batches already sorted by (`gpu_uuid`,
    /// time) across all of them, written as they come (a producer on another thread can
    /// feed it through a channel): memory is one batch, not the partition. A batch out of
    /// order or outside the day, or an `Err` from `parts`, fails the replacement and the
    /// stored partition stays as it was. The end of `parts` is the end of the partition,
    /// so a producer that stops early must say so with an `Err`.
    pub fn replace_partition_sorted<E: std::fmt::Display>(
        &self,
        table: Table,
        date: &str,
        parts: impl Iterator<Item = Result<RecordBatch, E>>,
    ) -> Result<PersistedFile, StoreError> {
        self.inner.replace_partition_sorted(table, date, parts)
    }

    /// A feed of the (table, day) spans that ingest writes from now on; see
    /// [`crate::changes`].
    pub fn subscribe_changes(&self) -> crate::changes::ChangeFeed {
        self.inner.feeds.subscribe()
    }

    /// Batches in memory for `table` (memory schema: decimals unscaled; see
    /// [`crate::schema::widen`]), oldest first.
    pub fn snapshot(&self, table: Table) -> Vec<RecordBatch> {
        self.view(table).batches
    }

    /// Published Parquet files of `table`.
    pub fn persisted_files(&self, table: Table) -> Vec<PersistedFile> {
        self.view(table).files
    }

    /// Memory batches and files of `table`, taken together so no row is in both.
    pub fn view(&self, table: Table) -> TableView {
        let st = lock(&self.inner.state);
        let mut batches = st.frozen.as_ref().map(|f| f.memtable.snapshot(table)).unwrap_or_default();
        batches.extend(st.active.snapshot(table));
        let files = st.files.get(&table).cloned().unwrap_or_default();
        TableView { schema: storage_schema(table), batches, files }
    }

    /// The published files of `table` now (what a query planned now would read).
    pub fn files(&self, table: Table) -> Vec<PersistedFile> {
        lock(&self.inner.state).files.get(&table).cloned().unwrap_or_default()
    }

    /// Counts for the rows of `table` in memory (active and being persisted).
    pub fn memtable_stats(&self, table: Table) -> TableStats {
        let st = lock(&self.inner.state);
        let a = st.active.stats(table);
        let Some(f) = &st.frozen else { return a };
        let b = f.memtable.stats(table);
        let min = |x: Option<i64>, y: Option<i64>| x.into_iter().chain(y).min();
        let max = |x: Option<i64>, y: Option<i64>| x.into_iter().chain(y).max();
        TableStats {
            batches: a.batches + b.batches,
            rows: a.rows + b.rows,
            bytes: a.bytes + b.bytes,
            min_time: min(a.min_time, b.min_time),
            max_time: max(a.max_time, b.max_time),
        }
    }

    pub fn data_dir(&self) -> &Path {
        &self.inner.config.data_dir
    }

    /// Where the published files are: `None` for the data directory, else the object
    /// store and its URL (`s3://bucket`), in which each [`PersistedFile::path`] is a key.
    pub fn object_store(&self) -> Option<(String, Arc<dyn object_store::ObjectStore>)> {
        self.inner.storage.object_store()
    }

    /// The bucket, when the store publishes to one (`[storage.object_store]`).
    pub fn lake(&self) -> Option<&crate::storage::Remote> {
        self.inner.storage.remote()
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        // Stops the background persister only: whatever is in memory is in the WAL and
        // comes back at the next open. (A clean shutdown may call persist_now first.)
        lock(&self.inner.signal).shutdown = true;
        self.inner.wake.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Inner {
    fn ingest(&self, req: IngestRequest<'_>) -> Result<IngestOutcome, IngestError> {
        if !req.table.shipped() {
            return Err(IngestError::BadRequest(format!(
                "table {} is derived by the server and cannot be ingested",
                req.table.name()
            )));
        }
        for (what, id) in [("agent id", req.agent), ("epoch", req.epoch)] {
            if id.is_empty() || id.len() > MAX_ID_LEN {
                return Err(IngestError::BadRequest(format!("{what} must be 1 to {MAX_ID_LEN} bytes")));
            }
        }
        // Validate fully before anything is written: a refused body leaves no trace.
        let batches = decode(req.table, req.body, self.config.max_rows_per_batch, self.config.max_batch_bytes)?;
        let rows = batches.iter().map(RecordBatch::num_rows).sum();
        if rows == 0 {
            // Nothing to keep; not recording it costs nothing if it is retried.
            return Ok(IngestOutcome { rows, duplicate: false });
        }
        match lock(&self.dedup).reserve(req.agent, req.epoch, req.sequence) {
            Reservation::Duplicate => return Ok(IngestOutcome { rows, duplicate: true }),
            Reservation::InFlight => return Err(IngestError::InFlight),
            Reservation::New => {}
        }
        let incoming: usize = batches.iter().map(crate::memtable::allocated_bytes).sum();
        let mut changed = crate::changes::Changed::default();
        if self.feeds.active() {
            changed.record(req.table, &batches);
        }
        {
            let mut st = lock(&self.state);
            let held = st.held_bytes();
            let budget = usize::try_from(self.config.memtable_max_bytes).unwrap_or(usize::MAX);
            // An empty store takes any one batch, so a batch larger than the budget is
            // never refused forever (its size is bounded by max_batch_bytes).
            if held > 0 && held.saturating_add(incoming) > budget {
                drop(st);
                lock(&self.dedup).release(req.agent, req.epoch, req.sequence);
                lock(&self.signal).kick = true;
                self.wake.notify_all();
                return Err(IngestError::Backpressure {
                    held: held as u64,
                    incoming: incoming as u64,
                    budget: budget as u64,
                });
            }
            st.reserved += incoming;
        }
        let record = WalRecord {
            table: req.table.name(),
            agent: req.agent,
            epoch: req.epoch,
            sequence: req.sequence,
            received_us: now_us(),
            body: req.body,
        };
        let over = {
            let _shared = self.gate.read().unwrap_or_else(PoisonError::into_inner);
            if let Err(e) = self.wal.append(&record) {
                lock(&self.state).reserved -= incoming;
                lock(&self.dedup).release(req.agent, req.epoch, req.sequence);
                return Err(IngestError::from_wal(e));
            }
            let mut st = lock(&self.state);
            st.reserved -= incoming;
            apply(&mut st.active, &mut lock(&self.dedup), req.table, &record, batches);
            st.active.bytes() as u64 > self.config.persist_max_bytes
        };
        // After the rows are visible: a subscriber that takes, then reads, misses nothing.
        self.feeds.publish(&changed);
        if over {
            lock(&self.signal).kick = true;
            self.wake.notify_all();
        }
        Ok(IngestOutcome { rows, duplicate: false })
    }
}

/// Checks, decodes and converts a body to memtable batches (the memory schema); the
/// validation of live ingest and of replay alike.
fn decode(table: Table, body: &[u8], max_rows: usize, max_bytes: u64) -> Result<Vec<RecordBatch>, IngestError> {
    crate::ipc_guard::check(body, max_rows as u64, max_bytes).map_err(IngestError::from_framing)?;
    let wire = decode_ipc(body, table, max_rows).map_err(IngestError::from_wire)?;
    wire.iter().map(|b| to_memory(table, b).map_err(IngestError::from)).collect()
}

/// The one path by which a batch enters the memtable, live or replayed: record it as
/// seen and add its rows, unless it was seen before. Returns false for a duplicate.
fn apply(active: &mut Memtable, dedup: &mut Dedup, table: Table, r: &WalRecord<'_>, batches: Vec<RecordBatch>) -> bool {
    if !dedup.commit(r.agent, r.epoch, r.sequence, r.received_us) {
        return false;
    }
    active.insert(table, batches);
    true
}

fn absolute(data: &Path, renames: &[Rename]) -> Vec<(PathBuf, PathBuf)> {
    renames.iter().map(|r| (data.join(&r.from), data.join(&r.to))).collect()
}
