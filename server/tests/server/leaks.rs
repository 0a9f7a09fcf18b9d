//! What a reader could take from the server beyond its rows (issue 39), against the real
//! `apron serve` binary:
//!
//! - `remote_read_is_bounded`: a remote read of 60 queries is refused (400) before any
//!   runs, one whose answer would pass `[remote_read] max_bytes` is 413, one past
//!   `max_samples` 400 (the budget is the request's, across its queries); answers under
//!   the caps are unchanged, and the server stays up.
//! - `a_failed_recommendation_run_tells_nobody_its_sql`: with a query memory limit the
//!   recommender's query over a slice of GPUs cannot meet, `GET /api/v1/recommendations`
//!   answers a team (and a viewer) with the kind of failure and an error id — no SQL, no
//!   other team's GPU, owner or namespace — and the log holds the SQL, with nlp's GPU
//!   ids, under that id; the weekly report likewise.
//! - `on_demand_recommendation_runs_are_limited`: while one on-demand run is in progress
//!   another window is 503 `busy` with `Retry-After`; the same window asked again within
//!   `[recommend] on_demand_cache` is the set already computed.
//! - `metrics_can_require_a_viewer_token`: `[server] metrics_auth = "token"` refuses
//!   `/metrics` without a token (401) and to agents and teams (403), serves a viewer;
//!   `/healthz` stays open.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use apron::prom_remote::{compress, proto};
use apron_common::wire::{encode_ipc, windows_to_batch};
use apron_common::{Field, FieldStats, GpuHolder, GpuIdentity, GpuWindow, UnixMicros};
use prost::Message;
use serde_json::Value;

use super::insights::{H100, ident, pod};
use super::{Reply, ServerProc, TOKEN, ingest_headers, now_us, poll, request, try_request_within};

const VIEWER: &str = "leaks-viewer-token-0123456789";
const VISION: &str = "leaks-vision-token-0123456789";
const NLP: &str = "leaks-nlp-token-0123456789";

const SEC: i64 = 1_000_000;
const MIN: i64 = 60 * SEC;
const GIB: f64 = (1u64 << 30) as f64;

const PRICES: &str = "version = \"leaks\"\n\
    [[price]]\nmodel = \"H100\"\nmatch = [\"H100 80GB HBM3\"]\nkind = \"on_demand\"\nusd_per_gpu_hour = \"3.60\"\n";

/// What only nlp's rows hold: no answer to vision may contain one. (`SELECT`, `FROM`
/// and `gpu_uuid` would be the recommender's own SQL.)
const NLP_ONLY: &[&str] = &["GPU-nlp-secret-7777", "GPU-nlp-secret-8888", "nlp-private", "nlp-notebook", "node-nlp"];
const SQL_WORDS: &[&str] = &["SELECT", "FROM gpu_samples", "gpu_uuid", "owner_kind", "Exec", "(in:"];

/// A server with a viewer, two teams and ~50 minutes of both teams' idle GPUs.
struct Fixture {
    server: ServerProc,
    log: PathBuf,
    /// The trace's first and last window ends (µs).
    base: i64,
    end: i64,
    _dir: tempfile::TempDir,
}

impl Fixture {
    /// `server`: more `[server]` keys; `extra`: more sections (`[remote_read]`,
    /// `[query]`, …); `recommend`: more `[recommend]` keys.
    fn start(server: &str, extra: &str, recommend: &str) -> Fixture {
        Fixture::start_with(server, extra, recommend, true)
    }

    /// [`Fixture::start`]; with `priced`, once both teams see their windows (the
    /// ledger has recorded their allocations).
    fn start_with(server: &str, extra: &str, recommend: &str, priced: bool) -> Fixture {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = dir.path().join("data");
        let book = dir.path().join("prices.toml");
        std::fs::write(&book, PRICES).expect("price book");
        let config = format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n{server}\n\
             [ingest]\ntokens = [{TOKEN:?}]\n\
             [storage]\ndata_dir = {:?}\n\
             [[tokens]]\nrole = \"viewer\"\ntoken = {VIEWER:?}\n\
             [[tokens]]\nrole = \"team:vision\"\ntoken = {VISION:?}\n\
             [[tokens]]\nrole = \"team:nlp\"\ntoken = {NLP:?}\n\
             [cost]\ninterval = \"1s\"\nprice_book = {:?}\n\
             [recommend]\ninterval = \"1h\"\nwindow = \"1h\"\n{recommend}\n\
             {extra}\n",
            data.display().to_string(),
            book.display().to_string()
        );
        let path = dir.path().join("apron.toml");
        std::fs::write(&path, config).expect("config");
        let config = path;
        let log = dir.path().join("apron.log");
        let server = ServerProc::start(&config, &[], &log);

