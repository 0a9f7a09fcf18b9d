#!/usr/bin/env python3
"""Runs every query of Apron's Grafana dashboards against real backends (stdlib only).

No Grafana runs here. Instead this script does what Grafana would do with each dashboard
and checks the answers:

  python3 tests/dashboards/check.py --prometheus http://127.0.0.1:9090 \
      --sql-mode http --server http://127.0.0.1:9402 \
      --from 2026-12-02T17:00:00Z --to 2026-12-02T20:00:00Z \
      dashboards/grafana/prometheus dashboards/grafana/postgres

  # the same SQL through the PostgreSQL wire port:
  python3 tests/dashboards/check.py --sql-mode psql \
      --psql-cmd 'psql -h 127.0.0.1 -p 5433 -U apron -d apron' \
      --from now-3h --to now dashboards/grafana/postgres

For each dashboard (a JSON file, or every *.json in a directory):

1. Lint: importable shape (`__inputs` with one datasource input DS_PROMETHEUS or
   DS_POSTGRES, schemaVersion, unique uid and panel ids, gridPos inside 24 columns),
   every panel and target uses `${DS_…}` of that input, every `$variable` a query uses
   is defined or a Grafana built-in, every SQL macro is one Grafana's PostgreSQL
   datasource defines.
2. Template variables, in dashboard order, each run like Grafana runs it (Prometheus:
   `label_values(label)`, `label_values(selector, label)`, `query_result(expr)`,
   `metrics(regex)`, `label_names()`; SQL: the first column of the query; then the
   variable's `regex` and `sort`). A multi-value or include-all variable takes "All"
   (its `allValue`, e.g. `.*`, or else every value); a single-value variable takes its
   first value, and a target that is empty under it is retried under the next values
   (and combinations with earlier single-value variables, at most
   --max-combinations): a GPU-detail panel for GPM metrics is right to be empty for
   an A100 as long as it has data for some GPU.
3. Every visible target (`hide` unset):
   - PromQL: built-ins and variables substituted as Grafana's Prometheus datasource
     does (below), then `/api/v1/query_range` (range targets, start/end aligned to the
     step) or `/api/v1/query` at --to (instant targets).
   - SQL: variables substituted as Grafana's SQL datasources do (multi-value → quoted,
     comma-joined literals), then the PostgreSQL macros expanded exactly as Grafana's
     backend does (below), then run over HTTP (`POST {server}/api/v1/sql`, JSON) or
     through psql.
   A target fails on an error, or when the answer is empty: no series / no rows, every
   value NaN / NULL, and for SQL `time_series` targets no `time` column, a time column
   out of order, or no non-NULL value beside time and metric. Exceptions are listed in
   ALLOWED_EMPTY (below) with the reason; keep it short.

Grafana's expansions reproduced here (Grafana 10/11: the Prometheus backend
`pkg/promlib/models/query.go`, `pkg/tsdb/grafana-postgresql-datasource/macros.go`,
`pkg/tsdb/sqleng` `Interpolate`, `gtime`; the frontend's template variable formats):

  $__interval      range / max data points, rounded to Grafana's table (10ms … 1y),
                   at least the min interval (target `interval`, else panel
                   `interval`, else the datasource's: Prometheus scrape interval,
                   default 15s; SQL datasources 1m); gtime.FormatInterval text
                   (`30s`, `1m`, `1h`, `1d`). For Prometheus it is also the step;
                   start and end are rounded down to a multiple of it.
  $__interval_ms   the same in milliseconds
  $__rate_interval max($__interval + scrape, 4 × scrape) as a Go duration
                   (`1m0s`, `1m2s`, `8s`); scrape = the target's min step if set,
                   else the datasource's scrape interval
  $__range         round(range seconds) + `s`; $__range_s, $__range_ms
  $__from, $__to   epoch milliseconds
  SQL: first sqleng's replacements ($__interval_ms, $__interval, $__unixEpochFrom(),
  $__unixEpochTo()), then comments outside quotes are dropped and the macros
  expanded (timestamps in Go's RFC3339Nano, UTC: `2026-12-02T17:00:00Z`,
  `2026-12-02T17:00:00.25Z`; arguments split as one CSV record):
  $__time(c)                 c AS "time"
  $__timeEpoch(c)            extract(epoch from c) as "time"
  $__timeFilter(c)           c BETWEEN '<from>' AND '<to>'
  $__timeFrom()              '<from>'
  $__timeTo()                '<to>'
  $__timeGroup(c, iv[, fill])        floor(extract(epoch from c)/S)*S   (S: seconds, Go %v)
  $__timeGroupAlias(c, iv[, fill])   the same + AS "time" (also $__timeGroup(…)
                                     directly followed by a comma: Grafana < 5.3 usage)
  $__unixEpochFilter(c)      c >= <from s> AND c <= <to s>
  $__unixEpochNanoFilter(c)  c >= <from ns> AND c <= <to ns>
  $__unixEpochFrom(), $__unixEpochTo(), $__unixEpochNanoFrom(), $__unixEpochNanoTo()
  $__unixEpochGroup(c, iv)   floor((c)/S)*S;  $__unixEpochGroupAlias adds AS "time"
  (Grafana finds macros with the regular expression \\$(\\w+)\\(([^)]*)\\) — a macro's
  arguments cannot contain parentheses — and rejects an unknown one.)

All of these are valid SQL for Apron's engine (Apache DataFusion): `extract(epoch
from …)`, `floor`, BETWEEN and comparisons of a timestamp column with an RFC 3339
string literal. The dashboards avoid what is not: `::` casts are not needed (CAST(…
AS DOUBLE) is used for decimals), `cluster` is always double-quoted, and hourly tables
are filtered with `hour >= date_trunc('hour', $__timeFrom()) AND hour <= $__timeTo()`
so that the hour the range starts in is counted.

Exit status: 0 all passed; 1 a check failed; 2 a tool is missing (psql) or the
arguments are wrong.
"""

import argparse
import csv
import datetime as dt
import glob
import itertools
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

# --------------------------------------------------------------------------- policy

# Targets allowed to answer with nothing even where data exists:
#   (dashboard uid, panel title, refId) -> why that is the correct answer.
# Every entry weakens the test; add one only when an empty answer is the normal state
# of a healthy system (e.g. a panel that lists lost GPUs), never to hide a bad query.
# Panels that would be empty in a healthy fleet are written to answer 0 instead
# (`count(...) or vector(0)`, `sum(apron_gpu_lost)`, `SELECT count(*)`), so this is empty.
ALLOWED_EMPTY = {}

