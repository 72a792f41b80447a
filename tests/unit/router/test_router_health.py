"""Backend health: breakers per server and per P-RLD pair, drain, and what the router answers when
no backend may take a request. The state machine and the pick are pure; the router's probes,
operator calls and replies run against the fake backends."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest

from tests.support.fake_backends import Fakes, Knobs, closed_port, serve_app, truth
from tests.support.flow_scenarios import PROMPT, flow_config
from tests.support.router_front import sse

from sglang_pdd.router.front.app import OPERATOR_HEADER, Router, build_app

from sglang_pdd.router.backends.pools import NoBackend, Pools
from sglang_pdd.router.backends.servers import MainBackend, PrefillBackend
from sglang_pdd.machine import IllegalTransition, fold
from sglang_pdd.router.backends.health import (BreakerState, BreakerPhase, Drain, BackendFailed, HealthBoard, HealthConfig, BackendSucceeded,
                                      pickable, transition)

CFG = HealthConfig(failure_threshold=2, cooldown_s=10.0)
TOKEN = "operator-secret-0123456789"


def after(state: BreakerState, *events) -> BreakerState:
    state, actions = fold(transition, state, *events, context=(CFG,))
    assert actions == []  # the breaker's readers read its state
    return state


# ---------------------------------------------------------------------------- state machine
def test_consecutive_failures_open_the_breaker_and_a_success_in_between_resets_them():
    s = after(BreakerState(), BackendFailed(0.0, "reset"))
    assert s.breaker is BreakerPhase.CLOSED and s.failures == 1
    s = after(s, BackendSucceeded(1.0))
    assert s.failures == 0
    s = after(s, BackendFailed(2.0), BackendFailed(3.0, "refused"))
    assert s.breaker is BreakerPhase.OPEN and s.opened_at == 3.0 and s.last_error == "refused"
    assert not pickable(s, 12.9, CFG) and pickable(s, 13.0, CFG)  # out for the cooldown, then a trial


def test_half_open_trial_closes_on_success_and_reopens_on_failure():
    opened = after(BreakerState(), BackendFailed(0.0), BackendFailed(0.0))
    assert after(opened, BackendSucceeded(10.0)).breaker is BreakerPhase.CLOSED
    again = after(opened, BackendFailed(10.5))  # one failure in the trial is enough
    assert again.breaker is BreakerPhase.OPEN and again.opened_at == 10.5
    # while open, more failures do not push the cooldown further out
    assert after(opened, BackendFailed(5.0)).opened_at == 0.0


def test_passing_probes_do_not_erase_failed_requests_within_the_window():
    """Requests failing on MD ~5 s apart, its /health passing between them (a relay stalling
    MD's streams, MD itself fine): each probe used to reset the streak, and six such requests
    never opened the breaker. Within failure_window_s a probe's success keeps the failures."""
    cfg = HealthConfig(failure_threshold=3, cooldown_s=10.0, failure_window_s=60.0)
    s = BreakerState(seen_up=True)
    for i in range(3):
        s, _ = transition(s, BackendFailed(5.0 * i, "MD room 1 handoff: no new token within 20 s"), cfg)
        s, _ = transition(s, BackendSucceeded(5.0 * i + 2.5, probe=True), cfg)
    assert s.breaker is BreakerPhase.OPEN and s.opened_at == 10.0
    s, _ = transition(s, BackendSucceeded(12.0, probe=True), cfg)  # a probe does not end the cooldown
    assert s.breaker is BreakerPhase.OPEN and not pickable(s, 12.0, cfg)
    trial, _ = transition(s, BackendSucceeded(21.0, probe=True), cfg)  # half open, requests failed lately
    assert trial.breaker is BreakerPhase.HALF_OPEN and pickable(trial, 21.0, cfg)  # requests get the trial
    closed, _ = transition(trial, BackendSucceeded(21.5), cfg)  # a request that completes closes it
    assert closed.breaker is BreakerPhase.CLOSED and closed.failures == 0


def test_a_probe_after_the_window_resets_failures_as_before():
    cfg = HealthConfig(failure_threshold=3, cooldown_s=10.0, failure_window_s=60.0)
    s, _ = transition(BreakerState(seen_up=True), BackendFailed(0.0), cfg)
    s, _ = transition(s, BackendSucceeded(30.0, probe=True), cfg)
    assert s.failures == 1  # inside the window: kept
    s, _ = transition(s, BackendSucceeded(61.0, probe=True), cfg)
    assert s.failures == 0 and s.request_failed_at is None
    probes_only, _ = transition(BreakerState(seen_up=True), BackendFailed(0.0, probe=True), cfg)
    assert transition(probes_only, BackendSucceeded(1.0, probe=True), cfg)[0].failures == 0  # probe vs probe


def test_drain_is_the_operators_and_outlives_breaker_changes():
    s = after(BreakerState(), Drain(True))
    s = after(s, BackendFailed(0.0), BackendSucceeded(1.0))
    assert s.draining and not pickable(s, 1.0, CFG)
    assert pickable(after(s, Drain(False)), 1.0, CFG)


def test_an_unknown_event_is_illegal_and_changes_nothing():
    with pytest.raises(IllegalTransition, match="unknown event"):
        transition(BreakerState(), BackendFailed, CFG)  # the class, not an event


def test_config_is_checked():
    for bad in ({"failure_threshold": 0}, {"cooldown_s": -1.0}, {"cooldown_s": float("nan")},
                {"failure_window_s": -1.0}):
        with pytest.raises(ValueError):
            HealthConfig(**bad)


# ---------------------------------------------------------------------------- the pick
def pools(n_p=2, n_rld=2, n_md=2) -> Pools:
    return Pools([PrefillBackend(f"http://p{i}", 8998) for i in range(n_p)], [f"http://r{i}" for i in range(n_rld)],
                 [MainBackend(f"http://m{i}", f"http://m{i}c", f"m{i}:1") for i in range(n_md)], health=CFG)


def open_breaker(board: HealthBoard, key) -> None:
    for _ in range(CFG.failure_threshold):
        board.record(key, BackendFailed(0.0))


def test_pick_routes_around_open_breakers_draining_servers_and_failing_pairs():
    p = pools()
    open_breaker(p.health, ("relay", "http://r0"))
    p.health.record(("main", "http://m1"), Drain(True))
    for _ in range(4):
        prefill, relay, main = p.pick(PROMPT, now=1.0)
        assert relay == "http://r1" and main.url == "http://m0"
    open_breaker(p.health, ("pair", "http://p0", "http://r1"))  # P0's KV does not reach RLD1
    picks = [p.pick(PROMPT, now=1.0) for _ in range(4)]
    assert {(pf.url, r) for pf, r, _ in picks} == {("http://p1", "http://r1")}  # P0 has no RLD left
    assert p.pick(PROMPT, now=11.0)[1] in ("http://r0", "http://r1")  # the cooldowns are over: trials


def test_no_prefill_or_no_relay_is_no_backend_and_no_md_is_none():
    p = pools(n_p=1, n_rld=1, n_md=1)
    open_breaker(p.health, ("main", "http://m0"))
    assert p.pick(PROMPT, now=1.0)[2] is None
    p.health.record(("relay", "http://r0"), Drain(True))
    with pytest.raises(NoBackend, match="relay"):
        p.pick(PROMPT, now=1.0)
    p.health.record(("relay", "http://r0"), Drain(False))
    open_breaker(p.health, ("prefill", "http://p0"))
    with pytest.raises(NoBackend, match="prefill"):
        p.pick(PROMPT, now=1.0)


def test_p_is_chosen_by_cached_prefix_and_new_prompts_take_turns():
    p = pools()
    p.prefixes.record("http://p1", PROMPT * 4)
    assert {p.pick(PROMPT * 4)[0].url for _ in range(4)} == {"http://p1"}  # the session's P holds its prefix
    other = [9000 + i for i in range(64)]
    assert {p.pick(other)[0].url for _ in range(4)} == {"http://p0", "http://p1"}
    held = p.prefixes.match("http://p1", PROMPT * 4)
    p.p_tokens["http://p1"] = held  # its queue no longer than the prefix it holds: the cache wins
    assert p.pick(PROMPT * 4)[0].url == "http://p1"
    p.p_tokens["http://p1"] = held + 1  # more queued prefill than the prefix saves: load wins
    assert p.pick(PROMPT * 4)[0].url == "http://p0"


# ---------------------------------------------------------------------------- the router
@contextlib.asynccontextmanager
async def router_on_fakes(state, knobs: Knobs, cooldown_s: float = 0.3, interval_s: float = 0.05,
                          dead_relays: int = 0):
    """The router on one set of fake backends; ``dead_relays``: RLD urls where nothing listens,
    listed first (so the least-loaded pick tries them first)."""
    fakes = await Fakes(knobs).start()
    relays = [f"http://127.0.0.1:{closed_port()}" for _ in range(dead_relays)] + [fakes.rld_url]
    pools = Pools([PrefillBackend(fakes.p_url, 8998)], relays,
                  [MainBackend(fakes.md_url, fakes.md_url, "127.0.0.1:1")],
                  health=HealthConfig(failure_threshold=2, cooldown_s=cooldown_s))
    router = Router(pools, flow_config(), None, max_prompt_tokens=1000, served_model="tiny", sglang_state=state,
                    max_new_tokens_cap=64, operator_token=TOKEN, health_check_interval_s=interval_s)
    try:
        async with serve_app(build_app(router)) as base, aiohttp.ClientSession() as client:
            yield base, client, fakes
    finally:
        await fakes.stop()


async def generate(client, base: str) -> tuple[int, dict, dict]:
    async with client.post(f"{base}/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8}},
                           headers={OPERATOR_HEADER: TOKEN}) as resp:
        return resp.status, dict(resp.headers), await resp.json()


async def poll(predicate, timeout_s: float = 5.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await predicate():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def test_a_failing_relay_is_taken_out_by_its_probes_and_back_after_recovering(router_sglang_state):
    knobs = Knobs()

    async def main():
        async with router_on_fakes(router_sglang_state, knobs) as (base, client, fakes):
            status, _, body = await generate(client, base)
            assert status == 200 and body["output_ids"] == truth(PROMPT, 8)
            knobs.health_status["rld"] = 500

            assert await poll(lambda: _out(client, base, "relay"))  # two failed probes in a row (seen up before)
            status, headers, body = await generate(client, base)
            assert status == 503 and headers["Retry-After"] == "1" and "relay" in body["message"], body
            assert len(fakes.records("rld", "generate")) == 1  # nothing started
            async with client.get(f"{base}/health") as resp:
                assert resp.status == 503 and (await resp.json())["available"]["relay"] == 0
            knobs.health_status["rld"] = 200  # recovered: after the cooldown a probe closes the breaker

            async def served():
                return (await generate(client, base))[0] == 200

            assert await poll(served)
            async with client.get(f"{base}/pdd/backends", headers={OPERATOR_HEADER: TOKEN}) as resp:
                rows = {r["role"]: r for r in (await resp.json())["backends"]}
            assert rows["relay"]["breaker"] == "closed" and rows["relay"]["pickable"]

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_failing_md_leaves_requests_to_rld_with_the_reason(router_sglang_state):
    knobs = Knobs()

    async def main():
        async with router_on_fakes(router_sglang_state, knobs, cooldown_s=60) as (base, client, fakes):
            assert await poll(lambda: _async(len(fakes.records("md", "health")) >= 1))  # seen up
            knobs.health_status["md"] = 503
            assert await poll(lambda: _out(client, base, "main"))
            status, _, body = await generate(client, base)
            pdd = body["meta_info"]["pdd"]
            assert status == 200 and body["output_ids"] == truth(PROMPT, 8)
            assert pdd["path"] == "p_rld_only" and pdd["fallbacks"] == ["md_unavailable: every MD is failing or draining"]
            assert fakes.records("md", "register") == []  # not asked at all

    asyncio.run(asyncio.wait_for(main(), 60))


async def _out(client, base, role: str) -> bool:
    """The router's own view (GET /pdd/backends): may it pick the ``role`` server now?"""
    async with client.get(f"{base}/pdd/backends", headers={OPERATOR_HEADER: TOKEN}) as resp:
        return not next(r for r in (await resp.json())["backends"] if r["role"] == role)["pickable"]


def test_drain_is_operator_only_and_stops_new_requests_not_running_ones(router_sglang_state):
    knobs = Knobs(rld_token_delay_s=0.05)

    async def main():
        async with router_on_fakes(router_sglang_state, knobs, interval_s=0) as (base, client, fakes):
            drain = f"{base}/pdd/backends/drain"
            async with client.post(drain, json={"url": fakes.rld_url}) as resp:
                assert resp.status == 403
            for bad, status in (({"url": 5}, 400), ({"url": "http://nowhere:1"}, 404),
                                ({"url": fakes.rld_url, "draining": "yes"}, 400)):
                async with client.post(drain, json=bad, headers={OPERATOR_HEADER: TOKEN}) as resp:
                    assert resp.status == status, bad
            running = asyncio.ensure_future(generate(client, base))  # 8 tokens at 50 ms: still running below
            assert await poll(lambda: _async(len(fakes.records("rld", "generate")) == 1))
            async with client.post(drain, json={"url": fakes.rld_url}, headers={OPERATOR_HEADER: TOKEN}) as resp:
                assert resp.status == 200 and (await resp.json())["inflight"] == 1
            status, headers, _ = await generate(client, base)
            assert status == 503 and headers["Retry-After"] == "1"
            status, _, body = await running
            assert status == 200 and body["output_ids"] == truth(PROMPT, 8)  # the running one finished
            async with client.post(drain, json={"url": fakes.rld_url, "draining": False},
                                   headers={OPERATOR_HEADER: TOKEN}) as resp:
                assert resp.status == 200
            assert (await generate(client, base))[0] == 200

    asyncio.run(asyncio.wait_for(main(), 60))


async def _async(value):
    return value


def test_legs_that_break_on_a_server_open_its_breaker_passively(router_sglang_state):
    knobs = Knobs(rld_fail_after={1: 2}, md_ready="never")

    async def main():
        async with router_on_fakes(router_sglang_state, knobs, cooldown_s=60, interval_s=0) as (base, client, fakes):
            for _ in range(2):  # RLD drops the connection mid-stream: a failure of that server
                assert (await generate(client, base))[0] == 502
            status, headers, body = await generate(client, base)
            assert status == 503 and "relay" in body["message"], body

    asyncio.run(asyncio.wait_for(main(), 60))


def one_of_each_breaking_at_two(fakes, cfg, sglang_state) -> Router:
    """A router over one fake P, RLD and MD whose breakers open after two failures (60 s cool-down)
    and that probes only when the test asks."""
    pools = Pools([PrefillBackend(fakes.p_url, 8998)], [fakes.rld_url],
                  [MainBackend(fakes.md_url, fakes.md_url, "127.0.0.1:1")],
                  health=HealthConfig(failure_threshold=2, cooldown_s=60))
    return Router(pools, cfg, None, max_prompt_tokens=1000, served_model="tiny", sglang_state=sglang_state,
                  max_new_tokens_cap=64, operator_token=TOKEN, health_check_interval_s=0)


@pytest.mark.parametrize("fault", ["bad_event_signature", "bad_reply_signature", "bad_ready_signature",
                                   "oversized_event"])
def test_md_replies_the_router_refuses_count_against_mds_breaker(router_sglang_state, fault):
    """A reply or stream event from MD whose signature does not verify, or an event over the
    request's bound, is MD failing (as a dropped connection is): each request ran MD, then a
    whole P->RLD recovery, and the breaker never opened (10 of 10 in the review). Now two such
    requests open it (threshold 2 here) and the next ones stay off MD, every answer whole."""
    from sglang_pdd.router.backends.clients import use_control_key
    from tests.support.flow_scenarios import p_md_cfg

    key = b"breaker-test-control-key-0123456789"
    knobs = Knobs(md_bad_event_sig=fault == "bad_event_signature", md_bad_ready_sig=fault == "bad_ready_signature",
                  md_pad_bytes=(8 << 20) if fault == "oversized_event" else 0)

    async def main():
        fakes = await Fakes(knobs, control_key=b"another-key-for-md-0123456789abcdef" if fault == "bad_reply_signature"
                            else key).start()
        router = one_of_each_breaking_at_two(fakes, p_md_cfg(), router_sglang_state)
        try:
            async with serve_app(build_app(router)) as base, aiohttp.ClientSession() as client:
                for _ in range(4):
                    status, _, body = await generate(client, base)
                    assert status == 200 and body["output_ids"] == truth(PROMPT, 8), body
                assert len(fakes.records("md", "register")) == 2  # the third request on: MD not asked
                assert await _out(client, base, "main")
        finally:
            await fakes.stop()

    use_control_key(key)
    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        use_control_key(None)


@pytest.mark.parametrize("hold", ["first token", "mid stream"])
def test_a_relay_holding_mds_stream_opens_mds_breaker_despite_passing_probes(router_sglang_state, hold):
    """A relay holding MD's handoff stream (no first token, or no next token) charged each
    request a stall and never counted against MD (3 of 3 requests, +0), and MD's /health
    passing between requests reset any streak. Now each stall is MD failing, probes between
    do not erase them, and after two (threshold 2 here) MD is not asked; every answer whole."""
    import dataclasses

    from tests.support.flow_scenarios import p_md_cfg

    async def held(index, budget):
        if index == (0 if hold == "first token" else 2):
            await asyncio.sleep(30)

    knobs = Knobs(md_before_token=held)
    cfg = dataclasses.replace(p_md_cfg(), md_first_token_timeout_s=0.3, md_stall_timeout_s=0.3)

    async def main():
        fakes = await Fakes(knobs).start()
        router = one_of_each_breaking_at_two(fakes, cfg, router_sglang_state)
        try:
            async with serve_app(build_app(router)) as base, aiohttp.ClientSession() as client:
                for _ in range(4):
                    status, _, body = await generate(client, base)
                    assert status == 200 and body["output_ids"] == truth(PROMPT, 8), body
                    await router.probe_backends()  # MD's /health passes between requests
                assert len(fakes.records("md", "handoff")) == 2  # the third request on: MD not asked
                assert await _out(client, base, "main")
        finally:
            await fakes.stop()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_request_whose_relay_refuses_before_the_first_token_starts_over_elsewhere(router_sglang_state):
    async def main():
        async with router_on_fakes(router_sglang_state, Knobs(), interval_s=0, dead_relays=1) as (base, client, fakes):
            for stream in (False, True):
                async with client.post(f"{base}/generate", headers={OPERATOR_HEADER: TOKEN}, json={
                        "input_ids": PROMPT, "stream": stream, "sampling_params": {"max_new_tokens": 8}}) as resp:
                    assert resp.status == 200
                    body = (await sse(resp))[-1] if stream else await resp.json()
                assert body["output_ids"] == truth(PROMPT, 8)
                fallbacks = body["meta_info"]["pdd"]["fallbacks"]
                assert len(fallbacks) == 1 and fallbacks[0].startswith("retried_elsewhere: http://127.0.0.1:"), fallbacks
            # every MD room the failed attempts registered was released
            assert sorted(fakes.released_rooms()) == sorted(fakes.registered_rooms())

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_request_counts_on_p_until_ps_reply_and_on_rld_to_its_end(router_sglang_state):
    async def main():
        async with router_on_fakes(router_sglang_state, Knobs(rld_token_delay_s=0.05), interval_s=0) as (
                base, client, fakes):
            running = asyncio.ensure_future(generate(client, base))  # 8 tokens at 50 ms on RLD

            async def inflight() -> dict:
                async with client.get(f"{base}/pdd/backends", headers={OPERATOR_HEADER: TOKEN}) as resp:
                    return {r["role"]: r["inflight"] for r in (await resp.json())["backends"]}

            assert await poll(lambda: _async(len(fakes.records("rld", "generate")) == 1))
            assert await poll(lambda: _p_done_rld_busy(inflight))  # P replied; RLD still decodes
            assert (await running)[0] == 200
            assert await inflight() == {"prefill": 0, "relay": 0, "main": 0}

    asyncio.run(asyncio.wait_for(main(), 60))


async def _p_done_rld_busy(inflight) -> bool:
    counts = await inflight()
    return counts["prefill"] == 0 and counts["relay"] == 1


def test_failed_probes_of_a_server_never_seen_up_do_not_open_its_breaker():
    s = BreakerState()
    for t in range(5):  # the router started before its backends finished loading
        s = after(s, BackendFailed(float(t), "connection refused", probe=True))
    assert s.breaker is BreakerPhase.CLOSED and s.last_error == "connection refused"
    s = after(s, BackendFailed(5.0, "a request failed on it"))  # requests count regardless
    assert s.failures == 1
    s = after(s, BackendSucceeded(6.0))
    for t in (7.0, 8.0):  # once seen up, probes count
        s = after(s, BackendFailed(t, "503", probe=True))
    assert s.breaker is BreakerPhase.OPEN


def test_the_board_counts_each_failure_that_counted_by_server_and_source():
    board = HealthBoard(CFG)
    relay = ("relay", "http://r0")
    board.record(relay, BackendFailed(0.0, "refused", probe=True))  # never seen up: still starting, not counted
    assert board.failures == {}
    board.record(relay, BackendFailed(1.0, "reset"))  # a request's leg counts regardless
    board.record(relay, BackendSucceeded(2.0))
    for t in (3.0, 4.0, 5.0):  # seen up: probes count, also while the breaker is open
        board.record(relay, BackendFailed(t, "refused", probe=True))
    assert board.failures == {(relay, "request"): 1, (relay, "probe"): 3}
    board.record(relay, Drain(True))
    assert sum(board.failures.values()) == 4