        // The last ~50 minutes, aligned to 10 s, ending a minute ago: all idle.
        let end = now_us().div_euclid(10 * SEC) * 10 * SEC - MIN;
        let base = end - 50 * MIN;
        let vision = |name: &str| pod("vision-ns", name, r#"{"team":"vision"}"#);
        let nlp = |name: &str| pod("nlp-private", name, r#"{"team":"nlp"}"#);
        let gpus = [
            (ident("node-vision-1", "GPU-vision-0001", H100), vision("vision-train")),
            (ident("node-nlp-2", "GPU-nlp-secret-7777", H100), nlp("nlp-notebook-a")),
            (ident("node-nlp-2", "GPU-nlp-secret-8888", H100), nlp("nlp-notebook-b")),
        ];
        let mut windows = Vec::new();
        for (g, h) in &gpus {
            windows.extend(idle_windows(g, h, base, end));
        }
        windows.sort_by_key(|w| (w.time.0, w.gpu.gpu_uuid.to_string()));
        let body = encode_ipc(&windows_to_batch(&windows).expect("batch")).expect("ipc");
        let auth = format!("Bearer {TOKEN}");
        let r = request(
            server.addr,
            "POST",
            "/api/v1/ingest",
            &ingest_headers("gpu_samples", "leaks", "e1", "1", &auth),
            &body,
        );
        assert_eq!(r.status, 200, "ingest: {r:?}");
        // A team sees its windows once the ledger has recorded its allocation (1 s).
        for token in [VISION, NLP].into_iter().filter(|_| priced) {
            let auth = format!("Bearer {token}");
            let q = b"SELECT count(*) AS n FROM gpu_samples";
            poll("each team sees its windows", Duration::from_secs(60), || {
                let r = request(server.addr, "POST", "/api/v1/sql", &[("authorization", &auth)], q);
                (r.status == 200 && r.json()["rows"][0][0].as_i64()? > 0).then_some(())
            });
        }
        Fixture { server, log, base, end, _dir: dir }
    }

    fn addr(&self) -> SocketAddr {
        self.server.addr
    }

    fn get(&self, path: &str, token: &str) -> Reply {
        let auth = format!("Bearer {token}");
        try_request_within(self.addr(), "GET", path, &[("authorization", &auth)], b"", Duration::from_secs(300))
            .unwrap_or_else(|e| panic!("GET {path}: {e}"))
    }

    fn alive(&self) {
        let r = request(self.addr(), "GET", "/healthz", &[], b"");
        assert_eq!(r.status, 200, "{r:?}");
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// 10 s windows of `g`, held by `h` and idle, ending in `(base, end]`.
fn idle_windows(g: &GpuIdentity, h: &GpuHolder, base: i64, end: i64) -> Vec<GpuWindow> {
    let stat = |v: f64| Some(FieldStats { count: 10, mean: v, min: v, max: v, last: v });
    let mut out = Vec::new();
    let mut t = base + 10 * SEC;
    while t <= end {
        let mut w = GpuWindow::new(UnixMicros(t), Duration::from_secs(10), g.clone());
        w.fields[Field::SmActive.index()] = stat(0.0);
        w.fields[Field::GpuUtil.index()] = stat(0.0);
        w.fields[Field::FbUsedBytes.index()] = stat(0.5 * GIB);
        w.fields[Field::FbTotalBytes.index()] = stat(80.0 * GIB);
        w.fields[Field::PowerWatts.index()] = stat(70.0);
        w.owner = Some(h.clone());
        out.push(w);
        t += 10 * SEC;
    }
    out
}

/// The texts of `NLP_ONLY` and `SQL_WORDS` found in `body`.
fn leaked(body: &str) -> Vec<&'static str> {
    NLP_ONLY.iter().chain(SQL_WORDS).copied().filter(|w| body.contains(w)).collect()
}

// ───────────────────────────── remote read ─────────────────────────────

fn matcher(name: &str, op: proto::MatchType, value: &str) -> proto::LabelMatcher {
    proto::LabelMatcher { r#type: op as i32, name: name.into(), value: value.into() }
}

fn query(start_us: i64, end_us: i64, matchers: Vec<proto::LabelMatcher>) -> proto::Query {
    proto::Query { start_timestamp_ms: start_us / 1000, end_timestamp_ms: end_us / 1000, matchers }
}

fn read(f: &Fixture, token: &str, queries: Vec<proto::Query>) -> (Reply, Vec<u8>) {
    let body = compress(&proto::ReadRequest { queries, accepted_response_types: vec![] }.encode_to_vec());
    let auth = format!("Bearer {token}");
    let h =
        [("authorization", auth.as_str()), ("content-encoding", "snappy"), ("content-type", "application/x-protobuf")];
    // The answer is binary: read it raw.
    let mut s = std::net::TcpStream::connect(f.addr()).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(120))).expect("timeout");
    let mut head = format!("POST /api/v1/read HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n", f.addr());
    for (k, v) in h {
        head += &format!("{k}: {v}\r\n");
    }
    head += &format!("Content-Length: {}\r\n\r\n", body.len());
    use std::io::{Read, Write};
    s.write_all(head.as_bytes()).expect("head");
    s.write_all(&body).expect("body");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("answer");
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").expect("an HTTP answer");
    let head = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
    let payload = raw[split + 4..].to_vec();
    let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).expect("status");
    let text = String::from_utf8_lossy(&payload).into_owned();
    (Reply { status, headers: head, body: text }, payload)
}

