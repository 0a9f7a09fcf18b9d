//! The cost ledger and the weekly report on a known trace, against hand-computed
//! seconds and dollars (never computed by the code under test).

use std::time::Duration;

use super::rollup::open;
use apron::ledger::{CostConfig, Ledger};
use apron::report::{self, ReportFormat};
use apron_collector::{IngestRequest, Table};
use apron_common::wire::{encode_ipc, windows_to_batch};
use apron_common::{Field, FieldStats, GpuHolder, GpuIdentity, GpuUuid, GpuWindow, HostName, UnixMicros};
use apron_cost::IsoWeek;
use apron_cost::report::ShareUnallocated;
use apron_query::{Format, QueryEngine};

/// 2026-11-19, a Thursday of ISO week 2026-W47.
pub(super) const D: i64 = 20_776;
pub(super) const DAY: i64 = 86_400_000_000;
pub(super) const SEC: i64 = 1_000_000;
const TEN: i64 = D * DAY + 10 * 3600 * SEC;

fn gpu() -> GpuIdentity {
    GpuIdentity::gpu(
        HostName::new("node-0").expect("host"),
        GpuUuid::new("GPU-A").expect("uuid"),
        0,
        "NVIDIA H100 80GB HBM3",
    )
}

fn stats(mean: f64, max: f64) -> Option<FieldStats> {
    Some(FieldStats { count: 4, mean, min: 0.0, max, last: mean })
}

