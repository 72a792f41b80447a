"""The PDD router's HTTP front (aiohttp): SGLang-native /generate over a P, RLD and MD pool.

This module is I/O only. Path decisions come from router/policy.py (pure); for now every
request takes the same-datacenter PD path P -> RLD (the harness later paths extend).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import random
import urllib.parse
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

logger = logging.getLogger("sglang_pdd.router")

MAX_BODY_BYTES = 64 * 1024 * 1024


@dataclass
class PrefillBackend:
    url: str
    bootstrap_port: int

    @property
    def host(self) -> str:
        return urllib.parse.urlparse(self.url).hostname


@dataclass
class Pools:
    prefill: list[PrefillBackend]
    relay: list[str]
    main: list[str] = field(default_factory=list)

    def __post_init__(self):
        if not self.prefill or not self.relay:
            raise ValueError("the router needs at least one --prefill and one --relay server")
        self._rr = itertools.count()

    def pick(self) -> tuple[PrefillBackend, str]:
        i = next(self._rr)
        return self.prefill[i % len(self.prefill)], self.relay[i % len(self.relay)]


def new_bootstrap_room() -> int:
    return random.randint(0, 2**63 - 1)


def with_bootstrap(body: dict, prefill: PrefillBackend, room: int) -> dict:
    return {**body, "bootstrap_host": prefill.host, "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": room}


class Router:
    def __init__(self, pools: Pools, request_timeout_s: float = 600.0):
        self.pools = pools
        self.timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self.session: aiohttp.ClientSession | None = None

    async def start(self, app):
        self.session = aiohttp.ClientSession(timeout=self.timeout)

    async def close(self, app):
        await self.session.close()

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "prefill": len(self.pools.prefill),
                                  "relay": len(self.pools.relay), "main": len(self.pools.main)})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return web.json_response({"error": f"malformed JSON body: {e}"}, status=400)
        if not isinstance(body, dict) or not ("text" in body or "input_ids" in body):
            return web.json_response({"error": "body must be an object with 'text' or 'input_ids'"},
                                     status=400)
        prefill, relay = self.pools.pick()
        routed = with_bootstrap(body, prefill, new_bootstrap_room())
        if body.get("stream"):
            return await self._pd_stream(request, routed, prefill, relay)
        return await self._pd_once(routed, prefill, relay)

    async def _pd_once(self, body: dict, prefill: PrefillBackend, relay: str) -> web.Response:
        p_task = asyncio.ensure_future(self.session.post(f"{prefill.url}/generate", json=body))
        try:
            async with self.session.post(f"{relay}/generate", json=body) as resp:
                payload = await resp.json(content_type=None)
                status = resp.status
        finally:
            await _drain(p_task)
        return web.json_response(payload, status=status)

    async def _pd_stream(self, request, body, prefill: PrefillBackend, relay: str):
        p_task = asyncio.ensure_future(self.session.post(f"{prefill.url}/generate", json=body))
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        try:
            async with self.session.post(f"{relay}/generate", json=body) as resp:
                await out.prepare(request)
                async for chunk in resp.content.iter_any():
                    await out.write(chunk)
        finally:
            await _drain(p_task)
        await out.write_eof()
        return out


async def _drain(task: asyncio.Future) -> None:
    """Finish (or cancel) the prefill leg; its body carries nothing the client needs."""
    try:
        resp = await asyncio.wait_for(task, timeout=30)
        await resp.read()
        resp.release()
    except (asyncio.TimeoutError, aiohttp.ClientError) as e:
        logger.warning("prefill leg did not finish cleanly: %r", e)
        task.cancel()


def build_app(pools: Pools) -> web.Application:
    router = Router(pools)
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.close)
    app.router.add_get("/health", router.health)
    app.router.add_post("/generate", router.generate)
    return app


def _prefill_arg(value: str) -> PrefillBackend:
    url, _, port = value.rpartition(",")
    if not url or not port.isdigit():
        raise argparse.ArgumentTypeError(f"--prefill must be URL,BOOTSTRAP_PORT, got {value!r}")
    return PrefillBackend(url, int(port))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m sglang_pdd.router",
                                 description="PDD router: P, RLD and MD pools behind one /generate.")
    ap.add_argument("--prefill", type=_prefill_arg, action="append", required=True,
                    help="URL,BOOTSTRAP_PORT of a prefill server (repeatable)")
    ap.add_argument("--relay", action="append", required=True, help="URL of a relay decode server")
    ap.add_argument("--main", action="append", default=[], help="URL of a main decode server")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30300)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    web.run_app(build_app(Pools(args.prefill, args.relay, args.main)), host=args.host,
                port=args.port, print=None)
