//! The storage schema: what the memtable holds and the Parquet files contain.
//!
//! Agents ship measurements as Float64 in base units (see `apron_common::wire`). The
//! collector stores each one exactly at the resolution the device reports
//! ([`Field::resolution`]), as an integer-backed type:
//!
//! | unit | resolution | stored as | Parquet physical |
//! | --- | --- | --- | --- |
//! | ratio (`gpu_util`, `sm_active`, …, `_max`, `sm_util`) | 1e-4 | Decimal128(5, 4) | INT32 |
//! | watts (`power_watts`) | 1e-3 (mW) | Decimal128(9, 3) | INT32 |
//! | joules (`energy_joules`, cumulative) | 1e-3 (mJ) | Decimal128(18, 3) | INT64 |
//! | celsius, MHz | 1 | Int32 | INT32 |
//! | bytes/s | 1 | Int64 | INT64 |
//! | bytes, counts, codes, bitmasks, flags | 1 | Int64 (as shipped) | INT64 |
//!
//! Why: a noisy Float64 costs 8 bytes before compression and its mantissa bits barely
//! compress, while the same value as a small integer delta-encodes into a few bits. The
//! reference measurement (`tsdb-storage.md`, pyarrow, 83 M values) was 1.44 bytes/value
//! for float64 + zstd against 0.87 for integer-scaled + delta + zstd. Parquet's arrow
//! writer (59) stores Decimal128 with precision 2–9 as INT32 and 10–18 as INT64, so
//! DELTA_BINARY_PACKED applies; every reader (DuckDB, pyarrow, Spark, DataFusion) shows
//! the decimal with its meaning. Window means finer than the resolution are rounded half
//! away from zero (at the default 1 s window most gauges have one reading per window).
//!
//! In memory the columns are narrower still ([`memory_schema`]): the memtable stores a
//! decimal column as its unscaled Int32 (precision ≤ 9) or Int64 — 4 or 8 bytes a value
//! instead of Decimal128's 16, what a ratio costs on disk before compression — and a
//! string column as a dictionary (Int32 keys), since identity and owner strings repeat
//! on every row of a GPU (Parquet dictionary-encodes them too). [`widen`] restores the
//! storage schema on the way out (a query's projected columns, a persist's gathered
//! chunk): the same integer reinterpreted, the same strings looked up, never a
//! rounding, so a query sees one schema and the same values whether rows are still in
//! memory or already in Parquet.

use std::sync::{Arc, LazyLock};

use apron_common::Field;
use apron_common::wire::Table;
use arrow_array::cast::AsArray;
use arrow_array::types::{Decimal128Type, Float64Type, Int32Type, Int64Type};
use arrow_array::{
    Array, ArrayRef, ArrowPrimitiveType, DictionaryArray, Float64Array, PrimitiveArray, RecordBatch, RecordBatchOptions,
};
use arrow_schema::{ArrowError, DataType, Field as ArrowField, Schema, SchemaRef};

/// How one wire column becomes a storage column.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Conversion {
    /// Stored as shipped.
    Keep,
    /// Float64 → Decimal128(precision, scale), rounded to the scale.
    Decimal { precision: u8, scale: i8 },
    /// Float64 → Int32, rounded.
    Int32,
    /// Float64 → Int64, rounded.
    Int64,
}

impl Conversion {
    pub fn data_type(self, wire: &DataType) -> DataType {
        match self {
            Conversion::Keep => wire.clone(),
            Conversion::Decimal { precision, scale } => DataType::Decimal128(precision, scale),
            Conversion::Int32 => DataType::Int32,
            Conversion::Int64 => DataType::Int64,
        }
    }

    /// The type the memtable holds: a decimal's unscaled integer, a string as a
    /// dictionary, otherwise the storage type.
    pub fn memory_type(self, wire: &DataType) -> DataType {
        match self {
            Conversion::Decimal { precision, .. } if precision <= 9 => DataType::Int32,
            Conversion::Decimal { .. } => DataType::Int64,
            Conversion::Keep if wire == &DataType::Utf8 => dictionary_type(),
            other => other.data_type(wire),
        }
    }
}

/// A memtable string column: identity (`host`, `gpu_uuid`, `gpu_model`, owners, …)
/// repeats across rows, so each batch keeps every distinct value once plus a 4-byte
/// key per row, instead of every row's bytes and offset.
fn dictionary_type() -> DataType {
    DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8))
}

