//! The wire schema: what an agent ships to the collector, as Arrow.
//!
//! One Arrow schema per table (`gpu_samples`, `gpu_processes`), derived from the field
//! catalogue so that columns, order and types are written down once. Batches travel as
//! Arrow IPC streams with zstd-compressed buffers; the request headers name the table,
//! the agent, its epoch and a per-epoch sequence number (see [`headers`]).
//!
//! Types follow the contract: timestamps `Timestamp(µs, UTC)`, no unsigned integers,
//! bytes and counts as Int64, measurements as Float64 in base units (the collector
//! stores them exactly at device resolution).

use std::io::Cursor;
use std::sync::{Arc, LazyLock};

use arrow_array::builder::{BooleanBuilder, Float64Builder, Int32Builder, Int64Builder, StringBuilder};
use arrow_array::{ArrayRef, RecordBatch, TimestampMicrosecondArray};
use arrow_ipc::CompressionType;
use arrow_ipc::reader::StreamReader;
use arrow_ipc::writer::{IpcWriteOptions, StreamWriter};
use arrow_schema::{ArrowError, DataType, Field as ArrowField, Schema, SchemaRef, TimeUnit};

use crate::field::{Field, FieldKind};
use crate::window::{GpuHolder, GpuWindow, ProcessRow};

/// Request headers of `POST /api/v1/ingest`.
pub mod headers {
    /// `gpu_samples` or `gpu_processes`.
    pub const TABLE: &str = "x-apron-table";
    /// A stable id of the agent (host name unless configured).
    pub const AGENT: &str = "x-apron-agent";
    /// New at every agent process start, so a restart never reuses sequence numbers.
    pub const EPOCH: &str = "x-apron-epoch";
    /// Per-epoch sequence number of the batch; retried duplicates are dropped on it.
    pub const SEQUENCE: &str = "x-apron-sequence";
    /// The Arrow IPC stream media type.
    pub const ARROW_STREAM: &str = "application/vnd.apache.arrow.stream";
}

/// The stored tables: those an agent ships ([`Table::shipped`]) and those the server
/// derives from them (rollups, allocations, cost), which share the storage path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Table {
    GpuSamples,
    GpuProcesses,
    GpuSamples1m,
    Allocations,
    GpuCostHourly,
}

impl Table {
    pub const ALL: [Table; 5] =
        [Table::GpuSamples, Table::GpuProcesses, Table::GpuSamples1m, Table::Allocations, Table::GpuCostHourly];

    pub const fn name(self) -> &'static str {
        match self {
            Table::GpuSamples => "gpu_samples",
            Table::GpuProcesses => "gpu_processes",
            Table::GpuSamples1m => "gpu_samples_1m",
            Table::Allocations => "allocations",
            Table::GpuCostHourly => "gpu_cost_hourly",
        }
    }

    pub fn from_name(name: &str) -> Option<Table> {
        Table::ALL.into_iter().find(|t| t.name() == name)
    }

    /// True for the tables agents send to `POST /api/v1/ingest`; the others are
    /// written by the server only.
    pub const fn shipped(self) -> bool {
        matches!(self, Table::GpuSamples | Table::GpuProcesses)
    }

    /// The Timestamp(µs, UTC) column whose UTC day names a row's `date=` partition;
    /// files are sorted by (`gpu_uuid`, this).
    pub const fn time_column(self) -> &'static str {
        match self {
            Table::GpuSamples | Table::GpuProcesses | Table::GpuSamples1m => "time",
            Table::Allocations => "start_time",
            Table::GpuCostHourly => "hour",
        }
    }

    /// The order of rows inside each stored file (all ascending): by GPU, then time, so
    /// that a GPU's history is contiguous and its time column sorted.
    pub const fn sort_order(self) -> &'static [&'static str] {
        match self {
            Table::GpuSamples | Table::GpuProcesses | Table::GpuSamples1m => &["gpu_uuid", "time"],
            Table::Allocations => &["gpu_uuid", "start_time"],
            Table::GpuCostHourly => &["gpu_uuid", "hour"],
        }
    }

    /// The schema batches of this table are written in: for shipped tables what agents
    /// send (measurements as Float64, stored exactly by the collector); for derived
    /// ones what the server writes, converted the same way.
    pub fn schema(self) -> SchemaRef {
        match self {
            Table::GpuSamples => GPU_SAMPLES.clone(),
            Table::GpuProcesses => GPU_PROCESSES.clone(),
            Table::GpuSamples1m => GPU_SAMPLES_1M.clone(),
            Table::Allocations => ALLOCATIONS.clone(),
            Table::GpuCostHourly => GPU_COST_HOURLY.clone(),
        }
    }
}

