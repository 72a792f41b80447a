"""The life of one PDD request as an explicit state machine (pure; modelled on h11's _state.py).

``transition(state, event) -> (state, actions)`` is the only place where the request's course
is decided; router/flow.py is the I/O shell that turns backend replies into events, feeds them
in one at a time (one queue, so the order of events is the order of decisions) and performs
the actions. Token contents live in handoff/stitcher.py; this module only counts positions.

Phases::

    STARTING ──PathChosen──▶ RELAY ──CutReady──▶ HANDING_OFF ──MainTokens(new)──▶ MAIN
                               ▲  ▲                   │                              │
                               │  └── MainFailed ─────┘ (RLD's buffered tokens flow)  │
                               └──────────── Recover (new relay leg) ◀── MainFailed ──┘
    every phase ──finish / error / Timeout / ClientDisconnected──▶ DONE | FAILED | CLOSED

Orthogonal to the phase, MD's room: NONE (no MD for this request) -> PENDING -> READY | FAILED.

Events (who sends them) and what they do:

    PathChosen(path, late_destination)  path choice   STARTING -> RELAY; starts relay leg 1 and
                                                      the MD side (register+deliver or watch)
    RelayTokens(leg, produced, finish)  RLD's stream  emit (RELAY) or buffer (HANDING_OFF);
                                                      ignored when stale or in MAIN; RLD
                                                      finishing the request ends it
    RelayFailed(leg, message)           RLD or P      FAILED, unless stale or MD owns the stream
    MdReady()                           MD's room     start the handoff (now, or after the
                                                      client's first token)
    MdNotReady(fallback)                MD's room     RLD finishes; a finished short relay leg
                                                      recovers on a new relay leg
    CutReady()                          handoff task  catch-up done: freeze the stream at the
                                                      cut, send the final handoff to MD
    MainTokens(produced, finish)        MD's stream   first token past the cut commits the
                                                      handoff (RLD aborted, room released)
    MainFailed(message)                 MD            HANDING_OFF: RLD's tokens stand; MAIN:
                                                      recover on a new relay leg
    Timeout()                           the deadline  FAILED
    ClientDisconnected()                the client    CLOSED

Positions (``produced``) are absolute output positions: every leg, MD's continuation and the
recovery legs included, reports its output from position 0 (docs: the resume contract).
An event that cannot happen in a state (a bug, or a backend that breaks its contract) raises
``LifecycleError``; the shell fails the request with it rather than guess.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from typing import Optional, Union

from sglang_pdd.router.policy import Path


class LifecycleError(RuntimeError):
    """An event that is illegal in the request's current state."""


class Phase(str, enum.Enum):
    STARTING = "starting"  # choosing the path (maybe registering on MD); no leg runs
    RELAY = "relay"  # RLD's tokens go to the client
    HANDING_OFF = "handing_off"  # final handoff sent; RLD's tokens are held back
    MAIN = "main"  # MD's tokens go to the client; RLD is aborted
    DONE = "done"  # finished with a finish reason
    FAILED = "failed"  # ended with an error
    CLOSED = "closed"  # the client went away

    @property
    def terminal(self) -> bool:
        return self in (Phase.DONE, Phase.FAILED, Phase.CLOSED)


class Md(str, enum.Enum):
    NONE = "none"  # no MD for this request (P->RLD only, MD unavailable)
    PENDING = "pending"  # waiting for MD's KV
    READY = "ready"  # MD's KV landed
    FAILED = "failed"  # MD cannot serve this request any more


# ---------------------------------------------------------------------------------- events
@dataclass(frozen=True)
class PathChosen:
    path: Path
    late_destination: bool = False  # P learns its WAN destination after the legs start


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
class MdReady:
    pass


@dataclass(frozen=True)
class MdNotReady:
    fallback: str  # the tag recorded, e.g. "wan_failed: ...", "md_unavailable: ..."


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


Event = Union[PathChosen, RelayTokens, RelayFailed, MdReady, MdNotReady, CutReady, MainTokens, MainFailed,
              Timeout, ClientDisconnected]


