"""Receiving side of the WAN KV channel (main decode, datacenter B).

A listening socket, an accept thread, one reader thread per authenticated stream, and a
watchdog. The owner (MD's scheduler, later the SGLang backend) *registers* each room it
expects, with its layout and a destination; chunks for any other room are refused.

Destination of a room, either:
  * a writable buffer (numpy array, bytearray, ...) of
    ``num_layers * total_pages * bytes_per_page`` bytes laid out [layer][page][byte]:
    payloads are ``recv_into``'d straight into it (no copy), or
  * a callable ``write(layer_start, layer_count, page_start, page_count, payload)``,
    called after the chunk's MAC tag is verified; ``payload`` is a memoryview that is
    only valid during the call (an SGLang backend scatters it into its KV pool pages).
Pages below ``decode_prefix_len // page_size`` are never written.

What is checked, and what happens (the connection survives unless the framing is lost):
  * authentication (handshake.py)            -> refused + logged, socket closed
  * malformed / oversized frame              -> ERROR(protocol) to the peer, stream closed,
                                                the session's unfinished rooms FAILED(protocol)
  * a frame whose MAC fails (altered on the  -> ERROR(integrity), stream closed, the session's
    way, replayed, reordered, injected)         unfinished rooms FAILED(integrity); never SUCCESS
  * chunk or BEGIN for an unregistered room  -> NACK(unknown_room), payload discarded
  * BEGIN / chunk not matching the room      -> room FAILED(layout_mismatch), NACK
  * duplicate or overlapping chunk           -> ERROR(duplicate), payload discarded, not written
  * stream of the room's session drops       -> room FAILED(connection_lost)
  * no bytes for ``idle_timeout`` mid-transfer -> room FAILED(idle_timeout)
  * the same peer name reconnects with a new session (restart) -> the old session's
    unfinished rooms FAILED(peer_restarted), its sockets closed.
A room is SUCCESS when BEGIN and END arrived and every (layer, page) of the announced
range was written exactly once with a verified tag; then the sender gets an ACK.

Row slices (P with TP > 1, each rank holding some KV heads): a room may come from several
senders, each moving bytes [offset, offset + width) of every token row (one *part* per slice,
each bound to its sender's session). Slices must not overlap, their BEGINs must agree on how
many there are, and the room is SUCCESS only when every part is complete and the slices tile
the whole row; each sender gets the ACK of its part. The destination callable then receives
``row=(offset, width)``; a destination buffer is written strided.

Chunks may arrive before BEGIN (they were striped over other streams); they are checked
against the registration, which is enough to write them safely.
"""

from __future__ import annotations

import collections
import logging
import socket
import ssl
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import numpy as np

from sglang_pdd.machine import Driver

from . import recv_room
from .acceptor import Acceptor, AdmissionLimits, Slot
from .handshake import HandshakeError, check_key, server_handshake
from .layout import MAX_ROW_SLICES, KvLayout, KvLayoutMismatch, num_pages, token_digest, window_first_page
from .contract import FailureReason, KvReceiver, RoomEntry, RoomState, WriteFn
from .wan_sender import SOCKET_BUFFER_BYTES, tune_socket
from .wire import (
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_PAYLOAD_BYTES,
    Abort,
    Ack,
    Chunk,
    ConnectionClosed,
    Error,
    FrameReader,
    FrameMac,
    Hello,
    IntegrityError,
    Nack,
    ProtocolError,
    TransferBegin,
    TransferEnd,
    send_frame,
)

logger = logging.getLogger(__name__)

_DATA_ARRIVED, _ALL_VERIFIED = recv_room.DataArrived(), recv_room.AllVerified()
MAX_QUEUED_REPLIES = 4096  # per stream; more means the peer is not reading them


@dataclass
class _Part:
    """What one sender moves of a room: all of every token row, or (P with TP > 1) the bytes
    ``[offset, offset + width)`` of it. Its frames come from one sender session."""

    index: int
    session: "_ReceiverSession"
    covered: np.ndarray  # [layers, pages] bool: written (or being written) once
    offset: Optional[int] = None  # known from the part's first chunk or BEGIN
    width: int = 0  # 0: the whole row
    begin: Optional[TransferBegin] = None
    end: Optional[TransferEnd] = None
    indices: set = field(default_factory=set)
    bytes_received: int = 0

    def page_bytes(self, layout: KvLayout) -> int:
        return layout.bytes_per_page if self.width == 0 else layout.page_size * self.width

    def window_first_page(self, layout: KvLayout) -> int:
        """First page the window buffers send (the announced first page without a window)."""
        b = self.begin
        if not layout.window_buffers or b.first_page == b.end_page:
            return b.first_page
        return window_first_page(b.num_tokens, b.first_page * layout.page_size, layout.window, layout.page_size)

    def expected_bytes(self, layout: KvLayout) -> int:
        b, full = self.begin, layout.num_layers - layout.window_buffers
        pages = full * (b.end_page - b.first_page) + layout.window_buffers * (b.end_page - self.window_first_page(layout))
        return pages * self.page_bytes(layout)

    def all_covered(self, layout: KvLayout) -> bool:
        b, full = self.begin, layout.num_layers - layout.window_buffers
        return bool(self.covered[:full, b.first_page:b.end_page].all()
                    and self.covered[full:, self.window_first_page(layout):b.end_page].all())


