//! The real `apron serve` binary behind TLS (HTTP API and PostgreSQL port) and under its
//! limits: each limit answers with its own status and a clear error, and slow clients
//! cannot hold connections.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use super::{
    AgentProc, ServerProc, TOKEN, free_port, ingest_headers, now_us, poll, request, samples_body, write_config,
};

/// A private CA and a server certificate for `localhost` / 127.0.0.1 signed by it, as
/// PEM files in `dir`: `(ca, cert, key)`.
fn pki(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf, std::path::PathBuf) {
    let ca_key = rcgen::KeyPair::generate().expect("CA key");
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.distinguished_name.push(rcgen::DnType::CommonName, "Apron test CA");
    ca.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign, rcgen::KeyUsagePurpose::CrlSign];
    let ca_cert = ca.self_signed(&ca_key).expect("CA cert");
    let issuer = rcgen::Issuer::new(ca, ca_key);
    let key = rcgen::KeyPair::generate().expect("key");
    let mut leaf = rcgen::CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).expect("params");
    leaf.distinguished_name.push(rcgen::DnType::CommonName, "localhost");
    let cert = leaf.signed_by(&key, &issuer).expect("leaf");
    let paths = (dir.join("ca.crt"), dir.join("server.crt"), dir.join("server.key"));
    std::fs::write(&paths.0, ca_cert.pem()).expect("ca");
    std::fs::write(&paths.1, cert.pem()).expect("cert");
    std::fs::write(&paths.2, key.serialize_pem()).expect("key");
    paths
}

/// An HTTPS client trusting `ca` only; statuses are answers, not errors.
fn https_client(ca: &Path) -> ureq::Agent {
    let pem = std::fs::read(ca).expect("ca");
    let cert = ureq::tls::Certificate::from_pem(&pem).expect("pem").to_owned();
    let tls = ureq::tls::TlsConfig::builder().root_certs(ureq::tls::RootCerts::new_with_certs(&[cert])).build();
    ureq::Agent::config_builder().tls_config(tls).http_status_as_error(false).build().into()
}