# ---------------------------------------------------------------------------------- actions
@dataclass(frozen=True)
class StartRelayLeg:
    """P prefills and RLD decodes ``prompt + emitted[:resume_len]`` (resume marker when
    ``resume_len`` > 0); ``one_token``: RLD only bridges the TTFT (P->MD); ``wan``: P also
    sends the KV to MD's room."""
    leg: int
    resume_len: int
    one_token: bool
    wan: bool


@dataclass(frozen=True)
class StartMdSide:
    """Register MD's room concurrently and post P's destination (``late_destination``), or
    only wait for MD's KV (the room was registered before the legs)."""
    late_destination: bool


@dataclass(frozen=True)
class RelayOutput:
    """Feed this relay event's tokens to the stitcher; yield what it releases."""


@dataclass(frozen=True)
class StartHandoff:
    """Catch-up rounds if the handoff policy says so, then a CutReady event."""


@dataclass(frozen=True)
class SendFinalHandoff:
    """Freeze the stream at ``cut`` (stitcher.begin_handoff) and open MD's continuation."""
    cut: int


@dataclass(frozen=True)
class HandoffCommitted:
    """MD produced past the cut: abort the relay legs, release MD's room."""


@dataclass(frozen=True)
class HandoffAbandoned:
    """MD failed before its first token: RLD's held-back tokens are released (stitcher)."""


@dataclass(frozen=True)
class MainOutput:
    """Feed this MD event's tokens to the stitcher; yield them."""


@dataclass(frozen=True)
class RecordFallback:
    tag: str


@dataclass(frozen=True)
class AbortLegs:
    """Abort every running backend request of this flow (a recovery replaces them)."""


@dataclass(frozen=True)
class Finish:
    finish_reason: dict


@dataclass(frozen=True)
class Fail:
    message: str


Action = Union[StartRelayLeg, StartMdSide, RelayOutput, StartHandoff, SendFinalHandoff, HandoffCommitted,
               HandoffAbandoned, MainOutput, RecordFallback, AbortLegs, Finish, Fail]


# ---------------------------------------------------------------------------------- state
@dataclass(frozen=True)
class State:
    max_new: int  # the client's total output budget
    phase: Phase = Phase.STARTING
    md: Md = Md.NONE
    leg: int = 0  # relay legs started (a recovery starts a new one)
    emitted: int = 0  # positions the client has
    relay_produced: int = 0  # positions the current relay leg has reached (held back ones too)
    relay_idle: bool = False  # the current relay leg ended short of the budget (P->MD's bridge)
    handoff_on_first_token: bool = False  # MD was ready before the client's first token
    cut: Optional[int] = None  # first position MD generates, once a final handoff was sent
    md_stream: bool = False  # a final handoff was sent (late MD events may still arrive)
    main_produced: int = 0


_TERMINAL = (Phase.DONE, Phase.FAILED, Phase.CLOSED)
_STATE_FIELDS = frozenset(f.name for f in fields(State))
_new = object.__new__

# Actions are immutable, so the constant ones are made once (the simulator steps this
# machine for every simulated request; a frozen dataclass costs ~1 us to build).
_RELAY_OUTPUT, _START_HANDOFF = RelayOutput(), StartHandoff()
_HANDOFF_COMMITTED, _MAIN_OUTPUT = HandoffCommitted(), MainOutput()
_FIRST_LEG = {(one_token, wan): StartRelayLeg(leg=1, resume_len=0, one_token=one_token, wan=wan)
              for one_token in (False, True) for wan in (False, True)}
_MD_SIDE = {late: StartMdSide(late_destination=late) for late in (False, True)}


def _replace(s: State, **changes) -> State:
    """dataclasses.replace for State, without re-running __init__ (several times faster,
    for the simulator as above). State has no __post_init__, so the result is the same;
    an unknown field name still raises."""
    new = _new(State)
    d = new.__dict__
    d.update(s.__dict__)
    d.update(changes)
    if len(d) != len(_STATE_FIELDS):
        raise TypeError(f"unknown State fields {sorted(changes.keys() - _STATE_FIELDS)}")
    return new


