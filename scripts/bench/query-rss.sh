#!/usr/bin/env bash
# Peak RSS of single SQL queries: for each `name<TAB>sql` line on stdin, a fresh
# `apron serve` over DATA (background passes off, so only the query runs), its VmHWM
# reset (/proc/PID/clear_refs) before the query and read after it.
#   BIN=target/release/apron DATA=/tmp/rss/data scripts/bench/query-rss.sh < queries.tsv
# Prints: name, HTTP status, RSS before, peak during, seconds. The data directory must
# not be in use (stop `apron up` first). Used to find which evaluator query peaks
# (docs/benchmarks.md, "Memory").
set -euo pipefail
BIN=${BIN:-target/release/apron}
DATA=${DATA:?set DATA to a data directory}
PORT=${PORT:-19402}
work=$(mktemp -d)
cat >"$work/serve.toml" <<EOF
[ingest]
tokens = ["query-rss-ingest-token"]
[sql]
tokens = ["query-rss-sql-token"]
[storage]
data_dir = "$DATA"
[rollup]
enabled = false
[cost]
enabled = false
[alerts]
enabled = false
[recommend]
enabled = false
EOF
url="http://127.0.0.1:$PORT"
pid=
trap '[ -n "$pid" ] && kill $pid 2>/dev/null; rm -rf "$work"' EXIT
while IFS=$'\t' read -r name sql; do
  [ -n "$name" ] || continue
  "$BIN" serve --config "$work/serve.toml" --http "127.0.0.1:$PORT" >"$work/serve.log" 2>&1 &
  pid=$!
  for _ in $(seq 100); do curl -sf "$url/healthz" >/dev/null && break; sleep 0.2; done
  echo 5 >"/proc/$pid/clear_refs"
  before=$(awk '/^VmRSS/ {print $2}' "/proc/$pid/status")
  start=$(date +%s%N)
  code=$(curl -s -o "$work/out" -w '%{http_code}' -H 'Authorization: Bearer query-rss-sql-token' \
    -H 'Content-Type: text/plain' --data-binary "$sql" "$url/api/v1/sql")
  ms=$((($(date +%s%N) - start) / 1000000))
  hwm=$(awk '/^VmHWM/ {print $2}' "/proc/$pid/status")
  printf '%-16s http=%s rss_before=%5d MiB peak=%5d MiB %6d ms\n' "$name" "$code" $((before / 1024)) $((hwm / 1024)) "$ms"
  [ "$code" = 200 ] || head -c 300 "$work/out"
  kill $pid; wait $pid 2>/dev/null || true
  pid=
done
