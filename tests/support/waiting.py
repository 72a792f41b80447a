"""Synchronising tests on conditions, not on fixed sleeps."""

from __future__ import annotations

import os
import time
from typing import Callable


def wait_until(predicate: Callable[[], object], timeout: float = 10.0, poll_s: float = 0.01) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds passed; its last value, as a bool
    (callers assert it, so a condition that never comes fails with the test's own message)."""
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(poll_s)
    return bool(predicate())


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
