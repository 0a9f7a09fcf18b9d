//! Backfill from dcgm-exporter history: Prometheus/OpenMetrics text with timestamps, or
//! Prometheus HTTP API JSON, into `gpu_samples` rows ([`GpuWindow`]).
//!
//! Pure logic: the caller hands in bytes or a reader (a file, an HTTP body) and gets
//! rows back; this crate opens nothing and does no async, so both `apron import FILE…`
//! and an upload route can use it, and the rows go through the same ingest path as an
//! agent's. A history larger than memory spills its samples to a file the caller hands
//! in ([`Importer::spill_to`]) and is read back one GPU at a time.
//!
//! # Parts and data flow
//!
//! ```text
//!  bytes ──► Format::detect ──► text   (Prometheus 0.0.4 / OpenMetrics / tsdb dumps)  ─┐
//!                           └─► json   (query_range matrix / instant vector)          ─┤
//!                                                                                      ▼
//!        dcgm: metric name → Field + unit scale; labels → GPU/MIG identity, host, pod
//!                                                                                      ▼
//!        series::Builder: points per GPU ──finish──► dedup, intervals, timeline, rows
//!                                                                                      ▼
//!              ImportOutcome { windows, counts, skip reasons }  (finish)
//!              or batches of rows to a sink, then the counts   (finish_in_batches)
//! ```
//!
//! - [`Format`]: content detection (`[`/`{"…":` is JSON; text ending in `# EOF` is
//!   OpenMetrics, whose timestamps are seconds; other text is Prometheus 0.0.4, whose
//!   timestamps are milliseconds) or a hint from a content type.
//! - `text`: one line grammar for scrapes (one or many concatenated), `promtool tsdb
//!   dump` (`{__name__="…", …} v ts_ms`) and `promtool tsdb dump-openmetrics`.
//! - `json`: one answer, an array of answers, or bare `data` objects.
//! - `dcgm`: [`MAPPINGS`] (dcgm-exporter name → field and scale: % → ratio, MiB → bytes,
//!   mJ → J) and label resolution. `UUID` is required. The host is `Hostname`, else
//!   `hostname`, else the host part of `instance`, else `unknown` (or
//!   [`ImportOptions::host_override`]). A series with `GPU_I_ID` belongs to a MIG
//!   instance whose UUID is [`mig_instance_uuid`]`(UUID, GPU_I_ID)`, with
//!   `parent_gpu_uuid` = `UUID` and `mig_profile` = `GPU_I_PROFILE`. `pod`/`namespace`/
//!   `container` (or Prometheus' `exported_*` renames) name the holder, a
//!   [`GpuHolder::pod`](apron_common::GpuHolder::pod).
//! - `series`: the point-sample semantics of the design brief, below.
//!
//! Several inputs can feed one [`Importer`] (files split by time or by host), so that a
//! series continuing across files is one series, not one unknown interval per file.
//!
//! # Semantics
//!
//! A sample at `t` stands for `(t_prev, t]` of its series — one field of one GPU —
//! when `t − t_prev` is at most `max_gap` ([`ImportOptions::max_gap`], else
//! [`ImportOptions::gap_factor`] (3) × the series' median step). The first sample of a
//! series and samples after a longer gap are unknown: no row, counted in
//! [`ImportOutcome::skipped`] ([`reason::FIRST`], [`reason::GAP`]).
//!
//! Rows are per GPU per distinct timestamp of its combined timeline: the row at `t` has
//! window `(t_prev, t]` with `t_prev` the GPU's previous timestamp, and carries each
//! series whose valid sample is at `t`, plus — for mean fields (activity, gauges) — the
//! value of a series whose valid interval covers the window, so series on different
//! timelines refine into exact sub-windows rather than overlap. Counters and states
//! (energy, XID) only appear at their own time. Each field is `FieldStats` with count 1
//! and mean = min = max = last = value, so `gpu_util_max` = `gpu_util`; `lost` is false.
//! Identical samples of one series at one time are kept once; differing ones keep the
//! last read and count a warning. The `series` module documents the details (XID).
//!
//! Samples without a timestamp, with a NaN/±Inf value, a DCGM blank sentinel or an
//! implausible value, or a time outside 2000–2199 (a unit mix-up) are skipped with their
//! reason too; malformed input is an [`ImportError`] naming the line (text) or line and
//! column (JSON), and nothing of that input is kept.
//!
//! Rows are deterministic for a given input: importing the same history twice gives the
//! same `(gpu_uuid, time)` rows, which is what makes a re-import idempotent downstream.

