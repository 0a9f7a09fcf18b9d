//! End-to-end tests of the `apron` binary (and the real `apron-agent` binary where an
//! agent is needed).
//!
//! Every server binds port 0 (or a port just found free) and readiness is polled; the
//! only sleeps are the random kill points of the kill -9 loop. The data directory is
//! read back with `Store::open` after the server has stopped, so what is counted is what
//! a restart would see.
//!
//! One test binary for the crate: the rollup and the cost ledger/report tests are its
//! modules.

#[path = "server/access.rs"]
mod access;
#[path = "server/adversarial.rs"]
mod adversarial;
#[path = "server/ballista.rs"]
mod ballista;
#[path = "server/cluster.rs"]
mod cluster;
#[path = "server/config_examples.rs"]
mod config_examples;
#[path = "server/cost.rs"]
mod cost;
#[path = "server/fairness.rs"]
mod fairness;
#[path = "server/fuzz_regressions.rs"]
mod fuzz_regressions;
#[path = "server/handover.rs"]
mod handover;
#[path = "server/hardening.rs"]
mod hardening;
#[path = "server/idle_rule.rs"]
mod idle_rule;
#[path = "server/import.rs"]
mod import;
#[path = "server/incremental.rs"]
mod incremental;
#[path = "server/insights.rs"]
mod insights;
#[path = "server/leaks.rs"]
mod leaks;
#[path = "server/live_holders.rs"]
mod live_holders;
#[path = "server/pg_binding.rs"]
mod pg_binding;
#[path = "server/pg_clients.rs"]
mod pg_clients;
#[path = "server/pg_limits.rs"]
mod pg_limits;
#[path = "server/prom_remote.rs"]
mod prom_remote;
#[path = "server/report_exact.rs"]
mod report_exact;
#[path = "server/rollup.rs"]
mod rollup;
#[path = "server/schedule.rs"]
mod schedule;
#[path = "server/transport.rs"]
mod transport;

use std::collections::HashMap;
use std::io::{BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use apron_collector::{Store, StoreConfig, Table};
use apron_common::wire::{encode_ipc, processes_to_batch, windows_to_batch};
use apron_common::{Field, FieldStats, GpuIdentity, GpuUuid, GpuWindow, HostName, ProcessRow, UnixMicros};
use apron_test_support::{KillOnDrop, dechunk, free_port, poll, spawn_listening};
use arrow_array::RecordBatch;
use arrow_array::cast::AsArray;
use arrow_array::types::TimestampMicrosecondType;
use serde_json::Value;

const APRON: &str = env!("CARGO_BIN_EXE_apron");
const TOKEN: &str = "test-ingest-token-0123456789abcdef";

/// target/<profile>/apron-agent, built here when it is missing (`cargo test` builds only
/// this package's binaries; scripts/test.sh builds the agent first), so that
/// `cargo test -p apron` works on its own.
fn agent_bin() -> PathBuf {
    static BUILD: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let dir = Path::new(APRON).parent().expect("binary has a directory");
    let p = dir.join("apron-agent");
    let _one_build = BUILD.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if !p.exists() {
        let target = dir.parent().expect("target directory");
        let mut cargo = Command::new(env!("CARGO"));
        cargo.args(["build", "--quiet", "-p", "apron-agent", "--bin", "apron-agent", "--target-dir"]).arg(target);
        if dir.file_name().is_some_and(|n| n == "release") {
            cargo.arg("--release");
        }
        let status = cargo.status().expect("cargo runs");
        assert!(status.success() && p.exists(), "building {} failed ({status})", p.display());
    }
    p
}

unsafe extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc_kill(child.id() as i32, sig) };
}

fn now_us() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").as_micros() as i64
}

// ───────────────────────────── HTTP ─────────────────────────────

#[derive(Debug)]
struct Reply {
    status: u16,
    headers: String,
    body: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {self:?}"))
    }
}

/// One HTTP/1.1 request. The body is written on its own thread while the answer is read,
/// so a server that answers early (413) and closes is still heard. `Err` when the
/// connection failed before a status line arrived.
fn try_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<Reply, String> {
    try_request_within(addr, method, path, headers, body, Duration::from_secs(20))
}

/// [`try_request`] waiting up to `timeout` between reads of the answer.
fn try_request_within(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> Result<Reply, String> {
    let mut s = TcpStream::connect(addr).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        head += &format!("{k}: {v}\r\n");
    }
    head += &format!("Content-Length: {}\r\n\r\n", body.len());
    s.write_all(head.as_bytes()).map_err(|e| e.to_string())?;
    let mut w = s.try_clone().map_err(|e| e.to_string())?;
    let body = body.to_vec();
    let writer = std::thread::spawn(move || {
        let _ = w.write_all(&body);
    });
    let mut raw = Vec::new();
    let read = s.read_to_end(&mut raw);
    let _ = writer.join();
    let text = String::from_utf8_lossy(&raw).into_owned();
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        return Err(format!("no answer ({read:?}): {text:?}"));
    };
    let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).ok_or_else(|| text.clone())?;
    let headers = head.to_ascii_lowercase();
    let body = if headers.contains("transfer-encoding: chunked") { dechunk(body) } else { body.to_owned() };
    Ok(Reply { status, headers, body })
}

fn request(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
    try_request(addr, method, path, headers, body).unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

fn get(addr: SocketAddr, path: &str) -> Reply {
    request(addr, "GET", path, &[], b"")
}

/// The protocol headers of one batch (docs/ingest.md).
fn ingest_headers<'a>(
    table: &'a str,
    agent: &'a str,
    epoch: &'a str,
    seq: &'a str,
    auth: &'a str,
) -> Vec<(&'a str, &'a str)> {
    vec![
        ("Authorization", auth),
        ("Content-Type", "application/vnd.apache.arrow.stream"),
        ("x-apron-table", table),
        ("x-apron-agent", agent),
        ("x-apron-epoch", epoch),
        ("x-apron-sequence", seq),
    ]
}

fn bearer() -> String {
    format!("Bearer {TOKEN}")
}

