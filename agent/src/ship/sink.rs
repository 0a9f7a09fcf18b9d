//! [`ShipperSink`]: the aggregation loop's end of shipping.
//!
//! It runs on the aggregation thread, so it must never wait on the network: it buffers
//! rows, and at the first window close in each new `flush_interval` slot (and at
//! shutdown, when the sink is dropped) it encodes one batch per table — more when a
//! table holds over `max_batch_rows` — and offers each to the shipper thread.
//!
//! Slots are on a fixed grid (Unix time, shifted by a random phase per process) rather
//! than "interval since the last flush": windows close on a grid too, a few
//! milliseconds late, so "5 s since the last flush" would often fall just short and
//! flush every 6 s instead. The random phase spreads a fleet's requests over the
//! interval instead of every agent posting in the same instant. If the
//! channel is full (the shipper is stuck on a slow collector) the batch goes straight to
//! the spool: a short local write instead of a wait.

use std::sync::Arc;
use std::sync::mpsc::{SyncSender, TrySendError};

use apron_common::wire::{self, Table};
use apron_common::{GpuWindow, ProcessRow, UnixMicros};

use super::{Batch, SharedSpool, publish_spool, with_stats};
use crate::config::ShipperConfig;
use crate::exposition::SharedState;
use crate::runtime::WindowSink;

pub struct ShipperSink {
    windows: Vec<GpuWindow>,
    processes: Vec<ProcessRow>,
    /// Flush slots: `(now - phase) / interval`, in µs.
    interval_us: i64,
    phase_us: i64,
    last_slot: i64,
    max_batch_rows: usize,
    epoch: Arc<str>,
    /// The next request's sequence number: per epoch, from 1, shared by both tables.
    next_seq: u64,
    tx: Option<SyncSender<Batch>>,
    spool: SharedSpool,
    state: SharedState,
    spool_error_logged: bool,
}

impl ShipperSink {
    pub fn new(
        config: &ShipperConfig,
        epoch: Arc<str>,
        tx: SyncSender<Batch>,
        spool: SharedSpool,
        state: SharedState,
        phase_seed: u64,
    ) -> Self {
        let interval_us = i64::try_from(config.flush_interval.as_micros()).unwrap_or(i64::MAX).max(1);
        let phase_us = i64::try_from(phase_seed % interval_us.unsigned_abs()).unwrap_or(0);
        Self {
            windows: Vec::new(),
            processes: Vec::new(),
            interval_us,
            phase_us,
            last_slot: slot(UnixMicros::now(), interval_us, phase_us),
            max_batch_rows: config.max_batch_rows.max(1),
            epoch,
            next_seq: 1,
            tx: Some(tx),
            spool,
            state,
            spool_error_logged: false,
        }
    }

    /// Encodes everything buffered and hands it on.
    pub fn flush(&mut self) -> std::io::Result<()> {
        let windows = std::mem::take(&mut self.windows);
        let processes = std::mem::take(&mut self.processes);
        let mut result = Ok(());
        for chunk in windows.chunks(self.max_batch_rows) {
            let body =
                wire::windows_to_batch(chunk).map_err(wire::WireError::Encode).and_then(|b| wire::encode_ipc(&b));
            result = result.and(self.hand_over(Table::GpuSamples, chunk.len(), body));
        }
        for chunk in processes.chunks(self.max_batch_rows) {
            let body =
                wire::processes_to_batch(chunk).map_err(wire::WireError::Encode).and_then(|b| wire::encode_ipc(&b));
            result = result.and(self.hand_over(Table::GpuProcesses, chunk.len(), body));
        }
        result
    }

    /// Gives the encoded batch the next sequence number and passes it on.
    fn hand_over(&mut self, table: Table, rows: usize, body: Result<Vec<u8>, wire::WireError>) -> std::io::Result<()> {
        let body = body.map_err(std::io::Error::other)?;
        let batch = Batch { epoch: self.epoch.clone(), seq: self.next_seq, table, rows, body };
        self.next_seq += 1;
        let Some(tx) = &self.tx else { return self.spool_directly(batch) };
        match tx.try_send(batch) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(batch) | TrySendError::Disconnected(batch)) => self.spool_directly(batch),
        }
    }

    fn spool_directly(&mut self, batch: Batch) -> std::io::Result<()> {
        let mut spool = self.spool.lock();
        match spool.push(&batch) {
            Ok(dropped) => {
                publish_spool(&self.state, &spool, dropped);
                drop(spool);
                with_stats(&self.state, |s| s.spooled_batches += 1);
                Ok(())
            }
            Err(e) => {
                drop(spool);
                with_stats(&self.state, |s| {
                    s.spool_dropped_batches += 1;
                    s.spool_dropped_rows += batch.rows as u64;
                });
                if !std::mem::replace(&mut self.spool_error_logged, true) {
                    tracing::error!(
                        "{e}; the batch is dropped (logged once; see apron_agent_spool_dropped_batches_total)"
                    );
                }
                Ok(())
            }
        }
    }
}

