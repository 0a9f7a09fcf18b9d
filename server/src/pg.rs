//! The PostgreSQL wire protocol listener (`:5433`): the same read-only SQL as
//! `POST /api/v1/sql`, for psql, Grafana's PostgreSQL datasource and BI tools.
//!
//! ```text
//!  TCP accept ─► logging in: at most [pg] max_preauth_connections (128) at once; one
//!       more closes the oldest of them instead of being refused (`slots`)
//!    ─► pgwire (startup, simple and extended query protocols), the client's bytes
//!       framed by `Guard`
//!    TLS + startup + authentication within [pg] auth_timeout (5 s), or closed
//!    TLS: SSLRequest answered with rustls when [pg.tls] or [server.tls] is set
//!    startup: `trust` (apron up: user `apron` only, loopback) or `password` (apron serve:
//!             [[pg.users]], cleartext password inside TLS, compared in constant time;
//!             each user has a role)
//!    logged in: a session of [pg] max_connections (256), at most
//!             max_connections_per_user (a quarter of that) of one user's; over either:
//!             FATAL 53300 before AuthenticationOk
//!    a session idle for [pg] idle_timeout (10 min): FATAL 57P05, closed; a message
//!             begun and not finished within message_timeout (30 s), or an answer the
//!             client does not read for that long: closed
//!    Query text over [sql] max_body_bytes (1 MiB, as HTTP): never buffered (`Guard` drops
//!             it as it arrives and passes an empty stand-in on), ErrorResponse 54000
//!             naming the setting; the connection stays usable. A Parse or Bind over
//!             that + 64 KiB: dropped the same way, 54000, the connection goes on after
//!             Sync. Any other message over it: FATAL 54000, connection closed.
//!    Query "SELECT …" ─► QueryEngine::execute_as(the user's scope: a team:<name> user
//!             reads that team's rows only; same plan checks, timeout, memory and
//!             row limits as HTTP) ─► arrow-pg: Arrow batches → text rows with pg types
//!    Query "SET …" / "BEGIN" / "COMMIT" / "ROLLBACK" / "SAVEPOINT" / "DISCARD ALL":
//!             acknowledged, no effect (clients send them on connect; nothing here is
//!             transactional; BEGIN/COMMIT do move the transaction status clients track;
//!             DISCARD ALL and DEALLOCATE do close prepared statements and portals)
//!    "SET ROLE …" / "SET SESSION AUTHORIZATION …": refused (42501): a session keeps
//!             the identity it logged in with
//!    Query "SHOW <session parameter>" (transaction isolation level, server_version, …):
//!             the fixed answer drivers expect (apron_query::pgcompat::SETTINGS, which
//!             current_setting() answers from too)
//!    extended protocol: Parse ─► the same size limit, then QueryEngine::describe_as
//!             (parsed, checked and planned as a query would be, under the user's scope)
//!             → parameter types and result columns for Describe; Bind stores the values;
//!             Execute ─► `params`: each value read as the client sent it and bound in
//!             the type its place wants where it is exactly that (else in its own, for
//!             DataFusion to coerce the comparison; 22xxx where it cannot be compared)
//!             ─► QueryEngine::execute_request_as(text + bound values): the same
//!             path, checks, timeout and limits as a simple query; a row limit on
//!             Execute sends that many and suspends the portal for the next.
//!             What a connection keeps is bounded (`session`): [pg] max_statements
//!             (1024), max_portals (64, suspended ones included), max_param_bytes per
//!             value (1 MiB), max_session_bytes (64 MiB of statement texts, values and
//!             suspended results) and, beyond each connection's first 2 MiB,
//!             max_total_session_bytes (1 GiB) for all together: past one, the Parse,
//!             Bind or Execute is refused (54000 / 53200 naming the setting), nothing
//!             already acknowledged is dropped, and the connection goes on
//!    every query is read as a PostgreSQL client's (datafusion-pg-catalog's rewrites of
//!             catalog operators and casts, then apron_query::pgcompat's: Grafana's
//!             search-path subquery, catalog scalar subqueries, PostgreSQL type names in
//!             information_schema.columns); `pg_catalog` and `information_schema`
//!             describe the user's own session (the same tables and columns for all)
//!    errors ─► ErrorResponse with a SQLSTATE (25006 read-only, 42601 syntax, 57014
//!             timeout, 53200 memory, 54000 too many rows, 53300 busy, …)
//! ```

mod params;
mod session;
mod slots;

use std::fmt::Debug;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use apron_query::{Described, QueryEngine, QueryError, Request, Scope};
use async_trait::async_trait;
use datafusion::arrow::datatypes::DataType;
use futures::{Sink, SinkExt, StreamExt, stream};
use pgwire::api::auth::{
    DefaultServerParameterProvider, LoginInfo, StartupHandler, finish_authentication, protocol_negotiation,
    save_startup_parameters_to_metadata,
};
use pgwire::api::portal::{Format, Portal, PortalExecutionState};
use pgwire::api::query::{ExtendedQueryHandler, SimpleQueryHandler};
use pgwire::api::results::{FieldInfo, QueryResponse, Response, Tag};
use pgwire::api::stmt::{QueryParser, StoredStatement};
use pgwire::api::store::{Entry, PortalStore};
use pgwire::api::{
    ClientInfo, ClientPortalStore, DEFAULT_NAME, ErrorHandler, PgWireConnectionState, PgWireServerHandlers,
    PidSecretKeyGenerator, RandomPidSecretKeyGenerator, Type,
};
use pgwire::error::{ErrorInfo, PgWireError, PgWireResult};
use pgwire::messages::extendedquery::{
    Bind, BindComplete, Close, CloseComplete, Execute, Parse, ParseComplete, Sync as PgSync, TARGET_TYPE_BYTE_PORTAL,
    TARGET_TYPE_BYTE_STATEMENT,
};
use pgwire::messages::response::ReadyForQuery;
use pgwire::messages::simplequery::Query;
use pgwire::messages::startup::Authentication;
use pgwire::messages::{PgWireBackendMessage, PgWireFrontendMessage};
use pgwire::tokio::server::{MaybeTls, PgWireMessageServerCodec, negotiate_tls, process_error, process_message};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::codec::{Framed, FramedParts};

use crate::access::Role;
use session::{Ledger, STATEMENT_OVERHEAD};
use slots::{Login, Slots, Ticket};

/// The user `apron up` accepts without a password.
pub const UP_USER: &str = "apron";

/// `[pg] max_connections` when unset.
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;
/// `[pg] auth_timeout` when unset: TLS, startup and a password take milliseconds.
pub const DEFAULT_AUTH_TIMEOUT: Duration = Duration::from_secs(5);
/// How much larger than the SQL limit any other message may be: a Parse carries the
/// query text plus parameter types; startup, password and the rest are far smaller.
const MESSAGE_SLACK: usize = 64 << 10;

/// The listener's limits (`[pg]`, and `[sql] max_body_bytes` shared with HTTP).
#[derive(Debug, Clone)]
pub struct PgLimits {
    /// Logged-in sessions at once; a login past them is refused (FATAL 53300).
    pub max_connections: usize,
    /// TLS, startup and authentication must be done within this of the accept.
    pub auth_timeout: Duration,
    /// The longest query text, in bytes.
    pub max_sql_bytes: usize,
    /// What each session may hold, and the other connection limits.
    pub session: PgSessionLimits,
    /// Counters; share the `Arc` to read them.
    pub stats: Arc<PgStats>,
}

impl Default for PgLimits {
    fn default() -> Self {
        PgLimits {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            auth_timeout: DEFAULT_AUTH_TIMEOUT,
            max_sql_bytes: crate::config::HttpOptions::default().max_sql_bytes,
            session: PgSessionLimits::default(),
            stats: Arc::default(),
        }
    }
}

/// `[pg]`'s limits beyond `max_connections` and `auth_timeout`: connections logging in,
/// per user, idle and stalled ones, and what one session may hold through the extended
/// protocol. The defaults are the documented ones (`docs/security.md`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PgSessionLimits {
    /// Connections still logging in at once (TLS, startup, password); one more closes
    /// the oldest of them. Counted apart from `max_connections`.
    pub max_preauth_connections: usize,
    /// Sessions one user may have open; `None`: a quarter of `max_connections` (at
    /// least 1).
    pub max_connections_per_user: Option<usize>,
    /// A logged-in session that sends nothing for this long is closed (FATAL 57P05);
    /// `None`: never.
    pub idle_timeout: Option<Duration>,
    /// A message begun must arrive whole within this, and an answer must not wait on a
    /// client that does not read for longer; otherwise the connection is closed.
    pub message_timeout: Duration,
    /// Prepared statements one connection may have.
    pub max_statements: usize,
    /// Portals one connection may have open, suspended ones included.
    pub max_portals: usize,
    /// One bound parameter value, in bytes.
    pub max_param_bytes: usize,
    /// What one connection may hold: statement texts, bound values and the buffered
    /// rest of suspended portals' results.
    pub max_session_bytes: usize,
    /// What all connections together may hold beyond each one's first
    /// [`session::OWN_BYTES`] (2 MiB).
    pub max_total_session_bytes: usize,
}

