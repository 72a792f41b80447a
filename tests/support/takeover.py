"""MD takes over a P->RLD->MD request at a point the test chooses, not when timing allows.

MD's KV is held on the emulated WAN (a long stall) until ``take_over()``; then RLD's scheduler is
paused in place (SGLang's /pause_generation: its requests keep their state and decode no
further) and the KV is let through on a fast link. MD's KV lands while RLD can no longer race
to the end of the output, so the router hands off at exactly the tokens RLD had streamed. RLD
resumes, and the WAN gets its test settings back, when the block ends; a watchdog resumes RLD
after WATCHDOG_S so a handoff that never comes fails the test instead of hanging it.
"""

import contextlib
import threading

from tests.support.waiting import wait_until

from sglang_pdd.launcher.http import get_json, post_json, stream_events

WATCHDOG_S = 30.0


def running_requests(server_url: str) -> int:
    """Requests in a server's running batch, from SGLang's /v1/loads (one entry per DP rank)."""
    loads = get_json(f"{server_url}/v1/loads?include=core")
    return sum(int(load.get("num_running_reqs", load.get("core", {}).get("num_running_reqs", 0)))
               for load in loads.get("loads", []))


def stream_final(url: str, payload: dict, on_event=lambda ids: None) -> dict:
    """The last event of a cumulative SGLang /generate stream from ``url`` (checked to be
    cumulative and error-free); ``on_event(output_ids so far)`` for each event."""
    events = []
    for event in stream_events(f"{url}/generate", {**payload, "stream": True}):
        events.append(event)
        on_event(event.get("output_ids", []))
    assert events and "error" not in events[-1], events[-1:]
    for shorter, longer in zip(events, events[1:]):
        assert longer["output_ids"][:len(shorter["output_ids"])] == shorter["output_ids"]
    return events[-1]


def stream_taken_over(cluster, payload: dict, eager: int) -> dict:
    """``payload`` streamed through the router, MD taking over once the client holds ``eager``
    tokens; the last event."""
    with md_takes_over(cluster) as take_over:
        return stream_final(cluster.topology.router_url, payload, lambda ids: len(ids) >= eager and take_over())


@contextlib.contextmanager
def md_takes_over(cluster, once_relay_decodes: bool = False):
    """Yields ``take_over()`` (idempotent, thread-safe). ``once_relay_decodes``: also called as
    soon as RLD has a request in its running batch (SGLang's /v1/loads), for non-streamed
    requests whose progress the client cannot see; pausing RLD before it admitted the request
    would hold P's prefill (P waits for RLD's side of the transfer) until the watchdog."""
    from tests.conftest import TEST_WAN_GBPS

    relay = cluster.topology.relay.url
    lock = threading.Lock()
    state = {"held": True, "paused": False}
    done = threading.Event()

    def watch_relay():
        while not done.is_set() and state["held"]:
            if running_requests(relay) > 0:
                take_over()
                return
            done.wait(0.01)

    def take_over():
        with lock:
            if not state["held"]:
                return
            state["held"] = False
            post_json(f"{relay}/pause_generation", {"mode": "in_place"})
            state["paused"] = True
            cluster.wan_control("link", rate_gbps=1.0)
            cluster.wan_control("heal")

    def resume_relay():
        with lock:
            if state["paused"]:
                state["paused"] = False
                post_json(f"{relay}/continue_generation", {})

    watchdog = threading.Timer(WATCHDOG_S, resume_relay)
    watcher = None
    if once_relay_decodes:
        # A request of an earlier take-over (aborted while RLD was paused) may still sit in RLD's
        # batch for an iteration or two: the watcher must see this request, not that one.
        assert wait_until(lambda: running_requests(relay) == 0, 30), "RLD still runs an earlier request"
        watcher = threading.Thread(target=watch_relay, daemon=True)
    cluster.wan_control("stall", seconds=WATCHDOG_S * 2)
    watchdog.start()
    if watcher is not None:
        watcher.start()
    try:
        yield take_over
    finally:
        done.set()
        watchdog.cancel()
        if watcher is not None:
            watcher.join()
        with lock:
            state["held"] = False
        resume_relay()
        cluster.wan_control("heal")
        cluster.wan_control("link", rate_gbps=TEST_WAN_GBPS)


def assert_taken_over(handoffs: list, requests: int, eager: int) -> None:
    """MD took over at or after ``eager`` on every request that handed off, and on at least half
    of ``requests``. The take-over is asked for from the client's side (or on RLD's /v1/loads)
    while RLD decodes at ~5 ms a token, and the pause lands 1-35 tokens after the chosen one on a
    loaded machine: RLD finished 21-40-token outputs in 0.1-0.4 s before it (3 of 8 in one run
    under a CPU hog). Such a request is still compared with the reference token for token."""
    handed = [h for h in handoffs if h is not None]
    assert all(h >= eager for h in handed) and 2 * len(handed) >= requests, handoffs
