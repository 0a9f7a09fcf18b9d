#!/usr/bin/env python3
"""Checks a chaos run (scripts/chaos.sh, scripts/chaos/run.py): every acknowledged
gpu_samples row is stored exactly once and every Parquet file reads.

Produced rows come from each agent instance's windows_out file, keyed by
(host, gpu_uuid, time). The agent writes a window to windows_out (write + flush, so it
survives SIGKILL) *before* it hands the window to the shipper, so windows_out is a
superset of what was ever shipped. Stored rows come from two independent views:

  sql      POST /api/v1/sql on the running collector after the drain (memtable + files)
  parquet  the live Parquet files of gpu_samples after the collector's clean shutdown
           (every *.parquet, minus the inputs of a committed compaction named in the
           partition's .compaction.json; those stay on disk for superseded_grace)

Rules (any violation fails the run):
  - no stored row that no agent produced (phantom);
  - no key stored more often than it was produced (duplicate);
  - a produced row may be missing only if the instance that produced it ended by
    SIGKILL (or crashed) AND the row lies after the last stored row of that instance in
    its own production order: the sink buffer (< flush_interval) and batches handed to
    the shipper thread but not yet sent or spooled die with the process and were never
    acknowledged. A missing row *before* a stored row of the same instance is a hole:
    a batch that was acknowledged or spooled and then lost — a real loss. An instance
    stopped gracefully (SIGTERM at the end) may miss nothing;
  - every *.parquet file under the data directory reads in full with pyarrow and DuckDB;
  - the SQL view and the Parquet view agree row for row;
  - no agent spool still holds batches, and no batch was rejected.
"""

import collections
import glob
import json
import os
import sys

import duckdb
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq


# The agents' shipper settings (scripts/chaos/run.py writes them). What a SIGKILL can
# take with it is the sink's buffer (< flush_interval of windows) plus batches queued in
# the shipper's memory behind one request that is still running: within request_timeout
# that request fails and the queue goes to the spool. A longer lost tail than this, plus
# a few seconds of scheduling slack on a loaded machine, means spooled or acknowledged
# data went missing, and fails the run.
FLUSH_INTERVAL_S = 2.0
REQUEST_TIMEOUT_S = 5.0
MAX_TAIL_SPAN_S = FLUSH_INTERVAL_S + REQUEST_TIMEOUT_S + 5.0


def load_events(work):
    out = []
    with open(os.path.join(work, "events.jsonl")) as f:
        for line in f:
            out.append(json.loads(line))
    return out


def instance_endings(events):
    """(target, instance) → 'killed' | 'stopped' | 'crashed' | 'forced' | 'running'."""
    end = {}
    for e in events:
        key = (e.get("target"), e.get("instance"))
        if e["kind"] == "start":
            end[key] = "running"
        elif e["kind"] == "kill":
            end[key] = "killed"
        elif e["kind"] == "exit":
            end[key] = "crashed"
        elif e["kind"] == "stop":
            end[key] = "forced" if e.get("forced") else ("stopped" if e.get("rc") == 0 else "stopped-rc%s" % e.get("rc"))
    return end


def read_windows(work):
    """Per (agent, instance): the list of keys in production order; torn lines counted."""
    produced = {}
    torn = 0
    bad_middle = []
    for agent_dir in sorted(glob.glob(os.path.join(work, "agents", "*"))):
        agent = os.path.basename(agent_dir)
        for path in sorted(glob.glob(os.path.join(agent_dir, "windows", "*.jsonl"))):
            inst = int(os.path.basename(path).split(".")[0])
            keys = []
            with open(path, "rb") as f:
                lines = f.read().split(b"\n")
            # The text after the last newline is a line being written at a SIGKILL: the
            # agent hands a window to the shipper only after its windows_out line is
            # flushed whole, so a torn line was never shipped.
            if lines and lines[-1] != b"":
                torn += 1
            for n, line in enumerate(lines[:-1]):
                try:
                    w = json.loads(line)
                except ValueError:
                    bad_middle.append(f"{path}:{n + 1}")
                    continue
                keys.append((w["gpu"]["host"], w["gpu"]["gpu_uuid"], int(w["time"])))
            produced[(agent, inst)] = keys
    return produced, torn, bad_middle


