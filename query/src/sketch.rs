//! Quantile sketches in SQL: `ddsketch(x)` summarises a column as a DDSketch (relative
//! accuracy 1 %), `ddsketch_merge(s)` merges sketches, `ddsketch_quantile(s, q)` reads
//! one quantile.
//!
//! Why a sketch and not `approx_percentile_cont`: a t-digest's answer depends on the
//! order it saw its values, so percentiles of a week built from stored hours would
//! differ from the week read whole. A DDSketch's buckets are counts on a fixed
//! logarithmic grid: merging is addition, in any order, so a week merged from hourly
//! sketches is the same sketch as the week read at once, and any quantile read from it
//! is within 1 % (relative) of the exact value. Sketches travel as the DataDog
//! binary encoding (`DDSketchWithExactSummaryStatistics`, readable by DataDog's Java
//! and Go libraries), typically tens to a few hundred bytes.
//!
//! NULL and non-finite inputs are ignored; a group with no value gives a NULL sketch.
//! Values below 1e-9 (idle SMs, say) count in the sketch's zero bucket.

use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, AsArray, Float64Array};
use datafusion::arrow::datatypes::{DataType, Field, FieldRef, Float64Type};
use datafusion::common::{DataFusionError, Result, ScalarValue, exec_err};
use datafusion::execution::SessionState;
use datafusion::logical_expr::function::{AccumulatorArgs, StateFieldsArgs};
use datafusion::logical_expr::utils::format_state_name;
use datafusion::logical_expr::{
    Accumulator, AggregateUDF, AggregateUDFImpl, ColumnarValue, ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl,
    Signature, Volatility,
};
use sketches_ddsketch::{Config, DDSketch};

/// An empty sketch with Apron's parameters (the crate's defaults: α = 0.01, 2,048 bins).
pub fn new_sketch() -> DDSketch {
    DDSketch::new(Config::defaults())
}

/// Decodes a sketch made by [`encode`] (or any DataDog-encoded DDSketch).
pub fn decode(bytes: &[u8]) -> Result<DDSketch> {
    DDSketch::from_java_bytes(bytes).map_err(|e| DataFusionError::Execution(format!("not a DDSketch: {e:?}")))
}

/// The sketch's binary form.
pub fn encode(sketch: &DDSketch) -> Vec<u8> {
    sketch.to_java_bytes()
}

/// Merges `other` into `into` (both made with [`new_sketch`]'s parameters).
pub fn merge(into: &mut DDSketch, other: &DDSketch) -> Result<()> {
    into.merge(other).map_err(|e| DataFusionError::Execution(format!("merging sketches: {e}")))
}

/// Quantile `q` of `sketch`, `None` when it is empty.
pub fn quantile(sketch: &DDSketch, q: f64) -> Result<Option<f64>> {
    sketch.quantile(q).map_err(|e| DataFusionError::Execution(format!("quantile {q}: {e}")))
}

/// The names [`register`] gives its functions (a sketch is bounded by its parameters).
pub const FUNCTIONS: &[&str] = &["ddsketch", "ddsketch_merge", "ddsketch_quantile"];

