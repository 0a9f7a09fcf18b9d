//! Report tests with hand-computed expectations in the comments.

use super::*;
use crate::time::parse_instant;

const S: i64 = 1_000_000;

fn t(s: &str) -> i64 {
    parse_instant(s).expect("timestamp")
}

#[test]
fn iso_weeks() {
    let w = IsoWeek::parse("2026-W48").expect("week");
    // 2026-11-23 is a Monday (`date -u -d 2026-11-23 +%A`).
    assert_eq!((w.start_us(), w.end_us()), (t("2026-11-23"), t("2026-11-30")));
    // Week 1 of 2026 holds Jan 4 (a Sunday), so it starts Monday 2025-12-29.
    assert_eq!(IsoWeek::parse("2026-W01").expect("w").start_us(), t("2025-12-29"));
    // 2026 starts on a Thursday: 53 weeks; 2025 (Wednesday, not leap): 52; 2020 (Wednesday, leap): 53.
    assert_eq!(IsoWeek::parse("2026-W53").expect("w").start_us(), t("2026-12-28"));
    assert!(IsoWeek::parse("2025-W53").is_err());
    assert!(IsoWeek::parse("2020-W53").is_ok());
    assert_eq!(IsoWeek::parse("2026-W01").expect("w").previous(), IsoWeek { year: 2025, week: 52 });
    assert_eq!(IsoWeek::parse("2026W07").expect("w").to_string(), "2026-W07");
    for bad in ["", "2026", "2026-W0", "2026-W54", "26-W01", "2026-Wxx", "2026-W123"] {
        assert!(IsoWeek::parse(bad).is_err(), "{bad:?}");
    }
}

fn row(hour: &str, team: &str, states: [i64; 6], money: Option<[i64; 3]>) -> HourlyRow {
    let [active, ai, st, ui, ub, unk] = states.map(|s| s * S);
    HourlyRow {
        hour_us: t(hour),
        gpu_uuid: "GPU-1".into(),
        team: team.into(),
        active_us: active,
        allocated_idle_us: ai,
        stranded_us: st,
        unallocated_idle_us: ui,
        unallocated_busy_us: ub,
        unknown_us: unk,
        underused_us: 0,
        cost_usd: money.map(|m| Micros(m[0])),
        idle_cost_usd: money.map(|m| Micros(m[1])),
        stranded_cost_usd: money.map(|m| Micros(m[2])),
    }
}

fn input<'a>(rows: &'a [HourlyRow], stranded: &'a [StrandedFact], share: ShareUnallocated) -> ReportInput<'a> {
    ReportInput {
        week: IsoWeek { year: 2026, week: 48 },
        rows,
        stranded,
        price_book_version: "pb-7",
        prices: Vec::new(),
        generated_at_us: t("2026-11-30T06:00:00Z"),
        share_unallocated: share,
        previous: None,
        example_prices: false,
    }
}

/// A known trace at $12.29/h over four GPU-hours of week 48:
/// - ml 10:00: active 900 s, stranded 2700 s; cost 12.29, idle 9.2175, stranded 9.2175
/// - ml 11:00: active 2400 s, allocated idle 1200 s; cost 12.29, idle 4.096667
/// - ml 12:00: unknown 3600 s (agent down); no cost
/// - unallocated 10:00: unallocated idle 3600 s; cost 12.29, idle 12.29
/// - a row from week 47 that must be ignored.
fn rows() -> Vec<HourlyRow> {
    vec![
        row("2026-11-24T10:00:00Z", "ml", [900, 0, 2700, 0, 0, 0], Some([12_290_000, 9_217_500, 9_217_500])),
        row("2026-11-24T11:00:00Z", "ml", [2400, 1200, 0, 0, 0, 0], Some([12_290_000, 4_096_667, 0])),
        row("2026-11-24T12:00:00Z", "ml", [0, 0, 0, 0, 0, 3600], Some([0, 0, 0])),
        row("2026-11-24T10:00:00Z", UNALLOCATED, [0, 0, 0, 3600, 0, 0], Some([12_290_000, 12_290_000, 0])),
        row("2026-11-20T10:00:00Z", "ml", [3600, 0, 0, 0, 0, 0], Some([99_000_000, 0, 0])),
    ]
}