/// The sum of a family's samples whose line contains `filter` (e.g. a label), `None`
/// when there is none.
fn metric(text: &str, name: &str, filter: &str) -> Option<f64> {
    let values: Vec<f64> = text
        .lines()
        .filter(|l| l.strip_prefix(name).is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{')))
        .filter(|l| l.contains(filter))
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

// ───────────────────────────── batches ─────────────────────────────

fn identity(uuid: &str) -> GpuIdentity {
    GpuIdentity::gpu(
        HostName::new("test-host").expect("host"),
        GpuUuid::new(uuid).expect("uuid"),
        0,
        "NVIDIA H100 80GB HBM3",
    )
}

/// A `gpu_samples` batch with one row per `(uuid, time)` marker.
fn samples(markers: &[(String, i64)]) -> RecordBatch {
    let rows: Vec<GpuWindow> = markers
        .iter()
        .map(|(uuid, t)| {
            let mut w = GpuWindow::new(UnixMicros(*t), Duration::from_secs(1), identity(uuid));
            let v = (*t % 10_000) as f64 / 10_000.0;
            w.fields[Field::GpuUtil.index()] = Some(FieldStats::single(v));
            w
        })
        .collect();
    windows_to_batch(&rows).expect("batch")
}

fn samples_body(markers: &[(String, i64)]) -> Vec<u8> {
    encode_ipc(&samples(markers)).expect("encode")
}

/// A `python` process using 1 GiB and half the SMs of `uuid` on `host` at `t_us`.
fn process(t_us: i64, host: &str, uuid: &str, pid: u32, user: Option<&str>) -> ProcessRow {
    ProcessRow {
        time: UnixMicros(t_us),
        host: HostName::new(host).expect("host"),
        gpu_uuid: GpuUuid::new(uuid).expect("uuid"),
        pid,
        process_name: Some("python".into()),
        user: user.map(str::to_owned),
        fb_used_bytes: Some(1 << 30),
        sm_util: Some(0.5),
        container_id: None,
        pod: None,
        namespace: None,
        container: None,
        pod_uid: None,
        job_id: None,
    }
}

fn processes_body() -> Vec<u8> {
    let row = process(now_us(), "test-host", "GPU-p", 42, None);
    encode_ipc(&processes_to_batch(&[row]).expect("batch")).expect("encode")
}

// ───────────────────────────── processes ─────────────────────────────

struct ServerProc {
    child: Child,
    addr: SocketAddr,
    stderr: PathBuf,
    _stdout: BufReader<ChildStdout>,
}

/// `[server]`, `[ingest]` with the test token, `[storage]` in `data`; `extra` is
/// appended to `[ingest]`, `storage` to `[storage]`.
fn write_config(dir: &Path, data: &Path, extra: &str, storage: &str) -> PathBuf {
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[ingest]\ntokens = [{TOKEN:?}]\n{extra}\n[storage]\ndata_dir = {:?}\n{storage}\n",
        data.display().to_string()
    );
    let path = dir.join("apron.toml");
    std::fs::write(&path, text).expect("write config");
    path
}

/// `struct rlimit` of Linux.
#[repr(C)]
struct RLimit {
    cur: u64,
    max: u64,
}

unsafe extern "C" {
    #[link_name = "setrlimit"]
    fn libc_setrlimit(resource: i32, limit: *const RLimit) -> i32;
}

/// Linux's `RLIMIT_DATA`: private writable memory (heap, anonymous maps, thread stacks).
const RLIMIT_DATA: i32 = 2;

impl ServerProc {
    /// `apron serve --config CONFIG ARGS…`, waiting for its "listening on" line.
    fn start(config: &Path, args: &[&str], log: &Path) -> ServerProc {
        ServerProc::start_limited(config, args, log, None)
    }

    /// [`ServerProc::start`] with the server's data memory capped at `data_limit` bytes
    /// (`RLIMIT_DATA`): a resource test that gets past the server's own limits makes
    /// the server fail an allocation (and the test), never the machine run out.
    fn start_limited(config: &Path, args: &[&str], log: &Path, data_limit: Option<u64>) -> ServerProc {
        let mut command = Command::new(APRON);
        if let Some(limit) = data_limit {
            use std::os::unix::process::CommandExt;
            let limit = RLimit { cur: limit, max: limit };
            // SAFETY: setrlimit is async-signal-safe and `limit` outlives the call; the
            // closure runs in the forked child before exec.
            unsafe {
                command.pre_exec(move || {
                    if libc_setrlimit(RLIMIT_DATA, &limit) == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
                });
            }
        }
        command
            .arg("serve")
            .arg("--config")
            .arg(config)
            .args(args)
            .env_remove("APRON_INGEST_TOKEN")
            .env_remove("APRON_HTTP")
            .env_remove("APRON_DATA")
            .stderr(std::fs::OpenOptions::new().create(true).append(true).open(log).expect("log file"));
        let (child, addr, stdout) = spawn_listening(&mut command, "apron serve", log);
        ServerProc { child, addr, stderr: log.to_owned(), _stdout: stdout }
    }

    fn metrics(&self) -> String {
        let r = get(self.addr, "/metrics");
        assert_eq!(r.status, 200, "{r:?}");
        r.body
    }

    /// SIGTERM: a clean stop (drain, persist). Returns the log.
    fn stop(mut self) -> String {
        signal(&self.child, 15);
        let status = poll("apron exit", Duration::from_secs(30), || self.child.try_wait().ok().flatten());
        let log = std::fs::read_to_string(&self.stderr).unwrap_or_default();
        assert!(status.success(), "apron exited with {status}\n{log}");
        log
    }

    fn kill9(mut self) {
        signal(&self.child, 9);
        let _ = self.child.wait();
    }
}

impl Drop for ServerProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct AgentProc {
    child: Child,
    addr: SocketAddr,
    stderr: PathBuf,
}

impl AgentProc {
    /// The real agent on the simulator, shipping to `collector` every second; the token
    /// comes from APRON_COLLECTOR_TOKEN, the spool and flush settings from a file.
    fn start(dir: &Path, collector: &str, windows_out: &Path) -> AgentProc {
        AgentProc::start_with(dir, collector, windows_out, "")
    }

    /// [`AgentProc::start`] with more `[shipper]` settings (`ca_file = …`).
    fn start_with(dir: &Path, collector: &str, windows_out: &Path, shipper: &str) -> AgentProc {
        let config = dir.join("agent.toml");
        std::fs::write(
            &config,
            format!(
                "[samplers]\nprocesses = \"1s\"\n[shipper]\nspool_dir = {:?}\nflush_interval = \"1s\"\nrequest_timeout = \"2s\"\nmax_backoff = \"500ms\"\n{shipper}",
                dir.join("spool").display().to_string()
            ),
        )
        .expect("write agent config");
        let stderr = dir.join("agent.log");
        let mut command = Command::new(agent_bin());
        command
            .args(["--source", "sim", "--collector", collector, "--hostname", "t", "--listen", "127.0.0.1:0"])
            .arg("--config")
            .arg(&config)
            .arg("--windows-out")
            .arg(windows_out)
            .env("APRON_COLLECTOR_TOKEN", TOKEN)
            .stderr(std::fs::File::create(&stderr).expect("agent log"));
        let (child, addr, _) = spawn_listening(&mut command, "apron-agent", &stderr);
        AgentProc { child, addr, stderr }
    }

    fn metrics(&self) -> String {
        get(self.addr, "/metrics").body
    }

    fn stop(mut self) -> String {
        signal(&self.child, 15);
        let status = poll("agent exit", Duration::from_secs(30), || self.child.try_wait().ok().flatten());
        let log = std::fs::read_to_string(&self.stderr).unwrap_or_default();
        assert!(status.success(), "apron-agent exited with {status}\n{log}");
        log
    }
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ───────────────────────────── reading the store ─────────────────────────────

#[derive(Debug, Default)]
struct Contents {
    rows: HashMap<Table, usize>,
    /// Rows still in memory (WAL replay) after the open.
    memory_rows: usize,
    /// (gpu_uuid, time) of every gpu_samples row → how often it is stored.
    markers: HashMap<(String, i64), usize>,
    parquet_files: usize,
}

fn add_markers(c: &mut Contents, batch: &RecordBatch) {
    let uuid = batch.column_by_name("gpu_uuid").expect("gpu_uuid").as_string::<i32>();
    let time = batch.column_by_name("time").expect("time").as_primitive::<TimestampMicrosecondType>();
    for i in 0..batch.num_rows() {
        *c.markers.entry((uuid.value(i).to_owned(), time.value(i))).or_default() += 1;
    }
}

fn parquet_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            parquet_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "parquet") {
            out.push(p);
        }
    }
}

/// Opens the store in `data` (recovery included), reads every row of both tables from
/// memory and Parquet, and reads every Parquet file under the table directories in full.
fn read_store(data: &Path) -> Contents {
    let store = Store::open(StoreConfig { data_dir: data.to_owned(), ..StoreConfig::default() })
        .unwrap_or_else(|e| panic!("the store in {} opens: {e}", data.display()));
    let mut c = Contents::default();
    for table in [Table::GpuSamples, Table::GpuProcesses] {
        let view = store.view(table);
        let mut rows = 0;
        for b in &view.widened().expect("widen") {
            rows += b.num_rows();
            c.memory_rows += b.num_rows();
            if table == Table::GpuSamples {
                add_markers(&mut c, b);
            }
        }
        let mut on_disk = Vec::new();
        parquet_files(&data.join(table.name()), &mut on_disk);
        on_disk.sort();
        let mut published: Vec<PathBuf> = view.files.iter().map(|f| f.path.clone()).collect();
        published.sort();
        assert_eq!(on_disk, published, "{}: every Parquet file on disk is published, and no other", table.name());
        for path in &on_disk {
            let file = std::fs::File::open(path).expect("open parquet");
            let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
                .unwrap_or_else(|e| panic!("{} is not readable: {e}", path.display()))
                .build()
                .expect("reader");
            for b in reader {
                let b = b.unwrap_or_else(|e| panic!("{} is not readable: {e}", path.display()));
                rows += b.num_rows();
                if table == Table::GpuSamples {
                    add_markers(&mut c, &b);
                }
            }
        }
        c.parquet_files += on_disk.len();
        c.rows.insert(table, rows);
    }
    c
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for e in std::fs::read_dir(from).expect("read dir").flatten() {
        let (src, dst) = (e.path(), to.join(e.file_name()));
        if src.is_dir() {
            copy_dir(&src, &dst);
        } else {
            std::fs::copy(&src, &dst).expect("copy");
        }
    }
}

// ───────────────────────────── tests ─────────────────────────────

/// (a) The real agent ships both tables to the real server; a SIGTERM persists; the
/// store holds exactly the rows the server counted.
#[test]
fn agent_round_trip_is_durable() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let config = write_config(dir.path(), &data, "", "");
    let server = ServerProc::start(&config, &[], &dir.path().join("apron.log"));
    let agent = AgentProc::start(dir.path(), &format!("http://{}", server.addr), &dir.path().join("windows.jsonl"));
    poll("rows of both tables at the server", Duration::from_secs(20), || {
        let m = server.metrics();
        (metric(&m, "apron_ingest_rows_total", "gpu_samples")? > 0.0
            && metric(&m, "apron_ingest_rows_total", "gpu_processes")? > 0.0)
            .then_some(())
    });
    let agent_log = agent.stop();
    let m = server.metrics();
    let samples = metric(&m, "apron_ingest_rows_total", "gpu_samples").expect("samples") as usize;
    let processes = metric(&m, "apron_ingest_rows_total", "gpu_processes").expect("processes") as usize;
    assert!(metric(&m, "apron_ingest_requests_total", "status=\"200\"").expect("200s") >= 2.0, "{m}");
    assert_eq!(
        metric(&m, "apron_ingest_requests_total", ""),
        metric(&m, "apron_ingest_requests_total", "\"200\""),
        "only 200s:\n{m}\n{agent_log}"
    );
    assert!(m.contains("apron_agent_clock_skew_seconds{agent=\"t\"}"), "{m}");
    assert!(metric(&m, "apron_memtable_rows", "gpu_samples").is_some(), "{m}");
    assert!(metric(&m, "apron_wal_bytes", "").expect("wal gauge") > 0.0, "{m}");
    let health = get(server.addr, "/healthz");
    assert_eq!((health.status, health.json()["status"].as_str()), (200, Some("ok")));
    let server_addr = server.addr;
    let log = server.stop();
    assert!(log.contains(&format!("serving http://{}", server_addr)), "the bound address is logged: {log}");
    assert!(log.contains("persisted the memtable to Parquet"), "{log}");

    assert!(data.join("wal").is_dir() && data.join("checkpoint.json").is_file(), "WAL and checkpoint exist");
    let c = read_store(&data);
    assert!(c.parquet_files >= 2, "one file per table at least: {c:?}");
    assert_eq!(c.memory_rows, 0, "a clean stop persisted everything");
    assert_eq!(c.rows[&Table::GpuSamples], samples);
    assert_eq!(c.rows[&Table::GpuProcesses], processes);
    assert!(c.markers.values().all(|&n| n == 1), "no row twice");
}

