//! The weekly idle-cost report: `apron report --week`, `GET /api/v1/reports/weekly`.
//!
//! ```text
//!  gpu_cost_hourly rows of the ISO week ─┐
//!  allocations ⋈ gpu_cost_hourly (stranded per owner) ─┼─► apron_cost::WeeklyReport::build
//!  the previous week (week-over-week) ──┘                  │
//!                                 JSON / CSV (4 tables) / HTML / XLSX
//!  <data>/reports/<week>/  — a week once closed (delivered, `--send`, `--close`) is
//!                            served from there, byte for byte; later changes show as
//!                            a diff against it, and `--recompute` replaces it
//! ```
//!
//! Every figure comes from stored rows: the seconds and micro-dollars of
//! `gpu_cost_hourly`, summed per team by `apron_cost::report` (each line rounded to
//! cents half-even, every total the sum of the rounded lines above it). A stranded
//! allocation's dollars are the `stranded_cost_usd` of the hours of its GPUs that
//! overlap it (hour granularity: two allocations of one team sharing a GPU-hour share
//! its stranded cost — documented in `docs/cost.md`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use apron_cost::report::ShareUnallocated;
use apron_cost::{HourlyRow, IsoWeek, Micros, PriceBook, ReportInput, StrandedFact, WeeklyReport};
use apron_query::{QueryEngine, Scope};
use datafusion::arrow::array::{Array, AsArray, RecordBatch};
use datafusion::arrow::datatypes::{Decimal128Type, Int64Type, TimestampMicrosecondType};

/// A rendering of a report.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReportFormat {
    Json,
    Csv,
    Html,
    Xlsx,
}

impl ReportFormat {
    pub fn parse(s: &str) -> Option<ReportFormat> {
        match s {
            "json" => Some(ReportFormat::Json),
            "csv" => Some(ReportFormat::Csv),
            "html" => Some(ReportFormat::Html),
            "xlsx" => Some(ReportFormat::Xlsx),
            _ => None,
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            ReportFormat::Json => "application/json",
            ReportFormat::Csv => "text/csv; charset=utf-8",
            ReportFormat::Html => "text/html; charset=utf-8",
            ReportFormat::Xlsx => "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet",
        }
    }
}

use crate::sqlutil::ts;

