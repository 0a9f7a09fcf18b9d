//! The SQL the evaluators (cost ledger, alerts, recommendations, reports, import, remote
//! read, the rollup) share: literals written safely into SQL text, reads through the
//! engine with one typed error that names the statement, the owner columns of
//! `gpu_samples` and the MIG-parent exclusion. One module, so that no evaluator reads
//! through another's.

use std::collections::BTreeSet;

use apron_common::UnixMicros;
pub(crate) use apron_cost::{Owner, OwnerKind};
use apron_query::{QueryEngine, QueryError};
use datafusion::arrow::array::{Array, AsArray, RecordBatch};

/// A read through the engine that failed, with the statement it ran.
#[derive(Debug, thiserror::Error)]
pub enum SqlError {
    #[error("{source} (in: {sql})")]
    Query {
        sql: String,
        #[source]
        source: QueryError,
    },
    #[error("expected {expected} (in: {sql})")]
    Shape { sql: String, expected: &'static str },
}

/// A SQL string literal.
pub(crate) fn sql_str(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// `'a', 'b', …`: string literals for an `IN (…)` list, each once, in order.
pub(crate) fn str_list<'a>(items: impl IntoIterator<Item = &'a str>) -> String {
    let set: BTreeSet<&str> = items.into_iter().collect();
    set.into_iter().map(sql_str).collect::<Vec<_>>().join(", ")
}

/// The first three columns of row `r` — `(gpu, owner kind, owner)` in the look-ups that
/// join `gpu_samples` to a VALUES list of runs — as owned strings.
pub(crate) fn run_key(b: &RecordBatch, r: usize) -> (String, String, String) {
    let s = |i: usize| b.column(i).as_string::<i32>().value(r).to_owned();
    (s(0), s(1), s(2))
}

/// A SQL timestamp literal (RFC 3339, UTC).
pub(crate) fn ts(us: i64) -> String {
    format!("TIMESTAMP '{}'", UnixMicros(us).to_rfc3339())
}

/// How many GPUs one read may take when each brings `per_gpu` rows and a read should
/// hold at most `budget` rows: between 1 and `max_gpus`. The evaluators read a few GPUs
/// at a time so that their memory follows the budget, not the fleet or the range.
pub(crate) fn gpus_per_read(max_gpus: usize, budget: u64, per_gpu: u64) -> usize {
    let by_budget = usize::try_from(budget / per_gpu.max(1)).unwrap_or(usize::MAX);
    max_gpus.clamp(1, by_budget.max(1))
}

/// Consecutive slices of items weighing `weights` (rows each brings to a read), each
/// slice at most `max_items` items and, where it has more than one, at most `budget`
/// in weight: the reads of an evaluator that must hold a bounded number of rows
/// however the items vary. An item heavier than `budget` is a slice of its own.
pub(crate) fn slices(weights: &[u64], max_items: usize, budget: u64) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut weight) = (0, 0u64);
    for (i, &w) in weights.iter().enumerate() {
        if i > start && (i - start >= max_items.max(1) || weight.saturating_add(w) > budget) {
            out.push(start..i);
            (start, weight) = (i, 0);
        }
        weight = weight.saturating_add(w);
    }
    if start < weights.len() {
        out.push(start..weights.len());
    }
    out
}

/// `(gpu_uuid, min(time), max(time))` rows of `sql`, in its order.
pub(crate) async fn gpu_spans(engine: &QueryEngine, sql: &str) -> Result<Vec<(String, i64, i64)>, SqlError> {
    use datafusion::arrow::datatypes::{DataType, TimestampMicrosecondType};
    let shape = || SqlError::Shape { sql: sql.to_owned(), expected: "gpu_uuid, min(time), max(time)" };
    let mut out = Vec::new();
    for b in &batches(engine, sql).await? {
        if b.num_columns() < 3 {
            return Err(shape());
        }
        let uuids = datafusion::arrow::compute::cast(b.column(0), &DataType::Utf8).map_err(|_| shape())?;
        let uuids = uuids.as_string_opt::<i32>().ok_or_else(shape)?;
        let lo = b.column(1).as_primitive_opt::<TimestampMicrosecondType>().ok_or_else(shape)?;
        let hi = b.column(2).as_primitive_opt::<TimestampMicrosecondType>().ok_or_else(shape)?;
        for r in 0..b.num_rows() {
            if uuids.is_valid(r) && lo.is_valid(r) && hi.is_valid(r) {
                out.push((uuids.value(r).to_owned(), lo.value(r), hi.value(r)));
            }
        }
    }
    Ok(out)
}

/// The rows of `sql`, run as the server (unscoped, the server's share of query slots).
pub(crate) async fn batches(engine: &QueryEngine, sql: &str) -> Result<Vec<RecordBatch>, SqlError> {
    engine
        .execute_internal(sql)
        .await
        .map(|r| r.batches)
        .map_err(|source| SqlError::Query { sql: sql.to_owned(), source })
}

/// The first string column of `sql`'s rows, NULLs left out.
pub(crate) async fn strings(engine: &QueryEngine, sql: &str) -> Result<Vec<String>, SqlError> {
    let mut out = Vec::new();
    for b in &batches(engine, sql).await? {
        let col = b
            .column(0)
            .as_string_opt::<i32>()
            .ok_or_else(|| SqlError::Shape { sql: sql.to_owned(), expected: "a string first column" })?;
        out.extend(col.iter().flatten().map(str::to_owned));
    }
    Ok(out)
}

