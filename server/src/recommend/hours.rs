//! The recommender's hours: what a run needs from raw windows, per (GPU, owner), summed
//! per clock hour and kept on disk, so that a run over a week reads each raw hour once —
//! when a run first needs it, and again only when late rows land in it — instead of the
//! whole week every `[recommend] interval`.
//!
//! ```text
//!  window (from, to]    (from, a]  │ hours a, a + 1 h, …, b − 1 h │  (b, to]
//!                       raw edge   │ stored partials              │  raw edge
//!                       a = `from` rounded up to the hour, b = `to` rounded down
//!
//!  partial of a piece, per (GPU, owner): held / known / idle seconds; DDSketches of SM
//!  activity, utilisation and memory used; count, mean and M2 of the per-minute idle
//!  share and SM; the identity maxima; the owner columns of its latest window
//!  + per piece: first and last window end, longest window, MIG parents seen
//!  + per piece, in a second file: each (GPU, owner)'s per-minute series (held seconds,
//!    busy or not, mean SM, peak memory), what a pack or right-size proposal replays
//! ```
//!
//! Hour `h` holds the windows that end in `(h, h + 1 h]`, so each minute of the
//! per-minute spread (`date_bin(1 minute, time − 1 µs)`) lies in one piece. Every
//! figure merges exactly: sums and maxima; DDSketch bucket counts (the p95 of a week
//! merged from hours is the p95 of the week read whole, within the sketch's 1 %); the
//! minute moments by Chan's parallel formula (equal up to float rounding, and the
//! confidence they feed is rounded to 0.01). A minute's series row is whole in one piece
//! too, so a replay reads its members' minutes from the stored hours and the edges, as
//! it read them from the window's raw windows before.
//!
//! The store's change feed says which (table, day) spans received rows since the last
//! run; the hours they cover are dropped and recomputed when next needed. Files live in
//! a directory of this process under `<data_dir>/derived/recommend-hours/` and start
//! empty: after a restart the first run reads the window once.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::{Path, PathBuf};

use apron_collector::Store;
use apron_collector::changes::ChangeFeed;
use apron_common::wire::Table;
use apron_cost::replay::Bucket;
use apron_query::sketch;
use datafusion::arrow::array::{Array, AsArray, RecordBatch};
use datafusion::arrow::datatypes::{Float64Type, Int64Type};
use datafusion::arrow::ipc::reader::FileReader;
use datafusion::arrow::ipc::writer::FileWriter;
use sketches_ddsketch::DDSketch;

use crate::sqlutil::{OWNER_COLUMNS_SQL, Owner, owner_at};

pub(crate) const HOUR_US: i64 = 3_600_000_000;

/// Whether a window says anything about activity.
pub(crate) const KNOWN_SQL: &str = "(sm_active_max IS NOT NULL OR gpu_util_max IS NOT NULL)";

/// `t` rounded down to the hour.
pub(crate) fn floor_hour(t: i64) -> i64 {
    t.div_euclid(HOUR_US) * HOUR_US
}

/// `t` rounded up to the hour.
pub(crate) fn ceil_hour(t: i64) -> i64 {
    let f = floor_hour(t);
    if f == t { t } else { f + HOUR_US }
}

/// How `(from, to]` splits: the raw edges (each within one hour) and the whole hours
/// between them, by their start.
pub(crate) fn split(from_us: i64, to_us: i64) -> (Vec<(i64, i64)>, Vec<i64>) {
    let (a, b) = (ceil_hour(from_us), floor_hour(to_us));
    let edges = [(from_us, a.min(to_us)), (a.max(b), to_us)].into_iter().filter(|(lo, hi)| lo < hi).collect();
    let hours = (a..b).step_by(HOUR_US as usize).collect();
    (edges, hours)
}

/// Count, mean and sum of squared deviations of a series (per-minute values).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Moments {
    pub n: f64,
    pub mean: f64,
    pub m2: f64,
}

