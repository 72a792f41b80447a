"""WAN KV channel over real loopback sockets: data integrity, security and faults.

Kept light (small KV, short timeouts): the machine is shared and has two cores.
"""

import os
import socket
import threading
import time

import numpy as np
import pytest
from tests.support.waiting import wait_until

from tests.support.kv_raw_stream import RawStream
from sglang_pdd.kv_channel.layout import KvLayout, TransferPlan
from sglang_pdd.kv_channel.contract import FailureReason, RoomState
from sglang_pdd.launcher.wan_emulator import WanEmulator
from sglang_pdd.kv_channel.wan_receiver import WanKvReceiver
from sglang_pdd.kv_channel.wan_sender import WanKvSender
from sglang_pdd.kv_channel.wire import (
    PREFIX,
    VERSION,
    MAGIC,
    Ack,
    Chunk,
    Error,
    FrameReader,
    Hello,
    HelloAuth,
    HelloChallenge,
    MsgType,
    Nack,
    TransferBegin,
    TransferEnd,
    encode_frame,
    send_frame,
)

KEY = b"test-shared-key-0123456789abcdef"
pytestmark = pytest.mark.timeout(60)


def kv_for(layout: KvLayout, num_tokens: int, seed: int = 0) -> np.ndarray:
    pages = -(-num_tokens // layout.page_size)
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (layout.num_layers, pages, layout.bytes_per_page), dtype=np.uint8)


@pytest.fixture
def receiver():
    rx = WanKvReceiver(KEY, name="md", idle_timeout=2.0)
    yield rx
    rx.close()


def make_sender(addr, **kw):
    kw.setdefault("num_streams", 2)
    kw.setdefault("idle_timeout", 2.0)
    kw.setdefault("connect_timeout", 2.0)
    return WanKvSender(addr, kw.pop("key", KEY), name=kw.pop("name", "prefill"), **kw)


def raw_client(addr, name="raw", key=KEY) -> RawStream:
    """An authenticated stream we can write hand-crafted (correctly tagged) frames to."""
    return RawStream(addr, key, name)


def assert_closed(sock):
    """The server closed the stream (FIN, or RST if our unread bytes were pending)."""
    sock = getattr(sock, "sock", sock)
    sock.settimeout(5)
    try:
        assert sock.recv(100) == b""
    except ConnectionResetError:
        pass


def read_until(sock, cls, limit=20):
    reader = sock.reader if isinstance(sock, RawStream) else FrameReader(sock)
    for _ in range(limit):
        msg, _ = reader.read_message()
        if isinstance(msg, cls):
            return msg
    raise AssertionError(f"no {cls.__name__} received")


# ----------------------------------------------------------------------------- data path


@pytest.mark.parametrize(
    "num_streams, layers, page_size, bpp, tokens, prefix, chunk_bytes",
    [
        (1, 2, 16, 4096, 16 * 8, 0, 1 << 20),  # single stream, everything sent
        (4, 6, 16, 3000, 16 * 37 + 5, 16 * 5, 10_000),  # odd sizes, partial last page, many chunks
        (3, 4, 64, 65536, 64 * 40, 64 * 39, 1 << 20),  # MD holds all but the last page
    ],
)
def test_roundtrip_sends_only_missing_pages(receiver, num_streams, layers, page_size, bpp, tokens, prefix, chunk_bytes):
    layout = KvLayout(layers, page_size, bpp, "float16")
    kv = kv_for(layout, tokens, seed=num_streams)
    dest = np.zeros_like(kv)
    receiver.register_room(11, layout, tokens, dest, decode_prefix_len=prefix)
    tx = make_sender(receiver.address, num_streams=num_streams, max_chunk_bytes=chunk_bytes)
    try:
        xfer = tx.begin_transfer(11, layout, tokens, prefix, request_id="r11")
        assert xfer.send_kv(kv)
        assert xfer.wait(20) == RoomState.SUCCESS, xfer.failure_detail
        assert receiver.wait(11, 5) == RoomState.SUCCESS
        first = prefix // page_size
        assert np.array_equal(dest[:, first:], kv[:, first:])
        assert not dest[:, :first].any()  # MD's cached pages were never sent nor touched
        assert tx.poll(11) == RoomState.SUCCESS and tx.failure_reason(11) == ""
    finally:
        tx.close()


