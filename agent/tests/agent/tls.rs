//! TLS: `/metrics` behind an exporter-toolkit web config (TLS + bcrypt basic auth),
//! checked by `promtool check web-config`, a rustls client and a real Prometheus; and
//! the shipper posting to an `https://` collector that only a private CA vouches for.
//!
//! Certificates are generated here (rcgen) into a temporary directory; bcrypt hashes with
//! the bcrypt crate. promtool and Prometheus are required (a missing one fails).

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use apron_http::serve::{ServeOptions, serve};
use apron_http::tls::{ClientAuth, TlsConfig};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use serde_json::Value;

use super::{Agent, TOKEN, metric, poll, ship_config, spool_dir, spool_files, tool, urlencode};

const USER: &str = "prometheus";
const PASSWORD: &str = "scrape:s3cret-42";

/// A private CA and a server certificate for `localhost` and 127.0.0.1, as PEM files.
struct Pki {
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
    ca_pem: String,
}

impl Pki {
    fn new(dir: &Path, prefix: &str) -> Pki {
        let ca_key = rcgen::KeyPair::generate().expect("CA key");
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params.distinguished_name.push(rcgen::DnType::CommonName, format!("{prefix} test CA"));
        ca_params.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign, rcgen::KeyUsagePurpose::CrlSign];
        let ca_cert = ca_params.self_signed(&ca_key).expect("CA certificate");
        let issuer = rcgen::Issuer::new(ca_params, ca_key);

        let key = rcgen::KeyPair::generate().expect("server key");
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params.subject_alt_names = vec![
            rcgen::SanType::DnsName("localhost".try_into().expect("dns name")),
            rcgen::SanType::IpAddress(Ipv4Addr::LOCALHOST.into()),
        ];
        params.distinguished_name.push(rcgen::DnType::CommonName, "localhost");
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
        let cert = params.signed_by(&key, &issuer).expect("server certificate");

        let pki = Pki {
            ca: dir.join(format!("{prefix}-ca.crt")),
            cert: dir.join(format!("{prefix}-server.crt")),
            key: dir.join(format!("{prefix}-server.key")),
            ca_pem: ca_cert.pem(),
        };
        std::fs::write(&pki.ca, &pki.ca_pem).expect("write CA");
        std::fs::write(&pki.cert, cert.pem()).expect("write certificate");
        std::fs::write(&pki.key, key.serialize_pem()).expect("write key");
        pki
    }

    fn client(&self) -> Arc<rustls::ClientConfig> {
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(self.ca_pem.as_bytes()) {
            roots.add(c.expect("PEM")).expect("CA");
        }
        let config = rustls::ClientConfig::builder_with_provider(apron_http::tls::ring_provider())
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
        Arc::new(config)
    }
}

fn base64(data: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in data.chunks(3) {
        let b = [chunk[0], chunk.get(1).copied().unwrap_or(0), chunk.get(2).copied().unwrap_or(0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            out.push(if i <= chunk.len() { A[((n >> (18 - 6 * i)) & 63) as usize] as char } else { '=' });
        }
    }
    out
}

fn basic(user: &str, password: &str) -> String {
    format!("Basic {}", base64(format!("{user}:{password}").as_bytes()))
}

struct Reply {
    status: u16,
    head: String,
    body: String,
}

/// One GET over TLS with a blocking rustls client; `Err` when TLS fails.
fn https_get(
    addr: SocketAddr,
    path: &str,
    client: &Arc<rustls::ClientConfig>,
    headers: &[(&str, &str)],
) -> Result<Reply, String> {
    let tcp = TcpStream::connect(addr).map_err(|e| e.to_string())?;
    tcp.set_read_timeout(Some(Duration::from_secs(10))).map_err(|e| e.to_string())?;
    let name = ServerName::try_from("localhost").map_err(|e| e.to_string())?;
    let conn = rustls::ClientConnection::new(client.clone(), name).map_err(|e| e.to_string())?;
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    let extra: String = headers.iter().map(|(k, v)| format!("{k}: {v}\r\n")).collect();
    write!(tls, "GET {path} HTTP/1.1\r\nHost: localhost\r\n{extra}Connection: close\r\n\r\n")
        .map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    if let Err(e) = tls.read_to_end(&mut raw)
        && raw.is_empty()
    {
        return Err(e.to_string());
    }
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        apron_test_support::dechunk(body)
    } else {
        body.to_owned()
    };
    Ok(Reply { status, head: head.to_owned(), body })
}

