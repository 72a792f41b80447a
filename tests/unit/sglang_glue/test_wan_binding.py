"""P's WAN binding (sglang_glue/p/wan_binding.py): every path without sockets or SGLang."""

import pytest

from sglang_pdd.machine import fold

from sglang_pdd.sglang_glue.p import wan_binding
from sglang_pdd.sglang_glue.p.wan_binding import (RequestAborted, AbortRoom, ForgetDestination, HoldPages, Initialized, Unbind, OpenRoom, BindingPhase,
                                         Polled, Posted, FanoutOpened, FanoutRefused, CountWaitExpired, Withdrawn)

DEST = "md:1"


def run(leg, *events):
    return fold(wan_binding.transition, leg, *events)


def kinds(actions):
    return [type(a) for a in actions]


def test_destination_at_bind_opens_the_room_at_init():
    leg, actions = run(wan_binding.bound(DEST), Initialized())
    assert leg.phase is BindingPhase.OPENING and kinds(actions) == [OpenRoom]
    leg, actions = run(leg, FanoutOpened())
    assert leg.phase is BindingPhase.OPEN and actions == []


@pytest.mark.parametrize("order", ["post_first", "init_first"])
def test_late_destination_opens_once_both_post_and_init_arrived(order):
    events = [Posted(DEST), Initialized()] if order == "post_first" else [Initialized(), Posted(DEST)]
    leg, actions = run(wan_binding.bound(None), *events)
    assert leg.phase is BindingPhase.OPENING and leg.dest == DEST and kinds(actions) == [OpenRoom]


def test_second_post_and_late_withdrawal_change_nothing_once_known():
    leg, _ = run(wan_binding.bound(None), Posted(DEST), Initialized(), FanoutOpened())
    assert run(leg, Posted("other:2"), Withdrawn()) == (leg, [])


def test_withdrawn_while_awaiting_drops_and_forgets():
    leg, actions = run(wan_binding.bound(None), Withdrawn())
    assert leg.phase is BindingPhase.DROPPED and kinds(actions) == [Unbind, ForgetDestination]
    assert run(leg, Posted(DEST), Initialized(), RequestAborted(), Polled(0, True, 1)) == (leg, [])


def test_refused_room_drops_the_leg():
    leg, actions = run(wan_binding.bound(DEST), Initialized(), FanoutRefused())
    assert leg.phase is BindingPhase.DROPPED and kinds(actions) == [OpenRoom, Unbind, ForgetDestination]


def test_poll_holds_for_a_promised_destination_until_the_wait_ends():
    leg = wan_binding.bound(None)
    leg, actions = run(leg, Initialized(), Polled(now=10.0, succeeded=True, wait_s=0.5))
    assert kinds(actions) == [HoldPages] and leg.wait_deadline == 10.5
    leg, actions = run(leg, Polled(now=10.4, succeeded=True, wait_s=0.5))
    assert kinds(actions) == [HoldPages]
    leg, actions = run(leg, Polled(now=10.5, succeeded=True, wait_s=0.5))
    assert leg.phase is BindingPhase.DROPPED and kinds(actions) == [CountWaitExpired, Unbind, ForgetDestination]


def test_poll_after_rld_failed_does_not_wait_for_a_destination():
    leg, actions = run(wan_binding.bound(None), Initialized(), Polled(now=1.0, succeeded=False, wait_s=5))
    assert leg.phase is BindingPhase.DROPPED and CountWaitExpired in kinds(actions)


def test_poll_of_an_open_room_holds_while_it_copies_then_forgets():
    leg, _ = run(wan_binding.bound(DEST), Initialized(), FanoutOpened())
    assert kinds(run(leg, Polled(1.0, True, 0.5, room_holds=True))[1]) == [HoldPages]
    leg2, actions = run(leg, Polled(1.0, True, 0.5, room_holds=False))
    assert leg2 == leg and kinds(actions) == [ForgetDestination]


@pytest.mark.parametrize("before", [[], [Initialized()]])
def test_abort_before_the_room_opened_drops_without_touching_a_room(before):
    leg, actions = run(wan_binding.bound(None), *before, RequestAborted())
    assert leg.phase is BindingPhase.DROPPED and kinds(actions) == [Unbind, ForgetDestination]


def test_abort_of_an_open_room_aborts_it():
    leg, actions = run(wan_binding.bound(DEST), Initialized(), FanoutOpened(), RequestAborted("gone"))
    assert leg.phase is BindingPhase.DROPPED and AbortRoom("gone") in actions and ForgetDestination() in actions


def test_a_room_answer_without_an_open_request_is_refused():
    with pytest.raises(wan_binding.IllegalBindingEvent, match="FanoutOpened while the WAN binding is destination_known"):
        wan_binding.transition(wan_binding.bound(DEST), FanoutOpened())
    with pytest.raises(wan_binding.IllegalBindingEvent, match="FanoutRefused while the WAN binding is awaiting_destination"):
        wan_binding.transition(wan_binding.bound(None), FanoutRefused())
    with pytest.raises(wan_binding.IllegalBindingEvent, match="unknown event"):
        wan_binding.transition(wan_binding.bound(None), "posted")