/// Money: exact micro-dollars (the contract's Decimal128(18, 6)).
pub const MONEY: DataType = DataType::Decimal128(18, 6);
/// Exclusive seconds of `gpu_cost_hourly`: exact to the microsecond, so the states of a
/// GPU-hour add up to exactly 3600.
pub const SECONDS: DataType = DataType::Decimal128(18, 6);

/// The rollup aggregates of each measurement in `gpu_samples_1m`.
pub const ROLLUP_SUFFIXES: [&str; 3] = ["_mean", "_min", "_max"];

/// The ownership columns at the end of `gpu_samples`, in order: who held the GPU during
/// the window (all NULL when nobody did). Nullable Utf8, dictionary-encoded in Parquet.
///
/// `owner_kind` is `pod` or `slurm_job`; `owner` is `<namespace>/<pod>` or the job id;
/// `owner_user` is the Slurm job's user; `pod_labels` is a JSON object of the holding
/// pod's labels (and selected annotations), NULL when unknown.
pub const OWNER_COLUMNS: [&str; 11] = [
    "owner_kind",
    "owner",
    "namespace",
    "pod",
    "container",
    "job_id",
    "owner_user",
    "account",
    "partition",
    "qos",
    "pod_labels",
];

fn time_type() -> DataType {
    DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into()))
}

/// The Arrow type of a field's column.
pub fn field_type(f: Field) -> DataType {
    match (f.kind(), f.unit()) {
        (_, "bytes" | "count" | "code" | "bitmask" | "bool") => DataType::Int64,
        (FieldKind::Activity | FieldKind::Gauge | FieldKind::Counter | FieldKind::State, _) => DataType::Float64,
    }
}

/// The `_max` column of an activity field.
pub fn max_column(f: Field) -> Option<String> {
    (f.kind() == FieldKind::Activity).then(|| format!("{}_max", f.column()))
}

static GPU_SAMPLES: LazyLock<SchemaRef> = LazyLock::new(|| {
    let mut fields = vec![
        ArrowField::new("time", time_type(), false),
        ArrowField::new("window_s", DataType::Float64, false),
        ArrowField::new("cluster", DataType::Utf8, true),
        ArrowField::new("host", DataType::Utf8, false),
        ArrowField::new("gpu_uuid", DataType::Utf8, false),
        ArrowField::new("gpu_index", DataType::Int32, false),
        ArrowField::new("gpu_model", DataType::Utf8, false),
        ArrowField::new("parent_gpu_uuid", DataType::Utf8, true),
        ArrowField::new("mig_profile", DataType::Utf8, true),
        ArrowField::new("gpu_lost", DataType::Boolean, false),
    ];
    for &f in Field::ALL {
        fields.push(ArrowField::new(f.column(), field_type(f), true));
        if let Some(max) = max_column(f) {
            fields.push(ArrowField::new(max, field_type(f), true));
        }
    }
    for c in OWNER_COLUMNS {
        fields.push(ArrowField::new(c, DataType::Utf8, true));
    }
    Arc::new(Schema::new(fields))
});

