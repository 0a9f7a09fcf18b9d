use arrow_array::cast::AsArray;
use arrow_array::types::{Decimal128Type, TimestampMicrosecondType};

use std::fs::File;

use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

use super::*;
use crate::persist::{list_files, publish, stage_table};
use crate::schema::to_storage;
use crate::testdata::{self, MIDNIGHT};

/// Persists `secs` seconds of `gpus` GPUs starting `offset_s` after MIDNIGHT, as one
/// published file, the way one persist would.
fn persist_one(dir: &Path, gpus: usize, offset_s: i64, secs: i64, row_group_rows: usize) {
    let wire = testdata::samples(gpus, MIDNIGHT + offset_s * 1_000_000, secs);
    let storage = to_storage(Table::GpuSamples, &wire).expect("convert");
    let options = PersistOptions { row_group_rows, ..PersistOptions::default() };
    let staged = stage_table(dir, Table::GpuSamples, &[storage], &options).expect("stage");
    publish(&staged.iter().map(|s| (s.tmp.clone(), s.file.path.clone())).collect::<Vec<_>>()).expect("publish");
}

/// Two persisted files of `gpus` GPUs × 10 s in one partition, and the plan merging them.
fn two_files_and_their_merge(dir: &Path, gpus: usize) -> (Vec<PersistedFile>, Plan) {
    for offset in [0, 10] {
        persist_one(dir, gpus, offset, 10, 100);
    }
    let files = list_files(dir, Table::GpuSamples).expect("list");
    let p = plan(&files, i64::MAX, POLICY).remove(0);
    (files, p)
}

fn read_all(path: &Path) -> RecordBatch {
    let b = ParquetRecordBatchReaderBuilder::try_new(File::open(path).expect("open")).expect("footer");
    let batches = b.build().expect("reader").collect::<Result<Vec<_>, _>>().expect("read");
    arrow_select::concat::concat_batches(&storage_schema(Table::GpuSamples), &batches).expect("concat")
}

/// (gpu_uuid, time, gpu_util) of every row: what must survive a merge unchanged.
fn keyed_rows(b: &RecordBatch) -> Vec<(String, i64, i128)> {
    let gpu = b.column_by_name("gpu_uuid").expect("col").as_string::<i32>();
    let time = b.column_by_name("time").expect("col").as_primitive::<TimestampMicrosecondType>();
    let util = b.column_by_name("gpu_util").expect("col").as_primitive::<Decimal128Type>();
    (0..b.num_rows()).map(|i| (gpu.value(i).to_owned(), time.value(i), util.value(i))).collect()
}

fn local(dir: &Path) -> Storage {
    Storage::Local { data_dir: dir.to_path_buf() }
}

const POLICY: Policy = Policy { delay_us: 3_600_000_000, max_files: 48 };

