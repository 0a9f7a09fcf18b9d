//! The `gpu_samples_1m` materializer: stores the rollup of finished days as Parquet, so
//! it outlives raw retention (raw `gpu_samples` 30 d, rollups 400 d by default).
//!
//! ```text
//!  every [rollup] interval (default 1m), one pass at a time:
//!    raw = Store snapshot of gpu_samples (files + memtable)
//!    (once, in a directory whose minutes are labelled by their end: relabel, below)
//!    for each rollup day E that raw data affects (raw day E feeds rollup day E alone),
//!        E finished (E's end + storage.compaction_delay passed), E's end within raw retention,
//!        E missing or stale (rollup::RawView::status against <data>/derived/rollup.json),
//!        E's day merge done (or not coming within an hour: merge_pending):
//!      inputs = raw files of day E (taken before the query)
//!      for each slice of [rollup] gpus_per_query GPUs (64; fewer when their minutes of
//!      the day pass [rollup] minutes_per_query, 16,384: 11 whole days), in UUID order:
//!        rows = QueryEngine::rollup_slice(minutes of E, slice)  — from gpu_samples only
//!        ─► Store::replace_partition_sorted(gpu_samples_1m, E)   — written as they come
//!      (the new file replaces the partition once the last slice is written)
//!      rollup.json[E] = inputs (written atomically, after the partition)
//! ```
//!
//! Stale: a raw file of E exists that the stored day did not read (late data,
//! compaction); files that disappeared (retention) do not count. Days with raw rows still
//! only in memory wait for the persist. The query layer reads the same state file, so a
//! stale day is computed live until it is re-rolled; the state is written after the
//! partition, so a crash in between leaves the day stale (re-rolled), never wrong.
//! Errors are logged and the day is retried at the next pass.
//!
//! Relabel: minutes were labelled by their end before 2026-12-05 (a state file without
//! `labels`, [`rollup::Labels`]). The first pass forgets every day's record, so days
//! that raw data still covers are re-rolled from raw; each older stored day is rewritten
//! from its stored rows moved back one minute (`rollup::relabel_sql`, the same slices and
//! writer), oldest first, and recorded as it is done, so a crash resumes where it
//! stopped (the day in progress and its files are saved first: if its files changed,
//! the rewrite was committed and is not repeated); when none is left the state says
//! `start`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use apron_collector::{Store, Table};
use apron_common::UnixMicros;
use apron_query::QueryEngine;
use apron_query::TableSource;
use apron_query::rollup::{self, DayState, DayStatus, GpuSlice, Labels, Minutes, RawView, RollupState};
use serde::Deserialize;

