//! The store end to end through its public API: ingest → WAL → memtable → Parquet,
//! restarts, crashes with torn WAL tails, duplicates, bad input and storage failures.

#[path = "store/fuzz_regressions.rs"]
mod fuzz_regressions;

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use apron_collector::checkpoint::{Checkpoint, Rename};
use apron_collector::compact;
use apron_collector::schema::storage_schema;
use apron_collector::wal::{Fault, FaultyIo, WalRecord, encode_record, list_segments};
use apron_collector::{IngestError, IngestOutcome, IngestRequest, Store, StoreConfig, Table};
use apron_common::wire::{encode_ipc, processes_to_batch, windows_to_batch};
use apron_common::{Field, FieldStats, GpuIdentity, GpuUuid, GpuWindow, HostName, ProcessRow, UnixMicros};
use arrow_array::RecordBatch;
use arrow_array::cast::AsArray;
use arrow_array::types::TimestampMicrosecondType;
use arrow_schema::{DataType, TimeUnit};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

/// 2026-11-18T11:06:40Z.
const T0: i64 = 1_795_000_000_000_000;
const GPUS: usize = 4;
const EPOCH: &str = "0192f0c1-7c4d-7e2a-9b1d-5f3e2a1b0c9d";
const SECS: i64 = 5;

fn config(dir: &Path) -> StoreConfig {
    StoreConfig {
        data_dir: dir.to_path_buf(),
        // Tests persist explicitly; the background timer must not interfere.
        persist_interval: Duration::from_secs(3600),
        maintenance_interval: Duration::from_secs(3600),
        wal_segment_bytes: 64 << 10,
        ..StoreConfig::default()
    }
}

fn identity(g: usize) -> GpuIdentity {
    GpuIdentity::gpu(
        HostName::new(format!("node-{}", g / 2)).expect("host"),
        GpuUuid::new(format!("GPU-{g:04}")).expect("uuid"),
        (g % 2) as u32,
        "NVIDIA A100-SXM4-80GB",
    )
}

fn one(v: f64) -> Option<FieldStats> {
    Some(FieldStats::single(v))
}

/// Batch number `n`: GPUS × SECS windows, times unique per `n`.
fn samples(n: i64, util: f64) -> Vec<u8> {
    let mut rows = Vec::new();
    for s in 0..SECS {
        for g in 0..GPUS {
            let t = T0 + (n * SECS + s) * 1_000_000;
            let mut w = GpuWindow::new(UnixMicros(t), Duration::from_secs(1), identity(g));
            w.fields[Field::GpuUtil.index()] = one(util);
            w.fields[Field::PowerWatts.index()] = one(250.5);
            w.fields[Field::FbUsedBytes.index()] = one(4096.0);
            rows.push(w);
        }
    }
    encode_ipc(&windows_to_batch(&rows).expect("batch")).expect("ipc")
}

fn processes(n: i64) -> Vec<u8> {
    let rows: Vec<ProcessRow> = (0..GPUS)
        .map(|g| ProcessRow {
            time: UnixMicros(T0 + n * 1_000_000),
            host: identity(g).host,
            gpu_uuid: identity(g).gpu_uuid,
            pid: 4242,
            process_name: Some("python".into()),
            user: Some("bob".into()),
            fb_used_bytes: Some(1 << 20),
            sm_util: Some(0.5),
            container_id: None,
            pod: None,
            namespace: None,
            container: None,
            pod_uid: None,
            job_id: Some("123".into()),
        })
        .collect();
    encode_ipc(&processes_to_batch(&rows).expect("batch")).expect("ipc")
}

fn ingest(store: &Store, agent: &str, seq: u64, body: &[u8]) -> Result<IngestOutcome, IngestError> {
    store.ingest(IngestRequest { table: Table::GpuSamples, agent, epoch: EPOCH, sequence: seq, body })
}

/// Every (gpu_uuid, time) row of `table`, from memory and Parquet, with its count.
fn rows(store: &Store, table: Table) -> BTreeMap<(String, i64), usize> {
    let view = store.view(table);
    let mut batches: Vec<RecordBatch> = view.widened().expect("widen");
    for f in &view.files {
        let reader = ParquetRecordBatchReaderBuilder::try_new(File::open(&f.path).expect("open"))
            .expect("parquet")
            .build()
            .expect("reader");
        batches.extend(reader.map(|b| b.expect("batch")));
    }
    let mut out = BTreeMap::new();
    for b in batches {
        let gpu = b.column_by_name("gpu_uuid").expect("col").as_string::<i32>();
        let time = b.column_by_name("time").expect("col").as_primitive::<TimestampMicrosecondType>();
        for i in 0..b.num_rows() {
            *out.entry((gpu.value(i).to_owned(), time.value(i))).or_insert(0) += 1;
        }
    }
    out
}

