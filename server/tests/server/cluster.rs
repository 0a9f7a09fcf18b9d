//! A cluster on one machine, in real processes: a real S3-compatible server (s3s-fs),
//! two collectors (`[cluster] role = "collector"`, shards `rack-a` and `rack-b`) fed by
//! two agents each over the ingest protocol, a query server (`role = "query"`) over the
//! whole lake, and one single server fed the same batches as the reference. The query
//! server's answers must equal the single server's: counts, sums, the rollup, the
//! allocations, the hourly cost, the weekly report line by line, and a team's scoped
//! view. A GPU moves from one shard to the other halfway and keeps its history.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use super::cost::SEC;
use super::insights::{H100, ident, pod, seg, windows};
use super::{ServerProc, TOKEN, bearer, ingest_headers, poll, request};
use apron_common::GpuWindow;
use apron_common::wire::{encode_ipc, windows_to_batch};
use serde_json::Value;

const HOUR: i64 = 3600 * SEC;
pub(super) const VIEWER: &str = "test-viewer-token-0123456789abcdef";
pub(super) const TEAM_A: &str = "test-team-a-token-0123456789abcdef";
const WEEK: &str = "2026-W47";
/// The query server's PostgreSQL port (the same across its restart).
static PG_PORT: std::sync::OnceLock<u16> = std::sync::OnceLock::new();

/// $3.60 per GPU-hour: exactly $0.001 a second.
const BOOK: &str = "version = \"test-cluster\"\n[[price]]\nmodel = \"H100\"\nmatch = [\"H100 80GB HBM3\"]\nkind = \"on_demand\"\nusd_per_gpu_hour = \"3.60\"\n";

/// The known trace, per agent: `(agent, windows)`. Agents a1, a2 ship to rack-a, b1,
/// b2 to rack-b; GPU-M is in rack-a for its first hour (agent a2) and in rack-b for
/// its second (agent b2): it moved, at an hour boundary, with its job ending first.
pub(super) fn trace() -> Vec<(&'static str, Vec<GpuWindow>)> {
    let a1 = ident("node-a1", "GPU-A1", H100);
    let a2 = ident("node-a2", "GPU-A2", H100);
    let b1 = ident("node-b1", "GPU-B1", H100);
    let b2 = ident("node-b2", "GPU-B2", H100);
    let m_in_a = ident("node-a2", "GPU-M", H100);
    let m_in_b = ident("node-b2", "GPU-M", H100);
    let job = |team: &str, name: &str| Some(pod(team, name, &format!("{{\"team\":\"{team}\"}}")));
    vec![
        ("a1", windows(&[seg(&a1, 0, 2 * HOUR, 0.8, 40.0, job("team-a", "train-1"))])),
        (
            "a2",
            windows(&[
                // Held and idle for two hours: stranded.
                seg(&a2, 0, 2 * HOUR, 0.0, 1.0, job("team-a", "notebook-2")),
                seg(&m_in_a, 0, HOUR, 0.6, 20.0, job("team-a", "train-3")),
            ]),
        ),
        (
            "b1",
            windows(&[
                seg(&b1, 0, HOUR, 0.0, 2.0, job("team-b", "serve-4")),
                seg(&b1, HOUR, 2 * HOUR, 0.9, 60.0, job("team-b", "serve-4")),
            ]),
        ),
        (
            "b2",
            windows(&[
                // Nobody holds it: unallocated.
                seg(&b2, 0, 2 * HOUR, 0.0, 0.0, None),
                seg(&m_in_b, HOUR, 2 * HOUR, 0.0, 3.0, job("team-b", "notebook-5")),
            ]),
        ),
    ]
}

pub(super) fn lake_toml(port: u16) -> String {
    format!(
        "[storage.object_store]\nurl = \"s3://apron/lake\"\nendpoint = \"http://127.0.0.1:{port}\"\nregion = \"us-east-1\"\naccess_key_id = \"AK\"\nsecret_access_key = \"SK\"\nallow_http = true\n"
    )
}

