//! From point samples to `gpu_samples` windows.
//!
//! Parsers hand every sample to a [`Builder`]: a series (name + labels) is resolved once
//! to a target — a GPU, a field, a unit scale, the labels' identity and holder — or to a
//! skip reason; its samples are then appended to their GPU's point list. Nothing is
//! interpreted until [`Builder::finish`], because samples of one series may arrive in
//! any order and from several inputs.
//!
//! `finish`, per GPU (one UUID, or one MIG instance):
//!
//! 1. **Series.** A series is one field of one GPU. Its points are sorted by time.
//!    Points at the same time are one sample: identical values are duplicates (kept
//!    once; time-sliced GPUs repeat every value once per pod), differing values keep the
//!    last in input order and count a warning.
//! 2. **Intervals.** A sample at `t` stands for `(t_prev, t]` of its series when
//!    `t − t_prev ≤ max_gap` (`ImportOptions::max_gap`, else `gap_factor` × the
//!    series' median step). The first sample of a series and samples after a longer gap
//!    stand for nothing known: they are skipped.
//! 3. **Timeline.** The GPU's timeline is every distinct time of any of its samples
//!    (skipped ones included: they still bound intervals). Consecutive times `t_{k−1} <
//!    t_k` give the row window `(t_{k−1}, t_k]`. Every series' interval boundaries are on
//!    the timeline, so each row window lies inside at most one interval per series.
//! 4. **Rows.** The row at `t_k` carries, per series: the sample at `t_k` if it is valid;
//!    else, for activity and gauge fields (means), the valid sample whose interval covers
//!    the window (the next one after `t_k`) — its value holds for all of its interval, so
//!    this is not carry-forward. Counters and states (energy, XID, …) are readings at an
//!    instant and only appear in the row at their own time. A row with no field is not
//!    emitted (e.g. every series was in a gap).
//!
//! When all series share one scrape timeline (the usual case: Prometheus stamps every
//! sample of a scrape alike), this is simply one row per scrape after the first, with
//! `window` = the scrape interval.
//!
//! Each field's [`FieldStats`] has count 1 and mean = min = max = last = the value, so
//! an activity field's `_max` column equals its mean: a point sample says nothing about
//! the peak inside its interval.
//!
//! `DCGM_FI_DEV_XID_ERRORS` is the last XID since the exporter started, while `xid_last`
//! is the XID seen in the window: a sample fills it only when its value is non-zero and
//! differs from the series' previous sample (a repeat of the same code in a later
//! interval cannot be told from no new error).

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use apron_common::{Field, FieldKind, FieldStats, GpuHolder, GpuIdentity, GpuWindow, UnixMicros};

use crate::dcgm::{self, MetricMapping, PodRef};
use crate::{ImportError, ImportOptions, ImportOutcome, reason};

/// A resolved series: an index into the builder's entries.
pub(crate) type SeriesRef = u32;

/// 2000-01-01T00:00:00Z and 2200-01-01T00:00:00Z in µs: a timestamp outside is a unit
/// mistake (ms read as s, or s as ms), not history.
const MIN_TIME_US: i64 = 946_684_800_000_000;
const MAX_TIME_US: i64 = 7_258_118_400_000_000;

