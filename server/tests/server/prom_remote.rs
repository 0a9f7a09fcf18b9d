//! Prometheus as a peer (`server/src/prom_remote.rs`): remote write into `gpu_samples`
//! and remote read out of it.
//!
//! - In process, over HTTP: bad bodies are refused with nothing stored, a resent
//!   WriteRequest stores nothing new, agent data wins; remote read serves dcgm-exporter
//!   and native series with matchers, and a team token reads only its team's rows
//!   (the trace of `access.rs`).
//! - Real binaries: a real Prometheus scrapes a dcgm-exporter-format endpoint and
//!   remote-writes into `apron serve`, whose ledger prices those GPUs; a real Prometheus
//!   with `remote_read` answers `avg_over_time(DCGM_FI_DEV_GPU_UTIL[1h])` over a range
//!   only Apron holds, equal to SQL over the same rows.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use super::access::{AGENT, VIEWER, VISION, open_with_roles, trace};
use super::insights::{H100, MIN, T0, cost, ingest};
use super::{
    KillOnDrop, ServerProc, TOKEN, bearer, free_port, ingest_headers, poll, request, try_request, write_config,
};
use apron::prom_remote::{compress, proto};
use apron_common::wire::{encode_ipc, windows_to_batch};
use apron_common::{Field, FieldStats, GpuIdentity, GpuUuid, GpuWindow, HostName, UnixMicros};
use prost::Message;
use serde_json::Value;

const SEC: i64 = 1_000_000;

/// `(status, headers (lower-case names), body)` of one POST.
async fn post(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: Vec<u8>,
) -> (u16, Vec<(String, String)>, Vec<u8>) {
    let url = format!("http://{addr}{path}");
    let headers: Vec<(String, String)> = headers.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
    tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
        let mut req = agent.post(&url);
        for (k, v) in &headers {
            req = req.header(k, v);
        }
        let mut r = req.send(&body[..]).unwrap_or_else(|e| panic!("{url}: {e}"));
        let status = r.status().as_u16();
        let h = r
            .headers()
            .iter()
            .map(|(k, v)| (k.as_str().to_ascii_lowercase(), v.to_str().unwrap_or_default().to_owned()))
            .collect();
        (status, h, r.body_mut().read_to_vec().expect("body"))
    })
    .await
    .expect("join")
}

fn label(name: &str, value: &str) -> proto::Label {
    proto::Label { name: name.into(), value: value.into() }
}

/// One dcgm-exporter series of GPU `uuid` on `node-9`, samples `(ms, value)`.
fn dcgm_series(name: &str, uuid: &str, samples: &[(i64, f64)]) -> proto::TimeSeries {
    proto::TimeSeries {
        labels: vec![
            label("__name__", name),
            label("UUID", uuid),
            label("gpu", "0"),
            label("Hostname", "node-9"),
            label("modelName", H100),
            label("instance", "node-9:9400"),
            label("job", "dcgm"),
        ],
        samples: samples.iter().map(|&(t, v)| proto::Sample { value: v, timestamp: t }).collect(),
    }
}

fn write_body(series: Vec<proto::TimeSeries>) -> Vec<u8> {
    compress(&proto::WriteRequest { timeseries: series }.encode_to_vec())
}

