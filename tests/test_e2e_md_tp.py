"""End-to-end PDD with MD on ``--tp 2`` (P and RLD on TP 1): MD's rank r holds KV head r of the
tiny Llama's two, receives it over its own WAN link (MD's WAN port + r) from P, which cuts each
token row in two, and MD's ranks register, complete and release every room in the same
scheduler iteration. Greedy output_ids through P->MD and P->RLD->MD (a handoff mid-stream, MD
extending on both ranks) equal a plain single server's, and a second turn hits MD's DRC with
only the uncached suffix crossing the WAN."""

import pytest

from conftest import start_pdd_cluster
from sglang_pdd.launcher.http import get_json, post_json
from test_e2e_pdd import PROMPTS, assert_routes_equal_reference, assert_second_turn_sends_only_the_suffix, greedy_body

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def reference(single_server):
    return {p: post_json(f"{single_server}/generate", greedy_body(p))["output_ids"] for p in PROMPTS}


@pytest.fixture(scope="module")
def pdd_cluster_md_tp2(run_root):
    with start_pdd_cluster(run_root, "cluster-mdtp2", main_tp=2) as cluster:
        yield cluster


@pytest.mark.parametrize("options", [{"path": "p_md"}, {"path": "p_rld_md", "handoff_mode": "one_shot"}],
                         ids=lambda o: o["path"])
def test_md_tp2_output_ids_equal_single_server(pdd_cluster_md_tp2, reference, options):
    cluster = pdd_cluster_md_tp2
    stats = get_json(f"{cluster.topology.main.control_url}/pdd/stats", key=cluster.control_key)
    assert stats["tp_size"] == 2
    assert_routes_equal_reference(cluster, reference, options)
    after = get_json(f"{cluster.topology.main.control_url}/pdd/stats", key=cluster.control_key)
    assert after["rooms_failed"] == stats["rooms_failed"]


def test_md_tp2_drc_second_turn_sends_only_the_suffix(pdd_cluster_md_tp2, single_server):
    turn1_tokens, cached = assert_second_turn_sends_only_the_suffix(
        pdd_cluster_md_tp2, "def merge(a, b):\n    out = []\n    i = j = 0\n    while i < len(a):\n",
        lambda prompt: post_json(f"{single_server}/generate", greedy_body(prompt))["output_ids"])
    assert cached >= turn1_tokens - 1