mod dcgm;
mod error;
mod json;
mod series;
mod text;

use std::collections::BTreeMap;
use std::time::Duration;

use apron_common::{ClusterName, GpuWindow, HostName, UnixMicros};

pub use dcgm::{MAPPINGS, MetricMapping, mapping, mig_instance_uuid};
pub use error::ImportError;

/// Why samples were skipped: the keys of [`ImportOutcome::skipped`] and
/// [`ImportOutcome::warnings`].
pub mod reason {
    /// The metric name is not one of [`MAPPINGS`](crate::MAPPINGS).
    pub const NOT_MAPPED: &str = "not a dcgm-exporter GPU metric we map";
    /// A series with neither a name before its labels nor a `__name__` label.
    pub const NO_NAME: &str = "no metric name";
    pub const NO_UUID: &str = "no UUID label";
    /// A `UUID` or `GPU_I_ID` label that cannot name a GPU (too long, control
    /// characters, a non-numeric instance id).
    pub const BAD_LABEL: &str = "invalid UUID or GPU_I_ID label";
    pub const NO_TIMESTAMP: &str = "no timestamp";
    pub const NOT_FINITE: &str = "NaN or infinite value";
    /// A DCGM blank sentinel or a reading no GPU can produce.
    pub const OUT_OF_RANGE: &str = "value outside the field's plausible range";
    /// Before 2000 or from 2200 on: usually milliseconds read as seconds or vice versa.
    pub const TIME_RANGE: &str = "timestamp outside 2000-2199 (wrong unit?)";
    pub const FIRST: &str = "first sample of a series";
    pub const GAP: &str = "gap longer than max_gap";
    /// The same value again for the same GPU field and time (time-sliced GPUs repeat
    /// each value once per pod).
    pub const DUPLICATE: &str = "duplicate sample";
    /// A different value for the same GPU field and time, replaced by a later one.
    pub const CONFLICT: &str = "conflicting sample replaced by a later one at the same time";
    /// The warning counted once per (GPU field, time) with conflicting values.
    pub const CONFLICT_WARNING: &str = "conflicting values for one GPU field at one time; kept the last";
}

/// The input formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Format {
    /// Prometheus text exposition 0.0.4 (also `promtool tsdb dump`): ms timestamps.
    PrometheusText,
    /// OpenMetrics text (also `promtool tsdb dump-openmetrics`): timestamps in seconds.
    OpenMetrics,
    /// Prometheus HTTP API JSON (`query_range` or instant query answers).
    PrometheusJson,
}

impl Format {
    pub const fn as_str(self) -> &'static str {
        match self {
            Format::PrometheusText => "prometheus-text",
            Format::OpenMetrics => "openmetrics",
            Format::PrometheusJson => "prometheus-json",
        }
    }

    /// The format a `Content-Type` names (`text/plain; version=0.0.4`,
    /// `application/openmetrics-text; version=1.0.0`, `application/json`), if any.
    pub fn from_content_type(content_type: &str) -> Option<Format> {
        let media = content_type.split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
        match media.as_str() {
            "application/openmetrics-text" => Some(Format::OpenMetrics),
            "text/plain" => Some(Format::PrometheusText),
            "application/json" => Some(Format::PrometheusJson),
            _ => None,
        }
    }

    /// The format of `input` by its content: JSON when it opens with `[` or with a
    /// `{` followed by a `"key":`; otherwise text, OpenMetrics when it ends with
    /// `# EOF`. (A text line may open with `{` too: `{__name__="m"} 1` or Prometheus 3's
    /// `{"m", a="b"} 1`.)
    pub fn detect(input: &[u8]) -> Format {
        let input = input.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(input);
        let start = input.iter().position(|c| !c.is_ascii_whitespace()).unwrap_or(input.len());
        let head = input.get(start..).unwrap_or_default();
        match head.first() {
            Some(b'[') => return Format::PrometheusJson,
            Some(b'{') if opens_json_object(head) => return Format::PrometheusJson,
            _ => {}
        }
        if input.trim_ascii_end().ends_with(b"# EOF") { Format::OpenMetrics } else { Format::PrometheusText }
    }
}

