//! The export loop: its own thread and single-threaded runtime (so neither a slow
//! receiver nor TLS handshakes touch `/metrics`), one request per interval, one last
//! request at stop.
//!
//! A failed request is not retried: the next one, an interval later, carries the state
//! of that moment, and every sum is cumulative from the agent's start, so nothing is
//! lost but the resolution of the gauges in between. The first failure of a run of
//! failures is logged as a warning with its reason, the recovery as info.

use std::time::Duration;

use apron_common::UnixMicros;
use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_client::MetricsServiceClient;
use opentelemetry_proto::tonic::collector::metrics::v1::{ExportMetricsServiceRequest, ExportMetricsServiceResponse};
use prost::Message as _;
use tonic::metadata::{AsciiMetadataValue, MetadataKey, MetadataMap};
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};

use super::metrics::{count_points, snapshot};
use super::{OtlpConfig, Protocol};
use crate::exposition::SharedState;

/// Answers longer than this are not read (an OTLP answer is a few bytes).
const MAX_ANSWER: u64 = 64 * 1024;

/// A running exporter; [`OtlpExporter::stop`] sends the last state and ends it.
pub struct OtlpExporter {
    stop: tokio::sync::watch::Sender<bool>,
    handle: std::thread::JoinHandle<()>,
    timeout: Duration,
}

impl std::fmt::Debug for OtlpExporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OtlpExporter").finish_non_exhaustive()
    }
}

impl OtlpExporter {
    /// Asks for one last export and waits for it, at most one request timeout (plus a
    /// second). Call it after the samplers stopped, so the last windows go out.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        let handle = self.handle;
        let joined = tokio::task::spawn_blocking(move || handle.join());
        if tokio::time::timeout(self.timeout + Duration::from_secs(1), joined).await.is_err() {
            tracing::warn!("the OTLP exporter did not finish its last export in time");
        }
    }
}

/// The body of an OTLP/HTTP error answer (`google.rpc.Status`), as far as it is read.
#[derive(Clone, PartialEq, prost::Message)]
struct RpcStatus {
    #[prost(int32, tag = "1")]
    code: i32,
    #[prost(string, tag = "2")]
    message: String,
}

enum Transport {
    Grpc { client: MetricsServiceClient<Channel>, metadata: MetadataMap, timeout: Duration },
    Http { agent: ureq::Agent, url: String, headers: Vec<(String, String)> },
}

/// What the receiver said about a request it took.
fn partial(answer: &ExportMetricsServiceResponse) -> Option<String> {
    let p = answer.partial_success.as_ref()?;
    (p.rejected_data_points > 0 || !p.error_message.is_empty())
        .then(|| format!("{} data points rejected: {}", p.rejected_data_points, p.error_message))
}

/// Why one export request failed (logged; the next interval sends the state afresh).
#[derive(Debug, thiserror::Error)]
enum ExportError {
    #[error("gRPC {code:?}: {message}")]
    Grpc { code: tonic::Code, message: String },
    #[error("{0} ({kind:?})", kind = .0.kind())]
    Io(std::io::Error),
    #[error("timed out ({0:?})")]
    Timeout(ureq::Timeout),
    #[error("{0}")]
    Http(ureq::Error),
    #[error("HTTP {status}{}", if message.is_empty() { String::new() } else { format!(": {message}") })]
    Status { status: u16, message: String },
}

impl Transport {
    async fn export(&mut self, request: ExportMetricsServiceRequest) -> Result<Option<String>, ExportError> {
        match self {
            Transport::Grpc { client, metadata, timeout } => {
                let mut r = tonic::Request::new(request);
                *r.metadata_mut() = metadata.clone();
                r.set_timeout(*timeout);
                match client.export(r).await {
                    Ok(answer) => Ok(partial(answer.get_ref())),
                    Err(status) => Err(ExportError::Grpc { code: status.code(), message: status.message().to_owned() }),
                }
            }
            Transport::Http { agent, url, headers } => {
                let mut r = agent.post(url.as_str()).header("content-type", "application/x-protobuf");
                for (k, v) in headers.iter() {
                    r = r.header(k.as_str(), v.as_str());
                }
                // ureq blocks this thread, which is the exporter's own.
                let mut answer = r.send(&request.encode_to_vec()[..]).map_err(|e| match e {
                    ureq::Error::Io(io) => ExportError::Io(io),
                    ureq::Error::Timeout(t) => ExportError::Timeout(t),
                    other => ExportError::Http(other),
                })?;
                let status = answer.status().as_u16();
                let body = answer.body_mut().with_config().limit(MAX_ANSWER).read_to_vec().unwrap_or_default();
                if (200..300).contains(&status) {
                    Ok(ExportMetricsServiceResponse::decode(&body[..]).ok().as_ref().and_then(partial))
                } else {
                    let message = RpcStatus::decode(&body[..]).map(|s| s.message).unwrap_or_default();
                    Err(ExportError::Status { status, message })
                }
            }
        }
    }
}

