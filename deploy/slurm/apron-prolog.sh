#!/bin/sh
# Apron's Slurm prolog: records which job holds each of this node's GPUs.
#
# slurmd runs it as root at the start of every job on the node (slurm.conf:
# `Prolog=/etc/apron/apron-prolog.sh`; with `PrologFlags=Alloc` it runs at allocation,
# so an `salloc` that has not launched anything yet is already seen holding its GPUs).
# For every GPU of the job it writes one file, `$APRON_SLURM_DIR/<gpu_uuid>`, which
# apron-agent reads (`[attribution] apron_slurm_dir`, agent/src/attribution/slurm.rs):
#
#   job_id=4242
#   user=alice
#   uid=1001
#   account=ml-research
#   partition=gpu
#   qos=normal
#   gpu_uuid=GPU-5fd4c3a1-7b2e-4c1d-9a8f-0e6d5c4b3a21
#   start_time=2026-05-12T10:00:00Z
#
# apron-epilog.sh removes them when the job ends.
#
# It never fails the job. A prolog that exits non-zero makes Slurm DRAIN the node and
# requeue (or fail) the job: a monitoring tool must not take GPUs out of service. Every
# problem is logged to syslog (tag apron-slurm) and stderr (slurmd's log), and the
# script exits 0; the GPU then simply shows up as unattributed in Apron.
#
# Environment (set by slurmd in the prolog; `scontrol show job` fills what is missing):
#   SLURM_JOB_ID, SLURM_JOB_USER, SLURM_JOB_UID, SLURM_JOB_ACCOUNT,
#   SLURM_JOB_PARTITION, SLURM_JOB_QOS (not set by every Slurm release),
#   SLURM_JOB_GPUS (the job's GPU GRES indices on this node, e.g. "0,1"), else
#   CUDA_VISIBLE_DEVICES, else `scontrol show job -d` (`GRES=gpu:2(IDX:0-1)`).
# Configuration: slurmd gives the prolog a fresh environment (SLURM_* only), so site
# settings go in /etc/apron/slurm.env, sourced below:
#   APRON_SLURM_DIR  where the per-GPU files go (default /run/apron/slurm)
#   APRON_GPU_MAP    a file of `index uuid` lines; when set it is used instead of
#                    nvidia-smi (default, when nvidia-smi is absent: /etc/apron/gpu-index-map)
#   APRON_SLURM_SCONTROL=0  never call `scontrol show job` (one slurmctld RPC per job
#                    and node; Slurm 22.05 leaves SLURM_JOB_QOS out of the prolog
#                    environment, so with this set the QoS stays empty there)
#
# Slurm GPU index → NVML UUID
# ---------------------------
# Slurm numbers a node's GPUs (the GRES index: IDX in `scontrol show job -d`,
# SLURM_JOB_GPUS, and CUDA_VISIBLE_DEVICES as slurmd sets it for the job) by their
# position in the node's sorted gres.conf `File=` list. With `AutoDetect=nvml`, or a
# gres.conf that lists every GPU as `File=/dev/nvidia[0-N]`, that order is the device
# files' minor number order: GRES index i is /dev/nvidia<i>. NVML's index, on the other
# hand, is PCI bus order, which usually but not always equals the minor order. So the
# prolog keys each GPU by its device minor number (nvidia-smi gives index, UUID and PCI
# bus ID; the driver's /proc/driver/nvidia/gpus/<bus id>/information gives "Device
# Minor"), and falls back to the NVML index only where that file is missing. A node
# whose gres.conf lists only some of its GPUs, or not in minor order, needs a mapping
# file (APRON_GPU_MAP) whose first column is the Slurm GRES index.
# MIG instances as GRES (`MultipleFiles=`) are not mapped: such a job's files name the
# parent GPUs it was given, if any.

PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:$PATH
export PATH
umask 022

# Site settings; a variable already in the environment (a wrapper's) wins.
env_APRON_SLURM_DIR=${APRON_SLURM_DIR:-}
env_APRON_GPU_MAP=${APRON_GPU_MAP:-}
env_APRON_SLURM_SCONTROL=${APRON_SLURM_SCONTROL:-}
if [ -r /etc/apron/slurm.env ]; then
    # shellcheck disable=SC1091
    . /etc/apron/slurm.env
fi
APRON_SLURM_DIR=${env_APRON_SLURM_DIR:-${APRON_SLURM_DIR:-}}
APRON_GPU_MAP=${env_APRON_GPU_MAP:-${APRON_GPU_MAP:-}}
APRON_SLURM_SCONTROL=${env_APRON_SLURM_SCONTROL:-${APRON_SLURM_SCONTROL:-}}

APRON_SLURM_DIR=${APRON_SLURM_DIR:-/run/apron/slurm}
TAG=apron-slurm

log() {
    printf '%s: %s\n' "$TAG" "$*" >&2
    logger -t "$TAG" -- "$*" 2>/dev/null || true
}

# The value of `Key=` in `scontrol show job` output ($1), e.g. Account.
job_field() {
    printf '%s\n' "$JOB_INFO" | tr ' ' '\n' | sed -n "s/^$1=//p" | head -n 1
}

# "0-2,5" → "0 1 2 5"
expand_ranges() {
    printf '%s\n' "$1" | tr ',' '\n' | while IFS= read -r part; do
        case $part in
            *-*)
                lo=${part%-*}
                hi=${part#*-}
                case $lo$hi in *[!0-9]*) continue ;; esac
                i=$lo
                while [ "$i" -le "$hi" ]; do
                    printf '%s ' "$i"
                    i=$((i + 1))
                done
                ;;
            '' | *[!0-9]*) ;;
            *) printf '%s ' "$part" ;;
        esac
    done
}

