"""A relay leg whose servers stop progressing ends within its deadline (router/backends/stall.py's rule,
backends.until_relay_stalled, the lifecycle's RelayStalled), and a busy server is not a stopped
one. Without the guard such a request waited for --request-timeout-s (600 s by default)."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time

import pytest

from sglang_pdd.router.backends.clients import StreamStalled, until_relay_stalled
from sglang_pdd.router.policy import Path
from sglang_pdd.router.backends.stall import BackendProgress, RelayStallBounds, wait_left
from tests.support.fake_backends import Knobs, truth, wait_until
from tests.support.flow_scenarios import PROMPT, assert_invariants, emitted_at_least, flow_config, leg_rid, scenario

pytestmark = pytest.mark.timeout(60)

BOUNDS = RelayStallBounds(stall_s=30.0, first_s=120.0)


# ---------------------------------------------------------------------- the rule (pure)
def test_a_leg_waits_out_its_own_bound_first():
    assert wait_left(BOUNDS, waited_s=10.0, first=False, rld_idle_s=math.inf) == pytest.approx(20.0)
    assert wait_left(BOUNDS, waited_s=10.0, first=True, rld_idle_s=math.inf) == pytest.approx(110.0)


def test_past_its_bound_a_leg_on_a_silent_rld_is_stalled():
    assert wait_left(BOUNDS, waited_s=30.0, first=False, rld_idle_s=30.0) <= 0
    assert wait_left(BOUNDS, waited_s=121.0, first=True, rld_idle_s=math.inf, p_idle_s=None) <= 0


def test_an_rld_progressing_on_other_streams_is_busy_not_stopped():
    """A request retracted or queued on an RLD that decodes others waits; the check comes back
    when RLD could have been silent for the whole window."""
    assert wait_left(BOUNDS, waited_s=300.0, first=False, rld_idle_s=1.0) == pytest.approx(29.0)
    assert wait_left(BOUNDS, waited_s=300.0, first=True, rld_idle_s=0.0) == pytest.approx(30.0)


def test_before_its_first_token_a_leg_p_owes_a_reply_waits_while_p_progresses():
    assert wait_left(BOUNDS, waited_s=200.0, first=True, rld_idle_s=math.inf, p_idle_s=5.0) == pytest.approx(25.0)
    assert wait_left(BOUNDS, waited_s=200.0, first=True, rld_idle_s=math.inf, p_idle_s=30.0) <= 0


def test_a_bound_of_zero_is_no_bound_and_the_window_falls_back_to_the_other():
    assert wait_left(RelayStallBounds(stall_s=0.0, first_s=120.0), 1e6, False, math.inf) is None
    assert wait_left(RelayStallBounds(stall_s=30.0, first_s=0.0), 1e6, True, math.inf) is None
    only_first = RelayStallBounds(stall_s=0.0, first_s=10.0)
    assert only_first.window == 10.0
    assert wait_left(only_first, 10.0, True, rld_idle_s=4.0) == pytest.approx(6.0)


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_bounds_that_make_no_sense_are_refused(bad):
    with pytest.raises(ValueError, match="stall_s"):
        RelayStallBounds(stall_s=bad)
    with pytest.raises(ValueError, match="first_s"):
        RelayStallBounds(first_s=bad)


def test_progress_is_per_server_and_never_goes_back():
    progress = BackendProgress()
    assert progress.idle_s("rld", 100.0) == math.inf
    progress.note("rld", 100.0)
    progress.note("rld", 90.0)  # a late note from an older read
    assert progress.idle_s("rld", 104.0) == pytest.approx(4.0)
    assert progress.idle_s("p", 104.0) == math.inf


# ---------------------------------------------------------------------- the stream wrapper
async def _stream(tokens_then_silence: int, every_s: float = 0.01, closed: list = None):
    try:
        for i in range(tokens_then_silence):
            await asyncio.sleep(every_s)
            yield {"output_ids": list(range(i + 1))}
        await asyncio.sleep(3600)
    finally:
        if closed is not None:
            closed.append(True)


async def _read(events, bounds, progress, p_replied=lambda: True):
    got = []
    async for event in until_relay_stalled(events, bounds, progress, "rld", "p", p_replied, "RLD"):
        got.append(event)
    return got


def test_a_silent_stream_on_a_silent_rld_stalls_within_its_bound_and_is_closed():
    closed = []

    async def main():
        t0 = time.monotonic()
        with pytest.raises(StreamStalled, match="no new token within 0.3 s"):
            await _read(_stream(3, closed=closed), RelayStallBounds(0.3, 5.0), BackendProgress())
        return time.monotonic() - t0

    took = asyncio.run(main())
    assert 0.3 <= took < 3.0 and closed == [True]


def test_a_stream_waiting_on_a_busy_rld_is_not_stalled_until_the_rld_stops():
    """Another stream of the same RLD gets tokens for 1 s: the silent one waits that long,
    then stalls once RLD itself was silent for its bound."""
    async def main():
        progress = BackendProgress()
        loop = asyncio.get_running_loop()

        async def other_stream():
            for _ in range(20):
                await asyncio.sleep(0.05)
                progress.note("rld", loop.time())

        busy = asyncio.ensure_future(other_stream())
        t0 = time.monotonic()
        with pytest.raises(StreamStalled):
            await _read(_stream(1), RelayStallBounds(0.2, 5.0), progress)
        await busy
        return time.monotonic() - t0

    took = asyncio.run(main())
    assert took >= 1.1  # the other stream's second plus the bound


def test_before_the_first_token_a_p_that_owes_its_reply_and_progresses_holds_the_bound_off():
    async def main():
        progress = BackendProgress()
        loop = asyncio.get_running_loop()

        async def p_replying_to_others():
            for _ in range(10):
                await asyncio.sleep(0.05)
                progress.note("p", loop.time())

        busy = asyncio.ensure_future(p_replying_to_others())
        t0 = time.monotonic()
        with pytest.raises(StreamStalled, match="no first token within 0.1 s"):
            await _read(_stream(0), RelayStallBounds(0.2, 0.1), progress, p_replied=lambda: False)
        await busy
        return time.monotonic() - t0

    assert asyncio.run(main()) >= 0.65  # P's half second plus the window


def test_events_that_carry_no_new_token_are_no_progress():
    async def keep_alive():
        yield {"output_ids": [1]}
        for _ in range(200):
            await asyncio.sleep(0.01)
            yield {"output_ids": [1]}

    async def main():
        with pytest.raises(StreamStalled):
            await _read(keep_alive(), RelayStallBounds(0.3, 5.0), BackendProgress())

    asyncio.run(main())


def test_a_cancel_of_the_reading_leg_is_a_cancel_not_a_stall():
    async def main():
        task = asyncio.ensure_future(_read(_stream(2), RelayStallBounds(5.0, 5.0), BackendProgress()))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


# ---------------------------------------------------------------------- the flow, on fake servers
def _rld_stops_at(index: int, leg: int = 1):
    async def hook(leg_no, i):
        if leg_no == leg and i == index:
            await asyncio.sleep(60)  # a stopped RLD: the connection open, nothing on it
    return hook


def _cfg(**kw):
    return dataclasses.replace(flow_config(), relay_stall_timeout_s=0.5, relay_first_token_timeout_s=1.0,
                               request_timeout_s=30.0, **kw)


def test_rld_stopping_mid_stream_ends_the_request_clearly_with_every_token_it_sent():
    knobs = Knobs(rld_before_token=_rld_stops_at(5))
    t0 = time.monotonic()
    run = scenario(knobs, max_new=30, cfg=_cfg(), force_path=Path.P_RLD_ONLY)
    assert time.monotonic() - t0 < 10  # the bound, not the request's 30 s, nor RLD's 60
    assert run.error is not None and "stalled" in str(run.error) and "--relay-stall-timeout-s" in str(run.error)
    assert_invariants(run, 30, complete=False)
    assert run.emitted == truth(PROMPT, 5)  # nothing lost, nothing twice
    assert leg_rid(run, "r1") in run.fakes.aborted_rids("rld")  # RLD's request freed
    assert ("relay", run.fakes.rld_url) in run.flow.result.failed_backends  # its breaker counts it


def test_rld_stopping_before_its_first_token_fails_within_the_first_token_bound():
    knobs = Knobs(rld_before_token=_rld_stops_at(0))
    run = scenario(knobs, max_new=20, cfg=_cfg(), force_path=Path.P_RLD_ONLY)
    assert run.error is not None and "no first token" in str(run.error)
    assert run.emitted == []
    assert leg_rid(run, "r1") in run.fakes.aborted_rids("rld")


def test_rld_stopping_before_the_handoff_lets_md_go_on_from_the_clients_tokens():
    """P->RLD->MD: RLD stops after 4 tokens while MD's KV is on its way. MD takes over at the
    client's 4 tokens once its KV lands: the client gets the whole output, every token once."""
    knobs = Knobs(rld_before_token=_rld_stops_at(4))

    def gates(run):
        async def ready_once_rld_stalled(room):
            await wait_until(lambda: run.flow.state.relay_stalled, timeout_s=10)
        knobs.md_before_ready = ready_once_rld_stalled

    run = scenario(knobs, max_new=30, cfg=_cfg(), gates=gates)
    assert_invariants(run, 30)
    r = run.flow.result
    assert r.handoff_at == 4 and r.md_tokens == 26
    assert [f.reason.value for f in r.fallbacks] == ["relay_stalled"]


def test_rld_and_md_both_stopping_ends_the_request_with_rlds_tokens():
    knobs = Knobs(rld_before_token=_rld_stops_at(4), md_ready="failed")

    def gates(run):
        knobs.md_before_ready = emitted_at_least(run, 4)

    run = scenario(knobs, max_new=30, cfg=_cfg(), gates=gates)
    assert run.error is not None and "stalled" in str(run.error)
    assert run.emitted == truth(PROMPT, 4)
    assert_invariants(run, 30, complete=False)