/// The series (labels, sample count) of each query of a 200 answer.
fn results(payload: &[u8]) -> Vec<Vec<(String, usize)>> {
    let raw = snap::raw::Decoder::new().decompress_vec(payload).expect("snappy answer");
    let r = proto::ReadResponse::decode(raw.as_slice()).expect("ReadResponse");
    r.results
        .iter()
        .map(|q| {
            q.timeseries
                .iter()
                .map(|s| {
                    let l: Vec<String> = s.labels.iter().map(|l| format!("{}={}", l.name, l.value)).collect();
                    (l.join(","), s.samples.len())
                })
                .collect()
        })
        .collect()
}

#[test]
fn remote_read_is_bounded() {
    let f = Fixture::start("", "[remote_read]\nmax_queries = 4\nmax_samples = 100\nmax_bytes = \"4KiB\"\n", "");
    let any = || vec![matcher("__name__", proto::MatchType::Re, ".+")];
    let util = |uuid: &str| {
        vec![
            matcher("__name__", proto::MatchType::Eq, "DCGM_FI_DEV_GPU_UTIL"),
            matcher("UUID", proto::MatchType::Eq, uuid),
        ]
    };
    let json = |r: &Reply| serde_json::from_str::<Value>(&r.body).unwrap_or_else(|e| panic!("{e}: {r:?}"));

    // The attack of issue 39: 60 queries of every series over 30 h in one ~1 KB request.
    let started = Instant::now();
    let (r, _) = read(&f, VISION, (0..60).map(|_| query(f.end - 30 * 60 * MIN, f.end, any())).collect());
    assert_eq!(r.status, 400, "{r:?}");
    let j = json(&r);
    assert_eq!(j["error"], "too_many_queries", "{j}");
    assert!(j["detail"].as_str().is_some_and(|d| d.contains("[remote_read] max_queries")), "{j}");
    assert!(started.elapsed() < Duration::from_secs(10), "refused before any query ran");
    f.alive();

    // One query whose answer would pass max_bytes: 413, refused as it was built. (Every
    // series of the first 30 s: ~90 samples, under max_samples, but ~30 label sets.)
    let (r, _) = read(&f, VIEWER, vec![query(f.base, f.base + 30 * SEC, any())]);
    assert_eq!(r.status, 413, "{r:?}");
    let j = json(&r);
    assert_eq!(j["error"], "response_too_large", "{j}");
    assert!(j["detail"].as_str().is_some_and(|d| d.contains("[remote_read] max_bytes")), "{j}");
    // The same for a team, whose answer names nothing of nlp's.
    let (r, _) = read(&f, VISION, vec![query(f.base, f.end, any())]);
    assert!([400, 413].contains(&r.status), "{r:?}");
    assert!(leaked(&r.body).is_empty(), "{r:?}");

    // 300 samples of one series: past max_samples (100), 400 as Prometheus answers.
    let (r, _) = read(&f, VIEWER, vec![query(f.base, f.end, util("GPU-vision-0001"))]);
    assert_eq!(r.status, 400, "{r:?}");
    let j = json(&r);
    assert_eq!(j["error"], "too_many_samples", "{j}");
    assert!(j["detail"].as_str().is_some_and(|d| d.contains("exceeded sample limit (100)")), "{j}");

    // Under the caps: 30 samples, one series, as before.
    let five = |k: i64| query(f.base + k * 5 * MIN, f.base + (k + 1) * 5 * MIN, util("GPU-vision-0001"));
    let (r, payload) = read(&f, VISION, vec![five(0)]);
    assert_eq!(r.status, 200, "{r:?}");
    let got = results(&payload);
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].len(), 1, "{got:?}");
    assert!(got[0][0].0.contains("UUID=GPU-vision-0001"), "{got:?}");
    assert!((29..=31).contains(&got[0][0].1), "{got:?}");
    // Three such queries in one request (~90 samples) answer in order; a fourth passes
    // the request's sample budget: the budget is the request's, not each query's.
    let (r, payload) = read(&f, VISION, (0..3).map(five).collect());
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(results(&payload).iter().map(Vec::len).collect::<Vec<_>>(), [1, 1, 1]);
    let (r, _) = read(&f, VISION, (0..4).map(five).collect());
    assert_eq!(r.status, 400, "{r:?}");
    assert_eq!(json(&r)["error"], "too_many_samples", "{r:?}");
    // A team reads none of nlp's series at all.
    let (r, payload) = read(&f, VISION, vec![query(f.base, f.base + 2 * MIN, util("GPU-nlp-secret-7777"))]);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(results(&payload), [Vec::<(String, usize)>::new()]);

    f.alive();
    let (r, _) = read(&f, VISION, vec![five(1)]);
    assert_eq!(r.status, 200, "the server still answers: {r:?}");
}

