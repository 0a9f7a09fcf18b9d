//! Row scoping: what a `team:<name>` principal may see, enforced in the plan — and
//! enforced *first*.
//!
//! A scoped query runs in a session whose catalog holds, under every table's usual name,
//! a [`ScopedTable`] over the real table — never the real table itself — so whatever the
//! SQL says (joins, subqueries, CTEs, `UNION`, `information_schema`, qualified names) it
//! can only reach scoped rows. The SQL text is never looked at or rewritten.
//!
//! ```text
//!  allocations, gpu_cost_hourly,          Filter team = '<name>'
//!  alerts, recommendations             ─► └─ TableScan <table>
//!
//!  gpu_samples, gpu_processes,            RightSemi join on gpu_uuid = a.gpu_uuid
//!  gpu_samples_1m                      ─►   AND time > a.start_time
//!                                           AND (a.end_time IS NULL OR time <= a.end_time)
//!                                               (1m: time + 1 min <= coalesce(a.end_time,
//!                                                                  a.held_through))
//!                                           AND the row's holder is a's (below)
//!                                         ├─ Filter team = '<name>' └─ TableScan allocations
//!                                         └─ TableScan <table>
//! ```
//!
//! **Scope first.** No expression of the user's query is ever evaluated on a row the
//! scope removes: an expression that can fail (`CAST(owner AS INT)`, `1/x`, a regex
//! built from a value) would otherwise turn the error message into an oracle on hidden
//! rows. So the scoped plan above is planned and optimised on its own, inside
//! [`ScopedTable::scan`], and handed to the query as one leaf, [`ScopedExec`], with no
//! children: no optimiser rule of the user's query (logical filter pushdown, physical
//! filter pushdown, dynamic filters of joins and TopK, projection pushdown) can move a
//! user expression below it, and `EXPLAIN` shows neither the files nor the row counts
//! behind it. The only user predicates that go below are time ranges
//! ([`prunes_below_scope`]: predicates that [`cannot_fail`] — comparisons of a column
//! with a constant, `IS NULL`, `IN (constants)`, `BETWEEN`, `AND`/`OR`/`NOT` of those —
//! over `time` or `hour` only): they prune partitions, files and row groups by time,
//! which every GPU has rows for whoever holds it. A predicate on another column would
//! prune by hidden rows' values, and the speed of a query that answers the same either
//! way told whether another team's GPU or namespace exists; those run above the scope,
//! on the scope's rows only.
//! New tables inherit this by having a [`Rule`]; a table without one is left out of
//! scoped sessions (fail closed).
//!
//! **Whose row.** Windows and process samples are labelled by their end, and an
//! allocation runs from the start of its first window to the end of its last, so a row
//! belongs to an allocation when its `time` is in `(start_time, end_time]` — the
//! previous holder's last window stays theirs, the next holder's first is theirs. A
//! minute of `gpu_samples_1m` is labelled by its start and holds the windows ending in
//! `[time, time + 1 min)`; it must lie wholly inside one allocation (a minute that spans
//! a hand-over mixes two holders and is no one's): `time > start_time` and
//! `time + 1 min <= end_time`. The
//! ledger keeps a holder's latest allocation open (`end_time` NULL) between passes, so a
//! window or process row must also name the allocation's holder itself: `owner_kind` and
//! `owner` of a window, `namespace/pod` or `job_id` of a process (static and process-user
//! allocations hold only rows that name no pod or job). A hand-over is therefore visible
//! in the very next row, not only after the next ledger pass. Minutes carry no holder:
//! an open allocation covers minutes only up to its `held_through`, the newest window the
//! ledger saw held, so a minute after a hand-over is never the previous holder's (and a
//! holder's own newest minutes appear with the next pass: fail closed).
//! The allocations side is the (small) build side of the hash join; the rows stream
//! through it.

use std::fmt;
use std::sync::Arc;

