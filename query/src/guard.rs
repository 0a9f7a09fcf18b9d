//! Guards that keep one query from crashing or exhausting the server.
//!
//! - **Shape** ([`check_shape`]), on the parsed statement before planning: expressions,
//!   subqueries and set operations nested deeper than `[query] max_expr_depth`, or more
//!   than `[query] max_expr_nodes` of them in one statement, are refused with a 400
//!   that names the limit. Why: DataFusion plans and evaluates expressions
//!   recursively, so `1+1+…+1` with a few thousand terms, `UNION ALL` × 3,000 or a long
//!   `OR` chain overflowed a thread's stack and aborted the whole process. The engine's
//!   threads get stacks sized well past what the depth limit needs
//!   ([`QUERY_THREAD_STACK_BYTES`]), so the check is the only thing that can refuse.
//! - **Functions that build variable-size values** ([`capped_functions`]): every
//!   string, binary, list, map and struct function of the registry, the `||` operator
//!   and the growing aggregates (`string_agg`, `array_agg`) allocate outside DataFusion's
//!   memory pool (`repeat('x', 1e9)` is a 1 GB value, `array_repeat(1, 1e9)` 8 GB). Each
//!   is bounded before it allocates and checked after, against `[query]
//!   max_string_result_bytes` (per result array, i.e. per batch, and per aggregate
//!   value): [`crate::funcs`]. Since every step of a chain is bounded, so is the chain.
//! - **Joins that yield** ([`YieldInJoins`]): a nested-loop or cross join emits batch
//!   after batch from its buffered side without polling its input, so nothing in the
//!   task ever returned `Pending`: a timed-out (aborted) query went on computing on the
//!   engine's threads, starving every other query for as long as the join ran (hours,
//!   for `generate_series(1, 1e6)` × itself). Every join's output is wrapped in
//!   DataFusion's `CooperativeExec`, which spends the task's tokio budget per batch, so
//!   the task yields every few batches and an abort takes effect at once.

use std::ops::ControlFlow;
use std::sync::Arc;

use datafusion::arrow::compute::cast;
use datafusion::arrow::compute::kernels::concat_elements::concat_elements_dyn;
use datafusion::arrow::datatypes::DataType;
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::{DFSchema, Result as DfResult, ScalarValue, exec_err};
use datafusion::execution::FunctionRegistry;
use datafusion::execution::context::SessionState;
use datafusion::logical_expr::planner::{ExprPlanner, PlannerResult, RawBinaryExpr};
use datafusion::logical_expr::{
    ColumnarValue, Expr, ExprSchemable, ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl, Signature, Volatility,
};
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::coop::CooperativeExec;
use datafusion::sql::parser::Statement as DfStatement;
use datafusion::sql::sqlparser::ast::{
    BinaryOperator, Expr as SqlExpr, Query, SetExpr, Statement as SqlStatement, TableFactor, Visit, Visitor,
};

/// The stack of each query thread. Address space only: the pages a query does not
/// touch are never committed. At ~1 KiB of stack per nesting level in DataFusion's
/// recursive planner and evaluator this carries tens of thousands of levels, two
/// orders of magnitude past the default `max_expr_depth`.
pub const QUERY_THREAD_STACK_BYTES: usize = 64 << 20;

/// A statement over a shape limit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what}: the limit is {limit} ({setting})")]
pub struct ShapeViolation {
    pub what: String,
    pub limit: usize,
    pub setting: &'static str,
}

/// Refuses a statement whose expressions, subqueries or set operations nest deeper than
/// `max_depth`, or that has more than `max_nodes` of them (tables counted too).
pub fn check_shape(statement: &DfStatement, max_depth: usize, max_nodes: usize) -> Result<(), ShapeViolation> {
    match statement {
        DfStatement::Statement(s) => check_sql(s, max_depth, max_nodes),
        DfStatement::Explain(e) => check_shape(&e.statement, max_depth, max_nodes),
        // Refused as writes by the read-only check; nothing of them is planned.
        _ => Ok(()),
    }
}

