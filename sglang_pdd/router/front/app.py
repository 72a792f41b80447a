"""The PDD router's HTTP front (aiohttp): SGLang's API over P, RLD and MD pools.

I/O only: per request item a ``PddFlow`` (router/flow/pdd_flow.py) runs the legs, opened and accounted
for by the ``FlowRunner`` (router/front/flow_runner.py) from the item's settled parameters
(router/flow/request.py); path and handoff decisions come from the pure policy modules, the
servers from the pools (router/backends/pools.py).
``/generate`` and the OpenAI endpoints are served by SGLang's own code on the router's
``PddTokenizerManager`` (router/front/serving.py, router/front/openai_front.py); what clients may send is
checked by router/front/validate.py. The API, its limits and what is operator-only: docs/api.md.
The command line that starts it: router/front/cli.py.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from typing import AsyncIterator, Optional

import aiohttp
from aiohttp import web

from sglang.srt.entrypoints.api_contract import generate_contract_error
from sglang.srt.managers.io_struct import GenerateReqInput

from sglang_pdd.handoff.policy import HandoffMode
from sglang_pdd.router.front import client_auth
from sglang_pdd.router.backends import kv_senders
from sglang_pdd.router.backends import loads
from sglang_pdd.router.front import shared_drain
from sglang_pdd.router.front.overload import OverloadLimits, running_slots_of
from sglang_pdd.router.backends.clients import BackendError, MainControl, error_text, read_bounded
from sglang_pdd.router.backends.reply_limits import MAX_CONTROL_REPLY_BYTES
from sglang_pdd.router.flow.pdd_flow import FlowConfig
from sglang_pdd.router.backends.servers import MainBackend
from sglang_pdd.router.flow.request import FlowRequest
from sglang_pdd.router.front.flow_runner import FlowRunner
from sglang_pdd.router.backends.health import Drain, BackendFailed, BackendSucceeded
from sglang_pdd.router.front.metrics import CONTENT_TYPE, RouterMetrics
from sglang_pdd.protocol import KvSize
from sglang_pdd.router.policy import Path
from sglang_pdd.router.front.openai_front import OpenAIFront, _dumps, dumps_bytes, sse_reply
from sglang_pdd.router.backends.pools import Pools
from sglang_pdd.router.front.scope import RequestScope
from sglang_pdd.router.front.scope import current_scope as _scope
from sglang_pdd.router.front.serving import PddTokenizerManager, UpstreamError
from sglang_pdd.router.front.shared_drain import SharedDrains
from sglang_pdd.router.front.validate import ApiError, LogprobLimits, check_generate_body, parse_json_body

logger = logging.getLogger("sglang_pdd.router")

MAX_BODY_BYTES = 4 * 1024 * 1024  # default of --max-body-bytes


# SGLang's HTTP server drops a keep-alive connection after 5 idle seconds
# (SGLANG_TIMEOUT_KEEP_ALIVE). Reusing one just as it does fails the request with "Server
# disconnected" (seen in CI: a P leg sent 5 s after the previous one), so the router retires
# idle connections well before the server can.
BACKEND_KEEPALIVE_S = 2.0

OPERATOR_HEADER = "X-PDD-Operator-Token"
# /flush_cache: backends get at least this long to become idle (legs the router aborted may
# still be ending there; MD lets go of the pages of rooms that ended), and ``?timeout=`` at most
# MAX_FLUSH_TIMEOUT_S; the router's own requests are polled every FLUSH_POLL_S.
FLUSH_SETTLE_S = 5.0
# On close: how long the work ended requests left (MD's late registrations) may still take;
# each step of it is one control call, bounded by the control client's own timeouts.
LINGERING_SETTLE_S = 5.0
MAX_FLUSH_TIMEOUT_S = 600.0
FLUSH_POLL_S = 0.05
PDD_OPTION_KEYS = {"path", "handoff_mode", "catch_up_threshold", "drc"}


def backend_session(keepalive_s: float = BACKEND_KEEPALIVE_S) -> aiohttp.ClientSession:
    tls = client_auth.backend_ssl()  # --backend-ca-file
    connector = aiohttp.TCPConnector(keepalive_timeout=keepalive_s, **({"ssl": tls} if tls else {}))
    return aiohttp.ClientSession(connector=connector,
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                                 headers=client_auth.backend_headers())  # --backend-api-key


def error_reply(status: int, message: str, err_type: str = "BadRequestError") -> web.Response:
    """SGLang's error body shape (ErrorResponse), with the client-facing message only."""
    return web.json_response({"object": "error", "message": message, "type": err_type, "param": None,
                              "code": status, "error": message}, status=status)


