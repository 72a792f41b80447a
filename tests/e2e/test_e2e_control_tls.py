"""End-to-end: the control plane on mutual TLS (``--pdd-control-tls-*`` on P and MD, the
router's ``--control-tls-*``, https CONTROL_URLs), on real servers. Requests hand off to MD
(its registration, readiness and handoff stream over TLS, P's late WAN destination too) and
give the same greedy output as P -> RLD alone; the control ports refuse plain HTTP.
"""

import pytest
from tests.support.pki import make_ca, make_leaf, needs_openssl

from sglang_pdd.launcher.http import call_json, post_json

# the full tier (scripts/test.sh --full): its own servers, beyond CI's representative tier
pytestmark = [pytest.mark.e2e, pytest.mark.full, needs_openssl, pytest.mark.own_cluster]

MAX_NEW = 24
PROMPTS = ["def fibonacci(n):", "The quick brown fox jumps over the lazy dog. " * 4]


@pytest.fixture(scope="module")
def tls_cluster(run_root, servers_under_test):
    from tests.conftest import start_pdd_cluster

    from sglang_pdd.launcher.topology import ControlTlsFiles

    def start():
        d = run_root / "control-pki"
        d.mkdir(exist_ok=True)
        make_ca(d, "ca")
        files = ControlTlsFiles(*make_leaf(d, "servers", "ca", "IP:127.0.0.1"),
                                *make_leaf(d, "router", "ca", "DNS:router"), str(d / "ca.pem"))
        return start_pdd_cluster(run_root, "cluster-control-tls", control_tls=files)

    return servers_under_test.get("cluster-control-tls", start)


def route(cluster, prompt: str, path: str) -> dict:
    return post_json(f"{cluster.topology.router_url}/generate", {
        "text": prompt, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0},
        "pdd_options": {"path": path}})


def test_requests_hand_off_to_md_over_the_tls_control_plane(tls_cluster):
    topo = tls_cluster.topology
    assert topo.main.control_url.startswith("https://") and topo.prefill.control_url.startswith("https://")
    for prompt in PROMPTS:
        want = route(tls_cluster, prompt, "p_rld_only")["output_ids"]
        got = route(tls_cluster, prompt, "p_md")
        pdd = got["meta_info"]["pdd"]
        assert got["output_ids"] == want, (prompt, pdd)
        assert pdd["path"] == "p_md" and not pdd["fallbacks"] and pdd["md_tokens"] > 0, pdd


def test_the_control_ports_refuse_plain_http(tls_cluster):
    topo = tls_cluster.topology
    for url in (topo.main.control_url, topo.prefill.control_url):
        with pytest.raises(OSError):
            call_json("GET", url.replace("https://", "http://") + "/health", timeout=10)
