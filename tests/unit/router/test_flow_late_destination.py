"""Late WAN destinations: with a control API on P, a P->RLD->MD request starts P and RLD at
once and registers MD's room concurrently; MD's answer is posted to P afterwards (PddFlow,
router/flow/pdd_flow.py). Against the fake P / RLD / MD (tests/support/fake_backends.py): the order of events
is asserted on the timestamps the fakes record (one clock, one event loop), never on
wall-clock thresholds.

The guarantees of tests/support/flow_scenarios.py hold here too (assert_invariants): the client
gets truth[:max_new] exactly once and in order, MD's room is released exactly once, nothing
is left running.
"""

from __future__ import annotations

import argparse

import pytest

from tests.support.fake_backends import Knobs, closed_port, wait_until
from sglang_pdd.router.front.app import Router
from sglang_pdd.router.front.cli import _prefill_arg, parse_args
from sglang_pdd.router.flow.fallback import Reason
from sglang_pdd.router.backends.servers import MainBackend, PrefillBackend
from sglang_pdd.router.flow.request import FlowRequest
from sglang_pdd.router.front.metrics import FLOW_FALLBACK_REASONS
from sglang_pdd.router.backends.placement import MdMoveCost
from sglang_pdd.router.policy import PathPolicyConfig
from sglang_pdd.router.backends.pools import Pools
from tests.support.flow_scenarios import (P_MD_POLICY, PROMPT, SLOW_WAN, WAN_PEER, assert_handed_off,
                                         assert_invariants, assert_p_control_sane, flow_config, p_leg_params,
                                         scenario, t_of, takeover)

pytestmark = pytest.mark.timeout(60)


def hold_rld_until(run_ref: dict, predicate, at_token: int):
    """An RLD hook: token ``at_token`` of leg 1 waits until ``predicate(run)`` (so a failure
    lands while RLD is mid-stream)."""
    async def hook(leg, i):
        if leg == 1 and i == at_token:
            await wait_until(lambda: predicate(run_ref["run"]), timeout_s=10)
    return hook


# ---------------------------------------------------------------------- (a) + (b) happy path
def relayed_with_md_slow_to_answer():
    """A P->RLD->MD request of 40 tokens whose MD answers its registration 0.3 s late (3 tokens
    cached), handed off at 3; checked for the flow's invariants."""
    knobs = Knobs(md_register_delay_s=0.3, md_cached_tokens=3)

    def gates(run):
        takeover(knobs, 3)(run)
        # RLD keeps producing until MD's KV is known to have landed, so the handoff happens.
        knobs.rld_before_token = hold_rld_until({"run": run}, lambda r: r.flow.state.md.value in ("ready", "failed"), 6)

    run = scenario(knobs, max_new=40, p_control=True, md_estimate=0, gates=gates)
    assert_invariants(run, 40)
    return run


def test_legs_start_before_md_registration_answers_and_first_token_reaches_client_first():
    run = relayed_with_md_slow_to_answer()
    assert_p_control_sane(run)
    r = run.flow.result
    assert r.path == "p_rld_md" and r.fallbacks == [] and r.md_registration == "concurrent"
    registered_t = t_of(run, "md", "registered")  # MD's register answer
    # (a) P and RLD were started before MD answered, and the first token got through first.
    assert t_of(run, "p", "generate") < registered_t
    assert t_of(run, "rld", "generate") < registered_t
    assert t_of(run, "rld", "first_token") < registered_t
    assert run.first_chunk_t is not None and run.first_chunk_t < registered_t
    # The P leg says "a destination will come", not where it goes.
    room = run.fakes.registered_rooms()[0]
    assert p_leg_params(run) == {"pdd_room": room, "pdd_wan_expected": True}
    assert run.fakes.records("p", "generate")[0].body["bootstrap_room"] == room
    # The destination follows MD's answer; the ready wait follows the destination.
    assert registered_t <= t_of(run, "p", "destination") <= t_of(run, "md", "ready")
    assert run.fakes.dropped_rooms() == []
    assert_handed_off(run, 40)
    assert r.wan_bytes == (len(PROMPT) - 3) * 100 and r.wan_bytes_saved == 3 * 100
    # The ready wait (the metrics' kv_transfer_latency_ms) starts after P has its destination.
    assert 0 < r.wan_ready_s < run.last_chunk_t - t_of(run, "p", "destination")


