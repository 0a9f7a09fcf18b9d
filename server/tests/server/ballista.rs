//! Ballista in real processes: a real S3-compatible bucket (s3s-fs), two shard
//! collectors fed the known trace, a single server fed the same as the reference, a
//! Ballista scheduler and two executors (`apron ballista scheduler|executor`), and a
//! query server with `[query.ballista]` (every scan over the lake goes to the cluster:
//! `min_scan_bytes = 0`; no fallback, so a cluster failure is seen as one).
//!
//! Checked: the answers equal one server's; they were computed by the cluster (its
//! counters); a team's queries over the cluster see that team's rows only, equal to
//! the single server's scoped answers; an executor killed while a query runs yields
//! the whole answer or a `cluster_unavailable` error, never a part; a query past its
//! timeout is cancelled on the cluster (its tasks stop); the scheduler down is a clear
//! error while the lake's small tables still answer.

use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::cluster::{
    SAME, TEAM_A, VIEWER, assert_converges, get_as, lake_toml, rows, settled, ship, sql_as, start, start_query_with,
    trace,
};
use super::{poll, request};
use serde_json::{Value, json};

/// A Ballista node (`apron ballista …`), killed when dropped.
struct Node {
    child: Child,
}

impl Node {
    fn start(dir: &Path, name: &'static str, args: &[String], ready: SocketAddr) -> Node {
        let log = std::fs::File::create(dir.join(format!("{name}.log"))).expect("log");
        let child = Command::new(super::APRON)
            .arg("--log")
            .arg("info")
            .arg("ballista")
            .args(args)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("apron ballista starts");
        let mut node = Node { child };
        poll(&format!("{name} to listen on {ready}"), Duration::from_secs(60), || {
            if let Ok(Some(status)) = node.child.try_wait() {
                let log = std::fs::read_to_string(dir.join(format!("{name}.log"))).unwrap_or_default();
                panic!("{name} exited with {status}: {log}");
            }
            TcpStream::connect_timeout(&ready, Duration::from_millis(200)).ok()
        });
        node
    }

    /// SIGKILL: no goodbye to the scheduler.
    fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// On a failing test, the tail of every node's log: what the cluster did is the only
/// way to tell a CI failure's cause.
struct LogsOnPanic<'a>(&'a Path);

impl Drop for LogsOnPanic<'_> {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        for name in ["scheduler", "executor-1", "executor-2", "bquery"] {
            let log = std::fs::read_to_string(self.0.join(format!("{name}.log"))).unwrap_or_default();
            // Each task and each finished job's clean-up logs a line: left in, they
            // push what went wrong out of the tail.
            let chatter = ["Execute task", "Finished task", "Remove data for job"];
            let lines: Vec<&str> = log
                .lines()
                .filter(|l| !chatter.iter().any(|c| l.contains(c)))
                .map(|l| l.split_once(" log.target=").map_or(l, |(head, _)| head))
                .collect();
            let tail = lines[lines.len().saturating_sub(80)..].join("\n");
            eprintln!("---- {name}.log (last 80 lines but per-task ones) ----\n{tail}");
        }
    }
}

