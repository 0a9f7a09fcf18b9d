//! Reading the log back at start-up, cutting torn tails.

use std::collections::VecDeque;
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};

use super::{
    FORMAT_VERSION, FRAME_LEN, HEADER_LEN, MAGIC, MAX_RECORD_BYTES, WalEntry, WalError, WalPosition, decode_payload,
    list_segments,
};

/// The smallest valid payload: version, table length, agent length, epoch length,
/// sequence, receive time. Anything shorter (a zero-filled tail reads as length 0,
/// CRC 0) is torn.
const MIN_PAYLOAD: usize = 1 + 1 + 2 + 2 + 8 + 8;

/// What replay found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReplayReport {
    /// Segments read.
    pub segments: usize,
    /// Valid records read.
    pub records: u64,
    /// Bytes cut from torn tails (records a crash interrupted; never acknowledged).
    pub torn_bytes: u64,
    /// Segments that had a torn tail (cut) or a torn header (removed).
    pub torn_segments: Vec<PathBuf>,
}

struct Open {
    seq: u64,
    path: PathBuf,
    data: Vec<u8>,
    offset: usize,
}

/// Yields the records of every segment after a given id, in order.
pub struct Replay {
    dir: PathBuf,
    pending: VecDeque<(u64, PathBuf)>,
    current: Option<Open>,
    report: ReplayReport,
}

impl std::fmt::Debug for Replay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replay").field("dir", &self.dir).field("report", &self.report).finish()
    }
}

impl Replay {
    /// Replays the segments in `dir` whose id is greater than `after` (those `<= after`
    /// are already persisted elsewhere).
    pub fn open(dir: &Path, after: u64) -> Result<Replay, WalError> {
        let pending = list_segments(dir)?.into_iter().filter(|(seq, _)| *seq > after).collect();
        Ok(Replay { dir: dir.to_path_buf(), pending, current: None, report: ReplayReport::default() })
    }

    pub fn report(&self) -> &ReplayReport {
        &self.report
    }

    /// The next record and the position where it ends, or `None` at the end of the log.
    pub fn next_entry(&mut self) -> Result<Option<(WalPosition, WalEntry)>, WalError> {
        loop {
            let Some(open) = self.current.as_mut() else {
                let Some((seq, path)) = self.pending.pop_front() else {
                    return Ok(None);
                };
                self.current = self.open_segment(seq, path)?;
                continue;
            };
            let rest = &open.data[open.offset..];
            if rest.is_empty() {
                self.current = None;
                continue;
            }
            let Some(payload_len) = frame_len(rest) else {
                let open = self.current.take().ok_or(WalError::Closed)?;
                self.cut(open)?;
                continue;
            };
            let start = open.offset + FRAME_LEN;
            let payload = &open.data[start..start + payload_len];
            let entry = decode_payload(payload).map_err(|detail| WalError::Undecodable {
                path: open.path.clone(),
                offset: open.offset as u64,
                detail,
            })?;
            open.offset = start + payload_len;
            self.report.records += 1;
            return Ok(Some((WalPosition { segment: open.seq, offset: open.offset as u64 }, entry)));
        }
    }

    fn open_segment(&mut self, seq: u64, path: PathBuf) -> Result<Option<Open>, WalError> {
        let data = std::fs::read(&path).map_err(|e| WalError::io("read segment", &path, e))?;
        let header = HEADER_LEN as usize;
        // A crash while the segment was being created leaves a short or zero header;
        // nothing in such a file was ever acknowledged.
        if data.len() < header || data[..header].iter().all(|&b| b == 0) {
            tracing::warn!(path = %path.display(), bytes = data.len(), "removing WAL segment with a torn header");
            std::fs::remove_file(&path).map_err(|e| WalError::io("remove torn segment", &path, e))?;
            crate::fsutil::sync_dir(&self.dir).map_err(|e| WalError::io("sync directory", &self.dir, e))?;
            self.report.torn_bytes += data.len() as u64;
            self.report.torn_segments.push(path);
            return Ok(None);
        }
        let version = u32::from_le_bytes([data[8], data[9], data[10], data[11]]);
        if &data[..8] != MAGIC || version != FORMAT_VERSION {
            return Err(WalError::BadHeader { path });
        }
        self.report.segments += 1;
        Ok(Some(Open { seq, path, data, offset: header }))
    }

    /// Cuts a segment at its current offset: the rest is a torn record.
    fn cut(&mut self, open: Open) -> Result<(), WalError> {
        let dropped = (open.data.len() - open.offset) as u64;
        tracing::warn!(
            path = %open.path.display(),
            offset = open.offset,
            dropped,
            "WAL segment has a torn tail (a record cut by a crash or failed write); truncating it"
        );
        let f = OpenOptions::new().write(true).open(&open.path).map_err(|e| WalError::io("open", &open.path, e))?;
        f.set_len(open.offset as u64).map_err(|e| WalError::io("truncate", &open.path, e))?;
        f.sync_all().map_err(|e| WalError::io("fsync", &open.path, e))?;
        self.report.torn_bytes += dropped;
        self.report.torn_segments.push(open.path);
        Ok(())
    }
}

/// The payload length of the record at the start of `rest`, if it is whole and its CRC
/// matches; `None` means torn.
fn frame_len(rest: &[u8]) -> Option<usize> {
    if rest.len() < FRAME_LEN {
        return None;
    }
    let len = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
    let crc = u32::from_le_bytes([rest[4], rest[5], rest[6], rest[7]]);
    if !(MIN_PAYLOAD..=MAX_RECORD_BYTES).contains(&len) || rest.len() - FRAME_LEN < len {
        return None;
    }
    (crc32c::crc32c(&rest[FRAME_LEN..FRAME_LEN + len]) == crc).then_some(len)
}
