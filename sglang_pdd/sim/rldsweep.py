"""The router's RLD admission (`--rld-max-running`) swept on one fleet and trace.

It is RLD's load in the path decision: the load-aware WAN budget is the idle share of the TTFT
slack (0 in relay_first mode, --p-md-share-idle in fit mode) while RLD's flows in flight are
under half of it and the whole slack above 0.9 of it (router/policy.py). A
small value makes RLD look busy early, so more requests go P -> MD: less RLD work, but their
users wait between P's first token and MD's second for the registration and the KV (the
switch stall). A large value keeps every request on RLD first: small stalls, and RLD decodes
the start of everything. The sweep shows both sides; the router's default is chosen from it
(docs/sim-notebook.md, "RLD admission").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, List, Optional, Sequence

from sglang_pdd.sim.workload import TraceRequest

from .cluster import ScenarioConfig, run_scenario
from .metrics import Sla, Summary


@dataclass(frozen=True)
class AdmissionPoint:
    rld_max_running: int
    summary: Summary

    @property
    def p_md_share(self) -> float:
        s = self.summary
        return s.paths.get("p_md", 0) / s.requests if s.requests else 0.0

    @property
    def via_rld_share(self) -> float:
        """Requests RLD decoded from its first token (P -> RLD -> MD and P -> RLD)."""
        return 1.0 - self.p_md_share


def rld_admission_sweep(cfg: ScenarioConfig, trace: Sequence[TraceRequest], sla: Sla, values: Sequence[int],
                        rate_scale: float = 1.0,
                        progress: Optional[Callable[[], None]] = None,
                        arrivals: str = "sessions") -> List[AdmissionPoint]:
    if cfg.kind != "pdd" or cfg.n_rld < 1:
        raise ValueError("the RLD admission sweep needs a PDD scenario with an RLD")
    out = []
    for v in values:
        out.append(AdmissionPoint(v, run_scenario(replace(cfg, rld_max_running=v), trace, sla, rate_scale, arrivals)))
        if progress:
            progress()
    return out


def choose_default(points: Sequence[AdmissionPoint], max_stall_p99_s: float, max_sla_loss: float = 0.005) -> AdmissionPoint:
    """The admission that sends the most requests P -> MD (least RLD work) while the switch
    stall's p99 stays within `max_stall_p99_s` and SLA attainment within `max_sla_loss` of
    the sweep's best; the largest value (all through RLD) if none qualifies."""
    best_sla = max(p.summary.sla_attainment for p in points)
    ok = [p for p in points if p.summary.sla_attainment >= best_sla - max_sla_loss
          and not p.summary.stall_p99 > max_stall_p99_s]
    if not ok:
        return max(points, key=lambda p: p.rld_max_running)
    return min(ok, key=lambda p: (p.summary.rld_token_share, -p.rld_max_running))
