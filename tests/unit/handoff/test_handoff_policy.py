import itertools

import pytest

from sglang_pdd.handoff.policy import (
    HandoffConfig,
    HandoffMode,
    RldLoad,
    choose_mode,
    next_catch_up_batch,
    plan_catch_up,
)

CFG = HandoffConfig(catch_up_threshold_tokens=64, one_shot_at_load=0.75, catch_up_at_load=0.5)


@pytest.mark.parametrize(
    "load, previous, expect",
    [
        (0.9, None, HandoffMode.ONE_SHOT),
        (0.75, HandoffMode.CATCH_UP, HandoffMode.ONE_SHOT),
        (0.1, None, HandoffMode.CATCH_UP),
        (0.5, HandoffMode.ONE_SHOT, HandoffMode.CATCH_UP),
        (0.6, HandoffMode.CATCH_UP, HandoffMode.CATCH_UP),  # hysteresis keeps the mode
        (0.6, HandoffMode.ONE_SHOT, HandoffMode.ONE_SHOT),
        (0.6, None, HandoffMode.ONE_SHOT),  # undecided -> free RLD
        (RldLoad(90, 100), None, HandoffMode.ONE_SHOT),
        (RldLoad(10, 100), None, HandoffMode.CATCH_UP),
    ],
)
def test_choose_mode(load, previous, expect):
    assert choose_mode(load, CFG, previous) is expect


def test_fixed_mode_wins():
    cfg = HandoffConfig(fixed_mode=HandoffMode.CATCH_UP)
    assert choose_mode(1.0, cfg) is HandoffMode.CATCH_UP


def test_config_validation():
    with pytest.raises(ValueError):
        HandoffConfig(catch_up_threshold_tokens=0)
    with pytest.raises(ValueError):
        HandoffConfig(one_shot_at_load=0.3, catch_up_at_load=0.6)


@pytest.mark.parametrize("backlog, rnd, expect", [(0, 0, (0, True)), (64, 0, (64, True)),
                                                  (65, 0, (64, False)), (500, 7, (500, True))])
def test_next_batch(backlog, rnd, expect):
    s = next_catch_up_batch(backlog, rnd, CFG)
    assert (s.tokens, s.final) == expect


@pytest.mark.parametrize(
    "eager, rld_rate, md_rate, overhead",
    list(itertools.product([0, 1, 63, 64, 65, 300, 5000], [0.0, 30.0, 200.0], [2000.0, 50_000.0], [0.0, 0.02])),
)
def test_plan_catch_up_invariants(eager, rld_rate, md_rate, overhead):
    plan = plan_catch_up(eager, rld_rate, md_rate, CFG, md_extend_overhead_s=overhead)
    # Nothing lost, nothing duplicated: batches sum to the tokens RLD generated.
    generated = eager
    for b in plan.batches[:-1]:
        assert b == CFG.catch_up_threshold_tokens
        generated += int(rld_rate * (overhead + b / md_rate))
    assert plan.total_tokens == generated
    assert plan.total_tokens >= eager
    assert len(plan.batches) <= CFG.max_catch_up_rounds
    if plan.converged:
        assert plan.batches[-1] <= CFG.catch_up_threshold_tokens
    expected_duration = sum(overhead + b / md_rate for b in plan.batches)
    assert plan.duration_s == pytest.approx(expected_duration)


def test_plan_does_not_converge_when_rld_outruns_md():
    # MD extends 100 tok/s, RLD makes 1000 tok/s: backlog grows, cut at max rounds.
    plan = plan_catch_up(200, 1000.0, 100.0, CFG)
    assert not plan.converged
    assert len(plan.batches) == CFG.max_catch_up_rounds


def test_plan_respects_output_budget():
    plan = plan_catch_up(100, 10_000.0, 1000.0, CFG, max_total_tokens=150)
    assert plan.total_tokens == 150
