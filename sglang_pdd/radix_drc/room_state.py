"""The life of one MD room as an explicit state machine (pure; on the machine kit, sglang_pdd/machine.py).

``transition(state, event) -> (state, actions)`` is the only place a room's course is decided;
radix_drc/rooms.py (the room table on the radix tree) performs the actions on the tree, and
sglang_glue/md/main_drc.py feeds the events it learns from the WAN receiver and the router.

Phases::

    NEW ──Registered──▶ LANDING ──KvLanded──▶ READY ──HandedOff──▶ HANDED_OFF
                          │  │                  │                      │
                          │  └─DrcFailed─▶ FAILED  │                      │
                          └─Released(keep_kv)─▶ LANDING_KEPT ─KvLanded / DrcFailed─▶ RELEASED
    every live phase ──Released──▶ RELEASED,  ──Expired──▶ EXPIRED  (terminal: the room is forgotten)

* LANDING: the matched prefix is locked (what P was told MD holds cannot be evicted) while the
  suffix's KV crosses the WAN.
* LANDING_KEPT: the request ended on RLD while its KV was in flight; the KV still lands and
  enters the cache for the session's next turn, then the room goes (nobody waits for it).
  ``keep_kv`` matters only here: a room already landed is cached anyway once released.
* READY / HANDED_OFF: the whole prompt is in the tree, locked until the router releases the
  room; the final handoff is accepted once (a second one is a duplicate; warmups do not count).
* FAILED: every lock dropped; the room stays so a waiter reads the typed reason, until released
  or expired.

Late events after a terminal phase (a WAN outcome, a second release or expiry) change nothing;
an event that cannot happen in a phase raises ``IllegalDrcEvent`` and changes nothing.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace
from typing import Optional, Union

from sglang_pdd.machine import IGNORE, IllegalTransition, table_machine


class IllegalDrcEvent(IllegalTransition):
    """An event that is illegal in the room's current phase; the room is unchanged."""


class DrcPhase(str, enum.Enum):
    NEW = "new"
    LANDING = "landing"
    LANDING_KEPT = "landing_kept"
    READY = "ready"
    HANDED_OFF = "handed_off"
    FAILED = "failed"
    RELEASED = "released"
    EXPIRED = "expired"

    @property
    def terminal(self) -> bool:
        return self in (DrcPhase.RELEASED, DrcPhase.EXPIRED)

    @property
    def landing(self) -> bool:
        return self in (DrcPhase.LANDING, DrcPhase.LANDING_KEPT)

    @property
    def holds_kv(self) -> bool:
        """The room holds tree locks or pool pages (a failed room holds neither: its pages are
        on their way back and only its reason is kept for a waiter)."""
        return self in (DrcPhase.LANDING, DrcPhase.LANDING_KEPT, DrcPhase.READY, DrcPhase.HANDED_OFF)


class FailReason(str, enum.Enum):
    WAN = "wan_failed"  # this rank's receiver failed the transfer (its reason in the detail)
    TP_RANK = "tp_rank_failed"  # another MD TP rank's slice of the KV failed
    DRC_FULL = "drc_full"  # no pool slots for the landed KV, even after eviction
    TIMEOUT = "timeout"  # the room's deadline passed while its KV was in flight


@dataclass(frozen=True)
class Failure:
    reason: FailReason
    detail: str = ""

    @classmethod
    def wan(cls, reason: str, detail: str) -> "Failure":
        return cls(FailReason.WAN, f"{reason}: {detail}")

    @property
    def text(self) -> str:
        """What MD reports (wait_ready's ``reason``, the log)."""
        if self.reason is FailReason.DRC_FULL:
            return f"drc_full: {self.detail}"
        if self.reason is FailReason.TIMEOUT:
            return "timeout"
        if self.reason is FailReason.TP_RANK:
            return "a TP rank's WAN slice failed (see that rank's log)"
        return self.detail


TIMED_OUT = Failure(FailReason.TIMEOUT)


# ---------------------------------------------------------------------------------- events
@dataclass(frozen=True)
class Registered:
    deadline: float  # the room goes at this time unless its KV lands first


@dataclass(frozen=True)
class KvLanded:
    deadline: float  # READY holds the prompt until then (for the handoff to come)


@dataclass(frozen=True)
class DrcFailed:
    failure: Failure


@dataclass(frozen=True)
class HandedOff:
    """The final handoff (MD continues the request)."""


@dataclass(frozen=True)
class Released:
    keep_kv: bool = False  # the request ended on RLD: KV still in flight lands into the cache


@dataclass(frozen=True)
class Expired:
    """The deadline passed (a router that vanished must not pin MD's memory)."""