def upstream_reply(e: UpstreamError) -> web.Response:
    """A backend failure (502), or no backend to take the request (503 with Retry-After)."""
    reply = error_reply(e.status_code, e.detail, "ServiceUnavailable" if e.status_code == 503 else "BackendError")
    reply.headers.update(e.headers or {})
    return reply


async def learn_md_kv_sizes(session: aiohttp.ClientSession, mains: list[MainBackend], pools: Pools,
                            attempts: int = 30, interval_s: float = 2.0) -> None:
    """Each MD's KV size (protocol KvSize) from its stats, into the pools, asked at start until it
    answers, so that the first requests' WAN estimates use MD's real size rather than the
    policy's default (46 KB, a 70B-class model: orders of magnitude off for a small one). A
    registration answer already taken is kept."""
    waiting = list(mains)
    for _ in range(attempts):
        for main in list(waiting):
            stats = await MainControl(session, main.control_url).stats() if main.control_url else None
            if stats is not None:
                waiting.remove(main)
                pools.learn_md_kv_size(main.url, KvSize.reported(stats), from_stats=True)
        if not waiting:
            return
        await asyncio.sleep(interval_s)


async def learn_relay_slots(session: aiohttp.ClientSession, slots: dict, relays: list[str],
                            interval_s: float = 2.0, refresh_s: float = 30.0) -> None:
    """Each RLD's running slots (its --max-running-requests) from its /v1/loads, into ``slots``
    (url -> slots): the default overload caps (router/front/overload.py). ``relays`` is the pool's own
    list, which service discovery grows and shrinks: a new RLD is unknown (no cap) until it
    answers, one that left no longer counts toward the total. Asked every ``interval_s``
    until each has answered, then every ``refresh_s`` (a restarted RLD may run another size)."""
    while True:
        for url in [u for u in slots if u not in relays]:
            del slots[url]
        for url in relays:
            slots.setdefault(url, None)
        for url in list(slots):
            reply = await loads.read_loads_reply(session, url)
            known = running_slots_of(reply) if reply is not None else None
            if known is not None:
                slots[url] = known
        await asyncio.sleep(refresh_s if all(v is not None for v in slots.values()) else interval_s)


