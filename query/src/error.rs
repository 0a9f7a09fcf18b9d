//! Query errors, classified for the HTTP layer without depending on it.
//!
//! | error | status | why this status |
//! | --- | --- | --- |
//! | `Syntax`, `Plan`, `Invalid`, `ReadOnly`, `TooComplex` | 400 | the request itself is wrong; resending it fails the same way |
//! | `TooManyRows`, `ResultTooLarge` | 413 | the answer is too large to send; add LIMIT or aggregate |
//! | `Timeout` | 504 | the server gave up waiting on the query engine (Druid answers 504 for query timeouts too); 408 would blame the client's upload |
//! | `Busy` | 503 | every query slot is taken; retry later (server-wide, not per client, so not 429) |
//! | `MemoryLimit` | 507 | the server cannot hold this query's working set; retrying as-is fails again (like the collector's 507 for a full disk) |
//! | `Source`, `Internal` | 500 | reading the data or the engine failed |
//! | `Cluster` | 503 | the Ballista cluster failed the query (an executor lost, the scheduler down) and it did not run here instead; retry later |
//!
//! The JSON body is `{"error": <one-line message>, "detail": <engine text or a hint>,
//! "code": <stable name>}` ([`QueryError::to_json`]); [`QueryError::code`] is the stable
//! machine-readable name (`invalid_cast`, `division_by_zero`, `invalid_regex`, … for
//! `Invalid`: what the user's query did wrong, never a value).
//!
//! **What errors may say.** No error carries a server path ([`redact_paths`] runs on
//! every engine text). For a scoped (`team:<name>`) principal, errors that come from
//! evaluating the query on data — `Invalid`, `MemoryLimit`, `Source`, `Internal`, `Cluster` — carry
//! no engine text at all: [`QueryError::opaque`] replaces it with the kind of failure and
//! an error id that the server logs together with the full text.
//!
//! **Internal errors say nothing to anyone.** DataFusion's internal errors (a bug, an
//! optimizer rule that failed) can quote the logical or physical plan — file paths,
//! literals of the query, the plan of a scoped table. [`QueryError::from_datafusion`]
//! logs such an error at `warn` under an error id (`an internal query error`) and keeps
//! only "the query failed inside the server (error id …)" for every principal.
//! The server's own passes and routes (recommendations, reports, remote read) answer
//! their internal failures in the same way: [`QueryError::value_free_message`] and an
//! error id, never their SQL (`apron::access::internal_error`).

use std::time::Duration;

use datafusion::arrow::error::ArrowError;
use datafusion::common::DataFusionError;

use crate::readonly::ReadOnlyViolation;
use crate::source::SourceError;