/// Why a weekly report could not be built, rendered, stored or closed.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error(transparent)]
    Query(#[from] apron_query::QueryError),
    #[error("the report model: {0}")]
    Model(String),
    #[error("rendering {format}: {detail}")]
    Render { format: &'static str, detail: String },
    #[error("comparing with the stored report: {0}")]
    Stored(String),
    #[error(transparent)]
    File(#[from] crate::statefile::FileError),
    #[error("{week} has not ended yet (it ends {ends}); a week can be closed once it is over")]
    NotOver { week: String, ends: String },
    /// A week before the data or after this week: HTTP 404 [`NO_SUCH_WEEK`], and
    /// `apron report` exits non-zero with these words.
    #[error("{week} is outside the stored data (from its first hour to this week: {first} to {current})")]
    NoSuchWeek { week: String, first: String, current: String },
}

/// The HTTP error code of [`ReportError::NoSuchWeek`].
pub const NO_SUCH_WEEK: &str = "no_such_week";

fn dec(b: &RecordBatch, i: usize, r: usize) -> Option<i64> {
    let c = b.column(i).as_primitive::<Decimal128Type>();
    (!c.is_null(r)).then(|| i64::try_from(c.value(r)).unwrap_or(i64::MAX))
}

/// The week's `gpu_cost_hourly` rows. Seconds are Decimal(18, 6): the unscaled integer
/// is microseconds; money likewise is micro-dollars.
async fn hourly_rows(engine: &QueryEngine, week: IsoWeek, scope: &Scope) -> Result<Vec<HourlyRow>, ReportError> {
    let sql = format!(
        "SELECT hour, gpu_uuid, team, active_s, allocated_idle_s, stranded_s, unallocated_idle_s, \
         unallocated_busy_s, unknown_s, underused_s, cost_usd, idle_cost_usd, stranded_cost_usd \
         FROM gpu_cost_hourly WHERE hour >= {} AND hour < {} ORDER BY hour, gpu_uuid, team",
        ts(week.start_us()),
        ts(week.end_us())
    );
    let result = engine.execute_internal_as(&sql, scope).await?;
    let mut rows = Vec::new();
    for b in &result.batches {
        let hour = b.column(0).as_primitive::<TimestampMicrosecondType>();
        let (gpu, team) = (b.column(1).as_string::<i32>(), b.column(2).as_string::<i32>());
        for r in 0..b.num_rows() {
            let us = |i| dec(b, i, r).unwrap_or(0);
            rows.push(HourlyRow {
                hour_us: hour.value(r),
                gpu_uuid: gpu.value(r).to_owned(),
                team: team.value(r).to_owned(),
                active_us: us(3),
                allocated_idle_us: us(4),
                stranded_us: us(5),
                unallocated_idle_us: us(6),
                unallocated_busy_us: us(7),
                unknown_us: us(8),
                underused_us: us(9),
                cost_usd: dec(b, 10, r).map(Micros),
                idle_cost_usd: dec(b, 11, r).map(Micros),
                stranded_cost_usd: dec(b, 12, r).map(Micros),
            });
        }
    }
    Ok(rows)
}

/// Stranded time and dollars per allocation owner in the week.
async fn stranded_facts(engine: &QueryEngine, week: IsoWeek, scope: &Scope) -> Result<Vec<StrandedFact>, ReportError> {
    let (from, to) = (ts(week.start_us()), ts(week.end_us()));
    let sql = format!(
        "WITH per_gpu AS ( \
           SELECT a.owner, a.team, a.gpu_uuid, sum(c.stranded_s) AS s, sum(coalesce(c.stranded_cost_usd, 0)) AS usd \
           FROM allocations a JOIN gpu_cost_hourly c \
             ON c.gpu_uuid = a.gpu_uuid AND c.team = a.team \
            AND c.hour + INTERVAL '1 hour' > a.start_time AND (a.end_time IS NULL OR c.hour < a.end_time) \
           WHERE c.hour >= {from} AND c.hour < {to} AND c.stranded_s > 0 AND a.start_time < {to} \
           GROUP BY a.owner, a.team, a.gpu_uuid) \
         SELECT owner, team, count(*) AS gpus, CAST(max(s) * 1000000 AS BIGINT) AS us, \
                CAST(sum(usd) * 1000000 AS BIGINT) AS micros \
         FROM per_gpu GROUP BY owner, team ORDER BY micros DESC, owner"
    );
    let result = engine.execute_internal_as(&sql, scope).await?;
    let mut out = Vec::new();
    for b in &result.batches {
        let (owner, team) = (b.column(0).as_string::<i32>(), b.column(1).as_string::<i32>());
        let gpus = b.column(2).as_primitive::<Int64Type>();
        let (us, micros) = (b.column(3).as_primitive::<Int64Type>(), b.column(4).as_primitive::<Int64Type>());
        for r in 0..b.num_rows() {
            out.push(StrandedFact {
                owner: owner.value(r).to_owned(),
                team: team.value(r).to_owned(),
                gpus: u32::try_from(gpus.value(r)).unwrap_or(u32::MAX),
                duration_us: us.value(r),
                cost: Micros(micros.value(r)),
            });
        }
    }
    Ok(out)
}

/// Builds the report of `week` (and of the week before, for the changes) from the rows
/// `scope` may read: the fleet's, or one team's (its report then covers that team only).
/// On a query server of a cluster it names the shards that were stale as it read them.
pub async fn build(
    engine: &QueryEngine,
    book: Option<&PriceBook>,
    week: IsoWeek,
    share: ShareUnallocated,
    now_us: i64,
    scope: &Scope,
) -> Result<WeeklyReport, ReportError> {
    let version = book.map_or("none (no price book configured)", |b| b.version());
    let example_prices = book.is_some_and(PriceBook::is_example);
    let prices = book.map(|b| b.table()).unwrap_or_default();
    let prev_week = week.previous();
    let prev_rows = hourly_rows(engine, prev_week, scope).await?;
    let prev_stranded = stranded_facts(engine, prev_week, scope).await?;
    let previous = WeeklyReport::build(&ReportInput {
        week: prev_week,
        rows: &prev_rows,
        stranded: &prev_stranded,
        price_book_version: version,
        prices: prices.clone(),
        generated_at_us: now_us,
        share_unallocated: share,
        previous: None,
        example_prices,
    })
    .map_err(|e| ReportError::Model(e.to_string()))?;
    let stale_shards = engine.stale_shards().await;
    let rows = hourly_rows(engine, week, scope).await?;
    let stranded = stranded_facts(engine, week, scope).await?;
    let mut report = WeeklyReport::build(&ReportInput {
        week,
        rows: &rows,
        stranded: &stranded,
        price_book_version: version,
        prices,
        generated_at_us: now_us,
        share_unallocated: share,
        previous: Some(&previous),
        example_prices,
    })
    .map_err(|e| ReportError::Model(e.to_string()))?;
    report.stale_shards = stale_shards;
    Ok(report)
}

/// The files of one rendering: `(file name, bytes)`.
pub fn render(report: &WeeklyReport, format: ReportFormat) -> Result<Vec<(String, Vec<u8>)>, ReportError> {
    Ok(match format {
        ReportFormat::Json => {
            vec![("report.json".into(), report.to_json().map_err(|e| render_error("JSON", e))?.into_bytes())]
        }
        ReportFormat::Html => vec![("report.html".into(), report.to_html().into_bytes())],
        ReportFormat::Csv => report
            .to_csv()
            .map_err(|e| render_error("CSV", e))?
            .into_iter()
            .map(|(name, text)| (name.to_owned(), text.into_bytes()))
            .collect(),
        ReportFormat::Xlsx => vec![("report.xlsx".into(), xlsx(report)?)],
    })
}

fn render_error(format: &'static str, e: impl std::fmt::Display) -> ReportError {
    ReportError::Render { format, detail: e.to_string() }
}

/// One sheet per table, from the report's typed cells (never by re-reading CSV text):
/// money as numbers in a currency format, ratios as percentages, GPU-hours to two
/// decimals, owners and every other text as text (a Slurm job id stays a string next to
/// pod names); a bold, frozen header row and column widths fitted to the content. Each
/// number equals its CSV text's value.
fn xlsx(report: &WeeklyReport) -> Result<Vec<u8>, ReportError> {
    use apron_cost::report::Cell;
    use rust_xlsxwriter::{Format, FormatAlign, Workbook};
    let x = |e: rust_xlsxwriter::XlsxError| render_error("XLSX", e);
    let mut book = Workbook::new();
    let header = Format::new().set_bold().set_text_wrap().set_align(FormatAlign::Top);
    let money = Format::new().set_num_format("\"$\"#,##0.00;-\"$\"#,##0.00");
    let price = Format::new().set_num_format("\"$\"#,##0.00####");
    let percent = Format::new().set_num_format("0.0%");
    let hours = Format::new().set_num_format("#,##0.00");
    let int = Format::new().set_num_format("0");
    for table in report.tables() {
        let sheet = book.add_worksheet();
        sheet.set_name(table.name).map_err(x)?;
        // Characters per column: the header (wrapped at 24) and the longest cell.
        let mut widths: Vec<usize> = table.header.iter().map(|h| h.len().min(24)).collect();
        for (c, h) in table.header.iter().enumerate() {
            let col = u16::try_from(c).map_err(|e| render_error("XLSX", e))?;
            sheet.write_string_with_format(0, col, *h, &header).map_err(x)?;
        }
        for (r, row) in table.rows.iter().enumerate() {
            let row_n = u32::try_from(r + 1).map_err(|e| render_error("XLSX", e))?;
            for (c, cell) in row.iter().enumerate() {
                let col = u16::try_from(c).map_err(|e| render_error("XLSX", e))?;
                let text = cell.to_text();
                let shown = match cell {
                    Cell::Money(_) | Cell::Price(_) => text.len() + 4,
                    _ => text.chars().count(),
                };
                if let Some(w) = widths.get_mut(c) {
                    *w = (*w).max(shown.min(60));
                }
                let format = match cell {
                    Cell::Money(_) => &money,
                    Cell::Price(_) => &price,
                    Cell::Ratio(_) => &percent,
                    Cell::Hours(_) => &hours,
                    Cell::Int(_) => &int,
                    Cell::Text(_) | Cell::Flag(_) => {
                        if !text.is_empty() {
                            sheet.write_string(row_n, col, &text).map_err(x)?;
                        }
                        continue;
                    }
                };
                if let Some(n) = cell.number() {
                    sheet.write_number_with_format(row_n, col, n, format).map_err(x)?;
                }
            }
        }
        for (c, w) in widths.iter().enumerate() {
            let col = u16::try_from(c).map_err(|e| render_error("XLSX", e))?;
            sheet.set_column_width(col, (*w as f64) + 2.0).map_err(x)?;
        }
        sheet.set_freeze_panes(1, 0).map_err(x)?;
    }
    book.save_to_buffer().map_err(x)
}

/// `<data>/reports/<week>/`.
pub fn stored_dir(data_dir: &Path, week: IsoWeek) -> PathBuf {
    data_dir.join("reports").join(week.to_string())
}

/// The stored rendering of `week` in `format`, if the week was written before.
pub fn load_stored(data_dir: &Path, week: IsoWeek, format: ReportFormat) -> Option<Vec<(String, Vec<u8>)>> {
    let dir = stored_dir(data_dir, week);
    let names: Vec<String> = match format {
        ReportFormat::Json => vec!["report.json".into()],
        ReportFormat::Html => vec!["report.html".into()],
        ReportFormat::Xlsx => vec!["report.xlsx".into()],
        ReportFormat::Csv => ["summary.csv", "teams.csv", "top_stranded.csv", "prices.csv"].map(String::from).into(),
    };
    names.into_iter().map(|n| std::fs::read(dir.join(&n)).ok().map(|b| (n, b))).collect()
}

/// Freezes `report`: writes every rendering of it to `<data>/reports/<week>/`
/// (atomically per file), so later requests re-render the week identically.
pub fn store(data_dir: &Path, week: IsoWeek, report: &WeeklyReport) -> Result<PathBuf, ReportError> {
    let mut files = Vec::new();
    for format in [ReportFormat::Json, ReportFormat::Csv, ReportFormat::Html, ReportFormat::Xlsx] {
        files.extend(render(report, format)?);
    }
    Ok(freeze(data_dir, week, files.iter().map(|(n, b)| (n.as_str(), b.as_slice())))?)
}

/// Freezes renderings already made (the schedule's, at the week's first delivery: the
/// frozen copy is byte for byte what was delivered).
pub fn freeze<'a>(
    data_dir: &Path,
    week: IsoWeek,
    files: impl IntoIterator<Item = (&'a str, &'a [u8])>,
) -> Result<PathBuf, crate::statefile::FileError> {
    let dir = stored_dir(data_dir, week);
    for (name, bytes) in files {
        crate::statefile::write(&dir.join(name), bytes)?;
    }
    Ok(dir)
}

/// Fields a report gained after some weeks were frozen: absent from an older frozen
/// copy, they are no change in the data.
const ADDED_FIELDS: [&str; 4] = [".example_prices", ".coverage_gpus", ".coverage_hours", ".coverage_basis"];

/// What changed between a stored report and a recomputation: the figures of their JSON
/// that differ (per team and total figures), for `--recompute` and a closed week's view.
///
/// Exact: both sides are compared as the literal text of their JSON values (the stored
/// file as written, the recomputation as it would be written), never through a float
/// read back — serde_json's default float parser can land one ULP off, which made a
/// closed week report `utilisation: 0.2499605304704768 → 0.24996053047047678` with
/// nothing changed. Money is printed from exact cents and ratios by a shortest
/// round-trip formatter, so unchanged data gives identical text; two numbers written
/// differently still compare equal when they are the same `f64` (std's parser is
/// correctly rounded).
pub fn changes(stored_json: &str, fresh: &WeeklyReport) -> Result<Vec<String>, ReportError> {
    let fresh_json = fresh.to_json().map_err(|e| ReportError::Stored(e.to_string()))?;
    let (mut a, mut b) = (BTreeMap::new(), BTreeMap::new());
    flatten_exact("", stored_json, &mut a).map_err(|e| ReportError::Stored(e.to_string()))?;
    flatten_exact("", &fresh_json, &mut b).map_err(|e| ReportError::Stored(e.to_string()))?;
    let same = |x: &str, y: &str| x == y || matches!((x.parse::<f64>(), y.parse::<f64>()), (Ok(p), Ok(q)) if p == q);
    let mut out = Vec::new();
    for (k, v) in &b {
        if k.ends_with("generated_at") {
            continue;
        }
        match a.get(k) {
            Some(old) if same(old, v) => {}
            Some(old) => out.push(format!("{k}: {old} → {v}")),
            None if ADDED_FIELDS.iter().any(|f| k == f || k.starts_with(&format!("{f}["))) => {}
            None => out.push(format!("{k}: (new) {v}")),
        }
    }
    for (k, v) in &a {
        if !b.contains_key(k) {
            out.push(format!("{k}: {v} → (gone)"));
        }
    }
    Ok(out)
}

/// Flattens JSON text to `path → the literal text of each scalar` (numbers exactly as
/// written; strings as their JSON literal), reading objects and arrays through
/// `serde_json::value::RawValue` so no number is ever converted.
fn flatten_exact(prefix: &str, json: &str, out: &mut BTreeMap<String, String>) -> Result<(), serde_json::Error> {
    use serde_json::value::RawValue;
    match json.trim_start().as_bytes().first() {
        Some(b'{') => {
            let m: BTreeMap<String, &RawValue> = serde_json::from_str(json)?;
            for (k, v) in m {
                flatten_exact(&format!("{prefix}.{k}"), v.get(), out)?;
            }
        }
        Some(b'[') => {
            let a: Vec<&RawValue> = serde_json::from_str(json)?;
            for (i, v) in a.into_iter().enumerate() {
                flatten_exact(&format!("{prefix}[{i}]"), v.get(), out)?;
            }
        }
        _ => {
            out.insert(prefix.to_owned(), json.trim().to_owned());
        }
    }
    Ok(())
}

/// What [`produce`] does with a week's frozen copy (`<data>/reports/<week>/`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Freeze {
    /// Read: a frozen week is served as frozen (with what changed since, for the
    /// caller to show); an open week is built from the data as it is now and stored
    /// nowhere, so a week viewed early still shows the history that arrives later.
    View,
    /// Close the week (`apron report --close`, `--send`, the schedule's delivery): an
    /// open week that has ended is built and frozen; a frozen one is served as frozen.
    Close,
    /// `--recompute`: rebuild from the data and replace the frozen copy (if the week
    /// was closed), returning what changed against it.
    Recompute,
}

