"""Sizing: the cheapest instance mix that meets an SLA-attainment target on a trace.

Every candidate faces the **same sessions**: by default (`arrivals="sessions"`) each session
starts at its trace time (times `rate_scale`), whatever the design does, and each next turn
arrives its think time after the previous turn's answer, as an agent's does. A slower design
stretches its sessions but cannot shed them: the long-run rate is session starts x turns, the
same for every design, and a backlog shows in the last tenth (below). Replaying every turn
at its trace time instead (`arrivals="open"`, what a trace without sessions does anyway) sends
a turn before the answer it extends, with its whole context uncached on MD: the trace model,
not the design, then decided the cross-DC verdicts. A fixed population of clients (a plain
closed loop) would let a slow design receive less load and look cheaper; that is not done.
Every run serves every request of the trace (and, open, the trace's rate: the demand). A
mix meets the target when its SLA attainment reaches it **over the whole run and over its
last tenth of arrivals** (`Summary.tail_sla_attainment`): a backlog that builds up late in
the trace would otherwise hide in the overall percentage.

For each RLD count: bisect the fewest P that meet the target with some MD count, then for
each P count from there, count MD up from one to the first that meets it, and stop adding P
once P alone costs more than the cheapest mix found. That assumes more P never hurts; more
MD can (at the report's scale on a 50 Gbps WAN, P5/R1/M3 met the target and P5/R1/M6 did
not: the router's affinity escape spreads turns over MDs without their prefix), so MD's
count is never bisected (the price: about twice the runs). When the cheapest mix sits on an
edge of a range, `SizingResult.edges` says which (a wider range may hold a cheaper mix).
Costs include the WAN's lease for a cross-datacenter design (ScenarioConfig.cost_per_hour).
Instances are TP groups of the presets' size (hardware.instance_chips);
`hardware.smallest_group` is the least a group can be (an RLD may use it: --rld-chips).

`size_designs` sizes PDD and every baseline (scenarios.BASELINES) on the same trace and
states PDD's verdict against each, the baseline named. PDD is sized under each of the
router's path modes (`--path-mode`: fit, relay_first) and the cheaper one stands for PDD,
named in every output: the mode is a deployment choice, like the mix. `verdicts_over_seeds`
states the verdicts over several seeds: a design wins only where it wins on every seed; a
difference that changes sign between seeds is inside the spread, a tie.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, List, Optional, Sequence

from sglang_pdd.router.policy import PathMode
from sglang_pdd.sim.workload import TraceRequest

from .cluster import ScenarioConfig, run_scenario
from .metrics import Sla, Summary
from .scenarios import with_counts


def keeps_up(s: Summary, target_attainment: float) -> bool:
    """Did the run keep serving its demand to the end (no backlog building up late)?"""
    return s.tail_sla_attainment >= target_attainment


def meets(s: Summary, target_attainment: float) -> bool:
    return s.sla_attainment >= target_attainment and keeps_up(s, target_attainment)


def offered_rps(trace: Sequence[TraceRequest], rate_scale: float = 1.0) -> float:
    """The demand: arrivals per second of the trace replayed open loop (with arrivals="sessions",
    the long-run rate of a design that keeps up)."""
    if len(trace) < 2:
        return 0.0
    ts = [tr.timestamp_ms for tr in trace]
    span_s = (max(ts) - min(ts)) / 1e3 / rate_scale
    return (len(trace) - 1) / span_s if span_s > 0 else 0.0


@dataclass(frozen=True)
class SizingResult:
    n_prefill: int
    n_rld: int
    n_md: int
    cost_per_hour: float
    summary: Summary
    edges: List[str] = field(default_factory=list)  # range edges the optimum sits on


def _edges(n_p: int, n_rld: int, n_md: int, prefill_range: List[int], rlds: List[int], md_max: int,
           md_name: str) -> List[str]:
    out = []
    if n_p == max(prefill_range) and len(prefill_range) > 1:
        out.append(f"prefill={n_p} is the top of the prefill range")
    if n_p == min(prefill_range) and n_p > 1:
        out.append(f"prefill={n_p} is the bottom of the prefill range")
    if n_md == md_max:
        out.append(f"{md_name}={n_md} is the top of the {md_name} range")
    if len(rlds) > 1 and n_rld == max(rlds):
        out.append(f"rld={n_rld} is the top of the RLD range")
    if n_rld == min(rlds) and n_rld > 0:
        out.append(f"rld={n_rld} is the bottom of the RLD range")
    return out


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
    arrivals: str = "sessions",
    no_rld_runs: Optional[dict] = None,
) -> Optional[SizingResult]:
    """no_rld_runs: runs without an RLD shared with another sizing of the same trace, SLA and
    design that differs only in the router's path mode (size_designs): with no RLD there is
    no path to choose, every request goes P->MD, so the mode changes nothing in such a run."""
    best: Optional[SizingResult] = None
    prefill_range = sorted(prefill_range)
    rlds: List[int] = list(rld_range) if base.kind == "pdd" else [0]
    demand = offered_rps(trace, rate_scale)
    own = {}

    def attempt(n_p: int, n_rld: int, n_md: int) -> Optional[Summary]:
        """The run's summary; None for a run given up once it could no longer meet the target."""
        key = (n_p, n_rld, n_md)
        cache = no_rld_runs if n_rld == 0 and no_rld_runs is not None else own
        if key not in cache:
            s = run_scenario(with_counts(base, n_p, n_rld, n_md), trace, sla, rate_scale, arrivals,
                             give_up_below=target_attainment)
            if s is not None and s.requests != len(trace):
                raise RuntimeError(f"a sizing run served {s.requests} requests, not the trace's {len(trace)}")
            if s is not None and arrivals == "open" and abs(s.offered_rps - demand) > 1e-6 * max(1.0, demand):
                raise RuntimeError(f"a sizing run saw {s.offered_rps} r/s, not the demand {demand}")
            cache[key] = s
            if progress:
                progress()
        return cache[key]

    def ok(n_p: int, n_rld: int, n_md: int) -> bool:
        s = attempt(n_p, n_rld, n_md)
        return s is not None and meets(s, target_attainment)

    def fewest_md(n_p: int, n_rld: int) -> Optional[int]:
        """The fewest MD (D) that meet the target at these counts, counted up from one (not
        monotone: the module's note), or None; stops once the mix would cost more than the
        cheapest found."""
        for n_md in range(1, md_max + 1):
            if best is not None and with_counts(base, n_p, n_rld, n_md).cost_per_hour >= best.cost_per_hour:
                return None
            if ok(n_p, n_rld, n_md):
                return n_md
        return None

    def can_meet(n_p: int, n_rld: int) -> bool:
        return any(ok(n_p, n_rld, n_md) for n_md in range(1, md_max + 1))

    for n_rld in rlds:
        # No mix with this many RLD can cost less than its fewest P with one MD: if that is
        # already no cheaper than the best found, the search below would find nothing better.
        if best is not None and with_counts(base, prefill_range[0], n_rld, 1).cost_per_hour >= best.cost_per_hour:
            continue
        # the fewest P that meet the target with some MD count (more P never hurts)
        lo, hi = 0, len(prefill_range)
        while lo < hi:
            mid = (lo + hi) // 2
            if can_meet(prefill_range[mid], n_rld):
                hi = mid
            else:
                lo = mid + 1
        for n_p in prefill_range[lo:]:
            if best is not None and with_counts(base, n_p, n_rld, 1).cost_per_hour >= best.cost_per_hour:
                break  # more P alone already costs more than the cheapest mix
            n_md = fewest_md(n_p, n_rld)
            if n_md is None:
                continue
            cfg = with_counts(base, n_p, n_rld, n_md)
            if best is None or cfg.cost_per_hour < best.cost_per_hour:
                best = SizingResult(n_p, n_rld, n_md, cfg.cost_per_hour, attempt(n_p, n_rld, n_md))
    if best is not None:
        name = "md" if base.kind == "pdd" else "d"
        best = SizingResult(best.n_prefill, best.n_rld, best.n_md, best.cost_per_hour, best.summary,
                            _edges(best.n_prefill, best.n_rld, best.n_md, prefill_range, rlds, md_max, name))
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

    @property
    def warnings(self) -> List[str]:
        """Where a cheapest mix sits on an edge of its search range (widen it and rerun)."""
        return [f"cheapest {tag} mix: {e}" for tag, r in (("PD", self.pd), ("PDD", self.pdd)) if r for e in r.edges]