#[derive(Debug, thiserror::Error)]
pub enum QueryError {
    /// The SQL does not parse. `detail`'s first line is the cause (the message's one
    /// line); what follows it, if anything, is [`QueryError::detail`].
    #[error("SQL syntax error: {}", cause(detail))]
    Syntax { detail: String },
    /// The SQL parses but does not plan: unknown table or column, type mismatch,
    /// unsupported feature. `detail` as for `Syntax`.
    #[error("invalid query: {}", cause(detail))]
    Plan { detail: String },
    /// The query failed on the data: a cast that does not hold, division by zero,
    /// overflow, a malformed argument to a function. `code` says which, in words that
    /// never hold a value. `detail` as for `Syntax`.
    #[error("query failed: {}", cause(detail))]
    Invalid { code: &'static str, detail: String },
    /// The statement is nested too deep or too large to plan safely; nothing ran.
    #[error("query too complex: {what}")]
    TooComplex { what: String, setting: &'static str },
    /// A write (DDL, DML, COPY, SET, …) was refused; nothing ran.
    #[error("read-only: {what} is not allowed")]
    ReadOnly { what: String },
    #[error("query timed out after {}", humantime::format_duration(*.timeout))]
    Timeout { timeout: Duration },
    #[error("the result has more than {max} rows")]
    TooManyRows { max: usize },
    #[error("the result is larger than the limit of {}", human_bytes(*.max_bytes))]
    ResultTooLarge { max_bytes: u64 },
    /// Every slot is taken (`share: false`), or this principal already runs its share
    /// of them (`share: true`).
    #[error("{}", busy_message(*.max_concurrent, *.waited, *.share))]
    Busy { max_concurrent: usize, waited: Duration, share: bool },
    #[error("query exceeded the memory limit of {}", human_bytes(*.limit_bytes))]
    MemoryLimit { limit_bytes: u64, detail: String },
    /// Listing or reading the table's files failed.
    #[error("reading table data: {detail}")]
    Source { detail: String },
    #[error("internal error: {detail}")]
    Internal { detail: String },
    /// The Ballista cluster failed the query (an executor lost, the scheduler down) and
    /// it was not run here instead; nothing of it is returned.
    #[error("the query cluster failed the query: {detail}")]
    Cluster { detail: String },
}

impl QueryError {
    /// The HTTP status this error maps to (see the module table).
    pub fn status(&self) -> u16 {
        match self {
            QueryError::Syntax { .. }
            | QueryError::Plan { .. }
            | QueryError::Invalid { .. }
            | QueryError::TooComplex { .. }
            | QueryError::ReadOnly { .. } => 400,
            QueryError::TooManyRows { .. } | QueryError::ResultTooLarge { .. } => 413,
            QueryError::Timeout { .. } => 504,
            QueryError::Busy { .. } => 503,
            QueryError::MemoryLimit { .. } => 507,
            QueryError::Source { .. } | QueryError::Internal { .. } => 500,
            QueryError::Cluster { .. } => 503,
        }
    }

    /// A short machine-readable name.
    pub fn code(&self) -> &'static str {
        match self {
            QueryError::Syntax { .. } => "sql_syntax",
            QueryError::Plan { .. } => "invalid_query",
            QueryError::Invalid { code, .. } => code,
            QueryError::TooComplex { .. } => "query_too_complex",
            QueryError::ReadOnly { .. } => "read_only",
            QueryError::Timeout { .. } => "timeout",
            QueryError::TooManyRows { .. } => "too_many_rows",
            QueryError::ResultTooLarge { .. } => "result_too_large",
            QueryError::Busy { .. } => "busy",
            QueryError::MemoryLimit { .. } => "memory_limit",
            QueryError::Source { .. } => "source_error",
            QueryError::Internal { .. } => "internal",
            QueryError::Cluster { .. } => "cluster_unavailable",
        }
    }

    /// The contract's `detail`: what the message's one line does not say — the rest of
    /// the engine's text (the valid columns, a hint) — or else what to do. Never the
    /// message again.
    pub fn detail(&self) -> String {
        match self {
            QueryError::Syntax { detail } => more(detail).unwrap_or_else(|| {
                "the SQL is PostgreSQL's dialect; docs/sql.md has the tables, columns and examples".to_owned()
            }),
            QueryError::Plan { detail } => more(detail).unwrap_or_else(|| {
                "docs/sql.md and information_schema.columns list the tables, columns and their types".to_owned()
            }),
            QueryError::Invalid { code, detail } => more(detail).unwrap_or_else(|| describe(code).to_owned()),
            QueryError::TooComplex { setting, .. } => {
                format!("simplify the query (fewer terms, a shallower nesting); the limit is {setting}")
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
            QueryError::Busy { share: false, .. } => "retry shortly; the limit is query.max_concurrent".to_owned(),
            QueryError::Busy { share: true, .. } => {
                "retry when one of your queries has finished; the limit is query.max_concurrent_per_team for a \
                 team, query.max_concurrent_per_principal for unscoped clients"
                    .to_owned()
            }
            QueryError::MemoryLimit { detail, .. } => detail.clone(),
            QueryError::Source { detail } | QueryError::Internal { detail } => detail.clone(),
            QueryError::Cluster { detail } => {
                format!("{detail}; retry, or set query.ballista.fallback_local to run such queries on the query server")
            }
        }
    }

    /// True when the same request may succeed later.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            QueryError::Busy { .. }
                | QueryError::Timeout { .. }
                | QueryError::Source { .. }
                | QueryError::Cluster { .. }
        )
    }

