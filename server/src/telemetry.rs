//! The server's own telemetry: logs on stderr and, when an OTLP endpoint is configured,
//! one span per HTTP request exported over OTLP (gRPC or HTTP/protobuf).
//!
//! ```text
//!  tracing events/spans ──► registry ─┬─► fmt layer (stderr, the --log filter)            always
//!                                     └─► tracing-opentelemetry layer ──► SDK tracer ──►   with OTLP
//!                                          (request spans, and what the       batch span processor
//!                                           --log filter lets through)        ──► opentelemetry-otlp
//! ```
//!
//! [`trace_request`] is the axum middleware that opens the request span: named
//! `<METHOD> <route>` (the matched route template, never the raw path), kind server,
//! with the stable HTTP conventions (`http.request.method`, `http.route`, `url.path`,
//! `http.response.status_code`) and the caller's W3C `traceparent` as its parent. It
//! does nothing until [`init_tracing`] turned OTLP on, and its span never reaches the log
//! output, so logs read the same with or without tracing.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::extract::{MatchedPath, Request};
use axum::middleware::Next;
use axum::response::Response;
use opentelemetry::propagation::{Extractor, TextMapPropagator as _};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _, WithTonicConfig as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use serde::Deserialize;
use tracing::Instrument as _;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::filter::{EnvFilter, FilterExt as _, Targets, filter_fn};
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::{Layer as _, Registry};

/// The target of request spans: the OpenTelemetry layer always takes them, the log
/// output never shows them.
const REQUEST_TARGET: &str = "apron::http";

/// Crates on the export path: their own spans and events must not be exported, or each
/// export would produce more to export.
const EXPORT_PATH: &[&str] = &["h2", "hyper", "hyper_util", "tonic", "tower", "reqwest", "rustls", "opentelemetry"];

/// Set once OTLP tracing is installed; until then [`trace_request`] passes requests
/// through untouched.
static ENABLED: AtomicBool = AtomicBool::new(false);

/// The OTLP transport for spans.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
pub enum TraceProtocol {
    /// OTLP/gRPC, `TraceService/Export` (usually port 4317).
    #[default]
    #[serde(rename = "grpc")]
    Grpc,
    /// OTLP/HTTP with protobuf bodies, `POST <endpoint>/v1/traces` (usually port 4318).
    #[serde(rename = "http/protobuf")]
    HttpProtobuf,
}

/// Where the server's spans go (e.g. a `[tracing.otlp]` config table, or flags).
/// `Debug` leaves header values out.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OtlpTracing {
    /// The receiver's URL, `http://` or `https://`. For HTTP, `/v1/traces` is appended
    /// unless the URL ends with it.
    pub endpoint: String,
    #[serde(default)]
    pub protocol: TraceProtocol,
    /// Extra request headers (gRPC metadata), e.g. `authorization`.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Per-export timeout (humantime); default 10s.
    #[serde(default)]
    pub timeout: Option<String>,
    /// The fraction of traces started here that are sampled, 0–1 (a caller's sampled
    /// `traceparent` is always followed); default 1.
    #[serde(default = "one")]
    pub sample_ratio: f64,
}

fn one() -> f64 {
    1.0
}

impl OtlpTracing {
    /// An endpoint with every default: gRPC, no headers, 10 s, every trace sampled.
    pub fn new(endpoint: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            protocol: TraceProtocol::Grpc,
            headers: BTreeMap::new(),
            timeout: None,
            sample_ratio: 1.0,
        }
    }
}

impl std::fmt::Debug for OtlpTracing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OtlpTracing")
            .field("endpoint", &self.endpoint)
            .field("protocol", &self.protocol)
            .field("headers", &self.headers.keys().map(|k| format!("{k}: <redacted>")).collect::<Vec<_>>())
            .field("timeout", &self.timeout)
            .field("sample_ratio", &self.sample_ratio)
            .finish()
    }
}

