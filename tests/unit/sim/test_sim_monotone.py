"""Trends that must hold whatever the exact numbers: change one input (WAN rate, hit rate,
output length) and no result may move the wrong way. A violation means a modelling bug
(the kind that once made PDD look best at 1 Gbps, or DRC ship more bytes than no DRC)."""

import math
from dataclasses import replace

import pytest

from sglang_pdd.router.policy import PathMode
from sglang_pdd.sim.bathtub import fixed_hit_trace
from sglang_pdd.sim.cluster import run_scenario
from sglang_pdd.sim.hardware import TOY_A, TOY_B, LinkProfile
from sglang_pdd.sim.metrics import Sla
from sglang_pdd.sim.scenarios import ClusterSpec, standard_scenarios
from sglang_pdd.sim.sizing import size_cluster

SLA = Sla(ttft_s=2.0, tpot_s=0.06)
REL = 1e-9  # exact trends: only float noise is forgiven


def _scenarios(gbps, **kw):
    wan = LinkProfile("wan", gbps=gbps, one_way_latency_s=0.02, jitter_s=0.005)
    spec = ClusterSpec(chip_a=TOY_A, chip_b=TOY_B, wan=wan, **kw)
    return {c.name: c for c in standard_scenarios(spec)}


def _trace(hit=0.5, out=128, n=400, rate=4.0):
    return list(fixed_hit_trace(n, hit, input_tokens=8192, output_tokens=out, rate_per_s=rate, sessions=32))


def _non_increasing(xs):
    return all(b <= a * (1 + REL) + 1e-12 for a, b in zip(xs, xs[1:]))


def _non_decreasing(xs):
    return all(b >= a * (1 - REL) - 1e-12 for a, b in zip(xs, xs[1:]))


def _cost(name, gbps, trace):
    # At equal arrivals (open): this trace's 32 sessions all start at once, a fixed population,
    # and with turns following answers longer outputs mean fewer turns a second, which can
    # rightly cost less.
    r = size_cluster(_scenarios(gbps)[name], trace, SLA, 0.9, range(1, 5), range(0, 2), md_max=4, arrivals="open")
    return math.inf if r is None else r.cost_per_hour  # nothing in range meets it: dearer than any


GBPS = (1, 2, 5, 10, 25, 100, 400)


@pytest.mark.parametrize("name", ["pdd_drc_adaptive", "pdd_nodrc_oneshot", "xdc_pd"])
def test_more_wan_bandwidth_never_makes_wan_time_or_attainment_worse(name):
    trace = _trace()
    # Every design's P rule (the router's: prefill tokens until P replies) does not depend on
    # when requests end, so the WAN's speed does not move P placement.
    # Relayed requests' KV kept for the next turn yields the link to KV a request waits for
    # (kept_kv_background, the default, as P's sender orders them): shared equally, it holds a
    # P->MD request's first MD token back (at 5 Gbps two of them miss TPOT, 99.5%).
    runs = [run_scenario(_scenarios(g, n_prefill=2, n_rld=1, n_md=2)[name], trace, SLA) for g in GBPS]
    landed = [s.kv_landed for s in runs]
    assert _non_decreasing(landed), landed  # fewer transfers outrun by their request's end
    wan_s = [s.kv_wan_s_mean for s in runs if s.kv_landed]
    assert len(wan_s) >= 4 and _non_increasing(wan_s), wan_s
    att = [s.sla_attainment for s in runs]
    assert _non_decreasing(att), att
    if name == "xdc_pd":
        assert _non_increasing([s.ttft_p50 for s in runs])
    else:  # fit: a faster link sends more requests P->MD, whose first token waits on MD's registration
        p_md = [s.paths.get("p_md", 0) for s in runs]
        assert _non_decreasing(p_md) and p_md[-1] == len(trace), p_md
        relay_first = [run_scenario(_scenarios(g, n_prefill=2, n_rld=1, n_md=2, path_mode=PathMode.RELAY_FIRST)[name],
                                    trace, SLA) for g in GBPS]
        assert _non_increasing([s.ttft_p50 for s in relay_first])
        assert all(s.paths.get("p_md", 0) == 0 for s in relay_first)