#[derive(Clone, Copy, Debug)]
enum Entry {
    Skip(&'static str),
    Target { gpu: u32, mapping: &'static MetricMapping, label: u32 },
}

/// The identity and holder one series' labels describe.
#[derive(Debug)]
struct Labels {
    identity: GpuIdentity,
    owner: Option<PodRef>,
}

#[derive(Clone, Copy, Debug)]
struct Point {
    t: i64,
    v: f64,
    label: u32,
    field: u8,
}

#[derive(Debug)]
struct Gpu {
    key: String,
    /// Points in memory, read after those in `spilled`.
    points: Vec<Point>,
    /// Runs of this GPU's earlier points in the spill file, in input order.
    spilled: Vec<Segment>,
}

/// One run of a GPU's points in the spill file.
#[derive(Clone, Copy, Debug)]
struct Segment {
    offset: u64,
    count: usize,
}

/// Where points go when memory is full: a file the caller opened (a temporary one),
/// written at increasing offsets and read back one GPU at a time by `finish`.
#[derive(Debug)]
struct Spill {
    file: std::fs::File,
    len: u64,
    max_points: usize,
}

/// Bytes of one spilled point: t (i64), v (f64 bits), label (u32), field (u8), LE.
const POINT_BYTES: usize = 21;

impl Point {
    fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.t.to_le_bytes());
        out.extend_from_slice(&self.v.to_bits().to_le_bytes());
        out.extend_from_slice(&self.label.to_le_bytes());
        out.push(self.field);
    }

    fn decode(b: &[u8]) -> Option<Point> {
        Some(Point {
            t: i64::from_le_bytes(b.get(0..8)?.try_into().ok()?),
            v: f64::from_bits(u64::from_le_bytes(b.get(8..16)?.try_into().ok()?)),
            label: u32::from_le_bytes(b.get(16..20)?.try_into().ok()?),
            field: *b.get(20)?,
        })
    }
}

/// Where a builder was before an input, to undo a failed input.
#[derive(Debug)]
pub(crate) struct Mark {
    entries: usize,
    labels: usize,
    gpus: usize,
    points: Vec<usize>,
    spilled: Vec<usize>,
    samples_read: u64,
    skipped: BTreeMap<&'static str, u64>,
}

/// Accumulates samples from any number of inputs; see the module docs.
#[derive(Debug)]
pub(crate) struct Builder {
    opts: ImportOptions,
    entries: Vec<Entry>,
    labels: Vec<Labels>,
    gpus: Vec<Gpu>,
    gpu_by_key: HashMap<String, u32>,
    samples_read: u64,
    skipped: BTreeMap<&'static str, u64>,
    /// The time of samples that carry none (a live scrape: the scrape's time).
    pub(crate) default_time: Option<i64>,
    /// Points held in memory now, over all GPUs.
    in_memory: usize,
    spill: Option<Spill>,
    /// The first failed spill write: the points stay in memory, and the input fails.
    spill_error: Option<String>,
    /// The earliest and latest time of a point kept (µs): every row lies inside.
    bounds: Option<(i64, i64)>,
}

impl Builder {
    pub(crate) fn new(opts: ImportOptions) -> Self {
        Self {
            opts,
            entries: Vec::new(),
            labels: Vec::new(),
            gpus: Vec::new(),
            gpu_by_key: HashMap::new(),
            samples_read: 0,
            skipped: BTreeMap::new(),
            default_time: None,
            in_memory: 0,
            spill: None,
            spill_error: None,
            bounds: None,
        }
    }

    /// From now on, when more than `max_points` points are in memory they are written
    /// to `file` (an empty file the caller opened, normally an unnamed temporary one).
    pub(crate) fn spill_to(&mut self, file: std::fs::File, max_points: usize) {
        self.spill = Some(Spill { file, len: 0, max_points: max_points.max(1) });
    }

    /// The error of a failed spill, if one failed since the last call.
    pub(crate) fn take_spill_error(&mut self) -> Option<String> {
        self.spill_error.take()
    }

    /// The earliest and latest time (µs) of any point kept.
    pub(crate) fn bounds(&self) -> Option<(i64, i64)> {
        self.bounds
    }

    /// Writes every GPU's in-memory points to the spill file.
    fn spill_all(&mut self) {
        use std::os::unix::fs::FileExt;
        let Some(spill) = self.spill.as_mut() else { return };
        let mut buf = Vec::new();
        for g in &mut self.gpus {
            if g.points.is_empty() {
                continue;
            }
            buf.clear();
            for p in &g.points {
                p.encode(&mut buf);
            }
            if let Err(e) = spill.file.write_all_at(&buf, spill.len) {
                self.spill_error.get_or_insert_with(|| format!("writing the import spill file: {e}"));
                return; // the points stay in memory; the input fails when it ends
            }
            g.spilled.push(Segment { offset: spill.len, count: g.points.len() });
            spill.len += buf.len() as u64;
            g.points = Vec::new();
        }
        self.in_memory = 0;
    }