impl Moments {
    /// Chan et al.'s parallel combination.
    pub fn merge(&mut self, o: Moments) {
        if o.n == 0.0 {
            return;
        }
        if self.n == 0.0 {
            *self = o;
            return;
        }
        let n = self.n + o.n;
        let d = o.mean - self.mean;
        self.mean += d * o.n / n;
        self.m2 += o.m2 + d * d * self.n * o.n / n;
        self.n = n;
    }

    /// Mean and population σ (both 0 for no values, as the SQL's NULLs read before).
    pub fn spread(self) -> apron_cost::recommend::Spread {
        if self.n == 0.0 {
            return apron_cost::recommend::Spread::default();
        }
        apron_cost::recommend::Spread { mean: self.mean, std: (self.m2 / self.n).max(0.0).sqrt() }
    }
}

/// One (GPU, owner)'s figures over the pieces folded so far.
#[derive(Clone)]
pub(crate) struct Usage {
    pub host: String,
    pub cluster: Option<String>,
    pub model: String,
    pub mig: Option<String>,
    pub fb_total: Option<i64>,
    pub held_s: f64,
    pub known_s: f64,
    pub idle_s: f64,
    pub sm: Option<DDSketch>,
    pub util: Option<DDSketch>,
    pub mem: Option<DDSketch>,
    pub idle_minutes: Moments,
    pub sm_minutes: Moments,
    /// End of the latest window, and its owner columns.
    pub last_us: i64,
    pub owner: Option<Owner>,
}

impl Usage {
    fn merge(&mut self, o: Usage) -> Result<(), HoursError> {
        self.host = std::mem::take(&mut self.host).max(o.host);
        self.cluster = self.cluster.take().max(o.cluster);
        self.model = std::mem::take(&mut self.model).max(o.model);
        self.mig = self.mig.take().max(o.mig);
        self.fb_total = self.fb_total.max(o.fb_total);
        self.held_s += o.held_s;
        self.known_s += o.known_s;
        self.idle_s += o.idle_s;
        for (mine, theirs) in [(&mut self.sm, o.sm), (&mut self.util, o.util), (&mut self.mem, o.mem)] {
            match (mine.as_mut(), theirs) {
                (Some(m), Some(t)) => sketch::merge(m, &t).map_err(|e| HoursError::Sketch(e.to_string()))?,
                (None, Some(t)) => *mine = Some(t),
                (_, None) => {}
            }
        }
        self.idle_minutes.merge(o.idle_minutes);
        self.sm_minutes.merge(o.sm_minutes);
        if o.last_us > self.last_us {
            self.last_us = o.last_us;
            self.owner = o.owner;
        }
        Ok(())
    }

    /// Quantile `q` of a sketch, `None` when it saw no value.
    pub fn quantile(s: Option<&DDSketch>, q: f64) -> Option<f64> {
        s.and_then(|s| sketch::quantile(s, q).ok().flatten())
    }
}

/// `(gpu_uuid, owner_kind, owner)`.
pub(crate) type Key = (String, String, String);

/// The first and last window end of a piece (all windows, held or not), and its longest
/// window, µs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Coverage {
    pub first_us: i64,
    pub last_us: i64,
    pub window_us: i64,
}

impl Coverage {
    pub fn merge(a: Option<Coverage>, b: Option<Coverage>) -> Option<Coverage> {
        match (a, b) {
            (Some(a), Some(b)) => Some(Coverage {
                first_us: a.first_us.min(b.first_us),
                last_us: a.last_us.max(b.last_us),
                window_us: a.window_us.max(b.window_us),
            }),
            (a, b) => a.or(b),
        }
    }

    /// How much of `(from, to]` the windows cover: from the start of the first (its end
    /// less the longest window) to the end of the last.
    pub fn within(self, from_us: i64, to_us: i64) -> Option<i64> {
        let span = self.last_us.min(to_us) - (self.first_us - self.window_us).max(from_us);
        (span > 0).then_some(span)
    }
}

