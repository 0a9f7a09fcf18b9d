//! The collector's HTTP surface: `POST /api/v1/ingest`, the server side of
//! `docs/ingest.md`.
//!
//! ```text
//!  request ─► bearer token (constant time) ─► x-apron-* headers, Content-Type
//!          ─► per-agent rate (429) ─► concurrency permit (429)
//!          ─► body, size-limited by DefaultBodyLimit (413)
//!          ─► spawn_blocking: Store::ingest (decode, dedup, WAL fsync, memtable)
//!                              + newest sample time (clock skew) ─► 200 {"rows", "duplicate"}
//!  every refusal is an [`ApiError`]: its status, code and Retry-After are decided in
//!  one place ([`ApiError::status`]), and its body is the contract's {"error", "detail"}.
//! ```
//!
//! [`router`] returns a plain `axum::Router` with its state applied, so the server binary
//! adds further routes (`/healthz`, `/metrics`, SQL, reports) with `Router::merge`. The
//! ingest and storage metrics are registered in the `prometheus-client` [`Registry`]
//! handed to [`IngestState::new`], which the server serves on its `/metrics`.

use std::collections::HashMap;
use std::io::Cursor;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use apron_common::wire::{Table, headers};
use arrow_array::cast::AsArray;
use arrow_array::types::TimestampMicrosecondType;
use arrow_ipc::reader::StreamReader;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, FromRequest, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric as _};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};
use tokio::sync::Semaphore;

use crate::error::IngestError;
use crate::store::{IngestOutcome, IngestRequest, Store};

/// The ingest route.
pub const INGEST_PATH: &str = "/api/v1/ingest";
/// Longest epoch accepted (`docs/ingest.md`: opaque ASCII, at most 64 characters).
const MAX_EPOCH_LEN: usize = 64;
/// Longest agent id accepted (the agent allows 253).
const MAX_AGENT_LEN: usize = 253;
/// A skew warning per agent and direction at most this often.
const SKEW_LOG_EVERY: Duration = Duration::from_secs(60);
/// Bound on the skew log's rate-limit memory (agents are authenticated, but ids are free).
const SKEW_LOG_MAX_AGENTS: usize = 10_000;

/// Ingest settings; the server's `[ingest]` config section.
#[derive(Clone)]
pub struct IngestOptions {
    /// Accepted bearer tokens. At least one is required.
    pub tokens: Vec<String>,
    /// Largest request body, bytes (413 beyond).
    pub max_body_bytes: usize,
    /// Batches whose newest sample time is further than this from the receive time are
    /// flagged (log line, `apron_ingest_clock_skew_batches_total`).
    pub clock_skew_threshold: Duration,
    /// Ingest requests handled at once; more get 429. Bounds the memory held by bodies
    /// (`max_concurrent × max_body_bytes`) and the blocking threads waiting on the WAL.
    pub max_concurrent: usize,
    /// Ingest requests one agent (`x-apron-agent`) may make per second, with bursts of
    /// up to as many again; beyond, 429 with `Retry-After` (agents back off and retry,
    /// so nothing is lost). `None`: no per-agent limit. A healthy agent sends one
    /// request per table per flush interval, plus catch-up after an outage.
    pub max_requests_per_agent: Option<std::num::NonZeroU32>,
}

impl Default for IngestOptions {
    fn default() -> Self {
        IngestOptions {
            tokens: Vec::new(),
            max_body_bytes: 64 << 20,
            clock_skew_threshold: Duration::from_secs(30),
            max_concurrent: 32,
            max_requests_per_agent: std::num::NonZeroU32::new(50),
        }
    }
}

impl std::fmt::Debug for IngestOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IngestOptions")
            .field("tokens", &format_args!("<{} redacted>", self.tokens.len()))
            .field("max_body_bytes", &self.max_body_bytes)
            .field("clock_skew_threshold", &self.clock_skew_threshold)
            .field("max_concurrent", &self.max_concurrent)
            .field("max_requests_per_agent", &self.max_requests_per_agent)
            .finish()
    }
}

