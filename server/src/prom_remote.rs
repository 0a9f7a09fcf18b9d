//! Prometheus as a peer: remote write in (`POST /api/v1/write`) and remote read out
//! (`POST /api/v1/read`). Both bodies are snappy (block format) protobuf: remote-write
//! 1.0's `prometheus.WriteRequest`, and remote read's `prometheus.ReadRequest`, answered
//! with a `ReadResponse` of sampled series (response type `SAMPLES`). The messages are
//! the few of `prompb` these routes need, derived by hand in [`proto`].
//!
//! ```text
//!  remote write (ingest token, body ≤ [ingest] max_body_bytes, compressed and not)
//!    WriteRequest ─► points of dcgm-exporter / Apron-agent names (apron_import::mapping)
//!    ─► WriteBuffer: per series the last points already converted (context) and the
//!       points not yet converted; each GPU's newest timestamp is held back until a later
//!       one arrives, so a scrape split over two requests still makes one row
//!    ─► apron_import::Importer (the point-sample rule of import and [[scrape]]: a sample
//!       at t stands for (t_prev, t] of its series) ─► windows ending after what this
//!       buffer already converted for the GPU
//!    ─► import::store_windows: data already stored for that GPU and time (an agent's)
//!       wins ─► Store::ingest as agent "remote-write", one epoch per server start
//!
//!  remote read (a reading token: viewer, team:<name> (its rows only), admin)
//!    ReadRequest { queries: [start, end, matchers] }
//!    ─► families: dcgm-exporter names (apron_import::MAPPINGS, in dcgm-exporter's units)
//!       and the agent's native apron_gpu_* gauges, kept when __name__ matchers allow
//!    ─► one SQL scan of gpu_samples through QueryEngine::execute_as(caller's scope):
//!       WHERE time in [start, end] AND the other matchers as predicates on host,
//!       gpu_uuid, gpu_model, namespace, pod, … (a superset, never fewer rows)
//!    ─► rows ─► series (labels of the family's style; every matcher applied exactly)
//!    ─► ReadResponse, one QueryResult per query, sample at each window's end
//! ```
//!
//! Remote read is bounded ([`ReadLimits`], `[remote_read]`): at most `max_queries`
//! queries per request (400 `too_many_queries`, before anything runs), at most
//! `max_concurrent` requests at once (the others wait up to 5 s, then 503 `busy`). The
//! queries run one after another; each one's series are encoded into the answer as soon
//! as it is done and dropped, so a request holds one query's series at a time plus the
//! encoded answer so far. Samples and bytes are counted as the series are built — the
//! bytes each sample and each new series add to the encoded answer — and a request is
//! refused the moment it would pass `max_samples` (400 `too_many_samples`, as
//! Prometheus' own `--storage.remote.read-sample-limit` answers 400) or `max_bytes`
//! (413 `response_too_large`), never after building it. Each query's scan is also under
//! the engine's `[query]` limits (timeout, memory, `max_result_rows`/`max_result_bytes`).
//!
//! A resent WriteRequest stores nothing new: its samples are at or before what the
//! buffer converted (filtered) or overlap the rows they made (dropped by
//! `store_windows`); one the store refused (503) is converted again when it comes back,
//! since [`WriteBuffer::undo`] puts the buffer back as it was. Every failure is a
//! [`RemoteError`], mapped to its status once ([`RemoteError::status`]): 400 for a body
//! that is not snappy or not the protobuf message, 413 over the body limit, 415 for
//! remote-write 2.0; nothing is stored then.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, LazyLock};

use apron_collector::http::{IngestState, json_error};
use apron_common::{GpuWindow, UnixMicros};
use apron_import::{ImportOptions, Importer};
use apron_query::{QueryEngine, QueryError, Scope};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use datafusion::arrow::array::{Array, ArrayRef, AsArray};
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{DataType, Float64Type, Int32Type, TimeUnit, TimestampMicrosecondType};
use datafusion::arrow::error::ArrowError;
use futures::StreamExt;
use prost::Message;
use tokio::sync::Mutex;

use crate::access::Access;
use crate::sqlutil::{sql_str, ts};

/// The agent id remote-written batches are stored under.
pub const REMOTE_WRITE_AGENT: &str = "remote-write";
pub const WRITE_PATH: &str = "/api/v1/write";
pub const READ_PATH: &str = "/api/v1/read";
/// Largest remote read request (compressed or not): a few queries of matchers.
const MAX_READ_BODY: usize = 1 << 20;
/// How long a remote read waits for one of `[remote_read] max_concurrent` before 503.
const READ_QUEUE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// `[remote_read]`: what one `POST /api/v1/read` may cost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadLimits {
    /// Queries in one ReadRequest.
    pub max_queries: usize,
    /// Samples in one answer, every query's together.
    pub max_samples: usize,
    /// Bytes of one answer (encoded, before compression), counted as it is built.
    pub max_bytes: usize,
    /// Remote reads at once.
    pub max_concurrent: usize,
}

impl Default for ReadLimits {
    fn default() -> Self {
        // Prometheus sends one query per request (Thanos and others a few); 5 M samples
        // are ~100 MB of answer, so the bytes cap (64 MiB) binds first for wide series.
        ReadLimits { max_queries: 16, max_samples: 5_000_000, max_bytes: 64 << 20, max_concurrent: 2 }
    }
}

/// What is left of a request's [`ReadLimits`] while its answer is built.
#[derive(Debug)]
pub struct Budget {
    samples: usize,
    bytes: usize,
    limits: ReadLimits,
}

impl Budget {
    pub fn new(limits: ReadLimits) -> Budget {
        Budget { samples: 0, bytes: 0, limits }
    }

    /// Counts `bytes` more of the answer, or refuses them (nothing is added then).
    fn bytes(&mut self, bytes: usize) -> Result<(), RemoteError> {
        let total = self.bytes.saturating_add(bytes);
        if total > self.limits.max_bytes {
            return Err(RemoteError::ResponseTooLarge { max_bytes: self.limits.max_bytes });
        }
        self.bytes = total;
        Ok(())
    }

    /// Counts one more sample of `bytes`, or refuses it.
    fn sample(&mut self, bytes: usize) -> Result<(), RemoteError> {
        if self.samples >= self.limits.max_samples {
            return Err(RemoteError::TooManySamples { max_samples: self.limits.max_samples });
        }
        self.bytes(bytes)?;
        self.samples += 1;
        Ok(())
    }

    /// Samples and bytes counted so far.
    pub fn used(&self) -> (usize, usize) {
        (self.samples, self.bytes)
    }
}

/// The bytes a length-delimited field of `len` bytes takes (tag, length, payload).
fn field_len(len: usize) -> usize {
    1 + prost::encoding::encoded_len_varint(len as u64) + len
}