def to_us(col):
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    return col.cast(pa.timestamp("us", tz="UTC")).cast(pa.int64()).to_pylist()


def keys_of_table(t):
    return list(zip(t.column("host").to_pylist(), t.column("gpu_uuid").to_pylist(), to_us(t.column("time"))))


def read_sql(work):
    path = os.path.join(work, "stored.arrows")
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        t = ipc.open_stream(f).read_all()
    return collections.Counter(keys_of_table(t))


def read_parquet(data):
    """Reads every file; returns (live gpu_samples key counter, files checked, unreadable)."""
    unreadable = []
    checked = 0
    rows_all = 0
    live = collections.Counter()
    con = duckdb.connect()
    superseded = set()
    for j in glob.glob(os.path.join(data, "**", ".compaction.json"), recursive=True):
        try:
            with open(j) as f:
                for name in json.load(f).get("inputs", []):
                    superseded.add(os.path.join(os.path.dirname(j), name))
        except (OSError, ValueError) as e:
            unreadable.append(f"{j}: {e}")
    files = sorted(glob.glob(os.path.join(data, "**", "*.parquet"), recursive=True))
    for path in files:
        checked += 1
        try:
            t = pq.read_table(path)
            n = con.execute("SELECT count(*) FROM read_parquet(?)", [path]).fetchone()[0]
            if n != t.num_rows:
                raise ValueError(f"pyarrow reads {t.num_rows} rows, duckdb {n}")
            # DuckDB reads every column too (a count may use metadata only).
            con.execute("SELECT * FROM read_parquet(?)", [path]).fetchall()
        except Exception as e:  # noqa: BLE001 — any failure to read is the finding
            unreadable.append(f"{path}: {e}")
            continue
        rows_all += t.num_rows
        rel = os.path.relpath(path, data)
        if rel.split(os.sep)[0] == "gpu_samples" and path not in superseded:
            live.update(keys_of_table(t))
    return live, checked, unreadable, rows_all, len(superseded)


def compare(name, stored, produced, endings):
    """Applies the rules to one stored view. Returns (report dict, failures list)."""
    failures = []
    prod_count = collections.Counter()
    owner = {}
    for (agent, inst), keys in produced.items():
        for idx, k in enumerate(keys):
            prod_count[k] += 1
            owner.setdefault(k, []).append((agent, inst, idx))
    ambiguous = sum(1 for c in prod_count.values() if c > 1)
    phantoms = [k for k in stored if k not in prod_count]
    dups = {k: stored[k] - prod_count[k] for k in stored if k in prod_count and stored[k] > prod_count[k]}
    # Per instance: positions stored vs missing.
    allowed = 0
    holes = []
    lost_graceful = []
    suffix_stats = []
    for (agent, inst), keys in produced.items():
        present = [stored.get(k, 0) >= prod_count[k] for k in keys]
        if all(present):
            continue
        last_stored = max((i for i, p in enumerate(present) if p), default=-1)
        missing_idx = [i for i, p in enumerate(present) if not p]
        ending = endings.get((agent, inst), "unknown")
        in_hole = [i for i in missing_idx if i < last_stored]
        suffix = [i for i in missing_idx if i > last_stored]
        if in_hole:
            holes.append({"agent": agent, "instance": inst, "ending": ending, "missing": len(in_hole),
                          "first": keys[in_hole[0]], "last": keys[in_hole[-1]]})
        if suffix:
            if ending in ("killed", "crashed", "forced"):
                allowed += len(suffix)
                span = (keys[suffix[-1]][2] - keys[suffix[0]][2]) / 1e6
                suffix_stats.append({"agent": agent, "instance": inst, "rows": len(suffix), "span_s": span})
            else:
                lost_graceful.append({"agent": agent, "instance": inst, "ending": ending, "missing": len(suffix),
                                      "first": keys[suffix[0]]})
    stored_total = sum(stored.values())
    rep = {
        "stored_rows": stored_total,
        "phantom_rows": len(phantoms),
        "duplicated_rows": sum(dups.values()),
        "missing_allowed_unacked_at_kill": allowed,
        "missing_in_holes": sum(h["missing"] for h in holes),
        "missing_from_graceful_instances": sum(x["missing"] for x in lost_graceful),
        "keys_produced_more_than_once": ambiguous,
        "killed_instances_with_lost_tail": len(suffix_stats),
        "max_lost_tail_rows": max((s["rows"] for s in suffix_stats), default=0),
        "max_lost_tail_span_s": max((s["span_s"] for s in suffix_stats), default=0),
    }
    long_tails = [x for x in suffix_stats if x["span_s"] > MAX_TAIL_SPAN_S]
    rep["lost_tails_longer_than_%gs" % MAX_TAIL_SPAN_S] = len(long_tails)
    for x in long_tails[:5]:
        failures.append(f"{name}: LOSS: {x['agent']} instance {x['instance']} lost a tail of {x['rows']} rows "
                        f"spanning {x['span_s']}s at its kill, more than un-acknowledged data can be "
                        f"({MAX_TAIL_SPAN_S}s)")
    if phantoms:
        failures.append(f"{name}: {len(phantoms)} stored rows no agent produced, e.g. {phantoms[:3]}")
    if dups:
        ex = list(dups.items())[:3]
        failures.append(f"{name}: {sum(dups.values())} duplicated rows over {len(dups)} keys, e.g. {ex}")
    for h in holes[:5]:
        failures.append(f"{name}: LOSS: {h['missing']} rows missing before a stored row of {h['agent']} "
                        f"instance {h['instance']} ({h['ending']}), first {h['first']}")
    for x in lost_graceful[:5]:
        failures.append(f"{name}: LOSS: {x['missing']} rows missing at the end of {x['agent']} instance "
                        f"{x['instance']}, which was not killed ({x['ending']}), first {x['first']}")
    return rep, failures