/// A produced week: its renderings, whether they are the frozen copy, and the figures
/// that differ between the frozen copy and the data now (empty for an open week).
#[derive(Debug)]
pub struct Produced {
    pub files: Vec<(String, Vec<u8>)>,
    pub frozen: bool,
    pub changed: Vec<String>,
    /// The report's JSON as the files show it (the frozen copy's when frozen), for the
    /// terminal's summary lines (coverage, example prices).
    pub json: Option<String>,
}

/// Builds `week`'s report or serves its frozen copy, as `freeze` says. A week is frozen
/// when it is delivered or closed, never when it is first looked at: until then every
/// request reflects the data; after it, the frozen copy is what finance received and
/// later changes show as a diff against it. `share` is the unallocated idle
/// presentation of a week built now (a frozen week keeps the one it was built with).
#[allow(clippy::too_many_arguments)]
pub async fn produce(
    engine: &QueryEngine,
    book: Option<&PriceBook>,
    data_dir: &Path,
    week: IsoWeek,
    format: ReportFormat,
    freeze: Freeze,
    share: ShareUnallocated,
    now_us: i64,
) -> Result<Produced, ReportError> {
    let stored = load_stored(data_dir, week, format);
    let frozen_json = std::fs::read_to_string(stored_dir(data_dir, week).join("report.json")).ok();
    if freeze == Freeze::Close
        && let Some(files) = stored
    {
        return Ok(Produced { files, frozen: true, changed: Vec::new(), json: frozen_json });
    }
    if stored.is_none() && frozen_json.is_none() {
        // Nothing frozen: a week outside the data is refused as over HTTP.
        check_week_in_data(engine, week, now_us, &Scope::All).await?;
    }
    let fresh = build(engine, book, week, share, now_us, &Scope::All).await?;
    let fresh_json = || fresh.to_json().ok();
    let changed = match &frozen_json {
        Some(old) => changes(old, &fresh)?,
        None => Vec::new(),
    };
    match (freeze, stored) {
        (Freeze::View, Some(files)) => Ok(Produced { files, frozen: true, changed, json: frozen_json }),
        (Freeze::View, None) => {
            Ok(Produced { files: render(&fresh, format)?, frozen: false, changed, json: fresh_json() })
        }
        (Freeze::Close, _) if week.end_us() > now_us => Err(ReportError::NotOver {
            week: week.to_string(),
            ends: apron_common::UnixMicros(week.end_us()).to_rfc3339(),
        }),
        (Freeze::Close, _) => {
            store(data_dir, week, &fresh)?;
            Ok(Produced { files: render(&fresh, format)?, frozen: true, changed, json: fresh_json() })
        }
        (Freeze::Recompute, _) => {
            let frozen = frozen_json.is_some();
            if frozen {
                store(data_dir, week, &fresh)?;
            }
            Ok(Produced { files: render(&fresh, format)?, frozen, changed, json: fresh_json() })
        }
    }
}

