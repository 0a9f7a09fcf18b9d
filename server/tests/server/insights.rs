//! Alerts and recommendations on known traces, against hand-computed figures; the alert
//! receivers against a capturing webhook and a real Alertmanager.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::cost::{D, DAY, SEC};
use super::rollup::open;
use apron::Server;
use apron::alerts::AlertsConfig;
use apron::ledger::CostConfig;
use apron::recommend::RecommendSettings;
use apron_collector::{IngestRequest, Table};
use apron_common::wire::{encode_ipc, windows_to_batch};
use apron_common::{Field, FieldStats, GpuHolder, GpuIdentity, GpuUuid, GpuWindow, HostName, UnixMicros};
use apron_query::Format;
use serde_json::Value;

pub(super) const MIN: i64 = 60 * SEC;
const GIB: f64 = (1u64 << 30) as f64;
/// 10:00 on the test day.
pub(super) const T0: i64 = D * DAY + 10 * 3600 * SEC;

/// $3.60 per GPU-hour for H100s (exactly $0.001 a second); A100s at $4.00 on demand with
/// a $1.50 spot rate.
const BOOK: &str = "version = \"test-insights\"\n\
    [[price]]\nmodel = \"H100\"\nmatch = [\"H100 80GB HBM3\"]\nkind = \"on_demand\"\nusd_per_gpu_hour = \"3.60\"\n\
    [[price]]\nmodel = \"A100 80GB\"\nmatch = [\"A100-SXM4-80GB\"]\nkind = \"on_demand\"\nusd_per_gpu_hour = \"4.00\"\n\
    [[price]]\nmodel = \"A100 80GB\"\nmatch = [\"A100-SXM4-80GB\"]\nkind = \"spot\"\nusd_per_gpu_hour = \"1.50\"\n";

pub(super) fn ident(host: &str, uuid: &str, model: &str) -> GpuIdentity {
    GpuIdentity::gpu(HostName::new(host).expect("host"), GpuUuid::new(uuid).expect("uuid"), 0, model)
}

pub(super) const H100: &str = "NVIDIA H100 80GB HBM3";

/// One segment of 10 s windows of one GPU: `(from, to]` relative to T0.
pub(super) struct Seg<'a> {
    gpu: &'a GpuIdentity,
    from: i64,
    to: i64,
    sm: f64,
    fb_gib: f64,
    holder: Option<GpuHolder>,
    lost: bool,
    xid: Option<f64>,
}

pub(super) fn seg<'a>(
    gpu: &'a GpuIdentity,
    from: i64,
    to: i64,
    sm: f64,
    fb_gib: f64,
    holder: Option<GpuHolder>,
) -> Seg<'a> {
    Seg { gpu, from, to, sm, fb_gib, holder, lost: false, xid: None }
}

