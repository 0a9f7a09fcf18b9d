//! Bound parameter values (the extended protocol's Bind) into the scalars DataFusion
//! substitutes for `$1 … $n`.
//!
//! Each value is first read as what the client says it is — the type it declared at
//! Parse, or, when it declared none (oid 0), the type Describe told it (the type the
//! plan infers from the parameter's place, e.g. the column it is compared with), or
//! text — and then meets the type its place wants:
//!
//! * where the value is exactly representable in that type (a float8 `0.5` against a
//!   `numeric(5,4)` column is `0.5000`; an int4 `3` against a bigint is `3`), it is bound
//!   in that type;
//! * otherwise it is bound in its own, exact type and DataFusion coerces the comparison
//!   to a type that holds both, just as for the same literal written in the query: a
//!   float8 `0.12345` against `numeric(5,4)` is the decimal `0.12345` (the float's
//!   shortest round-trip digits, never rounded to the column's scale), an int8 larger
//!   than an `integer` column compares as bigint, a float `2.5` against an integer column
//!   compares as double precision;
//! * a numeric against a double precision column is read as the nearest double, as
//!   PostgreSQL converts numeric to float8;
//! * text (psycopg's strings, JDBC's `setString`, any value in text format the client
//!   did not type) is read as a value of the type its place wants: a number, a boolean
//!   (`t`/`true`/`yes`/`on`/`1` …) or a timestamp (ISO 8601, offset optional: UTC).
//!
//! What cannot be read or held says so with PostgreSQL's SQLSTATE: 22P02 (not a number
//! or boolean), 22007 (not a timestamp), 22003 (a number beyond numeric's 38 digits, or
//! NaN/Infinity against a numeric or integer column), 22008 (a timestamp out of range),
//! 22P03 (malformed binary value). Types this module does not read (date, time,
//! interval, bytea, arrays, …) are arrow-pg's.

use std::str::FromStr;
use std::sync::Arc;

use datafusion::arrow::array::timezone::Tz;
use datafusion::arrow::compute::kernels::cast_utils::string_to_datetime;
use datafusion::arrow::datatypes::{DataType, TimeUnit};
use datafusion::common::ParamValues;
use datafusion::scalar::ScalarValue;
use pgwire::api::Type;
use pgwire::api::portal::Portal;
use pgwire::api::stmt::StoredStatement;
use pgwire::error::{ErrorInfo, PgWireError, PgWireResult};
use pgwire::messages::extendedquery::Bind;

/// Decimal128's most digits.
const MAX_DIGITS: u32 = 38;
/// Seconds from the Unix epoch to PostgreSQL's (2000-01-01).
const PG_EPOCH_S: i64 = 946_684_800;

/// The values of `portal`'s parameters, `inferred[i]` being the type the plan wants for
/// `$i+1` (`None`: it does not say).
pub(super) fn deserialize<S: Clone>(portal: &Portal<S>, inferred: &[Option<&DataType>]) -> PgWireResult<ParamValues> {
    let mut values = Vec::with_capacity(portal.parameters.len());
    for (i, raw) in portal.parameters.iter().enumerate() {
        let target = inferred.get(i).copied().flatten();
        let declared = portal.statement.parameter_types.get(i).cloned().flatten();
        let binary = portal.parameter_format.is_binary(i);
        // What the bytes are: as declared; untyped binary as Describe said; untyped
        // text is text (read below as whatever the place wants, as PostgreSQL does).
        let wire = match declared {
            Some(t) => t,
            None if binary => match target {
                Some(t) => arrow_pg::datatypes::into_pg_type(t).unwrap_or(Type::UNKNOWN),
                None => Type::UNKNOWN,
            },
            None => Type::UNKNOWN,
        };
        let p = Param { n: i + 1, target };
        let value = match raw {
            None => Some(Value::Null(wire.clone())),
            Some(bytes) => decode(&p, &wire, binary, bytes)?,
        };
        let scalar = match value {
            Some(v) => p.bind(v)?,
            None => fallback(portal, i, target)?,
        };
        values.push(scalar);
    }
    Ok(ParamValues::from(values))
}

/// A parameter of another type: arrow-pg reads it, alone.
fn fallback<S: Clone>(portal: &Portal<S>, i: usize, target: Option<&DataType>) -> PgWireResult<ScalarValue> {
    let statement = Arc::new(StoredStatement::new(
        portal.statement.id.clone(),
        portal.statement.statement.clone(),
        vec![portal.statement.parameter_types.get(i).cloned().flatten()],
    ));
    let format = i16::from(portal.parameter_format.is_binary(i));
    let bind = Bind::new(None, None, vec![format], vec![portal.parameters[i].clone()], Vec::new());
    let one = Portal::try_new(&bind, statement)?;
    match arrow_pg::datatypes::df::deserialize_parameters(&one, &[target])? {
        ParamValues::List(mut v) if v.len() == 1 => Ok(v.remove(0).into_inner().0),
        _ => Err(PgWireError::ParameterIndexOutOfBound(i)),
    }
}

