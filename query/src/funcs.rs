//! Every function that builds a variable-size value, bounded before it allocates.
//!
//! DataFusion's scalar functions allocate their whole result array at once, and its
//! aggregates grow their state between the memory pool's checks; neither allocation is
//! counted by the query's memory pool while it happens. One call could therefore ask
//! for gigabytes in a single allocation (`array_repeat(1, 1e9)`: 8 GB;
//! `range(0, 1e10)`; `make_array` of 80 strings of 60 MB; `string_agg` whose string
//! doubled past the pool in one `update_batch`), and an allocation that fails aborts the
//! whole process: every team loses the server, ingest included.
//!
//! So the registry itself is walked ([`bound_functions`]): every scalar function is
//! looked up in [`class`] by its name, and every aggregate in [`aggregate_class`]. A
//! function whose result has a fixed size, or cannot outgrow its arguments by more than
//! a small constant factor that the next step checks, is left as it is; every other is
//! replaced by a wrapper ([`Capped`]) that
//!
//! 1. computes an upper bound of its result from its arguments *before* running it
//!    ([`Bound`]) and refuses past `[query] max_string_result_bytes` (per result array,
//!    i.e. per batch), and
//! 2. measures what it built and refuses a result over the same limit, so a chain of
//!    steps (`encode(encode(…))`, `s || s` over CTE levels) is bounded step by step.
//!
//! `string_agg` and `array_agg` hold one growing value per group: their accumulators
//! refuse, before each batch, to grow a value past the same limit ([`CappedAggregate`]).
//!
//! A function the tables do not name is wrapped with the post-check (the safe default),
//! and a unit test fails until it is classified: a DataFusion upgrade that adds a
//! function is looked at, not trusted.

use std::any::Any;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use datafusion::arrow::array::{Array, ArrayRef, AsArray};
use datafusion::arrow::datatypes::{DataType, FieldRef};
use datafusion::common::config::{ConfigEntry, ConfigExtension, ConfigOptions, ExtensionOptions};
use datafusion::common::{Result as DfResult, ScalarValue};
use datafusion::execution::FunctionRegistry;
use datafusion::execution::context::SessionState;
use datafusion::logical_expr::function::{AccumulatorArgs, StateFieldsArgs};
use datafusion::logical_expr::utils::AggregateOrderSensitivity;
use datafusion::logical_expr::{
    Accumulator, AggregateUDF, AggregateUDFImpl, ColumnarValue, Documentation, Expr, ReturnFieldArgs, ReversedUDAF,
    ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl, Signature,
};

/// How a function's result size is bounded by its arguments (bytes of the whole result
/// array; `rows` is the batch's row count, for scalar arguments).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Bound {
    /// `repeat(s, n)`: Σ len(s)·n.
    Repeat,
    /// `lpad/rpad(s, n [, fill])`: Σ 4·n (n characters of up to 4 bytes) + len(s).
    Pad,
    /// `replace(s, from, to)`, `regexp_replace(s, re, to [, flags])`,
    /// `array_replace*(list, from, to [, n])`: Σ (len(s)+1)·max(1, len(to)).
    Replace { to: usize },
    /// `concat`, `make_array`, `map`, `struct`, …: Σ of every argument's bytes, times
    /// `factor` (`encode` to hex doubles, `to_char` spells a format out), plus a
    /// separator per argument (`concat_ws`).
    Sum { factor: u8 },
    /// `array_repeat(v, n)`: Σ (len(v) + 8)·n.
    ListRepeat,
    /// `range`/`generate_series(start, stop [, step])` as a list: 8 bytes per element.
    Range,
    /// `array_resize(list, n [, v])`: Σ n·(len(v) + 8) + the list.
    Resize,
    /// `array_to_string(list, sep [, null])`: 24 bytes (a rendered number) plus the
    /// separator and null text per element.
    ListToString,
    /// No bound before: the function cannot outgrow its arguments by more than a small
    /// factor. Only what it built is checked.
    After,
}

/// What is done about a scalar function.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Class {
    /// A result of fixed size (numbers, times, hashes, booleans), or one that is planned
    /// away before it runs (`arrow_cast`, `get_field`, `coalesce`: their `simplify`
    /// must stay theirs); not wrapped.
    Fixed,
    Bounded(Bound),
}

