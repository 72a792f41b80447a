"""Wire format of the WAN KV channel: message dataclasses and the framing codec.

Every frame on a stream is::

    prefix (20 bytes, network order)   msgpack header         raw payload
    +-------+-----+------+----+--------+------------------+  +--------------+
    | magic | ver | type | 00 | hdrlen | paylen (u64)     |  | paylen bytes |
    | PDKV  | u8  | u8   | u16| u32    |                  |  +--------------+
    +-------+-----+------+----+--------+------------------+
    then ``hdrlen`` bytes of msgpack: a list of the message's field values, in
    dataclass field order (positional: compact, and the length is checked).

Only CHUNK frames (the KV bytes, layer-major: for each layer of the chunk,
``page_count * bytes_per_page`` bytes) and MEM_WRITE frames (raw bytes for a one-sided
write, see tcp_engine.py) carry a payload. Payloads are never copied by the codec:
the sender hands the header, the caller's memoryview and the tag to one ``sendmsg``
(gather write) and the receiver ``recv_into``s straight into the destination buffer (or,
for MEM_WRITE, into a scratch buffer that is checked before it is copied to the target
address).

Why a fixed prefix before the msgpack header: the reader learns both lengths from
20 bytes and checks them against hard limits *before* allocating anything, so a
malformed or hostile peer cannot make us allocate 4 GiB or read forever.

Every malformed input raises :class:`ProtocolError` whose message names what was wrong.

Frame authentication (after the handshake, see handshake.py): every frame carries
AES-256-GMAC tags (AES-GCM with an empty plaintext: the bytes are authenticated, not
encrypted) under a per-connection, per-direction key, with the frame counter as nonce::

    prefix | header | tag_h [| payload | tag_p]
    tag_h = GMAC(k, nonce = 00 00 00 01 | seq, aad = prefix | header)  -- checked before acting on the header
    tag_p = GMAC(k, nonce = 00 00 00 02 | seq, aad = payload)          -- checked once the payload is read

``seq`` (u64) counts the frames of that direction from 0 and is not sent, so a replayed,
reordered, dropped or injected frame fails its tag like an altered one (IntegrityError);
tag_p is bound to its frame's header through the shared ``seq``, and the header (tag_h)
fixes the payload's length. Each (key, nonce) pair is used once, as GCM requires: the key
is unique to the connection and direction, the nonce to the frame and part. GMAC replaced
HMAC-SHA256 (wire version 4) because it is ~10x cheaper per byte with AES-NI/PCLMUL and
OpenSSL releases the GIL on it (benchmarks/bench_frame_mac.py); the tag also replaced the
chunks' CRC-32, which could only catch what the tag already does.

On a stream whose handshake ran inside TLS 1.3 and is bound to it (handshake.py,
``SecureStream.tls_bound``), frames carry no tags: TLS records are already authenticated
and ordered, and the binding proves the TLS peer is the one that knew the shared key.
"""

from __future__ import annotations

import dataclasses
import enum
import hmac
import socket
import ssl
import struct
import zlib
from dataclasses import dataclass
from typing import ClassVar, Optional, Union

import msgpack
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

MAGIC = b"PDKV"
# 2: frames after the handshake carry MAC tags; 3: row slices (P with TP > 1); 4: GMAC tags instead
# of HMAC-SHA256, no CRC-32 in CHUNK, no tags on a TLS-bound stream
VERSION = 4
PREFIX = struct.Struct("!4sBBHIQ")  # magic, version, msg type, reserved, header len, payload len
PREFIX_SIZE = PREFIX.size  # 20

DEFAULT_MAX_HEADER_BYTES = 64 * 1024
DEFAULT_MAX_PAYLOAD_BYTES = 64 * 1024 * 1024

_U64_MAX = (1 << 64) - 1


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame; the message says what."""


class IntegrityError(ProtocolError):
    """A frame's MAC tag did not verify: altered, replayed, reordered, dropped or forged."""


TAG_BYTES = 16
_NONCE = struct.Struct("!IQ")  # part (1 = header, 2 = payload), frame counter: 12 bytes
_PART_HEADER, _PART_PAYLOAD = 1, 2


