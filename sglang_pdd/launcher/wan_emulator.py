"""A userspace WAN emulator: a TCP proxy between "datacenter A" and "datacenter B".

The kernel here has tbf/htb but no netem, so latency, jitter and faults are imposed by
this proxy instead: it listens on a loopback port and forwards every connection to a
loopback upstream, shaping both directions.

The link model, per direction (client->upstream is "up", upstream->client "down"):

    recv from source -> in-flight window -> token bucket -> delay line -> send to target
                        (per connection)    (shared by all   (release at t + latency
                                             connections:     + jitter, never before
                                             one link)        the previous piece)

* bandwidth: one token bucket per direction shared by all connections, so parallel
  streams share the link like on a real WAN, rather than each getting the full rate.
* latency: a delay line of timestamped pieces, so the proxy never sleeps in series
  (that would cap throughput at piece/latency); any amount of data can be in flight.
* jitter: each piece gets latency +- uniform(jitter), but never leaves before the
  previous piece of the same connection: bytes within a connection are never reordered.
* window: a connection may have at most ``window_bytes`` un-"acknowledged" in a
  direction; a piece counts until ``latency`` after delivery (the ACK's trip back). This
  brings back the long-fat-pipe effect (one stream moves at most window / RTT) that a
  loopback proxy would otherwise hide, since each leg of the proxy is itself loopback.
* memory is bounded by ``window_bytes`` per connection and direction.

Faults, at run time (API below, HTTP control endpoint, or CLI):
  stall(seconds)   nothing is delivered for that long (data queues, then flows again)
  partition()      nothing is delivered and new connections are held until heal()
  heal()           ends a partition (and a stall)
  reset()          every connection gets a TCP RST on both sides
  corrupt(n, after_bytes, direction)  flips the n bytes that follow the next
                   ``after_bytes`` bytes forwarded in that direction (checksum tests)
  set_link(rate_gbps=, latency_ms=, jitter_ms=)

From another program::

    emu = WanEmulator(upstream=("127.0.0.1", md_port), rate_gbps=1, latency_ms=20, jitter_ms=2)
    emu.start()                       # emu.address is the (host, port) to connect to
    ...; emu.stall(3.0); ...; emu.stop()

or as a process (prints one JSON line with the bound addresses, then serves)::

    python -m sglang_pdd.launcher.wan_emulator --listen 127.0.0.1:0 \\
        --upstream 127.0.0.1:PORT --rate-gbps 1 --latency-ms 20 --jitter-ms 2 \\
        --control 127.0.0.1:0
    curl -X POST 'http://127.0.0.1:CTRL/stall?seconds=2'   # /partition /heal /reset
    curl -X POST 'http://127.0.0.1:CTRL/corrupt?count=1&after=100000&direction=up'
    curl -X POST 'http://127.0.0.1:CTRL/link?rate_gbps=0.5&latency_ms=30'
    curl 'http://127.0.0.1:CTRL/stats'

Only loopback addresses are accepted, for listening and as upstream.
"""

from __future__ import annotations

import argparse
import collections
import ipaddress
import json
import logging
import random
import signal
import socket
import struct
import sys
import threading
import time
import urllib.parse
from typing import Optional

from sglang_pdd.control.api import ControlApi, ControlServer
from sglang_pdd.control.gate import JsonRequestHandler
from sglang_pdd.protocol import Route, RouteTable, bad_request

logger = logging.getLogger(__name__)

_POLL_S = 0.05  # socket timeout: how fast threads notice reset/stop
DEFAULT_WINDOW_BYTES = 16 * 1024 * 1024
LOOPBACK = ("127.0.0.0/8", "::1")  # the control endpoint's only clients: no per-source cap for them


def require_loopback(host: str) -> str:
    if host == "localhost":
        return "127.0.0.1"
    try:
        if ipaddress.ip_address(host).is_loopback:
            return host
    except ValueError:
        pass
    raise ValueError(f"WAN emulator only works on loopback addresses, not {host!r}")


def parse_hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return require_loopback(host or "127.0.0.1"), int(port)


