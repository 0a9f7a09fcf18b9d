//! Distributed execution: a query server's heavy scans run on an Apache DataFusion
//! Ballista cluster (`[query.ballista] scheduler = "df://host:50050"`).
//!
//! ```text
//!  query server                       ballista scheduler              executors
//!  SQL ─► checks ─► logical plan      decodes the plan (this codec):  decode each stage's
//!         (team's ScopedTables)  ───► ApronTable = a table's files    physical plan (this
//!         distributable and big?      ScopedTable = the team's scope  codec): ScopedScan =
//!         yes: submit (this codec)    plans it physically, cuts it    the scope's own plan
//!         no: run here                into stages ──────────────────► read the lake, run
//!  ◄──── result partitions (Arrow Flight) ◄──────────────────────────────────────┘
//! ```
//!
//! **What travels.** A table is shipped as the list of Parquet files the query server
//! saw when it submitted the plan (the shards' statuses, [`crate::lake`]), never as a
//! prefix to LIST: a LIST would see a merge's inputs beside its output and count rows
//! twice. The scheduler and executors read those files from the same bucket with their
//! own credentials (the same `[storage.object_store]`).
//!
//! **Scoping survives serialization.** A team's tables are [`ScopedTable`]s: on the
//! scheduler they plan, as on the query server, into one [`ScopedExec`] leaf whose
//! inner plan is the scope's filter or semi-join over the real scan; that leaf is what
//! the executors receive and run. No executor is handed a scan of the table without the
//! scope above it, and the user's expressions still run only on scoped rows (the
//! leaf has no children a stage boundary or an optimiser rule could reach into).
//!
//! **What runs here instead.** Plans that read anything but stored lake tables (the
//! derived tables merged from the shards' in-memory records, `alerts`,
//! `recommendations`, the catalogs), `EXPLAIN`, and plans whose tables hold fewer than
//! `min_scan_bytes` of files. A query the cluster fails (an executor lost, the
//! scheduler down) runs here once more when `fallback_local` is set, else fails with
//! [`QueryError::Cluster`]; either way the result is whole or absent, never a part.

use std::collections::HashMap;
use std::sync::Arc;

use ballista_core::execution_plans::DistributedQueryExec;
use ballista_core::extension::{SessionConfigExt, SessionStateExt};
use ballista_core::registry::BallistaFunctionRegistry;
use ballista_core::serde::protobuf::CancelJobParams;
use ballista_core::serde::protobuf::scheduler_grpc_client::SchedulerGrpcClient;
use ballista_core::serde::{BallistaLogicalExtensionCodec, BallistaPhysicalExtensionCodec};
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::catalog::TableProvider;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{DataFusionError, Result as DfResult, TableReference};
use datafusion::datasource::source_as_provider;
use datafusion::execution::{SessionState, TaskContext};
use datafusion::logical_expr::{Extension, LogicalPlan};
use datafusion::object_store::ObjectStore;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::prelude::SessionConfig;
use datafusion_proto::logical_plan::LogicalExtensionCodec;
use datafusion_proto::physical_plan::{AsExecutionPlan, PhysicalExtensionCodec, PhysicalProtoConverterExtension};
use datafusion_proto::protobuf::{LogicalPlanNode, PhysicalPlanNode};
use serde::{Deserialize, Serialize};

use crate::error::QueryError;
use crate::provider::ApronTable;
use crate::scope::{ScopedExec, ScopedTable};
use crate::source::{DataFile, SourceError, TableSnapshot, TableSource};

/// `[query.ballista]`: where a query server sends its heavy scans.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BallistaConfig {
    /// The scheduler, `df://host:port` (Ballista's own URL form; port 50050 when left
    /// out).
    pub scheduler: String,
    /// A query whose tables hold fewer bytes of Parquet (before any pruning) runs on the
    /// query server itself: shipping a plan, scheduling its stages and fetching the
    /// result over Flight costs tens of milliseconds that a small scan does not repay.
    pub min_scan_bytes: u64,
    /// When the cluster fails a query, run it on the query server once more (under the
    /// same limits) instead of answering [`QueryError::Cluster`].
    pub fallback_local: bool,
}

impl Default for BallistaConfig {
    fn default() -> Self {
        BallistaConfig { scheduler: String::new(), min_scan_bytes: 256 << 20, fallback_local: true }
    }
}

