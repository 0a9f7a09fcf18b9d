//! The `ingest_decode` fuzz target's inputs replayed in a normal `cargo test` (no nightly,
//! no fuzz crate): every file in `fuzz/regressions/ingest_decode/` (crash inputs, kept
//! after the fix) and `fuzz/seeds/ingest_decode/` goes through the same validation the
//! target runs, and through `Store::ingest` itself, and must come back as Ok or Err —
//! never a panic. See docs/fuzzing.md.
//!
//! The seeds are valid bodies written by `ingest_decode_seeds_are_valid_bodies` when
//! `APRON_WRITE_FUZZ_SEEDS=1` (the wire encoder's output: `encode_ipc`, plus an
//! uncompressed two-batch stream); without it the test checks that they still decode.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::time::Duration;

use apron_collector::{IngestRequest, Store, StoreConfig, Table, ipc_guard, schema};
use apron_common::wire::{decode_ipc, encode_ipc, processes_to_batch, windows_to_batch};
use apron_common::{Field, FieldStats, GpuHolder, GpuIdentity, GpuUuid, GpuWindow, HostName, ProcessRow, UnixMicros};
use arrow_array::RecordBatch;
use arrow_ipc::writer::StreamWriter;

fn fuzz_dir(kind: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz").join(kind).join("ingest_decode")
}

/// What the fuzz target runs: `Store::ingest`'s validation (framing guard, wire decoder,
/// storage conversion) with the default limits, for `table`.
fn decode(table: Table, body: &[u8]) -> Result<Vec<RecordBatch>, String> {
    let limits = StoreConfig::default();
    ipc_guard::check(body, limits.max_rows_per_batch as u64, limits.max_batch_bytes).map_err(|e| e.to_string())?;
    let wire = decode_ipc(body, table, limits.max_rows_per_batch).map_err(|e| e.to_string())?;
    wire.iter().map(|b| schema::to_storage(table, b).map_err(|e| e.to_string())).collect()
}

#[test]
fn ingest_decode_regressions_and_seeds_never_panic() {
    let all = apron_test_support::fuzz_inputs("ingest_decode");
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(StoreConfig {
        data_dir: dir.path().to_path_buf(),
        persist_interval: Duration::from_secs(3600),
        maintenance_interval: Duration::from_secs(3600),
        ..StoreConfig::default()
    })
    .expect("open");
    for (n, (path, body)) in all.iter().enumerate() {
        for table in [Table::GpuSamples, Table::GpuProcesses] {
            let decoded = catch_unwind(AssertUnwindSafe(|| decode(table, body).map(|b| b.len())));
            assert!(decoded.is_ok(), "{} panicked in the decoder as {}", path.display(), table.name());
            let req = IngestRequest { table, agent: "fuzz", epoch: "regressions", sequence: n as u64, body };
            let ingested = catch_unwind(AssertUnwindSafe(|| store.ingest(req).map(|o| o.rows)));
            assert!(ingested.is_ok(), "{} panicked in Store::ingest as {}", path.display(), table.name());
        }
    }
}

fn gpu(g: u32) -> GpuIdentity {
    GpuIdentity::gpu(
        HostName::new(format!("node-{}", g / 2)).expect("host"),
        GpuUuid::new(format!("GPU-{g:04}")).expect("uuid"),
        g % 2,
        "NVIDIA H100 80GB HBM3",
    )
}

fn windows(n: usize) -> Vec<GpuWindow> {
    (0..n)
        .map(|i| {
            let t = 1_795_000_000_000_000 + i as i64 * 1_000_000;
            let mut w = GpuWindow::new(UnixMicros(t), Duration::from_secs(1), gpu(i as u32 % 3));
            w.fields[Field::GpuUtil.index()] =
                Some(FieldStats { count: 10, mean: 0.5, min: 0.0, max: 1.0, last: 0.25 });
            w.fields[Field::PowerWatts.index()] = Some(FieldStats::single(312.5));
            w.fields[Field::FbUsedBytes.index()] = Some(FieldStats::single(4096.0 * i as f64));
            if i % 2 == 0 {
                w.owner = Some(GpuHolder::pod(Some("ml".into()), Some(format!("train-{i}")), Some("main".into())));
            }
            w
        })
        .collect()
}

fn processes(n: usize) -> Vec<ProcessRow> {
    (0..n)
        .map(|i| ProcessRow {
            time: UnixMicros(1_795_000_000_000_000 + i as i64 * 5_000_000),
            host: gpu(i as u32).host,
            gpu_uuid: gpu(i as u32).gpu_uuid,
            pid: 4242 + i as u32,
            process_name: Some("python".into()),
            user: (i % 2 == 0).then(|| "bob".into()),
            fb_used_bytes: Some(1 << 20),
            sm_util: Some(0.5),
            container_id: None,
            pod: (i % 2 == 1).then(|| "train-0".into()),
            namespace: (i % 2 == 1).then(|| "ml".into()),
            container: None,
            pod_uid: None,
            job_id: (i % 2 == 0).then(|| "123".into()),
        })
        .collect()
}

/// An uncompressed stream of several batches (the agent sends one zstd batch; the
/// decoder takes any stream of the schema).
fn uncompressed(batches: &[RecordBatch]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut w = StreamWriter::try_new(&mut out, batches[0].schema_ref()).expect("writer");
    for b in batches {
        w.write(b).expect("write");
    }
    w.finish().expect("finish");
    drop(w);
    out
}

/// (file name, table, body) of every seed.
fn seeds() -> Vec<(&'static str, Table, Vec<u8>)> {
    let s = |rows: Vec<GpuWindow>| windows_to_batch(&rows).expect("batch");
    let p = |rows: Vec<ProcessRow>| processes_to_batch(&rows).expect("batch");
    let ipc = |b: &RecordBatch| encode_ipc(b).expect("ipc");
    vec![
        ("gpu_samples-1.arrows", Table::GpuSamples, ipc(&s(windows(1)))),
        ("gpu_samples-4.arrows", Table::GpuSamples, ipc(&s(windows(4)))),
        ("gpu_samples-0.arrows", Table::GpuSamples, ipc(&s(Vec::new()))),
        ("gpu_samples-raw-2x2.arrows", Table::GpuSamples, uncompressed(&[s(windows(2)), s(windows(2))])),
        ("gpu_processes-3.arrows", Table::GpuProcesses, ipc(&p(processes(3)))),
        ("gpu_processes-raw-2.arrows", Table::GpuProcesses, uncompressed(&[p(processes(2))])),
    ]
}

#[test]
fn ingest_decode_seeds_are_valid_bodies() {
    let dir = fuzz_dir("seeds");
    if std::env::var_os("APRON_WRITE_FUZZ_SEEDS").is_some() {
        std::fs::create_dir_all(&dir).expect("mkdir");
        for (name, _, body) in seeds() {
            std::fs::write(dir.join(name), body).expect("write seed");
        }
    }
    for (name, table, body) in seeds() {
        let kept = std::fs::read(dir.join(name)).unwrap_or_else(|e| panic!("seed {name}: {e}"));
        let rows = decode(table, &kept).unwrap_or_else(|e| panic!("seed {name} does not decode: {e}"));
        let expected = decode(table, &body).expect("fresh body decodes");
        assert_eq!(rows, expected, "seed {name} holds other rows than the encoder now writes");
    }
}