def main():
    work = sys.argv[1]
    data = sys.argv[2]
    with open(os.path.join(work, "run.json")) as f:
        run = json.load(f)
    c = run["counters"]
    events = load_events(work)
    endings = instance_endings(events)
    produced, torn, bad_middle = read_windows(work)
    failures = []
    if bad_middle:
        failures.append(f"windows_out has unparseable lines before its end: {bad_middle[:5]}")
    produced_total = sum(len(v) for v in produced.values())

    sql = read_sql(work)
    if sql is None:
        failures.append(f"no SQL result (HTTP {c.get('sql_status')}): cannot check the collector's view")
        sql_rep = None
    else:
        sql_rep, f = compare("sql", sql, produced, endings)
        failures += f
    live, checked, unreadable, rows_all, superseded = read_parquet(data)
    pq_rep, f = compare("parquet", live, produced, endings)
    failures += f
    for u in unreadable:
        failures.append(f"unreadable file: {u}")
    if sql is not None and sql != live:
        only_sql = sum((sql - live).values())
        only_pq = sum((live - sql).values())
        failures.append(f"the SQL view and the Parquet files differ: {only_sql} rows only in SQL, {only_pq} only in Parquet")
    if c.get("agents_left_with_spool"):
        failures.append(f"spools not drained at the end: {c['agents_left_with_spool']}")
    if c.get("rejected_files"):
        failures.append(f"batches rejected by the collector: {c['rejected_files'][:5]}")
    if c.get("collector_not_up_at_end"):
        failures.append("the collector did not come back up after the chaos")
    forced = [e for e in events if e["kind"] == "stop" and e.get("forced")]
    if forced:
        failures.append(f"{len(forced)} graceful stops timed out and needed SIGKILL: "
                        f"{[(e['target'], e['instance']) for e in forced]}")
    full_answers = [a for a in c.get("enospc_probe_answers", []) if a.get("status") is not None]
    for ep in range(1, c.get("enospc_episodes", 0) + 1):
        got = [a["status"] for a in full_answers if a.get("episode") == ep]
        if 507 not in got:
            failures.append(f"ENOSPC episode {ep}: no probe was answered 507 while the disk was full: {got}")
    # 200 is legitimate too: a small append that fits in the WAL segment's last, already
    # allocated tmpfs page needs no new block, so it is written, fsynced and acknowledged.
    # Acknowledged rows are checked like every other row.
    bad_full = [a for a in full_answers if a["status"] not in (0, 200, 503, 507)]
    if bad_full:
        failures.append(f"ingest while the disk was full got an unexpected answer: {bad_full}")
    not_recovered = [a for a in c.get("recovery_probe_answers", []) if a.get("status") not in (200, None)]
    if not_recovered:
        failures.append(f"ingest did not recover after space was freed: {not_recovered}")

    # Evidence from the logs.
    def count_in(path, needle):
        try:
            with open(path, errors="replace") as fh:
                return sum(line.count(needle) for line in fh)
        except OSError:
            return 0

    coll_log = os.path.join(work, "collector.log")
    enospc_log_lines = count_in(coll_log, "storage full")
    agent_507 = sum(count_in(p, "507") for p in glob.glob(os.path.join(work, "agents", "*", "agent.log")))
    skew = {}
    try:
        with open(os.path.join(work, "collector-metrics.txt")) as fh:
            for line in fh:
                if line.startswith("apron_agent_clock_skew") and "agent=" in line:
                    agent = line.split('agent="', 1)[1].split('"', 1)[0]
                    skew[agent] = float(line.rsplit(" ", 1)[1])
                elif line.startswith("apron_ingest_clock_skew_batches_total"):
                    d = line.split('direction="', 1)[1].split('"', 1)[0]
                    skew[f"batches_flagged_{d} (since last restart)"] = float(line.rsplit(" ", 1)[1])
    except OSError:
        pass
    # Observed clock offset of each agent: newest window time vs the real time its
    # windows_out file was last written.
    offsets = {}
    for agent_dir in sorted(glob.glob(os.path.join(work, "agents", "*"))):
        files = sorted(glob.glob(os.path.join(agent_dir, "windows", "*.jsonl")))
        if not files:
            continue
        agent = os.path.basename(agent_dir)
        for path in reversed(files):
            keys = produced.get((agent, int(os.path.basename(path).split(".")[0])), [])
            if keys:
                offsets[agent] = round(max(k[2] for k in keys) / 1e6 - os.path.getmtime(path), 1)
                break

    summary = {
        "seed": run.get("seed"),
        "kills": {"collector": c["kills_collector"], "agent": c["kills_agent"],
                  "total": c["kills_collector"] + c["kills_agent"], "during_enospc": c["kills_during_enospc"]},
        "restarts": {"collector": c["restarts_collector"], "agent": c["restarts_agent"]},
        "unexpected_exits": {"collector": c["unexpected_exits_collector"], "agent": c["unexpected_exits_agent"]},
        "agent_instances": len(produced),
        "clock_shifts": run.get("clock_shifts"),
        "observed_agent_clock_offset_s": offsets,
        "collector_skew_metrics": skew,
        "enospc": {
            "episodes": c["enospc_episodes"],
            "answers_while_full": collections.Counter(str(a.get("status")) for a in c.get("enospc_probe_answers", [])),
            "example_507_answer": next((a["body"] for a in full_answers if a["status"] == 507), None),
            "answers_after_free": [(a.get("status"), a.get("seconds")) for a in c.get("recovery_probe_answers", [])],
            "collector_log_storage_full_lines": enospc_log_lines,
            "agent_log_lines_mentioning_507": agent_507,
            "max_total_spool_bytes_while_full": c["max_spool_bytes_during_enospc"],
        },
        "chaos_seconds": c.get("chaos_seconds"),
        "drain_seconds": c.get("drain_seconds"),
        "rows_produced": produced_total,
        "torn_last_lines": torn,
        "sql": sql_rep,
        "parquet": pq_rep,
        "parquet_files_checked": checked,
        "parquet_rows_all_tables_all_files": rows_all,
        "parquet_superseded_files_skipped_for_counting": superseded,
        "unreadable_files": len(unreadable),
        "result": "FAIL" if failures else "PASS",
        "failures": failures,
    }
    with open(os.path.join(work, "summary.json"), "w") as fh:
        json.dump(summary, fh, indent=2, default=str)
    print(json.dumps(summary, indent=2, default=str))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
