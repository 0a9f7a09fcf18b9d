//! The PostgreSQL port's session limits (`[pg]`, `docs/security.md`), against the real
//! listener (`apron::pg::serve_with`) over raw sockets speaking the wire protocol, so
//! that each message — Parse, Bind, Execute with a row limit, Close, Sync, a half-sent
//! one — is exactly what the test says:
//!
//! - statements, portals (suspended ones included) and their bytes past the limits are
//!   refused with an ErrorResponse naming the setting, and the connection goes on;
//! - a bound value over `max_param_bytes`, or a Bind over the message limit, is refused
//!   the same way (the latter used to end the connection);
//! - one user cannot take every session (`max_connections_per_user`), sessions are
//!   capped (`max_connections`), and sockets that never log in cannot keep anyone out
//!   (`max_preauth_connections`: the oldest makes way);
//! - a silent session is closed after `idle_timeout`, a half-sent message and an unread
//!   answer after `message_timeout`;
//! - `SET ROLE` / `SET SESSION AUTHORIZATION` are refused, through psql too.
//!
//! Limits are small so that every test takes seconds.

use std::sync::Arc;
use std::time::{Duration, Instant};

use apron::access::Role;
use apron::pg::{PgAuth, PgLimits, PgSessionLimits, PgStats, PgUser};
use apron_common::TeamName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const ALICE: (&str, &str) = ("alice", "alice-pass-0123");
const BOB: (&str, &str) = ("bob", "bob-pass-0123");

/// A listener on a free port under `limits`, over an empty store.
struct Fixture {
    port: u16,
    stats: Arc<PgStats>,
    _task: tokio::task::JoinHandle<()>,
    _server: apron::Server,
    _dir: tempfile::TempDir,
}

async fn start(limits: PgLimits) -> Fixture {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = super::rollup::open(dir.path());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind pg");
    let port = listener.local_addr().expect("addr").port();
    let users: Arc<[PgUser]> = vec![
        PgUser { name: ALICE.0.into(), password: ALICE.1.into(), role: Role::Viewer },
        PgUser { name: BOB.0.into(), password: BOB.1.into(), role: Role::Team(TeamName::new("vision").expect("team")) },
    ]
    .into();
    let stats = limits.stats.clone();
    let engine = server.engine().clone();
    let task = tokio::spawn(apron::pg::serve_with(listener, engine, PgAuth::Password(users), None, limits));
    Fixture { port, stats, _task: task, _server: server, _dir: dir }
}

fn limits(session: PgSessionLimits) -> PgLimits {
    PgLimits { session, ..PgLimits::default() }
}

// ─────────────────────────── the wire protocol ───────────────────────────

fn message(ty: u8, body: &[u8]) -> Vec<u8> {
    let mut m = vec![ty];
    m.extend(u32::try_from(body.len() + 4).expect("small").to_be_bytes());
    m.extend(body);
    m
}

fn cstr(out: &mut Vec<u8>, s: &str) {
    out.extend(s.as_bytes());
    out.push(0);
}

fn query(sql: &str) -> Vec<u8> {
    let mut b = Vec::new();
    cstr(&mut b, sql);
    message(b'Q', &b)
}

/// Parse `sql` as statement `name`, with these parameter type OIDs.
fn parse(name: &str, sql: &str, types: &[u32]) -> Vec<u8> {
    let mut b = Vec::new();
    cstr(&mut b, name);
    cstr(&mut b, sql);
    b.extend(u16::try_from(types.len()).expect("few").to_be_bytes());
    for t in types {
        b.extend(t.to_be_bytes());
    }
    message(b'P', &b)
}

/// Bind statement `statement` into portal `portal` with text values.
fn bind(portal: &str, statement: &str, values: &[&[u8]]) -> Vec<u8> {
    let mut b = Vec::new();
    cstr(&mut b, portal);
    cstr(&mut b, statement);
    b.extend(0u16.to_be_bytes());
    b.extend(u16::try_from(values.len()).expect("few").to_be_bytes());
    for v in values {
        b.extend(i32::try_from(v.len()).expect("small").to_be_bytes());
        b.extend(*v);
    }
    b.extend(0u16.to_be_bytes());
    message(b'B', &b)
}

