//! Why an input could not be imported at all.
//!
//! Samples that are merely unusable (an unmapped metric, no timestamp, the first of a
//! series) are not errors: they are counted under a reason in
//! [`ImportOutcome::skipped`](crate::ImportOutcome::skipped). An error means the input
//! itself is malformed, so nothing of it is imported.

/// An input that is not valid Prometheus/OpenMetrics text or Prometheus API JSON, or
/// options that make no sense.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImportError {
    /// Prometheus or OpenMetrics text that does not parse; `line` is 1-based.
    #[error("line {line}: {message}")]
    Text { line: usize, message: String },
    /// Text input that is not UTF-8.
    #[error("line {line}: the input is not UTF-8 (byte offset {offset})")]
    NotUtf8 { line: usize, offset: usize },
    /// JSON that does not parse or does not have the shape of a Prometheus API answer.
    #[error("JSON line {line}, column {column}: {message}")]
    Json { line: usize, column: usize, message: String },
    /// A Prometheus API answer whose `status` is not `success`; `response` is 1-based
    /// (a file may hold an array of answers).
    #[error("response {response}: Prometheus answered status {status:?}: {error_type}: {error}")]
    Api { response: usize, status: String, error_type: String, error: String },
    /// A `scalar` or `string` result: no series to import.
    #[error(
        "response {response}: resultType {result_type:?} holds no series; export a range query (matrix) or an instant vector"
    )]
    UnsupportedResult { response: usize, result_type: String },
    /// An answer without `data.result`.
    #[error("response {response}: no data.resultType/data.result in this object")]
    NoData { response: usize },
    /// The input could not be read (a file, a pipe).
    #[error("reading the input: {0}")]
    Read(String),
    /// The spill file (history larger than the memory budget) could not be written or
    /// read back.
    #[error("{0}")]
    Spill(String),
    /// Options out of range (see [`ImportOptions`](crate::ImportOptions)).
    #[error("import options: {0}")]
    Options(String),
}
