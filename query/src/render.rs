//! Query results and their renderings in the contract's formats.
//!
//! - **JSON** `{"columns": [{"name", "type"}], "rows": [[…], …]}`. Timestamps are RFC 3339
//!   UTC strings (`2026-11-19T00:00:01Z`, with `.mmm`/`.µµµµµµ`/9 digits only when the
//!   value has them; a timestamp without a zone is taken as UTC). Decimals are JSON
//!   numbers written with their exact digits (`0.5167`, `312.125`): the text is exact; a
//!   client that parses numbers into IEEE doubles keeps about 15–17 significant digits,
//!   which covers every stored column (at most 18 digits for `energy_joules` in mJ; a
//!   `sum()` over it can exceed what a double holds exactly). Integers are exact JSON
//!   integers. Float NaN/±∞, which JSON cannot hold, are the strings `"NaN"`,
//!   `"Infinity"`, `"-Infinity"`. Dates are `YYYY-MM-DD`; other types (lists, intervals,
//!   binary) are strings in Arrow's display form. NULL is `null`.
//! - **CSV**: a header row, then the same value text as JSON (RFC 4180 quoting; NULL is an
//!   empty field, an empty string is `""`), `\n` line ends.
//! - **Arrow IPC stream** and **Parquet** (ZSTD): the result batches as they are.
//! - **Table**: aligned text for terminals (`apron sql --format table`).
//!
//! JSON type names ([`type_name`]): `boolean`, `int8`…`int64`, `uint8`…`uint64`,
//! `float32`, `float64`, `decimal(p,s)`, `string`, `timestamp` (always shown in UTC),
//! `date`, `null`, else Arrow's type in lower case.

use std::io::Write;

use datafusion::arrow::array::{
    Array, ArrayRef, AsArray, BooleanArray, Decimal128Array, Decimal256Array, Float64Array, Int64Array, StringArray,
    UInt64Array,
};
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{
    DataType, Decimal128Type, Decimal256Type, Float64Type, Int64Type, SchemaRef, TimeUnit, UInt64Type,
};
use datafusion::arrow::error::ArrowError;
use datafusion::arrow::ipc::writer::StreamWriter;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::arrow::util::display::{ArrayFormatter, FormatOptions};
use datafusion::parquet::arrow::ArrowWriter;
use datafusion::parquet::basic::{Compression, ZstdLevel};
use datafusion::parquet::errors::ParquetError;
use datafusion::parquet::file::properties::WriterProperties;

/// A query's answer: its schema and batches (empty batches are dropped).
#[derive(Clone, Debug)]
pub struct QueryResult {
    pub schema: SchemaRef,
    pub batches: Vec<RecordBatch>,
    /// Computed by the Ballista cluster (`[query.ballista]`), not in this process.
    pub distributed: bool,
}

/// An output format of `POST /api/v1/sql` and `apron sql`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Json,
    Csv,
    ArrowStream,
    Parquet,
    Table,
}

const FORMATS: [(Format, &str, &str); 5] = [
    (Format::Json, "json", "application/json"),
    (Format::Csv, "csv", "text/csv"),
    (Format::ArrowStream, "arrow", "application/vnd.apache.arrow.stream"),
    (Format::Parquet, "parquet", "application/vnd.apache.parquet"),
    (Format::Table, "table", "text/plain"),
];

