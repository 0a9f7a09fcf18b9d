use std::collections::BTreeSet;

use apron_common::{FieldStats, GpuIdentity, GpuUuid, HostName, ProcessRow, UnixMicros};

use super::*;
use apron_http::metrics::{Format, render};

use crate::sampler::FieldGroup;

fn gpu(uuid: &str, parent: Option<&str>) -> GpuIdentity {
    GpuIdentity {
        cluster: None,
        host: HostName::new("node-1").expect("valid"),
        gpu_uuid: GpuUuid::new(uuid).expect("valid"),
        gpu_index: 0,
        gpu_model: "NVIDIA H100 80GB HBM3".into(),
        pci_bus_id: "00000000:18:00.0".into(),
        minor_number: Some(0),
        parent_gpu_uuid: parent.map(|p| GpuUuid::new(p).expect("valid")),
        mig_profile: parent.map(|_| "1g.10gb".to_owned()),
        mig_gpu_instance_id: parent.map(|_| 9),
    }
}

/// A window with a plausible value in every field (by unit), so the golden file reads
/// like a real node.
fn full_window(g: &GpuIdentity) -> GpuWindow {
    let mut w = GpuWindow::new(UnixMicros(10_000_000), std::time::Duration::from_secs(1), g.clone());
    for f in Field::ALL {
        let v = match f.unit() {
            "ratio" => 0.5,
            "bytes" => 40.0 * 1024.0 * 1024.0 * 1024.0,
            "watts" => 350.25,
            "celsius" => 61.0,
            "MHz" => 1980.0,
            "bytes/s" => 1.5e9,
            "joules" => 123_456.789,
            "code" => 79.0,
            "bitmask" => 4.0,
            "bool" => 0.0,
            _ => 3.0,
        };
        w.fields[f.index()] = Some(FieldStats { count: 4, mean: v, min: v * 0.5, max: v * 1.5, last: v });
    }
    w
}

fn rendered(format: Format) -> String {
    let parent = gpu("GPU-aaaa", None);
    let mig = gpu("MIG-bbbb", Some("GPU-aaaa"));
    let mut st = AgentState::new("nvml", Some("570.172.08".into()), &[parent.clone(), mig.clone()]);
    st.apply_windows(&[full_window(&parent), full_window(&mig)]);
    st.gpus[0].1.owner = OwnerLabels { pod: Some("p".into()), namespace: Some("ns".into()), container: None };
    st.samplers.insert(FieldGroup::Utilization, SamplerStats { runs: 3, up: true, ..Default::default() });
    st.unsupported.insert((FieldGroup::Gpm, "nvmlGpmSampleGet", Some(1)));
    st.processes.push(ProcessRow {
        time: UnixMicros(0),
        host: parent.host.clone(),
        gpu_uuid: parent.gpu_uuid.clone(),
        pid: 42,
        process_name: Some("python".into()),
        user: Some("alice".into()),
        fb_used_bytes: Some(1 << 30),
        sm_util: Some(0.5),
        container_id: None,
        pod: Some("p".into()),
        namespace: Some("ns".into()),
        container: None,
        pod_uid: None,
        job_id: None,
    });
    let mut ship = ShipStats {
        duplicates: 1,
        retries: 4,
        rejected_batches: 1,
        spooled_batches: 6,
        spool_bytes: 8192,
        spool_files: 2,
        spool_dropped_batches: 1,
        spool_dropped_rows: 16,
        last_success_time: Some(1_700_000_000.5),
        ack_seconds: 0.25,
        collector_up: Some(true),
        ..Default::default()
    };
    ship.sent.insert("gpu_samples", TableShipped { batches: 10, rows: 160 });
    st.ship = Some(ship);
    #[cfg(feature = "kubernetes")]
    {
        let mut k = crate::attribution::kube::KubeStats {
            pods: 12,
            last_success_time: Some(1_700_000_000.25),
            ..Default::default()
        };
        k.requests.insert("ok", 40);
        k.requests.insert("forbidden", 2);
        st.kubernetes = Some(k);
    }
    render(&registry(SharedState::new(st)), format).expect("renders")
}

#[test]
fn every_family_is_documented() {
    let docs =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/metrics.md")).expect("docs/metrics.md");
    let text = rendered(Format::PrometheusText);
    let mut names = BTreeSet::new();
    for line in text.lines().filter_map(|l| l.strip_prefix("# TYPE ")) {
        names.insert(line.split(' ').next().unwrap_or_default().to_owned());
    }
    assert!(names.len() > 60, "{names:?}");
    for n in &names {
        assert!(docs.contains(&format!("`{n}")), "{n} is emitted but not in docs/metrics.md");
    }
}

