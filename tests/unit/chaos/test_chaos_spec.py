"""The chaos run's plan (pure): scenarios, the soak's schedule, the load's prompts and arrivals."""

import itertools
import statistics

import pytest

from sglang_pdd.chaos.spec import (ALL_KINDS, SCENARIOS, SOAK_GAP_RANGE_S, SOAK_HOLD_RANGE_S, Fault, FaultKind,
                                   LoadSpec, arrivals, prompt_pool, scenario, soak_faults)
from sglang_pdd.router.flow.pdd_flow import FlowConfig


def test_one_scenario_per_fault_kind_and_a_baseline():
    assert set(SCENARIOS) == {"baseline", "kill_md_wan_down", "wan_blip", "md_late_first_token",
                              *(k.value for k in ALL_KINDS)}
    assert [f.kind for f in SCENARIOS["kill_md_wan_down"].faults] == [FaultKind.KILL_MD, FaultKind.WAN_DOWN]
    assert SCENARIOS["baseline"].faults == ()
    for kind in ALL_KINDS:  # each kind alone
        (fault,) = SCENARIOS[kind.value].faults
        assert fault.kind is kind
        assert fault.after_s > 0  # load runs before the fault
        assert fault.hold_s > 0 or kind is FaultKind.ROUTER_RESTART
    with pytest.raises(ValueError, match="unknown scenario 'kill_everything'"):
        scenario("kill_everything")


def test_the_kinds_cover_the_issue_and_only_kills_are_kills():
    assert {k.value for k in ALL_KINDS} == {"kill_rld", "kill_md", "kill_p", "wan_down", "wan_slow",
                                            "router_restart", "md_drain", "md_slow", "md_stop"}
    assert {k for k in ALL_KINDS if k.kills} == {FaultKind.KILL_RLD, FaultKind.KILL_MD, FaultKind.KILL_P}


def test_a_fault_or_load_that_makes_no_sense_is_refused():
    with pytest.raises(ValueError):
        Fault(FaultKind.WAN_DOWN, after_s=-1)
    with pytest.raises(ValueError):
        Fault(FaultKind.WAN_DOWN, after_s=1, hold_s=-2)
    with pytest.raises(ValueError):
        LoadSpec(rate_per_s=0)
    with pytest.raises(ValueError):
        LoadSpec(max_new_choices=())


def test_the_prompt_pool_is_a_function_of_the_load_only():
    load = LoadSpec(prompts=5, max_new_choices=(8, 32), long_prompts=2)
    pool = prompt_pool(load)
    assert pool == prompt_pool(load)  # the reference outputs are taken once, for this pool
    assert pool != prompt_pool(LoadSpec(prompts=5, max_new_choices=(8, 32), long_prompts=2, seed=1))
    assert len(pool) == 5 * 2 + 2
    assert len({p.key for p in pool}) == len(pool)
    low, high = load.vocab
    assert all(low <= t < high for p in pool for t in p.ids)  # never BOS/EOS/PAD
    normal = [p for p in pool if not p.key.startswith("long")]
    assert all(load.prompt_tokens[0] <= len(p.ids) <= load.prompt_tokens[1] for p in normal)
    assert {p.max_new for p in normal} == {8, 32}


def test_long_prompts_are_outliers_for_the_router_the_chaos_cluster_starts():
    from sglang_pdd.chaos.runner import ROUTER_ARGS

    flag = dict(zip(ROUTER_ARGS[::2], ROUTER_ARGS[1::2]))
    load = LoadSpec()
    longs = [p for p in prompt_pool(load) if p.key.startswith("long")]
    assert len(longs) == load.long_prompts
    assert all(len(p.ids) >= int(flag["--outlier-min-input-tokens"]) for p in longs)
    assert all(p.max_new <= int(flag["--outlier-max-output-tokens"]) for p in longs)
    normal = [p for p in prompt_pool(load) if not p.key.startswith("long")]
    assert all(len(p.ids) < int(flag["--outlier-min-input-tokens"]) for p in normal)