DS_INPUTS = {
    "DS_PROMETHEUS": ("prometheus", {"prometheus"}),
    "DS_POSTGRES": ("postgres", {"grafana-postgresql-datasource", "postgres"}),
}
PANEL_TYPES = {"row", "timeseries", "stat", "table", "bargauge", "gauge", "heatmap",
               "state-timeline", "status-history", "piechart", "barchart", "text", "histogram"}
BUILTIN_VARS = {"__interval", "__interval_ms", "__range", "__range_s", "__range_ms",
                "__rate_interval", "__rate_interval_ms", "__from", "__to", "__dashboard",
                "__org", "__user",
                "__timezone"}
SQL_MACROS = {"__time", "__timeEpoch", "__timeFilter", "__timeFrom", "__timeTo", "__timeGroup",
              "__timeGroupAlias", "__unixEpochFilter", "__unixEpochNanoFilter", "__unixEpochFrom",
              "__unixEpochTo", "__unixEpochNanoFrom", "__unixEpochNanoTo", "__unixEpochGroup",
              "__unixEpochGroupAlias"}


class CheckError(Exception):
    """A query could not be run or answered with an error."""


class ToolMissing(Exception):
    pass


class EmptyVariable(Exception):
    """A target uses a variable whose query found no values: an empty answer, not an
    error (Grafana would substitute nothing and, for SQL, send `IN ()`)."""


# --------------------------------------------------------------------------- time

_DUR = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w|y)")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000,
            "w": 604_800_000, "y": 31_536_000_000}


def parse_duration_ms(text):
    """Grafana/Prometheus durations: 1m, 1h30m, 500ms, 1d, 1w, 1y (bare numbers: s)."""
    text = text.strip().strip("'\"")
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text) * 1000
    pos, total = 0, 0.0
    for m in _DUR.finditer(text):
        if m.start() != pos:
            raise ValueError(f"bad duration {text!r}")
        total += float(m.group(1)) * _UNIT_MS[m.group(2)]
        pos = m.end()
    if pos != len(text) or not text:
        raise ValueError(f"bad duration {text!r}")
    return total


def parse_time(text, now):
    """RFC 3339 (`2026-12-02T17:00:00Z`, offsets, fractions) or `now`, `now-3h`."""
    t = text.strip()
    m = re.fullmatch(r"now(?:-(.+))?", t)
    if m:
        return now - dt.timedelta(milliseconds=parse_duration_ms(m.group(1))) if m.group(1) else now
    if t.endswith("Z") or t.endswith("z"):
        t = t[:-1] + "+00:00"
    # Python < 3.11 accepts at most 6 fraction digits.
    t = re.sub(r"(\.\d{6})\d+", r"\1", t)
    value = dt.datetime.fromisoformat(t)
    if value.tzinfo is None:
        raise ValueError(f"{text!r} has no time zone")
    return value.astimezone(dt.timezone.utc)


def rfc3339nano(t):
    """Go's time.RFC3339Nano in UTC: fraction without trailing zeros, none if zero."""
    t = t.astimezone(dt.timezone.utc)
    base = t.strftime("%Y-%m-%dT%H:%M:%S")
    if t.microsecond:
        base += ("." + f"{t.microsecond:06d}").rstrip("0")
    return base + "Z"


def epoch_s(t):
    return t.timestamp()


def go_float(x):
    """Go's fmt %v of a float64 (shortest representation, %e from exponent 21)."""
    if x == int(x) and abs(x) < 1e21:
        return str(int(x))
    r = repr(float(x))
    if "e" in r:
        mant, exp = r.split("e")
        sign = "-" if exp.startswith("-") else "+"
        exp = exp.lstrip("+-").rjust(2, "0")
        return f"{mant}e{sign}{exp}"
    return r


def go_duration(ms):
    """Go's time.Duration.String() for a whole number of milliseconds: 8s, 1m2s, 1h0m0s, 500ms."""
    ms = int(round(ms))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    sec = rest / 1000
    sec_text = go_float(sec) if sec != int(sec) else str(int(sec))
    if h:
        return f"{h}h{m}m{sec_text}s"
    if m:
        return f"{m}m{sec_text}s"
    return f"{sec_text}s"


def round_interval_ms(ms):
    """Grafana's rangeutil roundInterval (same table in frontend and gtime)."""
    table = [
        (15, 10), (35, 20), (75, 50), (150, 100), (350, 200), (750, 500), (1500, 1000),
        (3500, 2000), (7500, 5000), (12500, 10000), (17500, 15000), (25000, 20000),
        (45000, 30000), (90000, 60000), (210000, 120000), (450000, 300000),
        (750000, 600000), (1050000, 900000), (1500000, 1200000), (2700000, 1800000),
        (5400000, 3600000), (9000000, 7200000), (16200000, 10800000), (32400000, 21600000),
        (86400000, 43200000), (604800000, 86400000), (1814400000, 604800000),
    ]
    for limit, value in table:
        if ms <= limit:
            return value
    if ms < 3628800000:
        return 2592000000
    return 31536000000


def format_interval(ms):
    """gtime.FormatInterval: the largest whole unit (y, d, h, m, s, ms)."""
    for unit, size in (("y", 31_536_000_000), ("d", 86_400_000), ("h", 3_600_000),
                       ("m", 60_000), ("s", 1000), ("ms", 1)):
        if ms >= size:
            return f"{int(ms // size)}{unit}"
    return "1ms"


# --------------------------------------------------------------------------- substitution

VAR_RE = re.compile(r"\$(\w+)|\$\{(\w+)(?::([^}]+))?\}|\[\[(\w+)(?::(\w+))?\]\]")


def prom_regular_escape(v):
    return v.replace("\\", "\\\\").replace("'", "\\\\'")


def prom_regex_escape(v):
    v = v.replace("\\", "\\\\\\\\")
    return re.sub(r"[$^*{}\[\]'+?.()|]", lambda m: "\\\\" + m.group(0), v)


def sql_quote(v):
    return "'" + str(v).replace("'", "''") + "'"


