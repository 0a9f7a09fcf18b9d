//! [`QueryEngine`]: the session, the limits and the execution of one SQL query.
//!
//! ```text
//!  execute(sql)
//!    slot: one of max_concurrent within the principal's share, never the last
//!          free one while it holds one (crate::slots), wait ≤ queue_timeout ─ else Busy (503)
//!          (the server's own passes: one of reserved_internal, waiting their turn,
//!           planned for pass_partitions when set)
//!    └─ timeout(query.timeout) ──────────────────────────────── else Timeout (504)
//!         state = base session + a fresh memory pool (memory_limit_bytes, no spill)
//!         parse → check_shape → check_statement → plan → check_plan
//!                                              ── TooComplex / ReadOnly / Syntax / Plan (400)
//!         [query.ballista] set, only stored lake tables, ≥ min_scan_bytes?
//!           yes: the same plan on the Ballista cluster (crate::distributed); a failure
//!                runs it here (fallback_local) ─────────────── else Cluster (503)
//!         DataFrame::new(state, plan) → physical plan → stream   (never SessionContext::sql,
//!         collect ≤ max_result_rows ─────────────────────────── which would run DDL)
//!           a cluster job left unread is cancelled             else TooManyRows (413)
//! ```
//!
//! Queries run on the engine's own multi-threaded tokio runtime (`apron-query-N`
//! threads), not the caller's. Why: some DataFusion operators (nested-loop and cross
//! joins emitting from buffered data) compute for seconds inside one poll without
//! yielding; on the caller's runtime they can occupy every worker, so neither the timeout
//! timer nor the HTTP server would run. Here the caller's timer always fires on time and
//! the query task is aborted; an operator stuck inside a poll stops at its next yield,
//! and the query keeps its slot until it really stops (so runaway queries cannot pile up
//! past `max_concurrent`). Those threads have large stacks
//! ([`crate::guard::QUERY_THREAD_STACK_BYTES`]) so that any statement within the shape
//! limits plans and runs; the shape check refuses the rest.
//!
//! A scoped principal's errors that could describe data are made opaque
//! ([`QueryError::opaque`]): it gets the kind of failure and an error id, the log gets the
//! full text under that id.

use std::num::NonZeroUsize;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use std::collections::HashMap;

use apron_common::TeamName;
use datafusion::catalog::{
    CatalogProvider, MemoryCatalogProvider, MemoryCatalogProviderList, MemorySchemaProvider, TableProvider,
};
use datafusion::dataframe::DataFrame;
use datafusion::execution::SessionStateBuilder;
use datafusion::execution::context::{SessionContext, SessionState};
use datafusion::execution::disk_manager::{DiskManagerBuilder, DiskManagerMode};
use datafusion::execution::memory_pool::{GreedyMemoryPool, TrackConsumersPool};
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::physical_plan::execute_stream;
use datafusion::prelude::SessionConfig;
use futures::StreamExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::QueryConfig;
use crate::distributed::{self, ApronCodec, BallistaConfig, DistributedStats};
use crate::error::QueryError;
use crate::guard;
use crate::pgcompat;
use crate::provider::ApronTable;
use crate::readonly;
use crate::render::QueryResult;
use crate::rollup::{self, RollupTable};
use crate::scope::{self, Scope};
use crate::slots::{Refusal, Slot, Slots};
use crate::source::TableSource;
use crate::tables::TABLES;
use datafusion::arrow::datatypes::{DataType, SchemaRef};
use datafusion::common::ParamValues;
use datafusion::logical_expr::LogicalPlan;
use datafusion::sql::parser::Statement as DfStatement;
use datafusion_pg_catalog::pg_catalog::PgCatalogStaticTables;
use datafusion_pg_catalog::sql::PostgresCompatibilityParser;

/// A read-only SQL engine over a [`TableSource`]. Share it with `Arc`; queries run
/// concurrently up to `max_concurrent`.
pub struct QueryEngine {
    inner: Arc<Inner>,
    /// Clients' slots (`max_concurrent`), shared fairly between principals.
    slots: Slots,
    /// Slots only the server's own passes use (`reserved_internal`), so a client cannot
    /// starve the ledger, rollups, alerts or recommendations.
    internal_slots: Arc<Semaphore>,
    /// Renderings in progress ([`QueryEngine::render`]): as many as `max_concurrent`.
    renders: Arc<Semaphore>,
    tables: Vec<&'static str>,
    runtime: ExecRuntime,
}

