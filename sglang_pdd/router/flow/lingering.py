"""Work a request leaves behind when it ends: tasks that outlive their flow.

A relayed request can finish on RLD before MD has answered its registration. The client's
reply must not wait for MD, yet MD's room still has to be registered, P told where the KV
goes and the room released with keep, or MD's cache misses the session's next turn. The
flow hands that work to the router's one ``Lingering``, which holds the tasks (asyncio keeps
only weak references to tasks) and, when the router closes, gives them a bounded time to
land before the client session goes.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Coroutine

logger = logging.getLogger("sglang_pdd.router")


class Lingering:
    """The router's tasks that outlive the request that started them; ``counters``: how the
    work after the end went (``MdSide`` counts it)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()
        self.counters: Counter = Counter()

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:  # a bug: say so, the router goes on
            logger.error("a task left by an ended request failed", exc_info=task.exception())

    def __len__(self) -> int:
        return len(self._tasks)

    async def settle(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for the tasks (and those they start), then cancel the rest;
        how many were cancelled."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._tasks and loop.time() < deadline:
            await asyncio.wait(list(self._tasks), timeout=deadline - loop.time())
        left = list(self._tasks)
        for task in left:
            task.cancel()
        if left:
            await asyncio.wait(left, timeout=1.0)
        return len(left)
