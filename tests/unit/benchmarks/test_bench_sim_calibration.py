"""Pure parts of benchmarks/bench_sim_calibration.py: workload, trace, router-log mapping, table."""

import json
import math

import pytest

from benchmarks import bench_sim_calibration as bsc
from sglang_pdd.sim.workload import BLOCK_TOKENS


def test_workload_is_seeded_and_only_arrivals_follow_the_rate():
    spec = bsc.WorkloadSpec(n=50, seed=3)
    slow, fast = bsc.build_workload(spec, 1.0), bsc.build_workload(spec, 4.0)
    assert slow == bsc.build_workload(spec, 1.0)
    assert [(r.unique_tokens, r.output_tokens, r.shared_prefix) for r in slow] == \
           [(r.unique_tokens, r.output_tokens, r.shared_prefix) for r in fast]
    assert slow[0].arrival_s == 0.0
    assert [r.arrival_s * 1.0 for r in slow[1:]] == pytest.approx([r.arrival_s * 4.0 for r in fast[1:]])
    assert all(b.arrival_s > a.arrival_s for a, b in zip(slow, slow[1:]))
    assert 0 < sum(r.shared_prefix for r in slow) < len(slow)  # both kinds of prompt
    with pytest.raises(ValueError):
        bsc.build_workload(spec, 0)


def test_prompt_ids_share_the_block_and_nothing_else():
    spec = bsc.WorkloadSpec(n=30, seed=1)
    shared = [r for r in bsc.build_workload(spec, 1.0) if r.shared_prefix][:2]
    a, b = (bsc.prompt_ids(r, "s") for r in shared)
    assert len(a) == shared[0].prompt_tokens and a[:BLOCK_TOKENS] == b[:BLOCK_TOKENS]
    assert a[BLOCK_TOKENS:BLOCK_TOKENS + 8] != b[BLOCK_TOKENS:BLOCK_TOKENS + 8]
    assert bsc.prompt_ids(shared[0], "other")[:BLOCK_TOKENS] != a[:BLOCK_TOKENS]  # a new salt, a cold cache
    assert min(a) >= bsc.FIRST_TOKEN_ID and max(a) < bsc.VOCAB


def test_trace_keeps_lengths_send_times_and_the_shared_block():
    reqs = [bsc.CalRequest(0, 0.0, 100, 20, True), bsc.CalRequest(1, 0.5, 700, 30, False),
            bsc.CalRequest(2, 0.9, 300, 10, True)]
    trace = bsc.to_trace(reqs, sent_s=[0.01, 0.52, 0.93])
    assert [t.timestamp_ms for t in trace] == pytest.approx([10, 520, 930])
    assert [t.input_length for t in trace] == [612, 700, 812]
    assert [t.output_length for t in trace] == [20, 30, 10]
    assert [len(t.hash_ids) for t in trace] == [2, 2, 2]
    assert trace[0].hash_ids[0] == trace[2].hash_ids[0] == bsc.SHARED_HASH_ID
    others = [h for t in trace for h in t.hash_ids if h != bsc.SHARED_HASH_ID]
    assert len(others) == len(set(others)) == 4  # every other block is unique
    assert bsc.to_trace(reqs)[1].timestamp_ms == pytest.approx(500)


def test_router_line_maps_to_metrics():
    line = ('2026-12-04 15:00:00,000 sglang_pdd.router.front.app INFO request ' + json.dumps(
        {"rid": "x", "path": "p_rld_md", "output_tokens": 11, "handoff_at": 4, "mode": "one_shot",
         "stall_s": 0.05, "ttft_s": 0.2, "e2e_s": 1.2}))
    d = bsc.parse_request_line(line)
    m = bsc.from_router_record(d)
    assert (m.path, m.ttft_s, m.stall_s, m.output_tokens) == ("p_rld_md", 0.2, 0.05, 11)
    assert m.tpot_s == pytest.approx(0.1)
    assert bsc.parse_request_line("... INFO started router") is None
    assert bsc.parse_request_line("x request {broken") is None
    # no handoff: no stall; one token: no TPOT
    m = bsc.from_router_record({"path": "p_rld_md", "output_tokens": 1, "handoff_at": None, "stall_s": None,
                                "ttft_s": 0.1, "e2e_s": 0.1})
    assert m.stall_s is None and m.tpot_s is None


