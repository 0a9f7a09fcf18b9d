//! Ingest load generator: N simulated agents posting to `apron serve` at 1 Hz
//! (`scripts/load.sh`, docs/benchmarks.md, "Ingest load: 1,000 agents at 1 Hz").
//!
//! ```text
//!  generator thread                       connection threads (--connections, default one
//!  ───────────────────────────────        per agent; agent a belongs to thread a % C)
//!  SimSource::history of AGENTS nodes     per agent: own id (its host name), own epoch
//!  × GPUS_PER_AGENT GPUs (the fleet        (UUIDv7), sequence from 1, FIFO of batches
//!  `apron up` simulates), 1 s windows;      │ encode (wire::windows_to_batch + encode_ipc)
//!  each second, LEAD before the window      │ wait until window end + the agent's phase
//!  ends, that window's rows, split by       ▼
//!  host ──────────────────────────────►   POST /api/v1/ingest (ureq, keep-alive), oldest
//!                                          first, one request at a time per agent:
//!                                           2xx → acknowledged (latency recorded)
//!                                           429/5xx/other/no answer → retried with the
//!                                             agent's backoff (0.5 s·2ⁿ, jitter, ≤ 30 s,
//!                                             at least Retry-After), same epoch/sequence
//!                                           400/413/422 → rejected (an agent moves it
//!                                             aside; counted, never expected here)
//! ```
//!
//! Each agent sends what `apron-agent` with `flush_interval = "1s"` sends: one
//! `gpu_samples` request per second holding that second's windows of its GPUs
//! (`docs/ingest.md`: bearer token, `x-apron-table/agent/epoch/sequence`, an Arrow IPC
//! stream with zstd buffers). Agents are phased evenly over the second
//! (agent a sends at window end + (a + 0.5)/N s), so the load is spread, not a burst.
//! Not simulated: `gpu_processes` requests and the agent's on-disk spool (a failed batch
//! waits in memory here; the server sees the same retries).
//!
//! `--pregen-dir DIR`: encode every batch of the run into files in DIR first (sim and
//! encoding on all cores, then the run only reads each body back and sends it). Encoding
//! one 8-row body (~140 tiny zstd-compressed Arrow buffers) costs ~0.4 ms of CPU, so live
//! encoding at 1,000 req/s takes ~0.4 of a core away from the server on a small machine;
//! the run's window times are then fixed before it starts (after a calibration of the
//! pre-generation's speed), and the files take ~15 KB per request (9 GB for 1,000
//! agents × 10 min).
//!
//! Measured per request: acknowledgement latency (send → 2xx, successful attempts), lag
//! (due → first attempt: the generator keeping up, and an agent's queue behind a batch
//! in backoff), delivery (due → acknowledged, retries included). Latencies are kept
//! exactly (µs, one u32 per request) and sorted at the end. Prints a summary; `--json FILE` writes it for scripts.
//!
//! ```sh
//! cargo run --release -p apron --example loadgen -- --server http://127.0.0.1:9402 \
//!     --token "$APRON_INGEST_TOKEN" --agents 1000 --duration 10m
//! ```

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, bail};
use apron_agent::ship::epoch::new_epoch;
use apron_agent::source::sim::{SimConfig, SimSource};
use apron_common::wire::{encode_ipc, headers, windows_to_batch};
use apron_common::{GpuWindow, UnixMicros};
use clap::Parser;

#[derive(Debug, Parser)]
#[command(about = "Simulated agents posting gpu_samples to `apron serve` at 1 Hz; measures ack latency.")]
struct Args {
    /// The server's base URL.
    #[arg(long, default_value = "http://127.0.0.1:9402")]
    server: String,
    /// Ingest token.
    #[arg(long, env = "APRON_INGEST_TOKEN", hide_env_values = true)]
    token: String,
    /// Simulated agents (nodes), 1–4096.
    #[arg(long, default_value_t = 1000)]
    agents: u32,
    /// GPUs per agent, 1–16.
    #[arg(long, default_value_t = 8)]
    gpus_per_agent: u32,
    /// How long the agents send (seconds of windows per agent).
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Connection threads (each one keep-alive connection, one request at a time);
    /// 0 = one per agent, as a real fleet.
    #[arg(long, default_value_t = 0)]
    connections: usize,
    /// Rows of a window are generated this long before the window ends.
    #[arg(long, default_value = "500ms", value_parser = humantime::parse_duration)]
    lead: Duration,
    /// Whole-request timeout, as the agent's `shipper.request_timeout`.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    request_timeout: Duration,
    /// As the agent's `shipper.max_backoff`.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    max_backoff: Duration,
    /// After the last window, how long batches still queued may be retried.
    #[arg(long, default_value = "3m", value_parser = humantime::parse_duration)]
    drain_timeout: Duration,
    /// Progress line on stderr this often (0s: none).
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    progress: Duration,
    /// Seeds the simulated fleet.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Write the summary as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Pre-encode every batch into files here before the run (see the module docs).
    #[arg(long)]
    pregen_dir: Option<PathBuf>,
}