/// Whether `s` (starting with `{`) continues as a JSON object: `{}` or `{"key":`.
fn opens_json_object(s: &[u8]) -> bool {
    let mut i = 1;
    let skip_ws = |i: &mut usize| {
        while s.get(*i).is_some_and(u8::is_ascii_whitespace) {
            *i += 1;
        }
    };
    skip_ws(&mut i);
    match s.get(i) {
        Some(b'}') => return true,
        Some(b'"') => {}
        _ => return false,
    }
    i += 1;
    while let Some(&c) = s.get(i) {
        match c {
            b'\\' => i += 2,
            b'"' => break,
            _ => i += 1,
        }
    }
    i += 1;
    skip_ws(&mut i);
    s.get(i) == Some(&b':')
}

/// How samples become rows.
#[derive(Clone, Debug, PartialEq)]
pub struct ImportOptions {
    /// The longest gap a sample may close and still stand for its interval. `None`:
    /// `gap_factor` × each series' median step.
    pub max_gap: Option<Duration>,
    /// The multiple of a series' median step that is still one interval (default 3);
    /// at least 1.
    pub gap_factor: f64,
    /// The `cluster` of every row.
    pub cluster: Option<ClusterName>,
    /// The `host` of every row, instead of the series' `Hostname`/`instance` labels.
    pub host_override: Option<HostName>,
}

impl Default for ImportOptions {
    fn default() -> Self {
        Self { max_gap: None, gap_factor: 3.0, cluster: None, host_override: None }
    }
}

/// What an import produced.
///
/// Every sample read is either used (it stands for a known interval of its series: its
/// value is in the row at its time, except an XID reading that shows no new XID) or
/// skipped under exactly one reason: `samples_read = samples_used + Σ skipped`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ImportOutcome {
    /// `gpu_samples` rows, sorted by GPU UUID, then time (empty when they were handed
    /// out by [`Importer::finish_in_batches`]).
    pub windows: Vec<GpuWindow>,
    /// Series imported: distinct (GPU or MIG instance, field) pairs with a timestamped,
    /// finite, plausible sample.
    pub series: usize,
    pub samples_read: u64,
    pub samples_used: u64,
    /// Rows produced (`windows.len()` after [`Importer::finish`]).
    pub rows: usize,
    /// Samples not used, by reason (the constants of [`reason`]).
    pub skipped: BTreeMap<String, u64>,
    /// Things that were resolved but deserve a look, by kind, with a count.
    pub warnings: BTreeMap<String, u64>,
    /// The start of the earliest row window (`time − window_s`).
    pub first_us: Option<UnixMicros>,
    /// The end of the latest row window.
    pub last_us: Option<UnixMicros>,
}

/// Collects samples from one or more inputs; [`Importer::finish`] turns them into rows.
#[derive(Debug)]
pub struct Importer {
    builder: series::Builder,
}

impl Importer {
    pub fn new(opts: ImportOptions) -> Result<Self, ImportError> {
        if !opts.gap_factor.is_finite() || opts.gap_factor < 1.0 {
            return Err(ImportError::Options(format!("gap_factor must be a number >= 1, not {}", opts.gap_factor)));
        }
        if opts.max_gap.is_some_and(|g| g.is_zero()) {
            return Err(ImportError::Options("max_gap must be longer than 0".to_owned()));
        }
        Ok(Self { builder: series::Builder::new(opts) })
    }

