//! One ingest request, and what its answer means.
//!
//! A small blocking client (ureq) on the shipper's own thread: no async runtime to share
//! with `/metrics`, and one request at a time is exactly the in-order delivery the spool
//! needs. Proxies from the environment are not used (the library reads no environment).
//!
//! `https://` collectors: rustls on ring, verifying the collector's certificate against
//! `shipper.ca_file` when set, else against the public web PKI roots (Mozilla's, built
//! in). A TLS failure is a retry like any network error (the batch stays in the spool);
//! its reason says what is wrong and which setting to look at.

use std::time::{Duration, Instant};

use apron_common::wire::headers;
use ureq::tls::{Certificate, RootCerts, TlsConfig, TlsProvider};

use super::Batch;
use crate::config::ShipperConfig;

/// Error bodies are short JSON; more than this is not read.
const MAX_ERROR_BODY: u64 = 64 * 1024;

/// What to do with a batch after one attempt.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// 2xx: durable in the collector's WAL.
    Acked { duplicate: bool, latency: Duration },
    /// Worth retrying later: no connection, timeout, 429, 5xx, or an unexpected status.
    Retry { reason: String, retry_after: Option<Duration> },
    /// 401/403: the token is wrong; retried (nothing is lost) while an operator fixes it.
    Unauthorized { status: u16, detail: String },
    /// 400, 413, 422: this batch can never succeed.
    Rejected { status: u16, detail: String },
}

pub struct Client {
    agent: ureq::Agent,
    url: String,
    authorization: String,
    agent_id: String,
    /// Whom the collector's certificate must chain to, for error messages.
    trust: String,
}

impl Client {
    pub fn new(config: &ShipperConfig) -> Self {
        let tls = TlsConfig::builder()
            .provider(TlsProvider::Rustls)
            .unversioned_rustls_crypto_provider(apron_http::tls::ring_provider());
        let (tls, trust) = match &config.ca {
            Some(ca) => {
                let certs: Vec<Certificate<'static>> =
                    ca.certs.iter().map(|c| Certificate::from_der(c.as_ref()).to_owned()).collect();
                (
                    tls.root_certs(RootCerts::new_with_certs(&certs)),
                    format!("the CA in shipper.ca_file ({})", ca.path.display()),
                )
            }
            None => (tls.root_certs(RootCerts::WebPki), "the public web PKI roots (no shipper.ca_file)".to_owned()),
        };
        let agent = ureq::Agent::config_builder()
            .tls_config(tls.build())
            .timeout_global(Some(config.request_timeout))
            .http_status_as_error(false)
            .proxy(None)
            .user_agent(concat!("apron-agent/", env!("CARGO_PKG_VERSION")))
            .build()
            .into();
        Self {
            agent,
            url: format!("{}/api/v1/ingest", config.collector),
            authorization: format!("Bearer {}", config.token),
            agent_id: config.agent_id.clone(),
            trust,
        }
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn send(&self, batch: &Batch) -> Outcome {
        let started = Instant::now();
        let sent = self
            .agent
            .post(&self.url)
            .header("authorization", &self.authorization)
            .header("content-type", headers::ARROW_STREAM)
            .header(headers::TABLE, batch.table.name())
            .header(headers::AGENT, &self.agent_id)
            .header(headers::EPOCH, &*batch.epoch)
            .header(headers::SEQUENCE, batch.seq.to_string())
            .send(&batch.body[..]);
        let mut resp = match sent {
            Ok(r) => r,
            Err(e) => return Outcome::Retry { reason: describe(&e, &self.trust), retry_after: None },
        };
        let status = resp.status().as_u16();
        let retry_after = resp
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        // Reading the answer to its end also lets the connection be reused.
        let text = resp.body_mut().with_config().limit(MAX_ERROR_BODY).read_to_string().unwrap_or_default();
        if (200..300).contains(&status) {
            // The status is the acknowledgement; the body only adds the duplicate flag.
            let duplicate = serde_json::from_str::<serde_json::Value>(&text)
                .ok()
                .and_then(|v| v.get("duplicate")?.as_bool())
                .unwrap_or(false);
            return Outcome::Acked { duplicate, latency: started.elapsed() };
        }
        classify(status, error_detail(&text), retry_after)
    }
}

/// Maps a non-2xx status to an outcome.
pub fn classify(status: u16, detail: String, retry_after: Option<Duration>) -> Outcome {
    match status {
        400 | 413 | 422 => Outcome::Rejected { status, detail },
        401 | 403 => Outcome::Unauthorized { status, detail },
        _ => Outcome::Retry {
            reason: if detail.is_empty() { format!("HTTP {status}") } else { format!("HTTP {status}: {detail}") },
            retry_after,
        },
    }
}

/// `{"error": "...", "detail": "..."}` as one line; other bodies shortened.
pub fn error_detail(body: &str) -> String {
    if let Ok(v) = serde_json::from_str::<serde_json::Value>(body) {
        let field = |k: &str| v.get(k).and_then(|x| x.as_str()).filter(|s| !s.is_empty());
        match (field("error"), field("detail")) {
            (Some(e), Some(d)) => return format!("{e}: {d}"),
            (Some(e), None) => return e.to_owned(),
            (None, Some(d)) => return d.to_owned(),
            (None, None) => {}
        }
    }
    body.trim().chars().take(300).collect()
}

fn describe(e: &ureq::Error, trust: &str) -> String {
    match e {
        ureq::Error::Rustls(tls) => describe_tls(tls, trust),
        ureq::Error::Io(io) => match io.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>()) {
            Some(tls) => describe_tls(tls, trust),
            None => format!("{} ({:?})", io, io.kind()),
        },
        ureq::Error::Timeout(t) => format!("timed out ({t:?})"),
        other => other.to_string(),
    }
}

