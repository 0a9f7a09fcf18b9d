//! The shipper thread: sends batches in order, oldest first, one request at a time.
//!
//! Batches wait in two places: a short in-memory queue (what the sink handed over
//! while the collector answers) and the spool. The next batch is always the oldest of
//! the two heads by (epoch, sequence), so order holds however a batch got where it is.
//!
//! - 2xx: done; a spooled batch's file is deleted.
//! - No connection, timeout, 429, 5xx, 401/403, any other status: the batch goes to the
//!   spool (if it is not there already), and so does every batch after it until one
//!   attempt succeeds — memory holds nothing an outage could lose at shutdown or crash.
//!   The oldest is retried after a backoff with jitter (longer if the collector asks
//!   with `Retry-After`); new batches keep arriving meanwhile and go to the spool.
//! - 400, 413, 422: the batch can never succeed: it moves to `rejected/` and the next
//!   one is sent at once.
//!
//! At shutdown (the sink dropped, channel closed) what is in memory is sent while the
//! collector answers, within one request timeout, and spooled otherwise; the next start
//! drains the spool first.

use std::collections::{HashSet, VecDeque};
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};

use apron_common::UnixMicros;

use super::backoff::{BASE, Backoff};
use super::client::{Client, Outcome};
use super::{Batch, CHANNEL_CAPACITY, SharedSpool, publish_spool, with_stats};
use crate::config::ShipperConfig;
use crate::exposition::SharedState;

/// A batch about to be sent, and its spool file if it came from there.
struct Next {
    batch: Batch,
    spooled: Option<String>,
}

enum Wait {
    Forever,
    Until(Instant),
    No,
}

pub struct Shipper {
    rx: Receiver<Batch>,
    spool: SharedSpool,
    client: Client,
    state: SharedState,
    backoff: Backoff,
    max_backoff: Duration,
    request_timeout: Duration,
    mem: VecDeque<Batch>,
    /// After a failed attempt every batch goes through the spool until one succeeds.
    down: bool,
    retry_at: Option<Instant>,
    /// The kind of failure last logged in this outage (true: the token was refused), so
    /// each outage is logged once, and again only if its cause changes.
    outage_logged: Option<bool>,
    rejects_logged: HashSet<u16>,
    spool_error_logged: bool,
}

impl Shipper {
    pub fn new(config: &ShipperConfig, rx: Receiver<Batch>, spool: SharedSpool, state: SharedState, seed: u64) -> Self {
        Self {
            rx,
            spool,
            client: Client::new(config),
            state,
            backoff: Backoff::new(BASE, config.max_backoff, seed),
            max_backoff: config.max_backoff,
            request_timeout: config.request_timeout,
            mem: VecDeque::new(),
            down: false,
            retry_at: None,
            outage_logged: None,
            rejects_logged: HashSet::new(),
            spool_error_logged: false,
        }
    }

    pub fn run(mut self) {
        loop {
            let pending = !self.mem.is_empty() || !self.spool.lock().is_empty();
            let wait = match self.retry_at {
                _ if !pending => Wait::Forever,
                Some(t) if t > Instant::now() => Wait::Until(t),
                _ => Wait::No,
            };
            if !self.receive(wait) {
                break;
            }
            if self.retry_at.is_some_and(|t| t > Instant::now()) {
                continue;
            }
            if let Some(next) = self.next() {
                self.attempt(next);
            }
        }
        self.finish();
    }

    /// Takes batches from the sink: waits as told for the first, then takes what is
    /// there without waiting. False once the sink has gone and the channel is empty.
    fn receive(&mut self, wait: Wait) -> bool {
        let first = match wait {
            Wait::Forever => match self.rx.recv() {
                Ok(b) => Some(b),
                Err(_) => return false,
            },
            Wait::Until(t) => match self.rx.recv_timeout(t.saturating_duration_since(Instant::now())) {
                Ok(b) => Some(b),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => return false,
            },
            Wait::No => None,
        };
        if let Some(b) = first {
            self.accept(b);
        }
        // While memory is full, later batches stay in the channel, and once that is
        // full too the sink spools them itself.
        while self.down || self.mem.len() < CHANNEL_CAPACITY {
            match self.rx.try_recv() {
                Ok(b) => self.accept(b),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => return false,
            }
        }
        true
    }

    fn accept(&mut self, batch: Batch) {
        if self.down || self.mem.len() >= CHANNEL_CAPACITY {
            self.spool_batch(batch);
        } else {
            self.mem.push_back(batch);
        }
    }

    /// The oldest waiting batch, from memory or the spool.
    fn next(&mut self) -> Option<Next> {
        let mut spool = self.spool.lock();
        let head = spool.head();
        let from_memory = match (self.mem.front(), &head) {
            (Some(m), Some(h)) => m.file_name() < h.name,
            (Some(_), None) => true,
            (None, _) => false,
        };
        if from_memory {
            return self.mem.pop_front().map(|batch| Next { batch, spooled: None });
        }
        let head = head?;
        match spool.load(&head) {
            Ok(Some(batch)) => {
                spool.set_in_flight(Some(head.name.clone()));
                Some(Next { batch, spooled: Some(head.name) })
            }
            Ok(None) => {
                spool.remove(&head.name);
                None
            }
            Err(e) => {
                // Unreadable (deleted or damaged under us): it cannot be sent; count it.
                tracing::warn!("{e}; the batch is dropped");
                spool.remove(&head.name);
                publish_spool(&self.state, &spool, super::spool::Dropped { batches: 1, rows: 0 });
                None
            }
        }
    }

