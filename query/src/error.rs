//! Query errors, classified for the HTTP layer without depending on it.
//!
//! | error | status | why this status |
//! | --- | --- | --- |
//! | `Syntax`, `Plan`, `Invalid`, `ReadOnly` | 400 | the request itself is wrong; resending it fails the same way |
//! | `TooManyRows`, `ResultTooLarge` | 413 | the answer is too large to send; add LIMIT or aggregate |
//! | `Timeout` | 504 | the server gave up waiting on the query engine (Druid answers 504 for query timeouts too); 408 would blame the client's upload |
//! | `Busy` | 503 | every query slot is taken; retry later (server-wide, not per client, so not 429) |
//! | `MemoryLimit` | 507 | the server cannot hold this query's working set; retrying as-is fails again (like the collector's 507 for a full disk) |
//! | `Source`, `Internal` | 500 | reading the data or the engine failed |
//!
//! The JSON body is `{"error": <one-line message>, "detail": <engine text or a hint>}`
//! ([`QueryError::to_json`]); [`QueryError::code`] is a stable machine-readable name.

use std::time::Duration;

use datafusion::arrow::error::ArrowError;
use datafusion::common::DataFusionError;

use crate::readonly::ReadOnlyViolation;
use crate::source::SourceError;

#[derive(Debug, thiserror::Error)]
pub enum QueryError {
    /// The SQL does not parse.
    #[error("SQL syntax error: {detail}")]
    Syntax { detail: String },
    /// The SQL parses but does not plan: unknown table or column, type mismatch,
    /// unsupported feature.
    #[error("invalid query: {detail}")]
    Plan { detail: String },
    /// The query failed on the data: a cast that does not hold, division by zero,
    /// overflow, a malformed argument to a function.
    #[error("query failed: {detail}")]
    Invalid { detail: String },
    /// A write (DDL, DML, COPY, SET, …) was refused; nothing ran.
    #[error("read-only: {what} is not allowed")]
    ReadOnly { what: String },
    #[error("query timed out after {}", humantime::format_duration(*.timeout))]
    Timeout { timeout: Duration },
    #[error("the result has more than {max} rows")]
    TooManyRows { max: usize },
    #[error("the result is larger than the limit of {}", human_bytes(*.max_bytes))]
    ResultTooLarge { max_bytes: u64 },
    #[error("server busy: all {max_concurrent} query slots are in use (waited {})", humantime::format_duration(*.waited))]
    Busy { max_concurrent: usize, waited: Duration },
    #[error("query exceeded the memory limit of {}", human_bytes(*.limit_bytes))]
    MemoryLimit { limit_bytes: u64, detail: String },
    /// Listing or reading the table's files failed.
    #[error("reading table data: {detail}")]
    Source { detail: String },
    #[error("internal error: {detail}")]
    Internal { detail: String },
}

impl QueryError {
    /// The HTTP status this error maps to (see the module table).
    pub fn status(&self) -> u16 {
        match self {
            QueryError::Syntax { .. }
            | QueryError::Plan { .. }
            | QueryError::Invalid { .. }
            | QueryError::ReadOnly { .. } => 400,
            QueryError::TooManyRows { .. } | QueryError::ResultTooLarge { .. } => 413,
            QueryError::Timeout { .. } => 504,
            QueryError::Busy { .. } => 503,
            QueryError::MemoryLimit { .. } => 507,
            QueryError::Source { .. } | QueryError::Internal { .. } => 500,
        }
    }

    /// A short machine-readable name.
    pub fn code(&self) -> &'static str {
        match self {
            QueryError::Syntax { .. } => "sql_syntax",
            QueryError::Plan { .. } => "invalid_query",
            QueryError::Invalid { .. } => "query_failed",
            QueryError::ReadOnly { .. } => "read_only",
            QueryError::Timeout { .. } => "timeout",
            QueryError::TooManyRows { .. } => "too_many_rows",
            QueryError::ResultTooLarge { .. } => "result_too_large",
            QueryError::Busy { .. } => "busy",
            QueryError::MemoryLimit { .. } => "memory_limit",
            QueryError::Source { .. } => "source_error",
            QueryError::Internal { .. } => "internal",
        }
    }

    /// The contract's `detail`: the engine's text where there is one, else what to do.
    pub fn detail(&self) -> String {
        match self {
            QueryError::Syntax { detail } | QueryError::Plan { detail } | QueryError::Invalid { detail } => {
                detail.clone()
            }
            QueryError::ReadOnly { .. } => {
                "this SQL API answers queries only (SELECT, EXPLAIN, DESCRIBE, SHOW); DDL, DML, COPY and SET are refused"
                    .to_owned()
            }
            QueryError::Timeout { .. } => {
                "the query was cancelled at the server's limit (query.timeout); narrow the time range, \
                 or aggregate a rollup table"
                    .to_owned()
            }
            QueryError::TooManyRows { .. } => {
                "add a LIMIT or aggregate; the limit is query.max_result_rows".to_owned()
            }
            QueryError::ResultTooLarge { .. } => {
                "select fewer columns, add a LIMIT or aggregate; the limit is query.max_result_bytes".to_owned()
            }
            QueryError::Busy { .. } => "retry shortly; the limit is query.max_concurrent".to_owned(),
            QueryError::MemoryLimit { detail, .. } => detail.clone(),
            QueryError::Source { detail } | QueryError::Internal { detail } => detail.clone(),
        }
    }

    /// True when the same request may succeed later.
    pub fn is_retryable(&self) -> bool {
        matches!(self, QueryError::Busy { .. } | QueryError::Timeout { .. } | QueryError::Source { .. })
    }

    /// The contract's error body: `{"error": "...", "detail": "..."}`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({ "error": self.to_string(), "detail": self.detail() })
    }

    /// Classifies an error DataFusion returned while planning or running a query.
    pub fn from_datafusion(e: DataFusionError, memory_limit_bytes: u64) -> QueryError {
        let text = e.strip_backtrace();
        // A memory refusal can be wrapped (by an operator, a spawned task, an Arrow
        // external error) anywhere in the chain; it decides the class.
        if chain(&e).any(|d| matches!(d, DataFusionError::ResourcesExhausted(_))) {
            return QueryError::MemoryLimit { limit_bytes: memory_limit_bytes, detail: text };
        }
        if let Some(source) = source_error(&e) {
            return QueryError::Source { detail: source.to_string() };
        }
        match e.find_root() {
            DataFusionError::SQL(..) => QueryError::Syntax { detail: text },
            DataFusionError::Plan(_)
            | DataFusionError::SchemaError(..)
            | DataFusionError::NotImplemented(_)
            | DataFusionError::Configuration(_) => QueryError::Plan { detail: text },
            DataFusionError::Execution(_) => QueryError::Invalid { detail: text },
            DataFusionError::ArrowError(a, _) if is_data_error(a) => QueryError::Invalid { detail: text },
            _ => QueryError::Internal { detail: text },
        }
    }
}

