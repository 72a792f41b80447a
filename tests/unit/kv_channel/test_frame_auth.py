"""Every frame after the handshake is authenticated (wire.FrameMac, handshake.derive_frame_keys).

The attack this closes: a relay on the WAN path that does not know the key
rewrote KV bytes inside a CHUNK, fixed up its CRC-32, and both ends reported SUCCESS.
"""

import os
import socket
import threading

import numpy as np
import pytest

from sglang_pdd.kv_channel import wire
from sglang_pdd.kv_channel.layout import KvLayout
from sglang_pdd.kv_channel.contract import FailureReason, RoomState
from sglang_pdd.kv_channel.wan_receiver import WanKvReceiver
from sglang_pdd.kv_channel.wan_sender import WanKvSender
from sglang_pdd.kv_channel.wire import PREFIX, PREFIX_SIZE, Ack, Chunk, FrameReader, MsgType, send_frame

KEY = b"frame-auth-test-key-0123456789abcdef"
pytestmark = pytest.mark.timeout(60)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            raise ConnectionError("closed")
        buf += got
    return bytes(buf)


class RewritingRelay:
    """A keyless man in the middle on loopback: forwards both directions, and in the
    sender -> receiver direction flips a byte in the first ``limit`` CHUNK payloads (it
    knows the public frame format, not the key; frames carry no checksum it could fix up)."""

    def __init__(self, target, limit: int = 1):
        self.target = target
        self.limit = limit
        self.rewritten = 0
        self.tag = getattr(wire, "TAG_BYTES", 0)  # tags are forwarded as they are: it cannot make new ones
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            self.socks += [client, server]
            threading.Thread(target=self._client_to_server, args=(client, server), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client), daemon=True).start()

    def _pipe(self, src, dst) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _client_to_server(self, src, dst) -> None:
        try:
            while True:
                prefix = _recv_exact(src, PREFIX_SIZE)
                magic, version, mtype, reserved, hlen, plen = PREFIX.unpack(prefix)
                header = _recv_exact(src, hlen)
                tagged = mtype not in (MsgType.HELLO, MsgType.HELLO_AUTH)  # the handshake's own frames
                tag_h = _recv_exact(src, self.tag) if tagged else b""
                payload = _recv_exact(src, plen)
                tag_p = _recv_exact(src, self.tag) if tagged and plen else b""
                if mtype == MsgType.CHUNK and self.rewritten < self.limit:
                    payload = bytearray(payload)
                    payload[len(payload) // 2] ^= 0x5A
                    self.rewritten += 1
                dst.sendall(prefix + header + tag_h + bytes(payload) + tag_p)
        except (OSError, ConnectionError):
            pass
        finally:  # half-close: the receiver's last words (its ERROR) still reach the sender
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def close(self) -> None:
        self.listener.close()
        for s in self.socks:
            s.close()


def test_keyless_relay_rewriting_a_chunk_fails_the_room_on_both_sides():
    layout = KvLayout(2, 16, 4096)
    tokens = 16 * 4
    kv = np.random.default_rng(1).integers(0, 256, (2, 4, 4096), dtype=np.uint8)
    dest = np.zeros_like(kv)
    rx = WanKvReceiver(KEY, name="md", idle_timeout=5.0)
    relay = RewritingRelay(rx.address)
    tx = WanKvSender(relay.address, KEY, name="p", num_streams=1, idle_timeout=5.0)
    try:
        rx.register_room(5, layout, tokens, dest)
        xfer = tx.begin_transfer(5, layout, tokens, 0)
        xfer.send_kv(kv)
        assert rx.wait(5, 10) == RoomState.FAILED
        assert xfer.wait(10) == RoomState.FAILED
        assert relay.rewritten == 1  # the attack did happen
        reason, detail = rx.failure(5)
        assert reason == FailureReason.INTEGRITY and "CHUNK frame" in detail and "MAC mismatch" in detail
        assert xfer.failure_reason == FailureReason.INTEGRITY
        assert rx.poll(5) != RoomState.SUCCESS and rx.stats()["integrity_failures"] == 1
    finally:
        tx.close()
        rx.close()
        relay.close()


# ----------------------------------------------------------------------------- frame level


@pytest.fixture
def authed_pair():
    """Two connected sockets, one FrameMac key per direction, a verifying reader on b."""
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    key = os.urandom(32)
    reader = FrameReader(b)
    reader.mac = wire.FrameMac(key)
    yield a, reader, wire.FrameMac(key)
    a.close()
    b.close()


def _frames(mac, payload=b"kv" * 3000):
    """Three tagged frames as the bytes a sender would write."""
    out = []
    for msg, p in [(Chunk(1, 0, 0, 1, 0, 1), payload), (Ack(1, 2), None), (Chunk(1, 1, 0, 1, 1, 1), payload)]:
        head = wire.encode_frame(msg, len(p) if p else 0)
        tag_h, tag_p = mac.seal(head, p)
        out.append(head + tag_h + (p or b"") + tag_p)
    return out


def _read_all(reader, n):
    for _ in range(n):
        _, plen = reader.read_message()
        if plen:
            reader.read_payload()


def test_untouched_tagged_frames_verify(authed_pair):
    a, reader, mac = authed_pair
    def send():  # large payload: a separate sendall, which blocks until we read
        send_frame(a, Chunk(1, 0, 0, 1, 0, 1), b"x" * 100_000, mac=mac)
        send_frame(a, Ack(1, 2), mac=mac)

    t = threading.Thread(target=send)
    t.start()
    msg, plen = reader.read_message()
    assert isinstance(msg, Chunk) and bytes(reader.read_payload()) == b"x" * 100_000
    assert reader.read_message()[0] == Ack(1, 2)
    t.join(5)


@pytest.mark.parametrize("flip", [None, 10, 150_000, 299_999])
def test_payload_read_in_pieces_verifies_like_one_piece(authed_pair, flip):
    """A payload read in pieces (GCM's incremental path) carries the same tag as one read
    whole (one-shot path); a flipped byte in any piece fails it."""
    a, reader, mac = authed_pair
    payload = os.urandom(300_000)
    head = wire.encode_frame(Chunk(1, 0, 0, 1, 0, 1), len(payload))
    tag_h, tag_p = mac.seal(head, payload)
    wire_payload = bytearray(payload)
    if flip is not None:
        wire_payload[flip] ^= 1
    t = threading.Thread(target=a.sendall, args=(head + tag_h + bytes(wire_payload) + tag_p,))
    t.start()
    reader.read_message()
    dest = memoryview(bytearray(len(payload)))
    for lo, hi in ((0, 100), (100, 200_000), (200_000, 300_000)):
        if hi < len(payload) or flip is None:
            reader.read_payload_into(dest[lo:hi])
        else:
            with pytest.raises(wire.IntegrityError, match="payload MAC mismatch"):
                reader.read_payload_into(dest[lo:hi])
    t.join(5)
    if flip is None:
        assert bytes(dest) == payload


@pytest.mark.parametrize("attack", ["payload_byte", "header_byte", "drop", "replay", "reorder", "untagged"])
def test_altered_dropped_replayed_reordered_or_injected_frames_are_refused(authed_pair, attack):
    a, reader, mac = authed_pair
    f = _frames(mac)
    if attack == "payload_byte":
        bad = bytearray(f[0])
        bad[len(bad) // 2] ^= 1
        stream = [bytes(bad)]
    elif attack == "header_byte":
        bad = bytearray(f[1])
        bad[PREFIX_SIZE + 1] ^= 1  # Ack.room 1 -> 0: still valid msgpack
        stream = [f[0], bytes(bad)]
    elif attack == "drop":
        stream = [f[0], f[2]]
    elif attack == "replay":
        stream = [f[0], f[0]]
    elif attack == "reorder":
        stream = [f[1], f[0]]
    else:  # a frame injected without tags, then the real ones
        stream = [wire.encode_frame(Ack(9, 9)) + b"\0" * wire.TAG_BYTES, *f]
    a.sendall(b"".join(stream))
    with pytest.raises(wire.IntegrityError, match="MAC mismatch"):
        _read_all(reader, len(stream))


def test_frame_keys_are_bound_to_the_connection_and_direction():
    from sglang_pdd.kv_channel.handshake import _transcript, derive_frame_keys
    from sglang_pdd.kv_channel.wire import Hello

    hello = Hello("p", b"s" * 16, 0, 1, b"n" * 32)
    c2s, s2c = derive_frame_keys(KEY, _transcript(hello, "md", b"m" * 32))
    other = derive_frame_keys(KEY, _transcript(hello, "md", b"M" * 32))  # another server nonce
    assert c2s != s2c and len(c2s) == len(s2c) == 32
    assert set(other).isdisjoint({c2s, s2c})
    assert derive_frame_keys(b"x" * 32, _transcript(hello, "md", b"m" * 32))[0] != c2s
