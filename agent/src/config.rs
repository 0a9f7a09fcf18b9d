//! Agent configuration: the TOML file, and the plain [`AgentConfig`] the library runs on.
//!
//! The binary reads the file, applies flag and `APRON_*` environment overrides (clap does
//! the environment), then calls [`FileConfig::resolve`]. Unknown keys are rejected by
//! serde (`deny_unknown_fields` names the key and what was expected); values are checked
//! here, and every error names the key, the value and the allowed range.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use apron_common::{ClusterName, HostName};
use apron_http::tls::TlsConfig;
use apron_http::webconfig::WebConfig;
use rustls_pki_types::CertificateDer;
use serde::Deserialize;

use crate::attribution::AttributionConfig;
use crate::sampler::FieldGroup;
use crate::source::sim::SimConfig;

/// The default `/metrics` listener. Loopback: nothing listens beyond what the config
/// names. Set `listen = "0.0.0.0:9401"` for a Prometheus on another host.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:9401";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("invalid config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("invalid value for `{key}`: {value:?} — {expected}")]
    Invalid { key: String, value: String, expected: String },
    /// A setting that names files (TLS, web config) whose content is unusable; the
    /// message names the file and the problem.
    #[error("{key}: {message}")]
    Setting { key: String, message: String },
}

fn invalid(key: impl Into<String>, value: impl Into<String>, expected: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { key: key.into(), value: value.into(), expected: expected.into() }
}

/// Which GPU source to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum SourceKind {
    /// The real driver through NVML.
    Nvml,
    /// A simulated fleet.
    Sim,
}

/// The config file as written. Durations are humantime strings (`100ms`, `5s`).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    #[serde(default)]
    pub agent: AgentSection,
    /// Per-field-group intervals, e.g. `utilization = "100ms"`.
    #[serde(default)]
    pub samplers: SamplersSection,
    #[serde(default)]
    pub attribution: AttributionConfig,
    #[serde(default)]
    pub sim: SimConfig,
    /// Shipping to the collector (used only when `agent.collector` is set).
    #[serde(default)]
    pub shipper: ShipperSection,
    /// Pushing metrics to an OpenTelemetry endpoint (cargo feature `otlp`).
    #[serde(default)]
    pub otlp: crate::otlp::OtlpSection,
}

/// The collector this host ships to. `list` is one URL, or several separated by commas:
/// the collectors of a sharded fleet (a StatefulSet's pods), of which each host takes
/// the one its name ranks highest (rendezvous hashing). So a host always ships to the
/// same shard, and a collector added or removed moves only the hosts it wins or
/// held. FNV-1a with MurmurHash3's finalizer (so URLs that differ in one character
/// still score independently): the same choice in every build.
fn pick_collector(list: &str, hostname: &str) -> Result<String, ConfigError> {
    let urls: Vec<&str> = list.split(',').map(str::trim).collect();
    if let Some(url) = urls.iter().find(|u| !(u.starts_with("http://") || u.starts_with("https://"))) {
        return Err(invalid("agent.collector", *url, "an http:// or https:// URL (several: separated by commas)"));
    }
    let score = |url: &str| {
        let key = format!("{hostname}\n{}", url.trim_end_matches('/'));
        let h =
            key.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3));
        let h = (h ^ (h >> 33)).wrapping_mul(0xff51_afd7_ed55_8ccd);
        let h = (h ^ (h >> 33)).wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        h ^ (h >> 33)
    };
    let best = urls.iter().max_by_key(|u| (score(u), **u)).copied().unwrap_or_default();
    Ok(best.to_owned())
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentSection {
    pub source: Option<SourceKind>,
    pub nvml_lib: Option<PathBuf>,
    pub listen: Option<String>,
    pub collector: Option<String>,
    pub window: Option<String>,
    pub hostname: Option<String>,
    pub cluster: Option<String>,
    /// Append every closed window as a JSON line to this file (debugging, tests).
    pub windows_out: Option<PathBuf>,
    /// A Prometheus exporter-toolkit web config (TLS, basic auth) for `/metrics`.
    pub web_config_file: Option<PathBuf>,
    /// TLS for `/metrics` without a web config (`[agent.tls]`).
    pub tls: Option<TlsConfig>,
}

