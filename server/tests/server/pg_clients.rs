//! The clients analysts use, against the PostgreSQL port of a server holding the
//! access module's trace (GPU-B is team `nlp`'s for the whole hour, 360 windows of 10 s):
//! psql's meta-commands and psql 16's `\bind`, psycopg 3 with server-side parameters,
//! asyncpg (prepared statements, a portal read two rows at a time), SQLAlchemy's
//! inspector and `pandas.read_sql`, and Grafana's data-source queries — run by
//! `tests/pg/clients.py` — and the PostgreSQL JDBC driver (`tests/pg/Jdbc.java`:
//! DatabaseMetaData, Metabase's and DBeaver's connect-time SQL, a PreparedStatement, a
//! cursor read in pieces). A viewer sees every row through each of them; a
//! `team:vision` user sees none of nlp's, and the same catalog.

use std::process::Command;
use std::sync::Arc;

use super::access::priced_trace;
use super::insights::{MIN, T0};
use apron::access::Role;
use apron::pg::{PgAuth, PgUser};
use apron_common::TeamName;
use serde_json::{Value, json};

/// The trace's hour, in Unix seconds: `[T0, T0 + 1 h]`.
const RANGE_S: (i64, i64) = (T0 / 1_000_000, (T0 + 60 * MIN) / 1_000_000);

/// The PostgreSQL JDBC driver as Debian installs it (libpostgresql-jdbc-java).
pub(super) const PGJDBC_JAR: &str = "/usr/share/java/postgresql.jar";

/// Runs a client program (`what`) as `user`, asking about `gpu` over [`RANGE_S`]; its
/// stdout is one JSON object.
fn run_client(what: &str, mut command: Command, user: &str, password: &str, gpu: &str) -> Value {
    let (from, to) = (RANGE_S.0.to_string(), RANGE_S.1.to_string());
    let o = command.args([user, password, gpu, &from, &to]).output().unwrap_or_else(|e| panic!("{what}: {e}"));
    let stderr = String::from_utf8_lossy(&o.stderr);
    // clients.py exits 2 when a client library is missing, and java when the driver
    // is (scripts/install-test-tools.sh installs both): a failure, never a skip.
    assert!(o.status.success(), "{what} as {user} failed ({}):\n{stderr}", o.status);
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{what}: {e}: {}", String::from_utf8_lossy(&o.stdout)))
}

