//! The weekly finance report: a model built from `gpu_cost_hourly`-shaped rows plus
//! stranded-allocation facts, and its JSON, CSV and HTML renderings.
//!
//! # Rounding and reconciliation
//!
//! Sums are exact (µs and micro-dollars) per team; then every **line** is rounded
//! half-even (money to cents, GPU-hours to hundredths), and every total is the sum of the
//! rounded figures it totals: a team's `idle_cost_usd` = its allocated-idle + stranded +
//! unallocated-idle cents; `gpu_hours_allocated` = active + allocated idle + stranded +
//! unknown hundredths; the fleet line = the column sums of the team lines and the
//! unallocated line. So every printed total adds up to the cent, at the price of a fleet
//! figure that may differ by a few cents from rounding the fleet's exact sum.
//!
//! # Definitions
//!
//! - `gpu_hours_allocated` counts the team's held time, including its unknown time (held,
//!   but no samples); `utilisation` = active / (active + allocated idle + stranded), the
//!   allocated time that is known (`null` when there is none).
//! - Unallocated time is its own line (`unallocated`). With `share_unallocated = weighted`
//!   its idle cost is shared across teams in proportion to their `cost_usd`; with `even`,
//!   equally. Shares are whole cents by the **largest-remainder** method (floor each exact
//!   share, hand the leftover cents one by one to the largest remainders, ties to the team
//!   name that sorts first), so they add up exactly to the cents shared; the unallocated
//!   line shows the same amount as a negative share. `weighted` with all costs 0 falls back
//!   to `even`. With no team there is nobody to share with and nothing moves.
//! - Rows with no money (unpriced) add their known time to `unpriced_gpu_hours` and no
//!   dollars; the report never prices them at 0 silently.
//!
//! # Renderings
//!
//! JSON (serde; money as numbers with two decimals), CSV as **one file per table**
//! (`summary.csv`, `teams.csv`, `top_stranded.csv`, `prices.csv` — what finance imports
//! cleanly, one header each), and self-contained HTML that reads at 800 px as a mail body
//! (inline CSS, three narrow team tables, a scaling inline SVG chart, no script). The CSV
//! and the server's XLSX (rust_xlsxwriter) are both written from [`WeeklyReport::tables`]
//! (typed cells). Every rendering says what its coverage is a share of
//! ([`coverage_basis`]) and, when the example price book priced it, that its dollars are
//! example prices ([`EXAMPLE_PRICES_NOTE`]).

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::classify::UNALLOCATED;
use crate::money::{Cents, Micros, div_round_half_even};
use crate::pricebook::PriceTableRow;
use crate::time::{US_PER_DAY, days_from_civil, format_rfc3339, weekday_from_days};

/// Why a report could not be built or rendered.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("{0:?} is not an ISO week like 2026-W48")]
    BadWeek(String),
    #[error(
        "row for {team} at {hour} has both allocated and unallocated idle time; rows must be per (hour, GPU, team)"
    )]
    MixedIdleRow { team: String, hour: String },
    #[error("money overflow summing {0}")]
    Overflow(String),
    #[error("JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("CSV: {0}")]
    Csv(String),
}

/// An ISO 8601 week, UTC: `[Monday 00:00, next Monday 00:00)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct IsoWeek {
    pub year: i64,
    pub week: u32,
}

fn weeks_in_year(year: i64) -> u32 {
    // A year has 53 ISO weeks iff Dec 28 (always in the last week) falls in week 53,
    // i.e. iff Jan 1 is a Thursday, or a Wednesday in a leap year.
    let jan1 = weekday_from_days(days_from_civil(year, 1, 1));
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    if jan1 == 3 || (leap && jan1 == 2) { 53 } else { 52 }
}

impl IsoWeek {
    /// Parses `YYYY-Www` (also `YYYY-ww`, `YYYYWww`).
    pub fn parse(text: &str) -> Result<IsoWeek, ReportError> {
        let bad = || ReportError::BadWeek(text.to_owned());
        let s = text.trim();
        let (y, w) = s.split_once("-W").or_else(|| s.split_once('W')).or_else(|| s.split_once('-')).ok_or_else(bad)?;
        let y = y.strip_suffix('-').unwrap_or(y);
        if y.len() != 4 || !y.bytes().all(|b| b.is_ascii_digit()) || w.is_empty() || w.len() > 2 {
            return Err(bad());
        }
        if !w.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let year: i64 = y.parse().map_err(|_| bad())?;
        let week: u32 = w.parse().map_err(|_| bad())?;
        if week == 0 || week > weeks_in_year(year) {
            return Err(bad());
        }
        Ok(IsoWeek { year, week })
    }

    /// Monday 00:00 UTC of the week, in µs.
    pub fn start_us(self) -> i64 {
        let jan4 = days_from_civil(self.year, 1, 4); // always in week 1
        let monday1 = jan4 - weekday_from_days(jan4);
        (monday1 + 7 * (i64::from(self.week) - 1)) * US_PER_DAY
    }

    pub fn end_us(self) -> i64 {
        self.start_us() + 7 * US_PER_DAY
    }

    /// The week before (for week-over-week).
    pub fn previous(self) -> IsoWeek {
        if self.week > 1 {
            IsoWeek { year: self.year, week: self.week - 1 }
        } else {
            IsoWeek { year: self.year - 1, week: weeks_in_year(self.year - 1) }
        }
    }
}