    /// Adds one input, in `format` or the detected one, and returns the format used.
    /// On error nothing of this input is kept, and the importer can go on.
    /// A live scrape of an exporter: samples without a timestamp are taken at `at` (the
    /// scrape's time); samples with one keep theirs.
    pub fn add_scrape(&mut self, input: &[u8], format: Option<Format>, at: UnixMicros) -> Result<Format, ImportError> {
        self.builder.default_time = Some(at.0);
        let r = self.add(input, format);
        self.builder.default_time = None;
        r
    }

    /// One sample given as parts (an OTLP data point, say): metric name, labels, time,
    /// value — mapped and checked exactly like a parsed line.
    pub fn add_point(&mut self, name: &str, labels: &[(&str, &str)], at: UnixMicros, value: f64) {
        let series = self.builder.resolve(Some(name), labels);
        self.builder.sample(series, Some(at.0), value);
    }

    pub fn add(&mut self, input: &[u8], format: Option<Format>) -> Result<Format, ImportError> {
        let format = format.unwrap_or_else(|| Format::detect(input));
        let mark = self.builder.mark();
        let result = match format {
            Format::PrometheusJson => json::parse(input, &mut self.builder),
            Format::PrometheusText | Format::OpenMetrics => {
                let input = input.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(input);
                match std::str::from_utf8(input) {
                    Err(e) => {
                        let offset = e.valid_up_to();
                        let line = input.get(..offset).map_or(0, |b| b.iter().filter(|&&c| c == b'\n').count()) + 1;
                        Err(ImportError::NotUtf8 { line, offset })
                    }
                    Ok(s) => {
                        let unit = if format == Format::OpenMetrics {
                            text::Timestamps::Seconds
                        } else {
                            text::Timestamps::Millis
                        };
                        text::parse(s, unit, &mut self.builder)
                    }
                }
            }
        };
        let result =
            result.and_then(|()| self.builder.take_spill_error().map_or(Ok(()), |e| Err(ImportError::Spill(e))));
        if result.is_err() {
            self.builder.rollback(mark);
        }
        result.map(|()| format)
    }

    /// Reads one input from `reader` in `format` and returns it. Text is parsed a line
    /// at a time, so memory does not grow with the input's size (only with the
    /// samples kept: see [`Importer::spill_to`]); JSON is read whole (a Prometheus
    /// `query_range` answer is bounded by the server's points-per-query limit). On
    /// error nothing of this input is kept, as with [`Importer::add`].
    pub fn add_reader(&mut self, mut reader: impl std::io::BufRead, format: Format) -> Result<Format, ImportError> {
        let read_err = |e: std::io::Error| ImportError::Read(e.to_string());
        if format == Format::PrometheusJson {
            let mut all = Vec::new();
            reader.read_to_end(&mut all).map_err(read_err)?;
            return self.add(&all, Some(format));
        }
        let mark = self.builder.mark();
        let unit = if format == Format::OpenMetrics { text::Timestamps::Seconds } else { text::Timestamps::Millis };
        let mut lines = text::Lines::new(unit);
        let result = (|| {
            let mut buf = Vec::new();
            let mut offset = 0usize;
            loop {
                buf.clear();
                if reader.read_until(b'\n', &mut buf).map_err(read_err)? == 0 {
                    return Ok(());
                }
                let mut bytes = buf.as_slice();
                if lines.number() == 0 {
                    bytes = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes);
                }
                let line = std::str::from_utf8(bytes)
                    .map_err(|e| ImportError::NotUtf8 { line: lines.number() + 1, offset: offset + e.valid_up_to() })?;
                offset += bytes.len();
                lines.line(line.strip_suffix('\n').unwrap_or(line), &mut self.builder)?;
                if let Some(e) = self.builder.take_spill_error() {
                    return Err(ImportError::Spill(e));
                }
            }
        })();
        if result.is_err() {
            self.builder.rollback(mark);
        }
        result.map(|()| format)
    }

    /// Bounds memory by the number of samples held: past `max_points` (24 bytes each)
    /// they are written to `file`, an empty file the caller opened for this import (an
    /// unnamed temporary one, on a disk with room for about 21 bytes per sample), and
    /// read back one GPU at a time when rows are made. Memory is then `max_points`
    /// plus one GPU's history, whatever the input's size.
    pub fn spill_to(&mut self, file: std::fs::File, max_points: usize) {
        self.builder.spill_to(file, max_points);
    }

    /// The earliest and latest sample time kept so far: every row's window lies
    /// inside, so this bounds what a row can overlap before the rows exist.
    pub fn time_bounds(&self) -> Option<(UnixMicros, UnixMicros)> {
        self.builder.bounds().map(|(a, b)| (UnixMicros(a), UnixMicros(b)))
    }

    /// The rows of everything added, all in [`ImportOutcome::windows`].
    ///
    /// A [`GpuWindow`] holds a slot for every field (about 1.7 KiB), so a history of
    /// millions of rows is better taken with [`Importer::finish_in_batches`]. Fails only
    /// when spilled samples cannot be read back.
    pub fn finish(self) -> Result<ImportOutcome, ImportError> {
        self.builder.finish()
    }

    /// The rows of everything added, handed to `sink` in order (GPU UUID, then time)
    /// in batches of at most `batch_rows`; the outcome's `windows` is then empty. Memory
    /// stays near one batch plus the samples not yet turned into rows. The first error
    /// of `sink` (or a spill that cannot be read back) stops the import and is returned.
    pub fn finish_in_batches<E: From<ImportError>>(
        self,
        batch_rows: usize,
        sink: impl FnMut(Vec<GpuWindow>) -> Result<(), E>,
    ) -> Result<ImportOutcome, E> {
        self.builder.finish_in_batches(batch_rows, sink)
    }
}

