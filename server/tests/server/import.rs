//! `apron import`: an OpenMetrics export of a trace, with each value held constant over
//! its 15 s export window, prices exactly like the same trace ingested by an agent;
//! importing twice stores once; agent data wins.

use std::time::Duration;

use super::cost::{D, DAY, SEC};
use super::rollup::open;
use apron::ledger::CostConfig;
use apron_collector::{IngestRequest, Table};
use apron_common::wire::{encode_ipc, windows_to_batch};
use apron_common::{Field, FieldStats, GpuHolder, GpuIdentity, GpuUuid, GpuWindow, HostName, UnixMicros};
use apron_query::Format;
use serde_json::Value;

const T0: i64 = D * DAY + 10 * 3600 * SEC;

/// (from s, to s, util, held), on the 15 s export grid: 10:00–10:20 busy and held,
/// 10:20–11:05 idle and held (stranded), 11:05–11:15 busy and held, 11:15–11:30 busy
/// with nobody holding it, 11:30–12:00 idle and unallocated.
const SEGMENTS: [(i64, i64, f64, bool); 5] = [
    (0, 1200, 0.6, true),
    (1200, 3900, 0.0, true),
    (3900, 4500, 0.3, true),
    (4500, 5400, 0.7, false),
    (5400, 7200, 0.0, false),
];

fn util_at(s: i64) -> (f64, bool) {
    SEGMENTS.iter().find(|(a, b, _, _)| s > *a && s <= *b).map_or((0.0, false), |(_, _, u, h)| (*u, *h))
}

fn holder() -> GpuHolder {
    GpuHolder::pod(Some("ml".into()), Some("train-a".into()), Some("trainer".into()))
}

/// The agent's view: 1 s windows (10:00:01 … 12:00:00).
fn agent_windows() -> Vec<GpuWindow> {
    let gpu = GpuIdentity::gpu(
        HostName::new("node-0").expect("host"),
        GpuUuid::new("GPU-A").expect("uuid"),
        0,
        "NVIDIA H100 80GB HBM3",
    );
    (1..=7200)
        .map(|s| {
            let (u, held) = util_at(s);
            let mut w = GpuWindow::new(UnixMicros(T0 + s * SEC), Duration::from_secs(1), gpu.clone());
            w.fields[Field::GpuUtil.index()] = Some(FieldStats { count: 10, mean: u, min: u, max: u, last: u });
            w.owner = held.then(holder);
            w
        })
        .collect()
}

/// dcgm-exporter's view, exported every 15 s (the value at t holds over (t − 15 s, t]).
fn openmetrics() -> String {
    let mut out = String::from("# TYPE DCGM_FI_DEV_GPU_UTIL gauge\n# UNIT DCGM_FI_DEV_GPU_UTIL percent\n");
    for k in 0..=480 {
        let s = k * 15;
        let (u, held) = util_at(s);
        let pod = if held { ",pod=\"train-a\",namespace=\"ml\",container=\"trainer\"" } else { "" };
        out.push_str(&format!(
            "DCGM_FI_DEV_GPU_UTIL{{gpu=\"0\",UUID=\"GPU-A\",device=\"nvidia0\",modelName=\"NVIDIA H100 80GB HBM3\",Hostname=\"node-0\"{pod}}} {} {}\n",
            (u * 100.0).round(),
            (T0 + s * SEC) / SEC
        ));
    }
    out.push_str("# EOF\n");
    out
}

async fn hourly(server: &apron::Server) -> Vec<Value> {
    let q = "SELECT CAST(hour AS VARCHAR), team, CAST(active_s AS VARCHAR), CAST(allocated_idle_s AS VARCHAR), \
             CAST(stranded_s AS VARCHAR), CAST(unallocated_idle_s AS VARCHAR), CAST(unallocated_busy_s AS VARCHAR), \
             CAST(idle_cost_usd AS VARCHAR), CAST(cost_usd AS VARCHAR) FROM gpu_cost_hourly \
             WHERE hour >= TIMESTAMP '2026-11-19T10:00:00Z' AND hour < TIMESTAMP '2026-11-19T12:00:00Z' ORDER BY 1, 2";
    let r = server.engine().execute(q).await.unwrap_or_else(|e| panic!("{e}"));
    let j: Value = serde_json::from_slice(&r.render(Format::Json).expect("render")).expect("json");
    j["rows"].as_array().expect("rows").clone()
}

