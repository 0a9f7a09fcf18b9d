//! The incremental cost ledger equals the whole computation.
//!
//! A 27-hour trace of a small fleet arrives pass by pass, as agents would send it —
//! with late batches for hours already priced (one for the previous day after
//! midnight), a GPU that goes silent, one that appears at noon, a MIG instance created
//! in the afternoon and processes of a mapped user on unheld time. After every pass the
//! ledger computes only the hours the new data can change; at the end a fresh ledger
//! computes every day whole from the same store, and both tables must be identical
//! row for row (seconds and dollars as exact decimals).
//!
//! The recommender over the same arrival: its runs keep whole hours (partials and
//! per-minute series) and read again only those that received rows; every few passes,
//! and at the end, its answer equals that of a recommender that reads the whole window,
//! and at the end that of one that can keep nothing (every piece and every replay from
//! raw windows).

use std::time::Duration;

use super::cost::{BOOK, D, DAY, SEC};
use super::rollup::open;
use apron::ledger::{CostConfig, Ledger, Plan};
use apron::recommend::{RecommendSettings, Recommender};
use apron_collector::{IngestRequest, Table};
use apron_common::wire::{encode_ipc, processes_to_batch, windows_to_batch};
use apron_common::{Field, FieldStats, GpuHolder, GpuIdentity, GpuUuid, GpuWindow, HostName, ProcessRow, UnixMicros};
use apron_query::{Format, QueryEngine};

const MIN: i64 = 60 * SEC;
const HOUR: i64 = 60 * MIN;
const T0: i64 = D * DAY;
const STEP: i64 = 10 * SEC;

/// A small deterministic generator (no dependency, same trace on every run).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % n
    }
}

fn identity(uuid: &str, host: &str) -> GpuIdentity {
    GpuIdentity::gpu(HostName::new(host).expect("host"), GpuUuid::new(uuid).expect("uuid"), 0, "NVIDIA H100 80GB HBM3")
}

