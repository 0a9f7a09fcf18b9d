//! `apron serve`'s configuration: the TOML file, the overrides the binary takes from
//! flags and `APRON_*` variables, and the validated [`ServeConfig`].
//!
//! ```toml
//! [server]
//! listen = "127.0.0.1:9402"          # loopback by default; port 0 picks a free port
//! header_read_timeout = "10s"        # slow clients cannot hold connections
//! body_read_timeout = "60s"          # longest gap in a request body
//! body_total_timeout = "60s"         # longest a whole request body may take
//! max_connections = 4096
//! metrics_auth = "none"             # or "token": GET /metrics needs a viewer/admin token
//! [server.tls]                       # HTTPS (and the pg port's TLS unless [pg.tls])
//! cert_file = "/etc/apron/tls/server.crt"
//! key_file = "/etc/apron/tls/server.key"
//!
//! [[tokens]]                         # bearer tokens with roles (crate::access)
//! role = "team:vision"               # agent | viewer | team:<name> | admin
//! token_file = "/etc/apron/tokens/vision"   # or token = "…"
//!
//! [ingest]
//! tokens = ["…"]                     # role agent; and/or
//! token_file = "/etc/apron/ingest-tokens"   # one token per line, '#' comments
//! max_body_bytes = "64MiB"           # 413 beyond
//! clock_skew_threshold = "30s"
//! max_concurrent = 32                # 429 beyond
//! max_requests_per_agent = 50        # per second, bursts of twice that; 0 = no limit
//!
//! [sql]
//! tokens = ["…"]                     # role viewer
//! max_body_bytes = "1MiB"            # the SQL text
//!
//! [storage]                          # apron_collector::StoreConfig
//! data_dir = "/var/lib/apron"
//! persist_interval = "10m"
//!
//! [rollup]                           # gpu_samples_1m materializer (crate::derive)
//! enabled = true
//! interval = "1m"
//!
//! [cost]                             # the cost ledger (crate::ledger)
//! enabled = true
//! interval = "1m"
//! price_book = "/etc/apron/pricebook.toml"
//! [cost.classify]                    # idle thresholds, stranded_after (+ overrides), max_idle_gap
//! [cost.teams]                       # team maps, workload-kind and interruptible rules
//!
//! [pg]                               # the PostgreSQL port (crate::pg)
//! listen = "127.0.0.1:5433"
//! users = [{ name = "grafana", password_file = "/etc/apron/pg/grafana" }]
//! max_connections = 256              # logged-in sessions; a login past them: FATAL 53300
//! auth_timeout = "5s"                # startup + authentication, or closed
//! max_preauth_connections = 128      # logging in at once; one more closes the oldest
//! max_connections_per_user = 64      # default: a quarter of max_connections
//! idle_timeout = "10m"               # a silent session is closed ("0s": never)
//! message_timeout = "30s"            # a half-sent message, an unread answer: closed
//! max_statements = 1024              # per connection (extended protocol) …
//! max_portals = 64                   # … suspended ones included
//! max_param_bytes = "1MiB"           # one bound value
//! max_session_bytes = "64MiB"        # statements + values + suspended results, per connection
//! max_total_session_bytes = "1GiB"   # all connections, beyond each one's first 2 MiB
//!
//! [report]                           # the weekly report schedule (crate::schedule)
//! enabled = true                     # delivered every Monday (at = "06:00", UTC)
//! # [report.email] (SMTP) and [report.webhook] (Slack-compatible JSON): docs/cost.md
//!
//! [cluster]                          # more than one machine over one bucket (crate::cluster)
//! role = "collector"                 # or "query"; needs [storage.object_store]
//! shard = "rack-a"                   # a collector's shard
//!
//! [remote_read]                     # POST /api/v1/read (crate::prom_remote::ReadLimits)
//! max_queries = 16                   # per request; 400 beyond
//! max_samples = 5000000              # per request's answer; 400 beyond
//! max_bytes = "64MiB"                # the answer as it is built; 413 beyond
//! max_concurrent = 2                 # requests at once; more wait (503 after 5 s)
//!
//! [query.ballista]                   # a query server's heavy scans on Ballista (apron_query::distributed)
//! scheduler = "df://127.0.0.1:50050"
//! min_scan_bytes = 268435456         # smaller scans run on the query server
//! fallback_local = true              # a query the cluster fails runs here once more
//! ```

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use apron_collector::StoreConfig;
use apron_collector::http::IngestOptions;
use apron_http::tls::TlsConfig;
use apron_query::QueryConfig;
use serde::Deserialize;

use crate::access::{Credential, Role};

pub use crate::derive::RollupConfig;

/// The server's default listen address: the contract's port, loopback only.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:9402";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("invalid config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("invalid value for `{key}`: {value:?} — {expected}")]
    Invalid { key: String, value: String, expected: String },
    #[error(
        "apron serve requires an ingest token: set [ingest] tokens = [\"…\"] or token_file = \"PATH\" in the config file, or APRON_INGEST_TOKEN"
    )]
    NoToken,
}

fn invalid(key: impl Into<String>, value: impl Into<String>, expected: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { key: key.into(), value: value.into(), expected: expected.into() }
}