pub(super) fn windows(segs: &[Seg<'_>]) -> Vec<GpuWindow> {
    let stat = |v: f64| Some(FieldStats { count: 10, mean: v, min: v, max: v, last: v });
    let mut out = Vec::new();
    for s in segs {
        let mut t = T0 + s.from + 10 * SEC;
        while t <= T0 + s.to {
            let mut w = GpuWindow::new(UnixMicros(t), Duration::from_secs(10), s.gpu.clone());
            if !s.lost {
                w.fields[Field::SmActive.index()] = stat(s.sm);
                w.fields[Field::GpuUtil.index()] = stat(s.sm);
                w.fields[Field::FbUsedBytes.index()] = stat(s.fb_gib * GIB);
                w.fields[Field::FbTotalBytes.index()] = stat(80.0 * GIB);
            }
            if let Some(x) = s.xid {
                w.fields[Field::XidLast.index()] = stat(x);
            }
            w.lost = s.lost;
            w.owner = s.holder.clone();
            out.push(w);
            t += 10 * SEC;
        }
    }
    out.sort_by_key(|w| (w.gpu.gpu_uuid.to_string(), w.time.0));
    out
}

pub(super) fn ingest(server: &Server, rows: &[GpuWindow], seq: u64) {
    let body = encode_ipc(&windows_to_batch(rows).expect("batch")).expect("ipc");
    server
        .store()
        .ingest(IngestRequest { table: Table::GpuSamples, agent: "t", epoch: "e", sequence: seq, body: &body })
        .expect("ingest");
}

pub(super) fn cost(dir: &std::path::Path, teams: apron_cost::TeamConfig) -> CostConfig {
    let book = dir.join("prices.toml");
    std::fs::write(&book, BOOK).expect("book");
    CostConfig { price_book: Some(book), teams, ..CostConfig::default() }
}

pub(super) fn pod(ns: &str, name: &str, labels: &str) -> GpuHolder {
    let mut h = GpuHolder::pod(Some(ns.into()), Some(name.into()), None);
    h.pod_labels = Some(labels.into());
    h
}

/// An HTTP server on port 0 that records every JSON body POSTed to it.
async fn capture() -> (SocketAddr, Arc<Mutex<Vec<Value>>>, tokio::task::JoinHandle<()>) {
    let seen: Arc<Mutex<Vec<Value>>> = Arc::default();
    let s = seen.clone();
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(move |body: axum::body::Bytes| {
            let s = s.clone();
            async move {
                s.lock().expect("lock").push(serde_json::from_slice(&body).unwrap_or(Value::Null));
                "ok"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let task = tokio::spawn(async move {
        axum::serve(listener, app).await.expect("serve");
    });
    (addr, seen, task)
}

async fn http_get(addr: SocketAddr, path: &str) -> Value {
    let path = path.to_owned();
    let (status, body) =
        tokio::task::spawn_blocking(move || apron_test_support::http_get(addr, &path, None)).await.expect("join");
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).expect("json")
}

async fn sql(server: &Server, q: &str) -> Vec<Value> {
    let r = server.engine().execute(q).await.unwrap_or_else(|e| panic!("{q}: {e}"));
    let j: Value = serde_json::from_slice(&r.render(Format::Json).expect("render")).expect("json");
    j["rows"].as_array().expect("rows").clone()
}

/// Every column of the server's own `table` reads unquoted, as in PostgreSQL (the
/// stored tables are checked in the query crate's test): selected, filtered, grouped
/// and ordered by.
async fn every_column_reads_unquoted(server: &Server, table: &str) {
    let q = format!(
        "SELECT column_name FROM information_schema.columns WHERE table_name = '{table}' ORDER BY ordinal_position"
    );
    let columns: Vec<String> = sql(server, &q).await.iter().map(|r| r[0].as_str().expect("name").to_owned()).collect();
    assert!(columns.len() > 5, "{table}: {columns:?}");
    for c in &columns {
        sql(server, &format!("SELECT {c}, count(*) FROM {table} WHERE {c} IS NOT NULL OR {c} IS NULL GROUP BY {c} ORDER BY {c} LIMIT 3"))
            .await;
    }
    let all = columns.join(", ");
    sql(server, &format!("SELECT {all} FROM {table} ORDER BY {all} LIMIT 1")).await;
}

/// The GPUs and pods of the trace below.
struct Cast {
    a: GpuIdentity,
    b: GpuIdentity,
    z: GpuIdentity,
    u: GpuIdentity,
    l: GpuIdentity,
    nb: GpuHolder,
    etl: GpuHolder,
}

fn cast() -> Cast {
    Cast {
        a: ident("node-0", "GPU-A", H100),
        b: ident("node-0", "GPU-B", H100),
        z: ident("node-0", "GPU-Z", H100),
        u: ident("node-1", "GPU-U", H100),
        l: ident("node-1", "GPU-L", H100),
        nb: pod("data-science", "jupyter-alice", r#"{"team":"ds"}"#),
        etl: pod("analytics", "etl", "{}"),
    }
}

/// The same stretch `(from, to]` of several GPUs: (GPU, SM, framebuffer GiB, holder).
fn span<'a>(from: i64, to: i64, states: &[(&'a GpuIdentity, f64, f64, &Option<GpuHolder>)]) -> Vec<Seg<'a>> {
    states.iter().map(|&(g, sm, fb, h)| seg(g, from, to, sm, fb, h.clone())).collect()
}

impl Cast {
    /// Everything until 10:50 but GPU L's XID and lost stretch ([`l_fails`]).
    fn until_50(&self) -> Vec<Seg<'_>> {
        let (nb, etl) = (Some(self.nb.clone()), Some(self.etl.clone()));
        vec![
            seg(&self.a, 0, 10 * MIN, 0.5, 20.0, nb.clone()),
            seg(&self.a, 10 * MIN, 50 * MIN, 0.0, 0.5, nb.clone()),
            seg(&self.b, 0, 50 * MIN, 0.5, 20.0, nb),
            seg(&self.z, 0, 50 * MIN, 0.0, 4.0, None),
            seg(&self.u, 0, 45 * MIN, 0.0, 0.0, None),
            seg(&self.u, 45 * MIN, 50 * MIN, 0.7, 3.0, None),
            seg(&self.l, 0, 49 * MIN + 30 * SEC, 0.5, 2.0, etl),
        ]
    }
}

/// GPU L's XID 79 in the window ending 10:49:40, then lost until `lost_to`.
fn l_fails<'a>(l: &'a GpuIdentity, etl: &GpuHolder, lost_to: i64) -> [Seg<'a>; 2] {
    let mut xid = seg(l, 49 * MIN + 30 * SEC, 49 * MIN + 40 * SEC, 0.5, 2.0, Some(etl.clone()));
    xid.xid = Some(79.0);
    let mut lost = seg(l, 49 * MIN + 40 * SEC, lost_to, 0.0, 0.0, Some(etl.clone()));
    lost.lost = true;
    [xid, lost]
}

