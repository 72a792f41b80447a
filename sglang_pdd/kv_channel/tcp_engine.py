"""TcpTransferEngine: Mooncake's TransferEngine surface, as one-sided writes over authenticated TCP.

Why it exists: SGLang's Mooncake PD backend (``MooncakeKVManager``) moves KV with
one-sided writes ("copy these local bytes to that address in the peer") through an
engine object. When the ``mooncake`` package is not installed, this engine gives the
same semantics over plain TCP, so the whole Mooncake protocol around it (bootstrap,
metadata and aux exchange, abort, session probing) is reused unchanged: it is the
intra-DC TCP fallback. Only the surface the manager calls is implemented:
``batch_register`` / ``batch_deregister`` / ``register`` / ``deregister``,
``batch_transfer_sync`` / ``transfer_sync``, ``get_session_id`` and ``send_probe``.

HOST MEMORY ONLY: both sides copy with ``ctypes.memmove`` / memoryviews, so every
registered address must be CPU memory. GPU KV pools need Mooncake (RDMA / GPUDirect) or
a device-to-host staging step; that is out of scope here.

Each engine is both ends. It listens on ``hostname:port`` (``get_session_id()``, which
peers pass as ``session_id``) and serves authenticated peers (handshake.py); it also
keeps, per peer, a pool of at most ``num_streams`` authenticated connections (opened
lazily, dropped on any failure and reopened by the next call). A call holds one
connection for its whole batch::

    MEM_WRITE(batch, i, dst_addr, length, crc32) + payload   x N  (split at max_write_bytes)
    MEM_COMMIT(batch, N, total_bytes)                        ->
                                                             <- MEM_WRITE_ACK(batch, applied, status, detail)

The call returns 0 only after the peer confirmed every write landed. What the
receiving side checks, so a buggy or stale sender cannot scribble over its memory:
  * the peer authenticated (else refused and logged, never served), and every frame's
    MAC tags verify (wire.FrameMac: nothing altered, replayed or injected on the way);
  * ``[dst_addr, dst_addr + length)`` lies inside ONE registered region, and still does
    when the bytes are copied (deregistration waits for copies in flight);
  * the CRC-32 of the payload, checked in a scratch buffer before it is copied;
  * frame limits (a write over ``max_write_bytes`` is a protocol error).
A refused write fails its batch (status + reason back to the sender, later writes of the
batch are skipped; earlier ones may have landed, as with Mooncake the caller fails the
request). A malformed frame gets an ERROR frame and the connection is closed; the
server keeps serving everyone else. The sender also refuses to read from memory it has
not registered itself (RDMA needs that too).

Failures never raise: calls return a negative code (``ERR_*``) and log one warning.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import logging
import os
import socket
import threading
from typing import Optional, Sequence

from .acceptor import Acceptor, AdmissionLimits, Slot
from .handshake import HandshakeError, check_key, client_handshake, server_handshake
from .wan_sender import tune_socket
from .wire import (
    ConnectionClosed,
    Error,
    FrameMac,
    FrameReader,
    MemCommit,
    MemWrite,
    MemWriteAck,
    ProtocolError,
    checksum,
    encode_frame,
    send_frame,
)

logger = logging.getLogger(__name__)

OK = 0
ERR_INVALID = -1  # bad arguments: list lengths, session id, source not registered here
ERR_CONNECT = -2  # peer unreachable, refused the connection, or failed authentication
ERR_IO = -3  # connection broke or timed out mid-batch, or the peer broke the protocol
ERR_REJECTED = -4  # the peer refused a write (outside its registered memory, checksum)
ERR_CLOSED = -5  # this engine is closed

STATUS_OK = "ok"
MAX_SERVER_CONNECTIONS = 256
_SEND_COALESCE_BYTES = 256 * 1024  # small frames are joined into one send (KV slices are often a few KiB)


def parse_session_id(session_id: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> (host, port). Raises ValueError."""
    host, sep, port = session_id.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bad session id {session_id!r} (expected host:port)")
    return host.strip("[]"), int(port)


def _describe(e: BaseException) -> str:
    return str(e) or type(e).__name__