/// The class of every scalar function of DataFusion 55, pg_catalog and Apron, by its
/// name (aliases share their function). `None`: not classified (wrapped with
/// [`Bound::After`]; the registry test fails).
pub(crate) fn class(name: &str) -> Option<Class> {
    use Bound::*;
    use Class::*;
    Some(match name {
        "repeat" => Bounded(Repeat),
        "lpad" | "rpad" => Bounded(Pad),
        "replace" | "regexp_replace" => Bounded(Replace { to: 2 }),
        "array_replace" | "array_replace_all" | "array_replace_n" => Bounded(Replace { to: 2 }),
        "concat" | "concat_ws" | "overlay" | "make_array" | "array_concat" | "array_append" | "array_prepend"
        | "array_union" | "map" | "named_struct" | "struct" | "arrays_zip" | "translate" => {
            Bounded(Sum { factor: 1 })
        }
        "encode" | "json_build_object" => Bounded(Sum { factor: 2 }),
        "to_char" | "date_format" => Bounded(Sum { factor: 4 }),
        "array_repeat" => Bounded(ListRepeat),
        "range" | "generate_series" => Bounded(Range),
        "array_resize" => Bounded(Resize),
        "array_to_string" => Bounded(ListToString),
        // No larger than their arguments (or a small multiple: a list of the pieces of
        // a string): what they built is checked.
        "array_any_value" | "array_compact" | "array_distinct" | "array_element" | "array_except"
        | "array_intersect" | "array_max" | "array_min" | "array_pop_back" | "array_pop_front"
        | "array_positions" | "array_remove" | "array_remove_all" | "array_remove_n" | "array_reverse"
        | "array_slice" | "array_sort" | "array_add" | "array_subtract" | "array_scale" | "array_normalize"
        | "flatten" | "string_to_array" | "regexp_match" | "split_part" | "substr" | "substr_index" | "left"
        | "right" | "lower" | "upper" | "initcap" | "btrim" | "ltrim" | "rtrim" | "reverse" | "decode"
        | "map_extract" | "map_keys" | "map_values" | "map_entries" | "nullif" | "parse_ident" | "greatest"
        | "least" => {
            Bounded(After)
        }
        // Fixed-size results.
        "abs" | "acos" | "acosh" | "asin" | "asinh" | "atan" | "atan2" | "atanh" | "cbrt" | "ceil" | "cos"
        | "cosh" | "cot" | "degrees" | "exp" | "factorial" | "floor" | "gcd" | "isnan" | "iszero" | "lcm" | "ln"
        | "log" | "log10" | "log2" | "nanvl" | "pi" | "power" | "radians" | "random" | "round" | "signum"
        | "sin" | "sinh" | "sqrt" | "tan" | "tanh" | "trunc" => Fixed,
        "array_avg" | "array_distance" | "array_dims" | "array_empty" | "array_has" | "array_has_all"
        | "array_has_any" | "array_length" | "array_ndims" | "array_position" | "array_product"
        | "array_sum" | "arrays_overlap" | "cardinality" | "cosine_distance" | "inner_product" | "empty" => Fixed,
        "ascii" | "bit_length" | "character_length" | "chr" | "contains" | "ends_with" | "find_in_set"
        | "levenshtein" | "octet_length" | "regexp_count" | "regexp_instr" | "regexp_like" | "starts_with"
        | "strpos" | "uuid" | "md5" | "sha224" | "sha256" | "sha384" | "sha512" | "digest" | "to_hex" => Fixed,
        "current_date" | "current_time" | "date_bin" | "date_part" | "date_trunc" | "from_unixtime"
        | "make_date" | "make_time" | "now" | "to_date" | "to_local_time" | "to_time" | "to_timestamp"
        | "to_timestamp_micros" | "to_timestamp_millis" | "to_timestamp_nanos" | "to_timestamp_seconds"
        | "to_unixtime" => Fixed,
        // Planned away (their `simplify` rewrites them) or metadata only.
        "arrow_cast" | "arrow_try_cast" | "cast_to_type" | "try_cast_to_type" | "arrow_typeof" | "arrow_field"
        | "arrow_metadata" | "with_metadata" | "get_field" | "coalesce" | "nvl" | "nvl2" | "union_tag"
        // No SQL builds a union value.
        | "union_extract"
        | "version" | "file_row_index" | "input_file_name" => Fixed,
        // Apron's own: `||` (capped where it is planned, [`crate::guard`]), the sketches.
        crate::guard::CONCAT_OP => Fixed,
        n if crate::sketch::FUNCTIONS.contains(&n) => Fixed,
        // pg_catalog's functions answer short metadata strings about the catalog.
        n if n.starts_with("pg_") || n.starts_with("has_") || n.ends_with("_is_visible") => Fixed,
        "format_type" | "obj_description" | "col_description" | "shobj_description" | "current_schema"
        | "current_schemas" | "current_database" | "current_user" | "session_user" | "quote_ident"
        | "array_upper" | "array_lower" | "txid_current" | "inet_server_addr" | "inet_server_port"
        | "current_setting" | "to_regtype" | "apron_pg_type_name" => Fixed,
        _ => return None,
    })
}

