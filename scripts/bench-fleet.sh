#!/usr/bin/env bash
# Fleet benchmark (docs/benchmarks.md, "Fleet benchmark"): one `apron serve` carrying
# GPUS simulated GPUs — HOURS of history shipped through the real HTTP ingest path at
# full speed, then LIVE of agents shipping at 1 Hz on top of it — with the server's RSS
# sampled every second and every background pass timed from its own log lines.
#
#   scripts/bench-fleet.sh [GPUS] [HOURS] [LIVE]        defaults: 256 24 10m
#
#   1. builds `apron` and the `fleet_history` and `loadgen` examples (release) unless
#      BIN_DIR is set
#   2. starts `apron serve` (default settings, a temp config: ingest and SQL tokens,
#      127.0.0.1 port 0, alert passes logged at debug) and an RSS/CPU sampler
#   3. history: server/examples/fleet_history.rs ships GPUS × HOURS of 1 s windows (the
#      fleet `apron up` simulates, owners included, so allocations, teams and stranded
#      runs exist) ending now, CHUNK rows per request, as fast as acknowledged
#   4. live: server/examples/loadgen.rs, GPUS / 8 agents × 8 GPUs at 1 Hz, for LIVE —
#      the background passes (persist, compaction, rollup, ledger, alerts,
#      recommendations) run on their own schedules throughout
#   5. the weekly report (JSON), recommendations over 7 d (computed on demand) and five
#      typical SQL queries, each timed twice
#   6. stops the server (SIGTERM) and prints one summary (OUT/summary.txt): ingest
#      windows/s, peak and steady RSS per phase, memtable bytes per row (its gauges at
#      the end of the live phase), disk bytes per window of gpu_samples,
#      each pass's count / median / max duration, the report and query times
#
# Environment:
#   BIN_DIR=<dir>   prebuilt binaries (BIN_DIR/apron, BIN_DIR/examples/{fleet_history,loadgen})
#   OUT=fleet-out   results: samples.tsv (s, phase, rss_kb, hwm_kb, server cpu s), server.err
#                   (its log), history/loadgen output, queries.txt, summary.txt
#   CHUNK=20000 SENDERS=2   history request size and concurrency
#   KEEP_DATA=0     1: keep the temp dir (config, data)
#   EXTRA_TOML=…    appended to the server's config, e.g. $'[alerts]\nincremental = false'
#   STORAGE_TOML=…  lines added to its [storage] table, e.g. 'memtable_max_bytes = 134217728'
set -euo pipefail

GPUS=${1:-256}
HOURS=${2:-24}
LIVE=${3:-10m}
OUT=${OUT:-fleet-out}
CHUNK=${CHUNK:-20000}
SENDERS=${SENDERS:-2}
KEEP_DATA=${KEEP_DATA:-0}
[ $((GPUS % 8)) = 0 ] || { echo "GPUS must be a multiple of 8" >&2; exit 2; }

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
log() { printf '[fleet] %s\n' "$*" >&2; }

# shellcheck source=scripts/bench/serve.sh
. "$root/scripts/bench/serve.sh"
release_binaries fleet_history loadgen

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
tmp="$(mktemp -d /tmp/apron-fleet.XXXXXX)"
data="$tmp/data"
write_config "$tmp" "$data" "${STORAGE_TOML:-}"
[ -z "${EXTRA_TOML:-}" ] || printf '\n%s\n' "$EXTRA_TOML" >> "$tmp/apron.toml"

trap cleanup EXIT

# Alert passes log their duration at debug.
export APRON_LOG="info,apron::alerts=debug"
start_apron "$BIN_DIR/apron" "$tmp/apron.toml" "$OUT" server
log "apron serve on $addr (pid $server_pid), data in $data"

# The phase the sampler stamps on each second's line.
echo start > "$tmp/phase"
(
    s=0
    while kill -0 "$server_pid" 2>/dev/null; do
        rss=$(awk '/^VmRSS:/ {print $2}' "/proc/$server_pid/status" 2>/dev/null) || break
        hwm=$(awk '/^VmHWM:/ {print $2}' "/proc/$server_pid/status" 2>/dev/null) || break
        ticks=$(sed 's/^.*) //' "/proc/$server_pid/stat" 2>/dev/null | awk '{print $12 + $13}') || break
        printf '%d\t%s\t%s\t%s\t%s\n' "$s" "$(cat "$tmp/phase")" "$rss" "$hwm" "$((ticks / 100))"
        s=$((s + 1))
        sleep 1
    done
) > "$OUT/samples.tsv" &
sampler_pid=$!