/// A piece's partial: its rows (see [`partial_sql`]), its per-minute series (see
/// [`minutes_sql`]) and what the run needs besides.
#[derive(Default)]
pub(crate) struct Piece {
    pub batches: Vec<RecordBatch>,
    pub minutes: Vec<RecordBatch>,
    pub coverage: Option<Coverage>,
    pub parents: BTreeSet<String>,
}

/// The SQL of a piece's partial over `range` (a `time` filter within one hour), for the
/// GPUs `slice` admits.
pub(crate) fn partial_sql(range: &str, slice: &str, idle: &str) -> String {
    let known = KNOWN_SQL;
    let owner_cols: Vec<String> = OWNER_COLUMNS_SQL.split(", ").map(|c| format!("o.{c}")).collect();
    let owner_cols = owner_cols.join(", ");
    format!(
        "WITH w AS (SELECT * FROM gpu_samples WHERE {range} AND owner IS NOT NULL AND NOT gpu_lost{slice}), \
         s AS (SELECT gpu_uuid, owner_kind, owner, max(\"host\") AS host_, max(\"cluster\") AS cluster_, \
           max(gpu_model) AS model_, max(mig_profile) AS mig_, max(CAST(fb_total_bytes AS BIGINT)) AS fb_total_, \
           sum(window_s) AS held_, sum(CASE WHEN {known} THEN window_s ELSE 0 END) AS known_, \
           sum(CASE WHEN {idle} THEN window_s ELSE 0 END) AS idle_, \
           ddsketch(CAST(sm_active AS DOUBLE)) AS sm_, ddsketch(CAST(gpu_util AS DOUBLE)) AS util_, \
           ddsketch(CAST(fb_used_bytes AS DOUBLE)) AS mem_ \
           FROM w GROUP BY gpu_uuid, owner_kind, owner), \
         m AS (SELECT gpu_uuid, owner_kind, owner, date_bin(INTERVAL '1 minute', time - INTERVAL '1 microsecond') AS minute_, \
           sum(CASE WHEN {idle} THEN window_s ELSE 0 END) / nullif(sum(CASE WHEN {known} THEN window_s ELSE 0 END), 0) AS idle_share, \
           avg(CAST(coalesce(sm_active, gpu_util) AS DOUBLE)) AS sm FROM w GROUP BY 1, 2, 3, 4), \
         sp AS (SELECT gpu_uuid, owner_kind, owner, count(idle_share) AS n_i, avg(idle_share) AS mean_i, \
           var_pop(idle_share) AS var_i, count(sm) AS n_s, avg(sm) AS mean_s, var_pop(sm) AS var_s \
           FROM m GROUP BY 1, 2, 3), \
         o AS (SELECT DISTINCT ON (gpu_uuid, owner_kind, owner) gpu_uuid AS g_, owner_kind AS k_, owner AS o_, \
           CAST(time AS BIGINT) AS last_, {OWNER_COLUMNS_SQL} FROM w ORDER BY gpu_uuid, owner_kind, owner, time DESC) \
         SELECT s.gpu_uuid, s.owner_kind, s.owner, host_, cluster_, model_, mig_, fb_total_, held_, known_, idle_, \
           sm_, util_, mem_, n_i, mean_i, var_i, n_s, mean_s, var_s, last_, {owner_cols} \
         FROM s JOIN sp ON s.gpu_uuid = sp.gpu_uuid AND s.owner_kind = sp.owner_kind AND s.owner = sp.owner \
         JOIN o ON s.gpu_uuid = o.g_ AND s.owner_kind = o.k_ AND s.owner = o.o_"
    )
}

