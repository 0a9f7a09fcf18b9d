//! End-to-end: the `apron-agent` binary, built with the `otlp` feature, pushes its
//! metrics to a real OTLP receiver built here from `opentelemetry-proto` — a tonic
//! `MetricsService` server for OTLP/gRPC and an HTTP `POST /v1/metrics` handler for
//! OTLP/HTTP protobuf bodies. The agent runs the simulated fleet (2 hosts × 8 GPUs);
//! expectations come from its own `/metrics`. Servers bind port 0 and every wait is a
//! poll with a deadline.

#![cfg(feature = "otlp")]

use std::collections::{BTreeMap, BTreeSet};

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use apron_test_support::{http_get, poll, spawn_listening};
use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
use opentelemetry_proto::tonic::common::v1::{KeyValue, any_value};
use opentelemetry_proto::tonic::metrics::v1::{
    AggregationTemporality, Metric, NumberDataPoint, ResourceMetrics, metric, number_data_point,
};

const AGENT: &str = env!("CARGO_BIN_EXE_apron-agent");
const TOKEN: &str = "Bearer otlp-test-token";

mod receiver {
    use std::net::SocketAddr;
    use std::sync::{Arc, Mutex};

    use axum::body::Bytes;
    use axum::extract::State;
    use axum::http::{HeaderMap, StatusCode, header};
    use axum::response::{IntoResponse, Response};
    use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_server::{
        MetricsService, MetricsServiceServer,
    };
    use opentelemetry_proto::tonic::collector::metrics::v1::{
        ExportMetricsServiceRequest, ExportMetricsServiceResponse,
    };
    use prost::Message as _;
    use tonic::metadata::KeyAndValueRef;

    /// One request as the receiver saw it.
    #[derive(Clone, Debug)]
    pub struct Received {
        /// Request headers (gRPC metadata), names lower-case.
        pub headers: Vec<(String, String)>,
        /// The HTTP path (`/v1/metrics`), or the gRPC method.
        pub path: String,
        pub request: ExportMetricsServiceRequest,
    }

    type Log = Arc<Mutex<Vec<Received>>>;

    /// A receiver on 127.0.0.1, port 0, on its own runtime.
    pub struct Receiver {
        rt: tokio::runtime::Runtime,
        pub addr: SocketAddr,
        log: Log,
        stop: Option<tokio::sync::oneshot::Sender<()>>,
    }

    struct Grpc(Log);

    #[tonic::async_trait]
    impl MetricsService for Grpc {
        async fn export(
            &self,
            request: tonic::Request<ExportMetricsServiceRequest>,
        ) -> Result<tonic::Response<ExportMetricsServiceResponse>, tonic::Status> {
            let headers = request
                .metadata()
                .iter()
                .filter_map(|kv| match kv {
                    KeyAndValueRef::Ascii(k, v) => Some((k.as_str().to_owned(), v.to_str().ok()?.to_owned())),
                    KeyAndValueRef::Binary(..) => None,
                })
                .collect();
            let path = "opentelemetry.proto.collector.metrics.v1.MetricsService/Export".to_owned();
            self.0.lock().expect("lock").push(Received { headers, path, request: request.into_inner() });
            Ok(tonic::Response::new(ExportMetricsServiceResponse { partial_success: None }))
        }
    }

    async fn http_export(State(log): State<Log>, headers: HeaderMap, body: Bytes) -> Response {
        let Ok(request) = ExportMetricsServiceRequest::decode(body) else {
            return (StatusCode::BAD_REQUEST, "not an ExportMetricsServiceRequest").into_response();
        };
        let headers =
            headers.iter().filter_map(|(k, v)| Some((k.as_str().to_owned(), v.to_str().ok()?.to_owned()))).collect();
        log.lock().expect("lock").push(Received { headers, path: "/v1/metrics".into(), request });
        let answer = ExportMetricsServiceResponse { partial_success: None }.encode_to_vec();
        ([(header::CONTENT_TYPE, "application/x-protobuf")], answer).into_response()
    }

