#!/usr/bin/env bash
# Validates the deployment files with real tools; run by scripts/test.sh after the cargo
# tests, whose binaries it starts. Every step fails (never skips) when a tool is missing;
# scripts/install-test-tools.sh installs them.
#
# Kubernetes (deploy/kubernetes): every kustomization is rendered by kustomize (as
# kubectl embeds it); built-in kinds are checked by kubernetes-validate's strict
# offline schemas for each of KUBE_VERSIONS, the ServiceMonitors by the strict schema
# in this directory (kubernetes-validate only warns about custom kinds), and
# cross-object references and the security floor by check_manifests.py. The server's
# and agent's ConfigMaps are then run by the real binaries in the layout the pod would
# see (configcheck.py).
# systemd (deploy/systemd): `systemd-analyze verify` and `security --offline` on every
# unit, and the binaries on the configs the units name. Configs with a bucket get one
# (s3s-fs); Ballista nodes are started against a scheduler of their own.
# Canaries: each checker is fed one broken input and must reject it, so a checker that
# stopped checking cannot pass everything.
#
# Environment: APRON_BIN, APRON_AGENT_BIN (default target/debug/…), APRON_S3S_FS, APRON_KUBECTL
# (default: kubectl on PATH, else ~/.cache/apron-tools/bin/kubectl).
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
here=$repo/tests/deploy

# The oldest Kubernetes Apron supports (pod-resources v1 is GA from 1.28) and a current
# one: a field too new or an API already removed fails one of them.
KUBE_VERSIONS=(1.28.0 1.33.0)
# `systemd-analyze security` exposure in tenths, as --threshold takes it (0 = locked
# down, 100 = nothing); the units score 12 (apron, both Ballista units) and 23 (the
# agent) with systemd 252. Over these, a hardening line was lost.
declare -A EXPOSURE_MAX=([apron.service]=20 [apron-agent.service]=30
  [apron-ballista-scheduler.service]=20 [apron-ballista-executor.service]=20)

APRON_BIN=$(realpath -m "${APRON_BIN:-target/debug/apron}")
APRON_AGENT_BIN=$(realpath -m "${APRON_AGENT_BIN:-target/debug/apron-agent}")
export APRON_BIN APRON_AGENT_BIN

# shellcheck source=tests/deploy/lib.sh
source "$here/lib.sh"

# ── tools ──────────────────────────────────────────────────────────────────────
kubectl=${APRON_KUBECTL:-}
if [ -z "$kubectl" ]; then
  kubectl=$(command -v kubectl || true)
  [ -n "$kubectl" ] || kubectl=$HOME/.cache/apron-tools/bin/kubectl
fi
[ -x "$kubectl" ] || missing "kubectl (kustomize): not at $kubectl; $install_hint"
kustomize_version=$("$kubectl" version --client 2>/dev/null | sed -n 's/^Kustomize Version: v\([0-9]*\).*/\1/p')
[ "${kustomize_version:-0}" -ge 5 ] || missing "$kubectl embeds no kustomize v5 or later; $install_hint"
python3 -c 'import kubernetes_validate, jsonschema, yaml, tomllib' 2>/dev/null ||
  missing "python3 modules kubernetes_validate, jsonschema, yaml, tomllib; $install_hint"
command -v systemd-analyze >/dev/null || missing "systemd-analyze; $install_hint"
command -v shellcheck >/dev/null || missing "shellcheck; $install_hint"
[ -x "$APRON_BIN" ] || missing "no apron binary at $APRON_BIN: cargo build -p apron, or set APRON_BIN"
s3s_fs=${APRON_S3S_FS:-$HOME/.cache/apron-tools/bin/s3s-fs}
[ -x "$s3s_fs" ] || missing "s3s-fs (a bucket for the cluster configs): not at $s3s_fs; $install_hint"
[ -x "$APRON_AGENT_BIN" ] || missing "no apron-agent binary at $APRON_AGENT_BIN: cargo build -p apron-agent, or set APRON_AGENT_BIN"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# kubernetes-validate exits 0 on a kind it has no schema for, printing a WARN; any
# output at all (--quiet prints only problems) is a failure here.
kube_validate() {
  local file=$1 version out
  for version in "${KUBE_VERSIONS[@]}"; do
    out=$(python3 -m kubernetes_validate --strict --quiet -k "$version" "$file" 2>&1) || {
      echo "$out"
      return 1
    }
    if [ -n "$out" ]; then
      echo "$out"
      return 1
    fi
  done
}

