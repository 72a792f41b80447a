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
from typing import Optional

from sglang_pdd.launcher.http import post_json

WATCHDOG_S = 30.0


@contextlib.contextmanager
def md_takes_over(cluster, after_s: Optional[float] = None):
    """Yields ``take_over()`` (idempotent, thread-safe); ``after_s``: also called by a timer
    (for non-streamed requests, whose progress the client cannot see)."""
    from conftest import TEST_WAN_GBPS

    relay = cluster.topology.relay.url
    lock = threading.Lock()
    state = {"held": True, "paused": False}

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

    timers = [threading.Timer(WATCHDOG_S, resume_relay)]
    if after_s is not None:
        timers.append(threading.Timer(after_s, take_over))
    cluster.wan_control("stall", seconds=WATCHDOG_S * 2)
    for timer in timers:
        timer.start()
    try:
        yield take_over
    finally:
        for timer in timers:
            timer.cancel()
        with lock:
            state["held"] = False
        resume_relay()
        cluster.wan_control("heal")
        cluster.wan_control("link", rate_gbps=TEST_WAN_GBPS)