def test_md_side_after_first_token_registers_once_the_client_has_its_first_token():
    """--md-side-after-first-token: MD hears of the request only after the client got its first
    token; then the registration, P's destination, MD's KV and the handoff as ever."""
    import dataclasses
    knobs = Knobs(md_cached_tokens=3)
    cfg = dataclasses.replace(flow_config(), md_side_after_first_token=True)
    run = scenario(knobs, max_new=40, p_control=True, cfg=cfg, gates=takeover(knobs, 3))
    assert_invariants(run, 40)
    assert_p_control_sane(run)
    r = run.flow.result
    assert r.path == "p_rld_md" and r.md_registration == "concurrent" and r.fallbacks == []
    room = run.fakes.records("p", "generate")[0].body["bootstrap_room"]
    assert p_leg_params(run) == {"pdd_room": room, "pdd_wan_expected": True}
    assert run.first_chunk_t < t_of(run, "md", "register") and run.fakes.registered_rooms() == [room]
    assert t_of(run, "md", "registered") <= t_of(run, "p", "destination") <= t_of(run, "md", "ready")
    assert_handed_off(run, 40)


def test_router_marks_each_step_of_a_relayed_request_in_order():
    """FlowResult.marks (the request's log line): the path and the legs come before MD's answer,
    the first token too; the destination follows the answer, MD's KV the destination."""
    run = relayed_with_md_slow_to_answer()
    m = run.flow.result.marks
    assert set(m) >= {"path", "legs", "md_registered", "destination", "p_replied", "first_token"}, m
    assert m["path"] <= m["legs"] <= m["first_token"] < m["md_registered"] <= m["destination"]
    assert m["legs"] <= m["p_replied"]
    assert m["md_registered"] >= 0.3  # MD answered after its delay, measured from the flow's start
    assert m["destination"] <= m["md_ready"]


def test_destination_carries_md_exact_prefix_and_room_path_kept_on_estimate():
    """Estimate 0 -> P->RLD->MD; MD actually holds the whole prompt (with it, P->MD would have
    been chosen). The path is not changed after the fact; both numbers are reported."""
    policy = SLOW_WAN
    # 8 uncached tokens x 100 B at 1 kbit/s: 6.4 s > 1 s; 0 uncached: 0 ms.
    knobs = Knobs(md_cached_tokens=len(PROMPT), md_register_delay_s=0.05)
    run = scenario(knobs, max_new=30, cfg=flow_config(policy=policy), p_control=True, md_estimate=0,
                   gates=takeover(knobs, 2))
    assert_invariants(run, 30)
    r = run.flow.result
    assert r.path == "p_rld_md" and r.md_registration == "concurrent"
    assert r.md_cached_estimate == 0 and r.md_cached_tokens == len(PROMPT)
    room = run.fakes.registered_rooms()[0]
    posts = run.fakes.records("p", "destination")
    assert [p.body for p in posts] == [{"bootstrap_room": room, "md_room": room, "wan_peer": WAN_PEER,
                                        "md_prefix_len": len(PROMPT)}]
    assert run.fakes.records("rld", "generate")[0].body["sampling_params"]["max_new_tokens"] == 30
    assert_handed_off(run, 30)