struct Inner {
    config: QueryConfig,
    /// The session every query starts from: config, functions and the catalog with the
    /// registered tables (shared, never changed after `new`).
    base: SessionState,
    /// Every registered table's real provider, for building scoped sessions.
    providers: std::sync::Mutex<Vec<(&'static str, Arc<dyn TableProvider>)>>,
    /// One session per team seen so far: `base` with a catalog of scoped tables
    /// ([`crate::scope`]) in place of the tables.
    team_sessions: std::sync::Mutex<HashMap<TeamName, SessionState>>,
    /// PostgreSQL clients' SQL rewrites ([`Request::pg_client`]).
    pg_parser: PostgresCompatibilityParser,
    /// `pg_catalog`'s fixed tables (types, functions, …), shared by every session.
    pg_tables: Arc<PgCatalogStaticTables>,
    /// Where the tables' data comes from (asked which shards are stale).
    source: Arc<dyn TableSource>,
    /// `[query.ballista]` and the codec plans are shipped with.
    cluster: Option<(BallistaConfig, Arc<ApronCodec>)>,
    cluster_stats: DistributedStats,
}

/// A held query slot: a client's or one of the server's reserved ones.
#[derive(Debug)]
enum Permit {
    Client(#[allow(dead_code, reason = "held for its drop")] Slot),
    Internal(#[allow(dead_code, reason = "held for its drop")] OwnedSemaphorePermit),
}

/// The query runtime; shut down without blocking, since the engine may be dropped
/// inside an async context (dropping a runtime there would panic).
struct ExecRuntime(Option<tokio::runtime::Runtime>);

impl Drop for ExecRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

impl std::fmt::Debug for QueryEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueryEngine").field("config", &self.inner.config).field("tables", &self.tables).finish()
    }
}

impl QueryEngine {
    /// Builds the session and registers every table of [`TABLES`] that `source` holds.
    pub fn new(config: QueryConfig, source: Arc<dyn TableSource>) -> Result<QueryEngine, QueryError> {
        QueryEngine::with_rollup_state(config, source, None)
    }

