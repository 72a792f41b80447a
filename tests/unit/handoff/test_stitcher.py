"""StreamStitcher: every position emitted once, in order, whatever the decoders do."""

import random

import pytest

from sglang_pdd.handoff.stitcher import Source, StitchError, StreamStitcher

TRUTH = list(range(100, 140))  # what greedy decoding produces, position by position


def test_one_shot_handoff_emits_each_token_once():
    s = StreamStitcher()
    out = s.on_rld_tokens(TRUTH[:5])
    eager = s.begin_handoff()
    assert eager == TRUTH[:5] and s.cut == 5
    out += s.on_rld_tokens(TRUTH[5:8])  # RLD keeps going while MD extends: held back
    assert out == TRUTH[:5]
    out += s.on_md_tokens(5, TRUTH[5:7])
    out += s.on_rld_tokens(TRUTH[8:9])  # RLD's last tokens before its abort lands: dropped
    out += s.on_md_tokens(7, TRUTH[7:])
    assert out == TRUTH and s.emitted == TRUTH and s.source is Source.MAIN


def test_failed_handoff_releases_rld_backlog_in_order():
    s = StreamStitcher()
    out = s.on_rld_tokens(TRUTH[:3])
    s.begin_handoff()
    out += s.on_rld_tokens(TRUTH[3:10])
    out += s.handoff_failed()
    out += s.on_rld_tokens(TRUTH[10:])
    assert out == TRUTH and s.source is Source.RELAY and s.handoffs_failed == 1


def test_retry_after_failure_cuts_at_new_position():
    s = StreamStitcher()
    s.on_rld_tokens(TRUTH[:3])
    s.begin_handoff()
    s.on_rld_tokens(TRUTH[3:6])
    s.handoff_failed()
    assert s.begin_handoff() == TRUTH[:6]
    assert s.on_md_tokens(6, TRUTH[6:]) == TRUTH[6:]
    assert s.emitted == TRUTH


@pytest.mark.parametrize("call,match", [
    (lambda s: s.on_md_tokens(0, [1]), "before any handoff"),
    (lambda s: s.handoff_failed(), "no handoff in flight"),
])
def test_protocol_violations_raise(call, match):
    s = StreamStitcher()
    s.on_rld_tokens([1, 2])
    with pytest.raises(StitchError, match=match):
        call(s)
    assert s.emitted == [1, 2]


def test_md_must_start_at_the_cut_and_stay_contiguous():
    s = StreamStitcher()
    s.on_rld_tokens(TRUTH[:4])
    s.begin_handoff()
    with pytest.raises(StitchError, match="expected the cut 4"):
        s.on_md_tokens(5, TRUTH[5:6])
    s.on_md_tokens(4, TRUTH[4:6])
    with pytest.raises(StitchError, match="stream is at 6"):
        s.on_md_tokens(7, TRUTH[7:8])
    with pytest.raises(StitchError, match="already main"):
        s.begin_handoff()
    assert s.emitted == TRUTH[:6]


def test_random_interleavings_never_lose_or_duplicate():
    rng = random.Random(7)
    for _ in range(300):
        s = StreamStitcher()
        rld_pos, out, md_next = 0, [], None
        while len(out) < len(TRUTH):
            action = rng.random()
            if s.source is not Source.MAIN and rld_pos < len(TRUTH) and action < 0.5:
                k = rng.randint(1, 3)
                out += s.on_rld_tokens(TRUTH[rld_pos:rld_pos + k])
                rld_pos = min(len(TRUTH), rld_pos + k)
            elif s.source is Source.RELAY and action < 0.7:
                md_next = len(s.begin_handoff())
            elif s.source is Source.HANDING_OFF and action < 0.8:
                out += s.handoff_failed()
            elif s.source is not Source.RELAY and md_next is not None and md_next < len(TRUTH):
                k = rng.randint(1, 4)
                out += s.on_md_tokens(md_next, TRUTH[md_next:md_next + k])
                md_next = min(len(TRUTH), md_next + k)
            elif s.source is Source.RELAY and rld_pos >= len(TRUTH):
                break
        assert out == TRUTH[:len(out)] and s.emitted == out
        assert len(out) == len(TRUTH)


def test_resume_relay_after_md_died_mid_stream():
    s = StreamStitcher()
    out = s.on_rld_tokens(TRUTH[:4])
    s.begin_handoff()
    out += s.on_md_tokens(4, TRUTH[4:9])
    s.resume_relay()  # a new P->RLD request for prompt + TRUTH[:9]
    out += s.on_rld_tokens(TRUTH[9:])
    assert out == TRUTH and s.source is Source.RELAY


def test_md_output_from_position_zero_is_taken_past_the_cut():
    """The resume contract: MD's cumulative stream starts with the eager tokens it was handed."""
    s = StreamStitcher()
    out = s.on_rld_tokens(TRUTH[:5])
    s.begin_handoff()
    out += s.on_rld_tokens(TRUTH[5:7])  # held back
    assert s.on_md_output(TRUTH[:5]) == []  # only the eager tokens so far: nothing new
    out += s.on_md_output(TRUTH[:8])
    out += s.on_md_output(TRUTH[:8])  # a repeated event adds nothing
    out += s.on_md_output(TRUTH)
    assert out == TRUTH and s.source is Source.MAIN


def test_md_output_not_starting_with_the_eager_tokens_is_refused():
    s = StreamStitcher()
    s.on_rld_tokens(TRUTH[:5])
    s.begin_handoff()
    with pytest.raises(StitchError):
        s.on_md_output(TRUTH[5:12])  # an MD that restarted instead of continuing