fn check_sql(s: &SqlStatement, max_depth: usize, max_nodes: usize) -> Result<(), ShapeViolation> {
    let mut meter = Meter { max_depth, max_nodes, depth: 0, nodes: 0 };
    match s.visit(&mut meter) {
        ControlFlow::Break(v) => Err(v),
        ControlFlow::Continue(()) => Ok(()),
    }
}

struct Meter {
    max_depth: usize,
    max_nodes: usize,
    depth: usize,
    nodes: usize,
}

impl Meter {
    fn enter(&mut self, levels: usize, nodes: usize) -> ControlFlow<ShapeViolation> {
        self.depth += levels;
        self.nodes += nodes;
        if self.depth > self.max_depth {
            return ControlFlow::Break(ShapeViolation {
                what: format!(
                    "the query nests expressions, subqueries or set operations more than {} deep",
                    self.max_depth
                ),
                limit: self.max_depth,
                setting: "query.max_expr_depth",
            });
        }
        if self.nodes > self.max_nodes {
            return ControlFlow::Break(ShapeViolation {
                what: format!("the query has more than {} expressions, tables and set operations", self.max_nodes),
                limit: self.max_nodes,
                setting: "query.max_expr_nodes",
            });
        }
        ControlFlow::Continue(())
    }
}

/// The nesting depth and node count of a query body's set operations, without recursion
/// (the visitor would recurse through a 3,000-deep `UNION` before any hook saw it).
fn set_operations(body: &SetExpr) -> (usize, usize) {
    let (mut max, mut count) = (0, 0);
    let mut stack = vec![(body, 0usize)];
    while let Some((e, d)) = stack.pop() {
        if let SetExpr::SetOperation { left, right, .. } = e {
            count += 1;
            max = max.max(d + 1);
            stack.push((left, d + 1));
            stack.push((right, d + 1));
        }
    }
    (max, count)
}

impl Visitor for Meter {
    type Break = ShapeViolation;

    fn pre_visit_query(&mut self, q: &Query) -> ControlFlow<ShapeViolation> {
        let (depth, count) = set_operations(&q.body);
        // Measured, then given back at once: the visitor descends one level per set
        // operation below, but the nesting that matters is checked here, up front.
        self.enter(1 + depth, 1 + count)?;
        self.depth -= depth;
        ControlFlow::Continue(())
    }

    fn post_visit_query(&mut self, _q: &Query) -> ControlFlow<ShapeViolation> {
        self.depth -= 1;
        ControlFlow::Continue(())
    }

    fn pre_visit_table_factor(&mut self, _t: &TableFactor) -> ControlFlow<ShapeViolation> {
        // Joins plan left-deep: each table is a level of the plan.
        self.enter(0, 1)
    }

    fn pre_visit_expr(&mut self, _e: &SqlExpr) -> ControlFlow<ShapeViolation> {
        self.enter(1, 1)
    }

    fn post_visit_expr(&mut self, _e: &SqlExpr) -> ControlFlow<ShapeViolation> {
        self.depth -= 1;
        ControlFlow::Continue(())
    }
}

/// A physical optimizer rule (appended after DataFusion's own): every join's output goes
/// through a [`CooperativeExec`], so a join that multiplies rows spends the task's
/// budget and yields (see the module docs).
#[derive(Debug, Default)]
pub struct YieldInJoins;

const JOINS: &[&str] = &[
    "NestedLoopJoinExec",
    "CrossJoinExec",
    "HashJoinExec",
    "SortMergeJoinExec",
    "SymmetricHashJoinExec",
    "PiecewiseMergeJoinExec",
];

