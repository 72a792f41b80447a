"""Processes a test started: whether one still runs, and waiting until a set of them is gone."""

from __future__ import annotations

import os
import time


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not reaped yet, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pids, timeout_s: float = 20.0) -> bool:
    """Whether every process of ``pids`` is gone within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(alive(int(p)) for p in pids):
            return True
        time.sleep(0.1)
    return False
