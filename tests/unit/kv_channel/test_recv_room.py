"""The WAN receiver's per-room state machine (kv_channel/recv_room.py), without sockets."""

import pytest

from sglang_pdd.kv_channel import recv_room as rr
from sglang_pdd.kv_channel.contract import FailureReason, RoomState
from sglang_pdd.machine import fold

FRESH = rr.RecvState()
NACK = rr.ReceiveFailed(FailureReason.LAYOUT_MISMATCH, "slice 0: 3 chunks", tell_peer=True)
QUIET = rr.ReceiveFailed(FailureReason.IDLE_TIMEOUT, "no data for 5.0s", tell_peer=False)


def test_data_then_every_byte_verified_is_success_and_wakes_the_waiters():
    status, actions = fold(rr.transition, FRESH, rr.DataArrived())
    assert status.state is RoomState.TRANSFERRING and actions == []
    status, actions = fold(rr.transition, status, rr.DataArrived(), rr.DataArrived(), rr.AllVerified())
    assert status == rr.RecvState(RoomState.SUCCESS) and actions == [rr.WakeReceiveWaiters()]


@pytest.mark.parametrize("before", [[], [rr.DataArrived()]])
def test_a_failure_keeps_its_reason_and_nacks_the_senders_only_when_asked(before):
    status, actions = fold(rr.transition, FRESH, *before, NACK)
    assert status == rr.RecvState(RoomState.FAILED, NACK.reason, NACK.detail)
    assert actions == [rr.WakeReceiveWaiters(), rr.NackSenders(NACK.reason, NACK.detail)]
    status, actions = fold(rr.transition, FRESH, *before, QUIET)
    assert status.reason == FailureReason.IDLE_TIMEOUT and actions == [rr.WakeReceiveWaiters()]


@pytest.mark.parametrize("end", [[rr.DataArrived(), rr.AllVerified()], [QUIET]])
def test_a_late_failure_changes_nothing_and_data_after_the_end_is_a_bug(end):
    done, _ = fold(rr.transition, FRESH, *end)
    assert rr.transition(done, NACK) == (done, [])  # the first outcome stands
    for event in (rr.DataArrived(), rr.AllVerified()):
        with pytest.raises(rr.IllegalRecvEvent, match="after the room ended"):
            rr.transition(done, event)


def test_verified_before_any_data_is_illegal():
    with pytest.raises(rr.IllegalRecvEvent, match="nothing arrived"):
        rr.transition(FRESH, rr.AllVerified())
