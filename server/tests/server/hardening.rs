//! The real `apron serve` binary against clients that try to hold or exhaust it: bodies
//! sent without a valid token, bodies trickled forever, PostgreSQL connections that never
//! authenticate and query texts over the limit. Loopback only; every loop is bounded.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::{ServerProc, free_port, poll, request, write_config};

const SQL_TOKEN: &str = "sql-token-0123456789abcdef";
const PG_PASSWORD: &str = "grafana-pass-0123";

/// `apron serve` with a SQL token, `server` settings added to `[server]` and `extra`
/// sections after `[ingest]`.
fn start(dir: &Path, server: &str, extra: &str) -> ServerProc {
    let data = dir.join("data");
    let config = write_config(dir, &data, &format!("[sql]\ntokens = [{SQL_TOKEN:?}]\n{extra}"), "");
    let text = std::fs::read_to_string(&config).expect("config");
    std::fs::write(&config, text.replacen("[server]\n", &format!("[server]\n{server}"), 1)).expect("config");
    ServerProc::start(&config, &[], &dir.join("apron.log"))
}

/// `GET /healthz` must answer 200 within a second, whatever else is going on.
fn healthy(addr: SocketAddr) {
    let started = Instant::now();
    let r = request(addr, "GET", "/healthz", &[], b"");
    let took = started.elapsed();
    assert_eq!(r.status, 200, "{r:?}");
    assert!(took < Duration::from_secs(1), "/healthz took {took:?}");
}

/// A client that sends a request head announcing a 1 MB body, then trickles the body a
/// byte every `every`. Returns how long the answer's head took to arrive after the
/// request head was sent (`None`: none came), what arrived, and how long until the
/// server closed the connection (`None`: still open when the client gave up after
/// `give_up`).
fn trickler(
    addr: SocketAddr,
    token: &str,
    every: Duration,
    give_up: Duration,
) -> (Option<Duration>, String, Option<Duration>) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(every)).expect("timeout");
    let head = format!(
        "POST /api/v1/sql HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\nContent-Length: 1048576\r\n\r\nSELECT"
    );
    s.write_all(head.as_bytes()).expect("head");
    let sent = Instant::now();
    let (mut answered, mut closed) = (None, None);
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while sent.elapsed() < give_up {
        match s.read(&mut buf) {
            Ok(0) => {
                closed = Some(sent.elapsed());
                break;
            }
            Ok(n) => {
                got.extend_from_slice(&buf[..n]);
                if answered.is_none() && got.windows(4).any(|w| w == b"\r\n\r\n") {
                    answered = Some(sent.elapsed());
                }
            }
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                // Another byte of the body; a closed connection shows at the next read.
                let _ = s.write_all(b" ");
            }
            Err(_) => {
                closed = Some(sent.elapsed());
                break;
            }
        }
    }
    (answered, String::from_utf8_lossy(&got).into_owned(), closed)
}

/// Checks `/healthz` every 100 ms until `done` says stop; returns how many answered.
fn watch_health(addr: SocketAddr, done: impl Fn() -> bool) -> usize {
    let mut checks = 0;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done() && Instant::now() < deadline {
        healthy(addr);
        checks += 1;
        std::thread::sleep(Duration::from_millis(100));
    }
    checks
}

#[test]
fn unauthenticated_bodies_are_never_read_and_healthz_stays_up() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Body timeouts far longer than the test: a 401 here comes from the token alone.
    let server = start(dir.path(), "body_read_timeout = \"30s\"\nbody_total_timeout = \"30s\"\n", "");
    let addr = server.addr;
    healthy(addr);
    let clients: Vec<_> = (0..200)
        .map(|i| {
            std::thread::spawn(move || {
                trickler(addr, &format!("bogus-token-{i}"), Duration::from_millis(100), Duration::from_secs(10))
            })
        })
        .collect();
    let checks = watch_health(addr, || clients.iter().all(|c| c.is_finished()));
    assert!(checks > 0);
    for c in clients {
        let (answered, got, closed) = c.join().expect("client");
        // Answered 401 on the head alone (the client had sent 6 of its 1,048,576 body
        // bytes, and a few more trickled), then closed: the body is never read.
        assert!(got.starts_with("HTTP/1.1 401"), "{got:?}");
        let answered = answered.expect("an answer");
        assert!(answered < Duration::from_secs(2), "answered after {answered:?}");
        let closed = closed.expect("closed by the server");
        assert!(closed < Duration::from_secs(3), "closed after {closed:?}");
    }
    healthy(addr);
    server.stop();
}

