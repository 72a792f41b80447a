"""MD placement by what a move costs (router/backends/placement.py's pick_main, the router's and the
simulator's): with more MDs a session's turns stay on the MD holding its prefix while that is
cheaper than re-sending it, so the path mix one MD gives survives a second and a fourth MD.
With the earlier rule (a fixed bound of 4 flows in flight) turns left their MD, shipped whole
contexts, filled the link and the mix collapsed to relaying."""

from dataclasses import replace

import pytest

from sglang_pdd.sim.cluster import ScenarioConfig, Simulation
from sglang_pdd.sim.hardware import MODELS, WAN_DEFAULT, preset
from sglang_pdd.sim.metrics import Sla
from sglang_pdd.sim.traces import tile_trace
from sglang_pdd.sim.workload import generate_agentic_trace, report_agentic_config

# DeepSeek-V3 with an fp8 KV cache (61 layers x 656 bytes), the report-like agentic trace tiled 4x,
# a 5 Gbps link: a quarter of the report's scale (21.5 req/s on 20 Gbps), in seconds.
FP8 = replace(MODELS["deepseek-v3"], kv_bytes_per_token=61 * 656)
A, B = preset(FP8, "h200"), preset(FP8, "h20")
WAN = replace(WAN_DEFAULT, gbps=5.0)
SLA = Sla(2.0, 0.06, 1.0)


@pytest.fixture(scope="module")
def trace():
    return tile_trace(list(generate_agentic_trace(report_agentic_config(num_requests=1000, seed=0))), 4, "spread")


def run(trace, n_md, **kw):
    cfg = ScenarioConfig("pdd", "pdd", n_prefill=2, n_rld=1, n_md=n_md, prefill_hw=A, rld_hw=A, md_hw=B, wan=WAN, **kw)
    s = Simulation(cfg, SLA).run(trace, arrivals="sessions")
    return s.paths.get("p_md", 0) / s.requests, s.rld_token_share, s.mean_md_hit, s


def test_two_and_four_mds_keep_one_mds_path_mix(trace):
    one_p_md, one_rld, one_hit, _ = run(trace, 1)
    assert one_rld < 0.10 and one_hit > 0.9
    for n_md in (2, 4):
        p_md, rld, hit, s = run(trace, n_md)
        assert p_md == pytest.approx(one_p_md, abs=0.06), n_md  # 81% with one MD, 80% and 75% here
        assert rld < 0.10 and hit == pytest.approx(one_hit, abs=0.02), n_md
        # 98.7-99.2%: a P->MD transfer's estimate counts the waited ones in flight, not those that
        # start after it and share the link too (counting every byte in flight as ahead gave
        # 99.4-99.6% with 55-58% P->MD)
        assert s.wan_cancelled_gb == 0.0 and s.sla_attainment > 0.985


def test_the_fixed_flow_bound_loses_the_mix_with_two_mds(trace):
    """The earlier rule, as a what-if: turns leave their MD 4 flows in, MD's hit halves and
    RLD decodes most tokens."""
    _, rld, hit, _ = run(trace, 2, md_affinity_excess_flows=4)  # RLD 52% of tokens, MD hit 0.68
    _, new_rld, new_hit, _ = run(trace, 2)  # 4%, 0.94
    assert rld > 0.45 and hit < 0.72
    assert new_rld < rld / 5 and new_hit > hit + 0.2
