//! Exact money: micro-dollars, cents, exact decimal parsing and the one rounding rule.
//!
//! **Rounding rule (used everywhere in this crate):** compute the exact value as a ratio of
//! `i128` integers, then round **once, half-to-even**, to the unit being produced
//! (micro-dollars for stored columns, cents for report lines). Half-even rather than
//! half-up because sums of many rounded figures then carry no systematic upward bias,
//! and because it is what finance systems (and `Decimal` in most SQL engines' banker's
//! mode) use. No floating point is ever on a money path.
//!
//! [`Micros`] is an `i64` of micro-dollars: exactly the integer inside a
//! `Decimal128(18, 6)` column, so the server stores it without conversion.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Microseconds in an hour: the divisor that turns $/GPU-hour × µs into dollars.
pub const MICROS_PER_HOUR: i64 = 3_600_000_000;
/// Hours in the "month" of monthly savings figures (8760 h / 12), as the design brief fixes.
pub const HOURS_PER_MONTH: i64 = 730;

/// Why a money value could not be produced.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum MoneyError {
    #[error("{0:?} is not a decimal number (digits with an optional sign and one '.')")]
    NotDecimal(String),
    #[error("{0:?} has too many digits to be handled exactly")]
    TooLong(String),
    #[error("arithmetic overflow computing {0}")]
    Overflow(&'static str),
    #[error("division by zero computing {0}")]
    DivisionByZero(&'static str),
    #[error("{0:?} must not be negative")]
    Negative(String),
}

/// Divides `n` by `d` and rounds half-to-even. `d` must be non-zero; the sign of the
/// result follows the usual rules. Callers check `d != 0` (returns `None` otherwise).
pub fn div_round_half_even(n: i128, d: i128) -> Option<i128> {
    if d == 0 {
        return None;
    }
    // Normalise to a positive divisor so the remainder logic below has one case.
    let (n, d) = if d < 0 { (n.checked_neg()?, d.checked_neg()?) } else { (n, d) };
    let q = n.div_euclid(d); // floor, because d > 0
    let r = n.rem_euclid(d); // 0 <= r < d
    // Compare 2r with d without overflowing: r < d, so d - r > 0.
    let twice_vs_d = r.cmp(&(d - r));
    Some(match twice_vs_d {
        std::cmp::Ordering::Less => q,
        std::cmp::Ordering::Greater => q + 1,
        std::cmp::Ordering::Equal => {
            if q.rem_euclid(2) == 0 {
                q
            } else {
                q + 1
            }
        }
    })
}

/// An exact rational number `n / d` with `d > 0`, kept reduced. Used to parse decimal
/// strings and to derive on-prem and per-GPU prices without any rounding until the very
/// end, where [`Ratio::to_micros`] rounds once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ratio {
    n: i128,
    d: i128,
}

fn gcd(mut a: i128, mut b: i128) -> i128 {
    a = a.abs();
    b = b.abs();
    while b != 0 {
        let t = a % b;
        a = b;
        b = t;
    }
    a
}

impl Ratio {
    pub const ZERO: Ratio = Ratio { n: 0, d: 1 };
    pub const ONE: Ratio = Ratio { n: 1, d: 1 };

    /// `n / d`, reduced. `None` when `d == 0`.
    pub fn new(n: i128, d: i128) -> Option<Ratio> {
        if d == 0 {
            return None;
        }
        let (n, d) = if d < 0 { (n.checked_neg()?, d.checked_neg()?) } else { (n, d) };
        let g = gcd(n, d).max(1);
        Some(Ratio { n: n / g, d: d / g })
    }

    pub fn integer(n: i128) -> Ratio {
        Ratio { n, d: 1 }
    }

    pub fn numer(self) -> i128 {
        self.n
    }

    pub fn denom(self) -> i128 {
        self.d
    }

    pub fn is_negative(self) -> bool {
        self.n < 0
    }

    pub fn is_zero(self) -> bool {
        self.n == 0
    }

    pub fn checked_add(self, o: Ratio) -> Option<Ratio> {
        let g = gcd(self.d, o.d).max(1);
        let l = self.d / g;
        let d = l.checked_mul(o.d)?;
        let n = self.n.checked_mul(o.d / g)?.checked_add(o.n.checked_mul(l)?)?;
        Ratio::new(n, d)
    }

