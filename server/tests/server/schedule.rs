//! The weekly report schedule against a real SMTP server (Python `aiosmtpd`, writing a
//! maildir) and a webhook receiver in the test: the week of `cost::trace()` (team ml
//! $5.70, hand-computed there) is e-mailed, posted and exported once, on Monday after
//! `at`, and never again.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use apron::ledger::CostConfig;
use apron::schedule::{EmailConfig, ReportConfig, TlsMode, WebhookConfig};
use apron_collector::{IngestRequest, Table};
use apron_common::wire::{encode_ipc, windows_to_batch};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::cost::{BOOK, D, DAY, SEC, trace};
use super::rollup::open;

/// `python3` with `aiosmtpd` (the SMTP server) and `openpyxl` (reads the attached
/// workbook): `scripts/install-test-tools.sh`. Missing: a failure under
/// `APRON_REQUIRE_TOOLS=1` (CI), else a NOTE and the test returns.
fn python_tools() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import aiosmtpd, openpyxl"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        assert!(
            std::env::var_os("APRON_REQUIRE_TOOLS").is_none(),
            "python3 with aiosmtpd and openpyxl is required (scripts/install-test-tools.sh)"
        );
        eprintln!("NOTE: skipping the e-mail test: python3 -m pip install aiosmtpd openpyxl");
    }
    ok
}

/// `python3 -m aiosmtpd` on a free loopback port, delivering into a maildir.
struct SmtpServer {
    child: Child,
    port: u16,
    maildir: PathBuf,
}

impl SmtpServer {
    fn start(dir: &Path, extra: &[&str]) -> SmtpServer {
        let port = super::free_port();
        let maildir = dir.join("maildir");
        let log = std::fs::File::create(dir.join("smtpd.log")).expect("log");
        let child = Command::new("python3")
            .args(["-m", "aiosmtpd", "-n", "-l", &format!("127.0.0.1:{port}"), "-c", "aiosmtpd.handlers.Mailbox"])
            .args(extra)
            .arg(&maildir)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("python3 -m aiosmtpd starts");
        let mut server = SmtpServer { child, port, maildir };
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Ok(Some(status)) = server.child.try_wait() {
                panic!(
                    "aiosmtpd exited with {status}: {}",
                    std::fs::read_to_string(dir.join("smtpd.log")).unwrap_or_default()
                );
            }
            assert!(Instant::now() < deadline, "aiosmtpd did not listen on {port}");
            std::thread::sleep(Duration::from_millis(50));
        }
        server
    }

    /// Every message received, parsed by Python's `email` package; the XLSX attachment
    /// opened with openpyxl and compared cell by cell with the CSV attachments.
    fn messages(&self) -> Vec<Value> {
        let o = Command::new("python3").args(["-c", READ_MAILDIR]).arg(&self.maildir).output().expect("python3 runs");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&o.stdout)))
    }
}

impl Drop for SmtpServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const READ_MAILDIR: &str = r#"
import csv, email, io, json, os, sys
from email import policy
import openpyxl
box, out = sys.argv[1], []
for sub in ("new", "cur"):
    d = os.path.join(box, sub)
    for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        with open(os.path.join(d, name), "rb") as f:
            m = email.message_from_binary_file(f, policy=policy.default)
        msg = {"subject": str(m["subject"]), "from": str(m["from"]), "to": str(m["to"]),
               "html": "", "text": "", "attachments": [], "xlsx_cells": 0, "xlsx_mismatches": []}
        csvs, xlsx = {}, None
        for part in m.walk():
            if part.is_multipart():
                continue
            fn = part.get_filename()
            if fn:
                msg["attachments"].append(fn)
                data = part.get_payload(decode=True)
                if fn.endswith(".csv"):
                    csvs[fn] = data.decode("utf-8")
                elif fn.endswith(".xlsx"):
                    xlsx = data
            elif part.get_content_type() == "text/html":
                msg["html"] = part.get_content()
            elif part.get_content_type() == "text/plain":
                msg["text"] = part.get_content()
        if xlsx is not None:
            wb = openpyxl.load_workbook(io.BytesIO(xlsx), data_only=True)
            for fn, text in csvs.items():
                ws = wb[fn.split("-")[-1][:-len(".csv")]]
                for r, row in enumerate(csv.reader(io.StringIO(text))):
                    for c, want in enumerate(row):
                        got = ws.cell(row=r + 1, column=c + 1).value
                        try:
                            same = r > 0 and want != "" and float(want) == got
                        except ValueError:
                            same = False
                        same = same or ("" if got is None else str(got)) == want
                        msg["xlsx_cells"] += 1
                        if not same:
                            msg["xlsx_mismatches"].append([fn, r, c, want, str(got)])
        out.append(msg)
