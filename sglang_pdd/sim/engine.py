"""A minimal discrete-event loop: a heap of (time, seq, callback, arg)."""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Callable

_heappush, _heappop = heapq.heappush, heapq.heappop  # hot: one push and one pop per event


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list = []
        self._seq = itertools.count()  # FIFO among equal times -> deterministic runs
        self.events_run = 0

    def at(self, t: float, fn: Callable[[float, Any], None], arg: Any = None) -> None:
        if t < self.now:
            t = self.now
        _heappush(self._heap, (t, next(self._seq), fn, arg))

    def after(self, dt: float, fn: Callable[[float, Any], None], arg: Any = None) -> None:
        t = self.now + dt
        if dt < 0:
            t = self.now
        _heappush(self._heap, (t, next(self._seq), fn, arg))

    def pending(self) -> int:
        return len(self._heap)

    def next_time(self) -> float:
        """When the earliest pending event runs (inf: none)."""
        return self._heap[0][0] if self._heap else float("inf")

    def run_until(self, t_stop: float = float("inf")) -> None:
        heap = self._heap
        n = 0
        try:
            while heap and heap[0][0] <= t_stop:
                t, _, fn, arg = _heappop(heap)
                self.now = t
                n += 1
                fn(t, arg)
        finally:
            self.events_run += n