def test_callable_destination_and_pipelined_layers(receiver):
    layout = KvLayout(4, 16, 8192)
    tokens, prefix = 16 * 20, 16 * 3
    kv = kv_for(layout, tokens)
    writes = []
    got = np.zeros_like(kv)
    lock = threading.Lock()

    def write(layer_start, layer_count, page_start, page_count, payload):
        with lock:
            writes.append((layer_start, page_start, page_count))
            got[layer_start : layer_start + layer_count, page_start : page_start + page_count] = np.frombuffer(
                payload, np.uint8).reshape(layer_count, page_count, -1)

    receiver.register_room(5, layout, tokens, write, decode_prefix_len=prefix)
    tx = make_sender(receiver.address, max_chunk_bytes=5 * 8192)
    try:
        xfer = tx.begin_transfer(5, layout, tokens, prefix)
        for layer in range(layout.num_layers):  # layer by layer, as a model would produce them
            assert receiver.poll(5) in (RoomState.WAITING_FOR_INPUT, RoomState.TRANSFERRING)
            xfer.send_layer(layer, np.ascontiguousarray(kv[layer, 3:]))
            assert xfer.poll() in (RoomState.BOOTSTRAPPING, RoomState.TRANSFERRING)
        xfer.finish()
        assert xfer.wait(10) == RoomState.SUCCESS
        assert min(p for _, p, _ in writes) == 3
        assert sum(c for _, _, c in writes) == layout.num_layers * 17
        assert np.array_equal(got[:, 3:], kv[:, 3:])
    finally:
        tx.close()


def test_backpressure_bounds_queued_bytes(receiver):
    layout = KvLayout(8, 16, 64 * 1024)
    tokens = 16 * 16  # 8 layers x 1 MiB
    kv = kv_for(layout, tokens)
    receiver.register_room(1, layout, tokens, np.zeros_like(kv))
    with WanEmulator(receiver.address, rate_gbps=0.2) as emu:  # 25 MB/s
        tx = make_sender(emu.address, num_streams=2, max_chunk_bytes=256 * 1024, window_bytes=1 << 20)
        try:
            seen = []
            xfer = tx.begin_transfer(1, layout, tokens, 0)
            for layer in range(layout.num_layers):
                xfer.send_layer(layer, kv[layer])
                seen.append(tx.stats()["queued_bytes"])
            xfer.finish()
            assert xfer.wait(20) == RoomState.SUCCESS
            assert max(seen) <= 1 << 20
        finally:
            tx.close()


# ----------------------------------------------------------------------------- security


def test_wrong_key_refused_and_good_peer_still_served(receiver, monkeypatch):
    from sglang_pdd.kv_channel import wan_receiver

    real_handshake = wan_receiver.server_handshake

    slow = [True, True]  # the intruder's two streams

    def slow_to_refuse(*args, **kwargs):
        # As on a loaded machine: the receiver's thread counts the intruder's refusal a while
        # after the intruder gave up (it drops its connections itself on a bad server proof).
        try:
            return real_handshake(*args, **kwargs)
        except Exception:
            if slow.pop() if slow else False:
                time.sleep(1.0)
            raise

    monkeypatch.setattr(wan_receiver, "server_handshake", slow_to_refuse)
    layout = KvLayout(1, 16, 1024)
    receiver.register_room(3, layout, 32, bytearray(2048))
    bad = make_sender(receiver.address, key=b"not-the-key-not-the-key-00000000", name="intruder")
    try:
        xfer = bad.begin_transfer(3, layout, 32, 0)
        xfer.send_kv(bytearray(2048))
        assert xfer.wait(5) == RoomState.FAILED
        assert xfer.failure_reason == FailureReason.AUTH
    finally:
        bad.close()
    assert receiver.poll(3) == RoomState.WAITING_FOR_INPUT  # nothing was written or bound

    # A client that skips checking the server and answers with a wrong MAC is refused.
    with socket.create_connection(receiver.address) as s:
        send_frame(s, Hello("forger", os.urandom(16), 0, 1, os.urandom(32)))
        assert isinstance(read_until(s, HelloChallenge), HelloChallenge)
        send_frame(s, HelloAuth(os.urandom(32)))
        err = read_until(s, Error)
        assert (err.reason, err.detail) == (FailureReason.AUTH, "HMAC check failed")
        assert_closed(s)
    # A peer that knows nothing of the protocol is refused too.
    with socket.create_connection(receiver.address) as s:
        s.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 64)
        assert_closed(s)
    assert wait_until(lambda: receiver.stats()["auth_failures"] >= 3), receiver.stats()

    good = make_sender(receiver.address)
    try:
        data = bytearray(os.urandom(2048))
        assert good.begin_transfer(3, layout, 32, 0).send_kv(data)
        assert good.wait(3, 5) == RoomState.SUCCESS
    finally:
        good.close()


