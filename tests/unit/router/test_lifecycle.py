"""router/flow/lifecycle.py: every legal and illegal transition of a request, without HTTP or asyncio."""

from __future__ import annotations

import pytest

from sglang_pdd.handoff.policy import HandoffConfig
from sglang_pdd.machine import fold
from sglang_pdd.router.flow.fallback import Fallback, Reason, Recovery
from sglang_pdd.router.flow.lifecycle import (AbortLegs, Broken, DeliverAfterEnd, ClientDisconnected, CutReady, Destination,
                                         DestinationDelivered, Ended, FailRequest, Finish, AbandonHandoff,
                                         CommitHandoff, IllegalRequestEvent, MainFailed, EmitMainOutput, MainTokens, Md,
                                         MdNotReady, MdReady, PathChosen, RequestPhase, RecordFallback, RecoveryMode,
                                         ReleaseAll, RelayFailed, RelayStalled, EmitRelayOutput, RelayTokens, SendCatchUpBatch,
                                         SendFinalHandoff, StartHandoff, StartMdSide, StartRelayLeg, RequestState, Timeout,
                                         WatchMd, WithdrawDestination, transition)
from sglang_pdd.router.flow.lifecycle import Event
from sglang_pdd.router.policy import Path

MAX_NEW = 20
WAN_X = Fallback(Reason.WAN_FAILED, "x")
LENGTH = {"type": "length", "length": MAX_NEW}
STOP = {"type": "stop", "matched": 2}
LENGTH_SHORT = {"type": "length", "length": 1}  # P->MD's one-token relay leg


def kinds(actions) -> list[str]:
    return [type(a).__name__ for a in actions]


def started(path: Path = Path.P_RLD_MD, late: bool = False) -> RequestState:
    state, _ = transition(RequestState(max_new=MAX_NEW), PathChosen(path, late))
    return state


def handing_off(cut: int = 5) -> RequestState:
    state, actions = fold(transition, started(), RelayTokens(1, cut), MdReady(), CutReady())
    assert state.phase is RequestPhase.HANDING_OFF and SendFinalHandoff(cut=cut) in actions
    return state


def in_main(cut: int = 5, produced: int = 7) -> RequestState:
    state, _ = transition(handing_off(cut), MainTokens(produced))
    assert state.phase is RequestPhase.MAIN
    return state


# ------------------------------------------------------------------------------ start
@pytest.mark.parametrize("path, late, expect", [
    (Path.P_RLD_MD, False, [StartRelayLeg(1, 0, one_token=False, wan=True), StartMdSide(False)]),
    (Path.P_RLD_MD, True, [StartRelayLeg(1, 0, one_token=False, wan=True, late_destination=True), StartMdSide(True)]),
    (Path.P_MD, False, [StartRelayLeg(1, 0, one_token=True, wan=True), StartMdSide(False)]),
    (Path.P_RLD_ONLY, False, [StartRelayLeg(1, 0, one_token=False, wan=False)]),
])
def test_path_chosen_starts_the_legs(path, late, expect):
    state, actions = transition(RequestState(max_new=MAX_NEW), PathChosen(path, late))
    assert actions == expect
    assert state.phase is RequestPhase.RELAY and state.leg == 1
    assert state.md is (Md.NONE if path is Path.P_RLD_ONLY else Md.PENDING)


@pytest.mark.parametrize("event", [RelayTokens(1, 1), RelayFailed(1, "x"), RelayStalled(1, "x"), MdReady(),
                                   MdNotReady(WAN_X), CutReady(),
                                   MainTokens(1), MainFailed("x")])
def test_nothing_but_the_path_before_the_path(event):
    with pytest.raises(IllegalRequestEvent):
        transition(RequestState(max_new=MAX_NEW), event)


def test_path_chosen_twice_is_illegal():
    with pytest.raises(IllegalRequestEvent):
        transition(started(), PathChosen(Path.P_MD))


def test_timeout_and_disconnect_are_legal_from_the_start():
    assert fold(transition, RequestState(max_new=MAX_NEW), Timeout("late"))[1] == [FailRequest("late")]
    state, actions = transition(RequestState(max_new=MAX_NEW), ClientDisconnected())
    assert state.phase is RequestPhase.CLOSED and actions == []


# ------------------------------------------------------------------------------ relay
def test_relay_tokens_are_emitted_and_rld_finishing_ends_the_request():
    state, actions = fold(transition, started(Path.P_RLD_ONLY), RelayTokens(1, 3), RelayTokens(1, MAX_NEW, LENGTH))
    assert state.phase is RequestPhase.DONE and state.emitted == MAX_NEW
    assert actions == [EmitRelayOutput(), EmitRelayOutput(), Finish(LENGTH)]


def test_rld_stopping_early_ends_the_request():
    state, actions = fold(transition, started(), RelayTokens(1, 4, STOP))
    assert state.phase is RequestPhase.DONE and actions[-1] == Finish(STOP)


