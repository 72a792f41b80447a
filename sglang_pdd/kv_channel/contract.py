"""The WAN KV channel's contract: what a sender and a receiver provide, their rooms' poll states,
failure and abort (in the spirit of SGLang's disaggregation/base/conn.py). The glue
(sglang_glue/p/wan_fanout.py on P, sglang_glue/md/ on MD) speaks to the channel through these
types; wan_sender.py and wan_receiver.py are their one implementation.

A room is one request's KV on its way, named by an integer both ends agree on.

Sender (P, ``KvSender``; one per receiver it feeds):
    begin_transfer(room, layout, ...) -> KvTransfer   the room opens (lazily connecting)
    KvTransfer.send_chunk / send_layer / send_kv      queue KV (blocks only on the window)
    KvTransfer.finish()                               all queued: the room waits for its ACK
    abort(room, reason) / release(room)               give the room up / forget it
Receiver (MD, ``KvReceiver``; one per MD TP rank):
    register_room(room, layout, num_tokens, dest)     expect the room; its KV lands in ``dest``
    bytes_received(room)                              progress
    abort(room, reason) / release_room(room)          give it up / forget it once no write runs
Both (``RoomEndpoint``): poll(room) -> RoomState, failure(room) -> (reason, detail),
wait(room, timeout), stats(), close().

Poll states, numbered exactly like SGLang's ``KVPoll`` (a transfer backend maps them with
``KVPoll(int(state))``: Failed=0, Bootstrapping=1, WaitingForInput=2, Transferring=3, Success=4):

Sender side (send_room.py, its state machine):
               BOOTSTRAPPING (streams not connected yet) -> WAITING_FOR_INPUT (ready,
               no chunk queued yet) -> TRANSFERRING (chunks queued / END sent, no ACK yet)
               -> SUCCESS (receiver verified every chunk) | FAILED.
Receiver side (recv_room.py, its state machine): WAITING_FOR_INPUT (room registered,
               nothing arrived) -> TRANSFERRING
               (BEGIN or a chunk arrived) -> SUCCESS (all chunks verified) | FAILED.
FAILED always comes with a reason (a ``FailureReason`` value) and a detail string; an abort is
FAILED with ``aborted``, and the peer is told.
"""

import enum
import threading
import time
from abc import ABC, abstractmethod
from typing import Any, Callable, Optional


class RoomState(enum.IntEnum):
    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4

    @property
    def is_terminal(self) -> bool:
        return self in (RoomState.FAILED, RoomState.SUCCESS)


class FailureReason:
    """Machine-readable failure reasons (strings, so they travel in NACK frames)."""

    CHECKSUM = "checksum"  # a chunk's CRC did not match its payload
    TIMEOUT = "timeout"  # the per-transfer deadline passed
    IDLE_TIMEOUT = "idle_timeout"  # no progress for idle_timeout seconds (stall, partition)
    CONNECTION_LOST = "connection_lost"  # a stream carrying the room broke (reset, crash)
    PEER_RESTARTED = "peer_restarted"  # the same peer came back with a new session
    CONNECT_FAILED = "connect_failed"  # could not connect / handshake
    AUTH = "auth"  # the peer failed authentication
    UNKNOWN_ROOM = "unknown_room"  # the receiver has no such room registered
    LAYOUT_MISMATCH = "layout_mismatch"  # BEGIN/CHUNK disagree with the registered room
    PROTOCOL = "protocol"  # malformed frame on a stream carrying the room
    INTEGRITY = "integrity"  # a frame's MAC failed: altered, replayed or forged on the way
    ABORTED = "aborted"  # the peer or the local owner aborted the room
    CLOSED = "closed"  # the local endpoint was closed


class RoomEntry:
    """One room as an endpoint keeps it: ``status`` is its machine's state record (send_room's
    or recv_room's), and what RoomEndpoint's queries read comes from it."""

    status: Any

    @property
    def state(self) -> RoomState:
        return self.status.state

    @property
    def reason(self) -> str:
        return self.status.reason

    @property
    def detail(self) -> str:
        return self.status.detail


