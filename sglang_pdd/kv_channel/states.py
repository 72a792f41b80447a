"""Per-room state of a KV transfer, numbered exactly like SGLang's ``KVPoll``.

An SGLang transfer backend maps ``RoomState`` to ``KVPoll`` with ``KVPoll(int(state))``:
Failed=0, Bootstrapping=1, WaitingForInput=2, Transferring=3, Success=4.

Sender side (send_room.py, its state machine):
               BOOTSTRAPPING (streams not connected yet) -> WAITING_FOR_INPUT (ready,
               no chunk queued yet) -> TRANSFERRING (chunks queued / END sent, no ACK yet)
               -> SUCCESS (receiver verified every chunk) | FAILED.
Receiver side (recv_room.py, its state machine): WAITING_FOR_INPUT (room registered,
               nothing arrived) -> TRANSFERRING
               (BEGIN or a chunk arrived) -> SUCCESS (all chunks verified) | FAILED.
FAILED always comes with a reason (a ``FailureReason`` value) and a detail string.
"""

import enum
from typing import Optional


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


class RoomQueries:
    """Per-room state queries shared by the sender and the receiver.

    Both keep ``self._rooms`` (room id -> entry with ``state``, ``reason``, ``detail`` and a
    ``done`` event set on a terminal state) guarded by the condition ``self._cv``.
    """

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
