"""P's WAN room (sglang_glue/p/fanout_room.py, driven by sglang_glue/p/wan_fanout.py), without
sockets, threads or a pool."""

import pytest

from sglang_pdd.machine import fold
from sglang_pdd.sglang_glue.p import fanout_room as fr
from sglang_pdd.sglang_glue.p.fanout_room import CopyHold, DropReason, FanoutPhase
from sglang_pdd.kv_channel.contract import FailureReason

QUEUE, ABORT, ALL_SENT = fr.QueueCopy(), fr.AbortSendRooms(), fr.CountSent()


def run(room, *events):
    return fold(fr.transition, room, *events)


def copy_round(more_ready=False):
    return [fr.CopyTaken(True), fr.CopyEnded(more_ready)]


def test_happy_path_one_share():
    room = fr.FanoutState(shares=1)
    room, actions = fr.transition(room, fr.PagesOffered(10))
    assert (room.phase, room.copy, room.pages_offered, actions) == (FanoutPhase.RECEIVING, CopyHold.QUEUED, 10, [QUEUE])
    room, actions = fr.transition(room, fr.CopyTaken(has_work=True))
    assert (room.copy, actions) == (CopyHold.COPYING, [])
    # pages arriving during a copy queue nothing: the copy thread looks again when it ends
    room, actions = fr.transition(room, fr.PagesOffered(10))
    assert (room.copy, room.pages_offered, actions) == (CopyHold.COPYING, 20, [])
    room, actions = fr.transition(room, fr.CopyEnded(more_ready=True))
    assert (room.copy, actions) == (CopyHold.QUEUED, [QUEUE])
    room, actions = run(room, *copy_round(), fr.PagesOffered(20, last=True))
    assert (room.phase, room.copy, room.pages_offered, actions) == (FanoutPhase.OFFERED, CopyHold.QUEUED, 40, [QUEUE])
    assert not room.may_free_pages(copy_done=False)
    room, actions = run(room, *copy_round())
    assert room.copy is CopyHold.IDLE and room.may_free_pages(copy_done=True)
    room, actions = fr.transition(room, fr.ShareEnded())
    assert (room.phase, room.shares_ended, actions) == (FanoutPhase.SENT, 1, [ALL_SENT])
    room, actions = fr.transition(room, fr.RequestEnded())
    assert (room.phase, actions) == (FanoutPhase.SENT, [])
    assert room.may_free_pages(copy_done=True) and room.reason is None and not room.dropped


def test_a_copy_round_with_nothing_ready_leaves_the_room_idle():
    room, _ = run(fr.FanoutState(shares=1), fr.PagesOffered(3))
    room, actions = fr.transition(room, fr.CopyTaken(has_work=False))
    assert (room.copy, actions) == (CopyHold.IDLE, [])
    room, actions = fr.transition(room, fr.PagesOffered(3))
    assert (room.copy, actions) == (CopyHold.QUEUED, [QUEUE])


@pytest.mark.parametrize("shares", [1, 2, 4])
def test_the_room_is_sent_once_every_share_ended(shares):
    room, _ = run(fr.FanoutState(shares=shares), fr.PagesOffered(8, last=True), *copy_round())
    for i in range(shares - 1):
        room, actions = fr.transition(room, fr.ShareEnded())
        assert (room.phase, room.shares_ended, actions) == (FanoutPhase.OFFERED, i + 1, [])
    room, actions = fr.transition(room, fr.ShareEnded())
    assert (room.phase, actions) == (FanoutPhase.SENT, [ALL_SENT])
    with pytest.raises(fr.IllegalFanoutEvent, match=f"TRANSFER_END {shares + 1} of a room with {shares} shares"):
        fr.transition(room, fr.ShareEnded())


def test_shares_ending_before_the_last_offer_are_sent_with_it():
    room, actions = run(fr.FanoutState(shares=1), fr.PagesOffered(8), *copy_round(), fr.ShareEnded())
    assert room.phase is FanoutPhase.RECEIVING and actions == [QUEUE, ALL_SENT]
    room, _ = fr.transition(room, fr.PagesOffered(0, last=True))
    assert room.phase is FanoutPhase.SENT


# Every live point of the room: (the events that reach it, its copy slot there).
LIVE = {
    "new": ([], CopyHold.IDLE),
    "receiving_queued": ([fr.PagesOffered(4)], CopyHold.QUEUED),
    "receiving_copying": ([fr.PagesOffered(4), fr.CopyTaken(True)], CopyHold.COPYING),
    "receiving_idle": ([fr.PagesOffered(4), *copy_round()], CopyHold.IDLE),
    "offered_copying": ([fr.PagesOffered(4, last=True), fr.CopyTaken(True)], CopyHold.COPYING),
    "offered_idle": ([fr.PagesOffered(4, last=True), *copy_round()], CopyHold.IDLE),
    "one_share_ended": ([fr.PagesOffered(4, last=True), *copy_round(), fr.ShareEnded()], CopyHold.IDLE),
    "sent": ([fr.PagesOffered(4, last=True), *copy_round(), fr.ShareEnded(), fr.ShareEnded()], CopyHold.IDLE),
}
FAILURES = [fr.FanoutFailed(DropReason.STAGING_BUDGET, "staging budget of 1024 bytes exhausted"),
            fr.FanoutFailed(DropReason.COPY_FAILED, "copy failed: boom"),
            fr.FanoutFailed(DropReason.SEND_FAILED, "WAN send failed: boom"),
            fr.FanoutFailed(DropReason.SHARE_FAILED, "receiver: bad layout", FailureReason.LAYOUT_MISMATCH)]


