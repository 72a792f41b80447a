"""Traces at a fleet's scale: a public trace is one small cluster's load (the Mooncake
trace: 3.9 requests/s); sizing for tens of GPUs needs more.

`tile_trace` lays K copies side by side, each another population of users: its own hash ids
(no prefix shared with the other copies, not even a system prompt, which is conservative for
every prefix cache) and its own sessions. The rate grows K times while each request's prompt,
output, reuse and each session's think times stay the trace's own. Replaying faster instead
(`rate_scale`) also shortens the time between a prefix's uses, so caches look better than
they would at scale.

Where the copies sit in time (`mode`):
- "spread" (the default): copy k is the trace rotated by k/K of its period (its span plus one
  mean gap), whole sessions at a time: each session (or request without one) keeps its own
  timing and moves by the same offset, wrapping to the start when its first turn would land
  past the period. K independent populations are not in phase: a burst of the trace arrives
  once, not K times at once, and the copies' bursts fill each other's lulls.
- "lockstep": copy k shifted by k/K of one mean gap, so every burst arrives K times within one
  gap. A what-if (and the earlier behaviour): it sizes for bursts K times the trace's.

`seed` (spread only): 0 keeps the even offsets k/K; another seed draws copy k's offset
uniformly in [k/K, (k+1)/K) of the period, so a recorded trace's seeds differ in where the
copies' bursts meet, the one thing about a tiled trace file a seed can honestly change.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import List, Sequence

from sglang_pdd.sim.workload import TraceRequest

TILE_MODES = ("spread", "lockstep")


def tile_trace(trace: Sequence[TraceRequest], copies: int, mode: str = "spread", seed: int = 0) -> List[TraceRequest]:
    if copies < 1:
        raise ValueError("copies must be >= 1")
    if mode not in TILE_MODES:
        raise ValueError(f"mode must be one of {TILE_MODES}, got {mode!r}")
    trace = list(trace)
    if copies == 1 or not trace:
        return trace
    stride = 1 + max((h for r in trace for h in r.hash_ids), default=0)
    sessions = 1 + max((r.session_id for r in trace if r.session_id is not None), default=0)
    ts = [r.timestamp_ms for r in trace]
    t0 = min(ts)
    gap = (max(ts) - t0) / max(1, len(trace) - 1)
    # The trace as one cycle: its last request one mean gap before its first comes round again.
    period = max(ts) - t0 + gap
    # Each request's unit of rotation starts at its session's first turn (its own time without
    # a session), so a session moves as a whole and its turns keep their order and gaps.
    first = {}
    for r in trace:
        if r.session_id is not None and r.timestamp_ms < first.get(r.session_id, float("inf")):
            first[r.session_id] = r.timestamp_ms
    rng = random.Random(seed) if seed else None
    out = []
    for k in range(copies):
        offset = period * (k + (rng.random() if rng else 0.0)) / copies
        for r in trace:
            if mode == "lockstep":
                shift = gap * k / copies
            else:
                start = (r.timestamp_ms if r.session_id is None else first[r.session_id]) - t0
                shift = (start + offset) % period - start
            out.append(replace(r, timestamp_ms=r.timestamp_ms + shift,
                               hash_ids=tuple(h + k * stride for h in r.hash_ids),
                               session_id=None if r.session_id is None else r.session_id + k * sessions))
    out.sort(key=lambda r: r.timestamp_ms)
    return out


def tiling_label(copies: int, mode: str) -> str:
    """How a trace was tiled, as every printed summary names it."""
    return "not tiled" if copies <= 1 else f"tiled {copies}x {mode}"


def has_sessions(trace: Sequence[TraceRequest]) -> bool:
    """Does some session have a next turn? Only then do turns following answers
    (arrivals="sessions") differ from replaying every request at its trace time."""
    seen = set()
    for r in trace:
        if r.session_id is not None:
            if r.session_id in seen:
                return True
            seen.add(r.session_id)
    return False


def effective_arrivals(trace: Sequence[TraceRequest], arrivals: str) -> str:
    """What a run asked for `arrivals` does with this trace: without sessions, open loop."""
    return arrivals if has_sessions(trace) else "open"


def arrivals_label(trace: Sequence[TraceRequest], arrivals: str) -> str:
    """How the trace arrives, as every printed summary names it."""
    if effective_arrivals(trace, arrivals) == "sessions":
        return "arrivals sessions (turns follow answers)"
    return "open loop" if arrivals == "open" else "open loop (the trace has no sessions)"