/// The SQL of a piece's per-minute series over `range` (a `time` filter within one
/// hour), for the GPUs `slice` admits: per (GPU, owner) and minute (`date_bin(1 minute,
/// time − 1 µs)`, µs), whether any window computed, the mean SM (`sm_active`, else
/// `gpu_util`), the peak memory used and the seconds held (at most 60), over the windows
/// the partial reads (held, not lost).
pub(crate) fn minutes_sql(range: &str, slice: &str, idle: &str) -> String {
    format!(
        "SELECT gpu_uuid, owner_kind, owner, \
         CAST(date_bin(INTERVAL '1 minute', time - INTERVAL '1 microsecond') AS BIGINT) AS minute, \
         bool_or(NOT coalesce({idle}, true)) AS busy, avg(CAST(coalesce(sm_active, gpu_util) AS DOUBLE)) AS sm, \
         max(CAST(fb_used_bytes AS BIGINT)) AS mem, CAST(least(sum(window_s), 60.0) AS DOUBLE) AS held \
         FROM gpu_samples WHERE {range} AND owner IS NOT NULL AND NOT gpu_lost{slice} GROUP BY 1, 2, 3, 4"
    )
}

/// Adds the minutes of `batches` (rows of [`minutes_sql`]) whose (GPU, owner) is in
/// `wanted` to `out`, unsorted.
pub(crate) fn fold_minutes(
    batches: impl IntoIterator<Item = Result<RecordBatch, HoursError>>,
    wanted: &BTreeSet<Key>,
    out: &mut BTreeMap<Key, Vec<Bucket>>,
) -> Result<(), HoursError> {
    let gpus: BTreeSet<&str> = wanted.iter().map(|(g, _, _)| g.as_str()).collect();
    for b in batches {
        let b = b?;
        let s = |i: usize| b.column(i).as_string_opt::<i32>().ok_or(HoursError::Shape(i));
        let (gpu, kind, owner) = (s(0)?, s(1)?, s(2)?);
        let minute = b.column(3).as_primitive_opt::<Int64Type>().ok_or(HoursError::Shape(3))?;
        let busy = b.column(4).as_boolean_opt().ok_or(HoursError::Shape(4))?;
        let sm = b.column(5).as_primitive_opt::<Float64Type>().ok_or(HoursError::Shape(5))?;
        let mem = b.column(6).as_primitive_opt::<Int64Type>().ok_or(HoursError::Shape(6))?;
        let held = b.column(7).as_primitive_opt::<Float64Type>().ok_or(HoursError::Shape(7))?;
        for r in 0..b.num_rows() {
            // Most rows are of GPUs no proposal holds: rejected before a key is built.
            if gpu.is_null(r) || kind.is_null(r) || owner.is_null(r) || !gpus.contains(gpu.value(r)) {
                continue;
            }
            let key = (gpu.value(r).to_owned(), kind.value(r).to_owned(), owner.value(r).to_owned());
            if !wanted.contains(&key) {
                continue;
            }
            out.entry(key).or_default().push(Bucket {
                start_us: minute.value(r),
                len_us: (held.value(r) * 1e6).round() as i64,
                held: true,
                busy: !busy.is_null(r) && busy.value(r),
                sm: (!sm.is_null(r)).then(|| sm.value(r)),
                mem_bytes: (!mem.is_null(r)).then(|| mem.value(r)),
            });
        }
    }
    Ok(())
}

/// Puts each series of `out` in time order (pieces and files come in any order).
pub(crate) fn sort_series(out: &mut BTreeMap<Key, Vec<Bucket>>) {
    for buckets in out.values_mut() {
        buckets.sort_by_key(|b| b.start_us);
    }
}

/// What can go wrong with the stored hours.
#[derive(Debug, thiserror::Error)]
pub enum HoursError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {source}")]
    Arrow { path: PathBuf, source: datafusion::arrow::error::ArrowError },
    #[error("a partial's column {0} has an unexpected type")]
    Shape(usize),
    #[error("a partial's sketch: {0}")]
    Sketch(String),
}