/// A value as the client sent it.
#[derive(Debug, Clone, PartialEq)]
enum Value {
    /// NULL, with the type it was sent as.
    Null(Type),
    Bool(bool),
    Int(i64),
    Float(f64),
    Dec(Dec),
    Text(String),
    /// Microseconds since the Unix epoch; `true`: an instant (timestamptz), `false`: a
    /// wall-clock time (timestamp), read in the session's time zone, UTC.
    Ts(i64, bool),
}

/// An exact decimal: `m / 10^scale`, without trailing fractional zeros, at most 38
/// digits and 38 decimal places.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Dec {
    m: i128,
    scale: u32,
}

impl Dec {
    fn digits(&self) -> u32 {
        digits(self.m)
    }

    /// The smallest Decimal128 holding it.
    fn scalar(self) -> ScalarValue {
        let p = self.digits().max(self.scale).max(1);
        ScalarValue::Decimal128(Some(self.m), p as u8, self.scale as i8)
    }

    /// At `(p, s)` when it is exactly that.
    fn at(self, p: u8, s: i8) -> Option<i128> {
        let s = u32::try_from(s).ok()?;
        let m = self.m.checked_mul(10i128.checked_pow(s.checked_sub(self.scale)?)?)?;
        (digits(m) <= u32::from(p)).then_some(m)
    }

    /// An integer when it is one.
    fn int(self) -> Option<i64> {
        if self.scale == 0 { i64::try_from(self.m).ok() } else { None }
    }

    fn to_f64(self) -> f64 {
        // Both exact below 2^53 and 10^22; otherwise through the digits, correctly rounded.
        if self.m.unsigned_abs() < (1 << 53) && self.scale <= 22 {
            self.m as f64 / 10f64.powi(self.scale as i32)
        } else {
            format!("{}e-{}", self.m, self.scale).parse().unwrap_or(f64::NAN)
        }
    }
}

fn digits(m: i128) -> u32 {
    m.unsigned_abs().checked_ilog10().map_or(1, |d| d + 1)
}

/// Why a number's text is not a [`Dec`].
#[derive(Debug, PartialEq)]
enum NumberError {
    Syntax,
    /// More digits or places than numeric holds here.
    Range,
}

/// A decimal number's text (`-12.5`, `1e-3`, `.5`): its sign, its significant digits
/// (no leading zeros, no trailing zeros after the point) and its scale; `None`: not a
/// number.
fn parts(s: &str) -> Option<(bool, String, i64)> {
    let s = s.trim();
    let (negative, s) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    let (mantissa, exponent) = match s.find(['e', 'E']) {
        Some(at) => (&s[..at], Some(&s[at + 1..])),
        None => (s, None),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    if int.is_empty() && frac.is_empty() || !int.bytes().chain(frac.bytes()).all(|b| b.is_ascii_digit()) {
        return None;
    }
    let exponent: i64 = match exponent {
        Some(e) => e.parse().ok()?,
        None => 0,
    };
    let mut significant = format!("{int}{frac}").trim_start_matches('0').to_owned();
    let mut scale = i64::try_from(frac.len()).ok()?.checked_sub(exponent)?;
    // Canonical: no trailing zeros at all (the scale may go below 0: 1e3 is 1, -3).
    while significant.ends_with('0') {
        significant.pop();
        scale -= 1;
    }
    if significant.is_empty() {
        return Some((false, String::new(), 0));
    }
    Some((negative, significant, scale))
}

/// A numeric parameter's text. One of more than 17 significant digits that is exactly
/// a double's binary expansion — asyncpg sends a Python float so, `0.07` as
/// 0.07000000000000000666… — is read as that double's shortest digits: the float the
/// client was given, as psycopg and JDBC send it.
fn numeric_decimal(s: &str) -> Result<Dec, NumberError> {
    if let Some(p) = parts(s)
        && p.1.len() > 17
        && let Ok(f) = s.trim().parse::<f64>()
        && f.is_finite()
        && parts(&format!("{f:.1100}")).as_ref() == Some(&p)
    {
        return float_decimal(f);
    }
    parse_decimal(s)
}

/// A decimal number's text: exact.
fn parse_decimal(s: &str) -> Result<Dec, NumberError> {
    let (negative, mut significant, mut scale) = parts(s).ok_or(NumberError::Syntax)?;
    if significant.is_empty() {
        return Ok(Dec { m: 0, scale: 0 });
    }
    if scale < 0 {
        if significant.len() as i64 - scale > i64::from(MAX_DIGITS) {
            return Err(NumberError::Range);
        }
        significant.extend(std::iter::repeat_n('0', (-scale) as usize));
        scale = 0;
    }
    if significant.len() > MAX_DIGITS as usize || scale > i64::from(MAX_DIGITS) {
        // More digits than Decimal128 holds (asyncpg sends a float's exact binary
        // expansion: 0.1 is 55 digits): kept to 36 places past the integer digits, and
        // a 5 after them where anything non-zero was dropped. That orders exactly as the
        // value itself against every decimal of fewer places (any column's), so
        // comparisons stay exact; only the integer digits can be too many.
        let int_digits = (significant.len() as i64 - scale).max(0);
        if int_digits > i64::from(MAX_DIGITS) - 2 {
            return Err(NumberError::Range);
        }
        let keep_scale = i64::from(MAX_DIGITS) - 2 - int_digits;
        let drop = (scale - keep_scale) as usize;
        let rest = significant.split_off(significant.len().saturating_sub(drop));
        scale = keep_scale;
        if rest.bytes().any(|b| b != b'0') {
            significant.push('5');
            scale += 1;
        }
        while scale > 0 && significant.ends_with('0') {
            significant.pop();
            scale -= 1;
        }
        if significant.is_empty() {
            return Ok(Dec { m: 0, scale: 0 });
        }
    }
    let m: i128 = significant.parse().map_err(|_| NumberError::Range)?;
    Ok(Dec { m: if negative { -m } else { m }, scale: scale as u32 })
}

/// A float's exact value as the decimal its shortest round-trip digits say (`0.1` is
/// 0.1, not 0.1000000000000000055…): what the client meant.
fn float_decimal(f: f64) -> Result<Dec, NumberError> {
    parse_decimal(&format!("{f:e}"))
}

/// PostgreSQL's boolean input.
fn parse_bool(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "t" | "true" | "y" | "yes" | "on" | "1" => Some(true),
        "f" | "false" | "n" | "no" | "off" | "0" => Some(false),
        _ => None,
    }
}