impl Format {
    /// The `Content-Type` of a response in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::Json => "application/json",
            Format::Csv => "text/csv; charset=utf-8; header=present",
            Format::ArrowStream => "application/vnd.apache.arrow.stream",
            Format::Parquet => "application/vnd.apache.parquet",
            Format::Table => "text/plain; charset=utf-8",
        }
    }

    /// `json`, `csv`, `arrow`, `parquet`, `table` (the CLI's `--format`).
    pub fn from_name(name: &str) -> Option<Format> {
        FORMATS.iter().find(|f| f.1.eq_ignore_ascii_case(name)).map(|f| f.0)
    }

    pub fn name(self) -> &'static str {
        FORMATS.iter().find(|f| f.0 == self).map_or("json", |f| f.1)
    }

    /// Content negotiation: the best format of an `Accept` header by q-value (ties: the
    /// order listed). Missing, empty, `*/*` and `application/*` mean JSON, `text/*` CSV.
    /// `None` when nothing listed is offered (answer 406).
    pub fn from_accept(accept: Option<&str>) -> Option<Format> {
        let accept = accept.map(str::trim).unwrap_or("");
        if accept.is_empty() {
            return Some(Format::Json);
        }
        let mut best: Option<(f32, Format)> = None;
        for range in accept.split(',') {
            let mut parts = range.split(';').map(str::trim);
            let media = parts.next().unwrap_or("").to_ascii_lowercase();
            let q = parts
                .filter_map(|p| p.strip_prefix("q=").or_else(|| p.strip_prefix("Q=")))
                .find_map(|v| v.trim().parse::<f32>().ok())
                .unwrap_or(1.0);
            let format = match media.as_str() {
                "*/*" | "application/*" => Some(Format::Json),
                "text/*" => Some(Format::Csv),
                "application/x-parquet" => Some(Format::Parquet),
                "application/vnd.apache.arrow.file" => None,
                m => FORMATS.iter().find(|f| f.2 == m).map(|f| f.0),
            };
            if let Some(f) = format
                && q > 0.0
                && best.is_none_or(|(bq, _)| q > bq)
            {
                best = Some((q, f));
            }
        }
        best.map(|b| b.1)
    }
}

/// The media types a client may ask for, as a 406 lists them.
pub fn accepted_media_types() -> String {
    FORMATS.iter().map(|f| f.2).collect::<Vec<_>>().join(", ")
}

/// A buffer that refuses to grow past `max_bytes`.
struct Limited {
    out: Vec<u8>,
    max_bytes: u64,
    passed: bool,
}

