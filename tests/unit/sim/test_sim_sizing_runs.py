"""The sizing search runs no simulation whose outcome cannot change its answer: PDD's runs
without an RLD are shared between path modes (no path to choose), and an RLD count whose
cheapest conceivable mix already costs more than the best found is not searched."""

import json
from dataclasses import asdict, replace

import sglang_pdd.sim.sizing as sizing
from sglang_pdd.router.policy import PathMode
from sglang_pdd.sim.cluster import run_scenario
from sglang_pdd.sim.hardware import TOY_A, TOY_B
from sglang_pdd.sim.metrics import Sla
from sglang_pdd.sim.scenarios import ClusterSpec, standard_scenarios, with_counts
from sglang_pdd.sim.workload import AgenticTraceConfig, generate_agentic_trace

TRACE = list(generate_agentic_trace(AgenticTraceConfig(num_requests=200, seed=3)))
SLA = Sla(ttft_s=10.0, tpot_s=0.1)
BY = {c.name: c for c in standard_scenarios(ClusterSpec(chip_a=TOY_A, chip_b=TOY_B))}
PDD = BY["pdd_drc_adaptive"]


def _recorded(monkeypatch):
    runs = []

    def run(cfg, trace, sla, rate_scale=1.0, arrivals="open", give_up_below=None):
        runs.append((cfg.path_mode, cfg.n_prefill, cfg.n_rld, cfg.n_md))
        return run_scenario(cfg, trace, sla, rate_scale, arrivals, give_up_below)
    monkeypatch.setattr(sizing, "run_scenario", run)
    return runs


def _key(r):
    # a summary as text, so that its NaN fields (no handoff, no RLD) compare equal
    return None if r is None else (r.n_prefill, r.n_rld, r.n_md, round(r.cost_per_hour, 6),
                                   json.dumps(asdict(r.summary), sort_keys=True))


def test_a_run_without_rld_is_the_same_under_either_path_mode():
    # what the sharing rests on: with no RLD the router has no path to choose
    cfg = with_counts(PDD, 1, 0, 1)
    a = run_scenario(replace(cfg, path_mode=PathMode.FIT), TRACE, SLA, arrivals="sessions")
    b = run_scenario(replace(cfg, path_mode=PathMode.RELAY_FIRST), TRACE, SLA, arrivals="sessions")
    assert json.dumps(asdict(a), sort_keys=True) == json.dumps(asdict(b), sort_keys=True)


def test_path_modes_share_their_no_rld_runs_and_size_as_each_alone(monkeypatch):
    runs = _recorded(monkeypatch)
    got = sizing.size_designs({"pdd_drc_adaptive": PDD}, "pdd_drc_adaptive", TRACE, SLA, 0.9, range(1, 4),
                              range(0, 2), 3)
    no_rld = [r[1:] for r in runs if r[2] == 0]
    assert len(no_rld) == len(set(no_rld))  # none run twice
    shared = len(runs)
    alone = {mode.value: sizing.size_cluster(replace(PDD, path_mode=mode), TRACE, SLA, 0.9, range(1, 4),
                                             range(0, 2), 3) for mode in PathMode}
    assert len(runs) - shared > shared  # sized alone, each mode runs its own no-RLD probes
    assert {m: _key(r) for m, r in got.pdd_by_mode.items()} == {m: _key(r) for m, r in alone.items()}


def test_an_rld_count_dearer_than_the_best_mix_is_not_searched(monkeypatch):
    runs = _recorded(monkeypatch)
    # an RLD priced so that one RLD with the fewest P and one MD costs more than the best
    # mix without RLD: no run with an RLD, the same answer as searching without RLD
    dear = replace(PDD, rld_hw=replace(TOY_A, price_per_chip_hour=100.0))
    best = sizing.size_cluster(dear, TRACE, SLA, 0.9, range(1, 4), range(0, 3), 3)
    assert best is not None and best.n_rld == 0
    assert with_counts(dear, 1, 1, 1).cost_per_hour >= best.cost_per_hour
    assert all(r[2] == 0 for r in runs)
    assert _key(best)[:4] == _key(sizing.size_cluster(dear, TRACE, SLA, 0.9, range(1, 4), [0], 3))[:4]


def test_a_run_that_cannot_meet_the_target_is_given_up_and_one_that_can_is_not():
    tight = Sla(ttft_s=0.05, tpot_s=0.1)  # most requests miss this TTFT
    full = run_scenario(with_counts(BY["pd_same_dc"], 1, 0, 1), TRACE, tight, arrivals="sessions")
    assert full.sla_attainment < 0.9
    assert run_scenario(with_counts(BY["pd_same_dc"], 1, 0, 1), TRACE, tight, arrivals="sessions",
                        give_up_below=0.9) is None
    # a run that passes (or fails on anything but TTFT) runs to its end: the same summary
    for sla in (SLA, Sla(ttft_s=10.0, tpot_s=0.001)):
        a = run_scenario(with_counts(PDD, 1, 1, 1), TRACE, sla, arrivals="sessions")
        b = run_scenario(with_counts(PDD, 1, 1, 1), TRACE, sla, arrivals="sessions", give_up_below=0.9)
        assert json.dumps(asdict(a), sort_keys=True) == json.dumps(asdict(b), sort_keys=True)
    # and sizing under the tight SLA finds what it found before: nothing
    assert sizing.size_cluster(BY["pd_same_dc"], TRACE, tight, 0.9, range(1, 3), [0], 2) is None


def test_giving_up_runs_through_quiet_stretches_longer_than_its_slice():
    # two requests 10 minutes apart: the loop's looks must move past the gap by themselves
    from sglang_pdd.sim.workload import TraceRequest
    quiet = [TraceRequest(0.0, 1000, 10, (1, 2)), TraceRequest(600_000.0, 1000, 10, (3, 4))]
    s = run_scenario(with_counts(BY["pd_same_dc"], 1, 0, 1), quiet, SLA, give_up_below=0.9)
    assert s is not None and s.requests == 2
