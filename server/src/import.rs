//! `apron import FILE…`: dcgm-exporter history (Prometheus / OpenMetrics text with
//! timestamps, Prometheus `query_range` JSON) into `gpu_samples`, through the same
//! ingest path agents use.
//!
//! ```text
//!  files ─► apron_import::Importer (one history across files; point samples → windows;
//!           read a line at a time on a blocking thread, samples past a budget spilled
//!           to an unnamed temp file in the data directory)
//!        ─► batches of ≤ 50 000 rows, in (GPU, time) order, through a channel of two
//!        ─► drop rows whose window overlaps data already stored for that GPU (agent or
//!           scrape data wins over an import for the same GPU and time)
//!        ─► Store::ingest as agent "import", epoch = a hash of the files' contents,
//!           sequence = batch number: importing the same files again is a no-op (the
//!           collector's (agent, epoch, sequence) dedup)
//!        ─► persist; the cost ledger of the next `apron up` / `apron serve` prices it
//! ```
//!
//! The data directory must not be open in a running server (the store's lock says so).

use std::path::PathBuf;
use std::sync::Arc;

use apron_collector::{INGEST_PATIENCE, IngestRequest, Store, Table};
use apron_common::GpuWindow;
use apron_common::wire::{encode_ipc, windows_to_batch};
use apron_import::{Format, ImportOptions, ImportOutcome, Importer};
use apron_query::QueryEngine;
use datafusion::arrow::array::AsArray;
use datafusion::arrow::datatypes::{Float64Type, TimestampMicrosecondType};

use crate::sqlutil::{SqlError, sql_str, ts};

