#!/usr/bin/env bash
# The test command: set up (idempotent), then unit tests, then end-to-end tests on real servers.
#   bash scripts/test.sh [PYTEST ARGS]          the CI tier: unit tests + the representative e2e
#                                               tier (what .ci/run runs; <= 35 min on 2 cores)
#   bash scripts/test.sh --full [PYTEST ARGS]   everything: unit tests + every e2e test, in shards
#                                               that each fit CI's 90 minutes
# Extra arguments go to every pytest run (e.g. -x, -k NAME). A stage whose filter selects no
# test is skipped; selecting no test at all is an error.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
FULL=0
if [ "${1:-}" = "--full" ]; then FULL=1; shift; fi

# End-to-end tests must run, never skip, wherever this script runs: setup installs what they need.
export CI="${CI:-1}"
[ "$FULL" = 1 ] && export PDD_E2E_FULL=1

STAGES=()    # "name minutes" per stage, for the summary
SELECTED=0   # stages that ran at least one test
T_ALL=$(date +%s)

minutes() { awk -v s="$1" 'BEGIN { printf "%.1f", s / 60 }'; }

summary() {
  echo "== minutes per stage"
  for s in "${STAGES[@]}"; do echo "   $s"; done
  local total=$(( $(date +%s) - T_ALL ))
  echo "   total $(minutes "$total")"
  if [ "$FULL" = 0 ] && [ "$total" -gt $((35 * 60)) ]; then
    echo "WARNING: the CI tier took $(minutes "$total") min, over its 35-minute budget (CI's hard limit is 90)"
  fi
}
trap summary EXIT

# stage NAME TIMEOUT_S CMD...: run one stage under a wall-clock limit, record its minutes.
# pytest's exit 5 (no test selected, e.g. -k matching only e2e tests) skips the stage.
stage() {
  local name="$1" limit="$2"; shift 2
  echo "== $name"
  local t0 rc=0; t0=$(date +%s)
  timeout --foreground --kill-after=30 "$limit" "$@" || rc=$?
  STAGES+=("$name $(minutes $(( $(date +%s) - t0 )))")
  case "$rc" in
    0) SELECTED=$((SELECTED + 1)) ;;
    5) echo "(no test selected in this stage)" ;;
    124|137) echo "FAILED: stage '$name' ran past its ${limit}s limit"; exit 1 ;;
    *) exit "$rc" ;;
  esac
}

t0=$(date +%s)
bash "$ROOT/scripts/setup.sh"
bash "$ROOT/scripts/setup.sh" --check
STAGES+=("setup $(minutes $(( $(date +%s) - t0 )))")
cd "$ROOT"
PYTEST=("$ROOT/.venv/bin/python" -m pytest -q -p no:cacheprovider --durations=15)

stage "unit tests" 1200 "${PYTEST[@]}" -m "not e2e" --timeout 600 "$@"
if [ "$FULL" = 0 ]; then
  stage "end-to-end tests, CI tier (real SGLang servers)" 2400 \
    "${PYTEST[@]}" -m "e2e and not full" --timeout 900 "$@"
else
  # Shards, each its own pytest run (and at most one cluster alive at a time within it), chosen
  # by marker so that a new e2e module lands in one without being listed here
  # (tests/unit/repo/test_test_tiers.py checks that every one does): the modules on the default cluster
  # with the whole differential matrix, then those marked own_cluster, which each bring their
  # own configuration (control-plane TLS, TP, MLA, page size, TCP engine, resume, injected
  # registration delays, datacenter B in a network namespace: SGLang's own PD against PDD, a
  # killed launcher's cleanup, faults under load).
  stage "end-to-end shard 1: default cluster, full matrix" 5400 \
    "${PYTEST[@]}" -m "e2e and not own_cluster" --timeout 1800 "$@"
  stage "end-to-end shard 2: other configurations" 5400 \
    "${PYTEST[@]}" -m "e2e and own_cluster" --timeout 1800 "$@"
fi
if [ "$SELECTED" = 0 ]; then
  echo "FAILED: no test selected by: $*"
  exit 5
fi
