#!/usr/bin/env python3
"""Load Apron's web UI in headless Chromium and check it.

    python3 tests/ui/chromium_check.py URL OUTDIR EXPECTED_TOTAL

URL is the UI (e.g. http://127.0.0.1:9402/ or http://127.0.0.1:9402/?week=2026-W49 to pin
the report week); EXPECTED_TOTAL is the fleet's idle dollars the weekly report API gives
for the week the page shows (`fleet.idle_cost_usd` of
GET /api/v1/reports/weekly?week=<that week>&format=json), e.g. 1234.5.

It drives Debian's `chromium` (or $CHROMIUM) over the DevTools protocol on a pipe
(--remote-debugging-pipe: Python's standard library only, no websocket package), with
flags fit for CI as root (--headless=new --no-sandbox --disable-gpu
--disable-dev-shm-usage), and checks that:

- the page finishes its first refresh (body[data-state=ready]);
- #idle-dollars-total shows EXPECTED_TOTAL (its text as dollars and its data-value, to
  the cent);
- #kpi-savings (the monthly savings headline) equals the sum of GET
  /api/v1/recommendations' `monthly_savings_usd` over the same default window, within 2 %
  (the two reads are moments apart on live data);
- the heatmap canvas drew cells (canvas#heatmap[data-cells] > 0);
- the SQL box runs `SELECT 1 AS one` into a one-row table;
- at 1280 and at 1920 px wide (WIDTHS), with the recommendations' evidence closed and
  open, nothing scrolls or spills sideways: the document is no wider than the viewport
  (documentElement.scrollWidth <= innerWidth), no table and no scroll container has
  scrollWidth > clientWidth, no table is wider than its container and no element leaves
  the viewport;
- there was no uncaught exception, no console.error, no CSP violation, no failed load of
  a page asset and no request to another origin. An /api/ answer of 4xx/5xx is logged by
  the browser as a network error; the page handles those (it shows a note), so they are
  listed but do not fail the check.

With APRON_UI_TOKEN set (apron serve), the page starts with that API token saved, as if
entered in its token field. With APRON_UI_STALE_SHARDS set (a query server of a cluster
with a collector down), the stale-shards banner must be shown naming exactly those
shards (comma-separated); without it, the banner must be hidden. APRON_UI_HISTORY_ONLY
(data older than the heatmap's 24 hours) accepts a heatmap without cells.

It saves OUTDIR/ui-1280.png and OUTDIR/ui-1920.png (the full page at each width), also on
failure, and prints one line per problem. Exit status: 0 passed, 1 a check failed, 2 could not run
(usage, chromium missing, chromium failed to start).
"""

import base64
import decimal
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse

LOAD_TIMEOUT_S = 90
CDP_TIMEOUT_S = 30
VIEW_H = 1000
# Common desktop widths: the layout check and a screenshot at each; the first is the
# width the page loads at.
WIDTHS = (1280, 1920)
VIEW_W = WIDTHS[0]
# Pixels of horizontal overflow tolerated (sub-pixel rounding).
SLACK_PX = 1
# The savings headline against the API read a moment later (live data moves).
SAVINGS_TOLERANCE = 0.02

