//! The on-disk spool: batches the collector has not acknowledged yet.
//!
//! One file per batch, `<epoch>-<seq>.<table>.arrows`, holding the exact request body,
//! so a spooled batch is re-sent byte for byte with its original epoch and sequence.
//! Lexical order of the names is send order (see [`super::Batch::file_name`]).
//!
//! Crash safety: a batch is written to `.<name>.tmp`, fsynced, renamed to its name and
//! the directory fsynced. A crash leaves either no file or a whole one under the final
//! name; a temp file left behind is deleted when the spool is opened and is never
//! listed.
//!
//! Bound: the files together stay within `max_bytes`. A batch that does not fit pushes
//! out the oldest files first (counted as dropped batches and rows); the batch being
//! sent at that moment is never the one dropped. Batches the collector refuses for good
//! (400, 413, 422) move to `rejected/`, which keeps the last [`KEEP_REJECTED`].

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use apron_common::wire::{self, Table};

use super::{Batch, parse_file_name};

/// Rejected batches kept for an operator to inspect.
pub const KEEP_REJECTED: usize = 100;
pub const REJECTED_DIR: &str = "rejected";

#[derive(Debug, thiserror::Error)]
pub enum SpoolError {
    #[error("cannot create the spool directory {path}: {source}")]
    Create { path: PathBuf, source: std::io::Error },
    #[error("cannot read the spool directory {path}: {source}")]
    List { path: PathBuf, source: std::io::Error },
    #[error("cannot write the spool file {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
    #[error("cannot read the spool file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
}

/// Batches (and their rows) dropped to keep the bound.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Dropped {
    pub batches: u64,
    pub rows: u64,
}

impl std::ops::AddAssign for Dropped {
    fn add_assign(&mut self, o: Dropped) {
        self.batches += o.batches;
        self.rows += o.rows;
    }
}

#[derive(Clone, Debug)]
struct Entry {
    size: u64,
    table: Table,
    /// Known for batches written by this process; counted from the file when needed.
    rows: Option<usize>,
}

/// A spooled batch's place in the queue.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Head {
    pub name: String,
}

#[derive(Debug)]
pub struct Spool {
    dir: PathBuf,
    max_bytes: u64,
    entries: BTreeMap<String, Entry>,
    bytes: u64,
    /// The file the shipper is sending; never dropped under it.
    in_flight: Option<String>,
}

fn write_err(path: &Path) -> impl FnOnce(std::io::Error) -> SpoolError + '_ {
    move |source| SpoolError::Write { path: path.to_owned(), source }
}

/// Writes `body` to `dir/name` atomically: temp file, fsync, rename, fsync the directory.
fn write_atomic(dir: &Path, name: &str, body: &[u8]) -> Result<(), SpoolError> {
    let tmp = dir.join(format!(".{name}.tmp"));
    let path = dir.join(name);
    let written = (|| {
        let mut f = File::create(&tmp)?;
        f.write_all(body)?;
        f.sync_all()?;
        fs::rename(&tmp, &path)?;
        // The rename is durable only once the directory entry is.
        File::open(dir)?.sync_all()
    })();
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    written.map_err(write_err(&path))
}

/// Rows in an encoded batch; 0 when the file is not a readable stream (it is still
/// sent: the collector's 400 moves it to `rejected/`).
pub fn count_rows(body: &[u8], table: Table) -> usize {
    wire::decode_ipc(body, table, usize::MAX).map_or(0, |bs| bs.iter().map(|b| b.num_rows()).sum())
}

