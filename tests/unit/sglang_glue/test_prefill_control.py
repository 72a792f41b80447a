"""P's control API for late WAN destinations: the board's pairing logic and the HTTP front."""

from __future__ import annotations

import json

import pytest

from sglang_pdd.control.auth import ROLE_P, ControlVerifier
from sglang_pdd.launcher.http import call_json
from sglang_pdd.protocol import ControlError
from sglang_pdd.sglang_glue.p.prefill_control import DROPPED, DestinationBoard, PrefillControlServer, parse_destination
from sglang_pdd.sglang_glue.p.wan_fanout import WanDestination

DEST = WanDestination(md_room=5, peer=("10.0.0.2", 7000), md_prefix_len=64)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_destination_posted_first_is_handed_to_the_sender_that_asks_later():
    board = DestinationBoard()
    board.post(5, DEST)
    got = []
    assert board.wait_for(5, got.append) == DEST
    assert got == []  # returned directly, no callback
    assert board.stats()["early"] == 1 and board.stats()["waiting_destinations"] == 0


def test_sender_waiting_first_is_called_back_once():
    board = DestinationBoard()
    got = []
    assert board.wait_for(5, got.append) is None
    board.post(5, DEST)
    assert got == [DEST] and board.stats()["late"] == 1
    with pytest.raises(ControlError) as e:
        board.post(5, DEST)  # a second destination for the same request
    assert e.value.status == 409 and got == [DEST]


def test_withdrawal_reaches_the_waiting_sender():
    board = DestinationBoard()
    got = []
    board.wait_for(9, got.append)
    board.post(9, DROPPED)
    assert got == [DROPPED]


def test_unclaimed_destinations_expire_and_are_bounded():
    clock = Clock()
    board = DestinationBoard(ttl_s=10, capacity=2, clock=clock)
    board.post(1, DEST)
    board.post(2, DEST)
    with pytest.raises(ControlError) as e:
        board.post(3, DEST)
    assert e.value.status == 503
    clock.t = 11
    board.post(4, DEST)  # 1 and 2 expired first
    assert board.stats()["expired"] == 2
    got = []
    assert board.wait_for(1, got.append) is None  # expired: the sender waits (and times out on P)


def test_destination_for_a_sender_that_stopped_waiting_is_refused_with_410():
    board = DestinationBoard()
    got = []
    board.wait_for(7, got.append)
    board.forget(7)  # P gave up waiting (or the request ended)
    with pytest.raises(ControlError) as e:
        board.post(7, DEST)
    assert e.value.status == 410 and "no longer holds" in str(e.value)
    assert got == [] and board.stats()["gone"] == 1 and board.stats()["waiting_destinations"] == 0
    board.post(8, DEST)  # other rooms are unaffected
    board.forget(8)  # consumed, then the sender finished: a repeat stays a 409
    with pytest.raises(ControlError) as e:
        board.post(8, DEST)
    assert e.value.status == 409


@pytest.mark.parametrize("body,message", [
    (b"not json", "not JSON"),
    (b"[1, 2]", "JSON object"),
    (json.dumps({"bootstrap_room": 1, "md_room": 1, "wan_peer": "h:1"}).encode(), "md_prefix_len must be int"),
    (json.dumps({"bootstrap_room": "1", "md_room": 1, "wan_peer": "h:1", "md_prefix_len": 0}).encode(),
     "bootstrap_room must be int"),
    (json.dumps({"bootstrap_room": 1, "md_room": 1, "wan_peer": "nohost", "md_prefix_len": 0}).encode(),
     "HOST:PORT"),
    (json.dumps({"bootstrap_room": 1, "md_room": 1, "wan_peer": "h:1", "md_prefix_len": -3}).encode(), ">= 0"),
    (json.dumps({"bootstrap_room": True, "md_room": 1, "wan_peer": "h:1", "md_prefix_len": 0}).encode(),
     "bootstrap_room must be int"),
    (json.dumps({"bootstrap_room": 1, "md_room": 1, "wan_peer": "h:1", "md_prefix_len": 0, "md_tp": 0}).encode(),
     "md_tp must be an integer in 1..64"),
    (json.dumps({"bootstrap_room": 1, "md_room": 1, "wan_peer": "h:1", "md_prefix_len": 0, "md_tp": "2"}).encode(),
     "md_tp must be an integer"),
    (json.dumps({"bootstrap_room": 1, "md_room": 1, "wan_peer": "h:1", "md_prefix_len": 0, "md_tp": 2.0}).encode(),
     "md_tp must be an integer"),
    (json.dumps({"bootstrap_room": 1, "md_room": 1, "wan_peer": "h:65534", "md_prefix_len": 0, "md_tp": 4}).encode(),
     "md_tp: .*pass 65535"),
])
def test_malformed_destinations_name_the_problem(body, message):
    with pytest.raises(ControlError, match=message) as e:
        parse_destination(body)
    assert e.value.status == 400


