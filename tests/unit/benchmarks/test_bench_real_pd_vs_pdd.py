"""bench_real_pd_vs_pdd's pure parts: the open-loop dispatch order, arrivals, per-request timing,
the SLA, the cross-design output comparison and the TTFT breakdown from the servers' time
stats. No server."""

from dataclasses import replace

import json
import pytest

from benchmarks.bench_agentic import Job, Turn, WorkloadConfig, build_jobs
from benchmarks.bench_real_pd_vs_pdd import (STAGES, Record, Slot, annotate_from_router_log, compare_outputs,
                                             dispatch_order, ideal_hit_per_request, meets_sla, parse_args,
                                             parse_router_requests, parse_time_stats, poisson_arrivals,
                                             add_stages, cell_key, spread_by_seed, stage_summary, summarize_cell, token_timing,
                                             ttft_stages, workload)


def session(index, turns, system=0):
    return Job("session", index, system=system, turns=[Turn(10, 5) for _ in range(turns)])


def test_dispatch_is_round_robin_over_live_sessions_and_every_turn_once():
    jobs = [session(0, 3), Job("outlier", 0, turns=[Turn(0, 2)], outlier_input=100), session(1, 1), session(2, 2)]
    order = dispatch_order(jobs, lanes=2)
    assert sorted(order, key=lambda s: (s.job, s.turn)) == [
        Slot(0, 0), Slot(0, 1), Slot(0, 2), Slot(1, 0), Slot(2, 0), Slot(3, 0), Slot(3, 1)]
    # session 0 and (after the outlier, which takes no lane) session 2 share the two lanes
    assert order[:3] == [Slot(1, 0), Slot(0, 0), Slot(2, 0)]
    for job in (0, 3):  # a session's turns in order
        turns = [s.turn for s in order if s.job == job]
        assert turns == sorted(turns)


def test_consecutive_turns_are_lanes_apart_while_sessions_last():
    jobs = [session(i, 4) for i in range(3)]
    order = dispatch_order(jobs, lanes=3)
    positions = [i for i, s in enumerate(order) if s.job == 1]
    assert [b - a for a, b in zip(positions, positions[1:])] == [3, 3, 3]


def test_poisson_arrivals_are_seeded_increasing_and_at_the_rate():
    a = poisson_arrivals(4000, 5.0, seed=1)
    assert a == poisson_arrivals(4000, 5.0, seed=1) and a != poisson_arrivals(4000, 5.0, seed=2)
    assert all(x < y for x, y in zip(a, a[1:]))
    assert 4000 / a[-1] == pytest.approx(5.0, rel=0.05)


def test_token_timing():
    ttft, tpot, gap = token_timing([1.1, 1.2, 1.5], [1, 2, 1], t_send=1.0)
    assert ttft == pytest.approx(0.1) and tpot == pytest.approx(0.4 / 3) and gap == pytest.approx(0.3)
    assert token_timing([2.0], [5], 1.0) == (1.0, 0.0, None)  # all tokens in one event
    assert token_timing([2.0], [1], 1.0) == (1.0, None, None)


def rec(design="pdd", ttft=0.1, tpot=0.01, error=None, out=(1, 2), job=0, turn=0, cell="c", done=2):
    return Record(design, 10, 1, cell, 0, "session", job, turn, 100, 2, ttft_s=ttft, tpot_s=tpot, error=error,
                  output_ids=list(out), completion_tokens=done, max_gap_s=0.02, e2e_s=0.2)


def test_sla_needs_both_ttft_and_tpot_and_no_error():
    assert meets_sla(rec(), 0.5, 0.1)
    assert not meets_sla(rec(ttft=0.6), 0.5, 0.1)
    assert not meets_sla(rec(tpot=0.2), 0.5, 0.1)
    assert not meets_sla(rec(error="x"), 0.5, 0.1)
    assert meets_sla(rec(tpot=None), 0.5, 0.1)  # one token: no TPOT


