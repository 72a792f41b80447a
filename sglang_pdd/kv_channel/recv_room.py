"""One room on the WAN receiver (MD) as an explicit state machine (pure; on the machine kit,
sglang_pdd/machine.py).

wan_receiver.py is the I/O shell: its reader threads, the owner's calls and the watchdog turn
frames and timers into events, apply them under the receiver's lock and perform the actions.
Which pages arrived, from which sender slice, is data the shell keeps (it decides when every
byte is verified); the room's course is decided here. The states are SGLang's KVPoll
numbering (contract.py)::

    WAITING_FOR_INPUT ──DataArrived──▶ TRANSFERRING ──AllVerified──▶ SUCCESS
            │                               │
            └────────── ReceiveFailed ──────┴──────────────────────▶ FAILED

Events (who sends them):

    DataArrived()                          a reader thread: a BEGIN, END or chunk was accepted
    AllVerified()                          a reader thread: every part's every byte verified
    ReceiveFailed(reason, detail, tell_peer)  a reader thread (layout mismatch, integrity, a
                                           sender's ABORT, its session lost), the owner
                                           (abort, release, close) or the watchdog (timeout)

A failure races with the end (the owner releases a room the watchdog just failed, close() fails
every room): ignored after it. Data after the end is refused (``IllegalRecvEvent``): the
shell checks for a terminal room first, under the same lock, so one arriving is a bug.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Union

from sglang_pdd.machine import IGNORE, IllegalTransition, table_machine

from .contract import RoomState


class IllegalRecvEvent(IllegalTransition):
    """An event that is illegal in the receiver room's current state."""


# ---------------------------------------------------------------------------------- state
@dataclass(frozen=True)
class RecvState:
    state: RoomState = RoomState.WAITING_FOR_INPUT
    reason: str = ""  # a FailureReason value once FAILED
    detail: str = ""


# ---------------------------------------------------------------------------------- events
@dataclass(frozen=True)
class DataArrived:
    pass


@dataclass(frozen=True)
class AllVerified:
    pass


@dataclass(frozen=True)
class ReceiveFailed:
    reason: str  # a FailureReason value
    detail: str
    tell_peer: bool  # NACK the room's senders (not when they told us, or the stream is the stalled thing)


Event = Union[DataArrived, AllVerified, ReceiveFailed]


# ---------------------------------------------------------------------------------- actions
@dataclass(frozen=True)
class WakeReceiveWaiters:
    """The room reached SUCCESS or FAILED: set its ``done`` and wake whoever waits on the lock."""


@dataclass(frozen=True)
class NackSenders:
    """Queue NACK(reason, detail) to every sender of the room."""
    reason: str
    detail: str


Action = Union[WakeReceiveWaiters, NackSenders]
Result = tuple[RecvState, list]
_WAKE = WakeReceiveWaiters()


def _data_arrived(s: RecvState, e: DataArrived) -> Result:
    return replace(s, state=RoomState.TRANSFERRING), []


def _all_verified(s: RecvState, e: AllVerified) -> Result:
    return replace(s, state=RoomState.SUCCESS), [_WAKE]


def _receive_failed(s: RecvState, e: ReceiveFailed) -> Result:
    actions: list = [_WAKE]
    if e.tell_peer:
        actions.append(NackSenders(e.reason, e.detail))
    return RecvState(RoomState.FAILED, e.reason, e.detail), actions


_WAITING, _TRANSFERRING = RoomState.WAITING_FOR_INPUT, RoomState.TRANSFERRING
_HANDLERS = {
    (_WAITING, DataArrived): _data_arrived,
    (_TRANSFERRING, DataArrived): IGNORE,
    (_TRANSFERRING, AllVerified): _all_verified,
    ReceiveFailed: _receive_failed,  # in any live state
}


def _illegal(s: RecvState, e: Event) -> str:
    return f"every byte verified, but nothing arrived ({s.state.name})"  # the one illegal live pair


transition = table_machine(_HANDLERS, error=IllegalRecvEvent, status="state",
                           terminal=(RoomState.SUCCESS, RoomState.FAILED), after_end={ReceiveFailed: IGNORE},
                           noun="room", illegal=_illegal, actions=Action)
transition.__doc__ = """The room's one transition function. Raises IllegalRecvEvent for an illegal event."""