def live(name):
    room, _ = run(fr.FanoutState(shares=2), *LIVE[name][0])
    assert room.copy is LIVE[name][1] and not room.dropped
    return room


def finish_copy(room):
    """What the copy thread does next with a dropped room, whatever its hold on it."""
    if room.copy is CopyHold.QUEUED:
        room, actions = fr.transition(room, fr.CopyTaken(has_work=True))
        assert room.copy is CopyHold.IDLE and actions == []  # a dropped room is not copied
    elif room.copy is CopyHold.COPYING:
        room, actions = fr.transition(room, fr.CopyEnded(more_ready=True))
        assert room.copy is CopyHold.IDLE and actions == []  # nor copied again
    return room


@pytest.mark.parametrize("where", LIVE)
def test_cancel_in_every_state(where):
    room = live(where)
    room, actions = fr.transition(room, fr.Cancel("withdrawn by the router"))
    assert (room.phase, room.reason, room.summary, actions) == (
        FanoutPhase.CANCELLED, DropReason.CANCELLED, "withdrawn by the router", [ABORT])
    # P may free its pages only once no copy reads them
    assert room.may_free_pages(copy_done=False) is (room.copy is CopyHold.IDLE)
    room = finish_copy(room)
    assert room.may_free_pages(copy_done=False)


@pytest.mark.parametrize("where", LIVE)
@pytest.mark.parametrize("fail", FAILURES, ids=lambda f: f.reason.value)
def test_failure_in_every_state(where, fail):
    room, actions = fr.transition(live(where), fail)
    assert (room.phase, room.reason, room.detail, room.share_failure, actions) == (
        FanoutPhase.FAILED, fail.reason, fail.detail, fail.share_failure, [ABORT])
    assert room.summary == (FailureReason.LAYOUT_MISMATCH if fail.reason is DropReason.SHARE_FAILED else fail.detail)
    assert finish_copy(room).may_free_pages(copy_done=False)


@pytest.mark.parametrize("where", LIVE)
def test_request_ending_drops_only_a_room_still_receiving(where):
    before = live(where)
    room, actions = fr.transition(before, fr.RequestEnded())
    if before.phase is FanoutPhase.RECEIVING:
        assert (room.phase, room.reason, room.detail, actions) == (
            FanoutPhase.CANCELLED, DropReason.INCOMPLETE, fr.INCOMPLETE_DETAIL, [ABORT])
    else:
        assert (room, actions) == (before, [])
        assert room.may_free_pages(copy_done=True) and not room.may_free_pages(copy_done=False)


def dropped_rooms():
    cancelled, _ = run(live("receiving_copying"), fr.Cancel("request aborted on P"))
    failed, _ = run(live("offered_idle"), FAILURES[-1])
    return {"cancelled": cancelled, "failed": failed}


@pytest.mark.parametrize("which", ["cancelled", "failed"])
@pytest.mark.parametrize("late", [fr.PagesOffered(4), fr.PagesOffered(4, last=True), fr.ShareEnded(), fr.RequestEnded(),
                                  fr.Cancel("again"), *FAILURES], ids=repr)
def test_late_events_after_a_drop_are_ignored_and_the_first_reason_stands(which, late):
    room = dropped_rooms()[which]
    assert fr.transition(room, late) == (room, [])


@pytest.mark.parametrize("events, match", [
    ([fr.PagesOffered(4, last=True), fr.PagesOffered(1)], "1 pages offered after the last"),
    ([fr.CopyTaken(True)], "copy taken, but the room is idle"),
    ([fr.PagesOffered(4), fr.CopyTaken(True), fr.CopyTaken(True)], "copy taken, but the room is copying"),
    ([fr.CopyEnded(False)], "copy ended, but the room is idle"),
    ([fr.PagesOffered(4), fr.CopyEnded(False)], "copy ended, but the room is queued"),
    ([fr.FanoutFailed(DropReason.CANCELLED)], "cancelled is a cancel, not a failure"),
    ([fr.FanoutFailed(DropReason.INCOMPLETE)], "incomplete is a cancel, not a failure"),
    ([fr.FanoutFailed(DropReason.SHARE_FAILED, "no reason")], "comes with SHARE_FAILED"),
    ([fr.FanoutFailed(DropReason.SEND_FAILED, "x", FailureReason.TIMEOUT)], "comes with SHARE_FAILED"),
    (["not an event"], "unknown event"),
])
def test_invalid_transitions_are_refused(events, match):
    with pytest.raises(fr.IllegalFanoutEvent, match=match):
        run(fr.FanoutState(shares=1), *events)


def test_copy_thread_events_still_refused_when_they_cannot_happen_after_a_drop():
    room, _ = run(fr.FanoutState(shares=1), fr.Cancel("gone"))
    with pytest.raises(fr.IllegalFanoutEvent, match="copy taken, but the room is idle"):
        fr.transition(room, fr.CopyTaken(True))
