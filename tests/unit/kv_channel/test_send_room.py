"""The WAN sender's per-room state machine (kv_channel/send_room.py), without sockets."""

import pytest

from sglang_pdd.machine import fold
from sglang_pdd.kv_channel import send_room as sr
from sglang_pdd.kv_channel.contract import FailureReason, RoomState

CHUNKS, BYTES = 3, 3000


def run(room, *events):
    return fold(sr.transition, room, *events)


def fresh(session_up=False):
    return sr.start(CHUNKS, BYTES, session_up)


ALL_CHUNKS = [sr.ChunkQueued()] * CHUNKS


def test_start_depends_on_the_session():
    assert fresh(False).state is RoomState.BOOTSTRAPPING
    assert fresh(True).state is RoomState.WAITING_FOR_INPUT


@pytest.mark.parametrize("up_after", range(CHUNKS + 2))
def test_happy_path_whenever_the_session_comes_up(up_after):
    """SessionUp after 0..N chunks or after the END: the room ends SUCCESS with the ACK, and
    it is TRANSFERRING exactly when the session is up and something was queued."""
    producer = [*ALL_CHUNKS, sr.EndQueued()]
    events = producer[:up_after] + [sr.SessionUp()] + producer[up_after:]
    room = fresh()
    for i, event in enumerate(events):
        room, actions = sr.transition(room, event)
        assert actions == []
        up = i >= up_after
        queued = i if up else i + 1
        expected = RoomState.BOOTSTRAPPING if not up else (
            RoomState.TRANSFERRING if queued else RoomState.WAITING_FOR_INPUT)
        assert room.state is expected, (i, event)
    assert room.end_queued and room.chunks_queued == CHUNKS
    room, actions = sr.transition(room, sr.SendAcked(BYTES))
    assert room.state is RoomState.SUCCESS and actions == [sr.WakeSendWaiters()]
    assert (room.reason, room.detail) == ("", "")


def test_a_room_with_no_chunks_goes_straight_to_the_end():
    room = sr.start(0, 0, True)
    room, _ = run(room, sr.EndQueued())
    assert room.state is RoomState.TRANSFERRING
    room, actions = run(room, sr.SendAcked(0))
    assert room.state is RoomState.SUCCESS and actions == [sr.WakeSendWaiters()]


# Every non-terminal point of the happy path, as the events that reach it.
PREFIXES = {
    "bootstrapping": [],
    "bootstrapping_with_input": [sr.ChunkQueued()],
    "waiting_for_input": [sr.SessionUp()],
    "transferring": [sr.SessionUp(), sr.ChunkQueued()],
    "end_queued": [sr.SessionUp(), *ALL_CHUNKS, sr.EndQueued()],
}


@pytest.mark.parametrize("prefix", PREFIXES)
@pytest.mark.parametrize("tell_peer", [True, False])
def test_fail_in_every_state(prefix, tell_peer):
    room, _ = run(fresh(), *PREFIXES[prefix])
    assert not room.state.is_terminal
    room, actions = sr.transition(room, sr.SendFailed(FailureReason.IDLE_TIMEOUT, "no progress", tell_peer))
    assert room.state is RoomState.FAILED
    assert (room.reason, room.detail) == (FailureReason.IDLE_TIMEOUT, "no progress")
    assert actions == [sr.WakeSendWaiters()] + ([sr.AbortPeer(FailureReason.IDLE_TIMEOUT)] if tell_peer else [])


@pytest.mark.parametrize("prefix", PREFIXES)
def test_owner_abort_in_every_state(prefix):
    """abort() / release(): FAILED(aborted), and the receiver is told."""
    room, _ = run(fresh(), *PREFIXES[prefix])
    room, actions = sr.transition(room, sr.SendFailed(FailureReason.ABORTED, "released by owner"))
    assert (room.state, room.reason) == (RoomState.FAILED, FailureReason.ABORTED)
    assert actions == [sr.WakeSendWaiters(), sr.AbortPeer(FailureReason.ABORTED)]


@pytest.mark.parametrize("prefix", PREFIXES)
@pytest.mark.parametrize("total", [BYTES, BYTES - 1])
def test_ack_before_the_end_or_with_the_wrong_count_is_a_protocol_failure(prefix, total):
    room, _ = run(fresh(), *PREFIXES[prefix])
    room, actions = sr.transition(room, sr.SendAcked(total))
    if prefix == "end_queued" and total == BYTES:
        assert room.state is RoomState.SUCCESS
        return
    assert (room.state, room.reason) == (RoomState.FAILED, FailureReason.PROTOCOL)
    assert room.detail == f"premature ACK ({total} bytes)"
    assert actions == [sr.WakeSendWaiters(), sr.AbortPeer(FailureReason.PROTOCOL)]


def terminal_rooms():
    done, _ = run(fresh(True), *ALL_CHUNKS, sr.EndQueued(), sr.SendAcked(BYTES))
    failed, _ = run(fresh(True), sr.ChunkQueued(), sr.SendFailed(FailureReason.CONNECTION_LOST, "reset", False))
    return {"success": done, "failed": failed}


@pytest.mark.parametrize("which", ["success", "failed"])
@pytest.mark.parametrize("late", [sr.SendAcked(BYTES), sr.SendAcked(1), sr.SendFailed(FailureReason.TIMEOUT, "late"),
                                  sr.SendFailed(FailureReason.UNKNOWN_ROOM, "nack", False)])
def test_late_replies_and_failures_after_the_end_are_ignored(which, late):
    room = terminal_rooms()[which]
    assert sr.transition(room, late) == (room, [])


@pytest.mark.parametrize("which", ["success", "failed"])
@pytest.mark.parametrize("event", [sr.SessionUp(), sr.ChunkQueued(), sr.EndQueued()])
def test_producer_and_session_events_after_the_end_are_refused(which, event):
    with pytest.raises(sr.IllegalSendEvent, match="after the room ended"):
        sr.transition(terminal_rooms()[which], event)


@pytest.mark.parametrize("events, match", [
    ([sr.SessionUp(), sr.SessionUp()], "session up, but the room is WAITING_FOR_INPUT"),
    ([*ALL_CHUNKS, sr.ChunkQueued()], "chunk 4 queued, the plan has 3"),
    ([sr.ChunkQueued(), sr.EndQueued()], "2 chunks not queued"),
    ([*ALL_CHUNKS, sr.EndQueued(), sr.EndQueued()], "TRANSFER_END queued twice"),
    ([*ALL_CHUNKS, sr.EndQueued(), sr.ChunkQueued()], "chunk queued after TRANSFER_END"),
    (["not an event"], "unknown event"),
])
def test_invalid_transitions_are_refused(events, match):
    with pytest.raises(sr.IllegalSendEvent, match=match):
        run(fresh(), *events)


def test_transition_never_mutates_its_input():
    room = fresh()
    after, _ = sr.transition(room, sr.ChunkQueued())
    assert room == fresh() and after.chunks_queued == 1
