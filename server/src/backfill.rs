//! `apron up`'s first start on a simulated fleet: the last hours of history, generated
//! at full speed, so reports and queries have something real to show at once.
//!
//! The rows come from the same simulator (same seed, same fleet) the live agent then
//! samples, and go through the same ingest path as an agent's batches — wire encoding,
//! WAL, memtable — under their own agent id and epoch, then are persisted to Parquet.
//! Processes are attributed by the same attribution code over the simulator's history
//! host.

use std::time::{Duration, Instant};

use apron_agent::attribution::{AttributionConfig, Attributor};
use apron_agent::source::sim::SimSource;
use apron_collector::{INGEST_PATIENCE, IngestRequest, Store};
use apron_common::UnixMicros;
use apron_common::wire::{Table, encode_ipc, processes_to_batch, windows_to_batch};

/// Rows per ingest request: well under the store's per-batch limits.
const CHUNK: usize = 20_000;

/// What was generated.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Backfilled {
    pub windows: u64,
    pub processes: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum BackfillError {
    #[error("encoding generated rows: {0}")]
    Encode(String),
    #[error("storing generated rows: {0}")]
    Ingest(String),
    #[error("persisting generated rows: {0}")]
    Persist(String),
}

/// Generates `span` of history ending at `end` and stores it; logs progress every tenth.
pub fn run(
    store: &Store,
    sim: &SimSource,
    end: UnixMicros,
    span: Duration,
    window: Duration,
) -> Result<Backfilled, BackfillError> {
    let started = Instant::now();
    let start = end.minus(span);
    // A fixed agent id and an epoch of its own: a second backfill of the same span would
    // be a different epoch, but `apron up` backfills only a new data directory.
    let agent = "apron-up-backfill";
    let epoch = format!("backfill-{}", end.0);
    let mut sequence = 0u64;
    let mut out = Backfilled::default();
    let mut send = |table: Table, body: Vec<u8>| -> Result<(), BackfillError> {
        sequence += 1;
        store
            .ingest_waiting(IngestRequest { table, agent, epoch: &epoch, sequence, body: &body }, INGEST_PATIENCE)
            .map_err(|e| BackfillError::Ingest(e.to_string()))?;
        Ok(())
    };

    let history = sim.history(start, end, window);
    let total = history.size_hint().0.max(1) as u64;
    let mut next_report = total / 10;
    let mut rows = Vec::with_capacity(CHUNK);
    for w in history {
        rows.push(w);
        if rows.len() == CHUNK {
            out.windows += rows.len() as u64;
            send(Table::GpuSamples, encode_windows(&rows)?)?;
            rows.clear();
            if out.windows >= next_report {
                tracing::info!("backfill: {}% of {total} GPU windows", out.windows * 100 / total);
                next_report += total / 10;
            }
        }
    }
    if !rows.is_empty() {
        out.windows += rows.len() as u64;
        send(Table::GpuSamples, encode_windows(&rows)?)?;
    }

    let host = sim.history_host();
    let attribution = Attributor::new(&AttributionConfig::default(), Box::new(host.clone()));
    let mut procs = Vec::with_capacity(CHUNK);
    for p in sim.process_history(&host, &attribution, start, end, Duration::from_secs(5)) {
        procs.push(p);
        if procs.len() == CHUNK {
            out.processes += procs.len() as u64;
            send(Table::GpuProcesses, encode_processes(&procs)?)?;
            procs.clear();
        }
    }
    if !procs.is_empty() {
        out.processes += procs.len() as u64;
        send(Table::GpuProcesses, encode_processes(&procs)?)?;
    }
    store.persist_now().map_err(|e| BackfillError::Persist(e.to_string()))?;
    tracing::info!(
        windows = out.windows,
        processes = out.processes,
        seconds = started.elapsed().as_secs_f64(),
        "backfill: stored {} of simulated history",
        humantime::format_duration(span)
    );
    Ok(out)
}

fn encode_windows(rows: &[apron_common::GpuWindow]) -> Result<Vec<u8>, BackfillError> {
    let batch = windows_to_batch(rows).map_err(|e| BackfillError::Encode(e.to_string()))?;
    encode_ipc(&batch).map_err(|e| BackfillError::Encode(e.to_string()))
}

fn encode_processes(rows: &[apron_common::ProcessRow]) -> Result<Vec<u8>, BackfillError> {
    let batch = processes_to_batch(rows).map_err(|e| BackfillError::Encode(e.to_string()))?;
    encode_ipc(&batch).map_err(|e| BackfillError::Encode(e.to_string()))
}