/// A timestamp's text, µs since the epoch: ISO 8601 with `T` or a space, an offset
/// (`Z`, `+01`, `+01:00`) or none (UTC, the session's time zone), or a bare date.
fn parse_timestamp(s: &str) -> Option<i64> {
    let utc = Tz::from_str("+00:00").ok()?;
    let t = string_to_datetime(&utc, s.trim()).ok()?;
    t.timestamp_micros().into()
}

/// A parameter's number and the type its place wants.
struct Param<'a> {
    n: usize,
    target: Option<&'a DataType>,
}

fn error(code: &str, message: String) -> PgWireError {
    PgWireError::UserError(Box::new(ErrorInfo::new("ERROR".to_owned(), code.to_owned(), message)))
}

/// A column type in PostgreSQL's words, for messages.
fn pg_name(t: &DataType) -> String {
    match t {
        DataType::Decimal128(p, s) => format!("numeric({p},{s})"),
        DataType::Int16 => "smallint".into(),
        DataType::Int32 => "integer".into(),
        DataType::Int64 => "bigint".into(),
        DataType::Float32 => "real".into(),
        DataType::Float64 => "double precision".into(),
        DataType::Boolean => "boolean".into(),
        DataType::Timestamp(_, Some(_)) => "timestamp with time zone".into(),
        DataType::Timestamp(_, None) => "timestamp".into(),
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => "text".into(),
        other => other.to_string(),
    }
}

fn is_numeric(t: &DataType) -> bool {
    t.is_numeric()
}

