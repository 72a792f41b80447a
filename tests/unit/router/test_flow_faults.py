"""Fault injection for PddFlow and the router's client-disconnect handling, against fake
P / RLD / MD servers (tests/support/fake_backends.py): no SGLang, deterministic, a few seconds.

Every scenario checks the flow's guarantees: the client gets truth[:max_new] exactly (no loss,
no duplicate, in order), the expected fallback tags, RLD aborted once MD produced a token, MD's
room released exactly once, no backend stream left running and no task left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time

import aiohttp
import pytest

from sglang_pdd.router.front.app import Router, build_app
from sglang_pdd.router.backends.clients import BackendError
from sglang_pdd.router.backends.servers import MainBackend, PrefillBackend
from sglang_pdd.router.policy import PathPolicyConfig
from sglang_pdd.router.backends.pools import Pools
from sglang_pdd.router.front.flow_runner import record_prefixes
from tests.support.fake_backends import Fakes, Knobs, closed_port, serve_app, truth, wait_until
from tests.support.flow_scenarios import (PROMPT, WAN_TIMEOUT_S, assert_handed_off, assert_invariants, emitted_at_least,
                                         flow_config, leg_rid, p_md_cfg, scenario, takeover)

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------------- P -> RLD -> MD
def test_one_shot_handoff_exact_stream_and_rld_aborted():
    knobs = Knobs()
    run = scenario(knobs, max_new=40, gates=takeover(knobs, 6))
    assert_invariants(run, 40)
    r = run.flow.result
    assert r.path == "p_rld_md" and r.fallbacks == [] and r.handoff_mode == "one_shot"
    assert r.handoff_at >= 6
    assert_handed_off(run, 40)
    rld_gen = run.fakes.records("rld", "generate")
    assert len(rld_gen) == 1 and rld_gen[0].body["sampling_params"]["custom_params"]["pdd_room"] == \
        run.fakes.registered_rooms()[0]
    # The room is released when MD takes over (not only at the end).
    release_t = run.fakes.records("md", "release")[0].t
    assert release_t < run.fakes.records("rld", "abort")[-1].t + 1.0


@pytest.mark.parametrize("fakes_sign", [True, False])
def test_a_signing_router_hands_off_only_to_an_md_whose_replies_are_signed(fakes_sign):
    """The fakes answer a signed router as MD and P do (signed replies and handoff events), so
    benchmarks that start the router with its control key measure handoffs; an MD whose
    replies are unsigned is no MD to such a router, and RLD finishes the request."""
    key = bytes(range(32))
    knobs = Knobs()
    run = scenario(knobs, max_new=40, gates=takeover(knobs, 6), p_control=True, control_key=key,
                   fakes_control_key=key if fakes_sign else None)
    assert_invariants(run, 40)
    r = run.flow.result
    if fakes_sign:
        assert r.path == "p_rld_md" and r.fallbacks == [] and r.md_tokens > 0
        assert_handed_off(run, 40)
    else:
        assert r.md_tokens == 0 and r.handoff_at is None


def test_rld_late_tokens_after_abort_are_dropped():
    knobs = Knobs(rld_abort_lag_tokens=4, rld_token_delay_s=0.002, md_token_delay_s=0.01)
    run = scenario(knobs, max_new=40, gates=takeover(knobs, 5))
    assert_invariants(run, 40)
    assert run.flow.result.fallbacks == []
    assert_handed_off(run, 40)


def test_md_finishing_at_once_still_aborts_rld_and_releases_room():
    """MD's whole continuation in its first event: the request ends right away; the RLD abort
    and the room release sent on MD's first token must not be lost with it."""
    knobs = Knobs(md_burst=True, rld_token_delay_s=0.02)
    run = scenario(knobs, max_new=60, gates=lambda run: setattr(knobs, "md_before_ready", emitted_at_least(run, 3)))
    assert_invariants(run, 60)
    assert_handed_off(run, 60)