/// Registers `ddsketch`, `ddsketch_merge` and `ddsketch_quantile` in `state`.
pub fn register(state: &mut SessionState) -> Result<()> {
    use datafusion::execution::FunctionRegistry;
    state.register_udaf(Arc::new(AggregateUDF::new_from_impl(SketchAgg::new(Input::Values))))?;
    state.register_udaf(Arc::new(AggregateUDF::new_from_impl(SketchAgg::new(Input::Sketches))))?;
    state.register_udf(Arc::new(ScalarUDF::new_from_impl(SketchQuantile {
        signature: Signature::exact(vec![DataType::Binary, DataType::Float64], Volatility::Immutable),
    })))?;
    Ok(())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Input {
    /// `ddsketch(x DOUBLE)`: values.
    Values,
    /// `ddsketch_merge(s BINARY)`: sketches.
    Sketches,
}

#[derive(Debug, PartialEq, Eq, Hash)]
struct SketchAgg {
    input: Input,
    signature: Signature,
}

impl SketchAgg {
    fn new(input: Input) -> SketchAgg {
        let arg = match input {
            Input::Values => DataType::Float64,
            Input::Sketches => DataType::Binary,
        };
        // `uniform` coerces: `ddsketch(sm_active)` over a decimal column reads as DOUBLE.
        SketchAgg { input, signature: Signature::uniform(1, vec![arg], Volatility::Immutable) }
    }
}

impl AggregateUDFImpl for SketchAgg {
    fn name(&self) -> &str {
        match self.input {
            Input::Values => "ddsketch",
            Input::Sketches => "ddsketch_merge",
        }
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn return_type(&self, _arg_types: &[DataType]) -> Result<DataType> {
        Ok(DataType::Binary)
    }

    fn accumulator(&self, _args: AccumulatorArgs) -> Result<Box<dyn Accumulator>> {
        Ok(Box::new(SketchAccumulator { input: self.input, sketch: new_sketch(), encoded_hint: 0 }))
    }

    fn state_fields(&self, args: StateFieldsArgs) -> Result<Vec<FieldRef>> {
        Ok(vec![Arc::new(Field::new(format_state_name(args.name, "sketch"), DataType::Binary, true))])
    }
}

struct SketchAccumulator {
    input: Input,
    sketch: DDSketch,
    /// Bytes of the last encoding: what `size` reports for the bins (the crate does not
    /// expose its store's length in bytes).
    encoded_hint: usize,
}

impl std::fmt::Debug for SketchAccumulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SketchAccumulator").field("input", &self.input).field("count", &self.sketch.count()).finish()
    }
}

impl SketchAccumulator {
    fn merge_sketches(&mut self, col: &ArrayRef) -> Result<()> {
        let Some(bin) = col.as_binary_opt::<i32>() else {
            return exec_err!("ddsketch_merge: expected a BINARY column, got {}", col.data_type());
        };
        for bytes in bin.iter().flatten() {
            merge(&mut self.sketch, &decode(bytes)?)?;
        }
        self.encoded_hint = self.sketch.length() * 9;
        Ok(())
    }

    fn value(&self) -> ScalarValue {
        ScalarValue::Binary((self.sketch.count() > 0).then(|| encode(&self.sketch)))
    }
}

impl Accumulator for SketchAccumulator {
    fn update_batch(&mut self, values: &[ArrayRef]) -> Result<()> {
        let Some(col) = values.first() else { return Ok(()) };
        match self.input {
            Input::Sketches => self.merge_sketches(col),
            Input::Values => {
                let Some(v) = col.as_primitive_opt::<Float64Type>() else {
                    return exec_err!("ddsketch: expected a DOUBLE column, got {}", col.data_type());
                };
                for x in v.iter().flatten().filter(|x| x.is_finite()) {
                    self.sketch.add(x);
                }
                self.encoded_hint = self.sketch.length() * 9;
                Ok(())
            }
        }
    }

    fn merge_batch(&mut self, states: &[ArrayRef]) -> Result<()> {
        match states.first() {
            Some(col) => self.merge_sketches(col),
            None => Ok(()),
        }
    }

    fn state(&mut self) -> Result<Vec<ScalarValue>> {
        Ok(vec![self.value()])
    }

    fn evaluate(&mut self) -> Result<ScalarValue> {
        Ok(self.value())
    }

    fn size(&self) -> usize {
        std::mem::size_of_val(self) + self.encoded_hint
    }
}

/// `ddsketch_quantile(sketch, q)`.
#[derive(Debug, PartialEq, Eq, Hash)]
struct SketchQuantile {
    signature: Signature,
}