/// Aggregates whose value grows with their input: one string or list per group.
pub(crate) fn aggregate_class(name: &str) -> Option<bool> {
    match name {
        "string_agg" | "array_agg" => Some(true),
        // A number, a sketch of bounded size, or one of the input's values.
        "any_value"
        | "approx_distinct"
        | "approx_median"
        | "approx_percentile_cont"
        | "approx_percentile_cont_with_weight"
        | "avg"
        | "bit_and"
        | "bit_or"
        | "bit_xor"
        | "bool_and"
        | "bool_or"
        | "corr"
        | "count"
        | "covar_pop"
        | "covar_samp"
        | "first_value"
        | "grouping"
        | "last_value"
        | "max"
        | "median"
        | "min"
        | "nth_value"
        | "percentile_cont"
        | "regr_avgx"
        | "regr_avgy"
        | "regr_count"
        | "regr_intercept"
        | "regr_r2"
        | "regr_slope"
        | "regr_sxx"
        | "regr_sxy"
        | "regr_syy"
        | "stddev"
        | "stddev_pop"
        | "sum"
        | "var"
        | "var_pop" => Some(false),
        n if crate::sketch::FUNCTIONS.contains(&n) => Some(false),
        _ => None,
    }
}

/// The bytes one query's functions may return as single values, i.e. values built from
/// constants alone. Constant folding makes them literals of the plan, and a plan's
/// literals are copied by every optimizer pass and spelled out in expression names: a
/// 60 MB literal cost 2 GB and 14 s of planning (release build), a chain of six
/// `encode`s over one aborted a server under a 4 GiB data limit; `make_array` of 80
/// folded `repeat`s held 80 of them at once. So such values are held, together, to
/// [`constant_budget`] — far below the per-result limit, which bounds values built
/// from the data, batch by batch. One per query, in its session's config
/// ([`Budget::install`]); clones share it.
#[derive(Debug, Clone)]
pub struct Budget {
    spent: Arc<AtomicU64>,
    limit: u64,
}

/// The bytes a query's values built from constants may hold together: 1/64 of
/// `max_string_result_bytes`, at least 1 MiB (1 MiB by default).
pub fn constant_budget(max_string_result_bytes: u64) -> u64 {
    (max_string_result_bytes / 64).max(1 << 20)
}

impl Budget {
    /// Puts a fresh budget of `limit` bytes into `config`.
    pub fn install(config: &mut ConfigOptions, limit: u64) {
        config.extensions.insert(Budget { spent: Arc::new(AtomicU64::new(0)), limit });
    }

    /// Counts `bytes` more, refusing past the limit.
    fn charge(&self, name: &str, bytes: u128) -> DfResult<()> {
        let bytes = u64::try_from(bytes).unwrap_or(u64::MAX);
        let spent = self.spent.fetch_add(bytes, Ordering::Relaxed).saturating_add(bytes);
        if spent > self.limit {
            return Err(datafusion::error::DataFusionError::Execution(format!(
                "{name}() would bring the query's values built from constants to {spent} bytes, over the limit \
                 of {} bytes (query.max_string_result_bytes / 64, at least 1 MiB)",
                self.limit
            )));
        }
        Ok(())
    }

    fn of(config: &ConfigOptions) -> Option<&Budget> {
        config.extensions.get::<Budget>()
    }
}

impl ConfigExtension for Budget {
    const PREFIX: &'static str = "apron_budget";
}

impl ExtensionOptions for Budget {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }

    fn cloned(&self) -> Box<dyn ExtensionOptions> {
        Box::new(self.clone())
    }

    fn set(&mut self, key: &str, _value: &str) -> DfResult<()> {
        datafusion::common::config_err!("{key} cannot be set")
    }

    fn entries(&self) -> Vec<ConfigEntry> {
        Vec::new()
    }
}

/// Replaces every variable-size function of `state` with its capped wrapper
/// (idempotent: a wrapper is not wrapped again).
pub fn bound_functions(state: &mut SessionState, max_bytes: usize) -> DfResult<()> {
    let scalars: Vec<Arc<ScalarUDF>> = state.scalar_functions().values().cloned().collect();
    let mut seen = std::collections::HashSet::new();
    for udf in scalars {
        let any: &dyn Any = udf.inner().as_ref();
        if !seen.insert(udf.name().to_owned()) || any.is::<Capped>() {
            continue;
        }
        let bound = match class(udf.name()) {
            Some(Class::Fixed) => continue,
            Some(Class::Bounded(b)) => b,
            None => Bound::After,
        };
        let capped = Capped { inner: udf.as_ref().clone(), bound, max_bytes };
        state.register_udf(Arc::new(ScalarUDF::new_from_impl(capped)))?;
    }
    let aggregates: Vec<Arc<AggregateUDF>> = state.aggregate_functions().values().cloned().collect();
    for udaf in aggregates {
        let any: &dyn Any = udaf.inner().as_ref();
        if any.is::<CappedAggregate>() || aggregate_class(udaf.name()) == Some(false) {
            continue;
        }
        state.register_udaf(Arc::new(capped_aggregate(udaf.as_ref().clone(), max_bytes)))?;
    }
    Ok(())
}

