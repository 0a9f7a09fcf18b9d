//! The agent's config file: `apron_agent::config::FileConfig::parse` and `resolve`, with
//! default overrides and once more with a collector URL and token (so the `[shipper]`
//! checks run even when the file names no collector). Errors are fine, panics are not.
//!
//! `resolve` reads `shipper.token_file`; the target points it at `/dev/null` first.
//! Nothing is written and no socket is opened (addresses and URLs are only parsed).
#![no_main]

use std::path::{Path, PathBuf};

use apron_agent::config::{FileConfig, Overrides};
use libfuzzer_sys::fuzz_target;

fn parse(text: &str) -> Option<FileConfig> {
    let mut file = FileConfig::parse(text, Path::new("fuzz.toml")).ok()?;
    if file.shipper.token_file.is_some() {
        file.shipper.token_file = Some(PathBuf::from("/dev/null"));
    }
    Some(file)
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Some(file) = parse(text) else { return };
    let _ = file.resolve(Overrides::default(), "fuzz-host");
    if let Some(file) = parse(text) {
        let o = Overrides {
            collector: Some("http://127.0.0.1:9402".into()),
            collector_token: Some("fuzz-token".into()),
            ..Overrides::default()
        };
        let _ = file.resolve(o, "fuzz-host");
    }
});