/// The MIG parents among the windows of `range`: their activity is their instances',
/// so the evaluators leave them out. Asked first, as a short list, because DataFusion
/// plans `gpu_uuid NOT IN (SELECT parent_gpu_uuid …)` as an anti join that holds every
/// matching window of the outer scan in memory (measured: 1.38 M windows → +500 MiB).
pub(crate) async fn mig_parent_uuids(engine: &QueryEngine, range: &str) -> Result<BTreeSet<String>, SqlError> {
    let sql = format!("SELECT DISTINCT parent_gpu_uuid FROM gpu_samples WHERE {range} AND parent_gpu_uuid IS NOT NULL");
    Ok(strings(engine, &sql).await?.into_iter().collect())
}

/// ` AND gpu_uuid NOT IN ('…', …)` for `gpus`, or nothing when there are none.
pub(crate) fn gpus_excluded_sql(gpus: &BTreeSet<String>) -> String {
    if gpus.is_empty() {
        return String::new();
    }
    format!(" AND gpu_uuid NOT IN ({})", str_list(gpus.iter().map(String::as_str)))
}

/// The owner columns of `gpu_samples`, quoted (`partition` is an SQL keyword), in the
/// order [`owner_at`] reads them.
pub(crate) const OWNER_COLUMNS_SQL: &str = "\"owner_kind\", \"owner\", \"namespace\", \"job_id\", \"owner_user\", \"account\", \"partition\", \"qos\", \"pod_labels\"";

/// The owner of row `r`, from the [`OWNER_COLUMNS_SQL`] columns starting at `first`;
/// `None` when nobody holds the GPU, the columns are not strings, or the kind is one no
/// part of Apron writes.
pub(crate) fn owner_at(b: &RecordBatch, first: usize, r: usize) -> Option<Owner> {
    let s = |i: usize| b.column(first + i).as_string_opt::<i32>();
    let opt = |i: usize| s(i).filter(|c| !c.is_null(r)).map(|c| c.value(r).to_owned());
    Some(Owner {
        kind: OwnerKind::parse(&opt(0)?)?,
        owner: opt(1)?,
        namespace: opt(2),
        job_id: opt(3),
        user: opt(4),
        account: opt(5),
        partition: opt(6),
        qos: opt(7),
        labels: opt(8),
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use apron_cost::{ClassifyConfig, Window, classify::window_is_idle};
    use datafusion::arrow::array::{BooleanArray, Float64Array};
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use datafusion::prelude::SessionContext;

    use super::*;

    #[test]
    fn slices_hold_at_most_the_budget_and_the_count() {
        // 1,440 minutes a GPU under 4,096: two at a time.
        assert_eq!(slices(&[1_440; 5], 64, 4_096), vec![0..2, 2..4, 4..5]);
        // Short days go further; the count still caps.
        assert_eq!(slices(&[200; 5], 3, 4_096), vec![0..3, 3..5]);
        // One item over the budget is read alone; nothing is lost or repeated.
        assert_eq!(slices(&[10, 5_000, 10, 10], 64, 100), vec![0..1, 1..2, 2..4]);
        assert_eq!(slices(&[], 64, 100), Vec::<std::ops::Range<usize>>::new());
    }

    #[test]
    fn a_read_takes_as_many_gpus_as_the_budget_allows() {
        // A whole day of 1 s windows under 250,000: 2 GPUs; an hour: all 64.
        assert_eq!(gpus_per_read(64, 250_000, 86_400), 2);
        assert_eq!(gpus_per_read(64, 250_000, 3_600), 64);
        // Never none, even when one GPU alone is over the budget.
        assert_eq!(gpus_per_read(64, 1_000, 86_400), 1);
        assert_eq!(gpus_per_read(0, 1_000, 0), 1);
    }

    /// The SQL form of the idle rule agrees with the classifier on every combination of
    /// present, absent and boundary signals, for the default and a custom config.
    #[tokio::test]
    async fn the_idle_rule_in_sql_agrees_with_the_classifier() {
        let values = [None, Some(0.0), Some(0.005), Some(0.01), Some(0.02), Some(0.05), Some(0.5), Some(1.0)];
        let pairs: Vec<(Option<f64>, Option<f64>)> =
            values.iter().flat_map(|sm| values.iter().map(move |u| (*sm, *u))).collect();
        let schema = Arc::new(Schema::new(vec![
            Field::new("sm_active_max", DataType::Float64, true),
            Field::new("gpu_util_max", DataType::Float64, true),
        ]));
        let batch = RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Float64Array::from_iter(pairs.iter().map(|p| p.0))),
                Arc::new(Float64Array::from_iter(pairs.iter().map(|p| p.1))),
            ],
        )
        .expect("batch");
        let ctx = SessionContext::new();
        ctx.register_batch("gpu_samples", batch).expect("register");
        let custom = ClassifyConfig { idle_sm_active_max: 0.05, idle_gpu_util_max: 0.02, ..ClassifyConfig::default() };
        for cfg in [ClassifyConfig::default(), custom] {
            let sql = format!("SELECT {} FROM gpu_samples", cfg.idle_sql());
            let out = ctx.sql(&sql).await.expect("plan").collect().await.expect("run");
            let got: Vec<Option<bool>> = out
                .iter()
                .flat_map(|b| {
                    b.column(0).as_any().downcast_ref::<BooleanArray>().expect("bool").iter().collect::<Vec<_>>()
                })
                .collect();
            let want: Vec<Option<bool>> = pairs
                .iter()
                .map(|(sm, u)| {
                    let w = Window {
                        end_us: 0,
                        window_us: 1,
                        sm_active_max: *sm,
                        gpu_util_max: *u,
                        sm_active_mean: *sm,
                        holder: None,
                    };
                    window_is_idle(&w, &cfg)
                })
                .collect();
            assert_eq!(got, want, "{sql}");
        }
    }
}
