// Apron web UI: one page over the server's own API, no build step, no external requests.
//
//   POST /api/v1/sql (gpu_cost_hourly) ─► fleet heatmap (canvas), utilisation chart (uPlot), KPIs
//   GET  /api/v1/reports/weekly?week=…&format=json ─► idle dollars by team (#idle-dollars-total)
//   GET  /api/v1/alerts ─► firing alerts (stranded allocations first)
//   GET  /api/v1/recommendations?window=… ─► recommendations by monthly savings
//   SQL box ─► POST /api/v1/sql, result table or the {"error","detail"} answer
//
// Everything refreshes every 30 s. Works under Content-Security-Policy: default-src 'self':
// no inline script or style, no markup built from strings (DOM nodes and text only),
// styles set through the CSSOM. An API failure is shown in its panel; an unexpected
// exception is shown there too and logged with console.error (the browser test fails on it).
// Page parameters: ?week=2026-W48 pins the report week, ?refresh=0 turns auto-refresh off.
(function () {
  "use strict";

  const REFRESH_MS = 30000;
  const TOKEN_KEY = "apron.token";
  const AUTO_KEY = "apron.autoRefresh";
  const HOURS = 24;

  // Order = tie-break order for the dominant state. Colours match app.css.
  const STATES = [
    { key: "active", label: "Active", color: "#2e9d5b" },
    { key: "allocated_idle", label: "Allocated idle", color: "#f0b429" },
    { key: "stranded", label: "Stranded", color: "#d64545" },
    { key: "unallocated_idle", label: "Unallocated idle", color: "#9fb3c8" },
    { key: "unallocated_busy", label: "Unallocated busy", color: "#7c5cc4" },
    { key: "unknown", label: "Unknown", color: "#d5d9e0" },
  ];
  const NO_DATA_COLOR = "#ffffff";
  const IDLE_STATES = ["allocated_idle", "stranded", "unallocated_idle"];

  const params = new URLSearchParams(window.location.search);
  const $ = (id) => document.getElementById(id);

  // ───────────────────────────── formatting ─────────────────────────────

  const usdFmt = new Intl.NumberFormat("en-US", { style: "currency", currency: "USD" });
  const usd0Fmt = new Intl.NumberFormat("en-US", { style: "currency", currency: "USD", maximumFractionDigits: 0 });
  const intFmt = new Intl.NumberFormat("en-US");

  /** Money or a count from the API: a JSON number or a decimal string. NaN when neither. */
  function num(v) {
    if (typeof v === "number") return v;
    if (typeof v === "string" && v.trim() !== "") return Number(v);
    return NaN;
  }
  function fmtUSD(v) {
    const n = num(v);
    return Number.isFinite(n) ? usdFmt.format(n) : v == null ? "—" : String(v);
  }
  function fmtUSDShort(v) {
    const n = num(v);
    if (!Number.isFinite(n)) return "—";
    return Math.abs(n) >= 10000 ? usd0Fmt.format(n) : usdFmt.format(n);
  }
  function fmtPct(f, digits) {
    return Number.isFinite(f) ? (f * 100).toFixed(digits == null ? 1 : digits) + "%" : "—";
  }
  function fmtDuration(seconds) {
    const s = num(seconds);
    if (!Number.isFinite(s)) return "—";
    if (s < 60) return Math.round(s) + " s";
    const m = Math.floor(s / 60);
    if (m < 60) return m + " min";
    const h = Math.floor(m / 60);
    if (h < 48) return h + " h " + String(m % 60).padStart(2, "0") + " min";
    return Math.floor(h / 24) + " d " + (h % 24) + " h";
  }
  function fmtAgo(iso) {
    const t = Date.parse(iso);
    if (!Number.isFinite(t)) return iso == null ? "—" : String(iso);
    return fmtDuration(Math.max(0, (Date.now() - t) / 1000)) + " ago";
  }
  function hhmm(ms) {
    const d = new Date(ms);
    return String(d.getUTCHours()).padStart(2, "0") + ":00";
  }
  function dayLabel(ms) {
    const d = new Date(ms);
    return d.toLocaleDateString("en-US", { timeZone: "UTC", month: "short", day: "numeric" });
  }
  function shortModel(m) {
    return (m || "").replace(/^NVIDIA\s+/i, "");
  }

  // ───────────────────────────── DOM helpers ─────────────────────────────

  /** el("td", {className: "num"}, "text", childNode, …) — text only, never HTML. */
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    if (attrs) {
      for (const [k, v] of Object.entries(attrs)) {
        if (v == null) continue;
        if (k === "className") node.className = v;
        else if (k === "dataset") Object.assign(node.dataset, v);
        else node.setAttribute(k, v);
      }
    }
    for (const c of children) {
      if (c == null) continue;
      node.append(c instanceof Node ? c : String(c));
    }
    return node;
  }
  /** An owner cell's name: a comma-separated list (several pods) one per line, each
   *  free to break after a "/" (namespace/pod) before it breaks anywhere. */
  function ownerName(owner) {
    const names = String(owner || "").split(",").map((n) => n.trim()).filter(Boolean);
    if (!names.length) return "—";
    const line = (n) => el("div", { className: "owner-line" }, ...n.split(/(?<=\/)/).flatMap((p, i) => (i ? [el("wbr"), p] : [p])));
    return names.length === 1 ? line(names[0]) : el("div", null, ...names.map(line));
  }
  /** A short identifier (team, host, GPU model, cluster) on one line, cut with an
   *  ellipsis past 16em (the whole name in its tooltip). */
  function ident(text, cls) {
    if (text == null || text === "") return null;
    return el("div", { className: "ident" + (cls ? " " + cls : ""), title: String(text) }, String(text));
  }
  function emptyRow(tbody, cols, text) {
    tbody.replaceChildren(el("tr", null, el("td", { className: "empty", colspan: String(cols) }, text)));
  }
  function showNote(id, text, kind) {
    const n = $(id);
    if (!text) {
      n.hidden = true;
      n.textContent = "";
      return;
    }
    n.className = "note" + (kind ? " note-" + kind : "");
    n.textContent = text;
    n.hidden = false;
  }

  // ───────────────────────────── API ─────────────────────────────

  class ApiError extends Error {
    constructor(status, code, detail) {
      super(code + (detail ? ": " + detail : ""));
      this.status = status;
      this.code = code;
      this.detail = detail;
    }
  }

  function getToken() {
    try {
      return window.localStorage.getItem(TOKEN_KEY) || "";
    } catch (_) {
      return "";
    }
  }
  function setToken(t) {
    try {
      if (t) window.localStorage.setItem(TOKEN_KEY, t);
      else window.localStorage.removeItem(TOKEN_KEY);
    } catch (_) {
      /* storage unavailable: the token lives for this page only */
    }
    memoryToken = t;
  }
  let memoryToken = getToken();

  let unauthorizedThisRound = false;

  async function api(path, opts) {
    const o = opts || {};
    const headers = { Accept: "application/json" };
    if (memoryToken) headers.Authorization = "Bearer " + memoryToken;
    if (o.body != null) headers["Content-Type"] = "text/plain; charset=utf-8";
    let resp;
    try {
      resp = await fetch(path, { method: o.method || "GET", headers, body: o.body, cache: "no-store", credentials: "same-origin" });
    } catch (e) {
      throw new ApiError(0, "unreachable", "cannot reach the server (" + (e && e.message ? e.message : e) + ")");
    }
    const text = await resp.text();
    let json = null;
    try {
      json = text ? JSON.parse(text) : null;
    } catch (_) {
      json = null;
    }
    if (resp.status === 401) {
      unauthorizedThisRound = true;
      showUnauthorized(json && json.detail);
    }
    if (!resp.ok) {
      const code = json && json.error ? json.error : "HTTP " + resp.status;
      const detail = json && json.detail ? json.detail : text.slice(0, 300) || resp.statusText;
      throw new ApiError(resp.status, code, detail);
    }
    if (json === null) throw new ApiError(resp.status, "bad_response", "the server did not answer JSON");
    return json;
  }

  /** POST /api/v1/sql → {columns, rows, objects()} */
  async function sql(text) {
    const r = await api("/api/v1/sql", { method: "POST", body: text });
    if (!r || !Array.isArray(r.columns) || !Array.isArray(r.rows)) {
      throw new ApiError(200, "bad_response", "the SQL answer has no columns/rows");
    }
    // A query server of a cluster names the shards whose collectors are not current.
    showStale(Array.isArray(r.stale_shards) ? r.stale_shards : []);
    const names = r.columns.map((c) => c.name);
    r.objects = () =>
      r.rows.map((row) => {
        const o = {};
        names.forEach((n, i) => (o[n] = row[i]));
        return o;
      });
    return r;
  }

  function showStale(shards) {
    $("stale-banner").hidden = shards.length === 0;
    $("stale-banner-detail").textContent = shards.join(", ");
  }

  function showUnauthorized(detail) {
    $("auth-banner").hidden = false;
    $("auth-banner-detail").textContent =
      (detail ? detail + ". " : "") +
      (memoryToken
        ? "The saved API token was refused: enter a valid SQL token above."
        : "This server needs an API token (apron serve): enter a SQL token above.");
    $("token-input").classList.add("invalid");
  }
  function clearUnauthorized() {
    $("auth-banner").hidden = true;
    $("token-input").classList.remove("invalid");
  }

  /** What a panel shows for a failed request. */
  function describeError(e, what) {
    if (e instanceof ApiError) {
      if (e.status === 401) return what + ": 401 Unauthorized — set an API token (top right).";
      if (e.status === 404) return what + " is not available on this server yet (404).";
      if (e.status === 503 && /_disabled$/.test(e.code)) return what + ": " + (e.detail || "turned off on this server") + ".";
      if (e.status === 0) return what + ": " + e.detail;
      return what + " failed (" + e.status + " " + e.code + "): " + (e.detail || "");
    }
    // A bug in this page: make it loud for the browser test.
    console.error("apron ui:", what, e);
    return what + " failed: " + (e && e.message ? e.message : String(e));
  }

  /** A server without that part (404) or with it turned off (503 …_disabled): a note, not an error. */
  function isUnavailable(e) {
    return e instanceof ApiError && (e.status === 404 || (e.status === 503 && /_disabled$/.test(e.code)));
  }

  // ───────────────────────────── hourly data (heatmap, chart, KPIs) ─────────────────────────────

  /** The hour the views end at: the server's current hour, or, when the newest priced
   *  hour is older than two hours (history brought in by `apron import`, a fleet whose
   *  agents stopped), that hour — so the views open on the data rather than on empty
   *  hours. */
  const ANCHOR_HOUR = `(SELECT CASE WHEN max("hour") < date_trunc('hour', now()) - INTERVAL '2 hours'
      THEN max("hour") ELSE date_trunc('hour', now()) END FROM gpu_cost_hourly)`;

  /** Per (hour, GPU) seconds for the 24 h ending at ANCHOR_HOUR (the current hour included). */
  async function loadHourly() {
    // "cluster" is quoted: the SQL parser rejects an unquoted `cluster` after a comma in a
    // select list (a keyword there); "hour" for symmetry.
    const r = await sql(`
      SELECT ${ANCHOR_HOUR} AS now_hour, "hour", "cluster", host, gpu_uuid, max(gpu_model) AS gpu_model,
        sum(active_s) AS active, sum(allocated_idle_s) AS allocated_idle, sum(stranded_s) AS stranded,
        sum(unallocated_idle_s) AS unallocated_idle, sum(unallocated_busy_s) AS unallocated_busy, sum(unknown_s) AS unknown,
        sum(idle_cost_usd) AS idle_usd, sum(cost_usd) AS cost_usd, string_agg(team, ', ') AS teams
      FROM gpu_cost_hourly
      WHERE "hour" >= ${ANCHOR_HOUR} - INTERVAL '${HOURS - 1} hours' AND "hour" <= ${ANCHOR_HOUR}
      GROUP BY "hour", "cluster", host, gpu_uuid
      ORDER BY host, gpu_uuid, "hour"`);
    const rows = r.objects();
    const current = Math.floor(Date.now() / 3600e3) * 3600e3;
    let nowHour = rows.length ? Date.parse(rows[0].now_hour) : NaN;
    if (!Number.isFinite(nowHour)) nowHour = current;
    return { nowHour, rows, historical: nowHour < current - 2 * 3600e3 };
  }

  const gpuIndex = new Map(); // gpu_uuid → index (or null when unknown)

  /** GPU indexes are not in gpu_cost_hourly: recent raw samples, then the minute rollup. */
  async function loadGpuIndexes(uuids) {
    const missing = uuids.filter((u) => !gpuIndex.has(u));
    if (!missing.length) return;
    const list = missing.map((u) => "'" + u.replace(/'/g, "''") + "'").join(", ");
    const fill = (r) => {
      for (const o of r.objects()) if (o.gpu_index != null) gpuIndex.set(o.gpu_uuid, o.gpu_index);
    };
    fill(
      await sql(
        "SELECT gpu_uuid, max(gpu_index) AS gpu_index FROM gpu_samples WHERE time > now() - INTERVAL '10 minutes' " +
          "AND gpu_uuid IN (" + list + ") GROUP BY gpu_uuid"
      )
    );
    const still = missing.filter((u) => !gpuIndex.has(u));
    if (still.length) {
      const l2 = still.map((u) => "'" + u.replace(/'/g, "''") + "'").join(", ");
      fill(
        await sql(
          "SELECT gpu_uuid, max(gpu_index) AS gpu_index FROM gpu_samples_1m WHERE time > now() - INTERVAL '25 hours' " +
            "AND gpu_uuid IN (" + l2 + ") GROUP BY gpu_uuid"
        )
      );
    }
    for (const u of missing) if (!gpuIndex.has(u)) gpuIndex.set(u, null);
  }

  // ───────────────────────────── heatmap ─────────────────────────────

  let heat = null; // {hours: [ms], gpus: [{label…, cells: [cell|null]}], geometry}

  function buildHeat(data) {
    const start = data.nowHour - (HOURS - 1) * 3600e3;
    const hours = [];
    for (let i = 0; i < HOURS; i++) hours.push(start + i * 3600e3);
    const clusters = new Set(data.rows.map((r) => r.cluster || ""));
    const byGpu = new Map();
    for (const r of data.rows) {
      let g = byGpu.get(r.gpu_uuid);
      if (!g) {
        g = { uuid: r.gpu_uuid, host: r.host || "?", cluster: r.cluster || "", model: r.gpu_model || "", cells: new Array(HOURS).fill(null) };
        byGpu.set(r.gpu_uuid, g);
      }
      const col = Math.round((Date.parse(r.hour) - start) / 3600e3);
      if (col < 0 || col >= HOURS) continue;
      const secs = {};
      let total = 0;
      let dom = null;
      // The hour in progress counts its not-yet-measured rest as unknown: there, the
      // dominant state is that of the measured part.
      const inProgress = hours[col] === data.nowHour;
      for (const s of STATES) {
        const v = num(r[s.key]) || 0;
        secs[s.key] = v;
        total += v;
        if (inProgress && s.key === "unknown") continue;
        if (v > 0 && (dom === null || v > secs[dom])) dom = s.key;
      }
      g.cells[col] = { hour: hours[col], secs, total, inProgress, dom: dom || "unknown", idleUsd: r.idle_usd, costUsd: r.cost_usd, teams: r.teams || "" };
      if (r.gpu_model) g.model = r.gpu_model;
    }
    let gpus = [...byGpu.values()];
    for (const g of gpus) {
      g.index = gpuIndex.has(g.uuid) ? gpuIndex.get(g.uuid) : null;
      g.hostLabel = clusters.size > 1 && g.cluster ? g.cluster + "/" + g.host : g.host;
    }
    gpus.sort(
      (a, b) =>
        a.hostLabel.localeCompare(b.hostLabel) ||
        (a.index == null ? 1e9 : a.index) - (b.index == null ? 1e9 : b.index) ||
        a.uuid.localeCompare(b.uuid)
    );
    const total = gpus.length;
    if (gpus.length > MAX_HEAT_GPUS) gpus = gpus.slice(0, MAX_HEAT_GPUS);
    return { hours, gpus, total, nowHour: data.nowHour };
  }

  function renderLegend() {
    const legend = $("heatmap-legend");
    const items = STATES.map((s) => el("span", { className: "legend-item" }, el("span", { className: "swatch swatch-" + s.key }), s.label));
    items.push(el("span", { className: "legend-item" }, el("span", { className: "swatch swatch-none" }), "No data"));
    legend.replaceChildren(...items);
  }

  const MAX_HEAT_GPUS = 1500; // rows on the canvas; more are counted, not drawn
  const HM = { cellH: 18, gap: 2, headerH: 36, pad: 8, font: "12px system-ui, -apple-system, 'Segoe UI', Roboto, Arial, sans-serif" };

  function drawHeatmap() {
    const canvas = $("heatmap");
    if (!heat) return;
    const wrap = $("heatmap-wrap");
    const ctx = canvas.getContext("2d");
    ctx.font = HM.font;
    let hostW = 0;
    let gpuW = 0;
    for (const g of heat.gpus) {
      hostW = Math.max(hostW, ctx.measureText(g.hostLabel).width);
      gpuW = Math.max(gpuW, ctx.measureText(gpuLabel(g)).width);
    }
    hostW = Math.ceil(hostW) + 14;
    gpuW = Math.ceil(gpuW) + 14;
    const labelW = HM.pad + hostW + gpuW;
    const avail = Math.max(wrap.clientWidth - 2, 400);
    const cellW = Math.max(14, Math.min(64, Math.floor((avail - labelW - HM.pad) / HOURS)));
    const width = labelW + cellW * HOURS + HM.pad;
    const rows = Math.max(heat.gpus.length, 1);
    const height = HM.headerH + rows * HM.cellH + HM.pad;
    // Browsers cap a canvas near 32k device pixels a side.
    const dpr = Math.min(window.devicePixelRatio || 1, 30000 / height, 30000 / width);
    canvas.width = Math.round(width * dpr);
    canvas.height = Math.round(height * dpr);
    canvas.style.width = width + "px";
    canvas.style.height = height + "px";
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, height);
    ctx.font = HM.font;
    ctx.textBaseline = "middle";

    // Column headers: the day where it changes, the hour every few columns.
    const every = cellW >= 36 ? 1 : cellW >= 22 ? 2 : 3;
    heat.hours.forEach((h, i) => {
      const x = labelW + i * cellW;
      const d = new Date(h);
      if (i === 0 || d.getUTCHours() === 0) {
        ctx.fillStyle = "#1c2430";
        ctx.fillText(dayLabel(h), x, 10);
        if (i > 0) {
          ctx.fillStyle = "#c5ccd6";
          ctx.fillRect(x - 1, 2, 1, height - 4);
        }
      }
      if ((HOURS - 1 - i) % every === 0) {
        ctx.fillStyle = h === heat.nowHour ? "#1f5fbf" : "#6b7685";
        ctx.fillText(h === heat.nowHour && every > 1 ? "now" : hhmm(h), x, 26);
      }
    });

    // Rows.
    let cells = 0;
    let prevHost = null;
    heat.gpus.forEach((g, r) => {
      const y = HM.headerH + r * HM.cellH;
      if (g.hostLabel !== prevHost) {
        if (prevHost !== null) {
          ctx.fillStyle = "#c5ccd6";
          ctx.fillRect(HM.pad, y - 1, width - 2 * HM.pad, 1);
        }
        ctx.fillStyle = "#1c2430";
        ctx.font = "600 " + HM.font;
        ctx.fillText(g.hostLabel, HM.pad, y + HM.cellH / 2);
        ctx.font = HM.font;
        prevHost = g.hostLabel;
      }
      ctx.fillStyle = "#4a5568";
      ctx.fillText(gpuLabel(g), HM.pad + hostW, y + HM.cellH / 2);
      g.cells.forEach((c, i) => {
        const x = labelW + i * cellW;
        const w = cellW - HM.gap;
        const hgt = HM.cellH - HM.gap;
        if (c) {
          ctx.fillStyle = STATES.find((s) => s.key === c.dom).color;
          ctx.fillRect(x, y + 1, w, hgt);
          cells++;
        } else {
          ctx.fillStyle = NO_DATA_COLOR;
          ctx.fillRect(x, y + 1, w, hgt);
          ctx.strokeStyle = "#dde2e8";
          ctx.setLineDash([2, 2]);
          ctx.strokeRect(x + 0.5, y + 1.5, w - 1, hgt - 1);
          ctx.setLineDash([]);
        }
      });
    });
    if (!heat.gpus.length) {
      ctx.fillStyle = "#6b7685";
      ctx.fillText("No GPU-hours in the last 24 h.", labelW, HM.headerH + HM.cellH / 2);
    }
    canvas.dataset.cells = String(cells);
    canvas.dataset.gpus = String(heat.gpus.length);
    heat.geometry = { labelW, cellW, width, height };
  }

  function gpuLabel(g) {
    return (g.index == null ? "GPU ?" : "GPU " + g.index) + "  " + shortModel(g.model);
  }

  function heatTooltip(ev) {
    const tip = $("heatmap-tip");
    if (!heat || !heat.geometry) return;
    const rect = $("heatmap").getBoundingClientRect();
    const x = ev.clientX - rect.left;
    const y = ev.clientY - rect.top;
    const { labelW, cellW } = heat.geometry;
    const col = Math.floor((x - labelW) / cellW);
    const row = Math.floor((y - HM.headerH) / HM.cellH);
    const g = heat.gpus[row];
    if (!g || col < 0 || col >= HOURS) {
      tip.hidden = true;
      return;
    }
    const c = g.cells[col];
    const h = heat.hours[col];
    const title = g.hostLabel + " · " + (g.index == null ? "GPU ?" : "GPU " + g.index) + " · " + shortModel(g.model);
    const when = dayLabel(h) + " " + hhmm(h) + "–" + hhmm(h + 3600e3) + " UTC" + (h === heat.nowHour ? " (in progress)" : "");
    const body = [el("div", { className: "tip-title" }, title), el("div", { className: "tip-sub" }, when + " · " + g.uuid)];
    if (!c) {
      body.push(el("div", null, "No data for this hour."));
    } else {
      const tbody = el("tbody");
      for (const s of STATES) {
        const v = c.secs[s.key];
        if (!v) continue;
        tbody.append(
          el(
            "tr",
            { className: s.key === c.dom ? "dom" : null },
            el("td", null, el("span", { className: "swatch swatch-" + s.key }), " ", s.label),
            el("td", { className: "num" }, fmtDuration(v)),
            el("td", { className: "num" }, fmtPct(c.total ? v / c.total : NaN, 0))
          )
        );
      }
      body.push(el("table", null, tbody));
      const money = [];
      if (c.costUsd != null) money.push("cost " + fmtUSD(c.costUsd));
      if (c.idleUsd != null) money.push("idle " + fmtUSD(c.idleUsd));
      if (!money.length) money.push("unpriced");
      body.push(el("div", { className: "tip-sub" }, money.join(" · ") + (c.teams ? " · team " + dedupe(c.teams) : "")));
    }
    tip.replaceChildren(...body);
    tip.hidden = false;
    const tw = tip.offsetWidth;
    const th = tip.offsetHeight;
    let left = ev.clientX + 14;
    let top = ev.clientY + 14;
    if (left + tw > window.innerWidth - 8) left = ev.clientX - tw - 14;
    if (top + th > window.innerHeight - 8) top = ev.clientY - th - 14;
    tip.style.left = Math.max(4, left) + "px";
    tip.style.top = Math.max(4, top) + "px";
  }

  function dedupe(list) {
    return [...new Set(String(list).split(", ").filter(Boolean))].join(", ");
  }

  // ───────────────────────────── utilisation chart ─────────────────────────────

  let utilRange = 24;
  let plot = null;

  async function loadUtil() {
    const r = await sql(`
      SELECT "hour", sum(active_s) AS active, sum(allocated_idle_s) AS allocated_idle, sum(stranded_s) AS stranded,
        sum(unallocated_idle_s) AS unallocated_idle, sum(unallocated_busy_s) AS unallocated_busy, sum(unknown_s) AS unknown,
        sum(idle_cost_usd) AS idle_usd
      FROM gpu_cost_hourly
      WHERE "hour" >= ${ANCHOR_HOUR} - INTERVAL '${utilRange - 1} hours' AND "hour" <= ${ANCHOR_HOUR}
      GROUP BY "hour" ORDER BY "hour"`);
    return r.objects();
  }

  function renderUtil(rows) {
    const target = $("util-chart");
    if (typeof window.uPlot !== "function") {
      showNote("util-note", "The chart library (uPlot) did not load.", "error");
      return;
    }
    const xs = [];
    const active = [];
    const idle = [];
    const stranded = [];
    const unknown = [];
    const idleUsd = [];
    for (const r of rows) {
      const t = Date.parse(r.hour) / 1000;
      // Active, idle and stranded are shares of the known GPU-seconds (so the hour in
      // progress, whose rest is still unknown, is comparable); unknown is a share of all.
      let all = 0;
      for (const s of STATES) all += num(r[s.key]) || 0;
      const known = all - (num(r.unknown) || 0);
      const f = (v) => (known > 0 ? (100 * (num(v) || 0)) / known : null);
      xs.push(t);
      active.push(f(r.active));
      idle.push(f((num(r.allocated_idle) || 0) + (num(r.stranded) || 0) + (num(r.unallocated_idle) || 0)));
      stranded.push(f(r.stranded));
      unknown.push(all > 0 ? (100 * (num(r.unknown) || 0)) / all : null);
      const u = num(r.idle_usd);
      idleUsd.push(Number.isFinite(u) ? u : null);
    }
    const data = [xs, active, idle, stranded, unknown, idleUsd];
    showNote("util-note", rows.length ? "" : "No gpu_cost_hourly rows in this range yet (the cost ledger runs every few minutes).", "info");
    const width = Math.max(target.clientWidth, 300);
    if (plot && plot.series.length === data.length) {
      plot.setData(data);
      if (plot.width !== width) plot.setSize({ width, height: 300 });
      return;
    }
    if (plot) plot.destroy();
    const pct = (u, v) => (v == null ? "—" : v.toFixed(1) + "%");
    const usd = (u, v) => (v == null ? "—" : fmtUSD(v));
    plot = new window.uPlot(
      {
        width,
        height: 300,
        tzDate: (ts) => window.uPlot.tzDate(new Date(ts * 1000), "Etc/UTC"),
        cursor: { drag: { x: false, y: false } },
        scales: { pct: { range: [0, 100] }, usd: { range: (u, min, max) => [0, Math.max(1, max * 1.1)] } },
        series: [
          { value: (u, v) => (v == null ? "—" : new Date(v * 1000).toISOString().slice(0, 16).replace("T", " ") + " UTC") },
          { label: "Active", scale: "pct", stroke: "#2e9d5b", width: 2, fill: "rgba(46,157,91,0.10)", value: pct },
          { label: "Idle", scale: "pct", stroke: "#f0b429", width: 2, value: pct },
          { label: "Stranded", scale: "pct", stroke: "#d64545", width: 2, value: pct },
          { label: "Unknown", scale: "pct", stroke: "#9aa4b2", width: 1, dash: [4, 4], value: pct },
          { label: "Idle $/h", scale: "usd", stroke: "#1f3a5f", width: 2, dash: [6, 3], value: usd },
        ],
        axes: [
          {
            stroke: "#6b7685",
            grid: { stroke: "#eef1f5" },
            ticks: { stroke: "#e2e6ec" },
            // UTC, 24-hour clock; the date under midnight and under the first tick.
            values: (u, splits) =>
              splits.map((ts, i) => {
                const ms = ts * 1000;
                const d = new Date(ms);
                const hm = String(d.getUTCHours()).padStart(2, "0") + ":" + String(d.getUTCMinutes()).padStart(2, "0");
                return i === 0 || (d.getUTCHours() === 0 && d.getUTCMinutes() === 0) ? hm + "\n" + dayLabel(ms) : hm;
              }),
          },
          { scale: "pct", stroke: "#6b7685", values: (u, vals) => vals.map((v) => v + "%"), grid: { stroke: "#eef1f5" }, ticks: { stroke: "#e2e6ec" } },
          { scale: "usd", side: 1, stroke: "#1f3a5f", values: (u, vals) => vals.map((v) => "$" + intFmt.format(v)), grid: { show: false }, size: 64 },
        ],
      },
      data,
      target
    );
  }

  // ───────────────────────────── idle dollars by team (weekly report) ─────────────────────────────

  function isoWeek(ms) {
    const d = new Date(ms);
    const t = new Date(Date.UTC(d.getUTCFullYear(), d.getUTCMonth(), d.getUTCDate()));
    const day = t.getUTCDay() || 7;
    t.setUTCDate(t.getUTCDate() + 4 - day);
    const year = t.getUTCFullYear();
    const week = Math.ceil(((t - Date.UTC(year, 0, 1)) / 86400e3 + 1) / 7);
    return year + "-W" + String(week).padStart(2, "0");
  }

  function fillWeekSelect() {
    const sel = $("week-select");
    const pinned = params.get("week");
    const opts = [];
    const now = Date.now();
    const names = ["This week", "Last week"];
    for (let i = 0; i < 6; i++) {
      const w = isoWeek(now - i * 7 * 86400e3);
      opts.push(el("option", { value: w }, (names[i] || i + " weeks ago") + " (" + w + ")"));
    }
    if (pinned && !opts.some((o) => o.value === pinned)) opts.unshift(el("option", { value: pinned }, pinned));
    sel.replaceChildren(...opts);
    sel.value = pinned || opts[0].value;
  }

  /** Once, unless a week is pinned (?week=) or chosen: open the report on the week of
   *  `ms` (the newest data) when that is not this week. */
  let weekChosen = false;
  function openOnWeekOf(ms) {
    const sel = $("week-select");
    const w = isoWeek(ms);
    if (weekChosen || params.get("week") || sel.value === w) return Promise.resolve();
    weekChosen = true;
    if (![...sel.options].some((o) => o.value === w)) sel.append(el("option", { value: w }, "Newest data (" + w + ")"));
    sel.value = w;
    return refreshIdle();
  }

  async function loadIdle() {
    const week = $("week-select").value;
    const rep = await api("/api/v1/reports/weekly?week=" + encodeURIComponent(week) + "&format=json");
    // Another week was chosen (or opened on the newest data) while this one loaded.
    if ($("week-select").value !== week) return;
    renderIdle(rep, week);
  }

  function renderIdle(rep, week) {
    const body = $("idle-body");
    const lines = Array.isArray(rep.teams) ? rep.teams.slice() : [];
    const un = rep.unallocated;
    if (un && (num(un.idle_cost_usd) || num(un.gpu_hours_unallocated_idle) || num(un.gpu_hours_unallocated_busy))) lines.push(un);
    lines.sort((a, b) => (num(b.idle_cost_usd) || 0) - (num(a.idle_cost_usd) || 0) || String(a.team).localeCompare(String(b.team)));
    const max = Math.max(0, ...lines.map((l) => num(l.idle_cost_usd) || 0));
    if (!lines.length) {
      emptyRow(body, 6, "No GPU-hours in " + (rep.week || week) + " yet.");
    } else {
      body.replaceChildren(
        ...lines.map((l) => {
          const bar = el("div", { className: "bar", title: "allocated idle · stranded · unallocated idle" });
          for (const k of IDLE_STATES) {
            const v = num(l[k + "_cost_usd"]) || 0;
            if (v <= 0 || max <= 0) continue;
            const seg = el("span", { className: "b-" + k });
            seg.style.width = ((100 * v) / max).toFixed(2) + "%";
            bar.append(seg);
          }
          const isUn = l === un;
          return el(
            "tr",
            { dataset: { team: l.team } },
            el("td", null, isUn ? el("em", null, "unallocated") : l.team),
            el("td", { className: "num" }, fmtUSD(l.allocated_idle_cost_usd)),
            el("td", { className: "num" }, fmtUSD(l.stranded_cost_usd)),
            el("td", { className: "num" }, fmtUSD(l.unallocated_idle_cost_usd)),
            el("td", { className: "num" }, el("strong", null, fmtUSD(l.idle_cost_usd))),
            el("td", null, bar)
          );
        })
      );
    }
    const fleet = rep.fleet || {};
    $("idle-total-alloc").textContent = fmtUSD(fleet.allocated_idle_cost_usd);
    $("idle-total-stranded").textContent = fmtUSD(fleet.stranded_cost_usd);
    $("idle-total-unalloc").textContent = fmtUSD(fleet.unallocated_idle_cost_usd);
    const total = $("idle-dollars-total");
    total.textContent = fmtUSD(fleet.idle_cost_usd);
    total.dataset.value = fleet.idle_cost_usd == null ? "" : String(fleet.idle_cost_usd);
    total.dataset.week = rep.week || week;
    const change = $("idle-total-change");
    const ch = num(fleet.change_idle_cost_usd);
    change.className = "muted";
    change.textContent = "";
    if (Number.isFinite(ch) && ch !== 0) {
      change.className = ch > 0 ? "change-up" : "change-down";
      change.textContent = (ch > 0 ? "▲ " : "▼ ") + fmtUSDShort(Math.abs(ch));
      change.title = "change from the previous week";
    }
    $("kpi-week").textContent = (rep.week || week) === isoWeek(Date.now()) ? "this week" : rep.week || week;
    $("kpi-idle").textContent = fmtUSDShort(fleet.idle_cost_usd);
    $("kpi-idle").className = "kpi-value" + (num(fleet.idle_cost_usd) > 0 ? " bad" : "");
    $("kpi-idle-sub").textContent =
      "stranded " + fmtUSDShort(fleet.stranded_cost_usd) + " · of " + fmtUSDShort(fleet.cost_usd) + " GPU spend";
    const foot = [];
    if (rep.week_start && rep.week_end) {
      const end = Date.parse(rep.week_end) - 1;
      foot.push((rep.week || week) + ": " + dayLabel(Date.parse(rep.week_start)) + " – " + dayLabel(end) + " (UTC)");
    }
    if (rep.price_book_version) foot.push("price book " + rep.price_book_version);
    if (Number.isFinite(num(rep.coverage))) foot.push("coverage " + fmtPct(num(rep.coverage)));
    const unpriced = num(fleet.unpriced_gpu_hours);
    if (unpriced > 0) foot.push(intFmt.format(unpriced) + " GPU-hours unpriced (no price for the model)");
    $("idle-foot").textContent = foot.join(" · ");
    if (rep.example_prices) {
      showNote("idle-note", "Example prices: these dollars come from the example price book (deploy/pricebook.example.toml), not your rates. Set [cost] price_book to your own.", "info");
    } else if (String(rep.price_book_version || "").startsWith("none")) {
      showNote("idle-note", "Unpriced: no price book is configured ([cost] price_book), so every money column is empty; GPU-hours are still classified.", "info");
    } else {
      showNote("idle-note", "");
    }
  }

  // ───────────────────────────── alerts ─────────────────────────────

  const KIND_ORDER = ["stranded_allocation", "zombie_memory", "unallocated_busy", "gpu_lost", "xid_error"];

  async function loadAlerts() {
    const body = $("alerts-body");
    let r;
    try {
      r = await api("/api/v1/alerts");
    } catch (e) {
      emptyRow(body, 9, "—");
      showNote("alerts-note", describeError(e, "Alerts (GET /api/v1/alerts)"), isUnavailable(e) ? "info" : null);
      $("alerts-count").textContent = "";
      $("kpi-stranded").textContent = "—";
      $("kpi-stranded-sub").textContent = isUnavailable(e) ? "alerts not available" : "alerts failed";
      return;
    }
    showNote("alerts-note", "");
    const all = Array.isArray(r && r.alerts) ? r.alerts : [];
    const firing = all.filter((a) => a && a.state === "firing");
    const rank = (k) => {
      const i = KIND_ORDER.indexOf(k);
      return i < 0 ? KIND_ORDER.length : i;
    };
    firing.sort((a, b) => rank(a.kind) - rank(b.kind) || (num(b.cost_usd) || 0) - (num(a.cost_usd) || 0) || String(a.starts_at).localeCompare(String(b.starts_at)));
    const stranded = firing.filter((a) => a.kind === "stranded_allocation");
    const strandedUsd = stranded.reduce((s, a) => s + (num(a.cost_usd) || 0), 0);
    $("kpi-stranded").textContent = intFmt.format(stranded.length);
    $("kpi-stranded").className = "kpi-value" + (stranded.length ? " bad" : " good");
    $("kpi-stranded-sub").textContent = stranded.length
      ? stranded.reduce((s, a) => s + (num(a.gpus_stranded) || (a.gpu_uuids || []).length || 0), 0) + " GPUs · " + fmtUSD(strandedUsd) + " so far"
      : "none firing";
    $("alerts-count").textContent =
      firing.length + " firing" + (all.length > firing.length ? " · " + (all.length - firing.length) + " resolved (not shown)" : "");
    if (!firing.length) {
      emptyRow(body, 9, "Nothing is firing: no stranded allocation right now.");
      return;
    }
    body.replaceChildren(
      ...firing.map((a) => {
        const gpus =
          a.gpus_stranded != null && a.gpus_total != null
            ? a.gpus_stranded + " / " + a.gpus_total
            : Array.isArray(a.gpu_uuids)
              ? String(a.gpu_uuids.length)
              : "—";
        const ownerSub = [a.owner_kind, a.workload_kind].filter(Boolean).join(" · ");
        return el(
          "tr",
          { dataset: { id: a.id == null ? "" : String(a.id) } },
          el(
            "td",
            null,
            el("span", { className: "badge badge-" + String(a.kind) }, String(a.kind || "—").replace(/_/g, " ")),
            a.severity ? el("div", { className: "muted" }, String(a.severity)) : null
          ),
          el("td", null, ident(a.team || "—")),
          el("td", { title: a.owner || null }, ownerName(a.owner), ownerSub ? el("div", { className: "muted" }, ownerSub) : null),
          el("td", null, ident(a.host || "—"), ident(a.cluster, "muted")),
          el("td", { className: "num", title: Array.isArray(a.gpu_uuids) ? a.gpu_uuids.join("\n") : null }, gpus),
          el("td", { className: "when", title: a.starts_at || null }, fmtAgo(a.starts_at)),
          el("td", { className: "num" }, a.idle_s == null ? "—" : fmtDuration(a.idle_s)),
          el("td", { className: "num" }, a.cost_usd == null ? "—" : fmtUSD(a.cost_usd)),
          el("td", { className: "summary-cell" }, a.summary || "")
        );
      })
    );
  }

  // ───────────────────────────── recommendations ─────────────────────────────

  // null: the server's [recommend] window, as `apron recommend` and the API default to.
  let recsWindow = null;

  async function loadRecs() {
    const body = $("recs-body");
    let r;
    try {
      r = await api("/api/v1/recommendations" + (recsWindow ? "?window=" + encodeURIComponent(recsWindow) : ""));
    } catch (e) {
      emptyRow(body, 8, "—");
      showNote("recs-note", describeError(e, "Recommendations (GET /api/v1/recommendations)"), isUnavailable(e) ? "info" : null);
      $("kpi-savings").textContent = "—";
      $("kpi-savings-sub").textContent = isUnavailable(e) ? "recommendations not available" : "recommendations failed";
      return;
    }
    showNote("recs-note", "");
    const recs = (Array.isArray(r && r.recommendations) ? r.recommendations : []).filter(Boolean);
    recs.sort((a, b) => (num(b.monthly_savings_usd) || 0) - (num(a.monthly_savings_usd) || 0));
    // The set's own totals by savings kind when it has them, else the items' sum.
    const byKind = r && r.monthly_savings_usd && typeof r.monthly_savings_usd === "object" ? Object.entries(r.monthly_savings_usd) : [];
    const total = byKind.length
      ? byKind.reduce((s, [, v]) => s + (num(v) || 0), 0)
      : recs.reduce((s, x) => s + (num(x.monthly_savings_usd) || 0), 0);
    $("kpi-savings").textContent = fmtUSDShort(total);
    $("kpi-savings").dataset.value = String(total);
    if (!recsWindow) {
      // The server's default window: mark its button (if one matches) as chosen.
      const hours = (Date.parse(r.to) - Date.parse(r.from)) / 3.6e6;
      for (const b of document.querySelectorAll("#recs-window .seg-btn")) {
        const m = /^(\d+)([hd])$/.exec(b.dataset.window || "");
        const h = m ? Number(m[1]) * (m[2] === "d" ? 24 : 1) : NaN;
        b.classList.toggle("active", Math.abs(h - hours) < 0.01);
      }
    }
    $("kpi-savings").className = "kpi-value" + (total > 0 ? " good" : "");
    const covered = num(r && r.covered_hours);
    const count = recs.length + " recommendation" + (recs.length === 1 ? "" : "s") + " over " + (r.window || recsWindow || "the default window") +
      (Number.isFinite(covered) && covered < (Date.parse(r.to) - Date.parse(r.from)) / 3.6e6 - 0.05 ? " (" + covered.toFixed(1) + " h of data)" : "");
    $("kpi-savings-sub").textContent = byKind.length > 1 ? byKind.map(([k, v]) => k + " " + fmtUSDShort(v)).join(" · ") + " · " + count : count;
    if (!recs.length) {
      emptyRow(body, 8, "No recommendation for this window.");
      return;
    }
    body.replaceChildren(
      ...recs.map((x) => {
        const where = [x.cluster, x.host].filter(Boolean).join(" · ") || (x.gpu_model ? "" : "—");
        const summary = el("td", { className: "summary-cell" }, x.summary || "");
        const detail = {};
        if (x.evidence != null) detail.evidence = x.evidence;
        if (x.replay != null) detail.replay = x.replay;
        if (x.window_savings_usd != null) detail.window_savings_usd = x.window_savings_usd;
        if (Array.isArray(x.gpus)) detail.gpus = x.gpus;
        if (Object.keys(detail).length) {
          summary.append(el("details", { className: "evidence" }, el("summary", null, "evidence"), el("pre", null, JSON.stringify(detail, null, 2))));
        }
        // gpus: the GPU UUIDs (a count from older servers).
        const gpus = Array.isArray(x.gpus) ? String(x.gpus.length) : x.gpus == null ? "—" : String(x.gpus);
        return el(
          "tr",
          { dataset: { id: x.id == null ? "" : String(x.id) } },
          el("td", null, el("span", { className: "badge badge-" + String(x.kind) }, String(x.kind || "—"))),
          el("td", null, ident(x.team || "—")),
          el("td", { title: x.owner || null }, ownerName(x.owner), x.owner_kind ? el("div", { className: "muted" }, String(x.owner_kind)) : null),
          el("td", null, ident(where), ident(shortModel(x.gpu_model), "muted")),
          el("td", { className: "num", title: Array.isArray(x.gpus) ? x.gpus.join("\n") : null }, gpus),
          el("td", { className: "num" }, el("strong", null, fmtUSD(x.monthly_savings_usd)), x.savings_kind ? el("div", { className: "muted" }, String(x.savings_kind)) : null),
          el("td", { className: "conf" }, fmtConfidence(x.confidence)),
          summary
        );
      })
    );
  }

  function fmtConfidence(c) {
    if (c == null) return "—";
    if (typeof c === "number") return c <= 1 ? fmtPct(c, 0) : String(c);
    return String(c);
  }

  // ───────────────────────────── SQL box ─────────────────────────────

  const SQL_MAX_ROWS = 2000;

  async function runSql() {
    const text = $("sql-input").value;
    const btn = $("sql-run");
    const status = $("sql-status");
    const table = $("sql-table");
    showNote("sql-error", "");
    if (!text.trim()) {
      showNote("sql-error", "Write a query first.", "error");
      return;
    }
    btn.disabled = true;
    status.textContent = "running…";
    const t0 = performance.now();
    try {
      const r = await sql(text);
      const ms = Math.round(performance.now() - t0);
      const head = el("tr", null, ...r.columns.map((c) => el("th", null, c.name, el("span", { className: "type" }, c.type || ""))));
      const shown = r.rows.slice(0, SQL_MAX_ROWS);
      const rows = shown.map((row) =>
        el(
          "tr",
          null,
          ...row.map((v) => {
            if (v === null) return el("td", { className: "null" }, "NULL");
            return el("td", { className: typeof v === "number" ? "num" : null }, typeof v === "object" ? JSON.stringify(v) : String(v));
          })
        )
      );
      table.tHead.replaceChildren(head);
      table.tBodies[0].replaceChildren(...rows);
      table.dataset.rows = String(r.rows.length);
      status.textContent =
        intFmt.format(r.rows.length) + " row" + (r.rows.length === 1 ? "" : "s") + " in " + ms + " ms" +
        (r.rows.length > SQL_MAX_ROWS ? " (first " + intFmt.format(SQL_MAX_ROWS) + " shown)" : "");
    } catch (e) {
      status.textContent = "";
      table.tHead.replaceChildren();
      table.tBodies[0].replaceChildren();
      table.dataset.rows = "";
      if (e instanceof ApiError) {
        showNote("sql-error", (e.status ? e.status + " " : "") + e.code + (e.detail ? "\n" + e.detail : ""), "error");
      } else {
        showNote("sql-error", describeError(e, "SQL"), "error");
      }
    } finally {
      btn.disabled = false;
    }
  }

  // ───────────────────────────── refresh loop ─────────────────────────────

  let refreshing = null;
  let refreshes = 0;

  async function refreshHourly() {
    try {
      const data = await loadHourly();
      let indexNote = "";
      try {
        await loadGpuIndexes([...new Set(data.rows.map((r) => r.gpu_uuid))]);
      } catch (e) {
        // Labels without an index are still useful: say why and go on.
        indexNote = describeError(e, "Looking up GPU indexes");
      }
      heat = buildHeat(data);
      drawHeatmap();
      renderKpiActive(data);
      if (data.historical) await openOnWeekOf(data.nowHour);
      if (!data.rows.length) {
        showNote("heatmap-note", "No gpu_cost_hourly rows in the last 24 h yet: the cost ledger fills them every few minutes (with cost enabled).", "info");
      } else if (data.historical) {
        showNote("heatmap-note", "No recent data: showing the 24 h up to the newest priced hour, " + new Date(data.nowHour).toISOString().slice(0, 13) + ":00 UTC.", "info");
      } else if (heat.total > heat.gpus.length) {
        showNote("heatmap-note", "Showing the first " + intFmt.format(heat.gpus.length) + " of " + intFmt.format(heat.total) + " GPUs (by host). Use the SQL box for the rest.", "info");
      } else {
        showNote("heatmap-note", indexNote);
      }
    } catch (e) {
      showNote("heatmap-note", describeError(e, "The heatmap query"));
      $("kpi-active").textContent = "—";
      $("kpi-active-sub").textContent = "\u00a0";
    }
  }

  function renderKpiActive(data) {
    let active = 0;
    let known = 0;
    let idle = 0;
    let idleUsd = 0;
    for (const r of data.rows) {
      const a = num(r.active) || 0;
      active += a;
      known += a + (num(r.allocated_idle) || 0) + (num(r.stranded) || 0) + (num(r.unallocated_idle) || 0) + (num(r.unallocated_busy) || 0);
      idle += (num(r.allocated_idle) || 0) + (num(r.stranded) || 0) + (num(r.unallocated_idle) || 0);
      idleUsd += num(r.idle_usd) || 0;
    }
    $("kpi-active").textContent = known > 0 ? fmtPct(active / known) : "—";
    $("kpi-active-sub").textContent =
      known > 0 ? intFmt.format(Math.round(idle / 3600)) + " idle GPU-hours · " + fmtUSDShort(idleUsd) + " idle" : "no known GPU time";
  }

  async function refreshUtil() {
    try {
      renderUtil(await loadUtil());
    } catch (e) {
      showNote("util-note", describeError(e, "The utilisation query"));
    }
  }

  async function refreshIdle() {
    try {
      await loadIdle();
    } catch (e) {
      showNote("idle-note", describeError(e, "The weekly report (GET /api/v1/reports/weekly)"), isUnavailable(e) ? "info" : null);
      emptyRow($("idle-body"), 6, "—");
    }
  }

  function refreshAll() {
    if (refreshing) return refreshing;
    unauthorizedThisRound = false;
    $("refresh-status").textContent = "refreshing…";
    const guard = (p) => Promise.resolve(p).catch((e) => describeError(e, "refresh"));
    refreshing = Promise.all([guard(refreshHourly()), guard(refreshUtil()), guard(refreshIdle()), guard(loadAlerts()), guard(loadRecs())]).then(() => {
      refreshing = null;
      refreshes++;
      if (!unauthorizedThisRound) clearUnauthorized();
      const t = new Date();
      $("refresh-status").textContent = "updated " + t.toISOString().slice(11, 19) + " UTC";
      document.body.dataset.refreshes = String(refreshes);
      document.body.dataset.state = "ready";
    });
    return refreshing;
  }

  // ───────────────────────────── wiring ─────────────────────────────

  function init() {
    renderLegend();
    fillWeekSelect();
    $("token-input").value = memoryToken;

    $("token-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      setToken($("token-input").value.trim());
      refreshAll();
    });
    $("token-clear").addEventListener("click", () => {
      $("token-input").value = "";
      setToken("");
      refreshAll();
    });
    $("refresh-now").addEventListener("click", () => refreshAll());

    const auto = $("auto-refresh");
    let autoOn = params.get("refresh") !== "0";
    try {
      if (window.localStorage.getItem(AUTO_KEY) === "off") autoOn = false;
    } catch (_) {
      /* ignore */
    }
    auto.checked = autoOn;
    auto.addEventListener("change", () => {
      try {
        window.localStorage.setItem(AUTO_KEY, auto.checked ? "on" : "off");
      } catch (_) {
        /* ignore */
      }
    });
    window.setInterval(() => {
      if (auto.checked && !document.hidden) refreshAll();
    }, REFRESH_MS);

    $("week-select").addEventListener("change", () => {
      weekChosen = true;
      refreshIdle();
    });
    for (const b of document.querySelectorAll("#util-range .seg-btn")) {
      b.addEventListener("click", () => {
        utilRange = Number(b.dataset.range) || 24;
        for (const o of document.querySelectorAll("#util-range .seg-btn")) o.classList.toggle("active", o === b);
        refreshUtil();
      });
    }
    for (const b of document.querySelectorAll("#recs-window .seg-btn")) {
      b.addEventListener("click", () => {
        recsWindow = b.dataset.window || "7d";
        for (const o of document.querySelectorAll("#recs-window .seg-btn")) o.classList.toggle("active", o === b);
        loadRecs().catch((e) => showNote("recs-note", describeError(e, "Recommendations")));
      });
    }

    $("sql-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      runSql();
    });
    $("sql-input").addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && (ev.ctrlKey || ev.metaKey)) {
        ev.preventDefault();
        runSql();
      }
    });

    const canvas = $("heatmap");
    canvas.addEventListener("mousemove", heatTooltip);
    canvas.addEventListener("mouseleave", () => ($("heatmap-tip").hidden = true));
    $("heatmap-wrap").addEventListener("scroll", () => ($("heatmap-tip").hidden = true));

    let resizeTimer = 0;
    window.addEventListener("resize", () => {
      window.clearTimeout(resizeTimer);
      resizeTimer = window.setTimeout(() => {
        if (heat) drawHeatmap();
        if (plot) plot.setSize({ width: Math.max($("util-chart").clientWidth, 300), height: 300 });
      }, 150);
    });

    refreshAll();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
