#!/usr/bin/env bash
# Ingest load test (docs/benchmarks.md, "Ingest load: 1,000 agents at 1 Hz"):
# AGENTS simulated agents, each posting one gpu_samples batch per second (its GPUs' 1 s
# windows, exactly as apron-agent ships them) to one `apron serve` on loopback for
# DURATION; then checks that nothing was lost.
#
#   scripts/load.sh [AGENTS] [DURATION]        defaults: 1000 10m
#
#   1. builds `apron` and the `loadgen` example (release) unless BIN_DIR is set
#   2. starts `apron serve` (default settings; config in a temp dir: an ingest token, an
#      SQL token, data dir, 127.0.0.1 port 0), waits for "listening on" and /healthz
#   3. runs server/examples/loadgen.rs (ack latency of every request, retries like an
#      agent; with PREGEN=1 every request body is encoded into files first, so the
#      generator's encoding does not compete with the server for CPU) while sampling the server's RSS (/proc/PID/status) and CPU
#      (/proc/PID/stat utime+stime) and the machine's busy CPU (/proc/stat) every second
#   4. counts gpu_samples rows and duplicate (host, gpu_uuid, time) keys over
#      POST /api/v1/sql while the server runs (memtable + Parquet), then stops it
#      (SIGTERM: final persist), starts it again on the same data directory and counts
#      again (Parquet + WAL replay): both must equal the rows the loadgen saw acknowledged
#   5. prints one summary (also OUT/summary.txt, OUT/summary.json); exit 1 when rows were
#      lost or duplicated
#
# Environment:
#   BIN_DIR=<dir>        prebuilt binaries: BIN_DIR/apron and BIN_DIR/examples/loadgen
#                        (no cargo build); default: build into TARGET_DIR
#   TARGET_DIR=<repo>/target      cargo target dir when building
#   GPUS_PER_AGENT=8  CONNECTIONS=0 (0: one keep-alive connection per agent)
#   OUT=load-out         results: loadgen.json, samples.tsv, server logs, summary
#   KEEP_DATA=0          1: keep the temp dir (config, data) after the run
#   PREGEN=1             1: pre-encode all bodies (~15 KB per request: 9 GB for 1000
#                        agents x 10 min, in the temp dir); 0: encode live at send time
#   LOADGEN_ARGS=""      extra loadgen flags (e.g. --lead 200ms)
#   STORAGE_TOML=""      extra lines for the server's [storage] section, e.g.
#                        'persist_max_bytes = 8589934592'
set -euo pipefail

AGENTS=${1:-1000}
DURATION=${2:-10m}
GPUS_PER_AGENT=${GPUS_PER_AGENT:-8}
CONNECTIONS=${CONNECTIONS:-0}
OUT=${OUT:-load-out}
KEEP_DATA=${KEEP_DATA:-0}
LOADGEN_ARGS=${LOADGEN_ARGS:-}
PREGEN=${PREGEN:-1}
STORAGE_TOML=${STORAGE_TOML:-}

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
log() { printf '[load] %s\n' "$*" >&2; }

# shellcheck source=scripts/bench/serve.sh
. "$root/scripts/bench/serve.sh"
release_binaries loadgen
apron_bin="$BIN_DIR/apron"
loadgen_bin="$BIN_DIR/examples/loadgen"

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
tmp="$(mktemp -d /tmp/apron-load.XXXXXX)"
data="$tmp/data"
write_config "$tmp" "$data" "$STORAGE_TOML"

trap cleanup EXIT

# Starts `apron serve`; sets server_pid and addr. $1: log name.
start_server() { start_apron "$apron_bin" "$tmp/apron.toml" "$OUT" "$1"; }

secs_since() { python3 -c 'import sys; print(f"{float(sys.argv[2]) - float(sys.argv[1]):.1f}")' "$1" "$EPOCHREALTIME"; }

# Stops the server with SIGTERM (it persists the memtable first); sets stop_secs.
stop_server() {
    local t0 rc=0
    t0=$EPOCHREALTIME
    kill -TERM "$server_pid"
    wait "$server_pid" || rc=$?
    [ "$rc" = 0 ] || log "apron serve exited with status $rc"
    server_pid=""
    stop_secs=$(secs_since "$t0")
}

# POST /api/v1/sql; prints the JSON answer.
sql() {
    curl -fsS -X POST "http://$addr/api/v1/sql" -H "Authorization: Bearer $sql_token" \
        -H 'Accept: application/json' --data-binary "$1"
}

# Rows, duplicate keys and series of gpu_samples, as "rows dups series".
count_rows() {
    local q='SELECT sum(n) AS rows, sum(n - d) AS duplicates, count(*) AS series FROM (SELECT host, gpu_uuid, count(*) AS n, count(DISTINCT time) AS d FROM gpu_samples GROUP BY host, gpu_uuid) t'
    sql "$q" | python3 -c '
import json, sys
r = json.load(sys.stdin)["rows"][0]
print(" ".join(str(int(v or 0)) for v in r))'
}

