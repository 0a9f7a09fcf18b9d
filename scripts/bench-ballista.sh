#!/usr/bin/env bash
# Ballista benchmark (docs/benchmarks.md, "Distributed SQL: one and two Ballista
# executors"): the same full-scan and hourly queries over the same two-shard lake,
# answered by a query server itself, then through a Ballista cluster with one
# executor, then with two — side by side in one run, with the answers compared.
#
#   scripts/bench-ballista.sh [GPUS] [HOURS]          defaults: 256 3
#
#   1. builds `apron` and the `fleet_history` example (release) unless BIN_DIR is set
#   2. starts s3s-fs (the bucket) and two collectors (`[cluster]` shards rack-a, rack-b)
#   3. ships GPUS/2 simulated GPUs × HOURS of 1 s windows to each (fleet_history,
#      different seeds: different GPUs), waits until the lake holds every row
#   4. starts `apron ballista scheduler`, one executor (VCORES task slots), a query
#      server without Ballista ("local") and one with `[query.ballista]` and
#      `min_scan_bytes = 0` ("cluster")
#   5. times each query RUNS times on local and on the cluster with one executor; starts
#      the second executor and times them again; prints medians, ratios and whether
#      every answer was identical (OUT/summary.txt)
#
# Environment:
#   BIN_DIR=<dir>   prebuilt binaries (BIN_DIR/apron, BIN_DIR/examples/fleet_history)
#   OUT=ballista-out   logs, answers, summary.txt
#   VCORES=1        task slots per executor (1: two executors = two cores on a 2-core box)
#   RUNS=5          timings per query and setup
#   S3S_FS=…        the s3s-fs binary (default: scripts/install-test-tools.sh's)
set -euo pipefail

GPUS=${1:-256}
HOURS=${2:-3}
OUT=${OUT:-ballista-out}
VCORES=${VCORES:-1}
RUNS=${RUNS:-5}
S3S_FS=${S3S_FS:-$HOME/.cache/apron-tools/bin/s3s-fs}
ROOT=$(cd "$(dirname "$0")/.." && pwd)

if [[ -z "${BIN_DIR:-}" ]]; then
  (cd "$ROOT" && cargo build --release -p apron --bin apron --example fleet_history)
  BIN_DIR=$ROOT/target/release
fi
APRON=$BIN_DIR/apron
HISTORY=$BIN_DIR/examples/fleet_history
[[ -x $APRON && -x $HISTORY && -x $S3S_FS ]] || { echo "need $APRON, $HISTORY and $S3S_FS" >&2; exit 1; }

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
TMP=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$TMP"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() { for _ in $(seq 1 600); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.1; done; echo "port $1 never opened" >&2; exit 1; }

TOKEN=bench-ingest-token-0123456789abcdef
VIEWER=bench-viewer-token-0123456789abcdef
S3_PORT=$(free_port)
mkdir -p "$TMP/s3/apron"
"$S3S_FS" --host 127.0.0.1 --port "$S3_PORT" --access-key AK --secret-key SK "$TMP/s3" >"$OUT/s3s-fs.log" 2>&1 &
PIDS+=($!)
wait_port "$S3_PORT"
LAKE="[storage.object_store]
url = \"s3://apron/lake\"
endpoint = \"http://127.0.0.1:$S3_PORT\"
region = \"us-east-1\"
access_key_id = \"AK\"
secret_access_key = \"SK\"
allow_http = true"
QUERY="[query]
timeout = \"10m\"
max_result_rows = 10000000
max_result_bytes = 1073741824"

# serve NAME PORT EXTRA: an `apron serve` on PORT with the lake and EXTRA TOML.
serve() {
  printf '[server]\nlisten = "127.0.0.1:%s"\n[ingest]\ntokens = ["%s"]\n[sql]\ntokens = ["%s"]\n[storage]\ndata_dir = "%s"\n%s\n%s\n%s\n' \
    "$2" "$TOKEN" "$VIEWER" "$TMP/$1" "$LAKE" "$QUERY" "$3" > "$TMP/$1.toml"
  "$APRON" serve --config "$TMP/$1.toml" >"$OUT/$1.out" 2>"$OUT/$1.log" &
  PIDS+=($!)
  wait_port "$2"
}