    /// [`QueryEngine::new`], with the materializer's record of what each stored
    /// `gpu_samples_1m` day read (`<data_dir>/derived/rollup.json`, see
    /// [`crate::rollup`]): stored days that raw data has changed since are then computed
    /// live instead. Without it, stored days are trusted.
    pub fn with_rollup_state(
        config: QueryConfig,
        source: Arc<dyn TableSource>,
        rollup_state: Option<std::path::PathBuf>,
    ) -> Result<QueryEngine, QueryError> {
        let df_err = |e| QueryError::from_datafusion(e, config.memory_limit_bytes);
        let session = session_config(&config);
        let runtime = RuntimeEnvBuilder::new()
            .with_disk_manager_builder(DiskManagerBuilder::default().with_mode(DiskManagerMode::Disabled))
            .build_arc()
            .map_err(df_err)?;
        let mut state = SessionStateBuilder::new()
            .with_config(session)
            .with_runtime_env(runtime)
            .with_default_features()
            // No `CREATE EXTERNAL TABLE` handlers, even if a plan got past the checks.
            .with_table_factories(Default::default())
            // Row-multiplying joins yield, so a cancelled query really stops.
            .with_physical_optimizer_rule(Arc::new(guard::YieldInJoins))
            .build();
        register_functions(&mut state, &config).map_err(df_err)?;
        let ctx = SessionContext::new_with_state(state);
        // `pg_catalog` (tables and functions) for PostgreSQL clients: what psql's `\d`,
        // JDBC's DatabaseMetaData and Grafana's pickers ask on connect. Metadata only
        // (row counts are not estimated), the same for every principal.
        let default_catalog = ctx.state().config_options().catalog.default_catalog.clone();
        let pg_tables = pgcompat::setup(&ctx, &default_catalog).map_err(df_err)?;
        let mut tables = Vec::new();
        let mut providers: Vec<(&'static str, Arc<dyn TableProvider>)> = Vec::new();
        for def in TABLES {
            let Some(table) = def.stored else { continue };
            let Some(schema) = source.schema(def.name) else { continue };
            let provider: Arc<dyn TableProvider> = if def.name == rollup::NAME {
                // Stored minutes where current, the rest live from gpu_samples.
                let Some(t) = RollupTable::new(source.clone(), rollup_state.clone()).map_err(df_err)? else {
                    continue;
                };
                Arc::new(t)
            } else if table == apron_collector::Table::GpuCostHourly && source.merges_shards() {
                Arc::new(crate::lake::MergedCostTable::new(source.clone(), schema).map_err(df_err)?)
            } else {
                Arc::new(ApronTable::new(table, schema, source.clone()))
            };
            ctx.register_table(def.name, provider.clone()).map_err(df_err)?;
            providers.push((def.name, provider));
            tables.push(def.name);
        }
        let threads = match config.target_partitions {
            0 => std::thread::available_parallelism().map_or(1, NonZeroUsize::get),
            n => n,
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_stack_size(guard::QUERY_THREAD_STACK_BYTES)
            .thread_name_fn(|| {
                static N: AtomicUsize = AtomicUsize::new(0);
                format!("apron-query-{}", N.fetch_add(1, Ordering::Relaxed))
            })
            .enable_all()
            .build()
            .map_err(|e| QueryError::Internal { detail: format!("starting the query runtime: {e}") })?;
        let cluster = match &config.ballista {
            Some(b) => {
                b.endpoint().map_err(|detail| QueryError::Cluster { detail: format!("query.ballista: {detail}") })?;
                Some((b.clone(), Arc::new(ApronCodec::new(None))))
            }
            None => None,
        };
        let slots = Slots::new(&config);
        let renders = Arc::new(Semaphore::new(config.max_concurrent.max(1)));
        let internal_slots = Arc::new(Semaphore::new(config.reserved_internal.max(1)));
        Ok(QueryEngine {
            inner: Arc::new(Inner {
                base: ctx.state(),
                config,
                providers: std::sync::Mutex::new(providers),
                team_sessions: Default::default(),
                pg_parser: PostgresCompatibilityParser::new(),
                pg_tables,
                source,
                cluster,
                cluster_stats: Default::default(),
            }),
            slots,
            internal_slots,
            renders,
            tables,
            runtime: ExecRuntime(Some(runtime)),
        })
    }

    /// Registers a table the server produces itself (`alerts`, `recommendations`: see
    /// [`crate::SnapshotTable`]) under the same read-only checks and limits. Call it before
    /// sharing the engine.
    pub fn register_table(
        &mut self,
        name: &'static str,
        provider: Arc<dyn datafusion::catalog::TableProvider>,
    ) -> Result<(), QueryError> {
        // The catalog is shared by every state cloned from `base`, so registering through
        // a context over it is visible to every later query.
        let ctx = SessionContext::new_with_state(self.inner.base.clone());
        ctx.register_table(name, provider.clone())
            .map_err(|e| QueryError::from_datafusion(e, self.inner.config.memory_limit_bytes))?;
        self.inner.providers.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push((name, provider));
        self.inner.team_sessions.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clear();
        self.tables.push(name);
        Ok(())
    }

    pub fn config(&self) -> &QueryConfig {
        &self.inner.config
    }

    /// The shards of a cluster's lake whose collectors are not current (empty for a
    /// single store); read off the async threads, since it may ask the bucket.
    pub async fn stale_shards(&self) -> Vec<String> {
        // Asked on every SQL request and pg query: one server has no shards, and no
        // blocking task to spend on saying so.
        if !self.inner.source.merges_shards() {
            return Vec::new();
        }
        let source = self.inner.source.clone();
        tokio::task::spawn_blocking(move || source.stale_shards()).await.unwrap_or_default()
    }

    /// Queries the Ballista cluster answered and failed so far (`None` without
    /// `[query.ballista]`).
    pub fn cluster_stats(&self) -> Option<(u64, u64)> {
        use std::sync::atomic::Ordering::Relaxed;
        let s = &self.inner.cluster_stats;
        self.inner.cluster.as_ref().map(|_| (s.answered.load(Relaxed), s.failed.load(Relaxed)))
    }

    /// Queries holding a slot now (for a gauge; and for tests, to see a query started).
    pub fn running(&self) -> usize {
        self.inner.config.max_concurrent.max(1).saturating_sub(self.slots.free())
    }

    /// The server's own passes' queries holding one of their reserved slots now.
    pub fn running_passes(&self) -> usize {
        self.inner.config.reserved_internal.max(1).saturating_sub(self.internal_slots.available_permits())
    }

    /// The registered table names.
    pub fn tables(&self) -> &[&'static str] {
        &self.tables
    }

    /// Runs one SQL statement (a query) under the configured limits. Call it from any
    /// tokio runtime; the work runs on the engine's own.
    pub async fn execute(&self, sql: &str) -> Result<QueryResult, QueryError> {
        self.execute_as(sql, &Scope::All).await
    }

    /// [`QueryEngine::execute`] for a principal that may only read `scope`'s rows.
    pub async fn execute_as(&self, sql: &str, scope: &Scope) -> Result<QueryResult, QueryError> {
        self.execute_request_as(Request::sql(sql), scope).await
    }

    /// A client's [`Request`] (the PostgreSQL port's: its dialect, bound parameters)
    /// over `scope`'s rows, under the same checks and limits as [`QueryEngine::execute_as`].
    pub async fn execute_request_as(&self, request: Request, scope: &Scope) -> Result<QueryResult, QueryError> {
        self.execute_capped(request, Some(self.inner.config.max_result_rows), scope, Caller::Client).await
    }

    /// What `request` would answer, without running it: its result schema and its
    /// parameters' types (the extended protocol's Parse and Describe). It is parsed,
    /// checked and planned exactly as [`QueryEngine::execute_request_as`] would, over
    /// `scope`'s tables, on a client slot and under the query timeout.
    pub async fn describe_as(&self, request: Request, scope: &Scope) -> Result<Described, QueryError> {
        let task_scope = scope.clone();
        self.on_runtime(scope, Caller::Client, move |inner| async move {
            let state = inner.query_state(&task_scope)?;
            let plan = inner.plan(&state, &request).await?;
            let params = plan.get_parameter_types().map_err(|e| inner.df_err(e))?;
            let mut params: Vec<(usize, Option<DataType>)> = params
                .into_iter()
                .filter_map(|(id, t)| Some((id.strip_prefix('$')?.parse::<usize>().ok()?, t)))
                .collect();
            params.sort_by_key(|(n, _)| *n);
            // `$1 … $n`: a gap (`$1`, `$3`) still takes n values, the missing untyped.
            let n = params.last().map_or(0, |(n, _)| *n);
            let mut types = vec![None; n];
            for (i, t) in params {
                if let Some(slot) = i.checked_sub(1).and_then(|i| types.get_mut(i)) {
                    *slot = t;
                }
            }
            Ok(Described { schema: Arc::new(plan.schema().as_arrow().clone()), params: types })
        })
        .await
    }

    /// The `gpu_samples_1m` rows of `minutes` for the GPUs of `slice`, ordered by
    /// (`gpu_uuid`, `time`), computed from `gpu_samples` alone (never from stored rollup
    /// rows), in the storage types (extremes as decimals/integers): what the materializer
    /// stores. Runs under the engine's limits except the result row cap.
    pub async fn rollup_slice(
        &self,
        minutes: rollup::Minutes,
        slice: rollup::GpuSlice<'_>,
    ) -> Result<QueryResult, QueryError> {
        self.execute_capped(Request::sql(&rollup::slice_sql(minutes, slice)), None, &Scope::All, Caller::Server).await
    }

    /// Runs a query of the server's own (the cost ledger, the weekly report) under the
    /// engine's read-only checks, timeout and memory limit but without the result-row
    /// cap, which is there for clients.
    /// It runs on the slots reserved for the server's own work.
    pub async fn execute_internal(&self, sql: &str) -> Result<QueryResult, QueryError> {
        self.execute_capped(Request::sql(sql), None, &Scope::All, Caller::Server).await
    }

    /// [`QueryEngine::execute_internal`] over `scope`'s rows only, for a client's
    /// request (a weekly report): no result-row cap, but on the client's slots and share.
    pub async fn execute_internal_as(&self, sql: &str, scope: &Scope) -> Result<QueryResult, QueryError> {
        self.execute_capped(Request::sql(sql), None, scope, Caller::Client).await
    }

    /// Renders a client's `result` in `format` (JSON with `members` after its rows) on a
    /// blocking thread. A rendering is held whole to be sent and is several times its
    /// Arrow batches, so it is bounded like the query: at most `max_concurrent` at once
    /// (waiting up to `queue_timeout`, else [`QueryError::Busy`]) and never past
    /// `max_result_bytes` of output ([`QueryError::ResultTooLarge`]). A server's worst
    /// case for clients is therefore `max_concurrent × (memory_limit_bytes + 2 ×
    /// max_result_bytes)`.
    pub async fn render(
        &self,
        result: QueryResult,
        format: crate::Format,
        members: Vec<(&'static str, serde_json::Value)>,
    ) -> Result<Vec<u8>, QueryError> {
        let config = &self.inner.config;
        let waiting = Instant::now();
        let permit = match tokio::time::timeout(config.queue_timeout, self.renders.clone().acquire_owned()).await {
            Ok(Ok(p)) => p,
            Ok(Err(_)) => return Err(QueryError::Internal { detail: "the render slots were closed".into() }),
            Err(_) => {
                let max_concurrent = config.max_concurrent.max(1);
                return Err(QueryError::Busy { max_concurrent, waited: waiting.elapsed(), share: false });
            }
        };
        let max_bytes = match config.max_result_bytes {
            0 => u64::MAX,
            n => n,
        };
        let rendered = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            result.render_limited(format, &members, max_bytes)
        })
        .await;
        match rendered {
            Ok(Ok(bytes)) => Ok(bytes),
            Ok(Err(crate::render::RenderError::TooLarge { max_bytes })) => {
                Err(QueryError::ResultTooLarge { max_bytes })
            }
            Ok(Err(e)) => Err(QueryError::Internal { detail: e.to_string() }),
            Err(e) => Err(QueryError::Internal { detail: format!("the render task failed: {e}") }),
        }
    }

    /// A slot for one query: a client takes one of the clients' slots under the fair
    /// share rules ([`crate::slots`]); the server's passes take a reserved one.
    async fn acquire(&self, scope: &Scope, caller: Caller) -> Result<Permit, QueryError> {
        let config = &self.inner.config;
        let waiting = Instant::now();
        if caller == Caller::Server {
            // The server's passes wait their turn, never Busy and with no deadline of
            // their own: each query holding a slot ends within `timeout`, and a pass
            // that gave up behind a long one would only come back to the same queue.
            return match self.internal_slots.clone().acquire_owned().await {
                Ok(p) => Ok(Permit::Internal(p)),
                Err(_) => Err(QueryError::Internal { detail: "the query slots were closed".into() }),
            };
        }
        match self.slots.acquire(scope, config.queue_timeout).await {
            Ok(slot) => Ok(Permit::Client(slot)),
            Err(Refusal::Share { share }) => {
                Err(QueryError::Busy { max_concurrent: share, waited: waiting.elapsed(), share: true })
            }
            Err(Refusal::Full { max_concurrent }) => {
                Err(QueryError::Busy { max_concurrent, waited: waiting.elapsed(), share: false })
            }
        }
    }

    async fn execute_capped(
        &self,
        request: Request,
        max_rows: Option<usize>,
        scope: &Scope,
        caller: Caller,
    ) -> Result<QueryResult, QueryError> {
        let task_scope = scope.clone();
        let partitions = match (caller, self.inner.config.pass_partitions) {
            (Caller::Server, n) if n > 0 => Some(n),
            _ => None,
        };
        self.on_runtime(scope, caller, move |inner| async move {
            match inner.run(&request, max_rows, &task_scope, partitions).await {
                // A file was replaced under the query (it planned before a compaction or
                // a derived partition's rewrite, and read after the old file's grace):
                // planned again, it reads the replacement. Read-only, so safe to repeat.
                Err(e) if e.is_vanished_file() => {
                    tracing::debug!("a data file was replaced under a query; running it again");
                    inner.run(&request, max_rows, &task_scope, partitions).await
                }
                other => other,
            }
        })
        .await
    }

    /// Runs `work` on the query runtime on one of `caller`'s slots, under the query
    /// timeout; a scoped principal's errors that could describe data become opaque.
    async fn on_runtime<T, F, Fut>(&self, scope: &Scope, caller: Caller, work: F) -> Result<T, QueryError>
    where
        T: Send + 'static,
        F: FnOnce(Arc<Inner>) -> Fut,
        Fut: std::future::Future<Output = Result<T, QueryError>> + Send + 'static,
    {
        let config = &self.inner.config;
        let permit = self.acquire(scope, caller).await?;
        let Some(runtime) = self.runtime.0.as_ref() else {
            return Err(QueryError::Internal { detail: "the query runtime is shut down".into() });
        };
        let started = Instant::now();
        let work = work(self.inner.clone());
        let mut task = runtime.spawn(async move {
            // The slot is held until the query has really stopped.
            let _permit = permit;
            work.await
        });
        // Also cancels the query when the caller goes away (client disconnected).
        let _cancel = AbortOnDrop(task.abort_handle());
        let result = match tokio::time::timeout(config.timeout, &mut task).await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => Err(QueryError::Internal { detail: format!("the query task failed: {e}") }),
            Err(_) => Err(QueryError::Timeout { timeout: config.timeout }),
        };
        match result {
            Ok(r) => {
                tracing::debug!(elapsed = ?started.elapsed(), "query");
                Ok(r)
            }
            Err(e) if scope.is_scoped() && e.describes_data() => {
                let id = crate::error::error_id();
                tracing::warn!(error_id = %id, error = %e, detail = %e.detail(), "a scoped query failed");
                Err(e.opaque(&id))
            }
            Err(e) => {
                tracing::debug!(error = %e, elapsed = ?started.elapsed(), "query refused or failed");
                Err(e)
            }
        }
    }
}

/// One query as a client sent it.
#[derive(Clone, Debug, Default)]
pub struct Request {
    pub sql: String,
    /// Read as a PostgreSQL client's SQL (the pg port): datafusion-pg-catalog's
    /// compatibility rewrites (catalog operators, `::regclass` casts, psql's and
    /// Grafana's catalog queries) run on the parsed statement before the checks.
    pub pg_client: bool,
    /// The values of `$1`, `$2`, … (the extended protocol's Bind).
    pub params: Option<ParamValues>,
}

impl Request {
    pub fn sql(sql: &str) -> Request {
        Request { sql: sql.to_owned(), ..Request::default() }
    }
}

/// What a query would answer ([`QueryEngine::describe_as`]).
#[derive(Clone, Debug)]
pub struct Described {
    pub schema: SchemaRef,
    /// The type of each of `$1 … $n` where the plan tells it.
    pub params: Vec<Option<DataType>>,
}

/// Who runs a query: a client (on its principal's share of the clients' slots) or the
/// server's own passes (on the reserved slots).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Caller {
    Client,
    Server,
}

struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        // A no-op once the task has finished.
        self.0.abort();
    }
}

impl Inner {
    /// The session `scope` starts from: `base`, or the team's scoped session (built on
    /// first use and kept).
    fn scope_base(&self, scope: &Scope) -> Result<SessionState, QueryError> {
        let Scope::Team(team) = scope else { return Ok(self.base.clone()) };
        let mut sessions = self.team_sessions.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(s) = sessions.get(team) {
            return Ok(s.clone());
        }
        let df_err = |e| QueryError::from_datafusion(e, self.config.memory_limit_bytes);
        let options = self.base.config_options();
        let schema = Arc::new(MemorySchemaProvider::new());
        let providers = self.providers.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        let allocations = providers.iter().find(|(n, _)| *n == "allocations").map(|(_, p)| p.clone());
        for (name, provider) in providers {
            if let Some(p) = scope::scoped_provider(name, provider, allocations.as_ref(), team).map_err(df_err)? {
                datafusion::catalog::SchemaProvider::register_table(schema.as_ref(), name.to_owned(), p)
                    .map_err(df_err)?;
            }
        }
        let catalog = Arc::new(MemoryCatalogProvider::new());
        catalog.register_schema(&options.catalog.default_schema, schema).map_err(df_err)?;
        let catalogs = Arc::new(MemoryCatalogProviderList::new());
        datafusion::catalog::CatalogProviderList::register_catalog(
            catalogs.as_ref(),
            options.catalog.default_catalog.clone(),
            catalog.clone(),
        );
        // The team's own pg_catalog: it describes this catalog (the same tables and
        // columns as everyone's; rows are never counted).
        let listed: Arc<dyn datafusion::catalog::CatalogProviderList> = catalogs.clone();
        pgcompat::register_for(&listed, catalog.as_ref(), self.pg_tables.clone()).map_err(df_err)?;
        let state = SessionStateBuilder::new_from_existing(self.base.clone()).with_catalog_list(catalogs).build();
        sessions.insert(team.clone(), state.clone());
        Ok(state)
    }

