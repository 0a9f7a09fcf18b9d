//! UTC calendar arithmetic on microsecond timestamps, and the two date spellings the
//! configuration accepts (RFC 3339, or `YYYY-MM-DD` meaning midnight UTC).
//!
//! The day-count conversions are `apron-common`'s (Howard Hinnant's algorithms); the
//! cost model needs a handful of exact conversions, nothing locale-dependent.

/// Microseconds per second / hour / day.
pub const US_PER_SEC: i64 = 1_000_000;
pub const US_PER_HOUR: i64 = 3_600 * US_PER_SEC;
pub const US_PER_DAY: i64 = 24 * US_PER_HOUR;

/// Why a date or time string was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TimeError {
    #[error("{0:?} is neither RFC 3339 (2026-11-26T12:00:00Z) nor a date (2026-11-26)")]
    Unparsable(String),
    #[error("{0:?} is out of range")]
    OutOfRange(String),
}

/// Days since 1970-01-01 of a proleptic Gregorian date (the one implementation in
/// `apron-common`, with this module's month/day types).
pub fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    apron_common::days_from_civil(y, i64::from(m), i64::from(d))
}

/// (year, month, day) of a day count since 1970-01-01.
pub use apron_common::civil_from_days;

/// ISO weekday of a day count: Monday = 0 … Sunday = 6 (1970-01-01 was a Thursday).
pub fn weekday_from_days(z: i64) -> i64 {
    (z + 3).rem_euclid(7)
}

fn days_in_month(y: i64, m: u32) -> u32 {
    match m {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        _ if (y % 4 == 0 && y % 100 != 0) || y % 400 == 0 => 29,
        _ => 28,
    }
}

/// The start of the UTC hour containing `t`.
pub fn hour_floor(t: i64) -> i64 {
    t.div_euclid(US_PER_HOUR) * US_PER_HOUR
}

/// The smallest hour boundary `>= t`.
pub fn hour_ceil(t: i64) -> i64 {
    let f = hour_floor(t);
    if f == t { t } else { f.saturating_add(US_PER_HOUR) }
}

/// RFC 3339 UTC text, whole seconds unless the timestamp has a fraction (then µs).
pub fn format_rfc3339(t: i64) -> String {
    let secs = t.div_euclid(US_PER_SEC);
    let micros = t.rem_euclid(US_PER_SEC);
    let (y, m, d) = civil_from_days(secs.div_euclid(86_400));
    let sod = secs.rem_euclid(86_400);
    let hms = format!("{:02}:{:02}:{:02}", sod / 3600, (sod / 60) % 60, sod % 60);
    if micros == 0 {
        format!("{y:04}-{m:02}-{d:02}T{hms}Z")
    } else {
        format!("{y:04}-{m:02}-{d:02}T{hms}.{micros:06}Z")
    }
}

fn num(s: &str, orig: &str) -> Result<u32, TimeError> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(TimeError::Unparsable(orig.to_owned()));
    }
    s.parse().map_err(|_| TimeError::Unparsable(orig.to_owned()))
}

