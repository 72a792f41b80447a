"""Control plane against an outsider, on real control servers on loopback: MD's
ControlServer and P's PrefillControlServer refuse unsigned calls (401, nothing changes), bad
Content-Length and bodies before reading them, malformed room ids with 400 (not 500), a full
room table with 503, and never put internals in a reply; P takes only its configured WAN
peers; the router's clients sign; nothing binds every interface unless asked to."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Optional
from urllib.parse import urlsplit

import aiohttp
import pytest
import torch
from tests.support.control_fakes import KEY, WAN_PEER, MdControl, PControl, exchange_raw
from tests.support.waiting import wait_until

from sglang_pdd.admission import AdmissionPolicy, source_of
from sglang_pdd.config import PddConfig, PddConfigError, validate
from sglang_pdd.control.auth import ROLE_MD, ROLE_P, ControlSigner
from sglang_pdd.launcher.http import call_json, get_json
from sglang_pdd.protocol import HandoffRequest, RegisterRequest, ReleaseRequest
from sglang_pdd.router.backends.clients import BackendError, MainControl, PrefillControl
from sglang_pdd.sglang_glue.p.wan_fanout import WanDestination, WanFanout


@pytest.fixture(scope="module")
def md_server():
    # 127.0.0.2 at the same port: the on-path relay below (a proxy's name, --pdd-control-names)
    server = MdControl(names=("127.0.0.1", "127.0.0.2"))
    yield server
    server.close()


@pytest.fixture
def md(md_server):
    md_server.reset()  # a fresh room table; the server itself is shared (start/stop costs ~1 s)
    return md_server


@pytest.fixture(scope="module")
def p():
    """Shared by the tests below, each on its own room ids."""
    server = PControl()
    yield server
    server.close()


def signed_request(url: str, method: str, target: str, body: bytes = b"", role: str = ROLE_MD,
                   length: Optional[int] = None, host: Optional[str] = None) -> bytes:
    """The raw bytes of a request signed as the router signs it (Host included). ``length``:
    the head alone, announcing (and signing) a body of that many spaces still to come;
    ``host``: addressed to another server than ``url``'s."""
    host = host or urlsplit(url).netloc
    signed_body = body if length is None else b" " * length
    auth = ControlSigner(KEY, role=role).header(method, target, signed_body, host=host)["Authorization"]
    return (b"%s %s HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\nAuthorization: %s\r\n\r\n"
            % (method.encode(), target.encode(), host.encode(), len(signed_body), auth.encode())
            + (body if length is None else b""))


def raw(url: str, request: bytes, timeout: float = 5.0) -> tuple[int, bytes]:
    """Send bytes as they are (no client fixes the headers up); (status, body)."""
    u = urlsplit(url)
    head, _, body = exchange_raw(u.hostname, u.port, request, timeout).partition(b"\r\n\r\n")
    return int(head.split()[1]), body


# ---------------------------------------------------------------------------- 1. authentication
MD_CALLS = [
    ("POST", "/pdd/rooms", {"room": 5, "token_ids": [1, 2, 3]}),
    ("GET", "/pdd/rooms/5/ready?timeout_s=0", None),
    ("POST", "/pdd/rooms/5/handoff", {"token_ids": [4], "sampling_params": {"max_new_tokens": 9}}),
    ("DELETE", "/pdd/rooms/5?keep_kv=0", None),
    ("GET", "/pdd/stats", None),
]


@pytest.mark.parametrize("method,path,body", MD_CALLS, ids=[c[1] for c in MD_CALLS])
def test_md_refuses_every_unsigned_or_wrongly_signed_call_and_changes_nothing(md, method, path, body):
    md.runtime.register(RegisterRequest(5, [1, 2, 3]))
    md.runtime.mark_ready(5)  # a victim's room, ready for its handoff
    before = md.runtime.state()
    for key in (None, b"w" * 32):
        status, reply = call_json(method, md.url + path, body, key=key)
        assert status == 401 and "sign" in reply["error"], (key, reply)
    assert md.runtime.state() == before
    assert md.generate.requests == []  # the handoff never reached MD's /generate
    assert call_json("GET", md.url + "/health")[0] == 200  # health stays open


def test_md_serves_signed_calls_end_to_end(md):
    status, reg = call_json("POST", md.url + "/pdd/rooms", {"room": 9, "token_ids": [1, 2, 3]}, key=KEY)
    assert status == 200 and reg["prompt_tokens"] == 3
    md.runtime.mark_ready(9)
    assert call_json("GET", md.url + "/pdd/rooms/9/ready?timeout_s=1", key=KEY) == (200, {
        "room": 9, "status": "ready", "reason": ""})
    status, stats = call_json("GET", md.url + "/pdd/stats", key=KEY)
    assert status == 200 and stats["open_rooms"] == 1
    assert call_json("DELETE", md.url + "/pdd/rooms/9?keep_kv=0", key=KEY) == (200, {"released": True})


def test_a_captured_signed_call_cannot_be_replayed(md):
    request = signed_request(md.url, "POST", "/pdd/rooms", json.dumps({"room": 3, "token_ids": [1]}).encode())
    assert raw(md.url, request)[0] == 200
    md.runtime.release(ReleaseRequest(3))
    status, reply = raw(md.url, request)
    assert status == 401 and b"replayed" in reply
    assert 3 not in md.runtime.table.rooms


def test_p_refuses_unsigned_destinations_and_withdrawals(p):
    dest = {"bootstrap_room": 1, "md_room": 1, "wan_peer": "%s:%d" % WAN_PEER, "md_prefix_len": 0}
    assert call_json("POST", p.url + "/pdd/wan_destinations", dest)[0] == 401
    assert call_json("DELETE", p.url + "/pdd/wan_destinations/1")[0] == 401
    assert call_json("GET", p.url + "/pdd/stats")[0] == 401
    got = []
    assert p.board.wait_for(1, got.append) is None  # nothing was posted for room 1
    assert call_json("POST", p.url + "/pdd/wan_destinations", dest, key=KEY) == (200, {"accepted": True})
    assert got == [WanDestination(1, WAN_PEER, 0)]