/// (b) Without the token, or with a wrong one: 401, the contract's error body.
#[test]
fn ingest_requires_the_token() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let server = ServerProc::start(&write_config(dir.path(), &data, "", ""), &[], &dir.path().join("apron.log"));
    let body = samples_body(&[("GPU-a".into(), now_us())]);
    for auth in ["", "Bearer wrong-token", "Bearer ", "Basic dGVzdDp0ZXN0", &format!("Bearer {TOKEN}x")] {
        let mut h = ingest_headers("gpu_samples", "a", "e1", "1", auth);
        if auth.is_empty() {
            h.remove(0);
        }
        let r = request(server.addr, "POST", "/api/v1/ingest", &h, &body);
        assert_eq!(r.status, 401, "{auth:?}: {r:?}");
        let j = r.json();
        assert_eq!(j["error"], "unauthorized");
        assert!(j["detail"].as_str().is_some_and(|d| !d.is_empty()), "{j}");
        assert!(r.headers.contains("www-authenticate: bearer"), "{r:?}");
    }
    let m = server.metrics();
    assert_eq!(metric(&m, "apron_ingest_requests_total", "\"401\""), Some(5.0), "{m}");
    server.stop();
    let c = read_store(&data);
    assert_eq!(c.rows.values().sum::<usize>(), 0);
}

#[test]
fn sql_on_serve_needs_its_token() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let log = dir.path().join("apron.log");
    // No SQL token configured: every SQL request is refused.
    let server = ServerProc::start(&write_config(dir.path(), &data, "", ""), &[], &log);
    let r = request(server.addr, "POST", "/api/v1/sql", &[], b"SELECT 1");
    assert_eq!(r.status, 401, "{r:?}");
    server.stop();
    // With one: wrong or missing tokens 401, the right one answers.
    let config = write_config(dir.path(), &data, "[sql]\ntokens = [\"sql-token-0123456789abcdef\"]", "");
    let server = ServerProc::start(&config, &[], &log);
    let r = request(server.addr, "POST", "/api/v1/sql", &[("authorization", "Bearer wrong")], b"SELECT 1");
    assert_eq!(r.status, 401, "{r:?}");
    let ok = [("authorization", "Bearer sql-token-0123456789abcdef"), ("accept", "text/csv")];
    let r = request(server.addr, "POST", "/api/v1/sql", &ok, b"SELECT count(*) AS n FROM gpu_samples");
    assert_eq!((r.status, r.body.trim()), (200, "n\n0"), "{r:?}");
    let r = request(server.addr, "POST", "/api/v1/sql", &[ok[0], ("accept", "image/png")], b"SELECT 1");
    assert_eq!(r.status, 406, "{r:?}");
    server.stop();
}

/// psql (Debian's client) against `apron serve`'s `[pg]` port: the configured user and
/// password answer, a wrong password or user is refused, writes get SQLSTATE 25006.
#[test]
fn psql_on_serve_needs_a_pg_user_and_is_read_only() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let log = dir.path().join("apron.log");
    let port = free_port();
    let secret = dir.path().join("pg-grafana");
    std::fs::write(&secret, "grafana-pass-0123\n").expect("secret");
    let extra = format!(
        "[pg]\nlisten = \"127.0.0.1:{port}\"\nusers = [{{ name = \"grafana\", password_file = {:?} }}]",
        secret.display().to_string()
    );
    let server = ServerProc::start(&write_config(dir.path(), &data, &extra, ""), &[], &log);
    let psql = |user: &str, password: &str, sql: &str| {
        Command::new("psql")
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &port.to_string(),
                "-U",
                user,
                "-d",
                "apron",
                "-X",
                "-A",
                "-t",
                "-v",
                "ON_ERROR_STOP=1",
                "-c",
                sql,
            ])
            .env("PGPASSWORD", password)
            .env("PGCONNECT_TIMEOUT", "10")
            .output()
            .expect("psql (Debian package postgresql-client; scripts/install-test-tools.sh installs it)")
    };
    let ok = poll("psql to connect", Duration::from_secs(20), || {
        let o = psql("grafana", "grafana-pass-0123", "SELECT count(*) AS n FROM gpu_samples");
        o.status.success().then_some(o)
    });
    assert_eq!(String::from_utf8_lossy(&ok.stdout).trim(), "0");
    let bad = psql("grafana", "wrong-password", "SELECT 1");
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).to_lowercase().contains("password authentication failed"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
    assert!(!psql("mallory", "grafana-pass-0123", "SELECT 1").status.success());
    let write = psql("grafana", "grafana-pass-0123", "DROP TABLE gpu_samples");
    let err = String::from_utf8_lossy(&write.stderr).into_owned();
    assert!(!write.status.success() && err.contains("read-only"), "{err}");
    // The session chatter of BI tools is acknowledged.
    let set = psql("grafana", "grafana-pass-0123", "SET extra_float_digits = 3");
    assert!(set.status.success(), "{}", String::from_utf8_lossy(&set.stderr));
    server.stop();
}

/// (c) Missing or bad headers 400, malformed body 400, wrong schema 422, oversized body
/// and too many rows 413 — each with a message, and nothing stored.
#[test]
fn bad_input_is_refused_and_nothing_is_stored() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let config = write_config(dir.path(), &data, "max_body_bytes = \"64KiB\"", "max_rows_per_batch = 10");
    let server = ServerProc::start(&config, &[], &dir.path().join("apron.log"));
    let auth = bearer();
    let t0 = now_us();
    let good = samples_body(&[("GPU-a".into(), t0)]);
    let post = |h: &[(&str, &str)], body: &[u8]| request(server.addr, "POST", "/api/v1/ingest", h, body);
    let expect = |r: Reply, status: u16, error: &str, detail: &str| {
        assert_eq!(r.status, status, "{r:?}");
        let j = r.json();
        assert_eq!(j["error"], error, "{j}");
        let d = j["detail"].as_str().expect("detail");
        assert!(d.contains(detail), "detail {d:?} should mention {detail:?}");
    };

    let full = ingest_headers("gpu_samples", "a", "e1", "1", &auth);
    for (i, (name, _)) in full.iter().enumerate().skip(1) {
        let mut h = full.clone();
        h.remove(i);
        expect(post(&h, &good), 400, "missing_header", &name.to_ascii_lowercase());
    }
    expect(post(&ingest_headers("gpu_stuff", "a", "e1", "1", &auth), &good), 400, "unknown_table", "gpu_stuff");
    expect(
        post(&ingest_headers("gpu_samples", "a", "e1", "one", &auth), &good),
        400,
        "invalid_header",
        "x-apron-sequence",
    );
    let mut h = full.clone();
    h[1] = ("Content-Type", "application/json");
    expect(post(&h, &good), 400, "invalid_header", "content-type");
    expect(post(&full, b"this is not an Arrow IPC stream"), 400, "malformed_body", "");
    expect(post(&full, &good[..good.len() / 2]), 400, "malformed_body", "");
    // A valid gpu_processes batch labelled gpu_samples.
    expect(post(&full, &processes_body()), 422, "wrong_schema", "gpu_samples");
    // Over `max_rows_per_batch`, and over `max_body_bytes`.
    let markers: Vec<(String, i64)> = (0..11).map(|i| (format!("GPU-{i}"), t0)).collect();
    expect(post(&full, &samples_body(&markers)), 413, "too_many_rows", "10");
    expect(post(&full, &vec![0u8; 100 << 10]), 413, "body_too_large", "65536");
    // Routes that do not exist answer in the same shape.
    let r = get(server.addr, "/api/v1/nothing");
    assert_eq!((r.status, r.json()["error"].as_str()), (404, Some("not_found")));
    let r = get(server.addr, "/api/v1/ingest");
    assert_eq!((r.status, r.json()["error"].as_str()), (405, Some("method_not_allowed")), "{r:?}");

    let m = server.metrics();
    assert_eq!(metric(&m, "apron_ingest_requests_total", "\"400\""), Some(10.0), "{m}");
    assert_eq!(metric(&m, "apron_ingest_requests_total", "\"413\""), Some(2.0), "{m}");
    assert_eq!(metric(&m, "apron_ingest_requests_total", "\"422\""), Some(1.0), "{m}");
    assert_eq!(metric(&m, "apron_ingest_requests_total", "\"200\""), None, "{m}");
    server.stop();
    let c = read_store(&data);
    assert_eq!(c.rows.values().sum::<usize>(), 0, "nothing stored: {c:?}");
    assert_eq!(c.parquet_files, 0);
}

