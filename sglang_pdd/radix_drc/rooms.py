"""MD's side of a WAN KV transfer, per bootstrap room, on top of a radix tree (pure logic).

Lifecycle of a room (all calls on the scheduler thread, which owns the tree):

    register  -> PENDING   match the prompt in the tree and LOCK the matched prefix, so what
                           P is told MD has (decode_prefix_len) cannot be evicted before the
                           suffix lands: P-side and MD-side hit rates stay aligned by design
    wan ok    -> READY     the suffix's KV enters the tree under the prompt's token ids and the
                           whole prompt is LOCKED until the handoff request has matched it
    wan fail  -> FAILED    prefix unlocked; RLD finishes the request (the router's fallback)
    release / expiry       every lock the room holds is dropped; the room is forgotten

The tree is reached only through ``TreeOps`` so this module is unit-tested with a fake.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence

from sglang_pdd.kv_channel.layout import align_down

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
    deadline: float
    status: RoomStatus = RoomStatus.PENDING
    reason: str = ""
    locks: list = field(default_factory=list)
    release_when_done: bool = False  # released while its KV was in flight: cache it, then go
    handed_off: bool = False  # the final handoff came: a second one is a duplicate


class DrcRooms:
    def __init__(self, tree: TreeOps, ttl_s: float = 60.0, max_rooms: int = 4096, page_size: int = 1):
        self.tree = tree
        self.page_size = page_size  # the tree holds whole pages: prefixes are cut on page boundaries
        self.ttl_s = ttl_s
        self.max_rooms = max_rooms
        self.rooms: dict[int, DrcRoom] = {}

    def register(self, room: int, token_ids: Sequence[int], now: float,
                 ttl_s: Optional[float] = None, use_cache: bool = True) -> DrcRoom:
        """``use_cache=False`` ignores MD's cached prefix (the whole prompt crosses the WAN):
        the baseline "plain cross-DC PD" that benchmarks compare DRC against."""
        if room in self.rooms:
            raise RoomError(f"room {room} is already registered")
        if not token_ids:
            raise RoomError(f"room {room}: empty prompt")
        if len(self.rooms) >= self.max_rooms:
            raise RoomsFull(f"room {room}: too many open rooms ({self.max_rooms})")
        entry = DrcRoom(room, tuple(token_ids), 0, now + (ttl_s or self.ttl_s))
        if use_cache:
            cached_len, node = self.tree.match(token_ids)
            # At least the last prompt token always crosses the WAN, so every room has a
            # transfer whose arrival marks it ready (a fully cached prompt sends its last
            # page). P sends from this page boundary on.
            entry.cached_len = min(align_down(cached_len, self.page_size),
                                   align_down(len(token_ids) - 1, self.page_size))
            entry.locks.append(self.tree.lock(node))
        self.rooms[room] = entry
        return entry

    def complete(self, room: int, kv: Any, now: float) -> DrcRoom:
        """The WAN delivered the suffix [cached_len, len) into ``kv``."""
        entry = self._get(room)
        if entry.status is not RoomStatus.PENDING:
            raise RoomError(f"room {room} is {entry.status.value}, not pending")
        try:
            prompt_node = self.tree.ingest(entry.token_ids, entry.cached_len, None, kv)
        except DrcFull as e:
            return self.fail(room, f"drc_full: {e}")
        prefix_locks, entry.locks = entry.locks, [self.tree.lock(prompt_node)]
        for lock in prefix_locks:
            self.tree.unlock(lock)
        entry.status = RoomStatus.READY
        entry.deadline = now + self.ttl_s  # hold the prompt until the handoff arrives
        if entry.release_when_done:  # nobody will hand off: the prompt stays cached, unlocked
            self.release(room)
        return entry

    def fail(self, room: int, reason: str) -> DrcRoom:
        entry = self._get(room)
        self._unlock_all(entry)
        entry.status, entry.reason = RoomStatus.FAILED, reason
        if entry.release_when_done:
            self.rooms.pop(room, None)
        return entry

    def release(self, room: int, keep_pending_kv: bool = False) -> bool:
        """Forget a room. ``keep_pending_kv``: if its KV is still crossing the WAN, let it
        land and enter the cache first (the request ended on RLD, but the next turn of the
        session will want this prefix on MD); the room goes when complete/fail/expire."""
        entry = self.rooms.get(room)
        if entry is None:
            return False
        if keep_pending_kv and entry.status is RoomStatus.PENDING:
            entry.release_when_done = True
            return True
        del self.rooms[room]
        self._unlock_all(entry)
        return True

    def expire(self, now: float) -> list[DrcRoom]:
        """Drop rooms past their deadline (a router that vanished must not pin MD's memory)."""
        expired = [e for e in self.rooms.values() if e.deadline <= now]
        for entry in expired:
            if entry.status is RoomStatus.PENDING:
                entry.status, entry.reason = RoomStatus.FAILED, "timeout"
            self.release(entry.room)
        return expired

    def pending(self) -> list[DrcRoom]:
        return [e for e in self.rooms.values() if e.status is RoomStatus.PENDING]

    def _get(self, room: int) -> DrcRoom:
        try:
            return self.rooms[room]
        except KeyError:
            raise RoomError(f"unknown room {room}") from None

    def _unlock_all(self, entry: DrcRoom) -> None:
        locks, entry.locks = entry.locks, []
        for lock in locks:
            self.tree.unlock(lock)