# Prints `index uuid` lines for this node's GPUs.
gpu_map() {
    if [ -n "${APRON_GPU_MAP:-}" ]; then
        map_file "$APRON_GPU_MAP"
    elif command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=index,uuid,pci.bus_id --format=csv,noheader 2>/dev/null |
            tr -d ' ' | while IFS=, read -r index uuid bus; do
                # nvidia-smi: 00000000:18:00.0; procfs: 0000:18:00.0
                bus=$(printf '%s' "${bus#????}" | tr 'A-F' 'a-f')
                info=/proc/driver/nvidia/gpus/$bus/information
                minor=
                if [ -r "$info" ]; then
                    minor=$(sed -n 's/^Device Minor:[[:space:]]*\([0-9][0-9]*\).*/\1/p' "$info")
                fi
                printf '%s %s\n' "${minor:-$index}" "$uuid"
            done
    else
        map_file /etc/apron/gpu-index-map
    fi
}

map_file() {
    if [ ! -r "$1" ]; then
        log "no GPU index map: nvidia-smi is not installed and $1 is not readable"
        return 0
    fi
    # `index uuid` lines; blank lines and # comments allowed.
    sed -e 's/#.*//' "$1" | awk 'NF >= 2 { print $1, $2 }'
}

main() {
    job_id=${SLURM_JOB_ID:-${SLURM_JOBID:-}}
    if [ -z "$job_id" ]; then
        log "SLURM_JOB_ID is not set; not run by slurmd?"
        return 0
    fi

    # Only ask slurmctld when the environment lacks something.
    JOB_INFO=
    if [ "${APRON_SLURM_SCONTROL:-1}" != 0 ] && { [ -z "${SLURM_JOB_USER:-}" ] || [ -z "${SLURM_JOB_UID:-}" ] || [ -z "${SLURM_JOB_ACCOUNT:-}" ] ||
        [ -z "${SLURM_JOB_PARTITION:-}" ] || [ -z "${SLURM_JOB_QOS:-}" ] ||
        { [ -z "${SLURM_JOB_GPUS:-}" ] && [ -z "${CUDA_VISIBLE_DEVICES:-}" ]; }; }; then
        JOB_INFO=$(scontrol show job -d "$job_id" 2>/dev/null) || log "job $job_id: scontrol show job failed"
    fi
    user=${SLURM_JOB_USER:-$(job_field UserId | sed 's/(.*//')}
    uid=${SLURM_JOB_UID:-$(job_field UserId | sed -n 's/.*(\([0-9]*\)).*/\1/p')}
    account=${SLURM_JOB_ACCOUNT:-$(job_field Account)}
    partition=${SLURM_JOB_PARTITION:-$(job_field Partition)}
    qos=${SLURM_JOB_QOS:-$(job_field QOS)}
    [ "$account" = "(null)" ] && account=
    [ "$qos" = "(null)" ] && qos=

    gpus=${SLURM_JOB_GPUS:-${CUDA_VISIBLE_DEVICES:-}}
    if [ -z "$gpus" ]; then
        # `GRES=gpu:a100:2(IDX:0-1)` on this node's line; `gpu(IDX:...)` forms too.
        gpus=$(printf '%s\n' "$JOB_INFO" | tr ' ' '\n' | sed -n 's/^GRES=.*gpu[^(]*(IDX:\([0-9,-]*\)).*/\1/p' | head -n 1)
    fi
    indices=$(expand_ranges "$gpus")
    if [ -z "$indices" ]; then
        return 0 # a job without GPUs on this node
    fi

    if ! mkdir -p "$APRON_SLURM_DIR" 2>/dev/null; then
        log "job $job_id: cannot create $APRON_SLURM_DIR"
        return 0
    fi
    chmod 0755 "$APRON_SLURM_DIR" 2>/dev/null || true

    map=$(gpu_map)
    start_time=$(date -u +%Y-%m-%dT%H:%M:%SZ)
    for index in $indices; do
        uuid=$(printf '%s\n' "$map" | awk -v i="$index" '$1 == i { print $2; exit }')
        case $uuid in
            '' | */* | .*)
                log "job $job_id: no UUID for GPU index $index (map: ${APRON_GPU_MAP:-nvidia-smi or /etc/apron/gpu-index-map})"
                continue
                ;;
        esac
        tmp="$APRON_SLURM_DIR/.$uuid.$$.tmp"
        if {
            echo "# written by apron's Slurm prolog, removed by its epilog"
            printf 'job_id=%s\n' "$job_id"
            printf 'user=%s\n' "$user"
            printf 'uid=%s\n' "$uid"
            printf 'account=%s\n' "$account"
            printf 'partition=%s\n' "$partition"
            printf 'qos=%s\n' "$qos"
            printf 'gpu_uuid=%s\n' "$uuid"
            printf 'slurm_gpu_index=%s\n' "$index"
            printf 'start_time=%s\n' "$start_time"
        } >"$tmp" && chmod 0644 "$tmp" && mv -f "$tmp" "$APRON_SLURM_DIR/$uuid"; then
            :
        else
            rm -f "$tmp"
            log "job $job_id: cannot write $APRON_SLURM_DIR/$uuid"
        fi
    done
}

main "$@"
exit 0
