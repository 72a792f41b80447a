"""End-to-end: a client that goes away frees every leg, whatever phase its request is in.

Each test starts a long streamed request (RLD or MD would decode for many seconds), drops the
connection at one phase (before P answers, while RLD streams, with the handoff on MD's queue,
while MD streams) and then checks that P, RLD and MD hold no request, no room and no WAN
destination. A phase is reached by pausing a server in place (SGLang's /pause_generation: it
still takes and aborts requests, decodes nothing), not by timing.
"""

import contextlib
import http.client
import json
import time
import urllib.request
from urllib.parse import urlsplit

import pytest
from tests.support.takeover import md_takes_over
from tests.support.pdd_requests import paused
from tests.support.waiting import wait_until

from sglang_pdd.control.auth import ROLE_MD, ROLE_P
from sglang_pdd.launcher.http import get_json, post_json

# CI's representative tier drops a client while RLD streams and with the handoff on MD's queue
# (the race an abort used to lose); the other two phases are in the full tier.
pytestmark = pytest.mark.e2e

PROMPT = "import collections\n\nclass LRUCache:\n    def __init__(self, capacity):"
# Left alone, this is 10-20 s of decoding on RLD or MD here.
LONG = 3000
# Freed "at once": the router aborts every leg when the client goes; the margin is for a loaded
# 2-core machine, far below the LONG request's own run time.
FREED_WITHIN_S = 5.0


def queued(server_url: str) -> int:
    """Requests a server holds: running, waiting, and (PD) bootstrap / prealloc / transfer queues."""
    loads = get_json(f"{server_url}/v1/loads?include=core")["loads"]
    return sum(int(load.get("core", load).get("num_running_reqs", 0)) + int(load.get("core", load).get("num_waiting_reqs", 0))
               for load in loads)


def md_stats(cluster) -> dict:
    return get_json(f"{cluster.topology.main.control_url}/pdd/stats", key=cluster.control_key, role=ROLE_MD)


def held(cluster) -> dict:
    """Everything a request can still hold on P, RLD and MD; all zero when it is freed."""
    topo, key = cluster.topology, cluster.control_key
    md = md_stats(cluster)
    p = get_json(f"{topo.prefill.control_url}/pdd/stats", key=key, role=ROLE_P)
    return {"p": queued(topo.prefill.url), "rld": queued(topo.relay.url), "md": queued(topo.main.url),
            "md_rooms": md["open_rooms"], "p_waiting_destinations": p["waiting_destinations"],
            "p_waiting_senders": p["waiting_senders"]}