/// Why [`IngestState::new`] refused its options.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("no ingest token is configured: every ingest request would be refused")]
    NoTokens,
    #[error("ingest token #{index} is not 1 or more visible ASCII characters without spaces; it could never match")]
    BadToken { index: usize },
    #[error("{key} must be at least 1")]
    Zero { key: &'static str },
}

/// Everything the handlers share. Cheap to clone.
#[derive(Clone)]
pub struct IngestState {
    inner: Arc<Shared>,
}

impl std::fmt::Debug for IngestState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IngestState").field("store", &self.inner.store).finish()
    }
}

struct Shared {
    store: Arc<Store>,
    tokens: Vec<Box<[u8]>>,
    max_body_bytes: usize,
    skew_threshold: Duration,
    permits: Arc<Semaphore>,
    max_concurrent: usize,
    metrics: IngestMetrics,
    registry: Registry,
    skew_log: Mutex<HashMap<(String, Direction), Instant>>,
    per_agent: Option<AgentLimiter>,
    per_agent_rate: u32,
}

/// The per-agent request rate (GCRA, keyed by agent id).
type AgentLimiter = governor::DefaultKeyedRateLimiter<String>;

/// Forget quiet agents' limiter state once this many are tracked (ids are free-form).
const RATE_MAX_AGENTS: usize = 100_000;

impl IngestState {
    /// Registers the ingest and storage metrics in `registry` (which may already hold
    /// other families of the server) and keeps it for the server's `GET /metrics`.
    pub fn new(store: Arc<Store>, options: IngestOptions, registry: Registry) -> Result<IngestState, SetupError> {
        if options.tokens.is_empty() {
            return Err(SetupError::NoTokens);
        }
        IngestState::build(store, options, registry)
    }

    /// A state that accepts no ingest (every token refused): for a server that only
    /// answers queries (the query role of a cluster), which still serves `/metrics`.
    pub fn without_ingest(store: Arc<Store>, registry: Registry) -> Result<IngestState, SetupError> {
        IngestState::build(store, IngestOptions { tokens: Vec::new(), ..IngestOptions::default() }, registry)
    }

    fn build(store: Arc<Store>, options: IngestOptions, mut registry: Registry) -> Result<IngestState, SetupError> {
        if let Some(index) = options.tokens.iter().position(|t| !visible_ascii(t)) {
            return Err(SetupError::BadToken { index });
        }
        if options.max_body_bytes == 0 {
            return Err(SetupError::Zero { key: "max_body_bytes" });
        }
        if options.max_concurrent == 0 {
            return Err(SetupError::Zero { key: "max_concurrent" });
        }
        let metrics = IngestMetrics::register(&mut registry);
        registry.register_collector(Box::new(StoreCollector { store: store.clone() }));
        Ok(IngestState {
            inner: Arc::new(Shared {
                store,
                tokens: options.tokens.iter().map(|t| t.as_bytes().into()).collect(),
                max_body_bytes: options.max_body_bytes,
                skew_threshold: options.clock_skew_threshold,
                permits: Arc::new(Semaphore::new(options.max_concurrent)),
                max_concurrent: options.max_concurrent,
                metrics,
                registry,
                skew_log: Mutex::new(HashMap::new()),
                per_agent_rate: options.max_requests_per_agent.map_or(0, std::num::NonZeroU32::get),
                per_agent: options.max_requests_per_agent.map(|n| {
                    governor::RateLimiter::keyed(governor::Quota::per_second(n).allow_burst(
                        n.saturating_mul(std::num::NonZeroU32::new(2).unwrap_or(std::num::NonZeroU32::MIN)),
                    ))
                }),
            }),
        })
    }

