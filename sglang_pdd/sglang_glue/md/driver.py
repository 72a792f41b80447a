"""MD's room commands and the scheduler iteration that applies them on every TP rank in lockstep.

Control threads (rank 0's) put commands on a ``CommandQueue`` and wait; a command is the
protocol's request itself (``MdCommand``: RegisterRequest, ReleaseRequest, KvSendersRequest),
answered with its reply type. The scheduler thread,
the only one that touches the radix tree and the allocator, runs ``LockstepDriver.iterate``
once per SGLang scheduler iteration: rank 0 drains the commands and reads the clock, every
rank applies them in the same order, then the ranks vote (lockstep.py) on registrations,
on rooms whose KV is landing and on pages waiting to go back, and act on the group's decision.
"""

from __future__ import annotations

import logging
import queue
import time
from concurrent.futures import Future
from typing import Callable, Optional, Union

from sglang_pdd.protocol import KvSendersRequest, RegisterRequest, ReleaseRequest
from sglang_pdd.sglang_glue.md.lockstep import RegistrationVote, ReleaseVote, RoomVote, agree
from sglang_pdd.sglang_glue.md.rooms import RankRooms
from sglang_pdd.sglang_glue.md.tp_sync import TpSync

logger = logging.getLogger(__name__)


# What a control thread asks of every rank's rooms (rank 0 shares them with the others:
# frozen dataclasses, pickled as they are).
MdCommand = Union[RegisterRequest, ReleaseRequest, KvSendersRequest]


class CommandQueue:
    def __init__(self, maxsize: int = 1024, on_submit: Optional[Callable[[], None]] = None):
        self._queue: "queue.Queue[tuple[MdCommand, Future]]" = queue.Queue(maxsize=maxsize)
        self._on_submit = on_submit  # wakes a scheduler sleeping on idle (idle_wake.py)

    def submit(self, command: MdCommand, timeout: float = 30.0) -> Future:
        """Queue ``command`` for the scheduler thread; queue.Full if it does not take it in time."""
        fut: Future = Future()
        self._queue.put((command, fut), timeout=timeout)
        if self._on_submit is not None:
            self._on_submit()
        return fut

    def call(self, command: MdCommand, timeout: float = 30.0):
        """Control threads: run ``command`` on the scheduler thread and wait for its reply."""
        return self.submit(command, timeout=timeout).result(timeout=timeout)

    def take(self) -> tuple[list[MdCommand], list[Future]]:
        """Scheduler thread: every command queued so far, and the futures that await them."""
        commands, futures = [], []
        while True:
            try:
                command, fut = self._queue.get_nowait()
            except queue.Empty:
                return commands, futures
            commands.append(command)
            futures.append(fut)


class LockstepDriver:
    def __init__(self, tp: TpSync, rooms: RankRooms, commands: CommandQueue):
        self.tp, self.rooms, self.commands = tp, rooms, commands

    def iterate(self) -> bool:
        """One scheduler iteration, on every TP rank in lockstep. A room completes, fails and
        gives its pages back only as every rank's receiver agrees (one all-min). The collectives
        run on every rank every iteration, whatever fails in between: a rank that skipped one
        would hang the group. Returns whether anything changed (a command, a decision, an
        expiry): SGLang's own checks (a deferred flush) see it in the next iteration."""
        commands, futures = self.commands.take() if self.tp.rank == 0 else ([], [])
        now, commands = self.tp.share(time.monotonic(), commands)
        results = [self._apply(command, now) for command in commands]
        try:
            # the same on every rank: the commands are rank 0's
            if any(isinstance(command, RegisterRequest) for command in commands):
                self._agree_on_registrations(commands, results)
            decided = self._agree_on_rooms_and_releases(now)
            expired = self.rooms.table.expire(now)  # rank 0's clock: the same rooms everywhere
            for entry in expired:
                self._guarded("expiry", entry.room, lambda room=entry.room: self.rooms.expired(room))
        finally:
            for fut, (ok, value) in zip(futures, results):
                fut.set_result(value) if ok else fut.set_exception(value)
        return bool(commands) or decided or bool(expired)

    def _apply(self, command: MdCommand, now: float) -> tuple[bool, object]:
        try:
            if isinstance(command, RegisterRequest):
                return True, self.rooms.register(command, now=now)
            if isinstance(command, ReleaseRequest):
                return True, self.rooms.release(command)
            if isinstance(command, KvSendersRequest):  # every rank's receiver learns the router's P hosts
                return True, self.rooms.announce_kv_senders(command)
            raise TypeError(f"unknown MD room command {type(command).__name__}")
        except Exception as e:  # the caller gets the error; the scheduler goes on
            return False, e

    def _agree_on_registrations(self, commands: list, results: list) -> None:
        """A registration stands only if every rank made it (a rank's receiver may refuse a
        room id it is still letting go of); otherwise it is undone everywhere, and the pages
        any rank reserved for it come back on all ranks together."""
        regs = [i for i, command in enumerate(commands) if isinstance(command, RegisterRequest)]
        votes = [RegistrationVote(made=results[i][0]) for i in regs]
        for i, mine, agreed in zip(regs, votes, agree(self.tp, votes)):
            if agreed.made:
                continue
            room = commands[i].room
            if mine.made:  # made here, refused on another rank: undo it here
                results[i] = (False, self.rooms.undo_registration(room))
            else:
                self.rooms.drop_refused(room)

    def _agree_on_rooms_and_releases(self, now: float) -> bool:
        """Whether the group decided anything (a room completed or failed, pages let go)."""
        pending = self.rooms.table.pending()  # the same rooms, in the same order, on every rank
        releasing = list(self.rooms.pages.releasing)
        states = [self.rooms.poll(entry.room) for entry in pending]
        room_votes = [RoomVote.of(state) for state in states]
        release_votes = [ReleaseVote.of(record.outcome) for record in releasing]
        agreed = agree(self.tp, [*room_votes, *release_votes])
        if not agreed:
            return False
        decided = False
        rooms_agreed, releases_agreed = agreed[:len(room_votes)], agreed[len(room_votes):]
        for record, vote in zip(releasing, releases_agreed):  # pages first: a staged completion may need them
            if vote.let_go:
                decided = True
                self._guarded("page release", record.room,
                              lambda r=record, ok=vote.ok: self.rooms.pages.free_agreed(r, ok))
        for entry, state, vote in zip(pending, states, rooms_agreed):
            if vote.landed:
                decided = True
                self._guarded("completion", entry.room, lambda room=entry.room: self.rooms.completed(room, now))
            elif not vote.alive:
                decided = True
                self._guarded("failure", entry.room, lambda room=entry.room, st=state: self.rooms.failed(room, st))
        return decided

    def _guarded(self, what: str, room: int, fn) -> None:
        """A decision every rank takes: an error is logged, never raised past the collectives."""
        try:
            fn()
        except Exception:  # noqa: BLE001
            logger.exception("room %s: %s failed on MD TP rank %d", room, what, self.tp.rank)