def test_relay_tokens_going_backwards_or_past_the_budget_are_illegal():
    state = fold(transition, started(), RelayTokens(1, 5))[0]
    with pytest.raises(IllegalRequestEvent):
        transition(state, RelayTokens(1, 4))
    with pytest.raises(IllegalRequestEvent):
        transition(state, RelayTokens(1, MAX_NEW + 1))
    with pytest.raises(IllegalRequestEvent):
        transition(state, RelayTokens(2, 6))  # a leg that was never started


def test_rld_death_fails_the_request():
    state, actions = fold(transition, started(), RelayTokens(1, 2), RelayFailed(1, "connection reset"))
    assert state.phase is RequestPhase.FAILED and actions[-1] == FailRequest("relay leg failed: connection reset")


def test_rld_death_while_handing_off_fails_the_request():
    state, actions = transition(handing_off(), RelayFailed(1, "gone"))
    assert state.phase is RequestPhase.FAILED and isinstance(actions[-1], FailRequest)


def test_rld_death_after_md_took_over_is_ignored():
    state = in_main()
    assert transition(state, RelayFailed(1, "aborted")) == (state, [])
    assert transition(state, RelayTokens(1, 9)) == (state, [])  # RLD's late tokens: dropped


# ------------------------------------------------------------------------------ a stalled relay leg
STALL = "RLD: no new token within 30 s"


def test_a_stalled_leg_without_md_fails_the_request_with_what_the_client_has():
    state, actions = fold(transition, started(Path.P_RLD_ONLY), RelayTokens(1, 4), RelayStalled(1, STALL))
    assert state.phase is RequestPhase.FAILED and state.emitted == 4
    assert actions[-1] == FailRequest(f"relay leg 1 stalled: {STALL}")


def test_a_stalled_leg_before_the_first_token_fails_even_with_md_ready():
    """Nothing to hand MD (no first token): the request fails (the router may retry it elsewhere)."""
    state, actions = fold(transition, started(), MdReady(), RelayStalled(1, STALL))
    assert state.phase is RequestPhase.FAILED and isinstance(actions[-1], FailRequest)


def test_a_stalled_leg_with_mds_kv_coming_waits_for_md_to_take_over():
    state, actions = fold(transition, started(), RelayTokens(1, 3), RelayStalled(1, STALL))
    assert state.phase is RequestPhase.RELAY and state.relay_stalled
    assert kinds(actions)[-1] == "RecordFallback" and actions[-1].fallback.reason is Reason.RELAY_STALLED
    assert not any(isinstance(a, (FailRequest, AbortLegs, StartRelayLeg)) for a in actions)
    state, actions = fold(transition, state, MdReady(), CutReady())
    assert state.phase is RequestPhase.HANDING_OFF and SendFinalHandoff(cut=3) in actions
    state, actions = transition(state, MainTokens(5))
    assert state.phase is RequestPhase.MAIN and state.emitted == 5  # MD goes on from the client's 3 tokens


@pytest.mark.parametrize("md_gone", [MdNotReady(WAN_X), MainFailed("MD refused")])
def test_a_stalled_leg_fails_once_md_cannot_take_over_either(md_gone):
    state, _ = fold(transition, started(), RelayTokens(1, 3), RelayStalled(1, STALL))
    if isinstance(md_gone, MainFailed):
        state, _ = transition(state, MdReady())
    state, actions = transition(state, md_gone)
    assert state.phase is RequestPhase.FAILED and state.emitted == 3
    assert isinstance(actions[-1], FailRequest) and "stalled" in actions[-1].message


def test_a_stalled_leg_while_handing_off_leaves_it_to_md():
    state, actions = transition(handing_off(cut=5), RelayStalled(1, STALL))
    assert state.phase is RequestPhase.HANDING_OFF and kinds(actions) == ["RecordFallback"]
    committed, _ = transition(state, MainTokens(6))
    assert committed.phase is RequestPhase.MAIN


def test_md_failing_after_the_relay_stalled_releases_rlds_held_back_tokens_then_ends():
    """RLD produced 8 while the handoff at 5 waited for MD: the client gets all 8 (nothing lost),
    then the end, instead of a wait for a relay leg that will not go on."""
    state, _ = fold(transition, handing_off(cut=5), RelayTokens(1, 8), RelayStalled(1, STALL))
    assert state.emitted == 5  # the client has the tokens up to the cut; 6-8 are held back
    state, actions = transition(state, MainFailed("no first token within 3 s"))
    assert state.phase is RequestPhase.FAILED and state.emitted == 8
    assert kinds(actions) == ["RecordFallback", "AbandonHandoff", "FailRequest"]


def test_a_stall_of_a_superseded_leg_or_after_md_took_over_changes_nothing():
    state = in_main()
    assert transition(state, RelayStalled(1, STALL)) == (state, [])
    state, _ = fold(transition, started(Path.P_MD), RelayTokens(1, 1, LENGTH_SHORT), MdNotReady(WAN_X))
    assert state.leg == 2 and not state.relay_stalled
    assert transition(state, RelayStalled(1, STALL)) == (state, [])


