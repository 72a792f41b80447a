"""Let MD's scheduler sleep when idle, and wake it when a room needs it.

SGLang's ``--sleep-on-idle`` parks an idle scheduler in a zmq poll of its tokenizer and RPC
sockets (up to a second at a time) instead of spinning a core. MD's room work does not come
through those sockets: the router's registrations and releases arrive on MD's control threads
(driver.CommandQueue) and KV lands from the WAN receiver's threads, both taken up in
scheduler iterations. So MD ran without the flag, and one core stayed busy on an idle MD: on a
small machine that core is taken from P and RLD (measured: PDD's first tokens 32 ms p50 with
MD stopped, 305-375 ms with MD idle beside P and RLD on 2 cores).

``IdleWake`` adds one pipe to the sleeper's poller: a control thread that queues a command
writes a byte, and the scheduler wakes at once; so does the WAN receiver when a room's KV has
all landed (or failed), and the page-release thread when a room's pages may go back. Only
while such a decision waits for the next iteration does the iteration wake itself
(``keep_awake``; rooms.RankRooms.needs_iteration): KV still crossing the WAN keeps no core
busy, which on a slow link is seconds per room, taken from P and RLD on a shared machine.
Without SGLang's sleeper (no flag, a TP rank other than 0, a test double) every call is a
no-op.
"""

from __future__ import annotations

import os

import zmq


class IdleWake:
    def __init__(self, scheduler):
        sleeper = getattr(scheduler, "idle_sleeper", None)
        poller = getattr(sleeper, "poller", None)
        self._read_fd = self._write_fd = self._poller = None
        if isinstance(poller, zmq.Poller):
            self._read_fd, self._write_fd = os.pipe()
            os.set_blocking(self._read_fd, False)
            os.set_blocking(self._write_fd, False)
            poller.register(self._read_fd, zmq.POLLIN)
            self._poller = poller

    @property
    def active(self) -> bool:
        return self._write_fd is not None

    def wake(self) -> None:
        """Any thread: the scheduler's next (or current) idle poll returns at once."""
        if self._write_fd is None:
            return
        try:
            os.write(self._write_fd, b"w")
        except BlockingIOError:  # the pipe is full: a wake-up is pending already
            pass

    def drain(self) -> None:
        """Scheduler thread, each iteration: the wake-ups so far are taken (else every poll
        would return at once and the scheduler would spin)."""
        if self._read_fd is None:
            return
        try:
            while os.read(self._read_fd, 4096):
                pass
        except BlockingIOError:
            pass

    def keep_awake(self, busy: bool) -> None:
        """Scheduler thread, end of an iteration: while ``busy`` (rooms landing, pages waiting
        to go back) the next idle poll returns at once."""
        if busy:
            self.wake()

    def close(self) -> None:
        if self._poller is not None:
            self._poller.unregister(self._read_fd)
        for fd in (self._read_fd, self._write_fd):
            if fd is not None:
                os.close(fd)
        self._read_fd = self._write_fd = self._poller = None
