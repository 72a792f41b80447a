"""P's WAN leg of one request, before and around its fan-out room, as an explicit state
machine (pure; on the machine kit, sglang_pdd/machine.py).

SGLang's sender to RLD (sglang_glue/transfer_backend.py, ``PddKVSender``) is the I/O shell:
it feeds this machine the request's binding, the router's late destination (or its
withdrawal), SGLang's ``init`` (the page count is known), the fan-out's answer, each poll once
RLD's transfer has ended, and an abort; it performs the actions. Which pages wait for a room
is data kept by the shell, not state.

Phases::

    AWAITING_DESTINATION ──Posted(dest)──▶ DESTINATION_KNOWN ──(initialized) OpenRoom──▶ OPENING
          │  Withdrawn / NotOurs / wait expired / Abort        │ Abort                  │ RoomOpened ▶ OPEN
          ▼                                                    ▼                        │ RoomRefused ▶ DROPPED
       DROPPED ◀──────────────────────────────────────────────────────── Abort (OPEN: AbortRoom)

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


class PLegError(IllegalTransition):
    """An event that is illegal in the WAN leg's current phase."""


class Phase(str, enum.Enum):
    AWAITING_DESTINATION = "awaiting_destination"  # the router promised a destination
    DESTINATION_KNOWN = "destination_known"  # waiting for SGLang's init before the room opens
    OPENING = "opening"  # the fan-out is asked to open the room
    OPEN = "open"  # pages go to the fan-out room
    DROPPED = "dropped"  # no WAN leg (any more): RLD's path alone


@dataclass(frozen=True)
class PLeg:
    phase: Phase
    dest: object = None  # the WanDestination, once known
    initialized: bool = False  # SGLang's init() ran
    wait_deadline: Optional[float] = None  # monotonic: when a promised destination stops being awaited
    why: str = ""  # why it was dropped, for the log

    @property
    def live(self) -> bool:
        return self.phase is not Phase.DROPPED


def bound(dest) -> PLeg:
    """A request with a WAN leg: its destination now, or (None) promised for later."""
    return PLeg(Phase.AWAITING_DESTINATION if dest is None else Phase.DESTINATION_KNOWN, dest)


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
class RoomOpened:
    pass


@dataclass(frozen=True)
class RoomRefused:
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
class Abort:
    why: str = "request aborted on P"


Event = Union[Posted, Withdrawn, Initialized, RoomOpened, RoomRefused, Polled, Abort]


# ---------------------------------------------------------------------------------- actions
@dataclass(frozen=True)
class OpenRoom:
    """Ask the fan-out for the room, then offer it the pages that waited."""


@dataclass(frozen=True)
class AbortRoom:
    why: str


@dataclass(frozen=True)
class NoLeg:
    """Log why there is no WAN leg; forget the pages that waited."""
    why: str


@dataclass(frozen=True)
class Forget:
    """P's control API forgets the destination slot of this request."""


@dataclass(frozen=True)
class Hold:
    """The poll answers Transferring: P keeps the pages for now."""


@dataclass(frozen=True)
class WaitExpired:
    """Count a destination that never came within the wait."""


Action = Union[OpenRoom, AbortRoom, NoLeg, Forget, Hold, WaitExpired]
Result = tuple[PLeg, list]

_FORGET, _HOLD, _OPEN = Forget(), Hold(), OpenRoom()


def _posted(leg: PLeg, e: Posted) -> Result:
    if leg.phase is not Phase.AWAITING_DESTINATION:
        return leg, []  # a second post, or one for a leg bound with its destination
    return _maybe_open(replace(leg, phase=Phase.DESTINATION_KNOWN, dest=e.dest))


def _withdrawn(leg: PLeg, e: Withdrawn) -> Result:
    if leg.phase is not Phase.AWAITING_DESTINATION:
        return leg, []  # the destination is in use: the withdrawal came too late
    return _drop(leg, e.why)


def _initialized(leg: PLeg, e: Initialized) -> Result:
    return _maybe_open(replace(leg, initialized=True))


def _room_opened(leg: PLeg, e: RoomOpened) -> Result:
    _expect(leg, Phase.OPENING, e)
    return replace(leg, phase=Phase.OPEN), []


def _room_refused(leg: PLeg, e: RoomRefused) -> Result:
    _expect(leg, Phase.OPENING, e)
    return _drop(leg, "refused by the fan-out")


def _abort(leg: PLeg, e: Abort) -> Result:
    if leg.phase is Phase.OPEN:
        return replace(leg, phase=Phase.DROPPED, why=e.why), [AbortRoom(e.why), _FORGET]
    return _drop(leg, e.why)


def _maybe_open(leg: PLeg) -> Result:
    if leg.phase is Phase.DESTINATION_KNOWN and leg.initialized:
        return replace(leg, phase=Phase.OPENING), [_OPEN]
    return leg, []


def _drop(leg: PLeg, why: str) -> Result:
    return replace(leg, phase=Phase.DROPPED, why=why), [NoLeg(why), _FORGET]


def _polled(leg: PLeg, e: Polled) -> Result:
    if leg.phase is Phase.OPEN:
        return (leg, [_HOLD]) if e.room_holds else (leg, [_FORGET])
    if leg.phase is Phase.AWAITING_DESTINATION:
        deadline = leg.wait_deadline if leg.wait_deadline is not None else e.now + e.wait_s
        leg = replace(leg, wait_deadline=deadline)
        if e.now < deadline and e.succeeded:
            return leg, [_HOLD]
        dropped, actions = _drop(leg, "no WAN destination within --pdd-wan-destination-wait-ms")
        return dropped, [WaitExpired(), *actions]
    # Known but never opened (SGLang ended the request before init): nothing was sent.
    return _drop(leg, f"the request ended before its WAN room opened ({leg.phase.value})")


def _expect(leg: PLeg, phase: Phase, event) -> None:
    if leg.phase is not phase:
        raise PLegError(f"{type(event).__name__} while the WAN leg is {leg.phase.value}")


_HANDLERS = {Posted: _posted, Withdrawn: _withdrawn, Initialized: _initialized, RoomOpened: _room_opened,
             RoomRefused: _room_refused, Polled: _polled, Abort: _abort}
# Events after DROPPED change nothing (the router's withdrawal races the request's end).
transition = table_machine(_HANDLERS, error=PLegError, terminal=(Phase.DROPPED,),
                           after_end=dict.fromkeys(_HANDLERS, IGNORE), noun="WAN leg")
transition.__doc__ = """The leg's one transition function. Raises PLegError for an illegal event."""