/// Why a rollup pass could not materialize or relabel a day (retried next pass).
#[derive(Debug, thiserror::Error)]
pub enum DeriveError {
    #[error(transparent)]
    Sql(#[from] crate::sqlutil::SqlError),
    #[error("rollup query: {0}")]
    Query(#[from] apron_query::QueryError),
    #[error("converting the rollup rows: {0}")]
    Convert(#[from] datafusion::error::DataFusionError),
    #[error("storing: {0}")]
    Store(String),
    #[error("saving the rollup state: {0}")]
    State(String),
    #[error("relabelling {date}: {source}")]
    Relabel {
        date: String,
        #[source]
        source: Box<DeriveError>,
    },
}

const DAY_US: i64 = 86_400_000_000;

/// `[rollup]`: the materializer of `gpu_samples_1m`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RollupConfig {
    /// Off: `gpu_samples_1m` is still served, computed live from `gpu_samples` only
    /// (and is lost with raw retention).
    pub enabled: bool,
    /// How often finished days are checked.
    #[serde(with = "apron_common::duration::at_least_1s")]
    pub interval: Duration,
    /// A day is rolled up at most this many GPUs at a time and written as it comes, so
    /// memory follows this, not the fleet's size.
    pub gpus_per_query: usize,
    /// The most minute rows one query aggregates (counted from each GPU's first and last
    /// minute of the day): what bounds a pass's memory, ~13 KB of aggregation state per
    /// minute row (measured), so 16,384 ≈ 210 MB. A whole day is 1,440 minutes per GPU:
    /// 11 GPUs a query. A GPU's day alone may pass it.
    pub minutes_per_query: u64,
}

impl Default for RollupConfig {
    fn default() -> Self {
        RollupConfig { enabled: true, interval: Duration::from_secs(60), gpus_per_query: 64, minutes_per_query: 16_384 }
    }
}

/// What the rollup hands the partition writer.
enum Part {
    Rows(datafusion::arrow::array::RecordBatch),
    Failed(String),
    End,
}

/// Where a day's rows come from.
#[derive(Clone, Copy, Debug)]
enum Source {
    /// Rolled up from `gpu_samples`.
    Raw,
    /// Stored rows labelled by their end, moved back a minute
    /// ([`rollup::relabel_sql`]); `with_next` as there.
    Relabel { with_next: bool },
}

/// What one pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeriveReport {
    /// `(date, rows)` of the days materialized.
    pub materialized: Vec<(String, usize)>,
    /// `(date, rows)` of the stored days moved from end to start labels.
    pub relabelled: Vec<(String, usize)>,
    /// Dates left for a later pass because raw rows of them are still in memory, or
    /// their day merge is still to come ([`merge_pending`]).
    pub waiting: Vec<String>,
    /// Failures; each day is retried at the next pass.
    pub errors: Vec<String>,
}

/// How long a finished day waits for its day merge at most (compaction off, failing or
/// behind), counted from when the merge became due or from when this server first found
/// the day waiting, whichever is later.
const MERGE_WAIT_US: i64 = 3_600_000_000;

/// Whether raw day `day` is about to be merged into its day file: a finished day is
/// merged once `compaction_delay` has passed, at about the time it is first rolled up,
/// and the merge's new file makes a stored rollup stale — rolling up before the merge
/// would read the whole day twice (measured: `apron up` rolled yesterday up at second
/// 61 and again at 120). So the day waits for its merge, for at most [`MERGE_WAIT_US`]
/// after it became due or after `seen_us`, when this server first found it waiting and
/// not yet rolled up: a day that arrives long after its end (a burst of history, a start
/// over stored data) gets its merge only then, and rolled up at once it was read twice
/// (at 1,000 GPUs: 79 s, then 58 s).
fn merge_pending(raw: &[apron_query::DataFile], day: i64, delay_us: i64, seen_us: i64, now_us: i64) -> bool {
    let files = raw.iter().filter(|f| f.day == Some(day)).map(|f| f.path.as_path());
    let due = day.saturating_add(1).saturating_mul(DAY_US).saturating_add(delay_us);
    apron_collector::compact::awaits_day_merge(files) && due.max(seen_us).saturating_add(MERGE_WAIT_US) > now_us
}

/// `YYYY-MM-DD` of a day number.
pub use apron_common::date_string;

/// Materializes `gpu_samples_1m` for finished days.
#[derive(Debug)]
pub struct Materializer {
    store: Arc<Store>,
    engine: Arc<QueryEngine>,
    state_path: std::path::PathBuf,
    /// `[rollup] gpus_per_query` and `minutes_per_query`: a query takes at most that
    /// many GPUs, and fewer where their minutes of the day would pass the budget.
    gpus_per_query: usize,
    minutes_per_query: u64,
    /// One pass at a time, so a day is never materialized twice concurrently; it holds
    /// when this server first found each day waiting for its merge ([`merge_pending`]).
    pass: tokio::sync::Mutex<BTreeMap<i64, i64>>,
}

impl Materializer {
    /// The engine should be built with the same state file
    /// ([`QueryEngine::with_rollup_state`]) so stale days are served live.
    pub fn new(store: Arc<Store>, engine: Arc<QueryEngine>, config: &RollupConfig) -> Materializer {
        let state_path = store.data_dir().join(rollup::STATE_FILE);
        Materializer {
            store,
            engine,
            state_path,
            gpus_per_query: config.gpus_per_query.max(1),
            minutes_per_query: config.minutes_per_query.max(1),
            pass: tokio::sync::Mutex::new(BTreeMap::new()),
        }
    }

    pub fn state_path(&self) -> &std::path::Path {
        &self.state_path
    }