/// Keeps the span exporter alive; dropping it (or [`TracingGuard::shutdown`]) exports
/// the spans still buffered. Drop it outside async code — after `Runtime::block_on`
/// returns, before the runtime itself is dropped — or call `shutdown` through
/// `spawn_blocking`: it blocks until the last export is done (at most the timeout).
/// Tracing that could not be set up or flushed.
#[derive(Debug, thiserror::Error)]
pub enum TracingError {
    #[error("tracing {setting}: {detail}")]
    Setting { setting: String, detail: String },
    #[error("OTLP/gRPC tracing must be set up inside the Tokio runtime (call it under runtime.enter())")]
    NoRuntime,
    #[error("tracing exporter for {endpoint}: {detail}")]
    Exporter { endpoint: String, detail: String },
    #[error("a tracing subscriber is already installed: {0}")]
    AlreadyInstalled(String),
    #[error("flushing the last spans: {0}")]
    Flush(String),
}

#[derive(Debug, Default)]
pub struct TracingGuard {
    provider: Option<SdkTracerProvider>,
}

impl TracingGuard {
    /// Exports what is buffered and stops the exporter.
    pub fn shutdown(mut self) -> Result<(), TracingError> {
        match self.provider.take() {
            Some(p) => p.shutdown().map_err(|e| TracingError::Flush(e.to_string())),
            None => Ok(()),
        }
    }
}

impl Drop for TracingGuard {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take()
            && let Err(e) = p.shutdown()
        {
            eprintln!("apron: flushing the last spans: {e}");
        }
    }
}

/// Installs the process's tracing subscriber: logs on stderr filtered by `filter`
/// (EnvFilter syntax; an invalid filter falls back to `info`), coloured when `ansi`
/// (the binary decides: a terminal, no `NO_COLOR`), and, with `otlp`, request
/// spans exported there. Call it once, inside the Tokio runtime (`runtime.enter()`)
/// when `otlp` is gRPC: the channel's connection task runs on it.
pub fn init_tracing(filter: &str, ansi: bool, otlp: Option<&OtlpTracing>) -> Result<TracingGuard, TracingError> {
    let (subscriber, guard) = build(filter, ansi, otlp)?;
    tracing::subscriber::set_global_default(subscriber).map_err(|e| TracingError::AlreadyInstalled(e.to_string()))?;
    // Libraries that log through the `log` crate (Ballista's scheduler and executor)
    // reach the same output; below info they are not even formatted.
    let _ = tracing_log::LogTracer::builder().with_max_level(log::LevelFilter::Info).init();
    Ok(guard)
}

fn env_filter(filter: &str) -> EnvFilter {
    EnvFilter::try_new(filter).unwrap_or_else(|_| EnvFilter::new("info"))
}

/// The subscriber [`init_tracing`] installs, without installing it (tests scope it to a
/// thread with `tracing::subscriber::set_default`).
pub fn build(
    filter: &str,
    ansi: bool,
    otlp: Option<&OtlpTracing>,
) -> Result<(impl tracing::Subscriber + Send + Sync + 'static, TracingGuard), TracingError> {
    let logs = tracing_subscriber::fmt::layer()
        .with_ansi(ansi)
        .with_writer(std::io::stderr)
        .with_filter(env_filter(filter).and(filter_fn(|m| m.target() != REQUEST_TARGET)));
    let (otel, guard) = match otlp {
        None => (None, TracingGuard::default()),
        Some(config) => {
            let provider = provider(config)?;
            let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("apron")).with_filter(
                Targets::new()
                    .with_target(REQUEST_TARGET, tracing::Level::TRACE)
                    .or(env_filter(filter))
                    .and(filter_fn(|m| !EXPORT_PATH.iter().any(|c| is_in(m.target(), c)))),
            );
            opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
            ENABLED.store(true, Ordering::Relaxed);
            (Some(layer), TracingGuard { provider: Some(provider) })
        }
    };
    Ok((Registry::default().with(logs).with(otel), guard))
}

