"""handoff/output_meta.py: logprob entries per output position, spliced across legs (pure)."""

from sglang_pdd.handoff.output_meta import OutputMeta, requested_keys

ASK = {"return_logprob": True, "top_logprobs_num": 1}


def entry(pos: int, src: str) -> list:
    return [-(pos + 1) / 10 - (0.001 if src == "md" else 0), 100 + pos, None]


def test_requested_keys_follow_the_request():
    assert requested_keys({}) == ((), ())
    assert requested_keys({"return_logprob": True}) == (("output_token_logprobs",), ("input_token_logprobs",))
    assert requested_keys({"return_logprob": True, "top_logprobs_num": 2, "token_ids_logprob": [5]}) == (
        ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs"),
        ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs"))
    # SGLang reports the token-id lists whenever token_ids_logprob is set, even to []
    assert "input_token_ids_logprobs" in requested_keys({"return_logprob": True, "token_ids_logprob": []})[1]


def run_handoff(md_format: str) -> dict:
    """RLD emits 0..4, MD (resumed 5) emits 5..9; MD's list for 0..4 per ``md_format``."""
    meta = OutputMeta(ASK)
    rld = [entry(i, "rld") for i in range(7)]  # RLD went on to 7 before its abort: 5, 6 unused
    meta.observe_prefill({"input_token_logprobs": [[None, 1, None], [-0.5, 2, None]],
                          "input_top_logprobs": [None, [[-0.5, 2, None]]]})
    meta.observe(("rld", 1), 7, {"output_token_logprobs": rld, "output_top_logprobs": [[e] for e in rld],
                                 "input_token_logprobs": [], "input_top_logprobs": []})
    meta.emitted(("rld", 1), 0, 5)
    own = [entry(i, "md") for i in range(5, 10)]
    if md_format == "shorter":
        lists = {"output_token_logprobs": own, "output_top_logprobs": [[e] for e in own]}
    else:  # placeholders, as sglang_glue/md/resume.py returns them
        lists = {"output_token_logprobs": [[None, 100 + i, None] for i in range(5)] + own,
                 "output_top_logprobs": [None] * 5 + [[e] for e in own]}
    meta.observe(("md", 0), 10, {**lists, "input_token_logprobs": []})
    meta.emitted(("md", 0), 5, 10)
    return meta.as_dict({"type": "length", "length": 10}, 2, 10)


def test_each_position_from_the_leg_that_emitted_it():
    for md_format in ("shorter", "placeholders"):
        got = run_handoff(md_format)
        want = [entry(i, "rld") for i in range(5)] + [entry(i, "md") for i in range(5, 10)]
        assert got["output_token_logprobs"] == want
        assert got["output_top_logprobs"] == [[e] for e in want]
        assert got["input_token_logprobs"] == [[None, 1, None], [-0.5, 2, None]]  # P's, not the decoders' []
        assert got["input_top_logprobs"] == [None, [[-0.5, 2, None]]]
        assert got["completion_tokens"] == 10 and got["finish_reason"]["length"] == 10


def test_a_position_its_emitter_gave_no_entry_for_is_spliced_from_another_leg():
    meta = OutputMeta({"return_logprob": True})
    meta.observe(("rld", 1), 3, {"output_token_logprobs": [entry(0, "rld"), entry(1, "rld"), entry(2, "rld")]})
    meta.observe(("md", 0), 4, {"output_token_logprobs": [[None, 100, None], entry(1, "md"), entry(2, "md"),
                                                          entry(3, "md")]})
    meta.emitted(("md", 0), 0, 4)  # e.g. MD's positions with placeholders where it resumed
    assert meta.as_dict(None, 1, 4)["output_token_logprobs"] == [entry(0, "rld"), entry(1, "md"), entry(2, "md"),
                                                                 entry(3, "md")]


def test_input_logprobs_are_p_replys_as_sglang_made_them():
    ask = {"return_logprob": True, "top_logprobs_num": 1, "token_ids_logprob": [7], "logprob_start_len": 2}
    meta = OutputMeta(ask)
    assert meta.missing_input() == ["input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs"]
    p_reply = {"input_token_logprobs": [[-1.5, 3, None], [-0.25, 4, None]],  # from logprob_start_len 2
               "input_top_logprobs": [[[-1.0, 9, None]], [[-0.2, 8, None]]],
               "input_token_ids_logprobs": [[[-4.0, 7, None]], [[-5.0, 7, None]]], "cached_tokens": 0}
    meta.observe_prefill(p_reply)
    meta.observe(("rld", 1), 1, {"output_token_logprobs": [entry(0, "rld")], "input_token_logprobs": []})
    meta.emitted(("rld", 1), 0, 1)
    got = meta.as_dict(None, 4, 1)
    assert meta.missing_input() == []
    for key in ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs"):
        assert got[key] == p_reply[key]


def test_a_p_reply_without_the_lists_asked_for_leaves_them_missing():
    meta = OutputMeta({"return_logprob": True, "top_logprobs_num": 2})
    meta.observe_prefill({"input_token_logprobs": [], "cached_tokens": 3})  # e.g. logprob_start_len -1: []
    assert meta.missing_input() == ["input_top_logprobs"]
    assert meta.as_dict(None, 3, 0)["input_token_logprobs"] == []
    assert OutputMeta({}).missing_input() == []  # nothing asked, nothing missing


def test_ps_entry_for_its_first_token_fills_the_relays_hole():
    """RLD is handed P's first token and gives no token-ids entry for it (SGLang's PD decode)."""
    meta = OutputMeta({"return_logprob": True, "token_ids_logprob": [5]})
    meta.observe(("rld", 1), 3, {"output_token_logprobs": [entry(i, "rld") for i in range(3)],
                                 "output_token_ids_logprobs": [None, [entry(1, "rld")], [entry(2, "rld")]]})
    meta.emitted(("rld", 1), 0, 3)
    assert meta.as_dict(None, 2, 3)["output_token_ids_logprobs"][0] is None  # P's reply not in yet
    meta.observe_prefill({"output_token_logprobs": [entry(0, "p")], "output_token_ids_logprobs": [[entry(0, "p")]],
                          "input_token_logprobs": [], "input_token_ids_logprobs": []})
    got = meta.as_dict(None, 2, 3)
    assert got["output_token_ids_logprobs"] == [[entry(0, "p")], [entry(1, "rld")], [entry(2, "rld")]]
    assert got["output_token_logprobs"] == [entry(i, "rld") for i in range(3)]  # the emitter's own stay