/// The canonical names of every scalar function and aggregate the query server's
/// sessions have: DataFusion's, pg_catalog's and Apron's.
fn registry() -> DfResult<(Vec<String>, Vec<String>)> {
    let ctx = datafusion::prelude::SessionContext::new();
    let mut state = ctx.state();
    crate::sketch::register(&mut state)?;
    let ctx = datafusion::prelude::SessionContext::new_with_state(state);
    crate::pgcompat::setup(&ctx, "datafusion")?;
    let state = ctx.state();
    let mut scalars: Vec<_> = state.scalar_functions().values().map(|f| f.name().to_owned()).collect();
    scalars.sort();
    scalars.dedup();
    let mut aggregates: Vec<_> = state.aggregate_functions().values().map(|f| f.name().to_owned()).collect();
    aggregates.sort();
    aggregates.dedup();
    Ok((scalars, aggregates))
}

/// Every function that builds a variable-size value (all that [`bound_functions`]
/// wraps), for tests that call each with arguments built to exhaust the server.
pub fn variable_size_functions() -> DfResult<Vec<String>> {
    let (scalars, aggregates) = registry()?;
    let scalars = scalars.into_iter().filter(|n| !matches!(class(n), Some(Class::Fixed)));
    let aggregates = aggregates.into_iter().filter(|n| aggregate_class(n) != Some(false));
    Ok(scalars.chain(aggregates).collect())
}

/// Bytes of one argument's values, row by row (a scalar counts for every row).
pub(crate) fn value_bytes(v: &ColumnarValue, rows: usize) -> Vec<usize> {
    match v {
        ColumnarValue::Scalar(s) => vec![scalar_bytes(s); rows],
        ColumnarValue::Array(a) => (0..a.len()).map(|i| array_value_bytes(a, i)).collect(),
    }
}

fn scalar_bytes(s: &ScalarValue) -> usize {
    match s {
        ScalarValue::Utf8(Some(v)) | ScalarValue::LargeUtf8(Some(v)) | ScalarValue::Utf8View(Some(v)) => v.len(),
        ScalarValue::Binary(Some(v)) | ScalarValue::LargeBinary(Some(v)) | ScalarValue::BinaryView(Some(v)) => v.len(),
        // Numbers render short; lists, maps and structs by their memory.
        s if s.data_type().is_nested() => s.size(),
        _ => 32,
    }
}

fn array_value_bytes(a: &ArrayRef, i: usize) -> usize {
    if a.is_null(i) {
        return 0;
    }
    match a.data_type() {
        DataType::Utf8 => a.as_string::<i32>().value(i).len(),
        DataType::LargeUtf8 => a.as_string::<i64>().value(i).len(),
        DataType::Utf8View => a.as_string_view().value(i).len(),
        DataType::Binary => a.as_binary::<i32>().value(i).len(),
        DataType::LargeBinary => a.as_binary::<i64>().value(i).len(),
        DataType::BinaryView => a.as_binary_view().value(i).len(),
        t if t.is_nested() => a.slice(i, 1).get_array_memory_size(),
        _ => 32,
    }
}

/// Bytes of all of one argument's values together, without a per-row pass where the
/// array's offsets say it (`||` and `concat` run on every batch of their input).
pub(crate) fn total_bytes(v: &ColumnarValue, rows: usize) -> u128 {
    match v {
        ColumnarValue::Scalar(s) => scalar_bytes(s) as u128 * rows as u128,
        ColumnarValue::Array(a) => array_bytes(a),
    }
}

/// The bytes an array's values hold: what its offsets span for strings and binaries
/// (a slice does not count its parent's buffers), the lengths of a view's values, and
/// the memory of anything else.
fn array_bytes(a: &ArrayRef) -> u128 {
    fn span<O: Copy + Into<i64>>(o: &[O]) -> u128 {
        o.last().zip(o.first()).map_or(0, |(l, f)| ((*l).into() - (*f).into()).max(0) as u128)
    }
    match a.data_type() {
        DataType::Utf8 => span(a.as_string::<i32>().value_offsets()),
        DataType::LargeUtf8 => span(a.as_string::<i64>().value_offsets()),
        DataType::Binary => span(a.as_binary::<i32>().value_offsets()),
        DataType::LargeBinary => span(a.as_binary::<i64>().value_offsets()),
        DataType::Utf8View => a.as_string_view().views().iter().map(|v| (*v as u32) as u128).sum(),
        DataType::BinaryView => a.as_binary_view().views().iter().map(|v| (*v as u32) as u128).sum(),
        t if t.is_primitive() => 32 * a.len() as u128,
        _ => a.get_array_memory_size() as u128,
    }
}

