"""The fixed costs behind tail chunks: whole-block cache hits, per-request work in a packed
prefill pass, MD placement of requests still in flight, and the closed-loop bathtub."""

import math
from dataclasses import replace

import pytest

from sglang_pdd.sim.bathtub import ClosedLoopSimulation, FixedHitTurns, sweep
from sglang_pdd.sim.cluster import ScenarioConfig, Simulation
from sglang_pdd.sim.engine import EventLoop
from sglang_pdd.sim.hardware import TOY_A, TOY_B, LinkProfile
from sglang_pdd.sim.metrics import Sla
from sglang_pdd.sim.scenarios import ClusterSpec, standard_scenarios
from sglang_pdd.sim.servers import PrefillInstance
from sglang_pdd.sim.workload import TraceRequest

INSTANT = LinkProfile("instant", gbps=math.inf, one_way_latency_s=0.0)


def _pd(hw=TOY_A):
    return ScenarioConfig("pd", "pd", n_prefill=1, n_md=1, prefill_hw=hw, md_hw=hw, wan=INSTANT, rdma=INSTANT,
                          drc=False)


def test_partial_block_is_recomputed_whole():
    # Turn 2 repeats turn 1's two blocks but its second block is partial (488 of 512 tokens):
    # a cache hits in whole blocks, so all 488 tokens of it are recomputed, not 0.
    first = TraceRequest(0.0, 1024, 2, (1, 2))
    again = TraceRequest(60_000.0, 1000, 2, (1, 2))
    sim = Simulation(_pd())
    s = sim.run([first, again])
    assert s.requests == 2
    ttft_again = sim.log.ttft[1]
    assert ttft_again == pytest.approx(TOY_A.prefill_time_s(488, 512))
    assert ttft_again > 10 * TOY_A.prefill_time_s(1, 999) - 9 * TOY_A.prefill_overhead_s


def _pass_time(hw, sizes):
    loop, done = EventLoop(), []
    p = PrefillInstance(loop, hw, lambda now, job: done.append(now))
    p.busy = True  # queue them all first, so they share the first pass
    for i, n in enumerate(sizes):
        p.submit(0.0, i, n, 0)
    p._start(0.0)
    loop.run_until()
    assert len(done) == len(sizes)
    return max(done)


def test_extra_requests_in_a_pass_cost_fixed_time():
    hw = replace(TOY_A, prefill_s_per_token_ctx=0.0, prefill_s_per_extra_request=1e-3)
    one_big = _pass_time(hw, [4096])
    eight_small = _pass_time(hw, [512] * 8)  # same tokens, one pass (chunk 8192)
    assert one_big == pytest.approx(hw.prefill_time_s(4096, 0))
    assert eight_small == pytest.approx(one_big + 7e-3)
    # Without the term they cost the same: the difference above is the new term alone.
    flat = replace(hw, prefill_s_per_extra_request=0.0)
    assert _pass_time(flat, [512] * 8) == pytest.approx(_pass_time(flat, [4096]))


def test_calibrated_profiles_without_the_field_do_not_pay_it():
    d = dict(TOY_A.__dict__)
    del d["prefill_s_per_extra_request"]
    from sglang_pdd.sim.hardware import HardwareProfile
    assert HardwareProfile.from_dict(d).prefill_s_per_extra_request == 0.0
    # A one-request pass is what calibration measures: the term does not enter it.
    assert TOY_A.prefill_time_s(100, 0) == pytest.approx(replace(TOY_A, prefill_s_per_extra_request=0).prefill_time_s(100, 0))


def test_new_sessions_spread_over_md_while_their_kv_is_in_flight():
    # A burst of new sessions arrives before any KV has landed on MD: counting assigned KV
    # keeps them from all picking the (momentarily idle) first MD.
    cfg = [c for c in standard_scenarios(ClusterSpec(chip_a=TOY_A, chip_b=TOY_B, n_prefill=2, n_rld=1, n_md=3)) if c.name == "pdd_drc_adaptive"][0]
    sim = ClosedLoopSimulation(cfg, Sla(), FixedHitTurns(0.9), n=120, sessions=24)
    sim.run_closed()
    used = [len(c) for c in sim.md_cache]
    assert min(used) > 0, used
    assert sum(sim.md_pending) == 0  # everything assigned was admitted or cancelled


def test_closed_loop_reaches_its_hit_rate_and_block_rounding_plateaus():
    scen = [c for c in standard_scenarios(ClusterSpec(chip_a=TOY_A, chip_b=TOY_B, n_prefill=1, n_md=2)) if c.name == "pd_same_dc"]
    pts = sweep(scen, [0.5, 0.97, 0.99], n=400, sla=Sla(), sessions=40, input_tokens=16_384)
    half, a, b = pts
    assert half.mean_p_hit == pytest.approx(0.5, abs=0.02)
    # 0.97 and 0.99 both keep 31 of 32 blocks: the last block is the tail chunk, always recomputed.
    assert a.mean_p_hit == pytest.approx(31 / 32, abs=0.01) and b.mean_p_hit == pytest.approx(a.mean_p_hit)
    assert b.throughput_rps == pytest.approx(a.throughput_rps)
    assert a.throughput_rps > half.throughput_rps


def test_bathtub_reports_goodput_within_the_sla_not_saturation():
    scen = [c for c in standard_scenarios(ClusterSpec(chip_a=TOY_A, chip_b=TOY_B, n_prefill=1, n_md=2))
            if c.name == "pd_same_dc"]
    sla = Sla(ttft_s=1.0, tpot_s=0.1)
    (pt,) = sweep(scen, [0.5], n=400, sla=sla, sessions_grid=[4, 64])
    # 64 clients saturate one prefill instance: the queue blows the TTFT SLO, so the best
    # goodput comes from the smaller client count and sits below saturation throughput.
    assert pt.best_sessions == 4
    assert 0 < pt.goodput_rps <= 1.001 * pt.throughput_rps
    sim = ClosedLoopSimulation(scen[0], sla, FixedHitTurns(0.5), n=400, sessions=64)
    sim.run_closed()
    assert sim.steady_goodput_rps() < 0.5 * sim.steady_throughput_rps()