/// The config file as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    #[serde(default)]
    pub server: ServerSection,
    #[serde(default)]
    pub ingest: IngestSection,
    #[serde(default)]
    pub storage: StoreConfig,
    #[serde(default)]
    pub sql: SqlSection,
    /// Limits of the SQL layer (`apron_query::QueryConfig`).
    #[serde(default)]
    pub query: QueryConfig,
    /// The `gpu_samples_1m` materializer.
    #[serde(default)]
    pub rollup: RollupConfig,
    /// The cost ledger: price book, thresholds, team maps (`crate::ledger`).
    #[serde(default)]
    pub cost: crate::ledger::CostConfig,
    /// The weekly report schedule: e-mail, webhook, export directory (`crate::schedule`).
    #[serde(default)]
    pub report: crate::schedule::ReportConfig,
    /// Live alerts and their receivers (`crate::alerts`).
    #[serde(default)]
    pub alerts: crate::alerts::AlertsConfig,
    /// Recommendations (`crate::recommend`).
    #[serde(default)]
    pub recommend: crate::recommend::RecommendSettings,
    /// The PostgreSQL wire listener (`crate::pg`).
    #[serde(default)]
    pub pg: PgSection,
    /// dcgm-exporter endpoints to scrape as a source (`[[scrape]]`, `crate::scrape`).
    #[serde(default)]
    pub scrape: Vec<crate::scrape::ScrapeTarget>,
    /// Bearer tokens with roles (`[[tokens]]`, `crate::access`).
    #[serde(default)]
    pub tokens: Vec<TokenEntry>,
    /// Sharded collectors and query servers over one lake (`crate::cluster`).
    #[serde(default)]
    pub cluster: crate::cluster::ClusterSection,
    /// Limits of Prometheus remote read (`POST /api/v1/read`, `crate::prom_remote`).
    #[serde(default)]
    pub remote_read: RemoteReadSection,
}

/// `[[tokens]]`: one bearer token (inline or, better, in a file) and its role.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenEntry {
    pub role: Role,
    pub token: Option<String>,
    pub token_file: Option<PathBuf>,
}

/// `[pg]`: where PostgreSQL clients connect and who they are. Without users the port is
/// not opened (secure by default).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PgSection {
    /// e.g. `"127.0.0.1:5433"` (the default when users are configured).
    pub listen: Option<String>,
    #[serde(default)]
    pub users: Vec<PgUser>,
    /// TLS for PostgreSQL clients (`sslmode=require`); without it, `[server.tls]`'s
    /// certificate is used when the server has one.
    pub tls: Option<TlsConfig>,
    /// Logged-in sessions at once; a login past them is refused (default 256).
    pub max_connections: Option<i64>,
    /// A connection must finish TLS, startup and authentication within this (default
    /// 5s), or it is closed.
    pub auth_timeout: Option<String>,
    /// Connections still logging in at once, counted apart from `max_connections`; one
    /// more closes the oldest of them (default 128).
    pub max_preauth_connections: Option<i64>,
    /// Sessions one user may have open (default: a quarter of `max_connections`).
    pub max_connections_per_user: Option<i64>,
    /// A session that sends nothing for this long is closed (default "10m"; "0s": never).
    pub idle_timeout: Option<String>,
    /// A message begun must arrive whole within this, and an answer must not wait on a
    /// client that reads nothing for longer (default "30s").
    pub message_timeout: Option<String>,
    /// Prepared statements per connection (default 1024).
    pub max_statements: Option<i64>,
    /// Portals per connection, suspended ones included (default 64).
    pub max_portals: Option<i64>,
    /// One bound parameter value (default 1MiB).
    pub max_param_bytes: Option<ByteSize>,
    /// What one connection may hold: statement texts, bound values, suspended results
    /// (default 64MiB).
    pub max_session_bytes: Option<ByteSize>,
    /// What all connections may hold together beyond each one's first 2 MiB (default 1GiB).
    pub max_total_session_bytes: Option<ByteSize>,
}

/// One PostgreSQL user: a password inline or (better) in a file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PgUser {
    pub name: String,
    pub password: Option<String>,
    pub password_file: Option<PathBuf>,
    /// `viewer` (the default), `team:<name>` or `admin`; `agent` cannot query.
    pub role: Option<Role>,
}

/// Who may run SQL (`POST /api/v1/sql`). Without a token the endpoint refuses every
/// request.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SqlSection {
    #[serde(default)]
    pub tokens: Vec<String>,
    /// Largest SQL text accepted (413 beyond); default 1 MiB.
    pub max_body_bytes: Option<ByteSize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerSection {
    pub listen: Option<String>,
    /// HTTPS for every route.
    pub tls: Option<TlsConfig>,
    /// A client must send its request headers within this (default 10s).
    pub header_read_timeout: Option<String>,
    /// … and its body without a gap longer than this (default 60s) …
    pub body_read_timeout: Option<String>,
    /// … and all of its body within this of the head (default 60s).
    pub body_total_timeout: Option<String>,
    /// Open connections at once; more are closed at accept (default 4096).
    pub max_connections: Option<i64>,
    /// Who may read `GET /metrics`: `"none"` (anyone who reaches the port; the default,
    /// so existing scrapes keep working) or `"token"` (a viewer's or admin's bearer token).
    pub metrics_auth: Option<String>,
}

/// `[remote_read]`: the limits of `POST /api/v1/read` (`crate::prom_remote::ReadLimits`).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemoteReadSection {
    /// Queries in one ReadRequest (default 16); more: 400.
    pub max_queries: Option<i64>,
    /// Samples one request's answer may hold, all queries together (default 5,000,000);
    /// more: 400, as Prometheus' `--storage.remote.read-sample-limit`.
    pub max_samples: Option<i64>,
    /// Bytes one request's answer may assemble before compression (default 64 MiB);
    /// more: 413.
    pub max_bytes: Option<ByteSize>,
    /// Remote reads at once (default 2), as Prometheus' `read-concurrent-limit`; more wait.
    pub max_concurrent: Option<i64>,
}

/// Who may read `GET /metrics` (`[server] metrics_auth`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum MetricsAuth {
    /// Anyone who reaches the port (the default: Prometheus scrapes without a token).
    #[default]
    None,
    /// A bearer token of role viewer or admin (every team's figures are on it).
    Token,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IngestSection {
    #[serde(default)]
    pub tokens: Vec<String>,
    pub token_file: Option<PathBuf>,
    pub max_body_bytes: Option<ByteSize>,
    pub clock_skew_threshold: Option<String>,
    pub max_concurrent: Option<i64>,
    pub max_requests_per_agent: Option<i64>,
}

pub use apron_common::size::ByteSize;

