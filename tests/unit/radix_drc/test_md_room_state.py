"""MD's room lifecycle (radix_drc/room_state.py) without servers: every legal path, release and
expiry in every phase, late events after the end, illegal events refused and changing nothing."""

from __future__ import annotations

import itertools

import pytest

from sglang_pdd.machine import fold
from sglang_pdd.radix_drc.room_state import (TIMED_OUT, Expired, DrcFailed, FailReason, Failure, ForgetRoom, HandedOff,
                                             IllegalDrcEvent, KvLanded, LockPrompt, DrcState, DrcPhase, Registered,
                                             Released, UnlockAll, transition)
from sglang_pdd.radix_drc.rooms import DrcRoom, RoomStatus

WAN = Failure.wan("checksum", "chunk 3 of layer 2")

# How to reach each live phase from NEW.
ROUTES = {
    DrcPhase.LANDING: [Registered(10.0)],
    DrcPhase.LANDING_KEPT: [Registered(10.0), Released(keep_kv=True)],
    DrcPhase.READY: [Registered(10.0), KvLanded(20.0)],
    DrcPhase.HANDED_OFF: [Registered(10.0), KvLanded(20.0), HandedOff()],
    DrcPhase.FAILED: [Registered(10.0), DrcFailed(WAN)],
    DrcPhase.RELEASED: [Registered(10.0), Released()],
    DrcPhase.EXPIRED: [Registered(10.0), Expired()],
}
LIVE = [DrcPhase.LANDING, DrcPhase.LANDING_KEPT, DrcPhase.READY, DrcPhase.HANDED_OFF, DrcPhase.FAILED]
EVENTS = [Registered(1.0), KvLanded(2.0), DrcFailed(WAN), HandedOff(), Released(), Released(keep_kv=True), Expired()]


def at(phase):
    state, _ = fold(transition, DrcState(), *ROUTES[phase])
    assert state.phase is phase
    return state


def test_landed_handed_off_released():
    state, actions = fold(transition, DrcState(), Registered(10.0), KvLanded(20.0))
    assert actions == [LockPrompt()]
    state, actions = fold(transition, state, HandedOff(), Released())
    assert state == DrcState(DrcPhase.RELEASED, deadline=20.0, landed=True)
    assert actions == [UnlockAll(), ForgetRoom()]


def test_landed_then_released_without_a_handoff_keeps_nothing_locked():
    state, actions = fold(transition, at(DrcPhase.READY), Released(keep_kv=True))
    assert state.phase is DrcPhase.RELEASED and state.landed and state.failure is None
    assert actions == [UnlockAll(), ForgetRoom()]


def test_wan_failure_unlocks_and_waits_for_the_release():
    state, actions = fold(transition, DrcState(), Registered(10.0), DrcFailed(WAN))
    assert state.phase is DrcPhase.FAILED and state.failure == WAN and not state.landed
    assert actions == [UnlockAll()]  # the table keeps the room: a waiter reads why
    state, actions = fold(transition, state, Released())
    assert state.phase is DrcPhase.RELEASED and state.failure == WAN and actions == [UnlockAll(), ForgetRoom()]


def test_kept_room_lands_into_the_cache_and_goes():
    state, actions = fold(transition, at(DrcPhase.LANDING_KEPT), KvLanded(20.0))
    assert state == DrcState(DrcPhase.RELEASED, deadline=20.0, landed=True)
    assert actions == [LockPrompt(), UnlockAll(), ForgetRoom()]


def test_kept_room_that_fails_goes_with_its_reason():
    failure = Failure(FailReason.DRC_FULL, "no slots")
    state, actions = fold(transition, at(DrcPhase.LANDING_KEPT), DrcFailed(failure))
    assert state.phase is DrcPhase.RELEASED and state.failure == failure and not state.landed
    assert actions == [UnlockAll(), ForgetRoom()]


@pytest.mark.parametrize("phase", LIVE)
@pytest.mark.parametrize("keep_kv", [False, True])
def test_release_in_every_phase(phase, keep_kv):
    before = at(phase)
    state, actions = transition(before, Released(keep_kv=keep_kv))
    if keep_kv and phase.landing:  # the KV still lands, into the cache
        assert state == DrcState(DrcPhase.LANDING_KEPT, deadline=before.deadline) and actions == []
    else:  # keep_kv means nothing once the KV landed or failed: the prompt is cached either way
        assert state.phase is DrcPhase.RELEASED and actions == [UnlockAll(), ForgetRoom()]
        assert (state.landed, state.failure, state.deadline) == (before.landed, before.failure, before.deadline)