/// `gpu_samples_1m`: the identity of `gpu_samples`, one row per GPU per minute (`time`
/// is the minute's start, so `date_trunc` groups minutes as it groups their windows),
/// `_mean`/`_min`/`_max` of every measurement over the windows ending in
/// `[time, time + 1 min)`, `samples` (windows) and `covered_s` (seconds those windows
/// cover).
static GPU_SAMPLES_1M: LazyLock<SchemaRef> = LazyLock::new(|| {
    let mut fields = vec![
        ArrowField::new("time", time_type(), false),
        ArrowField::new("window_s", DataType::Float64, false),
        ArrowField::new("cluster", DataType::Utf8, true),
        ArrowField::new("host", DataType::Utf8, false),
        ArrowField::new("gpu_uuid", DataType::Utf8, false),
        ArrowField::new("gpu_index", DataType::Int32, false),
        ArrowField::new("gpu_model", DataType::Utf8, false),
        ArrowField::new("parent_gpu_uuid", DataType::Utf8, true),
        ArrowField::new("mig_profile", DataType::Utf8, true),
        ArrowField::new("samples", DataType::Int64, false),
        ArrowField::new("covered_s", DataType::Float64, false),
    ];
    for &f in Field::ALL {
        for suffix in ROLLUP_SUFFIXES {
            // Means of integer fields are fractional.
            let t = if suffix == "_mean" { DataType::Float64 } else { field_type(f) };
            fields.push(ArrowField::new(format!("{}{suffix}", f.column()), t, true));
        }
        if let Some(max) = max_column(f) {
            fields.push(ArrowField::new(format!("{max}_mean"), DataType::Float64, true));
            fields.push(ArrowField::new(format!("{max}_max"), field_type(f), true));
        }
    }
    Arc::new(Schema::new(fields))
});

/// `allocations`: who held which GPU when.
static ALLOCATIONS: LazyLock<SchemaRef> = LazyLock::new(|| {
    let s = |n: &str, nullable| ArrowField::new(n, DataType::Utf8, nullable);
    Arc::new(Schema::new(vec![
        s("gpu_uuid", false),
        s("host", false),
        ArrowField::new("start_time", time_type(), false),
        ArrowField::new("end_time", time_type(), true),
        s("owner_kind", false),
        s("owner", false),
        s("team", false),
        s("workload_kind", true),
        ArrowField::new("interruptible", DataType::Boolean, false),
        s("source", false),
        s("cluster", true),
        // The end of the newest window the cost ledger saw of this holding: while
        // `end_time` is NULL (still held) the holding is known up to here (team scoping
        // of `gpu_samples_1m` reads it; NULL in files written before the column).
        ArrowField::new("held_through", time_type(), true),
    ]))
});

/// `gpu_cost_hourly`: one row per (hour, GPU, team), exclusive seconds and money.
static GPU_COST_HOURLY: LazyLock<SchemaRef> = LazyLock::new(|| {
    let s = |n: &str, nullable| ArrowField::new(n, DataType::Utf8, nullable);
    let mut fields = vec![
        ArrowField::new("hour", time_type(), false),
        s("cluster", true),
        s("host", false),
        s("gpu_uuid", false),
        s("gpu_model", false),
        s("team", false),
    ];
    for c in [
        "active_s",
        "allocated_idle_s",
        "stranded_s",
        "unallocated_idle_s",
        "unallocated_busy_s",
        "unknown_s",
        "underused_s",
    ] {
        fields.push(ArrowField::new(c, SECONDS, false));
    }
    // NULL price and money where the GPU's model has no price (reported, never 0).
    for c in ["price_per_gpu_hour", "cost_usd", "idle_cost_usd", "stranded_cost_usd"] {
        fields.push(ArrowField::new(c, MONEY, true));
    }
    Arc::new(Schema::new(fields))
});

