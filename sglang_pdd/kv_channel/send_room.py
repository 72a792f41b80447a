"""One room on the WAN sender as an explicit state machine (pure; on the machine kit, sglang_pdd/machine.py).

``transition(state, event) -> (state, actions)`` decides every change of a room's
``RoomState``; wan_sender.py is the I/O shell that turns producer calls, session changes,
receiver replies and the watchdog into events, applies them under its lock and performs the
actions. The states are SGLang's KVPoll numbering (contract.py)::

    BOOTSTRAPPING ──SessionUp──▶ WAITING_FOR_INPUT ──ChunkQueued / EndQueued──▶ TRANSFERRING
         │  └──────────SessionUp (a chunk or END already queued)─────────────────▲   │
         │                                                                       SendAcked (END queued,
         └── SendFailed (any non-terminal state) ──▶ FAILED            SUCCESS ◀──── every byte)

Events (who sends them):

    SessionUp()                 the stream threads, once all N streams are authenticated
    ChunkQueued()               the producer (send_chunk) queued one chunk
    EndQueued()                 the producer (finish) queued TRANSFER_END after the last chunk
    SendAcked(total_bytes)            the receiver: SUCCESS if END was queued and the byte count
                                matches, else FAILED(protocol): a premature ACK
    SendFailed(reason, detail, tell_peer)  NACK / ABORT from the receiver, a broken session, the
                                watchdog (timeout, idle), abort() / release() by the owner

Replies and failures race with each other (a NACK after the watchdog failed the room, an ACK
after an abort), so SendAcked and SendFailed on a terminal room are ignored. The producer's and the
session's events are refused there (``IllegalSendEvent``): the shell checks for a terminal
room first, under the same lock, so one arriving is a bug.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Union

from sglang_pdd.machine import IGNORE, IllegalTransition, table_machine

from .contract import FailureReason, RoomState


class IllegalSendEvent(IllegalTransition):
    """An event that is illegal in the room's current state."""


# ---------------------------------------------------------------------------------- events
@dataclass(frozen=True)
class SessionUp:
    pass


@dataclass(frozen=True)
class ChunkQueued:
    pass


@dataclass(frozen=True)
class EndQueued:
    pass


@dataclass(frozen=True)
class SendAcked:
    total_bytes: int  # what the receiver verified


@dataclass(frozen=True)
class SendFailed:
    reason: str  # a FailureReason value
    detail: str
    tell_peer: bool = True  # send ABORT so the receiver stops waiting (not when it told us, or is gone)


Event = Union[SessionUp, ChunkQueued, EndQueued, SendAcked, SendFailed]


# ---------------------------------------------------------------------------------- actions
@dataclass(frozen=True)
class WakeSendWaiters:
    """The room reached SUCCESS or FAILED: wake its waiters."""


@dataclass(frozen=True)
class AbortPeer:
    """Queue ABORT(reason) to the receiver (the writers skip the room's other frames now)."""
    reason: str


Action = Union[WakeSendWaiters, AbortPeer]


# ---------------------------------------------------------------------------------- state
@dataclass(frozen=True)
class SendState:
    num_chunks: int
    total_bytes: int
    state: RoomState = RoomState.BOOTSTRAPPING
    chunks_queued: int = 0
    end_queued: bool = False
    reason: str = ""  # FailureReason value once FAILED
    detail: str = ""

    @property
    def has_input(self) -> bool:
        return self.chunks_queued > 0 or self.end_queued


def start(num_chunks: int, total_bytes: int, session_up: bool) -> SendState:
    """A new room: WAITING_FOR_INPUT on a session that is up, else BOOTSTRAPPING."""
    return SendState(num_chunks, total_bytes,
                    RoomState.WAITING_FOR_INPUT if session_up else RoomState.BOOTSTRAPPING)


Result = tuple[SendState, list]
_WAKE = WakeSendWaiters()


def _session_up(r: SendState, e: SessionUp) -> Result:
    return replace(r, state=RoomState.TRANSFERRING if r.has_input else RoomState.WAITING_FOR_INPUT), []


def _input_state(r: SendState) -> RoomState:
    # Before the session is up the room stays BOOTSTRAPPING; its frames wait in the queue.
    return RoomState.TRANSFERRING if r.state is RoomState.WAITING_FOR_INPUT else r.state


def _chunk_queued(r: SendState, e: ChunkQueued) -> Result:
    if r.end_queued:
        raise IllegalSendEvent("chunk queued after TRANSFER_END")
    if r.chunks_queued >= r.num_chunks:
        raise IllegalSendEvent(f"chunk {r.chunks_queued + 1} queued, the plan has {r.num_chunks}")
    return replace(r, state=_input_state(r), chunks_queued=r.chunks_queued + 1), []


def _end_queued(r: SendState, e: EndQueued) -> Result:
    if r.end_queued:
        raise IllegalSendEvent("TRANSFER_END queued twice")
    if r.chunks_queued != r.num_chunks:
        raise IllegalSendEvent(f"TRANSFER_END with {r.num_chunks - r.chunks_queued} chunks not queued")
    return replace(r, state=_input_state(r), end_queued=True), []


def _ack(r: SendState, e: SendAcked) -> Result:
    if r.end_queued and e.total_bytes == r.total_bytes:
        return replace(r, state=RoomState.SUCCESS), [_WAKE]
    return _fail(r, SendFailed(FailureReason.PROTOCOL, f"premature ACK ({e.total_bytes} bytes)"))


def _fail(r: SendState, e: SendFailed) -> Result:
    actions: list = [_WAKE]
    if e.tell_peer:
        actions.append(AbortPeer(e.reason))
    return replace(r, state=RoomState.FAILED, reason=e.reason, detail=e.detail), actions


_HANDLERS = {
    (RoomState.BOOTSTRAPPING, SessionUp): _session_up,
    ChunkQueued: _chunk_queued,  # in any live state (before the session is up the frames wait)
    EndQueued: _end_queued,
    SendAcked: _ack,
    SendFailed: _fail,
}
# Replies and failures race with the end (a NACK after the watchdog failed the room, an ACK after
# an abort): ignored there. The producer's and the session's events after the end are bugs.
_AFTER_END = {SendAcked: IGNORE, SendFailed: IGNORE}

transition = table_machine(_HANDLERS, error=IllegalSendEvent, status="state",
                           terminal=(RoomState.SUCCESS, RoomState.FAILED), after_end=_AFTER_END, noun="room",
                           illegal=lambda r, e: f"session up, but the room is {r.state.name}", actions=Action)
transition.__doc__ = """The room's one transition function. Raises IllegalSendEvent for an illegal event."""
