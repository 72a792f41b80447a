"""Mutual authentication of a stream: HMAC-SHA256 challenge-response on a shared key.

    client                                   server
    HELLO(name_c, session, stream, nonce_c) ->
                                          <- HELLO_CHALLENGE(name_s, nonce_s, mac_s)
    verify mac_s
    HELLO_AUTH(mac_c)                      ->
                                             verify mac_c
                                          <- HELLO_OK   (or ERROR + close)

    transcript = nonce_c | nonce_s | name_c | name_s | session | stream | num_streams [| tls_binding]
    mac_s = HMAC(key, "server" | transcript)
    mac_c = HMAC(key, "client" | transcript)
    (c2s, s2c) = HKDF(key, salt = sha256(transcript))   -> per-frame GMAC keys (wire.FrameMac)

Both sides prove knowledge of the key over fresh nonces, so neither a wrong-key peer
nor a replayed handshake gets in; the role tag stops a reflection of the server's
proof. Every frame after that (HELLO_OK first) carries AES-GMAC tags under keys
derived from the key and this connection's transcript, with implicit sequence numbers
(wire.py): a keyless relay that alters, drops, replays or reorders a frame is detected.
Frames are authenticated, not encrypted: for confidentiality pass an ``ssl.SSLContext``
to sender and receiver (``--pdd-wan-tls-*``).

TLS-bound streams. When the handshake runs inside TLS 1.3 (mutual TLS, tls.py), both sides
append the connection's channel binding (``tls-unique``: the first Finished message, which
only the two TLS endpoints share) to the transcript, so the proofs above are valid only on
this TLS connection: a relay that terminates TLS towards each side (even one holding a
certificate from the CA) has two TLS connections with different bindings and cannot pass
the proofs on to the other side. On such a stream the frames carry no MAC tags
(``SecureStream.tls_bound``): TLS records are already encrypted and authenticated, with
implicit per-direction sequence numbers (nothing altered, replayed, reordered, dropped or
injected gets through), and the binding proves that the TLS peer is the one that knew the
shared key. Without TLS, or with TLS 1.2, frames keep their tags.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import ssl
import stat
from dataclasses import dataclass
from typing import Optional

import msgpack

from .wire import (ConnectionClosed, Error, FrameMac, FrameReader, Hello, HelloAuth, HelloChallenge, HelloOk,
                   ProtocolError, send_frame)
from sglang_pdd.shared_key import MIN_KEY_BYTES

NONCE_BYTES = 32


class HandshakeError(Exception):
    """The peer failed to authenticate (wrong key, or not speaking the protocol)."""


class KeyFileError(ValueError):
    """A key file that must not be used (unreadable, readable by others, too short)."""


def check_key(key: bytes) -> bytes:
    if not isinstance(key, (bytes, bytearray)) or len(key) < MIN_KEY_BYTES:
        got = len(key) if isinstance(key, (bytes, bytearray)) else type(key).__name__
        raise ValueError(f"auth key must be at least {MIN_KEY_BYTES} bytes (got {got})")
    return bytes(key)


def _check_private_fd(fd: int, path) -> None:
    st = os.fstat(fd)  # of the opened file: no window between the check and the read
    if not stat.S_ISREG(st.st_mode):
        raise KeyFileError(f"key file {path}: not a regular file")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise KeyFileError(f"key file {path} has mode {mode:04o}: group/others may access it; "
                           f"run chmod 600 {path}")


def open_private(path) -> int:
    """An fd of ``path``, checked to be a regular file only its owner may access (checked on
    the opened file: no window between the check and the read)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise KeyFileError(f"key file {path}: cannot open: {e.strerror}") from None
    try:
        _check_private_fd(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_private_file(path) -> None:
    """Raise KeyFileError unless ``path`` is a regular file only its owner may access."""
    os.close(open_private(path))


def load_key(path) -> bytes:
    """The shared key in ``path`` (its bytes, surrounding whitespace stripped).

    Refused with a :class:`KeyFileError` naming the file: a file that group or others
    may read (``chmod 600`` it: anyone who reads the key can impersonate P or MD) and a
    key shorter than ``MIN_KEY_BYTES``. ``secrets.token_hex(32)`` makes a good one.
    """
    with os.fdopen(open_private(path), "rb") as f:
        key = f.read(1 << 16).strip()
    if len(key) < MIN_KEY_BYTES:
        raise KeyFileError(f"key file {path} holds a {len(key)}-byte key; need at least {MIN_KEY_BYTES} bytes")
    return key


def _transcript(hello: Hello, server_name: str, server_nonce: bytes, tls_binding: bytes = b"") -> bytes:
    """Everything both sides said in the handshake, in one unambiguous encoding, plus the
    TLS channel binding when the stream is TLS-bound (see the module docstring)."""
    fields = [hello.nonce, server_nonce, hello.peer_name, server_name, hello.session_id, hello.stream_index,
              hello.num_streams]
    if tls_binding:
        fields.append(tls_binding)
    return msgpack.packb(fields, use_bin_type=True)


def tls_binding(sock: socket.socket) -> bytes:
    """The channel binding of a TLS 1.3 stream (b"" for plain TCP or older TLS: frames then
    keep their MAC tags). Both ends of one TLS connection get the same bytes.

    RFC 9266 names ``tls-exporter`` for TLS 1.3, where ``tls-unique`` is undefined. Python's
    ssl offers no keying-material exporter (``CHANNEL_BINDING_TYPES`` is ``['tls-unique']``),
    so this is OpenSSL's ``tls-unique``, the first Finished message: in TLS 1.3 an HMAC over
    the whole handshake transcript (both randoms and key shares, the certificates) under a
    key from that connection's (EC)DHE secret. A relay terminating TLS towards each side
    has two transcripts and two secrets, and cannot make the two Finished messages equal
    (the triple-handshake weakness of tls-unique needed TLS 1.2's resumption and RSA key
    exchange). docs/security.md says so too; tests/unit/kv_channel/test_wan_tls.py notices when
    Python offers the exporter."""
    if not isinstance(sock, ssl.SSLSocket) or sock.version() != "TLSv1.3":
        return b""
    return sock.get_channel_binding("tls-unique") or b""


def _proof(key: bytes, role: bytes, transcript: bytes) -> bytes:
    return hmac.new(key, role + transcript, hashlib.sha256).digest()


def derive_frame_keys(key: bytes, transcript: bytes) -> tuple[bytes, bytes]:
    """(client->server, server->client) frame-MAC keys (AES-256-GMAC) of one connection.

    HKDF-SHA256 (RFC 5869): extract with both nonces' transcript hash as salt over the
    shared key, expand once per direction. Fresh nonces from both sides make the keys
    unique to this connection: frames spliced in from another connection (or replayed
    from an earlier one) fail their tags.
    """
    prk = hmac.new(hashlib.sha256(transcript).digest(), key, hashlib.sha256).digest()

    def expand(label: bytes) -> bytes:
        return hmac.new(prk, b"pdkv frame mac v4 " + label + b"\x01", hashlib.sha256).digest()

    return expand(b"c2s"), expand(b"s2c")


@dataclass
class SecureStream:
    """An authenticated stream: the peer's name, its HELLO (server side) and the frame
    MACs to pass to ``send_frame(..., mac=send_mac)``; the reader already verifies.
    On a TLS-bound stream both MACs are None: TLS authenticates every record."""

    peer_name: str
    hello: Hello
    send_mac: Optional[FrameMac]
    recv_mac: Optional[FrameMac]

    @property
    def tls_bound(self) -> bool:
        return self.send_mac is None


def client_handshake(
    sock: socket.socket,
    key: bytes,
    name: str,
    session_id: bytes,
    stream_index: int,
    num_streams: int,
    reader: Optional[FrameReader] = None,
) -> SecureStream:
    """Authenticate to a server; from then on ``reader`` (made here if not given)
    verifies the server's frames. Raises HandshakeError (or ProtocolError, OSError)."""
    reader = reader if reader is not None else FrameReader(sock)
    hello = Hello(name, session_id, stream_index, num_streams, os.urandom(NONCE_BYTES))
    send_frame(sock, hello)
    msg, _ = reader.read_message()
    if isinstance(msg, Error):
        raise HandshakeError(f"server refused: {msg.reason}: {msg.detail}")
    if not isinstance(msg, HelloChallenge):
        raise HandshakeError(f"expected HELLO_CHALLENGE, got {type(msg).__name__}")
    binding = tls_binding(sock)
    transcript = _transcript(hello, msg.peer_name, msg.nonce, binding)
    if not hmac.compare_digest(msg.mac, _proof(key, b"server", transcript)):
        raise HandshakeError(f"server {msg.peer_name!r} failed to prove the shared key"
                        + (" on this TLS connection" if binding else ""))
    send_frame(sock, HelloAuth(_proof(key, b"client", transcript)))
    c2s, s2c = derive_frame_keys(key, transcript)
    reader.mac = None if binding else FrameMac(s2c)  # HELLO_OK is the server's first authenticated frame
    try:
        reply, _ = reader.read_message()
    except (ProtocolError, ConnectionClosed) as e:
        # A refusal is an unauthenticated ERROR and a close: it cannot pass the tag check.
        raise HandshakeError(f"server {msg.peer_name!r} did not accept our proof: {e}") from None
    if not isinstance(reply, HelloOk):
        raise HandshakeError(f"expected HELLO_OK, got {type(reply).__name__}")
    return SecureStream(msg.peer_name, hello, None if binding else FrameMac(c2s), reader.mac)


def server_handshake(sock: socket.socket, key: bytes, name: str, reader: FrameReader) -> SecureStream:
    """Authenticate a client; from then on ``reader`` verifies its frames.
    Raises HandshakeError or ProtocolError."""
    hello, _ = reader.read_message()
    if not isinstance(hello, Hello):
        raise ProtocolError(f"expected HELLO as first frame, got {type(hello).__name__}")
    if len(hello.nonce) != NONCE_BYTES or not (1 <= len(hello.session_id) <= 64):
        raise ProtocolError("HELLO: bad nonce or session id length")
    nonce = os.urandom(NONCE_BYTES)
    binding = tls_binding(sock)
    transcript = _transcript(hello, name, nonce, binding)
    send_frame(sock, HelloChallenge(name, nonce, _proof(key, b"server", transcript)))
    auth, _ = reader.read_message()
    if not isinstance(auth, HelloAuth):
        raise ProtocolError(f"expected HELLO_AUTH, got {type(auth).__name__}")
    if not hmac.compare_digest(auth.mac, _proof(key, b"client", transcript)):
        try:
            send_frame(sock, Error(-1, "auth", "HMAC check failed"))
        except OSError:
            pass
        raise HandshakeError(f"peer {hello.peer_name!r} failed HMAC authentication")
    c2s, s2c = derive_frame_keys(key, transcript)
    stream = SecureStream(hello.peer_name, hello, *((None, None) if binding else (FrameMac(s2c), FrameMac(c2s))))
    reader.mac = stream.recv_mac
    send_frame(sock, HelloOk(), mac=stream.send_mac)
    return stream
