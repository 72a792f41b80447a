"""Router input validation (router/front/validate.py): pure, no servers."""

from __future__ import annotations

import pytest

from sglang_pdd.router.front.validate import DEFAULT_MAX_NEW_TOKENS, settle_max_new_tokens
from sglang_pdd.router.front.validate import (ApiError, check_generate_body, check_openai_body, check_token_budget,
                                        check_token_ids, parse_json_object)

LIMITS = dict(cap=100, vocab_size=1000, max_n=4)


@pytest.mark.parametrize("value", ["abc", None, True, -1, 1.5, [3]])
def test_max_new_tokens_must_be_a_non_negative_int(value):
    with pytest.raises(ApiError) as e:
        check_generate_body({"text": "x", "sampling_params": {"max_new_tokens": value}}, **LIMITS)
    assert e.value.status == 400 and "sampling_params.max_new_tokens" in e.value.message


def test_max_new_tokens_cap_and_missing_budget():
    with pytest.raises(ApiError, match="--max-new-tokens-cap"):
        check_token_budget(101, "max_new_tokens", 100)
    assert check_token_budget(None, "max_tokens", 100) is None
    assert check_token_budget(0, "max_tokens", 100) == 0


@pytest.mark.parametrize("ids,where", [([True], "input_ids[0]"), ([10**40], "input_ids[0]"), ([1, -1], "input_ids[1]"),
                                       ([1, 1000], "input_ids[1]"), ([], "non-empty"), ("12", "non-empty"),
                                       ([[1], [2, "x"]], "input_ids[1][1]")])
def test_input_ids_are_ints_in_the_vocab(ids, where):
    with pytest.raises(ApiError) as e:
        check_generate_body({"input_ids": ids}, **LIMITS)
    assert where in e.value.message


def test_batches_and_valid_bodies_pass():
    check_generate_body({"input_ids": [[1, 2], [3]], "sampling_params": [{"max_new_tokens": 5}, {"n": 2}]}, **LIMITS)
    check_generate_body({"text": ["a", "b"], "rid": ["r1", "r2"]}, **LIMITS)
    assert check_token_ids([0, 999], "input_ids", 1000) == [0, 999]


def test_reserved_custom_params_unsupported_fields_n_and_rid():
    with pytest.raises(ApiError, match="pdd_room"):
        check_generate_body({"text": "x", "sampling_params": {"custom_params": {"pdd_room": 1, "ok": 2}}}, **LIMITS)
    with pytest.raises(ApiError, match="input_embeds"):
        check_generate_body({"input_embeds": [[0.1]], "text": "x"}, **LIMITS)
    with pytest.raises(ApiError, match="--max-n"):
        check_generate_body({"text": "x", "sampling_params": {"n": 5}}, **LIMITS)
    with pytest.raises(ApiError, match="rid"):
        check_generate_body({"text": "x", "rid": 7}, **LIMITS)
    with pytest.raises(ApiError, match="custom_params"):
        check_openai_body({"custom_params": {"pdd_wan_peer": "1.2.3.4:5"}}, cap=100, max_n=4)
    with pytest.raises(ApiError, match="max_tokens"):
        check_openai_body({"max_tokens": 10**9}, cap=100, max_n=4)


@pytest.mark.parametrize("raw", [b"{oops", b"[1, 2]", b"\xff\xfe", b""])
def test_body_must_be_a_json_object(raw):
    with pytest.raises(ApiError) as e:
        parse_json_object(raw)
    assert e.value.status == 400


def test_error_messages_bound_echoed_client_values():
    with pytest.raises(ApiError) as e:
        check_token_budget("x" * 100_000, "max_tokens", 100)
    assert len(e.value.message) < 200


def test_json_nested_too_deep_is_refused_not_a_recursion_error():
    from sglang_pdd.router.front.validate import MAX_JSON_DEPTH, json_depth

    assert json_depth({"a": [1, {"b": []}]}) == 4 and json_depth(5) == 0
    ok = b'{"a": ' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b"}"
    assert parse_json_object(ok)["a"]
    for depth in (MAX_JSON_DEPTH, 100_000):
        with pytest.raises(ApiError, match="nested deeper than") as e:
            parse_json_object(b'{"a": ' + b"[" * depth + b"]" * depth + b"}")
        assert e.value.status == 400


