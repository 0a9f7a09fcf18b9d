//! One idle-run rule (docs/cost.md, "The idle-run rule"), end to end on the real `apron
//! serve`: an agent restart in the middle of a stranded run leaves 40 s without windows;
//! the ledger (`gpu_cost_hourly.stranded_s`), the UI heatmap's query over it and the
//! `stranded_allocation` alert (`/api/v1/alerts`) must agree on the run before and after
//! the gap, and the gap's seconds must be unknown (never idle, never priced). A second GPU
//! whose agent is away for longer than `max_idle_gap` (2 min) starts a new run after it.
//!
//! The runs begin 2 h ago, further back than the alerts' lookback, so the alert's look
//! further back (the rule in SQL) is exercised too.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use apron_common::wire::{encode_ipc, windows_to_batch};
use apron_common::{Field, FieldStats, GpuHolder, GpuIdentity, GpuUuid, GpuWindow, HostName, UnixMicros};
use apron_test_support::poll;
use serde_json::Value;

use super::{ServerProc, TOKEN, bearer, ingest_headers, now_us, request};

const SEC: i64 = 1_000_000;
const HOUR: i64 = 3_600 * SEC;
const VIEWER: &str = "idle-rule-viewer-token-0123456789";
/// $3.60 per GPU-hour: exactly $0.001 per second.
const BOOK: &str = "version = \"test-1\"\n[[price]]\nmodel = \"H100\"\nmatch = [\"H100 80GB HBM3\"]\nkind = \"on_demand\"\nusd_per_gpu_hour = \"3.60\"\n";

fn gpu(uuid: &str, index: u32) -> GpuIdentity {
    GpuIdentity::gpu(
        HostName::new("node-7").expect("host"),
        GpuUuid::new(uuid).expect("uuid"),
        index,
        "NVIDIA H100 80GB HBM3",
    )
}

/// Idle 1 s windows of `uuid` held by pod `ml/<pod>` ending in `(from, to]`.
fn idle(uuid: &str, index: u32, pod: &str, from: i64, to: i64) -> Vec<GpuWindow> {
    let holder = GpuHolder::pod(Some("ml".into()), Some(pod.into()), None);
    let zero = Some(FieldStats { count: 1, mean: 0.0, min: 0.0, max: 0.0, last: 0.0 });
    (from / SEC + 1..=to / SEC)
        .map(|s| {
            let mut w = GpuWindow::new(UnixMicros(s * SEC), Duration::from_secs(1), gpu(uuid, index));
            w.fields[Field::SmActive.index()] = zero;
            w.fields[Field::GpuUtil.index()] = zero;
            w.owner = Some(holder.clone());
            w
        })
        .collect()
}

fn ship(addr: SocketAddr, seq: &mut u64, rows: &[GpuWindow]) {
    let auth = bearer();
    for chunk in rows.chunks(1000) {
        let body = encode_ipc(&windows_to_batch(chunk).expect("batch")).expect("ipc");
        *seq += 1;
        let s = seq.to_string();
        let r =
            request(addr, "POST", "/api/v1/ingest", &ingest_headers("gpu_samples", "node-7", "e1", &s, &auth), &body);
        assert_eq!(r.status, 200, "ingest #{s}: {r:?}");
    }
}

fn sql(addr: SocketAddr, q: &str) -> Vec<Value> {
    let auth = format!("Bearer {VIEWER}");
    let r =
        request(addr, "POST", "/api/v1/sql", &[("authorization", &auth), ("accept", "application/json")], q.as_bytes());
    assert_eq!(r.status, 200, "{q}: {r:?}");
    r.json()["rows"].as_array().expect("rows").clone()
}

fn num(v: &Value) -> f64 {
    v.as_f64().or_else(|| v.as_str().and_then(|s| s.parse().ok())).unwrap_or_else(|| panic!("not a number: {v}"))
}

/// Per GPU and hour: `(stranded_s, allocated_idle_s, unknown_s, idle_cost_usd)`, read
/// with the UI heatmap's own query (dashboards/ui/app.js, `loadHourly`).
fn heatmap(addr: SocketAddr) -> BTreeMap<(String, i64), (f64, f64, f64, f64)> {
    let rows = sql(
        addr,
        "SELECT date_trunc('hour', now()) AS now_hour, \"hour\", \"cluster\", host, gpu_uuid, max(gpu_model) AS gpu_model, \
         sum(active_s) AS active, sum(allocated_idle_s) AS allocated_idle, sum(stranded_s) AS stranded, \
         sum(unallocated_idle_s) AS unallocated_idle, sum(unallocated_busy_s) AS unallocated_busy, sum(unknown_s) AS unknown, \
         sum(idle_cost_usd) AS idle_usd, sum(cost_usd) AS cost_usd, string_agg(team, ', ') AS teams \
         FROM gpu_cost_hourly \
         WHERE \"hour\" >= date_trunc('hour', now()) - INTERVAL '23 hours' \
         GROUP BY \"hour\", \"cluster\", host, gpu_uuid \
         ORDER BY host, gpu_uuid, \"hour\"",
    );
    rows.iter()
        .map(|r| {
            let hour = r[1].as_str().expect("hour");
            let hour = apron_cost::time::parse_instant(hour).unwrap_or_else(|e| panic!("hour {hour}: {e}"));
            (
                (r[4].as_str().expect("uuid").to_owned(), hour),
                (num(&r[8]), num(&r[7]), num(&r[11]), if r[12].is_null() { f64::NAN } else { num(&r[12]) }),
            )
        })
        .collect()
}