fn matcher(name: &str, op: proto::MatchType, value: &str) -> proto::LabelMatcher {
    proto::LabelMatcher { r#type: op as i32, name: name.into(), value: value.into() }
}

fn read_body(start_us: i64, end_us: i64, matchers: Vec<proto::LabelMatcher>) -> Vec<u8> {
    let q = proto::Query { start_timestamp_ms: start_us / 1000, end_timestamp_ms: end_us / 1000, matchers };
    compress(&proto::ReadRequest { queries: vec![q], accepted_response_types: vec![] }.encode_to_vec())
}

/// The series of a remote-read answer as (labels as `k=v,…`, samples).
fn decode_read(body: &[u8]) -> Vec<(String, Vec<proto::Sample>)> {
    let raw = snap::raw::Decoder::new().decompress_vec(body).expect("snappy answer");
    let r = proto::ReadResponse::decode(raw.as_slice()).expect("ReadResponse");
    assert_eq!(r.results.len(), 1);
    r.results[0]
        .timeseries
        .iter()
        .map(|s| {
            let l: Vec<String> = s.labels.iter().map(|l| format!("{}={}", l.name, l.value)).collect();
            (l.join(","), s.samples.clone())
        })
        .collect()
}

async fn count(server: &apron::Server, uuid: &str) -> i64 {
    let q = format!("SELECT count(*) FROM gpu_samples WHERE gpu_uuid = '{uuid}'");
    let r = server.engine().execute(&q).await.expect("count");
    let j: Value = serde_json::from_slice(&r.render(apron_query::Format::Json).expect("render")).expect("json");
    j["rows"][0][0].as_i64().expect("n")
}

/// The trace of `access.rs` (GPU-A: vision until 10:30, then nlp; B: nlp; C: nobody;
/// D: vision; 10 s windows), priced, on an in-process server with roles.
async fn served_trace(dir: &std::path::Path) -> (apron::Server, SocketAddr) {
    let server = open_with_roles(dir).with_cost(cost(dir, apron_cost::TeamConfig::default())).expect("cost");
    ingest(&server, &trace(), 0);
    let r = server.ledger().expect("ledger").run_once(T0 + 61 * MIN).await;
    assert!(r.errors.is_empty(), "{r:?}");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let router = server.router();
    tokio::spawn(async move { axum::serve(listener, router).await.expect("serve") });
    (server, addr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_write_refuses_bad_bodies_and_stores_a_resent_batch_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (server, addr) = served_trace(dir.path()).await;
    let agent = format!("Bearer {AGENT}");
    let auth =
        [("authorization", agent.as_str()), ("content-encoding", "snappy"), ("content-type", "application/x-protobuf")];
    let t = |s: i64| (T0 + 2 * 3600 * SEC) / 1000 + s * 1000;
    let util = |s: &[i64]| {
        dcgm_series("DCGM_FI_DEV_GPU_UTIL", "GPU-RW", &s.iter().map(|&k| (t(k), k as f64)).collect::<Vec<_>>())
    };
    let good = write_body(vec![util(&[0, 15, 30, 45])]);

    // Refused, each with its status; nothing stored.
    let status = |h: &[(&str, &str)], body: Vec<u8>| {
        let h: Vec<(String, String)> = h.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        async move {
            let h: Vec<(&str, &str)> = h.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            let (s, _, b) = post(addr, "/api/v1/write", &h, body).await;
            (s, serde_json::from_slice::<Value>(&b).map(|v| v["error"].clone()).unwrap_or(Value::Null))
        }
    };
    assert_eq!(status(&[], good.clone()).await.0, 401);
    let viewer = format!("Bearer {VIEWER}");
    assert_eq!(status(&[("authorization", &viewer)], good.clone()).await.0, 401, "a read token may not write");
    assert_eq!(status(&auth, b"plain text, not snappy".to_vec()).await, (400, "not_snappy".into()));
    assert_eq!(status(&auth, compress(b"\xff\xff\xff")).await, (400, "invalid_protobuf".into()));
    // A snappy header announcing 100 MB (over the 64 MiB ingest limit): refused unread.
    let mut huge = Vec::new();
    let mut n: u64 = 100_000_000;
    while n >= 0x80 {
        huge.push((n as u8) | 0x80);
        n >>= 7;
    }
    huge.push(n as u8);
    huge.extend_from_slice(b"\x00\x00");
    assert_eq!(status(&auth, huge).await, (413, "body_too_large".into()));
    let v2 = [
        ("authorization", agent.as_str()),
        ("content-type", "application/x-protobuf;proto=io.prometheus.write.v2.Request"),
    ];
    assert_eq!(status(&v2, good.clone()).await.0, 415);
    assert_eq!(count(&server, "GPU-RW").await, 0);

    // Accepted: (0, 15] and (15, 30]; the newest scrape (45) waits for the next one.
    let stored = |h: &[(String, String)]| h.iter().find(|(k, _)| k == "x-apron-rows-stored").map(|(_, v)| v.clone());
    let (s, h, _) = post(addr, "/api/v1/write", &auth, good.clone()).await;
    assert_eq!((s, stored(&h).as_deref()), (204, Some("2")));
    // Prometheus retries a batch whose answer it missed: nothing new.
    let (s, h, _) = post(addr, "/api/v1/write", &auth, good).await;
    assert_eq!((s, stored(&h).as_deref()), (204, Some("0")));
    assert_eq!(count(&server, "GPU-RW").await, 2);
    let (s, h, _) = post(addr, "/api/v1/write", &auth, write_body(vec![util(&[60])])).await;
    assert_eq!((s, stored(&h).as_deref()), (204, Some("1")));
    assert_eq!(count(&server, "GPU-RW").await, 3);

    // Agent data wins: samples for GPU-A over the agent's windows add nothing.
    let before = count(&server, "GPU-A").await;
    let over: Vec<(i64, f64)> = (0..6).map(|k| ((T0 + k * 15 * SEC) / 1000, 10.0)).collect();
    let (s, h, _) =
        post(addr, "/api/v1/write", &auth, write_body(vec![dcgm_series("DCGM_FI_DEV_GPU_UTIL", "GPU-A", &over)])).await;
    assert_eq!((s, stored(&h).as_deref()), (204, Some("0")));
    assert_eq!(count(&server, "GPU-A").await, before);

    // What was written reads back under its dcgm-exporter name and value.
    let viewer_h = [("authorization", viewer.as_str())];
    let (s, _, b) = post(
        addr,
        "/api/v1/read",
        &viewer_h,
        read_body(T0, T0 + 3 * 3600 * SEC, vec![matcher("UUID", proto::MatchType::Eq, "GPU-RW")]),
    )
    .await;
    assert_eq!(s, 200);
    let got = decode_read(&b);
    let util: Vec<_> = got.iter().filter(|(l, _)| l.contains("__name__=DCGM_FI_DEV_GPU_UTIL")).collect();
    assert_eq!(util.len(), 1, "{got:?}");
    let values: Vec<(i64, f64)> = util[0].1.iter().map(|s| ((s.timestamp - t(0)) / 1000, s.value)).collect();
    assert_eq!(values, vec![(15, 15.0), (30, 30.0), (45, 45.0)]);
    assert!(util[0].0.contains("Hostname=node-9") && util[0].0.contains("modelName=NVIDIA H100"), "{}", util[0].0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_read_serves_dcgm_and_native_series_with_matchers_and_team_scope() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (server, addr) = served_trace(dir.path()).await;
    let read = |token: &'static str, matchers: Vec<proto::LabelMatcher>| async move {
        let auth = format!("Bearer {token}");
        let (s, _, b) =
            post(addr, "/api/v1/read", &[("authorization", &auth)], read_body(T0, T0 + 61 * MIN, matchers)).await;
        assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
        decode_read(&b)
    };
    use proto::MatchType::{Eq, Neq, Nre, Re};
    let util = || matcher("__name__", Eq, "DCGM_FI_DEV_GPU_UTIL");
    let summary = |got: &[(String, Vec<proto::Sample>)]| {
        got.iter()
            .map(|(l, s)| {
                let get =
                    |k: &str| l.split(',').find_map(|kv| kv.strip_prefix(&format!("{k}="))).unwrap_or("").to_owned();
                (get("UUID") + &get("gpu_uuid"), get("namespace"), s.len(), s.first().map(|s| s.value))
            })
            .collect::<Vec<_>>()
    };
    // The viewer: every GPU, one series per holder; 10 s windows, util in %.
    let all = read(VIEWER, vec![util()]).await;
    assert_eq!(
        summary(&all),
        vec![
            ("GPU-A".into(), "nlp".into(), 180, Some(60.0)),
            ("GPU-A".into(), "vision".into(), 180, Some(60.0)),
            ("GPU-B".into(), "nlp".into(), 360, Some(0.0)),
            ("GPU-C".into(), String::new(), 360, Some(0.0)),
            ("GPU-D".into(), "vision".into(), 360, Some(0.0)),
        ]
    );
    // Team vision: its allocations only, as in SQL.
    let mine = read(VISION, vec![util()]).await;
    assert_eq!(
        summary(&mine),
        vec![("GPU-A".into(), "vision".into(), 180, Some(60.0)), ("GPU-D".into(), "vision".into(), 360, Some(0.0))]
    );
    let sql = server
        .engine()
        .execute_as(
            "SELECT count(*) FROM gpu_samples WHERE gpu_uuid = 'GPU-A'",
            &apron_query::Scope::Team(apron_common::TeamName::new("vision").expect("team")),
        )
        .await
        .expect("sql");
    let j: Value = serde_json::from_slice(&sql.render(apron_query::Format::Json).expect("render")).expect("json");
    assert_eq!(j["rows"][0][0], 180);
    // Matchers on names, hosts and owners, both styles: only GPU-C (node-1, no pod).
    let c = read(
        VIEWER,
        vec![
            matcher("__name__", Re, "DCGM_FI_DEV_GPU_UTIL|apron_gpu_util_ratio"),
            matcher("Hostname", Eq, "node-1"),
            matcher("pod", Nre, "tr.*"),
        ],
    )
    .await;
    assert_eq!(summary(&c), vec![("GPU-C".into(), String::new(), 360, Some(0.0))]);
    // Native names and labels; memory in MiB under the dcgm-exporter name.
    let d = read(VIEWER, vec![matcher("__name__", Eq, "apron_gpu_util_ratio"), matcher("gpu_uuid", Eq, "GPU-D")]).await;
    assert_eq!(d.len(), 1);
    assert!(d[0].0.contains("hostname=node-1") && d[0].0.contains("namespace=vision"), "{}", d[0].0);
    let fb = read(
        VIEWER,
        vec![
            matcher("__name__", Eq, "DCGM_FI_DEV_FB_USED"),
            matcher("UUID", Eq, "GPU-A"),
            matcher("namespace", Neq, "nlp"),
        ],
    )
    .await;
    assert_eq!(summary(&fb), vec![("GPU-A".into(), "vision".into(), 180, Some(20.0 * 1024.0))]);
    // Refusals.
    let status = |token: &str, body: Vec<u8>| {
        let auth = format!("Bearer {token}");
        async move { post(addr, "/api/v1/read", &[("authorization", &auth)], body).await.0 }
    };
    assert_eq!(status(AGENT, read_body(T0, T0 + MIN, vec![])).await, 403);
    assert_eq!(status("nope", read_body(T0, T0 + MIN, vec![])).await, 401);
    assert_eq!(status(VIEWER, b"garbage".to_vec()).await, 400);
    assert_eq!(status(VIEWER, read_body(T0, T0 + MIN, vec![matcher("pod", Re, "(")])).await, 400);
}

// ───────────────────────────── real Prometheus ─────────────────────────────

fn prometheus(dir: &std::path::Path, config: &str) -> (std::process::Child, SocketAddr) {
    let path = dir.join("prometheus.yml");
    std::fs::write(&path, config).expect("config");
    let port = free_port();
    let prom = Command::new(std::env::var("APRON_PROMETHEUS").unwrap_or_else(|_| "prometheus".into()))
        .arg(format!("--config.file={}", path.display()))
        .arg(format!("--storage.tsdb.path={}", dir.join("prom").display()))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("prom.log")).expect("log"))
        .spawn()
        .expect("prometheus (Debian package; scripts/install-test-tools.sh installs it)");
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
    poll("Prometheus ready", Duration::from_secs(30), || {
        try_request(addr, "GET", "/-/ready", &[], b"").ok().filter(|r| r.status == 200)
    });
    (prom, addr)
}