    pub fn checked_mul(self, o: Ratio) -> Option<Ratio> {
        // Cross-reduce first so intermediate products stay small.
        let g1 = gcd(self.n, o.d).max(1);
        let g2 = gcd(o.n, self.d).max(1);
        let n = (self.n / g1).checked_mul(o.n / g2)?;
        let d = (self.d / g2).checked_mul(o.d / g1)?;
        Ratio::new(n, d)
    }

    pub fn checked_div(self, o: Ratio) -> Option<Ratio> {
        if o.n == 0 {
            return None;
        }
        self.checked_mul(Ratio::new(o.d, o.n)?)
    }

    /// Rounds (half-even) to a whole number of micro-dollars, reading `self` as dollars.
    pub fn to_micros(self) -> Option<Micros> {
        let n = self.n.checked_mul(1_000_000)?;
        let v = div_round_half_even(n, self.d)?;
        i64::try_from(v).ok().map(Micros)
    }

    /// Parses an exact decimal string (`"12.29"`, `"-0.5"`, `"700"`): no exponent, no
    /// thousands separators, at most 30 significant characters. Surrounding whitespace is
    /// ignored.
    pub fn parse_decimal(text: &str) -> Result<Ratio, MoneyError> {
        let s = text.trim();
        let bad = || MoneyError::NotDecimal(text.to_owned());
        let (neg, body) = match s.as_bytes().first() {
            Some(b'-') => (true, &s[1..]),
            Some(b'+') => (false, &s[1..]),
            _ => (false, s),
        };
        let (int, frac) = match body.split_once('.') {
            Some((i, f)) => (i, f),
            None => (body, ""),
        };
        if (int.is_empty() && frac.is_empty())
            || !int.bytes().all(|b| b.is_ascii_digit())
            || !frac.bytes().all(|b| b.is_ascii_digit())
        {
            return Err(bad());
        }
        if int.len() + frac.len() > 30 {
            return Err(MoneyError::TooLong(text.to_owned()));
        }
        let mut n: i128 = 0;
        for b in int.bytes().chain(frac.bytes()) {
            n = n * 10 + i128::from(b - b'0');
        }
        let d = 10i128.pow(frac.len() as u32);
        let n = if neg { -n } else { n };
        Ratio::new(n, d).ok_or_else(bad)
    }
}

impl fmt::Display for Ratio {
    /// Exact when the denominator divides a power of ten within 12 digits; otherwise the
    /// fraction `n/d` — the point is to never display a rounded value as if exact.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for scale in 0..=12u32 {
            let p = 10i128.pow(scale);
            if p % self.d == 0 {
                let Some(v) = self.n.checked_mul(p / self.d) else { break };
                let sign = if v < 0 { "-" } else { "" };
                let v = v.unsigned_abs();
                let p = p as u128;
                return if scale == 0 {
                    write!(f, "{sign}{v}")
                } else {
                    write!(f, "{sign}{}.{:0w$}", v / p, v % p, w = scale as usize)
                };
            }
        }
        write!(f, "{}/{}", self.n, self.d)
    }
}

/// Micro-dollars (10⁻⁶ USD) in an `i64`: the integer of a `Decimal128(18, 6)`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Micros(pub i64);

impl Micros {
    pub const ZERO: Micros = Micros(0);

    /// Parses a decimal dollar amount exactly, rounding half-even to micro-dollars when it
    /// has more than six decimals.
    pub fn parse(text: &str) -> Result<Micros, MoneyError> {
        Ratio::parse_decimal(text)?.to_micros().ok_or(MoneyError::Overflow("micro-dollars"))
    }

    pub fn checked_add(self, o: Micros) -> Option<Micros> {
        self.0.checked_add(o.0).map(Micros)
    }

    pub fn checked_sub(self, o: Micros) -> Option<Micros> {
        self.0.checked_sub(o.0).map(Micros)
    }

    /// Exact dollars as a ratio.
    pub fn to_ratio(self) -> Ratio {
        Ratio { n: i128::from(self.0), d: 1_000_000 }.reduced()
    }

    /// Rounds half-even to cents (the report's unit).
    pub fn to_cents(self) -> Cents {
        // |i64| / 10_000 always fits; the divisor is non-zero.
        Cents(div_round_half_even(i128::from(self.0), 10_000).map_or(0, |v| v as i64))
    }
}

