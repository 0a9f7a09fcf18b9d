//! `apron`: parse arguments and the environment, call the library, print.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context as _;
use apron::up::{DEFAULT_DATA_DIR, DEFAULT_HTTP, Up, UpOptions};
use apron::{Access, FileConfig, Overrides, Server};
use apron_agent::config::SourceKind;
use clap::Parser;

/// mimalloc instead of glibc's malloc: after `apron up`'s seed and first passes glibc
/// kept ~600 MiB of freed memory in its arenas (938 MiB steady against 354 MiB with
/// mimalloc; docs/benchmarks.md, "Memory"). Built with `no_thp` (Cargo.toml): with
/// transparent huge pages a rollup pass peaked ~100 MiB higher.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Apron: GPU utilisation, idle time and its cost — the server (`serve`), the
/// all-in-one (`up`), and the tools that read what they store.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    #[command(subcommand)]
    command: Command,
    /// Log filter (tracing EnvFilter syntax), e.g. info or apron_collector=debug.
    #[arg(long, env = "APRON_LOG", default_value = "info", global = true)]
    log: String,
}

/// Request tracing, for the commands that serve requests.
#[derive(Debug, Clone, clap::Args)]
struct TraceArgs {
    /// Export the server's request spans to this OTLP endpoint, e.g. http://otel-collector:4317.
    #[arg(long, env = "APRON_OTLP_TRACES")]
    otlp_traces: Option<String>,
    /// Transport for --otlp-traces.
    #[arg(long, env = "APRON_OTLP_TRACES_PROTOCOL", default_value = "grpc", value_parser = ["grpc", "http/protobuf"])]
    otlp_traces_protocol: String,
}

