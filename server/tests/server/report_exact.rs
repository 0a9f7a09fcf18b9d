//! Issue 42, the weekly report's findings 3, 6, 7 and 8 and its example-prices flag,
//! end to end: the real `apron report` binary on a data directory a ledger priced, the
//! HTTP endpoint for the same week, the HTML in headless Chromium and the XLSX read back
//! with openpyxl.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use super::APRON;
use super::cost::{D, DAY, SEC};
use super::rollup::open;
use apron::Server;
use apron::ledger::CostConfig;
use apron_collector::{IngestRequest, Table};
use apron_common::wire::{encode_ipc, windows_to_batch};
use apron_common::{Field, FieldStats, GpuHolder, GpuIdentity, GpuUuid, GpuWindow, HostName, UnixMicros};

/// $3.60 per GPU-hour, marked as the example book is (`example = true`).
const EXAMPLE_BOOK: &str = "version = \"example-test\"\nexample = true\n[[price]]\nmodel = \"H100\"\n\
    match = [\"H100 80GB HBM3\"]\nkind = \"on_demand\"\nusd_per_gpu_hour = \"3.60\"\n";

/// One H100 held by ml/train-a from `start_us`: `active` 1 s windows at 50 % SM, then
/// `idle` at 0 (stranded once 30 min long).
fn windows(start_us: i64, active: i64, idle: i64) -> Vec<GpuWindow> {
    let gpu = GpuIdentity::gpu(
        HostName::new("node-0").expect("host"),
        GpuUuid::new("GPU-A").expect("uuid"),
        0,
        "NVIDIA H100 80GB HBM3",
    );
    let mut holder = GpuHolder::pod(Some("ml".into()), Some("train-a".into()), None);
    holder.pod_labels = Some(r#"{"team":"ml"}"#.into());
    (1..=active + idle)
        .map(|s| {
            let mean = if s <= active { 0.5 } else { 0.0 };
            let stats = Some(FieldStats { count: 4, mean, min: 0.0, max: mean, last: mean });
            let mut w = GpuWindow::new(UnixMicros(start_us + s * SEC), Duration::from_secs(1), gpu.clone());
            w.fields[Field::SmActive.index()] = stats;
            w.fields[Field::GpuUtil.index()] = stats;
            w.owner = Some(holder.clone());
            w
        })
        .collect()
}

fn ingest(server: &Server, sequence: u64, windows: &[GpuWindow]) {
    let body = encode_ipc(&windows_to_batch(windows).expect("batch")).expect("ipc");
    server
        .store()
        .ingest(IngestRequest { table: Table::GpuSamples, agent: "a", epoch: "e", sequence, body: &body })
        .expect("ingest");
    server.store().persist_now().expect("persist");
}

/// A data directory with week 2026-W47 priced by a ledger: on Thursday D from 10:00,
/// 600 s active then 6000 s stranded — team ml's utilisation is 600 / 6600 = 1/11,
/// 0.09090909090909091, a float serde_json's default parser reads back one ULP off.
async fn priced(dir: &Path) -> (Server, PathBuf, PathBuf) {
    let server = open(dir);
    ingest(&server, 0, &windows(D * DAY + 10 * 3600 * SEC, 600, 6000));
    let book = dir.join("prices.toml");
    std::fs::write(&book, EXAMPLE_BOOK).expect("book");
    let server =
        server.with_cost(CostConfig { price_book: Some(book.clone()), ..CostConfig::default() }).expect("cost");
    let pass = server.ledger().expect("ledger").run_once((D + 1) * DAY + 2 * 3600 * SEC).await;
    assert_eq!(pass.errors, Vec::<String>::new());
    (server, dir.join("data"), book)
}

/// `apron report ARGS --data DATA --price-book BOOK --out OUT --format json`:
/// (success, stderr, the report JSON's text written if any).
fn report(data: &Path, book: &Path, out: &Path, args: &[&str]) -> (bool, String, Option<String>) {
    let _ = std::fs::remove_dir_all(out);
    let o = Command::new(APRON)
        .arg("report")
        .args(args)
        .arg("--data")
        .arg(data)
        .arg("--price-book")
        .arg(book)
        .arg("--out")
        .arg(out)
        .args(["--format", "json"])
        .env_remove("APRON_DATA")
        .output()
        .expect("apron report runs");
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    let json = std::fs::read_dir(out)
        .ok()
        .and_then(|mut d| d.next())
        .map(|e| std::fs::read_to_string(e.expect("entry").path()).expect("read"));
    (o.status.success(), stderr, json)
}

/// Findings 3 and 7 and the example flag: closing a week, re-reading it and recomputing
/// it report no change; a real change in the data is reported; the terminal and the JSON
/// say what the coverage's denominator is and that the prices are examples.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_week_rereads_without_change_and_reports_real_ones() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (server, data, book) = priced(dir.path()).await;
    let out = dir.path().join("out");
    let week = ["--week", "2026-W47"];

    let (ok, err, json) = report(&data, &book, &out, &[&week[..], &["--close"]].concat());
    assert!(ok, "{err}");
    let text = json.expect("report.json");
    // The trap of finding 3: ml's utilisation, 1/11 written exactly, does not survive
    // serde_json's default float parser (it reads back one ULP off).
    assert!(text.contains("\"utilisation\": 0.09090909090909091,"), "{text}");
    let j: serde_json::Value = serde_json::from_str(&text).expect("json");
    assert_eq!(j["teams"][0]["team"], "ml");
    let u = j["teams"][0]["utilisation"].as_f64().expect("utilisation");
    assert_ne!(u.to_bits(), (1.0f64 / 11.0).to_bits(), "serde_json reads it back off (the trap)");
    // Finding 7: one GPU with samples on Thursday D gets a row for every hour of that UTC
    // day (the ledger ran at D + 1 02:00 with nothing on D + 1): 24 GPU-hours, 6600 s
    // known = 1.83 h.
    assert_eq!((j["known_gpu_hours"].as_f64(), j["total_gpu_hours"].as_f64()), (Some(1.83), Some(24.0)), "{j:#}");
    assert_eq!((j["coverage_gpus"].as_u64(), j["coverage_hours"].as_u64()), (Some(1), Some(24)), "{j:#}");
    let basis = apron_cost::report::coverage_basis(1, 24);
    assert_eq!(j["coverage_basis"], basis.as_str());
    let line = format!("Data coverage 7.6 %: 1.83 GPU-hours with samples of 24.00 GPU-hours, {basis}.");
    assert!(err.contains(&format!("apron report: 2026-W47: {line}")), "the terminal says it: {err}");
    // Example prices, flagged in the JSON and on the terminal.
    assert_eq!(j["example_prices"], true);
    assert!(err.contains(apron_cost::report::EXAMPLE_PRICES_NOTE), "{err}");

    // Re-read (view), recompute, view again: nothing changed.
    let (ok, err, _) = report(&data, &book, &out, &week);
    assert!(ok && err.contains("is closed (frozen in") && !err.contains("changed"), "{err}");
    let (ok, err, _) = report(&data, &book, &out, &[&week[..], &["--recompute"]].concat());
    assert!(ok && err.contains("recomputed 2026-W47: nothing changed"), "{err}");
    let (ok, err, _) = report(&data, &book, &out, &week);
    assert!(ok && err.contains("is closed (frozen in") && !err.contains("changed"), "{err}");

    // A real change: an hour of work on Friday arrives late and is priced.
    ingest(&server, 1, &windows((D + 1) * DAY + 10 * 3600 * SEC, 3600, 0));
    let pass = server.ledger().expect("ledger").run_once((D + 2) * DAY + 2 * 3600 * SEC).await;
    assert_eq!(pass.errors, Vec::<String>::new());
    let (ok, err, _) = report(&data, &book, &out, &week);
    assert!(ok && err.contains("the data has changed since"), "{err}");
    assert!(err.contains(".teams[0].gpu_hours_active: 0.17 → 1.17"), "{err}");
    assert!(err.contains(".teams[0].utilisation: 0.09090909090909091 → "), "{err}");
    let (ok, err, _) = report(&data, &book, &out, &[&week[..], &["--recompute"]].concat());
    assert!(ok && err.contains("replaced the frozen copy") && err.contains(".teams[0].gpu_hours_active"), "{err}");
    let (ok, err, _) = report(&data, &book, &out, &week);
    assert!(ok && !err.contains("changed"), "after --recompute the frozen copy is the data: {err}");
}

