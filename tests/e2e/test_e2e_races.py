"""SGLang's PD test patterns on real servers on CPU, for PDD's own rendezvous.

* A registration race under load (SGLang injects a metadata race under 40 concurrent
  requests and checks every first token): MD's room registrations and P's late WAN
  destinations are each held back by a random 0-300 ms (test-only delays read from the
  servers' environment at start, sglang_glue/injected_delays.py), while 40 requests run at
  once. Every request's first token and whole output must equal one server's greedy output,
  each stream cumulative (no token repeated or skipped), and afterwards P, RLD and MD hold
  nothing and MD flushes.
* A canary on DRC suffixes (SGLang's KV canary with the decode radix cache): multi-turn
  sessions run at once; each turn after the first finds the conversation so far in MD's
  cache, so only the new suffix crosses the WAN. What MD produces after landing that suffix
  (its tokens and their logprobs) must equal one server's at the same positions.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from tests.support.waiting import wait_until

from sglang_pdd.launcher.http import get_json, post_json, stream_events
from tests.support.pdd_requests import md_cached
from sglang_pdd.sglang_glue.injected_delays import MD_REGISTER_DELAY_ENV, P_DESTINATION_DELAY_ENV, SEED_ENV

pytestmark = [pytest.mark.e2e, pytest.mark.full, pytest.mark.own_cluster]

INJECTED = {MD_REGISTER_DELAY_ENV: "0-300", P_DESTINATION_DELAY_ENV: "0-300", SEED_ENV: "30"}
# The race wants MD's KV to land while RLD still streams, often: a WAN well above the test
# default (0.5 Mbit/s), still slow enough that the registration delays matter.
RACE_WAN_GBPS = 0.02
CONCURRENT = 40
MAX_NEW = 24


@contextlib.contextmanager
def environ(values: dict):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def cluster_with_injected_delays(run_root):
    """The test cluster, its servers started with the delays in their environment (only the
    start sees them: no later cluster inherits them)."""
    from tests.conftest import start_pdd_cluster

    with contextlib.ExitStack() as stack:
        with environ(INJECTED):
            cluster = stack.enter_context(start_pdd_cluster(run_root, "cluster-races"))
        cluster.wan_control("link", rate_gbps=RACE_WAN_GBPS)
        yield cluster


@pytest.fixture(scope="module")
def race_cluster(run_root, servers_under_test):
    return servers_under_test.get("cluster-races", lambda: cluster_with_injected_delays(run_root))


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(rng.randrange(24, 72))] for _ in range(n)]


def greedy(max_new: int = MAX_NEW) -> dict:
    return {"temperature": 0, "max_new_tokens": max_new}


def streamed(router_url: str, body: dict) -> list[dict]:
    events = list(stream_events(f"{router_url}/generate", {**body, "stream": True}))
    assert events and all("error" not in e for e in events), events[-1:]
    for shorter, longer in zip(events, events[1:]):  # cumulative: nothing repeated, skipped or changed
        assert longer["output_ids"][:len(shorter["output_ids"])] == shorter["output_ids"]
    return events


def injected_delays_are_active(cluster) -> bool:
    """The servers' logs say the test-only delays were read at start (else the race test
    would run without its race)."""
    logs = cluster.run_dir / "logs"
    texts = {name: (logs / f"{name}.log").read_text(errors="replace")
             for name in (cluster.topology.main.name, cluster.topology.prefill.name)}
    return (MD_REGISTER_DELAY_ENV in texts[cluster.topology.main.name]
            and P_DESTINATION_DELAY_ENV in texts[cluster.topology.prefill.name])


def assert_nothing_held(cluster) -> None:
    """After the load: MD holds no room and no WAN slot (it flushes), P waits for no
    destination, RLD runs nothing."""
    from tests.support.takeover import running_requests

    from sglang_pdd.control.auth import ROLE_P

    topo, key = cluster.topology, cluster.control_key
    md_stats = f"{topo.main.control_url}/pdd/stats"
    assert wait_until(lambda: get_json(md_stats, key=key)["open_rooms"] == 0, 30), get_json(md_stats, key=key)
    p_stats = f"{topo.prefill.control_url}/pdd/stats"
    assert wait_until(lambda: get_json(p_stats, key=key, role=ROLE_P)["waiting_senders"] == 0, 30)
    assert wait_until(lambda: running_requests(topo.relay.url) == 0, 30)
    with contextlib.closing(_post(f"{topo.main.url}/flush_cache")) as resp:
        assert resp.status == 200


def _post(url: str):
    import urllib.request

    return urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"), timeout=60)


def test_every_first_token_and_output_under_a_registration_race(race_cluster, single_server):
    assert injected_delays_are_active(race_cluster)
    router = race_cluster.topology.router_url
    ids = prompts(CONCURRENT, seed=40)
    with ThreadPoolExecutor(8) as pool:
        want = list(pool.map(lambda p: post_json(f"{single_server}/generate",
                                                 {"input_ids": p, "sampling_params": greedy()}), ids))
    # three of four through P->RLD->MD (the late-destination rendezvous), the rest P->MD (the
    # registration before the legs)
    paths = ["p_md" if i % 4 == 3 else "p_rld_md" for i in range(CONCURRENT)]
    with ThreadPoolExecutor(CONCURRENT) as pool:
        got = list(pool.map(lambda a: streamed(router, {"input_ids": a[0], "sampling_params": greedy(),
                                                        "pdd_options": {"path": a[1]}}), zip(ids, paths)))
    handed_off, fell_back = 0, 0
    for i, (events, ref) in enumerate(zip(got, want)):
        first = next(e["output_ids"] for e in events if e["output_ids"])
        assert first[0] == ref["output_ids"][0], (i, first, ref["output_ids"][:3])
        last = events[-1]
        assert last["output_ids"] == ref["output_ids"], (i, last["meta_info"]["pdd"])
        assert last["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"], i
        pdd = last["meta_info"]["pdd"]
        handed_off += pdd["md_tokens"] > 0
        fell_back += bool(pdd["fallbacks"])
    print(f"\n{CONCURRENT} concurrent requests under injected registration/destination delays: "
          f"{handed_off} handed off to MD, {fell_back} fell back, all {CONCURRENT} equal to one server")
    assert handed_off > 0  # the race was run through, not around
    assert_nothing_held(race_cluster)


SESSIONS = 8
TURNS = 3


def test_drc_suffix_canary_under_concurrent_sessions(race_cluster, single_server):
    """Each later turn: MD's cache holds the conversation so far, only the new suffix crosses
    the WAN; MD's tokens after landing it and their logprobs equal one server's."""
    router = race_cluster.topology.router_url
    rng = random.Random(7)
    firsts = prompts(SESSIONS, seed=8)

    def session(s: int) -> list[dict]:
        conversation, turns = list(firsts[s]), []
        for turn in range(TURNS):
            body = {"input_ids": conversation, "sampling_params": greedy(16), "return_logprob": True}
            ref = post_json(f"{single_server}/generate", body)
            got = post_json(f"{router}/generate", {**body, "pdd_options": {"path": "p_md" if s % 2 else "p_rld_md"}})
            turns.append({"session": s, "turn": turn, "got": got, "ref": ref, "prompt_len": len(conversation)})
            conversation = conversation + ref["output_ids"] + [rng.randrange(3, 1000) for _ in range(6)]
        return turns

    with ThreadPoolExecutor(SESSIONS) as pool:
        results = [t for turns in pool.map(session, range(SESSIONS)) for t in turns]
    canaries = 0
    for r in results:
        got, ref, where = r["got"], r["ref"], (r["session"], r["turn"])
        assert got["output_ids"] == ref["output_ids"], (where, got["meta_info"]["pdd"])
        pdd = got["meta_info"]["pdd"]
        if r["turn"] == 0 or pdd["md_tokens"] == 0:
            continue
        assert pdd["md_cached_tokens"] > 0, (where, pdd)  # DRC: only the suffix crossed
        start = pdd["handoff_at"]  # MD's tokens from here on
        mine = got["meta_info"]["output_token_logprobs"][start:]
        theirs = ref["meta_info"]["output_token_logprobs"][start:]
        assert [x[1] for x in mine] == [x[1] for x in theirs], where
        assert all(abs(a[0] - b[0]) < 1e-3 for a, b in zip(mine, theirs)), where
        canaries += 1
    print(f"\nDRC canary: {canaries} of {SESSIONS * (TURNS - 1)} later turns continued on MD after landing "
          f"their suffix, each equal to one server (tokens and logprobs)")
    assert canaries >= SESSIONS // 2  # the canary ran on many later turns, not only fallbacks
    assert_nothing_held(race_cluster)


def after_end_counts(router_url: str) -> dict:
    """The router's ``pdd:md_kv_after_end_total`` by outcome."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"{router_url}/metrics", timeout=10).read().decode()
    return {s.labels["outcome"]: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "pdd:md_kv_after_end_total"}