    /// An unknown table's error with the closest table name and the list of tables (the
    /// contract's names, the same for every principal).
    fn table_hint(&self, e: QueryError) -> QueryError {
        let QueryError::Plan { detail } = e else { return e };
        let unknown = detail
            .split_once("table '")
            .and_then(|(_, rest)| rest.split_once("' not found"))
            .map(|(name, _)| name.rsplit('.').next().unwrap_or(name).to_owned());
        let Some(unknown) = unknown else { return QueryError::Plan { detail } };
        let mut tables: Vec<&'static str> =
            self.providers.lock().unwrap_or_else(std::sync::PoisonError::into_inner).iter().map(|(n, _)| *n).collect();
        tables.sort_unstable();
        let lower = unknown.to_ascii_lowercase();
        let closest = tables
            .iter()
            .map(|t| (datafusion::common::utils::datafusion_strsim::levenshtein(&lower, t), *t))
            .min()
            .filter(|(d, t)| *d <= (t.len() / 3).max(2));
        let hint = match closest {
            Some((_, t)) => format!("did you mean {t}? The tables are: {}", tables.join(", ")),
            None => format!("the tables are: {}", tables.join(", ")),
        };
        // The hint is the detail; the engine's line stays the message.
        QueryError::Plan { detail: format!("{}\n{hint}", detail.lines().next().unwrap_or_default()) }
    }