/// Finding 6: a week before the data or in the future is refused by `apron report`
/// (non-zero, nothing written) with the words of the HTTP 404 `no_such_week`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_for_a_week_outside_the_data_fails_like_http() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (server, data, book) = priced(dir.path()).await;
    let out = dir.path().join("out");
    let now = apron_common::UnixMicros::now().0;
    let this_week = apron::report::current_week(now).expect("week");
    let future = format!("{}-W10", this_week.year + 1);

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(server.run(listener, async move {
        let _ = stopped.await;
    }));
    for week in ["2026-W40", future.as_str()] {
        let path = format!("/api/v1/reports/weekly?week={week}&format=json");
        let (status, body) =
            tokio::task::spawn_blocking(move || apron_test_support::http_get(addr, &path, None)).await.expect("join");
        assert_eq!(status, 404, "{body}");
        let body: serde_json::Value = serde_json::from_str(&body).expect("json");
        assert_eq!(body["error"], "no_such_week");
        let detail = body["detail"].as_str().expect("detail").to_owned();
        assert!(detail.starts_with(&format!("{week} is outside the stored data")), "{detail}");
        assert!(detail.contains(&format!("2026-W47 to {this_week}")), "names the weeks there are: {detail}");

        let (ok, err, json) = report(&data, &book, &out, &["--week", week]);
        assert!(!ok, "{week}: apron report must fail: {err}");
        assert!(err.contains(&detail), "{week}: the HTTP error's words ({detail}) in: {err}");
        assert!(json.is_none() && !out.exists(), "{week}: nothing written");
        assert!(!apron::report::stored_dir(&data, apron_cost::IsoWeek::parse(week).expect("w")).exists());
    }
    // The week with data still works.
    let (ok, err, json) = report(&data, &book, &out, &["--week", "2026-W47"]);
    assert!(ok && json.is_some(), "{err}");
    let _ = stop.send(());
    running.await.expect("join").expect("server");
}