def test_cell_summary_counts_errors_in_goodput():
    recs = [rec(), rec(ttft=0.9), rec(error="boom"), rec(done=1)]
    s = summarize_cell(recs, rate=2.0, sla_ttft_s=0.5, sla_tpot_s=0.1, link_bytes=(5, 7), wall_s=3.0)
    assert s["requests"] == 4 and s["errors"] == 1 and s["completion_mismatch"] == 1
    assert s["sla_attainment"] == pytest.approx(0.5) and s["goodput_rps"] == pytest.approx(1.0)
    assert s["ttft_p50"] == pytest.approx(0.1) and (s["link_bytes_a_to_b"], s["link_bytes_b_to_a"]) == (5, 7)


def test_outputs_compared_request_by_request():
    same = [rec("a"), rec("b"), rec("a", job=1, out=(3, 4)), rec("b", job=1, out=(3, 4))]
    assert compare_outputs(same) == {"compared": 2, "mismatches": 0, "examples": [], "designs_per_request": [2]}
    differ = same + [rec("c", job=1, out=(3, 5))]
    eq = compare_outputs(differ)
    assert eq["mismatches"] == 1 and eq["examples"][0]["first_difference"] == 1
    # a failed request is not compared; a request only one design completed is not either
    assert compare_outputs([rec("a"), rec("b", error="x")])["compared"] == 0


def test_ideal_hits_follow_the_session():
    cfg = WorkloadConfig(system_tokens=100)
    jobs = [Job("session", 0, system=0, turns=[Turn(100, 10), Turn(20, 5)]),
            Job("session", 1, system=0, turns=[Turn(100, 10)]), Job("outlier", 0, turns=[Turn(0, 1)])]
    hits = ideal_hit_per_request(jobs, cfg)
    # turn 0: nothing held; turn 1: the previous prompt + output less its last token;
    # the second session's first turn: the shared system prompt; outliers: nothing
    assert hits == [0.0, pytest.approx(209 / 230), pytest.approx(100 / 200), 0.0]


def test_default_trace_is_mostly_high_hit():
    args = parse_args([])
    cfg, jobs = workload(args)
    hits = ideal_hit_per_request(jobs, cfg)
    assert sum(h >= 0.9 for h in hits) / len(hits) >= 0.6
    assert sum(j.kind == "outlier" for j in jobs) == args.outliers


def test_quick_size_is_one_cell():
    args = parse_args(["--quick"])
    assert len(args.links) == 1 and len(args.rates) == 1 and args.sessions <= 3
    assert build_jobs(workload(args)[0])  # builds


PREFILL_LINE = ("[2026-12-04 22:51:56] ReqTimeStats(rid=abc, bootstrap_room=77, input_len=300, cached_input_len=256, "
                "output_len=1, attempts=1, type=prefill): bootstrap_duration=2.00ms, queue_duration=1.00ms, "
                "forward_duration=30.00ms, entry_time=1000.010, transfer_speed=0.10 GB/s, transfer_total=0.30 MB")
DECODE_LINE = ("[2026-12-04 22:51:57] ReqTimeStats(rid=abc, bootstrap_room=77, input_len=300, cached_input_len=0, "
               "output_len=20, attempts=0, type=decode): bootstrap_duration=3.00ms, alloc_wait_duration=1.00ms, "
               "transfer_duration=40.00ms, queue_duration=5.00ms, forward_duration=200.00ms, entry_time=1000.020")


def test_time_stats_lines_parse():
    (p, d) = parse_time_stats(["noise", PREFILL_LINE, DECODE_LINE])
    assert p["type"] == "prefill" and p["bootstrap_room"] == 77 and p["input_len"] == 300
    assert p["forward_duration"] == pytest.approx(0.03) and p["entry_time"] == pytest.approx(1000.01)
    assert d["type"] == "decode" and d["transfer_duration"] == pytest.approx(0.04)


