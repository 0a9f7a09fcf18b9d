//! `apron up`: the all-in-one server on one machine.
//!
//! ```text
//!  Up::start: refuse non-loopback → bind HTTP → Store::open(<data>) (first start? hook)
//!             → random ingest token → GPU source (--source): auto = nvml, else sim;
//!               sim only where no other data is (a host in gpu_samples that is not
//!               the simulator's: sim refused, auto runs without an agent); none
//!             → bind the agent's /metrics on 127.0.0.1:0
//!             → --config: apron serve's sections about computing ([storage] but --data,
//!               [query], [rollup], [cost], [report], [alerts], [recommend], [[scrape]])
//!  Up::run:   seed (sim, first start) → kick the ledger, recommender and alerts
//!             → write <data>/endpoints.json (atomically) → agent ──HTTP ingest──► server
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

/// `apron up --source`: where the in-process agent's GPUs come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum UpSource {
    /// NVML when it finds a GPU, else the simulator (in a data directory of its own).
    Auto,
    /// NVML only: no GPU is an error.
    Nvml,
    /// The simulated fleet; refused in a data directory that holds other data.
    Sim,
    /// No agent: browse imported history, or what `[[scrape]]` targets send.
    None,
}

/// What `apron up` was asked for.
#[derive(Debug)]
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
    pub source: UpSource,
    /// `--config`: `apron serve`'s file. `apron up` takes the sections that describe
    /// what is computed — `[storage]` (but `--data`), `[query]`, `[rollup]`, `[cost]`,
    /// `[report]`, `[alerts]`, `[recommend]`, `[[scrape]]` — and ignores those about
    /// listening and credentials (it serves loopback only, without tokens).
    pub config: Option<crate::config::FileConfig>,
}

/// The sections of `apron serve`'s config that `apron up` does not use.
pub const IGNORED_SECTIONS: [&str; 5] = ["server", "ingest", "sql", "pg", "tokens"];

/// The URLs `apron up` serves, as written to `endpoints.json`.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Endpoints {
    pub http: String,
    pub metrics: String,
    pub ingest: String,
    /// The in-process agent's `/metrics` (none with `--source none`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agent_metrics: Option<String>,
    /// `postgresql://apron@127.0.0.1:5433/apron`
    pub postgres: String,
    /// This run's ingest token, in a file only its owner reads (`<data>/ingest-token`):
    /// what Prometheus' `remote_write` (`authorization: credentials_file`) or another
    /// agent sends. A new one every start.
    pub ingest_token_file: String,
}

/// The file `apron up` writes this run's ingest token to, in its data directory.
pub const INGEST_TOKEN_FILE: &str = "ingest-token";

/// Which GPU source the agent runs, and why.
#[derive(Debug, Clone)]
pub struct SourceChoice {
    /// None: no agent (`--source none`, or the simulator kept out of a directory with
    /// other data).
    pub kind: Option<SourceKind>,
    pub gpus: usize,
    /// Why NVML (or, for no agent, the simulator) was not used.
    pub fallback_reason: Option<String>,
}

/// The in-process agent: its config, source and `/metrics` listener.
struct Agent {
    config: AgentConfig,
    source: Box<dyn GpuSource>,
    listener: tokio::net::TcpListener,
}

