//! Every parameter type binds against every column type it can be compared with, over
//! the PostgreSQL port, from the drivers BI tools and notebooks use: psycopg 3 (text and
//! binary values, unnamed and server-side prepared statements), asyncpg (values typed
//! by the server's Describe) and the PostgreSQL JDBC driver (`setDouble`, `setInt`,
//! `setLong`, `setBigDecimal`, `setString`, `setObject(…, OTHER)`, `setBoolean`,
//! `setTimestamp`; unnamed and named statements). Each `WHERE column op $1` must answer
//! what the same query with the value written as a literal answers, and a value that
//! cannot be compared must be refused with its SQLSTATE.
//!
//! The trace is the access module's hour with varied measurements: `gpu_util` in steps
//! of 0.0001 (`numeric(5,4)`), `power_watts` in steps of 0.125 W (`numeric(9,3)`), some
//! windows lost (`gpu_lost`), and the ledger's `gpu_cost_hourly` money and seconds
//! (`numeric(18,6)`).

use std::fmt::Write as _;
use std::process::Command;
use std::sync::Arc;

use super::access::{open_with_roles, trace};
use super::insights::{MIN, T0, cost, ingest};
use super::pg_clients::PGJDBC_JAR;
use apron::pg::{PgAuth, PgUser};
use apron::{access::Role, alerts::AlertsConfig, recommend::RecommendSettings};
use apron_common::{Field, FieldStats};
use apron_query::{Request, Scope};
use datafusion::arrow::array::Int64Array;
use serde_json::{Value, json};

/// One comparison: `SELECT count(*) FROM table WHERE column op <value>`, the value sent
/// as a parameter of `kind` (float8, int4, int8, numeric, text: typed text, unknown:
/// untyped text, bool, timestamptz).
struct Case {
    id: String,
    table: &'static str,
    column: &'static str,
    op: &'static str,
    kind: &'static str,
    value: String,
    /// The value as a literal in the query text; `None`: the parameter must be refused
    /// with `refused`.
    literal: Option<String>,
    refused: &'static str,
}

/// asyncpg encodes each value by the type Describe gives the parameter (the column's,
/// as PostgreSQL's would), so some values never reach the server as sent: it refuses a
/// str for an integer, float, boolean or timestamp column (and one that is not a
/// number for a numeric column) before sending anything.
fn asyncpg_refuses(c: &Case) -> bool {
    let typed = matches!(c.column, "gpu_index" | "fb_used_bytes" | "window_s" | "gpu_lost" | "time" | "start_time");
    matches!(c.kind, "text" | "unknown") && (typed || c.literal.is_none())
}

/// ... and it turns a float or decimal into an integer column's int4/int8 itself,
/// dropping the fraction: the literal asyncpg's value is.
fn asyncpg_literal(c: &Case) -> Option<String> {
    let integer = matches!(c.column, "gpu_index" | "fb_used_bytes");
    (integer && matches!(c.kind, "float8" | "numeric"))
        .then(|| format!("{}", c.value.parse::<f64>().expect("a number").trunc() as i64))
}