fn execute(portal: &str, max_rows: i32) -> Vec<u8> {
    let mut b = Vec::new();
    cstr(&mut b, portal);
    b.extend(max_rows.to_be_bytes());
    message(b'E', &b)
}

fn close(kind: u8, name: &str) -> Vec<u8> {
    let mut b = vec![kind];
    cstr(&mut b, name);
    message(b'C', &b)
}

fn sync() -> Vec<u8> {
    message(b'S', b"")
}

/// A startup message (protocol 3.0) for `user`, database `apron`.
fn startup_message(user: &str) -> Vec<u8> {
    let mut params = Vec::new();
    for (k, v) in [("user", user), ("database", "apron")] {
        cstr(&mut params, k);
        cstr(&mut params, v);
    }
    params.push(0);
    let mut startup = Vec::new();
    startup.extend(u32::try_from(8 + params.len()).expect("small").to_be_bytes());
    startup.extend(196_608u32.to_be_bytes());
    startup.extend(params);
    startup
}

/// An ErrorResponse's severity, SQLSTATE and message.
#[derive(Debug, Clone)]
struct PgError {
    severity: String,
    code: String,
    message: String,
}

impl PgError {
    fn from_body(body: &[u8]) -> PgError {
        let mut e = PgError { severity: String::new(), code: String::new(), message: String::new() };
        let mut rest = body;
        while let [kind, tail @ ..] = rest {
            if *kind == 0 {
                break;
            }
            let end = tail.iter().position(|b| *b == 0).unwrap_or(tail.len());
            let text = String::from_utf8_lossy(&tail[..end]).into_owned();
            match kind {
                b'S' => e.severity = text,
                b'C' => e.code = text,
                b'M' => e.message = text,
                _ => {}
            }
            rest = tail.get(end + 1..).unwrap_or_default();
        }
        e
    }

    /// The SQLSTATE, and that the message names `setting`.
    fn expect(&self, code: &str, setting: &str) {
        assert_eq!(self.code, code, "{self:?}");
        assert!(self.message.contains(setting), "the message names {setting}: {self:?}");
    }
}

/// What came back for a round of messages: the rows of each result, the other
/// message types in order, and the errors.
#[derive(Debug, Default)]
struct Answer {
    rows: Vec<Vec<Option<String>>>,
    kinds: Vec<u8>,
    errors: Vec<PgError>,
}

impl Answer {
    fn error(&self) -> &PgError {
        self.errors.first().unwrap_or_else(|| panic!("an error: {self:?}"))
    }

    fn ok(&self) -> &Self {
        assert!(self.errors.is_empty(), "{:?}", self.errors);
        self
    }

    fn first(&self) -> Option<String> {
        self.rows.first().and_then(|r| r.first().cloned().flatten())
    }
}

struct Client {
    s: TcpStream,
}

impl Client {
    async fn connect(port: u16) -> TcpStream {
        TcpStream::connect(("127.0.0.1", port)).await.expect("connect")
    }

    /// Startup and password; the FATAL ErrorResponse when the login is refused.
    async fn login(port: u16, (user, password): (&str, &str)) -> Result<Client, PgError> {
        let mut c = Client { s: Client::connect(port).await };
        c.s.write_all(&startup_message(user)).await.expect("startup");
        let (ty, body) = c.recv().await.expect("an answer to startup");
        if ty == b'E' {
            return Err(PgError::from_body(&body));
        }
        assert_eq!((ty, &body[..]), (b'R', &3u32.to_be_bytes()[..]), "a cleartext password request");
        let mut p = Vec::new();
        cstr(&mut p, password);
        c.s.write_all(&message(b'p', &p)).await.expect("password");
        loop {
            match c.recv().await.expect("login answer") {
                (b'E', body) => return Err(PgError::from_body(&body)),
                (b'Z', _) => return Ok(c),
                _ => {}
            }
        }
    }

