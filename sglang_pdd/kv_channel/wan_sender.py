"""Sending side of the WAN KV channel (prefill, datacenter A -> main decode, datacenter B).

Threads and blocking sockets, so the API is plain synchronous calls (SGLang's scheduler
is synchronous). One ``WanKvSender`` talks to one receiver through a *session*: N TCP
streams (default 4) that each authenticate (see handshake.py). Many rooms share it.

Data path::

    producer --send_layer/send_chunk--> bounded queue (window_bytes) --> N stream writers
                                                                          (GMAC tag, sendmsg)
    N stream readers <-- ACK / NACK / ERROR / ABORT from the receiver

* Striping: the writers pull from one shared queue, so chunks spread over all streams
  and a slow stream simply takes fewer chunks.
* Order (send_order.py): rooms someone waits for go before rooms kept only for MD's cache
  (``keep_only``: the router released MD's room with keep), and rooms of a kind take turns
  chunk by chunk, so a small transfer is not queued behind a large one.
* Pipelining: chunks are queued as soon as the producer has them (e.g. per layer);
  they go on the wire while later layers are still being produced.
* Backpressure: ``send_chunk`` blocks while ``window_bytes`` of payload are queued but
  not yet written (a waited room's chunk counts only the waited rooms' bytes, so kept
  rooms filling the window never hold it back). Payloads are *not* copied: the caller's buffer must stay unchanged
  until the room is SUCCESS or FAILED (same contract as Mooncake's transfer).
* Success means the receiver verified every chunk (ACK), not that bytes left this host.

Failures (room -> FAILED with a ``FailureReason``): a NACK from the receiver
(unknown_room, layout_mismatch, ...), a broken stream (connection_lost: every unfinished
room of that session fails, since its chunks were striped over all streams), a stream
stuck in ``send`` or a room without progress for ``idle_timeout`` (stall / partition),
the per-transfer deadline ``transfer_timeout``, connect or auth failure, ``abort()``.
After a session breaks, the next ``begin_transfer`` opens a new one (a restarted
receiver just works). A room's state changes only through ``WanKvSender._machine`` (the
kit's Driver over the pure state machine in send_room.py).
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from sglang_pdd.machine import Driver

from .handshake import HandshakeError, SecureStream, check_key, client_handshake
from . import send_room
from .send_order import SendOrder
from .layout import DEFAULT_MAX_CHUNK_BYTES, KvLayout, RowSlice, TransferPlan, token_digest
from .contract import FailureReason, KvSender, KvTransfer, RoomEntry, RoomState
from .wire import (
    Abort,
    Ack,
    Chunk,
    ConnectionClosed,
    Error,
    FrameReader,
    IntegrityError,
    Nack,
    ProtocolError,
    TransferBegin,
    TransferEnd,
    send_frame,
)

logger = logging.getLogger(__name__)

SOCKET_BUFFER_BYTES = 8 * 1024 * 1024


def tune_socket(sock: socket.socket, buffer_bytes: int = SOCKET_BUFFER_BYTES) -> None:
    """No Nagle (headers must not wait for the next payload), large kernel buffers for a
    long fat pipe (the kernel caps them at net.core.[rw]mem_max)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)
        except OSError:
            pass


@dataclass
class _SenderRoom(RoomEntry):
    room: int
    plan: TransferPlan
    session: "_SenderSession"
    begin_msg: TransferBegin
    deadline: float
    row: Optional[RowSlice]  # this sender's bytes of each token row (None: all of it)
    # The room's state (send_room.py); replaced only by WanKvSender._machine, under its lock.
    status: send_room.SendState
    last_progress: float = field(default_factory=time.monotonic)
    queued: set = field(default_factory=set)  # chunk indices handed to us by the producer
    kept: bool = False  # nobody waits for it (keep_only): it sends behind the waited rooms
    bytes_written: int = 0
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def end_queued(self) -> bool:
        return self.status.end_queued


@dataclass
class _Item:
    room: _SenderRoom
    msg: object
    payload: Optional[memoryview] = None

    @property
    def nbytes(self) -> int:
        return 0 if self.payload is None else self.payload.nbytes


class _Stream:
    def __init__(self, index: int):
        self.index = index
        self.sock: Optional[socket.socket] = None
        self.secure: Optional[SecureStream] = None  # frame MACs of this stream's connection
        self.busy_since: Optional[float] = None  # set while inside sendall
        self.threads: list[threading.Thread] = []