fn cases() -> Vec<Case> {
    let ts = |us: i64| {
        let s = us / 1_000_000;
        let (days, rest) = (s.div_euclid(86_400), s.rem_euclid(86_400));
        // Civil date from days since the epoch (Howard Hinnant's algorithm).
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z - era * 146_097;
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let d = doy - (153 * mp + 2) / 5 + 1;
        let m = if mp < 10 { mp + 3 } else { mp - 9 };
        let y = yoe + era * 400 + i64::from(m <= 2);
        format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rest / 3600, rest / 60 % 60, rest % 60)
    };
    let half_hour = ts(T0 + 30 * MIN);
    let first_window = ts(T0 + 10_000_000);
    #[rustfmt::skip]
    let rows: Vec<(&str, &str, &str, &str, String)> = vec![
        // numeric(5,4)
        ("gpu_samples", "gpu_util", ">=", "float8", "0.5".into()),
        ("gpu_samples", "gpu_util", "=", "float8", "0.07".into()),
        ("gpu_samples", "gpu_util", ">=", "float8", "0.12345".into()),
        ("gpu_samples", "gpu_util", "<", "float8", "0.12345".into()),
        ("gpu_samples", "gpu_util", ">", "int4", "0".into()),
        ("gpu_samples", "gpu_util", "<", "int8", "1".into()),
        ("gpu_samples", "gpu_util", ">=", "numeric", "0.5".into()),
        ("gpu_samples", "gpu_util", ">=", "numeric", "0.12345".into()),
        ("gpu_samples", "gpu_util", "=", "numeric", "0.07".into()),
        ("gpu_samples", "gpu_util", ">=", "text", "0.5".into()),
        ("gpu_samples", "gpu_util", "=", "unknown", "0.07".into()),
        // numeric(9,3)
        ("gpu_samples", "power_watts", "=", "float8", "150.125".into()),
        ("gpu_samples", "power_watts", ">=", "float8", "180.5".into()),
        ("gpu_samples", "power_watts", ">=", "int4", "150".into()),
        ("gpu_samples", "power_watts", "<", "int8", "150".into()),
        ("gpu_samples", "power_watts", "=", "numeric", "150.125".into()),
        ("gpu_samples", "power_watts", ">=", "numeric", "150.0625".into()),
        ("gpu_samples", "power_watts", "=", "text", "150.125".into()),
        ("gpu_samples", "power_watts", ">=", "unknown", "180.5".into()),
        // numeric(18,6): money and seconds
        ("gpu_cost_hourly", "cost_usd", ">=", "float8", "0.5".into()),
        ("gpu_cost_hourly", "cost_usd", ">", "int4", "0".into()),
        ("gpu_cost_hourly", "cost_usd", "<", "int8", "1".into()),
        ("gpu_cost_hourly", "cost_usd", ">=", "numeric", "0.25".into()),
        ("gpu_cost_hourly", "cost_usd", ">=", "text", "0.5".into()),
        ("gpu_cost_hourly", "active_s", ">=", "float8", "1800.5".into()),
        ("gpu_cost_hourly", "active_s", "<", "int4", "3600".into()),
        // integer
        ("gpu_samples", "gpu_index", "=", "float8", "0".into()),
        ("gpu_samples", "gpu_index", "<", "float8", "0.5".into()),
        ("gpu_samples", "gpu_index", "=", "int4", "0".into()),
        ("gpu_samples", "gpu_index", "<", "int8", "1".into()),
        ("gpu_samples", "gpu_index", "=", "numeric", "0".into()),
        ("gpu_samples", "gpu_index", "<", "numeric", "0.5".into()),
        ("gpu_samples", "gpu_index", "=", "text", "0".into()),
        ("gpu_samples", "gpu_index", "<", "unknown", "1".into()),
        // bigint
        ("gpu_samples", "fb_used_bytes", ">=", "float8", "1e9".into()),
        ("gpu_samples", "fb_used_bytes", ">=", "int4", "1000000000".into()),
        ("gpu_samples", "fb_used_bytes", ">=", "int8", "10737418240".into()),
        ("gpu_samples", "fb_used_bytes", "=", "numeric", "536870912".into()),
        ("gpu_samples", "fb_used_bytes", "=", "text", "21474836480".into()),
        ("gpu_samples", "fb_used_bytes", "<", "unknown", "1000".into()),
        // double precision
        ("gpu_samples", "window_s", ">", "float8", "9.5".into()),
        ("gpu_samples", "window_s", "=", "int4", "10".into()),
        ("gpu_samples", "window_s", ">", "int8", "10".into()),
        ("gpu_samples", "window_s", "=", "numeric", "10.0".into()),
        ("gpu_samples", "window_s", ">", "numeric", "9.99".into()),
        ("gpu_samples", "window_s", "=", "text", "10".into()),
        ("gpu_samples", "window_s", ">", "unknown", "9.5".into()),
        // text
        ("gpu_samples", "gpu_uuid", "=", "text", "GPU-B".into()),
        ("gpu_samples", "gpu_uuid", "=", "unknown", "GPU-A".into()),
        // boolean
        ("gpu_samples", "gpu_lost", "=", "bool", "true".into()),
        ("gpu_samples", "gpu_lost", "=", "bool", "false".into()),
        ("gpu_samples", "gpu_lost", "=", "text", "true".into()),
        ("gpu_samples", "gpu_lost", "=", "unknown", "f".into()),
        // timestamp with time zone
        ("gpu_samples", "time", ">=", "timestamptz", half_hour.clone()),
        ("gpu_samples", "time", "=", "timestamptz", first_window.clone()),
        ("gpu_samples", "time", ">=", "text", half_hour.clone()),
        ("gpu_samples", "time", "<", "unknown", half_hour),
        ("allocations", "start_time", "<=", "timestamptz", first_window),
    ];
    let mut out: Vec<Case> = rows
        .into_iter()
        .enumerate()
        .map(|(n, (table, column, op, kind, value))| {
            let quoted = matches!(column, "gpu_uuid" | "time" | "start_time");
            let literal = match column {
                _ if quoted => format!("'{value}'"),
                "gpu_lost" => (if value.starts_with('t') { "true" } else { "false" }).to_owned(),
                _ => value.clone(),
            };
            Case {
                id: format!("{n:02}_{column}_{kind}"),
                table,
                column,
                op,
                kind,
                value,
                literal: Some(literal),
                refused: "",
            }
        })
        .collect();
    // Values that cannot be compared: refused with PostgreSQL's SQLSTATE, never a crash.
    #[rustfmt::skip]
    let refusals = [
        ("gpu_util", ">=", "float8", "1e300", "22003"),
        ("power_watts", "<", "numeric", "1e40", "22003"),
        ("gpu_util", ">=", "text", "half", "22P02"),
        ("gpu_lost", "=", "unknown", "maybe", "22P02"),
        ("time", ">=", "unknown", "yesterday at noon", "22007"),
    ];
    for (n, (column, op, kind, value, code)) in refusals.into_iter().enumerate() {
        out.push(Case {
            id: format!("refused_{n}_{column}_{kind}"),
            table: "gpu_samples",
            column,
            op,
            kind,
            value: value.into(),
            literal: None,
            refused: code,
        });
    }
    out
}

