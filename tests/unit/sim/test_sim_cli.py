import json

import pytest
import os

from sglang_pdd.sim.bathtub import fixed_hit_trace, sweep
from sglang_pdd.sim.cli import main
from sglang_pdd.sim.metrics import Sla
from sglang_pdd.sim.hardware import TOY_A, TOY_B
from sglang_pdd.sim.scenarios import ClusterSpec, standard_scenarios
from sglang_pdd.sim.sizing import size_cluster
from sglang_pdd.sim.workload import AgenticTraceConfig, generate_agentic_trace, ideal_prefix_hit_rate


def test_compare_writes_table_plot_and_json(tmp_path, capsys):
    rc = main(["compare", "--agentic", "300", "--prefill", "2", "--md", "2", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    for name in ("pd_same_dc", "xdc_pd", "xdc_pd_drc", "pdd_drc_catchup", "BCR"):
        assert name in out
    assert os.path.getsize(tmp_path / "compare_agentic300.png") > 1000
    rows = json.loads((tmp_path / "compare_agentic300.json").read_text())
    assert [r["requests"] for r in rows] == [300] * 7


def test_sizing_finds_cheapest_mix_meeting_target():
    trace = list(generate_agentic_trace(AgenticTraceConfig(num_requests=300, seed=2)))
    base = standard_scenarios(ClusterSpec(chip_a=TOY_A, chip_b=TOY_B))[0]  # PD: only prefill and decode counts matter
    sla = Sla(ttft_s=10.0, tpot_s=0.1)
    # Open: this short trace is a few sessions alive for all of it, which with turns after
    # answers is nearly a fixed population, light enough for the smallest mix.
    best = size_cluster(base, trace, sla, 0.9, range(1, 4), range(0, 1), md_max=4, arrivals="open")
    assert best is not None and best.summary.sla_attainment >= 0.9
    # Nothing cheaper in the searched space meets the target (over the run and its last tenth).
    from sglang_pdd.sim.cluster import run_scenario
    from sglang_pdd.sim.scenarios import with_counts
    from sglang_pdd.sim.sizing import meets
    cheaper = 0
    for n_p in range(1, 4):
        for n_d in range(1, 5):
            cfg = with_counts(base, n_p, 0, n_d)
            if cfg.cost_per_hour < best.cost_per_hour:
                cheaper += 1
                assert not meets(run_scenario(cfg, trace, sla, arrivals="open"), 0.9)
    assert cheaper > 0


def test_fixed_hit_trace_hits_its_target():
    for hit in (0.0, 0.5, 0.9):
        got = ideal_prefix_hit_rate(fixed_hit_trace(400, hit, sessions=8))
        assert abs(got - hit) < 0.08


def test_bathtub_sweep_shape():
    scen = [c for c in standard_scenarios(ClusterSpec(chip_a=TOY_A, chip_b=TOY_B, n_prefill=2, n_md=2)) if c.name == "pd_same_dc"]
    pts = sweep(scen, [0.0, 0.9], n=200, sla=Sla())
    assert len(pts) == 2
    low, high = pts
    # Prefill-bound at saturation: reusing 90% of the prompt must raise throughput.
    assert high.throughput_rps > low.throughput_rps


def _designs(chip_b_price, wan_gbps=25.0):
    from dataclasses import replace as _r
    from sglang_pdd.sim.hardware import LinkProfile
    from sglang_pdd.sim.sizing import compare_designs
    trace = list(generate_agentic_trace(AgenticTraceConfig(num_requests=200, seed=2)))
    spec = ClusterSpec(chip_a=TOY_A, chip_b=_r(TOY_B, price_per_chip_hour=chip_b_price),
                       wan=LinkProfile("wan", gbps=wan_gbps, one_way_latency_s=0.02))
    by = {c.name: c for c in standard_scenarios(spec)}
    return compare_designs(by["pd_same_dc"], by["pdd_drc_adaptive"], trace, Sla(ttft_s=10.0, tpot_s=0.1), 0.9,
                           range(1, 3), range(0, 2), md_max=3)


def test_sizing_says_pd_wins_when_pdd_costs_more():
    v = _designs(chip_b_price=6.0)  # MD's chip dearer than PD's: PDD cannot be cheaper
    assert v.pd is not None
    assert v.winner == "pd" and v.message.startswith("PD wins here")
    if v.pdd is not None:
        assert v.pdd.cost_per_hour >= v.pd.cost_per_hour


def test_sizing_picks_pdd_only_when_cheaper():
    v = _designs(chip_b_price=0.5)
    assert v.winner == "pdd" and "wins" in v.message and v.message.startswith("PDD"), v.message
    assert v.pdd.cost_per_hour < v.pd.cost_per_hour
    assert v.pdd.summary.sla_attainment >= 0.9


def test_size_cli_prints_the_verdict(capsys):
    rc = main(["size", "--agentic", "150", "--prefill-range", "4:4", "--rld-range", "0:1", "--md-max", "2",
               "--ttft-slo", "30", "--tpot-slo", "1", "--target", "0.5", "--wan-gbps", "400"])
    out = capsys.readouterr().out
    assert rc == 0
    # every design sized, and PDD's verdict stated against each baseline, named
    for name in ("pd_same_dc", "xdc_pd", "xdc_pd_drc", "pdd_drc_adaptive"):
        assert f"cheapest {name} (" in out
    verdicts = [ln for ln in out.splitlines() if ln.startswith("verdict vs ")]
    assert [v.split(":")[0] for v in verdicts] == ["verdict vs same-DC PD", "verdict vs cross-DC PD (no relay, no DRC)",
                                                   "verdict vs cross-DC PD + DRC"]
    assert all(" wins" in v or ": a tie, " in v or "neither" in v for v in verdicts)


def test_sweep_cli_finds_a_knee(tmp_path, capsys):
    # Open: every request scaled (with sessions only session starts are, think times are not)
    rc = main(["sweep", "--agentic", "200", "--scales", "0.25,1,8", "--prefill", "2", "--rld", "1", "--md", "2",
               "--scenarios", "pd_same_dc", "--arrivals", "open", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "<- knee" in out
    rows = json.loads((tmp_path / "sweep_agentic200.json").read_text())
    pts = rows[0]["points"]
    assert [p["rate_scale"] for p in pts] == [0.25, 1.0, 8.0]
    # Offered load scales with the rate; goodput does not keep up at 8x.
    assert pts[2]["offered_rps"] == pytest.approx(32 * pts[0]["offered_rps"], rel=1e-6)
    assert pts[2]["goodput_rps"] < 0.9 * pts[2]["offered_rps"]


def test_relay_of_any_chip_count(tmp_path, capsys):
    """A 3xH100 RLD (not a power of two) beside 4xH100 P: its own price, pool and speed."""
    from sglang_pdd.sim.cli import _add_common, _spec
    from sglang_pdd.sim.hardware import preset
    import argparse
    p = argparse.ArgumentParser()
    _add_common(p)
    spec = _spec(p.parse_args(["--model", "llama3-70b", "--chip-a", "h100", "--rld-chips", "3", "--rld", "2"]))
    four, three = preset("llama3-70b", "h100"), preset("llama3-70b", "h100", 3)
    assert (four.chips_per_instance, three.chips_per_instance) == (4, 3)
    assert spec.rld_hw == three and spec.chip_a == four
    cfg = {c.name: c for c in standard_scenarios(spec)}["pdd_drc_adaptive"]
    assert cfg.rld_hw == three and cfg.prefill_hw == four
    assert cfg.cost_per_hour == pytest.approx(7 * four.price_per_hour + 2 * three.price_per_hour
                                              + 3 * spec.chip_b.price_per_hour + spec.wan.lease_per_hour)
    # 3 chips hold the same 141 GB of weights: about half the KV room of 4 (75 vs 147 GB)
    assert three.kv_capacity_tokens < 0.6 * four.kv_capacity_tokens
    assert three.decode_step_s(8, 8 * 4096) > four.decode_step_s(8, 8 * 4096)
    rc = main(["compare", "--agentic", "200", "--prefill", "2", "--md", "1", "--rld-chips", "3",
               "--out", str(tmp_path)])
    assert rc == 0 and "pdd_drc_adaptive" in capsys.readouterr().out


def test_decode_attention_scale_slows_long_context_mla_decode_only():
    """--decode-attn-scale: what the sizing says if MLA decode ran on generic kernels (3-4x
    slower attention, timed on an H200) instead of the fused kernel the presets assume."""
    from sglang_pdd.sim.cli import _add_common, _spec
    from sglang_pdd.sim.hardware import preset
    import argparse
    p = argparse.ArgumentParser()
    _add_common(p)
    base = ["--model", "deepseek-v3", "--chip-a", "h200"]
    spec, slow = _spec(p.parse_args(base)), _spec(p.parse_args(base + ["--decode-attn-scale", "3"]))
    assert spec.chip_b == preset("deepseek-v3", "h20")
    assert slow.chip_b.decode_attn_s_per_kv_token == pytest.approx(3 * spec.chip_b.decode_attn_s_per_kv_token)
    # a short-context batch reads its weights for longer than it computes: unchanged
    assert slow.chip_b.decode_step_s(8, 8 * 1024) == spec.chip_b.decode_step_s(8, 8 * 1024)
    assert slow.chip_b.decode_step_s(150, 150 * 65536) > 2.5 * spec.chip_b.decode_step_s(150, 150 * 65536)


def test_sweep_cli_refines_the_knee(tmp_path, capsys):
    rc = main(["sweep", "--agentic", "200", "--scales", "0.25,1,8", "--prefill", "2", "--rld", "1", "--md", "2",
               "--scenarios", "pd_same_dc", "--arrivals", "open", "--knee-resolution", "0.1", "--out", str(tmp_path)])
    knee_line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.endswith("<- knee"))
    assert rc == 0
    knee = float(knee_line.split()[1])
    pts = json.loads((tmp_path / "sweep_agentic200.json").read_text())[0]["points"]
    scales = [p["rate_scale"] for p in pts]
    # bisection added runs between the grid's points, ascending; every run at or under the
    # knee passes, and the lowest failing run is within 10% above it
    assert scales == sorted(scales) and len(scales) > 3
    assert all(p["sla_attainment"] >= 0.9 for p in pts if p["rate_scale"] <= knee)
    hi = min(p["rate_scale"] for p in pts if p["sla_attainment"] < 0.9)
    assert knee < hi <= 1.1 * knee + 0.01  # the printed knee has two decimals


_SIZE_SMALL = ["size", "--agentic", "150", "--prefill-range", "4:4", "--rld-range", "1:1", "--md-max", "2",
               "--ttft-slo", "30", "--tpot-slo", "1", "--target", "0.5", "--wan-gbps", "400"]


def test_size_refuses_path_mode_with_path_modes(capsys):
    with pytest.raises(SystemExit, match="--path-mode relay_first and --path-modes fit conflict"):
        main(_SIZE_SMALL + ["--path-mode", "relay_first", "--path-modes", "fit"])


def test_size_with_path_mode_sizes_pdd_under_that_mode_only(capsys):
    assert main(_SIZE_SMALL + ["--path-mode", "relay_first"]) == 0
    modes = [ln.split("--path-mode ")[1].split(":")[0] for ln in capsys.readouterr().out.splitlines()
             if ln.startswith("cheapest pdd_drc_adaptive with --path-mode")]
    assert modes == ["relay_first"]