    /// The contract's error body: `{"error": "...", "detail": "...", "code": "..."}`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({ "error": self.to_string(), "detail": self.detail(), "code": self.code() })
    }

    /// True for errors whose text may describe the data the query ran over (a value
    /// that did not cast, a file that could not be read, the memory an operator held).
    pub fn describes_data(&self) -> bool {
        matches!(
            self,
            QueryError::Invalid { .. }
                | QueryError::MemoryLimit { .. }
                | QueryError::Source { .. }
                | QueryError::Internal { .. }
                | QueryError::Cluster { .. }
        )
    }

    /// This error as a scoped principal may see it: for [`QueryError::describes_data`]
    /// errors, the kind of failure and `error_id` instead of the engine's text (the
    /// caller logs the full error under the same id); other errors unchanged.
    pub fn opaque(self, error_id: &str) -> QueryError {
        let see_log = |what: &str| logged(what, error_id);
        match self {
            QueryError::Invalid { code, .. } => QueryError::Invalid { code, detail: see_log(describe(code)) },
            QueryError::MemoryLimit { limit_bytes, .. } => {
                QueryError::MemoryLimit { limit_bytes, detail: see_log("the query needed more memory than its limit") }
            }
            QueryError::Source { .. } => QueryError::Source { detail: see_log("reading table data failed") },
            // Already logged under its own id (from_datafusion): that id stays.
            QueryError::Internal { detail } if detail.ends_with(LOGGED_SUFFIX) => QueryError::Internal { detail },
            QueryError::Internal { .. } => {
                QueryError::Internal { detail: see_log("the query failed inside the server") }
            }
            QueryError::Cluster { .. } => QueryError::Cluster { detail: see_log("the query cluster failed") },
            other => other,
        }
    }

    /// What this error was, in words that never hold engine text, SQL, a plan or a
    /// value: the limit that was hit (with its setting's size), or the kind of failure.
    /// For answers to requests whose query the server wrote itself (a recommendation
    /// run, a report, remote read), where the query's text is not the client's.
    pub fn value_free_message(&self) -> String {
        match self {
            QueryError::Timeout { .. }
            | QueryError::TooManyRows { .. }
            | QueryError::ResultTooLarge { .. }
            | QueryError::Busy { .. }
            | QueryError::MemoryLimit { .. } => self.to_string(),
            QueryError::Syntax { .. } | QueryError::Plan { .. } | QueryError::ReadOnly { .. } => {
                "the server's query was refused".to_owned()
            }
            QueryError::TooComplex { setting, .. } => format!("the server's query is too complex ({setting})"),
            QueryError::Invalid { code, .. } => format!("the query failed: {}", describe(code)),
            QueryError::Source { .. } => "reading table data failed".to_owned(),
            QueryError::Internal { .. } => "the query failed inside the server".to_owned(),
            QueryError::Cluster { .. } => "the query cluster failed the query".to_owned(),
        }
    }

    /// Classifies an error DataFusion returned while planning or running a query.
    pub fn from_datafusion(e: DataFusionError, memory_limit_bytes: u64) -> QueryError {
        let text = engine_text(&redact_paths(&e.strip_backtrace()));
        // A memory refusal can be wrapped (by an operator, a spawned task, an Arrow
        // external error) anywhere in the chain; it decides the class.
        if chain(&e).any(|d| matches!(d, DataFusionError::ResourcesExhausted(_))) {
            return QueryError::MemoryLimit { limit_bytes: memory_limit_bytes, detail: text };
        }
        if let Some(source) = source_error(&e) {
            return QueryError::Source { detail: redact_paths(&source.to_string()) };
        }
        if vanished_file(&e) {
            return QueryError::Source { detail: VANISHED.to_owned() };
        }
        if object_store_failed(&e) {
            return QueryError::Source { detail: text };
        }
        // A value the user's expression could not handle, however deeply an operator or
        // the Parquet decoder (which evaluates pushed-down predicates) wrapped it.
        if let Some(a) = arrow_data_error(&e) {
            return QueryError::Invalid { code: arrow_code(a), detail: text };
        }
        match e.find_root() {
            DataFusionError::SQL(..) => QueryError::Syntax { detail: text },
            DataFusionError::Plan(_)
            | DataFusionError::SchemaError(..)
            | DataFusionError::NotImplemented(_)
            | DataFusionError::Configuration(_) => QueryError::Plan { detail: text },
            DataFusionError::Execution(m) => QueryError::Invalid { code: execution_code(m), detail: text },
            // An internal error may quote the plan (logical or physical): logged under
            // an error id, never sent, whoever asked.
            _ => {
                let id = error_id();
                tracing::warn!(error_id = %id, detail = %text, "an internal query error");
                QueryError::Internal { detail: logged("the query failed inside the server", &id) }
            }
        }
    }
}