use apron_common::TeamName;
use async_trait::async_trait;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::catalog::{Session, TableProvider};
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{Column, Result as DfResult};
use datafusion::datasource::provider_as_source;
use datafusion::execution::TaskContext;
use datafusion::logical_expr::utils::conjunction;
use datafusion::logical_expr::{
    Expr, JoinType, LogicalPlanBuilder, Operator, TableProviderFilterPushDown, TableType, lit,
};
use datafusion::physical_expr::{EquivalenceProperties, PhysicalExpr};
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType, ReplaceChildrenOptions};
use datafusion::physical_plan::filter_pushdown::{
    ChildPushdownResult, FilterDescription, FilterPushdownPhase, FilterPushdownPropagation,
};
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, Partitioning, PlanProperties, SendableRecordBatchStream,
};

/// Whose rows a query may read.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Scope {
    /// Every row (`viewer`, `admin`, and the server's own queries).
    All,
    /// Only the rows of one team (`team:<name>`).
    Team(TeamName),
}

impl Scope {
    /// True for a principal that must not learn anything about rows outside its scope
    /// (errors lose their values, `EXPLAIN` hides what the scope reads).
    pub fn is_scoped(&self) -> bool {
        matches!(self, Scope::Team(_))
    }
}

/// How a table is cut down to one team's rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// The table has a `team` column.
    TeamColumn,
    /// The rows of a GPU during the team's allocations of it, and only while the row's
    /// own holder is the allocation's ([`Held`]).
    AllocatedIntervals(Held),
}

/// How a row of a GPU table says who held the GPU, so that a hand-over is seen in the
/// row itself and not only when the cost ledger next closes the allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Held {
    /// A window labelled by its end (`time`), with the holder's `owner_kind`/`owner`.
    Window,
    /// A process sample at `time`, with the holder's `namespace`/`pod` or `job_id`.
    Process,
    /// A minute labelled by its start (`time`); it carries no holder, so the whole
    /// minute must lie inside the allocation.
    Minute,
}

/// The rule for `table` ([`crate::tables::TABLES`]); `None`: the table is hidden from
/// scoped sessions.
pub fn rule(table: &str) -> Option<Rule> {
    crate::tables::table_def(table).map(|t| t.scope)
}

/// `table` as `team` sees it, given the real `allocations` provider (needed by
/// [`Rule::AllocatedIntervals`]). `Ok(None)` when the table has no rule, or needs
/// allocations and there are none: the table is then not offered at all.
pub fn scoped_provider(
    table: &'static str,
    provider: Arc<dyn TableProvider>,
    allocations: Option<&Arc<dyn TableProvider>>,
    team: &TeamName,
) -> DfResult<Option<Arc<dyn TableProvider>>> {
    let Some(rule) = rule(table) else { return Ok(None) };
    let allocations = match rule {
        Rule::TeamColumn => None,
        Rule::AllocatedIntervals(_) => match allocations {
            Some(a) => Some(a.clone()),
            None => return Ok(None),
        },
    };
    Ok(Some(Arc::new(ScopedTable { table, rule, team: team.clone(), provider, allocations })))
}

/// A [`ScopedTable`]'s table, team, real provider and allocations provider.
pub(crate) type ScopedParts<'a> =
    (&'static str, &'a TeamName, &'a Arc<dyn TableProvider>, Option<&'a Arc<dyn TableProvider>>);

/// A table as one team sees it. It presents itself as the base table it stands for (so
/// `information_schema` and `SHOW TABLES` look the same to every principal).
#[derive(Debug)]
pub struct ScopedTable {
    table: &'static str,
    rule: Rule,
    team: TeamName,
    provider: Arc<dyn TableProvider>,
    allocations: Option<Arc<dyn TableProvider>>,
}

/// A name no SQL can refer to: it lives only inside the scope's own plan.
const HELD: &str = "apron_scope_held";

