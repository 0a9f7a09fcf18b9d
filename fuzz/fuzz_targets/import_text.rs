//! `apron import`'s text parsers: Prometheus text exposition 0.0.4 (ms timestamps), the
//! same bytes as OpenMetrics (s timestamps), and as a live scrape (samples without a
//! timestamp taken at a given time), each through `Importer::add`/`add_scrape` and
//! `finish` (the series → rows semantics). Errors are fine; a panic, or an outcome that
//! breaks the documented accounting `samples_read = samples_used + Σ skipped`, is a bug.
#![no_main]

use apron_common::UnixMicros;
use apron_import::{Format, ImportOptions, ImportOutcome, Importer};
use libfuzzer_sys::fuzz_target;

fn check(out: &ImportOutcome) {
    let skipped: u64 = out.skipped.values().sum();
    assert_eq!(out.samples_read, out.samples_used + skipped, "accounting: {out:?}");
    assert_eq!(out.rows, out.windows.len());
}

fuzz_target!(|data: &[u8]| {
    for format in [Format::PrometheusText, Format::OpenMetrics] {
        let mut importer = Importer::new(ImportOptions::default()).expect("default options");
        if importer.add(data, Some(format)).is_ok() {
            check(&importer.finish().expect("finish"));
        }
    }
    let mut importer = Importer::new(ImportOptions::default()).expect("default options");
    // 2023-11-14T22:13:20Z, inside the accepted 2000–2199 range.
    if importer.add_scrape(data, None, UnixMicros(1_700_000_000_000_000)).is_ok() {
        check(&importer.finish().expect("finish"));
    }
});
