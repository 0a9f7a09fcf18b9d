//! Row scoping: what a `team:<name>` principal may see, enforced in the logical plan.
//!
//! A scoped query runs in a session whose catalog holds, under every table's usual name,
//! a view over the real table — never the real table itself — so whatever the SQL says
//! (joins, subqueries, CTEs, `UNION`, `information_schema`, qualified names) it can only
//! reach scoped rows. The SQL text is never looked at or rewritten.
//!
//! ```text
//!  allocations, gpu_cost_hourly,          Filter team = '<name>'
//!  alerts, recommendations             ─► └─ TableScan <table>
//!
//!  gpu_samples, gpu_processes,            RightSemi join on gpu_uuid = a.gpu_uuid
//!  gpu_samples_1m                      ─►   AND time >= a.start_time
//!                                           AND (a.end_time IS NULL OR time < a.end_time)
//!                                         ├─ Filter team = '<name>' └─ TableScan allocations
//!                                         └─ TableScan <table>
//! ```
//!
//! A sample belongs to a team when one of the team's allocations held that GPU at the
//! sample's `time` (the same half-open `[start_time, end_time)` the cost ledger uses).
//! The allocations side is the (small) build side of the hash join; the samples stream
//! through it, and a `time` filter of the query still prunes the samples' partitions.
//! A table without a [`Rule`] is left out of scoped sessions: new tables are invisible
//! to teams until someone decides how they are scoped (fail closed).

use std::borrow::Cow;
use std::sync::Arc;

use apron_common::TeamName;
use async_trait::async_trait;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::catalog::{Session, TableProvider};
use datafusion::common::{Column, Result as DfResult};
use datafusion::datasource::{ViewTable, provider_as_source};
use datafusion::logical_expr::{
    Expr, JoinType, LogicalPlan, LogicalPlanBuilder, TableProviderFilterPushDown, TableType, lit,
};
use datafusion::physical_plan::ExecutionPlan;

/// Whose rows a query may read.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Scope {
    /// Every row (`viewer`, `admin`, and the server's own queries).
    All,
    /// Only the rows of one team (`team:<name>`).
    Team(TeamName),
}

/// How a table is cut down to one team's rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// The table has a `team` column.
    TeamColumn,
    /// The rows of a GPU during the team's allocations of it (`gpu_uuid`, `time`).
    AllocatedIntervals,
}

/// The rule of every table the server serves; the one place to add a table's rule.
pub const RULES: &[(&str, Rule)] = &[
    ("gpu_samples", Rule::AllocatedIntervals),
    ("gpu_processes", Rule::AllocatedIntervals),
    ("gpu_samples_1m", Rule::AllocatedIntervals),
    ("allocations", Rule::TeamColumn),
    ("gpu_cost_hourly", Rule::TeamColumn),
    ("alerts", Rule::TeamColumn),
    ("recommendations", Rule::TeamColumn),
];

/// The rule for `table`; `None`: the table is hidden from scoped sessions.
pub fn rule(table: &str) -> Option<Rule> {
    RULES.iter().find(|(name, _)| *name == table).map(|(_, r)| *r)
}

/// `table` as `team` sees it, given the real `allocations` provider (needed by
/// [`Rule::AllocatedIntervals`]). `Ok(None)` when the table has no rule, or needs
/// allocations and there are none: the table is then not offered at all.
pub fn scoped_provider(
    table: &str,
    provider: Arc<dyn TableProvider>,
    allocations: Option<&Arc<dyn TableProvider>>,
    team: &TeamName,
) -> DfResult<Option<Arc<dyn TableProvider>>> {
    let team_is = |qualifier: &str| Expr::Column(Column::new(Some(qualifier), "team")).eq(lit(team.as_str()));
    let plan = match rule(table) {
        None => return Ok(None),
        Some(Rule::TeamColumn) => {
            LogicalPlanBuilder::scan(table, provider_as_source(provider), None)?.filter(team_is(table))?.build()?
        }
        Some(Rule::AllocatedIntervals) => {
            let Some(allocations) = allocations else { return Ok(None) };
            // A name no SQL can refer to: it lives only inside this plan.
            const HELD: &str = "apron_scope_held";
            let held = LogicalPlanBuilder::scan(HELD, provider_as_source(allocations.clone()), None)?
                .filter(team_is(HELD))?
                .build()?;
            let c = |q: &str, name: &str| Expr::Column(Column::new(Some(q), name));
            let on = [
                c(table, "gpu_uuid").eq(c(HELD, "gpu_uuid")),
                c(table, "time").gt_eq(c(HELD, "start_time")),
                c(HELD, "end_time").is_null().or(c(table, "time").lt(c(HELD, "end_time"))),
            ];
            LogicalPlanBuilder::from(held)
                .join_on(
                    LogicalPlanBuilder::scan(table, provider_as_source(provider), None)?.build()?,
                    JoinType::RightSemi,
                    on,
                )?
                .build()?
        }
    };
    Ok(Some(Arc::new(Scoped(ViewTable::new(plan, None)))))
}

/// A scoped table: a view that presents itself as the base table it stands for (so
/// `information_schema` and `SHOW TABLES` look the same to every principal).
#[derive(Debug)]
struct Scoped(ViewTable);

#[async_trait]
impl TableProvider for Scoped {
    fn schema(&self) -> SchemaRef {
        self.0.schema()
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    fn get_logical_plan(&self) -> Option<Cow<'_, LogicalPlan>> {
        self.0.get_logical_plan()
    }

    fn supports_filters_pushdown(&self, filters: &[&Expr]) -> DfResult<Vec<TableProviderFilterPushDown>> {
        self.0.supports_filters_pushdown(filters)
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        self.0.scan(state, projection, filters, limit).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_unscoped_column_names_exist_in_the_contract_schemas() {
        use apron_common::wire::Table;
        for (name, rule) in RULES {
            let Some(t) = Table::from_name(name) else { continue };
            let schema = t.schema();
            let need: &[&str] = match rule {
                Rule::TeamColumn => &["team"],
                Rule::AllocatedIntervals => &["gpu_uuid", "time"],
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
}
