//! The clients analysts use, against the PostgreSQL port of a server holding the
//! access module's trace (GPU-B is team `nlp`'s for the whole hour, 360 windows of 10 s):
//! psql's meta-commands, psycopg 3 with server-side parameters, asyncpg (prepared
//! statements, a portal read two rows at a time), SQLAlchemy's inspector and
//! `pandas.read_sql` — run by `tests/pg/clients.py`. A viewer sees every row through
//! each of them; a `team:vision` user sees none of nlp's, and the same catalog.

use std::process::Command;
use std::sync::Arc;

use super::access::priced_trace;
use super::insights::{MIN, T0};
use apron::access::Role;
use apron::pg::{PgAuth, PgUser};
use apron_common::TeamName;
use serde_json::{Value, json};

/// `tests/pg/clients.py` as `user`, asking about `gpu`.
fn clients(port: u16, user: &'static str, password: &'static str, gpu: &'static str) -> Value {
    let o = Command::new("python3")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/pg/clients.py"))
        .args([&port.to_string(), user, password, gpu])
        .output()
        .expect("python3 runs");
    let stderr = String::from_utf8_lossy(&o.stderr);
    // 2: a client library is missing (scripts/install-test-tools.sh installs them): a
    // failure, never a skip.
    assert!(o.status.success(), "clients.py as {user} failed ({}):\n{stderr}", o.status);
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&o.stdout)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psql_psycopg_asyncpg_sqlalchemy_and_pandas_browse_and_query_within_their_scope() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = priced_trace(dir.path(), T0 + 61 * MIN).await;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind pg");
    let port = listener.local_addr().expect("addr").port();
    let vision = TeamName::new("vision").expect("team");
    let users: Arc<[PgUser]> = vec![
        PgUser { name: "vision-analyst".into(), password: "vision-pass-0123".into(), role: Role::Team(vision) },
        PgUser { name: "finance".into(), password: "finance-pass-0123".into(), role: Role::Viewer },
    ]
    .into();
    tokio::spawn(apron::pg::serve(listener, server.engine().clone(), PgAuth::Password(users), None));

    let run = |user, password| tokio::task::spawn_blocking(move || clients(port, user, password, "GPU-B"));
    let (finance, analyst) = (run("finance", "finance-pass-0123"), run("vision-analyst", "vision-pass-0123"));
    let (finance, analyst) = (finance.await.expect("finance"), analyst.await.expect("analyst"));

    // The catalog: the same tables and columns for both.
    let tables = [
        "alerts",
        "allocations",
        "gpu_cost_hourly",
        "gpu_processes",
        "gpu_samples",
        "gpu_samples_1m",
        "recommendations",
    ];
    for who in [&finance, &analyst] {
        let dt: Vec<String> = who["psql"]["\\dt"]["lines"]
            .as_array()
            .unwrap_or_else(|| panic!("\\dt: {who:#}"))
            .iter()
            .filter_map(|l| l.as_str()?.split('|').nth(1).map(str::to_owned))
            .collect();
        assert_eq!(dt, tables, "\\dt");
        let d = who["psql"]["\\d gpu_samples"]["lines"].as_array().unwrap_or_else(|| panic!("\\d: {who:#}"));
        assert!(d.iter().any(|l| l.as_str().is_some_and(|l| l.starts_with("gpu_uuid|text|"))), "{d:?}");
        assert!(d.iter().any(|l| l.as_str().is_some_and(|l| l.starts_with("time|timestamp with time zone|"))), "{d:?}");
        assert!(who["psql"]["\\l"]["lines"].as_array().is_some_and(|l| !l.is_empty()), "\\l: {who:#}");
        assert!(
            who["psql"]["\\dn"]["lines"]
                .as_array()
                .is_some_and(|l| l.iter().any(|l| l.as_str().is_some_and(|l| l.starts_with("public|")))),
            "\\dn: {who:#}"
        );
        assert_eq!(who["sqlalchemy"]["tables"], json!(tables), "SQLAlchemy inspect()");
        // Writes through the extended protocol are refused like any other.
        assert_eq!(who["psycopg"]["write"], "25006", "{who:#}");
        assert_eq!(who["psycopg"]["bad_column"], "42P01", "{who:#}");
        assert_eq!(who["asyncpg"]["param_types"], json!(["text"]), "{who:#}");
        assert_eq!(who["asyncpg"]["columns"], json!(["gpu_uuid", "n"]), "{who:#}");
        assert_eq!(who["asyncpg"]["cursor_rows"], 7, "a portal read in pieces: {who:#}");
    }

    // The rows: GPU-B's 360 windows for the viewer, none for vision.
    assert_eq!((&finance["psycopg"]["count"], &finance["psycopg"]["count_again"]), (&json!(360), &json!(360)));
    assert_eq!(finance["psycopg"]["teams"], json!(["nlp", "vision"]));
    assert_eq!(finance["asyncpg"]["rows"], json!([["GPU-B", 360]]));
    assert_eq!(finance["sqlalchemy"]["pandas"], json!([{"gpu_uuid": "GPU-B", "n": 360}]));
    assert_eq!((&analyst["psycopg"]["count"], &analyst["psycopg"]["count_again"]), (&json!(0), &json!(0)));
    assert_eq!(analyst["psycopg"]["teams"], json!(["vision"]));
    assert_eq!(analyst["asyncpg"]["rows"], json!([]));
    assert_eq!(analyst["sqlalchemy"]["pandas"], json!([]));
}
