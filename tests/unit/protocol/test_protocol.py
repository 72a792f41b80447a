"""The control protocol (sglang_pdd/protocol): every message round-trips, the wire is what the
servers have always read, bad input is a ControlError with its 4xx status, and a new handoff
field is a change in one place: the protocol's type."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re

import aiohttp
import pytest
from tests.support.control_fakes import KEY, MdControl, PControl, WAN_PEER
from tests.support.fake_backends import Fakes

from sglang_pdd import protocol
from sglang_pdd.control.auth import ControlSigner
from sglang_pdd.launcher.http import call_json
from sglang_pdd.protocol import (MAX_MD_TP, MAX_ROOM_ID, ControlError, DestinationReply, DropReply, HandoffRequest, KeptReply,
                                 InfoReply, LegParams, ReadyReply, ReadyRequest, RegisterReply, RegisterRequest,
                                 ReleaseReply, ReleaseRequest, RouteTable, WanDestinationRequest, check_md_tp)
from sglang_pdd.protocol import messages as protocol_messages
from sglang_pdd.protocol import routes as api
from sglang_pdd.router.backends.clients import MainControl, PrefillControl

pytestmark = pytest.mark.timeout(60)

MESSAGES = [
    RegisterRequest(7, [1, 2, 3]),
    RegisterRequest(MAX_ROOM_ID, [0], use_cache=False),
    RegisterReply(7, 0),
    RegisterReply(7, 64, prompt_tokens=100, wan_peer="10.0.0.2:7000", tp_size=4, kv_bytes_per_token=512,
                  kv_layout={"page_size": 16}),
    ReadyReply(7, "ready", ""),
    ReadyReply(7, "failed", None),
    ReleaseReply(True),
    HandoffRequest([5, 6], "r-m", {"max_new_tokens": 9}),
    HandoffRequest([], None, {}, stream=False, warmup=True),
    HandoffRequest([5], "r-m", {"max_new_tokens": 9}, return_logprob=True, top_logprobs_num=2,
                   logprob_start_len=-1, token_ids_logprob=[3, 4]),
    WanDestinationRequest(1, 2, "10.0.0.2:7000", 0),
    WanDestinationRequest(MAX_ROOM_ID, 0, "h:1", (1 << 31) - 1, md_tp=MAX_MD_TP),
    DestinationReply(),
    DestinationReply(sends_wan=False),
    DropReply(),
    DropReply(sends_wan=False),
    KeptReply(),
    KeptReply(False),
    InfoReply(1, 4, True),
    LegParams.destination(7, "10.0.0.2:7000", 64),
    LegParams.destination(7, "10.0.0.2:7000", 64, md_tp=2),
    LegParams.late(7),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_through_json(message):
    wire = json.loads(json.dumps(message.to_json()))
    assert type(message).from_json(wire) == message


def test_the_wire_is_what_the_servers_have_always_read():
    assert RegisterRequest(7, [1, 2]).to_json() == {"room": 7, "token_ids": [1, 2], "use_cache": True}
    assert HandoffRequest([5], "r", {"max_new_tokens": 3}).to_json() == {
        "token_ids": [5], "rid": "r", "sampling_params": {"max_new_tokens": 3}, "stream": True, "warmup": False}
    # md_tp is sent only when it is not 1 (a P that knows only TP 1 reads the rest unchanged)
    assert WanDestinationRequest(1, 2, "h:1", 3).to_json() == {"bootstrap_room": 1, "md_room": 2, "wan_peer": "h:1",
                                                               "md_prefix_len": 3}
    assert WanDestinationRequest(1, 2, "h:1", 3, md_tp=2).to_json()["md_tp"] == 2
    assert LegParams.destination(7, "h:1", 64).to_json() == {"pdd_room": 7, "pdd_wan_peer": "h:1",
                                                             "pdd_md_prefix_len": 64}
    assert LegParams.destination(7, "h:1", 64, 2).to_json()["pdd_md_tp"] == 2
    assert LegParams.late(7).to_json() == {"pdd_room": 7, "pdd_wan_expected": True}
    assert LegParams.wire_key("wan_peer") == "pdd_wan_peer" and RegisterRequest.wire_key("room") == "room"
    assert protocol.resume_marker(3) == {"pdd_resume_output_len": 3} == {protocol.RESUME_KEY: 3}
    assert RegisterReply(7, 0).to_json() == {"room": 7, "cached_tokens": 0}  # tp_size absent: TP 1
    assert RegisterReply(7, 0).md_tp == 1 and RegisterReply(7, 0, tp_size=4).md_tp == 4
    assert InfoReply(0, 2, True).to_json() == {"tp_rank": 0, "tp_size": 2, "sends_wan": True}


def test_leg_params_from_custom_params():
    assert LegParams.from_custom_params({"mine": 1}) is None and LegParams.from_custom_params(None) is None
    leg = LegParams.from_custom_params({"pdd_room": 3, "pdd_wan_peer": "h:1", "other": 1})
    assert leg == LegParams(3, "h:1", 0)  # the prefix defaults to 0
    assert LegParams.expects_destination(LegParams.late(3).to_json())
    assert not LegParams.expects_destination(LegParams.destination(3, "h:1", 0).to_json())
    assert protocol.without_pdd_params({"pdd_room": 1, "pdd_x": 2, "mine": 3}) == {"mine": 3}


def test_routes_build_and_parse_their_paths():
    assert api.MD_HANDOFF.path(room=7) == "/pdd/rooms/7/handoff"
    assert api.MD_HANDOFF.match("/pdd/rooms/7/handoff") == {"room": 7}
    assert api.MD_RELEASE.match("/pdd/rooms/7/handoff") is None and api.MD_READY.match("/pdd/rooms/7") is None
    assert api.P_DROP.match(api.P_DROP.path(bootstrap_room=MAX_ROOM_ID)) == {"bootstrap_room": MAX_ROOM_ID}
    assert api.ready_target(7, 2) == "/pdd/rooms/7/ready?timeout_s=2.0"
    assert api.release_target(7, True) == "/pdd/rooms/7?keep_kv=1"
    assert ReadyRequest.from_query(7, "timeout_s=2.5") == ReadyRequest(7, 2.5)
    assert ReadyRequest.from_query(7, "timeout_s=9999").timeout_s == ReadyRequest.MAX_TIMEOUT_S
    assert ReleaseRequest.from_query(7, "keep_kv=1") == ReleaseRequest(7, True)
    assert ReleaseRequest.from_query(7, "") == ReleaseRequest(7, False)
    assert api.is_p_path("/pdd/wan_destinations/5") and api.is_p_path("/pdd/info")
    assert not api.is_p_path("/pdd/stats") and not api.is_p_path("/pdd/rooms")
    table = RouteTable({route: route.template for route in api.MD_ROUTES})
    assert table.resolve("POST", "/pdd/rooms/9/handoff") == ("/pdd/rooms/{room}/handoff", {"room": 9})
    assert table.resolve("DELETE", "/pdd/rooms/9") == ("/pdd/rooms/{room}", {"room": 9})


BAD = [
    (RegisterRequest, {"room": -1, "token_ids": [1]}, "'room' must be an integer"),
    (RegisterRequest, {"room": True, "token_ids": [1]}, "'room' must be an integer"),
    (RegisterRequest, {"room": 1, "token_ids": []}, "'token_ids' must be a non-empty list"),
    (RegisterRequest, {"room": 1, "token_ids": [1 << 31]}, "'token_ids'"),
    (RegisterRequest, {"room": 1, "token_ids": [1], "use_cache": 1}, "'use_cache' must be true or false"),
    (RegisterRequest, [1, 2], "JSON object"),
    (RegisterReply, {"room": 1, "cached_tokens": 0, "tp_size": MAX_MD_TP + 1}, "tp_size must be an integer in 1..64"),
    (RegisterReply, {"room": 1}, "cached_tokens"),
    (ReadyReply, {"room": 1, "status": "done"}, "status must be one of"),
    (HandoffRequest, {"token_ids": [-1]}, "'token_ids'"),
    (HandoffRequest, {"token_ids": [1], "stream": "yes"}, "stream must be a boolean"),
    (HandoffRequest, {"token_ids": [1], "sampling_params": [1]}, "sampling_params must be an object"),
    (HandoffRequest, {"token_ids": [1], "rid": 5}, "rid must be str"),
    (HandoffRequest, {}, "'token_ids'"),
    (WanDestinationRequest, {"bootstrap_room": 1, "md_room": 1, "wan_peer": "h:1"}, "md_prefix_len must be int"),
    (WanDestinationRequest, {"bootstrap_room": 1, "md_room": 1, "wan_peer": "h:1", "md_prefix_len": 0, "md_tp": 0},
     "md_tp must be an integer in 1..64"),
    (WanDestinationRequest, {"bootstrap_room": 1, "md_room": 1, "wan_peer": 5, "md_prefix_len": 0}, "wan_peer"),
    (InfoReply, {"tp_rank": 0, "tp_size": 0, "sends_wan": True}, "tp_size must be a positive int"),
    (LegParams, {"pdd_room": 1 << 63, "pdd_wan_peer": "h:1"}, "pdd_room must be an integer in 0..2^63-1"),
    (LegParams, {"pdd_room": 1, "pdd_wan_peer": "h:1", "pdd_md_tp": 65}, "pdd_md_tp must be an integer in 1..64"),
]


@pytest.mark.parametrize("kind,body,message", BAD, ids=[f"{k.__name__}-{i}" for i, (k, _, _) in enumerate(BAD)])
def test_bad_input_is_a_control_error_with_status_400(kind, body, message):
    with pytest.raises(ControlError, match=re.escape(message)) as e:
        kind.from_json(body)
    assert (e.value.status, e.value.kind) == (400, "bad_request") and e.value.to_json() == {"error": str(e.value)}


@pytest.mark.parametrize("call,status", [
    (lambda: api.MD_READY.match("/pdd/rooms/x/ready"), 400),
    (lambda: api.P_DROP.match(f"/pdd/wan_destinations/{1 << 63}"), 400),
    (lambda: RouteTable({api.STATS: None}).resolve("GET", "/pdd/nothing"), 404),
    (lambda: RouteTable({api.STATS: None}).resolve("POST", "/pdd/stats"), 404),
    (lambda: ReadyRequest.from_query(1, "timeout_s=nan"), 400),
    (lambda: ReleaseRequest.from_query(1, "keep_kv=yes"), 400),
    (lambda: check_md_tp(9, limit=8), 400),
    (lambda: check_md_tp(True), 400),
])
def test_bad_paths_and_queries_are_control_errors(call, status):
    with pytest.raises(ControlError) as e:
        call()
    assert e.value.status == status


def test_the_servers_answer_with_the_errors_status():
    """Over HTTP, MD's and P's real servers: the status is the ControlError's (400 malformed,
    403 a peer P may not send to, 404 no route, 409 a stale handoff or a repeated destination)."""
    md, p = MdControl(), PControl()
    try:
        assert call_json("POST", md.url + "/pdd/rooms", {"room": 1, "token_ids": []}, key=KEY)[0] == 400
        assert call_json("GET", md.url + "/pdd/rooms/1/ready?timeout_s=-1", key=KEY)[0] == 400
        assert call_json("GET", md.url + "/pdd/nothing", key=KEY)[0] == 404
        assert call_json("POST", md.url + "/pdd/rooms", {"room": 1, "token_ids": [5, 6]}, key=KEY)[0] == 200
        status, reply = call_json("POST", md.url + "/pdd/rooms/1/handoff", {"token_ids": [8]}, key=KEY)
        assert status == 409 and "stale" in reply["error"]  # registered, not ready
        status, reply = call_json("POST", md.url + "/pdd/rooms/1/handoff", {"token_ids": "x"}, key=KEY)
        assert status == 400 and "token_ids" in reply["error"]
        dest = WanDestinationRequest(5, 5, "%s:%d" % WAN_PEER, 0).to_json()
        assert call_json("POST", p.url + "/pdd/wan_destinations", {**dest, "md_tp": 0}, key=KEY)[0] == 400
        assert call_json("POST", p.url + "/pdd/wan_destinations", {**dest, "wan_peer": "10.9.9.9:1"}, key=KEY)[0] == 403
        assert call_json("POST", p.url + "/pdd/wan_destinations", dest, key=KEY) == (200, {"accepted": True})
        assert call_json("POST", p.url + "/pdd/wan_destinations", dest, key=KEY)[0] == 409
        assert call_json("GET", p.url + "/pdd/info", key=KEY) == (200, {"tp_rank": 0, "tp_size": 1, "sends_wan": True})
    finally:
        md.close()
        p.close()


# ---- a new handoff field is one change: the protocol's HandoffRequest ---------------------------

def _with_priority():
    """HandoffRequest plus one field, declared as a field of the protocol's type is."""
    return dataclasses.make_dataclass(
        "HandoffRequest", [("priority", int, protocol_messages.wire(omit=lambda v: v == 0, default=0))],
        bases=(HandoffRequest,), frozen=True)