class _SenderSession:
    """N authenticated streams to the receiver; dies as a whole."""

    def __init__(self, sender: "WanKvSender"):
        self.sender = sender
        self.id = os.urandom(16)
        self.tag = self.id.hex()[:8]
        self.up = False
        self.dead = False
        self.dead_reason = ""
        self.connected = 0
        self.order: SendOrder[_Item] = SendOrder()  # queued, not yet taken by a writer
        self.writing_bytes = 0  # taken by a writer, not yet written
        self.last_write = time.monotonic()
        self.streams = [_Stream(i) for i in range(sender.num_streams)]

    @property
    def queued_bytes(self) -> int:
        """Payload queued or being written: what the window bounds."""
        return self.order.queued_bytes + self.writing_bytes

    def window_open(self, room: int, nbytes: int, window: int) -> bool:
        """Whether ``room``'s next ``nbytes`` may be queued: a waited room's chunk counts the
        waited rooms' bytes only, a kept room's all of them (an oversized chunk may go alone)."""
        queued = self.writing_bytes + (self.order.queued_bytes if self.order.is_kept(room) else self.order.waited_bytes)
        return queued == 0 or queued + nbytes <= window


class WanKvSender(KvSender):
    """Sends KV of many rooms to one ``WanKvReceiver`` over N parallel TCP streams."""

    def __init__(
        self,
        peer: tuple[str, int],
        auth_key: bytes,
        name: str = "prefill",
        *,
        num_streams: int = 4,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        window_bytes: int = 64 * 1024 * 1024,
        connect_timeout: float = 5.0,
        idle_timeout: float = 10.0,
        transfer_timeout: float = 120.0,
        socket_buffer_bytes: int = SOCKET_BUFFER_BYTES,
        ssl_context: Optional[ssl.SSLContext] = None,
        server_hostname: Optional[str] = None,
        instance: Optional[str] = None,
    ):
        if num_streams < 1:
            raise ValueError("num_streams must be >= 1")
        super().__init__(name, idle_timeout,
                         Driver(send_room.transition, {send_room.WakeSendWaiters: self._wake_waiters,
                                                       send_room.AbortPeer: self._abort_peer}, state="status"),
                         watchdog_name=f"kv-send-watchdog-{name}")
        self.peer = (peer[0], int(peer[1]))
        self.key = check_key(auth_key)
        # What the receiver knows us by: the name plus a random instance tag, so two P hosts
        # configured with the same name never pass for each other (the receiver ends the
        # older session of an identity that reconnects: "peer_restarted").
        self.identity = f"{name}#{instance or os.urandom(6).hex()}"
        self.num_streams = num_streams
        self.max_chunk_bytes = max_chunk_bytes
        self.window_bytes = window_bytes
        self.connect_timeout = connect_timeout
        self.transfer_timeout = transfer_timeout
        self.socket_buffer_bytes = socket_buffer_bytes
        self.ssl_context = ssl_context
        self.server_hostname = server_hostname

        # One lock guards rooms, sessions and the send queue. Waiters of different things wait
        # on different conditions of it, so a queued chunk wakes one writer, and a written one
        # only a producer blocked on the window, not every thread (per chunk, on the hot path).
        # ``_cv`` (contract.RoomEndpoint) also carries window space and the session up/dead.
        self._work = self._condition()  # writers: the queue got an item, or the session changed
        self._rooms: dict[int, _SenderRoom]
        self._session: Optional[_SenderSession] = None
        self._threads: list[threading.Thread] = []
        self._watchdog.start()

    # ------------------------------------------------------------------ public API

    def connect(self, timeout: Optional[float] = None) -> bool:
        """Open the session now (optional: begin_transfer does it lazily). True if up."""
        with self._cv:
            session = self._ensure_session()
            self._cv.wait_for(lambda: session.up or session.dead, timeout or self.connect_timeout + 1)
            return session.up

    def begin_transfer(
        self,
        room: int,
        layout: KvLayout,
        num_tokens: int,
        decode_prefix_len: int = 0,
        *,
        request_id: str = "",
        token_ids: Optional[Sequence[int]] = None,
        timeout: Optional[float] = None,
        row: Optional[RowSlice] = None,
    ) -> "Transfer":
        """Start sending a room's KV: pages from ``decode_prefix_len // page_size`` on.
        ``layout`` is the whole pool's (what the receiver registered); ``row``, if given, is
        the part of every token row this sender moves (one of P's TP ranks): the plan and the
        chunks then cover only those bytes.

        Never blocks on the network; the room is BOOTSTRAPPING until the session is up.
        """
        if row is not None:
            problem = row.problem(layout.token_bytes)
            if problem:
                raise ValueError(f"room {room}: {problem}")
        plan = TransferPlan.build(layout if row is None else layout.of_slice(row), num_tokens, decode_prefix_len,
                                  self.max_chunk_bytes)
        sliced = {} if row is None else dict(slice_index=row.index, slice_count=row.count,
                                             row_offset=row.offset, row_bytes=row.width)
        begin = TransferBegin(
            room=room,
            request_id=request_id,
            num_tokens=num_tokens,
            page_size=layout.page_size,
            first_page=plan.first_page,
            end_page=plan.end_page,
            num_layers=layout.num_layers,
            bytes_per_page=layout.bytes_per_page,
            dtype=layout.dtype,
            num_chunks=plan.num_chunks,
            token_digest=token_digest(token_ids),
            kv_kind=layout.kind,
            window_buffers=layout.window_buffers,
            window=layout.window,
            **sliced,
        )
        with self._cv:
            if self._closed:
                raise RuntimeError("sender is closed")
            old = self._rooms.get(room)
            if old is not None and not old.state.is_terminal:
                raise ValueError(f"room {room} is already transferring")
            session = self._ensure_session()
            entry = _SenderRoom(room, plan, session, begin, time.monotonic() + (timeout or self.transfer_timeout), row,
                          send_room.start(plan.num_chunks, plan.total_bytes, session.up))
            self._rooms[room] = entry
            if session.dead:  # it could not even start; the next begin_transfer tries again
                self._fail_room(entry, session.dead_reason, "the session to the receiver could not start")
            self._enqueue(entry, begin)
        logger.debug("room %s: begin, pages [%d, %d) x %d layers, %d chunks, %d bytes",
                     room, plan.first_page, plan.end_page, layout.num_layers, plan.num_chunks, plan.total_bytes)
        return Transfer(self, entry)

    def abort(self, room: int, reason: str = FailureReason.ABORTED) -> None:
        with self._cv:
            entry = self._rooms.get(room)
            if entry is not None and not entry.state.is_terminal:
                self._fail_room(entry, FailureReason.ABORTED, reason)

    def release(self, room: int) -> None:
        """Forget a room (aborting it if unfinished). Its queued chunks are dropped (an ABORT
        for the receiver still goes), so its buffers are no longer referenced."""
        with self._cv:
            entry = self._rooms.pop(room, None)
            if entry is not None and not entry.state.is_terminal:
                self._fail_room(entry, FailureReason.ABORTED, "released by owner")
            if entry is not None:
                entry.session.order.forget(room)
                self._cv.notify_all()

    def keep_only(self, room: int) -> bool:
        """Nobody waits for ``room``'s KV any more (its request ended on RLD; MD keeps what
        lands for its cache): its chunks go behind every waited room's from now on. False if
        the room is unknown here or already ended."""
        with self._cv:
            entry = self._rooms.get(room)
            if entry is None or entry.state.is_terminal:
                return False
            entry.kept = True
            entry.session.order.keep_only(room)
            self._cv.notify_all()  # a kept chunk's window now counts what it did not
            return True

    def close(self, timeout: float = 5.0) -> None:
        """Fail unfinished rooms (reason ``closed``), close all sockets, join all threads."""
        with self._cv:
            if not self._mark_closed():
                return
            if self._session is not None:
                self._kill_session(self._session, FailureReason.CLOSED, "sender closed")
        self._join([self._watchdog, *self._threads], timeout)

    def stats(self) -> dict:
        with self._cv:
            s = self._session
            return {
                "session_up": bool(s and s.up),
                "queued_bytes": s.queued_bytes if s else 0,
                "rooms": {r: e.state.name for r, e in self._rooms.items()},
                "threads_alive": sum(t.is_alive() for t in self._threads),
            }

    # ------------------------------------------------------------------ producer side

    def _send_chunk(self, entry: _SenderRoom, index: int, payload) -> bool:
        spec = entry.plan.chunk(index)
        view = memoryview(payload).cast("B")
        if view.nbytes != spec.nbytes:
            raise ValueError(f"room {entry.room} chunk {index}: payload is {view.nbytes} bytes, expected {spec.nbytes}")
        msg = Chunk(entry.room, index, spec.layer, 1, spec.page_start, spec.page_count,
                    *(() if entry.row is None else (entry.row.index, entry.row.offset, entry.row.width)))
        with self._cv:
            if index in entry.queued:
                raise ValueError(f"room {entry.room}: chunk {index} sent twice")
            session = entry.session
            # Backpressure: wait for room in the window (an oversized chunk may go alone).
            self._cv.wait_for(
                lambda: entry.state.is_terminal
                or session.dead
                or session.window_open(entry.room, view.nbytes, self.window_bytes)
            )
            if entry.state.is_terminal:
                return False
            entry.queued.add(index)
            self._machine.step(entry, send_room.ChunkQueued())
            self._enqueue(entry, msg, view)
            return True

    def _finish(self, entry: _SenderRoom) -> None:
        with self._cv:
            if entry.state.is_terminal or entry.end_queued:
                return
            missing = entry.plan.num_chunks - len(entry.queued)
            if missing:
                raise ValueError(f"room {entry.room}: finish() with {missing} chunks not sent")
            self._machine.step(entry, send_room.EndQueued())
            self._enqueue(entry, TransferEnd(entry.room, entry.plan.num_chunks, entry.plan.total_bytes,
                                             entry.row.index if entry.row else 0))

    # ------------------------------------------------------------------ internals (hold _cv)

    def _enqueue(self, entry: _SenderRoom, msg, payload: Optional[memoryview] = None) -> None:
        session = entry.session
        if session.dead:
            return
        item = _Item(entry, msg, payload)
        session.order.push(entry.room, item, item.nbytes, urgent=isinstance(msg, Abort))
        entry.last_progress = time.monotonic()
        self._work.notify()

    def _ensure_session(self) -> _SenderSession:
        s = self._session
        if s is not None and not s.dead:
            return s
        s = _SenderSession(self)
        self._session = s
        self._threads = [t for t in self._threads if t.is_alive()]  # drop finished sessions' threads
        for stream in s.streams:
            t = threading.Thread(target=self._run_stream, args=(s, stream), daemon=True,
                                 name=f"kv-send-{self.name}-{s.tag}-{stream.index}")
            try:
                t.start()
            except RuntimeError as e:  # thread exhaustion: this session fails, the sender lives on
                self._kill_session(s, FailureReason.CONNECT_FAILED, f"cannot start a stream thread ({e})")
                break
            stream.threads.append(t)
            self._threads.append(t)
        return s

    def _wake_waiters(self, entry: _SenderRoom, action: send_room.WakeSendWaiters) -> None:
        """The room ended (SUCCESS or FAILED: once)."""
        if entry.state is RoomState.FAILED:
            logger.warning("room %s: transfer to %s:%s failed: %s (%s)", entry.room, *self.peer, entry.reason,
                           entry.detail)
        entry.done.set()
        self._cv.notify_all()

    def _abort_peer(self, entry: _SenderRoom, action: send_room.AbortPeer) -> None:
        # Also before the session is up: its BEGIN may already be queued (writers skip it now),
        # and the receiver must not wait for this room until its own timeout.
        self._enqueue(entry, Abort(entry.room, action.reason))

    def _fail_room(self, entry: _SenderRoom, reason: str, detail: str, tell_peer: bool = True) -> None:
        self._machine.step(entry, send_room.SendFailed(reason, detail, tell_peer))

    def _kill_session(self, s: _SenderSession, reason: str, detail: str) -> None:
        if s.dead:
            return
        s.dead, s.up, s.dead_reason = True, False, reason
        if reason != FailureReason.CLOSED:
            logger.warning("session %s to %s:%s down: %s (%s)", s.tag, *self.peer, reason, detail)
        for entry in self._rooms.values():
            if entry.session is s:
                self._fail_room(entry, reason, detail, tell_peer=False)
        s.order.clear()
        for stream in s.streams:
            if stream.sock is not None:
                try:  # shutdown (not just close) wakes a thread blocked in send/recv
                    stream.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._cv.notify_all()
        self._work.notify_all()

    # ------------------------------------------------------------------ threads

    def _connect_stream(self, s: _SenderSession, stream: _Stream) -> tuple[socket.socket, FrameReader]:
        sock = socket.create_connection(self.peer, timeout=self.connect_timeout)
        try:
            tune_socket(sock, self.socket_buffer_bytes)
            if self.ssl_context is not None:
                sock = self.ssl_context.wrap_socket(sock, server_hostname=self.server_hostname or self.peer[0])
            reader = FrameReader(sock)
            stream.secure = client_handshake(sock, self.key, self.identity, s.id, stream.index, self.num_streams,
                                             reader)
            sock.settimeout(None)
            return sock, reader
        except BaseException:
            sock.close()
            raise

    def _run_stream(self, s: _SenderSession, stream: _Stream) -> None:
        try:
            sock, frame_reader = self._connect_stream(s, stream)
        except HandshakeError as e:
            with self._cv:
                self._kill_session(s, FailureReason.AUTH, f"stream {stream.index}: {e}")
            return
        except (OSError, ProtocolError, ConnectionClosed) as e:
            with self._cv:
                self._kill_session(s, FailureReason.CONNECT_FAILED, f"stream {stream.index}: {e!r}")
            return
        with self._cv:
            if s.dead:
                sock.close()
                return
            stream.sock = sock
            s.connected += 1
            if s.connected == len(s.streams):
                s.up = True
                logger.info("session %s to %s:%s up (%d streams)", s.tag, *self.peer, len(s.streams))
                for entry in self._rooms.values():
                    if entry.session is s and entry.state == RoomState.BOOTSTRAPPING:
                        self._machine.step(entry, send_room.SessionUp())
                self._cv.notify_all()
                self._work.notify_all()
        reader = threading.Thread(target=self._read_stream, args=(s, stream, frame_reader), daemon=True,
                                  name=f"kv-send-rd-{self.name}-{s.tag}-{stream.index}")
        with self._cv:
            self._threads.append(reader)
        reader.start()
        try:
            self._write_stream(s, stream, sock)
        finally:
            reader.join()
            sock.close()

    def _write_stream(self, s: _SenderSession, stream: _Stream, sock: socket.socket) -> None:
        while True:
            with self._cv:
                self._work.wait_for(lambda: s.dead or (s.up and s.order))
                if s.dead:
                    return
                _, item, _ = s.order.pop()
                entry = item.room
                if entry.state.is_terminal and not isinstance(item.msg, Abort):
                    self._cv.notify_all()
                    continue
                s.writing_bytes += item.nbytes
                stream.busy_since = time.monotonic()
            try:
                # Tagged here, so N writers tag in parallel (OpenSSL's GMAC releases the GIL).
                send_frame(sock, item.msg, item.payload, mac=stream.secure.send_mac)
            except OSError as e:
                with self._cv:
                    stream.busy_since = None
                    self._kill_session(s, FailureReason.CONNECTION_LOST, f"stream {stream.index} send: {e!r}")
                return
            with self._cv:
                stream.busy_since = None
                s.writing_bytes -= item.nbytes
                entry.bytes_written += item.nbytes
                entry.last_progress = s.last_write = time.monotonic()
                self._cv.notify_all()

    def _read_stream(self, s: _SenderSession, stream: _Stream, reader: FrameReader) -> None:
        try:
            while True:
                msg, plen = reader.read_message()
                if plen:
                    raise ProtocolError(f"unexpected payload from receiver on {type(msg).__name__}")
                self._on_reply(s, msg)
        except (OSError, ConnectionClosed, ProtocolError) as e:
            with self._cv:
                if not s.dead:
                    reason = (FailureReason.INTEGRITY if isinstance(e, IntegrityError) else
                              FailureReason.PROTOCOL if isinstance(e, ProtocolError) else
                              FailureReason.CONNECTION_LOST)
                    self._kill_session(s, reason, f"stream {stream.index} recv: {e!r}")

    def _on_reply(self, s: _SenderSession, msg) -> None:
        with self._cv:
            entry = self._rooms.get(getattr(msg, "room", -1))
            if entry is not None and entry.session is not s:
                entry = None  # a reply about an older incarnation of this room id
            if isinstance(msg, Ack):
                if entry is not None and not entry.state.is_terminal:  # SUCCESS, or FAILED if premature
                    entry.last_progress = time.monotonic()
                    self._machine.step(entry, send_room.SendAcked(msg.total_bytes))
                    if entry.state is RoomState.SUCCESS:
                        logger.debug("room %s: receiver verified %d bytes", entry.room, msg.total_bytes)
            elif isinstance(msg, Nack):
                if entry is not None:
                    self._fail_room(entry, msg.reason, f"receiver: {msg.detail}", tell_peer=False)
            elif isinstance(msg, Abort):
                if entry is not None:
                    self._fail_room(entry, FailureReason.ABORTED, f"receiver aborted: {msg.reason}", tell_peer=False)
            elif isinstance(msg, Error):
                logger.warning("receiver %s:%s reports for room %s: %s: %s", *self.peer, msg.room, msg.reason, msg.detail)
                if msg.room == -1 and msg.reason in (FailureReason.INTEGRITY, FailureReason.PROTOCOL):
                    # The receiver closes the stream: name the cause, not just "connection lost".
                    self._kill_session(s, msg.reason, f"receiver: {msg.detail}")
            else:
                raise ProtocolError(f"unexpected {type(msg).__name__} from receiver")

    def _progress(self, entry: _SenderRoom) -> float:
        """When ``entry`` last moved; a kept room waits behind the waited ones by design, so
        for it any room's write on its session counts (the link is not stalled)."""
        if entry.kept:
            return max(entry.last_progress, entry.session.last_write)
        return entry.last_progress

    def _check_rooms(self, now: float) -> None:
        s = self._session
        if s is not None and not s.dead:
            for stream in s.streams:
                if stream.busy_since is not None and now - stream.busy_since > self.idle_timeout:
                    self._kill_session(s, FailureReason.IDLE_TIMEOUT,
                                       f"stream {stream.index} stuck in send for {now - stream.busy_since:.1f}s")
                    break
        for entry in list(self._rooms.values()):
            if entry.state.is_terminal:
                continue
            if now > entry.deadline:
                self._fail_room(entry, FailureReason.TIMEOUT, "transfer deadline passed")
            elif now - self._progress(entry) > self.idle_timeout:
                self._fail_room(entry, FailureReason.IDLE_TIMEOUT,
                                f"no progress for {now - entry.last_progress:.1f}s in {entry.state.name}")


