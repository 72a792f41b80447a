"""P's WAN room (one request's KV to MD, sglang_glue/p/wan_fanout.py) as an explicit state
machine (pure; on the machine kit, sglang_pdd/machine.py).

``transition(state, event) -> (state, actions)`` decides every change of the room; WanFanout
is the I/O shell that feeds it events from the scheduler thread (pages offered, the request
ended, an abort), the copy thread and the send thread, under its lock, and performs the
actions. A room exists once P knows its destination (the fan-out opens it then); how far each
share's copies got (``RankShare.groups_copied``) and which pages arrived are data, not state.

Phases::

    RECEIVING ──PagesOffered(last)──▶ OFFERED ──ShareEnded (every share)──▶ SENT
        │                                │                               │
        └─── Cancel / RequestEnded ──────┴──── Cancel ───────────────────┴──▶ CANCELLED
        └─── FanoutFailed (a share, the copy, the staging budget, a send) ──────────────▶ FAILED

SENT means every share's TRANSFER_END is with its sender; the ACKs are the sender's business
(its room's state, send_room.py), and a share that fails after that still fails this room.

Orthogonal to the phase, the copy thread's hold on the room: IDLE -> QUEUED (pages to copy)
-> COPYING -> IDLE, or QUEUED again when more pages arrived meanwhile. It keeps moving after
the room is dropped, since P may free the pages only once no copy reads them.

Events (who sends them):

    PagesOffered(count, last)  scheduler  the next pool pages; queue a copy if none is pending
    CopyTaken(has_work)        copy       took the room off its queue: COPYING if there is
                                          work and the room is live, else IDLE
    CopyEnded(more_ready)      copy       a copy round ended; QUEUED again if pages wait
    ShareEnded()                 send       one share's TRANSFER_END was handed to its sender
    RequestEnded()             scheduler  P is done with the pages: a room still RECEIVING
                                          is CANCELLED(incomplete)
    Cancel(detail)             scheduler  P drops the room (request aborted, destination
                                          withdrawn): CANCELLED(cancelled)
    FanoutFailed(reason, ...)          any        FAILED with a DropReason (and a share's FailureReason)

Pages, cancels and failures after the room was dropped are ignored (P keeps offering until
it learns; a share fails while another failure drops the room). Events that cannot happen
(pages after the last, a copy round that was not started, more ENDs than shares) raise
``IllegalFanoutEvent``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Optional, Union

from sglang_pdd.machine import IGNORE, IllegalTransition, table_machine


class IllegalFanoutEvent(IllegalTransition):
    """An event that is illegal in the room's current state."""


class FanoutPhase(str, enum.Enum):
    RECEIVING = "receiving"  # P's pages still arriving; copies and sends follow them
    OFFERED = "offered"  # P's last page offered; copies and ENDs may remain
    SENT = "sent"  # every share's TRANSFER_END is with its sender
    CANCELLED = "cancelled"  # P dropped the room
    FAILED = "failed"  # the WAN transfer failed

    @property
    def dropped(self) -> bool:
        return self in (FanoutPhase.CANCELLED, FanoutPhase.FAILED)


class CopyHold(str, enum.Enum):
    IDLE = "idle"
    QUEUED = "queued"  # on the copy thread's queue
    COPYING = "copying"  # the copy thread reads the room's pages now


class DropReason(str, enum.Enum):
    """Why a room was dropped (MD's room fails with it and RLD finishes the request)."""

    CANCELLED = "cancelled"  # P's request was aborted, or its destination withdrawn
    INCOMPLETE = "incomplete"  # P's request ended before all of its KV was produced
    STAGING_BUDGET = "staging_budget"  # its host copies would pass --pdd-wan-staging-mb
    COPY_FAILED = "copy_failed"  # copying pages out of the pool raised
    SEND_FAILED = "send_failed"  # handing a chunk or the END to a sender raised
    SHARE_FAILED = "share_failed"  # one MD rank's transfer failed (``share_failure`` says why)

    @property
    def phase(self) -> FanoutPhase:
        return FanoutPhase.CANCELLED if self in (DropReason.CANCELLED, DropReason.INCOMPLETE) else FanoutPhase.FAILED


# ---------------------------------------------------------------------------------- events
@dataclass(frozen=True)
class PagesOffered:
    count: int
    last: bool = False


@dataclass(frozen=True)
class CopyTaken:
    has_work: bool  # some share has page groups ready to copy


@dataclass(frozen=True)
class CopyEnded:
    more_ready: bool  # page groups became ready while copying


@dataclass(frozen=True)
class ShareEnded:
    pass


@dataclass(frozen=True)
class RequestEnded:
    pass


@dataclass(frozen=True)
class Cancel:
    detail: str  # the owner's words, for the log


@dataclass(frozen=True)
class FanoutFailed:
    reason: DropReason
    detail: str = ""
    share_failure: str = ""  # SHARE_FAILED: the share's FailureReason value (kv_channel/contract.py)


Event = Union[PagesOffered, CopyTaken, CopyEnded, ShareEnded, RequestEnded, Cancel, FanoutFailed]


# ---------------------------------------------------------------------------------- actions
@dataclass(frozen=True)
class QueueCopy:
    """Put the room on the copy thread's queue."""


@dataclass(frozen=True)
class AbortSendRooms:
    """Abort every share's room on its sender: every MD rank's room fails, none is ready
    without the others."""


@dataclass(frozen=True)
class CountSent:
    """Every share's TRANSFER_END is with its sender (a room finished on P's side)."""


Action = Union[QueueCopy, AbortSendRooms, CountSent]