/// The first line of an error's text: its cause, said once.
fn cause(text: &str) -> &str {
    text.lines().next().unwrap_or_default().trim()
}

/// What follows the cause, if anything.
fn more(text: &str) -> Option<String> {
    text.split_once('\n').map(|(_, rest)| rest.trim().to_owned()).filter(|r| !r.is_empty())
}

/// DataFusion's text as a cause on its first line and the rest after it: the wrappers'
/// own words (`Optimizer rule '…' failed / caused by`, `Error during planning: `,
/// `Arrow error: `, `ParserError("…")`, the catalog's `datafusion.public.` qualifier)
/// go, so the message says the cause once, in the user's terms.
pub fn engine_text(text: &str) -> String {
    // A chain of wrappers: the root cause is the last link.
    let mut t = text.rsplit("\ncaused by\n").next().unwrap_or(text).trim().to_owned();
    const PREFIXES: &[&str] = &[
        "Error during planning: ",
        "Schema error: ",
        "Execution error: ",
        "Arrow error: ",
        "External error: ",
        "SQL error: ",
        "This feature is not implemented: ",
        "Optimizer rule ",
    ];
    loop {
        let before = t.len();
        for p in PREFIXES {
            if let Some(rest) = t.strip_prefix(p) {
                t = rest.to_owned();
            }
        }
        if let Some(inner) = t.strip_prefix("ParserError(\"").and_then(|r| r.strip_suffix("\")")) {
            t = inner.replace("\\\"", "\"");
        }
        if t.len() == before {
            break;
        }
    }
    let t = t.replace("datafusion.public.", "");
    // `No field named x.\nValid fields are t.a, t.b, …`: the list is the detail, and the
    // table qualifier repeated on every column is noise.
    match t.split_once('\n') {
        Some((first, rest)) if rest.starts_with("Valid fields are ") => {
            let fields: Vec<&str> = rest["Valid fields are ".len()..]
                .trim_end_matches('.')
                .split(", ")
                .map(|f| f.rsplit('.').next().unwrap_or(f))
                .collect();
            let mut unique = Vec::with_capacity(fields.len());
            for f in fields {
                if !unique.contains(&f) {
                    unique.push(f);
                }
            }
            format!("{first}\nthe columns are: {}", unique.join(", "))
        }
        _ => t,
    }
}

/// `what (error id …; the server's log has the detail)`: the text of an error whose
/// detail went to the log under `error_id`.
pub fn logged(what: &str, error_id: &str) -> String {
    format!("{what} (error id {error_id}{LOGGED_SUFFIX}")
}

const LOGGED_SUFFIX: &str = "; the server's log has the detail)";

/// A short id that ties an answer to its log line (not a secret, just unique).
pub fn error_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    format!("{:012x}", (nanos ^ N.fetch_add(1, Ordering::Relaxed).rotate_left(40)) & 0xffff_ffff_ffff)
}

impl From<SourceError> for QueryError {
    fn from(e: SourceError) -> Self {
        // A lake's errors name the bucket's URL.
        QueryError::Source { detail: redact_paths(&e.to_string()) }
    }
}

impl From<ReadOnlyViolation> for QueryError {
    fn from(v: ReadOnlyViolation) -> Self {
        QueryError::ReadOnly { what: v.what }
    }
}

