//! The agent's HTTP surface: `GET /metrics` (OpenMetrics) and `GET /healthz`.

use std::future::Future;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::registry::Registry;

use crate::exposition::{self, Format, SharedState};

#[derive(Clone)]
struct App {
    registry: Arc<Registry>,
    state: SharedState,
}

/// Serves until `shutdown` resolves. The listener is bound by the caller (port 0 works).
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: SharedState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = App { registry: Arc::new(exposition::registry(state.clone())), state };
    let router = axum::Router::new().route("/metrics", get(metrics)).route("/healthz", get(healthz)).with_state(app);
    axum::serve(listener, router).with_graceful_shutdown(shutdown).await
}

async fn metrics(State(app): State<App>, headers: HeaderMap) -> Response {
    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
    let format = Format::negotiate(accept);
    match exposition::render(&app.registry, format) {
        Ok(body) => ([(header::CONTENT_TYPE, format.content_type())], body).into_response(),
        Err(_) => error(StatusCode::INTERNAL_SERVER_ERROR, "encoding metrics failed", ""),
    }
}

async fn healthz(State(app): State<App>) -> Response {
    let st = app.state.lock();
    let lost = st.gpus.iter().filter(|(_, s)| s.lost).count();
    let body = serde_json::json!({
        "status": "ok",
        "source": st.source,
        "gpus": st.gpus.len(),
        "lost_gpus": lost,
        "windows": st.windows_total,
    });
    drop(st);
    (StatusCode::OK, axum::Json(body)).into_response()
}

/// The contract's error shape: `{"error": "...", "detail": "..."}`.
fn error(status: StatusCode, error: &str, detail: &str) -> Response {
    (status, axum::Json(serde_json::json!({ "error": error, "detail": detail }))).into_response()
}