def test_ttft_is_split_into_stages_from_the_send():
    r = rec("same_dc_pd", ttft=0.1)
    r.prompt_tokens, r.sent_at = 300, 1000.0
    other = rec("same_dc_pd", ttft=0.2, job=1)
    other.prompt_tokens, other.sent_at = 999, 1000.0  # no server line with its length: left out
    (row,) = ttft_stages([r, other], parse_time_stats([PREFILL_LINE, DECODE_LINE]))
    assert row["to_prefill"] == pytest.approx(0.01) and row["p_forward"] == pytest.approx(0.03)
    assert row["to_decode"] == pytest.approx(0.02) and row["d_prealloc"] == pytest.approx(0.004)
    # ready to decode at 0.02 + 0.004 + 0.040 + 0.005 after the send: the rest of the 100 ms TTFT
    assert row["after_ready"] == pytest.approx(0.1 - 0.069)
    assert set(STAGES) <= set(row)


def stage_row(ttft, p_forward, d_transfer):
    row = {k: 0.0 for k in STAGES}
    return row | {"ttft": ttft, "p_forward": p_forward, "d_transfer": d_transfer}


def test_stage_summary_names_where_the_slowest_quarter_waits():
    rows = [stage_row(0.05, 0.03, 0.01) for _ in range(6)] + [stage_row(0.8, 0.03, 0.7), stage_row(0.6, 0.04, 0.5)]
    s = stage_summary(rows)
    assert s["matched"] == 8 and s["tail_n"] == 2
    assert s["tail"]["d_transfer"] == pytest.approx(0.6) and s["all"]["d_transfer"] == pytest.approx(0.01)
    assert s["tail"]["ttft"] == pytest.approx(0.7)
    assert stage_summary([])["matched"] == 0


def test_stages_go_to_their_cell():
    first = rec("pdd", ttft=0.1, cell="l0r1s0")
    first.rate, first.prompt_tokens, first.sent_at = 2.5, 300, 999.99
    second = rec("pdd", ttft=0.1, cell="l0r0s0")
    second.prompt_tokens, second.sent_at = 300, 1000.0
    res = {"cells": {cell_key("pdd", 10, 1): {}, cell_key("pdd", 10, 2.5): {}}}
    stats = parse_time_stats([PREFILL_LINE, DECODE_LINE, PREFILL_LINE.replace("77", "78").replace("1000.010", "1000.005"),
                              DECODE_LINE.replace("77", "78")])
    add_stages(res, "pdd", [first, second], stats)
    assert res["cells"][cell_key("pdd", 10, 1)]["stages"]["matched"] == 1
    assert res["cells"][cell_key("pdd", 10, 2.5)]["stages"]["matched"] == 1


def test_where_two_decode_sides_share_a_room_the_first_token_is_the_one_ready_first():
    r = rec("pdd", ttft=0.1)
    r.prompt_tokens, r.sent_at = 300, 1000.0
    # RLD (ready at 0.069 after the send, DECODE_LINE) and MD (its KV 0.5 s over the WAN), MD's line last
    md = DECODE_LINE.replace("transfer_duration=40.00ms", "transfer_duration=500.00ms")
    for lines in ([PREFILL_LINE, DECODE_LINE, md], [PREFILL_LINE, md, DECODE_LINE]):
        (row,) = ttft_stages([r], parse_time_stats(lines))
        assert row["d_transfer"] == pytest.approx(0.04)


def test_spread_gathers_each_runs_p90_by_seed_design_and_rate_on_one_link():
    run = lambda seed, p90: {"args": {"seed": seed}, "cells": {
        cell_key("pdd", 200, 5): {"ttft_p90": p90}, cell_key("pdd", 10, 5): {"ttft_p90": 9.0},
        cell_key("cross_dc_pd", 200, 5): {"ttft_p90": None}}}
    spread = spread_by_seed([run(2, 0.4), run(2, 0.2), run(0, 0.1)], 200)
    assert spread == {2: {"pdd": {5.0: [0.4, 0.2]}}, 0: {"pdd": {5.0: [0.1]}}}


