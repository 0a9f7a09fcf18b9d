#!/usr/bin/env bash
# Runs deploy/slurm/apron-{prolog,epilog}.sh under a real single-node Slurm.
#
# Starts munged, slurmctld and slurmd (Debian `slurm-wlm` + `munge`; all state, sockets,
# logs and config under one temp dir; root required, as slurmd runs jobs as their user),
# with two GRES GPUs backed by dummy character devices and Prolog/Epilog set to our
# scripts. Submits a 2-GPU job and checks that while it runs the per-GPU files exist
# with the job's id, user, account, partition, QoS and the mapped UUIDs, and that after
# it they are gone. With APRON_AGENT (the apron-agent binary) and APRON_FAKE_NVML (the
# fake libnvidia-ml.so) set, also runs the agent on a fake NVML whose GPUs have the same
# UUIDs and checks that /metrics attributes the GPUs' processes to the job.
#
# Exit status: 0 passed, 1 failed, 77 a tool is missing or not root (a skip, printed as
# NOTE; with APRON_REQUIRE_TOOLS=1 that is a failure: exit 1).
# Every daemon started here is stopped on exit, whatever happens.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
PROLOG=$REPO/deploy/slurm/apron-prolog.sh
EPILOG=$REPO/deploy/slurm/apron-epilog.sh

missing() {
    if [ "${APRON_REQUIRE_TOOLS:-}" = 1 ]; then
        echo "FAIL: $* (run scripts/install-test-tools.sh; APRON_REQUIRE_TOOLS=1 forbids skipping)" >&2
        exit 1
    fi
    echo "NOTE: skipping the real-Slurm test: $*"
    exit 77
}

fail() {
    echo "FAIL: $*" >&2
    exit 1
}

[ "$(id -u)" -eq 0 ] || missing "must run as root (slurmd starts jobs as their user)"
for t in munged slurmctld slurmd sbatch squeue scontrol sinfo scancel python3 mknod runuser shellcheck; do
    command -v "$t" >/dev/null 2>&1 || missing "$t is not installed (Debian packages slurm-wlm, munge, shellcheck)"
done

# The shipped scripts are POSIX sh: lint them as such first.
shellcheck --shell=sh "$PROLOG" "$EPILOG" || fail "shellcheck finds problems in deploy/slurm"
echo "OK: shellcheck --shell=sh deploy/slurm/apron-prolog.sh deploy/slurm/apron-epilog.sh"

T=$(mktemp -d /tmp/apron-slurm.XXXXXX)
chmod 0755 "$T"
PIDS=()
cleanup() {
    local rc=$?
    set +e
    if [ -n "${JOB:-}" ]; then
        # A job still running: cancel it and let slurmd finish it (epilog included).
        scancel "$JOB" >/dev/null 2>&1
        for _ in $(seq 50); do [ -z "$(squeue -h -j "$JOB" 2>/dev/null)" ] && break; sleep 0.2; done
    fi
    # Reverse start order: agent, slurmd, slurmctld, munged. Only our own PIDs.
    for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
        kill "${PIDS[i]}" 2>/dev/null
    done
    for pid in "${PIDS[@]}"; do
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null
        wait "$pid" 2>/dev/null
    done
    # slurmd's job step daemons outlive it; ours are the slurmstepd processes that
    # inherited this test's SLURM_CONF.
    for p in /proc/[0-9]*; do
        [ "$(cat "$p/comm" 2>/dev/null)" = slurmstepd ] || continue
        if { tr '\0' '\n' <"$p/environ"; } 2>/dev/null | grep -qxF "SLURM_CONF=$T/slurm.conf"; then
            kill -9 "${p#/proc/}" 2>/dev/null
        fi
    done
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 77 ]; then
        for f in munged.log slurmctld.log slurmd.log agent.log; do
            [ -f "$T/$f" ] && { echo "---- $f (tail)"; tail -n 40 "$T/$f"; }
        done
    fi
    rm -rf "$T"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 1' INT TERM