shellcheck_self() {
  shellcheck -x -P "$repo" "$here"/*.sh scripts/dist-bins.sh scripts/build-images.sh \
    scripts/build-debs.sh deploy/debian/*.postinst deploy/debian/*.prerm deploy/debian/*.postrm
}

step "tests/deploy, the image and package scripts are shellcheck-clean" shellcheck_self

# ── Kubernetes ─────────────────────────────────────────────────────────────────
# The Secrets the manifests leave to the operator (docs/deploy.md) and the keys each
# must hold: the tokens, and the bucket's keys (overlays/cluster).
external_secrets=(--external-secret "apron-tokens=ingest-token,sql-token"
  --external-secret "apron-lake=access-key-id,secret-access-key")

render() {
  "$kubectl" kustomize "$1" >"$2"
}

kustomizations=()
components=()
while IFS= read -r file; do
  dir=${file%/kustomization.yaml}
  if grep -q '^kind: Component' "$file"; then
    components+=("$dir")
  else
    kustomizations+=("$dir")
  fi
done < <(find deploy/kubernetes -name kustomization.yaml | sort)
[ "${#kustomizations[@]}" -gt 0 ] || missing "no kustomization under deploy/kubernetes"

for dir in "${kustomizations[@]}"; do
  name=${dir#deploy/kubernetes/}
  out=$work/${name//\//_}
  mkdir -p "$out"
  step "$name: kustomize renders" render "$dir" "$out/rendered.yaml"
  [ "$last" = ok ] || continue
  step "$name: objects split into built-in and known custom kinds" \
    python3 "$here/check_manifests.py" split "$out/rendered.yaml" "$out"
  step "$name: built-in kinds valid (strict, Kubernetes ${KUBE_VERSIONS[*]})" kube_validate "$out/core.yaml"
  step "$name: custom resources valid (strict schema)" python3 "$here/check_manifests.py" custom "$out/custom.yaml"
  step "$name: references and security floor" \
    python3 "$here/check_manifests.py" refs "$out/rendered.yaml" "${external_secrets[@]}"
  step "$name: binaries start on the rendered config" python3 "$here/configcheck.py" k8s "$out/rendered.yaml"
done

# A component is validated only through an overlay that lists it.
component_used() {
  grep -rqs --include=kustomization.yaml -e "${1#deploy/kubernetes/}\$" deploy/kubernetes/overlays
}
for dir in "${components[@]}"; do
  step "${dir#deploy/kubernetes/}: rendered by an overlay" component_used "$dir"
done

# Copies of files outside the kustomize tree, which kustomize cannot read; they must
# not drift.
step "components/pricebook/pricebook.toml equals deploy/pricebook.example.toml" \
  cmp deploy/pricebook.example.toml deploy/kubernetes/components/pricebook/pricebook.toml
production_config_is_base() {
  python3 - <<'EOF'
import sys, tomllib
base = tomllib.load(open("deploy/kubernetes/base/apron.toml", "rb"))
prod = tomllib.load(open("deploy/kubernetes/overlays/production/apron.toml", "rb"))
if prod.get("cost", {}).pop("price_book", None) != "/etc/apron/pricebook/pricebook.toml":
    sys.exit("overlays/production/apron.toml: [cost] price_book is not the component's mount")
if not prod["cost"]:
    del prod["cost"]
if prod != base:
    sys.exit(f"overlays/production/apron.toml differs from base/apron.toml beyond the price book:\n{prod}\n{base}")
EOF
}
step "overlays/production/apron.toml is base/apron.toml with the price book" production_config_is_base
# The images the manifests run are the ones scripts/build-images.sh builds, under the
# names it gives them (base, sim) or renamed by `images:` with the same tag (production).
version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"$/\1/p' Cargo.toml)
images_are_built_ones() {
  local dir=$1 prefix=$2 want got
  want=$(printf '%s\n' "${prefix}apron-agent:$version" "${prefix}apron:$version")
  got=$("$kubectl" kustomize "$dir" | sed -n 's/^ *image: //p' | sort -u)
  [ "$got" = "$want" ] || {
    echo "$dir runs: $got"
    echo "expected: $want"
    return 1
  }
}
step "base and overlays/sim run localhost/apron{,-agent}:$version (scripts/build-images.sh)" \
  images_are_built_ones deploy/kubernetes/overlays/sim localhost/
step "overlays/production runs the same tag from the registry it names" \
  images_are_built_ones deploy/kubernetes/overlays/production registry.example.com/apron/
sim_teams_match() {
  python3 - <<'EOF'
import sys, tomllib
sim = tomllib.load(open("deploy/teams.sim.toml", "rb"))
teams = tomllib.load(open("deploy/kubernetes/overlays/sim/apron.toml", "rb"))["cost"]["teams"]
if sim != teams:
    sys.exit(f"deploy/teams.sim.toml: {sim}\noverlays/sim/apron.toml [cost.teams]: {teams}")
EOF
}
step "overlays/sim/apron.toml [cost.teams] equals deploy/teams.sim.toml" sim_teams_match

# ── systemd ────────────────────────────────────────────────────────────────────
# verify needs ExecStart's binary to exist: a copy of each unit points at the one here.
# It exits 0 on unknown keys and bad values, printing them; any output fails.
systemd_verify() {
  local unit=$1 copy=$work/systemd/${1##*/} out
  mkdir -p "$work/systemd"
  sed -e "s#^ExecStart=/usr/local/bin/apron-agent #ExecStart=$APRON_AGENT_BIN #" \
    -e "s#^ExecStart=/usr/local/bin/apron #ExecStart=$APRON_BIN #" "$unit" >"$copy"
  grep -qF -e "ExecStart=$APRON_BIN " -e "ExecStart=$APRON_AGENT_BIN " "$copy" || {
    echo "$unit: ExecStart runs neither /usr/local/bin/apron nor /usr/local/bin/apron-agent"
    return 1
  }
  out=$(cd "$work/systemd" && systemd-analyze verify --man=no "./${unit##*/}" 2>&1) || {
    echo "$out"
    return 1
  }
  if [ -n "$out" ]; then
    echo "$out"
    return 1
  fi
}
systemd_exposure() {
  local unit=$1
  systemd-analyze security --offline=yes --threshold="${EXPOSURE_MAX[${unit##*/}]}" "$unit" | tail -n 1
}

