#!/usr/bin/env bash
# Storage benchmark (docs/benchmarks.md, "Storage: Apron vs Prometheus, VictoriaMetrics,
# DuckDB"): the same simulated-fleet dataset stored by Apron's collector and by three
# peers, one after another in one run, on the same machine; prints absolute numbers and
# Apron/peer ratios. Measured, never asserted: it fails only when something breaks.
#
# Dataset (server/examples/bench_dataset.rs): SimSource::history of GPUS simulated GPUs
# (seed 42, the fleet `apron up` backfills) over HOURS ending at END, 1 s windows. Apron
# receives it as Arrow IPC batches of CHUNK_ROWS rows; the peers as Prometheus text /
# OpenMetrics with one series per GPU per measurement column and the decimal Apron
# stores. "values" = non-NULL measurement cells, the same count for everyone.
#
#   Apron        `apron serve` (default config) ← bench_dataset post (POST /api/v1/ingest,
#                one batch at a time: WAL group-commit fsync, memtable); ingest ends when
#                `apron serve` has exited on SIGTERM, i.e. after its final persist to
#                Parquet. Bytes: the data directory. Queries: POST /api/v1/sql on a
#                second `apron serve` over the same directory.
#   Prometheus   promtool tsdb create-blocks-from openmetrics (backfill into blocks of
#                up to PROM_BLOCK); bytes: the blocks. Queries: prometheus over them.
#   VictoriaMetrics  victoria-metrics ← curl POST /api/v1/import/prometheus, then
#                /internal/force_flush; bytes: the storage directory once its background
#                merges are done (VM_SETTLE s at most). Queries: nocache=1.
#   DuckDB       CREATE TABLE AS SELECT * FROM Apron's Parquet files + CHECKPOINT, in a
#                database file; queries in-process (python duckdb).
#
# Peak RSS: /usr/bin/time -v (apron serve, promtool, the DuckDB loader), VmHWM from
# /proc/<pid>/status (victoria-metrics: after import + flush; query servers: after the
# queries).
#
# Parameters (environment):
#   GPUS=64 HOURS=2 END=<unix s, default 2026-11-29T12:00:00Z> CHUNK_ROWS=20000
#   QUERY_RUNS=5 OUT=bench-out/storage PROM_BLOCK=54h VM_SETTLE=60 (s, at most)
#   APRON_SETTLE=120 (s at most: the query server's first derivation of the day, see below)
#   READING_ENCODING=delta ZSTD_LEVEL=3   Apron's [storage] reading_encoding and zstd_level
#                (the defaults; READING_ENCODING=byte_stream_split for the compact layout)
#   TARGET_DIR=<repo>/target/release  (where apron and examples/bench_dataset are)
#   REUSE_BUILD=0   1: use the binaries already in TARGET_DIR (no cargo build)
#   REUSE_DATASET=1 keep OUT/dataset when its meta.json matches GPUS/HOURS/END/CHUNK_ROWS
#   KEEP_DATA=0     1: keep the stores (apron-data, prom-data, vm-data, duck.db) after the run
set -euo pipefail

GPUS=${GPUS:-64}
HOURS=${HOURS:-2}
END=${END:-1795953600}
CHUNK_ROWS=${CHUNK_ROWS:-20000}
QUERY_RUNS=${QUERY_RUNS:-5}
OUT=${OUT:-bench-out/storage}
PROM_BLOCK=${PROM_BLOCK:-54h}
VM_SETTLE=${VM_SETTLE:-60}
APRON_SETTLE=${APRON_SETTLE:-120}
READING_ENCODING=${READING_ENCODING:-delta}
ZSTD_LEVEL=${ZSTD_LEVEL:-3}
REUSE_BUILD=${REUSE_BUILD:-0}
REUSE_DATASET=${REUSE_DATASET:-1}
KEEP_DATA=${KEEP_DATA:-0}

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
TARGET_DIR=${TARGET_DIR:-$root/target/release}
helpers="$root/scripts/bench/storage"
apron_bin="$TARGET_DIR/apron"
dataset_bin="$TARGET_DIR/examples/bench_dataset"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
results="$OUT/results.txt"
dataset="$OUT/dataset"

