#!/usr/bin/env bash
# The test command (README): one build, every test. External tools come from
# scripts/install-test-tools.sh; a missing tool fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-test-tools.sh >/dev/null
export APRON_REQUIRE_TOOLS=1
cargo test --workspace --no-fail-fast "$@"
