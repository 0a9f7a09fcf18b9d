//! Prometheus HTTP API answers: `query_range` (`resultType: matrix`, `values`) and
//! instant queries (`vector`, `value`).
//!
//! A file holds one answer, an array of answers, or bare `{"resultType", "result"}`
//! objects (what `jq .data` leaves). Points are `[seconds, "value"]`; numbers are
//! accepted for either, strings for the timestamp too. Each series is resolved once and
//! its points decoded straight to (µs, f64), so memory stays near 16 bytes a point.

use std::collections::BTreeMap;
use std::fmt;

use serde::Deserialize;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use crate::ImportError;
use crate::series::Builder;
use crate::text::{f64_seconds_to_micros, parse_value, seconds_to_micros};

/// Parses `input` into `b`. On error, `b` may hold part of the input; the caller rolls
/// it back.
pub(crate) fn parse(input: &[u8], b: &mut Builder) -> Result<(), ImportError> {
    let array = input.iter().find(|c| !c.is_ascii_whitespace()) == Some(&b'[');
    let answers: Vec<Answer> =
        if array { serde_json::from_slice(input) } else { serde_json::from_slice(input).map(|a| vec![a]) }
            .map_err(json_error)?;
    for (i, answer) in answers.into_iter().enumerate() {
        add(i + 1, answer, b)?;
    }
    Ok(())
}

fn json_error(e: serde_json::Error) -> ImportError {
    // serde_json's message ends with " at line L column C"; the error shows them itself.
    let full = e.to_string();
    let suffix = format!(" at line {} column {}", e.line(), e.column());
    let message = full.strip_suffix(&suffix).unwrap_or(&full).to_owned();
    ImportError::Json { line: e.line(), column: e.column(), message }
}

fn add(response: usize, a: Answer, b: &mut Builder) -> Result<(), ImportError> {
    if let Some(status) = a.status.as_deref().filter(|s| *s != "success") {
        return Err(ImportError::Api {
            response,
            status: status.to_owned(),
            error_type: a.error_type.unwrap_or_default(),
            error: a.error.unwrap_or_default(),
        });
    }
    let (result_type, result) = match a.data {
        Some(d) => (d.result_type, d.result),
        None => (a.result_type, a.result),
    };
    let Some(result) = result else { return Err(ImportError::NoData { response }) };
    let unsupported = |t: &str| ImportError::UnsupportedResult { response, result_type: t.to_owned() };
    match result_type.as_deref() {
        None | Some("matrix" | "vector") => {}
        Some(other) => return Err(unsupported(other)),
    }
    for element in result {
        let Element::Series(s) = element else {
            return Err(unsupported(result_type.as_deref().unwrap_or("scalar")));
        };
        let labels: Vec<(&str, &str)> = s.metric.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let series = b.resolve(None, &labels);
        for p in s.values.iter().chain(&s.value) {
            b.sample(series, Some(p.t), p.v);
        }
    }
    Ok(())
}

#[derive(Deserialize)]
struct Answer {
    #[serde(default)]
    status: Option<String>,
    #[serde(default, rename = "errorType")]
    error_type: Option<String>,
    #[serde(default)]
    error: Option<String>,
    #[serde(default)]
    data: Option<Data>,
    #[serde(default, rename = "resultType")]
    result_type: Option<String>,
    #[serde(default)]
    result: Option<Vec<Element>>,
}

#[derive(Deserialize)]
struct Data {
    #[serde(default, rename = "resultType")]
    result_type: Option<String>,
    #[serde(default)]
    result: Option<Vec<Element>>,
}

/// An entry of `result`: a series object, or a part of a scalar/string result
/// (`[ts, "v"]`), which has no series.
enum Element {
    Series(Series),
    Other,
}

impl<'de> Deserialize<'de> for Element {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Element;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a series object")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Element, A::Error> {
                Series::deserialize(de::value::MapAccessDeserializer::new(map)).map(Element::Series)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Element, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Element::Other)
            }
            fn visit_f64<E>(self, _: f64) -> Result<Element, E> {
                Ok(Element::Other)
            }
            fn visit_u64<E>(self, _: u64) -> Result<Element, E> {
                Ok(Element::Other)
            }
            fn visit_i64<E>(self, _: i64) -> Result<Element, E> {
                Ok(Element::Other)
            }
            fn visit_str<E>(self, _: &str) -> Result<Element, E> {
                Ok(Element::Other)
            }
            fn visit_bool<E>(self, _: bool) -> Result<Element, E> {
                Ok(Element::Other)
            }
            fn visit_unit<E>(self) -> Result<Element, E> {
                Ok(Element::Other)
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Deserialize)]
struct Series {
    #[serde(default)]
    metric: BTreeMap<String, String>,
    #[serde(default)]
    values: Vec<Point>,
    #[serde(default)]
    value: Option<Point>,
}