# ------------------------------------------------------------------------------ MD ready / handoff
def test_md_ready_after_first_token_starts_the_handoff():
    state, actions = fold(transition, started(), RelayTokens(1, 3), MdReady())
    assert state.md is Md.READY and actions[-1] == StartHandoff()


def test_md_ready_before_first_token_waits_for_it():
    state, actions = fold(transition, started(), MdReady())
    assert actions == [] and state.handoff_on_first_token
    state, actions = transition(state, RelayTokens(1, 1))
    assert actions == [EmitRelayOutput(), StartHandoff()] and not state.handoff_on_first_token


def test_md_ready_before_first_token_no_handoff_if_rld_finishes_with_it():
    state, actions = fold(transition, started(), MdReady(), RelayTokens(1, 1, STOP))
    assert state.phase is RequestPhase.DONE and StartHandoff() not in actions


def test_md_ready_twice_is_illegal():
    state = fold(transition, started(), MdReady())[0]
    for event in (MdReady(), MdNotReady(WAN_X)):
        with pytest.raises(IllegalRequestEvent):
            transition(state, event)


def test_md_ready_without_md_is_illegal():
    with pytest.raises(IllegalRequestEvent):
        transition(started(Path.P_RLD_ONLY), MdReady())


def test_cut_freezes_the_stream_and_rld_tokens_are_held_back():
    state = handing_off(cut=5)
    state, actions = transition(state, RelayTokens(1, 8))
    assert actions == [EmitRelayOutput()] and state.emitted == 5 and state.relay_produced == 8


def test_cut_after_the_request_used_its_budget_does_nothing():
    state = fold(transition, started(), RelayTokens(1, MAX_NEW), MdReady())[0]
    assert transition(state, CutReady()) == (state, [])


def test_cut_without_md_ready_or_twice_is_illegal():
    with pytest.raises(IllegalRequestEvent):
        transition(fold(transition, started(), RelayTokens(1, 2))[0], CutReady())
    with pytest.raises(IllegalRequestEvent):
        transition(handing_off(), CutReady())


def test_md_first_token_past_the_cut_commits_the_handoff():
    state, actions = transition(handing_off(cut=5), MainTokens(5))  # the eager tokens only
    assert actions == [] and state.phase is RequestPhase.HANDING_OFF
    state, actions = transition(state, MainTokens(6))
    assert actions == [CommitHandoff(), EmitMainOutput()] and state.phase is RequestPhase.MAIN and state.emitted == 6
    state, actions = transition(state, MainTokens(MAX_NEW, LENGTH))
    assert actions == [EmitMainOutput(), Finish(LENGTH)] and state.phase is RequestPhase.DONE and state.emitted == MAX_NEW


def test_md_finishing_in_its_first_event():
    state, actions = transition(handing_off(cut=5), MainTokens(MAX_NEW, LENGTH))
    assert actions == [CommitHandoff(), EmitMainOutput(), Finish(LENGTH)]


def test_md_tokens_before_any_handoff_or_backwards_or_past_budget_are_illegal():
    with pytest.raises(IllegalRequestEvent):
        transition(fold(transition, started(), RelayTokens(1, 2), MdReady())[0], MainTokens(3))
    with pytest.raises(IllegalRequestEvent):
        transition(in_main(produced=8), MainTokens(7))
    with pytest.raises(IllegalRequestEvent):
        transition(in_main(), MainTokens(MAX_NEW + 1))


def test_rld_finishing_first_while_handing_off_keeps_rlds_tokens():
    state, actions = transition(handing_off(cut=5), RelayTokens(1, 9, STOP))
    assert actions == [EmitRelayOutput(), AbandonHandoff(), Finish(STOP)]
    assert state.phase is RequestPhase.DONE and state.emitted == 9


# ------------------------------------------------------------------------------ faults
def test_wan_failure_rld_finishes():
    boom = Fallback(Reason.WAN_FAILED, "boom")
    state, actions = fold(transition, started(), RelayTokens(1, 3), MdNotReady(boom))
    assert actions[-1] == RecordFallback(boom) and state.md is Md.FAILED and state.phase is RequestPhase.RELAY
    state, actions = transition(state, RelayTokens(1, MAX_NEW, LENGTH))
    assert state.phase is RequestPhase.DONE


def test_timeout_while_waiting_for_md():
    state, actions = transition(fold(transition, started(), RelayTokens(1, 3))[0], Timeout("deadline"))
    assert state.phase is RequestPhase.FAILED and actions == [FailRequest("deadline")]