/// Run in Python: the HTML report at 800 and 1280 px in headless Chromium (the UI
/// check's browser driver and overflow probe, tests/ui/chromium_check.py), then the
/// XLSX read back with openpyxl. Prints one JSON object.
const CHECK_PY: &str = r#"
import json, os, sys, tempfile, time
sys.path.insert(0, sys.argv[1])
import chromium_check as cc
import openpyxl
html, xlsx = sys.argv[2], sys.argv[3]
out = {"layout": {}, "xlsx": {}}
exe = cc.find_chromium()
if not exe:
    print(json.dumps({"error": "no chromium"})); sys.exit(0)
browser = cc.Browser(exe, tempfile.mkdtemp(prefix="apron-report-chromium-"))
try:
    target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    cdp = lambda m, p=None: browser.send(m, p, session)
    def js(expr):
        r = cdp("Runtime.evaluate", {"expression": expr, "returnByValue": True})
        return r.get("result", {}).get("value")
    cdp("Page.enable")
    for width in (800, 1280):
        cdp("Emulation.setDeviceMetricsOverride", {"width": width, "height": 1000, "deviceScaleFactor": 1, "mobile": False})
        cdp("Page.navigate", {"url": "file://" + html})
        for _ in range(100):
            if js("document.readyState") == "complete":
                break
            time.sleep(0.1)
        time.sleep(0.3)
        out["layout"][str(width)] = {
            "overflow": js(cc.OVERFLOW_JS),
            "body": js("[document.body.scrollWidth, document.body.clientWidth, document.documentElement.scrollWidth, window.innerWidth]"),
            "tables": js("Array.from(document.querySelectorAll('table')).map(t => [t.scrollWidth, t.clientWidth, Math.ceil(t.getBoundingClientRect().right)])"),
            "text": js("document.body.innerText.length"),
        }
    # The probe's control: the old one-table layout's width (15 columns of ~100 px)
    # must be found too wide at 800 px, so the check above cannot pass vacuously.
    control = os.path.join(os.path.dirname(html), "control.html")
    with open(control, "w") as f:
        f.write("<!DOCTYPE html><html><body style='margin:2em'><table><tr>" + "<td style='white-space:nowrap'>$123,456.78 total</td>" * 15 + "</tr></table></body></html>")
    cdp("Emulation.setDeviceMetricsOverride", {"width": 800, "height": 1000, "deviceScaleFactor": 1, "mobile": False})
    cdp("Page.navigate", {"url": "file://" + control})
    time.sleep(0.5)
    out["control"] = js(cc.OVERFLOW_JS)