# ---------------------------------------------------------------------------------- state
@dataclass(frozen=True)
class FanoutState:
    shares: int  # MD ranks this room goes to
    phase: FanoutPhase = FanoutPhase.RECEIVING
    copy: CopyHold = CopyHold.IDLE
    pages_offered: int = 0
    shares_ended: int = 0  # TRANSFER_ENDs handed to the senders
    reason: Optional[DropReason] = None
    share_failure: str = ""  # FailureReason value of the failed share (reason SHARE_FAILED)
    detail: str = ""

    @property
    def dropped(self) -> bool:
        return self.phase.dropped

    @property
    def summary(self) -> str:
        """Why the room was dropped, in words (for logs and the senders' abort detail)."""
        return self.share_failure if self.reason is DropReason.SHARE_FAILED else self.detail

    def may_free_pages(self, copy_done: bool) -> bool:
        """After RequestEnded: whether P may free the request's pages — every page copied,
        or the room dropped and no copy reading them."""
        if self.dropped:
            return self.copy is CopyHold.IDLE
        return self.phase is not FanoutPhase.RECEIVING and copy_done


Result = tuple[FanoutState, list]
_QUEUE_COPY, _ABORT_SEND_ROOMS, _COUNT_SENT = QueueCopy(), AbortSendRooms(), CountSent()
INCOMPLETE_DETAIL = "P's request ended before all of its KV was produced"


def _pages_offered(r: FanoutState, e: PagesOffered) -> Result:
    phase = r.phase
    if e.last:
        phase = FanoutPhase.SENT if r.shares_ended == r.shares else FanoutPhase.OFFERED
    r = replace(r, phase=phase, pages_offered=r.pages_offered + e.count)
    if r.copy is CopyHold.IDLE:
        return replace(r, copy=CopyHold.QUEUED), [_QUEUE_COPY]
    return r, []  # the copy thread takes the new pages on this round or the next


def _copy_taken(r: FanoutState, e: CopyTaken) -> Result:
    if r.copy is not CopyHold.QUEUED:
        raise IllegalFanoutEvent(f"copy taken, but the room is {r.copy.value}")
    return replace(r, copy=CopyHold.COPYING if e.has_work and not r.dropped else CopyHold.IDLE), []


def _copy_ended(r: FanoutState, e: CopyEnded) -> Result:
    if r.copy is not CopyHold.COPYING:
        raise IllegalFanoutEvent(f"copy ended, but the room is {r.copy.value}")
    if e.more_ready and not r.dropped:
        return replace(r, copy=CopyHold.QUEUED), [_QUEUE_COPY]
    return replace(r, copy=CopyHold.IDLE), []


def _share_ended(r: FanoutState, e: ShareEnded) -> Result:
    if r.shares_ended >= r.shares:
        raise IllegalFanoutEvent(f"TRANSFER_END {r.shares_ended + 1} of a room with {r.shares} shares")
    r = replace(r, shares_ended=r.shares_ended + 1)
    if r.shares_ended < r.shares:
        return r, []
    return (replace(r, phase=FanoutPhase.SENT) if r.phase is FanoutPhase.OFFERED else r), [_COUNT_SENT]


def _request_ended(r: FanoutState, e: RequestEnded) -> Result:
    return _drop(r, DropReason.INCOMPLETE, INCOMPLETE_DETAIL)


def _cancel(r: FanoutState, e: Cancel) -> Result:
    return _drop(r, DropReason.CANCELLED, e.detail)


def _fail(r: FanoutState, e: FanoutFailed) -> Result:
    if e.reason.phase is not FanoutPhase.FAILED:
        raise IllegalFanoutEvent(f"{e.reason.value} is a cancel, not a failure")
    if (e.reason is DropReason.SHARE_FAILED) != bool(e.share_failure):
        raise IllegalFanoutEvent("a share's failure reason comes with SHARE_FAILED, and only with it")
    return _drop(r, e.reason, e.detail, e.share_failure)


def _drop(r: FanoutState, reason: DropReason, detail: str, share_failure: str = "") -> Result:
    if r.dropped:
        return r, []  # the first reason stands
    return replace(r, phase=reason.phase, reason=reason, detail=detail, share_failure=share_failure), [_ABORT_SEND_ROOMS]


_DROPPED = (FanoutPhase.CANCELLED, FanoutPhase.FAILED)
_HANDLERS = {
    (FanoutPhase.RECEIVING, PagesOffered): _pages_offered,  # OFFERED, SENT: pages after the last
    **{(phase, PagesOffered): IGNORE for phase in _DROPPED},  # later pages are discarded
    CopyTaken: _copy_taken,  # the copy hold, not the phase, decides (also after a drop)
    CopyEnded: _copy_ended,
    ShareEnded: _share_ended,
    **{(phase, ShareEnded): IGNORE for phase in _DROPPED},  # the senders' rooms were aborted: no success
    (FanoutPhase.RECEIVING, RequestEnded): _request_ended,
    RequestEnded: IGNORE,  # every page was offered, or the room is dropped
    Cancel: _cancel,
    FanoutFailed: _fail,
}


def _illegal(r: FanoutState, e: Event) -> str:
    return f"{e.count} pages offered after the last ({r.phase.value})"  # the one missing live pair


# No terminal state for the kit: a dropped room still tracks the copy thread's hold on its pages
# (P frees them only once no copy reads them); the table says what a dropped room ignores.
transition = table_machine(_HANDLERS, error=IllegalFanoutEvent, illegal=_illegal, noun="room", actions=Action)
transition.__doc__ = """The room's one transition function. Raises IllegalFanoutEvent for an illegal event."""
