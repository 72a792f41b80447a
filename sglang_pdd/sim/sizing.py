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
    rate_scale: float = 1.0,
    closed_loop: bool = False,
) -> Optional[SizingResult]:
    best: Optional[SizingResult] = None
    rlds: List[int] = list(rld_range) if base.kind == "pdd" else [0]
    for n_p in prefill_range:
        for n_rld in rlds:
            cache = {}

            def attempt(n_md: int) -> Summary:
                if n_md not in cache:
                    cache[n_md] = run_scenario(with_counts(base, n_p, n_rld, n_md), trace, sla, rate_scale,
                                               closed_loop)
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


@dataclass(frozen=True)
class DesignVerdict:
    """The cheapest PD and the cheapest PDD mix for the same trace, SLA and target, and
    which one to build. PDD is never recommended when PD is cheaper (or when no PDD mix
    reaches the target): the message then says that PD wins."""
    pd: Optional[SizingResult]
    pdd: Optional[SizingResult]
    winner: str  # "pd" | "pdd" | "none"
    message: str


def compare_designs(pd_base: ScenarioConfig, pdd_base: ScenarioConfig, trace: Sequence[TraceRequest], sla: Sla,
                    target_attainment: float, prefill_range: Iterable[int], rld_range: Iterable[int], md_max: int,
                    progress: Optional[Callable[[], None]] = None, rate_scale: float = 1.0,
                    closed_loop: bool = False) -> DesignVerdict:
    if pd_base.kind != "pd" or pdd_base.kind != "pdd":
        raise ValueError("compare_designs needs a pd and a pdd scenario")
    prefill_range, rld_range = list(prefill_range), list(rld_range)
    # PD gets as many decode instances as PDD may have (RLD + MD) at most.
    pd = size_cluster(pd_base, trace, sla, target_attainment, prefill_range, [0], md_max + max(rld_range),
                      progress, rate_scale, closed_loop)
    pdd = size_cluster(pdd_base, trace, sla, target_attainment, prefill_range, rld_range, md_max, progress,
                       rate_scale, closed_loop)
    goal = f"{target_attainment:.0%} SLA attainment"
    if pd is None and pdd is None:
        return DesignVerdict(pd, pdd, "none", f"neither PD nor PDD reaches {goal} within the searched ranges")
    if pdd is None:
        return DesignVerdict(pd, pdd, "pd", f"PD wins here: no PDD mix reaches {goal}; "
                                            f"PD does at ${pd.cost_per_hour:.1f}/h")
    if pd is None:
        return DesignVerdict(pd, pdd, "pdd", f"PDD wins: ${pdd.cost_per_hour:.1f}/h; no PD mix in the "
                                             f"searched ranges reaches {goal}")
    if pd.cost_per_hour <= pdd.cost_per_hour:
        more = (pdd.cost_per_hour / pd.cost_per_hour - 1.0) * 100.0
        return DesignVerdict(pd, pdd, "pd", f"PD wins here: ${pd.cost_per_hour:.1f}/h meets {goal}; the cheapest "
                                            f"PDD mix costs ${pdd.cost_per_hour:.1f}/h ({more:+.0f}%)")
    less = (1.0 - pdd.cost_per_hour / pd.cost_per_hour) * 100.0
    # Without RLD the "PDD" mix is cross-DC PD with a decode-side cache: say so.
    what = "PDD (no RLD: cross-DC PD with DRC)" if pdd.n_rld == 0 else "PDD"
    return DesignVerdict(pd, pdd, "pdd", f"{what} wins: ${pdd.cost_per_hour:.1f}/h meets {goal}, {less:.0f}% less "
                                         f"than PD's ${pd.cost_per_hour:.1f}/h")
