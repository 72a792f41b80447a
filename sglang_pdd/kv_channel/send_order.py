"""The order in which P's WAN sender puts queued KV on the wire (pure: no I/O, no locks; its
owner holds them).

Two kinds of rooms share one link to MD:

* **waited** rooms: someone waits for the KV to land (a P->MD request's MD, a relayed
  request whose RLD still decodes and will hand over);
* **kept** rooms: the request already ended on RLD, the router released MD's room with keep,
  and the KV lands only so that the session's next turn hits MD's cache.

A kept room's bytes must not delay a waited one's, so every waited item goes before every kept
one (strict priority). Within a kind, rooms take turns item by item (a chunk each), so the link
is shared fairly between the rooms of a kind: a small transfer queued behind a large one lands
after about twice its own bytes, not after the large one (the router's estimate,
router/backends/wan_in_flight.competing_wan_bytes, counts on that). Within one room, items keep their
order (its BEGIN before its chunks, its END after them). Urgent items (an ABORT frame) go before
everything.
"""

from __future__ import annotations

import collections
from typing import Any, Generic, Hashable, Optional, TypeVar

T = TypeVar("T")


class SendOrder(Generic[T]):
    """Queued items of many rooms; ``pop`` answers the next to send."""

    def __init__(self) -> None:
        self._items: dict[Hashable, collections.deque] = {}  # room -> its items, in order
        self._turns = {False: collections.deque(), True: collections.deque()}  # kept? -> rooms with items
        self._kept: set = set()  # rooms marked kept (also before or after they have items)
        self._urgent: collections.deque = collections.deque()
        self.waited_bytes = 0
        self.kept_bytes = 0

    # ---------------------------------------------------------------- queries
    def __len__(self) -> int:
        return len(self._urgent) + sum(len(q) for q in self._items.values())

    def __bool__(self) -> bool:
        return bool(self._urgent or self._items)

    @property
    def queued_bytes(self) -> int:
        return self.waited_bytes + self.kept_bytes

    def is_kept(self, room: Hashable) -> bool:
        return room in self._kept

    # ---------------------------------------------------------------- changes
    def push(self, room: Hashable, item: T, nbytes: int = 0, urgent: bool = False) -> None:
        """Queue ``item`` (``nbytes`` of payload) after the room's earlier items; ``urgent``:
        before every queued item (it carries no payload the window counts)."""
        if urgent:
            self._urgent.append((room, item, 0))
            return
        queue = self._items.get(room)
        kept = room in self._kept
        if queue is None:
            queue = self._items[room] = collections.deque()
            self._turns[kept].append(room)
        queue.append((item, nbytes))
        self._count(kept, nbytes)

    def pop(self) -> Optional[tuple[Hashable, T, int]]:
        """The next item to send as (room, item, nbytes), or None when nothing is queued."""
        if self._urgent:
            return self._urgent.popleft()
        for kept in (False, True):
            turns = self._turns[kept]
            if not turns:
                continue
            room = turns.popleft()
            queue = self._items[room]
            item, nbytes = queue.popleft()
            if queue:
                turns.append(room)  # its next item after the other rooms' next ones
            else:
                del self._items[room]
            self._count(kept, -nbytes)
            return room, item, nbytes
        return None

    def keep_only(self, room: Hashable) -> bool:
        """Nobody waits for ``room`` any more: its queued items and later ones go behind every
        waited room's. Returns whether it was waited before (False: already kept)."""
        if room in self._kept:
            return False
        self._kept.add(room)
        queue = self._items.get(room)
        if queue is not None:
            self._turns[False].remove(room)
            self._turns[True].append(room)
            moved = sum(n for _, n in queue)
            self._count(False, -moved)
            self._count(True, moved)
        return True

    def forget(self, room: Hashable) -> list:
        """The room ended: drop its queued items (returned) and its kept mark."""
        self._kept.discard(room)
        queue = self._items.pop(room, None)
        if queue is None:
            return []
        kept_turns = self._turns[True]
        turns = kept_turns if room in kept_turns else self._turns[False]
        turns.remove(room)
        nbytes = sum(n for _, n in queue)
        self._count(turns is kept_turns, -nbytes)
        return [item for item, _ in queue]

    def clear(self) -> None:
        self.__init__()

    def _count(self, kept: bool, nbytes: int) -> None:
        if kept:
            self.kept_bytes += nbytes
        else:
            self.waited_bytes += nbytes


__all__ = ["SendOrder"]