    /// Checks an ingest bearer token, for other ingest routes of the server (OTLP).
    pub fn authorize_ingest(&self, headers: &HeaderMap) -> Result<(), (StatusCode, &'static str)> {
        authorize(headers, &self.inner.tokens).map_err(|e| match e {
            ApiError::Unauthorized(why) => (StatusCode::UNAUTHORIZED, why),
            _ => (StatusCode::UNAUTHORIZED, "unauthorized"),
        })
    }

    /// The configured request body limit.
    pub fn max_body_bytes(&self) -> usize {
        self.inner.max_body_bytes
    }

    pub fn store(&self) -> &Arc<Store> {
        &self.inner.store
    }

    pub fn registry(&self) -> &Registry {
        &self.inner.registry
    }
}

/// `POST /api/v1/ingest` with `state` applied. Merge further routes into the result; it
/// sets no fallback, so the caller may.
pub fn router(state: IngestState) -> Router {
    let limit = state.inner.max_body_bytes;
    Router::new().route(INGEST_PATH, post(ingest).layer(DefaultBodyLimit::max(limit))).with_state(state)
}

// ───────────────────────────── errors ─────────────────────────────

/// Every way a request to this module fails. [`ApiError::status`] is the one mapping
/// from failure to HTTP status.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    Unauthorized(&'static str),
    #[error("missing header {0}")]
    MissingHeader(&'static str),
    #[error("invalid header {name}: {detail}")]
    InvalidHeader { name: &'static str, detail: String },
    #[error("unknown table {0:?} in header x-apron-table; known: gpu_samples, gpu_processes")]
    UnknownTable(String),
    #[error("the body is larger than {limit} bytes")]
    BodyTooLarge { limit: usize },
    #[error("could not read the body: {0}")]
    BodyUnreadable(String),
    #[error("{0} ingest requests are in progress; retry shortly")]
    Overloaded(usize),
    #[error(
        "agent {agent} is over its rate of {per_second} ingest requests per second (ingest.max_requests_per_agent); retry in {retry_after_s} s"
    )]
    RateLimited { agent: String, per_second: u32, retry_after_s: u32 },
    #[error(transparent)]
    Ingest(#[from] IngestError),
    #[error("internal error: {0}")]
    Internal(String),
}

impl ApiError {
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::MissingHeader(_)
            | ApiError::InvalidHeader { .. }
            | ApiError::UnknownTable(_)
            | ApiError::BodyUnreadable(_) => StatusCode::BAD_REQUEST,
            ApiError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Overloaded(_) | ApiError::RateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Ingest(e) => StatusCode::from_u16(e.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The JSON `error` field: short and stable, for programs.
    pub fn code(&self) -> &'static str {
        match self {
            ApiError::Unauthorized(_) => "unauthorized",
            ApiError::MissingHeader(_) => "missing_header",
            ApiError::InvalidHeader { .. } => "invalid_header",
            ApiError::UnknownTable(_) => "unknown_table",
            ApiError::BodyTooLarge { .. } => "body_too_large",
            ApiError::BodyUnreadable(_) => "body_unreadable",
            ApiError::Overloaded(_) => "overloaded",
            ApiError::RateLimited { .. } => "rate_limited",
            ApiError::Ingest(e) => e.code(),
            ApiError::Internal(_) => "internal",
        }
    }

