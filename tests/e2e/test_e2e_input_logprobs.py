"""Differential end to end: the prompt's logprobs through the router equal one SGLang server's
(within 1e-3, same layout) — ``/generate`` with ``logprob_start_len`` / ``top_logprobs_num`` /
``token_ids_logprob`` / ``return_text_in_logprobs`` on P->MD, P->RLD->MD (one-shot) and P->RLD,
streaming (the first event already carries them), and ``/v1/completions`` with ``echo`` +
``logprobs`` (SGLang builds the prompt part from them), streaming and not.

They come from P's reply to the first leg (P prefills the prompt; SGLang's PD decode servers
report none); short outputs keep this cheap on a 2-core machine.
"""

from __future__ import annotations

import contextlib

import pytest
from tests.support.takeover import md_takes_over

from sglang_pdd.launcher.http import post_json, stream_events

pytestmark = pytest.mark.e2e

TOL = 1e-3
PROMPT = "The history of the printing press begins"
MAX_NEW = 6
LOGPROB_FIELDS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs",
                  "output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")
PATHS = {"p_md": {"path": "p_md"}, "one_shot": {"path": "p_rld_md", "handoff_mode": "one_shot"},
         "rld_only": {"path": "p_rld_only"}}


def assert_close(got, want, where: str) -> None:
    """Same structure, same ids and texts, logprobs within TOL (``None`` where SGLang has None)."""
    if isinstance(want, float) and not isinstance(got, bool):
        assert isinstance(got, (int, float)) and abs(got - want) <= TOL, (where, got, want)
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (where, got, want)
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, f"{where}[{i}]")
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (where, got, want)
        for k in want:
            assert_close(got[k], want[k], f"{where}.{k}")
    else:
        assert got == want, (where, got, want)


def sse_events(url: str, payload: dict) -> list[dict]:
    events = list(stream_events(url, {**payload, "stream": True}))
    assert events and "error" not in events[-1], events[-1:]
    return events


def generate_body(**extra) -> dict:
    return {"text": PROMPT, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0},
            "return_logprob": True, "logprob_start_len": 3, "top_logprobs_num": 2, "token_ids_logprob": [5, 7],
            "return_text_in_logprobs": True, **extra}


@pytest.mark.parametrize("path", list(PATHS))
def test_generate_input_logprobs_equal_single_server(pdd_cluster, single_server, path):
    want = post_json(f"{single_server}/generate", generate_body())
    assert len(want["meta_info"]["input_token_logprobs"]) > 1  # from logprob_start_len 3: not empty
    with contextlib.ExitStack() as stack:
        if PATHS[path]["path"] == "p_rld_md":
            stack.enter_context(md_takes_over(pdd_cluster, 2))
        got = post_json(f"{pdd_cluster.topology.router_url}/generate", generate_body(pdd_options=PATHS[path]))
    assert got["output_ids"] == want["output_ids"], got["meta_info"].get("pdd")
    for key in LOGPROB_FIELDS:
        assert_close(got["meta_info"][key], want["meta_info"][key], f"{path} {key}")
    if path == "p_md":  # streaming: every event carries the prompt's lists, the first one included
        events = sse_events(f"{pdd_cluster.topology.router_url}/generate", generate_body(pdd_options=PATHS[path]))
        for event in (events[0], events[-1]):
            for key in ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs"):
                assert_close(event["meta_info"][key], want["meta_info"][key], f"stream {key}")
        for key in LOGPROB_FIELDS[3:]:
            assert_close(events[-1]["meta_info"][key], want["meta_info"][key], f"stream {key}")


def completion_logprobs(events: list[dict]) -> dict:
    """A streamed completion's logprobs, chunk by chunk concatenated (chunking may differ)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for event in events:
        for choice in event.get("choices", []):
            for key in out:
                out[key] += (choice.get("logprobs") or {}).get(key) or []
    return out


def test_completions_echo_with_logprobs_equal_single_server(pdd_cluster, single_server):
    body = {"model": "default", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 2}
    router = pdd_cluster.topology.router_url
    want = post_json(f"{single_server}/v1/completions", body)["choices"][0]
    got = post_json(f"{router}/v1/completions", body)["choices"][0]
    assert got["text"] == want["text"] and got["text"].startswith(PROMPT)
    assert len(want["logprobs"]["tokens"]) > 4  # the prompt's tokens, then the output's
    assert_close(got["logprobs"], want["logprobs"], "completions")
    want_stream = completion_logprobs(sse_events(f"{single_server}/v1/completions", body))
    got_events = sse_events(f"{router}/v1/completions", body)
    # SGLang reads the prompt's logprobs from the first chunk only: they must be in it
    assert len(got_events[0]["choices"][0]["logprobs"]["tokens"]) > len(want["logprobs"]["tokens"]) - 4
    assert_close(completion_logprobs(got_events), want_stream, "completions stream")