# wait_for SECONDS DESCRIPTION COMMAND...: polls every 0.2 s.
wait_for() {
    local secs=$1 what=$2
    shift 2
    local deadline=$((SECONDS + secs))
    until "$@"; do
        [ "$SECONDS" -lt "$deadline" ] || fail "timed out after ${secs}s waiting for $what"
        sleep 0.2
    done
}

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# ---- munge -------------------------------------------------------------------------
mkdir -p "$T/munge" "$T/spool/ctld" "$T/spool/d" "$T/dev" "$T/apron-slurm"
dd if=/dev/urandom of="$T/munge/munge.key" bs=1024 count=1 status=none
chmod 0400 "$T/munge/munge.key"
chmod 0755 "$T/munge"
munged --foreground --force --key-file="$T/munge/munge.key" --socket="$T/munge/munge.sock" \
    --pid-file="$T/munge/munged.pid" --seed-file="$T/munge/seed" --log-file="$T/munged.log" \
    >"$T/munged.stderr" 2>&1 &
PIDS+=($!)
wait_for 10 "munged's socket" test -S "$T/munge/munge.sock"

# ---- GPUs: dummy character devices (/dev/null's major:minor) ------------------------
# Slurm only needs the File= paths to exist (it stats them and, with task/cgroup, would
# constrain the job to them); two dummy nodes stand for /dev/nvidia0 and /dev/nvidia1.
for i in 0 1; do mknod -m 0666 "$T/dev/nvidia$i" c 1 3; done
UUID0=GPU-00000000-0000-0000-0000-000000000000
UUID1=GPU-11111111-1111-1111-1111-111111111111
printf '# Slurm GRES index, NVML UUID\n0 %s\n1 %s\n' "$UUID0" "$UUID1" >"$T/gpu-index-map"

# ---- Slurm --------------------------------------------------------------------------
# slurmd gives Prolog/Epilog a fresh environment (SLURM_* only), so site settings reach
# the scripts through /etc/apron/slurm.env; here, where /etc is not ours to change, a
# two-line wrapper sets them and execs the repository's scripts unchanged.
for kind in prolog epilog; do
    script=$PROLOG
    [ "$kind" = epilog ] && script=$EPILOG
    cat >"$T/$kind.sh" <<EOF
#!/bin/sh
env | sort >"$T/$kind.env"
APRON_SLURM_DIR="$T/apron-slurm" APRON_GPU_MAP="$T/gpu-index-map" exec "$script"
EOF
    chmod 0755 "$T/$kind.sh"
done

NODE=apron-test-node
CTLD_PORT=$(free_port)
SLURMD_PORT=$(free_port)
cat >"$T/slurm.conf" <<EOF
ClusterName=apron-test
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$T/munge/munge.sock
StateSaveLocation=$T/spool/ctld
SlurmdSpoolDir=$T/spool/d
SlurmctldPidFile=$T/slurmctld.pid
SlurmdPidFile=$T/slurmd.pid
SlurmctldLogFile=$T/slurmctld.log
SlurmdLogFile=$T/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
Prolog=$T/prolog.sh
Epilog=$T/epilog.sh
PrologFlags=Alloc
SlurmdParameters=config_overrides
NodeName=$NODE NodeHostname=$(hostname -s) NodeAddr=127.0.0.1 CPUs=2 RealMemory=100 Gres=gpu:2 State=UNKNOWN
PartitionName=gpu Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
cat >"$T/gres.conf" <<EOF
NodeName=$NODE Name=gpu File=$T/dev/nvidia[0-1]
EOF
chmod 0644 "$T/slurm.conf" "$T/gres.conf"
export SLURM_CONF=$T/slurm.conf

slurmctld -D -i -f "$T/slurm.conf" >"$T/slurmctld.stderr" 2>&1 &
PIDS+=($!)
ctld_up() { scontrol ping >/dev/null 2>&1; }
wait_for 20 "slurmctld" ctld_up
slurmd -D -N "$NODE" -f "$T/slurm.conf" >"$T/slurmd.stderr" 2>&1 &
PIDS+=($!)
node_idle() { sinfo -h -n "$NODE" -o %t 2>/dev/null | grep -qx idle; }
wait_for 30 "node $NODE idle" node_idle
echo "OK: single-node Slurm up ($(slurmd -V)), node $NODE with gres $(sinfo -h -n "$NODE" -o %G)"

