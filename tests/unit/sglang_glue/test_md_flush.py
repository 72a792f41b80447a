"""SGLang's /flush_cache on MD: refused while rooms of requests in flight hold radix prefixes
or pool pages for KV still crossing the WAN (a flush would hand them out again and MD's
scheduler would die on its own pool check), done as usual otherwise. Rooms whose request is
over (KV landing only to fill the cache) go when a flush comes, and a flush held up only by
pages on their way back waits for them: an idle MD always flushes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_pdd.protocol import RegisterRequest, ReleaseRequest
from tests.conftest import require_sglang_import


def room_queries(phases=(), held_tokens=0):
    """MD's flush queries (what the plugin's flush hooks ask) over rooms in the given phases."""
    from sglang_pdd.sglang_glue.md.queries import MdRoomQueries

    rooms = {i: SimpleNamespace(state=SimpleNamespace(phase=p)) for i, p in enumerate(phases)}
    return MdRoomQueries(SimpleNamespace(table=SimpleNamespace(rooms=rooms),
                                         pages=SimpleNamespace(held_tokens=held_tokens)))


def flush(runtime):
    require_sglang_import()
    from sglang_pdd.sglang_glue.plugin import _flush_cache_without_rooms

    flushed = []
    scheduler = SimpleNamespace(_pdd_runtime=runtime)
    result = _flush_cache_without_rooms(lambda s, *a, **k: flushed.append(s) or True, scheduler)
    return result, bool(flushed)


def phases(*names):
    require_sglang_import()
    from sglang_pdd.radix_drc.room_state import DrcPhase

    return [DrcPhase(n) for n in names]


def test_flush_refused_while_rooms_of_requests_in_flight_hold_kv(caplog):
    runtime = room_queries(phases("landing", "ready", "handed_off"))
    assert flush(runtime) == (False, False)
    assert "MD holds 3 PDD rooms of requests in flight (handed_off 1, landing 1, ready 1)" in caplog.text


def test_a_failed_room_holds_nothing_and_does_not_stop_a_flush():
    assert flush(room_queries(phases("failed"))) == (True, True)


def test_flush_refused_while_pages_wait_for_the_wan_to_let_go():
    runtime = room_queries(held_tokens=64)
    assert flush(runtime) == (False, False)
    assert runtime.flush_waits_only_for_pages()
    assert not room_queries(phases("ready"), held_tokens=64).flush_waits_only_for_pages()


def test_flush_runs_when_md_holds_nothing_and_on_other_roles():
    assert flush(room_queries()) == (True, True)
    assert flush(None) == (True, True)  # P, RLD, plain servers: SGLang's own flush


class FakeScheduler:
    """The two Scheduler methods MD's flush hooks wrap, over one real MD rank's runtime."""

    def __init__(self, runtime):
        self._pdd_runtime = runtime
        self.flushes = 0
        self.busy = False  # SGLang's own requests running

    def _flush(self):
        self.flushes += 1
        return True

    def flush_cache(self):
        from sglang_pdd.sglang_glue.plugin import _flush_cache_without_rooms

        return _flush_cache_without_rooms(FakeScheduler._flush, self) if not self.busy else False

    def _sglang_is_fully_idle(self, for_health_check=False, ignore_waiting=False):
        return not self.busy

    def is_fully_idle(self, for_health_check=False, ignore_waiting=False):
        from sglang_pdd.sglang_glue.plugin import _idle_without_md_rooms

        return _idle_without_md_rooms(FakeScheduler._sglang_is_fully_idle, self, for_health_check=for_health_check,
                                      ignore_waiting=ignore_waiting)

    is_fully_idle.__wrapped__ = _sglang_is_fully_idle  # as HookRegistry leaves it


def flush_wrappers(ranks):
    """SGLang's own SchedulerFlushWrapper per rank, its handle wrapped by MD's hook."""
    from sglang.srt.managers.scheduler_components.flush_wrapper import SchedulerFlushWrapper

    out = []
    for md in ranks:
        scheduler, replies = FakeScheduler(md), []
        wrapper = SchedulerFlushWrapper(flush_cache=scheduler.flush_cache, is_fully_idle=scheduler.is_fully_idle,
                                        send_output=lambda reply, req, replies=replies: replies.append(reply))
        out.append((scheduler, wrapper, replies))
    return out


def request_flush(wrappers, timeout_s=None):
    """A FlushCacheReqInput handled on every rank in the same iteration, as SGLang does."""
    from sglang.srt.managers.io_struct import FlushCacheReqInput
    from sglang_pdd.sglang_glue.plugin import _flush_request_on_md
    from sglang.srt.managers.scheduler_components.flush_wrapper import SchedulerFlushWrapper

    return [_flush_request_on_md(SchedulerFlushWrapper.handle, wrapper, FlushCacheReqInput(timeout_s=timeout_s))
            for _, wrapper, _ in wrappers]


def test_rooms_kept_only_for_the_cache_go_on_a_flush_which_waits_for_their_pages():
    """The request ended on RLD while its KV was on the WAN (released with keep_kv): MD would
    hold the room and its pages until the KV lands. A flush drops it, waits (SGLang's
    deferred flush) until every rank's receiver let go of its pages, then flushes on every rank."""
    require_sglang_import()
    from tests.support.md_tp import MdTp

    c = MdTp("mha", 2, 2)
    try:
        free_before = c.ranks[0].ops.allocator.available_size()
        c.call(RegisterRequest(21, list(range(50))))
        assert c.call(ReleaseRequest(21, keep_kv=True)).released is True  # keep_kv: landing only to fill the cache
        assert [md.table.rooms[21].state.phase.value for md in c.ranks] == ["landing_kept"] * 2
        wrappers = flush_wrappers(c.ranks)
        assert request_flush(wrappers) == [None, None]  # deferred: pages on their way back
        assert all(21 not in md.table.rooms for md in c.ranks) and c.ranks[0].held_tokens > 0
        for _ in range(200):
            c.step()
            for _, wrapper, _ in wrappers:
                wrapper.check_pending()
            if all(replies for _, _, replies in wrappers):
                break
        assert [[r.success for r in replies] for _, _, replies in wrappers] == [[True], [True]]
        assert [s.flushes for s, _, _ in wrappers] == [1, 1]
        assert c.ranks[0].ops.allocator.available_size() == free_before
    finally:
        c.close()


