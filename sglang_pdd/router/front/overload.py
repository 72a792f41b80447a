"""Overload shedding: whether one more request may start now (pure, no I/O).

Every request holds a relay decode server (RLD) from its start to its end, whatever its path
(router/front/flow_runner.py counts it), so the requests in flight on an RLD are what it runs plus
what waits in its and its P's queues for it. Unbounded, a saturated cluster queued requests for
minutes (TTFTs of 281 s, then --request-timeout-s failed them) instead of refusing at once as
SGLang's own router does. Here a request is refused (503 with Retry-After, before anything is
started) when the RLD it would get, the least loaded one, holds ``per_relay`` requests, or the
router holds ``total`` in all.

By default the caps come from the backends: an RLD may hold ``queue_factor`` (4) times the
requests it runs at once (its ``--max-running-requests``, from its ``/v1/loads``: a running
batch and three batches' worth waiting for it), and the router the sum of its RLDs' caps. An RLD whose size is not known yet (it has
not answered) is not bounded, unless ``per_relay`` is given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional


@dataclass(frozen=True)
class OverloadLimits:
    per_relay: Optional[int] = None  # requests in flight on one RLD (None: queue_factor x its running slots)
    total: Optional[int] = None  # requests in flight in all (None: the sum of the RLDs' caps)
    queue_factor: float = 4.0  # an RLD's cap, in its --max-running-requests
    retry_after_s: int = 1

    def __post_init__(self):
        for name in ("per_relay", "total"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or None: from the backends), got {value}")
        if not self.queue_factor >= 1:
            raise ValueError(f"queue_factor must be >= 1, got {self.queue_factor}")


def relay_cap(limits: OverloadLimits, running_slots: Optional[int]) -> Optional[int]:
    """Requests one RLD may hold: ``per_relay``, else ``queue_factor`` x its running slots
    (None while they are not known: no cap)."""
    if limits.per_relay is not None:
        return limits.per_relay
    if not running_slots:
        return None
    return max(1, math.ceil(running_slots * limits.queue_factor))


def total_cap(limits: OverloadLimits, slots: Mapping[str, Optional[int]]) -> Optional[int]:
    """Requests the router may hold: ``total``, else the sum of every RLD's cap (None while one
    of them is not bounded)."""
    if limits.total is not None:
        return limits.total
    caps = [relay_cap(limits, s) for s in slots.values()]
    return None if not caps or any(c is None for c in caps) else sum(caps)


def refusal(limits: OverloadLimits, relay: str, inflight: Mapping[str, int],
            slots: Mapping[str, Optional[int]]) -> Optional[str]:
    """None when a request may start on ``relay``; else why not, in words (the 503's message).
    ``inflight``: requests in flight per RLD; ``slots``: each RLD's running slots, as known."""
    total, cap = total_cap(limits, slots), relay_cap(limits, slots.get(relay))
    held = sum(inflight.values())
    if total is not None and held >= total:
        return (f"overloaded: {held} requests in flight, the router's cap is {total} "
                f"(--max-inflight-total); retry after {limits.retry_after_s} s")
    if cap is not None and inflight.get(relay, 0) >= cap:
        return (f"overloaded: every relay decode server holds its cap of requests ({cap}, "
                f"--max-inflight-per-relay); retry after {limits.retry_after_s} s")
    return None


def running_slots_of(loads_reply: dict) -> Optional[int]:
    """An SGLang server's running slots from its ``GET /v1/loads`` reply: the sum of its DP
    ranks' ``max_running_requests`` (None if the reply names none)."""
    loads = loads_reply.get("loads") if isinstance(loads_reply, dict) else None
    if not isinstance(loads, list):
        return None
    slots = [load.get("max_running_requests") for load in loads if isinstance(load, dict)]
    slots = [s for s in slots if isinstance(s, int) and not isinstance(s, bool) and s > 0]
    return sum(slots) or None