impl PhysicalOptimizerRule for YieldInJoins {
    fn optimize(&self, plan: Arc<dyn ExecutionPlan>, _config: &ConfigOptions) -> DfResult<Arc<dyn ExecutionPlan>> {
        plan.transform_up(|node| {
            if JOINS.contains(&node.name()) {
                Ok(Transformed::yes(Arc::new(CooperativeExec::new(node)) as Arc<dyn ExecutionPlan>))
            } else {
                Ok(Transformed::no(node))
            }
        })
        .map(|t| t.data)
    }

    fn name(&self) -> &str {
        "apron_yield_in_joins"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// The name of the `||` function (a name SQL users will see only in `EXPLAIN`).
pub(crate) const CONCAT_OP: &str = "apron_string_concat";

/// Bounds every function of `state` that builds a variable-size value
/// ([`crate::funcs`]) and plans `||` of two strings through a capped function.
pub fn capped_functions(state: &mut SessionState, max_bytes: usize) -> DfResult<()> {
    crate::funcs::bound_functions(state, max_bytes)?;
    let op =
        Arc::new(ScalarUDF::new_from_impl(ConcatOp { signature: Signature::any(2, Volatility::Immutable), max_bytes }));
    // Also a function by name, so a plan shipped to a Ballista node finds it there.
    state.register_udf(op.clone())?;
    state.register_expr_planner(Arc::new(ConcatPlanner { op }))?;
    Ok(())
}

/// `a || b` of two strings: NULL when either is NULL (unlike `concat`), capped.
#[derive(Debug, PartialEq, Eq, Hash)]
struct ConcatOp {
    signature: Signature,
    max_bytes: usize,
}

impl ScalarUDFImpl for ConcatOp {
    fn name(&self) -> &str {
        CONCAT_OP
    }

    fn schema_name(&self, args: &[Expr]) -> DfResult<String> {
        // The name the plain operator would give the column.
        match args {
            [l, r] => Ok(format!("{} || {}", l.schema_name(), r.schema_name())),
            _ => Ok(CONCAT_OP.to_owned()),
        }
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn return_type(&self, _arg_types: &[DataType]) -> DfResult<DataType> {
        Ok(DataType::Utf8)
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> DfResult<ColumnarValue> {
        let rows = args.number_rows.max(1);
        crate::funcs::check_estimate("||", crate::funcs::Bound::Sum { factor: 1 }, &args.args, rows, self.max_bytes)?;
        let all_scalar = args.args.iter().all(|a| matches!(a, ColumnarValue::Scalar(_)));
        let arrays = ColumnarValue::values_to_arrays(&args.args)?;
        let [l, r] = arrays.as_slice() else { return exec_err!("|| takes two arguments") };
        let (l, r) = (cast(l, &DataType::Utf8)?, cast(r, &DataType::Utf8)?);
        let out = concat_elements_dyn(&l, &r)?;
        let out = match all_scalar {
            true => ColumnarValue::Scalar(ScalarValue::try_from_array(&out, 0)?),
            false => ColumnarValue::Array(out),
        };
        crate::funcs::check_result("||", &out, self.max_bytes, &args.config_options)?;
        Ok(out)
    }
}

/// Plans `a || b` of two strings as [`ConcatOp`]; anything else stays the operator.
#[derive(Debug)]
struct ConcatPlanner {
    op: Arc<ScalarUDF>,
}

fn is_string(t: &DataType) -> bool {
    matches!(t, DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View)
}

impl ExprPlanner for ConcatPlanner {
    fn plan_binary_op(&self, expr: RawBinaryExpr, schema: &DFSchema) -> DfResult<PlannerResult<RawBinaryExpr>> {
        if expr.op != BinaryOperator::StringConcat {
            return Ok(PlannerResult::Original(expr));
        }
        let string = |e: &Expr| e.get_type(schema).is_ok_and(|t| is_string(&t));
        if !(string(&expr.left) && string(&expr.right)) {
            return Ok(PlannerResult::Original(expr));
        }
        Ok(PlannerResult::Planned(self.op.call(vec![expr.left, expr.right])))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::prelude::SessionContext;
    use datafusion::sql::parser::DFParser;

    fn parse(sql: &str) -> DfStatement {
        let mut v = DFParser::parse_sql(sql).expect("parse");
        v.pop_front().expect("one statement")
    }

    #[test]
    fn deep_and_wide_statements_are_refused_before_planning() {
        let plus = format!("SELECT {}", vec!["1"; 5000].join("+"));
        let e = check_shape(&parse(&plus), 500, 20_000).expect_err("deep");
        assert_eq!(e.setting, "query.max_expr_depth");
        let union = vec!["SELECT 1"; 3000].join(" UNION ALL ");
        assert_eq!(check_shape(&parse(&union), 500, 20_000).expect_err("deep").setting, "query.max_expr_depth");
        let or = format!("SELECT 1 WHERE {}", (0..3000).map(|i| format!("{i} = 1")).collect::<Vec<_>>().join(" OR "));
        assert!(check_shape(&parse(&or), 500, 20_000).is_err());
        // Wide but shallow: an IN list.
        let wide =
            format!("SELECT 1 WHERE 1 IN ({})", (0..30_000).map(|i| i.to_string()).collect::<Vec<_>>().join(","));
        assert_eq!(check_shape(&parse(&wide), 500, 20_000).expect_err("wide").setting, "query.max_expr_nodes");
        // Ordinary queries pass.
        let ok = "WITH x AS (SELECT a, b FROM t WHERE a > 1 AND (b = 2 OR b = 3)) \
                  SELECT a FROM x UNION ALL SELECT b FROM t ORDER BY 1";
        check_shape(&parse(ok), 500, 20_000).expect("fine");
        check_shape(&parse(&format!("SELECT {}", vec!["1"; 400].join("+"))), 500, 20_000).expect("400 terms");
    }

    async fn ctx(max: usize) -> SessionContext {
        let ctx = SessionContext::new();
        let mut state = ctx.state();
        capped_functions(&mut state, max).expect("capped");
        SessionContext::new_with_state(state)
    }

    async fn run(ctx: &SessionContext, q: &str) -> Result<String, String> {
        let df = ctx.sql(q).await.map_err(|e| e.to_string())?;
        let b = df.collect().await.map_err(|e| e.to_string())?;
        Ok(datafusion::arrow::util::pretty::pretty_format_batches(&b).map_err(|e| e.to_string())?.to_string())
    }

    #[tokio::test]
    async fn amplifying_string_functions_are_capped_before_they_allocate() {
        let c = ctx(1 << 20).await;
        for q in [
            "SELECT length(repeat('x', 1000000000))",
            "SELECT length(lpad('x', 2000000000, 'y'))",
            "SELECT length(rpad('x', 2000000000))",
            "SELECT length(replace(repeat('x', 1000), 'x', repeat('y', 2000)))",
            "WITH a AS (SELECT repeat('x', 300000) AS s), b AS (SELECT s || s AS s FROM a), \
             c AS (SELECT s || s AS s FROM b) SELECT length(s) FROM c",
            "SELECT length(concat(repeat('x', 600000), repeat('y', 600000)))",
        ] {
            let e = run(&c, q).await.expect_err(q);
            assert!(e.contains("query.max_string_result_bytes"), "{q}: {e}");
        }
        // Within the cap they answer as before, `||` keeps its NULL rule and its name.
        assert!(run(&c, "SELECT length(repeat('ab', 3)) AS n").await.expect("ok").contains("| 6 |"));
        let t = run(&c, "SELECT 'a' || 'b', 'a' || NULL, concat('a', NULL)").await.expect("ok");
        assert!(t.contains("Utf8(\"a\") || Utf8(\"b\")"), "{t}");
        assert!(t.contains("| ab "), "{t}");
        let t = run(&c, "SELECT ('a' || NULL) IS NULL AS n").await.expect("ok");
        assert!(t.contains("true"), "{t}");
        let t = run(&c, "SELECT 1 || 'x' AS s").await.expect("ok");
        assert!(t.contains("1x"), "{t}");
    }
}