impl Write for Limited {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.out.len() as u64 + buf.len() as u64 > self.max_bytes {
            self.passed = true;
            return Err(std::io::Error::other("the rendered result is over its limit"));
        }
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RenderError {
    /// The rendering passed its byte limit ([`QueryResult::render_limited`]).
    #[error("the rendered result passed {max_bytes} bytes")]
    TooLarge { max_bytes: u64 },
    #[error("writing the result: {0}")]
    Io(#[from] std::io::Error),
    #[error("rendering the result: {0}")]
    Arrow(#[from] ArrowError),
    #[error("rendering the result as Parquet: {0}")]
    Parquet(#[from] ParquetError),
}

impl QueryResult {
    pub fn num_rows(&self) -> usize {
        self.batches.iter().map(RecordBatch::num_rows).sum()
    }

    /// The whole rendering in `format`.
    pub fn render(&self, format: Format) -> Result<Vec<u8>, RenderError> {
        self.render_limited(format, &[], u64::MAX)
    }

    /// The whole rendering in `format` (JSON with `members` after `rows`: a query
    /// server's `stale_shards`), refused with [`RenderError::TooLarge`] as soon as it
    /// passes `max_bytes`: a rendering is text, several times its Arrow batches, and it
    /// is held whole to be sent.
    pub fn render_limited(
        &self,
        format: Format,
        members: &[(&str, serde_json::Value)],
        max_bytes: u64,
    ) -> Result<Vec<u8>, RenderError> {
        let mut out = Limited { out: Vec::new(), max_bytes, passed: false };
        let written = match format {
            Format::Json => self.write_json_with(&mut out, members),
            Format::Csv => self.write_csv(&mut out),
            Format::ArrowStream => self.write_arrow_stream(&mut out),
            Format::Parquet => self.write_parquet(&mut out),
            Format::Table => self.write_table(&mut out),
        };
        // The writers wrap the I/O error in their own; the flag says what it was.
        match written {
            _ if out.passed => Err(RenderError::TooLarge { max_bytes }),
            Err(e) => Err(e),
            Ok(()) => Ok(out.out),
        }
    }

    /// The JSON form ([`QueryResult::write_json`]) with more members after `rows`
    /// (a query server's `stale_shards`).
    pub fn render_json_with(&self, members: &[(&str, serde_json::Value)]) -> Result<Vec<u8>, RenderError> {
        self.render_limited(Format::Json, members, u64::MAX)
    }

    /// `{"columns": [{"name": …, "type": …}], "rows": [[…], …]}`.
    pub fn write_json<W: Write>(&self, w: W) -> Result<(), RenderError> {
        self.write_json_with(w, &[])
    }

    fn write_json_with<W: Write>(&self, w: W, members: &[(&str, serde_json::Value)]) -> Result<(), RenderError> {
        let mut w = std::io::BufWriter::new(w);
        w.write_all(b"{\"columns\":[")?;
        for (i, f) in self.schema.fields().iter().enumerate() {
            if i > 0 {
                w.write_all(b",")?;
            }
            w.write_all(b"{\"name\":")?;
            serde_json::to_writer(&mut w, f.name()).map_err(std::io::Error::from)?;
            w.write_all(b",\"type\":")?;
            serde_json::to_writer(&mut w, &type_name(f.data_type())).map_err(std::io::Error::from)?;
            w.write_all(b"}")?;
        }
        w.write_all(b"],\"rows\":[")?;
        let mut first = true;
        let mut buf = Vec::new();
        for batch in &self.batches {
            let cols = columns(batch)?;
            for row in 0..batch.num_rows() {
                w.write_all(if first { b"[" } else { b",[" })?;
                first = false;
                for (i, c) in cols.iter().enumerate() {
                    if i > 0 {
                        w.write_all(b",")?;
                    }
                    buf.clear();
                    c.json(row, &mut buf)?;
                    w.write_all(&buf)?;
                }
                w.write_all(b"]")?;
            }
        }
        w.write_all(b"]")?;
        for (name, value) in members {
            w.write_all(b",")?;
            serde_json::to_writer(&mut w, name).map_err(std::io::Error::from)?;
            w.write_all(b":")?;
            serde_json::to_writer(&mut w, value).map_err(std::io::Error::from)?;
        }
        w.write_all(b"}")?;
        w.flush()?;
        Ok(())
    }

    /// A header row of column names, then one line per row.
    pub fn write_csv<W: Write>(&self, w: W) -> Result<(), RenderError> {
        let mut w = std::io::BufWriter::new(w);
        let mut buf = Vec::new();
        for (i, f) in self.schema.fields().iter().enumerate() {
            if i > 0 {
                w.write_all(b",")?;
            }
            csv_field(f.name().as_bytes(), true, &mut w)?;
        }
        w.write_all(b"\n")?;
        for batch in &self.batches {
            let cols = columns(batch)?;
            for row in 0..batch.num_rows() {
                for (i, c) in cols.iter().enumerate() {
                    if i > 0 {
                        w.write_all(b",")?;
                    }
                    buf.clear();
                    if c.text(row, &mut buf)? {
                        csv_field(&buf, c.is_text(), &mut w)?;
                    }
                }
                w.write_all(b"\n")?;
            }
        }
        w.flush()?;
        Ok(())
    }

    /// An Arrow IPC stream (schema message, then the batches).
    pub fn write_arrow_stream<W: Write>(&self, w: W) -> Result<(), RenderError> {
        let mut writer = StreamWriter::try_new(w, &self.schema)?;
        for b in &self.batches {
            writer.write(b)?;
        }
        writer.finish()?;
        Ok(())
    }

    /// One Parquet file, ZSTD-compressed.
    pub fn write_parquet<W: Write + Send>(&self, w: W) -> Result<(), RenderError> {
        let props = WriterProperties::builder().set_compression(Compression::ZSTD(ZstdLevel::try_new(3)?)).build();
        let mut writer = ArrowWriter::try_new(w, self.schema.clone(), Some(props))?;
        for b in &self.batches {
            writer.write(b)?;
        }
        writer.close()?;
        Ok(())
    }

    /// Aligned columns for a terminal, like psql: numbers right-aligned, `(N rows)`.
    pub fn write_table<W: Write>(&self, mut w: W) -> Result<(), RenderError> {
        let names: Vec<String> = self.schema.fields().iter().map(|f| f.name().clone()).collect();
        let mut widths: Vec<usize> = names.iter().map(|n| n.chars().count()).collect();
        let mut rows: Vec<Vec<String>> = Vec::with_capacity(self.num_rows());
        let mut right = vec![false; names.len()];
        let mut buf = Vec::new();
        for batch in &self.batches {
            let cols = columns(batch)?;
            for (i, c) in cols.iter().enumerate() {
                right[i] = c.is_numeric();
            }
            for row in 0..batch.num_rows() {
                let mut cells = Vec::with_capacity(cols.len());
                for (i, c) in cols.iter().enumerate() {
                    buf.clear();
                    c.text(row, &mut buf)?;
                    let s = String::from_utf8_lossy(&buf).replace('\n', "\\n");
                    widths[i] = widths[i].max(s.chars().count());
                    cells.push(s);
                }
                rows.push(cells);
            }
        }
        let line = |w: &mut W, cells: &[String], align: &[bool]| -> std::io::Result<()> {
            let mut s = String::new();
            for (i, c) in cells.iter().enumerate() {
                if i > 0 {
                    s.push_str(" | ");
                }
                let pad = widths[i].saturating_sub(c.chars().count());
                if align.get(i).copied().unwrap_or(false) {
                    s.extend(std::iter::repeat_n(' ', pad));
                    s.push_str(c);
                } else {
                    s.push_str(c);
                    s.extend(std::iter::repeat_n(' ', pad));
                }
            }
            writeln!(w, "{}", s.trim_end())
        };
        line(&mut w, &names, &vec![false; names.len()])?;
        let rule: Vec<String> = widths.iter().map(|&n| "-".repeat(n)).collect();
        writeln!(w, "{}", rule.join("-+-"))?;
        for r in &rows {
            line(&mut w, r, &right)?;
        }
        let n = rows.len();
        writeln!(w, "({n} row{})", if n == 1 { "" } else { "s" })?;
        Ok(())
    }
}

/// The JSON `type` of a column (see the module docs).
pub fn type_name(t: &DataType) -> String {
    match t {
        DataType::Boolean => "boolean".into(),
        DataType::Int8 => "int8".into(),
        DataType::Int16 => "int16".into(),
        DataType::Int32 => "int32".into(),
        DataType::Int64 => "int64".into(),
        DataType::UInt8 => "uint8".into(),
        DataType::UInt16 => "uint16".into(),
        DataType::UInt32 => "uint32".into(),
        DataType::UInt64 => "uint64".into(),
        DataType::Float16 | DataType::Float32 => "float32".into(),
        DataType::Float64 => "float64".into(),
        DataType::Decimal32(p, s) | DataType::Decimal64(p, s) | DataType::Decimal128(p, s) => {
            format!("decimal({p},{s})")
        }
        DataType::Decimal256(p, s) => format!("decimal({p},{s})"),
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => "string".into(),
        DataType::Timestamp(..) => "timestamp".into(),
        DataType::Date32 | DataType::Date64 => "date".into(),
        DataType::Null => "null".into(),
        DataType::Dictionary(_, v) => type_name(v),
        other => other.to_string().to_ascii_lowercase(),
    }
}

/// One column prepared for cell-by-cell rendering.
enum Col<'a> {
    Null,
    Bool(BooleanArray),
    Int(Int64Array),
    UInt(UInt64Array),
    Float(Float64Array),
    Dec128(Decimal128Array),
    Dec256(Decimal256Array),
    /// Raw values in `unit` since the epoch.
    Timestamp(Int64Array, TimeUnit),
    /// Days since the epoch.
    Date(Int64Array),
    Str(StringArray),
    Other(&'a dyn Array, ArrayFormatter<'a>),
}

fn columns(batch: &RecordBatch) -> Result<Vec<Col<'_>>, ArrowError> {
    batch.columns().iter().map(Col::new).collect()
}

impl<'a> Col<'a> {
    fn new(array: &'a ArrayRef) -> Result<Col<'a>, ArrowError> {
        let t = array.data_type();
        let values = match t {
            // Render a dictionary as its values.
            DataType::Dictionary(_, v) => return Col::owned(cast(array, v)?, array),
            _ => array.clone(),
        };
        Col::owned(values, array)
    }

    fn owned(values: ArrayRef, original: &'a ArrayRef) -> Result<Col<'a>, ArrowError> {
        Ok(match values.data_type() {
            DataType::Null => Col::Null,
            DataType::Boolean => Col::Bool(values.as_boolean().clone()),
            DataType::Int8
            | DataType::Int16
            | DataType::Int32
            | DataType::Int64
            | DataType::UInt8
            | DataType::UInt16
            | DataType::UInt32 => Col::Int(cast(&values, &DataType::Int64)?.as_primitive::<Int64Type>().clone()),
            DataType::UInt64 => Col::UInt(values.as_primitive::<UInt64Type>().clone()),
            DataType::Float16 | DataType::Float32 | DataType::Float64 => {
                Col::Float(cast(&values, &DataType::Float64)?.as_primitive::<Float64Type>().clone())
            }
            DataType::Decimal32(p, s) | DataType::Decimal64(p, s) => {
                Col::Dec128(cast(&values, &DataType::Decimal128(*p, *s))?.as_primitive::<Decimal128Type>().clone())
            }
            DataType::Decimal128(..) => Col::Dec128(values.as_primitive::<Decimal128Type>().clone()),
            DataType::Decimal256(..) => Col::Dec256(values.as_primitive::<Decimal256Type>().clone()),
            DataType::Timestamp(unit, _) => {
                Col::Timestamp(cast(&values, &DataType::Int64)?.as_primitive::<Int64Type>().clone(), *unit)
            }
            DataType::Date32 => {
                let days = cast(&values, &DataType::Int32)?;
                Col::Date(cast(&days, &DataType::Int64)?.as_primitive::<Int64Type>().clone())
            }
            DataType::Date64 => {
                let ms = cast(&values, &DataType::Int64)?;
                let ms = ms.as_primitive::<Int64Type>();
                Col::Date(ms.unary::<_, Int64Type>(|v| v.div_euclid(86_400_000)))
            }
            DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => {
                Col::Str(cast(&values, &DataType::Utf8)?.as_string::<i32>().clone())
            }
            _ => {
                let opts = FormatOptions::default();
                Col::Other(original.as_ref(), ArrayFormatter::try_new(original.as_ref(), &opts)?)
            }
        })
    }

    fn is_null(&self, row: usize) -> bool {
        match self {
            Col::Null => true,
            Col::Bool(a) => a.is_null(row),
            Col::Int(a) | Col::Timestamp(a, _) | Col::Date(a) => a.is_null(row),
            Col::UInt(a) => a.is_null(row),
            Col::Float(a) => a.is_null(row),
            Col::Dec128(a) => a.is_null(row),
            Col::Dec256(a) => a.is_null(row),
            Col::Str(a) => a.is_null(row),
            Col::Other(a, _) => a.is_null(row),
        }
    }

    /// Values that CSV must quote when they hold separators (strings and free text).
    fn is_text(&self) -> bool {
        matches!(self, Col::Str(_) | Col::Other(..))
    }

    fn is_numeric(&self) -> bool {
        matches!(self, Col::Int(_) | Col::UInt(_) | Col::Float(_) | Col::Dec128(_) | Col::Dec256(_))
    }

    /// The value as text (CSV, table); false for NULL (nothing written).
    fn text(&self, row: usize, out: &mut Vec<u8>) -> Result<bool, ArrowError> {
        if self.is_null(row) {
            return Ok(false);
        }
        match self {
            Col::Null => return Ok(false),
            Col::Bool(a) => out.extend_from_slice(if a.value(row) { b"true" } else { b"false" }),
            Col::Int(a) => write!(out, "{}", a.value(row))?,
            Col::UInt(a) => write!(out, "{}", a.value(row))?,
            Col::Float(a) => float(a.value(row), false, out),
            Col::Dec128(a) => out.extend_from_slice(a.value_as_string(row).as_bytes()),
            Col::Dec256(a) => out.extend_from_slice(a.value_as_string(row).as_bytes()),
            Col::Timestamp(a, unit) => rfc3339(a.value(row), *unit, out),
            Col::Date(a) => date(a.value(row), out),
            Col::Str(a) => out.extend_from_slice(a.value(row).as_bytes()),
            Col::Other(_, f) => write!(out, "{}", f.value(row))?,
        }
        Ok(true)
    }

    /// The value as a JSON value.
    fn json(&self, row: usize, out: &mut Vec<u8>) -> Result<(), ArrowError> {
        if self.is_null(row) {
            out.extend_from_slice(b"null");
            return Ok(());
        }
        match self {
            Col::Bool(_) | Col::Int(_) | Col::UInt(_) | Col::Dec128(_) | Col::Dec256(_) => {
                self.text(row, out)?;
            }
            Col::Float(a) => float(a.value(row), true, out),
            Col::Null | Col::Timestamp(..) | Col::Date(_) | Col::Str(_) | Col::Other(..) => {
                let mut s = Vec::new();
                self.text(row, &mut s)?;
                let s = String::from_utf8_lossy(&s);
                serde_json::to_writer(&mut *out, s.as_ref()).map_err(|e| ArrowError::ExternalError(Box::new(e)))?;
            }
        }
        Ok(())
    }
}

/// Shortest round-trip text of a float; NaN/±∞ as words (quoted for JSON).
fn float(v: f64, json: bool, out: &mut Vec<u8>) {
    let word = if v.is_nan() {
        "NaN"
    } else if v == f64::INFINITY {
        "Infinity"
    } else if v == f64::NEG_INFINITY {
        "-Infinity"
    } else {
        // serde_json writes finite floats exactly as JSON numbers (ryu).
        if serde_json::to_writer(&mut *out, &v).is_err() {
            out.extend_from_slice(b"null");
        }
        return;
    };
    if json {
        out.push(b'"');
        out.extend_from_slice(word.as_bytes());
        out.push(b'"');
    } else {
        out.extend_from_slice(word.as_bytes());
    }
}

/// Writes a CSV field: quoted when it holds a separator, quote or line break — and an
/// empty string always, so it differs from NULL (an empty unquoted field).
fn csv_field<W: Write>(v: &[u8], text: bool, w: &mut W) -> std::io::Result<()> {
    let needs = (text && v.is_empty()) || v.iter().any(|b| matches!(b, b',' | b'"' | b'\n' | b'\r'));
    if !needs {
        return w.write_all(v);
    }
    w.write_all(b"\"")?;
    for chunk in v.split_inclusive(|&b| b == b'"') {
        w.write_all(chunk)?;
        if chunk.last() == Some(&b'"') {
            w.write_all(b"\"")?;
        }
    }
    w.write_all(b"\"")
}

fn date(days: i64, out: &mut Vec<u8>) {
    let (y, m, d) = apron_common::civil_from_days(days);
    let _ = write!(out, "{y:04}-{m:02}-{d:02}");
}

/// RFC 3339 in UTC: `2026-11-19T00:00:01Z`, fractional digits (3, 6 or 9) only when
/// the value has them.
pub(crate) fn rfc3339(value: i64, unit: TimeUnit, out: &mut Vec<u8>) {
    let per_sec: i64 = match unit {
        TimeUnit::Second => 1,
        TimeUnit::Millisecond => 1_000,
        TimeUnit::Microsecond => 1_000_000,
        TimeUnit::Nanosecond => 1_000_000_000,
    };
    let secs = value.div_euclid(per_sec);
    let nanos = value.rem_euclid(per_sec) * (1_000_000_000 / per_sec);
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    date(days, out);
    let _ = write!(out, "T{:02}:{:02}:{:02}", sod / 3600, sod / 60 % 60, sod % 60);
    if nanos != 0 {
        let _ = if nanos % 1_000_000 == 0 {
            write!(out, ".{:03}", nanos / 1_000_000)
        } else if nanos % 1_000 == 0 {
            write!(out, ".{:06}", nanos / 1_000)
        } else {
            write!(out, ".{nanos:09}")
        };
    }
    out.push(b'Z');
}

/// Builds a result from single-column arrays, for tests.
#[cfg(test)]
fn result_of(columns: Vec<(&str, ArrayRef)>) -> QueryResult {
    use std::sync::Arc;

    use datafusion::arrow::datatypes::{Field, Schema};
    let schema = Arc::new(Schema::new(
        columns.iter().map(|(n, a)| Field::new(*n, a.data_type().clone(), true)).collect::<Vec<_>>(),
    ));
    let batch = RecordBatch::try_new(schema.clone(), columns.into_iter().map(|c| c.1).collect()).expect("batch");
    QueryResult { schema, batches: vec![batch], distributed: false }
}

#[cfg(test)]
mod tests {
    use datafusion::arrow::array::{
        Date32Array, DictionaryArray, Int32Array, TimestampMicrosecondArray, TimestampNanosecondArray,
    };
    use std::sync::Arc;

    use datafusion::arrow::datatypes::Int8Type;

    use super::*;

    /// Parquet bytes as a readable file (the reader wants a `ChunkReader`).
    pub(crate) fn parquet_file(bytes: &[u8]) -> std::fs::File {
        use std::io::{Seek, Write};
        let mut f = tempfile::tempfile().expect("tempfile");
        f.write_all(bytes).expect("write");
        f.rewind().expect("rewind");
        f
    }

    fn ts_us(v: i64) -> String {
        let mut out = Vec::new();
        rfc3339(v, TimeUnit::Microsecond, &mut out);
        String::from_utf8(out).expect("utf8")
    }

    #[test]
    fn timestamps_are_rfc3339_utc() {
        assert_eq!(ts_us(0), "1970-01-01T00:00:00Z");
        assert_eq!(ts_us(20_776 * 86_400_000_000 + 1_000_000), "2026-11-19T00:00:01Z");
        assert_eq!(ts_us(1_500), "1970-01-01T00:00:00.001500Z");
        assert_eq!(ts_us(250_000), "1970-01-01T00:00:00.250Z");
        assert_eq!(ts_us(-1), "1969-12-31T23:59:59.999999Z");
        let mut out = Vec::new();
        rfc3339(1, TimeUnit::Nanosecond, &mut out);
        assert_eq!(out, b"1970-01-01T00:00:00.000000001Z");
    }

    #[test]
    fn json_shape_types_and_values() {
        let dec = Decimal128Array::from(vec![Some(5167), None]).with_precision_and_scale(5, 4).expect("dec");
        let ts = TimestampMicrosecondArray::from(vec![Some(1_000_000), None]).with_timezone("UTC");
        let dict: DictionaryArray<Int8Type> = vec!["a\"b", "c"].into_iter().collect();
        let r = result_of(vec![
            ("d", Arc::new(dec)),
            ("t", Arc::new(ts)),
            ("s", Arc::new(dict)),
            ("f", Arc::new(Float64Array::from(vec![0.1, f64::NAN]))),
            ("i", Arc::new(Int32Array::from(vec![Some(-3), None]))),
            ("day", Arc::new(Date32Array::from(vec![Some(20_776), None]))),
            ("tn", Arc::new(TimestampNanosecondArray::from(vec![Some(1), None]))),
        ]);
        let json: serde_json::Value = serde_json::from_slice(&r.render(Format::Json).expect("json")).expect("parse");
        assert_eq!(
            json["columns"],
            serde_json::json!([
                {"name": "d", "type": "decimal(5,4)"}, {"name": "t", "type": "timestamp"},
                {"name": "s", "type": "string"}, {"name": "f", "type": "float64"},
                {"name": "i", "type": "int32"}, {"name": "day", "type": "date"},
                {"name": "tn", "type": "timestamp"},
            ])
        );
        assert_eq!(
            json["rows"],
            serde_json::json!([
                [0.5167, "1970-01-01T00:00:01Z", "a\"b", 0.1, -3, "2026-11-19", "1970-01-01T00:00:00.000000001Z"],
                [null, null, "c", "NaN", null, null, null],
            ])
        );
        // The decimal is written with its exact digits, not via a double.
        let text = String::from_utf8(r.render(Format::Json).expect("json")).expect("utf8");
        assert!(text.contains("[0.5167,"), "{text}");
    }

    #[test]
    fn csv_header_quoting_and_nulls() {
        let r = result_of(vec![
            ("name", Arc::new(StringArray::from(vec![Some("a,b"), Some(""), None, Some("say \"hi\"")]))),
            ("n", Arc::new(Int64Array::from(vec![Some(1), None, Some(3), Some(4)]))),
        ]);
        let csv = String::from_utf8(r.render(Format::Csv).expect("csv")).expect("utf8");
        assert_eq!(csv, "name,n\n\"a,b\",1\n\"\",\n,3\n\"say \"\"hi\"\"\",4\n");
    }

    #[test]
    fn table_and_binary_formats() {
        let r = result_of(vec![
            ("host", Arc::new(StringArray::from(vec!["node-0", "n1"]))),
            ("n", Arc::new(Int64Array::from(vec![1, 22]))),
        ]);
        let t = String::from_utf8(r.render(Format::Table).expect("table")).expect("utf8");
        assert_eq!(t, "host   | n\n-------+---\nnode-0 |  1\nn1     | 22\n(2 rows)\n");
        let ipc = r.render(Format::ArrowStream).expect("ipc");
        let reader =
            datafusion::arrow::ipc::reader::StreamReader::try_new(std::io::Cursor::new(ipc), None).expect("reader");
        let batches: Vec<_> = reader.collect::<Result<_, _>>().expect("batches");
        assert_eq!(batches, r.batches);
        let pq = r.render(Format::Parquet).expect("parquet");
        let reader =
            datafusion::parquet::arrow::arrow_reader::ParquetRecordBatchReader::try_new(parquet_file(&pq), 1024)
                .expect("reader");
        let batches: Vec<_> = reader.collect::<Result<_, _>>().expect("batches");
        assert_eq!(batches[0].num_rows(), 2);
        assert_eq!(batches[0].column(1).as_primitive::<Int64Type>().values().to_vec(), vec![1, 22]);
    }

    #[test]
    fn accept_negotiation() {
        assert_eq!(Format::from_accept(None), Some(Format::Json));
        assert_eq!(Format::from_accept(Some("*/*")), Some(Format::Json));
        assert_eq!(Format::from_accept(Some("text/csv")), Some(Format::Csv));
        assert_eq!(
            Format::from_accept(Some("application/json;q=0.5, application/vnd.apache.arrow.stream")),
            Some(Format::ArrowStream)
        );
        assert_eq!(Format::from_accept(Some("application/vnd.apache.parquet")), Some(Format::Parquet));
        assert_eq!(Format::from_accept(Some("image/png")), None);
        assert_eq!(Format::from_name("CSV"), Some(Format::Csv));
        assert_eq!(Format::Csv.name(), "csv");
    }
}