    /// A GPU's points in input order: the spilled runs, then those in memory.
    fn load_points(&self, g: Gpu) -> Result<Vec<Point>, ImportError> {
        use std::os::unix::fs::FileExt;
        if g.spilled.is_empty() {
            return Ok(g.points);
        }
        let Some(spill) = self.spill.as_ref() else {
            return Err(ImportError::Spill("spilled points but no spill file".to_owned()));
        };
        let total = g.spilled.iter().map(|s| s.count).sum::<usize>() + g.points.len();
        let mut points = Vec::with_capacity(total);
        let mut buf = Vec::new();
        for s in &g.spilled {
            buf.resize(s.count * POINT_BYTES, 0);
            spill
                .file
                .read_exact_at(&mut buf, s.offset)
                .map_err(|e| ImportError::Spill(format!("reading the import spill file: {e}")))?;
            points.extend(buf.chunks_exact(POINT_BYTES).filter_map(Point::decode));
        }
        points.extend(g.points);
        Ok(points)
    }

    /// Resolves a series once; its samples then go to [`Builder::sample`].
    pub(crate) fn resolve(&mut self, name: Option<&str>, labels: &[(&str, &str)]) -> SeriesRef {
        let entry = match dcgm::resolve(name, labels, &self.opts) {
            Err(why) => Entry::Skip(why),
            Ok(r) => {
                let key = r.identity.gpu_uuid.as_str();
                let gpu = match self.gpu_by_key.get(key) {
                    Some(&g) => g,
                    None => {
                        let g = u32::try_from(self.gpus.len()).unwrap_or(u32::MAX);
                        self.gpus.push(Gpu { key: key.to_owned(), points: Vec::new(), spilled: Vec::new() });
                        self.gpu_by_key.insert(key.to_owned(), g);
                        g
                    }
                };
                let label = u32::try_from(self.labels.len()).unwrap_or(u32::MAX);
                self.labels.push(Labels { identity: r.identity, owner: r.owner });
                Entry::Target { gpu, mapping: r.mapping, label }
            }
        };
        self.entries.push(entry);
        u32::try_from(self.entries.len() - 1).unwrap_or(u32::MAX)
    }

    /// One sample of a resolved series; `t` in µs since the epoch.
    pub(crate) fn sample(&mut self, series: SeriesRef, t: Option<i64>, value: f64) {
        self.samples_read += 1;
        let Some(&entry) = self.entries.get(series as usize) else {
            return self.skip(reason::NOT_MAPPED, 1);
        };
        let (gpu, mapping, label) = match entry {
            Entry::Skip(why) => return self.skip(why, 1),
            Entry::Target { gpu, mapping, label } => (gpu, mapping, label),
        };
        let field = mapping.field;
        let Some(t) = t.or(self.default_time) else { return self.skip(reason::NO_TIMESTAMP, 1) };
        if !value.is_finite() {
            return self.skip(reason::NOT_FINITE, 1);
        }
        let v = mapping.to_base(value);
        if !dcgm::plausible(field, v) {
            return self.skip(reason::OUT_OF_RANGE, 1);
        }
        if !(MIN_TIME_US..MAX_TIME_US).contains(&t) {
            return self.skip(reason::TIME_RANGE, 1);
        }
        if let Some(g) = self.gpus.get_mut(gpu as usize) {
            g.points.push(Point { t, v, label, field: field.index() as u8 });
            self.in_memory += 1;
            self.bounds = Some(self.bounds.map_or((t, t), |(lo, hi)| (lo.min(t), hi.max(t))));
            if self.spill.as_ref().is_some_and(|s| self.in_memory >= s.max_points) && self.spill_error.is_none() {
                self.spill_all();
            }
        }
    }

