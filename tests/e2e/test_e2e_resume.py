"""End-to-end differential test of the resume marker on ONE real plain SGLang server (plugin loaded).

For each case: a greedy full generation G; then for cut points k, the same request with
input_ids = prompt + G[:k] and ``custom_params.pdd_resume_output_len = k`` must answer exactly
what the full run answered: output_ids and text from position 0, finish_reason (incl. the
matched stop), completion_tokens, prompt_tokens; with logprobs, the positions k.. of the full
run. Where the case allows, the same request WITHOUT the marker (SGLang's own behaviour:
the cut tokens become prompt) must differ, which shows the case exercises the marker.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import pytest

from sglang_pdd.launcher.http import post_json, stream_events
from sglang_pdd.sglang_glue.md.resume import RESUME_KEY

pytestmark = [pytest.mark.e2e, pytest.mark.own_cluster]

PROMPT = "The quick brown fox jumps over the lazy dog. Then it"
# bounded values: the tiny random model would otherwise write one string / number forever
JSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                                 "ok": {"type": "boolean"}},
               "required": ["name", "ok"], "additionalProperties": False}
# bounded words: the match must end (with its ".") well within max_new_tokens on the tiny model
REGEX = r"[a-z]{1,6}( [a-z]{1,6}){3,5}\."


@pytest.fixture(scope="module")
def server(run_root, servers_under_test):
    """One plain SGLang server with the plugin (like conftest's single_server), whose JSON
    grammar allows no free whitespace: the tiny random model would otherwise pad JSON with
    whitespace until max_new_tokens."""
    from tests.conftest import _require_sglang, plain_server

    model = _require_sglang()
    return servers_under_test.get("resume", lambda: plain_server(
        run_root, model, name="resume", extra_args=("--constrained-json-disable-any-whitespace",)))  # its own reference: default dtype


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from sglang_pdd.launcher.cluster import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path())


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return tokenizer(PROMPT)["input_ids"]


def _stream(url: str, body: dict) -> dict:
    """The last event of a /generate stream; checks the stream is cumulative on the way."""
    events = list(stream_events(url, body))
    assert events, "empty stream"
    for before, after in zip(events, events[1:]):
        assert after["output_ids"][:len(before["output_ids"])] == before["output_ids"]
    last = dict(events[-1])
    last["_first_event_ids"] = events[0]["output_ids"]
    return last


def generate(server: str, prompt_ids: list[int], params: dict, *, resumed: list[int] = (), marker: bool = True,
             stream: bool = False, **extra) -> dict:
    sampling = dict(params)
    if resumed and marker:
        sampling["custom_params"] = {RESUME_KEY: len(resumed)}
    body = {"input_ids": list(prompt_ids) + list(resumed), "sampling_params": sampling, **extra}
    if stream:
        return _stream(f"{server}/generate", {**body, "stream": True})
    return post_json(f"{server}/generate", body, timeout=300)


def assert_continues(full: dict, got: dict, k: int) -> None:
    assert got["output_ids"] == full["output_ids"], f"k={k}"
    assert got["text"] == full["text"], f"k={k}"
    fm, gm = full["meta_info"], got["meta_info"]
    assert gm["finish_reason"] == fm["finish_reason"], f"k={k}"
    assert gm["completion_tokens"] == fm["completion_tokens"], f"k={k}"
    assert gm["prompt_tokens"] == fm["prompt_tokens"], f"k={k}"


def check_cuts(server, prompt_ids, params, cuts, *, stream=False, expect_sensitive=False, **extra) -> dict:
    full = generate(server, prompt_ids, params, stream=stream, **extra)
    n = len(full["output_ids"])
    cuts = sorted({k for k in cuts if 0 < k < n})
    assert cuts, f"no cut point inside an output of {n} tokens"
    differs = []
    for k in cuts:
        got = generate(server, prompt_ids, params, resumed=full["output_ids"][:k], stream=stream, **extra)
        assert_continues(full, got, k)
        if stream:  # the first event already carries the resumed tokens (cumulative stream)
            assert got["_first_event_ids"][:k] == full["output_ids"][:k]
        if expect_sensitive:
            plain = generate(server, prompt_ids, params, resumed=full["output_ids"][:k], marker=False, **extra)
            differs.append(full["output_ids"][:k] + plain["output_ids"] != full["output_ids"][:k + len(plain["output_ids"])]
                           or plain["meta_info"]["finish_reason"] != full["meta_info"]["finish_reason"])
    if expect_sensitive:
        assert any(differs), "without the marker every cut gave the same output: the case tests nothing"
    return full


@pytest.mark.parametrize("stream", [False, True])
def test_length_finish(server, prompt_ids, stream):
    full = check_cuts(server, prompt_ids, {"max_new_tokens": 24, "temperature": 0}, [1, 8, 23], stream=stream)
    assert full["meta_info"]["finish_reason"]["type"] == "length"


def test_parallel_samples_each_continue(server, prompt_ids):
    """n > 1: SGLang first caches the prefix with a max_new_tokens=0 copy, then runs n samples."""
    params = {"max_new_tokens": 12, "temperature": 0}
    full = generate(server, prompt_ids, params)
    got = generate(server, prompt_ids, {**params, "n": 2}, resumed=full["output_ids"][:5])
    assert isinstance(got, list) and len(got) == 2
    for sample in got:
        assert_continues(full, sample, 5)


def test_max_new_tokens_is_the_total_budget(server, prompt_ids):
    full = check_cuts(server, prompt_ids, {"max_new_tokens": 10, "temperature": 0}, [1, 5, 9],
                      expect_sensitive=True)
    assert full["meta_info"]["completion_tokens"] == 10


@pytest.mark.parametrize("stream", [False, True])
def test_regex(server, prompt_ids, stream):
    params = {"max_new_tokens": 48, "temperature": 0, "regex": REGEX}
    full = generate(server, prompt_ids, params)
    n = len(full["output_ids"])
    assert re.fullmatch(REGEX, full["text"]), full["text"]
    check_cuts(server, prompt_ids, params, [1, n // 2, n - 1], stream=stream, expect_sensitive=not stream)


def test_json_schema_cut_inside_a_value(server, prompt_ids, tokenizer):
    params = {"max_new_tokens": 64, "temperature": 0, "json_schema": json.dumps(JSON_SCHEMA)}
    full = generate(server, prompt_ids, params)
    value = json.loads(full["text"])
    assert set(value) == {"name", "ok"}
    ids = full["output_ids"]
    # cut points where the decoded prefix ends inside a JSON string (odd number of quotes)
    # after the first key, i.e. inside the "name" value
    inside = [k for k in range(1, len(ids)) if (t := tokenizer.decode(ids[:k])).count('"') % 2 == 1 and t.count('"') >= 3]
    assert inside, full["text"]
    check_cuts(server, prompt_ids, params, [1, inside[0], inside[-1], len(ids) - 1], expect_sensitive=True)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_straddling_the_cut(server, prompt_ids, tokenizer, stream):
    base = generate(server, prompt_ids, {"max_new_tokens": 32, "temperature": 0})
    ids = base["output_ids"]
    # a stop string that spans a token boundary in the middle of the output
    for m in range(len(ids) // 2, len(ids) - 2):
        head, tail = tokenizer.decode(ids[:m]), tokenizer.decode(ids[:m + 2])
        stop = tail[len(head) - 3:len(head) + 3]
        if tail.startswith(head) and len(head) >= 3 and len(tail) - len(head) >= 3 and "\ufffd" not in stop:
            break
    else:
        pytest.fail(f"no stop string straddling a token boundary in {base['text']!r}")
    params = {"max_new_tokens": 32, "temperature": 0, "stop": [stop]}
    full = generate(server, prompt_ids, params)
    assert full["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    out = full["output_ids"]
    # cuts whose resumed text ends strictly inside the stop string
    straddling = [k for k in range(1, len(out)) if stop not in (t := tokenizer.decode(out[:k]))
                  and any(t.endswith(stop[:i]) for i in range(1, len(stop)))]
    assert straddling, (stop, full["text"])
    check_cuts(server, prompt_ids, params, straddling + [1], stream=stream)


def test_stop_token_ids(server, prompt_ids):
    base = generate(server, prompt_ids, {"max_new_tokens": 32, "temperature": 0})["output_ids"]
    stop_id = base[12]
    params = {"max_new_tokens": 32, "temperature": 0, "stop_token_ids": [stop_id]}
    full = check_cuts(server, prompt_ids, params, [1, 6, base.index(stop_id)])
    assert full["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}


@pytest.mark.parametrize("penalty", [{"frequency_penalty": 1.5}, {"presence_penalty": 1.5},
                                     {"repetition_penalty": 1.6}])
def test_penalties_count_resumed_tokens(server, prompt_ids, penalty):
    plain = generate(server, prompt_ids, {"max_new_tokens": 32, "temperature": 0})
    params = {"max_new_tokens": 32, "temperature": 0, **penalty}
    full = check_cuts(server, prompt_ids, params, [1, 6, 12, 20, 28], expect_sensitive=True)
    assert full["output_ids"] != plain["output_ids"], "the penalty changes nothing for this prompt"


def test_penalties_follow_the_servers_clock(server, tokenizer):
    """Under the overlap scheduler one server counts penalties one token late (relay/penalty_clock.py):
    on this prompt its greedy output repeats the first token under repetition_penalty, which a
    resume at k=1 that counted the resumed token at once would not (measured before the fix)."""
    ids = tokenizer("call error the printing")["input_ids"]
    for penalty in ({"repetition_penalty": 1.4}, {"frequency_penalty": 0.8, "presence_penalty": 0.6}):
        params = {"max_new_tokens": 16, "temperature": 0, **penalty}
        full = check_cuts(server, ids, params, [1, 2, 3])
        assert full["output_ids"][0] == full["output_ids"][1], "the case this test is about is gone"


def test_min_new_tokens_counts_resumed_tokens(server, prompt_ids):
    base = generate(server, prompt_ids, {"max_new_tokens": 32, "temperature": 0})["output_ids"]
    stop_id = base[2]  # without min_new_tokens the request would stop after 3 tokens
    params = {"max_new_tokens": 32, "temperature": 0, "stop_token_ids": [stop_id], "min_new_tokens": 12}
    full = generate(server, prompt_ids, params)
    assert full["meta_info"]["completion_tokens"] >= 12
    check_cuts(server, prompt_ids, params, [1, 3, 8, 11])


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_are_the_full_runs_from_position_k(server, prompt_ids, stream):
    params = {"max_new_tokens": 20, "temperature": 0}
    extra = {"return_logprob": True, "top_logprobs_num": 3}
    full = generate(server, prompt_ids, params, stream=stream, **extra)
    fm = full["meta_info"]
    assert len(fm["output_token_logprobs"]) == 20
    for k in (1, 7, 19):
        got = generate(server, prompt_ids, params, resumed=full["output_ids"][:k], stream=stream, **extra)
        assert_continues(full, got, k)
        gm = got["meta_info"]
        assert gm["input_token_logprobs"] == []
        # one entry per output position; the k resumed ones are placeholders the router fills
        assert len(gm["output_token_logprobs"]) == 20
        assert [tid for _, tid, _ in gm["output_token_logprobs"]] == full["output_ids"]
        assert [lp for lp, _, _ in gm["output_token_logprobs"][:k]] == [None] * k
        for (lp, _, _), (ref_lp, _, _) in zip(gm["output_token_logprobs"][k:], fm["output_token_logprobs"][k:]):
            assert lp == pytest.approx(ref_lp, abs=1e-3)
        assert gm["output_top_logprobs"][:k] == [None] * k
        assert [[t for _, t, _ in row] for row in gm["output_top_logprobs"][k:]] == \
               [[t for _, t, _ in row] for row in fm["output_top_logprobs"][k:]]


def _post_status(url: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_bad_markers_are_400_naming_the_field(server, prompt_ids):
    url = f"{server}/generate"
    n = len(prompt_ids)
    for k, max_new in ((n, 8), (0, 8), ("3", 8), (4, 4)):
        status, text = _post_status(url, {"input_ids": prompt_ids, "sampling_params": {
            "max_new_tokens": max_new, "temperature": 0, "custom_params": {RESUME_KEY: k}}})
        assert status == 400 and RESUME_KEY in text, (k, status, text)
    # resumed tokens the grammar rejects
    bad = generate(server, prompt_ids, {"max_new_tokens": 8, "temperature": 0})["output_ids"][:3]
    status, text = _post_status(url, {"input_ids": prompt_ids + bad, "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "regex": r"\d+", "custom_params": {RESUME_KEY: 3}}})
    assert status == 400 and "grammar" in text, (status, text)