/// Integer argument values, row by row (NULL and non-integers as 0).
fn counts(v: &ColumnarValue, rows: usize) -> Vec<u64> {
    let as_u64 = |s: &ScalarValue| match s {
        ScalarValue::Int64(Some(n)) => u64::try_from(*n).unwrap_or(0),
        ScalarValue::Int32(Some(n)) => u64::try_from(*n).unwrap_or(0),
        ScalarValue::Int16(Some(n)) => u64::try_from(*n).unwrap_or(0),
        ScalarValue::Int8(Some(n)) => u64::try_from(*n).unwrap_or(0),
        ScalarValue::UInt64(Some(n)) => *n,
        ScalarValue::UInt32(Some(n)) => u64::from(*n),
        ScalarValue::UInt16(Some(n)) => u64::from(*n),
        ScalarValue::UInt8(Some(n)) => u64::from(*n),
        _ => 0,
    };
    scalars(v, rows).iter().map(as_u64).collect()
}

/// An argument's values as scalars, row by row.
fn scalars(v: &ColumnarValue, rows: usize) -> Vec<ScalarValue> {
    match v {
        ColumnarValue::Scalar(s) => vec![s.clone(); rows],
        ColumnarValue::Array(a) => {
            (0..a.len()).map(|i| ScalarValue::try_from_array(a, i).unwrap_or(ScalarValue::Null)).collect()
        }
    }
}

/// A number, date or time as one integer on a common scale (times in nanoseconds, an
/// interval's month counted as 28 days: never more elements than there are).
fn ordinal(s: &ScalarValue) -> Option<i128> {
    const DAY: i128 = 86_400_000_000_000;
    Some(match s {
        ScalarValue::Int64(Some(n)) => i128::from(*n),
        ScalarValue::Int32(Some(n)) => i128::from(*n),
        ScalarValue::Int16(Some(n)) => i128::from(*n),
        ScalarValue::Int8(Some(n)) => i128::from(*n),
        ScalarValue::UInt64(Some(n)) => i128::from(*n),
        ScalarValue::UInt32(Some(n)) => i128::from(*n),
        ScalarValue::Date32(Some(d)) => i128::from(*d) * DAY,
        ScalarValue::Date64(Some(ms)) => i128::from(*ms) * 1_000_000,
        ScalarValue::TimestampSecond(Some(t), _) => i128::from(*t) * 1_000_000_000,
        ScalarValue::TimestampMillisecond(Some(t), _) => i128::from(*t) * 1_000_000,
        ScalarValue::TimestampMicrosecond(Some(t), _) => i128::from(*t) * 1_000,
        ScalarValue::TimestampNanosecond(Some(t), _) => i128::from(*t),
        ScalarValue::IntervalMonthDayNano(Some(i)) => {
            i128::from(i.months) * 28 * DAY + i128::from(i.days) * DAY + i128::from(i.nanoseconds)
        }
        ScalarValue::IntervalDayTime(Some(i)) => i128::from(i.days) * DAY + i128::from(i.milliseconds) * 1_000_000,
        ScalarValue::IntervalYearMonth(Some(m)) => i128::from(*m) * 28 * DAY,
        _ => return None,
    })
}

/// Elements of a list argument, all rows together.
fn list_elements(v: &ColumnarValue, rows: usize) -> u128 {
    let of = |a: &dyn Array| -> u128 {
        match a.data_type() {
            DataType::List(_) => {
                let o = a.as_list::<i32>().value_offsets();
                o.last().zip(o.first()).map_or(0, |(l, f)| (l - f).max(0) as u128)
            }
            DataType::LargeList(_) => {
                let o = a.as_list::<i64>().value_offsets();
                o.last().zip(o.first()).map_or(0, |(l, f)| (l - f).max(0) as u128)
            }
            DataType::FixedSizeList(_, n) => a.len() as u128 * (*n).max(0) as u128,
            _ => a.len() as u128,
        }
    };
    match v {
        ColumnarValue::Array(a) => of(a.as_ref()),
        ColumnarValue::Scalar(s) => match s.to_array_of_size(1) {
            Ok(a) => of(a.as_ref()) * rows as u128,
            Err(_) => rows as u128,
        },
    }
}

