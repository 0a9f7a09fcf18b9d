//! Scoping follows the GPU's holder at every moment: one GPU is held by `vision`, handed
//! to `data-science`, released, and taken back by `vision`. Each team sees exactly its
//! own windows, process rows and minutes — right after ingest (before the cost ledger
//! has closed the open allocation) and after the ledger pass — and no window changes
//! hands at a hand-over. (A holding that began after the last pass becomes visible with
//! the pass that records it: fail closed.)
//!
//! | (T0 + …]   | holder of GPU-X                 |
//! | ---------- | ------------------------------- |
//! | 0–20 min   | vision `train-1`                |
//! | 20–40 min  | data-science `secret-notebook`  |
//! | 40–50 min  | nobody                          |
//! | 50–60 min  | vision `train-2`                |

use std::collections::BTreeSet;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use super::cost::SEC;
use super::insights::{H100, MIN, T0, cost, ident, ingest, pod, seg, windows};
use apron::Server;
use apron::access::{Access, Credential, Role};
use apron::pg::{PgAuth, PgUser};
use apron_collector::http::IngestOptions;
use apron_collector::{IngestRequest, StoreConfig, Table};
use apron_common::wire::{encode_ipc, processes_to_batch};
use apron_common::{GpuUuid, HostName, ProcessRow, TeamName, UnixMicros};
use apron_query::{QueryConfig, QueryEngine, Scope};

fn team(name: &str) -> Scope {
    Scope::Team(TeamName::new(name).expect("team"))
}

/// One process sample every 10 s of `(from, to]` (relative to T0), in `ns/pod`.
fn processes(from: i64, to: i64, holder: Option<(&str, &str)>, name: &str) -> Vec<ProcessRow> {
    let mut out = Vec::new();
    let mut t = T0 + from + 10 * SEC;
    while t <= T0 + to {
        out.push(ProcessRow {
            time: UnixMicros(t),
            host: HostName::new("node-0").expect("host"),
            gpu_uuid: GpuUuid::new("GPU-X").expect("uuid"),
            pid: 100,
            process_name: Some(name.to_owned()),
            user: None,
            fb_used_bytes: Some(1 << 30),
            sm_util: Some(0.5),
            container_id: None,
            pod: holder.map(|(_, p)| p.to_owned()),
            namespace: holder.map(|(ns, _)| ns.to_owned()),
            container: None,
            pod_uid: None,
            job_id: None,
        });
        t += 10 * SEC;
    }
    out
}

fn ingest_processes(server: &Server, rows: &[ProcessRow], seq: u64) {
    let body = encode_ipc(&processes_to_batch(rows).expect("batch")).expect("ipc");
    server
        .store()
        .ingest(IngestRequest { table: Table::GpuProcesses, agent: "t", epoch: "p", sequence: seq, body: &body })
        .expect("ingest");
}

/// The window ends (µs after T0, in seconds) a scope sees of `table` (`time` column).
async fn seen(engine: &QueryEngine, scope: &Scope, table: &str) -> BTreeSet<i64> {
    let q = format!("SELECT CAST((CAST(time AS BIGINT) - {T0}) / 1000000 AS BIGINT) FROM {table} ORDER BY 1");
    let r = engine.execute_as(&q, scope).await.unwrap_or_else(|e| panic!("{q}: {e}"));
    let mut out = BTreeSet::new();
    for b in &r.batches {
        let c = b.column(0).as_any().downcast_ref::<datafusion::arrow::array::Int64Array>().expect("i64");
        out.extend(c.iter().flatten());
    }
    out
}

/// Window ends (seconds after T0) of `(from, to]` minutes, every `step` seconds.
fn ends(from_min: i64, to_min: i64, step: i64) -> BTreeSet<i64> {
    (from_min * 60 / step + 1..=to_min * 60 / step).map(|i| i * step).collect()
}