/// Whether `week` is one a report exists for: from the week of the first
/// `gpu_cost_hourly` hour `scope` can see (the last finished week at the latest, so it
/// and this week always exist) to this week. Anything else is [`ReportError::NoSuchWeek`]
/// — HTTP 404 `no_such_week`, `apron report` exits non-zero — and nothing is computed or
/// written for it (any of ~18,000 weeks since 1678 could be asked for).
pub async fn check_week_in_data(
    engine: &QueryEngine,
    week: IsoWeek,
    now_us: i64,
    scope: &Scope,
) -> Result<(), ReportError> {
    // No cost table yet (or it cannot be read): only this week and the last one exist.
    let first = first_hour(engine, scope).await.unwrap_or_else(|e| {
        tracing::debug!(error = %e, "no first hour of gpu_cost_hourly");
        None
    });
    let current = current_week(now_us);
    let earliest = first.unwrap_or(i64::MAX).min(current.map_or(now_us, |w| w.previous().start_us()));
    if week.end_us() <= earliest || week.start_us() > now_us {
        let first_week = current_week(earliest).map_or_else(|| "?".to_owned(), |w| w.to_string());
        return Err(ReportError::NoSuchWeek {
            week: week.to_string(),
            first: first_week,
            current: current.map_or_else(|| "?".to_owned(), |w| w.to_string()),
        });
    }
    Ok(())
}

