"""Validity tests of the cluster simulator: conservation, Little's law, PD reduction, and
that each mechanism moves the metric it should."""

import math
from dataclasses import replace

import numpy as np
import pytest

from sglang_pdd.router.policy import PathPolicyConfig
from sglang_pdd.sim.cache import BlockCache
from sglang_pdd.sim.cluster import PATH_NAMES, ScenarioConfig, Simulation
from sglang_pdd.sim.hardware import TOY_A, TOY_B, LinkProfile
from sglang_pdd.sim.metrics import Sla
from sglang_pdd.sim.scenarios import ClusterSpec, standard_scenarios
from sglang_pdd.sim.workload import AgenticTraceConfig, TraceRequest, generate_agentic_trace


def trace(n=600, **kw):
    cfg = dict(num_requests=n, seed=1, session_rate_per_s=0.6, outlier_fraction=0.03)
    cfg.update(kw)
    return list(generate_agentic_trace(AgenticTraceConfig(**cfg)))


TRACE = trace()
SPEC = ClusterSpec(chip_a=TOY_A, chip_b=TOY_B, n_prefill=2, n_rld=1, n_md=2)


@pytest.fixture(scope="module")
def runs():
    out = {}
    for cfg in standard_scenarios(SPEC):
        sim = Simulation(cfg)
        out[cfg.name] = (sim, sim.run(TRACE))
    return out


@pytest.mark.parametrize("name", [c.name for c in standard_scenarios(SPEC)])
def test_conservation_every_request_finishes_once(runs, name):
    sim, s = runs[name]
    assert sim.arrived == sim.finished == s.requests == len(TRACE)
    log = sim.log
    out = np.array(log.output)
    rld = np.array(log.rld_tokens)
    assert out.sum() == sum(r.output_length for r in TRACE)
    assert (rld >= 0).all() and (rld <= out).all()
    assert (np.array(log.ttft) >= 0).all()
    assert (np.array(log.e2e) >= np.array(log.ttft) - 1e-12).all()
    assert sum(s.paths.values()) == len(TRACE)
    assert sim.loop.pending() == 0
    # Every instance drained its memory: nothing leaked in KV accounting.
    assert all(d.kv_used == 0 and not d.waiting and len(d.batch) == 0 for d in sim.md + sim.rld)


@pytest.mark.parametrize("name", ["pd_same_dc", "pdd_drc_catchup"])
def test_littles_law(runs, name):
    sim, _ = runs[name]
    span = sim.loop.now
    # L = lambda * W, both for the whole system and for the prefill stage.
    assert sim.in_system.value == 0 and sim.in_prefill.value == 0
    lam = sim.arrived / span
    assert sim.in_system.area / span == pytest.approx(lam * sim.sojourn_sum / sim.arrived, rel=1e-9)
    assert sim.in_prefill.area / span == pytest.approx(lam * sim.prefill_sojourn_sum / sim.arrived, rel=1e-9)


def test_pdd_reduces_to_pd_with_zero_wan_and_one_chip():
    instant = LinkProfile("instant", gbps=math.inf, one_way_latency_s=0.0)
    pd = ScenarioConfig("pd", "pd", n_prefill=2, n_md=2, prefill_hw=TOY_A, md_hw=TOY_A,
                        wan=instant, rdma=instant, drc=False)
    pdd = ScenarioConfig("pdd", "pdd", n_prefill=2, n_rld=1, n_md=2, prefill_hw=TOY_A, rld_hw=TOY_A,
                         md_hw=TOY_A, wan=instant, rdma=instant, drc=False, md_staging_bytes=math.inf,
                         router=PathPolicyConfig(wan_gbps=1e12, wan_rtt_ms=0.0, enable_outlier_filter=False,
                                                 max_wan_transfer_ms=1e9))
    a, b = Simulation(pd), Simulation(pdd)
    sa, sb = a.run(TRACE), b.run(TRACE)
    assert sb.paths == {"p_md": len(TRACE)}
    for col in ("ttft", "tpot", "e2e"):
        np.testing.assert_allclose(np.array(getattr(a.log, col)), np.array(getattr(b.log, col)), rtol=1e-12)
    assert sa.sla_attainment == sb.sla_attainment


def test_drc_cuts_wan_bytes(runs):
    assert runs["pdd_drc_oneshot"][1].wan_gb < 0.7 * runs["pdd_nodrc_oneshot"][1].wan_gb
    assert runs["pdd_drc_oneshot"][1].mean_md_hit > 0.3
    assert runs["pdd_nodrc_oneshot"][1].mean_md_hit == 0.0


