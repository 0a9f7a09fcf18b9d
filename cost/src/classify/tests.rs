//! Hand-computed traces. Expected seconds are worked out in the comments from the trace
//! description, never by calling the code under test.

use super::*;
use crate::time::parse_instant;

const MIN: i64 = 60_000_000;
const S: i64 = 1_000_000;

fn t(s: &str) -> i64 {
    parse_instant(s).expect("timestamp")
}

/// Windows of `win` µs from `start` for `minutes`, all busy ('B', sm 0.5), under-used busy
/// ('b', sm mean 0.1), idle ('I'), signal-less ('U') or absent ('-': a gap).
fn stretch(out: &mut Vec<Window>, start: i64, minutes: i64, win: i64, kind: char, holder: Option<usize>) -> i64 {
    let end = start + minutes * MIN;
    let mut e = start + win;
    while e <= end {
        let (sm_max, mean) = match kind {
            'B' => (Some(0.5), Some(0.5)),
            'b' => (Some(0.5), Some(0.1)),
            'I' => (Some(0.0), Some(0.0)),
            'U' => (None, None),
            _ => {
                e += win;
                continue;
            }
        };
        out.push(Window {
            end_us: e,
            window_us: win,
            sm_active_max: sm_max,
            gpu_util_max: None,
            sm_active_mean: mean,
            holder: holder.map(HolderId),
        });
        e += win;
    }
    end
}

/// A trace from (minutes, kind, holder) pieces with 60 s windows from `start`.
fn trace(start: i64, pieces: &[(i64, char, Option<usize>)]) -> Vec<Window> {
    let mut out = Vec::new();
    let mut at = start;
    for &(m, k, h) in pieces {
        at = stretch(&mut out, at, m, MIN, k, h);
    }
    let _ = at;
    out
}

fn holders() -> Vec<Holder> {
    vec![
        Holder { team: "ml".into(), workload_kind: Some("training".into()) },
        Holder { team: "vision".into(), workload_kind: Some("notebook".into()) },
        Holder { team: "research".into(), workload_kind: Some("notebook".into()) },
    ]
}

fn cell<'a>(rows: &'a [HourTeam], hour: i64, team: &str) -> &'a StateMicros {
    match rows.iter().find(|r| r.hour_us == hour && r.team == team) {
        Some(r) => &r.micros,
        None => panic!("no cell {hour} {team}: {rows:?}"),
    }
}

fn assert_hours_sum(rows: &[HourTeam], from: i64, to: i64) {
    let mut h = from;
    while h < to {
        let sum: i64 = rows.iter().filter(|r| r.hour_us == h).map(|r| r.micros.total()).sum();
        assert_eq!(sum, 3600 * S, "hour {h} sums to {sum}");
        h += US_PER_HOUR;
    }
}

fn run(w: &[Window], cfg: &ClassifyConfig, from: i64, to: i64) -> (Vec<HourTeam>, Classified) {
    let c = classify(w, &holders(), cfg, from, to).expect("classify");
    let rows = c.hourly();
    assert_hours_sum(&rows, from, to);
    (rows, c)
}

#[test]
fn idle_run_of_45_min_is_stranded_in_full_from_its_start() {
    // 10:00–10:10 busy, 10:10–10:55 idle (45 min >= 30m), 10:55–11:00 busy, holder ml.
    // active = 10 + 5 = 15 min = 900 s; stranded = 45 min = 2700 s.
    let h = t("2026-11-23T10:00:00Z");
    let w = trace(h, &[(10, 'B', Some(0)), (45, 'I', Some(0)), (5, 'B', Some(0))]);
    let (rows, c) = run(&w, &ClassifyConfig::default(), h, h + US_PER_HOUR);
    assert_eq!(rows.len(), 1);
    let m = cell(&rows, h, "ml");
    assert_eq!((m.active, m.stranded, m.allocated_idle, m.unknown), (900 * S, 2700 * S, 0, 0));
    assert_eq!(
        c.stranded_runs,
        vec![StrandedRun { holder: HolderId(0), start_us: h + 10 * MIN, end_us: h + 55 * MIN }]
    );
}

