#!/usr/bin/env bash
# The test command: set up (idempotent), then unit tests, then end-to-end tests on real servers.
# Extra arguments go to both pytest runs (e.g. -x, -k NAME).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
PY="$ROOT/.venv/bin/python"
bash "$ROOT/scripts/setup.sh" --check
echo "== unit tests"
"$PY" -m pytest -q -m "not e2e" --timeout 600 "$@"
echo "== end-to-end tests (real SGLang servers)"
"$PY" -m pytest -q -m e2e --timeout 1800 "$@"
