//! Sizes in configuration files: a TOML integer (bytes) or text with a unit (`"512MiB"`,
//! `"64 KiB"`, `"2GB"`; binary units are powers of 1024, decimal ones powers of 1000).
//! One type for every crate's config, so that a size reads the same everywhere.

use serde::Deserialize;

/// A size as written in a config file; [`ByteSize::bytes`] reads it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum ByteSize {
    Bytes(i64),
    Text(String),
}

impl ByteSize {
    /// The number of bytes; `None` for a negative number or text that is not a size.
    pub fn bytes(&self) -> Option<u64> {
        match self {
            ByteSize::Bytes(n) => u64::try_from(*n).ok(),
            ByteSize::Text(t) => parse_bytes(t),
        }
    }

    /// As written, for error messages.
    pub fn text(&self) -> String {
        match self {
            ByteSize::Bytes(n) => n.to_string(),
            ByteSize::Text(t) => t.clone(),
        }
    }
}

/// Parses a size such as `512MiB`; `None` when it is not one (or overflows).
pub fn parse_bytes(text: &str) -> Option<u64> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().ok()?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "KB" | "kB" => 1000,
        "KiB" => 1 << 10,
        "MB" => 1000 * 1000,
        "MiB" => 1 << 20,
        "GB" => 1000 * 1000 * 1000,
        "GiB" => 1 << 30,
        "TB" => 1000 * 1000 * 1000 * 1000,
        "TiB" => 1 << 40,
        _ => return None,
    };
    n.checked_mul(mult)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizes() {
        assert_eq!(parse_bytes("512MiB"), Some(512 << 20));
        assert_eq!(parse_bytes("64 KiB"), Some(64 << 10));
        assert_eq!(parse_bytes("1kB"), Some(1000));
        assert_eq!(parse_bytes("7"), Some(7));
        assert_eq!(parse_bytes("1.5GiB"), None);
        assert_eq!(parse_bytes("MiB"), None);
        assert_eq!(parse_bytes("99999999999TiB"), None, "overflow is an error");
        assert_eq!(ByteSize::Bytes(-1).bytes(), None);
        assert_eq!(ByteSize::Text("2GB".into()).bytes(), Some(2_000_000_000));
    }
}