# Run in the page: what overflows horizontally. The document wider than the viewport;
# a table or a scroll container (overflow-x auto or scroll) whose content is wider than
# its box; a table wider than its parent's content box; a rendered element whose box
# leaves the viewport at the left or right (the outermost one only, and none inside a
# box that clips or scrolls: that box is checked itself). Each as {what, by} (by: the
# excess in px).
OVERFLOW_JS = r"""
(() => {
  const slack = %d;
  const out = [];
  const vw = window.innerWidth;
  const name = (e) => {
    const parts = [];
    for (let n = e; n && n !== document.body && parts.length < 4; n = n.parentElement) {
      let s = n.tagName.toLowerCase();
      if (n.id) { parts.unshift(s + "#" + n.id); break; }
      if (typeof n.className === "string" && n.className.trim()) s += "." + n.className.trim().split(/\s+/).join(".");
      parts.unshift(s);
    }
    return parts.join(" > ");
  };
  const de = document.documentElement;
  if (de.scrollWidth > vw + slack) out.push({ what: "document (scrollWidth " + de.scrollWidth + " > innerWidth " + vw + ")", by: de.scrollWidth - vw });
  const outside = new Set();
  const clipped = (e) => {
    for (let n = e.parentElement; n && n !== document.body; n = n.parentElement) {
      if (getComputedStyle(n).overflowX !== "visible") return true;
    }
    return false;
  };
  for (const e of document.body.querySelectorAll("*")) {
    const cs = getComputedStyle(e);
    if (cs.display === "none" || cs.visibility === "hidden" || !e.getClientRects().length) continue;
    if (cs.position === "fixed") continue;
    const scroller = cs.overflowX === "auto" || cs.overflowX === "scroll";
    if ((scroller || e.tagName === "TABLE") && e.scrollWidth > e.clientWidth + slack) {
      out.push({ what: name(e) + " scrolls sideways (scrollWidth " + e.scrollWidth + " > clientWidth " + e.clientWidth + ")", by: e.scrollWidth - e.clientWidth });
    }
    if (e.tagName === "TABLE" && e.parentElement) {
      const p = e.parentElement, ps = getComputedStyle(p);
      const inner = p.clientWidth - parseFloat(ps.paddingLeft) - parseFloat(ps.paddingRight);
      const w = e.getBoundingClientRect().width;
      if (w > inner + slack) out.push({ what: name(e) + " is wider than its container (" + Math.ceil(w) + " > " + Math.floor(inner) + ")", by: Math.ceil(w - inner) });
    }
    const r = e.getBoundingClientRect();
    if (r.width > 0 && (r.right > vw + slack || r.left < -slack)) {
      outside.add(e);
      if (outside.has(e.parentElement) || clipped(e)) continue;
      out.push({ what: name(e) + " leaves the viewport (" + Math.round(r.left) + ".." + Math.round(r.right) + " of " + vw + ")", by: Math.ceil(Math.max(r.right - vw, -r.left)) });
    }
  }
  return out;
})()
""" % SLACK_PX


def die(code, msg):
    print("chromium_check: " + msg, file=sys.stderr)
    sys.exit(code)


def find_chromium():
    env = os.environ.get("CHROMIUM")
    if env:
        return env if shutil.which(env) or os.path.isfile(env) else None
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        p = shutil.which(name)
        if p:
            return p
    return "/usr/lib/chromium/chromium" if os.path.isfile("/usr/lib/chromium/chromium") else None