/// The first hour of `gpu_cost_hourly` that `scope` can see, if any.
async fn first_hour(engine: &QueryEngine, scope: &Scope) -> Result<Option<i64>, ReportError> {
    use datafusion::arrow::array::AsArray;
    use datafusion::arrow::datatypes::TimestampMicrosecondType;
    let r = engine.execute_as("SELECT min(hour) FROM gpu_cost_hourly", scope).await?;
    Ok(r.batches.first().and_then(|b| {
        let c = b.column(0).as_primitive_opt::<TimestampMicrosecondType>()?;
        (b.num_rows() > 0 && !c.is_null(0)).then(|| c.value(0))
    }))
}

#[derive(Clone)]
struct ReportState {
    engine: std::sync::Arc<QueryEngine>,
    ledger: Option<std::sync::Arc<crate::ledger::Ledger>>,
    data_dir: PathBuf,
    auth: crate::access::Access,
    share: ShareUnallocated,
}

#[derive(Debug, serde::Deserialize)]
struct ReportQuery {
    week: Option<String>,
    format: Option<String>,
    /// CSV only: which table (`summary`, `teams`, `top_stranded`, `prices`).
    table: Option<String>,
}

/// `GET /api/v1/reports/weekly?week=2026-W48&format=json|csv|html|xlsx[&table=teams]`,
/// behind the same tokens as SQL. Weeks are built with `share` (`[report]
/// share_unallocated`), as the schedule builds them.
pub fn router(
    engine: std::sync::Arc<QueryEngine>,
    ledger: Option<std::sync::Arc<crate::ledger::Ledger>>,
    data_dir: PathBuf,
    auth: crate::access::Access,
    share: ShareUnallocated,
) -> axum::Router {
    axum::Router::new().route("/api/v1/reports/weekly", axum::routing::get(weekly)).with_state(ReportState {
        engine,
        ledger,
        data_dir,
        auth,
        share,
    })
}