fn header<'a>(reply: &'a Reply, name: &str) -> Option<&'a str> {
    reply.head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// A web-config.yml next to the certificates (relative paths, as exporter-toolkit
/// resolves them), with one bcrypt user.
fn web_config(dir: &Path, pki: &Pki) -> PathBuf {
    let hash = bcrypt::hash(PASSWORD, 6).expect("bcrypt");
    let name = |p: &Path| p.file_name().expect("name").to_str().expect("utf8").to_owned();
    let path = dir.join("web-config.yml");
    std::fs::write(
        &path,
        format!(
            "tls_server_config:\n  cert_file: {}\n  key_file: {}\n  min_version: TLS12\nhttp_server_config:\n  headers:\n    X-Content-Type-Options: nosniff\nbasic_auth_users:\n  {USER}: {hash}\n",
            name(&pki.cert),
            name(&pki.key)
        ),
    )
    .expect("write web config");
    path
}

fn start_agent(web: &Path) -> Agent {
    Agent::start(&["--source", "sim", "--web-config-file", web.to_str().expect("utf8")], None)
}

#[test]
fn web_config_tls_and_basic_auth_pass_promtool_and_guard_metrics() {
    let promtool = tool("promtool");
    let dir = tempfile::tempdir().expect("tempdir");
    let pki = Pki::new(dir.path(), "agent");
    let web = web_config(dir.path(), &pki);

    // promtool (exporter-toolkit's own checks) accepts the file the agent runs with.
    let out = Command::new(&promtool).args(["check", "web-config"]).arg(&web).output().expect("promtool runs");
    let report = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && report.contains("SUCCESS"), "promtool check web-config:\n{report}");

    let agent = start_agent(&web);
    let client = pki.client();
    let auth = basic(USER, PASSWORD);
    let om = "application/openmetrics-text;version=1.0.0";

    // Right credentials: OpenMetrics over TLS, with the configured header.
    let ok = poll("a sampled scrape", Duration::from_secs(30), || {
        let r = https_get(agent.addr, "/metrics", &client, &[("Authorization", &auth), ("Accept", om)]).ok()?;
        (r.status == 200 && r.body.contains("apron_gpu_busy_seconds_total")).then_some(r)
    });
    assert!(header(&ok, "content-type").is_some_and(|c| c.starts_with("application/openmetrics-text")), "{}", ok.head);
    assert!(ok.body.ends_with("# EOF\n"));
    assert_eq!(header(&ok, "x-content-type-options"), Some("nosniff"));
    let health = https_get(agent.addr, "/healthz", &client, &[("Authorization", &auth)]).expect("TLS");
    assert_eq!(health.status, 200, "{}", health.body);

    // Wrong password, unknown user, no credentials: 401 with a Basic challenge, on
    // every path.
    for (path, headers) in [
        ("/metrics", vec![("Authorization", basic(USER, "wrong"))]),
        ("/metrics", vec![("Authorization", basic("mallory", PASSWORD))]),
        ("/metrics", vec![]),
        ("/healthz", vec![]),
    ] {
        let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let r = https_get(agent.addr, path, &client, &h).expect("TLS works");
        assert_eq!(r.status, 401, "{path} {headers:?}: {}", r.head);
        assert_eq!(header(&r, "www-authenticate"), Some("Basic"), "{}", r.head);
        assert!(!r.body.contains("DCGM_"), "no metrics without credentials");
    }

    // No TLS: plain HTTP gets no answer.
    let mut plain = TcpStream::connect(agent.addr).expect("connect");
    plain.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    // The server may hang up before the request is fully written: that is the point.
    let request = format!("GET /metrics HTTP/1.1\r\nHost: localhost\r\nAuthorization: {auth}\r\n\r\n");
    let _ = plain.write_all(request.as_bytes());
    let mut raw = Vec::new();
    let _ = plain.read_to_end(&mut raw);
    assert!(!String::from_utf8_lossy(&raw).contains("200 OK"), "plain HTTP must not be served");

    // A client that does not trust the agent's CA: the handshake fails.
    let other = Pki::new(dir.path(), "other");
    let err = https_get(agent.addr, "/metrics", &other.client(), &[("Authorization", &auth)])
        .err()
        .expect("untrusted certificate");
    assert!(err.contains("UnknownIssuer") || err.contains("invalid peer certificate"), "{err}");

    let stderr = agent.stop();
    assert!(stderr.contains("serving https://"), "{stderr}");
    // Failed handshakes are not errors in the agent's log.
    assert!(!stderr.contains("ERROR"), "{stderr}");
}

