"""The knee's refinement (loadsweep.find_knee) against fake loads whose pass/fail is known:
the refined knee lies within the resolution under the true threshold, never above a tested
failure, and a coarse grid alone cannot separate thresholds in one gap."""

import pytest

from sglang_pdd.sim.loadsweep import find_knee, load_sweep

GRID = [1.0, 1.5, 2.0, 2.5, 3.0]


class Threshold:
    """Passes at and below `t`; records what was run."""

    def __init__(self, t):
        self.t, self.ran = t, []

    def __call__(self, k):
        self.ran.append(k)
        return k <= self.t


@pytest.mark.parametrize("t", [1.03, 1.22, 1.49, 2.31, 2.9])
def test_refined_knee_lies_within_the_resolution_under_the_threshold(t):
    run = Threshold(t)
    k = find_knee(run, GRID, resolution=0.05)
    assert k <= t and t / k - 1 <= 0.05
    # the first failure found bounds it from above, as tightly
    above = min(x for x in run.ran if x > t)
    assert above / k - 1 <= 0.05


def test_the_coarse_grid_ties_thresholds_in_one_gap_and_refinement_separates_them():
    assert find_knee(Threshold(1.05), GRID) == find_knee(Threshold(1.45), GRID) == 1.0
    a, b = find_knee(Threshold(1.05), GRID, 0.05), find_knee(Threshold(1.45), GRID, 0.05)
    assert b / a - 1 > 0.3


def test_below_the_lowest_scale_down_to_a_floor():
    run = Threshold(0.37)
    k = find_knee(run, GRID, resolution=0.05, floor=0.1)
    assert k <= 0.37 and 0.37 / k - 1 <= 0.05
    # without a floor, or when even the floor fails: no knee
    assert find_knee(Threshold(0.37), GRID, resolution=0.05) is None
    assert find_knee(Threshold(0.05), GRID, resolution=0.05, floor=0.1) is None


def test_no_failure_on_the_grid_leaves_the_top_unrefined():
    run = Threshold(10.0)
    assert find_knee(run, GRID, resolution=0.05, floor=0.1) == 3.0
    assert sorted(run.ran) == GRID


def test_stop_at_fail_skips_the_grid_above_the_first_failure():
    run = Threshold(1.2)
    find_knee(run, GRID, resolution=0.05, stop_at_fail=True)
    assert not {2.0, 2.5, 3.0} & set(run.ran)
    run = Threshold(1.2)
    find_knee(run, GRID, resolution=0.05)
    assert {2.0, 2.5, 3.0} <= set(run.ran)


def test_non_monotone_attainment_keeps_every_lower_tested_scale_passing():
    # Passes up to 1.2, fails in (1.2, 1.3], passes again up to 1.45, and passes at 2.0 on the
    # grid (a lucky cache timing): the knee stays under the first failing region.
    def ok(k):
        return k <= 1.2 or 1.3 < k <= 1.45 or k == 2.0

    ran = []
    k = find_knee(lambda x: (ran.append(x), ok(x))[1], GRID, resolution=0.05)
    assert k <= 1.2 and 1.2 / k - 1 <= 0.05
    fails = [x for x in ran if not ok(x)]
    passes_below = [x for x in ran if x <= k]
    assert all(ok(x) for x in passes_below) and all(f > k for f in fails)


def test_a_pass_above_a_failing_midpoint_is_ignored():
    # The first midpoint of [1, 1.5] (1.2247) fails, though 1.3-1.45 would pass: the
    # bisection never goes back above a tested failure.
    def ok(k):
        return k <= 1.1 or 1.3 < k <= 1.45

    k = find_knee(ok, GRID, resolution=0.05)
    assert k <= 1.1 and 1.1 / k - 1 <= 0.05


def test_load_sweep_refines_on_the_simulator(monkeypatch):
    # A real sweep is minutes; the refinement's bookkeeping (points ascending, the knee one of
    # them) is checked with the simulator stubbed by a fake whose attainment falls with load.
    import sglang_pdd.sim.loadsweep as ls

    class S:
        def __init__(self, k):
            self.offered_rps, self.goodput_rps = 10 * k, 10 * k * (1.0 if k <= 1.33 else 0.5)
            self.sla_attainment, self.ttft_p90 = (0.95 if k <= 1.33 else 0.5), 1.0

    monkeypatch.setattr(ls, "run_scenario", lambda cfg, trace, sla, rate_scale, arrivals: S(rate_scale))

    class Cfg:
        name, cost_per_hour = "fake", 36.0

    k = load_sweep(Cfg(), [], None, GRID, 0.9, resolution=0.05, stop_at_fail=True)
    scales = [p.rate_scale for p in k.points]
    assert scales == sorted(scales) and k.knee in k.points
    assert k.knee.rate_scale <= 1.33 and 1.33 / k.knee.rate_scale - 1 <= 0.05
    assert k.knee_goodput_rps == pytest.approx(10 * k.knee.rate_scale)