impl BallistaConfig {
    /// The scheduler's gRPC endpoint (`http://host:port`), or why `scheduler` is not a
    /// scheduler URL.
    pub fn endpoint(&self) -> Result<String, String> {
        let rest = self
            .scheduler
            .strip_prefix("df://")
            .ok_or_else(|| format!("scheduler = {:?}: expected df://host:port", self.scheduler))?;
        let rest = rest.trim_end_matches('/');
        let (host, port) = match rest.rsplit_once(':') {
            Some((h, p)) => (h, p.parse::<u16>().map_err(|_| format!("scheduler = {:?}: bad port", self.scheduler))?),
            None => (rest, 50050),
        };
        if host.is_empty() || host.contains('/') {
            return Err(format!("scheduler = {:?}: expected df://host:port", self.scheduler));
        }
        Ok(format!("http://{host}:{port}"))
    }
}

/// Counts of queries sent to the cluster, for `/metrics` and tests.
#[derive(Debug, Default)]
pub struct DistributedStats {
    /// Queries the cluster answered.
    pub answered: std::sync::atomic::AtomicU64,
    /// Queries the cluster failed (then run here, or failed with `Cluster`).
    pub failed: std::sync::atomic::AtomicU64,
}

/// Cancels a cluster job whose answer nobody will read: dropped before the whole
/// result was read (the query's timeout, a result cap, a client gone), the job would
/// otherwise run on and hold the executors' task slots that the next queries wait for.
/// Ballista's client stops polling a dropped job but never cancels it.
#[derive(Debug)]
pub struct JobGuard {
    exec: Option<Arc<dyn ExecutionPlan>>,
    scheduler: String,
}

impl JobGuard {
    /// A guard for `plan` when it is a job submitted to the scheduler at `scheduler`
    /// (`http://host:port`); a plan that runs here needs none.
    pub fn new(plan: &Arc<dyn ExecutionPlan>, scheduler: String) -> JobGuard {
        let exec = plan.is::<DistributedQueryExec<LogicalPlanNode>>().then(|| plan.clone());
        JobGuard { exec, scheduler }
    }

    /// The whole result was read: nothing to cancel.
    pub fn finished(mut self) {
        self.exec = None;
    }
}

impl Drop for JobGuard {
    fn drop(&mut self) {
        let Some(exec) = self.exec.take() else { return };
        let Some(job) = exec.downcast_ref::<DistributedQueryExec<LogicalPlanNode>>().and_then(|e| e.job_id()) else {
            // Not submitted yet (or the submission failed): nothing runs.
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        let scheduler = std::mem::take(&mut self.scheduler);
        runtime.spawn(async move {
            let job_id = job.into_inner();
            let cancelled = async {
                let mut client = SchedulerGrpcClient::connect(scheduler).await.map_err(|e| e.to_string())?;
                client.cancel_job(CancelJobParams { job_id: job_id.clone() }).await.map_err(|e| e.message().to_owned())
            };
            match tokio::time::timeout(std::time::Duration::from_secs(10), cancelled).await {
                Ok(Ok(_)) => tracing::info!(job_id, "cancelled a cluster job whose answer is no longer wanted"),
                Ok(Err(e)) => tracing::warn!(job_id, error = %e, "could not cancel a cluster job"),
                Err(_) => {
                    tracing::warn!(job_id, "could not cancel a cluster job: the scheduler did not answer in 10 s")
                }
            }
        });
    }
}

/// Why a plan runs on the query server, or the bytes it would read on the cluster.
pub fn distributable(plan: &LogicalPlan) -> Result<u64, &'static str> {
    let (mut bytes, mut tables) = (0u64, 0usize);
    let mut refusal = None;
    let _ = plan.apply_with_subqueries(|node| {
        let why = match node {
            LogicalPlan::Explain(_) | LogicalPlan::Analyze(_) => Some("EXPLAIN runs here"),
            LogicalPlan::Extension(_) | LogicalPlan::DescribeTable(_) | LogicalPlan::Statement(_) => {
                Some("the plan has a node only this server runs")
            }
            LogicalPlan::TableScan(scan) => match source_as_provider(&scan.source) {
                Ok(p) => match lake_bytes(p.as_ref()) {
                    Some(b) => {
                        bytes = bytes.saturating_add(b);
                        tables += 1;
                        None
                    }
                    None => Some("a table is not a stored lake table"),
                },
                Err(_) => Some("a table is not a stored lake table"),
            },
            _ => None,
        };
        match why {
            Some(w) => {
                refusal = Some(w);
                Ok(TreeNodeRecursion::Stop)
            }
            None => Ok(TreeNodeRecursion::Continue),
        }
    });
    match refusal {
        Some(w) => Err(w),
        None if tables == 0 => Err("the plan reads no stored table"),
        None => Ok(bytes),
    }
}

