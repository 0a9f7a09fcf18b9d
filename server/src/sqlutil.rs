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

/// A SQL timestamp literal (RFC 3339, UTC).
pub(crate) fn ts(us: i64) -> String {
    format!("TIMESTAMP '{}'", UnixMicros(us).to_rfc3339())
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
    let list: Vec<String> = gpus.iter().map(|g| sql_str(g)).collect();
    format!(" AND gpu_uuid NOT IN ({})", list.join(", "))
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