# ---- optional: apron-agent on a fake NVML with the same UUIDs ---------------------
AGENT_ADDR=
if [ -n "${APRON_AGENT:-}" ]; then
    [ -x "$APRON_AGENT" ] || fail "APRON_AGENT=$APRON_AGENT is not executable"
    [ -f "${APRON_FAKE_NVML:-}" ] || fail "APRON_FAKE_NVML=${APRON_FAKE_NVML:-} is not a file"
    # One process on each GPU whose PID is not in the agent's (empty) procfs: the agent
    # then attributes it to whoever holds the GPU, i.e. the Slurm file.
    cat >"$T/scenario.toml" <<EOF
driver_version = "570.172.08"
[[gpus]]
index = 0
uuid = "$UUID0"
name = "NVIDIA H100 80GB HBM3"
pci_bus_id = "00000000:18:00.0"
minor_number = 0
architecture = "hopper"
memory_total_mib = 81559
power_limit_w = 700
idle = { gpu_util = 0, mem_util = 0, sm_active = 0, sm_occupancy = 0, tensor_active = 0, dram_active = 0, power_w = 100, fb_used_mib = 1000, temp_c = 35, sm_clock_mhz = 345 }
processes = [ { pid = 7100, name = "train.py", used_memory_mib = 900 } ]
[[gpus]]
index = 1
uuid = "$UUID1"
name = "NVIDIA H100 80GB HBM3"
pci_bus_id = "00000000:2A:00.0"
minor_number = 1
architecture = "hopper"
memory_total_mib = 81559
power_limit_w = 700
idle = { gpu_util = 30, mem_util = 10, sm_active = 0.3, sm_occupancy = 0.2, tensor_active = 0, dram_active = 0.1, power_w = 200, fb_used_mib = 20000, temp_c = 45 }
processes = [ { pid = 7101, name = "train.py", used_memory_mib = 1800 } ]
EOF
    mkdir -p "$T/agent-proc"
    printf 'nobody:x:%s:%s:nobody:/nonexistent:/usr/sbin/nologin\n' "$(id -u nobody)" "$(id -g nobody)" >"$T/agent-passwd"
    cat >"$T/agent.toml" <<EOF
[samplers]
processes = "1s"
[attribution]
proc_root = "$T/agent-proc"
passwd_path = "$T/agent-passwd"
apron_slurm_dir = "$T/apron-slurm"
slurm_gpu_dir = "$T/no-gpustat"
pod_resources_socket = "$T/no-kubelet.sock"
EOF
    FAKE_NVML_SCENARIO=$T/scenario.toml "$APRON_AGENT" --config "$T/agent.toml" --source nvml \
        --nvml-lib "$APRON_FAKE_NVML" --listen 127.0.0.1:0 --hostname "$NODE" \
        >"$T/agent.out" 2>"$T/agent.log" &
    PIDS+=($!)
    agent_listening() { grep -q '^listening on ' "$T/agent.out"; }
    wait_for 20 "apron-agent to listen" agent_listening
    AGENT_ADDR=$(sed -n 's/^listening on //p' "$T/agent.out" | head -n 1)
    echo "OK: apron-agent listening on $AGENT_ADDR (fake NVML, GPUs $UUID0 $UUID1)"
fi

metrics() { python3 -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen("http://" + sys.argv[1] + "/metrics", timeout=5).read().decode())' "$AGENT_ADDR"; }
# process_line PID: the agent's apron_gpu_process_memory_bytes line for that PID.
process_line() { metrics | grep "^apron_gpu_process_memory_bytes{" | grep "pid=\"$1\"" || true; }

# ---- the job ------------------------------------------------------------------------
if [ -n "$AGENT_ADDR" ]; then
    line=$(process_line 7100)
    [ -n "$line" ] || { sleep 2; line=$(process_line 7100); }
    case $line in *job_id=*) fail "before the job the agent already sees a job: $line" ;; esac
    echo "OK: before the job, the agent attributes no job: $line"
fi

JOB=$(runuser -u nobody -- sbatch --parsable --gres=gpu:2 --account=ml-research --qos=normal --job-name=apron-slurm-test \
    --chdir=/ --output=/dev/null --error=/dev/null --wrap='sleep 8') || fail "sbatch failed"
JOB=${JOB%%;*}
echo "OK: submitted job $JOB (sbatch --gres=gpu:2 --account=ml-research)"