def compare_designs(pd_base: ScenarioConfig, pdd_base: ScenarioConfig, trace: Sequence[TraceRequest], sla: Sla,
                    target_attainment: float, prefill_range: Iterable[int], rld_range: Iterable[int], md_max: int,
                    progress: Optional[Callable[[], None]] = None, rate_scale: float = 1.0,
                    arrivals: str = "sessions") -> DesignVerdict:
    if pd_base.kind != "pd" or pdd_base.kind != "pdd":
        raise ValueError("compare_designs needs a pd and a pdd scenario")
    prefill_range, rld_range = list(prefill_range), list(rld_range)
    # PD gets as many decode instances as PDD may have (RLD + MD) at most.
    pd = size_cluster(pd_base, trace, sla, target_attainment, prefill_range, [0], md_max + max(rld_range),
                      progress, rate_scale, arrivals)
    pdd = size_cluster(pdd_base, trace, sla, target_attainment, prefill_range, rld_range, md_max, progress,
                       rate_scale, arrivals)
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


@dataclass(frozen=True)
class Verdict:
    """PDD's cheapest mix against one baseline's, at the same trace, SLA and target."""
    baseline: str  # a scenario name (scenarios.BASELINES)
    label: str  # what the baseline is, in words
    winner: str  # "pdd" | "baseline" | "tie" | "none"
    delta: Optional[float]  # PDD's cost / the baseline's - 1; None if either found no mix
    message: str


