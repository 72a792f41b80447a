"""End-to-end PDD with P on ``--tp 2`` (RLD and MD on TP 1): each of P's ranks holds one of the
tiny Llama's two KV heads and sends its bytes of every token row to MD as one slice of the
room; RLD gets P's KV through SGLang's own heterogeneous-TP PD path. Greedy output_ids through
P->MD and P->RLD->MD equal a plain single server's, both ranks sent every room, and a second
turn hits MD's DRC with only the uncached suffix crossing the WAN."""

import pytest

from conftest import start_pdd_cluster
from sglang_pdd.launcher.http import get_json, post_json
from test_e2e_pdd import PROMPTS, assert_routes_equal_reference, assert_second_turn_sends_only_the_suffix, greedy_body

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def reference(single_server):
    return {p: post_json(f"{single_server}/generate", greedy_body(p))["output_ids"] for p in PROMPTS}


@pytest.fixture(scope="module")
def pdd_cluster_tp2(run_root):
    with start_pdd_cluster(run_root, "cluster-ptp2", prefill_tp=2) as cluster:
        yield cluster


def p_rank_stats(cluster):
    """Each P rank's control API (port + rank): its WAN fan-out's counters."""
    from sglang_pdd.router.backends import prefill_rank_url

    url = cluster.topology.prefill.control_url
    return [get_json(f"{prefill_rank_url(url, r)}/pdd/stats", key=cluster.control_key) for r in range(2)]


@pytest.mark.parametrize("options", [{"path": "p_md"}, {"path": "p_rld_md", "handoff_mode": "one_shot"}],
                         ids=lambda o: o["path"])
def test_p_tp2_output_ids_equal_single_server(pdd_cluster_tp2, reference, options):
    before = p_rank_stats(pdd_cluster_tp2)
    assert [s["tp_rank"] for s in before] == [0, 1] and all(s["tp_size"] == 2 and s["sends_wan"] for s in before)
    assert_routes_equal_reference(pdd_cluster_tp2, reference, options)
    after = p_rank_stats(pdd_cluster_tp2)
    for rank, (b, a) in enumerate(zip(before, after)):  # every room came from both ranks
        assert a.get("finished", 0) - b.get("finished", 0) >= (len(PROMPTS) if options["path"] == "p_md" else 1), \
            (rank, b, a)
        assert a.get("failed", 0) == b.get("failed", 0) and a.get("aborted", 0) == b.get("aborted", 0), (rank, a)


def test_p_tp2_drc_second_turn_sends_only_the_suffix(pdd_cluster_tp2, single_server):
    turn1_tokens, cached = assert_second_turn_sends_only_the_suffix(
        pdd_cluster_tp2, "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n",
        lambda prompt: post_json(f"{single_server}/generate", greedy_body(prompt))["output_ids"])
    assert cached >= turn1_tokens - 1