@pytest.mark.parametrize("order", ["leg_ends_then_not_ready", "not_ready_then_leg_ends"])
def test_p_md_wan_failure_after_the_bridge_token_recovers_on_a_new_leg(order):
    events = [RelayTokens(1, 1, {"type": "length", "length": 1}), MdNotReady(Fallback(Reason.WAN_FAILED, "x"))]
    if order == "not_ready_then_leg_ends":
        events = events[::-1]
    state, actions = fold(transition, started(Path.P_MD), *events)
    assert actions[-3:] == [RecordFallback(Fallback.recovered(Recovery.WAN_FAILED_AFTER_RLD)), AbortLegs(),
                            StartRelayLeg(2, resume_len=1, one_token=False, wan=False)]
    assert state.leg == 2 and state.phase is RequestPhase.RELAY and state.relay_produced == 1


def test_p_md_wan_failure_before_the_bridge_token():
    state, actions = fold(transition, started(Path.P_MD), MdNotReady(Fallback(Reason.WAN_FAILED, "x")))
    assert AbortLegs() not in actions  # RLD's bridge leg still runs
    state, actions = transition(state, RelayTokens(1, 1, {"type": "length", "length": 1}))
    assert actions[-1] == StartRelayLeg(2, resume_len=1, one_token=False, wan=False)


@pytest.mark.parametrize("relay_idle", [False, True])
def test_md_refusing_the_handoff_releases_rlds_tokens(relay_idle):
    if relay_idle:  # P->MD: the one-token bridge leg ended already
        state = fold(transition, started(Path.P_MD), RelayTokens(1, 1, {"type": "length", "length": 1}), MdReady(),
                      CutReady())[0]
    else:
        state = fold(transition, handing_off(cut=5), RelayTokens(1, 8))[0]
    state, actions = transition(state, MainFailed("HTTP 409"))
    assert actions[:2] == [RecordFallback(Fallback(Reason.MD_FAILED, "HTTP 409")), AbandonHandoff()]
    assert state.md is Md.FAILED and state.cut is None
    if relay_idle:
        assert actions[-1] == StartRelayLeg(2, resume_len=1, one_token=False, wan=False)
    else:
        assert state.phase is RequestPhase.RELAY and state.emitted == 8 and actions[-1] == AbandonHandoff()
        # late MD events after the failed handoff are dropped; RLD finishes
        assert transition(state, MainTokens(9)) == (state, [])
        assert transition(state, RelayTokens(1, MAX_NEW, LENGTH))[0].phase is RequestPhase.DONE


def test_md_death_mid_stream_recovers_on_a_new_leg_from_what_the_client_has():
    state, actions = transition(in_main(cut=5, produced=9), MainFailed("connection reset"))
    assert actions == [RecordFallback(Fallback(Reason.MD_FAILED, "connection reset")),
                       RecordFallback(Fallback.recovered(Recovery.MD_FAILED_MID_STREAM)), AbortLegs(),
                       StartRelayLeg(2, resume_len=9, one_token=False, wan=False)]
    assert state.phase is RequestPhase.RELAY and state.leg == 2 and state.relay_produced == 9
    # the old leg's stragglers are ignored; the new leg reports from position 0 (resumed ones too)
    assert transition(state, RelayTokens(1, 12)) == (state, [])
    assert transition(state, RelayFailed(1, "aborted")) == (state, [])
    state, actions = fold(transition, state, RelayTokens(2, 9), RelayTokens(2, 10), RelayTokens(2, MAX_NEW, LENGTH))
    assert state.phase is RequestPhase.DONE and state.emitted == MAX_NEW and actions[-1] == Finish(LENGTH)


def test_recovery_leg_going_behind_the_resume_point_is_illegal():
    state = transition(in_main(cut=5, produced=9), MainFailed("x"))[0]
    with pytest.raises(IllegalRequestEvent):
        transition(state, RelayTokens(2, 8))


def test_catch_up_warmup_failure_rld_finishes():
    state = fold(transition, started(), RelayTokens(1, 3), MdReady())[0]
    state, actions = transition(state, MainFailed("warmup HTTP 500"))
    assert actions == [RecordFallback(Fallback(Reason.MD_FAILED, "warmup HTTP 500"))] and state.phase is RequestPhase.RELAY
    with pytest.raises(IllegalRequestEvent):  # no cut after MD failed
        transition(state, CutReady())


def test_md_failure_without_md_is_illegal():
    with pytest.raises(IllegalRequestEvent):
        transition(started(Path.P_RLD_ONLY), MainFailed("x"))


@pytest.mark.parametrize("make", [started, handing_off, in_main])
def test_client_disconnect_from_any_running_phase(make):
    state, actions = transition(make(), ClientDisconnected())
    assert state.phase is RequestPhase.CLOSED and actions == []


@pytest.mark.parametrize("terminal", [RequestPhase.DONE, RequestPhase.FAILED, RequestPhase.CLOSED])
@pytest.mark.parametrize("event", [PathChosen(Path.P_MD), RelayTokens(1, 1), RelayFailed(1, "x"), RelayStalled(1, "x"),
                                   MdReady(), MdNotReady(WAN_X), CutReady(), MainTokens(1), MainFailed("x"), Timeout(),
                                   ClientDisconnected(), DestinationDelivered()])
