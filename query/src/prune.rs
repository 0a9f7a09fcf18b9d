//! Time-partition pruning: the bounds a query's filters put on a table's time column,
//! so the scan skips whole `date=` partitions and memtable batches it cannot need.
//!
//! Only what is certain is used: comparisons of the bare column with a timestamp literal
//! (`time >= '2026-11-19'` arrives here as a typed literal after DataFusion's coercion
//! and constant folding), `BETWEEN`, and `AND`/`OR` of those. Anything else leaves the
//! bound open. The column is Timestamp(µs) (the storage contract), so bounds are exact
//! in whole µs: `time < '2026-11-19'` ends at 2026-11-18T23:59:59.999999 and does not
//! touch the next day's partition. The filters themselves still run on every row read.

use datafusion::logical_expr::{Between, BinaryExpr, Expr, Operator};
use datafusion::scalar::ScalarValue;

/// Inclusive bounds in µs since the epoch; `None` = unbounded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TimeRange {
    pub min: Option<i64>,
    pub max: Option<i64>,
}

pub const MICROS_PER_DAY: i64 = 86_400_000_000;

impl TimeRange {
    pub const ALL: TimeRange = TimeRange { min: None, max: None };

    fn intersect(self, o: TimeRange) -> TimeRange {
        let pick = |a: Option<i64>, b: Option<i64>, f: fn(i64, i64) -> i64| match (a, b) {
            (Some(a), Some(b)) => Some(f(a, b)),
            (a, b) => a.or(b),
        };
        TimeRange { min: pick(self.min, o.min, i64::max), max: pick(self.max, o.max, i64::min) }
    }

    /// The smallest range holding both (an `OR`): unbounded on a side if either is.
    fn hull(self, o: TimeRange) -> TimeRange {
        let both = |a: Option<i64>, b: Option<i64>, f: fn(i64, i64) -> i64| Some(f(a?, b?));
        TimeRange { min: both(self.min, o.min, i64::min), max: both(self.max, o.max, i64::max) }
    }

    /// True if some instant in `[lo, hi]` (inclusive, µs) may match.
    pub fn overlaps(&self, lo: i64, hi: i64) -> bool {
        self.min.is_none_or(|min| hi >= min) && self.max.is_none_or(|max| lo <= max)
    }

    /// True if rows of UTC day `day` (days since the epoch) may match.
    pub fn overlaps_day(&self, day: i64) -> bool {
        let lo = day.saturating_mul(MICROS_PER_DAY);
        self.overlaps(lo, lo.saturating_add(MICROS_PER_DAY - 1))
    }

    pub fn is_all(&self) -> bool {
        *self == TimeRange::ALL
    }
}

/// The range of `column` that rows passing all of `filters` (ANDed) can have.
pub fn time_range(filters: &[Expr], column: &str) -> TimeRange {
    filters.iter().fold(TimeRange::ALL, |acc, f| acc.intersect(range_of(f, column)))
}

fn range_of(e: &Expr, column: &str) -> TimeRange {
    match e {
        Expr::BinaryExpr(BinaryExpr { left, op, right }) => match op {
            Operator::And => range_of(left, column).intersect(range_of(right, column)),
            Operator::Or => range_of(left, column).hull(range_of(right, column)),
            _ => comparison(left, *op, right, column).unwrap_or(TimeRange::ALL),
        },
        Expr::Between(Between { expr, negated: false, low, high }) if is_column(expr, column) => {
            TimeRange { min: micros(low).map(|v| v.1), max: micros(high).map(|v| v.0) }
        }
        _ => TimeRange::ALL,
    }
}

fn comparison(left: &Expr, op: Operator, right: &Expr, column: &str) -> Option<TimeRange> {
    // Normalise to `column op literal`.
    let (op, lit) = if is_column(left, column) {
        (op, right)
    } else if is_column(right, column) {
        (op.swap()?, left)
    } else {
        return None;
    };
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

fn is_column(e: &Expr, column: &str) -> bool {
    matches!(e, Expr::Column(c) if c.name == column)
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