impl Param<'_> {
    fn malformed(&self, wire: &Type) -> PgWireError {
        error("22P03", format!("incorrect binary data format in bind parameter ${} ({})", self.n, wire.name()))
    }

    fn syntax(&self, what: &str, text: &str) -> PgWireError {
        let shown: String = text.chars().take(64).collect();
        error("22P02", format!("invalid input syntax for type {what}: \"{shown}\" (parameter ${})", self.n))
    }

    fn out_of_range(&self, what: &str) -> PgWireError {
        let against = self.target.map_or_else(String::new, |t| format!(" for comparison with {}", pg_name(t)));
        error("22003", format!("parameter ${}: {what} is out of range{against}", self.n))
    }

    fn timestamp_out_of_range(&self) -> PgWireError {
        error("22008", format!("parameter ${}: timestamp out of range", self.n))
    }

    fn number_error(&self, e: NumberError, text: &str) -> PgWireError {
        match e {
            NumberError::Syntax => self.syntax("numeric", text),
            NumberError::Range => {
                self.out_of_range(&format!("{} (numeric holds at most {MAX_DIGITS} digits here)", short(text)))
            }
        }
    }

    /// The value bound where the plan wants `self.target`.
    fn bind(&self, value: Value) -> PgWireResult<ScalarValue> {
        let Some(target) = self.target else { return self.natural(value) };
        match value {
            Value::Null(_) => ScalarValue::try_from(target).or_else(|_| Ok(ScalarValue::Null)),
            Value::Bool(b) => Ok(ScalarValue::Boolean(Some(b))),
            Value::Int(n) => self.int(n, target),
            Value::Float(f) => self.float(f, target),
            Value::Dec(d) => self.decimal(d, target),
            Value::Ts(us, instant) => self.timestamp(us, instant, target),
            Value::Text(s) => self.text(s, target),
        }
    }

    /// The value in its own type (nothing says what its place wants).
    fn natural(&self, value: Value) -> PgWireResult<ScalarValue> {
        Ok(match value {
            Value::Null(t) => match t {
                Type::BOOL => ScalarValue::Boolean(None),
                Type::INT2 => ScalarValue::Int16(None),
                Type::INT4 => ScalarValue::Int32(None),
                Type::INT8 => ScalarValue::Int64(None),
                Type::FLOAT4 => ScalarValue::Float32(None),
                Type::FLOAT8 => ScalarValue::Float64(None),
                Type::NUMERIC => ScalarValue::Decimal128(None, MAX_DIGITS as u8, 10),
                Type::TIMESTAMPTZ => ScalarValue::TimestampMicrosecond(None, Some("UTC".into())),
                Type::TIMESTAMP => ScalarValue::TimestampMicrosecond(None, None),
                _ => ScalarValue::Utf8(None),
            },
            Value::Bool(b) => ScalarValue::Boolean(Some(b)),
            Value::Int(n) => ScalarValue::Int64(Some(n)),
            Value::Float(f) => ScalarValue::Float64(Some(f)),
            Value::Dec(d) => d.scalar(),
            Value::Ts(us, true) => ScalarValue::TimestampMicrosecond(Some(us), Some("UTC".into())),
            Value::Ts(us, false) => ScalarValue::TimestampMicrosecond(Some(us), None),
            Value::Text(s) => ScalarValue::Utf8(Some(s)),
        })
    }

    fn int(&self, n: i64, target: &DataType) -> PgWireResult<ScalarValue> {
        let exact = match target {
            DataType::Int8 => i8::try_from(n).ok().map(|v| ScalarValue::Int8(Some(v))),
            DataType::Int16 => i16::try_from(n).ok().map(|v| ScalarValue::Int16(Some(v))),
            DataType::Int32 => i32::try_from(n).ok().map(|v| ScalarValue::Int32(Some(v))),
            DataType::Int64 => Some(ScalarValue::Int64(Some(n))),
            DataType::UInt8 => u8::try_from(n).ok().map(|v| ScalarValue::UInt8(Some(v))),
            DataType::UInt16 => u16::try_from(n).ok().map(|v| ScalarValue::UInt16(Some(v))),
            DataType::UInt32 => u32::try_from(n).ok().map(|v| ScalarValue::UInt32(Some(v))),
            DataType::UInt64 => u64::try_from(n).ok().map(|v| ScalarValue::UInt64(Some(v))),
            DataType::Float32 if n.unsigned_abs() <= 1 << 24 => Some(ScalarValue::Float32(Some(n as f32))),
            DataType::Float64 if n.unsigned_abs() <= 1 << 53 => Some(ScalarValue::Float64(Some(n as f64))),
            DataType::Decimal128(p, s) => {
                Dec { m: i128::from(n), scale: 0 }.at(*p, *s).map(|m| ScalarValue::Decimal128(Some(m), *p, *s))
            }
            // An integer where a timestamp goes: seconds since the epoch.
            DataType::Timestamp(unit, tz) => {
                let v = match unit {
                    TimeUnit::Second => Some(n),
                    TimeUnit::Millisecond => n.checked_mul(1_000),
                    TimeUnit::Microsecond => n.checked_mul(1_000_000),
                    TimeUnit::Nanosecond => n.checked_mul(1_000_000_000),
                };
                let v = v.ok_or_else(|| self.timestamp_out_of_range())?;
                Some(timestamp_scalar(v, unit, tz.clone()))
            }
            _ => None,
        };
        Ok(exact.unwrap_or(ScalarValue::Int64(Some(n))))
    }

    fn float(&self, f: f64, target: &DataType) -> PgWireResult<ScalarValue> {
        match target {
            DataType::Float64 => return Ok(ScalarValue::Float64(Some(f))),
            DataType::Float32 if f64::from(f as f32) == f || !f.is_finite() => {
                return Ok(ScalarValue::Float32(Some(f as f32)));
            }
            t if is_numeric(t) => {}
            _ => return Ok(ScalarValue::Float64(Some(f))),
        }
        if !f.is_finite() {
            return Err(self.out_of_range(&f.to_string()));
        }
        if matches!(target, DataType::Float32) {
            return Ok(ScalarValue::Float64(Some(f)));
        }
        let d = float_decimal(f).map_err(|e| self.number_error(e, &f.to_string()))?;
        if target.is_integer() {
            // Integral: as that integer; otherwise compared as double precision.
            return match d.int() {
                Some(n) => self.int(n, target),
                None => Ok(ScalarValue::Float64(Some(f))),
            };
        }
        self.decimal(d, target)
    }

    fn decimal(&self, d: Dec, target: &DataType) -> PgWireResult<ScalarValue> {
        Ok(match target {
            DataType::Decimal128(p, s) => match d.at(*p, *s) {
                Some(m) => ScalarValue::Decimal128(Some(m), *p, *s),
                None => d.scalar(),
            },
            // numeric → float8, as PostgreSQL converts it: the nearest double.
            DataType::Float64 => ScalarValue::Float64(Some(d.to_f64())),
            t if t.is_integer() => match d.int() {
                Some(n) => match self.int(n, t)? {
                    ScalarValue::Int64(_) if *t != DataType::Int64 => d.scalar(),
                    exact => exact,
                },
                None => d.scalar(),
            },
            _ => d.scalar(),
        })
    }

    fn timestamp(&self, us: i64, instant: bool, target: &DataType) -> PgWireResult<ScalarValue> {
        let DataType::Timestamp(unit, tz) = target else { return self.natural(Value::Ts(us, instant)) };
        let v = match unit {
            TimeUnit::Microsecond => Some(us),
            TimeUnit::Nanosecond => Some(us.checked_mul(1_000).ok_or_else(|| self.timestamp_out_of_range())?),
            TimeUnit::Millisecond => (us % 1_000 == 0).then_some(us / 1_000),
            TimeUnit::Second => (us % 1_000_000 == 0).then_some(us / 1_000_000),
        };
        Ok(match v {
            Some(v) => timestamp_scalar(v, unit, tz.clone()),
            // Finer than the column: compared at microseconds.
            None => ScalarValue::TimestampMicrosecond(Some(us), tz.clone()),
        })
    }

    /// Text where `target` goes: read as a value of that type.
    fn text(&self, s: String, target: &DataType) -> PgWireResult<ScalarValue> {
        match target {
            DataType::Utf8View => Ok(ScalarValue::Utf8View(Some(s))),
            DataType::LargeUtf8 => Ok(ScalarValue::LargeUtf8(Some(s))),
            DataType::Utf8 => Ok(ScalarValue::Utf8(Some(s))),
            DataType::Boolean => match parse_bool(&s) {
                Some(b) => Ok(ScalarValue::Boolean(Some(b))),
                None => Err(self.syntax("boolean", &s)),
            },
            DataType::Float32 | DataType::Float64 => match s.trim().parse::<f64>() {
                Ok(f) => self.float(f, target),
                Err(_) => Err(self.syntax("double precision", &s)),
            },
            t if is_numeric(t) => match parse_decimal(&s) {
                Ok(d) => self.decimal(d, t),
                // NaN and Infinity are floats; numeric and integer columns hold neither.
                Err(NumberError::Syntax) if s.trim().parse::<f64>().is_ok() => Err(self.out_of_range(s.trim())),
                Err(e) => Err(self.number_error(e, &s)),
            },
            DataType::Timestamp(..) => match parse_timestamp(&s) {
                Some(us) => self.timestamp(us, true, target),
                None => Err(error(
                    "22007",
                    format!(
                        "invalid input syntax for type timestamp with time zone: \"{}\" (parameter ${})",
                        short(&s),
                        self.n
                    ),
                )),
            },
            // Dates, intervals, …: DataFusion casts the text as for a literal.
            _ => Ok(ScalarValue::Utf8(Some(s))),
        }
    }
}