def relay_finished_request(state: State, produced: int, finish: dict) -> bool:
    """A relay leg ended: is the whole request done (budget used, or EOS / stop / abort)?"""
    return produced >= state.max_new or finish.get("type") != "length"


Result = tuple[State, list]


def transition(state: State, event: Event) -> Result:
    """The request's one transition function. Raises LifecycleError for an illegal event."""
    phase = state.phase
    if phase in _TERMINAL:
        raise LifecycleError(f"{type(event).__name__} after the request ended ({phase.value})")
    handler = _HANDLERS.get(type(event))
    if handler is None:
        raise LifecycleError(f"unknown event {event!r}")
    if phase is Phase.STARTING and not isinstance(event, (PathChosen, Timeout, ClientDisconnected)):
        raise LifecycleError(f"{type(event).__name__} before the path was chosen")
    return handler(state, event)


def _path_chosen(s: State, e: PathChosen) -> Result:
    if s.phase is not Phase.STARTING:
        raise LifecycleError("the path was already chosen")
    with_md = e.path is not Path.P_RLD_ONLY
    s = _replace(s, phase=Phase.RELAY, leg=1, md=Md.PENDING if with_md else Md.NONE)
    actions = [_FIRST_LEG[e.path is Path.P_MD, with_md]]
    if with_md:
        actions.append(_MD_SIDE[bool(e.late_destination)])
    return s, actions


def _relay_tokens(s: State, e: RelayTokens) -> Result:
    if e.leg > s.leg or e.leg < 1:
        raise LifecycleError(f"tokens from relay leg {e.leg}, only {s.leg} started")
    if e.leg < s.leg or s.phase is Phase.MAIN:
        return s, []  # a superseded leg, or MD owns the stream (RLD is being aborted)
    if e.produced < s.relay_produced:
        raise LifecycleError(f"relay leg {e.leg} went back from {s.relay_produced} to {e.produced}")
    if e.produced > s.max_new:
        raise LifecycleError(f"relay leg {e.leg} produced {e.produced} > max_new_tokens {s.max_new}")
    actions: list = [_RELAY_OUTPUT]
    if s.phase is Phase.RELAY:
        s = _replace(s, relay_produced=e.produced, emitted=e.produced)
    else:
        s = _replace(s, relay_produced=e.produced)
    request_done = e.finish is not None and relay_finished_request(s, e.produced, e.finish)
    if s.handoff_on_first_token and s.emitted and not request_done:
        s = _replace(s, handoff_on_first_token=False)
        actions.append(_START_HANDOFF)
    if e.finish is None:
        return s, actions
    if request_done:
        if s.phase is Phase.HANDING_OFF:  # RLD finished first: its tokens stand
            actions.append(HandoffAbandoned())
            s = _replace(s, emitted=s.relay_produced)
        return _replace(s, phase=Phase.DONE), actions + [Finish(e.finish)]
    s = _replace(s, relay_idle=True)
    if s.md is Md.FAILED and s.phase is Phase.RELAY:
        return _recover(s, actions, "wan_failed_after_rld")
    return s, actions


def _relay_failed(s: State, e: RelayFailed) -> Result:
    if e.leg > s.leg:
        raise LifecycleError(f"failure of relay leg {e.leg}, only {s.leg} started")
    if e.leg < s.leg or s.phase is Phase.MAIN:
        return s, []  # a superseded leg, or the aborted RLD of a committed handoff
    return _replace(s, phase=Phase.FAILED), [Fail(f"relay leg failed: {e.message}")]


def _md_ready(s: State, e: MdReady) -> Result:
    if s.md is not Md.PENDING:
        raise LifecycleError(f"MD ready, but MD is {s.md.value}")
    s = _replace(s, md=Md.READY)
    if s.phase is not Phase.RELAY:
        raise LifecycleError(f"MD ready in phase {s.phase.value}")
    if s.emitted or s.relay_idle:
        return s, [_START_HANDOFF]
    return _replace(s, handoff_on_first_token=True), []  # P's first token comes via RLD: same-DC TTFT