class TokenBucket:
    """Byte-rate limiter shared by many threads (GCRA: each caller reserves its slot)."""

    def __init__(self, rate_bytes_per_s: Optional[float], burst_bytes: int = 64 * 1024):
        self._lock = threading.Lock()
        self._tat = time.monotonic()  # theoretical arrival time of the next byte
        self.burst_bytes = burst_bytes
        self.rate = rate_bytes_per_s

    def acquire(self, n: int) -> None:
        rate = self.rate
        if not rate:
            return
        with self._lock:
            now = time.monotonic()
            self._tat = max(self._tat, now - self.burst_bytes / rate) + n / rate
            wait = self._tat - now - self.burst_bytes / rate
        if wait > 0:
            time.sleep(wait)


class _Link:
    """State shared by all connections: config, buckets, faults, counters."""

    def __init__(self, rate_gbps, latency_ms, jitter_ms, window_bytes, seed):
        self.lock = threading.Condition()
        self.buckets = {"up": TokenBucket(None), "down": TokenBucket(None)}
        self.rng = random.Random(seed)
        self.window_bytes = window_bytes
        self.set(rate_gbps, latency_ms, jitter_ms)
        self.stalled_until = 0.0
        self.partitioned = False
        self.corrupt = {"up": [0, 0], "down": [0, 0]}  # direction -> [bytes to skip, bytes to flip]
        self.bytes = {"up": 0, "down": 0}

    def set(self, rate_gbps, latency_ms, jitter_ms):
        self.rate_gbps = rate_gbps
        self.latency = (latency_ms or 0) / 1000
        self.jitter = (jitter_ms or 0) / 1000
        rate = rate_gbps * 1e9 / 8 if rate_gbps else None
        for b in self.buckets.values():
            b.rate = rate
            # ~2 ms of line rate, at least one MTU: a fixed 64 KiB floor would let whole small
            # transfers through unshaped on the slow links that emulate a scaled-down model.
            b.burst_bytes = int(max(1500, rate * 0.002)) if rate else 0
        # Small pieces at low rates keep shaping smooth; large ones keep syscalls few.
        self.piece_bytes = int(min(256 * 1024, max(1500, (rate or 1e12) * 0.002)))

    def blocked(self) -> bool:
        return self.partitioned or time.monotonic() < self.stalled_until

    def apply_corruption(self, direction: str, data: bytes) -> bytes:
        with self.lock:
            self.bytes[direction] += len(data)
            state = self.corrupt[direction]
            if not state[1]:
                return data
            skip, flip = state
            if skip >= len(data):
                state[0] -= len(data)
                return data
            buf = bytearray(data)
            end = min(len(buf), skip + flip)
            for i in range(skip, end):
                buf[i] ^= 0xFF
            state[0], state[1] = 0, flip - (end - skip)
            logger.warning("emulator: corrupted %d bytes (%s)", end - skip, direction)
            return bytes(buf)