    /// One message, or `None` when the server closed the connection.
    async fn recv(&mut self) -> Option<(u8, Vec<u8>)> {
        let read = async {
            let mut head = [0u8; 5];
            self.s.read_exact(&mut head).await.ok()?;
            let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
            let mut body = vec![0u8; len.saturating_sub(4)];
            self.s.read_exact(&mut body).await.ok()?;
            Some((head[0], body))
        };
        tokio::time::timeout(Duration::from_secs(20), read).await.expect("the server answers within 20 s")
    }

    /// Sends `messages` and reads up to ReadyForQuery.
    async fn round(&mut self, messages: &[Vec<u8>]) -> Answer {
        self.s.write_all(&messages.concat()).await.expect("send");
        let mut a = Answer::default();
        loop {
            let (ty, body) = self.recv().await.expect("the connection stays open");
            match ty {
                b'D' => a.rows.push(data_row(&body)),
                b'E' => a.errors.push(PgError::from_body(&body)),
                b'Z' => return a,
                other => a.kinds.push(other),
            }
        }
    }

    async fn simple(&mut self, sql: &str) -> Answer {
        self.round(&[query(sql)]).await
    }

    /// Terminate, and wait for the server to close (its session is given back by then).
    async fn terminate(mut self) {
        self.s.write_all(&message(b'X', b"")).await.expect("terminate");
        self.closed().await;
    }

    /// Reads until the server closes; the first ErrorResponse on the way, and when it
    /// closed.
    async fn closed(&mut self) -> (Option<PgError>, Instant) {
        let mut error = None;
        while let Some((ty, body)) = self.recv().await {
            if ty == b'E' && error.is_none() {
                error = Some(PgError::from_body(&body));
            }
        }
        (error, Instant::now())
    }
}

fn data_row(body: &[u8]) -> Vec<Option<String>> {
    let n = u16::from_be_bytes([body[0], body[1]]) as usize;
    let mut at = 2;
    (0..n)
        .map(|_| {
            let len = i32::from_be_bytes(body[at..at + 4].try_into().expect("4 bytes"));
            at += 4;
            (len >= 0).then(|| {
                let v = String::from_utf8_lossy(&body[at..at + len as usize]).into_owned();
                at += len as usize;
                v
            })
        })
        .collect()
}