/// Sample times far from the collector's clock are flagged per direction (counter, a
/// rate-limited log line), and the gauge shows each agent's last offset.
#[test]
fn clock_skew_is_measured_and_flagged() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let log = dir.path().join("apron.log");
    let server = ServerProc::start(&write_config(dir.path(), &data, "clock_skew_threshold = \"5s\"", ""), &[], &log);
    let auth = bearer();
    let hour = 3_600_000_000;
    let sends = [("fast", 1, hour), ("fast", 2, hour + 1), ("slow", 1, -hour), ("ok", 1, 0)];
    for (agent, seq, offset) in sends {
        let body = samples_body(&[(format!("GPU-{agent}-{seq}"), now_us() + offset)]);
        let seq = seq.to_string();
        let r = request(
            server.addr,
            "POST",
            "/api/v1/ingest",
            &ingest_headers("gpu_samples", agent, "e", &seq, &auth),
            &body,
        );
        assert_eq!(r.status, 200, "{r:?}");
    }
    let m = server.metrics();
    assert_eq!(metric(&m, "apron_ingest_clock_skew_batches_total", "ahead"), Some(2.0), "{m}");
    assert_eq!(metric(&m, "apron_ingest_clock_skew_batches_total", "behind"), Some(1.0), "{m}");
    let skew =
        |agent: &str| metric(&m, "apron_agent_clock_skew_seconds", &format!("agent=\"{agent}\"")).expect("gauge");
    assert!((3590.0..3601.0).contains(&skew("fast")), "{m}");
    assert!((-3601.0..-3590.0).contains(&skew("slow")), "{m}");
    assert!(skew("ok").abs() < 5.0, "{m}");
    let text = server.stop();
    assert_eq!(text.matches("clock skew: agent fast").count(), 1, "one line per agent and minute:\n{text}");
    assert_eq!(text.matches("clock skew: agent slow").count(), 1, "{text}");
    assert!(!text.contains("clock skew: agent ok"), "{text}");
}

/// A batch of the kill -9 test: one agent's (epoch, sequence), four rows whose
/// (gpu_uuid, time) markers appear in no other batch.
struct ChaosBatch {
    agent: String,
    epoch: String,
    seq: u64,
    markers: Vec<(String, i64)>,
    body: Vec<u8>,
    acked: bool,
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*: enough to scatter kill points; the seed is printed.
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// One agent's stream: its batches in send order, a new epoch at each simulated restart.
struct ChaosAgent {
    name: String,
    batches: Vec<ChaosBatch>,
    epoch_no: u32,
    next_seq: u64,
}

impl ChaosAgent {
    fn new_batch(&mut self, base_us: i64, serial: &mut i64) -> usize {
        *serial += 1;
        let t = base_us + *serial * 1000;
        let markers: Vec<(String, i64)> = (0..4).map(|g| (format!("GPU-{}-{g}", self.name), t)).collect();
        let body = samples_body(&markers);
        self.batches.push(ChaosBatch {
            agent: self.name.clone(),
            epoch: format!(
                "0199a000-0000-7000-8000-{:012x}",
                u64::from(self.epoch_no) << 8 | u64::from(self.name.as_bytes()[0])
            ),
            seq: self.next_seq,
            markers,
            body,
            acked: false,
        });
        self.next_seq += 1;
        self.batches.len() - 1
    }