/// The trace (10 s windows, times from 10:00):
///
/// | GPU | what | expected at 10:50 |
/// | --- | --- | --- |
/// | A, B (node-0) | pod `data-science/jupyter-alice` (team ds by label); A busy 0.5 to 10:10, then idle with 0.5 GiB; B busy throughout | stranded allocation, 1 of 2 GPUs, idle 40 min since 10:10, $2.40 burnt |
/// | Z | nobody; idle holding 4 GiB, no process | zombie memory since 10:00: 50 min, $3.00 |
/// | U | nobody; SM 0.7 from 10:45 | unallocated busy (5 min ≥ 2 min) |
/// | L | pod analytics/etl; busy, XID 79 in the window ending 10:49:40, lost from 10:49:50 | gpu_lost and xid_error (79) |
///
/// From 10:50 to 11:01 every condition clears: A computes, Z frees its memory, U idles,
/// L is back without XIDs (the XID's 10 min hold ends at 10:59:40).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_alert_kind_fires_with_hand_computed_figures_and_resolves() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (hook, seen, _hook_task) = capture().await;
    let alerts = AlertsConfig {
        webhook: Some(toml::from_str(&format!("url = \"http://{hook}/hook\"")).expect("webhook config")),
        // Two GPUs per query: the pass works through the fleet in three chunks.
        gpus_per_query: 2,
        ..AlertsConfig::default()
    };
    let server = open(dir.path())
        .with_cost(cost(dir.path(), apron_cost::TeamConfig::default()))
        .expect("cost")
        .with_alerts(alerts);
    let c = cast();
    let Cast { a, b, z, u, l, nb, etl } = &c;
    let [lost_xid, lost] = l_fails(l, etl, 50 * MIN);
    let first = windows(&{
        let mut v = c.until_50();
        v.extend([lost_xid, lost]);
        v
    });
    ingest(&server, &first, 0);
    let evaluator = server.alerts().expect("alerts on").clone();
    let r = evaluator.evaluate_at(T0 + 50 * MIN).await.expect("evaluate");
    assert_eq!(r.fired.len(), 5, "{r:?}");

    let list = evaluator.list();
    let by_kind = |k: &str| list.iter().find(|a| a.kind == k).unwrap_or_else(|| panic!("{k} in {list:#?}"));
    let s = by_kind("stranded_allocation");
    assert_eq!(
        (s.team.as_str(), s.owner.as_deref(), s.gpus_stranded, s.gpus_total),
        ("ds", Some("data-science/jupyter-alice"), 1, 2)
    );
    assert_eq!(s.gpu_uuids, ["GPU-A"]);
    assert_eq!((s.starts_at_us, s.idle_s), (T0 + 10 * MIN, 2400.0));
    // 40 min × $3.60/h = $2.40.
    assert_eq!(s.cost_micros, Some(2_400_000));
    let zombie = by_kind("zombie_memory");
    assert_eq!(
        (zombie.gpu_uuids.as_slice(), zombie.starts_at_us, zombie.cost_micros),
        (&["GPU-Z".to_owned()][..], T0, Some(3_000_000))
    );
    assert_eq!(by_kind("unallocated_busy").gpu_uuids, ["GPU-U"]);
    assert_eq!(
        (by_kind("gpu_lost").gpu_uuids.as_slice(), by_kind("gpu_lost").severity.as_str()),
        (&["GPU-L".to_owned()][..], "critical")
    );
    assert!(by_kind("xid_error").summary.contains("XID 79"));

    // The same alerts over HTTP, in SQL and on /metrics.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let api = listener.local_addr().expect("addr");
    let router =
        apron::insights::router(apron::insights::AlertSource::Local(evaluator.clone()), None, apron::Access::Loopback);
    tokio::spawn(async move { axum::serve(listener, router).await.expect("serve") });
    let j = http_get(api, "/api/v1/alerts?state=firing").await;
    let stranded = j["alerts"]
        .as_array()
        .expect("alerts")
        .iter()
        .find(|a| a["kind"] == "stranded_allocation")
        .cloned()
        .expect("stranded");
    assert_eq!((stranded["cost_usd"].as_f64(), stranded["gpus_stranded"].as_u64()), (Some(2.4), Some(1)));
    assert_eq!(stranded["starts_at"], "2026-11-19T10:10:00.000000Z");
    let rows = sql(
        &server,
        "SELECT kind, CAST(cost_usd AS VARCHAR), gpus_stranded FROM alerts WHERE state = 'firing' ORDER BY kind",
    )
    .await;
    assert_eq!(rows.len(), 5);
    assert_eq!(rows[1], serde_json::json!(["stranded_allocation", "2.400000", 1]));
    let mut registry = prometheus_client::registry::Registry::default();
    registry.register_collector(Box::new(server.alert_metrics().clone()));
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
    assert!(
        text.contains("apron_stranded_allocation{team=\"ds\",host=\"node-0\",gpu=\"GPU-A\",owner=\"data-science/jupyter-alice\",workload_kind=\"\"} 1"),
        "{text}"
    );
    assert!(text.contains("apron_stranded_seconds{team=\"ds\",host=\"node-0\",gpu=\"GPU-A\",owner=\"data-science/jupyter-alice\",workload_kind=\"\"} 2400.0"), "{text}");
    assert!(text.contains("apron_alerts_firing{kind=\"zombie_memory\"} 1"), "{text}");

    // Each transition reaches the webhook once, with a Slack-compatible text.
    let wall = UnixMicros::now().0;
    let out = evaluator.deliver(wall).await;
    assert!(out.iter().all(Result::is_ok), "{out:?}");
    evaluator.deliver(wall).await;
    {
        let got = seen.lock().expect("lock");
        assert_eq!(got.len(), 5, "{got:#?}");
        let texts: Vec<&str> = got.iter().filter_map(|v| v["text"].as_str()).collect();
        assert!(texts.iter().all(|t| t.starts_with("[FIRING] Apron")), "{texts:?}");
        assert!(
            texts
                .iter()
                .any(|t| t.contains("jupyter-alice") && t.contains("1 of 2 GPUs") && t.ends_with("$2.40 burnt so far")),
            "{texts:?}"
        );
    }

    // Everything clears.
    let second = windows(&[
        seg(a, 50 * MIN, 61 * MIN, 0.4, 20.0, Some(nb.clone())),
        seg(b, 50 * MIN, 61 * MIN, 0.5, 20.0, Some(nb.clone())),
        seg(z, 50 * MIN, 61 * MIN, 0.0, 0.0, None),
        seg(u, 50 * MIN, 61 * MIN, 0.0, 0.0, None),
        seg(l, 50 * MIN, 61 * MIN, 0.5, 2.0, Some(etl.clone())),
    ]);
    ingest(&server, &second, 1);
    let r = evaluator.evaluate_at(T0 + 61 * MIN).await.expect("evaluate");
    assert_eq!((r.fired.len(), r.resolved.len()), (0, 5), "{r:?}");
    evaluator.deliver(UnixMicros::now().0).await;
    let got = seen.lock().expect("lock").clone();
    assert_eq!(got.len(), 10);
    assert!(got[5..].iter().all(|v| v["text"].as_str().is_some_and(|t| t.starts_with("[RESOLVED]"))), "{got:#?}");
    let rows = sql(
        &server,
        "SELECT count(*) FROM alerts WHERE state = 'resolved' AND ends_at = TIMESTAMP '2026-11-19T11:01:00Z'",
    )
    .await;
    assert_eq!(rows[0][0], 5);
    every_column_reads_unquoted(&server, "alerts").await;

    // Exempt by label: the notebook's stranded alert never fires.
    let dir2 = tempfile::tempdir().expect("tempdir");
    let mut exempt = AlertsConfig::default();
    exempt.exempt.labels.insert("team".into(), "ds".into());
    let quiet = open(dir2.path())
        .with_cost(cost(dir2.path(), apron_cost::TeamConfig::default()))
        .expect("cost")
        .with_alerts(exempt);
    ingest(&quiet, &first, 0);
    let e = quiet.alerts().expect("alerts").clone();
    e.evaluate_at(T0 + 50 * MIN).await.expect("evaluate");
    assert!(e.list().iter().all(|a| a.kind != "stranded_allocation"));
    assert_eq!(e.list().len(), 4);
}

