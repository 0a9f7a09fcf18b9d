//! The ledger's `/metrics` families: totals of the stored `gpu_cost_hourly`.

use std::sync::Arc;

use datafusion::arrow::array::{Array, AsArray};
use datafusion::arrow::datatypes::Float64Type;

use super::{Ledger, LedgerError};

/// Totals of the stored `gpu_cost_hourly`, refreshed after every ledger pass, for the
/// server's `/metrics`: `apron_idle_cost_dollars_total{team,kind}` and
/// `apron_gpu_seconds_total{team,state}`. They are sums over the rows the store holds
/// (derived retention, 400 d by default), so a recomputation or retention can lower
/// them; `rate()` over them is still right between such events.
#[derive(Debug, Default, Clone)]
pub struct CostMetrics {
    inner: Arc<std::sync::Mutex<Totals>>,
}

#[derive(Debug, Default)]
struct Totals {
    /// (team, kind) → dollars.
    idle: Vec<(String, &'static str, f64)>,
    /// (team, state) → seconds.
    seconds: Vec<(String, &'static str, f64)>,
}

const STATES: [&str; 7] =
    ["active", "allocated_idle", "stranded", "unallocated_idle", "unallocated_busy", "unknown", "underused"];

impl CostMetrics {
    fn set(&self, totals: Totals) {
        *self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = totals;
    }
}

impl prometheus_client::collector::Collector for CostMetrics {
    fn encode(&self, mut enc: prometheus_client::encoding::DescriptorEncoder) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::MetricType;
        use prometheus_client::metrics::counter::ConstCounter;
        let t = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut d = enc.encode_descriptor(
            "apron_idle_cost_dollars",
            "Idle cost in US dollars by team and kind (allocated_idle, stranded, unallocated_idle), summed over the stored gpu_cost_hourly rows.",
            None,
            MetricType::Counter,
        )?;
        for (team, kind, v) in &t.idle {
            let labels = vec![("team".to_owned(), team.clone()), ("kind".to_owned(), (*kind).to_owned())];
            ConstCounter::new(*v).encode(d.encode_family(&labels)?)?;
        }
        let mut d = enc.encode_descriptor(
            "apron_gpu",
            "GPU time by team and state (exclusive states; underused is a part of active), summed over the stored gpu_cost_hourly rows.",
            Some(&prometheus_client::registry::Unit::Seconds),
            MetricType::Counter,
        )?;
        for (team, state, v) in &t.seconds {
            let labels = vec![("team".to_owned(), team.clone()), ("state".to_owned(), (*state).to_owned())];
            ConstCounter::new(*v).encode(d.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

impl Ledger {
    /// Refreshes `metrics` from the stored `gpu_cost_hourly`.
    pub async fn refresh_metrics(&self, metrics: &CostMetrics) -> Result<(), LedgerError> {
        let cols = STATES.map(|s| format!("CAST(sum({s}_s) AS DOUBLE)")).join(", ");
        let sql = format!(
            // The difference in exact decimals, then one conversion to a float.
            "SELECT team, {cols}, CAST(sum(coalesce(idle_cost_usd, 0)) AS DOUBLE), \
             CAST(sum(coalesce(stranded_cost_usd, 0)) AS DOUBLE), \
             CAST(sum(coalesce(idle_cost_usd, 0) - coalesce(stranded_cost_usd, 0)) AS DOUBLE) \
             FROM gpu_cost_hourly GROUP BY team ORDER BY team"
        );
        let mut totals = Totals::default();
        for b in self.query(&sql).await? {
            let team = b.column(0).as_string::<i32>();
            let f = |i: usize, r: usize| {
                let c = b.column(i).as_primitive::<Float64Type>();
                if c.is_null(r) { 0.0 } else { c.value(r) }
            };
            for r in 0..b.num_rows() {
                let name = team.value(r).to_owned();
                for (i, state) in STATES.iter().enumerate() {
                    totals.seconds.push((name.clone(), state, f(1 + i, r)));
                }
                let (idle, stranded, allocated_idle) = (f(8, r), f(9, r), f(10, r));
                // A row is either the `unallocated` team's (all its idle is unallocated
                // idle) or a holder's team (allocated idle + stranded).
                if name == apron_cost::UNALLOCATED {
                    totals.idle.push((name, "unallocated_idle", idle));
                } else {
                    totals.idle.push((name.clone(), "stranded", stranded));
                    totals.idle.push((name, "allocated_idle", allocated_idle));
                }
            }
        }
        metrics.set(totals);
        Ok(())
    }
}