    /// A session for one query: the scope's session with its own memory pool.
    fn query_state(&self, scope: &Scope) -> Result<SessionState, QueryError> {
        let limit = usize::try_from(self.config.memory_limit_bytes).unwrap_or(usize::MAX);
        // Greedy: the query may use up to the limit however its operators share it.
        // Tracked: the error names the operators holding the most memory.
        let pool =
            TrackConsumersPool::new(GreedyMemoryPool::new(limit), NonZeroUsize::new(3).unwrap_or(NonZeroUsize::MIN));
        let runtime = RuntimeEnvBuilder::from_runtime_env(self.base.runtime_env())
            .with_memory_pool(Arc::new(pool))
            .build_arc()
            .map_err(|e| QueryError::from_datafusion(e, self.config.memory_limit_bytes))?;
        let mut state =
            SessionStateBuilder::new_from_existing(self.scope_base(scope)?).with_runtime_env(runtime).build();
        let budget = crate::funcs::constant_budget(self.config.max_string_result_bytes);
        crate::funcs::Budget::install(state.config_mut().options_mut(), budget);
        // `now()` is the query's start, not the engine's (the base state was built once).
        let options = state.config_options().clone();
        state.execution_props_mut().mark_start_execution(options);
        Ok(state)
    }

    fn df_err(&self, e: datafusion::error::DataFusionError) -> QueryError {
        QueryError::from_datafusion(e, self.config.memory_limit_bytes)
    }