impl Spool {
    /// Opens (creating) `dir`, deletes temp files a crash left behind, indexes the
    /// batches and drops the oldest if they exceed `max_bytes` (a lowered bound).
    pub fn open(dir: &Path, max_bytes: u64) -> Result<(Spool, Dropped), SpoolError> {
        for d in [dir.to_path_buf(), dir.join(REJECTED_DIR)] {
            fs::create_dir_all(&d).map_err(|source| SpoolError::Create { path: d.clone(), source })?;
        }
        let list_err = |source| SpoolError::List { path: dir.to_owned(), source };
        let mut entries = BTreeMap::new();
        let mut bytes = 0;
        for item in fs::read_dir(dir).map_err(list_err)? {
            let item = item.map_err(list_err)?;
            let Ok(name) = item.file_name().into_string() else { continue };
            let path = item.path();
            if !item.file_type().map_err(list_err)?.is_file() {
                continue;
            }
            if name.ends_with(".tmp") {
                // An interrupted write: the batch was never handed over as spooled.
                let _ = fs::remove_file(&path);
                continue;
            }
            match parse_file_name(&name) {
                Some((_, _, table)) => {
                    let size = item.metadata().map_err(list_err)?.len();
                    bytes += size;
                    entries.insert(name, Entry { size, table, rows: None });
                }
                None => tracing::warn!(file = %path.display(), "not a spool file; ignored"),
            }
        }
        let mut spool = Spool { dir: dir.to_owned(), max_bytes, entries, bytes, in_flight: None };
        let dropped = spool.make_room(0);
        Ok((spool, dropped))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn files(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The oldest batch, next to send.
    pub fn head(&self) -> Option<Head> {
        self.entries.keys().next().map(|name| Head { name: name.clone() })
    }

    /// File names in send order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    pub fn set_in_flight(&mut self, name: Option<String>) {
        self.in_flight = name;
    }

    /// Drops the oldest files (never the one in flight) until `incoming` more bytes fit.
    fn make_room(&mut self, incoming: u64) -> Dropped {
        let mut dropped = Dropped::default();
        while self.bytes + incoming > self.max_bytes {
            let Some(name) = self.entries.keys().find(|n| Some(*n) != self.in_flight.as_ref()).cloned() else {
                break;
            };
            let rows = self.rows_of(&name);
            self.remove(&name);
            tracing::debug!(file = %name, rows, "spool full: dropped the oldest batch");
            dropped += Dropped { batches: 1, rows: rows as u64 };
        }
        dropped
    }

    fn rows_of(&self, name: &str) -> usize {
        let Some(e) = self.entries.get(name) else { return 0 };
        e.rows.unwrap_or_else(|| fs::read(self.dir.join(name)).map_or(0, |b| count_rows(&b, e.table)))
    }

    /// Writes `batch`, first dropping the oldest batches to make room. A batch larger
    /// than the whole bound is dropped itself. Returns what was dropped.
    pub fn push(&mut self, batch: &Batch) -> Result<Dropped, SpoolError> {
        let size = batch.body.len() as u64;
        let name = batch.file_name();
        if self.entries.contains_key(&name) {
            return Ok(Dropped::default());
        }
        if size > self.max_bytes {
            return Ok(Dropped { batches: 1, rows: batch.rows as u64 });
        }
        let mut dropped = self.make_room(size);
        if self.bytes + size > self.max_bytes {
            dropped += Dropped { batches: 1, rows: batch.rows as u64 };
            return Ok(dropped);
        }
        write_atomic(&self.dir, &name, &batch.body)?;
        self.bytes += size;
        self.entries.insert(name, Entry { size, table: batch.table, rows: Some(batch.rows) });
        Ok(dropped)
    }

    /// Reads a spooled batch back, with the epoch and sequence its name carries.
    pub fn load(&self, head: &Head) -> Result<Option<Batch>, SpoolError> {
        let Some((epoch, seq, table)) = parse_file_name(&head.name) else { return Ok(None) };
        let path = self.dir.join(&head.name);
        let body = fs::read(&path).map_err(|source| SpoolError::Read { path, source })?;
        let rows = match self.entries.get(&head.name).and_then(|e| e.rows) {
            Some(r) => r,
            None => count_rows(&body, table),
        };
        Ok(Some(Batch { epoch: Arc::from(epoch), seq, table, rows, body }))
    }

    /// Forgets and deletes a file (sent, dropped or unreadable).
    pub fn remove(&mut self, name: &str) {
        if let Some(e) = self.entries.remove(name) {
            self.bytes -= e.size;
            if let Err(err) = fs::remove_file(self.dir.join(name))
                && err.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(file = name, "cannot delete a spool file: {err}");
            }
        }
    }

