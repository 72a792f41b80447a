"""End-to-end: the intra-DC TCP fallback (``--pdd-intra-dc-transport tcp``).

P and RLD run SGLang's PD code with the ``pdd`` backend on sglang-pdd's TcpTransferEngine
instead of Mooncake's (what a machine without Mooncake gets). Greedy output_ids through
P -> RLD and through P -> RLD -> MD must equal a single server's.
"""

import pytest

from sglang_pdd.launcher.http import post_json

# the full tier (scripts/test.sh --full): its own servers, beyond CI's representative tier
pytestmark = [pytest.mark.e2e, pytest.mark.full, pytest.mark.own_cluster]

MAX_NEW = 24
PROMPTS = [
    "def fibonacci(n):",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "import collections\n\nclass LRUCache:\n    def __init__(self, capacity):",
]


def greedy_body(prompt: str, **extra) -> dict:
    return {"text": prompt, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}, **extra}


@pytest.fixture(scope="module")
def tcp_cluster(run_root, servers_under_test):
    from tests.conftest import start_pdd_cluster

    return servers_under_test.get("cluster-tcp", lambda: start_pdd_cluster(run_root, "cluster-tcp",
                                                                           intra_dc_transport="tcp"))


@pytest.mark.parametrize("path", ["p_rld_only", "p_rld_md"])
def test_tcp_intra_dc_path_equals_single_server(single_server, tcp_cluster, path):
    from tests.support.takeover import assert_taken_over
    from tests.support.pdd_requests import RELAY_MAX_NEW, hand_off_after

    handoffs, logs = [], tcp_cluster.procs.log_dir
    for role in ("prefill-0", "relay-0"):
        assert "intra-DC engine tcp" in (logs / f"{role}.log").read_text(), role
    for prompt in PROMPTS:
        if path == "p_rld_md":  # MD takes over after RLD's third token (takeover.py)
            want = post_json(f"{single_server}/generate", {"text": prompt, "sampling_params": {
                "max_new_tokens": RELAY_MAX_NEW, "temperature": 0}})["output_ids"]
            got = hand_off_after(tcp_cluster, prompt, 3, handoff_mode="one_shot")
        else:
            want = post_json(f"{single_server}/generate", greedy_body(prompt))["output_ids"]
            got = post_json(f"{tcp_cluster.topology.router_url}/generate",
                            greedy_body(prompt, pdd_options={"path": path}))
        pdd = got["meta_info"]["pdd"]
        assert got["output_ids"] == want, (prompt, pdd)
        assert pdd["path"] == path and not pdd["fallbacks"], pdd
        if path == "p_rld_only":
            assert pdd["handoff_at"] is None, pdd
        elif pdd["handoff_at"] is not None:
            assert pdd["md_tokens"] == len(want) - pdd["handoff_at"] > 0, pdd
        handoffs.append(pdd["handoff_at"])
    if path == "p_rld_md":
        assert_taken_over(handoffs, len(PROMPTS), 3)