@dataclass
class _ReceiverRoom(RoomEntry):
    room: int
    layout: KvLayout
    num_tokens: int
    total_pages: int
    decode_prefix_len: Optional[int]
    dest_view: Optional[memoryview]
    dest_write: Optional[WriteFn]
    expected_digest: bytes
    deadline: Optional[float]
    status: recv_room.RecvState = recv_room.RecvState()  # changed only by the receiver's _machine (recv_room.py)
    parts: dict = field(default_factory=dict)  # slice index -> _Part
    slice_count: Optional[int] = None  # from the first BEGIN; all must agree
    writers: int = 0  # reader threads currently writing into the destination
    last_progress: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    # Why the room failed, when no sender had a frame in it to be told: the first frame that
    # comes gets it (else a sender whose frames were still queued waits out its idle timeout).
    untold: Optional[Nack] = None

    @property
    def sessions(self) -> set:
        return {p.session for p in self.parts.values()}


def _row_range(offset: int, width: int) -> str:
    return "(the whole row)" if width == 0 else f"[{offset}, {offset + width})"


class _ReceiverConn:
    def __init__(self, sock: socket.socket, addr):
        self.sock = sock
        self.addr = addr
        self.send_lock = threading.Lock()
        self.session: Optional[_ReceiverSession] = None
        self.peer = f"{addr[0]}:{addr[1]}"
        self.mac: Optional[FrameMac] = None  # from the handshake: tags every later frame (None if TLS-bound)

        # Replies decided under the receiver's lock wait here; they are sent without it
        # (flush), so a peer that stops reading stalls only its own threads.
        self.outbox: collections.deque = collections.deque()

    def send(self, msg) -> None:
        """Send now. Never call with the receiver's lock held."""
        try:
            with self.send_lock:
                send_frame(self.sock, msg, mac=self.mac)
        except OSError:
            self.shutdown()  # the reader of this connection will notice and clean up

    def flush(self) -> None:
        """Send what was posted, in order. Never call with the receiver's lock held."""
        try:
            with self.send_lock:
                while self.outbox:
                    send_frame(self.sock, self.outbox.popleft(), mac=self.mac)
        except OSError:
            self.outbox.clear()
            self.shutdown()

    def shutdown(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class _ReceiverSession:
    def __init__(self, session_id: bytes, peer_name: str):
        self.id = session_id
        self.tag = session_id.hex()[:8]
        self.peer_name = peer_name
        self.conns: set[_ReceiverConn] = set()
        self.dead = False


class WanKvReceiver(KvReceiver):
    """Accepts authenticated senders and writes the KV of registered rooms."""

    def __init__(
        self,
        auth_key: bytes,
        name: str = "decode",
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        idle_timeout: float = 10.0,
        handshake_timeout: float = 5.0,
        max_connections: int = 256,
        socket_buffer_bytes: int = SOCKET_BUFFER_BYTES,
        ssl_context: Optional[ssl.SSLContext] = None,
        admission: AdmissionLimits = AdmissionLimits(),
        on_settled: Optional[Callable[[int], None]] = None,
    ):
        self.key = check_key(auth_key)
        # One lock (contract.RoomEndpoint); the flusher and the watchdog wait on conditions of
        # their own, so the notifications of the per-chunk path do not wake them.
        super().__init__(name, idle_timeout,
                         Driver(recv_room.transition, {recv_room.WakeReceiveWaiters: self._wake_waiters,
                                                       recv_room.NackSenders: self._nack_senders}, state="status"),
                         watchdog_name=f"kv-recv-watchdog-{name}")
        # Called (lock held: must not block) when a room reaches SUCCESS or FAILED, so an owner
        # that polls rooms from a loop may sleep until then instead of polling all along.
        self._on_settled = on_settled
        self.max_header_bytes = max_header_bytes
        self.max_payload_bytes = max_payload_bytes
        self.handshake_timeout = handshake_timeout
        self.max_connections = max_connections
        self.socket_buffer_bytes = socket_buffer_bytes
        self.ssl_context = ssl_context

        # ``_cv`` also carries writers leaving a destination.
        self._flush_cv = self._condition()  # the flusher: replies were posted
        self._rooms: dict[int, _ReceiverRoom]
        self._sessions: dict[bytes, _ReceiverSession] = {}
        self._conns: set[_ReceiverConn] = set()
        # Rooms whose late frames are dropped (logged once each); the value, if any, is the NACK
        # their sender has not heard yet (_ReceiverRoom.untold), sent to the first frame.
        self._rejected_rooms: collections.OrderedDict[int, Optional[Nack]] = collections.OrderedDict()
        self.counters = collections.Counter()

        listener = socket.create_server((host, port), backlog=128)
        self.address: tuple[str, int] = listener.getsockname()[:2]
        self._to_flush: set[_ReceiverConn] = set()  # connections with posted replies (guarded by _cv)
        self._flusher = threading.Thread(target=self._flush_loop, name=f"kv-recv-replies-{name}", daemon=True)
        self._watchdog.start()
        self._flusher.start()
        self._acceptor = Acceptor(listener, self._serve, name=f"recv-{name}", max_connections=max_connections,
                                  admission=admission, handshake_deadline=handshake_timeout)
        logger.info("WAN KV receiver %r listening on %s:%s", name, *self.address)

    # ------------------------------------------------------------------ owner API

    def register_room(
        self,
        room: int,
        layout: KvLayout,
        num_tokens: int,
        dest: Union[WriteFn, object],
        *,
        decode_prefix_len: Optional[int] = None,
        token_ids=None,
        timeout: Optional[float] = None,
    ) -> None:
        """Expect KV for ``room``. ``decode_prefix_len`` (if given) must equal the sender's;
        ``token_ids`` (if given) must match the sender's digest; ``timeout`` is a deadline."""
        total = num_pages(num_tokens, layout.page_size)
        dest_view, dest_write = None, None
        if callable(dest):
            dest_write = dest
        else:
            dest_view = memoryview(dest).cast("B")
            if dest_view.readonly:
                raise ValueError(f"room {room}: destination buffer is read-only")
            need = layout.num_layers * total * layout.bytes_per_page
            if dest_view.nbytes != need:
                raise ValueError(f"room {room}: destination is {dest_view.nbytes} bytes, expected {need}")
        if decode_prefix_len is not None and (decode_prefix_len % layout.page_size or decode_prefix_len > num_tokens):
            raise ValueError(f"room {room}: bad decode_prefix_len {decode_prefix_len}")
        entry = _ReceiverRoom(
            room, layout, num_tokens, total, decode_prefix_len, dest_view, dest_write,
            token_digest(token_ids), None if timeout is None else time.monotonic() + timeout,
        )
        with self._cv:
            old = self._rooms.get(room)
            if old is not None and not old.state.is_terminal:
                raise ValueError(f"room {room} is already registered")
            self._rooms[room] = entry
            self._rejected_rooms.pop(room, None)

    def bytes_received(self, room: int) -> int:
        """KV bytes of ``room`` written into its destination so far (all slices; 0 if unknown)."""
        with self._cv:
            entry = self._rooms.get(room)
            return sum(part.bytes_received for part in entry.parts.values()) if entry is not None else 0

    def abort(self, room: int, reason: str = "aborted by owner") -> None:
        with self._cv:
            entry = self._rooms.get(room)
            if entry is not None and not entry.state.is_terminal:
                self._fail_room(entry, FailureReason.ABORTED, reason, tell_peer=True)

    def release_room(self, room: int, timeout: float = 2.0) -> None:
        """Forget a room. Returns only when no thread is writing into its destination
        any more, so the owner may reuse that memory (a stuck write is cut off by
        closing its stream)."""
        with self._cv:
            entry = self._rooms.get(room)
            if entry is None:
                return
            if not entry.state.is_terminal:
                self._fail_room(entry, FailureReason.ABORTED, "released by owner", tell_peer=True)
            if not self._cv.wait_for(lambda: entry.writers == 0, timeout):
                for session in entry.sessions:
                    for conn in list(session.conns):
                        conn.shutdown()
                self._cv.wait_for(lambda: entry.writers == 0, timeout)
            if self._rooms.get(room) is entry:
                del self._rooms[room]
                # Its sender heard why (or ends on its own failure): frames still on their way
                # on other streams are dropped, not answered "unknown room", which could reach
                # the sender first and hide the reason. A sender not told yet (none of its frames had
                # come) is told at its first frame.
                self._mark_rejected(room, entry.untold)

    def _mark_rejected(self, room: int, untold: Optional[Nack] = None) -> bool:
        """Remember a room whose late frames are dropped without a reply (but for ``untold``,
        the first one's); False if it was."""
        if room in self._rejected_rooms:
            return False
        self._rejected_rooms[room] = untold
        if len(self._rejected_rooms) > 4096:
            self._rejected_rooms.popitem(last=False)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting, fail unfinished rooms (``closed``), close sockets, join threads."""
        with self._cv:
            if not self._mark_closed():
                return
            for entry in self._rooms.values():
                self._fail_room(entry, FailureReason.CLOSED, "receiver closed", tell_peer=False)
            for conn in self._conns:
                conn.shutdown()
            self._flush_cv.notify_all()
        deadline = time.monotonic() + timeout
        self._acceptor.close(timeout)
        self._join([self._watchdog, self._flusher], max(0.0, deadline - time.monotonic()))

    def announce_senders(self, networks) -> int:
        """The hosts that send this receiver KV, as an authenticated control call names them
        (the router's P hosts): known peers from now on, in place of the last ones, so a
        keyless flood cannot keep them out of the handshake slots (acceptor.py)."""
        return self._acceptor.announce(networks)

    def stats(self) -> dict:
        front = self._acceptor.stats()
        with self._cv:
            return {
                **self.counters,
                **{k: front[k] for k in ("refused", "refused_per_source", "refused_unknown", "handshake_timeouts",
                                         "thread_start_failures", "known_sources_announced")},
                "connections": len(self._conns),
                "sessions": len(self._sessions),
                "threads_alive": front["threads_alive"],
            }

    # ------------------------------------------------------------------ connection threads

    def _serve(self, slot: Slot) -> None:
        """One connection's thread (started by the acceptor, which bounds connections and
        the handshake's total time)."""
        conn = _ReceiverConn(slot.sock, slot.addr)
        with self._cv:
            if self._closed:
                return
            self._conns.add(conn)
        try:
            tune_socket(conn.sock, self.socket_buffer_bytes)
            conn.sock.settimeout(self.handshake_timeout)  # per recv; the acceptor bounds the total
            try:
                if self.ssl_context is not None:  # a TLS failure is an authentication failure too
                    conn.sock = slot.sock = self.ssl_context.wrap_socket(conn.sock, server_side=True)
                reader = FrameReader(conn.sock, self.max_header_bytes, self.max_payload_bytes)
                secure = server_handshake(conn.sock, self.key, self.name, reader)
                if not slot.authenticated():
                    raise HandshakeError(f"handshake took longer than {self.handshake_timeout}s")
            except (HandshakeError, ProtocolError, ConnectionClosed, OSError, ssl.SSLError) as e:
                with self._cv:
                    self.counters["auth_failures"] += 1
                logger.warning("refused peer %s: authentication failed: %s", conn.peer,
                               "handshake deadline passed" if slot.expired else e)
                return
            hello, conn.mac = secure.hello, secure.send_mac
            conn.sock.settimeout(None)
            # Replies are sent outside the receiver's lock; still, a peer that stops reading
            # must not hold this thread (or the reply flusher) long: sends give up after 2 s.
            conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 2, 0))
            self._join_session(conn, hello)
            logger.info("peer %r (%s) authenticated, session %s stream %d",
                        hello.peer_name, conn.peer, conn.session.tag, hello.stream_index)
            while True:
                msg, plen = reader.read_message()
                self._dispatch(conn, reader, msg, plen)
                if conn.outbox:
                    conn.flush()  # this frame's replies, from this thread, outside the lock
        except IntegrityError as e:
            with self._cv:
                self.counters["integrity_failures"] += 1
            logger.error("integrity failure on the stream from %s: %s; closing the stream", conn.peer, e)
            conn.send(Error(-1, FailureReason.INTEGRITY, str(e)))
            self._drop(conn, FailureReason.INTEGRITY, f"stream from {conn.peer}: {e}")
        except ProtocolError as e:
            with self._cv:
                self.counters["protocol_errors"] += 1
            logger.warning("protocol error from %s: %s; closing the stream", conn.peer, e)
            conn.send(Error(-1, FailureReason.PROTOCOL, str(e)))
            self._drop(conn, FailureReason.PROTOCOL, str(e))
        except (ConnectionClosed, OSError) as e:
            self._drop(conn, FailureReason.CONNECTION_LOST, f"stream from {conn.peer}: {e!r}")
        except Exception as e:  # a bug or a failing destination callable: never kill the server
            logger.exception("error serving %s", conn.peer)
            self._drop(conn, FailureReason.PROTOCOL, f"internal error: {e!r}")
        finally:
            self._drop(conn, FailureReason.CONNECTION_LOST, f"stream from {conn.peer} closed")
            conn.sock.close()

    def _join_session(self, conn: _ReceiverConn, hello: Hello) -> None:
        with self._cv:
            s = self._sessions.get(hello.session_id)
            if s is None:
                for old in list(self._sessions.values()):
                    if old.peer_name == hello.peer_name and not old.dead:
                        self._kill_session(old, FailureReason.PEER_RESTARTED,
                                           f"peer {hello.peer_name!r} reconnected with a new session")
                s = _ReceiverSession(hello.session_id, hello.peer_name)
                self._sessions[s.id] = s
            s.conns.add(conn)
            conn.session = s

    def _drop(self, conn: _ReceiverConn, reason: str, detail: str) -> None:
        """A stream ended: its session's unfinished rooms cannot complete (striping)."""
        with self._cv:
            self._conns.discard(conn)
            s = conn.session
            if s is None:
                return
            s.conns.discard(conn)
            if not s.dead:
                self._kill_session(s, reason, detail)
            if not s.conns and self._sessions.get(s.id) is s:
                del self._sessions[s.id]

    def _kill_session(self, s: _ReceiverSession, reason: str, detail: str) -> None:
        s.dead = True
        for entry in self._rooms.values():
            if s in entry.sessions and not entry.state.is_terminal:
                self._fail_room(entry, reason, detail, tell_peer=False)
        for conn in s.conns:
            conn.shutdown()

    # ------------------------------------------------------------------ frames

    def _dispatch(self, conn: _ReceiverConn, reader: FrameReader, msg, plen: int) -> None:
        if isinstance(msg, Chunk):
            self._on_chunk(conn, reader, msg, plen)
        elif isinstance(msg, TransferBegin):
            self._on_begin(conn, msg)
        elif isinstance(msg, TransferEnd):
            self._on_end(conn, msg)
        elif isinstance(msg, Abort):
            with self._cv:
                entry = self._rooms.get(msg.room)
                # An unbound room: its sender aborted before its BEGIN went out.
                if entry is not None and (not entry.parts or conn.session in entry.sessions):
                    self._fail_room(entry, FailureReason.ABORTED, f"sender aborted: {msg.reason}", tell_peer=False)
        elif isinstance(msg, Error):
            logger.warning("peer %s reports: room %s: %s: %s", conn.peer, msg.room, msg.reason, msg.detail)
        else:
            raise ProtocolError(f"unexpected {type(msg).__name__} after the handshake")

    def _room_for(self, conn: _ReceiverConn, room: int, what: str) -> Optional[_ReceiverRoom]:
        """The registered room, bound to this session; None (after replying) if refused."""
        entry = self._rooms.get(room)
        if entry is None:
            untold = self._rejected_rooms.get(room)
            if untold is not None:  # dropped before any of its frames came: the reason, once
                self._rejected_rooms[room] = None
                self._post(conn, untold)
                return None
            self.counters["unknown_room"] += 1
            if self._mark_rejected(room):  # log and NACK once per room, not per chunk
                logger.warning("room %s: %s from %s refused: room not registered", room, what, conn.peer)
                self._post(conn, Nack(room, FailureReason.UNKNOWN_ROOM,
                                      f"room {room} is not registered at {self.name!r}"))
            return None
        if entry.untold is not None:  # failed before any of its frames came: the reason, once
            untold, entry.untold = entry.untold, None
            self._post(conn, untold)
        return entry  # late frames of a finished room are dropped by the caller

    def _part_for(self, conn: _ReceiverConn, entry: _ReceiverRoom, index: int, what: str,
                  row: Optional[tuple[int, int]] = None) -> Optional[_Part]:
        """The room's part ``index`` (created by its first frame), bound to this session;
        ``row`` = (offset, width or 0 for the whole row) from the frame. None (after replying
        or failing the room) if refused."""
        room = entry.room
        part = entry.parts.get(index)
        if part is None:
            limit = entry.slice_count or MAX_ROW_SLICES
            if not 0 <= index < limit:
                self._fail_room(entry, FailureReason.LAYOUT_MISMATCH, f"{what}: row slice {index} outside [0, {limit})",
                                tell_peer=True, conn=conn)
                return None
            part = entry.parts[index] = _Part(index, conn.session,
                                              np.zeros((entry.layout.num_layers, entry.total_pages), dtype=bool))
        elif part.session is not conn.session:
            self.counters["wrong_session"] += 1
            logger.warning("room %s: %s from %s refused: room belongs to another session", room, what, conn.peer)
            self._post(conn, Error(room, "wrong_session", f"room {room} is being served by another sender session"))
            return None
        problem = self._set_row(entry, part, *row) if row is not None else ""
        if problem:
            self._fail_room(entry, FailureReason.LAYOUT_MISMATCH, f"{what}: {problem}", tell_peer=True, conn=conn)
            return None
        return part

    @staticmethod
    def _set_row(entry: _ReceiverRoom, part: _Part, offset: int, width: int) -> str:
        """Fix (first frame) or check the part's bytes of each token row; why not, or ""."""
        lay = entry.layout
        if width and offset == 0 and width * lay.page_size == lay.bytes_per_page:
            width = 0  # the whole row, said explicitly
        if part.offset is not None:
            if (part.offset, part.width) != (offset, width):
                return (f"slice {part.index}: row bytes {_row_range(offset, width)} differ from its earlier frames' "
                        f"{_row_range(part.offset, part.width)}")
            return ""
        if width == 0 and offset:
            return f"slice {part.index}: a whole row cannot start at byte {offset}"
        if width and (lay.bytes_per_page % lay.page_size or offset + width > lay.token_bytes):
            return (f"slice {part.index}: row bytes {_row_range(offset, width)} outside a {lay.token_bytes}-byte "
                    f"token row")
        for other in entry.parts.values():
            if other is part or other.offset is None:
                continue
            if width == 0 or other.width == 0 or (offset < other.offset + other.width and other.offset < offset + width):
                return (f"slice {part.index}'s row bytes {_row_range(offset, width)} overlap slice {other.index}'s "
                        f"{_row_range(other.offset, other.width)}")
        part.offset, part.width = offset, width
        return ""

    def _on_begin(self, conn: _ReceiverConn, msg: TransferBegin) -> None:
        with self._cv:
            entry = self._room_for(conn, msg.room, "BEGIN")
            if entry is None or entry.state.is_terminal:
                return
            part = self._part_for(conn, entry, msg.slice_index, "BEGIN", (msg.row_offset, msg.row_bytes))
            if part is None or entry.state.is_terminal:
                return
            if part.begin is not None:
                self.counters["duplicate"] += 1
                self._post(conn, Error(msg.room, "duplicate", "TRANSFER_BEGIN received twice"))
                return
            lay = entry.layout
            problems = []
            try:
                lay.check_same(KvLayout(msg.num_layers, msg.page_size, msg.bytes_per_page, msg.dtype, msg.kv_kind,
                                        msg.window_buffers, msg.window), "receiver (registered)", "sender")
            except (KvLayoutMismatch, ValueError) as e:
                problems.append(str(e))
            if msg.num_tokens != entry.num_tokens:
                problems.append(f"num_tokens {msg.num_tokens} != registered {entry.num_tokens}")
            if msg.end_page != entry.total_pages or not 0 <= msg.first_page <= msg.end_page:
                problems.append(f"page range [{msg.first_page}, {msg.end_page}) invalid for {entry.total_pages} pages")
            if entry.decode_prefix_len is not None and msg.first_page * lay.page_size != entry.decode_prefix_len:
                problems.append(f"first page {msg.first_page} != decode_prefix_len {entry.decode_prefix_len} / page_size")
            if entry.expected_digest and msg.token_digest != entry.expected_digest:
                problems.append("prompt token digest differs")
            window_first = (window_first_page(msg.num_tokens, msg.first_page * lay.page_size, lay.window, lay.page_size)
                            if lay.window_buffers and msg.first_page < msg.end_page else msg.first_page)
            if (any(i >= msg.num_chunks for i in part.indices) or part.covered[:, : msg.first_page].any()
                    or part.covered[lay.num_layers - lay.window_buffers:, :window_first].any()):
                problems.append("chunks already received lie outside the announced range")
            count = entry.slice_count or msg.slice_count
            if msg.slice_count != count or not 1 <= count <= MAX_ROW_SLICES or max(entry.parts) >= count:
                problems.append(f"slice count {msg.slice_count} (slice {msg.slice_index}) does not match the room's "
                                f"{count} / slices {sorted(entry.parts)}")
            others = [p.begin.first_page for p in entry.parts.values() if p.begin is not None]
            if others and others[0] != msg.first_page:
                problems.append(f"first page {msg.first_page} differs from another slice's {others[0]}")
            if problems:
                self._fail_room(entry, FailureReason.LAYOUT_MISMATCH, "; ".join(problems), tell_peer=True, conn=conn)
                return
            entry.slice_count = count
            part.begin = msg
            self._machine.step(entry, _DATA_ARRIVED)
            entry.last_progress = time.monotonic()
            self._check_complete(entry, conn)

    def _on_end(self, conn: _ReceiverConn, msg: TransferEnd) -> None:
        with self._cv:
            entry = self._room_for(conn, msg.room, "END")
            if entry is None or entry.state.is_terminal:
                return
            part = self._part_for(conn, entry, msg.slice_index, "END")
            if part is None or entry.state.is_terminal:
                return
            if part.end is not None:
                self.counters["duplicate"] += 1
                self._post(conn, Error(msg.room, "duplicate", "TRANSFER_END received twice"))
                return
            part.end = msg
            self._machine.step(entry, _DATA_ARRIVED)
            entry.last_progress = time.monotonic()
            self._check_complete(entry, conn)

    def _on_chunk(self, conn: _ReceiverConn, reader: FrameReader, msg: Chunk, plen: int) -> None:
        with self._cv:
            entry, part = self._accept_chunk(conn, msg, plen)
        if entry is None:
            reader.discard_payload()  # outside the lock: keeps the stream in sync, writes nothing
            return
        try:
            self._receive_payload(entry, part, reader, msg)
        except BaseException as e:
            with self._cv:
                if isinstance(e, IntegrityError):  # before any other stream can complete the room on altered bytes
                    self._fail_room(entry, FailureReason.INTEGRITY, f"chunk {msg.index}: {e}", tell_peer=False)
                entry.writers -= 1
                self._cv.notify_all()
            raise
        # One critical section: once this writer is no longer counted, its bytes are, else
        # another stream's completion check can see every writer gone and bytes missing.
        with self._cv:
            entry.writers -= 1
            self._cv.notify_all()
            if entry.state.is_terminal:
                return  # failed/aborted meanwhile
            part.bytes_received += plen
            entry.last_progress = time.monotonic()
            self._check_complete(entry, conn)

    def _accept_chunk(self, conn: _ReceiverConn, msg: Chunk, plen: int) -> tuple[Optional[_ReceiverRoom], Optional[_Part]]:
        """Decide (under the lock) whether a chunk's payload may be written; claim its pages."""
        what = f"chunk {msg.index}"
        entry = self._room_for(conn, msg.room, what)
        if entry is None or entry.state.is_terminal:
            return None, None
        part = self._part_for(conn, entry, msg.slice_index, what, (msg.row_offset, msg.row_bytes))
        if part is None or entry.state.is_terminal:
            return None, None
        problem = self._check_chunk(entry, part, msg, plen)
        if problem:
            self._fail_room(entry, FailureReason.LAYOUT_MISMATCH, f"{what}: {problem}", tell_peer=True, conn=conn)
            return None, None
        region = part.covered[msg.layer_start : msg.layer_start + msg.layer_count,
                              msg.page_start : msg.page_start + msg.page_count]
        if msg.index in part.indices or region.any():
            self.counters["duplicate"] += 1
            logger.warning("room %s: duplicate chunk %d from %s rejected", msg.room, msg.index, conn.peer)
            self._post(conn, Error(msg.room, "duplicate",
                                   f"chunk {msg.index} (or its pages) already received; ignored"))
            return None, None
        # Claim before reading so a copy racing on another stream is seen as a duplicate.
        part.indices.add(msg.index)
        region[:] = True
        entry.writers += 1
        self._machine.step(entry, _DATA_ARRIVED)
        return entry, part

    def _check_chunk(self, entry: _ReceiverRoom, part: _Part, msg: Chunk, plen: int) -> str:
        lay = entry.layout
        first = part.begin.first_page if part.begin else 0
        # Explicit lower bounds too, though the decoder refuses negatives: a slice with a
        # negative start would land in another layer of the destination.
        if msg.layer_start < 0 or msg.layer_count < 1 or msg.layer_start + msg.layer_count > lay.num_layers:
            return f"layers [{msg.layer_start}, +{msg.layer_count}) outside [0, {lay.num_layers})"
        if (msg.page_start < 0 or msg.page_count < 1 or msg.page_start < first
                or msg.page_start + msg.page_count > entry.total_pages):
            return f"pages [{msg.page_start}, +{msg.page_count}) outside [{first}, {entry.total_pages})"
        if entry.decode_prefix_len is not None and msg.page_start * lay.page_size < entry.decode_prefix_len:
            return f"page {msg.page_start} is below decode_prefix_len {entry.decode_prefix_len}"
        if part.begin is not None and msg.layer_start + msg.layer_count > lay.num_layers - lay.window_buffers:
            window_first = part.window_first_page(lay)
            if msg.page_start < window_first:
                return f"window buffer pages from {msg.page_start}, before the window's first page {window_first}"
        page_bytes = part.page_bytes(lay)
        if plen != msg.layer_count * msg.page_count * page_bytes:
            return f"payload {plen} bytes != {msg.layer_count} layers x {msg.page_count} pages x {page_bytes}"
        if part.begin is not None and msg.index >= part.begin.num_chunks:
            return f"index {msg.index} >= num_chunks {part.begin.num_chunks}"
        return ""

    def _receive_payload(self, entry: _ReceiverRoom, part: _Part, reader: FrameReader, msg: Chunk) -> None:
        """Read the payload into the destination. Runs without the lock. The reader checks
        the frame's tag when the last byte is read (IntegrityError): bytes written straight
        into a destination buffer before that only count once the room is SUCCESS."""
        lay = entry.layout
        whole = part.width == 0
        if entry.dest_view is not None and whole:
            bpp = lay.bytes_per_page
            for layer in range(msg.layer_start, msg.layer_start + msg.layer_count):
                start = (layer * entry.total_pages + msg.page_start) * bpp
                reader.read_payload_into(entry.dest_view[start : start + msg.page_count * bpp])  # zero-copy
            return
        payload = reader.read_payload()  # verified (or IntegrityError) before anything is written
        if entry.state.is_terminal:
            return
        if entry.dest_view is not None:  # a row slice: strided into [layer][page][token][row bytes]
            dest = np.frombuffer(entry.dest_view, dtype=np.uint8).reshape(
                lay.num_layers, entry.total_pages, lay.page_size, lay.token_bytes)
            dest[msg.layer_start : msg.layer_start + msg.layer_count, msg.page_start : msg.page_start + msg.page_count,
                 :, part.offset : part.offset + part.width] = np.frombuffer(payload, dtype=np.uint8).reshape(
                msg.layer_count, msg.page_count, lay.page_size, part.width)
        elif whole:
            entry.dest_write(msg.layer_start, msg.layer_count, msg.page_start, msg.page_count, payload)
        else:
            entry.dest_write(msg.layer_start, msg.layer_count, msg.page_start, msg.page_count, payload,
                             row=(part.offset, part.width))

    def _check_complete(self, entry: _ReceiverRoom, conn: _ReceiverConn) -> None:
        parts = list(entry.parts.values())
        if (entry.slice_count is None or len(parts) < entry.slice_count or entry.writers
                or any(p.begin is None or p.end is None for p in parts)):
            return
        lay = entry.layout
        for p in parts:
            b, e, expected = p.begin, p.end, p.expected_bytes(lay)
            if e.num_chunks != b.num_chunks or e.total_bytes != expected:
                self._fail_room(entry, FailureReason.LAYOUT_MISMATCH,
                                f"slice {p.index}: END says {e.num_chunks} chunks / {e.total_bytes} bytes, expected "
                                f"{b.num_chunks} / {expected}", tell_peer=True, conn=conn)
                return
        if any(len(p.indices) < p.begin.num_chunks or not p.all_covered(lay) for p in parts):
            return  # chunks still in flight on other streams
        for p in parts:
            if p.bytes_received != p.expected_bytes(lay):
                self._fail_room(entry, FailureReason.LAYOUT_MISMATCH, f"slice {p.index}: received {p.bytes_received} "
                                f"bytes, expected {p.expected_bytes(lay)}", tell_peer=True, conn=conn)
                return
        covered = sum(p.width for p in parts)  # slices never overlap (_set_row): this is the union
        if parts[0].width and covered != lay.token_bytes:  # (a whole-row part is the only part)
            self._fail_room(entry, FailureReason.LAYOUT_MISMATCH, f"the {len(parts)} slices cover {covered} of "
                            f"{entry.layout.token_bytes} bytes of each token row", tell_peer=True, conn=conn)
            return
        self._machine.step(entry, _ALL_VERIFIED)
        logger.debug("room %s: all chunks of %d slice(s) verified", entry.room, len(parts))
        for p in parts:
            reply_to = self._conn_of(p.session, conn)
            if reply_to is not None:
                self._post(reply_to, Ack(entry.room, p.expected_bytes(lay)))

    @staticmethod
    def _conn_of(session: _ReceiverSession, preferred: Optional[_ReceiverConn]) -> Optional[_ReceiverConn]:
        """A connection of ``session`` to reply on: ``preferred`` if it is one."""
        if preferred is not None and preferred.session is session:
            return preferred
        return next(iter(session.conns), None)

    def _fail_room(self, entry: _ReceiverRoom, reason: str, detail: str, tell_peer: bool, conn: Optional[_ReceiverConn] = None) -> None:
        if entry.state.is_terminal:
            return
        logger.warning("room %s: receive failed: %s (%s)", entry.room, reason, detail)
        self._machine.step(entry, recv_room.ReceiveFailed(reason, detail, tell_peer), conn)

    def _wake_waiters(self, entry: _ReceiverRoom, action: recv_room.WakeReceiveWaiters,
                      conn: Optional[_ReceiverConn] = None) -> None:
        entry.done.set()
        self._cv.notify_all()
        if self._on_settled is not None:
            self._on_settled(entry.room)

    def _nack_senders(self, entry: _ReceiverRoom, action: recv_room.NackSenders,
                      conn: Optional[_ReceiverConn] = None) -> None:
        """``conn``: the stream the failing frame came in on, if any: its session is told too."""
        nack, told = Nack(entry.room, action.reason, action.detail), False
        for session in entry.sessions | ({conn.session} if conn is not None and conn.session else set()):
            reply_to = self._conn_of(session, conn)
            if reply_to is not None:
                self._post(reply_to, nack)
                told = True
        entry.untold = None if told else nack

    def _post(self, conn: _ReceiverConn, msg) -> None:
        """Queue a reply (called with the lock held); sent by the connection's reader thread
        after the frame it is handling, else by the flusher thread."""
        if len(conn.outbox) >= MAX_QUEUED_REPLIES:  # the peer has stopped reading long ago
            logger.warning("peer %s does not read its replies; closing the stream", conn.peer)
            conn.shutdown()
            return
        conn.outbox.append(msg)
        self._to_flush.add(conn)
        self._flush_cv.notify()

    def _flush_loop(self) -> None:
        """Sends the replies that no reader thread is about to send (owner aborts, other
        streams' rooms), without the lock."""
        while True:
            with self._cv:
                self._flush_cv.wait_for(lambda: self._to_flush or self._closed)
                if self._closed:
                    return
                conns, self._to_flush = self._to_flush, set()
            for conn in conns:
                conn.flush()

    def _check_rooms(self, now: float) -> None:
        for entry in self._rooms.values():
            if entry.state.is_terminal:
                continue
            if entry.deadline is not None and now > entry.deadline:
                self._fail_room(entry, FailureReason.TIMEOUT, "transfer deadline passed", tell_peer=False)
            elif entry.parts and now - entry.last_progress > self.idle_timeout:
                # No NACK: the stream may be the stalled thing; the sender has its own timer.
                self._fail_room(entry, FailureReason.IDLE_TIMEOUT,
                                f"no data for {now - entry.last_progress:.1f}s", tell_peer=False)
