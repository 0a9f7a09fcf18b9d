//! `POST /v1/metrics`: OTLP/HTTP (protobuf) metrics into `gpu_samples` — e.g. a
//! dcgm-exporter scraped by an OpenTelemetry Collector's prometheus receiver and pushed
//! with its `otlphttp` exporter to `http://apron:9402` (the exporter appends
//! `/v1/metrics`). Authenticated with an ingest token, like agents.
//!
//! ```text
//!  ExportMetricsServiceRequest (protobuf, ≤ the ingest body limit)
//!    gauge and sum data points of dcgm-exporter metric names (DCGM_FI_*), their
//!    attributes and the resource's as labels (UUID, Hostname, modelName, pod, …)
//!    + the previous request's last point of each series (so a point at t stands for
//!      (t_prev, t] across requests: the brief's point-sample rule, as for import)
//!    ─► apron_import::Importer::add_point ─► windows
//!    ─► import::store_windows (agent data for the same GPU and time wins)
//!       as agent "otlp", one epoch per server start
//! ```
//!
//! Answers 200 with an empty `ExportMetricsServiceResponse`; 400 for a body that is not
//! the protobuf request; 401 without a valid token; 415 for OTLP/JSON (send protobuf).

use std::collections::HashMap;
use std::sync::Arc;

use apron_collector::Store;
use apron_collector::http::{IngestState, json_error};
use apron_common::UnixMicros;
use apron_import::{ImportOptions, Importer};
use apron_query::QueryEngine;
use axum::body::Bytes;
use axum::extract::{FromRequest, Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use opentelemetry_proto::tonic::collector::metrics::v1::{ExportMetricsServiceRequest, ExportMetricsServiceResponse};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use opentelemetry_proto::tonic::metrics::v1::{metric, number_data_point};
use prost::Message;
use tokio::sync::Mutex;

use crate::import::StoreImportError;

/// The agent id OTLP batches are stored under.
pub const OTLP_AGENT: &str = "otlp";

type Labels = Vec<(String, String)>;

/// One point: metric name, labels, time (µs), value.
type Point = (String, Labels, i64, f64);

/// The newest point of each series (metric name, labels).
type LastPoints = HashMap<(String, Labels), Point>;

#[derive(Clone)]
pub struct OtlpState {
    ingest: IngestState,
    engine: Arc<QueryEngine>,
    /// (name, labels) → the newest point received; one request at a time.
    last: Arc<Mutex<(LastPoints, u64)>>,
    epoch: String,
}

impl OtlpState {
    pub fn new(ingest: IngestState, engine: Arc<QueryEngine>) -> OtlpState {
        OtlpState { ingest, engine, last: Arc::default(), epoch: format!("otlp-{:x}", UnixMicros::now().0) }
    }

    fn store(&self) -> &Arc<Store> {
        self.ingest.store()
    }
}

/// The route, merged into the server's app.
pub fn router(state: OtlpState) -> axum::Router {
    axum::Router::new().route("/v1/metrics", axum::routing::post(export)).with_state(state)
}

fn text(v: &Option<AnyValue>) -> Option<String> {
    match v.as_ref()?.value.as_ref()? {
        any_value::Value::StringValue(s) => Some(s.clone()),
        any_value::Value::IntValue(i) => Some(i.to_string()),
        any_value::Value::DoubleValue(d) => Some(d.to_string()),
        any_value::Value::BoolValue(b) => Some(b.to_string()),
        _ => None,
    }
}

fn labels(resource: &[KeyValue], point: &[KeyValue]) -> Labels {
    let mut out: Labels = Vec::with_capacity(resource.len() + point.len());
    // Point attributes win over the resource's; the resource's host names fill in.
    for kv in point.iter().chain(resource) {
        if let Some(v) = text(&kv.value)
            && !out.iter().any(|(k, _)| *k == kv.key)
        {
            out.push((kv.key.clone(), v));
        }
    }
    if !out.iter().any(|(k, _)| k == "Hostname" || k == "hostname")
        && let Some((_, h)) = out.iter().find(|(k, _)| k == "host.name").cloned()
    {
        out.push(("Hostname".into(), h));
    }
    out.sort();
    out
}

/// dcgm-exporter's metric name from an OTLP one: OpenTelemetry instrument names are
/// case-insensitive and some SDKs send them lower-cased (`dcgm_fi_dev_gpu_util`).
fn dcgm_name(name: &str) -> String {
    if name.len() > 8 && name[..8].eq_ignore_ascii_case("dcgm_fi_") {
        let upper = name.to_ascii_uppercase();
        match upper.strip_suffix("_TOTAL") {
            Some(stem) => format!("{stem}_total"),
            None => upper,
        }
    } else {
        name.to_owned()
    }
}

/// The gauge and sum points of a request.
pub fn points(req: &ExportMetricsServiceRequest) -> Vec<Point> {
    let mut out = Vec::new();
    for rm in &req.resource_metrics {
        let resource = rm.resource.as_ref().map(|r| r.attributes.as_slice()).unwrap_or_default();
        for sm in &rm.scope_metrics {
            for m in &sm.metrics {
                let dps = match &m.data {
                    Some(metric::Data::Gauge(g)) => &g.data_points,
                    Some(metric::Data::Sum(s)) => &s.data_points,
                    _ => continue,
                };
                for p in dps {
                    let value = match p.value {
                        Some(number_data_point::Value::AsDouble(d)) => d,
                        Some(number_data_point::Value::AsInt(i)) => i as f64,
                        None => continue,
                    };
                    let t = i64::try_from(p.time_unix_nano / 1000).unwrap_or(i64::MAX);
                    out.push((dcgm_name(&m.name), labels(resource, &p.attributes), t, value));
                }
            }
        }
    }
    out
}

async fn export(State(s): State<OtlpState>, request: Request) -> Response {
    // Authenticated from the request head alone: a client without a token never makes
    // the server read (or wait for) a body.
    let headers = request.headers();
    if let Err((status, detail)) = s.ingest.authorize_ingest(headers) {
        return json_error(status, "unauthorized", detail);
    }
    let ct = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    if ct.starts_with("application/json") {
        return json_error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "OTLP/JSON is not accepted: send application/x-protobuf",
        );
    }
    // The same extractor (and default body limit) as before, only after the check.
    let body = match Bytes::from_request(request, &()).await {
        Ok(b) => b,
        Err(rejection) if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            return json_error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
                "the OTLP request exceeds the ingest body limit",
            );
        }
        Err(rejection) => return json_error(rejection.status(), "body_unreadable", &rejection.body_text()),
    };
    if body.len() > s.ingest.max_body_bytes() {
        return json_error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            "the OTLP request exceeds the ingest body limit",
        );
    }
    let req = match ExportMetricsServiceRequest::decode(body) {
        Ok(r) => r,
        Err(e) => {
            return json_error(StatusCode::BAD_REQUEST, "invalid_otlp", &format!("not an OTLP metrics request: {e}"));
        }
    };
    let points = points(&req);
    let n = points.len();
    match ingest(&s, points).await {
        Ok(stored) => {
            tracing::debug!(points = n, stored, "OTLP metrics");
            (
                [(header::CONTENT_TYPE, "application/x-protobuf")],
                ExportMetricsServiceResponse::default().encode_to_vec(),
            )
                .into_response()
        }
        Err(e) => json_error(StatusCode::SERVICE_UNAVAILABLE, "store_failed", &e.to_string()),
    }
}