impl Case {
    fn sql(&self, rhs: &str) -> String {
        format!("SELECT count(*) FROM {} WHERE {} {} {rhs}", self.table, self.column, self.op)
    }
}

/// The access trace with varied measurements (see the module's comment).
fn varied_trace() -> Vec<apron_common::GpuWindow> {
    let stat = |v: f64| Some(FieldStats { count: 10, mean: v, min: v, max: v, last: v });
    let mut windows = trace();
    for (k, w) in windows.iter_mut().enumerate() {
        if k % 97 == 5 {
            w.lost = true;
            w.fields.iter_mut().for_each(|f| *f = None);
            continue;
        }
        w.fields[Field::GpuUtil.index()] = stat(((k * 7) % 10_000) as f64 / 10_000.0);
        w.fields[Field::PowerWatts.index()] = stat(100.0 + (k % 800) as f64 * 0.125);
    }
    windows
}

const CLIENTS_PY: &str = r#"
import asyncio, datetime, decimal, json, sys
import psycopg, asyncpg
from psycopg.types.numeric import Int4, Int8
from psycopg.types.string import StrDumper

port, user, password, path = sys.argv[1:5]
cases = [l.rstrip("\n").split("\t") for l in open(path) if l.strip()]

def value(kind, v, client):
    if kind == "float8": return float(v)
    if kind == "int4": return Int4(int(v)) if client == "psycopg" else int(v)
    if kind == "int8": return Int8(int(v)) if client == "psycopg" else int(v)
    if kind == "numeric": return decimal.Decimal(v)
    if kind in ("text", "unknown"): return v
    if kind == "bool": return v == "true"
    if kind == "timestamptz": return datetime.datetime.fromisoformat(v.replace("Z", "+00:00"))
    raise ValueError(kind)

out = {}
conninfo = f"host=127.0.0.1 port={port} user={user} password={password} dbname=apron sslmode=disable"
for mode in ("text", "prepared", "binary"):
    res = {}
    with psycopg.connect(conninfo, autocommit=True) as c:
        for id_, sql, kind, v in cases:
            cur = c.cursor()
            if kind == "text":
                # psycopg sends str untyped (unknown); typed text as well.
                cur.adapters.register_dumper(str, StrDumper)
            ph = "%b" if mode == "binary" else "%s"
            try:
                cur.execute(sql.replace("{p}", ph), (value(kind, v, "psycopg"),), prepare=(mode == "prepared"))
                res[id_] = cur.fetchone()[0]
            except psycopg.Error as e:
                res[id_] = "error:" + str(e.sqlstate) + ": " + str(e).splitlines()[0]
    out["psycopg_" + mode] = res