impl fmt::Display for IsoWeek {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04}-W{:02}", self.year, self.week)
    }
}

/// One `gpu_cost_hourly` row (the columns the report reads).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HourlyRow {
    pub hour_us: i64,
    pub gpu_uuid: String,
    pub team: String,
    pub active_us: i64,
    pub allocated_idle_us: i64,
    pub stranded_us: i64,
    pub unallocated_idle_us: i64,
    pub unallocated_busy_us: i64,
    pub unknown_us: i64,
    pub underused_us: i64,
    /// `None` = unpriced (NULL).
    pub cost_usd: Option<Micros>,
    pub idle_cost_usd: Option<Micros>,
    pub stranded_cost_usd: Option<Micros>,
}

/// One stranded allocation of the week (the server sums its runs' costs per allocation).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StrandedFact {
    pub owner: String,
    pub team: String,
    pub gpus: u32,
    pub duration_us: i64,
    pub cost: Micros,
}

/// How unallocated idle cost is presented.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShareUnallocated {
    #[default]
    None,
    Weighted,
    Even,
}

/// Hundredths of a GPU-hour (the report's hour unit), serialised as a 2-decimal number.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct GpuHours(pub i64);

impl GpuHours {
    /// µs → hundredths of an hour, half-even.
    pub fn from_us(us: i64) -> GpuHours {
        GpuHours(div_round_half_even(i128::from(us), 36_000_000).map_or(0, |v| v as i64))
    }
}

impl std::ops::Add for GpuHours {
    type Output = GpuHours;
    fn add(self, o: GpuHours) -> GpuHours {
        GpuHours(self.0.saturating_add(o.0))
    }
}

impl fmt::Display for GpuHours {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&Cents(self.0), f)
    }
}

impl Serialize for GpuHours {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(self.0 as f64 / 100.0)
    }
}

/// One line of the team table (also the unallocated and fleet lines).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Line {
    pub team: String,
    pub gpu_hours_allocated: GpuHours,
    pub gpu_hours_active: GpuHours,
    pub gpu_hours_underused: GpuHours,
    pub gpu_hours_stranded: GpuHours,
    pub gpu_hours_allocated_idle: GpuHours,
    pub gpu_hours_unallocated_idle: GpuHours,
    pub gpu_hours_unallocated_busy: GpuHours,
    pub gpu_hours_unknown: GpuHours,
    pub unpriced_gpu_hours: GpuHours,
    pub utilisation: Option<f64>,
    pub cost_usd: Cents,
    pub idle_cost_usd: Cents,
    pub allocated_idle_cost_usd: Cents,
    pub stranded_cost_usd: Cents,
    pub unallocated_idle_cost_usd: Cents,
    pub unallocated_share_usd: Cents,
    pub total_usd: Cents,
    pub change_idle_cost_usd: Option<Cents>,
    pub change_cost_usd: Option<Cents>,
}

/// One of the top stranded allocations.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StrandedLine {
    pub owner: String,
    pub team: String,
    pub gpus: u32,
    pub duration_hours: GpuHours,
    pub cost_usd: Cents,
}

/// The weekly report model.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WeeklyReport {
    pub week: String,
    pub week_start: String,
    pub week_end: String,
    pub generated_at: String,
    pub price_book_version: String,
    /// The dollars are priced by the example price book (`example = true` in it, as in
    /// `deploy/pricebook.example.toml`): every rendering says so.
    pub example_prices: bool,
    /// Known GPU-seconds / all GPU-seconds of the rows in the week (`null` with no rows).
    pub coverage: Option<f64>,
    /// GPU-hours with samples (every state but unknown).
    pub known_gpu_hours: GpuHours,
    /// The denominator: the GPU-hours of the week's `gpu_cost_hourly` rows (see
    /// [`coverage_basis`]).
    pub total_gpu_hours: GpuHours,
    /// Distinct GPUs (MIG instances count as GPUs) with rows in the week.
    pub coverage_gpus: u32,
    /// Distinct clock hours of the week with rows (of its 168).
    pub coverage_hours: u32,
    /// What `total_gpu_hours` is, in words ([`coverage_basis`]).
    pub coverage_basis: String,
    pub share_unallocated: ShareUnallocated,
    pub teams: Vec<Line>,
    pub unallocated: Line,
    pub fleet: Line,
    pub top_stranded: Vec<StrandedLine>,
    pub prices: Vec<PriceTableRow>,
    /// Shards of a cluster whose collectors were not current when the report was built
    /// (their rows are what they last persisted); empty (and left out) otherwise.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub stale_shards: Vec<String>,
}

/// Everything a report is built from.
#[derive(Clone, Debug)]
pub struct ReportInput<'a> {
    pub week: IsoWeek,
    pub rows: &'a [HourlyRow],
    pub stranded: &'a [StrandedFact],
    pub price_book_version: &'a str,
    pub prices: Vec<PriceTableRow>,
    pub generated_at_us: i64,
    pub share_unallocated: ShareUnallocated,
    /// The previous week's report, for week-over-week changes.
    pub previous: Option<&'a WeeklyReport>,
    /// The price book is the example one (`PriceBook::is_example`).
    pub example_prices: bool,
}