impl ScopedTable {
    /// The table, the team, the real provider and the allocations provider (for
    /// shipping the scope to a Ballista scheduler, [`crate::distributed`]).
    pub(crate) fn parts(&self) -> ScopedParts<'_> {
        (self.table, &self.team, &self.provider, self.allocations.as_ref())
    }

    /// The scope's plan: the rule's rows, then (only then) `safe` user predicates
    /// and the projection.
    fn plan(&self, projection: Option<&Vec<usize>>, safe: &[Expr]) -> DfResult<datafusion::logical_expr::LogicalPlan> {
        let table = self.table;
        let c = |q: &str, name: &str| Expr::Column(Column::new(Some(q), name));
        let team_is = |q: &str| c(q, "team").eq(lit(self.team.as_str()));
        // Infallible predicates go right onto the table's scan, where they prune.
        let mut scan = LogicalPlanBuilder::scan(table, provider_as_source(self.provider.clone()), None)?;
        if let Some(p) = conjunction(safe.iter().cloned()) {
            scan = scan.filter(p)?;
        }
        let scoped = match (self.rule, &self.allocations) {
            (Rule::TeamColumn, _) => scan.filter(team_is(table))?,
            (Rule::AllocatedIntervals(held_by), Some(allocations)) => {
                let held = LogicalPlanBuilder::scan(HELD, provider_as_source(allocations.clone()), None)?
                    .filter(team_is(HELD))?
                    .build()?;
                let (t, a) = (|n: &str| c(table, n), |n: &str| c(HELD, n));
                // An allocation runs from the start of its first window to the end of its
                // last, and windows are labelled by their end: a row belongs to it when
                // its windows' ends are in (start_time, end_time], so no row crosses a
                // hand-over. A minute holds the windows ending in [time, time + 1 min).
                let starts_after = t("time").gt(a("start_time"));
                let ends_before = match held_by {
                    // A minute has no holder of its own: an open allocation covers it only
                    // up to the newest window the ledger saw held (NULL: not at all).
                    Held::Minute => {
                        let minute = lit(datafusion::common::ScalarValue::new_interval_mdn(0, 0, 60_000_000_000));
                        (t("time") + minute).lt_eq(datafusion::functions::core::expr_fn::coalesce(vec![
                            a("end_time"),
                            a("held_through"),
                        ]))
                    }
                    Held::Window | Held::Process => a("end_time").is_null().or(t("time").lt_eq(a("end_time"))),
                };
                // Until the ledger closes an allocation its end is NULL; the row's own
                // holder columns say whether the GPU has changed hands since.
                let kind = |k: &str| a("owner_kind").eq(lit(k));
                let unowned = a("owner_kind").in_list(vec![lit("pod"), lit("slurm_job")], true);
                let holder = match held_by {
                    Held::Window => (a("owner_kind")
                        .in_list(vec![lit("pod"), lit("slurm_job")], false)
                        .and(t("owner_kind").eq(a("owner_kind")))
                        .and(t("owner").eq(a("owner"))))
                    .or(unowned.and(t("owner").is_null())),
                    Held::Process => {
                        let pod =
                            datafusion::functions::string::expr_fn::concat(vec![t("namespace"), lit("/"), t("pod")]);
                        (kind("pod").and(pod.eq(a("owner"))))
                            .or(kind("slurm_job").and(t("job_id").eq(a("owner"))))
                            .or(unowned.and(t("pod").is_null()).and(t("job_id").is_null()))
                    }
                    Held::Minute => lit(true),
                };
                let on = [t("gpu_uuid").eq(a("gpu_uuid")), starts_after, ends_before, holder];
                LogicalPlanBuilder::from(held).join_on(scan.build()?, JoinType::RightSemi, on)?
            }
            (Rule::AllocatedIntervals(_), None) => {
                return datafusion::common::internal_err!("{table} is scoped by allocations, which are missing");
            }
        };
        let schema = self.provider.schema();
        let columns: Vec<Expr> = match projection {
            Some(p) => p.iter().map(|&i| c(table, schema.field(i).name())).collect(),
            None => schema.fields().iter().map(|f| c(table, f.name())).collect(),
        };
        scoped.project(columns)?.build()
    }
}