/// Adds each row of a partial's `batches` to `acc`.
pub(crate) fn fold(batches: &[RecordBatch], acc: &mut BTreeMap<Key, Usage>) -> Result<(), HoursError> {
    for b in batches {
        let s = |i: usize| b.column(i).as_string_opt::<i32>().ok_or(HoursError::Shape(i));
        let f = |i: usize| b.column(i).as_primitive_opt::<Float64Type>().ok_or(HoursError::Shape(i));
        let n = |i: usize| b.column(i).as_primitive_opt::<Int64Type>().ok_or(HoursError::Shape(i));
        let bin = |i: usize| b.column(i).as_binary_opt::<i32>().ok_or(HoursError::Shape(i));
        let (gpu, kind, owner, host, cluster, model, mig) = (s(0)?, s(1)?, s(2)?, s(3)?, s(4)?, s(5)?, s(6)?);
        let (fb_total, held, known, idle) = (n(7)?, f(8)?, f(9)?, f(10)?);
        let (sm, util, mem) = (bin(11)?, bin(12)?, bin(13)?);
        let (n_i, mean_i, var_i, n_s, mean_s, var_s, last) = (n(14)?, f(15)?, f(16)?, n(17)?, f(18)?, f(19)?, n(20)?);
        let opt_s =
            |c: &datafusion::arrow::array::StringArray, r: usize| (!c.is_null(r)).then(|| c.value(r).to_owned());
        let opt_f = |c: &datafusion::arrow::array::Float64Array, r: usize| if c.is_null(r) { 0.0 } else { c.value(r) };
        let moments = |cnt: &datafusion::arrow::array::Int64Array,
                       mean: &datafusion::arrow::array::Float64Array,
                       var: &datafusion::arrow::array::Float64Array,
                       r: usize| {
            let k = if cnt.is_null(r) { 0.0 } else { cnt.value(r) as f64 };
            Moments { n: k, mean: opt_f(mean, r), m2: opt_f(var, r) * k }
        };
        let decode = |c: &datafusion::arrow::array::BinaryArray, r: usize| -> Result<Option<DDSketch>, HoursError> {
            if c.is_null(r) {
                return Ok(None);
            }
            sketch::decode(c.value(r)).map(Some).map_err(|e| HoursError::Sketch(e.to_string()))
        };
        for r in 0..b.num_rows() {
            if gpu.is_null(r) || kind.is_null(r) || owner.is_null(r) {
                continue;
            }
            let usage = Usage {
                host: host.value(r).to_owned(),
                cluster: opt_s(cluster, r),
                model: model.value(r).to_owned(),
                mig: opt_s(mig, r),
                fb_total: (!fb_total.is_null(r)).then(|| fb_total.value(r)),
                held_s: opt_f(held, r),
                known_s: opt_f(known, r),
                idle_s: opt_f(idle, r),
                sm: decode(sm, r)?,
                util: decode(util, r)?,
                mem: decode(mem, r)?,
                idle_minutes: moments(n_i, mean_i, var_i, r),
                sm_minutes: moments(n_s, mean_s, var_s, r),
                last_us: last.value(r),
                owner: owner_at(b, 21, r),
            };
            let key = (gpu.value(r).to_owned(), kind.value(r).to_owned(), owner.value(r).to_owned());
            match acc.get_mut(&key) {
                Some(u) => u.merge(usage)?,
                None => {
                    acc.insert(key, usage);
                }
            }
        }
    }
    Ok(())
}

/// What is kept of a stored hour in memory.
#[derive(Clone, Debug, Default)]
struct Meta {
    coverage: Option<Coverage>,
    parents: BTreeSet<String>,
    rows: usize,
    minute_rows: usize,
}

/// The stored hours of one process.
pub(crate) struct Hours {
    dir: tempfile::TempDir,
    feed: ChangeFeed,
    stored: BTreeMap<i64, Meta>,
}

