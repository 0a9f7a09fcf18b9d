//! Durations in configuration files, written as humantime text (`"500ms"`, `"10s"`,
//! `"1h 30m"`): the one serde adapter every crate's config structs use, so that a bad
//! value reads the same wherever it is.
//!
//! ```
//! #[derive(serde::Deserialize)]
//! struct Config {
//!     #[serde(with = "apron_common::duration")]
//!     interval: std::time::Duration,
//!     #[serde(with = "apron_common::duration::at_least_1s")]
//!     period: std::time::Duration,
//! }
//! let c: Config = serde_json::from_str(r#"{"interval": "250ms", "period": "1m"}"#).unwrap();
//! assert_eq!(c.interval, std::time::Duration::from_millis(250));
//! assert_eq!(c.period, std::time::Duration::from_secs(60));
//! ```

use std::time::Duration;

use serde::{Deserialize, Deserializer, de::Error as _};

/// A humantime duration; an error names the text it could not read.
pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
    let text = String::deserialize(deserializer)?;
    humantime::parse_duration(&text).map_err(|e| D::Error::custom(format!("invalid duration {text:?}: {e}")))
}

/// A period of background work: at least one second, so that a typo (`"1ms"` for
/// `"1m"`) cannot turn a pass into a busy loop.
pub mod at_least_1s {
    use std::time::Duration;

    use serde::{Deserializer, de::Error as _};

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
        let d = super::deserialize(deserializer)?;
        if d < Duration::from_secs(1) {
            return Err(D::Error::custom(format!(
                "invalid duration {:?}: at least 1s",
                humantime::format_duration(d).to_string()
            )));
        }
        Ok(d)
    }
}

#[cfg(test)]
mod tests {
    use serde::de::IntoDeserializer;
    use serde::de::value::{Error, StrDeserializer};

    fn text(s: &str) -> StrDeserializer<'_, Error> {
        s.into_deserializer()
    }

    #[test]
    fn humantime_text_reads_and_bad_text_is_named() {
        assert_eq!(super::deserialize(text("1h 30m")).ok(), Some(std::time::Duration::from_secs(5400)));
        let e = super::deserialize(text("soon")).expect_err("not a duration").to_string();
        assert!(e.contains("invalid duration \"soon\""), "{e}");
        let e = super::at_least_1s::deserialize(text("500ms")).expect_err("too short").to_string();
        assert_eq!(e, "invalid duration \"500ms\": at least 1s");
        assert!(super::at_least_1s::deserialize(text("1s")).is_ok());
    }
}