#[async_trait]
impl TableProvider for ScopedTable {
    fn schema(&self) -> SchemaRef {
        self.provider.schema()
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    fn supports_filters_pushdown(&self, filters: &[&Expr]) -> DfResult<Vec<TableProviderFilterPushDown>> {
        // Inexact: DataFusion keeps every user filter above the scan as well; the ones
        // handed to `scan` only prune.
        Ok(filters
            .iter()
            .map(|f| {
                if prunes_below_scope(f) {
                    TableProviderFilterPushDown::Inexact
                } else {
                    TableProviderFilterPushDown::Unsupported
                }
            })
            .collect())
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        _limit: Option<usize>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        // Filters reach `scan` qualified by whatever the query called the table; the
        // scope's plan names it by its own name. Re-check: only time ranges that cannot fail.
        let safe: Vec<Expr> =
            filters.iter().filter(|f| prunes_below_scope(f)).map(unqualified).collect::<DfResult<_>>()?;
        let plan = self.plan(projection, &safe)?;
        if !crate::distributed::is_ballista_session(state.config()) {
            let inner = state.create_physical_plan(&plan).await?;
            return Ok(Arc::new(ScopedExec::new(self.table, self.team.clone(), inner)));
        }
        // On a Ballista scheduler, two things differ. Ballista prefers sort-merge joins
        // (its session sets `prefer_hash_join = false`); the scope's join has a team's
        // allocations on one side, few rows, so it is planned as the hash join it is
        // here (a sort-merge join would sort the whole table side first). And the scope
        // is one partition, all of its own partitions merged inside: Ballista runs a
        // stage's partitions as separate tasks and narrows each task's plan to its
        // partitions leaf by leaf; it cannot narrow a leaf it does not know, so every
        // task of a many-partition scope would read the whole scope (seen: a team's rows
        // counted twice with two tasks). The scope still reads its partitions in
        // parallel inside the one task; the stages above it spread over the executors.
        let Some(session) = state.as_any().downcast_ref::<datafusion::execution::SessionState>() else {
            return datafusion::common::internal_err!("a scoped table needs a DataFusion session");
        };
        let mut config = session.config().clone();
        config.options_mut().optimizer.prefer_hash_join = true;
        let own =
            datafusion::execution::SessionStateBuilder::new_from_existing(session.clone()).with_config(config).build();
        let mut inner = own.create_physical_plan(&plan).await?;
        if inner.properties().partitioning.partition_count() > 1 {
            inner = Arc::new(datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec::new(inner));
        }
        Ok(Arc::new(ScopedExec::new(self.table, self.team.clone(), inner)))
    }
}

/// `e` with its columns' qualifiers removed.
fn unqualified(e: &Expr) -> DfResult<Expr> {
    e.clone()
        .transform(|e| match e {
            Expr::Column(c) => Ok(Transformed::yes(Expr::Column(Column::new_unqualified(c.name)))),
            other => Ok(Transformed::no(other)),
        })
        .map(|t| t.data)
}

/// The columns whose predicates may prune below the scope: the time of a sample, a
/// minute or a priced hour. Every GPU has a row for every window, minute and hour its
/// agent reported, whoever held it, so how much a time range reads says when agents
/// reported, never who held what. A predicate on anything else (`gpu_uuid`, `host`,
/// `namespace`, `team`, …) pruned files and row groups by *other* teams' values: a
/// query that counted 0 rows either way ran twice as long when a hidden GPU or
/// namespace matched (issue 39), so such predicates run above the scope, on its rows.
const PRUNE_COLUMNS: &[&str] = &["time", "hour"];

/// True when `e` may go below the scope to prune: it [`cannot_fail`] and reads only
/// [`PRUNE_COLUMNS`].
pub fn prunes_below_scope(e: &Expr) -> bool {
    cannot_fail(e) && e.column_refs().iter().all(|c| PRUNE_COLUMNS.contains(&c.name.as_str()))
}

/// True when evaluating `e` on any row cannot fail, whatever the row holds: a column,
/// a constant, comparisons, `IS [NOT] NULL`, `BETWEEN`, `IN (…)` of those, and
/// `AND`/`OR`/`NOT` of such predicates. Casts, arithmetic, functions, `LIKE` and
/// subqueries are not (a cast or a division can fail on a value; a function may).
pub fn cannot_fail(e: &Expr) -> bool {
    let operand = |e: &Expr| matches!(e, Expr::Column(_) | Expr::Literal(..));
    match e {
        Expr::Column(_) | Expr::Literal(..) => true,
        Expr::BinaryExpr(b) => match b.op {
            Operator::And | Operator::Or => cannot_fail(&b.left) && cannot_fail(&b.right),
            Operator::Eq
            | Operator::NotEq
            | Operator::Lt
            | Operator::LtEq
            | Operator::Gt
            | Operator::GtEq
            | Operator::IsDistinctFrom
            | Operator::IsNotDistinctFrom => operand(&b.left) && operand(&b.right),
            _ => false,
        },
        Expr::Not(e)
        | Expr::IsNull(e)
        | Expr::IsNotNull(e)
        | Expr::IsTrue(e)
        | Expr::IsFalse(e)
        | Expr::IsNotTrue(e)
        | Expr::IsNotFalse(e)
        | Expr::IsUnknown(e)
        | Expr::IsNotUnknown(e) => cannot_fail(e),
        Expr::Between(b) => operand(&b.expr) && operand(&b.low) && operand(&b.high),
        Expr::InList(l) => operand(&l.expr) && l.list.iter().all(operand),
        _ => false,
    }
}

/// The scope's physical plan, as one leaf of the user's plan. It has no children as far
/// as the user's plan can tell, so no optimiser rule of the user's query reaches into
/// it (filters, dynamic filters, projections) and `EXPLAIN [ANALYZE]` shows one line
/// without files or row counts. Statistics are unknown (never the unscoped ones).
#[derive(Debug)]
pub struct ScopedExec {
    table: &'static str,
    team: TeamName,
    inner: Arc<dyn ExecutionPlan>,
    properties: Arc<PlanProperties>,
}

impl ScopedExec {
    pub(crate) fn new(table: &'static str, team: TeamName, inner: Arc<dyn ExecutionPlan>) -> ScopedExec {
        let properties = PlanProperties::new(
            EquivalenceProperties::new(inner.schema()),
            Partitioning::UnknownPartitioning(inner.properties().partitioning.partition_count()),
            EmissionType::Incremental,
            Boundedness::Bounded,
        );
        ScopedExec { table, team, inner, properties: Arc::new(properties) }
    }