fn short(s: &str) -> String {
    s.trim().chars().take(64).collect()
}

fn timestamp_scalar(v: i64, unit: &TimeUnit, tz: Option<Arc<str>>) -> ScalarValue {
    match unit {
        TimeUnit::Second => ScalarValue::TimestampSecond(Some(v), tz),
        TimeUnit::Millisecond => ScalarValue::TimestampMillisecond(Some(v), tz),
        TimeUnit::Microsecond => ScalarValue::TimestampMicrosecond(Some(v), tz),
        TimeUnit::Nanosecond => ScalarValue::TimestampNanosecond(Some(v), tz),
    }
}

/// Reads a non-NULL value sent as `wire`; `None`: a type left to arrow-pg.
fn decode(p: &Param<'_>, wire: &Type, binary: bool, bytes: &[u8]) -> PgWireResult<Option<Value>> {
    let text = || std::str::from_utf8(bytes).map_err(|_| p.malformed(wire));
    let fixed = |n: usize| -> PgWireResult<&[u8]> { if bytes.len() == n { Ok(bytes) } else { Err(p.malformed(wire)) } };
    Ok(Some(match (wire, binary) {
        (&Type::BOOL, true) => Value::Bool(fixed(1)?[0] != 0),
        (&Type::BOOL, false) => {
            Value::Bool(parse_bool(text()?).ok_or_else(|| p.syntax("boolean", text().unwrap_or("")))?)
        }
        (&Type::INT2, true) => Value::Int(i64::from(i16::from_be_bytes(fixed(2)?.try_into().expect("2 bytes")))),
        (&Type::INT4, true) => Value::Int(i64::from(i32::from_be_bytes(fixed(4)?.try_into().expect("4 bytes")))),
        (&Type::INT8, true) => Value::Int(i64::from_be_bytes(fixed(8)?.try_into().expect("8 bytes"))),
        (&Type::INT2 | &Type::INT4 | &Type::INT8, false) => {
            let s = text()?;
            match s.trim().parse::<i64>() {
                Ok(n) => Value::Int(n),
                Err(_) => match parse_decimal(s) {
                    Ok(_) => return Err(p.out_of_range(&format!("integer {}", short(s)))),
                    Err(_) => return Err(p.syntax("integer", s)),
                },
            }
        }
        (&Type::FLOAT4, true) => Value::Float(f64::from(f32::from_be_bytes(fixed(4)?.try_into().expect("4 bytes")))),
        (&Type::FLOAT8, true) => Value::Float(f64::from_be_bytes(fixed(8)?.try_into().expect("8 bytes"))),
        (&Type::FLOAT4 | &Type::FLOAT8, false) => {
            let s = text()?;
            Value::Float(s.trim().parse().map_err(|_| p.syntax("double precision", s))?)
        }
        (&Type::NUMERIC, true) => numeric_binary(p, bytes)?,
        (&Type::NUMERIC, false) => {
            let s = text()?;
            match numeric_decimal(s) {
                Ok(d) => Value::Dec(d),
                Err(NumberError::Syntax) => match s.trim().parse::<f64>() {
                    Ok(f) if !f.is_finite() => Value::Float(f),
                    _ => return Err(p.syntax("numeric", s)),
                },
                Err(e) => return Err(p.number_error(e, s)),
            }
        }
        (&Type::TIMESTAMP | &Type::TIMESTAMPTZ, true) => {
            let v = i64::from_be_bytes(fixed(8)?.try_into().expect("8 bytes"));
            if v == i64::MAX || v == i64::MIN {
                return Err(p.timestamp_out_of_range());
            }
            let us = v.checked_add(PG_EPOCH_S * 1_000_000).ok_or_else(|| p.timestamp_out_of_range())?;
            Value::Ts(us, *wire == Type::TIMESTAMPTZ)
        }
        (&Type::TIMESTAMP | &Type::TIMESTAMPTZ, false) => {
            let s = text()?;
            match parse_timestamp(s) {
                Some(us) => Value::Ts(us, *wire == Type::TIMESTAMPTZ),
                None => {
                    return Err(error(
                        "22007",
                        format!("invalid input syntax for type {}: \"{}\" (parameter ${})", wire.name(), short(s), p.n),
                    ));
                }
            }
        }
        (&Type::TEXT | &Type::VARCHAR | &Type::BPCHAR | &Type::NAME | &Type::UNKNOWN, _) => {
            Value::Text(text()?.to_owned())
        }
        _ => return Ok(None),
    }))
}

