//! The PostgreSQL wire protocol listener (`:5433`): the same read-only SQL as
//! `POST /api/v1/sql`, for psql, Grafana's PostgreSQL datasource and BI tools.
//!
//! ```text
//!  TCP accept ─► over [pg] max_connections (256) open: closed at once, counted, logged
//!    ─► pgwire (startup, simple and extended query protocols), the client's bytes
//!       framed by `Guard`
//!    TLS + startup + authentication within [pg] auth_timeout (10 s), or closed
//!    TLS: SSLRequest answered with rustls when [pg.tls] or [server.tls] is set
//!    startup: `trust` (apron up: user `apron` only, loopback) or `password` (apron serve:
//!             [[pg.users]], cleartext password inside TLS; each user has a role)
//!    Query text over [sql] max_body_bytes (1 MiB, as HTTP): never buffered (`Guard` drops
//!             it as it arrives and passes an empty stand-in on), ErrorResponse 54000
//!             naming the setting; the connection stays usable. Any other message over
//!             that + 64 KiB: FATAL 54000, connection closed.
//!    Query "SELECT …" ─► QueryEngine::execute_as(the user's scope: a team:<name> user
//!             reads that team's rows only; same plan checks, timeout, memory and
//!             row limits as HTTP) ─► arrow-pg: Arrow batches → text rows with pg types
//!    Query "SET …" / "BEGIN" / "COMMIT" / "ROLLBACK" / "SAVEPOINT" / "DISCARD ALL":
//!             acknowledged, no effect (clients send them on connect; nothing here is
//!             transactional; BEGIN/COMMIT do move the transaction status clients track)
//!    Query "SHOW <session parameter>" (transaction isolation level, server_version, …):
//!             the fixed answer drivers expect (apron_query::pgcompat::SETTINGS, which
//!             current_setting() answers from too)
//!    extended protocol: Parse ─► the same size limit, then QueryEngine::describe_as
//!             (parsed, checked and planned as a query would be, under the user's scope)
//!             → parameter types and result columns for Describe; Bind stores the values;
//!             Execute ─► QueryEngine::execute_request_as(text + bound values): the same
//!             path, checks, timeout and limits as a simple query; a row limit on
//!             Execute sends that many and suspends the portal for the next
//!    every query is read as a PostgreSQL client's (datafusion-pg-catalog's rewrites of
//!             catalog operators and casts, then apron_query::pgcompat's: Grafana's
//!             search-path subquery, catalog scalar subqueries, PostgreSQL type names in
//!             information_schema.columns); `pg_catalog` and `information_schema`
//!             describe the user's own session (the same tables and columns for all)
//!    errors ─► ErrorResponse with a SQLSTATE (25006 read-only, 42601 syntax, 57014
//!             timeout, 53200 memory, 54000 too many rows, 53300 busy, …)
//! ```

use std::fmt::Debug;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use apron_query::{Described, QueryEngine, QueryError, Request, Scope};
use async_trait::async_trait;
use datafusion::arrow::datatypes::DataType;
use futures::{Sink, SinkExt, StreamExt, stream};
use pgwire::api::Type;
use pgwire::api::auth::cleartext::CleartextPasswordAuthStartupHandler;
use pgwire::api::auth::noop::NoopStartupHandler;
use pgwire::api::auth::{AuthSource, DefaultServerParameterProvider, LoginInfo, Password, StartupHandler};
use pgwire::api::portal::{Format, Portal};
use pgwire::api::query::{ExtendedQueryHandler, SimpleQueryHandler};
use pgwire::api::results::{FieldInfo, QueryResponse, Response, Tag};
use pgwire::api::stmt::QueryParser;
use pgwire::api::store::PortalStore;
use pgwire::api::{ClientInfo, ClientPortalStore, ErrorHandler, PgWireConnectionState, PgWireServerHandlers};
use pgwire::error::{ErrorInfo, PgWireError, PgWireResult};
use pgwire::messages::simplequery::Query;
use pgwire::messages::{PgWireBackendMessage, PgWireFrontendMessage};
use pgwire::tokio::server::{negotiate_tls, process_error, process_message};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::codec::{Framed, FramedParts};