def _md_not_ready(s: State, e: MdNotReady) -> Result:
    if s.md is not Md.PENDING:
        raise LifecycleError(f"MD not ready, but MD is {s.md.value}")
    s = _replace(s, md=Md.FAILED)
    actions: list = [RecordFallback(e.fallback)]
    if s.relay_idle and s.phase is Phase.RELAY:
        return _recover(s, actions, "wan_failed_after_rld")
    return s, actions


def _cut_ready(s: State, e: CutReady) -> Result:
    if s.md is not Md.READY or s.md_stream:
        raise LifecycleError(f"cut requested with MD {s.md.value}, handoff sent {s.md_stream}")
    if s.phase is not Phase.RELAY or s.emitted >= s.max_new:
        return s, []  # the request ends on RLD anyway
    return _replace(s, phase=Phase.HANDING_OFF, cut=s.emitted, md_stream=True), [SendFinalHandoff(cut=s.emitted)]


def _main_tokens(s: State, e: MainTokens) -> Result:
    if not s.md_stream:
        raise LifecycleError("MD tokens before any handoff")
    if e.produced > s.max_new:
        raise LifecycleError(f"MD produced {e.produced} > max_new_tokens {s.max_new}")
    if s.phase is Phase.RELAY:
        return s, []  # a late MD event after a failed handoff
    if e.produced < s.main_produced:
        raise LifecycleError(f"MD went back from {s.main_produced} to {e.produced}")
    s = _replace(s, main_produced=e.produced)
    actions: list = []
    if s.phase is Phase.HANDING_OFF:
        if e.produced <= s.cut:
            return s, []  # MD repeated the eager tokens only; wait for its first own token
        s = _replace(s, phase=Phase.MAIN)
        actions.append(_HANDOFF_COMMITTED)
    actions.append(_MAIN_OUTPUT)
    s = _replace(s, emitted=max(s.emitted, e.produced))
    if e.finish is not None:
        return _replace(s, phase=Phase.DONE), actions + [Finish(e.finish)]
    return s, actions


def _main_failed(s: State, e: MainFailed) -> Result:
    if s.md is Md.NONE:
        raise LifecycleError("MD failed, but the request has no MD")
    s = _replace(s, md=Md.FAILED)
    actions: list = [RecordFallback(f"md_failed: {e.message}")]
    if s.phase is Phase.HANDING_OFF:
        actions.append(HandoffAbandoned())
        s = _replace(s, phase=Phase.RELAY, emitted=s.relay_produced, cut=None)
        if s.relay_idle:
            return _recover(s, actions, "md_failed")
        return s, actions
    if s.phase is Phase.MAIN:
        return _recover(s, actions, "md_failed_mid_stream")
    if s.relay_idle:
        return _recover(s, actions, "md_failed")
    return s, actions


def _recover(s: State, actions: list, why: str) -> Result:
    """MD cannot finish: a new P->RLD leg continues from what the client already has."""
    leg = s.leg + 1
    s = _replace(s, phase=Phase.RELAY, leg=leg, relay_produced=s.emitted, relay_idle=False, cut=None,
                md=Md.FAILED)
    return s, actions + [RecordFallback(f"recovered_on_relay: {why}"), AbortLegs(),
                         StartRelayLeg(leg=leg, resume_len=s.emitted, one_token=False, wan=False)]


def _timeout(s: State, e: Timeout) -> Result:
    return _replace(s, phase=Phase.FAILED), [Fail(e.message)]


def _client_disconnected(s: State, e: ClientDisconnected) -> Result:
    return _replace(s, phase=Phase.CLOSED), []


_HANDLERS = {PathChosen: _path_chosen, RelayTokens: _relay_tokens, RelayFailed: _relay_failed, MdReady: _md_ready,
             MdNotReady: _md_not_ready, CutReady: _cut_ready, MainTokens: _main_tokens, MainFailed: _main_failed,
             Timeout: _timeout, ClientDisconnected: _client_disconnected}