def test_malformed_and_oversized_frames_do_not_crash_server(receiver):
    for bad in (
        PREFIX.pack(MAGIC, VERSION, MsgType.CHUNK, 0, 16, 2**40),  # oversized payload
        PREFIX.pack(MAGIC, VERSION, MsgType.ACK, 0, 2**31, 0),  # oversized header
        PREFIX.pack(b"XXXX", VERSION, MsgType.ACK, 0, 4, 0),  # garbage
        PREFIX.pack(MAGIC, VERSION, MsgType.ACK, 0, 2, 0) + b"\xc1\xc1",  # bad msgpack (correctly tagged)
    ):
        with raw_client(receiver.address) as s:
            s.sendall(bad + s.tag(bad))
            err = read_until(s, Error)
            assert err.reason == FailureReason.PROTOCOL
            assert any(w in err.detail for w in ("exceeds limit", "bad magic", "msgpack")), err.detail
            assert_closed(s)  # stream closed after the framing is lost
    assert receiver.stats()["protocol_errors"] == 4
    test_wrong_room_rejected(receiver)  # still serving


def test_wrong_room_rejected(receiver):
    layout = KvLayout(2, 16, 1024)
    tx = make_sender(receiver.address)
    try:
        xfer = tx.begin_transfer(424242, layout, 64, 0)
        xfer.send_kv(bytearray(2 * 4 * 1024))
        assert xfer.wait(5) == RoomState.FAILED
        assert xfer.failure_reason == FailureReason.UNKNOWN_ROOM
        assert "not registered" in xfer.failure_detail
    finally:
        tx.close()
    assert receiver.stats()["unknown_room"] >= 1


def test_layout_mismatch_rejected(receiver):
    layout = KvLayout(2, 16, 1024)
    dest = np.zeros((2, 4, 1024), np.uint8)
    receiver.register_room(9, layout, 64, dest, decode_prefix_len=32)
    tx = make_sender(receiver.address)
    try:
        xfer = tx.begin_transfer(9, layout, 64, 16)  # sender thinks MD holds less than it does
        xfer.send_kv(np.ones_like(dest))
        assert xfer.wait(5) == RoomState.FAILED and xfer.failure_reason == FailureReason.LAYOUT_MISMATCH
        assert receiver.failure_reason(9) == FailureReason.LAYOUT_MISMATCH
        assert not dest[:, :2].any()  # never writes below decode_prefix_len
    finally:
        tx.close()