def test_a_flush_while_requests_run_is_refused_at_once_as_on_sglang():
    """Pages on their way back do not turn a flush under running requests into a wait."""
    require_sglang_import()
    from tests.support.md_tp import MdTp

    c = MdTp("mha", 1, 2)
    try:
        c.call(RegisterRequest(25, list(range(40))))
        c.call(ReleaseRequest(25))  # its pages wait for the receiver to let go
        assert c.ranks[0].held_tokens > 0
        wrappers = flush_wrappers(c.ranks)
        wrappers[0][0].busy = True
        [reply] = request_flush(wrappers)
        assert reply is not None and reply.success is False and wrappers[0][0].flushes == 0
        c.settle()
    finally:
        c.close()


def test_a_flush_under_a_room_of_a_request_in_flight_is_refused_and_says_why():
    require_sglang_import()
    from tests.support.md_tp import MdTp

    c = MdTp("mha", 1, 2)
    try:
        c.call(RegisterRequest(22, list(range(40))))
        wrappers = flush_wrappers(c.ranks)
        [reply] = request_flush(wrappers)
        assert reply.success is False and wrappers[0][0].flushes == 0
        assert reply.message.startswith("Cache not flushed: MD holds 1 PDD room of requests in flight (landing 1)")
        assert 22 in c.ranks[0].table.rooms  # untouched: its request may still hand off
        c.call(ReleaseRequest(22))
        c.settle()
        assert request_flush(wrappers)[0].success is True
    finally:
        c.close()


@pytest.mark.parametrize("timeout_s", [None, 5.0])
def test_a_flush_with_a_room_in_flight_and_a_timeout_waits_for_the_room(timeout_s):
    """SGLang's deferred flush (``?timeout=``) counts MD's rooms as not idle."""
    require_sglang_import()
    from tests.support.md_tp import MdTp

    c = MdTp("mha", 1, 2)
    try:
        c.call(RegisterRequest(23, list(range(40))))
        wrappers = flush_wrappers(c.ranks)
        [reply] = request_flush(wrappers, timeout_s)
        if timeout_s is None:
            assert reply.success is False
            return
        assert reply is None  # waits
        wrappers[0][1].check_pending()
        assert wrappers[0][2] == []
        c.call(ReleaseRequest(23))
        c.settle()
        wrappers[0][1].check_pending()
        assert [r.success for r in wrappers[0][2]] == [True]
        # a health check never waits for rooms (SGLang piggybacks it on running requests)
        c.call(RegisterRequest(24, list(range(40))))
        assert wrappers[0][0].is_fully_idle(for_health_check=True) and not wrappers[0][0].is_fully_idle()
    finally:
        c.close()


def test_a_registration_that_comes_in_after_its_release_is_refused():
    """The router released the room (its request ended) before the registration, sent on
    another connection, came in: opened anyway, the room would pin its prefix and pages for
    a transfer nobody sends."""
    require_sglang_import()
    from sglang_pdd.radix_drc.rooms import RoomReleased
    from tests.support.md_tp import MdTp

    c = MdTp("mha", 2, 2)
    try:
        assert c.call(ReleaseRequest(31, keep_kv=True)).released is False  # unknown yet
        with pytest.raises(RoomReleased):
            c.call(RegisterRequest(31, list(range(40))))
        assert all(not md.table.rooms and md.held_tokens == 0 for md in c.ranks)
        assert c.ranks[0].counters["late_registrations_refused"] == 1
    finally:
        c.close()