    /// Parses, checks and plans `request` in `state`: the shape limits, then the
    /// read-only checks on the statement and on the plan.
    async fn plan(&self, state: &SessionState, request: &Request) -> Result<LogicalPlan, QueryError> {
        let statement = if request.pg_client {
            let mut statements = self
                .pg_parser
                .parse(&pgcompat::rewrite_client_sql(&request.sql))
                .map_err(|e| QueryError::Syntax { detail: crate::error::engine_text(&e.to_string()) })?;
            if statements.len() != 1 {
                return Err(QueryError::Syntax {
                    detail: format!("expected one statement, found {}", statements.len()),
                });
            }
            let mut statement = statements.remove(0);
            pgcompat::rewrite_catalog_statement(&mut statement);
            DfStatement::Statement(Box::new(statement))
        } else {
            let dialect = state.config().options().sql_parser.dialect;
            state.sql_to_statement(&request.sql, &dialect).map_err(|e| self.df_err(e))?
        };
        guard::check_shape(&statement, self.config.max_expr_depth, self.config.max_expr_nodes)
            .map_err(|v| QueryError::TooComplex { what: v.what, setting: v.setting })?;
        readonly::check_statement(&statement)?;
        let plan = match state.statement_to_plan(statement).await {
            Ok(plan) => plan,
            Err(e) => return Err(self.table_hint(self.df_err(e))),
        };
        readonly::check_plan(&plan)?;
        Ok(plan)
    }

    /// `partitions`: plan for that many partitions instead of `target_partitions`.
    async fn run(
        &self,
        request: &Request,
        max_rows: Option<usize>,
        scope: &Scope,
        partitions: Option<usize>,
    ) -> Result<QueryResult, QueryError> {
        let df_err = |e| self.df_err(e);
        let mut state = self.query_state(scope)?;
        if let Some(n) = partitions {
            state.config_mut().options_mut().execution.target_partitions = n;
        }
        let mut plan = self.plan(&state, request).await?;
        if let Some(params) = &request.params {
            plan = plan.with_param_values(params.clone()).map_err(df_err)?;
        }
        if let Some((cluster, codec)) = &self.cluster {
            match distributed::distributable(&plan) {
                Ok(bytes) if bytes >= cluster.min_scan_bytes => {
                    let ran = match distributed::cluster_state(state.clone(), cluster, codec) {
                        Ok(remote) => self
                            .collect(remote, plan.clone(), max_rows, cluster.endpoint().ok())
                            .await
                            .map(|r| QueryResult { distributed: true, ..r }),
                        Err(e) => Err(e),
                    };
                    use std::sync::atomic::Ordering::Relaxed;
                    match ran {
                        Ok(result) => {
                            self.cluster_stats.answered.fetch_add(1, Relaxed);
                            return Ok(result);
                        }
                        // The result's own limits: the same here.
                        Err(e @ (QueryError::TooManyRows { .. } | QueryError::ResultTooLarge { .. })) => return Err(e),
                        Err(e) => {
                            self.cluster_stats.failed.fetch_add(1, Relaxed);
                            let detail = e.detail();
                            if !cluster.fallback_local {
                                return Err(QueryError::Cluster { detail });
                            }
                            tracing::warn!(%detail, "the Ballista cluster failed a query; running it here");
                        }
                    }
                }
                Ok(bytes) => tracing::debug!(bytes, "a small scan; runs here"),
                Err(why) => tracing::debug!(why, "runs here"),
            }
        }
        self.collect(state, plan, max_rows, None).await
    }