static GPU_PROCESSES: LazyLock<SchemaRef> = LazyLock::new(|| {
    let s = |n: &str| ArrowField::new(n, DataType::Utf8, true);
    Arc::new(Schema::new(vec![
        ArrowField::new("time", time_type(), false),
        ArrowField::new("host", DataType::Utf8, false),
        ArrowField::new("gpu_uuid", DataType::Utf8, false),
        ArrowField::new("pid", DataType::Int64, false),
        s("process_name"),
        s("user"),
        ArrowField::new("fb_used_bytes", DataType::Int64, true),
        ArrowField::new("sm_util", DataType::Float64, true),
        s("container_id"),
        s("pod"),
        s("namespace"),
        s("container"),
        s("pod_uid"),
        s("job_id"),
        // Resolved by the server; agents always send NULL.
        s("team"),
    ]))
});

fn timestamps(values: impl Iterator<Item = i64>) -> ArrayRef {
    Arc::new(TimestampMicrosecondArray::from_iter_values(values).with_timezone("UTC"))
}

fn strings<'a>(values: impl Iterator<Item = Option<&'a str>>) -> ArrayRef {
    let mut b = StringBuilder::new();
    for v in values {
        b.append_option(v);
    }
    Arc::new(b.finish())
}

/// `gpu_samples` rows as one batch.
pub fn windows_to_batch(rows: &[GpuWindow]) -> Result<RecordBatch, ArrowError> {
    let mut cols: Vec<ArrayRef> = vec![
        timestamps(rows.iter().map(|r| r.time.0)),
        Arc::new(rows.iter().map(|r| Some(r.window_secs())).collect::<arrow_array::Float64Array>()),
        strings(rows.iter().map(|r| r.gpu.cluster.as_ref().map(|c| c.as_str()))),
        strings(rows.iter().map(|r| Some(r.gpu.host.as_str()))),
        strings(rows.iter().map(|r| Some(r.gpu.gpu_uuid.as_str()))),
        {
            let mut b = Int32Builder::with_capacity(rows.len());
            for r in rows {
                b.append_value(i32::try_from(r.gpu.gpu_index).unwrap_or(i32::MAX));
            }
            Arc::new(b.finish())
        },
        strings(rows.iter().map(|r| Some(r.gpu.gpu_model.as_str()))),
        strings(rows.iter().map(|r| r.gpu.parent_gpu_uuid.as_ref().map(|p| p.as_str()))),
        strings(rows.iter().map(|r| r.gpu.mig_profile.as_deref())),
        {
            let mut b = BooleanBuilder::with_capacity(rows.len());
            for r in rows {
                b.append_value(r.lost);
            }
            Arc::new(b.finish())
        },
    ];
    for &f in Field::ALL {
        cols.push(column(rows, f, |r| r.value(f)));
        if f.kind() == FieldKind::Activity {
            cols.push(column(rows, f, |r| r.get(f).map(|s| s.max)));
        }
    }
    // In OWNER_COLUMNS order.
    let owner = |get: fn(&GpuHolder) -> Option<&str>| strings(rows.iter().map(move |r| r.owner.as_ref().and_then(get)));
    cols.extend([
        owner(|o| Some(o.kind.as_str())),
        owner(|o| Some(o.owner.as_str())),
        owner(|o| o.namespace.as_deref()),
        owner(|o| o.pod.as_deref()),
        owner(|o| o.container.as_deref()),
        owner(|o| o.job_id.as_deref()),
        owner(|o| o.user.as_deref()),
        owner(|o| o.account.as_deref()),
        owner(|o| o.partition.as_deref()),
        owner(|o| o.qos.as_deref()),
        owner(|o| o.pod_labels.as_deref()),
    ]);
    RecordBatch::try_new(GPU_SAMPLES.clone(), cols)
}