/// The trace, 1 s windows of one H100 from 10:00:00 (window ends 10:00:01 …):
///
/// | from–to | holder | sm_active mean/max | expected |
/// | --- | --- | --- | --- |
/// | 10:00–10:20 | ml/train-a (label team=ml) | 0.5 / 0.6 | active 1200 s |
/// | 10:20–11:05 | ml/train-a | 0 / 0 | idle run of 45 min ≥ 30 min: stranded 2700 s |
/// | 11:05–11:15 | ml/train-a | 0.1 / 0.3 | active 600 s, all under-used (< 0.2) |
/// | 11:15–11:35 | ml/train-a | 0 / 0 | idle run of 20 min: allocated idle 1200 s |
/// | 11:35–11:45 | nobody | 0 / 0 | unallocated idle 600 s |
/// | 11:45–11:50 | nobody | 0.4 / 0.5 | unallocated busy 300 s |
/// | 11:50–12:00 | no data | | unknown 600 s |
pub(super) fn trace() -> Vec<GpuWindow> {
    let mut holder = GpuHolder::pod(Some("ml".into()), Some("train-a".into()), None);
    holder.pod_labels = Some(r#"{"team":"ml","app":"trainer"}"#.into());
    let segments: [(i64, i64, bool, f64, f64); 6] = [
        (0, 1200, true, 0.5, 0.6),
        (1200, 3900, true, 0.0, 0.0),
        (3900, 4500, true, 0.1, 0.3),
        (4500, 5700, true, 0.0, 0.0),
        (5700, 6300, false, 0.0, 0.0),
        (6300, 6600, false, 0.4, 0.5),
    ];
    let mut rows = Vec::new();
    for (from, to, held, mean, max) in segments {
        for s in from + 1..=to {
            let mut w = GpuWindow::new(UnixMicros(TEN + s * SEC), Duration::from_secs(1), gpu());
            w.fields[Field::SmActive.index()] = stats(mean, max);
            w.fields[Field::GpuUtil.index()] = stats(mean, max);
            w.owner = held.then(|| holder.clone());
            rows.push(w);
        }
    }
    rows
}

async fn rows(engine: &QueryEngine, sql: &str) -> Vec<serde_json::Value> {
    let r = engine.execute(sql).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
    let j: serde_json::Value = serde_json::from_slice(&r.render(Format::Json).expect("render")).expect("json");
    j["rows"].as_array().expect("rows").clone()
}

/// A price book at $3.60 per GPU-hour: exactly $0.001 per second.
pub(super) const BOOK: &str = "version = \"test-1\"\n[[price]]\nmodel = \"H100\"\nmatch = [\"H100 80GB HBM3\"]\nkind = \"on_demand\"\nusd_per_gpu_hour = \"3.60\"\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ledger_and_weekly_report_match_the_hand_computed_trace() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = open(dir.path());
    let store = server.store().clone();
    let body = encode_ipc(&windows_to_batch(&trace()).expect("batch")).expect("ipc");
    store
        .ingest(IngestRequest { table: Table::GpuSamples, agent: "a", epoch: "e", sequence: 0, body: &body })
        .expect("ingest");
    store.persist_now().expect("persist");

    let book = dir.path().join("prices.toml");
    std::fs::write(&book, BOOK).expect("book");
    let config = CostConfig { price_book: Some(book), ..CostConfig::default() };
    let server = server.with_cost(config).expect("cost on");
    let ledger: std::sync::Arc<Ledger> = server.ledger().expect("ledger").clone();
    let now = (D + 1) * DAY + 2 * 3600 * SEC;
    let report = ledger.run_once(now).await;
    assert_eq!(report.errors, Vec::<String>::new());
    assert_eq!(report.computed.len(), 1, "{report:?}");
    let engine = server.engine().clone();
    let engine = &engine;

    // Every GPU-hour adds up to 3600 s over its rows; 24 hours of the day.
    let hours = rows(
        engine,
        "SELECT CAST(hour AS VARCHAR) AS h, CAST(sum(active_s + allocated_idle_s + stranded_s + unallocated_idle_s \
         + unallocated_busy_s + unknown_s) AS DOUBLE) AS total FROM gpu_cost_hourly GROUP BY hour ORDER BY hour",
    )
    .await;
    assert_eq!(hours.len(), 24);
    assert!(hours.iter().all(|r| r[1] == 3600.0), "{hours:?}");

    let detail = rows(
        engine,
        "SELECT CAST(hour AS VARCHAR) AS h, team, CAST(active_s AS DOUBLE), CAST(allocated_idle_s AS DOUBLE), \
         CAST(stranded_s AS DOUBLE), CAST(unallocated_idle_s AS DOUBLE), CAST(unallocated_busy_s AS DOUBLE), \
         CAST(unknown_s AS DOUBLE), CAST(underused_s AS DOUBLE), CAST(cost_usd AS VARCHAR), \
         CAST(idle_cost_usd AS VARCHAR), CAST(stranded_cost_usd AS VARCHAR), CAST(price_per_gpu_hour AS VARCHAR) \
         FROM gpu_cost_hourly WHERE hour >= TIMESTAMP '2026-11-19T10:00:00Z' AND hour < TIMESTAMP '2026-11-19T12:00:00Z' \
         ORDER BY hour, team",
    )
    .await;
    let want = serde_json::json!([
        // 10:00: active 1200 + stranded 2400 (10:20–11:00); $0.001/s: 3.6 known, 2.4 idle.
        [
            "2026-11-19T10:00:00Z",
            "ml",
            1200.0,
            0.0,
            2400.0,
            0.0,
            0.0,
            0.0,
            0.0,
            "3.600000",
            "2.400000",
            "2.400000",
            "3.600000"
        ],
        // 11:00 ml: stranded 300 (11:00–11:05), active 600 (all under-used), idle 1200.
        [
            "2026-11-19T11:00:00Z",
            "ml",
            600.0,
            1200.0,
            300.0,
            0.0,
            0.0,
            0.0,
            600.0,
            "2.100000",
            "1.500000",
            "0.300000",
            "3.600000"
        ],
        // 11:00 unallocated: idle 600, busy 300, no data 600 (not billed).
        [
            "2026-11-19T11:00:00Z",
            "unallocated",
            0.0,
            0.0,
            0.0,
            600.0,
            300.0,
            600.0,
            0.0,
            "0.900000",
            "0.600000",
            "0.000000",
            "3.600000"
        ],
    ]);
    // Timestamps render as RFC 3339 text in CAST; compare the hour prefix only.
    assert_eq!(detail.len(), 3, "{detail:?}");
    for (got, want) in detail.iter().zip(want.as_array().expect("array")) {
        let g = got.as_array().expect("row");
        let w = want.as_array().expect("row");
        assert!(g[0].as_str().expect("hour").starts_with(&w[0].as_str().expect("hour")[..16]), "{g:?}");
        assert_eq!(&g[1..], &w[1..], "{g:?}");
    }

    // The allocation: 10:00:00 to 11:35:00, team ml from the pod label.
    let allocs = rows(
        engine,
        "SELECT gpu_uuid, CAST(start_time AS VARCHAR) AS s, CAST(end_time AS VARCHAR) AS e, owner_kind, owner, team, source \
         FROM allocations",
    )
    .await;
    assert_eq!(allocs.len(), 1, "{allocs:?}");
    let a = allocs[0].as_array().expect("row");
    assert_eq!(a[0], "GPU-A");
    assert!(a[1].as_str().expect("start").starts_with("2026-11-19T10:00:00"), "{a:?}");
    assert!(a[2].as_str().expect("end").starts_with("2026-11-19T11:35:00"), "{a:?}");
    assert_eq!((&a[3], &a[4], &a[5], &a[6]), (&"pod".into(), &"ml/train-a".into(), &"ml".into(), &"kubernetes".into()));

    // A second pass with nothing new recomputes nothing.
    assert!(ledger.run_once(now).await.computed.is_empty());

    // The weekly report: team ml allocated 5700 s = 1.58 h, active 0.50 h, stranded
    // 0.75 h, allocated idle 0.33 h; cost 3.60 + 2.10 = 5.70; idle 2.70 + 1.20 = 3.90;
    // unallocated idle 0.60 on its own line; top stranded: ml/train-a, 1 GPU, 45 min, 2.70.
    let week = IsoWeek::parse("2026-W47").expect("week");
    let r = report::build(engine, ledger.price_book(), week, ShareUnallocated::None, now, &apron_query::Scope::All)
        .await
        .expect("report");
    let j: serde_json::Value = serde_json::from_str(&r.to_json().expect("json")).expect("parse");
    let ml = &j["teams"][0];
    assert_eq!(ml["team"], "ml");
    for (k, v) in [
        ("gpu_hours_allocated", 1.58),
        ("gpu_hours_active", 0.5),
        ("gpu_hours_stranded", 0.75),
        ("gpu_hours_allocated_idle", 0.33),
        ("cost_usd", 5.7),
        ("idle_cost_usd", 3.9),
        ("stranded_cost_usd", 2.7),
        ("allocated_idle_cost_usd", 1.2),
    ] {
        assert_eq!(ml[k].as_f64(), Some(v), "ml {k}: {ml}");
    }
    assert_eq!(j["unallocated"]["unallocated_idle_cost_usd"].as_f64(), Some(0.6));
    // Fleet = ml 5.70 + unallocated 0.90 (idle 0.60 + busy 0.30).
    assert_eq!(j["fleet"]["cost_usd"].as_f64(), Some(6.6));
    assert_eq!(j["fleet"]["idle_cost_usd"].as_f64(), Some(4.5));
    let top = &j["top_stranded"][0];
    assert_eq!((top["owner"].as_str(), top["gpus"].as_u64()), (Some("ml/train-a"), Some(1)));
    assert_eq!((top["duration_hours"].as_f64(), top["cost_usd"].as_f64()), (Some(0.75), Some(2.7)));
    assert_eq!(j["price_book_version"], "test-1");
    for format in [ReportFormat::Json, ReportFormat::Csv, ReportFormat::Html, ReportFormat::Xlsx] {
        let files = report::render(&r, format).expect("render");
        assert!(!files.is_empty() && files.iter().all(|(_, b)| !b.is_empty()), "{format:?}");
    }
    let csv = report::render(&r, ReportFormat::Csv).expect("csv");
    let teams = &csv.iter().find(|(n, _)| n == "teams.csv").expect("teams.csv").1;
    let teams = String::from_utf8_lossy(teams);
    let ml = teams.lines().find(|l| l.starts_with("ml,")).unwrap_or_else(|| panic!("no ml line in {teams}"));
    for v in ["1.58", "0.50", "0.75", "0.33", "5.70", "3.90"] {
        assert!(ml.split(',').any(|c| c == v), "{v} not in {ml} (header: {:?})", teams.lines().next());
    }

    // Viewing a finished week stores nothing; closing freezes it, and later requests
    // get the same bytes; recomputing with nothing new changes nothing.
    let later = week.end_us() + DAY;
    let data = store.data_dir().to_path_buf();
    let book = ledger.price_book();
    let produce = |freeze, now| {
        report::produce(engine, book, &data, week, ReportFormat::Json, freeze, ShareUnallocated::None, now)
    };
    let viewed = produce(report::Freeze::View, later).await.expect("view");
    assert!(!viewed.frozen && !report::stored_dir(&data, week).exists(), "a view never freezes");
    let too_early = produce(report::Freeze::Close, week.end_us() - 1).await.expect_err("close before the end");
    assert!(matches!(too_early, report::ReportError::NotOver { .. }), "{too_early}");
    assert!(too_early.to_string().contains("has not ended"), "{too_early}");
    let first = produce(report::Freeze::Close, later).await.expect("close");
    assert!(first.frozen && report::stored_dir(&data, week).join("report.xlsx").exists());
    assert_eq!(first.files, viewed.files, "closing freezes what a view showed");
    let again = produce(report::Freeze::View, later + DAY).await.expect("again");
    assert_eq!((first.files, again.changed), (again.files, Vec::new()), "a closed week re-renders identically");
    let recomputed = produce(report::Freeze::Recompute, later + DAY).await.expect("recompute");
    assert_eq!(recomputed.changed, Vec::<String>::new());

    // Over HTTP, and the idle dollars on the server's /metrics.
    let metrics = apron::ledger::CostMetrics::default();
    ledger.refresh_metrics(&metrics).await.expect("metrics");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(server.run(listener, async move {
        let _ = stopped.await;
    }));
    let (status, body) = http_get(addr, "/api/v1/reports/weekly?week=2026-W47&format=csv&table=teams").await;
    assert_eq!(status, 200, "{body}");
    assert!(body.lines().any(|l| l.starts_with("ml,") && l.contains("5.70")), "{body}");
    let (status, body) = http_get(addr, "/api/v1/reports/weekly?week=2026-W99").await;
    assert_eq!(status, 400, "{body}");
    let (status, body) = http_get(addr, "/api/v1/reports/weekly?week=2026-W47&format=pdf").await;
    assert_eq!(status, 400, "{body}");
    let metrics_text = loop {
        // The server's own ledger pass refreshes the families shortly after start.
        let (_, text) = http_get(addr, "/metrics").await;
        if text.contains("apron_idle_cost_dollars_total{") {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    for line in [
        "apron_idle_cost_dollars_total{team=\"ml\",kind=\"stranded\"} 2.7",
        "apron_idle_cost_dollars_total{team=\"ml\",kind=\"allocated_idle\"} 1.2",
        "apron_idle_cost_dollars_total{team=\"unallocated\",kind=\"unallocated_idle\"} 0.6",
        "apron_gpu_seconds_total{team=\"ml\",state=\"stranded\"} 2700.0",
    ] {
        assert!(metrics_text.contains(line), "{line} not in\n{metrics_text}");
    }
    let _ = stop.send(());
    running.await.expect("join").expect("server");
}

/// A GET asking for OpenMetrics text: (status, body).
async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    let path = path.to_owned();
    tokio::task::spawn_blocking(move || apron_test_support::http_get(addr, &path, Some("application/openmetrics-text")))
        .await
        .expect("join")
}

/// The process-owner fallback: a GPU nobody holds, busy 10:00–10:40, whose process list
/// shows carol (mapped to team vision) every 5 s from 10:00:00 to 10:19:55 and mallory
/// (unmapped) from 10:20:00 to 10:39:55.
///
/// A window belongs to the user of the latest mapped process sample at or before its
/// end, if at most 10 s before: carol's last sample (10:19:55) covers windows ending up
/// to 10:20:05, so vision gets windows ending 10:00:01 … 10:20:05 = 1205 s active, the
/// rest (10:20:05–10:40) is unallocated busy 1195 s, and 10:40–11:00 unknown 1200 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_owners_are_the_last_fallback_for_mapped_users_only() {
    use apron_common::ProcessRow;
    use apron_common::wire::processes_to_batch;
    let dir = tempfile::tempdir().expect("tempdir");
    let server = open(dir.path());
    let store = server.store().clone();
    let mut windows = Vec::new();
    for s in 1..=2400 {
        let mut w = GpuWindow::new(UnixMicros(TEN + s * SEC), Duration::from_secs(1), gpu());
        w.fields[Field::SmActive.index()] = stats(0.5, 0.6);
        windows.push(w);
    }
    let procs: Vec<ProcessRow> = (0..480)
        .map(|k| {
            let user = if k < 240 { "carol" } else { "mallory" };
            super::process(TEN + k * 5 * SEC, "node-0", "GPU-A", 4000, Some(user))
        })
        .collect();
    for (n, (table, body)) in [
        (Table::GpuSamples, encode_ipc(&windows_to_batch(&windows).expect("batch")).expect("ipc")),
        (Table::GpuProcesses, encode_ipc(&processes_to_batch(&procs).expect("batch")).expect("ipc")),
    ]
    .into_iter()
    .enumerate()
    {
        store.ingest(IngestRequest { table, agent: "a", epoch: "e", sequence: n as u64, body: &body }).expect("ingest");
    }
    store.persist_now().expect("persist");
    let mut config = CostConfig::default();
    config.teams.users.insert("carol".into(), "vision".into());
    let server = server.with_cost(config).expect("cost on");
    let ledger = server.ledger().expect("ledger").clone();
    let r = ledger.run_once((D + 1) * DAY).await;
    assert_eq!(r.errors, Vec::<String>::new());
    let engine = server.engine().clone();
    let got = rows(
        &engine,
        "SELECT team, CAST(active_s AS DOUBLE) AS a, CAST(unallocated_busy_s AS DOUBLE) AS b, \
         CAST(unknown_s AS DOUBLE) AS u, cost_usd FROM gpu_cost_hourly \
         WHERE hour = TIMESTAMP '2026-11-19T10:00:00Z' ORDER BY team",
    )
    .await;
    assert_eq!(
        got,
        vec![
            serde_json::json!(["unallocated", 0.0, 1195.0, 1200.0, null]),
            serde_json::json!(["vision", 1205.0, 0.0, 0.0, null])
        ],
        "no price book: money is NULL, never 0"
    );
    let allocs = rows(&engine, "SELECT owner_kind, owner, team, source FROM allocations").await;
    assert_eq!(allocs, vec![serde_json::json!(["process", "carol", "vision", "process"])]);
}