class VarValue:
    """A variable's current value: raw (custom all value, single value) or a list."""

    def __init__(self, var, value, is_all_custom=False, empty=False):
        self.var = var
        self.value = value
        self.is_all_custom = is_all_custom
        self.empty = empty

    def describe(self):
        if self.is_all_custom:
            return f"All ({self.value})"
        if isinstance(self.value, list):
            return "All" if self.var.get("includeAll") else ",".join(self.value)
        return self.value


def format_value(vv, kind, fmt):
    var, value = vv.var, vv.value
    if vv.is_all_custom and not fmt:
        return value
    values = value if isinstance(value, list) else [value]
    if fmt:
        fmt = fmt.split(":")[0]
        if fmt in ("raw", "text"):
            return ",".join(values)
        if fmt == "csv":
            return ",".join(values)
        if fmt == "pipe":
            return "|".join(values)
        if fmt == "regex":
            esc = [re.sub(r"[\\^$*+?.()|{}\[\]/]", lambda m: "\\" + m.group(0), v) for v in values]
            return esc[0] if len(esc) == 1 else "(" + "|".join(esc) + ")"
        if fmt in ("singlequote", "sqlstring"):
            return ",".join(sql_quote(v) for v in values)
        if fmt == "doublequote":
            return ",".join('"' + v.replace('"', '\\"') + '"' for v in values)
        raise CheckError(f"unsupported variable format :{fmt}")
    multi = var.get("multi") or var.get("includeAll")
    if kind == "prometheus":
        if not multi:
            return prom_regular_escape(values[0] if values else "")
        esc = [prom_regex_escape(v) for v in values]
        return esc[0] if len(esc) == 1 else "(" + "|".join(esc) + ")"
    if not multi:
        return (values[0] if values else "").replace("'", "''")
    return ",".join(sql_quote(v) for v in values)


def substitute(text, env, kind, strict=True):
    """Replace $var, ${var}, ${var:fmt}, [[var]] from env (name -> VarValue or str)."""

    def repl(m):
        name = m.group(1) or m.group(2) or m.group(4)
        fmt = m.group(3) or m.group(5)
        if name not in env:
            return m.group(0)
        v = env[name]
        if isinstance(v, VarValue):
            return format_value(v, kind, fmt)
        if fmt and fmt.startswith("date"):
            return v  # __from/__to date formats are not used by these dashboards
        return v

    return VAR_RE.sub(repl, text)


def referenced_vars(text):
    out = set()
    for m in VAR_RE.finditer(text):
        out.add(m.group(1) or m.group(2) or m.group(4))
    return out


MACRO_RE = re.compile(r"\$(\w+)\(([^)]*)\)")


def strip_sql_comments(sql):
    """Grafana (10.x and later) drops -- and /* */ comments outside quotes before it
    expands macros, so a macro in a comment is not evaluated."""
    out, i, n = [], 0, len(sql)
    while i < n:
        c = sql[i]
        if c in "'\"":
            j = i + 1
            while j < n:
                if sql[j] == c:
                    if j + 1 < n and sql[j + 1] == c:
                        j += 2
                        continue
                    break
                j += 1
            out.append(sql[i:j + 1])
            i = j + 1
        elif sql.startswith("/*", i):
            end = sql.find("*/", i + 2)
            i = n if end < 0 else end + 2
        elif sql.startswith("--", i):
            end = sql.find("\n", i)
            i = n if end < 0 else end
        else:
            out.append(c)
            i += 1
    return "".join(out)


def macro_args(params):
    """Grafana splits macro arguments as one CSV record (lazy quotes, trimmed)."""
    params = params.strip().replace("\n", "")
    if not params:
        return [""]
    return [a.strip() for a in next(csv.reader([params], skipinitialspace=True))]


def expand_sql_macros(sql, t_from, t_to, interval_ms):
    """sqleng's Interpolate ($__interval, $__interval_ms, $__unixEpochFrom/To()) then
    Grafana's PostgreSQL macro engine (pkg/tsdb/grafana-postgresql-datasource/macros.go)."""

    sql = sql.replace("$__interval_ms", str(int(interval_ms)))
    sql = sql.replace("$__interval", format_interval(interval_ms))
    sql = sql.replace("$__unixEpochFrom()", str(int(epoch_s(t_from))))
    sql = sql.replace("$__unixEpochTo()", str(int(epoch_s(t_to))))
    sql = strip_sql_comments(sql)

    def seconds(arg):
        try:
            value = parse_duration_ms(arg.strip("'")) / 1000.0
        except ValueError:
            raise CheckError(f"error parsing interval {arg}")
        if value <= 0:
            raise CheckError(f"interval must be positive, got {arg}")
        return value

    def macro(m):
        name, args = m.group(1), macro_args(m.group(2))
        # Compatibility with Grafana < 5.3: $__timeGroup(...) directly followed by a
        # comma is taken as $__timeGroupAlias.
        if name == "__timeGroup" and sql[m.end():m.end() + 1] == ",":
            name = "__timeGroupAlias"
        f, t = rfc3339nano(t_from), rfc3339nano(t_to)
        if name == "__time":
            return f'{args[0]} AS "time"'
        if name == "__timeEpoch":
            return f'extract(epoch from {args[0]}) as "time"'
        if name == "__timeFilter":
            return f"{args[0]} BETWEEN '{f}' AND '{t}'"
        if name == "__timeFrom":
            return f"'{f}'"
        if name == "__timeTo":
            return f"'{t}'"
        if name in ("__timeGroup", "__timeGroupAlias"):
            if len(args) < 2:
                raise CheckError(f"macro {name} needs time column and interval and optional fill value")
            s = go_float(seconds(args[1]))
            out = f"floor(extract(epoch from {args[0]})/{s})*{s}"
            return out + ' AS "time"' if name == "__timeGroupAlias" else out
        if name == "__unixEpochFilter":
            return (f"{args[0]} >= {int(epoch_s(t_from))} AND {args[0]} <= {int(epoch_s(t_to))}")
        if name == "__unixEpochNanoFilter":
            return (f"{args[0]} >= {int(epoch_s(t_from) * 1e9)} AND {args[0]} <= {int(epoch_s(t_to) * 1e9)}")
        if name == "__unixEpochFrom":
            return str(int(epoch_s(t_from)))
        if name == "__unixEpochTo":
            return str(int(epoch_s(t_to)))
        if name == "__unixEpochNanoFrom":
            return str(int(epoch_s(t_from) * 1e9))
        if name == "__unixEpochNanoTo":
            return str(int(epoch_s(t_to) * 1e9))
        if name in ("__unixEpochGroup", "__unixEpochGroupAlias"):
            if len(args) < 2:
                raise CheckError(f"macro {name} needs time column and interval")
            s = go_float(seconds(args[1]))
            out = f"floor(({args[0]})/{s})*{s}"
            return out + ' AS "time"' if name == "__unixEpochGroupAlias" else out
        raise CheckError(f"unknown macro \"{name}\"")

    return MACRO_RE.sub(macro, sql)