/// The storage form of a Float64 measurement field (and its `_max` column).
pub fn field_conversion(f: Field) -> Conversion {
    match f.unit() {
        "ratio" => Conversion::Decimal { precision: 5, scale: 4 },
        "watts" => Conversion::Decimal { precision: 9, scale: 3 },
        "joules" => Conversion::Decimal { precision: 18, scale: 3 },
        "celsius" | "MHz" => Conversion::Int32,
        "bytes/s" => Conversion::Int64,
        // Units shipped as Int64 already (bytes, count, code, bitmask, bool).
        _ => Conversion::Keep,
    }
}

/// The field whose readings a stored measurement column of `table` holds at device
/// resolution: `gpu_samples`' `<field>` and `<field>_max`, `gpu_samples_1m`'s `_min`
/// and `_max` extremes. `None` for identity columns and for means of the rollup, which
/// are finer than any reading.
pub fn reading_field(table: Table, column: &str) -> Option<Field> {
    let base = match table {
        Table::GpuSamples => column.strip_suffix("_max").unwrap_or(column),
        Table::GpuSamples1m => {
            let base = column.strip_suffix("_min").or_else(|| column.strip_suffix("_max"))?;
            base.strip_suffix("_max").unwrap_or(base)
        }
        Table::GpuProcesses | Table::Allocations | Table::GpuCostHourly => return None,
    };
    Field::from_column(base)
}

/// The conversion of one wire column of `table`.
pub fn conversion(table: Table, column: &str, wire: &DataType) -> Conversion {
    if wire != &DataType::Float64 {
        return Conversion::Keep;
    }
    match table {
        // Rollup extremes at device resolution like the raw columns; means stay Float64.
        Table::GpuSamples | Table::GpuSamples1m => {
            reading_field(table, column).map_or(Conversion::Keep, field_conversion)
        }
        // NVML reports per-process SM utilisation in whole percent; 1e-4 keeps it exact.
        Table::GpuProcesses if column == "sm_util" => Conversion::Decimal { precision: 5, scale: 4 },
        Table::GpuProcesses | Table::Allocations | Table::GpuCostHourly => Conversion::Keep,
    }
}

struct TableSchema {
    schema: SchemaRef,
    memory: SchemaRef,
    conversions: Vec<Conversion>,
}

fn build(table: Table) -> TableSchema {
    let wire = table.schema();
    let mut fields = Vec::with_capacity(wire.fields().len());
    let mut memory = Vec::with_capacity(wire.fields().len());
    let mut conversions = Vec::with_capacity(wire.fields().len());
    for f in wire.fields() {
        let c = conversion(table, f.name(), f.data_type());
        fields.push(ArrowField::new(f.name(), c.data_type(f.data_type()), f.is_nullable()));
        memory.push(ArrowField::new(f.name(), c.memory_type(f.data_type()), f.is_nullable()));
        conversions.push(c);
    }
    TableSchema { schema: Arc::new(Schema::new(fields)), memory: Arc::new(Schema::new(memory)), conversions }
}

static GPU_SAMPLES: LazyLock<TableSchema> = LazyLock::new(|| build(Table::GpuSamples));
static GPU_PROCESSES: LazyLock<TableSchema> = LazyLock::new(|| build(Table::GpuProcesses));
static GPU_SAMPLES_1M: LazyLock<TableSchema> = LazyLock::new(|| build(Table::GpuSamples1m));
static ALLOCATIONS: LazyLock<TableSchema> = LazyLock::new(|| build(Table::Allocations));
static GPU_COST_HOURLY: LazyLock<TableSchema> = LazyLock::new(|| build(Table::GpuCostHourly));

fn table_schema(table: Table) -> &'static TableSchema {
    match table {
        Table::GpuSamples => &GPU_SAMPLES,
        Table::GpuProcesses => &GPU_PROCESSES,
        Table::GpuSamples1m => &GPU_SAMPLES_1M,
        Table::Allocations => &ALLOCATIONS,
        Table::GpuCostHourly => &GPU_COST_HOURLY,
    }
}

/// The storage schema of `table`: what Parquet files hold and queries see.
pub fn storage_schema(table: Table) -> SchemaRef {
    table_schema(table).schema.clone()
}

/// The memtable's schema of `table`: the storage schema with each decimal column as
/// its unscaled integer.
pub fn memory_schema(table: Table) -> SchemaRef {
    table_schema(table).memory.clone()
}