/// `apron pricebook`: the example book's table, and a SkyPilot catalog turned into
/// entries (p5.48xlarge $98.32 / 8 GPUs = $12.29 per GPU-hour; an unknown accelerator
/// reported, not dropped silently).
#[test]
fn pricebook_cli_shows_and_imports() {
    let book = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/pricebook.example.toml");
    let o = std::process::Command::new(super::APRON).args(["pricebook", "show", book]).output().expect("runs");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let table = String::from_utf8_lossy(&o.stdout);
    assert!(table.contains("example-2026-12") && table.contains("1.540881") && table.contains("12.29"), "{table}");

    let dir = tempfile::tempdir().expect("tempdir");
    let csv = dir.path().join("vms.csv");
    std::fs::write(
        &csv,
        "InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,Price,Region,SpotPrice\n\
         p5.48xlarge,H100,8,192,2048,98.32,us-east-1,39.33\n\
         x1.fancy,Quantum9000,1,4,16,5.00,us-east-1,\n",
    )
    .expect("csv");
    let o = std::process::Command::new(super::APRON)
        .args(["pricebook", "import-skypilot", "--region", "us-east-1"])
        .arg(&csv)
        .output()
        .expect("runs");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let toml = String::from_utf8_lossy(&o.stdout);
    assert!(toml.contains("[[price]]") && toml.contains("12.29"), "{toml}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("Quantum9000"));
    // The output is a valid price book once a version is added.
    apron_cost::PriceBook::from_toml(&format!("version = \"import\"\n{toml}")).expect("parses");

    let o = std::process::Command::new(super::APRON)
        .args(["pricebook", "show", "/nonexistent.toml"])
        .output()
        .expect("runs");
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("/nonexistent.toml"));
}