use crate::access::Role;

/// The user `apron up` accepts without a password.
pub const UP_USER: &str = "apron";

/// `[pg] max_connections` when unset.
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;
/// `[pg] auth_timeout` when unset.
pub const DEFAULT_AUTH_TIMEOUT: Duration = Duration::from_secs(10);
/// How much larger than the SQL limit any other message may be: a Parse carries the
/// query text plus parameter types; startup, password and the rest are far smaller.
const MESSAGE_SLACK: usize = 64 << 10;

/// The listener's limits (`[pg]`, and `[sql] max_body_bytes` shared with HTTP).
#[derive(Debug, Clone)]
pub struct PgLimits {
    /// Connections at once; more are closed at accept.
    pub max_connections: usize,
    /// TLS, startup and authentication must be done within this of the accept.
    pub auth_timeout: Duration,
    /// The longest query text, in bytes.
    pub max_sql_bytes: usize,
    /// Counters; share the `Arc` to read them.
    pub stats: Arc<PgStats>,
}

impl Default for PgLimits {
    fn default() -> Self {
        PgLimits {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            auth_timeout: DEFAULT_AUTH_TIMEOUT,
            max_sql_bytes: crate::config::HttpOptions::default().max_sql_bytes,
            stats: Arc::default(),
        }
    }
}

/// What the limits did, totals since start (except [`PgStats::active`]).
#[derive(Debug, Default)]
pub struct PgStats {
    accepted: AtomicU64,
    active: AtomicU64,
    rejected: AtomicU64,
    auth_timeouts: AtomicU64,
    oversized: AtomicU64,
}

impl PgStats {
    /// Connections accepted (not rejected).
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }
    /// Connections open now.
    pub fn active(&self) -> u64 {
        self.active.load(Ordering::Relaxed)
    }
    /// Connections closed at accept because `max_connections` were open.
    pub fn rejected(&self) -> u64 {
        self.rejected.load(Ordering::Relaxed)
    }
    /// Connections closed because startup and authentication took too long.
    pub fn auth_timeouts(&self) -> u64 {
        self.auth_timeouts.load(Ordering::Relaxed)
    }
    /// Queries (and other messages) refused for their size.
    pub fn oversized(&self) -> u64 {
        self.oversized.load(Ordering::Relaxed)
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
}

/// The query handlers (simple and extended protocol) of one connection.
struct Queries {
    shared: Arc<Shared>,
    /// What [`Guard`] saw on this connection.
    seen: Arc<Seen>,
    parser: Arc<Parser>,
}

/// Set by a connection's [`Guard`] as the client's bytes pass, read by its handlers.
#[derive(Debug, Default)]
struct Seen {
    /// Length of the query text `Guard` dropped (0: none): the empty query it passed on
    /// instead stands for it.
    dropped_query: AtomicUsize,
    /// Length of a message over the limit that ended the connection (0: none).
    fatal_message: AtomicUsize,
}