echo history > "$tmp/phase"
log "history: $GPUS GPUs x $HOURS h through HTTP ingest"
"$BIN_DIR/examples/fleet_history" --server "http://$addr" --token "$ingest_token" --gpus "$GPUS" \
    --hours "$HOURS" --chunk "$CHUNK" --senders "$SENDERS" > "$OUT/history.txt" 2> "$OUT/history.log"
cat "$OUT/history.txt"

echo live > "$tmp/phase"
log "live: $((GPUS / 8)) agents x 8 GPUs at 1 Hz for $LIVE"
"$BIN_DIR/examples/loadgen" --server "http://$addr" --token "$ingest_token" --agents $((GPUS / 8)) \
    --gpus-per-agent 8 --duration "$LIVE" --progress 60s --json "$OUT/loadgen.json" \
    > "$OUT/loadgen.txt" 2> "$OUT/loadgen.log"

# What a row costs in the memtable, from its own gauges at the end of the live phase.
curl -fsS "http://$addr/metrics" | grep -E '^apron_memtable_(rows|bytes)\{table="gpu_samples"' \
    > "$OUT/memtable.txt" || true

echo queries > "$tmp/phase"
# Prints "<seconds> <bytes>" of one request; fails on a non-2xx answer.
timed() { curl -fsS -o "$tmp/answer" -w '%{time_total} %{size_download}\n' "$@"; }
week=$(date -u +%G-W%V)
queries=(
    "SELECT team, round(sum(idle_cost_usd), 2) AS idle_usd, round(sum(stranded_cost_usd), 2) AS stranded_usd FROM gpu_cost_hourly WHERE hour >= now() - INTERVAL '7 days' GROUP BY team ORDER BY idle_usd DESC"
    "SELECT team, host, gpu_uuids, owner, starts_at, cost_usd FROM alerts WHERE kind = 'stranded_allocation' AND state = 'firing' ORDER BY cost_usd DESC NULLS LAST"
    "SELECT gpu_model, round(sum(active_s + allocated_idle_s + stranded_s) / 3600, 1) AS allocated_gpu_hours, round(sum(active_s) / 3600, 1) AS active_gpu_hours FROM gpu_cost_hourly WHERE hour >= now() - INTERVAL '7 days' GROUP BY gpu_model"
    "SELECT namespace, count(*) AS windows, round(approx_percentile_cont(gpu_util, 0.95), 3) AS p95 FROM gpu_samples WHERE time >= now() - INTERVAL '1 hour' AND namespace IS NOT NULL GROUP BY namespace ORDER BY p95"
    "SELECT host, date_trunc('hour', time) AS hour, avg(gpu_util_mean) AS util FROM gpu_samples_1m WHERE time >= now() - INTERVAL '24 hours' GROUP BY host, date_trunc('hour', time)"
)
{
    for run in 1 2; do
        printf 'weekly report (%s, JSON), run %d: ' "$week" "$run"
        timed -H "Authorization: Bearer $sql_token" "http://$addr/api/v1/reports/weekly?week=$week&format=json"
    done
    # Computed on demand over the stored samples (the same pass as the table's refresh,
    # which ran at start-up over an empty store and next runs an interval later).
    for run in 1 2; do
        printf 'recommendations (7 d, on demand), run %d: ' "$run"
        timed -H "Authorization: Bearer $sql_token" "http://$addr/api/v1/recommendations?window=7d"
        python3 -c 'import json,sys; print("    items:", len(json.load(open(sys.argv[1]))["recommendations"]))' "$tmp/answer"
    done
    for q in "${queries[@]}"; do
        for run in 1 2; do
            printf 'run %d: ' "$run"
            timed -X POST "http://$addr/api/v1/sql" -H "Authorization: Bearer $sql_token" \
                -H 'Accept: application/json' --data-binary "$q"
        done
        printf '    %s\n' "$q"
    done
} > "$OUT/queries.txt"