#[test]
fn idle_run_of_20_min_is_allocated_idle_and_exactly_30_min_is_stranded() {
    // 20 min idle then 40 min busy: allocated_idle 1200 s, active 2400 s.
    let h = t("2026-11-23T10:00:00Z");
    let w = trace(h, &[(20, 'I', Some(0)), (40, 'B', Some(0))]);
    let (rows, c) = run(&w, &ClassifyConfig::default(), h, h + US_PER_HOUR);
    let m = cell(&rows, h, "ml");
    assert_eq!((m.allocated_idle, m.active, m.stranded), (1200 * S, 2400 * S, 0));
    assert!(c.stranded_runs.is_empty());
    // Exactly 30 min "reaches" stranded_after: stranded 1800 s, active 1800 s.
    let w = trace(h, &[(30, 'I', Some(0)), (30, 'B', Some(0))]);
    let (rows, _) = run(&w, &ClassifyConfig::default(), h, h + US_PER_HOUR);
    let m = cell(&rows, h, "ml");
    assert_eq!((m.stranded, m.active), (1800 * S, 1800 * S));
}

#[test]
fn unknown_gap_ends_an_idle_run() {
    // A gap longer than max_idle_gap (2 min by default) ends a run (a shorter one does not:
    // `a_short_gap_does_not_end_a_run_and_its_seconds_stay_unknown`).
    // 20 idle, 5 min gap (no windows), 20 idle, 15 busy: two 20-min runs, neither stranded.
    // ml: allocated_idle 40 min = 2400 s, active 900 s; the gap's 300 s is unknown with no
    // holder -> team "unallocated". 2400 + 900 + 300 = 3600.
    let h = t("2026-11-23T10:00:00Z");
    let w = trace(h, &[(20, 'I', Some(0)), (5, '-', None), (20, 'I', Some(0)), (15, 'B', Some(0))]);
    let (rows, _) = run(&w, &ClassifyConfig::default(), h, h + US_PER_HOUR);
    let m = cell(&rows, h, "ml");
    assert_eq!((m.allocated_idle, m.active, m.stranded), (2400 * S, 900 * S, 0));
    assert_eq!(cell(&rows, h, UNALLOCATED).unknown, 300 * S);
    // The same gap filled with signal-less windows that name the holder: gap time too, so
    // still longer than the bound and the run ends; the 300 s of unknown now belong to ml.
    let w = trace(h, &[(20, 'I', Some(0)), (5, 'U', Some(0)), (20, 'I', Some(0)), (15, 'B', Some(0))]);
    let (rows, _) = run(&w, &ClassifyConfig::default(), h, h + US_PER_HOUR);
    assert_eq!(rows.len(), 1);
    let m = cell(&rows, h, "ml");
    assert_eq!((m.allocated_idle, m.unknown, m.stranded), (2400 * S, 300 * S, 0));
}

