//! Identity and time newtypes.
//!
//! Strings that mean different things (a GPU UUID, a host name, a cluster name) get
//! different types so that one can never be passed where another is expected.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// Why an identity string was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IdError {
    #[error("{kind} must not be empty")]
    Empty { kind: &'static str },
    #[error("{kind} {value:?} is longer than {max} bytes")]
    TooLong { kind: &'static str, value: String, max: usize },
    #[error("{kind} {value:?} contains a control character")]
    Control { kind: &'static str, value: String },
    #[error("{kind} {value:?}: use {allowed}")]
    Charset { kind: &'static str, value: String, allowed: &'static str },
}

fn check(kind: &'static str, value: &str, max: usize) -> Result<(), IdError> {
    if value.is_empty() {
        return Err(IdError::Empty { kind });
    }
    if value.len() > max {
        return Err(IdError::TooLong { kind, value: value.to_owned(), max });
    }
    if value.chars().any(char::is_control) {
        return Err(IdError::Control { kind, value: value.to_owned() });
    }
    Ok(())
}

macro_rules! string_id {
    ($(#[$doc:meta])* $name:ident, $kind:literal, $max:expr) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            /// Validates and wraps `value`.
            pub fn new(value: impl Into<String>) -> Result<Self, IdError> {
                let value = value.into();
                check($kind, &value, $max)?;
                Ok(Self(value))
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl TryFrom<String> for $name {
            type Error = IdError;
            fn try_from(value: String) -> Result<Self, IdError> {
                Self::new(value)
            }
        }

        impl From<$name> for String {
            fn from(value: $name) -> String {
                value.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }
    };
}

string_id!(
    /// A GPU's or MIG instance's UUID as NVML reports it (`GPU-…` or `MIG-…`).
    GpuUuid,
    "GPU UUID",
    96
);
string_id!(
    /// The host a GPU is attached to.
    HostName,
    "host name",
    253
);
string_id!(
    /// The cluster a host belongs to (configuration, not discovered).
    ClusterName,
    "cluster name",
    128
);

string_id!(
    /// A team: the unit idle cost is charged to and the scope of a `team:<name>` role.
    TeamName,
    "team name",
    128
);

/// A collector's shard of a shared lake (`[cluster] shard`): the value of the
/// `shard=` Hive partition its files are published under. Stricter than the other
/// names because it is part of every object key: ASCII letters, digits, `-`, `_` and
/// `.` (not first), at most 63 bytes.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct ShardName(String);

impl ShardName {
    pub const MAX_BYTES: usize = 63;

    pub fn new(value: impl Into<String>) -> Result<ShardName, IdError> {
        let value = value.into();
        check("shard name", &value, Self::MAX_BYTES)?;
        let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
        if !value.chars().all(ok) || value.starts_with('.') {
            return Err(IdError::Charset {
                kind: "shard name",
                value,
                allowed: "ASCII letters, digits, '-', '_', '.' (not first)",
            });
        }
        Ok(ShardName(value))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for ShardName {
    type Error = IdError;
    fn try_from(value: String) -> Result<ShardName, IdError> {
        ShardName::new(value)
    }
}

impl From<ShardName> for String {
    fn from(value: ShardName) -> String {
        value.0
    }
}

impl fmt::Display for ShardName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A point in time: microseconds since the Unix epoch, UTC.
///
/// Microseconds because that is both NVML's sample resolution and the contract's
/// `Timestamp(µs, UTC)` column type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct UnixMicros(pub i64);

impl UnixMicros {
    pub const MICROS_PER_SECOND: i64 = 1_000_000;

    /// The wall clock now. A clock before 1970 reads as the epoch rather than failing:
    /// a broken clock must not stop sampling, and the collector flags skew.
    pub fn now() -> Self {
        Self::from_system_time(SystemTime::now())
    }

    pub fn from_system_time(t: SystemTime) -> Self {
        let micros = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros());
        Self(i64::try_from(micros).unwrap_or(i64::MAX))
    }

    pub fn from_secs_f64(secs: f64) -> Self {
        Self((secs * 1e6).round() as i64)
    }

    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 / 1e6
    }

    /// Saturating addition of a duration.
    pub fn plus(self, d: Duration) -> Self {
        Self(self.0.saturating_add(i64::try_from(d.as_micros()).unwrap_or(i64::MAX)))
    }

    /// Saturating subtraction of a duration.
    pub fn minus(self, d: Duration) -> Self {
        Self(self.0.saturating_sub(i64::try_from(d.as_micros()).unwrap_or(i64::MAX)))
    }

    /// The end of the window of length `window` that contains `self`, with windows
    /// aligned to the epoch and half-open as `(end - window, end]`.
    pub fn window_end(self, window: Duration) -> Self {
        let w = i64::try_from(window.as_micros()).unwrap_or(i64::MAX).max(1);
        let q = self.0.div_euclid(w);
        let r = self.0.rem_euclid(w);
        if r == 0 { Self(self.0) } else { Self((q + 1) * w) }
    }

    /// RFC 3339 UTC text with microseconds, as the contract prints timestamps.
    pub fn to_rfc3339(self) -> String {
        let secs = self.0.div_euclid(1_000_000);
        let micros = self.0.rem_euclid(1_000_000);
        let days = secs.div_euclid(86_400);
        let sod = secs.rem_euclid(86_400);
        let (y, m, d) = civil_from_days(days);
        format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{micros:06}Z", sod / 3600, (sod / 60) % 60, sod % 60)
    }
}

/// Days since 1970-01-01 to a proleptic Gregorian (year, month, day), UTC (Howard
/// Hinnant's algorithm; exact for every day count a timestamp can reach).
pub fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// Howard Hinnant's `days_from_civil`: (year, month, day) to days since 1970-01-01.
pub fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// `YYYY-MM-DD` of a day count since 1970-01-01 (a partition name, a report day).
pub fn date_string(day: i64) -> String {
    let (y, m, d) = civil_from_days(day);
    format!("{y:04}-{m:02}-{d:02}")
}

/// A `YYYY-MM-DD` date (a partition name, a report day) to days since 1970-01-01;
/// `None` when it is malformed or not a real date (`2026-02-31`).
pub fn parse_date(s: &str) -> Option<i64> {
    let b = s.as_bytes();
    if b.len() != 10 || b[4] != b'-' || b[7] != b'-' {
        return None;
    }
    let num =
        |r: std::ops::Range<usize>| s.get(r).filter(|p| p.bytes().all(|c| c.is_ascii_digit()))?.parse::<i64>().ok();
    let (y, m, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let day = days_from_civil(y, m, d);
    (civil_from_days(day) == (y, m as u32, d as u32)).then_some(day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_names_are_safe_in_object_keys() {
        for good in ["rack-a", "eu_west.1", "A9"] {
            assert_eq!(ShardName::new(good).expect(good).as_str(), good);
        }
        for bad in ["", "a/b", "a=b", ".hidden", "rack a", "é", &"x".repeat(64)] {
            assert!(ShardName::new(bad).is_err(), "{bad:?}");
        }
        let parsed: Result<ShardName, _> = serde_json::from_str("\"x/y\"");
        assert!(parsed.is_err());
    }

    #[test]
    fn dates_round_trip() {
        assert_eq!(parse_date("1970-01-01"), Some(0));
        assert_eq!(parse_date("2026-11-19"), Some(20_776));
        assert_eq!(parse_date("2000-03-01"), Some(11_017));
        assert_eq!(parse_date("2000-02-29"), Some(11_016));
        for bad in ["2026-13-01", "2026-1-01", "20261-01-0", "2026-02-31", "2026-02-+1", ""] {
            assert_eq!(parse_date(bad), None, "{bad}");
        }
        for day in [-800_000, -1, 0, 20_780, 2_000_000] {
            let (y, m, d) = civil_from_days(day);
            assert_eq!(days_from_civil(y, i64::from(m), i64::from(d)), day);
        }
    }

    #[test]
    fn ids_reject_empty_and_control() {
        assert_eq!(GpuUuid::new(""), Err(IdError::Empty { kind: "GPU UUID" }));
        assert!(HostName::new("a\nb").is_err());
        assert_eq!(GpuUuid::new("GPU-1").map(|g| g.to_string()), Ok("GPU-1".to_owned()));
    }

    #[test]
    fn window_end_is_half_open_on_the_left() {
        let w = Duration::from_secs(1);
        assert_eq!(UnixMicros(1_000_000).window_end(w), UnixMicros(1_000_000));
        assert_eq!(UnixMicros(1_000_001).window_end(w), UnixMicros(2_000_000));
        assert_eq!(UnixMicros(999_999).window_end(w), UnixMicros(1_000_000));
        assert_eq!(UnixMicros(-1).window_end(w), UnixMicros(0));
    }

    #[test]
    fn rfc3339_matches_known_dates() {
        assert_eq!(UnixMicros(0).to_rfc3339(), "1970-01-01T00:00:00.000000Z");
        // 2026-11-23T12:34:56.5Z, checked with `date -u -d @1795437296`.
        assert_eq!(UnixMicros(1_795_437_296_500_000).to_rfc3339(), "2026-11-23T12:34:56.500000Z");
        assert_eq!(UnixMicros(951_782_400_000_000).to_rfc3339(), "2000-02-29T00:00:00.000000Z");
    }
}