    impl Receiver {
        fn new() -> (Receiver, tokio::net::TcpListener, tokio::sync::oneshot::Receiver<()>) {
            let rt =
                tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("runtime");
            let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).expect("bind");
            let addr = listener.local_addr().expect("addr");
            let (tx, rx) = tokio::sync::oneshot::channel();
            (Receiver { rt, addr, log: Log::default(), stop: Some(tx) }, listener, rx)
        }

        /// OTLP/gRPC: `MetricsService/Export`.
        pub fn grpc() -> Receiver {
            let (r, listener, stop) = Self::new();
            let service = MetricsServiceServer::new(Grpc(r.log.clone()));
            r.rt.spawn(async move {
                let incoming = tonic::transport::server::TcpIncoming::from(listener);
                let _ = tonic::transport::Server::builder()
                    .serve_with_incoming_shutdown(service, incoming, async move {
                        let _ = stop.await;
                    })
                    .await;
            });
            r
        }

        /// OTLP/HTTP with protobuf bodies: `POST /v1/metrics`.
        pub fn http() -> Receiver {
            let (r, listener, stop) = Self::new();
            let router =
                axum::Router::new().route("/v1/metrics", axum::routing::post(http_export)).with_state(r.log.clone());
            r.rt.spawn(async move {
                let _ = axum::serve(listener, router)
                    .with_graceful_shutdown(async move {
                        let _ = stop.await;
                    })
                    .await;
            });
            r
        }

        pub fn url(&self) -> String {
            format!("http://{}", self.addr)
        }

        pub fn received(&self) -> Vec<Received> {
            self.log.lock().expect("lock").clone()
        }
    }

    impl Drop for Receiver {
        fn drop(&mut self) {
            if let Some(tx) = self.stop.take() {
                let _ = tx.send(());
            }
        }
    }
}

use receiver::{Received, Receiver};

struct Agent {
    child: Child,
    addr: SocketAddr,
    stderr: PathBuf,
    _dir: tempfile::TempDir,
}

impl Agent {
    /// The simulated fleet with `[otlp]` = `otlp` (TOML lines), serving on port 0.
    fn start(otlp: &str) -> Agent {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = dir.path().join("agent.toml");
        std::fs::write(&config, format!("[agent]\nsource = \"sim\"\n[samplers]\nprocesses = \"1s\"\n[otlp]\n{otlp}"))
            .expect("write config");
        let stderr = dir.path().join("stderr.log");
        let mut cmd = Command::new(AGENT);
        cmd.arg("--config")
            .arg(&config)
            .args(["--listen", "127.0.0.1:0", "--hostname", "test-node"])
            .stderr(std::fs::File::create(&stderr).expect("stderr file"));
        let (child, addr, _) = spawn_listening(&mut cmd, "the agent", &stderr);
        Agent { child, addr, stderr, _dir: dir }
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// SIGTERM, a clean exit; returns stderr.
    fn stop(mut self) -> String {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc_kill(self.child.id() as i32, 15) };
        let status = poll("agent exit", Duration::from_secs(15), || self.child.try_wait().ok().flatten());
        assert!(status.success(), "agent exited with {status}\n{}", self.stderr());
        self.stderr()
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

/// `gpu_uuid` → (hostname, gpu_model, framebuffer total bytes) from the agent's own
/// `/metrics`.
fn inventory(agent: &Agent) -> BTreeMap<String, (String, String, f64)> {
    let text = poll("framebuffer totals on /metrics", Duration::from_secs(30), || {
        let t = http_get(agent.addr, "/metrics", None).1;
        (t.matches("apron_gpu_memory_total_bytes{").count() >= 16).then_some(t)
    });
    let label = |line: &str, name: &str| -> String {
        let key = format!("{name}=\"");
        let start = line.find(&key).map(|i| i + key.len()).expect("label");
        line[start..].split('"').next().expect("value").to_owned()
    };
    let mut out = BTreeMap::new();
    for line in text.lines().filter(|l| l.starts_with("apron_gpu_memory_total_bytes{")) {
        let value: f64 = line.rsplit(' ').next().and_then(|v| v.parse().ok()).expect("sample value");
        out.insert(label(line, "gpu_uuid"), (label(line, "hostname"), label(line, "gpu_model"), value));
    }
    out
}

fn attr<'a>(attrs: &'a [KeyValue], key: &str) -> Option<&'a any_value::Value> {
    attrs.iter().find(|a| a.key == key)?.value.as_ref()?.value.as_ref()
}

