//! OTLP: pushing the agent's GPU metrics to an OpenTelemetry endpoint (cargo feature
//! `otlp`, off by default).
//!
//! ```text
//!  AgentState (the state /metrics encodes) ──► metrics::snapshot ──► ExportMetricsServiceRequest
//!   last window per GPU, busy-time integrals      hw.gpu.* / hw.* names where     one ResourceMetrics
//!                                                  OpenTelemetry has one,          per host
//!                                                  apron.gpu.* otherwise              │
//!                                                                                     ▼
//!                                   export thread ("otlp"), every `interval`: gRPC (tonic) or
//!                                   HTTP/protobuf (ureq) POST …/v1/metrics; one last export at stop
//! ```
//!
//! Every export is a snapshot of the state, as a scrape is: a label set that disappears
//! (a pod leaves, a GPU is lost) is simply not in the next request, and counters are
//! cumulative from the agent's start, so a failed export loses nothing that the next one
//! does not carry. `docs/otlp.md` has the mapping table.
//!
//! This module's configuration half ([`OtlpSection`], [`OtlpConfig`]) is always compiled,
//! so a config file with `[otlp]` parses the same in every build and a build without the
//! feature says so instead of ignoring the section.

#[cfg(feature = "otlp")]
mod export;
#[cfg(feature = "otlp")]
pub mod metrics;

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

use crate::config::{ConfigError, parse_duration};

#[cfg(feature = "otlp")]
pub use export::{OtlpExporter, StartError, start};

/// Whether this build can export over OTLP.
pub const COMPILED: bool = cfg!(feature = "otlp");

/// The OTLP transport.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// OTLP/gRPC: `opentelemetry.proto.collector.metrics.v1.MetricsService/Export`
    /// (usually port 4317).
    Grpc,
    /// OTLP/HTTP with a binary protobuf body: `POST <endpoint>/v1/metrics` (usually
    /// port 4318).
    HttpProtobuf,
}

impl Protocol {
    pub const fn name(self) -> &'static str {
        match self {
            Protocol::Grpc => "grpc",
            Protocol::HttpProtobuf => "http/protobuf",
        }
    }
}

/// `[otlp]` as written. The section is absent (or has no key) when OTLP is off.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OtlpSection {
    /// The receiver's base URL, e.g. `http://otel-collector:4317` (gRPC) or
    /// `http://otel-collector:4318` (HTTP; `/v1/metrics` is appended unless the URL
    /// already ends with it).
    pub endpoint: Option<String>,
    /// `"grpc"` (default) or `"http/protobuf"`.
    pub protocol: Option<String>,
    /// Export interval (humantime), default 10s.
    pub interval: Option<String>,
    /// Extra request headers (gRPC metadata), e.g. `{ authorization = "Bearer …" }`.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Per-request timeout (humantime), default 10s.
    pub timeout: Option<String>,
}

/// OTLP export settings, validated. `Debug` leaves header values out (they usually
/// carry credentials).
#[derive(Clone)]
pub struct OtlpConfig {
    /// The URL requests go to: the gRPC endpoint as given, or the HTTP URL ending in
    /// `/v1/metrics`.
    pub url: String,
    pub protocol: Protocol,
    pub interval: Duration,
    /// Header names lower-cased (gRPC metadata keys must be).
    pub headers: Vec<(String, String)>,
    pub timeout: Duration,
}

impl std::fmt::Debug for OtlpConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OtlpConfig")
            .field("url", &self.url)
            .field("protocol", &self.protocol)
            .field("interval", &self.interval)
            .field("headers", &self.headers.iter().map(|(k, _)| format!("{k}: <redacted>")).collect::<Vec<_>>())
            .field("timeout", &self.timeout)
            .finish()
    }
}

pub const DEFAULT_INTERVAL: &str = "10s";
pub const DEFAULT_TIMEOUT: &str = "10s";

fn invalid(key: &str, value: impl Into<String>, expected: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { key: key.to_owned(), value: value.into(), expected: expected.into() }
}