    /// Runs `plan` in `state` (here, or on the cluster at `scheduler` for a Ballista
    /// state) and collects the whole result under the result caps.
    async fn collect(
        &self,
        state: SessionState,
        plan: LogicalPlan,
        max_rows: Option<usize>,
        scheduler: Option<String>,
    ) -> Result<QueryResult, QueryError> {
        let df_err = |e| self.df_err(e);
        let explain = matches!(plan, LogicalPlan::Explain(_) | LogicalPlan::Analyze(_));
        let frame = DataFrame::new(state, plan);
        let task = Arc::new(frame.task_ctx());
        let physical = frame.create_physical_plan().await.map_err(df_err)?;
        // A job left unread (this query's timeout, a cap below) is cancelled on the cluster.
        let job = scheduler.map(|s| distributed::JobGuard::new(&physical, s));
        let mut stream = execute_stream(physical, task).map_err(df_err)?;
        let schema = stream.schema();
        let max = max_rows.unwrap_or(0);
        // Clients' results are capped in bytes too; the server's own queries are not.
        let max_bytes = if max_rows.is_some() { self.config.max_result_bytes } else { 0 };
        let (mut batches, mut rows, mut bytes) = (Vec::new(), 0usize, 0u64);
        while let Some(batch) = stream.next().await {
            let batch = batch.map_err(df_err)?;
            rows += batch.num_rows();
            if max > 0 && rows > max {
                return Err(QueryError::TooManyRows { max });
            }
            bytes += batch.get_array_memory_size() as u64;
            if max_bytes > 0 && bytes > max_bytes {
                return Err(QueryError::ResultTooLarge { max_bytes });
            }
            if batch.num_rows() > 0 {
                batches.push(batch);
            }
        }
        if let Some(job) = job {
            job.finished();
        }
        if explain {
            // Plans name the data files and the byte ranges each partition reads: where
            // and how the server stores data is nobody's business, viewers' included.
            batches = batches.iter().map(redact_batch).collect::<Result<_, _>>()?;
        }
        Ok(QueryResult { schema, batches, distributed: false })
    }
}

/// `batch` with every path in its text columns redacted ([`crate::error::redact_plan_paths`]).
fn redact_batch(
    batch: &datafusion::arrow::array::RecordBatch,
) -> Result<datafusion::arrow::array::RecordBatch, QueryError> {
    use datafusion::arrow::array::{Array, ArrayRef, AsArray, StringArray};
    let columns: Vec<ArrayRef> = batch
        .columns()
        .iter()
        .map(|c| match c.data_type() {
            DataType::Utf8 => {
                let text = c.as_string::<i32>();
                Arc::new(text.iter().map(|v| v.map(crate::error::redact_plan_paths)).collect::<StringArray>())
                    as ArrayRef
            }
            _ => c.clone(),
        })
        .collect();
    datafusion::arrow::array::RecordBatch::try_new(batch.schema(), columns)
        .map_err(|e| QueryError::Internal { detail: format!("redacting a plan: {e}") })
}

/// The session options every Apron session runs with: the query server's, and the
/// Ballista scheduler's and executors' ([`crate::distributed`]).
pub fn session_config(config: &QueryConfig) -> SessionConfig {
    let mut session = SessionConfig::new()
        // `SHOW TABLES`, `SHOW COLUMNS`, information_schema.* for clients and BI tools.
        .with_information_schema(true);
    if config.target_partitions > 0 {
        session = session.with_target_partitions(config.target_partitions);
    }
    let o = session.options_mut();
    // Filter pushdown into the Parquet decoder, cheapest predicates first; page
    // index and statistics pruning (defaults, set so they cannot drift).
    o.execution.parquet.pushdown_filters = true;
    o.execution.parquet.reorder_filters = true;
    o.execution.parquet.enable_page_index = true;
    o.execution.parquet.pruning = true;
    // PostgreSQL's dialect, as the pg port's clients expect: the contract's column
    // names (`cluster`, `host`, `time`, `hour`, …) work unquoted, where the generic
    // dialect reads `cluster` as the start of Hive's `CLUSTER BY`.
    o.sql_parser.dialect = datafusion::config::Dialect::PostgreSQL;
    session
}

/// Apron's functions in `state`: the capped string functions (`max_string_result_bytes`)
/// and the sketches. The query server's sessions and every Ballista node's have the
/// same, so a shipped plan's functions mean the same everywhere.
pub fn register_functions(state: &mut SessionState, config: &QueryConfig) -> datafusion::common::Result<()> {
    let max_string = usize::try_from(config.max_string_result_bytes).unwrap_or(usize::MAX);
    guard::capped_functions(state, max_string)?;
    crate::sketch::register(state)
}