#[derive(Debug, clap::Subcommand)]
enum BallistaRole {
    /// The scheduler: plans the jobs query servers submit and hands their stages to
    /// executors.
    Scheduler {
        /// Config file: [storage.object_store] (the lake) and [query] (function limits).
        #[arg(long)]
        config: Option<PathBuf>,
        #[command(flatten)]
        options: apron::ballista::SchedulerOptions,
    },
    /// An executor: runs stages over the lake, serves results over Arrow Flight.
    Executor {
        /// Config file: [storage.object_store] (the lake) and [query] (function limits).
        #[arg(long)]
        config: Option<PathBuf>,
        #[command(flatten)]
        options: apron::ballista::ExecutorOptions,
    },
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// The server for a deployment: ingest from agents, storage, SQL (HTTP and
    /// PostgreSQL), the cost ledger, alerts, recommendations, reports and the web UI.
    Serve {
        #[command(flatten)]
        trace: TraceArgs,
        /// Config file (TOML). Flags and APRON_* environment variables override it.
        #[arg(long)]
        config: Option<PathBuf>,
        /// HTTP listen address (overrides server.listen; port 0 picks a free port).
        #[arg(long, env = "APRON_HTTP")]
        http: Option<String>,
        /// Data directory (overrides storage.data_dir).
        #[arg(long, env = "APRON_DATA")]
        data: Option<PathBuf>,
        /// One more accepted ingest token. Prefer the environment variable: flags show
        /// in `ps`.
        #[arg(long, env = "APRON_INGEST_TOKEN", hide_env_values = true)]
        ingest_token: Option<String>,
        /// One more accepted SQL token (POST /api/v1/sql). Prefer the environment variable.
        #[arg(long, env = "APRON_SQL_TOKEN", hide_env_values = true)]
        sql_token: Option<String>,
        /// PostgreSQL wire address (overrides pg.listen; the port opens only with [pg] users).
        #[arg(long, env = "APRON_PG")]
        pg: Option<String>,
        /// A collector's shard (overrides cluster.shard): a StatefulSet gives each pod
        /// its name.
        #[arg(long, env = "APRON_SHARD")]
        shard: Option<String>,
    },
    /// One read-only SQL query, against a running server or straight on a data directory.
    Sql {
        /// The query, e.g. "SELECT count(*) FROM gpu_samples".
        query: String,
        /// Output format.
        #[arg(long, value_enum, default_value_t = OutFormat::Table)]
        format: OutFormat,
        /// The server to ask (ignored with --data).
        #[arg(long, env = "APRON_SERVER", default_value = "http://127.0.0.1:9402")]
        server: String,
        /// Query the Parquet files of this data directory instead of a server (rows
        /// still in a running server's write-ahead log are not visible this way).
        #[arg(long)]
        data: Option<PathBuf>,
        /// SQL token for the server (`apron serve`; `apron up` needs none).
        #[arg(long, env = "APRON_SQL_TOKEN", hide_env_values = true)]
        token: Option<String>,
    },
    /// The weekly idle-cost report for finance, built locally from a data directory's
    /// gpu_cost_hourly (what `apron up` / `apron serve` computed). A running server
    /// serves the same at GET /api/v1/reports/weekly. A week stays open (every run
    /// reflects the data) until it is delivered (--send, the schedule) or closed
    /// (--close); a closed week is frozen, and later changes are shown as a diff.
    Report {
        /// ISO week, e.g. 2026-W48 (UTC). Default: the last finished week.
        #[arg(long)]
        week: Option<String>,
        /// The rendering: html (one file), json, csv (four tables) or xlsx.
        #[arg(long, value_enum, default_value_t = apron::report::ReportFormat::Html)]
        format: apron::report::ReportFormat,
        /// Directory to write the report file(s) into.
        #[arg(long, default_value = ".")]
        out: PathBuf,
        /// The data directory (a closed week's frozen copy is read from it).
        /// Default: the config's storage.data_dir with --config, else ./apron-data.
        #[arg(long, env = "APRON_DATA")]
        data: Option<PathBuf>,
        /// Price book for the report's price table and version stamp (default: the
        /// config's cost.price_book, else the one `apron up` wrote into the data
        /// directory, if any).
        #[arg(long)]
        price_book: Option<PathBuf>,
        /// Rebuild a closed week from the data, print what changed and replace its
        /// frozen copy.
        #[arg(long, conflicts_with = "close")]
        recompute: bool,
        /// Close the week (it must have ended): freeze this report as the one finance
        /// received; later runs serve it and show changes as a diff.
        #[arg(long)]
        close: bool,
        /// `apron serve`'s config file: its [storage], [cost] price book and [report]
        /// (share_unallocated, and the deliveries of --send).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Deliver the week now as the schedule would ([report] dir, [report.email],
        /// [report.webhook] of --config), e.g. to test a mail setup. A week already
        /// delivered is refused (see --resend).
        #[arg(long)]
        send: bool,
        /// With --send: deliver again a week already delivered.
        #[arg(long, requires = "send")]
        resend: bool,
    },
    /// Rebalancing recommendations (reclaim, right-size, pack, downsize, spot) with
    /// their savings, from a running server.
    Recommend {
        /// The window to look back over, e.g. 1h, 24h, 7d. Default: the server's
        /// [recommend] window (7d unless configured), as the web UI and the API use.
        #[arg(long)]
        window: Option<String>,
        /// A table for people, or the API's JSON.
        #[arg(long, value_enum, default_value_t = RecommendFormat::Table)]
        format: RecommendFormat,
        /// The server to ask.
        #[arg(long, env = "APRON_SERVER", default_value = "http://127.0.0.1:9402")]
        server: String,
        /// Token for the server (`apron serve`'s SQL token; `apron up` needs none).
        #[arg(long, env = "APRON_SQL_TOKEN", hide_env_values = true)]
        token: Option<String>,
    },
    /// Backfill gpu_samples from dcgm-exporter history: Prometheus / OpenMetrics text
    /// with timestamps, or Prometheus query_range JSON. Into a data directory that no
    /// server has open; importing the same files again stores nothing new.
    Import {
        /// Files to import (one history across them).
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// The data directory.
        #[arg(long, env = "APRON_DATA", default_value = DEFAULT_DATA_DIR)]
        data: PathBuf,
        /// Cluster name for the imported GPUs.
        #[arg(long)]
        cluster: Option<String>,
        /// Host name for every imported GPU (when the Hostname label names the exporter's pod).
        #[arg(long)]
        host: Option<String>,
        /// The longest gap a point sample still covers (default: 3× the series' median step).
        #[arg(long, value_parser = humantime::parse_duration)]
        max_gap: Option<std::time::Duration>,
    },
    /// Apache DataFusion Ballista's scheduler or executor, with Apron's codecs, functions
    /// and lake, for query servers with [query.ballista].
    Ballista {
        #[command(subcommand)]
        role: BallistaRole,
    },
    /// Price books: show one's $/GPU-hour table, or import a SkyPilot catalog.
    Pricebook {
        #[command(subcommand)]
        action: PricebookAction,
    },
    /// All in one on this machine: the server and an agent on the local GPUs (or a
    /// simulated fleet), on loopback.
    Up {
        #[command(flatten)]
        trace: TraceArgs,
        /// HTTP listen address, loopback only (port 0 picks a free port).
        #[arg(long, env = "APRON_HTTP", default_value = DEFAULT_HTTP)]
        http: SocketAddr,
        /// Data directory.
        #[arg(long, env = "APRON_DATA", default_value = DEFAULT_DATA_DIR)]
        data: PathBuf,
        /// PostgreSQL wire address, loopback only (port 0 picks a free port); psql
        /// connects as user `apron` without a password.
        #[arg(long, env = "APRON_PG", default_value = "127.0.0.1:5433")]
        pg: SocketAddr,
        /// On first start with the simulator, the history to generate (0s: none).
        #[arg(long, env = "APRON_BACKFILL", default_value = "24h", value_parser = humantime::parse_duration)]
        backfill: std::time::Duration,
        /// Where the GPUs come from: auto (NVML, else the simulator), nvml, sim, or none
        /// (no agent: browse imported history or [[scrape]] targets). The simulator
        /// never writes into a data directory that holds other data.
        #[arg(long, env = "APRON_SOURCE", value_enum, default_value_t = apron::up::UpSource::Auto)]
        source: apron::up::UpSource,
        /// `apron serve`'s config file, for what it says about computing: [storage]
        /// (--data wins), [query], [rollup], [cost] (price book, teams), [report],
        /// [alerts], [recommend], [[scrape]]. Listening and credentials stay `apron
        /// up`'s own (loopback, no tokens).
        #[arg(long)]
        config: Option<PathBuf>,
    },
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    match run(args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("apron: {}", apron_common::error_chain(e.as_ref()));
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("apron")
        .build()
        .context("starting the async runtime")?;
    let trace = match &args.command {
        Command::Serve { trace, .. } | Command::Up { trace, .. } => Some(trace),
        _ => None,
    };
    let otlp = trace.and_then(|t| t.otlp_traces.clone()).map(|endpoint| apron::telemetry::OtlpTracing {
        protocol: if trace.is_some_and(|t| t.otlp_traces_protocol == "http/protobuf") {
            apron::telemetry::TraceProtocol::HttpProtobuf
        } else {
            apron::telemetry::TraceProtocol::Grpc
        },
        ..apron::telemetry::OtlpTracing::new(endpoint)
    });
    // Colour only for a person at a terminal: files and journald get plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr()) && std::env::var_os("NO_COLOR").is_none();
    // Inside the runtime (the gRPC channel runs on it). Declared after `rt`, so it is
    // dropped first, outside block_on, flushing the last spans.
    let _telemetry = {
        let _enter = rt.enter();
        apron::telemetry::init_tracing(&args.log, ansi, otlp.as_ref()).map_err(anyhow::Error::msg)?
    };
    match args.command {
        Command::Sql { query, format, server, data, token } => {
            rt.block_on(sql_command(query, format, server, data, token))
        }
        Command::Serve { trace: _, config, http, data, ingest_token, sql_token, pg, shard } => {
            let file = match &config {
                Some(path) => FileConfig::load(path)?,
                None => FileConfig::default(),
            };
            let config = file.resolve(Overrides {
                listen: http,
                data_dir: data,
                ingest_token,
                sql_token,
                pg_listen: pg,
                shard,
                credentials: bucket_credentials(),
            })?;
            rt.block_on(async move {
                // A deep accept queue: a burst of connections must not crowd out probes.
                let listener = apron_http::serve::bind(config.listen)
                    .with_context(|| {
                        format!("cannot listen on {} (--http ADDR or [server] listen; port 0 picks a free one)", config.listen)
                    })?;
                let addr = listener.local_addr()?;
                let (store, ingest, query, rollup, cost) =
                    (config.store, config.ingest, config.query, config.rollup, config.cost);
                let (report, alerts, recommend, scrape) = (config.report, config.alerts, config.recommend, config.scrape);
                let pg = match config.pg {
                    Some(p) => {
                        let l = apron_http::serve::bind(p.addr)
                            .with_context(|| format!("cannot listen on {} for PostgreSQL clients", p.addr))?;
                        let tls = p.tls.as_ref().map(|t| t.server_config()).transpose().context("[pg.tls]")?;
                        let limits = (p.max_connections, p.auth_timeout, p.session);
                        Some((l, apron::pg::PgAuth::Password(p.users.into()), tls, limits))
                    }
                    None => None,
                };
                let pg_addr = pg.as_ref().and_then(|(l, ..)| l.local_addr().ok());
                if !config.credentials.iter().any(|c| c.role.read_scope().is_some()) {
                    tracing::warn!("no token may read ([[tokens]] with role viewer, team:<name> or admin; [sql] tokens; APRON_SQL_TOKEN): SQL, alerts, recommendations and reports refuse every request");
                }
                let auth = Access::Tokens(config.credentials.into());
                let http = config.http;
                let cluster = config.cluster;
                let server = tokio::task::spawn_blocking(move || match cluster {
                    apron::cluster::Cluster::Single => Server::open(store, ingest, query, auth),
                    apron::cluster::Cluster::Collector { shard, heartbeat } => {
                        Server::open(store, ingest, query, auth)?.with_shard(shard, heartbeat)
                    }
                    apron::cluster::Cluster::Query { lake } => Server::open_query(store, query, auth, lake),
                })
                .await??
                .with_rollup(rollup)
                    .with_cost(cost)?
                    .with_report(report)
                    .with_alerts(alerts)
                    .with_recommend(recommend)
                    .with_scrape(scrape)?
                    .with_http(http)?;
                let server = match pg {
                    Some((l, auth, tls, (max_connections, auth_timeout, session))) => server
                        .with_pg(l, auth, tls)
                        .with_pg_limits(max_connections, auth_timeout)
                        .with_pg_session_limits(session),
                    None => server,
                };
                if let Some(a) = pg_addr {
                    tracing::info!(%a, "PostgreSQL clients connect here ([pg] users)");
                }
                // A line on stdout that scripts and tests wait for: the store is open
                // and the address bound.
                let shutdown = apron_http::serve::shutdown_signal();
                println!("listening on {addr}");
                server.run(listener, shutdown).await?;
                Ok(())
            })
        }
        Command::Recommend { window, format, server, token } => {
            recommend_command(&server, window.as_deref(), format, token.as_deref())
        }
        Command::Report { week, format, out, data, price_book, recompute, close, config, send, resend } => {
            let options = ReportOptions { week, format, out, data, price_book, recompute, close, config, send, resend };
            rt.block_on(report_command(options))
        }
        Command::Pricebook { action } => pricebook_command(action),
        Command::Ballista { role } => rt.block_on(ballista_command(role)),
        Command::Import { files, data, cluster, host, max_gap } => {
            rt.block_on(import_command(files, data, cluster, host, max_gap))
        }
        Command::Up { trace: _, http, data, pg, backfill, source, config } => rt.block_on(async move {
            let config = match config {
                Some(path) => {
                    let ignored = FileConfig::sections_in(&path)?
                        .into_iter()
                        .filter(|s| apron::up::IGNORED_SECTIONS.contains(&s.as_str()))
                        .collect::<Vec<_>>();
                    if !ignored.is_empty() {
                        eprintln!(
                            "apron up: {} sets [{}], which apron up ignores (it listens on loopback only, without tokens)",
                            path.display(),
                            ignored.join("], [")
                        );
                    }
                    Some(FileConfig::load(&path)?)
                }
                None => None,
            };
            let options =
                UpOptions { http, data_dir: data, pg, hostname: machine_hostname(), backfill, source, config };
            let up = Up::start(options).await?;
            let shutdown = apron_http::serve::shutdown_signal();
            print_up(&up);
            up.run(shutdown).await?;
            Ok(())
        }),
    }
}

#[derive(Debug, clap::Subcommand)]
enum PricebookAction {
    /// Checks a price book and prints its per-model $/GPU-hour table (on-prem
    /// derivations included).
    Show {
        /// The price book (TOML).
        file: PathBuf,
    },
    /// Turns a SkyPilot catalog CSV (e.g. skypilot-catalog's vms.csv) into `[[price]]`
    /// entries on stdout, per GPU (instance price / accelerator count), the cheapest row
    /// per model; accelerators with no NVML mapping are listed on stderr.
    ImportSkypilot {
        file: PathBuf,
        /// Import SpotPrice as `spot` instead of Price as `on_demand`.
        #[arg(long)]
        spot: bool,
        /// Only rows of this region.
        #[arg(long)]
        region: Option<String>,
        /// Make the entries a per-cluster override.
        #[arg(long)]
        cluster: Option<String>,
        /// effective_from of the entries (RFC 3339 or YYYY-MM-DD, UTC).
        #[arg(long)]
        effective_from: Option<String>,
    },
}

fn pricebook_command(action: PricebookAction) -> anyhow::Result<()> {
    use apron_cost::pricebook::{SkyPilotImport, SkyPilotPrice, import_skypilot_csv};
    match action {
        PricebookAction::Show { file } => {
            let text = std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
            let book =
                apron_cost::PriceBook::from_toml(&text).with_context(|| format!("price book {}", file.display()))?;
            println!("price book {} (version {})", file.display(), book.version());
            print!("{}", book.render_table());
        }
        PricebookAction::ImportSkypilot { file, spot, region, cluster, effective_from } => {
            let text = std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
            let effective_from_us = effective_from.as_deref().map(apron_cost::time::parse_instant).transpose()?;
            let price = if spot { SkyPilotPrice::Spot } else { SkyPilotPrice::OnDemand };
            let out = import_skypilot_csv(&text, &SkyPilotImport { price, region, cluster, effective_from_us })?;
            print!("{}", apron_cost::PriceBook::entries_to_toml(&out.entries));
            for (name, rows) in &out.unmapped {
                eprintln!(
                    "apron pricebook: no NVML model for SkyPilot accelerator {name:?} ({rows} rows): not imported"
                );
            }
            eprintln!("apron pricebook: {} entries", out.entries.len());
        }
    }
    Ok(())
}

/// `apron sql`'s output formats.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum OutFormat {
    Table,
    Csv,
    Json,
}