print(json.dumps(out))
"#;

/// One request the webhook receiver got.
#[derive(Debug, Clone)]
struct Hook {
    head: String,
    body: Value,
}

/// An HTTP/1.1 receiver on port 0: answers 500 to the first request (the schedule must
/// retry) and 200 after, recording each.
async fn webhook_receiver() -> (SocketAddr, Arc<Mutex<Vec<Hook>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let got: Arc<Mutex<Vec<Hook>>> = Arc::default();
    let seen = got.clone();
    tokio::spawn(async move {
        let mut n = 0;
        while let Ok((mut s, _)) = listener.accept().await {
            let mut buf = Vec::new();
            let mut chunk = [0u8; 8192];
            let (head, body) = loop {
                let Ok(k) = s.read(&mut chunk).await else { break (String::new(), Vec::new()) };
                if k == 0 {
                    break (String::new(), Vec::new());
                }
                buf.extend_from_slice(&chunk[..k]);
                let text = String::from_utf8_lossy(&buf).into_owned();
                if let Some(i) = text.find("\r\n\r\n") {
                    let head = text[..i].to_ascii_lowercase();
                    let len = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse::<usize>().ok())
                        .unwrap_or(0);
                    if buf.len() >= i + 4 + len {
                        break (head, buf[i + 4..i + 4 + len].to_vec());
                    }
                }
            };
            n += 1;
            let body = serde_json::from_slice(&body).unwrap_or(Value::Null);
            seen.lock().expect("lock").push(Hook { head, body });
            let status = if n == 1 { "500 Internal Server Error" } else { "200 OK" };
            let _ = s
                .write_all(format!("HTTP/1.1 {status}\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok").as_bytes())
                .await;
        }
    });
    (addr, got)
}

