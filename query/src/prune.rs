//! Time-partition pruning: the bounds a query's filters put on a table's time column,
//! so the scan skips whole `date=` partitions and memtable batches it cannot need — and
//! the bounds on `gpu_uuid`, so the memtable rows an evaluator's per-GPU-chunk query
//! sorts are its chunk's, not the whole memtable's.
//!
//! Only what is certain is used: comparisons of the bare column with a timestamp literal
//! (`time >= '2026-11-19'` arrives here as a typed literal after DataFusion's coercion
//! and constant folding), `BETWEEN`, and `AND`/`OR` of those. Anything else leaves the
//! bound open. The column is Timestamp(µs) (the storage contract), so bounds are exact
//! in whole µs: `time < '2026-11-19'` ends at 2026-11-18T23:59:59.999999 and does not
//! touch the next day's partition. The filters themselves still run on every row read.

use datafusion::logical_expr::expr::InList;
use datafusion::logical_expr::{Between, BinaryExpr, Expr, Operator};
use datafusion::scalar::ScalarValue;

/// Inclusive bounds on a column's values; `None` = unbounded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Bounds<T> {
    pub min: Option<T>,
    pub max: Option<T>,
}

/// Bounds in µs since the epoch on a table's time column.
pub type TimeRange = Bounds<i64>;

/// Bounds on a string key column (`gpu_uuid`): what a scan of memtable rows may skip.
pub type KeyRange = Bounds<String>;

pub const MICROS_PER_DAY: i64 = 86_400_000_000;

impl<T: Ord + Clone> Bounds<T> {
    pub const ALL: Bounds<T> = Bounds { min: None, max: None };

    fn intersect(self, o: Bounds<T>) -> Bounds<T> {
        let pick = |a: Option<T>, b: Option<T>, f: fn(T, T) -> T| match (a, b) {
            (Some(a), Some(b)) => Some(f(a, b)),
            (a, b) => a.or(b),
        };
        Bounds { min: pick(self.min, o.min, T::max), max: pick(self.max, o.max, T::min) }
    }

    /// The smallest range holding both (an `OR`): unbounded on a side if either is.
    fn hull(self, o: Bounds<T>) -> Bounds<T> {
        let both = |a: Option<T>, b: Option<T>, f: fn(T, T) -> T| Some(f(a?, b?));
        Bounds { min: both(self.min, o.min, T::min), max: both(self.max, o.max, T::max) }
    }

    /// True if some value in `[lo, hi]` may match.
    pub fn overlaps(&self, lo: &T, hi: &T) -> bool {
        self.min.as_ref().is_none_or(|min| hi >= min) && self.max.as_ref().is_none_or(|max| lo <= max)
    }

    /// True if `v` may match.
    pub fn contains(&self, v: &T) -> bool {
        self.overlaps(v, v)
    }

    pub fn is_all(&self) -> bool {
        self.min.is_none() && self.max.is_none()
    }
}

impl TimeRange {
    /// True if rows of UTC day `day` (days since the epoch) may match.
    pub fn overlaps_day(&self, day: i64) -> bool {
        let lo = day.saturating_mul(MICROS_PER_DAY);
        self.overlaps(&lo, &lo.saturating_add(MICROS_PER_DAY - 1))
    }
}

/// The range of `column` that rows passing all of `filters` (ANDed) can have.
pub fn time_range(filters: &[Expr], column: &str) -> TimeRange {
    filters.iter().fold(TimeRange::ALL, |acc, f| acc.intersect(range_of(f, column)))
}

/// The range of string column `column` that rows passing all of `filters` (ANDed) can
/// have: `=`, `<`, `<=`, `>`, `>=` (strict comparisons taken as inclusive: a bound may
/// be wider than the filter, never narrower), `BETWEEN`, `IN` lists and `AND`/`OR`.
pub fn key_range(filters: &[Expr], column: &str) -> KeyRange {
    filters.iter().fold(KeyRange::ALL, |acc, f| acc.intersect(range_of(f, column)))
}

/// A literal of the column's type, and what a comparison with it bounds.
trait Bound: Ord + Clone + Sized {
    fn comparison(op: Operator, lit: &Expr) -> Option<Bounds<Self>>;
    fn between(low: &Expr, high: &Expr) -> Bounds<Self>;
}

