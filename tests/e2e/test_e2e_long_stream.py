"""A long streamed output with many top logprobs, through the router on every path, equals one
server's (full tier).

SGLang streams cumulatively: each event repeats the whole output and its logprobs so far, so
with 40 top logprobs the last events of a 500-token request are ~600 KB lines (the stream as
a whole ~150 MB). The router
reads each backend event whole, up to the bound its request allows (router/backends/reply_limits.py),
and must carry such a stream to the end like one server does, on P->MD, P->RLD->MD (one-shot
and catch-up) and P->RLD only.
"""

from __future__ import annotations

import json

import pytest
import requests

pytestmark = [pytest.mark.e2e, pytest.mark.full]

MAX_NEW = 500
TOP = 40
# The prompt is the first of these whose greedy output has no near-tie at any position (best two
# tokens more than MIN_GAP apart in the single server's own top logprobs): then the router's output
# must equal it exactly, whatever pass (decode step or MD's extend) computed each position.
PROMPTS = ["def long_stream(events):", "class Relay:\n    def __init__(self):", "import itertools\n\n"]
MIN_GAP = 1e-3
LOGPROB_TOL = 1e-3
PATHS = {
    "p_md": {"path": "p_md"},
    "one_shot": {"path": "p_rld_md", "handoff_mode": "one_shot"},
    "catch_up": {"path": "p_rld_md", "handoff_mode": "catch_up", "catch_up_threshold": 16},
    "rld_only": {"path": "p_rld_only"},
}


def body(prompt: str, **extra) -> dict:
    return {"text": prompt, "stream": True, "return_logprob": True, "top_logprobs_num": TOP,
            "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}, **extra}


def stream(url: str, payload: dict) -> tuple[dict, int, int]:
    """The last event of a streamed /generate, the number of events and the longest line."""
    last, events, longest = None, 0, 0
    with requests.post(f"{url}/generate", json=payload, stream=True, timeout=600) as resp:
        assert resp.status_code == 200, resp.text[:300]
        for line in resp.iter_lines():
            longest = max(longest, len(line))
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            last = json.loads(line[5:])
            assert "error" not in last, str(last)[:500]
            events += 1
    return last, events, longest


def top2_gap(entries: list) -> float:
    values = sorted((e[0] for e in entries), reverse=True)
    return values[0] - values[1]


@pytest.fixture(scope="module")
def reference(single_server):
    for prompt in PROMPTS:
        want, _, longest = stream(single_server, body(prompt))
        gaps = [top2_gap(top) for top in want["meta_info"]["output_top_logprobs"]]
        if min(gaps) > MIN_GAP:
            assert longest > 512 << 10  # a stream of lines longer than any library default
            return prompt, want
    pytest.fail(f"every candidate prompt has a near-tie within {MAX_NEW} tokens; add another prompt")


@pytest.mark.parametrize("path", list(PATHS))
def test_long_stream_with_top_logprobs_equals_single_server(pdd_cluster, reference, path):
    prompt, want = reference
    got, events, longest = stream(pdd_cluster.topology.router_url, body(prompt, pdd_options=PATHS[path]))
    assert got["output_ids"] == want["output_ids"]
    meta, want_meta = got["meta_info"], want["meta_info"]
    assert meta["finish_reason"] == want_meta["finish_reason"]
    assert meta["completion_tokens"] == MAX_NEW
    assert meta["pdd"]["path"] == PATHS[path]["path"] and not meta["pdd"]["fallbacks"], meta["pdd"]
    if path != "rld_only":
        assert meta["pdd"]["handoff_at"] is not None
    for i, (g, w) in enumerate(zip(meta["output_token_logprobs"], want_meta["output_token_logprobs"], strict=True)):
        assert g[1] == w[1] and abs(g[0] - w[0]) <= LOGPROB_TOL, (path, i, g, w)
    for i, (g, w) in enumerate(zip(meta["output_top_logprobs"], want_meta["output_top_logprobs"], strict=True)):
        assert len(g) == TOP and g[0][1] == w[0][1] and abs(g[0][0] - w[0][0]) <= LOGPROB_TOL, (path, i)
    assert longest > 512 << 10 and events > 1
