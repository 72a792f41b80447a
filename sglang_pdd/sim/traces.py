"""Traces at a fleet's scale: a public trace is one small cluster's load (the Mooncake
trace: 3.9 requests/s); sizing for tens of GPUs needs more.

`tile_trace` lays K copies side by side, each another population of users: its own hash ids
(no prefix shared with the other copies, not even a system prompt, which is conservative for
every prefix cache) and its own sessions, shifted by a fraction of the mean gap so arrivals
interleave. The rate grows K times while each request's prompt, output, reuse and each
session's think times stay the trace's own. Replaying faster instead (`rate_scale`) also
shortens the time between a prefix's uses, so caches look better than they would at scale.
"""

from __future__ import annotations

from dataclasses import replace
from typing import List, Sequence

from sglang_pdd.workload import TraceRequest


def tile_trace(trace: Sequence[TraceRequest], copies: int) -> List[TraceRequest]:
    if copies < 1:
        raise ValueError("copies must be >= 1")
    trace = list(trace)
    if copies == 1 or not trace:
        return trace
    stride = 1 + max((h for r in trace for h in r.hash_ids), default=0)
    sessions = 1 + max((r.session_id for r in trace if r.session_id is not None), default=0)
    ts = [r.timestamp_ms for r in trace]
    gap = (max(ts) - min(ts)) / max(1, len(trace) - 1)
    out = []
    for k in range(copies):
        shift = gap * k / copies
        for r in trace:
            out.append(replace(r, timestamp_ms=r.timestamp_ms + shift,
                               hash_ids=tuple(h + k * stride for h in r.hash_ids),
                               session_id=None if r.session_id is None else r.session_id + k * sessions))
    out.sort(key=lambda r: r.timestamp_ms)
    return out