#[derive(Debug, Default, Deserialize)]
pub struct SamplersSection {
    /// Field groups not to sample at all.
    #[serde(default)]
    pub disabled: Vec<String>,
    /// `<field group> = "<interval>"`; a key that names no field group is refused when
    /// the file is parsed.
    #[serde(flatten)]
    pub intervals: BTreeMap<FieldGroup, String>,
}

/// `[shipper]`: how windows travel to the collector. Durations are humantime strings.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShipperSection {
    /// The ingest bearer token (prefer `token_file` or `APRON_COLLECTOR_TOKEN`).
    pub token: Option<String>,
    /// A file holding the token; wins over `token`.
    pub token_file: Option<PathBuf>,
    pub agent_id: Option<String>,
    pub flush_interval: Option<String>,
    pub spool_dir: Option<PathBuf>,
    pub spool_max_bytes: Option<ByteSize>,
    pub request_timeout: Option<String>,
    pub max_batch_rows: Option<i64>,
    pub max_backoff: Option<String>,
    /// PEM CA certificate(s) to trust for an `https://` collector instead of the public
    /// web PKI roots.
    pub ca_file: Option<PathBuf>,
}

/// Sizes in the agent's config ([`apron_common::size`], shared with the server's).
pub use apron_common::size::{ByteSize, parse_bytes};

/// Shipping settings, validated. `Debug` leaves the token out.
#[derive(Clone)]
pub struct ShipperConfig {
    /// The collector's base URL, without a trailing `/`.
    pub collector: String,
    pub token: String,
    pub agent_id: String,
    pub flush_interval: Duration,
    pub spool_dir: PathBuf,
    pub spool_max_bytes: u64,
    pub request_timeout: Duration,
    pub max_batch_rows: usize,
    pub max_backoff: Duration,
    /// The CA(s) an `https://` collector's certificate must chain to; `None`: the public
    /// web PKI roots (Mozilla's, built in).
    pub ca: Option<CollectorCa>,
}

/// `shipper.ca_file`, loaded.
#[derive(Clone)]
pub struct CollectorCa {
    pub path: PathBuf,
    pub certs: Arc<Vec<CertificateDer<'static>>>,
}

impl std::fmt::Debug for CollectorCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({} certificates)", self.path.display(), self.certs.len())
    }
}

impl std::fmt::Debug for ShipperConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShipperConfig")
            .field("collector", &self.collector)
            .field("token", &"<redacted>")
            .field("agent_id", &self.agent_id)
            .field("flush_interval", &self.flush_interval)
            .field("spool_dir", &self.spool_dir)
            .field("spool_max_bytes", &self.spool_max_bytes)
            .field("request_timeout", &self.request_timeout)
            .field("max_batch_rows", &self.max_batch_rows)
            .field("max_backoff", &self.max_backoff)
            .field("ca", &self.ca)
            .finish()
    }
}

pub const DEFAULT_SPOOL_DIR: &str = "/var/lib/apron-agent/spool";
pub const DEFAULT_SPOOL_MAX_BYTES: u64 = 512 << 20;
pub const DEFAULT_MAX_BATCH_ROWS: usize = 50_000;
const SPOOL_MIN_BYTES: u64 = 1 << 10;
const SPOOL_MAX_BYTES: u64 = 1 << 44;
const MAX_BATCH_ROWS: i64 = 10_000_000;

/// A value that can travel in an HTTP header unchanged: visible ASCII, no spaces.
fn header_safe(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_graphic())
}

fn duration_in(
    key: &str,
    text: Option<String>,
    default: &str,
    min: Duration,
    max: Duration,
    range: &str,
) -> Result<Duration, ConfigError> {
    let text = text.unwrap_or_else(|| default.to_owned());
    let d = parse_duration(key, &text)?;
    if !(min..=max).contains(&d) {
        return Err(invalid(key, text, range));
    }
    Ok(d)
}

