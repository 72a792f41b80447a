"""End-to-end: P's late WAN destinations on real servers (P's control API).

The router's concurrent registration is covered by test_e2e_pdd.py (every P->RLD->MD request
of the cluster uses it); here the P side alone, driven by hand: a destination posted after P
has finished the prefill still gets the KV to MD (P held the pages), and a promised
destination that never comes costs P only ``--pdd-wan-destination-wait-ms``.
"""

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from tests.support.waiting import wait_until

from sglang_pdd.control.auth import ROLE_P
from sglang_pdd.launcher.http import call_json, get_json, post_json

pytestmark = pytest.mark.e2e

PROMPT = list(range(300, 340))


def _delete(url: str, key: bytes) -> None:
    status, reply = call_json("DELETE", url, timeout=10, key=key)
    assert status == 200, reply


def _pd_body(topo, room: int, max_new: int) -> dict:
    """The P/RLD request the router sends when MD's answer is still pending."""
    sampling = {"temperature": 0, "max_new_tokens": max_new,
                "custom_params": {"pdd_room": room, "pdd_wan_expected": True}}
    return {"input_ids": PROMPT, "sampling_params": sampling, "rid": f"late-{room:x}",
            "bootstrap_host": "127.0.0.1", "bootstrap_port": topo.prefill.bootstrap_port, "bootstrap_room": room}


def _run_pd(topo, body: dict) -> list[int]:
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(post_json, f"{topo.prefill.url}/generate", body)
        r = pool.submit(post_json, f"{topo.relay.url}/generate", body)
        p.result()
        return r.result()["output_ids"]


def _p_stats(cluster) -> dict:
    return get_json(f"{cluster.topology.prefill.control_url}/pdd/stats", key=cluster.control_key, role=ROLE_P)


def test_destination_posted_after_prefill_still_delivers_the_kv(pdd_cluster, single_server):
    topo, key = pdd_cluster.topology, pdd_cluster.control_key
    want = post_json(f"{single_server}/generate", {"input_ids": PROMPT,
                                                   "sampling_params": {"temperature": 0, "max_new_tokens": 4}})
    room = random.getrandbits(62)
    before = _p_stats(pdd_cluster)
    body = _pd_body(topo, room, 4)
    with ThreadPoolExecutor(2) as pool:
        wan_binding = pool.submit(post_json, f"{topo.prefill.url}/generate", body)
        # RLD finishes the request before anybody tells P where MD is; P's own reply waits
        # (it still holds the KV, up to --pdd-wan-destination-wait-ms).
        assert pool.submit(post_json, f"{topo.relay.url}/generate", body).result()["output_ids"] == want["output_ids"]
        assert not wan_binding.done()
        reg = post_json(f"{topo.main.control_url}/pdd/rooms", {"room": room, "token_ids": PROMPT}, key=key)
        try:
            dest = {"bootstrap_room": room, "md_room": room, "wan_peer": f"127.0.0.1:{topo.wan.listen_port}",
                    "md_prefix_len": int(reg["cached_tokens"])}
            assert post_json(f"{topo.prefill.control_url}/pdd/wan_destinations", dest, key=key) == {"accepted": True}
            ready = get_json(f"{topo.main.control_url}/pdd/rooms/{room}/ready?timeout_s=30", timeout=40, key=key)
            assert ready["status"] == "ready", ready
            wan_binding.result()
            after = _p_stats(pdd_cluster)
            assert after.get("late", 0) == before.get("late", 0) + 1
            assert after.get("destination_wait_expired", 0) == before.get("destination_wait_expired", 0)
            # a second destination for the same request is refused, clearly
            status, reply = call_json("POST", f"{topo.prefill.control_url}/pdd/wan_destinations", dest, key=key)
            assert status == 409 and "already" in reply["error"]
        finally:
            _delete(f"{topo.main.control_url}/pdd/rooms/{room}", key)


@pytest.mark.full  # waits out P's hold; the expiry itself is unit-tested (test_prefill_control)
def test_promised_destination_that_never_comes_only_delays_ps_release(pdd_cluster):
    from tests.conftest import TEST_DESTINATION_WAIT_MS

    topo = pdd_cluster.topology
    before = _p_stats(pdd_cluster).get("destination_wait_expired", 0)
    room = random.getrandbits(62)
    out = _run_pd(topo, _pd_body(topo, room, 3))
    assert len(out) == 3  # RLD served the request regardless
    assert wait_until(lambda: _p_stats(pdd_cluster).get("destination_wait_expired", 0) == before + 1,
                 TEST_DESTINATION_WAIT_MS / 1000 + 10)
    assert wait_until(lambda: _p_stats(pdd_cluster)["waiting_senders"] == 0, 5)
    # a destination that comes after P gave up is refused at once (the router then falls back
    # instead of waiting for MD's KV until --wan-timeout-s)
    dest = {"bootstrap_room": room, "md_room": room, "wan_peer": f"127.0.0.1:{topo.wan.listen_port}",
            "md_prefix_len": 0}
    status, reply = call_json("POST", f"{topo.prefill.control_url}/pdd/wan_destinations", dest,
                              key=pdd_cluster.control_key)
    assert status == 410 and "no longer holds" in reply["error"]


def test_withdrawn_destination_frees_p_at_once(pdd_cluster):
    topo = pdd_cluster.topology
    before = _p_stats(pdd_cluster).get("destination_wait_expired", 0)
    room = random.getrandbits(62)
    _delete(f"{topo.prefill.control_url}/pdd/wan_destinations/{room}", pdd_cluster.control_key)  # router gave up on MD
    assert len(_run_pd(topo, _pd_body(topo, room, 3))) == 3
    assert _p_stats(pdd_cluster).get("destination_wait_expired", 0) == before  # no wait: it knew already
