//! The agent's HTTP surface: `GET /metrics` (OpenMetrics) and `GET /healthz`.
//!
//! Served through `apron_http::serve` (header-read timeout, graceful shutdown), over
//! TLS when `[agent.tls]` or a web config asks for it; a web config's basic-auth users
//! and response headers apply to every path (`docs/tls.md`).

use std::future::Future;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::registry::Registry;

use apron_http::serve::ServeOptions;

use crate::config::HttpConfig;
use crate::exposition::{self, SharedState};

#[derive(Clone)]
struct App {
    registry: Arc<Registry>,
    state: SharedState,
}

/// Serves until `shutdown` resolves. The listener is bound by the caller (port 0 works).
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: SharedState,
    http: &HttpConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = App { registry: Arc::new(exposition::registry(state.clone())), state };
    let router = axum::Router::new().route("/metrics", get(metrics)).route("/healthz", get(healthz)).with_state(app);
    let router = match &http.web_config {
        Some(web) => {
            for note in web.notes() {
                tracing::info!(web_config = %web.path().display(), "{note}");
            }
            if let Some(auth) = web.basic_auth() {
                tracing::info!(users = auth.users().len(), "basic authentication required for every path");
            }
            web.apply(router)
        }
        None => router,
    };
    let options = ServeOptions::default().with_tls(http.tls.clone());
    apron_http::serve::serve(listener, router, options, shutdown).await
}

async fn metrics(State(app): State<App>, headers: HeaderMap) -> Response {
    apron_http::metrics::respond(&app.registry, &headers)
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