units=(deploy/systemd/*.service)
for unit in "${units[@]}"; do
  name=${unit#deploy/}
  [ -n "${EXPOSURE_MAX[${unit##*/}]:-}" ] || {
    fail "$name: no exposure limit in validate.sh"
    continue
  }
  step "$name: systemd-analyze verify" systemd_verify "$unit"
  step "$name: exposure at most ${EXPOSURE_MAX[${unit##*/}]}/100" systemd_exposure "$unit"
  step "$name: binary starts on its config" python3 "$here/configcheck.py" systemd "$unit" deploy/systemd
done

# ── canaries ───────────────────────────────────────────────────────────────────
canary=$work/canary
mkdir -p "$canary"
render deploy/kubernetes/overlays/production "$canary/good.yaml"
python3 "$here/check_manifests.py" split "$canary/good.yaml" "$canary" >/dev/null

sed 's/readinessProbe:/readinesProbe:/' "$canary/core.yaml" >"$canary/core-typo.yaml"
step "canary: a misspelt pod field is rejected" rejects kube_validate "$canary/core-typo.yaml"
sed 's/honorLabels:/honourLabels:/' "$canary/custom.yaml" >"$canary/custom-typo.yaml"
step "canary: a misspelt ServiceMonitor field is rejected" \
  rejects python3 "$here/check_manifests.py" custom "$canary/custom-typo.yaml"
sed 's/^    port: metrics$/    port: metric/' "$canary/good.yaml" >"$canary/port.yaml"
step "canary: a ServiceMonitor port no Service has is rejected" \
  rejects python3 "$here/check_manifests.py" refs "$canary/port.yaml" "${external_secrets[@]}"
sed 's/^\(    token_file\) = /\1s = /' "$canary/good.yaml" >"$canary/toml.yaml"
step "canary: an unknown config key is rejected by the binaries" \
  rejects python3 "$here/configcheck.py" k8s "$canary/toml.yaml"
render deploy/kubernetes/overlays/cluster "$canary/cluster.yaml"
sed 's/- 0.0.0.0:50051$/- 0.0.0.0:50061/' "$canary/cluster.yaml" >"$canary/ballista-port.yaml"
step "canary: a Ballista executor on a port its container does not declare is rejected" \
  rejects python3 "$here/configcheck.py" k8s "$canary/ballista-port.yaml"
mkdir -p "$canary/systemd"
sed 's/^ProtectSystem=strict/ProtectSystem=strictly/' deploy/systemd/apron.service >"$canary/systemd/apron.service"
step "canary: a bad systemd value is rejected" rejects systemd_verify "$canary/systemd/apron.service"

finish deploy
