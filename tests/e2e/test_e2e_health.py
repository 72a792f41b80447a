"""End-to-end: the router's backend health on real servers. An operator drains MD under load:
the request MD is decoding finishes there, new ones are served by P->RLD meanwhile (same
tokens as one server), and MD takes requests again once undrained."""

import threading

import pytest
from tests.support.takeover import stream_final

from sglang_pdd.launcher.http import get_json, post_json

# the full tier (scripts/test.sh --full): beyond CI's representative tier
pytestmark = [pytest.mark.e2e, pytest.mark.full]

PROMPT = "import collections\n\nclass LRUCache:\n    def get(self, key):"
LONG, SHORT = 160, 24


def greedy(prompt: str, max_new: int, **extra) -> dict:
    return {"text": prompt, "sampling_params": {"max_new_tokens": max_new, "temperature": 0}, **extra}


def test_a_drained_md_finishes_its_requests_and_new_ones_go_to_rld(pdd_cluster, single_server):
    router, md = pdd_cluster.topology.router_url, pdd_cluster.topology.main.url
    want_long = post_json(f"{single_server}/generate", greedy(PROMPT, LONG))["output_ids"]
    want_short = post_json(f"{single_server}/generate", greedy(PROMPT, SHORT))["output_ids"]
    drained = threading.Event()

    def drain_once_md_decodes(ids):  # MD has taken over (p_md: from the first token) and decodes
        if len(ids) >= 5 and not drained.is_set():
            reply = post_json(f"{router}/pdd/backends/drain", {"url": md})
            assert reply["draining"] and reply["roles"] == ["main"] and reply["inflight"] == 1, reply
            drained.set()

    try:
        last = stream_final(router, greedy(PROMPT, LONG, pdd_options={"path": "p_md"}), drain_once_md_decodes)
        assert drained.is_set()
        pdd = last["meta_info"]["pdd"]
        assert last["output_ids"] == want_long and pdd["handoff_at"] == 1 and not pdd["fallbacks"], pdd

        during = post_json(f"{router}/generate", greedy(PROMPT, SHORT))
        pdd = during["meta_info"]["pdd"]
        assert during["output_ids"] == want_short, pdd
        assert pdd["path"] == "p_rld_only" and pdd["fallbacks"] == ["md_unavailable: every MD is failing or draining"]
        mains = [b for b in get_json(f"{router}/pdd/backends")["backends"] if b["role"] == "main"]
        assert [(b["draining"], b["pickable"]) for b in mains] == [(True, False)]
        assert get_json(f"{router}/health")["status"] == "ok"  # P and RLD still serve
    finally:
        post_json(f"{router}/pdd/backends/drain", {"url": md, "draining": False})
    after = post_json(f"{router}/generate", greedy(PROMPT, SHORT, pdd_options={"path": "p_md"}))
    assert after["output_ids"] == want_short and after["meta_info"]["pdd"]["handoff_at"] == 1