#[test]
fn team_lines_by_hand() {
    let rows = rows();
    let r = WeeklyReport::build(&input(&rows, &[], ShareUnallocated::None)).expect("report");
    assert_eq!(r.teams.len(), 1);
    let ml = &r.teams[0];
    // active (900 + 2400) s = 0.91666 h -> 0.92; stranded 0.75; allocated idle 1200 s = 0.333 -> 0.33;
    // unknown 1.00; allocated = 0.92 + 0.33 + 0.75 + 1.00 = 3.00.
    assert_eq!(
        (ml.gpu_hours_active, ml.gpu_hours_stranded, ml.gpu_hours_allocated_idle, ml.gpu_hours_unknown),
        (GpuHours(92), GpuHours(75), GpuHours(33), GpuHours(100))
    );
    assert_eq!(ml.gpu_hours_allocated, GpuHours(300));
    // utilisation = 3300 / (3300 + 1200 + 2700) = 3300 / 7200 = 0.458333…
    assert!((ml.utilisation.expect("u") - 3300.0 / 7200.0).abs() < 1e-12);
    // cost 24.58; stranded 9.2175 -> 9.22 (21.75 cents -> 22); allocated idle
    // (9.2175 − 9.2175) + 4.096667 = 4.096667 -> 4.10; idle line = 4.10 + 9.22 = 13.32.
    assert_eq!((ml.cost_usd, ml.stranded_cost_usd, ml.allocated_idle_cost_usd), (Cents(2458), Cents(922), Cents(410)));
    assert_eq!(ml.idle_cost_usd, Cents(1332));
    let u = &r.unallocated;
    assert_eq!((u.cost_usd, u.unallocated_idle_cost_usd, u.idle_cost_usd), (Cents(1229), Cents(1229), Cents(1229)));
    assert_eq!(u.gpu_hours_unallocated_idle, GpuHours(100));
    // Fleet = sum of lines: cost 24.58 + 12.29 = 36.87; idle 13.32 + 12.29 = 25.61.
    assert_eq!((r.fleet.cost_usd, r.fleet.idle_cost_usd, r.fleet.total_usd), (Cents(3687), Cents(2561), Cents(3687)));
    // Coverage: known 3 GPU-hours of 4 -> 0.75.
    assert_eq!(r.coverage, Some(0.75));
    assert_eq!((r.known_gpu_hours, r.total_gpu_hours), (GpuHours(300), GpuHours(400)));
    assert_eq!(
        (r.week.as_str(), r.week_start.as_str(), r.price_book_version.as_str()),
        ("2026-W48", "2026-11-23T00:00:00Z", "pb-7")
    );
}

#[test]
fn totals_are_sums_of_rounded_lines() {
    // Three teams each with exact cost 0.005 (half a cent): each line rounds half-even to
    // 0.00, so the fleet line is 0.00 — not round(0.015) = 0.02. A fourth team at 0.015
    // rounds to 0.02 (1.5 cents -> 2). Fleet = 0 + 0 + 0 + 2 = 0.02.
    let mut rows = Vec::new();
    for team in ["a", "b", "c"] {
        rows.push(row("2026-11-24T10:00:00Z", team, [3600, 0, 0, 0, 0, 0], Some([5_000, 0, 0])));
    }
    rows.push(row("2026-11-24T10:00:00Z", "d", [3600, 0, 0, 0, 0, 0], Some([15_000, 0, 0])));
    let r = WeeklyReport::build(&input(&rows, &[], ShareUnallocated::None)).expect("report");
    let costs: Vec<Cents> = r.teams.iter().map(|l| l.cost_usd).collect();
    assert_eq!(costs, [Cents(0), Cents(0), Cents(0), Cents(2)]);
    assert_eq!(r.fleet.cost_usd, Cents(2));
    // And for every column the fleet line is the exact sum of the lines above it.
    let lines: Vec<&Line> = r.teams.iter().chain([&r.unallocated]).collect();
    assert_eq!(r.fleet.total_usd, lines.iter().map(|l| l.total_usd).sum());
    assert_eq!(r.fleet.gpu_hours_active, GpuHours(lines.iter().map(|l| l.gpu_hours_active.0).sum()));
}