#[test]
fn prometheus_scrapes_the_agent_over_tls_with_basic_auth() {
    let prometheus = tool("prometheus");
    let dir = tempfile::tempdir().expect("tempdir");
    let pki = Pki::new(dir.path(), "agent");
    let web = web_config(dir.path(), &pki);
    let agent = start_agent(&web);

    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: apron-agent-tls\n    scheme: https\n    tls_config:\n      ca_file: {:?}\n    basic_auth:\n      username: {USER}\n      password: {PASSWORD:?}\n    static_configs:\n      - targets: ['{}']\n",
            pki.ca.display().to_string(),
            agent.addr
        ),
    )
    .expect("config");
    let port = std::net::TcpListener::bind("127.0.0.1:0").expect("free port").local_addr().expect("addr").port();
    let web_addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
    let log = dir.path().join("prom.log");
    let mut prom = Command::new(prometheus)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
        .arg(format!("--web.listen-address={web_addr}"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log"))
        .spawn()
        .expect("prometheus starts");
    let query = |q: &str| -> Option<Vec<Value>> {
        let path = format!("/api/v1/query?query={}", urlencode(q));
        let (status, body) = std::panic::catch_unwind(|| super::http_get(web_addr, &path, None)).ok()?;
        if status != 200 {
            return None;
        }
        let v: Value = serde_json::from_str(&body).ok()?;
        let r = v["data"]["result"].as_array()?.clone();
        (!r.is_empty()).then_some(r)
    };
    let up = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        poll("up == 1 for the TLS target", Duration::from_secs(60), || {
            let r = query(r#"up{job="apron-agent-tls"}"#)?;
            (r[0]["value"][1].as_str()? == "1").then_some(r)
        })
    }));
    let targets = super::http_get(web_addr, "/api/v1/targets", None).1;
    let up = match up {
        Ok(up) => up,
        Err(_) => {
            let _ = prom.kill();
            panic!(
                "Prometheus never scraped the agent: targets {targets}\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
    };
    assert_eq!(up.len(), 1, "{up:?}");
    assert!(targets.contains("https://"), "{targets}");
    // And the samples are there: the agent's families came through TLS + auth.
    let util = poll("GPU families in Prometheus", Duration::from_secs(30), || {
        query(r#"DCGM_FI_DEV_GPU_UTIL{job="apron-agent-tls"}"#)
    });
    assert!(util.len() >= 2, "the simulated fleet's GPUs: {util:?}");
    let _ = prom.kill();
    let _ = prom.wait();
}

// ---------------------------------------------------------------------------------------
// The shipper and an https:// collector
// ---------------------------------------------------------------------------------------

/// (table, sequence, authorization) per ingest request.
type IngestLog = Arc<Mutex<Vec<(String, u64, String)>>>;

/// A collector stand-in behind TLS (the common serve module), recording
/// (table, sequence, authorization) of every ingest request and acknowledging it.
struct TlsCollector {
    /// Runs the server; dropped (after the stop signal) with the collector.
    _rt: tokio::runtime::Runtime,
    addr: SocketAddr,
    log: IngestLog,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl TlsCollector {
    fn start(pki: &Pki) -> TlsCollector {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("runtime");
        let tls = TlsConfig {
            cert_file: pki.cert.clone(),
            key_file: pki.key.clone(),
            client_ca_file: None,
            client_auth: ClientAuth::None,
            min_version: None,
        }
        .server_config()
        .expect("TLS settings");
        let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).expect("bind");
        let addr = listener.local_addr().expect("addr");
        let log = Arc::new(Mutex::new(Vec::new()));
        let router = axum::Router::new().route("/api/v1/ingest", axum::routing::post(ingest)).with_state(log.clone());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        rt.spawn(serve(listener, router, ServeOptions::default().with_tls(Some(tls)), async move {
            let _ = rx.await;
        }));
        TlsCollector { _rt: rt, addr, log, stop: Some(tx) }
    }

    fn url(&self) -> String {
        format!("https://localhost:{}", self.addr.port())
    }

    fn requests(&self) -> Vec<(String, u64, String)> {
        self.log.lock().expect("lock").clone()
    }
}

impl Drop for TlsCollector {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }
}

async fn ingest(State(log): State<IngestLog>, headers: HeaderMap, body: axum::body::Bytes) -> Response {
    let h = |k: &str| headers.get(k).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    let seq = h(apron_common::wire::headers::SEQUENCE).parse().unwrap_or(0);
    log.lock().expect("lock").push((h(apron_common::wire::headers::TABLE), seq, h("authorization")));
    let ok = !body.is_empty();
    (StatusCode::OK, axum::Json(serde_json::json!({ "rows": usize::from(ok), "duplicate": false }))).into_response()
}

#[test]
fn the_shipper_trusts_a_private_ca_for_an_https_collector() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pki = Pki::new(dir.path(), "collector");
    let collector = TlsCollector::start(&pki);

    // With the collector's CA: batches arrive over TLS.
    let good = dir.path().join("good");
    std::fs::create_dir(&good).expect("mkdir");
    let config =
        ship_config(&good, Some(&collector.url()), true, &format!("ca_file = {:?}\n", pki.ca.display().to_string()));
    let agent = Agent::start(&["--config", config.to_str().expect("utf8")], None);
    poll("batches over https", Duration::from_secs(20), || (collector.requests().len() >= 2).then_some(()));
    let text = agent.metrics();
    assert_eq!(metric(&text, "apron_agent_ship_collector_up"), Some(1.0), "{text}");
    let stderr = agent.stop();
    let reqs = collector.requests();
    assert!(reqs.iter().all(|(_, _, auth)| *auth == format!("Bearer {TOKEN}")), "{reqs:?}\n{stderr}");
    assert!(reqs.iter().any(|(table, _, _)| table == "gpu_samples"), "{reqs:?}");

    // With another CA: every attempt fails with a readable reason, and the batches stay
    // in the spool for later.
    let seen = collector.requests().len();
    let bad = dir.path().join("bad");
    std::fs::create_dir(&bad).expect("mkdir");
    let wrong = Pki::new(dir.path(), "wrong");
    let config =
        ship_config(&bad, Some(&collector.url()), true, &format!("ca_file = {:?}\n", wrong.ca.display().to_string()));
    let agent = Agent::start(&["--config", config.to_str().expect("utf8")], None);
    poll("batches spooled", Duration::from_secs(20), || (spool_files(&spool_dir(&bad)).len() >= 2).then_some(()));
    let text = agent.metrics();
    assert_eq!(metric(&text, "apron_agent_ship_collector_up"), Some(0.0), "{text}");
    assert!(metric(&text, "apron_agent_ship_retries_total").unwrap_or(0.0) >= 1.0, "{text}");
    let stderr = agent.stop();
    let want =
        format!("TLS: the collector's certificate is not signed by the CA in shipper.ca_file ({})", wrong.ca.display());
    assert!(stderr.contains(&want), "{stderr}");
    assert!(stderr.contains("UnknownIssuer"), "{stderr}");
    assert_eq!(collector.requests().len(), seen, "nothing reached the collector");
    assert!(!spool_files(&spool_dir(&bad)).is_empty(), "the spool is kept");
}

#[test]
fn tls_settings_errors_stop_the_agent_with_the_file_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pki = Pki::new(dir.path(), "agent");
    let web = dir.path().join("web-config.yml");
    // The key file named as the certificate.
    std::fs::write(
        &web,
        format!("tls_server_config:\n  cert_file: {}\n  key_file: {}\n", pki.key.display(), pki.key.display()),
    )
    .expect("write");
    let err = super::run_failing(&["--source", "sim", "--web-config-file", web.to_str().expect("utf8")], None);
    assert!(
        err.contains("agent.web_config_file")
            && err.contains("agent-server.key")
            && err.contains("no certificate found"),
        "{err}"
    );
    // node_exporter's spelling of the flag works too.
    std::fs::write(&web, "tls_server_config:\n  cert_file: x.crt\n  key_file: x.key\n  min_version: TLS10\n")
        .expect("write");
    let err = super::run_failing(&["--source", "sim", "--web.config.file", web.to_str().expect("utf8")], None);
    assert!(err.contains("min_version") && err.contains("TLS 1.0"), "{err}");
}