/// Turns points into windows with the previous request's last points and stores them.
/// Returns the rows stored.
pub async fn ingest(s: &OtlpState, points: Vec<Point>) -> Result<usize, StoreImportError> {
    let mut guard = s.last.lock().await;
    let (last, sequence) = &mut *guard;
    let mut importer = Importer::new(ImportOptions::default())?;
    let relevant: Vec<&Point> = points.iter().filter(|p| apron_import::mapping(&p.0).is_some()).collect();
    let mut keys: Vec<(String, Labels)> = relevant.iter().map(|p| (p.0.clone(), p.1.clone())).collect();
    keys.sort();
    keys.dedup();
    for k in &keys {
        if let Some((name, l, t, v)) = last.get(k) {
            let l: Vec<(&str, &str)> = l.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
            importer.add_point(name, &l, UnixMicros(*t), *v);
        }
    }
    for (name, l, t, v) in &relevant {
        let lr: Vec<(&str, &str)> = l.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
        importer.add_point(name, &lr, UnixMicros(*t), *v);
        let key = (name.clone(), l.clone());
        if last.get(&key).is_none_or(|p| p.2 <= *t) {
            last.insert(key, ((*name).clone(), l.clone(), *t, *v));
        }
    }
    let outcome = importer.finish()?;
    if outcome.windows.is_empty() {
        return Ok(0);
    }
    *sequence += 1;
    let range = (outcome.first_us.map_or(0, |t| t.0), outcome.last_us.map_or(0, |t| t.0));
    let stored =
        crate::import::store_windows(s.store(), &s.engine, outcome.windows, range, OTLP_AGENT, &s.epoch, *sequence)
            .await?;
    Ok(stored.stored)
}

#[cfg(test)]
mod tests {
    #[test]
    fn lower_cased_dcgm_names_are_restored() {
        assert_eq!(super::dcgm_name("dcgm_fi_dev_gpu_util"), "DCGM_FI_DEV_GPU_UTIL");
        assert_eq!(super::dcgm_name("DCGM_FI_DEV_GPU_UTIL"), "DCGM_FI_DEV_GPU_UTIL");
        assert_eq!(
            super::dcgm_name("dcgm_fi_dev_total_energy_consumption_total"),
            "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION_total"
        );
        assert_eq!(super::dcgm_name("hw.gpu.utilization"), "hw.gpu.utilization");
    }
}
