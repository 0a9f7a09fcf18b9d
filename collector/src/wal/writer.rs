//! The WAL writer thread: group commit, segment rolls, and recovery from failed writes.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender};

use super::{FORMAT_VERSION, HEADER_LEN, MAGIC, WalError, WalIo, WalOptions, WalPosition, segment_path};
use crate::wal::file::WalFile;

/// At most this many bytes are written per group, so one fsync's latency stays bounded
/// even when a burst of large batches arrives at once.
const GROUP_MAX_BYTES: usize = 16 << 20;

pub(super) enum Command {
    Append { bytes: Vec<u8>, ack: SyncSender<Result<WalPosition, WalError>> },
    Roll { ack: SyncSender<Result<u64, WalError>> },
}

struct Segment {
    seq: u64,
    path: PathBuf,
    file: Box<dyn WalFile>,
    /// Bytes known durable (header plus committed records).
    len: u64,
    records: u64,
}

/// Records of the current group not yet written: one buffer, one write, one fsync.
#[derive(Default)]
struct Pending {
    buf: Vec<u8>,
    acks: Vec<(SyncSender<Result<WalPosition, WalError>>, WalPosition)>,
}

pub(super) struct Writer {
    dir: PathBuf,
    options: WalOptions,
    io: Arc<dyn WalIo>,
    next_seq: u64,
    /// Shared with [`super::Wal::truncate_through`]: the lowest segment id this writer
    /// may still write to.
    active: Arc<AtomicU64>,
    /// `None` before the first append and after a failure that abandoned the segment.
    current: Option<Segment>,
}

impl Writer {
    pub(super) fn new(
        dir: PathBuf,
        options: WalOptions,
        io: Arc<dyn WalIo>,
        next_seq: u64,
        active: Arc<AtomicU64>,
    ) -> Writer {
        Writer { dir, options, io, next_seq, active, current: None }
    }

    pub(super) fn run(mut self, rx: Receiver<Command>) {
        while let Ok(first) = rx.recv() {
            let mut bytes = command_bytes(&first);
            let mut group = vec![first];
            // Everything that queued up while the previous fsync ran shares this one.
            while bytes < GROUP_MAX_BYTES {
                match rx.try_recv() {
                    Ok(c) => {
                        bytes += command_bytes(&c);
                        group.push(c);
                    }
                    Err(_) => break,
                }
            }
            self.process(group);
        }
    }

    fn process(&mut self, group: Vec<Command>) {
        let mut pending = Pending::default();
        for command in group {
            match command {
                Command::Append { bytes, ack } => self.stage(bytes, ack, &mut pending),
                Command::Roll { ack } => {
                    self.commit(&mut pending);
                    let _ = ack.send(Ok(self.roll()));
                }
            }
        }
        self.commit(&mut pending);
    }

    /// Adds one record to the group, rolling first if it would overflow the segment.
    fn stage(&mut self, bytes: Vec<u8>, ack: SyncSender<Result<WalPosition, WalError>>, pending: &mut Pending) {
        let full = match &self.current {
            None => true,
            Some(seg) => {
                let used = seg.records > 0 || !pending.acks.is_empty();
                used && seg.len + (pending.buf.len() + bytes.len()) as u64 > self.options.segment_bytes
            }
        };
        if full {
            self.commit(pending);
            self.close();
            if let Err(e) = self.open_segment() {
                let _ = ack.send(Err(e));
                return;
            }
        }
        let Some(seg) = &self.current else {
            let _ = ack.send(Err(WalError::Closed));
            return;
        };
        let end = seg.len + (pending.buf.len() + bytes.len()) as u64;
        pending.buf.extend_from_slice(&bytes);
        pending.acks.push((ack, WalPosition { segment: seg.seq, offset: end }));
    }

    /// Writes and fsyncs the group, then answers every appender in it.
    fn commit(&mut self, pending: &mut Pending) {
        if pending.acks.is_empty() {
            return;
        }
        let acks = std::mem::take(&mut pending.acks);
        let buf = std::mem::take(&mut pending.buf);
        let Some(seg) = self.current.as_mut() else {
            for (ack, _) in acks {
                let _ = ack.send(Err(WalError::Closed));
            }
            return;
        };
        let result = match seg.file.write_all(&buf) {
            Err(e) => Err(("write", e)),
            Ok(()) => seg.file.sync().map_err(|e| ("fsync", e)),
        };
        match result {
            Ok(()) => {
                seg.len += buf.len() as u64;
                seg.records += acks.len() as u64;
                for (ack, pos) in acks {
                    let _ = ack.send(Ok(pos));
                }
            }
            Err((op, e)) => {
                let err = WalError::io(op, &seg.path, e);
                // After a failed write, cutting back to the last committed length
                // restores a clean tail and the segment stays usable. After a failed
                // fsync the kernel may have dropped or kept any of it, so the segment
                // is abandoned; replay treats whatever it holds at the end as torn.
                let restored = op == "write" && seg.file.truncate(seg.len).is_ok();
                tracing::warn!(error = %err, restored, records = acks.len(), "WAL append failed");
                if !restored {
                    self.close();
                }
                for (ack, _) in acks {
                    let _ = ack.send(Err(err.clone()));
                }
            }
        }
    }

    /// Closes the current segment; returns the id of the last closed segment.
    fn roll(&mut self) -> u64 {
        match &self.current {
            // An empty segment can stay open: nothing in it needs separating.
            Some(seg) if seg.records == 0 => seg.seq - 1,
            Some(seg) => {
                let closed = seg.seq;
                self.close();
                closed
            }
            None => self.next_seq - 1,
        }
    }

    fn close(&mut self) {
        // Every committed record is already fsynced, so closing is just dropping.
        self.current = None;
        self.active.store(self.next_seq, Ordering::Release);
    }

    fn open_segment(&mut self) -> Result<(), WalError> {
        let seq = self.next_seq;
        // Burn the number even on failure, so a half-created file never blocks a retry.
        self.next_seq += 1;
        let path = segment_path(&self.dir, seq);
        let mut file = self.io.create(&path).map_err(|e| WalError::io("create segment", &path, e))?;
        let mut header = Vec::with_capacity(HEADER_LEN as usize);
        header.extend_from_slice(MAGIC);
        header.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        header.extend_from_slice(&[0; 4]);
        let made = file
            .write_all(&header)
            .and_then(|()| file.sync())
            .map_err(|e| WalError::io("write segment header", &path, e))
            .and_then(|()| self.io.sync_dir(&self.dir).map_err(|e| WalError::io("sync directory", &self.dir, e)));
        if let Err(e) = made {
            drop(file);
            let _ = std::fs::remove_file(&path);
            self.active.store(self.next_seq, Ordering::Release);
            return Err(e);
        }
        self.current = Some(Segment { seq, path, file, len: HEADER_LEN, records: 0 });
        self.active.store(seq, Ordering::Release);
        Ok(())
    }
}

fn command_bytes(c: &Command) -> usize {
    match c {
        Command::Append { bytes, .. } => bytes.len(),
        Command::Roll { .. } => 0,
    }
}
