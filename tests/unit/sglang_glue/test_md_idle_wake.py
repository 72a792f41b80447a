"""MD sleeps on idle as P and RLD do (SGLang's own IdleSleeper), and a room command or KV in
flight wakes it: idle_wake.IdleWake on the real sleeper and real zmq sockets."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import zmq

from sglang_pdd.protocol import ReleaseRequest
from sglang_pdd.sglang_glue.md.idle_wake import IdleWake
from sglang_pdd.sglang_glue.md.driver import CommandQueue

IdleSleeper = pytest.importorskip("sglang.srt.managers.scheduler_components.idle_sleeper").IdleSleeper


@pytest.fixture
def sleeper():
    ctx = zmq.Context()
    tokenizer_socket = ctx.socket(zmq.PULL)  # stands in for the scheduler's tokenizer socket
    tokenizer_socket.bind("inproc://tokenizer")
    yield IdleSleeper(sockets=[tokenizer_socket])
    tokenizer_socket.close(linger=0)
    ctx.term()


def slept(sleeper) -> float:
    t0 = time.monotonic()
    sleeper.maybe_sleep()  # SGLang's: a poll of up to 1 s
    return time.monotonic() - t0


def test_an_idle_md_sleeps_the_sleepers_full_poll(sleeper):
    wake = IdleWake(SimpleNamespace(idle_sleeper=sleeper))
    assert wake.active
    wake.drain()
    assert slept(sleeper) > 0.9  # nothing to do: no spinning
    wake.close()


def test_a_room_command_wakes_a_sleeping_md_at_once(sleeper):
    wake = IdleWake(SimpleNamespace(idle_sleeper=sleeper))
    commands = CommandQueue(on_submit=wake.wake)
    threading.Timer(0.1, lambda: commands.submit(ReleaseRequest(1))).start()
    assert slept(sleeper) < 0.6
    taken, _ = commands.take()
    assert taken == [ReleaseRequest(1)]
    wake.drain()  # the iteration took the wake-up: the next idle poll sleeps again
    assert slept(sleeper) > 0.9
    wake.close()


def test_kv_in_flight_keeps_md_awake_and_its_end_lets_it_sleep(sleeper):
    wake = IdleWake(SimpleNamespace(idle_sleeper=sleeper))
    wake.drain()
    wake.keep_awake(True)  # a room landing after this iteration
    assert slept(sleeper) < 0.2
    wake.drain()
    wake.keep_awake(False)  # nothing in flight any more
    assert slept(sleeper) > 0.9
    wake.close()


def test_many_wakeups_before_an_iteration_do_not_block_the_control_threads(sleeper):
    wake = IdleWake(SimpleNamespace(idle_sleeper=sleeper))
    t0 = time.monotonic()
    for _ in range(200_000):  # more than a pipe holds
        wake.wake()
    assert time.monotonic() - t0 < 10
    wake.drain()
    assert slept(sleeper) > 0.9
    wake.close()


def test_without_sglangs_sleeper_nothing_happens():
    """No --sleep-on-idle, or a TP rank other than 0 (SGLang gives only rank 0 a sleeper)."""
    for scheduler in (SimpleNamespace(idle_sleeper=None), SimpleNamespace()):
        wake = IdleWake(scheduler)
        assert not wake.active
        wake.wake(), wake.keep_awake(True), wake.drain(), wake.close()


def test_md_sleeps_while_kv_crosses_the_wan_and_wakes_when_it_has_landed(sleeper):
    """MD's real runtime and WAN receiver, P's real fan-out: a registered room whose KV has not
    come yet keeps no core busy (the idle poll sleeps its full second); the receiver wakes the
    scheduler once the room has landed, and the next iteration puts it in the tree."""
    from sglang_pdd.protocol import RegisterRequest
    from tests.support.md_runtime import KEY, Prefill, close, make_pool, runtime_on_pool, settle

    md = runtime_on_pool(make_pool("mha", 16, seed=None), 16, KEY, idle_sleeper=sleeper, wan_timeout_s=10.0,
                         md_staging_mb=64, md_ingest="pool")
    p = Prefill("mha", 16, md)
    try:
        ids = list(range(1000, 1050))
        md.rank_rooms.register(RegisterRequest(1, ids))
        md.on_scheduler_iteration()
        assert md.table.pending() and not md.rank_rooms.needs_iteration()
        assert slept(sleeper) > 0.9  # the room waits for its KV: MD sleeps, it does not spin
        md.on_scheduler_iteration()
        threading.Timer(0.2, lambda: p.send(1, ids, 0, p.pages_for(len(ids), seed=1))).start()
        assert slept(sleeper) < 0.9  # the room landed: the receiver woke the scheduler
        assert md.rank_rooms.needs_iteration()  # a landed room waits for the iteration's decision
        deadline = time.monotonic() + 10
        while md.table.pending() and time.monotonic() < deadline:
            md.on_scheduler_iteration()
            time.sleep(0.01)
        assert md.table.rooms[1].status.value == "ready"
        settle(md)  # the partial page goes back once the receiver let go of the room
        assert md.held_tokens == 0
        md.on_scheduler_iteration()
        assert not md.rank_rooms.needs_iteration()
    finally:
        close(md, p)


class SchedulerStandIn:
    """What the plugin's on_idle hook reads of SGLang's scheduler: SGLang's own idle verdict
    (``busy``: requests running or waiting), its sleep, MD's runtime."""

    def __init__(self, runtime, sleeper):
        self._pdd_runtime, self.sleeper, self.busy = runtime, sleeper, False

    def is_fully_idle(self, for_health_check=False, ignore_waiting=False):
        return not self.busy

    def maybe_sleep_on_idle(self):
        self.sleeper.maybe_sleep()


