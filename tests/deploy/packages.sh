#!/usr/bin/env bash
# Builds the OCI images and the Debian packages, and runs them on this machine; run by
# scripts/test.sh after tests/deploy/validate.sh. Every step fails (never skips) when a
# tool is missing; scripts/install-test-tools.sh installs them.
#
# Binaries: scripts/dist-bins.sh (cargo profile `dist`, APRON_PROFILE to change it;
# APRON_DIST_PREBUILT=DIR to take binaries already built), stripped.
# Images (scripts/build-images.sh): built twice, the digests must match; then podman
# (runtime runc: crun refuses this machine's hybrid cgroups) runs them as Kubernetes
# would, read-only root filesystem, every capability dropped, no new privileges: the
# server on a small config answers /healthz and SQL, the agent serves /metrics from the
# simulator and ships to that server, and the SQL sees its rows; SIGTERM stops both
# with status 0. podman's storage is a temporary directory, removed at the end.
# docs/deploy.md: tests/deploy/doc_steps.py runs its commands with these images.
# Packages (scripts/build-debs.sh): `dpkg -i` on this machine, `systemd-analyze
# verify` of the installed units, the binaries run as systemd would run them (the
# service's user, the packaged config, LoadCredential's file; only the listen
# addresses are moved to free loopback ports and the agent runs the simulator), then
# `dpkg --purge` and a check that nothing is left behind. Refuses to run where apron or
# apron-agent is already installed.
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
here=$repo/tests/deploy
# shellcheck source=tests/deploy/lib.sh
source "$here/lib.sh"

for tool in podman runc umoci dpkg-deb systemd-analyze setpriv unshare curl python3 objcopy readelf; do
  command -v "$tool" >/dev/null || missing "$tool; $install_hint"
done

work=$(mktemp -d)
store=$work/podman
podman=(podman --root "$store/root" --runroot "$store/run" --runtime runc
  --storage-driver overlay --cgroup-manager cgroupfs --events-backend none)
