"""End-to-end PDD on an MLA model (tiny DeepSeek-V2 style, artifacts/tiny-deepseek): P's pool
and MD's pool hold one latent buffer per layer (``kv_lora_rank + qk_rope_head_dim`` wide), and
the WAN moves that. Greedy output_ids through P->MD and P->RLD->MD (handoff mid-stream) equal a
plain single server's; a second turn hits MD's DRC and only the uncached suffix crosses the WAN.

One single server (stopped first) and one cluster, a few short requests: CI cost stays small.
"""


import pytest

from tests.conftest import _require_sglang, plain_server, start_pdd_cluster
from tests.support.pdd_requests import (TURN1, assert_routes_equal_reference, assert_second_turn_sends_only_the_suffix,
                                        next_turn, route, single_server_reference)

# the full tier (scripts/test.sh --full): its own servers, beyond CI's representative tier
pytestmark = [pytest.mark.e2e, pytest.mark.full, pytest.mark.own_cluster]

PROMPTS = [
    "def fibonacci(n):",
    "import collections\n\nclass LRUCache:\n    def __init__(self, capacity):",
    "The quick brown fox jumps over the lazy dog. " * 4,
]


@pytest.fixture(scope="module")
def mla_model():
    return _require_sglang(mla=True)


@pytest.fixture(scope="module")
def mla_reference(run_root, mla_model, servers_under_test):
    """Greedy output_ids of a plain single server on the MLA model, stopped before the cluster
    starts (two servers' worth of CPU less)."""
    servers_under_test.stop()
    with plain_server(run_root, mla_model, name="single-mla", extra_args=()) as url:
        return single_server_reference(url, PROMPTS)


@pytest.fixture(scope="module")
def mla_cluster(run_root, mla_model, mla_reference, servers_under_test):
    return servers_under_test.get("cluster-mla", lambda: start_pdd_cluster(run_root, "cluster-mla",
                                                                           model_path=mla_model, extra_args=()))


@pytest.mark.parametrize("options", [{"path": "p_md"}, {"path": "p_rld_md", "handoff_mode": "one_shot"}],
                         ids=lambda o: o["path"])
def test_mla_output_ids_equal_single_server(mla_cluster, mla_reference, options):
    assert_routes_equal_reference(mla_cluster, {p: mla_reference[p] for p in PROMPTS}, options)


def test_mla_drc_second_turn_sends_only_the_suffix(mla_cluster, mla_reference):
    turn1_tokens, cached = assert_second_turn_sends_only_the_suffix(mla_cluster, TURN1, mla_reference.__getitem__,
                                                                    next_turn)
    assert cached >= turn1_tokens - 1  # turn 1's prompt (the last token may be recomputed)


def test_mla_pools_are_latent_on_both_ends(mla_cluster):
    route(mla_cluster, PROMPTS[0], path="p_md")  # P logs its pool layout at its first request
    logs = mla_cluster.procs.log_dir
    prefill, main = (logs / "prefill-0.log").read_text(errors="replace"), (logs / "main-0.log").read_text(errors="replace")
    assert "WAN fan-out: KV pool kind=mla buffers=2 " in prefill
    assert "KV pool kind=mla buffers=2 " in main