impl Bound {
    /// An upper bound of the result's bytes; `None` where only the result is checked.
    pub(crate) fn estimate(self, args: &[ColumnarValue], rows: usize) -> Option<u128> {
        let arg = |i: usize| args.get(i);
        Some(match self {
            Bound::Repeat => {
                let (Some(s), Some(n)) = (arg(0), arg(1)) else { return Some(0) };
                value_bytes(s, rows).into_iter().zip(counts(n, rows)).map(|(b, n)| b as u128 * n as u128).sum()
            }
            Bound::Pad => {
                let (Some(s), Some(n)) = (arg(0), arg(1)) else { return Some(0) };
                total_bytes(s, rows) + counts(n, rows).into_iter().map(|n| 4 * n as u128).sum::<u128>()
            }
            Bound::Replace { to } => {
                let Some(s) = arg(0) else { return Some(0) };
                let to = arg(to).map(|t| value_bytes(t, rows)).unwrap_or_else(|| vec![0; rows]);
                let s_bytes = value_bytes(s, rows);
                // A list's elements each become `to` at most.
                let per_row = list_elements(s, rows) / rows.max(1) as u128;
                s_bytes.into_iter().zip(to).map(|(b, t)| (b as u128 + per_row + 1) * t.max(1) as u128).sum()
            }
            Bound::Sum { factor } => {
                let all: u128 = args.iter().map(|a| total_bytes(a, rows)).sum();
                // concat_ws repeats its separator between arguments.
                let sep = arg(0).map_or(0, |a| total_bytes(a, rows));
                (all + sep * args.len() as u128) * u128::from(factor)
            }
            Bound::ListRepeat => {
                let (Some(v), Some(n)) = (arg(0), arg(1)) else { return Some(0) };
                value_bytes(v, rows).into_iter().zip(counts(n, rows)).map(|(b, n)| (b as u128 + 8) * n as u128).sum()
            }
            Bound::Range => {
                let (start, stop, step) = match args {
                    [stop] => (None, scalars(stop, rows), None),
                    [start, stop] => (Some(scalars(start, rows)), scalars(stop, rows), None),
                    [start, stop, step, ..] => {
                        (Some(scalars(start, rows)), scalars(stop, rows), Some(scalars(step, rows)))
                    }
                    [] => return Some(0),
                };
                (0..stop.len())
                    .map(|i| {
                        let from = start.as_ref().and_then(|s| ordinal(&s[i])).unwrap_or(0);
                        let to = ordinal(&stop[i]).unwrap_or(from);
                        let by = step.as_ref().and_then(|s| ordinal(&s[i])).unwrap_or(1).unsigned_abs().max(1);
                        (to.abs_diff(from) / by + 1) * 8
                    })
                    .sum()
            }
            Bound::Resize => {
                let (Some(list), Some(n)) = (arg(0), arg(1)) else { return Some(0) };
                let fill = arg(2).map(|v| value_bytes(v, rows)).unwrap_or_else(|| vec![0; rows]);
                total_bytes(list, rows)
                    + counts(n, rows).into_iter().zip(fill).map(|(n, f)| n as u128 * (f as u128 + 8)).sum::<u128>()
            }
            Bound::ListToString => {
                let Some(list) = arg(0) else { return Some(0) };
                let sep = arg(1).map_or(0, |s| value_bytes(s, rows).into_iter().max().unwrap_or(0));
                let null = arg(2).map_or(0, |s| value_bytes(s, rows).into_iter().max().unwrap_or(0));
                total_bytes(list, rows) + list_elements(list, rows) * (24 + sep as u128 + null as u128)
            }
            Bound::After => return None,
        })
    }
}

fn too_large(name: &str, what: &str, bytes: u128, max_bytes: usize) -> datafusion::error::DataFusionError {
    datafusion::error::DataFusionError::Execution(format!(
        "{name}() would {what} {bytes} bytes, over the limit of {max_bytes} bytes per result \
         (query.max_string_result_bytes)"
    ))
}

/// Refuses a result that [`Bound::estimate`] says is too large.
pub(crate) fn check_estimate(
    name: &str,
    bound: Bound,
    args: &[ColumnarValue],
    rows: usize,
    max_bytes: usize,
) -> DfResult<()> {
    match bound.estimate(args, rows) {
        Some(b) if b > max_bytes as u128 => Err(too_large(name, "build a result of up to", b, max_bytes)),
        _ => Ok(()),
    }
}

/// Refuses a result that came out too large (it is dropped at once), and a single
/// value past the query's [`Budget`].
pub(crate) fn check_result(name: &str, out: &ColumnarValue, max_bytes: usize, config: &ConfigOptions) -> DfResult<()> {
    let bytes = match out {
        ColumnarValue::Scalar(s) => scalar_bytes(s) as u128,
        ColumnarValue::Array(a) if a.data_type().is_primitive() => return Ok(()),
        ColumnarValue::Array(a) => array_bytes(a),
    };
    if bytes > max_bytes as u128 {
        return Err(too_large(name, "build a result of", bytes, max_bytes));
    }
    if let (ColumnarValue::Scalar(_), Some(budget)) = (out, Budget::of(config)) {
        budget.charge(name, bytes)?;
    }
    Ok(())
}