/// The bytes of files behind `provider` when it is a stored lake table (or a team's
/// view of one) that the cluster can read; `None` otherwise.
fn lake_bytes(provider: &dyn TableProvider) -> Option<u64> {
    if let Some(t) = provider.downcast_ref::<ApronTable>() {
        let snapshot = t.source().snapshot(t.table().name()).ok()?;
        // Rows only in a collector's memory cannot be shipped.
        if !snapshot.batches.is_empty() || t.source().object_store().is_none() {
            return None;
        }
        return Some(snapshot.files.iter().map(|f| f.bytes).sum());
    }
    if let Some(s) = provider.downcast_ref::<ScopedTable>() {
        let (_, _, inner, allocations) = s.parts();
        let a = match allocations {
            Some(a) => lake_bytes(a.as_ref())?,
            None => 0,
        };
        return Some(lake_bytes(inner.as_ref())? + a);
    }
    None
}

/// `state` made to run its plans on the cluster at `config`'s scheduler, with Apron's
/// codecs.
pub fn cluster_state(
    state: SessionState,
    config: &BallistaConfig,
    codec: &Arc<ApronCodec>,
) -> Result<SessionState, QueryError> {
    let endpoint = config.endpoint().map_err(|detail| QueryError::Cluster { detail })?;
    let session = ballista_options(state.config().clone(), codec);
    let state = datafusion::execution::SessionStateBuilder::new_from_existing(state).with_config(session).build();
    state.upgrade_for_ballista(endpoint).map_err(|e| QueryError::Cluster { detail: e.strip_backtrace() })
}

/// True for a session Ballista made (a scheduler's or an executor's, or one upgraded
/// to submit to a cluster).
pub fn is_ballista_session(config: &SessionConfig) -> bool {
    config.options().extensions.get::<ballista_core::config::BallistaConfig>().is_some()
}

/// `config` with Apron's codecs and Ballista's static planner. The adaptive planner
/// (AQE) turns hash joins into joins it resolves stage by stage; the join inside a
/// team's scope is planned whole into one leaf ([`ScopedExec`]), where no stage would
/// ever resolve it, so jobs are planned statically.
pub fn ballista_options(config: SessionConfig, codec: &Arc<ApronCodec>) -> SessionConfig {
    config
        .upgrade_for_ballista()
        .with_ballista_adaptive_query_planner(false)
        .with_ballista_logical_extension_codec(codec.clone())
        .with_ballista_physical_extension_codec(codec.clone())
}

/// Apron's functions as an executor's registry (the string caps of `limits`, the
/// sketches), so a decoded plan's functions are the ones the query server planned.
pub fn function_registry(state: &SessionState) -> BallistaFunctionRegistry {
    BallistaFunctionRegistry {
        scalar_functions: state.scalar_functions().clone(),
        aggregate_functions: state.aggregate_functions().clone(),
        window_functions: state.window_functions().clone(),
        higher_order_functions: state.higher_order_functions().clone(),
    }
}

/// The lake a codec reads from: the bucket's URL (`s3://bucket`) and the store.
pub type Lake = (String, Arc<dyn ObjectStore>);

/// Encodes Apron's tables and the scope's leaf for Ballista; everything else goes to
/// Ballista's own codecs (shuffles, its plans).
#[derive(Debug)]
pub struct ApronCodec {
    lake: Option<Lake>,
    logical: BallistaLogicalExtensionCodec,
    physical: BallistaPhysicalExtensionCodec,
}

impl ApronCodec {
    /// `lake`: the bucket the decoded tables read (`None` on the query server, which
    /// only encodes).
    pub fn new(lake: Option<Lake>) -> ApronCodec {
        ApronCodec { lake, logical: Default::default(), physical: Default::default() }
    }
}

/// Apron's messages start with this (a byte no protobuf message of Ballista's starts
/// with: field 31 of wire type 7 does not exist).
const MAGIC: &[u8] = b"\xffAPRON1";

