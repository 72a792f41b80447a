"""Test-only delays at the two rendezvous of a P->RLD->MD request: MD's room registration and
P's late WAN destination (SGLang's PD tests inject a metadata race the same way, by an
environment variable read when the server starts).

Set when a server process starts, never per request: no client can reach them. Unset (the
default) they cost nothing. A value is a delay in milliseconds, fixed (``"150"``) or drawn
uniformly per call (``"0-400"``); ``SGLANG_PDD_TEST_DELAY_SEED`` makes the draws repeatable.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from dataclasses import dataclass
from typing import Mapping, Optional

logger = logging.getLogger(__name__)

MD_REGISTER_DELAY_ENV = "SGLANG_PDD_TEST_MD_REGISTER_DELAY_MS"  # MD: before a room registration is taken
P_DESTINATION_DELAY_ENV = "SGLANG_PDD_TEST_P_DESTINATION_DELAY_MS"  # P: before a late WAN destination is taken
SEED_ENV = "SGLANG_PDD_TEST_DELAY_SEED"
MAX_DELAY_MS = 60_000.0


@dataclass(frozen=True)
class DelayRange:
    low_ms: float
    high_ms: float

    @classmethod
    def parse(cls, text: str) -> "DelayRange":
        """``"150"`` or ``"0-400"`` (milliseconds, 0 <= low <= high <= 60000); ValueError otherwise."""
        low, sep, high = text.strip().partition("-")
        try:
            lo, hi = float(low), float(high) if sep else float(low)
        except ValueError:
            raise ValueError(f"a delay is MS or LOW-HIGH milliseconds, got {text!r}") from None
        if not 0 <= lo <= hi <= MAX_DELAY_MS:
            raise ValueError(f"a delay must lie in [0, {MAX_DELAY_MS:g}] ms with low <= high, got {text!r}")
        return cls(lo, hi)

    def draw_s(self, rng: random.Random) -> float:
        return rng.uniform(self.low_ms, self.high_ms) / 1000.0


class InjectedDelay:
    """``wait()`` sleeps one drawn delay (thread-safe draws); a no-op when ``delay`` is None."""

    def __init__(self, name: str, delay: Optional[DelayRange], seed: Optional[int] = None):
        self.name, self.delay = name, delay
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, name: str, environ: Mapping[str, str] = os.environ) -> "InjectedDelay":
        text = environ.get(name)
        if not text:
            return cls(name, None)
        delay = DelayRange.parse(text)
        seed = environ.get(SEED_ENV)
        logger.warning("TEST-ONLY fault injection active: %s=%s (a delay of %g-%g ms on every call)", name, text,
                       delay.low_ms, delay.high_ms)
        return cls(name, delay, int(seed) if seed else None)

    def wait(self) -> float:
        """Sleeps the drawn delay; returns it in seconds."""
        if self.delay is None:
            return 0.0
        with self._lock:
            seconds = self.delay.draw_s(self._rng)
        time.sleep(seconds)
        return seconds