impl ShipperSection {
    /// Validates every value; the token is required (and `token_file` read) only when
    /// there is a collector to ship to.
    fn resolve(
        self,
        collector: Option<&str>,
        token_override: Option<String>,
        default_agent_id: &str,
    ) -> Result<Option<ShipperConfig>, ConfigError> {
        let flush_interval = duration_in(
            "shipper.flush_interval",
            self.flush_interval,
            "5s",
            Duration::from_millis(100),
            Duration::from_secs(3600),
            "between 100ms and 1h",
        )?;
        let request_timeout = duration_in(
            "shipper.request_timeout",
            self.request_timeout,
            "10s",
            Duration::from_millis(100),
            Duration::from_secs(600),
            "between 100ms and 10m",
        )?;
        let max_backoff = duration_in(
            "shipper.max_backoff",
            self.max_backoff,
            "30s",
            Duration::from_millis(100),
            Duration::from_secs(3600),
            "between 100ms and 1h",
        )?;
        let spool_max_bytes = match &self.spool_max_bytes {
            None => DEFAULT_SPOOL_MAX_BYTES,
            Some(v) => match v.bytes() {
                Some(n) if (SPOOL_MIN_BYTES..=SPOOL_MAX_BYTES).contains(&n) => n,
                _ => {
                    return Err(invalid(
                        "shipper.spool_max_bytes",
                        v.text(),
                        "a size between 1KiB and 16TiB: a number of bytes or a string such as \"512MiB\" (KiB, MiB, GiB, TiB; KB, MB, GB, TB)",
                    ));
                }
            },
        };
        let max_batch_rows = match self.max_batch_rows {
            None => DEFAULT_MAX_BATCH_ROWS,
            Some(n) if (1..=MAX_BATCH_ROWS).contains(&n) => usize::try_from(n).unwrap_or(DEFAULT_MAX_BATCH_ROWS),
            Some(n) => return Err(invalid("shipper.max_batch_rows", n.to_string(), "between 1 and 10000000")),
        };
        let agent_id = self.agent_id.unwrap_or_else(|| default_agent_id.to_owned());
        if !header_safe(&agent_id) || agent_id.len() > 253 {
            return Err(invalid("shipper.agent_id", agent_id, "1 to 253 visible ASCII characters, no spaces"));
        }
        let spool_dir = self.spool_dir.unwrap_or_else(|| PathBuf::from(DEFAULT_SPOOL_DIR));
        if spool_dir.as_os_str().is_empty() {
            return Err(invalid("shipper.spool_dir", "", "a directory path"));
        }

        let Some(collector) = collector else { return Ok(None) };
        let ca = match &self.ca_file {
            None => None,
            Some(_) if !collector.starts_with("https://") => {
                return Err(invalid(
                    "shipper.ca_file",
                    self.ca_file.as_ref().map(|p| p.display().to_string()).unwrap_or_default(),
                    format!("only an https:// collector is checked against a CA; agent.collector is {collector}"),
                ));
            }
            Some(path) => {
                let setting = |e: apron_http::tls::TlsError| ConfigError::Setting {
                    key: "shipper.ca_file".into(),
                    message: e.to_string(),
                };
                let certs = apron_http::tls::load_certificates(path).map_err(setting)?;
                // Each one must be usable as a trust anchor.
                apron_http::tls::client_root_store(path).map_err(setting)?;
                Some(CollectorCa { path: path.clone(), certs: Arc::new(certs) })
            }
        };
        let (token, key, shown) = if let Some(t) = token_override {
            (t, "APRON_COLLECTOR_TOKEN", "<from the environment>".to_owned())
        } else if let Some(path) = &self.token_file {
            let text = std::fs::read_to_string(path).map_err(|e| {
                invalid(
                    "shipper.token_file",
                    path.display().to_string(),
                    format!("a readable file holding the token ({e})"),
                )
            })?;
            (text.trim().to_owned(), "shipper.token_file", path.display().to_string())
        } else if let Some(t) = self.token {
            (t, "shipper.token", "<hidden>".to_owned())
        } else {
            return Err(invalid(
                "shipper.token",
                "",
                "a collector is set, so an ingest token is required: set shipper.token_file, shipper.token or APRON_COLLECTOR_TOKEN",
            ));
        };
        if !header_safe(&token) {
            return Err(invalid(key, shown, "a non-empty token of visible ASCII characters, no spaces"));
        }
        Ok(Some(ShipperConfig {
            collector: collector.trim_end_matches('/').to_owned(),
            token,
            agent_id,
            flush_interval,
            spool_dir,
            spool_max_bytes,
            request_timeout,
            max_batch_rows,
            max_backoff,
            ca,
        }))
    }
}