log() { printf '[bench-storage] %s\n' "$*" >&2; }
record() { printf '%s %s\n' "$1" "$2" >> "$results"; }
now() { date +%s.%N; }
elapsed() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.3f}')" "$1" "$2"; }
maxrss_kb() { awk -F': ' '/Maximum resident set size/ {print $2}' "$1"; }
hwm_kb() { awk '/^VmHWM:/ {print $2}' "/proc/$1/status"; }
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
settle_cpu() { # pid, seconds at most; prints 1 once the process used < 5 % of a core for 3 s in a row
    local pid=$1 quiet=0 i before after hz
    hz=$(getconf CLK_TCK)
    before=$(cpu_ticks "$pid")
    for ((i = 0; i < $2; i++)); do
        sleep 1
        after=$(cpu_ticks "$pid")
        if [ $(( (after - before) * 20 )) -lt "$hz" ]; then quiet=$((quiet + 1)); else quiet=0; fi
        before=$after
        [ "$quiet" -ge 3 ] && { echo 1; return; }
    done
    echo 0
}
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_http() { # url, seconds
    local i
    for ((i = 0; i < $2 * 10; i++)); do
        curl -fsS -o /dev/null "$1" 2>/dev/null && return 0
        sleep 0.1
    done
    log "timed out waiting for $1"
    return 1
}
pids=()
cleanup() {
    local p
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
}
trap cleanup EXIT

# ---------------------------------------------------------------- 1. prerequisites
sudo_=""
[ "$(id -u)" = 0 ] || sudo_="sudo"
need_apt=()
command -v victoria-metrics >/dev/null || need_apt+=(victoria-metrics)
command -v prometheus >/dev/null || need_apt+=(prometheus)
command -v promtool >/dev/null || need_apt+=(prometheus)
[ -x /usr/bin/time ] || need_apt+=(time)
if [ "${#need_apt[@]}" -gt 0 ]; then
    log "installing ${need_apt[*]}"
    $sudo_ apt-get update -qq
    # policy-rc.d or no systemd: the packaged services are not started; this script
    # starts its own instances.
    $sudo_ env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}"
fi
python3 -c 'import duckdb' 2>/dev/null || { log "installing duckdb (pip)"; python3 -m pip install --quiet duckdb; }

if [ "$REUSE_BUILD" != 1 ]; then
    log "building release apron and the bench_dataset example"
    CARGO_TARGET_DIR="$(dirname "$TARGET_DIR")" cargo build --release -p apron --bin apron --example bench_dataset
fi
[ -x "$apron_bin" ] && [ -x "$dataset_bin" ] || { log "missing $apron_bin or $dataset_bin"; exit 1; }

: > "$results"
record run.date "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
record machine.nproc "$(nproc)"
record machine.cpu "$(lscpu | awk -F: '/Model name/ {gsub(/^ +/, "", $2); print $2; exit}')"
record machine.mem_kb "$(awk '/MemTotal/ {print $2}' /proc/meminfo)"
# The checkout's HEAD: the binary's sources only if it was built here (REUSE_BUILD=0).
record version.repo_head "$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)"
record version.apron_binary "$apron_bin sha256 $(sha256sum "$apron_bin" | cut -c1-16) built $(date -u -r "$apron_bin" +%Y-%m-%dT%H:%M:%SZ)"
record version.prometheus "$(prometheus --version 2>&1 | head -1)"
# The Debian build's -version prints nothing: the package version instead.
record version.victoria_metrics "$(dpkg-query -W -f '${Version}' victoria-metrics 2>/dev/null || victoria-metrics -version 2>&1 | head -1)"
record version.duckdb "$(python3 -c 'import duckdb; print(duckdb.__version__)')"