/// Hours in an ISO week.
pub const WEEK_HOURS: u32 = 168;

/// What a report says wherever it shows dollars priced by the example price book.
pub const EXAMPLE_PRICES_NOTE: &str = "EXAMPLE PRICES: these dollars come from the example price book \
    (deploy/pricebook.example.toml, example = true), not your rates; configure [cost] price_book \
    with your own before acting on them.";

/// The coverage denominator in words: which GPU-hours the ledger has rows for. The
/// ledger (`server/src/ledger`) writes, for each UTC day, a row for every hour of the
/// day (up to the hour last priced) for every GPU that sent samples in that day; hours
/// of such a GPU without samples are unknown. GPUs and days with no samples at all have
/// no rows, so they are not in the denominator.
pub fn coverage_basis(gpus: u32, hours: u32) -> String {
    format!(
        "the GPU-hours the ledger has rows for: {gpus} GPU{}, each for every hour of the UTC days it sent \
         samples in (up to the last hour priced), in {hours} of the week's {WEEK_HOURS} hours; \
         GPUs and days with no samples at all are not counted",
        if gpus == 1 { "" } else { "s" }
    )
}

/// The coverage line of the HTML, the terminal and the mail: the ratio, both GPU-hour
/// figures and what the denominator is. `known` and `total` as printed (`12.34`).
pub fn coverage_sentence(coverage: Option<f64>, known: &str, total: &str, basis: &str) -> String {
    let pct = coverage.map_or_else(|| "n/a".to_owned(), |c| format!("{:.1} %", c * 100.0));
    format!("Data coverage {pct}: {known} GPU-hours with samples of {total} GPU-hours, {basis}.")
}

#[derive(Default)]
struct Agg {
    active: i64,
    underused: i64,
    allocated_idle: i64,
    stranded: i64,
    unallocated_idle: i64,
    unallocated_busy: i64,
    unknown: i64,
    unpriced: i64,
    cost: i64,
    stranded_cost: i64,
    allocated_idle_cost: i64,
    unallocated_idle_cost: i64,
}

fn add(acc: &mut i64, v: i64, what: &str) -> Result<(), ReportError> {
    *acc = acc.checked_add(v).ok_or_else(|| ReportError::Overflow(what.to_owned()))?;
    Ok(())
}

impl Agg {
    fn line(&self, team: &str) -> Line {
        let h = GpuHours::from_us;
        let c = |m: i64| Micros(m).to_cents();
        let (active, alloc_idle, stranded, unknown) =
            (h(self.active), h(self.allocated_idle), h(self.stranded), h(self.unknown));
        let (ai, sc, ui) = (c(self.allocated_idle_cost), c(self.stranded_cost), c(self.unallocated_idle_cost));
        let known_alloc = self.active.saturating_add(self.allocated_idle).saturating_add(self.stranded);
        let cost = c(self.cost);
        Line {
            team: team.to_owned(),
            gpu_hours_allocated: active
                + alloc_idle
                + stranded
                + if team == UNALLOCATED { GpuHours(0) } else { unknown },
            gpu_hours_active: active,
            gpu_hours_underused: h(self.underused),
            gpu_hours_stranded: stranded,
            gpu_hours_allocated_idle: alloc_idle,
            gpu_hours_unallocated_idle: h(self.unallocated_idle),
            gpu_hours_unallocated_busy: h(self.unallocated_busy),
            gpu_hours_unknown: unknown,
            unpriced_gpu_hours: h(self.unpriced),
            utilisation: (known_alloc > 0).then(|| self.active as f64 / known_alloc as f64),
            cost_usd: cost,
            idle_cost_usd: ai + sc + ui,
            allocated_idle_cost_usd: ai,
            stranded_cost_usd: sc,
            unallocated_idle_cost_usd: ui,
            unallocated_share_usd: Cents::ZERO,
            total_usd: cost,
            change_idle_cost_usd: None,
            change_cost_usd: None,
        }
    }
}

/// Splits `total` cents over `weights` by largest remainder (ties: earlier index first,
/// and callers pass teams sorted by name). Weights all zero → equal weights.
pub fn largest_remainder(total: Cents, weights: &[i64]) -> Vec<Cents> {
    if weights.is_empty() {
        return Vec::new();
    }
    let w: Vec<i128> = if weights.iter().all(|x| *x <= 0) {
        vec![1; weights.len()]
    } else {
        weights.iter().map(|x| i128::from((*x).max(0))).collect()
    };
    let sum: i128 = w.iter().sum();
    let t = i128::from(total.0);
    let mut shares: Vec<i128> = w.iter().map(|wi| (t * wi).div_euclid(sum)).collect();
    let mut left = t - shares.iter().sum::<i128>();
    let mut order: Vec<usize> = (0..w.len()).collect();
    order.sort_by(|a, b| (t * w[*b]).rem_euclid(sum).cmp(&(t * w[*a]).rem_euclid(sum)).then(a.cmp(b)));
    for i in order.iter().cycle() {
        if left <= 0 {
            break;
        }
        shares[*i] += 1;
        left -= 1;
    }
    shares.into_iter().map(|v| Cents(v as i64)).collect()
}