impl OutFormat {
    fn format(self) -> apron_query::Format {
        match self {
            OutFormat::Table => apron_query::Format::Table,
            OutFormat::Csv => apron_query::Format::Csv,
            OutFormat::Json => apron_query::Format::Json,
        }
    }
}

async fn sql_command(
    query: String,
    format: OutFormat,
    server: String,
    data: Option<PathBuf>,
    token: Option<String>,
) -> anyhow::Result<()> {
    let out = match data {
        Some(dir) => {
            let source = apron_query::DirectorySource::open(&dir)
                .with_context(|| format!("cannot open the data directory {}", dir.display()))?;
            let state = source.data_dir().join(apron_query::rollup::STATE_FILE);
            let engine = apron_query::QueryEngine::with_rollup_state(
                apron_query::QueryConfig::default(),
                std::sync::Arc::new(source),
                Some(state),
            )?;
            engine.execute(&query).await?.render(format.format())?
        }
        None => tokio::task::spawn_blocking(move || sql_over_http(&server, &query, format, token.as_deref())).await??,
    };
    use std::io::Write as _;
    std::io::stdout().write_all(&out)?;
    Ok(())
}

/// Runs the query on a server. CSV and JSON come rendered; the table is rendered here
/// from the Arrow stream, so it looks the same as with `--data`.
fn sql_over_http(server: &str, query: &str, format: OutFormat, token: Option<&str>) -> anyhow::Result<Vec<u8>> {
    let url = format!("{}/api/v1/sql", server.trim_end_matches('/'));
    let wire = match format {
        OutFormat::Table => apron_query::Format::ArrowStream,
        other => other.format(),
    };
    let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let mut req = agent.post(&url).header("Accept", wire.content_type());
    if let Some(t) = token {
        req = req.header("Authorization", &format!("Bearer {t}"));
    }
    let mut resp =
        req.send(query).with_context(|| format!("cannot reach {url}: is `apron up` or `apron serve` running?"))?;
    let status = resp.status();
    // A query server of a cluster names the shards whose collectors are not current.
    if let Some(stale) = resp.headers().get(apron::sql::STALE_SHARDS_HEADER).and_then(|v| v.to_str().ok()) {
        eprintln!("note: stale shards (answered from what they last persisted): {stale}");
    }
    let body = resp.body_mut().read_to_vec().context("reading the answer")?;
    if !status.is_success() {
        return Err(server_error(status, &body));
    }
    match format {
        OutFormat::Table => {
            let reader = arrow_ipc::reader::StreamReader::try_new(std::io::Cursor::new(body), None)?;
            let schema = reader.schema();
            let batches = reader.collect::<Result<Vec<_>, _>>()?;
            Ok(apron_query::QueryResult { schema, batches, distributed: false }.render(apron_query::Format::Table)?)
        }
        _ => Ok(body),
    }
}