def _host_memory(ptr: int, length: int) -> memoryview:
    """A view of ``length`` bytes at ``ptr`` (no copy)."""
    return memoryview((ctypes.c_char * length).from_address(ptr)).cast("B")


class _Regions:
    """Registered host memory: disjoint [start, end) regions, with copies in flight counted
    so that deregistration returns only when nobody is writing into the region any more."""

    def __init__(self):
        self._cv = threading.Condition()
        self._ends: dict[int, int] = {}  # start -> end
        self._starts: list[int] = []  # sorted
        self._inflight = 0

    def add(self, ptrs: Sequence[int], lengths: Sequence[int]) -> str:
        """All or nothing; returns "" or why not. An exact re-registration is a no-op."""
        if len(ptrs) != len(lengths):
            return f"{len(ptrs)} pointers but {len(lengths)} lengths"
        with self._cv:
            ends = dict(self._ends)
            for ptr, n in zip(ptrs, lengths):
                if ptr <= 0 or n <= 0:
                    return f"bad region 0x{ptr:x} +{n}"
                if ends.setdefault(ptr, ptr + n) != ptr + n:
                    return f"region 0x{ptr:x} +{n} conflicts with one registered at the same address"
            starts = sorted(ends)
            for a, b in zip(starts, starts[1:]):
                if ends[a] > b:  # overlaps would make "inside one region" ambiguous
                    return f"region 0x{a:x}..0x{ends[a]:x} overlaps region at 0x{b:x}"
            self._ends, self._starts = ends, starts
        return ""

    def remove(self, ptrs: Sequence[int]) -> list[int]:
        """Forget regions (by start); returns the unknown ones. Waits for copies in flight."""
        unknown = []
        with self._cv:
            for ptr in ptrs:
                if self._ends.pop(ptr, None) is None:
                    unknown.append(ptr)
            self._starts = sorted(self._ends)
            self._cv.wait_for(lambda: self._inflight == 0)
        return unknown

    def _outside(self, addr: int, n: int) -> str:
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0 and addr + n <= self._ends[self._starts[i]]:
            return ""
        return f"write [0x{addr:x},+{n}) outside registered memory"

    def check(self, addr: int, n: int) -> str:
        with self._cv:
            return self._outside(addr, n)

    def copy_in(self, addr: int, data: memoryview) -> str:
        """memmove ``data`` to ``addr`` if it lies inside one region; returns "" or why not."""
        n = len(data)
        with self._cv:
            why = self._outside(addr, n)
            if why:
                return why
            self._inflight += 1
        try:
            # memmove releases the GIL; the lock is not held, so copies run in parallel.
            ctypes.memmove(addr, (ctypes.c_char * n).from_buffer(data), n)
        finally:
            with self._cv:
                self._inflight -= 1
                if not self._inflight:
                    self._cv.notify_all()
        return ""


class _EngineConn:
    """One authenticated client connection to a peer."""

    def __init__(self, sock: socket.socket, timeout: float, reader: FrameReader, mac: FrameMac):
        self.sock = sock
        self.timeout = timeout
        self.reader = reader  # verifies the peer's frame MACs
        self.mac = mac  # tags ours

    def alive(self) -> bool:
        """A pooled connection whose peer went away (restart, close) reads EOF or an error
        now; checked before reuse so a restarted peer works on the very next call (no
        batch is ever resent: after a restart its addresses may mean something else)."""
        self.sock.setblocking(False)
        try:
            self.sock.recv(1, socket.MSG_PEEK)
            return False  # EOF, or bytes nobody asked for: not reusable either way
        except BlockingIOError:
            return True
        except OSError:
            return False
        finally:
            self.sock.settimeout(self.timeout)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class _Peer:
    def __init__(self, num_streams: int):
        self.slots = threading.BoundedSemaphore(num_streams)
        self.idle: list[_EngineConn] = []


