"""The life of one PDD request as an explicit state machine (pure; modelled on h11's _state.py).

``transition(state, event) -> (state, actions)`` is the only place where the request's course
is decided; router/flow/pdd_flow.py is the I/O shell that turns backend replies into events, feeds them
in one at a time (one queue, so the order of events is the order of decisions) and performs
the actions. Token contents live in handoff/stitcher.py; this module only counts positions.

Phases: STARTING -> RELAY -> HANDING_OFF -> MAIN (a failed MD brings the request back to
RELAY, on a new relay leg where needed), ended DONE | FAILED | CLOSED. ``ROWS`` below is the
whole table, one legal (phase, event) pair a row with its guard and the phases it may lead
to; ``python -m sglang_pdd.router.flow.lifecycle [--mermaid]`` prints it (docs/router.md holds it).

Orthogonal to the phase, MD's room: NONE (no MD for this request) -> PENDING -> READY | FAILED;
and P's WAN destination where P learns it after its leg started (P's control API): NONE ->
PENDING -> DELIVERED | DROPPED (withdrawn on P: MD's side failed, or the request failed or
closed first) | AFTER_END (the request finished first: P gets it after the end, so MD's cache
still gets the prompt for the session's next turn).

Events (who sends them) and what they do:

    PathChosen(path, late_destination,  path choice   STARTING -> RELAY; starts relay leg 1 and
               p_room)                                the MD side (register+deliver or watch)
    RelayTokens(leg, produced, finish)  RLD's stream  emit (RELAY) or buffer (HANDING_OFF);
                                                      ignored when stale or in MAIN; RLD
                                                      finishing the request ends it; the
                                                      first token starts an MD side that
                                                      waits for it (md_side_after_first_token)
    RelayFailed(leg, message)           RLD or P      FAILED, unless stale or MD owns the stream
    RelayStalled(leg, message)          RLD's stream  the leg made no progress (router/backends/stall.py):
                                                      MD takes over where it may (a handoff
                                                      under way, or MD's KV on its way after
                                                      the client's first token), else FAILED
    MdReady()                           MD's room     start the handoff (now, or after the
                                                      client's first token)
    MdNotReady(fallback)                MD's room     RLD finishes (a pending destination is
                                                      withdrawn on P); a finished short relay
                                                      leg recovers on a new relay leg; a
                                                      stalled one fails the request
    DestinationDelivered()              P's control   P has MD's room: wait for MD's KV (after
                                                      the end: nothing left to withdraw)
    CutReady()                          handoff       the handoff may go on: one more catch-up
                                                      round if the backlog needs it, else freeze
                                                      the stream at the cut and send the final
                                                      handoff to MD
    MainTokens(produced, finish)        MD's stream   first token past the cut commits the
                                                      handoff (RLD aborted, room released)
    MainFailed(message)                 MD            HANDING_OFF: RLD's tokens stand; MAIN:
                                                      recover on a new relay leg; RLD stalled
                                                      too: RLD's tokens so far, then FAILED
    Timeout()                           the deadline  FAILED
    ClientDisconnected()                the client    CLOSED
    Broken(message)                     the shell     FAILED, even after the end: an illegal
                                                      event, or an action found a backend's
                                                      reply breaking the stream's invariants
    Ended()                             the shell     after the end: release everything; a
                                                      destination P still waits for is delivered
                                                      after the end (finished) or withdrawn

Catch-up rounds (``RequestState.catch_up``, the router's handoff policy when it hands off in
catch-up mode) are decided here too: each CutReady hands MD the next batch while the backlog
exceeds one batch (handoff/policy.py's next_catch_up_batch), then cuts. The simulator runs its
rounds in simulated time and leaves ``catch_up`` unset. A recovery leg continues as
``RequestState.recovery`` says (RecoveryMode); its output offset and the positions it replays, checked
once against the client's, are decided here and carried by StartRelayLeg and EmitRelayOutput.

Positions (``produced``) are absolute output positions: every leg, MD's continuation and the
recovery legs included, reports its output from position 0 (docs: the resume contract).
An event that cannot happen in a state (a bug, or a backend that breaks its contract) raises
``IllegalRequestEvent``; the shell fails the request with it rather than guess.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from typing import Optional, Union

from sglang_pdd.handoff.policy import HandoffConfig, next_catch_up_batch
from sglang_pdd.machine import IGNORE, IllegalTransition, TableRow, rows_table, table_machine
from sglang_pdd.machine import diagram as machine_diagram
from sglang_pdd.router.flow.fallback import Fallback, Reason, Recovery
from sglang_pdd.router.policy import Path


class IllegalRequestEvent(IllegalTransition):
    """An event that is illegal in the request's current state."""


