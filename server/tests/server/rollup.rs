//! `gpu_samples_1m` end to end: a known trace ingested into a real store, the rollup
//! served live, materialized by the server's materializer, served from the stored
//! partition, re-rolled after late data, and read straight from the Parquet file.

use std::time::Duration;

use apron::config::RollupConfig;
use apron::{Access, Server};
use apron_collector::http::IngestOptions;
use apron_collector::{IngestRequest, Store, StoreConfig, Table};
use apron_common::wire::{encode_ipc, windows_to_batch};
use apron_common::{Field, FieldStats, GpuIdentity, GpuUuid, GpuWindow, HostName, UnixMicros};
use apron_query::{Format, QueryConfig, QueryEngine};
use arrow_array::cast::AsArray;
use arrow_array::types::Decimal128Type;

/// 2026-11-19 (day 20776).
const D: i64 = 20_776;
const DAY: i64 = 86_400_000_000;
const SEC: i64 = 1_000_000;
const NOON: i64 = D * DAY + 12 * 3600 * SEC;

fn gpu(g: usize) -> GpuIdentity {
    GpuIdentity::gpu(
        HostName::new(format!("node-{g}")).expect("host"),
        GpuUuid::new(format!("GPU-{g}")).expect("uuid"),
        g as u32,
        "NVIDIA H100 80GB HBM3",
    )
}

fn window(g: usize, end_us: i64, len: Duration, util: f64, util_max: f64) -> GpuWindow {
    let mut w = GpuWindow::new(UnixMicros(end_us), len, gpu(g));
    w.fields[Field::GpuUtil.index()] = Some(FieldStats { count: 1, mean: util, min: util, max: util_max, last: util });
    w
}

/// 2 GPUs × 3 minutes of 1 s windows ending 12:00:00 … 12:02:59 of day D: in minute k
/// (12:0k:00, windows ending 12:0k:00 … 12:0k:59), second i = 1..=60 of GPU g (ending
/// at 12:0k:(i − 1)):
/// - gpu_util = b + i/1000 with b = (3g + k)/10, window max = that + 0.1;
/// - power_watts = 200 + i + 10g for even i, NULL for odd i;
/// - gpu_temp_c = 50 + g + k.
fn trace() -> Vec<GpuWindow> {
    let mut rows = Vec::new();
    for g in 0..2 {
        for k in 0..3i64 {
            for i in 1..=60i64 {
                let b = (3 * g as i64 + k) as f64 / 10.0;
                let u = b + i as f64 / 1000.0;
                let mut w = window(g, NOON + (k * 60 + i - 1) * SEC, Duration::from_secs(1), u, u + 0.1);
                if i % 2 == 0 {
                    w.fields[Field::PowerWatts.index()] = Some(FieldStats::single((200 + i + 10 * g as i64) as f64));
                }
                w.fields[Field::GpuTempC.index()] = Some(FieldStats::single((50 + g as i64 + k) as f64));
                rows.push(w);
            }
        }
    }
    rows
}

/// GPU-0's windows at the day's edges.
fn boundary() -> Vec<GpuWindow> {
    let half = Duration::from_millis(500);
    vec![
        // Ends exactly at D 00:00:00: minute D 00:00:00 (partition D).
        window(0, D * DAY, Duration::from_secs(1), 0.5, 0.5),
        // Ends exactly at D 23:59:00: minute D 23:59:00, the last of partition D.
        window(0, (D + 1) * DAY - 60 * SEC, Duration::from_secs(1), 0.25, 0.25),
        // Ends at D 23:59:59.5 (raw partition D): the same minute.
        window(0, (D + 1) * DAY - SEC / 2, half, 0.75, 0.75),
        // Ends exactly at D+1 00:00:00 (raw partition D+1): minute D+1 00:00:00, the
        // first of partition D+1.
        window(0, (D + 1) * DAY, half, 0.125, 0.125),
    ]
}

fn ingest(store: &Store, sequence: u64, rows: &[GpuWindow]) {
    let body = encode_ipc(&windows_to_batch(rows).expect("batch")).expect("ipc");
    let req = IngestRequest { table: Table::GpuSamples, agent: "a", epoch: "e", sequence, body: &body };
    store.ingest(req).expect("ingest");
}

