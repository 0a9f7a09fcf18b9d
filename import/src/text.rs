//! Prometheus text exposition (0.0.4) and OpenMetrics text, with timestamps.
//!
//! One grammar covers what the tools write:
//!
//! - a scrape or many concatenated scrapes: `name{labels} value [timestamp]`, with
//!   `# HELP`, `# TYPE`, `# UNIT` and `# EOF` lines (ignored, wherever they are);
//! - `promtool tsdb dump`: `{__name__="name", a="b"} value timestamp_ms` (the name as a
//!   label, `, ` between labels);
//! - `promtool tsdb dump-openmetrics`: `name{a="b"} value timestamp_s`, then `# EOF`;
//! - Prometheus 3's quoted UTF-8 names: `{"name", "a.b"="c"} value`.
//!
//! Timestamps are integer milliseconds in Prometheus text and seconds (with decimals) in
//! OpenMetrics; the caller says which ([`Timestamps`]). OpenMetrics exemplars
//! (` # {…} v`) after the value or timestamp are ignored.
//!
//! Lines of one series repeat the same series text, so the text up to the value is the
//! key of a per-input cache: labels are parsed and resolved once per series, and a
//! sample line costs one hash lookup and two number parses.

use std::borrow::Cow;
use std::collections::HashMap;

use crate::ImportError;
use crate::series::{Builder, SeriesRef};

/// The unit of text timestamps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Timestamps {
    /// Prometheus text 0.0.4 and `promtool tsdb dump`: integer milliseconds.
    Millis,
    /// OpenMetrics: seconds, possibly fractional.
    Seconds,
}

/// Parses `input` into `b`. On error, `b` may hold part of the input; the caller rolls
/// it back.
pub(crate) fn parse(input: &str, unit: Timestamps, b: &mut Builder) -> Result<(), ImportError> {
    let mut lines = Lines::new(unit);
    for raw in input.split('\n') {
        lines.line(raw, b)?;
    }
    Ok(())
}

/// A text input fed one line at a time (from a file read in pieces): the series cache
/// lives as long as the input, so a line costs what it does in [`parse`].
pub(crate) struct Lines {
    unit: Timestamps,
    number: usize,
    cache: HashMap<String, SeriesRef>,
}

impl Lines {
    pub(crate) fn new(unit: Timestamps) -> Self {
        Self { unit, number: 0, cache: HashMap::new() }
    }

    /// The 1-based number of the last line given.
    pub(crate) fn number(&self) -> usize {
        self.number
    }

    /// One line, without its `\n` (a trailing `\r` is dropped here).
    pub(crate) fn line(&mut self, raw: &str, b: &mut Builder) -> Result<(), ImportError> {
        self.number += 1;
        let line = raw.strip_suffix('\r').unwrap_or(raw).trim_start_matches([' ', '\t']);
        if line.is_empty() || line.starts_with('#') {
            return Ok(());
        }
        parse_sample(line, self.unit, b, &mut self.cache)
            .map_err(|Syntax(message)| ImportError::Text { line: self.number, message })
    }
}

/// What is wrong with one line of exposition text (the caller adds the line number).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
struct Syntax(String);

fn parse_sample(
    line: &str,
    unit: Timestamps,
    b: &mut Builder,
    cache: &mut HashMap<String, SeriesRef>,
) -> Result<(), Syntax> {
    let (end, has_labels) = series_end(line)?;
    let text = &line[..end];
    let series = match cache.get(text) {
        Some(&s) => s,
        None => {
            let s = resolve(text, b)?;
            cache.insert(text.to_owned(), s);
            s
        }
    };
    let rest = line[end..].trim_start_matches([' ', '\t']);
    let (value, rest) = token(rest);
    if value.is_empty() || value.starts_with('#') {
        let after = if has_labels { "the labels" } else { "the metric name" };
        return Err(Syntax(format!("expected a value after {after}")));
    }
    let value = parse_value(value).ok_or_else(|| Syntax(format!("invalid sample value {value:?}")))?;
    let (ts, rest) = token(rest.trim_start_matches([' ', '\t']));
    let t = if ts.is_empty() || ts.starts_with('#') {
        None
    } else {
        let t = match unit {
            Timestamps::Millis => ts.parse::<i64>().ok().and_then(|ms| ms.checked_mul(1000)).ok_or_else(|| {
                Syntax(if seconds_to_micros(ts).is_some() {
                    format!(
                        "timestamp {ts:?} is not integer milliseconds (Prometheus text); an OpenMetrics file, whose timestamps are seconds, ends with `# EOF`"
                    )
                } else {
                    format!("invalid timestamp {ts:?}")
                })
            })?,
            Timestamps::Seconds => seconds_to_micros(ts).ok_or_else(|| Syntax(format!("invalid timestamp {ts:?}")))?,
        };
        let rest = rest.trim_start_matches([' ', '\t']);
        if !rest.is_empty() && !rest.starts_with('#') {
            return Err(Syntax(format!("unexpected text {rest:?} after the timestamp")));
        }
        Some(t)
    };
    b.sample(series, t, value);
    Ok(())
}