impl Ratio {
    fn reduced(self) -> Ratio {
        Ratio::new(self.n, self.d).unwrap_or(self)
    }
}

impl fmt::Display for Micros {
    /// `12.345678` (always six decimals, `-` for negatives).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sign = if self.0 < 0 { "-" } else { "" };
        let v = self.0.unsigned_abs();
        write!(f, "{sign}{}.{:06}", v / 1_000_000, v % 1_000_000)
    }
}

/// Cents (10⁻² USD): the unit of every report line.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Cents(pub i64);

impl Cents {
    pub const ZERO: Cents = Cents(0);

    /// As dollars in an `f64`, for JSON: every cent amount below 2⁵³ is represented so that
    /// its shortest decimal form is the exact two-decimal value (`12.34`).
    pub fn as_dollars_f64(self) -> f64 {
        self.0 as f64 / 100.0
    }
}

impl std::ops::Add for Cents {
    type Output = Cents;
    fn add(self, o: Cents) -> Cents {
        Cents(self.0.saturating_add(o.0))
    }
}

impl std::ops::Sub for Cents {
    type Output = Cents;
    fn sub(self, o: Cents) -> Cents {
        Cents(self.0.saturating_sub(o.0))
    }
}

impl std::iter::Sum for Cents {
    fn sum<I: Iterator<Item = Cents>>(iter: I) -> Cents {
        iter.fold(Cents::ZERO, |a, b| a + b)
    }
}

impl fmt::Display for Cents {
    /// `1234.56` (two decimals, `-` for negatives, no thousands separator: CSV-safe).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sign = if self.0 < 0 { "-" } else { "" };
        let v = self.0.unsigned_abs();
        write!(f, "{sign}{}.{:02}", v / 100, v % 100)
    }
}

impl Serialize for Cents {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(self.as_dollars_f64())
    }
}

/// The exact numerator of a cost: Σ price (µ$/GPU-hour) × duration (µs). Dividing by
/// [`MICROS_PER_HOUR`] gives micro-dollars; summing numerators before that single
/// division is what keeps a row's cost exact across price changes inside an hour.
pub fn cost_numerator(price_per_gpu_hour: Micros, duration_us: i64) -> Option<i128> {
    i128::from(price_per_gpu_hour.0).checked_mul(i128::from(duration_us))
}

/// Rounds a cost numerator (see [`cost_numerator`]) half-even to micro-dollars.
pub fn numerator_to_micros(numerator: i128) -> Option<Micros> {
    div_round_half_even(numerator, i128::from(MICROS_PER_HOUR)).and_then(|v| i64::try_from(v).ok()).map(Micros)
}

/// The exact cost of `duration_us` microseconds at `price_per_gpu_hour`, rounded once,
/// half-even, to micro-dollars: `round(price_µ$ × µs / 3.6e9)` in `i128`.
pub fn cost_of_duration(price_per_gpu_hour: Micros, duration_us: i64) -> Result<Micros, MoneyError> {
    cost_numerator(price_per_gpu_hour, duration_us)
        .and_then(numerator_to_micros)
        .ok_or(MoneyError::Overflow("cost of a duration"))
}