fn slot(now: UnixMicros, interval_us: i64, phase_us: i64) -> i64 {
    (now.0 - phase_us).div_euclid(interval_us)
}

impl WindowSink for ShipperSink {
    fn accept(&mut self, windows: &[GpuWindow], processes: &[ProcessRow]) -> std::io::Result<()> {
        self.windows.extend_from_slice(windows);
        self.processes.extend_from_slice(processes);
        let now = slot(UnixMicros::now(), self.interval_us, self.phase_us);
        if now != self.last_slot {
            self.last_slot = now;
            self.flush()?;
        }
        Ok(())
    }
}

impl Drop for ShipperSink {
    /// At shutdown: the last rows go out too, then the channel closes, which tells the
    /// shipper thread to finish.
    fn drop(&mut self) {
        if let Err(e) = self.flush() {
            tracing::warn!("cannot encode the last batches: {e}");
        }
        self.tx = None;
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::path::Path;
    use std::sync::mpsc::sync_channel;
    use std::time::Duration;

    use apron_common::{GpuIdentity, GpuUuid, HostName};

    use super::*;
    use crate::ship::Spool;

    pub(crate) fn config(spool_dir: &Path) -> ShipperConfig {
        ShipperConfig {
            collector: "http://127.0.0.1:1".into(),
            token: "t".into(),
            agent_id: "a".into(),
            flush_interval: Duration::from_secs(3600),
            spool_dir: spool_dir.to_owned(),
            spool_max_bytes: 1 << 30,
            request_timeout: Duration::from_secs(1),
            max_batch_rows: 3,
            max_backoff: Duration::from_secs(1),
            ca: None,
        }
    }

    fn window(i: i64) -> GpuWindow {
        let gpu = GpuIdentity::gpu(HostName::new("n1").expect("valid"), GpuUuid::new("GPU-1").expect("valid"), 0, "m");
        GpuWindow::new(UnixMicros(i * 1_000_000), Duration::from_secs(1), gpu)
    }

    #[test]
    fn flush_splits_numbers_and_overflows_to_the_spool() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = config(dir.path());
        let (spool, _) = Spool::open(dir.path(), cfg.spool_max_bytes).expect("spool");
        let spool = SharedSpool::new(spool);
        let state = SharedState::default();
        let (tx, rx) = sync_channel(2);
        let mut sink = ShipperSink::new(&cfg, "e".into(), tx, spool.clone(), state.clone(), 0);
        let rows: Vec<GpuWindow> = (0..7).map(window).collect();
        // A flush interval of an hour: accepting only buffers.
        sink.accept(&rows, &[]).expect("accept");
        assert!(rx.try_recv().is_err());
        sink.flush().expect("flush");
        // 7 rows at 3 per batch: 3 batches, sequences 1, 2, 3. The channel takes two;
        // the third goes straight to the spool instead of waiting.
        let got: Vec<(u64, usize)> = rx.try_iter().map(|b| (b.seq, b.rows)).collect();
        assert_eq!(got, [(1, 3), (2, 3)]);
        let spooled: Vec<String> = spool.lock().names().map(str::to_owned).collect();
        assert_eq!(spooled, [crate::ship::file_name("e", 3, Table::GpuSamples)]);
        assert_eq!(state.lock().ship.as_ref().map(|s| (s.spooled_batches, s.spool_files)), Some((1, 1)));
        // Dropping the sink flushes what is left and closes the channel.
        sink.accept(&[window(8)], &[]).expect("accept");
        drop(sink);
        let last: Vec<u64> = rx.iter().map(|b| b.seq).collect();
        assert_eq!(last, [4]);
    }
}