impl ScalarUDFImpl for SketchQuantile {
    fn name(&self) -> &str {
        "ddsketch_quantile"
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn return_type(&self, _arg_types: &[DataType]) -> Result<DataType> {
        Ok(DataType::Float64)
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let rows = args.number_rows;
        let arrays = ColumnarValue::values_to_arrays(&args.args)?;
        let (Some(sketches), Some(qs)) = (arrays.first(), arrays.get(1)) else {
            return exec_err!("ddsketch_quantile(sketch, q) takes two arguments");
        };
        let (Some(sketches), Some(qs)) = (sketches.as_binary_opt::<i32>(), qs.as_primitive_opt::<Float64Type>()) else {
            return exec_err!("ddsketch_quantile(sketch BINARY, q DOUBLE)");
        };
        let out: Float64Array = (0..rows)
            .map(|r| {
                if sketches.is_null(r) || qs.is_null(r) {
                    return Ok(None);
                }
                let q = qs.value(r);
                if !(0.0..=1.0).contains(&q) {
                    return exec_err!("ddsketch_quantile: q must lie in [0, 1], got {q}");
                }
                quantile(&decode(sketches.value(r))?, q)
            })
            .collect::<Result<_>>()?;
        Ok(ColumnarValue::Array(Arc::new(out)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::prelude::SessionContext;

    async fn one(ctx: &SessionContext, sql: &str) -> Option<f64> {
        let batches = ctx.sql(sql).await.expect("plan").collect().await.expect("run");
        let b = batches.iter().find(|b| b.num_rows() > 0).expect("a row");
        let c = b.column(0).as_primitive::<Float64Type>();
        (!c.is_null(0)).then(|| c.value(0))
    }

    #[tokio::test]
    async fn quantiles_are_within_one_percent_and_merging_hours_equals_reading_whole() {
        let mut state = datafusion::execution::SessionStateBuilder::new().with_default_features().build();
        register(&mut state).expect("register");
        let ctx = SessionContext::new_with_state(state);
        ctx.sql(
            "CREATE VIEW v AS SELECT CAST(value % 100 AS DOUBLE) / 100.0 AS x, value % 7 AS h \
             FROM generate_series(1, 10000)",
        )
        .await
        .expect("view");
        let whole = one(&ctx, "SELECT ddsketch_quantile(ddsketch(x), 0.95) FROM v").await.expect("p95");
        // 0.00 … 0.99, 100 of each: rank ⌊0.95 × 9,999⌋ = 9,499 holds 0.94.
        assert!((whole - 0.94).abs() <= 0.94 * 0.01, "{whole}");
        let merged = one(
            &ctx,
            "SELECT ddsketch_quantile(ddsketch_merge(s), 0.95) FROM (SELECT h, ddsketch(x) AS s FROM v GROUP BY h)",
        )
        .await
        .expect("p95");
        assert_eq!(whole.to_bits(), merged.to_bits(), "bucket counts add, whatever the grouping");
        // Decimal columns (the stored ratios) coerce to DOUBLE.
        let dec = one(&ctx, "SELECT ddsketch_quantile(ddsketch(CAST(x AS DECIMAL(5, 4))), 0.95) FROM v").await;
        assert!(dec.is_some_and(|d| (d - whole).abs() <= whole * 0.01), "{dec:?}");
        // Zeros and NULLs: a group of zeros reads 0; a group of NULLs has no sketch.
        assert_eq!(one(&ctx, "SELECT ddsketch_quantile(ddsketch(x * 0), 0.95) FROM v").await, Some(0.0));
        assert_eq!(one(&ctx, "SELECT ddsketch_quantile(ddsketch(CAST(NULL AS DOUBLE)), 0.5) FROM v").await, None);
        let bad = ctx.sql("SELECT ddsketch_quantile(ddsketch(x), 2.0) FROM v").await.expect("plan").collect().await;
        assert!(bad.is_err_and(|e| e.to_string().contains("q must lie in [0, 1]")));
    }

    #[test]
    fn decoded_sketches_merge_with_new_ones() {
        let mut a = new_sketch();
        let mut b = new_sketch();
        for i in 0..100 {
            a.add(f64::from(i));
            b.add(f64::from(i) * 1e9);
        }
        let mut d = decode(&encode(&a)).expect("decode");
        merge(&mut d, &decode(&encode(&b)).expect("decode")).expect("merge");
        merge(&mut a, &b).expect("merge");
        assert_eq!(encode(&d), encode(&a));
        assert!(decode(b"not a sketch").is_err());
    }
}
