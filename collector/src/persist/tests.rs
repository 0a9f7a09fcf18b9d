use std::fs::File;

use arrow_array::cast::AsArray;
use arrow_array::types::{Decimal128Type, Int32Type, Int64Type};
use parquet::arrow::arrow_reader::{ArrowReaderOptions, ParquetRecordBatchReaderBuilder};
use parquet::basic::Type as PhysicalType;
use parquet::file::metadata::PageIndexPolicy;

use super::*;
use crate::fsutil::MICROS_PER_DAY;
use crate::schema::to_storage;
use crate::testdata;

/// 2026-11-19T00:00:00Z.
const MIDNIGHT: i64 = 20_776 * MICROS_PER_DAY;

fn stage_and_publish(dir: &Path, table: Table, wire: &RecordBatch, options: PersistOptions) -> Vec<StagedFile> {
    let storage = to_storage(table, wire).expect("convert");
    // Two batches, to check they are merged and sorted across batch boundaries.
    let half = storage.num_rows() / 2;
    let batches = [storage.slice(half, storage.num_rows() - half), storage.slice(0, half)];
    let staged = stage_table(dir, table, &batches, &options).expect("stage");
    for s in &staged {
        assert!(s.tmp.exists() && !s.file.path.exists(), "nothing visible before publish");
    }
    assert!(list_files(dir, table).expect("list").is_empty());
    let pairs: Vec<_> = staged.iter().map(|s| (s.tmp.clone(), s.file.path.clone())).collect();
    publish(&pairs).expect("publish");
    publish(&pairs).expect("publishing twice is harmless");
    staged
}

fn read(path: &Path) -> (Vec<RecordBatch>, parquet::file::metadata::ParquetMetaData) {
    let options = ArrowReaderOptions::new().with_page_index_policy(PageIndexPolicy::Required);
    let builder = ParquetRecordBatchReaderBuilder::try_new_with_options(File::open(path).expect("open"), options)
        .expect("parquet footer");
    let metadata = builder.metadata().as_ref().clone();
    let batches = builder.build().expect("reader").collect::<Result<Vec<_>, _>>().expect("read");
    (batches, metadata)
}

#[test]
fn gpu_samples_files_are_sorted_partitioned_and_exact() {
    for readings in [ReadingEncoding::Delta, ReadingEncoding::ByteStreamSplit] {
        sorted_partitioned_and_exact(readings);
    }
}

