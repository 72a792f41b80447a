"""Inter-token gaps simulated per decode step (sim/steps.py): each token's gap is the step time
in force while it was decoded, a pause (an extend) lengthens one token of every running
sequence, a handoff stall is one gap, and every decoded token is counted once."""

import dataclasses
import math
from dataclasses import replace

import numpy as np
import pytest

from sglang_pdd.handoff.policy import HandoffConfig, HandoffMode
from sglang_pdd.router.policy import PathPolicyConfig
from sglang_pdd.sim.cluster import ScenarioConfig, Simulation
from sglang_pdd.sim.engine import EventLoop
from sglang_pdd.sim.hardware import TOY_A, TOY_B, LinkProfile
from sglang_pdd.sim.metrics import GapSamples, RequestLog, Sla, itl_samples, weighted_percentile
from sglang_pdd.sim.scenarios import ClusterSpec, standard_scenarios
from sglang_pdd.sim.servers import DecodeInstance
from sglang_pdd.sim.workload import AgenticTraceConfig, TraceRequest, generate_agentic_trace

# Step = 10 ms + 10 ms per running sequence: 20 ms alone, 30 ms with two.
HW = replace(TOY_A, decode_step_overhead_s=0.010, decode_step_s_per_seq=0.010, decode_step_s_per_kv_token=0.0)


def _instance():
    loop, gaps, done = EventLoop(), GapSamples(), {}
    d = DecodeInstance(loop, HW, lambda now, j: None, lambda now, j: done.__setitem__(j, (now, d.pop_max_gap(j))),
                       gaps)
    return loop, d, gaps, done


def _percentiles(gaps):
    v, w = gaps.arrays()
    return weighted_percentile(v, w, 50), weighted_percentile(v, w, 99)


def test_gaps_follow_the_batch_when_it_changes_mid_request():
    loop, d, gaps, done = _instance()
    d.submit(0.0, "a", 10, 100)
    # b joins after a's 5th token (5 x 20 ms); both step at 30 ms for b's 3 tokens, then a
    # finishes its last 2 alone at 20 ms.
    loop.at(0.1, lambda now, _: d.submit(now, "b", 3, 100))
    loop.run_until()
    assert done["b"][0] == pytest.approx(0.19) and done["a"][0] == pytest.approx(0.23)
    v, w = gaps.arrays()
    by_value = {round(x, 6): 0.0 for x in v}
    for x, y in zip(v, w):
        by_value[round(x, 6)] += y
    # a: 5 + 2 gaps of 20 ms and 3 of 30 ms; b: 3 of 30 ms.
    assert by_value == pytest.approx({0.02: 7.0, 0.03: 6.0})
    p50, p99 = _percentiles(gaps)
    assert p50 == pytest.approx(0.02) and p99 == pytest.approx(0.03)
    # Each sequence's longest gap is the slowest step it lived through.
    assert done["a"][1] == pytest.approx(0.03) and done["b"][1] == pytest.approx(0.03)
    # Spreading each request's decode time evenly (a's 23 ms mean gap x 10) gets neither.
    even = np.repeat([0.023, 0.03], [10, 3])
    assert np.percentile(even, 50, method="inverted_cdf") == pytest.approx(0.023) != p50


def test_run_metrics_use_the_simulated_gaps():
    # PD on one D: a decodes 20 tokens alone at 20 ms, b joins for 3 tokens (both at 30 ms).
    instant = LinkProfile("instant", gbps=math.inf, one_way_latency_s=0.0)
    cfg = ScenarioConfig("pd", "pd", n_prefill=1, n_md=1, prefill_hw=TOY_A, md_hw=HW, wan=instant, rdma=instant,
                         drc=False)
    reqs = [TraceRequest(0.0, 512, 21, (1,)), TraceRequest(100.0, 512, 4, (2,))]
    strict = Sla(ttft_s=10.0, tpot_s=1.0, max_itl_s=0.025)
    sim = Simulation(cfg, strict)
    s = sim.run(reqs)
    # 17 gaps of 20 ms and 3 of 30 ms for a, 3 of 30 ms for b: p50 20 ms, p99 30 ms; a's mean
    # gap (the even spread) is 21.5 ms, which is what its tokens would all be reconstructed as.
    assert s.itl_p50 == pytest.approx(0.02) and s.itl_p99 == pytest.approx(0.03)
    assert list(sim.log.max_gap) == pytest.approx([0.03, 0.03])
    assert list(sim.log.tpot) == pytest.approx([0.03, (17 * 0.02 + 3 * 0.03) / 20])  # b ends first
    # a's mean gap is under the 25 ms bound, its 30 ms gaps are not: both requests fail
    assert s.sla_attainment == 0.0
    assert Simulation(cfg, replace(strict, max_itl_s=0.031)).run(reqs).sla_attainment == 1.0


