#!/usr/bin/env bash
# RSS of `apron up` on a new data directory (16 simulated GPUs, default 24 h seed),
# sampled from /proc every second for DURATION seconds, then SIGTERM. Prints the peak,
# the mean of the last minute, and the server's compaction and ledger log lines.
#   BIN=target/release/apron DURATION=300 [CONFIG=up.toml] scripts/bench/rss-up.sh
set -euo pipefail
BIN=${BIN:-target/release/apron}
DURATION=${DURATION:-300}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
data="$OUT/data"
"$BIN" up ${CONFIG:+--config "$CONFIG"} --http 127.0.0.1:0 --pg 127.0.0.1:0 --data "$data" >"$OUT/up.out" 2>"$OUT/up.log" &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
: >"$OUT/rss.tsv"
for ((s = 1; s <= DURATION; s++)); do
  sleep 1
  kb=$(awk '/^VmRSS/ {print $2}' "/proc/$pid/status" 2>/dev/null) || break
  hwm=$(awk '/^VmHWM/ {print $2}' "/proc/$pid/status" 2>/dev/null) || break
  printf '%d\t%d\t%d\n' "$s" "$kb" "$hwm" >>"$OUT/rss.tsv"
done
metrics=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["metrics"])' "$data/endpoints.json" 2>/dev/null || true)
[ -n "$metrics" ] && curl -s "$metrics" | grep -E '^apron_memtable_bytes' >"$OUT/memtable.txt" || true
kill -TERM $pid; wait $pid || true
trap - EXIT
awk -v d="$DURATION" '{ if ($3 > hwm) hwm = $3; if ($2 > peak) peak = $2; if ($1 > d - 60) { sum += $2; n++ } }
  END { printf "peak RSS %.0f MiB (VmHWM %.0f MiB); mean RSS over the last minute %.0f MiB\n", peak / 1024, hwm / 1024, sum / n / 1024 }' "$OUT/rss.tsv"
awk 'NR % 15 == 0 { printf "%ss:%.0f ", $1, $2 / 1024 } END { print "" }' "$OUT/rss.tsv"
grep -E "compacted|computed gpu_cost_hourly|backfill" "$OUT/up.log" | sed 's/\x1b\[[0-9;]*m//g' | tail -20 || true
echo "memtable at the end (bytes):"; cat "$OUT/memtable.txt" 2>/dev/null || true
echo "logs and samples: $OUT"
