//! The agent's own `apron_agent_*` families: samplers, unsupported calls, windows,
//! shipping, the Kubernetes API and the process.

use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType;

use super::{AgentState, Labels, SamplerStats, Series, ShipStats, TableShipped, family};
use crate::selfstats;

pub(super) fn encode(enc: &mut DescriptorEncoder, st: &AgentState) -> Result<(), std::fmt::Error> {
    let per_sampler = |get: fn(&SamplerStats) -> f64| -> Vec<(Labels, f64)> {
        st.samplers.iter().map(|(g, s)| (vec![("sampler".into(), g.name().to_owned())], get(s))).collect()
    };
    family(
        enc,
        "apron_agent_sampler_runs",
        "Sampler ticks run.",
        MetricType::Counter,
        &per_sampler(|s| s.runs as f64),
    )?;
    family(
        enc,
        "apron_agent_sampler_errors",
        "Sampler ticks that read nothing.",
        MetricType::Counter,
        &per_sampler(|s| s.errors as f64),
    )?;
    family(
        enc,
        "apron_agent_sampler_duration_seconds",
        "Time spent in a sampler, all ticks.",
        MetricType::Counter,
        &per_sampler(|s| s.duration_seconds_total),
    )?;
    family(
        enc,
        "apron_agent_sampler_last_duration_seconds",
        "Duration of the sampler's last tick.",
        MetricType::Gauge,
        &per_sampler(|s| s.last_duration_seconds),
    )?;
    family(
        enc,
        "apron_agent_sampler_up",
        "1 when the sampler's last tick read something.",
        MetricType::Gauge,
        &per_sampler(|s| if s.up { 1.0 } else { 0.0 }),
    )?;
    family(
        enc,
        "apron_agent_sampler_interval_seconds",
        "Configured sampler interval.",
        MetricType::Gauge,
        &per_sampler(|s| s.interval_seconds),
    )?;

    let unsupported: Vec<_> = st
        .unsupported
        .iter()
        .map(|(group, what, slot)| {
            let mut l: Labels = vec![("sampler".into(), group.name().to_owned()), ("call".into(), (*what).to_owned())];
            if let Some((g, _)) = slot.and_then(|s| st.gpus.get(s)) {
                l.push(("gpu_uuid".into(), g.gpu_uuid.to_string()));
            }
            (l, 1.0)
        })
        .collect();
    family(
        enc,
        "apron_agent_unsupported",
        "NVML calls the driver or device does not support; their fields stay NULL.",
        MetricType::Gauge,
        &unsupported,
    )?;
    family(
        enc,
        "apron_agent_windows",
        "GPU windows closed.",
        MetricType::Counter,
        &[(vec![], st.windows_total as f64)],
    )?;
    family(
        enc,
        "apron_agent_late_readings",
        "Readings that arrived after their window closed (dropped).",
        MetricType::Counter,
        &[(vec![], st.late_readings as f64)],
    )?;
    family(
        enc,
        "apron_agent_dropped_windows",
        "Windows a sink could not take (dropped).",
        MetricType::Counter,
        &[(vec![], st.dropped_windows as f64)],
    )?;
    if let Some(ship) = &st.ship {
        encode_ship(enc, ship)?;
    }
    #[cfg(feature = "kubernetes")]
    if let Some(k) = &st.kubernetes {
        encode_kubernetes(enc, k)?;
    }
    let me = selfstats::read();
    if let Some(cpu) = me.cpu_seconds {
        family(
            enc,
            "apron_agent_cpu_seconds",
            "CPU time used by the agent process.",
            MetricType::Counter,
            &[(vec![], cpu)],
        )?;
    }
    if let Some(rss) = me.resident_bytes {
        family(
            enc,
            "apron_agent_resident_memory_bytes",
            "Resident memory of the agent process.",
            MetricType::Gauge,
            &[(vec![], rss)],
        )?;
    }
    family(
        enc,
        "apron_agent_start_time_seconds",
        "Agent start, Unix seconds.",
        MetricType::Gauge,
        &[(vec![], st.start_time)],
    )?;
    let mut build: Labels =
        vec![("version".into(), env!("CARGO_PKG_VERSION").to_owned()), ("source".into(), st.source.to_owned())];
    if let Some(d) = &st.driver_version {
        build.push(("driver_version".into(), d.clone()));
    }
    family(
        enc,
        "apron_agent_build_info",
        "Agent version, GPU source and driver (always 1).",
        MetricType::Gauge,
        &[(build, 1.0)],
    )
}