/// The next whitespace-delimited token and what follows it.
fn token(s: &str) -> (&str, &str) {
    let end = s.find([' ', '\t']).unwrap_or(s.len());
    s.split_at(end)
}

fn is_name_start(c: u8) -> bool {
    c.is_ascii_alphabetic() || c == b'_' || c == b':'
}

fn is_name_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_' || c == b':'
}

/// Where the series text (name and label set) ends, and whether it has a label set.
fn series_end(line: &str) -> Result<(usize, bool), Syntax> {
    let b = line.as_bytes();
    let mut i = 0;
    match b.first() {
        Some(&c) if is_name_start(c) => {
            while b.get(i).is_some_and(|&c| is_name_char(c)) {
                i += 1;
            }
        }
        Some(b'{') => {}
        _ => {
            return Err(Syntax(format!(
                "expected a metric name or `{{`, found {:?}",
                line.chars().next().unwrap_or(' ')
            )));
        }
    }
    let mut j = i;
    while matches!(b.get(j), Some(b' ' | b'\t')) {
        j += 1;
    }
    if b.get(j) != Some(&b'{') {
        return Ok((i, false));
    }
    let (mut in_quotes, mut escaped) = (false, false);
    for (k, &c) in b.iter().enumerate().skip(j + 1) {
        if in_quotes {
            if escaped {
                escaped = false;
            } else if c == b'\\' {
                escaped = true;
            } else if c == b'"' {
                in_quotes = false;
            }
        } else if c == b'"' {
            in_quotes = true;
        } else if c == b'}' {
            return Ok((k + 1, true));
        }
    }
    Err(Syntax("the label set is not closed with `}`".to_owned()))
}

/// Parses a series text (cache miss) and resolves it in the builder.
fn resolve(text: &str, b: &mut Builder) -> Result<SeriesRef, Syntax> {
    let name_end = text.find(['{', ' ', '\t']).unwrap_or(text.len());
    let mut name: Option<Cow<str>> = (name_end > 0).then(|| Cow::Borrowed(&text[..name_end]));
    let mut labels: Vec<(Cow<str>, Cow<str>)> = Vec::new();
    if let Some(open) = text.find('{') {
        let inner = text.get(open + 1..text.len() - 1).unwrap_or_default();
        let quoted_name = parse_labels(inner, &mut labels)?;
        if let Some(q) = quoted_name {
            if name.is_some() {
                return Err(Syntax("a metric name both before and inside the label set".to_owned()));
            }
            name = Some(q);
        }
    }
    let pairs: Vec<(&str, &str)> = labels.iter().map(|(k, v)| (k.as_ref(), v.as_ref())).collect();
    Ok(b.resolve(name.as_deref(), &pairs))
}

/// Parses the inside of `{…}` into `labels`; returns a quoted metric name if the set
/// holds one (Prometheus 3's UTF-8 form).
fn parse_labels<'a>(
    s: &'a str,
    labels: &mut Vec<(Cow<'a, str>, Cow<'a, str>)>,
) -> Result<Option<Cow<'a, str>>, Syntax> {
    let mut c = Cursor { s, i: 0 };
    let mut name = None;
    loop {
        c.skip_ws();
        if c.peek().is_none() {
            return Ok(name);
        }
        let quoted = c.peek() == Some(b'"');
        let key = if quoted { c.quoted()? } else { Cow::Borrowed(c.ident()?) };
        c.skip_ws();
        if c.peek() == Some(b'=') {
            c.i += 1;
            c.skip_ws();
            if c.peek() != Some(b'"') {
                return Err(Syntax(format!("expected a quoted value after `{key}=`")));
            }
            let value = c.quoted()?;
            labels.push((key, value));
        } else if quoted && name.is_none() {
            name = Some(key);
        } else {
            return Err(Syntax(format!("expected `=` after the label name {key:?}")));
        }
        c.skip_ws();
        match c.peek() {
            None => return Ok(name),
            Some(b',') => c.i += 1,
            Some(other) => {
                return Err(Syntax(format!("expected `,` or `}}` after a label, found {:?}", char::from(other))));
            }
        }
    }
}

struct Cursor<'a> {
    s: &'a str,
    i: usize,
}