fn sorted_partitioned_and_exact(readings: ReadingEncoding) {
    let dir = tempfile::tempdir().expect("tempdir");
    // 16 GPUs × 100 s across midnight: 50 s on each day.
    let wire = testdata::samples(16, MIDNIGHT - 50_000_000, 100);
    let options = PersistOptions { row_group_rows: 300, reading_encoding: readings, ..PersistOptions::default() };
    let staged = stage_and_publish(dir.path(), Table::GpuSamples, &wire, options);
    let files = list_files(dir.path(), Table::GpuSamples).expect("list");
    assert_eq!(files.iter().map(|f| f.date.as_str()).collect::<Vec<_>>(), vec!["2026-11-18", "2026-11-19"]);
    assert_eq!(files.len(), staged.len());
    for f in &files {
        let name = f.path.file_name().and_then(|n| n.to_str()).expect("name");
        assert!(name.ends_with(".parquet") && uuid::Uuid::parse_str(&name[..36]).is_ok(), "{name}");
        assert_eq!(
            f.path.parent().and_then(|p| p.file_name()).and_then(|n| n.to_str()),
            Some(&*format!("date={}", f.date))
        );
    }

    let (batches, meta) = read(&files[1].path);
    let schema = storage_schema(Table::GpuSamples);
    assert_eq!(batches[0].schema().fields(), schema.fields(), "reads back with the storage schema");
    let all = arrow_select::concat::concat_batches(&schema, &batches).expect("concat");
    assert_eq!(all.num_rows(), 16 * 50);

    // Sorted by (gpu_uuid, time) and on the right day.
    let gpu = all.column_by_name("gpu_uuid").expect("col").as_string::<i32>();
    let time = all.column_by_name("time").expect("col").as_primitive::<TimestampMicrosecondType>();
    for i in 1..all.num_rows() {
        assert!((gpu.value(i - 1), time.value(i - 1)) < (gpu.value(i), time.value(i)), "row {i}");
        assert_eq!(day_of_micros(time.value(i)), 20_776);
    }
    // Values exactly at device resolution.
    let row = (0..all.num_rows()).find(|&i| gpu.value(i) == "GPU-0003" && time.value(i) == MIDNIGHT).expect("row");
    let dec = |c: &str| all.column_by_name(c).expect("col").as_primitive::<Decimal128Type>().value(row);
    assert_eq!(dec("gpu_util"), (testdata::util(3, 50) * 1e4).round() as i128);
    assert_eq!(dec("power_watts"), 303_125, "303.125 W in mW");
    assert_eq!(dec("energy_joules"), 1_000_000_000_000 + 50 * 300_125);
    assert_eq!(all.column_by_name("gpu_temp_c").expect("col").as_primitive::<Int32Type>().value(row), 53);
    assert_eq!(all.column_by_name("fb_used_bytes").expect("col").as_primitive::<Int64Type>().value(row), 3 << 20);
    assert!(all.column_by_name("mem_temp_c").expect("col").is_null(row), "NULL stays NULL");

    // File metadata: row groups, sorting columns, encodings, page index, key-value.
    assert_eq!(meta.num_row_groups(), 3, "800 rows in groups of at most 300");
    let kv = meta.file_metadata().key_value_metadata().expect("kv");
    assert!(kv.iter().any(|k| k.key == "apron.table" && k.value.as_deref() == Some("gpu_samples")));
    let idx = |c: &str| schema.index_of(c).expect("col");
    for rg in meta.row_groups() {
        assert!(rg.num_rows() <= 300);
        let sorting = rg.sorting_columns().expect("sorting columns");
        assert_eq!(
            sorting.iter().map(|s| (s.column_idx as usize, s.descending)).collect::<Vec<_>>(),
            vec![(idx("gpu_uuid"), false), (idx("time"), false)]
        );
        let col = |c: &str| rg.column(idx(c));
        let reading = match readings {
            ReadingEncoding::Delta => Encoding::DELTA_BINARY_PACKED,
            ReadingEncoding::ByteStreamSplit => Encoding::BYTE_STREAM_SPLIT,
        };
        let delta = ["time", "energy_joules"].map(|c| (c, Encoding::DELTA_BINARY_PACKED));
        let readings = ["gpu_util", "gpu_util_max", "power_watts", "gpu_temp_c", "fb_used_bytes"].map(|c| (c, reading));
        for (c, encoding) in delta.into_iter().chain(readings) {
            let encodings: Vec<Encoding> = col(c).encodings().collect();
            assert!(encodings.contains(&encoding), "{c}: {encodings:?}");
            assert!(!encodings.contains(&Encoding::RLE_DICTIONARY), "{c}: {encodings:?}");
            assert!(matches!(col(c).compression(), Compression::ZSTD(_)), "{c}");
        }
        for c in ["host", "gpu_uuid", "gpu_model", "gpu_index"] {
            assert!(col(c).encodings().any(|e| e == Encoding::RLE_DICTIONARY), "{c} is dictionary-encoded");
        }
        // Decimals of precision ≤ 9 sit on INT32, ≤ 18 on INT64: integer encodings apply.
        assert_eq!(col("gpu_util").column_type(), PhysicalType::INT32);
        assert_eq!(col("power_watts").column_type(), PhysicalType::INT32);
        assert_eq!(col("energy_joules").column_type(), PhysicalType::INT64);
        assert_eq!(col("time").column_type(), PhysicalType::INT64);
    }
    let column_index = meta.column_index().expect("column index (page statistics)");
    let offset_index = meta.offset_index().expect("offset index");
    assert_eq!((column_index.len(), offset_index.len()), (3, 3));
}

