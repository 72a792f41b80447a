"""Throughput vs mean prefix-hit rate (the "bathtub").

Every request has the same prompt and output length; a fraction `hit` of its prompt is the
previous turn of its session (same block ids), the rest is new. Offered load is set above
capacity, so requests/s over the run measure what the cluster can sustain at that hit
rate. Block alignment matters: the part of the hit that ends inside a 512-token block is
a "tail chunk" that no cache can reuse, so it is recomputed and shipped again.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence

from sglang_pdd.workload import BLOCK_TOKENS, TraceRequest, blocks_for

from .cluster import ScenarioConfig, run_scenario
from .metrics import Sla


def fixed_hit_trace(n: int, hit: float, input_tokens: int = 16_384, output_tokens: int = 128,
                    rate_per_s: float = 20.0, sessions: int = 64, seed: int = 0) -> Iterator[TraceRequest]:
    rng = random.Random(seed)
    next_id = 0
    last: Dict[int, tuple] = {}
    shared_tokens = int(hit * input_tokens)
    shared_blocks = shared_tokens // BLOCK_TOKENS  # whole blocks only; the rest is the tail chunk
    t = 0.0
    for _ in range(n):
        sid = rng.randrange(sessions)
        prev = last.get(sid)
        keep = list(prev[:shared_blocks]) if prev is not None else []
        new = blocks_for(input_tokens) - len(keep)
        ids = tuple(keep + list(range(next_id, next_id + new)))
        next_id += new
        last[sid] = ids
        yield TraceRequest(round(t * 1e3, 3), input_tokens, output_tokens, ids, sid)
        t += rng.expovariate(rate_per_s)


@dataclass(frozen=True)
class BathtubPoint:
    scenario: str
    target_hit: float
    mean_md_hit: float
    throughput_rps: float
    goodput_rps: float
    wan_util: float


def sweep(scenarios: Sequence[ScenarioConfig], hits: Sequence[float], n: int, sla: Sla,
          rate_per_s: float = 20.0, seed: int = 0, progress: Optional[Callable[[], None]] = None,
          **trace_kw) -> List[BathtubPoint]:
    points = []
    for hit in hits:
        trace = list(fixed_hit_trace(n, hit, rate_per_s=rate_per_s, seed=seed, **trace_kw))
        for cfg in scenarios:
            s = run_scenario(cfg, trace, sla)
            points.append(BathtubPoint(cfg.name, hit, s.mean_md_hit, s.requests / s.duration_s,
                                       s.goodput_rps, s.wan_util))
            if progress:
                progress()
    return points