/// Why an import (or a scrape, remote write or OTLP batch, which store through the same
/// path) stopped. Rows stored before it stay stored; a retry stores nothing twice.
#[derive(Debug, thiserror::Error)]
pub enum StoreImportError {
    #[error(transparent)]
    Sql(#[from] SqlError),
    #[error("{0}")]
    Import(#[from] apron_import::ImportError),
    #[error("{name}: {detail}")]
    Input { name: String, detail: String },
    #[error("encoding the rows: {0}")]
    Encode(String),
    #[error("storing: {0}")]
    Store(String),
    #[error("creating a spill file in {}: {detail}", dir.display())]
    Spill { dir: PathBuf, detail: String },
    #[error("import: {0}")]
    Pipeline(&'static str),
}

/// The agent id imported batches are stored under.
pub const IMPORT_AGENT: &str = "import";
const BATCH_ROWS: usize = 50_000;

/// What an import did.
#[derive(Debug, Clone, Default)]
pub struct ImportReport {
    pub outcome: ImportOutcome,
    /// Rows stored now.
    pub stored: usize,
    /// Rows already stored by an earlier import of the same files.
    pub already_imported: usize,
    /// Rows dropped because data was already stored for that GPU and time.
    pub overlapping: usize,
    pub epoch: String,
}

#[cfg(test)]
fn epoch(inputs: &[(String, Vec<u8>)]) -> String {
    let mut h = Fnv::new();
    for (_, bytes) in inputs {
        h.whole(bytes);
    }
    h.epoch()
}

/// Time already covered for one GPU, as sorted `(start, end]` intervals in µs.
async fn covered(engine: &QueryEngine, gpu: &str, from: i64, to: i64) -> Result<Vec<(i64, i64)>, StoreImportError> {
    let sql = format!(
        "SELECT time, window_s FROM gpu_samples WHERE gpu_uuid = {} AND time > {} AND time <= {} ORDER BY time",
        sql_str(gpu),
        ts(from),
        // A window ending up to a day later may still reach back into the range.
        ts(to + 86_400_000_000)
    );
    let batches = crate::sqlutil::batches(engine, &sql).await?;
    let mut out = Vec::new();
    for b in &batches {
        let (t, w) =
            (b.column(0).as_primitive::<TimestampMicrosecondType>(), b.column(1).as_primitive::<Float64Type>());
        for r in 0..b.num_rows() {
            let end = t.value(r);
            out.push((end - (w.value(r) * 1e6).round() as i64, end));
        }
    }
    Ok(out)
}

fn overlaps(iv: &[(i64, i64)], start: i64, end: i64) -> bool {
    // First interval ending after `start`; it overlaps when it begins before `end`.
    let i = iv.partition_point(|(_, e)| *e <= start);
    iv.get(i).is_some_and(|(s, _)| *s < end)
}

/// What [`store_windows`] did with one batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stored {
    pub stored: usize,
    /// Already stored under this (agent, epoch, sequence).
    pub duplicate: usize,
    /// Dropped: data already covers that GPU and time.
    pub overlapping: usize,
}

/// Stores `rows` (sorted by GPU, then time) as one ingest batch of `agent`, leaving out
/// every window that overlaps data already stored for its GPU in `range` (µs): what an
/// agent (or anything before) stored wins. Shared by `apron import` and `[[scrape]]`.
pub(crate) async fn store_windows(
    store: &Arc<Store>,
    engine: &QueryEngine,
    rows: Vec<GpuWindow>,
    range: (i64, i64),
    agent: &str,
    epoch: &str,
    sequence: u64,
) -> Result<Stored, StoreImportError> {
    let mut out = Stored::default();
    let mut coverage: Option<(String, Vec<(i64, i64)>)> = None;
    let mut keep = Vec::with_capacity(rows.len());
    for w in rows {
        let gpu = w.gpu.gpu_uuid.as_str().to_owned();
        if coverage.as_ref().is_none_or(|(g, _)| *g != gpu) {
            let mut iv = covered(engine, &gpu, range.0, range.1).await?;
            iv.sort_unstable();
            coverage = Some((gpu.clone(), iv));
        }
        let iv = coverage.as_ref().map(|(_, iv)| iv.as_slice()).unwrap_or_default();
        let end = w.time.0;
        let start = end - i64::try_from(w.window.as_micros()).unwrap_or(i64::MAX);
        if overlaps(iv, start, end) {
            out.overlapping += 1;
        } else {
            keep.push(w);
        }
    }
    if keep.is_empty() {
        return Ok(out);
    }
    let batch = windows_to_batch(&keep).map_err(|e| StoreImportError::Encode(e.to_string()))?;
    let body = encode_ipc(&batch).map_err(|e| StoreImportError::Encode(e.to_string()))?;
    let (store, agent, epoch) = (store.clone(), agent.to_owned(), epoch.to_owned());
    let n = keep.len();
    let outcome = tokio::task::spawn_blocking(move || {
        let req = IngestRequest { table: Table::GpuSamples, agent: &agent, epoch: &epoch, sequence, body: &body };
        store.ingest_waiting(req, INGEST_PATIENCE)
    })
    .await
    .map_err(|e| StoreImportError::Store(e.to_string()))?
    .map_err(|e| StoreImportError::Store(e.to_string()))?;
    if outcome.duplicate {
        out.duplicate = n;
    } else {
        out.stored = n;
    }
    Ok(out)
}

/// One input of an import.
#[derive(Debug)]
pub enum Input {
    /// Bytes already in memory (an upload, a test), with a name for messages.
    Bytes { name: String, bytes: Vec<u8> },
    /// A file, read a line at a time (text) so its size does not matter.
    File(PathBuf),
}

/// Samples an import holds in memory before it spills them to a temporary file in the
/// spill directory (24 B each in memory, 21 B on disk): about 100 MiB.
pub const SPILL_POINTS: usize = 4 << 20;

/// What the reading thread tells the storing task.
enum Msg {
    Progress(String),
    /// Every input is read: the epoch and the time bounds of every row to come.
    Ready {
        epoch: String,
        from: i64,
        to: i64,
    },
    Batch(Vec<GpuWindow>),
}

/// Why the reading thread stopped early.
enum Stop {
    Import(apron_import::ImportError),
    /// The storing side gave up (its error is the one reported).
    Closed,
}

impl From<apron_import::ImportError> for Stop {
    fn from(e: apron_import::ImportError) -> Self {
        Stop::Import(e)
    }
}

/// Imports `inputs` (name, bytes) into `store`; `progress` hears one line per step.
pub async fn run(
    store: Arc<Store>,
    engine: Arc<QueryEngine>,
    inputs: Vec<(String, Vec<u8>)>,
    options: ImportOptions,
    progress: impl FnMut(String),
) -> Result<ImportReport, StoreImportError> {
    let inputs = inputs.into_iter().map(|(name, bytes)| Input::Bytes { name, bytes }).collect();
    run_inputs(store, engine, inputs, options, None, progress).await
}

/// Imports `inputs` into `store`, streaming: files are read a line at a time on a
/// blocking thread, samples past [`SPILL_POINTS`] go to an unnamed temporary file in
/// `spill.0` (when given; `spill.1` is the budget, normally [`SPILL_POINTS`]), and rows reach the store in batches of 50,000 through a
/// channel of two — so memory does not depend on the size of the inputs.
pub async fn run_inputs(
    store: Arc<Store>,
    engine: Arc<QueryEngine>,
    inputs: Vec<Input>,
    options: ImportOptions,
    spill: Option<(PathBuf, usize)>,
    mut progress: impl FnMut(String),
) -> Result<ImportReport, StoreImportError> {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Msg>(2);
    let reader = tokio::task::spawn_blocking(move || read_inputs(inputs, options, spill, &tx));
    let mut report = ImportReport::default();
    let mut ready: Option<(String, i64, i64)> = None;
    let (mut sequence, mut done) = (0u64, 0usize);
    while let Some(msg) = rx.recv().await {
        match msg {
            Msg::Progress(line) => progress(line),
            Msg::Ready { epoch, from, to } => ready = Some((epoch, from, to)),
            Msg::Batch(rows) => {
                let Some((epoch, from, to)) = &ready else {
                    return Err(StoreImportError::Pipeline("rows before the inputs were read"));
                };
                let n = rows.len();
                let s = store_windows(&store, &engine, rows, (*from, *to), IMPORT_AGENT, epoch, sequence).await?;
                sequence += 1;
                report.overlapping += s.overlapping;
                report.stored += s.stored;
                report.already_imported += s.duplicate;
                done += n;
                // Progress counts rows handled; the summary says how many were stored
                // and why the rest were skipped (a re-import stores none).
                progress(format!("{done} rows handled, {} stored so far", report.stored));
            }
        }
    }
    report.outcome = reader.await.map_err(|e| StoreImportError::Store(e.to_string()))??;
    report.epoch = ready.map(|(epoch, ..)| epoch).unwrap_or_default();
    let s = store.clone();
    tokio::task::spawn_blocking(move || s.persist_now())
        .await
        .map_err(|e| StoreImportError::Store(e.to_string()))?
        .map_err(|e| StoreImportError::Store(e.to_string()))?;
    Ok(report)
}

/// The reading thread: every input into one importer, then its rows to `tx`.
fn read_inputs(
    inputs: Vec<Input>,
    options: ImportOptions,
    spill: Option<(PathBuf, usize)>,
    tx: &tokio::sync::mpsc::Sender<Msg>,
) -> Result<ImportOutcome, StoreImportError> {
    let say = |line: String| {
        let _ = tx.blocking_send(Msg::Progress(line));
    };
    let mut importer = Importer::new(options)?;
    if let Some((dir, max_points)) = spill {
        let file = tempfile::tempfile_in(&dir)
            .map_err(|e| StoreImportError::Spill { dir: dir.clone(), detail: e.to_string() })?;
        importer.spill_to(file, max_points);
    }
    let mut epoch = Fnv::new();
    for input in inputs {
        match input {
            Input::Bytes { name, bytes } => {
                epoch.whole(&bytes);
                let format = importer
                    .add(&bytes, None)
                    .map_err(|e| StoreImportError::Input { name: name.clone(), detail: e.to_string() })?;
                say(format!("read {name} ({}, {} bytes)", format.as_str(), bytes.len()));
            }
            Input::File(path) => {
                let name = path.display().to_string();
                let io = |e: std::io::Error| StoreImportError::Input { name: name.clone(), detail: e.to_string() };
                let mut file = std::fs::File::open(&path).map_err(io)?;
                let len = file.metadata().map_err(io)?.len();
                let format = detect_file(&mut file, len).map_err(io)?;
                epoch.input(len);
                let reader = std::io::BufReader::with_capacity(1 << 20, Hashing { inner: file, fnv: &mut epoch });
                importer
                    .add_reader(reader, format)
                    .map_err(|e| StoreImportError::Input { name: name.clone(), detail: e.to_string() })?;
                say(format!("read {name} ({}, {len} bytes)", format.as_str()));
            }
        }
    }
    let (from, to) = importer.time_bounds().map_or((0, 0), |(a, b)| (a.0, b.0));
    if tx.blocking_send(Msg::Ready { epoch: epoch.epoch(), from, to }).is_err() {
        return Err(StoreImportError::Pipeline("the storing side stopped"));
    }
    let outcome =
        importer.finish_in_batches(BATCH_ROWS, |rows| tx.blocking_send(Msg::Batch(rows)).map_err(|_| Stop::Closed));
    match outcome {
        Ok(o) => Ok(o),
        Err(Stop::Import(e)) => Err(e.into()),
        // The storing side's own error is what the caller sees.
        Err(Stop::Closed) => Err(StoreImportError::Pipeline("the storing side stopped")),
    }
}

/// The format of a file from its first 64 KiB and its last bytes (JSON opens with `[`
/// or `{"`; OpenMetrics ends with `# EOF`), leaving the file at its start.
fn detect_file(file: &mut std::fs::File, len: u64) -> std::io::Result<Format> {
    use std::io::{Read, Seek, SeekFrom};
    let mut probe = Vec::new();
    file.by_ref().take(64 << 10).read_to_end(&mut probe)?;
    if len > probe.len() as u64 {
        file.seek(SeekFrom::Start(len.saturating_sub(64)))?;
        file.by_ref().take(64).read_to_end(&mut probe)?;
    }
    file.seek(SeekFrom::Start(0))?;
    Ok(Format::detect(&probe))
}

/// FNV-1a over the inputs, each as its length then its bytes: the same files give the
/// same epoch, so importing them again is a no-op (the store's dedup).
struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    /// The start of an input of `len` bytes (its bytes follow through [`Fnv::update`]).
    fn input(&mut self, len: u64) {
        self.update(&len.to_le_bytes());
    }

    /// A whole input held in memory.
    fn whole(&mut self, bytes: &[u8]) {
        self.input(bytes.len() as u64);
        self.update(bytes);
    }

    fn update(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }

    fn epoch(&self) -> String {
        format!("import-{:016x}", self.0)
    }
}

/// A reader that feeds what passes through it to the epoch hash.
struct Hashing<'a, R> {
    inner: R,
    fnv: &'a mut Fnv,
}

impl<R: std::io::Read> std::io::Read for Hashing<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.fnv.update(buf.get(..n).unwrap_or_default());
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_is_half_open_on_both_sides() {
        let iv = [(10, 20), (30, 40)];
        assert!(!overlaps(&iv, 0, 10));
        assert!(overlaps(&iv, 5, 11));
        assert!(!overlaps(&iv, 20, 30));
        assert!(overlaps(&iv, 39, 50));
        assert!(!overlaps(&iv, 40, 50));
        assert_eq!(epoch(&[("a".into(), b"x".to_vec())]), epoch(&[("b".into(), b"x".to_vec())]));
        assert_ne!(epoch(&[("a".into(), b"x".to_vec())]), epoch(&[("a".into(), b"y".to_vec())]));
    }
}
