//! Read-only enforcement. Three layers, none of which looks at SQL text:
//!
//! 1. [`check_statement`] on the parsed statement, before planning: only queries,
//!    `EXPLAIN` of a query, `DESCRIBE` and `SHOW …` pass. This gives a clear refusal even
//!    for writes that would not plan (`INSERT INTO no_such_table`, `COPY … TO 'x.csv'`).
//! 2. [`check_plan`] on the logical plan — the authority: every node, including the
//!    plans inside `EXPLAIN`/`EXPLAIN ANALYZE` and inside subquery expressions, must be
//!    a pure query node. DDL, DML (INSERT/UPDATE/DELETE/CTAS/TRUNCATE/MERGE), `COPY … TO`,
//!    statements (SET, RESET, transactions, PREPARE/EXECUTE) and extension nodes (whose
//!    behaviour we cannot vouch for) are refused.
//! 3. DataFusion's own [`SQLOptions`] (no DDL, no DML, no statements) verify the plan
//!    again, and the session has no table factories (so `CREATE EXTERNAL TABLE` could
//!    not run) and no URL tables (`SELECT * FROM '/etc/passwd'` does not resolve). The
//!    only table functions are DataFusion's `generate_series`/`range`, which read nothing.

use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::execution::context::SQLOptions;
use datafusion::logical_expr::{DdlStatement, LogicalPlan, Statement as PlanStatement};
use datafusion::sql::parser::Statement as DfStatement;
use datafusion::sql::sqlparser::ast::Statement as SqlStatement;

/// The refusal: `what` names the operation (`CREATE TABLE`, `INSERT INTO`, `COPY … TO`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("read-only: {what} is not allowed; this SQL API only answers queries (SELECT, EXPLAIN, DESCRIBE, SHOW)")]
pub struct ReadOnlyViolation {
    pub what: String,
}

fn refuse<T>(what: impl Into<String>) -> Result<T, ReadOnlyViolation> {
    Err(ReadOnlyViolation { what: what.into() })
}

/// The SQL options every query is verified with.
pub fn sql_options() -> SQLOptions {
    SQLOptions::new().with_allow_ddl(false).with_allow_dml(false).with_allow_statements(false)
}

/// Layer 1: the parsed statement must be a query (or read-only metadata statement).
pub fn check_statement(s: &DfStatement) -> Result<(), ReadOnlyViolation> {
    match s {
        DfStatement::Statement(s) => check_sql_statement(s),
        DfStatement::Explain(e) => check_statement(&e.statement),
        DfStatement::CreateExternalTable(_) => refuse("CREATE EXTERNAL TABLE"),
        DfStatement::CopyTo(_) => refuse("COPY … TO"),
        DfStatement::Reset(_) => refuse("RESET"),
    }
}

fn check_sql_statement(s: &SqlStatement) -> Result<(), ReadOnlyViolation> {
    match s {
        SqlStatement::Explain { statement, .. } => check_sql_statement(statement),
        SqlStatement::Query { .. }
        | SqlStatement::ExplainTable { .. }
        | SqlStatement::ShowTables { .. }
        | SqlStatement::ShowColumns { .. }
        | SqlStatement::ShowCreate { .. }
        | SqlStatement::ShowFunctions { .. }
        | SqlStatement::ShowVariable { .. } => Ok(()),
        other => refuse(statement_kind(other)),
    }
}

/// `INSERT`, `CREATE TABLE`, `DROP`, … from the statement's variant name (its `Debug`
/// form starts with it), so new sqlparser variants still get a fitting name.
fn statement_kind(s: &SqlStatement) -> String {
    let debug = format!("{s:?}");
    let name: String = debug.chars().take_while(|c| c.is_ascii_alphanumeric()).collect();
    let words = camel_to_words(&name);
    if words.is_empty() { "this statement".to_owned() } else { words }
}