/// Flag and environment overrides; `None` keeps the file's value.
#[derive(Debug, Default, Clone)]
pub struct Overrides {
    pub listen: Option<String>,
    pub data_dir: Option<PathBuf>,
    /// One more accepted ingest token (`APRON_INGEST_TOKEN`).
    pub ingest_token: Option<String>,
    /// One more accepted SQL token (`APRON_SQL_TOKEN`).
    pub sql_token: Option<String>,
    /// The PostgreSQL listen address (`APRON_PG`).
    pub pg_listen: Option<String>,
    /// A collector's shard (`APRON_SHARD`, e.g. a StatefulSet pod's name), over
    /// `[cluster] shard`.
    pub shard: Option<String>,
    /// The bucket's keys where `[storage.object_store]` leaves them out.
    pub credentials: apron_collector::storage::Credentials,
}

/// The PostgreSQL listener: address, users, TLS and its connection limits (the SQL
/// text limit is `[sql] max_body_bytes`, shared with HTTP: [`HttpOptions::max_sql_bytes`]).
#[derive(Debug, Clone)]
pub struct PgListen {
    pub addr: SocketAddr,
    pub users: Vec<crate::pg::PgUser>,
    pub tls: Option<TlsConfig>,
    pub max_connections: usize,
    pub auth_timeout: Duration,
    /// The rest of `[pg]`'s limits (connections logging in, per user, timeouts, what a
    /// session may hold): `crate::pg::PgLimits::session`.
    pub session: crate::pg::PgSessionLimits,
}

/// The HTTP listener's transport settings.
#[derive(Debug, Clone)]
pub struct HttpOptions {
    pub tls: Option<TlsConfig>,
    pub header_read_timeout: Duration,
    /// The longest gap in a request body.
    pub body_read_timeout: Duration,
    /// The longest a whole request body may take.
    pub body_total_timeout: Duration,
    pub max_connections: usize,
    /// Largest SQL text (`POST /api/v1/sql` and the PostgreSQL port).
    pub max_sql_bytes: usize,
    /// Who may read `GET /metrics`.
    pub metrics_auth: MetricsAuth,
    /// `[remote_read]`.
    pub remote_read: crate::prom_remote::ReadLimits,
}

impl Default for HttpOptions {
    fn default() -> Self {
        HttpOptions {
            tls: None,
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(60),
            body_total_timeout: Duration::from_secs(60),
            max_connections: 4096,
            max_sql_bytes: 1 << 20,
            metrics_auth: MetricsAuth::None,
            remote_read: crate::prom_remote::ReadLimits::default(),
        }
    }
}

/// Everything `apron serve` runs on, validated.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub listen: SocketAddr,
    pub store: StoreConfig,
    pub ingest: IngestOptions,
    pub query: QueryConfig,
    /// Every bearer token with its role (ingest tokens are also in `ingest.tokens`).
    pub credentials: Vec<Credential>,
    pub http: HttpOptions,
    pub rollup: RollupConfig,
    pub cost: crate::ledger::CostConfig,
    pub report: crate::schedule::ReportConfig,
    pub alerts: crate::alerts::AlertsConfig,
    pub recommend: crate::recommend::RecommendSettings,
    /// `None`: not listening.
    pub pg: Option<PgListen>,
    pub scrape: Vec<crate::scrape::ScrapeTarget>,
    /// This server's part in a cluster (`[cluster]`).
    pub cluster: crate::cluster::Cluster,
}

const MAX_BODY_MIN: u64 = 1 << 10;
const MAX_BODY_MAX: u64 = 1 << 32;

