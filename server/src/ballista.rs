//! `apron ballista scheduler` and `apron ballista executor`: Apache DataFusion Ballista's
//! own scheduler and executor processes, with what Apron's plans need registered —
//! the codec for Apron's tables and the scope's leaf ([`apron_query::distributed`]),
//! Apron's functions (the capped string functions, the sketches) and the lake's bucket
//! (`[storage.object_store]` of the same config file the query servers read).
//!
//! Nothing here schedules or executes: Ballista does. A query server with
//! `[query.ballista] scheduler = "df://host:port"` submits its heavy plans to the
//! scheduler; the executors read the lake and answer over Arrow Flight.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use apron_query::QueryConfig;
use apron_query::distributed::{ApronCodec, Lake, function_registry, node_session};
use ballista_executor::executor_process::{ExecutorProcessConfig, start_executor_process};
use ballista_scheduler::cluster::BallistaCluster;
use ballista_scheduler::config::SchedulerConfig;
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::prelude::SessionConfig;

#[derive(Debug, thiserror::Error)]
pub enum BallistaError {
    #[error("opening the lake ([storage.object_store]): {0}")]
    Lake(#[from] apron_collector::StorageError),
    #[error("Apron's functions: {0}")]
    Functions(datafusion::error::DataFusionError),
    #[error("{0}")]
    Ballista(#[from] ballista_core::error::BallistaError),
    #[error("scheduler {0:?}: expected df://host:port")]
    SchedulerUrl(String),
}

/// What a scheduler or executor needs of the Apron config: the lake and the query
/// limits (the string caps of the functions).
#[derive(Clone, Debug)]
pub struct NodeConfig {
    pub object_store: Option<apron_collector::storage::ObjectStoreConfig>,
    pub query: QueryConfig,
}

impl NodeConfig {
    fn lake(&self) -> Result<Option<Lake>, BallistaError> {
        match &self.object_store {
            Some(c) => Ok(Some(apron_collector::Remote::open(c)?.store())),
            None => {
                tracing::warn!(
                    "no [storage.object_store]: this Ballista node cannot read Apron's tables (plans over them fail)"
                );
                Ok(None)
            }
        }
    }

    /// The session options every job starts from.
    fn session_config(&self, codec: &Arc<ApronCodec>) -> SessionConfig {
        apron_query::distributed::ballista_options(apron_query::engine::session_config(&self.query), codec)
    }
}

/// `apron ballista scheduler` (its flags).
#[derive(Clone, Debug, clap::Args)]
pub struct SchedulerOptions {
    /// gRPC listen address.
    #[arg(long, default_value = "127.0.0.1:50050")]
    pub bind: SocketAddr,
    /// The host name executors and query servers reach this scheduler by.
    #[arg(long, default_value = "localhost")]
    pub external_host: String,
    /// An executor silent this long is lost: its tasks run again elsewhere.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "30s")]
    pub executor_timeout: Duration,
}

/// Runs a Ballista scheduler until the process is stopped.
pub async fn run_scheduler(node: NodeConfig, options: SchedulerOptions) -> Result<(), BallistaError> {
    let lake = node.lake()?;
    let codec = Arc::new(ApronCodec::new(lake.clone()));
    // Fails early on a bad function setup rather than on the first job.
    node_session(node.session_config(&codec), &node.query, lake.as_ref()).map_err(BallistaError::Functions)?;
    let (producer_node, producer_codec) = (node.clone(), codec.clone());
    let (builder_limits, builder_lake) = (node.query.clone(), lake.clone());
    let timeout = options.executor_timeout.as_secs().max(2);
    let config = SchedulerConfig {
        bind_host: options.bind.ip().to_string(),
        bind_port: options.bind.port(),
        external_host: options.external_host,
        executor_timeout_seconds: timeout,
        expire_dead_executor_interval_seconds: (timeout / 4).max(1),
        no_executors_grace_period_seconds: timeout,
        override_config_producer: Some(Arc::new(move || producer_node.session_config(&producer_codec))),
        override_session_builder: Some(Arc::new(move |config: SessionConfig| {
            node_session(config, &builder_limits, builder_lake.as_ref())
        })),
        override_logical_codec: Some(codec.clone()),
        override_physical_codec: Some(codec),
        ..SchedulerConfig::default()
    };
    let cluster = BallistaCluster::new_from_config(&config).await?;
    ballista_scheduler::scheduler_process::start_server(cluster, options.bind, Arc::new(config)).await?;
    Ok(())
}

/// `apron ballista executor` (its flags).
#[derive(Clone, Debug, clap::Args)]
pub struct ExecutorOptions {
    /// The scheduler, df://host:port.
    #[arg(long, default_value = "df://127.0.0.1:50050")]
    pub scheduler: String,
    /// Arrow Flight listen address (results and shuffles).
    #[arg(long, default_value = "127.0.0.1:50051")]
    pub bind: SocketAddr,
    /// The executor's gRPC port (the scheduler's calls), on the --bind host.
    #[arg(long, default_value_t = 50052)]
    pub grpc_port: u16,
    /// The host name the scheduler and query servers reach this executor by.
    #[arg(long)]
    pub external_host: Option<String>,
    /// Tasks at once (0: the CPU count).
    #[arg(long, default_value_t = 0)]
    pub vcores: usize,
    /// Memory for all running tasks together, in bytes (past it, tasks spill to
    /// --work-dir). Default: a share of the host's or cgroup's memory.
    #[arg(long)]
    pub memory_limit_bytes: Option<u64>,
    /// Shuffle files (default: a temporary directory).
    #[arg(long)]
    pub work_dir: Option<String>,
    /// How often the executor tells the scheduler it is alive.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "5s")]
    pub heartbeat: Duration,
}

/// Runs a Ballista executor until the process is stopped.
pub async fn run_executor(node: NodeConfig, options: ExecutorOptions) -> Result<(), BallistaError> {
    let endpoint = apron_query::BallistaConfig { scheduler: options.scheduler.clone(), ..Default::default() }
        .endpoint()
        .map_err(|_| BallistaError::SchedulerUrl(options.scheduler.clone()))?;
    let (host, port) = endpoint
        .trim_start_matches("http://")
        .rsplit_once(':')
        .and_then(|(h, p)| Some((h.to_owned(), p.parse::<u16>().ok()?)))
        .ok_or_else(|| BallistaError::SchedulerUrl(options.scheduler.clone()))?;
    let lake = node.lake()?;
    let codec = Arc::new(ApronCodec::new(lake.clone()));
    let registry = function_registry(
        &node_session(node.session_config(&codec), &node.query, lake.as_ref()).map_err(BallistaError::Functions)?,
    );
    let (producer_node, producer_codec) = (node.clone(), codec.clone());
    let work_dir = options.work_dir.clone();
    let runtime_lake = lake.clone();
    let config = ExecutorProcessConfig {
        bind_host: options.bind.ip().to_string(),
        external_host: options.external_host,
        port: options.bind.port(),
        grpc_port: options.grpc_port,
        scheduler_host: host,
        scheduler_port: port,
        scheduler_connect_timeout_seconds: 30,
        vcores: options.vcores,
        work_dir: options.work_dir,
        memory_pool_size: options.memory_limit_bytes,
        executor_heartbeat_interval_seconds: options.heartbeat.as_secs().max(1),
        print_thread_info: false,
        override_function_registry: Some(Arc::new(registry)),
        override_config_producer: Some(Arc::new(move || producer_node.session_config(&producer_codec))),
        override_runtime_producer: Some(Arc::new(move |_: &SessionConfig| {
            let mut builder = RuntimeEnvBuilder::new();
            if let Some(dir) = &work_dir {
                builder = builder.with_temp_file_path(dir.clone());
            }
            let runtime = builder.build()?;
            if let Some((url, store)) = &runtime_lake {
                let url = datafusion::datasource::object_store::ObjectStoreUrl::parse(url)?;
                runtime.register_object_store(url.as_ref(), store.clone());
            }
            Ok(Arc::new(runtime))
        })),
        override_logical_codec: Some(codec.clone()),
        override_physical_codec: Some(codec),
        ..ExecutorProcessConfig::default()
    };
    start_executor_process(Arc::new(config)).await?;
    Ok(())
}
