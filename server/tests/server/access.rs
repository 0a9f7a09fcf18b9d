//! Roles and team scoping: a `team:<name>` principal tries to read another team's rows
//! every way we could think of — over HTTP and over the PostgreSQL protocol — and never
//! sees one.
//!
//! The trace (10 s windows from 10:00, an hour):
//!
//! | GPU | holder |
//! | --- | --- |
//! | A | team `vision` until 10:30, then team `nlp` (the time edge) |
//! | B | team `nlp` throughout (idle: a stranded allocation of nlp) |
//! | C | nobody |
//! | D | team `vision` throughout (idle: a stranded allocation of vision) |

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use super::insights::{H100, MIN, T0, cost, ident, ingest, pod, seg, windows};
use apron::access::{Access, Credential, Role};
use apron::pg::{PgAuth, PgUser};
use apron::{Server, alerts::AlertsConfig, recommend::RecommendSettings};
use apron_collector::StoreConfig;
use apron_collector::http::IngestOptions;
use apron_common::TeamName;
use apron_query::{QueryConfig, Scope};
use serde_json::Value;

pub(super) const VIEWER: &str = "viewer-token-0123456789";
pub(super) const VISION: &str = "vision-token-0123456789";
pub(super) const AGENT: &str = "agent-token-0123456789";
const ADMIN: &str = "admin-token-0123456789";
/// 10:30, where GPU-A passes from vision to nlp.
const HANDOVER: i64 = T0 + 30 * MIN;

fn vision() -> TeamName {
    TeamName::new("vision").expect("team")
}

pub(super) fn open_with_roles(dir: &std::path::Path) -> Server {
    let cred = |t: &str, role| Credential { token: t.as_bytes().into(), role };
    let access = Access::Tokens(
        vec![
            cred(VIEWER, Role::Viewer),
            cred(VISION, Role::Team(vision())),
            cred(AGENT, Role::Agent),
            cred(ADMIN, Role::Admin),
        ]
        .into(),
    );
    let store = StoreConfig {
        data_dir: dir.join("data"),
        persist_interval: Duration::from_secs(3600),
        maintenance_interval: Duration::from_secs(3600),
        ..StoreConfig::default()
    };
    let ingest = IngestOptions { tokens: vec![AGENT.into(), ADMIN.into()], ..IngestOptions::default() };
    Server::open(store, ingest, QueryConfig::default(), access).expect("open")
}

/// `(status, body as JSON or as a string)`.
async fn call(addr: SocketAddr, method: &str, path: &str, token: &str, body: &str) -> (u16, Value) {
    let (url, method, token, body) =
        (format!("http://{addr}{path}"), method.to_owned(), token.to_owned(), body.to_owned());
    tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
        let auth = format!("Bearer {token}");
        let mut r = if method == "POST" {
            agent.post(&url).header("authorization", &auth).send(body.as_bytes())
        } else {
            agent.get(&url).header("authorization", &auth).call()
        }
        .unwrap_or_else(|e| panic!("{url}: {e}"));
        let status = r.status().as_u16();
        let bytes = r.body_mut().read_to_vec().expect("body");
        let v =
            serde_json::from_slice(&bytes).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()));
        (status, v)
    })
    .await
    .expect("join")
}

async fn sql_rows(addr: SocketAddr, token: &str, q: &str) -> Vec<Value> {
    let (status, v) = call(addr, "POST", "/api/v1/sql", token, q).await;
    assert_eq!(status, 200, "{q}: {v}");
    v["rows"].as_array().unwrap_or_else(|| panic!("{q}: {v}")).clone()
}