impl Default for PgSessionLimits {
    fn default() -> Self {
        PgSessionLimits {
            max_preauth_connections: 128,
            max_connections_per_user: None,
            idle_timeout: Some(Duration::from_secs(600)),
            message_timeout: Duration::from_secs(30),
            max_statements: 1024,
            max_portals: 64,
            max_param_bytes: 1 << 20,
            max_session_bytes: 64 << 20,
            max_total_session_bytes: 1 << 30,
        }
    }
}

impl PgSessionLimits {
    /// Sessions one user may have, given `max_connections`.
    pub fn per_user(&self, max_connections: usize) -> usize {
        self.max_connections_per_user.unwrap_or(max_connections / 4).max(1)
    }
}

/// What the limits did, totals since start (except [`PgStats::active`] and
/// [`PgStats::held_bytes`]).
#[derive(Debug, Default)]
pub struct PgStats {
    accepted: AtomicU64,
    active: AtomicU64,
    rejected: AtomicU64,
    preauth_evicted: AtomicU64,
    auth_timeouts: AtomicU64,
    idle_timeouts: AtomicU64,
    message_timeouts: AtomicU64,
    oversized: AtomicU64,
    session_refusals: AtomicU64,
    held_bytes: AtomicUsize,
}

impl PgStats {
    /// Connections accepted.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }
    /// Connections open now (logging in or logged in).
    pub fn active(&self) -> u64 {
        self.active.load(Ordering::Relaxed)
    }
    /// Logins refused because `max_connections` sessions, or `max_connections_per_user`
    /// of the user's, were open.
    pub fn rejected(&self) -> u64 {
        self.rejected.load(Ordering::Relaxed)
    }
    /// Connections still logging in closed to make room (`max_preauth_connections`).
    pub fn preauth_evicted(&self) -> u64 {
        self.preauth_evicted.load(Ordering::Relaxed)
    }
    /// Connections closed because startup and authentication took too long.
    pub fn auth_timeouts(&self) -> u64 {
        self.auth_timeouts.load(Ordering::Relaxed)
    }
    /// Sessions closed after `idle_timeout`.
    pub fn idle_timeouts(&self) -> u64 {
        self.idle_timeouts.load(Ordering::Relaxed)
    }
    /// Connections closed because a message (theirs or the answer) stalled past
    /// `message_timeout`.
    pub fn message_timeouts(&self) -> u64 {
        self.message_timeouts.load(Ordering::Relaxed)
    }
    /// Queries (and other messages) refused for their size.
    pub fn oversized(&self) -> u64 {
        self.oversized.load(Ordering::Relaxed)
    }
    /// Parse, Bind and Execute refused by a session limit (statements, portals, bytes).
    pub fn session_refusals(&self) -> u64 {
        self.session_refusals.load(Ordering::Relaxed)
    }
    /// Bytes the sessions hold now beyond each one's own first 2 MiB
    /// (`max_total_session_bytes` bounds it).
    pub fn held_bytes(&self) -> usize {
        self.held_bytes.load(Ordering::Relaxed)
    }
}

/// One PostgreSQL user. `Debug` never shows the password.
#[derive(Clone)]
pub struct PgUser {
    pub name: String,
    pub password: String,
    pub role: Role,
}

impl std::fmt::Debug for PgUser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgUser").field("name", &self.name).field("role", &self.role).finish_non_exhaustive()
    }
}

/// How clients authenticate.
#[derive(Clone, Debug)]
pub enum PgAuth {
    /// `apron up`: single user on loopback, no password; any other user is refused.
    Trust { user: String },
    /// `apron serve`: `[[pg.users]]`.
    Password(Arc<[PgUser]>),
}

impl PgAuth {
    /// The rows `user` (already authenticated) may read.
    fn scope(&self, user: Option<&str>) -> Option<Scope> {
        match self {
            PgAuth::Trust { user: trusted } => (user == Some(trusted.as_str())).then_some(Scope::All),
            PgAuth::Password(users) => users.iter().find(|u| Some(u.name.as_str()) == user)?.role.read_scope(),
        }
    }
}

/// What every connection shares.
struct Shared {
    engine: Arc<QueryEngine>,
    auth: PgAuth,
    /// With TLS configured, a client that did not ask for it is refused before it
    /// sends a password in the clear.
    require_tls: bool,
    limits: PgLimits,
    slots: Arc<Slots>,
    pids: RandomPidSecretKeyGenerator,
}

/// The query handlers (simple and extended protocol) of one connection.
struct Queries {
    shared: Arc<Shared>,
    /// What [`Guard`] saw on this connection.
    seen: Arc<Seen>,
    parser: Arc<Parser>,
    /// What this connection's statements and portals hold (`session`).
    ledger: Mutex<Ledger>,
}

impl Queries {
    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Set by a connection's [`Guard`] as the client's bytes pass, read by its handlers.
#[derive(Debug, Default)]
struct Seen {
    /// Length of the query text `Guard` dropped (0: none): the empty query it passed on
    /// instead stands for it.
    dropped_query: AtomicUsize,
    /// Length of a Parse message `Guard` dropped (0: none): the empty Parse it passed on
    /// stands for it.
    dropped_parse: AtomicUsize,
    /// Length of a Bind message `Guard` dropped (0: none): the empty Bind it passed on
    /// stands for it.
    dropped_bind: AtomicUsize,
    /// Length of a message over the limit that ended the connection (0: none).
    fatal_message: AtomicUsize,
}

impl Seen {
    /// A stand-in's flag is taken by the handler of the stand-in, the very next message;
    /// only after an error (the extended protocol then skips to Sync) can one be left
    /// over, and Sync clears it.
    fn clear(&self) {
        self.dropped_query.store(0, Ordering::Relaxed);
        self.dropped_parse.store(0, Ordering::Relaxed);
        self.dropped_bind.store(0, Ordering::Relaxed);
    }
}

/// An ErrorResponse (severity ERROR) with this SQLSTATE.
fn error(code: &str, message: String) -> PgWireError {
    PgWireError::UserError(Box::new(ErrorInfo::new("ERROR".to_owned(), code.to_owned(), message)))
}

/// The ErrorResponse for a query text over `[sql] max_body_bytes`.
fn too_long(len: usize, max: usize) -> PgWireError {
    error(
        "54000",
        format!("the query text ({len} bytes) is larger than the server's limit of {max} bytes (sql.max_body_bytes)"),
    )
}

/// The ErrorResponse for a Parse or Bind message `Guard` dropped.
fn message_too_long(what: &str, len: usize, max: usize) -> PgWireError {
    error(
        "54000",
        format!(
            "a {what} message of {len} bytes is larger than the server's limit of {max} bytes \
             (sql.max_body_bytes + 64 KiB)"
        ),
    )
}

/// Maps a query error to the SQLSTATE a PostgreSQL client understands.
fn pg_error(e: &QueryError) -> PgWireError {
    let code = match e {
        QueryError::ReadOnly { .. } => "25006",
        QueryError::Syntax { .. } => "42601",
        QueryError::Plan { .. } => "42P01",
        QueryError::Invalid { .. } => "22000",
        QueryError::TooComplex { .. } => "54001",
        QueryError::Timeout { .. } => "57014",
        QueryError::MemoryLimit { .. } => "53200",
        QueryError::TooManyRows { .. } | QueryError::ResultTooLarge { .. } => "54000",
        QueryError::Busy { .. } => "53300",
        // cannot_connect_now: the query cluster, retry later.
        QueryError::Cluster { .. } => "57P03",
        _ => "XX000",
    };
    let mut info = ErrorInfo::new("ERROR".to_owned(), code.to_owned(), e.to_string());
    info.detail = Some(e.detail().to_owned()).filter(|d| !d.is_empty() && !e.to_string().contains(d.as_str()));
    PgWireError::UserError(Box::new(info))
}

/// True when nothing but `--` / `/* */` comments, whitespace and semicolons is left.
fn is_comment_only(query: &str) -> bool {
    let mut rest = query;
    loop {
        rest = rest.trim_start_matches(|c: char| c.is_whitespace() || c == ';');
        if let Some(after) = rest.strip_prefix("--") {
            rest = after.split_once('\n').map_or("", |(_, r)| r);
        } else if let Some(after) = rest.strip_prefix("/*") {
            rest = after.split_once("*/").map_or("", |(_, r)| r);
        } else {
            return rest.is_empty();
        }
    }
}

/// Session statements clients send on connect, acknowledged without effect (nothing
/// here is transactional: savepoints, too, have nothing to undo).
fn session_noop(query: &str) -> Option<&'static str> {
    let mut words = query.split(|c: char| c.is_whitespace() || c == ';').filter(|w| !w.is_empty());
    let first = words.next()?.to_ascii_uppercase();
    match first.as_str() {
        "SET" => Some("SET"),
        "BEGIN" | "START" => Some("BEGIN"),
        "COMMIT" | "END" => Some("COMMIT"),
        // `ROLLBACK TO [SAVEPOINT] x` stays inside the block.
        "ROLLBACK" if words.next().is_some_and(|w| w.eq_ignore_ascii_case("TO")) => Some("ROLLBACK TO"),
        "ROLLBACK" | "ABORT" => Some("ROLLBACK"),
        "SAVEPOINT" => Some("SAVEPOINT"),
        "RELEASE" => Some("RELEASE"),
        "DISCARD" => Some("DISCARD ALL"),
        _ => None,
    }
}