/// The whole exposition for a fixed state, against a reviewed golden file. Lines
/// about the test process itself (CPU, RSS, start time) vary and are left out.
/// `UPDATE_GOLDEN=1 cargo test -p apron-agent golden` rewrites the file.
#[test]
fn a_slow_samplers_reading_stays_for_a_minute() {
    let g = GpuIdentity::gpu(HostName::new("h").expect("host"), GpuUuid::new("GPU-h").expect("uuid"), 0, "m");
    let mut st = AgentState::new("sim", None, std::slice::from_ref(&g));
    let row = |t: i64, replays: Option<f64>| {
        let mut w = GpuWindow::new(UnixMicros(t * 1_000_000), std::time::Duration::from_secs(1), g.clone());
        w.fields[Field::GpuUtil.index()] = Some(FieldStats { count: 1, mean: 0.5, min: 0.5, max: 0.5, last: 0.5 });
        w.fields[Field::PcieReplays.index()] =
            replays.map(|v| FieldStats { count: 1, mean: v, min: v, max: v, last: v });
        w
    };
    let replays = |st: &AgentState| st.gpus[0].1.last.as_ref().and_then(|w| w.value(Field::PcieReplays));
    st.apply_windows(&[row(100, Some(3.0))]);
    st.apply_windows(&[row(101, None)]);
    assert_eq!(replays(&st), Some(3.0), "held between readings");
    st.apply_windows(&[row(160, None)]);
    assert_eq!(replays(&st), Some(3.0), "60 s after its reading");
    st.apply_windows(&[row(161, None)]);
    assert_eq!(replays(&st), None, "gone when the sampler stopped");
}

#[test]
fn golden_exposition() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/metrics.txt");
    let volatile = ["apron_agent_cpu_seconds", "apron_agent_resident_memory_bytes", "apron_agent_start_time_seconds"];
    let text: String = rendered(Format::OpenMetrics)
        .lines()
        .filter(|l| !volatile.iter().any(|v| l.starts_with(v) || l.contains(&format!(" {v}"))))
        .map(|l| format!("{l}\n"))
        .collect();
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(path, &text).expect("write golden");
    }
    let golden = std::fs::read_to_string(path).expect("golden file (UPDATE_GOLDEN=1 creates it)");
    assert!(text == golden, "exposition differs from {path}; review and rerun with UPDATE_GOLDEN=1");
}

#[test]
fn dcgm_labels_follow_dcgm_exporter() {
    let text = rendered(Format::OpenMetrics);
    assert!(text.contains(r#"DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-aaaa",pci_bus_id="00000000:18:00.0",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="node-1",DCGM_FI_DRIVER_VERSION="570.172.08",pod="p",namespace="ns"} 50.0"#), "{text}");
    // A MIG instance: the parent's identity plus GPU_I_PROFILE/GPU_I_ID.
    assert!(text.contains(r#"DCGM_FI_PROF_SM_ACTIVE{gpu="0",UUID="GPU-aaaa",pci_bus_id="00000000:18:00.0",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",GPU_I_PROFILE="1g.10gb",GPU_I_ID="9",Hostname="node-1""#), "{text}");
    assert!(text.contains("# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION gauge"));
    assert!(text.contains("apron_gpu_busy_seconds_total{"), "{text}");
    assert!(text.ends_with("# EOF\n"));
}

#[test]
fn counters_integrate_window_means() {
    let g = gpu("GPU-aaaa", None);
    let mut st = AgentState::new("sim", None, std::slice::from_ref(&g));
    let mut w = full_window(&g);
    st.apply_windows(&[w.clone()]);
    w.fields[Field::GpuUtil.index()] = Some(FieldStats { count: 1, mean: 1.0, min: 1.0, max: 1.0, last: 1.0 });
    st.apply_windows(&[w.clone()]);
    w.fields[Field::GpuUtil.index()] = None;
    st.apply_windows(&[w]);
    let s = &st.gpus[0].1;
    assert!((s.busy_seconds - 1.5).abs() < 1e-12);
    assert!((s.util_observed_seconds - 2.0).abs() < 1e-12, "a window without readings is not observed");
}

#[test]
fn lost_gpu_keeps_only_info_and_lost() {
    let g = gpu("GPU-aaaa", None);
    let mut st = AgentState::new("nvml", None, std::slice::from_ref(&g));
    let mut w = full_window(&g);
    st.apply_windows(&[w.clone()]);
    w.lost = true;
    w.fields = vec![None; Field::COUNT];
    st.apply_windows(&[w]);
    let text = render(&registry(SharedState::new(st)), Format::PrometheusText).expect("renders");
    assert!(!text.contains("DCGM_FI_DEV_GPU_UTIL{"), "{text}");
    assert!(text.contains("apron_gpu_lost{") && text.contains("} 1"), "{text}");
}
