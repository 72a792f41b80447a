"""End-to-end: two P, one RLD and two MD behind one router, with active /health probes and
breakers. Sessions stick to the P and MD that hold their prefix while sessions spread over both;
an MD killed mid-stream is finished for by RLD and its breaker keeps new requests off it; a P
killed is retried around before the first token and then left out. Every output is a single
SGLang server's (greedy, float32)."""

import contextlib
import os
import signal
import threading
import time

import pytest
from tests.conftest import EXACT_ARGS, TEST_DESTINATION_WAIT_MS, TEST_ROUTER_ARGS, _require_sglang
from tests.support.waiting import wait_until

from sglang_pdd.launcher.http import get_json, post_json, stream_events

# the full tier (scripts/test.sh --full): beyond CI's representative tier
pytestmark = [pytest.mark.e2e, pytest.mark.full, pytest.mark.own_cluster]

# Probes every 0.5 s and two failures open a breaker: a dead server is out within a second or
# two; the long cooldown keeps it out for the rest of the module (no half-open trials).
HEALTH_ARGS = ["--health-check-interval-s", "0.5", "--breaker-failures", "2", "--breaker-cooldown-s", "30"]

SEEDS = [
    "def merge_sort(items):\n    if len(items) <= 1:\n        return items\n    middle = len(items) // 2\n",
    "The history of the printing press begins in the fifteenth century, when movable type",
    "SELECT customers.name, SUM(orders.total) FROM customers JOIN orders ON customers.id =",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old",
]
USER_TURN = "\nContinue, and explain each step in detail:\n"
TURNS, TURN_TOKENS = 3, 24


@contextlib.contextmanager
def start_multi_cluster(run_root):
    from sglang_pdd.launcher.cluster import LocalCluster
    from sglang_pdd.launcher.topology import Topology

    topology = Topology.on_free_ports(prefills=2, mains=2)
    for prefill in topology.prefills:  # as the default test cluster (conftest.start_pdd_cluster)
        prefill.extra_args += ["--pdd-wan-destination-wait-ms", str(TEST_DESTINATION_WAIT_MS)]
    for server in topology.servers:
        server.extra_args += list(EXACT_ARGS)
    with LocalCluster(run_root / "cluster-multi", model_path=_require_sglang(), topology=topology,
                      router_args=TEST_ROUTER_ARGS + HEALTH_ARGS) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def cluster(run_root, servers_under_test):
    return servers_under_test.get("cluster-multi", lambda: start_multi_cluster(run_root))


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_require_sglang())


def body(ids, max_new, **extra):
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0}, **extra}


def reference(single_server, ids, max_new):
    return post_json(f"{single_server}/generate", body(ids, max_new))["output_ids"]


def backends(cluster) -> dict:
    return {b["url"]: b for b in get_json(f"{cluster.topology.router_url}/pdd/backends")["backends"]}


def kill_server(cluster, spec) -> None:
    """kill -9 the server's whole process group (HTTP server, tokenizer, scheduler)."""
    proc = cluster.procs.procs[spec.name]
    os.killpg(os.getpgid(proc.popen.pid), signal.SIGKILL)
    assert wait_until(lambda: proc.popen.poll() is not None, 10)


def wait_out_of_rotation(cluster, spec) -> float:
    """Seconds until the router's probes opened the dead server's breaker."""
    t0 = time.monotonic()
    assert wait_until(lambda: not backends(cluster)[spec.url]["pickable"], 15, 0.05), backends(cluster)[spec.url]
    return time.monotonic() - t0


def test_sessions_stick_to_their_p_and_md_and_spread_over_both(cluster, single_server, tokenizer):
    topo, router = cluster.topology, cluster.topology.router_url
    user = tokenizer(USER_TURN, add_special_tokens=False)["input_ids"]
    placed = {s: [] for s in range(len(SEEDS))}
    errors = []

    def session(s: int) -> None:
        try:
            ids = tokenizer(SEEDS[s])["input_ids"]
            for _ in range(TURNS):
                reply = post_json(f"{router}/generate", body(ids, TURN_TOKENS, pdd_options={"path": "p_md"}))
                pdd = reply["meta_info"]["pdd"]
                placed[s].append((pdd["prefill_url"], pdd["main_url"], pdd["p_cached_tokens"], pdd["md_cached_tokens"]))
                assert reply["output_ids"] == reference(single_server, ids, TURN_TOKENS), (s, pdd)
                assert not pdd["fallbacks"], pdd
                ids = ids + reply["output_ids"] + user  # the next turn extends this one
        except BaseException as e:  # noqa: BLE001 (reported by the main thread)
            errors.append(e)

    threads = [threading.Thread(target=session, args=(s,)) for s in range(len(SEEDS))]
    for t in threads:  # staggered: each session's first turn sees the ones before it in flight
        t.start()
        time.sleep(0.2)
    for t in threads:
        t.join(600)
    print("placement per session (P, MD, P cached, MD cached):", placed)
    assert not errors, errors
    for s, turns in placed.items():
        assert len(turns) == TURNS
        assert len({(p, m) for p, m, _, _ in turns}) == 1, (s, turns)  # every turn on the same P and MD
    assert {turns[0][0] for turns in placed.values()} == {p.url for p in topo.prefills}, placed
    assert {turns[0][1] for turns in placed.values()} == {m.url for m in topo.mains}, placed