impl std::fmt::Debug for Hours {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hours").field("dir", &self.dir.path()).field("stored", &self.stored.len()).finish()
    }
}

/// Where the hours of every process live, under the data directory.
pub(crate) const DIR: &str = "derived/recommend-hours";

impl Hours {
    /// A fresh directory under `<data_dir>/derived/recommend-hours/`, following `store`'s
    /// changes from now on. Directories of processes that are gone are removed.
    pub fn open(store: &Store) -> Result<Hours, HoursError> {
        let base = store.data_dir().join(DIR);
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| HoursError::Io { path, source }
        };
        std::fs::create_dir_all(&base).map_err(io(&base))?;
        remove_orphans(&base);
        let feed = store.subscribe_changes();
        let dir = tempfile::Builder::new()
            .prefix(&format!("pid{}-", std::process::id()))
            .tempdir_in(&base)
            .map_err(io(&base))?;
        Ok(Hours { dir, feed, stored: BTreeMap::new() })
    }

    fn path(&self, hour: i64) -> PathBuf {
        self.dir.path().join(format!("{hour}.arrow"))
    }

    fn minutes_path(&self, hour: i64) -> PathBuf {
        self.dir.path().join(format!("{hour}.minutes.arrow"))
    }

    /// Drops the hours that received rows since the last call.
    pub fn invalidate(&mut self) {
        let changed = self.feed.take();
        for (_, span) in changed.hours(Table::GpuSamples) {
            let (lo, hi) = (floor_hour(span.min_us - 1), floor_hour(span.max_us - 1));
            let dropped: Vec<i64> = self.stored.range(lo..=hi).map(|(h, _)| *h).collect();
            for h in dropped {
                self.forget(h);
            }
        }
    }

    /// Drops stored hour `hour`.
    pub fn forget(&mut self, hour: i64) {
        if self.stored.remove(&hour).is_some() {
            // A file that cannot be removed is overwritten when the hour is next stored.
            let _ = std::fs::remove_file(self.path(hour));
            let _ = std::fs::remove_file(self.minutes_path(hour));
        }
    }

    /// Forgets the hours that start before `hour`.
    pub fn evict_before(&mut self, hour: i64) {
        let old: Vec<i64> = self.stored.range(..hour).map(|(h, _)| *h).collect();
        for h in old {
            self.forget(h);
        }
    }

    pub fn has(&self, hour: i64) -> bool {
        self.stored.contains_key(&hour)
    }

    /// Keeps `piece` as hour `hour` (replacing its files atomically).
    pub fn put(&mut self, hour: i64, piece: Piece) -> Result<(), HoursError> {
        // Forgotten first: an hour whose second file fails is not left half replaced.
        self.forget(hour);
        let rows = write_ipc(&self.path(hour), &piece.batches)?;
        let minute_rows = write_ipc(&self.minutes_path(hour), &piece.minutes)?;
        self.stored.insert(hour, Meta { coverage: piece.coverage, parents: piece.parents, rows, minute_rows });
        Ok(())
    }

    /// The coverage and MIG parents of stored hour `hour`.
    pub fn meta(&self, hour: i64) -> (Option<Coverage>, &BTreeSet<String>) {
        static NONE: BTreeSet<String> = BTreeSet::new();
        match self.stored.get(&hour) {
            Some(m) => (m.coverage, &m.parents),
            None => (None, &NONE),
        }
    }

    /// The rows of stored hour `hour`.
    pub fn read(&self, hour: i64) -> Result<Vec<RecordBatch>, HoursError> {
        if self.stored.get(&hour).is_none_or(|m| m.rows == 0) {
            return Ok(Vec::new());
        }
        read_ipc(&self.path(hour))?.collect()
    }

    /// The per-minute series of stored hour `hour`, a batch at a time.
    pub fn read_minutes(
        &self,
        hour: i64,
    ) -> Result<Box<dyn Iterator<Item = Result<RecordBatch, HoursError>>>, HoursError> {
        if self.stored.get(&hour).is_none_or(|m| m.minute_rows == 0) {
            return Ok(Box::new(std::iter::empty()));
        }
        Ok(Box::new(read_ipc(&self.minutes_path(hour))?))
    }
}

