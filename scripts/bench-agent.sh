#!/usr/bin/env bash
# Agent overhead benchmark (docs/benchmarks.md, "Agent overhead"): apron-agent and a
# peer exporter (nvitop-exporter, NVML through nvidia-ml-py) side by side on the same
# fake libnvidia-ml.so, same scenario, same per-call latency table.
#
# Measures, over DURATION seconds after a WARMUP: CPU time from /proc/<pid>/stat
# (utime + stime, all threads) and peak RSS from /proc/<pid>/status (VmHWM), while a
# loop scrapes every /metrics every SCRAPE_EVERY seconds as Prometheus would. Then runs
# the agent under valgrind --tool=callgrind for CALLGRIND_SECONDS and divides the
# instructions by the windows it closed. Speed is measured, not asserted: this prints
# numbers and ratios and never fails on them.
#
# Processes measured (all four run concurrently, side by side):
#   agent-default  apron-agent, default sampler intervals (utilization 100 ms, gpm 250 ms,
#                  processes 5 s, health 10 s, the rest 1 s)
#   agent-1s       apron-agent with every sampler at 1 s (the same cadence as the peer)
#   peer-1s        nvitop-exporter --interval 1.0 (its default)
#   peer-fast      nvitop-exporter --interval $PEER_FAST_INTERVAL (0.25 s: the smallest it
#                  accepts; it refuses 0.1 s)
#
# Parameters (environment):
#   DURATION=60 GPUS=8 OUT=bench-out/agent WARMUP=5 SCRAPE_EVERY=15
#   PEER_VENV=${XDG_CACHE_HOME:-$HOME/.cache}/apron-bench/venv   (outside the clone)
#   PEER_VERSION=1.7.2 PEER_FAST_INTERVAL=0.25
#   LATENCY_MODE=sleep   sleep | spin | none (how the fake spends [latency_us])
#   CALLGRIND_SECONDS=20 (0 skips the callgrind run)
#   REUSE_BUILD=0        1: reuse the release binaries already built (no cargo build)
set -euo pipefail

DURATION=${DURATION:-60}
GPUS=${GPUS:-8}
OUT=${OUT:-bench-out/agent}
WARMUP=${WARMUP:-5}
SCRAPE_EVERY=${SCRAPE_EVERY:-15}
PEER_VENV=${PEER_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/apron-bench/venv}
PEER_VERSION=${PEER_VERSION:-1.7.2}
PEER_FAST_INTERVAL=${PEER_FAST_INTERVAL:-0.25}
LATENCY_MODE=${LATENCY_MODE:-sleep}
CALLGRIND_SECONDS=${CALLGRIND_SECONDS:-20}
REUSE_BUILD=${REUSE_BUILD:-0}

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
bench="$root/scripts/bench"
agent_bin="$root/target/release/apron-agent"
fake_lib="$root/target/release/libnvidia_ml.so"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
raw="$OUT/results.txt"
clk_tck=$(getconf CLK_TCK)

log() { printf '[bench-agent] %s\n' "$*" >&2; }

# ---------------------------------------------------------------- 1. prerequisites
if [ "$REUSE_BUILD" != 1 ]; then
    log "building release apron-agent and apron-fake-nvml"
    cargo build --release -p apron-agent -p apron-fake-nvml
fi
[ -x "$agent_bin" ] && [ -f "$fake_lib" ] || { log "missing $agent_bin or $fake_lib"; exit 1; }

peer_installed=$("$PEER_VENV/bin/pip" show nvitop-exporter 2>/dev/null || true)
if ! grep -qx "Version: $PEER_VERSION" <<<"$peer_installed"; then
    log "creating $PEER_VENV with nvitop-exporter==$PEER_VERSION"
    mkdir -p "$(dirname "$PEER_VENV")"
    python3 -m venv "$PEER_VENV"
    "$PEER_VENV/bin/pip" install --quiet "nvitop-exporter==$PEER_VERSION"
fi

if [ "$CALLGRIND_SECONDS" != 0 ] && ! command -v valgrind >/dev/null; then
    log "installing valgrind"
    sudo_=""; [ "$(id -u)" = 0 ] || sudo_="sudo"
    $sudo_ apt-get update -qq && $sudo_ env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind
fi