def _handoff_through_router_client(url: str, room: int, body, signer=None, register=True) -> list[dict]:
    async def run():
        async with aiohttp.ClientSession() as session:
            mc = MainControl(session, url, signer=signer)
            if register:
                await mc.register(room, [5, 6, 7])
            return [e async for e in mc.handoff_stream(room, body)]

    return asyncio.run(run())


def test_a_new_handoff_field_reaches_mds_handler_from_the_protocol_type_alone(monkeypatch):
    """The router's client sends whatever fields the message has; MD's real handler parses the
    body with the protocol's HandoffRequest and hands MainDrcRuntime.handoff_request that
    message. So the field reaches MD once the protocol's type has it, and not before."""
    extended = _with_priority()
    md = MdControl()
    got = []
    real = md.runtime.handoff_request
    md.runtime.handoff_request = lambda room, req: (got.append(req.to_json()), real(room, req))[1]
    try:
        for room, patched in ((1, False), (2, True)):
            if patched:
                monkeypatch.setattr(protocol_messages, "HandoffRequest", extended)
            md.runtime.register(RegisterRequest(room, [5, 6, 7]))
            md.runtime.mark_ready(room)
            body = extended([8], f"r{room}", {"max_new_tokens": 4}, priority=3)
            assert body.to_json()["priority"] == 3  # the client's wire has it either way
            events = _handoff_through_router_client(md.url, room, body, ControlSigner(KEY), register=False)
            assert events[-1]["output_ids"] == [7, 8]
        assert "priority" not in got[0]  # MD's type without the field: not passed on
        assert got[1]["priority"] == 3 and got[1]["token_ids"] == [8] and got[1]["rid"] == "r2"
    finally:
        md.close()


