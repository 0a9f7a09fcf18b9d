#!/usr/bin/env python3
"""The storage benchmark's two queries, timed the same way on every system.

    queries.py apron URL TOKEN META RUNS      POST /api/v1/sql (JSON) to `apron serve`
    queries.py prom  URL META RUNS            Prometheus HTTP API (PromQL)
    queries.py vm    URL META RUNS            VictoriaMetrics HTTP API (MetricsQL = PromQL here)
    queries.py duckdb DBFILE META RUNS        DuckDB, in this process

Queries (docs/benchmarks.md, "Storage"):
  hourly  per-GPU hourly mean of gpu_util over the whole span. SQL buckets
          date_trunc('hour', time); PromQL evaluates avg_over_time(apron_gpu_util[1h])
          (Prometheus 2.x: [3599s], its ranges include the left end) at the last second
          of each hour bucket (H + 3599 s), which on the 1 s grid covers exactly the
          samples of [H, H + 1h), so the results are the same numbers. SQL also returns
          a (NULL) row for a GPU-hour without values; PromQL returns no point.
  scan    the mean of every measurement over everything. SQL: one SELECT avg(c) per
          column. PromQL has no single query for it (the range functions drop
          __name__ and `sum by (__name__)` cannot group them), so one instant query per
          metric, avg(avg_over_time(m[span])) at the end, all timed together; this is the
          mean of per-series means, equal to the SQL mean where every series has the same
          number of samples.

Each query runs RUNS times; prints JSON: first, median and min seconds, plus a checksum
(points, sum) so the systems can be seen to answer the same thing.
"""

import http.client
import json
import statistics
import sys
import time
import urllib.parse


def load_meta(path):
    with open(path) as f:
        return json.load(f)


def hourly_sql():
    return (
        "SELECT gpu_uuid, date_trunc('hour', time) AS hour, avg(gpu_util) AS mean "
        "FROM gpu_samples GROUP BY 1, 2 ORDER BY 1, 2"
    )


def scan_sql(meta):
    cols = ", ".join(f"avg({c['column']}) AS {c['column']}" for c in meta["columns"])
    return f"SELECT {cols} FROM gpu_samples"


def time_runs(fn, runs):
    times, check = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        check = fn()
        times.append(time.perf_counter() - t0)
    return {
        "first_s": times[0],
        "median_s": statistics.median(times),
        "min_s": min(times),
        "runs": runs,
        "points": check[0],
        "sum": check[1],
    }


def numbers(values):
    out = []
    for v in values:
        if v is None:
            continue
        out.append(float(v))
    return out


class Http:
    def __init__(self, url):
        u = urllib.parse.urlsplit(url)
        self.host, self.port = u.hostname, u.port
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=600)

    def request(self, method, path, body=None, headers=None):
        self.conn.request(method, path, body=body, headers=headers or {})
        r = self.conn.getresponse()
        data = r.read()
        if r.status != 200:
            raise SystemExit(f"{method} {path}: {r.status} {data[:500]!r}")
        return data


def apron(url, token, meta, runs):
    h = Http(url)
    headers = {"Authorization": f"Bearer {token}", "Accept": "application/json", "Content-Type": "text/plain"}

    def run(sql, summarise):
        def f():
            doc = json.loads(h.request("POST", "/api/v1/sql", sql.encode(), headers))
            return summarise(doc["rows"])

        return f

    hourly = run(hourly_sql(), lambda rows: (len(rows), sum(numbers(r[2] for r in rows))))
    scan = run(scan_sql(meta), lambda rows: (len(rows[0]), sum(numbers(rows[0]))))
    return {"hourly": time_runs(hourly, runs), "scan": time_runs(scan, runs)}


def promql(url, meta, runs, extra, hour_range):
    h = Http(url)
    span = int(round(meta["last_time_s"] - meta["start_s"]))
    end = int(meta["last_time_s"])
    first_hour = int(meta["first_time_s"]) // 3600 * 3600
    last_hour = end // 3600 * 3600

    def get(path, params):
        q = urllib.parse.urlencode({**params, **extra})
        doc = json.loads(h.request("GET", f"{path}?{q}"))
        if doc.get("status") != "success":
            raise SystemExit(f"{path}: {doc}")
        return doc["data"]["result"]

    def hourly():
        res = get(
            "/api/v1/query_range",
            {
                "query": f"avg_over_time(apron_gpu_util[{hour_range}])",
                "start": first_hour + 3599,
                "end": last_hour + 3599,
                "step": 3600,
            },
        )
        vals = [float(v[1]) for s in res for v in s["values"]]
        return len(vals), sum(vals)

    def scan():
        total, n = 0.0, 0
        for c in meta["columns"]:
            res = get("/api/v1/query", {"query": f"avg(avg_over_time({c['metric']}[{span}s]))", "time": end})
            for s in res:
                total += float(s["value"][1])
                n += 1
        return n, total

    return {"hourly": time_runs(hourly, runs), "scan": time_runs(scan, runs)}


def duck(dbfile, meta, runs):
    import duckdb

    con = duckdb.connect(dbfile, read_only=True)
    con.execute("SET TimeZone = 'UTC'")

    def hourly():
        rows = con.execute(hourly_sql()).fetchall()
        return len(rows), sum(numbers(r[2] for r in rows))

    def scan():
        row = con.execute(scan_sql(meta)).fetchone()
        return len(row), sum(numbers(row))

    return {"hourly": time_runs(hourly, runs), "scan": time_runs(scan, runs)}


def main():
    kind = sys.argv[1]
    if kind == "apron":
        url, token, meta, runs = sys.argv[2], sys.argv[3], load_meta(sys.argv[4]), int(sys.argv[5])
        out = apron(url, token, meta, runs)
    elif kind == "prom":
        # Prometheus 2.x range selectors are closed at both ends ([t - d, t]; 3.0 made them
        # left-open): 3599s holds the same 3600 one-second samples as (t - 1h, t].
        out = promql(sys.argv[2], load_meta(sys.argv[3]), int(sys.argv[4]), {}, "3599s")
    elif kind == "vm":
        # nocache: VictoriaMetrics would otherwise answer repeated range queries from its cache.
        out = promql(sys.argv[2], load_meta(sys.argv[3]), int(sys.argv[4]), {"nocache": "1"}, "1h")
    elif kind == "duckdb":
        out = duck(sys.argv[2], load_meta(sys.argv[3]), int(sys.argv[4]))
    else:
        raise SystemExit(f"unknown system {kind}")
    json.dump(out, sys.stdout)
    print()


if __name__ == "__main__":
    main()
