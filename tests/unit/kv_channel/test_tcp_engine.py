"""TcpTransferEngine: one-sided writes over authenticated TCP, real sockets on 127.0.0.1
and real host memory (numpy arrays, addressed by pointer like SGLang's KV pools)."""

from __future__ import annotations

import logging
import re
import socket
import struct
import threading
import time

import numpy as np
import pytest

from tests.support.kv_raw_stream import RawStream
from sglang_pdd.kv_channel import tcp_engine
from sglang_pdd.kv_channel.handshake import server_handshake
from sglang_pdd.kv_channel.tcp_engine import (
    ERR_CLOSED,
    ERR_CONNECT,
    ERR_INVALID,
    ERR_IO,
    ERR_REJECTED,
    TcpTransferEngine,
)
from sglang_pdd.kv_channel.wire import (
    Error,
    FrameReader,
    Hello,
    HelloAuth,
    HelloChallenge,
    MemCommit,
    MemWrite,
    MemWriteAck,
    checksum,
    send_frame,
)

KEY = b"k" * 32
WRONG_KEY = b"w" * 32
LOG = "sglang_pdd.kv_channel.tcp_engine"

pytestmark = pytest.mark.timeout(60)


def ptr(a: np.ndarray, offset: int = 0) -> int:
    return a.ctypes.data + offset


