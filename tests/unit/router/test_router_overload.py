"""Overload shedding (router/front/overload.py): past its cap of requests in flight the router
answers 503 with Retry-After at once, starting nothing, instead of queueing for minutes. The
caps are pure logic; the router's replies run against the fake backends."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from sglang_pdd.router.front.app import OPERATOR_HEADER, Router, build_app
from sglang_pdd.router.backends.servers import MainBackend, PrefillBackend
from sglang_pdd.router.front.overload import OverloadLimits, refusal, relay_cap, running_slots_of, total_cap
from sglang_pdd.router.backends.pools import Pools
from tests.support.fake_backends import Fakes, Knobs, serve_app, truth
from tests.support.flow_scenarios import PROMPT, flow_config

TOKEN = "operator-secret-0123456789"
pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------------------- the caps (pure)
def test_caps_come_from_the_relays_running_slots_unless_given():
    lim = OverloadLimits()
    assert relay_cap(lim, 16) == 64 and relay_cap(lim, None) is None  # not known yet: no cap
    assert total_cap(lim, {"a": 16, "b": 8}) == 96 and total_cap(lim, {"a": 16, "b": None}) is None
    given = OverloadLimits(per_relay=5, total=7)
    assert relay_cap(given, 16) == 5 and relay_cap(given, None) == 5 and total_cap(given, {"a": None}) == 7
    for bad in ({"per_relay": 0}, {"total": -1}, {"queue_factor": 0.5}):
        with pytest.raises(ValueError):
            OverloadLimits(**bad)


def test_a_request_is_refused_when_its_relay_or_the_router_is_full():
    lim = OverloadLimits(queue_factor=2.0)
    slots = {"a": 2, "b": 2}
    assert refusal(lim, "a", {"a": 3, "b": 0}, slots) is None
    assert "--max-inflight-per-relay" in refusal(lim, "a", {"a": 4, "b": 0}, slots)
    assert "--max-inflight-total" in refusal(OverloadLimits(total=3), "b", {"a": 2, "b": 1}, slots)
    assert refusal(lim, "a", {"a": 100}, {"a": None}) is None  # an RLD not yet known is not bounded


def test_running_slots_are_read_from_sglangs_v1_loads():
    assert running_slots_of({"loads": [{"dp_rank": 0, "max_running_requests": 16},
                                       {"dp_rank": 1, "max_running_requests": 16}]}) == 32
    for reply in ({}, {"loads": "x"}, {"loads": [{"max_running_requests": True}]}, None):
        assert running_slots_of(reply) is None


# ---------------------------------------------------------------------------- the router
async def _generate(client, base):
    async with client.post(f"{base}/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8}},
                           headers={OPERATOR_HEADER: TOKEN}) as resp:
        return resp.status, dict(resp.headers), await resp.json()


@pytest.mark.parametrize("caps", ["flags", "from /v1/loads"])
def test_past_its_cap_the_router_answers_503_at_once_and_serves_again_after(router_sglang_state, caps):
    """An RLD that holds its requests (a saturated cluster): past the cap a request gets 503
    with Retry-After within a second, P and RLD never see it; the held ones complete whole,
    and once they have, requests are served again."""
    release = asyncio.Event()

    async def hold(leg, i):
        if i == 1:
            await release.wait()

    knobs = Knobs(rld_before_token=hold, rld_max_running=1 if caps == "from /v1/loads" else None)
    limits = OverloadLimits(per_relay=2) if caps == "flags" else OverloadLimits(queue_factor=2.0)

    async def main():
        fakes = await Fakes(knobs).start()
        pools = Pools([PrefillBackend(fakes.p_url, 8998)], [fakes.rld_url],
                      [MainBackend(fakes.md_url, fakes.md_url, "127.0.0.1:1")])
        router = Router(pools, flow_config(), None, max_prompt_tokens=1000, served_model="tiny",
                        sglang_state=router_sglang_state, max_new_tokens_cap=64, operator_token=TOKEN,
                        health_check_interval_s=0, overload=limits)
        try:
            async with serve_app(build_app(router)) as base, aiohttp.ClientSession() as client:
                if caps == "from /v1/loads":
                    deadline = time.monotonic() + 10
                    while router.flows.relay_slots[fakes.rld_url] != 1 and time.monotonic() < deadline:
                        await asyncio.sleep(0.02)
                    assert router.flows.relay_slots[fakes.rld_url] == 1
                held = [asyncio.ensure_future(_generate(client, base)) for _ in range(2)]
                deadline = time.monotonic() + 10
                # both held requests counted on RLD by the router *and* arrived there: their legs
                # reach RLD a moment after the router counts them
                while (pools.rld_inflight[fakes.rld_url] < 2 or len(fakes.records("rld", "generate")) < 2) \
                        and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                legs = len(fakes.records("rld", "generate"))
                assert legs == 2
                t0 = time.monotonic()
                status, headers, body = await _generate(client, base)
                assert status == 503 and headers.get("Retry-After") == "1", body
                assert "overloaded" in body["error"], body
                assert time.monotonic() - t0 < 1.0
                assert len(fakes.records("rld", "generate")) == legs  # nothing started for it
                release.set()
                for done in await asyncio.gather(*held):
                    assert done[0] == 200 and done[2]["output_ids"] == truth(PROMPT, 8)
                status, _, body = await _generate(client, base)
                assert status == 200 and body["output_ids"] == truth(PROMPT, 8)
                async with client.get(f"{base}/metrics") as resp:
                    assert "pdd:overload_refused_total 1.0" in await resp.text()
        finally:
            release.set()
            await fakes.stop()

    asyncio.run(asyncio.wait_for(main(), 50))