    fn attempt(&mut self, next: Next) {
        let outcome = self.client.send(&next.batch);
        match outcome {
            Outcome::Acked { duplicate, latency } => self.acked(&next, duplicate, latency),
            Outcome::Rejected { status, detail } => self.rejected(&next, status, &detail),
            Outcome::Retry { reason, retry_after } => self.failed(next, &reason, retry_after, false),
            Outcome::Unauthorized { status, detail } => {
                let reason = format!("HTTP {status}: {detail}");
                self.failed(next, &reason, None, true);
            }
        }
        self.spool.lock().set_in_flight(None);
    }

    fn acked(&mut self, next: &Next, duplicate: bool, latency: Duration) {
        let b = &next.batch;
        let left = match &next.spooled {
            Some(name) => {
                let mut spool = self.spool.lock();
                spool.remove(name);
                publish_spool(&self.state, &spool, Default::default());
                spool.files()
            }
            None => self.spool.lock().files(),
        };
        with_stats(&self.state, |s| {
            let t = s.sent.entry(b.table.name()).or_default();
            t.batches += 1;
            t.rows += b.rows as u64;
            s.duplicates += u64::from(duplicate);
            s.ack_seconds += latency.as_secs_f64();
            s.last_success_time = Some(UnixMicros::now().as_secs_f64());
            s.collector_up = Some(true);
        });
        if self.outage_logged.take().is_some() {
            tracing::info!(
                url = self.client.url(),
                spooled = left,
                "collector reachable again; sending the spool, oldest first"
            );
        }
        tracing::debug!(table = b.table.name(), seq = b.seq, rows = b.rows, duplicate, "shipped");
        self.down = false;
        self.backoff.reset();
        self.retry_at = None;
    }

    fn rejected(&mut self, next: &Next, status: u16, detail: &str) {
        let b = &next.batch;
        let reason = format!("HTTP {status}: {detail}");
        {
            let mut spool = self.spool.lock();
            if let Err(e) = spool.reject(b, &reason) {
                tracing::warn!("cannot keep the rejected batch: {e}");
            }
            publish_spool(&self.state, &spool, Default::default());
        }
        with_stats(&self.state, |s| {
            s.rejected_batches += 1;
            s.collector_up = Some(true);
        });
        if self.rejects_logged.insert(status) {
            tracing::error!(
                table = b.table.name(),
                seq = b.seq,
                "the collector refused a batch for good ({reason}); it is kept in {}/rejected/ (logged once per status; see apron_agent_ship_rejected_batches_total)",
                self.spool.lock().dir().display()
            );
        }
        // The collector answered, so it is reachable: go on with the next batch at once.
        self.down = false;
        self.backoff.reset();
        self.retry_at = None;
    }

    fn failed(&mut self, next: Next, reason: &str, retry_after: Option<Duration>, unauthorized: bool) {
        with_stats(&self.state, |s| {
            s.retries += 1;
            s.collector_up = Some(false);
        });
        // From here on nothing waits in memory: the spool survives a restart.
        if next.spooled.is_none() {
            self.spool_batch(next.batch);
        }
        self.down = true;
        while let Some(b) = self.mem.pop_front() {
            self.spool_batch(b);
        }
        let delay = self.backoff.next_delay().max(retry_after.unwrap_or_default().min(self.max_backoff));
        self.retry_at = Some(Instant::now() + delay);
        let dir = self.spool.lock().dir().display().to_string();
        if self.outage_logged.replace(unauthorized) != Some(unauthorized) {
            if unauthorized {
                tracing::error!(
                    url = self.client.url(),
                    "collector refused the token ({reason}); batches are kept in the spool ({dir}) and retried until the token is fixed"
                );
            } else {
                tracing::warn!(
                    url = self.client.url(),
                    "cannot ship: {reason}; spooling to {dir} and retrying with backoff"
                );
            }
        } else {
            tracing::debug!(reason, retry_in = ?delay, "ship attempt failed");
        }
    }

    fn spool_batch(&mut self, batch: Batch) {
        let mut spool = self.spool.lock();
        match spool.push(&batch) {
            Ok(dropped) => {
                publish_spool(&self.state, &spool, dropped);
                drop(spool);
                with_stats(&self.state, |s| s.spooled_batches += 1);
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
            }
        }
    }