def test_catch_up_warmups_bounded_by_threshold_and_final_carries_all_eager():
    knobs = Knobs(rld_token_delay_s=0.004)
    cfg = flow_config(mode=None, threshold=4)  # auto: RLD idle (0 in flight) -> catch-up
    run = scenario(knobs, max_new=80, cfg=cfg, gates=takeover(knobs, 20))
    assert_invariants(run, 80)
    r = run.flow.result
    assert r.handoff_mode == "catch_up" and r.fallbacks == []
    final = assert_handed_off(run, 80)
    warmups = [w.body for w in run.fakes.records("md", "warmup")]
    assert len(warmups) >= 4  # a backlog of >= 20 tokens, 4 per batch
    handed = 0
    for i, w in enumerate(warmups):
        assert w["warmup"] is True and w["rid"] == leg_rid(run, f"c{i}")
        assert 0 < len(w["token_ids"]) - handed <= 4
        assert w["token_ids"] == truth(PROMPT, len(w["token_ids"]))
        handed = len(w["token_ids"])
    assert r.catch_up_batches[:-1] == [4] * len(warmups)
    assert sum(r.catch_up_batches) == len(final["token_ids"]) == r.handoff_at
    if len(warmups) < cfg.handoff.max_catch_up_rounds - 1:
        assert r.catch_up_batches[-1] <= 4


def test_catch_up_warmup_refused_rld_finishes():
    knobs = Knobs(md_warmup_status=500)
    run = scenario(knobs, max_new=40, cfg=flow_config(mode=None, threshold=4),
                   gates=lambda run: setattr(knobs, "md_before_ready", emitted_at_least(run, 12)))
    assert_invariants(run, 40)
    r = run.flow.result
    assert run.fallbacks == ["md_failed"] and r.md_tokens == 0 and r.handoff_at is None
    assert len(run.fakes.records("md", "warmup")) == 1 and run.fakes.records("md", "handoff") == []
    assert run.flow.stitcher.handoffs_failed == 0  # the stream was never frozen


def test_wan_failed_rld_finishes():
    knobs = Knobs(md_ready="failed")
    run = scenario(knobs, max_new=30)
    assert_invariants(run, 30)
    r = run.flow.result
    assert run.fallbacks == ["wan_failed"] and r.md_tokens == 0
    assert run.fakes.records("md", "handoff") == [] and run.fakes.records("md", "warmup") == []


def test_md_never_ready_times_out_rld_finishes():
    knobs = Knobs()

    def gates(run):
        knobs.md_ready = "never"

        async def hold(leg, i):  # RLD still decoding when the long-poll gives up
            if i == 10:
                await wait_until(lambda: run.flow.state.md.value in ("ready", "failed"), timeout_s=10)
        knobs.rld_before_token = hold

    run = scenario(knobs, max_new=30, gates=gates)
    assert_invariants(run, 30)
    assert run.fallbacks == ["wan_failed"]
    assert "not ready within" in run.flow.result.fallbacks[0].detail
    assert run.fakes.records("md", "ready")[0].body["timeout_s"] == WAN_TIMEOUT_S
    assert run.fakes.records("md", "handoff") == []


@pytest.mark.parametrize("fault", ["409", "500", "drop"])
def test_md_refuses_handoff_rld_continues(fault):
    knobs = Knobs(md_handoff_status={"409": 409, "500": 500}.get(fault, 200), md_handoff_drop=fault == "drop")
    run = scenario(knobs, max_new=40, gates=lambda run: setattr(knobs, "md_before_ready", emitted_at_least(run, 5)))
    assert_invariants(run, 40)
    r = run.flow.result
    assert run.fallbacks == ["md_failed"]
    assert r.md_tokens == 0 and r.handoff_at is None and run.flow.stitcher.handoffs_failed == 1
    assert len(run.fakes.records("rld", "generate")) == 1  # no new leg: RLD was still running