def test_no_event_after_the_end(terminal, event):
    with pytest.raises(IllegalRequestEvent):
        transition(RequestState(max_new=MAX_NEW, phase=terminal), event)


def test_random_event_orders_keep_the_invariants():
    """Whatever order the backends' events arrive in, a legal run never lets the client's
    position go backwards, never exceeds the budget, and ends at most once."""
    import random
    rng = random.Random(7)
    for _ in range(3000):
        state = started(rng.choice(list(Path)), rng.random() < 0.5)
        produced = {"rld": 0, "md": 0}
        for _step in range(30):
            if state.phase.terminal:
                break
            pick = rng.randrange(7)
            if pick == 0:
                produced["rld"] = min(MAX_NEW, max(produced["rld"], state.relay_produced) + rng.randint(0, 3))
                fin = LENGTH if produced["rld"] == MAX_NEW else None
                event = RelayTokens(state.leg, produced["rld"], fin)
            elif pick == 1:
                event = MdReady() if rng.random() < 0.7 else MdNotReady(WAN_X)
            elif pick == 2:
                event = CutReady()
            elif pick == 3:
                produced["md"] = min(MAX_NEW, max(produced["md"], (state.cut or 0) + rng.randint(0, 3)))
                event = MainTokens(produced["md"], LENGTH if produced["md"] == MAX_NEW else None)
            elif pick == 4:
                event = MainFailed("x")
            elif pick == 5:
                event = RelayFailed(state.leg, "x") if rng.random() < 0.1 else RelayTokens(max(1, state.leg - 1), 0)
            else:
                event = Timeout() if rng.random() < 0.05 else ClientDisconnected() if rng.random() < 0.05 else CutReady()
            before = state
            try:
                state, actions = transition(state, event)
            except IllegalRequestEvent:
                assert state is before
                continue
            assert state.emitted >= before.emitted and state.emitted <= MAX_NEW
            assert len([a for a in actions if isinstance(a, (Finish, FailRequest))]) <= 1
            if any(isinstance(a, StartRelayLeg) for a in actions) and before.phase is not RequestPhase.STARTING:
                produced["rld"] = state.emitted  # the new leg counts from 0, resumed positions included
            if isinstance(event, MainFailed) and state.md is Md.FAILED:
                produced["md"] = 0


def test_fast_replace_matches_dataclasses_replace():
    import dataclasses

    from sglang_pdd.router.flow import lifecycle
    s = lifecycle.RequestState(max_new=9, emitted=2)
    fast = lifecycle._replace(s, phase=lifecycle.RequestPhase.MAIN, cut=3)
    assert fast == dataclasses.replace(s, phase=lifecycle.RequestPhase.MAIN, cut=3) and s.cut is None
    assert hash(fast) == hash(dataclasses.replace(fast))
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.cut = 4
    with pytest.raises(TypeError):
        lifecycle._replace(s, emited=3)


# ------------------------------------------------------------------------------ P's late WAN destination
def late(room: int = 77) -> RequestState:
    state, actions = transition(RequestState(max_new=MAX_NEW), PathChosen(Path.P_RLD_MD, True, p_room=room))
    assert state.destination is Destination.PENDING and state.p_room == room
    assert actions[0].late_destination and actions[1] == StartMdSide(True)
    return state


def test_a_path_without_md_has_no_destination_to_wait_for():
    state, actions = transition(RequestState(max_new=MAX_NEW), PathChosen(Path.P_RLD_ONLY, True, p_room=5))
    assert state.destination is Destination.NONE and not actions[0].late_destination


def test_a_delivered_destination_waits_for_mds_kv():
    state, actions = transition(late(), DestinationDelivered())
    assert state.destination is Destination.DELIVERED and actions == [WatchMd()]
    with pytest.raises(IllegalRequestEvent):  # P gets it once
        transition(state, DestinationDelivered())
    state, actions = transition(state, MdNotReady(WAN_X))  # the KV never landed: nothing to withdraw on P
    assert actions == [RecordFallback(WAN_X)] and state.destination is Destination.DELIVERED


def test_md_refusing_withdraws_the_pending_destination():
    refused = Fallback(Reason.MD_UNAVAILABLE, "full")
    state, actions = fold(transition, late(room=9), RelayTokens(1, 2), MdNotReady(refused))
    assert actions[-2:] == [RecordFallback(refused), WithdrawDestination(9)]
    assert state.destination is Destination.DROPPED and state.md is Md.FAILED
    state = transition(state, Timeout())[0]
    assert transition(state, Ended())[1] == [ReleaseAll(keep_md_kv=False)]  # withdrawn once