/// Writes `batches` to `path` as an Arrow IPC file (through a temp file and a rename);
/// nothing is written for no rows. The rows written.
fn write_ipc(path: &Path, batches: &[RecordBatch]) -> Result<usize, HoursError> {
    let rows = batches.iter().map(RecordBatch::num_rows).sum();
    let Some(first) = batches.first().filter(|_| rows > 0) else { return Ok(0) };
    let tmp = path.with_extension("tmp");
    let arrow = |source| HoursError::Arrow { path: tmp.clone(), source };
    let file = File::create(&tmp).map_err(|source| HoursError::Io { path: tmp.clone(), source })?;
    let mut w = FileWriter::try_new(file, &first.schema()).map_err(arrow)?;
    for b in batches.iter().filter(|b| b.num_rows() > 0) {
        w.write(b).map_err(arrow)?;
    }
    w.finish().map_err(arrow)?;
    std::fs::rename(&tmp, path).map_err(|source| HoursError::Io { path: path.to_path_buf(), source })?;
    Ok(rows)
}

/// The batches of the Arrow IPC file at `path`, read as they are taken.
fn read_ipc(path: &Path) -> Result<impl Iterator<Item = Result<RecordBatch, HoursError>> + use<>, HoursError> {
    let owned = path.to_path_buf();
    let file = File::open(path).map_err(|source| HoursError::Io { path: owned.clone(), source })?;
    let reader = FileReader::try_new(file, None).map_err(|source| HoursError::Arrow { path: owned.clone(), source })?;
    Ok(reader.map(move |b| b.map_err(|source| HoursError::Arrow { path: owned.clone(), source })))
}