    fn skip(&mut self, why: &'static str, n: u64) {
        if n > 0 {
            *self.skipped.entry(why).or_default() += n;
        }
    }

    pub(crate) fn mark(&self) -> Mark {
        Mark {
            entries: self.entries.len(),
            labels: self.labels.len(),
            gpus: self.gpus.len(),
            points: self.gpus.iter().map(|g| g.points.len()).collect(),
            spilled: self.gpus.iter().map(|g| g.spilled.len()).collect(),
            samples_read: self.samples_read,
            skipped: self.skipped.clone(),
        }
    }

    pub(crate) fn rollback(&mut self, m: Mark) {
        self.entries.truncate(m.entries);
        self.labels.truncate(m.labels);
        self.gpus.truncate(m.gpus);
        self.gpu_by_key.retain(|_, g| (*g as usize) < m.gpus);
        for ((g, len), runs) in self.gpus.iter_mut().zip(m.points).zip(m.spilled) {
            if g.spilled.len() > runs {
                // The first spill of this GPU after the mark wrote its `len` pre-mark
                // points in memory first: keep those, drop what followed.
                g.spilled.truncate(runs + usize::from(len > 0));
                if len > 0
                    && let Some(first) = g.spilled.get_mut(runs)
                {
                    first.count = len;
                }
                g.points.clear();
            } else {
                g.points.truncate(len);
            }
        }
        self.in_memory = self.gpus.iter().map(|g| g.points.len()).sum();
        self.spill_error = None;
        self.samples_read = m.samples_read;
        self.skipped = m.skipped;
    }

    /// Applies the point-sample semantics (module docs) and hands the rows, sorted by
    /// GPU UUID and time, to `sink` in batches of up to `batch_rows` (at least 1). The
    /// returned outcome's `windows` is empty; the first error of `sink` stops the work.
    pub(crate) fn finish_in_batches<E: From<ImportError>>(
        mut self,
        batch_rows: usize,
        mut sink: impl FnMut(Vec<GpuWindow>) -> Result<(), E>,
    ) -> Result<ImportOutcome, E> {
        let batch_rows = batch_rows.max(1);
        let mut out = ImportOutcome { samples_read: self.samples_read, ..ImportOutcome::default() };
        let mut warnings: BTreeMap<&'static str, u64> = BTreeMap::new();
        let mut gpus = std::mem::take(&mut self.gpus);
        gpus.sort_by(|a, b| a.key.cmp(&b.key));
        let mut buf: Vec<GpuWindow> = Vec::new();
        let (mut rows, mut first, mut last) = (0usize, None::<UnixMicros>, None::<UnixMicros>);
        let mut failed: Option<E> = None;
        let mut emit = |w: GpuWindow| {
            rows += 1;
            let start = w.time.minus(w.window);
            first = Some(first.map_or(start, |f| f.min(start)));
            last = Some(last.map_or(w.time, |l| l.max(w.time)));
            buf.push(w);
            if buf.len() >= batch_rows
                && let Err(e) = sink(std::mem::take(&mut buf))
            {
                failed = Some(e);
                return false;
            }
            true
        };
        for g in gpus {
            // Each GPU's points are dropped once its rows are out, so memory stays near
            // the points not yet processed (or, spilled, one GPU's) plus one batch.
            let points = match self.load_points(g) {
                Ok(p) => p,
                Err(e) => {
                    failed = Some(E::from(e));
                    break;
                }
            };
            if !self.gpu_rows(points, &mut out, &mut warnings, &mut emit) {
                break;
            }
        }
        if failed.is_none() && !buf.is_empty() {
            sink(std::mem::take(&mut buf))?;
        }
        if let Some(e) = failed {
            return Err(e);
        }
        out.rows = rows;
        out.first_us = first;
        out.last_us = last;
        out.skipped = self.skipped.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
        out.warnings = warnings.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
        Ok(out)
    }