/// Imports one input of any supported format (detected from its content).
pub fn import(input: &[u8], opts: &ImportOptions) -> Result<ImportOutcome, ImportError> {
    let mut importer = Importer::new(opts.clone())?;
    importer.add(input, None)?;
    importer.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detects_formats() {
        assert_eq!(Format::detect(br#"{"status":"success","data":{}}"#), Format::PrometheusJson);
        assert_eq!(Format::detect(b" \n[{\"data\":{}}]"), Format::PrometheusJson);
        assert_eq!(Format::detect(b"{ }"), Format::PrometheusJson);
        assert_eq!(Format::detect(br#"{__name__="m", a="b"} 1 1700000000000"#), Format::PrometheusText);
        assert_eq!(Format::detect(br#"{"m", a="b"} 1 1700000000000"#), Format::PrometheusText);
        assert_eq!(Format::detect(b"m 1 1700000000.5\n# EOF\n"), Format::OpenMetrics);
        assert_eq!(Format::detect(b"\xEF\xBB\xBFm 1 1700000000000\n"), Format::PrometheusText);
        assert_eq!(Format::detect(b""), Format::PrometheusText);
        assert_eq!(
            Format::from_content_type("application/openmetrics-text; version=1.0.0; charset=utf-8"),
            Some(Format::OpenMetrics)
        );
        assert_eq!(Format::from_content_type("text/plain; version=0.0.4"), Some(Format::PrometheusText));
        assert_eq!(Format::from_content_type("Application/JSON"), Some(Format::PrometheusJson));
        assert_eq!(Format::from_content_type("text/csv"), None);
    }

    #[test]
    fn options_are_checked() {
        let bad = ImportOptions { gap_factor: 0.5, ..ImportOptions::default() };
        assert!(matches!(Importer::new(bad), Err(ImportError::Options(_))));
        let bad = ImportOptions { max_gap: Some(Duration::ZERO), ..ImportOptions::default() };
        assert!(matches!(Importer::new(bad), Err(ImportError::Options(_))));
    }

    #[test]
    fn not_utf8_names_line_and_offset() {
        let e = import(b"# x\nm{a=\"\xff\"} 1 1\n", &ImportOptions::default()).err();
        assert_eq!(e, Some(ImportError::NotUtf8 { line: 2, offset: 9 }));
    }
}