class _Pipe:
    """One direction of one proxied connection: a reader and a writer thread."""

    def __init__(self, conn: "_EmulatedConn", src: socket.socket, dst: socket.socket, direction: str):
        self.conn, self.src, self.dst, self.direction = conn, src, dst, direction
        self.link = conn.link
        self.cv = threading.Condition()
        self.line: collections.deque = collections.deque()  # (release time, bytes or None=EOF)
        self.acks: collections.deque = collections.deque()  # (ack time, nbytes)
        self.inflight = 0
        self.last_release = 0.0

    def start(self):
        tag = f"{self.conn.id}-{self.direction}"
        for fn in (self._read, self._write):
            t = threading.Thread(target=self._guard, args=(fn,), daemon=True, name=f"wanemu-{fn.__name__[1:]}-{tag}")
            self.conn.threads.append(t)
            t.start()

    def _guard(self, fn):
        try:
            fn()
        except OSError as e:  # reset by a peer: pass the reset on to the other side
            if not self.conn.dead:
                logger.debug("emulator conn %s %s: %r", self.conn.id, self.direction, e)
            self.conn.kill(rst=True)
        finally:
            self.conn.thread_done()

    def _read(self):
        link = self.link
        while not self.conn.dead:
            try:
                data = self.src.recv(link.piece_bytes)
            except socket.timeout:
                continue
            if not data:
                with self.cv:
                    self.line.append((max(self.last_release, time.monotonic() + link.latency), None))
                    self.cv.notify_all()
                return
            n = len(data)
            with self.cv:  # in-flight window (bounded memory, and per-stream rate = window / RTT)
                while not self.conn.dead:
                    now = time.monotonic()
                    while self.acks and self.acks[0][0] <= now:
                        self.inflight -= self.acks.popleft()[1]
                    if self.inflight == 0 or self.inflight + n <= link.window_bytes:
                        break
                    self.cv.wait(self.acks[0][0] - now if self.acks else _POLL_S)
                self.inflight += n
            link.buckets[self.direction].acquire(n)
            data = link.apply_corruption(self.direction, data)
            delay = link.latency + (link.rng.uniform(-link.jitter, link.jitter) if link.jitter else 0.0)
            with self.cv:
                self.last_release = max(self.last_release, time.monotonic() + max(0.0, delay))
                self.line.append((self.last_release, data))
                self.cv.notify_all()

    def _write(self):
        link = self.link
        while True:
            with self.cv:
                while True:
                    if self.conn.dead:
                        return
                    now = time.monotonic()
                    if self.line and self.line[0][0] <= now and not link.blocked():
                        break
                    wait = self.line[0][0] - now if self.line else _POLL_S
                    self.cv.wait(min(max(wait, 0.0005), _POLL_S))
                _, data = self.line.popleft()
            if data is None:  # EOF: pass the FIN on
                try:
                    self.dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                self.conn.half_closed()
                return
            view = memoryview(data)
            while view:
                if self.conn.dead:
                    return
                try:
                    sent = self.dst.send(view)
                except socket.timeout:
                    continue
                view = view[sent:]
            with self.cv:
                self.acks.append((time.monotonic() + link.latency, len(data)))
                self.cv.notify_all()