class RequestPhase(str, enum.Enum):
    STARTING = "starting"  # choosing the path (maybe registering on MD); no leg runs
    RELAY = "relay"  # RLD's tokens go to the client
    HANDING_OFF = "handing_off"  # final handoff sent; RLD's tokens are held back
    MAIN = "main"  # MD's tokens go to the client; RLD is aborted
    DONE = "done"  # finished with a finish reason
    FAILED = "failed"  # ended with an error
    CLOSED = "closed"  # the client went away

    @property
    def terminal(self) -> bool:
        return self in (RequestPhase.DONE, RequestPhase.FAILED, RequestPhase.CLOSED)


class Md(str, enum.Enum):
    NONE = "none"  # no MD for this request (P->RLD only, MD unavailable)
    PENDING = "pending"  # waiting for MD's KV
    READY = "ready"  # MD's KV landed
    FAILED = "failed"  # MD cannot serve this request any more


class Destination(str, enum.Enum):
    NONE = "none"  # P got its WAN destination with its leg, or has none to get
    PENDING = "pending"  # P's leg runs and waits for MD's room (P's control API)
    DELIVERED = "delivered"  # P has it
    DROPPED = "dropped"  # withdrawn on P: no MD for this request after all
    AFTER_END = "after_end"  # the request finished first; P gets it after the end


class RecoveryMode(str, enum.Enum):
    """How a recovery leg continues the request on P and RLD (a PD pair).

    RESUME: prompt + emitted tokens with the resume marker and the total budget (the resume
      contract), for P / RLD servers that support resuming in PD mode. SGLang's PD path does
      not (sglang_glue/md/resume.py: a PD server answers 400), hence not the default.
    REPLAY: the original request again (prompt, total budget, the client's sampling); its
      first positions must reproduce what the client has (checked, else the request fails)
      and are dropped. Exact for greedy requests: grammar, stop strings, penalties,
      min/max_new_tokens and logprobs behave as on one server. Costs re-decoding those tokens.
    CONTINUE: prompt + emitted tokens as a NEW request with the remaining budget: the eager
      tokens count as prompt, so grammar / stop-string / penalty state restarts at the cut;
      for sampled requests, whose replay would diverge.
    """
    RESUME = "resume"
    REPLAY = "replay"
    CONTINUE = "continue"


# ---------------------------------------------------------------------------------- events
@dataclass(frozen=True)
class PathChosen:
    path: Path
    late_destination: bool = False  # P learns its WAN destination after the legs start
    p_room: Optional[int] = None  # P's bootstrap room, where it waits for that destination


@dataclass(frozen=True)
class RelayTokens:
    leg: int
    produced: int  # absolute output positions this leg has reached
    finish: Optional[dict] = None  # SGLang's finish_reason on the leg's last event


@dataclass(frozen=True)
class RelayFailed:
    leg: int
    message: str


@dataclass(frozen=True)
class RelayStalled:
    """The relay leg got no new token within its bound while its servers made no progress
    (router/backends/stall.py): its stream is closed, its backend request still to be aborted."""
    leg: int
    message: str


@dataclass(frozen=True)
class MdReady:
    pass


@dataclass(frozen=True)
class MdNotReady:
    fallback: Fallback  # why: WAN_FAILED, MD_UNAVAILABLE, WAN_DESTINATION_FAILED


@dataclass(frozen=True)
class DestinationDelivered:
    pass


@dataclass(frozen=True)
class CutReady:
    pass


@dataclass(frozen=True)
class MainTokens:
    produced: int  # absolute output positions MD has reached (its stream counts from 0)
    finish: Optional[dict] = None


@dataclass(frozen=True)
class MainFailed:
    message: str


@dataclass(frozen=True)
class Timeout:
    message: str = "request timed out"


@dataclass(frozen=True)
class ClientDisconnected:
    pass


@dataclass(frozen=True)
class Broken:
    message: str


@dataclass(frozen=True)
class Ended:
    """The request ended (a terminal phase) and its shell cleans up."""


Event = Union[PathChosen, RelayTokens, RelayFailed, RelayStalled, MdReady, MdNotReady, DestinationDelivered, CutReady,
              MainTokens, MainFailed, Timeout, ClientDisconnected, Broken, Ended]