/// The rows batches `ns` should have produced, each once.
fn expected(ns: impl IntoIterator<Item = i64>) -> BTreeMap<(String, i64), usize> {
    let mut out = BTreeMap::new();
    for n in ns {
        for s in 0..SECS {
            for g in 0..GPUS {
                out.insert((format!("GPU-{g:04}"), T0 + (n * SECS + s) * 1_000_000), 1);
            }
        }
    }
    out
}

#[test]
fn ingest_persist_reopen_keeps_every_row_exactly_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let store = Store::open(config(dir.path())).expect("open");
        for n in 0..10 {
            let out = ingest(&store, "a", n as u64, &samples(n, 0.25)).expect("ingest");
            assert_eq!(out, IngestOutcome { rows: GPUS * SECS as usize, duplicate: false });
        }
        assert_eq!(store.memtable_stats(Table::GpuSamples).rows, 200, "queryable at once");
        let report = store.persist_now().expect("persist");
        assert_eq!(report.rows, 200);
        assert!(report.wal_segments_removed >= 1);
        assert_eq!(store.memtable_stats(Table::GpuSamples).rows, 0);
        for n in 10..13 {
            ingest(&store, "a", n as u64, &samples(n, 0.25)).expect("ingest");
        }
        assert_eq!(rows(&store, Table::GpuSamples), expected(0..13));
    }
    let store = Store::open(config(dir.path())).expect("reopen");
    assert_eq!(store.open_report().replayed_records, 3, "only what was not persisted is replayed");
    assert_eq!(rows(&store, Table::GpuSamples), expected(0..13));
    store.persist_now().expect("persist");
    drop(store);
    let store = Store::open(config(dir.path())).expect("reopen");
    assert_eq!(store.open_report().replayed_records, 0);
    assert_eq!(rows(&store, Table::GpuSamples), expected(0..13));
    assert_eq!(list_segments(&dir.path().join("wal")).expect("list").len(), 0, "persisted segments are gone");
}

/// The UTC end of T0's day, µs.
const T0_DAY_END: i64 = (T0 / 86_400_000_000 + 1) * 86_400_000_000;

#[test]
fn compaction_merges_persists_and_retention_drops_old_days() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = StoreConfig { superseded_grace: Duration::from_secs(3600), ..config(dir.path()) };
    let store = Store::open(cfg.clone()).expect("open");
    for n in 0..6 {
        ingest(&store, "a", n as u64, &samples(n, 0.5)).expect("ingest");
        store.persist_now().expect("persist");
    }
    let inputs = store.persisted_files(Table::GpuSamples);
    assert_eq!(inputs.len(), 6, "one file per persist");
    assert!(store.maintain_at(T0_DAY_END).compacted.is_empty(), "the day just ended: within the delay");

    let report = store.maintain_at(T0_DAY_END + 3_600_000_000);
    assert_eq!(report.errors, Vec::<String>::new());
    assert_eq!(report.compacted.len(), 1);
    let c = &report.compacted[0];
    assert_eq!((c.inputs, c.rows), (6, 6 * GPUS * SECS as usize));
    assert!(c.bytes_after < c.bytes_before, "one file is smaller than six: {c:?}");
    assert_eq!(store.persisted_files(Table::GpuSamples).len(), 1);
    assert_eq!(rows(&store, Table::GpuSamples), expected(0..6), "every row once");
    assert!(inputs.iter().all(|f| f.path.exists()), "inputs kept through their grace");

    // A restart within the grace finishes the compaction: inputs gone, rows once.
    drop(store);
    let store = Store::open(cfg.clone()).expect("reopen");
    assert_eq!(store.open_report().compactions_finished, 1);
    assert!(inputs.iter().all(|f| !f.path.exists()));
    assert_eq!(rows(&store, Table::GpuSamples), expected(0..6));

    assert_eq!(c.level, compact::Level::Day);
    let day_file = store.persisted_files(Table::GpuSamples).remove(0);
    assert!(day_file.path.to_string_lossy().ends_with(".day.parquet"), "{day_file:?}");

    // Late data for the compacted day: small files beside the day's file, which is
    // never rewritten for them; once they are more than `compaction_max_files` (3
    // here), they, and only they, are merged into a tier-1 file.
    drop(store);
    let store = Store::open(StoreConfig { compaction_max_files: 3, ..cfg.clone() }).expect("reopen");
    for n in 6..9 {
        ingest(&store, "a", n as u64, &samples(n, 0.5)).expect("ingest");
        store.persist_now().expect("persist");
        assert!(store.maintain_at(T0_DAY_END + 7_200_000_000).compacted.is_empty());
    }
    ingest(&store, "a", 9, &samples(9, 0.5)).expect("ingest");
    store.persist_now().expect("persist");
    assert_eq!(store.persisted_files(Table::GpuSamples).len(), 5);
    let report = store.maintain_at(T0_DAY_END + 7_200_000_000);
    assert_eq!(report.compacted.len(), 1);
    let c = &report.compacted[0];
    assert_eq!((c.level, c.inputs, c.rows), (compact::Level::Tier(1), 4, 4 * GPUS * SECS as usize));
    let files = store.persisted_files(Table::GpuSamples);
    assert_eq!(files.len(), 2);
    assert!(files.contains(&day_file), "the day's file stays as it was: {files:?}");
    assert_eq!(rows(&store, Table::GpuSamples), expected(0..10));

    // Retention: 30 days after the day's end the partition goes (tables are raw).
    let thirty_days = 30 * 86_400_000_000;
    assert!(store.maintain_at(T0_DAY_END + thirty_days - 1).expired.is_empty());
    let report = store.maintain_at(T0_DAY_END + thirty_days);
    assert_eq!(report.expired.len(), 1, "{report:?}");
    assert!(store.persisted_files(Table::GpuSamples).is_empty());
    assert!(rows(&store, Table::GpuSamples).is_empty());
    assert!(!dir.path().join("gpu_samples").join("date=2026-11-18").exists());
}

