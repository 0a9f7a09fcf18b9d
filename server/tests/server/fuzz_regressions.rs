//! The `server_config` fuzz target's inputs replayed in a normal `cargo test` (no
//! nightly, no fuzz crate): every file in `fuzz/regressions/server_config/` (crash
//! inputs, kept after the fix) and `fuzz/seeds/server_config/` goes through
//! `apron::config::FileConfig::parse` and `resolve` exactly as the target does, and must
//! give Ok or Err — never a panic. See docs/fuzzing.md.

use std::path::{Path, PathBuf};

use apron::config::{FileConfig, Overrides};

/// The target's parse: token and password files are read as `/dev/null`, never as named.
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

fn run(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Some(file) = parse(text) else { return };
    let _ = file.resolve(Overrides::default());
    if let Some(file) = parse(text) {
        let o = Overrides { ingest_token: Some("fuzz-ingest-token-0123456789".into()), ..Overrides::default() };
        let _ = file.resolve(o);
    }
}

#[test]
fn server_config_fuzz_regressions_and_seeds_never_panic() {
    apron_test_support::replay_fuzz_inputs("server_config", run);
}
