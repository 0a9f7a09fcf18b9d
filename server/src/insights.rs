//! `GET /api/v1/alerts` and `GET /api/v1/recommendations`: the evaluators' answers over
//! HTTP, behind the same tokens as the SQL API; a `team:<name>` token sees its team's
//! items only.

use std::sync::Arc;

use apron_collector::http::json_error;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use crate::alerts::{Alerts, api_alert};
use crate::cluster::FleetAlerts;
use crate::recommend::{ON_DEMAND_RETRY_AFTER_S, OnDemandError, Recommender};

/// Where `GET /api/v1/alerts` reads episodes from.
#[derive(Clone, Default)]
pub enum AlertSource {
    /// Alerts are off.
    #[default]
    Off,
    /// This server's evaluator.
    Local(Arc<Alerts>),
    /// A query server: every shard's episodes, with the lake to tell stale shards.
    Fleet(Arc<FleetAlerts>, Arc<apron_query::LakeSource>),
}

#[derive(Clone)]
struct InsightState {
    alerts: AlertSource,
    recommender: Option<Arc<Recommender>>,
    auth: crate::access::Access,
}

/// The routes, merged into the server's app.
pub fn router(alerts: AlertSource, recommender: Option<Arc<Recommender>>, auth: crate::access::Access) -> axum::Router {
    axum::Router::new()
        .route("/api/v1/alerts", get(list_alerts))
        .route("/api/v1/recommendations", get(recommendations))
        .with_state(InsightState { alerts, recommender, auth })
}

#[derive(serde::Deserialize)]
struct AlertQuery {
    state: Option<String>,
}

async fn list_alerts(State(s): State<InsightState>, headers: HeaderMap, Query(q): Query<AlertQuery>) -> Response {
    let scope = match s.auth.read_scope(&headers) {
        Ok(scope) => scope,
        Err(answer) => return *answer,
    };
    if matches!(s.alerts, AlertSource::Off) {
        return json_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "alerts_disabled",
            "alerts are off on this server: they need [cost] enabled and [alerts] enabled",
        );
    }
    let want = match q.state.as_deref() {
        None | Some("all") => None,
        Some("firing") => Some(apron_cost::alert::AlertState::Firing),
        Some("resolved") => Some(apron_cost::alert::AlertState::Resolved),
        Some(other) => {
            return json_error(
                StatusCode::BAD_REQUEST,
                "invalid_state",
                &format!("state={other}: use firing, resolved or all"),
            );
        }
    };
    let keep = |a: &apron_cost::alert::AlertRecord| {
        want.is_none_or(|w| a.state == w) && crate::access::visible(&scope, &a.team)
    };
    let body = match s.alerts {
        AlertSource::Off => serde_json::json!({ "alerts": [] }),
        AlertSource::Local(alerts) => {
            let list: Vec<serde_json::Value> = alerts.list().iter().filter(|a| keep(a)).map(api_alert).collect();
            serde_json::json!({ "alerts": list })
        }
        AlertSource::Fleet(fleet, lake) => {
            let list: Vec<serde_json::Value> = fleet
                .list()
                .iter()
                .filter(|(_, a)| keep(a))
                .map(|(shard, a)| {
                    let mut v = api_alert(a);
                    v["shard"] = serde_json::Value::from(shard.as_str());
                    v
                })
                .collect();
            let stale = tokio::task::spawn_blocking(move || lake.stale_shards()).await.unwrap_or_default();
            serde_json::json!({ "alerts": list, "stale_shards": stale })
        }
    };
    axum::Json(body).into_response()
}

#[derive(serde::Deserialize)]
struct RecommendQuery {
    window: Option<String>,
}

async fn recommendations(
    State(s): State<InsightState>,
    headers: HeaderMap,
    Query(q): Query<RecommendQuery>,
) -> Response {
    let scope = match s.auth.read_scope(&headers) {
        Ok(scope) => scope,
        Err(answer) => return *answer,
    };
    let Some(rec) = s.recommender else {
        return json_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "recommendations_disabled",
            "recommendations are off on this server: they need [cost] enabled and [recommend] enabled",
        );
    };
    let window = match q.window.as_deref() {
        None => rec.settings().window,
        Some(w) => match humantime::parse_duration(w) {
            Ok(d) if d >= std::time::Duration::from_secs(60) && d <= std::time::Duration::from_secs(400 * 86_400) => d,
            Ok(_) => {
                return json_error(StatusCode::BAD_REQUEST, "invalid_window", "window must be between 1m and 400d");
            }
            Err(e) => {
                return json_error(
                    StatusCode::BAD_REQUEST,
                    "invalid_window",
                    &format!("window={w}: {e} (use a duration such as 1h, 24h or 7d)"),
                );
            }
        },
    };
    match rec.on_demand(window).await {
        Ok(set) => {
            let mut set = (*set).clone();
            set.retain(|r| crate::access::visible(&scope, &r.team));
            axum::Json(set).into_response()
        }
        Err(e @ OnDemandError::Busy { .. }) => {
            let mut r = json_error(StatusCode::SERVICE_UNAVAILABLE, "busy", &e.to_string());
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(ON_DEMAND_RETRY_AFTER_S));
            r
        }
        // The run's SQL is fleet-wide (other teams' GPUs and owners): logged, not sent.
        Err(OnDemandError::Failed(e)) => {
            crate::access::internal_error("the recommendation run", "recommendations_failed", &e, e.query_error())
        }
    }
}