async fn import_command(
    files: Vec<PathBuf>,
    data: PathBuf,
    cluster: Option<String>,
    host: Option<String>,
    max_gap: Option<std::time::Duration>,
) -> anyhow::Result<()> {
    let options = apron_import::ImportOptions {
        max_gap,
        cluster: cluster.map(apron_common::ClusterName::new).transpose().context("--cluster")?,
        host_override: host.map(apron_common::HostName::new).transpose().context("--host")?,
        ..apron_import::ImportOptions::default()
    };
    // Files are streamed (read a line at a time, samples spilled past a budget), so an
    // import of any size runs in the same memory.
    let inputs = files.into_iter().map(apron::import::Input::File).collect();
    let config = apron_collector::StoreConfig { data_dir: data.clone(), ..apron_collector::StoreConfig::default() };
    let store = tokio::task::spawn_blocking(move || apron_collector::Store::open(config))
        .await?
        .with_context(|| format!("cannot open {} (is a server running on it? stop it first)", data.display()))?;
    let store = std::sync::Arc::new(store);
    let engine =
        std::sync::Arc::new(apron_query::QueryEngine::new(apron_query::QueryConfig::default(), store.clone())?);
    let spill = Some((data.clone(), apron::import::SPILL_POINTS));
    let r = apron::import::run_inputs(store, engine, inputs, options, spill, |line| eprintln!("apron import: {line}"))
        .await
        .map_err(anyhow::Error::msg)?;
    let o = &r.outcome;
    let span = match (o.first_us, o.last_us) {
        (Some(a), Some(b)) => format!("{} .. {}", a.to_rfc3339(), b.to_rfc3339()),
        _ => "nothing".to_owned(),
    };
    println!("read {} samples in {} series; {} windows ({span})", o.samples_read, o.series, o.rows);
    println!("stored {} rows in {}", r.stored, data.display());
    if r.overlapping > 0 {
        println!(
            "skipped {} rows: data already stored for that GPU and time (an earlier import, or agent data, which wins)",
            r.overlapping
        );
    }
    if r.already_imported > 0 {
        println!("skipped {} rows: these files were imported before", r.already_imported);
    }
    for (why, n) in &o.skipped {
        println!("skipped {n} samples: {why}");
    }
    for (why, n) in &o.warnings {
        println!("warning ({n}): {why}");
    }
    Ok(())
}