class Browser:
    """Chromium with the DevTools protocol on fds 3 (commands in) and 4 (messages out)."""

    def __init__(self, exe, profile):
        cmd_r, self._cmd_w = os.pipe()
        self._msg_r, msg_w = os.pipe()
        flags = [
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--remote-debugging-pipe",
            "--user-data-dir=" + profile,
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-features=Translate,MediaRouter,OptimizationHints",
            "--mute-audio",
            "--hide-scrollbars",
            "--window-size=%d,%d" % (VIEW_W, VIEW_H),
            "about:blank",
        ]
        # The shell puts the pipe ends on fds 3 and 4, where Chromium expects them.
        script = 'exec "$0" "$@" 3<&%d 4>&%d' % (cmd_r, msg_w)
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            ["sh", "-c", script, exe] + flags,
            pass_fds=(cmd_r, msg_w),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=self._log,
        )
        os.close(cmd_r)
        os.close(msg_w)
        self._next_id = 0
        self._lock = threading.Condition()
        self._replies = {}
        self.events = []
        self._closed = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        buf = b""
        while True:
            try:
                chunk = os.read(self._msg_r, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                with self._lock:
                    self._closed = True
                    self._lock.notify_all()
                return
            buf += chunk
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                try:
                    msg = json.loads(raw)
                except ValueError:
                    continue
                with self._lock:
                    if "id" in msg:
                        self._replies[msg["id"]] = msg
                    else:
                        self.events.append(msg)
                    self._lock.notify_all()

    def send(self, method, params=None, session=None, timeout=CDP_TIMEOUT_S):
        with self._lock:
            self._next_id += 1
            mid = self._next_id
        msg = {"id": mid, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        try:
            os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        except OSError as e:
            raise RuntimeError("chromium is gone (%s)" % e)
        deadline = time.monotonic() + timeout
        with self._lock:
            while mid not in self._replies:
                left = deadline - time.monotonic()
                if self._closed:
                    raise RuntimeError("chromium closed the DevTools pipe (it exited?)")
                if left <= 0:
                    raise RuntimeError("no answer to %s within %d s" % (method, timeout))
                self._lock.wait(left)
            reply = self._replies.pop(mid)
        if "error" in reply:
            raise RuntimeError("%s: %s" % (method, reply["error"].get("message")))
        return reply.get("result", {})

    def log_tail(self):
        self._log.seek(0)
        return self._log.read().decode("utf-8", "replace")[-3000:]

    def close(self):
        try:
            self.send("Browser.close", timeout=5)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._cmd_w)


def layout_check(cdp, js, width, loaded, outdir, failures):
    """At WIDTH px: the overflow check (when the page loaded), then OUTDIR/ui-WIDTH.png of
    the whole page."""
    cdp("Emulation.setDeviceMetricsOverride", {"width": width, "height": VIEW_H, "deviceScaleFactor": 1, "mobile": False})
    if loaded:
        time.sleep(0.6)  # the page redraws its canvas and chart on resize (150 ms debounce)
        found = [(o, "") for o in js(OVERFLOW_JS) or []]
        # Again with every <details> (a recommendation's evidence) open, as a reader has it.
        opened = js("Array.from(document.querySelectorAll('details:not([open])')).map((d) => (d.open = true, d)).length")
        if opened:
            time.sleep(0.2)
            found += [(o, " (%d <details> open)" % opened) for o in js(OVERFLOW_JS) or []]
            js("document.querySelectorAll('details[open]').forEach((d) => (d.open = false)), true")
        if found:
            for o, how in found:
                failures.append("at %d px%s: %s: %d px too wide" % (width, how, o["what"], o["by"]))
        else:
            print("layout at %d px: nothing overflows sideways" % width + (" (also with %d <details> open)" % opened if opened else ""))
        h = js("Math.ceil(document.documentElement.scrollHeight)") or VIEW_H
        cdp("Emulation.setDeviceMetricsOverride", {"width": width, "height": min(max(h, VIEW_H), 8000), "deviceScaleFactor": 1, "mobile": False})
        time.sleep(0.6)
    shot = cdp("Page.captureScreenshot", {"format": "png"}, timeout=60)
    path = os.path.join(outdir, "ui-%d.png" % width)
    with open(path, "wb") as f:
        f.write(base64.b64decode(shot["data"]))
    print("screenshot: " + path)


def main():
    if len(sys.argv) != 4:
        die(2, "usage: chromium_check.py URL OUTDIR EXPECTED_TOTAL")
    url, outdir, expected_arg = sys.argv[1], sys.argv[2], sys.argv[3]
    try:
        expected = decimal.Decimal(expected_arg.replace("$", "").replace(",", "")).quantize(decimal.Decimal("0.01"))
    except decimal.InvalidOperation:
        die(2, "EXPECTED_TOTAL %r is not a number" % expected_arg)
    exe = find_chromium()
    if not exe:
        die(2, "chromium is not installed (apt-get install -y chromium, or set CHROMIUM=/path/to/chrome)")
    os.makedirs(outdir, exist_ok=True)
    origin = urllib.parse.urlsplit(url)
    origin = (origin.scheme, origin.netloc)

    profile = tempfile.mkdtemp(prefix="apron-ui-chromium-")
    browser = None
    failures = []
    try:
        browser = Browser(exe, profile)
        try:
            target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
            session = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        except RuntimeError as e:
            die(2, "cannot start chromium (%s): %s\n%s" % (exe, e, browser.log_tail()))

        def cdp(method, params=None, timeout=CDP_TIMEOUT_S):
            return browser.send(method, params, session, timeout)

        def js(expr, timeout=CDP_TIMEOUT_S):
            r = cdp("Runtime.evaluate", {"expression": expr, "returnByValue": True, "awaitPromise": True}, timeout)
            if "exceptionDetails" in r:
                raise RuntimeError("evaluating %s: %s" % (expr, r["exceptionDetails"].get("text")))
            return r.get("result", {}).get("value")

        def wait_for(expr, timeout, what):
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if js(expr):
                    return True
                time.sleep(0.25)
            failures.append("timed out after %d s waiting for %s" % (timeout, what))
            return False

        for domain in ("Runtime", "Log", "Network", "Page"):
            cdp(domain + ".enable")
        cdp("Emulation.setDeviceMetricsOverride", {"width": VIEW_W, "height": VIEW_H, "deviceScaleFactor": 1, "mobile": False})
        token = os.environ.get("APRON_UI_TOKEN")
        if token:
            # As if the user had saved it in the token field (apron serve).
            cdp("Page.addScriptToEvaluateOnNewDocument", {"source": "localStorage.setItem('apron.token', %s);" % json.dumps(token)})
        nav = cdp("Page.navigate", {"url": url})
        if nav.get("errorText"):
            die(2, "cannot load %s: %s" % (url, nav["errorText"]))

        loaded = wait_for(
            "document.body && document.body.dataset.state === 'ready'", LOAD_TIMEOUT_S, "the page's first refresh (body[data-state=ready])"
        )
        if loaded:
            stale_want = os.environ.get("APRON_UI_STALE_SHARDS", "")
            stale = js(
                "(() => { const b = document.getElementById('stale-banner');"
                " return b ? {hidden: b.hidden, text: document.getElementById('stale-banner-detail').textContent} : null; })()"
            )
            want_names = ", ".join(n for n in stale_want.split(",") if n)
            if not stale:
                failures.append("#stale-banner is missing")
            elif stale_want and (stale["hidden"] or stale["text"] != want_names):
                failures.append("the stale-shards banner shows %r (hidden: %s), expected %r" % (stale["text"], stale["hidden"], want_names))
            elif not stale_want and not stale["hidden"]:
                failures.append("the stale-shards banner is shown (%r) with every shard current" % stale["text"])
            else:
                print("stale-shards banner: %s" % (want_names or "hidden"))
            total = js(
                "(() => { const e = document.getElementById('idle-dollars-total');"
                " return e ? {text: e.textContent, value: e.dataset.value || '', week: e.dataset.week || ''} : null; })()"
            )
            if not total:
                failures.append("#idle-dollars-total is missing")
            else:
                shown_text = total["text"].strip()
                try:
                    text_val = decimal.Decimal(shown_text.replace("$", "").replace(",", "").replace("\u2212", "-"))
                except decimal.InvalidOperation:
                    text_val = None
                try:
                    data_val = decimal.Decimal(total["value"])
                except decimal.InvalidOperation:
                    data_val = None
                if text_val is None or text_val.quantize(decimal.Decimal("0.01")) != expected:
                    failures.append(
                        "#idle-dollars-total shows %r for week %s, expected %s" % (shown_text, total["week"] or "?", expected)
                    )
                elif data_val is None or data_val.quantize(decimal.Decimal("0.01")) != expected:
                    failures.append("#idle-dollars-total data-value is %r, expected %s" % (total["value"], expected))
                else:
                    print("idle dollars total: %s (week %s) = expected %s" % (shown_text, total["week"], expected))

            # The savings headline is the API's sum over the same (default) window: the
            # page's figure against a fresh GET of the same endpoint (the fleet moves on
            # between the two reads, so within SAVINGS_TOLERANCE).
            savings = js(
                "(async () => { const e = document.getElementById('kpi-savings');"
                " const h = new Headers(); const t = localStorage.getItem('apron.token');"
                " if (t) h.set('Authorization', 'Bearer ' + t);"
                " const r = await (await fetch('/api/v1/recommendations', {headers: h})).json();"
                " const sum = Object.values(r.monthly_savings_usd || {}).reduce((a, v) => a + Number(v), 0);"
                " return {shown: e ? e.dataset.value || '' : null, text: e ? e.textContent : '', api: sum, window: r.window}; })()"
            )
            try:
                shown = float(savings["shown"])
            except (TypeError, ValueError, KeyError):
                shown = None
            if shown is None:
                failures.append("#kpi-savings has no data-value: %r" % savings)
            elif abs(shown - savings["api"]) > SAVINGS_TOLERANCE * max(abs(savings["api"]), 1.0):
                failures.append(
                    "the savings headline %s (%s) differs from the API's sum %.2f over %s"
                    % (savings["text"], shown, savings["api"], savings["window"])
                )
            else:
                print("savings headline: %s = the API's %.2f over %s" % (savings["text"].strip(), savings["api"], savings["window"]))

            cells = js("Number((document.getElementById('heatmap') || {dataset: {}}).dataset.cells || 0)")
            gpus = js("Number((document.getElementById('heatmap') || {dataset: {}}).dataset.gpus || 0)")
            if os.environ.get("APRON_UI_HISTORY_ONLY") and not cells:
                # The heatmap shows the last 24 hours; a trace of past weeks has none.
                print("heatmap: no cells (APRON_UI_HISTORY_ONLY: the data is older than 24 h)")
            elif not cells:
                failures.append("the heatmap drew no cells (canvas#heatmap data-cells=%r)" % cells)
            else:
                print("heatmap: %d cells for %d GPUs" % (cells, gpus))

            js(
                "(() => { document.getElementById('sql-input').value = 'SELECT 1 AS one';"
                " document.getElementById('sql-run').click(); return true; })()"
            )
            done = "document.getElementById('sql-table').dataset.rows === '1' || !document.getElementById('sql-error').hidden"
            if wait_for(done, 30, "the SQL box's result (SELECT 1 AS one)"):
                if js("document.getElementById('sql-table').dataset.rows") == "1":
                    print("sql box: 1 row")
                else:
                    failures.append("the SQL box answered: %r" % js("document.getElementById('sql-error').textContent"))

        # At each width: nothing wider than the viewport, no table or scroll container
        # that scrolls sideways; then a screenshot of the whole page.
        for width in WIDTHS:
            try:
                layout_check(cdp, js, width, loaded, outdir, failures)
            except RuntimeError as e:
                failures.append("at %d px: %s" % (width, e))

        # What the browser reported while all that ran.
        with browser._lock:
            events = list(browser.events)
        tolerated = []
        req_urls = {}
        for ev in events:
            m, p = ev.get("method"), ev.get("params", {})
            if m == "Runtime.exceptionThrown":
                d = p.get("exceptionDetails", {})
                desc = (d.get("exception") or {}).get("description") or d.get("text")
                failures.append("uncaught exception: %s (%s:%s)" % (desc, d.get("url", ""), d.get("lineNumber", "")))
            elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                args = " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", []))
                failures.append("console.%s: %s" % (p.get("type"), args))
            elif m == "Log.entryAdded":
                e = p.get("entry", {})
                if e.get("level") != "error":
                    continue
                u = e.get("url") or ""
                if e.get("source") == "network" and urllib.parse.urlsplit(u).path.startswith("/api/"):
                    tolerated.append("%s (%s)" % (e.get("text"), u))
                else:
                    failures.append("browser error [%s]: %s %s" % (e.get("source"), e.get("text"), u))
            elif m == "Network.requestWillBeSent":
                u = p.get("request", {}).get("url", "")
                req_urls[p.get("requestId")] = u
                s = urllib.parse.urlsplit(u)
                if s.scheme in ("http", "https", "ws", "wss") and (s.scheme, s.netloc) != origin:
                    failures.append("request to another origin: " + u)
            elif m == "Network.responseReceived":
                r = p.get("response", {})
                u = r.get("url", "")
                if r.get("status", 0) >= 400 and not urllib.parse.urlsplit(u).path.startswith("/api/"):
                    failures.append("HTTP %s for %s" % (r.get("status"), u))
            elif m == "Network.loadingFailed":
                u = req_urls.get(p.get("requestId"), "?")
                if not p.get("canceled") and not urllib.parse.urlsplit(u).path.startswith("/api/"):
                    failures.append("loading failed: %s (%s)" % (u, p.get("errorText")))
        for t in tolerated:
            print("note: API error handled by the page: " + t)
        if any("status of 401" in t for t in tolerated):
            failures.append("the API answered 401 Unauthorized: under apron serve, set APRON_UI_TOKEN to a SQL token")
    except RuntimeError as e:
        failures.append("devtools: %s" % e)
        if browser:
            failures.append("chromium output:\n" + browser.log_tail())
    finally:
        if browser:
            browser.close()
        shutil.rmtree(profile, ignore_errors=True)

    if failures:
        for f in failures:
            print("FAIL: " + f, file=sys.stderr)
        sys.exit(1)
    print("ok: the web UI at %s passed" % url)


if __name__ == "__main__":
    main()