/// Why a batch cannot be stored exactly.
#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    #[error(
        "column {column:?}, row {row}: value {value} is not representable as {target} (not finite or out of range)"
    )]
    OutOfRange { column: String, row: usize, value: f64, target: DataType },
    #[error("column {column:?} is {found}, expected Float64")]
    WrongType { column: String, found: DataType },
    #[error("cannot build the storage batch: {0}")]
    Arrow(#[from] ArrowError),
}

/// Converts a wire batch (already schema-checked by `decode_ipc`) to the memory schema.
pub fn to_memory(table: Table, batch: &RecordBatch) -> Result<RecordBatch, ConvertError> {
    let ts = table_schema(table);
    let mut columns = Vec::with_capacity(batch.num_columns());
    for ((column, &conv), field) in batch.columns().iter().zip(&ts.conversions).zip(ts.memory.fields()) {
        let held = convert_column(column, conv, field.name())?;
        columns.push(match field.data_type() {
            DataType::Dictionary(..) => encode_dictionary(&held, field.name())?,
            _ => held,
        });
    }
    Ok(RecordBatch::try_new(ts.memory.clone(), columns)?)
}

/// Converts a wire batch (already schema-checked by `decode_ipc`) to the storage schema.
pub fn to_storage(table: Table, batch: &RecordBatch) -> Result<RecordBatch, ConvertError> {
    let ts = table_schema(table);
    let mut columns = Vec::with_capacity(batch.num_columns());
    for ((column, &conv), field) in batch.columns().iter().zip(&ts.conversions).zip(ts.schema.fields()) {
        columns.push(widen_column(&convert_column(column, conv, field.name())?, field.data_type(), field.name())?);
    }
    Ok(RecordBatch::try_new(ts.schema.clone(), columns)?)
}

fn encode_dictionary(column: &ArrayRef, name: &str) -> Result<ArrayRef, ArrowError> {
    let strings = column
        .as_string_opt::<i32>()
        .ok_or_else(|| ArrowError::SchemaError(format!("column {name:?}: {} is not Utf8", column.data_type())))?;
    // At most `max_rows_per_batch` distinct values, far below the Int32 keys' range.
    Ok(Arc::new(strings.iter().collect::<DictionaryArray<Int32Type>>()))
}

/// `batch` (memory or storage schema, or a projection of either) in the types of
/// `target`, whose fields it has in the same order: an Int32/Int64 column becomes the
/// target's Decimal128 with the same unscaled values; a column already of the target
/// type is shared, not copied.
pub fn widen(batch: &RecordBatch, target: &SchemaRef) -> Result<RecordBatch, ArrowError> {
    let columns = batch
        .columns()
        .iter()
        .zip(target.fields())
        .map(|(column, field)| widen_column(column, field.data_type(), field.name()))
        .collect::<Result<Vec<_>, _>>()?;
    // The row count keeps a projection to no columns (`count(*)`) its rows.
    let options = RecordBatchOptions::new().with_row_count(Some(batch.num_rows()));
    RecordBatch::try_new_with_options(target.clone(), columns, &options)
}

fn widen_column(column: &ArrayRef, target: &DataType, name: &str) -> Result<ArrayRef, ArrowError> {
    if column.data_type() == target {
        return Ok(column.clone());
    }
    if target == &DataType::Utf8
        && let Some(dict) = column.as_dictionary_opt::<Int32Type>()
    {
        return arrow_select::take::take(dict.values(), dict.keys(), None);
    }
    if let DataType::Decimal128(precision, scale) = *target {
        let widened = if let Some(v) = column.as_primitive_opt::<Int32Type>() {
            Some(v.unary::<_, Decimal128Type>(i128::from))
        } else {
            column.as_primitive_opt::<Int64Type>().map(|v| v.unary::<_, Decimal128Type>(i128::from))
        };
        if let Some(w) = widened {
            return Ok(Arc::new(w.with_precision_and_scale(precision, scale)?));
        }
    }
    Err(ArrowError::SchemaError(format!("column {name:?}: cannot widen {} to {target}", column.data_type())))
}