/// Parses `YYYY-MM-DD` (midnight UTC) or RFC 3339 (`YYYY-MM-DDTHH:MM:SS[.frac](Z|±HH:MM)`,
/// `t`/space accepted for `T`) into microseconds since the epoch. Fractions beyond
/// microseconds are refused rather than silently truncated.
pub fn parse_instant(text: &str) -> Result<i64, TimeError> {
    let s = text.trim();
    let bad = || TimeError::Unparsable(text.to_owned());
    if !s.is_ascii() || s.len() < 10 {
        return Err(bad());
    }
    let (date, rest) = s.split_at(10);
    let b = date.as_bytes();
    if b[4] != b'-' || b[7] != b'-' {
        return Err(bad());
    }
    let y = i64::from(num(&date[0..4], text)?);
    let m = num(&date[5..7], text)?;
    let d = num(&date[8..10], text)?;
    if !(1..=12).contains(&m) || d == 0 || d > days_in_month(y, m) {
        return Err(TimeError::OutOfRange(text.to_owned()));
    }
    let days = days_from_civil(y, m, d);
    if rest.is_empty() {
        return Ok(days * US_PER_DAY);
    }
    let rest = match rest.as_bytes()[0] {
        b'T' | b't' | b' ' => &rest[1..],
        _ => return Err(bad()),
    };
    if rest.len() < 8 || rest.as_bytes()[2] != b':' || rest.as_bytes()[5] != b':' {
        return Err(bad());
    }
    let hh = num(&rest[0..2], text)?;
    let mm = num(&rest[3..5], text)?;
    let ss = num(&rest[6..8], text)?;
    if hh > 23 || mm > 59 || ss > 59 {
        return Err(TimeError::OutOfRange(text.to_owned()));
    }
    let mut tail = &rest[8..];
    let mut frac_us: i64 = 0;
    if let Some(f) = tail.strip_prefix('.') {
        let digits = f.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 || digits > 6 {
            return Err(bad());
        }
        frac_us = i64::from(num(&f[..digits], text)?) * 10i64.pow(6 - digits as u32);
        tail = &f[digits..];
    }
    let offset_s: i64 = match tail {
        "Z" | "z" => 0,
        _ if tail.len() == 6 && (tail.starts_with('+') || tail.starts_with('-')) && &tail[3..4] == ":" => {
            let oh = i64::from(num(&tail[1..3], text)?);
            let om = i64::from(num(&tail[4..6], text)?);
            if oh > 23 || om > 59 {
                return Err(TimeError::OutOfRange(text.to_owned()));
            }
            let o = oh * 3600 + om * 60;
            if tail.starts_with('-') { -o } else { o }
        }
        _ => return Err(bad()),
    };
    let secs = days * 86_400 + i64::from(hh) * 3600 + i64::from(mm) * 60 + i64::from(ss) - offset_s;
    secs.checked_mul(US_PER_SEC)
        .and_then(|v| v.checked_add(frac_us))
        .ok_or_else(|| TimeError::OutOfRange(text.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_dates() {
        // 2026-11-23 is a Monday (checked with `date -u -d 2026-11-23 +%A`).
        let z = days_from_civil(2026, 11, 23);
        assert_eq!(civil_from_days(z), (2026, 11, 23));
        assert_eq!(weekday_from_days(z), 0);
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        // 1_795_437_296 s = 2026-11-23T12:34:56Z (`date -u -d @1795437296`).
        assert_eq!(parse_instant("2026-11-23T12:34:56Z"), Ok(1_795_437_296_000_000));
        assert_eq!(parse_instant("2026-11-23T13:34:56.5+01:00"), Ok(1_795_437_296_500_000));
        assert_eq!(parse_instant("2026-11-23"), Ok(1_795_392_000_000_000));
        assert_eq!(format_rfc3339(1_795_437_296_000_000), "2026-11-23T12:34:56Z");
        assert_eq!(format_rfc3339(1_795_437_296_500_000), "2026-11-23T12:34:56.500000Z");
    }

    #[test]
    fn refuses_bad_text() {
        for bad in [
            "",
            "2026-13-01",
            "2026-02-29",
            "2026-11-23T24:00:00Z",
            "2026-11-23T12:00:00",
            "yesterday",
            "2026-11-23T12:00:00.1234567Z",
            "2026-11-23T12:00Z",
            "２０２６-11-23",
        ] {
            assert!(parse_instant(bad).is_err(), "{bad:?}");
        }
        assert!(parse_instant("2024-02-29").is_ok());
    }

    #[test]
    fn hour_rounding() {
        assert_eq!(hour_floor(US_PER_HOUR + 1), US_PER_HOUR);
        assert_eq!(hour_ceil(US_PER_HOUR + 1), 2 * US_PER_HOUR);
        assert_eq!(hour_ceil(US_PER_HOUR), US_PER_HOUR);
        assert_eq!(hour_floor(-1), -US_PER_HOUR);
    }
}