#[test]
fn a_trickled_body_is_cut_off_at_the_total_deadline() {
    let dir = tempfile::tempdir().expect("tempdir");
    // A byte every 300 ms never trips the 1 s gap timeout; the 2 s total deadline ends
    // each body.
    let server = start(dir.path(), "body_read_timeout = \"1s\"\nbody_total_timeout = \"2s\"\n", "");
    let addr = server.addr;
    let clients: Vec<_> = (0..20)
        .map(|_| {
            std::thread::spawn(move || trickler(addr, SQL_TOKEN, Duration::from_millis(300), Duration::from_secs(10)))
        })
        .collect();
    let checks = watch_health(addr, || clients.iter().all(|c| c.is_finished()));
    assert!(checks > 0);
    for c in clients {
        let (answered, got, closed) = c.join().expect("client");
        assert!(got.starts_with("HTTP/1.1 408"), "{got:?}");
        assert!(got.contains("body_timeout") && got.contains("server.body_total_timeout"), "{got:?}");
        let answered = answered.expect("an answer");
        assert!(
            answered >= Duration::from_millis(1900) && answered < Duration::from_secs(4),
            "answered after {answered:?}"
        );
        let closed = closed.expect("closed by the server");
        assert!(closed < Duration::from_secs(5), "closed after {closed:?}");
    }
    // A prompt body with the same token is served.
    let r = request(addr, "POST", "/api/v1/sql", &[("authorization", &format!("Bearer {SQL_TOKEN}"))], b"SELECT 1");
    assert_eq!(r.status, 200, "{r:?}");
    healthy(addr);
    server.stop();
}

/// `[pg]` on a free port with one viewer user, plus `extra` keys.
fn pg_section(port: u16, extra: &str) -> String {
    format!(
        "[pg]\nlisten = \"127.0.0.1:{port}\"\nusers = [{{ name = \"grafana\", password = {PG_PASSWORD:?} }}]\n{extra}"
    )
}

fn psql(port: u16, args: &[&str], stdin: Option<&str>) -> std::process::Output {
    let mut child = Command::new("psql")
        .arg(format!("host=127.0.0.1 port={port} user=grafana dbname=apron sslmode=disable"))
        .args(["-X", "-A", "-t"])
        .args(args)
        .env("PGPASSWORD", PG_PASSWORD)
        .env("PGCONNECT_TIMEOUT", "10")
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("psql (Debian package postgresql-client; scripts/install-test-tools.sh installs it)");
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        let text = text.to_owned();
        // On its own thread: psql answers while it reads.
        std::thread::spawn(move || {
            let _ = pipe.write_all(text.as_bytes());
        });
    }
    child.wait_with_output().expect("psql runs")
}

fn psql_select_1(port: u16) -> Option<()> {
    let o = psql(port, &["-c", "SELECT 1"], None);
    (o.status.success() && String::from_utf8_lossy(&o.stdout).trim() == "1").then_some(())
}

/// Reads until the server closes (EOF or reset) or `limit` passes; returns what arrived
/// and when the connection closed (`None`: still open).
fn read_until_closed(s: &mut TcpStream, since: Instant, limit: Duration) -> (Vec<u8>, Option<Duration>) {
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while since.elapsed() < limit {
        s.set_read_timeout(Some(Duration::from_millis(100))).expect("timeout");
        match s.read(&mut buf) {
            Ok(0) => return (got, Some(since.elapsed())),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(_) => return (got, Some(since.elapsed())),
        }
    }
    (got, None)
}

/// A PostgreSQL startup message for user `grafana`.
fn startup_message() -> Vec<u8> {
    let params = b"user\0grafana\0database\0apron\0\0";
    let mut m = Vec::new();
    m.extend(u32::try_from(8 + params.len()).expect("small").to_be_bytes());
    m.extend(196_608u32.to_be_bytes());
    m.extend(params);
    m
}

