"""One accepted KV connection's handshake slot as an explicit state machine (pure; on the
machine kit, sglang_pdd/machine.py).

acceptor.py's ``Slot`` is the I/O shell: the connection's thread, the accept loop's deadline
check and the acceptor's thread start feed it events under the slot's lock and perform the
action (give the handshake slot back to the admission policy, once)::

    HANDSHAKE ──HandshakePassed──▶ AUTHENTICATED
        │──DeadlineChecked(now >= deadline)──▶ EXPIRED   (the deadline cut the connection off)
        └──ServeEnded──▶ FAILED                          (serve returned, or no thread started)

Whatever comes first decides: the handshake passing and the deadline race (a peer that
authenticates just as the accept loop cuts it off), and the connection's end follows either.
Events after the end change nothing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Union

from sglang_pdd.machine import IGNORE, IllegalTransition, table_machine


class IllegalSlotEvent(IllegalTransition):
    """An event the handshake slot does not know."""


class SlotPhase(str, enum.Enum):
    HANDSHAKE = "handshake"  # holds one of the acceptor's handshake slots, under its deadline
    AUTHENTICATED = "authenticated"  # the peer proved the key: no deadline any more
    EXPIRED = "expired"  # the handshake deadline passed first
    FAILED = "failed"  # serve returned without authenticating (a refused peer), or never ran


@dataclass(frozen=True)
class SlotState:
    deadline: float  # monotonic: the handshake's total deadline from accept
    phase: SlotPhase = SlotPhase.HANDSHAKE


# ---------------------------------------------------------------------------------- events
@dataclass(frozen=True)
class HandshakePassed:
    pass


@dataclass(frozen=True)
class DeadlineChecked:
    now: float


@dataclass(frozen=True)
class ServeEnded:
    pass


Event = Union[HandshakePassed, DeadlineChecked, ServeEnded]


# ---------------------------------------------------------------------------------- actions
@dataclass(frozen=True)
class LeaveHandshake:
    """Give the handshake slot back (``authenticated``: the source counts as known from now)."""
    authenticated: bool


Action = LeaveHandshake
Result = tuple[SlotState, list]
_PASSED, _GAVE_UP = LeaveHandshake(True), LeaveHandshake(False)


def _handshake_passed(s: SlotState, e: HandshakePassed) -> Result:
    return replace(s, phase=SlotPhase.AUTHENTICATED), [_PASSED]


def _deadline_checked(s: SlotState, e: DeadlineChecked) -> Result:
    if e.now < s.deadline:
        return s, []
    return replace(s, phase=SlotPhase.EXPIRED), [_GAVE_UP]


def _serve_ended(s: SlotState, e: ServeEnded) -> Result:
    return replace(s, phase=SlotPhase.FAILED), [_GAVE_UP]


_HANDSHAKE = SlotPhase.HANDSHAKE
_HANDLERS = {
    (_HANDSHAKE, HandshakePassed): _handshake_passed,
    (_HANDSHAKE, DeadlineChecked): _deadline_checked,
    (_HANDSHAKE, ServeEnded): _serve_ended,
}

transition = table_machine(_HANDLERS, error=IllegalSlotEvent,
                           terminal=(SlotPhase.AUTHENTICATED, SlotPhase.EXPIRED, SlotPhase.FAILED),
                           after_end=dict.fromkeys(Event.__args__, IGNORE),
                           noun="handshake", actions=Action)
transition.__doc__ = """The slot's one transition function. Raises IllegalSlotEvent for an unknown event."""