fn strings(rows: &[Value]) -> BTreeSet<String> {
    rows.iter().map(|r| r[0].as_str().map_or_else(|| r[0].to_string(), str::to_owned)).collect()
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

fn ts(us: i64) -> String {
    format!("to_timestamp_micros({us})")
}

/// The trace of the module docs (10 s windows, an hour from T0; GPU-A busy at 60 %, the
/// others idle).
pub(super) fn trace() -> Vec<apron_common::GpuWindow> {
    let (a, b, c, d) = (
        ident("node-0", "GPU-A", H100),
        ident("node-0", "GPU-B", H100),
        ident("node-1", "GPU-C", H100),
        ident("node-1", "GPU-D", H100),
    );
    let cv = pod("vision", "train", r#"{"team":"vision"}"#);
    let nlp = pod("nlp", "serve", r#"{"team":"nlp"}"#);
    windows(&[
        seg(&a, 0, 30 * MIN, 0.6, 20.0, Some(cv.clone())),
        seg(&a, 30 * MIN, 60 * MIN, 0.6, 20.0, Some(nlp.clone())),
        seg(&b, 0, 60 * MIN, 0.0, 0.5, Some(nlp)),
        seg(&c, 0, 60 * MIN, 0.0, 0.0, None),
        seg(&d, 0, 60 * MIN, 0.0, 0.5, Some(cv)),
    ])
}

/// A server with the roles, holding [`trace`] priced by a ledger pass at `now`.
pub(super) async fn priced_trace(dir: &std::path::Path, now: i64) -> Server {
    let server = open_with_roles(dir)
        .with_cost(cost(dir, apron_cost::TeamConfig::default()))
        .expect("cost")
        .with_alerts(AlertsConfig::default())
        .with_recommend(RecommendSettings::default());
    ingest(&server, &trace(), 0);
    server.ledger().expect("ledger").run_once(now).await;
    server
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_team_token_cannot_read_another_teams_rows_by_any_route() {
    let dir = tempfile::tempdir().expect("tempdir");
    let now = T0 + 61 * MIN;
    let server = priced_trace(dir.path(), now).await;
    server.alerts().expect("alerts").evaluate_at(now).await.expect("alerts");
    server.recommender().expect("recommender").refresh_at(now).await.expect("recommendations");

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let api = listener.local_addr().expect("addr");
    let router = server.router();
    tokio::spawn(async move { axum::serve(listener, router).await.expect("serve") });

    // The viewer sees both teams: the data the team must not see is really there.
    let teams = |t| async move {
        strings(&sql_rows(api, t, "SELECT team FROM allocations UNION SELECT team FROM gpu_cost_hourly").await)
    };
    // ("unallocated": GPU-C's hours in gpu_cost_hourly.)
    assert_eq!(teams(VIEWER).await, set(&["nlp", "unallocated", "vision"]));
    assert_eq!(teams(ADMIN).await, set(&["nlp", "unallocated", "vision"]));
    assert_eq!(teams(VISION).await, set(&["vision"]));

    // What vision may see of gpu_samples, by the documented rule, computed unscoped.
    let expected = strings(
        &sql_rows(
            api,
            VIEWER,
            "SELECT DISTINCT s.gpu_uuid || '@' || CAST(s.time AS VARCHAR) FROM gpu_samples s JOIN allocations a \
             ON s.gpu_uuid = a.gpu_uuid AND s.time > a.start_time AND (a.end_time IS NULL OR s.time <= a.end_time) \
             AND ((a.owner_kind IN ('pod', 'slurm_job') AND s.owner_kind = a.owner_kind AND s.owner = a.owner) \
                  OR (a.owner_kind NOT IN ('pod', 'slurm_job') AND s.owner IS NULL)) \
             WHERE a.team = 'vision'",
        )
        .await,
    );
    let seen =
        strings(&sql_rows(api, VISION, "SELECT gpu_uuid || '@' || CAST(time AS VARCHAR) FROM gpu_samples").await);
    assert_eq!(seen, expected);
    let uuids: BTreeSet<String> = seen.iter().map(|k| k.split('@').next().unwrap_or_default().to_owned()).collect();
    assert_eq!(uuids, set(&["GPU-A", "GPU-D"]), "never GPU-B (nlp) or GPU-C (nobody's)");
    let nlp_a = sql_rows(
        api,
        VIEWER,
        &format!("SELECT count(*) FROM gpu_samples WHERE gpu_uuid = 'GPU-A' AND time > {}", ts(HANDOVER + 10_000_000)),
    )
    .await;
    assert!(nlp_a[0][0].as_i64().unwrap_or(0) > 100, "nlp's half of GPU-A exists: {nlp_a:?}");

    // Every way in, as vision. Each query names what a leak would show; all must be
    // empty (or zero).
    let zero = |q: String| async move {
        let rows = sql_rows(api, VISION, &q).await;
        let n = rows.first().and_then(|r| r[0].as_i64()).unwrap_or(-1);
        assert_eq!(n, 0, "{q} → {rows:?}");
    };
    let after = ts(HANDOVER + 10_000_000);
    for q in [
        // Plain filters and the time edge: GPU-A after the handover is nlp's.
        "SELECT count(*) FROM gpu_samples WHERE gpu_uuid IN ('GPU-B', 'GPU-C')".to_owned(),
        format!("SELECT count(*) FROM gpu_samples WHERE gpu_uuid = 'GPU-A' AND time >= {after}"),
        format!("SELECT count(*) FROM gpu_samples WHERE gpu_uuid = 'GPU-A' AND time BETWEEN {after} AND {}", ts(T0 + 61 * MIN)),
        format!("SELECT count(*) FROM gpu_samples_1m WHERE gpu_uuid = 'GPU-B' OR (gpu_uuid = 'GPU-A' AND time >= {})", ts(HANDOVER)),
        "SELECT count(*) FROM gpu_processes WHERE gpu_uuid IN ('GPU-B', 'GPU-C')".to_owned(),
        // Joins, in both directions and self-joins.
        "SELECT count(*) FROM gpu_samples s JOIN allocations a ON s.gpu_uuid = a.gpu_uuid WHERE a.team <> 'vision'".to_owned(),
        "SELECT count(*) FROM allocations a LEFT JOIN gpu_cost_hourly c ON a.gpu_uuid = c.gpu_uuid WHERE c.team = 'nlp' OR a.team = 'nlp'".to_owned(),
        "SELECT count(*) FROM gpu_samples x CROSS JOIN gpu_samples y WHERE y.gpu_uuid = 'GPU-B' AND x.gpu_uuid = 'GPU-D'".to_owned(),
        // Subqueries: IN, EXISTS, scalar, correlated.
        "SELECT count(*) FROM gpu_samples WHERE gpu_uuid IN (SELECT gpu_uuid FROM allocations WHERE team = 'nlp')".to_owned(),
        "SELECT count(*) FROM allocations a WHERE EXISTS (SELECT 1 FROM gpu_cost_hourly c WHERE c.team <> a.team)".to_owned(),
        "SELECT (SELECT count(*) FROM gpu_cost_hourly WHERE team = 'nlp') + (SELECT count(*) FROM alerts WHERE team = 'nlp')".to_owned(),
        // CTEs, recursive too.
        "WITH x AS (SELECT * FROM gpu_cost_hourly), y AS (SELECT * FROM x WHERE team = 'nlp') SELECT count(*) FROM y".to_owned(),
        "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r WHERE n < 3) \
         SELECT count(*) FROM r JOIN allocations a ON a.team = 'nlp'".to_owned(),
        // UNION of every table's team column.
        "SELECT count(*) FROM (SELECT team FROM allocations UNION ALL SELECT team FROM gpu_cost_hourly \
         UNION ALL SELECT team FROM alerts UNION ALL SELECT team FROM recommendations \
         UNION ALL SELECT team FROM gpu_processes) t WHERE team <> 'vision'".to_owned(),
        // Fully qualified names reach the same scoped tables.
        "SELECT count(*) FROM datafusion.public.gpu_samples WHERE gpu_uuid = 'GPU-B'".to_owned(),
        "SELECT count(*) FROM datafusion.public.allocations WHERE team = 'nlp'".to_owned(),
        // Aggregates and window functions over everything.
        "SELECT count(DISTINCT team) - 1 FROM gpu_cost_hourly".to_owned(),
        "SELECT count(*) FROM (SELECT team, row_number() OVER (PARTITION BY team) AS n FROM alerts) t WHERE team = 'nlp'".to_owned(),
        "SELECT count(*) FROM recommendations WHERE team = 'nlp' OR gpu_uuids LIKE '%GPU-B%'".to_owned(),
        // information_schema shows the same tables as for everyone, and nothing more.
        "SELECT count(*) FROM information_schema.tables WHERE table_name LIKE 'apron_scope%'".to_owned(),
    ] {
        zero(q).await;
    }
    // The scoped session's catalog lists the contract's tables only.
    let tables = strings(
        &sql_rows(api, VISION, "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'").await,
    );
    assert_eq!(
        tables,
        set(&[
            "alerts",
            "allocations",
            "gpu_cost_hourly",
            "gpu_processes",
            "gpu_samples",
            "gpu_samples_1m",
            "recommendations"
        ])
    );
    // No way to name a file or an unscoped table.
    let data_dir = dir.path().join("data");
    for q in [
        "SELECT * FROM apron_scope_held".to_owned(),
        format!("SELECT * FROM '{}/gpu_samples'", data_dir.display()),
        format!("SELECT * FROM read_parquet('{}')", data_dir.display()),
        "CREATE VIEW mine AS SELECT * FROM gpu_samples".to_owned(),
    ] {
        let (status, v) = call(api, "POST", "/api/v1/sql", VISION, &q).await;
        assert!((400..500).contains(&status), "{q}: {status} {v}");
    }

    // The HTTP read routes apply the same scope.
    let (status, alerts) = call(api, "GET", "/api/v1/alerts", VISION, "").await;
    assert_eq!(status, 200, "{alerts}");
    let alert_teams: BTreeSet<String> = alerts["alerts"]
        .as_array()
        .expect("alerts")
        .iter()
        .map(|a| a["team"].as_str().unwrap_or("").to_owned())
        .collect();
    assert_eq!(alert_teams, set(&["vision"]), "{alerts}");
    let (_, all_alerts) = call(api, "GET", "/api/v1/alerts", VIEWER, "").await;
    assert!(all_alerts.to_string().contains("\"nlp\""), "the viewer sees nlp's stranded GPU-B: {all_alerts}");
    let (status, recs) = call(api, "GET", "/api/v1/recommendations?window=1h", VISION, "").await;
    assert_eq!(status, 200, "{recs}");
    assert!(recs["recommendations"].as_array().expect("items").iter().all(|r| r["team"] == "vision"), "{recs}");
    let (status, report) = call(
        api,
        "GET",
        &format!("/api/v1/reports/weekly?week={}", apron::report::current_week(T0).expect("week")),
        VISION,
        "",
    )
    .await;
    assert_eq!(status, 200, "{report}");
    assert!(!report.to_string().contains("\"nlp\""), "a team's report holds its own rows only: {report}");
    assert!(report.to_string().contains("\"vision\""), "{report}");

    // The JSON request form reads the same rows; a malformed one is a clear 400.
    let json_form = |body: &'static str| async move {
        tokio::task::spawn_blocking(move || {
            let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
            let mut r = agent
                .post(format!("http://{api}/api/v1/sql"))
                .header("authorization", &format!("Bearer {VISION}"))
                .header("content-type", "application/json; charset=utf-8")
                .header("accept", "text/csv")
                .send(body)
                .expect("sql");
            (r.status().as_u16(), r.body_mut().read_to_string().expect("body"))
        })
        .await
        .expect("join")
    };
    assert_eq!(
        json_form(r#"{"sql": "SELECT DISTINCT team FROM allocations"}"#).await,
        (200, "team\nvision\n".to_owned())
    );
    let (status, body) = json_form(r#"{"query": "SELECT 1"}"#).await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("{\\\"sql\\\""), "{body}");

    // A week outside the data: 404, and nothing is written for it.
    let (status, v) = call(api, "GET", "/api/v1/reports/weekly?week=1971-W07", VIEWER, "").await;
    assert_eq!((status, v["error"].as_str()), (404, Some("no_such_week")), "{v}");
    assert!(!data_dir.join("reports").join("1971-W07").exists(), "a 404 week stores nothing");
    let (status, _) = call(api, "GET", "/api/v1/reports/weekly?week=2999-W01", VISION, "").await;
    assert_eq!(status, 404);

    // EXPLAIN shows a team the scope as one leaf: no files, paths or row counts of what
    // the scope reads.
    for q in
        ["EXPLAIN SELECT * FROM gpu_samples WHERE gpu_util > 0", "EXPLAIN ANALYZE SELECT count(*) FROM gpu_samples"]
    {
        let (status, v) = call(api, "POST", "/api/v1/sql", VISION, q).await;
        let text = v.to_string();
        assert_eq!(status, 200, "{q}: {text}");
        assert!(text.contains("ScopedScan: table=gpu_samples, team=vision"), "{q}: {text}");
        assert!(!text.contains(".parquet") && !text.contains(&data_dir.display().to_string()), "{q}: {text}");
    }

    // Roles: an agent token cannot read; a team token cannot ingest; no token, 401.
    let (status, v) = call(api, "POST", "/api/v1/sql", AGENT, "SELECT 1").await;
    assert_eq!((status, v["error"].as_str()), (403, Some("forbidden")), "{v}");
    let (status, _) = call(api, "POST", "/api/v1/sql", "not-a-token-at-all", "SELECT 1").await;
    assert_eq!(status, 401);
    let (status, _) = call(api, "POST", "/api/v1/ingest", VISION, "").await;
    assert_eq!(status, 401, "a team token is not an ingest token");

    // The engine itself, for the PostgreSQL path below and internal callers.
    let scoped = server
        .engine()
        .execute_as("SELECT count(*) FROM allocations WHERE team = 'nlp'", &Scope::Team(vision()))
        .await
        .expect("query");
    assert_eq!(scoped.num_rows(), 1);

    // PostgreSQL: the same scope for a team user; viewers see everything.
    let pg_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind pg");
    let port = pg_listener.local_addr().expect("addr").port();
    let users: Arc<[PgUser]> = vec![
        PgUser { name: "vision-analyst".into(), password: "vision-pass-0123".into(), role: Role::Team(vision()) },
        PgUser { name: "finance".into(), password: "finance-pass-0123".into(), role: Role::Viewer },
    ]
    .into();
    tokio::spawn(apron::pg::serve(pg_listener, server.engine().clone(), PgAuth::Password(users), None));
    let psql = move |user: &'static str, password: &'static str, sql: &'static str| {
        tokio::task::spawn_blocking(move || {
            let o = Command::new("psql")
                .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-U", user, "-d", "apron", "-X", "-A", "-t"])
                .args(["-v", "ON_ERROR_STOP=1", "-c", sql])
                .env("PGPASSWORD", password)
                .env("PGCONNECT_TIMEOUT", "10")
                .env("PGSSLMODE", "disable")
                .output()
                .expect("psql (Debian package postgresql-client; scripts/install-test-tools.sh installs it)");
            assert!(o.status.success(), "{sql}: {}", String::from_utf8_lossy(&o.stderr));
            String::from_utf8_lossy(&o.stdout).trim().to_owned()
        })
    };
    let q =
        "SELECT string_agg(DISTINCT team, ',') FROM (SELECT team FROM allocations UNION ALL SELECT team FROM alerts)";
    assert_eq!(psql("vision-analyst", "vision-pass-0123", q).await.expect("join"), "vision");
    assert_eq!(psql("finance", "finance-pass-0123", q).await.expect("join").split(',').count(), 2);
    let q = "WITH s AS (SELECT gpu_uuid FROM gpu_samples) SELECT count(*) FROM s WHERE gpu_uuid IN ('GPU-B', 'GPU-C')";
    assert_eq!(psql("vision-analyst", "vision-pass-0123", q).await.expect("join"), "0");
}

/// The SQL of docs/sql.md, as a reader would paste it: the `sql` blocks of its cookbook
/// and the queries of its `curl` examples.
fn documented_sql() -> Vec<String> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/sql.md")).expect("docs/sql.md");
    let mut queries = Vec::new();
    let mut block: Option<String> = None;
    for line in doc.lines() {
        match (&mut block, line.trim_end()) {
            (None, "```sql") => block = Some(String::new()),
            (Some(sql), "```") => {
                queries.push(std::mem::take(sql));
                block = None;
            }
            (Some(sql), text) => {
                sql.push_str(text);
                sql.push('\n');
            }
            (None, text) if text.contains("--data") => {
                for (open, close) in [("--data-binary \"", "\""), ("{\"sql\": \"", "\"}")] {
                    if let Some(start) = text.find(open) {
                        let rest = &text[start + open.len()..];
                        queries.push(rest[..rest.find(close).expect("closed")].to_owned());
                    }
                }
            }
            (None, _) => {}
        }
    }
    queries
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_query_in_docs_sql_md_runs_as_written_for_a_viewer_and_a_team() {
    let dir = tempfile::tempdir().expect("tempdir");
    let now = T0 + 61 * MIN;
    let server = priced_trace(dir.path(), now).await;
    server.alerts().expect("alerts").evaluate_at(now).await.expect("alerts");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let api = listener.local_addr().expect("addr");
    let router = server.router();
    tokio::spawn(async move { axum::serve(listener, router).await.expect("serve") });

    let queries = documented_sql();
    // Five cookbook recipes and the two curl examples.
    assert_eq!(queries.len(), 7, "{queries:#?}");
    for sql in &queries {
        for token in [VIEWER, VISION] {
            sql_rows(api, token, sql).await;
        }
    }
    // The curl example's GROUP BY over the trace: two hosts, one cluster.
    let hosts = sql_rows(api, VIEWER, &queries[0]).await;
    assert_eq!(hosts.len(), 2, "{hosts:?}");
}