/// `SET ROLE …`, `SET SESSION AUTHORIZATION …` (with `SESSION`/`LOCAL`, or as `SET role
/// TO …`): a client must not believe it changed who it is, so these are refused rather
/// than acknowledged like the other `SET`s.
fn changes_identity(query: &str) -> bool {
    let words: Vec<String> = query
        .split(|c: char| c.is_whitespace() || c == ';' || c == '=')
        .filter(|w| !w.is_empty())
        .take(4)
        .map(|w| w.trim_matches('"').to_ascii_lowercase())
        .collect();
    let Some((first, mut rest)) = words.split_first() else { return false };
    if first != "set" {
        return false;
    }
    if let [scope, next, ..] = rest
        && (scope == "local" || (scope == "session" && next != "authorization"))
    {
        rest = &rest[1..];
    }
    matches!(rest, [role, ..] if role == "role")
        || matches!(rest, [session, authorization, ..] if session == "session" && authorization == "authorization")
}

fn identity_refused() -> PgWireError {
    error(
        "42501",
        "SET ROLE and SET SESSION AUTHORIZATION are not supported: a session keeps the user (and the role) it \
         logged in with; log in as another [pg] user instead"
            .to_owned(),
    )
}

/// `DEALLOCATE [PREPARE] name | ALL`: `Some(None)` for ALL. An unquoted name is folded
/// to lower case, as PostgreSQL does.
fn deallocate(query: &str) -> Option<Option<String>> {
    let mut words = query.split(|c: char| c.is_whitespace() || c == ';').filter(|w| !w.is_empty());
    if !words.next()?.eq_ignore_ascii_case("DEALLOCATE") {
        return None;
    }
    let mut name = words.next()?;
    if name.eq_ignore_ascii_case("PREPARE") {
        name = words.next()?;
    }
    if name.eq_ignore_ascii_case("ALL") {
        return Some(None);
    }
    Some(Some(match name.strip_prefix('"').and_then(|n| n.strip_suffix('"')) {
        Some(quoted) => quoted.replace("\"\"", "\""),
        None => name.to_ascii_lowercase(),
    }))
}

/// `DISCARD ALL`: closes every prepared statement and portal of the connection too.
fn discards_all(query: &str) -> bool {
    let mut words = query.split(|c: char| c.is_whitespace() || c == ';').filter(|w| !w.is_empty());
    words.next().is_some_and(|w| w.eq_ignore_ascii_case("DISCARD"))
        && words.next().is_some_and(|w| w.eq_ignore_ascii_case("ALL"))
}

/// The answer to a session statement: `BEGIN` opens a (read-only, effect-free)
/// transaction block and `COMMIT`/`ROLLBACK` close it, so that the transaction status
/// clients track (asyncpg's cursors need one open) follows what they sent.
fn noop_response(tag: &'static str) -> Response {
    match tag {
        "BEGIN" => Response::TransactionStart(Tag::new(tag)),
        "COMMIT" | "ROLLBACK" => Response::TransactionEnd(Tag::new(tag)),
        "ROLLBACK TO" => Response::Execution(Tag::new("ROLLBACK")),
        _ => Response::Execution(Tag::new(tag)),
    }
}

/// `SHOW <parameter>` for the session parameters drivers read on connect (SQLAlchemy's
/// isolation level, JDBC's and asyncpg's settings): the name and the fixed answer.
fn session_show(query: &str) -> Option<(String, &'static str)> {
    let words: Vec<String> = query
        .trim()
        .trim_end_matches(';')
        .split_whitespace()
        .map(|w| w.trim_matches('"').to_ascii_lowercase())
        .collect();
    if words.first().map(String::as_str) != Some("show") || words.len() < 2 {
        return None;
    }
    let name = words[1..].join(" ");
    let value = apron_query::pgcompat::setting(&name)?;
    Some((name.replace(' ', "_"), value))
}

/// One text column, one row: a `SHOW` answer.
fn show_response(name: &str, value: &str, format: &Format) -> PgWireResult<QueryResponse> {
    use datafusion::arrow::array::StringArray;
    use datafusion::arrow::datatypes::{Field, Schema};
    let schema = Arc::new(Schema::new(vec![Field::new(name, DataType::Utf8, false)]));
    let batch =
        datafusion::arrow::array::RecordBatch::try_new(schema.clone(), vec![Arc::new(StringArray::from(vec![value]))])
            .map_err(|e| PgWireError::ApiError(Box::new(e)))?;
    encode(apron_query::QueryResult { schema, batches: vec![batch], distributed: false }, format)
}

#[async_trait]
impl SimpleQueryHandler for Queries {
    async fn on_query<C>(&self, client: &mut C, query: Query) -> PgWireResult<()>
    where
        C: ClientInfo + ClientPortalStore + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::PortalStore: PortalStore,
        C::Error: Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        // Size first, before anything looks at the text (pgwire answers an empty query
        // itself, so this cannot wait for `do_query`). An empty query right after
        // `Guard` dropped one is its stand-in (see `Guard`); a text over the limit that
        // got here anyway (invalid UTF-8 repaired into longer text) is refused the same.
        let max = self.shared.limits.max_sql_bytes;
        let dropped = if query.query.is_empty() { self.seen.dropped_query.swap(0, Ordering::Relaxed) } else { 0 };
        if dropped > 0 || query.query.len() > max {
            self.shared.limits.stats.oversized.fetch_add(1, Ordering::Relaxed);
            return Err(too_long(dropped.max(query.query.len()), max));
        }
        self.shared.notice_stale_shards(client).await?;
        self._on_query(client, query).await
    }

    async fn do_query<C>(&self, client: &mut C, query: &str) -> PgWireResult<Vec<Response>>
    where
        C: ClientInfo + ClientPortalStore + Unpin + Send + Sync,
        C::PortalStore: PortalStore,
    {
        if is_comment_only(query) {
            // Grafana's health check and connection pools send `-- ping`.
            return Ok(vec![Response::EmptyQuery]);
        }
        if changes_identity(query) {
            return Err(identity_refused());
        }
        if let Some(name) = deallocate(query) {
            return Ok(vec![self.deallocate(client.portal_store(), name.as_deref())?]);
        }
        if discards_all(query) {
            self.discard_all(client.portal_store());
        }
        if let Some(tag) = session_noop(query) {
            return Ok(vec![noop_response(tag)]);
        }
        if let Some((name, value)) = session_show(query) {
            return Ok(vec![Response::Query(show_response(&name, value, &Format::UnifiedText)?)]);
        }
        let scope = self.shared.scope_of(client)?;
        let request = Request { sql: query.to_owned(), pg_client: true, params: None };
        let result = self.shared.engine.execute_request_as(request, &scope).await.map_err(|e| pg_error(&e))?;
        Ok(vec![Response::Query(encode(result, &Format::UnifiedText)?)])
    }
}

impl Queries {
    /// `DEALLOCATE name` / `DEALLOCATE ALL`: the statements leave pgwire's store and the
    /// ledger.
    fn deallocate<S: PortalStore>(&self, store: &S, name: Option<&str>) -> PgWireResult<Response> {
        let mut ledger = self.ledger();
        let names = match name {
            None => ledger.statement_names(),
            Some(n) if ledger.has_statement(n) => vec![n.to_owned()],
            Some(n) => return Err(error("26000", format!("prepared statement \"{n}\" does not exist"))),
        };
        for n in names {
            store.rm_statement(&n);
            ledger.forget_statement(&n);
        }
        Ok(Response::Execution(Tag::new(if name.is_some() { "DEALLOCATE" } else { "DEALLOCATE ALL" })))
    }

    /// `DISCARD ALL`: every statement and portal of the connection is closed.
    fn discard_all<S: PortalStore>(&self, store: &S) {
        let mut ledger = self.ledger();
        for n in ledger.statement_names() {
            store.rm_statement(&n);
            ledger.forget_statement(&n);
        }
        for n in ledger.portal_names() {
            store.rm_portal(&n);
            ledger.forget_portal(&n);
        }
    }
}

/// A query's rows as pg rows in `format` (text or binary per column, as the client
/// asked in Bind; the simple protocol is all text), encoded a batch at a time as they
/// are sent: a suspended portal holds its Arrow batches (what the engine bounded by
/// `[query] max_result_bytes`, and what the session's ledger counts), not a second,
/// encoded copy of them.
fn encode(result: apron_query::QueryResult, format: &Format) -> PgWireResult<QueryResponse> {
    let fields = Arc::new(arrow_pg::datatypes::arrow_schema_to_pg_fields(&result.schema, format, None)?);
    let per_batch = fields.clone();
    let rows =
        result.batches.into_iter().flat_map(move |b| arrow_pg::datatypes::encode_recordbatch(per_batch.clone(), b));
    Ok(QueryResponse::new(fields, stream::iter(rows)))
}

