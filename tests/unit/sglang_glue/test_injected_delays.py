"""Test-only delays at MD's registration and P's late destination: read from the server's
environment at start (no client reaches them), inert when unset, applied on every call."""

from __future__ import annotations

import random

import pytest
from tests.support.control_fakes import KEY, WAN_PEER, MdControl, PControl

from sglang_pdd.launcher.http import call_json
from sglang_pdd.sglang_glue.injected_delays import (MD_REGISTER_DELAY_ENV, P_DESTINATION_DELAY_ENV, SEED_ENV,
                                                     DelayRange, InjectedDelay)


@pytest.mark.parametrize("text,want", [("150", DelayRange(150, 150)), ("0-400", DelayRange(0, 400)),
                                       (" 5 - 7 ", DelayRange(5, 7))])
def test_a_delay_is_milliseconds_or_a_range(text, want):
    assert DelayRange.parse(text) == want


@pytest.mark.parametrize("text", ["", "abc", "-5", "9-3", "0-70000", "1-2-3", "nan"])
def test_bad_delays_are_refused(text):
    with pytest.raises(ValueError):
        DelayRange.parse(text)


def test_draws_stay_in_the_range_and_repeat_with_a_seed():
    delay = DelayRange(10, 30)
    draws = [delay.draw_s(random.Random(3)) for _ in range(3)]
    assert len(set(draws)) == 1 and 0.010 <= draws[0] <= 0.030
    rng = random.Random(4)
    assert all(0.010 <= delay.draw_s(rng) <= 0.030 for _ in range(100))


def test_unset_is_inert_and_set_is_read_at_start():
    assert InjectedDelay.from_env(MD_REGISTER_DELAY_ENV, {}).wait() == 0.0
    delay = InjectedDelay.from_env(MD_REGISTER_DELAY_ENV, {MD_REGISTER_DELAY_ENV: "0-2", SEED_ENV: "7"})
    assert delay.delay == DelayRange(0, 2) and 0.0 <= delay.wait() <= 0.002


class Counted(InjectedDelay):
    def __init__(self):
        super().__init__("counted", None)
        self.calls = 0

    def wait(self) -> float:
        self.calls += 1
        return 0.0


def test_md_delays_every_registration_and_p_every_destination(monkeypatch):
    monkeypatch.setenv(MD_REGISTER_DELAY_ENV, "1")
    monkeypatch.setenv(P_DESTINATION_DELAY_ENV, "1")
    md, p = MdControl(), PControl()
    try:
        api = md.server.api
        assert api.register_delay.delay == DelayRange(1, 1)  # taken from the environment at start
        api.register_delay = counted = Counted()
        for room in (1, 2):
            status, _ = call_json("POST", f"{md.url}/pdd/rooms", {"room": room, "token_ids": [1, 2, 3]}, key=KEY)
            assert status == 200
        assert counted.calls == 2
        dest = {"bootstrap_room": 5, "md_room": 5, "wan_peer": "%s:%d" % WAN_PEER, "md_prefix_len": 0}
        assert call_json("POST", f"{p.url}/pdd/wan_destinations", dest, key=KEY)[0] == 200
    finally:
        md.close()
        p.close()


def test_p_applies_its_destination_delay():
    p = PControl(destination_delay=(counted := Counted()))
    try:
        dest = {"bootstrap_room": 6, "md_room": 6, "wan_peer": "%s:%d" % WAN_PEER, "md_prefix_len": 0}
        assert call_json("POST", f"{p.url}/pdd/wan_destinations", dest, key=KEY)[0] == 200
        assert counted.calls == 1 and p.board.stats()
    finally:
        p.close()