    /// One pass as if the clock read `now_us`.
    pub async fn run_once(&self, now_us: i64) -> DeriveReport {
        let mut waiting_since = self.pass.lock().await;
        let mut report = DeriveReport::default();
        let mut state = match RollupState::load(&self.state_path) {
            Ok(s) => s,
            Err(e) => {
                // Rebuilt from scratch: every stored day counts as stale and is re-rolled.
                report.errors.push(format!("{e}; starting a new rollup state"));
                RollupState::default()
            }
        };
        let store: &Store = &self.store;
        let (raw, stored) =
            match (TableSource::snapshot(store, rollup::RAW), TableSource::snapshot(store, rollup::NAME)) {
                (Ok(r), Ok(s)) => (r, s),
                (Err(e), _) | (_, Err(e)) => {
                    report.errors.push(format!("listing the tables: {e}"));
                    return report;
                }
            };
        let view = RawView::new(raw.files, &raw.batches);
        let stored_days = rollup::stored_days(&stored.files);
        // Days whose stored rollup went (derived retention) are forgotten.
        let before = state.days.len();
        state.days.retain(|d, _| stored_days.contains(d));
        let mut dirty = state.days.len() != before;
        if state.labels != Labels::Start {
            match self.relabel(&mut state, &view, &stored.files, now_us, &mut report).await {
                Ok(()) => dirty = false,
                Err(e) => {
                    report.errors.push(e.to_string());
                    return report;
                }
            }
        }

        let config = store.config();
        let delay = i64::try_from(config.compaction_delay.as_micros()).unwrap_or(i64::MAX);
        let retention = i64::try_from(config.retention_raw.as_micros()).unwrap_or(i64::MAX);
        let mut days: Vec<i64> = view.affected_days().unwrap_or_default().into_iter().collect();
        days.retain(|&d| {
            let end = d.saturating_add(1).saturating_mul(DAY_US);
            end.saturating_add(delay) <= now_us && end >= now_us.saturating_sub(retention)
        });
        // Days no longer candidates (rolled up, or past raw retention) are forgotten.
        waiting_since.retain(|d, _| days.contains(d));
        for day in days {
            let date = date_string(day);
            let missing = match view.status(day, &stored_days, Some(&state)) {
                DayStatus::Current => continue,
                DayStatus::InMemory => {
                    tracing::debug!(%date, "gpu_samples_1m: raw rows of the day are still in memory; waiting");
                    report.waiting.push(date);
                    continue;
                }
                DayStatus::Missing => true,
                DayStatus::Stale => false,
            };
            // A day never rolled up waits from when it was first found; a stored day made
            // stale by late rows, from when its merge became due.
            let seen = if missing { *waiting_since.entry(day).or_insert(now_us) } else { i64::MIN };
            if merge_pending(&view.files, day, delay, seen, now_us) {
                tracing::debug!(%date, "gpu_samples_1m: waiting for the day's merge");
                report.waiting.push(date);
                continue;
            }
            waiting_since.remove(&day);
            let inputs = rollup::inputs(&view.files, day);
            let started = std::time::Instant::now();
            match self.materialize(day, &date, Source::Raw).await {
                Ok(rows) => {
                    state.days.insert(day, DayState { inputs, materialized_us: now_us, rows });
                    dirty = true;
                    tracing::info!(%date, rows, elapsed_ms = started.elapsed().as_millis() as u64, "materialized gpu_samples_1m");
                    report.materialized.push((date, rows));
                    // Saved at once: a later day's failure must not lose this record.
                    if let Err(e) = self.save(&state).await {
                        report.errors.push(e.to_string());
                    } else {
                        dirty = false;
                    }
                }
                Err(e) => {
                    tracing::warn!(%date, error = %e, "materializing gpu_samples_1m failed; retried at the next pass");
                    report.errors.push(format!("{date}: {e}"));
                }
            }
        }
        if dirty && let Err(e) = self.save(&state).await {
            report.errors.push(e.to_string());
        }
        report
    }