class PayloadMac:
    """The running tag of one frame's payload, fed as its pieces arrive.

    A payload read in one piece (the common case) is tagged in one ``AESGCM.encrypt`` call,
    which releases the GIL; one read in pieces goes through GCM's incremental interface.
    """

    __slots__ = ("_key", "_aead", "_nonce", "_left", "_ctx", "_tag")

    def __init__(self, key: bytes, aead: AESGCM, nonce: bytes, nbytes: int):
        self._key, self._aead, self._nonce, self._left = key, aead, nonce, nbytes
        self._ctx = None
        self._tag: Optional[bytes] = None

    def update(self, piece) -> None:
        n = memoryview(piece).nbytes
        if n > self._left:
            raise ValueError("more bytes than the payload has")
        if self._ctx is None and self._tag is None and n == self._left:
            self._tag = self._aead.encrypt(self._nonce, b"", piece)
        else:
            if self._ctx is None:
                self._ctx = Cipher(algorithms.AES(self._key), modes.GCM(self._nonce)).encryptor()
            self._ctx.authenticate_additional_data(piece)
        self._left -= n

    def digest(self) -> bytes:
        if self._left:
            raise ValueError(f"payload tag asked for with {self._left} bytes still unread")
        if self._tag is None:
            if self._ctx is None:  # an empty payload: no frame has one, but keep it well-defined
                self._tag = self._aead.encrypt(self._nonce, b"", None)
            else:
                self._ctx.finalize()
                self._tag = self._ctx.tag
        return self._tag


class FrameMac:
    """One direction of a connection's frame authentication: key + frame counter.

    Not thread-safe: each direction of a connection has one writer (or one reader) at a time.
    """

    def __init__(self, key: bytes):
        if len(key) != 32:
            raise ValueError("frame MAC key must be 32 bytes (AES-256)")
        self._key = bytes(key)
        self._aead = AESGCM(self._key)
        self.seq = 0

    def begin(self, head, payload_len: int = 0) -> tuple[bytes, Optional[PayloadMac]]:
        """Tag of a frame's prefix+header, and the running tag of its payload (None without one)."""
        seq = self.seq
        self.seq += 1
        tag_h = self._aead.encrypt(_NONCE.pack(_PART_HEADER, seq), b"", bytes(head))
        if not payload_len:
            return tag_h, None
        return tag_h, PayloadMac(self._key, self._aead, _NONCE.pack(_PART_PAYLOAD, seq), payload_len)

    def seal(self, head, payload=None) -> tuple[bytes, bytes]:
        """(tag_h, tag_p) of an outgoing frame; tag_p is b"" without a payload."""
        n = 0 if payload is None else memoryview(payload).nbytes
        tag_h, p = self.begin(head, n)
        if p is None:
            return tag_h, b""
        p.update(payload)
        return tag_h, p.digest()


class MsgType(enum.IntEnum):
    HELLO = 1
    HELLO_CHALLENGE = 2
    HELLO_AUTH = 3
    HELLO_OK = 4
    TRANSFER_BEGIN = 10
    CHUNK = 11
    TRANSFER_END = 12
    ACK = 13
    NACK = 14
    ABORT = 15
    ERROR = 16
    # One-sided writes of tcp_engine.TcpTransferEngine (the intra-DC Mooncake stand-in).
    MEM_WRITE = 20
    MEM_COMMIT = 21
    MEM_WRITE_ACK = 22


def checksum(data) -> int:
    """CRC-32 of a MEM_WRITE payload (tcp_engine.py; zlib releases the GIL on large buffers)."""
    return zlib.crc32(data) & 0xFFFFFFFF


# ---------------------------------------------------------------------------
# Messages. Field order is the wire order; annotations are checked on decode.
# ---------------------------------------------------------------------------


@dataclass
class Hello:
    """Client -> server, first frame of every stream."""

    TYPE: ClassVar[MsgType] = MsgType.HELLO
    peer_name: str
    session_id: bytes  # random per sender process+connect; groups the N streams
    stream_index: int
    num_streams: int
    nonce: bytes


@dataclass
class HelloChallenge:
    """Server -> client: the server's nonce and its proof that it knows the key."""

    TYPE: ClassVar[MsgType] = MsgType.HELLO_CHALLENGE
    peer_name: str
    nonce: bytes
    mac: bytes


@dataclass
class HelloAuth:
    """Client -> server: the client's proof that it knows the key."""

    TYPE: ClassVar[MsgType] = MsgType.HELLO_AUTH
    mac: bytes


@dataclass
class HelloOk:
    TYPE: ClassVar[MsgType] = MsgType.HELLO_OK