/// The ErrorResponse for a query text over `[sql] max_body_bytes`.
fn too_long(len: usize, max: usize) -> PgWireError {
    PgWireError::UserError(Box::new(ErrorInfo::new(
        "ERROR".to_owned(),
        "54000".to_owned(),
        format!("the query text ({len} bytes) is larger than the server's limit of {max} bytes (sql.max_body_bytes)"),
    )))
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

/// A query's rows as pg rows in `format` (text or binary per column, as the client
/// asked in Bind; the simple protocol is all text).
fn encode(result: apron_query::QueryResult, format: &Format) -> PgWireResult<QueryResponse> {
    let fields = Arc::new(arrow_pg::datatypes::arrow_schema_to_pg_fields(&result.schema, format, None)?);
    let rows: Vec<_> = result
        .batches
        .into_iter()
        .flat_map(|b| arrow_pg::datatypes::encode_recordbatch(fields.clone(), b).collect::<Vec<_>>())
        .collect();
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

#[async_trait]
impl ExtendedQueryHandler for Queries {
    type Statement = Prepared;
    type QueryParser = Parser;

    fn query_parser(&self) -> Arc<Parser> {
        self.parser.clone()
    }

    async fn do_query<C>(&self, client: &mut C, portal: &Portal<Prepared>, _max_rows: usize) -> PgWireResult<Response>
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
            Prepared::Query(q) => q.clone(),
        };
        // The values as the client typed them (Parse), else as the plan infers them.
        let inferred: Vec<Option<&DataType>> = q.described.params.iter().map(Option::as_ref).collect();
        let params = arrow_pg::datatypes::df::deserialize_parameters(portal, &inferred)?;
        let scope = self.shared.scope_of(client)?;
        let request = Request { sql: q.sql.clone(), pg_client: true, params: Some(params) };
        let result = self.shared.engine.execute_request_as(request, &scope).await.map_err(|e| pg_error(&e))?;
        // pgwire sends at most Execute's row limit and keeps the rest in the portal
        // (PortalSuspended) for the next Execute.
        Ok(Response::Query(encode(result, &portal.result_column_format)?))
    }
}

/// `trust`: accepts only the one user name.
struct Trust {
    user: String,
}

#[async_trait]
impl NoopStartupHandler for Trust {
    async fn post_startup<C>(&self, client: &mut C, _message: PgWireFrontendMessage) -> PgWireResult<()>
    where
        C: ClientInfo + Sink<PgWireBackendMessage> + Unpin + Send,
        C::Error: Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        let login = LoginInfo::from_client_info(client);
        if login.user() == Some(self.user.as_str()) {
            return Ok(());
        }
        Err(PgWireError::UserError(Box::new(ErrorInfo::new(
            "FATAL".to_owned(),
            "28000".to_owned(),
            format!(
                "role \"{}\" is not allowed: this server accepts user \"{}\"",
                login.user().unwrap_or(""),
                self.user
            ),
        ))))
    }
}

/// `[pg] users` as a pgwire password source. An unknown user gets a password no client
/// can send, so the answer is the same "password authentication failed".
#[derive(Debug)]
struct Users(Arc<[PgUser]>);

#[async_trait]
impl AuthSource for Users {
    async fn get_password(&self, login: &LoginInfo) -> PgWireResult<Password> {
        let user = login.user().unwrap_or("");
        let pass = self.0.iter().find(|u| u.name == user).map(|u| u.password.as_bytes().to_vec());
        Ok(Password::new(None, pass.unwrap_or_else(|| vec![0u8; 64])))
    }
}

/// One connection's handlers (the query handler knows what its `Guard` saw).
struct Handlers {
    queries: Arc<Queries>,
}

impl PgWireServerHandlers for Handlers {
    fn simple_query_handler(&self) -> Arc<impl SimpleQueryHandler> {
        self.queries.clone()
    }

    fn extended_query_handler(&self) -> Arc<impl ExtendedQueryHandler> {
        self.queries.clone()
    }

    fn startup_handler(&self) -> Arc<impl StartupHandler> {
        let shared = &self.queries.shared;
        Arc::new(Startup { mode: StartupMode::from(&shared.auth), require_tls: shared.require_tls })
    }
}

/// One startup handler type for both modes (pgwire wants a single `impl` type).
struct Startup {
    mode: StartupMode,
    require_tls: bool,
}

enum StartupMode {
    Trust(Trust),
    Password(Box<CleartextPasswordAuthStartupHandler<Users, DefaultServerParameterProvider>>),
}

