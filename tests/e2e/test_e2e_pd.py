"""End-to-end: real SGLang prefill + decode servers, KV over Mooncake TCP, through the router.

Greedy output_ids through P -> RLD (PD across a real Mooncake transfer) must equal a single
plain server's, for several prompts including ones that share a prefix (radix hits on P).
"""

import pytest

from sglang_pdd.launcher.http import post_json

pytestmark = pytest.mark.e2e

PROMPTS = [
    "def fibonacci(n):",
    "import collections\n\nclass LRUCache:\n    def __init__(self, capacity):",
    "import collections\n\nclass LRUCache:\n    def get(self, key):",  # shares a prefix with the one above
    "The quick brown fox jumps over the lazy dog. " * 6,
    "import collections\n\nclass LRUCache:\n    def __init__(self, capacity):",  # exact repeat: full prefix hit
]


def greedy(url: str, text: str, max_new_tokens: int = 32, **extra) -> dict:
    return post_json(f"{url}/generate", {
        "text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}, **extra})


def test_pd_output_ids_equal_single_server(single_server, pdd_cluster):
    router = pdd_cluster.topology.router_url
    for prompt in PROMPTS:
        ref = greedy(single_server, prompt)
        got = greedy(router, prompt, pdd_options={"path": "p_rld_only"})  # plain PD: P, then RLD decodes it all
        pdd = got["meta_info"]["pdd"]
        assert len(ref["output_ids"]) == 32
        assert got["output_ids"] == ref["output_ids"], prompt
        assert got["meta_info"]["prompt_tokens"] == ref["meta_info"]["prompt_tokens"]
        assert got["meta_info"]["completion_tokens"] == 32
        assert pdd["path"] == "p_rld_only" and not pdd["fallbacks"] and pdd["md_tokens"] == 0, pdd


def test_outputs_differ_across_prompts(single_server):
    """Guards the test above: the tiny model must not emit the same tokens whatever the prompt."""
    outs = {tuple(greedy(single_server, p)["output_ids"]) for p in PROMPTS[:4]}
    assert len(outs) == 4