@dataclass
class TransferBegin:
    """Announces one request's KV: pages [first_page, end_page) of every layer (of a window
    buffer, only the window's pages).

    first_page = decode_prefix_len // page_size: the pages MD already holds are not sent.
    """

    TYPE: ClassVar[MsgType] = MsgType.TRANSFER_BEGIN
    room: int
    request_id: str
    num_tokens: int
    page_size: int
    first_page: int
    end_page: int
    num_layers: int
    bytes_per_page: int  # per layer
    dtype: str
    num_chunks: int
    token_digest: bytes  # sha256 of the prompt token ids, or b"" if not given
    kv_kind: str = "mha"  # what each "layer" buffer holds: K or V (mha) or MLA's latent (mla)
    # P with TP > 1: this sender moves bytes [row_offset, row_offset + row_bytes) of every token
    # row (its ranks' KV heads), one of slice_count senders of the room. row_bytes 0 = the whole
    # row; bytes_per_page above is always the whole row's, as MD registered it.
    slice_index: int = 0
    slice_count: int = 1
    row_offset: int = 0
    row_bytes: int = 0
    # A hybrid sliding-window pool: the last window_buffers buffers send only the window's pages
    # (layout.py, TransferPlan.window_first_page), window tokens wide; 0, 0: no window.
    window_buffers: int = 0
    window: int = 0


@dataclass
class Chunk:
    """Header of one CHUNK; the payload follows, layer-major."""

    TYPE: ClassVar[MsgType] = MsgType.CHUNK
    room: int
    index: int
    layer_start: int
    layer_count: int
    page_start: int
    page_count: int
    slice_index: int = 0  # as in TransferBegin: chunks may overtake their BEGIN on other streams
    row_offset: int = 0
    row_bytes: int = 0  # 0 = the whole row


@dataclass
class TransferEnd:
    TYPE: ClassVar[MsgType] = MsgType.TRANSFER_END
    room: int
    num_chunks: int
    total_bytes: int
    slice_index: int = 0


@dataclass
class Ack:
    """Receiver -> sender: every chunk of the room arrived and verified."""

    TYPE: ClassVar[MsgType] = MsgType.ACK
    room: int
    total_bytes: int


@dataclass
class Nack:
    """Receiver -> sender: the room failed on the receiving side (reason = FailureReason)."""

    TYPE: ClassVar[MsgType] = MsgType.NACK
    room: int
    reason: str
    detail: str


@dataclass
class Abort:
    """Either direction: give up on a room."""

    TYPE: ClassVar[MsgType] = MsgType.ABORT
    room: int
    reason: str


@dataclass
class Error:
    """A problem that is not (only) about one room, e.g. a duplicate chunk or a bad frame.

    room is -1 when the error is about the connection.
    """

    TYPE: ClassVar[MsgType] = MsgType.ERROR
    room: int
    reason: str
    detail: str


@dataclass
class MemWrite:
    """Write the payload (``length`` bytes) at the receiver's address ``dst_addr``.

    ``index`` counts the writes of ``batch`` from 0; the receiver checks the order.
    """

    TYPE: ClassVar[MsgType] = MsgType.MEM_WRITE
    batch: int
    index: int
    dst_addr: int
    length: int
    crc32: int


@dataclass
class MemCommit:
    """Ends a batch: the receiver answers MEM_WRITE_ACK once every write is applied.
    A batch of 0 writes is a ping (send_probe)."""

    TYPE: ClassVar[MsgType] = MsgType.MEM_COMMIT
    batch: int
    count: int
    total_bytes: int


@dataclass
class MemWriteAck:
    """Receiver -> sender: ``status`` is "ok" (all ``applied``), else why the batch failed."""

    TYPE: ClassVar[MsgType] = MsgType.MEM_WRITE_ACK
    batch: int
    applied: int
    status: str
    detail: str


Message = Union[
    Hello, HelloChallenge, HelloAuth, HelloOk, TransferBegin, Chunk, TransferEnd, Ack, Nack, Abort, Error,
    MemWrite, MemCommit, MemWriteAck,
]

_BY_TYPE = {
    cls.TYPE: cls
    for cls in (
        Hello, HelloChallenge, HelloAuth, HelloOk, TransferBegin, Chunk, TransferEnd, Ack, Nack, Abort, Error,
        MemWrite, MemCommit, MemWriteAck,
    )
}
_WITH_PAYLOAD = (MsgType.CHUNK, MsgType.MEM_WRITE)
_FIELDS = {cls: [(f.name, f.type) for f in dataclasses.fields(cls)] for cls in _BY_TYPE.values()}
_PY_TYPES = {"int": int, "str": str, "bytes": bytes}
_MAX_STR = 4096  # names, reasons, dtypes: nothing legitimate is longer
# Every integer on the wire is in [0, 2**64) except these (-1 = "about the connection").
_MAY_BE_MINUS_ONE = {(Error, "room")}


# ---------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------


def encode_header(msg: Message) -> bytes:
    values = [getattr(msg, name) for name, _ in _FIELDS[type(msg)]]
    return msgpack.packb(values, use_bin_type=True)