def test_md_dies_mid_stream_recovers_on_new_relay_leg():
    knobs = Knobs(md_die_after=5, md_token_delay_s=0.005)
    run = scenario(knobs, max_new=40, gates=lambda run: setattr(knobs, "md_before_ready", emitted_at_least(run, 6)))
    assert_invariants(run, 40)
    r = run.flow.result
    assert run.fallbacks == ["md_failed", "recovered_on_relay:md_failed_mid_stream"]
    assert r.md_tokens == 5
    legs = run.fakes.records("rld", "generate")
    assert [g.body["rid"] for g in legs] == [leg_rid(run, "r1"), leg_rid(run, "r2")]
    resumed_at = r.handoff_at + 5
    # greedy: the recovery leg replays the request (total budget), its first positions dropped
    assert r.recovery_mode == "replay" and resumed_at == 5 + r.handoff_at
    assert legs[1].body["input_ids"] == PROMPT
    assert legs[1].body["sampling_params"]["max_new_tokens"] == 40
    assert "custom_params" not in legs[1].body["sampling_params"]  # no second WAN transfer
    assert leg_rid(run, "r1") in run.fakes.aborted_rids("rld") and leg_rid(run, "m") in run.fakes.aborted_rids("md")


@pytest.mark.parametrize("silent_from", [1, 4])
def test_md_silent_mid_stream_is_md_failed_and_the_request_goes_on_from_rld(silent_from):
    """MD stops sending (the WAN down under a handed-off stream, MD stopped): after
    md_stall_timeout_s without a byte the router treats MD as failed and the request goes on
    on a new P->RLD leg, every token once; without the timeout it would wait as TCP does."""
    async def hang(index, budget):
        if index == silent_from:
            await asyncio.sleep(60)

    knobs = Knobs(md_token_delay_s=0.005, md_before_token=hang)
    cfg = dataclasses.replace(flow_config(), md_stall_timeout_s=0.5)
    t0 = time.monotonic()
    run = scenario(knobs, max_new=30, cfg=cfg, gates=lambda run: setattr(knobs, "md_before_ready",
                                                                          emitted_at_least(run, 3)))
    assert_invariants(run, 30)
    assert time.monotonic() - t0 < 15  # not the 60 s MD would take
    assert run.fallbacks[0] == "md_failed" and run.fallbacks[-1].startswith("recovered_on_relay")
    assert run.flow.result.md_tokens == silent_from
    assert leg_rid(run, "m") in run.fakes.aborted_rids("md")


@pytest.mark.parametrize("path", ["p_rld_md", "p_md"])
def test_md_late_first_token_after_the_handoff_is_md_failed_within_its_own_deadline(path):
    """MD holds its first token after the final handoff (the WAN down for a few seconds, MD
    stopped) for less than md_stall_timeout_s: the client's stall is bounded by
    md_first_token_timeout_s, not by the stall timeout. MD counts as failed and the request
    goes on from RLD as after any MD failure: on P->RLD->MD RLD was still decoding and its
    held-back tokens flow (no new leg); on P->MD (RLD's leg gave one token) a new P->RLD leg.
    MD's tokens, sent once it wakes up, are never forwarded: every token once."""
    knobs = Knobs(md_token_delay_s=0.005)
    cfg = dataclasses.replace(flow_config() if path == "p_rld_md" else p_md_cfg(),
                              md_stall_timeout_s=20.0, md_first_token_timeout_s=0.5)

    def md_gave_up(run):
        return lambda: run.flow.state.md.value == "failed"

    def gates(run):
        knobs.md_before_ready = emitted_at_least(run, 3 if path == "p_rld_md" else 1)

        async def late_first_token(i, budget):  # MD wakes once the router gave up, or after 5 s
            if i == 0:
                with contextlib.suppress(AssertionError):
                    await wait_until(md_gave_up(run), timeout_s=5)

        async def rld_waits(leg, i):  # RLD still decoding when the router decides on MD's first token
            if leg == 1 and i == 10:
                await wait_until(lambda: md_gave_up(run)() or run.flow.state.phase.value == "main", timeout_s=10)

        knobs.md_before_token, knobs.rld_before_token = late_first_token, rld_waits

    run = scenario(knobs, max_new=30, cfg=cfg, gates=gates)
    assert_invariants(run, 30)
    r = run.flow.result
    assert r.fallbacks[0].reason.value == "md_failed" and "first token" in r.fallbacks[0].detail
    assert r.md_tokens == 0 and r.handoff_at is None and run.flow.stitcher.handoffs_failed == 1
    assert ("main", run.fakes.md_url) in r.failed_backends  # MD's breaker counts the missed deadline
    assert len(run.fakes.records("md", "handoff")) == 1
    legs = [g.body["rid"] for g in run.fakes.records("rld", "generate")]
    if path == "p_rld_md":
        assert run.fallbacks == ["md_failed"] and legs == [leg_rid(run, "r1")]
    else:
        assert run.fallbacks == ["md_failed", "recovered_on_relay:md_failed"]
        assert legs == [leg_rid(run, "r1"), leg_rid(run, "r2")]