def test_relayed_requests_ending_before_md_answers_still_warm_mds_cache(race_cluster):
    """MD answers its registrations 0-300 ms late here, so a one-token relayed request often
    finishes on RLD first. Its registration and P's destination then finish after the reply,
    and MD's cache still gets the prompt: every prompt is there afterwards, as P's is."""
    topo = race_cluster.topology
    before = after_end_counts(topo.router_url)
    sent = []
    for ids in prompts(30, seed=77):  # until enough of them ended first (each a draw of the delays)
        out = post_json(f"{topo.router_url}/generate", {"input_ids": ids, "sampling_params": greedy(1),
                                                       "pdd_options": {"path": "p_rld_md"}})
        assert len(out["output_ids"]) == 1 and not out["meta_info"]["pdd"]["fallbacks"], out["meta_info"]
        sent.append(ids)
        if after_end_counts(topo.router_url).get("delivered", 0) - before.get("delivered", 0) >= 3:
            break
    after = after_end_counts(topo.router_url)
    delivered = after.get("delivered", 0) - before.get("delivered", 0)
    assert delivered >= 3, f"only {delivered} of {len(sent)} requests ended before MD answered: no race run"
    assert after.get("failed", 0) == before.get("failed", 0), after
    for ids in sent:  # landed, also those delivered after the end (SGLang's cache keeps all but the last)
        held = []
        assert wait_until(lambda: held.append(md_cached(race_cluster, ids)) or held[-1] >= len(ids) - 1, 30,
                          poll_s=0.5), (len(ids), held[-3:])
    print(f"\n{len(sent)} one-token relayed requests, {delivered} ended before MD answered; "
          f"all {len(sent)} prompts in MD's cache")
    assert_nothing_held(race_cluster)
