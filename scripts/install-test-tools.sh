#!/usr/bin/env bash
# Installs every external tool the tests talk to. Idempotent; run by .ci/run and by
# hand on a fresh machine. Tests fail (never skip) when a tool is missing.
set -euo pipefail

need_apt=()
command -v prometheus >/dev/null 2>&1 || need_apt+=(prometheus)
command -v promtool >/dev/null 2>&1 || need_apt+=(prometheus)
command -v valgrind >/dev/null 2>&1 || need_apt+=(valgrind)
# The STARTTLS test makes a private CA with the openssl CLI.
command -v openssl >/dev/null 2>&1 || need_apt+=(openssl)
# A real single-node Slurm for the prolog/epilog test (tests/slurm/run.sh), and the
# linter it runs on deploy/slurm/*.sh.
command -v slurmctld >/dev/null 2>&1 || need_apt+=(slurm-wlm)
command -v slurmd >/dev/null 2>&1 || need_apt+=(slurm-wlm)
command -v munged >/dev/null 2>&1 || need_apt+=(munge)
command -v shellcheck >/dev/null 2>&1 || need_apt+=(shellcheck)

if ((${#need_apt[@]})); then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  # Debian's prometheus package starts a service on install where systemd runs; it
  # does not here, and the tests start their own instances on free ports. The same goes
  # for slurm-wlm's and munge's services: tests/slurm/run.sh starts its own daemons.
  $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

# The Parquet files must open unchanged in DuckDB and pyarrow (query/tests/query.rs).
if ! python3 -c "import duckdb, pyarrow" >/dev/null 2>&1; then
  python3 -m pip install --quiet --disable-pip-version-check "duckdb>=1.1" "pyarrow>=17"
fi

# A real SMTP server for the weekly report e-mail, and a reader for its XLSX attachment
# (server/tests/server/schedule.rs).
if ! python3 -c "import aiosmtpd, openpyxl" >/dev/null 2>&1; then
  python3 -m pip install --quiet --disable-pip-version-check "aiosmtpd>=1.4" "openpyxl>=3.1"
fi

# A real S3-compatible server for the object-store storage root (query/tests/query.rs).
# Built once into ~/.cache/apron-tools, outside the clone, so CI does not rebuild it
# every run (the tests look there, or at $APRON_S3S_FS).
S3S_FS="${APRON_S3S_FS:-$HOME/.cache/apron-tools/bin/s3s-fs}"
if [ ! -x "$S3S_FS" ]; then
  cargo install --quiet --locked s3s-fs --version 0.14.1 --features binary --root "$HOME/.cache/apron-tools"
fi

prometheus --version 2>&1 | head -1
"$S3S_FS" --version
python3 -c "import duckdb, pyarrow; print('duckdb', duckdb.__version__, '/ pyarrow', pyarrow.__version__)"
python3 -c "import aiosmtpd, openpyxl; print('aiosmtpd', aiosmtpd.__version__, '/ openpyxl', openpyxl.__version__)"
promtool --version 2>&1 | head -1
slurmd -V
munged --version
shellcheck --version | sed -n 2p