/// The contract's `{"error", "detail"}` answer as an error.
fn server_error(status: ureq::http::StatusCode, body: &[u8]) -> anyhow::Error {
    let text = String::from_utf8_lossy(body);
    let err: Option<serde_json::Value> = serde_json::from_str(&text).ok();
    let msg = err
        .as_ref()
        .and_then(|v| Some(format!("{} ({})", v.get("error")?.as_str()?, v.get("detail")?.as_str().unwrap_or(""))))
        .unwrap_or_else(|| text.into_owned());
    anyhow::anyhow!("the server answered {status}: {msg}")
}

/// `apron recommend`: asks the server (which holds the price book and team maps) and
/// prints a table or the JSON.
fn recommend_command(
    server: &str,
    window: Option<&str>,
    format: RecommendFormat,
    token: Option<&str>,
) -> anyhow::Result<()> {
    let base = format!("{}/api/v1/recommendations", server.trim_end_matches('/'));
    let url = match window {
        Some(w) => {
            humantime::parse_duration(w).with_context(|| format!("--window {w}: use a duration such as 1h or 7d"))?;
            format!("{base}?window={w}")
        }
        None => base,
    };
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(std::time::Duration::from_secs(600)))
        .build()
        .into();
    let mut req = agent.get(&url);
    if let Some(t) = token {
        req = req.header("Authorization", &format!("Bearer {t}"));
    }
    eprintln!("apron recommend: computing over the last {} on {server} ...", window.unwrap_or("[recommend] window"));
    let mut resp =
        req.call().with_context(|| format!("cannot reach {url}: is `apron up` or `apron serve` running?"))?;
    let status = resp.status();
    let body = resp.body_mut().read_to_vec().context("reading the answer")?;
    if !status.is_success() {
        return Err(server_error(status, &body));
    }
    use std::io::Write as _;
    if format == RecommendFormat::Json {
        std::io::stdout().write_all(&body)?;
        return Ok(());
    }
    let v: serde_json::Value = serde_json::from_slice(&body).context("the answer is not JSON")?;
    let items = v["recommendations"].as_array().cloned().unwrap_or_default();
    let mut out = String::new();
    out.push_str(&format!(
        "recommendations over {} ({} .. {}; {} h of data, extrapolated to a month)\n\n{:<16} {:<14} {:>12} {:<9} {:>5}  {}\n",
        v["window"].as_str().unwrap_or_default(),
        v["from"].as_str().unwrap_or(""),
        v["to"].as_str().unwrap_or(""),
        v["covered_hours"].as_f64().map_or("?".to_owned(), |h| format!("{h:.1}")),
        "kind",
        "team",
        "$/month",
        "savings",
        "conf",
        "summary"
    ));
    for r in &items {
        out.push_str(&format!(
            "{:<16} {:<14} {:>12.2} {:<9} {:>5.2}  {}\n",
            r["kind"].as_str().unwrap_or(""),
            r["team"].as_str().unwrap_or(""),
            r["monthly_savings_usd"].as_f64().unwrap_or(0.0),
            r["savings_kind"].as_str().unwrap_or(""),
            r["confidence"].as_f64().unwrap_or(0.0),
            r["summary"].as_str().unwrap_or("")
        ));
    }
    if items.is_empty() {
        out.push_str("(none: nothing idle, under-used or mis-priced enough in this window)\n");
    }
    if let Some(t) = v["monthly_savings_usd"].as_object() {
        for (kind, usd) in t {
            out.push_str(&format!(
                "\ntotal {kind}: ${:.2}/month (holders that still hold their GPUs)",
                usd.as_f64().unwrap_or(0.0)
            ));
        }
        out.push('\n');
    }
    // Items whose holder has released its GPUs: history, in no total.
    let ended = v["ended"].as_array().cloned().unwrap_or_default();
    if !ended.is_empty() {
        out.push_str(&format!(
            "\nended: {} item(s) whose holder no longer holds the GPU(s), not in the total\n{:<16} {:<14} {:<28} {}\n",
            ended.len(),
            "kind",
            "team",
            "holder ended at",
            "summary"
        ));
        for r in &ended {
            out.push_str(&format!(
                "{:<16} {:<14} {:<28} {}\n",
                r["kind"].as_str().unwrap_or(""),
                r["team"].as_str().unwrap_or(""),
                r["holder_ended_at"].as_str().unwrap_or("?"),
                r["summary"].as_str().unwrap_or("")
            ));
        }
    }
    std::io::stdout().write_all(out.as_bytes())?;
    Ok(())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum RecommendFormat {
    Table,
    Json,
}