def test_grammar_size_is_capped_for_every_grammar_kind():
    from sglang_pdd.router.front.validate import GRAMMAR_FIELDS, check_grammar_size

    for name in GRAMMAR_FIELDS:
        check_grammar_size({name: "x" * 100}, "sampling_params", 100)
        with pytest.raises(ApiError, match=f"sampling_params.{name} has 101 bytes.*--max-grammar-bytes"):
            check_grammar_size({name: "é" * 50 + "x"}, "sampling_params", 100)  # bytes, not characters


def test_openai_prompt_characters_are_capped_per_prompt_and_per_conversation():
    from sglang_pdd.router.front.validate import text_chars

    messages = [{"role": "user", "content": [{"type": "text", "text": "ab"}]}, {"role": "system", "content": "cde"}]
    assert text_chars(messages) == len("user" + "text" + "ab" + "system" + "cde")
    check_openai_body({"prompt": ["x" * 10, "y" * 10]}, cap=100, max_n=4, max_prompt_chars=10)
    with pytest.raises(ApiError, match=r"prompt\[1\] has 11 characters.*--max-prompt-chars"):
        check_openai_body({"prompt": ["x", "y" * 11]}, cap=100, max_n=4, max_prompt_chars=10)
    with pytest.raises(ApiError, match="messages has 19 characters"):
        check_openai_body({"messages": messages}, cap=100, max_n=4, max_prompt_chars=18)


@pytest.mark.parametrize("sampling,words", [
    ({"temperature": -1}, "temperature must be a non-negative finite number, got -1"),
    ({"temperature": float("nan")}, "temperature must be a non-negative finite number"),
    ({"frequency_penalty": 3}, "frequency_penalty must be in [-2, 2]"),
    ({"logit_bias": {"1000": 1.0}}, "logit_bias must has keys in [0, 999]"),
    ({"stop": ["s"] * 33}, "at most 32 stop strings"),
    ({"regex": "("}, "Failed to compile regex grammar: "),
    ({"json_schema": "{"}, "Failed to compile json grammar: "),
    ({"temperature": "hot"}, "bad sampling_params"),
])
def test_sampling_params_are_checked_as_one_sglang_server_checks_them(sampling, words):
    from sglang_pdd.router.front.validate import check_sampling_as_sglang

    with pytest.raises(ApiError) as e:
        check_sampling_as_sglang(sampling, None, 1000)
    assert e.value.status == 400 and words in e.value.message
    assert "regex_converter.cc" not in e.value.message  # xgrammar's C++ location stays out


def test_valid_sampling_params_and_grammars_pass():
    from sglang_pdd.router.front.validate import check_sampling_as_sglang

    for sampling in ({"temperature": 0, "top_p": 0.5, "max_new_tokens": None}, {"regex": "hello (world|there)"},
                     {"json_schema": '{"type": "object"}'}, {"json_schema": "$$ANY$$"}):
        check_sampling_as_sglang(sampling, None, 1000)
    with pytest.raises(ApiError, match="text and input_ids cannot be provided at the same time"):
        check_generate_body({"text": "x", "input_ids": [1]}, **LIMITS)


def test_max_new_tokens_is_settled_in_one_place():
    """Named: checked against the cap; absent: SGLang's default; None (an OpenAI request
    without max_tokens): what one server would decode, up to its context length and the cap."""
    settle = lambda sampling, prompt_len=10: settle_max_new_tokens(sampling, prompt_len, cap=100,  # noqa: E731
                                                                   context_len=50)
    assert settle({"max_new_tokens": 7}) == 7
    assert settle({}) == DEFAULT_MAX_NEW_TOKENS == 128
    assert settle({"max_new_tokens": None}) == 40 and settle({"max_new_tokens": None}, 60) == 0
    assert settle_max_new_tokens({"max_new_tokens": None}, 10, cap=30, context_len=50) == 30
    for bad in (101, -1, 2.5, "8", True):
        with pytest.raises(ApiError, match="max_new_tokens"):
            settle({"max_new_tokens": bad})
