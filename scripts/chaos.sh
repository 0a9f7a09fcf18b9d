#!/usr/bin/env bash
# Chaos run against the real binaries (docs/chaos.md has the results and the reasoning):
#   one `apron serve` (data directory on a small tmpfs) and N `apron-agent --source sim`
#   processes, each with its own spool; SIGKILLs of the collector and the agents at random
#   moments, each restarted after a random short delay; some agents under libfaketime
#   (+1 h, −10 min, a clock running at 80 % speed); the collector's disk filled to ENOSPC
#   in episodes and freed again. Afterwards: stop killing, let every spool drain, stop
#   everything gracefully, and check that every row the agents produced and the
#   collector acknowledged is stored exactly once and that every Parquet file reads.
#
#   scripts/chaos.sh [--kills N] [--agents N] [--enospc N] [--tmpfs-size SIZE]
#                    [--keep] [--no-build] [--bin-dir DIR] [-- extra scripts/chaos/run.py options]
#   --bin-dir DIR: take apron and apron-agent from DIR (no build), e.g. a build of a
#   clean `git archive HEAD` tree while the working tree does not compile
#   APRON_CHAOS_SEED=…  reproduces a run's kill schedule (printed at the start)
#
# Exit status: 0 when the check passes, 1 on any loss, duplicate, phantom row,
# unreadable file or unrecovered ENOSPC, 2 when the run itself could not be set up.
#
# Needs root for `mount -t tmpfs` (or, as a non-root user, a kernel that allows
# unprivileged user namespaces: the script then re-runs itself under
# `unshare --user --map-root-user --mount`). Installs libfaketime (Debian `faketime`)
# with apt-get when missing, and duckdb/pyarrow with pip, as scripts/install-test-tools.sh
# does. scripts/chaos-kill.sh is the collector-only kill loop of the server test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
orig_args=("$@")

kills=120 agents=6 enospc=3 tmpfs_size=32m keep=0 build=1 bin_dir=""
extra=()
while (($#)); do
  case "$1" in
    --kills) kills=$2; shift 2 ;;
    --agents) agents=$2; shift 2 ;;
    --enospc) enospc=$2; shift 2 ;;
    --tmpfs-size) tmpfs_size=$2; shift 2 ;;
    --keep) keep=1; shift ;;
    --no-build) build=0; shift ;;
    --bin-dir) bin_dir=$2; build=0; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "chaos.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
seed=${APRON_CHAOS_SEED:-$(( ($(date +%s%N) / 1000) % 4294967296 ))}

# ── tools ──────────────────────────────────────────────────────────────────────────
LIBFAKETIME=/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1
if [ ! -e "$LIBFAKETIME" ]; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends faketime >/dev/null
fi
if ! python3 -c "import duckdb, pyarrow" >/dev/null 2>&1; then
  python3 -m pip install --quiet --disable-pip-version-check "duckdb>=1.1" "pyarrow>=17"
fi

# ── a private mount namespace when not root ─────────────────────────────────────────
if [ "$(id -u)" -ne 0 ] && [ -z "${APRON_CHAOS_IN_USERNS:-}" ]; then
  echo "chaos.sh: not root; re-running in a user + mount namespace (unshare -rm) for the tmpfs"
  exec env APRON_CHAOS_IN_USERNS=1 APRON_CHAOS_SEED="$seed" unshare --user --map-root-user --mount "$0" "${orig_args[@]}"
fi

# ── binaries: built here, then copied so other rebuilds cannot change them mid-run ──
work=$(mktemp -d /tmp/apron-chaos.XXXXXX)
mnt="$work/disk"
mkdir -p "$work/bin" "$mnt"
# shellcheck disable=SC2317  # run by the EXIT trap
cleanup() {
  local rc=$?
  if mountpoint -q "$mnt"; then
    # The tmpfs goes with the unmount: keep a copy of the data for a failed or --keep run.
    if [ "$keep" = 1 ] || [ "$rc" -ne 0 ]; then cp -a "$mnt/data" "$work/data" 2>/dev/null || true; fi
    umount -l "$mnt" || true
  fi
  if [ "$keep" = 1 ] || [ "$rc" -ne 0 ]; then
    echo "chaos.sh: evidence kept in $work"
  else
    rm -rf "$work"
  fi
  exit "$rc"
}
trap cleanup EXIT
if [ "$build" = 1 ]; then
  nice -n 10 cargo build --quiet -p apron --bin apron -p apron-agent --bin apron-agent