class _EmulatedConn:
    _ids = iter(range(1, 1 << 62))

    def __init__(self, emu: "WanEmulator", client: socket.socket):
        self.emu = emu
        self.link = emu.link
        self.id = next(self._ids)
        self.client = client
        self.upstream: Optional[socket.socket] = None
        self.threads: list[threading.Thread] = []
        self.dead = False
        self._lock = threading.Lock()
        self._running = 0
        self._half = 0

    def run(self):
        """Connect upstream (held while partitioned), then start the two pipes."""
        try:
            while self.link.partitioned and not self.dead:
                time.sleep(_POLL_S)
            if self.dead:
                self._close_sockets()
                self.emu._forget(self)
                return
            self.upstream = socket.create_connection(self.emu.upstream, timeout=5)
        except OSError as e:
            logger.warning("emulator: upstream %s:%s unreachable: %r", *self.emu.upstream, e)
            self.kill(rst=True)
            self._close_sockets()
            self.emu._forget(self)
            return
        for s in (self.client, self.upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.settimeout(_POLL_S)
        pipes = [_Pipe(self, self.client, self.upstream, "up"), _Pipe(self, self.upstream, self.client, "down")]
        with self._lock:
            if self.dead:
                self._close_sockets()
                self.emu._forget(self)
                return
            self._running = 4
        for p in pipes:
            p.start()

    def half_closed(self):
        with self._lock:
            self._half += 1
            both = self._half == 2
        if both:
            self.kill(rst=False)

    def kill(self, rst: bool):
        with self._lock:
            if self.dead:
                return
            self.dead = True
        for s in (self.client, self.upstream):
            if s is None:
                continue
            try:
                if rst:  # linger 0: close() sends RST instead of FIN
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.shutdown(socket.SHUT_RD)  # wakes a blocked recv; sends nothing
            except OSError:
                pass
        with self._lock:
            if self._running == 0:
                self._close_sockets()

    def thread_done(self):
        with self._lock:
            self._running -= 1
            last = self._running == 0
        if last:
            self.kill(rst=False)  # no-op if already dead
            self._close_sockets()
            self.emu._forget(self)

    def _close_sockets(self):
        for s in (self.client, self.upstream):
            if s is not None:
                s.close()


class WanEmulator:
    """TCP proxy imposing a shared bandwidth cap, latency, jitter and faults."""

    def __init__(
        self,
        upstream: tuple[str, int],
        listen: tuple[str, int] = ("127.0.0.1", 0),
        *,
        rate_gbps: Optional[float] = None,
        latency_ms: float = 0.0,
        jitter_ms: float = 0.0,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        seed: Optional[int] = None,
    ):
        self.upstream = (require_loopback(upstream[0]), int(upstream[1]))
        self.listen = (require_loopback(listen[0]), int(listen[1]))
        self.link = _Link(rate_gbps, latency_ms, jitter_ms, window_bytes, seed)
        self._conns: set[_EmulatedConn] = set()
        self._lock = threading.Lock()
        self._server: Optional[socket.socket] = None
        self._acceptor: Optional[threading.Thread] = None
        self._stopped = False
        self.address: Optional[tuple[str, int]] = None
        self.total_connections = 0

    # -- lifecycle
    def start(self) -> "WanEmulator":
        self._server = socket.create_server(self.listen, backlog=128)
        self.address = self._server.getsockname()[:2]
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True, name="wanemu-accept")
        self._acceptor.start()
        logger.info("WAN emulator %s:%s -> %s:%s (%s Gbps, %.1f ms +- %.1f ms)", *self.address, *self.upstream,
                    self.link.rate_gbps or "unlimited", self.link.latency * 1e3, self.link.jitter * 1e3)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stopped = True
        if self._server is not None:
            try:
                self._server.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._server.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            c.kill(rst=True)
        deadline = time.monotonic() + timeout
        if self._acceptor is not None:
            self._acceptor.join(timeout)
        for c in conns:
            for t in c.threads:
                t.join(max(0.0, deadline - time.monotonic()))

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # -- faults and config
    def stall(self, seconds: float) -> None:
        logger.warning("emulator: stall for %.2fs", seconds)
        self.link.stalled_until = time.monotonic() + seconds

    def partition(self) -> None:
        logger.warning("emulator: partition")
        self.link.partitioned = True

    def heal(self) -> None:
        logger.warning("emulator: heal")
        self.link.partitioned = False
        self.link.stalled_until = 0.0

    def reset(self) -> int:
        """RST every current connection (new ones are accepted normally). Returns how many."""
        with self._lock:
            conns = list(self._conns)
        logger.warning("emulator: reset %d connections", len(conns))
        for c in conns:
            c.kill(rst=True)
        return len(conns)

    def corrupt(self, count: int = 1, after_bytes: int = 0, direction: str = "up") -> None:
        if direction not in ("up", "down"):
            raise ValueError("direction must be 'up' or 'down'")
        with self.link.lock:
            self.link.corrupt[direction] = [int(after_bytes), int(count)]

    def set_link(self, rate_gbps=..., latency_ms=..., jitter_ms=...) -> None:
        link = self.link
        link.set(
            link.rate_gbps if rate_gbps is ... else rate_gbps,
            link.latency * 1e3 if latency_ms is ... else latency_ms,
            link.jitter * 1e3 if jitter_ms is ... else jitter_ms,
        )

    def stats(self) -> dict:
        with self._lock:
            active = len(self._conns)
        return {
            "address": list(self.address or ()),
            "upstream": list(self.upstream),
            "rate_gbps": self.link.rate_gbps,
            "latency_ms": self.link.latency * 1e3,
            "jitter_ms": self.link.jitter * 1e3,
            "bytes_up": self.link.bytes["up"],
            "bytes_down": self.link.bytes["down"],
            "active_connections": active,
            "total_connections": self.total_connections,
            "partitioned": self.link.partitioned,
            "stalled": time.monotonic() < self.link.stalled_until,
        }

    # -- internals
    def _accept_loop(self):
        while not self._stopped:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            conn = _EmulatedConn(self, client)
            with self._lock:
                self._conns.add(conn)
                self.total_connections += 1
            t = threading.Thread(target=conn.run, daemon=True, name=f"wanemu-conn-{conn.id}")
            conn.threads.append(t)
            t.start()

    def _forget(self, conn: _EmulatedConn):
        with self._lock:
            self._conns.discard(conn)