/// Command-line (and `APRON_*` environment) overrides; `None` leaves the file's value.
#[derive(Debug, Default, Clone)]
pub struct Overrides {
    pub source: Option<SourceKind>,
    pub nvml_lib: Option<PathBuf>,
    pub listen: Option<String>,
    pub collector: Option<String>,
    pub window: Option<String>,
    pub hostname: Option<String>,
    pub windows_out: Option<PathBuf>,
    /// The ingest token (`APRON_COLLECTOR_TOKEN`); wins over the file's.
    pub collector_token: Option<String>,
    /// `--web-config-file` / `APRON_WEB_CONFIG_FILE`; wins over `agent.web_config_file`.
    pub web_config_file: Option<PathBuf>,
}

/// How `/metrics` and `/healthz` are served: plain HTTP by default; TLS from
/// `[agent.tls]`, or TLS, basic auth and response headers from an exporter-toolkit web
/// config.
#[derive(Debug, Clone, Default)]
pub struct HttpConfig {
    /// TLS settings; `None`: plain HTTP.
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// The web config, where one is set (its TLS is in `tls` already).
    pub web_config: Option<WebConfig>,
}

impl HttpConfig {
    /// Validates the listener's settings, loading certificates and the web config now
    /// so that a bad file stops the agent at start.
    fn resolve(web_config_file: Option<PathBuf>, tls: Option<TlsConfig>) -> Result<HttpConfig, ConfigError> {
        match (web_config_file, tls) {
            (Some(path), Some(_)) => Err(invalid(
                "agent.tls",
                "[agent.tls]",
                format!(
                    "either [agent.tls] or a web config ({}), not both: put the TLS settings in the web config's tls_server_config",
                    path.display()
                ),
            )),
            (Some(path), None) => {
                let web = WebConfig::load(&path).map_err(|e| ConfigError::Setting {
                    key: "agent.web_config_file".into(),
                    message: e.to_string(),
                })?;
                Ok(HttpConfig { tls: web.tls(), web_config: Some(web) })
            }
            (None, Some(tls)) => {
                let server = tls
                    .server_config()
                    .map_err(|e| ConfigError::Setting { key: "[agent.tls]".into(), message: e.to_string() })?;
                Ok(HttpConfig { tls: Some(server), web_config: None })
            }
            (None, None) => Ok(HttpConfig::default()),
        }
    }

    /// `https` or `http`, for the URL the agent logs.
    pub fn scheme(&self) -> &'static str {
        if self.tls.is_some() { "https" } else { "http" }
    }
}

/// Everything the agent runs on, validated.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub source: SourceKind,
    /// `None`: nvml-wrapper's default (`libnvidia-ml.so`, through the loader path).
    pub nvml_lib: Option<PathBuf>,
    pub listen: SocketAddr,
    /// TLS and basic auth for `/metrics`.
    pub http: HttpConfig,
    pub collector: Option<String>,
    pub window: Duration,
    pub hostname: HostName,
    pub cluster: Option<ClusterName>,
    pub windows_out: Option<PathBuf>,
    /// Enabled field groups and their intervals.
    pub intervals: BTreeMap<FieldGroup, Duration>,
    pub attribution: AttributionConfig,
    pub sim: SimConfig,
    /// Shipping to the collector; `None` without a collector.
    pub shipper: Option<ShipperConfig>,
    /// OTLP export; `None` without an `[otlp]` section.
    pub otlp: Option<crate::otlp::OtlpConfig>,
}

/// The window length must divide evenly into whole windows per minute and stay within
/// what the contract's `window_s` column means.
const WINDOW_MIN: Duration = Duration::from_millis(100);
const WINDOW_MAX: Duration = Duration::from_secs(60);
const INTERVAL_MAX: Duration = Duration::from_secs(3600);

pub fn parse_duration(key: &str, value: &str) -> Result<Duration, ConfigError> {
    humantime::parse_duration(value)
        .map_err(|e| invalid(key, value, format!("a duration such as \"100ms\", \"5s\" or \"1m\" ({e})")))
}

