"""End-to-end: the intra-DC TCP fallback (``--pdd-intra-dc-transport tcp``).

P and RLD run SGLang's PD code with the ``pdd`` backend on sglang-pdd's TcpTransferEngine
instead of Mooncake's (what a machine without Mooncake gets). Greedy output_ids through
P -> RLD and through P -> RLD -> MD must equal a single server's.
"""

import pytest

from sglang_pdd.launcher.http import post_json

pytestmark = pytest.mark.e2e

MAX_NEW = 24
PROMPTS = [
    "def fibonacci(n):",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "import collections\n\nclass LRUCache:\n    def __init__(self, capacity):",
]


def greedy_body(prompt: str, **extra) -> dict:
    return {"text": prompt, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}, **extra}


@pytest.fixture(scope="module")
def tcp_cluster(run_root):
    from conftest import TEST_ROUTER_ARGS, TEST_WAN_GBPS, _require_sglang
    from sglang_pdd.launcher.cluster import LocalCluster
    from sglang_pdd.launcher.topology import Topology

    _require_sglang()
    topology = Topology.on_free_ports(intra_dc_transport="tcp")
    topology.wan.rate_gbps, topology.wan.latency_ms = TEST_WAN_GBPS, 20.0
    with LocalCluster(run_root / "cluster-tcp", topology=topology, router_args=TEST_ROUTER_ARGS) as cluster:
        yield cluster


@pytest.mark.parametrize("path", ["p_rld_only", "p_rld_md"])
def test_tcp_intra_dc_path_equals_single_server(single_server, tcp_cluster, path):
    logs = tcp_cluster.procs.log_dir
    for role in ("prefill-0", "relay-0"):
        assert "intra-DC engine tcp" in (logs / f"{role}.log").read_text(), role
    handoffs = 0
    for prompt in PROMPTS:
        want = post_json(f"{single_server}/generate", greedy_body(prompt))["output_ids"]
        got = post_json(f"{tcp_cluster.topology.router_url}/generate", greedy_body(prompt, pdd_options={"path": path}))
        pdd = got["meta_info"]["pdd"]
        assert got["output_ids"] == want, (prompt, pdd)
        assert pdd["path"] == path and not pdd["fallbacks"], pdd
        handoffs += pdd["handoff_at"] is not None
    if path == "p_rld_only":
        assert handoffs == 0
