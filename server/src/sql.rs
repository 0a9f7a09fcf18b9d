//! `POST /api/v1/sql`: read-only SQL over the stored tables.
//!
//! The body is the SQL text; `Accept` picks the format (JSON by default, CSV, Arrow IPC
//! stream, Parquet; 406 when nothing acceptable is listed). The query layer
//! (`apron-query`) enforces read-only, the caller's row scope (a `team:<name>` token
//! reads its team's rows only) and the limits on the plan; this module only
//! authenticates, negotiates and maps `QueryError` to its status in the contract's
//! `{"error", "detail"}` shape.
//!
//! The body is the SQL text (any content type but JSON), or with `Content-Type:
//! application/json` an object `{"sql": "<query>"}` (docs/sql.md).
//!
//! Everything that can be decided from the request head is decided before the body is
//! read: the bearer token (401/403), `Accept` (406) and a declared `Content-Length` over
//! `[sql] max_body_bytes` (413). The body is then read up to that limit (413 beyond),
//! within the server's body timeouts (408).

use std::sync::Arc;

use apron_collector::http::json_error;

use crate::access::Access;
use apron_query::{Format, QueryEngine, QueryError};
use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use futures::StreamExt;

#[derive(Clone)]
struct SqlState {
    engine: Arc<QueryEngine>,
    access: Access,
    max_sql_bytes: usize,
}

/// The SQL routes, merged into the server's app. On a query server of a cluster, every
/// answer names the shards whose collectors have not written their status for
/// `[cluster] stale_after`: a JSON answer in a `stale_shards` member, every format in
/// the `Apron-Stale-Shards` header (only when there are any).
pub fn router(engine: Arc<QueryEngine>, access: Access, max_sql_bytes: usize) -> Router {
    Router::new().route("/api/v1/sql", post(sql)).with_state(SqlState { engine, access, max_sql_bytes })
}

/// The header that names stale shards on a query server's answers.
pub const STALE_SHARDS_HEADER: &str = "apron-stale-shards";

/// Names the engine that computed an answer when it was not this process:
/// `Apron-Engine: ballista` ([`apron_query::distributed`]).
pub const ENGINE_HEADER: &str = "apron-engine";

/// The answer to a body over `sql.max_body_bytes` (HTTP and, in spirit, the pg port).
fn too_large() -> Response {
    json_error(
        StatusCode::PAYLOAD_TOO_LARGE,
        "body_too_large",
        "the SQL text is larger than the server's limit (sql.max_body_bytes)",
    )
}

/// Reads the SQL text, at most `max` bytes. Called only once the caller is known: an
/// unauthenticated client never makes the server read (or buffer, or wait for) a body.
async fn read_body(headers: &HeaderMap, body: axum::body::Body, max: usize) -> Result<Vec<u8>, Response> {
    // A declared length over the limit is refused before a byte of it is read.
    let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return Err(too_large());
    }
    let mut text = Vec::with_capacity(declared.map_or(0, |n| n as usize));
    let mut chunks = body.into_data_stream();
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk.map_err(|e| body_error(&e))?;
        if text.len() + chunk.len() > max {
            return Err(too_large());
        }
        text.extend_from_slice(&chunk);
    }
    Ok(text)
}

/// A body that could not be read: 408 when a body timeout cut it off (the connection
/// closes after the answer), else 400.
fn body_error(e: &axum::Error) -> Response {
    let mut chain = std::iter::successors(Some(e as &(dyn std::error::Error + 'static)), |e| e.source());
    let timeout = chain.find_map(|e| {
        if let Some(d) = e.downcast_ref::<apron_http::serve::BodyDeadlineExceeded>() {
            Some(format!("{d} (server.body_total_timeout)"))
        } else if e.is::<tower_http::timeout::TimeoutError>() {
            Some("the request body stalled longer than the server allows (server.body_read_timeout)".to_owned())
        } else {
            None
        }
    });
    match timeout {
        Some(detail) => json_error(StatusCode::REQUEST_TIMEOUT, "body_timeout", &detail),
        None => json_error(StatusCode::BAD_REQUEST, "invalid_body", &format!("the body could not be read: {e}")),
    }
}

async fn sql(State(state): State<SqlState>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let headers = &parts.headers;
    // The token first, from the head alone: a client without one costs no body read.
    let scope = match state.access.read_scope(headers) {
        Ok(scope) => scope,
        Err(answer) => return *answer,
    };
    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
    let Some(format) = Format::from_accept(accept) else {
        return json_error(
            StatusCode::NOT_ACCEPTABLE,
            "not_acceptable",
            &format!("Accept one of {}", apron_query::render::accepted_media_types()),
        );
    };
    let body = match read_body(headers, body, state.max_sql_bytes).await {
        Ok(b) => b,
        Err(answer) => return answer,
    };
    let Ok(text) = std::str::from_utf8(&body) else {
        return json_error(StatusCode::BAD_REQUEST, "invalid_body", "the body must be the SQL text in UTF-8");
    };
    // `Content-Type: application/json`: `{"sql": "…"}`; anything else is the SQL text.
    let json_body = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| t.split(';').next().is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json")));
    let owned;
    let text = if json_body {
        #[derive(serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        struct SqlRequest {
            sql: String,
        }
        match serde_json::from_str::<SqlRequest>(text) {
            Ok(r) => {
                owned = r.sql;
                owned.as_str()
            }
            Err(e) => {
                return json_error(
                    StatusCode::BAD_REQUEST,
                    "invalid_body",
                    &format!("a JSON body must be {{\"sql\": \"<query>\"}}: {e}"),
                );
            }
        }
    } else {
        text
    };
    if text.trim().is_empty() {
        return json_error(StatusCode::BAD_REQUEST, "empty_query", "the body is empty: send the SQL text");
    }
    // Read before the query: what it says holds for the data the query then reads.
    let stale = state.engine.stale_shards().await;
    match state.engine.execute_as(text, &scope).await {
        Ok(result) => {
            // Rendered off the I/O threads, bounded in number and size like the query.
            let distributed = result.distributed;
            let members = match format {
                Format::Json if !stale.is_empty() => vec![("stale_shards", serde_json::json!(stale))],
                _ => Vec::new(),
            };
            match state.engine.render(result, format, members).await {
                Ok(bytes) => {
                    let mut r = ([(header::CONTENT_TYPE, format.content_type())], bytes).into_response();
                    if !stale.is_empty()
                        && let Ok(v) = HeaderValue::from_str(&stale.join(","))
                    {
                        r.headers_mut().insert(STALE_SHARDS_HEADER, v);
                    }
                    if distributed {
                        r.headers_mut().insert(ENGINE_HEADER, HeaderValue::from_static("ballista"));
                    }
                    r
                }
                Err(e) => query_error(&e),
            }
        }
        Err(e) => query_error(&e),
    }
}

/// The one mapping from a query error to an HTTP answer.
fn query_error(e: &QueryError) -> Response {
    let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut r = (status, axum::Json(e.to_json())).into_response();
    if status == StatusCode::SERVICE_UNAVAILABLE {
        r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    r
}