fn sql(addr: SocketAddr, token: &str, q: &str) -> Vec<Value> {
    let auth = format!("Bearer {token}");
    let r =
        request(addr, "POST", "/api/v1/sql", &[("authorization", &auth), ("accept", "application/json")], q.as_bytes());
    assert_eq!(r.status, 200, "{q}: {r:?}");
    r.json()["rows"].as_array().expect("rows").clone()
}

fn number(v: &Value) -> f64 {
    v.as_f64().or_else(|| v.as_str().and_then(|s| s.parse().ok())).unwrap_or_else(|| panic!("not a number: {v}"))
}

/// A dcgm-exporter stand-in on port 0: two H100s, GPU-P0 busy in a 0/50/100/25 % cycle
/// by scrape and unallocated, GPU-P1 idle and held by pod ml/train-a.
fn dcgm_exporter() -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let scrapes = Arc::new(AtomicUsize::new(0));
    let n = scrapes.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let mut reader = BufReader::new(conn.try_clone().expect("clone"));
            let mut line = String::new();
            while reader.read_line(&mut line).is_ok_and(|n| n > 2) {
                line.clear();
            }
            let k = n.fetch_add(1, Ordering::SeqCst);
            let util = [0, 50, 100, 25][k % 4];
            let id = |uuid: &str, gpu: u32| {
                format!(
                    "gpu=\"{gpu}\",UUID=\"{uuid}\",device=\"nvidia{gpu}\",modelName=\"{H100}\",Hostname=\"prom-node\""
                )
            };
            let body = format!(
                "# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).\n# TYPE DCGM_FI_DEV_GPU_UTIL gauge\n\
                 DCGM_FI_DEV_GPU_UTIL{{{}}} {util}\nDCGM_FI_DEV_GPU_UTIL{{{},namespace=\"ml\",pod=\"train-a\",container=\"main\"}} 0\n\
                 # HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).\n# TYPE DCGM_FI_DEV_FB_USED gauge\n\
                 DCGM_FI_DEV_FB_USED{{{}}} 1024\nDCGM_FI_DEV_FB_USED{{{},namespace=\"ml\",pod=\"train-a\",container=\"main\"}} 2048\n",
                id("GPU-P0", 0),
                id("GPU-P1", 1),
                id("GPU-P0", 0),
                id("GPU-P1", 1)
            );
            let _ = write!(
                conn,
                "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    (addr, scrapes)
}

