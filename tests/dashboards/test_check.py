#!/usr/bin/env python3
"""Unit tests for check.py's Grafana emulation, with no backend (stdlib unittest).

    python3 tests/dashboards/test_check.py        # or: python3 -m unittest discover tests/dashboards

Pins the expansions check.py documents (Grafana's PostgreSQL macros, interval
rounding, $__rate_interval, variable formats), the empty-answer rules against stub
backends, and that dashboards/grafana/*.json are what generate.py writes.
"""

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import check  # noqa: E402

UTC = dt.timezone.utc
FROM = dt.datetime(2026, 12, 2, 17, 0, 0, tzinfo=UTC)
TO = dt.datetime(2026, 12, 2, 20, 0, 0, 250000, tzinfo=UTC)


class Formats(unittest.TestCase):
    def test_rfc3339nano_like_go(self):
        self.assertEqual(check.rfc3339nano(FROM), "2026-12-02T17:00:00Z")
        self.assertEqual(check.rfc3339nano(TO), "2026-12-02T20:00:00.25Z")

    def test_go_float(self):
        self.assertEqual(check.go_float(3600.0), "3600")
        self.assertEqual(check.go_float(0.5), "0.5")
        self.assertEqual(check.go_float(60), "60")

    def test_go_duration(self):
        self.assertEqual(check.go_duration(8000), "8s")
        self.assertEqual(check.go_duration(60000), "1m0s")
        self.assertEqual(check.go_duration(62000), "1m2s")
        self.assertEqual(check.go_duration(3_600_000), "1h0m0s")
        self.assertEqual(check.go_duration(500), "500ms")

    def test_interval_rounding_and_text(self):
        self.assertEqual(check.round_interval_ms(10_800), 10_000)   # 3 h / 1000 points
        self.assertEqual(check.round_interval_ms(21_600), 20_000)
        self.assertEqual(check.round_interval_ms(86_400), 60_000)
        self.assertEqual(check.format_interval(60_000), "1m")
        self.assertEqual(check.format_interval(3_600_000), "1h")
        self.assertEqual(check.format_interval(500), "500ms")

    def test_parse_time(self):
        now = dt.datetime(2026, 12, 2, 20, 0, tzinfo=UTC)
        self.assertEqual(check.parse_time("now-3h", now), now - dt.timedelta(hours=3))
        self.assertEqual(check.parse_time("2026-12-02T17:00:00Z", now), FROM)
        self.assertEqual(check.parse_time("2026-12-02T18:00:00+01:00", now), FROM)
        with self.assertRaises(ValueError):
            check.parse_time("2026-12-02T17:00:00", now)


class SqlMacros(unittest.TestCase):
    def expand(self, sql, interval_ms=60_000):
        return check.expand_sql_macros(sql, FROM, TO, interval_ms)

    def test_time_filter_from_to(self):
        self.assertEqual(self.expand("WHERE $__timeFilter(time)"),
                         "WHERE time BETWEEN '2026-12-02T17:00:00Z' AND '2026-12-02T20:00:00.25Z'")
        self.assertEqual(self.expand("$__timeFrom() $__timeTo()"),
                         "'2026-12-02T17:00:00Z' '2026-12-02T20:00:00.25Z'")

    def test_time_group(self):
        self.assertEqual(self.expand("SELECT $__timeGroupAlias(time, $__interval)"),
                         'SELECT floor(extract(epoch from time)/60)*60 AS "time"')
        self.assertEqual(self.expand("GROUP BY $__timeGroup(hour, '1h')"),
                         "GROUP BY floor(extract(epoch from hour)/3600)*3600")
        # Grafana < 5.3 compatibility: a comma right after $__timeGroup adds the alias.
        self.assertEqual(self.expand("SELECT $__timeGroup(t, 5m), v"),
                         'SELECT floor(extract(epoch from t)/300)*300 AS "time", v')
        self.assertEqual(self.expand("$__timeGroupAlias(t, 1m, previous)"),
                         'floor(extract(epoch from t)/60)*60 AS "time"')

    def test_epoch_macros(self):
        self.assertEqual(self.expand("$__unixEpochFilter(ts)"), "ts >= 1796230800 AND ts <= 1796241600")
        self.assertEqual(self.expand("$__unixEpochFrom() $__unixEpochTo()"), "1796230800 1796241600")
        self.assertEqual(self.expand("$__unixEpochGroupAlias(ts, 1h)"), 'floor((ts)/3600)*3600 AS "time"')
        self.assertEqual(self.expand("$__time(c), $__timeEpoch(c)"), 'c AS "time", extract(epoch from c) as "time"')
        self.assertEqual(self.expand("$__interval_ms"), "60000")

    def test_comments_are_dropped_but_not_strings(self):
        self.assertEqual(self.expand("SELECT '--x' -- $__nope(y)\n, 1 /* $__nope() */"),
                         "SELECT '--x' \n, 1 ")

    def test_errors(self):
        with self.assertRaisesRegex(check.CheckError, "unknown macro"):
            self.expand("$__nope(x)")
        with self.assertRaisesRegex(check.CheckError, "needs time column"):
            self.expand("$__timeGroup(x)")
        with self.assertRaisesRegex(check.CheckError, "positive"):
            self.expand("$__timeGroup(x, 0s)")