#[test]
fn a_short_gap_does_not_end_a_run_and_its_seconds_stay_unknown() {
    let h = t("2026-11-23T10:00:00Z");
    let cfg = ClassifyConfig::default();
    assert_eq!(cfg.max_idle_gap, Duration::from_secs(120));
    // 20 idle, 1 min gap (no windows: an agent restart), 20 idle, 19 busy, holder ml.
    // One run 10:00–10:41, 41 min >= 30 including the gap: its idle windows are stranded
    // from its start, 40 min = 2400 s; allocated idle 0; active 19 min = 1140 s; the gap's
    // 60 s unknown with no holder (team "unallocated"). 2400 + 1140 + 60 = 3600.
    let w = trace(h, &[(20, 'I', Some(0)), (1, '-', None), (20, 'I', Some(0)), (19, 'B', Some(0))]);
    let (rows, c) = run(&w, &cfg, h, h + US_PER_HOUR);
    let m = cell(&rows, h, "ml");
    assert_eq!((m.stranded, m.allocated_idle, m.active, m.unknown), (2400 * S, 0, 1140 * S, 0));
    assert_eq!(cell(&rows, h, UNALLOCATED).unknown, 60 * S);
    assert_eq!(c.stranded_runs, vec![StrandedRun { holder: HolderId(0), start_us: h, end_us: h + 41 * MIN }]);
    // A gap of exactly the bound, as signal-less windows naming the holder: 20 I, 2 U,
    // 20 I, 18 B. Stranded 2400 s, active 1080 s, the 120 s unknown are ml's.
    let w = trace(h, &[(20, 'I', Some(0)), (2, 'U', Some(0)), (20, 'I', Some(0)), (18, 'B', Some(0))]);
    let (rows, _) = run(&w, &cfg, h, h + US_PER_HOUR);
    let m = cell(&rows, h, "ml");
    assert_eq!((m.stranded, m.allocated_idle, m.active, m.unknown), (2400 * S, 0, 1080 * S, 120 * S));
    // Longer than the bound (3 min): two 20-min runs, allocated idle 2400 s, unknown 180 s.
    let w = trace(h, &[(20, 'I', Some(0)), (3, '-', None), (20, 'I', Some(0)), (17, 'B', Some(0))]);
    let (rows, c) = run(&w, &cfg, h, h + US_PER_HOUR);
    let m = cell(&rows, h, "ml");
    assert_eq!((m.stranded, m.allocated_idle, m.active), (0, 2400 * S, 1020 * S));
    assert!(c.stranded_runs.is_empty());
    // `max_idle_gap = "0s"`: only back-to-back windows make a run (the rule before it had
    // a bound): the 1-min gap ends it.
    let strict = ClassifyConfig::from_toml("max_idle_gap = \"0s\"").expect("config");
    let w = trace(h, &[(20, 'I', Some(0)), (1, '-', None), (20, 'I', Some(0)), (19, 'B', Some(0))]);
    let (rows, _) = run(&w, &strict, h, h + US_PER_HOUR);
    assert_eq!(cell(&rows, h, "ml").allocated_idle, 2400 * S);
}

#[test]
fn a_holder_change_ends_a_run_across_a_short_gap_even_without_a_signal() {
    let h = t("2026-11-23T10:00:00Z");
    // 20 idle ml, 1 min gap, 20 idle vision (another holder), 19 busy vision: two runs of
    // 20 min, neither stranded: ml allocated idle 1200 s, vision 1200 s + active 1140 s.
    let w = trace(h, &[(20, 'I', Some(0)), (1, '-', None), (20, 'I', Some(1)), (19, 'B', Some(1))]);
    let (rows, c) = run(&w, &ClassifyConfig::default(), h, h + US_PER_HOUR);
    assert_eq!((cell(&rows, h, "ml").allocated_idle, cell(&rows, h, "ml").stranded), (1200 * S, 0));
    assert_eq!(cell(&rows, h, "vision").allocated_idle, 1200 * S);
    assert!(c.stranded_runs.is_empty());
    // A signal-less window of another holder inside ml's short gap ends ml's run too: 20 I
    // ml, 1 U vision, 20 I ml, 19 B ml: ml allocated idle 2400 s, vision unknown 60 s.
    let w = trace(h, &[(20, 'I', Some(0)), (1, 'U', Some(1)), (20, 'I', Some(0)), (19, 'B', Some(0))]);
    let (rows, c) = run(&w, &ClassifyConfig::default(), h, h + US_PER_HOUR);
    assert_eq!((cell(&rows, h, "ml").allocated_idle, cell(&rows, h, "ml").stranded), (2400 * S, 0));
    assert_eq!(cell(&rows, h, "vision").unknown, 60 * S);
    assert!(c.stranded_runs.is_empty());
}

