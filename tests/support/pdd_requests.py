"""Requests through a real PDD cluster's router and the checks the end-to-end tests share:
greedy bodies, a P->RLD->MD request MD takes over at a chosen token, one that ends on RLD only
once P has its WAN destination, every route equal to one plain server's output, a second turn
that sends only its uncached suffix over the WAN."""

import contextlib
import random
from concurrent.futures import ThreadPoolExecutor

from tests.support.takeover import assert_taken_over, stream_taken_over
from tests.support.waiting import wait_until

from sglang_pdd.control.auth import ROLE_P
from sglang_pdd.launcher.http import call_json, get_json, post_json

MAX_NEW = 24
# P->RLD->MD requests run longer: MD takes over after a few tokens and does most of the output,
# and RLD, racing on while the take-over is asked for, cannot end the output first (takeover.py).
RELAY_MAX_NEW = 128

PROMPTS = [
    "def fibonacci(n):",
    "import collections\n\nclass LRUCache:\n    def __init__(self, capacity):",
    "import collections\n\nclass LRUCache:\n    def get(self, key):",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "for i in range(10):\n    print(i)",
]


# A two-turn session: the second turn is the first turn, its answer and a new line.
TURN1 = "def parse(config):\n    values = {}\n    for key in config:\n        values[key] = config[key]\n"


def next_turn(first_text: str) -> str:
    return TURN1 + first_text + "\n# next turn\n"


def single_server_reference(url: str, prompts) -> dict:
    """Greedy output_ids of one plain server at ``url``: each of ``prompts``, TURN1 and TURN1's
    next turn (keyed by prompt text)."""
    def generate(prompt):
        return post_json(f"{url}/generate", greedy_body(prompt))

    reference = {p: generate(p)["output_ids"] for p in prompts}
    first = generate(TURN1)
    reference[TURN1] = first["output_ids"]
    reference[next_turn(first["text"])] = generate(next_turn(first["text"]))["output_ids"]
    return reference


@contextlib.contextmanager
def paused(server_url: str):
    """A server paused in place within the block (SGLang's /pause_generation), resumed after."""
    post_json(f"{server_url}/pause_generation", {"mode": "in_place"})
    try:
        yield
    finally:
        post_json(f"{server_url}/continue_generation", {})


def greedy_body(prompt: str, **extra) -> dict:
    return {"text": prompt, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}, **extra}


def route(cluster, prompt: str, **options) -> dict:
    return post_json(f"{cluster.topology.router_url}/generate", greedy_body(prompt, pdd_options=options))


def hand_off_after(cluster, prompt: str, eager: int, max_new: int = RELAY_MAX_NEW, **options) -> dict:
    """A P->RLD->MD request, streamed, that MD takes over once the client holds ``eager`` tokens
    from RLD (takeover.py). Returns the last event of the (checked cumulative) stream."""
    body = {"text": prompt, "sampling_params": {"max_new_tokens": max_new, "temperature": 0},
            "pdd_options": {"path": "p_rld_md", **options}}
    return stream_taken_over(cluster, body, eager)


def route_once_p_has_destination(cluster, body: dict) -> dict:
    """``body``, a P->RLD->MD request, through the router, with P paused (SGLang's
    /pause_generation) until P holds the request's WAN destination; the reply.

    The router starts P and RLD at once and registers MD's room concurrently (one round trip
    to MD, then one to P's control API). A short output can end on RLD before that is done:
    then the registration and P's destination finish after the reply (router/flow/lingering.py),
    and a next turn sent at once may reach MD before the KV does. Nothing orders the two, and
    on a loaded machine a 2-token request ends first within tens of milliseconds. Held on P,
    the request cannot yield a token before P has been given the destination (P's reply to
    the router leaves right after; the request's first token needs P's prefill and RLD's
    decoding first), so it ends as one whose KV is already on its way to MD."""
    url, key = f"{cluster.topology.prefill.control_url}/pdd/stats", cluster.control_key

    def given() -> int:  # destinations P has been given (before or after its request asked)
        stats = get_json(url, key=key, role=ROLE_P)
        return stats.get("early", 0) + stats.get("late", 0)

    prefill = cluster.topology.prefill.url
    before = given()
    with ThreadPoolExecutor(1) as pool:
        post_json(f"{prefill}/pause_generation", {"mode": "in_place"})
        try:
            reply = pool.submit(post_json, f"{cluster.topology.router_url}/generate", body)
            assert wait_until(lambda: given() > before, 30), get_json(url, key=key, role=ROLE_P)
        finally:  # resumed before the pool waits for the reply, also when the wait failed
            post_json(f"{prefill}/continue_generation", {})
        return reply.result(timeout=120)