/// Removes `pid<N>-…` directories of processes that no longer run (Linux: no
/// `/proc/<N>`); elsewhere nothing is removed.
fn remove_orphans(base: &Path) {
    if !Path::new("/proc/self").exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(base) else { return };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix("pid").and_then(|r| r.split('-').next()) else { continue };
        if pid.parse::<u32>().is_ok() && !Path::new("/proc").join(pid).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_splits_into_raw_edges_and_whole_hours() {
        let h = HOUR_US;
        // Aligned: no edge.
        assert_eq!(split(0, 3 * h), (vec![], vec![0, h, 2 * h]));
        // Inside one hour: one edge.
        assert_eq!(split(10, 20), (vec![(10, 20)], vec![]));
        // Across one hour boundary: two edges, no whole hour.
        assert_eq!(split(h / 2, h + h / 2), (vec![(h / 2, h), (h, h + h / 2)], vec![]));
        assert_eq!(split(h / 2, 3 * h + 1), (vec![(h / 2, h), (3 * h, 3 * h + 1)], vec![h, 2 * h]));
        assert_eq!(split(-h - 1, 0), (vec![(-h - 1, -h)], vec![-h]));
    }

    #[test]
    fn moments_merge_like_one_pass() {
        let xs = [0.0, 1.0, 1.0, 0.5, 0.25, 1.0, 0.0];
        let whole = |xs: &[f64]| {
            let n = xs.len() as f64;
            let mean = xs.iter().sum::<f64>() / n;
            Moments { n, mean, m2: xs.iter().map(|x| (x - mean) * (x - mean)).sum() }
        };
        let mut m = whole(&xs[..3]);
        m.merge(whole(&xs[3..]));
        m.merge(Moments::default());
        let w = whole(&xs);
        assert_eq!(m.n, w.n);
        assert!((m.mean - w.mean).abs() < 1e-12 && (m.m2 - w.m2).abs() < 1e-12, "{m:?} {w:?}");
        let s = Moments { n: 60.0, mean: 0.9, m2: 0.09 * 60.0 }.spread();
        assert!((s.std - 0.3).abs() < 1e-12);
        assert_eq!(Moments::default().spread().mean, 0.0);
    }

    #[test]
    fn minutes_fold_only_the_wanted_pairs_and_survive_a_file() {
        use datafusion::arrow::array::{ArrayRef, BooleanArray, Float64Array, Int64Array, StringArray};
        use std::sync::Arc;
        let strs = |v: [Option<&str>; 3]| Arc::new(StringArray::from(v.to_vec())) as ArrayRef;
        let batch = RecordBatch::try_from_iter([
            ("gpu_uuid", strs([Some("GPU-a"), Some("GPU-a"), Some("GPU-b")])),
            ("owner_kind", strs([Some("pod"), Some("job"), Some("pod")])),
            ("owner", strs([Some("ml/train"), Some("42"), Some("ml/train")])),
            ("minute", Arc::new(Int64Array::from(vec![120_000_000, 60_000_000, 0])) as ArrayRef),
            ("busy", Arc::new(BooleanArray::from(vec![Some(true), None, Some(false)])) as ArrayRef),
            ("sm", Arc::new(Float64Array::from(vec![Some(0.5), None, Some(0.0)])) as ArrayRef),
            ("mem", Arc::new(Int64Array::from(vec![Some(1 << 30), None, Some(0)])) as ArrayRef),
            ("held", Arc::new(Float64Array::from(vec![60.0, 12.5, 60.0])) as ArrayRef),
        ])
        .expect("batch");
        let key = |g: &str, k: &str, o: &str| (g.to_owned(), k.to_owned(), o.to_owned());
        // GPU-a's job is another pair of the same GPU; GPU-b is not asked for.
        let wanted = BTreeSet::from([key("GPU-a", "pod", "ml/train"), key("GPU-c", "pod", "x")]);
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("h.minutes.arrow");
        assert_eq!(write_ipc(&path, std::slice::from_ref(&batch)).expect("write"), 3);
        let mut out = BTreeMap::new();
        fold_minutes(read_ipc(&path).expect("read"), &wanted, &mut out).expect("fold");
        assert_eq!(out.len(), 1);
        let b = out[&key("GPU-a", "pod", "ml/train")].clone();
        assert_eq!(
            b,
            vec![Bucket {
                start_us: 120_000_000,
                len_us: 60_000_000,
                held: true,
                busy: true,
                sm: Some(0.5),
                mem_bytes: Some(1 << 30)
            }]
        );
        // A NULL busy reads as idle, NULL gauges as unknown, held seconds as µs.
        let all = BTreeSet::from([key("GPU-a", "job", "42")]);
        let mut out = BTreeMap::new();
        fold_minutes([Ok(batch)], &all, &mut out).expect("fold");
        let b = out[&key("GPU-a", "job", "42")][0];
        assert_eq!((b.busy, b.sm, b.mem_bytes, b.len_us), (false, None, None, 12_500_000));
        // No rows, no file.
        assert_eq!(write_ipc(&dir.path().join("empty.arrow"), &[]).expect("write"), 0);
        assert!(!dir.path().join("empty.arrow").exists());
    }

    #[test]
    fn coverage_merges_and_clips_to_the_window() {
        let a = Coverage { first_us: 100, last_us: 200, window_us: 10 };
        let b = Coverage { first_us: 50, last_us: 150, window_us: 30 };
        let m = Coverage::merge(Some(a), Some(b)).expect("some");
        assert_eq!(m, Coverage { first_us: 50, last_us: 200, window_us: 30 });
        assert_eq!(m.within(0, 1000), Some(180));
        assert_eq!(m.within(100, 150), Some(50));
        assert_eq!(Coverage::merge(None, Some(a)), Some(a));
        assert_eq!(a.within(300, 400), None);
    }
}