/// Why OTLP export cannot start: a setting only the transport's own types can check.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("otlp.endpoint {url:?}: {detail}")]
    Endpoint { url: String, detail: String },
    #[error("otlp.headers.{key}: {detail}")]
    Header { key: String, detail: String },
    #[error("cannot start the OTLP export thread: {0}")]
    Thread(std::io::Error),
}

/// Validates what can only be checked with the transport's own types.
fn grpc_parts(config: &OtlpConfig) -> Result<(Endpoint, MetadataMap), StartError> {
    let endpoint_error = |detail: String| StartError::Endpoint { url: config.url.clone(), detail };
    let mut endpoint = Endpoint::from_shared(config.url.clone())
        .map_err(|e| endpoint_error(e.to_string()))?
        .timeout(config.timeout)
        .connect_timeout(config.timeout)
        .user_agent(concat!("apron-agent/", env!("CARGO_PKG_VERSION")))
        .map_err(|e| endpoint_error(format!("user agent: {e}")))?;
    if config.url.starts_with("https://") {
        endpoint = endpoint
            .tls_config(ClientTlsConfig::new().with_webpki_roots())
            .map_err(|e| endpoint_error(format!("TLS: {e}")))?;
    }
    let mut metadata = MetadataMap::new();
    for (k, v) in &config.headers {
        let header_error = |detail: String| StartError::Header { key: k.clone(), detail };
        let key = MetadataKey::from_bytes(k.as_bytes()).map_err(|e| header_error(e.to_string()))?;
        let value = AsciiMetadataValue::try_from(v.as_str()).map_err(|e| header_error(e.to_string()))?;
        metadata.append(key, value);
    }
    Ok((endpoint, metadata))
}

/// Starts exporting `state` every `config.interval`. `agent_host` is the agent's own
/// host name (`service.instance.id`).
pub fn start(config: &OtlpConfig, state: SharedState, agent_host: &str) -> Result<OtlpExporter, StartError> {
    let grpc = match config.protocol {
        Protocol::Grpc => Some(grpc_parts(config)?),
        Protocol::HttpProtobuf => None,
    };
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let (config, agent_host) = (config.clone(), agent_host.to_owned());
    let timeout = config.timeout;
    let handle = std::thread::Builder::new()
        .name("otlp".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(rt) => rt,
                Err(e) => {
                    tracing::error!("OTLP export is off: cannot start its runtime: {e}");
                    return;
                }
            };
            rt.block_on(async move {
                let mut transport = match grpc {
                    // The channel connects on first use, and again after a failure.
                    Some((endpoint, metadata)) => Transport::Grpc {
                        client: MetricsServiceClient::new(endpoint.connect_lazy()),
                        metadata,
                        timeout: config.timeout,
                    },
                    None => Transport::Http {
                        agent: ureq::Agent::config_builder()
                            .timeout_global(Some(config.timeout))
                            .http_status_as_error(false)
                            .proxy(None)
                            .user_agent(concat!("apron-agent/", env!("CARGO_PKG_VERSION")))
                            .build()
                            .into(),
                        url: config.url.clone(),
                        headers: config.headers.clone(),
                    },
                };
                tracing::info!(
                    protocol = config.protocol.name(),
                    interval = %humantime::format_duration(config.interval),
                    "exporting metrics over OTLP to {}",
                    config.url
                );
                let mut ticks =
                    tokio::time::interval_at(tokio::time::Instant::now() + config.interval, config.interval);
                ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let mut failing = false;
                loop {
                    let last = tokio::select! {
                        _ = ticks.tick() => false,
                        _ = stopped.changed() => true,
                    };
                    let request = {
                        let st = state.lock();
                        snapshot(&st, &agent_host, UnixMicros::now())
                    };
                    if !request.resource_metrics.is_empty() {
                        let points = count_points(&request);
                        match transport.export(request).await {
                            Ok(rejected) => {
                                if failing {
                                    tracing::info!("OTLP export to {} works again", config.url);
                                    failing = false;
                                }
                                if let Some(r) = rejected {
                                    tracing::warn!("the OTLP receiver {} took the export partially: {r}", config.url);
                                } else {
                                    tracing::debug!(points, "OTLP export done");
                                }
                            }
                            Err(e) if !failing => {
                                tracing::warn!("OTLP export to {} failed: {e} (retried every interval)", config.url);
                                failing = true;
                            }
                            Err(e) => tracing::debug!("OTLP export to {} failed again: {e}", config.url),
                        }
                    }
                    if last {
                        break;
                    }
                }
            });
        })
        .map_err(StartError::Thread)?;
    Ok(OtlpExporter { stop, handle, timeout })
}