@pytest.mark.parametrize("phase", LIVE)
def test_expiry_in_every_phase(phase):
    before = at(phase)
    assert before.expired_at(before.deadline) and not before.expired_at(before.deadline - 0.1)
    state, actions = transition(before, Expired())
    assert state.phase is DrcPhase.EXPIRED and actions == [UnlockAll(), ForgetRoom()]
    # KV still in flight at the deadline is a timeout; a landed or failed room keeps what it was
    assert state.failure == (TIMED_OUT if phase.landing else before.failure)
    assert state.landed == before.landed


@pytest.mark.parametrize("phase", [DrcPhase.RELEASED, DrcPhase.EXPIRED])
@pytest.mark.parametrize("event", [KvLanded(2.0), DrcFailed(WAN), Released(), Released(keep_kv=True), Expired()])
def test_late_events_after_the_end_change_nothing(phase, event):
    before = at(phase)
    assert transition(before, event) == (before, [])
    assert not before.expired_at(1e9)  # a forgotten room never expires again


@pytest.mark.parametrize("phase", [DrcPhase.RELEASED, DrcPhase.EXPIRED])
@pytest.mark.parametrize("event", [HandedOff(), Registered(1.0)])
def test_handoff_or_registration_after_the_end_is_refused(phase, event):
    with pytest.raises(IllegalDrcEvent):
        transition(at(phase), event)


ILLEGAL = [(DrcPhase.NEW, e) for e in EVENTS if not isinstance(e, Registered)] + [
    (p, Registered(1.0)) for p in LIVE] + [
    (p, KvLanded(2.0)) for p in (DrcPhase.READY, DrcPhase.HANDED_OFF, DrcPhase.FAILED)] + [
    (p, DrcFailed(WAN)) for p in (DrcPhase.READY, DrcPhase.HANDED_OFF, DrcPhase.FAILED)] + [
    (p, HandedOff()) for p in (DrcPhase.LANDING, DrcPhase.LANDING_KEPT, DrcPhase.FAILED)] + [
    (DrcPhase.HANDED_OFF, HandedOff())]  # a duplicate final handoff


@pytest.mark.parametrize("phase,event", ILLEGAL, ids=lambda v: getattr(v, "value", type(v).__name__))
def test_illegal_events_are_refused(phase, event):
    before = DrcState() if phase is DrcPhase.NEW else at(phase)
    with pytest.raises(IllegalDrcEvent, match=type(event).__name__):
        transition(before, event)


def test_unknown_event_is_refused():
    with pytest.raises(IllegalDrcEvent, match="unknown event"):
        transition(at(DrcPhase.READY), "ready")


def test_every_phase_and_event_is_decided_and_terminal_phases_are_final():
    """Every (phase, event) pair either moves (legal) or raises; no pair is left out, no phase
    is unreachable, nothing leaves a terminal phase."""
    illegal = {(p, type(e), getattr(e, "keep_kv", None)) for p, e in ILLEGAL}
    reached = set()
    for phase, event in itertools.product([DrcPhase.NEW, *ROUTES], EVENTS):
        before = DrcState() if phase is DrcPhase.NEW else at(phase)
        key = (phase, type(event), getattr(event, "keep_kv", None))
        if key in illegal or (phase.terminal and isinstance(event, (HandedOff, Registered))):
            with pytest.raises(IllegalDrcEvent):
                transition(before, event)
            continue
        after, _ = transition(before, event)
        reached.add(after.phase)
        if phase.terminal:
            assert after == before
    assert reached == set(DrcPhase) - {DrcPhase.NEW}


def test_failure_texts_are_what_md_reports():
    assert WAN.text == "checksum: chunk 3 of layer 2"
    assert Failure(FailReason.DRC_FULL, "cannot allocate 64 KV slots").text == "drc_full: cannot allocate 64 KV slots"
    assert TIMED_OUT.text == "timeout"
    assert "TP rank" in Failure(FailReason.TP_RANK).text


@pytest.mark.parametrize("phase,status", [
    (DrcPhase.LANDING, RoomStatus.PENDING), (DrcPhase.LANDING_KEPT, RoomStatus.PENDING), (DrcPhase.READY, RoomStatus.READY),
    (DrcPhase.HANDED_OFF, RoomStatus.READY), (DrcPhase.FAILED, RoomStatus.FAILED), (DrcPhase.RELEASED, RoomStatus.PENDING),
    (DrcPhase.EXPIRED, RoomStatus.FAILED)])
def test_the_status_the_router_sees(phase, status):
    entry = DrcRoom(1, (1, 2), 0, state=at(phase))
    assert entry.status is status
    assert entry.handed_off is (phase is DrcPhase.HANDED_OFF)
    assert entry.reason == ("timeout" if phase is DrcPhase.EXPIRED else WAN.text if phase is DrcPhase.FAILED else "")
    assert entry.report() == {"status": status.value, "reason": entry.reason}