def test_sim_log_maps_to_the_same_records():
    from sglang_pdd.sim.metrics import RequestLog

    log = RequestLog()
    for ttft, tpot, stall, out, path in ((0.1, 0.02, float("nan"), 10, 1), (0.3, float("nan"), 0.05, 1, 0)):
        log.ttft.append(ttft), log.tpot.append(tpot), log.stall.append(stall)
        log.output.append(out), log.path.append(path), log.arrival.append(0), log.e2e.append(1)
        log.rld_tokens.append(0)
    recs = bsc.from_sim_log(log, ("p_md", "p_rld_md", "p_rld_only"))
    assert recs[0] == bsc.RequestMetrics("p_rld_md", 0.1, 0.02, None, 10)
    assert recs[1] == bsc.RequestMetrics("p_md", 0.3, None, 0.05, 1)


def test_summary_and_error_table():
    recs = [bsc.RequestMetrics("p_rld_md", t, 0.01 * (i + 1), 0.04 if i % 2 else None, 8)
            for i, t in enumerate([0.1, 0.2, 0.3, 0.4, 0.5])]
    s = bsc.summarise(recs)
    assert s["n"] == 5 and s["paths"] == {"p_rld_md": 5} and s["handoffs"] == 2
    assert s["ttft_p50"] == pytest.approx(0.3) and s["ttft_p90"] == pytest.approx(0.46)
    assert s["tpot_p50"] == pytest.approx(0.03) and s["stall_p50"] == pytest.approx(0.04)
    assert bsc.summarise([])["ttft_p50"] is None
    sim = {**s, "ttft_p50": 0.45, "stall_p50": None}
    rows = bsc.error_rows("30%", s, sim)
    assert [r.metric for r in rows] == list(bsc.METRICS)
    assert rows[0].error == pytest.approx(0.5) and rows[2].error == pytest.approx(0.0)
    assert rows[3].error is None  # a side without handoffs has no stall to compare
    assert bsc.relative_error(0.0, 1.0) is None
    text = bsc.format_table(rows)
    assert "+50%" in text and "ttft_p90" in text
    md = bsc.markdown_table(rows)
    assert md.count("\n") == 1 + len(rows) and "| 30% | ttft_p50 | 300 | 450 | +50% |" in md


def test_simulator_runs_the_same_requests_with_a_fitted_profile():
    from benchmarks import calibrate_profile as cp

    # 20 ms a step: RLD is still decoding when MD's KV lands, so requests hand off.
    prof = cp.build_profile("t", 1, 1.0, 512, 65536, 16, (0.01, 2e-5, 0.0), (0.02, 1e-4, 1e-7))
    cfg = bsc.sim_config(prof, 0.004, 20.0, 16)
    trace = bsc.to_trace(bsc.build_workload(bsc.WorkloadSpec(n=20), 2.0))
    recs = bsc.simulate(cfg, trace)
    assert len(recs) == 20 and all(r.ttft_s is not None and r.ttft_s > 0 for r in recs)
    assert any(r.stall_s is not None for r in recs)  # a slow WAN: RLD hands off to MD mid-stream
    assert not math.isnan(bsc.summarise(recs)["tpot_p50"])


def test_min_steps_keeps_the_fastest_run_per_batch():
    runs = [[(1, 100, 0.02), (4, 400, 0.05)], [(4, 400, 0.03), (1, 100, 0.04), (8, 800, 0.1)]]
    assert bsc.min_steps(runs) == [(1, 100, 0.02), (4, 400, 0.03), (8, 800, 0.1)]


def test_kv_bytes_come_from_the_model_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 128,
         "head_dim": 32}))
    assert bsc.kv_bytes_of_model(str(tmp_path)) == 2 * 2 * 2 * 32 * 2  # K and V, 16-bit
    assert bsc.kv_bytes_of_model(str(tmp_path), "float32") == 1024
