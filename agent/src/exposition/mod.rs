//! `/metrics`: the agent's state, encoded at scrape time with `prometheus-client`.
//!
//! The sampling side updates one [`AgentState`] as windows close; a [`MetricsCollector`]
//! registered with the registry encodes that state on each scrape. Encoding from a
//! snapshot (instead of keeping long-lived metric handles) means a pod that leaves or a
//! GPU that is lost drops its series at once, with no stale label sets.
//!
//! Three kinds of family, per the metric contract (docs/metrics.md):
//! - dcgm-exporter-compatible gauges with dcgm-exporter's names, units and camelCase
//!   labels, so existing dashboards work unchanged;
//! - native `apron_gpu_*` families in base units with snake_case labels, including busy
//!   time as counters so `rate()` is exact at any scrape interval;
//! - `apron_agent_*` self-metrics.
//!
//! One file each: [`state`] (what is shown), `dcgm` and `native` (the GPU families and
//! their label sets) and `selfmetrics`. The format (OpenMetrics or Prometheus text, by
//! `Accept`) is `apron_http::metrics`', shared with the server.

use std::borrow::Cow;
use std::fmt::Write as _;

use apron_common::{Field, GpuWindow};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric as _};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

mod dcgm;
mod native;
mod selfmetrics;
pub mod state;

pub use native::native_gauges;
pub use state::{AgentState, GpuState, OwnerLabels, SamplerStats, SharedState, ShipStats, TableShipped};

type Labels = Vec<(Cow<'static, str>, String)>;
type Series = Vec<(Labels, f64)>;
fn push_owner(l: &mut Labels, owner: &OwnerLabels) {
    for (k, v) in [("pod", &owner.pod), ("namespace", &owner.namespace), ("container", &owner.container)] {
        if let Some(v) = v {
            l.push((k.into(), v.clone()));
        }
    }
}

/// Encodes one family from `(labels, value)` pairs; nothing is written for an empty one.
fn family(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    ty: MetricType,
    series: &[(Labels, f64)],
) -> Result<(), std::fmt::Error> {
    if series.is_empty() {
        return Ok(());
    }
    let mut m = enc.encode_descriptor(name, help, None, ty)?;
    for (labels, v) in series {
        let fam = m.encode_family(labels)?;
        match ty {
            MetricType::Counter => prometheus_client::metrics::counter::ConstCounter::new(*v).encode(fam)?,
            _ => prometheus_client::metrics::gauge::ConstGauge::new(*v).encode(fam)?,
        }
    }
    Ok(())
}

/// Encodes [`AgentState`] on every scrape.
#[derive(Debug)]
pub struct MetricsCollector {
    state: SharedState,
}

impl MetricsCollector {
    pub fn new(state: SharedState) -> Self {
        Self { state }
    }
}

impl Collector for MetricsCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let st = self.state.lock();
        dcgm::encode(&mut enc, &st)?;
        native::encode(&mut enc, &st)?;
        selfmetrics::encode(&mut enc, &st)
    }
}

/// Builds the registry serving `state`.
pub fn registry(state: SharedState) -> Registry {
    let mut r = Registry::default();
    r.register_collector(Box::new(MetricsCollector::new(state)));
    r
}

/// A one-line summary of a window for logs.
pub fn describe(w: &GpuWindow) -> String {
    let mut s = format!("{} {}", w.time.to_rfc3339(), w.gpu.gpu_uuid);
    for f in [Field::GpuUtil, Field::SmActive, Field::PowerWatts] {
        if let Some(v) = w.value(f) {
            let _ = write!(s, " {}={v:.3}", f.column());
        }
    }
    s
}

#[cfg(test)]
mod tests;