fn str_attr<'a>(attrs: &'a [KeyValue], key: &str) -> Option<&'a str> {
    match attr(attrs, key)? {
        any_value::Value::StringValue(s) => Some(s),
        _ => None,
    }
}

fn metrics<'a>(r: &'a ResourceMetrics, name: &str) -> Vec<&'a Metric> {
    r.scope_metrics.iter().flat_map(|s| &s.metrics).filter(|m| m.name == name).collect()
}

fn points<'a>(r: &'a ResourceMetrics, name: &str) -> Vec<&'a NumberDataPoint> {
    metrics(r, name)
        .into_iter()
        .flat_map(|m| match &m.data {
            Some(metric::Data::Gauge(g)) => g.data_points.iter().collect::<Vec<_>>(),
            Some(metric::Data::Sum(s)) => s.data_points.iter().collect(),
            _ => Vec::new(),
        })
        .collect()
}

fn number(p: &NumberDataPoint) -> f64 {
    match p.value {
        Some(number_data_point::Value::AsDouble(v)) => v,
        Some(number_data_point::Value::AsInt(v)) => v as f64,
        None => f64::NAN,
    }
}

/// GPUs (`hw.id`) with a general-utilisation point in a request.
fn gpus_with_utilization(req: &ExportMetricsServiceRequest) -> BTreeSet<String> {
    req.resource_metrics
        .iter()
        .flat_map(|r| points(r, "hw.gpu.utilization"))
        .filter(|p| str_attr(&p.attributes, "hw.gpu.task") == Some("general"))
        .filter_map(|p| str_attr(&p.attributes, "hw.id").map(str::to_owned))
        .collect()
}

/// Waits for a request that carries every GPU of the fleet, and for a pod holder on
/// at least one of them (attribution's first answer).
fn complete_request(receiver: &Receiver, agent: &Agent, gpus: usize) -> Received {
    poll("a complete OTLP export", Duration::from_secs(60), || {
        let got = receiver.received();
        assert!(!agent.stderr().contains("OTLP export to"), "the agent reported a failed export:\n{}", agent.stderr());
        got.into_iter().rev().find(|r| {
            gpus_with_utilization(&r.request).len() == gpus
                && r.request.resource_metrics.iter().flat_map(|rm| points(rm, "hw.gpu.utilization")).any(|p| {
                    str_attr(&p.attributes, "k8s.pod.name").is_some()
                        && str_attr(&p.attributes, "k8s.namespace.name").is_some()
                })
        })
    })
}