def test_md_trickling_bytes_without_tokens_is_a_stall():
    """The stall timeout counts tokens, not bytes: MD's stream (or a relay on it) sending a
    blank line every 0.1 s and no token used to keep the stream open for as long as it kept
    trickling (the request then failed at --request-timeout-s); now it is MD failed after
    md_stall_timeout_s, and the request goes on from RLD, every token once."""
    knobs = Knobs(md_token_delay_s=0.005, md_trickle_from=2, md_trickle_every_s=0.1, md_trickle_s=6.0)
    cfg = dataclasses.replace(flow_config(), md_stall_timeout_s=0.5)
    t0 = time.monotonic()
    run = scenario(knobs, max_new=30, cfg=cfg, gates=lambda run: setattr(knobs, "md_before_ready",
                                                                          emitted_at_least(run, 3)))
    assert_invariants(run, 30)
    assert time.monotonic() - t0 < 4  # not the 6 s MD trickles
    assert run.fallbacks[0] == "md_failed" and run.fallbacks[-1].startswith("recovered_on_relay")
    assert run.flow.result.md_tokens == 2
    assert leg_rid(run, "m") in run.fakes.aborted_rids("md")
    assert ("main", run.fakes.md_url) in run.flow.result.failed_backends  # MD's breaker counts the stall


# ---------------------------------------------------------------------- P -> MD (RLD budget 1)
def test_p_md_happy():
    knobs = Knobs()
    run = scenario(knobs, max_new=30, cfg=p_md_cfg(), gates=takeover(knobs, 0))
    assert_invariants(run, 30)
    r = run.flow.result
    assert r.path == "p_md" and r.fallbacks == []
    legs = run.fakes.records("rld", "generate")
    assert len(legs) == 1 and legs[0].body["sampling_params"]["max_new_tokens"] == 1
    assert_handed_off(run, 30)
    assert r.handoff_at == 1


def test_p_md_ready_before_rld_first_token():
    """MD's KV lands before RLD's (single) first token: the handoff must still happen."""
    knobs = Knobs()

    def gates(run):
        async def hold(leg, i):
            await wait_until(lambda: run.flow.state.md.value == "ready", timeout_s=10)
        knobs.rld_before_token = hold

    run = scenario(knobs, max_new=30, cfg=p_md_cfg(), gates=gates, timeout_s=10)
    assert_invariants(run, 30)
    assert run.flow.result.fallbacks == []
    assert_handed_off(run, 30)