/// The bytes a new series adds to the answer: its labels and the most its own length
/// prefix can take (its samples are counted one by one).
fn series_bytes(labels: &Labels) -> usize {
    labels.iter().map(|(k, v)| field_len(field_len(k.len()) + field_len(v.len()))).sum::<usize>() + 11
}
/// Points of a series kept after conversion, so the next request's first sample stands
/// for the time since the previous one and the gap rule sees the series' step.
const CONTEXT: usize = 3;
/// A series with nothing pending and no sample for this long (behind its GPU's newest)
/// is forgotten: its labels changed (a new pod) or it stopped.
const STALE_US: i64 = 3_600_000_000;

/// The remote-write 1.0 / remote-read messages of Prometheus' `prompb` that these routes
/// use (fields not declared here — exemplars, histograms, metadata, hints — are skipped
/// by the decoder).
pub mod proto {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct WriteRequest {
        #[prost(message, repeated, tag = "1")]
        pub timeseries: Vec<TimeSeries>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct TimeSeries {
        #[prost(message, repeated, tag = "1")]
        pub labels: Vec<Label>,
        #[prost(message, repeated, tag = "2")]
        pub samples: Vec<Sample>,
    }

    #[derive(Clone, PartialEq, Eq, PartialOrd, Ord, prost::Message)]
    pub struct Label {
        #[prost(string, tag = "1")]
        pub name: String,
        #[prost(string, tag = "2")]
        pub value: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Sample {
        #[prost(double, tag = "1")]
        pub value: f64,
        /// Milliseconds since the epoch.
        #[prost(int64, tag = "2")]
        pub timestamp: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ReadRequest {
        #[prost(message, repeated, tag = "1")]
        pub queries: Vec<Query>,
        #[prost(enumeration = "ResponseType", repeated, tag = "2")]
        pub accepted_response_types: Vec<i32>,
    }

    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
    #[repr(i32)]
    pub enum ResponseType {
        Samples = 0,
        StreamedXorChunks = 1,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Query {
        #[prost(int64, tag = "1")]
        pub start_timestamp_ms: i64,
        #[prost(int64, tag = "2")]
        pub end_timestamp_ms: i64,
        #[prost(message, repeated, tag = "3")]
        pub matchers: Vec<LabelMatcher>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct LabelMatcher {
        #[prost(enumeration = "MatchType", tag = "1")]
        pub r#type: i32,
        #[prost(string, tag = "2")]
        pub name: String,
        #[prost(string, tag = "3")]
        pub value: String,
    }

    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
    #[repr(i32)]
    pub enum MatchType {
        Eq = 0,
        Neq = 1,
        Re = 2,
        Nre = 3,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ReadResponse {
        #[prost(message, repeated, tag = "1")]
        pub results: Vec<QueryResult>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct QueryResult {
        #[prost(message, repeated, tag = "1")]
        pub timeseries: Vec<TimeSeries>,
    }
}

// ───────────────────────────── errors ─────────────────────────────

/// Every way a remote write or read fails; [`RemoteError::status`] is the one place its
/// HTTP status is decided.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    #[error("{0}")]
    Unauthorized(&'static str),
    #[error("the role {0} may only ingest; reading needs a viewer, team:<name> or admin token")]
    Forbidden(String),
    #[error("the {what} is larger than the server's limit of {limit} bytes ({key})")]
    TooLarge { what: &'static str, limit: usize, key: &'static str },
    #[error("the body could not be read: {0}")]
    Body(String),
    #[error("the body is not snappy-compressed (block format): {0}")]
    NotSnappy(String),
    #[error("the body is not a {what} protobuf message: {detail}")]
    NotProtobuf { what: &'static str, detail: String },
    #[error("{0}")]
    Unsupported(String),
    #[error("label matcher {name}{op}{value:?}: {detail}")]
    BadMatcher { name: String, op: &'static str, value: String, detail: String },
    #[error(
        "the request has {queries} queries; the limit is {max} per request ([remote_read] max_queries): send them in several requests"
    )]
    TooManyQueries { queries: usize, max: usize },
    #[error(
        "exceeded sample limit ({max_samples}) of [remote_read] max_samples: narrow the time range or the matchers"
    )]
    TooManySamples { max_samples: usize },
    #[error(
        "the answer would be larger than {} ([remote_read] max_bytes): narrow the time range or the matchers",
        apron_query::error::human_bytes(*.max_bytes as u64)
    )]
    ResponseTooLarge { max_bytes: usize },
    #[error("server busy: {max} remote reads are running ([remote_read] max_concurrent); retry shortly")]
    Busy { max: usize },
    #[error(transparent)]
    Query(#[from] QueryError),
    #[error("converting the samples failed: {0}")]
    Convert(#[from] apron_import::ImportError),
    #[error("storing the samples failed: {0}")]
    Store(#[from] crate::import::StoreImportError),
}

impl RemoteError {
    pub fn status(&self) -> StatusCode {
        match self {
            RemoteError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            RemoteError::Forbidden(_) => StatusCode::FORBIDDEN,
            RemoteError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            RemoteError::Body(_)
            | RemoteError::NotSnappy(_)
            | RemoteError::NotProtobuf { .. }
            | RemoteError::BadMatcher { .. }
            | RemoteError::TooManyQueries { .. }
            | RemoteError::TooManySamples { .. } => StatusCode::BAD_REQUEST,
            RemoteError::ResponseTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            RemoteError::Busy { .. } => StatusCode::SERVICE_UNAVAILABLE,
            RemoteError::Unsupported(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            RemoteError::Query(e) => StatusCode::from_u16(e.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            RemoteError::Store(_) | RemoteError::Convert(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    pub fn code(&self) -> &'static str {
        match self {
            RemoteError::Unauthorized(_) => "unauthorized",
            RemoteError::Forbidden(_) => "forbidden",
            RemoteError::TooLarge { .. } => "body_too_large",
            RemoteError::Body(_) => "invalid_body",
            RemoteError::NotSnappy(_) => "not_snappy",
            RemoteError::NotProtobuf { .. } => "invalid_protobuf",
            RemoteError::Unsupported(_) => "unsupported_media_type",
            RemoteError::BadMatcher { .. } => "invalid_matcher",
            RemoteError::TooManyQueries { .. } => "too_many_queries",
            RemoteError::TooManySamples { .. } => "too_many_samples",
            RemoteError::ResponseTooLarge { .. } => "response_too_large",
            RemoteError::Busy { .. } => "busy",
            RemoteError::Query(e) => e.code(),
            RemoteError::Store(_) | RemoteError::Convert(_) => "store_failed",
        }
    }
}

impl IntoResponse for RemoteError {
    fn into_response(self) -> Response {
        let status = self.status();
        let mut r = match &self {
            // The SQL API's shape for the query's own errors (with `code`).
            RemoteError::Query(e) => (status, axum::Json(e.to_json())).into_response(),
            _ => json_error(status, self.code(), &self.to_string()),
        };
        if status == StatusCode::UNAUTHORIZED {
            r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if status == StatusCode::SERVICE_UNAVAILABLE {
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        r
    }
}

// ───────────────────────────── bodies ─────────────────────────────

/// Reads a body of at most `limit` bytes (a declared larger length is refused unread).
async fn read_limited(headers: &HeaderMap, body: axum::body::Body, limit: usize) -> Result<Vec<u8>, RemoteError> {
    let too_large = RemoteError::TooLarge { what: "body", limit, key: "[ingest] max_body_bytes" };
    let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large);
    }
    let mut out = Vec::with_capacity(declared.map_or(0, |n| n as usize));
    let mut stream = body.into_data_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| RemoteError::Body(e.to_string()))?;
        if out.len() + chunk.len() > limit {
            return Err(too_large);
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out)
}

/// Snappy block-format decompression, refusing output over `limit` before allocating.
pub fn decompress(body: &[u8], limit: usize) -> Result<Vec<u8>, RemoteError> {
    let n = snap::raw::decompress_len(body).map_err(|e| RemoteError::NotSnappy(e.to_string()))?;
    if n > limit {
        return Err(RemoteError::TooLarge { what: "decompressed body", limit, key: "[ingest] max_body_bytes" });
    }
    snap::raw::Decoder::new().decompress_vec(body).map_err(|e| RemoteError::NotSnappy(e.to_string()))
}

/// Snappy block-format compression (answers, and clients in tests).
pub fn compress(raw: &[u8]) -> Vec<u8> {
    // Compressing a slice in memory cannot fail but for inputs over 2^32 bytes.
    snap::raw::Encoder::new().compress_vec(raw).unwrap_or_default()
}

/// A `WriteRequest` from a remote-write body.
pub fn decode_write(body: &[u8], limit: usize) -> Result<proto::WriteRequest, RemoteError> {
    let raw = decompress(body, limit)?;
    proto::WriteRequest::decode(raw.as_slice())
        .map_err(|e| RemoteError::NotProtobuf { what: "prometheus.WriteRequest", detail: e.to_string() })
}

/// A `ReadRequest` from a remote-read body.
pub fn decode_read(body: &[u8]) -> Result<proto::ReadRequest, RemoteError> {
    let raw = decompress(body, MAX_READ_BODY)?;
    proto::ReadRequest::decode(raw.as_slice())
        .map_err(|e| RemoteError::NotProtobuf { what: "prometheus.ReadRequest", detail: e.to_string() })
}

// ───────────────────────────── state and routes ─────────────────────────────

#[derive(Clone)]
pub struct RemoteState {
    ingest: IngestState,
    engine: Arc<QueryEngine>,
    access: Access,
    /// One remote-write request converts and stores at a time.
    buffer: Arc<Mutex<WriteBuffer>>,
    epoch: String,
    limits: ReadLimits,
    /// One permit per remote read running (`limits.max_concurrent`).
    reads: Arc<tokio::sync::Semaphore>,
}

impl RemoteState {
    pub fn new(ingest: IngestState, engine: Arc<QueryEngine>, access: Access) -> RemoteState {
        RemoteState {
            ingest,
            engine,
            access,
            buffer: Arc::default(),
            epoch: format!("remote-write-{:x}", UnixMicros::now().0),
            limits: ReadLimits::default(),
            reads: Arc::new(tokio::sync::Semaphore::new(ReadLimits::default().max_concurrent)),
        }
    }

    /// Remote read under `limits` (`[remote_read]`) instead of the defaults.
    pub fn with_limits(mut self, limits: ReadLimits) -> RemoteState {
        self.reads = Arc::new(tokio::sync::Semaphore::new(limits.max_concurrent.max(1)));
        self.limits = limits;
        self
    }
}

/// The two routes, merged into the server's app.
pub fn router(state: RemoteState) -> axum::Router {
    axum::Router::new().route(WRITE_PATH, post(write)).route(READ_PATH, post(read)).with_state(state)
}

async fn write(State(s): State<RemoteState>, request: Request) -> Response {
    match write_request(&s, request).await {
        Ok(stored) => {
            let mut r = StatusCode::NO_CONTENT.into_response();
            r.headers_mut().insert("x-apron-rows-stored", HeaderValue::from(stored));
            r
        }
        Err(e) => e.into_response(),
    }
}

async fn write_request(s: &RemoteState, request: Request) -> Result<usize, RemoteError> {
    let (parts, body) = request.into_parts();
    // The token from the head alone: a client without one never makes the server read.
    s.ingest.authorize_ingest(&parts.headers).map_err(|(_, detail)| RemoteError::Unauthorized(detail))?;
    let content_type = parts.headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or_default();
    if content_type.contains("io.prometheus.write.v2") {
        return Err(RemoteError::Unsupported(
            "remote write 2.0 (io.prometheus.write.v2.Request) is not accepted: send prometheus.WriteRequest (remote write 1.0, Prometheus' default)".to_owned(),
        ));
    }
    let limit = s.ingest.max_body_bytes();
    let body = read_limited(&parts.headers, body, limit).await?;
    let req = decode_write(&body, limit)?;
    let points = points(&req);
    let mut buffer = s.buffer.lock().await;
    let (windows, sequence, undo) = buffer.add(points)?;
    if windows.is_empty() {
        return Ok(0);
    }
    let from = windows.iter().map(|w| w.time.minus(w.window).0).min().unwrap_or(0);
    let to = windows.iter().map(|w| w.time.0).max().unwrap_or(0);
    let stored = crate::import::store_windows(
        s.ingest.store(),
        &s.engine,
        windows,
        (from, to),
        REMOTE_WRITE_AGENT,
        &s.epoch,
        sequence,
    )
    .await;
    let stored = match stored {
        Ok(stored) => stored,
        Err(e) => {
            // Prometheus retries a 5xx: the batch must make its windows again then.
            buffer.undo(undo);
            return Err(RemoteError::Store(e));
        }
    };
    tracing::debug!(?stored, "remote write");
    Ok(stored.stored)
}

// ───────────────────────────── remote write ─────────────────────────────

/// A series' labels, sorted, `__name__` included.
type Labels = Vec<(String, String)>;

/// One sample: series, time (µs), value.
pub type Point = (Labels, i64, f64);

/// The samples of a request whose metric name is one apron-import maps (dcgm-exporter's
/// and the agent's dcgm-compatible families); times in µs.
pub fn points(req: &proto::WriteRequest) -> Vec<Point> {
    let mut out = Vec::new();
    for ts in &req.timeseries {
        let name = ts.labels.iter().find(|l| l.name == "__name__").map(|l| l.value.as_str()).unwrap_or_default();
        if apron_import::mapping(name).is_none() {
            continue;
        }
        let mut labels: Labels = ts.labels.iter().map(|l| (l.name.clone(), l.value.clone())).collect();
        labels.sort();
        for s in &ts.samples {
            if let Some(t) = s.timestamp.checked_mul(1000) {
                out.push((labels.clone(), t, s.value));
            }
        }
    }
    out
}

/// The GPU (or MIG instance) a series' labels name, as the importer keys it; `None`
/// for a series the importer cannot place (no `UUID`, a bad `GPU_I_ID`).
fn gpu_key(labels: &Labels) -> Option<String> {
    let get = |k: &str| labels.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str()).filter(|v| !v.is_empty());
    let uuid = get("UUID")?;
    match get("GPU_I_ID") {
        Some(gi) => Some(apron_import::mig_instance_uuid(uuid, gi.parse().ok()?)),
        None => Some(uuid.to_owned()),
    }
}

#[derive(Clone, Debug, Default)]
struct SeriesState {
    /// The newest points already converted (at most [`CONTEXT`]), sorted by time.
    context: Vec<(i64, f64)>,
    /// Points not converted yet.
    pending: Vec<(i64, f64)>,
}

#[derive(Clone, Debug, Default)]
struct GpuState {
    series: Vec<Labels>,
    /// The newest time converted: windows ending there or before were made already.
    done: i64,
}

/// What remote write keeps between requests (see the module docs).
#[derive(Debug, Default)]
pub struct WriteBuffer {
    series: HashMap<Labels, SeriesState>,
    gpus: HashMap<String, GpuState>,
    sequence: u64,
}

impl WriteBuffer {
    /// Adds a request's points; returns the new windows (sorted by GPU, then time) and the
    /// sequence number to store them under.
    ///
    /// The [`Undo`] puts the GPUs it touched back as they were, for a batch that could
    /// not be stored: Prometheus sends it again, and it must convert again.
    pub fn add(&mut self, points: Vec<Point>) -> Result<(Vec<GpuWindow>, u64, Undo), apron_import::ImportError> {
        let mut touched: Vec<String> = Vec::new();
        let mut seen: HashSet<String> = HashSet::new();
        let mut undo = Undo::default();
        for (labels, _, _) in &points {
            let Some(gpu) = gpu_key(labels) else { continue };
            if !undo.series.iter().any(|(k, _)| k == labels) {
                undo.series.push((labels.clone(), self.series.get(labels).cloned()));
            }
            if seen.insert(gpu.clone()) {
                let before = self.gpus.get(&gpu).cloned();
                for k in before.iter().flat_map(|g| &g.series) {
                    undo.series.push((k.clone(), self.series.get(k).cloned()));
                }
                undo.gpus.push((gpu, before));
            }
        }
        seen.clear();
        for (labels, t, v) in points {
            let Some(gpu) = gpu_key(&labels) else { continue };
            if !self.series.contains_key(&labels) {
                self.gpus.entry(gpu.clone()).or_default().series.push(labels.clone());
            }
            self.series.entry(labels).or_default().pending.push((t, v));
            if seen.insert(gpu.clone()) {
                touched.push(gpu);
            }
        }
        let mut importer = Importer::new(ImportOptions::default())?;
        let mut done_before: HashMap<String, i64> = HashMap::new();
        for gpu in touched {
            let Some(g) = self.gpus.get_mut(&gpu) else { continue };
            let newest =
                g.series.iter().filter_map(|k| self.series.get(k)).flat_map(|s| s.pending.iter().map(|p| p.0)).max();
            let Some(newest) = newest else { continue };
            done_before.insert(gpu.clone(), g.done);
            let mut converted = g.done;
            for key in &g.series {
                let Some(s) = self.series.get_mut(key) else { continue };
                // The GPU's newest time waits: other fields of that scrape may still come.
                let (ready, held): (Vec<_>, Vec<_>) = s.pending.drain(..).partition(|p| p.0 < newest);
                s.pending = held;
                if ready.is_empty() {
                    continue;
                }
                let name = key.iter().find(|(k, _)| k == "__name__").map(|(_, v)| v.as_str()).unwrap_or_default();
                let labels: Vec<(&str, &str)> = key.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                for &(t, v) in s.context.iter().chain(&ready) {
                    importer.add_point(name, &labels, UnixMicros(t), v);
                }
                converted = converted.max(ready.iter().map(|p| p.0).max().unwrap_or(i64::MIN));
                let mut all: Vec<(i64, f64)> = s.context.drain(..).chain(ready).collect();
                all.sort_by_key(|p| p.0);
                all.dedup_by_key(|p| p.0);
                s.context = all.split_off(all.len().saturating_sub(CONTEXT));
            }
            g.done = converted;
            // Forget series that stopped (their labels changed, or the field went away).
            let series = &mut self.series;
            g.series.retain(|key| {
                let stale = series
                    .get(key)
                    .is_none_or(|s| s.pending.is_empty() && s.context.last().is_none_or(|p| p.0 < newest - STALE_US));
                if stale {
                    series.remove(key);
                }
                !stale
            });
        }
        let windows: Vec<GpuWindow> = importer
            .finish()?
            .windows
            .into_iter()
            .filter(|w| done_before.get(w.gpu.gpu_uuid.as_str()).is_none_or(|&d| w.time.0 > d))
            .collect();
        if !windows.is_empty() {
            self.sequence += 1;
        }
        Ok((windows, self.sequence, undo))
    }

    /// Puts back what [`WriteBuffer::add`] changed (the sequence stays: a retry is a new
    /// batch, and nothing of the failed one was stored).
    pub fn undo(&mut self, undo: Undo) {
        for (key, before) in undo.series {
            match before {
                Some(s) => self.series.insert(key, s),
                None => self.series.remove(&key),
            };
        }
        for (gpu, before) in undo.gpus {
            match before {
                Some(g) => self.gpus.insert(gpu, g),
                None => self.gpus.remove(&gpu),
            };
        }
    }
}

/// The state of the GPUs and series one [`WriteBuffer::add`] touched, before it.
#[derive(Debug, Default)]
pub struct Undo {
    gpus: Vec<(String, Option<GpuState>)>,
    series: Vec<(Labels, Option<SeriesState>)>,
}

// ───────────────────────────── remote read ─────────────────────────────

/// Which label set a family's series carry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Style {
    /// dcgm-exporter's: `gpu`, `UUID`, `device`, `modelName`, `Hostname`, `GPU_I_ID`,
    /// `GPU_I_PROFILE`, `pod`, `namespace`, `container` (+ `cluster` when set).
    Dcgm,
    /// The agent's native `apron_gpu_*`: `gpu_uuid`, `gpu_index`, `gpu_model`,
    /// `hostname`, `cluster`, `parent_gpu_uuid`, `mig_profile`, `pod`, `namespace`,
    /// `container`.
    Native,
}

/// A metric served from one `gpu_samples` column.
#[derive(Clone, Debug)]
struct Family {
    name: &'static str,
    column: String,
    style: Style,
    /// Prometheus value = column value × this.
    factor: f64,
}

/// dcgm-exporter's names in its units (the inverse of apron-import's table) and the
/// agent's native gauges in base units.
static FAMILIES: LazyLock<Vec<Family>> = LazyLock::new(|| {
    let mut out: Vec<Family> = apron_import::MAPPINGS
        .iter()
        .map(|m| Family {
            name: m.name,
            column: m.field.column().to_owned(),
            style: Style::Dcgm,
            factor: if m.scale < 1.0 { m.scale.recip() } else { 1.0 / m.scale },
        })
        .collect();
    for (name, field, max, scale) in apron_agent::exposition::native_gauges() {
        let column = if max { apron_common::wire::max_column(field) } else { None };
        out.push(Family {
            name,
            column: column.unwrap_or_else(|| field.column().to_owned()),
            style: Style::Native,
            factor: scale,
        });
    }
    out
});

/// The value of a family from a column value. Ratios are stored with 4 decimals and
/// joules with 3, so a percentage has 2 and millijoules none: rounding there gives the
/// number dcgm-exporter showed (15 % stays 15, not 15.000000000000002).
fn prom_value(f: &Family, v: f64) -> f64 {
    let x = v * f.factor;
    if f.factor == 100.0 {
        (x * 100.0).round() / 100.0
    } else if f.factor == 1000.0 {
        x.round()
    } else {
        x
    }
}

/// A checked label matcher.
#[derive(Clone, Debug)]
pub struct Matcher {
    name: String,
    op: proto::MatchType,
    value: String,
    regex: Option<regex::Regex>,
}

impl Matcher {
    pub fn new(m: &proto::LabelMatcher) -> Result<Matcher, RemoteError> {
        let op = proto::MatchType::try_from(m.r#type).map_err(|_| RemoteError::BadMatcher {
            name: m.name.clone(),
            op: "?",
            value: m.value.clone(),
            detail: format!("unknown matcher type {}", m.r#type),
        })?;
        let regex = match op {
            proto::MatchType::Re | proto::MatchType::Nre => {
                // Prometheus anchors matchers at both ends; `.` matches a newline too.
                Some(regex::Regex::new(&format!("^(?s:{})$", m.value)).map_err(|e| RemoteError::BadMatcher {
                    name: m.name.clone(),
                    op: op_text(op),
                    value: m.value.clone(),
                    detail: e.to_string(),
                })?)
            }
            _ => None,
        };
        Ok(Matcher { name: m.name.clone(), op, value: m.value.clone(), regex })
    }

    /// Whether a label value (`""` when the label is absent) matches.
    pub fn matches(&self, v: &str) -> bool {
        match (self.op, &self.regex) {
            (proto::MatchType::Eq, _) => v == self.value,
            (proto::MatchType::Neq, _) => v != self.value,
            (proto::MatchType::Re, Some(r)) => r.is_match(v),
            (proto::MatchType::Nre, Some(r)) => !r.is_match(v),
            _ => false,
        }
    }

    /// The predicate on a string expression `c` (NULL is an absent label, i.e. `""`),
    /// as SQL.
    fn sql(&self, c: &str) -> String {
        let empty_matches = self.matches("");
        let pred = match self.op {
            proto::MatchType::Eq | proto::MatchType::Neq => format!("{c} {} {}", sql_op(self.op), sql_str(&self.value)),
            // The anchored pattern, as the regex crate (DataFusion's `~`) reads it.
            _ => format!("{c} {} {}", sql_op(self.op), sql_str(&format!("^(?s:{})$", self.value))),
        };
        if empty_matches { format!("({c} IS NULL OR {pred})") } else { format!("({c} IS NOT NULL AND {pred})") }
    }
}

fn op_text(op: proto::MatchType) -> &'static str {
    match op {
        proto::MatchType::Eq => "=",
        proto::MatchType::Neq => "!=",
        proto::MatchType::Re => "=~",
        proto::MatchType::Nre => "!~",
    }
}

fn sql_op(op: proto::MatchType) -> &'static str {
    match op {
        proto::MatchType::Eq => "=",
        proto::MatchType::Neq => "<>",
        proto::MatchType::Re => "~",
        proto::MatchType::Nre => "!~",
    }
}

/// The SQL expression a label of `style` is read from, where it is one column (or a
/// `coalesce` of two); `None` for labels that are not (pushed down) or absent.
fn label_column(style: Style, label: &str) -> Option<&'static str> {
    Some(match (style, label) {
        (Style::Dcgm, "Hostname") | (Style::Native, "hostname") => "\"host\"",
        (Style::Dcgm, "UUID") => "coalesce(parent_gpu_uuid, gpu_uuid)",
        (Style::Dcgm, "modelName") | (Style::Native, "gpu_model") => "gpu_model",
        (Style::Dcgm, "GPU_I_PROFILE") | (Style::Native, "mig_profile") => "mig_profile",
        (Style::Native, "gpu_uuid") => "gpu_uuid",
        (Style::Native, "parent_gpu_uuid") => "parent_gpu_uuid",
        (_, "cluster") => "\"cluster\"",
        (_, "namespace") => "namespace",
        (_, "pod") => "pod",
        (_, "container") => "container",
        _ => return None,
    })
}

/// The predicate a matcher puts on the rows of one style (`None`: not pushed down).
fn pushdown(style: Style, m: &Matcher) -> Option<String> {
    let index = match style {
        Style::Dcgm => "gpu",
        Style::Native => "gpu_index",
    };
    if m.name == index {
        // The index is an integer column: only equality with a number is pushed.
        return match (m.op, m.value.parse::<i32>()) {
            (proto::MatchType::Eq, Ok(i)) => Some(format!("gpu_index = {i}")),
            _ => None,
        };
    }
    if style == Style::Dcgm && m.name == "UUID" && m.op == proto::MatchType::Eq && !m.value.is_empty() {
        // Two plain comparisons keep the gpu_uuid statistics usable for pruning.
        let v = sql_str(&m.value);
        return Some(format!("(gpu_uuid = {v} OR parent_gpu_uuid = {v})"));
    }
    label_column(style, &m.name).map(|c| m.sql(c))
}

/// The identity and owner columns every read scans, then one column per family.
const ID_COLUMNS: &[&str] = &[
    "\"host\"",
    "gpu_uuid",
    "gpu_index",
    "gpu_model",
    "parent_gpu_uuid",
    "mig_profile",
    "\"cluster\"",
    "namespace",
    "pod",
    "container",
];

/// A planned query: the families it can return, its SQL, and the matchers to apply.
#[derive(Debug)]
pub struct Plan {
    families: Vec<Family>,
    columns: Vec<String>,
    matchers: Vec<Matcher>,
    pub sql: Option<String>,
}

/// Plans one remote-read query; `sql` is `None` when no family can match.
pub fn plan(q: &proto::Query) -> Result<Plan, RemoteError> {
    let matchers = q.matchers.iter().map(Matcher::new).collect::<Result<Vec<_>, _>>()?;
    let families: Vec<Family> = FAMILIES
        .iter()
        .filter(|f| matchers.iter().filter(|m| m.name == "__name__").all(|m| m.matches(f.name)))
        .cloned()
        .collect();
    let mut columns: Vec<String> = families.iter().map(|f| f.column.clone()).collect();
    columns.sort();
    columns.dedup();
    if families.is_empty() {
        return Ok(Plan { families, columns, matchers, sql: None });
    }
    let mut styles: Vec<Style> = families.iter().map(|f| f.style).collect();
    styles.dedup();
    // One conjunction per style present, OR-ed: a superset of each style's rows.
    let per_style: Vec<String> = styles
        .iter()
        .map(|&s| {
            let preds: Vec<String> =
                matchers.iter().filter(|m| m.name != "__name__").filter_map(|m| pushdown(s, m)).collect();
            if preds.is_empty() { "TRUE".to_owned() } else { preds.join(" AND ") }
        })
        .collect();
    let labels = if per_style.iter().any(|p| p == "TRUE") {
        String::new()
    } else if per_style.len() == 1 {
        format!(" AND {}", per_style[0])
    } else {
        format!(" AND (({}))", per_style.join(") OR ("))
    };
    let values: Vec<String> = columns.iter().map(|c| format!("CAST({c} AS DOUBLE) AS {c}")).collect();
    let (start, end) = (q.start_timestamp_ms.saturating_mul(1000), q.end_timestamp_ms.saturating_mul(1000));
    let sql = format!(
        "SELECT \"time\", {}, {} FROM gpu_samples WHERE \"time\" >= {} AND \"time\" <= {}{labels} ORDER BY gpu_uuid, \"time\"",
        ID_COLUMNS.join(", "),
        values.join(", "),
        ts(start),
        ts(end),
    );
    Ok(Plan { families, columns, matchers, sql: Some(sql) })
}

fn strings(a: &ArrayRef) -> Result<Vec<Option<String>>, ArrowError> {
    let a = cast(a, &DataType::Utf8)?;
    let a = a.as_string::<i32>();
    Ok((0..a.len()).map(|i| (!a.is_null(i)).then(|| a.value(i).to_owned()).filter(|s| !s.is_empty())).collect())
}

fn floats(a: &ArrayRef) -> Result<Vec<Option<f64>>, ArrowError> {
    let a = cast(a, &DataType::Float64)?;
    let a = a.as_primitive::<Float64Type>();
    Ok((0..a.len()).map(|i| (!a.is_null(i)).then(|| a.value(i))).collect())
}

/// The labels of one row in a style (absent labels left out), unsorted.
fn row_labels(style: Style, id: &[Option<String>], gpu_index: Option<i32>) -> Labels {
    let [host, uuid, model, parent, profile, cluster, namespace, pod, container] = id else { return Vec::new() };
    let mut l: Labels = Vec::with_capacity(12);
    let mut push = |k: &str, v: &Option<String>| {
        if let Some(v) = v {
            l.push((k.to_owned(), v.clone()));
        }
    };
    let index = gpu_index.map(|i| i.to_string());
    match style {
        Style::Dcgm => {
            push("gpu", &index);
            push("UUID", if parent.is_some() { parent } else { uuid });
            push("device", &gpu_index.map(|i| format!("nvidia{i}")));
            push("modelName", model);
            push("Hostname", host);
            push("GPU_I_PROFILE", profile);
            // The importer's MIG instance id `MIG-<parent>/<GPU_I_ID>`.
            let gi = parent.as_ref().zip(uuid.as_ref()).and_then(|(p, u)| {
                u.strip_prefix("MIG-")?.strip_prefix(p.as_str())?.strip_prefix('/').map(str::to_owned)
            });
            push("GPU_I_ID", &gi);
        }
        Style::Native => {
            push("gpu_uuid", uuid);
            push("gpu_index", &index);
            push("gpu_model", model);
            push("hostname", host);
            push("parent_gpu_uuid", parent);
            push("mig_profile", profile);
        }
    }
    push("cluster", cluster);
    push("pod", pod);
    push("namespace", namespace);
    push("container", container);
    l
}

/// Runs one planned query as `scope` and groups its rows into series, counting what
/// each series and sample adds to the answer against `budget` (refused as soon as it
/// would pass it).
pub async fn run_plan(
    engine: &QueryEngine,
    plan: &Plan,
    scope: &Scope,
    budget: &mut Budget,
) -> Result<proto::QueryResult, RemoteError> {
    let Some(sql) = &plan.sql else { return Ok(proto::QueryResult::default()) };
    let result = engine.execute_as(sql, scope).await?;
    let mut series: BTreeMap<Labels, Vec<proto::Sample>> = BTreeMap::new();
    // Reading our own columns failed: a bug, whose text is the log's, not the client's.
    let internal = |e: ArrowError| {
        let id = apron_query::error::error_id();
        tracing::warn!(error_id = %id, error = %e, "remote read: converting the rows failed");
        RemoteError::Query(QueryError::Internal {
            detail: apron_query::error::logged("converting the rows failed", &id),
        })
    };
    for b in &result.batches {
        let time = cast(b.column(0), &DataType::Timestamp(TimeUnit::Microsecond, None)).map_err(internal)?;
        let time = time.as_primitive::<TimestampMicrosecondType>();
        let mut id: Vec<Vec<Option<String>>> = Vec::new();
        let mut index = None;
        for (i, name) in ID_COLUMNS.iter().enumerate() {
            let col = b.column(i + 1);
            if *name == "gpu_index" {
                let c = cast(col, &DataType::Int32).map_err(internal)?;
                let c = c.as_primitive::<Int32Type>();
                index = Some((0..c.len()).map(|r| (!c.is_null(r)).then(|| c.value(r))).collect::<Vec<_>>());
            } else {
                id.push(strings(col).map_err(internal)?);
            }
        }
        let index = index.unwrap_or_default();
        let first_value = ID_COLUMNS.len() + 1;
        let values: HashMap<&str, Vec<Option<f64>>> = plan
            .columns
            .iter()
            .enumerate()
            .map(|(i, c)| Ok((c.as_str(), floats(b.column(first_value + i))?)))
            .collect::<Result<_, ArrowError>>()
            .map_err(internal)?;
        for r in 0..b.num_rows() {
            let row: Vec<Option<String>> = id.iter().map(|c| c.get(r).cloned().flatten()).collect();
            let gpu_index = index.get(r).copied().flatten();
            let by_style = [Style::Dcgm, Style::Native].map(|s| row_labels(s, &row, gpu_index));
            let t_ms = time.value(r).div_euclid(1000);
            for f in &plan.families {
                let Some(v) = values.get(f.column.as_str()).and_then(|c| c.get(r).copied().flatten()) else {
                    continue;
                };
                let mut labels = by_style[usize::from(f.style == Style::Native)].clone();
                labels.push(("__name__".to_owned(), f.name.to_owned()));
                let ok = plan.matchers.iter().all(|m| {
                    m.matches(labels.iter().find(|(k, _)| *k == m.name).map(|(_, v)| v.as_str()).unwrap_or(""))
                });
                if !ok {
                    continue;
                }
                labels.sort();
                let sample = proto::Sample { value: prom_value(f, v), timestamp: t_ms };
                budget.sample(field_len(sample.encoded_len()))?;
                match series.get_mut(&labels) {
                    Some(samples) => samples.push(sample),
                    None => {
                        budget.bytes(series_bytes(&labels))?;
                        series.insert(labels, vec![sample]);
                    }
                }
            }
        }
    }
    Ok(proto::QueryResult {
        timeseries: series
            .into_iter()
            .map(|(labels, mut samples)| {
                samples.sort_by_key(|s| s.timestamp);
                proto::TimeSeries {
                    labels: labels.into_iter().map(|(name, value)| proto::Label { name, value }).collect(),
                    samples,
                }
            })
            .collect(),
    })
}

async fn read(State(s): State<RemoteState>, request: Request) -> Response {
    match read_request(&s, request).await {
        Ok(body) => {
            ([(header::CONTENT_TYPE, "application/x-protobuf"), (header::CONTENT_ENCODING, "snappy")], compress(&body))
                .into_response()
        }
        Err(e) => e.into_response(),
    }
}

/// The encoded (not yet compressed) `ReadResponse` of a remote read.
async fn read_request(s: &RemoteState, request: Request) -> Result<Vec<u8>, RemoteError> {
    let (parts, body) = request.into_parts();
    let role = s.access.authenticate(&parts.headers).map_err(RemoteError::Unauthorized)?;
    let scope = role.read_scope().ok_or_else(|| RemoteError::Forbidden(role.to_string()))?;
    let body = read_limited(&parts.headers, body, MAX_READ_BODY).await?;
    let req = decode_read(&body)?;
    let samples = proto::ResponseType::Samples as i32;
    if !req.accepted_response_types.is_empty() && !req.accepted_response_types.contains(&samples) {
        return Err(RemoteError::Unsupported(
            "only the SAMPLES response type is served; accept it in accepted_response_types".to_owned(),
        ));
    }
    if req.queries.len() > s.limits.max_queries {
        return Err(RemoteError::TooManyQueries { queries: req.queries.len(), max: s.limits.max_queries });
    }
    // Every query is checked before any runs.
    let plans = req.queries.iter().map(plan).collect::<Result<Vec<_>, _>>()?;
    let _running = match tokio::time::timeout(READ_QUEUE_TIMEOUT, s.reads.clone().acquire_owned()).await {
        Ok(Ok(permit)) => permit,
        _ => return Err(RemoteError::Busy { max: s.limits.max_concurrent }),
    };
    // One query at a time; each one's series encoded (field 1 of ReadResponse, one
    // QueryResult per query, in order) and dropped before the next runs.
    let mut budget = Budget::new(s.limits);
    let mut out = Vec::new();
    for p in &plans {
        // The QueryResult's own tag and length.
        budget.bytes(6)?;
        let result = run_plan(&s.engine, p, &scope, &mut budget).await?;
        prost::encoding::message::encode(1, &result, &mut out);
    }
    let (samples, bytes) = budget.used();
    tracing::debug!(queries = plans.len(), samples, bytes, "remote read");
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::proto::*;
    use super::*;
    use apron_common::Field;

    const T0_MS: i64 = 1_764_000_000_000;

    fn series(name: &str, uuid: &str, extra: &[(&str, &str)], samples: &[(i64, f64)]) -> TimeSeries {
        let mut labels = vec![
            Label { name: "__name__".into(), value: name.into() },
            Label { name: "UUID".into(), value: uuid.into() },
            Label { name: "Hostname".into(), value: "node-1".into() },
            Label { name: "gpu".into(), value: "0".into() },
            Label { name: "modelName".into(), value: "NVIDIA H100 80GB HBM3".into() },
        ];
        labels.extend(extra.iter().map(|(k, v)| Label { name: (*k).into(), value: (*v).into() }));
        TimeSeries {
            labels,
            samples: samples.iter().map(|&(t, v)| Sample { value: v, timestamp: T0_MS + t * 1000 }).collect(),
        }
    }

    fn request(ts: Vec<TimeSeries>) -> Vec<Point> {
        let body = compress(&WriteRequest { timeseries: ts }.encode_to_vec());
        points(&decode_write(&body, 1 << 20).expect("decode"))
    }

    #[test]
    fn bodies_decode_or_fail_with_their_status() {
        let body = compress(
            &WriteRequest { timeseries: vec![series("DCGM_FI_DEV_GPU_UTIL", "GPU-a", &[], &[(0, 50.0)])] }
                .encode_to_vec(),
        );
        let req = decode_write(&body, 1 << 20).expect("decodes");
        assert_eq!(req.timeseries[0].samples[0].value, 50.0);
        let status = |r: Result<WriteRequest, RemoteError>| r.err().map(|e| (e.status().as_u16(), e.code()));
        assert_eq!(status(decode_write(b"not snappy at all", 1 << 20)), Some((400, "not_snappy")));
        assert_eq!(status(decode_write(&compress(b"\xff\xff\xff"), 1 << 20)), Some((400, "invalid_protobuf")));
        assert_eq!(status(decode_write(&compress(&[0u8; 4096]), 1000)), Some((413, "body_too_large")));
        let read = compress(
            &ReadRequest {
                queries: vec![Query { start_timestamp_ms: 1, end_timestamp_ms: 2, matchers: vec![] }],
                accepted_response_types: vec![ResponseType::Samples as i32],
            }
            .encode_to_vec(),
        );
        assert_eq!(decode_read(&read).expect("read").queries[0].end_timestamp_ms, 2);
        let bad = RemoteError::Unsupported("v2".into());
        assert_eq!(bad.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE);
    }

    #[test]
    fn points_keep_mapped_names_only() {
        let p = request(vec![
            series("DCGM_FI_DEV_GPU_UTIL", "GPU-a", &[], &[(0, 50.0), (1, 60.0)]),
            series("up", "GPU-a", &[], &[(0, 1.0)]),
        ]);
        assert_eq!(p.len(), 2);
        assert_eq!(p[1].1, (T0_MS + 1000) * 1000);
    }

    #[test]
    fn windows_hold_the_newest_scrape_and_a_resend_makes_nothing() {
        let mut b = WriteBuffer::default();
        let util = |s: &[(i64, f64)]| series("DCGM_FI_DEV_GPU_UTIL", "GPU-a", &[], s);
        let fb = |s: &[(i64, f64)]| series("DCGM_FI_DEV_FB_USED", "GPU-a", &[], s);
        // Scrapes at 0, 15, 30; the scrape at 30 is split: util now, fb_used later.
        let first = request(vec![util(&[(0, 10.0), (15, 20.0), (30, 30.0)]), fb(&[(0, 1.0), (15, 2.0)])]);
        // A batch that could not be stored converts again when Prometheus resends it.
        let (failed, _, undo) = b.add(first.clone()).expect("add");
        b.undo(undo);
        let (w, seq, _) = b.add(first.clone()).expect("add");
        assert_eq!(w, failed);
        // (0, 15]; 30 is held back.
        assert_eq!(w.len(), 1);
        assert_eq!((w[0].time.0 / 1000 - T0_MS, w[0].window.as_secs(), seq), (15_000, 15, 2));
        assert_eq!(w[0].value(Field::GpuUtil), Some(0.2));
        assert_eq!(w[0].value(Field::FbUsedBytes), Some(2.0 * 1_048_576.0));
        // The same request again: nothing.
        assert!(b.add(first).expect("again").0.is_empty());
        // The rest of the scrape at 30, then the scrape at 45: (15, 30] with both fields.
        assert!(b.add(request(vec![fb(&[(30, 3.0)])])).expect("rest").0.is_empty());
        let (w, seq, _) = b.add(request(vec![util(&[(45, 40.0)]), fb(&[(45, 4.0)])])).expect("next");
        assert_eq!(w.len(), 1, "{w:?}");
        assert_eq!((w[0].time.0 / 1000 - T0_MS, w[0].window.as_secs(), seq), (30_000, 15, 3));
        assert_eq!((w[0].value(Field::GpuUtil), w[0].value(Field::FbUsedBytes)), (Some(0.3), Some(3.0 * 1_048_576.0)));
        // A gap far beyond the series' step opens it again instead of billing the gap.
        let (w, _, _) = b.add(request(vec![util(&[(4000, 50.0), (4015, 60.0)])])).expect("gap");
        assert!(w.iter().all(|w| w.window.as_secs() == 15), "{w:?}");
        // MIG instances are their own GPUs, series without UUID are left out.
        let mig = series("DCGM_FI_DEV_GPU_UTIL", "GPU-m", &[("GPU_I_ID", "3")], &[(0, 1.0)]);
        assert_eq!(gpu_key(&request(vec![mig])[0].0).as_deref(), Some("MIG-GPU-m/3"));
    }

    fn matcher(name: &str, op: MatchType, value: &str) -> LabelMatcher {
        LabelMatcher { r#type: op as i32, name: name.into(), value: value.into() }
    }

    #[test]
    fn matchers_follow_prometheus_and_become_sql() {
        let m = |name: &str, op, v: &str| Matcher::new(&matcher(name, op, v)).expect("matcher");
        let re = m("pod", MatchType::Re, "train-.*");
        assert!(re.matches("train-a") && !re.matches("xtrain-a") && !re.matches(""));
        assert_eq!(re.sql("pod"), "(pod IS NOT NULL AND pod ~ '^(?s:train-.*)$')");
        let nre = m("pod", MatchType::Nre, "train-.*");
        assert!(nre.matches("") && !nre.matches("train-b"));
        assert_eq!(nre.sql("pod"), "(pod IS NULL OR pod !~ '^(?s:train-.*)$')");
        let eq_empty = m("pod", MatchType::Eq, "");
        assert_eq!(eq_empty.sql("pod"), "(pod IS NULL OR pod = '')");
        let neq = m("namespace", MatchType::Neq, "o'brien");
        assert_eq!(neq.sql("namespace"), "(namespace IS NULL OR namespace <> 'o''brien')");
        let bad = Matcher::new(&matcher("pod", MatchType::Re, "(")).expect_err("bad regex");
        assert_eq!((bad.status().as_u16(), bad.code()), (400, "invalid_matcher"));
        let unknown = Matcher::new(&LabelMatcher { r#type: 9, name: "pod".into(), value: "x".into() });
        assert!(unknown.is_err());
    }

    #[test]
    fn plans_push_name_host_uuid_and_time_into_the_scan() {
        let q = Query {
            start_timestamp_ms: T0_MS,
            end_timestamp_ms: T0_MS + 3_600_000,
            matchers: vec![
                matcher("__name__", MatchType::Eq, "DCGM_FI_DEV_GPU_UTIL"),
                matcher("UUID", MatchType::Eq, "GPU-a"),
                matcher("Hostname", MatchType::Re, "node-.*"),
                matcher("gpu", MatchType::Eq, "0"),
            ],
        };
        let p = plan(&q).expect("plan");
        assert_eq!(p.families.len(), 1);
        assert_eq!(p.columns, vec!["gpu_util".to_owned()]);
        let sql = p.sql.expect("sql");
        assert!(sql.contains("CAST(gpu_util AS DOUBLE)"), "{sql}");
        assert!(sql.contains("\"time\" >= TIMESTAMP '2025-11-24T16:00:00.000000Z'"), "{sql}");
        assert!(sql.contains("(gpu_uuid = 'GPU-a' OR parent_gpu_uuid = 'GPU-a')"), "{sql}");
        assert!(sql.contains("(\"host\" IS NOT NULL AND \"host\" ~ '^(?s:node-.*)$')"), "{sql}");
        assert!(sql.contains("gpu_index = 0"), "{sql}");
        // Both styles: each one's predicates, OR-ed.
        let q = Query {
            matchers: vec![
                matcher("__name__", MatchType::Re, "DCGM_FI_DEV_GPU_UTIL|apron_gpu_util_ratio"),
                matcher("namespace", MatchType::Eq, "ml"),
            ],
            ..q
        };
        let p = plan(&q).expect("plan");
        assert_eq!(
            p.families.iter().map(|f| f.name).collect::<Vec<_>>(),
            ["DCGM_FI_DEV_GPU_UTIL", "apron_gpu_util_ratio"]
        );
        let sql = p.sql.expect("sql");
        assert!(
            sql.contains("AND (((namespace IS NOT NULL AND namespace = 'ml')) OR ((namespace IS NOT NULL"),
            "{sql}"
        );
        // A name nothing serves: no scan at all.
        let none = Query { matchers: vec![matcher("__name__", MatchType::Eq, "up")], ..q };
        assert!(plan(&none).expect("plan").sql.is_none());
    }

    #[test]
    fn values_and_labels_in_each_style() {
        let util = FAMILIES.iter().find(|f| f.name == "DCGM_FI_DEV_GPU_UTIL").expect("util");
        assert_eq!(prom_value(util, 0.35), 35.0);
        assert_eq!(prom_value(util, 0.15), 15.0);
        let fb = FAMILIES.iter().find(|f| f.name == "DCGM_FI_DEV_FB_USED").expect("fb");
        assert_eq!(prom_value(fb, 1_073_741_824.0), 1024.0);
        let clock = FAMILIES.iter().find(|f| f.name == "apron_gpu_sm_clock_hertz").expect("clock");
        assert_eq!(prom_value(clock, 1410.0), 1.41e9);
        let max = FAMILIES.iter().find(|f| f.name == "apron_gpu_util_max_ratio").expect("max");
        assert_eq!(max.column, "gpu_util_max");
        let s = |v: &str| Some(v.to_owned());
        let id = [s("node-1"), s("MIG-GPU-p/3"), s("H100"), s("GPU-p"), s("1g.10gb"), None, s("ml"), s("train"), None];
        let dcgm = row_labels(Style::Dcgm, &id, Some(2));
        let get = |l: &Labels, k: &str| l.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        assert_eq!(get(&dcgm, "UUID"), s("GPU-p"));
        assert_eq!(get(&dcgm, "GPU_I_ID"), s("3"));
        assert_eq!(get(&dcgm, "device"), s("nvidia2"));
        assert_eq!(get(&dcgm, "cluster"), None);
        let native = row_labels(Style::Native, &id, Some(2));
        assert_eq!(get(&native, "gpu_uuid"), s("MIG-GPU-p/3"));
        assert_eq!(get(&native, "hostname"), s("node-1"));
        assert_eq!(get(&native, "pod"), s("train"));
    }
}