#[test]
fn merges_a_partition_into_one_sorted_file_with_bounded_memory() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Three persists of 12 GPUs over overlapping-in-GPU, disjoint-in-time stretches.
    for (offset, secs) in [(0, 40), (40, 25), (65, 35)] {
        persist_one(dir.path(), 12, offset, secs, 64);
    }
    let before = list_files(dir.path(), Table::GpuSamples).expect("list");
    assert_eq!(before.len(), 3);
    let mut expected: Vec<_> = before.iter().flat_map(|f| keyed_rows(&read_all(&f.path))).collect();
    expected.sort();

    let plans = plan(&before, MIDNIGHT + 86_400_000_000 + 3_600_000_000, POLICY);
    assert_eq!(plans.len(), 1);
    // 250 rows in memory at most: 12 GPUs × 100 rows come through in ranges of 2 GPUs.
    let staged = merge(
        &local(dir.path()),
        &plans[0],
        &PersistOptions { row_group_rows: 128, ..PersistOptions::default() },
        250,
        &|| false,
    )
    .expect("merge");
    assert_eq!(staged.rows, 1200);
    assert!(staged.tmp.exists() && !staged.file.path.exists(), "nothing visible before the commit");
    assert_eq!(list_files(dir.path(), Table::GpuSamples).expect("list").len(), 3);

    let journal = commit(&local(dir.path()), &plans[0], &staged).expect("commit");
    assert_eq!(journal.inputs.len(), 3);
    let after = list_files(dir.path(), Table::GpuSamples).expect("list");
    assert_eq!(after, vec![staged.file.clone()], "the inputs are hidden once committed");
    assert!(before.iter().all(|f| f.path.exists()), "… but kept for queries planned before");

    let merged = read_all(&staged.file.path);
    let rows = keyed_rows(&merged);
    assert!(rows.windows(2).all(|w| (&w[0].0, w[0].1) < (&w[1].0, w[1].1)), "sorted by (gpu_uuid, time)");
    assert_eq!(rows, expected, "every row once, values unchanged");
    let meta = ParquetRecordBatchReaderBuilder::try_new(File::open(&staged.file.path).expect("open"))
        .expect("footer")
        .metadata()
        .clone();
    assert!(meta.row_groups().iter().all(|rg| rg.num_rows() <= 128 && rg.sorting_columns().is_some()));

    let partition = staged.file.path.parent().expect("dir");
    assert_eq!(finish(&local(dir.path()), partition).expect("finish"), 3);
    assert!(before.iter().all(|f| !f.path.exists()));
    assert!(!partition.join(JOURNAL).exists());
    assert_eq!(finish(&local(dir.path()), partition).expect("idempotent"), 0);
    assert_eq!(plans[0].output, Level::Day, "a finished day merges into its day file");
    assert!(staged.tmp.to_string_lossy().ends_with(".day.parquet.tmp"), "{:?}", staged.tmp);
    assert_eq!(Level::of(&staged.file.path), Level::Day);
    assert_eq!(list_files(dir.path(), Table::GpuSamples).expect("list"), vec![staged.file]);
}

/// A file of the partition `date` with the given name and size.
fn named(date: &str, name: &str, bytes: u64) -> PersistedFile {
    PersistedFile {
        table: Table::GpuSamples,
        date: date.into(),
        path: PathBuf::from(format!("gpu_samples/date={date}/{name}")),
        bytes,
    }
}

#[test]
fn levels_round_trip_through_file_names() {
    let id = "0193a0b2-7c4d-7e2a-9b1d-5f3e2a1b0c9d";
    for level in [Level::Tier(0), Level::Tier(1), Level::Tier(12), Level::Day] {
        assert_eq!(Level::of(Path::new(&level.file_name(id))), level);
    }
    assert_eq!(Level::Tier(0).file_name(id), format!("{id}.parquet"), "a persist's name is unchanged");
    // Files of earlier versions and odd names are tier 0.
    for name in ["x.parquet", "a.b.parquet", "x.tz.parquet", "x.t.parquet", "x.t-1.parquet"] {
        assert_eq!(Level::of(Path::new(name)), Level::Tier(0), "{name}");
    }
}

#[test]
fn tiers_merge_only_their_own_files_and_a_day_is_merged_once() {
    let policy = Policy { delay_us: 3_600_000_000, max_files: 2 };
    let open = MIDNIGHT + 3_600_000_000;
    let date = "2026-11-19"; // MIDNIGHT's
    // Two tier-0 files (not more than max_files) and three tier-1 files: tier 1 goes.
    let files = vec![
        named(date, "a.parquet", 10),
        named(date, "b.parquet", 10),
        named(date, "c.t1.parquet", 100),
        named(date, "d.t1.parquet", 100),
        named(date, "e.t1.parquet", 100),
        named(date, "f.t2.parquet", 1000),
    ];
    let plans = plan(&files, open, policy);
    assert_eq!(plans.len(), 1);
    assert_eq!(plans[0].output, Level::Tier(2));
    assert_eq!(plans[0].inputs, files[2..5].to_vec());
    // The lowest tier with too many files first.
    let mut more = files.clone();
    more.push(named(date, "g.parquet", 10));
    let plans = plan(&more, open, policy);
    assert_eq!((plans[0].output, plans[0].inputs.len()), (Level::Tier(1), 3));

    // Finished: everything into the day's file, once.
    let finished = MIDNIGHT + 86_400_000_000 + 3_600_000_000;
    let plans = plan(&files, finished, policy);
    assert_eq!((plans[0].output, plans[0].inputs.clone()), (Level::Day, files.clone()));
    // Late files beside the day's file are tiered; the day's file is not read again.
    let mut late = vec![named(date, "z.day.parquet", 5000), named(date, "h.parquet", 1), named(date, "i.parquet", 1)];
    assert!(plan(&late, finished, policy).is_empty(), "two late files: not more than max_files");
    late.push(named(date, "j.parquet", 1));
    let plans = plan(&late, finished, policy);
    assert_eq!((plans[0].output, plans[0].inputs.clone()), (Level::Tier(1), late[1..].to_vec()));
    // A finished day with one file has nothing to merge.
    assert!(plan(&files[..1], finished, policy).is_empty());
}

