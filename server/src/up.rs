//! `apron up`: the all-in-one server on one machine.
//!
//! ```text
//!  Up::start: refuse non-loopback → bind HTTP → Store::open(<data>) (first start? hook)
//!             → random ingest token → GPU source: nvml, else sim (and why)
//!             → bind the agent's /metrics on 127.0.0.1:0
//!  Up::run:   write <data>/endpoints.json (atomically) → agent ──HTTP ingest──► server
//!             shutdown: agent first (its last batches ship), then the server drains and
//!             persists
//! ```
//!
//! The agent is the `apron-agent` library, configured as a file would configure it, and
//! ships through the same `POST /api/v1/ingest` as a remote agent, with a token made at
//! start and known to nobody else. Its spool is `<data>/agent-spool`.

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use apron_agent::AgentError;
use apron_agent::config::{AgentConfig, FileConfig as AgentFile, Overrides as AgentOverrides, SourceKind};
use apron_agent::source::GpuSource;
use apron_agent::source::nvml::NvmlSourceError;
use apron_agent::source::sim::SimSource;
use apron_collector::http::IngestOptions;
use apron_collector::{Store, StoreConfig};
use apron_common::UnixMicros;
use serde::Serialize;

use crate::{Server, ServerError};

/// The default `--data`.
pub const DEFAULT_DATA_DIR: &str = "./apron-data";
/// The default `--http`.
pub const DEFAULT_HTTP: &str = "127.0.0.1:9402";
/// How often the in-process agent ships: short, so new data shows within seconds.
const AGENT_FLUSH_INTERVAL: &str = "2s";
/// The price book `apron up` prices with when it has no other: example figures.
pub const EXAMPLE_PRICE_BOOK: &str = "pricebook.example.toml";
const EXAMPLE_PRICES: &str = include_str!("../../deploy/pricebook.example.toml");
/// The simulated fleet's team maps.
const SIM_TEAMS: &str = include_str!("../../deploy/teams.sim.toml");

/// What `apron up` was asked for.
#[derive(Debug, Clone)]
pub struct UpOptions {
    pub http: SocketAddr,
    pub data_dir: PathBuf,
    /// `--pg`: the PostgreSQL wire address, loopback only (user `apron`, no password).
    pub pg: SocketAddr,
    /// The host name the agent reports for NVML GPUs (the simulator names its own).
    pub hostname: String,
    /// On a new data directory with the simulator: how much history to generate first
    /// (zero: none).
    pub backfill: Duration,
}

/// The URLs `apron up` serves, as written to `endpoints.json`.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Endpoints {
    pub http: String,
    pub metrics: String,
    pub ingest: String,
    pub agent_metrics: String,
    /// `postgresql://apron@127.0.0.1:5433/apron`
    pub postgres: String,
}

/// Which GPU source the agent runs, and why.
#[derive(Debug, Clone)]
pub struct SourceChoice {
    pub kind: SourceKind,
    pub gpus: usize,
    /// Why NVML was not used, when the simulator runs instead.
    pub fallback_reason: Option<String>,
}

/// A started `apron up`: bound, store open, source chosen; [`Up::run`] serves.
pub struct Up {
    server: Server,
    listener: tokio::net::TcpListener,
    agent_listener: tokio::net::TcpListener,
    agent_config: AgentConfig,
    source: Box<dyn GpuSource>,
    choice: SourceChoice,
    endpoints: Endpoints,
    data_dir: PathBuf,
    first_start: bool,
    backfill: Duration,
}

impl std::fmt::Debug for Up {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Up").field("endpoints", &self.endpoints).field("data_dir", &self.data_dir).finish()
    }
}