files_present() { [ -f "$T/apron-slurm/$UUID0" ] && [ -f "$T/apron-slurm/$UUID1" ]; }
wait_for 20 "the prolog's per-GPU files" files_present
state=$(squeue -h -j "$JOB" -o %T)
echo "prolog environment from slurmd: $(sed -n 's/^\(SLURM_JOB_[A-Z_]*\|CUDA_VISIBLE_DEVICES\|SLURM_[A-Z_]*GPU[A-Z_]*\)=.*/\1/p' "$T/prolog.env" | tr '\n' ' ')"
echo "prolog SLURM_JOB_GPUS=$(sed -n 's/^SLURM_JOB_GPUS=//p' "$T/prolog.env") CUDA_VISIBLE_DEVICES=$(sed -n 's/^CUDA_VISIBLE_DEVICES=//p' "$T/prolog.env")"
echo "scontrol: $(scontrol show job "$JOB" | tr ' ' '\n' | grep -E '^(QOS|Account|UserId|Partition)=' | tr '\n' ' ')"
echo "OK: while job $JOB is $state, $T/apron-slurm holds: $(cd "$T/apron-slurm" && echo *)"
# Slurm 22.05 gives the prolog no SLURM_JOB_QOS; the prolog then asks scontrol, which
# without accounting storage (no slurmdbd here) knows no QoS: "(null)", written empty.
QOS=$(scontrol show job "$JOB" | tr ' ' '\n' | sed -n 's/^QOS=//p' | head -n 1)
[ "$QOS" = "(null)" ] && QOS=
for uuid in "$UUID0" "$UUID1"; do
    f=$T/apron-slurm/$uuid
    mode=$(stat -c %a "$f")
    [ "$mode" = 644 ] || fail "$f has mode $mode, want 644"
    echo "---- $uuid"
    cat "$f"
    for want in "job_id=$JOB" "user=nobody" "uid=$(id -u nobody)" "account=ml-research" "partition=gpu" "qos=$QOS" "gpu_uuid=$uuid"; do
        grep -qx "$want" "$f" || fail "$f lacks the line $want"
    done
    grep -Eqx 'start_time=[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z' "$f" || fail "$f: start_time is not RFC 3339 UTC"
done
for f in "$T"/apron-slurm/.*; do
    case $f in */. | */..) ;; *) [ -e "$f" ] && fail "temporary file left: $f" ;; esac
done
echo "OK: both GPU files name job $JOB, user nobody (uid $(id -u nobody)), account ml-research, partition gpu, qos '$QOS' (as scontrol has it), mode 0644"

if [ -n "$AGENT_ADDR" ]; then
    attributed() {
        local a b
        a=$(process_line 7100) b=$(process_line 7101)
        case "$a|$b" in *"job_id=\"$JOB\""*"|"*"job_id=\"$JOB\""*) return 0 ;; *) return 1 ;; esac
    }
    wait_for 15 "the agent to attribute both GPUs' processes to job $JOB" attributed
    echo "OK: agent /metrics during the job:"
    process_line 7100
    process_line 7101
    process_line 7100 | grep -q "user=\"nobody\"" || fail "the agent does not name user nobody"
fi

files_gone() { ! [ -e "$T/apron-slurm/$UUID0" ] && ! [ -e "$T/apron-slurm/$UUID1" ]; }
wait_for 40 "the epilog to remove the files of job $JOB" files_gone
[ -f "$T/epilog.env" ] || fail "the epilog did not run"
echo "OK: job $JOB ended ($(scontrol show job "$JOB" 2>/dev/null | tr ' ' '\n' | sed -n 's/^JobState=//p' | head -n 1)); the epilog removed both files"

if [ -n "$AGENT_ADDR" ]; then
    unattributed() { ! process_line 7100 | grep -q 'job_id='; }
    wait_for 15 "the agent to drop job $JOB" unattributed
    echo "OK: agent /metrics after the job: $(process_line 7100)"
fi

# A file the epilog must keep: another job's.
printf 'job_id=999999\ngpu_uuid=%s\n' "$UUID0" >"$T/apron-slurm/$UUID0"
SLURM_JOB_ID=$JOB APRON_SLURM_DIR=$T/apron-slurm "$EPILOG"
[ -f "$T/apron-slurm/$UUID0" ] || fail "the epilog of job $JOB removed job 999999's file"
echo "OK: the epilog of job $JOB keeps another job's file"
JOB=
echo "PASS: apron-prolog.sh / apron-epilog.sh under real Slurm"
