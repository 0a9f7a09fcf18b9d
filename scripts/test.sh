#!/usr/bin/env bash
# The test command (README): one build, every test. External tools come from
# scripts/install-test-tools.sh; a missing tool fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-test-tools.sh >/dev/null
# Tests that need an external tool or privilege fail instead of skipping.
export APRON_REQUIRE_TOOLS=1
# `cargo test` builds libraries as rlibs only, and binaries only for their own package's
# tests; the end-to-end tests load the fake libnvidia-ml.so (a cdylib) by path and the
# server's tests run the apron-agent binary, so build those first (same profile: no
# rebuild).
cargo build --quiet -p apron-fake-nvml -p apron-fake-nvml-legacy -p apron-agent
cargo test --workspace --no-fail-fast "$@"
# Docs: every relative link and anchor in *.md resolves, every flag named exists in --help.
python3 -m unittest discover -s tests/docs -q
./scripts/check-docs.py
# Kubernetes manifests and systemd units, checked with real tools and started with the
# binaries just built (tests/deploy/validate.sh).
./tests/deploy/validate.sh
# Release binaries in OCI images (podman) and Debian packages (dpkg -i, run, purge):
# tests/deploy/packages.sh.
./tests/deploy/packages.sh