class Variables(unittest.TestCase):
    def var(self, multi, include_all=False, all_value=None):
        v = {"name": "v", "multi": multi, "includeAll": include_all}
        if all_value:
            v["allValue"] = all_value
        return v

    def test_prometheus(self):
        single = check.VarValue(self.var(False), "GPU-1")
        multi = check.VarValue(self.var(True, True), ["a.b", "c"])
        all_custom = check.VarValue(self.var(True, True, ".*"), ".*", is_all_custom=True)
        env = {"g": single, "h": multi, "a": all_custom}
        self.assertEqual(check.substitute('x{u="$g",h=~"${h}",a=~"$a"}', env, "prometheus"),
                         'x{u="GPU-1",h=~"(a\\\\.b|c)",a=~".*"}')

    def test_sql(self):
        single = check.VarValue(self.var(False), "o'neil")
        multi = check.VarValue(self.var(True, True), ["a", "b'c"])
        env = {"s": single, "m": multi}
        self.assertEqual(check.substitute("x = '$s' AND y IN ($m) AND z IN (${m:singlequote})", env, "postgres"),
                         "x = 'o''neil' AND y IN ('a','b''c') AND z IN ('a','b''c')")
        self.assertEqual(check.substitute("$__timeFilter(time) $unknown", env, "postgres"),
                         "$__timeFilter(time) $unknown")

    def test_regex_and_sort(self):
        var = {"regex": '/gpu_uuid="([^"]+)"/', "sort": 1}
        values = ['apron_gpu_info{gpu_uuid="b"} 1 0', 'apron_gpu_info{gpu_uuid="a"} 1 0', "other"]
        self.assertEqual(check.Checker.apply_regex_sort(var, values), ["a", "b"])
        self.assertEqual(check.Checker.apply_regex_sort({"sort": 7}, ["n10", "n9"]), ["n9", "n10"])


# --------------------------------------------------------------------------- stub backends

class StubProm:
    """Answers from a dict expr-substring -> result list; records queries."""

    def __init__(self, answers):
        self.answers = answers
        self.queries = []

    def _result(self, expr):
        self.queries.append(expr)
        for key, res in self.answers.items():
            if key in expr:
                if isinstance(res, Exception):
                    raise res
                return res
        return []

    def query_range(self, expr, start, end, step):
        res = self._result(expr)
        return {"data": {"resultType": "matrix",
                         "result": [{"metric": m, "values": [[start, v]]} for m, v in res]}}

    def query(self, expr, at):
        res = self._result(expr)
        return {"data": {"resultType": "vector", "result": [{"metric": m, "value": [at, v]} for m, v in res]}}

    def label_values(self, label, match, start, end):
        self.queries.append(f"label_values({match}, {label})")
        return {"hostname": ["h1", "h2"], "gpu_uuid": ["G-a100", "G-h100"]}[label]

    def label_names(self, start, end):
        return []