class TcpTransferEngine:
    """Drop-in for SGLang's MooncakeTransferEngine (host memory, TCP). See the module doc."""

    def __init__(
        self,
        hostname: str,
        auth_key: bytes,
        *,
        port: int = 0,
        name: str = "tcp-engine",
        num_streams: int = 2,
        connect_timeout: float = 5.0,
        io_timeout: float = 30.0,
        max_write_bytes: int = 64 * 1024 * 1024,
        admission: AdmissionLimits = AdmissionLimits(),
    ):
        if num_streams < 1 or max_write_bytes < 1:
            raise ValueError("num_streams and max_write_bytes must be >= 1")
        self.key = check_key(auth_key)
        self.hostname = hostname
        self.name = name
        self.num_streams = num_streams
        self.connect_timeout = connect_timeout
        self.io_timeout = io_timeout
        self.max_write_bytes = max_write_bytes

        self._regions = _Regions()
        self._lock = threading.Lock()
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._closed = False
        self._batch_ids = itertools.count(1)
        self._stream_ids = itertools.count()
        self._client_session = os.urandom(16)  # handshake session: groups this engine's connections

        family = socket.AF_INET6 if ":" in hostname else socket.AF_INET
        listener = socket.create_server((hostname, port), family=family, backlog=128)
        self.port: int = listener.getsockname()[1]
        self._session_id = f"[{hostname}]:{self.port}" if family == socket.AF_INET6 else f"{hostname}:{self.port}"
        self._acceptor = Acceptor(listener, self._serve, name=f"tcp-engine-{name}",
                                  max_connections=MAX_SERVER_CONNECTIONS, admission=admission,
                                  handshake_deadline=connect_timeout)
        logger.info("TCP transfer engine %r listening on %s", name, self._session_id)

    # ------------------------------------------------------------------ Mooncake surface

    def get_session_id(self) -> str:
        return self._session_id

    def batch_register(self, ptrs: list[int], lengths: list[int]) -> int:
        why = self._regions.add(list(ptrs), list(lengths))
        if why:
            logger.warning("%s: memory registration failed: %s", self.name, why)
            return ERR_INVALID
        return OK

    def batch_deregister(self, ptrs: list[int]) -> int:
        unknown = self._regions.remove(list(ptrs))
        if unknown:
            logger.warning("%s: deregister of unregistered memory %s", self.name, [hex(p) for p in unknown])
            return ERR_INVALID
        return OK

    def register(self, ptr: int, length: int) -> None:
        # Mooncake's wrapper raises on failure here (and returns codes in the batch forms).
        if self.batch_register([ptr], [length]) != OK:
            raise RuntimeError(f"TCP engine memory registration failed (0x{ptr:x} +{length})")

    def deregister(self, ptr: int) -> None:
        if self.batch_deregister([ptr]) != OK:
            raise RuntimeError(f"TCP engine memory deregistration failed (0x{ptr:x})")

    def transfer_sync(self, session_id: str, buffer: int, peer_buffer_address: int, length: int) -> int:
        return self.batch_transfer_sync(session_id, [buffer], [peer_buffer_address], [length])

    def batch_transfer_sync(
        self,
        session_id: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
    ) -> int:
        """Write ``lengths[i]`` bytes from local ``buffers[i]`` to the peer's
        ``peer_buffer_addresses[i]``; 0 once the peer confirmed all of them, else ERR_*."""
        if not len(buffers) == len(peer_buffer_addresses) == len(lengths):
            logger.warning("%s: batch_transfer_sync: %d buffers, %d peer addresses, %d lengths",
                           self.name, len(buffers), len(peer_buffer_addresses), len(lengths))
            return ERR_INVALID
        writes = []  # (src, dst, n), split at max_write_bytes; empty writes dropped
        for src, dst, n in zip(buffers, peer_buffer_addresses, lengths):
            if n < 0:
                logger.warning("%s: batch_transfer_sync: negative length %d", self.name, n)
                return ERR_INVALID
            if n and (why := self._regions.check(src, n)):
                logger.warning("%s: refusing to send: source %s", self.name, why)
                return ERR_INVALID
            for off in range(0, n, self.max_write_bytes):
                writes.append((src + off, dst + off, min(self.max_write_bytes, n - off)))
        return self._run_batch(session_id, writes)

    def send_probe(self, peer_session_id: str) -> int:
        """0 if the peer is reachable, authenticated and answering (an empty batch)."""
        return self._run_batch(peer_session_id, [], what="probe")

    # ------------------------------------------------------------------ lifecycle

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving, close every connection, join the threads."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            idle = [c for p in self._peers.values() for c in p.idle]
            for p in self._peers.values():
                p.idle.clear()
        self._acceptor.close(timeout)  # stops serving: cuts and joins every server connection
        for conn in idle:
            conn.close()

    def __enter__(self) -> "TcpTransferEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ sending side

    def _run_batch(self, session_id: str, writes: list[tuple[int, int, int]], what: str = "transfer") -> int:
        if self._closed:
            return ERR_CLOSED
        try:
            peer_addr = parse_session_id(session_id)
        except ValueError as e:
            logger.warning("%s: %s: %s", self.name, what, e)
            return ERR_INVALID
        peer = self._peer(peer_addr)
        peer.slots.acquire()  # at most num_streams calls in flight per peer; each owns a connection
        try:
            try:
                conn = self._checkout(peer, peer_addr)
            except (OSError, HandshakeError, ProtocolError) as e:
                logger.warning("%s: %s to %s failed: cannot connect: %s", self.name, what, session_id, _describe(e))
                return ERR_CONNECT
            total = sum(n for _, _, n in writes)
            try:
                reply = self._send_batch(conn, writes, total)
            except (OSError, ProtocolError) as e:  # ConnectionClosed and timeouts are OSErrors
                conn.close()
                logger.warning("%s: %s to %s failed (%d writes, %d bytes): %s",
                               self.name, what, session_id, len(writes), total, _describe(e))
                return ERR_IO
            self._checkin(peer, conn)
            if reply.status != STATUS_OK:
                logger.warning("%s: %s to %s rejected by the peer after %d of %d writes: %s: %s",
                               self.name, what, session_id, reply.applied, len(writes), reply.status, reply.detail)
                return ERR_REJECTED
            return OK
        finally:
            peer.slots.release()

    def _peer(self, addr: tuple[str, int]) -> _Peer:
        with self._lock:
            peer = self._peers.get(addr)
            if peer is None:
                peer = self._peers[addr] = _Peer(self.num_streams)
            return peer

    def _checkout(self, peer: _Peer, addr: tuple[str, int]) -> _EngineConn:
        while True:
            with self._lock:
                conn = peer.idle.pop() if peer.idle else None
            if conn is None:
                return self._connect(addr)
            if conn.alive():
                return conn
            conn.close()

    def _checkin(self, peer: _Peer, conn: _EngineConn) -> None:
        with self._lock:
            if not self._closed:
                peer.idle.append(conn)
                return
        conn.close()

    def _connect(self, addr: tuple[str, int]) -> _EngineConn:
        sock = socket.create_connection(addr, timeout=self.connect_timeout)
        try:
            tune_socket(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            reader = FrameReader(sock)
            secure = client_handshake(sock, self.key, self.name, self._client_session, next(self._stream_ids),
                                      self.num_streams, reader)
            sock.settimeout(self.io_timeout)
        except BaseException:
            sock.close()
            raise
        return _EngineConn(sock, self.io_timeout, reader, secure.send_mac)

    def _send_batch(self, conn: _EngineConn, writes: list[tuple[int, int, int]], total: int) -> MemWriteAck:
        batch = next(self._batch_ids)
        sock, out = conn.sock, bytearray()
        for i, (src, dst, n) in enumerate(writes):
            view = _host_memory(src, n)  # no copy: the caller keeps the source unchanged during the call
            head = encode_frame(MemWrite(batch, i, dst, n, checksum(view)), n)
            tag_h, tag_p = conn.mac.seal(head, view)
            if n <= 64 * 1024:
                out += head + tag_h
                out += view
                out += tag_p
                if len(out) >= _SEND_COALESCE_BYTES:
                    sock.sendall(out)
                    out.clear()
            else:
                out += head + tag_h
                sock.sendall(out)
                out.clear()
                sock.sendall(view)
                out += tag_p
        head = encode_frame(MemCommit(batch, len(writes), total))
        out += head + conn.mac.seal(head)[0]
        sock.sendall(out)
        reply, _ = conn.reader.read_message()
        if isinstance(reply, Error):
            raise ProtocolError(f"peer reports {reply.reason}: {reply.detail}")
        if not isinstance(reply, MemWriteAck) or reply.batch != batch:
            raise ProtocolError(f"expected MEM_WRITE_ACK for batch {batch}, got {reply}")
        return reply

    # ------------------------------------------------------------------ receiving side

    def _serve(self, slot: Slot) -> None:
        """One server connection's thread (the acceptor bounds connections and handshake time)."""
        sock, peer = slot.sock, slot.peer
        reader = FrameReader(sock, max_payload_bytes=self.max_write_bytes)
        mac: Optional[FrameMac] = None  # before the handshake completes, errors go untagged
        try:
            tune_socket(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.settimeout(self.connect_timeout)  # per recv; the acceptor bounds the total
            try:
                secure = server_handshake(sock, self.key, self.name, reader)
                if not slot.authenticated():
                    raise HandshakeError(f"handshake took longer than {self.connect_timeout}s")
            except (HandshakeError, ConnectionClosed, OSError) as e:
                logger.warning("%s: refused peer %s: authentication failed: %s", self.name, peer,
                               "handshake deadline passed" if slot.expired else e)
                return
            sock.settimeout(None)  # idle pooled connections wait here between batches
            logger.debug("%s: peer %r (%s) connected", self.name, secure.peer_name, peer)
            mac = secure.send_mac
            self._serve_batches(sock, reader, peer, mac)
        except ProtocolError as e:
            logger.warning("%s: protocol error from %s: %s; closing the connection", self.name, peer, e)
            try:
                send_frame(sock, Error(-1, "protocol", str(e)), mac=mac)
            except OSError:
                pass
        except (ConnectionClosed, OSError):
            pass  # the peer closed or reset: its own side reports the failure
        except Exception:  # a bug must not kill the server
            logger.exception("%s: error serving %s", self.name, peer)
        finally:
            sock.close()

    def _serve_batches(self, sock: socket.socket, reader: FrameReader, peer: str, mac: FrameMac) -> None:
        batch, seen, nbytes, applied, failure = None, 0, 0, 0, None
        while True:
            msg, plen = reader.read_message()
            if isinstance(msg, MemWrite):
                if batch is None:
                    batch = msg.batch
                if msg.batch != batch or msg.index != seen or msg.length != plen:
                    raise ProtocolError(
                        f"MEM_WRITE batch {msg.batch} #{msg.index} ({msg.length} bytes, payload {plen}) "
                        f"does not follow batch {batch} #{seen}"
                    )
                seen += 1
                nbytes += plen
                if failure is None:
                    failure = self._apply(reader, msg)
                    applied += failure is None
                if reader.pending_payload:  # the write was refused before its payload was read
                    reader.discard_payload()
            elif isinstance(msg, MemCommit):
                if batch is not None and msg.batch != batch:
                    raise ProtocolError(f"MEM_COMMIT for batch {msg.batch} inside batch {batch}")
                if failure is None and (msg.count, msg.total_bytes) != (seen, nbytes):
                    failure = ("incomplete", f"commit says {msg.count} writes / {msg.total_bytes} bytes, "
                                             f"got {seen} / {nbytes}")
                if failure is not None:
                    logger.warning("%s: batch %d from %s rejected: %s: %s", self.name, msg.batch, peer, *failure)
                status, detail = failure or (STATUS_OK, "")
                send_frame(sock, MemWriteAck(msg.batch, applied, status, detail), mac=mac)
                batch, seen, nbytes, applied, failure = None, 0, 0, 0, None
            else:
                raise ProtocolError(f"unexpected {type(msg).__name__} on a transfer-engine connection")

    def _apply(self, reader: FrameReader, msg: MemWrite) -> Optional[tuple[str, str]]:
        """Verify and copy one write; None, or (status, detail) why it was refused."""
        where = f"write #{msg.index}"
        why = self._regions.check(msg.dst_addr, msg.length)  # before reading: a refused payload is skipped
        if why:
            return "outside_registered_memory", f"{where}: {why}"
        data = reader.read_payload()  # scratch: nothing reaches the target before its CRC matches
        if checksum(data) != msg.crc32:
            return "checksum", f"{where}: CRC-32 mismatch on [0x{msg.dst_addr:x},+{msg.length})"
        why = self._regions.copy_in(msg.dst_addr, data)  # re-checked: it may have been deregistered since
        return ("outside_registered_memory", f"{where}: {why}") if why else None