@pytest.mark.parametrize("fault", ["409", "drop"])
def test_p_md_md_fails_recovers_on_relay(fault):
    knobs = Knobs(md_handoff_status=409 if fault == "409" else 200, md_handoff_drop=fault == "drop")
    run = scenario(knobs, max_new=30, cfg=p_md_cfg())
    assert_invariants(run, 30)
    assert run.fallbacks == ["md_failed", "recovered_on_relay:md_failed"]
    legs = run.fakes.records("rld", "generate")
    assert [g.body["rid"] for g in legs] == [leg_rid(run, "r1"), leg_rid(run, "r2")]
    assert legs[1].body["input_ids"] == PROMPT  # a replay (greedy)
    assert legs[1].body["sampling_params"]["max_new_tokens"] == 30
    assert "custom_params" not in legs[1].body["sampling_params"]
    assert run.flow.result.md_tokens == 0


def test_p_md_never_ready_recovers_on_relay():
    run = scenario(Knobs(md_ready="never"), max_new=20, cfg=p_md_cfg())
    assert_invariants(run, 20)
    assert run.fallbacks == ["wan_failed", "recovered_on_relay:wan_failed_after_rld"]
    assert run.flow.result.fallbacks[0].timed_out  # the router's wait ran out: wan_timeout in the metrics
    assert [g.body["rid"] for g in run.fakes.records("rld", "generate")] == [leg_rid(run, "r1"), leg_rid(run, "r2")]
    assert run.fakes.records("md", "handoff") == []


def test_p_md_wan_failed_before_rld_token_recovers():
    knobs = Knobs(md_ready="failed")

    def gates(run):
        async def hold(leg, i):
            if leg == 1:
                await wait_until(lambda: run.flow.state.md.value == "failed", timeout_s=10)
        knobs.rld_before_token = hold

    run = scenario(knobs, max_new=20, cfg=p_md_cfg(), gates=gates)
    assert_invariants(run, 20)
    assert run.fallbacks == ["wan_failed", "recovered_on_relay:wan_failed_after_rld"]


def test_p_md_md_dies_mid_stream_recovers():
    run = scenario(Knobs(md_die_after=3), max_new=20, cfg=p_md_cfg())
    assert_invariants(run, 20)
    assert run.fallbacks == ["md_failed", "recovered_on_relay:md_failed_mid_stream"]
    legs = run.fakes.records("rld", "generate")
    assert legs[1].body["input_ids"] == PROMPT and run.flow.result.recovery_mode == "replay"  # greedy
    assert legs[1].body["sampling_params"]["max_new_tokens"] == 20


# ---------------------------------------------------------------------- P -> RLD only
@pytest.mark.parametrize("fault", ["error500", "text500", "refused"])
def test_md_unavailable_serves_on_rld_only(fault):
    knobs = Knobs(md_register=fault if fault != "refused" else "ok")
    control = f"http://127.0.0.1:{closed_port()}" if fault == "refused" else None
    run = scenario(knobs, max_new=20, control_url=control)
    assert_invariants(run, 20)
    r = run.flow.result
    assert r.path == "p_rld_only" and run.fallbacks == ["md_unavailable"]
    assert run.fakes.records("md", "ready") == [] and run.fakes.records("md", "handoff") == []
    assert run.fakes.released_rooms() == []
    assert "custom_params" not in run.fakes.records("rld", "generate")[0].body["sampling_params"]


def test_outlier_registers_then_releases_and_never_hands_off():
    policy = PathPolicyConfig(outlier_min_input_tokens=4, outlier_max_output_tokens=16)
    run = scenario(Knobs(), max_new=12, cfg=flow_config(policy=policy))
    assert_invariants(run, 12)
    r = run.flow.result
    assert r.path == "p_rld_only" and r.fallbacks == []
    assert len(run.fakes.registered_rooms()) == 1
    assert run.fakes.released_rooms() == run.fakes.registered_rooms()
    assert [r.body["keep_kv"] for r in run.fakes.records("md", "release")] == [False]  # transfer cancelled
    assert run.fakes.records("md", "ready") == [] and run.fakes.records("md", "handoff") == []
    assert "custom_params" not in run.fakes.records("rld", "generate")[0].body["sampling_params"]


