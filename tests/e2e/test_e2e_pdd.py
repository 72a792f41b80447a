"""End-to-end PDD on real SGLang servers: P + RLD (datacenter A), MD behind an emulated WAN.

The reference is a plain single server: greedy output_ids through every PDD path, handoff
mode and threshold must equal it, token for token, streaming or not, and through WAN / MD
failures (RLD finishes the request). The WAN is slow on purpose (0.5 Mbit/s, 20 ms): MD's KV
lands after RLD's first tokens; where a test needs the handoff at a chosen token, MD takes over
there (takeover.py).
"""

import json
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from tests.support.takeover import assert_taken_over
from tests.support.waiting import wait_until

from sglang_pdd.launcher.http import call_json, get_json, post_json, stream_events
from tests.support.pdd_requests import (MAX_NEW, PROMPTS, RELAY_MAX_NEW, assert_second_turn_sends_only_the_suffix,
                                        greedy_body, hand_off_after, md_cached, route,
                                        route_once_p_has_destination)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def reference(single_server):
    return {p: post_json(f"{single_server}/generate", greedy_body(p))["output_ids"] for p in PROMPTS}


@pytest.fixture(scope="module")
def relay_reference(single_server):
    """The single server's greedy ids at RELAY_MAX_NEW tokens."""
    return {p: post_json(f"{single_server}/generate", {"text": p, "sampling_params": {
        "max_new_tokens": RELAY_MAX_NEW, "temperature": 0}})["output_ids"] for p in PROMPTS}


CONFIGS = [
    {"path": "p_rld_md", "handoff_mode": "one_shot"},
    {"path": "p_rld_md", "handoff_mode": "catch_up", "catch_up_threshold": 2},
    {"path": "p_rld_md", "handoff_mode": "catch_up", "catch_up_threshold": 64},
    {"path": "p_md"},
    {"path": "p_rld_only"},
]