/// "Monthly" savings = window savings × 730 h / window hours, rounded half-even to
/// micro-dollars (the design brief's definition). `window_us` must be positive.
pub fn monthly_savings(window_savings: Micros, window_us: i64) -> Result<Micros, MoneyError> {
    if window_us <= 0 {
        return Err(MoneyError::DivisionByZero("monthly savings (empty window)"));
    }
    let n = i128::from(window_savings.0)
        .checked_mul(i128::from(HOURS_PER_MONTH) * i128::from(MICROS_PER_HOUR))
        .ok_or(MoneyError::Overflow("monthly savings"))?;
    div_round_half_even(n, i128::from(window_us))
        .and_then(|v| i64::try_from(v).ok())
        .map(Micros)
        .ok_or(MoneyError::Overflow("monthly savings"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_even_rounds_ties_to_even_both_signs() {
        assert_eq!(div_round_half_even(5, 2), Some(2)); // 2.5 -> 2
        assert_eq!(div_round_half_even(7, 2), Some(4)); // 3.5 -> 4
        assert_eq!(div_round_half_even(-5, 2), Some(-2)); // -2.5 -> -2
        assert_eq!(div_round_half_even(-7, 2), Some(-4)); // -3.5 -> -4
        assert_eq!(div_round_half_even(10, 3), Some(3)); // 3.33 -> 3
        assert_eq!(div_round_half_even(20, 3), Some(7)); // 6.67 -> 7
        assert_eq!(div_round_half_even(-20, 3), Some(-7));
        assert_eq!(div_round_half_even(5, -2), Some(-2));
        assert_eq!(div_round_half_even(1, 0), None);
    }

    #[test]
    fn decimal_parsing_is_exact_and_strict() {
        assert_eq!(Micros::parse("12.29"), Ok(Micros(12_290_000)));
        assert_eq!(Micros::parse(" 0.000001 "), Ok(Micros(1)));
        assert_eq!(Micros::parse("-3"), Ok(Micros(-3_000_000)));
        assert_eq!(Micros::parse(".5"), Ok(Micros(500_000)));
        // 7 decimals: 0.0000005 is a tie -> even (0); 0.0000015 -> 0.000002.
        assert_eq!(Micros::parse("0.0000005"), Ok(Micros(0)));
        assert_eq!(Micros::parse("0.0000015"), Ok(Micros(2)));
        for bad in ["", ".", "1e3", "1,000", "1.2.3", "$5", "NaN", "--1"] {
            assert!(Micros::parse(bad).is_err(), "{bad:?} should be refused");
        }
        assert_eq!(Ratio::parse_decimal("1.30"), Ok(Ratio::new(13, 10).expect("ratio")));
    }

    #[test]
    fn formatting() {
        assert_eq!(Micros(12_290_000).to_string(), "12.290000");
        assert_eq!(Micros(-1).to_string(), "-0.000001");
        assert_eq!(Cents(123_456).to_string(), "1234.56");
        assert_eq!(Cents(-5).to_string(), "-0.05");
        assert_eq!(Ratio::new(1, 8).expect("r").to_string(), "0.125");
        assert_eq!(Ratio::new(1, 3).expect("r").to_string(), "1/3");
        assert_eq!(serde_json::to_string(&Cents(1234)).expect("json"), "12.34");
    }

    #[test]
    fn cents_round_half_even() {
        assert_eq!(Micros(12_345_000).to_cents(), Cents(1234)); // 12.345 -> 12.34 (4 even)
        assert_eq!(Micros(12_355_000).to_cents(), Cents(1236)); // 12.355 -> 12.36 (6 even)
        assert_eq!(Micros(12_345_001).to_cents(), Cents(1235));
        assert_eq!(Micros(-12_345_000).to_cents(), Cents(-1234));
    }

    #[test]
    fn cost_of_duration_by_hand() {
        // $12.29/h for 45 min: 12.29 × 0.75 = 9.2175 exactly.
        assert_eq!(cost_of_duration(Micros(12_290_000), 2_700_000_000), Ok(Micros(9_217_500)));
        // $1/h for 1 s: 1/3600 = 0.000277777… -> 0.000278.
        assert_eq!(cost_of_duration(Micros(1_000_000), 1_000_000), Ok(Micros(278)));
        // $0.000001/h for 30 min: 0.0000005 is a tie -> 0 (even).
        assert_eq!(cost_of_duration(Micros(1), 1_800_000_000), Ok(Micros(0)));
        // $0.000003/h for 30 min: 0.0000015 -> 0.000002.
        assert_eq!(cost_of_duration(Micros(3), 1_800_000_000), Ok(Micros(2)));
    }

    #[test]
    fn monthly_savings_by_hand() {
        // $70 saved over a 7-day window (168 h): 70 × 730 / 168 = 304.1666… -> 304.166667.
        assert_eq!(monthly_savings(Micros(70_000_000), 168 * MICROS_PER_HOUR), Ok(Micros(304_166_667)));
        assert!(monthly_savings(Micros(1), 0).is_err());
    }

    #[test]
    fn ratio_arithmetic() {
        let a = Ratio::parse_decimal("0.1").expect("a");
        let b = Ratio::parse_decimal("0.2").expect("b");
        assert_eq!(a.checked_add(b), Ratio::parse_decimal("0.3").ok());
        assert_eq!(a.checked_div(b), Some(Ratio::new(1, 2).expect("r")));
        assert_eq!(a.checked_div(Ratio::ZERO), None);
        assert_eq!(Ratio::new(2, -4), Ratio::new(-1, 2));
    }
}