fn sum_lines(team: &str, lines: &[&Line]) -> Line {
    let mut f = Line { team: team.to_owned(), ..Line::default() };
    for l in lines {
        f.gpu_hours_allocated = f.gpu_hours_allocated + l.gpu_hours_allocated;
        f.gpu_hours_active = f.gpu_hours_active + l.gpu_hours_active;
        f.gpu_hours_underused = f.gpu_hours_underused + l.gpu_hours_underused;
        f.gpu_hours_stranded = f.gpu_hours_stranded + l.gpu_hours_stranded;
        f.gpu_hours_allocated_idle = f.gpu_hours_allocated_idle + l.gpu_hours_allocated_idle;
        f.gpu_hours_unallocated_idle = f.gpu_hours_unallocated_idle + l.gpu_hours_unallocated_idle;
        f.gpu_hours_unallocated_busy = f.gpu_hours_unallocated_busy + l.gpu_hours_unallocated_busy;
        f.gpu_hours_unknown = f.gpu_hours_unknown + l.gpu_hours_unknown;
        f.unpriced_gpu_hours = f.unpriced_gpu_hours + l.unpriced_gpu_hours;
        f.cost_usd = f.cost_usd + l.cost_usd;
        f.idle_cost_usd = f.idle_cost_usd + l.idle_cost_usd;
        f.allocated_idle_cost_usd = f.allocated_idle_cost_usd + l.allocated_idle_cost_usd;
        f.stranded_cost_usd = f.stranded_cost_usd + l.stranded_cost_usd;
        f.unallocated_idle_cost_usd = f.unallocated_idle_cost_usd + l.unallocated_idle_cost_usd;
        f.unallocated_share_usd = f.unallocated_share_usd + l.unallocated_share_usd;
        f.total_usd = f.total_usd + l.total_usd;
    }
    f
}

impl WeeklyReport {
    /// Builds the report. Rows outside the week are ignored.
    pub fn build(input: &ReportInput<'_>) -> Result<WeeklyReport, ReportError> {
        let (from, to) = (input.week.start_us(), input.week.end_us());
        let mut aggs: BTreeMap<&str, Agg> = BTreeMap::new();
        let (mut known, mut all) = (0i64, 0i64);
        let (mut gpus_seen, mut hours_seen) = (std::collections::BTreeSet::new(), std::collections::BTreeSet::new());
        for r in input.rows.iter().filter(|r| r.hour_us >= from && r.hour_us < to) {
            gpus_seen.insert(r.gpu_uuid.as_str());
            hours_seen.insert(r.hour_us);
            let allocated_idle_like = r.allocated_idle_us.saturating_add(r.stranded_us);
            if r.unallocated_idle_us > 0 && allocated_idle_like > 0 {
                return Err(ReportError::MixedIdleRow { team: r.team.clone(), hour: format_rfc3339(r.hour_us) });
            }
            let a = aggs.entry(r.team.as_str()).or_default();
            let k = [r.active_us, r.allocated_idle_us, r.stranded_us, r.unallocated_idle_us, r.unallocated_busy_us]
                .iter()
                .fold(0i64, |a, v| a.saturating_add(*v));
            add(&mut known, k, "known seconds")?;
            add(&mut all, k.saturating_add(r.unknown_us), "all seconds")?;
            add(&mut a.active, r.active_us, "active")?;
            add(&mut a.underused, r.underused_us, "underused")?;
            add(&mut a.allocated_idle, r.allocated_idle_us, "allocated idle")?;
            add(&mut a.stranded, r.stranded_us, "stranded")?;
            add(&mut a.unallocated_idle, r.unallocated_idle_us, "unallocated idle")?;
            add(&mut a.unallocated_busy, r.unallocated_busy_us, "unallocated busy")?;
            add(&mut a.unknown, r.unknown_us, "unknown")?;
            match (r.cost_usd, r.idle_cost_usd, r.stranded_cost_usd) {
                (Some(cost), Some(idle), Some(stranded)) => {
                    add(&mut a.cost, cost.0, "cost")?;
                    add(&mut a.stranded_cost, stranded.0, "stranded cost")?;
                    if r.unallocated_idle_us > 0 {
                        add(&mut a.unallocated_idle_cost, idle.0, "unallocated idle cost")?;
                    } else {
                        add(&mut a.allocated_idle_cost, idle.0.saturating_sub(stranded.0), "allocated idle cost")?;
                    }
                }
                _ => add(&mut a.unpriced, k, "unpriced seconds")?,
            }
        }
        let unalloc_agg = aggs.remove(UNALLOCATED).unwrap_or_default();
        let mut teams: Vec<Line> = aggs.iter().map(|(t, a)| a.line(t)).collect();
        let mut unallocated = unalloc_agg.line(UNALLOCATED);

        if input.share_unallocated != ShareUnallocated::None && !teams.is_empty() {
            let pot = unallocated.unallocated_idle_cost_usd;
            let weights: Vec<i64> = match input.share_unallocated {
                ShareUnallocated::Weighted => teams.iter().map(|l| l.cost_usd.0).collect(),
                _ => vec![1; teams.len()],
            };
            for (l, s) in teams.iter_mut().zip(largest_remainder(pot, &weights)) {
                l.unallocated_share_usd = s;
                l.total_usd = l.cost_usd + s;
            }
            unallocated.unallocated_share_usd = Cents(-pot.0);
            unallocated.total_usd = unallocated.cost_usd - pot;
        }

        let mut fleet = {
            let mut all_lines: Vec<&Line> = teams.iter().collect();
            all_lines.push(&unallocated);
            sum_lines("fleet", &all_lines)
        };
        // Fleet utilisation from the exact team sums (not from rounded hours).
        let (fa, fk) = aggs.values().fold((0i64, 0i64), |(a, k), g| {
            (
                a.saturating_add(g.active),
                k.saturating_add(g.active).saturating_add(g.allocated_idle).saturating_add(g.stranded),
            )
        });
        fleet.utilisation = (fk > 0).then(|| fa as f64 / fk as f64);

        if let Some(prev) = input.previous {
            let prev_of = |team: &str| -> (Cents, Cents) {
                let l = if team == UNALLOCATED {
                    Some(&prev.unallocated)
                } else if team == "fleet" {
                    Some(&prev.fleet)
                } else {
                    prev.teams.iter().find(|l| l.team == team)
                };
                l.map_or((Cents::ZERO, Cents::ZERO), |l| (l.idle_cost_usd, l.cost_usd))
            };
            for l in teams.iter_mut().chain([&mut unallocated, &mut fleet]) {
                let (pi, pc) = prev_of(&l.team);
                l.change_idle_cost_usd = Some(l.idle_cost_usd - pi);
                l.change_cost_usd = Some(l.cost_usd - pc);
            }
        }

        let mut facts: Vec<&StrandedFact> = input.stranded.iter().collect();
        facts.sort_by(|a, b| b.cost.cmp(&a.cost).then(b.duration_us.cmp(&a.duration_us)).then(a.owner.cmp(&b.owner)));
        let top_stranded = facts
            .into_iter()
            .take(10)
            .map(|f| StrandedLine {
                owner: f.owner.clone(),
                team: f.team.clone(),
                gpus: f.gpus,
                duration_hours: GpuHours::from_us(f.duration_us),
                cost_usd: f.cost.to_cents(),
            })
            .collect();

        Ok(WeeklyReport {
            week: input.week.to_string(),
            week_start: format_rfc3339(from),
            week_end: format_rfc3339(to),
            generated_at: format_rfc3339(input.generated_at_us),
            price_book_version: input.price_book_version.to_owned(),
            example_prices: input.example_prices,
            coverage: (all > 0).then(|| known as f64 / all as f64),
            known_gpu_hours: GpuHours::from_us(known),
            total_gpu_hours: GpuHours::from_us(all),
            coverage_gpus: u32::try_from(gpus_seen.len()).unwrap_or(u32::MAX),
            coverage_hours: u32::try_from(hours_seen.len()).unwrap_or(u32::MAX),
            coverage_basis: coverage_basis(
                u32::try_from(gpus_seen.len()).unwrap_or(u32::MAX),
                u32::try_from(hours_seen.len()).unwrap_or(u32::MAX),
            ),
            share_unallocated: input.share_unallocated,
            teams,
            unallocated,
            fleet,
            top_stranded,
            prices: input.prices.clone(),
            stale_shards: Vec::new(),
        })
    }