# Only raw samples are timed: the collectors' derived passes stay off.
COST=$'[cost]\nenabled = false\n[rollup]\nenabled = false'
A=$(free_port); B=$(free_port)
serve rack-a "$A" "$COST"$'\n[cluster]\nrole = "collector"\nshard = "rack-a"\nfreshness = "5s"\nheartbeat = "2s"'
serve rack-b "$B" "$COST"$'\n[cluster]\nrole = "collector"\nshard = "rack-b"\nfreshness = "5s"\nheartbeat = "2s"'
END=$(( $(date +%s) / 60 * 60 ))
echo "shipping $((GPUS / 2)) GPUs x ${HOURS} h to each shard"
APRON_INGEST_TOKEN=$TOKEN "$HISTORY" --server "http://127.0.0.1:$A" --gpus $((GPUS / 2)) --hours "$HOURS" --end "$END" --seed 1 >"$OUT/history-a.txt" &
ha=$!
APRON_INGEST_TOKEN=$TOKEN "$HISTORY" --server "http://127.0.0.1:$B" --gpus $((GPUS / 2)) --hours "$HOURS" --end "$END" --seed 2 >"$OUT/history-b.txt"
wait $ha
WINDOWS=$(( $(sed -n 's/.*windows=\([0-9]*\).*/\1/p' "$OUT/history-a.txt") + $(sed -n 's/.*windows=\([0-9]*\).*/\1/p' "$OUT/history-b.txt") ))

SCHED=$(free_port)
NODE="$TMP/node.toml"
printf '%s\n' "$LAKE" > "$NODE"
"$APRON" ballista scheduler --config "$NODE" --bind "127.0.0.1:$SCHED" --external-host 127.0.0.1 >"$OUT/scheduler.out" 2>"$OUT/scheduler.log" &
PIDS+=($!)
declare -A NODE_PID=([scheduler]=$!)
wait_port "$SCHED"
executor() {
  local flight grpc
  flight=$(free_port); grpc=$(free_port)
  mkdir -p "$TMP/$1"
  "$APRON" ballista executor --config "$NODE" --scheduler "df://127.0.0.1:$SCHED" --bind "127.0.0.1:$flight" \
    --grpc-port "$grpc" --external-host 127.0.0.1 --vcores "$VCORES" --work-dir "$TMP/$1" >"$OUT/$1.out" 2>"$OUT/$1.log" &
  PIDS+=($!)
  NODE_PID[$1]=$!
  wait_port "$flight"
}
executor executor-1
L=$(free_port); C=$(free_port)
serve local "$L" $'[recommend]\nenabled = false\n[cluster]\nrole = "query"\nrefresh = "1s"'
serve cluster "$C" $'[recommend]\nenabled = false\n[cluster]\nrole = "query"\nrefresh = "1s"\n'"[query.ballista]
scheduler = \"df://127.0.0.1:$SCHED\"
min_scan_bytes = 0
fallback_local = false"

sql() { # PORT TOKEN SQL -> body on stdout; "seconds engine" on fd 3
  curl -sS -D "$TMP/headers" -o "$TMP/body" -w '%{time_total}' -H "Authorization: Bearer $2" -H 'Accept: text/csv' \
    --data-binary "$3" "http://127.0.0.1:$1/api/v1/sql" >"$TMP/time"
  local engine=local
  grep -qi '^apron-engine: ballista' "$TMP/headers" && engine=ballista
  echo "$(cat "$TMP/time") $engine" >&3
  cat "$TMP/body"
}

echo "waiting for the lake to hold all $WINDOWS windows"
for _ in $(seq 1 600); do
  n=$(sql "$L" "$VIEWER" "SELECT count(*) FROM gpu_samples" 3>/dev/null | tail -1)
  [[ "$n" == "$WINDOWS" ]] && break
  sleep 2
