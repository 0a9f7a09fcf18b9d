//! The collector's ingest body decoder: an HTTP `POST /api/v1/ingest` body (an Arrow IPC
//! stream of the wire schema) → validated storage rows.
//!
//! This is `Store::ingest`'s validation (`store::decode`, private): the framing guard
//! (`ipc_guard::check`), the wire decoder (`wire::decode_ipc`: schema and row limit) and
//! the exact conversion to the storage schema (`schema::to_storage`), with the default
//! limits of `StoreConfig`. Every body is tried as both shipped tables. Errors are the
//! expected outcome for garbage; a panic, an abort, an allocation past `-rss_limit_mb`
//! or a hang is a bug. No file or socket is touched.
//!
//! `decode_ipc` catches panics of the Arrow reader (a malformed body, not a crash), but
//! libfuzzer-sys's panic hook aborts on every panic, caught or not; so the target puts
//! back a hook that only reports (the first few). A panic that escapes the target still
//! aborts (libfuzzer-sys checks `catch_unwind` around each run) and is a crash.
#![no_main]

use std::sync::Once;
use std::sync::atomic::{AtomicUsize, Ordering};

use apron_collector::{StoreConfig, Table, ipc_guard, schema};
use apron_common::wire::decode_ipc;
use libfuzzer_sys::fuzz_target;

fn report_caught_panics() {
    static HOOK: Once = Once::new();
    static REPORTED: AtomicUsize = AtomicUsize::new(0);
    HOOK.call_once(|| {
        std::panic::set_hook(Box::new(|info| {
            if REPORTED.fetch_add(1, Ordering::Relaxed) < 5 {
                eprintln!("ingest_decode: panic (caught by decode_ipc unless libFuzzer reports a crash): {info}");
            }
        }));
    });
}

fuzz_target!(|body: &[u8]| {
    report_caught_panics();
    let limits = StoreConfig::default();
    for table in [Table::GpuSamples, Table::GpuProcesses] {
        if ipc_guard::check(body, limits.max_rows_per_batch as u64, limits.max_batch_bytes).is_err() {
            continue;
        }
        let Ok(batches) = decode_ipc(body, table, limits.max_rows_per_batch) else { continue };
        let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
        assert!(rows <= limits.max_rows_per_batch, "decode_ipc let {rows} rows through");
        for batch in &batches {
            if let Ok(stored) = schema::to_storage(table, batch) {
                assert_eq!(stored.num_rows(), batch.num_rows(), "conversion changed the row count");
                assert_eq!(stored.schema(), schema::storage_schema(table), "conversion's schema");
            }
        }
    }
});