#[test]
fn largest_remainder_shares_add_up_exactly() {
    // $1.00 over equal weights: 33 each + 1 leftover to the first (tie -> earlier).
    assert_eq!(largest_remainder(Cents(100), &[1, 1, 1]), [Cents(34), Cents(33), Cents(33)]);
    // $1.00 weighted 2:1: 66.67 / 33.33 -> floors 66, 33; leftover to the larger remainder.
    assert_eq!(largest_remainder(Cents(100), &[200, 100]), [Cents(67), Cents(33)]);
    // All-zero weights fall back to even.
    assert_eq!(largest_remainder(Cents(5), &[0, 0]), [Cents(3), Cents(2)]);
    assert_eq!(largest_remainder(Cents(7), &[]), Vec::<Cents>::new());
    // Exhaustive-ish: sums always match.
    for total in 0..200 {
        for ws in [[1, 2, 3], [0, 5, 5], [7, 0, 0], [3, 3, 3]] {
            let s: i64 = largest_remainder(Cents(total), &ws).iter().map(|c| c.0).sum();
            assert_eq!(s, total);
        }
    }
}

#[test]
fn unallocated_idle_shared_weighted_and_even() {
    // Teams: a costs 2.00, b costs 1.00; unallocated idle 1.00 to share.
    let rows = vec![
        row("2026-11-24T10:00:00Z", "a", [3600, 0, 0, 0, 0, 0], Some([2_000_000, 0, 0])),
        row("2026-11-24T10:00:00Z", "b", [3600, 0, 0, 0, 0, 0], Some([1_000_000, 0, 0])),
        row("2026-11-24T10:00:00Z", UNALLOCATED, [0, 0, 0, 3600, 0, 0], Some([1_000_000, 1_000_000, 0])),
    ];
    let r = WeeklyReport::build(&input(&rows, &[], ShareUnallocated::Weighted)).expect("report");
    // weighted: a 0.67, b 0.33 (see largest_remainder test); totals a 2.67, b 1.33.
    let shares: Vec<(Cents, Cents)> = r.teams.iter().map(|l| (l.unallocated_share_usd, l.total_usd)).collect();
    assert_eq!(shares, [(Cents(67), Cents(267)), (Cents(33), Cents(133))]);
    assert_eq!((r.unallocated.unallocated_share_usd, r.unallocated.total_usd), (Cents(-100), Cents(0)));
    // Fleet total = 2.67 + 1.33 + 0 = 4.00 = all costs; shares net to 0.
    assert_eq!(
        (r.fleet.total_usd, r.fleet.unallocated_share_usd, r.fleet.cost_usd),
        (Cents(400), Cents(0), Cents(400))
    );
    let r = WeeklyReport::build(&input(&rows, &[], ShareUnallocated::Even)).expect("report");
    let shares: Vec<Cents> = r.teams.iter().map(|l| l.unallocated_share_usd).collect();
    assert_eq!(shares, [Cents(50), Cents(50)]);
    let r = WeeklyReport::build(&input(&rows, &[], ShareUnallocated::None)).expect("report");
    assert_eq!(r.unallocated.total_usd, Cents(100));
}