// ───────────────────────────── errors ─────────────────────────────

/// The error id an answer names, if any.
fn error_id(body: &str) -> Option<String> {
    let at = body.find("error id ")? + "error id ".len();
    let id: String = body[at..].chars().take_while(char::is_ascii_hexdigit).collect();
    (!id.is_empty()).then_some(id)
}

#[test]
fn a_failed_recommendation_run_tells_nobody_its_sql() {
    // 256 KiB per query: the recommender lists the GPUs of an hour, then fails on the
    // query over a slice of them — the one whose SQL names them (issue 39: `gpu_uuid >=
    // 'GPU-…' AND gpu_uuid <= 'GPU-…'`). The ledger's passes may fail too (no team then
    // sees its windows; the recommender reads owners from the windows themselves).
    let f = Fixture::start_with("", "[query]\nmemory_limit_bytes = 262144\n", "", false);
    for (token, who) in [(VISION, "team vision"), (VIEWER, "the viewer")] {
        for path in ["/api/v1/recommendations?window=1h", "/api/v1/recommendations?window=400d"] {
            let r = f.get(path, token);
            assert!(r.status >= 500, "{who} {path}: {r:?}");
            assert!(leaked(&r.body).is_empty(), "{who} {path} leaks {:?}: {}", leaked(&r.body), r.body);
            let j = r.json();
            assert_eq!(j["error"], "memory_limit", "{who} {path}: {j}");
            let detail = j["detail"].as_str().unwrap_or_default();
            assert!(detail.contains("the recommendation run failed"), "{who}: {j}");
            let id = error_id(detail).unwrap_or_else(|| panic!("{who}: no error id in {j}"));
            // The detail is the server's, under that id.
            let log = f.log();
            let line = log.lines().find(|l| l.contains(&id)).unwrap_or_else(|| panic!("{id} not logged:\n{log}"));
            assert!(line.contains("SELECT") && line.contains("GPU-nlp-secret"), "the log has the failed SQL: {line}");
        }
    }
    // The weekly report of this week, built from the team's rows: whatever fails is
    // answered the same way.
    let week = apron::report::current_week(now_us()).expect("week").to_string();
    for token in [VISION, VIEWER] {
        let r = f.get(&format!("/api/v1/reports/weekly?week={week}"), token);
        if r.status >= 500 {
            assert!(leaked(&r.body).is_empty(), "{r:?}");
            assert!(error_id(&r.body).is_some(), "{r:?}");
        }
    }
    f.alive();
}

