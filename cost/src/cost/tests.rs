//! Dollar figures worked out by hand in the comments, never by the code under test.

use super::*;
use crate::classify::{ClassifyConfig, Holder, HolderId, UNALLOCATED, Window, classify};
use crate::time::parse_instant;

const MIN: i64 = 60_000_000;
const S: i64 = 1_000_000;

fn t(s: &str) -> i64 {
    parse_instant(s).expect("timestamp")
}

/// 60 s windows from `start`: (minutes, 'B' busy | 'I' idle | '-' gap, holder).
fn trace(start: i64, pieces: &[(i64, char, Option<usize>)]) -> Vec<Window> {
    let mut out = Vec::new();
    let mut at = start;
    for &(m, k, h) in pieces {
        for i in 1..=m {
            let sm = match k {
                'B' => Some(0.5),
                'I' => Some(0.0),
                _ => continue,
            };
            out.push(Window {
                end_us: at + i * MIN,
                window_us: MIN,
                sm_active_max: sm,
                gpu_util_max: None,
                sm_active_mean: Some(0.5),
                holder: h.map(HolderId),
            });
        }
        at += m * MIN;
    }
    out
}

fn holders() -> Vec<Holder> {
    vec![Holder { team: "ml".into(), workload_kind: None }]
}

const BOOK: &str = r#"
version = "test-1"
[[price]]
model = "H100"
match = ["H100 80GB HBM3"]
kind = "on_demand"
usd_per_gpu_hour = "12.29"
[[price]]
model = "H100"
match = ["H100 80GB HBM3"]
kind = "committed"
usd_per_gpu_hour = "6.88"
effective_from = "2026-11-26T12:30:00Z"
"#;

fn book() -> PriceBook {
    PriceBook::from_toml(BOOK).expect("book")
}

const H100: GpuKey<'static> = GpuKey { model_name: "NVIDIA H100 80GB HBM3", mig_profile: None, cluster: None };

fn money(rows: &[CostRow], hour: i64, team: &str) -> HourMoney {
    rows.iter()
        .find(|r| r.hour_us == hour && r.team == team)
        .and_then(|r| r.money)
        .unwrap_or_else(|| panic!("no priced cell {hour} {team}"))
}

#[test]
fn stranded_45_min_at_12_29() {
    // 10 busy, 45 idle (stranded), 5 busy; $12.29/h.
    // cost = 12.29 (all 3600 s known); idle = stranded = 12.29 × 2700/3600 = 9.2175.
    let h = t("2026-11-23T10:00:00Z");
    let w = trace(h, &[(10, 'B', Some(0)), (45, 'I', Some(0)), (5, 'B', Some(0))]);
    let c = classify(&w, &holders(), &ClassifyConfig::default(), h, h + US_PER_HOUR).expect("classify");
    let rows = hourly_cost(&c, &book(), &H100).expect("cost");
    let m = money(&rows, h, "ml");
    assert_eq!(m.price_per_gpu_hour, Micros(12_290_000));
    assert_eq!(m.cost_usd, Micros(12_290_000));
    assert_eq!(m.idle_cost_usd, Micros(9_217_500));
    assert_eq!(m.stranded_cost_usd, Micros(9_217_500));
    // The run's own cost, as the report's top-stranded list needs it: same 9.2175.
    let segs = price_segments(&book(), &H100, h, h + US_PER_HOUR).expect("segments");
    assert_eq!(interval_cost(&segs, h + 10 * MIN, h + 55 * MIN).expect("cost"), Some(Micros(9_217_500)));
}

#[test]
fn unknown_seconds_are_not_billed() {
    // 20 idle, 5 gap, 20 idle, 15 busy. ml known = 3300 s: 12.29 × 3300/3600 = 11.265833…
    // -> 11.265833; idle 2400 s: 12.29 × 2/3 = 8.193333… -> 8.193333; stranded 0.
    // The gap's unknown 300 s sit in "unallocated" and cost nothing.
    let h = t("2026-11-23T10:00:00Z");
    let w = trace(h, &[(20, 'I', Some(0)), (5, '-', None), (20, 'I', Some(0)), (15, 'B', Some(0))]);
    let c = classify(&w, &holders(), &ClassifyConfig::default(), h, h + US_PER_HOUR).expect("classify");
    let rows = hourly_cost(&c, &book(), &H100).expect("cost");
    let m = money(&rows, h, "ml");
    assert_eq!((m.cost_usd, m.idle_cost_usd, m.stranded_cost_usd), (Micros(11_265_833), Micros(8_193_333), Micros(0)));
    let u = money(&rows, h, UNALLOCATED);
    assert_eq!((u.cost_usd, u.idle_cost_usd, u.price_per_gpu_hour), (Micros(0), Micros(0), Micros(12_290_000)));
}

#[test]
fn a_short_gap_keeps_stranded_pricing_from_the_runs_start_and_is_not_billed() {
    // 20 idle, 1 min gap (an agent restart; max_idle_gap is 2 min), 20 idle, 19 busy:
    // one 41-min run, stranded from its start. ml known = 2400 + 1140 = 3540 s:
    // 12.29 × 3540/3600 = 12.0851666… -> 12.085167; idle = stranded = 2400 s:
    // 12.29 × 2/3 = 8.193333… -> 8.193333. The gap's 60 s sit in "unallocated", $0.
    let h = t("2026-11-23T10:00:00Z");
    let w = trace(h, &[(20, 'I', Some(0)), (1, '-', None), (20, 'I', Some(0)), (19, 'B', Some(0))]);
    let c = classify(&w, &holders(), &ClassifyConfig::default(), h, h + US_PER_HOUR).expect("classify");
    let rows = hourly_cost(&c, &book(), &H100).expect("cost");
    let m = money(&rows, h, "ml");
    assert_eq!(
        (m.cost_usd, m.idle_cost_usd, m.stranded_cost_usd),
        (Micros(12_085_167), Micros(8_193_333), Micros(8_193_333))
    );
    let u = money(&rows, h, UNALLOCATED);
    assert_eq!((u.cost_usd, u.idle_cost_usd, u.stranded_cost_usd), (Micros(0), Micros(0), Micros(0)));
}