class Router:
    def __init__(self, pools: Pools, flow_cfg: FlowConfig, tokenizer, max_prompt_tokens: int,
                 served_model: str, *, sglang_state=None, max_new_tokens_cap: int = 32768, max_n: int = 16,
                 operator_token: Optional[str] = None, every_client_is_operator: bool = False,
                 report_cached_tokens: bool = False, max_prompt_chars: Optional[int] = None,
                 max_flows_per_request: int = 64, max_grammar_bytes: int = 16384,
                 logprob_limits: LogprobLimits = LogprobLimits(), health_check_interval_s: float = 10.0,
                 shared_drains: Optional[SharedDrains] = None, measure_prefill: bool = True,
                 overload: OverloadLimits = OverloadLimits()):
        self.pools, self.flow_cfg, self.tokenizer = pools, flow_cfg, tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.served_model = served_model
        self.max_new_tokens_cap, self.max_n = max_new_tokens_cap, max_n
        self.operator_token = operator_token
        self.every_client_is_operator = every_client_is_operator
        self.metrics = RouterMetrics()
        self.flows = FlowRunner(pools, flow_cfg, self.metrics, overload)
        self.metrics.track_backends(pools.inflight())
        self.metrics.track_health(self._health_rows)
        self.metrics.track_failures(self._failure_rows)
        self.metrics.track_after_end(self.flows.lingering.counters)
        self.health_check_interval_s = health_check_interval_s
        self._probes: Optional[asyncio.Task] = None
        self._md_sizes: Optional[asyncio.Task] = None  # learn_md_kv_sizes, from start() on
        self._speeds: Optional[asyncio.Task] = None  # loads.measure_forever, from start() on
        # P's speed from its /v1/loads, unless the operator fixed it (--p-prefill-tokens-per-s)
        self.measure_prefill = measure_prefill
        self._relay_slots: Optional[asyncio.Task] = None  # learn_relay_slots, from start() on
        self._kv_senders: Optional[asyncio.Task] = None  # kv_senders.announce_forever, from start() on
        # --workers: operator drains shared with the other workers (front/shared_drain.py)
        self.shared_drains = shared_drains
        self._drain_sync: Optional[asyncio.Task] = None
        self.manager = None
        if sglang_state is not None:
            server_args, model_config, tok = sglang_state
            self.tokenizer = tok
            self.manager = PddTokenizerManager(
                server_args, model_config, tok, flows=self.flows,
                max_prompt_tokens=max_prompt_tokens, max_new_tokens_cap=max_new_tokens_cap,
                report_cached_tokens=report_cached_tokens, max_prompt_chars=max_prompt_chars, max_flows_per_request=max_flows_per_request,
                max_grammar_bytes=max_grammar_bytes, logprob_limits=logprob_limits)
            self.openai = OpenAIFront(self.manager, served_model, max_n=max_n)

    @property
    def session(self) -> Optional[aiohttp.ClientSession]:
        """The client session to the backends (the flows' too), from start() on."""
        return self.flows.session

    async def start(self, app):
        self.flows.session = backend_session()
        self._md_sizes = asyncio.ensure_future(learn_md_kv_sizes(self.session, self.pools.main, self.pools))
        self._speeds = asyncio.ensure_future(loads.measure_forever(
            self.session, self.pools.prefill, self.pools.main, self.pools.md_flow_step_s, self.measure_prefill))
        self._relay_slots = asyncio.ensure_future(learn_relay_slots(self.session, self.flows.relay_slots,
                                                                     self.pools.relay))
        if self.pools.main:  # each MD learns the P hosts as known KV peers (backends/kv_senders.py)
            self._kv_senders = asyncio.ensure_future(
                kv_senders.announce_forever(self.session, self.pools.main, self.pools.prefill))
        if self.health_check_interval_s > 0:
            self._probes = asyncio.ensure_future(self._probe_forever())
        if self.shared_drains is not None:
            self._drain_sync = asyncio.ensure_future(self._sync_drains_forever())

    async def close(self, app):
        for task in (self._md_sizes, self._speeds, self._relay_slots, self._kv_senders, self._probes,
                     self._drain_sync):
            if task is not None:
                task.cancel()
        # MD's registrations that outlived their request: let them land, bounded
        cancelled = await self.flows.lingering.settle(LINGERING_SETTLE_S)
        if cancelled:
            logger.warning("closing: %d task(s) left by ended requests cancelled after %.0f s", cancelled,
                           LINGERING_SETTLE_S)
        await self.session.close()

    def is_operator(self, request: web.Request) -> bool:
        if self.every_client_is_operator:
            return True
        given = request.headers.get(OPERATOR_HEADER)
        return bool(self.operator_token and given and hmac.compare_digest(given.encode(), self.operator_token.encode()))

    # ------------------------------------------------------------------ routes
    async def health(self, request: web.Request) -> web.Response:
        """200 while the router can serve (a P and an RLD may be picked), else 503: what a load
        balancer in front of several routers needs."""
        now = time.monotonic()
        up = {role: sum(self.pools.health.pickable((role, url), now) for url in urls)
              for role, urls in self.pools.roles().items()}
        serving = up["prefill"] > 0 and up["relay"] > 0
        return web.json_response({"status": "ok" if serving else "unavailable",
                                  **{role: len(urls) for role, urls in self.pools.roles().items()},
                                  "available": up}, status=200 if serving else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        """One token through P and RLD, as SGLang's /health_generate: whether the router can
        serve. MD is not asked (a request needs none to be served; MD's health is its probes')."""
        try:
            flow = self.flows.open(FlowRequest([self._probe_token()], {"max_new_tokens": 1, "temperature": 0}),
                                   with_main=False)
            async with self.flows.run(flow) as events:
                got = [t async for new in events for t in new]
        except UpstreamError as e:
            return error_reply(503, f"unhealthy: {e.detail}", "ServiceUnavailable")
        return web.Response(status=200) if got else error_reply(503, "unhealthy: no token", "ServiceUnavailable")

    def _probe_token(self) -> int:
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return bos if bos is not None else 0

    async def metrics_route(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """SGLang's native /generate: single or batch, ``n``, streaming, logprobs."""
        try:
            body = await parse_json_body(await request.read())
            scope = self._scope(request, body.pop("pdd_options", None))
            # ours first: its messages name the field; then SGLang's own contract (all types)
            check_generate_body(body, cap=self.max_new_tokens_cap, vocab_size=self.manager.vocab_size,
                                max_n=self.max_n)
            contract_error = generate_contract_error(body)
            if contract_error is not None:
                raise ApiError(400, f"bad /generate body: {contract_error}")
            try:
                obj = GenerateReqInput(**body)
            except TypeError as e:
                raise ApiError(400, f"unknown /generate field: {str(e).rsplit(' ', 1)[-1]}") from None
        except ApiError as e:
            return error_reply(e.status, e.message)
        _scope.set(scope)
        gen = self.manager.generate_request(obj, request)
        if not obj.stream:
            try:
                return web.json_response(await gen.__anext__(), dumps=_dumps)
            except ValueError as e:
                return error_reply(400, str(e))
            except UpstreamError as e:
                return upstream_reply(e)
            finally:
                await gen.aclose()
        # The first output before the 200: a request refused by the serving layer (duplicate
        # rid, prompt too long, ...) still gets its 4xx, as on SGLang's OpenAI streams.
        try:
            first = await gen.__anext__()
        except ValueError as e:
            await gen.aclose()
            return error_reply(400, str(e))
        except UpstreamError as e:
            await gen.aclose()
            return upstream_reply(e)
        except StopAsyncIteration:
            return error_reply(502, "the request produced no output", "BackendError")
        return await sse_reply(request, _generate_events(first, gen))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.openai.handle(request, "chat", self._scope)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.openai.handle(request, "completion", self._scope)

    async def models(self, request: web.Request) -> web.Response:
        return await self.openai.models()

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(self.openai.model_info())

    async def server_info(self, request: web.Request) -> web.Response:
        """A decode backend's /server_info (its internal states), plus the router's pools."""
        decoders = [m.url for m in self.pools.main] + list(self.pools.relay)
        if not decoders:  # service discovery has found none yet
            return error_reply(503, "no decode backend to ask for /server_info", "ServiceUnavailable")
        url = decoders[0]
        try:
            async with self.session.get(f"{url}/server_info", timeout=aiohttp.ClientTimeout(total=30)) as resp:
                info = json.loads(await read_bounded(resp, MAX_CONTROL_REPLY_BYTES, f"{url}/server_info"))
            if not isinstance(info, dict):
                raise ValueError("not an object")
        except (BackendError, aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return error_reply(503, "no decode backend answered /server_info", "ServiceUnavailable")
        info["pdd_router"] = {"prefill": len(self.pools.prefill), "relay": len(self.pools.relay),
                              "main": len(self.pools.main), "served_model_name": self.served_model}
        return web.json_response(info)

    async def ready(self, request: web.Request) -> web.Response:
        """SGLang's /ready: 200 (no body) while the router takes new requests, i.e. a P and an
        RLD may be picked; else 503."""
        now = time.monotonic()
        roles = self.pools.roles()
        up = all(any(self.pools.health.pickable((role, url), now) for url in roles[role]) for role in ("prefill", "relay"))
        return web.Response(status=200 if up else 503)

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        return await self.openai.tokens(request, "tokenize")

    async def detokenize(self, request: web.Request) -> web.StreamResponse:
        return await self.openai.tokens(request, "detokenize")

    def running_requests(self) -> int:
        """Flows the router runs now (each holds a relay slot until it ends)."""
        return self.flows.running()

    async def flush_cache(self, request: web.Request) -> web.Response:
        """Operator only: SGLang's /flush_cache (GET or POST, ``?timeout=`` seconds to wait for
        idle). 400 while the router runs requests (after waiting up to ``timeout``), as one
        server answers while it does; else every P, RLD and MD flushes: 200 when all did, 400
        naming each backend that refused and why (MD: the rooms and WAN slots it holds), 503 if
        one did not answer. Backends get at least FLUSH_SETTLE_S to become idle (SGLang's
        deferred flush): legs the router aborted may still be ending there."""
        if not self.is_operator(request):
            return error_reply(403, f"/flush_cache is operator-only: send {OPERATOR_HEADER} "
                                    f"(router flag --operator-token-file)", "Forbidden")
        raw = request.query.get("timeout", "0")
        try:
            timeout_s = float(raw)
            if not 0 <= timeout_s <= MAX_FLUSH_TIMEOUT_S:
                raise ValueError
        except ValueError:
            return error_reply(400, f"timeout must be a number of seconds in [0, {MAX_FLUSH_TIMEOUT_S:g}], "
                                    f"got {raw[:40]!r}")
        deadline = time.monotonic() + timeout_s
        while self.running_requests():
            if time.monotonic() >= deadline:
                n = self.running_requests()
                return web.json_response({"flushed": False, "backends": {}, "message": (
                    f"Cache not flushed: the router runs {n} request{'s' if n != 1 else ''} (retry when idle, "
                    f"or pass ?timeout=SECONDS to wait for idle)")}, status=400)
            await asyncio.sleep(FLUSH_POLL_S)
        backend_timeout = max(deadline - time.monotonic(), FLUSH_SETTLE_S)
        mains = {m.url: m for m in self.pools.main}
        backends = {p.url: "prefill" for p in self.pools.prefill}
        backends.update((url, "relay") for url in self.pools.relay)
        backends.update((url, "main") for url in mains)

        async def one(url: str) -> tuple[str, int, str]:
            try:
                async with self.session.post(f"{url}/flush_cache", params={"timeout": f"{backend_timeout:g}"},
                                             timeout=aiohttp.ClientTimeout(total=backend_timeout + 30)) as resp:
                    text = (await error_text(resp)).strip()  # SGLang's one-line answer; read bounded
                    status = resp.status
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                return url, 503, f"no answer: {e!r}"[:300]
            if status == 400 and url in mains and mains[url].control_url:
                text = await self._md_flush_refusal(mains[url], text)
            return url, status, text

        results = await asyncio.gather(*(one(url) for url in backends))
        refused = {url: f"{backends[url]}: {text or status}" for url, status, text in results if status != 200}
        status = 200 if not refused else 503 if any(s not in (200, 400) for _, s, _ in results) else 400
        message = ("Cache flushed on every backend (P, RLD, MD)." if not refused else
                   "Cache not flushed on " + "; ".join(f"{url} ({why})" for url, why in refused.items()))
        return web.json_response({"flushed": not refused, "message": message,
                                  "backends": {url: code for url, code, _ in results}, "refused": refused},
                                 status=status)

    async def _md_flush_refusal(self, main: MainBackend, said: str) -> str:
        """Why MD refused a flush: its own words, and the rooms and WAN slots it holds."""
        stats = await MainControl(self.session, main.control_url).stats()
        if not stats:
            return said
        phases = stats.get("rooms_by_phase")
        rooms = ", ".join(f"{phase} {n}" for phase, n in sorted(phases.items())) if isinstance(phases, dict) else ""
        held = stats.get("held_kv_slots")
        holds = f"MD has {stats.get('open_rooms', '?')} PDD rooms open" + (f" ({rooms})" if rooms else "") + \
            (f", {held} KV slots held for the WAN" if held is not None else "")
        return f"{said} [{holds}]" if said else holds

    async def abort_request(self, request: web.Request) -> web.Response:
        """SGLang's body: {"rid": str} or {"abort_all": true} (operator only)."""
        try:
            body = await parse_json_body(await request.read())
            rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
            if not isinstance(rid, str) or not isinstance(abort_all, bool):
                raise ApiError(400, "rid must be a string and abort_all a boolean")
            if abort_all and not self.is_operator(request):
                raise ApiError(403, f"abort_all is operator-only: send {OPERATOR_HEADER}")
        except ApiError as e:
            return error_reply(e.status, e.message)
        n = self.manager.abort(rid, abort_all)
        return web.json_response({"aborted": n})

    # ------------------------------------------------------------------ backend health
    async def _probe_forever(self) -> None:
        """Active checks: each backend's SGLang /health every --health-check-interval-s; a
        failed probe counts as a failure, a passing one closes a half-open breaker."""
        while True:
            await self.probe_backends()
            await asyncio.sleep(self.health_check_interval_s)

    async def probe_backends(self) -> None:
        async def one(role: str, url: str) -> None:
            try:
                # SGLang's /health decodes one token and may take its HEALTH_CHECK_TIMEOUT (20 s)
                async with self.session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=20)) as resp:
                    await error_text(resp)
                    ok, error = resp.status == 200, f"/health answered {resp.status}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                ok, error = False, f"/health failed: {e!r}"
            now = time.monotonic()
            self.pools.health.record((role, url), BackendSucceeded(now, probe=True) if ok
                                     else BackendFailed(now, error, probe=True))

        await asyncio.gather(*(one(role, url) for role, urls in self.pools.roles().items() for url in urls))

    def _health_rows(self):
        now = time.monotonic()
        for role, urls in self.pools.roles().items():
            for url in urls:
                state = self.pools.health.view((role, url), now)
                yield role, url, self.pools.health.pickable((role, url), now), state.draining

    def _failure_rows(self):
        counted = self.pools.health.failures
        for role, urls in self.pools.roles().items():
            for url in urls:
                for source in ("request", "probe"):
                    yield role, url, source, counted.get(((role, url), source), 0)

    async def backends(self, request: web.Request) -> web.Response:
        """Operator only: GET /pdd/backends, each backend's health and load as the router sees it."""
        if not self.is_operator(request):
            return error_reply(403, f"/pdd/backends is operator-only: send {OPERATOR_HEADER}", "Forbidden")
        now, inflight = time.monotonic(), self.pools.inflight()
        rows = []
        for role, urls in self.pools.roles().items():
            for url in urls:
                state = self.pools.health.view((role, url), now)
                # index: the backend's label in /metrics, which names no URL
                rows.append({"role": role, "index": int(self.metrics.index_of(role, url)), "url": url,
                             "pickable": self.pools.health.pickable((role, url), now),
                             "breaker": state.breaker.value, "draining": state.draining,
                             "last_error": state.last_error, "inflight": inflight[role][url]})
        pairs = [{"prefill": key[1], "peer": key[2], "breaker": self.pools.health.view(key, now).breaker.value}
                 for key in self.pools.health.states if key[0] == "pair"]
        return web.json_response({"backends": rows, "pairs": pairs})

    async def drain(self, request: web.Request) -> web.Response:
        """Operator only: POST /pdd/backends/drain {"url": ..., "draining": true|false}. A
        draining backend gets no new requests; those it has run to their end."""
        if not self.is_operator(request):
            return error_reply(403, f"/pdd/backends/drain is operator-only: send {OPERATOR_HEADER}", "Forbidden")
        try:
            body = await parse_json_body(await request.read())
            url, draining = body.get("url"), body.get("draining", True)
            if not isinstance(url, str) or not isinstance(draining, bool):
                raise ApiError(400, "the body is {\"url\": backend url, \"draining\": true|false}")
        except ApiError as e:
            return error_reply(e.status, e.message)
        roles = [role for role, urls in self.pools.roles().items() if url in urls]
        if not roles:
            return error_reply(404, f"no backend {url[:200]!r} (see GET /pdd/backends)", "NotFoundError")
        if self.shared_drains is not None:  # every worker, not only the one that took this call
            await asyncio.get_running_loop().run_in_executor(None, self.shared_drains.set, url, draining)
        self._apply_drain(url, draining)
        return web.json_response({"url": url, "roles": roles, "draining": draining,
                                  "inflight": sum(self.pools.inflight()[role][url] for role in roles)})

    def _apply_drain(self, url: str, draining: bool) -> None:
        now = time.monotonic()
        for role, urls in self.pools.roles().items():
            if url in urls and self.pools.health.view((role, url), now).draining != draining:
                self.pools.health.record((role, url), Drain(draining))

    async def _sync_drains_forever(self) -> None:
        """--workers: the drains another worker recorded, applied here within POLL_S."""
        while True:
            try:
                drains = self.shared_drains.poll()
            except OSError as e:
                logger.warning("shared drains unreadable: %s", e)
                drains = None
            for url, draining in (drains or {}).items():
                self._apply_drain(url, draining)
            await asyncio.sleep(shared_drain.POLL_S)

    # ------------------------------------------------------------------ helpers
    def _scope(self, request: web.Request, options) -> RequestScope:
        """pdd_options (operators only) and whether replies carry meta_info.pdd."""
        operator = self.is_operator(request)
        if options is not None:
            if not operator:
                raise ApiError(403, f"pdd_options is operator-only: send {OPERATOR_HEADER} "
                                    f"(router flag --operator-token-file)")
            if not isinstance(options, dict) or set(options) - PDD_OPTION_KEYS:
                raise ApiError(400, "pdd_options may set only path, handoff_mode, catch_up_threshold, drc")
            try:
                if "path" in options:
                    Path(options["path"])
                if "handoff_mode" in options:
                    HandoffMode(options["handoff_mode"])
                int(options.get("catch_up_threshold", 0))
            except (TypeError, ValueError) as e:
                raise ApiError(400, f"bad pdd_options: {e}") from None
        return RequestScope(operator=operator, options=options,
                            deadline=asyncio.get_running_loop().time() + self.flow_cfg.request_timeout_s)


async def _generate_events(first: dict, gen: AsyncIterator) -> AsyncIterator[bytes]:
    """SGLang's /generate stream: one ``data:`` event per output dict, then [DONE]; a request
    refused after the stream began ends with an error event."""
    try:  # bytes straight from orjson: a cumulative logprob event can be megabytes
        yield b"data: " + dumps_bytes(first) + b"\n\n"
        async for out in gen:
            yield b"data: " + dumps_bytes(out) + b"\n\n"
    except ValueError as e:
        err = {"error": {"message": str(e), "type": "invalid_request_error", "code": 400}}
        yield b"data: " + json.dumps(err).encode() + b"\n\n"
    finally:
        await gen.aclose()
    yield b"data: [DONE]\n\n"


@web.middleware
async def no_internals_in_errors(request: web.Request, handler):
    """A bug answers a plain JSON 500 (logged with its traceback here), never internals."""
    try:
        return await handler(request)
    except (web.HTTPException, asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        logger.exception("unhandled error on %s", request.path)
        return error_reply(500, "internal error in the router (logged)", "InternalServerError")


def build_app(router: Router, max_body_bytes: int = MAX_BODY_BYTES) -> web.Application:
    app = web.Application(client_max_size=max_body_bytes, middlewares=[no_internals_in_errors])
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.close)
    app.router.add_get("/health", router.health)
    app.router.add_get("/ready", router.ready)
    app.router.add_get("/metrics", router.metrics_route)
    app.router.add_post("/generate", router.generate)
    if router.manager is not None:
        app.router.add_get("/health_generate", router.health_generate)
        app.router.add_post("/v1/completions", router.completions)
        app.router.add_post("/v1/chat/completions", router.chat_completions)
        app.router.add_get("/v1/models", router.models)
        for path in ("/get_model_info", "/model_info"):
            app.router.add_get(path, router.model_info)
        for path in ("/get_server_info", "/server_info"):
            app.router.add_get(path, router.server_info)
        for method in ("GET", "POST"):  # SGLang serves both
            app.router.add_route(method, "/flush_cache", router.flush_cache)
        for path in ("/v1/tokenize", "/tokenize"):
            app.router.add_post(path, router.tokenize)
        for path in ("/v1/detokenize", "/detokenize"):
            app.router.add_post(path, router.detokenize)
        app.router.add_post("/abort_request", router.abort_request)
    app.router.add_get("/pdd/backends", router.backends)
    app.router.add_post("/pdd/backends/drain", router.drain)
    return app