    /// The table, the team and the scope's own plan (for shipping it to Ballista's
    /// executors, [`crate::distributed`]).
    pub(crate) fn parts(&self) -> (&'static str, &TeamName, &Arc<dyn ExecutionPlan>) {
        (self.table, &self.team, &self.inner)
    }
}

impl DisplayAs for ScopedExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "ScopedScan: table={}, team={}", self.table, self.team.as_str())
    }
}

impl ExecutionPlan for ScopedExec {
    fn name(&self) -> &str {
        "ScopedScan"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> DfResult<TreeNodeRecursion>,
    ) -> DfResult<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn replace_children(
        self: Arc<Self>,
        _: Vec<Arc<dyn ExecutionPlan>>,
        _: ReplaceChildrenOptions,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        Ok(self)
    }

    fn with_new_children(self: Arc<Self>, _: Vec<Arc<dyn ExecutionPlan>>) -> DfResult<Arc<dyn ExecutionPlan>> {
        Ok(self)
    }

    fn gather_filters_for_pushdown(
        &self,
        _phase: FilterPushdownPhase,
        parent_filters: Vec<Arc<dyn PhysicalExpr>>,
        _config: &ConfigOptions,
    ) -> DfResult<FilterDescription> {
        Ok(FilterDescription::all_unsupported(&parent_filters, &[]))
    }