def test_arrivals_are_open_loop_poisson_at_the_rate_and_repeatable():
    load = LoadSpec(rate_per_s=4.0, seed=3)
    pool = prompt_pool(load)
    first = list(itertools.islice(arrivals(load, pool), 4000))
    assert first == list(itertools.islice(arrivals(load, pool), 4000))
    times = [t for t, _ in first]
    assert times == sorted(times) and times[0] > 0
    gaps = [b - a for a, b in zip([0.0] + times, times)]
    assert statistics.mean(gaps) == pytest.approx(1 / 4.0, rel=0.06)
    assert statistics.pstdev(gaps) == pytest.approx(1 / 4.0, rel=0.1)  # exponential: sd = mean
    keys = {p.key for _, p in first}
    assert keys == {p.key for p in pool}  # every request of the pool comes, again and again


def test_a_burst_adds_its_requests_at_once_and_leaves_the_poisson_stream_as_it_was():
    plain, burst = LoadSpec(rate_per_s=2.0, seed=1), LoadSpec(rate_per_s=2.0, seed=1, burst=48, burst_at_s=8.0)
    pool = prompt_pool(plain)
    base = [(t, p) for t, p in itertools.islice(arrivals(plain, pool), 200)]
    both = list(itertools.islice(arrivals(burst, pool), 248))
    times = [t for t, _ in both]
    assert times == sorted(times)  # the load sends them in order of time
    at_once = [p for t, p in both if t == 8.0]
    assert len(at_once) == 48 and len({p.key for p in at_once}) > 1
    assert [(t, p) for t, p in both if t != 8.0] == base  # the Poisson arrivals unchanged


def test_a_negative_burst_is_refused():
    with pytest.raises(ValueError, match="burst"):
        LoadSpec(burst=-1)


def test_the_soak_brings_every_kind_once_per_round_within_its_ranges():
    faults = list(itertools.islice(soak_faults(seed=5), len(ALL_KINDS) * 4))
    for r in range(4):
        round_ = faults[r * len(ALL_KINDS):(r + 1) * len(ALL_KINDS)]
        assert sorted(f.kind.value for f in round_) == sorted(k.value for k in ALL_KINDS)
    for f in faults:
        low, high = SOAK_HOLD_RANGE_S[f.kind]
        assert low <= f.hold_s <= high
        assert SOAK_GAP_RANGE_S[0] <= f.after_s <= SOAK_GAP_RANGE_S[1]
    n = len(ALL_KINDS)
    orders = {tuple(f.kind for f in faults[r * n:(r + 1) * n]) for r in range(4)}
    assert len(orders) > 1  # shuffled per round
    assert faults == list(itertools.islice(soak_faults(seed=5), len(faults)))
    only = list(itertools.islice(soak_faults(1, (FaultKind.WAN_DOWN,)), 3))
    assert [f.kind for f in only] == [FaultKind.WAN_DOWN] * 3
    with pytest.raises(ValueError):
        next(soak_faults(1, ()))


def test_the_pause_scenarios_outlast_the_first_token_deadline_and_not_the_stall_timeout():
    """wan_blip and md_late_first_token pause MD for longer than the router's deadline for
    MD's first token plus the checks' slack (a client waiting out the whole pause fails the
    row), and for less than its stall timeout (only the new deadline can bound the wait)."""
    from sglang_pdd.chaos.checks import HANDOFF_SLACK_S

    cfg = FlowConfig()
    blip, late = SCENARIOS["wan_blip"], SCENARIOS["md_late_first_token"]
    assert {f.kind for f in blip.faults} == {FaultKind.WAN_DOWN} and len(blip.faults) >= 2
    assert {f.kind for f in late.faults} == {FaultKind.MD_STOP} and len(late.faults) >= 2
    for fault in blip.faults + late.faults:
        assert cfg.md_first_token_timeout_s + HANDOFF_SLACK_S < fault.hold_s < cfg.md_stall_timeout_s
        assert fault.when_md_busy >= 1  # the pause meets requests MD carries
    assert all(f.when_md_busy == 0 for sc in (SCENARIOS["wan_down"], SCENARIOS["kill_md"]) for f in sc.faults)
    with pytest.raises(ValueError):
        Fault(FaultKind.MD_STOP, after_s=1, hold_s=1, when_md_busy=-1)
    assert blip.bound_gaps and late.bound_gaps and SCENARIOS["md_stop"].bound_gaps
    assert not SCENARIOS["wan_down"].bound_gaps and not SCENARIOS["baseline"].bound_gaps
