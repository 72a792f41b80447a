"""P's WAN leg (kv_channel/p_leg.py): every path without sockets or SGLang."""

import pytest

from sglang_pdd.machine import fold

from sglang_pdd.kv_channel import p_leg
from sglang_pdd.kv_channel.p_leg import (Abort, AbortRoom, Forget, Hold, Initialized, NoLeg, OpenRoom, Phase,
                                         Polled, Posted, RoomOpened, RoomRefused, WaitExpired, Withdrawn)

DEST = "md:1"


def run(leg, *events):
    return fold(p_leg.transition, leg, *events)


def kinds(actions):
    return [type(a) for a in actions]


def test_destination_at_bind_opens_the_room_at_init():
    leg, actions = run(p_leg.bound(DEST), Initialized())
    assert leg.phase is Phase.OPENING and kinds(actions) == [OpenRoom]
    leg, actions = run(leg, RoomOpened())
    assert leg.phase is Phase.OPEN and actions == []


@pytest.mark.parametrize("order", ["post_first", "init_first"])
def test_late_destination_opens_once_both_post_and_init_arrived(order):
    events = [Posted(DEST), Initialized()] if order == "post_first" else [Initialized(), Posted(DEST)]
    leg, actions = run(p_leg.bound(None), *events)
    assert leg.phase is Phase.OPENING and leg.dest == DEST and kinds(actions) == [OpenRoom]


def test_second_post_and_late_withdrawal_change_nothing_once_known():
    leg, _ = run(p_leg.bound(None), Posted(DEST), Initialized(), RoomOpened())
    assert run(leg, Posted("other:2"), Withdrawn()) == (leg, [])


def test_withdrawn_while_awaiting_drops_and_forgets():
    leg, actions = run(p_leg.bound(None), Withdrawn())
    assert leg.phase is Phase.DROPPED and kinds(actions) == [NoLeg, Forget]
    assert run(leg, Posted(DEST), Initialized(), Abort(), Polled(0, True, 1)) == (leg, [])


def test_refused_room_drops_the_leg():
    leg, actions = run(p_leg.bound(DEST), Initialized(), RoomRefused())
    assert leg.phase is Phase.DROPPED and kinds(actions) == [OpenRoom, NoLeg, Forget]


def test_poll_holds_for_a_promised_destination_until_the_wait_ends():
    leg = p_leg.bound(None)
    leg, actions = run(leg, Initialized(), Polled(now=10.0, succeeded=True, wait_s=0.5))
    assert kinds(actions) == [Hold] and leg.wait_deadline == 10.5
    leg, actions = run(leg, Polled(now=10.4, succeeded=True, wait_s=0.5))
    assert kinds(actions) == [Hold]
    leg, actions = run(leg, Polled(now=10.5, succeeded=True, wait_s=0.5))
    assert leg.phase is Phase.DROPPED and kinds(actions) == [WaitExpired, NoLeg, Forget]


def test_poll_after_rld_failed_does_not_wait_for_a_destination():
    leg, actions = run(p_leg.bound(None), Initialized(), Polled(now=1.0, succeeded=False, wait_s=5))
    assert leg.phase is Phase.DROPPED and WaitExpired in kinds(actions)


def test_poll_of_an_open_room_holds_while_it_copies_then_forgets():
    leg, _ = run(p_leg.bound(DEST), Initialized(), RoomOpened())
    assert kinds(run(leg, Polled(1.0, True, 0.5, room_holds=True))[1]) == [Hold]
    leg2, actions = run(leg, Polled(1.0, True, 0.5, room_holds=False))
    assert leg2 == leg and kinds(actions) == [Forget]


@pytest.mark.parametrize("before", [[], [Initialized()]])
def test_abort_before_the_room_opened_drops_without_touching_a_room(before):
    leg, actions = run(p_leg.bound(None), *before, Abort())
    assert leg.phase is Phase.DROPPED and kinds(actions) == [NoLeg, Forget]


def test_abort_of_an_open_room_aborts_it():
    leg, actions = run(p_leg.bound(DEST), Initialized(), RoomOpened(), Abort("gone"))
    assert leg.phase is Phase.DROPPED and AbortRoom("gone") in actions and Forget() in actions


def test_a_room_answer_without_an_open_request_is_refused():
    with pytest.raises(p_leg.PLegError, match="RoomOpened while the WAN leg is destination_known"):
        p_leg.transition(p_leg.bound(DEST), RoomOpened())
    with pytest.raises(p_leg.PLegError, match="RoomRefused while the WAN leg is awaiting_destination"):
        p_leg.transition(p_leg.bound(None), RoomRefused())
    with pytest.raises(p_leg.PLegError, match="unknown event"):
        p_leg.transition(p_leg.bound(None), "posted")