const SQL_TOKEN: &str = "sql-token-0123456789abcdef";

/// A real Prometheus scrapes a dcgm-exporter-format endpoint every second and
/// remote-writes into `apron serve`: the samples become 1 s windows with the point-sample
/// rule, and the ledger prices both GPUs (GPU-P1's idle time held by ml/train-a).
#[test]
fn prometheus_remote_writes_a_dcgm_exporter_into_apron_and_the_ledger_prices_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let book = dir.path().join("prices.toml");
    std::fs::write(&book, super::cost::BOOK).expect("book");
    let extra = format!(
        "[sql]\ntokens = [{SQL_TOKEN:?}]\n[cost]\ninterval = \"1s\"\nprice_book = {:?}\n",
        book.display().to_string()
    );
    let config = write_config(dir.path(), &data, &extra, "");
    let server = ServerProc::start(&config, &[], &dir.path().join("apron.log"));
    let (exporter, scrapes) = dcgm_exporter();
    let (prom, _) = prometheus(
        dir.path(),
        &format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: dcgm\n    static_configs:\n      - targets: ['{exporter}']\n\
             remote_write:\n  - url: http://{}/api/v1/write\n    authorization:\n      credentials: {TOKEN}\n    \
             queue_config:\n      batch_send_deadline: 1s\n      min_backoff: 100ms\n      max_backoff: 1s\n",
            server.addr
        ),
    );
    let mut procs = KillOnDrop(vec![prom]);
    let windows = "SELECT gpu_uuid, count(*), sum(window_s), min(window_s), max(window_s), \
                   sum(CASE WHEN pod = 'train-a' THEN 1 ELSE 0 END), max(fb_used_bytes) \
                   FROM gpu_samples WHERE gpu_uuid IN ('GPU-P0', 'GPU-P1') GROUP BY gpu_uuid ORDER BY gpu_uuid";
    poll("8 remote-written windows of each GPU", Duration::from_secs(90), || {
        let rows = sql(server.addr, SQL_TOKEN, windows);
        (rows.len() == 2 && rows.iter().all(|r| r[1].as_i64().unwrap_or(0) >= 8)).then_some(())
    });
    // Prometheus stops: what it sent is what the ledger must price.
    for c in &mut procs.0 {
        let _ = c.kill();
        let _ = c.wait();
    }
    let rows = sql(server.addr, SQL_TOKEN, windows);
    println!(
        "remote-written windows (gpu, n, seconds, min, max, held, fb): {rows:?}; scrapes served: {}",
        scrapes.load(Ordering::SeqCst)
    );
    for r in &rows {
        // 1 s scrapes: each window is the time since the previous scrape.
        let (lo, hi) = (number(&r[3]), number(&r[4]));
        assert!(lo > 0.5 && hi < 3.5, "{r:?}");
    }
    assert_eq!(rows[0][5], 0, "GPU-P0 is nobody's");
    assert_eq!(rows[1][5], rows[1][1], "GPU-P1 is held by ml/train-a in every window");
    assert_eq!(number(&rows[0][6]), 1024.0 * 1024.0 * 1024.0);
    let utils = sql(
        server.addr,
        SQL_TOKEN,
        "SELECT DISTINCT CAST(gpu_util AS DOUBLE) FROM gpu_samples WHERE gpu_uuid = 'GPU-P0' ORDER BY 1",
    );
    assert!(utils.iter().all(|u| [0.0, 0.25, 0.5, 1.0].contains(&number(&u[0]))), "{utils:?}");

    // The ledger prices exactly the seconds remote write stored (state seconds add up
    // to the windows' seconds), at $3.60/h. A request Prometheus had in flight may
    // still land: both sides are read again on every poll.
    let ledger = "SELECT gpu_uuid, CAST(sum(active_s + allocated_idle_s + stranded_s + unallocated_idle_s + unallocated_busy_s) AS DOUBLE), \
                  CAST(sum(cost_usd) AS DOUBLE), CAST(sum(allocated_idle_s + stranded_s) AS DOUBLE), \
                  CAST(sum(unallocated_idle_s + unallocated_busy_s) AS DOUBLE), min(team) \
                  FROM gpu_cost_hourly WHERE gpu_uuid IN ('GPU-P0', 'GPU-P1') GROUP BY gpu_uuid ORDER BY gpu_uuid";
    let (expected, priced) = poll("the ledger prices the remote-written seconds", Duration::from_secs(60), || {
        let stored: Vec<f64> = sql(server.addr, SQL_TOKEN, windows).iter().map(|r| number(&r[2])).collect();
        let rows = sql(server.addr, SQL_TOKEN, ledger);
        let got: Vec<f64> = rows.iter().map(|r| number(&r[1])).collect();
        (got.len() == 2 && got.iter().zip(&stored).all(|(g, e)| (g - e).abs() < 1e-6)).then_some((stored, rows))
    });
    println!(
        "seconds stored {expected:?}; gpu_cost_hourly (gpu, seconds, cost, allocated idle, unallocated, team): {priced:?}"
    );
    for (r, secs) in priced.iter().zip(&expected) {
        assert!((number(&r[2]) - secs * 0.001).abs() < 1e-5, "$0.001 a second: {r:?}");
    }
    assert!((number(&priced[1][3]) - expected[1]).abs() < 1e-6, "GPU-P1: idle while held by ml/train-a");
    assert!((number(&priced[0][4]) - expected[0]).abs() < 1e-6, "GPU-P0: unallocated");
    server.stop();
}