# Every second: wall time, server RSS (kB), server utime+stime (ticks), machine busy
# and total jiffies (/proc/stat).
sample() {
    local pid=$1 rss ticks cpu
    while kill -0 "$pid" 2>/dev/null; do
        rss=$(awk '/^VmRSS:/ {print $2}' "/proc/$pid/status" 2>/dev/null) || break
        ticks=$(sed 's/^.*) //' "/proc/$pid/stat" 2>/dev/null | awk '{print $12 + $13}') || break
        cpu=$(awk '/^cpu / {busy = $2 + $3 + $4 + $7 + $8 + $9; print busy, busy + $5 + $6; exit}' /proc/stat)
        printf '%s %s %s %s\n' "$EPOCHREALTIME" "$rss" "$ticks" "$cpu"
        sleep 1
    done
}

run_date=$(date -u +%Y-%m-%dT%H:%M:%SZ)
log "$run_date: $AGENTS agents x $GPUS_PER_AGENT GPUs for $DURATION; binaries in $BIN_DIR; temp dir $tmp"
start_server server
log "apron serve (pid $server_pid) on http://$addr"
{ cat /proc/loadavg; ps -eo pid,ni,pcpu,etime,args --sort=-pcpu | head -12 | cut -c1-160; } > "$OUT/ps-before.txt"

sample "$server_pid" > "$OUT/samples.tsv" &
sampler_pid=$!
sleep 2 # a baseline before the load
pregen_args=()
[ "$PREGEN" = 1 ] && pregen_args=(--pregen-dir "$tmp/bodies")
set +e
# shellcheck disable=SC2086 # LOADGEN_ARGS is a list of flags
APRON_INGEST_TOKEN="$ingest_token" "$loadgen_bin" --server "http://$addr" --agents "$AGENTS" \
    --gpus-per-agent "$GPUS_PER_AGENT" --duration "$DURATION" --connections "$CONNECTIONS" \
    --json "$OUT/loadgen.json" "${pregen_args[@]}" $LOADGEN_ARGS 2> >(tee "$OUT/loadgen.err" >&2) | tee "$OUT/loadgen.out"
loadgen_rc=${PIPESTATUS[0]}
set -e
load_t1=$EPOCHREALTIME
rm -rf "$tmp/bodies"
sleep 1
kill "$sampler_pid" 2>/dev/null || true
wait "$sampler_pid" 2>/dev/null || true
sampler_pid=""
{ cat /proc/loadavg; ps -eo pid,ni,pcpu,etime,args --sort=-pcpu | head -12 | cut -c1-160; } > "$OUT/ps-after.txt"
[ -f "$OUT/loadgen.json" ] || { log "loadgen wrote no summary (exit $loadgen_rc)"; exit 1; }

log "counting rows while the server runs (memtable + Parquet)"
read -r live_rows live_dups live_series < <(count_rows) || { log "the count query failed"; exit 1; }
curl -fsS "http://$addr/metrics" > "$OUT/metrics.txt" || true
log "stopping the server (final persist)"
stop_server
shutdown_secs=$stop_secs
data_bytes=$(du -sb "$data" | cut -f1)
log "restarting on the same data directory"
restart_t0=$EPOCHREALTIME
start_server server2
ready_secs=$(secs_since "$restart_t0")
read -r cold_rows cold_dups cold_series < <(count_rows) || { log "the count query failed"; exit 1; }
stop_server

# The load starts one second before the first window ends (pre-generation comes before).
load_t0=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["first_window_end_unix_s"] - 1)' "$OUT/loadgen.json")
python3 - "$OUT" "$load_t0" "$load_t1" "$(getconf CLK_TCK)" "$run_date" "$DURATION" \
    "$live_rows" "$live_dups" "$live_series" "$cold_rows" "$cold_dups" "$cold_series" \
    "$shutdown_secs" "$ready_secs" "$data_bytes" "$loadgen_rc" <<'PY'
import json, sys
out, t0, t1, hz, date, duration = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
live_rows, live_dups, live_series, cold_rows, cold_dups, cold_series = map(int, sys.argv[7:13])
stop_s, ready_s, data_bytes, loadgen_rc = float(sys.argv[13]), float(sys.argv[14]), int(sys.argv[15]), int(sys.argv[16])
g = json.load(open(f"{out}/loadgen.json"))
samples = []
for line in open(f"{out}/samples.tsv"):
    f = line.split()
    if len(f) == 5:
        samples.append((float(f[0]), int(f[1]), int(f[2]), int(f[3]), int(f[4])))
base = [s for s in samples if s[0] <= t0]
during = [s for s in samples if t0 <= s[0] <= t1]
first = base[-1] if base else samples[0]
last = during[-1] if during else samples[-1]
span = last[0] - first[0]
cpu_s = (last[2] - first[2]) / hz
# Busiest 10 s of the server.
peak10 = 0.0
for i, s in enumerate(during):
    j = next((k for k in range(i, len(during)) if during[k][0] - s[0] >= 10), None)
    if j is not None:
        peak10 = max(peak10, 100 * (during[j][2] - s[2]) / hz / (during[j][0] - s[0]))