fn convert_column(column: &ArrayRef, conv: Conversion, name: &str) -> Result<ArrayRef, ConvertError> {
    if conv == Conversion::Keep {
        return Ok(column.clone());
    }
    let values: &Float64Array = column
        .as_primitive_opt::<Float64Type>()
        .ok_or_else(|| ConvertError::WrongType { column: name.to_owned(), found: column.data_type().clone() })?;
    let target = conv.data_type(&DataType::Float64);
    let out_of_range = |row: usize, value: f64| ConvertError::OutOfRange {
        column: name.to_owned(),
        row,
        value,
        target: target.clone(),
    };
    Ok(match conv {
        Conversion::Keep => column.clone(),
        // Decimals are held as their unscaled integers (see `memory_schema`); the
        // precision bound keeps each within its Parquet physical type.
        Conversion::Decimal { precision, scale } => {
            let factor = 10f64.powi(i32::from(scale));
            let max = 10f64.powi(i32::from(precision)) - 1.0;
            if precision <= 9 {
                to_integers::<Int32Type>(values, factor, max, out_of_range, |v| v as i32)?
            } else {
                to_integers::<Int64Type>(values, factor, max, out_of_range, |v| v as i64)?
            }
        }
        Conversion::Int32 => to_integers::<Int32Type>(values, 1.0, f64::from(i32::MAX), out_of_range, |v| v as i32)?,
        // The largest f64 below 2^63, so the cast cannot saturate.
        Conversion::Int64 => {
            to_integers::<Int64Type>(values, 1.0, 9.223_372_036_854_775e18, out_of_range, |v| v as i64)?
        }
    })
}

/// `values × factor`, rounded, as `T` (`cast` is exact: the value is within ±`max`).
fn to_integers<T: ArrowPrimitiveType>(
    values: &Float64Array,
    factor: f64,
    max: f64,
    out_of_range: impl Fn(usize, f64) -> ConvertError,
    cast: impl Fn(f64) -> T::Native,
) -> Result<ArrayRef, ConvertError> {
    let mut out = Vec::with_capacity(values.len());
    for (row, v) in values.iter().enumerate() {
        out.push(match v {
            None => None,
            Some(v) => Some(cast(scaled(v, factor, max).ok_or_else(|| out_of_range(row, v))?)),
        });
    }
    Ok(Arc::new(out.into_iter().collect::<PrimitiveArray<T>>()))
}