/// A TLS failure in words an operator can act on.
pub fn describe_tls(e: &rustls::Error, trust: &str) -> String {
    use rustls::{CertificateError, Error};
    let hint = match e {
        Error::InvalidCertificate(CertificateError::UnknownIssuer | CertificateError::BadSignature) => {
            format!("the collector's certificate is not signed by {trust}")
        }
        Error::InvalidCertificate(
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
        ) => "the collector's certificate does not name the host in agent.collector".to_owned(),
        Error::InvalidCertificate(CertificateError::Expired | CertificateError::ExpiredContext { .. }) => {
            "the collector's certificate has expired".to_owned()
        }
        Error::InvalidCertificate(_) => format!("the collector's certificate was refused (trusting {trust})"),
        Error::InvalidMessage(_) | Error::InappropriateMessage { .. } => {
            "the collector does not speak TLS there (use http:// for a plain-HTTP collector)".to_owned()
        }
        Error::AlertReceived(_) => "the collector refused the TLS handshake".to_owned(),
        _ => "the TLS handshake with the collector failed".to_owned(),
    };
    format!("TLS: {hint} ({e})")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_codes_map_to_outcomes() {
        for s in [400, 413, 422] {
            assert!(matches!(classify(s, String::new(), None), Outcome::Rejected { .. }), "{s}");
        }
        assert!(matches!(classify(401, String::new(), None), Outcome::Unauthorized { status: 401, .. }));
        for s in [404, 408, 429, 500, 502, 503, 504, 507] {
            assert!(matches!(classify(s, String::new(), None), Outcome::Retry { .. }), "{s}");
        }
        let Outcome::Retry { retry_after, reason } = classify(429, "slow down".into(), Some(Duration::from_secs(3)))
        else {
            panic!("429 is retried")
        };
        assert_eq!(retry_after, Some(Duration::from_secs(3)));
        assert_eq!(reason, "HTTP 429: slow down");
    }

    #[test]
    fn tls_failures_say_what_to_fix() {
        let trust = "the CA in shipper.ca_file (/etc/apron/ca.crt)";
        let e = rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer);
        let msg = describe_tls(&e, trust);
        assert!(
            msg.starts_with("TLS: the collector's certificate is not signed by the CA in shipper.ca_file"),
            "{msg}"
        );
        assert!(msg.contains("/etc/apron/ca.crt") && msg.contains("UnknownIssuer"), "{msg}");
        let e = rustls::Error::InvalidCertificate(rustls::CertificateError::NotValidForName);
        assert!(describe_tls(&e, trust).contains("does not name the host"));
        let e = rustls::Error::InvalidMessage(rustls::InvalidMessage::InvalidContentType);
        assert!(describe_tls(&e, trust).contains("use http://"));
        let io = std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer),
        );
        let msg = describe(&ureq::Error::Io(io), trust);
        assert!(msg.contains("not signed by"), "{msg}");
    }

    #[test]
    fn error_bodies_become_one_line() {
        assert_eq!(error_detail(r#"{"error":"wrong schema","detail":"column x"}"#), "wrong schema: column x");
        assert_eq!(error_detail(r#"{"error":"bad token"}"#), "bad token");
        assert_eq!(error_detail("  plain text\n"), "plain text");
    }
}
