"""P with ``--tp N``: one control API per TP rank (port + rank), and the router's PrefillControl
that finds the ranks (GET /pdd/info) and gives every one each WAN destination. Real servers on
loopback (PrefillControlServer per rank), no SGLang."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from sglang_pdd.control.auth import ROLE_P, ControlSigner
from sglang_pdd.launcher.http import call_json
from sglang_pdd.router.backends.clients import BackendError, PrefillControl, prefill_rank_url
from sglang_pdd.protocol import ControlError
from sglang_pdd.sglang_glue.p.prefill_control import DROPPED, DestinationBoard
from sglang_pdd.sglang_glue.p.wan_fanout import WanDestination
from tests.conftest import on_consecutive_ports
from tests.support.control_fakes import KEY, WAN_PEER, PControl

PEER = "%s:%d" % WAN_PEER
DEST = WanDestination(md_room=7, peer=WAN_PEER, md_prefix_len=3)


def tp_ranks(n: int, sends_wan=lambda rank: True):
    """n PControl ranks on consecutive ports (rank r on rank 0's port + r)."""
    return on_consecutive_ports(
        n, lambda: PControl(0, tp_rank=0, tp_size=n, sends_wan=sends_wan(0)),
        lambda rank, port: PControl(port, tp_rank=rank, tp_size=n, sends_wan=sends_wan(rank)),
        lambda first: first.server.address[1])


def run_with_control(url: str, body):
    """asyncio.run(body(control, info_requests)); info_requests counts GET /pdd/info sent."""
    info_requests = []

    async def on_start(session, ctx, params):
        if params.url.path == "/pdd/info":
            info_requests.append(str(params.url))

    async def main():
        trace = aiohttp.TraceConfig()
        trace.on_request_start.append(on_start)
        async with aiohttp.ClientSession(trace_configs=[trace]) as session:
            return await body(PrefillControl(session, url, signer=ControlSigner(KEY, role=ROLE_P)), info_requests)

    return asyncio.run(main())


def claimed(board: DestinationBoard, room: int):
    """What a sender on this rank would get for ``room`` now (None: nothing posted)."""
    return board.wait_for(room, lambda value: None)


# ---------------------------------------------------------------------------- P's side
def test_each_rank_reports_its_place_and_stats_name_it():
    with tp_ranks(2) as (r0, r1):
        assert call_json("GET", r1.url + "/pdd/info", key=KEY) == (
            200, {"tp_rank": 1, "tp_size": 2, "sends_wan": True})
        status, stats = call_json("GET", r0.url + "/pdd/stats", key=KEY, role=ROLE_P)
        assert status == 200 and stats["tp_rank"] == 0 and stats["tp_size"] == 2
        assert call_json("GET", r0.url + "/pdd/info")[0] == 401  # signed like every other route


def test_rank_that_sends_nothing_checks_and_acknowledges_but_keeps_nothing():
    p = PControl(tp_rank=1, tp_size=2, sends_wan=False)
    try:
        ok = {"bootstrap_room": 3, "md_room": 3, "wan_peer": PEER, "md_prefix_len": 0}
        assert call_json("POST", p.url + "/pdd/wan_destinations", ok, key=KEY) == (
            200, {"accepted": True, "sends_wan": False})
        assert call_json("POST", p.url + "/pdd/wan_destinations", ok, key=KEY)[0] == 200  # no 409: nothing kept
        status, body = call_json("POST", p.url + "/pdd/wan_destinations", {**ok, "wan_peer": "10.9.9.9:1"}, key=KEY)
        assert status == 403 and "--pdd-wan-peers" in body["error"]
        status, body = call_json("POST", p.url + "/pdd/wan_destinations", {**ok, "md_prefix_len": -1}, key=KEY)
        assert status == 400 and "md_prefix_len" in body["error"]
        assert call_json("POST", p.url + "/pdd/wan_destinations", ok)[0] == 401
        assert call_json("DELETE", p.url + "/pdd/wan_destinations/3", key=KEY) == (
            200, {"dropped": True, "sends_wan": False})
        assert call_json("DELETE", p.url + "/pdd/wan_destinations/x3", key=KEY)[0] == 400
        stats = p.board.stats()
        assert stats["waiting_destinations"] == 0 and "early" not in stats and "duplicate" not in stats
        assert claimed(p.board, 3) is None
    finally:
        p.close()


def test_unclaimed_destination_can_be_withdrawn_a_claimed_one_cannot():
    board = DestinationBoard()
    board.post(1, DEST)
    board.post(1, DROPPED)  # another rank refused it: nobody sends it here either
    assert claimed(board, 1) is DROPPED and board.stats()["withdrawn"] == 1
    board.post(2, DEST)
    assert claimed(board, 2) == DEST  # its sender has it (the KV is on its way)
    with pytest.raises(ControlError) as e:
        board.post(2, DROPPED)
    assert e.value.status == 409
    board.post(3, DROPPED)
    with pytest.raises(ControlError):  # a withdrawal is not withdrawn twice, nor replaced
        board.post(3, DEST)


# ---------------------------------------------------------------------------- the router's side
@pytest.mark.parametrize("url,rank,expected", [
    ("http://127.0.0.1:9000", 0, "http://127.0.0.1:9000"),
    ("http://127.0.0.1:9000", 3, "http://127.0.0.1:9003"),
    ("https://p.example", 1, "https://p.example:444"),
    ("http://[::1]:9000", 2, "http://[::1]:9002"),
])
def test_rank_urls_are_rank_0_port_plus_rank(url, rank, expected):
    assert prefill_rank_url(url, rank) == expected


def test_router_finds_the_ranks_once_and_gives_each_the_destination():
    with tp_ranks(2) as (r0, r1):
        async def body(pc, info_requests):
            sizes = await asyncio.gather(*(pc.tp_size() for _ in range(5)))
            assert sizes == [2] * 5 and len(info_requests) == 1  # concurrent first callers share one ask
            assert await pc.set_wan_destination(7, 7, PEER, 3) == {"accepted": True}
            other = PrefillControl(pc.session, r0.url, signer=pc.signer)  # the next request's
            await other.set_wan_destination(8, 8, PEER, 0)
            assert len(info_requests) == 1  # asked once per session, not per request
            await other.drop_wan_destination(9)

        run_with_control(r0.url, body)
        assert claimed(r0.board, 7) == DEST and claimed(r1.board, 7) == DEST
        assert claimed(r1.board, 8) == WanDestination(8, WAN_PEER, 0)
        assert claimed(r0.board, 9) is DROPPED and claimed(r1.board, 9) is DROPPED


def test_one_rank_refusing_fails_the_call_and_withdraws_it_from_the_others():
    with tp_ranks(2) as (r0, r1):
        r1.board.post(7, DEST)  # rank 1 already has one for room 7: it answers 409

        async def body(pc, info_requests):
            with pytest.raises(BackendError) as e:
                await pc.set_wan_destination(7, 7, PEER, 3)
            assert "TP rank 1" in str(e.value) and "409" in str(e.value)

        run_with_control(r0.url, body)
        assert claimed(r0.board, 7) is DROPPED  # rank 0 accepted it, then had it withdrawn
        assert r0.board.stats()["withdrawn"] == 1


def test_unreachable_rank_fails_the_call_and_withdraws_it_from_the_others():
    with tp_ranks(2) as (r0, r1):
        r1.close()  # rank 1's API is gone (its scheduler died)

        async def body(pc, info_requests):
            with pytest.raises(aiohttp.ClientError):
                await pc.set_wan_destination(7, 7, PEER, 3)

        run_with_control(r0.url, body)
        assert claimed(r0.board, 7) is DROPPED


def test_rank_that_sends_nothing_acknowledges_and_the_sending_rank_keeps_it():
    with tp_ranks(2, sends_wan=lambda rank: rank == 0) as (r0, r1):
        async def body(pc, info_requests):
            assert await pc.set_wan_destination(7, 7, PEER, 3) == {"accepted": True}
            await pc.drop_wan_destination(8)

        run_with_control(r0.url, body)
        assert claimed(r0.board, 7) == DEST and claimed(r0.board, 8) is DROPPED
        assert r1.board.stats()["waiting_destinations"] == 0 and claimed(r1.board, 7) is None


def test_unsigned_info_or_destination_replies_are_backend_failures():
    """A P that does not sign its replies (an older one, or a relay in front of P answering
    for it: 404 on /pdd/info, a forged tp_size or acceptance) is a failure, not one rank."""
    got = []

    async def body(_, info_requests):
        async def info(request):
            return web.json_response({"tp_rank": 0, "tp_size": 64, "sends_wan": True})

        async def destination(request):
            got.append(await request.json())
            return web.json_response({"accepted": True})

        for routes in ([], [("GET", "/pdd/info", info)]):
            app = web.Application()
            app.router.add_post("/pdd/wan_destinations", destination)
            for method, path, handler in routes:
                app.router.add_route(method, path, handler)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            url = "http://127.0.0.1:%d" % runner.addresses[0][1]
            try:
                async with aiohttp.ClientSession() as session:
                    pc = PrefillControl(session, url, signer=ControlSigner(KEY, role=ROLE_P))
                    with pytest.raises(BackendError):
                        await pc.tp_size()
                    with pytest.raises(BackendError):
                        await pc.set_wan_destination(7, 7, PEER, 3)
            finally:
                await runner.cleanup()

    asyncio.run(body(None, None))
    assert got == []


def test_failed_discovery_is_asked_again():
    with tp_ranks(1) as (r0,):
        port = r0.server.address[1]
    # P not up yet: the call fails (the flow falls back); once it is up, the router asks again.
    async def body(pc, info_requests):
        with pytest.raises(aiohttp.ClientError):
            await pc.set_wan_destination(7, 7, PEER, 3)
        late = PControl(port, tp_rank=0, tp_size=1)
        try:
            assert await pc.tp_size() == 1
            await pc.set_wan_destination(7, 7, PEER, 3)
            assert len(info_requests) == 2
            return late.board
        finally:
            late.close()

    board = run_with_control("http://127.0.0.1:%d" % port, body)
    assert claimed(board, 7) == DEST