/// An `allocations` batch of `n` rows starting at `start_us`, one per GPU.
fn allocations(n: usize, start_us: i64, team: &str) -> RecordBatch {
    use arrow_array::{ArrayRef, BooleanArray, StringArray, TimestampMicrosecondArray};
    let schema = Table::Allocations.schema();
    let strings = |v: Vec<String>| Arc::new(StringArray::from(v)) as ArrayRef;
    let times = |v: Vec<Option<i64>>| Arc::new(TimestampMicrosecondArray::from(v).with_timezone("UTC")) as ArrayRef;
    let columns = vec![
        strings((0..n).map(|g| format!("GPU-{g:04}")).collect()),
        strings((0..n).map(|_| "node-0".to_owned()).collect()),
        times((0..n).map(|g| Some(start_us + g as i64)).collect()),
        times(vec![None; n]),
        strings(vec!["pod".to_owned(); n]),
        strings((0..n).map(|g| format!("ml/train-{g}")).collect()),
        strings(vec![team.to_owned(); n]),
        Arc::new(StringArray::from(vec![Some("training"); n])) as ArrayRef,
        Arc::new(BooleanArray::from(vec![false; n])) as ArrayRef,
        strings(vec!["kubernetes".to_owned(); n]),
        Arc::new(StringArray::from(vec![None::<&str>; n])) as ArrayRef,
        times(vec![None; n]),
    ];
    RecordBatch::try_new(schema, columns).expect("batch")
}

#[test]
fn derived_partitions_are_replaced_whole_and_never_ingested() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(config(dir.path())).expect("open");
    let date = "2026-11-18";
    let first = store.replace_partition(Table::Allocations, date, &[allocations(3, T0, "ml")]).expect("replace");
    assert_eq!(store.persisted_files(Table::Allocations), vec![first.clone()]);
    let second = store.replace_partition(Table::Allocations, date, &[allocations(5, T0, "vision")]).expect("again");
    assert_eq!(store.persisted_files(Table::Allocations), vec![second.clone()], "the old file is replaced");
    let read = |p: &Path| {
        let r = ParquetRecordBatchReaderBuilder::try_new(File::open(p).expect("open")).expect("parquet");
        r.build().expect("reader").map(|b| b.expect("batch")).collect::<Vec<_>>()
    };
    let batches = read(&second.path);
    assert_eq!(batches.iter().map(RecordBatch::num_rows).sum::<usize>(), 5);
    assert_eq!(batches[0].schema().fields(), storage_schema(Table::Allocations).fields());
    // Replacing with nothing leaves an empty partition, still one file.
    let empty = store.replace_partition(Table::Allocations, date, &[]).expect("empty");
    assert_eq!(read(&empty.path).iter().map(RecordBatch::num_rows).sum::<usize>(), 0);
    // Survives a restart exactly as it was.
    drop(store);
    let store = Store::open(config(dir.path())).expect("reopen");
    assert_eq!(store.persisted_files(Table::Allocations), vec![empty]);

    // Rows outside the day, raw tables and ingest of derived tables are refused.
    let next_day = T0 + 86_400_000_000;
    assert!(store.replace_partition(Table::Allocations, date, &[allocations(1, next_day, "ml")]).is_err());
    assert!(store.replace_partition(Table::Allocations, "2026-02-31", &[]).is_err());
    assert!(store.replace_partition(Table::GpuSamples, date, &[]).is_err());
    let body = encode_ipc(&allocations(1, T0, "ml")).expect("ipc");
    let req = IngestRequest { table: Table::Allocations, agent: "a", epoch: EPOCH, sequence: 0, body: &body };
    assert!(matches!(store.ingest(req), Err(IngestError::BadRequest(_))));
}

