#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/ for a fixed time and prints a summary.
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET]        (default 60)
#
# Environment:
#   FUZZ_TARGETS="a b"     only these targets (default: all, `cargo fuzz list`)
#   FUZZ_RSS_LIMIT_MB=N    libFuzzer's -rss_limit_mb (default 4096; also the malloc limit)
#   FUZZ_TIMEOUT_S=N       libFuzzer's -timeout per input (default 20)
#   FUZZ_NICE=N            niceness of the build and the runs (default 10)
#   FUZZ_BUILD_ONLY=1      install cargo-fuzz and build the targets, run nothing
#
# The machine has only the stable toolchain: RUSTC_BOOTSTRAP=1 lets cargo-fuzz use the
# nightly flags it needs. cargo-fuzz itself is installed from crates.io into
# ~/.cache/apron-tools (outside the clone, like s3s-fs in install-test-tools.sh) when
# missing. Targets are built once, without a sanitizer (--sanitizer none) and with debug
# assertions (-a, which also turns on overflow checks); docs/fuzzing.md says why.
#
# Each target starts from its kept seeds (fuzz/seeds/<t>) and crash regressions
# (fuzz/regressions/<t>) plus the working corpus of earlier runs (fuzz/corpus/<t>,
# git-ignored), with fuzz/dicts/<t>.dict where there is one. A crash stops that target;
# the others still run. Exits non-zero if any target crashed (or timed out, or ran out
# of memory) and names the artifact file.
set -euo pipefail

SECS="${1:-60}"
case "$SECS" in '' | *[!0-9]*) echo "usage: $0 [SECONDS_PER_TARGET]" >&2; exit 2 ;; esac
RSS_LIMIT_MB="${FUZZ_RSS_LIMIT_MB:-4096}"
TIMEOUT_S="${FUZZ_TIMEOUT_S:-20}"
NICE="${FUZZ_NICE:-10}"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# ── cargo-fuzz, built once into the tools cache ───────────────────────────────────
CARGO_FUZZ_VERSION=0.13.2
TOOLS="$HOME/.cache/apron-tools"
CARGO_FUZZ="${APRON_CARGO_FUZZ:-$TOOLS/bin/cargo-fuzz}"
if ! { [ -x "$CARGO_FUZZ" ] && "$CARGO_FUZZ" fuzz --version 2>/dev/null | grep -q " $CARGO_FUZZ_VERSION"; }; then
  echo "fuzz.sh: installing cargo-fuzz $CARGO_FUZZ_VERSION into $TOOLS" >&2
  nice -n "$NICE" cargo install --quiet --locked cargo-fuzz --version "$CARGO_FUZZ_VERSION" --root "$TOOLS"
  CARGO_FUZZ="$TOOLS/bin/cargo-fuzz"
fi

export RUSTC_BOOTSTRAP=1
# The same flags for build and run, or `cargo fuzz run` rebuilds.
BASE_FLAGS=(--sanitizer none --debug-assertions --fuzz-dir fuzz)
# server_config needs the server crate (and DataFusion), behind the `server` feature;
# the other targets build without it, so they do not wait for (or rebuild with) it.
flags_for() {
  FLAGS=("${BASE_FLAGS[@]}")
  if [ "$1" = server_config ]; then FLAGS+=(--features server); fi
}

if [ -n "${FUZZ_TARGETS:-}" ]; then
  read -r -a TARGETS <<<"$FUZZ_TARGETS"
else
  mapfile -t TARGETS < <("$CARGO_FUZZ" fuzz list --fuzz-dir fuzz)
fi

echo "fuzz.sh: building ${TARGETS[*]} (the first build with server_config takes long)" >&2
for t in "${TARGETS[@]}"; do
  flags_for "$t"
  nice -n "$NICE" "$CARGO_FUZZ" fuzz build "${FLAGS[@]}" "$t"
done
if [ -n "${FUZZ_BUILD_ONLY:-}" ]; then exit 0; fi

# ── runs ──────────────────────────────────────────────────────────────────────────
LOGS="fuzz/logs"
mkdir -p "$LOGS"
declare -a ROWS=()
failed=0
for t in "${TARGETS[@]}"; do
  flags_for "$t"
  mkdir -p "fuzz/corpus/$t" "fuzz/artifacts/$t"
  dirs=("fuzz/corpus/$t")
  for d in "fuzz/seeds/$t" "fuzz/regressions/$t"; do
    if [ -d "$d" ]; then dirs+=("$d"); fi
  done
  opts=(-max_total_time="$SECS" -rss_limit_mb="$RSS_LIMIT_MB" -timeout="$TIMEOUT_S" -print_final_stats=1)
  if [ -f "fuzz/dicts/$t.dict" ]; then opts+=(-dict="fuzz/dicts/$t.dict"); fi
  log="$LOGS/$t.log"
  echo "fuzz.sh: $t for ${SECS}s (log $log)" >&2
  rc=0
  nice -n "$NICE" "$CARGO_FUZZ" fuzz run "${FLAGS[@]}" "$t" "${dirs[@]}" -- "${opts[@]}" >"$log" 2>&1 || rc=$?

  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  if [ -z "$runs" ]; then runs=$(grep -oE '^#[0-9]+' "$log" | tail -1 | tr -d '#'); fi
  last=$(grep -E '^#[0-9]+.*cov: ' "$log" | tail -1 || true)
  cov=$(sed -nE 's/.*cov: ([0-9]+).*/\1/p' <<<"$last")
  ft=$(sed -nE 's/.*ft: ([0-9]+).*/\1/p' <<<"$last")
  corp=$(sed -nE 's/.*corp: ([0-9]+).*/\1/p' <<<"$last")
  artifact=$(sed -nE 's/.*Test unit written to (.*)$/\1/p' "$log" | tail -1)
  crash=0
  if [ "$rc" -ne 0 ] || [ -n "$artifact" ]; then
    crash=1
    failed=1
    kind=$(grep -oE 'ERROR: libFuzzer: [a-z-]+|panicked at [^:]*:[0-9]+' "$log" | head -1 || true)
    echo "fuzz.sh: $t CRASHED (exit $rc${kind:+, $kind}); artifact: ${artifact:-none written, see $log}" >&2
    echo "fuzz.sh:   reproduce: RUSTC_BOOTSTRAP=1 cargo fuzz run ${FLAGS[*]} $t ${artifact:-<artifact>}" >&2
    echo "fuzz.sh:   then keep it: cp ${artifact:-<artifact>} fuzz/regressions/$t/ and fix the parser" >&2
  fi
  ROWS+=("$t|${runs:-?}|${cov:-?}|${ft:-?}|${corp:-?}|$crash|${artifact:--}")
done

echo
printf '%-16s %12s %8s %9s %7s %8s  %s\n' target runs cov features corpus crashes artifact
for r in "${ROWS[@]}"; do
  IFS='|' read -r t runs cov ft corp crash artifact <<<"$r"
  printf '%-16s %12s %8s %9s %7s %8s  %s\n' "$t" "$runs" "$cov" "$ft" "$corp" "$crash" "$artifact"
done
echo "(${SECS}s per target; -rss_limit_mb=$RSS_LIMIT_MB; logs in $LOGS/)"
exit "$failed"