#[test]
fn price_change_at_12_30_splits_the_hour() {
    // 12:00–12:15 busy, 12:15–12:45 idle (30 min: stranded), 12:45–13:00 busy.
    // Price 12.29 until 12:30, 6.88 from 12:30.
    // cost = 12.29 × 0.5 + 6.88 × 0.5 = 6.145 + 3.44 = 9.585
    // stranded = idle = 12.29 × 0.25 (12:15–12:30) + 6.88 × 0.25 (12:30–12:45) = 3.0725 + 1.72 = 4.7925
    // price column = time-weighted (12.29 + 6.88) / 2 = 9.585
    let h = t("2026-11-26T12:00:00Z");
    let w = trace(h, &[(15, 'B', Some(0)), (30, 'I', Some(0)), (15, 'B', Some(0))]);
    let c = classify(&w, &holders(), &ClassifyConfig::default(), h, h + US_PER_HOUR).expect("classify");
    let rows = hourly_cost(&c, &book(), &H100).expect("cost");
    let m = money(&rows, h, "ml");
    assert_eq!(m.cost_usd, Micros(9_585_000));
    assert_eq!(m.stranded_cost_usd, Micros(4_792_500));
    assert_eq!(m.idle_cost_usd, Micros(4_792_500));
    assert_eq!(m.price_per_gpu_hour, Micros(9_585_000));
}

#[test]
fn price_change_on_an_hour_boundary_prices_each_hour_alone() {
    // Change at 12:00 exactly: 11:00–12:00 busy at 12.29, 12:00–13:00 busy at 6.88.
    let b = PriceBook::from_toml(&BOOK.replace("12:30:00Z", "12:00:00Z")).expect("book");
    let h = t("2026-11-26T11:00:00Z");
    let w = trace(h, &[(120, 'B', Some(0))]);
    let c = classify(&w, &holders(), &ClassifyConfig::default(), h, h + 2 * US_PER_HOUR).expect("classify");
    let rows = hourly_cost(&c, &b, &H100).expect("cost");
    assert_eq!(money(&rows, h, "ml").cost_usd, Micros(12_290_000));
    assert_eq!(money(&rows, h + US_PER_HOUR, "ml").cost_usd, Micros(6_880_000));
}

#[test]
fn mig_slice_is_priced_by_its_share() {
    // 1g.10gb of a $12.29 H100: 12.29 / 7 = 1.755714285… -> $1.755714/h.
    // 20 idle (allocated idle) + 40 busy: cost 1.755714; idle = 1.755714 / 3 = 0.585238 exactly.
    let h = t("2026-11-23T10:00:00Z");
    let w = trace(h, &[(20, 'I', Some(0)), (40, 'B', Some(0))]);
    let c = classify(&w, &holders(), &ClassifyConfig::default(), h, h + US_PER_HOUR).expect("classify");
    let mig = GpuKey { mig_profile: Some("1g.10gb"), ..H100 };
    let rows = hourly_cost(&c, &book(), &mig).expect("cost");
    let m = money(&rows, h, "ml");
    assert_eq!(
        (m.price_per_gpu_hour, m.cost_usd, m.idle_cost_usd),
        (Micros(1_755_714), Micros(1_755_714), Micros(585_238))
    );
}

#[test]
fn unpriced_hours_carry_no_money_and_say_why() {
    let h = t("2026-11-23T10:00:00Z");
    let w = trace(h, &[(60, 'B', Some(0))]);
    let c = classify(&w, &holders(), &ClassifyConfig::default(), h, h + US_PER_HOUR).expect("classify");
    let rows = hourly_cost(&c, &book(), &GpuKey { model_name: "NVIDIA B200", ..H100 }).expect("cost");
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].money, None);
    assert!(matches!(rows[0].unpriced, Some(Unpriced::UnknownModel { .. })));
    // A book whose only entry starts at 10:30: the 10:00 hour is unpriced (half of it has
    // no price), the 11:00 hour is priced.
    let late = PriceBook::from_toml(
        "version = \"v\"\n[[price]]\nmodel = \"H100\"\nmatch = [\"H100 80GB HBM3\"]\nkind = \"spot\"\nusd_per_gpu_hour = \"2\"\neffective_from = \"2026-11-23T10:30:00Z\"\n",
    )
    .expect("book");
    let w = trace(h, &[(120, 'B', Some(0))]);
    let c = classify(&w, &holders(), &ClassifyConfig::default(), h, h + 2 * US_PER_HOUR).expect("classify");
    let rows = hourly_cost(&c, &late, &H100).expect("cost");
    assert!(matches!(rows[0].unpriced, Some(Unpriced::NotYetInForce { .. })) && rows[0].money.is_none());
    assert_eq!(rows[1].money.map(|m| m.cost_usd), Some(Micros(2_000_000)));
    let segs = price_segments(&late, &H100, h, h + 2 * US_PER_HOUR).expect("segments");
    assert_eq!(interval_cost(&segs, h, h + US_PER_HOUR).expect("cost"), None);
    assert_eq!(interval_cost(&segs, h + 30 * MIN, h + 45 * MIN).expect("cost"), Some(Micros(500_000)));
    let _ = S;
}