def disconnects(cluster) -> float:
    """The router's count of clients gone before their response ended."""
    text = urllib.request.urlopen(f"{cluster.topology.router_url}/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("pdd:client_disconnects_total"))


def nothing_held(cluster) -> bool:
    """Nothing held, twice 0.1 s apart: a request on its way from a server's front end to its
    scheduler is in no queue for a moment, and one poll can fall in it."""
    return not any(held(cluster).values()) and (time.sleep(0.1) or not any(held(cluster).values()))


def assert_freed(cluster) -> None:
    """Nothing held within FREED_WITHIN_S (else fails, showing what still is)."""
    if not wait_until(lambda: nothing_held(cluster), FREED_WITHIN_S, poll_s=0.05):
        pytest.fail(f"{FREED_WITHIN_S} s after the client went: {held(cluster)}")


class DroppableStream:
    """A streamed /generate through the router that the test reads event by event and then
    drops (the socket shut down, as a client that goes away)."""

    def __init__(self, router_url: str, options: dict, max_new: int = LONG, **extra):
        parts = urlsplit(router_url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
        body = {"text": PROMPT, "stream": True, "pdd_options": options, **extra,
                "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
        self.conn.request("POST", "/generate", body=json.dumps(body), headers={"Content-Type": "application/json"})
        self.resp = None
        self.last: dict = {}

    def read_tokens(self, n: int) -> dict:
        """Reads until the client holds ``n`` output tokens (or the stream ends); the last event.
        Counted in tokens, not events: RLD's first event carries P's token and its own first one,
        and SGLang merges the tokens a slow reader has not taken yet into one event."""
        if self.resp is None:
            self.resp = self.conn.getresponse()
            assert self.resp.status == 200, self.resp.read()
        while len(self.last.get("output_ids", ())) < n:
            line = self.resp.fp.readline()
            if not line or line.strip() == b"data: [DONE]":
                break
            if line.startswith(b"data:"):
                self.last = json.loads(line[5:])
                assert "error" not in self.last, line
        return self.last

    def drop(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.sock.shutdown(2)
        self.conn.close()


@pytest.fixture
def cluster(pdd_cluster):
    assert wait_until(lambda: nothing_held(pdd_cluster), 60), held(pdd_cluster)
    yield pdd_cluster
    from tests.conftest import TEST_WAN_GBPS

    pdd_cluster.wan_control("heal")
    pdd_cluster.wan_control("link", rate_gbps=TEST_WAN_GBPS)


@pytest.mark.full
def test_dropped_before_p_answers(cluster):
    topo = cluster.topology
    with paused(topo.prefill.url):
        gone = disconnects(cluster)
        stream = DroppableStream(topo.router_url, {"path": "p_rld_md"})
        # P's front end holds the request while paused; RLD waits for P's KV
        assert wait_until(lambda: queued(topo.relay.url) > 0, 30), held(cluster)
        stream.drop()
        assert wait_until(lambda: disconnects(cluster) > gone, 30)
    assert_freed(cluster)


def test_dropped_while_rld_streams(cluster):
    cluster.wan_control("stall", seconds=60)  # MD's KV held: RLD alone decodes
    stream = DroppableStream(cluster.topology.router_url, {"path": "p_rld_md", "handoff_mode": "one_shot"})
    stream.read_tokens(3)
    assert queued(cluster.topology.relay.url) == 1
    stream.drop()
    assert_freed(cluster)


def test_abort_request_while_rld_streams(cluster):
    cluster.wan_control("stall", seconds=60)
    stream = DroppableStream(cluster.topology.router_url, {"path": "p_rld_md"}, rid="abort-me")
    stream.read_tokens(3)
    assert post_json(f"{cluster.topology.router_url}/abort_request", {"rid": "abort-me"}) == {"aborted": 1}
    last = stream.read_tokens(LONG)  # the stream ends, SGLang's way: finish_reason abort
    assert last["meta_info"]["finish_reason"]["type"] == "abort" and len(last["output_ids"]) < LONG, last["meta_info"]
    stream.drop()
    assert_freed(cluster)


def test_dropped_with_the_handoff_on_mds_queue(cluster):
    topo = cluster.topology
    with md_takes_over(cluster, 3, automatic=False) as let_through, paused(topo.main.url):
        stream = DroppableStream(topo.router_url, {"path": "p_rld_md", "handoff_mode": "one_shot"})
        stream.read_tokens(3)
        handoffs, abandoned = (md_stats(cluster).get(k, 0) for k in ("handoffs", "handoffs_abandoned"))
        let_through()  # RLD held, MD's KV let through: the router hands off to a paused MD
        assert wait_until(lambda: md_stats(cluster).get("handoffs", 0) > handoffs, 30), held(cluster)
        gone = disconnects(cluster)
        stream.drop()
        assert wait_until(lambda: disconnects(cluster) > gone, 30)  # the router's aborts meet a paused MD
    # resumed, MD runs the continuation until its control API finds the router gone and aborts it
    assert wait_until(lambda: md_stats(cluster).get("handoffs_abandoned", 0) > abandoned, 30), held(cluster)
    assert_freed(cluster)


@pytest.mark.full
def test_dropped_while_md_streams(cluster):
    stream = DroppableStream(cluster.topology.router_url, {"path": "p_md"})
    stream.read_tokens(10)
    assert queued(cluster.topology.main.url) == 1
    stream.drop()
    assert_freed(cluster)