def encode_frame(msg: Message, payload_len: int = 0) -> bytes:
    """Prefix + header of a frame; the caller sends ``payload_len`` payload bytes after it."""
    header = encode_header(msg)
    return PREFIX.pack(MAGIC, VERSION, int(msg.TYPE), 0, len(header), payload_len) + header


def sendmsg_all(sock: socket.socket, parts: list) -> None:
    """``sendall`` of several buffers as one gather write (no joining copy), resumed after
    partial writes. A TLS socket has no ``sendmsg``: its parts go one ``sendall`` each."""
    if isinstance(sock, ssl.SSLSocket):
        for part in parts:
            if memoryview(part).nbytes:
                sock.sendall(part)
        return
    views = [memoryview(p).cast("B") for p in parts if memoryview(p).nbytes]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= views[0].nbytes:
            sent -= views[0].nbytes
            views.pop(0)
        if sent:
            views[0] = views[0][sent:]


def send_frame(sock: socket.socket, msg: Message, payload=None, mac: Optional[FrameMac] = None) -> None:
    """Write one frame (with its tags when ``mac`` is given: every frame after the
    handshake, unless the stream is TLS-bound). Header, payload (the caller's memoryview,
    not copied) and tag go in one gather write."""
    n = 0 if payload is None else memoryview(payload).nbytes
    head = encode_frame(msg, n)
    tag_h, tag_p = mac.seal(head, payload if n else None) if mac is not None else (b"", b"")
    if n == 0:
        sock.sendall(head + tag_h)
    elif n <= 64 * 1024:  # small: one buffer, one TLS record or syscall
        sock.sendall(b"".join((head, tag_h, payload, tag_p)))
    else:
        sendmsg_all(sock, [head + tag_h, payload, tag_p])


# ---------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------


def decode_prefix(
    prefix: bytes,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
) -> tuple[MsgType, int, int]:
    """Check the 20-byte prefix; returns (type, header_len, payload_len). Allocates nothing."""
    if len(prefix) != PREFIX_SIZE:
        raise ProtocolError(f"truncated frame prefix: {len(prefix)} of {PREFIX_SIZE} bytes")
    magic, version, mtype, _reserved, header_len, payload_len = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r} (expected {MAGIC!r}): not a sglang-pdd KV stream")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (this side speaks {VERSION})")
    try:
        msg_type = MsgType(mtype)
    except ValueError:
        raise ProtocolError(f"unknown message type {mtype}") from None
    if header_len == 0:
        raise ProtocolError(f"{msg_type.name}: empty header")
    if header_len > max_header_bytes:
        raise ProtocolError(f"{msg_type.name}: header of {header_len} bytes exceeds limit {max_header_bytes}")
    if payload_len > max_payload_bytes:
        raise ProtocolError(f"{msg_type.name}: payload of {payload_len} bytes exceeds limit {max_payload_bytes}")
    if payload_len and msg_type not in _WITH_PAYLOAD:
        raise ProtocolError(
            f"{msg_type.name}: unexpected payload of {payload_len} bytes (only CHUNK and MEM_WRITE have one)"
        )
    return msg_type, header_len, payload_len