    fn restart(&mut self) {
        self.epoch_no += 1;
        self.next_seq = 1;
    }
}

/// What sending one batch showed.
enum Sent {
    Acked {
        duplicate: bool,
    },
    /// The server died (or answered something else): outcome unknown.
    Lost,
}

fn send(addr: SocketAddr, b: &ChaosBatch) -> Sent {
    let seq = b.seq.to_string();
    let auth = bearer();
    let h = ingest_headers("gpu_samples", &b.agent, &b.epoch, &seq, &auth);
    match try_request(addr, "POST", "/api/v1/ingest", &h, &b.body) {
        Ok(r) if r.status == 200 => {
            let j = r.json();
            assert_eq!(j["rows"], 4, "{j}");
            Sent::Acked { duplicate: j["duplicate"].as_bool().expect("duplicate flag") }
        }
        Ok(r) => {
            assert!(r.status >= 500, "only a storage failure may refuse a valid batch: {r:?}");
            Sent::Lost
        }
        Err(_) => Sent::Lost,
    }
}

/// Sends `agent`'s un-acked batches oldest first, then new ones, re-sending an acked
/// batch now and then (it must come back `duplicate: true`), until the server stops
/// answering or `until` passes. Returns (acks, duplicates confirmed).
fn drive(
    addr: SocketAddr,
    agent: &mut ChaosAgent,
    rng: &mut Rng,
    base_us: i64,
    serial: &mut i64,
    until: Option<Instant>,
) -> (usize, usize) {
    let (mut acks, mut dups) = (0, 0);
    loop {
        if until.is_some_and(|u| Instant::now() >= u) {
            return (acks, dups);
        }
        let acked: Vec<usize> = (0..agent.batches.len()).filter(|&i| agent.batches[i].acked).collect();
        if !acked.is_empty() && rng.below(5) == 0 {
            let i = acked[rng.below(acked.len() as u64) as usize];
            match send(addr, &agent.batches[i]) {
                Sent::Acked { duplicate } => {
                    assert!(duplicate, "an acknowledged batch re-sent must be a duplicate");
                    dups += 1;
                }
                Sent::Lost => return (acks, dups),
            }
            continue;
        }
        let i = match agent.batches.iter().position(|b| !b.acked) {
            Some(i) => i,
            None if until.is_none() => return (acks, dups),
            None => agent.new_batch(base_us, serial),
        };
        match send(addr, &agent.batches[i]) {
            Sent::Acked { .. } => {
                agent.batches[i].acked = true;
                acks += 1;
            }
            Sent::Lost => return (acks, dups),
        }
    }
}

/// Every acknowledged marker exactly once, no marker twice.
fn check_acked(c: &Contents, agents: &[ChaosAgent], when: &str) {
    if let Some((m, n)) = c.markers.iter().find(|(_, n)| **n > 1) {
        panic!("{when}: row {m:?} stored {n} times");
    }
    for b in agents.iter().flat_map(|a| &a.batches).filter(|b| b.acked) {
        for m in &b.markers {
            assert_eq!(
                c.markers.get(m),
                Some(&1),
                "{when}: acknowledged row {m:?} ({}/{}/{})",
                b.agent,
                b.epoch,
                b.seq
            );
        }
    }
}

/// (d) kill -9 at random points under concurrent ingest; after each kill every
/// acknowledged row is present exactly once and every Parquet file is readable.
/// `APRON_CHAOS_ITERATIONS` (default 20) and `APRON_CHAOS_SEED` tune it
/// (`scripts/chaos-kill.sh` runs 100).
#[test]
fn kill_9_loses_no_acknowledged_row() {
    let iterations: usize = std::env::var("APRON_CHAOS_ITERATIONS").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
    let seed: u64 =
        std::env::var("APRON_CHAOS_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or_else(|| now_us() as u64 | 1);
    eprintln!("kill -9 loop: {iterations} iterations, APRON_CHAOS_SEED={seed}");
    let mut rng = Rng(seed);
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    // Persists every 200 ms and small WAL segments, so kills also land in persists and
    // segment rolls.
    let config = write_config(dir.path(), &data, "", "persist_interval = \"200ms\"\nwal_segment_bytes = 262144");
    let log = dir.path().join("apron.log");
    let base_us = now_us() - 3_600_000_000;
    let mut agents: Vec<ChaosAgent> = ["alpha", "bravo"]
        .iter()
        .map(|n| ChaosAgent { name: (*n).into(), batches: Vec::new(), epoch_no: 0, next_seq: 1 })
        .collect();
    let mut serials = [0i64; 2];
    let (mut total_acks, mut total_dups, mut kills_mid_request) = (0, 0, 0);

    for it in 0..iterations {
        let server = ServerProc::start(&config, &[], &log);
        let addr = server.addr;
        let kill_after = Duration::from_millis(rng.below(500));
        let seeds = [rng.next() | 1, rng.next() | 1];
        let results = std::thread::scope(|s| {
            let handles: Vec<_> = agents
                .iter_mut()
                .zip(serials.iter_mut())
                .zip(seeds)
                .map(|((agent, serial), seed)| {
                    s.spawn(move || {
                        let mut rng = Rng(seed);
                        drive(addr, agent, &mut rng, base_us, serial, Some(Instant::now() + Duration::from_secs(30)))
                    })
                })
                .collect();
            // The random kill point (the one sleep that is not about readiness).
            std::thread::sleep(kill_after);
            server.kill9();
            handles.into_iter().map(|h| h.join().expect("sender")).collect::<Vec<_>>()
        });
        for (a, d) in results {
            total_acks += a;
            total_dups += d;
        }
        kills_mid_request += agents.iter().filter(|a| a.batches.last().is_some_and(|b| !b.acked)).count();
        // Check a copy (the server recovers the original at its next start).
        let copy = dir.path().join(format!("copy-{it}"));
        copy_dir(&data, &copy);
        let c = read_store(&copy);
        check_acked(&c, &agents, &format!("after kill {it}"));
        std::fs::remove_dir_all(&copy).expect("remove copy");
        if it % 5 == 4 {
            // An agent restart: the un-acked batches keep their old epoch and go first.
            agents[(it / 5) % 2].restart();
        }
    }

    // A last run re-sends everything still un-acked, then stops cleanly.
    let server = ServerProc::start(&config, &[], &log);
    for (agent, serial) in agents.iter_mut().zip(serials.iter_mut()) {
        let (a, d) = drive(server.addr, agent, &mut rng, base_us, serial, None);
        total_acks += a;
        total_dups += d;
        assert!(agent.batches.iter().all(|b| b.acked), "the running server acknowledges everything");
    }
    server.stop();
    let c = read_store(&data);
    check_acked(&c, &agents, "at the end");
    let batches: usize = agents.iter().map(|a| a.batches.len()).sum();
    assert_eq!(c.rows[&Table::GpuSamples], batches * 4, "exactly the acknowledged rows, once each");
    assert!(total_dups > 0, "some acknowledged batches were re-sent");
    eprintln!(
        "kill -9 loop: {iterations} kills ({kills_mid_request} with an un-acknowledged batch in flight), {batches} batches acknowledged ({total_acks} acks), {total_dups} re-sent acknowledged batches answered duplicate, {} Parquet files readable",
        c.parquet_files
    );
    assert!(batches >= iterations, "the loop ingested data: {batches} batches");
}

/// (e) The agent starts while the collector is down, spools, and delivers everything
/// once the server comes up on its port.
#[test]
fn collector_outage_spools_and_recovers_without_loss() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let windows_out = dir.path().join("windows.jsonl");
    let agent = AgentProc::start(dir.path(), &format!("http://127.0.0.1:{port}"), &windows_out);
    poll("batches spooled while the collector is down", Duration::from_secs(20), || {
        (metric(&agent.metrics(), "apron_agent_spool_files", "")? >= 4.0).then_some(())
    });

    let config = write_config(dir.path(), &data, "", "");
    let server = ServerProc::start(&config, &["--http", &format!("127.0.0.1:{port}")], &dir.path().join("apron.log"));
    poll("the spool drained into the server", Duration::from_secs(30), || {
        let drained = metric(&agent.metrics(), "apron_agent_spool_files", "")? == 0.0;
        (drained && metric(&server.metrics(), "apron_ingest_rows_total", "gpu_samples")? > 0.0).then_some(())
    });
    let agent_log = agent.stop();
    server.stop();

    let closed: Vec<(String, i64)> = std::fs::read_to_string(&windows_out)
        .expect("windows file")
        .lines()
        .map(|l| {
            let w: Value = serde_json::from_str(l).expect("window JSON");
            (w["gpu"]["gpu_uuid"].as_str().expect("uuid").to_owned(), w["time"].as_i64().expect("time"))
        })
        .collect();
    let c = read_store(&data);
    assert!(closed.len() > 16, "the agent closed windows: {}", closed.len());
    for m in &closed {
        assert_eq!(c.markers.get(m), Some(&1), "window {m:?} stored once\n{agent_log}");
    }
    assert_eq!(c.rows[&Table::GpuSamples], closed.len(), "nothing else stored");
}

/// (f) `apron up` on port 0: endpoints.json appears, the in-process agent (the
/// simulator, without a GPU) ships through the ingest path, and a SIGTERM persists.
#[test]
fn apron_up_serves_and_ingests_from_its_agent() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("apron-data");
    let out = dir.path().join("up.out");
    let log = dir.path().join("up.log");
    let mut child = Command::new(APRON)
        .args(["up", "--http", "127.0.0.1:0", "--pg", "127.0.0.1:0", "--backfill", "2m", "--data"])
        .arg(&data)
        .stdout(std::fs::File::create(&out).expect("stdout file"))
        .stderr(std::fs::File::create(&log).expect("log file"))
        .spawn()
        .expect("apron up starts");
    let endpoints: Value = poll("endpoints.json", Duration::from_secs(30), || {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("apron up exited with {status}\n{}", std::fs::read_to_string(&log).unwrap_or_default());
        }
        serde_json::from_str(&std::fs::read_to_string(data.join("endpoints.json")).ok()?).ok()
    });
    let url = |key: &str| -> (SocketAddr, String) {
        let u = endpoints[key].as_str().unwrap_or_else(|| panic!("endpoints.{key}: {endpoints}"));
        let rest = u.strip_prefix("http://").expect("http URL");
        let (host, path) = rest.split_once('/').map_or((rest, String::new()), |(h, p)| (h, format!("/{p}")));
        (host.parse().expect("address"), path)
    };
    let (http, _) = url("http");
    assert!(http.ip().is_loopback() && http.port() != 0, "{endpoints}");
    let (maddr, mpath) = url("metrics");
    assert_eq!((maddr, mpath.as_str()), (http, "/metrics"));
    assert_eq!(url("ingest").1, "/api/v1/ingest");
    let (aaddr, apath) = url("agent_metrics");
    assert_eq!(get(aaddr, &apath).status, 200);
    // This run's ingest token, for Prometheus' remote write: a file only its owner reads;
    // with it a write gets past authentication (an empty body is then a bad request).
    let token_file = PathBuf::from(endpoints["ingest_token_file"].as_str().expect("ingest_token_file"));
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&token_file).expect("token file").permissions().mode();
        assert_eq!(mode & 0o077, 0, "the token file is the owner's only: {mode:o}");
    }
    let token = std::fs::read_to_string(&token_file).expect("token");
    let auth = format!("Bearer {}", token.trim());
    assert_eq!(request(http, "POST", "/api/v1/write", &[], b"").status, 401);
    let r = request(http, "POST", "/api/v1/write", &[("authorization", &auth)], b"");
    assert!(r.status != 401 && r.status != 403, "the token is refused: {r:?}");

    let rows = |min: f64| {
        poll("rows ingested from the in-process agent", Duration::from_secs(30), || {
            let r = try_request(http, "GET", "/metrics", &[], b"").ok()?;
            metric(&r.body, "apron_ingest_rows_total", "gpu_samples").filter(|&n| n > min)
        })
    };
    let first = rows(0.0);
    rows(first);

    // SQL over live data: `apron sql` against the server sees the rows the agent
    // shipped (memtable included), and the count grows.
    let sql_count = || -> u64 {
        let o = Command::new(APRON)
            .args(["sql", "--format", "csv", "--server", endpoints["http"].as_str().expect("http")])
            .arg("SELECT count(*) AS n FROM gpu_samples")
            .env_remove("APRON_SQL_TOKEN")
            .output()
            .expect("apron sql runs");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        let mut lines = text.lines();
        assert_eq!(lines.next(), Some("n"), "{text}");
        lines.next().and_then(|l| l.trim().parse().ok()).unwrap_or_else(|| panic!("a count: {text}"))
    };
    // The first start seeds 2 minutes of simulated history in the background: 16 GPUs ×
    // 120 windows.
    let n1 = poll("the seeded history", Duration::from_secs(30), || {
        let n = sql_count();
        (n >= 16 * 120).then_some(n)
    });
    poll("the SQL count to grow", Duration::from_secs(30), || (sql_count() > n1).then_some(()));
    // JSON in the contract's shape, over HTTP.
    let r = request(
        http,
        "POST",
        "/api/v1/sql",
        &[("accept", "application/json")],
        b"SELECT gpu_uuid, time FROM gpu_samples ORDER BY time LIMIT 2",
    );
    assert_eq!(r.status, 200, "{r:?}");
    let j = r.json();
    assert_eq!(j["columns"][0]["name"], "gpu_uuid", "{j}");
    assert!(j["rows"][0][1].as_str().is_some_and(|t| t.ends_with('Z') && t.contains('T')), "RFC 3339 UTC: {j}");
    // Read-only, refused on the plan with a clear error.
    let r = request(http, "POST", "/api/v1/sql", &[], b"CREATE TABLE t AS SELECT 1");
    assert_eq!(r.status, 400, "{r:?}");
    assert!(r.json()["error"].as_str().is_some_and(|e| e.to_lowercase().contains("read-only")), "{r:?}");
    let r = request(http, "POST", "/api/v1/sql", &[], b"SELEC nonsense");
    assert_eq!(r.status, 400, "{r:?}");

    let printed = poll("seeded on stdout", Duration::from_secs(30), || {
        std::fs::read_to_string(&out).ok().filter(|p| p.contains("seeded "))
    });
    assert!(printed.contains(endpoints["http"].as_str().expect("http")), "{printed}");
    assert!(printed.contains("sim") || printed.contains("nvml"), "{printed}");
    let pg = endpoints["postgres"].as_str().expect("postgres");
    assert!(pg.starts_with("postgresql://apron@127.0.0.1:") && printed.contains(pg), "{printed}");
    assert!(printed.contains("psql -h 127.0.0.1 -p "), "the psql command is printed: {printed}");
    assert!(printed.contains("seeded"), "first start seeds history: {printed}");

    signal(&child, 15);
    let status = poll("apron up exit", Duration::from_secs(30), || child.try_wait().ok().flatten());
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(status.success(), "apron up exited with {status}\n{text}");
    assert!(data.join("agent-spool").is_dir(), "the agent spools under the data directory");
    let c = read_store(&data);
    assert!(c.rows[&Table::GpuSamples] as f64 > first, "{c:?}");
    assert_eq!(c.memory_rows, 0, "persisted at shutdown");
}