def test_estimate_says_p_md_registers_first_then_decides_on_md_exact_prefix():
    """A high estimate (P->MD) means the round trip is awaited anyway; MD's exact answer (0
    cached) then picks P->RLD->MD, with the destination in the request as without P control."""
    policy = SLOW_WAN
    knobs = Knobs(md_cached_tokens=0, md_register_delay_s=0.05)
    run = scenario(knobs, max_new=30, cfg=flow_config(policy=policy), p_control=True, md_estimate=len(PROMPT),
                   gates=takeover(knobs, 2))
    assert_invariants(run, 30)
    r = run.flow.result
    assert r.path == "p_rld_md" and r.md_registration == "before_legs"
    assert r.md_cached_estimate == len(PROMPT) and r.md_cached_tokens == 0
    assert t_of(run, "md", "registered") < t_of(run, "p", "generate")
    assert p_leg_params(run) == {"pdd_room": run.fakes.registered_rooms()[0], "pdd_wan_peer": WAN_PEER,
                                 "pdd_md_prefix_len": 0}
    assert run.fakes.records("p", "destination") == [] and run.fakes.dropped_rooms() == []
    assert_handed_off(run, 30)


# ---------------------------------------------------------------------- (c) registration fails
@pytest.mark.parametrize("fault", ["error500", "text500", "refused"])
def test_registration_fails_destination_dropped_rld_finishes(fault):
    knobs = Knobs(md_register=fault if fault != "refused" else "ok", md_register_delay_s=0.05)
    control = f"http://127.0.0.1:{closed_port()}" if fault == "refused" else None

    def gates(run):  # the failure lands while RLD is mid-stream
        knobs.rld_before_token = hold_rld_until({"run": run}, lambda r: r.flow.state.md.value == "failed", 5)

    run = scenario(knobs, max_new=30, control_url=control, p_control=True, gates=gates)
    assert_invariants(run, 30)
    assert_p_control_sane(run)
    r = run.flow.result
    assert r.path == "p_rld_md" and r.md_registration == "concurrent"
    assert run.fallbacks == ["md_unavailable"]
    assert r.md_tokens == 0 and r.rld_tokens == 30 and r.handoff_at is None
    room = run.fakes.records("p", "generate")[0].body["bootstrap_room"]
    assert run.fakes.dropped_rooms() == [room]
    assert run.fakes.records("p", "destination") == []
    assert run.fakes.released_rooms() == []  # MD holds no room
    assert run.fakes.records("md", "ready") == [] and run.fakes.records("md", "handoff") == []
    assert len(run.fakes.records("rld", "generate")) == 1  # RLD's own leg finished it
    # The drop came while RLD was still streaming, not from the end-of-request cleanup.
    assert t_of(run, "p", "drop") < run.last_chunk_t


# ---------------------------------------------------------------------- (d) P refuses the destination
@pytest.mark.parametrize("status", [409, 500])
def test_destination_refused_by_p_dropped_room_released_rld_finishes(status):
    knobs = Knobs(p_control_status=status, md_cached_tokens=2, rld_token_delay_s=0.01)

    def gates(run):
        knobs.rld_before_token = hold_rld_until({"run": run}, lambda r: r.flow.state.md.value == "failed", 5)

    run = scenario(knobs, max_new=30, p_control=True, gates=gates)
    assert_invariants(run, 30)  # includes: the registered room released exactly once
    r = run.flow.result
    assert r.path == "p_rld_md" and run.fallbacks == ["wan_destination_failed"]
    assert f"HTTP {status}" in r.fallbacks[0].detail
    assert r.md_tokens == 0 and r.rld_tokens == 30
    room = run.fakes.registered_rooms()[0]
    assert [p.body["bootstrap_room"] for p in run.fakes.records("p", "destination")] == [room]
    assert run.fakes.dropped_rooms() == [room]
    assert run.fakes.released_rooms() == [room]
    # Released as soon as P refused, not by the end-of-request cleanup (RLD had 25 tokens to go).
    assert t_of(run, "md", "release") < run.last_chunk_t
    assert run.fakes.records("md", "ready") == [] and run.fakes.records("md", "handoff") == []
    assert len(run.fakes.records("rld", "generate")) == 1
    assert FLOW_FALLBACK_REASONS[Reason.WAN_DESTINATION_FAILED] == "wan_failed"