async def run_asyncpg():
    conn = await asyncpg.connect(host="127.0.0.1", port=int(port), user=user, password=password,
                                 database="apron", ssl=False)
    res = {}
    for id_, sql, kind, v in cases:
        try:
            res[id_] = await conn.fetchval(sql.replace("{p}", "$1"), value(kind, v, "asyncpg"))
        except asyncpg.PostgresError as e:
            message = str(e).splitlines()[0]
            if message.startswith("invalid input for query argument"):
                # asyncpg's own codec refused the Python value before sending it.
                res[id_] = "client:" + message
            else:
                res[id_] = "error:" + str(e.sqlstate) + ": " + message
    await conn.close()
    return res

out["asyncpg"] = asyncio.run(run_asyncpg())
print(json.dumps(out))
"#;

const BINDING_JAVA: &str = r#"
import java.math.BigDecimal;
import java.nio.file.*;
import java.sql.*;
import java.time.Instant;
import java.util.*;

public class Binding {
    static String quote(String s) {
        return "\"" + s.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", " ") + "\"";
    }

    static void set(PreparedStatement ps, String kind, String v) throws SQLException {
        switch (kind) {
            case "float8": ps.setDouble(1, Double.parseDouble(v)); break;
            case "int4": ps.setInt(1, Integer.parseInt(v)); break;
            case "int8": ps.setLong(1, Long.parseLong(v)); break;
            case "numeric": ps.setBigDecimal(1, new BigDecimal(v)); break;
            case "text": ps.setString(1, v); break;
            case "unknown": ps.setObject(1, v, Types.OTHER); break;
            case "bool": ps.setBoolean(1, Boolean.parseBoolean(v)); break;
            case "timestamptz": ps.setTimestamp(1, Timestamp.from(Instant.parse(v))); break;
            default: throw new IllegalArgumentException(kind);
        }
    }

    public static void main(String[] args) throws Exception {
        List<String[]> cases = new ArrayList<>();
        for (String line : Files.readAllLines(Paths.get(args[3]))) {
            if (!line.isBlank()) cases.add(line.split("\t", -1));
        }
        StringBuilder out = new StringBuilder("{");
        // Unnamed statements (the default), then named server-side ones from the first run.
        String[][] modes = {{"jdbc", "5"}, {"jdbc_prepared", "1"}};
        for (int m = 0; m < modes.length; m++) {
            Properties props = new Properties();
            props.setProperty("user", args[1]);
            props.setProperty("password", args[2]);
            props.setProperty("sslmode", "disable");
            props.setProperty("prepareThreshold", modes[m][1]);
            if (m > 0) out.append(",");
            out.append(quote(modes[m][0])).append(":{");
            try (Connection c = DriverManager.getConnection("jdbc:postgresql://127.0.0.1:" + args[0] + "/apron", props)) {
                for (int i = 0; i < cases.size(); i++) {
                    String[] k = cases.get(i);
                    String result = null;
                    try (PreparedStatement ps = c.prepareStatement(k[1].replace("{p}", "?"))) {
                        // Twice: the second run uses the named statement where one is made.
                        for (int run = 0; run < 2; run++) {
                            set(ps, k[2], k[3]);
                            try (ResultSet rs = ps.executeQuery()) {
                                rs.next();
                                String r = Long.toString(rs.getLong(1));
                                if (result != null && !result.equals(r)) r = "\"runs differ: " + result + " then " + r + "\"";
                                result = r;
                            }
                        }
                    } catch (SQLException e) {
                        result = quote("error:" + e.getSQLState() + ": " + e.getMessage());
                    }
                    if (i > 0) out.append(",");
                    out.append(quote(k[0])).append(":").append(result);
                }
            }
            out.append("}");
        }
        System.out.println(out.append("}"));
    }
}
"#;