fn psql(port: u16, conninfo: &str, sql: &str) -> std::process::Output {
    Command::new("psql")
        .arg(format!("host=localhost port={port} user=grafana dbname=apron {conninfo}"))
        .args(["-X", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-c", sql])
        .env("PGPASSWORD", "grafana-pass-0123")
        .env("PGCONNECT_TIMEOUT", "10")
        .output()
        .expect("psql (Debian package postgresql-client; scripts/install-test-tools.sh installs it)")
}

#[test]
fn the_api_and_the_pg_port_speak_tls_and_refuse_plaintext() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let (ca, cert, key) = pki(dir.path());
    let pg_port = free_port();
    let extra = format!(
        "[sql]\ntokens = [\"sql-token-0123456789abcdef\"]\n\
         [server.tls]\ncert_file = {:?}\nkey_file = {:?}\n\
         [pg]\nlisten = \"127.0.0.1:{pg_port}\"\nusers = [{{ name = \"grafana\", password = \"grafana-pass-0123\" }}]\n",
        cert.display().to_string(),
        key.display().to_string()
    );
    let server = ServerProc::start(&write_config(dir.path(), &data, &extra, ""), &[], &dir.path().join("apron.log"));
    let port = server.addr.port();

    // HTTPS with the private CA: ingest and SQL answer.
    let client = https_client(&ca);
    let body = samples_body(&[("GPU-tls".into(), now_us())]);
    let auth = format!("Bearer {TOKEN}");
    let mut req = client.post(format!("https://localhost:{port}/api/v1/ingest"));
    for (k, v) in ingest_headers("gpu_samples", "tls-agent", "e1", "1", &auth) {
        req = req.header(k, v);
    }
    let r = req.send(&body[..]).expect("https ingest");
    assert_eq!(r.status().as_u16(), 200);
    let mut r = client
        .post(format!("https://localhost:{port}/api/v1/sql"))
        .header("authorization", "Bearer sql-token-0123456789abcdef")
        .header("accept", "text/csv")
        .send("SELECT count(*) AS n FROM gpu_samples WHERE gpu_uuid = 'GPU-tls'")
        .expect("https sql");
    assert_eq!((r.status().as_u16(), r.body_mut().read_to_string().expect("body").trim()), (200, "n\n1"));

    // The real agent ships over HTTPS, trusting the private CA (`[shipper] ca_file`).
    let agent_dir = dir.path().join("agent");
    std::fs::create_dir_all(&agent_dir).expect("agent dir");
    let agent = AgentProc::start_with(
        &agent_dir,
        &format!("https://localhost:{port}"),
        &agent_dir.join("windows.jsonl"),
        &format!("ca_file = {:?}\n", ca.display().to_string()),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let shipped = || {
        let mut r = client
            .post(format!("https://localhost:{port}/api/v1/sql"))
            .header("authorization", "Bearer sql-token-0123456789abcdef")
            .header("accept", "text/csv")
            .send("SELECT count(*) AS n FROM gpu_samples WHERE gpu_uuid <> 'GPU-tls'")
            .ok()?;
        let text = r.body_mut().read_to_string().ok()?;
        (text.trim() != "n\n0").then_some(())
    };
    while shipped().is_none() {
        if Instant::now() > deadline {
            panic!("no rows from the agent over HTTPS:\n{}", agent.stop());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    agent.stop();

    // A client that does not trust the CA fails the handshake; plaintext HTTP gets no
    // HTTP answer.
    let default_roots: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let e = default_roots.get(format!("https://localhost:{port}/healthz")).call().expect_err("unknown CA");
    assert!(e.to_string().to_lowercase().contains("certificate") || e.to_string().contains("tls"), "{e}");
    let plain = super::try_request(server.addr, "GET", "/healthz", &[], b"");
    assert!(plain.as_ref().map_or(true, |r| r.status != 200), "plaintext must not be served: {plain:?}");

    // PostgreSQL: verify-full against the CA works; a client without TLS is refused
    // before it sends its password.
    let ok = poll("psql over TLS", Duration::from_secs(20), || {
        let o = psql(
            pg_port,
            &format!("sslmode=verify-full sslrootcert={}", ca.display()),
            "SELECT count(*) FROM gpu_samples WHERE gpu_uuid = 'GPU-tls'",
        );
        o.status.success().then(|| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    });
    assert_eq!(ok, "1");
    let o = psql(pg_port, "sslmode=disable", "SELECT 1");
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("requires TLS"), "{}", String::from_utf8_lossy(&o.stderr));
    server.stop();
}

#[test]
fn limits_answer_with_clear_errors_and_slow_clients_are_cut_off() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let sql_token = "sql-token-0123456789abcdef";
    let extra = format!(
        "max_requests_per_agent = 2\nmax_body_bytes = \"64KiB\"\n\
         [sql]\ntokens = [{sql_token:?}]\nmax_body_bytes = \"1KiB\"\n\
         [query]\nmax_result_rows = 1000\nmax_result_bytes = 65536\ntimeout = \"2s\"\nmax_concurrent = 2\nqueue_timeout = \"100ms\"\n"
    );
    let config = write_config(dir.path(), &data, &extra, "max_rows_per_batch = 3\n");
    let text = std::fs::read_to_string(&config).expect("config");
    // Timeouts of the HTTP listener, kept short for the test.
    std::fs::write(
        &config,
        text.replacen("[server]\n", "[server]\nheader_read_timeout = \"1s\"\nbody_read_timeout = \"1s\"\n", 1),
    )
    .expect("config");
    let server = ServerProc::start(&config, &[], &dir.path().join("apron.log"));
    let auth = format!("Bearer {TOKEN}");
    let sql_once = |q: &str| {
        request(server.addr, "POST", "/api/v1/sql", &[("authorization", &format!("Bearer {sql_token}"))], q.as_bytes())
    };
    // The server's own background queries (rollup, ledger) share the query slots: a
    // 503 here is retried.
    let sql = |q: &str| poll("a query slot", Duration::from_secs(30), || Some(sql_once(q)).filter(|r| r.status != 503));
    let error = |r: &super::Reply| r.json()["error"].as_str().unwrap_or_default().to_owned();

    // Rows per batch (storage.max_rows_per_batch): 413 too_many_rows; nothing stored.
    let t = now_us();
    let four: Vec<(String, i64)> = (0..4).map(|i| (format!("GPU-{i}"), t)).collect();
    let r = request(
        server.addr,
        "POST",
        "/api/v1/ingest",
        &ingest_headers("gpu_samples", "big", "e", "1", &auth),
        &samples_body(&four),
    );
    assert_eq!((r.status, r.json()["error"].as_str()), (413, Some("too_many_rows")), "{r:?}");

    // Body size (ingest.max_body_bytes): 413 body_too_large.
    let r = request(
        server.addr,
        "POST",
        "/api/v1/ingest",
        &ingest_headers("gpu_samples", "big", "e", "2", &auth),
        &vec![0u8; 65 << 10],
    );
    assert_eq!((r.status, r.json()["error"].as_str()), (413, Some("body_too_large")), "{r:?}");

    // Per-agent rate (2/s, bursts of 4): a flood from one agent gets 429 rate_limited
    // with Retry-After, while another agent is unaffected.
    let mut limited = None;
    for seq in 10..30 {
        let body = samples_body(&[("GPU-r".into(), t + seq)]);
        let r = request(
            server.addr,
            "POST",
            "/api/v1/ingest",
            &ingest_headers("gpu_samples", "noisy", "e", &seq.to_string(), &auth),
            &body,
        );
        if r.status == 429 {
            limited = Some(r);
            break;
        }
        assert_eq!(r.status, 200, "{r:?}");
    }
    let r = limited.expect("the flood is limited");
    assert_eq!(r.json()["error"], "rate_limited", "{r:?}");
    assert!(
        r.json()["detail"].as_str().is_some_and(|d| d.contains("noisy") && d.contains("max_requests_per_agent")),
        "{r:?}"
    );
    assert!(r.headers.contains("retry-after: "), "{r:?}");
    let body = samples_body(&[("GPU-q".into(), t)]);
    let r =
        request(server.addr, "POST", "/api/v1/ingest", &ingest_headers("gpu_samples", "quiet", "e", "1", &auth), &body);
    assert_eq!(r.status, 200, "{r:?}");

    // SQL text size (sql.max_body_bytes): 413 body_too_large.
    let long = format!("SELECT 1 -- {}", "x".repeat(2000));
    let r = sql(&long);
    assert_eq!((r.status, r.json()["error"].as_str()), (413, Some("body_too_large")), "{r:?}");
    // Result rows and bytes (query.max_result_rows / max_result_bytes): 413 each.
    let r = sql("SELECT * FROM generate_series(1, 5000)");
    assert_eq!(r.status, 413, "{r:?}");
    assert!(error(&r).contains("more than 1000 rows"), "{r:?}");
    let r = sql("SELECT repeat('x', 1000) FROM generate_series(1, 500)");
    assert_eq!(r.status, 413, "{r:?}");
    assert!(error(&r).contains("larger than the limit of"), "{r:?}");
    // Query timeout (query.timeout): 504.
    // Streams batch after batch (so the cancelled query lets go of its slot at once).
    let slow = "SELECT sum(value % 7) FROM generate_series(1, 1000000000000)";
    let r = sql(slow);
    assert_eq!(r.status, 504, "{r:?}");
    assert!(error(&r).contains("timed out after 2s"), "{r:?}");

    // Concurrent queries (query.max_concurrent = 2): while two run, the next is 503.
    let addr = server.addr;
    let running: Vec<_> = (0..2)
        .map(|_| {
            std::thread::spawn(move || {
                request(
                    addr,
                    "POST",
                    "/api/v1/sql",
                    &[("authorization", &format!("Bearer {sql_token}"))],
                    slow.as_bytes(),
                )
            })
        })
        .collect();
    let busy = poll("a third query to be refused while two run", Duration::from_secs(10), || {
        let r = sql_once("SELECT 1");
        (r.status == 503).then_some(r)
    });
    // One principal: its share (query.max_concurrent_per_principal: all but one of 2) is the
    // first limit it meets.
    assert!(error(&busy).contains("query slots"), "{busy:?}");
    assert!(busy.headers.contains("retry-after: "), "{busy:?}");
    for r in running {
        assert!([503, 504].contains(&r.join().expect("join").status));
    }

    // A client that sends half a request head is disconnected after the header read
    // timeout (1 s), not held open.
    let started = Instant::now();
    let mut s = TcpStream::connect(server.addr).expect("connect");
    s.write_all(b"POST /api/v1/sql HTTP/1.1\r\nHost: x\r\n").expect("half a head");
    s.set_read_timeout(Some(Duration::from_secs(15))).expect("timeout");
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    let held = started.elapsed();
    assert!(held < Duration::from_secs(10), "held for {held:?}");
    // One that announces a body and stalls is answered (408) or cut off after the body
    // read timeout.
    let started = Instant::now();
    let mut s = TcpStream::connect(server.addr).expect("connect");
    let head = format!(
        "POST /api/v1/sql HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {sql_token}\r\nContent-Length: 100\r\n\r\nSELECT"
    );
    s.write_all(head.as_bytes()).expect("head");
    s.set_read_timeout(Some(Duration::from_secs(15))).expect("timeout");
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    let held = started.elapsed();
    assert!(held < Duration::from_secs(10), "held for {held:?}");
    let answer = String::from_utf8_lossy(&buf);
    assert!(answer.is_empty() || answer.starts_with("HTTP/1.1 408") || answer.starts_with("HTTP/1.1 400"), "{answer}");

    // The server is still healthy for everyone else.
    assert_eq!(sql("SELECT 1").status, 200);
    server.stop();
}
