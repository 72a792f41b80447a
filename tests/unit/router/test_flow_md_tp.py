"""An MD on ``--tp N``: the router reads ``tp_size`` from MD's registration answer and tells P,
in the request (``pdd_md_tp``) or with the late destination (``md_tp``), so that P feeds each
MD rank (rank r's WAN receiver on the WAN address's port + r). Against the fake backends."""

from __future__ import annotations

import pytest

from tests.support.fake_backends import Knobs
from tests.support.flow_scenarios import (PROMPT, SLOW_WAN, WAN_PEER, assert_invariants, assert_p_control_sane,
                                         flow_config, p_leg_params, scenario, takeover)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("p_control", [False, True])
def test_early_destination_carries_mds_tp_size(p_control):
    knobs = Knobs(md_tp_size=4, md_register_delay_s=0.05)
    run = scenario(knobs, max_new=30, cfg=flow_config(policy=SLOW_WAN), p_control=p_control,
                   md_estimate=len(PROMPT), gates=takeover(knobs, 2))
    assert_invariants(run, 30)
    assert run.flow.result.md_registration == "before_legs"
    assert p_leg_params(run) == {"pdd_room": run.fakes.registered_rooms()[0], "pdd_wan_peer": WAN_PEER,
                                 "pdd_md_prefix_len": 0, "pdd_md_tp": 4}


def test_late_destination_carries_mds_tp_size():
    knobs = Knobs(md_tp_size=2, md_cached_tokens=3, md_register_delay_s=0.05)
    run = scenario(knobs, max_new=30, cfg=flow_config(policy=SLOW_WAN), p_control=True, md_estimate=0,
                   gates=takeover(knobs, 2))
    assert_invariants(run, 30)
    assert_p_control_sane(run)
    room = run.fakes.registered_rooms()[0]
    assert run.flow.result.md_registration == "concurrent"
    assert "pdd_md_tp" not in p_leg_params(run)  # not known yet when P started
    assert [p.body for p in run.fakes.records("p", "destination")] == [
        {"bootstrap_room": room, "md_room": room, "wan_peer": WAN_PEER, "md_prefix_len": 3, "md_tp": 2}]


@pytest.mark.parametrize("p_control", [False, True])
def test_md_on_tp_1_or_silent_about_it_changes_nothing(p_control):
    knobs = Knobs(md_tp_size=1, md_register_delay_s=0.05)
    run = scenario(knobs, max_new=20, cfg=flow_config(policy=SLOW_WAN), p_control=p_control,
                   md_estimate=0 if p_control else len(PROMPT), gates=takeover(knobs, 2))
    assert_invariants(run, 20)
    assert "pdd_md_tp" not in p_leg_params(run)
    assert all("md_tp" not in p.body for p in run.fakes.records("p", "destination"))


@pytest.mark.parametrize("bad", [0, 9, 64, 65, "2", True, 2.0])  # 9, 64: over the router's --max-md-tp (8)
@pytest.mark.parametrize("p_control", [False, True])
def test_bad_tp_size_from_md_falls_back_to_rld_and_releases_mds_room(bad, p_control):
    knobs = Knobs(md_tp_size=bad, md_register_delay_s=0.05)
    run = scenario(knobs, max_new=20, cfg=flow_config(policy=SLOW_WAN), p_control=p_control,
                   md_estimate=0 if p_control else len(PROMPT))
    assert_invariants(run, 20)
    assert run.fallbacks == ["md_unavailable"]
    assert run.fakes.released_rooms() == run.fakes.registered_rooms()  # MD's room unlocked at once
    assert run.fakes.records("md", "handoff") == [] and run.fakes.records("p", "destination") == []


def test_routers_bound_is_ps():
    from sglang_pdd.kv_channel.tp_relayout import MAX_MD_TP as p_bound
    from sglang_pdd.protocol import MAX_MD_TP as protocol_bound
    from sglang_pdd.router.backends import clients as backends
    assert p_bound is protocol_bound
    backends.set_max_md_tp(protocol_bound)  # the router's --max-md-tp reaches exactly P's bound
    try:
        assert backends.md_tp_of({"tp_size": protocol_bound}) == protocol_bound
        with pytest.raises(ValueError):
            backends.set_max_md_tp(protocol_bound + 1)
    finally:
        backends.set_max_md_tp(8)


def test_unsigned_md_replies_fall_back_to_rld(monkeypatch):
    """With the router signing, a registration reply without MD's signature (a relay on the
    path, or not MD at all) is an MD failure: the request stays on RLD."""
    from sglang_pdd.control.auth import ControlSigner
    from sglang_pdd.router.backends import clients as backends
    monkeypatch.setattr(backends, "_control_signer", ControlSigner(b"k" * 32))
    knobs = Knobs(md_tp_size=1, md_register_delay_s=0.05)
    run = scenario(knobs, max_new=20, cfg=flow_config(policy=SLOW_WAN), p_control=False, md_estimate=len(PROMPT))
    assert_invariants(run, 20)
    assert run.fallbacks == ["md_unavailable"]
    assert run.fakes.released_rooms() == run.fakes.registered_rooms()  # it may hold the room: released
    assert run.fakes.records("md", "handoff") == [] and run.fakes.records("p", "destination") == []