#[test]
fn week_over_week_and_top_stranded() {
    let prev_rows =
        vec![row("2026-11-17T10:00:00Z", "ml", [0, 1800, 1800, 0, 0, 0], Some([10_000_000, 10_000_000, 5_000_000]))];
    let prev_in =
        ReportInput { week: IsoWeek { year: 2026, week: 47 }, ..input(&prev_rows, &[], ShareUnallocated::None) };
    let prev = WeeklyReport::build(&prev_in).expect("prev");
    assert_eq!(prev.teams[0].idle_cost_usd, Cents(1000));
    let rows = rows();
    let facts: Vec<StrandedFact> = (0..12)
        .map(|i| StrandedFact {
            owner: format!("pod/job-{i:02}"),
            team: "ml".into(),
            gpus: 1 + i % 4,
            duration_us: i64::from(i) * 3_600 * S,
            cost: Micros(i64::from(i % 6) * 1_000_000),
        })
        .collect();
    let r = WeeklyReport::build(&ReportInput { previous: Some(&prev), ..input(&rows, &facts, ShareUnallocated::None) })
        .expect("report");
    // ml idle 13.32 now vs 10.00 before: +3.32. Unallocated 12.29 vs 0: +12.29.
    assert_eq!(r.teams[0].change_idle_cost_usd, Some(Cents(332)));
    assert_eq!(r.unallocated.change_idle_cost_usd, Some(Cents(1229)));
    assert_eq!(r.fleet.change_idle_cost_usd, Some(Cents(2561 - 1000)));
    // Top 10 by cost desc, then duration desc: costs (i % 6) → 5 (i=11, 5), 4 (10, 4), …
    assert_eq!(r.top_stranded.len(), 10);
    let owners: Vec<&str> = r.top_stranded.iter().map(|s| s.owner.as_str()).collect();
    assert_eq!(&owners[..4], ["pod/job-11", "pod/job-05", "pod/job-10", "pod/job-04"]);
    assert_eq!((r.top_stranded[0].cost_usd, r.top_stranded[0].duration_hours), (Cents(500), GpuHours(1100)));
}

#[test]
fn mixed_idle_rows_are_refused() {
    let rows = vec![row("2026-11-24T10:00:00Z", "ml", [0, 1800, 0, 1800, 0, 0], Some([1, 1, 0]))];
    assert!(matches!(
        WeeklyReport::build(&input(&rows, &[], ShareUnallocated::None)),
        Err(ReportError::MixedIdleRow { .. })
    ));
}

#[test]
fn unpriced_rows_are_reported_not_zeroed() {
    let rows = vec![row("2026-11-24T10:00:00Z", "ml", [3600, 0, 0, 0, 0, 0], None)];
    let r = WeeklyReport::build(&input(&rows, &[], ShareUnallocated::None)).expect("report");
    assert_eq!((r.teams[0].unpriced_gpu_hours, r.teams[0].cost_usd), (GpuHours(100), Cents(0)));
    assert_eq!(r.fleet.unpriced_gpu_hours, GpuHours(100));
}