/// `apron up` in the background on `data` with `args`; its endpoints once written.
fn start_up(data: &Path, args: &[&str], out: &Path, log: &Path) -> (KillOnDrop, Value) {
    let mut child = Command::new(APRON)
        .args(["up", "--http", "127.0.0.1:0", "--pg", "127.0.0.1:0", "--data"])
        .arg(data)
        .args(args)
        .stdout(std::fs::File::create(out).expect("stdout file"))
        .stderr(std::fs::File::create(log).expect("log file"))
        .spawn()
        .expect("apron up starts");
    let endpoints: Value = poll("endpoints.json", Duration::from_secs(60), || {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("apron up exited with {status}\n{}", std::fs::read_to_string(log).unwrap_or_default());
        }
        serde_json::from_str(&std::fs::read_to_string(data.join("endpoints.json")).ok()?).ok()
    });
    (KillOnDrop(vec![child]), endpoints)
}

fn http_of(endpoints: &Value) -> SocketAddr {
    endpoints["http"]
        .as_str()
        .and_then(|u| u.strip_prefix("http://"))
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("{endpoints}"))
}

/// The rows of a JSON SQL answer.
fn sql_rows(http: SocketAddr, q: &str) -> Vec<Value> {
    let r = request(http, "POST", "/api/v1/sql", &[("accept", "application/json")], q.as_bytes());
    assert_eq!(r.status, 200, "{q}: {r:?}");
    r.json()["rows"].as_array().cloned().unwrap_or_default()
}

/// `apron import`s into `data` an hour of a held, idle H100 (stranded from its first
/// minute), starting `hours_ago` whole hours ago, from dcgm-exporter text.
fn import_idle_hour(dir: &Path, data: &Path, hours_ago: i64) {
    let t0 = (now_us() / 1_000_000 / 3600 - hours_ago) * 3600;
    let mut om = String::from("# TYPE DCGM_FI_DEV_GPU_UTIL gauge\n");
    for k in 0..=240 {
        om.push_str(&format!(
            "DCGM_FI_DEV_GPU_UTIL{{gpu=\"0\",UUID=\"GPU-IMP\",modelName=\"NVIDIA H100 80GB HBM3\",Hostname=\"node-0\",namespace=\"ml\",pod=\"nb\",container=\"c\"}} 0 {}\n",
            t0 + k * 15
        ));
    }
    om.push_str("# EOF\n");
    let file = dir.join("history.om");
    std::fs::write(&file, om).expect("history");
    let o = Command::new(APRON).args(["import", "--data"]).arg(data).arg(&file).output().expect("import runs");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// `apron up` on imported history (ten days old here) opens its views on the data: the
/// heatmap over the data's last 24 h and the report on the data's week, not on empty
/// recent hours and an empty week.
#[test]
fn apron_up_on_imported_history_opens_on_the_newest_data() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("imported");
    import_idle_hour(dir.path(), &data, 240);
    let (out, log) = (dir.path().join("up.out"), dir.path().join("up.log"));
    let (_child, endpoints) = start_up(&data, &["--source", "none"], &out, &log);
    let http = http_of(&endpoints);
    poll("the imported hour priced", Duration::from_secs(120), || {
        let rows = sql_rows(http, "SELECT CAST(sum(idle_cost_usd) AS VARCHAR) FROM gpu_cost_hourly");
        rows.first().and_then(|r| r[0].as_str().map(str::to_owned)).filter(|v| v != "0.000000" && !v.is_empty())
    });
    // The week the page should open on: the data's.
    let week = sql_rows(http, "SELECT to_char(max(\"hour\"), '%G-W%V') FROM gpu_cost_hourly");
    let week = week[0][0].as_str().expect("week").to_owned();
    let total = get(http, &format!("/api/v1/reports/weekly?week={week}&format=json")).json()["fleet"]["idle_cost_usd"]
        .as_f64()
        .expect("fleet idle");
    assert!(total > 0.0, "{week}: {total}");
    let shots = dir.path().join("ui");
    let o = Command::new("python3")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/ui/chromium_check.py"))
        .arg(format!("http://{http}/?refresh=0"))
        .arg(&shots)
        .arg(format!("{total:.2}"))
        .output()
        .expect("python3 runs");
    let said = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert_ne!(o.status.code(), Some(2), "{said}");
    // Without APRON_UI_HISTORY_ONLY the check requires heatmap cells: the 24 h shown are
    // the data's, and the idle dollars those of the data's week.
    assert!(o.status.success(), "the UI did not open on the imported data:\n{said}");
}

/// `apron up --source nvml` without a driver: up's own advice, and nothing left behind.
#[test]
fn apron_up_with_no_driver_says_what_to_run_and_leaves_nothing_behind() {
    // No NVIDIA driver on a test machine (the fake NVML is only loaded by path): `--source
    // nvml` fails, naming up's own way out, and leaves no WAL that would make the next
    // start skip its seed.
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("fresh");
    let o = Command::new(APRON)
        .args(["up", "--http", "127.0.0.1:0", "--pg", "127.0.0.1:0", "--source", "nvml", "--data"])
        .arg(&data)
        .env_remove("APRON_NVML_LIB")
        .output()
        .expect("apron up runs");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("apron up --source sim"), "{err}");
    assert!(!err.contains("--nvml-lib") && !err.contains("apron-agent --source"), "flags up does not have: {err}");
    assert!(!data.join("wal").exists(), "a failed first start left its WAL behind");
}

/// `apron up` never mixes the simulator into history it did not write: `--source sim`
/// is refused on an imported directory, and `auto` runs with no agent there; `--config`
/// brings `apron serve`'s price book and alert settings (and says which sections it
/// ignores); after a seed, the first alert pass runs at once, not at the next interval.
#[test]
fn apron_up_keeps_the_simulator_out_of_imported_history_and_takes_a_config() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("imported");
    import_idle_hour(dir.path(), &data, 2);

    // Asked for the simulator there: refused, saying why and what to do instead.
    let o = Command::new(APRON)
        .args(["up", "--http", "127.0.0.1:0", "--pg", "127.0.0.1:0", "--source", "sim", "--data"])
        .arg(&data)
        .output()
        .expect("apron up runs");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("node-0") && err.contains("the simulator never writes into it"), "{err}");
    assert!(err.contains("--source none"), "{err}");
    assert_eq!(err.matches("the simulator never writes").count(), 1, "said once: {err}");

    // `auto` with --config: no agent (there is no GPU here), the config's price book.
    let book = dir.path().join("prices.toml");
    std::fs::write(
        &book,
        "version = \"up-config-1\"\n[[price]]\nmodel = \"H100\"\nmatch = [\"H100 80GB HBM3\"]\nkind = \"on_demand\"\nusd_per_gpu_hour = \"3.60\"\n",
    )
    .expect("book");
    let config = dir.path().join("apron.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"0.0.0.0:9402\"\n[cost]\nprice_book = {:?}\n[alerts]\ninterval = \"1h\"\n",
            book.display().to_string()
        ),
    )
    .expect("config");
    let (out, log) = (dir.path().join("up.out"), dir.path().join("up.log"));
    let (child, endpoints) = start_up(&data, &["--config", config.to_str().expect("utf-8")], &out, &log);
    assert!(endpoints.get("agent_metrics").is_none(), "no agent: {endpoints}");
    let http = http_of(&endpoints);
    let printed = std::fs::read_to_string(&out).unwrap_or_default();
    assert!(printed.contains("GPU source     none:") && printed.contains("never writes into it"), "{printed}");
    let said = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(said.contains("sets [server], which apron up ignores"), "{said}");
    assert!(!said.contains('\u{1b}'), "no colour codes in a log file: {said}");
    // 3600 stranded seconds at the config's $3.60/h (the example book's on-prem H100
    // would price them at ~$1.54).
    let idle = poll("the imported hour priced", Duration::from_secs(120), || {
        let rows = sql_rows(http, "SELECT CAST(sum(idle_cost_usd) AS VARCHAR) FROM gpu_cost_hourly");
        rows.first().and_then(|r| r[0].as_str().map(str::to_owned)).filter(|v| v != "0.000000")
    });
    assert_eq!(idle, "3.600000");
    let hosts = sql_rows(http, "SELECT DISTINCT \"host\" FROM gpu_samples");
    assert_eq!(hosts, vec![serde_json::json!(["node-0"])], "no simulated host in imported history");

    // A port in use: the cause is said once.
    let o = Command::new(APRON)
        .args(["up", "--pg", "127.0.0.1:0", "--http", &http.to_string(), "--data"])
        .arg(dir.path().join("other"))
        .output()
        .expect("apron up runs");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains(&format!("cannot listen on {http}")), "{err}");
    assert_eq!(err.matches("(os error").count(), 1, "the cause once: {err}");
    drop(child);

    // A fresh directory with the simulator and an hourly alert pass: the stranded GPUs
    // of the seeded history fire right after the seed, not an hour later.
    let fresh = dir.path().join("fresh");
    std::fs::write(&config, "[alerts]\ninterval = \"1h\"\n").expect("config");
    let (out, log) = (dir.path().join("up2.out"), dir.path().join("up2.log"));
    let args = ["--source", "sim", "--backfill", "1h", "--config", config.to_str().expect("utf-8")];
    let (_child, endpoints) = start_up(&fresh, &args, &out, &log);
    let http = http_of(&endpoints);
    poll("a stranded alert after the seed", Duration::from_secs(120), || {
        let r = try_request(http, "GET", "/api/v1/alerts", &[], b"").ok()?;
        let j: Value = serde_json::from_str(&r.body).ok()?;
        j["alerts"].as_array()?.iter().find(|a| a["kind"] == "stranded_allocation" && a["state"] == "firing").cloned()
    });
}