    /// All rows at once in `ImportOutcome::windows`.
    pub(crate) fn finish(self) -> Result<ImportOutcome, ImportError> {
        let mut windows = Vec::new();
        let mut out = self.finish_in_batches::<ImportError>(usize::MAX, |mut batch| {
            windows.append(&mut batch);
            Ok(())
        })?;
        out.windows = windows;
        Ok(out)
    }

    /// The rows of one GPU, to `emit`; false when `emit` asked to stop.
    fn gpu_rows(
        &mut self,
        mut points: Vec<Point>,
        out: &mut ImportOutcome,
        warnings: &mut BTreeMap<&'static str, u64>,
        emit: &mut dyn FnMut(GpuWindow) -> bool,
    ) -> bool {
        // Stable: points of one time keep input order, so "the last" is the last read.
        points.sort_by_key(|p| (p.field, p.t));
        let mut series = Vec::new();
        for run in points.chunk_by(|a, b| a.field == b.field) {
            let Some(field) = run.first().and_then(|p| Field::ALL.get(usize::from(p.field))).copied() else {
                continue;
            };
            series.push(self.series(field, run, warnings));
        }
        out.series += series.len();
        out.samples_used += series.iter().map(|s| s.valid.iter().filter(|&&v| v).count() as u64).sum::<u64>();

        // The timeline, with each time's labels (smallest field first, then input order).
        let mut timeline: Vec<(i64, u32)> = points.iter().map(|p| (p.t, p.label)).collect();
        timeline.sort_by_key(|&(t, _)| t);
        let mut prev: Option<i64> = None;
        let mut values: Vec<(Field, f64)> = Vec::with_capacity(series.len());
        for group in timeline.chunk_by(|a, b| a.0 == b.0) {
            let Some(&(t, first_label)) = group.first() else { continue };
            let Some(t0) = prev.replace(t) else { continue };
            values.clear();
            for s in &mut series {
                while s.ts.get(s.cursor).is_some_and(|&st| st < t) {
                    s.cursor += 1;
                }
                let (Some(&st), Some(true)) = (s.ts.get(s.cursor), s.valid.get(s.cursor).copied()) else {
                    continue;
                };
                let spreads = matches!(s.field.kind(), FieldKind::Activity | FieldKind::Gauge);
                if (st == t || spreads)
                    && let Some(v) = s.vals.get(s.cursor).copied().flatten()
                {
                    values.push((s.field, v));
                }
            }
            if values.is_empty() {
                continue;
            }
            let Some(labels) = self.labels.get(first_label as usize) else { continue };
            let window = Duration::from_micros(u64::try_from(t - t0).unwrap_or(0));
            let mut w = GpuWindow::new(UnixMicros(t), window, labels.identity.clone());
            for &(f, v) in &values {
                w.fields[f.index()] = Some(FieldStats::single(v));
            }
            w.owner = self.holder(group.iter().map(|&(_, l)| l));
            if !emit(w) {
                return false;
            }
        }
        true
    }