fn unix_us() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as i64)
}

/// Maps Unix µs onto this process's monotonic clock.
#[derive(Clone, Copy)]
struct Clock {
    at: Instant,
    unix: i64,
}

impl Clock {
    fn now() -> Clock {
        Clock { at: Instant::now(), unix: unix_us() }
    }

    fn instant(&self, unix: i64) -> Instant {
        let d = unix - self.unix;
        if d >= 0 {
            self.at + Duration::from_micros(d as u64)
        } else {
            self.at.checked_sub(Duration::from_micros(d.unsigned_abs())).unwrap_or(self.at)
        }
    }
}

/// User CPU + system CPU of this process so far, seconds (`/proc/self/stat`, USER_HZ 100).
fn process_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name may hold spaces; fields after its closing parenthesis are fixed.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = f.get(11)?.parse().ok()?;
    let stime: f64 = f.get(12)?.parse().ok()?;
    Some((utime + stime) / 100.0)
}

/// One second's rows of one agent, from the generator.
struct Rows {
    agent: usize,
    end_us: i64,
    rows: Vec<GpuWindow>,
}

struct Batch {
    seq: u64,
    rows: usize,
    body: Body,
    due: Instant,
    attempts: u32,
}

/// A request body: encoded live, or pre-generated into `Worker::files`.
enum Body {
    Mem(Vec<u8>),
    File { file: usize, offset: u64, len: u32 },
}

/// Where pre-generation put one batch.
#[derive(Clone, Copy)]
struct Stored {
    file: usize,
    offset: u64,
    len: u32,
    rows: u32,
}

struct AgentState {
    id: String,
    epoch: String,
    next_seq: u64,
    phase: Duration,
    queue: VecDeque<Batch>,
    retry_at: Option<Instant>,
    failures: u32,
}

/// Shared live counters, for the progress line.
#[derive(Default)]
struct Live {
    acked: AtomicU64,
    acked_rows: AtomicU64,
    failed_attempts: AtomicU64,
    queued: AtomicU64,
}

#[derive(Default)]
struct WorkerStats {
    /// µs, successful attempts.
    latency_us: Vec<u32>,
    /// µs, first attempt start − due.
    lag_us: Vec<u32>,
    /// µs, acknowledged − due.
    delivery_us: Vec<u32>,
    attempts: u64,
    acked: u64,
    duplicates: u64,
    rows_sent: u64,
    rows_acked: u64,
    body_bytes: u64,
    encode_us: u64,
    retried_batches: u64,
    non_2xx: BTreeMap<u16, u64>,
    errors: BTreeMap<String, u64>,
    rejected_batches: u64,
    rejected_rows: u64,
    undelivered_batches: u64,
    undelivered_rows: u64,
    first_send: Option<Instant>,
    last_ack: Option<Instant>,
}

impl WorkerStats {
    fn merge(&mut self, o: WorkerStats) {
        self.latency_us.extend(o.latency_us);
        self.lag_us.extend(o.lag_us);
        self.delivery_us.extend(o.delivery_us);
        self.attempts += o.attempts;
        self.acked += o.acked;
        self.duplicates += o.duplicates;
        self.rows_sent += o.rows_sent;
        self.rows_acked += o.rows_acked;
        self.body_bytes += o.body_bytes;
        self.encode_us += o.encode_us;
        self.retried_batches += o.retried_batches;
        for (k, v) in o.non_2xx {
            *self.non_2xx.entry(k).or_default() += v;
        }
        for (k, v) in o.errors {
            *self.errors.entry(k).or_default() += v;
        }
        self.rejected_batches += o.rejected_batches;
        self.rejected_rows += o.rejected_rows;
        self.undelivered_batches += o.undelivered_batches;
        self.undelivered_rows += o.undelivered_rows;
        self.first_send = match (self.first_send, o.first_send) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        self.last_ack = self.last_ack.max(o.last_ack);
    }
}

fn us(d: Duration) -> u32 {
    u32::try_from(d.as_micros()).unwrap_or(u32::MAX)
}

/// xorshift64*: backoff jitter only.
struct Rng(u64);

impl Rng {
    fn unit(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    }
}