impl Up {
    pub async fn start(options: UpOptions) -> Result<Up, ServerError> {
        for addr in [options.http, options.pg] {
            if !addr.ip().is_loopback() {
                return Err(ServerError::NotLoopback(addr));
            }
        }
        let data_dir = options.data_dir.clone();
        std::fs::create_dir_all(&data_dir)
            .map_err(|source| ServerError::Io { what: format!("cannot create {}", data_dir.display()), source })?;
        let listener = tokio::net::TcpListener::bind(options.http)
            .await
            .map_err(|source| ServerError::Io { what: format!("cannot listen on {}", options.http), source })?;
        let addr = listener.local_addr().map_err(ServerError::Serve)?;
        let pg_listener = tokio::net::TcpListener::bind(options.pg).await.map_err(|source| ServerError::Io {
            what: format!(
                "cannot listen on {} for PostgreSQL clients (--pg ADDR; port 0 picks a free one)",
                options.pg
            ),
            source,
        })?;
        let pg_addr = pg_listener.local_addr().map_err(ServerError::Serve)?;

        // The store creates its WAL directory on first open: none yet is a new store.
        let first_start = !data_dir.join("wal").exists();
        let token = random_token()?;
        let store_config = StoreConfig { data_dir: data_dir.clone(), ..StoreConfig::default() };
        let ingest = IngestOptions { tokens: vec![token.clone()], ..IngestOptions::default() };
        let server = tokio::task::spawn_blocking(move || {
            Server::open(store_config, ingest, apron_query::QueryConfig::default(), crate::Access::Loopback)
        })
        .await
        .map_err(|e| ServerError::Task(e.to_string()))??;

        let agent_listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|source| ServerError::Io { what: "cannot listen for the agent's /metrics".into(), source })?;
        let agent_addr = agent_listener.local_addr().map_err(ServerError::Serve)?;
        let (agent_config, source, choice) = open_agent(&options, &data_dir, addr, agent_addr, token)?;
        // Dollars from the first run: the example price book, written next to the data
        // (and said so in every report it prices).
        let book = data_dir.join(EXAMPLE_PRICE_BOOK);
        if !book.exists() {
            std::fs::write(&book, EXAMPLE_PRICES)
                .map_err(|source| ServerError::Io { what: format!("cannot write {}", book.display()), source })?;
        }
        let mut cost = crate::ledger::CostConfig {
            price_book: Some(book),
            interval: std::time::Duration::from_secs(60),
            ..crate::ledger::CostConfig::default()
        };
        if choice.kind == SourceKind::Sim {
            // The simulated organisation: its namespaces and Slurm accounts → teams.
            cost.teams = apron_cost::TeamConfig::from_toml(SIM_TEAMS).map_err(|e| ServerError::Cost(e.to_string()))?;
        }
        let server = server
            .with_cost(cost)?
            .with_alerts(crate::alerts::AlertsConfig::default())
            .with_recommend(crate::recommend::RecommendSettings::default())
            .with_pg(pg_listener, crate::pg::PgAuth::Trust { user: crate::pg::UP_USER.to_owned() }, None);