/// MIG: an H100 ($7.00/h, so a slice is $1.00/h) split into one `3g.40gb` instance held
/// and busy for 10:00–11:00. The instance costs 3/7 × 7.00 = $3.00 (active); the 4/7
/// of the parent no instance holds is the parent's unallocated idle, 4/7 × 7.00 =
/// $4.00 — together the whole card's $7.00, nothing counted twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mig_instances_carry_cost_and_free_capacity_is_the_parents_unallocated_idle() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = open(dir.path());
    let store = server.store().clone();
    let parent = gpu();
    let mut child = GpuIdentity::gpu(
        HostName::new("node-0").expect("host"),
        GpuUuid::new("MIG-A-1").expect("uuid"),
        0,
        "NVIDIA H100 80GB HBM3",
    );
    child.parent_gpu_uuid = Some(GpuUuid::new("GPU-A").expect("uuid"));
    child.mig_profile = Some("3g.40gb".into());
    let mut rows = Vec::new();
    for s in 1..=3600 {
        let mut w = GpuWindow::new(UnixMicros(TEN + s * SEC), Duration::from_secs(1), child.clone());
        w.fields[Field::SmActive.index()] = stats(0.5, 0.6);
        w.owner = Some(GpuHolder::pod(Some("ml".into()), Some("infer-0".into()), None));
        rows.push(w);
        let mut p = GpuWindow::new(UnixMicros(TEN + s * SEC), Duration::from_secs(1), parent.clone());
        // The parent's device fields reflect its instances' work: not classified.
        p.fields[Field::SmActive.index()] = stats(0.2, 0.3);
        rows.push(p);
    }
    let body = encode_ipc(&windows_to_batch(&rows).expect("batch")).expect("ipc");
    store
        .ingest(IngestRequest { table: Table::GpuSamples, agent: "a", epoch: "e", sequence: 0, body: &body })
        .expect("ingest");
    store.persist_now().expect("persist");
    let book = dir.path().join("prices.toml");
    std::fs::write(&book, BOOK.replace("3.60", "7.00")).expect("book");
    let server = server.with_cost(CostConfig { price_book: Some(book), ..CostConfig::default() }).expect("cost");
    let ledger = server.ledger().expect("ledger").clone();
    assert_eq!(ledger.run_once((D + 1) * DAY).await.errors, Vec::<String>::new());
    let got = rows_of(
        server.engine(),
        "SELECT gpu_uuid, team, CAST(active_s AS DOUBLE) AS a, CAST(unallocated_idle_s AS DOUBLE) AS i, \
         CAST(cost_usd AS VARCHAR) AS c, CAST(idle_cost_usd AS VARCHAR) AS ic FROM gpu_cost_hourly \
         WHERE hour = TIMESTAMP '2026-11-19T10:00:00Z' ORDER BY gpu_uuid",
    )
    .await;
    assert_eq!(
        got,
        vec![
            serde_json::json!(["GPU-A", "unallocated", 0.0, 3600.0, "4.000000", "4.000000"]),
            // No team label and no namespace map: the pod's team is `unassigned`.
            serde_json::json!(["MIG-A-1", "unassigned", 3600.0, 0.0, "3.000000", "0.000000"]),
        ]
    );
}