# --------------------------------------------------------------------------- backends

def http_json(url, data=None, headers=None, timeout=60):
    req = urllib.request.Request(url, data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read().decode("utf-8"))
    except urllib.error.HTTPError as e:
        body = e.read().decode("utf-8", "replace")
        try:
            return e.code, json.loads(body)
        except ValueError:
            return e.code, {"error": body.strip()[:500]}
    except (urllib.error.URLError, OSError) as e:
        raise CheckError(f"{url}: {e}")
    except ValueError as e:
        raise CheckError(f"{url}: answer is not JSON: {e}")


class Prometheus:
    def __init__(self, url, timeout):
        self.url = url.rstrip("/")
        self.timeout = timeout

    def _call(self, path, params):
        data = urllib.parse.urlencode(params, doseq=True).encode()
        status, body = http_json(self.url + path, data,
                                 {"Content-Type": "application/x-www-form-urlencoded"}, self.timeout)
        if status != 200 or body.get("status") != "success":
            raise CheckError(f"HTTP {status}: {body.get('errorType', '')} {body.get('error', body)}".strip())
        return body

    def query_range(self, expr, start, end, step):
        return self._call("/api/v1/query_range",
                          {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": go_float(step)})

    def query(self, expr, at):
        return self._call("/api/v1/query", {"query": expr, "time": f"{at:.3f}"})

    def label_values(self, label, match, start, end):
        params = {"start": f"{start:.3f}", "end": f"{end:.3f}"}
        if match:
            params["match[]"] = match
        q = urllib.parse.urlencode(params, doseq=True)
        status, body = http_json(f"{self.url}/api/v1/label/{urllib.parse.quote(label)}/values?{q}",
                                 timeout=self.timeout)
        if status != 200 or body.get("status") != "success":
            raise CheckError(f"HTTP {status}: {body.get('error', body)}")
        return body["data"]

    def label_names(self, start, end):
        q = urllib.parse.urlencode({"start": f"{start:.3f}", "end": f"{end:.3f}"})
        status, body = http_json(f"{self.url}/api/v1/labels?{q}", timeout=self.timeout)
        if status != 200:
            raise CheckError(f"HTTP {status}: {body}")
        return body["data"]


class SqlResult:
    def __init__(self, columns, rows):
        self.columns = columns  # names
        self.rows = rows        # lists; None for NULL


class SqlHttp:
    def __init__(self, server, token, timeout):
        self.url = server.rstrip("/") + "/api/v1/sql"
        self.token = token
        self.timeout = timeout

    def run(self, sql):
        headers = {"Accept": "application/json", "Content-Type": "application/sql"}
        if self.token:
            headers["Authorization"] = "Bearer " + self.token
        status, body = http_json(self.url, sql.encode("utf-8"), headers, self.timeout)
        if status != 200:
            raise CheckError(f"HTTP {status}: {body.get('error', '')}: {body.get('detail', '')}")
        if "columns" not in body or "rows" not in body:
            raise CheckError(f"unexpected answer: {str(body)[:300]}")
        return SqlResult([c["name"] if isinstance(c, dict) else c for c in body["columns"]], body["rows"])


class SqlPsql:
    """psql in unaligned mode with a header, unit/record separators and a NULL marker,
    so values with commas or newlines and NULL vs '' are told apart."""

    FS, RS, NULL = "\x1f", "\x1e", "\x1a<NULL>"

    def __init__(self, cmd, timeout):
        self.cmd = shlex.split(cmd)
        self.timeout = timeout
        if not self.cmd or not shutil.which(self.cmd[0]):
            raise ToolMissing(f"{self.cmd[0] if self.cmd else 'psql'} not found on PATH")

    def run(self, sql):
        argv = self.cmd + ["-X", "-q", "-v", "ON_ERROR_STOP=1", "-A", "-F", self.FS, "-R", self.RS,
                           "-P", "footer=off", "-P", f"null={self.NULL}", "-c", sql]
        env = dict(os.environ)
        env.setdefault("PGCONNECT_TIMEOUT", "10")
        try:
            p = subprocess.run(argv, capture_output=True, timeout=self.timeout, env=env)
        except subprocess.TimeoutExpired:
            raise CheckError(f"psql timed out after {self.timeout}s")
        out = p.stdout.decode("utf-8", "replace")
        if p.returncode != 0:
            err = p.stderr.decode("utf-8", "replace").strip()
            raise CheckError(f"psql exit {p.returncode}: {err[:500]}")
        if out.endswith("\n"):
            out = out[:-1]
        if not out:
            return SqlResult([], [])
        records = out.split(self.RS)
        columns = records[0].split(self.FS)
        rows = [[None if v == self.NULL else v for v in r.split(self.FS)] for r in records[1:]]
        return SqlResult(columns, rows)


# --------------------------------------------------------------------------- dashboards

def panels_of(dash):
    for p in dash.get("panels", []):
        yield p
        for sub in p.get("panels", []) or []:
            yield sub


def dashboard_kind(dash):
    inputs = [i for i in dash.get("__inputs", []) if i.get("type") == "datasource"]
    if len(inputs) != 1 or inputs[0].get("name") not in DS_INPUTS:
        return None, None
    name = inputs[0]["name"]
    return DS_INPUTS[name][0], name


def target_query(kind, t):
    return t.get("expr", "") if kind == "prometheus" else t.get("rawSql", "")


def variable_query(var):
    q = var.get("query", "")
    if isinstance(q, dict):
        q = q.get("query", "") or q.get("rawSql", "")
    return q or var.get("definition", "")


def lint(path, dash, seen_uids):
    problems = []
    kind, ds_name = dashboard_kind(dash)
    if kind is None:
        return ["__inputs must declare exactly one datasource input: DS_PROMETHEUS or DS_POSTGRES"]
    plugins = DS_INPUTS[ds_name][1]
    inp = dash["__inputs"][0]
    if inp.get("pluginId") not in plugins:
        problems.append(f"__inputs pluginId {inp.get('pluginId')!r} is not one of {sorted(plugins)}")
    for key in ("title", "uid", "panels", "templating", "time", "schemaVersion"):
        if key not in dash:
            problems.append(f"missing {key}")
    if not isinstance(dash.get("schemaVersion"), int) or dash.get("schemaVersion", 0) < 36:
        problems.append("schemaVersion must be >= 36 (Grafana 9+)")
    uid = dash.get("uid")
    if not uid or len(uid) > 40:
        problems.append("uid missing or longer than 40 characters")
    elif uid in seen_uids:
        problems.append(f"uid {uid} also used by {seen_uids[uid]}")
    else:
        seen_uids[uid] = path
    if dash.get("id") is not None:
        problems.append("id must be null in an importable dashboard")
    ds_uid = "${%s}" % ds_name

    def check_ds(where, ref):
        if not isinstance(ref, dict) or ref.get("uid") != ds_uid or ref.get("type") not in plugins:
            problems.append(f"{where}: datasource must be {{type: {sorted(plugins)[0]}, uid: {ds_uid}}}, got {ref}")

    variables = dash.get("templating", {}).get("list", [])
    defined = set(BUILTIN_VARS)
    for v in variables:
        name = v.get("name")
        if not name:
            problems.append("a variable has no name")
            continue
        if v.get("type") == "query":
            check_ds(f"variable {name}", v.get("datasource"))
            used = referenced_vars(variable_query(v)) - defined
            if kind == "postgres":
                used -= SQL_MACROS
            if used:
                problems.append(f"variable {name} uses undefined (or later) variables {sorted(used)}")
        defined.add(name)
    ids = set()
    for p in panels_of(dash):
        title = p.get("title", "?")
        if p.get("type") not in PANEL_TYPES:
            problems.append(f"panel {title!r}: unknown type {p.get('type')!r}")
        if p.get("id") in ids:
            problems.append(f"panel {title!r}: duplicate id {p.get('id')}")
        ids.add(p.get("id"))
        g = p.get("gridPos", {})
        if not all(isinstance(g.get(k), int) for k in ("h", "w", "x", "y")) or g["x"] + g["w"] > 24:
            problems.append(f"panel {title!r}: bad gridPos {g}")
        if p.get("type") in ("row", "text"):
            continue
        check_ds(f"panel {title!r}", p.get("datasource"))
        targets = p.get("targets") or []
        if not targets:
            problems.append(f"panel {title!r}: no targets")
        refids = set()
        for t in targets:
            ref = t.get("refId")
            if not ref or ref in refids:
                problems.append(f"panel {title!r}: missing or duplicate refId {ref!r}")
            refids.add(ref)
            check_ds(f"panel {title!r} [{ref}]", t.get("datasource"))
            q = target_query(kind, t)
            if not q.strip():
                problems.append(f"panel {title!r} [{ref}]: empty query")
            used = referenced_vars(q) - defined
            if kind == "postgres":
                used -= SQL_MACROS
                for m in MACRO_RE.finditer(q):
                    used.discard(m.group(1))
                    if m.group(1) not in SQL_MACROS:
                        problems.append(f"panel {title!r} [{ref}]: unknown macro ${m.group(1)}")
                if not t.get("rawQuery") or t.get("format") not in ("table", "time_series"):
                    problems.append(f"panel {title!r} [{ref}]: SQL targets need rawQuery: true and format table|time_series")
            if used:
                problems.append(f"panel {title!r} [{ref}]: undefined variables {sorted(used)}")
    return problems


# --------------------------------------------------------------------------- the run

class Checker:
    def __init__(self, args, prom, sql):
        self.args = args
        self.prom = prom
        self.sql = sql
        self.t_from = args.t_from
        self.t_to = args.t_to
        self.range_ms = (self.t_to - self.t_from).total_seconds() * 1000
        self.scrape_ms = parse_duration_ms(args.scrape_interval)
        self.sql_min_ms = parse_duration_ms(args.sql_min_interval)
        self.failures = 0
        self.passes = 0
        self.errors = 0      # failures that are not empty answers (never retried)
        self.empty_names = []
        self.lines = [] if args.buffer else None
        self.var_cache = {}
        self.overrides = dict(kv.split("=", 1) for kv in args.var)

    # -- output
    def out(self, line):
        if self.lines is None:
            print(line, flush=True)
        else:
            self.lines.append(line)

    def report(self, ok, dash_name, what, detail, query=None, empty=False):
        status = "ok  " if ok else "FAIL"
        if ok:
            self.passes += 1
        else:
            self.failures += 1
            if not empty:
                self.errors += 1
            else:
                self.empty_names.append(f"{dash_name} :: {what}")
        self.out(f"{status} {dash_name} :: {what}: {detail}")
        if query is not None and (not ok or self.args.verbose):
            for line in query.strip().splitlines():
                self.out(f"       | {line}")

    # -- intervals
    def interval_ms(self, kind, min_interval, max_data_points):
        auto = round_interval_ms(self.range_ms / max_data_points)
        if min_interval:
            low = parse_duration_ms(min_interval)
        else:
            low = self.scrape_ms if kind == "prometheus" else self.sql_min_ms
        return max(auto, low)

    def builtins(self, kind, interval_ms, scrape_ms=None):
        range_s = round(self.range_ms / 1000)
        env = {
            "__interval": format_interval(interval_ms),
            "__interval_ms": str(int(interval_ms)),
            "__range": f"{range_s}s",
            "__range_s": str(range_s),
            "__range_ms": str(int(self.range_ms)),
            "__from": str(int(epoch_s(self.t_from) * 1000)),
            "__to": str(int(epoch_s(self.t_to) * 1000)),
        }
        if kind == "prometheus":
            # promlib: max(interval + scrape, 4 × scrape) as a Go duration (`1m0s`).
            scrape = scrape_ms or self.scrape_ms
            rate = max(interval_ms + scrape, 4 * scrape)
            env["__rate_interval"] = go_duration(rate)
            env["__rate_interval_ms"] = str(int(rate))
        return env

    # -- variables
    def run_variable(self, kind, dash_name, var, env):
        qtext = variable_query(var)
        vtype = var.get("type")
        if vtype == "custom":
            opts = []
            for part in re.split(r"(?<!\\),", qtext):
                part = part.strip()
                if not part:
                    continue
                opts.append(part.split(" : ", 1)[-1] if " : " in part else part)
            return opts
        if vtype in ("constant", "textbox"):
            return [qtext]
        if vtype == "interval":
            return [o.strip() for o in qtext.split(",") if o.strip()]
        if vtype != "query":
            return None
        missing = sorted(v for v in referenced_vars(qtext)
                         if isinstance(env.get(v), VarValue) and env[v].empty)
        if missing:
            self.report(False, dash_name, f"${var['name']} (variable)",
                        f"not run: {', '.join('$' + m for m in missing)} has no values", qtext, empty=True)
            return []
        interval = self.interval_ms(kind, None, self.args.max_data_points)
        full_env = dict(self.builtins(kind, interval))
        full_env.update(env)
        q = substitute(qtext, full_env, kind)
        key = (dash_name, var["name"], q)
        if key in self.var_cache:
            return self.var_cache[key]
        try:
            if kind == "prometheus":
                values = self.prom_variable(q)
            else:
                q = expand_sql_macros(q, self.t_from, self.t_to, interval)
                res = self.sql.run(q)
                names = [c.lower() for c in res.columns]
                col = names.index("__value") if "__value" in names else 0
                values = [str(r[col]) for r in res.rows if r and r[col] is not None]
            values = self.apply_regex_sort(var, values)
        except CheckError as e:
            self.report(False, dash_name, f"${var['name']} (variable)", str(e), q)
            self.var_cache[key] = []
            return []
        if values:
            shown = ", ".join(values[:6]) + (", …" if len(values) > 6 else "")
            self.report(True, dash_name, f"${var['name']} (variable)", f"{len(values)} values [{shown}]", q)
        else:
            self.report(False, dash_name, f"${var['name']} (variable)", "no values", q, empty=True)
        self.var_cache[key] = values
        return values

    def prom_variable(self, q):
        start, end = epoch_s(self.t_from), epoch_s(self.t_to)
        q = q.strip()
        m = re.fullmatch(r"label_values\((.*)\)", q, re.S)
        if m:
            inner = m.group(1)
            depth, split = 0, -1
            quote = None
            for i, ch in enumerate(inner):
                if quote:
                    if ch == quote and inner[i - 1] != "\\":
                        quote = None
                elif ch in "\"'`":
                    quote = ch
                elif ch in "{(":
                    depth += 1
                elif ch in "})":
                    depth -= 1
                elif ch == "," and depth == 0:
                    split = i
            if split < 0:
                return self.prom.label_values(inner.strip(), None, start, end)
            return self.prom.label_values(inner[split + 1:].strip(), inner[:split].strip(), start, end)
        m = re.fullmatch(r"label_names\(\s*\)", q)
        if m:
            return self.prom.label_names(start, end)
        m = re.fullmatch(r"metrics\((.*)\)", q, re.S)
        if m:
            names = self.prom.label_values("__name__", None, start, end)
            rx = re.compile(m.group(1).strip())
            return [n for n in names if rx.search(n)]
        m = re.fullmatch(r"query_result\((.*)\)", q, re.S)
        if m:
            body = self.prom.query(m.group(1), end)
            out = []
            for s in body["data"]["result"]:
                metric = dict(s.get("metric", {}))
                name = metric.pop("__name__", "")
                labels = ",".join(f'{k}="{v}"' for k, v in metric.items())
                ts, val = s["value"]
                out.append(f"{name}{{{labels}}} {val} {int(float(ts) * 1000)}")
            return out
        raise CheckError(f"unsupported Prometheus variable query {q!r}")

    @staticmethod
    def apply_regex_sort(var, values):
        rx = var.get("regex") or ""
        if rx:
            m = re.fullmatch(r"/(.*)/([gimsuy]*)", rx, re.S)
            flags = re.I if m and "i" in m.group(2) else 0
            pattern = re.compile(m.group(1) if m else rx, flags)
            out = []
            for v in values:
                mm = pattern.search(v)
                if not mm:
                    continue
                gd = mm.groupdict()
                out.append(gd.get("value") or gd.get("text") or (mm.group(1) if mm.groups() else v))
            values = out
        seen, uniq = set(), []
        for v in values:
            if v not in seen:
                seen.add(v)
                uniq.append(v)
        sort = var.get("sort", 0) or 0

        def num(v):
            m = re.search(r"-?\d+(\.\d+)?", v)
            return float(m.group(0)) if m else math.inf

        def natural(v):
            return [int(p) if p.isdigit() else p.lower() for p in re.split(r"(\d+)", v)]

        if sort in (1, 2):
            uniq.sort(reverse=sort == 2)
        elif sort in (3, 4):
            uniq.sort(key=num, reverse=sort == 4)
        elif sort in (5, 6):
            uniq.sort(key=str.lower, reverse=sort == 6)
        elif sort in (7, 8):
            uniq.sort(key=natural, reverse=sort == 8)
        return uniq

    def assignments(self, kind, dash_name, variables, idx=0, env=None):
        """Yields variable environments: "All" for multi/include-all variables, each
        value in turn for single-value ones (first value first)."""
        env = dict(env or {})
        while idx < len(variables) and variables[idx].get("type") in ("datasource", "adhoc"):
            idx += 1
        if idx >= len(variables):
            yield env
            return
        var = variables[idx]
        name = var["name"]
        if name in self.overrides:
            env[name] = VarValue(var, self.overrides[name])
            yield from self.assignments(kind, dash_name, variables, idx + 1, env)
            return
        values = self.run_variable(kind, dash_name, var, env)
        if values is None:
            yield from self.assignments(kind, dash_name, variables, idx + 1, env)
            return
        if not values:
            env[name] = VarValue(var, [] if var.get("multi") or var.get("includeAll") else "", empty=True)
            yield from self.assignments(kind, dash_name, variables, idx + 1, env)
            return
        if var.get("includeAll"):
            if var.get("allValue"):
                env[name] = VarValue(var, var["allValue"], is_all_custom=True)
            else:
                env[name] = VarValue(var, list(values))
            yield from self.assignments(kind, dash_name, variables, idx + 1, env)
            return
        if var.get("multi"):
            env[name] = VarValue(var, values[:1])
            yield from self.assignments(kind, dash_name, variables, idx + 1, env)
            return
        for v in values:
            env[name] = VarValue(var, v)
            yield from self.assignments(kind, dash_name, variables, idx + 1, env)

    # -- targets
    def run_prom_target(self, panel, target, env, seen):
        min_step = target.get("interval") or panel.get("interval")
        mdp = panel.get("maxDataPoints") or self.args.max_data_points
        interval = self.interval_ms("prometheus", min_step, mdp)
        # promlib: the rate interval's "scrape" is the target's own min step, if any.
        scrape = parse_duration_ms(target["interval"]) if target.get("interval") else None
        full_env = self.builtins("prometheus", interval, scrape)
        full_env.update(env)
        expr = substitute(target["expr"], full_env, "prometheus")
        left = [n for n in referenced_vars(expr)]
        if left:
            raise CheckError(f"unresolved variables {left}")
        if expr in seen:
            return None
        seen.add(expr)
        step_s = max(interval / 1000, math.ceil(self.range_ms / 1000 / 11000))
        start = math.floor(epoch_s(self.t_from) / step_s) * step_s
        end = math.floor(epoch_s(self.t_to) / step_s) * step_s
        results = []
        instant = bool(target.get("instant"))
        ranged = bool(target.get("range")) or not instant  # neither set: a range query
        if ranged:
            body = self.prom.query_range(expr, start, end, step_s)
            results.append(("range", body))
        if instant:
            body = self.prom.query(expr, epoch_s(self.t_to))
            results.append(("instant", body))
        details, empty = [], False
        for mode, body in results:
            data = body["data"]
            rtype, res = data["resultType"], data["result"]
            if rtype == "matrix":
                points = [float(v) for s in res for _, v in s["values"]]
            elif rtype == "vector":
                points = [float(s["value"][1]) for s in res]
            elif rtype == "scalar":
                points = [float(res[1])]
                res = [res]
            else:
                points = []
            real = [p for p in points if not math.isnan(p)]
            if not res:
                empty = True
                details.append(f"{mode}: no series")
            elif not real:
                empty = True
                details.append(f"{mode}: {len(res)} series, every value NaN")
            else:
                details.append(f"{mode}: {len(res)} series, {len(points)} points")
            for w in body.get("warnings", []) or []:
                details.append(f"warning: {w}")
        return expr, empty, "; ".join(details)

    def run_sql_target(self, panel, target, env, seen):
        mdp = panel.get("maxDataPoints") or self.args.max_data_points
        interval = self.interval_ms("postgres", target.get("interval") or panel.get("interval"), mdp)
        full_env = self.builtins("postgres", interval)
        full_env.update(env)
        sql = substitute(target["rawSql"], full_env, "postgres")
        sql = expand_sql_macros(sql, self.t_from, self.t_to, interval)
        left = [n for n in referenced_vars(sql)]
        if left:
            raise CheckError(f"unresolved variables {left}")
        if sql in seen:
            return None
        seen.add(sql)
        res = self.sql.run(sql)
        cols = res.columns
        nrows = len(res.rows)
        if not res.rows:
            return sql, True, "0 rows"
        if target.get("format") == "time_series":
            if "time" not in cols:
                raise CheckError(f"time_series target without a 'time' column (columns {cols})")
            ti = cols.index("time")
            times = []
            for r in res.rows:
                v = r[ti]
                if v is None:
                    raise CheckError("NULL in the time column")
                try:
                    times.append(float(v))
                except (TypeError, ValueError):
                    times.append(epoch_s(parse_time(str(v).replace(" ", "T"), self.t_to)))
            if any(b < a for a, b in zip(times, times[1:])):
                raise CheckError("time column not in ascending order (Grafana needs ORDER BY time)")
            value_cols = [i for i, c in enumerate(cols) if c not in ("time", "metric")]
            if not value_cols:
                raise CheckError("time_series target without a value column")
            if not any(r[i] is not None for r in res.rows for i in value_cols):
                return sql, True, f"{nrows} rows, every value NULL"
            return sql, False, f"{nrows} rows × {len(cols)} columns"
        if not any(v is not None for r in res.rows for v in r):
            return sql, True, f"{nrows} rows, every value NULL"
        return sql, False, f"{nrows} rows × {len(cols)} columns"

    def check_dashboard(self, path, dash, kind, label):
        uid = dash.get("uid")
        variables = dash.get("templating", {}).get("list", [])
        targets = []
        for p in panels_of(dash):
            if p.get("type") in ("row", "text"):
                continue
            for t in p.get("targets") or []:
                if t.get("hide"):
                    self.out(f"skip {label} :: {p.get('title')} [{t.get('refId')}]: hidden target")
                    continue
                targets.append((p, t))
        combos = []
        gen = self.assignments(kind, label, variables)
        for env in itertools.islice(gen, self.args.max_combinations):
            combos.append(env)
        if not combos:
            combos = [{}]
        for p, t in targets:
            what = f"{p.get('title')} [{t.get('refId')}]"
            allowed = ALLOWED_EMPTY.get((uid, p.get("title"), t.get("refId")))
            last = None
            ok = False
            seen = set()
            for n, env in enumerate(combos):
                try:
                    missing = sorted(v for v in referenced_vars(target_query(kind, t))
                                     if isinstance(env.get(v), VarValue) and env[v].empty)
                    if missing:
                        raise EmptyVariable(", ".join("$" + v for v in missing))
                    if kind == "prometheus":
                        answer = self.run_prom_target(p, t, env, seen)
                    else:
                        answer = self.run_sql_target(p, t, env, seen)
                    if answer is None:
                        continue  # this combination expands to a query already run
                    q, empty, detail = answer
                except EmptyVariable as e:
                    last = (target_query(kind, t), f"not run: {e} has no values", env)
                    continue
                except CheckError as e:
                    qtext = target_query(kind, t)
                    self.report(False, label, what, f"error: {e}" + self.vars_note(env, variables), qtext)
                    last = "error"
                    break
                last = (q, detail, env)
                if not empty:
                    note = self.vars_note(env, variables) if n else ""
                    self.report(True, label, what, detail + note, q)
                    ok = True
                    break
            if ok or last == "error":
                continue
            q, detail, env = last
            tried = f" (tried {len(seen)} variable combinations)" if len(seen) > 1 else ""
            if allowed:
                self.report(True, label, what, f"empty, allowed: {allowed}")
            else:
                self.report(False, label, what, f"empty answer: {detail}{tried}", q, empty=True)

    @staticmethod
    def vars_note(env, variables):
        single = [v["name"] for v in variables
                  if v.get("type") == "query" and not v.get("multi") and not v.get("includeAll")]
        parts = [f"{n}={env[n].describe()}" for n in single if n in env]
        return f" (with {', '.join(parts)})" if parts else ""


def collect(paths):
    files = []
    for p in paths:
        if os.path.isdir(p):
            files.extend(sorted(glob.glob(os.path.join(p, "*.json"))))
        else:
            files.append(p)
    return files


def main():
    ap = argparse.ArgumentParser(
        description="Run every query of Grafana dashboards against Prometheus and Apron's SQL.",
        epilog="See the module docstring (and dashboards/grafana/README.md) for the expansions.")
    ap.add_argument("dashboards", nargs="+", help="dashboard JSON files or directories of them")
    ap.add_argument("--prometheus", help="Prometheus base URL (needed by DS_PROMETHEUS dashboards)")
    ap.add_argument("--sql-mode", choices=["http", "psql"], help="how to run SQL (needed by DS_POSTGRES dashboards)")
    ap.add_argument("--server", default="http://127.0.0.1:9402", help="apron server base URL for --sql-mode http")
    ap.add_argument("--token", default=os.environ.get("APRON_SQL_TOKEN"),
                    help="bearer token for POST /api/v1/sql (apron serve); env APRON_SQL_TOKEN")
    ap.add_argument("--psql-cmd", default="psql -h 127.0.0.1 -p 5433 -U apron -d apron",
                    help="psql command line for --sql-mode psql")
    ap.add_argument("--from", dest="t_from", required=True, help="range start: RFC 3339 or now-<duration>")
    ap.add_argument("--to", dest="t_to", required=True, help="range end: RFC 3339 or now")
    ap.add_argument("--scrape-interval", default="15s",
                    help="the Prometheus datasource's scrape interval (Grafana's default 15s)")
    ap.add_argument("--sql-min-interval", default="1m",
                    help="the SQL datasource's min time interval (Grafana's default 1m)")
    ap.add_argument("--max-data-points", type=int, default=1000,
                    help="Grafana's max data points (about a panel's width in pixels)")
    ap.add_argument("--max-combinations", type=int, default=64,
                    help="at most this many values of single-value variables are tried")
    ap.add_argument("--var", action="append", default=[], metavar="NAME=VALUE",
                    help="fix a variable's value instead of running its query")
    ap.add_argument("--timeout", type=float, default=60, help="seconds per query")
    ap.add_argument("--retry-empty-for", default="0s", metavar="DURATION",
                    help="while some answers are empty (and none is an error), run everything "
                         "again every 5 s for up to this long, re-reading now-relative --from/--to; "
                         "for a freshly started system whose ledger and alert passes have not run yet")
    ap.add_argument("--lint-only", action="store_true", help="only check the dashboards' shape")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every expanded query")
    args = ap.parse_args()

    now = dt.datetime.now(dt.timezone.utc)
    from_text, to_text = args.t_from, args.t_to
    try:
        args.t_from = parse_time(from_text, now)
        args.t_to = parse_time(to_text, now)
        retry_s = parse_duration_ms(args.retry_empty_for) / 1000
        parse_duration_ms(args.scrape_interval)
        parse_duration_ms(args.sql_min_interval)
        for kv in args.var:
            if "=" not in kv:
                raise ValueError(f"--var {kv!r}: expected NAME=VALUE")
    except ValueError as e:
        print(f"check.py: {e}", file=sys.stderr)
        return 2
    if args.t_to <= args.t_from:
        print("check.py: --to must be after --from", file=sys.stderr)
        return 2

    files = collect(args.dashboards)
    if not files:
        print("check.py: no dashboards found", file=sys.stderr)
        return 2

    loaded, seen_uids, lint_failures = [], {}, 0
    for f in files:
        label = os.path.join(os.path.basename(os.path.dirname(f)), os.path.basename(f))
        try:
            with open(f, encoding="utf-8") as fh:
                dash = json.load(fh)
        except (OSError, ValueError) as e:
            print(f"FAIL {label} :: load: {e}")
            lint_failures += 1
            continue
        problems = lint(f, dash, seen_uids)
        for pr in problems:
            print(f"FAIL {label} :: lint: {pr}")
        if problems:
            lint_failures += len(problems)
            continue
        print(f"ok   {label} :: lint: {sum(1 for p in panels_of(dash) if p.get('type') != 'row')} panels")
        loaded.append((f, label, dash, dashboard_kind(dash)[0]))
    if args.lint_only:
        print(f"\n{len(files)} dashboards linted, {lint_failures} problems")
        return 1 if lint_failures else 0

    kinds = {k for _, _, _, k in loaded}
    prom = sql = None
    if "prometheus" in kinds:
        if not args.prometheus:
            print("check.py: Prometheus dashboards need --prometheus URL", file=sys.stderr)
            return 2
        prom = Prometheus(args.prometheus, args.timeout)
    if "postgres" in kinds:
        if not args.sql_mode:
            print("check.py: SQL dashboards need --sql-mode http|psql", file=sys.stderr)
            return 2
        try:
            sql = SqlHttp(args.server, args.token, args.timeout) if args.sql_mode == "http" \
                else SqlPsql(args.psql_cmd, args.timeout)
        except ToolMissing as e:
            print(f"check.py: {e}", file=sys.stderr)
            return 2

    args.buffer = retry_s > 0
    deadline = time.monotonic() + retry_s
    attempt = 1
    while True:
        checker = Checker(args, prom, sql)
        checker.failures += lint_failures
        checker.errors += lint_failures
        checker.out(f"range {rfc3339nano(args.t_from)} .. {rfc3339nano(args.t_to)}")
        for f, label, dash, kind in loaded:
            checker.check_dashboard(f, dash, kind, label)
        if checker.failures == 0 or checker.errors or time.monotonic() + 5 > deadline:
            break
        names = "; ".join(checker.empty_names[:3]) + (" …" if len(checker.empty_names) > 3 else "")
        print(f"attempt {attempt}: {checker.failures} empty answers ({names}); retrying in 5 s", flush=True)
        time.sleep(5)
        attempt += 1
        now = dt.datetime.now(dt.timezone.utc)
        args.t_from = parse_time(from_text, now)
        args.t_to = parse_time(to_text, now)
    for line in checker.lines or []:
        print(line)
    total = checker.passes + checker.failures
    print(f"\n{total} checks, {checker.passes} ok, {checker.failures} failed")
    return 1 if checker.failures else 0


if __name__ == "__main__":
    sys.exit(main())
