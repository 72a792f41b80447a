"""Sizing: the cheapest instance mix that meets an SLA-attainment target on a trace.

For each (prefill, RLD) count, binary-search the smallest MD count that meets the target
(attainment rises with MD count), then keep the cheapest mix. Instance counts are small
integers, so this exhaustive-with-bisection search is exact on the given ranges.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Sequence

from sglang_pdd.workload import TraceRequest

from .cluster import ScenarioConfig, run_scenario
from .metrics import Sla, Summary
from .scenarios import with_counts


@dataclass(frozen=True)
class SizingResult:
    n_prefill: int
    n_rld: int
    n_md: int
    cost_per_hour: float
    summary: Summary


def size_cluster(
    base: ScenarioConfig,
    trace: Sequence[TraceRequest],
    sla: Sla,
    target_attainment: float,
    prefill_range: Iterable[int],
    rld_range: Iterable[int],
    md_max: int,
    progress: Optional[Callable[[], None]] = None,
) -> Optional[SizingResult]:
    best: Optional[SizingResult] = None
    rlds: List[int] = list(rld_range) if base.kind == "pdd" else [0]
    for n_p in prefill_range:
        for n_rld in rlds:
            cache = {}

            def attempt(n_md: int) -> Summary:
                if n_md not in cache:
                    cache[n_md] = run_scenario(with_counts(base, n_p, n_rld, n_md), trace, sla)
                    if progress:
                        progress()
                return cache[n_md]

            if attempt(md_max).sla_attainment < target_attainment:
                continue  # more MD does not help: prefill or RLD is the bottleneck
            lo, hi = 1, md_max
            while lo < hi:
                mid = (lo + hi) // 2
                if attempt(mid).sla_attainment >= target_attainment:
                    hi = mid
                else:
                    lo = mid + 1
            cfg = with_counts(base, n_p, n_rld, lo)
            if best is None or cfg.cost_per_hour < best.cost_per_hour:
                best = SizingResult(n_p, n_rld, lo, cfg.cost_per_hour, attempt(lo))
    return best