def test_an_extend_is_one_long_gap_of_each_running_sequence():
    loop, d, gaps, done = _instance()
    d.submit(0.0, "a", 10, 100)
    d.submit(0.0, "b", 10, 100)  # two sequences, 30 ms a step
    loop.at(0.09, lambda now, _: d.occupy(now, 0.5))  # after 3 tokens each, a 0.5 s extend
    loop.run_until()
    assert done["a"][0] == pytest.approx(10 * 0.03 + 0.5)
    v, w = gaps.arrays()
    assert w.sum() == pytest.approx(20.0)  # every token once
    long = v > 0.1
    assert v[long] == pytest.approx([0.53]) and w[long] == pytest.approx([2.0])  # one per sequence
    assert set(np.round(v[~long], 6)) == {0.03}
    assert done["a"][1] == pytest.approx(0.53) and done["b"][1] == pytest.approx(0.53)
    p50, p99 = _percentiles(gaps)
    assert p50 == pytest.approx(0.03) and p99 == pytest.approx(0.53)


def test_a_sequence_joining_during_an_extend_does_not_count_it():
    loop, d, gaps, done = _instance()
    d.submit(0.0, "a", 4, 100)
    d.occupy(0.0, 0.2)  # a waits for it: its first gap is 0.22 s
    loop.at(0.1, lambda now, _: d.submit(now, "b", 2, 100))  # joins inside it
    loop.run_until()
    assert done["a"][1] == pytest.approx(0.2 + 0.02)
    # b's first token also waits for the extend's end; a caller that counts that gap itself
    # (a handoff stall) says so with first_token_elsewhere. Here nobody does: b's longest
    # *step* is 30 ms.
    assert done["b"][1] == pytest.approx(0.03)


def test_history_keeps_only_what_running_sequences_need():
    # Step = 10 ms + 1 ms per sequence. 200 sequences of 1..200 tokens join at once: each
    # departure lowers the step, so the history holds ~200 decreasing steps they may ask for
    # (the last leaves after 22.1 s). From 20 s on, short sequences, one every 5 ms, keep the
    # batch busy: once the 200 are gone, none of their steps is needed.
    hw = replace(HW, decode_step_s_per_seq=0.001, max_running_requests=1000)
    loop, gaps, done = EventLoop(), GapSamples(), {}
    d = DecodeInstance(loop, hw, lambda now, j: None, lambda now, j: done.__setitem__(j, d.pop_max_gap(j)), gaps)
    for i in range(1, 201):
        d.submit(0.0, ("old", i), i, 100)
    h, seen = d.history, {}
    loop.at(20.0, lambda now, _: seen.__setitem__("early", len(h._idx)))
    n = 6000
    for k in range(n):
        loop.at(20.0 + 0.005 * k, lambda now, j: d.submit(now, ("new", j), 1, 100), k)
    loop.at(20.0 + 0.005 * n - 0.001, lambda now, _: seen.__setitem__("late", (len(h._idx), len(d.batch))))
    loop.run_until()
    assert len(done) == 200 + n
    assert seen["early"] > 50  # needed then
    late_stack, running = seen["late"]
    assert running > 0 and late_stack <= 64 + 4  # stale steps dropped while the batch never emptied
    assert done[("old", 200)] == pytest.approx(hw.decode_step_s(200, 0))  # the first, fullest step
    assert max(done[("new", k)] for k in range(500, n)) < 0.05  # joined after the 200 left
    assert not h.start and not h.exit_gap and not h._idx


def _one_shot(wan):
    return ScenarioConfig("pdd", "pdd", n_prefill=1, n_rld=1, n_md=1, prefill_hw=TOY_A, rld_hw=TOY_A,
                          md_hw=TOY_B, wan=wan, rdma=LinkProfile("rdma", math.inf, 0.0),
                          handoff=HandoffConfig(fixed_mode=HandoffMode.ONE_SHOT),
                          router=PathPolicyConfig(max_wan_transfer_ms=0.0, enable_outlier_filter=False))


