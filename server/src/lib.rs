//! `apron`: the server binary's library.
//!
//! ```text
//!  apron serve --config apron.toml            apron up [--http ADDR] [--data DIR]
//!   config: TOML + overrides → ServeConfig      token: random, this run only
//!          │                                    agent: apron-agent library, nvml or sim,
//!          ▼                                           ships over HTTP with that token
//!   Server::open: Store::open (WAL replay)              │
//!   Server::run(listener, shutdown)  ◄──────────────────┘  (same server, loopback only)
//!     app(): /healthz, /metrics + collector::http::router (ingest) + sql::router (POST /api/v1/sql)
//!            + report::router + insights::router (alerts, recommendations)
//!            + otlp_in::router (POST /v1/metrics) + prom_remote::router (Prometheus
//!              remote write and remote read: POST /api/v1/write, /api/v1/read)
//!     background: derive (gpu_samples_1m), ledger (cost), alerts (every 30 s),
//!                 recommend (the recommendations table), schedule (weekly report)
//!     shutdown: stop accepting → finish requests in flight → Store::persist_now
//! ```
//!
//! - [`cluster`]: `[cluster]` — a collector of one shard of a shared bucket (its status
//!   to the lake every heartbeat) or a query server over every shard
//!   ([`Server::open_query`]: no ingest, the lake as its tables, the shards' alerts).
//! - [`config`]: `apron serve`'s file, overrides and validation.
//! - [`up`]: the all-in-one `apron up`: server + in-process agent, `endpoints.json`.
//! - [`alerts`], [`recommend`], [`insights`]: live alerts and their receivers,
//!   recommendations with replays, and their HTTP routes.
//! - [`Server`]: a store and its HTTP routes; [`app`] is the one place where the routers
//!   of the server are put together.
//!
//! The library reads no environment variables; `main.rs` does (clap), and prints.

pub mod access;
pub mod alerts;
pub mod backfill;
pub mod ballista;
pub mod cluster;
pub mod config;
mod deliver;
pub mod derive;
pub mod import;
pub mod insights;
pub mod ledger;
pub mod otlp_in;
pub mod pg;
pub mod prom_remote;
pub mod recommend;
pub mod report;
pub mod schedule;
pub mod scrape;
pub mod sql;
mod sqlutil;
mod statefile;
pub mod telemetry;
pub mod ui;
pub mod up;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use apron_collector::http::{IngestOptions, IngestState, SetupError, json_error};
use apron_collector::{Store, StoreConfig, StoreError};
use apron_query::{QueryConfig, QueryEngine};
use axum::Router;
use axum::http::StatusCode;
use axum::response::Response;
use prometheus_client::registry::Registry;

pub use access::{Access, Role};

pub use config::{ConfigError, FileConfig, Overrides, ServeConfig};

