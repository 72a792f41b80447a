"""The userspace WAN emulator: faithful forwarding, shaping, faults, CLI + control endpoint."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from sglang_pdd.launcher.wan_emulator import TokenBucket, WanEmulator
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(60)


class Sink:
    """Upstream server: echoes (mode 'echo') or counts+hashes what it receives ('sink')."""

    def __init__(self, mode="echo"):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = self.server.getsockname()[:2]
        self.received = bytearray()
        self.first_byte_at = None
        self.done = threading.Event()
        self.mode = mode
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        with conn:
            try:
                while data := conn.recv(1 << 16):
                    if self.first_byte_at is None:
                        self.first_byte_at = time.monotonic()
                    if self.mode == "echo":
                        conn.sendall(data)
                    else:
                        self.received += data
            except OSError:
                pass
        self.done.set()

    def close(self):
        self.server.close()


@pytest.fixture
def echo():
    s = Sink("echo")
    yield s
    s.close()


@pytest.fixture
def sink():
    s = Sink("sink")
    yield s
    s.close()


def recv_exactly(sock, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return bytes(buf)


def test_forwards_bytes_both_ways_unchanged(echo):
    with WanEmulator(echo.address, latency_ms=2, jitter_ms=1, seed=1) as emu:
        payload = os.urandom(3 * 1024 * 1024 + 17)
        with socket.create_connection(emu.address) as s:
            t = threading.Thread(target=s.sendall, args=(payload,))
            t.start()
            got = recv_exactly(s, len(payload))
            t.join()
        assert got == payload  # jitter never reorders bytes within a connection
        assert emu.stats()["bytes_up"] == len(payload)


def test_latency_applies_each_way(echo):
    with WanEmulator(echo.address, latency_ms=50) as emu, socket.create_connection(emu.address) as s:
        t0 = time.monotonic()
        s.sendall(b"ping")
        assert recv_exactly(s, 4) == b"ping"
        assert time.monotonic() - t0 >= 0.1  # 50 ms there + 50 ms back


def test_rate_cap_is_shared_by_connections(sink):
    # 8 MB at 80 Mbps is 0.8 s; two connections share the cap rather than doubling it.
    with WanEmulator(sink.address, rate_gbps=0.08) as emu:
        t0 = time.monotonic()
        socks = [socket.create_connection(emu.address) for _ in range(2)]
        threads = [threading.Thread(target=s.sendall, args=(os.urandom(4 * 1000 * 1000),)) for s in socks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for s in socks:
            s.close()
        while len(sink.received) < 8 * 1000 * 1000 and time.monotonic() - t0 < 20:
            time.sleep(0.01)
        assert len(sink.received) == 8 * 1000 * 1000
        assert time.monotonic() - t0 >= 0.6


def test_token_bucket_average_rate():
    bucket = TokenBucket(10e6, burst_bytes=10_000)  # 10 MB/s
    t0 = time.monotonic()
    for _ in range(50):
        bucket.acquire(40_000)  # 2 MB
    assert time.monotonic() - t0 >= 0.15


def test_stall_delays_delivery(sink):
    with WanEmulator(sink.address) as emu, socket.create_connection(emu.address) as s:
        emu.stall(0.5)
        t0 = time.monotonic()
        s.sendall(b"x" * 1000)
        while len(sink.received) < 1000 and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        assert len(sink.received) == 1000 and sink.first_byte_at - t0 >= 0.45


def test_partition_holds_new_connections_until_heal(echo):
    with WanEmulator(echo.address) as emu:
        emu.partition()
        with socket.create_connection(emu.address) as s:
            s.sendall(b"hello")
            s.settimeout(0.3)
            with pytest.raises(socket.timeout):
                s.recv(5)
            emu.heal()
            s.settimeout(5)
            assert recv_exactly(s, 5) == b"hello"


def test_reset_sends_rst_to_client(echo):
    with WanEmulator(echo.address) as emu, socket.create_connection(emu.address) as s:
        s.sendall(b"a")
        assert recv_exactly(s, 1) == b"a"
        assert emu.reset() == 1
        s.settimeout(5)
        with pytest.raises((ConnectionResetError, ConnectionError)):
            while True:  # RST (or at worst EOF) arrives shortly
                s.sendall(b"more")
                if not s.recv(10):
                    raise ConnectionError("eof")
                time.sleep(0.01)
        assert wait_until(lambda: emu.stats()["active_connections"] == 0, timeout=5)
        with socket.create_connection(emu.address) as s2:  # new connections still work
            s2.sendall(b"b")
            assert recv_exactly(s2, 1) == b"b"


def test_corrupt_flips_exactly_the_requested_bytes(sink):
    with WanEmulator(sink.address) as emu, socket.create_connection(emu.address) as s:
        emu.corrupt(count=3, after_bytes=1000)
        data = bytes(5000)
        s.sendall(data)
        s.close()
        sink.done.wait(5)
        got = bytes(sink.received)
        assert len(got) == 5000
        assert [i for i, b in enumerate(got) if b] == [1000, 1001, 1002]


def test_only_loopback():
    with pytest.raises(ValueError, match="loopback"):
        WanEmulator(("10.0.0.1", 80))
    with pytest.raises(ValueError, match="loopback"):
        WanEmulator(("127.0.0.1", 80), listen=("0.0.0.0", 0))


def test_cli_and_control_endpoint(echo):
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_pdd.launcher.wan_emulator", "--listen", "127.0.0.1:0",
         "--upstream", f"127.0.0.1:{echo.address[1]}", "--rate-gbps", "1", "--latency-ms", "5",
         "--jitter-ms", "1", "--control", "127.0.0.1:0", "--log-level", "WARNING"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        info = json.loads(proc.stdout.readline())
        ctl = f"http://127.0.0.1:{info['control'][1]}"
        with socket.create_connection(tuple(info["listen"])) as s:
            s.sendall(b"over the wan")
            assert recv_exactly(s, 12) == b"over the wan"
        req = urllib.request.Request(f"{ctl}/stall?seconds=0.2", method="POST")
        body = json.load(urllib.request.urlopen(req, timeout=5))
        assert body["ok"] and body["stalled"] and body["rate_gbps"] == 1
        body = json.load(urllib.request.urlopen(f"{ctl}/link?rate_gbps=0.5&latency_ms=7", timeout=5))
        assert body["rate_gbps"] == 0.5 and abs(body["latency_ms"] - 7) < 1e-6
        assert json.load(urllib.request.urlopen(f"{ctl}/stats", timeout=5))["bytes_up"] == 12
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
