#!/usr/bin/env bash
# Runs pynvml_check.py against the built fake: pynvml dlopens "libnvidia-ml.so.1",
# so a symlink with that name goes on LD_LIBRARY_PATH.
# Needs: cargo build -p apron-fake-nvml; pip install nvidia-ml-py.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
lib="${FAKE_NVML_LIB:-$here/../../../target/debug/libnvidia_ml.so}"
[ -f "$lib" ] || { echo "missing $lib: run cargo build -p apron-fake-nvml" >&2; exit 1; }
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
ln -s "$(realpath "$lib")" "$dir/libnvidia-ml.so.1"
unset FAKE_NVML_SCENARIO   # the built-in default scenario (scenarios/basic.toml)
LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" python3 "$here/pynvml_check.py"