#[test]
fn pg_connections_must_authenticate_in_time() {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = free_port();
    let server = start(dir.path(), "", &pg_section(port, "max_connections = 8\nauth_timeout = \"2s\"\n"));
    poll("psql", Duration::from_secs(20), || psql_select_1(port));
    // psql's own connection has let go of its slot (it sent Terminate and left).
    std::thread::sleep(Duration::from_millis(300));
    let pg: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");

    // Eight connections that never authenticate: three silent, three after an
    // SSLRequest (answered 'N': no TLS here), two after a startup message (answered
    // with a password request). Their answers show the server has accepted them.
    let opened = Instant::now();
    let mut stalled = Vec::new();
    for i in 0..8 {
        let mut s = TcpStream::connect(pg).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(2))).expect("timeout");
        let mut first = [0u8; 1];
        if (3..6).contains(&i) {
            s.write_all(&[0, 0, 0, 8, 4, 210, 22, 47]).expect("SSLRequest");
            s.read_exact(&mut first).expect("SSL answer");
            assert_eq!(&first, b"N");
        } else if i >= 6 {
            s.write_all(&startup_message()).expect("startup");
            s.read_exact(&mut first).expect("auth request");
            assert_eq!(&first, b"R", "an authentication request");
        }
        stalled.push(s);
    }
    // The silent ones are accepted by now too (the accept loop takes them in order).
    std::thread::sleep(Duration::from_millis(200));

    // Connections that have not logged in take no session (pg.max_preauth_connections
    // counts them apart; pg_limits.rs floods it): psql still logs in.
    assert_eq!(psql_select_1(port), Some(()));
    healthy(server.addr);

    // The stalled ones are closed at the authentication deadline.
    for (i, mut s) in stalled.into_iter().enumerate() {
        let (got, closed) = read_until_closed(&mut s, opened, Duration::from_secs(8));
        let closed = closed.unwrap_or_else(|| panic!("connection {i} still open"));
        assert!(
            closed >= Duration::from_millis(1800) && closed < Duration::from_secs(5),
            "{i}: closed after {closed:?}"
        );
        if i >= 6 {
            // The password request, then a FATAL naming the setting.
            let text = String::from_utf8_lossy(&got);
            assert!(text.contains("57014") && text.contains("pg.auth_timeout"), "{text:?}");
        }
    }

    // Slots are free again: psql connects, and the HTTP side never noticed.
    poll("psql after the flood", Duration::from_secs(10), || psql_select_1(port));
    healthy(server.addr);
    server.stop();
}

#[test]
fn pg_query_text_over_the_limit_is_refused_and_the_connection_goes_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = free_port();
    let server = start(dir.path(), "", &format!("max_body_bytes = \"4KiB\"\n{}", pg_section(port, "")));
    poll("psql", Duration::from_secs(20), || psql_select_1(port));

    // One session: a text just under the limit, one over it, one of 3 MiB (dropped as it
    // arrives, never buffered), then an ordinary query on the same connection.
    let script = format!(
        "\\set VERBOSITY verbose\nSELECT length('{}') AS under;\nSELECT length('{}') AS over;\nSELECT length('{}') AS huge;\nSELECT 42 AS alive;\n",
        "u".repeat(4000),
        "o".repeat(10_000),
        "h".repeat(3 << 20),
    );
    let o = psql(port, &["-v", "ON_ERROR_STOP=0", "-f", "-"], Some(&script));
    let (stdout, stderr) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    let lines: Vec<&str> = stdout.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    assert_eq!(lines, ["4000", "42"], "stdout: {stdout}\nstderr: {stderr}");
    assert_eq!(stderr.matches("54000").count(), 2, "{stderr}");
    assert_eq!(stderr.matches("sql.max_body_bytes").count(), 2, "{stderr}");
    assert!(!stderr.contains("server closed the connection"), "{stderr}");

    // The server goes on serving both ways in.
    assert_eq!(psql_select_1(port), Some(()));
    let r = request(
        server.addr,
        "POST",
        "/api/v1/sql",
        &[("authorization", &format!("Bearer {SQL_TOKEN}")), ("accept", "text/csv")],
        b"SELECT 7 AS n",
    );
    assert_eq!((r.status, r.body.trim()), (200, "n\n7"), "{r:?}");
    healthy(server.addr);
    server.stop();
}