    /// Shutdown: send what memory holds while the collector answers (within one request
    /// timeout), spool the rest.
    fn finish(&mut self) {
        while let Ok(b) = self.rx.try_recv() {
            self.mem.push_back(b);
        }
        let deadline = Instant::now() + self.request_timeout;
        while !self.down && Instant::now() < deadline && self.spool.lock().is_empty() {
            let Some(batch) = self.mem.pop_front() else { break };
            self.attempt(Next { batch, spooled: None });
        }
        while let Some(b) = self.mem.pop_front() {
            self.spool_batch(b);
        }
        let spool = self.spool.lock();
        if !spool.is_empty() {
            tracing::info!(
                dir = %spool.dir().display(),
                files = spool.files(),
                bytes = spool.bytes(),
                "batches left in the spool are sent at the next start"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead as _, BufReader, Read as _, Write as _};
    use std::net::TcpListener;
    use std::sync::mpsc::sync_channel;
    use std::sync::{Arc, Mutex};

    use apron_common::wire::Table;

    use super::*;
    use crate::ship::Spool;

    /// A one-connection-at-a-time HTTP server answering with `script`'s statuses in
    /// turn (200 once the script runs out); records (status, sequence) per request.
    /// (status answered, sequence) per request.
    type Log = Arc<Mutex<Vec<(u16, u64)>>>;

    fn scripted_server(script: Vec<u16>) -> (String, Log) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let log = Arc::new(Mutex::new(Vec::new()));
        let seen = log.clone();
        std::thread::spawn(move || {
            let mut script = script.into_iter();
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                let mut reader = BufReader::new(stream.try_clone().expect("clone"));
                let (mut len, mut seq) = (0usize, 0u64);
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                        break;
                    }
                    let lower = line.to_ascii_lowercase();
                    if let Some(v) = lower.strip_prefix("content-length:") {
                        len = v.trim().parse().unwrap_or(0);
                    }
                    if let Some(v) = lower.strip_prefix("x-apron-sequence:") {
                        seq = v.trim().parse().unwrap_or(0);
                    }
                }
                let mut body = vec![0; len];
                let _ = reader.read_exact(&mut body);
                let status = script.next().unwrap_or(200);
                seen.lock().expect("lock").push((status, seq));
                let answer = if status == 200 {
                    r#"{"rows":1,"duplicate":false}"#
                } else {
                    r#"{"error":"nope","detail":"scripted"}"#
                };
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{answer}",
                    answer.len()
                );
            }
        });
        (url, log)
    }

    fn batch(seq: u64) -> Batch {
        Batch { epoch: "e".into(), seq, table: Table::GpuSamples, rows: 2, body: vec![1, 2, 3] }
    }

    fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !f() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn failures_spool_and_retry_in_order_and_rejections_move_aside() {
        // 401 and 503 are retried (the batch waits in the spool); 422 is final.
        let (url, log) = scripted_server(vec![401, 503, 200, 422]);
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cfg = crate::ship::sink::tests::config(dir.path());
        cfg.collector = url;
        cfg.max_backoff = Duration::from_millis(50);
        let (spool, _) = Spool::open(dir.path(), cfg.spool_max_bytes).expect("spool");
        let spool = SharedSpool::new(spool);
        let state = SharedState::default();
        let (tx, rx) = sync_channel(CHANNEL_CAPACITY);
        let shipper = Shipper::new(&cfg, rx, spool.clone(), state.clone(), 1);
        let handle = std::thread::spawn(move || shipper.run());
        for seq in 1..=4 {
            tx.send(batch(seq)).expect("send");
        }
        wait_for("every batch answered", || {
            log.lock().expect("lock").iter().filter(|(s, _)| *s != 401 && *s != 503).count() == 4
        });
        drop(tx);
        handle.join().expect("shipper exits");

        let log = log.lock().expect("lock").clone();
        // Batch 1 is tried three times; nothing overtakes it.
        assert_eq!(log, [(401, 1), (503, 1), (200, 1), (422, 2), (200, 3), (200, 4)]);
        let st = state.lock();
        let ship = st.ship.as_ref().expect("stats");
        assert_eq!(ship.retries, 2);
        assert_eq!(ship.rejected_batches, 1);
        assert_eq!(ship.sent.get("gpu_samples").map(|t| (t.batches, t.rows)), Some((3, 6)));
        assert_eq!(ship.collector_up, Some(true));
        assert_eq!((ship.spool_files, ship.spool_bytes), (0, 0));
        assert!(spool.lock().is_empty());
        let rejected = dir.path().join("rejected").join(batch(2).file_name());
        assert!(rejected.exists());
    }

    #[test]
    fn shutdown_while_the_collector_is_down_spools_everything() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = crate::ship::sink::tests::config(dir.path());
        let (spool, _) = Spool::open(dir.path(), cfg.spool_max_bytes).expect("spool");
        let spool = SharedSpool::new(spool);
        let (tx, rx) = sync_channel(CHANNEL_CAPACITY);
        let shipper = Shipper::new(&cfg, rx, spool.clone(), SharedState::default(), 1);
        let handle = std::thread::spawn(move || shipper.run());
        for seq in 1..=5 {
            tx.send(batch(seq)).expect("send");
        }
        drop(tx);
        handle.join().expect("shipper exits");
        let names: Vec<String> = spool.lock().names().map(str::to_owned).collect();
        assert_eq!(names, (1..=5).map(|q| batch(q).file_name()).collect::<Vec<_>>());
    }
}