/// A server's config: `role` is `None` (single), a shard name, or `"query"`.
fn config(dir: &Path, name: &str, s3_port: Option<u16>, role: Option<&str>) -> std::path::PathBuf {
    config_with(dir, name, s3_port, role, "", true)
}

/// [`config`] with `extra` TOML at the end; `pg`: a query server's PostgreSQL port
/// ([`PG_PORT`], one per test binary).
fn config_with(
    dir: &Path,
    name: &str,
    s3_port: Option<u16>,
    role: Option<&str>,
    extra: &str,
    pg: bool,
) -> std::path::PathBuf {
    let book = dir.join("prices.toml");
    std::fs::write(&book, BOOK).expect("price book");
    let data = dir.join(name);
    let ingest = if role == Some("query") { String::new() } else { format!("[ingest]\ntokens = [{TOKEN:?}]\n") };
    // Merged inputs go 5 s after the merge (default 5 min, checked every minute), so
    // the lake settles to
    // exactly the files the statuses list within the test.
    let grace = if s3_port.is_some() && role != Some("query") {
        "superseded_grace = \"5s\"\nmaintenance_interval = \"1s\"\n"
    } else {
        ""
    };
    let cluster = match role {
        None => String::new(),
        Some("query") => format!(
            "{}[cluster]\nrole = \"query\"\nrefresh = \"1s\"\nstale_after = \"10s\"\n",
            if pg {
                format!(
                    "[pg]\nlisten = \"127.0.0.1:{}\"\nusers = [{{ name = \"grafana\", password = \"grafana-pass-0123\" }}]\n",
                    PG_PORT.get_or_init(apron_test_support::free_port)
                )
            } else {
                String::new()
            }
        ),
        Some(shard) => {
            format!("[cluster]\nrole = \"collector\"\nshard = {shard:?}\nfreshness = \"1s\"\nheartbeat = \"1s\"\n")
        }
    };
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n{ingest}\
         [sql]\ntokens = [{VIEWER:?}]\n\
         [[tokens]]\nrole = \"team:team-a\"\ntoken = {TEAM_A:?}\n\
         [storage]\ndata_dir = {:?}\n{grace}{}\
         [rollup]\ninterval = \"1s\"\n\
         [cost]\ninterval = \"1s\"\nprice_book = {:?}\n\
         [cost.teams]\nlabel_keys = [\"team\"]\n\
         {cluster}{extra}",
        data.display().to_string(),
        s3_port.map(lake_toml).unwrap_or_default(),
        book.display().to_string(),
    );
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).expect("config");
    path
}

pub(super) fn start(dir: &Path, name: &str, s3_port: Option<u16>, role: Option<&str>) -> ServerProc {
    let config = config(dir, name, s3_port, role);
    ServerProc::start(&config, &[], &dir.join(format!("{name}.log")))
}

/// A query server without a PostgreSQL port, with `extra` TOML in its config.
pub(super) fn start_query_with(dir: &Path, name: &str, s3_port: u16, extra: &str) -> ServerProc {
    let config = config_with(dir, name, Some(s3_port), Some("query"), extra, false);
    ServerProc::start(&config, &[], &dir.join(format!("{name}.log")))
}

pub(super) fn ship(addr: SocketAddr, agent: &str, rows: &[GpuWindow]) {
    let auth = bearer();
    // In batches of 100 windows, as an agent would ship them.
    for (seq, chunk) in rows.chunks(100).enumerate() {
        let body = encode_ipc(&windows_to_batch(chunk).expect("batch")).expect("ipc");
        let seq = seq.to_string();
        let r =
            request(addr, "POST", "/api/v1/ingest", &ingest_headers("gpu_samples", agent, "e1", &seq, &auth), &body);
        assert_eq!(r.status, 200, "{agent} #{seq}: {r:?}");
    }
}