/// The ledger's own rows, straight from `gpu_cost_hourly`: per GPU and hour,
/// `(stranded_s, allocated_idle_s, unknown_s)` summed over teams.
fn ledger(addr: SocketAddr) -> BTreeMap<(String, i64), (f64, f64, f64)> {
    sql(
        addr,
        "SELECT gpu_uuid, CAST(\"hour\" AS BIGINT) AS h, CAST(sum(stranded_s) AS DOUBLE), \
         CAST(sum(allocated_idle_s) AS DOUBLE), CAST(sum(unknown_s) AS DOUBLE) FROM gpu_cost_hourly GROUP BY 1, 2",
    )
    .iter()
    .map(|r| {
        ((r[0].as_str().expect("uuid").to_owned(), r[1].as_i64().expect("hour")), (num(&r[2]), num(&r[3]), num(&r[4])))
    })
    .collect()
}

/// Seconds of `windows` per hour (1 s windows ending at `t` cover `(t − 1 s, t]`).
fn per_hour(windows: &[GpuWindow]) -> BTreeMap<i64, f64> {
    let mut out = BTreeMap::new();
    for w in windows {
        *out.entry((w.time.0 - SEC).div_euclid(HOUR) * HOUR).or_insert(0.0) += 1.0;
    }
    out
}

/// The firing `stranded_allocation` alert of `owner`, if any.
fn stranded_alert(addr: SocketAddr, owner: &str) -> Option<Value> {
    let auth = format!("Bearer {VIEWER}");
    let r = request(addr, "GET", "/api/v1/alerts?state=firing", &[("authorization", &auth)], b"");
    assert_eq!(r.status, 200, "{r:?}");
    r.json()["alerts"]
        .as_array()
        .expect("alerts")
        .iter()
        .find(|a| a["kind"] == "stranded_allocation" && a["owner"] == owner)
        .cloned()
}

/// What GPU `uuid` must show, hour by hour: `stranded` and `allocated idle` windows.
struct Expect<'a> {
    uuid: &'a str,
    stranded: BTreeMap<i64, f64>,
    allocated_idle: BTreeMap<i64, f64>,
}

impl Expect<'_> {
    /// Whether the ledger's rows are exactly this: every hour from the first expected on
    /// holds the stranded and allocated-idle seconds expected, and every other second of
    /// the hour is unknown (the gap's included: nothing else was sent).
    fn holds(&self, rows: &BTreeMap<(String, i64), (f64, f64, f64)>) -> Result<(), String> {
        let hours: std::collections::BTreeSet<i64> =
            self.stranded.keys().chain(self.allocated_idle.keys()).copied().collect();
        for h in hours {
            let want_s = self.stranded.get(&h).copied().unwrap_or(0.0);
            let want_a = self.allocated_idle.get(&h).copied().unwrap_or(0.0);
            let got = rows.get(&(self.uuid.to_owned(), h)).copied();
            if got != Some((want_s, want_a, 3600.0 - want_s - want_a)) {
                return Err(format!(
                    "{} hour {}: got (stranded, allocated_idle, unknown) {got:?}, want ({want_s}, {want_a}, {})",
                    self.uuid,
                    UnixMicros(h).to_rfc3339(),
                    3600.0 - want_s - want_a
                ));
            }
        }
        Ok(())
    }
}

fn config(dir: &Path) -> std::path::PathBuf {
    let book = dir.join("prices.toml");
    std::fs::write(&book, BOOK).expect("book");
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[ingest]\ntokens = [{TOKEN:?}]\n[sql]\ntokens = [{VIEWER:?}]\n\
         [storage]\ndata_dir = {:?}\n\
         [cost]\ninterval = \"1s\"\nprice_book = {:?}\n\
         [alerts]\ninterval = \"1s\"\n\
         # A slow test machine must not let the GPUs' newest windows go stale meanwhile.\n\
         [alerts.rules]\nstale_after = \"1h\"\n",
        dir.join("data").display().to_string(),
        book.display().to_string()
    );
    let path = dir.join("apron.toml");
    std::fs::write(&path, text).expect("config");
    path
}

