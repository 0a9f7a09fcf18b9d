//! The cost ledger at fleet scale: incremental passes against whole computations of the
//! same data, side by side in one run (docs/benchmarks.md, "The ledger at fleet scale").
//!
//! ```text
//!  1. N simulated GPUs (SimSource::history: the fleet `apron up` seeds, 1 s windows)
//!     for H hours ending at END are ingested in-process (Store::ingest_waiting)
//!  2. ledger A prices the day (its first pass: whole)
//!  3. K times: STEP more history is ingested; ledger A passes again (incremental, from
//!     the change feed), then a fresh ledger B, with no state, computes the same day
//!     whole; both timed, with VmHWM
//! ```
//!
//! ```sh
//! cargo run --release -p apron --example ledger_bench -- --gpus 256 --hours 12 --passes 3
//! ```
//!
//! END is 2026-11-19 + `--end-hour`, so the whole span lies in one UTC day and both
//! ledgers compute exactly one day. No user map: the process fallback is not exercised.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use apron::ledger::{CostConfig, Ledger, LedgerReport};
use apron::{Access, Server};
use apron_agent::source::sim::{SimConfig, SimSource};
use apron_collector::http::IngestOptions;
use apron_collector::{INGEST_PATIENCE, IngestRequest, Store, StoreConfig, Table};
use apron_common::UnixMicros;
use apron_common::wire::{encode_ipc, windows_to_batch};
use apron_query::QueryConfig;
use clap::Parser;

const DAY_US: i64 = 86_400_000_000;
/// 2026-11-19.
const DAY: i64 = 20_776;

#[derive(Debug, Parser)]
#[command(about = "Times incremental cost-ledger passes against whole computations of the same day.")]
struct Args {
    #[arg(long, default_value_t = 64)]
    gpus: u32,
    #[arg(long, default_value_t = 8)]
    gpus_per_node: u32,
    /// Hours of history before the first pass (all in one day: at most `--end-hour`).
    #[arg(long, default_value_t = 12.0)]
    hours: f64,
    /// The first pass's clock, hours after midnight UTC.
    #[arg(long, default_value_t = 20.0)]
    end_hour: f64,
    /// Incremental passes after the first.
    #[arg(long, default_value_t = 3)]
    passes: u32,
    /// History added before each of them (the `[cost] interval`).
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
    step: Duration,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Data directory (default: a new temporary one, removed at the end).
    #[arg(long)]
    data: Option<PathBuf>,
}

fn vm_hwm_mib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmHWM:")).map(str::to_owned))
        .and_then(|l| l.split_whitespace().nth(1).and_then(|k| k.parse::<u64>().ok()))
        .map_or(0, |kb| kb / 1024)
}

/// Ingests the fleet's windows ending in `(from, to]`; returns how many.
fn ingest(store: &Store, sim: &SimSource, from: i64, to: i64, seq: &mut u64) -> anyhow::Result<u64> {
    let mut history = sim.history(UnixMicros(from), UnixMicros(to), Duration::from_secs(1)).peekable();
    let (mut rows, mut n) = (Vec::with_capacity(8192), 0u64);
    while history.peek().is_some() {
        rows.clear();
        rows.extend(history.by_ref().take(8192));
        let body = encode_ipc(&windows_to_batch(&rows).context("wire batch")?).context("ipc")?;
        let req = IngestRequest { table: Table::GpuSamples, agent: "bench", epoch: "e", sequence: *seq, body: &body };
        store.ingest_waiting(req, INGEST_PATIENCE).context("ingest")?;
        *seq += 1;
        n += rows.len() as u64;
    }
    Ok(n)
}