fn encode_ship(enc: &mut DescriptorEncoder, s: &ShipStats) -> Result<(), std::fmt::Error> {
    let one = |v: f64| -> Series { vec![(vec![], v)] };
    let per_table = |get: fn(&TableShipped) -> u64| -> Series {
        ["gpu_samples", "gpu_processes"]
            .iter()
            .map(|t| {
                let v = s.sent.get(t).map_or(0, get);
                (vec![("table".into(), (*t).to_owned())], v as f64)
            })
            .collect()
    };
    let counters: [(&str, &str, Series); 9] = [
        ("apron_agent_ship_batches", "Batches the collector acknowledged.", per_table(|t| t.batches)),
        ("apron_agent_ship_rows", "Rows in acknowledged batches.", per_table(|t| t.rows)),
        (
            "apron_agent_ship_duplicate_batches",
            "Acknowledged batches the collector already had (a retried request).",
            one(s.duplicates as f64),
        ),
        ("apron_agent_ship_retries", "Requests that failed and are retried.", one(s.retries as f64)),
        (
            "apron_agent_ship_rejected_batches",
            "Batches the collector refused for good (400, 413, 422), kept in the spool's rejected/ directory.",
            one(s.rejected_batches as f64),
        ),
        ("apron_agent_ship_spooled_batches", "Batches written to the on-disk spool.", one(s.spooled_batches as f64)),
        (
            "apron_agent_spool_dropped_batches",
            "Batches dropped, oldest first, because the spool was full (or could not be written).",
            one(s.spool_dropped_batches as f64),
        ),
        ("apron_agent_spool_dropped_rows", "Rows in dropped batches.", one(s.spool_dropped_rows as f64)),
        (
            "apron_agent_ship_ack_duration_seconds",
            "Seconds from request to acknowledgement, summed over acknowledged batches.",
            one(s.ack_seconds),
        ),
    ];
    for (name, help, series) in &counters {
        family(enc, name, help, MetricType::Counter, series)?;
    }
    family(
        enc,
        "apron_agent_spool_bytes",
        "Bytes in the on-disk spool.",
        MetricType::Gauge,
        &one(s.spool_bytes as f64),
    )?;
    family(
        enc,
        "apron_agent_spool_files",
        "Batches in the on-disk spool.",
        MetricType::Gauge,
        &one(s.spool_files as f64),
    )?;
    if let Some(up) = s.collector_up {
        family(
            enc,
            "apron_agent_ship_collector_up",
            "1 when the collector took the last request (acknowledged or refused for good), 0 while requests fail and are retried.",
            MetricType::Gauge,
            &one(if up { 1.0 } else { 0.0 }),
        )?;
    }
    if let Some(t) = s.last_success_time {
        family(
            enc,
            "apron_agent_ship_last_success_time_seconds",
            "When the collector last acknowledged a batch, Unix seconds.",
            MetricType::Gauge,
            &one(t),
        )?;
    }
    Ok(())
}

#[cfg(feature = "kubernetes")]
fn encode_kubernetes(
    enc: &mut DescriptorEncoder,
    k: &crate::attribution::kube::KubeStats,
) -> Result<(), std::fmt::Error> {
    let requests: Series =
        ["ok", "unauthorized", "forbidden", "http_error", "unreachable", "bad_response", "config_error"]
            .iter()
            .map(|r| (vec![("result".into(), (*r).to_owned())], k.requests.get(r).copied().unwrap_or(0) as f64))
            .collect();
    family(
        enc,
        "apron_agent_kubernetes_requests",
        "Lists of this node's pods sent to the Kubernetes API server, by result.",
        MetricType::Counter,
        &requests,
    )?;
    family(
        enc,
        "apron_agent_kubernetes_pods",
        "Pods of this node in the last successful list (their labels go into pod_labels).",
        MetricType::Gauge,
        &[(vec![], k.pods as f64)],
    )?;
    if let Some(t) = k.last_success_time {
        family(
            enc,
            "apron_agent_kubernetes_last_success_time_seconds",
            "When the API server last answered a list, Unix seconds.",
            MetricType::Gauge,
            &[(vec![], t)],
        )?;
    }
    Ok(())
}