/// Incremental passes (the tracker carried from pass to pass, only new windows read)
/// list exactly the alerts of passes that read the whole lookback, step by step through
/// the trace above: firing, holding, clearing, and a late backfilled window, which sends
/// the incremental evaluator back to a whole read once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incremental_passes_list_what_whole_passes_list() {
    let (d1, d2) = (tempfile::tempdir().expect("tempdir"), tempfile::tempdir().expect("tempdir"));
    let server = |dir: &std::path::Path, incremental: bool| {
        open(dir).with_cost(cost(dir, apron_cost::TeamConfig::default())).expect("cost").with_alerts(AlertsConfig {
            gpus_per_query: 2,
            incremental,
            ..AlertsConfig::default()
        })
    };
    let (inc, whole) = (server(d1.path(), true), server(d2.path(), false));
    let c = cast();
    let Cast { a, b, z, u, l, nb, etl } = &c;
    let n = ident("node-2", "GPU-N", H100);
    let [lost_xid, lost] = l_fails(l, etl, 53 * MIN);
    use apron::alerts::PassKind::{Incremental, Whole};
    // (windows ingested, evaluated at, how the incremental evaluator reads, firing then)
    let steps = [
        (
            windows(&{
                let mut v = c.until_50();
                v.push(lost_xid);
                v
            }),
            50 * MIN,
            Whole,
            4,
        ),
        // The lost stretch arrives in the next pass; everything else holds.
        (
            windows(&{
                let mut v = span(
                    50 * MIN,
                    53 * MIN,
                    &[
                        (a, 0.0, 0.5, &Some(nb.clone())),
                        (b, 0.5, 20.0, &Some(nb.clone())),
                        (z, 0.0, 4.0, &None),
                        (u, 0.7, 3.0, &None),
                    ],
                );
                v.push(lost);
                v
            }),
            53 * MIN,
            Incremental,
            5,
        ),
        (
            windows(&span(
                53 * MIN,
                61 * MIN,
                &[
                    (a, 0.4, 20.0, &Some(nb.clone())),
                    (b, 0.5, 20.0, &Some(nb.clone())),
                    (z, 0.0, 0.0, &None),
                    (u, 0.0, 0.0, &None),
                    (l, 0.5, 2.0, &Some(etl.clone())),
                ],
            )),
            61 * MIN,
            Incremental,
            0,
        ),
        // Late: GPU-N's idle allocation from 10:20, backfilled after the 11:01 pass.
        (windows(&[seg(&n, 20 * MIN, 62 * MIN, 0.0, 0.5, Some(etl.clone()))]), 62 * MIN, Whole, 1),
        (
            windows(&[
                seg(&n, 62 * MIN, 66 * MIN, 0.0, 0.5, Some(etl.clone())),
                seg(a, 61 * MIN, 66 * MIN, 0.0, 20.0, Some(nb.clone())),
            ]),
            66 * MIN,
            Incremental,
            // GPU-N stranded; GPU-A idle holding 20 GiB with no process for 5 min: zombie.
            2,
        ),
    ];
    for (seq, (rows, at, how, firing)) in steps.into_iter().enumerate() {
        ingest(&inc, &rows, seq as u64);
        ingest(&whole, &rows, seq as u64);
        let (i, w) = (inc.alerts().expect("alerts"), whole.alerts().expect("alerts"));
        let ri = i.evaluate_at(T0 + at).await.expect("incremental pass");
        let rw = w.evaluate_at(T0 + at).await.expect("whole pass");
        assert_eq!((ri.how, rw.how), (how, Whole), "at T0 + {} min", at / MIN);
        let sorted = |mut v: Vec<apron_cost::alert::AlertRecord>| {
            v.sort_by(|x, y| x.id.cmp(&y.id));
            v
        };
        let (li, lw) = (sorted(i.list()), sorted(w.list()));
        assert_eq!(li, lw, "at T0 + {} min", at / MIN);
        let on = li.iter().filter(|a| a.state == apron_cost::alert::AlertState::Firing).count();
        assert_eq!(on, firing, "at T0 + {} min: {li:#?}", at / MIN);
        if how == Incremental {
            assert!(ri.windows < rw.windows, "an incremental pass reads less: {ri:?} vs {rw:?}");
        }
    }
}