fi
if [ -n "$bin_dir" ]; then
  target_dir="" ; src_dir="$bin_dir"
else
  target_dir=$(cargo metadata --format-version 1 --no-deps 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])' || echo "$repo/target")
  src_dir="$target_dir/debug"
fi
cp "$src_dir/apron" "$src_dir/apron-agent" "$work/bin/"
echo "chaos.sh: binaries copied to $work/bin ($(sha256sum "$work/bin/apron" | cut -c1-12) apron, $(sha256sum "$work/bin/apron-agent" | cut -c1-12) apron-agent)"

# ── the collector's disk: a small tmpfs ─────────────────────────────────────────────
if ! mount -t tmpfs -o "size=$tmpfs_size,mode=0755" apron-chaos "$mnt"; then
  echo "chaos.sh: cannot mount a tmpfs on $mnt (need root or unprivileged user namespaces)" >&2
  exit 2
fi
echo "chaos.sh: collector data on tmpfs $mnt ($(df -h --output=size "$mnt" | tail -1 | tr -d ' '))"

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
echo "chaos.sh: APRON_CHAOS_SEED=$seed  kills=$kills agents=$agents enospc=$enospc"
set +e
python3 "$repo/scripts/chaos/run.py" --work "$work" --bin "$work/bin" --mnt "$mnt" --port "$port" \
  --seed "$seed" --kills "$kills" --agents "$agents" --enospc "$enospc" "${extra[@]}"
run_rc=$?
python3 "$repo/scripts/chaos/verify.py" "$work" "$mnt/data"
verify_rc=$?
set -e
python3 - "$work/summary.json" <<'EOF' || true
import json, sys
s = json.load(open(sys.argv[1]))
k, e, q, p = s["kills"], s["enospc"], s["sql"] or {}, s["parquet"]
print()
print("═════════════════════════════ chaos summary ═════════════════════════════")
print(f"seed {s['seed']}: {k['total']} SIGKILLs ({k['collector']} collector, {k['agent']} agent; {k['during_enospc']} while the disk was full)")
print(f"restarts: {s['restarts']['collector']} collector, {s['restarts']['agent']} agent; unexpected exits: {s['unexpected_exits']}")
shifts = ", ".join("%s: %s" % (a, v["label"]) for a, v in (s["clock_shifts"] or {}).items())
print(f"clock shifts: {shifts}; observed offsets (s): {s['observed_agent_clock_offset_s']}")
print(f"ENOSPC: {e['episodes']} episodes; answers while full {e['answers_while_full']}; after freeing {e['answers_after_free']}; "
      f"{e['collector_log_storage_full_lines']} 'storage full' collector log lines; spools peaked at {e['max_total_spool_bytes_while_full']} bytes")
print(f"rows produced {s['rows_produced']}; stored (SQL) {q.get('stored_rows')}; stored (Parquet) {p['stored_rows']}")
print(f"missing: {q.get('missing_allowed_unacked_at_kill')} un-acknowledged at a kill (allowed, max tail {q.get('max_lost_tail_rows')} rows / {q.get('max_lost_tail_span_s')} s), "
      f"{q.get('missing_in_holes')} in holes, {q.get('missing_from_graceful_instances')} from graceful stops; "
      f"duplicated {q.get('duplicated_rows')}; phantom {q.get('phantom_rows')}")
print(f"Parquet files checked {s['parquet_files_checked']}, unreadable {s['unreadable_files']}")
print(f"RESULT: {s['result']}")
for f in s["failures"]:
    print(f"  - {f}")
EOF
if [ "$run_rc" -ne 0 ] && [ "$verify_rc" -eq 0 ]; then exit 2; fi
exit "$verify_rc"
