//! The `agent_config` fuzz target's inputs replayed in a normal `cargo test` (no nightly,
//! no fuzz crate): every file in `fuzz/regressions/agent_config/` (crash inputs, kept
//! after the fix) and `fuzz/seeds/agent_config/` goes through `FileConfig::parse` and
//! `resolve` exactly as the target does, and must give Ok or Err — never a panic. See
//! docs/fuzzing.md.

use std::path::{Path, PathBuf};

use apron_agent::config::{FileConfig, Overrides};

/// The target's parse: a token file is read as `/dev/null`, never as named.
fn parse(text: &str) -> Option<FileConfig> {
    let mut file = FileConfig::parse(text, Path::new("fuzz.toml")).ok()?;
    if file.shipper.token_file.is_some() {
        file.shipper.token_file = Some(PathBuf::from("/dev/null"));
    }
    Some(file)
}

fn run(data: &[u8]) {
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
}

#[test]
fn agent_config_fuzz_regressions_and_seeds_never_panic() {
    apron_test_support::replay_fuzz_inputs("agent_config", run);
}
