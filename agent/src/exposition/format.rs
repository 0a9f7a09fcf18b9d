//! The exposition formats and their negotiation.

use prometheus_client::registry::Registry;

/// An exposition format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// OpenMetrics 1.0 text, what Prometheus asks for first.
    OpenMetrics,
    /// Prometheus text 0.0.4, for clients that do not ask for OpenMetrics (curl,
    /// `promtool check metrics`).
    PrometheusText,
}

impl Format {
    /// Content negotiation on the `Accept` header, as Prometheus exporters do it.
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