#[test]
fn a_partition_written_as_it_comes_is_checked_and_a_failure_keeps_the_old_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(config(dir.path())).expect("open");
    let date = "2026-11-18";
    let teams_of = |p: &Path| {
        let r = ParquetRecordBatchReaderBuilder::try_new(File::open(p).expect("open")).expect("parquet");
        let mut teams = Vec::new();
        for b in r.build().expect("reader") {
            let b = b.expect("batch");
            let col = b.column_by_name("team").expect("team").as_string::<i32>().clone();
            teams.extend(col.iter().map(|t| t.expect("team").to_owned()));
        }
        teams
    };
    store.replace_partition(Table::Allocations, date, &[allocations(5, T0, "ml")]).expect("whole");
    // Two parts in order: the same partition as one batch would give.
    let rows = allocations(5, T0, "vision");
    let parts = [Ok::<_, String>(rows.slice(0, 2)), Ok(rows.slice(2, 3))];
    let streamed = store.replace_partition_sorted(Table::Allocations, date, parts.into_iter()).expect("streamed");
    assert_eq!(store.persisted_files(Table::Allocations), vec![streamed.clone()]);
    assert_eq!(teams_of(&streamed.path), vec!["vision"; 5]);

    // Out of order, a producer's error, a row of the next day: refused, the stored
    // partition stays, no temp file is left behind.
    let fail = |parts: Vec<Result<RecordBatch, String>>| {
        store.replace_partition_sorted(Table::Allocations, date, parts.into_iter()).expect_err("refused").to_string()
    };
    let other = allocations(5, T0, "infra");
    let e = fail(vec![Ok(other.slice(2, 3)), Ok(other.slice(0, 2))]);
    assert!(e.contains("not in (gpu_uuid, time) order") && e.contains("allocations"), "{e}");
    let e = fail(vec![Ok(other.slice(0, 2)), Err("the rollup query failed".into())]);
    assert!(e.contains("the rollup query failed"), "{e}");
    let e = fail(vec![Ok(allocations(1, T0 + 86_400_000_000, "infra"))]);
    assert!(e.contains("outside the partition's day"), "{e}");
    assert_eq!(store.persisted_files(Table::Allocations), vec![streamed.clone()]);
    assert_eq!(teams_of(&streamed.path), vec!["vision"; 5]);
    let partition = dir.path().join("allocations").join(format!("date={date}"));
    let temp: Vec<_> = std::fs::read_dir(&partition)
        .expect("partition")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert!(temp.is_empty(), "{temp:?}");
}

#[test]
fn duplicates_are_stored_once_across_restarts() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let store = Store::open(config(dir.path())).expect("open");
        assert!(!ingest(&store, "a", 1, &samples(1, 0.5)).expect("first").duplicate);
        assert!(ingest(&store, "a", 1, &samples(1, 0.5)).expect("retry").duplicate);
        // Same sequence, other agent or epoch: a different batch.
        assert!(!ingest(&store, "b", 1, &samples(2, 0.5)).expect("other agent").duplicate);
        let other_epoch =
            IngestRequest { table: Table::GpuSamples, agent: "a", epoch: "other", sequence: 1, body: &samples(3, 0.5) };
        assert!(!store.ingest(other_epoch).expect("other epoch").duplicate);
        store.persist_now().expect("persist");
        // Known from the checkpoint after the persist, and later from the WAL.
        assert!(!ingest(&store, "a", 2, &samples(4, 0.5)).expect("new").duplicate);
    }
    let store = Store::open(config(dir.path())).expect("reopen");
    assert!(ingest(&store, "a", 1, &samples(1, 0.5)).expect("retry after restart").duplicate, "from checkpoint");
    assert!(ingest(&store, "a", 2, &samples(4, 0.5)).expect("retry after restart").duplicate, "from WAL replay");
    assert_eq!(rows(&store, Table::GpuSamples), expected([1, 2, 3, 4]));
}

/// The last segment of the store's WAL.
fn last_segment(dir: &Path) -> PathBuf {
    list_segments(&dir.join("wal")).expect("list").pop().expect("a segment").1
}

