"""Goodput vs offered load: the same trace replayed faster or slower (`rate_scale`: with
arrivals="sessions", its session starts; think times stay the trace's), and the knee, the highest offered rate at which the SLA-attainment target still holds.

Goodput of one run can never exceed its offered rate, so one run at the trace's own rate
says nothing about capacity. The knee does: `knee_goodput_rps` is what the cluster serves
within the SLA at the most load it sustains, and `knee_bcr` puts that on the cost axis
(SLA-meeting requests per $ of hardware when run at the knee), comparable across designs.

A coarse grid of scales only says between which two grid points the knee lies: designs whose
knees fall in the same gap tie. `find_knee` therefore can refine: it bisects the gap between
the knee and the first failing scale (or, when even the lowest scale fails, the gap between a
floor and that scale) until it is narrower than a relative resolution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from sglang_pdd.sim.workload import TraceRequest

from .cluster import ScenarioConfig, run_scenario
from .metrics import Sla, Summary


@dataclass(frozen=True)
class LoadPoint:
    rate_scale: float
    offered_rps: float
    goodput_rps: float
    sla_attainment: float
    ttft_p90: float
    summary: Summary


@dataclass(frozen=True)
class Knee:
    scenario: str
    cost_per_hour: float
    points: List[LoadPoint]
    knee: Optional[LoadPoint]  # None: the target fails even at the lowest rate

    @property
    def knee_goodput_rps(self) -> float:
        return self.knee.goodput_rps if self.knee else 0.0

    @property
    def knee_bcr(self) -> float:
        """SLA-meeting requests per $ of hardware at the knee."""
        return self.knee_goodput_rps * 3600.0 / self.cost_per_hour if self.cost_per_hour > 0 else 0.0


def find_knee(passes: Callable[[float], bool], scales: Sequence[float], resolution: float = 0.0,
              floor: Optional[float] = None, stop_at_fail: bool = False) -> Optional[float]:
    """The highest rate scale that passes with every lower tested scale passing; None when
    the lowest tested scale fails. `passes(k)` runs (and may record) the load at scale k.

    Coarse: every scale in `scales`, ascending (after the first failure only when
    `stop_at_fail` is off: the rule ignores a pass above a failure, so those runs only draw
    the curve). Refined (`resolution` > 0): geometric bisection of the bracket [knee, first
    failing scale] until hi / lo - 1 <= resolution; a midpoint that passes becomes the
    knee, one that fails the new upper end. When the lowest scale fails and `floor` is below
    it, the floor is tried first (failing there: None) and the bracket is [floor, lowest].

    Attainment is not strictly monotone in load, so the rule stays "every lower *tested*
    scale passes": refinement never moves the knee above a tested failure, and a pass above
    one is ignored, but a failing dip between two tested scales goes unseen, as it does
    between the coarse grid's points. A bracket from the grid whose top passes (no failure
    at all) is not refined: the knee is then "at least the top scale".
    """
    lo: Optional[float] = None
    hi: Optional[float] = None
    for k in sorted(scales):
        if hi is not None and stop_at_fail:
            break
        ok = passes(k)
        if hi is None and ok:
            lo = k
        elif hi is None:
            hi = k
    if resolution <= 0 or hi is None:
        return lo
    if lo is None:
        if floor is None or floor >= hi:
            return None
        if not passes(floor):
            return None
        lo = floor
    while hi / lo - 1 > resolution:
        mid = math.sqrt(lo * hi)
        if passes(mid):
            lo = mid
        else:
            hi = mid
    return lo


def load_sweep(cfg: ScenarioConfig, trace: Sequence[TraceRequest], sla: Sla, scales: Sequence[float],
               target: float = 0.9, progress: Optional[Callable[[], None]] = None,
               arrivals: str = "sessions", resolution: float = 0.0, floor: Optional[float] = None,
               stop_at_fail: bool = False) -> Knee:
    """Runs `cfg` at every rate scale (ascending) and finds the knee (`find_knee`'s rule:
    the highest rate whose attainment meets the target with every lower tested rate meeting
    it; with `resolution` > 0 the knee is refined to that relative width). `points` holds
    every run, ascending by scale."""
    runs: Dict[float, LoadPoint] = {}

    def passes(k: float) -> bool:
        s = run_scenario(cfg, trace, sla, rate_scale=k, arrivals=arrivals)
        runs[k] = LoadPoint(k, s.offered_rps, s.goodput_rps, s.sla_attainment, s.ttft_p90, s)
        if progress:
            progress()
        return s.sla_attainment >= target

    k = find_knee(passes, scales, resolution, floor, stop_at_fail)
    points = [runs[x] for x in sorted(runs)]
    return Knee(cfg.name, cfg.cost_per_hour, points, None if k is None else runs[k])