@pytest.mark.parametrize("end", [Timeout(), ClientDisconnected(), RelayFailed(1, "gone")])
def test_the_end_of_an_unfinished_request_withdraws_a_destination_still_pending(end):
    """P never got MD's room and nobody wants the KV: MD keeps nothing, P stops waiting."""
    state = transition(late(room=3), end)[0]
    state, actions = transition(state, Ended())
    assert actions == [ReleaseAll(keep_md_kv=False), WithdrawDestination(3)]
    assert state.destination is Destination.DROPPED


@pytest.mark.parametrize("finish", [LENGTH, {"type": "stop", "matched": 2}])
def test_a_request_finished_before_p_got_its_destination_delivers_it_after_the_end(finish):
    """RLD finished before MD answered the registration: MD still gets the KV for the next
    turn, so the destination is delivered after the end and MD's room is that step's."""
    state = transition(late(room=3), RelayTokens(1, MAX_NEW if finish is LENGTH else 4, finish))[0]
    assert state.phase is RequestPhase.DONE
    state, actions = transition(state, Ended())
    assert actions == [ReleaseAll(keep_md_kv=True, md_room=False), DeliverAfterEnd(3)]
    assert state.destination is Destination.AFTER_END


def after_first_token(path: Path = Path.P_RLD_MD, room: int = 77) -> tuple[RequestState, list]:
    return transition(RequestState(max_new=MAX_NEW, md_side_after_first_token=True),
                      PathChosen(path, True, p_room=room))


def test_md_side_after_first_token_starts_with_the_clients_first_token():
    """--md-side-after-first-token: P and RLD start, MD's registration and P's destination
    wait for the first token the client gets, then run as ever."""
    state, actions = after_first_token()
    assert [type(a) for a in actions] == [StartRelayLeg] and actions[0].late_destination
    assert state.md_side_waits and state.md is Md.PENDING and state.destination is Destination.PENDING
    state, actions = transition(state, RelayTokens(1, 0))  # an event without a token: still waiting
    assert StartMdSide(True) not in actions and state.md_side_waits
    state, actions = transition(state, RelayTokens(1, 1))
    assert actions == [EmitRelayOutput(), StartMdSide(True)] and not state.md_side_waits
    state, actions = transition(state, RelayTokens(1, 2))
    assert StartMdSide(True) not in actions  # once
    state, actions = fold(transition, state, DestinationDelivered(), MdReady())
    assert actions == [WatchMd(), StartHandoff()]


def test_md_side_after_first_token_applies_to_the_relay_path_only():
    state, actions = after_first_token(Path.P_MD)  # P->MD's first token is RLD's bridge: MD registers at once
    assert actions[1] == StartMdSide(True) and not state.md_side_waits


def test_a_request_ending_before_its_first_token_with_md_side_waiting_only_withdraws_on_p():
    """MD never heard of it: no room to release; P stops waiting for its destination."""
    state, _ = after_first_token(room=5)
    state = transition(state, RelayFailed(1, "gone"))[0]
    state, actions = transition(state, Ended())
    assert actions == [ReleaseAll(keep_md_kv=False, md_room=False), WithdrawDestination(5)]
    assert state.destination is Destination.DROPPED


def test_a_one_token_request_starts_md_side_and_delivers_after_the_end():
    state, _ = after_first_token(room=5)
    state, actions = transition(state, RelayTokens(1, 1, {"type": "stop"}))
    assert StartMdSide(True) in actions and state.phase is RequestPhase.DONE
    assert transition(state, Ended())[1] == [ReleaseAll(keep_md_kv=True, md_room=False), DeliverAfterEnd(5)]


def test_a_destination_delivered_just_before_the_end_is_not_withdrawn():
    state = transition(late(), RelayTokens(1, MAX_NEW, LENGTH))[0]
    state, actions = transition(state, DestinationDelivered())  # P's answer, queued behind the finish
    assert actions == [] and state.destination is Destination.DELIVERED
    assert transition(state, Ended())[1] == [ReleaseAll(keep_md_kv=True)]


def test_ended_only_after_the_end():
    with pytest.raises(IllegalRequestEvent):
        transition(started(), Ended())


# ------------------------------------------------------------------------------ catch-up rounds
def catching_up(threshold: int = 4, rounds: int = 8) -> RequestState:
    cfg = HandoffConfig(catch_up_threshold_tokens=threshold, max_catch_up_rounds=rounds)
    state, _ = transition(RequestState(max_new=MAX_NEW, catch_up=cfg), PathChosen(Path.P_RLD_MD))
    return state


def test_catch_up_hands_batches_until_the_backlog_fits_one_then_cuts():
    state, actions = fold(transition, catching_up(), RelayTokens(1, 10), MdReady())
    assert actions[-1] == StartHandoff()
    state, actions = transition(state, CutReady())
    assert actions == [SendCatchUpBatch(upto=4, tokens=4, round=0)] and state.phase is RequestPhase.RELAY
    state, actions = fold(transition, state, RelayTokens(1, 11), CutReady())  # backlog 7 > 4: another round
    assert actions[-1] == SendCatchUpBatch(upto=8, tokens=4, round=1)
    state, actions = fold(transition, state, RelayTokens(1, 12), CutReady())  # backlog 4: the final batch
    assert actions[-1] == SendFinalHandoff(cut=12, catch_up_tail=4)
    assert state.phase is RequestPhase.HANDING_OFF and state.handed == 8 and state.catch_up_round == 2


