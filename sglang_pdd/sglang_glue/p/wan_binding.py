"""P's WAN binding of one request (whether, and where, its KV goes to MD), before and around its
fan-out room, as an explicit state machine (pure; on the machine kit, sglang_pdd/machine.py).

SGLang's sender to RLD (sglang_glue/transfer_backend.py, ``PddKVSender``) is the I/O shell:
it feeds this machine the request's binding, the router's late destination (or its
withdrawal), SGLang's ``init`` (the page count is known), the fan-out's answer, each poll once
RLD's transfer has ended, and an abort; it performs the actions. Which pages wait for a room
is data kept by the shell, not state.

Phases::

    AWAITING_DESTINATION ──Posted(dest)──▶ DESTINATION_KNOWN ──(initialized) OpenRoom──▶ OPENING
          │  Withdrawn / NotOurs / wait expired /              │ RequestAborted         │ FanoutOpened ▶ OPEN
          │  RequestAborted                                    ▼                        │ FanoutRefused ▶ DROPPED
          ▼
       DROPPED ◀──────────────────────────────────────────── RequestAborted (OPEN: AbortRoom)

A request bound with its destination starts at DESTINATION_KNOWN. ``Polled`` decides whether
P may free the pages now: held while a promised destination may still come (up to the wait),
or while an open room still copies them (the fan-out's answer comes in ``Polled``).
Events after DROPPED change nothing (the router's withdrawal races the request's end).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Optional, Union

from sglang_pdd.machine import IGNORE, IllegalTransition, table_machine


class IllegalBindingEvent(IllegalTransition):
    """An event that is illegal in the WAN binding's current phase."""


class BindingPhase(str, enum.Enum):
    AWAITING_DESTINATION = "awaiting_destination"  # the router promised a destination
    DESTINATION_KNOWN = "destination_known"  # waiting for SGLang's init before the room opens
    OPENING = "opening"  # the fan-out is asked to open the room
    OPEN = "open"  # pages go to the fan-out room
    DROPPED = "dropped"  # no WAN binding (any more): RLD's path alone


@dataclass(frozen=True)
class BindingState:
    phase: BindingPhase
    dest: object = None  # the WanDestination, once known
    initialized: bool = False  # SGLang's init() ran
    wait_deadline: Optional[float] = None  # monotonic: when a promised destination stops being awaited
    why: str = ""  # why it was dropped, for the log

    @property
    def live(self) -> bool:
        return self.phase is not BindingPhase.DROPPED


def bound(dest) -> BindingState:
    """A request with a WAN binding: its destination now, or (None) promised for later."""
    return BindingState(BindingPhase.AWAITING_DESTINATION if dest is None else BindingPhase.DESTINATION_KNOWN, dest)


# ---------------------------------------------------------------------------------- events
@dataclass(frozen=True)
class Posted:
    dest: object


@dataclass(frozen=True)
class Withdrawn:
    why: str = "withdrawn by the router"


@dataclass(frozen=True)
class Initialized:
    pass


@dataclass(frozen=True)
class FanoutOpened:
    pass


@dataclass(frozen=True)
class FanoutRefused:
    pass


@dataclass(frozen=True)
class Polled:
    """RLD's transfer ended (``succeeded``: it did); ``room_holds``: an open room still copies
    the pages; ``wait_s``: how long P holds its pages for a promised destination."""
    now: float
    succeeded: bool
    wait_s: float
    room_holds: bool = False


@dataclass(frozen=True)
class RequestAborted:
    why: str = "request aborted on P"


Event = Union[Posted, Withdrawn, Initialized, FanoutOpened, FanoutRefused, Polled, RequestAborted]


# ---------------------------------------------------------------------------------- actions
@dataclass(frozen=True)
class OpenRoom:
    """Ask the fan-out for the room, then offer it the pages that waited."""


@dataclass(frozen=True)
class AbortRoom:
    why: str


@dataclass(frozen=True)
class Unbind:
    """Log why the request has no WAN binding (no KV to MD); forget the pages that waited."""
    why: str


@dataclass(frozen=True)
class ForgetDestination:
    """P's control API forgets the destination slot of this request."""


@dataclass(frozen=True)
class HoldPages:
    """The poll answers Transferring: P keeps the pages for now."""