impl FileConfig {
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_owned(), source })?;
        Self::parse(&text, path)
    }

    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        toml::from_str(text)
            .map_err(|e| ConfigError::Parse { path: path.to_owned(), message: e.to_string().trim().to_owned() })
    }

    /// Applies overrides and validates. `default_hostname` is the machine's name, which
    /// the binary looks up (libraries do not).
    pub fn resolve(self, o: Overrides, default_hostname: &str) -> Result<AgentConfig, ConfigError> {
        let a = self.agent;
        let source = o.source.or(a.source).unwrap_or(SourceKind::Nvml);
        let listen_text = o.listen.or(a.listen).unwrap_or_else(|| DEFAULT_LISTEN.to_owned());
        let listen: SocketAddr = listen_text.parse().map_err(|_| {
            invalid("agent.listen", &listen_text, "an address such as 127.0.0.1:9401 (port 0 picks a free port)")
        })?;

        let window_text = o.window.or(a.window).unwrap_or_else(|| "1s".to_owned());
        let window = parse_duration("agent.window", &window_text)?;
        if !(WINDOW_MIN..=WINDOW_MAX).contains(&window) {
            return Err(invalid("agent.window", window_text, "between 100ms and 60s"));
        }
        if 60_000_000 % window.as_micros() != 0 {
            return Err(invalid(
                "agent.window",
                window_text,
                "a length that divides one minute evenly (e.g. 1s, 2s, 5s, 10s)",
            ));
        }

        let hostname_text = o.hostname.or(a.hostname).unwrap_or_else(|| default_hostname.to_owned());
        let hostname = HostName::new(hostname_text.clone())
            .map_err(|e| invalid("agent.hostname", hostname_text, e.to_string()))?;
        let cluster = match a.cluster {
            Some(c) => Some(ClusterName::new(c.clone()).map_err(|e| invalid("agent.cluster", c, e.to_string()))?),
            None => None,
        };
        let collector = match o.collector.or(a.collector) {
            Some(list) => Some(pick_collector(&list, hostname.as_str())?),
            None => None,
        };
        let shipper = self.shipper.resolve(collector.as_deref(), o.collector_token, hostname.as_str())?;
        let http = HttpConfig::resolve(o.web_config_file.or(a.web_config_file), a.tls)?;
        let otlp = self.otlp.resolve()?;

        let mut disabled = Vec::new();
        for name in &self.samplers.disabled {
            let group: FieldGroup = name
                .parse()
                .map_err(|e: crate::sampler::UnknownFieldGroup| invalid("samplers.disabled", name, e.to_string()))?;
            disabled.push(group);
        }
        let mut intervals = BTreeMap::new();
        for &group in FieldGroup::ALL {
            let key = format!("samplers.{}", group.name());
            let interval = match self.samplers.intervals.get(&group) {
                Some(text) => parse_duration(&key, text)?,
                None => group.default_interval(),
            };
            if interval < group.min_interval() || interval > INTERVAL_MAX {
                return Err(invalid(
                    key,
                    humantime::format_duration(interval).to_string(),
                    format!(
                        "between {} and 1h{}",
                        humantime::format_duration(group.min_interval()),
                        if group == FieldGroup::Gpm { " (NVML needs more than 100ms between GPM samples)" } else { "" }
                    ),
                ));
            }
            if !disabled.contains(&group) {
                intervals.insert(group, interval);
            }
        }

        Ok(AgentConfig {
            source,
            nvml_lib: o.nvml_lib.or(a.nvml_lib),
            listen,
            http,
            collector,
            window,
            hostname,
            cluster,
            windows_out: o.windows_out.or(a.windows_out),
            intervals,
            attribution: self.attribution,
            sim: self.sim,
            shipper,
            otlp,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(text: &str) -> Result<AgentConfig, ConfigError> {
        FileConfig::parse(text, Path::new("agent.toml"))?.resolve(Overrides::default(), "node-1")
    }

    #[test]
    fn a_host_takes_one_collector_of_a_list_and_keeps_it() {
        let urls: Vec<String> = (0..4).map(|i| format!("http://apron-{i}.apron-collectors:9402")).collect();
        let hosts: Vec<String> = (0..2000).map(|i| format!("gpu-node-{i:04}")).collect();
        let pick = |urls: &[String], host: &str| pick_collector(&urls.join(", "), host).expect("valid");
        let mut counts = std::collections::HashMap::new();
        for h in &hosts {
            *counts.entry(pick(&urls, h)).or_insert(0) += 1;
        }
        // Spread: each of four takes about a quarter.
        assert_eq!(counts.len(), 4);
        assert!(counts.values().all(|&n| (400..=600).contains(&n)), "{counts:?}");
        // The list's order does not matter; a collector removed moves only its hosts.
        let reversed: Vec<String> = urls.iter().rev().cloned().collect();
        let fewer = &urls[..3];
        for h in &hosts {
            let before = pick(&urls, h);
            assert_eq!(pick(&reversed, h), before);
            if before != urls[3] {
                assert_eq!(pick(fewer, h), before, "{h} moved");
            }
        }
        assert_eq!(pick_collector("http://only:9402", "h").expect("one"), "http://only:9402");
        let e = pick_collector("http://a:9402,apron-1:9402", "h").expect_err("no scheme").to_string();
        assert!(e.contains("apron-1:9402"), "{e}");
    }

    #[test]
    fn defaults_are_the_contract() {
        let c = resolve("").expect("empty config is valid");
        assert_eq!(c.listen, DEFAULT_LISTEN.parse().expect("valid"));
        assert_eq!(c.window, Duration::from_secs(1));
        assert_eq!(c.intervals[&FieldGroup::Utilization], Duration::from_millis(100));
        assert_eq!(c.intervals[&FieldGroup::Gpm], Duration::from_millis(250));
        assert_eq!(c.intervals[&FieldGroup::Processes], Duration::from_secs(5));
        assert_eq!(c.intervals[&FieldGroup::Health], Duration::from_secs(10));
        assert_eq!(c.hostname.as_str(), "node-1");
        assert_eq!(c.source, SourceKind::Nvml);
    }

    #[test]
    fn unknown_key_is_named() {
        let e = resolve("[agent]\nlisten_addr = \"x\"\n").expect_err("unknown key");
        let msg = e.to_string();
        assert!(msg.contains("listen_addr"), "{msg}");
        assert!(msg.contains("agent.toml"), "{msg}");
    }

    #[test]
    fn bad_values_name_value_and_range() {
        let msg = resolve("[samplers]\ngpm = \"50ms\"\n").expect_err("too fast").to_string();
        assert!(msg.contains("samplers.gpm") && msg.contains("50ms") && msg.contains("110ms"), "{msg}");
        let msg = resolve("[agent]\nwindow = \"7s\"\n").expect_err("uneven").to_string();
        assert!(msg.contains("agent.window") && msg.contains("7s"), "{msg}");
        let msg = resolve("[agent]\nwindow = \"soon\"\n").expect_err("not a duration").to_string();
        assert!(msg.contains("soon"), "{msg}");
        let msg = resolve("[agent]\nlisten = \"nowhere\"\n").expect_err("bad addr").to_string();
        assert!(msg.contains("agent.listen") && msg.contains("nowhere"), "{msg}");
        let msg = resolve("[samplers]\ndisabled = [\"gpu\"]\n").expect_err("bad group").to_string();
        assert!(msg.contains("\"gpu\"") && msg.contains("utilization"), "{msg}");
        let msg = resolve("[samplers]\ngpu = \"1s\"\n").expect_err("unknown group").to_string();
        assert!(msg.contains("gpu") && msg.contains("utilization"), "{msg}");
    }

    #[test]
    fn overrides_win_over_file() {
        let file =
            FileConfig::parse("[agent]\nsource = \"nvml\"\nwindow = \"2s\"\n", Path::new("a.toml")).expect("parses");
        let c = file
            .resolve(Overrides { source: Some(SourceKind::Sim), window: Some("5s".into()), ..Default::default() }, "h")
            .expect("valid");
        assert_eq!(c.source, SourceKind::Sim);
        assert_eq!(c.window, Duration::from_secs(5));
    }

    fn shipper(text: &str) -> Result<Option<ShipperConfig>, ConfigError> {
        Ok(resolve(&format!("[agent]\ncollector = \"http://c:9402/\"\n{text}"))?.shipper)
    }

    #[test]
    fn shipper_defaults_and_switch() {
        assert!(resolve("[shipper]\ntoken = \"t\"\n").expect("valid").shipper.is_none(), "no collector, no shipper");
        let s = shipper("[shipper]\ntoken = \"s3cret\"\n").expect("valid").expect("shipper");
        assert_eq!(s.collector, "http://c:9402");
        assert_eq!(s.agent_id, "node-1", "the host name by default");
        assert_eq!(s.flush_interval, Duration::from_secs(5));
        assert_eq!(s.request_timeout, Duration::from_secs(10));
        assert_eq!(s.max_backoff, Duration::from_secs(30));
        assert_eq!(s.spool_dir, PathBuf::from(DEFAULT_SPOOL_DIR));
        assert_eq!(s.spool_max_bytes, 512 * 1024 * 1024);
        assert_eq!(s.max_batch_rows, 50_000);
        assert!(!format!("{s:?}").contains("s3cret"), "Debug hides the token");
    }

    #[test]
    fn shipper_token_is_required_and_the_file_wins() {
        let msg = shipper("").expect_err("no token").to_string();
        assert!(msg.contains("shipper.token_file") && msg.contains("APRON_COLLECTOR_TOKEN"), "{msg}");

        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("token");
        std::fs::write(&path, "from-file\n").expect("write");
        let s = shipper(&format!("[shipper]\ntoken = \"inline\"\ntoken_file = {:?}\n", path.display().to_string()))
            .expect("valid")
            .expect("shipper");
        assert_eq!(s.token, "from-file");

        let msg = shipper("[shipper]\ntoken_file = \"/nonexistent/token\"\n").expect_err("unreadable").to_string();
        assert!(msg.contains("shipper.token_file") && msg.contains("/nonexistent/token"), "{msg}");
        let msg = shipper("[shipper]\ntoken = \"two words\"\n").expect_err("spaces").to_string();
        assert!(msg.contains("shipper.token") && !msg.contains("two words"), "the token is not echoed: {msg}");

        let file =
            FileConfig::parse("[agent]\ncollector = \"http://c\"\n[shipper]\ntoken = \"a\"\n", Path::new("a.toml"))
                .expect("parses");
        let o = Overrides { collector_token: Some("env".into()), ..Default::default() };
        assert_eq!(file.resolve(o, "h").expect("valid").shipper.expect("shipper").token, "env");
    }

    #[test]
    fn shipper_values_are_checked() {
        let base = "[shipper]\ntoken = \"t\"\n";
        let ok = |extra: &str| shipper(&format!("{base}{extra}")).expect("valid").expect("shipper");
        assert_eq!(ok("spool_max_bytes = \"64KiB\"\n").spool_max_bytes, 65536);
        assert_eq!(ok("spool_max_bytes = \"2 GB\"\n").spool_max_bytes, 2_000_000_000);
        assert_eq!(ok("spool_max_bytes = 4096\n").spool_max_bytes, 4096);
        assert_eq!(ok("agent_id = \"rack7-node3\"\nmax_batch_rows = 10\n").max_batch_rows, 10);
        let bad = |extra: &str, key: &str, value: &str| {
            let msg = shipper(&format!("{base}{extra}")).expect_err(extra).to_string();
            assert!(msg.contains(key) && msg.contains(value), "{extra}: {msg}");
        };
        bad("spool_max_bytes = \"lots\"\n", "shipper.spool_max_bytes", "lots");
        bad("spool_max_bytes = 10\n", "shipper.spool_max_bytes", "1KiB");
        bad("spool_max_bytes = \"5PiB\"\n", "shipper.spool_max_bytes", "5PiB");
        bad("flush_interval = \"10ms\"\n", "shipper.flush_interval", "between 100ms and 1h");
        bad("request_timeout = \"never\"\n", "shipper.request_timeout", "never");
        bad("max_batch_rows = 0\n", "shipper.max_batch_rows", "between 1 and 10000000");
        bad("agent_id = \"a b\"\n", "shipper.agent_id", "no spaces");
        bad("max_backoff = \"2h\"\n", "shipper.max_backoff", "2h");
        let msg = shipper("[shipper]\ntokn = \"t\"\n").expect_err("unknown key").to_string();
        assert!(msg.contains("tokn"), "{msg}");
        let s = resolve("[agent]\ncollector = \"https://c:9402\"\n[shipper]\ntoken = \"t\"\n")
            .expect("https is fine")
            .shipper
            .expect("shipper");
        assert_eq!(s.collector, "https://c:9402");
        assert!(s.ca.is_none(), "the web PKI roots by default");
    }

    /// A self-signed CA certificate as PEM.
    fn ca_pem() -> String {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.self_signed(&key).expect("cert").pem()
    }

    #[test]
    fn shipper_ca_file_is_loaded_at_start() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = dir.path().join("ca.crt");
        std::fs::write(&ca, ca_pem()).expect("write");
        let with = |url: &str, file: &Path| {
            resolve(&format!(
                "[agent]\ncollector = {url:?}\n[shipper]\ntoken = \"t\"\nca_file = {:?}\n",
                file.display().to_string()
            ))
        };
        let s = with("https://c", &ca).expect("valid").shipper.expect("shipper");
        assert_eq!(s.ca.as_ref().map(|c| c.certs.len()), Some(1));
        assert!(format!("{s:?}").contains("ca.crt (1 certificates)"));

        let msg = with("http://c", &ca).expect_err("http").to_string();
        assert!(msg.contains("shipper.ca_file") && msg.contains("https://"), "{msg}");
        let msg = with("https://c", &dir.path().join("none.crt")).expect_err("missing").to_string();
        assert!(msg.contains("shipper.ca_file") && msg.contains("none.crt") && msg.contains("cannot read"), "{msg}");
        let junk = dir.path().join("junk.crt");
        std::fs::write(&junk, "not a certificate\n").expect("write");
        let msg = with("https://c", &junk).expect_err("junk").to_string();
        assert!(msg.contains("junk.crt") && msg.contains("no certificate found"), "{msg}");
    }

    #[test]
    fn listener_tls_from_the_table_or_a_web_config_not_both() {
        let c = resolve("").expect("valid");
        assert!(c.http.tls.is_none() && c.http.web_config.is_none(), "plain HTTP by default");
        assert_eq!(c.http.scheme(), "http");

        let dir = tempfile::tempdir().expect("tempdir");
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
            .expect("params")
            .self_signed(&key)
            .expect("cert");
        std::fs::write(dir.path().join("server.crt"), cert.pem()).expect("write");
        std::fs::write(dir.path().join("server.key"), key.serialize_pem()).expect("write");
        let table = format!(
            "[agent.tls]\ncert_file = {:?}\nkey_file = {:?}\n",
            dir.path().join("server.crt").display().to_string(),
            dir.path().join("server.key").display().to_string()
        );
        let c = resolve(&table).expect("valid");
        assert!(c.http.tls.is_some() && c.http.web_config.is_none());
        assert_eq!(c.http.scheme(), "https");

        let web = dir.path().join("web-config.yml");
        std::fs::write(&web, "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n").expect("write");
        let web_line = format!("[agent]\nweb_config_file = {:?}\n", web.display().to_string());
        let c = resolve(&web_line).expect("valid");
        assert!(c.http.tls.is_some() && c.http.web_config.is_some());
        // The flag wins over the file's key.
        let c = FileConfig::parse("", Path::new("a.toml"))
            .expect("parses")
            .resolve(Overrides { web_config_file: Some(web.clone()), ..Default::default() }, "h")
            .expect("valid");
        assert!(c.http.web_config.is_some());

        let msg = resolve(&format!("{web_line}{table}")).expect_err("both").to_string();
        assert!(msg.contains("[agent.tls]") && msg.contains("not both"), "{msg}");
        std::fs::write(&web, "tls_server_config:\n  cert_file: server.crt\n").expect("write");
        let msg = resolve(&web_line).expect_err("no key").to_string();
        assert!(msg.contains("agent.web_config_file") && msg.contains("missing key_file"), "{msg}");
        let msg = resolve(&table.replace("server.key", "server.crt")).expect_err("cert as key").to_string();
        assert!(msg.contains("[agent.tls]") && msg.contains("no private key found"), "{msg}");
        let msg = resolve("[agent.tls]\ncert_file = \"a\"\nkey_file = \"b\"\nciphers = []\n")
            .expect_err("unknown")
            .to_string();
        assert!(msg.contains("ciphers"), "{msg}");
    }

    #[test]
    fn disabled_groups_are_dropped() {
        let c = resolve("[samplers]\ndisabled = [\"nvlink\", \"pcie\"]\n").expect("valid");
        assert!(!c.intervals.contains_key(&FieldGroup::Nvlink));
        assert!(!c.intervals.contains_key(&FieldGroup::Pcie));
        assert!(c.intervals.contains_key(&FieldGroup::Memory));
    }
}
