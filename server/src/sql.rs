//! `POST /api/v1/sql`: read-only SQL over the stored tables.
//!
//! The body is the SQL text; `Accept` picks the format (JSON by default, CSV, Arrow IPC
//! stream, Parquet; 406 when nothing acceptable is listed). The query layer
//! (`apron-query`) enforces read-only, the caller's row scope (a `team:<name>` token
//! reads its team's rows only) and the limits on the plan; this module only
//! authenticates, negotiates and maps `QueryError` to its status in the contract's
//! `{"error", "detail"}` shape.

use std::sync::Arc;

use apron_collector::http::json_error;

use crate::access::Access;
use apron_query::{Format, QueryEngine, QueryError};
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;

#[derive(Clone)]
struct SqlState {
    engine: Arc<QueryEngine>,
    access: Access,
}

/// The SQL routes, merged into the server's app.
pub fn router(engine: Arc<QueryEngine>, access: Access, max_sql_bytes: usize) -> Router {
    Router::new()
        .route("/api/v1/sql", post(sql).layer(axum::extract::DefaultBodyLimit::max(max_sql_bytes)))
        .with_state(SqlState { engine, access })
}

async fn sql(
    State(state): State<SqlState>,
    headers: HeaderMap,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Response {
    let scope = match state.access.read_scope(&headers) {
        Ok(scope) => scope,
        Err(answer) => return *answer,
    };
    let body = match body {
        Ok(b) => b,
        Err(rejection) if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            return json_error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
                "the SQL text is larger than the server's limit (sql.max_body_bytes)",
            );
        }
        Err(rejection) => return json_error(StatusCode::BAD_REQUEST, "invalid_body", &rejection.body_text()),
    };
    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
    let Some(format) = Format::from_accept(accept) else {
        return json_error(
            StatusCode::NOT_ACCEPTABLE,
            "not_acceptable",
            "Accept one of application/json, text/csv, application/vnd.apache.arrow.stream, application/vnd.apache.parquet",
        );
    };
    let Ok(text) = std::str::from_utf8(&body) else {
        return json_error(StatusCode::BAD_REQUEST, "invalid_body", "the body must be the SQL text in UTF-8");
    };
    if text.trim().is_empty() {
        return json_error(StatusCode::BAD_REQUEST, "empty_query", "the body is empty: send the SQL text");
    }
    match state.engine.execute_as(text, &scope).await {
        Ok(result) => {
            // Rendering a large Parquet result is CPU work: keep it off the I/O threads.
            let rendered = tokio::task::spawn_blocking(move || result.render(format)).await;
            match rendered {
                Ok(Ok(bytes)) => ([(header::CONTENT_TYPE, format.content_type())], bytes).into_response(),
                Ok(Err(e)) => json_error(StatusCode::INTERNAL_SERVER_ERROR, "render_failed", &e.to_string()),
                Err(e) => json_error(StatusCode::INTERNAL_SERVER_ERROR, "render_failed", &e.to_string()),
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