@pytest.mark.parametrize("p_control", [False, True], ids=["registered_first", "late_destination"])
def test_request_ending_on_rld_before_mds_kv_lands_keeps_that_kv_for_the_next_turn(p_control):
    """RLD finishes first: MD's room is released with keep_kv (the KV goes on landing, into
    MD's cache), P's destination is not withdrawn (the router aborts only RLD's leg, so P goes
    on sending) and P, where it has a control API, is told the room is kept (it sends it behind
    the KV other requests wait for), and the router counts MD as holding the prompt for the next
    turn's placement."""
    from sglang_pdd.router.backends.pools import Pools
    knobs = Knobs()
    knobs.md_ready = "never"  # still in flight when RLD finishes
    run = scenario(knobs, max_new=8, p_control=p_control)
    assert_invariants(run, 8)
    r = run.flow.result
    assert r.path == "p_rld_md" and r.md_tokens == 0 and r.handoff_at is None
    assert [r.body["keep_kv"] for r in run.fakes.records("md", "release")] == [True]
    assert r.md_kv_kept and r.wan_bytes is None  # kept, not (yet) landed
    assert len(run.fakes.records("p", "reply")) == 1  # P's leg ran to its reply
    assert run.fakes.dropped_rooms() == []  # P's WAN destination never withdrawn
    kept = [k.body["bootstrap_room"] for k in run.fakes.records("p", "kept")]
    assert kept == (run.fakes.released_rooms() if p_control else [])
    pools = Pools([run.flow.prefill], [run.flow.relay_url], [run.flow.main])
    record_prefixes(pools, run.flow, list(run.flow.stitcher.emitted))
    assert pools.prefixes.match(run.flow.main.url, run.flow.ids) == len(run.flow.ids) // 16 * 16


# ---------------------------------------------------------------------- relay / prefill failures
def test_rld_dies_mid_stream_fails_request_and_cleans_up():
    knobs = Knobs(rld_fail_after={1: 7}, md_ready="never")
    run = scenario(knobs, max_new=30)
    assert_invariants(run, 30, complete=False)
    assert isinstance(run.error, BackendError) and "relay leg failed" in str(run.error)
    assert len(run.emitted) == 7


@pytest.mark.parametrize("text", [False, True])
def test_prefill_error_fails_request_and_cleans_up(text):
    knobs = Knobs(p_status=500, p_text_error=text, rld_prefill_wait_s=3.0)
    run = scenario(knobs, max_new=30)
    assert_invariants(run, 30, complete=False)
    assert isinstance(run.error, BackendError) and "prefill" in str(run.error)
    assert run.emitted == []


# ---------------------------------------------------------------------- router: client disconnect
class _Tokenizer:
    def decode(self, ids):
        return " ".join(map(str, ids))

    def encode(self, text):
        return [int(t) for t in text.split()]


def test_router_client_disconnect_aborts_rld_and_releases_room(router_sglang_state):
    knobs = Knobs(md_ready="never", rld_token_delay_s=0.05)

    async def main():
        fakes = await Fakes(knobs).start()
        pools = Pools([PrefillBackend(fakes.p_url, 8998)], [fakes.rld_url],
                      [MainBackend(fakes.md_url, fakes.md_url, "127.0.0.1:1")])
        cfg = dataclasses.replace(flow_config(), wan_timeout_s=30.0)
        router = Router(pools, cfg, _Tokenizer(), max_prompt_tokens=1000, served_model="fake",
                        sglang_state=router_sglang_state)
        try:
            async with serve_app(build_app(router)) as base, aiohttp.ClientSession() as client:
                async with client.post(f"{base}/generate",
                                       json={"input_ids": PROMPT, "stream": True, "rid": "cli",
                                             "sampling_params": {"max_new_tokens": 200}}) as resp:
                    assert resp.status == 200
                    async for line in resp.content:
                        if line.startswith(b"data:"):
                            first = json.loads(line[5:])
                            break
                    assert first["output_ids"] == truth(PROMPT, len(first["output_ids"]))
                    resp.connection.transport.abort()  # the client goes away mid-stream
            room = fakes.registered_rooms()[0]
            leg_rid = fakes.records("rld", "generate")[0].body["rid"]
            assert not leg_rid.startswith("cli")  # backends never see the client's rid
            await wait_until(lambda: leg_rid in fakes.aborted_rids("rld") and room in fakes.released_rooms(),
                             timeout_s=3)
            await wait_until(lambda: fakes.rld_active == 0, timeout_s=3)
            await wait_until(lambda: pools.rld_inflight[fakes.rld_url] == 0, timeout_s=3)
            assert fakes.released_rooms().count(room) == 1
            # MD's KV was still crossing: a client gone cancels it (a finished request keeps it)
            assert [r.body["keep_kv"] for r in fakes.records("md", "release")] == [False]
            assert len(fakes.records("rld", "generate")) == 1
        finally:
            await fakes.stop()

    asyncio.run(asyncio.wait_for(main(), 20))


