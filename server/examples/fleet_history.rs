//! Ships N simulated GPUs × H hours of history to `apron serve` through the real HTTP
//! ingest path, as fast as the server acknowledges it (`scripts/bench-fleet.sh`,
//! docs/benchmarks.md, "Fleet benchmark").
//!
//! ```text
//!  generator (this thread)                     senders (--senders threads, keep-alive)
//!  SimSource::history: the fleet `apron up`    POST /api/v1/ingest, bearer token, one
//!  simulates (owners included), 1 s windows,   agent id, one epoch, sequence numbers in
//!  time-major; --chunk rows per body,  ──────► order of generation; 2xx → acknowledged,
//!  wire::windows_to_batch + encode_ipc          429/503/no answer → retried after
//!  (bounded queue: 2 bodies per sender)         Retry-After (or 1 s), 4xx → fatal
//! ```
//!
//! Prints one `key=value` line: windows, requests, retries (back-pressure answers),
//! elapsed seconds, windows/s and the generator's share of this process's CPU.
//!
//! ```sh
//! cargo run --release -p apron --example fleet_history -- --server http://127.0.0.1:9402 \
//!     --token "$APRON_INGEST_TOKEN" --gpus 256 --hours 24
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use apron_agent::ship::epoch::new_epoch;
use apron_agent::source::sim::{SimConfig, SimSource};
use apron_common::UnixMicros;
use apron_common::wire::{encode_ipc, headers, windows_to_batch};
use clap::Parser;

#[derive(Debug, Parser)]
#[command(about = "Ships simulated GPU history to `apron serve` over HTTP ingest at full speed.")]
struct Args {
    /// The server's base URL.
    #[arg(long, default_value = "http://127.0.0.1:9402")]
    server: String,
    /// Ingest token.
    #[arg(long, env = "APRON_INGEST_TOKEN", hide_env_values = true)]
    token: String,
    #[arg(long, default_value_t = 256)]
    gpus: u32,
    #[arg(long, default_value_t = 8)]
    gpus_per_node: u32,
    /// Hours of history, ending at `--end`.
    #[arg(long, default_value_t = 24.0)]
    hours: f64,
    /// The end of the history, Unix seconds (default: now, to the minute).
    #[arg(long)]
    end: Option<i64>,
    /// Rows per request (the server's `max_rows_per_batch` is the limit).
    #[arg(long, default_value_t = 20_000)]
    chunk: usize,
    /// Concurrent requests.
    #[arg(long, default_value_t = 2)]
    senders: usize,
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

struct Body {
    seq: u64,
    rows: usize,
    bytes: Vec<u8>,
}

#[derive(Default)]
struct Counters {
    acked_rows: AtomicU64,
    requests: AtomicU64,
    retries: AtomicU64,
}

fn cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else { return 0.0 };
    let Some(rest) = stat.rfind(')').map(|i| &stat[i + 2..]) else { return 0.0 };
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of stat: 11 and 12 after the name.
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

/// Sends one body until the server acknowledges it.
fn send(http: &ureq::Agent, args: &Args, epoch: &str, body: &Body, counters: &Counters) -> anyhow::Result<()> {
    let url = format!("{}/api/v1/ingest", args.server);
    loop {
        let sent = http
            .post(&url)
            .header("authorization", format!("Bearer {}", args.token))
            .header("content-type", headers::ARROW_STREAM)
            .header(headers::TABLE, "gpu_samples")
            .header(headers::AGENT, "fleet-history")
            .header(headers::EPOCH, epoch)
            .header(headers::SEQUENCE, body.seq.to_string())
            .send(&body.bytes[..]);
        let wait = match sent {
            Ok(mut resp) => {
                let status = resp.status().as_u16();
                let retry_after = resp
                    .headers()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.trim().parse::<u64>().ok());
                let text = resp.body_mut().with_config().limit(64 * 1024).read_to_string().unwrap_or_default();
                match status {
                    200..=299 => {
                        counters.requests.fetch_add(1, Ordering::Relaxed);
                        counters.acked_rows.fetch_add(body.rows as u64, Ordering::Relaxed);
                        return Ok(());
                    }
                    429 | 500..=599 => Duration::from_secs(retry_after.unwrap_or(1)),
                    s => bail!("HTTP {s} for sequence {}: {}", body.seq, text.trim()),
                }
            }
            Err(e) => {
                eprintln!("fleet_history: sequence {}: {e}; retrying", body.seq);
                Duration::from_secs(1)
            }
        };
        counters.retries.fetch_add(1, Ordering::Relaxed);
        std::thread::sleep(wait);
    }
}