    /// Moves a directory whose stored minutes are labelled by their end over to start
    /// labels (see the module docs); `Err` stops the pass, which resumes next time.
    async fn relabel(
        &self,
        state: &mut RollupState,
        view: &RawView,
        stored: &[apron_query::DataFile],
        now_us: i64,
        report: &mut DeriveReport,
    ) -> Result<(), DeriveError> {
        let stored_days = rollup::stored_days(stored);
        let files_of = |day: i64| -> Vec<String> {
            let mut v: Vec<String> = stored
                .iter()
                .filter(|f| f.day == Some(day))
                .filter_map(|f| f.path.file_name().map(|n| n.to_string_lossy().into_owned()))
                .collect();
            v.sort();
            v
        };
        if state.labels == Labels::End {
            tracing::info!(
                days = stored_days.len(),
                "gpu_samples_1m: relabelling stored minutes by their start (once)"
            );
            state.days.clear();
            state.labels = Labels::Relabelling;
            self.save(state).await?;
        }
        let raw_days = view.affected_days().unwrap_or_default();
        // End-labelled: stored, not covered by raw (re-rolled from raw instead), not done.
        let old = |d: i64, state: &RollupState| {
            stored_days.contains(&d) && !raw_days.contains(&d) && !state.days.contains_key(&d)
        };
        let days: Vec<i64> = stored_days.iter().copied().filter(|&d| old(d, state)).collect();
        for day in days {
            let date = date_string(day);
            let before = files_of(day);
            // A rewrite of this day began before a restart: its files changed, so it was
            // committed (the state is saved after the partition): record it, never move
            // it again.
            if let Some((d, files)) = &state.relabelling
                && *d == day
                && *files != before
            {
                tracing::info!(%date, "gpu_samples_1m: relabelled before the restart");
                state.days.insert(day, DayState { inputs: Vec::new(), materialized_us: now_us, rows: 0 });
                state.relabelling = None;
                self.save(state).await?;
                continue;
            }
            state.relabelling = Some((day, before));
            self.save(state).await?;
            let started = std::time::Instant::now();
            let rows = self
                .materialize(day, &date, Source::Relabel { with_next: old(day + 1, state) })
                .await
                .map_err(|e| DeriveError::Relabel { date: date.clone(), source: Box::new(e) })?;
            tracing::info!(%date, rows, elapsed_ms = started.elapsed().as_millis() as u64, "relabelled gpu_samples_1m");
            state.days.insert(day, DayState { inputs: Vec::new(), materialized_us: now_us, rows });
            state.relabelling = None;
            self.save(state).await?;
            report.relabelled.push((date, rows));
        }
        state.labels = Labels::Start;
        state.relabelling = None;
        self.save(state).await
    }

    async fn save(&self, state: &RollupState) -> Result<(), DeriveError> {
        let (state, path) = (state.clone(), self.state_path.clone());
        match tokio::task::spawn_blocking(move || state.save(&path)).await {
            Ok(saved) => saved.map_err(|e| DeriveError::State(e.to_string())),
            Err(e) => Err(DeriveError::State(e.to_string())),
        }
    }

    /// Rolls up day `day` from `gpu_samples` and replaces its partition: a slice of GPUs
    /// at a time, in UUID order, each slice's minutes handed to the partition writer as
    /// they come — the day is never whole in memory.
    async fn materialize(&self, day: i64, date: &str, source: Source) -> Result<usize, DeriveError> {
        let minutes = Minutes::day(day);
        // Each GPU's first and last minute: how many minute rows its slice will hold.
        let gpus_sql = match source {
            Source::Raw => format!(
                "SELECT gpu_uuid, min(time), max(time) FROM {} WHERE {} GROUP BY gpu_uuid ORDER BY gpu_uuid",
                rollup::RAW,
                rollup::raw_filter(minutes)
            ),
            Source::Relabel { .. } => {
                let (from, to) = (UnixMicros(day * DAY_US), UnixMicros((day + 1) * DAY_US));
                format!(
                    "SELECT gpu_uuid, min(time), max(time) FROM {} WHERE time >= '{}' AND time <= '{}' \
                     GROUP BY gpu_uuid ORDER BY gpu_uuid",
                    rollup::NAME,
                    from.to_rfc3339(),
                    to.to_rfc3339()
                )
            }
        };
        let gpus = crate::sqlutil::gpu_spans(&self.engine, &gpus_sql).await?;
        let minutes_of = |(_, lo, hi): &(String, i64, i64)| {
            u64::try_from(hi.div_euclid(rollup::MINUTE_US) - lo.div_euclid(rollup::MINUTE_US) + 1).unwrap_or(1)
        };
        let weights: Vec<u64> = gpus.iter().map(minutes_of).collect();
        let slices = crate::sqlutil::slices(&weights, self.gpus_per_query, self.minutes_per_query);
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Part>(2);
        let (store, owned_date) = (self.store.clone(), date.to_owned());
        let writer = tokio::task::spawn_blocking(move || {
            let parts = std::iter::from_fn(move || match rx.blocking_recv() {
                Some(Part::Rows(b)) => Some(Ok(b)),
                Some(Part::Failed(e)) => Some(Err(e)),
                Some(Part::End) => None,
                // Dropped before the end (the pass was cancelled): nothing is replaced.
                None => Some(Err("the rollup stopped before the day's end".to_owned())),
            });
            store.replace_partition_sorted(Table::GpuSamples1m, &owned_date, parts)
        });
        let mut rows = 0;
        let produced: Result<(), DeriveError> = async {
            for range in slices {
                let chunk = &gpus[range];
                let (Some((first, ..)), Some((last, ..))) = (chunk.first(), chunk.last()) else { continue };
                let slice = GpuSlice { first, last };
                let result = match source {
                    Source::Raw => self.engine.rollup_slice(minutes, slice).await,
                    Source::Relabel { with_next } => {
                        self.engine.execute_internal(&rollup::relabel_sql(day, with_next, slice)).await
                    }
                }?;
                for b in &result.batches {
                    let wire = rollup::to_wire(b)?;
                    rows += wire.num_rows();
                    if tx.send(Part::Rows(wire)).await.is_err() {
                        return Ok(()); // the writer stopped; its error says why
                    }
                }
            }
            Ok(())
        }
        .await;
        let last = match &produced {
            Ok(()) => Part::End,
            Err(e) => Part::Failed(e.to_string()),
        };
        let _ = tx.send(last).await;
        drop(tx);
        let stored = writer.await.map_err(|e| DeriveError::Store(e.to_string()))?;
        produced?;
        stored.map_err(|e| DeriveError::Store(e.to_string()))?;
        Ok(rows)
    }

