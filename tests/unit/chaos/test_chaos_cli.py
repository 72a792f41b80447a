"""docs/faults.md's first command, ``python -m sglang_pdd.chaos --list``, as a user runs it (the
scenarios themselves run on real servers in tests/e2e/test_e2e_chaos.py)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO_ROOT
from sglang_pdd.chaos.spec import SCENARIOS


def test_list_prints_every_scenario():
    done = subprocess.run([sys.executable, "-m", "sglang_pdd.chaos", "--list"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    listed = [line.split()[0] for line in done.stdout.splitlines() if line.strip()]
    assert listed == list(SCENARIOS)