/// `apron report`'s arguments.
struct ReportOptions {
    week: Option<String>,
    format: apron::report::ReportFormat,
    out: PathBuf,
    data: Option<PathBuf>,
    price_book: Option<PathBuf>,
    recompute: bool,
    close: bool,
    config: Option<PathBuf>,
    send: bool,
    resend: bool,
}

async fn report_command(o: ReportOptions) -> anyhow::Result<()> {
    let now = apron_common::UnixMicros::now().0;
    let week = match &o.week {
        Some(w) => apron_cost::IsoWeek::parse(w)?,
        None => apron::report::current_week(now).context("cannot tell the current week")?.previous(),
    };
    let file = match &o.config {
        Some(path) => Some(FileConfig::load(path)?),
        None => None,
    };
    if let Some(f) = &file {
        f.report.validate()?;
    }
    if o.send && file.is_none() {
        anyhow::bail!("--send needs --config apron.toml (its [report] deliveries)");
    }
    let data = o
        .data
        .or_else(|| file.as_ref().map(|f| f.storage.data_dir.clone()))
        .unwrap_or_else(|| PathBuf::from(DEFAULT_DATA_DIR));
    let book_path = o.price_book.or_else(|| file.as_ref().and_then(|f| f.cost.price_book.clone())).or_else(|| {
        let p = data.join(apron::up::EXAMPLE_PRICE_BOOK);
        p.exists().then_some(p)
    });
    let book = match &book_path {
        Some(p) => Some(
            apron_cost::PriceBook::from_toml(
                &std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?,
            )
            .with_context(|| format!("price book {}", p.display()))?,
        ),
        None => None,
    };
    let report_config = file.map(|f| f.report).unwrap_or_default();
    let source = apron_query::DirectorySource::open(&data)
        .with_context(|| format!("cannot open the data directory {}", data.display()))?;
    let state = source.data_dir().join(apron_query::rollup::STATE_FILE);
    let engine = apron_query::QueryEngine::with_rollup_state(
        apron_query::QueryConfig::default(),
        std::sync::Arc::new(source),
        Some(state),
    )?;
    eprintln!("apron report: building {week} from {}", data.display());
    let share = report_config.share_unallocated;
    let freeze = if o.recompute {
        apron::report::Freeze::Recompute
    } else if o.close {
        apron::report::Freeze::Close
    } else {
        apron::report::Freeze::View
    };
    let produced = apron::report::produce(&engine, book.as_ref(), &data, week, o.format, freeze, share, now)
        .await
        .map_err(anyhow::Error::msg)?;
    let frozen_at = apron::report::stored_dir(&data, week);
    match (freeze, produced.frozen, produced.changed.is_empty()) {
        (apron::report::Freeze::Recompute, false, _) => {
            eprintln!("apron report: {week} is open (not closed): built from the data, nothing to compare")
        }
        (apron::report::Freeze::Recompute, true, true) => {
            eprintln!("apron report: recomputed {week}: nothing changed")
        }
        (apron::report::Freeze::Recompute, true, false) => {
            eprintln!("apron report: recomputed {week}; replaced the frozen copy in {}; changed:", frozen_at.display());
            for c in &produced.changed {
                eprintln!("  {c}");
            }
        }
        (_, true, true) => eprintln!("apron report: {week} is closed (frozen in {})", frozen_at.display()),
        (_, true, false) => {
            eprintln!(
                "apron report: {week} is closed (frozen in {}); the data has changed since \
                 (--recompute replaces the frozen copy):",
                frozen_at.display()
            );
            for c in &produced.changed {
                eprintln!("  {c}");
            }
        }
        (_, false, _) => eprintln!("apron report: {week} is open: built from the data as it is now"),
    }
    // What the report is: its coverage and what that is a share of, and whether its
    // dollars are example prices (from the JSON the files show: a frozen week's own).
    if let Some(j) = produced.json.as_deref().and_then(|t| serde_json::from_str::<serde_json::Value>(t).ok()) {
        if j["example_prices"].as_bool() == Some(true) {
            eprintln!("apron report: {week}: {}", apron_cost::report::EXAMPLE_PRICES_NOTE);
        }
        let hours = |k: &str| j[k].as_f64().map_or_else(|| "?".to_owned(), |h| format!("{h:.2}"));
        if let Some(basis) = j["coverage_basis"].as_str() {
            let line = apron_cost::report::coverage_sentence(
                j["coverage"].as_f64(),
                &hours("known_gpu_hours"),
                &hours("total_gpu_hours"),
                basis,
            );
            eprintln!("apron report: {week}: {line}");
        }
    }
    let files = produced.files;
    std::fs::create_dir_all(&o.out).with_context(|| format!("creating {}", o.out.display()))?;
    for (name, bytes) in files {
        let path = o.out.join(format!("apron-{week}-{name}"));
        std::fs::write(&path, bytes).with_context(|| format!("writing {}", path.display()))?;
        println!("{}", path.display());
    }
    if o.send {
        let schedule = apron::schedule::Schedule::new(std::sync::Arc::new(engine), book, data.clone(), report_config);
        let r = schedule.send(week, o.resend, now).await.map_err(anyhow::Error::msg)?;
        for d in &r.delivered {
            eprintln!("apron report: {week}: {d} delivered");
        }
        if !r.errors.is_empty() {
            anyhow::bail!("{week}: delivery failed: {}", r.errors.join("; "));
        }
        eprintln!("apron report: recorded in {}", schedule.sent_path(week).display());
    }
    Ok(())
}