# ---------------------------------------------------------------- 2. dataset
want="$GPUS/$HOURS/$END/$CHUNK_ROWS"
have=""
[ -f "$dataset/meta.json" ] && have=$(python3 -c '
import json, sys
m = json.load(open(sys.argv[1]))
h = m["hours"]
print("/".join(str(x) for x in (m["gpus"], int(h) if h == int(h) else h, m["end_s"], m["chunk_rows"])))' "$dataset/meta.json")
if [ "$REUSE_DATASET" = 1 ] && [ "$have" = "$want" ]; then
    log "reusing the dataset in $dataset"
else
    log "generating the dataset: $GPUS GPUs x $HOURS h ending at $END"
    rm -rf "$dataset"
    "$dataset_bin" gen --gpus "$GPUS" --hours "$HOURS" --end "$END" --chunk-rows "$CHUNK_ROWS" --out "$dataset" >&2
fi
cp "$dataset/meta.json" "$OUT/meta.json"
values=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["values"])' "$dataset/meta.json")
record dataset.values "$values"
record dataset.prom_txt_bytes "$(stat -c %s "$dataset/prom.txt")"
record dataset.openmetrics_bytes "$(stat -c %s "$dataset/openmetrics.txt")"
# The peers read their text from the page cache, like Apron its batches.
cat "$dataset/prom.txt" "$dataset/openmetrics.txt" "$dataset"/apron/*.arrows > /dev/null

# ---------------------------------------------------------------- 3. Apron
log "Apron: ingest through apron serve"
apron_data="$OUT/apron-data"
rm -rf "$apron_data"
ingest_token="bench-ingest-$RANDOM$RANDOM"
apron_config="$OUT/apron.toml"
printf '[storage]\nreading_encoding = "%s"\nzstd_level = %s\n' "$READING_ENCODING" "$ZSTD_LEVEL" > "$apron_config"
record apron.config "reading_encoding=$READING_ENCODING zstd_level=$ZSTD_LEVEL"
sql_token="bench-sql-$RANDOM$RANDOM"
start_apron() { # log file, time file; sets apron_pid (the server, not /usr/bin/time), apron_tpid, apron_url
    local logf=$1 timef=$2
    APRON_INGEST_TOKEN=$ingest_token APRON_SQL_TOKEN=$sql_token APRON_LOG=warn \
        /usr/bin/time -v -o "$timef" "$apron_bin" serve --config "$apron_config" --http 127.0.0.1:0 --data "$apron_data" > "$logf" 2>&1 &
    local tpid=$!
    pids+=("$tpid")
    local i
    for ((i = 0; i < 600; i++)); do
        grep -q '^listening on ' "$logf" && break
        kill -0 "$tpid" 2>/dev/null || { cat "$logf" >&2; log "apron serve exited"; exit 1; }
        sleep 0.1
    done
    apron_url="http://$(awk '/^listening on / {print $3; exit}' "$logf")"
    apron_pid=$(pgrep -P "$tpid" | head -1)
    apron_tpid=$tpid
    # SIGTERM to /usr/bin/time would leave the server running: clean up the server itself.
    pids+=("$apron_pid")
}
start_apron "$OUT/apron-serve.log" "$OUT/apron-serve.time"
t0=$(now)
APRON_INGEST_TOKEN=$ingest_token "$dataset_bin" post --dir "$dataset" --server "$apron_url" | tee "$OUT/apron-post.log" >&2
t_post=$(now)
kill -TERM "$apron_pid"
wait "$apron_tpid"
t1=$(now)
record apron.post_s "$(elapsed "$t0" "$t_post")"
record apron.ingest_s "$(elapsed "$t0" "$t1")"
record apron.rss_kb "$(maxrss_kb "$OUT/apron-serve.time")"
record apron.bytes "$(du -sb "$apron_data" | cut -f1)"
record apron.parquet_bytes "$(find "$apron_data/gpu_samples" -name '*.parquet' -printf '%s\n' | awk '{s += $1} END {print s}')"
record apron.parquet_files "$(find "$apron_data/gpu_samples" -name '*.parquet' | wc -l)"
record apron.wal_bytes "$(du -sb "$apron_data/wal" 2>/dev/null | cut -f1 || echo 0)"

log "Apron: queries"
start_apron "$OUT/apron-query.log" "$OUT/apron-query.time"
# A server that opens a finished day it has not derived yet first materializes its
# gpu_samples_1m minutes, prices it in the ledger and runs alerts and recommendations;
# queried at once, the timings would measure that work too. Like VictoriaMetrics'
# merges, it is left to settle first.
settled=$(settle_cpu "$apron_pid" "$APRON_SETTLE")
record apron.settled "$settled"
record apron.note "[storage] reading_encoding=$READING_ENCODING zstd_level=$ZSTD_LEVEL; queries once the query server's first derivation of the day has settled (settled=$settled)"
python3 "$helpers/queries.py" apron "$apron_url" "$sql_token" "$OUT/meta.json" "$QUERY_RUNS" > "$OUT/apron.queries.json"
record apron.query_rss_kb "$(hwm_kb "$apron_pid")"
kill -TERM "$apron_pid"
wait "$apron_tpid" || true

# ---------------------------------------------------------------- 4. DuckDB
log "DuckDB: load Apron's Parquet files"
duck_db="$OUT/duck.db"
/usr/bin/time -v -o "$OUT/duck-load.time" python3 "$helpers/duck_load.py" "$apron_data" "$duck_db" > "$OUT/duck-load.json"
record duckdb.ingest_s "$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["load_s"])' "$OUT/duck-load.json")"
record duckdb.rss_kb "$(maxrss_kb "$OUT/duck-load.time")"
record duckdb.bytes "$(cat "$duck_db" "$duck_db.wal" 2>/dev/null | wc -c)"
record duckdb.note "ingest = CREATE TABLE AS SELECT from Apron's Parquet (not text), RSS includes the Python interpreter"
/usr/bin/time -v -o "$OUT/duck-query.time" \
    python3 "$helpers/queries.py" duckdb "$duck_db" "$OUT/meta.json" "$QUERY_RUNS" > "$OUT/duckdb.queries.json"
record duckdb.query_rss_kb "$(maxrss_kb "$OUT/duck-query.time")"

# ---------------------------------------------------------------- 5. Prometheus
log "Prometheus: promtool tsdb create-blocks-from openmetrics"
prom_data="$OUT/prom-data"
rm -rf "$prom_data"
mkdir -p "$prom_data"
t0=$(now)
/usr/bin/time -v -o "$OUT/promtool.time" promtool tsdb create-blocks-from openmetrics \
    --max-block-duration="$PROM_BLOCK" "$dataset/openmetrics.txt" "$prom_data" > "$OUT/promtool.log" 2>&1 \
    || { tail -20 "$OUT/promtool.log" >&2; exit 1; }
t1=$(now)
record prom.ingest_s "$(elapsed "$t0" "$t1")"
record prom.rss_kb "$(maxrss_kb "$OUT/promtool.time")"
record prom.bytes "$(du -sb "$prom_data" | cut -f1)"
record prom.blocks "$(find "$prom_data" -mindepth 1 -maxdepth 1 -type d | wc -l)"
record prom.samples "$(python3 -c '
import json, sys
print(sum(json.load(open(p))["stats"]["numSamples"] for p in sys.argv[1:]))' "$prom_data"/*/meta.json)"
record prom.note "ingest = promtool backfill of the OpenMetrics file into $PROM_BLOCK-max blocks (no WAL, no head)"