def test_only_pdd_uses_rld_and_outliers_skip_the_wan(runs):
    for name in ("pd_same_dc", "xdc_pd"):
        assert runs[name][1].rld_token_share == 0.0
        assert runs[name][1].paths == {"p_md": len(TRACE)}
    s = runs["pdd_drc_oneshot"][1]
    assert s.paths.get("p_rld_only", 0) > 0
    assert 0.0 < s.rld_token_share < 0.5
    assert runs["pd_same_dc"][1].wan_gb == 0.0


def test_catch_up_keeps_rld_busy_longer_than_one_shot():
    # Slow WAN: many requests go through RLD, so the mode matters.
    slow = LinkProfile("slow", gbps=2.0, one_way_latency_s=0.03)
    spec = replace(SPEC, wan=slow, catch_up_threshold_tokens=4)
    by = {c.name: Simulation(c).run(TRACE) for c in standard_scenarios(spec) if "drc_" in c.name}
    one, catch = by["pdd_drc_oneshot"], by["pdd_drc_catchup"]
    assert catch.rld_token_share > one.rld_token_share
    assert one.paths.get("p_rld_md", 0) > 0


def test_cross_dc_pd_pays_for_the_wan(runs):
    assert runs["xdc_pd"][1].ttft_p50 > runs["pd_same_dc"][1].ttft_p50
    assert runs["xdc_pd"][1].wan_gb > runs["pdd_drc_oneshot"][1].wan_gb


def test_cost_and_bcr_follow_counts():
    by = {c.name: c for c in standard_scenarios(SPEC)}
    assert by["pd_same_dc"].cost_per_hour == pytest.approx(2 * TOY_A.price_per_hour + 3 * TOY_A.price_per_hour)
    # Every cross-datacenter design pays the WAN's lease (by its rate), same-DC PD does not.
    lease = SPEC.wan.gbps * SPEC.wan.price_per_gbps_hour
    assert lease > 0 and by["pd_same_dc"].wan_lease_per_hour == 0
    assert by["pdd_drc_oneshot"].cost_per_hour == pytest.approx(3 * TOY_A.price_per_hour + 2 * TOY_B.price_per_hour
                                                                + lease)
    for name in ("xdc_pd", "xdc_pd_drc", "pdd_nodrc_oneshot", "pdd_drc_adaptive"):
        assert by[name].wan_lease_per_hour == pytest.approx(lease)
        assert by[name].cost_per_hour == pytest.approx(by[name].hw_cost_per_hour + lease)


def test_sla_attainment_is_monotone_in_sla():
    cfg = standard_scenarios(SPEC)[3]
    loose = Simulation(cfg, Sla(ttft_s=100, tpot_s=10)).run(TRACE)
    tight = Simulation(cfg, Sla(ttft_s=0.05, tpot_s=0.005)).run(TRACE)
    assert loose.sla_attainment == 1.0
    assert tight.sla_attainment < loose.sla_attainment


def test_more_prefill_instances_lower_ttft():
    base = standard_scenarios(replace(SPEC, n_prefill=1))[0]
    more = standard_scenarios(replace(SPEC, n_prefill=4))[0]
    assert Simulation(more).run(TRACE).ttft_p90 < Simulation(base).run(TRACE).ttft_p90


def test_single_request_latency_matches_hand_computation():
    # One request, idle cluster, PD over an instant link: TTFT = prefill time;
    # TPOT = one decode step at batch 1 holding its prompt.
    instant = LinkProfile("instant", gbps=math.inf, one_way_latency_s=0.0)
    cfg = ScenarioConfig("pd", "pd", n_prefill=1, n_md=1, prefill_hw=TOY_A, md_hw=TOY_A,
                         wan=instant, rdma=instant, drc=False)
    r = TraceRequest(0.0, 3000, 11, tuple(range(6)))
    sim = Simulation(cfg)
    s = sim.run([r])
    chunk = TOY_A.prefill_chunk_tokens
    assert 3000 <= chunk
    assert s.ttft_p50 == pytest.approx(TOY_A.prefill_time_s(3000, 0))
    assert s.tpot_p50 == pytest.approx(TOY_A.decode_step_s(1, 3000))


def test_block_cache_lru_prefers_keeping_roots():
    c = BlockCache(capacity_tokens=3 * 512)
    c.insert([1, 2, 3])
    assert c.match_prefix_blocks([1, 2, 3, 4]) == 3
    c.insert([1, 2, 9])  # evicts leaf 3, not root 1
    assert c.match_prefix_blocks([1, 2, 3]) == 2
    assert c.match_prefix_blocks([1, 2, 9]) == 3
    assert BlockCache(0).match_prefix_blocks([1]) == 0


def test_path_names_cover_the_policy_enum():
    assert set(PATH_NAMES) == {"p_md", "p_rld_md", "p_rld_only"}