# ---------------------------------------------------------------------------- 3. WAN peers
def test_p_control_refuses_a_destination_outside_its_wan_peers(p):
    for peer in ("10.9.9.9:18000", "127.0.0.1:18001", "metadata.internal:80"):
        dest = {"bootstrap_room": 2, "md_room": 2, "wan_peer": peer, "md_prefix_len": 0}
        status, reply = call_json("POST", p.url + "/pdd/wan_destinations", dest, key=KEY)
        assert status == 403 and "--pdd-wan-peers" in reply["error"]
    got = []
    assert p.board.wait_for(2, got.append) is None and got == []


def test_fanout_never_dials_or_keeps_a_sender_for_an_unlisted_peer():
    dialed = []
    fanout = WanFanout(b"k" * 32, "p", allowed_peers=[WAN_PEER], sender_factory=dialed.append)

    class Pool:  # the smallest MHA pool kv_layout_of accepts
        k_buffer = [torch.zeros(8, 1, 2, dtype=torch.float16)]
        v_buffer = [torch.zeros(8, 1, 2, dtype=torch.float16)]

    fanout.attach_pool(Pool(), 1)
    threads = threading.active_count()
    for i in range(50):  # 50 arbitrary peers from requests' custom_params
        dest = WanDestination(i, (f"10.0.{i}.1", 9000 + i), 0)
        assert fanout.open_room(dest, rid=f"r{i}", token_ids=[1, 2, 3], first_offered_page=0) is None
    assert dialed == [] and fanout.stats()["refused_peer"] == 50
    assert threading.active_count() == threads
    fanout.close()


@pytest.mark.parametrize("params,match", [
    ({"pdd_wan_peer": "h:1", "pdd_room": "abc"}, "pdd_room"),
    ({"pdd_wan_peer": "h:1", "pdd_room": 10 ** 40}, "pdd_room"),
    ({"pdd_wan_peer": "h:1", "pdd_room": True}, "pdd_room"),
    ({"pdd_wan_peer": "h:1", "pdd_room": 1, "pdd_md_prefix_len": "x"}, "pdd_md_prefix_len"),
    ({"pdd_wan_peer": "nohost", "pdd_room": 1}, "HOST:PORT"),
])
def test_malformed_destinations_in_custom_params_are_refused_clearly(params, match):
    with pytest.raises(ValueError, match=match):
        WanDestination.from_custom_params(params)


# ---------------------------------------------------------------------------- 4. input limits
@pytest.mark.parametrize("length,status", [("-1", 400), ("abc", 400), ("1e3", 400), ("0x10", 400),
                                           ("99999999999", 413), (None, 411)])
def test_bad_content_length_is_refused_before_reading(md, p, length, status):
    for server, path, cap in ((md, "/pdd/rooms", 16 << 20), (p, "/pdd/wan_destinations", 64 << 10)):
        header = b"" if length is None else b"Content-Length: %s\r\n" % length.encode()
        got, body = raw(server.url, b"POST %s HTTP/1.1\r\nHost: x\r\n%s\r\n{}" % (path.encode(), header))
        assert got == status, (server, body)
        assert b"Content-Length" in body or b"exceeds" in body


def test_oversized_body_is_refused_with_413(p):
    status, reply = call_json("POST", p.url + "/pdd/wan_destinations", b"x" * (64 * 1024 + 1), key=KEY)
    assert status == 413 and "exceeds" in reply["error"]


@pytest.mark.parametrize("path", ["/pdd/rooms/abc/ready", "/pdd/rooms/-1/ready", "/pdd/rooms/%C2%B2/ready",
                                  "/pdd/rooms/99999999999999999999999/ready", "/pdd/rooms//ready"])
def test_malformed_room_ids_are_400_not_500(md, path):
    status, reply = call_json("GET", md.url + path, key=KEY)
    assert status == 400 and "room id" in reply["error"]


@pytest.mark.parametrize("method,path,body,needle", [
    ("POST", "/pdd/rooms", {"room": True, "token_ids": [1]}, "'room'"),
    ("POST", "/pdd/rooms", {"room": 1, "token_ids": [10 ** 30]}, "token_ids"),
    ("POST", "/pdd/rooms", {"room": 1, "token_ids": []}, "token_ids"),
    ("POST", "/pdd/rooms", {"room": 1, "token_ids": [1], "use_cache": "no"}, "use_cache"),
    ("POST", "/pdd/rooms", b"[" * 50000, "JSON"),
    ("GET", "/pdd/rooms/1/ready?timeout_s=nan", None, "timeout_s"),
    ("GET", "/pdd/rooms/1/ready?timeout_s=-1", None, "timeout_s"),
    ("GET", "/pdd/rooms/1/ready?timeout_s=inf", None, "timeout_s"),
    ("DELETE", "/pdd/rooms/1?keep_kv=yes", None, "keep_kv"),
])
def test_malformed_md_calls_name_the_field(md, method, path, body, needle):
    status, reply = call_json(method, md.url + path, body, key=KEY)
    assert status == 400 and needle in reply["error"], reply
    assert md.runtime.table.rooms == {}


def test_full_room_table_answers_503(md):
    md.runtime.table.max_rooms = 2
    for room in (1, 2):
        assert call_json("POST", md.url + "/pdd/rooms", {"room": room, "token_ids": [1]}, key=KEY)[0] == 200
    status, reply = call_json("POST", md.url + "/pdd/rooms", {"room": 3, "token_ids": [1]}, key=KEY)
    assert status == 503 and "too many open rooms" in reply["error"]


def test_internal_errors_are_logged_not_sent(md, caplog):
    md.runtime.fail_stats_with = RuntimeError("secret internals at 0xdeadbeef")
    status, reply = call_json("GET", md.url + "/pdd/stats", key=KEY)
    assert status == 500 and "deadbeef" not in json.dumps(reply) and "Traceback" not in json.dumps(reply)
    assert "log" in reply["error"]
    assert any("deadbeef" in (r.exc_text or str(r.exc_info)) for r in caplog.records if r.exc_info)