def test_router_log_lines_annotate_requests_by_length_and_end_time():
    lines = ['[2026-12-04 22:49:14] request {"rid": "x1", "path": "p_rld_md", "prompt_tokens": 100, "output_tokens": 2, '
             '"md_cached": 77, "handoff_at": 1, "ttft_s": 0.07, "rld_tokens": 2, "fallbacks": ["wan_failed: x"]}',
             '[2026-12-04 22:49:30] request {"rid": "x2", "path": "p_md", "prompt_tokens": 100, "output_tokens": 2, '
             '"md_cached": 99, "handoff_at": null, "ttft_s": 0.05, "rld_tokens": 1, "fallbacks": []}',
             "other line", "[2026-12-04 22:49:30] request {broken"]
    entries = parse_router_requests(lines)
    assert [e["rid"] for e in entries] == ["x1", "x2"]
    first, second, unknown = rec(), rec(job=1), rec(job=2)
    first.sent_at, second.sent_at = entries[0]["logged_at"] - 0.3, entries[1]["logged_at"] - 0.5
    unknown.sent_at, unknown.prompt_tokens = first.sent_at, 555  # no line with its length
    annotate_from_router_log([second, unknown, first], entries)
    assert (first.path, first.md_cached_tokens, first.handoff_at, first.fallbacks) == ("p_rld_md", 77, 1, ["wan_failed: x"])
    assert (second.path, second.md_cached_tokens) == ("p_md", 99)
    assert unknown.path == "" and unknown.md_cached_tokens is None
    # the cell's shares count only requests the log named: 1 of 2 went P->MD, RLD made 3 of 4 tokens
    s = summarize_cell([first, second, unknown], rate=1.0, sla_ttft_s=0.5, sla_tpot_s=0.1, link_bytes=(0, 0), wall_s=1.0)
    assert s["p_md_share"] == pytest.approx(0.5) and s["rld_token_share"] == pytest.approx(0.75)


# ----------------------------------------------------------------------------- the cold burst
from benchmarks.bench_real_pd_vs_pdd import (burst_arrivals, burst_ratios, burst_stage_table, burst_summary,  # noqa: E402
                                             burst_workload, relayed_vs_same_dc)


def test_burst_sends_every_first_turn_at_once_and_holds_later_turns_on_their_session():
    args = parse_args(["--burst", "4", "--turns", "3", "3"])
    assert args.designs == ["same_dc_pd", "cross_dc_pd", "pdd"] and args.links == [8.0, 40.0]
    cfg, jobs = burst_workload(args)
    assert cfg.outliers == 0 and len(jobs) == 4
    order = dispatch_order(jobs, lanes=args.burst)
    assert [s.turn for s in order[:4]] == [0] * 4  # the burst: every session's first turn first
    assert burst_arrivals(order) == [0.0] * len(order)  # later turns wait for their answers only
    first = [cfg.system_tokens + j.turns[0].new_block for j in jobs]
    assert all(0.85 * 680 <= n <= 1.15 * 680 for n in first), first