    /// One field's series: dedup, intervals, validity.
    fn series(&mut self, field: Field, run: &[Point], warnings: &mut BTreeMap<&'static str, u64>) -> FieldSeries {
        let mut ts = Vec::with_capacity(run.len());
        let mut vs = Vec::with_capacity(run.len());
        for same_t in run.chunk_by(|a, b| a.t == b.t) {
            let Some(last) = same_t.last() else { continue };
            let extra = same_t.len() as u64 - 1;
            if same_t.iter().all(|p| p.v == last.v) {
                self.skip(reason::DUPLICATE, extra);
            } else {
                self.skip(reason::CONFLICT, extra);
                *warnings.entry(reason::CONFLICT_WARNING).or_default() += 1;
            }
            ts.push(last.t);
            vs.push(last.v);
        }
        let max_gap = match self.opts.max_gap {
            Some(d) => Some(i64::try_from(d.as_micros()).unwrap_or(i64::MAX)),
            None => median_step(&ts).map(|m| (m as f64 * self.opts.gap_factor).round() as i64),
        };
        let mut valid = Vec::with_capacity(ts.len());
        let mut vals = Vec::with_capacity(ts.len());
        for i in 0..ts.len() {
            let gap = i.checked_sub(1).and_then(|p| ts.get(p)).map(|&prev| ts[i] - prev);
            let ok = match gap {
                None => {
                    self.skip(reason::FIRST, 1);
                    false
                }
                Some(gap) if max_gap.is_some_and(|m| gap <= m) => true,
                Some(_) => {
                    self.skip(reason::GAP, 1);
                    false
                }
            };
            valid.push(ok);
            let v = vs[i];
            vals.push(match field {
                Field::XidLast => {
                    let prev = i.checked_sub(1).and_then(|p| vs.get(p)).copied();
                    (v != 0.0 && prev != Some(v)).then_some(v)
                }
                _ => Some(v),
            });
        }
        FieldSeries { field, ts, valid, vals, cursor: 0 }
    }

    /// The holder of a row from the labels of the samples at its time: one pod, or
    /// pods sharing a time-sliced GPU (`<namespace>/*`, or `*` across namespaces).
    fn holder(&self, labels: impl Iterator<Item = u32>) -> Option<GpuHolder> {
        let mut pods: Vec<&PodRef> =
            labels.filter_map(|l| self.labels.get(l as usize)).filter_map(|l| l.owner.as_ref()).collect();
        pods.sort();
        pods.dedup();
        let (first, rest) = pods.split_first()?;
        if rest.is_empty() {
            return Some(GpuHolder::pod(first.namespace.clone(), first.pod.clone(), first.container.clone()));
        }
        let same = |f: fn(&PodRef) -> &Option<String>| rest.iter().all(|p| f(p) == f(first));
        Some(match (same(|p| &p.namespace), same(|p| &p.pod)) {
            // Several containers of one pod.
            (true, true) => GpuHolder::pod(first.namespace.clone(), first.pod.clone(), None),
            (true, false) if first.namespace.is_some() => GpuHolder::pod(first.namespace.clone(), None, None),
            _ => GpuHolder::pod(None, None, None),
        })
    }
}

/// One field of one GPU after dedup: times, whether each sample's interval is known,
/// the value it contributes, and a cursor for the row walk.
#[derive(Debug)]
struct FieldSeries {
    field: Field,
    ts: Vec<i64>,
    valid: Vec<bool>,
    vals: Vec<Option<f64>>,
    cursor: usize,
}