def test_wan_fails_after_destination_delivered_no_drop():
    """The destination was accepted: a later WAN failure is the usual wan_failed, and P is not
    told to drop a destination it already has."""
    run = scenario(Knobs(md_ready="failed"), max_new=30, p_control=True)
    assert_invariants(run, 30)
    assert run.fallbacks == ["wan_failed"]
    assert len(run.fakes.records("p", "destination")) == 1 and run.fakes.dropped_rooms() == []
    assert run.flow.result.wan_ready_s is None  # no KV landed: no transfer time


def ends_before_md_answers(knobs: Knobs, max_new: int = 5):
    """A P->RLD->MD request whose RLD finishes it (or fails) while MD's registration is still
    on its way: RLD's first token waits until MD has the register request in hand."""
    def gates(run):
        knobs.rld_before_token = hold_rld_until({"run": run}, lambda r: r.fakes.registered_rooms(), 0)

    return scenario(knobs, max_new=max_new, p_control=True, gates=gates)


def test_a_request_finished_before_md_answers_still_gets_its_kv_to_md():
    """MD's cache stays as warm as P's: the registration outlives the request, P gets its
    destination after the end and MD's room is released keeping the KV, while the client's
    reply did not wait for MD."""
    run = ends_before_md_answers(Knobs(md_register_delay_s=0.5, md_cached_tokens=3))
    assert_invariants(run, 5)  # the registered room released exactly once
    assert_p_control_sane(run)
    r = run.flow.result
    assert r.fallbacks == [] and r.rld_tokens == 5 and r.md_tokens == 0
    assert r.md_registration == "after_end" and r.md_kv_kept
    assert run.lingering_at_end == 1
    assert run.ended_t < t_of(run, "md", "registered")  # the client did not wait for MD
    room = run.fakes.registered_rooms()[0]
    assert [d.body for d in run.fakes.records("p", "destination")] == [
        {"bootstrap_room": room, "md_room": room, "wan_peer": WAN_PEER, "md_prefix_len": 3}]
    assert t_of(run, "md", "registered") < t_of(run, "p", "destination") < t_of(run, "md", "release")
    assert [x.body for x in run.fakes.records("md", "release")] == [{"room": room, "keep_kv": True}]
    assert [x.body["bootstrap_room"] for x in run.fakes.records("p", "kept")] == [room]
    assert run.fakes.dropped_rooms() == []


def test_a_destination_p_refuses_after_the_end_frees_mds_room():
    """P no longer waits (it gave up, 409/410): MD keeps nothing for KV that will not come."""
    run = ends_before_md_answers(Knobs(md_register_delay_s=0.3, p_control_status=409))
    assert_invariants(run, 5)
    room = run.fakes.registered_rooms()[0]
    assert run.flow.result.md_registration == "after_end" and run.flow.result.fallbacks == []
    assert [x.body for x in run.fakes.records("md", "release")] == [{"room": room, "keep_kv": False}]
    assert run.fakes.records("p", "kept") == []
    assert run.fakes.dropped_rooms() == [room]  # P's other TP ranks, if any, stop waiting too


def test_a_request_failing_before_md_answers_withdraws_at_once_and_frees_the_room_once_registered():
    """A failed request's KV is not wanted: P stops waiting at once, and MD's room is freed
    once MD answered (a release before the registration would leave the room to expire)."""
    run = ends_before_md_answers(Knobs(md_register_delay_s=0.5, rld_fail_after={1: 2}), max_new=20)
    assert_invariants(run, 20, complete=False)
    assert run.error is not None and run.flow.result.md_registration == "concurrent"
    room = run.fakes.registered_rooms()[0]
    assert run.fakes.dropped_rooms() == [room] and run.fakes.records("p", "destination") == []
    assert t_of(run, "p", "drop") < t_of(run, "md", "registered") < t_of(run, "md", "release")
    assert [x.body for x in run.fakes.records("md", "release")] == [{"room": room, "keep_kv": False}]
    assert run.ended_t < t_of(run, "md", "registered")  # the client's error did not wait for MD