log "Prometheus: queries"
prom_port=$(free_port)
cat > "$OUT/prometheus.yml" <<'EOF'
global:
  scrape_interval: 1h
scrape_configs: []
EOF
prometheus --config.file="$OUT/prometheus.yml" --storage.tsdb.path="$prom_data" \
    --storage.tsdb.retention.time=100y --web.listen-address="127.0.0.1:$prom_port" \
    --query.max-samples=500000000 > "$OUT/prometheus.log" 2>&1 &
prom_pid=$!
pids+=("$prom_pid")
wait_http "http://127.0.0.1:$prom_port/-/ready" 120
python3 "$helpers/queries.py" prom "http://127.0.0.1:$prom_port" "$OUT/meta.json" "$QUERY_RUNS" > "$OUT/prom.queries.json"
record prom.query_rss_kb "$(hwm_kb "$prom_pid")"
kill -TERM "$prom_pid"
wait "$prom_pid" || true

# ---------------------------------------------------------------- 6. VictoriaMetrics
log "VictoriaMetrics: import"
vm_data="$OUT/vm-data"
rm -rf "$vm_data"
vm_port=$(free_port)
victoria-metrics -storageDataPath="$vm_data" -httpListenAddr="127.0.0.1:$vm_port" -retentionPeriod=100y \
    -search.disableCache -search.latencyOffset=0s -loggerLevel=WARN > "$OUT/victoria-metrics.log" 2>&1 &
vm_pid=$!
pids+=("$vm_pid")
vm_url="http://127.0.0.1:$vm_port"
wait_http "$vm_url/health" 60
record vm.start_rss_kb "$(hwm_kb "$vm_pid")"
t0=$(now)
curl -fsS -H 'Expect:' -X POST -T "$dataset/prom.txt" "$vm_url/api/v1/import/prometheus"
curl -fsS "$vm_url/internal/force_flush"
t1=$(now)
record vm.ingest_s "$(elapsed "$t0" "$t1")"
record vm.rss_kb "$(hwm_kb "$vm_pid")"
record vm.rows_added "$(curl -fsS "$vm_url/metrics" | awk '/^vm_rows_added_to_storage_total/ {print $2}')"
record vm.bytes_at_flush "$(du -sb "$vm_data" | cut -f1)"
# Background merges rewrite the flushed parts (the directory grows while a merge holds
# old and new parts): wait until no merge runs and the size holds still, VM_SETTLE s at most.
prev=-1
settled=0
for ((i = 0; i < VM_SETTLE * 2; i++)); do
    sleep 0.5
    merges=$(curl -fsS "$vm_url/metrics" | awk '/^vm_active_merges/ {s += $2} END {print s + 0}')
    size=$(du -sb "$vm_data" | cut -f1)
    if [ "$merges" = 0 ] && [ "$size" = "$prev" ]; then settled=1; break; fi
    prev=$size
done
record vm.bytes "$(du -sb "$vm_data" | cut -f1)"
record vm.settled "$settled"
record vm.note "ingest = POST /api/v1/import/prometheus (curl) + force_flush; bytes once merges are done (settled=$settled)"

log "VictoriaMetrics: queries"
python3 "$helpers/queries.py" vm "$vm_url" "$OUT/meta.json" "$QUERY_RUNS" > "$OUT/vm.queries.json"
record vm.query_rss_kb "$(hwm_kb "$vm_pid")"
kill -TERM "$vm_pid"
wait "$vm_pid" || true

# ---------------------------------------------------------------- 7. report
python3 "$helpers/report.py" "$OUT" | tee "$OUT/report.txt"
if [ "$KEEP_DATA" != 1 ]; then
    rm -rf "$apron_data" "$prom_data" "$vm_data" "$duck_db" "$duck_db.wal"
fi