/// The simulator's `notebook-idle-resume` notebook, backfilled; at a moment 40 minutes
/// into an idle stretch the stranded alert fires and reaches a real Alertmanager (API
/// v2) with its labels and dollars; once work resumes it resolves there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stranded_sim_notebook_reaches_a_real_alertmanager_and_resolves() {
    use apron_agent::source::sim::{PhaseKind, Scenario, SimConfig, SimSource};
    let bin = std::env::var("APRON_ALERTMANAGER").unwrap_or_else(|_| "prometheus-alertmanager".into());
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("am.yml");
    std::fs::write(&config, "route:\n  receiver: blackhole\nreceivers:\n  - name: blackhole\n").expect("config");
    let port = super::free_port();
    let child = std::process::Command::new(&bin)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!("--storage.path={}", dir.path().join("am-data").display()))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .arg("--cluster.listen-address=")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("{bin} (Debian package prometheus-alertmanager; scripts/install-test-tools.sh installs it): {e}")
        });
    let _am = super::KillOnDrop(vec![child]);
    let am = format!("http://127.0.0.1:{port}");
    let ready = format!("{am}/-/ready");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while ureq::get(&ready).call().is_err() {
        assert!(std::time::Instant::now() < deadline, "Alertmanager did not become ready at {ready}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // One node, one GPU, the resuming notebook.
    let sim_config = SimConfig {
        nodes: 1,
        gpus_per_node: 1,
        scenarios: Some(vec![Scenario::NotebookIdleResume]),
        ..SimConfig::default()
    };
    let now = UnixMicros::now().0;
    let sim = SimSource::starting_at(&sim_config, None, UnixMicros(now)).expect("sim");
    // The latest idle stretch (2 h in every 3 h cycle) that has ended by now: both the
    // firing and the resolution lie in the past, so Alertmanager's clock agrees.
    let phase = |t: i64| sim.fleet().phase(0, UnixMicros(t));
    let mut t = now - 2 * 3600 * SEC - 10 * MIN;
    while !(phase(t) == Some(PhaseKind::Stranded) && phase(t - MIN) == Some(PhaseKind::Active)) {
        t -= 10 * SEC;
        assert!(t > now - 6 * 3600 * SEC, "no idle stretch found");
    }
    while phase(t - SEC) == Some(PhaseKind::Stranded) {
        t -= SEC;
    }
    let idle_from = t;
    let mut resume = idle_from;
    while phase(resume) != Some(PhaseKind::Active) {
        resume += 10 * SEC;
    }
    let fire_at = idle_from + 40 * MIN;
    let resolve_at = resume + 2 * MIN;
    assert!(resolve_at < now, "the resolution lies in the past");

    let alerts: AlertsConfig = toml::from_str(&format!("[alertmanager]\nurls = [\"{am}\"]\n")).expect("alerts config");
    let teams = apron_cost::TeamConfig::from_toml("[namespaces]\ndata-science = \"data-science\"\n").expect("teams");
    let server = open(dir.path()).with_cost(cost(dir.path(), teams)).expect("cost").with_alerts(alerts);
    let store = server.store().clone();
    let end = UnixMicros(resolve_at);
    let span = Duration::from_micros(u64::try_from(resolve_at - (idle_from - 2 * 3600 * SEC)).expect("span"));
    tokio::task::spawn_blocking(move || apron::backfill::run(&store, &sim, end, span, Duration::from_secs(1)))
        .await
        .expect("join")
        .expect("backfill");
    let evaluator = server.alerts().expect("alerts").clone();

    let r = evaluator.evaluate_at(fire_at).await.expect("evaluate");
    assert_eq!(r.fired.len(), 1, "{r:?} {:#?}", evaluator.list());
    let fired = evaluator.list()[0].clone();
    assert_eq!((fired.kind.as_str(), fired.team.as_str()), ("stranded_allocation", "data-science"));
    // The idle run began after the last 6 s burst of the active hour (bursts come every
    // 30 s), so 40 min to 40 min 25 s before; the sim's H100 at $3.60/h is $0.001 a
    // second burnt.
    assert!((2399.0..=2426.0).contains(&fired.idle_s), "{fired:?}");
    assert_eq!(fired.cost_micros, Some((fired.idle_s * 1000.0).round() as i64), "{fired:?}");
    let out = evaluator.deliver(UnixMicros::now().0).await;
    assert!(out.iter().all(Result::is_ok), "{out:?}");

    let list = |am: String| async move {
        tokio::task::spawn_blocking(move || {
            let mut r = ureq::get(&format!("{am}/api/v2/alerts")).call().expect("GET alerts");
            serde_json::from_slice::<Value>(&r.body_mut().read_to_vec().expect("body")).expect("json")
        })
        .await
        .expect("join")
    };
    let got = list(am.clone()).await;
    let got = got.as_array().expect("array");
    assert_eq!(got.len(), 1, "{got:#?}");
    let labels = &got[0]["labels"];
    assert_eq!(labels["alertname"], "ApronStrandedAllocation");
    assert_eq!(labels["team"], "data-science");
    assert_eq!(labels["kind"], "stranded_allocation");
    assert_eq!(labels["host"], "sim-node-0");
    assert!(labels["owner"].as_str().is_some_and(|o| o.starts_with("data-science/jupyter-")), "{labels}");
    assert!(labels["gpu"].as_str().is_some_and(|g| g.starts_with("GPU-")));
    assert_eq!(got[0]["status"]["state"], "active");
    assert_eq!(
        got[0]["annotations"]["cost_usd"],
        apron_cost::Micros(fired.cost_micros.unwrap_or(0)).to_cents().to_string()
    );
    assert_eq!(got[0]["annotations"]["gpus_stranded"], "1/1");

    // Work resumes: resolved here and, once delivered, no longer active there.
    let r = evaluator.evaluate_at(resolve_at).await.expect("evaluate");
    assert_eq!(r.resolved.len(), 1, "{r:?}");
    let out = evaluator.deliver(UnixMicros::now().0).await;
    assert!(out.iter().all(Result::is_ok), "{out:?}");
    let got = list(am).await;
    assert_eq!(got.as_array().map(Vec::len), Some(0), "resolved alerts leave Alertmanager's active list: {got:#?}");
}

/// Recommendations over one hour (10 s windows, 10:00–11:00), hand-computed:
///
/// | GPUs | workload | expected |
/// | --- | --- | --- |
/// | R (H100, node-0) | pod ds/nb, idle 54 of 60 min | reclaim: 54 min × $3.60/h = $3.24; × 730 = $2365.20 |
/// | J0–J3 (H100, node-1) | Slurm job 42: J0 busy, J1–J3 idle | right-size: replay frees 3 GPU-hours = $10.80; × 730 = $7884.00 |
/// | P1, P2 (H100, node-2) | two embedders, SM 0.05, 6 and 8 GiB | pack onto one GPU (1g.10gb each): 1 GPU-hour = $3.60; × 730 = $2628.00 |
/// | S (A100 80GB, node-3) | pod batch/etl labelled interruptible, SM 0.7, 60 GiB | spot: ($4.00 − $1.50) × 1 h = $2.50; × 730 = $1825.00 |
/// | X (H100, node-4) | one embedder alone, SM 0.05, 7 GiB | downsize to 1g.10gb: $3.60 × 6/7 = $3.085714/h (to the µ$, as the price book prices slices) × 1 h; × 730 = $2252.571220 → $2252.57 |
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recommendations_match_the_price_books_arithmetic_with_replays() {
    let dir = tempfile::tempdir().expect("tempdir");
    let teams = apron_cost::TeamConfig::from_toml(
        "[namespaces]\nds = \"data-science\"\nsearch = \"search\"\nbatch = \"analytics\"\n\
         [slurm_accounts]\nvision = \"vision\"\n\
         [[interruptible]]\nlabel = \"interruptible\"\nlabel_value = \"true\"\n",
    )
    .expect("teams");
    let server = open(dir.path())
        .with_cost(cost(dir.path(), teams))
        .expect("cost")
        // One GPU per query: every figure is gathered slice by slice.
        .with_recommend(RecommendSettings {
            window: Duration::from_secs(3600),
            gpus_per_query: 1,
            ..RecommendSettings::default()
        });
    let g = |host: &str, uuid: &str| ident(host, uuid, H100);
    let (r, p1, p2, x) = (g("node-0", "GPU-R"), g("node-2", "GPU-P1"), g("node-2", "GPU-P2"), g("node-4", "GPU-X"));
    let js: Vec<GpuIdentity> = (0..4).map(|i| g("node-1", &format!("GPU-J{i}"))).collect();
    let s = ident("node-3", "GPU-S", "NVIDIA A100-SXM4-80GB");
    let mut job = GpuHolder::slurm_job("42");
    job.account = Some("vision".into());
    let emb = |n: &str| pod("search", n, "{}");
    let h = 60 * MIN;
    let mut segs = vec![
        seg(&r, 0, 6 * MIN, 0.3, 10.0, Some(pod("ds", "nb", "{}"))),
        seg(&r, 6 * MIN, h, 0.0, 10.0, Some(pod("ds", "nb", "{}"))),
        seg(&p1, 0, h, 0.05, 6.0, Some(emb("emb-1"))),
        seg(&p2, 0, h, 0.05, 8.0, Some(emb("emb-2"))),
        seg(&x, 0, h, 0.05, 7.0, Some(emb("emb-3"))),
        seg(&s, 0, h, 0.7, 60.0, Some(pod("batch", "etl", r#"{"interruptible":"true"}"#))),
    ];
    for (i, j) in js.iter().enumerate() {
        segs.push(seg(j, 0, h, if i == 0 { 0.6 } else { 0.0 }, if i == 0 { 40.0 } else { 0.6 }, Some(job.clone())));
    }
    ingest(&server, &windows(&segs), 0);
    let rec = server.recommender().expect("recommender").clone();
    let set = rec.compute(Duration::from_secs(3600), T0 + h).await.expect("compute");
    let json = serde_json::to_value(&set).expect("json");
    let items = json["recommendations"].as_array().expect("items");
    let find = |kind: &str| items.iter().find(|i| i["kind"] == kind).unwrap_or_else(|| panic!("{kind} in {items:#?}"));
    let money =
        |i: &Value| (i["window_savings_usd"].as_f64().expect("w"), i["monthly_savings_usd"].as_f64().expect("m"));

    let reclaim = find("reclaim");
    assert_eq!((reclaim["team"].as_str(), reclaim["owner"].as_str()), (Some("data-science"), Some("ds/nb")));
    assert_eq!(money(reclaim), (3.24, 2365.20));
    assert_eq!(reclaim["savings_kind"], "cash");
    // Every window observed; the per-minute idle share is 0 for 6 minutes and 1 for 54
    // (mean 0.9, σ 0.3): confidence = 1 / (1 + 0.3/0.9) = 0.75.
    assert_eq!(reclaim["confidence"], 0.75);

    let rs = find("right-size");
    assert_eq!((rs["team"].as_str(), rs["gpus"].as_array().map(Vec::len)), (Some("vision"), Some(4)));
    assert_eq!(money(rs), (10.80, 7884.00));
    assert_eq!(rs["replay"]["gpu_us_saved"], 3 * 3600 * SEC);
    assert_eq!(rs["replay"]["collisions"].as_array().map(Vec::len), Some(0));

    let pack = find("pack");
    assert_eq!(pack["gpus"], serde_json::json!(["GPU-P1", "GPU-P2"]));
    assert_eq!(money(pack), (3.60, 2628.00));
    assert_eq!(pack["evidence"]["workloads"][0]["mig_profile"], "1g.10gb");
    assert_eq!(pack["evidence"]["gpus_freed"], 1);
    assert_eq!(pack["replay"]["peak_gpus_after"], 1);

    let spot = find("spot");
    assert_eq!(money(spot), (2.50, 1825.00));
    assert_eq!((spot["team"].as_str(), spot["savings_kind"].as_str()), (Some("analytics"), Some("cash")));

    let down = find("downsize");
    assert_eq!(down["gpus"], serde_json::json!(["GPU-X"]));
    assert_eq!(money(down), (3.09, 2252.57));
    assert!(items.iter().all(|i| i["kind"] != "rebalance-quota"), "no pending work is reported");
    assert_eq!(items.len(), 5, "{items:#?}");

    // A 7-day window over the same hour of data extrapolates the hour it covers: the
    // same monthly figures, whatever window the UI, `apron recommend` or the API ask for.
    assert_eq!(json["covered_hours"], 1.0);
    let week = rec.compute(Duration::from_secs(7 * 86_400), T0 + h).await.expect("7d");
    let week = serde_json::to_value(&week).expect("json");
    assert_eq!(
        (&week["covered_hours"], &week["monthly_savings_usd"]),
        (&json["covered_hours"], &json["monthly_savings_usd"])
    );
    let monthly = |v: &Value| -> Vec<(Value, Value)> {
        let items = v["recommendations"].as_array().expect("items");
        items.iter().map(|i| (i["id"].clone(), i["monthly_savings_usd"].clone())).collect()
    };
    assert_eq!(monthly(&week), monthly(&json));

    // The evidence's SQL reproduces its figures.
    let q = reclaim["evidence"]["sql"].as_str().expect("sql");
    let rows = sql(&server, q).await;
    assert_eq!((rows[0][2].as_f64(), rows[0][4].as_f64()), (Some(3600.0), Some(54.0 * 60.0)), "{rows:?}");
    // … p95s included: the window's sketch is its hours' sketches merged, bucket for
    // bucket, so the SQL over raw windows gives the very figures the run used — within
    // the sketch's 1 % of the trace's constant SM 0.05 and 6 / 8 GiB.
    let q = pack["evidence"]["sql"].as_str().expect("sql");
    let rows = sql(&server, q).await;
    let workloads = pack["evidence"]["workloads"].as_array().expect("workloads");
    assert_eq!(rows.len(), 2, "{rows:?}");
    for row in &rows {
        let w = workloads.iter().find(|w| w["gpu_uuid"] == row[0]).expect("a workload per row");
        let mem = row[6].as_f64().map(|v| v.round() as i64);
        assert_eq!((&row[5], mem), (&w["p95_sm_active"], w["p95_fb_used_bytes"].as_i64()), "{row:?} {w}");
        let sm = row[5].as_f64().expect("p95 SM");
        assert!((sm - 0.05).abs() <= 0.05 * 0.01, "{sm}");
    }

    // The table holds the same items.
    rec.refresh_at(T0 + h).await.expect("refresh");
    let rows = sql(
        &server,
        "SELECT kind, CAST(monthly_savings_usd AS VARCHAR) FROM recommendations \
         WHERE window_savings_usd * 730 / covered_hours - monthly_savings_usd BETWEEN -0.000001 AND 0.000001 ORDER BY kind",
    )
    .await;
    assert_eq!(
        rows,
        serde_json::json!([
            ["downsize", "2252.571220"],
            ["pack", "2628.000000"],
            ["reclaim", "2365.200000"],
            ["right-size", "7884.000000"],
            ["spot", "1825.000000"]
        ])
        .as_array()
        .expect("rows")
        .clone()
    );
    every_column_reads_unquoted(&server, "recommendations").await;
}

/// Idle runs that began before the lookback are followed back to where they began —
/// all of a pass's such runs with one query — and priced from there (10 s windows,
/// $0.001 a second; evaluated at 14:00, hours before the lookback starts):
///
/// | GPU | trace | stranded since | idle | burnt |
/// | --- | --- | --- | --- | --- |
/// | P | ml/p busy 10:00–11:00, then idle | 11:00 | 3 h | $10.80 |
/// | Q | ml/q idle from its first window (10:00) | 10:00 | 4 h | $14.40 |
/// | R | ml/old busy 10:00–11:30, then ml/r idle | 11:30 | 2.5 h | $9.00 |
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_runs_older_than_the_lookback_are_followed_back_to_their_start() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = open(dir.path())
        .with_cost(cost(dir.path(), apron_cost::TeamConfig::default()))
        .expect("cost")
        .with_alerts(AlertsConfig::default());
    let (p, q, r) = (ident("node-2", "GPU-P", H100), ident("node-2", "GPU-Q", H100), ident("node-2", "GPU-R", H100));
    let ml = |name: &str| Some(pod("ml", name, r#"{"team":"ml"}"#));
    let end = 240 * MIN;
    let trace = windows(&[
        seg(&p, 0, 60 * MIN, 0.5, 20.0, ml("p")),
        seg(&p, 60 * MIN, end, 0.0, 0.0, ml("p")),
        seg(&q, 0, end, 0.0, 0.0, ml("q")),
        seg(&r, 0, 90 * MIN, 0.5, 20.0, ml("old")),
        seg(&r, 90 * MIN, end, 0.0, 0.0, ml("r")),
    ]);
    ingest(&server, &trace, 0);
    server.store().persist_now().expect("persist");
    let evaluator = server.alerts().expect("alerts on").clone();
    let report = evaluator.evaluate_at(T0 + end).await.expect("evaluate");
    assert_eq!(report.fired.len(), 3, "{report:?}");
    let mut got: Vec<(String, i64, f64, Option<i64>)> = evaluator
        .list()
        .into_iter()
        .map(|a| {
            assert_eq!((a.kind.as_str(), a.team.as_str()), ("stranded_allocation", "ml"), "{a:?}");
            (a.owner.unwrap_or_default(), a.starts_at_us, a.idle_s, a.cost_micros)
        })
        .collect();
    got.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        got,
        vec![
            ("ml/p".to_owned(), T0 + 60 * MIN, 10_800.0, Some(10_800_000)),
            ("ml/q".to_owned(), T0, 14_400.0, Some(14_400_000)),
            ("ml/r".to_owned(), T0 + 90 * MIN, 9_000.0, Some(9_000_000)),
        ]
    );
}