def decode_header(msg_type: MsgType, header: bytes) -> Message:
    cls = _BY_TYPE[msg_type]
    try:
        values = msgpack.unpackb(header, raw=False, use_list=True, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types
        raise ProtocolError(f"{msg_type.name}: header is not valid msgpack ({e})") from None
    fields = _FIELDS[cls]
    if not isinstance(values, list) or len(values) != len(fields):
        got = len(values) if isinstance(values, list) else type(values).__name__
        raise ProtocolError(f"{msg_type.name}: header has {got} fields, expected {len(fields)}")
    for (name, type_name), value in zip(fields, values):
        want = _PY_TYPES[type_name]
        # bool is an int subclass; a bool where an int belongs is a malformed frame.
        if not isinstance(value, want) or isinstance(value, bool):
            raise ProtocolError(f"{msg_type.name}.{name}: expected {type_name}, got {type(value).__name__}")
        if want is int and not ((-1 if (cls, name) in _MAY_BE_MINUS_ONE else 0) <= value <= _U64_MAX):
            raise ProtocolError(f"{msg_type.name}.{name}: integer {value} out of range")
        if want is str and len(value) > _MAX_STR:
            raise ProtocolError(f"{msg_type.name}.{name}: string of {len(value)} chars is too long")
    return cls(*values)


def decode_frame(
    buf,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
) -> tuple[Message, memoryview, int]:
    """Decode one frame from the start of ``buf``. Returns (message, payload view, bytes used).

    For tests and tools; streams use :class:`FrameReader`.
    """
    mv = memoryview(buf).cast("B")
    msg_type, hlen, plen = decode_prefix(bytes(mv[:PREFIX_SIZE]), max_header_bytes, max_payload_bytes)
    end = PREFIX_SIZE + hlen + plen
    if len(mv) < end:
        raise ProtocolError(f"{msg_type.name}: truncated frame ({len(mv)} of {end} bytes)")
    msg = decode_header(msg_type, bytes(mv[PREFIX_SIZE : PREFIX_SIZE + hlen]))
    return msg, mv[PREFIX_SIZE + hlen : end], end


class ConnectionClosed(ConnectionError):
    """The peer closed the stream (cleanly at a frame boundary, or mid-frame)."""


def recv_exactly_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from the socket; raise ConnectionClosed on EOF."""
    got, n = 0, len(view)
    while got < n:
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            raise ConnectionClosed(f"peer closed the connection ({got} of {n} bytes read)")
        got += r


class FrameReader:
    """Reads frames from a blocking socket with hard limits.

    Usage: ``msg, payload_len = reader.read_message()``; then, if payload_len > 0, the
    caller must consume the payload with :meth:`read_payload_into` (zero-copy into the
    destination), :meth:`read_payload` or :meth:`discard_payload` before the next frame.
    """

    def __init__(
        self,
        sock: socket.socket,
        max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    ):
        self.sock = sock
        self.max_header_bytes = max_header_bytes
        self.max_payload_bytes = max_payload_bytes
        self._prefix = bytearray(PREFIX_SIZE)
        self._scratch: Optional[bytearray] = None
        self.pending_payload = 0
        # Set after the handshake: from then on every frame's tags are verified.
        self.mac: Optional[FrameMac] = None
        self._payload_mac = None
        self._frame_name = ""

    def read_message(self) -> tuple[Message, int]:
        """Next frame's message and payload length. With ``mac`` set, the header is
        verified before it is returned; the payload when its last byte is read."""
        if self.pending_payload:
            raise RuntimeError("previous frame's payload was not consumed")
        view = memoryview(self._prefix)
        first = self.sock.recv_into(view, PREFIX_SIZE)
        if first == 0:
            raise ConnectionClosed("peer closed the connection")
        recv_exactly_into(self.sock, view[first:])
        prefix = bytes(self._prefix)
        msg_type, hlen, plen = decode_prefix(prefix, self.max_header_bytes, self.max_payload_bytes)
        header = bytearray(hlen)  # bounded by max_header_bytes, checked above
        recv_exactly_into(self.sock, memoryview(header))
        if self.mac is not None:
            seq = self.mac.seq
            tag_h, self._payload_mac = self.mac.begin(prefix + header, plen)
            self._frame_name = f"{msg_type.name} frame #{seq}"
            self._check_tag(tag_h, "header")
        msg = decode_header(msg_type, bytes(header))
        self.pending_payload = plen
        return msg, plen

    def _check_tag(self, expected: bytes, part: str) -> None:
        got = bytearray(TAG_BYTES)
        recv_exactly_into(self.sock, memoryview(got))
        if not hmac.compare_digest(bytes(got), expected):
            raise IntegrityError(f"{self._frame_name}: {part} MAC mismatch (altered, replayed, reordered or "
                                 f"forged on the way)")

    def read_payload_into(self, view: memoryview) -> None:
        """Fill ``view`` with the next payload bytes. With ``mac`` set, the read that ends
        the payload raises IntegrityError if the payload's tag does not verify."""
        if len(view) > self.pending_payload:
            raise RuntimeError("reading past the payload")
        recv_exactly_into(self.sock, view)
        self.pending_payload -= len(view)
        if self._payload_mac is not None:
            self._payload_mac.update(view)
            if not self.pending_payload:
                p, self._payload_mac = self._payload_mac, None
                self._check_tag(p.digest(), "payload")

    def read_payload(self) -> memoryview:
        """Whole payload into a reusable scratch buffer (valid until the next read)."""
        n = self.pending_payload
        if self._scratch is None or len(self._scratch) < n:
            self._scratch = bytearray(n)
        view = memoryview(self._scratch)[:n]
        self.read_payload_into(view)
        return view

    def discard_payload(self) -> None:
        """Skip the payload (rejected chunk) without allocating its full size."""
        buf = memoryview(bytearray(min(self.pending_payload, 1 << 20) or 1))
        while self.pending_payload:
            n = min(self.pending_payload, len(buf))
            self.read_payload_into(buf[:n])
