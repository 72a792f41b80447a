"""The router's HTTP front (``Router`` + ``build_app``, SGLang's serving layer in process) on
fake P / RLD / MD backends, for tests of its API; and reading its SSE replies."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp

from sglang_pdd.router.front.app import Router, build_app
from sglang_pdd.router.backends.servers import MainBackend, PrefillBackend
from sglang_pdd.router.backends.pools import Pools
from tests.support.fake_backends import Fakes, Knobs, serve_app
from tests.support.flow_scenarios import flow_config

TOKEN = "operator-secret-0123456789"


@contextlib.asynccontextmanager
async def front(state, knobs: Knobs = None, max_body_bytes: int = 1 << 20, **router_kwargs):
    fakes = await Fakes(knobs or Knobs()).start()
    pools = Pools([PrefillBackend(fakes.p_url, 8998)], [fakes.rld_url],
                  [MainBackend(fakes.md_url, fakes.md_url, "127.0.0.1:1")])
    router = Router(pools, flow_config(), None, max_prompt_tokens=1000, served_model="tiny", sglang_state=state,
                    max_new_tokens_cap=64, operator_token=TOKEN, **router_kwargs)
    try:
        async with serve_app(build_app(router, max_body_bytes)) as base, aiohttp.ClientSession() as client:
            yield base, client, fakes, router
    finally:
        await fakes.stop()


def run(coro):
    asyncio.run(asyncio.wait_for(coro, 60))


async def sse(resp) -> list[dict]:
    events = []
    async for line in resp.content:
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
            events.append(json.loads(line[6:]))
    return events