async fn weekly(
    axum::extract::State(state): axum::extract::State<ReportState>,
    headers: axum::http::HeaderMap,
    axum::extract::Query(q): axum::extract::Query<ReportQuery>,
) -> axum::response::Response {
    use apron_collector::http::json_error;
    use axum::http::{StatusCode, header};
    use axum::response::IntoResponse;
    let scope = match state.auth.read_scope(&headers) {
        Ok(scope) => scope,
        Err(answer) => return *answer,
    };
    let now = apron_common::UnixMicros::now().0;
    let week = match q.week.as_deref() {
        Some(w) => match IsoWeek::parse(w) {
            Ok(w) => w,
            Err(e) => return json_error(StatusCode::BAD_REQUEST, "bad_week", &e.to_string()),
        },
        // The last finished week.
        None => match current_week(now) {
            Some(w) => w.previous(),
            None => return json_error(StatusCode::INTERNAL_SERVER_ERROR, "clock", "cannot tell the current week"),
        },
    };
    let format = match q.format.as_deref().map(ReportFormat::parse) {
        None => ReportFormat::Json,
        Some(Some(f)) => f,
        Some(None) => {
            return json_error(StatusCode::BAD_REQUEST, "bad_format", "format must be json, csv, html or xlsx");
        }
    };
    let book = state.ledger.as_ref().and_then(|l| l.price_book());
    let stored = match scope {
        Scope::All => load_stored(&state.data_dir, week, format),
        Scope::Team(_) => None,
    };
    if stored.is_none() {
        // A week outside the data is nobody's report: 404, and nothing is computed or
        // written for it (`apron report` refuses it with the same words).
        if let Err(e) = check_week_in_data(&state.engine, week, now, &scope).await {
            return json_error(StatusCode::NOT_FOUND, NO_SUCH_WEEK, &e.to_string());
        }
    }
    let built = || async { render(&build(&state.engine, book, week, state.share, now, &scope).await?, format) };
    let produced = match (&scope, stored) {
        (Scope::All, Some(files)) => Ok(files),
        // A request reads; it never stores a week (the schedule's delivery does, and
        // `apron report`), so a week viewed early still shows data that arrives later.
        // A team's report is built from its rows each time and never stored: the
        // stored report of a finished week is the fleet's.
        (Scope::All, None) | (Scope::Team(_), _) => built().await,
    };
    let files = match produced {
        Ok(files) => files,
        // The report's SQL and the model's text stay in the log, under the answer's id.
        Err(e) => {
            let query = match &e {
                ReportError::Query(q) => Some(q),
                _ => None,
            };
            return crate::access::internal_error("the weekly report", "report_failed", &e, query);
        }
    };
    let body = if format == ReportFormat::Csv {
        let want = format!("{}.csv", q.table.as_deref().unwrap_or("teams"));
        match files.into_iter().find(|(n, _)| *n == want) {
            Some((_, b)) => b,
            None => {
                return json_error(
                    StatusCode::BAD_REQUEST,
                    "bad_table",
                    "table must be summary, teams, top_stranded or prices",
                );
            }
        }
    } else {
        files.into_iter().next().map(|(_, b)| b).unwrap_or_default()
    };
    ([(header::CONTENT_TYPE, format.content_type())], body).into_response()
}