fn cost(dir: &std::path::Path) -> CostConfig {
    let book = dir.join("prices.toml");
    std::fs::write(&book, super::cost::BOOK).expect("book");
    CostConfig { price_book: Some(book), ..CostConfig::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_imported_openmetrics_export_prices_like_the_agent_trace() {
    let now = (D + 1) * DAY;
    // The agent's trace.
    let a_dir = tempfile::tempdir().expect("tempdir");
    let agent = open(a_dir.path()).with_cost(cost(a_dir.path())).expect("cost");
    let body = encode_ipc(&windows_to_batch(&agent_windows()).expect("batch")).expect("ipc");
    agent
        .store()
        .ingest(IngestRequest { table: Table::GpuSamples, agent: "a", epoch: "e", sequence: 0, body: &body })
        .expect("ingest");
    let r = agent.ledger().expect("ledger").run_once(now).await;
    assert!(r.errors.is_empty(), "{r:?}");
    let from_agent = hourly(&agent).await;

    // The same trace through an OpenMetrics export and `apron import`'s code.
    let i_dir = tempfile::tempdir().expect("tempdir");
    let imported = open(i_dir.path()).with_cost(cost(i_dir.path())).expect("cost");
    let file = vec![("gpu.om".to_owned(), openmetrics().into_bytes())];
    let run = |server: &apron::Server| {
        apron::import::run(
            server.store().clone(),
            server.engine().clone(),
            file.clone(),
            apron_import::ImportOptions::default(),
            |_| {},
        )
    };
    let first = run(&imported).await.expect("import");
    // 481 samples: the first opens the series, 480 windows of 15 s.
    assert_eq!((first.outcome.samples_read, first.outcome.rows, first.stored), (481, 480, 480));
    assert_eq!(first.outcome.skipped.values().sum::<u64>(), 1, "{:?}", first.outcome.skipped);
    let r = imported.ledger().expect("ledger").run_once(now).await;
    assert!(r.errors.is_empty(), "{r:?}");
    let from_import = hourly(&imported).await;
    assert_eq!(from_import, from_agent);
    // Hand-computed (an unlabelled pod with no namespace map: team `unassigned`):
    // hour 10: active 1200 s, stranded 2400 s (the idle run 10:20–11:05 is 45 min ≥ 30);
    // hour 11: stranded 300, active 600 (unassigned); unallocated busy 900, idle 1800.
    let secs: Vec<Vec<&str>> =
        from_import.iter().map(|r| (1..=6).map(|i| r[i].as_str().unwrap_or("")).collect()).collect();
    let z = "0.000000";
    assert_eq!(
        secs,
        vec![
            vec!["unassigned", "1200.000000", z, "2400.000000", z, z],
            vec!["unallocated", z, z, z, "1800.000000", "900.000000"],
            vec!["unassigned", "600.000000", z, "300.000000", z, z],
        ]
    );
    // $3.60/h = $0.001/s: hour 10's idle cost is the 2400 stranded seconds.
    assert_eq!(from_import[0][7], "2.400000");

    // Importing the same file again stores nothing more.
    let count = |s: &apron::Server| {
        let e = s.engine().clone();
        async move {
            let r = e.execute("SELECT count(*) FROM gpu_samples").await.expect("count");
            let j: Value = serde_json::from_slice(&r.render(Format::Json).expect("render")).expect("json");
            j["rows"][0][0].as_i64().expect("n")
        }
    };
    let before = count(&imported).await;
    let again = run(&imported).await.expect("import again");
    assert_eq!(again.stored, 0, "{again:?}");
    assert_eq!(count(&imported).await, before);

    // The same export as a file, as `apron import FILE` reads it: a line at a time, the
    // samples spilled to disk every 50. The same epoch, nothing stored again here, and
    // on a fresh store the same rows and the same dollars.
    let f_dir = tempfile::tempdir().expect("tempdir");
    let path = f_dir.path().join("gpu.om");
    std::fs::write(&path, openmetrics()).expect("file");
    let streamed = |server: &apron::Server| {
        apron::import::run_inputs(
            server.store().clone(),
            server.engine().clone(),
            vec![apron::import::Input::File(path.clone())],
            apron_import::ImportOptions::default(),
            Some((f_dir.path().to_path_buf(), 50)),
            |_| {},
        )
    };
    let again = streamed(&imported).await.expect("import the file");
    let kept_out = again.already_imported + again.overlapping;
    assert_eq!((again.epoch.as_str(), again.stored, kept_out), (first.epoch.as_str(), 0, 480));
    let s_dir = tempfile::tempdir().expect("tempdir");
    let fresh = open(s_dir.path()).with_cost(cost(s_dir.path())).expect("cost");
    let from_file = streamed(&fresh).await.expect("import the file");
    assert_eq!((from_file.stored, &from_file.outcome), (480, &first.outcome));
    let r = fresh.ledger().expect("ledger").run_once(now).await;
    assert!(r.errors.is_empty(), "{r:?}");
    assert_eq!(hourly(&fresh).await, from_agent);

    // Agent data wins: importing over the agent's store adds nothing.
    let over = run(&agent).await.expect("import over agent data");
    assert_eq!((over.stored, over.overlapping), (0, 480));
    assert_eq!(count(&agent).await, 7200);
}

/// A week is frozen when it is closed, not when it is first looked at: a week viewed
/// before its history was imported shows the imported dollars; once closed, it is
/// served as frozen and a later import shows as a diff until `--recompute`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_week_viewed_before_its_import_shows_the_imported_dollars() {
    use apron::report::{self, Freeze, ReportFormat};
    let now = (D + 7) * DAY;
    let dir = tempfile::tempdir().expect("tempdir");
    let server = open(dir.path()).with_cost(cost(dir.path())).expect("cost");
    let ledger = server.ledger().expect("ledger").clone();
    let week = report::current_week(T0).expect("week");
    let data = dir.path().to_path_buf();
    let view = |freeze| {
        let (engine, ledger, data) = (server.engine().clone(), ledger.clone(), data.clone());
        async move {
            let share = apron_cost::report::ShareUnallocated::None;
            let p = report::produce(&engine, ledger.price_book(), &data, week, ReportFormat::Json, freeze, share, now)
                .await
                .expect("report");
            let json: Value = serde_json::from_slice(&p.files[0].1).expect("json");
            (json["fleet"]["idle_cost_usd"].to_string(), p.frozen, p.changed)
        }
    };
    let import = |text: String| {
        let server = &server;
        async move {
            let file = vec![("gpu.om".to_owned(), text.into_bytes())];
            let opts = apron_import::ImportOptions::default();
            apron::import::run(server.store().clone(), server.engine().clone(), file, opts, |_| {})
                .await
                .expect("import");
            let r = server.ledger().expect("ledger").run_once(now).await;
            assert!(r.errors.is_empty(), "{r:?}");
        }
    };

    // Viewed while empty (as a fresh `apron up`'s UI would): nothing is frozen.
    assert_eq!(view(Freeze::View).await, ("0.0".to_owned(), false, Vec::new()));
    assert!(!report::stored_dir(&data, week).exists());

    // The week's history arrives: the report shows it. Hand-computed at $0.001/s: 2400 s
    // stranded in hour 10, 300 s stranded and 1800 s unallocated idle in hour 11.
    import(openmetrics()).await;
    assert_eq!(view(Freeze::View).await, ("4.5".to_owned(), false, Vec::new()));

    // Closed: frozen as it is now.
    assert_eq!(view(Freeze::Close).await, ("4.5".to_owned(), true, Vec::new()));
    assert!(report::stored_dir(&data, week).join("report.json").exists());

    // A second GPU's history lands after the close: the frozen copy is still served,
    // with the difference; recomputing replaces it.
    import(openmetrics().replace("GPU-A", "GPU-B").replace("gpu=\"0\"", "gpu=\"1\"")).await;
    let (idle, frozen, changed) = view(Freeze::View).await;
    assert_eq!((idle.as_str(), frozen), ("4.5", true));
    assert!(changed.iter().any(|c| c == ".fleet.idle_cost_usd: 4.5 → 9.0"), "{changed:#?}");
    let (idle, frozen, _) = view(Freeze::Recompute).await;
    assert_eq!((idle.as_str(), frozen), ("9.0", true));
    assert_eq!(view(Freeze::View).await, ("9.0".to_owned(), true, Vec::new()));
}

/// `[[scrape]]`: a dcgm-exporter endpoint (here an HTTP server answering like one, with
/// no timestamps) becomes 15 s windows (t_prev, t]; where an agent already covers the
/// GPU, the scrape's window is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scraping_a_dcgm_exporter_stores_windows_and_yields_to_the_agent() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let calls = std::sync::Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let n = c.fetch_add(1, Ordering::SeqCst);
            let util = [0, 100, 50, 25][n.min(3)];
            async move {
                format!(
                    "# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).\n# TYPE DCGM_FI_DEV_GPU_UTIL gauge\n\
                     DCGM_FI_DEV_GPU_UTIL{{gpu=\"0\",UUID=\"GPU-S\",device=\"nvidia0\",modelName=\"NVIDIA A100-SXM4-40GB\",Hostname=\"node-9\"}} {util}\n\
                     # TYPE DCGM_FI_DEV_FB_USED gauge\n\
                     DCGM_FI_DEV_FB_USED{{gpu=\"0\",UUID=\"GPU-S\",device=\"nvidia0\",modelName=\"NVIDIA A100-SXM4-40GB\",Hostname=\"node-9\"}} 1024\n"
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });

    let dir = tempfile::tempdir().expect("tempdir");
    let server = open(dir.path());
    let target: apron::scrape::ScrapeTarget =
        toml::from_str(&format!("url = \"http://{addr}/metrics\"\ninterval = \"15s\"\ncluster = \"lab\""))
            .expect("target");
    let mut s = apron::scrape::Scraper::new(server.store().clone(), server.engine().clone(), target).expect("scraper");
    let at = |k: i64| UnixMicros(T0 + k * 15 * SEC);
    // The first scrape opens the series; each later one is a 15 s window.
    assert_eq!(s.scrape_at(at(0)).await.expect("scrape").windows, 0);
    assert_eq!(s.scrape_at(at(1)).await.expect("scrape").stored, 1);
    // An agent already shipped 1 s windows for the next 15 s of this GPU: it wins.
    let gpu = GpuIdentity::gpu(
        HostName::new("node-9").expect("host"),
        GpuUuid::new("GPU-S").expect("uuid"),
        0,
        "NVIDIA A100-SXM4-40GB",
    );
    let agent: Vec<GpuWindow> =
        (1..=15).map(|i| GpuWindow::new(UnixMicros(at(1).0 + i * SEC), Duration::from_secs(1), gpu.clone())).collect();
    let body = encode_ipc(&windows_to_batch(&agent).expect("batch")).expect("ipc");
    server
        .store()
        .ingest(IngestRequest { table: Table::GpuSamples, agent: "a", epoch: "e", sequence: 0, body: &body })
        .expect("ingest");
    let r = s.scrape_at(at(2)).await.expect("scrape");
    assert_eq!((r.stored, r.overlapping), (0, 1));
    assert_eq!(s.scrape_at(at(3)).await.expect("scrape").stored, 1);

    let q = "SELECT CAST(time AS VARCHAR) AS t, window_s, CAST(gpu_util AS DOUBLE), fb_used_bytes, \"cluster\", \"host\" \
             FROM gpu_samples WHERE window_s = 15 ORDER BY time";
    let r = server.engine().execute(q).await.expect("query");
    let j: Value = serde_json::from_slice(&r.render(Format::Json).expect("render")).expect("json");
    let rows = j["rows"].as_array().expect("rows");
    // (10:00:00, 10:00:15] at 100 % and (10:00:30, 10:00:45] at 25 %; 1 GiB as bytes.
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert_eq!((rows[0][2].as_f64(), rows[1][2].as_f64()), (Some(1.0), Some(0.25)));
    assert_eq!(rows[0][3], 1024 * 1024 * 1024);
    assert_eq!((rows[0][4].as_str(), rows[0][5].as_str()), (Some("lab"), Some("node-9")));
    assert_eq!(calls.load(Ordering::SeqCst), 4);
}
