//! Savings only for live holders: the real `apron serve`, a trace of the hour up to now
//! ingested over HTTP, `GET /api/v1/recommendations` and the `recommendations` table.
//!
//! | GPU (H100, $3.60/h)  | holder, the last hour (0 = an hour ago)                      | item                 |
//! | -------------------- | ------------------------------------------------------------ | -------------------- |
//! | L (node-0)           | pod ds/live-nb, idle 0–60 min: still holds it                 | reclaim, live        |
//! | E (node-1)           | pod ds/gone-nb idle 0–40, then windows of nobody (released)   | reclaim, ended at 40 |
//! | S (node-2)           | pod ds/silent-nb idle 0–30, then no window at all (silent)    | reclaim, ended at 30 |
//! | H0, H1 (node-3)      | Slurm job 777 (H0 busy, H1 idle) 0–30, then job 888 (busy)    | right-size, ended at 30 (hand-over) |
//! | K0, K1 (node-4)      | Slurm job 999 (K0 busy, K1 idle) 0–60                         | right-size, live     |
//!
//! Live = the ledger's open allocation at the run's end: the GPU's newest window is the
//! holder's and at most 10 minutes old (docs/alerts-and-recommendations.md).

use std::time::Duration;

use super::insights::{H100, MIN, ident, pod};
use super::{ServerProc, TOKEN, ingest_headers, now_us, poll, request, try_request_within, write_config};
use apron_common::wire::{encode_ipc, windows_to_batch};
use apron_common::{Field, FieldStats, GpuHolder, GpuIdentity, GpuWindow, UnixMicros};
use serde_json::Value;

const SQL_TOKEN: &str = "sql-token-live-holders-0123456789";
const SEC: i64 = 1_000_000;
const GIB: f64 = (1u64 << 30) as f64;
const BOOK: &str = "version = \"test-live-holders\"\n\
    [[price]]\nmodel = \"H100\"\nmatch = [\"H100 80GB HBM3\"]\nkind = \"on_demand\"\nusd_per_gpu_hour = \"3.60\"\n";

/// 10 s windows of `gpu` over `(from, to]` minutes after `base`.
fn span(base: i64, gpu: &GpuIdentity, (from, to): (i64, i64), sm: f64, holder: Option<GpuHolder>) -> Vec<GpuWindow> {
    let stat = |v: f64| Some(FieldStats { count: 10, mean: v, min: v, max: v, last: v });
    let mut out = Vec::new();
    let mut t = base + from * MIN + 10 * SEC;
    while t <= base + to * MIN {
        let mut w = GpuWindow::new(UnixMicros(t), Duration::from_secs(10), gpu.clone());
        w.fields[Field::SmActive.index()] = stat(sm);
        w.fields[Field::GpuUtil.index()] = stat(sm);
        w.fields[Field::FbUsedBytes.index()] = stat(40.0 * GIB);
        w.fields[Field::FbTotalBytes.index()] = stat(80.0 * GIB);
        w.owner = holder.clone();
        out.push(w);
        t += 10 * SEC;
    }
    out
}

fn sql(addr: std::net::SocketAddr, q: &str) -> Vec<Value> {
    let auth = format!("Bearer {SQL_TOKEN}");
    let r =
        request(addr, "POST", "/api/v1/sql", &[("authorization", &auth), ("accept", "application/json")], q.as_bytes());
    assert_eq!(r.status, 200, "{q}: {r:?}");
    r.json()["rows"].as_array().expect("rows").clone()
}