/// Whether `target` is the crate `krate` or one of its modules.
fn is_in(target: &str, krate: &str) -> bool {
    target.strip_prefix(krate).is_some_and(|rest| rest.is_empty() || rest.starts_with("::") || rest.starts_with('_'))
}

fn provider(config: &OtlpTracing) -> Result<SdkTracerProvider, TracingError> {
    let setting = |setting: String, detail: String| TracingError::Setting { setting, detail };
    let endpoint = config.endpoint.trim_end_matches('/');
    if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
        return Err(setting(format!("endpoint {endpoint:?}"), "an http:// or https:// URL".into()));
    }
    let timeout = match &config.timeout {
        Some(t) => humantime::parse_duration(t).map_err(|e| setting(format!("timeout {t:?}"), e.to_string()))?,
        None => Duration::from_secs(10),
    };
    if !(0.0..=1.0).contains(&config.sample_ratio) {
        return Err(setting(format!("sample_ratio {}", config.sample_ratio), "between 0 and 1".into()));
    }
    let mut headers = axum::http::HeaderMap::new();
    for (k, v) in &config.headers {
        let name = axum::http::HeaderName::from_bytes(k.to_ascii_lowercase().as_bytes())
            .map_err(|e| setting(format!("header {k:?}"), e.to_string()))?;
        let value = axum::http::HeaderValue::from_str(v)
            .map_err(|_| setting(format!("header {k:?}"), "not a valid value".into()))?;
        headers.insert(name, value);
    }
    let exporter = match config.protocol {
        TraceProtocol::Grpc => {
            // The channel's connection task is spawned on the current runtime.
            if tokio::runtime::Handle::try_current().is_err() {
                return Err(TracingError::NoRuntime);
            }
            let mut b = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(endpoint)
                .with_timeout(timeout)
                .with_metadata(opentelemetry_otlp::tonic_types::metadata::MetadataMap::from_headers(headers));
            if endpoint.starts_with("https://") {
                b = b.with_tls_config(
                    opentelemetry_otlp::tonic_types::transport::ClientTlsConfig::new().with_webpki_roots(),
                );
            }
            b.build()
        }
        TraceProtocol::HttpProtobuf => {
            let url =
                if endpoint.ends_with("/v1/traces") { endpoint.to_owned() } else { format!("{endpoint}/v1/traces") };
            opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                .with_endpoint(url)
                .with_timeout(timeout)
                .with_headers(
                    config.headers.iter().map(|(k, v)| (k.to_ascii_lowercase(), v.clone())).collect::<HashMap<_, _>>(),
                )
                .build()
        }
    }
    .map_err(|e| TracingError::Exporter { endpoint: endpoint.to_owned(), detail: e.to_string() })?;
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name("apron")
        .with_attribute(opentelemetry::KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
        .build();
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(config.sample_ratio))))
        .with_resource(resource)
        .build())
}

