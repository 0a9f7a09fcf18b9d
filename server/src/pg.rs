//! The PostgreSQL wire protocol listener (`:5433`): the same read-only SQL as
//! `POST /api/v1/sql`, for psql, Grafana's PostgreSQL datasource and BI tools.
//!
//! ```text
//!  TCP accept ─► pgwire (startup, simple-query protocol)
//!    TLS: SSLRequest answered with rustls when [pg.tls] or [server.tls] is set
//!    startup: `trust` (apron up: user `apron` only, loopback) or `password` (apron serve:
//!             [[pg.users]], cleartext password inside TLS; each user has a role)
//!    Query "SELECT …" ─► QueryEngine::execute_as(the user's scope: a team:<name> user
//!             reads that team's rows only; same plan checks, timeout, memory and
//!             row limits as HTTP) ─► arrow-pg: Arrow batches → text rows with pg types
//!    Query "SET …" / "BEGIN" / "COMMIT" / "ROLLBACK" / "DISCARD ALL": acknowledged, no
//!             effect (clients send them on connect; nothing here is transactional)
//!    errors ─► ErrorResponse with a SQLSTATE (25006 read-only, 42601 syntax, 57014
//!             timeout, 53200 memory, 54000 too many rows, 53300 busy, …)
//! ```
//!
//! Only the simple-query protocol is served (psql, Grafana's datasource and most BI
//! tools use it for plain SQL); a client that insists on the extended protocol gets a
//! clear error.

use std::fmt::Debug;
use std::sync::Arc;

use apron_query::{QueryEngine, QueryError, Scope};
use async_trait::async_trait;
use futures::{Sink, stream};
use pgwire::api::auth::cleartext::CleartextPasswordAuthStartupHandler;
use pgwire::api::auth::noop::NoopStartupHandler;
use pgwire::api::auth::{AuthSource, DefaultServerParameterProvider, LoginInfo, Password, StartupHandler};
use pgwire::api::portal::Format;
use pgwire::api::query::SimpleQueryHandler;
use pgwire::api::results::{QueryResponse, Response, Tag};
use pgwire::api::store::PortalStore;
use pgwire::api::{ClientInfo, ClientPortalStore, PgWireServerHandlers};
use pgwire::error::{ErrorInfo, PgWireError, PgWireResult};
use pgwire::messages::{PgWireBackendMessage, PgWireFrontendMessage};
use tokio::net::TcpListener;

use crate::access::Role;

/// The user `apron up` accepts without a password.
pub const UP_USER: &str = "apron";

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

struct Queries {
    engine: Arc<QueryEngine>,
    auth: PgAuth,
}

/// Maps a query error to the SQLSTATE a PostgreSQL client understands.
fn pg_error(e: &QueryError) -> PgWireError {
    let code = match e {
        QueryError::ReadOnly { .. } => "25006",
        QueryError::Syntax { .. } => "42601",
        QueryError::Plan { .. } => "42P01",
        QueryError::Invalid { .. } => "22000",
        QueryError::Timeout { .. } => "57014",
        QueryError::MemoryLimit { .. } => "53200",
        QueryError::TooManyRows { .. } | QueryError::ResultTooLarge { .. } => "54000",
        QueryError::Busy { .. } => "53300",
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

/// Session statements clients send on connect, acknowledged without effect.
fn session_noop(query: &str) -> Option<&'static str> {
    let first = query.trim_start().split(|c: char| c.is_whitespace() || c == ';').next()?.to_ascii_uppercase();
    match first.as_str() {
        "SET" => Some("SET"),
        "BEGIN" | "START" => Some("BEGIN"),
        "COMMIT" | "END" => Some("COMMIT"),
        "ROLLBACK" | "ABORT" => Some("ROLLBACK"),
        "DISCARD" => Some("DISCARD ALL"),
        _ => None,
    }
}

#[async_trait]
impl SimpleQueryHandler for Queries {
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
            return Ok(vec![Response::Execution(Tag::new(tag))]);
        }
        // The startup handler authenticated this user; the scope follows its role.
        let user = client.metadata().get(pgwire::api::METADATA_USER).cloned();
        let Some(scope) = self.auth.scope(user.as_deref()) else {
            return Err(PgWireError::UserError(Box::new(ErrorInfo::new(
                "ERROR".to_owned(),
                "42501".to_owned(),
                format!("user {:?} may not query", user.unwrap_or_default()),
            ))));
        };
        let result = self.engine.execute_as(query, &scope).await.map_err(|e| pg_error(&e))?;
        let fields =
            Arc::new(arrow_pg::datatypes::arrow_schema_to_pg_fields(&result.schema, &Format::UnifiedText, None)?);
        let rows: Vec<_> = result
            .batches
            .into_iter()
            .flat_map(|b| arrow_pg::datatypes::encode_recordbatch(fields.clone(), b).collect::<Vec<_>>())
            .collect();
        Ok(vec![Response::Query(QueryResponse::new(fields, stream::iter(rows)))])
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

struct Handlers {
    queries: Arc<Queries>,
    auth: PgAuth,
    /// With TLS configured, a client that did not ask for it is refused before it
    /// sends a password in the clear.
    require_tls: bool,
}

impl PgWireServerHandlers for Handlers {
    fn simple_query_handler(&self) -> Arc<impl SimpleQueryHandler> {
        self.queries.clone()
    }

    fn startup_handler(&self) -> Arc<impl StartupHandler> {
        Arc::new(Startup { mode: StartupMode::from(&self.auth), require_tls: self.require_tls })
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

/// Serves the PostgreSQL protocol on `listener` until the task is dropped; with `tls`,
/// clients that ask for SSL get it (`sslmode=require`).
pub async fn serve(
    listener: TcpListener,
    engine: Arc<QueryEngine>,
    auth: PgAuth,
    tls: Option<Arc<rustls::ServerConfig>>,
) {
    let require_tls = tls.is_some();
    let tls = tls.map(tokio_rustls::TlsAcceptor::from);
    let handlers = Arc::new(Handlers { queries: Arc::new(Queries { engine, auth: auth.clone() }), auth, require_tls });
    loop {
        let (socket, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "pg: accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let (handlers, tls) = (handlers.clone(), tls.clone());
        tokio::spawn(async move {
            if let Err(e) = pgwire::tokio::process_socket(socket, tls, handlers).await {
                tracing::debug!(%peer, error = %e, "pg: connection ended with an error");
            }
        });
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
    }

    #[test]
    fn comment_only_queries_are_empty() {
        assert!(is_comment_only("-- ping"));
        assert!(is_comment_only(" /* hi */ ;\n-- x\n"));
        assert!(!is_comment_only("-- ping\nSELECT 1"));
        assert!(!is_comment_only("SELECT 1 -- trailing"));
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