#[test]
fn a_restart_inside_a_ten_hour_stranded_run_keeps_it_stranded_from_its_start() {
    // The finding: 10 s windows, idle and held by ml since 00:00, an agent restart leaves
    // 40 s without windows at 10:00:00–10:00:40, idle again until 10:30. Classifying
    // 10:00–11:00 (the data before it as context): the run started at 00:00 continues, so
    // 10:00:40–10:30 is stranded (1800 − 40 = 1760 s), nothing allocated idle, the 40 s
    // and 10:30–11:00 (1800 s) unknown: 1760 + 40 + 1800 = 3600.
    let day = t("2026-11-23T00:00:00Z");
    let ten = day + 10 * US_PER_HOUR;
    let mut w = Vec::new();
    stretch(&mut w, day, 600, 10 * S, 'I', Some(0));
    stretch(&mut w, ten + 40 * S, 29, 10 * S, 'I', Some(0));
    // `stretch` covers whole minutes: 10:00:40 + 29 min = 10:29:40; 20 s more to 10:30.
    w.push(Window { end_us: ten + 29 * MIN + 50 * S, ..*w.last().expect("window") });
    w.push(Window { end_us: ten + 30 * MIN, ..*w.last().expect("window") });
    let (rows, c) = run(&w, &ClassifyConfig::default(), ten, ten + US_PER_HOUR);
    let ml = cell(&rows, ten, "ml");
    assert_eq!((ml.stranded, ml.allocated_idle), (1760 * S, 0));
    assert_eq!(cell(&rows, ten, UNALLOCATED).unknown, 1840 * S);
    assert_eq!(c.stranded_runs, vec![StrandedRun { holder: HolderId(0), start_us: day, end_us: ten + 30 * MIN }]);
}

#[test]
fn run_crossing_an_hour_boundary_with_a_straddling_window_is_split_exactly() {
    // 7-min windows from 10:00. Busy 10:00–10:42 (6 windows), idle 10:42–11:24 (6 windows,
    // 42 min >= 30 -> stranded), busy 11:24–12:06 (6 windows; the last, 11:59–12:06, is cut
    // at 12:00). The window 10:56–11:03 straddles 11:00.
    // 10h: active 42 min = 2520 s, stranded 10:42–11:00 = 18 min = 1080 s.
    // 11h: stranded 11:00–11:24 = 24 min = 1440 s, active 11:24–12:00 = 36 min = 2160 s.
    let h = t("2026-11-23T10:00:00Z");
    let mut w = Vec::new();
    let mut at = stretch(&mut w, h, 42, 7 * MIN, 'B', Some(0));
    at = stretch(&mut w, at, 42, 7 * MIN, 'I', Some(0));
    stretch(&mut w, at, 42, 7 * MIN, 'B', Some(0));
    let (rows, c) = run(&w, &ClassifyConfig::default(), h, h + 2 * US_PER_HOUR);
    let a = cell(&rows, h, "ml");
    assert_eq!((a.active, a.stranded), (2520 * S, 1080 * S));
    let b = cell(&rows, h + US_PER_HOUR, "ml");
    assert_eq!((b.stranded, b.active), (1440 * S, 2160 * S));
    assert_eq!(c.stranded_runs.len(), 1);
}

#[test]
fn holder_change_ends_a_run() {
    // ml idle 20 min, then vision idle 20 min, then vision busy 20 min. Without the holder
    // change this would be one 40-min (stranded) run; with it, two 20-min runs.
    // ml: allocated_idle 1200 s. vision: allocated_idle 1200 s + active 1200 s.
    let h = t("2026-11-23T10:00:00Z");
    let w = trace(h, &[(20, 'I', Some(0)), (20, 'I', Some(1)), (20, 'B', Some(1))]);
    let (rows, c) = run(&w, &ClassifyConfig::default(), h, h + US_PER_HOUR);
    assert_eq!(cell(&rows, h, "ml").allocated_idle, 1200 * S);
    let v = cell(&rows, h, "vision");
    assert_eq!((v.allocated_idle, v.active, v.stranded), (1200 * S, 1200 * S, 0));
    assert!(c.stranded_runs.is_empty());
}