    pub fn to_json(&self) -> Result<String, ReportError> {
        Ok(serde_json::to_string_pretty(self)?)
    }

    /// The report's four tables as typed cells — what the CSV files and the XLSX sheets
    /// are both written from (the XLSX from the types, never by re-reading CSV text).
    pub fn tables(&self) -> Vec<Table> {
        let text = |s: &str| Cell::Text(s.to_owned());
        let flag = Cell::Flag(self.example_prices);
        let mut summary = vec![
            vec![text("week"), text(&self.week)],
            vec![text("week_start"), text(&self.week_start)],
            vec![text("week_end"), text(&self.week_end)],
            vec![text("generated_at"), text(&self.generated_at)],
            vec![text("price_book_version"), text(&self.price_book_version)],
            vec![text("example_prices"), flag.clone()],
        ];
        if self.example_prices {
            summary.push(vec![text("example_prices_note"), text(EXAMPLE_PRICES_NOTE)]);
        }
        summary.extend([
            vec![text("coverage"), Cell::Ratio(self.coverage)],
            vec![text("known_gpu_hours"), Cell::Hours(self.known_gpu_hours)],
            vec![text("total_gpu_hours"), Cell::Hours(self.total_gpu_hours)],
            vec![text("coverage_gpus"), Cell::Int(i64::from(self.coverage_gpus))],
            vec![text("coverage_hours"), Cell::Int(i64::from(self.coverage_hours))],
            vec![text("coverage_basis"), text(&self.coverage_basis)],
            vec![text("share_unallocated"), text(&format!("{:?}", self.share_unallocated).to_lowercase())],
        ]);
        if !self.stale_shards.is_empty() {
            summary.push(vec![text("stale_shards"), text(&self.stale_shards.join(" "))]);
        }

        let teams = self
            .teams
            .iter()
            .chain([&self.unallocated, &self.fleet])
            .map(|l| {
                vec![
                    text(&l.team),
                    Cell::Hours(l.gpu_hours_allocated),
                    Cell::Hours(l.gpu_hours_active),
                    Cell::Hours(l.gpu_hours_underused),
                    Cell::Hours(l.gpu_hours_stranded),
                    Cell::Hours(l.gpu_hours_allocated_idle),
                    Cell::Hours(l.gpu_hours_unallocated_idle),
                    Cell::Hours(l.gpu_hours_unallocated_busy),
                    Cell::Hours(l.gpu_hours_unknown),
                    Cell::Hours(l.unpriced_gpu_hours),
                    Cell::Ratio(l.utilisation),
                    Cell::Money(Some(l.cost_usd)),
                    Cell::Money(Some(l.idle_cost_usd)),
                    Cell::Money(Some(l.allocated_idle_cost_usd)),
                    Cell::Money(Some(l.stranded_cost_usd)),
                    Cell::Money(Some(l.unallocated_idle_cost_usd)),
                    Cell::Money(Some(l.unallocated_share_usd)),
                    Cell::Money(Some(l.total_usd)),
                    Cell::Money(l.change_idle_cost_usd),
                    Cell::Money(l.change_cost_usd),
                    flag.clone(),
                ]
            })
            .collect();

        let stranded = self
            .top_stranded
            .iter()
            .enumerate()
            .map(|(i, l)| {
                vec![
                    Cell::Int(i64::try_from(i + 1).unwrap_or(i64::MAX)),
                    // Always text: a Slurm job id looks like a number, a pod is a name.
                    text(&l.owner),
                    text(&l.team),
                    Cell::Int(i64::from(l.gpus)),
                    Cell::Hours(l.duration_hours),
                    Cell::Money(Some(l.cost_usd)),
                    flag.clone(),
                ]
            })
            .collect();

        let prices = self
            .prices
            .iter()
            .map(|r| {
                vec![
                    text(&r.model),
                    text(r.cluster.as_deref().unwrap_or_default()),
                    text(r.kind.as_str()),
                    text(r.effective_from.as_deref().unwrap_or_default()),
                    Cell::Price(r.usd_per_gpu_hour),
                    text(r.derivation.as_deref().unwrap_or_default()),
                    text(r.source.as_deref().unwrap_or_default()),
                    flag.clone(),
                ]
            })
            .collect();

        vec![
            Table { name: "summary", header: vec!["key", "value"], rows: summary },
            Table {
                name: "teams",
                header: vec![
                    "team",
                    "gpu_hours_allocated",
                    "gpu_hours_active",
                    "gpu_hours_underused",
                    "gpu_hours_stranded",
                    "gpu_hours_allocated_idle",
                    "gpu_hours_unallocated_idle",
                    "gpu_hours_unallocated_busy",
                    "gpu_hours_unknown",
                    "unpriced_gpu_hours",
                    "utilisation",
                    "cost_usd",
                    "idle_cost_usd",
                    "allocated_idle_cost_usd",
                    "stranded_cost_usd",
                    "unallocated_idle_cost_usd",
                    "unallocated_share_usd",
                    "total_usd",
                    "change_idle_cost_usd",
                    "change_cost_usd",
                    "example_prices",
                ],
                rows: teams,
            },
            Table {
                name: "top_stranded",
                header: vec!["rank", "owner", "team", "gpus", "duration_hours", "cost_usd", "example_prices"],
                rows: stranded,
            },
            Table {
                name: "prices",
                header: vec![
                    "model",
                    "cluster",
                    "kind",
                    "effective_from",
                    "usd_per_gpu_hour",
                    "derivation",
                    "source",
                    "example_prices",
                ],
                rows: prices,
            },
        ]
    }