@dataclass(frozen=True)
class DesignSizing:
    """The cheapest mix of every design, and PDD's verdict against each baseline."""
    results: dict  # scenario name -> Optional[SizingResult]; PDD's under `pdd_mode`
    pdd_name: str
    verdicts: List[Verdict]
    pdd_by_mode: dict = field(default_factory=dict)  # PathMode value -> Optional[SizingResult]
    pdd_mode: Optional[str] = None  # the path mode PDD's result was sized under

    @property
    def warnings(self) -> List[str]:
        return [f"cheapest {name} mix: {e}" for name, r in self.results.items() if r for e in r.edges]


def verdict(baseline: str, label: str, base: Optional[SizingResult], pdd: Optional[SizingResult],
            goal: str) -> Verdict:
    pdd_what = "PDD" if pdd is None or pdd.n_rld else "PDD without RLD"
    if base is None and pdd is None:
        return Verdict(baseline, label, "none", None, f"vs {label}: neither reaches {goal}")
    if pdd is None:
        return Verdict(baseline, label, "baseline", None,
                       f"vs {label}: {label} wins, ${base.cost_per_hour:.1f}/h; no PDD mix reaches {goal}")
    if base is None:
        return Verdict(baseline, label, "pdd", None,
                       f"vs {label}: {pdd_what} wins, ${pdd.cost_per_hour:.1f}/h; no {label} mix in the searched "
                       f"ranges reaches {goal}")
    delta = pdd.cost_per_hour / base.cost_per_hour - 1.0
    if abs(pdd.cost_per_hour - base.cost_per_hour) < 0.01:  # the same $/h: neither wins
        same = "" if pdd.n_rld else f" (PDD's cheapest mix has no RLD: {label}'s fleet under PDD's router)"
        return Verdict(baseline, label, "tie", delta,
                       f"vs {label}: a tie, ${pdd.cost_per_hour:.1f}/h each{same}")
    if delta < 0:
        return Verdict(baseline, label, "pdd", delta,
                       f"vs {label}: {pdd_what} wins, ${pdd.cost_per_hour:.1f}/h vs ${base.cost_per_hour:.1f}/h "
                       f"({100 * delta:+.0f}%)")
    return Verdict(baseline, label, "baseline", delta,
                   f"vs {label}: {label} wins, ${base.cost_per_hour:.1f}/h vs PDD's ${pdd.cost_per_hour:.1f}/h "
                   f"(PDD {100 * delta:+.0f}%)")