#[test]
fn crash_with_torn_wal_tail_replays_acknowledged_rows_only() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let store = Store::open(config(dir.path())).expect("open");
        for n in 0..5 {
            ingest(&store, "a", n as u64, &samples(n, 0.1)).expect("ingest");
        }
        // Dropped without persist: the process "dies" with everything in the WAL only.
    }
    // The crash interrupted the write of a sixth, unacknowledged record halfway.
    let body = samples(5, 0.1);
    let torn = encode_record(&WalRecord {
        table: "gpu_samples",
        agent: "a",
        epoch: EPOCH,
        sequence: 5,
        received_us: T0,
        body: &body,
    })
    .expect("encode");
    let half = &torn[..torn.len() / 2];
    OpenOptions::new().append(true).open(last_segment(dir.path())).expect("open").write_all(half).expect("write");

    let store = Store::open(config(dir.path())).expect("reopen");
    let report = store.open_report().clone();
    assert_eq!(report.replay.torn_bytes, half.len() as u64);
    assert_eq!(report.replayed_records, 5);
    assert_eq!(rows(&store, Table::GpuSamples), expected(0..5), "every acknowledged row, nothing else");
    // The torn batch was never acknowledged, so its retry is new, not a duplicate.
    assert!(!ingest(&store, "a", 5, &body).expect("retry").duplicate);
    drop(store);

    // Garbage after the tail (e.g. a preallocated, never-written block).
    OpenOptions::new().append(true).open(last_segment(dir.path())).expect("open").write_all(&[0xA5; 100]).expect("w");
    let store = Store::open(config(dir.path())).expect("reopen");
    assert_eq!(store.open_report().replay.torn_bytes, 100);
    assert_eq!(rows(&store, Table::GpuSamples), expected(0..6));
}

#[test]
fn bad_bodies_are_refused_and_nothing_is_stored() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = StoreConfig { max_rows_per_batch: 10, ..config(dir.path()) };
    {
        let store = Store::open(cfg.clone()).expect("open");
        let status = |r: Result<IngestOutcome, IngestError>| r.expect_err("refused").status();
        assert_eq!(status(ingest(&store, "a", 1, b"definitely not arrow")), 400);
        assert_eq!(status(ingest(&store, "a", 2, &processes(0))), 422, "gpu_processes body for gpu_samples");
        assert_eq!(status(ingest(&store, "a", 3, &samples(0, 0.5))), 413, "20 rows > 10");
        assert_eq!(status(ingest(&store, "a", 3, &samples(0, 0.5)[..300])), 400, "truncated stream");
        let err = ingest(&store, "", 4, &processes(0)).expect_err("no agent");
        assert_eq!((err.status(), err.code()), (400, "bad_request"));
        let no_epoch = IngestRequest { table: Table::GpuSamples, agent: "a", epoch: "", sequence: 4, body: &[] };
        assert_eq!(store.ingest(no_epoch).expect_err("no epoch").status(), 400);
        let wide = StoreConfig { max_rows_per_batch: 1000, ..cfg.clone() };
        drop(store);
        let store = Store::open(wide).expect("open");
        // A ratio of 12 cannot be stored as Decimal(5,4): refused, not clamped.
        let err = ingest(&store, "a", 5, &samples(0, 12.0)).expect_err("out of range");
        assert_eq!((err.status(), err.code()), (422, "unrepresentable_value"), "{err}");
        assert!(err.to_string().contains("gpu_util"), "{err}");
        assert!(store.snapshot(Table::GpuSamples).is_empty());
        assert_eq!(store.memtable_stats(Table::GpuSamples).rows, 0);
        // Refusals leave no dedup trace: the same sequence with a good body is new.
        assert!(!ingest(&store, "a", 5, &samples(0, 0.5)).expect("good body").duplicate);
    }
    let store = Store::open(cfg).expect("reopen");
    assert_eq!(store.open_report().replayed_records, 1, "only the good batch reached the WAL");
    assert_eq!(rows(&store, Table::GpuSamples), expected([0]));
}