    /// One CSV per table: `(file name, contents)`.
    pub fn to_csv(&self) -> Result<Vec<(&'static str, String)>, ReportError> {
        let err = |e: csv::Error| ReportError::Csv(e.to_string());
        let mut out = Vec::new();
        for table in self.tables() {
            let mut w = csv::Writer::from_writer(Vec::new());
            w.write_record(&table.header).map_err(err)?;
            for row in &table.rows {
                w.write_record(row.iter().map(Cell::to_text)).map_err(err)?;
            }
            let bytes = w.into_inner().map_err(|e| ReportError::Csv(e.to_string()))?;
            let name = match table.name {
                "summary" => "summary.csv",
                "teams" => "teams.csv",
                "top_stranded" => "top_stranded.csv",
                _ => "prices.csv",
            };
            out.push((name, String::from_utf8(bytes).map_err(|e| ReportError::Csv(e.to_string()))?));
        }
        Ok(out)
    }

    /// The coverage line: ratio, both GPU-hour figures and what the denominator is.
    pub fn coverage_line(&self) -> String {
        coverage_sentence(
            self.coverage,
            &self.known_gpu_hours.to_string(),
            &self.total_gpu_hours.to_string(),
            &self.coverage_basis,
        )
    }
    /// Self-contained, printable HTML that reads as a mail body at 800 px: inline CSS
    /// (a `<style>` block, no external sheet), an inline SVG bar chart of idle cost by
    /// kind per team (scaled to the width), no script. The team figures are three narrow
    /// tables (hours, cost, idle cost by kind) rather than one of 15 columns, and long
    /// names wrap, so nothing needs more than ~700 px.
    pub fn to_html(&self) -> String {
        let e = html_escape;
        let mut h = String::new();
        h.push_str("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">");
        h.push_str("<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">");
        h.push_str(&format!("<title>Apron GPU idle cost {}</title>", e(&self.week)));
        h.push_str(
            "<style>body{font-family:system-ui,sans-serif;margin:1em;color:#222;max-width:60em}\
             table{border-collapse:collapse;margin:.5em 0 1.5em;max-width:100%}\
             th,td{border:1px solid #ccc;padding:.25em .4em;overflow-wrap:anywhere;word-break:break-word}\
             th{text-align:left;vertical-align:bottom;font-size:90%}\
             td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}\
             tr.total td{font-weight:bold;border-top:2px solid #333}\
             .legend span{display:inline-block;width:1em;height:1em;margin:0 .3em 0 1em;vertical-align:middle}\
             .example{border:2px solid #d9534f;background:#fdf0ef;padding:.5em .75em;font-weight:bold}\
             svg{max-width:100%;height:auto}\
             @media print{body{margin:0}}</style></head><body>\n",
        );
        h.push_str(&format!("<h1>GPU idle cost — week {}</h1>\n", e(&self.week)));
        if self.example_prices {
            h.push_str(&format!("<p class=\"example\">{}</p>\n", e(EXAMPLE_PRICES_NOTE)));
        }
        h.push_str(&format!(
            "<p>{} to {} (UTC). Price book <b>{}</b>{}. Generated {}.</p>\n<p>{}</p>\n",
            e(&self.week_start),
            e(&self.week_end),
            e(&self.price_book_version),
            if self.example_prices { " (example prices)" } else { "" },
            e(&self.generated_at),
            e(&self.coverage_line()),
        ));
        if !self.stale_shards.is_empty() {
            h.push_str(&format!(
                "<p><b>Stale shards:</b> {} (their collectors were not current: their rows are what they last persisted).</p>\n",
                e(&self.stale_shards.join(", "))
            ));
        }
        h.push_str(&self.svg_chart());
        let lines: Vec<(&Line, &str)> = self
            .teams
            .iter()
            .map(|l| (l, ""))
            .chain([(&self.unallocated, ""), (&self.fleet, " class=\"total\"")])
            .collect();
        let table = |h: &mut String, title: &str, heads: &[&str], cells: &dyn Fn(&Line) -> Vec<String>| {
            h.push_str(&format!("<h2>{title}</h2>\n<table><tr><th>team</th>"));
            for head in heads {
                h.push_str(&format!("<th>{head}</th>"));
            }
            h.push_str("</tr>\n");
            for (l, class) in &lines {
                h.push_str(&format!("<tr{class}><td>{}</td>", e(&l.team)));
                for c in cells(l) {
                    h.push_str(&format!("<td class=n>{c}</td>"));
                }
                h.push_str("</tr>\n");
            }
            h.push_str("</table>\n");
        };
        let dash = |c: Option<Cents>| c.map_or("–".to_owned(), |c| c.to_string());
        table(
            &mut h,
            "Teams: GPU-hours",
            &["allocated", "active", "stranded", "allocated idle", "unknown", "utilisation"],
            &|l| {
                vec![
                    l.gpu_hours_allocated.to_string(),
                    l.gpu_hours_active.to_string(),
                    l.gpu_hours_stranded.to_string(),
                    l.gpu_hours_allocated_idle.to_string(),
                    l.gpu_hours_unknown.to_string(),
                    l.utilisation.map_or("–".to_owned(), |u| format!("{:.1}%", u * 100.0)),
                ]
            },
        );
        table(
            &mut h,
            "Teams: cost ($)",
            &["cost", "idle", "unallocated share", "total", "Δ idle vs previous week"],
            &|l| {
                vec![
                    l.cost_usd.to_string(),
                    l.idle_cost_usd.to_string(),
                    l.unallocated_share_usd.to_string(),
                    l.total_usd.to_string(),
                    dash(l.change_idle_cost_usd),
                ]
            },
        );
        table(&mut h, "Teams: idle cost by kind ($)", &["allocated idle", "stranded", "unallocated idle"], &|l| {
            vec![
                l.allocated_idle_cost_usd.to_string(),
                l.stranded_cost_usd.to_string(),
                l.unallocated_idle_cost_usd.to_string(),
            ]
        });
        h.push_str(
            "<h2>Top stranded allocations</h2>\n<table><tr><th>#</th><th>owner</th><th>team</th>\
            <th>GPUs</th><th>hours</th><th>cost $</th></tr>\n",
        );
        for (i, s) in self.top_stranded.iter().enumerate() {
            h.push_str(&format!(
                "<tr><td class=n>{}</td><td>{}</td><td>{}</td><td class=n>{}</td><td class=n>{}</td><td class=n>{}</td></tr>\n",
                i + 1,
                e(&s.owner),
                e(&s.team),
                s.gpus,
                s.duration_hours,
                s.cost_usd
            ));
        }
        h.push_str(&format!(
            "</table>\n<h2>Prices ($ per GPU-hour{})</h2>\n<table><tr><th>model</th><th>cluster</th><th>kind</th>\
            <th>from</th><th>$/GPU-h</th><th>derivation / source</th></tr>\n",
            if self.example_prices { ", EXAMPLE figures" } else { "" }
        ));
        for r in &self.prices {
            h.push_str(&format!(
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class=n>{}</td><td>{}</td></tr>\n",
                e(&r.model),
                e(r.cluster.as_deref().unwrap_or("all")),
                r.kind.as_str(),
                e(r.effective_from.as_deref().unwrap_or("always")),
                r.usd_per_gpu_hour,
                e(r.derivation.as_deref().or(r.source.as_deref()).unwrap_or(""))
            ));
        }
        h.push_str("</table>\n</body></html>\n");
        h
    }
    /// Horizontal stacked bars: allocated idle, stranded, unallocated idle per line.
    fn svg_chart(&self) -> String {
        const COLOURS: [(&str, &str); 3] =
            [("allocated idle", "#f0ad4e"), ("stranded", "#d9534f"), ("unallocated idle", "#999999")];
        let lines: Vec<&Line> = self.teams.iter().chain([&self.unallocated]).collect();
        let max = lines.iter().map(|l| l.idle_cost_usd.0).max().unwrap_or(0).max(1);
        let (label_w, bar_w, row_h) = (160i64, 480i64, 22i64);
        let height = row_h * lines.len() as i64 + 10;
        let width = label_w + bar_w + 100;
        let mut s = format!(
            "<p class=\"legend\">Idle cost by kind:{}</p>\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" viewBox=\"0 0 {width} {height}\" style=\"max-width:100%;height:auto\" role=\"img\" aria-label=\"idle cost by team\">\n",
            COLOURS.iter().map(|(n, c)| format!("<span style=\"background:{c}\"></span>{n}")).collect::<String>(),
        );
        for (i, l) in lines.iter().enumerate() {
            let y = i as i64 * row_h + 5;
            s.push_str(&format!("<text x=\"0\" y=\"{}\" font-size=\"12\">{}</text>", y + 14, html_escape(&l.team)));
            let mut x = label_w;
            for (v, (_, colour)) in
                [l.allocated_idle_cost_usd, l.stranded_cost_usd, l.unallocated_idle_cost_usd].iter().zip(COLOURS)
            {
                let w = (i128::from(v.0.max(0)) * i128::from(bar_w) / i128::from(max)) as i64;
                if w > 0 {
                    s.push_str(&format!(
                        "<rect x=\"{x}\" y=\"{y}\" width=\"{w}\" height=\"{}\" fill=\"{colour}\"/>",
                        row_h - 6
                    ));
                }
                x += w;
            }
            s.push_str(&format!(
                "<text x=\"{}\" y=\"{}\" font-size=\"12\">${}</text>\n",
                x + 6,
                y + 14,
                l.idle_cost_usd
            ));
        }
        s.push_str("</svg>\n");
        s
    }
}

/// One table of the report (a CSV file, an XLSX sheet): a header and typed rows.
#[derive(Clone, Debug, PartialEq)]
pub struct Table {
    /// `summary`, `teams`, `top_stranded`, `prices`.
    pub name: &'static str,
    pub header: Vec<&'static str>,
    pub rows: Vec<Vec<Cell>>,
}

/// A typed cell. CSV writes [`Cell::to_text`]; the XLSX writes numbers as numbers with
/// their format (currency, percent, hours) and text as text.
#[derive(Clone, Debug, PartialEq)]
pub enum Cell {
    /// Always a string, even where it looks like a number (a Slurm job id).
    Text(String),
    /// `true` / `false`.
    Flag(bool),
    Int(i64),
    Hours(GpuHours),
    /// Dollars to the cent (`None`: empty).
    Money(Option<Cents>),
    /// Dollars to the micro-dollar (a price per GPU-hour).
    Price(Micros),
    /// A ratio, written with four decimals (`None`: empty).
    Ratio(Option<f64>),
}

impl Cell {
    /// The CSV text.
    pub fn to_text(&self) -> String {
        match self {
            Cell::Text(s) => s.clone(),
            Cell::Flag(b) => b.to_string(),
            Cell::Int(i) => i.to_string(),
            Cell::Hours(h) => h.to_string(),
            Cell::Money(m) => m.map_or_else(String::new, |m| m.to_string()),
            Cell::Price(p) => p.to_string(),
            Cell::Ratio(r) => r.map_or_else(String::new, |r| format!("{r:.4}")),
        }
    }

    /// The number a spreadsheet holds for it: exactly the value of its CSV text
    /// (cents / 100, hundredths / 100, micro-dollars / 10⁶, the ratio rounded to four
    /// decimals as printed), `None` for text and empty cells.
    pub fn number(&self) -> Option<f64> {
        match self {
            Cell::Text(_) | Cell::Flag(_) | Cell::Money(None) | Cell::Ratio(None) => None,
            Cell::Int(i) => Some(*i as f64),
            Cell::Hours(h) => Some(h.0 as f64 / 100.0),
            Cell::Money(Some(c)) => Some(c.0 as f64 / 100.0),
            Cell::Price(p) => Some(p.0 as f64 / 1_000_000.0),
            // The printed four decimals, as a number (what the CSV holds).
            Cell::Ratio(Some(_)) => self.to_text().parse().ok(),
        }
    }
}

fn html_escape(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            _ => o.push(c),
        }
    }
    o
}

#[cfg(test)]
mod tests;