#[test]
fn renderers_agree() {
    let rows = rows();
    let r = WeeklyReport::build(&input(&rows, &[], ShareUnallocated::Weighted)).expect("report");
    let json: serde_json::Value = serde_json::from_str(&r.to_json().expect("json")).expect("parse");
    for k in ["week", "generated_at", "price_book_version", "coverage", "teams", "unallocated", "fleet", "top_stranded"]
    {
        assert!(json.get(k).is_some(), "missing {k}");
    }
    assert_eq!(json["fleet"]["cost_usd"], serde_json::json!(36.87));
    assert_eq!(json["teams"][0]["idle_cost_usd"], serde_json::json!(13.32));
    for k in [
        "gpu_hours_allocated",
        "gpu_hours_active",
        "gpu_hours_stranded",
        "gpu_hours_allocated_idle",
        "gpu_hours_unknown",
        "utilisation",
        "cost_usd",
        "idle_cost_usd",
        "stranded_cost_usd",
        "change_idle_cost_usd",
    ] {
        assert!(json["teams"][0].get(k).is_some(), "team key {k}");
    }

    let files = r.to_csv().expect("csv");
    let names: Vec<&str> = files.iter().map(|(n, _)| *n).collect();
    assert_eq!(names, ["summary.csv", "teams.csv", "top_stranded.csv", "prices.csv"]);
    let teams = &files[1].1;
    let mut rdr = csv::Reader::from_reader(teams.as_bytes());
    let recs: Vec<csv::StringRecord> = rdr.records().map(|r| r.expect("record")).collect();
    assert_eq!(recs.len(), 3); // ml, unallocated, fleet
    let total_col = 17;
    let cents = |s: &str| -> i64 { s.replace('.', "").parse().expect("cents") };
    let sum: i64 = recs[..2].iter().map(|r| cents(&r[total_col])).sum();
    assert_eq!(cents(&recs[2][total_col]), sum, "CSV fleet total = sum of lines");
    assert_eq!(&recs[2][11], "36.87");

    let html = r.to_html();
    assert!(html.contains("<svg") && html.contains("36.87") && html.contains("pb-7"));
    assert!(!html.contains("<script"));
}

#[test]
fn html_escapes_team_names() {
    let rows = vec![row("2026-11-24T10:00:00Z", "<b>&x", [3600, 0, 0, 0, 0, 0], Some([1, 0, 0]))];
    let html = WeeklyReport::build(&input(&rows, &[], ShareUnallocated::None)).expect("r").to_html();
    assert!(html.contains("&lt;b&gt;&amp;x") && !html.contains("<b>&x"));
}

/// Issue 42, finding 7: the coverage line says what its denominator is — the GPU-hours
/// of the week's rows: the GPUs seen, the hours they span — in JSON, CSV and HTML alike.
#[test]
fn coverage_names_its_denominator_everywhere() {
    let mut rows = rows();
    // A second GPU with one unknown hour: 2 GPUs, 4 distinct hours of week 48.
    rows.push(HourlyRow { gpu_uuid: "GPU-2".into(), ..row("2026-11-25T03:00:00Z", "ml", [0, 0, 0, 0, 0, 3600], None) });
    let r = WeeklyReport::build(&input(&rows, &[], ShareUnallocated::None)).expect("report");
    // Known: 900 + 2700 + 2400 + 1200 + 3600 s = 10800 s = 3.00 h; all: + 2 × 3600 unknown.
    assert_eq!((r.known_gpu_hours, r.total_gpu_hours), (GpuHours(300), GpuHours(500)));
    assert_eq!((r.coverage_gpus, r.coverage_hours), (2, 4));
    let basis = "the GPU-hours the ledger has rows for: 2 GPUs, each for every hour of the UTC days it sent \
                 samples in (up to the last hour priced), in 4 of the week's 168 hours; GPUs and days with no \
                 samples at all are not counted";
    assert_eq!(r.coverage_basis, basis);
    let line = r.coverage_line();
    assert_eq!(line, format!("Data coverage 60.0 %: 3.00 GPU-hours with samples of 5.00 GPU-hours, {basis}."));

    let json: serde_json::Value = serde_json::from_str(&r.to_json().expect("json")).expect("parse");
    assert_eq!(json["coverage_basis"], basis);
    assert_eq!((json["coverage_gpus"].as_u64(), json["coverage_hours"].as_u64()), (Some(2), Some(4)));
    let summary = &r.to_csv().expect("csv")[0].1;
    let mut rdr = csv::Reader::from_reader(summary.as_bytes());
    let kv: BTreeMap<String, String> =
        rdr.records().map(|r| r.expect("record")).map(|r| (r[0].to_owned(), r[1].to_owned())).collect();
    assert_eq!(kv["coverage_basis"], basis);
    assert_eq!(
        (kv["coverage"].as_str(), kv["known_gpu_hours"].as_str(), kv["total_gpu_hours"].as_str()),
        ("0.6000", "3.00", "5.00")
    );
    assert!(r.to_html().contains(&html_escape(&line)), "the HTML shows the same line");
    // The single-GPU wording.
    assert!(
        coverage_basis(1, 24).contains(": 1 GPU, each")
            && coverage_basis(1, 24).contains("in 24 of the week's 168 hours")
    );
}