/// A function run only when its result fits the cap.
#[derive(Debug, PartialEq, Eq, Hash)]
pub(crate) struct Capped {
    inner: ScalarUDF,
    bound: Bound,
    max_bytes: usize,
}

impl ScalarUDFImpl for Capped {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn aliases(&self) -> &[String] {
        self.inner.aliases()
    }

    fn display_name(&self, args: &[Expr]) -> DfResult<String> {
        #[allow(deprecated, reason = "the wrapped function's own name, whichever way it is spelled")]
        self.inner.inner().display_name(args)
    }

    fn schema_name(&self, args: &[Expr]) -> DfResult<String> {
        self.inner.inner().schema_name(args)
    }

    fn signature(&self) -> &Signature {
        self.inner.signature()
    }

    fn return_type(&self, arg_types: &[DataType]) -> DfResult<DataType> {
        self.inner.inner().return_type(arg_types)
    }

    fn return_field_from_args(&self, args: ReturnFieldArgs) -> DfResult<FieldRef> {
        self.inner.inner().return_field_from_args(args)
    }

    fn is_nullable(&self, args: &[Expr], schema: &dyn datafusion::common::ExprSchema) -> bool {
        #[allow(deprecated, reason = "delegated as it is")]
        self.inner.inner().is_nullable(args, schema)
    }

    fn coerce_types(&self, arg_types: &[DataType]) -> DfResult<Vec<DataType>> {
        self.inner.inner().coerce_types(arg_types)
    }

    fn short_circuits(&self) -> bool {
        self.inner.inner().short_circuits()
    }

    fn documentation(&self) -> Option<&Documentation> {
        self.inner.inner().documentation()
    }

    // `simplify` is deliberately not delegated: `concat`'s folds literal arguments into
    // one string at plan time, with nothing checking its size.

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> DfResult<ColumnarValue> {
        let rows = args.number_rows.max(1);
        check_estimate(self.name(), self.bound, &args.args, rows, self.max_bytes)?;
        let config = args.config_options.clone();
        let out = self.inner.invoke_with_args(args)?;
        check_result(self.name(), &out, self.max_bytes, &config)?;
        Ok(out)
    }
}

/// `inner` with accumulators that refuse to grow a value past `max_bytes`.
fn capped_aggregate(inner: AggregateUDF, max_bytes: usize) -> AggregateUDF {
    AggregateUDF::new_from_impl(CappedAggregate { inner, max_bytes })
}

/// An aggregate whose value per group (one string, one list) is capped.
#[derive(Debug, PartialEq, Eq, Hash)]
pub(crate) struct CappedAggregate {
    inner: AggregateUDF,
    max_bytes: usize,
}

impl CappedAggregate {
    fn capped(&self, inner: Box<dyn Accumulator>) -> Box<dyn Accumulator> {
        Box::new(CappedAccumulator { name: self.inner.name().to_owned(), inner, max_bytes: self.max_bytes })
    }
}

impl AggregateUDFImpl for CappedAggregate {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn aliases(&self) -> &[String] {
        self.inner.aliases()
    }

    fn schema_name(&self, params: &datafusion::logical_expr::expr::AggregateFunctionParams) -> DfResult<String> {
        self.inner.inner().schema_name(params)
    }

    fn display_name(&self, params: &datafusion::logical_expr::expr::AggregateFunctionParams) -> DfResult<String> {
        self.inner.inner().display_name(params)
    }

    fn signature(&self) -> &Signature {
        self.inner.signature()
    }

    fn return_type(&self, arg_types: &[DataType]) -> DfResult<DataType> {
        self.inner.inner().return_type(arg_types)
    }

    fn return_field(&self, arg_fields: &[FieldRef]) -> DfResult<FieldRef> {
        self.inner.inner().return_field(arg_fields)
    }

    fn is_nullable(&self) -> bool {
        self.inner.inner().is_nullable()
    }

    fn accumulator(&self, acc_args: AccumulatorArgs) -> DfResult<Box<dyn Accumulator>> {
        let inner = self.inner.accumulator(acc_args)?;
        Ok(self.capped(inner))
    }

    fn state_fields(&self, args: StateFieldsArgs) -> DfResult<Vec<FieldRef>> {
        self.inner.inner().state_fields(args)
    }

    // Grouped, each group gets its own capped accumulator: the groups accumulators of
    // `string_agg`/`array_agg` would grow a group's value unchecked.
    fn groups_accumulator_supported(&self, _args: AccumulatorArgs) -> bool {
        false
    }

    fn create_sliding_accumulator(&self, args: AccumulatorArgs) -> DfResult<Box<dyn Accumulator>> {
        let inner = self.inner.create_sliding_accumulator(args)?;
        Ok(self.capped(inner))
    }