impl Shared {
    /// On a query server of a cluster, a NOTICE naming the shards whose collectors are
    /// not current (psql prints it above the rows; drivers hand it to their notice
    /// handler). Nothing otherwise.
    async fn notice_stale_shards<C>(&self, client: &mut C) -> PgWireResult<()>
    where
        C: Sink<PgWireBackendMessage> + Unpin + Send,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        let stale = self.engine.stale_shards().await;
        if stale.is_empty() {
            return Ok(());
        }
        let info = ErrorInfo::new(
            "NOTICE".to_owned(),
            "01000".to_owned(),
            format!("stale shards (answered from what they last persisted): {}", stale.join(", ")),
        );
        client.send(PgWireBackendMessage::NoticeResponse(info.into())).await?;
        Ok(())
    }

    /// The rows the connection's user (authenticated by the startup handler) may read.
    fn scope_of<C: ClientInfo>(&self, client: &C) -> PgWireResult<Scope> {
        let user = client.metadata().get(pgwire::api::METADATA_USER).cloned();
        self.auth.scope(user.as_deref()).ok_or_else(|| {
            PgWireError::UserError(Box::new(ErrorInfo::new(
                "ERROR".to_owned(),
                "42501".to_owned(),
                format!("user {:?} may not query", user.unwrap_or_default()),
            )))
        })
    }
}

/// A statement of the extended protocol (Parse): planned once for its description,
/// run from its text and the bound values at Execute, through the same engine path as
/// a simple query.
#[derive(Clone, Debug)]
enum Prepared {
    /// `SET`, `BEGIN`, … acknowledged without effect, as in the simple protocol.
    Noop(&'static str),
    /// `SHOW <session parameter>`: its name and fixed value.
    Show(String, &'static str),
    /// `DEALLOCATE name` (`None`: ALL).
    Deallocate(Option<String>),
    /// `DISCARD ALL`.
    DiscardAll,
    Query(Arc<PreparedQuery>),
}

#[derive(Debug)]
struct PreparedQuery {
    sql: String,
    described: Described,
}

/// Parse: the size limit, then the engine's checks and plan under the user's scope.
struct Parser {
    shared: Arc<Shared>,
}

#[async_trait]
impl QueryParser for Parser {
    type Statement = Prepared;

    async fn parse_sql<C>(&self, client: &C, sql: &str, _types: &[Option<Type>]) -> PgWireResult<Option<Prepared>>
    where
        C: ClientInfo + Unpin + Send + Sync,
    {
        let max = self.shared.limits.max_sql_bytes;
        if sql.len() > max {
            self.shared.limits.stats.oversized.fetch_add(1, Ordering::Relaxed);
            return Err(too_long(sql.len(), max));
        }
        if is_comment_only(sql) {
            return Ok(None);
        }
        if changes_identity(sql) {
            return Err(identity_refused());
        }
        if let Some(name) = deallocate(sql) {
            return Ok(Some(Prepared::Deallocate(name)));
        }
        if discards_all(sql) {
            return Ok(Some(Prepared::DiscardAll));
        }
        if let Some(tag) = session_noop(sql) {
            return Ok(Some(Prepared::Noop(tag)));
        }
        if let Some((name, value)) = session_show(sql) {
            return Ok(Some(Prepared::Show(name, value)));
        }
        let scope = self.shared.scope_of(client)?;
        let request = Request { sql: sql.to_owned(), pg_client: true, params: None };
        let described = self.shared.engine.describe_as(request, &scope).await.map_err(|e| pg_error(&e))?;
        Ok(Some(Prepared::Query(Arc::new(PreparedQuery { sql: sql.to_owned(), described }))))
    }

    fn get_parameter_types(&self, stmt: &Prepared) -> PgWireResult<Vec<Type>> {
        let Prepared::Query(q) = stmt else { return Ok(Vec::new()) };
        q.described
            .params
            .iter()
            .map(|t| match t {
                Some(t) => arrow_pg::datatypes::into_pg_type(t),
                None => Ok(Type::UNKNOWN),
            })
            .collect()
    }

    fn get_result_schema(&self, stmt: &Prepared, format: Option<&Format>) -> PgWireResult<Vec<FieldInfo>> {
        if let Prepared::Show(name, value) = stmt {
            let fields = show_response(name, value, format.unwrap_or(&Format::UnifiedText))?.row_schema;
            return Ok(fields.iter().cloned().collect());
        }
        let Prepared::Query(q) = stmt else { return Ok(Vec::new()) };
        arrow_pg::datatypes::arrow_schema_to_pg_fields(
            &q.described.schema,
            format.unwrap_or(&Format::UnifiedText),
            None,
        )
    }
}

/// pgwire's extended-protocol handlers, with the connection's ledger (`session`) kept
/// beside its statement and portal store: Parse, Bind and Execute are refused before
/// anything is stored past a limit; Close, Sync, DEALLOCATE and DISCARD ALL give back.
#[async_trait]
impl ExtendedQueryHandler for Queries {
    type Statement = Prepared;
    type QueryParser = Parser;

    fn query_parser(&self) -> Arc<Parser> {
        self.parser.clone()
    }

    async fn on_parse<C>(&self, client: &mut C, message: Parse) -> PgWireResult<()>
    where
        C: ClientInfo + ClientPortalStore + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::PortalStore: PortalStore<Statement = Self::Statement>,
        C::Error: Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        let dropped = self.seen.dropped_parse.swap(0, Ordering::Relaxed);
        if dropped > 0 {
            self.shared.limits.stats.oversized.fetch_add(1, Ordering::Relaxed);
            let max = self.shared.limits.max_sql_bytes.saturating_add(MESSAGE_SLACK);
            return Err(message_too_long("Parse", dropped, max));
        }
        let name = message.name.clone().unwrap_or_else(|| DEFAULT_NAME.to_owned());
        let bytes = message.query.len() + name.len() + STATEMENT_OVERHEAD;
        // Refused before it is planned; taken once it is.
        self.ledger().statement(&name, bytes, false)?;
        let statement = StoredStatement::parse(client, &message, self.query_parser()).await?;
        self.ledger().statement(&name, bytes, true)?;
        match statement {
            Some(s) => client.portal_store().put_statement(Arc::new(s)),
            None => client.portal_store().put_empty_statement(&name),
        }
        client.send(PgWireBackendMessage::ParseComplete(ParseComplete::new())).await?;
        Ok(())
    }

    async fn on_bind<C>(&self, client: &mut C, mut message: Bind) -> PgWireResult<()>
    where
        C: ClientInfo + ClientPortalStore + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::PortalStore: PortalStore<Statement = Self::Statement>,
        C::Error: Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        let limits = &self.shared.limits;
        let dropped = self.seen.dropped_bind.swap(0, Ordering::Relaxed);
        if dropped > 0 {
            limits.stats.oversized.fetch_add(1, Ordering::Relaxed);
            return Err(message_too_long("Bind", dropped, limits.max_sql_bytes.saturating_add(MESSAGE_SLACK)));
        }
        let max_param = limits.session.max_param_bytes;
        if let Some((n, len)) = message
            .parameters
            .iter()
            .enumerate()
            .find_map(|(n, p)| Some((n, p.as_ref()?.len())).filter(|p| p.1 > max_param))
        {
            limits.stats.oversized.fetch_add(1, Ordering::Relaxed);
            return Err(error(
                "54000",
                format!(
                    "parameter ${} is {len} bytes, larger than the server's limit of {max_param} bytes \
                     (pg.max_param_bytes)",
                    n + 1
                ),
            ));
        }
        let statement_name = message.statement_name.clone().unwrap_or_else(|| DEFAULT_NAME.to_owned());
        let portal_name = message.portal_name.clone().unwrap_or_else(|| DEFAULT_NAME.to_owned());
        let statement = match client.portal_store().get_statement(&statement_name) {
            Some(Entry::Value(statement)) => Some(statement),
            Some(Entry::Empty) => None,
            None => return Err(PgWireError::StatementNotFound(statement_name)),
        };
        if statement.is_none() && !message.parameters.is_empty() {
            return Err(error(
                "08P01",
                format!(
                    "bind message supplies {} parameters, but prepared statement \"{statement_name}\" requires 0",
                    message.parameters.len()
                ),
            ));
        }
        let values: usize = message.parameters.iter().flatten().map(|p| p.len()).sum();
        self.ledger().portal(&portal_name, &statement_name, values + portal_name.len())?;
        match statement {
            Some(statement) => {
                // The values are slices of the connection's read buffer: copied, a
                // portal holds what the ledger counts and not the buffer around them.
                for p in message.parameters.iter_mut().flatten() {
                    *p = p.to_vec().into();
                }
                let portal = Portal::try_new(&message, statement)?;
                client.portal_store().put_portal(Arc::new(portal));
            }
            None => client.portal_store().put_empty_portal(&portal_name),
        }
        client.send(PgWireBackendMessage::BindComplete(BindComplete::new())).await?;
        Ok(())
    }