fn holders() -> Vec<Option<GpuHolder>> {
    let mut ml = GpuHolder::pod(Some("ml".into()), Some("train-a".into()), None);
    ml.pod_labels = Some(r#"{"team":"ml"}"#.into());
    vec![
        Some(ml),
        Some(GpuHolder::pod(Some("research".into()), Some("nb-0".into()), None)),
        Some(GpuHolder::slurm_job("4242")),
        None,
        None,
    ]
}

/// Windows of one GPU over `[from, to)`: segments of 5–120 min, each with one holder
/// and busy (well or under-used) or idle, and now and then a few missing windows.
fn gpu_trace(rng: &mut Lcg, id: &GpuIdentity, from: i64, to: i64, out: &mut Vec<GpuWindow>) {
    let holders = holders();
    let mut t = from;
    while t < to {
        let seg_end = (t + (5 + rng.next(116) as i64) * MIN).min(to);
        let holder = holders[rng.next(holders.len() as u64) as usize].clone();
        let (mean, max) = match rng.next(4) {
            0 | 1 => (0.0, 0.0),
            2 => (0.1, 0.3),
            _ => (0.6, 0.8),
        };
        while t < seg_end {
            t += STEP;
            if rng.next(300) == 0 {
                t += STEP * (1 + rng.next(20) as i64);
                continue;
            }
            let mut w = GpuWindow::new(UnixMicros(t), Duration::from_secs(10), id.clone());
            let stats = Some(FieldStats { count: 10, mean, min: 0.0, max, last: mean });
            w.fields[Field::SmActive.index()] = stats;
            w.fields[Field::GpuUtil.index()] = stats;
            w.owner = holder.clone();
            out.push(w);
        }
    }
}

fn trace() -> (Vec<GpuWindow>, Vec<ProcessRow>) {
    let seed = std::env::var("APRON_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(7);
    let mut rng = Lcg(seed);
    let mut w = Vec::new();
    let end = T0 + DAY + 3 * HOUR;
    gpu_trace(&mut rng, &identity("GPU-A", "node-0"), T0, end, &mut w);
    // Silent from 15:00.
    gpu_trace(&mut rng, &identity("GPU-B", "node-0"), T0, T0 + 15 * HOUR, &mut w);
    // First seen at noon.
    gpu_trace(&mut rng, &identity("GPU-C", "node-1"), T0 + 12 * HOUR, end, &mut w);
    // A MIG parent (its own windows) with one instance all along and one from 13:00.
    let parent = identity("GPU-M", "node-1");
    let mut m1 = identity("MIG-M-1", "node-1");
    m1.parent_gpu_uuid = Some(GpuUuid::new("GPU-M").expect("uuid"));
    m1.mig_profile = Some("3g.40gb".into());
    let mut m2 = m1.clone();
    m2.gpu_uuid = GpuUuid::new("MIG-M-2").expect("uuid");
    m2.mig_profile = Some("2g.20gb".into());
    gpu_trace(&mut rng, &parent, T0, end, &mut w);
    gpu_trace(&mut rng, &m1, T0, end, &mut w);
    gpu_trace(&mut rng, &m2, T0 + 13 * HOUR, end, &mut w);
    // Carol (mapped to a team) runs on GPU-A every 5 s from 04:00 to 09:00.
    let procs = (0..3600)
        .map(|k| super::process(T0 + 4 * HOUR + k * 5 * SEC, "node-0", "GPU-A", 4000, Some("carol")))
        .collect();
    (w, procs)
}

/// Held back until a later pass: (GPU, from, to, released at).
fn late(w: &GpuWindow) -> Option<i64> {
    let t = w.time.0;
    let uuid = w.gpu.gpu_uuid.as_str();
    if uuid == "GPU-B" && (T0 + 2 * HOUR..T0 + 2 * HOUR + 40 * MIN).contains(&t) {
        return Some(T0 + 14 * HOUR);
    }
    if uuid == "GPU-A" && (T0 + 23 * HOUR + 40 * MIN..T0 + 23 * HOUR + 55 * MIN).contains(&t) {
        return Some(T0 + DAY + HOUR);
    }
    None
}

async fn dump(engine: &QueryEngine) -> Vec<serde_json::Value> {
    let mut out = Vec::new();
    for sql in [
        "SELECT CAST(hour AS VARCHAR), \"cluster\", host, gpu_uuid, gpu_model, team, \
         CAST(active_s AS VARCHAR), CAST(allocated_idle_s AS VARCHAR), CAST(stranded_s AS VARCHAR), \
         CAST(unallocated_idle_s AS VARCHAR), CAST(unallocated_busy_s AS VARCHAR), CAST(unknown_s AS VARCHAR), \
         CAST(underused_s AS VARCHAR), CAST(price_per_gpu_hour AS VARCHAR), CAST(cost_usd AS VARCHAR), \
         CAST(idle_cost_usd AS VARCHAR), CAST(stranded_cost_usd AS VARCHAR) \
         FROM gpu_cost_hourly ORDER BY 1, 4, 6",
        "SELECT gpu_uuid, host, CAST(start_time AS VARCHAR), CAST(end_time AS VARCHAR), owner_kind, owner, team, \
         workload_kind, interruptible, source, \"cluster\", CAST(held_through AS VARCHAR) \
         FROM allocations ORDER BY 1, 3, 6",
    ] {
        let r = engine.execute(sql).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
        let j: serde_json::Value = serde_json::from_slice(&r.render(Format::Json).expect("render")).expect("json");
        out.extend(j["rows"].as_array().expect("rows").iter().cloned());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passes_over_new_data_equal_the_whole_computation() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = open(dir.path());
    let store = server.store().clone();
    let book = dir.path().join("prices.toml");
    std::fs::write(&book, BOOK).expect("book");
    let mut config = CostConfig { price_book: Some(book), ..CostConfig::default() };
    config.teams.users.insert("carol".into(), "vision".into());
    let server = server.with_cost(config.clone()).expect("cost on");
    let ledger = server.ledger().expect("ledger").clone();

    let (mut windows, mut procs) = trace();
    windows.sort_by_key(|w| w.time.0);
    let mut seq = 0u64;
    let mut send = |table: Table, body: Vec<u8>| {
        store.ingest(IngestRequest { table, agent: "a", epoch: "e", sequence: seq, body: &body }).expect("ingest");
        seq += 1;
    };
    let step = std::env::var("APRON_TEST_STEP_MIN").ok().and_then(|s| s.parse().ok()).unwrap_or(35) * MIN;
    let (mut passes, mut partial, mut now) = (0, 0, T0 + 20 * MIN);
    let last = T0 + DAY + 3 * HOUR + 10 * MIN;
    loop {
        let (due, rest): (Vec<GpuWindow>, Vec<GpuWindow>) =
            windows.into_iter().partition(|w| w.time.0 <= now && late(w).is_none_or(|at| at <= now));
        windows = rest;
        if !due.is_empty() {
            send(Table::GpuSamples, encode_ipc(&windows_to_batch(&due).expect("batch")).expect("ipc"));
        }
        let (due, rest): (Vec<ProcessRow>, Vec<ProcessRow>) = procs.into_iter().partition(|p| p.time.0 <= now);
        procs = rest;
        if !due.is_empty() {
            send(Table::GpuProcesses, encode_ipc(&processes_to_batch(&due).expect("batch")).expect("ipc"));
        }
        if passes % 3 == 2 {
            store.persist_now().expect("persist");
        }
        let r = ledger.run_once(now).await;
        assert_eq!(r.errors, Vec::<String>::new(), "pass at {}", UnixMicros(now).to_rfc3339());
        partial += r.plans.iter().filter(|p| matches!(p, Plan::From(_) | Plan::OpenRuns)).count();
        passes += 1;
        if now >= last {
            break;
        }
        now = (now + step).min(last);
    }
    assert!(windows.is_empty());
    let final_now = now;
    let incremental = dump(server.engine()).await;
    assert!(incremental.len() > 100, "{}", incremental.len());
    // Whole: a day's first passes (their hours reach back to midnight anyway).
    assert!(partial * 4 >= passes * 3, "most passes were incremental: {partial} of {passes}");

    // The same store, computed whole by a ledger that never saw it: caught up in steps
    // of `catch_up_step` (the default, 2 h: 13 steps for the first day, 2 for the
    // second), and at once.
    for step in [config.catch_up_step, Duration::ZERO] {
        std::fs::remove_file(dir.path().join("data").join(apron::ledger::STATE_FILE)).expect("state file");
        let config = CostConfig { catch_up_step: step, ..config.clone() };
        let whole = Ledger::new(store.clone(), server.engine().clone(), config).expect("ledger");
        let r = whole.run_once(final_now).await;
        assert_eq!(r.errors, Vec::<String>::new());
        assert!(r.plans.iter().all(|p| *p == Plan::Whole), "{:?}", r.plans);
        assert_eq!(r.computed.len(), 2, "{:?}", r.computed);
        let recomputed = dump(server.engine()).await;
        let only = |a: &[serde_json::Value], b: &[serde_json::Value]| -> Vec<serde_json::Value> {
            a.iter().filter(|r| !b.contains(r)).cloned().collect()
        };
        let (left, right) = (only(&incremental, &recomputed), only(&recomputed, &incremental));
        assert!(
            left.is_empty() && right.is_empty() && incremental == recomputed,
            "catch_up_step {step:?}: only incremental:\n{}\nonly whole:\n{}",
            left.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"),
            right.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n")
        );
    }
}

/// A run's answer without the moment it was generated.
fn answer(set: &apron::recommend::RecommendationSet) -> serde_json::Value {
    let mut v = serde_json::to_value(set).expect("json");
    v.as_object_mut().expect("object").remove("generated_at");
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recommendations_from_stored_hours_equal_reading_the_window_whole() {
    let dir = tempfile::tempdir().expect("tempdir");
    let book = dir.path().join("prices.toml");
    std::fs::write(&book, BOOK).expect("book");
    let config = CostConfig { price_book: Some(book), ..CostConfig::default() };
    let settings = RecommendSettings { gpus_per_query: 2, ..RecommendSettings::default() };
    let server = open(dir.path()).with_cost(config.clone()).expect("cost on").with_recommend(settings.clone());
    let store = server.store().clone();
    let ledger = server.ledger().expect("ledger").clone();
    let rec = server.recommender().expect("recommender").clone();
    let window = Duration::from_secs(24 * 3600);

    let (mut windows, _) = trace();
    windows.sort_by_key(|w| w.time.0);
    let (mut seq, mut passes, mut now) = (0u64, 0u32, T0 + 20 * MIN);
    let last = T0 + DAY + 3 * HOUR + 10 * MIN;
    let (mut items, mut replays) = (0, 0);
    let last_answer = loop {
        let (due, rest): (Vec<GpuWindow>, Vec<GpuWindow>) =
            windows.into_iter().partition(|w| w.time.0 <= now && late(w).is_none_or(|at| at <= now));
        windows = rest;
        if !due.is_empty() {
            let body = encode_ipc(&windows_to_batch(&due).expect("batch")).expect("ipc");
            let req = IngestRequest { table: Table::GpuSamples, agent: "a", epoch: "e", sequence: seq, body: &body };
            store.ingest(req).expect("ingest");
            seq += 1;
        }
        if passes % 3 == 2 {
            store.persist_now().expect("persist");
        }
        let before = rec.pieces_read();
        let stored = rec.compute(window, now).await.expect("run over stored hours");
        let read = rec.pieces_read() - before;
        // Two raw edges, the hour (or two) the pass's windows landed in, and the hour of
        // a late batch: never the whole day again.
        if passes > 0 {
            assert!(read <= 5, "pass at {}: {read} pieces read", UnixMicros(now).to_rfc3339());
        }
        if passes % 8 == 7 || now >= last {
            let fresh = Recommender::new(
                server.engine().clone(),
                ledger.clone(),
                settings.clone(),
                apron_query::SnapshotTable::new(apron::recommend::schema()),
            );
            let whole = fresh.compute(window, now).await.expect("run over the whole window");
            assert_eq!(answer(&stored), answer(&whole), "at {}", UnixMicros(now).to_rfc3339());
            items += stored.recommendations.len();
            replays += stored.recommendations.iter().filter(|r| r.replay.is_some()).count();
            assert_eq!(fresh.raw_replays(), 0, "replays read the stored minutes");
        }
        passes += 1;
        if now >= last {
            break answer(&stored);
        }
        now = (now + 35 * MIN).min(last);
    };
    assert!(windows.is_empty());
    assert!(items > 0 && replays > 0, "the trace gives recommendations and replays to compare");
    assert_eq!(rec.raw_replays(), 0, "replays read the stored minutes");

    // Where no hour can be kept (the directory cannot be made: a full or read-only disk)
    // every run reads its pieces and replays its proposals from raw windows: the same
    // answer.
    store.persist_now().expect("persist");
    drop((rec, ledger, store, server));
    let hours_dir = dir.path().join("data").join("derived").join("recommend-hours");
    std::fs::remove_dir_all(&hours_dir).expect("remove the stored hours");
    std::fs::write(&hours_dir, "not a directory").expect("block the stored hours");
    let server = open(dir.path()).with_cost(config).expect("cost on").with_recommend(settings);
    let rec = server.recommender().expect("recommender").clone();
    let raw = rec.compute(window, last).await.expect("run from raw windows");
    assert!(rec.raw_replays() > 0, "replayed from raw windows");
    assert_eq!(answer(&raw), last_answer);
}
