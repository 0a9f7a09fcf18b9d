//! The `import_text` and `import_json` fuzz targets' inputs replayed in a normal
//! `cargo test` (no nightly, no fuzz crate): every file in `fuzz/regressions/<target>/`
//! (crash inputs, kept after the fix) and `fuzz/seeds/<target>/` goes through the same
//! `Importer` calls as the target, and must give Ok or Err — never a panic — with the
//! outcome's accounting intact. See docs/fuzzing.md.

use apron_common::UnixMicros;
use apron_import::{Format, ImportOptions, ImportOutcome, Importer};

fn check(out: &ImportOutcome) {
    let skipped: u64 = out.skipped.values().sum();
    assert_eq!(out.samples_read, out.samples_used + skipped, "accounting: {out:?}");
    assert_eq!(out.rows, out.windows.len());
}

/// What `import_text` runs.
fn text(data: &[u8]) {
    for format in [Format::PrometheusText, Format::OpenMetrics] {
        let mut importer = Importer::new(ImportOptions::default()).expect("default options");
        if importer.add(data, Some(format)).is_ok() {
            check(&importer.finish().expect("finish"));
        }
    }
    let mut importer = Importer::new(ImportOptions::default()).expect("default options");
    if importer.add_scrape(data, None, UnixMicros(1_700_000_000_000_000)).is_ok() {
        check(&importer.finish().expect("finish"));
    }
}

/// What `import_json` runs.
fn json(data: &[u8]) {
    let mut importer = Importer::new(ImportOptions::default()).expect("default options");
    if importer.add(data, Some(Format::PrometheusJson)).is_ok() {
        check(&importer.finish().expect("finish"));
    }
}

#[test]
fn import_text_fuzz_regressions_and_seeds_never_panic() {
    apron_test_support::replay_fuzz_inputs("import_text", text);
}

#[test]
fn import_json_fuzz_regressions_and_seeds_never_panic() {
    apron_test_support::replay_fuzz_inputs("import_json", json);
}