fn local(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

fn executor(dir: &Path, name: &'static str, config: &Path, scheduler: u16) -> Node {
    let (flight, grpc) = (apron_test_support::free_port(), apron_test_support::free_port());
    let work = dir.join(name);
    std::fs::create_dir_all(&work).expect("work dir");
    let args: Vec<String> = [
        "executor",
        "--config",
        &config.display().to_string(),
        "--scheduler",
        &format!("df://127.0.0.1:{scheduler}"),
        "--bind",
        &format!("127.0.0.1:{flight}"),
        "--grpc-port",
        &grpc.to_string(),
        "--external-host",
        "127.0.0.1",
        "--vcores",
        "2",
        "--memory-limit-bytes",
        &(512u64 << 20).to_string(),
        "--work-dir",
        &work.display().to_string(),
        "--heartbeat",
        "1s",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    Node::start(dir, name, &args, local(flight))
}

/// The query server's Ballista counters: (answered, failed).
fn cluster_counts(addr: SocketAddr) -> (u64, u64) {
    let c = get_as(addr, "/api/v1/cluster");
    let b = &c["ballista"];
    (b["answered"].as_u64().expect("answered"), b["failed"].as_u64().expect("failed"))
}

/// A SQL request's status, headers and JSON body with `token`.
fn sql_with_headers(addr: SocketAddr, token: &str, q: &str) -> (u16, String, Value) {
    let auth = format!("Bearer {token}");
    let r =
        request(addr, "POST", "/api/v1/sql", &[("authorization", &auth), ("accept", "application/json")], q.as_bytes());
    let (status, headers) = (r.status, r.headers.clone());
    (status, headers, r.json())
}

/// A SQL request's (status, body) as `VIEWER`, waiting as long as the query server's
/// own timeout (a cluster that lost an executor takes seconds to notice).
fn try_sql(addr: SocketAddr, q: &str) -> (u16, Value) {
    let auth = format!("Bearer {VIEWER}");
    let headers = [("authorization", auth.as_str()), ("accept", "application/json")];
    let r = super::try_request_within(addr, "POST", "/api/v1/sql", &headers, q.as_bytes(), Duration::from_secs(90))
        .unwrap_or_else(|e| panic!("{q}: {e}"));
    let status = r.status;
    (status, r.json())
}

/// A failed answer is whole too: the cluster's clear error, or the query's timeout.
fn assert_clear_error(status: u16, body: &Value) {
    let code = body["code"].as_str();
    assert!(
        (status, code) == (503, Some("cluster_unavailable")) || (status, code) == (504, Some("timeout")),
        "{status}: {body}"
    );
}

#[test]
fn a_query_server_runs_its_heavy_scans_on_ballista() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _logs = LogsOnPanic(dir.path());
    let Some(s3) = apron_test_support::S3Server::start(&dir.path().join("s3")) else { return };
    let port = s3.port;
    let rack_a = start(dir.path(), "rack-a", Some(port), Some("rack-a"));
    let rack_b = start(dir.path(), "rack-b", Some(port), Some("rack-b"));
    let single = start(dir.path(), "single", None, None);

    // The Ballista nodes read the same lake section as the query server.
    let node_config = dir.path().join("ballista.toml");
    std::fs::write(&node_config, lake_toml(port)).expect("node config");
    let sched_port = apron_test_support::free_port();
    let scheduler_args: Vec<String> = [
        "scheduler",
        "--config",
        &node_config.display().to_string(),
        "--bind",
        &format!("127.0.0.1:{sched_port}"),
        "--external-host",
        "127.0.0.1",
        "--executor-timeout",
        "4s",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let scheduler = Node::start(dir.path(), "scheduler", &scheduler_args, local(sched_port));
    let e1 = executor(dir.path(), "executor-1", &node_config, sched_port);
    let e2 = executor(dir.path(), "executor-2", &node_config, sched_port);
    let query = start_query_with(
        dir.path(),
        "bquery",
        port,
        &format!(
            "[query.ballista]\nscheduler = \"df://127.0.0.1:{sched_port}\"\nmin_scan_bytes = 0\nfallback_local = false\n"
        ),
    );

    for (agent, rows) in trace() {
        let collector = if agent.starts_with('a') { rack_a.addr } else { rack_b.addr };
        ship(collector, agent, &rows);
        ship(single.addr, agent, &rows);
    }
    let expected = settled(single.addr, "the single server's ledger");
    // The raw-table statements (gpu_samples, allocations) run on the cluster; the
    // derived tables merged from the shards' records run on the query server.
    assert_converges(query.addr, &expected, "the query server over Ballista");
    let (answered, failed) = cluster_counts(query.addr);
    assert!(answered >= 3 && failed == 0, "the cluster answered {answered}, failed {failed}");
    for (q, on_cluster) in [(SAME[0], true), (SAME[2], true), (SAME[5], true), (SAME[1], false), (SAME[4], false)] {
        let (status, headers, _) = sql_with_headers(query.addr, VIEWER, q);
        assert_eq!((status, headers.contains("apron-engine: ballista")), (200, on_cluster), "{q}: {headers}");
    }

    // Team scoping over the cluster: the scope is part of the shipped plan.
    for q in [
        "SELECT gpu_uuid, count(*) AS n, CAST(sum(sm_active) AS VARCHAR) AS sm FROM gpu_samples GROUP BY 1 ORDER BY 1",
        "SELECT gpu_uuid, team, owner FROM allocations ORDER BY 1, 3",
        "SELECT count(*) AS n FROM gpu_samples s JOIN allocations a ON s.gpu_uuid = a.gpu_uuid",
    ] {
        let (status, headers, body) = sql_with_headers(query.addr, TEAM_A, q);
        assert_eq!((status, headers.contains("apron-engine: ballista")), (200, true), "on the cluster: {q}: {body}");
        let scoped = body["rows"].clone();
        assert_eq!(scoped, sql_as(single.addr, TEAM_A, q)["rows"], "{q}");
        assert_ne!(scoped, rows(single.addr, q), "the scope removed rows: {q}");
        assert!(!scoped.to_string().contains("GPU-B1") && !scoped.to_string().contains("team-b"), "{q}: {scoped}");
    }
    // Each side of a join is a scope shuffled over two tasks, on either executor: the
    // tasks split the scope's rows, never read them all twice (Ballista narrows each
    // task's plan to its partitions; the scope is one partition there). Repeated, as
    // where the tasks run varies.
    let join = "SELECT count(*) AS n FROM gpu_samples s JOIN allocations a ON s.gpu_uuid = a.gpu_uuid";
    let once = sql_as(single.addr, TEAM_A, join)["rows"].clone();
    for _ in 0..8 {
        assert_eq!(sql_as(query.addr, TEAM_A, join)["rows"], once, "{join}");
    }

    // An executor killed while a query runs: the whole answer or a clear error.
    let heavy = "SELECT count(*) AS n FROM gpu_samples a JOIN gpu_samples b ON a.gpu_uuid = b.gpu_uuid AND a.sm_active >= b.sm_active";
    let whole = rows(single.addr, heavy);
    let addr = query.addr;
    let running = std::thread::spawn(move || try_sql(addr, heavy));
    std::thread::sleep(Duration::from_millis(300));
    e2.kill9();
    let (status, body) = running.join().expect("query thread");
    eprintln!("the query the kill hit: {status} {}", body["code"]);
    match status {
        200 => assert_eq!(body["rows"], whole, "a whole answer"),
        _ => assert_clear_error(status, &body),
    }
    // Whatever the cluster does while it notices, no answer is ever partial; once the
    // lost executor is expired (4 s), the remaining one answers. A query caught in
    // that may wait out the query server's timeout (60 s) once.
    let mut whole_in_a_row = 0;
    let started = std::time::Instant::now();
    poll("the cluster to answer with one executor", Duration::from_secs(150), || {
        let (status, body) = try_sql(query.addr, SAME[0]);
        eprintln!("after the kill, {:?}: {status} {}", started.elapsed(), body["code"]);
        if status == 200 {
            assert_eq!(body["rows"], expected[0], "never a partial answer");
            whole_in_a_row += 1;
        } else {
            assert_clear_error(status, &body);
            whole_in_a_row = 0;
        }
        (whole_in_a_row >= 2).then_some(())
    });

    // A query past the query server's timeout is cancelled on the cluster: the
    // scheduler drops the job and the executors abort its tasks, giving their threads
    // back (left running, the job would hold the task slots the next queries wait
    // for). Endless: three-way self-join per GPU, whose join would never yield but for
    // the scheduler's `YieldInJoins` (an executor aborts a task at its next yield).
    // Last, so that a slow abort on a loaded machine cannot hold up the checks above.
    // The timeout leaves room for a slow submission.
    let quick = start_query_with(
        dir.path(),
        "bquick",
        port,
        &format!(
            "[query]\ntimeout = \"15s\"\n[query.ballista]\nscheduler = \"df://127.0.0.1:{sched_port}\"\nmin_scan_bytes = 0\nfallback_local = false\n"
        ),
    );
    let endless = "SELECT count(*) AS n FROM gpu_samples a JOIN gpu_samples b ON a.gpu_uuid = b.gpu_uuid \
                   JOIN gpu_samples c ON b.gpu_uuid = c.gpu_uuid";
    let (status, body) = try_sql(quick.addr, endless);
    assert_eq!((status, body["code"].as_str()), (504, Some("timeout")), "{body}");
    let log = |name: &str| std::fs::read_to_string(dir.path().join(format!("{name}.log"))).unwrap_or_default();
    poll("the timed-out query's tasks to stop on the cluster", Duration::from_secs(30), || {
        let executors = log("executor-1") + &log("executor-2");
        (log("bquick").contains("cancelled a cluster job")
            && log("scheduler").contains("Received cancellation request for job")
            && executors.contains("Cancelling tasks for")
            && executors.contains("Task has been aborted"))
        .then_some(())
    });
    drop(quick);

    // The scheduler down: the cluster's queries fail clearly (no fallback configured);
    // what runs on the query server still answers.
    scheduler.kill9();
    let (status, body) = try_sql(query.addr, SAME[5]);
    assert_eq!((status, body["code"].as_str()), (503, Some("cluster_unavailable")), "{body}");
    assert!(body["detail"].as_str().is_some_and(|d| d.contains("fallback_local")), "{body}");
    assert_eq!(rows(query.addr, SAME[4]), expected[4], "gpu_cost_hourly runs on the query server");
    assert!(cluster_counts(query.addr).1 >= 1, "the failure counted");
    assert_eq!(
        get_as(query.addr, "/api/v1/cluster")["ballista"]["scheduler"],
        json!(format!("df://127.0.0.1:{sched_port}"))
    );
    drop(e1);
}