def test_handoff_stall_is_one_gap_between_two_instances_steps():
    # A slow WAN: RLD decodes while the KV crosses, then hands over in one shot.
    wan = LinkProfile("wan", gbps=1.0, one_way_latency_s=0.03)
    inp, out = 2048, 400
    sim = Simulation(_one_shot(wan))
    s = sim.run([TraceRequest(0.0, inp, out, tuple(range(4)))])
    assert s.paths == {"p_rld_md": 1} and s.switches == 1
    rld_tokens = sim.log.rld_tokens[0]
    assert 0 < rld_tokens < out - 2
    stall = sim.log.stall[0]
    v, w = itl_samples(sim.log)
    md_tokens = out - 1 - rld_tokens  # MD's first token is the stall
    rld_step, md_step = TOY_A.decode_step_s(1, inp), TOY_B.decode_step_s(1, inp + 1 + rld_tokens)
    want = {rld_step: rld_tokens, stall: 1, md_step: md_tokens - 1}
    got = {}
    for x, y in zip(v, w):
        key = min(want, key=lambda k: abs(k - x))
        assert x == pytest.approx(key, rel=1e-9)
        got[key] = got.get(key, 0.0) + y
    assert got == pytest.approx(want)
    assert stall > 3 * max(rld_step, md_step)
    assert sim.log.max_gap[0] == pytest.approx(stall)
    assert s.itl_p99 == pytest.approx(max(rld_step, md_step))  # one stall in ~400 gaps is under the p99
    # the SLA's gap bound reads that one gap
    assert Simulation(_one_shot(wan), Sla(100, 10, max_itl_s=stall * 0.99)).run(
        [TraceRequest(0.0, inp, out, tuple(range(4)))]).sla_attainment == 0.0
    assert Simulation(_one_shot(wan), Sla(100, 10, max_itl_s=stall * 1.01)).run(
        [TraceRequest(0.0, inp, out, tuple(range(4)))]).sla_attainment == 1.0


TRACE = list(generate_agentic_trace(AgenticTraceConfig(num_requests=400, seed=3, session_rate_per_s=0.8,
                                                       outlier_fraction=0.03)))


@pytest.mark.parametrize("cfg", standard_scenarios(ClusterSpec(chip_a=TOY_A, chip_b=TOY_B, n_prefill=2, n_rld=1,
                                                               n_md=2, wan=LinkProfile("w", 5.0, 0.02))),
                         ids=lambda c: c.name)
def test_every_decoded_token_is_one_gap(cfg):
    sim = Simulation(cfg)
    s = sim.run(TRACE)
    out = np.array(sim.log.output)
    v, w = itl_samples(sim.log)
    # Each request has out - 1 gaps; what may be left over is the unfinished token of a
    # request RLD stopped last (paid by RLD's next step, if any).
    assert w.sum() == pytest.approx((out - 1).sum(), abs=1.0)
    assert (w > 0).all()
    gap = np.frombuffer(sim.log.max_gap, dtype=np.float64)
    tpot = np.frombuffer(sim.log.tpot, dtype=np.float64)
    many = out > 1
    assert np.isnan(gap[~many]).all() and not np.isnan(gap[many]).any()
    # a request's longest gap is at least its mean gap
    assert (gap[many] >= tpot[many] * (1 - 1e-6)).all()
    # the gap SLO fails exactly the requests whose longest gap exceeds it (the bound
    # changes nothing else in the run, the router's path rule held as it was: with a gap SLO
    # of its own the router budgets P->MD's wait against it, tests/unit/router/test_router_policy.py)
    bound = float(np.percentile(gap[many], 80))
    tight_sim = Simulation(dataclasses.replace(cfg, router=sim.route_cfg), Sla(max_itl_s=bound))
    tight = tight_sim.run(TRACE)
    np.testing.assert_array_equal(np.frombuffer(tight_sim.log.max_gap, dtype=np.float64), gap)
    log = sim.log
    ok = ((np.frombuffer(log.ttft) <= Sla().ttft_s) & (np.isnan(tpot) | (tpot <= Sla().tpot_s))
          & (np.isnan(gap) | (gap <= bound)))
    assert tight.sla_attainment == pytest.approx(ok.mean()) and tight.sla_attainment < s.sla_attainment + 1e-12
    assert s.itl_p50 <= s.itl_p99 <= gap[many].max()
    # every request's history was read and let go
    assert all(not d.history.start and not d.history.exit_gap for d in sim.md + sim.rld)


def test_itl_samples_include_each_stall_once():
    log = RequestLog()
    log.gaps.add(0.02, 10.0)
    log.gaps.add(0.02, 5.0)  # merged with its equal neighbour
    log.stall.extend([float("nan"), 0.4])
    v, w = itl_samples(log)
    assert list(v) == [0.02, 0.4] and list(w) == [15.0, 1.0]