/// The ISO week containing `now_us`.
pub fn current_week(now_us: i64) -> Option<IsoWeek> {
    let day = now_us.div_euclid(86_400_000_000);
    // Try this year's and neighbouring years' weeks: the one whose range holds now.
    let (y, _, _) = apron_common::civil_from_days(day);
    (y - 1..=y + 1)
        .flat_map(|year| (1..=53).filter_map(move |w| IsoWeek::parse(&format!("{year}-W{w:02}")).ok()))
        .find(|w| w.start_us() <= now_us && now_us < w.end_us())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Week 2026-W47 with one GPU-hour of team ml: `active` s active, the rest of
    /// 3600 s stranded (utilisation = active / 3600).
    fn report(active: i64) -> WeeklyReport {
        let week = IsoWeek::parse("2026-W47").expect("week");
        let s = 1_000_000;
        let rows = [HourlyRow {
            hour_us: week.start_us() + 10 * 3600 * s,
            gpu_uuid: "GPU-A".into(),
            team: "ml".into(),
            active_us: active * s,
            stranded_us: (3600 - active) * s,
            cost_usd: Some(Micros(3_600_000)),
            idle_cost_usd: Some(Micros((3600 - active) * 1000)),
            stranded_cost_usd: Some(Micros((3600 - active) * 1000)),
            ..HourlyRow::default()
        }];
        WeeklyReport::build(&ReportInput {
            week,
            rows: &rows,
            stranded: &[],
            price_book_version: "t",
            prices: Vec::new(),
            generated_at_us: week.end_us(),
            share_unallocated: ShareUnallocated::None,
            previous: None,
            example_prices: false,
        })
        .expect("report")
    }

    /// Issue 42, finding 3: a closed week re-read with unchanged data reports no
    /// change, though its utilisation (1/11) is a float serde_json reads back one ULP
    /// off; a real change is still reported, with the exact figures.
    #[test]
    fn closed_week_compares_exactly() {
        let r = report(43); // 43 / 3600 = 0.011944444444444445
        let stored = r.to_json().expect("json");
        // The trap: read back through serde_json's (default, fast) float parser, the
        // stored utilisation is not the figure written. Comparing that way is what
        // reported a change with nothing changed.
        let lossy: serde_json::Value = serde_json::from_str(&stored).expect("parse");
        let fresh = serde_json::to_value(&r).expect("value");
        let u = r.teams[0].utilisation.expect("utilisation");
        if lossy["teams"][0]["utilisation"].as_f64() == Some(u) {
            // Find one that trips it, so the test keeps testing the trap.
            panic!("pick an active time whose utilisation serde_json reads back off (not {u})");
        }
        assert_ne!(lossy, fresh, "the old comparison saw a change");
        assert_eq!(changes(&stored, &r).expect("changes"), Vec::<String>::new(), "nothing changed");
        // Recomputed later (another generated_at): still nothing.
        let mut later = report(43);
        later.generated_at = "2030-01-01T00:00:00Z".into();
        assert_eq!(changes(&stored, &later).expect("changes"), Vec::<String>::new());

        // A real change: one more active second (every other figure rounds the same),
        // shown with the exact figures as written.
        let changed = changes(&stored, &report(44)).expect("changes");
        assert_eq!(
            changed,
            [
                ".fleet.utilisation: 0.011944444444444445 → 0.012222222222222223",
                ".teams[0].utilisation: 0.011944444444444445 → 0.012222222222222223",
            ]
        );
        // A frozen copy from before the report gained its coverage basis and example
        // flag: those new keys are no change in the data.
        let mut old: serde_json::Value = serde_json::from_str(&stored).expect("parse");
        for k in ["example_prices", "coverage_gpus", "coverage_hours", "coverage_basis"] {
            old.as_object_mut().expect("object").remove(k);
        }
        let old = serde_json::to_string_pretty(&old).expect("json");
        let diff = changes(&old, &r).expect("changes");
        // (serde_json re-wrote the stored floats here, so only ask that no added key shows.)
        assert!(diff.iter().all(|c| !c.contains("example_prices") && !c.contains("coverage_basis")), "{diff:?}");
    }
}
