//! The SQL the evaluators (cost ledger, alerts, recommendations, reports, import, remote
//! read, the rollup) share: literals written safely into SQL text, reads through the
//! engine with one typed error that names the statement, the owner columns of
//! `gpu_samples` and the MIG-parent exclusion. One module, so that no evaluator reads
//! through another's.

use std::collections::{BTreeMap, BTreeSet};

use apron_common::UnixMicros;
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

/// One holder's facts as the windows carry them (the owner columns).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Owner {
    pub(crate) kind: String,
    pub(crate) owner: String,
    pub(crate) namespace: Option<String>,
    pub(crate) job_id: Option<String>,
    pub(crate) user: Option<String>,
    pub(crate) account: Option<String>,
    pub(crate) partition: Option<String>,
    pub(crate) qos: Option<String>,
    pub(crate) labels: Option<String>,
}

/// The owner columns of `gpu_samples`, quoted (`partition` is an SQL keyword), in the
/// order [`owner_at`] reads them.
pub(crate) const OWNER_COLUMNS_SQL: &str = "\"owner_kind\", \"owner\", \"namespace\", \"job_id\", \"owner_user\", \"account\", \"partition\", \"qos\", \"pod_labels\"";

/// The owner of row `r`, from the [`OWNER_COLUMNS_SQL`] columns starting at `first`;
/// `None` when nobody holds the GPU (or the columns are not strings).
pub(crate) fn owner_at(b: &RecordBatch, first: usize, r: usize) -> Option<Owner> {
    let s = |i: usize| b.column(first + i).as_string_opt::<i32>();
    let opt = |i: usize| s(i).filter(|c| !c.is_null(r)).map(|c| c.value(r).to_owned());
    Some(Owner {
        kind: opt(0)?,
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

impl Owner {
    /// The labels as a map (the column holds a JSON object; non-string values are skipped).
    pub(crate) fn label_map(&self) -> BTreeMap<String, String> {
        self.labels
            .as_deref()
            .and_then(|l| serde_json::from_str::<BTreeMap<String, serde_json::Value>>(l).ok())
            .map(|m| m.into_iter().filter_map(|(k, v)| v.as_str().map(|s| (k, s.to_owned()))).collect())
            .unwrap_or_default()
    }
}