#[test]
fn a_tier_that_fell_behind_is_merged_a_bounded_batch_at_a_time_oldest_first() {
    let policy = Policy { delay_us: 3_600_000_000, max_files: 2 };
    let open = MIDNIGHT + 3_600_000_000;
    let date = "2026-11-19";
    // Seven tier-0 files, listed out of creation order: at most 2 × max_files go, the
    // oldest names (v7 ids sort by creation) first.
    let files: Vec<_> =
        ["g", "c", "a", "f", "b", "e", "d"].iter().map(|n| named(date, &format!("{n}.parquet"), 10)).collect();
    let plans = plan(&files, open, policy);
    assert_eq!(plans.len(), 1);
    let names: Vec<_> = plans[0].inputs.iter().map(|f| file_name(&f.path)).collect();
    assert_eq!(names, ["a.parquet", "b.parquet", "c.parquet", "d.parquet"]);
    assert_eq!(plans[0].output, Level::Tier(1));
    // Three left: still more than max_files, so the next pass merges them.
    let rest: Vec<_> = files.iter().filter(|f| !plans[0].inputs.contains(f)).cloned().collect();
    assert_eq!(plan(&rest, open, policy)[0].inputs.len(), 3);
}

#[test]
fn plan_waits_for_the_day_to_end_unless_too_many_files() {
    let dir = tempfile::tempdir().expect("tempdir");
    persist_one(dir.path(), 2, 0, 10, 100);
    let files = list_files(dir.path(), Table::GpuSamples).expect("list");
    let day_end = MIDNIGHT + 86_400_000_000;
    assert!(plan(&files, day_end + 7_200_000_000, POLICY).is_empty(), "one file: nothing to merge");

    persist_one(dir.path(), 2, 10, 10, 100);
    persist_one(dir.path(), 2, 20, 10, 100);
    let files = list_files(dir.path(), Table::GpuSamples).expect("list");
    assert!(plan(&files, MIDNIGHT + 3_600_000_000, POLICY).is_empty(), "the day is not over");
    assert!(plan(&files, day_end + 3_599_999_999, POLICY).is_empty(), "still within the delay");
    assert_eq!(plan(&files, day_end + 3_600_000_000, POLICY).len(), 1);
    let eager = Policy { delay_us: 3_600_000_000, max_files: 2 };
    let plans = plan(&files, MIDNIGHT, eager);
    assert_eq!(plans.len(), 1, "more than max_files merges early");
    assert_eq!((plans[0].output, plans[0].inputs.len()), (Level::Tier(1), 3));
}

