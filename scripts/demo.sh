#!/usr/bin/env bash
# The main job: set up (idempotent), then run P + RLD + MD + router across an emulated WAN.
# Extra arguments go to `python -m sglang_pdd.launcher.demo` (e.g. --keep-running).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m sglang_pdd.launcher.demo "$@"