    fn with_beneficial_ordering(
        self: Arc<Self>,
        beneficial_ordering: bool,
    ) -> DfResult<Option<Arc<dyn AggregateUDFImpl>>> {
        let max_bytes = self.max_bytes;
        Ok(self
            .inner
            .clone()
            .with_beneficial_ordering(beneficial_ordering)?
            .map(|inner| Arc::new(CappedAggregate { inner, max_bytes }) as Arc<dyn AggregateUDFImpl>))
    }

    fn order_sensitivity(&self) -> AggregateOrderSensitivity {
        self.inner.inner().order_sensitivity()
    }

    fn reverse_expr(&self) -> ReversedUDAF {
        match self.inner.reverse_udf() {
            ReversedUDAF::Reversed(r) => {
                ReversedUDAF::Reversed(Arc::new(capped_aggregate(r.as_ref().clone(), self.max_bytes)))
            }
            other => other,
        }
    }

    fn coerce_types(&self, arg_types: &[DataType]) -> DfResult<Vec<DataType>> {
        self.inner.inner().coerce_types(arg_types)
    }

    fn default_value(&self, data_type: &DataType) -> DfResult<ScalarValue> {
        self.inner.default_value(data_type)
    }

    fn supports_null_handling_clause(&self) -> bool {
        self.inner.inner().supports_null_handling_clause()
    }

    fn supports_within_group_clause(&self) -> bool {
        self.inner.inner().supports_within_group_clause()
    }

    fn documentation(&self) -> Option<&Documentation> {
        self.inner.documentation()
    }
}

/// An accumulator that refuses, before each batch, to hold more than `max_bytes`. Its
/// value may double its capacity while it grows, so it holds at most twice the limit.
#[derive(Debug)]
struct CappedAccumulator {
    name: String,
    inner: Box<dyn Accumulator>,
    max_bytes: usize,
}

impl CappedAccumulator {
    fn check(&self, values: &[ArrayRef]) -> DfResult<()> {
        let incoming: u128 = values.iter().map(array_bytes).sum();
        let held = self.inner.size() as u128 + incoming;
        if held > self.max_bytes as u128 {
            return Err(too_large(&self.name, "hold a value of up to", held, self.max_bytes));
        }
        Ok(())
    }
}

impl Accumulator for CappedAccumulator {
    fn update_batch(&mut self, values: &[ArrayRef]) -> DfResult<()> {
        self.check(values)?;
        self.inner.update_batch(values)
    }

    fn evaluate(&mut self) -> DfResult<ScalarValue> {
        self.inner.evaluate()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn state(&mut self) -> DfResult<Vec<ScalarValue>> {
        self.inner.state()
    }

    fn merge_batch(&mut self, states: &[ArrayRef]) -> DfResult<()> {
        self.check(states)?;
        self.inner.merge_batch(states)
    }

    fn retract_batch(&mut self, values: &[ArrayRef]) -> DfResult<()> {
        self.inner.retract_batch(values)
    }

    fn supports_retract_batch(&self) -> bool {
        self.inner.supports_retract_batch()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_registered_function_is_classified() {
        let (scalars, aggregates) = registry().expect("registry");
        let unknown: Vec<_> = scalars.iter().filter(|n| class(n).is_none()).collect();
        assert!(unknown.is_empty(), "classify these scalar functions in funcs::class: {unknown:?}");
        let unknown: Vec<_> = aggregates.iter().filter(|n| aggregate_class(n).is_none()).collect();
        assert!(unknown.is_empty(), "classify these aggregates in funcs::aggregate_class: {unknown:?}");
    }

    #[test]
    fn estimates_bound_what_the_functions_build() {
        let s = |v: &str| ColumnarValue::Scalar(ScalarValue::Utf8(Some(v.into())));
        let i = |n: i64| ColumnarValue::Scalar(ScalarValue::Int64(Some(n)));
        assert_eq!(Bound::Repeat.estimate(&[s("ab"), i(10)], 3), Some(60));
        assert_eq!(Bound::ListRepeat.estimate(&[i(1), i(1_000_000_000)], 1), Some(40_000_000_000));
        assert_eq!(Bound::Range.estimate(&[i(0), i(9)], 1), Some(80));
        assert_eq!(Bound::Range.estimate(&[i(0), i(99), i(10)], 2), Some(160));
        let day = ColumnarValue::Scalar(ScalarValue::Date32(Some(0)));
        let year = ColumnarValue::Scalar(ScalarValue::Date32(Some(365)));
        let step = ColumnarValue::Scalar(ScalarValue::new_interval_mdn(0, 1, 0));
        assert_eq!(Bound::Range.estimate(&[day, year, step], 1), Some(366 * 8));
        assert_eq!(Bound::Sum { factor: 2 }.estimate(&[s("abc"), s("hex")], 1), Some(24));
        assert_eq!(Bound::After.estimate(&[s("abc")], 1), None);
    }
}