// ───────────────────────────── on-demand runs ─────────────────────────────

#[test]
fn on_demand_recommendation_runs_are_limited() {
    let f = Fixture::start("", "", "on_demand_max_concurrent = 1\non_demand_cache = \"5m\"\n");
    // A run over 30 days reads 720 hours: long enough to be caught in progress.
    let addr = f.addr();
    let long = std::thread::spawn(move || {
        let auth = format!("Bearer {VISION}");
        loop {
            let r = try_request_within(
                addr,
                "GET",
                "/api/v1/recommendations?window=30d",
                &[("authorization", &auth)],
                b"",
                Duration::from_secs(600),
            );
            // One of the requests below may have taken the run slot first.
            match r {
                Ok(r) if r.status == 503 => std::thread::sleep(Duration::from_millis(200)),
                other => return other,
            }
        }
    });
    std::thread::sleep(Duration::from_millis(500));
    // Other windows (each asked once, so none is cached) while it runs: 503 busy.
    let mut minutes = 60;
    let busy = poll("an on-demand run refused while another runs", Duration::from_secs(120), || {
        minutes += 1;
        let r = f.get(&format!("/api/v1/recommendations?window={minutes}m"), VIEWER);
        match r.status {
            503 => Some(r),
            200 => None,
            _ => panic!("{r:?}"),
        }
    });
    assert_eq!(busy.json()["error"], "busy", "{busy:?}");
    assert!(busy.headers.contains("retry-after: 5"), "{busy:?}");
    assert!(
        busy.json()["detail"].as_str().is_some_and(|d| d.contains("[recommend] on_demand_max_concurrent")),
        "{busy:?}"
    );
    let first = long.join().expect("join").expect("the long run answers");
    assert_eq!(first.status, 200, "{first:?}");
    let generated = first.json()["generated_at"].clone();
    // The same window again, within on_demand_cache: the set already computed, at once.
    let started = Instant::now();
    let again = f.get("/api/v1/recommendations?window=30d", VIEWER);
    assert_eq!(again.status, 200, "{again:?}");
    assert_eq!(again.json()["generated_at"], generated, "the cached set");
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
    // Filtered per caller: vision's copy holds vision's items only.
    let teams = |r: &Reply| -> Vec<String> {
        r.json()["recommendations"]
            .as_array()
            .map(|a| a.iter().filter_map(|i| i["team"].as_str().map(str::to_owned)).collect())
            .unwrap_or_default()
    };
    assert!(teams(&first).iter().all(|t| t == "vision"), "{first:?}");
    assert!(teams(&again).iter().any(|t| t == "nlp"), "the viewer sees both teams: {again:?}");
    f.alive();
}

// ───────────────────────────── /metrics ─────────────────────────────

#[test]
fn metrics_can_require_a_viewer_token() {
    let f = Fixture::start("metrics_auth = \"token\"", "", "");
    let r = request(f.addr(), "GET", "/metrics", &[], b"");
    assert_eq!(r.status, 401, "{r:?}");
    assert!(!r.body.contains("apron_"), "{r:?}");
    for token in [VISION, TOKEN] {
        let r = f.get("/metrics", token);
        assert_eq!(r.status, 403, "{r:?}");
        assert!(!r.body.contains("apron_"), "{r:?}");
    }
    let r = f.get("/metrics", VIEWER);
    assert_eq!(r.status, 200, "{r:?}");
    assert!(r.body.contains("apron_ingest_rows_total"), "{r:?}");
    f.alive();
    // The default keeps existing scrapes working (and says so in the log: teams exist).
    let open = Fixture::start("", "", "");
    assert_eq!(request(open.addr(), "GET", "/metrics", &[], b"").status, 200);
    assert!(open.log().contains("metrics_auth"), "{}", open.log());
}
