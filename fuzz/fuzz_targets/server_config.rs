//! `apron serve`'s config file: `apron::config::FileConfig::parse` (TOML → sections) and
//! `FileConfig::resolve` (validation), with default overrides and once more with an
//! ingest-token override so that a file without a token still reaches the checks after
//! the token one. Errors are fine, panics are not.
//!
//! `resolve` reads `ingest.token_file` and `pg.users[].password_file`; the target points
//! any such path at `/dev/null` first, so no input can make it read (or block on) a real
//! file. Nothing is written and no socket is opened: `resolve` only parses addresses.
#![no_main]

use std::path::{Path, PathBuf};

use apron::config::{FileConfig, Overrides};
use libfuzzer_sys::fuzz_target;

fn parse(text: &str) -> Option<FileConfig> {
    let mut file = FileConfig::parse(text, Path::new("fuzz.toml")).ok()?;
    if file.ingest.token_file.is_some() {
        file.ingest.token_file = Some(PathBuf::from("/dev/null"));
    }
    for u in &mut file.pg.users {
        if u.password_file.is_some() {
            u.password_file = Some(PathBuf::from("/dev/null"));
        }
    }
    Some(file)
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Some(file) = parse(text) else { return };
    let _ = file.resolve(Overrides::default());
    if let Some(file) = parse(text) {
        let o = Overrides { ingest_token: Some("fuzz-ingest-token-0123456789".into()), ..Overrides::default() };
        let _ = file.resolve(o);
    }
});
