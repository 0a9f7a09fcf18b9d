//! Shipping closed windows to the collector, with a bounded on-disk spool.
//!
//! ```text
//!  aggregation loop                      shipper thread
//!  ───────────────────────────────       ─────────────────────────────────────────────────
//!  ShipperSink (a WindowSink)            oldest first, from memory or spool ──► POST
//!   buffers windows + process rows        {collector}/api/v1/ingest
//!   every flush_interval: encode one        2xx ─────────────► done (spool file removed)
//!   Arrow IPC batch per table (split at     network error, timeout, 401, 429, 5xx
//!   max_batch_rows), give it the next         ─► Spool (this and every newer batch),
//!   sequence number                              retry the oldest after backoff + jitter
//!        │ try_send (bounded channel)        400 / 413 / 422 ─► spool_dir/rejected/
//!        ├──────────────────────────────►
//!        └─ channel full: straight to the Spool ◄── drained oldest first on recovery
//! ```
//!
//! - [`sink`]: [`ShipperSink`], which never blocks the aggregation loop: a full channel
//!   (the shipper stuck on a slow collector) sends the batch to the spool instead.
//! - [`shipper`]: the thread that sends in order and decides, per response, between
//!   done, retry (and spool) and reject.
//! - [`spool`]: a directory of `<epoch>-<seq>.<table>.arrows` files whose lexical order
//!   is the send order, written atomically (temp file, fsync, rename), bounded by
//!   `spool_max_bytes` by dropping the oldest first.
//! - [`client`]: one blocking HTTP request (ureq) and the meaning of its status code.
//! - [`backoff`]: exponential backoff with jitter.
//! - [`epoch`]: the per-process epoch id.
//!
//! Every batch keeps the epoch and sequence number it was given when it was encoded,
//! through spooling, retries and restarts, so the collector drops retried duplicates on
//! (agent, epoch, sequence). The protocol is written down in `docs/ingest.md`.

pub mod backoff;
pub mod client;
pub mod epoch;
pub mod shipper;
pub mod sink;
pub mod spool;

use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use apron_common::wire::Table;

pub use sink::ShipperSink;
pub use spool::Spool;

use crate::config::ShipperConfig;
use crate::exposition::{SharedState, ShipStats};

/// How many encoded batches wait between the sink and the shipper thread (about a
/// minute and a half at the default flush interval, two tables per flush).
pub const CHANNEL_CAPACITY: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum ShipError {
    #[error(transparent)]
    Spool(#[from] spool::SpoolError),
    #[error("cannot start the shipper thread: {0}")]
    Thread(std::io::Error),
}

/// One request's worth of rows, encoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    pub epoch: Arc<str>,
    pub seq: u64,
    pub table: Table,
    pub rows: usize,
    /// An Arrow IPC stream with zstd-compressed buffers (`wire::encode_ipc`).
    pub body: Vec<u8>,
}

impl Batch {
    /// `<epoch>-<seq, 20 digits>.<table>.arrows`: lexical order is send order, within
    /// an epoch by the zero-padded sequence and across epochs because epochs start
    /// with their creation time.
    pub fn file_name(&self) -> String {
        file_name(&self.epoch, self.seq, self.table)
    }
}

pub fn file_name(epoch: &str, seq: u64, table: Table) -> String {
    format!("{epoch}-{seq:020}.{}.arrows", table.name())
}

/// The (epoch, sequence, table) a spool file name carries; `None` for any other name.
pub fn parse_file_name(name: &str) -> Option<(String, u64, Table)> {
    let stem = name.strip_suffix(".arrows")?;
    let (key, table) = stem.rsplit_once('.')?;
    let table = Table::from_name(table)?;
    let (epoch, seq) = key.rsplit_once('-')?;
    if seq.len() != 20 || !seq.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if epoch.is_empty() || !epoch.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-') {
        return None;
    }
    Some((epoch.to_owned(), seq.parse().ok()?, table))
}

/// The spool, shared by the sink (overflow) and the shipper thread.
#[derive(Clone)]
pub struct SharedSpool(Arc<Mutex<Spool>>);

impl SharedSpool {
    pub fn new(spool: Spool) -> Self {
        Self(Arc::new(Mutex::new(spool)))
    }

    /// A poisoned lock means a panic mid-operation; the index is rebuilt from the
    /// directory on the next start, and meanwhile the one we have is the best there is.
    pub fn lock(&self) -> MutexGuard<'_, Spool> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Updates the agent's shipping counters. Callers holding the spool lock may call this
/// (the order is always spool, then state).
pub(crate) fn with_stats(state: &SharedState, f: impl FnOnce(&mut ShipStats)) {
    let mut st = state.lock();
    f(st.ship.get_or_insert_with(ShipStats::default));
}

/// Publishes the spool's size after a change.
pub(crate) fn publish_spool(state: &SharedState, spool: &Spool, dropped: spool::Dropped) {
    with_stats(state, |s| {
        s.spool_bytes = spool.bytes();
        s.spool_files = spool.files() as u64;
        s.spool_dropped_batches += dropped.batches;
        s.spool_dropped_rows += dropped.rows;
    });
}

/// Opens the spool and starts the shipper thread; returns the sink for the aggregation
/// loop and the thread's handle (it exits once the sink is dropped and the last
/// batches are sent or spooled).
pub fn start(config: &ShipperConfig, state: SharedState) -> Result<(ShipperSink, JoinHandle<()>), ShipError> {
    let (spool, dropped) = Spool::open(&config.spool_dir, config.spool_max_bytes)?;
    if spool.files() > 0 {
        tracing::info!(
            dir = %config.spool_dir.display(),
            files = spool.files(),
            bytes = spool.bytes(),
            "found spooled batches from an earlier run; they are sent first"
        );
    }
    publish_spool(&state, &spool, dropped);
    let spool = SharedSpool::new(spool);
    let epoch: Arc<str> = epoch::new_epoch().into();
    let (tx, rx) = std::sync::mpsc::sync_channel(CHANNEL_CAPACITY);
    let shipper = shipper::Shipper::new(config, rx, spool.clone(), state.clone(), epoch::random_u64());
    let handle =
        std::thread::Builder::new().name("shipper".into()).spawn(move || shipper.run()).map_err(ShipError::Thread)?;
    tracing::info!(
        collector = %config.collector,
        agent_id = %config.agent_id,
        epoch = %epoch,
        flush_interval = %humantime::format_duration(config.flush_interval),
        "shipping windows"
    );
    Ok((ShipperSink::new(config, epoch, tx, spool, state, epoch::random_u64()), handle))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_round_trip_and_sort_by_sequence() {
        let e = "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b";
        let a = file_name(e, 9, Table::GpuSamples);
        let b = file_name(e, 10, Table::GpuProcesses);
        assert!(a < b, "{a} < {b}");
        assert_eq!(parse_file_name(&a), Some((e.to_owned(), 9, Table::GpuSamples)));
        assert_eq!(parse_file_name(&b), Some((e.to_owned(), 10, Table::GpuProcesses)));
        for bad in [
            "x.arrows",
            &format!("{e}-9.gpu_samples.arrows"),
            &format!("{e}-00000000000000000009.gpu_things.arrows"),
            &format!("{a}.tmp"),
        ] {
            assert_eq!(parse_file_name(bad), None, "{bad}");
        }
    }
}