#[test]
fn unallocated_busy_and_unallocated_idle_are_never_stranded() {
    // No holder: 30 min busy then 30 min idle -> unallocated_busy 1800 s, unallocated_idle
    // 1800 s (a 30-min idle run, but nobody holds the GPU, so it cannot be stranded).
    let h = t("2026-11-23T10:00:00Z");
    let w = trace(h, &[(30, 'B', None), (30, 'I', None)]);
    let (rows, c) = run(&w, &ClassifyConfig::default(), h, h + US_PER_HOUR);
    let u = cell(&rows, h, UNALLOCATED);
    assert_eq!((u.unallocated_busy, u.unallocated_idle, u.stranded), (1800 * S, 1800 * S, 0));
    assert!(c.stranded_runs.is_empty());
}

#[test]
fn underused_is_a_part_of_active() {
    // 10 min busy with sm mean 0.1 (< 0.2) + 50 min busy at 0.5: active 3600 s, underused 600 s.
    let h = t("2026-11-23T10:00:00Z");
    let w = trace(h, &[(10, 'b', Some(0)), (50, 'B', Some(0))]);
    let (rows, _) = run(&w, &ClassifyConfig::default(), h, h + US_PER_HOUR);
    let m = cell(&rows, h, "ml");
    assert_eq!((m.active, m.underused), (3600 * S, 600 * S));
}

#[test]
fn signal_choice_sm_activity_first_then_gpu_util() {
    let cfg = ClassifyConfig::default();
    let w = |sm: Option<f64>, util: Option<f64>| Window {
        end_us: 1,
        window_us: 1,
        sm_active_max: sm,
        gpu_util_max: util,
        sm_active_mean: None,
        holder: None,
    };
    assert_eq!(observe(&w(Some(0.005), Some(50.0)), &cfg), Obs::Idle); // SM activity decides
    assert_eq!(observe(&w(Some(0.01), None), &cfg), Obs::Busy { underused: false }); // not < 0.01
    assert_eq!(observe(&w(None, Some(0.0)), &cfg), Obs::Idle);
    assert_eq!(observe(&w(None, Some(3.0)), &cfg), Obs::Busy { underused: false });
    assert_eq!(observe(&w(None, None), &cfg), Obs::Unknown);
    assert_eq!(observe(&w(Some(f64::NAN), None), &cfg), Obs::Unknown);
    assert_eq!(observe(&w(Some(f64::NAN), Some(0.0)), &cfg), Obs::Idle);
}

#[test]
fn team_override_beats_kind_override() {
    // research (kind notebook): team says 1h, kind says 10m -> team wins: a 45-min idle
    // run stays allocated_idle (2700 s). vision (kind notebook, no team override): 10m
    // applies, so its 15-min idle run is stranded (900 s).
    let cfg = ClassifyConfig::from_toml(
        "stranded_after = \"30m\"\nstranded_after_team = { research = \"1h\" }\nstranded_after_kind = { notebook = \"10m\" }\n",
    )
    .expect("config");
    assert_eq!(cfg.max_stranded_after_us(), 60 * MIN);
    let h = t("2026-11-23T10:00:00Z");
    let w = trace(h, &[(45, 'I', Some(2)), (15, 'I', Some(1))]);
    let (rows, _) = run(&w, &cfg, h, h + US_PER_HOUR);
    assert_eq!(cell(&rows, h, "research").allocated_idle, 2700 * S);
    assert_eq!(cell(&rows, h, "vision").stranded, 900 * S);
}

