//! `apron-agent`: the node agent.
//!
//! Data flow, left to right:
//!
//! ```text
//!  GpuSource (nvml | sim) ──► one Sampler per field group, each on its own thread and interval
//!        │                          │ Readings (value + the time it describes)
//!        │                          ▼
//!  Attributor (procfs, Slurm,   Aggregator: epoch-aligned windows (default 1 s),
//!  kubelet pod-resources)       mean/min/max/last per field, busy time integrated
//!        │                          │ closed GpuWindow rows
//!        └──── processes ──────────►▼
//!                              AgentState ──► /metrics (OpenMetrics, scrape-time encoding)
//!                                   └───────► sinks: JSON lines (debugging)
//!                                                    ShipperSink ─► shipper thread ─► collector
//!                                                                         └─► on-disk spool
//! ```
//!
//! - [`config`]: TOML file + overrides → [`config::AgentConfig`].
//! - [`source`]: the [`source::GpuSource`] trait and its two implementations.
//! - [`sampler`]: the [`sampler::Sampler`] seam and the field groups.
//! - [`window`]: readings → windows.
//! - [`exposition`]: the metric families.
//! - [`runtime`]: sampler threads and the aggregation loop.
//! - [`server`]: `GET /metrics`, `GET /healthz`.
//! - [`attribution`]: PID → container, pod, Slurm job, user.
//! - [`ship`]: Arrow IPC batches to the collector's `POST /api/v1/ingest`, with retries
//!   and a bounded on-disk spool (`docs/ingest.md`).
//! - [`otlp`]: the same state pushed to an OpenTelemetry endpoint (feature `otlp`,
//!   `docs/otlp.md`).
//!
//! The library never reads the environment; `main.rs` does, and calls [`run`].

pub mod attribution;
pub mod config;
pub mod exposition;
pub mod otlp;
pub mod runtime;
pub mod sampler;
pub mod selfstats;
pub mod server;
pub mod ship;
pub mod source;
pub mod window;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use apron_common::UnixMicros;