# ---------------------------------------------------------------------------------- actions
@dataclass(frozen=True)
class StartRelayLeg:
    """P prefills and RLD decodes, continuing from ``emitted[:resume_len]`` as ``mode`` says
    (a first leg: RESUME from nothing); ``one_token``: RLD only bridges the TTFT (P->MD);
    ``wan``: P also sends the KV to MD's room, ``late_destination``: P learns that room's WAN
    destination later."""
    leg: int
    resume_len: int
    one_token: bool
    wan: bool
    late_destination: bool = False
    mode: RecoveryMode = RecoveryMode.RESUME

    @property
    def offset(self) -> int:
        """The output position of the leg's own first token: a CONTINUE leg counts from the
        resumed tokens, every other leg reports from position 0."""
        return self.resume_len if self.mode is RecoveryMode.CONTINUE else 0

    @property
    def replays(self) -> int:
        """Positions the leg reports again (REPLAY, RESUME): below them it has nothing new."""
        return 0 if self.mode is RecoveryMode.CONTINUE else self.resume_len


@dataclass(frozen=True)
class StartMdSide:
    """Register MD's room concurrently and post P's destination (``late_destination``), or
    only wait for MD's KV (the room was registered before the legs)."""
    late_destination: bool


@dataclass(frozen=True)
class EmitRelayOutput:
    """Feed this relay event's tokens to the stitcher; yield what it releases. The leg's
    output starts at position ``offset``; its first ``check_replay`` positions must equal
    what the client has (a recovery leg's replay, checked once), else the request fails."""
    offset: int = 0
    check_replay: int = 0


@dataclass(frozen=True)
class WatchMd:
    """Wait for MD's KV to land (MdReady / MdNotReady)."""


@dataclass(frozen=True)
class WithdrawDestination:
    """Tell P (``p_room``) to stop waiting for a WAN destination."""
    p_room: Optional[int]


@dataclass(frozen=True)
class StartHandoff:
    """The handoff begins: a CutReady event (the router), catch-up rounds in simulated time
    then CutReady (the simulator)."""


@dataclass(frozen=True)
class SendCatchUpBatch:
    """Catch-up round ``round``: MD extends ``emitted[:upto]`` (``tokens`` new ones) while RLD
    keeps decoding; then CutReady."""
    upto: int
    tokens: int
    round: int


@dataclass(frozen=True)
class SendFinalHandoff:
    """Freeze the stream at ``cut`` (stitcher.begin_handoff) and open MD's continuation;
    ``catch_up_tail``: the final catch-up batch (None: a one-shot handoff)."""
    cut: int
    catch_up_tail: Optional[int] = None


@dataclass(frozen=True)
class CommitHandoff:
    """MD produced past the cut: abort the relay legs, release MD's room."""


@dataclass(frozen=True)
class AbandonHandoff:
    """MD failed before its first token: RLD's held-back tokens are released (stitcher)."""


@dataclass(frozen=True)
class EmitMainOutput:
    """Feed this MD event's tokens to the stitcher; yield them."""


@dataclass(frozen=True)
class RecordFallback:
    fallback: Fallback


@dataclass(frozen=True)
class AbortLegs:
    """Abort every running backend request of this flow (a recovery replaces them)."""


@dataclass(frozen=True)
class Finish:
    finish_reason: dict


@dataclass(frozen=True)
class FailRequest:
    message: str


@dataclass(frozen=True)
class ReleaseAll:
    """Abort every running backend request; release MD's room, keeping the KV MD has for a
    finished request (the session's next turn hits it) or freeing it. ``md_room`` False: MD's
    room is DeliverAfterEnd's to release."""
    keep_md_kv: bool
    md_room: bool = True


@dataclass(frozen=True)
class DeliverAfterEnd:
    """The request finished before P got its WAN destination: MD's registration and P's
    destination (``p_room``) finish after the end, without the client waiting for them; then
    MD's room is released keeping the KV (P sends it behind the KV someone waits for). Where
    MD or P fails, the destination is withdrawn and the room freed."""
    p_room: Optional[int]


Action = Union[StartRelayLeg, StartMdSide, EmitRelayOutput, WatchMd, WithdrawDestination, StartHandoff,
               SendCatchUpBatch, SendFinalHandoff, CommitHandoff, AbandonHandoff, EmitMainOutput, RecordFallback,
               AbortLegs, Finish, FailRequest, ReleaseAll, DeliverAfterEnd]