/// A started `apron up`: bound, store open, source chosen; [`Up::run`] serves.
pub struct Up {
    server: Server,
    listener: tokio::net::TcpListener,
    agent: Option<Agent>,
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
    pub async fn start(mut options: UpOptions) -> Result<Up, ServerError> {
        for addr in [options.http, options.pg] {
            if !addr.ip().is_loopback() {
                return Err(ServerError::NotLoopback(addr));
            }
        }
        let data_dir = options.data_dir.clone();
        std::fs::create_dir_all(&data_dir)
            .map_err(|source| ServerError::Io { what: format!("cannot create {}", data_dir.display()), source })?;
        let listener = tokio::net::TcpListener::bind(options.http).await.map_err(|source| ServerError::Io {
            what: format!("cannot listen on {} (--http ADDR; port 0 picks a free one)", options.http),
            source,
        })?;
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
        let token_file = write_token(&data_dir, &token)?;
        let configured = options.config.is_some();
        let file = options.config.take().unwrap_or_default();
        let mut store_config = StoreConfig { data_dir: data_dir.clone(), ..file.storage };
        let mut rollup = file.rollup;
        if !configured {
            // One machine's GPUs: budgets sized for `up`'s memory targets (≤ 500 MiB peak,
            // ≤ 300 MiB steady; docs/benchmarks.md, "Memory: `apron up` RSS"); the
            // memtable's are the server's defaults, the merges' half of them.
            store_config.compaction_memory_bytes = UP_COMPACTION_MEMORY_BYTES;
            rollup.gpus_per_query = UP_ROLLUP_GPUS_PER_QUERY;
        }
        let ingest = IngestOptions { tokens: vec![token.clone()], ..IngestOptions::default() };
        let query = file.query;
        let server =
            tokio::task::spawn_blocking(move || Server::open(store_config, ingest, query, crate::Access::Loopback))
                .await
                .map_err(ServerError::Task)??;

        let (agent, choice) = match open_agent(&options, &server, &data_dir, first_start, addr, token).await {
            Ok(opened) => opened,
            Err(e) => {
                // A failed first start leaves nothing that changes the next one: the WAL
                // directory the store just created would make the next start skip its
                // seed. Nothing was stored yet (no agent ran).
                if first_start {
                    drop(server);
                    let _ = std::fs::remove_dir_all(data_dir.join("wal"));
                }
                return Err(e);
            }
        };
        // Dollars from the first run: the config's price book, else the example one,
        // written next to the data (and said so in every report it prices).
        let mut cost = file.cost;
        if cost.price_book.is_none() {
            let book = data_dir.join(EXAMPLE_PRICE_BOOK);
            // Up's own copy: written when missing, and replaced when it is an older
            // example without the `example = true` marker the reports show.
            let unmarked = std::fs::read_to_string(&book).is_ok_and(|t| !t.contains("\nexample = true"));
            if !book.exists() || unmarked {
                std::fs::write(&book, EXAMPLE_PRICES)
                    .map_err(|source| ServerError::Io { what: format!("cannot write {}", book.display()), source })?;
            }
            cost.price_book = Some(book);
        }
        if !configured {
            // Without a config, price each minute: a first start shows dollars soon.
            cost.interval = std::time::Duration::from_secs(60);
        }
        if choice.kind == Some(SourceKind::Sim) && cost.teams.is_empty() {
            // The simulated organisation: its namespaces and Slurm accounts → teams.
            cost.teams = apron_cost::TeamConfig::from_toml(SIM_TEAMS).map_err(|e| {
                ServerError::Cost(crate::ledger::LedgerError::Config { section: "teams", detail: e.to_string() })
            })?;
        }
        let server = server
            .with_rollup(rollup)
            .with_cost(cost)?
            .with_report(file.report)
            .with_alerts(file.alerts)
            .with_recommend(file.recommend)
            .with_scrape(file.scrape)?
            .with_pg(pg_listener, crate::pg::PgAuth::Trust { user: crate::pg::UP_USER.to_owned() }, None);

        let http = format!("http://{addr}");
        let endpoints = Endpoints {
            metrics: format!("{http}/metrics"),
            ingest: format!("{http}{}", apron_collector::http::INGEST_PATH),
            agent_metrics: agent
                .as_ref()
                .and_then(|a| a.listener.local_addr().ok())
                .map(|a| format!("http://{a}/metrics")),
            postgres: format!("postgresql://{}@{pg_addr}/apron", crate::pg::UP_USER),
            ingest_token_file: token_file.display().to_string(),
            http,
        };
        Ok(Up { server, listener, agent, choice, endpoints, data_dir, first_start, backfill: options.backfill })
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
        }
        if let Some(agent) = self.agent.as_ref().filter(|a| self.first_start && a.config.source == SourceKind::Sim)
            && !self.backfill.is_zero()
        {
            let sim = SimSource::new(&agent.config.sim, agent.config.cluster.clone())
                .map_err(|e| ServerError::Agent(e.to_string()))?;
            let (store, span, window) = (self.server.store().clone(), self.backfill, agent.config.window);
            println!(
                "  seeding        the last {} of simulated history (in the background)…",
                humantime::format_duration(span)
            );
            let ledger = self.server.ledger().cloned();
            let recommender = self.server.recommender().cloned();
            let alerts = self.server.alerts().cloned();
            seeding = Some(tokio::task::spawn_blocking(move || {
                match crate::backfill::run(&store, &sim, UnixMicros::now(), span, window) {
                    Ok(done) => {
                        println!("  seeded         {} GPU windows, {} process rows", done.windows, done.processes);
                        // Merge the seeded days that are finished into their day files now,
                        // before the first rollup pass: rolled up from the seed's many
                        // files, a day would be rolled up again after its merge a minute
                        // later, and the merge and the rollup would run in the same second
                        // (measured: the peak of `apron up`).
                        if let Err(e) = store.persist_now() {
                            tracing::warn!("persisting the seeded history: {e}");
                        }
                        for e in store.maintain_now().errors {
                            tracing::warn!("merging the seeded days: {e}");
                        }
                        // Price the seeded history and look for stranded GPUs now rather
                        // than at the next tick: the first page never says "nothing is
                        // firing" beside a red heatmap.
                        if let Some(l) = ledger {
                            l.kick();
                        }
                        if let Some(r) = recommender {
                            r.kick();
                        }
                        if let Some(a) = alerts {
                            a.kick();
                        }
                    }
                    Err(e) => tracing::error!("seeding simulated history failed: {e}"),
                }
            }));
        }
        write_endpoints(&self.data_dir, &self.endpoints)?;

