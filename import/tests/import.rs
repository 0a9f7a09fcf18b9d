//! The importer end to end: bytes in the formats the tools write → `gpu_samples` rows,
//! with expectations computed by hand.

#[path = "import/fuzz_regressions.rs"]
mod fuzz_regressions;

use std::fmt::Write as _;
use std::time::Duration;

use apron_common::{ClusterName, Field, FieldStats, GpuIdentity, GpuUuid, GpuWindow, HolderKind, HostName, UnixMicros};
use apron_import::{Format, ImportError, ImportOptions, ImportOutcome, Importer, import, reason};

/// 2023-11-14T22:13:20Z, a multiple of 60 s.
const T0: i64 = 1_700_000_000;
const H100: &str = r#"gpu="0",UUID="GPU-aaaa",pci_bus_id="00000000:18:00.0",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="node-1""#;
const L4: &str =
    r#"gpu="1",UUID="GPU-bbbb",pci_bus_id="00000000:3b:00.0",device="nvidia1",modelName="NVIDIA L4",Hostname="node-1""#;

fn opts() -> ImportOptions {
    ImportOptions::default()
}

fn run(input: &str) -> ImportOutcome {
    match import(input.as_bytes(), &opts()) {
        Ok(out) => out,
        Err(e) => panic!("import failed: {e}\n{input}"),
    }
}

/// `samples_read = samples_used + Σ skipped`, the outcome's accounting invariant.
fn balanced(out: &ImportOutcome) -> bool {
    out.samples_read == out.samples_used + out.skipped.values().sum::<u64>()
}

/// (seconds after T0, window seconds, value of `f`) per row of `uuid`.
fn rows(out: &ImportOutcome, uuid: &str, f: Field) -> Vec<(i64, f64, Option<f64>)> {
    out.windows
        .iter()
        .filter(|w| w.gpu.gpu_uuid.as_str() == uuid)
        .map(|w| (w.time.0 / 1_000_000 - T0, w.window_secs(), w.value(f)))
        .collect()
}

/// One series as Prometheus text lines (timestamps in ms).
fn prom_lines(out: &mut String, name: &str, labels: &str, points: &[(i64, f64)]) {
    for (t, v) in points {
        let _ = writeln!(out, "{name}{{{labels}}} {v} {}", (T0 + t) * 1000);
    }
}

#[test]
fn a_15s_gpu_util_series_gives_one_window_per_scrape_after_the_first() {
    let mut text =
        String::from("# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).\n# TYPE DCGM_FI_DEV_GPU_UTIL gauge\n");
    prom_lines(&mut text, "DCGM_FI_DEV_GPU_UTIL", H100, &[(0, 0.0), (15, 0.0), (30, 100.0), (45, 100.0)]);
    let out = run(&text);
    assert_eq!(
        rows(&out, "GPU-aaaa", Field::GpuUtil),
        vec![(15, 15.0, Some(0.0)), (30, 15.0, Some(1.0)), (45, 15.0, Some(1.0))]
    );
    assert_eq!((out.series, out.samples_read, out.samples_used, out.rows), (1, 4, 3, 3));
    assert_eq!(out.skipped.get(reason::FIRST), Some(&1));
    assert!(balanced(&out));
    assert_eq!(out.first_us, Some(UnixMicros(T0 * 1_000_000)));
    assert_eq!(out.last_us, Some(UnixMicros((T0 + 45) * 1_000_000)));
    let w = &out.windows[1];
    // A point sample: one reading, so the window's max (the `_max` column) is the value.
    assert_eq!(w.get(Field::GpuUtil), Some(&FieldStats { count: 1, mean: 1.0, min: 1.0, max: 1.0, last: 1.0 }));
    assert!(!w.lost && w.owner.is_none());
    let g = &w.gpu;
    assert_eq!((g.host.as_str(), g.gpu_index, g.gpu_model.as_str()), ("node-1", 0, "NVIDIA H100 80GB HBM3"));
    assert_eq!((g.pci_bus_id.as_str(), g.minor_number, g.cluster.as_ref()), ("00000000:18:00.0", Some(0), None));
}