#[test]
fn no_data_is_unknown_and_inputs_are_checked() {
    let h = t("2026-11-23T10:00:00Z");
    let (rows, _) = run(&[], &ClassifyConfig::default(), h, h + 2 * US_PER_HOUR);
    assert_eq!(rows.len(), 2);
    assert!(rows.iter().all(|r| r.team == UNALLOCATED && r.micros.unknown == 3600 * S));
    let cfg = ClassifyConfig::default();
    assert!(matches!(classify(&[], &holders(), &cfg, h + 1, h + US_PER_HOUR), Err(ClassifyError::BadRange { .. })));
    assert!(matches!(classify(&[], &holders(), &cfg, h, h), Err(ClassifyError::BadRange { .. })));
    let mut w = trace(h, &[(2, 'B', Some(0))]);
    w.swap(0, 1);
    assert!(matches!(classify(&w, &holders(), &cfg, h, h + US_PER_HOUR), Err(ClassifyError::OutOfOrder { .. })));
    let w = trace(h, &[(1, 'B', Some(7))]);
    assert!(matches!(classify(&w, &holders(), &cfg, h, h + US_PER_HOUR), Err(ClassifyError::UnknownHolder { .. })));
    assert!(ClassifyConfig::from_toml("stranded_after = \"0s\"").is_err());
    assert!(ClassifyConfig::from_toml("stranded_afterr = \"1m\"").is_err());
    assert!(ClassifyConfig::from_toml("stranded_after = \"soon\"").is_err());
}

#[test]
fn overlapping_windows_are_clipped_not_double_counted() {
    // Two 60 s windows ending at +60 s and +90 s: the second is clipped to (60 s, 90 s];
    // then nothing until the hour ends. active 90 s, unknown 3510 s (gap, unallocated).
    let h = t("2026-11-23T10:00:00Z");
    let mk = |end: i64| Window {
        end_us: h + end * S,
        window_us: 60 * S,
        sm_active_max: Some(1.0),
        gpu_util_max: None,
        sm_active_mean: None,
        holder: Some(HolderId(0)),
    };
    let (rows, _) = run(&[mk(60), mk(90)], &ClassifyConfig::default(), h, h + US_PER_HOUR);
    assert_eq!(cell(&rows, h, "ml").active, 90 * S);
    assert_eq!(cell(&rows, h, UNALLOCATED).unknown, 3510 * S);
}

/// A deterministic pseudo-random trace (LCG) over `hours` hours with 30 s windows, idle runs
/// of all lengths, gaps, holder changes and signal-less windows.
fn pseudo_random_trace(start: i64, hours: i64, seed: u64) -> Vec<Window> {
    let mut x = seed;
    let mut next = move |m: u64| {
        x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        (x >> 33) % m
    };
    let mut out = Vec::new();
    let mut at = start;
    let end = start + hours * US_PER_HOUR;
    while at < end {
        let minutes = 1 + next(70) as i64;
        let kind = ['B', 'b', 'I', 'I', 'I', 'U', '-'][next(7) as usize];
        let holder = match next(4) {
            0 => None,
            n => Some(n as usize - 1),
        };
        let mut chunk = Vec::new();
        at = stretch(&mut chunk, at, minutes, 30 * S, kind, holder);
        out.extend(chunk);
    }
    out
}