# ---------------------------------------------------------------------- (e) no P control: as before
def test_without_p_control_registration_comes_first_with_old_params():
    knobs = Knobs(md_register_delay_s=0.1, md_cached_tokens=3)
    run = scenario(knobs, max_new=30, p_control=False, md_estimate=7, gates=takeover(knobs, 2))
    assert_invariants(run, 30)
    r = run.flow.result
    assert r.path == "p_rld_md" and r.md_registration == "before_legs" and r.fallbacks == []
    assert r.md_cached_tokens == 3 and r.md_cached_estimate == 7
    registered_t = t_of(run, "md", "registered")
    assert registered_t < t_of(run, "p", "generate") and registered_t < t_of(run, "rld", "generate")
    assert p_leg_params(run) == {"pdd_room": run.fakes.registered_rooms()[0], "pdd_wan_peer": WAN_PEER,
                                 "pdd_md_prefix_len": 3}
    assert run.fakes.records("p", "destination") == [] and run.fakes.dropped_rooms() == []
    assert_handed_off(run, 30)


# ---------------------------------------------------------------------- (f) P->MD awaits registration
def test_p_md_with_p_control_still_awaits_registration():
    knobs = Knobs(md_register_delay_s=0.1)
    run = scenario(knobs, max_new=30, cfg=flow_config(policy=P_MD_POLICY), p_control=True,
                   gates=takeover(knobs, 0))
    assert_invariants(run, 30)
    r = run.flow.result
    assert r.path == "p_md" and r.md_registration == "before_legs" and r.fallbacks == []
    assert t_of(run, "md", "registered") < t_of(run, "p", "generate")
    assert p_leg_params(run) == {"pdd_room": run.fakes.registered_rooms()[0], "pdd_wan_peer": WAN_PEER,
                                 "pdd_md_prefix_len": 0}
    assert run.fakes.records("rld", "generate")[0].body["sampling_params"]["max_new_tokens"] == 1
    assert run.fakes.records("p", "destination") == [] and run.fakes.dropped_rooms() == []
    assert_handed_off(run, 30)


@pytest.mark.parametrize("md_fails", [False, True], ids=["lands", "md_unavailable"])
def test_p_md_starts_p_at_once_and_registers_beside_it_by_default(md_fails):
    """The router's default (no --p-md-registers-first): P->MD starts P and RLD's one-token leg
    before MD answers, MD's room is registered beside them and P learns it late; MD's KV
    lands and MD continues after token 1. MD unavailable: RLD finishes the request on a new
    leg from the token the client has."""
    import dataclasses
    knobs = Knobs(md_register_delay_s=0.2, md_register="error500" if md_fails else "ok")
    policy = dataclasses.replace(P_MD_POLICY, p_md_registers_first=False)
    run = scenario(knobs, max_new=30, cfg=flow_config(policy=policy), p_control=True,
                   gates=None if md_fails else takeover(knobs, 0))
    assert_invariants(run, 30)
    r = run.flow.result
    assert r.path == "p_md" and r.md_registration == "concurrent"
    assert run.fakes.records("rld", "generate")[0].body["sampling_params"]["max_new_tokens"] == 1
    if md_fails:
        assert run.fallbacks[0] == "md_unavailable" and r.md_tokens == 0
        assert run.fakes.dropped_rooms() == [run.fakes.records("p", "generate")[0].body["bootstrap_room"]]
        assert len(run.fakes.records("rld", "generate")) == 2  # the recovery leg finished it
        return
    assert t_of(run, "p", "generate") < t_of(run, "md", "registered")
    room = run.fakes.registered_rooms()[0]
    assert [p.body["bootstrap_room"] for p in run.fakes.records("p", "destination")] == [room]
    assert r.fallbacks == []
    assert_handed_off(run, 30)


