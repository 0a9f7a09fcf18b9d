//! `apron import FILE…`: dcgm-exporter history (Prometheus / OpenMetrics text with
//! timestamps, Prometheus `query_range` JSON) into `gpu_samples`, through the same
//! ingest path agents use.
//!
//! ```text
//!  files ─► apron_import::Importer (one history across files; point samples → windows)
//!        ─► batches of ≤ 50 000 rows, in (GPU, time) order
//!        ─► drop rows whose window overlaps data already stored for that GPU (agent or
//!           scrape data wins over an import for the same GPU and time)
//!        ─► Store::ingest as agent "import", epoch = a hash of the files' contents,
//!           sequence = batch number: importing the same files again is a no-op (the
//!           collector's (agent, epoch, sequence) dedup)
//!        ─► persist; the cost ledger of the next `apron up` / `apron serve` prices it
//! ```
//!
//! The data directory must not be open in a running server (the store's lock says so).

use std::sync::Arc;

use apron_collector::{INGEST_PATIENCE, IngestRequest, Store, Table};
use apron_common::GpuWindow;
use apron_common::wire::{encode_ipc, windows_to_batch};
use apron_import::{ImportOptions, ImportOutcome, Importer};
use apron_query::QueryEngine;
use datafusion::arrow::array::AsArray;
use datafusion::arrow::datatypes::{Float64Type, TimestampMicrosecondType};

use crate::ledger::{sql_str, ts};

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

/// FNV-1a over the inputs, their lengths included: the same files give the same epoch.
fn epoch(inputs: &[(String, Vec<u8>)]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (_, bytes) in inputs {
        for b in (bytes.len() as u64).to_le_bytes().iter().chain(bytes.iter()) {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    format!("import-{h:016x}")
}

/// Time already covered for one GPU, as sorted `(start, end]` intervals in µs.
async fn covered(engine: &QueryEngine, gpu: &str, from: i64, to: i64) -> Result<Vec<(i64, i64)>, String> {
    let sql = format!(
        "SELECT time, window_s FROM gpu_samples WHERE gpu_uuid = {} AND time > {} AND time <= {} ORDER BY time",
        sql_str(gpu),
        ts(from),
        // A window ending up to a day later may still reach back into the range.
        ts(to + 86_400_000_000)
    );
    let batches = engine.execute_internal(&sql).await.map_err(|e| format!("{e} (in: {sql})"))?.batches;
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
) -> Result<Stored, String> {
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
    let batch = windows_to_batch(&keep).map_err(|e| e.to_string())?;
    let body = encode_ipc(&batch).map_err(|e| e.to_string())?;
    let (store, agent, epoch) = (store.clone(), agent.to_owned(), epoch.to_owned());
    let n = keep.len();
    let outcome = tokio::task::spawn_blocking(move || {
        let req = IngestRequest { table: Table::GpuSamples, agent: &agent, epoch: &epoch, sequence, body: &body };
        store.ingest_waiting(req, INGEST_PATIENCE)
    })
    .await
    .map_err(|e| e.to_string())?
    .map_err(|e| e.to_string())?;
    if outcome.duplicate {
        out.duplicate = n;
    } else {
        out.stored = n;
    }
    Ok(out)
}

/// Imports `inputs` (name, bytes) into `store`; `progress` hears one line per step.
pub async fn run(
    store: Arc<Store>,
    engine: Arc<QueryEngine>,
    inputs: Vec<(String, Vec<u8>)>,
    options: ImportOptions,
    mut progress: impl FnMut(String),
) -> Result<ImportReport, String> {
    let epoch = epoch(&inputs);
    let mut importer = Importer::new(options).map_err(|e| e.to_string())?;
    for (name, bytes) in &inputs {
        let format = importer.add(bytes, None).map_err(|e| format!("{name}: {e}"))?;
        progress(format!("read {name} ({}, {} bytes)", format.as_str(), bytes.len()));
    }
    let mut batches: Vec<Vec<GpuWindow>> = Vec::new();
    let outcome = importer
        .finish_in_batches(BATCH_ROWS, |rows| {
            batches.push(rows);
            Ok::<(), String>(())
        })
        .map_err(|e| e.to_string())?;
    let mut report = ImportReport { outcome, epoch: epoch.clone(), ..ImportReport::default() };
    let total: usize = batches.iter().map(Vec::len).sum();
    let (from, to) = (report.outcome.first_us.map_or(0, |t| t.0), report.outcome.last_us.map_or(0, |t| t.0));
    let mut done = 0usize;
    for (sequence, rows) in batches.into_iter().enumerate() {
        let n = rows.len();
        let s = store_windows(&store, &engine, rows, (from, to), IMPORT_AGENT, &epoch, sequence as u64).await?;
        report.overlapping += s.overlapping;
        report.stored += s.stored;
        report.already_imported += s.duplicate;
        done += n;
        progress(format!("stored {done}/{total} rows"));
    }
    let s = store.clone();
    tokio::task::spawn_blocking(move || s.persist_now())
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    Ok(report)
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