    async fn on_execute<C>(&self, client: &mut C, message: Execute) -> PgWireResult<()>
    where
        C: ClientInfo + ClientPortalStore + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::PortalStore: PortalStore<Statement = Self::Statement>,
        C::Error: Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        let name = message.name.clone().unwrap_or_else(|| DEFAULT_NAME.to_owned());
        let outcome = self._on_execute(client, message).await;
        // What the portal holds now: nothing once read to its end, and nothing at all
        // once gone (COMMIT through the extended protocol drops the unnamed one).
        match client.portal_store().get_portal(&name) {
            None => self.ledger().forget_portal(&name),
            Some(Entry::Value(portal)) => {
                if self.ledger().suspended(&name)
                    && !matches!(*portal.state().lock().await, PortalExecutionState::Suspended(_))
                {
                    self.ledger().finished(&name);
                }
            }
            Some(Entry::Empty) => {}
        }
        outcome
    }

    async fn on_close<C>(&self, client: &mut C, message: Close) -> PgWireResult<()>
    where
        C: ClientInfo + ClientPortalStore + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::PortalStore: PortalStore<Statement = Self::Statement>,
        C::Error: Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        let name = message.name.as_deref().unwrap_or(DEFAULT_NAME);
        match message.target_type {
            TARGET_TYPE_BYTE_STATEMENT => {
                client.portal_store().rm_statement(name);
                self.ledger().forget_statement(name);
            }
            TARGET_TYPE_BYTE_PORTAL => {
                client.portal_store().rm_portal(name);
                self.ledger().forget_portal(name);
            }
            _ => {}
        }
        client.send(PgWireBackendMessage::CloseComplete(CloseComplete::new())).await?;
        Ok(())
    }

    async fn on_sync<C>(&self, client: &mut C, _message: PgSync) -> PgWireResult<()>
    where
        C: ClientInfo + ClientPortalStore + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::PortalStore: PortalStore<Statement = Self::Statement>,
        C::Error: Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        self.seen.clear();
        client.portal_store().rm_portal(DEFAULT_NAME);
        self.ledger().forget_portal(DEFAULT_NAME);
        let status = client.transaction_status();
        client.send(PgWireBackendMessage::ReadyForQuery(ReadyForQuery::new(status))).await?;
        client.flush().await?;
        Ok(())
    }

    async fn do_query<C>(&self, client: &mut C, portal: &Portal<Prepared>, max_rows: usize) -> PgWireResult<Response>
    where
        C: ClientInfo + ClientPortalStore + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::PortalStore: PortalStore<Statement = Prepared>,
        C::Error: Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        let q = match &portal.statement.statement {
            Prepared::Noop(tag) => return Ok(noop_response(tag)),
            Prepared::Show(name, value) => {
                return Ok(Response::Query(show_response(name, value, &portal.result_column_format)?));
            }
            Prepared::Deallocate(name) => return self.deallocate(client.portal_store(), name.as_deref()),
            Prepared::DiscardAll => {
                self.discard_all(client.portal_store());
                return Ok(noop_response("DISCARD ALL"));
            }
            Prepared::Query(q) => q.clone(),
        };
        // The values as the client typed them (Parse), else as Describe told it, each
        // bound in the type its place wants where it is exactly that (`params`).
        let inferred: Vec<Option<&DataType>> = q.described.params.iter().map(Option::as_ref).collect();
        let params = params::deserialize(portal, &inferred)?;
        let scope = self.shared.scope_of(client)?;
        let request = Request { sql: q.sql.clone(), pg_client: true, params: Some(params) };
        let result = self.shared.engine.execute_request_as(request, &scope).await.map_err(|e| pg_error(&e))?;
        // pgwire sends at most Execute's row limit and keeps the rest in the portal
        // (PortalSuspended) for the next Execute: counted as the connection's, or
        // refused before a row is sent.
        let rows: usize = result.batches.iter().map(|b| b.num_rows()).sum();
        if max_rows > 0 && rows > max_rows {
            let bytes = result.batches.iter().map(|b| b.get_array_memory_size()).sum();
            self.ledger().suspend(&portal.name, bytes)?;
        }
        Ok(Response::Query(encode(result, &portal.result_column_format)?))
    }
}

/// `[pg] users` with their passwords, compared in constant time (all of them, so the
/// time taken does not tell a known user name from an unknown one).
fn password_ok(users: &[PgUser], user: &str, password: &str) -> bool {
    let mut ok = false;
    for u in users {
        let same = apron_collector::http::constant_time_eq(password.as_bytes(), u.password.as_bytes());
        ok |= same && u.name == user;
    }
    ok
}

/// One connection's handlers (the query handler knows what its `Guard` saw).
struct Handlers {
    queries: Arc<Queries>,
    startup: Arc<Startup>,
}

impl PgWireServerHandlers for Handlers {
    fn simple_query_handler(&self) -> Arc<impl SimpleQueryHandler> {
        self.queries.clone()
    }

    fn extended_query_handler(&self) -> Arc<impl ExtendedQueryHandler> {
        self.queries.clone()
    }

    fn startup_handler(&self) -> Arc<impl StartupHandler> {
        self.startup.clone()
    }
}

/// Startup and login: `trust` (one user name) or a cleartext password (inside TLS when
/// configured); then a session slot (`slots`), or FATAL 53300 before AuthenticationOk.
struct Startup {
    shared: Arc<Shared>,
    /// The logged-in session's slot, held while the connection lives.
    login: Mutex<Option<Login>>,
}

impl Startup {
    /// A session slot for `user`, then AuthenticationOk, parameters, key and ReadyForQuery.
    async fn log_in<C>(&self, client: &mut C, user: &str) -> PgWireResult<()>
    where
        C: ClientInfo + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::Error: Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        let login = self.shared.slots.login(user)?;
        *self.login.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(login);
        let (pid, secret_key) = self.shared.pids.generate(&*client);
        client.set_pid_and_secret_key(pid, secret_key);
        finish_authentication(client, &DefaultServerParameterProvider::default()).await
    }
}

#[async_trait]
impl StartupHandler for Startup {
    async fn on_startup<C>(&self, client: &mut C, message: PgWireFrontendMessage) -> PgWireResult<()>
    where
        C: ClientInfo + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::Error: Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        if self.shared.require_tls && !client.is_secure() {
            return Err(PgWireError::UserError(Box::new(ErrorInfo::new(
                "FATAL".to_owned(),
                "28000".to_owned(),
                "this server requires TLS: connect with sslmode=require (or verify-full with its CA)".to_owned(),
            ))));
        }
        match message {
            PgWireFrontendMessage::Startup(ref startup) => {
                protocol_negotiation(client, startup).await?;
                save_startup_parameters_to_metadata(client, startup);
                let user = LoginInfo::from_client_info(client).user().unwrap_or("").to_owned();
                match &self.shared.auth {
                    PgAuth::Trust { user: trusted } if user == *trusted => self.log_in(client, &user).await?,
                    PgAuth::Trust { user: trusted } => {
                        return Err(PgWireError::UserError(Box::new(ErrorInfo::new(
                            "FATAL".to_owned(),
                            "28000".to_owned(),
                            format!("role \"{user}\" is not allowed: this server accepts user \"{trusted}\""),
                        ))));
                    }
                    PgAuth::Password(_) => {
                        client.set_state(PgWireConnectionState::AuthenticationInProgress);
                        client.send(PgWireBackendMessage::Authentication(Authentication::CleartextPassword)).await?;
                    }
                }
            }
            PgWireFrontendMessage::PasswordMessageFamily(password) => {
                let PgAuth::Password(users) = &self.shared.auth else { return Ok(()) };
                let password = password.into_password()?;
                let user = LoginInfo::from_client_info(client).user().unwrap_or("").to_owned();
                if !password_ok(users, &user, &password.password) {
                    return Err(PgWireError::InvalidPassword(user));
                }
                self.log_in(client, &user).await?;
            }
            _ => {}
        }
        Ok(())
    }
}

/// Serves the PostgreSQL protocol on `listener` until the task is dropped, with the
/// default [`PgLimits`]; with `tls`, clients that ask for SSL get it (`sslmode=require`).
pub async fn serve(
    listener: TcpListener,
    engine: Arc<QueryEngine>,
    auth: PgAuth,
    tls: Option<Arc<rustls::ServerConfig>>,
) {
    serve_with(listener, engine, auth, tls, PgLimits::default()).await;
}

