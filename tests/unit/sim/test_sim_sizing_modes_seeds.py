"""PDD is sized under each router path mode and the cheaper one stands for it, named; verdicts
over several seeds call a difference a win only where it holds on every seed."""

from types import SimpleNamespace

import pytest

from sglang_pdd.router.policy import PathMode
from sglang_pdd.sim.cli import main
from sglang_pdd.sim.hardware import TOY_A, TOY_B
from sglang_pdd.sim.metrics import Sla
from sglang_pdd.sim.scenarios import ClusterSpec, standard_scenarios
from sglang_pdd.sim.sizing import DesignSizing, Verdict, pick_path_mode, size_designs, verdicts_over_seeds
from sglang_pdd.sim.workload import AgenticTraceConfig, generate_agentic_trace


def _sized(cost, attainment=0.95):
    return SimpleNamespace(cost_per_hour=cost, summary=SimpleNamespace(sla_attainment=attainment))


def test_the_cheaper_mode_stands_for_pdd_then_the_higher_attainment_then_fit():
    assert pick_path_mode({"fit": _sized(120.0), "relay_first": _sized(100.0)}) == "relay_first"
    assert pick_path_mode({"fit": _sized(100.0, 0.91), "relay_first": _sized(100.0, 0.97)}) == "relay_first"
    assert pick_path_mode({"relay_first": _sized(100.0), "fit": _sized(100.0)}) == "fit"
    assert pick_path_mode({"fit": None, "relay_first": _sized(300.0)}) == "relay_first"
    assert pick_path_mode({"fit": None, "relay_first": None}) is None


def _seed(*winners_deltas):
    return DesignSizing({}, "pdd", [Verdict(b, b.upper(), w, d, "") for b, (w, d) in zip(("a", "b"), winners_deltas)])


def test_a_verdict_over_seeds_is_a_win_only_on_every_seed():
    seeds = [_seed(("pdd", -0.10), ("pdd", -0.02)), _seed(("pdd", -0.05), ("baseline", 0.03)),
             _seed(("pdd", -0.08), ("pdd", -0.01))]
    a, b = verdicts_over_seeds(seeds)
    assert (a.baseline, a.winner) == ("a", "pdd") and a.delta == pytest.approx(-23 / 300)
    assert "PDD wins on all 3 seeds" in a.message and "PDD -10% to -5%" in a.message
    assert b.winner == "tie" and "pdd, baseline, pdd" in b.message and "PDD -2% to +3%" in b.message
    lost = verdicts_over_seeds([_seed(("baseline", 0.1), ("tie", 0.0)), _seed(("baseline", 0.2), ("tie", 0.0))])
    assert [v.winner for v in lost] == ["baseline", "tie"]
    with pytest.raises(ValueError):
        verdicts_over_seeds([_seed(("pdd", -0.1)), DesignSizing({}, "pdd", [Verdict("b", "B", "pdd", -0.1, "")])])


def test_size_designs_sizes_pdd_under_each_mode_and_states_the_picked_one():
    trace = list(generate_agentic_trace(AgenticTraceConfig(num_requests=150, seed=1)))
    by = {c.name: c for c in standard_scenarios(ClusterSpec(chip_a=TOY_A, chip_b=TOY_B))}
    v = size_designs({n: by[n] for n in ("pd_same_dc", "pdd_drc_adaptive")}, "pdd_drc_adaptive", trace,
                     Sla(ttft_s=10.0, tpot_s=0.1), 0.9, range(1, 3), range(0, 2), 3)
    assert set(v.pdd_by_mode) == {m.value for m in PathMode}
    assert v.pdd_mode == pick_path_mode(v.pdd_by_mode) and v.pdd_mode is not None
    assert v.results["pdd_drc_adaptive"] is v.pdd_by_mode[v.pdd_mode]
    # each mode was really sized under its own rule
    for mode, res in v.pdd_by_mode.items():
        if res is not None and res.n_rld:
            assert res.summary.scenario == "pdd_drc_adaptive"


def test_size_over_seeds_prints_each_seed_and_the_verdicts_over_them(capsys):
    rc = main(["size", "--agentic", "120", "--scenario", "pdd_drc_adaptive", "--prefill-range", "1:2",
               "--rld-range", "0:1", "--md-max", "2", "--ttft-slo", "30", "--tpot-slo", "1", "--target", "0.5",
               "--seeds", "0,1,2", "--model", "llama3-70b"])
    out = capsys.readouterr().out
    assert rc == 0
    for seed in (0, 1, 2):
        assert f"# seed {seed}: agentic120" in out
    assert out.count("with --path-mode fit:") == 3 and out.count("with --path-mode relay_first:") == 3
    assert out.count("PDD stands as --path-mode") == 3
    assert "# over seeds 0,1,2: PDD stood as" in out
    assert out.count("verdict over seeds vs ") == 3


def test_each_seed_is_sized_on_its_own_trace_in_any_order(capsys):
    """The --seed trace the command built first is not reused for another seed, nor another
    seed's for --seed."""
    argv = ["size", "--agentic", "120", "--scenario", "pdd_drc_adaptive", "--prefill-range", "1:2",
            "--rld-range", "0:1", "--md-max", "2", "--ttft-slo", "30", "--tpot-slo", "1", "--target", "0.5",
            "--model", "llama3-70b"]

    def per_seed(out):
        blocks = out.split("# seed ")[1:]
        return {b.split(":", 1)[0]: b.split("# over seeds")[0] for b in blocks}

    assert main(argv + ["--seeds", "0,1"]) == 0
    forward = per_seed(capsys.readouterr().out)
    assert main(argv + ["--seeds", "1,0"]) == 0
    backward = per_seed(capsys.readouterr().out)
    assert forward == backward and forward["0"] != forward["1"]
