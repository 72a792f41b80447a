"""The KV channels' shared acceptor: bounded connections, thread-start failures survived,
a total handshake deadline. Real loopback sockets."""

import logging
import select
import socket
import threading
import time

import pytest
from tests.support.waiting import wait_until

from sglang_pdd.kv_channel.acceptor import Acceptor, AdmissionLimits, Slot
from sglang_pdd.kv_channel.tcp_engine import TcpTransferEngine
from sglang_pdd.kv_channel.wan_receiver import WanKvReceiver
from sglang_pdd.kv_channel.wire import Hello, encode_frame

KEY = b"acceptor-test-key-0123456789abcdef"
pytestmark = pytest.mark.timeout(60)


def closed_by_server(sock: socket.socket, within: float) -> bool:
    """True if the server closes ``sock`` within ``within`` seconds (we never send)."""
    r, _, _ = select.select([sock], [], [], within)
    if not r:
        return False
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True




class Server:
    """An Acceptor whose serve() authenticates at once (unless told not to) and then holds
    the connection until released."""

    def __init__(self, authenticate=True, **kw):
        self.release = threading.Event()
        self.served = []
        self.authenticate = authenticate
        self.acceptor = Acceptor(socket.create_server(("127.0.0.1", 0)), self._serve, name="test", **kw)
        self.address = self.acceptor.listener.getsockname()[:2]

    def _serve(self, slot: Slot) -> None:
        if self.authenticate:
            slot.authenticated()
        self.served.append(slot.peer)
        slot.sock.sendall(b"hi")
        self.release.wait(10)

    def close(self):
        self.release.set()
        self.acceptor.close()


def test_connections_over_the_cap_are_refused_and_logged(caplog):
    caplog.set_level(logging.WARNING, logger="sglang_pdd.kv_channel.acceptor")
    server = Server(max_connections=2)
    try:
        held = [socket.create_connection(server.address, timeout=5) for _ in range(2)]
        for s in held:
            assert s.recv(2) == b"hi"
        extra = socket.create_connection(server.address, timeout=5)
        assert closed_by_server(extra, 5)
        assert server.acceptor.stats()["refused"] == 1
        assert "refusing 127.0.0.1" in caplog.text and "2 connections already" in caplog.text
        server.release.set()  # the held connections end: slots free again
        assert wait_until(lambda: server.acceptor.stats()["connections"] == 0)
        server.release.clear()
        again = socket.create_connection(server.address, timeout=5)
        assert again.recv(2) == b"hi"
        for s in [*held, extra, again]:
            s.close()
    finally:
        server.close()


def test_handshakes_in_progress_are_bounded_separately():
    server = Server(authenticate=False, max_connections=10, handshake_deadline=30,
                    admission=AdmissionLimits(max_handshaking=2, reserved=0))
    try:
        silent = [socket.create_connection(server.address, timeout=5) for _ in range(2)]
        assert wait_until(lambda: server.acceptor.stats()["handshaking"] == 2)
        third = socket.create_connection(server.address, timeout=5)
        assert closed_by_server(third, 5)
        assert server.acceptor.stats()["refused"] == 1
        for s in [*silent, third]:
            s.close()
    finally:
        server.close()


def test_a_thread_that_cannot_start_costs_one_connection_not_the_acceptor(caplog):
    failures = [2]

    def flaky_start(thread: threading.Thread) -> None:
        if failures[0]:
            failures[0] -= 1
            raise RuntimeError("can't start new thread")
        thread.start()

    caplog.set_level(logging.WARNING, logger="sglang_pdd.kv_channel.acceptor")
    server = Server(start_thread=flaky_start)
    try:
        for _ in range(2):
            s = socket.create_connection(server.address, timeout=5)
            assert closed_by_server(s, 5)
            s.close()
        ok = socket.create_connection(server.address, timeout=5)
        assert ok.recv(2) == b"hi"  # still accepting and serving
        stats = server.acceptor.stats()
        assert stats["thread_start_failures"] == 2 and stats["connections"] == 1
        assert "cannot start a thread" in caplog.text
        ok.close()
    finally:
        server.close()


@pytest.fixture(params=["wan_receiver", "tcp_engine"])
def kv_server(request):
    if request.param == "wan_receiver":
        server = WanKvReceiver(KEY, name="md", handshake_timeout=1.0)
        yield server.address, server
    else:
        server = TcpTransferEngine("127.0.0.1", KEY, connect_timeout=1.0)
        yield ("127.0.0.1", server.port), server
    server.close()


def test_slowloris_handshake_is_cut_off_at_the_total_deadline(kv_server):
    """One byte every 0.3 s never trips a 1 s per-recv timeout; the total deadline does."""
    address, server = kv_server
    hello = encode_frame(Hello("slow", b"s" * 16, 0, 1, b"n" * 32))
    sock = socket.create_connection(address, timeout=5)
    t0, cut_off = time.monotonic(), False
    try:
        for byte in hello:
            try:
                sock.send(bytes([byte]))
            except OSError:
                cut_off = True
                break
            if closed_by_server(sock, 0.3):
                cut_off = True
                break
            if time.monotonic() - t0 > 5:
                break
        assert cut_off, "a peer trickling its handshake held the connection for 5 s"
        assert time.monotonic() - t0 < 4
        assert server._acceptor.stats()["handshake_timeouts"] == 1
    finally:
        sock.close()


def test_sender_survives_a_thread_it_cannot_start(monkeypatch):
    """The sender's side of thread exhaustion: that transfer fails (connect_failed), the
    next one works."""
    from sglang_pdd.kv_channel.layout import KvLayout
    from sglang_pdd.kv_channel.contract import FailureReason, RoomState
    from sglang_pdd.kv_channel.wan_sender import WanKvSender

    rx = WanKvReceiver(KEY, name="md")
    tx = WanKvSender(rx.address, KEY, name="p", num_streams=2)
    layout = KvLayout(1, 16, 1024)
    try:
        real_start = threading.Thread.start

        def no_threads(thread):
            raise RuntimeError("can't start new thread")

        monkeypatch.setattr(threading.Thread, "start", no_threads)
        failed = tx.begin_transfer(1, layout, 16, 0)
        monkeypatch.setattr(threading.Thread, "start", real_start)
        assert failed.poll() == RoomState.FAILED and failed.failure_reason == FailureReason.CONNECT_FAILED
        rx.register_room(2, layout, 16, bytearray(1024))
        ok = tx.begin_transfer(2, layout, 16, 0)
        ok.send_kv(bytearray(1024))
        assert ok.wait(10) == RoomState.SUCCESS
    finally:
        tx.close()
        rx.close()
