"""What a gap between two turns of a session is: a recorded trace's runs arrival to arrival
(the answer's time inside it), so with turns following answers the next turn keeps its
recorded time and only waits for an answer that came later; the generator's gaps are think
time alone (`gap_after_answer`), counted from the answer's end, and its saved traces say so."""

import pytest

from sglang_pdd.sim.workload import TraceRequest, load_trace
from tests.support.sim_sessions import TRACE, by_session, designs, early_turns, run, write_trace


# A recorded trace's gaps run arrival to arrival: the generator's sessions as a trace file
# without the generator's mark would hold them.
RECORDED = [TraceRequest(tr.timestamp_ms, tr.input_length, tr.output_length, tr.hash_ids, tr.session_id, tr.turn)
            for tr in TRACE]


@pytest.mark.parametrize("name", ["pd_same_dc", "xdc_pd", "pdd_drc_adaptive"])
def test_a_recorded_gap_keeps_its_time_unless_the_answer_is_later(name):
    """The next turn arrives its recorded gap after the previous turn's arrival, or when the
    previous answer ends if that is later: the answer's time is inside a recorded gap, so it
    is not added to it."""
    cfg = {c.name: c for c in designs()}[name]
    seen = run(cfg, RECORDED, "sessions")
    assert early_turns(seen) == 0
    on_time = waited = 0
    for turns in by_session(seen).values():
        for (prev_tr, prev_arrival, prev_done), (tr, arrival, _) in zip(turns, turns[1:]):
            gap = (tr.timestamp_ms - prev_tr.timestamp_ms) / 1e3
            assert arrival == pytest.approx(max(prev_arrival + gap, prev_done))
            on_time += prev_arrival + gap > prev_done
            waited += prev_arrival + gap < prev_done
    assert on_time > 0 and waited > 0  # both cases occur on this (overloaded) trace


def test_a_recorded_session_answered_in_time_replays_its_timestamps():
    """Two turns 5 s apart whose first answer takes well under 5 s: the second arrives at 5 s,
    as recorded (not 5 s after the answer); a gap shorter than the answer waits for it."""
    cfg = {c.name: c for c in designs()}["pd_same_dc"]
    ids = tuple(range(8))
    turns = [TraceRequest(0.0, 8 * 512, 20, ids, 1, 0), TraceRequest(5000.0, 9 * 512, 20, ids + (50,), 1, 1),
             TraceRequest(5001.0, 10 * 512, 20, ids + (50, 51), 1, 2)]
    (_, a0, d0), (_, a1, d1), (_, a2, _) = sorted(run(cfg, turns, "sessions"), key=lambda s: s[1])
    assert a0 == 0.0 and d0 < 5.0
    assert a1 == pytest.approx(5.0)
    assert d1 > 5.001 and a2 == pytest.approx(d1)  # 1 ms recorded: it waits for the answer


def test_a_generators_gap_is_think_time_after_the_answer():
    cfg = {c.name: c for c in designs()}["pd_same_dc"]
    ids = tuple(range(8))
    think = [TraceRequest(0.0, 8 * 512, 20, ids, 1, 0, gap_after_answer=True),
             TraceRequest(5000.0, 9 * 512, 20, ids + (50,), 1, 1, gap_after_answer=True),
             TraceRequest(5001.0, 10 * 512, 20, ids + (50, 51), 1, 2, gap_after_answer=True)]
    (_, _, d0), (_, a1, d1), (_, a2, _) = sorted(run(cfg, think, "sessions"), key=lambda s: s[1])
    assert a1 == pytest.approx(d0 + 5.0) and a2 == pytest.approx(d1 + 0.001)


def test_the_generator_marks_its_gaps_as_think_time_and_a_saved_trace_keeps_the_mark(tmp_path):
    assert all(tr.gap_after_answer for tr in TRACE)
    path = write_trace(tmp_path / "gen.jsonl", TRACE[:50])
    assert list(load_trace(path)) == TRACE[:50]
    recorded = write_trace(tmp_path / "rec.jsonl", RECORDED[:50])
    assert '"gap_after_answer"' not in open(recorded).read()
    assert not any(tr.gap_after_answer for tr in load_trace(recorded))