#[test]
fn recompute_plan_context_is_sufficient_and_changes_stay_inside_it() {
    let cfg = ClassifyConfig::from_toml("stranded_after = \"30m\"\nstranded_after_team = { research = \"90m\" }\n")
        .expect("config");
    let s = cfg.max_stranded_after_us();
    assert_eq!(s, 90 * MIN);
    // The context is that plus max_idle_gap (default 2 min): a run's link across a short
    // gap is seen only with the gap's far side (see `recompute_plan`).
    assert_eq!(cfg.context_us(), 92 * MIN);
    let day = t("2026-11-23T00:00:00Z");
    let full = pseudo_random_trace(day, 24, 7);
    let all = classify(&full, &holders(), &cfg, day, day + 24 * US_PER_HOUR).expect("classify").hourly();

    // Late data changed samples in [09:10, 09:20).
    let (a, b) = (day + 9 * US_PER_HOUR + 10 * MIN, day + 9 * US_PER_HOUR + 20 * MIN);
    let plan = recompute_plan(a, b, &cfg);
    // By hand, with the context 92 min (90 + max_idle_gap 2; before the gap rule it was 90
    // and the data [05:30, 12:30)): a − 92m = 07:38 -> hours from 07:00; b + 92m = 10:52 ->
    // hours to 11:00; data [07:00 − 92m, 11:00 + 92m) = [05:28, 12:32).
    assert_eq!(plan.hours_from_us, day + 7 * US_PER_HOUR);
    assert_eq!(plan.hours_to_us, day + 11 * US_PER_HOUR);
    assert_eq!(plan.data_from_us, day + 5 * US_PER_HOUR + 28 * MIN);
    assert_eq!(plan.data_to_us, day + 12 * US_PER_HOUR + 32 * MIN);

    // (1) Sufficient context: classifying the plan's hours from only the plan's data gives
    // the same cells as classifying from the whole day.
    let ctx: Vec<Window> = full
        .iter()
        .copied()
        .filter(|w| w.end_us > plan.data_from_us && w.end_us - w.window_us < plan.data_to_us)
        .collect();
    let part = classify(&ctx, &holders(), &cfg, plan.hours_from_us, plan.hours_to_us).expect("classify").hourly();
    let expect: Vec<HourTeam> =
        all.iter().filter(|r| r.hour_us >= plan.hours_from_us && r.hour_us < plan.hours_to_us).cloned().collect();
    assert_eq!(part, expect);

    // (2) Locality: flip every window inside [a, b) (idle <-> busy, holder -> research) and
    // reclassify the day: only hours inside the plan may differ.
    let changed: Vec<Window> = full
        .iter()
        .map(|w| {
            if w.end_us > a && w.end_us - w.window_us < b {
                let idle = w.sm_active_max.is_some_and(|v| v < 0.01);
                Window { sm_active_max: Some(if idle { 0.9 } else { 0.0 }), holder: Some(HolderId(2)), ..*w }
            } else {
                *w
            }
        })
        .collect();
    let after = classify(&changed, &holders(), &cfg, day, day + 24 * US_PER_HOUR).expect("classify").hourly();
    let outside = |rows: &[HourTeam]| -> Vec<HourTeam> {
        rows.iter().filter(|r| r.hour_us < plan.hours_from_us || r.hour_us >= plan.hours_to_us).cloned().collect()
    };
    assert_eq!(outside(&all), outside(&after));
    assert_ne!(all, after, "the change must show somewhere");
    assert_hours_sum(&after, day, day + 24 * US_PER_HOUR);
}

#[test]
fn the_idle_rule_decides_by_the_first_signal_present_at_its_thresholds() {
    let cfg = ClassifyConfig::default(); // sm_active < 0.01 idle; else util ≤ 0 idle
    let w = |sm: Option<f64>, util: Option<f64>| Window {
        end_us: 60 * S,
        window_us: 60 * S,
        sm_active_max: sm,
        gpu_util_max: util,
        sm_active_mean: sm,
        holder: None,
    };
    assert_eq!(window_is_idle(&w(Some(0.009), Some(0.9)), &cfg), Some(true), "SM activity decides over utilisation");
    assert_eq!(window_is_idle(&w(Some(0.01), None), &cfg), Some(false), "at the SM threshold: busy");
    assert_eq!(window_is_idle(&w(None, Some(0.0)), &cfg), Some(true), "utilisation at its threshold: idle");
    assert_eq!(window_is_idle(&w(None, Some(0.01)), &cfg), Some(false));
    assert_eq!(window_is_idle(&w(Some(f64::NAN), Some(0.0)), &cfg), Some(true), "a NaN signal is absent");
    assert_eq!(window_is_idle(&w(None, None), &cfg), None);
    assert_eq!(
        cfg.idle_sql(),
        "(CASE WHEN sm_active_max IS NOT NULL THEN CAST(sm_active_max AS DOUBLE) < 0.01 \
         WHEN gpu_util_max IS NOT NULL THEN CAST(gpu_util_max AS DOUBLE) <= 0 END)"
    );
}
