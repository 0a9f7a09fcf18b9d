//! `GET /metrics` for every listener: content negotiation and encoding of a
//! `prometheus-client` registry.
//!
//! Like Prometheus' exporters: OpenMetrics 1.0 for scrapers that ask for it (Prometheus
//! does, first), Prometheus text 0.0.4 otherwise (curl, `promtool check metrics`).

use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use prometheus_client::registry::Registry;

use crate::serve::json_error;

/// An exposition format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// OpenMetrics 1.0 text, what Prometheus asks for first.
    OpenMetrics,
    /// Prometheus text 0.0.4, for clients that do not ask for OpenMetrics.
    PrometheusText,
}

impl Format {
    /// Content negotiation on the `Accept` header.
    pub fn negotiate(accept: Option<&str>) -> Self {
        match accept {
            Some(a) if a.contains("application/openmetrics-text") => Format::OpenMetrics,
            _ => Format::PrometheusText,
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
            Format::PrometheusText => "text/plain; version=0.0.4; charset=utf-8",
        }
    }
}

/// Renders the registry in `format`.
pub fn render(registry: &Registry, format: Format) -> Result<String, std::fmt::Error> {
    let mut out = String::with_capacity(64 * 1024);
    match format {
        Format::OpenMetrics => prometheus_client::encoding::text::encode(&mut out, registry)?,
        Format::PrometheusText => prometheus_client::encoding::prometheus_text::encode(&mut out, registry)?,
    }
    Ok(out)
}

/// The `GET /metrics` answer for a request with `headers`: the registry in the format
/// the request accepts, or a 500 in the contract's error shape if encoding fails.
pub fn respond(registry: &Registry, headers: &HeaderMap) -> Response {
    let format = Format::negotiate(headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()));
    match render(registry, format) {
        Ok(body) => ([(header::CONTENT_TYPE, format.content_type())], body).into_response(),
        Err(_) => json_error(StatusCode::INTERNAL_SERVER_ERROR, "internal", "encoding the metrics failed"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openmetrics_only_when_asked() {
        assert_eq!(
            Format::negotiate(Some("application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5")),
            Format::OpenMetrics
        );
        assert_eq!(Format::negotiate(Some("text/plain")), Format::PrometheusText);
        assert_eq!(Format::negotiate(None), Format::PrometheusText);
        let mut registry = Registry::default();
        let c = prometheus_client::metrics::counter::Counter::<u64>::default();
        registry.register("apron_test", "A test counter.", c.clone());
        c.inc();
        let om = render(&registry, Format::OpenMetrics).expect("encodes");
        assert!(om.contains("apron_test_total 1") && om.ends_with("# EOF\n"), "{om}");
        let text = render(&registry, Format::PrometheusText).expect("encodes");
        assert!(text.contains("apron_test_total 1") && !text.contains("# EOF"), "{text}");
    }
}
