//! The write-ahead log: every accepted batch is durable here before it is acknowledged.
//!
//! Layout: `<data>/wal/<16-digit seq>.wal`, one directory of segments with increasing
//! sequence numbers (gaps allowed). Each segment starts with a 16-byte header
//! (`APRONWAL`, format version u32 LE, 4 reserved bytes), then records:
//!
//! ```text
//! record  = len: u32 LE | crc32c(payload): u32 LE | payload (len bytes)
//! payload = version u8 (1) | table_len u8 | table | agent_len u16 LE | agent
//!         | epoch_len u16 LE | epoch | sequence u64 LE | received_us i64 LE
//!         | body (the rest: the Arrow IPC stream exactly as received and validated)
//! ```
//!
//! **Group commit.** One writer thread owns the open segment. Appenders send their
//! encoded record with a one-shot reply channel; the writer takes everything queued,
//! writes it with one `write`, `fsync`s once and answers all of them. Under load many
//! requests share one fsync; alone, a request pays exactly one.
//!
//! **Failure.** If a write or fsync fails (disk full, I/O error) every appender of that
//! group gets the error and nothing of the group is acknowledged. The writer cuts the
//! segment back to its last good length; if that fails too, or the fsync failed (after
//! which the kernel's page cache state is unknown), the segment is abandoned and the
//! next append starts a fresh one. Either way the log stays replayable.
//!
//! **Replay** ([`Replay`]) reads segments in order and stops a segment at the first
//! record whose length or CRC is bad — a torn tail from a crash, never acknowledged —
//! truncating the file there and reporting the bytes dropped.

mod fault;
mod file;
mod replay;
mod writer;

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;

pub use fault::{Fault, FaultyIo};
pub use file::{StdIo, WalFile, WalIo};
pub use replay::{Replay, ReplayReport};

use writer::{Command, Writer};

/// The 8-byte magic at the start of every segment.
pub const MAGIC: &[u8; 8] = b"APRONWAL";
/// Segment format version, stored after the magic.
pub const FORMAT_VERSION: u32 = 1;
/// Segment header length: magic, version, reserved.
pub const HEADER_LEN: u64 = 16;
/// Record framing: length and CRC.
pub const FRAME_LEN: usize = 8;
/// Payload format version.
const RECORD_VERSION: u8 = 1;
/// The largest payload accepted. Bigger lengths in a file are treated as torn.
pub const MAX_RECORD_BYTES: usize = 256 << 20;

/// Where a record ends in the log: segment sequence number and byte offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WalPosition {
    pub segment: u64,
    pub offset: u64,
}

/// One record to append (borrowed) — the request metadata and the body as received.
#[derive(Clone, Copy, Debug)]
pub struct WalRecord<'a> {
    pub table: &'a str,
    pub agent: &'a str,
    /// The agent's process epoch (opaque; a UUID v7 from `apron-agent`).
    pub epoch: &'a str,
    pub sequence: u64,
    pub received_us: i64,
    pub body: &'a [u8],
}

/// One record read back by replay (owned).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WalEntry {
    pub table: String,
    pub agent: String,
    pub epoch: String,
    pub sequence: u64,
    pub received_us: i64,
    pub body: Vec<u8>,
}

impl WalEntry {
    pub fn as_record(&self) -> WalRecord<'_> {
        WalRecord {
            table: &self.table,
            agent: &self.agent,
            epoch: &self.epoch,
            sequence: self.sequence,
            received_us: self.received_us,
            body: &self.body,
        }
    }
}

/// Errors of the write-ahead log. `Clone` because one failed group commit answers many
/// appenders with the same cause.
#[derive(Clone, Debug, thiserror::Error)]
pub enum WalError {
    #[error("write-ahead log: {op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: Arc<io::Error>,
    },
    #[error("write-ahead log: {path} is not a WAL segment (bad header)")]
    BadHeader { path: PathBuf },
    #[error("write-ahead log: record at {path}:{offset} passed its checksum but cannot be decoded: {detail}")]
    Undecodable {
        path: PathBuf,
        offset: u64,
        #[source]
        detail: PayloadError,
    },
    #[error("write-ahead log: a {0}-byte record exceeds the limit of {MAX_RECORD_BYTES} bytes")]
    TooLarge(usize),
    #[error("write-ahead log: field {0} is too long")]
    FieldTooLong(&'static str),
    #[error("write-ahead log: the writer thread has stopped")]
    Closed,
}