fn describe(r: &LedgerReport) -> String {
    let plans: Vec<String> = r.plans.iter().map(apron::ledger::Plan::describe).collect();
    let rows: Vec<String> = r.computed.iter().map(|(d, c, a)| format!("{d}: {c} cost rows, {a} allocations")).collect();
    format!("{} [{}]", plans.join(", "), rows.join("; "))
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if !(args.hours > 0.0 && args.hours <= args.end_hour && args.end_hour < 24.0) {
        bail!("need 0 < --hours <= --end-hour < 24");
    }
    let temp = tempfile::tempdir().context("temporary directory")?;
    let data = args.data.clone().unwrap_or_else(|| temp.path().join("data"));
    let store_config = StoreConfig { data_dir: data.clone(), ..StoreConfig::default() };
    let ingest_options = IngestOptions { tokens: vec!["0123456789abcdef".into()], ..IngestOptions::default() };
    let server = Server::open(store_config, ingest_options, QueryConfig::default(), Access::Loopback)?;
    let book = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/pricebook.example.toml");
    let config = CostConfig { price_book: Some(book.into()), ..CostConfig::default() };
    let server = server.with_cost(config.clone())?;
    let (store, engine) = (server.store().clone(), server.engine().clone());
    let ledger = server.ledger().context("ledger")?.clone();

    let end = DAY * DAY_US + (args.end_hour * 3.6e9) as i64;
    let start = end - (args.hours * 3.6e9) as i64;
    let sim_config = SimConfig {
        nodes: args.gpus / args.gpus_per_node.max(1),
        gpus_per_node: args.gpus_per_node,
        seed: args.seed,
        ..SimConfig::default()
    };
    let sim = SimSource::starting_at(&sim_config, None, UnixMicros(start)).context("simulated fleet")?;
    let gpus = sim_config.nodes * sim_config.gpus_per_node;
    println!("ledger_bench: {gpus} GPUs, {} h of 1 s windows to {}", args.hours, UnixMicros(end).to_rfc3339());

    let mut seq = 0;
    let t = Instant::now();
    let n = ingest(&store, &sim, start, end, &mut seq)?;
    println!("ingested {n} windows in {:.1} s; VmHWM {} MiB", t.elapsed().as_secs_f64(), vm_hwm_mib());

    let t = Instant::now();
    let r = ledger.run_once(end).await;
    if !r.errors.is_empty() {
        bail!("first pass: {:?}", r.errors);
    }
    println!("first pass (A): {:.2} s, {}; VmHWM {} MiB", t.elapsed().as_secs_f64(), describe(&r), vm_hwm_mib());

    let step = i64::try_from(args.step.as_micros()).context("--step")?;
    let mut now = end;
    let (mut inc_total, mut whole_total) = (0.0, 0.0);
    for pass in 1..=args.passes {
        let n = ingest(&store, &sim, now, now + step, &mut seq)?;
        now += step;
        let t = Instant::now();
        let r = ledger.run_once(now).await;
        let inc = t.elapsed().as_secs_f64();
        if !r.errors.is_empty() {
            bail!("incremental pass: {:?}", r.errors);
        }
        println!("pass {pass}: +{n} windows; incremental (A) {inc:.2} s, {}; VmHWM {} MiB", describe(&r), vm_hwm_mib());
        std::fs::remove_file(data.join(apron::ledger::STATE_FILE)).context("ledger state")?;
        let whole = Ledger::new(store.clone(), engine.clone(), config.clone()).map_err(anyhow::Error::msg)?;
        let t = Instant::now();
        let r = Arc::new(whole).run_once(now).await;
        let full = t.elapsed().as_secs_f64();
        if !r.errors.is_empty() {
            bail!("whole pass: {:?}", r.errors);
        }
        println!(
            "pass {pass}: whole (B) {full:.2} s, {}; ratio whole/incremental {:.1}×; VmHWM {} MiB",
            describe(&r),
            full / inc,
            vm_hwm_mib()
        );
        inc_total += inc;
        whole_total += full;
    }
    if args.passes > 0 {
        let k = f64::from(args.passes);
        println!(
            "mean over {} passes: incremental {:.2} s, whole {:.2} s ({:.1}×); per GPU: {:.2} ms vs {:.2} ms",
            args.passes,
            inc_total / k,
            whole_total / k,
            whole_total / inc_total,
            inc_total / k / f64::from(gpus) * 1e3,
            whole_total / k / f64::from(gpus) * 1e3
        );
    }
    Ok(())
}