/// PostgreSQL's binary numeric: ndigits, weight, sign, dscale, then base-10000 digits.
fn numeric_binary(p: &Param<'_>, b: &[u8]) -> PgWireResult<Value> {
    let bad = || p.malformed(&Type::NUMERIC);
    let word = |i: usize| b.get(2 * i..2 * i + 2).map(|w| u16::from_be_bytes([w[0], w[1]])).ok_or_else(bad);
    let (ndigits, weight, sign, dscale) = (word(0)? as usize, word(1)? as i16, word(2)?, word(3)?);
    if b.len() != 8 + 2 * ndigits {
        return Err(bad());
    }
    match sign {
        0x0000 | 0x4000 => {}
        0xC000 => return Ok(Value::Float(f64::NAN)),
        0xD000 => return Ok(Value::Float(f64::INFINITY)),
        0xF000 => return Ok(Value::Float(f64::NEG_INFINITY)),
        _ => return Err(bad()),
    }
    // The digits as text, then read exactly as any numeric text.
    let mut s = String::with_capacity(4 * ndigits + 8);
    let mut groups = Vec::with_capacity(ndigits);
    for i in 0..ndigits {
        let d = word(4 + i)?;
        if d > 9999 {
            return Err(bad());
        }
        groups.push(d);
    }
    for g in &groups {
        s.push_str(&format!("{g:04}"));
    }
    // value = 0.<groups> × 10000^(weight + 1)
    let exponent = 4 * (i64::from(weight) + 1);
    let text = format!("{}0.{}e{exponent}", if sign == 0x4000 { "-" } else { "" }, if s.is_empty() { "0" } else { &s });
    let _ = dscale;
    numeric_decimal(&text).map(Value::Dec).map_err(|e| p.number_error(e, &text))
}

#[cfg(test)]
mod tests {
    use super::*;
    use pgwire::api::portal::Portal;

    fn dec(s: &str) -> Dec {
        parse_decimal(s).unwrap_or_else(|e| panic!("{s}: {e:?}"))
    }

    #[test]
    fn decimals_are_read_exactly() {
        assert_eq!(dec("0.5"), Dec { m: 5, scale: 1 });
        assert_eq!(dec("0.50000"), Dec { m: 5, scale: 1 });
        assert_eq!(dec("-12.25"), Dec { m: -1225, scale: 2 });
        assert_eq!(dec("1e3"), Dec { m: 1000, scale: 0 });
        assert_eq!(dec(".5e-2"), Dec { m: 5, scale: 3 });
        assert_eq!(dec("000"), Dec { m: 0, scale: 0 });
        assert_eq!(parse_decimal("abc"), Err(NumberError::Syntax));
        assert_eq!(parse_decimal("1.2.3"), Err(NumberError::Syntax));
        assert_eq!(parse_decimal(""), Err(NumberError::Syntax));
        assert_eq!(parse_decimal("1e300"), Err(NumberError::Range));
        // Past 38 digits: an order-preserving 5 after 36 places.
        assert_eq!(dec("1e-300"), Dec { m: 5, scale: 37 });
        assert_eq!(
            dec("0.1000000000000000055511151231257827021181583404541015625"),
            Dec { m: 1_000_000_000_000_000_055_511_151_231_257_827_025, scale: 37 }
        );
        assert_eq!(dec("0.5000000000000000000000000000000000000000000"), Dec { m: 5, scale: 1 });
        // A double's exact expansion as numeric (asyncpg's floats): the double's digits.
        assert_eq!(
            numeric_decimal("0.070000000000000006661338147750939242541790008544921875"),
            Ok(Dec { m: 7, scale: 2 })
        );
        assert_eq!(
            numeric_decimal("0.1000000000000000055511151231257827021181583404541015625"),
            Ok(Dec { m: 1, scale: 1 })
        );
        assert_eq!(numeric_decimal("0.07000000000000000666"), Ok(Dec { m: 7_000_000_000_000_000_666, scale: 20 }));
        assert_eq!(parse_decimal("1e38"), Err(NumberError::Range));
        assert_eq!(float_decimal(0.1), Ok(Dec { m: 1, scale: 1 }));
        assert_eq!(float_decimal(0.12345), Ok(Dec { m: 12345, scale: 5 }));
        assert_eq!(float_decimal(300.123), Ok(Dec { m: 300123, scale: 3 }));
        assert_eq!(float_decimal(-0.0), Ok(Dec { m: 0, scale: 0 }));
    }