class RoomEndpoint(ABC):
    """What a sender and a receiver share: their rooms under one lock, the machine that alone
    changes a room's state, the watchdog that fails rooms past their deadline or idle, and the
    per-room queries.

    ``self._rooms`` maps a room id to its ``RoomEntry``, with a ``done`` event set on a
    terminal state, guarded by the condition ``self._cv``. More
    conditions of the same lock come from ``_condition()``, so the notifications of the
    per-chunk path wake only their own waiters.
    """

    def __init__(self, name: str, idle_timeout: float, machine: Any, watchdog_name: str):
        self.name = name
        self.idle_timeout = idle_timeout
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)  # room states and what waits on them
        self._tick = threading.Condition(self._lock)  # the watchdog's sleep, cut short by close()
        self._rooms: dict = {}
        self._machine = machine  # with the lock held: the only way a room's state changes
        self._closed = False
        self._watchdog = threading.Thread(target=self._watch, name=watchdog_name, daemon=True)

    def _condition(self) -> threading.Condition:
        return threading.Condition(self._lock)

    def _watch(self) -> None:
        while True:
            with self._cv:
                if self._closed:
                    return
                self._check_rooms(time.monotonic())
                self._tick.wait(min(0.1, self.idle_timeout / 4))

    @abstractmethod
    def _check_rooms(self, now: float) -> None:
        """The watchdog's round, lock held: fail what is past its deadline or idle too long."""

    def _mark_closed(self) -> bool:
        """Lock held: True the first time only; wakes every waiter and the watchdog."""
        if self._closed:
            return False
        self._closed = True
        self._cv.notify_all()
        self._tick.notify_all()
        return True

    @staticmethod
    def _join(threads, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))

    # ---- the per-room queries

    def poll(self, room: int) -> RoomState:
        with self._cv:
            entry = self._rooms.get(room)
            if entry is None:
                raise KeyError(f"unknown room {room}")
            return entry.state

    def failure(self, room: int) -> tuple[str, str]:
        """(reason, detail) of a FAILED room; ("", "") otherwise."""
        with self._cv:
            entry = self._rooms[room]
            return entry.reason, entry.detail

    def failure_reason(self, room: int) -> str:
        return self.failure(room)[0]

    def wait(self, room: int, timeout: Optional[float] = None) -> RoomState:
        with self._cv:
            entry = self._rooms[room]
        entry.done.wait(timeout)
        return entry.state

    @abstractmethod
    def abort(self, room: int, reason: str = FailureReason.ABORTED) -> None:
        """Fail the room (``aborted``, the detail saying why) and tell the peer."""

    @abstractmethod
    def stats(self) -> dict:
        """Counters and each room's state, for /pdd/stats."""

    @abstractmethod
    def close(self, timeout: float = 5.0) -> None:
        """Fail unfinished rooms (``closed``), close every socket, join every thread."""


class KvTransfer(ABC):
    """One room on the sender: feed its chunks, then ``finish()``; poll until SUCCESS or FAILED."""

    room: int

    @abstractmethod
    def send_chunk(self, index: int, payload) -> bool:
        """Queue chunk ``index`` of the room's plan; False once the room failed (stop feeding)."""

    @abstractmethod
    def send_layer(self, layer: int, data) -> bool:
        """Queue one layer's pages of the plan, contiguous."""

    @abstractmethod
    def finish(self) -> None:
        """Every chunk is queued: SUCCESS comes with the receiver's ACK."""

    @abstractmethod
    def poll(self) -> RoomState: ...

    @property
    @abstractmethod
    def failure_reason(self) -> str: ...

    @property
    @abstractmethod
    def failure_detail(self) -> str: ...

    @abstractmethod
    def wait(self, timeout: Optional[float] = None) -> RoomState: ...


class KvSender(RoomEndpoint):
    """Sends the KV of many rooms to one receiver."""

    @abstractmethod
    def connect(self, timeout: Optional[float] = None) -> bool:
        """Open the session now (``begin_transfer`` does it lazily); True if up."""

    @abstractmethod
    def begin_transfer(self, room: int, layout, num_tokens: int, **how) -> KvTransfer:
        """Open ``room`` (its pages from the receiver's prefix on) and return its handle."""

    @abstractmethod
    def release(self, room: int) -> None:
        """Forget a room, aborting it if unfinished."""

    def keep_only(self, room: int) -> bool:
        """Nobody waits for ``room``'s KV any more (MD keeps it for its cache): send it behind
        the rooms someone waits for. True if it was sending that room; a sender without an
        order of its own ignores it (False)."""
        return False


# Where a receiver writes a chunk that lands: (first layer, layers, first page, pages, bytes[, row=(offset,
# width)]: a P rank's slice of each token row when P's TP differs from MD's).
WriteFn = Callable[..., None]


class KvReceiver(RoomEndpoint):
    """Accepts authenticated senders and writes the KV of the rooms registered with it."""

    address: tuple[str, int]

    @abstractmethod
    def register_room(self, room: int, layout, num_tokens: int, dest, **expect) -> None:
        """Expect KV for ``room``: it lands in ``dest`` (a buffer, or a ``WriteFn``)."""

    @abstractmethod
    def bytes_received(self, room: int) -> int:
        """KV bytes of ``room`` written so far."""

    @abstractmethod
    def release_room(self, room: int, timeout: float = 2.0) -> None:
        """Forget a room; returns once no thread writes into its destination."""

    @abstractmethod
    def announce_senders(self, networks) -> int:
        """The hosts that send this receiver KV: known peers from now on."""