def _craft_room(rx, room, layout, tokens):
    dest = np.zeros((layout.num_layers, tokens // layout.page_size, layout.bytes_per_page), np.uint8)
    rx.register_room(room, layout, tokens, dest)
    plan = TransferPlan.build(layout, tokens, 0, max_chunk_bytes=layout.bytes_per_page)
    begin = TransferBegin(room, "", tokens, layout.page_size, 0, plan.end_page, layout.num_layers,
                          layout.bytes_per_page, layout.dtype, plan.num_chunks, b"")
    return dest, plan, begin


def test_duplicate_chunk_rejected_not_double_written(receiver):
    layout = KvLayout(1, 16, 1000)
    dest, plan, begin = _craft_room(receiver, 77, layout, 32)
    a, b = os.urandom(1000), os.urandom(1000)
    with raw_client(receiver.address) as s:
        s.send(begin)
        s.send(Chunk(77, 0, 0, 1, 0, 1), a)
        s.send(Chunk(77, 0, 0, 1, 0, 1), b)  # same index, other bytes
        err = read_until(s, Error)
        assert err.reason == "duplicate" and err.room == 77
        s.send(Chunk(77, 1, 0, 1, 0, 1), b)  # other index, same pages
        assert read_until(s, Error).reason == "duplicate"
        s.send(Chunk(77, 1, 0, 1, 1, 1), b)
        s.send(TransferEnd(77, 2, 2000))
        assert read_until(s, Ack).room == 77
    assert receiver.poll(77) == RoomState.SUCCESS
    assert bytes(dest[0, 0]) == a and bytes(dest[0, 1]) == b
    assert receiver.stats()["duplicate"] == 2


def test_chunk_whose_payload_does_not_match_its_tag_fails_room(receiver):
    """What the per-chunk CRC used to catch: payload bytes that are not the ones the sender
    tagged. The receiver never reports SUCCESS on them and closes the stream."""
    layout = KvLayout(1, 16, 1000)
    dest, plan, begin = _craft_room(receiver, 78, layout, 16)
    data = os.urandom(1000)
    with raw_client(receiver.address) as s:
        s.send(begin)
        head = encode_frame(Chunk(78, 0, 0, 1, 0, 1), len(data))
        tag_h, tag_p = s.secure.send_mac.seal(head, data)
        s.sendall(head + tag_h + bytes([data[0] ^ 1]) + data[1:] + tag_p)
        err = read_until(s, Error)
        assert (err.room, err.reason) == (-1, FailureReason.INTEGRITY) and "payload MAC mismatch" in err.detail
        assert_closed(s)
    assert receiver.wait(78, 5) == RoomState.FAILED and receiver.failure_reason(78) == FailureReason.INTEGRITY


def test_corrupted_chunk_on_the_wire_fails_both_sides(receiver):
    layout = KvLayout(2, 16, 512 * 1024)
    kv = kv_for(layout, 64)
    receiver.register_room(21, layout, 64, np.zeros_like(kv))
    with WanEmulator(receiver.address) as emu:
        tx = make_sender(emu.address, num_streams=1, max_chunk_bytes=1 << 20)
        try:
            assert tx.connect()
            emu.corrupt(count=1, after_bytes=100_000)  # lands inside the first chunk's payload
            xfer = tx.begin_transfer(21, layout, 64, 0)
            xfer.send_kv(kv)
            assert xfer.wait(10) == RoomState.FAILED
            # The frame MAC catches it (before the CRC would): the bytes were altered on the way.
            assert receiver.failure_reason(21) == FailureReason.INTEGRITY
            # The receiver's ERROR(integrity) may lose the race with the emulator closing both ends.
            assert xfer.failure_reason in (FailureReason.INTEGRITY, FailureReason.CONNECTION_LOST)
        finally:
            tx.close()


# ----------------------------------------------------------------------------- faults


def _slow_transfer(receiver, emu_kw, room, sender_kw=None):
    layout = KvLayout(4, 16, 256 * 1024)
    kv = kv_for(layout, 16 * 8)  # 8 MiB
    receiver.register_room(room, layout, 16 * 8, np.zeros_like(kv))
    emu = WanEmulator(receiver.address, **emu_kw).start()
    tx = make_sender(emu.address, max_chunk_bytes=256 * 1024, **(sender_kw or {}))
    xfer = tx.begin_transfer(room, layout, 16 * 8, 0)
    threading.Thread(target=xfer.send_kv, args=(kv,), daemon=True).start()
    deadline = time.monotonic() + 5
    while receiver.poll(room) != RoomState.TRANSFERRING and time.monotonic() < deadline:
        time.sleep(0.02)
    return emu, tx, xfer


def test_reset_fails_both_sides(receiver):
    emu, tx, xfer = _slow_transfer(receiver, dict(rate_gbps=0.05), room=31)
    try:
        assert emu.reset() >= 1
        assert xfer.wait(5) == RoomState.FAILED
        assert xfer.failure_reason == FailureReason.CONNECTION_LOST
        assert receiver.wait(31, 5) == RoomState.FAILED
        assert receiver.failure_reason(31) == FailureReason.CONNECTION_LOST
    finally:
        tx.close()
        emu.stop()


def test_stall_past_idle_timeout_fails_both_sides(receiver):
    receiver.idle_timeout = 0.6
    emu, tx, xfer = _slow_transfer(receiver, dict(rate_gbps=0.1), room=32, sender_kw=dict(idle_timeout=0.6))
    try:
        emu.stall(30)
        assert xfer.wait(10) == RoomState.FAILED
        assert xfer.failure_reason == FailureReason.IDLE_TIMEOUT
        assert receiver.wait(32, 10) == RoomState.FAILED
        assert receiver.failure_reason(32) in (FailureReason.IDLE_TIMEOUT, FailureReason.CONNECTION_LOST)
    finally:
        tx.close()
        emu.stop()


def test_transfer_deadline(receiver):
    layout = KvLayout(2, 16, 1024)
    receiver.register_room(33, layout, 32, bytearray(4096), timeout=0.5)
    tx = make_sender(receiver.address)
    try:
        xfer = tx.begin_transfer(33, layout, 32, 0, timeout=0.5)
        xfer.send_layer(0, bytearray(2048))  # the producer never sends layer 1
        assert xfer.wait(5) == RoomState.FAILED and xfer.failure_reason in (
            FailureReason.TIMEOUT, FailureReason.ABORTED)
        assert receiver.wait(33, 5) == RoomState.FAILED
        assert receiver.failure_reason(33) in (FailureReason.TIMEOUT, FailureReason.ABORTED)
    finally:
        tx.close()


def test_dropped_sender_and_restarted_sender(receiver):
    layout = KvLayout(2, 16, 1024)
    receiver.register_room(41, layout, 32, bytearray(4096))
    receiver.register_room(42, layout, 32, bytearray(4096))
    old = make_sender(receiver.address, name="prefill-0", instance="i0")
    xfer = old.begin_transfer(41, layout, 32, 0)
    xfer.send_layer(0, bytearray(2048))  # half done
    deadline = time.monotonic() + 5
    while receiver.poll(41) != RoomState.TRANSFERRING and time.monotonic() < deadline:
        time.sleep(0.01)
    # The same sender identity comes back with a new session, old sockets left open.
    # (Identities are unique per sender object unless ``instance`` is given, so this
    # needs the explicit instance; see test_kv_validation for two hosts sharing a name.)
    new = make_sender(receiver.address, name="prefill-0", instance="i0")
    try:
        ok = new.begin_transfer(42, layout, 32, 0)
        ok.send_kv(bytearray(os.urandom(4096)))
        assert ok.wait(5) == RoomState.SUCCESS
        assert receiver.poll(41) == RoomState.FAILED
        assert receiver.failure_reason(41) == FailureReason.PEER_RESTARTED
        assert xfer.wait(5) == RoomState.FAILED  # the old sender sees its connection closed
    finally:
        old.close()
        new.close()


def test_restarted_receiver_accepts_new_transfer():
    layout = KvLayout(2, 16, 1024)
    rx = WanKvReceiver(KEY, idle_timeout=2)
    port = rx.address[1]
    rx.register_room(51, layout, 32, bytearray(4096))
    tx = make_sender(rx.address)
    try:
        xfer = tx.begin_transfer(51, layout, 32, 0)
        xfer.send_layer(0, bytearray(2048))
        assert wait_until(lambda: rx.bytes_received(51) == 2048)
        rx.close()  # the MD process dies mid-transfer
        assert xfer.wait(5) == RoomState.FAILED
        assert xfer.failure_reason == FailureReason.CONNECTION_LOST
        rx = WanKvReceiver(KEY, port=port)  # ...and comes back on the same port
        dest = bytearray(4096)
        rx.register_room(52, layout, 32, dest)
        data = os.urandom(4096)
        xfer2 = tx.begin_transfer(52, layout, 32, 0)
        xfer2.send_kv(data)
        assert xfer2.wait(5) == RoomState.SUCCESS and bytes(dest) == data
    finally:
        tx.close()
        rx.close()


def test_receiver_abort_reaches_sender(receiver):
    layout = KvLayout(2, 16, 1024)
    receiver.register_room(61, layout, 32, bytearray(4096))
    tx = make_sender(receiver.address)
    try:
        xfer = tx.begin_transfer(61, layout, 32, 0)
        xfer.send_layer(0, bytearray(2048))
        deadline = time.monotonic() + 5
        while receiver.poll(61) != RoomState.TRANSFERRING and time.monotonic() < deadline:
            time.sleep(0.01)
        receiver.release_room(61)  # e.g. RLD already finished the request
        assert xfer.wait(5) == RoomState.FAILED and xfer.failure_reason == FailureReason.ABORTED
        assert not xfer.send_layer(1, bytearray(2048))  # the producer learns it can stop
    finally:
        tx.close()


def _fds():
    return len(os.listdir("/proc/self/fd"))


def test_no_thread_or_socket_leaks():
    layout = KvLayout(2, 16, 4096)
    threads0, fds0 = threading.active_count(), _fds()
    for _ in range(2):
        rx = WanKvReceiver(KEY)
        tx = make_sender(rx.address, num_streams=4)
        for room in range(3):
            rx.register_room(room, layout, 64, bytearray(2 * 4 * 4096))
            tx.begin_transfer(room, layout, 64, 0).send_kv(bytearray(2 * 4 * 4096))
            assert tx.wait(room, 5) == RoomState.SUCCESS
        tx.close()
        rx.close()
    deadline = time.monotonic() + 5
    while (threading.active_count() > threads0 or _fds() > fds0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() == threads0, [t.name for t in threading.enumerate()]
    assert _fds() <= fds0


def test_intra_dc_fallback_choice(monkeypatch):
    from sglang_pdd.kv_channel import fallback

    monkeypatch.setattr(fallback, "mooncake_available", lambda: False)
    assert fallback.intra_dc_transport() == "tcp"
    with pytest.raises(fallback.TransportUnavailable, match="not installed"):
        fallback.intra_dc_transport("mooncake")
    monkeypatch.setattr(fallback, "mooncake_available", lambda: True)
    assert fallback.intra_dc_transport() == "mooncake"
    assert fallback.intra_dc_transport("mooncake") == "mooncake"
    assert fallback.intra_dc_transport("tcp") == "tcp"
    with pytest.raises(ValueError, match="one of"):
        fallback.intra_dc_transport("rdma")


def test_tls_optional(tmp_path):
    import shutil
    import ssl
    import subprocess

    if not shutil.which("openssl") and not os.environ.get("CI"):  # setup installs it; CI must not skip
        pytest.skip("openssl CLI not available to make a test certificate")
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key),
                    "-out", str(cert)], check=True, capture_output=True)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.create_default_context(cafile=str(cert))
    rx = WanKvReceiver(KEY, ssl_context=server_ctx)
    tx = make_sender(rx.address, ssl_context=client_ctx)
    try:
        layout = KvLayout(2, 16, 4096)
        dest = bytearray(2 * 2 * 4096)
        data = os.urandom(len(dest))
        rx.register_room(1, layout, 32, dest)
        tx.begin_transfer(1, layout, 32, 0).send_kv(data)
        assert tx.wait(1, 10) == RoomState.SUCCESS and bytes(dest) == data
    finally:
        tx.close()
        rx.close()