class StubSql:
    def __init__(self, answers):
        self.answers = answers
        self.queries = []

    def run(self, sql):
        self.queries.append(sql)
        for key, res in self.answers.items():
            if key in sql:
                if isinstance(res, Exception):
                    raise res
                return check.SqlResult(*res)
        return check.SqlResult(["x"], [])


def args(**kw):
    a = argparse.Namespace(t_from=FROM, t_to=TO, scrape_interval="15s", sql_min_interval="1m",
                           max_data_points=1000, max_combinations=64, var=[], verbose=False,
                           buffer=True)
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def board(kind, targets, variables=()):
    ds = {"type": "prometheus" if kind == "prometheus" else "grafana-postgresql-datasource",
          "uid": "${DS_PROMETHEUS}" if kind == "prometheus" else "${DS_POSTGRES}"}
    panels = []
    for i, (title, t) in enumerate(targets):
        t = dict(t, refId="A", datasource=ds)
        panels.append({"type": "timeseries", "title": title, "id": i + 1, "datasource": ds,
                       "gridPos": {"h": 4, "w": 24, "x": 0, "y": 4 * i}, "targets": [t]})
    return {"uid": "u", "panels": panels, "templating": {"list": list(variables)}}


def run_board(kind, dash, prom=None, sql=None, **kw):
    c = check.Checker(args(**kw), prom, sql)
    c.check_dashboard("x.json", dash, kind, "x.json")
    return c


class EmptyAnswers(unittest.TestCase):
    def test_prometheus_empty_nan_and_error(self):
        prom = StubProm({"ok_metric": [({"a": "1"}, "1")], "nan_metric": [({}, "NaN")],
                         "bad": check.CheckError("HTTP 400: bad_data")})
        dash = board("prometheus", [("ok", {"expr": "ok_metric"}), ("empty", {"expr": "missing"}),
                                    ("nan", {"expr": "nan_metric", "instant": True}),
                                    ("bad", {"expr": "bad("})])
        c = run_board("prometheus", dash, prom=prom)
        self.assertEqual((c.passes, c.failures, c.errors), (1, 3, 1), "\n".join(c.lines))
        self.assertIn("every value NaN", "\n".join(c.lines))

    def test_rate_interval_and_step(self):
        prom = StubProm({"x": [({}, "1")]})
        dash = board("prometheus", [("r", {"expr": "rate(x[$__rate_interval]) $__interval $__range"})])
        run_board("prometheus", dash, prom=prom, scrape_interval="1s")
        # 3 h / 1000 = 10.8 s -> 10 s; rate = max(10 s + 1 s, 4 s) = 11 s.
        self.assertEqual(prom.queries, ["rate(x[11s]) 10s 10800s"])

    def test_single_value_variable_falls_back_to_later_values(self):
        prom = StubProm({'gpu_uuid="G-h100"': [({}, "0.5")]})
        gpu = {"name": "gpu", "type": "query", "multi": False, "includeAll": False,
               "query": {"query": "label_values(apron_gpu_info, gpu_uuid)"}, "sort": 1}
        dash = board("prometheus", [("gpm", {"expr": 'sm{gpu_uuid="$gpu"}'}),
                                    ("static", {"expr": "missing"})], [gpu])
        c = run_board("prometheus", dash, prom=prom)
        out = "\n".join(c.lines)
        self.assertEqual((c.passes, c.failures), (2, 1), out)  # variable + gpm ok; static empty
        self.assertIn("with gpu=G-h100", out)
        # the target that does not use the variable ran once, not once per value
        self.assertEqual(sum(1 for q in prom.queries if q == "missing"), 1)

    def test_allowed_empty(self):
        prom = StubProm({})
        dash = board("prometheus", [("lost", {"expr": "lost"})])
        check.ALLOWED_EMPTY[("u", "lost", "A")] = "test"
        try:
            c = run_board("prometheus", dash, prom=prom)
        finally:
            del check.ALLOWED_EMPTY[("u", "lost", "A")]
        self.assertEqual((c.passes, c.failures), (1, 0))

    def test_sql_rules(self):
        sql = StubSql({
            "good_ts": (["time", "metric", "value"], [[1.0, "a", 1], [2.0, "a", None]]),
            "null_ts": (["time", "value"], [[1.0, None]]),
            "unordered": (["time", "value"], [[2.0, 1], [1.0, 1]]),
            "notime": (["value"], [[1]]),
            "nulls": (["a", "b"], [[None, None]]),
            "table": (["a"], [["x"]]),
            "broken": check.CheckError("HTTP 400: invalid query"),
        })
        ts = lambda s: {"rawSql": s, "rawQuery": True, "format": "time_series"}  # noqa: E731
        tb = lambda s: {"rawSql": s, "rawQuery": True, "format": "table"}  # noqa: E731
        dash = board("postgres", [("1", ts("good_ts $__timeFilter(time)")), ("2", ts("null_ts")),
                                  ("3", ts("unordered")), ("4", ts("notime")), ("5", tb("nulls")),
                                  ("6", tb("table")), ("7", tb("broken")), ("8", tb("nothing"))])
        c = run_board("postgres", dash, sql=sql)
        out = "\n".join(c.lines)
        self.assertEqual((c.passes, c.failures), (2, 6), out)
        self.assertIn("time BETWEEN '2026-12-02T17:00:00Z' AND '2026-12-02T20:00:00.25Z'", sql.queries[0])

    def test_sql_variables_all_values_quoted(self):
        sql = StubSql({"DISTINCT team": (["team"], [["b"], ["a"]]),
                       "IN ('a','b')": (["v"], [[1]])})
        team = {"name": "team", "type": "query", "multi": True, "includeAll": True, "sort": 1,
                "query": "SELECT DISTINCT team FROM gpu_cost_hourly"}
        dash = board("postgres", [("t", {"rawSql": "SELECT 1 WHERE team IN ($team)", "rawQuery": True,
                                         "format": "table"})], [team])
        c = run_board("postgres", dash, sql=sql)
        self.assertEqual((c.passes, c.failures), (2, 0), "\n".join(c.lines))