    /// Seconds for `Retry-After`: on 429 and 503, where a retry soon may succeed.
    fn retry_after(&self) -> Option<u32> {
        if let ApiError::RateLimited { retry_after_s, .. } = self {
            return Some(*retry_after_s);
        }
        match self.status() {
            StatusCode::TOO_MANY_REQUESTS => Some(1),
            StatusCode::SERVICE_UNAVAILABLE => Some(match self {
                ApiError::Ingest(IngestError::InFlight) => 1,
                // A persist of the frozen memtable takes about a second at the
                // default budget; two lets it finish without a thundering herd.
                ApiError::Ingest(IngestError::Backpressure { .. }) => 2,
                _ => 5,
            }),
            _ => None,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = json_error(self.status(), self.code(), &self.to_string());
        if let Some(s) = self.retry_after() {
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        if matches!(self, ApiError::Unauthorized(_)) {
            r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        r
    }
}

/// The contract's error body (one definition, in `apron_http::serve`).
pub use apron_http::serve::json_error;

// ───────────────────────────── ingest ─────────────────────────────

/// The validated identity of a request.
struct Target {
    table: Table,
    agent: String,
    epoch: String,
    sequence: u64,
}

async fn ingest(State(state): State<IngestState>, request: Request) -> Response {
    let started = Instant::now();
    let received = SystemTime::now();
    let s = &state.inner;
    let result = handle(&state, request, received).await;
    let status = match &result {
        Ok(_) => StatusCode::OK,
        Err(e) => e.status(),
    };
    s.metrics.requests.get_or_create(&StatusLabels { status: status.as_u16().to_string() }).inc();
    s.metrics.duration.observe(started.elapsed().as_secs_f64());
    match result {
        Ok(out) => (StatusCode::OK, axum::Json(serde_json::json!({ "rows": out.rows, "duplicate": out.duplicate })))
            .into_response(),
        Err(e) => {
            // 5xx is the operator's problem; 4xx the client's (the agent logs those).
            if status.is_server_error() {
                tracing::warn!(status = status.as_u16(), "ingest failed: {e}");
            } else {
                tracing::debug!(status = status.as_u16(), "ingest refused: {e}");
            }
            e.into_response()
        }
    }
}

async fn handle(state: &IngestState, request: Request, received: SystemTime) -> Result<IngestOutcome, ApiError> {
    let s = &state.inner;
    authorize(request.headers(), &s.tokens)?;
    let target = target(request.headers())?;
    state.check_rate(&target.agent)?;
    // Before the body is read: the permit bounds the memory bodies take.
    let Ok(permit) = s.permits.clone().try_acquire_owned() else {
        return Err(ApiError::Overloaded(s.max_concurrent));
    };
    let body = Bytes::from_request(request, &()).await.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::BodyTooLarge { limit: s.max_body_bytes }
        } else {
            ApiError::BodyUnreadable(rejection.body_text())
        }
    })?;

    let state = state.clone();
    tokio::task::spawn_blocking(move || -> Result<IngestOutcome, ApiError> {
        // Held until the store is done, even when the client goes away meanwhile: the
        // append then completes unanswered (and is counted), and the retry is a duplicate.
        let _permit = permit;
        let req = IngestRequest {
            table: target.table,
            agent: &target.agent,
            epoch: &target.epoch,
            sequence: target.sequence,
            body: &body,
        };
        let s = &state.inner;
        let outcome = s.store.ingest(req)?;
        if outcome.duplicate {
            s.metrics.duplicates.inc();
        } else if outcome.rows > 0 {
            let t = TableLabels { table: target.table.name().to_owned() };
            s.metrics.rows.get_or_create(&t).inc_by(outcome.rows as u64);
            s.metrics.bytes.get_or_create(&t).inc_by(body.len() as u64);
            // The body was validated by the store; only its time column is decoded again.
            if let Some(newest) = newest_time_us(&body) {
                state.record_skew(&target.agent, newest, received);
            }
        }
        Ok(outcome)
    })
    .await
    .map_err(|e| ApiError::Internal(format!("the ingest task failed: {e}")))?
}

impl IngestState {
    /// Spends one of `agent`'s requests, or says how long it must wait.
    fn check_rate(&self, agent: &str) -> Result<(), ApiError> {
        let Some(limiter) = &self.inner.per_agent else { return Ok(()) };
        if limiter.len() > RATE_MAX_AGENTS {
            limiter.retain_recent();
        }
        let key = agent.to_owned();
        limiter.check_key(&key).map_err(|not_until| {
            let wait = not_until.wait_time_from(governor::clock::Clock::now(&governor::clock::DefaultClock::default()));
            ApiError::RateLimited {
                agent: key,
                per_second: self.inner.per_agent_rate,
                retry_after_s: u32::try_from(wait.as_secs()).unwrap_or(u32::MAX).max(1),
            }
        })
    }