/// `v × factor` rounded half away from zero, if finite and within ±max.
fn scaled(v: f64, factor: f64, max: f64) -> Option<f64> {
    let s = (v * factor).round();
    (s.is_finite() && s.abs() <= max).then_some(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use apron_common::wire::field_type;
    use arrow_array::cast::AsArray;

    #[test]
    fn memory_schema_holds_decimals_unscaled_and_widen_restores_them() {
        let mem = memory_schema(Table::GpuSamples);
        let storage = storage_schema(Table::GpuSamples);
        let ty = |s: &SchemaRef, n: &str| s.field_with_name(n).expect("column").data_type().clone();
        assert_eq!(ty(&mem, "gpu_util"), DataType::Int32);
        assert_eq!(ty(&mem, "power_watts"), DataType::Int32);
        assert_eq!(ty(&mem, "energy_joules"), DataType::Int64);
        assert_eq!(ty(&mem, "gpu_temp_c"), DataType::Int32);
        assert_eq!(ty(&mem, "gpu_uuid"), dictionary_type());
        assert_eq!(ty(&mem, "namespace"), dictionary_type());
        assert_eq!(ty(&storage, "gpu_uuid"), DataType::Utf8);
        for (m, s) in mem.fields().iter().zip(storage.fields()) {
            assert_eq!((m.name(), m.is_nullable()), (s.name(), s.is_nullable()));
        }

        let wire = crate::testdata::samples(2, 0, 1);
        let gpu_util = wire.schema().index_of("gpu_util").expect("gpu_util");
        let enc_util = wire.schema().index_of("enc_util").expect("enc_util");
        let held = to_memory(Table::GpuSamples, &wire).expect("memory");
        assert_eq!(held.schema(), mem);
        let stored = widen(&held, &storage).expect("widen");
        assert_eq!(stored.schema(), storage);
        let d = stored.column(gpu_util).as_primitive::<Decimal128Type>();
        assert_eq!((d.value(1), d.value_as_string(1).as_str()), (700, "0.0700"));
        assert!(stored.column(enc_util).is_null(0), "nulls survive");
        let uuid = wire.schema().index_of("gpu_uuid").expect("gpu_uuid");
        assert_eq!(stored.column(uuid), wire.column(uuid), "strings looked up again");
        assert_eq!(stored, to_storage(Table::GpuSamples, &wire).expect("storage"));
        // Already wide, or a projection: shared as is.
        let again = widen(&stored, &storage).expect("idempotent");
        assert!(Arc::ptr_eq(again.column(gpu_util), stored.column(gpu_util)));
        let projected =
            widen(&held.project(&[gpu_util]).expect("project"), &Arc::new(storage.project(&[gpu_util]).expect("p")))
                .expect("projection");
        assert_eq!(projected.column(0).data_type(), &DataType::Decimal128(5, 4));
        // Anything else is refused, not cast.
        let bad =
            widen_column(&(Arc::new(Float64Array::from(vec![0.5])) as ArrayRef), &DataType::Decimal128(5, 4), "x");
        assert!(bad.is_err());
    }

    #[test]
    fn every_float_field_is_stored_at_its_resolution() {
        for &f in Field::ALL {
            if field_type(f) != DataType::Float64 {
                assert_eq!(field_conversion(f), Conversion::Keep, "{f:?} is shipped as an integer already");
                continue;
            }
            let digits = (-f.resolution().log10()).round() as i8;
            match field_conversion(f) {
                Conversion::Decimal { precision, scale } => {
                    assert_eq!(scale, digits, "{f:?}");
                    assert!(precision <= 18, "{f:?} must stay on INT32/INT64");
                }
                Conversion::Int32 | Conversion::Int64 => assert_eq!(digits, 0, "{f:?}"),
                Conversion::Keep => panic!("{f:?} would be stored as Float64"),
            }
        }
    }

    #[test]
    fn storage_schema_has_no_floats_but_window_s_and_no_unsigned() {
        for t in [Table::GpuSamples, Table::GpuProcesses] {
            let s = storage_schema(t);
            assert_eq!(s.fields().len(), t.schema().fields().len());
            for f in s.fields() {
                assert!(!f.data_type().is_unsigned_integer(), "{}", f.name());
                if f.data_type() == &DataType::Float64 {
                    assert_eq!(f.name(), "window_s");
                }
            }
        }
        let s = storage_schema(Table::GpuSamples);
        let ty = |n: &str| s.field_with_name(n).expect("column").data_type().clone();
        assert_eq!(ty("gpu_util"), DataType::Decimal128(5, 4));
        assert_eq!(ty("sm_active_max"), DataType::Decimal128(5, 4));
        assert_eq!(ty("power_watts"), DataType::Decimal128(9, 3));
        assert_eq!(ty("energy_joules"), DataType::Decimal128(18, 3));
        assert_eq!(ty("gpu_temp_c"), DataType::Int32);
        assert_eq!(ty("pcie_tx_bytes_per_s"), DataType::Int64);
        assert_eq!(ty("fb_used_bytes"), DataType::Int64);
    }

    #[test]
    fn converts_exactly_and_refuses_out_of_range() {
        let ratio = Arc::new(Float64Array::from(vec![Some(0.51666), None, Some(1.0), Some(0.0001)])) as ArrayRef;
        let out = convert_column(&ratio, Conversion::Decimal { precision: 5, scale: 4 }, "gpu_util").expect("convert");
        assert_eq!(out.data_type(), &DataType::Int32, "held unscaled in memory");
        let out = widen_column(&out, &DataType::Decimal128(5, 4), "gpu_util").expect("widen");
        let d = out.as_primitive::<Decimal128Type>();
        assert_eq!(d.value(0), 5167);
        assert!(d.is_null(1));
        assert_eq!(d.value(2), 10000);
        assert_eq!(d.value(3), 1);
        assert_eq!(d.value_as_string(2), "1.0000");

        let watts = Arc::new(Float64Array::from(vec![312.4567, -0.0004])) as ArrayRef;
        let out = convert_column(&watts, Conversion::Decimal { precision: 9, scale: 3 }, "power_watts").expect("ok");
        assert_eq!(out.as_primitive::<Int32Type>().value(0), 312_457);
        let joules = Arc::new(Float64Array::from(vec![1.5e12])) as ArrayRef;
        let out =
            convert_column(&joules, Conversion::Decimal { precision: 18, scale: 3 }, "energy_joules").expect("ok");
        assert_eq!(out.as_primitive::<Int64Type>().value(0), 1_500_000_000_000_000);

        let temp = Arc::new(Float64Array::from(vec![45.5, -3.2])) as ArrayRef;
        let out = convert_column(&temp, Conversion::Int32, "gpu_temp_c").expect("ok");
        assert_eq!(out.as_primitive::<Int32Type>().values().to_vec(), vec![46, -3]);

        for bad in [12.0, f64::NAN, f64::INFINITY] {
            let col = Arc::new(Float64Array::from(vec![0.5, bad])) as ArrayRef;
            let err = convert_column(&col, Conversion::Decimal { precision: 5, scale: 4 }, "gpu_util");
            assert!(matches!(err, Err(ConvertError::OutOfRange { row: 1, .. })), "{bad}: {err:?}");
        }
    }
}