impl From<&PgAuth> for StartupMode {
    fn from(a: &PgAuth) -> StartupMode {
        match a {
            PgAuth::Trust { user } => StartupMode::Trust(Trust { user: user.clone() }),
            PgAuth::Password(users) => StartupMode::Password(Box::new(CleartextPasswordAuthStartupHandler::new(
                Users(users.clone()),
                DefaultServerParameterProvider::default(),
            ))),
        }
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
        if self.require_tls && !client.is_secure() {
            return Err(PgWireError::UserError(Box::new(ErrorInfo::new(
                "FATAL".to_owned(),
                "28000".to_owned(),
                "this server requires TLS: connect with sslmode=require (or verify-full with its CA)".to_owned(),
            ))));
        }
        match &self.mode {
            StartupMode::Trust(t) => t.on_startup(client, message).await,
            StartupMode::Password(p) => p.on_startup(client, message).await,
        }
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
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    let shared = Arc::new(Shared { engine, auth, require_tls, limits });
    let stats = shared.limits.stats.clone();
    // Refusals are logged at most once a minute (an attack would flood the log), with
    // how many there were since.
    let mut last_warning: Option<Instant> = None;
    let mut unreported = 0u64;
    loop {
        let (socket, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "pg: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            stats.rejected.fetch_add(1, Ordering::Relaxed);
            unreported += 1;
            if last_warning.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
                tracing::warn!(
                    refused = unreported,
                    "pg: {} connections are open (pg.max_connections); closing new ones at accept",
                    shared.limits.max_connections
                );
                last_warning = Some(Instant::now());
                unreported = 0;
            }
            tracing::debug!(%peer, "pg: connection limit reached; closing");
            drop(socket);
            continue;
        };
        stats.accepted.fetch_add(1, Ordering::Relaxed);
        let (shared, tls) = (shared.clone(), tls.clone());
        tokio::spawn(async move {
            // The slot is held while the connection lives.
            let _slot = slot;
            shared.limits.stats.active.fetch_add(1, Ordering::Relaxed);
            if let Err(e) = connection(socket, tls, shared.clone()).await {
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

/// One connection: pgwire's own loop (`pgwire::tokio::process_socket`), with the
/// client's bytes passed through a [`Guard`] and `auth_timeout` instead of pgwire's
/// fixed 60 s startup timeout.
async fn connection(socket: TcpStream, tls: Option<tokio_rustls::TlsAcceptor>, shared: Arc<Shared>) -> io::Result<()> {
    let limits = shared.limits.clone();
    let timed_out = || {
        limits.stats.auth_timeouts.fetch_add(1, Ordering::Relaxed);
        tracing::debug!("pg: closing a connection that did not authenticate within {:?}", limits.auth_timeout);
    };
    // TLS, startup and authentication, all of it: a client that connects and sends
    // nothing, half a handshake or no password holds its slot this long at most.
    let deadline = tokio::time::sleep(limits.auth_timeout);
    tokio::pin!(deadline);
    let negotiated = tokio::select! {
        () = &mut deadline => {
            timed_out();
            return Ok(());
        }
        n = negotiate_tls(socket, tls) => n?,
    };
    // A direct TLS connection without TLS configured: nothing to say to it.
    let Some(framed) = negotiated else { return Ok(()) };
    let seen = Arc::new(Seen::default());
    let max_message = limits.max_sql_bytes.saturating_add(MESSAGE_SLACK);
    let parts = framed.into_parts();
    let guard = Guard::new(parts.io, &parts.read_buf, limits.max_sql_bytes, max_message, seen.clone());
    let mut parts_now = FramedParts::new::<PgWireBackendMessage>(guard, parts.codec);
    parts_now.write_buf = parts.write_buf;
    let mut socket = Framed::from_parts(parts_now);

    let parser = Arc::new(Parser { shared: shared.clone() });
    let handlers = Handlers { queries: Arc::new(Queries { shared, seen: seen.clone(), parser }) };
    let startup_handler = handlers.startup_handler();
    let simple_query_handler = handlers.simple_query_handler();
    let extended_query_handler = handlers.extended_query_handler();
    let copy_handler = handlers.copy_handler();
    let cancel_handler = handlers.cancel_handler();
    let error_handler = handlers.error_handler();
    loop {
        let authenticating = matches!(
            socket.state(),
            PgWireConnectionState::AwaitingStartup | PgWireConnectionState::AuthenticationInProgress
        );
        let step = async {
            let msg = match socket.next().await {
                Some(Ok(msg)) => msg,
                Some(Err(e)) => return Err(e),
                None => return Ok(false),
            };
            // Terminate: the client is leaving; close (some clients wait for it).
            if matches!(msg, PgWireFrontendMessage::Terminate(_)) {
                return Ok(false);
            }
            let is_extended_query = match socket.state() {
                PgWireConnectionState::CopyInProgress(is_extended_query) => is_extended_query,
                _ => msg.is_extended_query(),
            };
            if let Err(mut e) = process_message(
                msg,
                &mut socket,
                startup_handler.clone(),
                simple_query_handler.clone(),
                extended_query_handler.clone(),
                copy_handler.clone(),
                cancel_handler.clone(),
            )
            .await
            {
                error_handler.on_error(&socket, &mut e);
                process_error(&mut socket, e, is_extended_query).await?;
            }
            Ok(true)
        };
        let outcome = if authenticating {
            tokio::select! {
                () = &mut deadline => None,
                r = step => Some(r),
            }
        } else {
            Some(step.await)
        };
        match outcome {
            Some(Ok(true)) => {}
            Some(Ok(false)) => return Ok(()),
            None => {
                timed_out();
                let message =
                    format!("canceling authentication due to timeout ({:?}, pg.auth_timeout)", limits.auth_timeout);
                send_fatal(&mut socket, "57014", message).await;
                return Ok(());
            }
            Some(Err(e)) => {
                let len = seen.fatal_message.load(Ordering::Relaxed);
                if len > 0 {
                    limits.stats.oversized.fetch_add(1, Ordering::Relaxed);
                    let message = format!(
                        "a message of {len} bytes is larger than the server's limit of {max_message} bytes \
                         (sql.max_body_bytes + 64 KiB)"
                    );
                    send_fatal(&mut socket, "54000", message).await;
                }
                return Err(io::Error::other(e.to_string()));
            }
        }
    }
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
/// - Any other message over `max_message` bytes ends the connection (reads fail;
///   [`Seen::fatal_message`] says why).
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
    /// Bytes to hand up before anything else: a complete head, or a stand-in query.
    emit: [u8; 6],
    emit_start: usize,
    emit_end: usize,
    /// Bytes of the current message still to pass on, or to drop.
    body: usize,
    skip: usize,
    max_query: usize,
    max_message: usize,
    failed: bool,
    seen: Arc<Seen>,
}

/// The stand-in for a dropped query: `Q`, length 5, an empty NUL-terminated text.
const STAND_IN: [u8; 6] = [b'Q', 0, 0, 0, 5, 0];

impl<IO> Guard<IO> {
    /// `unread`: what pgwire had already read past the TLS negotiation (it starts at a
    /// message boundary: the startup message's).
    fn new(io: IO, unread: &[u8], max_query: usize, max_message: usize, seen: Arc<Seen>) -> Guard<IO> {
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
            emit: [0; 6],
            emit_start: 0,
            emit_end: 0,
            body: 0,
            skip: 0,
            max_query,
            max_message,
            failed: false,
            seen,
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
            self.emit = STAND_IN;
            self.emit_start = 0;
            self.emit_end = STAND_IN.len();
            self.skip = body;
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
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
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
        let mut guard = Guard::new(server, &input[..unread], 10, 100, seen.clone());
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
    async fn the_guard_ends_the_connection_on_other_oversized_messages() {
        let parse = message(b'P', &[b'a'; 200]);
        let input = [startup(), query("SELECT 1"), parse].concat();
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
