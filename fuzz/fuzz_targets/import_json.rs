//! `apron import`'s Prometheus HTTP API JSON parser (`query_range` matrices, instant
//! vectors, arrays of answers, bare `data` objects) through `Importer::add` and
//! `finish`. Errors are fine; a panic, or an outcome that breaks the documented
//! accounting `samples_read = samples_used + Σ skipped`, is a bug.
#![no_main]

use apron_import::{Format, ImportOptions, Importer};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut importer = Importer::new(ImportOptions::default()).expect("default options");
    if importer.add(data, Some(Format::PrometheusJson)).is_ok() {
        let out = importer.finish().expect("finish");
        let skipped: u64 = out.skipped.values().sum();
        assert_eq!(out.samples_read, out.samples_used + skipped, "accounting: {out:?}");
        assert_eq!(out.rows, out.windows.len());
    }
});
