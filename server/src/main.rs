//! `apron`: parse arguments and the environment, call the library, print.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context as _;
use apron::up::{DEFAULT_DATA_DIR, DEFAULT_HTTP, Up, UpOptions};
use apron::{FileConfig, Overrides, Server};
use apron_agent::config::SourceKind;
use clap::Parser;

/// Apron: GPU utilisation, idle time and its cost.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    #[command(subcommand)]
    command: Command,
    /// Log filter (tracing EnvFilter syntax), e.g. info or apron_collector=debug.
    #[arg(long, env = "APRON_LOG", default_value = "info", global = true)]
    log: String,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// The server for a deployment: ingest from agents, storage.
    Serve {
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
    },
    /// All in one on this machine: the server and an agent on the local GPUs (or a
    /// simulated fleet), on loopback.
    Up {
        /// HTTP listen address, loopback only (port 0 picks a free port).
        #[arg(long, env = "APRON_HTTP", default_value = DEFAULT_HTTP)]
        http: SocketAddr,
        /// Data directory.
        #[arg(long, env = "APRON_DATA", default_value = DEFAULT_DATA_DIR)]
        data: PathBuf,
        /// PostgreSQL wire address (reserved: not served yet).
        #[arg(long, env = "APRON_PG")]
        pg: Option<String>,
    },
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_new(&args.log).unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    match run(args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("apron: {e:#}");
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
    match args.command {
        Command::Serve { config, http, data, ingest_token } => {
            let file = match &config {
                Some(path) => FileConfig::load(path)?,
                None => FileConfig::default(),
            };
            let config = file.resolve(Overrides { listen: http, data_dir: data, ingest_token })?;
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::bind(config.listen)
                    .await
                    .with_context(|| format!("cannot listen on {}", config.listen))?;
                let addr = listener.local_addr()?;
                let (store, ingest) = (config.store, config.ingest);
                let server = tokio::task::spawn_blocking(move || Server::open(store, ingest)).await??;
                // A line on stdout that scripts and tests wait for: the store is open
                // and the address bound.
                println!("listening on {addr}");
                server.run(listener, shutdown_signal()).await?;
                Ok(())
            })
        }
        Command::Up { http, data, pg } => rt.block_on(async move {
            let options = UpOptions { http, data_dir: data, pg: pg.clone(), hostname: machine_hostname() };
            let up = Up::start(options).await?;
            print_up(&up, pg.as_deref());
            up.run(shutdown_signal()).await?;
            Ok(())
        }),
    }
}

fn print_up(up: &Up, pg: Option<&str>) {
    let e = up.endpoints();
    let c = up.source();
    println!("apron up: data in {}{}", up.data_dir().display(), if up.first_start() { " (new)" } else { "" });
    println!("  http           {}", e.http);
    println!("  metrics        {}", e.metrics);
    println!("  ingest         {}", e.ingest);
    println!("  agent metrics  {}", e.agent_metrics);
    match (c.kind, &c.fallback_reason) {
        (SourceKind::Nvml, _) => println!("  GPU source     nvml: {} GPU(s) on this machine", c.gpus),
        (SourceKind::Sim, Some(why)) => {
            println!("  GPU source     sim: a simulated fleet of {} GPUs ({why})", c.gpus)
        }
        (SourceKind::Sim, None) => println!("  GPU source     sim: a simulated fleet of {} GPUs", c.gpus),
    }
    if let Some(pg) = pg {
        println!("  postgres       not served yet: --pg {pg} is reserved for the PostgreSQL wire port");
    }
    println!("  endpoints      {}", up.data_dir().join("endpoints.json").display());
}

fn machine_hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".to_owned())
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("shutdown signal received");
}