/// A JSON SQL answer (the whole body) with `token`.
pub(super) fn sql_as(addr: SocketAddr, token: &str, q: &str) -> Value {
    let auth = format!("Bearer {token}");
    let r =
        request(addr, "POST", "/api/v1/sql", &[("authorization", &auth), ("accept", "application/json")], q.as_bytes());
    assert_eq!(r.status, 200, "{q}: {r:?}");
    r.json()
}

pub(super) fn rows(addr: SocketAddr, q: &str) -> Value {
    sql_as(addr, VIEWER, q)["rows"].clone()
}

/// The statements whose answers must be the same on the query server and on one server.
pub(super) const SAME: [&str; 6] = [
    "SELECT gpu_uuid, host, count(*) AS n, CAST(sum(sm_active) AS VARCHAR) AS sm FROM gpu_samples GROUP BY 1, 2 ORDER BY 1, 2",
    // Minutes by their start; the mean weighted by its windows sums exactly across a
    // minute split between two shards (GPU-M's move), and rounding hides summation order.
    "SELECT gpu_uuid, count(DISTINCT time) AS minutes, sum(samples) AS windows, CAST(round(sum(sm_active_mean * samples), 6) AS VARCHAR) AS sm FROM gpu_samples_1m GROUP BY 1 ORDER BY 1",
    "SELECT gpu_uuid, team, owner, CAST(start_time AS VARCHAR) AS s, CAST(end_time AS VARCHAR) AS e FROM allocations ORDER BY 1, 4",
    "SELECT gpu_uuid, CAST(hour AS VARCHAR) AS h, team, CAST(allocated_idle_s AS VARCHAR) AS idle, CAST(stranded_s AS VARCHAR) AS stranded, CAST(cost_usd AS VARCHAR) AS cost, CAST(idle_cost_usd AS VARCHAR) AS idle_cost FROM gpu_cost_hourly ORDER BY 1, 2, 3",
    "SELECT team, CAST(sum(idle_cost_usd) AS VARCHAR) AS idle, CAST(sum(stranded_cost_usd) AS VARCHAR) AS stranded FROM gpu_cost_hourly GROUP BY 1 ORDER BY 1",
    "SELECT count(*) AS n FROM gpu_samples WHERE time >= TIMESTAMP '2026-11-19 10:30:00' AND time < TIMESTAMP '2026-11-19 11:30:00'",
];

pub(super) fn answers(addr: SocketAddr) -> Vec<Value> {
    SAME.iter().map(|q| rows(addr, q)).collect()
}

/// The weekly report's figures (JSON), without when it was generated.
pub(super) fn report(addr: SocketAddr) -> Value {
    let auth = format!("Bearer {VIEWER}");
    let r = request(
        addr,
        "GET",
        &format!("/api/v1/reports/weekly?week={WEEK}&format=json"),
        &[("authorization", &auth)],
        b"",
    );
    assert_eq!(r.status, 200, "{r:?}");
    let mut v = r.json();
    if let Some(o) = v.as_object_mut() {
        o.retain(|k, _| !k.contains("generated"));
    }
    v
}

/// Waits until `addr`'s ledger holds the trace's five allocations and its answers have
/// not changed for three polls in a row (a second apart; the ledger runs every second).
pub(super) fn settled(addr: SocketAddr, what: &str) -> Vec<Value> {
    let mut last = Vec::new();
    let mut same = 0;
    poll(what, Duration::from_secs(120), || {
        std::thread::sleep(Duration::from_secs(1));
        let now = answers(addr);
        same = if now == last { same + 1 } else { 0 };
        let allocated = now[2].as_array().map_or(0, Vec::len) == 5;
        last = now.clone();
        (allocated && same >= 3).then_some(now)
    })
}