fn main() -> anyhow::Result<()> {
    let args = Arc::new(Args::parse());
    if args.gpus_per_node == 0 || args.gpus % args.gpus_per_node != 0 {
        bail!("--gpus must be a multiple of --gpus-per-node");
    }
    let end = args.end.unwrap_or_else(|| UnixMicros::now().0 / 60_000_000 * 60) * 1_000_000;
    let start = end - (args.hours * 3_600_000_000.0) as i64;
    let sim_config = SimConfig {
        nodes: args.gpus / args.gpus_per_node,
        gpus_per_node: args.gpus_per_node,
        seed: args.seed,
        ..SimConfig::default()
    };
    let sim = SimSource::starting_at(&sim_config, None, UnixMicros(start)).context("simulated fleet")?;
    let epoch = new_epoch();
    let counters = Arc::new(Counters::default());
    let (tx, rx) = mpsc::sync_channel::<Body>(2 * args.senders.max(1));
    let rx = Arc::new(Mutex::new(rx));
    let http: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(120)))
        .http_status_as_error(false)
        .proxy(None)
        .build()
        .into();
    let senders: Vec<_> = (0..args.senders.max(1))
        .map(|_| {
            let (rx, args, counters, http, epoch) =
                (rx.clone(), args.clone(), counters.clone(), http.clone(), epoch.clone());
            std::thread::spawn(move || -> anyhow::Result<()> {
                loop {
                    let body = match rx.lock().map_err(|_| anyhow::anyhow!("queue poisoned"))?.recv() {
                        Ok(b) => b,
                        Err(_) => return Ok(()),
                    };
                    send(&http, &args, &epoch, &body, &counters)?;
                }
            })
        })
        .collect();

    let started = Instant::now();
    let (mut seq, mut generated, mut generating) = (0u64, 0u64, Duration::ZERO);
    let total = u64::from(args.gpus) * ((end - start) / 1_000_000) as u64;
    let mut next_report = total / 10;
    let mut history = sim.history(UnixMicros(start), UnixMicros(end), Duration::from_secs(1)).peekable();
    let mut rows = Vec::with_capacity(args.chunk);
    while history.peek().is_some() {
        let t = Instant::now();
        rows.clear();
        rows.extend(history.by_ref().take(args.chunk));
        let bytes = encode_ipc(&windows_to_batch(&rows)?)?;
        generating += t.elapsed();
        seq += 1;
        generated += rows.len() as u64;
        if tx.send(Body { seq, rows: rows.len(), bytes }).is_err() {
            break; // a sender failed; its error is reported below
        }
        if generated >= next_report {
            eprintln!(
                "fleet_history: {}% generated, {} windows acknowledged, {:.0} s",
                generated * 100 / total.max(1),
                counters.acked_rows.load(Ordering::Relaxed),
                started.elapsed().as_secs_f64()
            );
            next_report += total / 10;
        }
    }
    drop(tx);
    for s in senders {
        s.join().map_err(|_| anyhow::anyhow!("a sender panicked"))??;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let acked = counters.acked_rows.load(Ordering::Relaxed);
    println!(
        "gpus={} hours={} windows={acked} requests={} retries={} elapsed_s={elapsed:.1} windows_per_s={:.0} \
         generator_s={:.1} client_cpu_s={:.1} start_us={start} end_us={end}",
        args.gpus,
        args.hours,
        counters.requests.load(Ordering::Relaxed),
        counters.retries.load(Ordering::Relaxed),
        acked as f64 / elapsed.max(1e-9),
        generating.as_secs_f64(),
        cpu_seconds(),
    );
    if acked != generated {
        bail!("{generated} windows generated, {acked} acknowledged");
    }
    Ok(())
}
