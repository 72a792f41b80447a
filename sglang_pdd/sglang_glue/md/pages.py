"""MD's pool pages held for rooms in flight, and their way back once nothing writes there.

A room's pages (reserved at registration, ``pool`` ingest) are written by the WAN receiver's
threads; they go back to SGLang's allocator only after every TP rank's receiver has let go of
the room. Letting go (``WanKvReceiver.release_room``) waits for a chunk still being written
(seconds on a slow WAN), so it runs on this module's own thread, never on the scheduler thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Optional

from sglang_pdd.sglang_glue.md.ingest import Landing

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class PagesRelease:
    """A room's reserved pages, waiting for the receiver (release thread) to let go of it."""
    room: int
    landing: Optional[Landing]
    outcome: Optional[bool] = None  # set by the release thread: True released, False failed


class PageReleases:
    """``held_tokens``: pool slots rooms in flight hold outside the tree (reserved, or waiting
    here); SGLang's leak check counts them (plugin.py). ``releasing``: the rooms waiting, in the
    order every rank queued them (only decisions every rank takes queue one), so the list is
    the same on every rank."""

    def __init__(self, receiver, free_slots, on_outcome: Callable[[], None] = lambda: None):
        self.receiver = receiver
        self._free_slots = free_slots  # SglangTreeOps.free: back to the allocator
        self._on_outcome = on_outcome  # a record's outcome is in: wakes a scheduler sleeping on idle
        self.held_tokens = 0
        self.held_swa_tokens = 0  # of those, slots with sliding-window KV (a hybrid pool's window)
        self.releasing: list[PagesRelease] = []
        self._to_receiver: "queue.Queue[Optional[tuple[int, Optional[PagesRelease]]]]" = queue.Queue()
        self._thread = threading.Thread(target=self._release_rooms_in_receiver, name="pdd-md-room-release",
                                        daemon=True)
        self._thread.start()

    def hold(self, num_tokens: int, window_tokens: int = 0) -> None:
        self.held_tokens += num_tokens
        self.held_swa_tokens += window_tokens

    def _let_go(self, landing: Landing) -> None:
        self.held_tokens -= landing.num_tokens
        self.held_swa_tokens -= landing.window_tokens

    def hand_to_tree(self, landing: Landing) -> None:
        """The landed pages go into the tree (or ingest's frees): no longer ours."""
        self._let_go(landing)

    def free_now(self, landing: Landing) -> None:
        """Pages no receiver ever wrote into (a registration that did not reach the receiver, TP 1)."""
        self._free_slots(landing.slots)
        self._let_go(landing)

    def queue(self, room: int, landing: Optional[Landing], always: bool = False) -> Optional[PagesRelease]:
        """Queue ``landing``'s pages (if any) to go back once every rank's receiver let go;
        ``always``: a record even without pages (a vote every rank casts)."""
        if landing is None or landing.slots is None:
            if not always:
                return None
            landing = None
        record = PagesRelease(room, landing)
        self.releasing.append(record)
        return record

    def let_go_in_receiver(self, room: int, record: Optional[PagesRelease]) -> None:
        """The receiver forgets ``room`` on the release thread; ``record`` learns how it went."""
        self._to_receiver.put((room, record))

    def free_agreed(self, record: PagesRelease, released_everywhere: bool) -> None:
        """Every rank's receiver let go of ``record``'s room (a decision every rank takes)."""
        self.releasing.remove(record)
        landing = record.landing
        if landing is None:
            return
        if not released_everywhere:
            # A writer may still hold the room's pages on some rank: keep them on every rank
            # (lost capacity, never corrupted KV, allocators still alike) rather than free them.
            logger.error("room %s: a receiver release failed; its %d reserved slots stay held", record.room,
                         landing.num_tokens)
            return
        self._free_slots(landing.slots)
        self._let_go(landing)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the release thread once the releases queued before are done (it holds the
        receiver: a runtime closed without this kept one thread and its receiver alive)."""
        self._to_receiver.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _release_rooms_in_receiver(self) -> None:
        while True:
            item = self._to_receiver.get()
            if item is None:
                return
            room, record = item
            try:
                self.receiver.release_room(room, timeout=60.0)
                ok = True
            except Exception:  # noqa: BLE001 — bookkeeping only; keep the thread alive
                logger.exception("room %s: receiver release failed", room)
                ok = False
            if record is not None:
                record.outcome = ok
                self._on_outcome()