impl WalError {
    pub(crate) fn io(op: &'static str, path: &Path, source: io::Error) -> WalError {
        WalError::Io { op, path: path.to_path_buf(), source: Arc::new(source) }
    }

    /// True when the cause is a full disk or quota (ENOSPC, EDQUOT): the HTTP layer
    /// answers 507 for these and 503 for other storage failures.
    pub fn is_storage_full(&self) -> bool {
        match self {
            WalError::Io { source, .. } => is_full(source),
            _ => false,
        }
    }
}

pub(crate) fn is_full(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded)
}

/// Encodes a record (frame + payload) ready to be written.
pub fn encode_record(r: &WalRecord<'_>) -> Result<Vec<u8>, WalError> {
    let table_len = u8::try_from(r.table.len()).map_err(|_| WalError::FieldTooLong("table"))?;
    let agent_len = u16::try_from(r.agent.len()).map_err(|_| WalError::FieldTooLong("agent"))?;
    let epoch_len = u16::try_from(r.epoch.len()).map_err(|_| WalError::FieldTooLong("epoch"))?;
    let payload_len = 1 + 1 + r.table.len() + 2 + r.agent.len() + 2 + r.epoch.len() + 8 + 8 + r.body.len();
    if payload_len > MAX_RECORD_BYTES {
        return Err(WalError::TooLarge(payload_len));
    }
    let mut out = Vec::with_capacity(FRAME_LEN + payload_len);
    out.extend_from_slice(&(payload_len as u32).to_le_bytes());
    out.extend_from_slice(&[0; 4]); // CRC, filled in below
    out.push(RECORD_VERSION);
    out.push(table_len);
    out.extend_from_slice(r.table.as_bytes());
    out.extend_from_slice(&agent_len.to_le_bytes());
    out.extend_from_slice(r.agent.as_bytes());
    out.extend_from_slice(&epoch_len.to_le_bytes());
    out.extend_from_slice(r.epoch.as_bytes());
    out.extend_from_slice(&r.sequence.to_le_bytes());
    out.extend_from_slice(&r.received_us.to_le_bytes());
    out.extend_from_slice(r.body);
    let crc = crc32c::crc32c(&out[FRAME_LEN..]);
    out[4..8].copy_from_slice(&crc.to_le_bytes());
    Ok(out)
}

/// Why a payload whose CRC matched still cannot be read (a record of a future format,
/// or a writer's bug): replay stops there rather than guess.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PayloadError {
    #[error("payload ends early (needs {needs} more bytes, has {has})")]
    Short { needs: usize, has: usize },
    #[error("unknown record version {0}")]
    Version(u8),
    #[error("{what} is not UTF-8: {source}")]
    Utf8 {
        what: &'static str,
        #[source]
        source: std::str::Utf8Error,
    },
}

/// The unread rest of a payload.
struct Payload<'a>(&'a [u8]);

impl<'a> Payload<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], PayloadError> {
        if self.0.len() < n {
            return Err(PayloadError::Short { needs: n, has: self.0.len() });
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    /// The little-endian unsigned integer in the next `n` (≤ 8) bytes.
    fn le(&mut self, n: usize) -> Result<u64, PayloadError> {
        Ok(self.take(n)?.iter().rev().fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
    }

    /// A string of `len_bytes`-byte little-endian length.
    fn string(&mut self, what: &'static str, len_bytes: usize) -> Result<String, PayloadError> {
        let len = self.le(len_bytes)? as usize;
        let b = self.take(len)?;
        std::str::from_utf8(b).map(str::to_owned).map_err(|source| PayloadError::Utf8 { what, source })
    }
}

/// Decodes a payload whose CRC already matched.
pub(crate) fn decode_payload(p: &[u8]) -> Result<WalEntry, PayloadError> {
    let mut cur = Payload(p);
    let version = cur.le(1)? as u8;
    if version != RECORD_VERSION {
        return Err(PayloadError::Version(version));
    }
    let table = cur.string("table", 1)?;
    let agent = cur.string("agent", 2)?;
    let epoch = cur.string("epoch", 2)?;
    let sequence = cur.le(8)?;
    let received_us = cur.le(8)? as i64;
    Ok(WalEntry { table, agent, epoch, sequence, received_us, body: cur.0.to_vec() })
}

/// The path of segment `seq` in `dir`.
pub fn segment_path(dir: &Path, seq: u64) -> PathBuf {
    dir.join(format!("{seq:016}.wal"))
}

/// The segments in `dir`, sorted by sequence number. Other files are ignored.
pub fn list_segments(dir: &Path) -> Result<Vec<(u64, PathBuf)>, WalError> {
    let mut out = Vec::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(WalError::io("list", dir, e)),
    };
    for entry in entries {
        let entry = entry.map_err(|e| WalError::io("list", dir, e))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(stem) = name.strip_suffix(".wal") else { continue };
        if stem.len() == 16
            && let Ok(seq) = stem.parse::<u64>()
        {
            out.push((seq, entry.path()));
        }
    }
    out.sort_unstable_by_key(|(seq, _)| *seq);
    Ok(out)
}