/// Micro-dollars of a Decimal(…, 6) rendered as text ("12.345678", "-0.5", NULL → 0).
fn micros(v: &Value) -> i64 {
    let s = v.as_str().unwrap_or("0");
    let (neg, s) = s.strip_prefix('-').map_or((false, s), |r| (true, r));
    let (int, frac) = s.split_once('.').unwrap_or((s, ""));
    let frac = format!("{frac:0<6}");
    let m = int.parse::<i64>().unwrap_or(0) * 1_000_000 + frac[..6].parse::<i64>().unwrap_or(0);
    if neg { -m } else { m }
}

/// Cents, rounded half-even, of micro-dollars (the report's rule).
fn cents(m: i64) -> i64 {
    let (q, r) = (m.div_euclid(10_000), m.rem_euclid(10_000));
    if r > 5_000 || (r == 5_000 && q % 2 != 0) { q + 1 } else { q }
}

/// Issue "idle cost": on `apron up`'s simulated fleet the week's report shows stranded
/// and unallocated idle dollars for the simulated organisation's teams, and they equal
/// what SQL over `gpu_cost_hourly` gives (each team line = its rows' micro-dollars
/// rounded half-even to cents), in JSON and in the HTML.
#[test]
fn apron_up_report_shows_the_fleets_idle_cost_equal_to_sql() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("apron-data");
    let log = dir.path().join("up.log");
    let child = Command::new(APRON)
        .args(["up", "--http", "127.0.0.1:0", "--pg", "127.0.0.1:0", "--backfill", "50m", "--data"])
        .arg(&data)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log file"))
        .spawn()
        .expect("apron up starts");
    let endpoints: Value = poll("endpoints.json", Duration::from_secs(30), || {
        serde_json::from_str(&std::fs::read_to_string(data.join("endpoints.json")).ok()?).ok()
    });
    let child = KillOnDrop(vec![child]);
    let http: SocketAddr = endpoints["http"]
        .as_str()
        .and_then(|u| u.strip_prefix("http://"))
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("{endpoints}"));
    let week = apron::report::current_week(now_us()).expect("week");
    let (from, to) = (UnixMicros(week.start_us()).to_rfc3339(), UnixMicros(week.end_us()).to_rfc3339());
    let sql = |q: &str| -> Value {
        let r = request(http, "POST", "/api/v1/sql", &[("accept", "application/json")], q.as_bytes());
        assert_eq!(r.status, 200, "{q}: {r:?}");
        r.json()["rows"].clone()
    };
    let per_team = format!(
        "SELECT team, CAST(sum(stranded_cost_usd) AS VARCHAR) AS s, \
         CAST(sum(idle_cost_usd - stranded_cost_usd) AS VARCHAR) AS i, CAST(sum(cost_usd) AS VARCHAR) AS c \
         FROM gpu_cost_hourly \
         WHERE hour >= TIMESTAMP '{from}' AND hour < TIMESTAMP '{to}' GROUP BY team ORDER BY team"
    );
    // The seeded 50 minutes hold idle runs of ≥ 30 min (the 4-GPU Slurm job that uses
    // one GPU) once the ledger has priced them.
    let stranded_team = poll("stranded dollars in gpu_cost_hourly", Duration::from_secs(240), || {
        let rows = sql(&per_team);
        let t = rows.as_array()?.iter().find(|r| r[0] != "unallocated" && micros(&r[1]) > 0)?;
        Some(t[0].as_str()?.to_owned())
    });
    // The live agent keeps adding rows and the ledger re-prices today every minute:
    // compare a report with SQL read just before and just after it, equal to both.
    let (report, rows) = poll("a report between two equal SQL reads", Duration::from_secs(180), || {
        let before = sql(&per_team);
        let r = get(http, &format!("/api/v1/reports/weekly?week={week}&format=json"));
        assert_eq!(r.status, 200, "{r:?}");
        let after = sql(&per_team);
        (before == after).then(|| (r.json(), before))
    });
    let rows = rows.as_array().expect("rows");
    let team_line = |t: &str| -> &Value {
        if t == "unallocated" {
            return &report["unallocated"];
        }
        report["teams"].as_array().and_then(|ts| ts.iter().find(|l| l["team"] == t)).unwrap_or_else(|| {
            panic!("no {t} line: {report}");
        })
    };
    let dollars = |v: &Value| (v.as_f64().expect("number") * 100.0).round() as i64;
    for r in rows {
        let team = r[0].as_str().expect("team");
        let line = team_line(team);
        // Each kind rounded from its exact sum; the idle total is the sum of the rounded
        // kinds (a total line is the sum of the rounded lines above it).
        let (stranded, other_idle) = (cents(micros(&r[1])), cents(micros(&r[2])));
        let other = if team == "unallocated" { "unallocated_idle_cost_usd" } else { "allocated_idle_cost_usd" };
        assert_eq!(dollars(&line["stranded_cost_usd"]), stranded, "{team} stranded: {line}");
        assert_eq!(dollars(&line[other]), other_idle, "{team} {other}: {line}");
        assert_eq!(dollars(&line["idle_cost_usd"]), stranded + other_idle, "{team} idle: {line}");
        assert_eq!(dollars(&line["cost_usd"]), cents(micros(&r[3])), "{team} cost: {line}");
    }
    assert!(dollars(&team_line(&stranded_team)["stranded_cost_usd"]) > 0, "{report}");
    assert!(dollars(&team_line("unallocated")["unallocated_idle_cost_usd"]) > 0, "{report}");
    assert!(report["price_book_version"].as_str().is_some_and(|v| v.starts_with("example-")), "{report}");

    // The HTML rendering carries the same figures.
    let html = get(http, &format!("/api/v1/reports/weekly?week={week}&format=html")).body;
    let ds = team_line(&stranded_team)["stranded_cost_usd"].as_f64().expect("number");
    assert!(html.contains(&format!("{ds:.2}")), "{ds:.2} not in the HTML report");

    // Alerts: the seeded stranded GPUs fire (the Slurm job idles 3 of its 4 GPUs).
    // A generous bound: a debug build beside the other tests on 2 cores reads the whole
    // lookback again while the seed's late rows are still arriving (seconds alone, over
    // 120 s once in a full `cargo test --workspace`).
    let alerts = poll("a stranded alert", Duration::from_secs(300), || {
        let j = get(http, "/api/v1/alerts?state=firing").json();
        let a = j["alerts"].as_array()?.iter().find(|a| a["kind"] == "stranded_allocation")?.clone();
        Some(a)
    });
    assert!(alerts["cost_usd"].as_f64().is_some_and(|c| c > 0.0), "{alerts}");

    // `apron recommend --window 1h` lists the scenarios built for reclaim, right-size
    // and pack, with monthly dollars equal to the price book's arithmetic on their
    // evidence: (GPU-hours saved in the hour) × $/GPU-hour × 730 / (hours of the window
    // that hold data).
    let server_url = endpoints["http"].as_str().expect("http").to_owned();
    let recommend = |format: &str| {
        let o = Command::new(APRON)
            .args(["recommend", "--window", "1h", "--format", format, "--server", &server_url])
            .env_remove("APRON_SQL_TOKEN")
            .output()
            .expect("apron recommend runs");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let j: Value = serde_json::from_str(&recommend("json")).expect("json");
    let items = j["recommendations"].as_array().expect("items");
    let covered = j["covered_hours"].as_f64().expect("covered_hours");
    assert!(covered > 0.0 && covered <= 1.0, "{j:#}");
    for kind in ["reclaim", "right-size", "pack"] {
        let i = items.iter().find(|i| i["kind"] == kind).unwrap_or_else(|| panic!("no {kind}: {j:#}"));
        let monthly = i["monthly_savings_usd"].as_f64().expect("monthly");
        let hours = match kind {
            "reclaim" => i["evidence"]["idle_gpu_hours"].as_f64(),
            _ => i["evidence"]["replay_gpu_hours_saved"].as_f64(),
        }
        .expect("hours");
        let rate: f64 = i["evidence"]["gpus"][0]["usd_per_gpu_hour"]
            .as_str()
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("a price: {i:#}"));
        // Hours are printed to the µ-hour: ± $0.01 a month.
        let expected = hours * rate * 730.0 / covered;
        assert!(
            (monthly - expected).abs() <= 0.03,
            "{kind}: {monthly} vs {hours} h × ${rate} × 730 / {covered} h = {expected}: {i:#}"
        );
        assert!(monthly > 0.0 && i["confidence"].as_f64().is_some_and(|c| c > 0.0 && c <= 1.0), "{i:#}");
    }
    let table = recommend("table");
    assert!(table.contains("reclaim") && table.contains("right-size") && table.contains("pack"), "{table}");

    // The web UI in headless Chromium shows the report's idle dollars for the week, with
    // no console error, and fits 1280 and 1920 px wide with nothing scrolling sideways;
    // its screenshots at both widths are kept (the 1280 px one is the README's).
    let shots = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("apron-ui");
    let mut last = String::new();
    let mut passed = false;
    for _ in 0..3 {
        let total =
            get(http, &format!("/api/v1/reports/weekly?week={week}&format=json")).json()["fleet"]["idle_cost_usd"]
                .as_f64()
                .expect("fleet idle");
        let o = Command::new("python3")
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/ui/chromium_check.py"))
            .arg(format!("http://{http}/?week={week}&refresh=0"))
            .arg(&shots)
            .arg(format!("{total:.2}"))
            .output()
            .expect("python3 runs");
        last = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        // 2: could not run (no chromium): a failure, never a skip.
        assert_ne!(o.status.code(), Some(2), "{last}");
        passed = o.status.success();
        // 1 may be the ledger re-pricing today between the two reads: retried. Something
        // too wide is no race: not retried.
        if passed || last.contains("px too wide") {
            break;
        }
    }
    assert!(passed, "the UI check failed:\n{last}");
    for width in [1280, 1920] {
        assert!(last.contains(&format!("layout at {width} px: nothing overflows sideways")), "{last}");
        assert!(shots.join(format!("ui-{width}.png")).exists(), "{last}");
    }

    // psql as the issue has it: per-team idle dollars, equal to the HTTP API's answer.
    let pg = endpoints["postgres"].as_str().expect("postgres URL").to_owned();
    let (host, port) = pg
        .rsplit_once('@')
        .and_then(|(_, a)| a.split_once('/'))
        .and_then(|(a, _)| a.rsplit_once(':'))
        .map(|(h, p)| (h.to_owned(), p.to_owned()))
        .unwrap_or_else(|| panic!("{pg}"));
    let q = "SELECT team, sum(idle_cost_usd) FROM gpu_cost_hourly GROUP BY team ORDER BY team";
    let (via_psql, via_http) = poll("psql and HTTP to agree", Duration::from_secs(120), || {
        let before = sql(q);
        let o = Command::new("psql")
            .args(["-h", &host, "-p", &port, "-U", "apron", "-X", "-A", "-t", "-F", ",", "-c", q])
            .output()
            .expect("psql runs");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        (before == sql(q)).then_some((text, before))
    });
    let expected: String = via_http
        .as_array()
        .expect("rows")
        .iter()
        .map(|r| {
            // Decimal(18, 6): psql prints the six places, JSON a number.
            format!("{},{:.6}\n", r[0].as_str().expect("team"), r[1].as_f64().expect("dollars"))
        })
        .collect();
    assert_eq!(via_psql, expected);
    drop(child);
}

