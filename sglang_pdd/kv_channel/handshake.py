"""Mutual authentication of a stream: HMAC-SHA256 challenge-response on a shared key.

    client                                   server
    HELLO(name_c, session, stream, nonce_c) ->
                                          <- HELLO_CHALLENGE(name_s, nonce_s, mac_s)
    verify mac_s
    HELLO_AUTH(mac_c)                      ->
                                             verify mac_c
                                          <- HELLO_OK   (or ERROR + close)

    mac_s = HMAC(key, "server" | nonce_c | nonce_s | name_c | name_s | session | stream)
    mac_c = HMAC(key, "client" | ...same...)

Both sides prove knowledge of the key over fresh nonces, so neither a wrong-key peer
nor a replayed handshake gets in; the role tag stops a reflection of the server's
proof. This authenticates the peer; it does not encrypt or MAC every frame (at 10+
Gbps that costs more than a core). For confidentiality and integrity against an
active attacker on the WAN, pass an ``ssl.SSLContext`` to sender and receiver (TLS).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import stat

import msgpack

from .wire import FrameReader, Hello, HelloAuth, HelloChallenge, HelloOk, Error, ProtocolError, send_frame

NONCE_BYTES = 32
MIN_KEY_BYTES = 32  # 256 bits: the session keys derived from it are HMAC-SHA256 keys


class AuthError(Exception):
    """The peer failed to authenticate (wrong key, or not speaking the protocol)."""


class KeyFileError(ValueError):
    """A key file that must not be used (unreadable, readable by others, too short)."""


def check_key(key: bytes) -> bytes:
    if not isinstance(key, (bytes, bytearray)) or len(key) < MIN_KEY_BYTES:
        got = len(key) if isinstance(key, (bytes, bytearray)) else type(key).__name__
        raise ValueError(f"auth key must be at least {MIN_KEY_BYTES} bytes (got {got})")
    return bytes(key)


def load_key(path) -> bytes:
    """The shared key in ``path`` (its bytes, surrounding whitespace stripped).

    Refused with a :class:`KeyFileError` naming the file: a file that group or others
    may read (``chmod 600`` it: anyone who reads the key can impersonate P or MD) and a
    key shorter than ``MIN_KEY_BYTES``. ``secrets.token_hex(32)`` makes a good one.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise KeyFileError(f"key file {path}: cannot open: {e.strerror}") from None
    try:
        st = os.fstat(fd)  # of the opened file: no window between the check and the read
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileError(f"key file {path}: not a regular file")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise KeyFileError(f"key file {path} has mode {mode:04o}: group/others may access it; "
                               f"run chmod 600 {path}")
        with os.fdopen(os.dup(fd), "rb") as f:
            key = f.read(1 << 16).strip()
    finally:
        os.close(fd)
    if len(key) < MIN_KEY_BYTES:
        raise KeyFileError(f"key file {path} holds a {len(key)}-byte key; need at least {MIN_KEY_BYTES} bytes")
    return key


def _proof(key: bytes, role: bytes, hello: Hello, server_name: str, server_nonce: bytes) -> bytes:
    transcript = msgpack.packb(
        [role, hello.nonce, server_nonce, hello.peer_name, server_name, hello.session_id, hello.stream_index],
        use_bin_type=True,
    )
    return hmac.new(key, transcript, hashlib.sha256).digest()


def client_handshake(
    sock: socket.socket,
    key: bytes,
    name: str,
    session_id: bytes,
    stream_index: int,
    num_streams: int,
) -> str:
    """Authenticate to a server; returns the server's name. Raises AuthError."""
    reader = FrameReader(sock)
    hello = Hello(name, session_id, stream_index, num_streams, os.urandom(NONCE_BYTES))
    send_frame(sock, hello)
    msg, _ = reader.read_message()
    if isinstance(msg, Error):
        raise AuthError(f"server refused: {msg.reason}: {msg.detail}")
    if not isinstance(msg, HelloChallenge):
        raise AuthError(f"expected HELLO_CHALLENGE, got {type(msg).__name__}")
    if not hmac.compare_digest(msg.mac, _proof(key, b"server", hello, msg.peer_name, msg.nonce)):
        raise AuthError(f"server {msg.peer_name!r} failed to prove the shared key")
    send_frame(sock, HelloAuth(_proof(key, b"client", hello, msg.peer_name, msg.nonce)))
    reply, _ = reader.read_message()
    if isinstance(reply, Error):
        raise AuthError(f"server refused: {reply.reason}: {reply.detail}")
    if not isinstance(reply, HelloOk):
        raise AuthError(f"expected HELLO_OK, got {type(reply).__name__}")
    return msg.peer_name


def server_handshake(sock: socket.socket, key: bytes, name: str, reader: FrameReader) -> Hello:
    """Authenticate a client; returns its HELLO. Raises AuthError or ProtocolError."""
    hello, _ = reader.read_message()
    if not isinstance(hello, Hello):
        raise ProtocolError(f"expected HELLO as first frame, got {type(hello).__name__}")
    if len(hello.nonce) != NONCE_BYTES or not (1 <= len(hello.session_id) <= 64):
        raise ProtocolError("HELLO: bad nonce or session id length")
    nonce = os.urandom(NONCE_BYTES)
    send_frame(sock, HelloChallenge(name, nonce, _proof(key, b"server", hello, name, nonce)))
    auth, _ = reader.read_message()
    if not isinstance(auth, HelloAuth):
        raise ProtocolError(f"expected HELLO_AUTH, got {type(auth).__name__}")
    if not hmac.compare_digest(auth.mac, _proof(key, b"client", hello, name, nonce)):
        try:
            send_frame(sock, Error(-1, "auth", "HMAC check failed"))
        except OSError:
            pass
        raise AuthError(f"peer {hello.peer_name!r} failed HMAC authentication")
    send_frame(sock, HelloOk())
    return hello