impl<'a> Cursor<'a> {
    fn peek(&self) -> Option<u8> {
        self.s.as_bytes().get(self.i).copied()
    }

    fn skip_ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t')) {
            self.i += 1;
        }
    }

    fn ident(&mut self) -> Result<&'a str, Syntax> {
        let start = self.i;
        while self.peek().is_some_and(|c| c.is_ascii_alphanumeric() || c == b'_') {
            self.i += 1;
        }
        if self.i == start || self.s.as_bytes().get(start).is_some_and(u8::is_ascii_digit) {
            let found = self.s.get(start..).and_then(|r| r.chars().next()).unwrap_or(' ');
            return Err(Syntax(format!("expected a label name, found {found:?}")));
        }
        Ok(&self.s[start..self.i])
    }

    /// A double-quoted string starting at the cursor, unescaped. `\\`, `\"` and `\n` are
    /// the escapes both formats define; any other backslash is kept as written (Go's
    /// `strconv.Quote` in `promtool tsdb dump` may write others).
    fn quoted(&mut self) -> Result<Cow<'a, str>, Syntax> {
        let start = self.i + 1;
        let b = self.s.as_bytes();
        let mut k = start;
        let mut has_escape = false;
        while let Some(&c) = b.get(k) {
            match c {
                b'"' => {
                    self.i = k + 1;
                    let raw = &self.s[start..k];
                    return Ok(if has_escape { Cow::Owned(unescape(raw)) } else { Cow::Borrowed(raw) });
                }
                b'\\' => {
                    has_escape = true;
                    k += 2;
                }
                _ => k += 1,
            }
        }
        Err(Syntax("a label value is not closed with `\"`".to_owned()))
    }
}

fn unescape(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('\\') => out.push('\\'),
            Some('"') => out.push('"'),
            Some(other) => {
                out.push('\\');
                out.push(other);
            }
            None => out.push('\\'),
        }
    }
    out
}

/// A sample value: a Go float (`1`, `1.5e3`, `NaN`, `+Inf`, `-Inf`).
pub(crate) fn parse_value(s: &str) -> Option<f64> {
    s.parse::<f64>().ok()
}

/// Seconds as decimal text (`1700000000`, `1700000000.123456789`, `1.7e9`) to µs. Plain
/// decimals are converted exactly (rounded half away from zero at the µs), so a
/// timestamp written with ms precision lands on its ms.
pub(crate) fn seconds_to_micros(s: &str) -> Option<i64> {
    if s.contains(['e', 'E']) {
        let f: f64 = s.parse().ok()?;
        return f64_seconds_to_micros(f);
    }
    let (neg, digits) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    let (int, frac) = digits.split_once('.').unwrap_or((digits, ""));
    if (int.is_empty() && frac.is_empty()) || !int.bytes().chain(frac.bytes()).all(|c| c.is_ascii_digit()) {
        return None;
    }
    let whole: i64 = if int.is_empty() { 0 } else { int.parse().ok()? };
    let f = frac.as_bytes();
    let mut micros: i64 = 0;
    for k in 0..6 {
        micros = micros * 10 + f.get(k).map_or(0, |d| i64::from(d - b'0'));
    }
    if f.get(6).is_some_and(|&d| d >= b'5') {
        micros += 1;
    }
    let total = whole.checked_mul(1_000_000)?.checked_add(micros)?;
    Some(if neg { -total } else { total })
}