def test_request_timeout_bounds_a_stuck_relay_and_aborts_every_leg():
    async def stuck(leg, index):  # RLD accepts the request, then never produces a token
        await asyncio.sleep(30)

    cfg = dataclasses.replace(flow_config(), request_timeout_s=1.5)
    run = scenario(Knobs(rld_before_token=stuck, md_ready="never"), max_new=10, cfg=cfg)
    assert isinstance(run.error, BackendError) and "--request-timeout-s" in str(run.error)
    assert run.emitted == []
    assert run.fakes.records("rld", "abort"), "the stuck relay leg must be aborted"
    assert run.fakes.released_rooms() == run.fakes.registered_rooms()


# ---------------------------------------------------------------------- long events, bounded
# SGLang's stream events are cumulative: with logprobs one event of a long request passes
# 512 KiB (1,500 tokens with 20 top logprobs: ~1 MB). The router reads an event up to the
# bound its leg's body allows (router/backends/reply_limits.py: ~2 MiB for these 30-token legs) and
# no further.
LONG_EVENT = 700 << 10
OVERSIZED_EVENT = 3 << 20


@pytest.mark.parametrize("server", ["p", "rld", "md"])
def test_events_longer_than_aiohttps_default_line_are_read(server):
    knobs = Knobs(**{f"{server}_pad_bytes": LONG_EVENT})
    run = scenario(knobs, max_new=30, gates=takeover(knobs, 4))
    assert_invariants(run, 30)
    assert run.flow.result.fallbacks == []
    assert_handed_off(run, 30)


def test_relay_event_over_the_bound_fails_the_request_at_once():
    run = scenario(Knobs(rld_pad_bytes=OVERSIZED_EVENT, md_ready="never"), max_new=30)
    assert_invariants(run, 30, complete=False)
    assert isinstance(run.error, BackendError) and "relay leg failed" in str(run.error)
    assert "over the" in str(run.error)
    assert len(run.emitted) == 2  # the two events before the oversized one


def test_md_event_over_the_bound_falls_back_to_relay():
    knobs = Knobs(md_pad_bytes=OVERSIZED_EVENT)
    run = scenario(knobs, max_new=30, gates=lambda run: setattr(knobs, "md_before_ready", emitted_at_least(run, 4)))
    assert_invariants(run, 30)  # every token, once: RLD finishes what MD could not send
    assert run.flow.result.md_tokens == 0
    assert any("over the" in f.detail for f in run.flow.result.fallbacks), run.flow.result.fallbacks


def test_prefill_reply_over_the_bound_fails_the_request():
    run = scenario(Knobs(p_pad_bytes=OVERSIZED_EVENT, rld_prefill_wait_s=3.0), max_new=30,
                   extras={"return_logprob": True})
    assert isinstance(run.error, BackendError) and "prefill" in str(run.error) and "over the" in str(run.error)
    assert run.emitted == []
    assert not run.tasks_after