/// 2026-11-23 (Monday of 2026-W48) at `hh:mm` UTC.
fn monday_w48(hh: i64, mm: i64) -> i64 {
    (D + 4) * DAY + (hh * 3600 + mm * 60) * SEC
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schedule_mails_posts_and_exports_the_previous_week_once() {
    if !python_tools() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let smtp = SmtpServer::start(dir.path(), &[]);
    let (hook_addr, hooks) = webhook_receiver().await;

    // The week of the hand-computed trace (2026-W47), priced and classified.
    let server = open(dir.path());
    let store = server.store().clone();
    let body = encode_ipc(&windows_to_batch(&trace()).expect("batch")).expect("ipc");
    store
        .ingest(IngestRequest { table: Table::GpuSamples, agent: "a", epoch: "e", sequence: 0, body: &body })
        .expect("ingest");
    store.persist_now().expect("persist");
    let book = dir.path().join("prices.toml");
    std::fs::write(&book, BOOK).expect("book");
    let server =
        server.with_cost(CostConfig { price_book: Some(book.clone()), ..CostConfig::default() }).expect("cost");
    let ledger = server.ledger().expect("ledger").clone();
    assert_eq!(ledger.run_once((D + 1) * DAY).await.errors, Vec::<String>::new());

    let token = dir.path().join("hook-token");
    std::fs::write(&token, "hook-secret-0123\n").expect("token");
    let export = dir.path().join("export");
    let config = ReportConfig {
        enabled: true,
        dir: Some(export.clone()),
        retry_backoff: Duration::from_millis(10),
        email: Some(EmailConfig {
            smtp_host: "127.0.0.1".into(),
            smtp_port: Some(smtp.port),
            tls: TlsMode::None,
            ca_file: None,
            username: None,
            password_file: None,
            from: "Apron <apron@example.org>".into(),
            to: vec!["finance@example.org".into(), "ml-leads@example.org".into()],
            formats: vec![
                apron::report::ReportFormat::Html,
                apron::report::ReportFormat::Xlsx,
                apron::report::ReportFormat::Csv,
            ],
            timeout: Duration::from_secs(20),
        }),
        webhook: Some(WebhookConfig {
            url: format!("http://{hook_addr}/hook"),
            token_file: Some(token),
            timeout: Duration::from_secs(10),
        }),
        ..ReportConfig::default()
    };
    config.validate().expect("valid");
    let server = server.with_report(config.clone());
    let schedule = server.schedule().expect("enabled").clone();

    // Monday before 06:00: nothing is due yet.
    let r = schedule.run_once(monday_w48(5, 59)).await;
    assert_eq!((r.week, r.delivered.len()), (None, 0), "{:?}", r.errors);
    assert!(smtp.messages().is_empty());

    // Monday 06:01: 2026-W47, every delivery (the webhook on its second try).
    let r = schedule.run_once(monday_w48(6, 1)).await;
    assert_eq!(r.errors, Vec::<String>::new());
    assert_eq!(r.week.as_deref(), Some("2026-W47"));
    assert_eq!(r.delivered, vec!["dir", "email", "webhook"]);

    let mail = smtp.messages();
    assert_eq!(mail.len(), 1, "{mail:?}");
    let m = &mail[0];
    let subject = m["subject"].as_str().expect("subject");
    assert!(subject.contains("2026-W47") && subject.contains("$6.60"), "{subject}");
    assert!(m["to"].as_str().is_some_and(|t| t.contains("finance@example.org") && t.contains("ml-leads@")), "{m}");
    let html = m["html"].as_str().expect("html");
    assert!(html.contains("<html") || html.contains("<!DOCTYPE"), "an HTML body");
    assert!(html.contains("5.70") && html.contains("3.90"), "team ml's dollars in the HTML body");
    assert!(m["text"].as_str().is_some_and(|t| t.contains("• ml: $5.70 total, $3.90 idle ($2.70 stranded)")), "{m}");
    let attachments: Vec<&str> = m["attachments"].as_array().expect("list").iter().filter_map(Value::as_str).collect();
    for name in ["report.xlsx", "summary.csv", "teams.csv", "top_stranded.csv", "prices.csv"] {
        assert!(attachments.contains(&format!("apron-2026-W47-{name}").as_str()), "{name} in {attachments:?}");
    }
    assert!(!attachments.iter().any(|a| a.ends_with(".html")), "HTML is the body: {attachments:?}");
    assert!(m["xlsx_cells"].as_u64().is_some_and(|n| n > 20), "{m}");
    assert_eq!(m["xlsx_mismatches"], serde_json::json!([]), "the workbook equals the CSVs");

    let got = hooks.lock().expect("lock").clone();
    assert_eq!(got.len(), 2, "the first answer was 500: retried once");
    let hook = &got[1];
    assert!(hook.head.starts_with("post /hook"), "{}", hook.head);
    assert!(hook.head.contains("authorization: bearer hook-secret-0123"), "{}", hook.head);
    assert!(hook.head.contains("content-type: application/json"), "{}", hook.head);
    let text = hook.body["text"].as_str().expect("Slack-compatible text");
    assert!(text.contains("2026-W47") && text.contains("$6.60") && text.contains("• ml: $5.70"), "{text}");
    assert_eq!((hook.body["week"].as_str(), hook.body["teams"][0]["team"].as_str()), (Some("2026-W47"), Some("ml")));
    assert_eq!(hook.body["teams"][0]["cost_usd"].as_f64(), Some(5.7));
    assert_eq!(hook.body["fleet"]["cost_usd"].as_f64(), Some(6.6));

    for name in ["report.html", "report.json", "report.xlsx", "teams.csv"] {
        assert!(export.join(format!("apron-2026-W47-{name}")).is_file(), "exported {name}");
    }
    let data = store.data_dir().to_path_buf();
    let sent: Value =
        serde_json::from_slice(&std::fs::read(data.join("reports/2026-W47/sent.json")).expect("sent.json written"))
            .expect("json");
    assert_eq!(sent["week"], "2026-W47");
    for d in ["dir", "email", "webhook"] {
        assert!(sent["delivered"][d]["at"].as_str().is_some_and(|t| t.starts_with("2026-11-23T06:01")), "{sent}");
    }
    assert_eq!(sent["delivered"]["webhook"]["tries"], 2, "{sent}");
    assert_eq!(sent["failed"], serde_json::json!({}), "{sent}");
    // Delivered, the week is closed: its frozen copy is byte for byte what was sent.
    assert_eq!(
        std::fs::read(data.join("reports/2026-W47/report.html")).expect("frozen at delivery"),
        std::fs::read(export.join("apron-2026-W47-report.html")).expect("exported")
    );

    // Later passes (and a restart: the record is on disk) send nothing.
    for now in [monday_w48(6, 2), monday_w48(23, 0), monday_w48(30, 0)] {
        let r = schedule.run_once(now).await;
        assert_eq!((r.delivered.len(), r.errors.len()), (0, 0), "{r:?}");
    }
    let again = apron::schedule::Schedule::new(server.engine().clone(), None, data.clone(), config);
    assert!(again.run_once(monday_w48(7, 0)).await.delivered.is_empty());
    assert_eq!(smtp.messages().len(), 1);
    assert_eq!(hooks.lock().expect("lock").len(), 2);

    // `apron report --send`: refused for a delivered week; `--resend` sends it again.
    let cfg = dir.path().join("apron.toml");
    std::fs::write(
        &cfg,
        format!(
            "[storage]\ndata_dir = {:?}\n[cost]\nprice_book = {:?}\n[report.email]\nsmtp_host = \"127.0.0.1\"\nsmtp_port = {}\ntls = \"none\"\nfrom = \"apron@example.org\"\nto = [\"ops@example.org\"]\nformats = [\"html\", \"csv\"]\n",
            data.display().to_string(),
            book.display().to_string(),
            smtp.port
        ),
    )
    .expect("config");
    let out = dir.path().join("out");
    let cli = move |extra: &'static [&'static str]| {
        let (cfg, out) = (cfg.clone(), out.clone());
        tokio::task::spawn_blocking(move || {
            Command::new(super::APRON)
                .args(["report", "--week", "2026-W47", "--format", "json", "--config"])
                .arg(&cfg)
                .arg("--out")
                .arg(&out)
                .args(extra)
                .env_remove("APRON_DATA")
                .output()
                .expect("apron report runs")
        })
    };
    let o = cli(&["--send"]).await.expect("join");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("already delivered") && err.contains("--resend"), "{err}");
    let o = cli(&["--send", "--resend"]).await.expect("join");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mail = smtp.messages();
    assert_eq!(mail.len(), 2, "{mail:?}");
    let resent = mail.iter().find(|m| m["to"].as_str().is_some_and(|t| t.contains("ops@"))).expect("the resend");
    assert!(resent["subject"].as_str().is_some_and(|s| s.contains("2026-W47")), "{resent}");
    let attachments = resent["attachments"].as_array().expect("list");
    assert!(attachments.iter().any(|a| a == "apron-2026-W47-teams.csv"), "{resent}");
    assert!(!attachments.iter().any(|a| a.as_str().is_some_and(|a| a.ends_with(".xlsx"))), "formats honoured");
}