/// The median gap between consecutive times (the upper one for an even count); `None`
/// for fewer than two times.
fn median_step(ts: &[i64]) -> Option<i64> {
    let mut gaps: Vec<i64> = ts.windows(2).map(|w| w[1] - w[0]).collect();
    if gaps.is_empty() {
        return None;
    }
    let mid = gaps.len() / 2;
    Some(*gaps.select_nth_unstable(mid).1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use apron_common::days_from_civil;

    #[test]
    fn time_bounds_are_the_documented_dates() {
        assert_eq!(MIN_TIME_US, days_from_civil(2000, 1, 1) * 86_400 * 1_000_000);
        assert_eq!(MAX_TIME_US, days_from_civil(2200, 1, 1) * 86_400 * 1_000_000);
    }

    #[test]
    fn median_step_of_irregular_series() {
        assert_eq!(median_step(&[0]), None);
        assert_eq!(median_step(&[0, 10]), Some(10));
        assert_eq!(median_step(&[0, 15, 30, 45, 165]), Some(15));
        assert_eq!(median_step(&[0, 1, 3, 6]), Some(2));
    }

    const T0: i64 = 1_700_000_000_000_000;
    const S: i64 = 1_000_000;

    fn gpu_labels(uuid: &'static str) -> Vec<(&'static str, &'static str)> {
        vec![("UUID", uuid), ("Hostname", "n1"), ("gpu", "0"), ("modelName", "M")]
    }

    #[test]
    fn offset_timelines_refine_into_exact_windows() {
        // Two gauges of one GPU scraped 5 s apart (two Prometheus jobs): each window of
        // the combined timeline carries the value whose interval covers it.
        let mut b = Builder::new(ImportOptions::default());
        let power = b.resolve(Some("DCGM_FI_DEV_POWER_USAGE"), &gpu_labels("GPU-a"));
        let temp = b.resolve(Some("DCGM_FI_DEV_GPU_TEMP"), &gpu_labels("GPU-a"));
        for k in 0..3 {
            b.sample(power, Some(T0 + k * 15 * S), 100.0 + k as f64);
            b.sample(temp, Some(T0 + (k * 15 + 5) * S), 40.0 + k as f64);
        }
        let out = b.finish().expect("finish");
        let rows: Vec<_> = out
            .windows
            .iter()
            .map(|w| ((w.time.0 - T0) / S, w.window.as_secs(), w.value(Field::PowerWatts), w.value(Field::GpuTempC)))
            .collect();
        assert_eq!(
            rows,
            vec![
                (5, 5, Some(101.0), None),
                (15, 10, Some(101.0), Some(41.0)),
                (20, 5, Some(102.0), Some(41.0)),
                (30, 10, Some(102.0), Some(42.0)),
                (35, 5, None, Some(42.0)),
            ]
        );
        assert_eq!(out.skipped.get(reason::FIRST), Some(&2));
        assert_eq!(out.samples_used, 4);
    }

    #[test]
    fn counters_only_at_their_own_time_and_xid_on_change() {
        let mut b = Builder::new(ImportOptions::default());
        let util = b.resolve(Some("DCGM_FI_DEV_GPU_UTIL"), &gpu_labels("GPU-a"));
        let energy = b.resolve(Some("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"), &gpu_labels("GPU-a"));
        let xid = b.resolve(Some("DCGM_FI_DEV_XID_ERRORS"), &gpu_labels("GPU-a"));
        for k in 0..5 {
            b.sample(util, Some(T0 + k * 10 * S), 50.0);
            b.sample(xid, Some(T0 + k * 10 * S), [0.0, 0.0, 79.0, 79.0, 48.0][k as usize]);
        }
        // Energy read every 20 s only: never spread to the row in between.
        for k in 0..3 {
            b.sample(energy, Some(T0 + k * 20 * S), 1_000_000.0 * (k + 1) as f64);
        }
        let out = b.finish().expect("finish");
        let col = |f: Field| out.windows.iter().map(|w| w.value(f)).collect::<Vec<_>>();
        assert_eq!(col(Field::GpuUtil), vec![Some(0.5); 4]);
        assert_eq!(col(Field::EnergyJoules), vec![None, Some(2000.0), None, Some(3000.0)]);
        assert_eq!(col(Field::XidLast), vec![None, Some(79.0), None, Some(48.0)]);
    }

    #[test]
    fn rollback_forgets_a_failed_input() {
        let mut b = Builder::new(ImportOptions::default());
        let a = b.resolve(Some("DCGM_FI_DEV_GPU_UTIL"), &gpu_labels("GPU-a"));
        b.sample(a, Some(T0), 1.0);
        let m = b.mark();
        let c = b.resolve(Some("DCGM_FI_DEV_GPU_UTIL"), &gpu_labels("GPU-c"));
        b.sample(c, Some(T0), 1.0);
        b.sample(a, Some(T0 + S), 1.0);
        b.sample(a, None, 1.0);
        b.rollback(m);
        let out = b.finish().expect("finish");
        assert_eq!((out.samples_read, out.series, out.rows), (1, 1, 0));
        assert_eq!(out.skipped.get(reason::NO_TIMESTAMP), None);
    }
}
