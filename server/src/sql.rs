//! `POST /api/v1/sql`: read-only SQL over the stored tables.
//!
//! The body is the SQL text; `Accept` picks the format (JSON by default, CSV, Arrow IPC
//! stream, Parquet; 406 when nothing acceptable is listed). The query layer
//! (`apron-query`) enforces read-only on the plan and the limits; this module only
//! authenticates, negotiates and maps `QueryError` to its status in the contract's
//! `{"error", "detail"}` shape.

use std::sync::Arc;

use apron_collector::http::{constant_time_eq, json_error};
use apron_query::{Format, QueryEngine, QueryError};
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;

/// Who may run SQL.
#[derive(Clone, Debug)]
pub enum SqlAuth {
    /// `apron up`: single user on loopback, no token.
    Loopback,
    /// `apron serve`: a bearer token from `[sql] tokens`. With none configured every
    /// request is refused: secure by default.
    Tokens(Arc<[Box<[u8]>]>),
}

#[derive(Clone)]
struct SqlState {
    engine: Arc<QueryEngine>,
    auth: SqlAuth,
}

/// The SQL routes, merged into the server's app.
pub fn router(engine: Arc<QueryEngine>, auth: SqlAuth) -> Router {
    Router::new().route("/api/v1/sql", post(sql)).with_state(SqlState { engine, auth })
}

/// `Err` carries why, for the 401's detail.
pub(crate) fn authorize(headers: &HeaderMap, auth: &SqlAuth) -> Result<(), &'static str> {
    let SqlAuth::Tokens(tokens) = auth else { return Ok(()) };
    if tokens.is_empty() {
        return Err("no SQL token is configured on this server: set [sql] tokens or APRON_SQL_TOKEN");
    }
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
        .ok_or("send Authorization: Bearer <SQL token>")?;
    let mut matched = false;
    for t in tokens.iter() {
        matched |= constant_time_eq(presented, t);
    }
    if matched { Ok(()) } else { Err("the SQL token is not valid") }
}

async fn sql(State(state): State<SqlState>, headers: HeaderMap, body: Bytes) -> Response {
    if let Err(detail) = authorize(&headers, &state.auth) {
        let mut r = json_error(StatusCode::UNAUTHORIZED, "unauthorized", detail);
        r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        return r;
    }
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
    match state.engine.execute(text).await {
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