# ----------------------------------------------------------------------------- row slices (P with TP > 1)


def _slice_of(kv: np.ndarray, layout: KvLayout, offset: int, width: int) -> np.ndarray:
    """Bytes [offset, offset + width) of every token row: what one P rank holds of the KV."""
    pages = kv.shape[1]
    rows = kv.reshape(layout.num_layers, pages, layout.page_size, layout.token_bytes)
    return np.ascontiguousarray(rows[..., offset:offset + width]).reshape(layout.num_layers, pages, -1)


@pytest.mark.parametrize("destination", ["buffer", "callable"])
def test_row_slices_from_two_senders_tile_the_room(receiver, destination):
    """Two P ranks, each moving its heads' bytes of every row, fill one MD room; each gets
    the ACK of its own part, and the room is SUCCESS only after both."""
    from sglang_pdd.kv_channel.layout import RowSlice

    layout = KvLayout(4, 16, 16 * 96, "bfloat16")  # 96-byte rows: 64 + 32
    tokens, prefix = 16 * 6 + 3, 16 * 2
    kv = kv_for(layout, tokens, seed=3)
    got = np.zeros_like(kv)
    rows = got.reshape(4, -1, 16, 96)
    lock = threading.Lock()

    def write(layer_start, layer_count, page_start, page_count, payload, row=None):
        with lock:  # the row slice arrives strided: (offset, width) of each token row
            offset, width = row
            rows[layer_start:layer_start + layer_count, page_start:page_start + page_count, :, offset:offset + width] = \
                np.frombuffer(payload, np.uint8).reshape(layer_count, page_count, 16, width)

    receiver.register_room(7, layout, tokens, got if destination == "buffer" else write, decode_prefix_len=prefix)
    parts = [RowSlice(0, 2, 0, 64), RowSlice(1, 2, 64, 32)]
    senders = [make_sender(receiver.address, name=f"prefill-tp{i}", max_chunk_bytes=3 * 16 * 64) for i in range(2)]
    try:
        xfers = [tx.begin_transfer(7, layout, tokens, prefix, row=part) for tx, part in zip(senders, parts)]
        assert xfers[0].send_kv(_slice_of(kv, layout, 0, 64))
        sent = (-(-tokens // 16) - prefix // 16) * 16 * 64 * layout.num_layers  # slice 0, pages past the prefix
        assert wait_until(lambda: receiver.bytes_received(7) == sent)
        assert receiver.poll(7) != RoomState.SUCCESS  # one slice alone does not make the room
        assert xfers[1].send_kv(_slice_of(kv, layout, 64, 32))
        assert [x.wait(20) for x in xfers] == [RoomState.SUCCESS] * 2, [x.failure_detail for x in xfers]
        assert receiver.wait(7, 5) == RoomState.SUCCESS
        first = prefix // 16
        assert np.array_equal(got[:, first:], kv[:, first:]) and not got[:, :first].any()
    finally:
        for tx in senders:
            tx.close()


@pytest.mark.parametrize("second, why", [
    ((1, 2, 48, 48), "overlap slice 0's [0, 64)"),  # bytes 48..63 claimed twice
    ((1, 3, 64, 32), "slice count 3"),  # the senders disagree on how many slices there are
    ((1, 2, 64, 16), "cover 80 of 96 bytes"),  # two slices that leave bytes 80..95 out
])
def test_bad_row_slices_fail_the_room_naming_the_problem(receiver, second, why):
    from sglang_pdd.kv_channel.layout import RowSlice

    layout = KvLayout(2, 16, 16 * 96, "bfloat16")
    kv = kv_for(layout, 64, seed=4)
    receiver.register_room(8, layout, 64, np.zeros_like(kv))
    senders = [make_sender(receiver.address, name=f"prefill-tp{i}") for i in range(2)]
    try:
        first = senders[0].begin_transfer(8, layout, 64, row=RowSlice(0, 2, 0, 64))
        first.send_kv(_slice_of(kv, layout, 0, 64))
        # slice 0's frames first, so the failure is the second sender's
        assert wait_until(lambda: receiver.bytes_received(8) == 64 * layout.num_layers * 64)
        other = RowSlice(*second)
        senders[1].begin_transfer(8, layout, 64, row=other).send_kv(_slice_of(kv, layout, other.offset, other.width))
        assert receiver.wait(8, 10) == RoomState.FAILED
        reason, detail = receiver.failure(8)
        assert reason == FailureReason.LAYOUT_MISMATCH and why in detail, detail
        assert first.wait(10) == RoomState.FAILED  # both senders hear of it (NACK)
    finally:
        for tx in senders:
            tx.close()


def test_a_row_slice_outside_the_row_is_refused_by_the_sender():
    from sglang_pdd.kv_channel.layout import RowSlice

    tx = WanKvSender(("127.0.0.1", 9), KEY, name="p", connect_timeout=0.5)
    try:
        with pytest.raises(ValueError, match=r"row bytes \[64, 128\) outside a 96-byte token row"):
            tx.begin_transfer(1, KvLayout(2, 16, 16 * 96), 32, row=RowSlice(1, 2, 64, 64))
    finally:
        tx.close()