machine_busy = 100 * (last[3] - first[3]) / max(1, last[4] - first[4])
lat = g["ack_latency_ms"]
ok = (g["rows_acked"] == live_rows == cold_rows and live_dups == 0 and cold_dups == 0
      and g["undelivered_rows"] == 0 and g["rejected_rows"] == 0)
s = {
    "date": date,
    "agents": g["agents"], "gpus_per_agent": g["gpus_per_agent"], "duration": duration,
    "connections": g["connections"],
    "target_rps": g["target_rps"], "achieved_rps": g["achieved_rps"],
    "requests": g["requests"], "requests_ok": g["requests_ok"], "non_2xx": g["non_2xx"],
    "transport_errors": g["errors"], "retried_batches": g["retried_batches"], "duplicates_acked": g["duplicates"],
    "ack_latency_ms": lat, "send_lag_ms": g["send_lag_ms"], "delivery_ms": g["delivery_ms"],
    "mean_body_bytes": g["mean_body_bytes"],
    "server_rss_mib": {"start": round(first[1] / 1024, 1), "peak": round(max(x[1] for x in during) / 1024, 1) if during else None,
                       "end": round(last[1] / 1024, 1)},
    "server_cpu": {"seconds": round(cpu_s, 1), "mean_pct_one_core": round(100 * cpu_s / span, 1) if span > 0 else None,
                   "peak_10s_pct_one_core": round(peak10, 1), "span_s": round(span, 1)},
    "machine_busy_pct_all_cores": round(machine_busy, 1),
    "loadgen": g["generator"],
    "rows": {"sent": g["rows_sent"], "acked": g["rows_acked"], "rejected": g["rejected_rows"],
             "undelivered": g["undelivered_rows"],
             "stored_live": live_rows, "duplicates_live": live_dups, "series_live": live_series,
             "stored_after_restart": cold_rows, "duplicates_after_restart": cold_dups},
    "shutdown_s": stop_s, "restart_ready_s": ready_s, "data_dir_bytes": data_bytes,
    "loadgen_exit": loadgen_rc, "nothing_lost": ok,
}
json.dump(s, open(f"{out}/summary.json", "w"), indent=2)
rss, cpu, rows = s["server_rss_mib"], s["server_cpu"], s["rows"]
pg = g["generator"].get("pregen")
if pg:
    pregen = f"bodies pre-generated before the run ({pg['bytes'] / 2**30:.1f} GiB, {pg['wall_s']:.0f} s, {pg['cpu_s']:.0f} CPU-s)"
else:
    pregen = f"encoded live: sim {g['generator']['sim_ms_mean']} ms/s, encode {g['generator']['encode_us_mean']} us/batch (wall)"
text = f"""== ingest load: {s['agents']} agents x {s['gpus_per_agent']} GPUs at 1 Hz for {duration} ({date})
requests      {s['requests_ok']} acknowledged of {s['requests']} sent; {s['achieved_rps']} req/s achieved (target {s['target_rps']:.0f}); non-2xx {s['non_2xx']}; errors {s['transport_errors']}; retried batches {s['retried_batches']}
ack latency   p50 {lat['p50']} ms  p90 {lat['p90']} ms  p99 {lat['p99']} ms  p99.9 {lat['p99_9']} ms  max {lat['max']} ms
send lag      p50 {g['send_lag_ms']['p50']} ms  p99 {g['send_lag_ms']['p99']} ms  max {g['send_lag_ms']['max']} ms (due -> first attempt: generator lateness, or an agent's queue behind a retried batch)
server RSS    start {rss['start']} MiB  peak {rss['peak']} MiB  end {rss['end']} MiB
server CPU    {cpu['seconds']} CPU-s over {cpu['span_s']} s = {cpu['mean_pct_one_core']}% of one core (busiest 10 s: {cpu['peak_10s_pct_one_core']}%)
machine       {s['machine_busy_pct_all_cores']}% of all cores busy during the run
loadgen       {g['generator']['cpu_s']} CPU-s = {g['generator']['cpu_pct_one_core']}% of one core during the run; {pregen}; body {s['mean_body_bytes']} B
rows          sent {rows['sent']}  acked {rows['acked']}  stored {rows['stored_live']} (live)  {rows['stored_after_restart']} (after restart)  duplicates {rows['duplicates_live']}/{rows['duplicates_after_restart']}  undelivered {rows['undelivered']}  rejected {rows['rejected']}
store         {data_bytes / 2**20:.1f} MiB on disk; shutdown (final persist) {stop_s} s; restart ready in {ready_s} s
result        {'NOTHING LOST: rows acked = rows stored, 0 duplicates' if ok else 'FAILED: rows lost, duplicated or undelivered'}
"""
open(f"{out}/summary.txt", "w").write(text)
print(text, end="")
sys.exit(0 if ok else 1)
PY