fn print_up(up: &Up) {
    let e = up.endpoints();
    let c = up.source();
    println!("apron up: data in {}{}", up.data_dir().display(), if up.first_start() { " (new)" } else { "" });
    println!("  http           {}", e.http);
    println!("  metrics        {}", e.metrics);
    println!("  ingest         {}", e.ingest);
    match &e.agent_metrics {
        Some(m) => println!("  agent metrics  {m}"),
        None => println!("  agent metrics  (no agent)"),
    }
    println!(
        "  sql            POST {}/api/v1/sql   e.g. apron sql --server {} \"SELECT count(*) FROM gpu_samples\"",
        e.http, e.http
    );
    match (c.kind, &c.fallback_reason) {
        (Some(SourceKind::Nvml), _) => println!("  GPU source     nvml: {} GPU(s) on this machine", c.gpus),
        (Some(SourceKind::Sim), Some(why)) => {
            println!("  GPU source     sim: a simulated fleet of {} GPUs ({why})", c.gpus)
        }
        (Some(SourceKind::Sim), None) => println!("  GPU source     sim: a simulated fleet of {} GPUs", c.gpus),
        (None, Some(why)) => println!("  GPU source     none: {why}"),
        (None, None) => println!("  GPU source     none (--source none): the data directory's history only"),
    }
    if let Some((host, port)) =
        e.postgres.rsplit_once('@').and_then(|(_, a)| a.split_once('/')).and_then(|(a, _)| a.rsplit_once(':'))
    {
        println!("  postgres       {}   psql -h {host} -p {port} -U apron", e.postgres);
        println!(
            "                 e.g. psql -h {host} -p {port} -U apron -c \"SELECT team, sum(idle_cost_usd) FROM gpu_cost_hourly GROUP BY team\""
        );
    }
    println!("  web UI         {}/", e.http);
    println!("  endpoints      {}", up.data_dir().join("endpoints.json").display());
}