        let (stop_agent, agent_stopped) = tokio::sync::oneshot::channel::<()>();
        let grace =
            self.agent.as_ref().and_then(|a| a.config.shipper.as_ref()).map_or(Duration::ZERO, |s| s.request_timeout);
        let agent = self.agent.map(|Agent { config, source, listener }| {
            tokio::spawn(async move {
                let shutdown = async move {
                    let _ = agent_stopped.await;
                };
                if let Err(e) = apron_agent::run(config, source, listener, shutdown).await {
                    tracing::error!("the in-process agent stopped: {e}");
                }
            })
        });
        let server_shutdown = async move {
            shutdown.await;
            let Some(agent) = agent else { return };
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
        source = choice.kind.map_or("none", source_name),
        "first start: created a new data directory"
    );
}

fn source_name(kind: SourceKind) -> &'static str {
    match kind {
        SourceKind::Nvml => "nvml",
        SourceKind::Sim => "sim",
    }
}

/// The in-process agent as `apron up` configures it, and its source, as `--source`
/// asks: NVML; the simulator (`auto` falls back to it when NVML has no library, no
/// driver or no GPU) — but never into a data directory holding other GPUs' data, so
/// simulated hosts are not mixed into imported or real history; or none.
async fn open_agent(
    options: &UpOptions,
    server: &Server,
    data_dir: &Path,
    first_start: bool,
    server_addr: SocketAddr,
    token: String,
) -> Result<(Option<Agent>, SourceChoice), ServerError> {
    if options.source == UpSource::None {
        return Ok((None, SourceChoice { kind: None, gpus: 0, fallback_reason: None }));
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|source| ServerError::Io { what: "cannot listen for the agent's /metrics".into(), source })?;
    let agent_listen = listener.local_addr().map_err(ServerError::Serve)?;
    let mut file = AgentFile::default();
    file.shipper.spool_dir = Some(data_dir.join("agent-spool"));
    file.shipper.flush_interval = Some(AGENT_FLUSH_INTERVAL.to_owned());
    let overrides = AgentOverrides {
        source: Some(if options.source == UpSource::Sim { SourceKind::Sim } else { SourceKind::Nvml }),
        listen: Some(agent_listen.to_string()),
        collector: Some(format!("http://{server_addr}")),
        collector_token: Some(token),
        hostname: Some(options.hostname.clone()),
        ..AgentOverrides::default()
    };
    let mut config = file.resolve(overrides, &options.hostname).map_err(|e| ServerError::Agent(e.to_string()))?;
    let mut fallback_reason = None;
    if config.source == SourceKind::Nvml {
        match apron_agent::open_source(&config) {
            Ok(source) => {
                let choice =
                    SourceChoice { kind: Some(SourceKind::Nvml), gpus: source.inventory().len(), fallback_reason };
                return Ok((Some(Agent { config, source, listener }), choice));
            }
            Err(AgentError::Nvml(
                e @ (NvmlSourceError::Load { .. } | NvmlSourceError::Init { .. } | NvmlSourceError::NoGpus { .. }),
            )) if options.source == UpSource::Auto => {
                // The agent's message ends with advice for its own command line; keep the cause.
                let reason = e.to_string();
                fallback_reason = Some(reason.split(". ").next().unwrap_or(&reason).trim_end_matches('.').to_owned());
                config.source = SourceKind::Sim;
            }
            Err(AgentError::Nvml(e)) => {
                // The agent's own advice names its flags (`--nvml-lib`, `apron-agent
                // --source sim`), which `up` does not have: keep the cause, give up's.
                let reason = e.to_string();
                let cause = reason.split(". ").next().unwrap_or(&reason).trim_end_matches('.');
                return Err(ServerError::Agent(format!(
                    "{cause}. Is the NVIDIA driver installed? Or run the simulated fleet: apron up --source sim"
                )));
            }
            Err(e) => return Err(ServerError::Agent(e.to_string())),
        }
    }
    if let Some(host) = foreign_host(server, &config.sim.host_prefix).await? {
        let why = format!(
            "{} holds data that the simulator did not write (host {host:?}); the simulator never writes into it",
            data_dir.display()
        );
        if options.source == UpSource::Sim {
            return Err(ServerError::Agent(format!(
                "{why}: run `apron up --source none` to browse it, or give the simulator a new --data directory"
            )));
        }
        let reason = match fallback_reason {
            Some(nvml) => format!("{nvml}; {why}"),
            None => why,
        };
        return Ok((None, SourceChoice { kind: None, gpus: 0, fallback_reason: Some(reason) }));
    }
    config.sim.phase_origin = sim_phase_origin(data_dir, first_start)?;
    let source = apron_agent::open_source(&config).map_err(|e| ServerError::Agent(e.to_string()))?;
    let choice = SourceChoice { kind: Some(SourceKind::Sim), gpus: source.inventory().len(), fallback_reason };
    Ok((Some(Agent { config, source, listener }), choice))
}