# ---------------------------------------------------------------- 2. scenario
scenario="$OUT/scenario.toml"
python3 "$bench/gen_scenario.py" "$GPUS" "$LATENCY_MODE" > "$scenario"
cat > "$OUT/agent-1s.toml" <<'EOF'
# Every field group once per second: the peer's cadence.
[samplers]
utilization = "1s"
gpm = "1s"
memory = "1s"
power = "1s"
thermal = "1s"
clocks = "1s"
pcie = "1s"
nvlink = "1s"
processes = "1s"
health = "1s"
EOF
# Tools that dlopen("libnvidia-ml.so.1") find the fake through LD_LIBRARY_PATH.
libdir="$OUT/lib"
mkdir -p "$libdir"
ln -sfn "$fake_lib" "$libdir/libnvidia-ml.so.1"

# ---------------------------------------------------------------- helpers
declare -A PID URL
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

cpu_ticks() { # "utime stime" of the whole process, exited threads included (fields 14, 15,
    # counted after the last ')'); the kernel keeps their sum exact to the tick
    local stat rest
    stat=$(<"/proc/$1/stat")
    rest=${stat##*) }
    read -ra f <<<"$rest"
    echo "${f[11]} ${f[12]}"
}
live_ns() { # on-CPU ns of the live threads (schedstat; finer than ticks, misses exited threads)
    cat /proc/"$1"/task/*/schedstat 2>/dev/null | awk '{ s += $1 } END { printf "%.0f\n", s }'
}
status_kb() { awk -v k="$2:" '$1 == k { print $2 }' "/proc/$1/status"; }
now() { date +%s.%N; }
metric() { # metric FILE NAME [LABEL-SUBSTRING] -> sum of matching samples
    awk -v n="$2" -v l="${3:-}" '{ split($1, a, "{") } a[1] == n && index($1, l) { s += $NF } END { printf "%.0f\n", s }' "$1"
}

wait_listening() { # wait_listening NAME STDOUT-FILE SECONDS
    local i
    for ((i = 0; i < $3 * 10; i++)); do
        if grep -q '^listening on ' "$2" 2>/dev/null; then
            URL[$1]="http://$(awk '/^listening on /{print $3; exit}' "$2")/metrics"
            return 0
        fi
        kill -0 "${PID[$1]}" 2>/dev/null || break
        sleep 0.1
    done
    log "$1 did not start; see $OUT/$1.log"
    cat "$OUT/$1.log" >&2
    exit 1
}

start_agent() { # start_agent NAME [extra args...]
    local name=$1
    shift
    FAKE_NVML_SCENARIO="$scenario" "$agent_bin" --source nvml --nvml-lib "$fake_lib" \
        --listen 127.0.0.1:0 "$@" >"$OUT/$name.stdout" 2>"$OUT/$name.log" &
    PID[$name]=$!
    pids+=("$!")
    wait_listening "$name" "$OUT/$name.stdout" 30
}

start_peer() { # start_peer NAME INTERVAL
    local name=$1 port i
    port=$(free_port)
    env LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" FAKE_NVML_SCENARIO="$scenario" \
        "$PEER_VENV/bin/nvitop-exporter" --bind-address 127.0.0.1 --port "$port" --interval "$2" \
        >"$OUT/$name.log" 2>&1 &
    PID[$name]=$!
    pids+=("$!")
    URL[$name]="http://127.0.0.1:$port/metrics"
    for ((i = 0; i < 300; i++)); do
        curl -sf -o /dev/null "${URL[$name]}" && return 0
        kill -0 "${PID[$name]}" 2>/dev/null || break
        sleep 0.1
    done
    log "$name did not start; see $OUT/$name.log"
    cat "$OUT/$name.log" >&2
    exit 1
}

# ---------------------------------------------------------------- 3. side by side
names=(agent-default agent-1s peer-1s peer-fast)
log "starting ${names[*]} on $GPUS fake H100s (latency mode: $LATENCY_MODE)"
start_agent agent-default
start_agent agent-1s --config "$OUT/agent-1s.toml"
start_peer peer-1s 1.0
start_peer peer-fast "$PEER_FAST_INTERVAL"

log "warm-up ${WARMUP}s"
sleep "$WARMUP"
declare -A U0 S0 U1 S1 N0 N1
for n in "${names[@]}"; do
    read -r "U0[$n]" "S0[$n]" < <(cpu_ticks "${PID[$n]}")
    N0[$n]=$(live_ns "${PID[$n]}")
done
t0=$(now)
for n in agent-default agent-1s; do curl -sf "${URL[$n]}" >"$OUT/$n.metrics.start"; done

# Scrape every SCRAPE_EVERY seconds, as Prometheus would.
(
    while sleep "$SCRAPE_EVERY"; do
        for n in "${names[@]}"; do curl -sf -o /dev/null "${URL[$n]}" || true; done
    done
) &
scraper=$!
log "measuring ${DURATION}s"
sleep "$DURATION"
kill "$scraper" 2>/dev/null || true
wait "$scraper" 2>/dev/null || true

for n in "${names[@]}"; do
    read -r "U1[$n]" "S1[$n]" < <(cpu_ticks "${PID[$n]}")
    N1[$n]=$(live_ns "${PID[$n]}")
done
t1=$(now)
declare -A HWM RSS
for n in "${names[@]}"; do
    HWM[$n]=$(status_kb "${PID[$n]}" VmHWM)
    RSS[$n]=$(status_kb "${PID[$n]}" VmRSS)
done
# Snapshots for the record (after the measurement: not counted).
for n in "${names[@]}"; do curl -sf "${URL[$n]}" >"$OUT/$n.metrics"; done
# The peer's real update period, and the per-GPU utilisation it shows (is it doing the work?).
for n in peer-1s peer-fast; do python3 "$bench/peer_period.py" "${URL[$n]}" 5 >"$OUT/$n.period"; done

cleanup
pids=()
elapsed=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f", b - a }')

# ---------------------------------------------------------------- 4. callgrind
cg_ir="" cg_windows="" cg_elapsed=""
declare -A CG_RUNS
if [ "$CALLGRIND_SECONDS" != 0 ]; then
    log "callgrind: the agent (default intervals) for ${CALLGRIND_SECONDS}s"
    rm -f "$OUT"/callgrind.out.*
    FAKE_NVML_SCENARIO="$scenario" valgrind --tool=callgrind --callgrind-out-file="$OUT/callgrind.out.%p" \
        "$agent_bin" --source nvml --nvml-lib "$fake_lib" --listen 127.0.0.1:0 \
        >"$OUT/agent-callgrind.stdout" 2>"$OUT/agent-callgrind.log" &
    PID[agent-callgrind]=$!
    pids+=("$!")
    wait_listening agent-callgrind "$OUT/agent-callgrind.stdout" 120
    sleep $((WARMUP * 2))
    # Count only the steady state: zero the counters, run, dump.
    curl -sf "${URL[agent-callgrind]}" >"$OUT/agent-callgrind.metrics.start"
    callgrind_control --zero "${PID[agent-callgrind]}" >/dev/null
    c0=$(now)
    (
        while sleep "$SCRAPE_EVERY"; do curl -sf -o /dev/null "${URL[agent-callgrind]}" || true; done
    ) &
    scraper=$!
    sleep "$CALLGRIND_SECONDS"
    kill "$scraper" 2>/dev/null || true
    wait "$scraper" 2>/dev/null || true
    curl -sf "${URL[agent-callgrind]}" >"$OUT/agent-callgrind.metrics"
    callgrind_control --dump=steady "${PID[agent-callgrind]}" >/dev/null
    c1=$(now)
    cleanup
    pids=()
    part=$(ls "$OUT"/callgrind.out.*.1 | head -1)
    python3 "$bench/callgrind_costs.py" "$part" >"$OUT/callgrind-costs.txt"
    callgrind_annotate --inclusive=yes "$part" >"$OUT/callgrind-annotate.txt" 2>/dev/null || true
    cg_ir=$(awk '$1 == "total_ir" { print $2 }' "$OUT/callgrind-costs.txt")
    cg_fake=$(awk '$1 == "calls_into_object_ir" && $3 ~ /libnvidia_ml\.so$/ { print $2 }' "$OUT/callgrind-costs.txt")
    cg_windows=$(($(metric "$OUT/agent-callgrind.metrics" apron_agent_windows_total) - \
        $(metric "$OUT/agent-callgrind.metrics.start" apron_agent_windows_total)))
    cg_elapsed=$(awk -v a="$c0" -v b="$c1" 'BEGIN { printf "%.3f", b - a }')
fi

# ---------------------------------------------------------------- 5. results
{
    echo "# bench-agent raw results ($(date -u +%FT%TZ))"
    echo "git_head_at_run $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet -- agent common tests/fake-nvml 2>/dev/null || echo ' (+uncommitted changes)')"
    echo "agent_sha256 $(sha256sum "$agent_bin" | cut -c1-16) built $(date -u -r "$agent_bin" +%FT%TZ)" \
        "sources_newer_than_binary $(find agent common tests/fake-nvml -name '*.rs' -newer "$agent_bin" | wc -l)"
    echo "machine nproc=$(nproc) cpu=\"$(lscpu | sed -n 's/^Model name: *//p' | head -1)\""
    echo "gpus $GPUS duration_s $elapsed warmup_s $WARMUP scrape_every_s $SCRAPE_EVERY latency_mode $LATENCY_MODE clk_tck $clk_tck"
    echo "peer nvitop-exporter $PEER_VERSION (nvidia-ml-py $("$PEER_VENV/bin/pip" show nvidia-ml-py | awk '/^Version/{print $2}'))"
    for n in "${names[@]}"; do
        u=$((U1[$n] - U0[$n])) s=$((S1[$n] - S0[$n]))
        echo "proc $n cpu_ticks $((u + s)) vmhwm_kb ${HWM[$n]} vmrss_kb ${RSS[$n]} live_threads_cpu_ns $((N1[$n] - N0[$n])) user_ticks $u sys_ticks $s"
    done
    for n in peer-1s peer-fast; do
        echo "peer_update_period_s $n $(sed -n 1p "$OUT/$n.period")"
        echo "peer_gpu_utilization_seen $n $(sed -n 2p "$OUT/$n.period")"
    done
    echo "agent_gpu_util_last_window agent-default $(awk '/^DCGM_FI_DEV_GPU_UTIL\{/ { match($0, /gpu="[0-9]+"/); printf "gpu%s:%.3g ", substr($0, RSTART + 5, RLENGTH - 6), $NF }' "$OUT/agent-default.metrics")"
    for n in agent-default agent-1s; do
        for g in utilization gpm memory power thermal clocks pcie nvlink processes health; do
            r=$(($(metric "$OUT/$n.metrics" apron_agent_sampler_runs_total "\"$g\"") - \
                $(metric "$OUT/$n.metrics.start" apron_agent_sampler_runs_total "\"$g\"")))
            echo "sampler_runs $n $g $r"
        done
        echo "windows $n $(($(metric "$OUT/$n.metrics" apron_agent_windows_total) - \
            $(metric "$OUT/$n.metrics.start" apron_agent_windows_total)))"
        echo "late_readings $n $(metric "$OUT/$n.metrics" apron_agent_late_readings_total)"
        echo "sampler_errors $n $(metric "$OUT/$n.metrics" apron_agent_sampler_errors_total)"
    done
    if [ -n "$cg_ir" ]; then
        echo "callgrind ir $cg_ir fake_nvml_ir $cg_fake windows $cg_windows elapsed_s $cg_elapsed"
        for g in utilization gpm memory power thermal clocks pcie nvlink processes health; do
            r=$(($(metric "$OUT/agent-callgrind.metrics" apron_agent_sampler_runs_total "\"$g\"") - \
                $(metric "$OUT/agent-callgrind.metrics.start" apron_agent_sampler_runs_total "\"$g\"")))
            echo "callgrind_sampler_runs $g $r"
        done
        grep -E '^(object_ir|calls_into_object_ir|entry_ir)' "$OUT/callgrind-costs.txt" | sed 's/^/callgrind_/'
    fi
} >"$raw"

report() {
    awk -v gpus="$GPUS" -v tck="$clk_tck" -v el="$elapsed" '
    $1 == "proc" {
        n = $2; cpu = $4 / tck; us[n] = cpu * 1e6 / (gpus * el); pct[n] = 100 * cpu / el; rss[n] = $6 / 1024
        tus[n] = $10 / 1e3 / (gpus * el)
        sys[n] = ($4 > 0) ? 100 * $14 / $4 : 0
        order[++k] = n
    }
    $1 == "peer_update_period_s" { per[$2] = $3 }
    $1 == "sampler_runs" { runs[$2, $3] = $4 }
    $1 == "windows" { win[$2] = $3 }
    $1 == "late_readings" { late[$2] = $3 }
    $1 == "callgrind" { ir = $3; fake = $5; cgw = $7; cgel = $9 }
    $1 == "callgrind_sampler_runs" { cgr[$2] = $3 }
    $1 == "callgrind_entry_ir" { ent[$2] = $3 }
    END {
        printf "\nAgent overhead: %d fake H100s, %.1f s measured after warm-up, all four side by side\n\n", gpus, el
        printf "%-14s %14s %10s %14s %8s %24s\n", "process", "CPU us/GPU-s", "% of core", "peak RSS MiB", "% sys", "(live threads us/GPU-s)"
        for (i = 1; i <= k; i++) { n = order[i]; printf "%-14s %14.1f %10.2f %14.1f %8.0f %24.1f\n", n, us[n], pct[n], rss[n], sys[n], tus[n] }
        printf "\n(peer real update period: peer-1s %s s, peer-fast %s s)\n", per["peer-1s"], per["peer-fast"]
        printf "\nratios agent/peer            CPU      RSS\n"
        printf "  agent-1s / peer-1s      %7.3f  %7.3f   (same 1 s cadence: the headline)\n", us["agent-1s"] / us["peer-1s"], rss["agent-1s"] / rss["peer-1s"]
        printf "  agent-default / peer-1s %7.3f  %7.3f   (agent at 10 Hz utilisation, peer at 1 Hz)\n", us["agent-default"] / us["peer-1s"], rss["agent-default"] / rss["peer-1s"]
        printf "  agent-default / peer-fast %5.3f  %7.3f   (peer at its fastest)\n", us["agent-default"] / us["peer-fast"], rss["agent-default"] / rss["peer-fast"]
        printf "\ntarget CPU <= 1/10 of the peer, same 1 s cadence (agent-1s/peer-1s %.3f): %s\n", \
            us["agent-1s"] / us["peer-1s"], us["agent-1s"] <= 0.1 * us["peer-1s"] ? "met" : "NOT met"
        printf "target CPU <= 1/10 of the peer, both at defaults (agent-default/peer-1s %.3f): %s\n", \
            us["agent-default"] / us["peer-1s"], us["agent-default"] <= 0.1 * us["peer-1s"] ? "met" : "NOT met"
        printf "target peak RSS <= 20 MiB (agent-default %.1f, agent-1s %.1f MiB): %s\n", rss["agent-default"], rss["agent-1s"], \
            (rss["agent-default"] <= 20 && rss["agent-1s"] <= 20) ? "met" : "NOT met"
        printf "agent windows closed: default %d, 1s %d (expect ~%d); late readings: %d, %d\n", \
            win["agent-default"], win["agent-1s"], gpus * el, late["agent-default"], late["agent-1s"]
        if (ir != "") {
            printf "\ncallgrind (agent, default intervals, %.1f s steady state, %d GPU windows):\n", cgel, cgw
            printf "  total %.3g Ir; %.3g Ir per GPU-window; %.3g Ir per node-second (%d GPUs)\n", ir, ir / cgw, ir / (cgw / gpus), gpus
            printf "  of which the fake libnvidia-ml: %.3g Ir (%.0f%%); the agent without it: %.3g Ir per GPU-window\n", fake, 100 * fake / ir, (ir - fake) / cgw
            printf "  sampler runs under valgrind: utilization %d (expect %d), gpm %d (expect %d)\n", cgr["utilization"], cgel * 10, cgr["gpm"], cgel * 4
            if (cgr["utilization"] > 0) printf "  per utilization tick (%d GPUs): %.3g Ir\n", gpus, ent["utilization"] / cgr["utilization"]
            if (cgr["gpm"] > 0) printf "  per gpm tick: %.3g Ir\n", ent["gpm"] / cgr["gpm"]
            pd = cgr["memory"] + cgr["power"] + cgr["thermal"] + cgr["clocks"] + cgr["pcie"] + cgr["nvlink"]
            if (pd > 0) printf "  per 1 s per-device tick (memory/power/thermal/clocks/pcie/nvlink, mean): %.3g Ir\n", ent["per_device_sample"] / pd
            if (cgr["processes"] > 0) printf "  per processes tick: %.3g Ir\n", ent["processes"] / cgr["processes"]
            printf "  aggregation thread: %.3g Ir per GPU-window\n", ent["aggregation_thread"] / cgw
        }
    }' "$raw"
}
report | tee "$OUT/report.txt"
echo
echo "raw numbers: $raw"
cat "$raw"