# ---------------------------------------------------------------------------------- state
@dataclass(frozen=True)
class RequestState:
    max_new: int  # the client's total output budget
    phase: RequestPhase = RequestPhase.STARTING
    md: Md = Md.NONE
    leg: int = 0  # relay legs started (a recovery starts a new one)
    emitted: int = 0  # positions the client has
    relay_produced: int = 0  # positions the current relay leg has reached (held back ones too)
    relay_idle: bool = False  # the current relay leg ended short of the budget (P->MD's bridge)
    handoff_on_first_token: bool = False  # MD was ready before the client's first token
    cut: Optional[int] = None  # first position MD generates, once a final handoff was sent
    md_stream: bool = False  # a final handoff was sent (late MD events may still arrive)
    main_produced: int = 0
    destination: Destination = Destination.NONE
    p_room: Optional[int] = None  # P's bootstrap room while it may wait for a destination
    recovery: RecoveryMode = RecoveryMode.RESUME  # how a recovery leg continues
    leg_offset: int = 0  # output position of the current relay leg's own first token
    replay_check: int = 0  # positions the current relay leg replays, not yet checked
    catch_up: Optional[HandoffConfig] = None  # catch-up rounds' policy; None: one-shot
    handed: int = 0  # eager tokens MD has extended in catch-up rounds
    catch_up_round: int = 0  # catch-up rounds done
    relay_stalled: bool = False  # the current relay leg stalled: only MD may go on from here
    # P->RLD->MD with a late destination: MD's side starts at the client's first token, not
    # with the legs (the router's --md-side-after-first-token), so MD's registration, P's
    # destination and P's WAN copy stay out of the first token's way. Until then it is
    # waiting (md_side_waits), MD's room PENDING as ever.
    md_side_after_first_token: bool = False
    md_side_waits: bool = False


_TERMINAL = (RequestPhase.DONE, RequestPhase.FAILED, RequestPhase.CLOSED)
_STATE_FIELDS = frozenset(f.name for f in fields(RequestState))
_new = object.__new__

# Actions are immutable, so the constant ones are made once (the simulator steps this
# machine for every simulated request; a frozen dataclass costs ~1 us to build).
_EMIT_RELAY_OUTPUT, _START_HANDOFF = EmitRelayOutput(), StartHandoff()
_COMMIT_HANDOFF, _EMIT_MAIN_OUTPUT = CommitHandoff(), EmitMainOutput()
_FIRST_LEG = {(one_token, wan, late): StartRelayLeg(leg=1, resume_len=0, one_token=one_token, wan=wan,
                                                    late_destination=late)
              for one_token in (False, True) for wan in (False, True) for late in (False, True)}
_MD_SIDE = {late: StartMdSide(late_destination=late) for late in (False, True)}


def _replace(s: RequestState, **changes) -> RequestState:
    """dataclasses.replace for RequestState, without re-running __init__ (several times faster,
    for the simulator as above). RequestState has no __post_init__, so the result is the same;
    an unknown field name still raises."""
    new = _new(RequestState)
    d = new.__dict__
    d.update(s.__dict__)
    d.update(changes)
    if len(d) != len(_STATE_FIELDS):
        raise TypeError(f"unknown RequestState fields {sorted(changes.keys() - _STATE_FIELDS)}")
    return new


def relay_finished_request(state: RequestState, produced: int, finish: dict) -> bool:
    """A relay leg ended: is the whole request done (budget used, or EOS / stop / abort)?"""
    return produced >= state.max_new or finish.get("type") != "length"


Result = tuple[RequestState, list]


def _path_chosen(s: RequestState, e: PathChosen) -> Result:
    with_md = e.path is not Path.P_RLD_ONLY
    late = with_md and bool(e.late_destination)
    s = _replace(s, phase=RequestPhase.RELAY, leg=1, md=Md.PENDING if with_md else Md.NONE)
    if late:
        s = _replace(s, destination=Destination.PENDING, p_room=e.p_room)
    actions = [_FIRST_LEG[e.path is Path.P_MD, with_md, late]]
    if late and e.path is Path.P_RLD_MD and s.md_side_after_first_token:
        return _replace(s, md_side_waits=True), actions
    if with_md:
        actions.append(_MD_SIDE[late])
    return s, actions


