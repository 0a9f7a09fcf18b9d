#!/usr/bin/env python3
"""Prints the storage benchmark's table from OUT/results.txt and OUT/*.queries.json.

    report.py OUT

results.txt holds `key value` lines written by scripts/bench-storage.sh. Ratios are
Apron / peer: below 1 means Apron is smaller or faster for bytes, seconds and RSS;
above 1 means Apron ingests faster for values/s.
"""

import json
import os
import sys

SYSTEMS = [("apron", "Apron"), ("prom", "Prometheus"), ("vm", "VictoriaMetrics"), ("duckdb", "DuckDB")]


def main():
    out = sys.argv[1]
    r = {}
    with open(os.path.join(out, "results.txt")) as f:
        for line in f:
            parts = line.split(None, 1)
            if len(parts) == 2:
                r[parts[0]] = parts[1].strip()
    with open(os.path.join(out, "meta.json")) as f:
        meta = json.load(f)
    q = {}
    for s, _ in SYSTEMS:
        p = os.path.join(out, f"{s}.queries.json")
        if os.path.exists(p):
            with open(p) as f:
                q[s] = json.load(f)
    values = meta["values"]

    def num(key):
        v = r.get(key)
        try:
            return float(v) if v is not None else None
        except ValueError:
            return None

    rows = []  # (label, better, {system: value}, fmt)

    def row(label, better, get, fmt):
        rows.append((label, better, {s: get(s) for s, _ in SYSTEMS}, fmt))

    row("disk bytes", "lower", lambda s: num(f"{s}.bytes"), "{:,.0f}")
    row("bytes/value", "lower", lambda s: num(f"{s}.bytes") / values if num(f"{s}.bytes") else None, "{:.3f}")
    row("ingest s", "lower", lambda s: num(f"{s}.ingest_s"), "{:.2f}")
    row("ingest values/s", "higher", lambda s: values / num(f"{s}.ingest_s") if num(f"{s}.ingest_s") else None,
        "{:,.0f}")
    row("ingest peak RSS MiB", "lower", lambda s: num(f"{s}.rss_kb") / 1024 if num(f"{s}.rss_kb") else None, "{:.1f}")
    for name, label in (("hourly", "hourly query ms (median)"), ("scan", "full scan ms (median)")):
        row(label, "lower", lambda s, n=name: q[s][n]["median_s"] * 1000 if s in q else None, "{:.1f}")
    for name, label in (("hourly", "hourly query ms (first)"), ("scan", "full scan ms (first)")):
        row(label, "lower", lambda s, n=name: q[s][n]["first_s"] * 1000 if s in q else None, "{:.1f}")
    row("query process RSS MiB", "lower",
        lambda s: num(f"{s}.query_rss_kb") / 1024 if num(f"{s}.query_rss_kb") else None, "{:.1f}")

    head = ["measure", "better"] + [n for _, n in SYSTEMS] + ["Apron/Prom", "Apron/VM", "Apron/DuckDB"]
    table = []
    for label, better, vals, fmt in rows:
        line = [label, better]
        for s, _ in SYSTEMS:
            line.append(fmt.format(vals[s]) if vals[s] is not None else "-")
        a = vals["apron"]
        for s in ("prom", "vm", "duckdb"):
            line.append(f"{a / vals[s]:.3f}" if a is not None and vals[s] else "-")
        table.append(line)
    widths = [max(len(str(x[i])) for x in [head] + table) for i in range(len(head))]
    fmt_line = lambda cells: "| " + " | ".join(str(c).rjust(w) if i > 1 else str(c).ljust(w)
                                               for i, (c, w) in enumerate(zip(cells, widths))) + " |"
    print(f"dataset: {meta['gpus']} GPUs x {meta['hours']} h at {meta['window_s']} s windows: "
          f"{meta['rows']:,} rows, {values:,} values (non-NULL measurement cells), {meta['series']:,} series, "
          f"{len(meta['columns'])} measurement columns")
    print(fmt_line(head))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for line in table:
        print(fmt_line(line))
    print()
    print("checksums (points, sum) — the same data answers the same:")
    for s, n in SYSTEMS:
        if s in q:
            h, c = q[s]["hourly"], q[s]["scan"]
            print(f"  {n:16} hourly {h['points']:6d} {h['sum']:.6f}   scan {c['points']:3d} {c['sum']:.6f}")
    notes = [k for k in r if k.endswith(".note")]
    for k in sorted(notes):
        print(f"  {k}: {r[k]}")


if __name__ == "__main__":
    main()