/// What every export must carry, whatever the transport.
fn check_export(received: &Received, inventory: &BTreeMap<String, (String, String, f64)>) {
    let req = &received.request;
    let header = |k: &str| received.headers.iter().find(|(h, _)| h == k).map(|(_, v)| v.as_str());
    assert_eq!(header("authorization"), Some(TOKEN), "configured headers travel: {:?}", received.headers);
    assert_eq!(header("x-apron-test"), Some("yes"));

    let now_ns = SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").as_nanos() as u64;
    let hosts: BTreeSet<&str> = inventory.values().map(|(h, _, _)| h.as_str()).collect();
    assert_eq!(req.resource_metrics.len(), hosts.len(), "one resource per simulated host");
    let mut seen = BTreeSet::new();
    for rm in &req.resource_metrics {
        let res = &rm.resource.as_ref().expect("resource").attributes;
        assert_eq!(str_attr(res, "service.name"), Some("apron-agent"));
        assert_eq!(str_attr(res, "service.instance.id"), Some("test-node"), "the agent's own host name");
        assert_eq!(str_attr(res, "apron.source"), Some("sim"));
        assert!(str_attr(res, "service.version").is_some_and(|v| !v.is_empty()));
        let host = str_attr(res, "host.name").expect("host.name");
        assert!(hosts.contains(host), "{host} is not a host of the fleet");
        let scope = rm.scope_metrics.first().and_then(|s| s.scope.as_ref()).expect("scope");
        assert_eq!(scope.name, "apron-agent");

        // hw.gpu.utilization: a Gauge in `1`, one general point per GPU of this host.
        let util_metrics = metrics(rm, "hw.gpu.utilization");
        assert_eq!(util_metrics.len(), 1, "one metric, tasks are an attribute");
        assert_eq!(util_metrics[0].unit, "1");
        assert!(matches!(util_metrics[0].data, Some(metric::Data::Gauge(_))), "a Gauge");
        let general: Vec<_> = points(rm, "hw.gpu.utilization")
            .into_iter()
            .filter(|p| str_attr(&p.attributes, "hw.gpu.task") == Some("general"))
            .collect();
        for p in &general {
            let id = str_attr(&p.attributes, "hw.id").expect("hw.id").to_owned();
            let (gpu_host, model, _) = inventory.get(&id).unwrap_or_else(|| panic!("{id} is not a GPU of the agent"));
            assert_eq!(gpu_host, host, "{id} is reported under its own host");
            assert_eq!(str_attr(&p.attributes, "hw.type"), Some("gpu"));
            assert_eq!(str_attr(&p.attributes, "hw.vendor"), Some("NVIDIA"));
            assert_eq!(str_attr(&p.attributes, "hw.model"), Some(model.as_str()));
            assert!(str_attr(&p.attributes, "hw.name").is_some_and(|n| n.starts_with("gpu")));
            let v = number(p);
            assert!((0.0..=1.0).contains(&v), "{id}: utilisation {v} is a ratio");
            assert!(p.time_unix_nano > 0 && p.time_unix_nano <= now_ns, "stamped with a past window end");
            assert!(now_ns - p.time_unix_nano < 60_000_000_000, "a recent window");
            assert!(seen.insert(id.clone()), "{id}: one general utilisation point per GPU");
        }

        // hw.gpu.memory.usage / limit: non-monotonic cumulative sums in bytes.
        for name in ["hw.gpu.memory.usage", "hw.gpu.memory.limit"] {
            let m = metrics(rm, name);
            assert_eq!(m.len(), 1, "{name}");
            assert_eq!(m[0].unit, "By", "{name}");
            let Some(metric::Data::Sum(sum)) = &m[0].data else { panic!("{name} is not a Sum") };
            assert!(!sum.is_monotonic, "{name} is an UpDownCounter");
            assert_eq!(sum.aggregation_temporality, AggregationTemporality::Cumulative as i32);
        }
        let limit: BTreeMap<&str, f64> = points(rm, "hw.gpu.memory.limit")
            .into_iter()
            .map(|p| (str_attr(&p.attributes, "hw.id").expect("hw.id"), number(p)))
            .collect();
        for p in points(rm, "hw.gpu.memory.usage") {
            let id = str_attr(&p.attributes, "hw.id").expect("hw.id");
            assert!(matches!(p.value, Some(number_data_point::Value::AsInt(_))), "bytes are integers");
            let (_, _, total) = &inventory[id];
            assert_eq!(limit.get(id), Some(total), "{id}: the limit is the framebuffer /metrics shows");
            let used = number(p);
            assert!(used > 0.0 && used <= *total, "{id}: {used} bytes used of {total}");
        }

        for p in points(rm, "hw.status") {
            let state = str_attr(&p.attributes, "hw.state").expect("hw.state");
            let want = if state == "ok" { 1.0 } else { 0.0 };
            assert_eq!(number(p), want, "no GPU of the fleet is lost yet ({state})");
        }
        let busy = metrics(rm, "apron.gpu.busy_time");
        assert_eq!(busy.first().map(|m| m.unit.as_str()), Some("s"));
        let Some(metric::Data::Sum(sum)) = &busy[0].data else { panic!("busy_time is not a Sum") };
        assert!(sum.is_monotonic, "busy time is a Counter");
        for p in &sum.data_points {
            assert!(p.start_time_unix_nano > 0 && p.start_time_unix_nano < p.time_unix_nano, "counted from the start");
            assert!(number(p) >= 0.0);
        }
    }
    let all: BTreeSet<String> = inventory.keys().cloned().collect();
    assert_eq!(seen, all, "every GPU of the fleet, each under its UUID");
}