    /// Records the agent's clock offset as seen in this batch and flags it beyond the
    /// threshold.
    ///
    /// The value is `newest sample time − receive time`. Ahead of the collector (> 0)
    /// can only be the agent's clock. Behind (< 0) is normal by up to a flush interval,
    /// and also what a batch delayed in the agent's spool looks like, so the log says so.
    fn record_skew(&self, agent: &str, newest_us: i64, received: SystemTime) {
        let s = &self.inner;
        let received_us = received.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as i64);
        let skew = (newest_us - received_us) as f64 / 1e6;
        s.metrics.clock_skew.get_or_create(&AgentLabels { agent: agent.to_owned() }).set(skew);
        let threshold = s.skew_threshold.as_secs_f64();
        let direction = if skew > threshold {
            Direction::Ahead
        } else if skew < -threshold {
            Direction::Behind
        } else {
            return;
        };
        s.metrics.skewed.get_or_create(&DirectionLabels { direction: direction.name().to_owned() }).inc();
        if !self.may_log_skew(agent, direction) {
            return;
        }
        match direction {
            Direction::Ahead => tracing::warn!(
                agent,
                skew_seconds = skew,
                "clock skew: agent {agent}'s newest sample is {skew:.1}s ahead of the collector's clock (threshold {threshold}s); check time sync on that host"
            ),
            Direction::Behind => tracing::warn!(
                agent,
                skew_seconds = skew,
                "clock skew: agent {agent}'s newest sample is {:.1}s behind the collector's clock (threshold {threshold}s): its clock is slow, or the batch was delayed (spooled during an outage)",
                -skew
            ),
        }
    }

    fn may_log_skew(&self, agent: &str, direction: Direction) -> bool {
        let mut log = self.inner.skew_log.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        let key = (agent.to_owned(), direction);
        if log.get(&key).is_some_and(|last| now.duration_since(*last) < SKEW_LOG_EVERY) {
            return false;
        }
        if log.len() >= SKEW_LOG_MAX_AGENTS {
            log.clear();
        }
        log.insert(key, now);
        true
    }
}

/// The largest `time` (µs) in an IPC stream the store has accepted. Column 0 is `time`
/// in both tables; projection skips decompressing the others.
fn newest_time_us(body: &[u8]) -> Option<i64> {
    let reader = StreamReader::try_new(Cursor::new(body), Some(vec![0])).ok()?;
    let mut newest = None;
    for batch in reader {
        let batch = batch.ok()?;
        let times = batch.column(0).as_primitive_opt::<TimestampMicrosecondType>()?;
        newest = newest.max(times.values().iter().copied().max());
    }
    newest
}

fn visible_ascii(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_graphic())
}

/// Checks `Authorization: Bearer <token>` against every configured token.
fn authorize(headers: &HeaderMap, tokens: &[Box<[u8]>]) -> Result<(), ApiError> {
    let Some(value) = headers.get(header::AUTHORIZATION) else {
        return Err(ApiError::Unauthorized("missing Authorization header: send Authorization: Bearer <ingest token>"));
    };
    let presented = value.as_bytes();
    let Some(token) = presented.strip_prefix(b"Bearer ").or_else(|| presented.strip_prefix(b"bearer ")) else {
        return Err(ApiError::Unauthorized("the Authorization header is not a Bearer token"));
    };
    // Every token is compared, each in constant time, so timing says nothing about
    // which token or how much of it matched.
    let mut matched = false;
    for t in tokens {
        matched |= constant_time_eq(token, t);
    }
    if matched { Ok(()) } else { Err(ApiError::Unauthorized("the ingest token is not valid")) }
}