/// The detail of a [`QueryError::Source`] for a data file that disappeared while the
/// query read it.
const VANISHED: &str = "a data file was replaced (compaction, a ledger or rollup pass) while the query read it";

impl QueryError {
    /// True when a file the query had planned to read was gone when it read it: the
    /// store replaced it (compaction, or a derived partition rewritten) and its grace
    /// ran out under a long query. Planning again sees the replacement.
    pub fn is_vanished_file(&self) -> bool {
        matches!(self, QueryError::Source { detail } if detail == VANISHED)
    }
}

/// True when `e` is, somewhere in its chain, "not found" from the object store or the
/// file system.
fn vanished_file(e: &DataFusionError) -> bool {
    any_in_chain(e, |cur| {
        if let Some(DataFusionError::ObjectStore(o)) = cur.downcast_ref::<DataFusionError>()
            && matches!(o.as_ref(), datafusion::object_store::Error::NotFound { .. })
        {
            return true;
        }
        if matches!(
            cur.downcast_ref::<datafusion::object_store::Error>(),
            Some(datafusion::object_store::Error::NotFound { .. })
        ) {
            return true;
        }
        if cur.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::NotFound) {
            return true;
        }
        matches!(cur.downcast_ref::<DataFusionError>(), Some(DataFusionError::IoError(io)) if io.kind() == std::io::ErrorKind::NotFound)
    })
}

/// True when the object store failed under the query (unreachable, refused, timed
/// out): the data could not be read, which a retry may fix.
fn object_store_failed(e: &DataFusionError) -> bool {
    any_in_chain(e, |cur| {
        matches!(cur.downcast_ref::<DataFusionError>(), Some(DataFusionError::ObjectStore(_)))
            || cur.downcast_ref::<datafusion::object_store::Error>().is_some()
    })
}

/// True when `pred` holds for `e` or anything in its source chain (through Arrow's
/// and the Parquet decoder's `External` wrappers).
fn any_in_chain(e: &DataFusionError, pred: impl Fn(&(dyn std::error::Error + 'static)) -> bool) -> bool {
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(cur) = next {
        if pred(cur) {
            return true;
        }
        next = match cur.downcast_ref::<ArrowError>() {
            Some(ArrowError::ExternalError(inner)) => Some(inner.as_ref()),
            _ => match cur.downcast_ref::<datafusion::parquet::errors::ParquetError>() {
                Some(datafusion::parquet::errors::ParquetError::External(inner)) => Some(inner.as_ref()),
                _ => cur.source(),
            },
        };
    }
    false
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

/// The first Arrow data error anywhere in `e`'s source chain (through DataFusion's
/// wrappers, `Arc`s and the Parquet decoder's `External`).
fn arrow_data_error(e: &DataFusionError) -> Option<&ArrowError> {
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(cur) = next {
        if let Some(DataFusionError::ArrowError(a, _)) = cur.downcast_ref::<DataFusionError>()
            && is_data_error(a)
        {
            return Some(a);
        }
        if let Some(a) = cur.downcast_ref::<ArrowError>() {
            if is_data_error(a) {
                return Some(a);
            }
            // Arrow wraps other errors (a UDF's DataFusionError) as External.
            if let ArrowError::ExternalError(inner) = a {
                next = Some(inner.as_ref());
                continue;
            }
        }
        next = cur.source();
    }
    None
}

fn arrow_code(e: &ArrowError) -> &'static str {
    match e {
        ArrowError::CastError(_) => "invalid_cast",
        ArrowError::DivideByZero => "division_by_zero",
        ArrowError::ArithmeticOverflow(_) => "arithmetic_overflow",
        ArrowError::ParseError(_) => "invalid_value",
        _ => "invalid_argument",
    }
}

/// DataFusion's execution errors are text; the stable code is read from the words
/// DataFusion uses (never from a value).
fn execution_code(message: &str) -> &'static str {
    let m = message.to_ascii_lowercase();
    if m.contains("max_string_result_bytes") {
        "string_result_too_large"
    } else if m.contains("regular expression") || m.contains("regex") {
        "invalid_regex"
    } else if m.contains("divide by zero") || m.contains("division by zero") {
        "division_by_zero"
    } else if m.contains("overflow") {
        "arithmetic_overflow"
    } else if m.contains("cast") {
        "invalid_cast"
    } else {
        "query_failed"
    }
}

/// What an `Invalid` error's code means, in words for a scoped principal.
fn describe(code: &str) -> &'static str {
    match code {
        "invalid_cast" => "a value could not be cast to the requested type",
        "division_by_zero" => "division by zero",
        "arithmetic_overflow" => "an arithmetic result overflowed its type",
        "invalid_value" => "a value could not be parsed",
        "invalid_regex" => "a regular expression is invalid",
        "string_result_too_large" => "a string function's result would exceed query.max_string_result_bytes",
        "invalid_argument" => "a function got an argument it cannot take",
        _ => "the query failed on a value",
    }
}