def _relay_tokens(s: RequestState, e: RelayTokens) -> Result:
    if e.leg < s.leg:
        return s, []  # a superseded leg
    if e.produced < s.relay_produced:
        raise IllegalRequestEvent(f"relay leg {e.leg} went back from {s.relay_produced} to {e.produced}")
    if e.produced > s.max_new:
        raise IllegalRequestEvent(f"relay leg {e.leg} produced {e.produced} > max_new_tokens {s.max_new}")
    if s.leg_offset or s.replay_check:
        actions: list = [EmitRelayOutput(offset=s.leg_offset, check_replay=s.replay_check)]
        s = _replace(s, replay_check=0)  # once: the leg's output only grows from there
    else:
        actions = [_EMIT_RELAY_OUTPUT]
    if s.phase is RequestPhase.RELAY:
        s = _replace(s, relay_produced=e.produced, emitted=e.produced)
    else:
        s = _replace(s, relay_produced=e.produced)
    request_done = e.finish is not None and relay_finished_request(s, e.produced, e.finish)
    if s.md_side_waits and s.emitted:  # the client has its first token: MD's side may start
        s = _replace(s, md_side_waits=False)
        actions.append(_MD_SIDE[True])
    if s.handoff_on_first_token and s.emitted and not request_done:
        s = _replace(s, handoff_on_first_token=False)
        actions.append(_START_HANDOFF)
    if e.finish is None:
        return s, actions
    if request_done:
        if s.phase is RequestPhase.HANDING_OFF:  # RLD finished first: its tokens stand
            actions.append(AbandonHandoff())
            s = _replace(s, emitted=s.relay_produced)
        return _replace(s, phase=RequestPhase.DONE), actions + [Finish(_total_length(s, e.finish))]
    s = _replace(s, relay_idle=True)
    if s.md is Md.FAILED and s.phase is RequestPhase.RELAY:
        return _recover(s, actions, Recovery.WAN_FAILED_AFTER_RLD)
    return s, actions


def _total_length(s: RequestState, finish: dict) -> dict:
    """A length finish reports the client's whole budget (a CONTINUE leg's own is smaller)."""
    if finish.get("type") == "length" and "length" in finish and finish["length"] != s.max_new:
        return {**finish, "length": s.max_new}
    return finish


def _relay_failed(s: RequestState, e: RelayFailed) -> Result:
    if e.leg < s.leg:
        return s, []  # a superseded leg
    return _replace(s, phase=RequestPhase.FAILED), [FailRequest(f"relay leg failed: {e.message}")]


def _relay_stalled(s: RequestState, e: RelayStalled) -> Result:
    """RLD stopped progressing. Nothing it produced is lost: the client has every token RLD
    sent (RELAY), or gets the held-back ones if MD fails too (HANDING_OFF). MD may go on from
    the client's tokens where a handoff is under way or MD's KV is on its way; without a first
    token there is nothing to hand off (the router may retry the request elsewhere)."""
    if e.leg < s.leg:
        return s, []  # a superseded leg
    why = f"relay leg {e.leg} stalled: {e.message}"
    if s.phase is RequestPhase.HANDING_OFF:  # MD's first token (or its deadline) decides
        return _replace(s, relay_stalled=True), [RecordFallback(Fallback(Reason.RELAY_STALLED, why))]
    if s.emitted and s.md in (Md.PENDING, Md.READY):
        return _replace(s, relay_stalled=True), [RecordFallback(Fallback(Reason.RELAY_STALLED, why))]
    return _replace(s, phase=RequestPhase.FAILED), [FailRequest(why)]


def _stalled_and_md_gone(s: RequestState, actions: list) -> Result:
    """MD cannot go on either: the request ends with the tokens the client has."""
    return (_replace(s, phase=RequestPhase.FAILED),
            actions + [FailRequest("the relay leg stalled and MD cannot continue the request")])


def _md_ready(s: RequestState, e: MdReady) -> Result:
    s = _replace(s, md=Md.READY)
    if s.emitted or s.relay_idle:
        return s, [_START_HANDOFF]
    return _replace(s, handoff_on_first_token=True), []  # P's first token comes via RLD: same-DC TTFT


def _md_not_ready(s: RequestState, e: MdNotReady) -> Result:
    s = _replace(s, md=Md.FAILED)
    actions: list = [RecordFallback(e.fallback)]
    if s.destination is Destination.PENDING:  # P stops waiting for MD's room
        s = _replace(s, destination=Destination.DROPPED)
        actions.append(WithdrawDestination(s.p_room))
    if s.relay_idle:
        return _recover(s, actions, Recovery.WAN_FAILED_AFTER_RLD)
    if s.relay_stalled:
        return _stalled_and_md_gone(s, actions)
    return s, actions


def _destination_delivered(s: RequestState, e: DestinationDelivered) -> Result:
    s = _replace(s, destination=Destination.DELIVERED)
    if s.phase in _TERMINAL or s.md is not Md.PENDING:
        return s, []
    return s, [WatchMd()]