/// How long requests in flight may take to finish after a shutdown signal before their
/// connections are dropped (an ingest request is bounded by one WAL fsync; this covers
/// a slow client still sending its body).
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot open the store: {0}")]
    Store(#[source] StoreError),
    #[error(transparent)]
    Setup(#[from] SetupError),
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
    #[error("the HTTP server failed: {0}")]
    Serve(std::io::Error),
    #[error(
        "persisting the memtable at shutdown failed: {0}; nothing is lost, the WAL holds the data and the next start replays it"
    )]
    Persist(#[source] StoreError),
    #[error("a background task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
    #[error(
        "apron up binds loopback addresses only (it has no authentication on its own endpoints); got {0}. Use apron serve for a deployment"
    )]
    NotLoopback(SocketAddr),
    #[error("the in-process agent: {0}")]
    Agent(String),
    #[error("cannot start the SQL engine: {0}")]
    Query(#[from] apron_query::QueryError),
    #[error("the cost ledger: {0}")]
    Cost(#[from] ledger::LedgerError),
    #[error("TLS: [server.tls]: {0}")]
    Tls(#[from] apron_http::tls::TlsError),
    #[error(transparent)]
    Scrape(#[from] scrape::ScrapeError),
    #[error("a query server reads a lake: set [storage.object_store]")]
    NoLake,
    #[error("the lake: {0}")]
    Lake(#[source] apron_collector::StorageError),
    #[error("[cluster]: {0}")]
    Cluster(#[from] cluster::ClusterError),
}

/// Every HTTP route of the server. Routers of later parts (SQL, reports, the UI) are
/// merged here, and only here — `.merge(sql::router(..))` before the fallbacks, which
/// apply to the routes present when they are set — so every route answers unknown paths
/// and methods in the contract's error shape.
pub fn app(ingest: IngestState, sql: Router) -> Router {
    app_with(ingest, sql, true, None)
}

/// [`app`]; without `accept_ingest` (a query server) the ingest route answers 403 and
/// points at the collectors. With `metrics_gate` (`[server] metrics_auth = "token"`),
/// `GET /metrics` needs a viewer's or admin's token of that [`Access`].
fn app_with(ingest: IngestState, sql: Router, accept_ingest: bool, metrics_gate: Option<Access>) -> Router {
    let health = Router::new()
        .route("/healthz", axum::routing::get(healthz))
        .with_state(ingest.clone())
        .merge(Router::new().route("/metrics", axum::routing::get(metrics)).with_state((ingest.clone(), metrics_gate)));
    let writes = if accept_ingest {
        apron_collector::http::router(ingest)
    } else {
        Router::new().route(apron_collector::http::INGEST_PATH, axum::routing::post(query_tier_ingest))
    };
    writes
        .merge(health)
        .merge(sql)
        .method_not_allowed_fallback(method_not_allowed)
        .fallback(not_found)
        .layer(axum::middleware::from_fn(telemetry::trace_request))
}

/// `GET /healthz`: the server answers, and how many rows wait in the memtable.
async fn healthz(axum::extract::State(ingest): axum::extract::State<IngestState>) -> Response {
    let store = ingest.store();
    let memtable_rows: usize = [apron_collector::Table::GpuSamples, apron_collector::Table::GpuProcesses]
        .iter()
        .map(|t| store.memtable_stats(*t).rows)
        .sum();
    axum::response::IntoResponse::into_response((
        StatusCode::OK,
        axum::Json(serde_json::json!({ "status": "ok", "memtable_rows": memtable_rows })),
    ))
}

/// `GET /metrics`: every family of the server (ingest, storage, cost — per team —,
/// alerts, …); behind a viewer's or admin's token when `[server] metrics_auth = "token"`.
async fn metrics(
    axum::extract::State((ingest, gate)): axum::extract::State<(IngestState, Option<Access>)>,
    headers: axum::http::HeaderMap,
) -> Response {
    if let Some(access) = &gate
        && let Err(answer) = access.metrics_access(&headers)
    {
        return *answer;
    }
    apron_http::metrics::respond(ingest.registry(), &headers)
}

async fn query_tier_ingest() -> Response {
    json_error(
        StatusCode::FORBIDDEN,
        "query_server",
        "this server answers queries over the lake ([cluster] role = \"query\") and ingests nothing: ship to your shard's collector",
    )
}

async fn not_found(uri: axum::http::Uri) -> Response {
    json_error(StatusCode::NOT_FOUND, "not_found", &format!("no route for {}", uri.path()))
}

async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    json_error(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        &format!("{method} is not allowed on {}", uri.path()),
    )
}

/// Aborts a background task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The store and the HTTP routes over it.
pub struct Server {
    store: Arc<Store>,
    ingest: IngestState,
    sql: Router,
    engine: Arc<QueryEngine>,
    rollup: derive::RollupConfig,
    ledger: Option<Arc<ledger::Ledger>>,
    cost_metrics: ledger::CostMetrics,
    reports: Router,
    access: Access,
    report: schedule::ReportConfig,
    schedule: Option<Arc<schedule::Schedule>>,
    alerts_table: Arc<apron_query::SnapshotTable>,
    recommendations_table: Arc<apron_query::SnapshotTable>,
    alert_metrics: alerts::AlertMetrics,
    alerts: Option<Arc<alerts::Alerts>>,
    recommender: Option<Arc<recommend::Recommender>>,
    insights: Router,
    pg: Option<(tokio::net::TcpListener, pg::PgAuth, Option<Arc<rustls::ServerConfig>>)>,
    pg_limits: pg::PgLimits,
    scrapers: Vec<scrape::Scraper>,
    http: config::HttpOptions,
    tls: Option<Arc<rustls::ServerConfig>>,
    role: ClusterRole,
}

/// What the server does in a cluster ([`cluster`]).
#[derive(Clone)]
enum ClusterRole {
    Single,
    Collector { shard: apron_common::ShardName, heartbeat: Duration, instance: String },
    Query { lake: Arc<apron_query::LakeSource>, alerts: Arc<cluster::FleetAlerts> },
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server").field("store", &self.store).finish()
    }
}

impl Server {
    /// Opens the store (finishing an interrupted persist and replaying the WAL, which
    /// blocks: call it from `spawn_blocking` or before the runtime) and builds the
    /// routes.
    pub fn open(
        store: StoreConfig,
        ingest: IngestOptions,
        query: QueryConfig,
        access: Access,
    ) -> Result<Server, ServerError> {
        Server::open_as(store, Some(ingest), query, access, None)
    }

    /// A query server of a cluster ([`cluster`]): SQL, the PostgreSQL port, reports,
    /// alerts and recommendations over every shard in `store.object_store`'s bucket;
    /// no ingest, nothing written to the lake. `store.data_dir` keeps what is this
    /// server's own (closed reports, stored recommendation hours).
    pub fn open_query(
        mut store: StoreConfig,
        query: QueryConfig,
        access: Access,
        lake: apron_query::LakeConfig,
    ) -> Result<Server, ServerError> {
        let object_store = store.object_store.take().ok_or(ServerError::NoLake)?;
        let open = || apron_collector::Remote::open(&object_store).map_err(ServerError::Lake);
        let lake = Arc::new(apron_query::LakeSource::new(open()?, open()?, lake));
        let mut server = Server::open_as(store, None, query, access, Some(lake.clone()))?;
        server.role = ClusterRole::Query { lake, alerts: Arc::new(cluster::FleetAlerts::default()) };
        server.rollup.enabled = false;
        server.insights = insights::router(server.alert_source(), None, server.access.clone());
        Ok(server)
    }

    /// A collector of a cluster: its store publishes under `shard` (set in the
    /// store's `object_store` config already, [`cluster::ClusterSection::resolve`]), and
    /// it writes its status to the lake every `heartbeat`. Fails when the data directory
    /// holds another shard or another collector serves this one
    /// ([`cluster::Heartbeat::claim`]; blocking: it reads the bucket).
    pub fn with_shard(mut self, shard: apron_common::ShardName, heartbeat: Duration) -> Result<Server, ServerError> {
        let instance = cluster::Heartbeat::claim(&self.store, &shard, heartbeat)?;
        self.role = ClusterRole::Collector { shard, heartbeat, instance };
        Ok(self)
    }

    fn open_as(
        store: StoreConfig,
        ingest: Option<IngestOptions>,
        query: QueryConfig,
        access: Access,
        lake: Option<Arc<apron_query::LakeSource>>,
    ) -> Result<Server, ServerError> {
        let store = Arc::new(Store::open(store).map_err(ServerError::Store)?);
        let r = store.open_report();
        if r.replayed_records > 0 || r.renames_completed > 0 || r.temp_files_removed > 0 {
            tracing::info!(
                replayed_records = r.replayed_records,
                replayed_rows = r.replayed_rows,
                renames_completed = r.renames_completed,
                temp_files_removed = r.temp_files_removed,
                "recovered the store"
            );
        }
        let cost_metrics = ledger::CostMetrics::default();
        let alert_metrics = alerts::AlertMetrics::default();
        let mut registry = Registry::default();
        registry.register_collector(Box::new(cost_metrics.clone()));
        registry.register_collector(Box::new(alert_metrics.clone()));
        let ingest = match ingest {
            Some(options) => IngestState::new(store.clone(), options, registry)?,
            None => IngestState::without_ingest(store.clone(), registry)?,
        };
        let mut engine = match &lake {
            // The shards' statuses carry the rollup's records.
            Some(lake) => QueryEngine::new(query, lake.clone()).map_err(ServerError::Query)?,
            None => {
                // The rollup's state file tells the engine which stored gpu_samples_1m
                // days are current (see derive).
                let state = store.data_dir().join(apron_query::rollup::STATE_FILE);
                QueryEngine::with_rollup_state(query, store.clone(), Some(state)).map_err(ServerError::Query)?
            }
        };
        // The evaluators' tables: empty until alerts / recommendations run.
        let alerts_table = apron_query::SnapshotTable::new(alerts::schema());
        let recommendations_table = apron_query::SnapshotTable::new(recommend::schema());
        engine.register_table("alerts", alerts_table.clone()).map_err(ServerError::Query)?;
        engine.register_table("recommendations", recommendations_table.clone()).map_err(ServerError::Query)?;
        let engine = Arc::new(engine);
        let sql = sql::router(engine.clone(), access.clone(), config::HttpOptions::default().max_sql_bytes);
        let report = schedule::ReportConfig::default();
        let reports = report::router(
            engine.clone(),
            None,
            store.data_dir().to_path_buf(),
            access.clone(),
            report.share_unallocated,
        );
        Ok(Server {
            store,
            ingest,
            sql,
            engine,
            rollup: derive::RollupConfig::default(),
            ledger: None,
            cost_metrics,
            reports,
            access: access.clone(),
            http: config::HttpOptions::default(),
            tls: None,
            report,
            schedule: None,
            alerts_table,
            recommendations_table,
            alert_metrics,
            alerts: None,
            recommender: None,
            insights: insights::router(insights::AlertSource::Off, None, access.clone()),
            pg: None,
            pg_limits: pg::PgLimits::default(),
            scrapers: Vec::new(),
            role: ClusterRole::Single,
        })
    }

    /// The lake of a query server.
    fn lake(&self) -> Option<&Arc<apron_query::LakeSource>> {
        match &self.role {
            ClusterRole::Query { lake, .. } => Some(lake),
            _ => None,
        }
    }

    fn alert_source(&self) -> insights::AlertSource {
        match (&self.role, &self.alerts) {
            (ClusterRole::Query { lake, alerts }, _) => insights::AlertSource::Fleet(alerts.clone(), lake.clone()),
            (_, Some(a)) => insights::AlertSource::Local(a.clone()),
            (_, None) => insights::AlertSource::Off,
        }
    }

    /// The `gpu_samples_1m` materializer's settings (default: on, every minute).
    pub fn with_rollup(mut self, mut rollup: derive::RollupConfig) -> Server {
        // A query server writes nothing: each collector materializes its shard.
        rollup.enabled &= self.lake().is_none();
        self.rollup = rollup;
        self
    }

    /// Turns the cost ledger on (when `cost.enabled`): loads the price book (an invalid
    /// one is an error, not a silent $0) and serves reports with it.
    pub fn with_cost(mut self, cost: ledger::CostConfig) -> Result<Server, ServerError> {
        if !cost.enabled {
            self.ledger = None;
            return Ok(self);
        }
        let l = ledger::Ledger::new(self.store.clone(), self.engine.clone(), cost).map_err(ServerError::Cost)?;
        self.ledger = Some(Arc::new(l));
        self.reports = self.reports_router();
        Ok(self)
    }

    /// Turns alerts on (when `alerts.enabled`; they need the ledger: call after
    /// [`Server::with_cost`]).
    pub fn with_alerts(mut self, config: alerts::AlertsConfig) -> Server {
        if self.lake().is_some() {
            // A query server evaluates nothing: it lists the shards' episodes.
            return self;
        }
        let changes = (config.enabled && config.incremental).then(|| self.store.subscribe_changes());
        self.alerts = match (&self.ledger, config.enabled) {
            (Some(l), true) => Some(Arc::new(alerts::Alerts::new(
                self.engine.clone(),
                l.clone(),
                config,
                self.store.data_dir(),
                self.alerts_table.clone(),
                self.alert_metrics.clone(),
                changes,
            ))),
            (None, true) => {
                tracing::warn!("alerts need the cost ledger ([cost] enabled): alerts are off");
                None
            }
            _ => None,
        };
        self.insights = insights::router(self.alert_source(), self.recommender.clone(), self.access.clone());
        self
    }

    /// Turns recommendations on (when `recommend.enabled`; call after [`Server::with_cost`]).
    pub fn with_recommend(mut self, settings: recommend::RecommendSettings) -> Server {
        self.recommender = match (&self.ledger, settings.enabled) {
            (Some(l), true) => Some(Arc::new(recommend::Recommender::new(
                self.engine.clone(),
                l.clone(),
                settings,
                self.recommendations_table.clone(),
            ))),
            (None, true) => {
                tracing::warn!("recommendations need the cost ledger ([cost] enabled): they are off");
                None
            }
            _ => None,
        };
        self.insights = insights::router(self.alert_source(), self.recommender.clone(), self.access.clone());
        self
    }

    /// Serves the PostgreSQL wire protocol on `listener` too (same engine, same checks),
    /// over TLS when `tls` is given.
    pub fn with_pg(
        mut self,
        listener: tokio::net::TcpListener,
        auth: pg::PgAuth,
        tls: Option<Arc<rustls::ServerConfig>>,
    ) -> Server {
        self.pg = Some((listener, auth, tls));
        self
    }

    /// The PostgreSQL port's connection limits (default: 256 connections, 10 s to
    /// authenticate). Its SQL text limit is HTTP's ([`Server::with_http`]).
    pub fn with_pg_limits(mut self, max_connections: usize, auth_timeout: Duration) -> Server {
        self.pg_limits.max_connections = max_connections;
        self.pg_limits.auth_timeout = auth_timeout;
        self
    }

    /// The rest of the PostgreSQL port's limits (`[pg]`: connections logging in, per
    /// user, idle and message timeouts, what a session may hold; default
    /// [`pg::PgSessionLimits::default`]).
    pub fn with_pg_session_limits(mut self, session: pg::PgSessionLimits) -> Server {
        self.pg_limits.session = session;
        self
    }

    /// The PostgreSQL port's counters (connections refused, authentication timeouts,
    /// oversized queries).
    pub fn pg_stats(&self) -> &Arc<pg::PgStats> {
        &self.pg_limits.stats
    }

    /// The HTTP listener's TLS, timeouts and limits (default: plain HTTP, 10 s to send
    /// the headers, 60 s the body (and no gap longer than 60 s in it), 4096
    /// connections, 1 MiB of SQL, on the PostgreSQL port too). The certificate and key
    /// are loaded here, so a bad one stops the start.
    pub fn with_http(mut self, http: config::HttpOptions) -> Result<Server, ServerError> {
        self.tls = match &http.tls {
            Some(t) => Some(t.server_config()?),
            None => None,
        };
        self.sql = sql::router(self.engine.clone(), self.access.clone(), http.max_sql_bytes);
        // One SQL text limit for both ways in.
        self.pg_limits.max_sql_bytes = http.max_sql_bytes;
        let teams = matches!(&self.access, Access::Tokens(c) if c.iter().any(|c| matches!(c.role, Role::Team(_))));
        if http.metrics_auth == config::MetricsAuth::None && teams {
            tracing::warn!(
                "GET /metrics needs no token ([server] metrics_auth = \"none\") and shows every team's costs: \
                 set metrics_auth = \"token\" (and give Prometheus a viewer token), or keep the port on a network only the scraper reaches"
            );
        }
        self.http = http;
        Ok(self)
    }

    /// Scrapes these dcgm-exporter endpoints as a source (`[[scrape]]`).
    pub fn with_scrape(mut self, targets: Vec<scrape::ScrapeTarget>) -> Result<Server, ServerError> {
        for t in targets {
            let s = scrape::Scraper::new(self.store.clone(), self.engine.clone(), t).map_err(ServerError::Scrape)?;
            self.scrapers.push(s);
        }
        Ok(self)
    }

    /// The alert evaluator, when on (tests drive `evaluate_at` / `deliver` directly).
    pub fn alerts(&self) -> Option<&Arc<alerts::Alerts>> {
        self.alerts.as_ref()
    }

    /// The alert families of `/metrics` (tests encode them directly).
    pub fn alert_metrics(&self) -> &alerts::AlertMetrics {
        &self.alert_metrics
    }

    /// The recommender, when on.
    pub fn recommender(&self) -> Option<&Arc<recommend::Recommender>> {
        self.recommender.as_ref()
    }

    fn reports_router(&self) -> Router {
        report::router(
            self.engine.clone(),
            self.ledger.clone(),
            self.store.data_dir().to_path_buf(),
            self.access.clone(),
            self.report.share_unallocated,
        )
    }

    /// The weekly report settings (`[report]`): reports are built with its
    /// `share_unallocated`, and when enabled [`Server::run`] runs the schedule. Call
    /// after [`Server::with_cost`]: the schedule prices with the ledger's price book.
    pub fn with_report(mut self, config: schedule::ReportConfig) -> Server {
        self.schedule = config.enabled.then(|| {
            let book = self.ledger.as_ref().and_then(|l| l.price_book().cloned());
            Arc::new(schedule::Schedule::new(
                self.engine.clone(),
                book,
                self.store.data_dir().to_path_buf(),
                config.clone(),
            ))
        });
        self.report = config;
        self.reports = self.reports_router();
        self
    }

    /// The weekly report schedule, when enabled ([`Server::with_report`]; tests call
    /// its `run_once` directly).
    pub fn schedule(&self) -> Option<&Arc<schedule::Schedule>> {
        self.schedule.as_ref()
    }

    /// The cost ledger, when turned on ([`Server::with_cost`]).
    /// Every HTTP route of this server, as `run` serves them (tests serve it without
    /// the background work).
    pub fn router(&self) -> Router {
        let view = match &self.role {
            ClusterRole::Single => cluster::ClusterView::Single,
            ClusterRole::Collector { shard, .. } => cluster::ClusterView::Collector(shard.clone()),
            ClusterRole::Query { lake, .. } => cluster::ClusterView::Query(lake.clone(), self.engine.clone()),
        };
        app_with(
            self.ingest.clone(),
            self.sql
                .clone()
                .merge(cluster::router(view, self.access.clone()))
                .merge(self.reports.clone())
                .merge(self.insights.clone())
                .merge(otlp_in::router(otlp_in::OtlpState::new(self.ingest.clone(), self.engine.clone())))
                .merge(prom_remote::router(
                    prom_remote::RemoteState::new(self.ingest.clone(), self.engine.clone(), self.access.clone())
                        .with_limits(self.http.remote_read),
                ))
                .merge(ui::router()),
            self.lake().is_none(),
            (self.http.metrics_auth == config::MetricsAuth::Token).then(|| self.access.clone()),
        )
    }

    pub fn ledger(&self) -> Option<&Arc<ledger::Ledger>> {
        self.ledger.as_ref()
    }

    /// A collector's status writer (none in the other roles).
    fn heartbeat(&self) -> Option<cluster::Heartbeat> {
        let ClusterRole::Collector { shard, heartbeat, instance } = &self.role else { return None };
        Some(cluster::Heartbeat {
            store: self.store.clone(),
            shard: shard.clone(),
            interval: *heartbeat,
            alerts: self.alerts.clone(),
            instance: instance.clone(),
        })
    }

    /// The materializer over this server's store and engine (run by [`Server::run`]
    /// when enabled; tests call its passes directly).
    pub fn materializer(&self) -> derive::Materializer {
        derive::Materializer::new(self.store.clone(), self.engine.clone(), &self.rollup)
    }

    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// The SQL engine the routes use.
    pub fn engine(&self) -> &Arc<QueryEngine> {
        &self.engine
    }

    /// Serves on `listener` until `shutdown` resolves, then stops accepting, lets the
    /// requests in flight finish (so every acknowledged batch was fsynced, and no request
    /// is cut between fsync and answer) and persists the memtable to Parquet.
    pub async fn run(
        mut self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServerError> {
        let addr = listener.local_addr().map_err(ServerError::Serve)?;
        let options = apron_http::serve::ServeOptions {
            tls: self.tls.clone(),
            header_read_timeout: self.http.header_read_timeout,
            body_read_timeout: Some(self.http.body_read_timeout),
            body_total_timeout: Some(self.http.body_total_timeout),
            max_connections: Some(self.http.max_connections),
            drain_timeout: DRAIN_TIMEOUT,
            ..Default::default()
        };
        tracing::info!(
            "serving {}://{addr} (POST /api/v1/ingest, POST /api/v1/sql, GET /metrics, GET /healthz)",
            options.scheme()
        );
        let materializer = self.rollup.enabled.then(|| {
            tracing::info!(interval = ?self.rollup.interval, "gpu_samples_1m materializer started");
            AbortOnDrop(tokio::spawn(Arc::new(self.materializer()).run(self.rollup.interval)))
        });
        let query_server = self.lake().is_some();
        let ledger = self.ledger.clone().filter(|_| !query_server).map(|l| {
            tracing::info!("cost ledger started");
            AbortOnDrop(tokio::spawn(l.run(self.cost_metrics.clone())))
        });
        let alerts = self.alerts.clone().map(|a| {
            tracing::info!(interval = ?a.config().interval, "alerts started");
            AbortOnDrop(tokio::spawn(a.run()))
        });
        let recommender = self.recommender.clone().map(|r| {
            tracing::info!(window = ?r.settings().window, "recommendations started");
            AbortOnDrop(tokio::spawn(r.run()))
        });
        let pg = self.pg.take().map(|(listener, auth, tls)| {
            if let Ok(a) = listener.local_addr() {
                tracing::info!(%a, ?auth, tls = tls.is_some(), "serving the PostgreSQL wire protocol");
            }
            AbortOnDrop(tokio::spawn(pg::serve_with(listener, self.engine.clone(), auth, tls, self.pg_limits.clone())))
        });
        let scrapers: Vec<AbortOnDrop> =
            std::mem::take(&mut self.scrapers).into_iter().map(|s| AbortOnDrop(tokio::spawn(s.run()))).collect();
        let cluster_task = match &self.role {
            ClusterRole::Single => None,
            ClusterRole::Collector { shard, heartbeat, .. } => {
                tracing::info!(%shard, ?heartbeat, "collector of shard {shard}: status to the lake every {heartbeat:?}");
                self.heartbeat().map(|h| AbortOnDrop(tokio::spawn(Arc::new(h).run())))
            }
            ClusterRole::Query { lake, alerts } => {
                tracing::info!(config = ?lake.config(), "query server over every shard of the lake");
                Some(AbortOnDrop(tokio::spawn(alerts.clone().run(
                    lake.clone(),
                    self.alerts_table.clone(),
                    self.alert_metrics.clone(),
                    lake.config().refresh,
                ))))
            }
        };
        let schedule = self.schedule.clone().map(|s| {
            tracing::info!(deliveries = ?s.config().deliveries(), "weekly report schedule started");
            AbortOnDrop(tokio::spawn(s.run()))
        });
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let router = self.router();
        // Slow clients are cut off by the header and body timeouts; the accept
        // loop drains requests in flight for up to DRAIN_TIMEOUT at shutdown.
        let mut serving = tokio::spawn(apron_http::serve::serve(listener, router, options, async move {
            let _ = stopped.await;
        }));

        let failed = tokio::select! {
            r = &mut serving => Some(r),
            () = shutdown => None,
        };
        let served = match failed {
            Some(r) => r.map_err(ServerError::Task).and_then(|r| r.map_err(ServerError::Serve)),
            None => {
                tracing::info!("shutting down: no new connections; finishing the requests in flight");
                let _ = stop.send(());
                match tokio::time::timeout(DRAIN_TIMEOUT + Duration::from_secs(2), &mut serving).await {
                    Ok(r) => r.map_err(ServerError::Task).and_then(|r| r.map_err(ServerError::Serve)),
                    Err(_) => {
                        // A request still running its WAL append completes on its
                        // blocking thread either way; only its answer is lost, and the
                        // client retries (a duplicate then).
                        tracing::warn!("connections still open after {DRAIN_TIMEOUT:?}; closing them");
                        serving.abort();
                        Ok(())
                    }
                }
            }
        };

        // A pass in flight stops here; a partition it was writing completes or is not
        // recorded (then re-rolled at the next start).
        drop(materializer);
        drop(ledger);
        drop(schedule);
        drop(alerts);
        drop(recommender);
        drop(pg);
        drop(scrapers);
        drop(cluster_task);
        let store = self.store.clone();
        let persisted = tokio::task::spawn_blocking(move || store.persist_now())
            .await
            .map_err(ServerError::Task)?
            .map_err(ServerError::Persist)?;
        tracing::info!(rows = persisted.rows, files = persisted.files.len(), "persisted the memtable to Parquet");
        if let Some(beat) = self.heartbeat() {
            // The last status says the memtable is empty and what the rollup read.
            match tokio::task::spawn_blocking(move || beat.publish_once()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "the last shard status"),
                Err(e) => tracing::warn!(error = %e, "the last shard status"),
            }
        }
        served
    }
}