class EmptyVariables(unittest.TestCase):
    def test_targets_using_an_empty_variable_are_empty_not_errors(self):
        sql = StubSql({"DISTINCT host": (["host"], [])})
        host = {"name": "host", "type": "query", "multi": True, "includeAll": True,
                "query": "SELECT DISTINCT host FROM t"}
        model = {"name": "model", "type": "query", "multi": True, "includeAll": True,
                 "query": "SELECT DISTINCT m FROM t WHERE host IN ($host)"}
        dash = board("postgres", [("p", {"rawSql": "SELECT 1 WHERE host IN ($host)", "rawQuery": True,
                                         "format": "table"})], [host, model])
        c = run_board("postgres", dash, sql=sql)
        out = "\n".join(c.lines)
        self.assertEqual((c.failures, c.errors), (3, 0), out)
        self.assertEqual(sql.queries, ["SELECT DISTINCT host FROM t"])  # nothing ran with IN ()
        self.assertIn("not run: $host has no values", out)


class CommittedDashboards(unittest.TestCase):
    def test_generated_files_are_current(self):
        p = subprocess.run([sys.executable, os.path.join(ROOT, "dashboards/grafana/generate.py"), "--check"],
                           capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)

    def test_lint_passes(self):
        seen = {}
        for sub in ("prometheus", "postgres"):
            d = os.path.join(ROOT, "dashboards/grafana", sub)
            names = sorted(os.listdir(d))
            self.assertEqual(names, ["fleet-overview.json", "gpu-detail.json", "idle-cost-by-team.json",
                                     "stranded-allocations.json"])
            for n in names:
                with open(os.path.join(d, n), encoding="utf-8") as fh:
                    dash = json.load(fh)
                self.assertEqual(check.lint(n, dash, seen), [], f"{sub}/{n}")

    def test_cli_usage_errors_exit_2(self):
        p = subprocess.run([sys.executable, os.path.join(HERE, "check.py"), "--sql-mode", "psql",
                            "--psql-cmd", "no-such-psql-binary", "--from", "now-1h", "--to", "now",
                            os.path.join(ROOT, "dashboards/grafana/postgres")],
                           capture_output=True, text=True)
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn("not found", p.stderr)


if __name__ == "__main__":
    unittest.main()