def random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def wait_for_log(caplog, pattern: str, timeout: float = 5.0) -> str:
    """Server threads log asynchronously; poll until a record matches."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for rec in caplog.records:
            if re.search(pattern, rec.getMessage()):
                return rec.getMessage()
        time.sleep(0.01)
    raise AssertionError(f"no log record matching {pattern!r}: {[r.getMessage() for r in caplog.records]}")


@pytest.fixture
def engines():
    made = []

    def make(key: bytes = KEY, **kw) -> TcpTransferEngine:
        e = TcpTransferEngine("127.0.0.1", key, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


@pytest.fixture
def pair(engines):
    """Sender with a registered 64 KiB random source; receiver with a 3x16 KiB zeroed
    backing array of which only the middle 16 KiB (``reg``) is registered."""
    src = random_bytes(64 * 1024)
    backing = np.zeros(3 * 16 * 1024, dtype=np.uint8)
    a, b = engines(name="sender"), engines(name="receiver")
    assert a.batch_register([ptr(src)], [src.nbytes]) == 0
    assert b.batch_register([ptr(backing, 16 * 1024)], [16 * 1024]) == 0
    return a, b, src, backing


def raw_client(engine: TcpTransferEngine, key: bytes = KEY) -> tuple[RawStream, FrameReader]:
    """An authenticated stream to the engine, to send hand-built (correctly tagged) frames."""
    stream = RawStream(("127.0.0.1", engine.port), key, "raw", b"raw-session")
    return stream, stream.reader


def assert_closed_by_peer(sock) -> None:
    sock = getattr(sock, "sock", sock)
    sock.settimeout(5)
    try:
        assert sock.recv(1) == b""
    except ConnectionResetError:
        pass


# ---------------------------------------------------------------------------- happy path


def test_batch_write_lands_byte_exact(pair):
    a, b, src, backing = pair
    src_before = src.copy()
    assert re.fullmatch(r"127\.0\.0\.1:\d+", b.get_session_id())
    assert b.get_session_id() == f"127.0.0.1:{b.port}" and b.port > 0
    base = 16 * 1024
    writes = [(0, 0, 100), (1000, 4096, 3000), (50_000, 16 * 1024 - 7, 7), (7, 200, 1)]  # (src off, dst off, n)
    rc = a.batch_transfer_sync(
        b.get_session_id(),
        [ptr(src, s) for s, _, _ in writes],
        [ptr(backing, base + d) for _, d, _ in writes],
        [n for _, _, n in writes],
    )
    assert rc == 0
    expected = np.zeros_like(backing)
    for s, d, n in writes:
        expected[base + d : base + d + n] = src[s : s + n]
    assert np.array_equal(backing, expected)
    assert np.array_equal(src, src_before)
    # single write, and an empty batch, on the same (pooled) connection
    assert a.transfer_sync(b.get_session_id(), ptr(src, 9), ptr(backing, base + 9000), 500) == 0
    assert np.array_equal(backing[base + 9000 : base + 9500], src[9:509])
    assert a.batch_transfer_sync(b.get_session_id(), [], [], []) == 0
    assert a.send_probe(b.get_session_id()) == 0


def test_large_write_is_split_and_lands_intact(engines):
    # Both sides limit a frame to 4 KiB: the receiver would refuse an unsplit frame.
    a, b = engines(max_write_bytes=4096), engines(max_write_bytes=4096)
    src, dst = random_bytes(100_003, seed=1), np.zeros(100_003, dtype=np.uint8)
    assert a.batch_register([ptr(src)], [src.nbytes]) == 0 and b.batch_register([ptr(dst)], [dst.nbytes]) == 0
    assert a.transfer_sync(b.get_session_id(), ptr(src), ptr(dst), src.nbytes) == 0
    assert np.array_equal(dst, src)


def test_concurrent_batches_to_the_same_peer(engines):
    a, b = engines(num_streams=2), engines()
    n_threads, batches, writes, size = 4, 5, 16, 256
    src = random_bytes(n_threads * batches * writes * size, seed=2)
    dst = np.zeros_like(src)
    assert a.batch_register([ptr(src)], [src.nbytes]) == 0 and b.batch_register([ptr(dst)], [dst.nbytes]) == 0
    results = []

    def worker(t: int) -> None:
        for k in range(batches):
            # interleaved slices so neighbouring threads write neighbouring bytes
            offs = [((w * batches + k) * n_threads + t) * size for w in range(writes)]
            results.append(a.batch_transfer_sync(
                b.get_session_id(), [ptr(src, o) for o in offs], [ptr(dst, o) for o in offs], [size] * writes))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [0] * (n_threads * batches)
    assert np.array_equal(dst, src)


# ---------------------------------------------------------------------------- memory safety


@pytest.mark.parametrize(
    "dst_off, n",
    [(16 * 1024 - 1, 10), (32 * 1024 - 4, 8), (0, 8), (40 * 1024, 8)],
    ids=["straddles-start", "straddles-end", "before", "after"],
)
def test_write_outside_registered_memory_is_rejected(pair, caplog, dst_off, n):
    a, b, src, backing = pair
    caplog.set_level(logging.WARNING, logger=LOG)
    rc = a.transfer_sync(b.get_session_id(), ptr(src), ptr(backing, dst_off), n)
    assert rc == ERR_REJECTED
    assert not backing.any()
    addr = ptr(backing, dst_off)
    wait_for_log(caplog, rf"rejected by the peer.*write \[0x{addr:x},\+{n}\) outside registered memory")
    # the connection survives a refused batch
    assert a.transfer_sync(b.get_session_id(), ptr(src), ptr(backing, 16 * 1024), n) == 0
    assert np.array_equal(backing[16 * 1024 : 16 * 1024 + n], src[:n])


def test_write_spanning_two_regions_is_rejected(engines):
    a, b = engines(), engines()
    src, dst = random_bytes(64), np.zeros(64, dtype=np.uint8)
    assert a.batch_register([ptr(src)], [64]) == 0
    assert b.batch_register([ptr(dst), ptr(dst, 32)], [32, 32]) == 0  # adjacent, both registered
    assert a.transfer_sync(b.get_session_id(), ptr(src), ptr(dst, 28), 8) == ERR_REJECTED
    assert not dst.any()
    # the same bytes as two writes, one per region, are fine
    rc = a.batch_transfer_sync(b.get_session_id(), [ptr(src), ptr(src, 4)], [ptr(dst, 28), ptr(dst, 32)], [4, 4])
    assert rc == 0
    assert np.array_equal(dst[28:36], src[:8])


def test_bad_write_later_in_batch_fails_the_batch(pair):
    a, b, src, backing = pair
    base = 16 * 1024
    dsts = [ptr(backing, base), ptr(backing, 0)]  # the second lies before the registered region
    rc = a.batch_transfer_sync(b.get_session_id(), [ptr(src), ptr(src, 8)], dsts, [8, 8])
    assert rc == ERR_REJECTED
    assert not backing[:base].any()  # the bad one was not written


def test_deregistered_region_stops_accepting_writes(pair):
    a, b, src, backing = pair
    region = ptr(backing, 16 * 1024)
    assert a.transfer_sync(b.get_session_id(), ptr(src), region, 16) == 0
    assert b.batch_deregister([region]) == 0
    assert a.transfer_sync(b.get_session_id(), ptr(src, 100), region, 16) == ERR_REJECTED
    assert np.array_equal(backing[16 * 1024 : 16 * 1024 + 16], src[:16])  # still the first write


def test_source_must_be_registered_locally(pair, caplog):
    a, b, src, backing = pair
    caplog.set_level(logging.WARNING, logger=LOG)
    other = random_bytes(64)
    assert a.transfer_sync(b.get_session_id(), ptr(other), ptr(backing, 16 * 1024), 64) == ERR_INVALID
    assert a.transfer_sync(b.get_session_id(), ptr(src, src.nbytes - 8), ptr(backing, 16 * 1024), 16) == ERR_INVALID
    assert not backing.any()
    wait_for_log(caplog, r"refusing to send: source write \[0x[0-9a-f]+,\+64\) outside registered memory")


def test_registration_rules(engines):
    e = engines()
    buf = np.zeros(4096, dtype=np.uint8)
    assert e.batch_register([ptr(buf)], [1024]) == 0
    assert e.batch_register([ptr(buf)], [1024]) == 0  # exact repeat: no-op
    assert e.batch_register([ptr(buf)], [2048]) == ERR_INVALID  # same start, other length
    assert e.batch_register([ptr(buf, 512)], [1024]) == ERR_INVALID  # overlap
    assert e.batch_register([ptr(buf, 2048), ptr(buf, 2500)], [1024, 10]) == ERR_INVALID  # overlap within batch
    assert e.batch_register([ptr(buf, 2048)], [0]) == ERR_INVALID  # zero length (Mooncake refuses it too)
    assert e.batch_register([ptr(buf, 1024)], [1024]) == 0  # adjacent is fine
    with pytest.raises(RuntimeError):
        e.register(ptr(buf, 100), 10)
    e.register(ptr(buf, 3000), 10)
    e.deregister(ptr(buf, 3000))
    with pytest.raises(RuntimeError):
        e.deregister(ptr(buf, 3000))
    assert e.batch_deregister([ptr(buf), ptr(buf, 7)]) == ERR_INVALID  # one unknown
    assert e.batch_deregister([ptr(buf, 1024)]) == 0


def test_bad_arguments(pair):
    a, b, src, backing = pair
    assert a.batch_transfer_sync(b.get_session_id(), [ptr(src)], [], [1]) == ERR_INVALID
    assert a.transfer_sync(b.get_session_id(), ptr(src), ptr(backing, 16 * 1024), -1) == ERR_INVALID
    for bad in ["127.0.0.1", "127.0.0.1:x", "127.0.0.1:0", ":80", ""]:
        assert a.send_probe(bad) == ERR_INVALID
    assert tcp_engine.parse_session_id("[::1]:8000") == ("::1", 8000)
    a.close()
    assert a.send_probe(b.get_session_id()) == ERR_CLOSED


# ---------------------------------------------------------------------------- integrity


def test_corrupted_payload_is_rejected_and_not_written(pair):
    a, b, src, backing = pair
    dst = ptr(backing, 16 * 1024)
    payload = bytes(src[:1000])
    sock, reader = raw_client(b)
    with sock:
        sock.send(MemWrite(1, 0, dst, len(payload), checksum(payload) ^ 1), payload)
        sock.send(MemCommit(1, 1, len(payload)))
        reply, _ = reader.read_message()
        assert reply == MemWriteAck(1, 0, "checksum", f"write #0: CRC-32 mismatch on [0x{dst:x},+1000)")
        assert not backing.any()
        # same connection, good checksum: applied
        sock.send(MemWrite(2, 0, dst, len(payload), checksum(payload)), payload)
        sock.send(MemCommit(2, 1, len(payload)))
        assert reader.read_message()[0] == MemWriteAck(2, 1, "ok", "")
        assert bytes(backing[16 * 1024 : 16 * 1024 + 1000]) == payload


def test_commit_not_matching_the_writes_fails_the_batch(pair):
    a, b, src, backing = pair
    sock, reader = raw_client(b)
    with sock:
        payload = bytes(src[:10])
        sock.send(MemWrite(5, 0, ptr(backing, 16 * 1024), 10, checksum(payload)), payload)
        sock.send(MemCommit(5, 2, 20))
        reply, _ = reader.read_message()
        assert isinstance(reply, MemWriteAck) and reply.status == "incomplete"


def test_receiver_refuses_a_frame_over_its_limit(engines, caplog):
    caplog.set_level(logging.WARNING, logger=LOG)
    b = engines(max_write_bytes=1024)
    dst = np.zeros(4096, dtype=np.uint8)
    assert b.batch_register([ptr(dst)], [dst.nbytes]) == 0
    sock, reader = raw_client(b)
    with sock:
        payload = b"x" * 2048
        sock.send(MemWrite(1, 0, ptr(dst), 2048, checksum(payload)), payload)
        reply, _ = reader.read_message()
        assert isinstance(reply, Error) and "payload of 2048 bytes exceeds limit 1024" in reply.detail
        assert_closed_by_peer(sock)
    assert not dst.any()
    # a sender that does not split small enough gets a negative code, not an exception
    a = engines(max_write_bytes=4096)
    src = random_bytes(4096)
    assert a.batch_register([ptr(src)], [4096]) == 0
    assert a.transfer_sync(b.get_session_id(), ptr(src), ptr(dst), 4096) == ERR_IO
    assert not dst.any()


# ---------------------------------------------------------------------------- authentication


def test_wrong_key_is_refused_and_server_keeps_serving(pair, engines, caplog):
    a, b, src, backing = pair
    caplog.set_level(logging.WARNING, logger=LOG)
    intruder = engines(WRONG_KEY, name="intruder")
    evil = random_bytes(64, seed=9)
    assert intruder.batch_register([ptr(evil)], [64]) == 0
    assert intruder.send_probe(b.get_session_id()) == ERR_CONNECT
    assert intruder.transfer_sync(b.get_session_id(), ptr(evil), ptr(backing, 16 * 1024), 64) == ERR_CONNECT
    wait_for_log(caplog, r"receiver: refused peer 127\.0\.0\.1:\d+: authentication failed")
    assert not backing.any()
    assert a.send_probe(b.get_session_id()) == 0
    assert a.transfer_sync(b.get_session_id(), ptr(src), ptr(backing, 16 * 1024), 64) == 0
    assert np.array_equal(backing[16 * 1024 : 16 * 1024 + 64], src[:64])


def test_peer_with_wrong_key_is_never_served(pair, caplog):
    """A client that ignores the server's proof and answers with a bad MAC gets ERROR,
    and what it sends next is not applied."""
    a, b, src, backing = pair
    caplog.set_level(logging.WARNING, logger=LOG)
    sock = socket.create_connection(("127.0.0.1", b.port), timeout=5)
    with sock:
        reader = FrameReader(sock)
        send_frame(sock, Hello("mallory", b"sess", 0, 1, b"n" * 32))
        assert isinstance(reader.read_message()[0], HelloChallenge)
        send_frame(sock, HelloAuth(b"\0" * 32))
        payload = b"evil" * 4
        try:
            send_frame(sock, MemWrite(1, 0, ptr(backing, 16 * 1024), 16, checksum(payload)), payload)
            send_frame(sock, MemCommit(1, 1, 16))
        except OSError:
            pass
        reply, _ = reader.read_message()
        assert isinstance(reply, Error) and reply.reason == "auth"
        assert_closed_by_peer(sock)
    wait_for_log(caplog, r"refused peer .*'mallory' failed HMAC authentication")
    assert not backing.any()


# ---------------------------------------------------------------------------- faults


def test_malformed_bytes_do_not_kill_the_server(pair, caplog):
    a, b, src, backing = pair
    caplog.set_level(logging.WARNING, logger=LOG)
    for junk in [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", bytes(range(256)) * 4, b"PDKV"]:
        with socket.create_connection(("127.0.0.1", b.port), timeout=5) as s:
            s.sendall(junk)
            if junk != b"PDKV":  # a bad prefix is answered; a truncated one just ends at our EOF
                reply, _ = FrameReader(s).read_message()
                assert isinstance(reply, Error) and "bad magic" in reply.detail
            try:
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # already reset by the server
            assert_closed_by_peer(s)
    # after authentication: a frame that is not ours, then garbage
    sock, reader = raw_client(b)
    with sock:
        sock.send(Error(-1, "x", "y"))
        reply, _ = reader.read_message()
        assert isinstance(reply, Error) and "unexpected Error" in reply.detail
        assert_closed_by_peer(sock)
    sock, reader = raw_client(b)
    with sock:
        sock.sendall(b"\xff" * 64)
        assert isinstance(reader.read_message()[0], Error)
        assert_closed_by_peer(sock)
    wait_for_log(caplog, "protocol error from")
    assert a.transfer_sync(b.get_session_id(), ptr(src), ptr(backing, 16 * 1024), 128) == 0
    assert np.array_equal(backing[16 * 1024 : 16 * 1024 + 128], src[:128])
    assert not backing[: 16 * 1024].any() and not backing[32 * 1024 :].any()


def test_peer_down_then_restarted_on_same_port(pair, engines, caplog):
    a, b, src, backing = pair
    caplog.set_level(logging.WARNING, logger=LOG)
    sid, port = b.get_session_id(), b.port
    assert a.transfer_sync(sid, ptr(src), ptr(backing, 16 * 1024), 32) == 0  # leaves a pooled connection
    b.close()
    t0 = time.monotonic()
    assert a.transfer_sync(sid, ptr(src), ptr(backing, 16 * 1024), 32) == ERR_CONNECT
    assert a.send_probe(sid) == ERR_CONNECT
    assert time.monotonic() - t0 < 2
    wait_for_log(caplog, rf"transfer to {sid} failed: cannot connect")

    b2 = engines(port=port, name="restarted")
    dst2 = np.zeros(256, dtype=np.uint8)
    assert b2.batch_register([ptr(dst2)], [256]) == 0
    assert b2.get_session_id() == sid
    assert a.send_probe(sid) == 0
    assert a.transfer_sync(sid, ptr(src, 64), ptr(dst2), 256) == 0
    assert np.array_equal(dst2, src[64:320])


def test_restarted_peer_works_on_the_very_next_call(pair, engines):
    """The pooled connection to the old process is found dead before use; no call fails."""
    a, b, src, backing = pair
    sid, port = b.get_session_id(), b.port
    assert a.transfer_sync(sid, ptr(src), ptr(backing, 16 * 1024), 32) == 0
    b.close()
    b2 = engines(port=port)
    dst2 = np.zeros(64, dtype=np.uint8)
    assert b2.batch_register([ptr(dst2)], [64]) == 0
    assert a.transfer_sync(sid, ptr(src), ptr(dst2), 64) == 0
    assert np.array_equal(dst2, src[:64])


class FakePeer:
    """Authenticates like an engine, then misbehaves: ``mode`` "reset" (RST after the first
    frame), "close" (FIN after the first frame) or "hang" (never answers)."""

    def __init__(self, mode: str):
        self.mode = mode
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.release = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        sock, _ = self.listener.accept()
        with sock:
            reader = FrameReader(sock)
            server_handshake(sock, KEY, "fake", reader)
            reader.read_message()
            if self.mode == "reset":
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            elif self.mode == "hang":
                self.release.wait(10)

    def close(self) -> None:
        self.release.set()
        self.thread.join(5)
        self.listener.close()


@pytest.mark.parametrize("mode", ["reset", "close", "hang"])
def test_connection_lost_or_stalled_mid_batch(engines, caplog, mode):
    caplog.set_level(logging.WARNING, logger=LOG)
    a = engines(io_timeout=0.3)
    src = random_bytes(8192)
    assert a.batch_register([ptr(src)], [src.nbytes]) == 0
    peer = FakePeer(mode)
    try:
        sid = f"127.0.0.1:{peer.port}"
        t0 = time.monotonic()
        assert a.batch_transfer_sync(sid, [ptr(src), ptr(src, 4096)], [0x1000, 0x2000], [4096, 4096]) == ERR_IO
        assert time.monotonic() - t0 < 3
    finally:
        peer.close()
    want = f"transfer to {sid} failed (2 writes, 8192 bytes)"
    msgs = [r.getMessage() for r in caplog.records if want in r.getMessage()]
    assert len(msgs) == 1, [r.getMessage() for r in caplog.records]
    # the broken connection is not reused: the next call connects again (and is refused: nobody listens)
    assert a.send_probe(sid) == ERR_CONNECT