Event = Union[Registered, KvLanded, DrcFailed, HandedOff, Released, Expired]


# ---------------------------------------------------------------------------------- actions
@dataclass(frozen=True)
class LockPrompt:
    """The landed KV is in the tree (the shell's precondition for KvLanded: KV that cannot
    enter the tree is a DrcFailed(DRC_FULL) instead): lock the whole prompt, unlock the prefix."""


@dataclass(frozen=True)
class UnlockAll:
    """Drop every tree lock the room holds."""


@dataclass(frozen=True)
class ForgetRoom:
    """Drop the room from the table."""


Action = Union[LockPrompt, UnlockAll, ForgetRoom]

_LOCK_PROMPT, _UNLOCK, _FORGET = LockPrompt(), UnlockAll(), ForgetRoom()
_GONE = [_UNLOCK, _FORGET]


# ---------------------------------------------------------------------------------- state
@dataclass(frozen=True)
class DrcState:
    phase: DrcPhase = DrcPhase.NEW
    deadline: float = math.inf
    failure: Optional[Failure] = None  # why the KV never made it into the tree
    landed: bool = False  # the KV entered the tree

    def expired_at(self, now: float) -> bool:
        return not self.phase.terminal and self.deadline <= now


Result = tuple[DrcState, list]


def _registered(s: DrcState, e: Registered) -> Result:
    return replace(s, phase=DrcPhase.LANDING, deadline=e.deadline), []


def _kv_landed(s: DrcState, e: KvLanded) -> Result:
    return replace(s, phase=DrcPhase.READY, deadline=e.deadline, landed=True), [_LOCK_PROMPT]


def _kv_landed_kept(s: DrcState, e: KvLanded) -> Result:
    # nobody will hand off: cached, unlocked, gone
    return replace(s, phase=DrcPhase.RELEASED, deadline=e.deadline, landed=True), [_LOCK_PROMPT, *_GONE]


def _failed(s: DrcState, e: DrcFailed) -> Result:
    return replace(s, phase=DrcPhase.FAILED, failure=e.failure), [_UNLOCK]


def _failed_kept(s: DrcState, e: DrcFailed) -> Result:
    return replace(s, phase=DrcPhase.RELEASED, failure=e.failure), list(_GONE)


def _handed_off(s: DrcState, e: HandedOff) -> Result:
    return replace(s, phase=DrcPhase.HANDED_OFF), []


def _released(s: DrcState, e: Released) -> Result:
    if s.phase.landing and e.keep_kv:
        return replace(s, phase=DrcPhase.LANDING_KEPT), []
    return replace(s, phase=DrcPhase.RELEASED), list(_GONE)


def _expired(s: DrcState, e: Expired) -> Result:
    failure = TIMED_OUT if s.phase.landing else s.failure
    return replace(s, phase=DrcPhase.EXPIRED, failure=failure), list(_GONE)


_REGISTERED = (DrcPhase.LANDING, DrcPhase.LANDING_KEPT, DrcPhase.READY, DrcPhase.HANDED_OFF, DrcPhase.FAILED)
_HANDLERS = {
    (DrcPhase.NEW, Registered): _registered,
    (DrcPhase.LANDING, KvLanded): _kv_landed,
    (DrcPhase.LANDING_KEPT, KvLanded): _kv_landed_kept,
    (DrcPhase.LANDING, DrcFailed): _failed,
    (DrcPhase.LANDING_KEPT, DrcFailed): _failed_kept,
    (DrcPhase.READY, HandedOff): _handed_off,  # else stale (not landed, failed) or a duplicate (HANDED_OFF)
    **{(phase, Released): _released for phase in _REGISTERED},
    **{(phase, Expired): _expired for phase in _REGISTERED},
}
# Late events after the end change nothing: a WAN outcome of a released room (its KV goes with
# the room), a second release or expiry. A handoff or a registration there is illegal.
_AFTER_END = {KvLanded: IGNORE, DrcFailed: IGNORE, Released: IGNORE, Expired: IGNORE}


def _illegal(s: DrcState, e: Event) -> str:
    if s.phase is DrcPhase.NEW:
        return f"{type(e).__name__} before the room was registered"
    return f"{type(e).__name__} in phase {s.phase.value}"


transition = table_machine(_HANDLERS, error=IllegalDrcEvent, terminal=(DrcPhase.RELEASED, DrcPhase.EXPIRED),
                           after_end=_AFTER_END, illegal=_illegal, noun="room", actions=Action)
transition.__doc__ = """The room's one transition function. Raises IllegalDrcEvent for an illegal event."""