KEY = b"p" * 32


def _call(method: str, url: str, body=None):
    return call_json(method, url, body, timeout=5, key=KEY, role=ROLE_P)  # all to P's API


def test_http_api_posts_withdraws_and_refuses():
    board = DestinationBoard()
    server = PrefillControlServer(board, "127.0.0.1", 0, stats=lambda: {"rooms": 3},
                                  auth=ControlVerifier(KEY, role=ROLE_P), peer_allowed=lambda peer: peer == ("127.0.0.1", 9000))
    base = "http://%s:%s" % server.address
    try:
        got = []
        board.wait_for(11, got.append)
        ok = {"bootstrap_room": 11, "md_room": 11, "wan_peer": "127.0.0.1:9000", "md_prefix_len": 16}
        assert _call("POST", base + "/pdd/wan_destinations", ok) == (200, {"accepted": True})
        assert got == [WanDestination(11, ("127.0.0.1", 9000), 16)]
        status, body = _call("POST", base + "/pdd/wan_destinations", ok)
        assert status == 409 and "already" in body["error"]
        status, body = _call("POST", base + "/pdd/wan_destinations", b"{oops")
        assert status == 400 and "JSON" in body["error"]
        assert _call("DELETE", base + "/pdd/wan_destinations/12")[0] == 200
        assert board.wait_for(12, got.append) is DROPPED
        assert _call("DELETE", base + "/pdd/wan_destinations/abc")[0] == 400
        assert _call("POST", base + "/elsewhere", ok)[0] == 404
        status, stats = _call("GET", base + "/pdd/stats")
        assert status == 200 and stats["rooms"] == 3 and stats["late"] == 1 and stats["duplicate"] == 1
    finally:
        server.close()


def test_md_tp_is_optional_and_carried():
    body = {"bootstrap_room": 1, "md_room": 2, "wan_peer": "10.0.0.2:7000", "md_prefix_len": 0}
    assert parse_destination(json.dumps(body).encode())[1].md_tp == 1  # older routers: MD on TP 1
    room, dest = parse_destination(json.dumps({**body, "md_tp": 4}).encode())
    assert (room, dest) == (1, WanDestination(2, ("10.0.0.2", 7000), 0, 4))


def test_kept_marks_the_room_on_the_fan_out():
    """The router's 'kept': P's fan-out puts the room's KV behind the waited rooms' (it answers
    whether it was sending that room); unsigned calls are refused."""
    marked = []
    server = PrefillControlServer(DestinationBoard(), "127.0.0.1", 0, auth=ControlVerifier(KEY, role=ROLE_P),
                                  peer_allowed=lambda peer: True,
                                  keep_only=lambda room: marked.append(room) or room == 21)
    base = "http://%s:%s" % server.address
    try:
        assert _call("POST", base + "/pdd/wan_destinations/21/kept", {}) == (200, {"kept": True})
        assert _call("POST", base + "/pdd/wan_destinations/22/kept", {}) == (200, {"kept": False})
        assert _call("POST", base + "/pdd/wan_destinations/x/kept", {})[0] == 400
        assert call_json("POST", base + "/pdd/wan_destinations/21/kept", {}, timeout=5)[0] == 401
        assert marked == [21, 22]
    finally:
        server.close()