#[test]
fn a_gap_longer_than_max_gap_is_unknown() {
    let mut text = String::new();
    let pts = [(0, 10.0), (15, 20.0), (30, 30.0), (150, 40.0), (165, 50.0), (180, 60.0)];
    prom_lines(&mut text, "DCGM_FI_DEV_GPU_UTIL", H100, &pts);
    let out = run(&text);
    // Median step 15 s, max_gap 45 s: the sample after the 2-minute gap is unknown.
    assert_eq!(
        rows(&out, "GPU-aaaa", Field::GpuUtil),
        vec![(15, 15.0, Some(0.2)), (30, 15.0, Some(0.3)), (165, 15.0, Some(0.5)), (180, 15.0, Some(0.6))]
    );
    assert_eq!(out.skipped.get(reason::GAP), Some(&1));
    assert_eq!(out.skipped.get(reason::FIRST), Some(&1));
    assert!(balanced(&out));

    // A fixed max_gap of 3 min bridges it: one 120 s window.
    let wide = ImportOptions { max_gap: Some(Duration::from_secs(180)), ..opts() };
    let out = import(text.as_bytes(), &wide).expect("imports");
    assert_eq!(rows(&out, "GPU-aaaa", Field::GpuUtil)[2], (150, 120.0, Some(0.4)));
    assert_eq!(out.skipped.get(reason::GAP), None);
}

#[test]
fn units_convert_to_base_units() {
    let mut text = String::new();
    for (name, v0, v1) in [
        ("DCGM_FI_DEV_FB_USED", 0.0, 1024.0),
        ("DCGM_FI_DEV_FB_FREE", 0.0, 80_000.0),
        ("DCGM_FI_DEV_FB_RESERVED", 0.0, 512.0),
        ("DCGM_FI_DEV_POWER_USAGE", 0.0, 312.5),
        ("DCGM_FI_DEV_GPU_TEMP", 0.0, 54.0),
        ("DCGM_FI_DEV_SM_CLOCK", 0.0, 1980.0),
        ("DCGM_FI_DEV_MEM_CLOCK", 0.0, 2619.0),
        ("DCGM_FI_DEV_MEM_COPY_UTIL", 0.0, 37.0),
        ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", 1_000.0, 4_690_500.0),
        ("DCGM_FI_PROF_SM_ACTIVE", 0.0, 0.625),
        ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", 0.0, 0.25),
        ("DCGM_FI_PROF_PCIE_TX_BYTES", 0.0, 1.5e9),
        ("DCGM_FI_PROF_NVLINK_RX_BYTES", 0.0, 2.0e10),
    ] {
        prom_lines(&mut text, name, H100, &[(0, v0), (15, v1)]);
    }
    let out = run(&text);
    assert_eq!(out.rows, 1);
    let w = &out.windows[0];
    let v = |f| w.value(f);
    assert_eq!(v(Field::FbUsedBytes), Some(1_073_741_824.0));
    assert_eq!(v(Field::FbFreeBytes), Some(80_000.0 * 1_048_576.0));
    assert_eq!(v(Field::FbReservedBytes), Some(536_870_912.0));
    assert_eq!(v(Field::PowerWatts), Some(312.5));
    assert_eq!(v(Field::GpuTempC), Some(54.0));
    assert_eq!((v(Field::SmClockMhz), v(Field::MemClockMhz)), (Some(1980.0), Some(2619.0)));
    assert_eq!(v(Field::MemCopyUtil), Some(0.37));
    assert_eq!(v(Field::EnergyJoules), Some(4690.5));
    assert_eq!((v(Field::SmActive), v(Field::TensorActive)), (Some(0.625), Some(0.25)));
    assert_eq!((v(Field::PcieTxBytesPerS), v(Field::NvlinkRxBytesPerS)), (Some(1.5e9), Some(2.0e10)));
    assert_eq!(v(Field::GpuUtil), None, "no reading: NULL, not 0");
    assert_eq!(out.series, 13);
}