use crate::attribution::{Attributor, RealHost};
use crate::config::{AgentConfig, SourceKind};
use crate::exposition::{AgentState, SharedState};
use crate::runtime::{Aggregation, JsonLinesSink, Stop, WindowSink};
use crate::sampler::FieldGroup;
use crate::source::GpuSource;
use crate::window::Aggregator;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Nvml(#[from] source::nvml::NvmlSourceError),
    #[error(transparent)]
    Sim(#[from] source::sim::SimError),
    #[error("cannot open the windows file {path}: {source}")]
    WindowsOut { path: std::path::PathBuf, source: std::io::Error },
    #[error("cannot start a thread: {0}")]
    Thread(std::io::Error),
    #[error("HTTP server failed: {0}")]
    Serve(std::io::Error),
    #[error(transparent)]
    Ship(#[from] ship::ShipError),
    #[cfg(feature = "otlp")]
    #[error("[otlp]: {0}")]
    Otlp(otlp::StartError),
    #[cfg(feature = "kubernetes")]
    #[error("[attribution.kubernetes]: {0}")]
    Kubernetes(#[from] attribution::kube::KubeError),
}

/// Opens the configured GPU source: NVML or the simulator.
pub fn open_source(config: &AgentConfig) -> Result<Box<dyn GpuSource>, AgentError> {
    Ok(match config.source {
        SourceKind::Nvml => Box::new(source::nvml::NvmlSource::open(
            config.nvml_lib.as_deref(),
            &config.hostname,
            config.cluster.as_ref(),
            config.window,
        )?),
        SourceKind::Sim => Box::new(source::sim::SimSource::new(&config.sim, config.cluster.clone())?),
    })
}

/// Starts listing this node's pods for their labels, where `[attribution.kubernetes]`
/// names an API server (the binary fills in the in-cluster one).
#[cfg(feature = "kubernetes")]
#[allow(clippy::type_complexity)]
fn start_pod_labels(
    config: &AgentConfig,
    state: &SharedState,
) -> Result<Option<(Arc<attribution::kube::PodLabels>, std::thread::JoinHandle<()>)>, AgentError> {
    let k = &config.attribution.kubernetes;
    let Some(api_server) = k.api_server.as_deref().filter(|_| k.enabled) else { return Ok(None) };
    let node = k.node_name.clone().unwrap_or_else(|| config.hostname.to_string());
    let lister = attribution::kube::PodLister::new(k, api_server, &node)?;
    let started = attribution::kube::PodLabels::start(lister, k.refresh, state.clone()).map_err(AgentError::Thread)?;
    Ok(Some(started))
}

/// How long a window stays open after its end for readings that arrive late.
///
/// The latest reading is a zero-filled idle slot of the driver's sample buffer: the
/// slot ends up to one driver period (1/6 s on data-centre parts; allow two) before it is
/// certain, and the utilisation sampler notices at its next tick. A window closing before
/// then would drop those readings (and bias idle means upwards).
fn lateness(config: &AgentConfig) -> Duration {
    const DRIVER_PERIODS: Duration = Duration::from_millis(2 * 167);
    const MARGIN: Duration = Duration::from_millis(100);
    let util = config.intervals.get(&FieldGroup::Utilization).copied().unwrap_or(Duration::from_millis(100));
    (util + DRIVER_PERIODS + MARGIN).clamp(Duration::from_millis(250), Duration::from_secs(5))
}

/// Runs the agent until `shutdown` resolves: samplers, windows, and the HTTP server on
/// `listener`.
pub async fn run(
    config: AgentConfig,
    source: Box<dyn GpuSource>,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), AgentError> {
    let inventory = source.inventory().to_vec();
    let state = SharedState::new(AgentState::new(source.kind(), source.driver_version(), &inventory));
    #[cfg(feature = "kubernetes")]
    let mut kube_labels = None;
    let host_view = match source.host_view() {
        Some(view) => view,
        None => {
            #[allow(unused_mut)]
            let mut host = RealHost::new(&config.attribution);
            #[cfg(feature = "kubernetes")]
            if let Some(labels) = start_pod_labels(&config, &state)? {
                host = host.with_pod_labels(labels.0.clone());
                kube_labels = Some(labels);
            }
            Box::new(host)
        }
    };
    let attribution = Arc::new(Attributor::new(&config.attribution, host_view));

    let mut samplers = Vec::new();
    for (&group, &interval) in &config.intervals {
        if let Some(s) = source.sampler(group, &attribution) {
            samplers.push((s, interval));
        }
    }
    let mut sinks: Vec<Box<dyn WindowSink>> = Vec::new();
    if let Some(path) = &config.windows_out {
        let sink =
            JsonLinesSink::create(path).map_err(|source| AgentError::WindowsOut { path: path.clone(), source })?;
        sinks.push(Box::new(sink));
    }
    let mut shipper = None;
    if let Some(ship_config) = &config.shipper {
        let (sink, handle) = ship::start(ship_config, state.clone())?;
        sinks.push(Box::new(sink));
        shipper = Some((handle, ship_config.request_timeout));
    }
    let aggregation = Aggregation {
        aggregator: {
            let a = Aggregator::new(inventory.clone(), config.window, lateness(&config)).starting_at(UnixMicros::now());
            // With process sampling on, the first windows wait (up to three of its
            // intervals) for attribution's first answer.
            match config.intervals.get(&FieldGroup::Processes) {
                Some(every) => a.awaiting_owners(*every * 3),
                None => a,
            }
        },
        state: state.clone(),
        attribution,
        sinks,
        intervals: config.intervals.iter().map(|(g, i)| (*g, *i)).collect(),
    };
    tracing::info!(
        source = source.kind(),
        gpus = inventory.len(),
        driver = source.driver_version().as_deref().unwrap_or("-"),
        window = %humantime::format_duration(config.window),
        "sampling {}",
        inventory.iter().map(|g| g.gpu_uuid.as_str()).collect::<Vec<_>>().join(", ")
    );
    #[cfg(feature = "otlp")]
    let otlp = match &config.otlp {
        Some(c) => Some(otlp::start(c, state.clone(), config.hostname.as_str()).map_err(AgentError::Otlp)?),
        None => None,
    };
    let stop = Stop::default();
    let handles = runtime::start(samplers, aggregation, stop.clone()).map_err(AgentError::Thread)?;

    let served = server::serve(listener, state, &config.http, shutdown).await;
    stop.stop();
    // Samplers finish their current call (bounded by NVML's own latency) and exit.
    let joined = tokio::task::spawn_blocking(move || {
        for h in handles {
            let _ = h.join();
        }
    });
    let _ = tokio::time::timeout(Duration::from_secs(5), joined).await;
    #[cfg(feature = "otlp")]
    if let Some(exporter) = otlp {
        // After the samplers: the last export carries the last windows.
        exporter.stop().await;
    }
    #[cfg(feature = "kubernetes")]
    if let Some((labels, _handle)) = kube_labels {
        // The thread ends at its next wake-up; a list in flight is bounded by its timeout
        // and is not waited for.
        labels.stop();
    }
    if let Some((handle, request_timeout)) = shipper {
        // The aggregation thread dropped the sink on its way out, which closed the
        // channel: the shipper sends (or spools) the last batches and exits. One request
        // timeout bounds it, plus time for the spool writes.
        let joined = tokio::task::spawn_blocking(move || handle.join());
        if tokio::time::timeout(request_timeout + Duration::from_secs(5), joined).await.is_err() {
            tracing::warn!("the shipper did not finish in time; unsent batches of this run may be lost");
        }
    }
    drop(source);
    served.map_err(AgentError::Serve)
}