async fn rows_of(engine: &std::sync::Arc<QueryEngine>, sql: &str) -> Vec<serde_json::Value> {
    rows(engine, sql).await
}

/// Runs still held at the end of a finished day end where the next day's windows say —
/// all of them found by one forward look, not a query per run — and a run left open
/// is closed by a later pass when its holder lets go (10 s windows; hand-computed):
///
/// | GPU | day D 22:00 → | after midnight | `allocations` row of D |
/// | --- | --- | --- | --- |
/// | X | ml/a | ml/a to 01:00, then ml/b | 22:00 – 01:00 (another owner followed) |
/// | Y | job 7 to 23:50, then silent | — | 22:00 – 23:50 (silent > 10 min) |
/// | Z | ml/c | ml/c to 03:00 (now) | 22:00 – open, held through 03:00; then ml/e from 03:10: ends 03:10 |
/// | W | ml/d | ml/d to 00:45 (past the 00:30 read), then nobody | 22:00 – 00:45 |
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_open_at_midnight_end_where_the_next_days_windows_say() {
    const MIN: i64 = 60 * SEC;
    const MIDNIGHT: i64 = (D + 1) * DAY;
    let dir = tempfile::tempdir().expect("tempdir");
    let server = open(dir.path());
    let store = server.store().clone();
    let pod = |name: &str| Some(GpuHolder::pod(Some("ml".into()), Some(name.into()), None));
    let mut windows = Vec::new();
    let mut seg = |uuid: &str, holder, from, to| windows.extend(windows_of(uuid, holder, from, to));
    let start = MIDNIGHT - 120 * MIN;
    seg("GPU-X", pod("a"), start, MIDNIGHT + 60 * MIN);
    seg("GPU-X", pod("b"), MIDNIGHT + 60 * MIN, MIDNIGHT + 180 * MIN);
    seg("GPU-Y", Some(GpuHolder::slurm_job("7")), start, MIDNIGHT - 10 * MIN);
    seg("GPU-Z", pod("c"), start, MIDNIGHT + 180 * MIN);
    seg("GPU-W", pod("d"), start, MIDNIGHT + 45 * MIN);
    seg("GPU-W", None, MIDNIGHT + 45 * MIN, MIDNIGHT + 180 * MIN);
    let mut seq = 0;
    let mut send = |windows: &[GpuWindow]| {
        let body = encode_ipc(&windows_to_batch(windows).expect("batch")).expect("ipc");
        let req = IngestRequest { table: Table::GpuSamples, agent: "a", epoch: "e", sequence: seq, body: &body };
        store.ingest(req).expect("ingest");
        seq += 1;
    };
    send(&windows);
    store.persist_now().expect("persist");
    let server = server.with_cost(CostConfig::default()).expect("cost on");
    let ledger = server.ledger().expect("ledger").clone();
    let day_rows = || async {
        rows(
            server.engine(),
            &format!(
                "SELECT gpu_uuid, owner, CAST(start_time AS VARCHAR), CAST(end_time AS VARCHAR), \
                 CAST(held_through AS VARCHAR) FROM allocations WHERE start_time < TIMESTAMP '{}' ORDER BY gpu_uuid",
                UnixMicros(MIDNIGHT).to_rfc3339()
            ),
        )
        .await
        .into_iter()
        .map(|r| {
            r.as_array()
                .expect("row")
                .iter()
                .map(|v| v.as_str().map_or_else(|| "NULL".to_owned(), |s| s.chars().take(19).collect()))
                .collect::<Vec<String>>()
        })
        .collect::<Vec<_>>()
    };
    let row = |gpu: &str, owner: &str, end: &str, held: &str| -> Vec<String> {
        [gpu, owner, "2026-11-19T22:00:00", end, held].map(str::to_owned).to_vec()
    };

    let r = ledger.run_once(MIDNIGHT + 180 * MIN + 5 * SEC).await;
    assert_eq!(r.errors, Vec::<String>::new());
    assert_eq!(
        day_rows().await,
        vec![
            row("GPU-W", "ml/d", "2026-11-20T00:45:00", "2026-11-20T00:45:00"),
            row("GPU-X", "ml/a", "2026-11-20T01:00:00", "2026-11-20T01:00:00"),
            row("GPU-Y", "7", "2026-11-19T23:50:00", "2026-11-19T23:50:00"),
            row("GPU-Z", "ml/c", "NULL", "2026-11-20T03:00:00"),
        ]
    );

    // Z's pod lets go at 03:10 (ml/e from then on): the next pass looks at D's open run
    // alone and ends it with its newest window.
    let mut more = windows_of("GPU-Z", pod("c"), MIDNIGHT + 180 * MIN, MIDNIGHT + 190 * MIN);
    more.extend(windows_of("GPU-Z", pod("e"), MIDNIGHT + 190 * MIN, MIDNIGHT + 200 * MIN));
    send(&more);
    let r = ledger.run_once(MIDNIGHT + 200 * MIN + 5 * SEC).await;
    assert_eq!(r.errors, Vec::<String>::new());
    assert!(r.plans.contains(&apron::ledger::Plan::OpenRuns), "{:?} {:?}", r.plans, r.computed);
    assert_eq!(day_rows().await[3], row("GPU-Z", "ml/c", "2026-11-20T03:10:00", "2026-11-20T03:10:00"));
}

/// 10 s windows of one busy GPU on node-0 ending in `(from, to]`, held by `holder`.
fn windows_of(uuid: &str, holder: Option<GpuHolder>, from: i64, to: i64) -> Vec<GpuWindow> {
    let id = GpuIdentity::gpu(
        HostName::new("node-0").expect("host"),
        GpuUuid::new(uuid).expect("uuid"),
        0,
        "NVIDIA H100 80GB HBM3",
    );
    (1..=(to - from) / (10 * SEC))
        .map(|k| {
            let mut w = GpuWindow::new(UnixMicros(from + k * 10 * SEC), Duration::from_secs(10), id.clone());
            w.fields[Field::SmActive.index()] = stats(0.5, 0.6);
            w.owner = holder.clone();
            w
        })
        .collect()
}