fn column(rows: &[GpuWindow], f: Field, get: impl Fn(&GpuWindow) -> Option<f64>) -> ArrayRef {
    match field_type(f) {
        DataType::Int64 => {
            let mut b = Int64Builder::with_capacity(rows.len());
            for r in rows {
                b.append_option(get(r).map(|v| v.round() as i64));
            }
            Arc::new(b.finish())
        }
        _ => {
            let mut b = Float64Builder::with_capacity(rows.len());
            for r in rows {
                b.append_option(get(r));
            }
            Arc::new(b.finish())
        }
    }
}

/// `gpu_processes` rows as one batch.
pub fn processes_to_batch(rows: &[ProcessRow]) -> Result<RecordBatch, ArrowError> {
    let mut pid = Int64Builder::with_capacity(rows.len());
    let mut fb = Int64Builder::with_capacity(rows.len());
    let mut sm = Float64Builder::with_capacity(rows.len());
    for r in rows {
        pid.append_value(i64::from(r.pid));
        fb.append_option(r.fb_used_bytes);
        sm.append_option(r.sm_util);
    }
    let cols: Vec<ArrayRef> = vec![
        timestamps(rows.iter().map(|r| r.time.0)),
        strings(rows.iter().map(|r| Some(r.host.as_str()))),
        strings(rows.iter().map(|r| Some(r.gpu_uuid.as_str()))),
        Arc::new(pid.finish()),
        strings(rows.iter().map(|r| r.process_name.as_deref())),
        strings(rows.iter().map(|r| r.user.as_deref())),
        Arc::new(fb.finish()),
        Arc::new(sm.finish()),
        strings(rows.iter().map(|r| r.container_id.as_deref())),
        strings(rows.iter().map(|r| r.pod.as_deref())),
        strings(rows.iter().map(|r| r.namespace.as_deref())),
        strings(rows.iter().map(|r| r.container.as_deref())),
        strings(rows.iter().map(|r| r.pod_uid.as_deref())),
        strings(rows.iter().map(|r| r.job_id.as_deref())),
        strings(rows.iter().map(|_| None)),
    ];
    RecordBatch::try_new(GPU_PROCESSES.clone(), cols)
}

/// Why a shipped body was refused.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("not a valid Arrow IPC stream: {0}")]
    Malformed(ArrowError),
    #[error("the batch does not match the {table} schema: {detail}")]
    Schema { table: &'static str, detail: String },
    #[error("the body holds {rows} rows; at most {max} are accepted per request")]
    TooManyRows { rows: usize, max: usize },
    #[error("cannot encode: {0}")]
    Encode(ArrowError),
}

/// An IPC stream of `batch`, buffers zstd-compressed.
pub fn encode_ipc(batch: &RecordBatch) -> Result<Vec<u8>, WireError> {
    let options =
        IpcWriteOptions::default().try_with_compression(Some(CompressionType::ZSTD)).map_err(WireError::Encode)?;
    let mut out = Vec::new();
    let mut w = StreamWriter::try_new_with_options(&mut out, batch.schema_ref(), options).map_err(WireError::Encode)?;
    w.write(batch).map_err(WireError::Encode)?;
    w.finish().map_err(WireError::Encode)?;
    drop(w);
    Ok(out)
}

/// Decodes an IPC stream for `table`, checking the schema (names, types, nullability)
/// and the row limit before anything is kept.
///
/// Arrow's IPC reader panics on some malformed streams instead of returning an error
/// (e.g. a validity buffer shorter than its array; found by fuzzing, `docs/fuzzing.md`).
/// A body is client input, so such a panic is a malformed body, not a crash: it is
/// caught here (the panic hook still reports it) and returned as [`WireError::Malformed`].
pub fn decode_ipc(body: &[u8], table: Table, max_rows: usize) -> Result<Vec<RecordBatch>, WireError> {
    std::panic::catch_unwind(|| decode_ipc_unguarded(body, table, max_rows)).unwrap_or_else(|_| {
        Err(WireError::Malformed(ArrowError::IpcError("malformed IPC stream (the Arrow decoder panicked)".into())))
    })
}