    fn handle_child_pushdown_result(
        &self,
        _phase: FilterPushdownPhase,
        child_pushdown_result: ChildPushdownResult,
        _config: &ConfigOptions,
    ) -> DfResult<FilterPushdownPropagation<Arc<dyn ExecutionPlan>>> {
        // Nothing is ever pushed into the scope (a leaf would refuse anyway; say so).
        Ok(FilterPushdownPropagation::all_unsupported(child_pushdown_result))
    }

    fn execute(&self, partition: usize, context: Arc<TaskContext>) -> DfResult<SendableRecordBatchStream> {
        self.inner.execute(partition, context)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::{RecordBatch, StringArray};
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use datafusion::datasource::MemTable;
    use datafusion::prelude::{SessionContext, col};

    #[test]
    fn the_unscoped_column_names_exist_in_the_contract_schemas() {
        use apron_common::wire::Table;
        for def in crate::tables::TABLES {
            let (name, rule) = (def.name, def.scope);
            let Some(t) = Table::from_name(name) else { continue };
            let schema = t.schema();
            let need: &[&str] = match rule {
                Rule::TeamColumn => &["team"],
                Rule::AllocatedIntervals(Held::Window) => &["gpu_uuid", "time", "owner_kind", "owner"],
                Rule::AllocatedIntervals(Held::Process) => &["gpu_uuid", "time", "namespace", "pod", "job_id"],
                Rule::AllocatedIntervals(Held::Minute) => &["gpu_uuid", "time"],
            };
            for c in need {
                assert!(schema.field_with_name(c).is_ok(), "{name} has no column {c}");
            }
        }
        assert_eq!(rule("no_such_table"), None);
    }

    #[test]
    fn unknown_tables_are_hidden() {
        let schema = apron_common::wire::Table::Allocations.schema();
        let p: Arc<dyn TableProvider> = Arc::new(datafusion::datasource::empty::EmptyTable::new(schema));
        let team = TeamName::new("vision").expect("team");
        assert!(scoped_provider("secrets", p.clone(), Some(&p), &team).expect("ok").is_none());
        assert!(scoped_provider("gpu_samples", p.clone(), None, &team).expect("ok").is_none());
        assert!(scoped_provider("allocations", p, None, &team).expect("ok").is_some());
    }

    #[test]
    fn only_predicates_that_cannot_fail_go_below_the_scope() {
        let t = || Expr::Literal(datafusion::common::ScalarValue::Utf8(Some("x".into())), None);
        assert!(cannot_fail(&col("team").eq(t())));
        assert!(cannot_fail(&col("a").gt_eq(lit(1)).and(col("b").is_null().or(col("c").in_list(vec![lit(1)], true)))));
        assert!(cannot_fail(&Expr::Not(Box::new(col("a").between(lit(1), lit(2))))));
        // A cast, arithmetic or a function can fail on a value.
        assert!(!cannot_fail(&datafusion::logical_expr::cast(col("owner"), DataType::Int32).eq(lit(0))));
        assert!(!cannot_fail(&(lit(1) / col("a")).eq(lit(0))));
        assert!(!cannot_fail(&col("a").eq(lit(1)).and(datafusion::functions::expr_fn::length(col("b")).gt(lit(0)))));
        assert!(!cannot_fail(&col("a").like(t())));
    }

    #[test]
    fn only_time_ranges_prune_below_the_scope() {
        let t = |v: &str| Expr::Literal(datafusion::common::ScalarValue::Utf8(Some(v.into())), None);
        assert!(prunes_below_scope(&col("time").gt(lit(1)).and(col("time").lt_eq(lit(9)))));
        assert!(prunes_below_scope(&col("hour").between(lit(1), lit(2))));
        // Another team's values must not decide what is read.
        assert!(!prunes_below_scope(&col("gpu_uuid").gt_eq(t("GPU-0")).and(col("gpu_uuid").lt(t("GPU-8")))));
        assert!(!prunes_below_scope(&col("namespace").eq(t("ml-research"))));
        assert!(!prunes_below_scope(&col("time").gt(lit(1)).and(col("host").eq(t("node-1")))));
        assert!(!prunes_below_scope(&datafusion::logical_expr::cast(col("time"), DataType::Utf8).eq(t("x"))));
        let schema = apron_common::wire::Table::Allocations.schema();
        let p: Arc<dyn TableProvider> = Arc::new(datafusion::datasource::empty::EmptyTable::new(schema));
        let team = TeamName::new("vision").expect("team");
        let scoped = scoped_provider("gpu_samples", p.clone(), Some(&p), &team).expect("ok").expect("offered");
        let pushed = scoped
            .supports_filters_pushdown(&[&col("gpu_uuid").eq(t("GPU-x")), &col("time").gt(lit(0))])
            .expect("answers");
        assert_eq!(pushed, vec![TableProviderFilterPushDown::Unsupported, TableProviderFilterPushDown::Inexact]);
    }

    /// `owner` is an integer in the team's rows and text in the other team's: a cast of
    /// it fails only if it is evaluated on a row the scope removes.
    fn oracle_table() -> Arc<dyn TableProvider> {
        let schema = Arc::new(Schema::new(vec![
            Field::new("team", DataType::Utf8, false),
            Field::new("owner", DataType::Utf8, false),
        ]));
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(StringArray::from(vec!["vision", "nlp", "vision", "nlp"])),
                Arc::new(StringArray::from(vec!["0", "nlp/secret-notebook", "7", "nlp/other"])),
            ],
        )
        .expect("batch");
        Arc::new(MemTable::try_new(schema, vec![vec![batch]]).expect("table"))
    }

    #[tokio::test]
    async fn a_failing_user_expression_never_sees_a_hidden_row() {
        let team = TeamName::new("vision").expect("team");
        let scoped = scoped_provider("allocations", oracle_table(), None, &team).expect("ok").expect("scoped");
        let ctx = SessionContext::new();
        ctx.register_table("allocations", scoped).expect("register");
        for q in [
            "SELECT count(*) FROM allocations WHERE CAST(owner AS INT) >= 0",
            "SELECT count(*) FROM allocations WHERE team = 'vision' AND CAST(owner AS INT) >= 0",
            "SELECT count(*) FROM allocations a JOIN allocations b ON CAST(a.owner AS INT) = CAST(b.owner AS INT)",
            "SELECT count(*) FROM (SELECT CASE WHEN CAST(owner AS INT) > 0 THEN 1 END AS x FROM allocations) t",
            "SELECT count(*) FROM allocations ORDER BY min(CAST(owner AS INT))",
        ] {
            let batches = ctx.sql(q).await.expect("plan").collect().await.unwrap_or_else(|e| panic!("{q}: {e}"));
            let n = batches[0]
                .column(0)
                .as_any()
                .downcast_ref::<datafusion::arrow::array::Int64Array>()
                .map(|a| a.value(0));
            assert!(matches!(n, Some(1 | 2)), "{q}: {n:?}");
        }
        // EXPLAIN shows the scope as one leaf.
        let plan = ctx.sql("EXPLAIN SELECT * FROM allocations WHERE CAST(owner AS INT) = 0").await.expect("plan");
        let text = datafusion::arrow::util::pretty::pretty_format_batches(&plan.collect().await.expect("explain"))
            .expect("format")
            .to_string();
        assert!(text.contains("ScopedScan: table=allocations, team=vision"), "{text}");
        assert!(!text.contains("MemoryExec") && !text.contains("DataSourceExec"), "{text}");
    }
}