/// A CA and a certificate for `localhost` signed by it (the `openssl` CLI).
fn make_certs(dir: &Path) -> Option<(PathBuf, PathBuf, PathBuf)> {
    let (ca_key, ca, key, csr, cert) =
        (dir.join("ca.key"), dir.join("ca.pem"), dir.join("key.pem"), dir.join("req.csr"), dir.join("cert.pem"));
    let ext = dir.join("ext.cnf");
    std::fs::write(&ext, "subjectAltName = DNS:localhost\nbasicConstraints = CA:FALSE\n").ok()?;
    let openssl = |args: &[&std::ffi::OsStr]| {
        Command::new("openssl").args(args).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
    };
    let s = |p: &Path| p.as_os_str().to_owned();
    let o = std::ffi::OsString::from;
    let ok = openssl(&[
        &o("req"),
        &o("-x509"),
        &o("-newkey"),
        &o("rsa:2048"),
        &o("-nodes"),
        &o("-days"),
        &o("2"),
        &o("-subj"),
        &o("/CN=apron test CA"),
        &o("-keyout"),
        &s(&ca_key),
        &o("-out"),
        &s(&ca),
        &o("-addext"),
        &o("basicConstraints=critical,CA:TRUE"),
        &o("-addext"),
        &o("keyUsage=critical,keyCertSign"),
    ]) && openssl(&[
        &o("req"),
        &o("-newkey"),
        &o("rsa:2048"),
        &o("-nodes"),
        &o("-subj"),
        &o("/CN=localhost"),
        &o("-keyout"),
        &s(&key),
        &o("-out"),
        &s(&csr),
    ]) && openssl(&[
        &o("x509"),
        &o("-req"),
        &o("-in"),
        &s(&csr),
        &o("-CA"),
        &s(&ca),
        &o("-CAkey"),
        &s(&ca_key),
        &o("-CAcreateserial"),
        &o("-days"),
        &o("2"),
        &o("-extfile"),
        &s(&ext),
        &o("-out"),
        &s(&cert),
    ]);
    ok.then_some((ca, cert, key))
}