// ─────────────────────────── statements and portals ───────────────────────────

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statements_past_the_limits_are_refused_and_the_connection_goes_on() {
    let f =
        start(limits(PgSessionLimits { max_statements: 8, max_session_bytes: 64 << 10, ..PgSessionLimits::default() }))
            .await;
    let mut c = Client::login(f.port, ALICE).await.expect("login");

    // Eight named statements: acknowledged. The ninth: refused, naming the setting.
    let mut round: Vec<Vec<u8>> = (0..8).map(|i| parse(&format!("s{i}"), &format!("SELECT {i} AS n"), &[])).collect();
    round.push(sync());
    let a = c.round(&round).await;
    assert_eq!(a.ok().kinds, [b'1'; 8], "eight ParseComplete");
    let a = c.round(&[parse("s8", "SELECT 8 AS n", &[]), sync()]).await;
    a.error().expect("54000", "pg.max_statements");
    // Re-preparing a name it has is not one more.
    c.round(&[parse("s7", "SELECT 77 AS n", &[]), sync()]).await.ok();

    // Nothing acknowledged was dropped, and the connection goes on.
    let a = c.round(&[bind("", "s3", &[]), execute("", 0), bind("", "s7", &[]), execute("", 0), sync()]).await;
    assert_eq!(a.ok().rows, [[Some("3".to_owned())], [Some("77".to_owned())]]);
    assert_eq!(c.simple("SELECT 40 + 2").await.ok().first().as_deref(), Some("42"));

    // Closing one (Close) and DEALLOCATE make room.
    c.round(&[close(b'S', "s0"), parse("s8", "SELECT 8 AS n", &[]), sync()]).await.ok();
    assert_eq!(c.simple("DEALLOCATE s1").await.ok().kinds, [b'C']);
    c.simple("DEALLOCATE s1").await.error().expect("26000", "s1");
    c.round(&[parse("s9", "SELECT 9 AS n", &[]), sync()]).await.ok();

    // Bytes: statements of ~20 KB each fit three at a time in 64 KiB, whatever their
    // number (DISCARD ALL closes everything first).
    assert!(c.simple("DISCARD ALL").await.ok().kinds.contains(&b'C'));
    let big = |i: usize| format!("SELECT length('{}') AS n", char::from(b'a' + i as u8).to_string().repeat(20_000));
    let a = c.round(&[parse("b0", &big(0), &[]), parse("b1", &big(1), &[]), parse("b2", &big(2), &[]), sync()]).await;
    assert_eq!(a.ok().kinds, [b'1'; 3]);
    let a = c.round(&[parse("b3", &big(3), &[]), sync()]).await;
    a.error().expect("53200", "pg.max_session_bytes");
    let a = c.round(&[bind("", "b1", &[]), execute("", 0), sync()]).await;
    assert_eq!(a.ok().first().as_deref(), Some("20000"), "b1 is still there");
    c.round(&[close(b'S', "b0"), parse("b3", &big(3), &[]), sync()]).await.ok();
    assert!(f.stats.session_refusals() >= 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn portals_and_parameters_past_the_limits_are_refused_and_the_connection_goes_on() {
    let f = start(PgLimits {
        max_sql_bytes: 16 << 10,
        ..limits(PgSessionLimits { max_portals: 4, max_param_bytes: 4 << 10, ..PgSessionLimits::default() })
    })
    .await;
    let mut c = Client::login(f.port, ALICE).await.expect("login");
    let a = c.round(&[parse("len", "SELECT length($1) AS n", &[25]), sync()]).await;
    assert_eq!(a.ok().kinds, [b'1']);

    // A value over max_param_bytes: refused; one under it binds and runs.
    let a = c.round(&[bind("", "len", &[&[b'x'; 8 << 10]]), execute("", 0), sync()]).await;
    a.error().expect("54000", "pg.max_param_bytes");
    assert!(a.rows.is_empty());
    let a = c.round(&[bind("", "len", &[&[b'x'; 4 << 10]]), execute("", 0), sync()]).await;
    assert_eq!(a.ok().first().as_deref(), Some("4096"));

    // A Bind over the message limit (16 KiB of SQL + 64 KiB) is dropped as it arrives
    // and refused; it used to end the connection.
    let huge = vec![b'y'; 200 << 10];
    let a = c.round(&[bind("", "len", &[&huge]), execute("", 0), sync()]).await;
    a.error().expect("54000", "sql.max_body_bytes");
    // So is a Parse.
    let a = c.round(&[parse("huge", &format!("SELECT '{}'", "z".repeat(100 << 10)), &[]), sync()]).await;
    a.error().expect("54000", "sql.max_body_bytes");
    assert_eq!(c.simple("SELECT 1").await.ok().first().as_deref(), Some("1"));

    // Four named portals; the fifth is refused, the four still run.
    let mut round: Vec<Vec<u8>> =
        (0..4).map(|i| bind(&format!("p{i}"), "len", &[format!("{i:>3}").as_bytes()])).collect();
    round.push(sync());
    assert_eq!(c.round(&round).await.ok().kinds, [b'2'; 4]);
    let a = c.round(&[bind("p4", "len", &[b"1"]), sync()]).await;
    a.error().expect("54000", "pg.max_portals");
    let a = c.round(&[execute("p2", 0), sync()]).await;
    assert_eq!(a.ok().first().as_deref(), Some("3"));
    // Closing one makes room; re-binding a name is not one more.
    c.round(&[close(b'P', "p0"), bind("p4", "len", &[b"1"]), bind("p1", "len", &[b"22"]), sync()]).await.ok();
    let a = c.round(&[execute("p1", 0), execute("p4", 0), sync()]).await;
    assert_eq!(a.ok().rows, [[Some("2".to_owned())], [Some("1".to_owned())]]);
}

/// The bytes, as the engine counts them, of `sql`'s result.
async fn result_bytes(f: &Fixture, sql: &str) -> usize {
    let r = f._server.engine().execute(sql).await.expect("query");
    r.batches.iter().map(|b| b.get_array_memory_size()).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_suspended_portal_counts_toward_what_the_connection_holds() {
    let rows = "SELECT repeat('y', 200) AS y, value FROM generate_series(1, 4000)";
    // The limit: two of those results held at once, not three.
    let probe = start(PgLimits::default()).await;
    let one = result_bytes(&probe, rows).await;
    drop(probe);
    let f =
        start(limits(PgSessionLimits { max_portals: 8, max_session_bytes: one * 5 / 2, ..PgSessionLimits::default() }))
            .await;
    let mut c = Client::login(f.port, ALICE).await.expect("login");
    c.round(&[parse("rows", rows, &[]), sync()]).await.ok();

    // Read one row at a time: the rest stays in the portal, counted.
    let a = c.round(&[bind("a", "rows", &[]), execute("a", 1), bind("b", "rows", &[]), execute("b", 1), sync()]).await;
    assert_eq!(a.ok().rows.len(), 2);
    assert_eq!(a.kinds.iter().filter(|k| **k == b's').count(), 2, "two PortalSuspended: {:?}", a.kinds);
    // A third is refused before any row is sent; the two go on.
    let a = c.round(&[bind("c", "rows", &[]), execute("c", 1), sync()]).await;
    a.error().expect("53200", "pg.max_session_bytes");
    assert!(a.rows.is_empty(), "{:?}", a.rows.len());
    let a = c.round(&[execute("a", 2), sync()]).await;
    assert_eq!(a.ok().rows.len(), 2);
    assert_eq!(a.rows[1][1].as_deref(), Some("3"), "portal a goes on where it was");
    // Read without a row limit, nothing is held: that one is never refused.
    let a = c.round(&[bind("d", "rows", &[]), execute("d", 0), sync()]).await;
    assert_eq!(a.ok().rows.len(), 4000);

    // Portal a read to its end gives its bytes back: the third fits now.
    let a = c.round(&[execute("a", 0), sync()]).await;
    assert_eq!(a.ok().rows.len(), 4000 - 3);
    let a = c.round(&[bind("c", "rows", &[]), execute("c", 1), sync()]).await;
    assert!(a.ok().kinds.contains(&b's'));
    // As does Close.
    let a = c.round(&[close(b'P', "b"), bind("e", "rows", &[]), execute("e", 1), sync()]).await;
    assert!(a.ok().kinds.contains(&b's'));
    c.round(&[close(b'P', "c"), sync()]).await.ok();
    // The unnamed portal is closed by Sync: suspending it again and again holds nothing
    // more than once.
    for _ in 0..5 {
        let a = c.round(&[bind("", "rows", &[]), execute("", 1), sync()]).await;
        assert!(a.ok().kinds.contains(&b's'));
    }
    assert_eq!(c.simple("SELECT 1").await.ok().first().as_deref(), Some("1"));
}

// ─────────────────────────── identity ───────────────────────────

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_role_and_session_authorization_are_refused() {
    let f = start(PgLimits::default()).await;
    let mut c = Client::login(f.port, BOB).await.expect("login");
    for sql in ["SET ROLE alice", "set role = 'alice'", "SET SESSION AUTHORIZATION alice", "SET LOCAL ROLE alice"] {
        let a = c.simple(sql).await;
        assert_eq!(a.error().code, "42501", "{sql}: {a:?}");
        assert!(a.error().message.contains("SET ROLE"), "{a:?}");
    }
    let a = c.round(&[parse("", "SET ROLE alice", &[]), bind("", "", &[]), execute("", 0), sync()]).await;
    assert_eq!(a.error().code, "42501", "the extended protocol too: {a:?}");
    // Other settings are still acknowledged, and the session is what it was.
    assert!(c.simple("SET extra_float_digits = 3").await.ok().kinds.contains(&b'C'));
    assert_eq!(c.simple("SELECT 1").await.ok().first().as_deref(), Some("1"));

    // psql says so too.
    let port = f.port.to_string();
    let o = tokio::task::spawn_blocking(move || {
        std::process::Command::new("psql")
            .args(["-h", "127.0.0.1", "-p", &port, "-U", BOB.0, "-d", "apron", "-X", "-A", "-t"])
            .args(["-v", "ON_ERROR_STOP=0", "-c", "SET ROLE alice", "-c", "SELECT 7"])
            .env("PGPASSWORD", BOB.1)
            .output()
            .expect("psql runs")
    })
    .await
    .expect("join");
    let (stdout, stderr) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(stderr.contains("SET ROLE"), "{stderr}");
    assert_eq!(stdout.trim(), "7", "{stderr}");
}

// ─────────────────────────── connections ───────────────────────────

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_user_cannot_take_every_session() {
    let f = start(PgLimits {
        max_connections: 6,
        ..limits(PgSessionLimits { max_connections_per_user: Some(4), ..PgSessionLimits::default() })
    })
    .await;
    let mut alice = Vec::new();
    for _ in 0..4 {
        alice.push(Client::login(f.port, ALICE).await.expect("alice"));
    }
    let e = Client::login(f.port, ALICE).await.err().expect("alice's fifth is refused");
    assert_eq!(e.severity, "FATAL");
    e.expect("53300", "pg.max_connections_per_user");
    // Another user still logs in, up to max_connections in all.
    let mut bob = vec![Client::login(f.port, BOB).await.expect("bob"), Client::login(f.port, BOB).await.expect("bob")];
    let e = Client::login(f.port, BOB).await.err().expect("all six taken");
    e.expect("53300", "pg.max_connections");
    // Those logged in are unaffected; one leaving makes room.
    assert_eq!(alice[0].simple("SELECT 1").await.ok().first().as_deref(), Some("1"));
    drop(alice.pop());
    bob.push(login_soon(f.port, BOB).await);
    assert!(f.stats.rejected() >= 2);
}

/// A login that may have to wait for a session just closed to be given back.
async fn login_soon(port: u16, user: (&str, &str)) -> Client {
    for _ in 0..100 {
        match Client::login(port, user).await {
            Ok(c) => return c,
            Err(e) => {
                e.expect("53300", "pg.max_connections");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    panic!("no session was given back within 2 s");
}

/// Sockets that connect, send two bytes of a startup message and wait.
async fn half_logins(port: u16, n: usize) -> Vec<TcpStream> {
    let mut held = Vec::new();
    for _ in 0..n {
        let mut s = Client::connect(port).await;
        s.write_all(&[0, 0]).await.expect("two bytes");
        held.push(s);
    }
    held
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sockets_that_never_log_in_do_not_keep_anyone_out() {
    let f = start(PgLimits {
        max_connections: 4,
        ..limits(PgSessionLimits {
            max_preauth_connections: 16,
            max_connections_per_user: Some(4),
            ..PgSessionLimits::default()
        })
    })
    .await;
    // Three sessions; one client that sent its startup message and never its
    // password; then a flood four times the logging-in places that never logs in.
    let mut sessions = Vec::new();
    for _ in 0..3 {
        sessions.push(Client::login(f.port, ALICE).await.expect("login"));
    }
    let mut stuck = Client { s: Client::connect(f.port).await };
    stuck.s.write_all(&startup_message(ALICE.0)).await.expect("startup");
    assert_eq!(stuck.recv().await.expect("a password request").0, b'R');
    let mut flood = half_logins(f.port, 64).await;
    // More keep coming while legitimate clients log in.
    let port = f.port;
    let more = tokio::spawn(async move {
        let mut held = Vec::new();
        for _ in 0..100 {
            held.extend(half_logins(port, 2).await);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        held
    });
    for _ in 0..5 {
        let started = Instant::now();
        let mut c = Client::login(f.port, BOB).await.expect("a login gets through the flood");
        assert!(started.elapsed() < Duration::from_secs(2), "took {:?}", started.elapsed());
        assert_eq!(c.simple("SELECT 1").await.ok().first().as_deref(), Some("1"));
        c.terminate().await;
    }
    // The flood took no session: the fourth logs in, a fifth is over max_connections.
    sessions.push(login_soon(f.port, BOB).await);
    Client::login(f.port, BOB).await.err().expect("a fifth").expect("53300", "pg.max_connections");
    flood.extend(more.await.expect("flood"));
    assert!(f.stats.preauth_evicted() >= 64 + 200 - 16 - 10, "{}", f.stats.preauth_evicted());

    // The oldest were closed to make room: the one that got as far as its startup
    // message with a FATAL naming the setting, the flood's first silently.
    let (error, _) = stuck.closed().await;
    error.expect("a FATAL").expect("53300", "pg.max_preauth_connections");
    let mut oldest = Client { s: flood.remove(0) };
    assert!(oldest.closed().await.0.is_none());
    drop(sessions);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sessions_half_sent_messages_and_unread_answers_are_closed() {
    let f = start(PgLimits {
        auth_timeout: Duration::from_secs(1),
        ..limits(PgSessionLimits {
            idle_timeout: Some(Duration::from_secs(3)),
            message_timeout: Duration::from_secs(1),
            ..PgSessionLimits::default()
        })
    })
    .await;
    let (mut idle, mut busy, mut half, mut deaf) = (
        Client::login(f.port, ALICE).await.expect("login"),
        Client::login(f.port, ALICE).await.expect("login"),
        Client::login(f.port, ALICE).await.expect("login"),
        Client::login(f.port, BOB).await.expect("login"),
    );
    let started = Instant::now();

    // Half a query, then nothing: closed after message_timeout, long before idle_timeout.
    let q = query("SELECT 1");
    half.s.write_all(&q[..q.len() - 3]).await.expect("half");
    // An answer of ~30 MB that is never read: closed once the writes stall that long.
    deaf.s.write_all(&query("SELECT repeat('x', 1000) FROM generate_series(1, 30000)")).await.expect("query");
    // Not logged in: closed at auth_timeout.
    let mut silent = Client { s: Client::connect(f.port).await };

    let busy_task = tokio::spawn(async move {
        for _ in 0..10 {
            assert_eq!(busy.simple("SELECT 2").await.ok().first().as_deref(), Some("2"));
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        busy
    });

    let (error, at) = half.closed().await;
    error.expect("a FATAL").expect("08P01", "pg.message_timeout");
    let after = at - started;
    assert!(after >= Duration::from_millis(900) && after < Duration::from_millis(2900), "{after:?}");
    // (Before its startup message there is no one to tell why.)
    let (error, at) = silent.closed().await;
    assert!(error.is_none(), "{error:?}");
    assert!(at - started < Duration::from_millis(2900), "{:?}", at - started);

    let (error, at) = idle.closed().await;
    error.expect("a FATAL").expect("57P05", "pg.idle_timeout");
    let after = at - started;
    assert!(after >= Duration::from_millis(2500) && after < Duration::from_secs(6), "{after:?}");

    // A session that keeps talking is never idle.
    let mut busy = busy_task.await.expect("busy");
    assert_eq!(busy.simple("SELECT 3").await.ok().first().as_deref(), Some("3"));
    assert!(started.elapsed() > Duration::from_secs(5));

    assert!(
        f.stats.message_timeouts() >= 2,
        "the half-sent query and the unread answer: {}",
        f.stats.message_timeouts()
    );
    assert_eq!(f.stats.idle_timeouts(), 1);
    drop(deaf);
}