#[test]
fn mig_instances_are_their_own_gpus() {
    let parent = r#"gpu="0",UUID="GPU-aaaa",device="nvidia0",modelName="NVIDIA A100 80GB PCIe",Hostname="node-2""#;
    let mut text = String::new();
    prom_lines(&mut text, "DCGM_FI_DEV_POWER_USAGE", parent, &[(0, 80.0), (30, 90.0)]);
    for (gi, profile, v) in [(1, "3g.40gb", 0.5), (9, "1g.10gb", 0.125)] {
        let labels = format!(r#"{parent},GPU_I_PROFILE="{profile}",GPU_I_ID="{gi}""#);
        prom_lines(&mut text, "DCGM_FI_PROF_GR_ENGINE_ACTIVE", &labels, &[(0, 0.0), (30, v)]);
    }
    let out = run(&text);
    let ids: Vec<_> = out.windows.iter().map(|w| w.gpu.gpu_uuid.as_str()).collect();
    assert_eq!(ids, vec!["GPU-aaaa", "MIG-GPU-aaaa/1", "MIG-GPU-aaaa/9"], "sorted by GPU UUID");
    let (whole, gi1, gi9) = (&out.windows[0], &out.windows[1], &out.windows[2]);
    assert!(!whole.gpu.is_mig());
    assert_eq!((whole.value(Field::PowerWatts), whole.value(Field::GrEngineActive)), (Some(90.0), None));
    assert_eq!(gi9.value(Field::GrEngineActive), Some(0.125));
    assert_eq!(gi9.gpu.parent_gpu_uuid.as_ref().map(GpuUuid::as_str), Some("GPU-aaaa"));
    assert_eq!((gi9.gpu.mig_profile.as_deref(), gi9.gpu.mig_gpu_instance_id), (Some("1g.10gb"), Some(9)));
    assert_eq!(
        (gi1.gpu.mig_profile.as_deref(), gi1.gpu.gpu_index, gi1.gpu.host.as_str()),
        (Some("3g.40gb"), 0, "node-2")
    );
    assert_eq!(gi1.gpu.gpu_uuid.as_str(), apron_import::mig_instance_uuid("GPU-aaaa", 1));
}

#[test]
fn pod_labels_become_the_holder() {
    let mut text = String::new();
    let held = format!(r#"{H100},pod="train-0",namespace="ml",container="main""#);
    prom_lines(&mut text, "DCGM_FI_DEV_GPU_UTIL", &held, &[(0, 90.0), (15, 95.0)]);
    // Time-slicing: the exporter repeats the L4's values once per pod.
    for pod in ["inf-a", "inf-b"] {
        let labels = format!(r#"{L4},pod="{pod}",namespace="serve",container="c""#);
        prom_lines(&mut text, "DCGM_FI_DEV_GPU_UTIL", &labels, &[(0, 10.0), (15, 20.0)]);
    }
    let out =
        import(text.as_bytes(), &ImportOptions { cluster: ClusterName::new("prod").ok(), ..opts() }).expect("imports");
    assert_eq!(out.rows, 2);
    let h = out.windows[0].owner.as_ref().expect("held");
    assert_eq!((h.kind, h.owner.as_str()), (HolderKind::Pod, "ml/train-0"));
    assert_eq!(
        (h.namespace.as_deref(), h.pod.as_deref(), h.container.as_deref()),
        (Some("ml"), Some("train-0"), Some("main"))
    );
    let shared = out.windows[1].owner.as_ref().expect("held");
    assert_eq!((shared.owner.as_str(), shared.pod.as_deref()), ("serve/*", None));
    assert_eq!(out.windows[1].value(Field::GpuUtil), Some(0.2));
    assert_eq!(out.skipped.get(reason::DUPLICATE), Some(&2), "one copy per timestamp kept");
    assert!(out.warnings.is_empty());
    assert!(out.windows.iter().all(|w| w.gpu.cluster.as_ref().map(ClusterName::as_str) == Some("prod")));
}

/// One data set in the three formats: Prometheus text (ms), OpenMetrics (s) and a
/// `query_range` answer.
fn three_formats() -> (String, String, String) {
    type Series = (&'static str, &'static str, Vec<(i64, f64)>);
    let series: [Series; 3] = [
        ("DCGM_FI_DEV_GPU_UTIL", H100, vec![(0, 0.0), (15, 50.0), (30, 100.0), (45, 25.0)]),
        ("DCGM_FI_DEV_FB_USED", H100, vec![(0, 100.0), (15, 2048.0), (30, 4096.0), (45, 4096.0)]),
        ("DCGM_FI_PROF_SM_ACTIVE", L4, vec![(0, 0.0), (15, 0.125), (30, 0.5)]),
    ];
    let (mut prom, mut om) = (String::new(), String::new());
    let mut json = String::from(r#"{"status":"success","data":{"resultType":"matrix","result":["#);
    for (i, (name, labels, pts)) in series.iter().enumerate() {
        let _ = writeln!(prom, "# TYPE {name} gauge");
        let _ = writeln!(om, "# TYPE {name} gauge");
        prom_lines(&mut prom, name, labels, pts);
        for (t, v) in pts {
            let _ = writeln!(om, "{name}{{{labels}}} {v} {}.000", T0 + t);
        }
        let metric: Vec<String> = labels
            .split(',')
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| format!("\"{k}\":{v}"))
            .chain([format!("\"__name__\":\"{name}\"")])
            .collect();
        let values: Vec<String> = pts.iter().map(|(t, v)| format!("[{},\"{v}\"]", T0 + t)).collect();
        let comma = if i == 0 { "" } else { "," };
        let _ = write!(json, r#"{comma}{{"metric":{{{}}},"values":[{}]}}"#, metric.join(","), values.join(","));
    }
    om.push_str("# EOF\n");
    json.push_str("]}}");
    (prom, om, json)
}

#[test]
fn query_range_json_equals_the_same_data_as_text() {
    let (prom, om, json) = three_formats();
    assert_eq!(Format::detect(prom.as_bytes()), Format::PrometheusText);
    assert_eq!(Format::detect(om.as_bytes()), Format::OpenMetrics);
    assert_eq!(Format::detect(json.as_bytes()), Format::PrometheusJson);
    let (a, b, c) = (run(&prom), run(&om), run(&json));
    assert_eq!(a.rows, 5);
    assert_eq!(rows(&a, "GPU-aaaa", Field::FbUsedBytes)[0], (15, 15.0, Some(2048.0 * 1_048_576.0)));
    assert_eq!(rows(&a, "GPU-bbbb", Field::SmActive), vec![(15, 15.0, Some(0.125)), (30, 15.0, Some(0.5))]);
    assert_eq!(a, b);
    assert_eq!(a, c);
    // An array of answers, one series each, is the same data too.
    let v: serde_json::Value = serde_json::from_str(&json).expect("valid JSON");
    let split: Vec<serde_json::Value> = v["data"]["result"]
        .as_array()
        .expect("result")
        .iter()
        .map(|s| serde_json::json!({"status": "success", "data": {"resultType": "matrix", "result": [s]}}))
        .collect();
    assert_eq!(run(&serde_json::Value::Array(split).to_string()), a);
}

#[test]
fn promtool_dumps_parse() {
    // `promtool tsdb dump`: the name as a label, ", " between labels, ms.
    let dump = "\
{__name__=\"DCGM_FI_DEV_GPU_UTIL\", Hostname=\"node-1\", UUID=\"GPU-aaaa\", gpu=\"0\", instance=\"10.0.0.1:9400\", job=\"dcgm\"} 0 1700000000000
{__name__=\"DCGM_FI_DEV_GPU_UTIL\", Hostname=\"node-1\", UUID=\"GPU-aaaa\", gpu=\"0\", instance=\"10.0.0.1:9400\", job=\"dcgm\"} 40 1700000015000
{__name__=\"up\", instance=\"10.0.0.1:9400\", job=\"dcgm\"} 1 1700000015000
";
    let out = run(dump);
    assert_eq!(rows(&out, "GPU-aaaa", Field::GpuUtil), vec![(15, 15.0, Some(0.4))]);
    assert_eq!(out.skipped.get(reason::NOT_MAPPED), Some(&1));
    // `promtool tsdb dump-openmetrics`: seconds with ms decimals, `# EOF` at the end.
    let om = "\
DCGM_FI_DEV_GPU_UTIL{Hostname=\"node-1\", UUID=\"GPU-aaaa\", gpu=\"0\"} 0 1700000000.000
DCGM_FI_DEV_GPU_UTIL{Hostname=\"node-1\", UUID=\"GPU-aaaa\", gpu=\"0\"} 40 1700000015.000
# EOF
";
    assert_eq!(run(om).windows, out.windows);
}

#[test]
fn concatenated_scrapes_with_escapes_infinities_and_counter_suffixes() {
    let mut text = String::new();
    for (k, util) in [(0, 10), (30, 20), (60, 30)] {
        let ms = (T0 + k) * 1000;
        let _ =
            writeln!(text, "# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).\n# TYPE DCGM_FI_DEV_GPU_UTIL gauge");
        let _ = writeln!(
            text,
            r#"DCGM_FI_DEV_GPU_UTIL{{UUID="GPU-aaaa",modelName="Quote \" and \\ back",Hostname="n1"}} {util} {ms}"#
        );
        let _ = writeln!(
            text,
            r#"DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION_total{{UUID="GPU-aaaa",Hostname="n1"}} {} {ms}"#,
            1000 * k
        );
        let _ = writeln!(text, r#"DCGM_FI_DEV_POWER_USAGE{{UUID="GPU-aaaa",Hostname="n1"}} +Inf {ms}"#);
    }
    let out = run(&text);
    assert_eq!(rows(&out, "GPU-aaaa", Field::GpuUtil), vec![(30, 30.0, Some(0.2)), (60, 30.0, Some(0.3))]);
    assert_eq!(rows(&out, "GPU-aaaa", Field::EnergyJoules), vec![(30, 30.0, Some(30.0)), (60, 30.0, Some(60.0))]);
    assert_eq!(out.windows[0].gpu.gpu_model, "Quote \" and \\ back");
    assert_eq!(out.skipped.get(reason::NOT_FINITE), Some(&3));
    assert!(balanced(&out));
}

#[test]
fn skipped_samples_are_counted_by_reason() {
    let mut text = String::new();
    let ms = |k: i64| (T0 + k) * 1000;
    prom_lines(&mut text, "DCGM_FI_DEV_GPU_UTIL", H100, &[(0, 1.0), (15, 2.0), (30, 3.0)]);
    let _ = writeln!(text, "DCGM_FI_DEV_GPU_UTIL{{{H100}}} 3 {}", ms(30)); // duplicate
    let _ = writeln!(text, "DCGM_FI_DEV_GPU_UTIL{{{H100}}} 9 {}", ms(15)); // conflicts, read later: kept
    let _ = writeln!(text, "DCGM_FI_DEV_GPU_UTIL{{{H100}}} 7"); // no timestamp
    let _ = writeln!(text, "DCGM_FI_DEV_GPU_UTIL{{{H100}}} NaN {}", ms(45));
    let _ = writeln!(text, "DCGM_FI_DEV_GPU_UTIL{{gpu=\"0\"}} 5 {}", ms(15)); // no UUID
    let _ = writeln!(text, "DCGM_FI_DEV_ENC_UTIL{{UUID=\"GPU-aaaa\",GPU_I_ID=\"x\"}} 5 {}", ms(15));
    let _ = writeln!(text, "DCGM_FI_DEV_VGPU_LICENSE_STATUS{{{H100}}} 0 {}", ms(15));
    let _ = writeln!(text, "DCGM_FI_DEV_GPU_TEMP{{{H100}}} 2147483632 {}", ms(15)); // DCGM blank
    let _ = writeln!(text, "DCGM_FI_DEV_GPU_TEMP{{{H100}}} 40 {}", T0 + 15); // seconds read as ms
    let out = run(&text);
    let expected = [
        (reason::FIRST, 1),
        (reason::DUPLICATE, 1),
        (reason::CONFLICT, 1),
        (reason::NO_TIMESTAMP, 1),
        (reason::NOT_FINITE, 1),
        (reason::NO_UUID, 1),
        (reason::BAD_LABEL, 1),
        (reason::NOT_MAPPED, 1),
        (reason::OUT_OF_RANGE, 1),
        (reason::TIME_RANGE, 1),
    ];
    let skipped: Vec<(&str, u64)> = out.skipped.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    let mut want: Vec<(&str, u64)> = expected.to_vec();
    want.sort_unstable();
    assert_eq!(skipped, want);
    assert_eq!(out.warnings.get(reason::CONFLICT_WARNING), Some(&1));
    assert_eq!(rows(&out, "GPU-aaaa", Field::GpuUtil), vec![(15, 15.0, Some(0.09)), (30, 15.0, Some(0.03))]);
    assert_eq!((out.samples_read, out.samples_used), (12, 2));
    assert!(balanced(&out));
}

#[test]
fn malformed_input_is_an_error_with_its_line() {
    let mut text = String::new();
    prom_lines(&mut text, "DCGM_FI_DEV_GPU_UTIL", H100, &[(0, 1.0), (15, 2.0), (30, 3.0)]);
    for _ in 0..8 {
        text.push_str("# filler\n");
    }
    text.push_str("DCGM_FI_DEV_GPU_UTIL{UUID=\"GPU-aaaa\"}\n");
    let e = import(text.as_bytes(), &opts()).err().map(|e| e.to_string());
    assert_eq!(e.as_deref(), Some("line 12: expected a value after the labels"));
    let e = import(b"{\"data\": [", &opts()).err();
    assert!(matches!(e, Some(ImportError::Json { line: 1, .. })), "{e:?}");
}

#[test]
fn several_inputs_make_one_history() {
    // One series split across two files: the second file's first sample closes an
    // interval opened by the first file.
    let (mut a, mut b) = (String::new(), String::new());
    prom_lines(&mut a, "DCGM_FI_DEV_GPU_UTIL", H100, &[(0, 10.0), (15, 20.0)]);
    prom_lines(&mut b, "DCGM_FI_DEV_GPU_UTIL", H100, &[(30, 30.0), (45, 40.0)]);
    let mut imp = Importer::new(opts()).expect("valid options");
    assert_eq!(imp.add(a.as_bytes(), None), Ok(Format::PrometheusText));
    // A broken input in between changes nothing.
    let broken = format!("{b}DCGM_FI_DEV_GPU_UTIL{{UUID=\"GPU-aaaa\"\n");
    assert!(matches!(imp.add(broken.as_bytes(), None), Err(ImportError::Text { line: 3, .. })));
    assert_eq!(imp.add(b.as_bytes(), Some(Format::PrometheusText)), Ok(Format::PrometheusText));
    let out = imp.finish().expect("finish");
    assert_eq!(
        rows(&out, "GPU-aaaa", Field::GpuUtil),
        vec![(15, 15.0, Some(0.2)), (30, 15.0, Some(0.3)), (45, 15.0, Some(0.4))]
    );
    assert_eq!(out.samples_read, 4);
}

// ---------------------------------------------------------------------------------------
// The property of the issue: "An OpenMetrics file of dcgm-exporter samples, with a value
// held constant within each export window" imports to windows that reproduce the
// busy and idle seconds of the per-second truth.

/// A per-second trace: 1 s agent windows ending at T0+1 … T0+n.
fn agent_windows(uuid: &str, util: &[f64]) -> Vec<GpuWindow> {
    let gpu = GpuIdentity::gpu(
        HostName::new("node-1").expect("valid"),
        GpuUuid::new(uuid).expect("valid"),
        0,
        "NVIDIA H100 80GB HBM3",
    );
    util.iter()
        .enumerate()
        .map(|(i, &u)| {
            let mut w =
                GpuWindow::new(UnixMicros((T0 + i as i64 + 1) * 1_000_000), Duration::from_secs(1), gpu.clone());
            w.fields[Field::GpuUtil.index()] = Some(FieldStats::single(u));
            w.fields[Field::SmActive.index()] = Some(FieldStats::single(u * 0.8));
            w
        })
        .collect()
}

/// Exports `windows` as dcgm-exporter would with a 15 s interval, as OpenMetrics: the
/// value at `t` is the mean over `(t − 15 s, t]`, constant over that export window; a
/// sample at T0 opens the series.
fn export_openmetrics(windows: &[GpuWindow], every: i64) -> String {
    let mut om = String::from("# TYPE DCGM_FI_DEV_GPU_UTIL gauge\n# UNIT DCGM_FI_DEV_GPU_UTIL percent\n");
    om.push_str("# TYPE DCGM_FI_PROF_SM_ACTIVE gauge\n");
    let uuids: std::collections::BTreeSet<&str> = windows.iter().map(|w| w.gpu.gpu_uuid.as_str()).collect();
    for uuid in uuids {
        let mine: Vec<&GpuWindow> = windows.iter().filter(|w| w.gpu.gpu_uuid.as_str() == uuid).collect();
        let labels = format!(r#"gpu="0",UUID="{uuid}",modelName="NVIDIA H100 80GB HBM3",Hostname="node-1""#);
        let n = mine.len() as i64;
        for k in 0..=n / every {
            let t = T0 + k * every;
            let inside: Vec<&&GpuWindow> =
                mine.iter().filter(|w| w.time.0 / 1_000_000 > t - every && w.time.0 / 1_000_000 <= t).collect();
            let mean = |f: Field| inside.iter().filter_map(|w| w.value(f)).sum::<f64>() / inside.len().max(1) as f64;
            let _ = writeln!(om, "DCGM_FI_DEV_GPU_UTIL{{{labels}}} {} {t}.000", mean(Field::GpuUtil) * 100.0);
            let _ = writeln!(om, "DCGM_FI_PROF_SM_ACTIVE{{{labels}}} {} {t}.000", mean(Field::SmActive));
        }
    }
    om.push_str("# EOF\n");
    om
}

/// (busy seconds Σ value × window, idle seconds Σ (1 − value) × window, seconds in idle
/// windows — those whose `_max` is 0) of one field over windows.
fn seconds(windows: &[GpuWindow], uuid: &str, f: Field) -> (f64, f64, f64) {
    let mine = windows.iter().filter(|w| w.gpu.gpu_uuid.as_str() == uuid);
    mine.fold((0.0, 0.0, 0.0), |(busy, idle, idle_windows), w| {
        let s = w.get(f).expect("a value in every window");
        let d = w.window_secs();
        (busy + s.mean * d, idle + (1.0 - s.mean) * d, idle_windows + if s.max == 0.0 { d } else { 0.0 })
    })
}

fn close(a: (f64, f64, f64), b: (f64, f64, f64)) -> bool {
    (a.0 - b.0).abs() < 1e-9 && (a.1 - b.1).abs() < 1e-9 && (a.2 - b.2).abs() < 1e-9
}

#[test]
fn openmetrics_export_windows_reproduce_busy_and_idle_seconds() {
    // GPU-aaaa: busy 20 s then idle 40 s. GPU-bbbb: busy 30 s then idle 30 s, which
    // changes state only at an export boundary, so every second is reproduced exactly.
    let a: Vec<f64> = (0..60).map(|s| if s < 20 { 1.0 } else { 0.0 }).collect();
    let b: Vec<f64> = (0..60).map(|s| if s < 30 { 1.0 } else { 0.0 }).collect();
    let mut truth = agent_windows("GPU-aaaa", &a);
    truth.extend(agent_windows("GPU-bbbb", &b));
    let om = export_openmetrics(&truth, 15);
    assert_eq!(Format::detect(om.as_bytes()), Format::OpenMetrics);
    let out = run(&om);

    // Four 15 s windows per GPU; the sample at T0 only opens the series.
    let got: Vec<(i64, f64, f64)> =
        rows(&out, "GPU-aaaa", Field::GpuUtil).into_iter().map(|(t, w, v)| (t, w, v.unwrap_or(f64::NAN))).collect();
    let want = [(15, 15.0, 1.0), (30, 15.0, 5.0 / 15.0), (45, 15.0, 0.0), (60, 15.0, 0.0)];
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(want) {
        assert!(g.0 == w.0 && g.1 == w.1 && (g.2 - w.2).abs() < 1e-12, "{got:?}");
    }
    assert_eq!(out.skipped.get(reason::FIRST), Some(&4));
    assert!(balanced(&out));

    // Busy/idle seconds: 20/40 for GPU-aaaa by both fields. Idle *windows* can only be
    // whole export windows: 30 s are in windows with max 0, while the 5 idle seconds of
    // the partly busy window (15, 30] cannot be located from a 15 s export.
    for f in [Field::GpuUtil, Field::SmActive] {
        let scale = if f == Field::SmActive { 0.8 } else { 1.0 };
        let (busy, idle, idle_windows) = seconds(&out.windows, "GPU-aaaa", f);
        assert!((busy - 20.0 * scale).abs() < 1e-9 && (idle - (60.0 - 20.0 * scale)).abs() < 1e-9, "{f:?}");
        assert!((idle_windows - 30.0).abs() < 1e-9);
        assert!(close(seconds(&truth, "GPU-aaaa", f), (busy, idle, 40.0)));
    }
    // GPU-bbbb: the truth is constant within each export window, so busy, idle and
    // idle-window seconds all match, and so does the value of every second.
    for f in [Field::GpuUtil, Field::SmActive] {
        assert!(close(seconds(&out.windows, "GPU-bbbb", f), seconds(&truth, "GPU-bbbb", f)), "{f:?}");
    }
    let imported: Vec<&GpuWindow> = out.windows.iter().filter(|w| w.gpu.gpu_uuid.as_str() == "GPU-bbbb").collect();
    for second in truth.iter().filter(|w| w.gpu.gpu_uuid.as_str() == "GPU-bbbb") {
        let covering = imported
            .iter()
            .find(|w| w.time.minus(w.window) < second.time && second.time <= w.time)
            .expect("every second is covered");
        assert_eq!(covering.value(Field::GpuUtil), second.value(Field::GpuUtil), "at {:?}", second.time);
        assert_eq!(covering.window, Duration::from_secs(15));
    }
}

#[test]
fn a_larger_history_imports_linearly() {
    // 8 GPUs × 4 fields × 2 days at 30 s: ~46k samples per field and GPU.
    let mut text = String::new();
    let steps = 2 * 86_400 / 30;
    for g in 0..8 {
        let labels = format!(r#"gpu="{g}",UUID="GPU-{g:04}",Hostname="n{}""#, g / 4);
        for name in ["DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_PROF_SM_ACTIVE"]
        {
            for k in 0..steps {
                let _ = writeln!(text, "{name}{{{labels}}} {} {}", k % 2, (T0 + k * 30) * 1000);
            }
        }
    }
    let out = run(&text);
    assert_eq!(out.rows, 8 * (steps as usize - 1));
    assert_eq!(out.samples_used, 8 * 4 * (steps as u64 - 1));
    let key = |w: &GpuWindow| (w.gpu.gpu_uuid.to_string(), w.time);
    assert!(out.windows.windows(2).all(|p| key(&p[0]) < key(&p[1])));

    // In batches: the same rows in the same order, at most 1000 at a time.
    let mut imp = Importer::new(opts()).expect("valid options");
    imp.add(text.as_bytes(), None).expect("parses");
    let mut batched = Vec::new();
    let done = imp.finish_in_batches(1000, |batch| {
        assert!(!batch.is_empty() && batch.len() <= 1000);
        batched.extend(batch);
        Ok::<_, ImportError>(())
    });
    let counts = done.expect("the sink never fails");
    assert!(counts.windows.is_empty());
    assert_eq!(ImportOutcome { windows: out.windows.clone(), ..counts }, out);
    assert_eq!(batched, out.windows);

    // A failing sink stops the import with its error.
    let mut imp = Importer::new(opts()).expect("valid options");
    imp.add(text.as_bytes(), None).expect("parses");
    let mut calls = 0;
    let done = imp.finish_in_batches(1000, |_| {
        calls += 1;
        if calls == 3 { Err(SinkError::DiskFull) } else { Ok(()) }
    });
    assert_eq!((done, calls), (Err(SinkError::DiskFull), 3));
}

/// A sink's own error; the importer's (a spill that cannot be read back) converts in.
#[derive(Debug, PartialEq)]
enum SinkError {
    DiskFull,
    Import(ImportError),
}

impl From<ImportError> for SinkError {
    fn from(e: ImportError) -> Self {
        SinkError::Import(e)
    }
}

/// A promtool-style dump (series after series) of two GPUs and three fields, with a gap,
/// repeats, a conflicting value and samples of one series split across the file.
fn long_dump() -> String {
    let mut s = String::new();
    for (labels, seed) in [(H100, 0.0), (L4, 0.5)] {
        let util: Vec<(i64, f64)> =
            (0..300).filter(|t| !(100..130).contains(t)).map(|t| (t * 15, ((t as f64 + seed) % 7.0) * 10.0)).collect();
        prom_lines(&mut s, "DCGM_FI_DEV_GPU_UTIL", labels, &util[..150]);
        let power: Vec<(i64, f64)> = (0..300).map(|t| (t * 15 + 5, 100.0 + t as f64)).collect();
        prom_lines(&mut s, "DCGM_FI_DEV_POWER_USAGE", labels, &power);
        prom_lines(&mut s, "DCGM_FI_DEV_GPU_UTIL", labels, &util[150..]);
        prom_lines(&mut s, "DCGM_FI_DEV_GPU_UTIL", labels, &util[10..20]); // repeats
        prom_lines(&mut s, "DCGM_FI_DEV_FB_USED", labels, &[(30, 100.0), (45, 200.0), (45, 300.0), (60, 300.0)]);
    }
    s
}

#[test]
fn a_history_larger_than_memory_spills_and_gives_the_same_rows() {
    let input = long_dump();
    let whole = run(&input);
    assert!(whole.rows > 1000 && balanced(&whole), "{} rows", whole.rows);
    for max_points in [1, 7, 500] {
        let mut importer = Importer::new(opts()).expect("options");
        importer.spill_to(tempfile::tempfile().expect("spill file"), max_points);
        // Read as a file is: through a small buffer, a line at a time.
        let reader = std::io::BufReader::with_capacity(64, input.as_bytes());
        assert_eq!(importer.add_reader(reader, Format::PrometheusText), Ok(Format::PrometheusText));
        let bounds = importer.time_bounds().expect("bounds");
        let spilled = importer.finish().expect("finish");
        assert_eq!(spilled, whole, "max_points = {max_points}");
        assert_eq!(bounds, (UnixMicros(T0 * 1_000_000), UnixMicros((T0 + 299 * 15 + 5) * 1_000_000)));
        assert!(whole.windows.iter().all(|w| w.time.minus(w.window) >= bounds.0 && w.time <= bounds.1));
    }
}

#[test]
fn a_failed_input_is_forgotten_even_after_it_spilled() {
    let good = long_dump();
    let expected = run(&good);
    // The second input repeats the first's series with new times, then breaks.
    let mut bad = String::new();
    prom_lines(&mut bad, "DCGM_FI_DEV_GPU_UTIL", H100, &(400..900).map(|t| (t * 15, 50.0)).collect::<Vec<_>>());
    bad.push_str("DCGM_FI_DEV_GPU_UTIL{UUID=\"GPU-aaaa\"} not-a-number 1\n");
    for max_points in [3, 100, 100_000] {
        let mut importer = Importer::new(opts()).expect("options");
        importer.spill_to(tempfile::tempfile().expect("spill file"), max_points);
        assert!(importer.add_reader(good.as_bytes(), Format::PrometheusText).is_ok());
        let e = importer.add_reader(bad.as_bytes(), Format::PrometheusText).err();
        assert!(matches!(e, Some(ImportError::Text { line: 501, .. })), "{e:?}");
        assert_eq!(importer.finish().expect("finish"), expected, "max_points = {max_points}");
    }
    // Not UTF-8, read a line at a time: the same line and offset as a whole input.
    let mut importer = Importer::new(opts()).expect("options");
    let e = importer.add_reader(&b"# x\nm{a=\"\xff\"} 1 1\n"[..], Format::PrometheusText).err();
    assert_eq!(e, Some(ImportError::NotUtf8 { line: 2, offset: 9 }));
}