/// `tests/pg/clients.py` (psql, psycopg, asyncpg, SQLAlchemy, pandas, Grafana's SQL).
fn clients(port: u16, user: &'static str, password: &'static str, gpu: &'static str) -> Value {
    let mut command = Command::new("python3");
    command.arg(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/pg/clients.py")).arg(port.to_string());
    run_client("clients.py", command, user, password, gpu)
}

/// `tests/pg/Jdbc.java`, run by the JDK's source launcher with the Debian driver.
fn jdbc(port: u16, user: &'static str, password: &'static str, gpu: &'static str) -> Value {
    assert!(std::path::Path::new(PGJDBC_JAR).exists(), "{PGJDBC_JAR}: run scripts/install-test-tools.sh");
    let mut command = Command::new("java");
    command
        .args(["-cp", PGJDBC_JAR, concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/pg/Jdbc.java")])
        .arg(port.to_string());
    run_client("Jdbc.java", command, user, password, gpu)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psql_python_drivers_grafana_and_jdbc_browse_and_query_within_their_scope() {
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

    let run = |user, password| {
        tokio::task::spawn_blocking(move || {
            let mut out = clients(port, user, password, "GPU-B");
            out["jdbc"] = jdbc(port, user, password, "GPU-B");
            out
        })
    };
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
        let columns = who["sqlalchemy"]["columns"].as_array().unwrap_or_else(|| panic!("get_columns: {who:#}"));
        assert!(columns.starts_with(&[json!(["hour", "TIMESTAMP"]), json!(["cluster", "TEXT"])]), "{columns:?}");
        assert!(columns.contains(&json!(["idle_cost_usd", "NUMERIC"])), "get_columns: {columns:?}");
        // Writes through the extended protocol are refused like any other.
        assert_eq!(who["psycopg"]["write"], "25006", "{who:#}");
        assert_eq!(who["psycopg"]["bad_column"], "42P01", "{who:#}");
        assert_eq!(who["asyncpg"]["param_types"], json!(["text"]), "{who:#}");
        assert_eq!(who["asyncpg"]["columns"], json!(["gpu_uuid", "n"]), "{who:#}");
        assert_eq!(who["asyncpg"]["cursor_rows"], 7, "a portal read in pieces: {who:#}");

        // Grafana: its version probe, schema, table and column pickers.
        let grafana = &who["grafana"];
        assert_eq!(grafana["version"], json!([[1600]]), "{grafana:#}");
        assert_eq!(grafana["timescaledb"], json!([]), "{grafana:#}");
        assert_eq!(grafana["schemas"], json!([["public"]]), "{grafana:#}");
        let picked: Vec<Value> = tables.iter().map(|t| json!([t])).collect();
        assert_eq!(grafana["tables"], json!(picked), "the table picker names tables on the search path bare");
        let columns = grafana["columns"].as_array().unwrap_or_else(|| panic!("columns: {grafana:#}"));
        let names: Vec<&str> = columns.iter().filter_map(|c| c[0].as_str()).collect();
        assert_eq!(names.len(), d.len(), "the column picker lists \\d's columns: {names:?}");
        assert!(names.starts_with(&["time", "window_s", "cluster", "host", "gpu_uuid"]), "{names:?}");
        // Typed in PostgreSQL's words, as Grafana's query builder reads them.
        for typed in [json!(["time", "timestamp with time zone"]), json!(["window_s", "double precision"])] {
            assert!(columns.contains(&typed), "{typed}: {columns:?}");
        }
        assert!(columns.contains(&json!(["gpu_uuid", "text"])) && columns.contains(&json!(["gpu_util", "numeric"])));

        // JDBC: the schema browser, and what Metabase and DBeaver send on connect.
        let jdbc = &who["jdbc"];
        assert_eq!(jdbc["product"], "PostgreSQL 16", "{jdbc:#}");
        assert_eq!(jdbc["tables"], json!(tables), "DatabaseMetaData.getTables");
        assert!(jdbc["schemas"].as_array().is_some_and(|s| s.contains(&json!("public"))), "{jdbc:#}");
        let jdbc_columns = jdbc["columns"].as_array().unwrap_or_else(|| panic!("getColumns: {jdbc:#}"));
        assert_eq!(jdbc_columns.len(), d.len(), "getColumns: {jdbc_columns:?}");
        for column in ["time timestamptz", "window_s float8", "gpu_uuid text", "gpu_util numeric", "fb_used_bytes int8"]
        {
            assert!(jdbc_columns.contains(&json!(column)), "getColumns lacks {column}: {jdbc_columns:?}");
        }
        let on_connect = jdbc["on_connect"].as_object().unwrap_or_else(|| panic!("{jdbc:#}"));
        assert_eq!(on_connect.len(), 9, "{on_connect:#?}");
        for (sql, rows) in on_connect {
            assert!(rows.is_u64(), "{sql}: {rows}");
        }
        assert_eq!(jdbc["write"], "25006", "{jdbc:#}");
        assert_eq!(jdbc["fetched_in_pieces"], 7, "a cursor read two rows at a time: {jdbc:#}");
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

    // psql 16's \bind, JDBC's PreparedStatement (six runs: unnamed, then a named
    // server-side statement) and a Grafana panel over GPU-B's hour.
    assert_eq!(finance["psql16_bind"], json!({"lines": ["360"]}));
    assert_eq!(analyst["psql16_bind"], json!({"lines": ["0"]}));
    assert_eq!(finance["jdbc"]["prepared_counts"], json!([360, 360, 360, 360, 360, 360]));
    assert_eq!(analyst["jdbc"]["prepared_counts"], json!([0, 0, 0, 0, 0, 0]));
    let panel = finance["grafana"]["panel"].as_array().expect("panel");
    let windows: i64 = panel.iter().filter_map(|p| p[1].as_i64()).sum();
    assert_eq!(windows, 360, "$__timeFilter over the hour: {panel:?}");
    for point in panel {
        let t = point[0].as_f64().expect("time") as i64;
        assert!(t % 600 == 0 && (RANGE_S.0..=RANGE_S.1).contains(&t), "$__timeGroupAlias(time, '10m'): {t}");
    }
    assert_eq!(analyst["grafana"]["panel"], json!([]));
    assert_eq!(finance["grafana"]["cost_teams"], json!(["nlp", "unallocated", "vision"]));
    assert_eq!(analyst["grafana"]["cost_teams"], json!(["vision"]));
}