def _cut_ready(s: RequestState, e: CutReady) -> Result:
    if s.emitted >= s.max_new:
        return s, []  # the request ends on RLD anyway
    tail = None
    if s.catch_up is not None:
        step = next_catch_up_batch(s.emitted - s.handed, s.catch_up_round, s.catch_up)
        if not step.final:  # MD extends this batch while RLD keeps decoding
            s = _replace(s, handed=s.handed + step.tokens, catch_up_round=s.catch_up_round + 1)
            return s, [SendCatchUpBatch(upto=s.handed, tokens=step.tokens, round=s.catch_up_round - 1)]
        tail = s.emitted - s.handed
    return (_replace(s, phase=RequestPhase.HANDING_OFF, cut=s.emitted, md_stream=True),
            [SendFinalHandoff(cut=s.emitted, catch_up_tail=tail)])


def _main_tokens(s: RequestState, e: MainTokens) -> Result:
    if e.produced < s.main_produced:
        raise IllegalRequestEvent(f"MD went back from {s.main_produced} to {e.produced}")
    s = _replace(s, main_produced=e.produced)
    actions: list = []
    if s.phase is RequestPhase.HANDING_OFF:
        if e.produced <= s.cut:
            return s, []  # MD repeated the eager tokens only; wait for its first own token
        s = _replace(s, phase=RequestPhase.MAIN)
        actions.append(_COMMIT_HANDOFF)
    actions.append(_EMIT_MAIN_OUTPUT)
    s = _replace(s, emitted=max(s.emitted, e.produced))
    if e.finish is not None:
        return _replace(s, phase=RequestPhase.DONE), actions + [Finish(_total_length(s, e.finish))]
    return s, actions


def _md_failed(s: RequestState, e: MainFailed) -> tuple[RequestState, list]:
    return _replace(s, md=Md.FAILED), [RecordFallback(Fallback(Reason.MD_FAILED, e.message))]


def _main_failed_relaying(s: RequestState, e: MainFailed) -> Result:
    s, actions = _md_failed(s, e)
    if s.relay_idle:
        return _recover(s, actions, Recovery.MD_FAILED)
    if s.relay_stalled:
        return _stalled_and_md_gone(s, actions)
    return s, actions


def _main_failed_handing_off(s: RequestState, e: MainFailed) -> Result:
    s, actions = _md_failed(s, e)
    actions.append(AbandonHandoff())
    s = _replace(s, phase=RequestPhase.RELAY, emitted=s.relay_produced, cut=None)
    if s.relay_idle:
        return _recover(s, actions, Recovery.MD_FAILED)
    if s.relay_stalled:  # RLD's held-back tokens first (AbandonHandoff), then the end
        return _stalled_and_md_gone(s, actions)
    return s, actions


def _main_failed_in_main(s: RequestState, e: MainFailed) -> Result:
    s, actions = _md_failed(s, e)
    return _recover(s, actions, Recovery.MD_FAILED_MID_STREAM)


def _recover(s: RequestState, actions: list, why: Recovery) -> Result:
    """MD cannot finish: a new P->RLD leg continues from what the client already has, as
    ``s.recovery`` says (nothing to continue from: a fresh leg)."""
    leg = StartRelayLeg(leg=s.leg + 1, resume_len=s.emitted, one_token=False, wan=False,
                        mode=s.recovery if s.emitted else RecoveryMode.RESUME)
    s = _replace(s, phase=RequestPhase.RELAY, leg=leg.leg, relay_produced=s.emitted, relay_idle=False, cut=None,
                 md=Md.FAILED, leg_offset=leg.offset, replay_check=leg.replays, relay_stalled=False)
    return s, actions + [RecordFallback(Fallback.recovered(why)), AbortLegs(), leg]


def _timeout(s: RequestState, e: Timeout) -> Result:
    return _replace(s, phase=RequestPhase.FAILED), [FailRequest(e.message)]


def _client_disconnected(s: RequestState, e: ClientDisconnected) -> Result:
    return _replace(s, phase=RequestPhase.CLOSED), []


def _broken(s: RequestState, e: Broken) -> Result:
    return _replace(s, phase=RequestPhase.FAILED), []


