"""The router tells every MD which P hosts send it KV (router/backends/kv_senders.py), so MD's WAN
receiver counts them as known peers even right after MD started (a keyless flood of its
unknown-source handshake slots then cannot keep them out: tests/unit/kv_channel/test_admission.py).
On fake backends: no SGLang."""

from __future__ import annotations

import asyncio

import aiohttp
from tests.support.fake_backends import Fakes, closed_port, serve_app, wait_until
from tests.support.flow_scenarios import flow_config

from sglang_pdd.router.backends import kv_senders
from sglang_pdd.router.front.app import Router, build_app
from sglang_pdd.router.backends.servers import MainBackend, PrefillBackend
from sglang_pdd.router.backends.pools import Pools


def test_p_hosts_are_resolved_to_addresses_once_each():
    async def run():
        prefills = [PrefillBackend("http://127.0.0.1:1", 1, "127.0.0.1"), PrefillBackend("http://localhost:2", 2,
                                                                                         "localhost"),
                    PrefillBackend("http://p.invalid:3", 3, "p.invalid")]  # does not resolve: left out, logged
        return await kv_senders.p_addresses(prefills)

    got = asyncio.run(run())
    assert "127.0.0.1" in got and got == sorted(set(got)) and all(not a.endswith(".invalid") for a in got)


def test_the_router_tells_every_md_its_p_hosts_at_start():
    async def run():
        fakes = await Fakes().start()
        pools = Pools([PrefillBackend(fakes.p_url, 8998, "127.0.0.1")], [fakes.rld_url],
                      [MainBackend(fakes.md_url, fakes.md_url, "127.0.0.1:1")])
        router = Router(pools, flow_config(), None, max_prompt_tokens=1000, served_model="tiny",
                        health_check_interval_s=0)
        try:
            async with serve_app(build_app(router)):
                await wait_until(lambda: fakes.records("md", "kv_senders"), timeout_s=5)
                assert fakes.records("md", "kv_senders")[0].body == {"sources": ["127.0.0.1"]}
        finally:
            await fakes.stop()

    asyncio.run(asyncio.wait_for(run(), 20))


def test_an_md_that_does_not_answer_is_asked_again_until_it_does():
    async def run():
        fakes = await Fakes().start()
        down = MainBackend("http://127.0.0.1:1", f"http://127.0.0.1:{closed_port()}", "127.0.0.1:1")
        up = MainBackend(fakes.md_url, fakes.md_url, "127.0.0.1:1")
        try:
            async with aiohttp.ClientSession() as session:
                assert await kv_senders.announce(session, [down, up], ["10.0.0.7"]) == {
                    down.control_url: False, up.control_url: True}
                task = asyncio.ensure_future(kv_senders.announce_forever(
                    session, [up], [PrefillBackend("http://127.0.0.1:1", 1)], interval_s=60, retry_s=0.05))
                await wait_until(lambda: len(fakes.records("md", "kv_senders")) == 2, timeout_s=5)
                await asyncio.sleep(0.3)  # taken: the next announcement waits for interval_s
                assert len(fakes.records("md", "kv_senders")) == 2
                task.cancel()
        finally:
            await fakes.stop()

    asyncio.run(asyncio.wait_for(run(), 20))