done
[[ "$n" == "$WINDOWS" ]] || { echo "the lake holds $n of $WINDOWS windows" >&2; exit 1; }
# Nothing else runs while the queries are timed: the collectors stop (the lake keeps
# what they persisted; the shards turn stale, which changes no answer) and the query
# servers' recommendation refresher is off.
for p in rack-a rack-b; do pkill -TERM -f "serve --config $TMP/$p.toml" || true; done
sleep 5
FILES=$(find "$TMP/s3/apron/lake/gpu_samples" -name '*.parquet' | wc -l)
BYTES=$(du -sb "$TMP/s3/apron/lake/gpu_samples" | cut -f1)

NAMES=(full-scan hourly-fleet hourly-per-gpu)
TOKENS=("$VIEWER" "$VIEWER" "$VIEWER")
QUERIES=(
  "SELECT count(*), round(avg(sm_active), 6), sum(power_watts * window_s) AS joules, max(gpu_util) FROM gpu_samples"
  "SELECT date_trunc('hour', time) AS h, count(*) AS windows, round(avg(sm_active), 6) AS sm FROM gpu_samples GROUP BY 1 ORDER BY 1"
  "SELECT gpu_uuid, date_trunc('hour', time) AS h, round(avg(sm_active), 6) AS sm, max(fb_used_bytes) AS fb FROM gpu_samples GROUP BY 1, 2 ORDER BY 1, 2"
)

# time_setup LABEL PORT: median seconds per query into $OUT/<label>.tsv, answers kept.
time_setup() {
  : >"$OUT/$1.tsv"
  for i in "${!QUERIES[@]}"; do
    sql "$2" "${TOKENS[$i]}" "${QUERIES[$i]}" 3>/dev/null >/dev/null   # warm (footers, connections)
    : >"$TMP/times"
    for _ in $(seq 1 "$RUNS"); do
      sql "$2" "${TOKENS[$i]}" "${QUERIES[$i]}" 3>>"$TMP/times" >"$OUT/$1.${NAMES[$i]}.csv"
    done
    med=$(cut -d' ' -f1 "$TMP/times" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
    engine=$(cut -d' ' -f2 "$TMP/times" | sort -u | tr '\n' ' ')
    printf '%s\t%s\t%s\n' "${NAMES[$i]}" "$med" "$engine" >>"$OUT/$1.tsv"
  done
}

time_setup local "$L"
time_setup one-executor "$C"
executor executor-2
sleep 3
time_setup two-executors "$C"

{
  echo "ballista benchmark: $GPUS GPUs x $HOURS h = $WINDOWS windows in 2 shards ($FILES gpu_samples files, $BYTES bytes), VCORES=$VCORES per executor, median of $RUNS"
  echo "binaries: $BIN_DIR"
  printf '%-16s %10s %14s %14s %12s %12s %s\n' query local_s one_exec_s two_exec_s two/one local/two same_answers
  for i in "${!NAMES[@]}"; do
    n=${NAMES[$i]}
    l=$(awk -v n="$n" '$1==n {print $2}' "$OUT/local.tsv")
    o=$(awk -v n="$n" '$1==n {print $2}' "$OUT/one-executor.tsv")
    t=$(awk -v n="$n" '$1==n {print $2}' "$OUT/two-executors.tsv")
    same=no
    if cmp -s "$OUT/local.$n.csv" "$OUT/one-executor.$n.csv" && cmp -s "$OUT/local.$n.csv" "$OUT/two-executors.$n.csv"; then same=yes; fi
    printf '%-16s %10s %14s %14s %12s %12s %s\n' "$n" "$l" "$o" "$t" \
      "$(python3 -c "print(f'{$t/$o:.2f}')")" "$(python3 -c "print(f'{$l/$t:.2f}')")" "$same"
  done
  echo "engines (one executor): $(cut -f3 "$OUT/one-executor.tsv" | sort -u | tr '\n' ' ')"
  for p in scheduler executor-1 executor-2; do
    echo "$p peak RSS (VmHWM): $(awk '/VmHWM/ {print $2, $3}' "/proc/${NODE_PID[$p]}/status" 2>/dev/null)"
  done
  for p in local cluster; do
    pid=$(pgrep -f "serve --config $TMP/$p.toml" | head -1 || true)
    echo "query server $p peak RSS (VmHWM): $(awk '/VmHWM/ {print $2, $3}' "/proc/$pid/status" 2>/dev/null)"
  done
} | tee "$OUT/summary.txt"