        let http = format!("http://{addr}");
        let endpoints = Endpoints {
            metrics: format!("{http}/metrics"),
            ingest: format!("{http}{}", apron_collector::http::INGEST_PATH),
            agent_metrics: format!("http://{agent_addr}/metrics"),
            postgres: format!("postgresql://{}@{pg_addr}/apron", crate::pg::UP_USER),
            http,
        };
        Ok(Up {
            server,
            listener,
            agent_listener,
            agent_config,
            source,
            choice,
            endpoints,
            data_dir,
            first_start,
            backfill: options.backfill,
        })
    }

    pub fn endpoints(&self) -> &Endpoints {
        &self.endpoints
    }

    pub fn source(&self) -> &SourceChoice {
        &self.choice
    }

    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    pub fn first_start(&self) -> bool {
        self.first_start
    }

    /// Serves until `shutdown` resolves; then stops the agent (which ships its last
    /// batches), drains the server and persists.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<(), ServerError> {
        // The history is seeded in the background: SQL, /metrics and the agent serve at
        // once (the first answers grow as the seed lands), so a first start answers SQL
        // within seconds whatever the backfill span.
        let mut seeding = None;
        if self.first_start {
            on_first_start(self.server.store(), &self.choice);
            if self.choice.kind == SourceKind::Sim && !self.backfill.is_zero() {
                let sim = SimSource::new(&self.agent_config.sim, self.agent_config.cluster.clone())
                    .map_err(|e| ServerError::Agent(e.to_string()))?;
                let (store, span, window) = (self.server.store().clone(), self.backfill, self.agent_config.window);
                println!(
                    "  seeding        the last {} of simulated history (in the background)…",
                    humantime::format_duration(span)
                );
                let ledger = self.server.ledger().cloned();
                let recommender = self.server.recommender().cloned();
                seeding = Some(tokio::task::spawn_blocking(move || {
                    match crate::backfill::run(&store, &sim, UnixMicros::now(), span, window) {
                        Ok(done) => {
                            println!("  seeded         {} GPU windows, {} process rows", done.windows, done.processes);
                            // Price the seeded history now rather than at the next tick.
                            if let Some(l) = ledger {
                                l.kick();
                            }
                            if let Some(r) = recommender {
                                r.kick();
                            }
                        }
                        Err(e) => tracing::error!("seeding simulated history failed: {e}"),
                    }
                }));
            }
        }
        write_endpoints(&self.data_dir, &self.endpoints)?;

        let (stop_agent, agent_stopped) = tokio::sync::oneshot::channel::<()>();
        let grace = self.agent_config.shipper.as_ref().map_or(Duration::ZERO, |s| s.request_timeout);
        let agent = tokio::spawn(async move {
            let shutdown = async move {
                let _ = agent_stopped.await;
            };
            if let Err(e) = apron_agent::run(self.agent_config, self.source, self.agent_listener, shutdown).await {
                tracing::error!("the in-process agent stopped: {e}");
            }
        });
        let server_shutdown = async move {
            shutdown.await;
            tracing::info!("stopping the in-process agent; its last batches ship first");
            let _ = stop_agent.send(());
            // The agent bounds its own shutdown (samplers, then one request timeout for
            // the shipper); this is only a backstop.
            if tokio::time::timeout(grace + Duration::from_secs(15), agent).await.is_err() {
                tracing::warn!("the in-process agent did not stop in time; its unsent batches stay in its spool");
            }
        };
        let served = self.server.run(self.listener, server_shutdown).await;
        if let Some(s) = seeding {
            // A seed still running at shutdown finishes (its rows are acknowledged into
            // the WAL batch by batch; the rest would be missing history, not lost data).
            let _ = s.await;
        }
        served
    }
}

/// Runs once, when `apron up` finds no store in its data directory, after the store is
/// open and before the agent starts: the place for work that only a new installation
/// needs, such as seeding history. Today it only records the event.
fn on_first_start(store: &Store, choice: &SourceChoice) {
    tracing::info!(
        data_dir = %store.data_dir().display(),
        source = source_name(choice.kind),
        "first start: created a new data directory"
    );
}

fn source_name(kind: SourceKind) -> &'static str {
    match kind {
        SourceKind::Nvml => "nvml",
        SourceKind::Sim => "sim",
    }
}