class Transfer(KvTransfer):
    """Handle of one room on the sender: feed chunks, then ``finish()``."""

    def __init__(self, sender: WanKvSender, entry: _SenderRoom):
        self._sender = sender
        self._entry = entry
        self.room = entry.room
        self.plan = entry.plan

    def send_chunk(self, index: int, payload) -> bool:
        """Queue chunk ``index`` of the plan (blocks while the window is full).
        Returns False if the room already failed (the producer may just stop)."""
        return self._sender._send_chunk(self._entry, index, payload)

    def send_layer(self, layer: int, data) -> bool:
        """Queue one layer: ``data`` holds the pages that layer sends ([first_page, end_page),
        a window buffer's [window_first_page, end_page)), contiguous (``plan.bytes_of_layer``
        bytes). Sliced into chunks without copying."""
        view = memoryview(data).cast("B")
        expected = self.plan.bytes_of_layer(layer)
        if view.nbytes != expected:
            raise ValueError(f"room {self.room} layer {layer}: {view.nbytes} bytes, expected {expected}")
        offset, ok = 0, True
        for spec in self.plan.chunks_of_layer(layer):
            ok = self.send_chunk(spec.index, view[offset : offset + spec.nbytes]) and ok
            offset += spec.nbytes
        return ok

    def send_kv(self, kv) -> bool:
        """Send a whole request's KV held as one buffer of shape
        [num_layers, total_pages, bytes_per_page] (e.g. a numpy array): only pages
        >= first_page go on the wire. Then ``finish()``."""
        layout = self.plan.layout
        view = memoryview(kv).cast("B")
        layer_stride = self.plan.end_page * layout.bytes_per_page
        if view.nbytes != layer_stride * layout.num_layers:
            raise ValueError(f"room {self.room}: KV buffer is {view.nbytes} bytes, expected {layer_stride * layout.num_layers}")
        ok = True
        for layer in range(layout.num_layers):
            start = layer * layer_stride + self.plan.layer_first_page(layer) * layout.bytes_per_page
            ok = self.send_layer(layer, view[start : start + self.plan.bytes_of_layer(layer)]) and ok
        self.finish()
        return ok

    def finish(self) -> None:
        """All chunks queued: send TRANSFER_END. SUCCESS comes with the receiver's ACK."""
        self._sender._finish(self._entry)

    def poll(self) -> RoomState:
        return self._entry.state

    @property
    def failure_reason(self) -> str:
        return self._entry.reason

    @property
    def failure_detail(self) -> str:
        return self._entry.detail

    def wait(self, timeout: Optional[float] = None) -> RoomState:
        self._entry.done.wait(timeout)
        return self._entry.state