/// Minute starts (seconds after T0) of the minutes wholly inside the allocation of window
/// ends `(from, to]` minutes: after `from`, ending by `to`.
fn starts(from_min: i64, to_min: i64) -> BTreeSet<i64> {
    (from_min + 1..to_min).map(|m| m * 60).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_team_sees_the_gpu_exactly_while_it_holds_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = StoreConfig {
        data_dir: dir.path().join("data"),
        persist_interval: Duration::from_secs(3600),
        maintenance_interval: Duration::from_secs(3600),
        ..StoreConfig::default()
    };
    let ingest_opts = IngestOptions { tokens: vec!["agent-token-0123456789".into()], ..IngestOptions::default() };
    let access = Access::Tokens(
        vec![
            Credential { token: b"agent-token-0123456789".to_vec().into(), role: Role::Agent },
            Credential {
                token: b"vision-token-0123456789".to_vec().into(),
                role: Role::Team(TeamName::new("vision").expect("team")),
            },
        ]
        .into(),
    );
    let server = Server::open(store, ingest_opts, QueryConfig::default(), access)
        .expect("open")
        .with_cost(cost(dir.path(), apron_cost::TeamConfig::default()))
        .expect("cost");
    let x = ident("node-0", "GPU-X", H100);
    let (vision, ds) = (team("vision"), team("data-science"));
    let v1 = pod("vision", "train-1", r#"{"team":"vision"}"#);
    let v2 = pod("vision", "train-2", r#"{"team":"vision"}"#);
    let nb = pod("data-science", "secret-notebook", r#"{"team":"data-science"}"#);
    let ledger = server.ledger().expect("ledger").clone();
    let engine = server.engine().clone();

    // vision holds the GPU; the ledger opens its allocation (end_time NULL).
    ingest(&server, &windows(&[seg(&x, 0, 20 * MIN, 0.6, 20.0, Some(v1.clone()))]), 0);
    ingest_processes(&server, &processes(0, 20 * MIN, Some(("vision", "train-1")), "python train.py"), 0);
    ledger.run_once(T0 + 20 * MIN + SEC).await;
    assert_eq!(seen(&engine, &vision, "gpu_samples").await, ends(0, 20, 10));

    // The GPU changes hands, is released and taken back — ingested, no ledger pass yet.
    ingest(
        &server,
        &windows(&[
            seg(&x, 20 * MIN, 40 * MIN, 0.0, 2.0, Some(nb.clone())),
            seg(&x, 40 * MIN, 50 * MIN, 0.0, 0.0, None),
            seg(&x, 50 * MIN, 60 * MIN, 0.7, 30.0, Some(v2.clone())),
        ]),
        1,
    );
    ingest_processes(
        &server,
        &[
            processes(20 * MIN, 40 * MIN, Some(("data-science", "secret-notebook")), "python s3://ds-private/etl.py"),
            processes(50 * MIN, 60 * MIN, Some(("vision", "train-2")), "python train.py"),
        ]
        .concat(),
        1,
    );
    // Right after ingest: vision's allocation is still open, yet vision sees none of
    // data-science's windows or processes — only train-1's. New holdings become visible
    // with the pass that records them (fail closed).
    assert_eq!(seen(&engine, &vision, "gpu_samples").await, ends(0, 20, 10), "before the pass");
    assert_eq!(seen(&engine, &vision, "gpu_processes").await, ends(0, 20, 10), "before the pass");
    assert_eq!(seen(&engine, &vision, "gpu_samples_1m").await, starts(0, 20), "before the pass");
    assert!(seen(&engine, &ds, "gpu_samples").await.is_empty(), "data-science has no allocation yet");
    let leaked = engine
        .execute_as("SELECT count(*) FROM gpu_processes WHERE process_name LIKE '%ds-private%'", &vision)
        .await
        .expect("query");
    assert_eq!(
        leaked.batches[0].column(0).as_any().downcast_ref::<datafusion::arrow::array::Int64Array>().map(|a| a.value(0)),
        Some(0)
    );

    // After the pass: each team exactly its own windows; the released stretch is
    // nobody's; the window at each hand-over stays with the holder whose window it is.
    ledger.run_once(T0 + 61 * MIN).await;
    let vision_windows = &ends(0, 20, 10) | &ends(50, 60, 10);
    assert_eq!(seen(&engine, &vision, "gpu_samples").await, vision_windows);
    assert_eq!(seen(&engine, &ds, "gpu_samples").await, ends(20, 40, 10));
    assert_eq!(seen(&engine, &vision, "gpu_processes").await, vision_windows);
    assert_eq!(seen(&engine, &ds, "gpu_processes").await, ends(20, 40, 10));
    // Minutes: those wholly inside a team's allocation. A minute is labelled by its
    // start and holds the windows ending in [start, start + 1 min); the one starting
    // exactly at an allocation's start could hold the previous holder's last window, so
    // it is no one's (fail closed).
    let vision_minutes = &starts(0, 20) | &starts(50, 60);
    assert_eq!(seen(&engine, &vision, "gpu_samples_1m").await, vision_minutes);
    assert_eq!(seen(&engine, &ds, "gpu_samples_1m").await, starts(20, 40));

    // The same over HTTP, as a vision token: train-1's and train-2's windows only.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let api = listener.local_addr().expect("addr");
    let router = server.router();
    tokio::spawn(async move { axum::serve(listener, router).await.expect("serve") });
    let body = tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
        let mut r = agent
            .post(format!("http://{api}/api/v1/sql"))
            .header("authorization", "Bearer vision-token-0123456789")
            .header("accept", "text/csv")
            .send("SELECT owner, count(*) AS n FROM gpu_samples GROUP BY owner ORDER BY owner")
            .expect("sql");
        (r.status().as_u16(), r.body_mut().read_to_string().expect("body"))
    })
    .await
    .expect("join");
    assert_eq!(body, (200, "owner,n\nvision/train-1,120\nvision/train-2,60\n".to_owned()));

    // The same over the PostgreSQL port, as a data-science user.
    let pg = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind pg");
    let port = pg.local_addr().expect("addr").port();
    let users: Arc<[PgUser]> = vec![PgUser {
        name: "ds-analyst".into(),
        password: "ds-pass-0123".into(),
        role: Role::Team(TeamName::new("data-science").expect("team")),
    }]
    .into();
    tokio::spawn(apron::pg::serve(pg, engine.clone(), PgAuth::Password(users), None));
    let out = tokio::task::spawn_blocking(move || {
        let sql = "SELECT count(*), count(DISTINCT owner) FROM gpu_samples";
        let o = Command::new("psql")
            .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-U", "ds-analyst", "-d", "apron", "-X", "-A", "-t"])
            .args(["-v", "ON_ERROR_STOP=1", "-c", sql])
            .env("PGPASSWORD", "ds-pass-0123")
            .env("PGCONNECT_TIMEOUT", "10")
            .env("PGSSLMODE", "disable")
            .output()
            .expect("psql (Debian package postgresql-client; scripts/install-test-tools.sh installs it)");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).trim().to_owned()
    })
    .await
    .expect("join");
    assert_eq!(out, "120|1", "data-science's 20 minutes of windows, one owner");
}