/// `[seconds, "value"]` decoded to µs and f64.
struct Point {
    t: i64,
    v: f64,
}

impl<'de> Deserialize<'de> for Point {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Point;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a [timestamp, \"value\"] pair")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Point, A::Error> {
                let t: Timestamp = seq.next_element()?.ok_or_else(|| de::Error::invalid_length(0, &self))?;
                let v: Value = seq.next_element()?.ok_or_else(|| de::Error::invalid_length(1, &self))?;
                if seq.next_element::<IgnoredAny>()?.is_some() {
                    return Err(de::Error::invalid_length(3, &self));
                }
                Ok(Point { t: t.0, v: v.0 })
            }
        }
        d.deserialize_seq(V)
    }
}

/// Seconds since the epoch, as a JSON number or string.
struct Timestamp(i64);

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Timestamp;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a timestamp in seconds")
            }
            fn visit_f64<E: de::Error>(self, s: f64) -> Result<Timestamp, E> {
                f64_seconds_to_micros(s).map(Timestamp).ok_or_else(|| E::custom(format!("timestamp {s} out of range")))
            }
            fn visit_u64<E: de::Error>(self, s: u64) -> Result<Timestamp, E> {
                i64::try_from(s)
                    .ok()
                    .and_then(|s| s.checked_mul(1_000_000))
                    .map(Timestamp)
                    .ok_or_else(|| E::custom(format!("timestamp {s} out of range")))
            }
            fn visit_i64<E: de::Error>(self, s: i64) -> Result<Timestamp, E> {
                s.checked_mul(1_000_000).map(Timestamp).ok_or_else(|| E::custom(format!("timestamp {s} out of range")))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Timestamp, E> {
                seconds_to_micros(s).map(Timestamp).ok_or_else(|| E::custom(format!("invalid timestamp {s:?}")))
            }
        }
        d.deserialize_any(V)
    }
}

/// A sample value: Prometheus writes it as a string (`"12"`, `"NaN"`, `"+Inf"`).
struct Value(f64);

impl<'de> Deserialize<'de> for Value {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Value;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a sample value")
            }
            fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
                Ok(Value(v))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
                Ok(Value(v as f64))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
                Ok(Value(v as f64))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
                parse_value(v).map(Value).ok_or_else(|| E::custom(format!("invalid sample value {v:?}")))
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ImportOptions, reason};

    fn run(json: &str) -> Result<crate::ImportOutcome, ImportError> {
        let mut b = Builder::new(ImportOptions::default());
        parse(json.as_bytes(), &mut b)?;
        b.finish()
    }

    #[test]
    fn matrix_vector_arrays_and_bare_data() {
        let m = r#"{"status":"success","data":{"resultType":"matrix","result":[
            {"metric":{"__name__":"DCGM_FI_DEV_GPU_UTIL","UUID":"GPU-a"},
             "values":[[1700000000,"0"],[1700000015,"50"],[1700000030.0,"NaN"],["1700000045","100"]]}]}}"#;
        let out = run(m).expect("parses");
        assert_eq!((out.samples_read, out.rows), (4, 2));
        assert_eq!(out.skipped.get(reason::NOT_FINITE), Some(&1));
        let v = r#"[{"data":{"resultType":"vector","result":[
            {"metric":{"__name__":"DCGM_FI_DEV_GPU_UTIL","UUID":"GPU-a"},"value":[1700000000.5,"1"]}]}},
            {"resultType":"vector","result":[
            {"metric":{"__name__":"DCGM_FI_DEV_GPU_UTIL","UUID":"GPU-a"},"value":[1700000015.5,2]}]}]"#;
        let out = run(v).expect("parses");
        assert_eq!((out.samples_read, out.rows), (2, 1));
        assert_eq!(out.windows.first().map(|w| w.time.0), Some(1_700_000_015_500_000));
    }

    #[test]
    fn api_errors_and_non_series_results_are_errors() {
        let e = run(r#"{"status":"error","errorType":"bad_data","error":"parse error"}"#).err();
        assert_eq!(
            e.map(|e| e.to_string()).as_deref(),
            Some(r#"response 1: Prometheus answered status "error": bad_data: parse error"#)
        );
        let e =
            run(r#"[{"data":{"resultType":"matrix","result":[]}},{"data":{"resultType":"scalar","result":[1,"2"]}}]"#)
                .err();
        assert_eq!(e, Some(ImportError::UnsupportedResult { response: 2, result_type: "scalar".into() }));
        assert_eq!(run(r#"{"status":"success"}"#).err(), Some(ImportError::NoData { response: 1 }));
        let e = run("{\"data\":{\"resultType\":\"matrix\",\n\"result\":[{\"values\":[[1,\"x\"]]}]}}").err();
        assert_eq!(e.map(|e| e.to_string()).as_deref(), Some(r#"JSON line 2, column 27: invalid sample value "x""#));
    }
}