@dataclass(frozen=True)
class CountWaitExpired:
    """Count a destination that never came within the wait."""


Action = Union[OpenRoom, AbortRoom, Unbind, ForgetDestination, HoldPages, CountWaitExpired]
Result = tuple[BindingState, list]

_FORGET, _HOLD, _OPEN_ROOM = ForgetDestination(), HoldPages(), OpenRoom()


def _posted(b: BindingState, e: Posted) -> Result:
    return _maybe_open(replace(b, phase=BindingPhase.DESTINATION_KNOWN, dest=e.dest))


def _withdrawn(b: BindingState, e: Withdrawn) -> Result:
    return _drop(b, e.why)


def _initialized(b: BindingState, e: Initialized) -> Result:
    return _maybe_open(replace(b, initialized=True))


def _room_opened(b: BindingState, e: FanoutOpened) -> Result:
    return replace(b, phase=BindingPhase.OPEN), []


def _room_refused(b: BindingState, e: FanoutRefused) -> Result:
    return _drop(b, "refused by the fan-out")


def _abort_open(b: BindingState, e: RequestAborted) -> Result:
    return replace(b, phase=BindingPhase.DROPPED, why=e.why), [AbortRoom(e.why), _FORGET]


def _abort(b: BindingState, e: RequestAborted) -> Result:
    return _drop(b, e.why)


def _maybe_open(b: BindingState) -> Result:
    if b.phase is BindingPhase.DESTINATION_KNOWN and b.initialized:
        return replace(b, phase=BindingPhase.OPENING), [_OPEN_ROOM]
    return b, []


def _drop(b: BindingState, why: str) -> Result:
    return replace(b, phase=BindingPhase.DROPPED, why=why), [Unbind(why), _FORGET]


def _polled_open(b: BindingState, e: Polled) -> Result:
    return (b, [_HOLD]) if e.room_holds else (b, [_FORGET])


def _polled_awaiting(b: BindingState, e: Polled) -> Result:
    deadline = b.wait_deadline if b.wait_deadline is not None else e.now + e.wait_s
    b = replace(b, wait_deadline=deadline)
    if e.now < deadline and e.succeeded:
        return b, [_HOLD]
    dropped, actions = _drop(b, "no WAN destination within --pdd-wan-destination-wait-ms")
    return dropped, [CountWaitExpired(), *actions]


def _polled_unopened(b: BindingState, e: Polled) -> Result:
    # Known but never opened (SGLang ended the request before init): nothing was sent.
    return _drop(b, f"the request ended before its WAN room opened ({b.phase.value})")


_AWAITING, _KNOWN, _OPENING, _OPEN = (BindingPhase.AWAITING_DESTINATION, BindingPhase.DESTINATION_KNOWN,
                                       BindingPhase.OPENING, BindingPhase.OPEN)
_HANDLERS = {
    (_AWAITING, Posted): _posted,
    (_KNOWN, Posted): IGNORE,  # a second post, or one for a binding bound with its destination
    (_OPENING, Posted): IGNORE,
    (_OPEN, Posted): IGNORE,
    (_AWAITING, Withdrawn): _withdrawn,
    (_KNOWN, Withdrawn): IGNORE,  # the destination is in use: the withdrawal came too late
    (_OPENING, Withdrawn): IGNORE,
    (_OPEN, Withdrawn): IGNORE,
    Initialized: _initialized,  # in any live phase
    (_OPENING, FanoutOpened): _room_opened,
    (_OPENING, FanoutRefused): _room_refused,
    (_AWAITING, Polled): _polled_awaiting,
    (_KNOWN, Polled): _polled_unopened,
    (_OPENING, Polled): _polled_unopened,
    (_OPEN, Polled): _polled_open,
    (_OPEN, RequestAborted): _abort_open,
    RequestAborted: _abort,  # in the other live phases
}
# Events after DROPPED change nothing (the router's withdrawal races the request's end).
transition = table_machine(_HANDLERS, error=IllegalBindingEvent, terminal=(BindingPhase.DROPPED,),
                           after_end=dict.fromkeys(Event.__args__, IGNORE), noun="WAN binding", actions=Action)
transition.__doc__ = """The binding's one transition function. Raises IllegalBindingEvent for an illegal event."""
