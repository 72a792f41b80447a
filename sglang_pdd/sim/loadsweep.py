"""Goodput vs offered load: the same trace replayed faster or slower (`rate_scale`: with
arrivals="sessions", its session starts; think times stay the trace's), and the knee, the highest offered rate at which the SLA-attainment target still holds.

Goodput of one run can never exceed its offered rate, so one run at the trace's own rate
says nothing about capacity. The knee does: `knee_goodput_rps` is what the cluster serves
within the SLA at the most load it sustains, and `knee_bcr` puts that on the cost axis
(SLA-meeting requests per $ of hardware when run at the knee), comparable across designs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

from sglang_pdd.workload import TraceRequest

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


def load_sweep(cfg: ScenarioConfig, trace: Sequence[TraceRequest], sla: Sla, scales: Sequence[float],
               target: float = 0.9, progress: Optional[Callable[[], None]] = None,
               arrivals: str = "sessions") -> Knee:
    """Runs `cfg` at every rate scale (ascending) and finds the knee. Attainment is not
    strictly monotone in load (a slower replay can change cache timing), so the knee is
    the highest rate whose attainment meets the target with every lower rate meeting it."""
    points = []
    knee = None
    broken = False
    for k in sorted(scales):
        s = run_scenario(cfg, trace, sla, rate_scale=k, arrivals=arrivals)
        p = LoadPoint(k, s.offered_rps, s.goodput_rps, s.sla_attainment, s.ttft_p90, s)
        points.append(p)
        if progress:
            progress()
        if not broken and s.sla_attainment >= target:
            knee = p
        else:
            broken = True
    return Knee(cfg.name, cfg.cost_per_hour, points, knee)