/// Waits until `addr` answers [`SAME`] as `expected`; on time-out, fails showing the
/// first statement whose answer differs.
pub(super) fn assert_converges(addr: SocketAddr, expected: &[Value], what: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        let got = answers(addr);
        if got == expected {
            return;
        }
        if std::time::Instant::now() > deadline {
            for ((q, g), e) in SAME.iter().zip(&got).zip(expected) {
                assert_eq!(g, e, "{what}: {q}");
            }
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

fn objects(root: &Path) -> Vec<String> {
    fn walk(dir: &Path, base: &Path, out: &mut Vec<String>) {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, base, out);
            } else if let Ok(rel) = p.strip_prefix(base) {
                out.push(rel.to_string_lossy().into_owned());
            }
        }
    }
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out.sort();
    out
}

#[test]
fn two_shards_and_a_query_server_answer_as_one_server() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bucket_root = dir.path().join("s3");
    let Some(s3) = apron_test_support::S3Server::start(&bucket_root) else { return };
    let port = s3.port;
    let rack_a = start(dir.path(), "rack-a", Some(port), Some("rack-a"));
    let rack_b = start(dir.path(), "rack-b", Some(port), Some("rack-b"));
    let single = start(dir.path(), "single", None, None);
    let query = start(dir.path(), "query", Some(port), Some("query"));

    for (agent, rows) in trace() {
        let collector = if agent.starts_with('a') { rack_a.addr } else { rack_b.addr };
        ship(collector, agent, &rows);
        ship(single.addr, agent, &rows);
    }
    let expected = settled(single.addr, "the single server's ledger");
    assert_eq!(expected[0].as_array().map(Vec::len), Some(6), "GPU-M on two hosts: {}", expected[0]);
    // The query server sees what one server sees, once the collectors persisted,
    // costed and wrote their statuses.
    assert_converges(query.addr, &expected, "the query server");
    // GPU-M's history is whole: 360 windows in each shard, one history in the lake.
    let m = rows(
        query.addr,
        "SELECT count(*) AS n, count(DISTINCT host) AS hosts FROM gpu_samples WHERE gpu_uuid = 'GPU-M'",
    );
    assert_eq!(m, serde_json::json!([[720, 2]]));
    // The minute of the move holds all six windows: in one row where it is computed
    // from raw samples, in one row per shard (each that shard's windows) where the
    // collectors' stored minutes serve it (docs/architecture.md, "A GPU that moves").
    let split = rows(
        query.addr,
        "SELECT count(*) AS n, sum(samples) AS windows FROM gpu_samples_1m WHERE gpu_uuid = 'GPU-M' AND time = TIMESTAMP '2026-11-19 11:00:00'",
    );
    assert!(split == serde_json::json!([[1, 6]]) || split == serde_json::json!([[2, 6]]), "{split}");
    assert_eq!(report(query.addr), report(single.addr), "the weekly report, line by line");

    // A team's token sees its team's rows only, as on one server.
    for q in [
        "SELECT team, count(*) AS n FROM gpu_cost_hourly GROUP BY 1 ORDER BY 1",
        "SELECT gpu_uuid, count(*) AS n FROM allocations GROUP BY 1 ORDER BY 1",
    ] {
        let scoped = sql_as(query.addr, TEAM_A, q)["rows"].clone();
        assert_eq!(scoped, sql_as(single.addr, TEAM_A, q)["rows"], "{q}");
        assert!(!scoped.to_string().contains("team-b") && !scoped.to_string().contains("GPU-B1"), "{scoped}");
    }

    // The lake is a plain Hive-partitioned Parquet lake with one shard= per collector.
    let lake = bucket_root.join("apron/lake");
    // Once merged inputs are gone (their grace), the lake holds exactly the files the
    // statuses list: what DuckDB globs is what the query server reads.
    let files = poll("the lake to hold only live files", Duration::from_secs(60), || {
        let on_disk: Vec<String> = objects(&lake).into_iter().filter(|p| p.ends_with(".parquet")).collect();
        let mut listed: Vec<String> = ["rack-a", "rack-b"]
            .iter()
            .flat_map(|s| {
                let status: Value =
                    serde_json::from_slice(&std::fs::read(lake.join(format!("_apron/shards/{s}.json"))).ok()?).ok()?;
                Some(
                    status["files"]
                        .as_array()?
                        .iter()
                        .filter_map(|f| f["key"].as_str().map(str::to_owned))
                        .collect::<Vec<_>>(),
                )
            })
            .flatten()
            .map(|k| k.trim_start_matches("lake/").to_owned())
            .collect();
        listed.sort();
        (on_disk == listed).then_some(on_disk)
    });
    assert!(!files.is_empty());
    for f in &files {
        let parts: Vec<&str> = f.split('/').collect();
        assert!(
            parts.len() == 4 && parts[1].starts_with("date=") && ["shard=rack-a", "shard=rack-b"].contains(&parts[2]),
            "{f}"
        );
    }
    assert!(objects(&lake).iter().any(|p| p == "_apron/shards/rack-a.json"));
    let duckdb = std::process::Command::new(apron_test_support::tool("python3"))
        .arg("-c")
        .arg(
            "import duckdb, sys; print(duckdb.sql(\"SELECT shard, count(*) FROM read_parquet('\" + sys.argv[1] + \"/gpu_samples/*/*/*.parquet', hive_partitioning=true) GROUP BY 1 ORDER BY 1\").fetchall())",
        )
        .arg(&lake)
        .output()
        .expect("python3 runs");
    assert!(duckdb.status.success(), "{}", String::from_utf8_lossy(&duckdb.stderr));
    let per_shard = rows(
        query.addr,
        "SELECT CASE WHEN host LIKE 'node-a%' THEN 'rack-a' ELSE 'rack-b' END AS shard, count(*) AS n FROM gpu_samples GROUP BY 1 ORDER BY 1",
    );
    let duck = String::from_utf8_lossy(&duckdb.stdout).trim().to_owned();
    assert_eq!(duck, format!("[('rack-a', {}), ('rack-b', {})]", per_shard[0][1], per_shard[1][1]), "DuckDB: {duck}");

    // One collector per shard: another data directory claiming rack-a is refused.
    refused(dir.path(), "rack-a-twin", port, "rack-a", "is served by another collector");

    // A query server ingests nothing.
    let r =
        request(query.addr, "POST", "/api/v1/ingest", &ingest_headers("gpu_samples", "x", "e", "0", &bearer()), b"");
    assert_eq!((r.status, r.json()["error"].as_str()), (403, Some("query_server")), "{r:?}");
    let fresh = sql_as(query.addr, VIEWER, SAME[0]);
    assert!(fresh.get("stale_shards").is_none(), "{fresh}");
    let cluster = get_as(query.addr, "/api/v1/cluster");
    assert_eq!(cluster["stale_shards"], serde_json::json!([]), "{cluster}");

    // A collector down: the lake still answers, and says which shard is stale.
    rack_b.stop();
    let stale = poll("rack-b to be reported stale", Duration::from_secs(30), || {
        let j = sql_as(query.addr, VIEWER, SAME[0]);
        (j["stale_shards"] == serde_json::json!(["rack-b"])).then_some(j)
    });
    assert_eq!(stale["rows"], expected[0], "answers from the lake while rack-b is down");
    let auth = format!("Bearer {VIEWER}");
    let r = request(
        query.addr,
        "POST",
        "/api/v1/sql",
        &[("authorization", &auth), ("accept", "text/csv")],
        SAME[5].as_bytes(),
    );
    assert!(r.headers.contains("apron-stale-shards: rack-b"), "{r:?}");
    // The web UI in headless Chromium shows the stale shard in its banner, and the
    // report's idle dollars (the fleet's, from the lake).
    let idle = report(query.addr)["fleet"]["idle_cost_usd"].as_f64().expect("fleet idle");
    let ui = std::process::Command::new(apron_test_support::tool("python3"))
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/ui/chromium_check.py"))
        .arg(format!("http://{}/?week={WEEK}&refresh=0", query.addr))
        .arg(dir.path().join("ui"))
        .arg(format!("{idle:.2}"))
        .env("APRON_UI_TOKEN", VIEWER)
        .env("APRON_UI_STALE_SHARDS", "rack-b")
        .env("APRON_UI_HISTORY_ONLY", "1")
        .output()
        .expect("python3 runs");
    let said = format!("{}{}", String::from_utf8_lossy(&ui.stdout), String::from_utf8_lossy(&ui.stderr));
    assert!(ui.status.success() && said.contains("stale-shards banner: rack-b"), "{said}");

    // A data directory keeps its shard.
    refused(dir.path(), "rack-b", port, "rack-c", "this data directory holds shard \"rack-b\"");
    let alerts = get_as(query.addr, "/api/v1/alerts");
    assert_eq!(alerts["stale_shards"], serde_json::json!(["rack-b"]), "{alerts}");
    let with_stale = report(query.addr);
    assert_eq!(with_stale["stale_shards"], serde_json::json!(["rack-b"]));
    assert_eq!(with_stale["fleet"], report(single.addr)["fleet"], "the lake still holds rack-b's rows");
    // psql prints the server's NOTICE above the rows.
    let psql = std::process::Command::new(apron_test_support::tool("psql"))
        .args(["-h", "127.0.0.1", "-p", &PG_PORT.get().expect("pg port").to_string(), "-U", "grafana", "-d", "apron"])
        .args(["-X", "-A", "-t", "-c", "SELECT count(*) FROM gpu_samples"])
        .env("PGPASSWORD", "grafana-pass-0123")
        .env("PGCONNECT_TIMEOUT", "10")
        .output()
        .expect("psql runs");
    let (out, err) = (String::from_utf8_lossy(&psql.stdout), String::from_utf8_lossy(&psql.stderr));
    assert_eq!((psql.status.success(), out.trim()), (true, "3600"), "{err}");
    assert!(err.contains("NOTICE:  stale shards (answered from what they last persisted): rack-b"), "{err}");

    // A query server restart loses nothing: it holds nothing of its own.
    query.stop();
    let query = start(dir.path(), "query", Some(port), Some("query"));
    assert_converges(query.addr, &expected, "the restarted query server");

    // The bucket down: an error that says so (and not where the bucket is), never a
    // partial answer.
    drop(s3);
    let auth = format!("Bearer {VIEWER}");
    // The lake's reads retry with backoff before they give up: on a loaded machine an
    // answer can take longer than a plain request waits, so wait for it longer.
    let r = poll("the query server to notice the bucket is gone", Duration::from_secs(180), || {
        let headers = [("authorization", auth.as_str())];
        let r = super::try_request_within(
            query.addr,
            "POST",
            "/api/v1/sql",
            &headers,
            SAME[0].as_bytes(),
            Duration::from_secs(90),
        )
        .ok()?;
        (r.status != 200).then_some(r)
    });
    assert_eq!((r.status, r.json()["code"].as_str()), (500, Some("source_error")), "{r:?}");
    assert!(!r.body.contains(&format!(":{port}")) && !r.body.contains("s3://"), "{}", r.body);
    drop(rack_a);
}

/// `apron serve` as collector `name` of `shard` exits at once, saying `why`.
fn refused(dir: &Path, name: &str, s3_port: u16, shard: &str, why: &str) {
    let cfg = config(dir, name, Some(s3_port), Some(shard));
    let out = std::process::Command::new(super::APRON).arg("serve").arg("--config").arg(&cfg).output().expect("runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains(why), "{name} as {shard}: {err}");
}

pub(super) fn get_as(addr: SocketAddr, path: &str) -> Value {
    let auth = format!("Bearer {VIEWER}");
    let r = request(addr, "GET", path, &[("authorization", &auth)], b"");
    assert_eq!(r.status, 200, "{path}: {r:?}");
    r.json()
}