    /// Keeps a batch the collector refused for good in `rejected/` with the reason
    /// next to it (`<name>.error`), removes it from the queue and trims `rejected/` to
    /// the last [`KEEP_REJECTED`].
    pub fn reject(&mut self, batch: &Batch, reason: &str) -> Result<(), SpoolError> {
        let name = batch.file_name();
        let dir = self.dir.join(REJECTED_DIR);
        fs::create_dir_all(&dir).map_err(|source| SpoolError::Create { path: dir.clone(), source })?;
        let kept = write_atomic(&dir, &name, &batch.body)
            .and_then(|()| write_atomic(&dir, &format!("{name}.error"), format!("{reason}\n").as_bytes()));
        self.remove(&name);
        kept?;
        let mut rejected: Vec<String> = fs::read_dir(&dir)
            .map_err(|source| SpoolError::List { path: dir.clone(), source })?
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| parse_file_name(n).is_some())
            .collect();
        rejected.sort();
        let excess = rejected.len().saturating_sub(KEEP_REJECTED);
        for old in &rejected[..excess] {
            let _ = fs::remove_file(dir.join(old));
            let _ = fs::remove_file(dir.join(format!("{old}.error")));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ship::file_name;

    const EPOCH: &str = "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b";

    fn batch(seq: u64, size: usize) -> Batch {
        Batch { epoch: EPOCH.into(), seq, table: Table::GpuSamples, rows: seq as usize, body: vec![seq as u8; size] }
    }

    fn listing(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir)
            .expect("list")
            .filter_map(|e| e.ok())
            .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
            .filter_map(|e| e.file_name().into_string().ok())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn keeps_send_order_across_reopen() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut s, _) = Spool::open(dir.path(), 1 << 20).expect("open");
        // Written out of order (the sink may spool a newer batch while older ones are
        // still queued): the queue is still by sequence.
        for seq in [3, 1, 10, 2] {
            s.push(&batch(seq, 100)).expect("push");
        }
        let names: Vec<String> = s.names().map(str::to_owned).collect();
        let expect: Vec<String> = [1, 2, 3, 10].iter().map(|&q| file_name(EPOCH, q, Table::GpuSamples)).collect();
        assert_eq!(names, expect);
        assert_eq!((s.files(), s.bytes()), (4, 400));
        drop(s);