/// `up`'s compaction budget without a config (the server's default: 128 MiB).
const UP_COMPACTION_MEMORY_BYTES: usize = 64 << 20;
/// GPUs per rollup query without a config (the server's default: 64): `up`'s 16 GPUs
/// in four slices, so the minute rollup of a seeded day is not one scan of it.
const UP_ROLLUP_GPUS_PER_QUERY: usize = 4;

/// Where the simulated fleet's job cycles start, kept beside the data.
const SIM_ORIGIN_FILE: &str = "sim-origin.json";

/// How long before a data directory's first start its simulated jobs' cycles begin: far
/// enough that every scenario is in its characteristic phase when `apron up` first shows
/// it (training in its steady run, the notebook idle and stranded, the Slurm job using
/// one of its four GPUs) and the seeded history holds that phase too.
const SIM_ORIGIN_BEFORE_FIRST_START: Duration = Duration::from_secs(10 * 3600);

#[derive(serde::Serialize, serde::Deserialize)]
struct SimOrigin {
    phase_origin_us: i64,
}

/// The simulated fleet's phase origin for `data_dir`: chosen at the first start and
/// kept in [`SIM_ORIGIN_FILE`], so a restart continues the stored history. A data
/// directory seeded before the file existed keeps the epoch-based phases (`None`).
fn sim_phase_origin(data_dir: &Path, first_start: bool) -> Result<Option<UnixMicros>, ServerError> {
    let path = data_dir.join(SIM_ORIGIN_FILE);
    if first_start {
        let origin = UnixMicros::now().0 - SIM_ORIGIN_BEFORE_FIRST_START.as_micros() as i64;
        crate::statefile::save_json(&path, &SimOrigin { phase_origin_us: origin })
            .map_err(|e| ServerError::Agent(e.to_string()))?;
        return Ok(Some(UnixMicros(origin)));
    }
    match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice::<SimOrigin>(&bytes)
            .map(|o| Some(UnixMicros(o.phase_origin_us)))
            .map_err(|e| ServerError::Agent(format!("{}: {e}", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(ServerError::Io { what: format!("cannot read {}", path.display()), source }),
    }
}

/// A host in the data directory's `gpu_samples` that is not the simulator's, if any
/// (rows still in the write-ahead log included).
async fn foreign_host(server: &Server, sim_prefix: &str) -> Result<Option<String>, ServerError> {
    let sql = format!(
        "SELECT \"host\" FROM gpu_samples WHERE NOT starts_with(\"host\", {}) LIMIT 1",
        crate::sqlutil::sql_str(sim_prefix)
    );
    let r = server
        .engine()
        .execute_internal(&sql)
        .await
        .map_err(|e| ServerError::Agent(format!("cannot read the data directory's hosts: {e}")))?;
    use datafusion::arrow::array::AsArray;
    let Some(b) = r.batches.iter().find(|b| b.num_rows() > 0) else { return Ok(None) };
    let host = datafusion::arrow::compute::cast(b.column(0), &datafusion::arrow::datatypes::DataType::Utf8)
        .map_err(|e| ServerError::Agent(format!("cannot read the data directory's hosts: {e}")))?;
    Ok(Some(host.as_string::<i32>().value(0).to_owned()))
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

/// Writes this run's ingest token to `<data>/ingest-token`, readable by its owner only.
fn write_token(data_dir: &Path, token: &str) -> Result<PathBuf, ServerError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = data_dir.join(INGEST_TOKEN_FILE);
    let io = |source| ServerError::Io { what: format!("cannot write {}", path.display()), source };
    std::fs::create_dir_all(data_dir).map_err(io)?;
    let mut f =
        std::fs::OpenOptions::new().create(true).write(true).truncate(true).mode(0o600).open(&path).map_err(io)?;
    f.write_all(format!("{token}\n").as_bytes()).map_err(io)?;
    Ok(path)
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
            agent_metrics: Some("http://127.0.0.1:2/metrics".into()),
            postgres: "postgresql://apron@127.0.0.1:3/apron".into(),
            ingest_token_file: "/tmp/ingest-token".into(),
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
        let options = |http: &str, pg: &str| UpOptions {
            http: http.parse().expect("addr"),
            data_dir: "/nonexistent".into(),
            pg: pg.parse().expect("addr"),
            hostname: "h".into(),
            backfill: Duration::ZERO,
            source: UpSource::Auto,
            config: None,
        };
        let e = Up::start(options("0.0.0.0:0", "127.0.0.1:0")).await.expect_err("refused");
        assert!(e.to_string().contains("loopback"), "{e}");
        // The PostgreSQL port too.
        let e = Up::start(options("127.0.0.1:0", "0.0.0.0:5433")).await.expect_err("refused");
        assert!(e.to_string().contains("0.0.0.0:5433"), "{e}");
    }
}