def test_md_killed_mid_stream_rld_finishes_then_the_other_md_serves(cluster, single_server, tokenizer):
    topo, router = cluster.topology, cluster.topology.router_url
    ids = tokenizer(SEEDS[0] + "    left = merge_sort(items[:middle])\n")["input_ids"]
    want = reference(single_server, ids, 96)
    killed = []
    events = []
    for event in stream_events(f"{router}/generate", {**body(ids, 96, pdd_options={"path": "p_md"}), "stream": True}):
        events.append(event)
        if len(event.get("output_ids", [])) >= 5 and not killed:
            url = event["meta_info"]["pdd"]["main_url"]
            victim = next(m for m in topo.mains if m.url == url)
            kill_server(cluster, victim)
            killed.append(victim)
    assert killed, "the stream ended before MD had decoded 5 tokens"
    assert events and "error" not in events[-1], events[-1:]
    for shorter, longer in zip(events, events[1:]):  # cumulative: nothing repeated, nothing lost
        assert longer["output_ids"][:len(shorter["output_ids"])] == shorter["output_ids"]
    pdd = events[-1]["meta_info"]["pdd"]
    print("after MD died mid-stream:", {k: pdd[k] for k in ("path", "fallbacks", "recovery_mode", "rld_tokens",
                                                            "md_tokens", "failed_backends")})
    assert events[-1]["output_ids"] == want, pdd
    assert pdd["fallbacks"], pdd  # MD's failure shows

    victim, (alive,) = killed[0], [m for m in topo.mains if m is not killed[0]]
    print(f"dead MD out of rotation after {wait_out_of_rotation(cluster, victim):.2f} s")
    for seed in SEEDS:  # affinity or not, new requests go to the live MD
        ids = tokenizer(seed + USER_TURN)["input_ids"]
        reply = post_json(f"{router}/generate", body(ids, 16, pdd_options={"path": "p_md"}))
        pdd = reply["meta_info"]["pdd"]
        assert reply["output_ids"] == reference(single_server, ids, 16), pdd
        assert pdd["main_url"] == alive.url and not pdd["fallbacks"], pdd


def test_p_killed_requests_retry_on_the_other_p_then_it_serves(cluster, single_server, tokenizer):
    topo, router = cluster.topology, cluster.topology.router_url
    ids = tokenizer(SEEDS[1] + " was invented by Johannes Gutenberg")["input_ids"]
    want = reference(single_server, ids, 16)
    first = post_json(f"{router}/generate", body(ids, 16))
    assert first["output_ids"] == want
    victim = next(p for p in topo.prefills if p.url == first["meta_info"]["pdd"]["prefill_url"])
    (alive,) = [p for p in topo.prefills if p is not victim]

    # At once, before any probe saw it dead: prefix affinity picks the dead P again; its P leg
    # fails to connect (before any token), and the router starts the request over elsewhere.
    kill_server(cluster, victim)
    again = post_json(f"{router}/generate", body(ids, 16))
    pdd = again["meta_info"]["pdd"]
    print("request sent right after P died:", {k: pdd[k] for k in ("prefill_url", "path", "fallbacks")})
    assert again["output_ids"] == want, pdd
    assert pdd["prefill_url"] == alive.url, pdd
    assert pdd["fallbacks"] and pdd["fallbacks"][0].startswith("retried_elsewhere"), pdd

    print(f"dead P out of rotation after {wait_out_of_rotation(cluster, victim):.2f} s")
    for seed in SEEDS:
        ids = tokenizer(seed + " In short,")["input_ids"]
        reply = post_json(f"{router}/generate", body(ids, 16))
        pdd = reply["meta_info"]["pdd"]
        assert reply["output_ids"] == reference(single_server, ids, 16), pdd
        assert pdd["prefill_url"] == alive.url and not any(f.startswith("retried") for f in pdd["fallbacks"]), pdd
    assert get_json(f"{router}/health")["status"] == "ok"
