"""Open-loop sizing: every design faces the same offered load, a run must keep up with its
demand, and an optimum on the edge of the searched ranges is flagged."""

from dataclasses import replace

import pytest

from sglang_pdd.sim.cli import main
from sglang_pdd.sim.cluster import run_scenario
from sglang_pdd.sim.hardware import TOY_A, TOY_B
from sglang_pdd.sim.metrics import Sla
from sglang_pdd.sim.scenarios import ClusterSpec, standard_scenarios, with_counts
from sglang_pdd.sim.sizing import keeps_up, meets, offered_rps, size_cluster
from sglang_pdd.sim.workload import AgenticTraceConfig, generate_agentic_trace

TRACE = list(generate_agentic_trace(AgenticTraceConfig(num_requests=300, seed=2)))
SLA = Sla(ttft_s=10.0, tpot_s=0.1)


def _pd(**kw):
    # The mixes below were sized by hand under the backlog-weighed P rule; these tests are
    # about the sizing (demand, tail, edges), so they keep it (a what-if since one P rule).
    return standard_scenarios(ClusterSpec(chip_a=TOY_A, chip_b=TOY_B, p_placement="backlog", **kw))[0]


def test_a_slower_decoder_at_the_same_price_never_sizes_cheaper():
    # A closed loop of a fixed client population offered a slow design less load, so a slower
    # decoder could come out cheaper. Sizing replays sessions: the same session starts for
    # every design, turns after answers; a slower decoder still does not size cheaper.
    fast = _pd()
    slow_hw = replace(TOY_A, decode_step_overhead_s=3 * TOY_A.decode_step_overhead_s,
                      decode_step_s_per_seq=3 * TOY_A.decode_step_s_per_seq)
    slow = replace(fast, md_hw=slow_hw)
    sla = Sla(ttft_s=10.0, tpot_s=0.05)
    a = size_cluster(fast, TRACE, sla, 0.9, range(1, 4), [0], md_max=6)
    b = size_cluster(slow, TRACE, sla, 0.9, range(1, 4), [0], md_max=6)
    assert a is not None
    assert b is None or b.cost_per_hour >= a.cost_per_hour
    # And both served every turn of the same sessions.
    if b is not None:
        assert b.summary.requests == a.summary.requests == len(TRACE)


def test_a_backlog_at_the_end_of_the_run_does_not_meet_the_target():
    # The trace plus a burst of 34 fresh prompts at its last timestamp: 2 P and 2 D serve
    # 93% of all requests within the SLA, but only ~30% of the last tenth.
    last = max(t.timestamp_ms for t in TRACE)
    burst = [replace(t, timestamp_ms=last, hash_ids=tuple(h + 10 ** 6 for h in t.hash_ids), session_id=None)
             for t in TRACE[:34]]
    s = run_scenario(with_counts(_pd(), 2, 0, 2), TRACE + burst, SLA)
    assert s.sla_attainment >= 0.9 and s.tail_sla_attainment < 0.5
    assert not keeps_up(s, 0.9) and not meets(s, 0.9)
    best = size_cluster(_pd(), TRACE + burst, SLA, 0.9, range(1, 5), [0], md_max=4)
    assert best is not None and best.summary.tail_sla_attainment >= 0.9
    assert (best.n_prefill, best.n_md) != (2, 2)


def test_every_sizing_run_faces_the_trace_demand():
    assert offered_rps(TRACE, 2.0) == pytest.approx(2 * offered_rps(TRACE))
    best = size_cluster(_pd(), TRACE, SLA, 0.9, range(1, 6), [0], md_max=6, rate_scale=2.0, arrivals="open")
    assert best is not None and best.summary.offered_rps == pytest.approx(offered_rps(TRACE, 2.0))


def test_an_optimum_on_the_edge_of_the_range_is_flagged(capsys):
    best = size_cluster(_pd(), TRACE, SLA, 0.9, range(2, 3), [0], md_max=1)
    assert best is not None and (best.n_prefill, best.n_md) == (2, 1)
    assert any("top of the d range" in e for e in best.edges)
    assert any("bottom of the prefill range" in e for e in best.edges)
    wide = size_cluster(_pd(), TRACE, SLA, 0.9, range(1, 4), [0], md_max=6)
    assert wide is not None and wide.n_prefill < 3 and wide.n_md < 6
    assert not any("top" in e for e in wide.edges)
    rc = main(["size", "--agentic", "150", "--scenario", "pd_same_dc", "--prefill-range", "4:4", "--md-max", "2",
               "--ttft-slo", "30", "--tpot-slo", "1", "--target", "0.5"])
    out = capsys.readouterr().out
    assert rc == 0 and "warning: " in out and "wider range" in out


def test_equal_costs_are_a_tie_not_a_baseline_win():
    """PDD's cheapest mix without RLD is the cross-DC baseline's own fleet: the same $/h is a
    tie, said as one (it read "cross-DC PD + DRC wins ... PDD +0%")."""
    from types import SimpleNamespace

    from sglang_pdd.sim.sizing import verdict

    base = SimpleNamespace(cost_per_hour=85.8, n_rld=0)
    same = verdict("xdc_pd_drc", "cross-DC PD + DRC", base, SimpleNamespace(cost_per_hour=85.8, n_rld=0), "90%")
    assert same.winner == "tie" and same.message.startswith("vs cross-DC PD + DRC: a tie, $85.8/h each")
    assert "no RLD" in same.message
    dearer = verdict("xdc_pd_drc", "cross-DC PD + DRC", base, SimpleNamespace(cost_per_hour=115.8, n_rld=1), "90%")
    cheaper = verdict("xdc_pd_drc", "cross-DC PD + DRC", base, SimpleNamespace(cost_per_hour=55.8, n_rld=1), "90%")
    assert (dearer.winner, cheaper.winner) == ("baseline", "pdd")


def test_a_fleet_that_fails_with_more_md_does_not_hide_a_cheaper_one_with_fewer(monkeypatch):
    """Attainment is not monotone in MD's count: MD's affinity escape sends more turns to a
    less loaded MD that lacks their prefix when there are more MDs, so more bytes cross the
    WAN (the report's scale at 50 Gbps: P5/R1/M3 99.9%, P5/R1/M6 88.8%). A search that probes
    each P at the most MD, or bisects MD's count, misses the cheaper mix."""
    import sglang_pdd.sim.sizing as sizing

    summary = replace(run_scenario(with_counts(_pd(), 2, 0, 2), TRACE[:20], SLA), requests=len(TRACE))

    def fake_run(cfg, *args, **kwargs):
        attainment = 0.99 if cfg.n_prefill >= 5 and 2 <= cfg.n_md <= 3 else 0.5
        return replace(summary, sla_attainment=attainment, tail_sla_attainment=attainment)

    monkeypatch.setattr(sizing, "run_scenario", fake_run)
    best = size_cluster(_pd(), TRACE, SLA, 0.9, range(3, 9), [0], md_max=6)
    assert best is not None and (best.n_prefill, best.n_md) == (5, 2)
