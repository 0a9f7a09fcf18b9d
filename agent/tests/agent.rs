//! End-to-end tests of the `apron-agent` binary.
//!
//! The NVML tests load the fake `libnvidia-ml.so` that the workspace builds
//! (`tests/fake-nvml`), so the real NVML code path runs — nvml-wrapper, symbol loading,
//! sample buffers, GPM deltas — against a scripted driver. Expectations are computed
//! here, independently, from the same scenario numbers. Every server binds port 0 and
//! readiness is polled; nothing sleeps for a fixed time to pass.
//!
//! External tools (Prometheus, promtool) are required: a missing tool fails the test.

#[path = "agent/fuzz_regressions.rs"]
mod fuzz_regressions;

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use apron_test_support::{http_get, poll, spawn_listening, tool};
use serde_json::Value;

#[path = "agent/tls.rs"]
mod tls;

const AGENT: &str = env!("CARGO_BIN_EXE_apron-agent");

/// target/<profile>/ — the fake NVML library is built next to the agent binary.
fn target_dir() -> PathBuf {
    Path::new(AGENT).parent().expect("binary has a directory").to_path_buf()
}

fn fake_lib(name: &str) -> PathBuf {
    let p = target_dir().join(name);
    assert!(
        p.exists(),
        "{} is missing: build the fake NVML first (`cargo build -p apron-fake-nvml -p apron-fake-nvml-legacy`; `cargo test --workspace` does it)",
        p.display()
    );
    p
}

struct Agent {
    child: Child,
    addr: SocketAddr,
    stderr: PathBuf,
    _dir: tempfile::TempDir,
}

impl Agent {
    /// Starts the agent with `args` (plus `--listen 127.0.0.1:0`) and waits until it
    /// serves.
    fn start(args: &[&str], scenario: Option<&str>) -> Agent {
        let dir = tempfile::tempdir().expect("tempdir");
        let stderr = dir.path().join("stderr.log");
        let mut cmd = Command::new(AGENT);
        cmd.args(args).args(["--listen", "127.0.0.1:0", "--hostname", "test-node"]);
        if let Some(s) = scenario {
            let path = dir.path().join("scenario.toml");
            std::fs::write(&path, s).expect("write scenario");
            cmd.env("FAKE_NVML_SCENARIO", path);
        }
        cmd.stderr(std::fs::File::create(&stderr).expect("stderr file"));
        let (child, addr, _) = spawn_listening(&mut cmd, "the agent", &stderr);
        Agent { child, addr, stderr, _dir: dir }
    }

    fn health(&self) -> Value {
        let (status, body) = http_get(self.addr, "/healthz", None);
        assert_eq!(status, 200, "{body}");
        serde_json::from_str(&body).expect("healthz is JSON")
    }

    fn wait_windows(&self, n: u64) {
        poll("closed windows", Duration::from_secs(30), || (self.health()["windows"].as_u64()? >= n).then_some(()));
    }

    fn metrics(&self) -> String {
        let (status, body) = http_get(self.addr, "/metrics", None);
        assert_eq!(status, 200);
        body
    }