#[test]
fn start_up_finishes_a_committed_compaction_and_drops_an_uncommitted_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (before, p) = two_files_and_their_merge(dir.path(), 3);
    let p = &p;
    let staged = merge(&local(dir.path()), p, &PersistOptions::default(), 1_000, &|| false).expect("merge");
    let partition = staged.file.path.parent().expect("dir").to_path_buf();

    // Uncommitted (crash before the journal): start-up removes the orphan temp file.
    assert_eq!(crate::persist::remove_temp_files(dir.path(), Table::GpuSamples).expect("clean"), 1);
    assert_eq!(list_files(dir.path(), Table::GpuSamples).expect("list"), before);

    // Committed, crash before the rename: the journal exists, the output is a temp file.
    let staged = merge(&local(dir.path()), p, &PersistOptions::default(), 1_000, &|| false).expect("merge");
    let j = Journal {
        inputs: p.inputs.iter().map(|f| file_name(&f.path)).collect(),
        output_tmp: file_name(&staged.tmp),
        output: file_name(&staged.file.path),
    };
    fsutil::write_atomic(&partition.join(JOURNAL), &serde_json::to_vec(&j).expect("json")).expect("journal");
    assert_eq!(list_files(dir.path(), Table::GpuSamples).expect("list"), Vec::new(), "inputs hidden, output not yet");
    assert_eq!(recover(&local(dir.path()), Table::GpuSamples).expect("recover"), 1);
    let after = list_files(dir.path(), Table::GpuSamples).expect("list");
    assert_eq!(after.len(), 1);
    assert_eq!(after[0].path, staged.file.path);
    assert_eq!(read_all(&after[0].path).num_rows(), 60);
    assert!(before.iter().all(|f| !f.path.exists()));
}

#[test]
fn retention_finds_days_past_their_age() {
    let day_end = MIDNIGHT + 86_400_000_000;
    let thirty_days = 30 * 86_400_000_000;
    let dates = ["2026-11-19", "2026-11-20", "2026-11-19", "not-a-date"];
    assert!(expired(dates, day_end + thirty_days - 1, thirty_days).is_empty());
    assert_eq!(expired(dates, day_end + thirty_days, thirty_days), vec!["2026-11-19".to_owned()]);
}

#[test]
fn gpu_ranges_respect_the_row_budget() {
    let counts: BTreeMap<String, usize> = [("a", 5), ("b", 5), ("c", 20), ("d", 1)].map(|(k, v)| (k.into(), v)).into();
    let r = gpu_ranges(&counts, 10);
    assert_eq!(r, vec![("a".into(), "b".into()), ("c".into(), "c".into()), ("d".into(), "d".into())]);
    assert!(gpu_ranges(&BTreeMap::new(), 10).is_empty());
}

#[test]
fn the_byte_budget_bounds_what_a_decoded_range_holds() {
    let dir = tempfile::tempdir().expect("tempdir");
    persist_one(dir.path(), 12, 0, 100, 64);
    let files = list_files(dir.path(), Table::GpuSamples).expect("list");
    let decoded = read_all(&files[0].path);
    let measured = crate::memtable::allocated_bytes(&decoded);
    let per_row = row_bytes(Table::GpuSamples);
    assert!(
        measured <= per_row * decoded.num_rows(),
        "the estimate ({per_row} B/row) must cover what decoding holds ({measured} B for {} rows)",
        decoded.num_rows()
    );
    assert_eq!(rows_within(Table::GpuSamples, per_row * 1000 + per_row - 1), 1000);
    assert_eq!(rows_within(Table::GpuSamples, 0), 1, "a merge always makes progress");
}

#[test]
fn a_merge_stops_between_steps_for_shutdown_and_leaves_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (before, p) = two_files_and_their_merge(dir.path(), 4);
    let p = &p;
    // 10 rows per GPU per file: 20-row steps take one GPU at a time; stop at the third.
    let asked = std::cell::Cell::new(0);
    let stop = || {
        asked.set(asked.get() + 1);
        asked.get() > 2
    };
    let r = merge(&local(dir.path()), p, &PersistOptions::default(), 20, &stop);
    assert!(matches!(r, Err(PersistError::Stopped)), "{r:?}");
    assert_eq!(asked.get(), 3);
    assert_eq!(crate::persist::remove_temp_files(dir.path(), Table::GpuSamples).expect("clean"), 0, "no temp file");
    assert_eq!(list_files(dir.path(), Table::GpuSamples).expect("list"), before);
}