fn otlp_section(receiver: &Receiver, protocol: &str) -> String {
    format!(
        "endpoint = {:?}\nprotocol = {protocol:?}\ninterval = \"500ms\"\ntimeout = \"5s\"\n[otlp.headers]\nAuthorization = {TOKEN:?}\nx-apron-test = \"yes\"\n",
        receiver.url()
    )
}

#[test]
fn exports_over_grpc_with_the_hardware_conventions() {
    let receiver = Receiver::grpc();
    let agent = Agent::start(&otlp_section(&receiver, "grpc"));
    let inventory = inventory(&agent);
    assert_eq!(inventory.len(), 16, "2 simulated hosts × 8 GPUs");
    let received = complete_request(&receiver, &agent, inventory.len());
    assert!(received.path.ends_with("MetricsService/Export"));
    check_export(&received, &inventory);
    let stderr = agent.stop();
    assert!(stderr.contains("exporting metrics over OTLP"), "{stderr}");
}

#[test]
fn the_last_state_goes_out_at_stop() {
    let receiver = Receiver::grpc();
    let agent = Agent::start(&format!("endpoint = {:?}\ninterval = \"1h\"\n", receiver.url()));
    let inventory = inventory(&agent);
    assert!(receiver.received().is_empty(), "nothing before the first interval");
    agent.stop();
    let got = receiver.received();
    assert_eq!(got.len(), 1, "exactly the export at stop");
    assert_eq!(gpus_with_utilization(&got[0].request).len(), inventory.len(), "with the last windows of every GPU");
}

#[test]
fn exports_over_http_protobuf() {
    let receiver = Receiver::http();
    let agent = Agent::start(&otlp_section(&receiver, "http/protobuf"));
    let inventory = inventory(&agent);
    let received = complete_request(&receiver, &agent, inventory.len());
    assert_eq!(received.path, "/v1/metrics", "the signal path is appended to the endpoint");
    let content_type = received.headers.iter().find(|(k, _)| k == "content-type").map(|(_, v)| v.as_str());
    assert_eq!(content_type, Some("application/x-protobuf"));
    check_export(&received, &inventory);
    agent.stop();
}

#[test]
fn an_unreachable_receiver_is_logged_once_and_sampling_goes_on() {
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr")
    };
    let agent = Agent::start(&format!("endpoint = \"http://{closed}\"\ninterval = \"200ms\"\ntimeout = \"1s\"\n"));
    poll("the failed export in the log", Duration::from_secs(30), || {
        agent.stderr().contains(&format!("OTLP export to http://{closed} failed")).then_some(())
    });
    // Several intervals later: still one warning, and /metrics still serves windows.
    let windows = |a: &Agent| http_get(a.addr, "/metrics", None).1.matches("apron_gpu_util_ratio{").count();
    poll("windows on /metrics", Duration::from_secs(30), || (windows(&agent) > 0).then_some(()));
    let stderr = agent.stop();
    assert_eq!(stderr.matches("failed: ").count(), 1, "one warning per run of failures:\n{stderr}");
}