    fn stop(mut self) -> String {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc_kill(self.child.id() as i32, 15) };
        let status = poll("agent exit", Duration::from_secs(10), || self.child.try_wait().ok().flatten());
        assert!(status.success(), "agent exited with {status}");
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

unsafe extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

/// Runs the agent to completion expecting failure; returns stderr.
fn run_failing(args: &[&str], scenario: Option<&str>) -> String {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cmd = Command::new(AGENT);
    cmd.args(args).args(["--listen", "127.0.0.1:0"]);
    if let Some(s) = scenario {
        let path = dir.path().join("scenario.toml");
        std::fs::write(&path, s).expect("write");
        cmd.env("FAKE_NVML_SCENARIO", path);
    }
    let out = cmd.output().expect("runs");
    assert!(!out.status.success(), "expected failure; stdout: {}", String::from_utf8_lossy(&out.stdout));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Two H100s. GPU 0 runs a 2-second cycle: busy (100 % util, SM active 0.8, 400 W) for
/// the first 500 ms, idle otherwise. GPU 1 runs steady light work: util 30 %, SM
/// active 0.3. Memory is constant.
const TWO_H100: &str = r#"
driver_version = "570.172.08"

[[gpus]]
index = 0
uuid = "GPU-00000000-0000-0000-0000-000000000000"
name = "NVIDIA H100 80GB HBM3"
pci_bus_id = "00000000:18:00.0"
minor_number = 0
architecture = "hopper"
memory_total_mib = 81559
power_limit_w = 700
nvlink_links = 18
idle = { gpu_util = 0, mem_util = 0, sm_active = 0, sm_occupancy = 0, tensor_active = 0, dram_active = 0, power_w = 100, fb_used_mib = 1000, temp_c = 35, sm_clock_mhz = 345 }
profile = { period_ms = 2000, segments = [ { start_ms = 0, end_ms = 500, gpu_util = 100, mem_util = 40, sm_active = 0.8, sm_occupancy = 0.4, tensor_active = 0.5, dram_active = 0.3, power_w = 400, temp_c = 60, sm_clock_mhz = 1980 } ] }
processes = [ { pid = 4242, name = "python", used_memory_mib = 900 } ]

[[gpus]]
index = 1
uuid = "GPU-11111111-1111-1111-1111-111111111111"
name = "NVIDIA H100 80GB HBM3"
pci_bus_id = "00000000:2A:00.0"
minor_number = 1
architecture = "hopper"
memory_total_mib = 81559
power_limit_w = 700
idle = { gpu_util = 30, mem_util = 10, sm_active = 0.3, sm_occupancy = 0.2, tensor_active = 0, dram_active = 0.1, power_w = 200, fb_used_mib = 20000, temp_c = 45 }
"#;

/// Busy fraction of GPU 0 in the window (end - 1 s, end]: the profile is busy on
/// [0, 0.5) of every 2 s, so a window ending on an odd second holds the busy half.
fn gpu0_busy_fraction(window_end_s: f64) -> f64 {
    let phase = window_end_s.rem_euclid(2.0);
    if (phase - 1.0).abs() < 1e-6 { 0.5 } else { 0.0 }
}

fn windows(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .expect("windows file")
        .lines()
        .map(|l| serde_json::from_str(l).expect("window JSON"))
        .collect()
}

fn field(w: &Value, name: &str, stat: &str) -> Option<f64> {
    let idx = apron_common::Field::from_column(name).expect("known column").index();
    w["fields"][idx].get(stat)?.as_f64()
}

/// The value of one exposition line.
fn sample_value(line: &str) -> f64 {
    line.rsplit(' ').next().and_then(|v| v.parse().ok()).unwrap_or(f64::NAN)
}

fn scenario_file(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fake-nvml/scenarios").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn fixture(path: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/attribution").join(path).display().to_string()
}

#[test]
fn nvml_windows_match_the_scenario() {
    let lib = fake_lib("libnvidia_ml.so");
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("windows.jsonl");
    let agent = Agent::start(
        &["--source", "nvml", "--nvml-lib", lib.to_str().expect("utf8"), "--windows-out", out.to_str().expect("utf8")],
        Some(TWO_H100),
    );
    agent.wait_windows(2 * 7);
    let stderr = agent.stop();
    let rows = windows(&out);
    assert!(rows.len() >= 12, "{} rows\n{stderr}", rows.len());
    let t0 = rows[0]["time"].as_i64().expect("time");

    let (mut checked, mut sm_n) = (0, 0);
    for w in &rows {
        let t = w["time"].as_i64().expect("time");
        // The first complete window may still miss a 1 s sampler's first tick.
        if t <= t0 {
            continue;
        }
        let uuid = w["gpu"]["gpu_uuid"].as_str().expect("uuid");
        let end_s = t as f64 / 1e6;
        assert_eq!(w["window"].as_f64(), Some(1.0));
        assert_eq!(field(w, "fb_total_bytes", "mean"), Some(81559.0 * 1048576.0));
        if uuid.starts_with("GPU-0") {
            let expect = gpu0_busy_fraction(end_s);
            let util = field(w, "gpu_util", "mean").expect("gpu_util present");
            assert!((util - expect).abs() <= 0.02, "window {end_s}: gpu_util {util}, expected {expect}");
            let max = field(w, "gpu_util", "max").expect("max");
            assert_eq!(max, if expect > 0.0 { 1.0 } else { 0.0 }, "window {end_s}");
            assert_eq!(field(w, "fb_used_bytes", "mean"), Some(1000.0 * 1048576.0));
            let p = field(w, "power_watts", "mean").expect("power");
            assert!(p == 100.0 || p == 400.0, "power reads the profile at call time: {p}");
            // GPM readings are deltas over 250 ms ticks on the window grid, stamped at
            // their midpoints: four tile each window exactly.
            if t > t0 + 1_000_000 {
                assert_eq!(field(w, "sm_active", "count"), Some(4.0), "window {end_s}");
                let sm = field(w, "sm_active", "mean").expect("GPM sm_active on Hopper");
                assert!((sm - 0.8 * expect).abs() <= 0.02, "window {end_s}: sm_active {sm}, expected {}", 0.8 * expect);
                let max = field(w, "sm_active", "max").expect("max");
                assert!((max - if expect > 0.0 { 0.8 } else { 0.0 }).abs() <= 0.02, "window {end_s}: max {max}");
                sm_n += 1;
            }
            checked += 1;
        } else {
            let util = field(w, "gpu_util", "mean").expect("gpu_util");
            assert!((util - 0.30).abs() < 1e-9, "steady 30 %: {util}");
            let sm = field(w, "sm_active", "mean").expect("GPM sm_active on Hopper");
            assert!((sm - 0.30).abs() < 1e-6, "steady SM activity: {sm}");
            assert!((field(w, "tensor_active", "mean").expect("tensor") - 0.0).abs() < 1e-9);
            assert_eq!(field(w, "gpu_temp_c", "mean"), Some(45.0));
        }
    }
    assert!(checked >= 5 && sm_n >= 4, "checked {checked} windows, {sm_n} with GPM");
}

#[test]
fn metrics_follow_the_contract_and_pass_promtool() {
    let promtool = tool("promtool");
    let lib = fake_lib("libnvidia_ml.so");
    let agent = Agent::start(&["--source", "nvml", "--nvml-lib", lib.to_str().expect("utf8")], Some(TWO_H100));
    agent.wait_windows(4);
    poll("process metrics", Duration::from_secs(15), || {
        agent.metrics().contains("apron_gpu_process_memory_bytes{").then_some(())
    });
    let text = agent.metrics();
    assert!(text.contains(r#"DCGM_FI_DEV_GPU_UTIL{gpu="1",UUID="GPU-11111111-1111-1111-1111-111111111111",pci_bus_id="00000000:2A:00.0",device="nvidia1",modelName="NVIDIA H100 80GB HBM3",Hostname="test-node",DCGM_FI_DRIVER_VERSION="570.172.08"} 30"#), "{text}");
    assert!(text.contains("DCGM_FI_DEV_FB_USED{"), "{text}");
    assert!(text.contains("DCGM_FI_PROF_SM_ACTIVE{"), "{text}");
    assert!(text.contains("# TYPE apron_gpu_busy_seconds_total counter"), "{text}");
    assert!(text.contains(r#"pid="4242",process_name="python""#), "{text}");

    let mut child = Command::new(&promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool runs");
    child.stdin.take().expect("stdin").write_all(text.as_bytes()).expect("write");
    let out = child.wait_with_output().expect("promtool");
    let report = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    // dcgm-exporter's camelCase labels are flagged by design; nothing else may be.
    let findings: Vec<&str> = report.lines().filter(|l| !l.trim().is_empty() && !l.starts_with("DCGM_FI_")).collect();
    assert!(findings.is_empty(), "promtool findings on native families:\n{report}");
    assert!(!report.contains("error"), "{report}");

    let (_, om) = http_get(agent.addr, "/metrics", Some("application/openmetrics-text;version=1.0.0"));
    assert!(om.ends_with("# EOF\n"), "OpenMetrics when asked for it");
}

#[test]
fn prometheus_scrapes_the_agent() {
    let prometheus = tool("prometheus");
    let lib = fake_lib("libnvidia_ml.so");
    let agent = Agent::start(&["--source", "nvml", "--nvml-lib", lib.to_str().expect("utf8")], Some(TWO_H100));
    agent.wait_windows(2);
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!("global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: apron-agent\n    static_configs:\n      - targets: ['{}']\n", agent.addr),
    )
    .expect("config");
    let port = std::net::TcpListener::bind("127.0.0.1:0").expect("free port").local_addr().expect("addr").port();
    let web = format!("127.0.0.1:{port}");
    let mut prom = Command::new(prometheus)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
        .arg(format!("--web.listen-address={web}"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("prom.log")).expect("log"))
        .spawn()
        .expect("prometheus starts");
    let addr: SocketAddr = web.parse().expect("addr");
    let query = |q: &str| -> Option<Vec<Value>> {
        let path = format!("/api/v1/query?query={}", urlencode(q));
        let (status, body) = std::panic::catch_unwind(|| http_get(addr, &path, None)).ok()?;
        if status != 200 {
            return None;
        }
        let v: Value = serde_json::from_str(&body).ok()?;
        let r = v["data"]["result"].as_array()?.clone();
        (!r.is_empty()).then_some(r)
    };
    let util = poll("DCGM_FI_DEV_GPU_UTIL in Prometheus", Duration::from_secs(60), || query("DCGM_FI_DEV_GPU_UTIL"));
    assert_eq!(util.len(), 2, "{util:?}");
    // Enough scrapes to fill the 10 s range (rate divides by the range, so a range
    // longer than the data would read low).
    let gpu1 = r#"{gpu_uuid="GPU-11111111-1111-1111-1111-111111111111"}"#;
    poll("15 scrapes", Duration::from_secs(90), || {
        let r = query(&format!("count_over_time(apron_gpu_busy_seconds_total{gpu1}[1m])"))?;
        let n: f64 = r[0]["value"][1].as_str()?.parse().ok()?;
        (n >= 15.0).then_some(())
    });
    let rate = query(&format!("rate(apron_gpu_busy_seconds_total{gpu1}[10s])")).expect("rate answers");
    let v: f64 = rate[0]["value"][1].as_str().and_then(|s| s.parse().ok()).expect("sample value");
    // GPU 1 is 30 % busy at every instant, so the busy-seconds rate is 0.30 whatever
    // the scrape alignment.
    assert!((v - 0.30).abs() < 0.04, "rate {v}");
    let _ = prom.kill();
    let _ = prom.wait();
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[test]
fn missing_library_is_one_clear_error() {
    let err = run_failing(&["--source", "nvml", "--nvml-lib", "/nonexistent/libnvidia-ml.so.1"], None);
    assert!(err.contains("/nonexistent/libnvidia-ml.so.1"), "{err}");
    assert!(err.contains("apron-agent --source sim"), "{err}");
    assert_eq!(err.trim().lines().filter(|l| l.starts_with("apron-agent:")).count(), 1, "{err}");
}

#[test]
fn driver_init_failure_is_reported() {
    let lib = fake_lib("libnvidia_ml.so");
    let err = run_failing(
        &["--source", "nvml", "--nvml-lib", lib.to_str().expect("utf8")],
        Some("init_error = \"DRIVER_NOT_LOADED\"\n"),
    );
    assert!(err.contains("nvmlInit failed"), "{err}");
    assert!(err.contains("--source sim"), "{err}");
}

#[test]
fn bad_config_names_the_key_and_the_range() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("agent.toml");
    std::fs::write(&path, "[agent]\nsource = \"sim\"\n[samplers]\nutilisation = \"100ms\"\n").expect("write");
    let err = run_failing(&["--config", path.to_str().expect("utf8")], None);
    assert!(err.contains("utilisation") && err.contains("agent.toml"), "{err}");

    std::fs::write(&path, "[agent]\nsource = \"sim\"\n[samplers]\ngpm = \"20ms\"\n").expect("write");
    let err = run_failing(&["--config", path.to_str().expect("utf8")], None);
    assert!(err.contains("samplers.gpm") && err.contains("20ms") && err.contains("between 110ms and 1h"), "{err}");

    let err = run_failing(&["--source", "sim", "--window", "0s"], None);
    assert!(err.contains("agent.window") && err.contains("between 100ms and 60s"), "{err}");
}

#[test]
fn lost_gpu_is_reported_while_others_are_served() {
    let lib = fake_lib("libnvidia_ml.so");
    let scenario = TWO_H100.replacen("index = 1\n", "index = 1\nlost_after_s = 1.5\n", 1);
    let agent = Agent::start(&["--source", "nvml", "--nvml-lib", lib.to_str().expect("utf8")], Some(&scenario));
    poll("GPU 1 lost", Duration::from_secs(20), || (agent.health()["lost_gpus"].as_u64()? == 1).then_some(()));
    let windows_then = agent.health()["windows"].as_u64().expect("windows");
    agent.wait_windows(windows_then + 4);
    let text = agent.metrics();
    assert!(text.contains(r#"apron_gpu_lost{gpu_uuid="GPU-11111111-1111-1111-1111-111111111111""#), "{text}");
    let lost_line = text.lines().find(|l| l.starts_with("apron_gpu_lost{gpu_uuid=\"GPU-1111")).expect("lost line");
    assert_eq!(sample_value(lost_line), 1.0, "{lost_line}");
    assert!(text.contains(r#"DCGM_FI_DEV_GPU_UTIL{gpu="0""#), "GPU 0 still served:\n{text}");
    assert!(!text.contains(r#"DCGM_FI_DEV_GPU_UTIL{gpu="1""#), "a lost GPU has no values");
    let stderr = agent.stop();
    assert!(stderr.contains("GPU is lost"), "{stderr}");
}

#[test]
fn missing_symbols_and_unsupported_fields_leave_fields_null() {
    // The legacy library lacks the GPM symbols and nvmlDeviceGetSamples, as drivers
    // before R520 do; GPU 1 also answers NOT_SUPPORTED for power.
    let lib = fake_lib("libnvidia_ml_legacy.so");
    let scenario = TWO_H100.replacen("index = 1\n", "index = 1\nunsupported = [\"nvmlDeviceGetPowerUsage\"]\n", 1);
    let agent = Agent::start(&["--source", "nvml", "--nvml-lib", lib.to_str().expect("utf8")], Some(&scenario));
    agent.wait_windows(6);
    let text = agent.metrics();
    // Utilisation falls back to the point read.
    assert!(text.contains(r#"DCGM_FI_DEV_GPU_UTIL{gpu="1""#), "{text}");
    assert!(!text.contains("DCGM_FI_PROF_SM_ACTIVE{"), "no GPM, no SM activity:\n{text}");
    assert!(text.contains(r#"DCGM_FI_DEV_POWER_USAGE{gpu="0""#), "{text}");
    assert!(!text.contains(r#"DCGM_FI_DEV_POWER_USAGE{gpu="1""#), "{text}");
    assert!(
        text.contains(
            r#"apron_agent_unsupported{sampler="power",call="nvmlDeviceGetPowerUsage",gpu_uuid="GPU-11111111"#
        ),
        "{text}"
    );
    assert!(text.contains(r#"apron_agent_unsupported{sampler="gpm""#), "{text}");
    assert!(text.contains(r#"apron_agent_sampler_up{sampler="memory"} 1"#), "{text}");
    let stderr = agent.stop();
    assert_eq!(stderr.matches("nvmlDeviceGetPowerUsage").count(), 1, "reported once:\n{stderr}");
}

#[test]
fn sim_source_serves_a_fleet_with_attribution() {
    let agent = Agent::start(&["--source", "sim"], None);
    agent.wait_windows(16);
    poll("process metrics", Duration::from_secs(20), || {
        agent.metrics().contains("apron_gpu_process_memory_bytes{").then_some(())
    });
    let text = agent.metrics();
    assert!(text.contains("DCGM_FI_DEV_GPU_UTIL{"), "{text}");
    assert!(text.contains(r#"apron_agent_build_info{version=""#) && text.contains(r#"source="sim""#), "{text}");
    // Pods come from the simulator's pod-resources answers and cgroup paths, through
    // the same attribution code as a real host.
    assert!(text.lines().any(|l| l.starts_with("apron_gpu_process_memory_bytes{") && l.contains("pod=")), "{text}");
}

#[test]
fn mig_instances_and_older_architectures() {
    let lib = fake_lib("libnvidia_ml.so");
    let agent = Agent::start(
        &["--source", "nvml", "--nvml-lib", lib.to_str().expect("utf8")],
        Some(&scenario_file("mixed.toml")),
    );
    agent.wait_windows(12);
    poll("process metrics", Duration::from_secs(15), || {
        agent.metrics().contains("apron_gpu_process_memory_bytes{").then_some(())
    });
    let text = agent.metrics();
    let lines = |prefix: &str| -> Vec<&str> { text.lines().filter(|l| l.starts_with(prefix)).collect() };

    // Each MIG instance is its own GPU: dcgm-exporter labels (parent UUID + GPU_I_*) …
    let sm = lines("DCGM_FI_PROF_SM_ACTIVE{");
    for (profile, gi) in [("3g.40gb", "2"), ("1g.10gb", "9")] {
        assert!(
            sm.iter().any(|l| l.contains(r#"UUID="GPU-9a8b7c6d-5e4f-4a3b-8c2d-1e0f9a8b7c6d""#)
                && l.contains(&format!(r#"GPU_I_PROFILE="{profile}",GPU_I_ID="{gi}""#))),
            "{profile}: {sm:?}"
        );
    }
    // … and native labels with its own UUID, parent and profile.
    assert!(text.contains(r#"apron_gpu_info{gpu_uuid="MIG-4f5e6d7c-8b9a-5a0b-9c1d-2e3f4a5b6c7d",gpu_index="1",gpu_model="NVIDIA H100 80GB HBM3",hostname="test-node",pci_bus_id="00000000:"#), "{text}");
    assert!(
        text.contains(r#"parent_gpu_uuid="GPU-9a8b7c6d-5e4f-4a3b-8c2d-1e0f9a8b7c6d",mig_profile="3g.40gb""#),
        "{text}"
    );
    // MIG memory is the instance's own.
    let fb = lines("apron_gpu_memory_total_bytes{gpu_uuid=\"MIG-1a2b");
    assert!(fb.len() == 1 && sample_value(fb[0]) == 9856.0 * 1048576.0, "{fb:?}");
    // Processes are attributed to the instance they run on.
    assert!(text.contains(r#"apron_gpu_process_memory_bytes{gpu_uuid="MIG-1a2b3c4d-5e6f-5a7b-8c9d-0e1f2a3b4c5d",hostname="test-node",pid="8201",process_name="jupyter-kernel""#), "{text}");

    // Ampere and Ada have no GPM: utilisation yes, SM activity no.
    for uuid in ["GPU-0f1e2d3c-4b5a-6978-8a9b-0c1d2e3f4a5b", "GPU-3c2b1a09-8f7e-4d6c-9b5a-4f3e2d1c0b9a"] {
        assert!(lines("DCGM_FI_DEV_GPU_UTIL{").iter().any(|l| l.contains(uuid)), "{uuid} util");
        assert!(!sm.iter().any(|l| l.contains(uuid) && !l.contains("GPU_I_ID")), "{uuid} has no GPM");
    }
    // The L4 has no NVLink.
    assert!(!lines("apron_gpu_nvlink_transmit_bytes_per_second{").iter().any(|l| l.contains("GPU-3c2b1a09")), "{text}");
    // NVLink on the A100 comes from the field-value counters (no GPM there).
    assert!(lines("apron_gpu_nvlink_transmit_bytes_per_second{").iter().any(|l| l.contains("GPU-0f1e2d3c")), "{text}");
}

#[test]
fn processes_are_attributed_through_procfs_and_slurm_files() {
    let lib = fake_lib("libnvidia_ml.so");
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("agent.toml");
    std::fs::write(
        &config,
        format!(
            "[samplers]\nprocesses = \"1s\"\n[attribution]\nproc_root = {:?}\npasswd_path = {:?}\napron_slurm_dir = {:?}\nslurm_gpu_dir = {:?}\npod_resources_socket = {:?}\n",
            fixture("proc"),
            fixture("etc/passwd"),
            fixture("run/apron/slurm"),
            fixture("run/gpustat"),
            dir.path().join("no-kubelet.sock").display().to_string(),
        ),
    )
    .expect("config");
    // PID 1001 is in a Kubernetes container (alice), PID 2002 in Slurm job 5150 (bob).
    let scenario = TWO_H100
        .replace(
            r#"processes = [ { pid = 4242, name = "python", used_memory_mib = 900 } ]"#,
            r#"processes = [ { pid = 1001, name = "python", used_memory_mib = 900 } ]"#,
        )
        .replacen(
            "idle = { gpu_util = 30,",
            "processes = [ { pid = 2002, name = \"train.py\", used_memory_mib = 18000 } ]\nidle = { gpu_util = 30,",
            1,
        );
    let agent = Agent::start(
        &["--config", config.to_str().expect("utf8"), "--source", "nvml", "--nvml-lib", lib.to_str().expect("utf8")],
        Some(&scenario),
    );
    let text = poll("attributed processes", Duration::from_secs(20), || {
        let t = agent.metrics();
        (t.contains(r#"pid="1001""#) && t.contains(r#"pid="2002""#)).then_some(t)
    });
    let line = |pid: &str| {
        text.lines()
            .find(|l| l.starts_with("apron_gpu_process_memory_bytes{") && l.contains(&format!(r#"pid="{pid}""#)))
            .expect("process line")
            .to_owned()
    };
    let alice = line("1001");
    assert!(alice.contains(r#"user="alice""#) && sample_value(&alice) == 900.0 * 1048576.0, "{alice}");
    let bob = line("2002");
    assert!(bob.contains(r#"user="bob""#) && bob.contains(r#"job_id="5150""#), "{bob}");
}

#[test]
fn environment_overrides_and_no_gpus() {
    // APRON_* variables stand in for flags.
    let out = Command::new(AGENT)
        .env("APRON_SOURCE", "sim")
        .env("APRON_WINDOW", "7s")
        .args(["--listen", "127.0.0.1:0"])
        .output()
        .expect("runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("agent.window") && err.contains("\"7s\""), "{err}");

    let lib = fake_lib("libnvidia_ml.so");
    let err = run_failing(
        &["--source", "nvml", "--nvml-lib", lib.to_str().expect("utf8")],
        Some("driver_version = \"570.172.08\"\n"),
    );
    assert!(err.contains("found no GPUs") && err.contains("--source sim"), "{err}");
}

#[test]
fn probe_reports_support_and_call_cost() {
    let lib = fake_lib("libnvidia_ml.so");
    let dir = tempfile::tempdir().expect("tempdir");
    let scenario = format!(
        "latency_mode = \"sleep\"\n{}",
        TWO_H100.replacen("[[gpus]]", "[latency_us]\nnvmlDeviceGetPowerUsage = 3000\n\n[[gpus]]", 1).replacen(
            "index = 1\n",
            "index = 1\nunsupported = [\"nvmlDeviceGetTemperature\"]\n",
            1
        )
    );
    let path = dir.path().join("scenario.toml");
    std::fs::write(&path, scenario).expect("write");
    let out = Command::new(AGENT)
        .args(["--nvml-lib", lib.to_str().expect("utf8"), "probe", "--repeats", "3", "--json"])
        .env("FAKE_NVML_SCENARIO", &path)
        .output()
        .expect("runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: Value = serde_json::from_slice(&out.stdout).expect("JSON report");
    let call = |gpu: &str, name: &str| -> Value {
        report["calls"]
            .as_array()
            .expect("calls")
            .iter()
            .find(|c| c["gpu_uuid"].as_str().is_some_and(|g| g.starts_with(gpu)) && c["call"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("{name} on {gpu} missing"))
    };
    let power = call("GPU-0", "nvmlDeviceGetPowerUsage");
    assert_eq!(power["outcome"], "ok");
    assert!(power["min_us"].as_f64().expect("min") >= 3000.0, "{power}");
    assert_eq!(call("GPU-0", "nvmlDeviceGetTemperature")["outcome"], "ok");
    assert!(
        call("GPU-1", "nvmlDeviceGetTemperature")["outcome"]
            .as_str()
            .expect("outcome")
            .contains("not available on the target device")
    );
    assert_eq!(call("GPU-0", "nvmlGpmQueryDeviceSupport")["value"], "true");
    assert_eq!(call("GPU-0", "nvmlGpmMetricsGet")["outcome"], "ok");
}

// ---------------------------------------------------------------------------------------
// Shipping to the collector: a fake collector in the test records every request.
// ---------------------------------------------------------------------------------------

mod fake_collector {
    use std::collections::HashSet;
    use std::net::SocketAddr;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use apron_common::wire::{self, Table};
    use arrow_array::cast::AsArray;
    use arrow_array::types::TimestampMicrosecondType;
    use axum::body::Bytes;
    use axum::extract::State;
    use axum::http::{HeaderMap, StatusCode};
    use axum::response::{IntoResponse, Response};

    pub const TOKEN: &str = "test-token-0123";

    /// One request as the fake collector saw it.
    #[derive(Clone, Debug)]
    pub struct Received {
        pub table: String,
        pub agent: String,
        pub epoch: String,
        pub seq: u64,
        pub authorization: String,
        pub content_type: String,
        pub status: u16,
        /// The collector already had (epoch, seq): a retry.
        pub duplicate: bool,
        pub rows: usize,
        /// gpu_samples: (gpu_uuid, time µs) of every row.
        pub windows: Vec<(String, i64)>,
    }

    #[derive(Clone, Default)]
    struct Shared {
        log: Arc<Mutex<Vec<Received>>>,
        seen: Arc<Mutex<HashSet<(String, u64)>>>,
        /// Answer 422 to every batch of this table.
        reject_table: Option<&'static str>,
    }

    /// A collector speaking the ingest protocol (docs/ingest.md), acknowledging on
    /// receipt and deduplicating on (epoch, sequence). `stop` closes the listener, so
    /// the agent gets connection refused; `restart` listens on the same port again.
    pub struct FakeCollector {
        rt: tokio::runtime::Runtime,
        pub addr: SocketAddr,
        shared: Shared,
        running: Option<(tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<()>)>,
    }

    impl FakeCollector {
        pub fn start(reject_table: Option<&'static str>) -> FakeCollector {
            let rt =
                tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("runtime");
            let shared = Shared { reject_table, ..Default::default() };
            let mut f = FakeCollector { rt, addr: "127.0.0.1:0".parse().expect("addr"), shared, running: None };
            f.listen();
            f
        }

        pub fn url(&self) -> String {
            format!("http://{}", self.addr)
        }

        fn listen(&mut self) {
            let listener = self.rt.block_on(tokio::net::TcpListener::bind(self.addr)).expect("bind");
            self.addr = listener.local_addr().expect("addr");
            let router = axum::Router::new()
                .route("/api/v1/ingest", axum::routing::post(ingest))
                .with_state(self.shared.clone());
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            let task = self.rt.spawn(async move {
                let _ = axum::serve(listener, router)
                    .with_graceful_shutdown(async move {
                        let _ = rx.await;
                    })
                    .await;
            });
            self.running = Some((tx, task));
        }

        pub fn stop(&mut self) {
            if let Some((tx, task)) = self.running.take() {
                let _ = tx.send(());
                let abort = task.abort_handle();
                if self.rt.block_on(async { tokio::time::timeout(Duration::from_secs(5), task).await }).is_err() {
                    abort.abort();
                }
            }
        }

        pub fn restart(&mut self) {
            self.listen();
        }

        pub fn requests(&self) -> Vec<Received> {
            self.shared.log.lock().expect("lock").clone()
        }

        /// Requests stored (2xx, not duplicates), in arrival order.
        pub fn stored(&self) -> Vec<Received> {
            self.requests().into_iter().filter(|r| r.status == 200 && !r.duplicate).collect()
        }

        pub fn stored_of(&self, table: &str) -> usize {
            self.stored().iter().filter(|r| r.table == table).count()
        }
    }

    impl Drop for FakeCollector {
        fn drop(&mut self) {
            self.stop();
        }
    }

    fn error(status: StatusCode, error: &str, detail: &str) -> Response {
        (status, axum::Json(serde_json::json!({ "error": error, "detail": detail }))).into_response()
    }

    async fn ingest(State(shared): State<Shared>, headers: HeaderMap, body: Bytes) -> Response {
        let h = |k: &str| headers.get(k).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
        let mut r = Received {
            table: h(wire::headers::TABLE),
            agent: h(wire::headers::AGENT),
            epoch: h(wire::headers::EPOCH),
            seq: h(wire::headers::SEQUENCE).parse().unwrap_or(0),
            authorization: h("authorization"),
            content_type: h("content-type"),
            status: 200,
            duplicate: false,
            rows: 0,
            windows: Vec::new(),
        };
        let record = |r: Received| shared.log.lock().expect("lock").push(r);
        if r.authorization != format!("Bearer {TOKEN}") {
            record(Received { status: 401, ..r });
            return error(StatusCode::UNAUTHORIZED, "unauthorized", "bad token");
        }
        let Some(table) = Table::from_name(&r.table) else {
            record(Received { status: 400, ..r });
            return error(StatusCode::BAD_REQUEST, "bad request", "unknown table");
        };
        if shared.reject_table == Some(table.name()) {
            record(Received { status: 422, ..r });
            return error(StatusCode::UNPROCESSABLE_ENTITY, "wrong schema", "injected by the test for this table");
        }
        let batches = match wire::decode_ipc(&body, table, 1_000_000) {
            Ok(b) => b,
            Err(e) => {
                record(Received { status: 400, ..r });
                return error(StatusCode::BAD_REQUEST, "malformed", &e.to_string());
            }
        };
        for b in &batches {
            r.rows += b.num_rows();
            if table == Table::GpuSamples {
                let uuid = b.column_by_name("gpu_uuid").expect("gpu_uuid").as_string::<i32>();
                let time = b.column_by_name("time").expect("time").as_primitive::<TimestampMicrosecondType>();
                for i in 0..b.num_rows() {
                    r.windows.push((uuid.value(i).to_owned(), time.value(i)));
                }
            }
        }
        r.duplicate = !shared.seen.lock().expect("lock").insert((r.epoch.clone(), r.seq));
        let body = serde_json::json!({ "rows": r.rows, "duplicate": r.duplicate });
        record(r);
        (StatusCode::OK, axum::Json(body)).into_response()
    }
}

use fake_collector::{FakeCollector, TOKEN};

/// Starts the agent with extra environment variables.
fn start_agent_env(args: &[&str], env: &[(&str, &str)]) -> Agent {
    let dir = tempfile::tempdir().expect("tempdir");
    let stderr = dir.path().join("stderr.log");
    let mut cmd = Command::new(AGENT);
    cmd.args(args)
        .args(["--listen", "127.0.0.1:0", "--hostname", "test-node"])
        .envs(env.iter().copied())
        .stderr(std::fs::File::create(&stderr).expect("stderr file"));
    let (child, addr, _) = spawn_listening(&mut cmd, "the agent", &stderr);
    Agent { child, addr, stderr, _dir: dir }
}

/// A simulated fleet that ships every second with fast retries; `collector: None`
/// leaves it to `--collector`, `token: false` to `APRON_COLLECTOR_TOKEN`.
fn ship_config(dir: &Path, collector: Option<&str>, token: bool, extra: &str) -> PathBuf {
    let mut text = String::from("[agent]\nsource = \"sim\"\n");
    if let Some(c) = collector {
        text += &format!("collector = {c:?}\n");
    }
    text += "[samplers]\nprocesses = \"1s\"\n[shipper]\n";
    if token {
        text += &format!("token = {TOKEN:?}\n");
    }
    text += &format!(
        "spool_dir = {:?}\nflush_interval = \"1s\"\nrequest_timeout = \"2s\"\nmax_backoff = \"1s\"\n{extra}",
        spool_dir(dir).display().to_string()
    );
    let path = dir.join("agent.toml");
    std::fs::write(&path, text).expect("write config");
    path
}

fn spool_dir(dir: &Path) -> PathBuf {
    dir.join("spool")
}

/// `*.arrows` files in a directory, sorted (= send order).
fn spool_files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| rd.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect())
        .unwrap_or_default();
    v.retain(|n| n.ends_with(".arrows"));
    v.sort();
    v
}

/// (epoch, sequence) of a spool file name `<epoch>-<seq>.<table>.arrows`.
fn spool_key(name: &str) -> (String, u64) {
    let stem = name.split('.').next().expect("stem");
    let (epoch, seq) = stem.rsplit_once('-').expect("epoch-seq");
    (epoch.to_owned(), seq.parse().expect("sequence"))
}

/// The sum of a family's samples (all label sets), `None` when absent.
fn metric(text: &str, name: &str) -> Option<f64> {
    let values: Vec<f64> = text
        .lines()
        .filter(|l| l.strip_prefix(name).is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{')))
        .map(sample_value)
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

/// A loopback URL where nothing listens.
fn closed_port_url() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    drop(l);
    format!("http://{addr}")
}

#[test]
fn ships_both_tables_with_headers_token_and_sequences() {
    let fake = FakeCollector::start(None);
    let dir = tempfile::tempdir().expect("tempdir");
    let config = ship_config(dir.path(), None, false, "");
    let windows_out = dir.path().join("windows.jsonl");
    let agent = start_agent_env(
        &[
            "--config",
            config.to_str().expect("utf8"),
            "--source",
            "sim",
            "--collector",
            &fake.url(),
            "--windows-out",
            windows_out.to_str().expect("utf8"),
        ],
        &[("APRON_COLLECTOR_TOKEN", TOKEN)],
    );
    poll("both tables shipped", Duration::from_secs(15), || {
        (fake.stored_of("gpu_samples") >= 3 && fake.stored_of("gpu_processes") >= 1).then_some(())
    });
    let text = agent.metrics();
    assert!(metric(&text, "apron_agent_ship_batches_total").expect("ship metrics") >= 4.0, "{text}");
    assert!(text.contains("apron_agent_ship_last_success_time_seconds "), "{text}");
    assert_eq!(metric(&text, "apron_agent_ship_collector_up"), Some(1.0));
    let stderr = agent.stop();

    let reqs = fake.requests();
    assert!(reqs.iter().all(|r| r.status == 200 && !r.duplicate), "{reqs:?}\n{stderr}");
    let epoch = &reqs[0].epoch;
    assert_eq!(epoch.len(), 36, "a UUID: {epoch}");
    for r in &reqs {
        assert_eq!(r.authorization, format!("Bearer {TOKEN}"));
        assert_eq!(r.content_type, "application/vnd.apache.arrow.stream");
        assert_eq!(r.agent, "test-node", "the host name is the default agent id");
        assert_eq!(&r.epoch, epoch, "one epoch per process");
        assert!(r.rows > 0, "no empty requests: {r:?}");
    }
    // One counter for both tables, from 1, one per request, nothing skipped.
    let seqs: Vec<u64> = reqs.iter().map(|r| r.seq).collect();
    assert_eq!(seqs, (1..=reqs.len() as u64).collect::<Vec<_>>());
    // Everything closed was shipped, the last flush at shutdown included.
    let mut closed: Vec<(String, i64)> = windows(&windows_out)
        .iter()
        .map(|w| (w["gpu"]["gpu_uuid"].as_str().expect("uuid").to_owned(), w["time"].as_i64().expect("time")))
        .collect();
    let mut shipped: Vec<(String, i64)> = reqs.iter().flat_map(|r| r.windows.clone()).collect();
    closed.sort();
    shipped.sort();
    assert_eq!(shipped, closed);
}

#[test]
fn collector_outage_spools_then_delivers_everything_once_in_order() {
    let mut fake = FakeCollector::start(None);
    let dir = tempfile::tempdir().expect("tempdir");
    let config = ship_config(dir.path(), Some(&fake.url()), true, "");
    let windows_out = dir.path().join("windows.jsonl");
    let agent = Agent::start(
        &["--config", config.to_str().expect("utf8"), "--windows-out", windows_out.to_str().expect("utf8")],
        None,
    );
    poll("first batches", Duration::from_secs(10), || (fake.stored_of("gpu_samples") >= 2).then_some(()));

    fake.stop();
    let before = fake.requests().len();
    poll("batches spooled during the outage", Duration::from_secs(15), || {
        let text = agent.metrics();
        (metric(&text, "apron_agent_spool_files")? >= 4.0 && metric(&text, "apron_agent_ship_retries_total")? >= 1.0)
            .then_some(())
    });
    assert!(!spool_files(&spool_dir(dir.path())).is_empty());
    assert_eq!(metric(&agent.metrics(), "apron_agent_ship_collector_up"), Some(0.0));

    fake.restart();
    poll("spool drained", Duration::from_secs(15), || {
        let text = agent.metrics();
        (metric(&text, "apron_agent_spool_files")? == 0.0 && fake.requests().len() > before + 4).then_some(())
    });
    let stderr = agent.stop();
    assert!(stderr.contains("spooling to") && stderr.contains("collector reachable again"), "{stderr}");

    let stored = fake.stored();
    // Sent in order: sequence numbers strictly increase in arrival order, and so do
    // the windows' times.
    for pair in stored.windows(2) {
        assert!(pair[0].seq < pair[1].seq, "out of order: {} then {}", pair[0].seq, pair[1].seq);
    }
    let times: Vec<i64> = stored.iter().flat_map(|r| r.windows.iter().map(|w| w.1)).collect();
    assert!(times.windows(2).all(|t| t[0] <= t[1]), "window times go backwards");
    // Every window the agent closed arrived exactly once.
    let mut closed: Vec<(String, i64)> = windows(&windows_out)
        .iter()
        .map(|w| (w["gpu"]["gpu_uuid"].as_str().expect("uuid").to_owned(), w["time"].as_i64().expect("time")))
        .collect();
    let mut shipped: Vec<(String, i64)> = stored.iter().flat_map(|r| r.windows.clone()).collect();
    closed.sort();
    shipped.sort();
    assert_eq!(shipped.len(), closed.len(), "{stderr}");
    assert_eq!(shipped, closed);
    assert!(spool_files(&spool_dir(dir.path())).is_empty());
}

#[test]
fn full_spool_drops_the_oldest_batches_and_counts_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    let max = 64 * 1024;
    let config = ship_config(dir.path(), Some(&closed_port_url()), true, "spool_max_bytes = \"64KiB\"\n");
    let agent = Agent::start(&["--config", config.to_str().expect("utf8")], None);
    let text = poll("batches dropped from the full spool", Duration::from_secs(20), || {
        let text = agent.metrics();
        (metric(&text, "apron_agent_spool_dropped_batches_total")? >= 3.0).then_some(text)
    });
    assert!(metric(&text, "apron_agent_spool_dropped_rows_total").expect("rows") > 0.0, "{text}");
    assert!(metric(&text, "apron_agent_spool_bytes").expect("bytes") <= max as f64, "{text}");
    let spool = spool_dir(dir.path());
    let files = spool_files(&spool);
    let on_disk: u64 = files.iter().map(|f| std::fs::metadata(spool.join(f)).map_or(0, |m| m.len())).sum();
    assert!(on_disk <= max, "{on_disk} bytes on disk");
    assert!(files.len() >= 2, "the spool still holds the newest batches: {files:?}");
    // The oldest went first: the first batches of this run are gone, the latest kept.
    let seqs: Vec<u64> = files.iter().map(|f| spool_key(f).1).collect();
    assert!(seqs[0] > 1, "{seqs:?}");
    assert!(metric(&text, "apron_agent_ship_batches_total").unwrap_or(0.0) == 0.0);
    agent.stop();
}

#[test]
fn rejected_batches_move_aside_and_shipping_goes_on() {
    let fake = FakeCollector::start(Some("gpu_processes"));
    let dir = tempfile::tempdir().expect("tempdir");
    let config = ship_config(dir.path(), Some(&fake.url()), true, "");
    let agent = Agent::start(&["--config", config.to_str().expect("utf8")], None);
    poll("rejections counted while samples keep flowing", Duration::from_secs(15), || {
        let text = agent.metrics();
        (metric(&text, "apron_agent_ship_rejected_batches_total")? >= 2.0 && fake.stored_of("gpu_samples") >= 4)
            .then_some(())
    });
    let rejected = spool_dir(dir.path()).join("rejected");
    let files = spool_files(&rejected);
    assert!(files.len() >= 2 && files.iter().all(|f| f.ends_with(".gpu_processes.arrows")), "{files:?}");
    let reason = std::fs::read_to_string(rejected.join(format!("{}.error", files[0]))).expect("reason file");
    assert!(reason.contains("422") && reason.contains("injected by the test"), "{reason}");
    // A rejected batch is not retried.
    let procs: Vec<u64> = fake.requests().iter().filter(|r| r.table == "gpu_processes").map(|r| r.seq).collect();
    let unique: std::collections::HashSet<_> = procs.iter().collect();
    assert_eq!(unique.len(), procs.len(), "{procs:?}");
    let stderr = agent.stop();
    assert_eq!(stderr.matches("refused a batch for good").count(), 1, "logged once per status:\n{stderr}");
    assert!(stderr.contains("injected by the test"), "{stderr}");
}

#[test]
fn a_restarted_agent_drains_the_previous_runs_spool_first() {
    let dir = tempfile::tempdir().expect("tempdir");
    let spool = spool_dir(dir.path());
    let down = closed_port_url();
    let config = ship_config(dir.path(), Some(&down), true, "");
    let first = Agent::start(&["--config", config.to_str().expect("utf8")], None);
    poll("spooled batches", Duration::from_secs(15), || (spool_files(&spool).len() >= 3).then_some(()));
    first.stop();
    let left: Vec<(String, u64)> = spool_files(&spool).iter().map(|f| spool_key(f)).collect();
    assert!(left.len() >= 3);
    let old_epoch = left[0].0.clone();

    let fake = FakeCollector::start(None);
    let config = ship_config(dir.path(), Some(&fake.url()), true, "");
    let second = Agent::start(&["--config", config.to_str().expect("utf8")], None);
    poll("old spool drained and new batches shipped", Duration::from_secs(15), || {
        let stored = fake.stored();
        let new = stored.iter().filter(|r| r.epoch != old_epoch).count();
        (spool_files(&spool).is_empty() && new >= 2).then_some(())
    });
    second.stop();
    let stored: Vec<(String, u64)> = fake.stored().iter().map(|r| (r.epoch.clone(), r.seq)).collect();
    // The earlier run's batches, with their own epoch and sequence numbers, all came
    // first and in order; then the new epoch from 1.
    assert_eq!(&stored[..left.len()], &left[..]);
    assert!(stored[left.len()..].iter().all(|(e, _)| *e != old_epoch), "{stored:?}");
    assert_eq!(stored[left.len()].1, 1, "{stored:?}");
}

/// deploy/slurm's prolog and epilog under a real single-node Slurm (`tests/slurm/run.sh`:
/// munged, slurmctld and slurmd from Debian's `slurm-wlm` and `munge`, two GRES GPUs
/// backed by dummy device files): a 2-GPU job submitted by `nobody` makes the prolog write
/// one file per mapped GPU UUID with the job's id, user, account and partition; this
/// agent, on a fake NVML with the same UUIDs, attributes both GPUs' processes to the job;
/// after the job the epilog has removed the files and the attribution is gone. Needs
/// root; without it, or without the tools, it prints a NOTE and passes, except under
/// `APRON_REQUIRE_TOOLS=1` (CI), where that is a failure.
#[test]
fn slurm_prolog_epilog_under_real_slurm() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/slurm/run.sh");
    let lib = fake_lib("libnvidia_ml.so");
    let out = Command::new("bash")
        .arg(&script)
        .env("APRON_AGENT", AGENT)
        .env("APRON_FAKE_NVML", &lib)
        .stdin(Stdio::null())
        .output()
        .expect("bash runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let required = std::env::var("APRON_REQUIRE_TOOLS").is_ok_and(|v| v == "1");
    if out.status.code() == Some(77) && !required {
        eprintln!("{}", stdout.trim());
        return;
    }
    assert!(out.status.success(), "tests/slurm/run.sh failed ({}):\n{stdout}\n{stderr}", out.status);
    assert!(stdout.contains("PASS: apron-prolog.sh / apron-epilog.sh under real Slurm"), "{stdout}");

    let job = stdout
        .lines()
        .find_map(|l| l.strip_prefix("OK: submitted job ")?.split_whitespace().next())
        .unwrap_or_else(|| panic!("no job id in:\n{stdout}"))
        .to_owned();
    let uuids = ["GPU-00000000-0000-0000-0000-000000000000", "GPU-11111111-1111-1111-1111-111111111111"];
    // The prolog's files, as the script printed them while the job ran.
    for uuid in uuids {
        let file: Vec<&str> = stdout
            .lines()
            .skip_while(|l| *l != format!("---- {uuid}"))
            .skip(1)
            .take_while(|l| !l.starts_with("---- ") && !l.starts_with("OK: "))
            .collect();
        for want in [
            format!("job_id={job}"),
            "user=nobody".into(),
            "account=ml-research".into(),
            "partition=gpu".into(),
            format!("gpu_uuid={uuid}"),
        ] {
            assert!(file.contains(&want.as_str()), "{uuid}'s file lacks {want}: {file:?}\n{stdout}");
        }
    }
    // The agent saw the job while it ran, on both GPUs, and not after.
    let during: Vec<&str> = stdout.lines().filter(|l| l.starts_with("apron_gpu_process_memory_bytes{")).collect();
    for uuid in uuids {
        assert!(
            during.iter().any(|l| l.contains(uuid)
                && l.contains(&format!(r#"job_id="{job}""#))
                && l.contains(r#"user="nobody""#)),
            "no process of {uuid} attributed to job {job}:\n{stdout}"
        );
    }
    let after = stdout.lines().find(|l| l.starts_with("OK: agent /metrics after the job: ")).expect("after line");
    assert!(!after.contains("job_id="), "{after}");
    assert!(stdout.contains("the epilog removed both files"), "{stdout}");
}

/// A stand-in for the Kubernetes API server: answers every request with a recorded
/// response (the node's PodList, or a 403 Status while `forbid` is set) and records each
/// request's target and `Authorization` header.
#[cfg(feature = "kubernetes")]
mod fake_api_server {
    use std::io::{BufRead, BufReader, Write};
    use std::net::{SocketAddr, TcpListener};
    use std::path::Path;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Debug)]
    pub struct Seen {
        pub target: String,
        pub authorization: Option<String>,
    }

    pub struct FakeApiServer {
        pub addr: SocketAddr,
        pub forbid: Arc<AtomicBool>,
        pub seen: Arc<Mutex<Vec<Seen>>>,
    }

    fn recorded(name: &str) -> Vec<u8> {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/k8s").join(name);
        std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    impl FakeApiServer {
        pub fn start() -> Self {
            let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
            let addr = listener.local_addr().expect("addr");
            let forbid = Arc::new(AtomicBool::new(false));
            let seen = Arc::new(Mutex::new(Vec::new()));
            let (pods, denied) = (recorded("podlist-node.json"), recorded("forbidden.json"));
            let (f, s) = (forbid.clone(), seen.clone());
            std::thread::spawn(move || {
                for stream in listener.incoming() {
                    let Ok(mut stream) = stream else { continue };
                    let mut reader = BufReader::new(stream.try_clone().expect("clone"));
                    let mut line = String::new();
                    if reader.read_line(&mut line).is_err() {
                        continue;
                    }
                    let target = line.split(' ').nth(1).unwrap_or_default().to_owned();
                    let mut authorization = None;
                    loop {
                        let mut h = String::new();
                        if reader.read_line(&mut h).unwrap_or(0) == 0 || h == "\r\n" {
                            break;
                        }
                        if let Some((name, value)) = h.split_once(':')
                            && name.eq_ignore_ascii_case("authorization")
                        {
                            authorization = Some(value.trim().to_owned());
                        }
                    }
                    s.lock().expect("lock").push(Seen { target, authorization });
                    let (status, body) =
                        if f.load(Ordering::SeqCst) { ("403 Forbidden", &denied) } else { ("200 OK", &pods) };
                    let head = format!(
                        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                        body.len()
                    );
                    let _ = stream.write_all(head.as_bytes()).and_then(|()| stream.write_all(body));
                }
            });
            Self { addr, forbid, seen }
        }

        pub fn seen(&self) -> Vec<Seen> {
            self.seen.lock().expect("lock").clone()
        }
    }
}

/// The real agent on the fake NVML, with the fake kubelet (pod-resources) and a fake API
/// server: every closed window names its GPU's holder and the holder's labels; a 403 is
/// reported once, counted, and sampling goes on.
#[cfg(feature = "kubernetes")]
#[test]
fn windows_carry_owners_and_pod_labels_from_the_api_server() {
    use std::sync::atomic::Ordering;

    use apron_agent::attribution::fake_kubelet::FakeKubelet;

    let lib = fake_lib("libnvidia_ml.so");
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("kubelet.sock");
    let _kubelet = FakeKubelet::start_at(
        &socket,
        &[
            (
                "kubeflow-alice",
                "jupyter-alice-0",
                vec![("notebook", "nvidia.com/gpu", vec!["GPU-00000000-0000-0000-0000-000000000000"])],
            ),
            (
                "ml-research",
                "train-llama-7f9c4-0",
                vec![("trainer", "nvidia.com/gpu", vec!["GPU-11111111-1111-1111-1111-111111111111"])],
            ),
        ],
    )
    .expect("fake kubelet");
    let api = fake_api_server::FakeApiServer::start();
    api.forbid.store(true, Ordering::SeqCst);
    let token = dir.path().join("token");
    std::fs::write(&token, "test-sa-token\n").expect("token");
    let windows_out = dir.path().join("windows.jsonl");
    let config = dir.path().join("agent.toml");
    std::fs::write(
        &config,
        format!(
            "[agent]\nwindows_out = {:?}\n[samplers]\nprocesses = \"1s\"\n[attribution]\nproc_root = {:?}\npasswd_path = {:?}\n\
             apron_slurm_dir = {:?}\nslurm_gpu_dir = {:?}\npod_resources_socket = {:?}\n\
             [attribution.kubernetes]\napi_server = \"http://{}\"\ntoken_file = {:?}\nnode_name = \"test-node\"\nrefresh = \"1s\"\n",
            windows_out.display().to_string(),
            fixture("proc"),
            fixture("etc/passwd"),
            dir.path().join("no-slurm").display().to_string(),
            dir.path().join("no-gpustat").display().to_string(),
            socket.display().to_string(),
            api.addr,
            token.display().to_string(),
        ),
    )
    .expect("config");
    let agent = Agent::start(
        &["--config", config.to_str().expect("utf8"), "--source", "nvml", "--nvml-lib", lib.to_str().expect("utf8")],
        Some(TWO_H100),
    );

    // 403: counted, sampling goes on, windows still name the holder (without labels).
    poll("forbidden lists counted", Duration::from_secs(20), || {
        let text = agent.metrics();
        (metric(&text, r#"apron_agent_kubernetes_requests_total{result="forbidden"}"#)? >= 2.0).then_some(())
    });
    let before = agent.health()["windows"].as_u64().expect("windows");
    agent.wait_windows(before + 2);
    let owned = |labels: bool| {
        windows(&windows_out).into_iter().rev().find(|w| {
            w["gpu"]["gpu_uuid"] == "GPU-00000000-0000-0000-0000-000000000000"
                && w["owner"].is_object()
                && w["owner"]["pod_labels"].is_string() == labels
        })
    };
    let w = poll("a window with its owner", Duration::from_secs(20), || owned(false));
    assert_eq!(w["owner"]["kind"], "pod");
    assert_eq!(w["owner"]["owner"], "kubeflow-alice/jupyter-alice-0");
    assert_eq!(w["owner"]["container"], "notebook");

    // The API server recovers: labels arrive within a refresh.
    api.forbid.store(false, Ordering::SeqCst);
    let w = poll("a window with pod labels", Duration::from_secs(20), || owned(true));
    let labels: Value = serde_json::from_str(w["owner"]["pod_labels"].as_str().expect("text")).expect("JSON object");
    assert_eq!(labels["notebook-name"], "jupyter-alice", "Kubeflow labels pass through: {labels}");
    assert_eq!(labels["notebooks.kubeflow.org/server-type"], "jupyter", "chosen annotations too: {labels}");
    assert!(labels.get("kubectl.kubernetes.io/restartedAt").is_none(), "other annotations stay out: {labels}");
    let train = poll("the trainer's labels", Duration::from_secs(20), || {
        windows(&windows_out).into_iter().rev().find(|w| {
            w["gpu"]["gpu_uuid"] == "GPU-11111111-1111-1111-1111-111111111111" && w["owner"]["pod_labels"].is_string()
        })
    });
    assert_eq!(train["owner"]["owner"], "ml-research/train-llama-7f9c4-0");
    let labels: Value = serde_json::from_str(train["owner"]["pod_labels"].as_str().expect("text")).expect("JSON");
    assert_eq!(labels["team"], "vision");
    assert_eq!(labels["project"], "llm-pretrain");
    assert_eq!(labels["runai/project"], "vision-research");
    assert_eq!(labels["training.kubeflow.org/job-name"], "train-llama-7f9c4");

    let text = agent.metrics();
    assert!(metric(&text, r#"apron_agent_kubernetes_requests_total{result="ok"}"#).is_some_and(|v| v >= 1.0));
    assert_eq!(metric(&text, "apron_agent_kubernetes_pods"), Some(3.0));
    let seen = api.seen();
    assert!(seen.iter().all(|s| s.authorization.as_deref() == Some("Bearer test-sa-token")), "{seen:?}");
    assert!(
        seen.iter().all(|s| s.target == "/api/v1/pods?fieldSelector=spec.nodeName%3Dtest-node&resourceVersion=0"),
        "{seen:?}"
    );
    let stderr = agent.stop();
    assert_eq!(stderr.matches("403 Forbidden").count(), 1, "a persisting failure is logged once:\n{stderr}");
}