    fn bind(v: Value, target: &DataType) -> PgWireResult<ScalarValue> {
        Param { n: 1, target: Some(target) }.bind(v)
    }

    fn code(r: PgWireResult<ScalarValue>) -> String {
        match r {
            Err(PgWireError::UserError(e)) => e.code.clone(),
            other => panic!("{other:?}"),
        }
    }

    const UTIL: DataType = DataType::Decimal128(5, 4);
    const WATTS: DataType = DataType::Decimal128(9, 3);

    #[test]
    fn floats_bind_against_decimal_columns_exactly() {
        assert_eq!(bind(Value::Float(0.5), &UTIL).ok(), Some(ScalarValue::Decimal128(Some(5000), 5, 4)));
        assert_eq!(bind(Value::Float(300.125), &WATTS).ok(), Some(ScalarValue::Decimal128(Some(300125), 9, 3)));
        // Finer than the column: the float's own digits, never rounded to 0.1235.
        assert_eq!(bind(Value::Float(0.12345), &UTIL).ok(), Some(ScalarValue::Decimal128(Some(12345), 5, 5)));
        // Larger than the column holds: still compared, as a wider decimal.
        assert_eq!(bind(Value::Float(1e20), &UTIL).ok(), Some(ScalarValue::Decimal128(Some(10i128.pow(20)), 21, 0)));
        assert_eq!(code(bind(Value::Float(1e300), &UTIL)), "22003");
        assert_eq!(code(bind(Value::Float(f64::NAN), &UTIL)), "22003");
        assert_eq!(code(bind(Value::Float(f64::INFINITY), &DataType::Int64)), "22003");
        assert_eq!(
            bind(Value::Float(f64::INFINITY), &DataType::Float64).ok(),
            Some(ScalarValue::Float64(Some(f64::INFINITY)))
        );
    }

    #[test]
    fn numbers_meet_integer_and_float_columns() {
        assert_eq!(bind(Value::Int(3), &DataType::Int32).ok(), Some(ScalarValue::Int32(Some(3))));
        assert_eq!(bind(Value::Int(1 << 40), &DataType::Int32).ok(), Some(ScalarValue::Int64(Some(1 << 40))));
        assert_eq!(bind(Value::Int(1), &UTIL).ok(), Some(ScalarValue::Decimal128(Some(10000), 5, 4)));
        assert_eq!(bind(Value::Int(100), &UTIL).ok(), Some(ScalarValue::Int64(Some(100))));
        assert_eq!(bind(Value::Float(2.0), &DataType::Int32).ok(), Some(ScalarValue::Int32(Some(2))));
        assert_eq!(bind(Value::Float(2.5), &DataType::Int32).ok(), Some(ScalarValue::Float64(Some(2.5))));
        assert_eq!(bind(Value::Dec(dec("2.5")), &DataType::Int64).ok(), Some(ScalarValue::Decimal128(Some(25), 2, 1)));
        assert_eq!(bind(Value::Dec(dec("7")), &DataType::Int32).ok(), Some(ScalarValue::Int32(Some(7))));
        assert_eq!(bind(Value::Dec(dec("0.1")), &DataType::Float64).ok(), Some(ScalarValue::Float64(Some(0.1))));
        assert_eq!(bind(Value::Dec(dec("0.55555")), &UTIL).ok(), Some(ScalarValue::Decimal128(Some(55555), 5, 5)));
        assert_eq!(bind(Value::Dec(dec("0.25")), &MONEY).ok(), Some(ScalarValue::Decimal128(Some(250_000), 18, 6)));
    }

    const MONEY: DataType = DataType::Decimal128(18, 6);