#[test]
fn ended_holders_are_history_and_never_in_the_monthly_headline() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let book = dir.path().join("prices.toml");
    std::fs::write(&book, BOOK).expect("book");
    let extra = format!(
        "[sql]\ntokens = [{SQL_TOKEN:?}]\n[cost]\ninterval = \"1s\"\nprice_book = {:?}\n\
         [recommend]\nwindow = \"1h\"\ninterval = \"1s\"\non_demand_cache = \"0s\"\n",
        book.display().to_string()
    );
    let config = write_config(dir.path(), &data, &extra, "");
    let log = dir.path().join("apron.log");
    let server = ServerProc::start(&config, &[], &log);
    let addr = server.addr;

    // The hour up to now, on whole 10 s.
    let end = now_us() / (10 * SEC) * (10 * SEC);
    let base = end - 60 * MIN;
    let g = |host: &str, uuid: &str| ident(host, uuid, H100);
    let (l, e, s) = (g("node-0", "GPU-L"), g("node-1", "GPU-E"), g("node-2", "GPU-S"));
    let (h0, h1, k0, k1) = (g("node-3", "GPU-H0"), g("node-3", "GPU-H1"), g("node-4", "GPU-K0"), g("node-4", "GPU-K1"));
    let job = |id: &str| GpuHolder::slurm_job(id);
    let mut rows = Vec::new();
    rows.extend(span(base, &l, (0, 60), 0.0, Some(pod("ds", "live-nb", "{}"))));
    rows.extend(span(base, &e, (0, 40), 0.0, Some(pod("ds", "gone-nb", "{}"))));
    rows.extend(span(base, &e, (40, 60), 0.0, None));
    rows.extend(span(base, &s, (0, 30), 0.0, Some(pod("ds", "silent-nb", "{}"))));
    rows.extend(span(base, &h0, (0, 30), 0.6, Some(job("777"))));
    rows.extend(span(base, &h1, (0, 30), 0.0, Some(job("777"))));
    rows.extend(span(base, &h0, (30, 60), 0.6, Some(job("888"))));
    rows.extend(span(base, &h1, (30, 60), 0.6, Some(job("888"))));
    rows.extend(span(base, &k0, (0, 60), 0.6, Some(job("999"))));
    rows.extend(span(base, &k1, (0, 60), 0.0, Some(job("999"))));
    rows.sort_by_key(|w| (w.time.0, w.gpu.gpu_uuid.to_string()));
    let body = encode_ipc(&windows_to_batch(&rows).expect("batch")).expect("ipc");
    let auth = format!("Bearer {TOKEN}");
    let r = request(addr, "POST", "/api/v1/ingest", &ingest_headers("gpu_samples", "t", "e1", "1", &auth), &body);
    assert_eq!(r.status, 200, "ingest: {r:?}");

    // The API, computed now: live items in `recommendations`, ended ones in `ended`.
    let bearer = format!("Bearer {SQL_TOKEN}");
    let set = poll("recommendations for the trace", Duration::from_secs(120), || {
        let r = try_request_within(
            addr,
            "GET",
            "/api/v1/recommendations?window=1h",
            &[("authorization", &bearer)],
            b"",
            Duration::from_secs(120),
        )
        .ok()?;
        let v = (r.status == 200).then(|| r.json())?;
        let n = v["recommendations"].as_array()?.len() + v["ended"].as_array()?.len();
        (n >= 5).then_some(v)
    });
    let items = |section: &str| -> Vec<(String, String, bool, Option<String>)> {
        let mut v: Vec<_> = set[section]
            .as_array()
            .expect(section)
            .iter()
            .map(|i| {
                (
                    i["kind"].as_str().expect("kind").to_owned(),
                    i["owner"].as_str().expect("owner").to_owned(),
                    i["holder_live"].as_bool().expect("holder_live"),
                    i["holder_ended_at"].as_str().map(str::to_owned),
                )
            })
            .collect();
        v.sort_by(|a, b| a.1.cmp(&b.1));
        v
    };
    let at = |m: i64| Some(UnixMicros(base + m * MIN).to_rfc3339());
    assert_eq!(
        items("recommendations"),
        vec![("right-size".into(), "999".into(), true, None), ("reclaim".into(), "ds/live-nb".into(), true, None)],
        "{set:#}"
    );
    assert_eq!(
        items("ended"),
        vec![
            ("right-size".into(), "777".into(), false, at(30)),
            ("reclaim".into(), "ds/gone-nb".into(), false, at(40)),
            ("reclaim".into(), "ds/silent-nb".into(), false, at(30)),
        ],
        "{set:#}"
    );
    // The headline is the live items' sum; the ended ones' dollars are in no total.
    let monthly = |section: &str| -> f64 {
        set[section].as_array().expect(section).iter().map(|i| i["monthly_savings_usd"].as_f64().expect("m")).sum()
    };
    let headline: f64 =
        set["monthly_savings_usd"].as_object().expect("totals").values().map(|v| v.as_f64().expect("usd")).sum();
    assert!(monthly("recommendations") > 0.0 && monthly("ended") > 0.0, "{set:#}");
    assert!((headline - monthly("recommendations")).abs() < 0.005, "{headline} vs {set:#}");
    // The ended items kept their figures (history), and say so in their summary.
    for i in set["ended"].as_array().expect("ended") {
        assert!(i["summary"].as_str().is_some_and(|s| s.contains("ended")), "{i:#}");
    }

    // The table (the background refresh over `[recommend] window`): every item, flagged.
    let table = poll("the recommendations table", Duration::from_secs(120), || {
        let rows = sql(
            addr,
            "SELECT kind, owner, holder_live, CAST(holder_ended_at AS BIGINT) FROM recommendations ORDER BY owner",
        );
        (rows.len() >= 5).then_some(rows)
    });
    let us = |m: i64| Value::from(base + m * MIN);
    assert_eq!(
        table,
        vec![
            serde_json::json!(["right-size", "777", false, us(30)]),
            serde_json::json!(["right-size", "999", true, null]),
            serde_json::json!(["reclaim", "ds/gone-nb", false, us(40)]),
            serde_json::json!(["reclaim", "ds/live-nb", true, null]),
            serde_json::json!(["reclaim", "ds/silent-nb", false, us(30)]),
        ]
    );
    // Summed over live holders, the table gives the API's headline (a later run, whose
    // window has slid by the seconds since: within 2 %).
    let live = sql(addr, "SELECT CAST(sum(monthly_savings_usd) AS DOUBLE) FROM recommendations WHERE holder_live");
    let live = live[0][0].as_f64().expect("sum");
    assert!((live - headline).abs() <= 0.02 * headline, "table {live} vs API {headline}");
    server.stop();
}
