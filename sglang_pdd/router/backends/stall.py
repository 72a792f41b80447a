"""When a relay leg counts as stalled (pure, no I/O).

A relay leg (P prefills, RLD decodes) that produces nothing new would hold its client until
``--request-timeout-s`` (600 s by default): a stopped RLD or P (SIGSTOP, a frozen VM, SGLang's
``/pause_generation``), or a server wedged on one request. Silence alone does not tell a stopped
server from a busy one, though: a request queued behind others on a saturated RLD, or waiting
for P's prefill of a long prompt, also gets no token for a while, and failing it would turn load
into errors. So a leg is stalled only when

- it waited for a new token for its own bound: ``first_s`` before its first one (P's queue and
  prefill, the KV transfer, RLD's queue), ``stall_s`` after it (one decode step; SGLang may
  retract a request and run it again later), and
- its RLD gave no new token on any of the router's streams for ``window`` (the server is not
  progressing, not just busy with others), and
- before the leg's first token, while P has not replied to it: P replied to none of the
  router's legs for ``window`` either (a P working through its queue is progressing).

Every time counts only while the router waits on the backend (time the flow spends between
events does not). ``BackendProgress`` keeps when each server last made progress the router saw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class RelayStallBounds:
    stall_s: float = 30.0  # --relay-stall-timeout-s: no new token after the first (0: no bound)
    first_s: float = 120.0  # --relay-first-token-timeout-s: no first token (0: no bound)

    def __post_init__(self):
        for name in ("stall_s", "first_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0 (0: no bound), got {value}")

    @property
    def window(self) -> float:
        """How long a server must have made no progress at all for a leg on it to be stalled."""
        return self.stall_s or self.first_s


def wait_left(bounds: RelayStallBounds, waited_s: float, first: bool, rld_idle_s: float,
              p_idle_s: Optional[float] = None) -> Optional[float]:
    """Seconds until the leg counts as stalled if nothing changes (<= 0: it is stalled now);
    None: nothing bounds it (its bound is 0). ``waited_s``: the leg's wait for a new token so far;
    ``first``: it has none yet; ``rld_idle_s`` / ``p_idle_s``: since RLD's last new token / P's last
    reply on any leg (``p_idle_s`` None: P is not what the leg waits for, it replied to this leg
    or the leg has its first token)."""
    own = bounds.first_s if first else bounds.stall_s
    if not own:
        return None
    window = bounds.window
    left = max(own - waited_s, window - rld_idle_s)
    if p_idle_s is not None:
        left = max(left, window - p_idle_s)
    return left


class BackendProgress:
    """When each server last made progress the router saw (``now``: the event loop's monotonic
    seconds): a new token on one of its streams, or a reply to one of its legs. Shared by the
    flows of one router process."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def note(self, url: str, now: float) -> None:
        self._last[url] = max(now, self._last.get(url, now))

    def idle_s(self, url: str, now: float) -> float:
        """Seconds since ``url`` last made progress (infinite: never, as far as the router saw)."""
        last = self._last.get(url)
        return math.inf if last is None else max(0.0, now - last)
