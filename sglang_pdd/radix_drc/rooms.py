"""MD's side of a WAN KV transfer, per bootstrap room, on top of a radix tree (pure logic).

The room table: each room's course is decided by radix_drc/room_state.py's ``transition``
(every change of a room's state goes through it); this module performs its actions on the
tree. All calls but ``hand_off`` on the scheduler thread, which owns the tree:

    register  -> LANDING   match the prompt in the tree and LOCK the matched prefix, so what
                           P is told MD has (decode_prefix_len) cannot be evicted before the
                           suffix lands: P-side and MD-side hit rates stay aligned by design
    wan ok    -> READY     the suffix's KV enters the tree under the prompt's token ids and the
                           whole prompt is LOCKED until the handoff request has matched it
    wan fail  -> FAILED    prefix unlocked; RLD finishes the request (the router's fallback)
    release / expiry       every lock the room holds is dropped; the room is forgotten

The tree is reached only through ``TreeOps`` so this module is unit-tested with a fake.
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence, Union

from sglang_pdd.kv_channel.layout import align_down
from sglang_pdd.machine import Driver
from sglang_pdd.radix_drc.room_state import (Event, Expired, DrcFailed, FailReason, Failure, ForgetRoom, HandedOff,
                                             IllegalDrcEvent, KvLanded, LockPrompt, DrcState, DrcPhase,
                                             Registered, Released, UnlockAll, transition)

logger = logging.getLogger(__name__)


class TreeOps(Protocol):
    def match(self, token_ids: Sequence[int]) -> tuple[int, Any]:
        """(cached_len, node): longest cached prefix, page-aligned."""

    def lock(self, node: Any) -> Any: ...

    def unlock(self, lock: Any) -> None: ...

    def ingest(self, token_ids: Sequence[int], prefix_len: int, prefix_node: Any, kv: Any) -> Any:
        """Insert the prompt into the tree with ``kv`` (the arrived KV of token_ids[prefix_len:],
        e.g. the pool slots it was written into; ingest owns it from here); return the node of
        the full prompt. Raises DrcFull if no room."""


class DrcFull(RuntimeError):
    """No KV slots left on MD for an arriving suffix, even after eviction."""


class RoomError(ValueError):
    """Bad use of the room API (unknown room, duplicate registration); nothing changes."""


class RoomReleased(RoomError):
    """A registration that came in after the router had released its room: refused."""


class RoomsFull(RoomError):
    """The room table is full (``max_rooms`` open): retry later (HTTP 503), nothing changed."""


class RoomStatus(str, enum.Enum):
    PENDING = "pending"
    READY = "ready"
    FAILED = "failed"


@dataclass
class DrcRoom:
    room: int
    token_ids: tuple[int, ...]
    cached_len: int
    state: DrcState = DrcState()  # changed only by DrcRoomTable, through room_state.transition
    locks: list = field(default_factory=list)

    @property
    def status(self) -> RoomStatus:
        """What the router sees: pending until the KV landed or failed."""
        return _status(self.state)

    @property
    def reason(self) -> str:
        return _reason(self.state)

    def report(self) -> dict:
        """Status and reason from one reading of the state (a control thread reads it while the
        scheduler thread may replace it)."""
        state = self.state
        return {"status": _status(state).value, "reason": _reason(state)}

    @property
    def deadline(self) -> float:
        return self.state.deadline

    @property
    def handed_off(self) -> bool:
        """The final handoff came: a second one is a duplicate."""
        return self.state.phase is DrcPhase.HANDED_OFF


def _status(state: DrcState) -> RoomStatus:
    if not state.phase.terminal:
        return _STATUS[state.phase]
    return RoomStatus.FAILED if state.failure else RoomStatus.READY if state.landed else RoomStatus.PENDING


def _reason(state: DrcState) -> str:
    return state.failure.text if state.failure else ""


_STATUS = {DrcPhase.NEW: RoomStatus.PENDING, DrcPhase.LANDING: RoomStatus.PENDING, DrcPhase.LANDING_KEPT: RoomStatus.PENDING,
           DrcPhase.READY: RoomStatus.READY, DrcPhase.HANDED_OFF: RoomStatus.READY, DrcPhase.FAILED: RoomStatus.FAILED}


class DrcRoomTable:
    def __init__(self, tree: TreeOps, ttl_s: float = 60.0, max_rooms: int = 4096, page_size: int = 1,
                 remember_released: int = 4096):
        self.tree = tree
        self.page_size = page_size  # the tree holds whole pages: prefixes are cut on page boundaries
        self.ttl_s = ttl_s
        self.max_rooms = max_rooms
        self.rooms: dict[int, DrcRoom] = {}
        # Room ids released lately (the newest ``remember_released``). Room ids are never reused,
        # so a registration of one of them is a late one: the router gave up on it (the request
        # ended) and released it before the registration came in, on another connection. Opened
        # anyway, the room would pin its prefix and pages for a transfer nobody sends until it
        # expires (and keep MD from flushing meanwhile).
        self._released: "collections.OrderedDict[int, None]" = collections.OrderedDict()
        self._remember_released = remember_released
        # The final handoff (a control thread) and the scheduler thread's events may meet on a
        # READY room: each reads and replaces a room's state under this lock.
        self._lock = threading.Lock()
        self._machine = Driver(transition, {LockPrompt: self._lock_prompt, UnlockAll: self._unlock_all,
                                            ForgetRoom: self._forget})

    def register(self, room: int, token_ids: Sequence[int], now: float,
                 ttl_s: Optional[float] = None, use_cache: bool = True) -> DrcRoom:
        """``use_cache=False`` ignores MD's cached prefix (the whole prompt crosses the WAN):
        the baseline "plain cross-DC PD" that benchmarks compare DRC against."""
        if room in self.rooms:
            raise RoomError(f"room {room} is already registered")
        if room in self._released:
            raise RoomReleased(f"room {room} was released before its registration came in")
        if not token_ids:
            raise RoomError(f"room {room}: empty prompt")
        if len(self.rooms) >= self.max_rooms:
            raise RoomsFull(f"room {room}: too many open rooms ({self.max_rooms})")
        entry = DrcRoom(room, tuple(token_ids), 0)
        if use_cache:
            # At least the last prompt token always crosses the WAN, so every room has a
            # transfer whose arrival marks it ready (a fully cached prompt sends its last
            # page). P sends from this page boundary on. The match is of that shorter prefix
            # itself, not the whole prompt cut back: in a sliding-window cache a prefix is a
            # hit only where the window before its end is cached, and the whole prompt's hit
            # says nothing about the window before its last page.
            usable = align_down(len(token_ids) - 1, self.page_size)
            cached_len, node = self.tree.match(token_ids[:max(usable, 1)])
            entry.cached_len = min(align_down(cached_len, self.page_size), usable)
            entry.locks.append(self.tree.lock(node))
        self._step(entry, Registered(now + (ttl_s or self.ttl_s)))
        self.rooms[room] = entry
        return entry

    def complete(self, room: int, kv: Any, now: float) -> DrcRoom:
        """The WAN delivered the suffix [cached_len, len) into ``kv``."""
        entry = self._get(room)
        event = KvLanded(now + self.ttl_s)  # READY holds the prompt until the handoff arrives
        try:
            transition(entry.state, event)  # legal here? (nothing is ingested otherwise)
        except IllegalDrcEvent:
            raise RoomError(f"room {room} is {entry.status.value}, not pending") from None
        try:
            prompt_node = self.tree.ingest(entry.token_ids, entry.cached_len, None, kv)
        except DrcFull as e:
            return self.fail(room, Failure(FailReason.DRC_FULL, str(e)))
        self._step(entry, event, prompt_node)
        return entry

    def fail(self, room: int, failure: Union[Failure, str]) -> DrcRoom:
        """The room's KV will not land (``failure``: a bare string is the WAN's reason)."""
        entry = self._get(room)
        self._step(entry, DrcFailed(failure if isinstance(failure, Failure) else Failure(FailReason.WAN, failure)))
        return entry

    def release(self, room: int, keep_pending_kv: bool = False) -> bool:
        """ForgetRoom a room. ``keep_pending_kv``: if its KV is still crossing the WAN, let it
        land and enter the cache first (the request ended on RLD, but the next turn of the
        session will want this prefix on MD); the room goes when complete/fail/expire."""
        self._remember_release(room)
        entry = self.rooms.get(room)
        if entry is None:
            return False
        self._step(entry, Released(keep_kv=keep_pending_kv))
        return True

    def unregister(self, room: int) -> bool:
        """Undo a registration that did not go through (refused further on): its id may be
        registered again."""
        entry = self.rooms.get(room)
        if entry is None:
            return False
        self._step(entry, Released())
        return True

    def _remember_release(self, room: int) -> None:
        self._released[room] = None
        self._released.move_to_end(room)
        while len(self._released) > self._remember_released:
            self._released.popitem(last=False)

    def hand_off(self, room: int) -> DrcRoom:
        """The final handoff for a READY room (any thread); RoomError if stale or a duplicate."""
        entry = self.rooms.get(room)
        try:
            if entry is None:
                raise RoomError("unknown")
            self._step(entry, HandedOff())
        except RoomError:
            if entry is not None and entry.state.phase is DrcPhase.HANDED_OFF:
                raise RoomError(f"duplicate handoff for room {room}") from None
            what = "unknown" if entry is None or entry.state.phase.terminal else entry.status.value
            raise RoomError(f"stale handoff: room {room} is {what}") from None
        return entry

    def expire(self, now: float) -> list[DrcRoom]:
        """Drop rooms past their deadline (a router that vanished must not pin MD's memory)."""
        expired = [e for e in self.rooms.values() if e.state.expired_at(now)]
        for entry in expired:
            self._step(entry, Expired())
        return expired

    def pending(self) -> list[DrcRoom]:
        return [e for e in self.rooms.values() if e.state.phase.landing]

    def kept_for_cache(self) -> list[int]:
        """Rooms whose request is over, landing only to enter the cache (LANDING_KEPT)."""
        return [e.room for e in self.rooms.values() if e.state.phase is DrcPhase.LANDING_KEPT]

    def _step(self, entry: DrcRoom, event: Event, prompt_node: Any = None) -> None:
        """The room's one way to change: the transition under the lock (an illegal event is a
        RoomError for the caller), then its actions on the tree (``prompt_node``: where the
        landed prompt entered it). The Driver's two halves, not its ``step``: the lock is
        dropped between them, so a control thread's handoff waits for the state change only,
        never for the tree."""
        try:
            with self._lock:
                actions = self._machine.advance(entry, event)
        except IllegalDrcEvent as e:
            raise RoomError(f"room {entry.room}: {e}") from None
        for action in actions:
            self._machine.perform(entry, action, prompt_node)

    def _lock_prompt(self, entry: DrcRoom, action: LockPrompt, prompt_node: Any) -> None:
        prefix_locks, entry.locks = entry.locks, [self.tree.lock(prompt_node)]
        for lock in prefix_locks:
            self.tree.unlock(lock)

    def _forget(self, entry: DrcRoom, action: ForgetRoom, prompt_node: Any = None) -> None:
        if self.rooms.get(entry.room) is entry:
            del self.rooms[entry.room]

    def _get(self, room: int) -> DrcRoom:
        try:
            return self.rooms[room]
        except KeyError:
            raise RoomError(f"unknown room {room}") from None

    def _unlock_all(self, entry: DrcRoom, action: UnlockAll, prompt_node: Any = None) -> None:
        locks, entry.locks = entry.locks, []
        for lock in locks:
            self.tree.unlock(lock)