struct Worker {
    agents: Vec<AgentState>,
    /// Global agent index → index in `agents`.
    local: HashMap<usize, usize>,
    http: ureq::Agent,
    url: String,
    authorization: String,
    max_backoff: Duration,
    drain_timeout: Duration,
    rng: Rng,
    live: Arc<Live>,
    stats: WorkerStats,
    clock: Clock,
    files: Arc<Vec<std::fs::File>>,
}

enum Answer {
    Acked { duplicate: bool },
    Rejected(u16),
    Retry { why: Failure, retry_after: Option<Duration> },
}

enum Failure {
    Status(u16),
    Transport(String),
}

impl Worker {
    fn run(mut self, rx: Receiver<Vec<Rows>>) -> WorkerStats {
        let mut open = true;
        let mut drain_until: Option<Instant> = None;
        loop {
            let now = Instant::now();
            // The agent whose oldest batch may go soonest.
            let next = self
                .agents
                .iter()
                .enumerate()
                .filter_map(|(i, a)| a.queue.front().map(|b| (i, a.retry_at.map_or(b.due, |r| r.max(b.due)))))
                .min_by_key(|&(_, t)| t);
            if let Some((i, t)) = next
                && t <= now
            {
                self.send(i);
                continue;
            }
            if !open {
                let Some((_, t)) = next else { break };
                let until = drain_until.unwrap_or(now);
                if t > until {
                    break;
                }
                std::thread::sleep(t.saturating_duration_since(now));
                continue;
            }
            let got = match next {
                Some((_, t)) => rx.recv_timeout(t.saturating_duration_since(now)),
                None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
            };
            match got {
                Ok(batch) => self.accept(batch),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    open = false;
                    // Pre-generated batches are all queued already, due until the end.
                    let last_due = self.agents.iter().filter_map(|a| a.queue.back().map(|b| b.due)).max();
                    drain_until = Some(last_due.unwrap_or(now).max(Instant::now()) + self.drain_timeout);
                }
            }
        }
        for a in &mut self.agents {
            for b in a.queue.drain(..) {
                self.stats.undelivered_batches += 1;
                self.stats.undelivered_rows += b.rows as u64;
            }
        }
        self.stats
    }

    /// Encodes each agent's rows into its next batch, as the agent's sink does at a flush.
    fn accept(&mut self, all: Vec<Rows>) {
        for r in all {
            let Some(&i) = self.local.get(&r.agent) else { continue };
            let started = Instant::now();
            let body = windows_to_batch(&r.rows)
                .map_err(apron_common::wire::WireError::Encode)
                .and_then(|b| encode_ipc(&b))
                .expect("the simulator's rows encode");
            self.stats.encode_us += started.elapsed().as_micros() as u64;
            let a = &mut self.agents[i];
            let due = self.clock.instant(r.end_us) + a.phase;
            a.queue.push_back(Batch { seq: a.next_seq, rows: r.rows.len(), body: Body::Mem(body), due, attempts: 0 });
            a.next_seq += 1;
            self.stats.rows_sent += r.rows.len() as u64;
            self.live.queued.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn send(&mut self, i: usize) {
        let mut buf = Vec::new();
        let body: &[u8] = {
            let Some(b) = self.agents[i].queue.front() else { return };
            match &b.body {
                Body::Mem(v) => v,
                &Body::File { file, offset, len } => {
                    use std::os::unix::fs::FileExt as _;
                    buf.resize(len as usize, 0);
                    self.files[file].read_exact_at(&mut buf, offset).expect("reading a pre-generated body");
                    &buf
                }
            }
        };
        let started = Instant::now();
        let answer = {
            let a = &self.agents[i];
            let Some(b) = a.queue.front() else { return };
            if b.attempts == 0 {
                self.stats.lag_us.push(us(started.saturating_duration_since(b.due)));
            }
            self.stats.body_bytes += body.len() as u64;
            self.post(&a.id, &a.epoch, b.seq, body)
        };
        let done = Instant::now();
        self.stats.attempts += 1;
        self.stats.first_send.get_or_insert(started);
        let a = &mut self.agents[i];
        if let Some(b) = a.queue.front_mut() {
            b.attempts += 1;
            if b.attempts == 2 {
                self.stats.retried_batches += 1;
            }
        }
        match answer {
            Answer::Acked { duplicate } => {
                let Some(b) = a.queue.pop_front() else { return };
                self.stats.latency_us.push(us(done - started));
                self.stats.delivery_us.push(us(done.saturating_duration_since(b.due)));
                self.stats.acked += 1;
                self.stats.duplicates += u64::from(duplicate);
                self.stats.rows_acked += b.rows as u64;
                self.stats.last_ack = Some(done);
                a.retry_at = None;
                a.failures = 0;
                self.live.acked.fetch_add(1, Ordering::Relaxed);
                self.live.acked_rows.fetch_add(b.rows as u64, Ordering::Relaxed);
                self.live.queued.fetch_sub(1, Ordering::Relaxed);
            }
            Answer::Rejected(status) => {
                let Some(b) = a.queue.pop_front() else { return };
                *self.stats.non_2xx.entry(status).or_default() += 1;
                self.stats.rejected_batches += 1;
                self.stats.rejected_rows += b.rows as u64;
                self.live.queued.fetch_sub(1, Ordering::Relaxed);
                self.live.failed_attempts.fetch_add(1, Ordering::Relaxed);
                eprintln!("loadgen: agent {} seq {} rejected with HTTP {status}", a.id, b.seq);
            }
            Answer::Retry { why, retry_after } => {
                match why {
                    Failure::Status(s) => *self.stats.non_2xx.entry(s).or_default() += 1,
                    Failure::Transport(e) => *self.stats.errors.entry(e).or_default() += 1,
                }
                self.live.failed_attempts.fetch_add(1, Ordering::Relaxed);
                // The agent's backoff: attempt n waits a random time in [c/2, c],
                // c = min(max_backoff, 0.5 s · 2ⁿ), and at least Retry-After.
                let c = Duration::from_millis(500)
                    .saturating_mul(1u32 << a.failures.min(16))
                    .min(self.max_backoff)
                    .as_secs_f64();
                a.failures += 1;
                let wait = Duration::from_secs_f64(c / 2.0 + self.rng.unit() * c / 2.0)
                    .max(retry_after.unwrap_or_default().min(self.max_backoff));
                a.retry_at = Some(done + wait);
            }
        }
    }

    fn post(&self, agent: &str, epoch: &str, seq: u64, body: &[u8]) -> Answer {
        let sent = self
            .http
            .post(&self.url)
            .header("authorization", &self.authorization)
            .header("content-type", headers::ARROW_STREAM)
            .header(headers::TABLE, "gpu_samples")
            .header(headers::AGENT, agent)
            .header(headers::EPOCH, epoch)
            .header(headers::SEQUENCE, seq.to_string())
            .send(body);
        let mut resp = match sent {
            Ok(r) => r,
            Err(e) => return Answer::Retry { why: Failure::Transport(describe(&e)), retry_after: None },
        };
        let status = resp.status().as_u16();
        let retry_after = resp
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        // Read to the end, so the connection is reused.
        let text = resp.body_mut().with_config().limit(64 * 1024).read_to_string().unwrap_or_default();
        match status {
            200..=299 => {
                let duplicate = serde_json::from_str::<serde_json::Value>(&text)
                    .ok()
                    .and_then(|v| v.get("duplicate")?.as_bool())
                    .unwrap_or(false);
                Answer::Acked { duplicate }
            }
            400 | 413 | 422 => {
                eprintln!("loadgen: HTTP {status}: {}", text.trim());
                Answer::Rejected(status)
            }
            s => Answer::Retry { why: Failure::Status(s), retry_after },
        }
    }
}

fn describe(e: &ureq::Error) -> String {
    match e {
        ureq::Error::Io(io) => format!("io {:?}", io.kind()),
        ureq::Error::Timeout(_) => "timeout".to_owned(),
        other => {
            let s = other.to_string();
            s.chars().take(80).collect()
        }
    }
}

/// One window's rows (fleet order) split by agent.
fn split(
    rows: impl Iterator<Item = GpuWindow>,
    host_index: &HashMap<String, usize>,
    n: usize,
    gpus: usize,
) -> Vec<Vec<GpuWindow>> {
    let mut per_agent: Vec<Vec<GpuWindow>> = (0..n).map(|_| Vec::with_capacity(gpus)).collect();
    for row in rows {
        if let Some(&a) = host_index.get(row.gpu.host.as_str()) {
            per_agent[a].push(row);
        }
    }
    per_agent
}

/// What the agent's sink does at a flush.
fn encode(rows: &[GpuWindow]) -> anyhow::Result<Vec<u8>> {
    let batch = windows_to_batch(rows).context("building a wire batch")?;
    encode_ipc(&batch).context("encoding a wire batch")
}

/// Encodes every batch of the run into `dir/bodies-<thread>.bin`: the simulator on this
/// thread, encoding on `threads` threads (agent a on thread a % threads, so each agent's
/// batches are in window order). Returns the files opened for reading, each agent's
/// batches in window order, and the bytes written.
#[allow(clippy::too_many_arguments)]
fn pregen(
    sim: &SimSource,
    host_index: &HashMap<String, usize>,
    n: usize,
    gpus: usize,
    first_end: i64,
    seconds: u64,
    dir: &std::path::Path,
    threads: usize,
) -> anyhow::Result<(Vec<std::fs::File>, Vec<Vec<Stored>>, u64)> {
    use std::io::Write as _;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = |k: usize| dir.join(format!("bodies-{k}.bin"));
    let mut txs = Vec::with_capacity(threads);
    let mut handles = Vec::with_capacity(threads);
    for k in 0..threads {
        let file = std::fs::File::create(path(k)).with_context(|| format!("creating {}", path(k).display()))?;
        let (tx, rx) = mpsc::sync_channel::<Vec<(usize, Vec<GpuWindow>)>>(2);
        txs.push(tx);
        handles.push(std::thread::spawn(move || -> anyhow::Result<(Vec<(usize, Stored)>, u64)> {
            let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
            let mut offset = 0u64;
            let mut index = Vec::new();
            for window in rx {
                for (agent, rows) in window {
                    let body = encode(&rows)?;
                    out.write_all(&body)?;
                    let len = u32::try_from(body.len()).context("a body over 4 GiB")?;
                    index.push((agent, Stored { file: k, offset, len, rows: rows.len() as u32 }));
                    offset += u64::from(len);
                }
            }
            out.flush()?;
            Ok((index, offset))
        }));
    }
    let start = UnixMicros(first_end - 1_000_000);
    let end = UnixMicros(first_end + (seconds as i64 - 1) * 1_000_000);
    let mut history = sim.history(start, end, Duration::from_secs(1));
    let t0 = Instant::now();
    for s in 0..seconds {
        let per_agent = split(history.by_ref().take(n * gpus), host_index, n, gpus);
        let mut per_thread: Vec<Vec<(usize, Vec<GpuWindow>)>> = (0..threads).map(|_| Vec::new()).collect();
        for (a, rows) in per_agent.into_iter().enumerate() {
            per_thread[a % threads].push((a, rows));
        }
        let mut stopped = false;
        for (k, w) in per_thread.into_iter().enumerate() {
            stopped |= txs[k].send(w).is_err();
        }
        if stopped {
            break;
        }
        if (s + 1) % 60 == 0 {
            eprintln!("loadgen: pre-generated {} of {seconds} windows ({:.0} s)", s + 1, t0.elapsed().as_secs_f64());
        }
    }
    drop(txs);
    let mut per_agent: Vec<Vec<Stored>> = (0..n).map(|_| Vec::with_capacity(seconds as usize)).collect();
    let mut bytes = 0;
    for h in handles {
        let (index, written) = h.join().map_err(|_| anyhow::anyhow!("an encoder thread panicked"))??;
        bytes += written;
        for (a, st) in index {
            per_agent[a].push(st);
        }
    }
    if per_agent.iter().any(|v| v.len() as u64 != seconds) {
        bail!("pre-generation produced fewer batches than windows");
    }
    let files = (0..threads)
        .map(|k| std::fs::File::open(path(k)).with_context(|| format!("opening {}", path(k).display())))
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok((files, per_agent, bytes))
}

/// Nearest-rank percentiles of a sorted slice, in ms.
fn percentiles(sorted: &[u32]) -> serde_json::Value {
    let at = |q: f64| -> f64 {
        if sorted.is_empty() {
            return 0.0;
        }
        let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
        f64::from(sorted[rank - 1]) / 1000.0
    };
    let mean = if sorted.is_empty() {
        0.0
    } else {
        sorted.iter().map(|&v| f64::from(v)).sum::<f64>() / sorted.len() as f64 / 1000.0
    };
    serde_json::json!({
        "count": sorted.len(),
        "mean": round3(mean),
        "p50": at(0.5),
        "p90": at(0.9),
        "p99": at(0.99),
        "p99_9": at(0.999),
        "max": sorted.last().map_or(0.0, |&v| f64::from(v) / 1000.0),
    })
}

fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if !(1..=4096).contains(&args.agents) {
        bail!("--agents must be 1 to 4096");
    }
    if !(1..=16).contains(&args.gpus_per_agent) {
        bail!("--gpus-per-agent must be 1 to 16");
    }
    let seconds = args.duration.as_secs();
    if seconds == 0 {
        bail!("--duration must be at least 1s");
    }
    let n = args.agents as usize;
    let connections = if args.connections == 0 { n } else { args.connections.min(n) };
    let server = args.server.trim_end_matches('/').to_owned();

    // Windows end on whole seconds; live, the first one far enough ahead to set up (the
    // fleet and one thread per connection); pre-generated, once the files are written.
    let clock = Clock::now();
    let config =
        SimConfig { nodes: args.agents, gpus_per_node: args.gpus_per_agent, seed: args.seed, ..SimConfig::default() };
    let sim_start = UnixMicros((clock.unix / 1_000_000 + 5) * 1_000_000);
    let sim = SimSource::starting_at(&config, None, sim_start).context("building the simulated fleet")?;
    let mut first_end = sim_start.0 + 1_000_000;
    // Agent ids are the host names, in fleet order.
    let mut hosts: Vec<String> = Vec::new();
    for g in sim.fleet().inventory() {
        if hosts.last().map(String::as_str) != Some(g.host.as_str()) {
            hosts.push(g.host.as_str().to_owned());
        }
    }
    if hosts.len() != n {
        bail!("the fleet has {} hosts, expected {n}", hosts.len());
    }
    let host_index: HashMap<String, usize> = hosts.iter().enumerate().map(|(i, h)| (h.clone(), i)).collect();
    let gpus = args.gpus_per_agent as usize;

    let pregen_started = Instant::now();
    let mut pregen_stats = serde_json::Value::Null;
    let (files, mut stored) = match &args.pregen_dir {
        None => (Vec::new(), Vec::new()),
        Some(dir) => {
            let threads = std::thread::available_parallelism().map_or(2, |p| p.get());
            // Calibrate: a few windows on one thread. The estimate assumes no speed-up
            // from the other threads (on a shared machine there may be none), plus a
            // margin: finishing early only means waiting for the first window.
            let probe = 3;
            let t = Instant::now();
            let mut history =
                sim.history(sim_start, UnixMicros(sim_start.0 + probe * 1_000_000), Duration::from_secs(1));
            for _ in 0..probe {
                let per_agent = split(history.by_ref().take(n * gpus), &host_index, n, gpus);
                for rows in &per_agent {
                    encode(rows)?;
                }
            }
            let per_window = t.elapsed().as_secs_f64() / probe as f64;
            let estimate = per_window * seconds as f64 * 1.5 + 15.0;
            first_end = (unix_us() / 1_000_000 + estimate.ceil() as i64) * 1_000_000;
            eprintln!(
                "loadgen: pre-generating {} batches into {} on {threads} threads ({:.0} ms per window on one thread; about {estimate:.0} s)",
                n as u64 * seconds,
                dir.display(),
                per_window * 1000.0
            );
            let cpu0 = process_cpu_seconds().unwrap_or(0.0);
            let (files, stored, bytes) = pregen(&sim, &host_index, n, gpus, first_end, seconds, dir, threads)?;
            pregen_stats = serde_json::json!({
                "wall_s": round3(pregen_started.elapsed().as_secs_f64()),
                "cpu_s": round3(process_cpu_seconds().unwrap_or(0.0) - cpu0),
                "bytes": bytes,
                "threads": threads,
            });
            eprintln!("loadgen: pre-generated {bytes} bytes in {:.0} s", pregen_started.elapsed().as_secs_f64());
            (files, stored)
        }
    };
    let files = Arc::new(files);
    let last_end = first_end + (seconds as i64 - 1) * 1_000_000;

    let live = Arc::new(Live::default());
    let mut txs: Vec<Sender<Vec<Rows>>> = Vec::with_capacity(connections);
    let mut handles = Vec::with_capacity(connections);
    for w in 0..connections {
        let mine: Vec<usize> = (w..n).step_by(connections).collect();
        let mut rows_sent = 0u64;
        let agents = mine
            .iter()
            .map(|&a| {
                let phase = Duration::from_secs_f64((a as f64 + 0.5) / n as f64);
                // Pre-generated: every batch of the run queued now, due at its window's end.
                let queue: VecDeque<Batch> = stored
                    .get_mut(a)
                    .map(std::mem::take)
                    .unwrap_or_default()
                    .into_iter()
                    .enumerate()
                    .map(|(w, st)| Batch {
                        seq: w as u64 + 1,
                        rows: st.rows as usize,
                        body: Body::File { file: st.file, offset: st.offset, len: st.len },
                        due: clock.instant(first_end + w as i64 * 1_000_000) + phase,
                        attempts: 0,
                    })
                    .collect();
                rows_sent += queue.iter().map(|b| b.rows as u64).sum::<u64>();
                live.queued.fetch_add(queue.len() as u64, Ordering::Relaxed);
                AgentState {
                    id: hosts[a].clone(),
                    epoch: new_epoch(),
                    next_seq: queue.len() as u64 + 1,
                    phase,
                    queue,
                    retry_at: None,
                    failures: 0,
                }
            })
            .collect();
        let http: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(args.request_timeout))
            .http_status_as_error(false)
            .proxy(None)
            .user_agent(concat!("apron-loadgen/", env!("CARGO_PKG_VERSION")))
            .build()
            .into();
        let worker = Worker {
            agents,
            local: mine.iter().enumerate().map(|(i, &a)| (a, i)).collect(),
            http,
            url: format!("{server}/api/v1/ingest"),
            authorization: format!("Bearer {}", args.token),
            max_backoff: args.max_backoff,
            drain_timeout: args.drain_timeout,
            rng: Rng(0x9e37_79b9_7f4a_7c15 ^ (w as u64 + 1).wrapping_mul(args.seed | 1)),
            live: live.clone(),
            stats: WorkerStats { rows_sent, ..WorkerStats::default() },
            clock,
            files: files.clone(),
        };
        let (tx, rx) = mpsc::channel();
        txs.push(tx);
        handles.push(
            std::thread::Builder::new()
                .name(format!("conn-{w}"))
                .stack_size(512 << 10)
                .spawn(move || worker.run(rx))
                .context("starting a connection thread")?,
        );
    }
    eprintln!(
        "loadgen: {n} agents × {} GPUs, {seconds} s of 1 s windows ({} → {} UTC s), {connections} connections, {server}",
        args.gpus_per_agent,
        first_end / 1_000_000,
        last_end / 1_000_000,
    );

    // The generator's own CPU is measured from here (pre-generated: from the first window).
    if args.pregen_dir.is_some() {
        let at = clock.instant(first_end - 1_000_000);
        let now = Instant::now();
        if at > now {
            std::thread::sleep(at - now);
        }
    }
    let cpu_start = process_cpu_seconds();
    let wall_start = Instant::now();

    // Progress, on its own thread.
    let stop = Arc::new(AtomicBool::new(false));
    let progress = (!args.progress.is_zero()).then(|| {
        let (live, stop, every) = (live.clone(), stop.clone(), args.progress);
        std::thread::spawn(move || {
            let t0 = Instant::now();
            let mut last = (0u64, Instant::now());
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(200));
                if last.1.elapsed() < every {
                    continue;
                }
                let acked = live.acked.load(Ordering::Relaxed);
                let dt = last.1.elapsed().as_secs_f64();
                eprintln!(
                    "loadgen: {:>5.0} s  acked {acked:>8} ({:>6.1} req/s)  rows {:>9}  failed attempts {}  queued {}  cpu {:.1} s",
                    t0.elapsed().as_secs_f64(),
                    (acked - last.0) as f64 / dt,
                    live.acked_rows.load(Ordering::Relaxed),
                    live.failed_attempts.load(Ordering::Relaxed),
                    live.queued.load(Ordering::Relaxed),
                    process_cpu_seconds().unwrap_or(0.0),
                );
                last = (acked, Instant::now());
            }
        })
    });

    // The generator: each window's rows, LEAD before it ends, to the agents' threads.
    let rows_per_window = n * args.gpus_per_agent as usize;
    let mut history = sim.history(UnixMicros(first_end - 1_000_000), UnixMicros(last_end), Duration::from_secs(1));
    let (mut gen_us_total, mut gen_us_max, mut gen_late) = (0u64, 0u64, 0u64);
    let lead = i64::try_from(args.lead.as_micros()).unwrap_or(0);
    let live_seconds = if args.pregen_dir.is_some() { 0 } else { seconds as i64 };
    for s in 0..live_seconds {
        let end = first_end + s * 1_000_000;
        let at = clock.instant(end - lead);
        let now = Instant::now();
        if at > now {
            std::thread::sleep(at - now);
        }
        let started = Instant::now();
        let mut per_worker: Vec<Vec<Rows>> = (0..connections).map(|_| Vec::new()).collect();
        let mut per_agent: Vec<Vec<GpuWindow>> =
            (0..n).map(|_| Vec::with_capacity(args.gpus_per_agent as usize)).collect();
        for row in history.by_ref().take(rows_per_window) {
            debug_assert_eq!(row.time.0, end);
            let Some(&a) = host_index.get(row.gpu.host.as_str()) else { continue };
            per_agent[a].push(row);
        }
        for (a, rows) in per_agent.into_iter().enumerate() {
            if !rows.is_empty() {
                per_worker[a % connections].push(Rows { agent: a, end_us: end, rows });
            }
        }
        for (w, batch) in per_worker.into_iter().enumerate() {
            if !batch.is_empty() {
                let _ = txs[w].send(batch);
            }
        }
        let took = started.elapsed();
        gen_us_total += took.as_micros() as u64;
        gen_us_max = gen_us_max.max(took.as_micros() as u64);
        // Late: the first agent of the window was due before its rows existed.
        if Instant::now() > clock.instant(end) {
            gen_late += 1;
        }
    }
    drop(txs);
    let mut stats = WorkerStats::default();
    for h in handles {
        stats.merge(h.join().map_err(|_| anyhow::anyhow!("a connection thread panicked"))?);
    }
    stop.store(true, Ordering::Relaxed);
    if let Some(p) = progress {
        let _ = p.join();
    }
    let cpu = process_cpu_seconds().zip(cpu_start).map(|(a, b)| a - b).unwrap_or(0.0);
    let wall = wall_start.elapsed().as_secs_f64();

    stats.latency_us.sort_unstable();
    stats.lag_us.sort_unstable();
    stats.delivery_us.sort_unstable();
    let active = match (stats.first_send, stats.last_ack) {
        (Some(a), Some(b)) if b > a => (b - a).as_secs_f64(),
        _ => 0.0,
    };
    let target_rps = n as f64;
    let achieved_rps = if active > 0.0 { stats.acked as f64 / active } else { 0.0 };
    let lost_rows = stats.rows_sent - stats.rows_acked;
    let summary = serde_json::json!({
        "server": server,
        "agents": n,
        "gpus_per_agent": args.gpus_per_agent,
        "duration_s": seconds,
        "connections": connections,
        "first_window_end_unix_s": first_end / 1_000_000,
        "last_window_end_unix_s": last_end / 1_000_000,
        "target_rps": target_rps,
        "achieved_rps": round3(achieved_rps),
        "active_s": round3(active),
        "requests": stats.attempts,
        "requests_ok": stats.acked,
        "duplicates": stats.duplicates,
        "retried_batches": stats.retried_batches,
        "non_2xx": stats.non_2xx.iter().map(|(k, v)| (k.to_string(), *v)).collect::<BTreeMap<_, _>>(),
        "errors": stats.errors,
        "rejected_batches": stats.rejected_batches,
        "rejected_rows": stats.rejected_rows,
        "undelivered_batches": stats.undelivered_batches,
        "undelivered_rows": stats.undelivered_rows,
        "rows_sent": stats.rows_sent,
        "rows_acked": stats.rows_acked,
        "mean_body_bytes": stats.body_bytes.checked_div(stats.attempts).unwrap_or(0),
        "ack_latency_ms": percentiles(&stats.latency_us),
        "send_lag_ms": percentiles(&stats.lag_us),
        "delivery_ms": percentiles(&stats.delivery_us),
        "generator": {
            "wall_s": round3(wall),
            "cpu_s": round3(cpu),
            "cpu_pct_one_core": round3(100.0 * cpu / wall.max(1e-9)),
            "sim_ms_mean": round3(gen_us_total as f64 / seconds as f64 / 1000.0),
            "sim_ms_max": round3(gen_us_max as f64 / 1000.0),
            "sim_late_windows": gen_late,
            "encode_us_mean": round3(stats.encode_us as f64 / (stats.rows_sent.max(1) as f64 / args.gpus_per_agent as f64)),
            "pregen": pregen_stats,
        },
    });
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&summary)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    let l = &summary["ack_latency_ms"];
    println!("agents {n} × {} GPUs, {seconds} s, {connections} connections", args.gpus_per_agent);
    println!(
        "requests {} ok {} (target {target_rps:.0} req/s, achieved {achieved_rps:.1} req/s over {active:.1} s), duplicates {}, retried batches {}",
        stats.attempts, stats.acked, stats.duplicates, stats.retried_batches
    );
    println!("non-2xx {:?}, transport errors {:?}", stats.non_2xx, stats.errors);
    println!(
        "ack latency ms: p50 {} p90 {} p99 {} p99.9 {} max {} (mean {})",
        l["p50"], l["p90"], l["p99"], l["p99_9"], l["max"], l["mean"]
    );
    let g = &summary["send_lag_ms"];
    println!("send lag ms (due → first attempt): p50 {} p99 {} max {}", g["p50"], g["p99"], g["max"]);
    println!(
        "rows sent {} acknowledged {} rejected {} undelivered {}",
        stats.rows_sent, stats.rows_acked, stats.rejected_rows, stats.undelivered_rows
    );
    println!(
        "generator: cpu {cpu:.1} s over {wall:.1} s ({:.1}% of one core), sim {:.1} ms/window (max {:.1}), late windows {gen_late}",
        100.0 * cpu / wall.max(1e-9),
        gen_us_total as f64 / seconds as f64 / 1000.0,
        gen_us_max as f64 / 1000.0
    );
    if lost_rows > 0 {
        eprintln!("loadgen: {lost_rows} rows were not acknowledged");
        std::process::exit(2);
    }
    Ok(())
}