def test_burst_placement_options_are_checked_at_parse_time():
    args = parse_args(["--burst", "3", "--dc-b-nice", "19", "--torch-threads", "1"])
    assert (args.dc_b_nice, args.torch_threads) == (19, 1)
    for bad in (["--burst", "3", "--dc-b-nice", "20"], ["--burst", "3", "--torch-threads", "-1"], ["--dc-b-nice", "5"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_burst_quick_size_is_a_burst_on_one_link():
    args = parse_args(["--burst", "6", "--quick"])
    assert args.burst >= 2 and len(args.links) == 1 and args.repeats == 1
    with pytest.raises(SystemExit):
        parse_args(["--burst", "1"])


def burst_record(design, link, rep, job, turn, ttft, path=""):
    return Record(design, link, 0, f"b0x{rep}s0", 0, "session", job, turn, 700, 8, ttft_s=ttft, path=path)


def test_burst_summary_splits_first_and_later_turns_paths_and_repeats():
    recs = [burst_record("pdd", 8.0, rep, j, t, 1.0 + j if t == 0 else 0.1, "p_rld_md" if t == 0 else "p_md")
            for rep in range(2) for j in range(3) for t in range(2)]
    recs.append(replace(burst_record("pdd", 8.0, 0, 9, 0, None), error="boom"))
    s = burst_summary(recs)["pdd|8"]
    assert s["n"] == 12 and s["errors"] == 1
    assert s["first_turns"]["ttft_p50"] == pytest.approx(2.0) and s["later_turns"]["ttft_p90"] == pytest.approx(0.1)
    assert s["paths"]["p_rld_md"]["n"] == 6 and s["paths"]["p_md"]["ttft_p50"] == pytest.approx(0.1)
    assert len(s["p90_per_repeat"]) == 2


def test_md_warmth_counts_relayed_requests_that_ended_before_md_answered_and_whether_md_got_them():
    # three sessions: turn 0 relayed (sessions 0 and 2 end before MD answered), turns 1 and 2 later
    recs = [replace(burst_record("pdd", 8.0, 0, j, 0, 0.3, "p_rld_md"),
                    router_marks={} if j != 1 else {"md_registered": 0.05}) for j in range(3)]
    hits = {(0, 1): 0, (0, 2): 700, (1, 1): 350, (1, 2): 700, (2, 1): 0, (2, 2): 0}  # (session, turn): MD's hit
    recs += [replace(burst_record("pdd", 8.0, 0, j, t, 0.1, "p_md"), md_cached_tokens=hit)
             for (j, t), hit in hits.items()]
    w = burst_summary(recs)["pdd|8"]["md_warmth"]
    assert w == {"relayed": 3, "relayed_ended_before_md_answered": 2, "ended_first_with_later_turns": 2,
                 "ended_first_found_later_on_md": 1,  # session 0 on its turn 2; session 2 never
                 "later_turns": 6, "later_md_hit_mean": pytest.approx(1750 / 700 / 6)}
    same = [burst_record("same_dc_pd", 0, 0, j, 0, 0.3) for j in range(2)]
    assert "md_warmth" not in burst_summary(same)["same_dc_pd|0"]  # no router log, no PDD


def test_burst_ratios_against_both_baselines_and_the_same_turns_on_same_dc():
    recs = ([burst_record("same_dc_pd", 0, 0, j, t, 1.0 if t == 0 else 0.5) for j in range(2) for t in range(2)]
            + [burst_record("cross_dc_pd", 8.0, 0, j, t, 2.0) for j in range(2) for t in range(2)]
            + [burst_record("pdd", 8.0, 0, j, t, 1.5 if t == 0 else 0.2, "p_rld_md" if t == 0 else "p_md")
               for j in range(2) for t in range(2)])
    r = burst_ratios(burst_summary(recs), 8.0)
    assert r["pdd_over_cross_dc"] == pytest.approx(pct_of([1.5, 1.5, 0.2, 0.2]) / 2.0)
    assert r["relayed_over_same_dc"] == pytest.approx(1.5 / pct_of([1, 1, 0.5, 0.5]))
    same = relayed_vs_same_dc(recs, 8.0)  # the relayed first turns against same-DC PD's first turns
    assert same["n"] == 2 and same["ratio"] == pytest.approx(1.5)


def pct_of(values):
    import numpy as np

    return float(np.percentile(values, 90))


def test_ratio_intervals_resample_whole_bursts_so_one_slow_burst_widens_the_interval():
    from benchmarks.bench_real_pd_vs_pdd import ratio_intervals

    def bursts(relayed_first_s):  # per burst: 3 sessions x 2 turns on each design, turn 0 relayed
        recs = []
        for rep, slow in enumerate(relayed_first_s):
            for j in range(3):
                recs.append(burst_record("same_dc_pd", 0, rep, j, 0, 0.20))
                recs.append(burst_record("same_dc_pd", 0, rep, j, 1, 0.10))
                recs.append(burst_record("pdd", 8.0, rep, j, 0, slow, "p_rld_md"))
                recs.append(burst_record("pdd", 8.0, rep, j, 1, 0.10, "p_md"))
        return recs

    steady = ratio_intervals(bursts([0.21] * 6), 8.0, resamples=300)
    assert steady["bursts"] == 6
    for name in ("relayed_over_same_dc", "relayed_over_same_turns"):
        assert steady[name]["low"] == pytest.approx(1.05) and steady[name]["high"] == pytest.approx(1.05)
        assert steady[name]["within_goal"] == 1.0
    # one burst of six is slow (a batch split): the pooled ratio could be anything from a tie to
    # 2x depending on whether that burst is drawn; the interval says so
    one_slow = ratio_intervals(bursts([0.21] * 5 + [0.60]), 8.0, resamples=300)
    iv = one_slow["relayed_over_same_turns"]
    assert iv["low"] == pytest.approx(1.05) and iv["high"] == pytest.approx(3.0)
    assert 0.1 < iv["within_goal"] < 0.6  # a resample misses the slow burst with probability (5/6)^6 = 0.33
    # no relayed request on the link: no relayed interval, PDD's own still there
    none_relayed = ratio_intervals([r for r in bursts([0.21] * 3) if r.path != "p_rld_md"], 8.0, resamples=50)
    assert none_relayed["relayed_over_same_dc"] is None and none_relayed["pdd_over_same_dc"] is not None
    assert ratio_intervals(bursts([0.21] * 3), 40.0, resamples=50)["pdd_over_same_dc"] is None


def test_ratio_intervals_split_the_relayed_turns_into_the_relay_path_and_the_wan_leg():
    from benchmarks.bench_real_pd_vs_pdd import ratio_intervals

    recs = []
    for rep in range(4):
        for j in range(3):
            recs.append(burst_record("same_dc_pd", 0, rep, j, 0, 0.20))
            recs.append(burst_record("pdd_rld_only", 8.0, rep, j, 0, 0.21, "p_rld_only"))
            recs.append(burst_record("pdd", 8.0, rep, j, 0, 0.30, "p_rld_md"))
    iv = ratio_intervals(recs, 8.0, resamples=100)
    assert iv["without_wan_over_same_turns"]["low"] == pytest.approx(1.05)
    assert iv["relayed_over_without_wan"]["high"] == pytest.approx(0.30 / 0.21)
    assert iv["relayed_over_same_turns"]["low"] == pytest.approx(1.5)
    # without pdd_rld_only beside, no split
    assert "relayed_over_without_wan" not in ratio_intervals([r for r in recs if r.design != "pdd_rld_only"], 8.0,
                                                             resamples=10)


def test_pdd_rld_only_sends_every_request_with_an_operators_path_on_pdds_own_servers(tmp_path):
    from types import SimpleNamespace

    from benchmarks.bench_real_pd_vs_pdd import DESIGNS, PddDesign, make_design, parse_args

    args = parse_args(["--burst", "6", "--designs", "same_dc_pd", "pdd", "pdd_rld_only", "--links", "8"])
    forced, plain = (make_design(name, tmp_path, "m", None, args) for name in ("pdd_rld_only", "pdd"))
    assert isinstance(forced, PddDesign) and "pdd_rld_only" not in DESIGNS  # not in the default set
    for design in (forced, plain):
        design.router_url = "http://router"
        design.cluster = SimpleNamespace(operator_headers={"Authorization": "Bearer op"})
    route = forced.route()
    assert route.name == "pdd_rld_only" and route.headers == {"Authorization": "Bearer op"}
    assert route.body_extra == {"pdd_options": {"path": "p_rld_only"}}
    assert plain.route().body_extra == {} and plain.route().headers == {}


def test_pdd_md_after_first_runs_pdds_router_with_its_flag_and_gets_its_own_intervals(tmp_path):
    from benchmarks.bench_real_pd_vs_pdd import DESIGNS, make_design, parse_args, ratio_intervals
    from sglang_pdd.router.front.cli import parse_args as router_args

    args = parse_args(["--burst", "6", "--designs", "same_dc_pd", "pdd", "pdd_md_after_first", "--links", "8"])
    late, plain = (make_design(name, tmp_path, "m", None, args) for name in ("pdd_md_after_first", "pdd"))
    assert "pdd_md_after_first" not in DESIGNS and late.forced_path is None  # its own requests, its own paths
    assert "--md-side-after-first-token" in late.router_args and "--md-side-after-first-token" not in plain.router_args
    assert router_args(["--prefill", "http://p,8998", "--relay", "http://r", "--tokenizer-path", "t",
                       *late.router_args]).md_side_after_first_token
    recs = [burst_record(d, l, rep, j, 0, t, p) for rep in range(3) for j in range(2)
            for d, l, t, p in (("same_dc_pd", 0, 0.20, ""), ("pdd", 8.0, 0.30, "p_rld_md"),
                               ("pdd_md_after_first", 8.0, 0.22, "p_rld_md"))]
    iv = ratio_intervals(recs, 8.0, resamples=50)
    assert iv["md_after_first_relayed_over_same_dc"]["low"] == pytest.approx(1.1)
    assert iv["relayed_over_same_dc"]["low"] == pytest.approx(1.5)


def test_burst_stage_table_groups_by_design_and_path():
    row = lambda design, path, ttft: {"design": design, "path": path, "ttft": ttft, **{k: ttft / 10 for k in STAGES}}
    t = burst_stage_table([row("pdd", "p_rld_md", 2.0), row("pdd", "p_rld_md", 4.0), row("pdd", "p_md", 1.0),
                           row("same_dc_pd", "", 1.0)])
    assert set(t) == {"pdd:p_rld_md", "pdd:p_md", "same_dc_pd"}
    assert t["pdd:p_rld_md"]["matched"] == 2 and t["pdd:p_rld_md"]["p_forward"] == pytest.approx(0.3)


def test_servers_are_labelled_by_role_for_the_cpu_split():
    from benchmarks.bench_real_pd_vs_pdd import server_label

    assert server_label(["python", "-m", "sglang.launch_server", "--pdd-role", "main", "--port", "1"]) == "main"
    assert server_label(["ip", "netns", "exec", "b", "python", "-m", "sglang.launch_server",
                         "--disaggregation-mode", "decode"]) == "pd_decode"
    assert server_label(["python", "-m", "sglang_router.launch_router", "--pd-disaggregation"]) == "sglang_router"
    assert server_label(["python", "-m", "sglang_pdd.router", "--port", "2"]) == "pdd_router"
    assert server_label(["python", "-m", "sglang.launch_server", "--pdd-role"]) == "other"


def test_pooled_bursts_are_one_sample_with_each_runs_p90_and_same_turns_matched_within_a_run(tmp_path, capsys):
    from dataclasses import asdict

    from benchmarks.bench_real_pd_vs_pdd import main, pool_bursts

    def run(name, relayed_s, same_first_s, relayed_jobs):
        recs = ([burst_record("same_dc_pd", 0, 0, j, t, same_first_s[j] if t == 0 else 0.1) for j in range(2) for t in range(2)]
                + [burst_record("pdd", 8.0, 0, j, t, relayed_s if t == 0 else 0.1,
                                "p_rld_md" if t == 0 and j in relayed_jobs else "p_md") for j in range(2) for t in range(2)])
        (tmp_path / name).mkdir()
        (tmp_path / name / "burst_requests.jsonl").write_text("".join(json.dumps(asdict(r)) + "\n" for r in recs))
        return tmp_path / name

    # both runs have the same cells, sessions and turns: only the run tells their requests apart
    a = run("a", relayed_s=1.0, same_first_s=[2.0, 2.0], relayed_jobs={0, 1})
    b = run("b", relayed_s=3.0, same_first_s=[1.0, 9.0], relayed_jobs={0})
    pooled = pool_bursts([a, b])
    assert pooled["runs"] == 2 and pooled["summary"]["pdd|8"]["n"] == 8
    assert pooled["p90_per_run"]["pdd|8"] == [pytest.approx(pct_of([1, 1, .1, .1])), pytest.approx(pct_of([3, 3, .1, .1]))]
    same = pooled["ratios"]["8"]["relayed_same_turns"]
    # run b's session 1 was not relayed: its same-DC turn (9 s) is not one of the same turns
    assert same["n"] == 3 and same["same_dc_same_turns_p90"] == pytest.approx(pct_of([2, 2, 1]))
    assert pooled["ratios"]["8"]["intervals"]["bursts"] == 2  # a burst per run: the runs' cells stay apart
    assert main(["--pool-bursts", str(a), str(b), "--plot", str(tmp_path / "iv.png")]) == 0
    out = capsys.readouterr().out
    assert "2 burst runs pooled" in out and "90% intervals, 2 bursts resampled" in out
    assert (tmp_path / "iv.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="does not exist"):
        pool_bursts([tmp_path / "nowhere"])


def test_the_documented_warmth_runs_pool_to_the_numbers_docs_quote():
    """docs/benchmarks.md's table of MD's cache warmth, from the records it ships: the previous
    router left every relayed prompt that ended before MD answered off MD; this one none."""
    from benchmarks.bench_real_pd_vs_pdd import pool_bursts
    from tests.conftest import REPO_ROOT

    runs = REPO_ROOT / "docs" / "img" / "real_burst_warm"
    warm = {t: pool_bursts([runs / f"{t}_s3", runs / f"{t}_s4"])["summary"]["pdd|8"]["md_warmth"] for t in ("base", "new")}
    assert [(w["relayed"], w["relayed_ended_before_md_answered"], w["ended_first_found_later_on_md"],
             w["ended_first_with_later_turns"]) for w in (warm["base"], warm["new"])] == [(51, 15, 0, 10), (39, 9, 9, 9)]
    assert round(warm["base"]["later_md_hit_mean"], 3) == 0.591 and round(warm["new"]["later_md_hit_mean"], 3) == 0.642


def test_a_burst_cell_waits_for_the_previous_cells_kv_to_leave_the_link():
    from benchmarks.bench_real_pd_vs_pdd import link_quiet, settle_link

    assert link_quiet(1_000, 0.5, 8.0) and not link_quiet(100_000, 0.5, 8.0)  # 16 kbit/s vs 1.6 Mbit/s
    assert not link_quiet(1_000, 0.5, 0.2)  # a quiet share is of the link's own rate

    class Link:  # the previous cell's KV still crosses for three windows, then probes only
        def __init__(self):
            self.moved = iter([0, 500_000, 1_000_000, 1_500_000, 1_500_100, 1_500_200])

        def counters(self):
            return next(self.moved), 0

    waited = settle_link(Link(), 8.0, window_s=0.01, timeout_s=5)
    assert 0.04 <= waited < 1.0
    busy = type("Busy", (), {"n": 0, "counters": lambda self: (setattr(self, "n", self.n + 10**6) or self.n, 0)})()
    assert settle_link(busy, 8.0, window_s=0.01, timeout_s=0.1) >= 0.1  # never quiet: it gives up


def test_the_documented_md_after_first_runs_pool_to_the_numbers_docs_quote():
    """docs/benchmarks.md's table for --md-side-after-first-token, from the records it ships."""
    from benchmarks.bench_real_pd_vs_pdd import pool_bursts
    from tests.conftest import REPO_ROOT

    runs = REPO_ROOT / "docs" / "img" / "real_burst_md_after_first"
    pooled = pool_bursts([runs / f"s{s}" for s in (3, 4, 5)])
    ms = lambda v: round(v * 1000)
    s = pooled["summary"]
    assert [(ms(s[k]["ttft_p50"]), ms(s[k]["ttft_p90"])) for k in ("same_dc_pd|0", "pdd|8", "pdd_md_after_first|8")] \
        == [(140, 252), (90, 282), (86, 234)]
    assert [(s[k]["paths"]["p_rld_md"]["n"], ms(s[k]["paths"]["p_rld_md"]["ttft_p50"]),
             ms(s[k]["paths"]["p_rld_md"]["ttft_p90"])) for k in ("pdd|8", "pdd_md_after_first|8")] \
        == [(125, 262, 299), (118, 200, 267)]
    iv = pooled["ratios"]["8"]["intervals"]
    assert [(round(iv[k]["low"], 2), round(iv[k]["high"], 2), round(100 * iv[k]["within_goal"]))
            for k in ("pdd_over_same_dc", "relayed_over_same_dc", "md_after_first_over_same_dc",
                      "md_after_first_relayed_over_same_dc")] \
        == [(1.03, 1.23, 31), (1.10, 1.31, 5), (0.83, 1.03, 99), (0.89, 1.22, 71)]
    assert [(round(iv[k]["low"], 2), round(iv[k]["high"], 2)) for k in
            ("md_after_first_over_pdd", "md_after_first_relayed_over_relayed")] == [(0.78, 0.86), (0.77, 1.01)]