fn duration_in(
    key: &str,
    text: Option<String>,
    default: &str,
    max: Duration,
    range: &str,
) -> Result<Duration, ConfigError> {
    let text = text.unwrap_or_else(|| default.to_owned());
    let d = parse_duration(key, &text)?;
    if !(Duration::from_millis(100)..=max).contains(&d) {
        return Err(invalid(key, text, range));
    }
    Ok(d)
}

impl OtlpSection {
    fn is_empty(&self) -> bool {
        self.endpoint.is_none()
            && self.protocol.is_none()
            && self.interval.is_none()
            && self.headers.is_empty()
            && self.timeout.is_none()
    }

    /// Validates the section: `None` when it is absent. A section with keys needs an
    /// `endpoint`, and a build without the `otlp` feature refuses it.
    pub fn resolve(self) -> Result<Option<OtlpConfig>, ConfigError> {
        if self.is_empty() {
            return Ok(None);
        }
        let Some(endpoint) = self.endpoint else {
            return Err(invalid(
                "otlp.endpoint",
                "",
                "the receiver's URL, e.g. \"http://otel-collector:4317\" (required when [otlp] is present)",
            ));
        };
        if !COMPILED {
            return Err(invalid(
                "otlp.endpoint",
                endpoint,
                "this apron-agent was built without OTLP support: rebuild with `--features otlp` (cargo build -p apron-agent --features otlp), or remove the [otlp] section",
            ));
        }
        let protocol = match self.protocol.as_deref() {
            None | Some("grpc") => Protocol::Grpc,
            Some("http/protobuf") => Protocol::HttpProtobuf,
            Some(other) => {
                return Err(invalid(
                    "otlp.protocol",
                    other,
                    "\"grpc\" or \"http/protobuf\" (http/json is not supported)",
                ));
            }
        };
        let trimmed = endpoint.trim_end_matches('/');
        let rest = trimmed.strip_prefix("http://").or_else(|| trimmed.strip_prefix("https://"));
        let host = rest.map(|r| r.split('/').next().unwrap_or_default()).unwrap_or_default();
        if host.is_empty() || trimmed.contains(char::is_whitespace) {
            return Err(invalid(
                "otlp.endpoint",
                endpoint,
                "an http:// or https:// URL with a host, e.g. \"http://otel-collector:4317\"",
            ));
        }
        let url = match protocol {
            Protocol::Grpc => trimmed.to_owned(),
            Protocol::HttpProtobuf if trimmed.ends_with("/v1/metrics") => trimmed.to_owned(),
            Protocol::HttpProtobuf => format!("{trimmed}/v1/metrics"),
        };
        let interval = duration_in(
            "otlp.interval",
            self.interval,
            DEFAULT_INTERVAL,
            Duration::from_secs(3600),
            "between 100ms and 1h",
        )?;
        let timeout = duration_in(
            "otlp.timeout",
            self.timeout,
            DEFAULT_TIMEOUT,
            Duration::from_secs(600),
            "between 100ms and 10m",
        )?;
        let mut headers = Vec::with_capacity(self.headers.len());
        for (name, value) in self.headers {
            let key = format!("otlp.headers.{name}");
            let lower = name.to_ascii_lowercase();
            // gRPC metadata keys: lower-case token characters; `-bin` keys carry binary
            // values, which a TOML string cannot.
            let name_ok = axum::http::HeaderName::from_bytes(lower.as_bytes()).is_ok()
                && lower.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
                && !lower.ends_with("-bin");
            if !name_ok {
                return Err(invalid(
                    &key,
                    name,
                    "a header name of letters, digits, '-', '_' or '.' (not ending in -bin)",
                ));
            }
            let value_ok = axum::http::HeaderValue::from_str(&value).is_ok()
                && value.bytes().all(|b| b == b' ' || b.is_ascii_graphic())
                && value.trim() == value;
            if !value_ok {
                // The value is not echoed: it is usually a credential.
                return Err(invalid(&key, "<hidden>", "visible ASCII characters (spaces allowed inside)"));
            }
            headers.push((lower, value));
        }
        Ok(Some(OtlpConfig { url, protocol, interval, headers, timeout }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section(text: &str) -> OtlpSection {
        toml::from_str(text).expect("parses")
    }

    #[test]
    fn absent_section_is_off() {
        assert!(section("").resolve().expect("valid").is_none());
    }

    #[test]
    fn endpoint_is_required() {
        let msg = section("interval = \"5s\"").resolve().expect_err("no endpoint").to_string();
        assert!(msg.contains("otlp.endpoint") && msg.contains("required"), "{msg}");
    }

    #[cfg(not(feature = "otlp"))]
    #[test]
    fn a_build_without_the_feature_refuses_the_section() {
        let msg = section("endpoint = \"http://c:4317\"").resolve().expect_err("no feature").to_string();
        assert!(msg.contains("otlp.endpoint") && msg.contains("--features otlp"), "{msg}");
    }

    #[cfg(feature = "otlp")]
    #[test]
    fn defaults_urls_and_headers() {
        let c = section("endpoint = \"http://c:4317/\"").resolve().expect("valid").expect("on");
        assert_eq!(c.url, "http://c:4317");
        assert_eq!(c.protocol, Protocol::Grpc);
        assert_eq!(c.interval, Duration::from_secs(10));
        assert_eq!(c.timeout, Duration::from_secs(10));

        let c = section(
            "endpoint = \"https://c:4318\"\nprotocol = \"http/protobuf\"\ninterval = \"1s\"\ntimeout = \"2s\"\n[headers]\nAuthorization = \"Bearer s3cret\"\n",
        )
        .resolve()
        .expect("valid")
        .expect("on");
        assert_eq!(c.url, "https://c:4318/v1/metrics");
        assert_eq!(c.protocol, Protocol::HttpProtobuf);
        assert_eq!((c.interval, c.timeout), (Duration::from_secs(1), Duration::from_secs(2)));
        assert_eq!(c.headers, vec![("authorization".to_owned(), "Bearer s3cret".to_owned())]);
        assert!(!format!("{c:?}").contains("s3cret"), "Debug hides header values");

        let c = section("endpoint = \"http://c/otlp/v1/metrics\"\nprotocol = \"http/protobuf\"")
            .resolve()
            .expect("valid")
            .expect("on");
        assert_eq!(c.url, "http://c/otlp/v1/metrics", "a full signal URL is kept");
    }

    #[cfg(feature = "otlp")]
    #[test]
    fn bad_values_name_the_key() {
        let bad = |text: &str, key: &str, value: &str| {
            let msg = section(text).resolve().expect_err(text).to_string();
            assert!(msg.contains(key) && msg.contains(value), "{text}: {msg}");
        };
        bad("endpoint = \"c:4317\"", "otlp.endpoint", "c:4317");
        bad("endpoint = \"http://\"", "otlp.endpoint", "http://");
        bad("endpoint = \"http://c\"\nprotocol = \"http/json\"", "otlp.protocol", "http/json");
        bad("endpoint = \"http://c\"\ninterval = \"10ms\"", "otlp.interval", "between 100ms and 1h");
        bad("endpoint = \"http://c\"\ntimeout = \"soon\"", "otlp.timeout", "soon");
        bad("endpoint = \"http://c\"\n[headers]\n\"a b\" = \"x\"", "otlp.headers.a b", "header name");
        let msg = section("endpoint = \"http://c\"\n[headers]\nx-key = \"s3cret\\n\"").resolve().expect_err("newline");
        assert!(!msg.to_string().contains("s3cret"), "the value is not echoed: {msg}");
        let msg = toml::from_str::<OtlpSection>("endpoint = \"http://c\"\nendpont = \"x\"").expect_err("unknown key");
        assert!(msg.to_string().contains("endpont"), "{msg}");
    }
}
