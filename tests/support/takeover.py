"""MD takes over a P->RLD->MD request at a point the test chooses, not when timing allows.

MD's KV is held on the emulated WAN (a long stall) while RLD decodes; RLD stops itself once the
request has ``at`` output tokens (sglang_glue/relay/relay_hold.py: on its scheduler thread, before its
next decode step, so however loaded the machine is it cannot race to the end of the output);
then the KV is let through on a fast link and the router hands off at exactly the tokens RLD
had streamed. RLD resumes, and the WAN gets its test settings back, when the block ends. A
watchdog resumes RLD after WATCHDOG_S so a handoff that never comes fails the test instead of
hanging it.

The test cluster's relay is started with the hold (conftest.start_pdd_cluster); the hold is
armed only inside ``md_takes_over``, for one request at a time.
"""

import contextlib
import threading
from pathlib import Path

from tests.support.waiting import wait_until

from sglang_pdd.launcher.http import get_json, post_json, stream_events
from sglang_pdd.sglang_glue.relay.relay_hold import HELD_SUFFIX, RELAY_HOLD_FILE_ENV, arm

WATCHDOG_S = 60.0


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


def stream_taken_over(cluster, payload: dict, at: int) -> dict:
    """``payload`` streamed through the router, MD taking over at output position ``at``; the
    last event."""
    seen = [0]

    def on_event(ids):
        seen[0] = len(ids)

    with md_takes_over(cluster, at, progress=lambda: seen[0]):
        return stream_final(cluster.topology.router_url, payload, on_event)


def hold_file(cluster) -> Path:
    """Where the cluster's relay looks for its hold (relay/relay_hold.py)."""
    path = cluster.topology.relay.extra_env.get(RELAY_HOLD_FILE_ENV)
    assert path, "this cluster's relay was started without the hold (conftest.start_pdd_cluster)"
    return Path(path)


@contextlib.contextmanager
def md_takes_over(cluster, at: int, automatic: bool = True, progress=None):
    """Within the block, the next request RLD decodes is held at ``at`` output tokens (at least
    2: RLD streams P's first token with its first decode step) and MD's KV waits on the WAN.
    ``automatic``: the KV is let through once RLD holds and, given ``progress()`` (the tokens the
    client has), once the client has the held tokens: the router then hands off at exactly
    ``at``. Without it the router may still be reading RLD's last tokens when MD's KV lands, and
    hands off at 1 to ``at`` (assert_taken_over's ``exact=False``). Not automatic: when the
    test calls the yielded ``let_through()`` (which waits for the hold first)."""
    from tests.conftest import TEST_WAN_GBPS

    assert at >= 2, at
    relay, armed = cluster.topology.relay.url, hold_file(cluster)
    held = Path(f"{armed}{HELD_SUFFIX}")
    lock = threading.Lock()
    state = {"through": False}
    done = threading.Event()

    def let_through():
        assert wait_until(lambda: held.exists() or done.is_set(), WATCHDOG_S), (
            f"RLD never reached the hold (still armed: {armed.exists()}, RLD running: {running_requests(relay)})")
        with lock:
            if state["through"]:
                return
            state["through"] = True
            cluster.wan_control("link", rate_gbps=1.0)
            cluster.wan_control("heal")

    def watch_hold():
        def client_caught_up():
            return held.exists() and (progress is None or progress() >= at)

        if wait_until(lambda: client_caught_up() or done.is_set(), WATCHDOG_S, poll_s=0.005) and not done.is_set():
            let_through()

    def resume_relay():
        post_json(f"{relay}/continue_generation", {})
        held.unlink(missing_ok=True)

    # A request of an earlier take-over (aborted while RLD held) may still sit in RLD's batch for
    # an iteration or two: the hold must catch this request, not that one.
    assert wait_until(lambda: running_requests(relay) == 0, 30), "RLD still runs an earlier request"
    held.unlink(missing_ok=True)
    cluster.wan_control("stall", seconds=WATCHDOG_S * 2)
    arm(str(armed), at)
    watchdog = threading.Timer(WATCHDOG_S, resume_relay)
    watchdog.start()
    watcher = threading.Thread(target=watch_hold, daemon=True) if automatic else None
    if watcher is not None:
        watcher.start()
    try:
        yield let_through
    finally:
        done.set()
        watchdog.cancel()
        if watcher is not None:
            watcher.join()
        armed.unlink(missing_ok=True)  # disarmed: a request that ended short of ``at`` left it
        resume_relay()
        # RLD may have read the hold just before it was disarmed: it then holds a moment later
        if wait_until(lambda: held.exists(), 0.5):
            resume_relay()
        cluster.wan_control("heal")
        cluster.wan_control("link", rate_gbps=TEST_WAN_GBPS)


def assert_taken_over(handoffs: list, requests: int, at: int, exact: bool = True) -> None:
    """MD took over every request, at the position RLD was held at (``at``) or, where RLD's
    batch ran one step ahead of its streamed output, one later; not ``exact`` (the take-over
    did not wait for the client's progress): anywhere from P's token (1) on."""
    lowest = at if exact else 1
    assert len(handoffs) == requests and all(h is not None and lowest <= h <= at + 1 for h in handoffs), handoffs