/// Every query of the Grafana dashboards (`dashboards/grafana/`) answers with data: the
/// PromQL panels against a real Prometheus scraping `apron up`'s agent and server, the
/// SQL panels over the HTTP API and through psql after Grafana's macros are expanded
/// (`tests/dashboards/check.py`; no Grafana runs here). The checker's own unit tests
/// run first.
#[test]
fn grafana_dashboard_queries_answer_on_apron_up() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let unit = Command::new("python3")
        .arg("tests/dashboards/test_check.py")
        .current_dir(root)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .expect("python3");
    assert!(
        unit.status.success(),
        "{}{}",
        String::from_utf8_lossy(&unit.stdout),
        String::from_utf8_lossy(&unit.stderr)
    );

    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("apron-data");
    let mut child = Command::new(APRON)
        .args(["up", "--http", "127.0.0.1:0", "--pg", "127.0.0.1:0", "--backfill", "3h", "--data"])
        .arg(&data)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("up.log")).expect("log"))
        .spawn()
        .expect("apron up starts");
    let endpoints: Value = poll("endpoints.json", Duration::from_secs(30), || {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("apron up exited with {status}");
        }
        serde_json::from_str(&std::fs::read_to_string(data.join("endpoints.json")).ok()?).ok()
    });
    let mut procs = KillOnDrop(vec![child]);
    let hostport = |key: &str| -> String {
        let u = endpoints[key].as_str().unwrap_or_else(|| panic!("{endpoints}"));
        let rest = u.split_once("://").map_or(u, |(_, r)| r);
        rest.split('/').next().unwrap_or(rest).to_owned()
    };
    let (server, agent) = (hostport("http"), hostport("agent_metrics"));
    let pg = endpoints["postgres"].as_str().expect("postgres").to_owned();
    let pg_port = pg.rsplit_once(':').and_then(|(_, p)| p.split('/').next()).expect("pg port").to_owned();

    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: apron-agent\n    honor_labels: true\n    static_configs:\n      - targets: ['{agent}']\n  - job_name: apron\n    static_configs:\n      - targets: ['{server}']\n"
        ),
    )
    .expect("config");
    let port = free_port();
    let prom = Command::new(std::env::var("APRON_PROMETHEUS").unwrap_or_else(|_| "prometheus".into()))
        .arg(format!("--config.file={}", config.display()))
        .arg(format!("--storage.tsdb.path={}", dir.path().join("prom").display()))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("prom.log")).expect("log"))
        .spawn()
        .expect("prometheus (Debian package; scripts/install-test-tools.sh installs it)");
    procs.0.push(prom);
    let prom_addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
    poll("Prometheus ready", Duration::from_secs(30), || {
        try_request(prom_addr, "GET", "/-/ready", &[], b"").ok().filter(|r| r.status == 200)
    });

    let check = |args: &[&str], dashboards: &[&str]| {
        let o = Command::new("python3")
            .arg("tests/dashboards/check.py")
            .args(args)
            .args(["--from", "now-3h", "--to", "now", "--retry-empty-for", "300s"])
            .args(dashboards)
            .current_dir(root)
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .output()
            .expect("python3");
        let out = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        // 2: a tool is missing or the arguments are wrong: a failure, never a skip.
        assert!(o.status.success(), "dashboard check failed ({:?}):\n{out}", o.status.code());
        out
    };
    let prom_url = format!("http://127.0.0.1:{port}");
    let http = format!("http://{server}");
    let out = check(
        &["--prometheus", &prom_url, "--scrape-interval", "1s", "--sql-mode", "http", "--server", &http],
        &["dashboards/grafana/prometheus", "dashboards/grafana/postgres"],
    );
    assert!(out.contains(" ok"), "{out}");
    let psql = format!("psql -h 127.0.0.1 -p {pg_port} -U apron -d apron");
    check(&["--sql-mode", "psql", "--psql-cmd", &psql], &["dashboards/grafana/postgres"]);
}

/// OTLP/HTTP metrics from a real OpenTelemetry SDK exporter (Python, as a Collector
/// forwarding a dcgm-exporter scrape would send them) become `gpu_samples` windows:
/// each export's point stands for the time since the previous one.
#[test]
fn otlp_metrics_from_a_real_exporter_land_in_gpu_samples() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let log = dir.path().join("apron.log");
    let config = write_config(dir.path(), &data, "[sql]\ntokens = [\"sql-token-0123456789abcdef\"]", "");
    let server = ServerProc::start(&config, &[], &log);
    let endpoint = format!("http://{}/v1/metrics", server.addr);
    // No token, and a body that is not OTLP: refused, nothing stored.
    assert_eq!(request(server.addr, "POST", "/v1/metrics", &[], b"x").status, 401);
    let auth = format!("Bearer {TOKEN}");
    let r = request(server.addr, "POST", "/v1/metrics", &[("authorization", &auth)], b"\xff\xff\xff");
    assert_eq!(r.status, 400, "{r:?}");
    let o = Command::new("python3")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/otlp/send_dcgm.py"))
        .args([endpoint.as_str(), TOKEN, "0", "100", "50"])
        .output()
        .expect("python3");
    assert!(o.status.success(), "{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    let q = b"SELECT CAST(gpu_util AS DOUBLE) AS u, fb_used_bytes, \"host\", owner, window_s FROM gpu_samples \
              WHERE gpu_uuid = 'GPU-OTLP' ORDER BY time";
    let ok = [("authorization", "Bearer sql-token-0123456789abcdef"), ("accept", "application/json")];
    let r = request(server.addr, "POST", "/api/v1/sql", &ok, q);
    assert_eq!(r.status, 200, "{r:?}");
    let rows = r.json()["rows"].as_array().expect("rows").clone();
    // Three exports: the first opens the series, the next two are windows.
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert_eq!((rows[0][0].as_f64(), rows[1][0].as_f64()), (Some(1.0), Some(0.5)));
    assert_eq!(rows[0][1], 1024 * 1024 * 1024);
    assert_eq!((rows[0][2].as_str(), rows[0][3].as_str()), (Some("otlp-node"), Some("ml/train-x")));
    let w = rows[1][4].as_f64().expect("window");
    assert!((0.9..5.0).contains(&w), "an export's window is the time since the previous one: {w}");
    server.stop();
}