    /// Runs a pass every `interval` until the task is dropped or aborted.
    pub async fn run(self: Arc<Self>, interval: Duration) {
        let mut tick = tokio::time::interval(interval.max(Duration::from_secs(1)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let r = self.run_once(UnixMicros::now().0).await;
            for e in &r.errors {
                tracing::warn!(error = %e, "gpu_samples_1m materializer");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_defaults_and_humantime() {
        let c: RollupConfig = toml::from_str("").expect("empty");
        assert_eq!(c, RollupConfig::default());
        assert_eq!(c.interval, Duration::from_secs(60));
        let c: RollupConfig = toml::from_str("interval = \"5m\"\nenabled = false").expect("parse");
        assert_eq!(c, RollupConfig { enabled: false, interval: Duration::from_secs(300), ..RollupConfig::default() });
        assert!(toml::from_str::<RollupConfig>("interval = \"soon\"").is_err());
        assert!(toml::from_str::<RollupConfig>("interval = \"1ms\"").is_err());
        assert!(toml::from_str::<RollupConfig>("intervall = \"1m\"").is_err());
        assert_eq!(date_string(20_776), "2026-11-19");
    }

    #[test]
    fn a_finished_day_waits_for_its_merge_for_an_hour_at_most() {
        let file = |day: i64, name: &str| apron_query::DataFile {
            path: std::path::PathBuf::from(format!("/d/gpu_samples/date=x/{name}")),
            bytes: 1,
            day: Some(day),
        };
        let (delay, end) = (3_600_000_000, 11 * DAY_US);
        let due = end + delay;
        let tiers = [file(10, "a.parquet"), file(10, "b.t1.parquet"), file(11, "c.parquet")];
        assert!(merge_pending(&tiers, 10, delay, due, due));
        assert!(merge_pending(&tiers, 10, delay, due, due + MERGE_WAIT_US - 1));
        assert!(!merge_pending(&tiers, 10, delay, due, due + MERGE_WAIT_US), "compaction off or behind");
        // Found waiting only a day later (its rows arrived late): an hour from then.
        let late = due + DAY_US;
        assert!(merge_pending(&tiers, 10, delay, late, late + MERGE_WAIT_US - 1));
        assert!(!merge_pending(&tiers, 10, delay, late, late + MERGE_WAIT_US));
        // One file, or the day file already there (late files beside it): nothing to wait for.
        assert!(!merge_pending(&tiers, 11, delay, due, due));
        let merged = [file(10, "a.day.parquet"), file(10, "late.parquet")];
        assert!(!merge_pending(&merged, 10, delay, late, late));
    }
}