def test_outlier_with_p_control_registers_nothing():
    policy = PathPolicyConfig(outlier_min_input_tokens=4, outlier_max_output_tokens=16)
    run = scenario(Knobs(), max_new=12, cfg=flow_config(policy=policy), p_control=True)
    assert_invariants(run, 12)
    r = run.flow.result
    assert r.path == "p_rld_only" and r.fallbacks == [] and r.md_registration == "none"
    assert run.fakes.registered_rooms() == [] and run.fakes.released_rooms() == []
    assert run.fakes.records("p", "destination") == [] and run.fakes.dropped_rooms() == []
    assert "custom_params" not in run.fakes.records("rld", "generate")[0].body["sampling_params"]


# ---------------------------------------------------------------------- router: CLI and estimate
def test_prefill_flag_two_and_three_fields():
    old = _prefill_arg("http://p.example:30000,8998")
    assert (old.url, old.bootstrap_port, old.host, old.control_url) == ("http://p.example:30000", 8998,
                                                                         "p.example", None)
    new = _prefill_arg("http://p.example:30000,8998,http://p.example:31000")
    assert (new.url, new.bootstrap_port, new.control_url) == ("http://p.example:30000", 8998,
                                                              "http://p.example:31000")
    args = parse_args(["--tokenizer-path", "m", "--relay", "http://r:1",
                       "--prefill", "http://a:1,10", "--prefill", "http://b:2,20,http://b:3"])
    assert [p.control_url for p in args.prefill] == [None, "http://b:3"]
    for bad in ("http://p:1", "http://p:1,x", "http://p:1,8998,p:31000", ",8998", "http://p:1,,http://c:2"):
        with pytest.raises(argparse.ArgumentTypeError):
            _prefill_arg(bad)


def test_router_passes_md_prefix_estimate_to_the_flow():
    prompt = list(range(100, 140))  # 40 tokens: 2 whole 16-token blocks
    md = MainBackend("http://md:1", "http://md:2", "md:3")
    pools = Pools([PrefillBackend("http://p:1", 8998, control_url="http://p:2")], ["http://rld:1"], [md])
    router = Router(pools, flow_config(), tokenizer=None, max_prompt_tokens=1000, served_model="fake")
    assert router.flows.open(FlowRequest(prompt, {"max_new_tokens": 4}, rid="a")).result.md_cached_estimate == 0
    pools.prefixes.record(md.url, prompt[:35])
    flow = router.flows.open(FlowRequest(prompt, {"max_new_tokens": 4}, rid="b"))
    assert flow.result.md_cached_estimate == 32 and flow.md.p_control is not None
    flow = router.flows.open(FlowRequest(prompt, {"max_new_tokens": 4}, options={"drc": False}, rid="c"))
    assert flow.result.md_cached_estimate == 0


def test_md_prefix_tie_goes_to_the_least_loaded_md():
    # Both MDs hold the same shared prefix (say a system prompt): the busier one must not win
    # just because it is configured first.
    prompt = list(range(200, 248))
    mds = [MainBackend(f"http://md{i}:1", f"http://md{i}:2", f"md{i}:3") for i in range(2)]
    pools = Pools([PrefillBackend("http://p:1", 8998)], ["http://rld:1"], mds)
    for md in mds:
        pools.prefixes.record(md.url, prompt[:32])
    pools.md_inflight[mds[0].url] = 2
    assert pools.pick(prompt)[2] is mds[1]
    pools.md_inflight[mds[0].url], pools.md_inflight[mds[1].url] = 0, 2
    assert pools.pick(prompt)[2] is mds[0]
    # a longer prefix on the busier MD: on a slow WAN (8 Mbit/s) re-sending it costs more than
    # 2 more flows' longer steps, so it stays; on a fast one (10 Gbps) moving is cheaper
    pools.prefixes.record(mds[1].url, prompt)
    pools.md_move = MdMoveCost(kv_bytes_per_token=46_000, wan_bytes_per_s=1e6, flow_step_s=1e-3)
    assert pools.pick(prompt)[2] is mds[1]
    pools.md_move = MdMoveCost(kv_bytes_per_token=46_000, wan_bytes_per_s=10e9 / 8, flow_step_s=1e-3)
    assert pools.pick(prompt)[2] is mds[0]