def test_catch_up_ends_after_its_last_allowed_round():
    state = fold(transition, catching_up(rounds=2), RelayTokens(1, 15), MdReady())[0]
    state, actions = transition(state, CutReady())
    assert actions == [SendCatchUpBatch(upto=4, tokens=4, round=0)]
    state, actions = fold(transition, state, RelayTokens(1, 19), CutReady())
    assert actions[-1] == SendFinalHandoff(cut=19, catch_up_tail=15)


def test_one_shot_cuts_at_once():
    state, actions = fold(transition, started(), RelayTokens(1, 10), MdReady(), CutReady())
    assert actions[-1] == SendFinalHandoff(cut=10) and actions[-1].catch_up_tail is None


# ------------------------------------------------------------------------------ recovery modes
@pytest.mark.parametrize("mode, offset, replays", [(RecoveryMode.REPLAY, 0, 9), (RecoveryMode.RESUME, 0, 9),
                                                   (RecoveryMode.CONTINUE, 9, 0)])
def test_a_recovery_leg_continues_as_the_mode_says(mode, offset, replays):
    state = transition(RequestState(max_new=MAX_NEW, recovery=mode), PathChosen(Path.P_RLD_MD))[0]
    state = fold(transition, state, RelayTokens(1, 5), MdReady(), CutReady(), MainTokens(9))[0]
    state, actions = transition(state, MainFailed("gone"))
    leg = actions[-1]
    assert leg == StartRelayLeg(2, resume_len=9, one_token=False, wan=False, mode=mode)
    assert (leg.offset, leg.replays) == (offset, replays)
    # the leg's first output is checked against the client's 9 positions (a replay), once
    state, actions = transition(state, RelayTokens(2, 10))
    assert actions == [EmitRelayOutput(offset=offset, check_replay=replays)]
    state, actions = transition(state, RelayTokens(2, 11))
    assert actions == [EmitRelayOutput(offset=offset, check_replay=0)] if offset else [EmitRelayOutput()]


def test_a_recovery_from_nothing_starts_afresh():
    state = transition(RequestState(max_new=MAX_NEW, recovery=RecoveryMode.CONTINUE), PathChosen(Path.P_MD))[0]
    state, actions = transition(state, RelayTokens(1, 0, LENGTH))  # RLD's bridge ended with no token
    state, actions = transition(state, MdNotReady(WAN_X))
    assert actions[-1] == StartRelayLeg(2, resume_len=0, one_token=False, wan=False, mode=RecoveryMode.RESUME)


def test_a_continue_legs_length_finish_reports_the_whole_budget():
    state = transition(RequestState(max_new=MAX_NEW, recovery=RecoveryMode.CONTINUE), PathChosen(Path.P_RLD_MD))[0]
    state = fold(transition, state, RelayTokens(1, 5), MdReady(), CutReady(), MainTokens(9), MainFailed("gone"))[0]
    own = {"type": "length", "length": MAX_NEW - 9}  # the CONTINUE leg's own, smaller budget
    state, actions = transition(state, RelayTokens(2, MAX_NEW, own))
    assert actions[-1] == Finish({"type": "length", "length": MAX_NEW}) and state.phase is RequestPhase.DONE


@pytest.mark.parametrize("make", [lambda: RequestState(max_new=MAX_NEW), started, handing_off, in_main,
                                  lambda: fold(transition, started(), RelayTokens(1, MAX_NEW, LENGTH))[0]])
def test_a_broken_stream_fails_the_request_even_after_its_finish(make):
    state, actions = transition(make(), Broken("MD repeated a position"))
    assert state.phase is RequestPhase.FAILED and actions == []


# ------------------------------------------------------------------------------ the table
def test_the_table_has_one_row_per_legal_pair_and_no_event_only_rows():
    from sglang_pdd.router.flow.lifecycle import ROWS
    pairs = [(row.status, row.event) for row in ROWS]
    assert len(pairs) == len(set(pairs)) == len(transition.handlers) >= 40
    assert all(isinstance(key, tuple) for key in transition.handlers)  # every row keyed by (phase, event)


@pytest.mark.parametrize("mermaid", [False, True])
def test_the_diagram_lists_every_row(mermaid):
    from sglang_pdd.router.flow.lifecycle import ROWS, diagram
    text = diagram(mermaid=mermaid)
    lines = text.splitlines()
    for row in ROWS:
        phase, event = row.status.value, row.event.__name__
        if mermaid:
            for to in row.to:
                assert any(line.split() == [phase, "-->", f"{to.value}:", event, *line.split()[4:]]
                           for line in lines), (phase, event, to)
        else:
            match = [line for line in lines if line.split()[:2] == [phase, event]]
            assert len(match) == 1, (phase, event)
            assert " | ".join(t.value for t in row.to) in match[0]
    assert len(lines) == (1 + sum(len(row.to) for row in ROWS) if mermaid else len(ROWS))