#[derive(Serialize, Deserialize)]
enum Message {
    /// A stored table as the files it had at submission.
    Table { table: String, url: String, files: Vec<File> },
    /// A team's view of a table (the inner and allocations providers encoded as
    /// [`Message::Table`]).
    Scoped { table: String, team: String, provider: Box<Message>, allocations: Option<Box<Message>> },
    /// The scope's leaf; its inner plan follows the header as a `PhysicalPlanNode`.
    ScopedExec { table: String, team: String },
}

#[derive(Serialize, Deserialize)]
struct File {
    path: String,
    bytes: u64,
    day: Option<i64>,
}

fn encode_message(m: &Message, tail: &[u8], buf: &mut Vec<u8>) -> DfResult<()> {
    let header = serde_json::to_vec(m).map_err(|e| DataFusionError::Internal(e.to_string()))?;
    buf.extend_from_slice(MAGIC);
    buf.extend_from_slice(&(header.len() as u32).to_le_bytes());
    buf.extend_from_slice(&header);
    buf.extend_from_slice(tail);
    Ok(())
}

/// `(message, tail)` when `buf` is one of Apron's.
fn decode_message(buf: &[u8]) -> DfResult<Option<(Message, &[u8])>> {
    let Some(rest) = buf.strip_prefix(MAGIC) else { return Ok(None) };
    let bad = || DataFusionError::Internal("a truncated Apron plan message".into());
    let (len, rest) = rest.split_first_chunk::<4>().ok_or_else(bad)?;
    let len = u32::from_le_bytes(*len) as usize;
    let header = rest.get(..len).ok_or_else(bad)?;
    let m =
        serde_json::from_slice(header).map_err(|e| DataFusionError::Internal(format!("an Apron plan message: {e}")))?;
    Ok(Some((m, &rest[len..])))
}

impl ApronCodec {
    fn table_message(provider: &dyn TableProvider) -> DfResult<Message> {
        let unsupported = || DataFusionError::NotImplemented("this table runs on the query server only".into());
        if let Some(t) = provider.downcast_ref::<ApronTable>() {
            let TableSnapshot { batches, files } =
                t.source().snapshot(t.table().name()).map_err(|e| DataFusionError::External(Box::new(e)))?;
            let (url, _) = t.source().object_store().ok_or_else(unsupported)?;
            if !batches.is_empty() {
                return Err(unsupported());
            }
            let files = files
                .into_iter()
                .map(|f| File { path: f.path.to_string_lossy().into_owned(), bytes: f.bytes, day: f.day })
                .collect();
            return Ok(Message::Table { table: t.table().name().to_owned(), url, files });
        }
        if let Some(s) = provider.downcast_ref::<ScopedTable>() {
            let (table, team, inner, allocations) = s.parts();
            return Ok(Message::Scoped {
                table: table.to_owned(),
                team: team.as_str().to_owned(),
                provider: Box::new(Self::table_message(inner.as_ref())?),
                allocations: allocations.map(|a| Self::table_message(a.as_ref()).map(Box::new)).transpose()?,
            });
        }
        Err(unsupported())
    }

    fn table_provider(&self, m: Message) -> DfResult<Arc<dyn TableProvider>> {
        match m {
            Message::Table { table, url, files } => {
                let t = apron_collector::Table::from_name(&table)
                    .ok_or_else(|| DataFusionError::Plan(format!("no stored table {table}")))?;
                let (lake_url, store) = self.lake.clone().ok_or_else(|| {
                    DataFusionError::Configuration("this Ballista node has no [storage.object_store]".into())
                })?;
                if lake_url != url {
                    return Err(DataFusionError::Configuration(format!(
                        "the plan reads {url}, this Ballista node's lake is {lake_url}"
                    )));
                }
                let schema = apron_collector::schema::storage_schema(t);
                let files =
                    files.into_iter().map(|f| DataFile { path: f.path.into(), bytes: f.bytes, day: f.day }).collect();
                let source = Arc::new(ShippedFiles { table, schema: schema.clone(), files, lake: (url, store) });
                Ok(Arc::new(ApronTable::new(t, schema, source)))
            }
            Message::Scoped { table, team, provider, allocations } => {
                let table = crate::tables::table_def(&table)
                    .map(|d| d.name)
                    .ok_or_else(|| DataFusionError::Plan(format!("no table {table}")))?;
                let team = apron_common::TeamName::new(&team).map_err(|e| DataFusionError::Plan(e.to_string()))?;
                let provider = self.table_provider(*provider)?;
                let allocations = allocations.map(|a| self.table_provider(*a)).transpose()?;
                crate::scope::scoped_provider(table, provider, allocations.as_ref(), &team)?
                    .ok_or_else(|| DataFusionError::Plan(format!("{table} has no scope rule")))
            }
            Message::ScopedExec { .. } => {
                Err(DataFusionError::Internal("a plan node where a table was expected".into()))
            }
        }
    }
}

