//! Agent configuration: the TOML file, and the plain [`AgentConfig`] the library runs on.
//!
//! The binary reads the file, applies flag and `APRON_*` environment overrides (clap does
//! the environment), then calls [`FileConfig::resolve`]. Unknown keys are rejected by
//! serde (`deny_unknown_fields` names the key and what was expected); values are checked
//! here, and every error names the key, the value and the allowed range.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use apron_common::{ClusterName, HostName};
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
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SamplersSection {
    pub utilization: Option<String>,
    pub gpm: Option<String>,
    pub memory: Option<String>,
    pub power: Option<String>,
    pub thermal: Option<String>,
    pub clocks: Option<String>,
    pub pcie: Option<String>,
    pub nvlink: Option<String>,
    pub health: Option<String>,
    pub processes: Option<String>,
    /// Field groups not to sample at all.
    #[serde(default)]
    pub disabled: Vec<String>,
}

impl SamplersSection {
    fn get(&self, group: FieldGroup) -> Option<&str> {
        match group {
            FieldGroup::Utilization => self.utilization.as_deref(),
            FieldGroup::Gpm => self.gpm.as_deref(),
            FieldGroup::Memory => self.memory.as_deref(),
            FieldGroup::Power => self.power.as_deref(),
            FieldGroup::Thermal => self.thermal.as_deref(),
            FieldGroup::Clocks => self.clocks.as_deref(),
            FieldGroup::Pcie => self.pcie.as_deref(),
            FieldGroup::Nvlink => self.nvlink.as_deref(),
            FieldGroup::Health => self.health.as_deref(),
            FieldGroup::Processes => self.processes.as_deref(),
        }
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
}

/// Everything the agent runs on, validated.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub source: SourceKind,
    /// `None`: nvml-wrapper's default (`libnvidia-ml.so`, through the loader path).
    pub nvml_lib: Option<PathBuf>,
    pub listen: SocketAddr,
    pub collector: Option<String>,
    pub window: Duration,
    pub hostname: HostName,
    pub cluster: Option<ClusterName>,
    pub windows_out: Option<PathBuf>,
    /// Enabled field groups and their intervals.
    pub intervals: BTreeMap<FieldGroup, Duration>,
    pub attribution: AttributionConfig,
    pub sim: SimConfig,
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
        let collector = o.collector.or(a.collector);
        if let Some(url) = collector.as_ref().filter(|u| !(u.starts_with("http://") || u.starts_with("https://"))) {
            return Err(invalid("agent.collector", url, "an http:// or https:// URL"));
        }

        let mut disabled = Vec::new();
        for name in &self.samplers.disabled {
            let group: FieldGroup = name.parse().map_err(|e: String| invalid("samplers.disabled", name, e))?;
            disabled.push(group);
        }
        let mut intervals = BTreeMap::new();
        for &group in FieldGroup::ALL {
            let key = format!("samplers.{}", group.name());
            let interval = match self.samplers.get(group) {
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
            collector,
            window,
            hostname,
            cluster,
            windows_out: o.windows_out.or(a.windows_out),
            intervals,
            attribution: self.attribution,
            sim: self.sim,
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

    #[test]
    fn disabled_groups_are_dropped() {
        let c = resolve("[samplers]\ndisabled = [\"nvlink\", \"pcie\"]\n").expect("valid");
        assert!(!c.intervals.contains_key(&FieldGroup::Nvlink));
        assert!(!c.intervals.contains_key(&FieldGroup::Pcie));
        assert!(c.intervals.contains_key(&FieldGroup::Memory));
    }
}