/// The agent's configuration as `apron up` sets it, and its source: NVML, or the
/// simulator when NVML has no library, no driver or no GPU.
fn open_agent(
    options: &UpOptions,
    data_dir: &Path,
    server: SocketAddr,
    agent_listen: SocketAddr,
    token: String,
) -> Result<(AgentConfig, Box<dyn GpuSource>, SourceChoice), ServerError> {
    let mut file = AgentFile::default();
    file.shipper.spool_dir = Some(data_dir.join("agent-spool"));
    file.shipper.flush_interval = Some(AGENT_FLUSH_INTERVAL.to_owned());
    let overrides = AgentOverrides {
        source: Some(SourceKind::Nvml),
        listen: Some(agent_listen.to_string()),
        collector: Some(format!("http://{server}")),
        collector_token: Some(token),
        hostname: Some(options.hostname.clone()),
        ..AgentOverrides::default()
    };
    let mut config = file.resolve(overrides, &options.hostname).map_err(|e| ServerError::Agent(e.to_string()))?;
    let (source, fallback_reason) = match apron_agent::open_source(&config) {
        Ok(s) => (s, None),
        Err(AgentError::Nvml(
            e @ (NvmlSourceError::Load { .. } | NvmlSourceError::Init { .. } | NvmlSourceError::NoGpus { .. }),
        )) => {
            config.source = SourceKind::Sim;
            let s = apron_agent::open_source(&config).map_err(|e| ServerError::Agent(e.to_string()))?;
            // The agent's message ends with advice for its own command line; keep the cause.
            let reason = e.to_string();
            let reason = reason.split(". ").next().unwrap_or(&reason).trim_end_matches('.').to_owned();
            (s, Some(reason))
        }
        Err(e) => return Err(ServerError::Agent(e.to_string())),
    };
    let choice = SourceChoice { kind: config.source, gpus: source.inventory().len(), fallback_reason };
    Ok((config, source, choice))
}

/// 32 random bytes, hex: the ingest token of this run.
fn random_token() -> Result<String, ServerError> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|e| ServerError::Io {
        what: "cannot generate the ingest token".into(),
        source: std::io::Error::other(e.to_string()),
    })?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Writes `<data>/endpoints.json` so that a reader sees the old file or the new one,
/// never a part: temp file, fsync, rename, fsync the directory.
fn write_endpoints(data_dir: &Path, endpoints: &Endpoints) -> Result<(), ServerError> {
    let path = data_dir.join("endpoints.json");
    let io =
        |what: &str, source: std::io::Error| ServerError::Io { what: format!("{what} {}", path.display()), source };
    let mut text = serde_json::to_string_pretty(endpoints).map_err(|e| io("cannot encode", e.into()))?;
    text.push('\n');
    apron_collector::write_atomic(&path, text.as_bytes()).map_err(|e| io("cannot write", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_random_hex() {
        let a = random_token().expect("token");
        let b = random_token().expect("token");
        assert_eq!(a.len(), 64);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }

    #[test]
    fn endpoints_are_replaced_atomically() {
        let dir = tempfile::tempdir().expect("tempdir");
        let e = Endpoints {
            http: "http://127.0.0.1:1".into(),
            metrics: "http://127.0.0.1:1/metrics".into(),
            ingest: "http://127.0.0.1:1/api/v1/ingest".into(),
            agent_metrics: "http://127.0.0.1:2/metrics".into(),
            postgres: "postgresql://apron@127.0.0.1:3/apron".into(),
        };
        write_endpoints(dir.path(), &e).expect("write");
        write_endpoints(dir.path(), &e).expect("replace");
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.path().join("endpoints.json")).expect("read"))
                .expect("json");
        assert_eq!(v["agent_metrics"], "http://127.0.0.1:2/metrics");
        assert!(!dir.path().join(".endpoints.json.tmp").exists());
    }

    #[tokio::test]
    async fn up_refuses_non_loopback_addresses() {
        let o = UpOptions {
            http: "0.0.0.0:0".parse().expect("addr"),
            data_dir: "/nonexistent".into(),
            pg: "127.0.0.1:0".parse().expect("addr"),
            hostname: "h".into(),
            backfill: Duration::ZERO,
        };
        let e = Up::start(o.clone()).await.expect_err("refused");
        assert!(e.to_string().contains("loopback"), "{e}");
        // The PostgreSQL port too.
        let o =
            UpOptions { http: "127.0.0.1:0".parse().expect("addr"), pg: "0.0.0.0:5433".parse().expect("addr"), ..o };
        let e = Up::start(o).await.expect_err("refused");
        assert!(e.to_string().contains("0.0.0.0:5433"), "{e}");
    }
}