/// A server on `dir/data` whose background persist and maintenance stay out of the
/// way: the tests drive them.
pub(super) fn open(dir: &std::path::Path) -> Server {
    let store = StoreConfig {
        data_dir: dir.join("data"),
        persist_interval: Duration::from_secs(3600),
        maintenance_interval: Duration::from_secs(3600),
        ..StoreConfig::default()
    };
    let ingest = IngestOptions { tokens: vec!["0123456789abcdef".into()], ..IngestOptions::default() };
    Server::open(store, ingest, QueryConfig::default(), Access::Loopback).expect("open")
}

async fn rows(engine: &QueryEngine, sql: &str) -> Vec<serde_json::Value> {
    let r = engine.execute(sql).await.unwrap_or_else(|e| panic!("{sql}: {e} ({})", e.detail()));
    let j: serde_json::Value = serde_json::from_slice(&r.render(Format::Json).expect("render")).expect("json");
    j["rows"].as_array().expect("rows").clone()
}

const CHECK: &str = "SELECT gpu_uuid, CAST(time AS VARCHAR) AS t, host, gpu_index, window_s, samples, covered_s, \
    gpu_util_mean, CAST(gpu_util_min AS DOUBLE), CAST(gpu_util_max AS DOUBLE), gpu_util_max_mean, \
    CAST(gpu_util_max_max AS DOUBLE), power_watts_mean, CAST(power_watts_min AS DOUBLE), \
    CAST(power_watts_max AS DOUBLE), gpu_temp_c_mean, gpu_temp_c_min, gpu_temp_c_max \
    FROM gpu_samples_1m ORDER BY gpu_uuid, time";

fn f(v: &serde_json::Value) -> Option<f64> {
    v.as_f64()
}

fn close(a: Option<f64>, b: Option<f64>, what: &str) {
    match (a, b) {
        (Some(a), Some(b)) => assert!((a - b).abs() < 1e-9, "{what}: {a} vs {b}"),
        (a, b) => assert_eq!(a, b, "{what}"),
    }
}

/// The hand-computed answer, checked row by row.
fn check(rows: &[serde_json::Value]) {
    // (gpu, minute start, samples, covered_s, util mean/min/max, util_max mean/max,
    //  power mean/min/max, temp mean/min/max)
    type Row = (&'static str, &'static str, i64, f64, [f64; 5], [Option<f64>; 3], [Option<f64>; 3]);
    let mut want: Vec<Row> = Vec::new();
    // GPU-0 at D 00:00:00: the one window ending exactly then (util 0.5).
    want.push(("GPU-0", "2026-11-19T00:00:00", 1, 1.0, [0.5, 0.5, 0.5, 0.5, 0.5], [None; 3], [None; 3]));
    for (g, gpu) in [(0, "GPU-0"), (1, "GPU-1")] {
        for (k, minute) in ["2026-11-19T12:00:00", "2026-11-19T12:01:00", "2026-11-19T12:02:00"].into_iter().enumerate()
        {
            let b = (3 * g + k) as f64 / 10.0;
            // mean of i/1000 for i = 1..=60 is 30.5/1000; window maxima are 0.1 higher.
            let util = [b + 0.0305, b + 0.001, b + 0.060, b + 0.1305, b + 0.160];
            // Even i only: 200 + i + 10g for i = 2..=60, mean i = 31.
            let p = 10.0 * g as f64;
            let power = [Some(231.0 + p), Some(202.0 + p), Some(260.0 + p)];
            let t = Some((50 + g + k) as f64);
            want.push((gpu, minute, 60, 60.0, util, power, [t; 3]));
        }
        if g == 0 {
            // D 23:59:00: windows ending 23:59:00 (1 s, 0.25) and 23:59:59.5 (0.5 s,
            // 0.75): mean (0.25 + 0.75) / 2 = 0.5, covered 1.5.
            want.push((gpu, "2026-11-19T23:59:00", 2, 1.5, [0.5, 0.25, 0.75, 0.5, 0.75], [None; 3], [None; 3]));
            // D+1 00:00:00: the window ending exactly then (0.5 s, 0.125).
            want.push((gpu, "2026-11-20T00:00:00", 1, 0.5, [0.125; 5], [None; 3], [None; 3]));
        }
    }
    // Order by gpu_uuid, time.
    want.sort_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
    assert_eq!(rows.len(), want.len(), "{rows:#?}");
    for (r, w) in rows.iter().zip(&want) {
        let what = format!("{} {}", w.0, w.1);
        assert_eq!(r[0], w.0, "{what}");
        assert!(r[1].as_str().expect("time").starts_with(w.1), "{what}: {}", r[1]);
        assert_eq!(r[2], if w.0 == "GPU-0" { "node-0" } else { "node-1" }, "{what}");
        assert_eq!(r[3], if w.0 == "GPU-0" { 0 } else { 1 }, "{what}");
        assert_eq!(f(&r[4]), Some(60.0), "{what}: window_s");
        assert_eq!(r[5], w.2, "{what}: samples");
        close(f(&r[6]), Some(w.3), &format!("{what}: covered_s"));
        for (j, v) in w.4.iter().enumerate() {
            close(f(&r[7 + j]), Some(*v), &format!("{what}: util column {j}"));
        }
        for (j, v) in w.5.iter().enumerate() {
            close(f(&r[12 + j]), *v, &format!("{what}: power column {j}"));
        }
        for (j, v) in w.6.iter().enumerate() {
            close(f(&r[15 + j]), *v, &format!("{what}: temp column {j}"));
        }
    }
}