        let (s, dropped) = Spool::open(dir.path(), 1 << 20).expect("reopen");
        assert_eq!(dropped, Dropped::default());
        assert_eq!(s.names().map(str::to_owned).collect::<Vec<_>>(), expect);
        let head = s.head().expect("head");
        let b = s.load(&head).expect("load").expect("spool name");
        assert_eq!((b.seq, b.table, &*b.epoch, b.body.len()), (1, Table::GpuSamples, EPOCH, 100));
        // An older epoch sorts first.
        let older = Batch { epoch: "0180a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b".into(), ..batch(99, 10) };
        assert!(older.file_name() < head.name);
    }

    #[test]
    fn bound_drops_the_oldest_first_and_counts_rows() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut s, _) = Spool::open(dir.path(), 1000).expect("open");
        let mut dropped = Dropped::default();
        for seq in 1..=10 {
            dropped += s.push(&batch(seq, 300)).expect("push");
            assert!(s.bytes() <= 1000);
        }
        // Three 300-byte files fit; seven were dropped, oldest first: rows 1..=7.
        assert_eq!(dropped, Dropped { batches: 7, rows: (1..=7).sum() });
        assert_eq!(s.names().collect::<Vec<_>>(), (8..=10).map(|q| batch(q, 0).file_name()).collect::<Vec<_>>());
        assert_eq!(listing(dir.path()).len(), 3, "dropped files are deleted");

        // The batch being sent survives; the next oldest goes instead.
        s.set_in_flight(Some(batch(8, 0).file_name()));
        let d = s.push(&batch(11, 300)).expect("push");
        assert_eq!(d, Dropped { batches: 1, rows: 9 });
        assert!(s.names().any(|n| n == batch(8, 0).file_name()));

        // A batch bigger than the whole bound is dropped itself, nothing else is.
        let d = s.push(&batch(12, 5000)).expect("push");
        assert_eq!(d, Dropped { batches: 1, rows: 12 });
        assert_eq!(s.files(), 3);
    }

    #[test]
    fn rows_of_files_from_an_earlier_run_are_counted_from_the_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let procs = apron_common::wire::processes_to_batch(&[]).expect("batch");
        let body = wire::encode_ipc(&procs).expect("encode");
        let real = Batch { epoch: EPOCH.into(), seq: 1, table: Table::GpuProcesses, rows: 0, body };
        let size = real.body.len() as u64;
        fs::write(dir.path().join(real.file_name()), &real.body).expect("write");
        fs::write(dir.path().join(batch(2, 0).file_name()), vec![0u8; size as usize]).expect("write");
        // Lowering the bound at start drops the oldest.
        let (s, dropped) = Spool::open(dir.path(), size).expect("open");
        assert_eq!(dropped, Dropped { batches: 1, rows: 0 });
        assert_eq!(s.files(), 1);
    }

    #[test]
    fn temp_files_from_a_crash_are_ignored_and_cleaned() {
        let dir = tempfile::tempdir().expect("tempdir");
        let b = batch(5, 50);
        // A crash between write and rename leaves only the temp file; a stray file
        // that is not a spool name is left alone but never sent.
        fs::write(dir.path().join(format!(".{}.tmp", b.file_name())), b"half a bat").expect("write");
        fs::write(dir.path().join("README"), b"operator notes").expect("write");
        let (mut s, _) = Spool::open(dir.path(), 1 << 20).expect("open");
        assert!(s.is_empty(), "{:?}", s.names().collect::<Vec<_>>());
        assert_eq!(listing(dir.path()), ["README"]);

        s.push(&b).expect("push");
        // After a push only the final name exists (the rename happened) and it holds the
        // whole body.
        assert_eq!(listing(dir.path()), vec![b.file_name(), "README".to_owned()]);
        assert_eq!(fs::read(dir.path().join(b.file_name())).expect("read"), b.body);
    }

    #[test]
    fn failed_write_leaves_nothing_behind() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut s, _) = Spool::open(dir.path(), 1 << 20).expect("open");
        // A directory where the final file should go makes the rename fail.
        let b = batch(1, 10);
        fs::create_dir(dir.path().join(b.file_name())).expect("mkdir");
        assert!(s.push(&b).is_err());
        assert_eq!(s.files(), 0);
        assert!(!listing(dir.path()).iter().any(|n| n.ends_with(".tmp")), "{:?}", listing(dir.path()));
    }

    #[test]
    fn rejected_batches_are_moved_and_bounded() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut s, _) = Spool::open(dir.path(), 1 << 30).expect("open");
        s.push(&batch(1, 10)).expect("push");
        s.reject(&batch(1, 10), "422 wrong schema: column x").expect("reject");
        assert!(s.is_empty());
        let rejected = dir.path().join(REJECTED_DIR);
        let reason = fs::read_to_string(rejected.join(format!("{}.error", batch(1, 0).file_name()))).expect("reason");
        assert!(reason.contains("422"), "{reason}");
        for seq in 2..=(KEEP_REJECTED as u64 + 5) {
            s.reject(&batch(seq, 1), "400").expect("reject");
        }
        let kept = listing(&rejected);
        assert_eq!(kept.iter().filter(|n| n.ends_with(".arrows")).count(), KEEP_REJECTED);
        assert_eq!(kept.len(), 2 * KEEP_REJECTED, "each with its reason");
        assert!(!kept.contains(&batch(5, 0).file_name()), "the oldest went first");
        // The rejected directory is not part of the queue.
        let (s, _) = Spool::open(dir.path(), 1 << 30).expect("reopen");
        assert!(s.is_empty());
    }
}