echo stop > "$tmp/phase"
windows=$(curl -fsS -X POST "http://$addr/api/v1/sql" -H "Authorization: Bearer $sql_token" \
    -H 'Accept: application/json' --data-binary 'SELECT count(*) FROM gpu_samples' |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["rows"][0][0])')
kill -TERM "$server_pid"
wait "$server_pid" || log "apron serve exited with status $?"
server_pid=""
kill "$sampler_pid" 2>/dev/null || true
wait "$sampler_pid" 2>/dev/null || true
sampler_pid=""
parquet_bytes=$(find "$data/gpu_samples" -name '*.parquet' -printf '%s\n' | awk '{s += $1} END {print s + 0}')

python3 - "$OUT" "$windows" "$parquet_bytes" "$GPUS" "$HOURS" "$LIVE" <<'EOF' | tee "$OUT/summary.txt"
import re, statistics, sys
out, windows, parquet_bytes, gpus, hours, live = sys.argv[1:]
windows, parquet_bytes = int(windows), int(parquet_bytes)
rows = [l.rstrip("\n").split("\t") for l in open(f"{out}/samples.tsv") if l.count("\t") == 4]
rows = [(int(s), ph, int(r), int(h), int(c)) for s, ph, r, h, c in rows if r and h and c]
print(f"fleet benchmark: {gpus} GPUs, {hours} h of history, then {live} live at 1 Hz")
print(open(f"{out}/history.txt").read().strip())
for phase in ["history", "live", "queries"]:
    p = [r for r in rows if r[1] == phase]
    if not p:
        continue
    last = p[-60:]
    cpu = (p[-1][4] - p[0][4]) / max(1, p[-1][0] - p[0][0])
    print(f"{phase:8} {len(p):5} s  peak RSS {max(r[2] for r in p) / 1024:7.0f} MiB  "
          f"mean RSS of its last minute {sum(r[2] for r in last) / len(last) / 1024:6.0f} MiB  server CPU {cpu:.2f} cores")
print(f"VmHWM over the run: {max(r[3] for r in rows) / 1024:.0f} MiB")
print(f"gpu_samples: {windows} windows, {parquet_bytes} bytes of Parquet = {parquet_bytes / max(1, windows):.1f} bytes/window")
gauges = {l.split("{")[0]: float(l.split()[-1]) for l in open(f"{out}/memtable.txt") if l.strip()}
if gauges.get("apron_memtable_rows"):
    rows_held, bytes_held = gauges["apron_memtable_rows"], gauges.get("apron_memtable_bytes", 0)
    print(f"memtable at the end of live: {rows_held:.0f} rows of gpu_samples in {bytes_held / 2**20:.1f} MiB "
          f"= {bytes_held / rows_held:.0f} bytes/row")
log = re.sub(r"\x1b\[[0-9;]*m", "", open(f"{out}/server.err").read())
# (label, the log line's message, a further field it must have): durations from elapsed_ms.
passes = [
    ("persist", "persisted memtable to Parquet", ""),
    ("compaction", "compacted a partition", ""),
    ("rollup (a day)", "materialized gpu_samples_1m", ""),
    ("ledger, whole day", "computed gpu_cost_hourly", "how=whole"),
    ("ledger, incremental", "computed gpu_cost_hourly", "how=from"),
    ("alerts, whole lookback", "alert pass", "how=Whole"),
    ("alerts, incremental", "alert pass", "how=Incremental"),
    ("recommendations (7 d)", "recommendations refreshed", ""),
]
for name, message, field in passes:
    ms = [int(m.group(1)) for l in log.splitlines() if message in l and field in l
          for m in [re.search(r"elapsed_ms=(\d+)", l)] if m]
    if ms:
        print(f"{name:24} {len(ms):4} passes  median {statistics.median(ms) / 1000:7.2f} s  max {max(ms) / 1000:7.2f} s")
    else:
        print(f"{name:24}    0 passes")
print(open(f"{out}/queries.txt").read().rstrip())
EOF