/// `text` with every file path and object-store URL replaced by `<path>`: errors must
/// not tell a client where or how the server stores data. A path is a run of
/// non-delimiters with at least two `/` (from the first `/`, or from the URL's scheme).
pub fn redact_paths(text: &str) -> String {
    redact_paths_with(text, |token, start| format!("{}<path>", &token[..start]))
}

/// [`redact_paths`] for a plan (`EXPLAIN`): a data file keeps its place in the lake —
/// from its table's directory on (`gpu_samples/date=2026-11-19/….parquet`), which
/// `docs/architecture.md` documents and pruning is read from — but loses the server's
/// data directory and the byte range a partition reads.
pub fn redact_plan_paths(text: &str) -> String {
    redact_paths_with(text, |token, start| {
        let tables = crate::tables::TABLES.iter().map(|t| t.name);
        let from = tables.filter_map(|t| token.find(&format!("/{t}/")).map(|i| i + 1)).min();
        match from {
            Some(i) => {
                let rel = &token[i..];
                // `file.parquet:0..1234`: the byte range of a partition's read.
                let rel = rel.rfind(':').filter(|&c| rel[c + 1..].contains("..")).map_or(rel, |c| &rel[..c]);
                rel.to_owned()
            }
            None => format!("{}<path>", &token[..start]),
        }
    })
}

