"""Incremental detokenization (router/front/detokenize.py) on the tiny model's byte-level tokenizer."""

from __future__ import annotations

import pytest

from tests.conftest import require_sglang_import

require_sglang_import()

from sglang_pdd.router.front.detokenize import IncrementalDetokenizer  # noqa: E402


class CountingTokenizer:
    """The real tokenizer, counting how many token ids it is asked to decode."""

    def __init__(self, inner):
        self.inner, self.decoded_ids = inner, 0

    def decode(self, ids, **kw):
        self.decoded_ids += len(ids)
        return self.inner.decode(ids, **kw)


@pytest.fixture(scope="module")
def tok(router_sglang_state):
    return router_sglang_state[2]


TEXT = "héllo wörld 你好 \n\nend of the story"


def stream(tok, prompt_ids, out_ids, finish, step=1, **kw):
    d = IncrementalDetokenizer(tok, prompt_ids, **kw)
    deltas = [d.add(out_ids[i:i + step]) for i in range(0, len(out_ids) - 1, step)]
    deltas.append(d.add(out_ids[len(deltas) * step:], finish))
    return d, deltas


@pytest.mark.parametrize("step", [1, 2, 5])
def test_stream_deltas_add_up_to_the_text_and_never_split_a_character(tok, step):
    prompt = tok.encode("Say:", add_special_tokens=False)
    out = tok.encode(TEXT, add_special_tokens=False)
    d, deltas = stream(tok, prompt, out, {"type": "length", "length": len(out)}, step=step)
    assert "".join(deltas) == d.text == tok.decode(out)
    assert not any("\ufffd" in delta for delta in deltas)
    if step == 1:
        assert any(len(delta) == 0 for delta in deltas), "a split multi-byte character is held back"


def test_cost_is_linear_in_output_length(tok):
    counting = CountingTokenizer(tok)
    out = tok.encode("the quick brown fox " * 100, add_special_tokens=False)
    d = IncrementalDetokenizer(counting, [1, 2, 3])
    for t in out:
        d.add([t])
    assert d.text == tok.decode(out)
    assert counting.decoded_ids < 12 * len(out)  # a full re-decode per step would be ~len(out)**2 / 2


def test_matched_stop_string_is_trimmed_unless_no_stop_trim(tok):
    out = tok.encode("hello STOP", add_special_tokens=False)  # a server stops at the stop string
    finish = {"type": "stop", "matched": "STOP"}
    for no_stop_trim, want in ((False, "hello "), (True, "hello STOP")):
        d = IncrementalDetokenizer(tok, [1], no_stop_trim=no_stop_trim)
        assert d.add(out, finish) == want
        # streamed, the steps before the last (held back by the router while a stop may have
        # matched, see may_finish_with) and the final one add up to the same text
        d = IncrementalDetokenizer(tok, [1], no_stop_trim=no_stop_trim)
        d.add(out[:2])
        d.add(out[2:], finish)
        assert d.text == want


def test_matched_stop_token_stays_out_of_the_text(tok):
    eos = tok.eos_token_id
    out = tok.encode("done", add_special_tokens=False) + [eos]
    d, _ = stream(tok, [1], out, {"type": "stop", "matched": eos}, skip_special_tokens=False)
    assert d.text == "done"
    d, _ = stream(tok, [1], out, {"type": "stop", "matched": eos}, skip_special_tokens=False, no_stop_trim=True)
    assert d.text == "done" + tok.decode([eos], skip_special_tokens=False)


def test_prompt_context_shapes_the_first_word_like_a_single_server(tok):
    prompt = tok.encode("hello", add_special_tokens=False)
    out = tok.encode(" world", add_special_tokens=False)
    d, _ = stream(tok, prompt, out, {"type": "length"})
    assert d.text == tok.decode(prompt + out)[len(tok.decode(prompt)):]


def test_may_finish_with_flags_stop_tokens_and_strings(tok):
    d = IncrementalDetokenizer(tok, [1])
    d.add(tok.encode("abc ", add_special_tokens=False))
    assert d.may_finish_with([2], [], {2})
    assert d.may_finish_with(tok.encode("ST", add_special_tokens=False), ["c ST"], set())
    assert not d.may_finish_with(tok.encode("xy", add_special_tokens=False), ["STOP"], {2})


def test_finished_stream_refuses_more_tokens(tok):
    d = IncrementalDetokenizer(tok, [1])
    d.add([70], {"type": "length"})
    with pytest.raises(RuntimeError):
        d.add([70])