/// Issue 42, deliverable 5: dollars priced by the example book say so in every rendering.
#[test]
fn example_prices_are_flagged_wherever_dollars_show() {
    let rows = rows();
    let plain = WeeklyReport::build(&input(&rows, &[], ShareUnallocated::None)).expect("report");
    let example =
        WeeklyReport::build(&ReportInput { example_prices: true, ..input(&rows, &[], ShareUnallocated::None) })
            .expect("report");
    for (r, flagged) in [(&plain, false), (&example, true)] {
        let json: serde_json::Value = serde_json::from_str(&r.to_json().expect("json")).expect("parse");
        assert_eq!(json["example_prices"], flagged);
        let csv = r.to_csv().expect("csv");
        assert_eq!(csv[0].1.contains("example_prices,true"), flagged, "{}", csv[0].1);
        assert_eq!(csv[0].1.contains("EXAMPLE PRICES"), flagged, "{}", csv[0].1);
        for (name, text) in &csv[1..] {
            let mut rdr = csv::Reader::from_reader(text.as_bytes());
            assert_eq!(rdr.headers().expect("header").iter().next_back(), Some("example_prices"), "{name}");
            for rec in rdr.records() {
                assert_eq!(
                    rec.expect("record").iter().next_back(),
                    Some(if flagged { "true" } else { "false" }),
                    "{name}"
                );
            }
        }
        let html = r.to_html();
        assert_eq!(html.contains(&html_escape(EXAMPLE_PRICES_NOTE)), flagged);
    }
}

/// The CSV files and the XLSX sheets come from the same typed tables: every number a
/// sheet holds equals its CSV text's value, and text stays text (an owner that looks
/// like a number — a Slurm job id — is still text).
#[test]
fn typed_tables_match_the_csv() {
    let rows = rows();
    let facts = [
        StrandedFact {
            owner: "13860256".into(),
            team: "ml".into(),
            gpus: 2,
            duration_us: 3600 * S,
            cost: Micros(5_000_000),
        },
        StrandedFact {
            owner: "ml/jupyter-erik".into(),
            team: "ml".into(),
            gpus: 1,
            duration_us: 1800 * S,
            cost: Micros(1_000_000),
        },
    ];
    let r = WeeklyReport::build(&input(&rows, &facts, ShareUnallocated::Weighted)).expect("report");
    let csv = r.to_csv().expect("csv");
    for (table, (_, text)) in r.tables().iter().zip(&csv) {
        let mut rdr = csv::ReaderBuilder::new().has_headers(false).from_reader(text.as_bytes());
        let recs: Vec<csv::StringRecord> = rdr.records().map(|r| r.expect("record")).collect();
        assert_eq!(recs.len(), table.rows.len() + 1, "{}", table.name);
        assert!(recs[0].iter().eq(table.header.iter().copied()), "{}", table.name);
        for (cells, rec) in table.rows.iter().zip(&recs[1..]) {
            for (cell, field) in cells.iter().zip(rec.iter()) {
                assert_eq!(cell.to_text(), field);
                match cell.number() {
                    Some(n) => assert_eq!(Some(n), field.parse::<f64>().ok(), "{}: {field}", table.name),
                    None => assert!(matches!(cell, Cell::Text(_) | Cell::Flag(_)) || field.is_empty(), "{cell:?}"),
                }
            }
        }
    }
    let stranded = &r.tables()[2];
    assert_eq!(stranded.rows[0][1], Cell::Text("13860256".into()), "a Slurm job id is text");
}