#[test]
fn gpu_processes_are_sorted_and_exact() {
    let dir = tempfile::tempdir().expect("tempdir");
    let wire = testdata::processes(5, MIDNIGHT + 1);
    stage_and_publish(dir.path(), Table::GpuProcesses, &wire, PersistOptions::default());
    let files = list_files(dir.path(), Table::GpuProcesses).expect("list");
    assert_eq!(files.len(), 1);
    assert!(files[0].path.starts_with(dir.path().join("gpu_processes").join("date=2026-11-19")));
    let (batches, meta) = read(&files[0].path);
    let b = &batches[0];
    assert_eq!(b.schema().fields(), storage_schema(Table::GpuProcesses).fields());
    let gpu = b.column_by_name("gpu_uuid").expect("col").as_string::<i32>();
    assert_eq!(
        gpu.iter().flatten().collect::<Vec<_>>(),
        vec!["GPU-0000", "GPU-0001", "GPU-0002", "GPU-0003", "GPU-0004"]
    );
    let sm = b.column_by_name("sm_util").expect("col").as_primitive::<Decimal128Type>();
    assert_eq!(sm.value(0), 2500);
    assert_eq!(sm.value_as_string(0), "0.2500");
    assert!(meta.row_group(0).sorting_columns().is_some());
}

#[test]
fn temp_files_are_invisible_and_cleaned_up() {
    let dir = tempfile::tempdir().expect("tempdir");
    let storage = to_storage(Table::GpuSamples, &testdata::samples(2, MIDNIGHT, 3)).expect("convert");
    let staged = stage_table(dir.path(), Table::GpuSamples, &[storage], &PersistOptions::default()).expect("stage");
    assert_eq!(staged.len(), 1);
    assert!(list_files(dir.path(), Table::GpuSamples).expect("list").is_empty());
    assert_eq!(remove_temp_files(dir.path(), Table::GpuSamples).expect("clean"), 1);
    assert!(!staged[0].tmp.exists());
    assert_eq!(remove_temp_files(dir.path(), Table::GpuProcesses).expect("no table dir yet"), 0);
}

#[test]
fn encoding_choice() {
    use parquet::basic::Encoding::{BYTE_STREAM_SPLIT as SPLIT, DELTA_BINARY_PACKED as DELTA};
    let time = DataType::Timestamp(arrow_schema::TimeUnit::Microsecond, None);
    let cases = [
        (Table::GpuSamples, "time", time.clone(), Some(DELTA)),
        (Table::GpuSamples, "gpu_util", DataType::Decimal128(5, 4), Some(SPLIT)),
        (Table::GpuSamples, "gpu_util_max", DataType::Decimal128(5, 4), Some(SPLIT)),
        (Table::GpuSamples, "power_watts", DataType::Decimal128(9, 3), Some(SPLIT)),
        (Table::GpuSamples, "pcie_rx_bytes_per_s", DataType::Int64, Some(SPLIT)),
        (Table::GpuSamples, "fb_used_bytes", DataType::Int64, Some(SPLIT)),
        (Table::GpuSamples, "energy_joules", DataType::Decimal128(18, 3), Some(DELTA)),
        (Table::GpuSamples, "ecc_sbe_total", DataType::Int64, Some(DELTA)),
        (Table::GpuSamples, "clocks_event_reasons", DataType::Int64, Some(DELTA)),
        (Table::GpuSamples, "gpu_index", DataType::Int32, None),
        (Table::GpuSamples, "host", DataType::Utf8, None),
        (Table::GpuSamples, "window_s", DataType::Float64, None),
        (Table::GpuSamples1m, "time", time, Some(DELTA)),
        (Table::GpuSamples1m, "gpu_util_min", DataType::Decimal128(5, 4), Some(SPLIT)),
        (Table::GpuSamples1m, "gpu_util_max_max", DataType::Decimal128(5, 4), Some(SPLIT)),
        (Table::GpuSamples1m, "gpu_util_mean", DataType::Float64, None),
        (Table::GpuSamples1m, "samples", DataType::Int64, Some(DELTA)),
        (Table::GpuProcesses, "pid", DataType::Int64, None),
        (Table::GpuProcesses, "sm_util", DataType::Decimal128(5, 4), Some(DELTA)),
    ];
    for (table, name, data_type, want) in cases {
        let split = column_encoding(table, name, &data_type, ReadingEncoding::ByteStreamSplit);
        assert_eq!(split, want, "{table:?}.{name}");
        // The default, which every lake reader opens: delta wherever split would be.
        let delta = column_encoding(table, name, &data_type, ReadingEncoding::Delta);
        assert_eq!(delta, want.map(|_| DELTA), "{table:?}.{name}");
    }
}