@pytest.mark.parametrize("options", CONFIGS, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_pdd_output_ids_equal_single_server(pdd_cluster, reference, relay_reference, options):
    eager, handoffs = 3, []
    for prompt in PROMPTS:
        if options["path"] == "p_rld_md":  # MD's KV held until RLD has streamed `eager` tokens
            got, want = hand_off_after(pdd_cluster, prompt, eager, **options), relay_reference[prompt]
        else:
            got, want = route(pdd_cluster, prompt, **options), reference[prompt]
        pdd = got["meta_info"]["pdd"]
        assert got["output_ids"] == want, (prompt, pdd)
        assert got["meta_info"]["completion_tokens"] == len(want)
        assert pdd["path"] == options["path"]
        assert pdd["rld_tokens"] + pdd["md_tokens"] == len(want)
        assert not pdd["fallbacks"], pdd
        if options["path"] == "p_rld_only":
            assert pdd["handoff_at"] is None and pdd["md_tokens"] == 0, pdd
        elif options["path"] == "p_md":  # RLD only relays P's first token; MD does the rest
            assert pdd["handoff_at"] == 1, pdd
        elif pdd["handoff_at"] is not None:
            assert pdd["md_tokens"] == len(want) - pdd["handoff_at"] > 0, pdd
        if pdd["handoff_at"] is not None:
            assert pdd["handoff_payload_bytes"] < 1500
        handoffs.append(pdd["handoff_at"])
    if options["path"] == "p_rld_md":
        assert_taken_over(handoffs, len(PROMPTS), eager)


def test_catch_up_hands_over_in_batches(pdd_cluster, relay_reference):
    prompt, threshold = PROMPTS[3], 2
    got = hand_off_after(pdd_cluster, prompt, 8, handoff_mode="catch_up", catch_up_threshold=threshold)
    pdd = got["meta_info"]["pdd"]
    assert got["output_ids"] == relay_reference[prompt] and not pdd["fallbacks"], pdd
    assert pdd["handoff_mode"] == "catch_up" and pdd["handoff_at"] >= 8, pdd
    batches = pdd["catch_up_batches"]
    assert len(batches) >= 2 and sum(batches) == pdd["handoff_at"], pdd
    assert all(0 < b <= threshold for b in batches[:-1]), pdd  # bounded while RLD kept going


def test_streaming_is_one_ordered_stream(pdd_cluster, single_server):
    """RLD's stream, then MD's after a handoff, reach the client as one cumulative stream.

    Whether MD's KV lands before RLD has decoded everything depends on timing (MD's room is
    registered while P and RLD already run), so longer outputs are tried until a handoff
    happens; every attempt must be one correct ordered stream."""
    prompt = PROMPTS[1]
    for max_new in (24, 96, 256):
        want = post_json(f"{single_server}/generate", {"text": prompt, "sampling_params": {
            "max_new_tokens": max_new, "temperature": 0}})["output_ids"]
        body = {"text": prompt, "sampling_params": {"max_new_tokens": max_new, "temperature": 0}, "stream": True,
                "pdd_options": {"path": "p_rld_md", "handoff_mode": "one_shot"}}
        events = list(stream_events(f"{pdd_cluster.topology.router_url}/generate", body))
        ids = [e["output_ids"] for e in events]
        assert ids[-1] == want
        for shorter, longer in zip(ids, ids[1:]):
            assert longer[:len(shorter)] == shorter  # cumulative: nothing rewritten, nothing dropped
        assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
        pdd = events[-1]["meta_info"]["pdd"]
        assert not pdd["fallbacks"], pdd
        if pdd["handoff_at"] is not None:
            assert pdd["md_tokens"] == max_new - pdd["handoff_at"] > 0
            return
    pytest.fail(f"no handoff within {max_new} tokens: MD's KV never landed before RLD finished ({pdd})")


def test_drc_second_turn_only_sends_the_new_suffix(pdd_cluster, single_server):
    turn1_tokens, cached = assert_second_turn_sends_only_the_suffix(
        pdd_cluster, "def parse(config):\n    values = {}\n",
        lambda prompt: post_json(f"{single_server}/generate", greedy_body(prompt))["output_ids"])
    assert cached >= turn1_tokens  # the prompt of turn 1 at least


def test_wan_partition_rld_finishes_without_loss(pdd_cluster, reference):
    pdd_cluster.wan_control("partition")
    try:
        for options in ({"path": "p_rld_md"}, {"path": "p_md"}):
            got = route(pdd_cluster, PROMPTS[0], **options)
            pdd = got["meta_info"]["pdd"]
            assert got["output_ids"] == reference[PROMPTS[0]], pdd
            assert pdd["md_tokens"] == 0  # MD never took over
            if options["path"] == "p_md":  # RLD stopped after token 1: the router recovered on RLD
                assert any(f.startswith("wan_failed") for f in pdd["fallbacks"]), pdd
                assert any(f.startswith("recovered_on_relay") for f in pdd["fallbacks"]), pdd
    finally:
        pdd_cluster.wan_control("heal")
    stats_url, key = f"{pdd_cluster.topology.main.control_url}/pdd/stats", pdd_cluster.control_key
    assert wait_until(lambda: get_json(stats_url, key=key)["open_rooms"] == 0, 30)


def _status(url: str, body: bytes, method: str = "POST", key=None) -> tuple[int, dict]:
    return call_json(method, url, body, key=key)


def test_md_refuses_stale_and_malformed_handoffs(pdd_cluster):
    control, key = pdd_cluster.topology.main.control_url, pdd_cluster.control_key
    code, body = _status(f"{control}/pdd/rooms/12345/handoff", json.dumps({"token_ids": [1, 2]}).encode(), key=key)
    assert code == 409 and "stale handoff" in body["error"]
    code, body = _status(f"{control}/pdd/rooms", b"{not json", key=key)
    assert code == 400
    code, body = _status(f"{control}/pdd/rooms", json.dumps({"room": 1, "token_ids": [-1]}).encode(), key=key)
    assert code == 400 and "non-negative" in body["error"]
    code, body = _status(f"{control}/pdd/rooms/abc/ready", b"", method="GET", key=key)
    assert code == 400 and "room id" in body["error"]
    assert get_json(f"{control}/health")["status"] == "ok"


def test_md_refuses_to_flush_under_an_open_room_and_keeps_serving(pdd_cluster):
    """A flush would free the pages and prefix a room holds for KV still on the WAN."""
    topo, key = pdd_cluster.topology, pdd_cluster.control_key
    room = int(time.time() * 1e6)
    post_json(f"{topo.main.control_url}/pdd/rooms", {"room": room, "token_ids": list(range(100, 164))}, key=key)
    try:
        code, _ = _raw_status(f"{topo.main.url}/flush_cache")
        assert code == 400
        with urllib.request.urlopen(f"{topo.main.url}/health_generate", timeout=60) as resp:
            assert resp.status == 200  # MD still generates
    finally:
        call_json("DELETE", f"{topo.main.control_url}/pdd/rooms/{room}", key=key)
    stats_url = f"{topo.main.control_url}/pdd/stats"
    assert wait_until(lambda: get_json(stats_url, key=key)["open_rooms"] == 0, 30)
    assert _raw_status(f"{topo.main.url}/flush_cache")[0] == 200
    assert route(pdd_cluster, PROMPTS[0], path="p_md")["meta_info"]["pdd"]["fallbacks"] == []


def _raw_status(url: str) -> tuple[int, bytes]:
    """(status, body) of a bodiless POST, whatever the status (SGLang's flush answers text)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"), timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_md_and_p_refuse_unsigned_control_calls_on_real_servers(pdd_cluster):
    topo = pdd_cluster.topology
    code, body = _status(f"{topo.main.control_url}/pdd/rooms", json.dumps({"room": 1, "token_ids": [1]}).encode())
    assert code == 401 and "signed" in body["error"]
    dest = {"bootstrap_room": 1, "md_room": 1, "wan_peer": f"127.0.0.1:{topo.wan.listen_port}", "md_prefix_len": 0}
    code, body = _status(f"{topo.prefill.control_url}/pdd/wan_destinations", json.dumps(dest).encode())
    assert code == 401
    # signed, but to an MD that P was not configured with: refused, nothing dialled
    dest["wan_peer"] = "127.0.0.1:9"
    code, body = _status(f"{topo.prefill.control_url}/pdd/wan_destinations", json.dumps(dest).encode(),
                         key=pdd_cluster.control_key)
    assert code == 403 and "--pdd-wan-peers" in body["error"]


@pytest.mark.full
def test_the_router_names_its_p_hosts_to_md_on_real_servers(pdd_cluster):
    """MD's WAN receiver counts the router's P hosts as known KV peers (reserved handshake
    slots), from the router's own configuration, with no --pdd-kv-trusted-sources."""
    url = f"{pdd_cluster.topology.main.control_url}/pdd/stats"

    def announced() -> int:
        return get_json(url, key=pdd_cluster.control_key)["wan_receiver"]["known_sources_announced"]

    assert wait_until(lambda: announced() == 1, timeout=30)  # the P host, 127.0.0.1


@pytest.mark.parametrize("path,body,code,needle", [
    ("/generate", b"{oops", 400, "malformed JSON"),
    ("/generate", json.dumps({"sampling_params": {}}).encode(), 400, "'text' or 'input_ids'"),
    ("/generate", json.dumps({"input_ids": [1] * 40000}).encode(), 400, "--max-prompt-tokens"),
    ("/generate", json.dumps({"text": "x", "pdd_options": {"path": "nowhere"}}).encode(), 400, "bad pdd_options"),
    ("/v1/completions", json.dumps({"model": "gpt-9", "prompt": "hi"}).encode(), 404, "unknown model"),
])
def test_router_rejects_bad_input_clearly(pdd_cluster, path, body, code, needle):
    got_code, got = _status(f"{pdd_cluster.topology.router_url}{path}", body)
    assert got_code == code and needle in json.dumps(got)
    assert get_json(f"{pdd_cluster.topology.router_url}/health")["status"] == "ok"


def test_openai_completions_match_generate(pdd_cluster, reference):
    code, got = _status(f"{pdd_cluster.topology.router_url}/v1/completions", json.dumps(
        {"prompt": PROMPTS[4], "max_tokens": MAX_NEW, "temperature": 0}).encode())
    assert code == 200 and got["usage"]["completion_tokens"] == MAX_NEW
    direct = route(pdd_cluster, PROMPTS[4], path="p_rld_md")
    assert got["choices"][0]["text"] == direct["text"]


def test_metrics_count_paths_and_handoffs(pdd_cluster):
    def counters() -> dict[str, float]:
        with urllib.request.urlopen(f"{pdd_cluster.topology.router_url}/metrics", timeout=10) as resp:
            lines = resp.read().decode().splitlines()
        wanted = ('pdd:requests_total{path="p_rld_md"}', 'pdd:handoffs_total{mode="one_shot"}')
        return {name: sum(float(l.split()[-1]) for l in lines if l.startswith(name + " ")) for name in wanted}

    before = counters()
    got = hand_off_after(pdd_cluster, PROMPTS[0], 2, handoff_mode="one_shot")
    assert got["meta_info"]["pdd"]["handoff_at"] is not None
    after = counters()
    assert {name: after[name] - before[name] for name in after} == {name: 1.0 for name in after}


def test_kv_still_crossing_when_rld_finishes_is_cached_on_md(pdd_cluster):
    """A one-token request ends on RLD long before its KV reaches MD over the slow test WAN;
    MD still lets it land and caches the prompt, so the session's next turn hits it.

    The request ends only once P holds its WAN destination (route_once_p_has_destination): one
    that ends before drops the destination by design, which would test nothing here."""
    topo, key = pdd_cluster.topology, pdd_cluster.control_key
    stats_url = f"{topo.main.control_url}/pdd/stats"
    before = get_json(stats_url, key=key)
    ids = [int(x) for x in np.random.default_rng(7).integers(100, 900, 96)]
    got = route_once_p_has_destination(pdd_cluster, {
        "input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "pdd_options": {"path": "p_rld_md"}})
    pdd = got["meta_info"]["pdd"]
    assert pdd["handoff_at"] is None and pdd["md_tokens"] == 0 and not pdd["fallbacks"], pdd
    assert pdd["md_registration"] == "concurrent", pdd

    cached = []
    assert wait_until(lambda: cached.append(md_cached(pdd_cluster, ids)) or cached[-1] == len(ids) - 1, 30, poll_s=0.5), cached
    # MD counts the room kept and landed, its suffix's bytes with it
    stats = []
    assert wait_until(lambda: stats.append(get_json(stats_url, key=key))
                      or stats[-1].get("rooms_kept_landed", 0) > before.get("rooms_kept_landed", 0), 30, poll_s=0.5)
    landed = stats[-1].get("kv_bytes_kept_landed", 0) - before.get("kv_bytes_kept_landed", 0)
    assert landed >= (len(ids) - 1 - pdd["md_cached_tokens"]) * stats[-1]["kv_bytes_per_token"] > 0, stats[-1]
    # the session's next turn, through the router: MD's DRC has the prefix, only the suffix crosses
    nxt = route_once_p_has_destination(pdd_cluster, {
        "input_ids": ids + [int(x) for x in np.random.default_rng(8).integers(100, 900, 24)],
        "sampling_params": {"max_new_tokens": 1, "temperature": 0}, "pdd_options": {"path": "p_rld_md"}})
    assert nxt["meta_info"]["pdd"]["md_cached_tokens"] >= len(ids) - 1, nxt["meta_info"]["pdd"]
