//! The `agent_config` fuzz target's inputs replayed in a normal `cargo test` (no nightly,
//! no fuzz crate): every file in `fuzz/regressions/agent_config/` (crash inputs, kept
//! after the fix) and `fuzz/seeds/agent_config/` goes through `FileConfig::parse` and
//! `resolve` exactly as the target does, and must give Ok or Err — never a panic. See
//! docs/fuzzing.md.

use std::path::{Path, PathBuf};

use apron_agent::config::{FileConfig, Overrides};

fn inputs(kind: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz").join(kind).join("agent_config");
    let Ok(entries) = std::fs::read_dir(&dir) else { return Vec::new() };
    let mut files: Vec<PathBuf> = entries.map(|e| e.expect("dir entry").path()).filter(|p| p.is_file()).collect();
    files.sort();
    files.into_iter().map(|p| (p.clone(), std::fs::read(&p).expect("read input"))).collect()
}

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
    let mut all = inputs("regressions");
    let seeds = inputs("seeds");
    assert!(!seeds.is_empty(), "fuzz/seeds/agent_config holds the seed configs");
    all.extend(seeds);
    for (path, data) in &all {
        assert!(std::panic::catch_unwind(|| run(data)).is_ok(), "{} panicked", path.display());
    }
}