def pick_path_mode(by_mode: dict) -> Optional[str]:
    """The path mode of PDD's cheapest sized mix; at the same $/h the higher SLA attainment,
    then the router's default (fit). None if no mode met the target."""
    found = [(mode, r) for mode, r in by_mode.items() if r is not None]
    if not found:
        return None
    order = [m.value for m in PathMode]
    return min(found, key=lambda mr: (round(mr[1].cost_per_hour, 2), -mr[1].summary.sla_attainment,
                                      order.index(mr[0])))[0]


def size_designs(bases: dict, pdd_name: str, trace: Sequence[TraceRequest], sla: Sla, target_attainment: float,
                 prefill_range: Iterable[int], rld_range: Iterable[int], md_max: int,
                 progress: Optional[Callable[[], None]] = None, rate_scale: float = 1.0,
                 labels: Optional[dict] = None, arrivals: str = "sessions",
                 path_modes: Sequence[PathMode] = tuple(PathMode)) -> DesignSizing:
    """Sizes `bases[pdd_name]` under each of `path_modes` (RLD over `rld_range`, 0 included:
    PDD without a relay) and every baseline present in `bases` (scenarios.BASELINES; a
    baseline may have as many decode instances as PDD's RLD + MD at most), and states the
    verdict of PDD's cheapest mode against each."""
    from .scenarios import BASELINES, DESIGN_LABELS
    labels = labels or DESIGN_LABELS
    prefill_range, rld_range = list(prefill_range), list(rld_range)
    results = {}
    for name in BASELINES:
        if name in bases:
            results[name] = size_cluster(bases[name], trace, sla, target_attainment, prefill_range, [0],
                                         md_max + max(rld_range), progress, rate_scale, arrivals)
    no_rld_runs: dict = {}  # the same runs under every mode (size_cluster's no_rld_runs)
    by_mode = {PathMode(m).value: size_cluster(replace(bases[pdd_name], path_mode=PathMode(m)), trace, sla,
                                               target_attainment, prefill_range, rld_range, md_max, progress,
                                               rate_scale, arrivals, no_rld_runs=no_rld_runs)
               for m in path_modes}
    mode = pick_path_mode(by_mode)
    results[pdd_name] = by_mode[mode] if mode is not None else None
    goal = f"{target_attainment:.0%} SLA attainment"
    verdicts = [verdict(name, labels.get(name, name), results[name], results[pdd_name], goal)
                for name in BASELINES if name in results]
    return DesignSizing(results, pdd_name, verdicts, by_mode, mode)


def verdicts_over_seeds(sizings: Sequence[DesignSizing]) -> List[Verdict]:
    """PDD against each baseline over several seeds' sizings: a side wins only if it wins on
    every seed; anything else (a tie on some seed, or winners that change between seeds) is
    a tie, the spread of PDD's cost difference named."""
    if not sizings:
        return []
    out = []
    for i, first in enumerate(sizings[0].verdicts):
        per_seed = [s.verdicts[i] for s in sizings]
        if any(v.baseline != first.baseline for v in per_seed):
            raise ValueError("every seed's sizing must state the same baselines in the same order")
        winners = {v.winner for v in per_seed}
        deltas = [v.delta for v in per_seed if v.delta is not None]
        spread = (f"PDD {100 * min(deltas):+.0f}% to {100 * max(deltas):+.0f}%" if deltas else "no cost on some seed")
        n = len(per_seed)
        if winners == {"pdd"}:
            winner, what = "pdd", f"PDD wins on all {n} seeds"
        elif winners == {"baseline"}:
            winner, what = "baseline", f"{first.label} wins on all {n} seeds"
        elif winners == {"none"}:
            winner, what = "none", f"neither reaches the target on any of {n} seeds"
        else:
            winner, what = "tie", (f"a tie over {n} seeds (per seed: "
                                   + ", ".join(v.winner for v in per_seed) + ")")
        mean = sum(deltas) / len(deltas) if len(deltas) == n else None
        out.append(Verdict(first.baseline, first.label, winner, mean, f"vs {first.label}: {what}; {spread}"))
    return out