/// Reads W3C trace context from request headers.
struct Headers<'a>(&'a axum::http::HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// Axum middleware: one server span per request (see the module docs). Add it with
/// `.layer(axum::middleware::from_fn(trace_request))` on the router whose routes it
/// should see (`MatchedPath` is set per route).
pub async fn trace_request(request: Request, next: Next) -> Response {
    if !ENABLED.load(Ordering::Relaxed) {
        return next.run(request).await;
    }
    let method = request.method().clone();
    let route = request.extensions().get::<MatchedPath>().map(|p| p.as_str().to_owned());
    let name = match &route {
        Some(r) => format!("{method} {r}"),
        None => method.to_string(),
    };
    let span = tracing::info_span!(
        target: REQUEST_TARGET,
        "request",
        otel.name = %name,
        otel.kind = "server",
        http.request.method = %method,
        http.route = tracing::field::Empty,
        url.path = %request.uri().path(),
        http.response.status_code = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    );
    if let Some(r) = &route {
        span.record("http.route", r.as_str());
    }
    let parent = TraceContextPropagator::new().extract(&Headers(request.headers()));
    // A request without (valid) trace context starts a trace; nothing to report.
    let _ = span.set_parent(parent);
    let response = next.run(request).instrument(span.clone()).await;
    let status = response.status();
    span.record("http.response.status_code", i64::from(status.as_u16()));
    if status.is_server_error() {
        span.record("otel.status_code", "error");
    }
    response
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::sync::{Arc, Mutex};

    use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
    use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
    use opentelemetry_proto::tonic::common::v1::{KeyValue, any_value};
    use opentelemetry_proto::tonic::trace::v1::{Span, span::SpanKind};
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;

    type Log = Arc<Mutex<Vec<ExportTraceServiceRequest>>>;

    struct Receiver(Log);

    #[tonic::async_trait]
    impl TraceService for Receiver {
        async fn export(
            &self,
            request: tonic::Request<ExportTraceServiceRequest>,
        ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
            self.0.lock().expect("lock").push(request.into_inner());
            Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
        }
    }

    /// A real OTLP/gRPC trace receiver on 127.0.0.1, port 0.
    async fn receiver() -> (SocketAddr, Log) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let log = Log::default();
        let service = TraceServiceServer::new(Receiver(log.clone()));
        tokio::spawn(async move {
            let incoming = tonic::transport::server::TcpIncoming::from(listener);
            let _ = tonic::transport::Server::builder().serve_with_incoming(service, incoming).await;
        });
        (addr, log)
    }

    fn str_attr<'a>(attrs: &'a [KeyValue], key: &str) -> Option<&'a str> {
        match attrs.iter().find(|a| a.key == key)?.value.as_ref()?.value.as_ref()? {
            any_value::Value::StringValue(s) => Some(s),
            _ => None,
        }
    }

    fn int_attr(attrs: &[KeyValue], key: &str) -> Option<i64> {
        match attrs.iter().find(|a| a.key == key)?.value.as_ref()?.value.as_ref()? {
            any_value::Value::IntValue(v) => Some(*v),
            _ => None,
        }
    }

    /// One GET through the middleware, over a real socket, with a caller's
    /// `traceparent`.
    async fn one_request(traceparent: &str) -> String {
        let app = axum::Router::new()
            .route("/api/v1/items/{id}", axum::routing::get(|| async { "ok" }))
            .layer(axum::middleware::from_fn(trace_request));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let req = format!(
            "GET /api/v1/items/42 HTTP/1.1\r\nHost: {addr}\r\ntraceparent: {traceparent}\r\nConnection: close\r\n\r\n"
        );
        s.write_all(req.as_bytes()).await.expect("write");
        let mut answer = String::new();
        s.read_to_string(&mut answer).await.expect("read");
        answer
    }

    fn spans(log: &Log) -> Vec<(Vec<KeyValue>, Span)> {
        log.lock()
            .expect("lock")
            .iter()
            .flat_map(|r| &r.resource_spans)
            .flat_map(|rs| {
                let resource = rs.resource.as_ref().map(|r| r.attributes.clone()).unwrap_or_default();
                rs.scope_spans.iter().flat_map(move |ss| {
                    ss.spans.iter().map({
                        let resource = resource.clone();
                        move |s| (resource.clone(), s.clone())
                    })
                })
            })
            .collect()
    }

    // Current-thread runtime: the subscriber is scoped to this thread, and every task
    // (the receiver, the app, the exporter's connection) runs on it.
    #[tokio::test]
    async fn a_request_span_reaches_an_otlp_grpc_receiver() {
        let (addr, log) = receiver().await;
        let (subscriber, guard) =
            build("info", false, Some(&OtlpTracing::new(format!("http://{addr}")))).expect("builds");
        let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
        let parent_id = "00f067aa0ba902b7";
        let answer = {
            let _scope = tracing::subscriber::set_default(subscriber);
            one_request(&format!("00-{trace_id}-{parent_id}-01")).await
        };
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        // Shutting down flushes the batch; it blocks, so off this thread.
        tokio::task::spawn_blocking(move || guard.shutdown()).await.expect("join").expect("flushed");

        let got = spans(&log);
        let (resource, span) = got.iter().find(|(_, s)| s.name == "GET /api/v1/items/{id}").unwrap_or_else(|| {
            panic!("no request span among {:?}", got.iter().map(|(_, s)| &s.name).collect::<Vec<_>>())
        });
        assert_eq!(str_attr(resource, "service.name"), Some("apron"));
        assert_eq!(span.kind, SpanKind::Server as i32);
        assert_eq!(str_attr(&span.attributes, "http.request.method"), Some("GET"));
        assert_eq!(str_attr(&span.attributes, "http.route"), Some("/api/v1/items/{id}"));
        assert_eq!(str_attr(&span.attributes, "url.path"), Some("/api/v1/items/42"));
        assert_eq!(int_attr(&span.attributes, "http.response.status_code"), Some(200));
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        assert_eq!(hex(&span.trace_id), trace_id, "the caller's trace continues");
        assert_eq!(hex(&span.parent_span_id), parent_id);
        assert!(span.end_time_unix_nano >= span.start_time_unix_nano && span.start_time_unix_nano > 0);
    }

    #[tokio::test]
    async fn a_request_span_reaches_an_otlp_http_receiver() {
        use prost::Message as _;
        let log = Log::default();
        let app = axum::Router::new()
            .route(
                "/v1/traces",
                axum::routing::post(
                    |axum::extract::State(log): axum::extract::State<Log>, body: axum::body::Bytes| async move {
                        let request = ExportTraceServiceRequest::decode(body).expect("an ExportTraceServiceRequest");
                        log.lock().expect("lock").push(request);
                        ExportTraceServiceResponse { partial_success: None }.encode_to_vec()
                    },
                ),
            )
            .with_state(log.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        let mut config = OtlpTracing::new(format!("http://{addr}"));
        config.protocol = TraceProtocol::HttpProtobuf;
        let (subscriber, guard) = build("info", false, Some(&config)).expect("builds");
        {
            let _scope = tracing::subscriber::set_default(subscriber);
            one_request("not a traceparent").await;
        }
        tokio::task::spawn_blocking(move || guard.shutdown()).await.expect("join").expect("flushed");
        let got = spans(&log);
        let (_, span) = got.iter().find(|(_, s)| s.name == "GET /api/v1/items/{id}").expect("the request span");
        assert!(span.parent_span_id.is_empty(), "no valid caller context: a root span");
        assert_eq!(int_attr(&span.attributes, "http.response.status_code"), Some(200));
    }

    #[test]
    fn bad_settings_are_refused_with_the_value() {
        let err = |t: OtlpTracing| build("info", false, Some(&t)).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err(OtlpTracing::new("collector:4317")).contains("collector:4317"));
        let mut t = OtlpTracing::new("http://c:4317");
        t.sample_ratio = 2.0;
        assert!(err(t).contains("sample_ratio"));
        let mut t = OtlpTracing::new("http://c:4317");
        t.timeout = Some("soon".into());
        assert!(err(t).contains("soon"));
        let t: OtlpTracing = toml::from_str(
            "endpoint = \"http://c:4318\"\nprotocol = \"http/protobuf\"\n[headers]\nx-key = \"s3cret\"\n",
        )
        .expect("parses");
        assert_eq!(t.protocol, TraceProtocol::HttpProtobuf);
        assert!(!format!("{t:?}").contains("s3cret"), "Debug hides header values");
        assert!(toml::from_str::<OtlpTracing>("endpoint = \"x\"\nendpont = \"y\"\n").is_err(), "unknown keys");
    }
}