#[test]
fn injected_append_failures_fail_cleanly_and_recover() {
    let dir = tempfile::tempdir().expect("tempdir");
    let io = FaultyIo::new();
    {
        let store = Store::open_with_io(config(dir.path()), Arc::new(io.clone())).expect("open");
        ingest(&store, "a", 0, &samples(0, 0.3)).expect("ingest");

        io.set(Fault::DiskFull);
        let err = ingest(&store, "a", 1, &samples(1, 0.3)).expect_err("disk full");
        assert_eq!((err.status(), err.code()), (507, "storage_full"), "{err}");
        assert!(err.is_retryable());
        assert_eq!(store.memtable_stats(Table::GpuSamples).rows, 20, "nothing of the failed batch is visible");

        io.set(Fault::SyncFails);
        let err = ingest(&store, "a", 2, &samples(2, 0.3)).expect_err("fsync fails");
        assert_eq!((err.status(), err.code()), (503, "storage_unavailable"), "{err}");

        io.set(Fault::None);
        // The agent's retries of both now succeed, as new batches.
        assert!(!ingest(&store, "a", 1, &samples(1, 0.3)).expect("retry").duplicate);
        assert!(!ingest(&store, "a", 2, &samples(2, 0.3)).expect("retry").duplicate);
        ingest(&store, "a", 3, &samples(3, 0.3)).expect("ingest");
        assert_eq!(rows(&store, Table::GpuSamples), expected(0..4));
    }
    // After a restart nothing is missing or doubled (a record whose fsync "failed" may
    // still be in the abandoned segment; dedup drops the retried copy).
    let store = Store::open(config(dir.path())).expect("reopen");
    assert_eq!(rows(&store, Table::GpuSamples), expected(0..4));
    store.persist_now().expect("persist");
    drop(store);
    let store = Store::open(config(dir.path())).expect("reopen");
    assert_eq!(rows(&store, Table::GpuSamples), expected(0..4));
}

#[test]
fn parquet_files_have_the_contract_names_and_types() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(config(dir.path())).expect("open");
    ingest(&store, "a", 0, &samples(0, 0.1234)).expect("ingest");
    let req = IngestRequest { table: Table::GpuProcesses, agent: "a", epoch: EPOCH, sequence: 1, body: &processes(0) };
    assert_eq!(store.ingest(req).expect("processes").rows, GPUS);
    let report = store.persist_now().expect("persist");
    assert_eq!(report.files.len(), 2);
    for f in &report.files {
        assert!(f.path.starts_with(dir.path().join(f.table.name()).join("date=2026-11-18")), "{:?}", f.path);
        let builder = ParquetRecordBatchReaderBuilder::try_new(File::open(&f.path).expect("open")).expect("parquet");
        let schema = builder.schema().clone();
        let wire = f.table.schema();
        let names = |s: &arrow_schema::Schema| s.fields().iter().map(|f| f.name().clone()).collect::<Vec<_>>();
        assert_eq!(names(&schema), names(&wire), "contract column names, in order");
        assert_eq!(schema.fields(), storage_schema(f.table).fields());
        assert_eq!(
            schema.field_with_name("time").expect("time").data_type(),
            &DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into()))
        );
        for field in schema.fields() {
            assert!(!field.data_type().is_unsigned_integer(), "{}", field.name());
        }
        assert_eq!(schema.field_with_name("fb_used_bytes").expect("col").data_type(), &DataType::Int64);
        let batch = builder.build().expect("reader").next().expect("a batch").expect("read");
        if f.table == Table::GpuSamples {
            assert_eq!(schema.field_with_name("gpu_util").expect("col").data_type(), &DataType::Decimal128(5, 4));
            assert_eq!(schema.field_with_name("power_watts").expect("col").data_type(), &DataType::Decimal128(9, 3));
            let util =
                batch.column_by_name("gpu_util").expect("col").as_primitive::<arrow_array::types::Decimal128Type>();
            assert_eq!(util.value_as_string(0), "0.1234");
        } else {
            assert_eq!(schema.field_with_name("sm_util").expect("col").data_type(), &DataType::Decimal128(5, 4));
        }
    }
}

#[test]
fn a_crash_inside_persist_is_finished_or_undone_at_start_up() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Committed but not renamed: the checkpoint names a temp file that still exists.
    {
        let store = Store::open(config(dir.path())).expect("open");
        ingest(&store, "a", 0, &samples(0, 0.2)).expect("ingest");
        let report = store.persist_now().expect("persist");
        let path = &report.files[0].path;
        let tmp = path.with_file_name(format!(".{}.tmp", path.file_name().and_then(|n| n.to_str()).expect("name")));
        std::fs::rename(path, &tmp).expect("un-rename");
        let mut cp = Checkpoint::load(dir.path()).expect("load").expect("exists");
        let rel = |p: &Path| p.strip_prefix(dir.path()).expect("inside").to_path_buf();
        cp.publish = vec![Rename { from: rel(&tmp), to: rel(path) }];
        cp.store(dir.path()).expect("store");
    }
    let store = Store::open(config(dir.path())).expect("reopen");
    assert_eq!(store.open_report().renames_completed, 1);
    assert_eq!(rows(&store, Table::GpuSamples), expected([0]));

    // Written but not committed: an orphan temp file whose rows are still in the WAL.
    ingest(&store, "a", 1, &samples(1, 0.2)).expect("ingest");
    let part = store.persisted_files(Table::GpuSamples)[0].path.parent().expect("partition").to_path_buf();
    drop(store);
    std::fs::copy(store_file(&part), part.join(".0192aaaa-bbbb-7ccc-8ddd-eeeeeeeeeeee.parquet.tmp")).expect("orphan");
    let store = Store::open(config(dir.path())).expect("reopen");
    assert_eq!(store.open_report().temp_files_removed, 1);
    assert_eq!(rows(&store, Table::GpuSamples), expected([0, 1]));
}