impl LogicalExtensionCodec for ApronCodec {
    fn try_decode(&self, buf: &[u8], inputs: &[LogicalPlan], ctx: &TaskContext) -> DfResult<Extension> {
        self.logical.try_decode(buf, inputs, ctx)
    }

    fn try_encode(&self, node: &Extension, buf: &mut Vec<u8>) -> DfResult<()> {
        self.logical.try_encode(node, buf)
    }

    fn try_decode_table_provider(
        &self,
        buf: &[u8],
        table_ref: &TableReference,
        schema: SchemaRef,
        ctx: &TaskContext,
    ) -> DfResult<Arc<dyn TableProvider>> {
        match decode_message(buf)? {
            Some((m, _)) => self.table_provider(m),
            None => self.logical.try_decode_table_provider(buf, table_ref, schema, ctx),
        }
    }

    fn try_encode_table_provider(
        &self,
        table_ref: &TableReference,
        node: Arc<dyn TableProvider>,
        buf: &mut Vec<u8>,
    ) -> DfResult<()> {
        if node.is::<ApronTable>() || node.is::<ScopedTable>() {
            return encode_message(&Self::table_message(node.as_ref())?, &[], buf);
        }
        self.logical.try_encode_table_provider(table_ref, node, buf)
    }

    fn try_decode_file_format(
        &self,
        buf: &[u8],
        ctx: &TaskContext,
    ) -> DfResult<Arc<dyn datafusion::datasource::file_format::FileFormatFactory>> {
        self.logical.try_decode_file_format(buf, ctx)
    }

    fn try_encode_file_format(
        &self,
        buf: &mut Vec<u8>,
        node: Arc<dyn datafusion::datasource::file_format::FileFormatFactory>,
    ) -> DfResult<()> {
        self.logical.try_encode_file_format(buf, node)
    }
}

impl PhysicalExtensionCodec for ApronCodec {
    fn try_decode(
        &self,
        buf: &[u8],
        inputs: &[Arc<dyn ExecutionPlan>],
        ctx: &TaskContext,
        proto_converter: &dyn PhysicalProtoConverterExtension,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        match decode_message(buf)? {
            Some((Message::ScopedExec { table, team }, tail)) => {
                let table = crate::tables::table_def(&table)
                    .map(|d| d.name)
                    .ok_or_else(|| DataFusionError::Plan(format!("no table {table}")))?;
                let team = apron_common::TeamName::new(&team).map_err(|e| DataFusionError::Plan(e.to_string()))?;
                let inner = PhysicalPlanNode::try_decode(tail)?.try_into_physical_plan(ctx, self)?;
                Ok(Arc::new(ScopedExec::new(table, team, inner)))
            }
            Some(_) => Err(DataFusionError::Internal("a table where a plan node was expected".into())),
            None => self.physical.try_decode(buf, inputs, ctx, proto_converter),
        }
    }

    fn try_encode(
        &self,
        node: Arc<dyn ExecutionPlan>,
        buf: &mut Vec<u8>,
        proto_converter: &dyn PhysicalProtoConverterExtension,
    ) -> DfResult<()> {
        if let Some(s) = node.downcast_ref::<ScopedExec>() {
            let (table, team, inner) = s.parts();
            let mut tail = Vec::new();
            PhysicalPlanNode::try_from_physical_plan(inner.clone(), self)?.try_encode(&mut tail)?;
            let m = Message::ScopedExec { table: table.to_owned(), team: team.as_str().to_owned() };
            return encode_message(&m, &tail, buf);
        }
        self.physical.try_encode(node, buf, proto_converter)
    }
}

/// A table's files as the query server shipped them (the scheduler's view of a table).
#[derive(Debug)]
struct ShippedFiles {
    table: String,
    schema: SchemaRef,
    files: Vec<DataFile>,
    lake: Lake,
}