def test_md_sleeps_on_idle_while_only_its_rooms_are_in_flight(sleeper):
    """SGLang's on_idle sleeps only when fully idle, and MD's rooms count as work there (a
    deferred flush waits for them): the plugin's on_idle hook sleeps while a room's KV crosses
    the WAN (measured before it: MD spun 0.65 cores for as long as a relayed request's KV
    landed), not while requests run, not a second time when SGLang slept already; the
    receiver wakes it when the room lands, and the iteration that completes the room wakes
    the next one (SGLang's deferred flush sees MD idle at once)."""
    from sglang_pdd.protocol import RegisterRequest
    from tests.support.md_runtime import KEY, Prefill, close, make_pool, runtime_on_pool
    from tests.conftest import require_sglang_import

    require_sglang_import()
    from sglang_pdd.sglang_glue.plugin import _sleep_while_md_rooms_land

    md = runtime_on_pool(make_pool("mha", 16, seed=None), 16, KEY, idle_sleeper=sleeper, wan_timeout_s=10.0,
                         md_staging_mb=64, md_ingest="pool")
    p = Prefill("mha", 16, md)
    scheduler = SchedulerStandIn(md, sleeper)

    def on_idle_hook() -> float:
        t0 = time.monotonic()
        _sleep_while_md_rooms_land(None, scheduler)
        return time.monotonic() - t0

    try:
        assert on_idle_hook() < 0.1  # no room: SGLang's on_idle has slept already
        ids = list(range(1000, 1050))
        md.rank_rooms.register(RegisterRequest(1, ids))
        md.on_scheduler_iteration()
        assert md.flush_blocker() is not None  # SGLang's is_fully_idle (hooked) says busy
        assert on_idle_hook() > 0.9  # the KV is on its way: MD sleeps the full poll
        scheduler.busy = True
        assert on_idle_hook() < 0.1  # requests to run: no sleep
        scheduler.busy = False
        md.on_scheduler_iteration()
        threading.Timer(0.2, lambda: p.send(1, ids, 0, p.pages_for(len(ids), seed=1))).start()
        assert on_idle_hook() < 0.9  # the room landed: the receiver woke the scheduler
        deadline = time.monotonic() + 10
        while md.table.pending() and time.monotonic() < deadline:
            md.on_scheduler_iteration()
            time.sleep(0.01)
        assert md.table.rooms[1].status.value == "ready"
        assert slept(sleeper) < 0.1  # the iteration that completed the room keeps the next one at once
    finally:
        close(md, p)
