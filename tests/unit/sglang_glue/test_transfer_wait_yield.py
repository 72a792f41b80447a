"""P and RLD wait on their own sockets for a millisecond, where SGLang's on_idle spins while KV
transfers run (plugin._yield_while_transfers_wait): the transfer threads get the GIL and the
core, and a request that comes in ends the wait at once."""

from __future__ import annotations

import time

import pytest
import zmq

from tests.conftest import require_sglang_import

IdleSleeper = pytest.importorskip("sglang.srt.managers.scheduler_components.idle_sleeper").IdleSleeper


class PollSpy:
    def __init__(self):
        self.calls = []

    def poll(self, timeout_ms):
        self.calls.append(timeout_ms)
        return []


class SchedulerStandIn:
    """SGLang's own idle verdict (``busy``: transfers in flight, or anything else to do), its
    sleeper, and the role flag the plugin sets at start."""

    def __init__(self, sleeper, role_yields=True, busy=True):
        self.idle_sleeper, self._pdd_yields_to_transfers, self.busy = sleeper, role_yields, busy

    def is_fully_idle(self, for_health_check=False, ignore_waiting=False):
        return not self.busy


def on_idle_hook(scheduler) -> float:
    require_sglang_import()
    from sglang_pdd.sglang_glue.plugin import _yield_while_transfers_wait

    t0 = time.monotonic()
    _yield_while_transfers_wait(None, scheduler)
    return time.monotonic() - t0


@pytest.fixture
def sockets():
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)  # stands in for the scheduler's tokenizer socket
    pull.bind("inproc://tokenizer")
    push = ctx.socket(zmq.PUSH)
    push.connect("inproc://tokenizer")
    yield pull, push
    push.close(linger=0)
    pull.close(linger=0)
    ctx.term()


def test_transfers_in_flight_wait_on_the_sockets_instead_of_spinning(sockets):
    pull, push = sockets
    scheduler = SchedulerStandIn(IdleSleeper(sockets=[pull]))
    waits = [on_idle_hook(scheduler) for _ in range(20)]
    assert min(waits) >= 0.0009  # each idle iteration hands the core over for ~1 ms
    push.send(b"request")  # left unread, as the scheduler reads it only after on_idle
    assert min(on_idle_hook(scheduler) for _ in range(20)) < 0.0009  # a request ends the wait at once


def test_nothing_changes_where_sglang_sleeps_or_another_role_runs():
    from types import SimpleNamespace

    for scheduler, why in (
        (SchedulerStandIn(SimpleNamespace(poller=PollSpy()), busy=False), "SGLang fully idle: its on_idle slept already"),
        (SchedulerStandIn(SimpleNamespace(poller=PollSpy()), role_yields=False), "MD or a plain server"),
        (SchedulerStandIn(None), "no --sleep-on-idle: the operator chose spinning"),
    ):
        on_idle_hook(scheduler)
        sleeper = scheduler.idle_sleeper
        assert sleeper is None or sleeper.poller.calls == [], why
    busy = SchedulerStandIn(SimpleNamespace(poller=PollSpy()))
    on_idle_hook(busy)
    assert busy.idle_sleeper.poller.calls == [1]