    #[test]
    fn text_is_read_as_its_place_wants() {
        let text = |s: &str| Value::Text(s.to_owned());
        assert_eq!(bind(text("0.5"), &UTIL).ok(), Some(ScalarValue::Decimal128(Some(5000), 5, 4)));
        assert_eq!(bind(text(" 42 "), &DataType::Int64).ok(), Some(ScalarValue::Int64(Some(42))));
        assert_eq!(bind(text("0.5"), &DataType::Float64).ok(), Some(ScalarValue::Float64(Some(0.5))));
        assert_eq!(bind(text("true"), &DataType::Boolean).ok(), Some(ScalarValue::Boolean(Some(true))));
        assert_eq!(bind(text("off"), &DataType::Boolean).ok(), Some(ScalarValue::Boolean(Some(false))));
        assert_eq!(bind(text("GPU-B"), &DataType::Utf8).ok(), Some(ScalarValue::Utf8(Some("GPU-B".into()))));
        let utc = DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into()));
        let t = ScalarValue::TimestampMicrosecond(Some(1_700_000_000_000_000), Some("UTC".into()));
        for s in ["2023-11-14 22:13:20+00", "2023-11-14T22:13:20Z", "2023-11-14 23:13:20+01:00", "2023-11-14 22:13:20"]
        {
            assert_eq!(bind(text(s), &utc).ok(), Some(t.clone()), "{s}");
        }
        assert_eq!(code(bind(text("half"), &UTIL)), "22P02");
        assert_eq!(code(bind(text("maybe"), &DataType::Boolean)), "22P02");
        assert_eq!(code(bind(text("NaN"), &UTIL)), "22003");
        assert_eq!(code(bind(text("1e99"), &UTIL)), "22003");
        assert_eq!(code(bind(text("yesterday"), &utc)), "22007");
        assert_eq!(
            code(bind(Value::Ts(i64::MAX / 10, true), &DataType::Timestamp(TimeUnit::Nanosecond, None))),
            "22008"
        );
    }

    fn portal(types: Vec<Option<Type>>, values: Vec<Option<&[u8]>>, binary: bool) -> Portal<()> {
        let statement = Arc::new(StoredStatement::new(String::new(), (), types));
        let values = values.into_iter().map(|v| v.map(|v| v.to_vec().into())).collect();
        Portal::try_new(&Bind::new(None, None, vec![i16::from(binary)], values, Vec::new()), statement).expect("portal")
    }

    fn values(p: ParamValues) -> Vec<ScalarValue> {
        match p {
            ParamValues::List(v) => v.into_iter().map(|v| v.into_inner().0).collect(),
            ParamValues::Map(_) => panic!("map"),
        }
    }

    #[test]
    fn wire_values_are_decoded_by_their_declared_type() {
        // psycopg 3 and JDBC's setDouble: a float8 against gpu_util, text and binary.
        let half = 0.5f64.to_be_bytes();
        for (bytes, binary) in [(&b"0.5"[..], false), (&half[..], true)] {
            let p = portal(vec![Some(Type::FLOAT8)], vec![Some(bytes)], binary);
            let v = values(deserialize(&p, &[Some(&UTIL)]).expect("binds"));
            assert_eq!(v, [ScalarValue::Decimal128(Some(5000), 5, 4)]);
        }
        // Binary numeric 300.125 (ndigits 2, weight 0, dscale 3: 0300 1250), as asyncpg
        // and setBigDecimal send it.
        let numeric = [0u8, 2, 0, 0, 0, 0, 0, 3, 0x01, 0x2c, 0x04, 0xe2];
        let p = portal(vec![Some(Type::NUMERIC)], vec![Some(&numeric)], true);
        assert_eq!(
            values(deserialize(&p, &[Some(&WATTS)]).expect("binds")),
            [ScalarValue::Decimal128(Some(300125), 9, 3)]
        );
        // -0.0001 (weight -1: 0.0001 is the group 0001 at 10000^-1).
        let tiny = [0u8, 1, 0xff, 0xff, 0x40, 0, 0, 4, 0, 1];
        let p = portal(vec![Some(Type::NUMERIC)], vec![Some(&tiny)], true);
        assert_eq!(values(deserialize(&p, &[Some(&UTIL)]).expect("binds")), [ScalarValue::Decimal128(Some(-1), 5, 4)]);
        // Untyped (oid 0) binary: as Describe said (int8 for a bigint column).
        let p = portal(vec![None], vec![Some(&7i64.to_be_bytes())], true);
        assert_eq!(values(deserialize(&p, &[Some(&DataType::Int64)]).expect("binds")), [ScalarValue::Int64(Some(7))]);
        // JDBC's setTimestamp: untyped text.
        let p = portal(vec![None], vec![Some(b"2023-11-14 22:13:20+00")], false);
        let utc = DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into()));
        assert_eq!(
            values(deserialize(&p, &[Some(&utc)]).expect("binds")),
            [ScalarValue::TimestampMicrosecond(Some(1_700_000_000_000_000), Some("UTC".into()))]
        );
        // Binary timestamptz: µs since 2000-01-01.
        let us = (1_700_000_000_000_000i64 - PG_EPOCH_S * 1_000_000).to_be_bytes();
        let p = portal(vec![Some(Type::TIMESTAMPTZ)], vec![Some(&us)], true);
        assert_eq!(
            values(deserialize(&p, &[Some(&utc)]).expect("binds")),
            [ScalarValue::TimestampMicrosecond(Some(1_700_000_000_000_000), Some("UTC".into()))]
        );
        // NULLs take the column's type; malformed binary is 22P03.
        let p = portal(vec![Some(Type::FLOAT8)], vec![None], true);
        assert_eq!(values(deserialize(&p, &[Some(&UTIL)]).expect("binds")), [ScalarValue::Decimal128(None, 5, 4)]);
        let p = portal(vec![Some(Type::FLOAT8)], vec![Some(b"abc")], true);
        assert_eq!(code(deserialize(&p, &[Some(&UTIL)]).map(|_| ScalarValue::Null)), "22P03");
        // Other types are arrow-pg's.
        let p = portal(vec![Some(Type::DATE)], vec![Some(b"2024-01-15")], false);
        assert!(matches!(values(deserialize(&p, &[None]).expect("binds"))[..], [ScalarValue::Date32(Some(_))]));
    }
}