def _ended(s: RequestState, e: Ended) -> Result:
    # MD keeps a finished request's KV still on the WAN for the session's next turn, also when
    # RLD finished before MD answered the registration (a short output, a busy MD): MD's cache
    # stays as warm as P's. A failed or closed request's KV is not wanted, and a room kept for
    # KV P never got a destination for would stay until it expired (holding its prefix and
    # pages, and MD's cache flush).
    done = s.phase is RequestPhase.DONE
    if s.md_side_waits:  # ended before its first token: MD never heard of it, P stops waiting
        return (_replace(s, destination=Destination.DROPPED),
                [ReleaseAll(keep_md_kv=False, md_room=False), WithdrawDestination(s.p_room)])
    if s.destination is Destination.PENDING and done:
        return (_replace(s, destination=Destination.AFTER_END),
                [ReleaseAll(keep_md_kv=True, md_room=False), DeliverAfterEnd(s.p_room)])
    actions: list = [ReleaseAll(keep_md_kv=done and s.destination is not Destination.DROPPED)]
    if s.destination is Destination.PENDING:  # failed or closed before P got a destination
        s = _replace(s, destination=Destination.DROPPED)
        actions.append(WithdrawDestination(s.p_room))
    return s, actions


# ---------------------------------------------------------------------------------- guards
# A guard says why an event its row lists is illegal in this state after all (None: legal).
def _a_started_leg(s: RequestState, e: RelayTokens) -> Optional[str]:
    """leg started"""
    if e.leg > s.leg or e.leg < 1:
        return f"tokens from relay leg {e.leg}, only {s.leg} started"
    return None


def _a_started_leg_failed(s: RequestState, e: RelayFailed) -> Optional[str]:
    """leg started"""
    if e.leg > s.leg:
        return f"failure of relay leg {e.leg}, only {s.leg} started"
    return None


def _md_pending(s: RequestState, e: Union[MdReady, MdNotReady]) -> Optional[str]:
    """MD pending"""
    if s.md is not Md.PENDING:
        return f"MD {'ready' if type(e) is MdReady else 'not ready'}, but MD is {s.md.value}"
    return None


def _destination_pending(s: RequestState, e: DestinationDelivered) -> Optional[str]:
    """destination pending"""
    if s.destination is not Destination.PENDING:
        return f"destination delivered, but it is {s.destination.value}"
    return None


def _md_ready_no_handoff_yet(s: RequestState, e: CutReady) -> Optional[str]:
    """MD ready, no final handoff sent"""
    if s.md is not Md.READY or s.md_stream:
        return f"cut requested with MD {s.md.value}, handoff sent {s.md_stream}"
    return None


def _handoff_sent(s: RequestState, e: MainTokens) -> Optional[str]:
    """final handoff sent, within the budget"""
    if not s.md_stream:
        return "MD tokens before any handoff"
    if e.produced > s.max_new:
        return f"MD produced {e.produced} > max_new_tokens {s.max_new}"
    return None


def _has_md(s: RequestState, e: MainFailed) -> Optional[str]:
    """the request has MD"""
    if s.md is Md.NONE:
        return "MD failed, but the request has no MD"
    return None


# ---------------------------------------------------------------------------------- the table
_STARTING, _RELAY, _HANDING_OFF, _MAIN = (RequestPhase.STARTING, RequestPhase.RELAY, RequestPhase.HANDING_OFF,
                                          RequestPhase.MAIN)
_DONE, _FAILED, _CLOSED = _TERMINAL
_LIVE = (_STARTING, _RELAY, _HANDING_OFF, _MAIN)