/// `CreateExternalTable` → `CREATE EXTERNAL TABLE`; `Insert Into` → `INSERT INTO`.
fn camel_to_words(name: &str) -> String {
    let mut out = String::new();
    for (i, c) in name.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 && !out.ends_with(' ') {
            out.push(' ');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}

/// Layer 2: every node of `plan` (and of plans nested in it) is a pure query node.
pub fn check_plan(plan: &LogicalPlan) -> Result<(), ReadOnlyViolation> {
    let mut violation = None;
    let walk = plan.apply_with_subqueries(|node| {
        if let Some(what) = write_node(node) {
            violation = Some(what);
            return Ok(TreeNodeRecursion::Stop);
        }
        Ok(TreeNodeRecursion::Continue)
    });
    if let Some(what) = violation {
        return refuse(what);
    }
    // The walk itself cannot fail (the closure never errs), but never let an error pass
    // as "checked".
    walk.map(|_| ()).or_else(|e| refuse(format!("a plan that could not be checked ({e})")))?;
    sql_options().verify_plan(plan).or_else(|e| refuse(format!("this statement ({e})")))
}

fn write_node(node: &LogicalPlan) -> Option<String> {
    Some(match node {
        LogicalPlan::Ddl(d) => match d {
            DdlStatement::CreateMemoryTable(_) => "CREATE TABLE".to_owned(),
            other => camel_to_words(other.name()),
        },
        LogicalPlan::Dml(d) => camel_to_words(d.name()),
        LogicalPlan::Copy(_) => "COPY … TO".to_owned(),
        LogicalPlan::Statement(s) => match s {
            PlanStatement::SetVariable(_) => "SET".to_owned(),
            PlanStatement::ResetVariable(_) => "RESET".to_owned(),
            other => camel_to_words(other.name()),
        },
        LogicalPlan::Extension(e) => format!("the plan node {}", e.node.name()),
        LogicalPlan::Projection(_)
        | LogicalPlan::Filter(_)
        | LogicalPlan::Window(_)
        | LogicalPlan::Aggregate(_)
        | LogicalPlan::Sort(_)
        | LogicalPlan::Join(_)
        | LogicalPlan::Repartition(_)
        | LogicalPlan::Union(_)
        | LogicalPlan::TableScan(_)
        | LogicalPlan::EmptyRelation(_)
        | LogicalPlan::Subquery(_)
        | LogicalPlan::SubqueryAlias(_)
        | LogicalPlan::Limit(_)
        | LogicalPlan::Values(_)
        | LogicalPlan::Explain(_)
        | LogicalPlan::Analyze(_)
        | LogicalPlan::Distinct(_)
        | LogicalPlan::DescribeTable(_)
        | LogicalPlan::Unnest(_)
        | LogicalPlan::RecursiveQuery(_) => return None,
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use datafusion::datasource::MemTable;
    use datafusion::prelude::SessionContext;

    use super::*;

    /// The plan check alone (layer 2), on plans a default DataFusion session builds —
    /// with file formats and table factories, unlike ours.
    #[tokio::test]
    async fn plan_check_refuses_writes_and_passes_queries() {
        let ctx = SessionContext::new();
        let schema = Arc::new(Schema::new(vec![Field::new("a", DataType::Int64, true)]));
        let t = MemTable::try_new(schema, vec![vec![]]).expect("memtable");
        ctx.register_table("t", Arc::new(t)).expect("register");
        let state = ctx.state();
        let cases = [
            ("CREATE TABLE u AS SELECT 1", Some("CREATE TABLE")),
            ("CREATE TABLE u (a INT)", Some("CREATE TABLE")),
            ("CREATE EXTERNAL TABLE u STORED AS CSV LOCATION '/tmp/u.csv'", Some("CREATE EXTERNAL TABLE")),
            ("CREATE VIEW v AS SELECT 1", Some("CREATE VIEW")),
            ("DROP TABLE t", Some("DROP TABLE")),
            ("INSERT INTO t VALUES (1)", Some("INSERT INTO")),
            ("DELETE FROM t", Some("DELETE")),
            ("COPY (SELECT 1) TO '/tmp/apron-never-written.csv'", Some("COPY … TO")),
            ("SET datafusion.execution.batch_size = 1", Some("SET")),
            ("EXPLAIN ANALYZE INSERT INTO t VALUES (1)", Some("INSERT INTO")),
            ("SELECT (SELECT max(a) FROM t) FROM t", None),
            ("EXPLAIN ANALYZE SELECT * FROM t", None),
            ("DESCRIBE t", None),
            ("SHOW TABLES", None),
        ];
        for (sql, refused) in cases {
            let plan = match state.create_logical_plan(sql).await {
                Ok(p) => p,
                // SHOW TABLES needs information_schema, not enabled in this bare session.
                Err(_) if refused.is_none() => continue,
                Err(e) => panic!("{sql}: {e}"),
            };
            match (check_plan(&plan), refused) {
                (Ok(()), None) => {}
                (Err(v), Some(what)) => assert_eq!(v.what, what, "{sql}"),
                (got, want) => panic!("{sql}: got {got:?}, want refusal {want:?}"),
            }
        }
        assert!(!std::path::Path::new("/tmp/apron-never-written.csv").exists());
    }

    #[test]
    fn names() {
        assert_eq!(camel_to_words("CreateExternalTable"), "CREATE EXTERNAL TABLE");
        assert_eq!(camel_to_words("Insert Into"), "INSERT INTO");
        assert_eq!(camel_to_words("DropTable"), "DROP TABLE");
        assert_eq!(camel_to_words("TransactionStart"), "TRANSACTION START");
    }
}