/// Byte equality whose running time depends only on the lengths, not on where the
/// first difference is.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = u8::from(a.len() != b.len());
    for i in 0..a.len().max(b.len()) {
        diff |= a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0);
    }
    std::hint::black_box(diff) == 0
}

fn header_str<'a>(headers: &'a HeaderMap, name: &'static str) -> Result<&'a str, ApiError> {
    let v = headers.get(name).ok_or(ApiError::MissingHeader(name))?;
    v.to_str().map_err(|_| ApiError::InvalidHeader { name, detail: "not visible ASCII".into() })
}

/// Validates the `x-apron-*` headers and `Content-Type`.
fn target(headers: &HeaderMap) -> Result<Target, ApiError> {
    let table_name = header_str(headers, headers::TABLE)?;
    let table = Table::from_name(table_name).ok_or_else(|| ApiError::UnknownTable(table_name.to_owned()))?;

    let agent = header_str(headers, headers::AGENT)?;
    if !visible_ascii(agent) || agent.len() > MAX_AGENT_LEN {
        return Err(ApiError::InvalidHeader {
            name: headers::AGENT,
            detail: format!("must be 1 to {MAX_AGENT_LEN} visible ASCII characters without spaces"),
        });
    }
    let epoch = header_str(headers, headers::EPOCH)?;
    // Opaque: never parsed, only bounded (it is stored in every WAL record).
    if !visible_ascii(epoch) || epoch.len() > MAX_EPOCH_LEN {
        return Err(ApiError::InvalidHeader {
            name: headers::EPOCH,
            detail: format!("must be 1 to {MAX_EPOCH_LEN} visible ASCII characters without spaces"),
        });
    }
    let seq_text = header_str(headers, headers::SEQUENCE)?;
    let sequence =
        seq_text.parse::<u64>().ok().filter(|_| seq_text.bytes().all(|b| b.is_ascii_digit())).ok_or_else(|| {
            ApiError::InvalidHeader {
                name: headers::SEQUENCE,
                detail: format!("{seq_text:?} is not an unsigned decimal integer"),
            }
        })?;

    let content_type = header_str(headers, "content-type")?;
    let media = content_type.split(';').next().unwrap_or_default().trim();
    if !media.eq_ignore_ascii_case(headers::ARROW_STREAM) {
        return Err(ApiError::InvalidHeader {
            name: "content-type",
            detail: format!("{media:?}; the body must be {}", headers::ARROW_STREAM),
        });
    }
    Ok(Target { table, agent: agent.to_owned(), epoch: epoch.to_owned(), sequence })
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusLabels {
    status: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TableLabels {
    table: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AgentLabels {
    agent: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirectionLabels {
    direction: String,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Direction {
    Ahead,
    Behind,
}

impl Direction {
    fn name(self) -> &'static str {
        match self {
            Direction::Ahead => "ahead",
            Direction::Behind => "behind",
        }
    }
}

struct IngestMetrics {
    requests: Family<StatusLabels, Counter>,
    rows: Family<TableLabels, Counter>,
    bytes: Family<TableLabels, Counter>,
    duplicates: Counter,
    clock_skew: Family<AgentLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    skewed: Family<DirectionLabels, Counter>,
    duration: Histogram,
}

impl IngestMetrics {
    fn register(r: &mut Registry) -> IngestMetrics {
        let m = IngestMetrics {
            requests: Family::default(),
            rows: Family::default(),
            bytes: Family::default(),
            duplicates: Counter::default(),
            clock_skew: Family::default(),
            skewed: Family::default(),
            // 0.5 ms … 8 s: an fsync on a quiet SSD up to a stalled disk.
            duration: Histogram::new(exponential_buckets(0.0005, 2.0, 15)),
        };
        r.register("apron_ingest_requests", "Ingest requests answered, by HTTP status.", m.requests.clone());
        r.register(
            "apron_ingest_rows",
            "Rows stored (durable in the WAL), by table; duplicates not counted.",
            m.rows.clone(),
        );
        r.register_with_unit(
            "apron_ingest_body",
            "Request body bytes of stored batches (Arrow IPC, compressed), by table.",
            Unit::Bytes,
            m.bytes.clone(),
        );
        r.register(
            "apron_ingest_duplicates",
            "Batches acknowledged as duplicates of a stored (agent, epoch, sequence); nothing was written.",
            m.duplicates.clone(),
        );
        r.register_with_unit(
            "apron_agent_clock_skew",
            "Newest sample time of the agent's last stored batch minus the collector's receive time: > 0 the agent's clock is ahead; < 0 behind, or the batch was delayed (flush interval, spool).",
            Unit::Seconds,
            m.clock_skew.clone(),
        );
        r.register(
            "apron_ingest_clock_skew_batches",
            "Stored batches whose newest sample time was beyond the clock skew threshold, by direction.",
            m.skewed.clone(),
        );
        r.register_with_unit(
            "apron_ingest_request_duration",
            "Time to answer an ingest request (including the WAL fsync).",
            Unit::Seconds,
            m.duration.clone(),
        );
        m
    }
}

/// Storage gauges, read from the store at scrape time.
#[derive(Debug)]
struct StoreCollector {
    store: Arc<Store>,
}

type Series = Vec<(Vec<(&'static str, &'static str)>, f64)>;

fn encode_family(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    ty: MetricType,
    series: &Series,
) -> Result<(), std::fmt::Error> {
    let mut d = enc.encode_descriptor(name, help, unit, ty)?;
    for (labels, v) in series {
        let fam = d.encode_family(labels)?;
        match ty {
            MetricType::Counter => ConstCounter::new(*v).encode(fam)?,
            _ => ConstGauge::new(*v).encode(fam)?,
        }
    }
    Ok(())
}

/// Number and total size of the WAL segments.
fn wal_usage(data_dir: &Path) -> (usize, u64) {
    let segments = crate::wal::list_segments(&data_dir.join("wal")).unwrap_or_default();
    let bytes = segments.iter().filter_map(|(_, p)| std::fs::metadata(p).ok()).map(|m| m.len()).sum();
    (segments.len(), bytes)
}

impl Collector for StoreCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let tables = [Table::GpuSamples, Table::GpuProcesses];
        let per_table = |f: &dyn Fn(Table) -> f64| -> Series {
            tables.iter().map(|&t| (vec![("table", t.name())], f(t))).collect()
        };
        let stats: HashMap<Table, _> = tables.iter().map(|&t| (t, self.store.memtable_stats(t))).collect();
        let files: HashMap<Table, _> = tables.iter().map(|&t| (t, self.store.persisted_files(t))).collect();
        let gauge = MetricType::Gauge;
        encode_family(
            &mut enc,
            "apron_memtable_rows",
            "Rows in memory not yet persisted to Parquet, by table.",
            None,
            gauge,
            &per_table(&|t| stats[&t].rows as f64),
        )?;
        encode_family(
            &mut enc,
            "apron_memtable",
            "Arrow bytes in memory not yet persisted to Parquet, by table.",
            Some(&Unit::Bytes),
            gauge,
            &per_table(&|t| stats[&t].bytes as f64),
        )?;
        encode_family(
            &mut enc,
            "apron_parquet_files",
            "Published Parquet files, by table.",
            None,
            gauge,
            &per_table(&|t| files[&t].len() as f64),
        )?;
        encode_family(
            &mut enc,
            "apron_parquet",
            "Bytes of the published Parquet files, by table.",
            Some(&Unit::Bytes),
            gauge,
            &per_table(&|t| files[&t].iter().map(|f| f.bytes).sum::<u64>() as f64),
        )?;
        let (segments, bytes) = wal_usage(self.store.data_dir());
        encode_family(
            &mut enc,
            "apron_wal_segments",
            "WAL segment files on disk.",
            None,
            gauge,
            &vec![(vec![], segments as f64)],
        )?;
        encode_family(
            &mut enc,
            "apron_wal",
            "Bytes of the WAL segment files on disk.",
            Some(&Unit::Bytes),
            gauge,
            &vec![(vec![], bytes as f64)],
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_time_eq_is_equality() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
        assert!(!constant_time_eq(b"", b"a"));
        assert!(constant_time_eq(b"", b""));
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).expect("header value"));
        }
        h
    }

    const GOOD: [(&str, &str); 5] = [
        ("x-apron-table", "gpu_samples"),
        ("x-apron-agent", "node-1"),
        ("x-apron-epoch", "01a2371f-b6c3-74d2-a45a-979400ea41d1"),
        ("x-apron-sequence", "7"),
        ("content-type", "application/vnd.apache.arrow.stream"),
    ];

    #[test]
    fn headers_are_required_and_named() {
        let t = target(&headers(&GOOD)).expect("valid");
        assert_eq!((t.table, t.agent.as_str(), t.sequence), (Table::GpuSamples, "node-1", 7));
        for (i, (name, _)) in GOOD.iter().enumerate() {
            let mut h = GOOD.to_vec();
            h.remove(i);
            let e = target(&headers(&h)).err().expect("missing header");
            assert_eq!(e.status(), StatusCode::BAD_REQUEST);
            assert!(e.to_string().contains(name), "{e}");
        }
        let bad = |k: &'static str, v: &str| {
            let mut h = headers(&GOOD);
            h.insert(k, HeaderValue::from_str(v).expect("value"));
            let e = target(&h).err().expect("invalid");
            assert_eq!(e.status(), StatusCode::BAD_REQUEST, "{k}={v}");
            e.to_string()
        };
        assert!(bad("x-apron-table", "gpu_stuff").contains("gpu_stuff"));
        assert!(bad("x-apron-sequence", "-1").contains("x-apron-sequence"));
        assert!(bad("x-apron-sequence", "+1").contains("x-apron-sequence"));
        assert!(bad("x-apron-epoch", &"e".repeat(65)).contains("x-apron-epoch"));
        assert!(bad("x-apron-agent", "two words").contains("x-apron-agent"));
        assert!(bad("content-type", "application/json").contains("content-type"));
        let mut h = headers(&GOOD);
        h.insert("content-type", HeaderValue::from_static("application/vnd.apache.arrow.stream; charset=binary"));
        assert!(target(&h).is_ok(), "parameters are ignored");
    }

    #[test]
    fn tokens_are_checked() {
        let tokens: Vec<Box<[u8]>> = vec![b"first".as_slice().into(), b"second".as_slice().into()];
        let auth = |v: &str| authorize(&headers(&[("authorization", v)]), &tokens);
        assert!(auth("Bearer first").is_ok());
        assert!(auth("Bearer second").is_ok());
        assert!(auth("Bearer secon").is_err());
        assert!(auth("Basic second").is_err());
        assert_eq!(authorize(&HeaderMap::new(), &tokens).err().map(|e| e.status()), Some(StatusCode::UNAUTHORIZED));
    }

    #[test]
    fn status_mapping_is_the_protocol() {
        let s = |e: ApiError| (e.status().as_u16(), e.retry_after());
        assert_eq!(s(ApiError::Unauthorized("x")), (401, None));
        assert_eq!(s(ApiError::BodyTooLarge { limit: 1 }), (413, None));
        assert_eq!(s(ApiError::Overloaded(1)), (429, Some(1)));
        assert_eq!(s(ApiError::Ingest(IngestError::InFlight)), (503, Some(1)));
        let full = IngestError::Backpressure { held: 2, incoming: 1, budget: 2 };
        assert_eq!(s(ApiError::Ingest(full)), (503, Some(2)));
        assert_eq!(s(ApiError::Ingest(IngestError::WrongSchema("x".into()))), (422, None));
        assert_eq!(s(ApiError::Ingest(IngestError::Malformed("x".into()))), (400, None));
    }
}