/// STARTTLS for real: aiosmtpd requires it (`--tlscert`), the schedule trusts the test
/// CA through `ca_file` and verifies the server's name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn email_over_starttls_with_a_private_ca() {
    if !python_tools() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let Some((ca, cert, key)) = make_certs(dir.path()) else {
        assert!(std::env::var_os("APRON_REQUIRE_TOOLS").is_none(), "the openssl CLI is required");
        eprintln!("NOTE: skipping the STARTTLS test: no openssl CLI");
        return;
    };
    let (cert, key) = (cert.display().to_string(), key.display().to_string());
    let smtp = SmtpServer::start(dir.path(), &["--tlscert", &cert, "--tlskey", &key]);
    let server = open(dir.path());
    let email = |tls: TlsMode, ca_file: Option<PathBuf>| EmailConfig {
        smtp_host: "localhost".into(),
        smtp_port: Some(smtp.port),
        tls,
        ca_file,
        username: None,
        password_file: None,
        from: "apron@example.org".into(),
        to: vec!["finance@example.org".into()],
        formats: vec![apron::report::ReportFormat::Html, apron::report::ReportFormat::Csv],
        timeout: Duration::from_secs(20),
    };
    let schedule = |e: EmailConfig| {
        let config = ReportConfig { enabled: true, tries: 1, email: Some(e), ..ReportConfig::default() };
        apron::schedule::Schedule::new(server.engine().clone(), None, server.store().data_dir().to_path_buf(), config)
    };
    let week = apron_cost::IsoWeek::parse("2026-W47").expect("week");
    // Without the CA the certificate is not trusted: nothing goes out in clear either.
    let r = schedule(email(TlsMode::Starttls, None)).send(week, false, monday_w48(6, 1)).await.expect("send");
    assert!(
        r.delivered.is_empty() && r.errors.len() == 1 && r.errors[0].starts_with("email: SMTP localhost:"),
        "{r:?}"
    );
    assert!(smtp.messages().is_empty());
    let r = schedule(email(TlsMode::Starttls, Some(ca))).send(week, false, monday_w48(6, 2)).await.expect("send");
    assert_eq!(r.errors, Vec::<String>::new());
    let mail = smtp.messages();
    assert_eq!(mail.len(), 1, "{mail:?}");
    assert!(mail[0]["subject"].as_str().is_some_and(|s| s.contains("2026-W47")), "{mail:?}");
}