finally:
    browser.close()

wb = openpyxl.load_workbook(xlsx)
x = out["xlsx"]
x["sheets"] = wb.sheetnames
for ws in wb.worksheets:
    header = [c.value for c in ws[1]]
    s = {"freeze": ws.freeze_panes, "header_bold": all(c.font.bold for c in ws[1]),
         "widths": [ws.column_dimensions[openpyxl.utils.get_column_letter(i + 1)].width for i in range(len(header))],
         "cells": {}}
    for row in ws.iter_rows(min_row=2):
        key = str(row[0].value)
        for h, c in zip(header, row):
            s["cells"].setdefault(h, []).append([c.value if not isinstance(c.value, float) else c.value, c.data_type, c.number_format])
    x[ws.title] = s
print(json.dumps(out))
"#;

/// Finding 8: the HTML report reads at 800 px (and 1280 px) with nothing cut off or
/// scrolling sideways; the XLSX has currency and percent formats, column widths, a
/// frozen bold header row, and owners as text (a Slurm job id next to pod names).
#[test]
fn html_fits_800px_and_xlsx_is_typed() {
    use apron_cost::report::{HourlyRow, ReportInput, ShareUnallocated, StrandedFact};
    use apron_cost::{IsoWeek, Micros, PriceBook, WeeklyReport};
    let week = IsoWeek::parse("2026-W47").expect("week");
    let h = 3_600_000_000i64;
    // Twelve teams with long names and five-figure dollars: the widest realistic table.
    let teams: Vec<String> = (0..12).map(|i| format!("research-platform-team-{i:02}-inference")).collect();
    let mut rows = Vec::new();
    for (i, team) in teams.iter().enumerate() {
        for hour in 0..100 {
            rows.push(HourlyRow {
                hour_us: week.start_us() + hour * h,
                gpu_uuid: format!("GPU-{i:02}"),
                team: team.clone(),
                active_us: h / 4,
                stranded_us: h / 2,
                allocated_idle_us: h / 4,
                cost_usd: Some(Micros(123_456_789)),
                idle_cost_usd: Some(Micros(92_592_592)),
                stranded_cost_usd: Some(Micros(61_728_394)),
                ..HourlyRow::default()
            });
        }
    }
    let stranded = [
        StrandedFact {
            owner: "13860256".into(),
            team: teams[0].clone(),
            gpus: 8,
            duration_us: 40 * h,
            cost: Micros(3_950_000_000),
        },
        StrandedFact {
            owner: "data-science/jupyter-erik-7f9c8d6b5-xk2lp-with-a-very-long-generated-suffix".into(),
            team: teams[1].clone(),
            gpus: 1,
            duration_us: 10 * h,
            cost: Micros(122_900_000),
        },
    ];
    let book = PriceBook::from_toml(include_str!("../../../deploy/pricebook.example.toml")).expect("example book");
    assert!(book.is_example(), "the shipped example book is marked");
    let r = WeeklyReport::build(&ReportInput {
        week,
        rows: &rows,
        stranded: &stranded,
        price_book_version: book.version(),
        prices: book.table(),
        generated_at_us: week.end_us(),
        share_unallocated: ShareUnallocated::Weighted,
        previous: None,
        example_prices: book.is_example(),
    })
    .expect("report");
    let dir = tempfile::tempdir().expect("tempdir");
    let html = dir.path().join("report.html");
    let xlsx = dir.path().join("report.xlsx");
    for (format, path) in [(apron::report::ReportFormat::Html, &html), (apron::report::ReportFormat::Xlsx, &xlsx)] {
        let files = apron::report::render(&r, format).expect("render");
        std::fs::write(path, &files[0].1).expect("write");
    }
    let text = std::fs::read_to_string(&html).expect("html");
    assert!(
        text.contains(
            apron_cost::report::EXAMPLE_PRICES_NOTE.split(' ').take(3).collect::<Vec<_>>().join(" ").as_str()
        )
    );

    let o = Command::new("python3")
        .arg("-c")
        .arg(CHECK_PY)
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/ui"))
        .arg(&html)
        .arg(&xlsx)
        .output()
        .expect("python3 runs (scripts/install-test-tools.sh)");
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{stdout}{}", String::from_utf8_lossy(&o.stderr));
    let j: serde_json::Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    assert!(j.get("error").is_none(), "chromium is required (scripts/install-test-tools.sh): {j}");

    assert!(j["control"].as_array().is_some_and(|o| !o.is_empty()), "the probe finds a too-wide table: {j:#}");
    for width in ["800", "1280"] {
        let l = &j["layout"][width];
        assert_eq!(l["overflow"], serde_json::json!([]), "at {width} px something is cut off or scrolls: {l:#}");
        let body: Vec<i64> = serde_json::from_value(l["body"].clone()).expect("body");
        assert!(body[0] <= body[1] && body[2] <= body[3], "at {width} px the body scrolls sideways: {body:?}");
        let w: i64 = width.parse().expect("width");
        for t in l["tables"].as_array().expect("tables") {
            let t: Vec<i64> = serde_json::from_value(t.clone()).expect("table");
            assert!(t[0] <= t[1] && t[2] <= w, "at {width} px a table is cut off: {t:?} ({l:#})");
        }
        assert!(l["text"].as_i64().is_some_and(|n| n > 1000), "{l:#}");
    }

    let x = &j["xlsx"];
    assert_eq!(x["sheets"], serde_json::json!(["summary", "teams", "top_stranded", "prices"]));
    for sheet in ["summary", "teams", "top_stranded", "prices"] {
        let s = &x[sheet];
        assert_eq!((s["freeze"].as_str(), s["header_bold"].as_bool()), (Some("A2"), Some(true)), "{sheet}: {s:#}");
        let widths: Vec<f64> = serde_json::from_value(s["widths"].clone()).unwrap_or_default();
        assert!(!widths.is_empty() && widths.iter().all(|w| *w >= 6.0), "{sheet}: column widths {widths:?}");
    }
    let cell = |sheet: &str, col: &str, i: usize| x[sheet]["cells"][col][i].clone();
    // Money: a number in a currency format; utilisation: a number as a percentage.
    let cost = cell("teams", "cost_usd", 0);
    assert!(cost[0].is_f64() && cost[1] == "n" && cost[2].as_str().is_some_and(|f| f.contains('$')), "{cost}");
    let util = cell("teams", "utilisation", 0);
    assert!(util[0].as_f64() == Some(0.25) && util[2].as_str().is_some_and(|f| f.contains('%')), "{util}");
    let hours = cell("teams", "gpu_hours_allocated", 0);
    assert!(hours[0].as_f64() == Some(100.0) && hours[2] == "#,##0.00", "{hours}");
    // Owners are text, the Slurm job id too.
    let owners = &x["top_stranded"]["cells"]["owner"];
    assert_eq!(owners[0], serde_json::json!(["13860256", "s", "General"]), "{owners}");
    assert_eq!(owners[1][1], "s", "{owners}");
    let price = cell("prices", "usd_per_gpu_hour", 1);
    assert!(price[0].is_f64() && price[2].as_str().is_some_and(|f| f.contains('$')), "{price}");
    let coverage = x["summary"]["cells"]["value"]
        .as_array()
        .expect("values")
        .iter()
        .find(|c| c[2].as_str().is_some_and(|f| f.contains('%')))
        .cloned();
    assert!(coverage.is_some(), "coverage as a percentage: {:#}", x["summary"]);
    let keys = &x["summary"]["cells"]["key"];
    assert!(keys.as_array().expect("keys").iter().any(|k| k[0] == "example_prices_note"), "{keys}");
}