/// [`serve`] under these limits.
pub async fn serve_with(
    listener: TcpListener,
    engine: Arc<QueryEngine>,
    auth: PgAuth,
    tls: Option<Arc<rustls::ServerConfig>>,
    limits: PgLimits,
) {
    let require_tls = tls.is_some();
    let tls = tls.map(tokio_rustls::TlsAcceptor::from);
    let slots = Arc::new(Slots::new(&limits));
    let pids = RandomPidSecretKeyGenerator::default();
    let shared = Arc::new(Shared { engine, auth, require_tls, limits, slots, pids });
    let stats = shared.limits.stats.clone();
    loop {
        let (socket, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "pg: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        // Never refused here: past max_preauth_connections the oldest login in
        // progress makes way (`slots`); sessions are capped at login.
        let ticket = shared.slots.admit();
        stats.accepted.fetch_add(1, Ordering::Relaxed);
        let (shared, tls) = (shared.clone(), tls.clone());
        tokio::spawn(async move {
            shared.limits.stats.active.fetch_add(1, Ordering::Relaxed);
            if let Err(e) = connection(socket, tls, shared.clone(), ticket).await {
                tracing::debug!(%peer, error = %e, "pg: connection ended with an error");
            }
            shared.limits.stats.active.fetch_sub(1, Ordering::Relaxed);
        });
    }
}

/// Best effort: a closing client that does not read gets no say in how long we wait.
async fn send_fatal<S: Sink<PgWireBackendMessage> + Unpin>(socket: &mut S, code: &str, message: String) {
    let info = ErrorInfo::new("FATAL".to_owned(), code.to_owned(), message);
    let _ =
        tokio::time::timeout(Duration::from_millis(200), socket.send(PgWireBackendMessage::ErrorResponse(info.into())))
            .await;
}

type Socket = Framed<Guard<MaybeTls>, PgWireMessageServerCodec<Prepared>>;

/// What waiting for a logged-in session's next message came to.
enum Next {
    Message(PgWireFrontendMessage),
    /// The client closed the connection.
    Closed,
    /// Nothing for `idle_timeout`.
    Idle(Duration),
    /// A message begun and not finished within `message_timeout`.
    Stalled(Duration),
}

/// The next message of a logged-in session, under `idle_timeout` (from now) and
/// `message_timeout` (from a message's first byte, as `Guard` saw it).
async fn next_message(socket: &mut Socket, limits: &PgSessionLimits) -> Result<Next, PgWireError> {
    let since = tokio::time::Instant::now();
    let message_timeout = limits.message_timeout;
    loop {
        // Wake at the next deadline, and at least every message_timeout to look for a
        // message begun since.
        let now = tokio::time::Instant::now();
        let wake = match socket.get_ref().in_progress() {
            Some(started) => tokio::time::Instant::from_std(started) + message_timeout,
            None => limits.idle_timeout.map_or(now + message_timeout, |d| (since + d).min(now + message_timeout)),
        };
        tokio::select! {
            biased;
            next = socket.next() => {
                return match next {
                    Some(Ok(m)) => Ok(Next::Message(m)),
                    Some(Err(e)) => Err(e),
                    None => Ok(Next::Closed),
                };
            }
            () = tokio::time::sleep_until(wake) => {}
        }
        let now = tokio::time::Instant::now();
        match socket.get_ref().in_progress() {
            Some(started) if tokio::time::Instant::from_std(started) + message_timeout <= now => {
                return Ok(Next::Stalled(message_timeout));
            }
            Some(_) => {}
            None => {
                if let Some(idle) = limits.idle_timeout.filter(|d| since + *d <= now) {
                    return Ok(Next::Idle(idle));
                }
            }
        }
    }
}

/// One connection: pgwire's own loop (`pgwire::tokio::process_socket`), with the
/// client's bytes passed through a [`Guard`], `auth_timeout` (and making way for newer
/// logins, `slots`) instead of pgwire's fixed 60 s startup timeout, and a logged-in
/// session's idle and message timeouts.
async fn connection(
    socket: TcpStream,
    tls: Option<tokio_rustls::TlsAcceptor>,
    shared: Arc<Shared>,
    ticket: Ticket,
) -> io::Result<()> {
    let limits = shared.limits.clone();
    let timed_out = || {
        limits.stats.auth_timeouts.fetch_add(1, Ordering::Relaxed);
        tracing::debug!("pg: closing a connection that did not authenticate within {:?}", limits.auth_timeout);
    };
    // TLS, startup and authentication, all of it: a client that connects and sends
    // nothing, half a handshake or no password holds its place this long at most, and
    // less when newer connections need it.
    let deadline = tokio::time::sleep(limits.auth_timeout);
    tokio::pin!(deadline);
    let evicted = ticket.evicted.clone();
    let negotiated = tokio::select! {
        () = &mut deadline => {
            timed_out();
            return Ok(());
        }
        () = evicted.notified() => return Ok(()),
        n = negotiate_tls::<Prepared>(socket, tls) => n?,
    };
    // A direct TLS connection without TLS configured: nothing to say to it.
    let Some(framed) = negotiated else { return Ok(()) };
    let seen = Arc::new(Seen::default());
    let max_message = limits.max_sql_bytes.saturating_add(MESSAGE_SLACK);
    let parts = framed.into_parts();
    let guard = Guard::new(
        parts.io,
        &parts.read_buf,
        limits.max_sql_bytes,
        max_message,
        limits.session.message_timeout,
        seen.clone(),
    );
    let mut parts_now = FramedParts::new::<PgWireBackendMessage>(guard, parts.codec);
    parts_now.write_buf = parts.write_buf;
    let mut socket: Socket = Framed::from_parts(parts_now);

    let parser = Arc::new(Parser { shared: shared.clone() });
    let ledger = Mutex::new(Ledger::new(limits.session.clone(), limits.stats.clone()));
    let startup = Arc::new(Startup { shared: shared.clone(), login: Mutex::new(None) });
    let handlers = Handlers { queries: Arc::new(Queries { shared, seen: seen.clone(), parser, ledger }), startup };
    let startup_handler = handlers.startup.clone();
    let simple_query_handler = handlers.queries.clone();
    let extended_query_handler = handlers.queries.clone();
    let copy_handler = handlers.copy_handler();
    let cancel_handler = handlers.cancel_handler();
    let error_handler = handlers.error_handler();
    let mut ticket = Some(ticket);
    loop {
        let authenticating = matches!(
            socket.state(),
            PgWireConnectionState::AwaitingStartup | PgWireConnectionState::AuthenticationInProgress
        );
        if !authenticating {
            // Logged in: its place among those logging in is free for the next.
            drop(ticket.take());
        }
        let outcome = if authenticating {
            let step = async {
                let msg = match socket.next().await {
                    Some(Ok(msg)) => msg,
                    Some(Err(e)) => return Err(e),
                    None => return Ok(false),
                };
                handle(
                    &mut socket,
                    msg,
                    (&startup_handler, &simple_query_handler, &extended_query_handler),
                    (&copy_handler, &cancel_handler, &error_handler),
                )
                .await
            };
            tokio::select! {
                () = &mut deadline => {
                    timed_out();
                    let message =
                        format!("canceling authentication due to timeout ({:?}, pg.auth_timeout)", limits.auth_timeout);
                    send_fatal(&mut socket, "57014", message).await;
                    return Ok(());
                }
                () = evicted.notified() => {
                    let message = format!(
                        "too many connections are logging in at once (pg.max_preauth_connections = {}); \
                         this one, the oldest, was closed to make room: connect again",
                        limits.session.max_preauth_connections
                    );
                    send_fatal(&mut socket, "53300", message).await;
                    return Ok(());
                }
                r = step => r,
            }
        } else {
            match next_message(&mut socket, &limits.session).await {
                Ok(Next::Message(msg)) => {
                    handle(
                        &mut socket,
                        msg,
                        (&startup_handler, &simple_query_handler, &extended_query_handler),
                        (&copy_handler, &cancel_handler, &error_handler),
                    )
                    .await
                }
                Ok(Next::Closed) => Ok(false),
                Ok(Next::Idle(idle)) => {
                    limits.stats.idle_timeouts.fetch_add(1, Ordering::Relaxed);
                    let message =
                        format!("terminating connection due to idle-session timeout ({idle:?}, pg.idle_timeout)");
                    send_fatal(&mut socket, "57P05", message).await;
                    return Ok(());
                }
                Ok(Next::Stalled(limit)) => {
                    limits.stats.message_timeouts.fetch_add(1, Ordering::Relaxed);
                    let message = format!(
                        "terminating connection: a message was begun and not finished within {limit:?} \
                         (pg.message_timeout)"
                    );
                    send_fatal(&mut socket, "08P01", message).await;
                    return Ok(());
                }
                Err(e) => Err(e),
            }
        };
        match outcome {
            Ok(true) => {}
            Ok(false) => return Ok(()),
            Err(e) => {
                let len = seen.fatal_message.load(Ordering::Relaxed);
                if len > 0 {
                    limits.stats.oversized.fetch_add(1, Ordering::Relaxed);
                    let message = format!(
                        "a message of {len} bytes is larger than the server's limit of {max_message} bytes \
                         (sql.max_body_bytes + 64 KiB)"
                    );
                    send_fatal(&mut socket, "54000", message).await;
                } else if socket.get_ref().write_stalled() {
                    limits.stats.message_timeouts.fetch_add(1, Ordering::Relaxed);
                }
                return Err(io::Error::other(e.to_string()));
            }
        }
    }
}

/// One message through pgwire's dispatch (`process_message`), its error answered as
/// pgwire's loop does. `Ok(false)`: the client is leaving.
async fn handle<A, Q, E, C, X, H>(
    socket: &mut Socket,
    msg: PgWireFrontendMessage,
    (startup, simple, extended): (&Arc<A>, &Arc<Q>, &Arc<E>),
    (copy, cancel, errors): (&Arc<C>, &Arc<X>, &Arc<H>),
) -> Result<bool, PgWireError>
where
    A: StartupHandler,
    Q: SimpleQueryHandler,
    E: ExtendedQueryHandler<Statement = Prepared>,
    C: pgwire::api::copy::CopyHandler,
    X: pgwire::api::cancel::CancelHandler,
    H: ErrorHandler,
{
    // Terminate: the client is leaving; close (some clients wait for it).
    if matches!(msg, PgWireFrontendMessage::Terminate(_)) {
        return Ok(false);
    }
    let is_extended_query = match socket.state() {
        PgWireConnectionState::CopyInProgress(is_extended_query) => is_extended_query,
        _ => msg.is_extended_query(),
    };
    if let Err(mut e) =
        process_message(msg, socket, startup.clone(), simple.clone(), extended.clone(), copy.clone(), cancel.clone())
            .await
    {
        errors.on_error(&*socket, &mut e);
        // A FATAL one (a wrong password, no session left) ends the connection here,
        // rather than when the client gets round to closing it.
        let info = ErrorInfo::from(e);
        let fatal = info.is_fatal();
        process_error(socket, PgWireError::UserError(Box::new(info)), is_extended_query).await?;
        return Ok(!fatal);
    }
    Ok(true)
}

/// The client's bytes (after TLS) on their way to pgwire's decoder, framed as they pass
/// so that no message over the limits is ever buffered: pgwire would hold a query text
/// of up to 1 GiB in memory before its handler could look at the length.
///
/// - A query (`Q`) whose text is over `max_query` bytes is dropped as it arrives, never
///   stored; pgwire gets an empty query in its place and [`Seen::dropped_query`] says
///   what it stands for, so the query handler answers it with 54000 and the connection
///   goes on. The stand-in is handed up in a read of its own, after every earlier
///   message was complete: the decoder has returned (and the server answered) all of
///   them before it sees the stand-in, so the flag cannot be taken by another query.
/// - A Parse or Bind over `max_message` bytes is dropped the same way, with an empty
///   Parse or Bind as its stand-in ([`Seen::dropped_parse`], [`Seen::dropped_bind`]):
///   the handler answers 54000 and the extended protocol goes on after the next Sync.
/// - Any other message over `max_message` bytes ends the connection (reads fail;
///   [`Seen::fatal_message`] says why).
///
/// It also tells when the message now arriving began ([`Guard::in_progress`], for
/// `[pg] message_timeout`), and fails a write that has made no progress for
/// `write_timeout` (a client that does not read its answer cannot hold it forever).
///
/// The first message (startup or cancel request) has no type byte; every later one has.
struct Guard<IO> {
    io: IO,
    /// Bytes read from `io`; `raw[start..end]` are not passed on yet.
    raw: Box<[u8]>,
    start: usize,
    end: usize,
    /// A message head being collected (type byte and length, or the length alone).
    head: [u8; 5],
    head_len: usize,
    typed: bool,
    /// Bytes to hand up before anything else: a complete head, or a stand-in.
    emit: [u8; 16],
    emit_start: usize,
    emit_end: usize,
    /// Bytes of the current message still to pass on, or to drop.
    body: usize,
    skip: usize,
    max_query: usize,
    max_message: usize,
    failed: bool,
    seen: Arc<Seen>,
    /// When the message now arriving began (its first head byte).
    started: Option<Instant>,
    write_timeout: Duration,
    /// Running while a write waits on the client.
    stall: Option<Pin<Box<tokio::time::Sleep>>>,
    stalled: bool,
}

/// The stand-in for a dropped query: `Q`, length 5, an empty NUL-terminated text.
const STAND_IN: [u8; 6] = [b'Q', 0, 0, 0, 5, 0];
/// … for a dropped Parse: `P`, length 8, unnamed, an empty text, no parameter types.
const PARSE_STAND_IN: [u8; 9] = [b'P', 0, 0, 0, 8, 0, 0, 0, 0];
/// … for a dropped Bind: `B`, length 12, unnamed portal and statement, no formats, no
/// values.
const BIND_STAND_IN: [u8; 13] = [b'B', 0, 0, 0, 12, 0, 0, 0, 0, 0, 0, 0, 0];

impl<IO> Guard<IO> {
    /// `unread`: what pgwire had already read past the TLS negotiation (it starts at a
    /// message boundary: the startup message's).
    fn new(
        io: IO,
        unread: &[u8],
        max_query: usize,
        max_message: usize,
        write_timeout: Duration,
        seen: Arc<Seen>,
    ) -> Guard<IO> {
        let mut raw = vec![0u8; unread.len().max(8 << 10)].into_boxed_slice();
        raw[..unread.len()].copy_from_slice(unread);
        Guard {
            io,
            raw,
            start: 0,
            end: unread.len(),
            head: [0; 5],
            head_len: 0,
            typed: false,
            emit: [0; 16],
            emit_start: 0,
            emit_end: 0,
            body: 0,
            skip: 0,
            max_query,
            max_message,
            failed: false,
            seen,
            started: None,
            write_timeout,
            stall: None,
            stalled: false,
        }
    }

    /// When the message now arriving began; `None` between messages.
    fn in_progress(&self) -> Option<Instant> {
        self.started.filter(|_| self.head_len > 0 || self.body > 0 || self.skip > 0)
    }

    /// True once a write failed for want of a reader.
    fn write_stalled(&self) -> bool {
        self.stalled
    }

    /// Hands up `stand_in` for a message whose `body` bytes are dropped as they arrive.
    fn stand_in(&mut self, stand_in: &[u8], body: usize) {
        self.emit[..stand_in.len()].copy_from_slice(stand_in);
        self.emit_start = 0;
        self.emit_end = stand_in.len();
        self.skip = body;
    }

    /// A write that is not done: fails once it has waited `write_timeout`.
    fn stalling(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        let timeout = self.write_timeout;
        let stall = self.stall.get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        match stall.as_mut().poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(()) => {
                self.stalled = true;
                Poll::Ready(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("the client read nothing of its answer for {timeout:?} (pg.message_timeout)"),
                ))
            }
        }
    }

    /// A complete head: decides what becomes of its message.
    fn on_head(&mut self) {
        let (ty, len_bytes) = if self.typed {
            (Some(self.head[0]), [self.head[1], self.head[2], self.head[3], self.head[4]])
        } else {
            (None, [self.head[0], self.head[1], self.head[2], self.head[3]])
        };
        let head_len = if self.typed { 5 } else { 4 };
        self.typed = true;
        // The length counts itself; a bogus one (< 4) is passed on for pgwire to refuse.
        let len = u32::from_be_bytes(len_bytes) as usize;
        let body = len.saturating_sub(4);
        if ty == Some(b'Q') && body.saturating_sub(1) > self.max_query {
            // The text without its NUL.
            self.seen.dropped_query.store(body - 1, Ordering::Relaxed);
            self.stand_in(&STAND_IN, body);
        } else if ty == Some(b'P') && body > self.max_message {
            self.seen.dropped_parse.store(len, Ordering::Relaxed);
            self.stand_in(&PARSE_STAND_IN, body);
        } else if ty == Some(b'B') && body > self.max_message {
            self.seen.dropped_bind.store(len, Ordering::Relaxed);
            self.stand_in(&BIND_STAND_IN, body);
        } else if body > self.max_message {
            self.seen.fatal_message.store(len, Ordering::Relaxed);
            self.failed = true;
        } else {
            self.emit[..head_len].copy_from_slice(&self.head[..head_len]);
            self.emit_start = 0;
            self.emit_end = head_len;
            self.body = body;
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Guard<IO> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        loop {
            if this.emit_start < this.emit_end {
                let n = (this.emit_end - this.emit_start).min(buf.remaining());
                buf.put_slice(&this.emit[this.emit_start..this.emit_start + n]);
                this.emit_start += n;
                return Poll::Ready(Ok(()));
            }
            if this.failed {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "a message larger than the server's limit (sql.max_body_bytes)",
                )));
            }
            let available = this.end - this.start;
            if available > 0 {
                if this.skip > 0 {
                    let n = this.skip.min(available);
                    this.start += n;
                    this.skip -= n;
                    continue;
                }
                if this.body > 0 {
                    let n = this.body.min(available).min(buf.remaining());
                    buf.put_slice(&this.raw[this.start..this.start + n]);
                    this.start += n;
                    this.body -= n;
                    return Poll::Ready(Ok(()));
                }
                let need = if this.typed { 5 } else { 4 };
                if this.head_len == 0 {
                    this.started = Some(Instant::now());
                }
                let n = (need - this.head_len).min(available);
                this.head[this.head_len..this.head_len + n].copy_from_slice(&this.raw[this.start..this.start + n]);
                this.head_len += n;
                this.start += n;
                if this.head_len == need {
                    this.head_len = 0;
                    this.on_head();
                }
                continue;
            }
            // Everything read so far is handled: read more.
            this.start = 0;
            this.end = 0;
            let mut into = ReadBuf::new(&mut this.raw);
            match Pin::new(&mut this.io).poll_read(cx, &mut into) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) => {}
            }
            this.end = into.filled().len();
            if this.end == 0 {
                // End of stream; a partial head is dropped (the decoder would not
                // have made a message of it either).
                return Poll::Ready(Ok(()));
            }
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Guard<IO> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        match Pin::new(&mut this.io).poll_write(cx, buf) {
            Poll::Pending => this.stalling(cx).map(Err),
            done => {
                this.stall = None;
                done
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match Pin::new(&mut this.io).poll_flush(cx) {
            Poll::Pending => this.stalling(cx).map(Err),
            done => {
                this.stall = None;
                done
            }
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_statements_are_acknowledged_and_queries_are_not() {
        assert_eq!(session_noop("SET extra_float_digits = 3"), Some("SET"));
        assert_eq!(session_noop("  begin;"), Some("BEGIN"));
        assert_eq!(session_noop("DISCARD ALL"), Some("DISCARD ALL"));
        assert_eq!(session_noop("SELECT 1"), None);
        // Writes are not "session statements": they reach the engine and its refusal.
        assert_eq!(session_noop("INSERT INTO gpu_samples VALUES (1)"), None);
        assert_eq!(session_noop("settle"), None);
        assert_eq!(session_noop("ROLLBACK TO SAVEPOINT _pg3_1"), Some("ROLLBACK TO"));
        assert_eq!(session_noop("rollback"), Some("ROLLBACK"));
        assert_eq!(session_noop("SAVEPOINT _pg3_1"), Some("SAVEPOINT"));
    }

    #[test]
    fn identity_changes_are_told_from_other_settings() {
        for q in [
            "SET ROLE finance",
            "set role = 'finance'",
            "SET \"role\" TO finance",
            "SET role='finance'",
            "SET LOCAL ROLE finance",
            "SET SESSION ROLE NONE",
            "SET SESSION AUTHORIZATION finance",
            "SET SESSION SESSION AUTHORIZATION DEFAULT",
            "SET LOCAL SESSION AUTHORIZATION finance;",
        ] {
            assert!(changes_identity(q), "{q}");
        }
        for q in [
            "SET extra_float_digits = 3",
            "SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY",
            "SET search_path = public",
            "SET SESSION timezone TO 'UTC'",
            "SELECT 'SET ROLE x'",
            "RESET ROLE",
        ] {
            assert!(!changes_identity(q), "{q}");
        }
    }

    #[test]
    fn deallocate_and_discard_are_read() {
        assert_eq!(deallocate("DEALLOCATE _pg3_0"), Some(Some("_pg3_0".to_owned())));
        assert_eq!(deallocate("deallocate prepare S_1;"), Some(Some("s_1".to_owned())));
        assert_eq!(deallocate("DEALLOCATE \"S_1\""), Some(Some("S_1".to_owned())));
        assert_eq!(deallocate("DEALLOCATE ALL"), Some(None));
        assert_eq!(deallocate("SELECT 1"), None);
        assert!(discards_all("DISCARD ALL") && !discards_all("DISCARD PLANS"));
    }

    #[test]
    fn comment_only_queries_are_empty() {
        assert!(is_comment_only("-- ping"));
        assert!(is_comment_only(" /* hi */ ;\n-- x\n"));
        assert!(!is_comment_only("-- ping\nSELECT 1"));
        assert!(!is_comment_only("SELECT 1 -- trailing"));
    }

    /// A startup message (no type byte) for user `u`.
    fn startup() -> Vec<u8> {
        let params = b"user\0u\0\0";
        let mut m = Vec::new();
        m.extend(u32::try_from(8 + params.len()).expect("small").to_be_bytes());
        m.extend(196_608u32.to_be_bytes());
        m.extend(params);
        m
    }

    fn message(ty: u8, body: &[u8]) -> Vec<u8> {
        let mut m = vec![ty];
        m.extend(u32::try_from(body.len() + 4).expect("small").to_be_bytes());
        m.extend(body);
        m
    }

    fn query(text: &str) -> Vec<u8> {
        let mut body = text.as_bytes().to_vec();
        body.push(0);
        message(b'Q', &body)
    }

    /// `input` through a `Guard` (query limit 10 bytes, other messages 100): the first
    /// `unread` bytes as if pgwire had read them already, the rest written in `chunk`-byte
    /// pieces. Returns what came out, the read error if any, and what the guard saw.
    async fn through_guard(input: &[u8], unread: usize, chunk: usize) -> (Vec<u8>, Option<io::Error>, Arc<Seen>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut client, server) = tokio::io::duplex(1 << 16);
        let seen = Arc::new(Seen::default());
        let mut guard = Guard::new(server, &input[..unread], 10, 100, Duration::from_secs(5), seen.clone());
        let rest = input[unread..].to_vec();
        let writer = tokio::spawn(async move {
            for piece in rest.chunks(chunk) {
                if client.write_all(piece).await.is_err() {
                    return;
                }
            }
        });
        let mut out = Vec::new();
        let mut buf = [0u8; 64];
        let error = loop {
            match guard.read(&mut buf).await {
                Ok(0) => break None,
                Ok(n) => out.extend_from_slice(&buf[..n]),
                Err(e) => break Some(e),
            }
        };
        writer.abort();
        (out, error, seen)
    }

    #[tokio::test]
    async fn the_guard_passes_messages_and_drops_oversized_queries() {
        let big = format!("SELECT '{}'", "x".repeat(5 << 20));
        let input = [startup(), query("SELECT 1"), query(&big), query("SELECT 2"), message(b'X', b"")].concat();
        let expected =
            [startup(), query("SELECT 1"), STAND_IN.to_vec(), query("SELECT 2"), message(b'X', b"")].concat();
        for (unread, chunk) in [(0, 1 << 16), (0, 1), (0, 7), (3, 1 << 16), (40, 4096)] {
            if chunk == 1 && unread == 0 {
                // Byte by byte, but not the five megabytes.
                let small = [startup(), query("SELECT 1"), query("SELECT 'far too long'"), query("SELECT 2")].concat();
                let (out, error, seen) = through_guard(&small, 0, 1).await;
                assert!(error.is_none(), "{error:?}");
                assert_eq!(out, [startup(), query("SELECT 1"), STAND_IN.to_vec(), query("SELECT 2")].concat());
                assert_eq!(seen.dropped_query.load(Ordering::Relaxed), "SELECT 'far too long'".len());
                continue;
            }
            let (out, error, seen) = through_guard(&input, unread, chunk).await;
            assert!(error.is_none(), "{error:?}");
            assert!(out == expected, "unread {unread}, chunk {chunk}: {} bytes out", out.len());
            assert_eq!(seen.dropped_query.load(Ordering::Relaxed), big.len());
            assert_eq!(seen.fatal_message.load(Ordering::Relaxed), 0);
        }
        // A text of exactly the limit passes.
        let input = [startup(), query("0123456789")].concat();
        let (out, _, seen) = through_guard(&input, 0, 1 << 16).await;
        assert_eq!((out, seen.dropped_query.load(Ordering::Relaxed)), (input, 0));
    }

    #[tokio::test]
    async fn the_guard_drops_oversized_parse_and_bind_messages() {
        let (parse, bind) = (message(b'P', &[b'a'; 200]), message(b'B', &[b'b'; 300]));
        let sync = message(b'S', b"");
        let input = [startup(), parse, sync.clone(), bind, sync.clone(), query("SELECT 1")].concat();
        for chunk in [1 << 16, 1, 7] {
            let (out, error, seen) = through_guard(&input, 0, chunk).await;
            assert!(error.is_none(), "{error:?}");
            let expected = [
                startup(),
                PARSE_STAND_IN.to_vec(),
                sync.clone(),
                BIND_STAND_IN.to_vec(),
                sync.clone(),
                query("SELECT 1"),
            ]
            .concat();
            assert_eq!(out, expected, "chunk {chunk}");
            assert_eq!(seen.dropped_parse.load(Ordering::Relaxed), 204);
            assert_eq!(seen.dropped_bind.load(Ordering::Relaxed), 304);
        }
    }

    #[tokio::test]
    async fn the_guard_ends_the_connection_on_other_oversized_messages() {
        let describe = message(b'D', &[b'a'; 200]);
        let input = [startup(), query("SELECT 1"), describe].concat();
        let (out, error, seen) = through_guard(&input, 0, 1 << 16).await;
        assert_eq!(out, [startup(), query("SELECT 1")].concat(), "what came before is passed on");
        assert_eq!(error.map(|e| e.kind()), Some(io::ErrorKind::InvalidData));
        assert_eq!(seen.fatal_message.load(Ordering::Relaxed), 204);
        // An oversized startup message too.
        let mut huge_startup = startup();
        huge_startup[..4].copy_from_slice(&100_000u32.to_be_bytes());
        let (out, error, _) = through_guard(&huge_startup, 0, 1 << 16).await;
        assert!(out.is_empty() && error.is_some());
    }

    #[test]
    fn read_only_refusals_carry_sqlstate_25006() {
        let e = pg_error(&QueryError::ReadOnly { what: "INSERT INTO".into() });
        match e {
            PgWireError::UserError(info) => {
                assert_eq!((info.severity.as_str(), info.code.as_str()), ("ERROR", "25006"))
            }
            other => panic!("{other:?}"),
        }
    }
}