/// `date_trunc` groups minutes into exactly the hours and days it groups their windows
/// into: per GPU, hour and day, the windows and the seconds they cover agree.
async fn same_hours_and_days(engine: &QueryEngine) {
    for unit in ["hour", "day"] {
        let minutes = rows(
            engine,
            &format!(
                "SELECT gpu_uuid, CAST(date_trunc('{unit}', time) AS VARCHAR) AS t, sum(samples), sum(covered_s) \
                 FROM gpu_samples_1m GROUP BY 1, 2 ORDER BY 1, 2"
            ),
        )
        .await;
        let windows = rows(
            engine,
            &format!(
                "SELECT gpu_uuid, CAST(date_trunc('{unit}', time) AS VARCHAR) AS t, count(*), sum(window_s) \
                 FROM gpu_samples GROUP BY 1, 2 ORDER BY 1, 2"
            ),
        )
        .await;
        assert_eq!(minutes, windows, "{unit}");
        assert!(minutes.len() >= 3, "{unit}: {minutes:?}");
    }
}

async fn plan(engine: &QueryEngine, sql: &str) -> String {
    let r = rows(engine, &format!("EXPLAIN {sql}")).await;
    r.iter().map(|row| row[1].as_str().unwrap_or_default().to_owned()).collect::<Vec<_>>().join("\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_samples_1m_live_materialized_and_rerolled() {
    let dir = tempfile::tempdir().expect("tempdir");
    // One GPU per slice: a day is written in two parts, in UUID order.
    let server = open(dir.path()).with_rollup(RollupConfig { gpus_per_query: 1, ..RollupConfig::default() });
    let store = server.store().clone();
    let engine = server.engine().clone();
    let m = server.materializer();
    ingest(&store, 1, &trace());
    ingest(&store, 2, &boundary());

    // Live: visible as soon as ingested, nothing stored yet.
    assert_eq!(
        engine.tables(),
        [
            "gpu_samples",
            "gpu_processes",
            "gpu_samples_1m",
            "allocations",
            "gpu_cost_hourly",
            "alerts",
            "recommendations"
        ]
    );
    let live = rows(&engine, CHECK).await;
    check(&live);
    same_hours_and_days(&engine).await;

    // Clock: D+2 02:00, so D and D+1 are finished (compaction_delay 1h).
    let now = (D + 2) * DAY + 2 * 3600 * SEC;
    let r = m.run_once(now).await;
    assert!(r.materialized.is_empty() && r.errors.is_empty(), "raw rows still in memory: {r:?}");
    assert_eq!(r.waiting, ["2026-11-19", "2026-11-20"]);
    store.persist_now().expect("persist");
    let r = m.run_once(now).await;
    assert!(r.errors.is_empty(), "{r:?}");
    // D: 2 × 3 minutes + D 00:00 + D 23:59 for GPU-0; D+1: its 00:00 minute.
    assert_eq!(r.materialized, [("2026-11-19".to_owned(), 8), ("2026-11-20".to_owned(), 1)]);
    assert!(m.run_once(now).await.materialized.is_empty(), "current days are not re-rolled");
    assert!(m.state_path().exists());

    // Served from the stored partitions now, with the same answer.
    let p = plan(&engine, "SELECT * FROM gpu_samples_1m").await;
    assert!(p.contains("gpu_samples_1m/date=2026-11-19"), "{p}");
    let stored = rows(&engine, CHECK).await;
    assert_eq!(stored, live);
    check(&stored);
    // A time filter bounds both parts.
    let one = rows(&engine, "SELECT samples FROM gpu_samples_1m WHERE time = '2026-11-19T23:59:00Z'").await;
    assert_eq!(one.len(), 1);
    assert_eq!(one[0][0], 2);
    same_hours_and_days(&engine).await;

    // The stored Parquet: extremes as exact decimals, means as Float64.
    let files = store.persisted_files(Table::GpuSamples1m);
    let day = files.iter().find(|f| f.date == "2026-11-19").expect("partition D");
    let file = std::fs::File::open(&day.path).expect("open parquet");
    let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
        .expect("reader")
        .build()
        .expect("build");
    let batches: Vec<_> = reader.collect::<Result<_, _>>().expect("read");
    let b = &batches[0];
    let schema = b.schema();
    let ty = |n: &str| schema.field_with_name(n).expect(n).data_type().to_string();
    assert_eq!(ty("gpu_util_min"), "Decimal128(5, 4)");
    assert_eq!(ty("gpu_util_max_max"), "Decimal128(5, 4)");
    assert_eq!(ty("power_watts_max"), "Decimal128(9, 3)");
    assert_eq!(ty("gpu_temp_c_min"), "Int32");
    assert_eq!(ty("gpu_util_mean"), "Float64");
    let total: usize = batches.iter().map(|b| b.num_rows()).sum();
    assert_eq!(total, 8);
    let mins = b.column_by_name("gpu_util_min").expect("col").as_primitive::<Decimal128Type>();
    // GPU-0's 12:01 minimum 0.001 is 10 units of 1e-4.
    assert!(mins.iter().flatten().any(|v| v == 10), "{mins:?}");

    // Late data for D: visible at once (live while only in memory), stale after its
    // persist, re-rolled by the next pass.
    let late = window(1, NOON + 30 * SEC + SEC / 2, Duration::from_millis(500), 0.9, 0.9);
    ingest(&store, 3, &[late]);
    let q = "SELECT samples, CAST(gpu_util_max AS DOUBLE) FROM gpu_samples_1m WHERE gpu_uuid = 'GPU-1' AND time = '2026-11-19T12:00:00Z'";
    assert_eq!(rows(&engine, q).await, [serde_json::json!([61, 0.9])]);
    store.persist_now().expect("persist");
    assert_eq!(rows(&engine, q).await, [serde_json::json!([61, 0.9])], "stale: computed live");
    let r = m.run_once(now).await;
    // Only D: rollup day D+1 reads raw day D+1 alone.
    assert_eq!(r.materialized, [("2026-11-19".to_owned(), 8)], "{r:?}");
    assert_eq!(rows(&engine, q).await, [serde_json::json!([61, 0.9])], "re-rolled");
    assert!(plan(&engine, q).await.contains("gpu_samples_1m/date=2026-11-19"));

    // The stored table is not visible to users; gpu_samples_1m is a table.
    let t = rows(
        &engine,
        "SELECT table_name, table_type FROM information_schema.tables WHERE table_name LIKE 'gpu_samples_1m%'",
    )
    .await;
    assert_eq!(t, [serde_json::json!(["gpu_samples_1m", "BASE TABLE"])]);
    assert!(engine.execute("SELECT * FROM gpu_samples_1m_stored").await.is_err());
    assert!(engine.execute("CREATE VIEW v AS SELECT * FROM gpu_samples_1m").await.is_err());
}

/// A data directory from before start labels (stored minutes labelled by their end, a
/// state file without `labels`) is moved over by the materializer's first pass: days raw
/// data covers are re-rolled from raw, older ones rewritten from their own rows, and
/// every minute then reads as if it had been start-labelled from the first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn end_labelled_minutes_are_moved_over_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = open(dir.path()).with_rollup(RollupConfig { gpus_per_query: 1, ..RollupConfig::default() });
    let (store, engine, m) = (server.store().clone(), server.engine().clone(), server.materializer());
    ingest(&store, 1, &trace());
    ingest(&store, 2, &boundary());
    store.persist_now().expect("persist");
    let now = (D + 2) * DAY + 2 * 3600 * SEC;
    assert!(m.run_once(now).await.errors.is_empty());
    let want = rows(&engine, CHECK).await;
    check(&want);

    // The same minutes five days earlier as an old version stored them: labelled by
    // their end, one minute later (D−5 23:59 becomes D−4 00:00, in D−4's partition).
    let columns: Vec<String> = apron_query::rollup::rollup_columns().into_iter().map(|(_, n)| n).collect();
    let store_old = |back_days: i64, day: i64, date: &'static str| {
        let (engine, store) = (engine.clone(), store.clone());
        let old = columns.join(", ").replacen(
            "time",
            &format!("time - INTERVAL '{back_days} days' + INTERVAL '1 minute' AS time"),
            1,
        );
        async move {
            let sql = format!(
                "SELECT * FROM (SELECT {old} FROM gpu_samples_1m WHERE time >= '2026-11-19T00:00:00Z') \
                 WHERE time >= '{}' AND time < '{}' ORDER BY gpu_uuid, time",
                UnixMicros(day * DAY).to_rfc3339(),
                UnixMicros((day + 1) * DAY).to_rfc3339()
            );
            let r = engine.execute(&sql).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
            let parts: Vec<_> = r.batches.iter().map(apron_query::rollup::to_wire).collect();
            store.replace_partition_sorted(Table::GpuSamples1m, date, parts.into_iter()).expect("store old minutes");
        }
    };
    store_old(5, D - 5, "2026-11-14").await;
    store_old(5, D - 4, "2026-11-15").await;
    let state = m.state_path().to_path_buf();
    std::fs::write(&state, r#"{"days": {}}"#).expect("old state file");
    // Until moved over, raw-covered days are served live and so are still right.
    assert_eq!(
        rows(&engine, CHECK.replace("ORDER BY", "WHERE time >= '2026-11-19T00:00:00Z' ORDER BY").as_str()).await,
        want
    );

    let r = m.run_once(now).await;
    assert!(r.errors.is_empty(), "{r:?}");
    assert_eq!(r.relabelled, [("2026-11-14".to_owned(), 8), ("2026-11-15".to_owned(), 1)]);
    assert_eq!(r.materialized, [("2026-11-19".to_owned(), 8), ("2026-11-20".to_owned(), 1)]);
    let saved: serde_json::Value = serde_json::from_slice(&std::fs::read(&state).expect("state")).expect("json");
    assert_eq!(saved["labels"], "start");
    let again = m.run_once(now).await;
    assert!(again.relabelled.is_empty() && again.materialized.is_empty(), "{again:?}");

    // Every minute now as start labels have it: the old days are the new ones, 5 days on.
    assert_eq!(rows(&engine, CHECK).await[..].len(), 2 * want.len());
    let moved = CHECK
        .replacen("CAST(time AS VARCHAR)", "CAST(time + INTERVAL '5 days' AS VARCHAR)", 1)
        .replace("ORDER BY", "WHERE time < '2026-11-19T00:00:00Z' ORDER BY");
    assert_eq!(rows(&engine, &moved).await, want);
    assert_eq!(
        rows(&engine, CHECK.replace("ORDER BY", "WHERE time >= '2026-11-19T00:00:00Z' ORDER BY").as_str()).await,
        want
    );

    // A restart while a day was being moved: the state names the day and its files
    // before the rewrite. Its files have changed since, so the rewrite was committed:
    // the day is recorded, not moved a second time.
    store_old(9, D - 9, "2026-11-10").await;
    let mut s: serde_json::Value = serde_json::from_slice(&std::fs::read(&state).expect("state")).expect("json");
    s["labels"] = "relabelling".into();
    s["relabelling"] = serde_json::json!([D - 9, ["gone.parquet"]]);
    std::fs::write(&state, serde_json::to_vec(&s).expect("encode")).expect("write state");
    let r = m.run_once(now).await;
    assert!(r.errors.is_empty() && r.relabelled.is_empty(), "{r:?}");
    let saved: serde_json::Value = serde_json::from_slice(&std::fs::read(&state).expect("state")).expect("json");
    assert_eq!(saved["labels"], "start");
    assert!(saved["days"].get((D - 9).to_string()).is_some(), "{saved}");
    assert!(saved.get("relabelling").is_none(), "{saved}");
    let kept = rows(
        &engine,
        "SELECT count(*), CAST(min(time) AS VARCHAR) FROM gpu_samples_1m WHERE time >= '2026-11-10T00:00:00Z' AND time < \
         '2026-11-11T00:00:00Z'",
    )
    .await;
    // Still end-labelled: D 00:00 moved back 9 days is 00:01 (a second move makes it 00:00).
    assert_eq!(kept[0][0], 7, "{kept:?}");
    assert!(kept[0][1].as_str().is_some_and(|t| t.starts_with("2026-11-10T00:01:00")), "{kept:?}");
}
