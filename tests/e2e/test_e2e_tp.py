"""End-to-end PDD with tensor parallelism on either end of the WAN, on the tiny Llama (two KV
heads), one cluster at a time:

* P on ``--tp 2``, RLD and MD on TP 1: each P rank holds one KV head and sends its bytes of every
  token row to MD as one slice of the room; RLD gets P's KV through SGLang's own
  heterogeneous-TP PD path;
* MD on ``--tp 2``, P and RLD on TP 1: MD's rank r holds KV head r and receives it on its own WAN
  link (MD's WAN port + r); P cuts each row in two, one leg per MD rank; MD's ranks register,
  complete and release every room in the same scheduler iteration.

Greedy output_ids through P->MD and P->RLD->MD (a handoff mid-stream) equal a plain single
server's, every room lands on every rank, and a second turn hits MD's DRC with only the uncached
suffix crossing the WAN."""

import pytest

from tests.conftest import start_pdd_cluster
from sglang_pdd.control.auth import ROLE_P
from sglang_pdd.launcher.http import get_json, post_json
from tests.support.pdd_requests import PROMPTS, assert_routes_equal_reference, assert_second_turn_sends_only_the_suffix, greedy_body
from tests.support.waiting import wait_until

# the full tier (scripts/test.sh --full): its own servers, beyond CI's representative tier
pytestmark = [pytest.mark.e2e, pytest.mark.full, pytest.mark.own_cluster]


@pytest.fixture(scope="module")
def reference(single_server):
    return {p: post_json(f"{single_server}/generate", greedy_body(p))["output_ids"] for p in PROMPTS}


@pytest.fixture(scope="module", params=[(2, 1), (1, 2)], ids=["p_tp2", "md_tp2"])
def tp_cluster(run_root, servers_under_test, request):
    """(P's TP, MD's TP); one at a time: the next configuration stops this one."""
    prefill_tp, main_tp = request.param
    name = f"cluster-tp{prefill_tp}{main_tp}"
    cluster = servers_under_test.get(name, lambda: start_pdd_cluster(run_root, name, prefill_tp=prefill_tp,
                                                                     main_tp=main_tp))
    cluster.tp = request.param
    return cluster


def p_rank_stats(cluster):
    """Each P rank's control API (port + rank): its WAN fan-out's counters."""
    from sglang_pdd.router.backends.clients import prefill_rank_url

    url = cluster.topology.prefill.control_url
    return [get_json(f"{prefill_rank_url(url, r)}/pdd/stats", key=cluster.control_key, role=ROLE_P)
            for r in range(cluster.tp[0])]


def md_stats(cluster):
    return get_json(f"{cluster.topology.main.control_url}/pdd/stats", key=cluster.control_key)


@pytest.mark.parametrize("options", [{"path": "p_md"}, {"path": "p_rld_md", "handoff_mode": "one_shot"}],
                         ids=lambda o: o["path"])
def test_tp_output_ids_equal_single_server(tp_cluster, reference, options):
    prefill_tp, main_tp = tp_cluster.tp
    p_before, md_before = p_rank_stats(tp_cluster), md_stats(tp_cluster)
    assert [s["tp_rank"] for s in p_before] == list(range(prefill_tp))
    assert all(s["tp_size"] == prefill_tp for s in p_before) and md_before["tp_size"] == main_tp
    assert_routes_equal_reference(tp_cluster, reference, options)
    want = len(PROMPTS) if options["path"] == "p_md" else 1

    def every_p_rank_sent() -> bool:  # a P rank counts its room just after MD has it: wait
        return all(a.get("finished", 0) - b.get("finished", 0) >= want
                   for b, a in zip(p_before, p_rank_stats(tp_cluster)))

    assert wait_until(every_p_rank_sent, 30), (p_before, p_rank_stats(tp_cluster))
    p_after, md_after = p_rank_stats(tp_cluster), md_stats(tp_cluster)
    for rank, (b, a) in enumerate(zip(p_before, p_after)):  # every room came from every P rank
        assert a.get("failed", 0) == b.get("failed", 0) and a.get("aborted", 0) == b.get("aborted", 0), (rank, a)
    assert md_after["rooms_failed"] == md_before["rooms_failed"]  # ready on every MD rank


def test_tp_drc_second_turn_sends_only_the_suffix(tp_cluster, single_server):
    turn1_tokens, cached = assert_second_turn_sends_only_the_suffix(
        tp_cluster, "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n",
        lambda prompt: post_json(f"{single_server}/generate", greedy_body(prompt))["output_ids"])
    assert cached >= turn1_tokens - 1