fn machine_hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".to_owned())
}

/// The bucket's keys from the environment, for a `[storage.object_store]` that leaves
/// them out (a Kubernetes Secret or a unit's credentials, never the config file).
fn bucket_credentials() -> apron_collector::storage::Credentials {
    let var = |name| std::env::var(name).ok().filter(|v: &String| !v.is_empty());
    apron_collector::storage::Credentials {
        access_key_id: var("AWS_ACCESS_KEY_ID"),
        secret_access_key: var("AWS_SECRET_ACCESS_KEY"),
    }
}

/// `apron ballista scheduler|executor`: the lake and the query limits from the config
/// file, the rest from flags.
async fn ballista_command(role: BallistaRole) -> anyhow::Result<()> {
    let node = |config: Option<PathBuf>| -> anyhow::Result<apron::ballista::NodeConfig> {
        let file = match &config {
            Some(path) => FileConfig::load(path)?,
            None => FileConfig::default(),
        };
        // Only the lake and the limits: a Ballista node has no listeners or tokens of
        // Apron's (the same file as the query servers' is fine).
        let mut object_store = file.storage.object_store;
        if let Some(os) = object_store.as_mut() {
            os.fill_credentials(&bucket_credentials());
        }
        Ok(apron::ballista::NodeConfig { object_store, query: file.query })
    };
    match role {
        BallistaRole::Scheduler { config, options } => {
            let node = node(config)?;
            // Registered before the scheduler starts, so an early SIGTERM is a clean stop
            // too (the executor handles its own: it drains its tasks first). Jobs in
            // flight fail; their query servers run them themselves or answer 503.
            let shutdown = apron_http::serve::shutdown_signal();
            println!("ballista scheduler on {}", options.bind);
            tokio::select! {
                ran = apron::ballista::run_scheduler(node, options) => ran?,
                () = shutdown => tracing::info!("ballista scheduler stopped"),
            }
        }
        BallistaRole::Executor { config, options } => {
            let node = node(config)?;
            println!(
                "ballista executor on {} (gRPC port {}), scheduler {}",
                options.bind, options.grpc_port, options.scheduler
            );
            apron::ballista::run_executor(node, options).await?;
        }
    }
    Ok(())
}