fn store_file(partition: &Path) -> PathBuf {
    std::fs::read_dir(partition)
        .expect("ls")
        .map(|e| e.expect("entry").path())
        .find(|p| p.extension().is_some_and(|e| e == "parquet"))
        .expect("a parquet file")
}

#[test]
fn concurrent_ingest_and_persist_lose_and_double_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Arc::new(Store::open(config(dir.path())).expect("open"));
    let writers: Vec<_> = (0..4i64)
        .map(|w| {
            let store = store.clone();
            std::thread::spawn(move || {
                for i in 0..15 {
                    let n = w * 100 + i;
                    ingest(&store, &format!("agent-{w}"), i as u64, &samples(n, 0.4)).expect("ingest");
                }
            })
        })
        .collect();
    let persister = {
        let store = store.clone();
        std::thread::spawn(move || {
            for _ in 0..5 {
                store.persist_now().expect("persist");
                std::thread::yield_now();
            }
        })
    };
    for t in writers {
        t.join().expect("writer");
    }
    persister.join().expect("persister");
    let all = (0..4).flat_map(|w| (0..15).map(move |i| w * 100 + i));
    assert_eq!(rows(&store, Table::GpuSamples), expected(all.clone()));
    drop(Arc::into_inner(store).expect("sole owner"));
    let store = Store::open(config(dir.path())).expect("reopen");
    assert_eq!(rows(&store, Table::GpuSamples), expected(all));
}

#[test]
fn a_second_store_on_the_same_directory_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _store = Store::open(config(dir.path())).expect("open");
    let err = Store::open(config(dir.path())).expect_err("locked");
    assert!(err.to_string().contains("in use"), "{err}");
}

/// A real full disk: a 1 MiB tmpfs as the data directory. Needs root and mount(8). CI
/// (`scripts/test.sh` sets `APRON_REQUIRE_TOOLS`) fails when it cannot mount; elsewhere
/// the test says so loudly and the injected-failure test above covers the same path.
#[test]
fn tmpfs_disk_full_then_recovery() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).expect("mkdir");
    let mounted = Command::new("mount").args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"]).arg(&mnt).output();
    match mounted {
        Ok(o) if o.status.success() => {}
        other => {
            assert!(
                std::env::var_os("APRON_REQUIRE_TOOLS").is_none(),
                "cannot mount a tmpfs for the disk-full test ({other:?}); CI requires it"
            );
            eprintln!(
                "NOTE: tmpfs disk-full test not run: cannot mount a tmpfs here ({other:?}); see injected_append_failures_fail_cleanly_and_recover"
            );
            return;
        }
    }
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(mnt.clone());
    let data = mnt.join("data");
    let cfg = StoreConfig { wal_segment_bytes: 256 << 10, ..config(&data) };
    let filler = mnt.join("filler");
    std::fs::write(&filler, vec![0u8; 600 << 10]).expect("filler");

    let store = Store::open(cfg.clone()).expect("open");
    let mut acked = Vec::new();
    let mut full = None;
    for n in 0..1000 {
        match ingest(&store, "a", n as u64, &samples(n, 0.7)) {
            Ok(_) => acked.push(n),
            Err(e) => {
                full = Some(e);
                break;
            }
        }
    }
    let err = full.expect("the disk fills up");
    assert_eq!(err.status(), 507, "{err}");
    assert!(!acked.is_empty());
    let persist = store.persist_now();
    if let Err(e) = &persist {
        assert!(e.is_storage_full(), "{e}");
    }
    eprintln!("tmpfs: {} batches acknowledged, then: {err}; persist on the full disk: {persist:?}", acked.len());
    assert_eq!(rows(&store, Table::GpuSamples), expected(acked.iter().copied()));

    std::fs::remove_file(&filler).expect("free space");
    let n = acked.len() as i64;
    ingest(&store, "a", n as u64, &samples(n, 0.7)).expect("ingest after space returns");
    acked.push(n);
    store.persist_now().expect("persist after space returns");
    drop(store);
    let store = Store::open(cfg).expect("reopen");
    assert_eq!(rows(&store, Table::GpuSamples), expected(acked.iter().copied()));
}