def test_more_wan_bandwidth_never_makes_pdd_dearer():
    trace = _trace(rate=8.0, n=300)
    costs = [_cost("pdd_drc_adaptive", g, trace) for g in (2, 10, 50, 400)]
    assert _non_increasing(costs), costs
    assert costs[-1] < costs[0]  # and it does help somewhere: the RLD is dropped


HITS = (0.0, 0.25, 0.5, 0.75, 0.9, 0.97)


def test_a_higher_hit_never_sends_more_bytes():
    runs = {h: {n: run_scenario(c, _trace(hit=h), SLA)
                for n, c in _scenarios(10, n_prefill=2, n_rld=1, n_md=2).items()
                if n in ("pdd_drc_adaptive", "pdd_drc_oneshot", "pdd_nodrc_oneshot", "xdc_pd")} for h in HITS}
    for name in ("pdd_drc_adaptive", "pdd_drc_oneshot", "xdc_pd"):
        gb = [runs[h][name].wan_gb for h in HITS]
        assert _non_increasing(gb), (name, gb)
    # Without a DRC every transfer is the whole prompt, whatever the hit: only cancellations
    # (requests ending on RLD first) move the bytes, by P's timing, a hair either way.
    gb = [runs[h]["pdd_nodrc_oneshot"].wan_gb for h in HITS]
    assert all(b <= a * 1.001 for a, b in zip(gb, gb[1:])), gb
    drc = [runs[h]["pdd_drc_adaptive"] for h in HITS]
    assert _non_decreasing([s.mean_md_hit for s in drc])
    assert drc[-1].wan_gb < 0.3 * drc[0].wan_gb  # the DRC does cut the bytes
    # A DRC never ships more than the same design (same handoff mode) without one, when both
    # cancel the KV of requests that ended on RLD first. Keeping it (the default; useless
    # without a DRC, so cancelled there) ships those bytes, and saves on the next turns.
    for h in HITS:
        cancel = run_scenario(replace(_scenarios(10, n_prefill=2, n_rld=1, n_md=2)["pdd_drc_oneshot"],
                                      keep_finished_kv=False), _trace(hit=h), SLA)
        assert cancel.wan_gb <= runs[h]["pdd_nodrc_oneshot"].wan_gb * (1 + REL)


def test_a_higher_hit_never_makes_a_design_dearer():
    traces = [_trace(hit=h, rate=8.0, n=300) for h in (0.0, 0.5, 0.9)]
    for name in ("pd_same_dc", "pdd_drc_adaptive"):
        costs = [_cost(name, 10, t) for t in traces]
        assert _non_increasing(costs), (name, costs)


OUTS = (16, 64, 256, 1024)


def test_longer_outputs_never_decode_faster_or_cost_less():
    runs = {o: _scenarios(10, n_prefill=2, n_rld=1, n_md=2) for o in OUTS}
    # Relay-first PDD here: in fit mode a P->MD request's WAN wait falls between its first
    # token (P's, through RLD) and MD's, i.e. in its TPOT, most in the shortest answers.
    relay_first = {o: _scenarios(10, n_prefill=2, n_rld=1, n_md=2, path_mode=PathMode.RELAY_FIRST) for o in OUTS}
    for name, scenarios in (("pd_same_dc", runs), ("pdd_drc_adaptive", relay_first)):
        got = [run_scenario(scenarios[o][name], _trace(out=o), SLA) for o in OUTS]
        assert _non_decreasing([s.tpot_p50 for s in got]), name
    # RLD covers the WAN transfer's time: a smaller share of longer answers (with the path
    # fixed: in fit mode RLD's load, which longer answers raise, moves requests P->MD).
    pdd = [run_scenario(relay_first[o]["pdd_drc_adaptive"], _trace(out=o), SLA) for o in OUTS]
    assert _non_increasing([s.rld_token_share for s in pdd])
    traces = [_trace(out=o, rate=8.0, n=300) for o in (32, 128, 512, 1024)]
    for name in ("pd_same_dc", "pdd_drc_adaptive"):
        costs = [_cost(name, 10, t) for t in traces]
        assert _non_decreasing(costs), (name, costs)