impl FileConfig {
    pub fn load(path: &Path) -> Result<FileConfig, ConfigError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_owned(), source })?;
        FileConfig::parse(&text, path)
    }

    /// The top-level sections (tables and arrays of tables) a config file sets.
    pub fn sections_in(path: &Path) -> Result<Vec<String>, ConfigError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_owned(), source })?;
        let table: toml::Table = toml::from_str(&text)
            .map_err(|e| ConfigError::Parse { path: path.to_owned(), message: e.to_string().trim().to_owned() })?;
        Ok(table.keys().cloned().collect())
    }

    pub fn parse(text: &str, path: &Path) -> Result<FileConfig, ConfigError> {
        toml::from_str(text)
            .map_err(|e| ConfigError::Parse { path: path.to_owned(), message: e.to_string().trim().to_owned() })
    }

    /// Applies overrides and validates; reads `ingest.token_file`. The accepted tokens
    /// are all of `ingest.tokens`, the file's and the override's (several at once let
    /// an operator rotate them without downtime).
    pub fn resolve(mut self, o: Overrides) -> Result<ServeConfig, ConfigError> {
        let listen_text = o.listen.or(self.server.listen.take()).unwrap_or_else(|| DEFAULT_LISTEN.to_owned());
        let listen: SocketAddr = listen_text.parse().map_err(|_| {
            invalid("server.listen", &listen_text, "an address such as 127.0.0.1:9402 (port 0 picks a free port)")
        })?;

        let i = self.ingest;
        // Every credential with its role; the ingest route accepts those that may ingest.
        let mut credentials: Vec<Credential> = Vec::new();
        let mut add = |key: String, token: String, role: Role| -> Result<(), ConfigError> {
            let token = check_token(key.clone(), token)?;
            if let Some(other) = credentials.iter_mut().find(|c| *c.token == *token.as_bytes()) {
                // The same token as ingest and as SQL token (one secret for both, as
                // before roles existed) may do both: admin. Any other mix is a mistake.
                other.role = match (&other.role, &role) {
                    (a, b) if a == b => role,
                    (Role::Agent, Role::Viewer | Role::Admin) | (Role::Viewer | Role::Admin, Role::Agent) => {
                        Role::Admin
                    }
                    (Role::Admin, Role::Viewer) | (Role::Viewer, Role::Admin) => Role::Admin,
                    (a, _) => {
                        return Err(invalid(key, "<hidden>", format!("a token not already listed with role {a}")));
                    }
                };
                return Ok(());
            }
            credentials.push(Credential { token: token.into_bytes().into(), role });
            Ok(())
        };
        for (n, t) in i.tokens.into_iter().enumerate() {
            add(format!("ingest.tokens[{n}]"), t, Role::Agent)?;
        }
        if let Some(path) = &i.token_file {
            for (key, t) in read_token_file("ingest.token_file", path)? {
                add(key, t, Role::Agent)?;
            }
        }
        if let Some(t) = o.ingest_token {
            add("APRON_INGEST_TOKEN".into(), t, Role::Agent)?;
        }
        for (n, t) in self.sql.tokens.into_iter().enumerate() {
            add(format!("sql.tokens[{n}]"), t, Role::Viewer)?;
        }
        if let Some(t) = o.sql_token {
            add("APRON_SQL_TOKEN".into(), t, Role::Viewer)?;
        }
        for (n, e) in self.tokens.into_iter().enumerate() {
            let key = format!("tokens[{n}]");
            match (e.token, &e.token_file) {
                (Some(t), None) => add(key, t, e.role)?,
                (None, Some(path)) => {
                    for (key, t) in read_token_file(&format!("{key}.token_file"), path)? {
                        add(key, t, e.role.clone())?;
                    }
                }
                _ => return Err(invalid(key, e.role.to_string(), "exactly one of token or token_file")),
            }
        }
        let tokens: Vec<String> = credentials
            .iter()
            .filter(|c| c.role.may_ingest())
            .map(|c| String::from_utf8_lossy(&c.token).into_owned())
            .collect();
        let mut store = self.storage;
        if let Some(os) = store.object_store.as_mut() {
            os.fill_credentials(&o.credentials);
        }
        if let Some(shard) = o.shard {
            self.cluster.shard = Some(shard);
        }
        let cluster = self.cluster.resolve(&mut store)?;
        let query_server = matches!(cluster, crate::cluster::Cluster::Query { .. });
        if tokens.is_empty() && !query_server {
            return Err(ConfigError::NoToken);
        }
        if let Some(b) = &self.query.ballista {
            if !query_server {
                return Err(invalid(
                    "query.ballista",
                    &b.scheduler,
                    "only on a query server ([cluster] role = \"query\"): a collector's memtable rows cannot be shipped",
                ));
            }
            b.endpoint().map_err(|e| invalid("query.ballista.scheduler", &b.scheduler, e))?;
        }
        if query_server && !self.scrape.is_empty() {
            return Err(invalid("scrape", "[[scrape]]", "none on a query server: scrapes go to a collector"));
        }
        if credentials.iter().any(|c| c.token.len() < 16) {
            tracing::warn!("a token is shorter than 16 characters; use a long random one (openssl rand -hex 32)");
        }

        let defaults = IngestOptions::default();
        let max_body_bytes = match &i.max_body_bytes {
            None => defaults.max_body_bytes,
            Some(v) => parse_size("ingest.max_body_bytes", v)?,
        };
        let clock_skew_threshold = match i.clock_skew_threshold {
            None => defaults.clock_skew_threshold,
            Some(text) => {
                let d = humantime::parse_duration(&text).map_err(|e| {
                    invalid("ingest.clock_skew_threshold", &text, format!("a duration such as \"30s\" ({e})"))
                })?;
                if !(Duration::from_secs(1)..=Duration::from_secs(86_400)).contains(&d) {
                    return Err(invalid("ingest.clock_skew_threshold", text, "between 1s and 1d"));
                }
                d
            }
        };
        let max_concurrent = match i.max_concurrent {
            None => defaults.max_concurrent,
            Some(n) if (1..=4096).contains(&n) => usize::try_from(n).unwrap_or(defaults.max_concurrent),
            Some(n) => return Err(invalid("ingest.max_concurrent", n.to_string(), "between 1 and 4096")),
        };

        if let Some(dir) = o.data_dir {
            store.data_dir = dir;
        }
        let max_requests_per_agent = match i.max_requests_per_agent {
            None => defaults.max_requests_per_agent,
            Some(n) if (0..=1_000_000).contains(&n) => u32::try_from(n).ok().and_then(std::num::NonZeroU32::new),
            Some(n) => {
                return Err(invalid(
                    "ingest.max_requests_per_agent",
                    n.to_string(),
                    "between 0 (no limit) and 1000000",
                ));
            }
        };
        let http = resolve_http(self.server, self.sql.max_body_bytes, self.remote_read)?;
        self.report.validate()?;
        Ok(ServeConfig {
            listen,
            store,
            ingest: IngestOptions {
                tokens,
                max_body_bytes,
                clock_skew_threshold,
                max_concurrent,
                max_requests_per_agent,
            },
            query: self.query,
            credentials,
            pg: resolve_pg(self.pg, o.pg_listen, http.tls.as_ref())?,
            http,
            rollup: self.rollup,
            cost: self.cost,
            report: self.report,
            alerts: self.alerts,
            recommend: self.recommend,
            scrape: self.scrape,
            cluster,
        })
    }
}

/// A size between 1 KiB and 4 GiB.
fn parse_size(key: &str, v: &ByteSize) -> Result<usize, ConfigError> {
    let text = v.text();
    v.bytes().filter(|n| (MAX_BODY_MIN..=MAX_BODY_MAX).contains(n)).and_then(|n| usize::try_from(n).ok()).ok_or_else(
        || invalid(key, text, "a size between 1KiB and 4GiB: a number of bytes or a string such as \"64MiB\""),
    )
}

/// A duration between 100 ms and 1 h.
fn parse_timeout(key: &str, text: &str) -> Result<Duration, ConfigError> {
    let d =
        humantime::parse_duration(text).map_err(|e| invalid(key, text, format!("a duration such as \"10s\" ({e})")))?;
    if !(Duration::from_millis(100)..=Duration::from_secs(3600)).contains(&d) {
        return Err(invalid(key, text, "between 100ms and 1h"));
    }
    Ok(d)
}

