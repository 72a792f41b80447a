"""Synchronising tests on conditions, not on fixed sleeps."""

from __future__ import annotations

import time
from typing import Callable


def wait_until(predicate: Callable[[], object], timeout: float = 10.0, poll_s: float = 0.01) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds passed; its last value, as a bool
    (callers assert it, so a condition that never comes fails with the test's own message)."""
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(poll_s)
    return bool(predicate())