cleanup() {
  "${podman[@]}" rm -af -t 0 >/dev/null 2>&1 || true
  "${podman[@]}" system reset -f >/dev/null 2>&1 || true
  # Anything the test started that is still running (pids recorded by run_bg).
  local pidfile
  for pidfile in "$work"/*.pid; do
    if [ -e "$pidfile" ]; then
      kill "$(cat "$pidfile")" 2>/dev/null || true
    fi
  done
  rm -rf /run/credentials/apron.service /run/credentials/apron-agent.service
  rmdir /run/credentials 2>/dev/null || true
  # A run that stopped between install and purge leaves nothing installed either.
  if [ -n "${installed:-}" ]; then
    dpkg --purge apron-agent apron >/dev/null 2>&1 || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# wait_http URL [CURL_ARGS...]: up to 60 s for a 200.
wait_http() {
  local url=$1 _
  shift
  for _ in $(seq 1 120); do
    if curl -fsS -o /dev/null "$@" "$url" 2>/dev/null; then
      return 0
    fi
    sleep 0.5
  done
  echo "no 200 from $url within 60 s"
  curl -sS "$@" "$url" || true
  return 1
}

# has_gpu_metrics URL: within 30 s, the dcgm-exporter-compatible GPU families are
# served (from the first closed window on). Read whole first: `grep -q` closing the
# pipe early would fail curl under pipefail.
has_gpu_metrics() {
  local body _
  for _ in $(seq 1 60); do
    body=$(curl -fsS "$1")
    if grep -q '^DCGM_FI_DEV_GPU_UTIL{' <<<"$body"; then
      return 0
    fi
    sleep 0.5
  done
  echo "$1 serves no DCGM_FI_DEV_GPU_UTIL series within 30 s"
  return 1
}

# sql_count URL TOKEN QUERY: the single number a COUNT query returns (CSV).
sql_count() {
  curl -fsS -H "Authorization: Bearer $2" -H 'Accept: text/csv' --data-binary "$3" "$1/api/v1/sql" | sed -n 2p
}

# wait_rows URL TOKEN: up to 60 s for gpu_samples rows (the server starts empty; the
# simulator names its own hosts).
wait_rows() {
  local n _
  for _ in $(seq 1 60); do
    n=$(sql_count "$1" "$2" "SELECT count(*) FROM gpu_samples" || true)
    if [ "${n:-0}" -gt 0 ] 2>/dev/null; then
      echo "$n rows"
      return 0
    fi
    sleep 1
  done
  echo "no gpu_samples rows within 60 s (last answer: ${n:-none})"
  return 1
}

# ── binaries ────────────────────────────────────────────────────────────────────
start=$(date +%s)
./scripts/dist-bins.sh || missing "scripts/dist-bins.sh failed"
echo "     (binaries ready in $(($(date +%s) - start)) s)"

stripped() {
  local bin
  for bin in target/ship/bin/apron target/ship/bin/apron-agent; do
    if readelf -S --wide "$bin" | grep -E '\.debug_(info|line|str) '; then
      echo "$bin still carries debug info"
      return 1
    fi
    readelf -S --wide "$bin" | grep -q '\.gnu_debuglink' || {
      echo "$bin: no .gnu_debuglink"
      return 1
    }
  done
}
step "binaries are stripped, with a debuglink to target/ship/debug" stripped

# ── images ──────────────────────────────────────────────────────────────────────
images=$repo/target/ship/images
version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"$/\1/p' Cargo.toml)
step "scripts/build-images.sh builds both images" env APRON_DIST_PREBUILT=target/ship/bin ./scripts/build-images.sh
[ "$last" = ok ] || missing "no images to run"
sed -n 's/^build-images: /     /p' "$work/out"
rebuild_same() {
  APRON_DIST_PREBUILT=target/ship/bin APRON_IMAGES_OUT="$work/images-again" ./scripts/build-images.sh
  local name
  for name in apron apron-agent; do
    cmp "$images/$name-$version.oci.tar" "$work/images-again/$name-$version.oci.tar" || return 1
  done
}
step "images are reproducible (a second build is byte-identical)" rebuild_same

load_images() {
  local name
  for name in apron apron-agent; do
    "${podman[@]}" load -i "$images/$name-$version.oci.tar"
    "${podman[@]}" image exists "localhost/$name:$version"
  done
}
step "podman loads the archives as localhost/apron:$version, localhost/apron-agent:$version" load_images
[ "$last" = ok ] || missing "images did not load"

# What a Kubernetes pod of the manifests gets: no root filesystem writes (not even
# /tmp, /run: podman's tmpfs there is off), no capabilities, no privilege gain. runc sets rlimits it may not raise here, so they are
# given explicitly, within this shell's hard limits.
nofile=$(ulimit -Hn)
if [ "$nofile" = unlimited ] || [ "$nofile" -gt 8192 ]; then
  nofile=8192
fi
run_opts=(--read-only --read-only-tmpfs=false --cap-drop all --security-opt no-new-privileges --network host
  --ulimit "nofile=$nofile:$nofile" --ulimit nproc=4096:4096)

image_contents() {
  local name
  for name in apron apron-agent; do
    "${podman[@]}" image inspect "localhost/$name:$version" --format '{{.Config.User}} {{.Config.Entrypoint}}' |
      grep -qx "65532:65532 \[/usr/bin/$name\]" || {
      echo "$name: user or entrypoint is not 65532:65532 /usr/bin/$name"
      return 1
    }
    "${podman[@]}" run --rm "${run_opts[@]}" "localhost/$name:$version" --version
    # Nothing but the binary: no shell to run.
    if "${podman[@]}" run --rm "${run_opts[@]}" --entrypoint /bin/sh "localhost/$name:$version" -c true 2>/dev/null; then
      echo "$name: has a shell"
      return 1
    fi
  done
}
step "images run as 65532 with only their binary (no shell)" image_contents

token_ingest=packages-test-ingest-token-0123456789abcdef
token_sql=packages-test-sql-token-0123456789abcdef
server_port=$(free_port)
agent_port=$(free_port)
mkdir -p "$work/etc-apron/tokens"
printf '%s\n' "$token_ingest" >"$work/etc-apron/tokens/ingest-token"
cat >"$work/etc-apron/apron.toml" <<EOF
[server]
listen = "127.0.0.1:$server_port"
[ingest]
token_file = "/etc/apron/tokens/ingest-token"
[storage]
data_dir = "/var/lib/apron"
[cost]
price_book = "/etc/apron/pricebook.toml"
EOF
cp deploy/pricebook.example.toml "$work/etc-apron/pricebook.toml"
chmod -R a+rX "$work/etc-apron"

server_container() {
  "${podman[@]}" run -d --name apron-server "${run_opts[@]}" \
    -v "$work/etc-apron:/etc/apron:ro" -e APRON_SQL_TOKEN="$token_sql" \
    "localhost/apron:$version" serve --config /etc/apron/apron.toml
  wait_http "http://127.0.0.1:$server_port/healthz"
  [ "$(sql_count "http://127.0.0.1:$server_port" "$token_sql" 'SELECT count(*) FROM gpu_samples')" = 0 ]
  wait_http "http://127.0.0.1:$server_port/api/v1/reports/weekly?format=xlsx" -H "Authorization: Bearer $token_sql"
}
step "image apron: serve answers /healthz, SQL and the weekly report (read-only root, no capabilities)" server_container

agent_container() {
  "${podman[@]}" run -d --name apron-agent "${run_opts[@]}" \
    -e APRON_COLLECTOR_TOKEN="$token_ingest" "localhost/apron-agent:$version" \
    --source sim --listen "127.0.0.1:$agent_port" --collector "http://127.0.0.1:$server_port"
  wait_http "http://127.0.0.1:$agent_port/healthz"
  has_gpu_metrics "http://127.0.0.1:$agent_port/metrics"
  wait_rows "http://127.0.0.1:$server_port" "$token_sql" || {
    "${podman[@]}" logs apron-agent 2>&1 | tail -20
    return 1
  }
}
step "image apron-agent: /metrics from the simulator, shipped to the apron image, rows in SQL" agent_container

stop_containers() {
  local name code
  for name in apron-agent apron-server; do
    "${podman[@]}" stop -t 60 "$name" >/dev/null
    code=$("${podman[@]}" inspect "$name" --format '{{.State.ExitCode}}')
    [ "$code" = 0 ] || {
      echo "$name exited $code on SIGTERM"
      "${podman[@]}" logs "$name" 2>&1 | tail -20
      return 1
    }
  done
}
step "both containers stop on SIGTERM with status 0" stop_containers

# ── docs/deploy.md ──────────────────────────────────────────────────────────────
# Its commands, with the images just built (tests/deploy/doc_steps.py).
kubectl=${APRON_KUBECTL:-$(command -v kubectl || echo "$HOME/.cache/apron-tools/bin/kubectl")}
[ -x "$kubectl" ] || missing "kubectl: not at $kubectl; $install_hint"
step "docs/deploy.md: every command marked run runs as written" \
  env APRON_BIN="$repo/target/ship/bin/apron" APRON_AGENT_BIN="$repo/target/ship/bin/apron-agent" \
  APRON_KUBECTL="$kubectl" python3 "$here/doc_steps.py" docs/deploy.md

# ── Debian packages ─────────────────────────────────────────────────────────────
arch=$(dpkg --print-architecture)
debs=$repo/target/ship/debs
step "scripts/build-debs.sh builds both packages" env APRON_DIST_PREBUILT=target/ship/bin ./scripts/build-debs.sh
[ "$last" = ok ] || missing "no packages to install"
sed -n 's/^build-debs: /     /p' "$work/out"

for pkg in apron apron-agent; do
  if dpkg-query -W -f '${Status}' "$pkg" 2>/dev/null | grep -q 'installed\|config-files'; then
    missing "$pkg is already installed on this machine; this test installs and purges it (dpkg --purge $pkg)"
  fi
done
[ ! -e /etc/apron ] || missing "/etc/apron exists; this test installs the packages, which own it"

# What must be the same before the install and after the purge: paths the packages
# and their scripts write (dpkg's own database and the shadow files' backups aside).
snapshot() {
  {
    find /etc /lib/systemd /usr/bin /usr/share/doc /var/lib -xdev \
      -not -path '/var/lib/dpkg/*' -not -path '/var/lib/apt/*' -not -path '/var/lib/containers/*' \
      -not -path '/etc/*-' -not -path '/etc/ld.so.cache' 2>/dev/null
    getent passwd | cut -d: -f1,3
    getent group | cut -d: -f1,3
  } | sort
}
snapshot >"$work/before"

install_debs() {
  dpkg -i "$debs/apron_${version}_${arch}.deb" "$debs/apron-agent_${version}_${arch}.deb"
  dpkg-query -W -f '${Package} ${Version} ${Status}\n' apron apron-agent
  [ "$(dpkg-query -W -f '${Status}' apron)" = "install ok installed" ]
  [ "$(dpkg-query -W -f '${Status}' apron-agent)" = "install ok installed" ]
  getent passwd apron
  [ "$(stat -c '%U %a' /var/lib/apron)" = "apron 700" ]
  [ "$(stat -c '%U %a' /etc/apron/ingest-token)" = "root 600" ]
  [ "$(stat -c '%U %a' /etc/apron/apron.env)" = "root 600" ]
  grep -qE '^[0-9a-f]{64}$' /etc/apron/ingest-token
  grep -qE '^APRON_SQL_TOKEN=[0-9a-f]{64}$' /etc/apron/apron.env
  dpkg-query -W -f '${Conffiles}\n' apron apron-agent | grep -c /etc/apron/
}
installed=1
step "dpkg -i installs apron and apron-agent (user, directories, tokens, conffiles)" install_debs
[ "$last" = ok ] || missing "packages did not install"

# Any output of verify is a problem (it exits 0 on unknown keys and bad values).
verify_units() {
  local out
  out=$(systemd-analyze verify --man=no /lib/systemd/system/apron.service /lib/systemd/system/apron-agent.service 2>&1) || {
    echo "$out"
    return 1
  }
  [ -z "$out" ] || {
    echo "$out"
    return 1
  }
  systemd-analyze security --offline=yes --threshold=20 /lib/systemd/system/apron.service | tail -1
  systemd-analyze security --offline=yes --threshold=30 /lib/systemd/system/apron-agent.service | tail -1
}
step "systemd-analyze verify and security on the installed units" verify_units

# run_bg NAME CMD...: starts CMD in the background (steps run in subshells, so not as
# a child of the script: a watcher records its exit status in $work/NAME.rc).
run_bg() {
  local name=$1
  shift
  (
    "$@" >"$work/$name.log" 2>&1 &
    echo $! >"$work/$name.pid"
    code=0
    wait $! || code=$?
    echo "$code" >"$work/$name.rc"
  ) &
  for _ in $(seq 1 50); do
    [ -s "$work/$name.pid" ] && return 0
    sleep 0.1
  done
  echo "$name did not start"
  return 1
}
# stop_bg NAME: SIGTERM, then its status must be 0 within 60 s.
stop_bg() {
  local code
  kill -TERM "$(cat "$work/$1.pid")"
  for _ in $(seq 1 600); do
    [ -s "$work/$1.rc" ] && break
    sleep 0.1
  done
  code=$(cat "$work/$1.rc" 2>/dev/null || echo "still running 60 s after SIGTERM")
  rm -f "$work/$1.pid"
  [ "$code" = 0 ] || {
    echo "$1 exited $code on SIGTERM"
    tail -20 "$work/$1.log"
    return 1
  }
}

sql_token=$(sed -n 's/^APRON_SQL_TOKEN=//p' /etc/apron/apron.env 2>/dev/null || true)
server_port=$(free_port)
agent_port=$(free_port)
# As apron.service: LoadCredential= copies the root-only token to a file the service
# alone reads; EnvironmentFile= gives APRON_SQL_TOKEN; the static user `apron`.
packaged_server() {
  install -d -m 0755 /run/credentials
  install -d -m 0500 -o apron -g apron /run/credentials/apron.service
  install -m 0400 -o apron -g apron /etc/apron/ingest-token /run/credentials/apron.service/ingest-token
  run_bg server env APRON_SQL_TOKEN="$sql_token" APRON_HTTP="127.0.0.1:$server_port" \
    setpriv --reuid apron --regid apron --init-groups --inh-caps=-all --bounding-set=-all \
    /usr/bin/apron serve --config /etc/apron/apron.toml
  wait_http "http://127.0.0.1:$server_port/healthz"
  [ "$(sql_count "http://127.0.0.1:$server_port" "$sql_token" 'SELECT count(*) FROM gpu_samples')" = 0 ]
  # What it wrote is the service user's.
  [ -n "$(find /var/lib/apron -mindepth 1 -print -quit)" ]
  [ -z "$(find /var/lib/apron ! -user apron -print -quit)" ]
}
step "package apron: apron serve as user apron on /etc/apron/apron.toml answers /healthz and SQL" packaged_server

# As apron-agent.service: root with CAP_SYS_ADMIN only, its credential, the packaged
# agent.toml; the simulator and the local server instead of NVML and apron-server.
packaged_agent() {
  install -d -m 0755 /run/credentials
  install -d -m 0500 /run/credentials/apron-agent.service
  install -m 0400 /etc/apron/ingest-token /run/credentials/apron-agent.service/ingest-token
  run_bg agent env APRON_SOURCE=sim APRON_LISTEN="127.0.0.1:$agent_port" \
    APRON_COLLECTOR="http://127.0.0.1:$server_port" \
    setpriv --inh-caps=-all --bounding-set=-all,+sys_admin \
    /usr/bin/apron-agent --config /etc/apron/agent.toml
  wait_http "http://127.0.0.1:$agent_port/healthz"
  has_gpu_metrics "http://127.0.0.1:$agent_port/metrics"
  wait_rows "http://127.0.0.1:$server_port" "$sql_token" || {
    tail -20 "$work/agent.log"
    return 1
  }
  [ -d /var/lib/apron-agent/spool ]
}
step "package apron-agent: /etc/apron/agent.toml, /metrics, shipped to the packaged server" packaged_agent

stop_packaged() {
  stop_bg agent
  stop_bg server
}
step "both stop on SIGTERM with status 0" stop_packaged
rm -rf /run/credentials/apron.service /run/credentials/apron-agent.service
rmdir /run/credentials 2>/dev/null || true

purge_debs() {
  dpkg --purge apron-agent apron
  if dpkg-query -W -f '${Package} ${Status}\n' apron apron-agent 2>/dev/null | grep -v 'not-installed'; then
    echo "still known to dpkg"
    return 1
  fi
  snapshot >"$work/after"
  diff "$work/before" "$work/after" || {
    echo "left behind (>) or removed (<) by install + purge"
    return 1
  }
}
step "dpkg --purge removes both and leaves nothing behind (files, users, groups)" purge_debs

echo "     (packages.sh took $(($(date +%s) - start)) s)"
finish packages