/// The tokens of a token file: one per line, blank lines and `#` comments skipped.
fn read_token_file(key: &str, path: &Path) -> Result<Vec<(String, String)>, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| invalid(key, path.display().to_string(), format!("a readable file of tokens ({e})")))?;
    Ok(text
        .lines()
        .enumerate()
        .map(|(n, l)| (n, l.trim()))
        .filter(|(_, l)| !l.is_empty() && !l.starts_with('#'))
        .map(|(n, l)| (format!("{key} {} line {}", path.display(), n + 1), l.to_owned()))
        .collect())
}

/// `[server]`'s transport settings and `[sql] max_body_bytes`.
fn resolve_http(
    server: ServerSection,
    max_sql: Option<ByteSize>,
    read: RemoteReadSection,
) -> Result<HttpOptions, ConfigError> {
    let d = HttpOptions::default();
    let count = |key: &str, v: Option<i64>, default: usize, max: i64| match v {
        None => Ok(default),
        Some(n) if (1..=max).contains(&n) => Ok(usize::try_from(n).unwrap_or(default)),
        Some(n) => Err(invalid(key, n.to_string(), format!("between 1 and {max}"))),
    };
    let r = d.remote_read;
    let remote_read = crate::prom_remote::ReadLimits {
        max_queries: count("remote_read.max_queries", read.max_queries, r.max_queries, 10_000)?,
        max_samples: count("remote_read.max_samples", read.max_samples, r.max_samples, 1_000_000_000)?,
        max_bytes: match &read.max_bytes {
            Some(v) => parse_size("remote_read.max_bytes", v)?,
            None => r.max_bytes,
        },
        max_concurrent: count("remote_read.max_concurrent", read.max_concurrent, r.max_concurrent, 1024)?,
    };
    let metrics_auth = match server.metrics_auth.as_deref().map(str::trim) {
        None | Some("none") => MetricsAuth::None,
        Some("token") => MetricsAuth::Token,
        Some(other) => return Err(invalid("server.metrics_auth", other, "\"none\" or \"token\"")),
    };
    Ok(HttpOptions {
        tls: server.tls,
        header_read_timeout: match server.header_read_timeout {
            Some(t) => parse_timeout("server.header_read_timeout", &t)?,
            None => d.header_read_timeout,
        },
        body_read_timeout: match server.body_read_timeout {
            Some(t) => parse_timeout("server.body_read_timeout", &t)?,
            None => d.body_read_timeout,
        },
        body_total_timeout: match server.body_total_timeout {
            Some(t) => parse_timeout("server.body_total_timeout", &t)?,
            None => d.body_total_timeout,
        },
        max_connections: match server.max_connections {
            None => d.max_connections,
            Some(n) if (1..=1_000_000).contains(&n) => usize::try_from(n).unwrap_or(d.max_connections),
            Some(n) => return Err(invalid("server.max_connections", n.to_string(), "between 1 and 1000000")),
        },
        max_sql_bytes: match &max_sql {
            Some(v) => parse_size("sql.max_body_bytes", v)?,
            None => d.max_sql_bytes,
        },
        metrics_auth,
        remote_read,
    })
}

/// A token must be sendable in a header unchanged. The error never shows the token.
fn check_token(key: String, token: String) -> Result<String, ConfigError> {
    let token = token.trim().to_owned();
    if token.is_empty() || !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(invalid(key, "<hidden>", "a non-empty token of visible ASCII characters, no spaces"));
    }
    Ok(token)
}

/// `[pg]` → the listener's address and users (passwords read from their files).
fn resolve_pg(
    pg: PgSection,
    listen: Option<String>,
    server_tls: Option<&TlsConfig>,
) -> Result<Option<PgListen>, ConfigError> {
    let session = resolve_pg_session(&pg)?;
    let mut users = Vec::new();
    for (n, u) in pg.users.into_iter().enumerate() {
        let key = format!("pg.users[{n}]");
        if u.name.trim().is_empty() {
            return Err(invalid(&key, "", "a user name"));
        }
        let password = match (u.password, &u.password_file) {
            (Some(p), None) => p,
            (None, Some(path)) => std::fs::read_to_string(path)
                .map_err(|e| {
                    invalid(
                        format!("{key}.password_file"),
                        path.display().to_string(),
                        format!("a readable file ({e})"),
                    )
                })?
                .lines()
                .next()
                .unwrap_or_default()
                .trim()
                .to_owned(),
            _ => return Err(invalid(&key, &u.name, "exactly one of password or password_file")),
        };
        if password.len() < 8 {
            return Err(invalid(&key, &u.name, "a password of at least 8 characters"));
        }
        let role = u.role.unwrap_or(Role::Viewer);
        if role.read_scope().is_none() {
            return Err(invalid(
                format!("{key}.role"),
                role.to_string(),
                "viewer, team:<name> or admin (agents cannot query)",
            ));
        }
        users.push(crate::pg::PgUser { name: u.name, password, role });
    }
    let max_connections = match pg.max_connections {
        None => crate::pg::DEFAULT_MAX_CONNECTIONS,
        Some(n) if (1..=100_000).contains(&n) => usize::try_from(n).unwrap_or(crate::pg::DEFAULT_MAX_CONNECTIONS),
        Some(n) => return Err(invalid("pg.max_connections", n.to_string(), "between 1 and 100000")),
    };
    let auth_timeout = match &pg.auth_timeout {
        Some(t) => parse_timeout("pg.auth_timeout", t)?,
        None => crate::pg::DEFAULT_AUTH_TIMEOUT,
    };
    let listen = listen.or(pg.listen);
    if users.is_empty() {
        if let Some(l) = listen {
            tracing::warn!(listen = %l, "[pg] has no users: the PostgreSQL port stays closed");
        }
        return Ok(None);
    }
    let text = listen.unwrap_or_else(|| "127.0.0.1:5433".to_owned());
    let addr: SocketAddr =
        text.parse().map_err(|_| invalid("pg.listen", &text, "an address such as 127.0.0.1:5433"))?;
    let tls = pg.tls.or_else(|| server_tls.cloned());
    Ok(Some(PgListen { addr, users, tls, max_connections, auth_timeout, session }))
}