fn range_of<T: Bound>(e: &Expr, column: &str) -> Bounds<T> {
    match e {
        Expr::BinaryExpr(BinaryExpr { left, op, right }) => match op {
            Operator::And => range_of(left, column).intersect(range_of(right, column)),
            Operator::Or => range_of(left, column).hull(range_of(right, column)),
            _ => comparison(left, *op, right, column).unwrap_or(Bounds::ALL),
        },
        Expr::Between(Between { expr, negated: false, low, high }) if is_column(expr, column) => T::between(low, high),
        Expr::InList(InList { expr, list, negated: false }) if is_column(expr, column) => list
            .iter()
            .map(|v| T::comparison(Operator::Eq, v))
            .reduce(|a, b| Some(a?.hull(b?)))
            .flatten()
            .unwrap_or(Bounds::ALL),
        _ => Bounds::ALL,
    }
}

fn comparison<T: Bound>(left: &Expr, op: Operator, right: &Expr, column: &str) -> Option<Bounds<T>> {
    // Normalise to `column op literal`.
    if is_column(left, column) {
        T::comparison(op, right)
    } else if is_column(right, column) {
        T::comparison(op.swap()?, left)
    } else {
        None
    }
}

impl Bound for i64 {
    fn comparison(op: Operator, lit: &Expr) -> Option<TimeRange> {
        let (floor, ceil) = micros(lit)?;
        // The column holds whole µs, so `time < v` is `time <= ceil(v) - 1`: exact bounds
        // matter at day edges (`time < '2026-11-19'` must not read 2026-11-19).
        Some(match op {
            Operator::Eq => TimeRange { min: Some(floor), max: Some(ceil) },
            Operator::Gt => TimeRange { min: Some(floor.saturating_add(1)), max: None },
            Operator::GtEq => TimeRange { min: Some(ceil), max: None },
            Operator::Lt => TimeRange { min: None, max: Some(ceil.saturating_sub(1)) },
            Operator::LtEq => TimeRange { min: None, max: Some(floor) },
            _ => return None,
        })
    }

    fn between(low: &Expr, high: &Expr) -> TimeRange {
        TimeRange { min: micros(low).map(|v| v.1), max: micros(high).map(|v| v.0) }
    }
}

impl Bound for String {
    fn comparison(op: Operator, lit: &Expr) -> Option<KeyRange> {
        let v = string(lit)?;
        Some(match op {
            Operator::Eq => KeyRange { min: Some(v.clone()), max: Some(v) },
            Operator::Gt | Operator::GtEq => KeyRange { min: Some(v), max: None },
            Operator::Lt | Operator::LtEq => KeyRange { min: None, max: Some(v) },
            _ => return None,
        })
    }

    fn between(low: &Expr, high: &Expr) -> KeyRange {
        KeyRange { min: string(low), max: string(high) }
    }
}

fn is_column(e: &Expr, column: &str) -> bool {
    matches!(e, Expr::Column(c) if c.name == column)
}

fn string(e: &Expr) -> Option<String> {
    match e {
        Expr::Literal(
            ScalarValue::Utf8(Some(v)) | ScalarValue::LargeUtf8(Some(v)) | ScalarValue::Utf8View(Some(v)),
            _,
        ) => Some(v.clone()),
        _ => None,
    }
}