impl TableSource for ShippedFiles {
    fn schema(&self, table: &str) -> Option<SchemaRef> {
        (table == self.table).then(|| self.schema.clone())
    }

    fn snapshot(&self, table: &str) -> Result<TableSnapshot, SourceError> {
        if table != self.table {
            return Err(SourceError::Lake(format!("{table} was not shipped with this plan")));
        }
        Ok(TableSnapshot { batches: Vec::new(), files: self.files.clone() })
    }

    fn object_store(&self) -> Option<(String, Arc<dyn ObjectStore>)> {
        Some(self.lake.clone())
    }
}

/// A scheduler's or executor's session: Apron's options and functions over `config`
/// (the options the query server sent with the job).
pub fn node_session(config: SessionConfig, limits: &crate::QueryConfig, lake: Option<&Lake>) -> DfResult<SessionState> {
    let runtime = datafusion::execution::runtime_env::RuntimeEnvBuilder::new().build_arc()?;
    if let Some((url, store)) = lake {
        let url = datafusion::datasource::object_store::ObjectStoreUrl::parse(url)?;
        runtime.register_object_store(url.as_ref(), store.clone());
    }
    let mut state = datafusion::execution::SessionStateBuilder::new()
        .with_config(config)
        .with_runtime_env(runtime)
        .with_default_features()
        .with_table_factories(HashMap::new())
        // The scheduler plans each job's stages with this session: its joins yield as
        // the query server's do, so a cancelled job's tasks stop on the executors
        // (an executor aborts a task only at its next yield).
        .with_physical_optimizer_rule(Arc::new(crate::guard::YieldInJoins))
        .build();
    crate::engine::register_functions(&mut state, limits)?;
    Ok(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scheduler_urls() {
        let c = |s: &str| BallistaConfig { scheduler: s.into(), ..BallistaConfig::default() }.endpoint();
        assert_eq!(c("df://sched:50050").as_deref(), Ok("http://sched:50050"));
        assert_eq!(c("df://10.0.0.5").as_deref(), Ok("http://10.0.0.5:50050"));
        assert!(c("http://sched:50050").is_err());
        assert!(c("df://:1").is_err());
        assert!(c("df://h:port").is_err());
    }

    #[tokio::test]
    async fn only_plans_over_stored_lake_tables_go_to_the_cluster() {
        use datafusion::arrow::array::Int64Array;
        use datafusion::arrow::datatypes::{DataType, Field, Schema};
        use datafusion::arrow::record_batch::RecordBatch;
        let ctx = datafusion::prelude::SessionContext::new();
        let schema = Arc::new(Schema::new(vec![Field::new("x", DataType::Int64, false)]));
        let batch = RecordBatch::try_new(schema.clone(), vec![Arc::new(Int64Array::from(vec![1]))]).expect("batch");
        let mem = datafusion::datasource::MemTable::try_new(schema, vec![vec![batch]]).expect("mem");
        ctx.register_table("t", Arc::new(mem)).expect("register");
        let plan = |sql: &'static str| {
            let ctx = ctx.clone();
            async move { ctx.state().create_logical_plan(sql).await.expect("plan") }
        };
        assert_eq!(distributable(&plan("SELECT 1").await), Err("the plan reads no stored table"));
        assert_eq!(distributable(&plan("SELECT x FROM t").await), Err("a table is not a stored lake table"));
        assert_eq!(distributable(&plan("EXPLAIN SELECT 1").await), Err("EXPLAIN runs here"));
        assert_eq!(
            distributable(&plan("SELECT 1 WHERE EXISTS (SELECT x FROM t)").await),
            Err("a table is not a stored lake table"),
            "subqueries are looked at too"
        );
    }

    #[test]
    fn messages_round_trip_and_foreign_bytes_are_not_ours() {
        let m = Message::ScopedExec { table: "gpu_samples".into(), team: "ml".into() };
        let mut buf = Vec::new();
        encode_message(&m, b"tail", &mut buf).expect("encode");
        let (back, tail) = decode_message(&buf).expect("decode").expect("ours");
        assert!(matches!(back, Message::ScopedExec { ref table, ref team } if table == "gpu_samples" && team == "ml"));
        assert_eq!(tail, b"tail");
        assert!(decode_message(b"\x0a\x03abc").expect("foreign").is_none());
        assert!(decode_message(&buf[..MAGIC.len() + 2]).is_err(), "truncated");
    }
}