/// `[pg]`'s limits past `max_connections` and `auth_timeout` (`crate::pg::PgSessionLimits`).
fn resolve_pg_session(pg: &PgSection) -> Result<crate::pg::PgSessionLimits, ConfigError> {
    let d = crate::pg::PgSessionLimits::default();
    let count = |key: &str, v: Option<i64>, default: usize| match v {
        None => Ok(default),
        Some(n) if (1..=1_000_000).contains(&n) => Ok(usize::try_from(n).unwrap_or(default)),
        Some(n) => Err(invalid(key, n.to_string(), "between 1 and 1000000")),
    };
    let size = |key: &str, v: &Option<ByteSize>, default: usize| v.as_ref().map_or(Ok(default), |v| parse_size(key, v));
    let idle_timeout = match pg.idle_timeout.as_deref().map(str::trim) {
        None => d.idle_timeout,
        Some("0" | "0s") => None,
        Some(t) => {
            let e = |why: String| invalid("pg.idle_timeout", t, why);
            let idle = humantime::parse_duration(t).map_err(|x| e(format!("a duration such as \"10m\" ({x})")))?;
            if !(Duration::from_secs(1)..=Duration::from_secs(7 * 86_400)).contains(&idle) {
                return Err(e("between 1s and 7d, or \"0s\" for never".to_owned()));
            }
            Some(idle)
        }
    };
    let per_user = pg.max_connections_per_user.map(|n| count("pg.max_connections_per_user", Some(n), 1)).transpose()?;
    Ok(crate::pg::PgSessionLimits {
        max_preauth_connections: count(
            "pg.max_preauth_connections",
            pg.max_preauth_connections,
            d.max_preauth_connections,
        )?,
        max_connections_per_user: per_user,
        idle_timeout,
        message_timeout: match &pg.message_timeout {
            Some(t) => parse_timeout("pg.message_timeout", t)?,
            None => d.message_timeout,
        },
        max_statements: count("pg.max_statements", pg.max_statements, d.max_statements)?,
        max_portals: count("pg.max_portals", pg.max_portals, d.max_portals)?,
        max_param_bytes: size("pg.max_param_bytes", &pg.max_param_bytes, d.max_param_bytes)?,
        max_session_bytes: size("pg.max_session_bytes", &pg.max_session_bytes, d.max_session_bytes)?,
        max_total_session_bytes: size(
            "pg.max_total_session_bytes",
            &pg.max_total_session_bytes,
            d.max_total_session_bytes,
        )?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(text: &str, o: Overrides) -> Result<ServeConfig, ConfigError> {
        FileConfig::parse(text, Path::new("apron.toml"))?.resolve(o)
    }

    #[test]
    fn a_token_is_required() {
        let e = resolve("", Overrides::default()).expect_err("no token");
        assert!(e.to_string().contains("APRON_INGEST_TOKEN") && e.to_string().contains("token_file"), "{e}");
        let c = resolve("", Overrides { ingest_token: Some("from-the-environment".into()), ..Default::default() })
            .expect("env token");
        assert_eq!(c.ingest.tokens, vec!["from-the-environment".to_owned()]);
    }

    #[test]
    fn defaults() {
        let c = resolve("[ingest]\ntokens = [\"0123456789abcdef\"]\n", Overrides::default()).expect("valid");
        assert_eq!(c.listen, DEFAULT_LISTEN.parse().expect("addr"));
        assert!(c.listen.ip().is_loopback());
        assert_eq!(c.ingest.max_body_bytes, 64 << 20);
        assert_eq!(c.ingest.clock_skew_threshold, Duration::from_secs(30));
        assert_eq!(c.store, StoreConfig::default());
        assert_eq!(
            (c.http.body_read_timeout, c.http.body_total_timeout),
            (Duration::from_secs(60), Duration::from_secs(60))
        );
        assert_eq!((c.http.max_connections, c.http.max_sql_bytes), (4096, 1 << 20));
        let c = resolve(
            "[ingest]\ntokens = [\"0123456789abcdef\"]\n[pg]\nusers = [{ name = \"a\", password = \"password-1\" }]\n",
            Overrides::default(),
        )
        .expect("valid");
        let pg = c.pg.expect("pg");
        assert_eq!((pg.max_connections, pg.auth_timeout), (256, Duration::from_secs(5)));
        assert_eq!(pg.session, crate::pg::PgSessionLimits::default());
    }

    #[test]
    fn pg_session_limits_parse() {
        let base =
            "[ingest]\ntokens = [\"0123456789abcdef\"]\n[pg]\nusers = [{ name = \"a\", password = \"password-1\" }]\n";
        let text = format!(
            "{base}max_preauth_connections = 16\nmax_connections_per_user = 3\nidle_timeout = \"2m\"\n\
             message_timeout = \"5s\"\nmax_statements = 10\nmax_portals = 4\nmax_param_bytes = \"4KiB\"\n\
             max_session_bytes = \"64KiB\"\nmax_total_session_bytes = \"1MiB\"\n"
        );
        let pg = resolve(&text, Overrides::default()).expect("valid").pg.expect("pg");
        let expected = crate::pg::PgSessionLimits {
            max_preauth_connections: 16,
            max_connections_per_user: Some(3),
            idle_timeout: Some(Duration::from_secs(120)),
            message_timeout: Duration::from_secs(5),
            max_statements: 10,
            max_portals: 4,
            max_param_bytes: 4 << 10,
            max_session_bytes: 64 << 10,
            max_total_session_bytes: 1 << 20,
        };
        assert_eq!(pg.session, expected);
        let pg = resolve(&format!("{base}idle_timeout = \"0s\"\n"), Overrides::default()).expect("valid").pg;
        assert_eq!(pg.expect("pg").session.idle_timeout, None, "0s: never");
        let err = |extra: &str| resolve(&format!("{base}{extra}"), Overrides::default()).expect_err(extra).to_string();
        assert!(err("max_statements = 0\n").contains("pg.max_statements"));
        assert!(err("max_portals = -1\n").contains("pg.max_portals"));
        assert!(err("max_connections_per_user = 0\n").contains("pg.max_connections_per_user"));
        assert!(err("max_preauth_connections = 0\n").contains("pg.max_preauth_connections"));
        assert!(err("idle_timeout = \"soon\"\n").contains("pg.idle_timeout"));
        assert!(err("message_timeout = \"2h\"\n").contains("pg.message_timeout"));
        assert!(err("max_session_bytes = \"lots\"\n").contains("pg.max_session_bytes"));
        assert!(err("max_param_bytes = 10\n").contains("pg.max_param_bytes"));
        assert!(err("max_total_session_bytes = \"8GiB\"\n").contains("pg.max_total_session_bytes"));
    }

    #[test]
    fn the_shard_and_the_buckets_keys_come_from_outside_the_file() {
        let tok = "[ingest]\ntokens = [\"0123456789abcdef\"]\n";
        let lake = "[storage.object_store]\nurl = \"s3://lake\"\n[cluster]\nrole = \"collector\"\n";
        let keys = apron_collector::storage::Credentials {
            access_key_id: Some("from-env".into()),
            secret_access_key: Some("secret-from-env".into()),
        };
        let o = || Overrides { shard: Some("apron-1".into()), credentials: keys.clone(), ..Default::default() };
        let c = resolve(&format!("{tok}{lake}"), o()).expect("valid");
        assert!(matches!(&c.cluster, crate::cluster::Cluster::Collector { shard, .. } if shard.as_str() == "apron-1"));
        let os = c.store.object_store.expect("lake");
        assert_eq!(
            (os.access_key_id.as_deref(), os.secret_access_key.as_deref()),
            (Some("from-env"), Some("secret-from-env"))
        );
        // The file's keys and shard? The override's shard wins (one file for every pod);
        // the file's keys win over the environment's.
        let text = format!("{tok}{lake}shard = \"rack-a\"\n")
            .replace("url = \"s3://lake\"\n", "url = \"s3://lake\"\naccess_key_id = \"in-file\"\n");
        let c = resolve(&text, o()).expect("valid");
        assert!(matches!(&c.cluster, crate::cluster::Cluster::Collector { shard, .. } if shard.as_str() == "apron-1"));
        let os = c.store.object_store.expect("lake");
        assert_eq!(
            (os.access_key_id.as_deref(), os.secret_access_key.as_deref()),
            (Some("in-file"), Some("secret-from-env"))
        );
        // A shard for a server that is no collector is refused, as in the file.
        let e = resolve(tok, o()).expect_err("no collector").to_string();
        assert!(e.contains("shard") && e.contains("collector"), "{e}");
    }

    #[test]
    fn values_and_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("tokens");
        std::fs::write(&file, "# rotation\nold-token-aaaaaaaaaa\n\n  new-token-bbbbbbbbbb  \n").expect("write");
        let text = format!(
            "[server]\nlisten = \"0.0.0.0:0\"\n[ingest]\ntoken_file = {:?}\nmax_body_bytes = \"1MiB\"\nclock_skew_threshold = \"2m\"\nmax_concurrent = 4\n[storage]\ndata_dir = \"/srv/apron\"\npersist_interval = \"1m\"\n",
            file.display().to_string()
        );
        let c = resolve(&text, Overrides { data_dir: Some("/elsewhere".into()), ..Default::default() }).expect("valid");
        assert_eq!(c.ingest.tokens, vec!["old-token-aaaaaaaaaa".to_owned(), "new-token-bbbbbbbbbb".to_owned()]);
        assert_eq!(c.ingest.max_body_bytes, 1 << 20);
        assert_eq!(c.ingest.clock_skew_threshold, Duration::from_secs(120));
        assert_eq!(c.ingest.max_concurrent, 4);
        assert_eq!(c.store.data_dir, PathBuf::from("/elsewhere"), "the override wins");
        assert_eq!(c.store.persist_interval, Duration::from_secs(60));
        assert_eq!(c.listen.port(), 0);
    }

    #[test]
    fn tokens_carry_roles_and_limits_parse() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("vision");
        std::fs::write(
            &file,
            "# team vision's Grafana
vision-token-0123456789
",
        )
        .expect("write");
        let text = format!(
            "[ingest]\ntokens = [\"agent-token-0123456789\"]\nmax_requests_per_agent = 0\n\
             [sql]\ntokens = [\"viewer-token-0123456789\"]\nmax_body_bytes = \"4KiB\"\n\
             [[tokens]]\nrole = \"team:vision\"\ntoken_file = {:?}\n\
             [[tokens]]\nrole = \"admin\"\ntoken = \"admin-token-0123456789\"\n\
             [server]\nheader_read_timeout = \"2s\"\nmax_connections = 10\nbody_total_timeout = \"30s\"\n\
             [pg]\nusers = [{{ name = \"v\", password = \"password-1\", role = \"team:vision\" }}, {{ name = \"f\", password = \"password-2\" }}]\n\
             max_connections = 8\nauth_timeout = \"2s\"\n",
            file.display().to_string()
        );
        let c = resolve(&text, Overrides::default()).expect("valid");
        let roles: Vec<String> = c.credentials.iter().map(|c| c.role.to_string()).collect();
        assert_eq!(roles, ["agent", "viewer", "team:vision", "admin"]);
        assert_eq!(c.ingest.tokens, ["agent-token-0123456789", "admin-token-0123456789"], "agent and admin ingest");
        assert_eq!(c.ingest.max_requests_per_agent, None, "0 turns the rate limit off");
        assert_eq!((c.http.max_sql_bytes, c.http.max_connections), (4096, 10));
        assert_eq!(c.http.header_read_timeout, Duration::from_secs(2));
        assert_eq!(c.http.body_total_timeout, Duration::from_secs(30));
        assert_eq!(c.http.body_read_timeout, Duration::from_secs(60), "the default");
        let pg = c.pg.expect("pg");
        assert_eq!((pg.max_connections, pg.auth_timeout), (8, Duration::from_secs(2)));
        assert_eq!(pg.users[0].role.to_string(), "team:vision");
        assert_eq!(pg.users[1].role.to_string(), "viewer", "the default role");

        let tok = "[ingest]\ntokens = [\"agent-token-0123456789\"]\n";
        let err = |extra: &str| resolve(&format!("{tok}{extra}"), Overrides::default()).expect_err(extra).to_string();
        assert!(err("[[tokens]]\nrole = \"root\"\ntoken = \"x-0123456789abcdef\"\n").contains("role"));
        assert!(err("[[tokens]]\nrole = \"viewer\"\n").contains("exactly one of token or token_file"));
        let e = err("[[tokens]]\nrole = \"team:x\"\ntoken = \"agent-token-0123456789\"\n");
        assert!(e.contains("already listed with role agent") && !e.contains("agent-token-0123456789"), "{e}");
        // One secret as ingest and SQL token (deployments from before roles): admin.
        let c = resolve(&format!("{tok}[sql]\ntokens = [\"agent-token-0123456789\"]\n"), Overrides::default())
            .expect("valid");
        assert_eq!(c.credentials.len(), 1);
        assert_eq!(c.credentials[0].role, Role::Admin);
        assert_eq!(c.ingest.tokens, ["agent-token-0123456789"]);
        assert!(
            err("[pg]\nusers = [{ name = \"a\", password = \"password-1\", role = \"agent\" }]\n")
                .contains("agents cannot query")
        );
        assert!(err("[server]\nheader_read_timeout = \"forever\"\n").contains("server.header_read_timeout"));
        assert!(err("[server]\nbody_total_timeout = \"10ms\"\n").contains("server.body_total_timeout"));
        let pg_user = "[pg]\nusers = [{ name = \"a\", password = \"password-1\" }]\n";
        assert!(err(&format!("{pg_user}max_connections = 0\n")).contains("pg.max_connections"));
        assert!(err(&format!("{pg_user}auth_timeout = \"never\"\n")).contains("pg.auth_timeout"));
        assert!(err("max_requests_per_agent = -1\n").contains("ingest.max_requests_per_agent"));
        // A team or viewer token alone cannot ingest: the server still needs an agent token.
        let e = resolve("[[tokens]]\nrole = \"viewer\"\ntoken = \"viewer-token-0123456789\"\n", Overrides::default());
        assert!(matches!(e, Err(ConfigError::NoToken)), "{e:?}");
    }

    #[test]
    fn errors_name_the_key() {
        let tok = "[ingest]\ntokens = [\"0123456789abcdef\"]\n";
        let err = |extra: &str| resolve(&format!("{tok}{extra}"), Overrides::default()).expect_err(extra).to_string();
        assert!(err("[server]\nlisten = \"nowhere\"\n").contains("server.listen"));
        assert!(err("max_body_bytes = \"lots\"\n").contains("ingest.max_body_bytes"));
        assert!(err("max_body_bytes = 10\n").contains("1KiB"));
        assert!(err("clock_skew_threshold = \"soon\"\n").contains("ingest.clock_skew_threshold"));
        assert!(err("max_concurrent = 0\n").contains("ingest.max_concurrent"));
        assert!(err("tokenz = []\n").contains("tokenz"), "unknown keys are refused");
        assert!(err("[storage]\npersist_intervall = \"1m\"\n").contains("persist_intervall"));
        let e = resolve("[ingest]\ntokens = [\"two words\"]\n", Overrides::default()).expect_err("spaces").to_string();
        assert!(e.contains("ingest.tokens[0]") && !e.contains("two words"), "{e}");
        let e = resolve("[ingest]\ntoken_file = \"/nonexistent/t\"\n", Overrides::default()).expect_err("file");
        assert!(e.to_string().contains("/nonexistent/t"), "{e}");
    }

    #[test]
    fn metrics_auth_and_remote_read_limits() {
        let tok = "[ingest]\ntokens = [\"0123456789abcdef\"]\n";
        let c = resolve(tok, Overrides::default()).expect("valid");
        assert_eq!(c.http.metrics_auth, MetricsAuth::None, "existing scrapes keep working");
        let r = c.http.remote_read;
        assert_eq!((r.max_queries, r.max_samples, r.max_bytes, r.max_concurrent), (16, 5_000_000, 64 << 20, 2));
        let text = format!(
            "{tok}[server]\nmetrics_auth = \"token\"\n[remote_read]\nmax_queries = 2\nmax_samples = 100\nmax_bytes = \"1KiB\"\nmax_concurrent = 1\n"
        );
        let c = resolve(&text, Overrides::default()).expect("valid");
        assert_eq!(c.http.metrics_auth, MetricsAuth::Token);
        let r = c.http.remote_read;
        assert_eq!((r.max_queries, r.max_samples, r.max_bytes, r.max_concurrent), (2, 100, 1024, 1));
        let err = |extra: &str| resolve(&format!("{tok}{extra}"), Overrides::default()).expect_err(extra).to_string();
        assert!(err("[server]\nmetrics_auth = \"open\"\n").contains("server.metrics_auth"));
        assert!(err("[remote_read]\nmax_queries = 0\n").contains("remote_read.max_queries"));
        assert!(err("[remote_read]\nmax_bytes = 10\n").contains("remote_read.max_bytes"));
        assert!(err("[remote_read]\nmax_sampels = 10\n").contains("max_sampels"));
    }
}