def test_docs_router_md_holds_the_table_as_the_code_prints_it():
    from tests.conftest import REPO_ROOT
    from sglang_pdd.router.flow.lifecycle import diagram
    assert diagram() in (REPO_ROOT / "docs" / "router.md").read_text(), \
        "docs/router.md's request table is stale: paste `python -m sglang_pdd.router.flow.lifecycle`"


def test_random_runs_take_every_row_and_land_where_the_row_says():
    """Every row is reachable, and every transition ends in a phase its row lists (so the
    printed table cannot promise less than the machine does)."""
    import random
    from sglang_pdd.router.flow.lifecycle import ROWS
    rows = {(row.status, row.event): row for row in ROWS}
    taken = set()
    rng = random.Random(11)
    for _ in range(4000):
        state = RequestState(max_new=MAX_NEW, catch_up=HandoffConfig(catch_up_threshold_tokens=4)
                             if rng.random() < 0.3 else None)
        produced = {"rld": 0, "md": 0}
        for _step in range(40):
            if state.phase is RequestPhase.STARTING:
                event = PathChosen(rng.choice(list(Path)), rng.random() < 0.5) if rng.random() < 0.9 else \
                    rng.choice([Timeout(), ClientDisconnected(), Broken("x"), MdReady()])
            elif state.phase.terminal:
                event = rng.choice([Ended(), Broken("x"), DestinationDelivered()])
            else:
                pick = rng.randrange(9)
                if pick == 0:
                    produced["rld"] = min(MAX_NEW, max(produced["rld"], state.relay_produced) + rng.randint(0, 3))
                    event = RelayTokens(state.leg, produced["rld"], LENGTH if produced["rld"] == MAX_NEW else
                                        STOP if rng.random() < 0.05 else None)
                elif pick == 1:
                    event = MdReady() if rng.random() < 0.7 else MdNotReady(WAN_X)
                elif pick in (2, 3):
                    event = CutReady()
                elif pick == 4:
                    produced["md"] = min(MAX_NEW, max(produced["md"], (state.cut or 0) + rng.randint(0, 3)))
                    event = MainTokens(produced["md"], LENGTH if produced["md"] == MAX_NEW else None)
                elif pick == 5:
                    event = MainFailed("x") if rng.random() < 0.5 else DestinationDelivered()
                elif pick == 6:
                    roll = rng.random()
                    event = RelayFailed(state.leg - rng.randint(0, 1), "x") if roll < 0.2 else \
                        RelayStalled(state.leg - rng.randint(0, 1), "x") if roll < 0.4 else \
                        RelayTokens(max(1, state.leg - 1), 0)
                elif pick == 7:
                    event = RelayTokens(state.leg, min(MAX_NEW, state.relay_produced + 1), {"type": "length"})
                else:
                    event = rng.choice([Timeout(), ClientDisconnected(), Broken("x"), Ended()]) \
                        if rng.random() < 0.1 else CutReady()
            before = state
            try:
                state, _ = transition(state, event)
            except IllegalRequestEvent:
                assert state is before
                continue
            row = rows[before.phase, type(event)]
            assert state.phase in row.to, (before.phase, type(event).__name__, state.phase)
            taken.add((before.phase, type(event)))
            if state.leg != before.leg:
                produced["rld"] = state.emitted
            if isinstance(event, MainFailed):
                produced["md"] = 0
            if isinstance(event, Ended):
                break
    missed = sorted(f"{p.value}/{e.__name__}" for p, e in set(rows) - taken)
    assert missed == []


_ONE_OF_EACH = [PathChosen(Path.P_MD), RelayTokens(1, 1), RelayFailed(1, "x"), RelayStalled(1, "x"), MdReady(), MdNotReady(WAN_X),
                DestinationDelivered(), CutReady(), MainTokens(1), MainFailed("x"), Timeout(), ClientDisconnected(),
                Broken("x"), Ended()]


@pytest.mark.parametrize("phase", list(RequestPhase))
def test_a_pair_the_table_does_not_list_is_illegal(phase):
    from sglang_pdd.router.flow.lifecycle import ROWS
    listed = {row.event for row in ROWS if row.status is phase}
    assert {type(e) for e in _ONE_OF_EACH} == set(Event.__args__)
    state = RequestState(max_new=MAX_NEW, phase=phase, leg=1, md=Md.READY, md_stream=True,
                         destination=Destination.PENDING)
    for event in _ONE_OF_EACH:
        if type(event) not in listed:
            with pytest.raises(IllegalRequestEvent):
                transition(state, event)