def test_connections_past_the_cap_get_503_not_a_thread():
    server = MdControl(max_connections=2)
    try:
        u = urlsplit(server.url)
        held = [socket.create_connection((u.hostname, u.port)) for _ in range(2)]
        # both accepted, each holding a handler thread (no request yet)
        assert wait_until(lambda: server.server.httpd.in_use == 2)
        status, body = raw(server.url, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 503 and b"retry" in body
        for s in held:
            s.close()
        assert wait_until(lambda: server.server.httpd.in_use == 0)
        assert raw(server.url, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")[0] == 200
    finally:
        server.close()


def test_a_connection_refused_at_the_cap_is_counted_in_the_servers_stats():
    """The one place the busy refusals are read: the control server's stats (MD's and P's
    /pdd/stats under control_server)."""
    server = MdControl(max_connections=1)
    try:
        u = urlsplit(server.url)
        held = socket.create_connection((u.hostname, u.port))
        assert wait_until(lambda: server.server.httpd.in_use == 1)
        assert server.server.httpd.stats()["refused_busy"] == 0
        assert raw(server.url, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")[0] == 503
        assert wait_until(lambda: server.server.httpd.stats()["refused_busy"] == 1)
        held.close()
    finally:
        server.close()


# ---------------------------------------------------------------------------- router side
def test_router_clients_sign_and_unsigned_clients_are_refused(md, p):
    async def run():
        async with aiohttp.ClientSession() as session:
            signer = ControlSigner(KEY)
            mc = MainControl(session, md.url, signer=signer)
            reg = await mc.register(21, [5, 6, 7])
            assert reg.prompt_tokens == 3
            md.runtime.mark_ready(21)
            assert (await mc.wait_ready(21, 1.0)).status == "ready"
            assert (await mc.stats())["open_rooms"] == 1
            events = [e async for e in mc.handoff_stream(21, HandoffRequest([8]))]
            assert events[-1]["output_ids"] == [7, 8]
            assert md.generate.requests[0]["input_ids"] == [5, 6, 7, 8]  # the room's prompt + eager token
            await mc.release(21)
            assert 21 not in md.runtime.table.rooms
            pc = PrefillControl(session, p.url, signer=ControlSigner(KEY, role=ROLE_P))
            assert await pc.set_wan_destination(4, 4, "%s:%d" % WAN_PEER, 0) == {"accepted": True}
            await pc.drop_wan_destination(5)
            with pytest.raises(BackendError, match="403"):
                await pc.set_wan_destination(6, 6, "10.1.1.1:1", 0)
            with pytest.raises(BackendError, match="401"):
                await MainControl(session, md.url, signer=None).register(22, [1])
            assert 22 not in md.runtime.table.rooms

    asyncio.run(run())
    assert p.board.wait_for(5, lambda v: None) is not None  # the signed withdrawal arrived


# ---------------------------------------------------------------------------- 2. interfaces
@pytest.mark.parametrize("cfg", [
    PddConfig(role="main", wan_listen="0.0.0.0:1", control_listen="10.0.0.1:2", wan_key_file="k"),
    PddConfig(role="main", wan_listen="10.0.0.1:1", control_listen="0.0.0.0:2", wan_key_file="k"),
    PddConfig(role="main", wan_listen="10.0.0.1:1", control_listen=":::2", wan_key_file="k"),
    PddConfig(role="prefill", control_listen="0.0.0.0:2", wan_key_file="k"),
])
def test_wildcard_binds_are_refused_unless_allowed(cfg):
    mode = "prefill" if cfg.role == "prefill" else None
    with pytest.raises(PddConfigError, match="--pdd-allow-wildcard-bind"):
        validate(cfg, mode)
    validate(PddConfig(**{**cfg.__dict__, "allow_wildcard_bind": True}), mode)


def test_wan_peers_flag_is_checked_and_only_for_prefill():
    validate(PddConfig(role="prefill", wan_key_file="k", wan_peers="10.0.0.1:18000, md2:18000"), "prefill")
    with pytest.raises(PddConfigError, match="--pdd-wan-peers"):
        validate(PddConfig(role="prefill", wan_key_file="k", wan_peers="10.0.0.1"), "prefill")
    with pytest.raises(PddConfigError, match="--pdd-wan-peers applies only"):
        validate(PddConfig(role="main", wan_listen="h:1", control_listen="h:2", wan_key_file="k",
                           wan_peers="h:3"), None)


def test_local_topology_wires_the_key_and_the_wan_peer(tmp_path):
    from sglang_pdd.launcher.topology import Topology, router_argv, server_argv

    topo = Topology.on_free_ports()
    topo.key_file = str(tmp_path / "wan.key")
    p_argv = server_argv(topo.prefill, "m", topo.key_file)
    assert p_argv[p_argv.index("--pdd-wan-peers") + 1] == f"127.0.0.1:{topo.wan.listen_port}"
    r_argv = router_argv(topo, "m")
    assert r_argv[r_argv.index("--control-key-file") + 1] == topo.key_file
    # what the router dials as MD's WAN address is exactly P's one peer
    assert r_argv[r_argv.index("--main") + 1].split(",")[2] == p_argv[p_argv.index("--pdd-wan-peers") + 1]
    for argv in (p_argv, server_argv(topo.main, "m", topo.key_file), r_argv):
        assert not any(a.startswith("0.0.0.0") for a in argv)


def test_refusal_warnings_are_rate_limited(caplog):
    from sglang_pdd.control.gate import _RefusalLog

    clock = [0.0]
    log = _RefusalLog(burst=3, period_s=10, clock=lambda: clock[0])
    with caplog.at_level("WARNING", logger="sglang_pdd.control.gate"):
        for i in range(100):
            log.warn("refused %d", i)
        clock[0] = 11
        log.warn("refused %d", 100)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["refused 0", "refused 1", "refused 2", "control: 97 more refused requests not logged",
                     "refused 100"]


def test_router_will_not_start_unable_to_sign():
    from sglang_pdd.router.front.cli import main

    with pytest.raises(SystemExit, match="--control-key-file is required"):
        main(["--tokenizer-path", "m", "--relay", "http://r:1", "--prefill", "http://p:1,10",
              "--main", "http://md:1,http://md:2,md:3"])


# ---------------------------------------------------------------------------- pre-auth memory
def first_reply(url: str, request: bytes, timeout: float = 5.0, source: Optional[str] = None) -> tuple[int, bytes]:
    """Send ``request`` and keep the connection open for writing (a client still to send its
    body): the server's answer, read until it closes; socket.timeout if it waits for the body."""
    u = urlsplit(url)
    data = exchange_raw(u.hostname, u.port, request, timeout, finish_body=False, source=source)
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), head + b"\r\n\r\n" + body


def shaped_header(ts=None, version=2) -> bytes:
    """A header of the right shape and time that anyone can write without the key (``version``
    1: the format the servers took before the head was signed as a whole)."""
    ts = int(time.time()) if ts is None else ts
    if version == 1:
        return b"Authorization: PDD-HMAC-SHA256 ts=%d,nonce=%s,sig=%s\r\n" % (ts, b"0" * 32, b"0" * 64)
    return b"Authorization: PDD-HMAC-SHA256 v=2,ts=%d,nonce=%s,body=%s,sig=%s\r\n" % (ts, b"0" * 32, b"0" * 64,
                                                                                      b"0" * 64)


@pytest.mark.parametrize("auth", [b"", shaped_header(ts=1), b"Authorization: PDD-HMAC-SHA256 garbage\r\n"],
                         ids=["unsigned", "stale", "malformed"])
def test_unsigned_requests_are_refused_before_the_body_is_read(md, auth):
    # 16 MiB announced, none sent: the answer must come without waiting for (or buffering) it
    status, reply = first_reply(md.url, b"POST /pdd/rooms HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%s\r\n"
                                % (16 << 20, auth))
    assert status == 401, reply
    assert md.server.httpd.body_budget.held == 0


def test_a_body_over_the_routes_cap_is_refused_before_reading(md):
    status, reply = first_reply(md.url, b"DELETE /pdd/rooms/1 HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%s\r\n"
                                % (1 << 20, shaped_header()))
    assert status == 413, reply


def trickle_signed(url: str, length: int, source: str = "127.0.0.1", target: str = "/pdd/rooms") -> socket.socket:
    """A validly signed POST head announcing ``length`` bytes, then one byte of its body: the
    rest is to trickle in (a socket the caller closes)."""
    u = urlsplit(url)
    s = socket.create_connection((u.hostname, u.port), timeout=5, source_address=(source, 0))
    s.sendall(signed_request(url, "POST", target, length=length) + b" ")
    return s


def test_bodies_being_read_share_one_byte_budget():
    server = MdControl(max_body_bytes_in_flight=1 << 20, trusted_sources="127.0.0.1")
    try:
        budget = server.server.httpd.body_budget
        slow = trickle_signed(server.url, 800 << 10)  # a signed head; its body trickles in
        assert wait_until(lambda: budget.held == 800 << 10)
        status, reply = first_reply(server.url, signed_request(server.url, "POST", "/pdd/rooms", length=400 << 10))
        assert status == 503 and b"Retry-After: 1" in reply and b"retry" in reply
        # a small signed call still fits, and is served
        assert call_json("POST", server.url + "/pdd/rooms", {"room": 1, "token_ids": [1]}, key=KEY)[0] == 200
        slow.close()  # its reservation goes with it
        assert wait_until(lambda: budget.held == 0)
    finally:
        server.close()


def test_one_source_holds_at_most_its_share_of_the_body_budget():
    """Bodies of signed heads from one source that is not allow-listed hold at most half the
    budget; other sources (and an allow-listed router) still get theirs."""
    server = MdControl(max_body_bytes_in_flight=1 << 20, trusted_sources="127.0.0.3")
    held = []
    try:
        budget = server.server.httpd.body_budget
        held.append(trickle_signed(server.url, 400 << 10, source="127.0.0.2"))
        assert wait_until(lambda: budget.held == 400 << 10)
        status, _ = first_reply(server.url, signed_request(server.url, "POST", "/pdd/rooms", length=200 << 10),
                                source="127.0.0.2")
        assert status == 503  # 600 KiB would pass its 512 KiB share
        held.append(trickle_signed(server.url, 400 << 10, source="127.0.0.4"))  # another source: its own share
        assert wait_until(lambda: budget.held == 800 << 10)
        for s in held[1:]:
            s.close()
        assert wait_until(lambda: budget.held == 400 << 10)
        held.append(trickle_signed(server.url, 600 << 10, source="127.0.0.3"))  # allow-listed: no share of its own
        assert wait_until(lambda: budget.held == 1000 << 10)
    finally:
        for s in held:
            s.close()
        server.close()


def test_a_trickled_body_is_cut_off_at_the_total_deadline(md, monkeypatch):
    monkeypatch.setattr(md.server.httpd.RequestHandlerClass, "body_deadline_s", 0.5)
    u = urlsplit(md.url)
    with socket.create_connection((u.hostname, u.port), timeout=5) as s:
        s.sendall(signed_request(md.url, "POST", "/pdd/rooms", length=100))
        data, start = b"", time.monotonic()
        while not data and time.monotonic() - start < 4:  # one byte at a time, each well within the read timeout
            s.sendall(b" ")
            s.settimeout(0.1)
            try:
                data = s.recv(65536)
            except socket.timeout:
                pass
    assert data.split()[1] == b"408", data


# ---------------------------------------------------------------------------- replies on the path
class Relay:
    """An on-path relay in front of MD's control URL: it listens where the router dials MD
    (127.0.0.2, at MD's port: a name MD answers to) and forwards each request as it is (Host
    and signature unchanged, so the router's signature stays valid) to MD, handing MD's
    reply to ``rewrite(path, body, headers)``, which returns the (body, headers) the router
    then gets."""

    def __init__(self, target: str, rewrite):
        self.target, self.rewrite = target, rewrite

    async def __aenter__(self):
        from aiohttp import web

        async def forward(request: web.Request) -> web.Response:
            headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type", "host")}
            async with aiohttp.ClientSession() as s, s.request(request.method, self.target + request.path_qs,
                                                                data=await request.read(), headers=headers) as r:
                body, got = await r.read(), {k: v for k, v in r.headers.items()
                                             if k.lower() in ("content-type", "x-pdd-reply-signature")}
                status = r.status
            body, got = self.rewrite(request.path, body, got)
            return web.Response(status=status, body=body, headers=got)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", forward)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = urlsplit(self.target).port
        site = web.TCPSite(self.runner, "127.0.0.2", port)
        await site.start()
        self.url = "http://127.0.0.2:%d" % port
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()


def _raise_tp(path, body, headers):
    if path == "/pdd/rooms":
        body = json.dumps({**json.loads(body), "tp_size": 8}).encode()  # within --max-md-tp: the MAC must catch it
    return body, headers


def _rewrite_tokens(path, body, headers):
    return body.replace(b"[7", b"[9"), headers


def _cut_before_done(path, body, headers):
    return body[:body.find(b"data: [DONE]")] if b"[DONE]" in body else body, headers


@pytest.mark.parametrize("rewrite,call", [
    (_raise_tp, "register"), (_rewrite_tokens, "handoff_stream"), (_cut_before_done, "handoff_stream"),
    (_rewrite_tokens, "handoff"),
], ids=["registration-tp_size", "handoff-stream-tokens", "handoff-stream-cut", "handoff-json-tokens"])
def test_a_relay_cannot_alter_mds_replies(md, rewrite, call):
    async def run():
        async with aiohttp.ClientSession() as session, Relay(md.url, rewrite) as relay:
            signer = ControlSigner(KEY)
            direct, relayed = MainControl(session, md.url, signer=signer), MainControl(session, relay.url, signer=signer)
            if call == "register":
                with pytest.raises(BackendError, match="reply signature"):
                    await relayed.register(31, [5, 6, 7])
                return
            await direct.register(31, [5, 6, 7])
            md.runtime.mark_ready(31)
            with pytest.raises(BackendError, match="signature|signed end"):
                if call == "handoff":
                    await relayed.handoff(31, HandoffRequest([8], warmup=True))
                else:
                    [e async for e in relayed.handoff_stream(31, HandoffRequest([8]))]

    asyncio.run(run())


def test_md_handoff_relay_sends_mds_own_api_key(md):
    """MD with SGLang's --api-key guards its /generate; the handoff relayed there must carry
    it (else every handoff is a 401 and every request ends on RLD)."""

    async def run():
        async with aiohttp.ClientSession() as session:
            mc = MainControl(session, md.url, signer=ControlSigner(KEY))
            for room, key in ((41, None), (42, "md-api-key-0123456789")):
                md.runtime.http_api_key = key
                await mc.register(room, [5, 6, 7])
                md.runtime.mark_ready(room)
                [e async for e in mc.handoff_stream(room, HandoffRequest([8]))]

    asyncio.run(run())
    assert md.generate.authorization == [None, "Bearer md-api-key-0123456789"]


def test_a_signed_reply_does_not_answer_another_request(md):
    """The relay serves a reply recorded for one call (same body) to the next one."""
    recorded = {}

    def replay_first(path, body, headers):
        recorded.setdefault(path, (body, headers))
        return recorded[path]

    async def run():
        async with aiohttp.ClientSession() as session, Relay(md.url, replay_first) as relay:
            mc = MainControl(session, relay.url, signer=ControlSigner(KEY))
            assert (await mc.stats())["open_rooms"] == 0  # the first, genuine
            assert await mc.stats() is None  # the same bytes, for another request: refused

    asyncio.run(run())


def test_p_and_the_router_bound_md_tp_by_their_own_configuration():
    server = PControl(max_md_tp=8)
    try:
        dest = {"bootstrap_room": 41, "md_room": 41, "wan_peer": "%s:%d" % WAN_PEER, "md_prefix_len": 0}
        status, reply = call_json("POST", server.url + "/pdd/wan_destinations", {**dest, "md_tp": 9}, key=KEY)
        assert status == 400 and "--pdd-max-md-tp" in reply["error"]
        assert call_json("POST", server.url + "/pdd/wan_destinations", {**dest, "md_tp": 8}, key=KEY)[0] == 200
    finally:
        server.close()
    with pytest.raises(PddConfigError, match="--pdd-max-md-tp"):
        validate(PddConfig(role="prefill", max_md_tp=65, wan_key_file="k"), "prefill")
    with pytest.raises(PddConfigError, match="--pdd-max-md-tp applies only"):
        validate(PddConfig(role="main", max_md_tp=4, wan_listen="10.0.0.1:1", control_listen="10.0.0.1:2",
                           wan_key_file="k"), "null")
    from sglang_pdd.router.backends import clients as backends
    from sglang_pdd.router.front.cli import parse_args

    base = ["--tokenizer-path", "m", "--relay", "http://r:1", "--prefill", "http://p:1,10"]
    assert parse_args(base + ["--max-md-tp", "4"]).max_md_tp == 4 and parse_args(base).max_md_tp == 8
    assert backends.md_tp_of({"tp_size": 8}) == 8
    with pytest.raises(BackendError, match="--max-md-tp"):
        backends.md_tp_of({"tp_size": 9})
    with pytest.raises(BackendError):
        backends.md_tp_of({"tp_size": 5}, max_md_tp=4)


def test_calls_signed_for_md_are_refused_by_p_and_the_reverse(md, p):
    """One shared key, two role keys: what MD received cannot be replayed to P."""
    for server, path, own, other in ((md, "/pdd/stats", ROLE_MD, ROLE_P), (p, "/pdd/stats", ROLE_P, ROLE_MD),
                                     (p, "/pdd/info", ROLE_P, ROLE_MD)):
        for role, want in ((other, 401), (own, 200)):
            status, _ = raw(server.url, signed_request(server.url, "GET", path, role=role))
            assert status == want, (server, path, role)
    body = json.dumps({"bootstrap_room": 51, "md_room": 51, "wan_peer": "%s:%d" % WAN_PEER,
                       "md_prefix_len": 0}).encode()
    status, _ = raw(p.url, signed_request(p.url, "POST", "/pdd/wan_destinations", body, role=ROLE_MD))
    assert status == 401 and p.board.wait_for(51, lambda v: None) is None


@pytest.mark.parametrize("version", [1, 2], ids=["v1-shape", "v2-shape"])
def test_forged_heads_reserve_nothing_and_genuine_registrations_are_served(version):
    """The starvation attack: POSTs announcing MD's 16 MiB cap under a signature header of the
    right shape and a fresh time (anyone can write one), their bodies never sent. Each used
    to reserve its length from the 64 MiB budget until the body came or 30 s passed: four of
    them made genuine registrations answer 503 (measured: 0 of 75 served). Now each is refused
    (401) on its head, before anything is reserved, and memory does not follow the lengths."""
    import tracemalloc

    server = MdControl()
    held = []
    tracemalloc.start()
    try:
        u = urlsplit(server.url)
        budget = server.server.httpd.body_budget
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(24):
            s = socket.create_connection((u.hostname, u.port), timeout=5, source_address=("127.0.0.2", 0))
            s.sendall(b"POST /pdd/rooms HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n%s\r\n{"
                      % (u.netloc.encode(), 16 << 20, shaped_header(version=version)))
            held.append(s)
        for s in held:
            s.settimeout(5)
            assert s.recv(65536).split()[1] == b"401"
        assert budget.held == 0
        for room in range(1, 21):
            status, _ = call_json("POST", server.url + "/pdd/rooms", {"room": room, "token_ids": [1, 2]}, key=KEY)
            assert status == 200, room
        assert tracemalloc.get_traced_memory()[0] - before < 8 << 20
    finally:
        tracemalloc.stop()
        for s in held:
            s.close()
        server.close()


def test_forged_heads_reserve_nothing_on_ps_api(p):
    """The same on P's API: 64 sockets announcing its 64 KiB cap used to fill its 4 MiB budget
    (0 of 75 destinations served); now they get 401 and destinations are served."""
    u = urlsplit(p.url)
    held = []
    try:
        for _ in range(64):
            s = socket.create_connection((u.hostname, u.port), timeout=5, source_address=("127.0.0.2", 0))
            s.sendall(b"POST /pdd/wan_destinations HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n%s\r\n"
                      % (u.netloc.encode(), 64 << 10, shaped_header(version=1)))
            held.append(s)
        assert p.server.httpd.body_budget.held == 0
        for room in range(300, 310):
            dest = {"bootstrap_room": room, "md_room": room, "wan_peer": "%s:%d" % WAN_PEER, "md_prefix_len": 0}
            assert call_json("POST", p.url + "/pdd/wan_destinations", dest, key=KEY)[0] == 200
    finally:
        for s in held:
            s.close()


def test_a_body_not_the_one_signed_is_refused_after_reading(md):
    """The head verifies; the body that follows must hash to what it announced."""
    head = signed_request(md.url, "POST", "/pdd/rooms", json.dumps({"room": 8, "token_ids": [1]}).encode())
    altered = head.replace(b'"room": 8', b'"room": 9')
    status, reply = raw(md.url, altered)
    assert status == 401 and b"not the one signed" in reply
    assert 9 not in md.runtime.table.rooms and 8 not in md.runtime.table.rooms


def test_a_call_signed_for_one_md_is_refused_by_another(md):
    """A registration captured on its way to one MD, replayed within the window to another
    MD with the same key: the Host it was signed for is not the other's name (it used to be
    served). The signature covers Host, so rewriting it breaks the MAC."""
    other = MdControl()
    try:
        body = json.dumps({"room": 12, "token_ids": [1, 2]}).encode()
        captured = signed_request(md.url, "POST", "/pdd/rooms", body)
        status, reply = raw(other.url, captured)
        assert status == 401 and b"another server" in reply
        rewritten = captured.replace(urlsplit(md.url).netloc.encode(), urlsplit(other.url).netloc.encode())
        status, reply = raw(other.url, rewritten)
        assert status == 401 and b"bad signature" in reply
        assert other.runtime.state() == {}
        assert raw(md.url, captured)[0] == 200  # the MD it was for serves it
    finally:
        other.close()


def test_a_server_answers_to_the_names_it_is_given(md):
    """--pdd-control-names (a proxy's or a DNS name): the router's URL may name MD so."""
    named = MdControl(names=("md-ctl.example", "127.0.0.1"))
    try:
        port = named.server.address[1]
        for host, want in ((f"md-ctl.example:{port}", 200), (f"MD-CTL.example:{port}", 200),
                           (f"127.0.0.1:{port}", 200), (f"md-ctl.example:{port + 1}", 401), ("evil:1", 401)):
            status, _ = raw(named.url, signed_request(named.url, "GET", "/pdd/stats", host=host))
            assert status == want, host
    finally:
        named.close()


def test_a_server_answers_to_a_proxys_name_at_the_proxys_port(md):
    """--pdd-control-names host:port: a TCP proxy on another port (a load balancer, the WAN
    emulator) forwards the Host the router signed, which names the proxy; only that authority
    is added, not the proxy's host at the server's own port."""
    named = MdControl(names=("md-ctl.example:8443", "[fd00::7]:9000"))
    try:
        port = named.server.address[1]
        for host, want in (("md-ctl.example:8443", 200), ("[fd00::7]:9000", 200), (f"md-ctl.example:{port}", 401),
                           ("md-ctl.example:8444", 401), ("[fd00::7]:8443", 401)):
            status, _ = raw(named.url, signed_request(named.url, "GET", "/pdd/stats", host=host))
            assert status == want, host
    finally:
        named.close()


# ---------------------------------------------------------------------------- connections before authentication
class Trickle:
    """``n`` sockets from ``sources`` (in turn) that each send a request line, then a byte of
    a header every ``every_s`` (slowloris), and reconnect as soon as the server cuts them."""

    def __init__(self, url: str, n: int, sources, every_s: float = 0.2):
        u = urlsplit(url)
        self.address, self.head = (u.hostname, u.port), b"GET /pdd/stats HTTP/1.1\r\nHost: %s\r\nX-Slow: " % u.netloc.encode()
        self.stop, self.every_s = threading.Event(), every_s
        self.connects = 0  # >= n: every socket connected once (a server under load accepts slowly)
        self.threads = [threading.Thread(target=self._one, args=(sources[i % len(sources)],), daemon=True)
                        for i in range(n)]
        for t in self.threads:
            t.start()

    def _one(self, source: str) -> None:
        while not self.stop.is_set():
            try:
                with socket.create_connection(self.address, timeout=2, source_address=(source, 0)) as s:
                    self.connects += 1
                    s.sendall(self.head)
                    while not self.stop.wait(self.every_s):
                        s.sendall(b"x")
            except OSError:  # cut off (refused, or the head deadline): again
                time.sleep(0.01)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(5)


def _signed_calls(url: str, n: int) -> list[int]:
    return [call_json("GET", url + "/pdd/stats", key=KEY, timeout=5)[0] for _ in range(n)]


def test_a_trickling_flood_from_one_host_leaves_signed_calls_served():
    """Slowloris with the connection cap lowered to 64: 70 sockets from one host trickling
    request heads held every slot, and 22 of 22 signed calls got 503. Now an unknown source
    holds at most 16 unauthenticated connections; its others are refused at once."""
    server = MdControl(max_connections=64)
    flood = Trickle(server.url, 70, ["127.0.0.2"])
    try:
        httpd = server.server.httpd
        assert wait_until(lambda: flood.connects >= 70, timeout=30)
        time.sleep(0.5)  # the flood in place
        assert _signed_calls(server.url, 22) == [200] * 22
        assert httpd.stats()["refused_per_source"] > 0 and httpd.stats()["handshaking_unknown"] <= 16
        # what an operator reads: MD's stats count the refusals
        assert get_json(server.url + "/pdd/stats", key=KEY)["control_server"]["refused_per_source"] > 0
    finally:
        flood.close()
        server.close()


def test_a_flood_from_many_hosts_leaves_the_reserved_slots_to_the_router():
    """Six attacker hosts fill the 48 slots unknown sources may hold (64 - 16 reserved); a new
    unknown host is refused, and the allow-listed router still gets every call served."""
    server = MdControl(max_connections=64, trusted_sources="127.0.0.1")
    flood = None
    try:
        flood = Trickle(server.url, 96, [f"127.0.0.{i}" for i in range(2, 8)])
        httpd = server.server.httpd
        assert wait_until(lambda: httpd.stats()["handshaking_unknown"] == 48 and httpd.stats()["refused_unknown"] > 0)
        status, body = first_reply(server.url, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", source="127.0.0.20")
        assert status == 503 and b"retry" in body
        assert _signed_calls(server.url, 22) == [200] * 22
    finally:
        if flood:
            flood.close()
        server.close()


def test_a_replay_does_not_make_its_source_a_known_peer():
    """A captured call replayed (its nonce used), its signed head sent with another body, or
    the captured call sent *before* the router's own copy (its nonce still new: it verifies
    and is served) all leave the sender's source unknown: only the allow-list is known."""
    server = MdControl(max_connections=64, trusted_sources="127.0.0.1")
    try:
        policy, now = server.server.httpd.policy, time.monotonic
        captured = signed_request(server.url, "POST", "/pdd/rooms", json.dumps({"room": 4, "token_ids": [1]}).encode())
        u = urlsplit(server.url)
        assert exchange_raw(u.hostname, u.port, captured).split()[1] == b"200"
        replayed = exchange_raw(u.hostname, u.port, captured, source="127.0.0.2")
        assert replayed.split()[1] == b"401" and b"replayed" in replayed
        head = signed_request(server.url, "POST", "/pdd/rooms", json.dumps({"room": 5, "token_ids": [1]}).encode())
        other_body = exchange_raw(u.hostname, u.port, head.replace(b'"room": 5', b'"room": 6'), source="127.0.0.3")
        assert other_body.split()[1] == b"401" and b"not the one signed" in other_body
        first = signed_request(server.url, "POST", "/pdd/rooms", json.dumps({"room": 7, "token_ids": [1]}).encode())
        assert exchange_raw(u.hostname, u.port, first, source="127.0.0.4").split()[1] == b"200"  # won the race
        assert exchange_raw(u.hostname, u.port, first).split()[1] == b"401"  # the router's copy: a replay now
        for source in ("127.0.0.2", "127.0.0.3", "127.0.0.4"):
            assert not policy.is_known(source_of(source), now()), source
        assert policy.is_known(source_of("127.0.0.1"), now())  # the allow-list
        assert policy.stats()["known_sources_remembered"] == 0
    finally:
        server.close()


def _promote(server, source: str) -> None:
    """What a relay on the control path does: sends a captured signed call ahead of the
    router's copy, from its own address (or one it controls). The call verifies and is served."""
    u = urlsplit(server.url)
    call = signed_request(server.url, "GET", "/pdd/stats")
    assert exchange_raw(u.hostname, u.port, call, source=source).split()[1] == b"200"


@pytest.mark.parametrize("attack", ["two promoted addresses", "one promoted plus 40 keyless hosts"])
def test_promoted_addresses_and_a_flood_leave_the_router_its_slots_at_default_limits(attack):
    """The review's attacks at MD's default limits (1024 connections: 16 per unknown source, a
    quarter reserved, half per allow-listed source): two addresses that each won a replay race
    x 560 trickling sockets, or one x 560 and 40 keyless hosts x 16, left the allow-listed
    router 1 of 15 calls (the replay had made each a known peer, 512 slots apiece). Admission
    as MD's server decides it, on the pure policy with the real server's limits; a promoted
    address is admitted as what a signed call makes it (an authenticated ticket)."""
    server = MdControl(trusted_sources="127.0.0.1")
    try:
        policy = AdmissionPolicy(server.server.httpd.policy.limits)
        assert policy.limits.max_handshaking == 1024
        promoted = ["10.9.0.1", "10.9.0.2"] if attack == "two promoted addresses" else ["10.9.0.1"]
        now = time.monotonic()
        for host in promoted:  # each sent a valid call first (what the server does with it)
            ticket = policy.admit(host, now)[0]
            policy.release(ticket)
            policy.authenticated(ticket, now)
        held = [policy.admit(host, now)[0] for host in promoted for _ in range(560)]
        if attack != "two promoted addresses":
            held += [policy.admit(f"10.8.0.{i}", now)[0] for i in range(40) for _ in range(16)]
        assert sum(t is not None for t in held) <= 1024 - 256  # the reserved quarter is left
        router = [policy.admit("127.0.0.1", now) for _ in range(15)]
        assert [t is not None for t, _, _ in router] == [True] * 15, router[-1]
    finally:
        server.close()


def test_a_promoted_address_gets_no_reserved_slot_on_a_real_server():
    """The same attack on real sockets (the cap lowered to 64): an address that won a replay
    race, then 96 trickling sockets from it and from five keyless hosts; the allow-listed
    router's calls are all served (the promoted address is one more unknown source)."""
    server = MdControl(max_connections=64, trusted_sources="127.0.0.1")
    flood = None
    try:
        httpd = server.server.httpd
        _promote(server, "127.0.0.2")
        assert not httpd.policy.is_known(source_of("127.0.0.2"), time.monotonic())
        flood = Trickle(server.url, 96, [f"127.0.0.{i}" for i in range(2, 8)])
        assert wait_until(lambda: httpd.stats()["handshaking_unknown"] == 48 and httpd.stats()["refused_unknown"] > 0)
        assert _signed_calls(server.url, 15) == [200] * 15
    finally:
        if flood:
            flood.close()
        server.close()


def test_a_trickled_request_head_is_cut_off_at_its_total_deadline(md, monkeypatch):
    """A head trickling a byte every 0.1 s (each read well within the 30 s read timeout) used
    to hold its connection for as long as it kept sending; now the head has a total deadline."""
    monkeypatch.setattr(md.server.httpd.RequestHandlerClass, "head_deadline_s", 0.5)
    before = md.server.httpd.stats()["head_timeouts"]
    u = urlsplit(md.url)
    start = time.monotonic()
    with socket.create_connection((u.hostname, u.port), timeout=5) as s:
        s.sendall(b"GET /pdd/stats HTTP/1.1\r\nHost: %s\r\nX-Slow: " % u.netloc.encode())
        closed = False
        while not closed and time.monotonic() - start < 4:
            try:
                s.sendall(b"x")
                s.settimeout(0.1)
                closed = s.recv(65536) == b""
            except socket.timeout:
                pass
            except OSError:
                closed = True
    assert closed and time.monotonic() - start < 2.0
    assert wait_until(lambda: md.server.httpd.stats()["head_timeouts"] > before)


def test_an_oversized_request_head_is_refused_with_431(md):
    """Headers past 64 KiB (each line and the count under http.server's own limits) are not
    buffered: 431, and the connection is closed."""
    headers = b"".join(b"X-Pad-%d: %s\r\n" % (i, b"a" * 4000) for i in range(20))
    status, body = raw(md.url, b"GET /pdd/stats HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
    assert status == 431 and b"too large" in body
    assert call_json("GET", md.url + "/pdd/stats", key=KEY)[0] == 200


# ---------------------------------------------------------------------------- the router's P hosts
def test_md_takes_the_p_hosts_the_router_names(md):
    """POST /pdd/kv_senders (signed): the router's P hosts become known peers of MD's WAN
    receiver; unsigned it changes nothing, malformed it is a 400 naming the problem."""
    hosts = {"sources": ["127.0.0.9", "2001:db8:1:2::7"]}
    assert call_json("POST", md.url + "/pdd/kv_senders", hosts)[0] == 401
    assert md.runtime.kv_senders == []
    assert call_json("POST", md.url + "/pdd/kv_senders", hosts, key=KEY) == (200, {"known": 2})
    assert md.runtime.kv_senders == [["127.0.0.9", "2001:db8:1:2::7"]]
    for bad, needle in (({"sources": ["p.example"]}, "not an IP"), ({"sources": "10.0.0.1"}, "list"),
                        ({"sources": ["10.0.0.1"] * 1025}, "at most"), ({}, "sources")):
        status, reply = call_json("POST", md.url + "/pdd/kv_senders", bad, key=KEY)
        assert status == 400 and needle in reply["error"], (bad, reply)
    assert len(md.runtime.kv_senders) == 1


@pytest.mark.parametrize("wide", ["0.0.0.0/0", "::/0", "0.0.0.0", "::", "10.0.0.0/8", "10.1.0.0/23",
                                  "2001:db8::/32", "2001:db8:1::/63"])
def test_md_refuses_wildcards_and_wide_networks_as_kv_senders(md, wide):
    """A key holder naming every address (0.0.0.0/0, ::/0) or a wide network as MD's P hosts
    made them all known KV peers, beside the one listed P: 400 naming the entry, and MD's
    known peers stay as they were. A host's own network (up to a /24, an IPv6 /64) is taken."""
    assert call_json("POST", md.url + "/pdd/kv_senders", {"sources": ["127.0.0.9"]}, key=KEY)[0] == 200
    status, reply = call_json("POST", md.url + "/pdd/kv_senders", {"sources": ["127.0.0.9", wide]}, key=KEY)
    assert status == 400 and wide in reply["error"] and "wide" in reply["error"], reply
    assert md.runtime.kv_senders == [["127.0.0.9"]]
    narrow = {"sources": ["10.1.2.0/24", "2001:db8:1:2::/64"]}
    assert call_json("POST", md.url + "/pdd/kv_senders", narrow, key=KEY) == (200, {"known": 2})


def test_p_and_md_answer_health_unsigned_with_one_body(md, p):
    """/health is the one route that needs no signature (probes carry no key); P and MD answer
    it with the same body, SGLang's shape, so one probe reads both."""
    for server in (md, p):
        status, body = raw(server.url, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (status, json.loads(body)) == (200, {"status": "ok"})
