"""The acceptor's handshake slot (kv_channel/handshake_slot.py), without sockets or threads."""

import pytest

from sglang_pdd.kv_channel import handshake_slot as hs
from sglang_pdd.kv_channel.handshake_slot import SlotPhase
from sglang_pdd.machine import fold

FRESH = hs.SlotState(deadline=10.0)


def test_passing_the_handshake_gives_the_slot_back_as_authenticated_once():
    state, actions = fold(hs.transition, FRESH, hs.DeadlineChecked(9.9), hs.HandshakePassed())
    assert state.phase is SlotPhase.AUTHENTICATED and actions == [hs.LeaveHandshake(authenticated=True)]
    # the deadline and the connection's end come later and change nothing
    assert fold(hs.transition, state, hs.DeadlineChecked(99.0), hs.ServeEnded()) == (state, [])


def test_the_deadline_cuts_a_slot_off_then_passing_comes_too_late():
    state, actions = fold(hs.transition, FRESH, hs.DeadlineChecked(10.0))
    assert state.phase is SlotPhase.EXPIRED and actions == [hs.LeaveHandshake(authenticated=False)]
    assert hs.transition(state, hs.HandshakePassed()) == (state, [])


def test_serve_returning_in_its_handshake_fails_the_slot():
    state, actions = fold(hs.transition, FRESH, hs.ServeEnded(), hs.HandshakePassed(), hs.DeadlineChecked(11.0))
    assert state.phase is SlotPhase.FAILED and actions == [hs.LeaveHandshake(authenticated=False)]


def test_an_unknown_event_is_illegal():
    with pytest.raises(hs.IllegalSlotEvent, match="unknown event"):
        hs.transition(FRESH, "authenticated")