/// Tuning of the log.
#[derive(Clone, Copy, Debug)]
pub struct WalOptions {
    /// A segment is closed and a new one started once it would exceed this size.
    pub segment_bytes: u64,
}

impl Default for WalOptions {
    fn default() -> Self {
        WalOptions { segment_bytes: 64 << 20 }
    }
}

/// The appendable log. Appends from many threads are group-committed by one writer.
pub struct Wal {
    dir: PathBuf,
    tx: Option<mpsc::Sender<Command>>,
    thread: Option<JoinHandle<()>>,
    /// The segment the writer appends to now (or will create next); never truncated.
    active: Arc<AtomicU64>,
}

impl fmt::Debug for Wal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Wal").field("dir", &self.dir).field("active", &self.active).finish()
    }
}

impl Wal {
    /// Opens the log in `dir` for appending. New records go to a new segment after
    /// every existing one and after segment `persisted` (replay the existing ones
    /// first: [`Replay`]); the segment file is created on the first append.
    ///
    /// `persisted` matters when every segment has been deleted after a persist: a new
    /// segment must never reuse an id the checkpoint already counts as persisted.
    pub fn open(dir: &Path, options: WalOptions, io: Arc<dyn WalIo>, persisted: u64) -> Result<Wal, WalError> {
        crate::fsutil::create_dir_durable(dir).map_err(|e| WalError::io("create directory", dir, e))?;
        let last = list_segments(dir)?.last().map_or(0, |(seq, _)| *seq);
        let next = last.max(persisted) + 1;
        let active = Arc::new(AtomicU64::new(next));
        let (tx, rx) = mpsc::channel();
        let writer = Writer::new(dir.to_path_buf(), options, io, next, active.clone());
        let thread = std::thread::Builder::new()
            .name("apron-wal".into())
            .spawn(move || writer.run(rx))
            .map_err(|e| WalError::io("spawn writer thread", dir, e))?;
        Ok(Wal { dir: dir.to_path_buf(), tx: Some(tx), thread: Some(thread), active })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Appends one record and returns once it is durable (written and fsynced).
    pub fn append(&self, record: &WalRecord<'_>) -> Result<WalPosition, WalError> {
        let bytes = encode_record(record)?;
        let (ack, reply) = mpsc::sync_channel(1);
        self.send(Command::Append { bytes, ack })?;
        reply.recv().map_err(|_| WalError::Closed)?
    }

    /// Closes the current segment so that everything appended so far lies in segments
    /// `<=` the returned id and everything appended later in segments after it.
    pub fn roll(&self) -> Result<u64, WalError> {
        let (ack, reply) = mpsc::sync_channel(1);
        self.send(Command::Roll { ack })?;
        reply.recv().map_err(|_| WalError::Closed)?
    }

    /// Deletes every whole segment with id `<= through` (their records are persisted
    /// elsewhere). The active segment is never deleted. Returns how many were removed.
    pub fn truncate_through(&self, through: u64) -> Result<usize, WalError> {
        let active = self.active.load(Ordering::Acquire);
        let mut removed = 0;
        for (seq, path) in list_segments(&self.dir)? {
            if seq > through || seq >= active {
                break;
            }
            std::fs::remove_file(&path).map_err(|e| WalError::io("remove segment", &path, e))?;
            removed += 1;
        }
        if removed > 0 {
            crate::fsutil::sync_dir(&self.dir).map_err(|e| WalError::io("sync directory", &self.dir, e))?;
        }
        Ok(removed)
    }

    fn send(&self, c: Command) -> Result<(), WalError> {
        self.tx.as_ref().ok_or(WalError::Closed)?.send(c).map_err(|_| WalError::Closed)
    }
}

impl Drop for Wal {
    fn drop(&mut self) {
        // Closing the channel ends the writer after it answers what is queued.
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests;
