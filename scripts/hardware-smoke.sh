#!/usr/bin/env bash
# One prepared run of the agent on a machine with a real NVIDIA GPU (docs/hardware.md).
#
# Reads only: it never changes a GPU setting (no clocks, no MIG, no persistence mode,
# no resets). Needs a release build of apron-agent (BIN) and the NVIDIA driver.
# Results go to $OUT: the driver's view (nvidia-smi), the probe (which NVML calls and
# GPM metrics are supported, and what each call costs), 30 s of windows, /metrics in
# both formats, and the agent's own CPU and RSS.
set -euo pipefail
BIN=${BIN:-target/release/apron-agent}
OUT=${OUT:-hardware-out}
SECONDS_TO_RUN=${SECONDS_TO_RUN:-30}
mkdir -p "$OUT"

{ nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,mig.mode.current,memory.total,power.limit --format=csv; } \
  > "$OUT/nvidia-smi.txt" 2>&1 || echo "nvidia-smi not available" >> "$OUT/nvidia-smi.txt"

"$BIN" probe --repeats 50 > "$OUT/probe.txt" 2> "$OUT/probe.stderr" || true
"$BIN" probe --repeats 50 --json > "$OUT/probe.json" 2>> "$OUT/probe.stderr" || true

"$BIN" --source nvml --listen 127.0.0.1:0 --windows-out "$OUT/windows.jsonl" --log info \
  > "$OUT/agent.stdout" 2> "$OUT/agent.stderr" &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 100); do grep -q "listening on" "$OUT/agent.stdout" 2>/dev/null && break; sleep 0.1; done
addr=$(sed -n 's/^listening on //p' "$OUT/agent.stdout")
[ -n "$addr" ] || { echo "agent did not start"; cat "$OUT/agent.stderr"; exit 1; }

ticks() { awk '{print $14 + $15}' "/proc/$pid/stat"; }
sleep 5
t0=$(ticks)
sleep "$SECONDS_TO_RUN"
t1=$(ticks)
curl -s "http://$addr/metrics" > "$OUT/metrics.txt"
curl -s -H 'Accept: application/openmetrics-text' "http://$addr/metrics" > "$OUT/metrics.openmetrics.txt"
curl -s "http://$addr/healthz" > "$OUT/healthz.json"
hz=$(getconf CLK_TCK)
gpus=$(grep -c '^apron_gpu_info{' "$OUT/metrics.txt" || true)
{
  echo "cpu_seconds_over_${SECONDS_TO_RUN}s=$(echo "($t1 - $t0) / $hz" | bc -l)"
  echo "gpus_and_mig_instances=$gpus"
  grep -E '^(VmHWM|VmRSS)' "/proc/$pid/status"
} > "$OUT/cost.txt"
kill -TERM "$pid"; wait "$pid" || true
trap - EXIT
grep -h '^apron_agent_sampler_\(runs\|duration_seconds\)_total\|^apron_agent_unsupported' "$OUT/metrics.txt" > "$OUT/samplers.txt" || true
echo "results in $OUT:"; ls -l "$OUT"; cat "$OUT/cost.txt"; cat "$OUT/probe.txt"