# Every legal (phase, event) pair of a request, one a row; an event a phase does not list is
# illegal there. MD's room and P's destination (orthogonal to the phase) are read by the guards.
ROWS = (
    TableRow(_STARTING, PathChosen, (_RELAY,), _path_chosen, note="start relay leg 1 and the MD side"),

    TableRow(_RELAY, RelayTokens, (_RELAY, _DONE), _relay_tokens, _a_started_leg,
        "emit; RLD finishing the request ends it; an idle leg with MD failed recovers"),
    TableRow(_RELAY, RelayFailed, (_RELAY, _FAILED), _relay_failed, _a_started_leg_failed, "a superseded leg: nothing"),
    TableRow(_RELAY, RelayStalled, (_RELAY, _FAILED), _relay_stalled, _a_started_leg_failed,
        "MD goes on where a handoff is under way or its KV is coming after the first token"),
    TableRow(_RELAY, MdReady, (_RELAY,), _md_ready, _md_pending, "start the handoff now or after the first token"),
    TableRow(_RELAY, MdNotReady, (_RELAY, _FAILED), _md_not_ready, _md_pending,
        "RLD finishes; withdraw a pending destination; an idle leg recovers; a stalled one fails"),
    TableRow(_RELAY, DestinationDelivered, (_RELAY,), _destination_delivered, _destination_pending, "watch MD's KV"),
    TableRow(_RELAY, CutReady, (_RELAY, _HANDING_OFF), _cut_ready, _md_ready_no_handoff_yet,
        "a catch-up batch, or the final handoff at the cut"),
    TableRow(_RELAY, MainTokens, (_RELAY,), IGNORE, _handoff_sent, "a late MD event after a failed handoff"),
    TableRow(_RELAY, MainFailed, (_RELAY, _FAILED), _main_failed_relaying, _has_md,
        "RLD finishes; an idle leg recovers; a stalled one fails"),

    TableRow(_HANDING_OFF, RelayTokens, (_HANDING_OFF, _DONE), _relay_tokens, _a_started_leg,
        "held back; RLD finishing first keeps its tokens"),
    TableRow(_HANDING_OFF, RelayFailed, (_HANDING_OFF, _FAILED), _relay_failed, _a_started_leg_failed,
        "a superseded leg: nothing"),
    TableRow(_HANDING_OFF, RelayStalled, (_HANDING_OFF,), _relay_stalled, _a_started_leg_failed,
        "MD's first token or its deadline decides"),
    TableRow(_HANDING_OFF, DestinationDelivered, (_HANDING_OFF,), _destination_delivered, _destination_pending),
    TableRow(_HANDING_OFF, MainTokens, (_HANDING_OFF, _MAIN, _DONE), _main_tokens, _handoff_sent,
        "the first token past the cut commits the handoff"),
    TableRow(_HANDING_OFF, MainFailed, (_RELAY, _FAILED), _main_failed_handing_off, _has_md,
        "RLD's tokens stand; an idle leg recovers; RLD stalled: they end the request"),

    TableRow(_MAIN, RelayTokens, (_MAIN,), IGNORE, _a_started_leg, "RLD is being aborted"),
    TableRow(_MAIN, RelayFailed, (_MAIN,), IGNORE, _a_started_leg_failed, "RLD is being aborted"),
    TableRow(_MAIN, RelayStalled, (_MAIN,), IGNORE, _a_started_leg_failed, "RLD is being aborted"),
    TableRow(_MAIN, DestinationDelivered, (_MAIN,), _destination_delivered, _destination_pending),
    TableRow(_MAIN, MainTokens, (_MAIN, _DONE), _main_tokens, _handoff_sent, "emit MD's tokens"),
    TableRow(_MAIN, MainFailed, (_RELAY,), _main_failed_in_main, _has_md, "recover on a new relay leg"),

    *(TableRow(phase, Timeout, (_FAILED,), _timeout) for phase in _LIVE),
    *(TableRow(phase, ClientDisconnected, (_CLOSED,), _client_disconnected) for phase in _LIVE),
    *(TableRow(phase, Broken, (_FAILED,), _broken) for phase in _LIVE),

    # What may still come once the request ended: P's answer to a destination delivered just
    # before the end (then there is nothing to withdraw), a reply found broken while the last
    # actions ran (the request failed after all), and the shell's cleanup.
    *(TableRow(phase, DestinationDelivered, (phase,), _destination_delivered, _destination_pending)
      for phase in _TERMINAL),
    *(TableRow(phase, Broken, (_FAILED,), _broken, note="failed after all") for phase in _TERMINAL),
    *(TableRow(phase, Ended, (phase,), _ended,
               note="release everything; a pending destination: delivered after the end if done, else withdrawn")
      for phase in _TERMINAL),
)


def _illegal(s: RequestState, e: Event) -> str:
    if s.phase is RequestPhase.STARTING:
        return f"{type(e).__name__} before the path was chosen"
    if type(e) is PathChosen:
        return "the path was already chosen"
    if type(e) is Ended:
        return f"Ended while the request is still {s.phase.value}"
    return f"{type(e).__name__} in phase {s.phase.value}"


transition = table_machine(rows_table(ROWS, IllegalRequestEvent), error=IllegalRequestEvent, terminal=_TERMINAL,
                           illegal=_illegal, noun="request", actions=Action)
transition.__doc__ = """The request's one transition function. Raises IllegalRequestEvent for an illegal event."""


def diagram(mermaid: bool = False) -> str:
    """The request's table as a picture (docs/router.md holds the text one)."""
    return machine_diagram(ROWS, mermaid=mermaid)


if __name__ == "__main__":
    import sys
    print(diagram(mermaid="--mermaid" in sys.argv[1:]), end="")