#[test]
fn an_agent_restart_inside_a_stranded_run_keeps_ledger_alert_and_heatmap_in_agreement() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = ServerProc::start(&config(dir.path()), &[], &dir.path().join("apron.log"));
    let addr = server.addr;
    let mut seq = 0u64;

    // GPU-A, pod ml/nb-a: idle since T0 (2 h ago) until T1 (30 s ago).
    let now = now_us() / SEC * SEC;
    let (t0, t1) = (now - 2 * HOUR, now - 30 * SEC);
    let before = idle("GPU-A", 0, "nb-a", t0, t1);
    ship(addr, &mut seq, &before);
    let mut want = Expect { uuid: "GPU-A", stranded: per_hour(&before), allocated_idle: BTreeMap::new() };
    // Before the gap: the whole run stranded (it is 7 170 s long), and the alert says so
    // from the same start.
    poll("the ledger prices the run before the gap", Duration::from_secs(180), || want.holds(&ledger(addr)).ok());
    let alert = poll("the stranded alert before the gap", Duration::from_secs(120), || {
        stranded_alert(addr, "ml/nb-a").filter(|a| num(&a["idle_s"]) == ((t1 - t0) / SEC) as f64)
    });
    assert_eq!(alert["starts_at"], UnixMicros(t0).to_rfc3339(), "{alert}");
    assert_eq!(alert["gpus_stranded"], 1, "{alert}");
    let stranded_before: f64 = want.stranded.values().sum();
    assert_eq!(stranded_before, ((t1 - t0) / SEC) as f64);

    // The agent restarts: nothing for 40 s after T1, then idle windows again up to T2.
    // GPU-B (pod ml/nb-b), shipped now: idle since T0 too, but its agent was away for
    // 3 min (longer than max_idle_gap) 20 min ago, so only its last 20 min are a run of
    // their own, allocated idle, and it has no stranded alert.
    let t2 = (now_us() / SEC * SEC).max(t1 + 60 * SEC);
    let after = idle("GPU-A", 0, "nb-a", t1 + 40 * SEC, t2);
    let b_first = idle("GPU-B", 1, "nb-b", t0, t2 - 23 * 60 * SEC);
    let b_second = idle("GPU-B", 1, "nb-b", t2 - 20 * 60 * SEC, t2);
    ship(addr, &mut seq, &after);
    ship(addr, &mut seq, &[b_first.clone(), b_second.clone()].concat());

    // After the gap: every idle second of A since T0 stranded (none allocated idle), the
    // 40 s of the gap unknown — the hour holding the gap has exactly 40 s more unknown
    // than its windows leave.
    for (h, n) in per_hour(&after) {
        *want.stranded.entry(h).or_insert(0.0) += n;
    }
    let want_b = Expect { uuid: "GPU-B", stranded: per_hour(&b_first), allocated_idle: per_hour(&b_second) };
    let rows = poll("the ledger prices the run after the gap", Duration::from_secs(180), || {
        let rows = ledger(addr);
        (want.holds(&rows).is_ok() && want_b.holds(&rows).is_ok()).then_some(rows)
    });
    let gap_hour = (t1 / HOUR) * HOUR;
    let (_, _, unknown) = rows[&("GPU-A".to_owned(), gap_hour)];
    let windows_in_gap_hour = want.stranded[&gap_hour];
    assert_eq!(unknown, 3600.0 - windows_in_gap_hour, "the gap's 40 s are unknown, not idle");
    let allocated_idle_a: f64 = rows.iter().filter(|((g, _), _)| g == "GPU-A").map(|(_, r)| r.1).sum();
    assert_eq!(allocated_idle_a, 0.0, "no second of A's run is re-priced as allocated idle: {rows:?}");
    let stranded_a: f64 = rows.iter().filter(|((g, _), _)| g == "GPU-A").map(|(_, r)| r.0).sum();
    assert_eq!(stranded_a, ((t2 - t0) / SEC - 40) as f64, "the run's idle seconds, the gap's 40 s left out");

    // The alert: the same episode (same id, same start), its idle run as long as the
    // ledger's — from T0 to the newest idle window, the gap inside it.
    let after_alert = poll("the stranded alert after the gap", Duration::from_secs(120), || {
        stranded_alert(addr, "ml/nb-a").filter(|a| num(&a["idle_s"]) == ((t2 - t0) / SEC) as f64)
    });
    assert_eq!(after_alert["id"], alert["id"], "one alert across the restart: {after_alert}");
    assert_eq!(after_alert["starts_at"], UnixMicros(t0).to_rfc3339(), "{after_alert}");
    assert!(after_alert["summary"].as_str().expect("summary").contains("1 of 1 GPUs idle for 2h"), "{after_alert}");
    assert!(stranded_alert(addr, "ml/nb-b").is_none(), "B's run restarted after its 3-min gap");

    // The UI heatmap reads the same figures: every hour of A that the last 24 h show is
    // stranded as the ledger says, never allocated idle, and its idle dollars are the
    // stranded seconds at $0.001.
    let map = heatmap(addr);
    let mut seen = 0;
    for ((g, h), (stranded, allocated_idle, unknown, idle_usd)) in &map {
        if g != "GPU-A" {
            continue;
        }
        seen += 1;
        let want_s = want.stranded.get(h).copied().unwrap_or(0.0);
        assert_eq!((*stranded, *allocated_idle, *unknown), (want_s, 0.0, 3600.0 - want_s), "heatmap hour {h}");
        assert!((idle_usd - want_s / 1000.0).abs() < 1e-9, "heatmap hour {h}: ${idle_usd} for {want_s} s");
    }
    assert!(seen >= 3, "the heatmap shows A's hours: {map:?}");
    server.stop();
}