/// Senders faster than persist, as agents after an outage: the memtable budget holds
/// (ingest answers 503 `memtable_full` until a persist frees room), every batch the
/// senders retry is stored once, and none is lost.
#[test]
fn a_flood_faster_than_persist_is_held_to_the_memtable_budget() {
    let dir = tempfile::tempdir().expect("tempdir");
    let budget: u64 = 256 << 10;
    let store = Arc::new(
        Store::open(StoreConfig {
            persist_max_bytes: budget / 4,
            memtable_max_bytes: budget,
            // Persist only when asked by the size trigger (the background thread).
            persist_interval: Duration::from_secs(3600),
            ..config(dir.path())
        })
        .expect("open"),
    );
    let largest = (0..1).map(|n| samples(n, 0.5).len()).max().unwrap_or(0);
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let (store, done) = (store.clone(), done.clone());
        std::thread::spawn(move || {
            let mut peak = 0;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(store.held_bytes());
                std::thread::yield_now();
            }
            peak
        })
    };
    const SENDERS: i64 = 8;
    const BATCHES: i64 = 60;
    let senders: Vec<_> = (0..SENDERS)
        .map(|w| {
            let store = store.clone();
            std::thread::spawn(move || {
                let mut refused = 0;
                for i in 0..BATCHES {
                    let body = samples(w * 1000 + i, 0.4);
                    loop {
                        match ingest(&store, &format!("agent-{w}"), i as u64, &body) {
                            Ok(out) => {
                                assert!(!out.duplicate);
                                break;
                            }
                            Err(e @ IngestError::Backpressure { .. }) => {
                                assert_eq!((e.status(), e.code()), (503, "memtable_full"));
                                refused += 1;
                                std::thread::sleep(Duration::from_millis(2));
                            }
                            Err(e) => panic!("ingest: {e}"),
                        }
                    }
                }
                refused
            })
        })
        .collect();
    let refused: usize = senders.into_iter().map(|t| t.join().expect("sender")).sum();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let peak = watcher.join().expect("watcher");
    assert!(refused > 0, "the senders outran persist at least once");
    // Decoded, a batch is smaller than its IPC body; one batch past the budget at most
    // (the one an empty store takes whatever its size).
    assert!(peak as u64 <= budget + largest as u64, "peak {peak} bytes over the budget {budget}");
    store.persist_now().expect("persist");
    assert!(store.persisted_files(Table::GpuSamples).len() > 2, "persisted several times under pressure");
    let all = (0..SENDERS).flat_map(|w| (0..BATCHES).map(move |i| w * 1000 + i));
    assert_eq!(rows(&store, Table::GpuSamples), expected(all));
}

#[test]
fn ingest_waiting_rides_out_back_pressure_and_a_bad_budget_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let err =
        Store::open(StoreConfig { persist_max_bytes: 1 << 20, memtable_max_bytes: 1 << 20, ..config(dir.path()) })
            .expect_err("budget under twice the persist trigger");
    assert!(err.to_string().contains("memtable_max_bytes"), "{err}");
    let store = Store::open(StoreConfig {
        persist_max_bytes: 16 << 10,
        memtable_max_bytes: 32 << 10,
        persist_interval: Duration::from_secs(3600),
        ..config(dir.path())
    })
    .expect("open");
    for n in 0..200 {
        let body = samples(n, 0.3);
        let req =
            IngestRequest { table: Table::GpuSamples, agent: "import", epoch: EPOCH, sequence: n as u64, body: &body };
        store.ingest_waiting(req, Duration::from_secs(60)).expect("waits for room, never refused");
    }
    assert_eq!(rows(&store, Table::GpuSamples), expected(0..200));
    assert!(store.persisted_files(Table::GpuSamples).len() > 1);
}

/// The change feed reports what ingest wrote since the last take — rows that persist
/// or compaction merely move are not reported again, refused bodies never.
#[test]
fn the_change_feed_reports_ingested_spans_once() {
    use apron_collector::changes::TimeSpan;
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(config(dir.path())).expect("open");
    ingest(&store, "a", 0, &samples(0, 0.5)).expect("before anyone listens");
    let feed = store.subscribe_changes();
    ingest(&store, "a", 1, &samples(1, 0.5)).expect("ingest");
    ingest(&store, "a", 2, &samples(2, 0.5)).expect("ingest");
    assert!(ingest(&store, "a", 3, b"not arrow").is_err());
    let day = T0.div_euclid(86_400_000_000);
    let c = feed.take();
    let want = TimeSpan { min_us: T0 + SECS * 1_000_000, max_us: T0 + (3 * SECS - 1) * 1_000_000 };
    assert_eq!(c.day(Table::GpuSamples, day), Some(want));
    assert_eq!(c.days(Table::GpuSamples).count(), 1);
    store.persist_now().expect("persist");
    store.maintain_now();
    assert!(feed.take().is_empty(), "moving rows is not a change");
}