/// `text` with each path-like token (a URL, or a run with two `/` or more) replaced by
/// `replace(token, where its path starts)`.
fn redact_paths_with(text: &str, replace: impl Fn(&str, usize) -> String) -> String {
    let delimiter = |c: char| c.is_whitespace() || "'\"`()[]{},;<>".contains(c);
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while !rest.is_empty() {
        let end = rest.find(delimiter).unwrap_or(rest.len());
        let (token, tail) = rest.split_at(end);
        let slashes = token.matches('/').count();
        match token.find("://").map(|i| token[..i].rfind(|c: char| !c.is_ascii_alphanumeric()).map_or(0, |j| j + 1)) {
            Some(start) => out.push_str(&replace(token, start)),
            None if slashes >= 2 => out.push_str(&replace(token, token.find('/').unwrap_or(0))),
            None => out.push_str(token),
        }
        let mut chars = tail.chars();
        if let Some(d) = chars.next() {
            out.push(d);
        }
        rest = chars.as_str();
    }
    out
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

fn busy_message(max: usize, waited: Duration, share: bool) -> String {
    let waited = humantime::format_duration(waited);
    if share {
        format!("server busy: you already run {max} queries, your share of the query slots (waited {waited})")
    } else {
        format!("server busy: all {max} query slots are in use (waited {waited})")
    }
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
        assert_eq!(QueryError::from_datafusion(cast, lim).code(), "invalid_cast");
        // The Parquet decoder wraps a failing pushed-down predicate: still the user's.
        let wrapped = DataFusionError::ParquetError(Box::new(datafusion::parquet::errors::ParquetError::External(
            Box::new(ArrowError::CastError("Cannot cast string 'team-b/secret' to value of Int32 type".into())),
        )));
        let e = QueryError::from_datafusion(wrapped, lim);
        assert_eq!((e.status(), e.code()), (400, "invalid_cast"));
        let opaque = e.opaque("e-1");
        assert!(!opaque.to_json().to_string().contains("secret"), "{}", opaque.to_json());
        assert!(opaque.to_json().to_string().contains("e-1"));
        let div = DataFusionError::ArrowError(Box::new(ArrowError::DivideByZero), None);
        assert_eq!(QueryError::from_datafusion(div, lim).code(), "division_by_zero");
        let re = DataFusionError::Execution("Regular expression did not compile: x".into());
        assert_eq!(QueryError::from_datafusion(re, lim).code(), "invalid_regex");
        let io = DataFusionError::IoError(std::io::Error::other("disk"));
        assert_eq!(QueryError::from_datafusion(io, lim).status(), 500);
        // An internal error quoting the physical plan: logged, never sent.
        let plan = DataFusionError::Internal(
            "ProjectionExec: expr=[gpu_uuid@0] FilterExec: gpu_uuid@0 = GPU-hidden-team-b".into(),
        );
        let e = QueryError::from_datafusion(plan, lim);
        let json = e.to_json().to_string();
        assert_eq!((e.status(), e.code()), (500, "internal"));
        assert!(!json.contains("GPU-hidden") && !json.contains("Exec") && json.contains("error id"), "{json}");
        let id = e.detail();
        assert_eq!(e.opaque("other").detail(), id, "the first id stays");
        let v = QueryError::Invalid { code: "invalid_cast", detail: "Cannot cast 'secret'".into() };
        assert!(!v.value_free_message().contains("secret"), "{}", v.value_free_message());
        let t = QueryError::Timeout { timeout: Duration::from_secs(3) };
        assert_eq!(t.value_free_message(), "query timed out after 3s");
        // A file replaced under a running query: retried by the engine.
        let gone = DataFusionError::ObjectStore(Box::new(datafusion::object_store::Error::NotFound {
            path: "/srv/data/x.parquet".into(),
            source: "gone".into(),
        }));
        let e = QueryError::from_datafusion(DataFusionError::Context("reading".into(), Box::new(gone)), lim);
        assert!(e.is_vanished_file(), "{e:?}");
        assert!(!e.to_string().contains("/srv"), "{e}");
        let json = QueryError::ReadOnly { what: "INSERT".into() }.to_json();
        assert_eq!(json["error"], "read-only: INSERT is not allowed");
        assert!(json["detail"].as_str().is_some_and(|d| d.contains("queries only")));
        assert_eq!(QueryError::Timeout { timeout: Duration::from_millis(1500) }.status(), 504);
        assert_eq!(QueryError::Busy { max_concurrent: 1, waited: Duration::ZERO, share: false }.status(), 503);
        assert_eq!(QueryError::TooManyRows { max: 1 }.status(), 413);
    }

    #[test]
    fn paths_never_leave_the_server() {
        let t = "table 'datafusion.public./srv/apron/data/gpu_samples/date=2026-12-01/x.parquet' not found";
        assert_eq!(redact_paths(t), "table 'datafusion.public.<path>' not found");
        assert_eq!(redact_paths("reading s3://bucket/prefix/a.parquet: denied"), "reading <path> denied");
        assert_eq!(redact_paths("Object at location /tmp/x/y not found"), "Object at location <path> not found");
        // SQL terms keep their slashes when they are not paths.
        assert_eq!(redact_paths("a / b and 10/3"), "a / b and 10/3");
        let plan = "file_groups={1 group: [[tmp/.tmpX/data/gpu_samples/date=2026-11-19/0001.parquet:0..4711, \
                    tmp/.tmpX/data/gpu_samples/date=2026-11-19/0002.parquet]]}, file_type=parquet";
        assert_eq!(
            redact_plan_paths(plan),
            "file_groups={1 group: [[gpu_samples/date=2026-11-19/0001.parquet, \
             gpu_samples/date=2026-11-19/0002.parquet]]}, file_type=parquet"
        );
        assert_eq!(redact_plan_paths("ObjectStoreUrl s3://bucket/lake/x"), "ObjectStoreUrl <path>");
    }

    #[test]
    fn bytes() {
        assert_eq!(human_bytes(100), "100 bytes");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(1 << 30), "1 GiB");
    }
}