/// A timestamp literal as (floor, ceil) in µs since the epoch (any unit; the time zone
/// does not change the instant). `None` for anything else or out of range.
fn micros(e: &Expr) -> Option<(i64, i64)> {
    let Expr::Literal(v, _) = e else { return None };
    let exact = |v: i64, per: i64| v.checked_mul(per).map(|us| (us, us));
    match v {
        ScalarValue::TimestampSecond(Some(v), _) => exact(*v, 1_000_000),
        ScalarValue::TimestampMillisecond(Some(v), _) => exact(*v, 1_000),
        ScalarValue::TimestampMicrosecond(Some(v), _) => Some((*v, *v)),
        ScalarValue::TimestampNanosecond(Some(v), _) => {
            let floor = v.div_euclid(1_000);
            Some((floor, floor + i64::from(v.rem_euclid(1_000) != 0)))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use datafusion::logical_expr::{col, lit};

    use super::*;

    fn ts(us: i64) -> Expr {
        lit(ScalarValue::TimestampMicrosecond(Some(us), Some("UTC".into())))
    }

    const DAY: i64 = MICROS_PER_DAY;

    #[test]
    fn comparisons_between_and_or() {
        assert_eq!(time_range(&[col("time").gt_eq(ts(5))], "time"), TimeRange { min: Some(5), max: None });
        // Literal on the left: `5 < time` is `time > 5`, i.e. `time >= 6` in whole µs.
        assert_eq!(time_range(&[ts(5).lt(col("time"))], "time"), TimeRange { min: Some(6), max: None });
        let both = [col("time").gt_eq(ts(5)), col("time").lt(ts(9))];
        assert_eq!(time_range(&both, "time"), TimeRange { min: Some(5), max: Some(8) });
        let and = col("time").gt_eq(ts(5)).and(col("time").lt_eq(ts(9))).and(col("gpu_uuid").eq(lit("x")));
        assert_eq!(time_range(&[and], "time"), TimeRange { min: Some(5), max: Some(9) });
        // Half-open day: `time < midnight` stays out of the next day.
        let r = time_range(&[col("time").lt(ts(2 * DAY))], "time");
        assert!(r.overlaps_day(1) && !r.overlaps_day(2));
        assert_eq!(time_range(&[col("time").between(ts(3), ts(4))], "time"), TimeRange { min: Some(3), max: Some(4) });
        assert_eq!(time_range(&[col("time").not_between(ts(3), ts(4))], "time"), TimeRange::ALL);
        let or = col("time").eq(ts(1)).or(col("time").eq(ts(10)));
        assert_eq!(time_range(&[or], "time"), TimeRange { min: Some(1), max: Some(10) });
        let open_or = col("time").eq(ts(1)).or(col("gpu_uuid").eq(lit("x")));
        assert_eq!(time_range(&[open_or], "time"), TimeRange::ALL);
        // Other columns, other operators, non-literals: no bound.
        assert_eq!(time_range(&[col("other").gt(ts(5))], "time"), TimeRange::ALL);
        assert_eq!(time_range(&[col("time").not_eq(ts(5))], "time"), TimeRange::ALL);
        assert_eq!(time_range(&[col("time").gt(col("other"))], "time"), TimeRange::ALL);
    }

    #[test]
    fn key_ranges_are_never_narrower_than_the_filter() {
        let g = || col("gpu_uuid");
        let r = key_range(&[g().gt_eq(lit("b")), g().lt_eq(lit("d"))], "gpu_uuid");
        assert_eq!(r, KeyRange { min: Some("b".into()), max: Some("d".into()) });
        assert!(r.contains(&"c".to_owned()) && r.contains(&"d".to_owned()) && !r.contains(&"e".to_owned()));
        // Strict comparisons stay inclusive (wider is safe; DataFusion re-checks rows).
        assert_eq!(key_range(&[g().gt(lit("b"))], "gpu_uuid").min.as_deref(), Some("b"));
        let list = g().in_list(vec![lit("q"), lit("c"), lit("k")], false);
        assert_eq!(key_range(&[list], "gpu_uuid"), KeyRange { min: Some("c".into()), max: Some("q".into()) });
        assert_eq!(key_range(&[g().in_list(vec![lit("c")], true)], "gpu_uuid"), KeyRange::ALL);
        assert_eq!(key_range(&[g().eq(lit("x")).or(g().eq(lit("a")))], "gpu_uuid").max.as_deref(), Some("x"));
        assert_eq!(key_range(&[g().eq(lit("x")).or(col("host").eq(lit("a")))], "gpu_uuid"), KeyRange::ALL);
        assert_eq!(key_range(&[g().not_eq(lit("x"))], "gpu_uuid"), KeyRange::ALL);
        assert_eq!(key_range(&[g().between(lit("a"), lit("c"))], "gpu_uuid").max.as_deref(), Some("c"));
    }

    #[test]
    fn units_round_outward() {
        let ns = |v: i64| lit(ScalarValue::TimestampNanosecond(Some(v), None));
        // time >= 1.5 µs → time >= 2; time <= 1.5 µs → time <= 1; time < 1.5 µs → time <= 1.
        assert_eq!(time_range(&[col("time").gt_eq(ns(1_500))], "time").min, Some(2));
        assert_eq!(time_range(&[col("time").lt_eq(ns(1_500))], "time").max, Some(1));
        assert_eq!(time_range(&[col("time").lt(ns(1_500))], "time").max, Some(1));
        assert_eq!(time_range(&[col("time").lt(ns(2_000))], "time").max, Some(1));
        let s = lit(ScalarValue::TimestampSecond(Some(2), None));
        assert_eq!(time_range(&[col("time").gt(s)], "time").min, Some(2_000_001));
    }

    #[test]
    fn days() {
        let r = TimeRange { min: Some(2 * DAY), max: None };
        assert!(!r.overlaps_day(1));
        assert!(r.overlaps_day(2));
        let r = TimeRange { min: Some(2 * DAY - 1), max: Some(2 * DAY) };
        assert!(r.overlaps_day(1) && r.overlaps_day(2) && !r.overlaps_day(3) && !r.overlaps_day(0));
        assert!(TimeRange::ALL.overlaps_day(-5));
    }
}