/// A real Prometheus with `remote_read` to Apron (read_recent) answers PromQL over a
/// range only Apron holds (three days ago, ingested as an agent would): the 1 h
/// average equals SQL over the same rows and the hand-computed 37.5 %.
#[test]
fn prometheus_remote_reads_history_only_apron_holds() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let config = write_config(dir.path(), &data, &format!("[sql]\ntokens = [{SQL_TOKEN:?}]"), "");
    let server = ServerProc::start(&config, &[], &dir.path().join("apron.log"));
    // 1 s windows ending at .250 s, from 100 s before the hour to 100 s after it.
    let now = super::now_us();
    let start = (now - 3 * 86_400 * SEC) / SEC * SEC;
    let gpu = |uuid: &str, host: &str| {
        GpuIdentity::gpu(HostName::new(host).expect("host"), GpuUuid::new(uuid).expect("uuid"), 0, H100)
    };
    let (a, b) = (gpu("GPU-RR-A", "rr-node-0"), gpu("GPU-RR-B", "rr-node-1"));
    let mut rows = Vec::new();
    for k in -100..3700_i64 {
        for (g, u) in [(&a, k.rem_euclid(4) as f64 * 0.25), (&b, 0.8)] {
            let mut w = GpuWindow::new(UnixMicros(start + k * SEC + 250_000), Duration::from_secs(1), g.clone());
            w.fields[Field::GpuUtil.index()] = Some(FieldStats::single(u));
            rows.push(w);
        }
    }
    rows.sort_by_key(|w| (w.gpu.gpu_uuid.to_string(), w.time.0));
    let body = encode_ipc(&windows_to_batch(&rows).expect("batch")).expect("ipc");
    let r = request(
        server.addr,
        "POST",
        "/api/v1/ingest",
        &ingest_headers("gpu_samples", "rr", "e1", "1", &bearer()),
        &body,
    );
    assert_eq!(r.status, 200, "{r:?}");

    let (prom, prom_addr) = prometheus(
        dir.path(),
        &format!(
            "global:\n  scrape_interval: 15s\nscrape_configs: []\nremote_read:\n  - url: http://{}/api/v1/read\n    read_recent: true\n    \
             authorization:\n      credentials: {SQL_TOKEN}\n",
            server.addr
        ),
    );
    let _procs = KillOnDrop(vec![prom]);
    // The hour (start, start + 1 h]; no window ends on either edge.
    let at = (start + 3600 * SEC) / SEC;
    let promql = |q: &str| -> Vec<Value> {
        let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
        let mut r = agent
            .get(format!("http://{prom_addr}/api/v1/query"))
            .query("query", q)
            .query("time", at.to_string())
            .call()
            .expect("Prometheus answers");
        let body = r.body_mut().read_to_string().expect("body");
        assert_eq!(r.status().as_u16(), 200, "{q}: {body}");
        let v: Value = serde_json::from_str(&body).expect("json");
        v["data"]["result"].as_array().expect("result").clone()
    };
    let avg = promql("avg_over_time(DCGM_FI_DEV_GPU_UTIL{UUID=\"GPU-RR-A\"}[1h])");
    assert_eq!(avg.len(), 1, "{avg:?}");
    let from_prom = number(&avg[0]["value"][1]);
    let q = format!(
        "SELECT avg(CAST(gpu_util AS DOUBLE)) * 100, count(*) FROM gpu_samples WHERE gpu_uuid = 'GPU-RR-A' \
         AND \"time\" >= to_timestamp_micros({}) AND \"time\" <= to_timestamp_micros({})",
        (at - 3600) * SEC,
        at * SEC
    );
    let from_sql = sql(server.addr, SQL_TOKEN, &q);
    println!("avg_over_time via Prometheus remote read: {from_prom}; SQL over the same rows: {from_sql:?}");
    assert!((from_prom - number(&from_sql[0][0])).abs() < 1e-9);
    assert_eq!(from_sql[0][1], 3600);
    // By hand: 900 windows each at 0, 25, 50 and 75 %.
    assert!((from_prom - 37.5).abs() < 1e-9, "{from_prom}");
    // Both GPUs by host, and samples counted by Prometheus.
    let both = promql("avg by (Hostname) (avg_over_time(DCGM_FI_DEV_GPU_UTIL{Hostname=~\"rr-node-.*\"}[1h]))");
    let mut got: Vec<(String, f64)> = both
        .iter()
        .map(|s| (s["metric"]["Hostname"].as_str().unwrap_or("").to_owned(), number(&s["value"][1])))
        .collect();
    got.sort_by(|x, y| x.0.cmp(&y.0));
    assert_eq!(got.len(), 2, "{both:?}");
    assert!((got[0].1 - 37.5).abs() < 1e-9 && (got[1].1 - 80.0).abs() < 1e-9, "{got:?}");
    let n = promql("count_over_time(apron_gpu_util_ratio{gpu_uuid=\"GPU-RR-B\"}[1h])");
    assert_eq!(number(&n[0]["value"][1]), 3600.0);
    server.stop();
}
