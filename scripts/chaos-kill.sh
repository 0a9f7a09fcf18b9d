#!/usr/bin/env bash
# The collector's kill -9 durability loop, longer than in CI: kill the server at random
# points during concurrent ingest, N times (default 100), checking after every kill that
# each acknowledged row is stored exactly once and every Parquet file reads.
#   scripts/chaos-kill.sh [ITERATIONS]      APRON_CHAOS_SEED=… reproduces a run
# The whole-system chaos run (real agents and spools, skewed clocks, a full disk) is
# scripts/chaos.sh; docs/chaos.md compares the two.
set -euo pipefail
cd "$(dirname "$0")/.."
export APRON_CHAOS_ITERATIONS="${1:-100}"
cargo build --quiet -p apron-agent
cargo test --quiet -p apron --test server kill_9_loses_no_acknowledged_row -- --exact --nocapture