/// Runs a client program; its stdout is one JSON object. A missing tool or library
/// fails the test (scripts/install-test-tools.sh installs them), never skips it.
fn run(what: &str, mut command: Command) -> Value {
    let o = command.output().unwrap_or_else(|e| panic!("{what}: {e} (run scripts/install-test-tools.sh)"));
    assert!(o.status.success(), "{what} failed ({}):\n{}", o.status, String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{what}: {e}: {}", String::from_utf8_lossy(&o.stdout)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_parameter_type_binds_against_every_column_type_from_psycopg_asyncpg_and_jdbc() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = open_with_roles(dir.path())
        .with_cost(cost(dir.path(), apron_cost::TeamConfig::default()))
        .expect("cost")
        .with_alerts(AlertsConfig::default())
        .with_recommend(RecommendSettings::default());
    ingest(&server, &varied_trace(), 0);
    server.ledger().expect("ledger").run_once(T0 + 61 * MIN).await;

    // What each comparison answers with the value written into the query.
    let cases = cases();
    let count = async |sql: String| {
        let request = Request { sql: sql.clone(), pg_client: true, params: None };
        let r = server.engine().execute_request_as(request, &Scope::All).await;
        let r = r.unwrap_or_else(|e| panic!("{sql}: {e}"));
        json!(r.batches[0].column(0).as_any().downcast_ref::<Int64Array>().expect("count").value(0))
    };
    let (mut expected, mut expected_asyncpg) = (Vec::new(), Vec::new());
    for c in &cases {
        let want = match &c.literal {
            Some(literal) => count(c.sql(literal)).await,
            None => json!(c.refused),
        };
        expected_asyncpg.push(match asyncpg_literal(c) {
            Some(literal) => count(c.sql(&literal)).await,
            None => want.clone(),
        });
        expected.push(want);
    }
    // The values are varied: the matrix is not all-or-nothing.
    let counts: Vec<i64> = expected.iter().filter_map(Value::as_i64).collect();
    assert!(counts.iter().filter(|&&n| n > 0).count() > counts.len() / 2, "{counts:?}");
    let by_id = |id: &str| expected[cases.iter().position(|c| c.id == id).expect("case")].clone();
    assert_eq!(by_id("01_gpu_util_float8"), json!(1), "gpu_util = 0.07: one window");
    assert_eq!(by_id("11_power_watts_float8"), json!(2), "power_watts = 150.125: two windows");
    assert_ne!(by_id("02_gpu_util_float8"), json!(0));

    let mut tsv = String::new();
    for c in &cases {
        writeln!(tsv, "{}\t{}\t{}\t{}", c.id, c.sql("{p}"), c.kind, c.value).expect("write");
    }
    let path = dir.path().join("cases.tsv");
    std::fs::write(&path, tsv).expect("cases");
    let java = dir.path().join("Binding.java");
    std::fs::write(&java, BINDING_JAVA).expect("java");

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind pg");
    let port = listener.local_addr().expect("addr").port().to_string();
    let users: Arc<[PgUser]> =
        vec![PgUser { name: "finance".into(), password: "finance-pass-0123".into(), role: Role::Viewer }].into();
    tokio::spawn(apron::pg::serve(listener, server.engine().clone(), PgAuth::Password(users), None));

    let args = |c: &mut Command| {
        c.args([port.as_str(), "finance", "finance-pass-0123"]).arg(&path);
    };
    let mut python = Command::new("python3");
    python.arg("-c").arg(CLIENTS_PY);
    args(&mut python);
    assert!(std::path::Path::new(PGJDBC_JAR).exists(), "{PGJDBC_JAR}: run scripts/install-test-tools.sh");
    let mut jdbc = Command::new("java");
    jdbc.args(["-cp", PGJDBC_JAR]).arg(&java);
    args(&mut jdbc);
    let (py, jv) = tokio::join!(
        tokio::task::spawn_blocking(move || run("psycopg/asyncpg", python)),
        tokio::task::spawn_blocking(move || run("JDBC", jdbc)),
    );
    let (py, jv) = (py.expect("python"), jv.expect("java"));

    let mut failures = Vec::new();
    for (client, results) in py.as_object().into_iter().chain(jv.as_object()).flatten() {
        for (n, c) in cases.iter().enumerate() {
            let want = if client == "asyncpg" { &expected_asyncpg[n] } else { &expected[n] };
            let got = &results[&c.id];
            let ok = match want {
                Value::String(code) if client == "asyncpg" && asyncpg_refuses(c) => {
                    got.as_str().is_some_and(|g| g.starts_with("client:"))
                }
                Value::String(code) => got.as_str().is_some_and(|g| g.starts_with(&format!("error:{code}"))),
                _ if client == "asyncpg" && asyncpg_refuses(c) => {
                    got.as_str().is_some_and(|g| g.starts_with("client:"))
                }
                _ => got == want,
            };
            if !ok {
                failures.push(format!("{client} {} [{} {}]: got {got}, want {want}", c.id, c.kind, c.value));
            }
        }
    }
    assert!(failures.is_empty(), "{} of the matrix failed:\n{}", failures.len(), failures.join("\n"));
}