fn decode_ipc_unguarded(body: &[u8], table: Table, max_rows: usize) -> Result<Vec<RecordBatch>, WireError> {
    let reader = StreamReader::try_new(Cursor::new(body), None).map_err(WireError::Malformed)?;
    let expected = table.schema();
    check_schema(&reader.schema(), &expected, table)?;
    let mut batches = Vec::new();
    let mut rows = 0;
    for batch in reader {
        let batch = batch.map_err(WireError::Malformed)?;
        rows += batch.num_rows();
        if rows > max_rows {
            return Err(WireError::TooManyRows { rows, max: max_rows });
        }
        batches.push(batch);
    }
    Ok(batches)
}

fn check_schema(got: &Schema, expected: &Schema, table: Table) -> Result<(), WireError> {
    let err = |detail: String| WireError::Schema { table: table.name(), detail };
    if got.fields().len() != expected.fields().len() {
        return Err(err(format!("{} columns, expected {}", got.fields().len(), expected.fields().len())));
    }
    for (g, e) in got.fields().iter().zip(expected.fields()) {
        if g.name() != e.name() {
            return Err(err(format!("column {:?} where {:?} was expected", g.name(), e.name())));
        }
        if g.data_type() != e.data_type() {
            return Err(err(format!("column {:?} is {}, expected {}", g.name(), g.data_type(), e.data_type())));
        }
        if g.is_nullable() && !e.is_nullable() {
            return Err(err(format!("column {:?} must not be nullable", g.name())));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use arrow_array::cast::AsArray;
    use arrow_array::types::{Float64Type, Int64Type};

    use super::*;
    use crate::{FieldStats, GpuIdentity, GpuUuid, HostName, UnixMicros};

    fn window() -> GpuWindow {
        let gpu = GpuIdentity::gpu(
            HostName::new("n1").expect("valid"),
            GpuUuid::new("GPU-1").expect("valid"),
            3,
            "NVIDIA H100 80GB HBM3",
        );
        let mut w = GpuWindow::new(UnixMicros(1_000_000), Duration::from_secs(1), gpu);
        w.fields[Field::GpuUtil.index()] = Some(FieldStats { count: 6, mean: 0.5, min: 0.0, max: 1.0, last: 1.0 });
        w.fields[Field::FbUsedBytes.index()] =
            Some(FieldStats { count: 1, mean: 1048576.0, min: 1048576.0, max: 1048576.0, last: 1048576.0 });
        w
    }

    #[test]
    fn windows_round_trip_through_ipc() {
        let batch = windows_to_batch(&[window(), window()]).expect("batch");
        let bytes = encode_ipc(&batch).expect("encode");
        let back = decode_ipc(&bytes, Table::GpuSamples, 10).expect("decode");
        assert_eq!(back, vec![batch.clone()]);
        let util = batch.column_by_name("gpu_util").expect("col").as_primitive::<Float64Type>();
        assert_eq!(util.value(0), 0.5);
        let max = batch.column_by_name("gpu_util_max").expect("col").as_primitive::<Float64Type>();
        assert_eq!(max.value(0), 1.0);
        let fb = batch.column_by_name("fb_used_bytes").expect("col").as_primitive::<Int64Type>();
        assert_eq!(fb.value(0), 1048576);
        assert!(batch.column_by_name("power_watts").expect("col").is_null(0), "no reading is NULL");
    }

    #[test]
    fn owner_columns_come_last_and_are_null_when_nobody_holds_the_gpu() {
        let schema = Table::GpuSamples.schema();
        let names: Vec<_> = schema.fields().iter().map(|f| f.name().as_str()).collect();
        assert_eq!(names[names.len() - OWNER_COLUMNS.len()..], OWNER_COLUMNS);
        assert!(schema.fields().iter().rev().take(OWNER_COLUMNS.len()).all(|f| f.is_nullable()));

        let mut pod = window();
        let mut holder = GpuHolder::pod(Some("ml".into()), Some("train-0".into()), Some("main".into()));
        holder.pod_labels = Some(r#"{"team":"vision"}"#.into());
        pod.owner = Some(holder);
        let mut job = window();
        job.owner = Some(GpuHolder {
            user: Some("carol".into()),
            account: Some("phys".into()),
            partition: Some("gpu".into()),
            qos: Some("normal".into()),
            ..GpuHolder::slurm_job("4711")
        });
        let batch = windows_to_batch(&[pod, job, window()]).expect("batch");
        let col = |name: &str| -> Vec<Option<String>> {
            let a = batch.column_by_name(name).expect("col").as_string::<i32>();
            a.iter().map(|v| v.map(str::to_owned)).collect()
        };
        let s = |v: &str| Some(v.to_owned());
        assert_eq!(col("owner_kind"), vec![s("pod"), s("slurm_job"), None]);
        assert_eq!(col("owner"), vec![s("ml/train-0"), s("4711"), None]);
        assert_eq!(col("namespace"), vec![s("ml"), None, None]);
        assert_eq!(col("pod"), vec![s("train-0"), None, None]);
        assert_eq!(col("container"), vec![s("main"), None, None]);
        assert_eq!(col("job_id"), vec![None, s("4711"), None]);
        assert_eq!(col("owner_user"), vec![None, s("carol"), None]);
        assert_eq!(col("account"), vec![None, s("phys"), None]);
        assert_eq!(col("partition"), vec![None, s("gpu"), None]);
        assert_eq!(col("qos"), vec![None, s("normal"), None]);
        assert_eq!(col("pod_labels"), vec![s(r#"{"team":"vision"}"#), None, None]);
        let back = decode_ipc(&encode_ipc(&batch).expect("encode"), Table::GpuSamples, 10).expect("decode");
        assert_eq!(back, vec![batch]);
    }

    #[test]
    fn shared_gpu_owners() {
        assert_eq!(GpuHolder::pod(Some("inf".into()), None, None).owner, "inf/*");
        assert_eq!(GpuHolder::pod(None, None, None).owner, "*");
    }

    #[test]
    fn refuses_garbage_wrong_schema_and_too_many_rows() {
        assert!(matches!(decode_ipc(b"not arrow", Table::GpuSamples, 10), Err(WireError::Malformed(_))));
        let procs = encode_ipc(&processes_to_batch(&[]).expect("batch")).expect("encode");
        assert!(matches!(decode_ipc(&procs, Table::GpuSamples, 10), Err(WireError::Schema { .. })));
        let bytes = encode_ipc(&windows_to_batch(&[window(), window()]).expect("batch")).expect("encode");
        assert!(matches!(decode_ipc(&bytes, Table::GpuSamples, 1), Err(WireError::TooManyRows { rows: 2, max: 1 })));
    }

    #[test]
    fn a_panic_of_the_arrow_reader_is_a_malformed_body() {
        // Found by fuzzing (docs/fuzzing.md): a validity buffer shorter than its array
        // makes arrow-buffer assert while the batch is read.
        let body = include_bytes!("../../fuzz/regressions/ingest_decode/arrow-short-validity-buffer.arrows");
        for table in [Table::GpuSamples, Table::GpuProcesses] {
            assert!(matches!(
                decode_ipc(body, table, 100_000),
                Err(WireError::Malformed(_)) | Err(WireError::Schema { .. })
            ));
        }
    }

    #[test]
    fn no_unsigned_types_and_utc_timestamps() {
        for t in [Table::GpuSamples, Table::GpuProcesses] {
            for f in t.schema().fields() {
                assert!(!f.data_type().is_unsigned_integer(), "{}", f.name());
            }
            assert_eq!(t.schema().field(0).data_type(), &time_type());
        }
    }
}
