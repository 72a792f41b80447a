"""Fleets at scale (tiled traces), the host (DRAM) tier behind the prefix caches, and the
router's RLD admission swept."""

import math
from dataclasses import replace

import pytest

from sglang_pdd.sim.cache import BlockCache
from sglang_pdd.sim.cli import main
from sglang_pdd.sim.cluster import ScenarioConfig, Simulation
from sglang_pdd.sim.hardware import TOY_A, TOY_B, LinkProfile
from sglang_pdd.sim.metrics import Sla
from sglang_pdd.sim.rldsweep import AdmissionPoint, choose_default
from sglang_pdd.sim.sizing import offered_rps
from sglang_pdd.sim.traces import TILE_MODES, tile_trace
from sglang_pdd.sim.workload import TraceRequest, generate_agentic_trace, ideal_prefix_hit_rate, report_agentic_config

INSTANT = LinkProfile("instant", gbps=math.inf, one_way_latency_s=0.0)


@pytest.mark.parametrize("mode", TILE_MODES)
def test_a_tiled_trace_is_k_populations_at_k_times_the_rate(mode):
    base = list(generate_agentic_trace(report_agentic_config(num_requests=400, seed=1)))
    tiled = tile_trace(base, 4, mode)
    assert len(tiled) == 4 * len(base)
    if mode == "lockstep":
        assert offered_rps(tiled) == pytest.approx(4 * offered_rps(base), rel=0.02)
    # spread: whole sessions rotate, so a copy's last sessions run on past the trace's span
    # (test_sim_tiling.py checks the rate of a trace without sessions and the session starts)
    assert [r.timestamp_ms for r in tiled] == sorted(r.timestamp_ms for r in tiled)
    # same requests (lengths), no prefix shared between copies, sessions kept apart
    assert sorted((r.input_length, r.output_length) for r in tiled) == \
        sorted((r.input_length, r.output_length) for r in base for _ in range(4))
    assert len({h for r in tiled for h in r.hash_ids}) == 4 * len({h for r in base for h in r.hash_ids})
    assert len({r.session_id for r in tiled}) == 4 * len({r.session_id for r in base})
    assert ideal_prefix_hit_rate(tiled) == pytest.approx(ideal_prefix_hit_rate(base), abs=0.01)


def test_host_tier_keeps_what_hbm_evicts_and_reports_what_it_loads_back():
    c = BlockCache(capacity_tokens=2 * 512, host_capacity_tokens=2 * 512)
    c.insert([1, 2])
    c.insert([7, 8])  # HBM holds 2 blocks: 1 and 2 go to the host
    assert c.in_host(1) and c.in_host(2)
    assert c.match_prefix_blocks([1, 2, 3], touch=False) == 2 and c.host_hits == 2
    assert c.match_prefix_blocks([1, 2]) == 2 and c.host_hits == 2  # loaded back...
    assert not c.in_host(1) and c.match_prefix_blocks([1, 2]) == 2 and c.host_hits == 0  # ...now in HBM
    assert c.in_host(7) and c.in_host(8)  # and what they displaced went down a tier
    c.insert([20, 21])  # the host's LRU drops the oldest when full
    assert c.match_prefix_blocks([7, 8], touch=False) == 0 or c.host_hits < 2
    no_host = BlockCache(capacity_tokens=2 * 512)
    no_host.insert([1, 2])
    no_host.insert([7, 8])
    assert no_host.match_prefix_blocks([1, 2]) == 0 and no_host.host_hits == 0


def test_a_host_hit_costs_its_load_not_a_recompute():
    """One P whose HBM cache holds one 16-block prompt: a second prompt evicts the first to
    the host tier; the first prompt again is a host hit, loaded back at the profile's rate
    instead of prefilled; without the tier it is a miss."""
    hw = replace(TOY_A, cache_capacity_tokens=16 * 512, host_cache_tokens=64 * 512, host_load_s_per_token=1e-6)
    cfg = ScenarioConfig("pd", "pd", n_prefill=1, n_md=1, prefill_hw=hw, md_hw=hw, wan=INSTANT, rdma=INSTANT,
                         drc=False)
    a, b = tuple(range(16)), tuple(range(100, 116))
    trace = [TraceRequest(0.0, 16 * 512, 2, a), TraceRequest(5000.0, 16 * 512, 2, b),
             TraceRequest(10_000.0, 16 * 512 + 100, 2, a + (999,))]
    with_host = Simulation(cfg)
    s = with_host.run(trace)
    without = Simulation(replace(cfg, prefill_hw=replace(hw, host_cache_tokens=0))).run(trace)
    assert s.p_host_tokens == 16 * 512 and without.p_host_tokens == 0
    load = 16 * 512 * hw.host_load_s_per_token
    assert with_host.log.ttft[2] == pytest.approx(hw.prefill_time_s(100, 16 * 512) + load)
    assert with_host.log.ttft[2] < 0.5 * hw.prefill_time_s(16 * 512 + 100, 0)


def test_choose_default_takes_the_least_rld_work_within_the_stall_and_sla_bounds():
    def point(v, share, stall, sla):
        s = type("S", (), dict(rld_token_share=share, stall_p99=stall, sla_attainment=sla))()
        return AdmissionPoint(v, s)
    pts = [point(4, 0.00, 4.1, 0.825), point(64, 0.006, 4.2, 0.825), point(256, 0.031, 0.106, 0.904),
           point(512, 0.032, 0.101, 0.905)]
    assert choose_default(pts, max_stall_p99_s=1.0).rld_max_running == 256
    assert choose_default(pts, max_stall_p99_s=10.0, max_sla_loss=0.1).rld_max_running == 4


def test_rld_sweep_cli_moves_the_path_mix(tmp_path, capsys):
    rc = main(["rld-sweep", "--agentic", "300", "--prefill", "2", "--rld", "1", "--md", "2", "--values", "1,4,100000",
               "--path-mode", "relay_first", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    rows = [ln.split() for ln in out.splitlines() if ln.strip() and ln.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == [1, 4, 100000]
    p_md = [float(r[1]) for r in rows]
    assert p_md[0] > p_md[-1] and p_md[-1] == 0.0  # relay-first, an admission never reached: nothing P->MD
    assert (tmp_path / "rld_sweep_agentic300.json").exists()
    # the choice line names one of the swept values
    choice = [ln for ln in out.splitlines() if ln.startswith("choice: --rld-max-running ")]
    assert len(choice) == 1 and int(choice[0].split()[2]) in (1, 4, 100000)
