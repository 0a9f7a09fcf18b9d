//! `apron-agent`: parse config, open the GPU source, bind, run.

use std::path::PathBuf;

use anyhow::Context as _;
use apron_agent::config::{FileConfig, Overrides, SourceKind};
use apron_agent::source::nvml::{NvmlSource, probe};
use clap::Parser;

/// Apron node agent: samples GPUs (NVML or a simulated fleet) and serves /metrics.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    /// Config file (TOML). Flags and APRON_* environment variables override it.
    #[arg(long, env = "APRON_CONFIG")]
    config: Option<PathBuf>,
    /// GPU source.
    #[arg(long, env = "APRON_SOURCE", value_enum)]
    source: Option<SourceKind>,
    /// Path of libnvidia-ml.so to load (default: the loader's search path).
    #[arg(long, env = "APRON_NVML_LIB")]
    nvml_lib: Option<PathBuf>,
    /// Address for /metrics and /healthz (port 0 picks a free port).
    #[arg(long, env = "APRON_LISTEN")]
    listen: Option<String>,
    /// Prometheus exporter-toolkit web config (TLS, basic auth) for /metrics, like
    /// node_exporter's --web.config.file.
    #[arg(long, env = "APRON_WEB_CONFIG_FILE", alias = "web.config.file")]
    web_config_file: Option<PathBuf>,
    /// Collector URL to ship windows to; several, separated by commas: the sharded
    /// collectors, of which this host takes one by its name.
    #[arg(long, env = "APRON_COLLECTOR")]
    collector: Option<String>,
    /// Bearer token for the collector's ingest API (wins over shipper.token_file and
    /// shipper.token). Prefer the environment variable: flags show in `ps`.
    #[arg(long, env = "APRON_COLLECTOR_TOKEN", hide_env_values = true)]
    collector_token: Option<String>,
    /// Row window, e.g. 1s (per-sampler intervals are set in the file).
    #[arg(long, env = "APRON_WINDOW")]
    window: Option<String>,
    /// Host name to report (default: this machine's).
    #[arg(long, env = "APRON_HOSTNAME")]
    hostname: Option<String>,
    /// Append every closed window as a JSON line to this file.
    #[arg(long, env = "APRON_WINDOWS_OUT")]
    windows_out: Option<PathBuf>,
    /// Log filter (tracing EnvFilter syntax), e.g. info or apron_agent=debug.
    #[arg(long, env = "APRON_LOG", default_value = "info")]
    log: String,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Try every NVML call the samplers make on every GPU and report support and cost.
    Probe {
        /// Calls per NVML function and GPU.
        #[arg(long, default_value_t = 20)]
        repeats: u32,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

fn machine_hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".to_owned())
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    // Colour only for a person at a terminal: files and journald get plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr()) && std::env::var_os("NO_COLOR").is_none();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_new(&args.log).unwrap_or_else(|_| "info".into()))
        .with_ansi(ansi)
        .with_writer(std::io::stderr)
        .init();
    match run(args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("apron-agent: {}", apron_common::error_chain(e.as_ref()));
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> anyhow::Result<()> {
    let file = match &args.config {
        Some(path) => FileConfig::load(path)?,
        None => FileConfig::default(),
    };
    let overrides = Overrides {
        source: args.source,
        nvml_lib: args.nvml_lib,
        listen: args.listen,
        collector: args.collector,
        window: args.window,
        hostname: args.hostname,
        windows_out: args.windows_out,
        collector_token: args.collector_token,
        web_config_file: args.web_config_file,
    };
    let mut config = file.resolve(overrides, &machine_hostname())?;
    // Inside a pod: the in-cluster API server and the node name from the downward API,
    // unless the file names them.
    let k8s = &mut config.attribution.kubernetes;
    if k8s.api_server.is_none()
        && let (Ok(host), Ok(port)) =
            (std::env::var("KUBERNETES_SERVICE_HOST"), std::env::var("KUBERNETES_SERVICE_PORT"))
    {
        let host = if host.contains(':') { format!("[{host}]") } else { host };
        k8s.api_server = Some(format!("https://{host}:{port}"));
    }
    if k8s.node_name.is_none() {
        k8s.node_name = std::env::var("NODE_NAME").ok().filter(|n| !n.is_empty());
    }
    if let Some(Command::Probe { repeats, json }) = args.command {
        let source =
            NvmlSource::open(config.nvml_lib.as_deref(), &config.hostname, config.cluster.as_ref(), config.window)?;
        let report = probe::probe(&source, repeats.max(1));
        if json {
            println!("{}", serde_json::to_string_pretty(&report)?);
        } else {
            print!("{}", probe::render_table(&report));
        }
        return Ok(());
    }
    let source = apron_agent::open_source(&config)?;

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .thread_name("agent-http")
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .with_context(|| format!("cannot listen on {}", config.listen))?;
        let addr = listener.local_addr()?;
        // SIGTERM is handled from here on, before anyone is told the agent is up: a
        // supervisor that stops it right after the line below gets a clean stop.
        let shutdown = apron_http::serve::shutdown_signal();
        tracing::info!("serving {}://{addr}/metrics", config.http.scheme());
        // A line on stdout that scripts and tests can wait for.
        println!("listening on {addr}");
        apron_agent::run(config, source, listener, shutdown).await?;
        Ok(())
    })
}
