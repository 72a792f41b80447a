"""handoff/output_meta.py: logprob entries per output position, spliced across legs (pure)."""

from sglang_pdd.handoff.output_meta import OutputMeta, requested_keys

ASK = {"return_logprob": True, "top_logprobs_num": 1}


def entry(pos: int, src: str) -> list:
    return [-(pos + 1) / 10 - (0.001 if src == "md" else 0), 100 + pos, None]


def test_requested_keys_follow_the_request():
    assert requested_keys({}) == ((), ())
    assert requested_keys({"return_logprob": True}) == (("output_token_logprobs",), ("input_token_logprobs",))
    assert requested_keys({"return_logprob": True, "top_logprobs_num": 2, "token_ids_logprob": [5]})[0] == (
        "output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


def run_handoff(md_format: str) -> dict:
    """RLD emits 0..4, MD (resumed 5) emits 5..9; MD's list for 0..4 per ``md_format``."""
    meta = OutputMeta(ASK)
    rld = [entry(i, "rld") for i in range(7)]  # RLD went on to 7 before its abort: 5, 6 unused
    meta.observe(("rld", 1), 7, {"output_token_logprobs": rld, "output_top_logprobs": [[e] for e in rld],
                                 "input_token_logprobs": [[None, 1, None], [-0.5, 2, None]]}, first_leg=True)
    meta.emitted(("rld", 1), 0, 5)
    own = [entry(i, "md") for i in range(5, 10)]
    if md_format == "shorter":
        lists = {"output_token_logprobs": own, "output_top_logprobs": [[e] for e in own]}
    else:  # placeholders, as sglang_glue/resume.py returns them
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
        assert got["input_token_logprobs"] == [[None, 1, None], [-0.5, 2, None]]  # the first leg's
        assert got["completion_tokens"] == 10 and got["finish_reason"]["length"] == 10


def test_a_position_its_emitter_gave_no_entry_for_is_spliced_from_another_leg():
    meta = OutputMeta({"return_logprob": True})
    meta.observe(("rld", 1), 3, {"output_token_logprobs": [entry(0, "rld"), entry(1, "rld"), entry(2, "rld")]})
    meta.observe(("md", 0), 4, {"output_token_logprobs": [[None, 100, None], entry(1, "md"), entry(2, "md"),
                                                          entry(3, "md")]})
    meta.emitted(("md", 0), 0, 4)  # e.g. MD's positions with placeholders where it resumed
    assert meta.as_dict(None, 1, 4)["output_token_logprobs"] == [entry(0, "rld"), entry(1, "md"), entry(2, "md"),
                                                                 entry(3, "md")]


def test_input_logprobs_fall_back_to_the_prefill_reply():
    meta = OutputMeta({"return_logprob": True})
    meta.observe_prefill({"input_token_logprobs": [[None, 1, None]]})
    meta.observe(("rld", 1), 0, {"input_token_logprobs": []}, first_leg=True)
    assert meta.as_dict(None, 1, 0)["input_token_logprobs"] == [[None, 1, None]]