def assert_routes_equal_reference(cluster, reference: dict, options: dict, check=lambda pdd: None) -> None:
    """Each prompt of ``reference`` (greedy ids at MAX_NEW) through the router on ``options``
    gives its greedy ids, with no fallback; p_md hands every request to MD at its first token,
    p_rld_md (streamed) after RLD's third, on at least half of them (takeover.py).
    ``check(meta_info.pdd)``: the caller's extra assertions."""
    handoffs = []
    for prompt, want in reference.items():
        if options["path"] == "p_rld_md":
            handoff = {k: v for k, v in options.items() if k != "path"}
            got = hand_off_after(cluster, prompt, 3, max_new=MAX_NEW, **handoff)
        else:
            got = route(cluster, prompt, **options)
        pdd = got["meta_info"]["pdd"]
        assert got["output_ids"] == want, (prompt, pdd)
        assert not pdd["fallbacks"], pdd
        assert pdd["rld_tokens"] + pdd["md_tokens"] == len(want), pdd
        check(pdd)
        handoffs.append(pdd["handoff_at"])
    if options["path"] == "p_md":
        assert handoffs == [1] * len(reference), handoffs
    elif options["path"] == "p_rld_md":  # MAX_NEW tokens: a short flow (assert_taken_over)
        assert_taken_over(handoffs, len(reference), 3)


def assert_second_turn_sends_only_the_suffix(cluster, turn1: str, reference_ids, next_turn=None) -> tuple[int, int]:
    """Turn 1, then turn 2 = turn 1 + its answer + more, both P->MD: turn 2's output equals
    ``reference_ids(prompt)`` (turn 1's too), it hits MD's DRC, and only the uncached suffix
    crosses the WAN.
    Returns (turn 1's prompt tokens, turn 2's cached tokens) for the caller's bound on the hit."""
    control, key = cluster.topology.main.control_url, cluster.control_key
    first = route(cluster, turn1, path="p_md")
    assert first["output_ids"] == reference_ids(turn1)
    turn2 = (next_turn or (lambda text: turn1 + text + "\n# next turn\n"))(first["text"])
    before = get_json(f"{control}/pdd/stats", key=key)
    second = route(cluster, turn2, path="p_md")
    after = get_json(f"{control}/pdd/stats", key=key)
    assert second["output_ids"] == reference_ids(turn2)
    pdd = second["meta_info"]["pdd"]
    cached = pdd["md_cached_tokens"]
    assert not pdd["fallbacks"], pdd
    assert after["cached_tokens"] - before["cached_tokens"] == cached
    assert after["wan_tokens"] - before["wan_tokens"] == second["meta_info"]["prompt_tokens"] - cached  # the suffix
    assert after["rooms_failed"] == before["rooms_failed"]
    return first["meta_info"]["prompt_tokens"], cached


def md_cached(cluster, ids: list[int]) -> int:
    """What MD's cache holds of ``ids`` now: a room registered (MD answers its exact cached
    prefix) and released at once."""
    topo, key = cluster.topology, cluster.control_key
    room = random.getrandbits(62)
    reg = post_json(f"{topo.main.control_url}/pdd/rooms", {"room": room, "token_ids": ids}, key=key)
    call_json("DELETE", f"{topo.main.control_url}/pdd/rooms/{room}", key=key)
    return int(reg["cached_tokens"])
