#!/bin/sh
# Apron's Slurm epilog: forgets the GPUs of a job that ended.
#
# slurmd runs it as root when a job ends on the node (slurm.conf:
# `Epilog=/etc/apron/apron-epilog.sh`). It removes the files apron-prolog.sh wrote,
# `$APRON_SLURM_DIR/<gpu_uuid>`, whose `job_id=` line is this job's, and no other: when
# a GPU has already been handed to the next job (whose prolog replaced the file), that
# job's file stays. It looks at every file in the directory rather than recomputing the
# job's GPUs, so a changed index map cannot leave a file behind.
#
# It never fails: an epilog that exits non-zero makes Slurm DRAIN the node. Problems are
# logged to syslog (tag apron-slurm) and stderr (slurmd's log); the script exits 0.
#
# Configuration: APRON_SLURM_DIR (default /run/apron/slurm), set in /etc/apron/slurm.env
# (slurmd gives the epilog a fresh environment of SLURM_* variables only).

PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:$PATH
export PATH

# Site settings; a variable already in the environment (a wrapper's) wins.
env_APRON_SLURM_DIR=${APRON_SLURM_DIR:-}
if [ -r /etc/apron/slurm.env ]; then
    # shellcheck disable=SC1091
    . /etc/apron/slurm.env
fi
APRON_SLURM_DIR=${env_APRON_SLURM_DIR:-${APRON_SLURM_DIR:-}}

APRON_SLURM_DIR=${APRON_SLURM_DIR:-/run/apron/slurm}
TAG=apron-slurm

log() {
    printf '%s: %s\n' "$TAG" "$*" >&2
    logger -t "$TAG" -- "$*" 2>/dev/null || true
}

main() {
    job_id=${SLURM_JOB_ID:-${SLURM_JOBID:-}}
    if [ -z "$job_id" ]; then
        log "SLURM_JOB_ID is not set; not run by slurmd?"
        return 0
    fi
    [ -d "$APRON_SLURM_DIR" ] || return 0
    for file in "$APRON_SLURM_DIR"/GPU-* "$APRON_SLURM_DIR"/MIG-*; do
        [ -f "$file" ] || continue
        owner=$(sed -n 's/^[[:space:]]*job_id[[:space:]]*=[[:space:]]*//p' "$file" 2>/dev/null | head -n 1 | tr -d '[:space:]')
        if [ "$owner" = "$job_id" ]; then
            rm -f "$file" || log "job $job_id: cannot remove $file"
        fi
    done
    # Temporary files of a prolog killed half-way.
    for file in "$APRON_SLURM_DIR"/.*.tmp; do
        [ -f "$file" ] || continue
        if grep -qx "job_id=$job_id" "$file" 2>/dev/null; then
            rm -f "$file"
        fi
    done
}

main "$@"
exit 0
