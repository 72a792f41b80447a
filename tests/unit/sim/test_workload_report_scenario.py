"""The report's scenario preset: ~64K tokens in all, ~1K output, 70-80% at >= 90% hit, sessions."""

from statistics import mean

import pytest

from sglang_pdd.sim.traces import has_sessions
from sglang_pdd.sim.workload import generate_agentic_trace, per_request_hit_rates, report_scenario_config


@pytest.mark.parametrize("seed", [0, 1])
def test_report_scenario_has_the_reports_lengths_and_hits(seed):
    trace = list(generate_agentic_trace(report_scenario_config(num_requests=2000, seed=seed)))
    hits = per_request_hit_rates(trace)
    assert 0.70 <= sum(h >= 0.9 for h in hits) / len(hits) <= 0.80
    assert 58_000 <= mean(r.input_length + r.output_length for r in trace) <= 66_000
    assert 900 <= mean(r.output_length for r in trace) <= 1100
    assert has_sessions(trace) and all(r.gap_after_answer for r in trace)


def test_the_cli_generates_and_simulates_the_report_scenario(tmp_path, capsys):
    from sglang_pdd.sim.cli import main
    from sglang_pdd.sim.workload import load_trace
    out = tmp_path / "t.jsonl"
    assert main(["gen-trace", "--kind", "report-scenario", "--n", "30", "--output", str(out)]) == 0
    assert len(list(load_trace(str(out)))) == 30
    assert main(["compare", "--report-scenario", "30", "--model", "deepseek-v4-pro", "--chip-a", "h200",
                 "--prefill", "1", "--rld", "1", "--md", "1", "--out", str(tmp_path)]) == 0
    assert "report_scenario30" in capsys.readouterr().out
