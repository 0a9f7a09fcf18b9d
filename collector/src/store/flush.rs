//! Persisting: freeze the memtable, write Parquet, commit the checkpoint, publish,
//! truncate the WAL — and the background thread that does it on a timer or size.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{Inner, lock, now_us};
use crate::checkpoint::{Checkpoint, Rename};
use crate::dedup::DedupState;
use crate::error::StoreError;
use crate::memtable::Memtable;
use crate::persist::{self, PersistedFile, StagedFile};

/// After a failed background persist, wait this long (or the interval, if shorter)
/// before trying again, however hard ingest pushes.
const RETRY_AFTER: Duration = Duration::from_secs(10);

/// A memtable taken out of the ingest path, with what its persist must record.
pub(super) struct Frozen {
    pub(super) memtable: Memtable,
    /// Every record of this memtable lies in WAL segments `<=` this, and no other.
    wal_through: u64,
    /// Dedup state as of the freeze (later batches are in later segments).
    dedup: DedupState,
    progress: Mutex<Progress>,
}

/// How far a persist of a frozen memtable got, so a retry resumes rather than redoes:
/// once the checkpoint naming the staged files may be on disk, those exact files must
/// be the ones published.
#[derive(Default)]
struct Progress {
    staged: Option<Vec<StagedFile>>,
    committed: bool,
}

/// What one persist wrote.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PersistReport {
    pub files: Vec<PersistedFile>,
    pub rows: usize,
    pub wal_segments_removed: usize,
}

impl Inner {
    pub(super) fn persist(&self) -> Result<PersistReport, StoreError> {
        let _one_at_a_time = lock(&self.persist_lock);
        let mut report = PersistReport::default();
        // A frozen memtable left by a failed attempt goes first, to keep WAL order.
        let leftover = lock(&self.state).frozen.clone();
        if let Some(f) = leftover {
            self.persist_frozen(&f, &mut report)?;
        }
        if let Some(f) = self.freeze()? {
            self.persist_frozen(&f, &mut report)?;
        }
        Ok(report)
    }

    fn freeze(&self) -> Result<Option<Arc<Frozen>>, StoreError> {
        // Exclusive: no append is between its WAL write and its memtable insert now.
        let _exclusive = self.gate.write().unwrap_or_else(PoisonError::into_inner);
        if lock(&self.state).active.is_empty() {
            return Ok(None);
        }
        let wal_through = self.wal.roll()?;
        let dedup = {
            let mut d = lock(&self.dedup);
            let retention = i64::try_from(self.config.dedup_retention.as_micros()).unwrap_or(i64::MAX);
            let pruned = d.prune(now_us().saturating_sub(retention));
            if pruned > 0 {
                tracing::info!(pruned, "dedup: forgot agent epochs past retention");
            }
            d.to_state()
        };
        let mut st = lock(&self.state);
        let memtable = std::mem::take(&mut st.active);
        let frozen = Arc::new(Frozen { memtable, wal_through, dedup, progress: Mutex::new(Progress::default()) });
        st.frozen = Some(frozen.clone());
        Ok(Some(frozen))
    }

    fn persist_frozen(&self, f: &Frozen, report: &mut PersistReport) -> Result<(), StoreError> {
        let data = &self.config.data_dir;
        let mut progress = lock(&f.progress);
        if progress.staged.is_none() {
            progress.staged = Some(self.stage(f)?);
        }
        let staged = progress.staged.clone().unwrap_or_default();
        if !progress.committed {
            let renames =
                staged.iter().map(|s| Rename { from: rel(data, &s.tmp), to: rel(data, &s.file.path) }).collect();
            // The commit point. If this fails the staged files stay: the checkpoint may
            // have reached the disk anyway, and then it must find them.
            Checkpoint::new(f.wal_through, renames, f.dedup.clone()).store(data)?;
            progress.committed = true;
        }
        let pairs: Vec<(PathBuf, PathBuf)> = staged.iter().map(|s| (s.tmp.clone(), s.file.path.clone())).collect();
        self.storage.publish(&pairs)?;
        let published: Vec<PersistedFile> = staged.iter().map(|s| self.storage.published(s.file.clone())).collect();
        {
            let mut st = lock(&self.state);
            for f in &published {
                st.files.entry(f.table).or_default().push(f.clone());
            }
            st.frozen = None;
        }
        // Room in the memtable budget: wake ingest that waits for it.
        self.wake.notify_all();
        report.rows += staged.iter().map(|s| s.rows).sum::<usize>();
        report.files.extend(published);
        // From here on, failures are harmless: the checkpoint already marks these
        // segments as persisted, so start-up skips and deletes them.
        match self.wal.truncate_through(f.wal_through) {
            Ok(n) => report.wal_segments_removed += n,
            Err(e) => tracing::warn!(error = %e, "could not delete persisted WAL segments; retried at start-up"),
        }
        if let Err(e) = Checkpoint::new(f.wal_through, Vec::new(), f.dedup.clone()).store(data) {
            tracing::warn!(error = %e, "could not clear the publish list of the checkpoint");
        }
        Ok(())
    }

    fn stage(&self, f: &Frozen) -> Result<Vec<StagedFile>, StoreError> {
        let data = &self.config.data_dir;
        let options = self.persist_options();
        let mut staged = Vec::new();
        for table in f.memtable.tables() {
            match persist::stage_table(data, table, &f.memtable.snapshot(table), &options) {
                Ok(files) => staged.extend(files),
                Err(e) => {
                    // No checkpoint names these yet, so they can go.
                    for s in &staged {
                        let _ = std::fs::remove_file(&s.tmp);
                    }
                    return Err(e.into());
                }
            }
        }
        Ok(staged)
    }
}

fn rel(data: &Path, p: &Path) -> PathBuf {
    p.strip_prefix(data).map(Path::to_path_buf).unwrap_or_else(|_| p.to_path_buf())
}

pub(super) fn spawn_background(inner: Arc<Inner>) -> io::Result<JoinHandle<()>> {
    std::thread::Builder::new().name("apron-persist".into()).spawn(move || background(&inner))
}

/// Persists every `persist_interval`, or sooner when ingest reports the memtable over
/// `persist_max_bytes`; stops at shutdown.
fn background(inner: &Inner) {
    let interval = inner.config.persist_interval.max(Duration::from_millis(100));
    let mut next = Instant::now() + interval;
    let mut retry_at: Option<Instant> = None;
    loop {
        let mut sig = lock(&inner.signal);
        loop {
            if sig.shutdown {
                return;
            }
            let now = Instant::now();
            if now >= next || (sig.kick && retry_at.is_none_or(|r| now >= r)) {
                break;
            }
            let until = if sig.kick { retry_at.unwrap_or(next).min(next) } else { next };
            sig = inner
                .wake
                .wait_timeout(sig, until.saturating_duration_since(now))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        sig.kick = false;
        drop(sig);
        let started = Instant::now();
        match inner.persist() {
            Ok(r) => {
                if !r.files.is_empty() {
                    let elapsed_ms = started.elapsed().as_millis() as u64;
                    tracing::info!(files = r.files.len(), rows = r.rows, elapsed_ms, "persisted memtable to Parquet");
                }
                retry_at = None;
                next = Instant::now() + interval;
            }
            Err(e) => {
                tracing::error!(error = %e, "persist failed; the rows stay in memory and in the WAL");
                let at = Instant::now() + RETRY_AFTER.min(interval);
                retry_at = Some(at);
                next = at;
            }
        }
    }
}