def test_a_new_handoff_field_reaches_the_fake_mds_handler_from_the_protocol_type_alone(monkeypatch):
    """The same through the test fakes' MD (tests/support/fake_backends.py), which dispatches through
    the protocol's route table and parses with the protocol's type too."""
    extended = _with_priority()

    async def run():
        fakes = await Fakes().start()
        try:
            async with aiohttp.ClientSession() as session:
                mc = MainControl(session, fakes.md_url)
                for room, patched in ((11, False), (12, True)):
                    if patched:
                        monkeypatch.setattr(protocol_messages, "HandoffRequest", extended)
                    await mc.register(room, [5, 6, 7])
                    body = extended([8], f"r{room}", {"max_new_tokens": 4}, priority=3)
                    events = [e async for e in mc.handoff_stream(room, body)]
                    assert events[-1]["output_ids"][:1] == [8]
            return [r.body for r in fakes.records("md", "handoff")]
        finally:
            await fakes.stop()

    unpatched, patched = asyncio.run(run())
    assert "priority" not in unpatched and patched["priority"] == 3 and patched["room"] == 12


def test_router_clients_speak_the_fakes_p_api():
    async def run():
        fakes = await Fakes().start()
        try:
            async with aiohttp.ClientSession() as session:
                pc = PrefillControl(session, fakes.p_control_url)
                assert await pc.tp_size() == 1
                reply = await pc.set_wan_destination(5, 6, "h:1", 0, md_tp=2)
                await pc.drop_wan_destination(7)
            return reply, fakes.records("p", "destination"), fakes.dropped_rooms()
        finally:
            await fakes.stop()

    reply, destinations, dropped = asyncio.run(run())
    assert reply == DestinationReply().to_json() and dropped == [7]
    assert [r.body for r in destinations] == [WanDestinationRequest(5, 6, "h:1", 0, md_tp=2).to_json()]
