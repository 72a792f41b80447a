"""How a trace arrives: with arrivals="sessions" a session's next turn follows the previous
turn's answer and its think time, session starts keep their trace times for every design, and
a trace without sessions replays exactly as open loop, and every summary says so."""

import json
from dataclasses import replace

import pytest

from benchmarks.sim_headline import headline_markdown
from sglang_pdd.sim.cli import main
from sglang_pdd.sim.cluster import run_scenario
from sglang_pdd.sim.metrics import Sla
from sglang_pdd.sim.scenarios import with_counts
from sglang_pdd.sim.sizing import size_cluster
from tests.support.sim_sessions import TRACE, by_session, designs, early_turns, run, same, write_trace


@pytest.mark.parametrize("name", ["pd_same_dc", "xdc_pd", "pdd_drc_adaptive"])
def test_a_turn_never_arrives_before_its_predecessor_was_answered(name):
    cfg = {c.name: c for c in designs()}[name]
    assert early_turns(run(cfg, TRACE, "open")) > 10  # the trace does send turns early open loop
    seen = run(cfg, TRACE, "sessions")
    assert early_turns(seen) == 0
    for turns in by_session(seen).values():
        for (prev_tr, _, prev_done), (tr, arrival, _) in zip(turns, turns[1:]):
            think = (tr.timestamp_ms - prev_tr.timestamp_ms) / 1e3
            assert arrival == pytest.approx(prev_done + think)


def _starts(seen):
    firsts, seen_sessions = {}, set()
    for tr in sorted((s[0] for s in seen), key=lambda tr: tr.timestamp_ms):
        if tr.session_id is None or tr.session_id not in seen_sessions:
            firsts[id(tr)] = tr
        if tr.session_id is not None:
            seen_sessions.add(tr.session_id)
    return sorted((arrival, tr.timestamp_ms) for tr, arrival, _ in seen if id(tr) in firsts)


def test_every_design_sees_the_same_session_starts_and_rate_scale_scales_them():
    t0 = TRACE[0].timestamp_ms
    later = {}
    for cfg in designs():
        for k in (1.0, 2.0):
            seen = run(cfg, TRACE, "sessions", k)
            starts = _starts(seen)
            assert len(starts) == len({tr.session_id for tr in TRACE})
            assert [a for a, _ in starts] == pytest.approx([(ts - t0) / 1e3 / k for _, ts in starts])
            if k == 1.0:
                later[cfg.name] = sorted(a for _, a, _ in seen)
    # ... while later turns follow each design's own answers
    assert len({tuple(round(a, 6) for a in v) for v in later.values()}) > 1


def test_a_trace_without_sessions_replays_exactly_as_open_loop():
    flat = [replace(tr, session_id=None) for tr in TRACE]
    for cfg in designs():
        assert same(run_scenario(cfg, flat, arrivals="sessions"), run_scenario(cfg, flat, arrivals="open"))


def test_unknown_arrivals_is_refused():
    with pytest.raises(ValueError):
        run_scenario(designs()[0], TRACE, arrivals="closed")


def test_sizing_replays_sessions_by_default():
    cfg = {c.name: c for c in designs()}["xdc_pd_drc"]
    best = size_cluster(cfg, TRACE, Sla(), 0.5, [1, 2], [0], 2)
    assert best is not None
    mix = with_counts(cfg, best.n_prefill, best.n_rld, best.n_md)
    assert same(best.summary, run_scenario(mix, TRACE, arrivals="sessions"))
    assert not same(best.summary, run_scenario(mix, TRACE, arrivals="open"))


@pytest.mark.parametrize("command", [["compare", "--prefill", "1", "--md", "1"],
                                     ["size", "--scenario", "pd_same_dc", "--prefill-range", "1:2", "--md-max", "2"],
                                     ["sweep", "--scenarios", "pd_same_dc", "--scales", "1"],
                                     ["rld-sweep", "--prefill", "1", "--rld", "1", "--md", "1", "--values", "4"]])
def test_a_trace_without_sessions_is_printed_as_open_loop(command, tmp_path, capsys):
    """Whatever --arrivals asked, a trace without sessions replays open loop, and says so."""
    flat = write_trace(tmp_path / "flat.jsonl", [replace(tr, session_id=None) for tr in TRACE[:120]])
    sessions = write_trace(tmp_path / "sessions.jsonl", TRACE[:120])
    for path, want, asked in ((flat, "open loop", "sessions"), (flat, "open loop", "open"),
                              (sessions, "arrivals sessions", "sessions"), (sessions, "open loop", "open")):
        main([*command, "--trace", path, "--arrivals", asked, "--out", str(tmp_path)])
        out = capsys.readouterr().out
        head = next(ln for ln in out.splitlines() if ln.startswith("# "))
        assert want in head, (path, asked, head)
        if want == "open loop":
            assert "arrivals sessions" not in out and "turns after answers" not in out
    if command[0] == "compare":
        rows = json.loads((tmp_path / "compare_flat.jsonl.json").read_text())
        assert {r["setup"]["arrivals"] for r in rows} == {"open"}


def test_the_headline_says_open_loop_unless_its_turns_followed_answers():
    table = dict(trace="t", requests=1, model="m", wan_gbps=20.0, mla_kernel="flashmla", fleet={}, target=0.9,
                 same_fleet={}, knees={}, sized={}, verdicts=[])
    assert "open loop" in headline_markdown(dict(table, arrivals="open"))
    assert "open loop" in headline_markdown(table)  # the earliest results replayed open loop
    assert "arrivals sessions" in headline_markdown(dict(table, arrivals="sessions"))