/// Seconds as a float (JSON numbers) to µs, `None` when not finite or out of range.
pub(crate) fn f64_seconds_to_micros(secs: f64) -> Option<i64> {
    let us = (secs * 1e6).round();
    (us.is_finite() && us.abs() < 9.2e18).then_some(us as i64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ImportOptions, reason};

    type Parsed = (Option<String>, Vec<(String, String)>);

    fn labels_of(inner: &str) -> Result<Parsed, Syntax> {
        let mut l = Vec::new();
        let name = parse_labels(inner, &mut l)?;
        Ok((name.map(Cow::into_owned), l.into_iter().map(|(k, v)| (k.into_owned(), v.into_owned())).collect()))
    }

    fn pair(k: &str, v: &str) -> (String, String) {
        (k.to_owned(), v.to_owned())
    }

    #[test]
    fn label_sets_with_escapes_spaces_and_quoted_names() {
        assert_eq!(labels_of(r#"a="1",b="x\"y\\z\nw""#), Ok((None, vec![pair("a", "1"), pair("b", "x\"y\\z\nw")])));
        assert_eq!(labels_of(r#"__name__="m", a="1", "#), Ok((None, vec![pair("__name__", "m"), pair("a", "1")])));
        assert_eq!(labels_of(r#""my.metric", "a.b"="c""#), Ok((Some("my.metric".into()), vec![pair("a.b", "c")])));
        assert_eq!(labels_of(r#"a="C:\dir""#), Ok((None, vec![pair("a", r"C:\dir")])));
        assert_eq!(labels_of(""), Ok((None, vec![])));
        assert_eq!(labels_of(r#"a=1"#), Err(Syntax("expected a quoted value after `a=`".to_owned())));
        assert_eq!(labels_of(r#"a="1" b="2""#), Err(Syntax("expected `,` or `}` after a label, found 'b'".to_owned())));
        assert_eq!(labels_of(r#"1a="x""#), Err(Syntax("expected a label name, found '1'".to_owned())));
    }

    #[test]
    fn series_text_ends_after_the_closing_brace() {
        assert_eq!(series_end(r#"m{a="}"} 1"#), Ok((8, true)));
        assert_eq!(series_end("m 1"), Ok((1, false)));
        assert_eq!(series_end(r#"m {a="b"} 1"#), Ok((9, true)));
        assert_eq!(series_end(r#"{__name__="m"} 1 2"#), Ok((14, true)));
        assert!(series_end(r#"m{a="b" 1"#).is_err());
        assert!(series_end("1m 1").is_err());
    }

    #[test]
    fn seconds_convert_exactly() {
        assert_eq!(seconds_to_micros("1700000000"), Some(1_700_000_000_000_000));
        assert_eq!(seconds_to_micros("1700000000.123"), Some(1_700_000_000_123_000));
        assert_eq!(seconds_to_micros("1700000000.1234565"), Some(1_700_000_000_123_457));
        assert_eq!(seconds_to_micros("-1.5"), Some(-1_500_000));
        assert_eq!(seconds_to_micros(".5"), Some(500_000));
        assert_eq!(seconds_to_micros("1.7e9"), Some(1_700_000_000_000_000));
        for bad in ["", ".", "1.2.3", "abc", "1,5", "-"] {
            assert_eq!(seconds_to_micros(bad), None, "{bad}");
        }
        assert_eq!(parse_value("+Inf"), Some(f64::INFINITY));
        assert!(parse_value("NaN").is_some_and(f64::is_nan));
        assert_eq!(parse_value("1.5e3"), Some(1500.0));
    }

    fn run(text: &str, unit: Timestamps) -> Result<Builder, ImportError> {
        let mut b = Builder::new(ImportOptions::default());
        parse(text, unit, &mut b)?;
        Ok(b)
    }

    #[test]
    fn errors_name_the_line() {
        let text = "# HELP x y\nDCGM_FI_DEV_GPU_UTIL{UUID=\"GPU-a\"} 1 1700000000000\n\nDCGM_FI_DEV_GPU_UTIL{UUID=\"GPU-a\"}\n";
        let e = run(text, Timestamps::Millis).err();
        assert_eq!(e.map(|e| e.to_string()), Some("line 4: expected a value after the labels".to_owned()));
        let e = run("m 1 2 3\n", Timestamps::Millis).err().map(|e| e.to_string());
        assert_eq!(e.as_deref(), Some("line 1: unexpected text \"3\" after the timestamp"));
        let e = run("m abc\n", Timestamps::Millis).err().map(|e| e.to_string());
        assert_eq!(e.as_deref(), Some("line 1: invalid sample value \"abc\""));
        let e = run("m 1 1700000000.5\n", Timestamps::Millis).err().map(|e| e.to_string());
        assert!(e.is_some_and(|e| e.starts_with("line 1: timestamp \"1700000000.5\" is not integer milliseconds")));
        let e = run("m\n", Timestamps::Millis).err().map(|e| e.to_string());
        assert_eq!(e.as_deref(), Some("line 1: expected a value after the metric name"));
    }

    #[test]
    fn comments_exemplars_and_missing_timestamps() {
        let text = "\
# TYPE DCGM_FI_DEV_GPU_UTIL gauge
# UNIT DCGM_FI_DEV_GPU_UTIL percent
DCGM_FI_DEV_GPU_UTIL{UUID=\"GPU-a\"} 5 1700000000.000 # {trace_id=\"x\"} 1
DCGM_FI_DEV_GPU_UTIL{UUID=\"GPU-a\"} 5 # {trace_id=\"x\"} 1
DCGM_FI_DEV_GPU_UTIL{UUID=\"GPU-a\"} 5
# EOF
";
        let b = run(text, Timestamps::Seconds).expect("parses");
        let out = b.finish().expect("finish");
        assert_eq!(out.samples_read, 3);
        assert_eq!(out.skipped.get(reason::NO_TIMESTAMP), Some(&2));
        assert_eq!(out.skipped.get(reason::FIRST), Some(&1));
    }
}