impl From<SourceError> for QueryError {
    fn from(e: SourceError) -> Self {
        QueryError::Source { detail: e.to_string() }
    }
}

impl From<ReadOnlyViolation> for QueryError {
    fn from(v: ReadOnlyViolation) -> Self {
        QueryError::ReadOnly { what: v.what }
    }
}

/// Arrow errors a query's data or arguments cause (as opposed to I/O or bugs).
fn is_data_error(e: &ArrowError) -> bool {
    matches!(
        e,
        ArrowError::CastError(_)
            | ArrowError::DivideByZero
            | ArrowError::ArithmeticOverflow(_)
            | ArrowError::ParseError(_)
            | ArrowError::InvalidArgumentError(_)
            | ArrowError::ComputeError(_)
    )
}

/// Every DataFusionError in `e`'s source chain, `e` first.
fn chain(e: &DataFusionError) -> impl Iterator<Item = &DataFusionError> {
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(e);
    std::iter::from_fn(move || {
        while let Some(cur) = next {
            next = cur.source();
            if let Some(d) = cur.downcast_ref::<DataFusionError>() {
                return Some(d);
            }
            if let Some(d) = cur.downcast_ref::<std::sync::Arc<DataFusionError>>() {
                return Some(d.as_ref());
            }
        }
        None
    })
}

/// A [`SourceError`] the table provider wrapped, if any.
fn source_error(e: &DataFusionError) -> Option<&SourceError> {
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(cur) = next {
        if let Some(s) = cur.downcast_ref::<SourceError>() {
            return Some(s);
        }
        next = cur.source();
    }
    None
}

/// `1073741824` → `1 GiB`, `1536` → `1.5 KiB`, `100` → `100 bytes`.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if n < 1024 {
        return format!("{n} bytes");
    }
    let mut v = n as f64;
    let mut unit = "";
    for u in UNITS {
        if v < 1024.0 {
            break;
        }
        v /= 1024.0;
        unit = u;
    }
    if v.fract() == 0.0 { format!("{v:.0} {unit}") } else { format!("{v:.1} {unit}") }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_and_maps_status() {
        let lim = 1 << 20;
        let e = QueryError::from_datafusion(DataFusionError::ResourcesExhausted("pool".into()), lim);
        assert_eq!((e.status(), e.code()), (507, "memory_limit"));
        assert_eq!(e.to_string(), "query exceeded the memory limit of 1 MiB");
        let wrapped = DataFusionError::Context(
            "sorting".into(),
            Box::new(DataFusionError::External(Box::new(DataFusionError::ResourcesExhausted("x".into())))),
        );
        assert_eq!(QueryError::from_datafusion(wrapped, lim).status(), 507);
        let plan = QueryError::from_datafusion(DataFusionError::Plan("no table".into()), lim);
        assert_eq!((plan.status(), plan.code()), (400, "invalid_query"));
        let cast = DataFusionError::ArrowError(Box::new(ArrowError::CastError("x".into())), None);
        assert_eq!(QueryError::from_datafusion(cast, lim).code(), "query_failed");
        let io = DataFusionError::IoError(std::io::Error::other("disk"));
        assert_eq!(QueryError::from_datafusion(io, lim).status(), 500);
        let json = QueryError::ReadOnly { what: "INSERT".into() }.to_json();
        assert_eq!(json["error"], "read-only: INSERT is not allowed");
        assert!(json["detail"].as_str().is_some_and(|d| d.contains("queries only")));
        assert_eq!(QueryError::Timeout { timeout: Duration::from_millis(1500) }.status(), 504);
        assert_eq!(QueryError::Busy { max_concurrent: 1, waited: Duration::ZERO }.status(), 503);
        assert_eq!(QueryError::TooManyRows { max: 1 }.status(), 413);
    }

    #[test]
    fn bytes() {
        assert_eq!(human_bytes(100), "100 bytes");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(1 << 30), "1 GiB");
    }
}
