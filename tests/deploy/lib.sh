# shellcheck shell=bash
# shellcheck disable=SC2034 # install_hint and last are read by the scripts that source this
# Shared by tests/deploy/validate.sh and tests/deploy/packages.sh (sourced): counted
# checks whose output is shown only when they fail. Callers set $work (a scratch
# directory) before the first step.

passed=0
failed=0
pass() {
  passed=$((passed + 1))
  echo "ok   $*"
}
fail() {
  failed=$((failed + 1))
  echo "FAIL $*"
}
# A missing tool or input stops the run: a check that cannot run fails, never skips.
missing() {
  echo "FAIL $*" >&2
  exit 1
}
install_hint="scripts/install-test-tools.sh installs it"

# Runs a step; its output is shown only when it fails. Sets last=ok|failed. The step
# runs in a subshell with errexit outside any `if`, where bash would ignore it: any
# failing command fails the step, not only its last one (and variables it sets stay
# in the subshell).
step() {
  : "${work:?set work to a scratch directory before the first step}"
  local name=$1 rc
  shift
  set +e
  (
    set -e
    "$@"
  ) >"$work/out" 2>&1
  rc=$?
  set -e
  if [ "$rc" -eq 0 ]; then
    pass "$name"
    last=ok
  else
    fail "$name"
    sed 's/^/     /' "$work/out"
    last=failed
  fi
}

# Passes when the command fails: a checker must reject a broken input.
rejects() {
  ! "$@"
}

# The summary line and the exit status.
finish() {
  echo "$1: $passed passed, $failed failed"
  [ "$failed" -eq 0 ]
}