# ---------------------------------------------------------------------------- control endpoint


class EmulatorControlApi(ControlApi):
    """The fault and link endpoint: each route (GET or POST, parameters in the query) acts on
    the emulator and answers ``{"ok": true}`` with its stats. Unsigned: loopback only."""

    def __init__(self, emu: WanEmulator):
        self.emu = emu
        actions = {"/stall": self.stall, "/partition": self.partition, "/heal": self.heal, "/reset": self.reset,
                   "/corrupt": self.corrupt, "/link": self.link, "/stats": self.stats}
        self.routes = RouteTable({Route(method, path): action for path, action in actions.items()
                                  for method in ("GET", "POST")})

    def stall(self, call: JsonRequestHandler, query: str) -> dict:
        seconds = _query(query).get("seconds", 1)
        return self._then_stats(lambda: self.emu.stall(float(seconds)))

    def partition(self, call: JsonRequestHandler, query: str) -> dict:
        return self._then_stats(self.emu.partition)

    def heal(self, call: JsonRequestHandler, query: str) -> dict:
        return self._then_stats(self.emu.heal)

    def reset(self, call: JsonRequestHandler, query: str) -> dict:
        return self._then_stats(self.emu.reset)

    def corrupt(self, call: JsonRequestHandler, query: str) -> dict:
        q = _query(query)
        return self._then_stats(lambda: self.emu.corrupt(int(q.get("count", 1)), int(q.get("after", 0)),
                                                         q.get("direction", "up")))

    def link(self, call: JsonRequestHandler, query: str) -> dict:
        q = _query(query)
        return self._then_stats(lambda: self.emu.set_link(**{k: float(q[k]) for k in ("rate_gbps", "latency_ms",
                                                                                      "jitter_ms") if k in q}))

    def stats(self, call: JsonRequestHandler, query: str) -> dict:
        return {"ok": True, **self.emu.stats()}

    def _then_stats(self, action) -> dict:
        try:
            action()
        except (ValueError, TypeError) as e:
            raise bad_request(str(e)) from None
        return {"ok": True, **self.emu.stats()}


def _query(query: str) -> dict:
    return {k: v[-1] for k, v in urllib.parse.parse_qs(query).items()}


def start_control_server(emu: WanEmulator, listen: tuple[str, int]) -> ControlServer:
    return ControlServer(EmulatorControlApi(emu), (require_loopback(listen[0]), listen[1]),
                         thread_name="wanemu-control", trusted_sources=LOOPBACK)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to accept on (loopback)")
    ap.add_argument("--upstream", required=True, help="HOST:PORT to forward to (loopback)")
    ap.add_argument("--rate-gbps", type=float, default=None, help="bandwidth cap per direction (default: none)")
    ap.add_argument("--latency-ms", type=float, default=0.0, help="one-way latency")
    ap.add_argument("--jitter-ms", type=float, default=0.0, help="+- uniform jitter (no reordering)")
    ap.add_argument("--window-mb", type=float, default=DEFAULT_WINDOW_BYTES / 2**20,
                    help="per-connection in-flight window per direction")
    ap.add_argument("--control", default=None, help="HOST:PORT of the HTTP fault/config endpoint")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    emu = WanEmulator(parse_hostport(args.upstream), parse_hostport(args.listen), rate_gbps=args.rate_gbps,
                      latency_ms=args.latency_ms, jitter_ms=args.jitter_ms,
                      window_bytes=int(args.window_mb * 2**20), seed=args.seed).start()
    ctl = start_control_server(emu, parse_hostport(args.control)) if args.control else None
    print(json.dumps({"listen": list(emu.address), "upstream": list(emu.upstream),
                      "control": list(ctl.address) if ctl else None}), flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    if ctl is not None:
        ctl.close()
    emu.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
