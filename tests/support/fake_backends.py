"""Fake P, RLD and MD-control servers (aiohttp, loopback) for fault-injection tests of PddFlow.

No SGLang: a deterministic "language model" (``next_token``) maps a token sequence to its next
token, so any server continuing any prefix produces the same text, and a correct request's
output is exactly ``truth(prompt, max_new_tokens)``. P, RLD and MD all run in the test's event
loop; knobs (``Knobs``) inject faults, ``Fakes.log`` records every request each server got.

What the fakes mimic (see sglang_pdd/router/flow/pdd_flow.py's docstring and backends.py):

- P: POST /generate (non-stream) -> {"meta_info": {"cached_tokens": N}}; it marks the request's
  bootstrap_room as prefilled, which RLD waits for (as a real PD decode waits for its KV).
- P's control API (its own server, ``p_control_url``): POST /pdd/wan_destinations (late WAN
  destination; 409 on a repeat, as the real one), DELETE /pdd/wan_destinations/{room} and
  GET /pdd/info (one TP rank).
  A room whose P leg carried ``pdd_wan_expected`` gets MD "ready" only once its destination
  was posted (as the real P sends nothing over the WAN before).
- RLD: POST /generate (stream) -> SSE, cumulative output_ids, finish_reason on the last event;
  POST /abort_request {"rid"} ends the stream with finish_reason {"type": "abort"} (after
  ``rld_abort_lag_tokens`` late tokens). Its first token is logged ("rld", "first_token").
- MD: the control API (/pdd/rooms, /ready long-poll, /handoff warmup JSON or final SSE, DELETE,
  /pdd/kv_senders)
  plus /abort_request for MD's own request. The final handoff follows the resume contract: the
  eager tokens are output already produced, max_new_tokens is the request's total budget, and
  the stream reports the whole output from position 0.
- Resume marker (``custom_params["pdd_resume_output_len"] = k``) on an RLD leg: the last k
  input ids are output already produced; the stream reports from position 0 as well.
- Logprobs (``return_logprob``): deterministic ``fake_logprob`` entries in SGLang's format, for
  the positions a server generated itself (none for resumed ones).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Optional

import orjson
from aiohttp import web

from sglang_pdd.control.auth import (EVENT_SIG, HEADER, REPLY_HEADER, ROLE_MD, ROLE_P, SCHEME, ControlVerifier,
                                     request_sig_of)
from sglang_pdd.protocol import messages as protocol_messages
from sglang_pdd.protocol import routes as api
from sglang_pdd.protocol import (RESUME_KEY, ControlError, DestinationReply, DropReply, InfoReply, KeptReply, KvSendersReply,
                                 KvSendersRequest, LegParams, ReadyReply, RegisterReply, ReleaseReply, ReleaseRequest,
                                 RouteTable, WanDestinationRequest, resume_marker)

VOCAB = 1000
_MOD = (1 << 61) - 1


def _step(state: int, token: int) -> int:
    return (state * 1_000_003 + token + 1) % _MOD


def _emit(state: int) -> int:
    return ((state * 0x9E3779B97F4A7C15) >> 17) % VOCAB


def continuation(seq: list[int], n: int) -> list[int]:
    """The n tokens the fake model generates after ``seq`` (greedy, deterministic)."""
    state = 0
    for t in seq:
        state = _step(state, t)
    out = []
    for _ in range(n):
        tok = _emit(state)
        out.append(tok)
        state = _step(state, tok)
    return out


def truth(prompt: list[int], n: int) -> list[int]:
    return continuation(prompt, n)


def fake_logprob(context: list[int], token: int) -> float:
    """The fake model's logprob of ``token`` after ``context`` (deterministic, in (-1, 0])."""
    state = 0
    for t in context:
        state = _step(state, t)
    return _logprob_at(state, token)


def _logprob_at(state: int, token: int) -> float:
    return -((state ^ token) % 997) / 1000.0


def _logprobs_along(seq: list[int], start: int) -> list[Optional[float]]:
    """``fake_logprob(seq[:j], seq[j])`` for j from ``start`` on, walking ``seq`` once (a
    stream's events carry every position: per position from scratch, a long stream costs the
    fakes O(n^3))."""
    state, out = 0, []
    for j, t in enumerate(seq):
        if j >= start:
            out.append(_logprob_at(state, t))
        state = _step(state, t)
    return out


def resumed_len(body: dict) -> int:
    """The resume contract's marker on a /generate body (0: a fresh request)."""
    custom = body["sampling_params"].get("custom_params") or {}
    return int(custom.get(RESUME_KEY) or 0)


def resumed_output(body: dict, budget: int) -> tuple[list[int], list[int]]:
    """(prompt, whole output) of a request that may resume ``k`` output tokens: its output is
    those k tokens, then the continuation, up to ``budget`` (the total max_new_tokens)."""
    ids, k = list(body["input_ids"]), resumed_len(body)
    prompt, done = (ids[:-k], ids[-k:]) if k else (ids, [])
    return prompt, done + continuation(ids, budget - k)


def fake_logprobs(body: dict, prompt: list[int], output: list[int]) -> dict:
    """SGLang's logprob fields as a fake decode server gives them for ``output`` (cumulative):
    none for the k positions the request resumed (a real server cannot give those either), and
    empty prompt lists (a PD decode server never scores the prompt; MD's resume gives ``[]``)."""
    if not body.get("return_logprob"):
        return {}
    k = resumed_len(body)
    logprobs = _logprobs_along(prompt + output, len(prompt) + k)
    entries = [[lp, tok, None] for lp, tok in zip(logprobs, output[k:])]
    meta = {"output_token_logprobs": entries, "input_token_logprobs": []}
    n = int(body.get("top_logprobs_num") or 0)
    if n:
        meta["output_top_logprobs"] = [[e] * n for e in entries]
        meta["input_top_logprobs"] = []
    if body.get("token_ids_logprob") is not None:
        # a PD decode leg's (RLD's) first new token is P's: SGLang's decode has no token-ids entry for it
        pd_leg = "bootstrap_room" in body
        meta["output_token_ids_logprobs"] = [None if j == 0 and pd_leg else [e] for j, e in enumerate(entries)]
        meta["input_token_ids_logprobs"] = []
    return meta


def fake_prefill_logprobs(body: dict) -> dict:
    """SGLang's logprob fields as P's reply carries them: the prompt's (from
    ``logprob_start_len``; the first entry has no logprob) and its one output token's."""
    if not body.get("return_logprob"):
        return {}
    prompt, start = list(body["input_ids"]), int(body.get("logprob_start_len", -1))
    start = len(prompt) if start < 0 else start
    entries = [[lp if j else None, prompt[j], None]
               for j, lp in zip(range(start, len(prompt)), _logprobs_along(prompt, start))]
    first = continuation(prompt, 1)[0]
    out = [[fake_logprob(prompt, first), first, None]]
    meta = {"input_token_logprobs": entries, "output_token_logprobs": out}
    n = int(body.get("top_logprobs_num") or 0)
    if n:
        meta["input_top_logprobs"] = [[e] * n if e[0] is not None else None for e in entries]
        meta["output_top_logprobs"] = [out * n]
    if body.get("token_ids_logprob") is not None:
        meta["input_token_ids_logprobs"] = [[e] if e[0] is not None else None for e in entries]
        meta["output_token_ids_logprobs"] = [out]
    return meta


def serve_routes(app: web.Application, table: RouteTable) -> None:
    """Serve a control API's routes (protocol.RouteTable) on ``app``, as the real servers do:
    ``await handler(request, **path_params)``; a ControlError is answered with its status."""

    async def dispatch(request: web.Request) -> web.StreamResponse:
        try:
            handler, params = table.resolve(request.method, request.path)
            return await handler(request, **params)
        except ControlError as e:
            return web.json_response(e.to_json(), status=e.status)

    app.router.add_route("*", "/{tail:.*}", dispatch)  # after the app's other routes: aiohttp tries them in order


async def _message(request: web.Request, kind):
    """The request's body as the protocol message ``kind`` (ControlError(400) if malformed)."""
    try:
        body = await request.json()
    except ValueError:
        raise ControlError.of("bad_request", "body is not valid JSON") from None
    return kind.from_json(body)


def closed_port() -> int:
    """A loopback port with nothing listening (connection refused)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


Hook = Optional[Callable[..., Awaitable[None]]]


@dataclass
class Knobs:
    # P
    p_status: int = 200
    p_text_error: bool = False  # error body is plain text, not JSON (a crashed handler)
    p_cached_tokens: int = 0
    p_before_reply: Hook = None  # async fn(body) awaited before P replies (its KV is already sent)
    p_logprobs: bool = True  # P's reply carries SGLang's logprob lists when asked (False: it lacks them)
    # P's control API (late WAN destinations)
    p_control_status: int = 200  # POST /pdd/wan_destinations: 409 / 500 to refuse
    # RLD
    rld_token_delay_s: float = 0.005
    rld_before_token: Hook = None  # async fn(leg, index_in_leg) awaited before each token
    rld_max_running: Optional[int] = None  # RLD answers GET /v1/loads with it (None: 404, as an old server)
    rld_fail_after: dict = field(default_factory=dict)  # leg -> drop the connection after N tokens
    rld_abort_lag_tokens: int = 0  # tokens still sent after an abort (late tokens)
    rld_prefill_wait_s: float = 5.0  # RLD waits this long for P's prefill of its room
    rld_diverge_legs: tuple = ()  # these relay legs produce other tokens (a sampled replay)
    # MD control
    md_register: str = "ok"  # ok | error500 | text500
    md_register_delay_s: float = 0.0  # register answers after this (a WAN round trip)
    md_cached_tokens: int = 0
    md_kv_bytes_per_token: int = 100
    md_tp_size: object = None  # the registration answer's "tp_size" (None: left out, as an MD on TP 1)
    md_ready: str = "ready"  # ready | failed | never (long-poll times out: "pending")
    md_ready_delay_s: float = 0.0
    md_before_ready: Hook = None  # async fn(room) awaited before answering "ready"/"failed"
    md_warmup_status: int = 200
    md_before_warmup: Hook = None  # async fn(handed_tokens) awaited before a warmup answers
    md_handoff_status: int = 200  # final handoff: 409 / 500 to refuse
    md_handoff_drop: bool = False  # final handoff: headers sent, connection dropped, no token
    md_die_after: Optional[int] = None  # final handoff: connection dropped after N tokens
    md_token_delay_s: float = 0.002
    # every server: what GET /health answers, per role ("p", "rld", "md"; 200 when not named)
    health_status: dict = field(default_factory=dict)
    # every server: what /flush_cache answers, per role (200 when not named; 400 with SGLang's text)
    flush_status: dict = field(default_factory=dict)
    md_stats: Optional[dict] = None  # what MD's control GET /pdd/stats answers (None: 404)
    md_before_token: Hook = None  # async fn(index, budget) awaited before each MD token
    md_burst: bool = False  # all of MD's tokens in one event, with the finish reason
    md_bad_event_sig: bool = False  # final handoff: each event signed for another index (a relay altered it)
    md_bad_ready_sig: bool = False  # /ready: the reply's signature is for another body (a relay altered it)
    # final handoff: before token N, a blank line every md_trickle_every_s for md_trickle_s (bytes, no token)
    md_trickle_from: Optional[int] = None
    md_trickle_every_s: float = 0.1
    md_trickle_s: float = 6.0
    md_restarts: bool = False  # MD without the resume contract: reports from the handoff point
    # Bytes of filler in meta_info ("pad") of each server's replies: P's reply, every RLD event
    # from its third on, every MD handoff event (a long stream event, as logprobs make them).
    p_pad_bytes: int = 0
    rld_pad_bytes: int = 0
    md_pad_bytes: int = 0


def _pad(meta: dict, size: int) -> dict:
    return {**meta, "pad": "x" * size} if size else meta


@dataclass
class Record:
    server: str  # p | rld | md
    # generate | abort | destination | drop | kept | first_token | register | registered | ready |
    # warmup | handoff | release | health | flush
    kind: str
    body: dict
    t: float


class Fakes:
    """Start with ``await fakes.start()``; ``await fakes.stop()`` at the end."""

    def __init__(self, knobs: Optional[Knobs] = None, ssl_context=None, control_key: Optional[bytes] = None):
        self.knobs = knobs or Knobs()
        self.ssl_context = ssl_context  # P, RLD and MD serve https:// with it
        # With the control key, MD's and P's control replies and MD's handoff stream are signed
        # as the real servers sign them, so a router started with --control-key-file trusts them.
        self.control_key = control_key
        self.log: list[Record] = []
        self.prefilled: dict[int, asyncio.Event] = {}
        self.rld_aborted: dict[str, asyncio.Event] = {}
        self.md_aborted: dict[str, asyncio.Event] = {}
        self.rooms: dict[int, dict] = {}  # room -> {"ids", "released", "final"}
        self.wan_expected: set[int] = set()  # rooms whose P leg awaits a late destination
        self.destinations: dict[int, asyncio.Event] = {}  # room -> its destination was posted
        self.p_control_seen: set[int] = set()  # rooms given a destination or dropped (409 on repeat)
        self.rld_active = 0  # RLD streams in progress
        self.md_active = 0
        self._runners: list[web.AppRunner] = []
        self.p_url = self.rld_url = self.md_url = self.p_control_url = ""
        self.authorization: list[tuple[str, str, Optional[str]]] = []  # (server URL, path, Authorization)

    def _signing(self, role: str) -> list:
        """A middleware signing replies to signed control calls (none without the key)."""
        if self.control_key is None:
            return []
        verifier = ControlVerifier(self.control_key, role=role)

        @web.middleware
        async def sign(request: web.Request, handler) -> web.StreamResponse:
            header = request.headers.get(HEADER, "")
            signed = header.startswith(SCHEME)
            if signed:
                request["pdd_signer"] = (verifier, request_sig_of(header))
            resp = await handler(request)
            if signed and isinstance(resp, web.Response) and not resp.prepared:
                body = (resp.body or b"") + (b" " if resp.get("pdd_bad_sig") else b"")
                resp.headers[REPLY_HEADER] = verifier.sign_reply(request_sig_of(header), resp.status, body)
            return resp

        return [sign]

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> "Fakes":
        self.p_url = await self._serve(self._p_app())
        self.rld_url = await self._serve(self._rld_app())
        self.md_url = await self._serve(self._md_app())
        self.p_control_url = await self._serve(self._p_control_app())
        return self

    async def stop(self) -> None:
        for runner in self._runners:
            await runner.cleanup()

    async def _serve(self, app: web.Application) -> str:
        @web.middleware
        async def note_authorization(request: web.Request, handler):
            sent = request.headers.getall("Authorization", [])  # all of them: one header must not ride along another
            self.authorization.append((f"{request.scheme}://{request.host}", request.path, ", ".join(sent) or None))
            return await handler(request)

        app.middlewares.append(note_authorization)
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=self.ssl_context)
        await site.start()
        self._runners.append(runner)
        host, port = runner.addresses[0][:2]
        return f"{'https' if self.ssl_context else 'http'}://{host}:{port}"

    def _record(self, server: str, kind: str, body: dict) -> None:
        self.log.append(Record(server, kind, body, time.monotonic()))

    # ------------------------------------------------------------------ queries
    def records(self, server: str, kind: str) -> list[Record]:
        return [r for r in self.log if r.server == server and r.kind == kind]

    def aborted_rids(self, server: str) -> list[str]:
        return [r.body["rid"] for r in self.records(server, "abort")]

    def released_rooms(self) -> list[int]:
        return [r.body["room"] for r in self.records("md", "release")]

    def registered_rooms(self) -> list[int]:
        return [r.body["room"] for r in self.records("md", "register")]

    def dropped_rooms(self) -> list[int]:
        return [r.body["bootstrap_room"] for r in self.records("p", "drop")]

    def _add_health(self, app: web.Application, role: str) -> None:
        async def health(request):
            self._record(role, "health", {})
            return web.Response(status=self.knobs.health_status.get(role, 200))

        app.router.add_get("/health", health)

        async def flush_cache(request):
            self._record(role, "flush", {"timeout": request.query.get("timeout")})
            status = self.knobs.flush_status.get(role, 200)
            return web.Response(status=status, text="Cache flushed.\n" if status == 200 else "Flush cache failed.\n")

        app.router.add_route("*", "/flush_cache", flush_cache)

    # ------------------------------------------------------------------ P
    def _p_app(self) -> web.Application:
        app = web.Application()
        self._add_health(app, "p")

        async def generate(request: web.Request) -> web.Response:
            body = await request.json()
            self._record("p", "generate", body)
            k = self.knobs
            if k.p_status != 200:
                if k.p_text_error:
                    return web.Response(status=k.p_status, text="Internal Server Error")
                return web.json_response({"error": "prefill failed"}, status=k.p_status)
            if LegParams.expects_destination(body["sampling_params"].get("custom_params")):
                self.wan_expected.add(body["bootstrap_room"])
            self.prefilled.setdefault(body["bootstrap_room"], asyncio.Event()).set()
            if k.p_before_reply is not None:
                await k.p_before_reply(body)
            self._record("p", "reply", {"rid": body["rid"]})
            return web.json_response({"text": "", "meta_info": _pad({
                "cached_tokens": k.p_cached_tokens, "prompt_tokens": len(body["input_ids"]),
                **(fake_prefill_logprobs(body) if k.p_logprobs else {})}, k.p_pad_bytes)})

        app.router.add_post("/generate", generate)
        return app

    def _p_control_app(self) -> web.Application:
        app = web.Application(middlewares=self._signing(ROLE_P))

        async def set_destination(request: web.Request) -> web.Response:
            req = await _message(request, WanDestinationRequest)
            self._record("p", "destination", req.to_json())
            room = req.bootstrap_room
            if self.knobs.p_control_status != 200:
                return web.json_response({"error": "refused (injected)"}, status=self.knobs.p_control_status)
            if room in self.p_control_seen:
                return web.json_response({"error": f"room {room} already has a WAN destination"}, status=409)
            self.p_control_seen.add(room)
            self.destinations.setdefault(room, asyncio.Event()).set()
            return web.json_response(DestinationReply().to_json())

        async def drop_destination(request: web.Request, bootstrap_room: int) -> web.Response:
            room = bootstrap_room
            self._record("p", "drop", {"bootstrap_room": room})
            if room in self.p_control_seen:
                return web.json_response({"error": f"room {room} already has a WAN destination"}, status=409)
            self.p_control_seen.add(room)
            return web.json_response(DropReply().to_json())

        async def kept(request: web.Request, bootstrap_room: int) -> web.Response:
            self._record("p", "kept", {"bootstrap_room": bootstrap_room})
            return web.json_response(KeptReply(bootstrap_room in self.p_control_seen).to_json())

        async def info(request: web.Request) -> web.Response:
            return web.json_response(InfoReply(tp_rank=0, tp_size=1, sends_wan=True).to_json())

        serve_routes(app, RouteTable({api.P_DESTINATION: set_destination, api.P_DROP: drop_destination,
                                      api.P_KEPT: kept, api.P_INFO: info}))
        return app

    # ------------------------------------------------------------------ RLD
    def _rld_app(self) -> web.Application:
        app = web.Application()
        self._add_health(app, "rld")

        async def loads(request: web.Request) -> web.Response:
            if self.knobs.rld_max_running is None:
                return web.Response(status=404)
            return web.json_response({"loads": [{"dp_rank": 0, "num_running_reqs": self.rld_active,
                                                 "max_running_requests": self.knobs.rld_max_running}]})

        app.router.add_get("/v1/loads", loads)

        async def generate(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            self._record("rld", "generate", body)
            k = self.knobs
            rid = body["rid"]
            leg = int(rid.rsplit("-r", 1)[1]) if "-r" in rid else 1
            aborted = self.rld_aborted.setdefault(rid, asyncio.Event())
            budget = int(body["sampling_params"]["max_new_tokens"])
            prompt, tokens = resumed_output(body, budget)
            if leg in k.rld_diverge_legs:
                tokens = [(t + 1) % VOCAB for t in tokens]
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            self.rld_active += 1
            try:
                prefilled = self.prefilled.setdefault(body["bootstrap_room"], asyncio.Event())
                try:
                    await asyncio.wait_for(prefilled.wait(), k.rld_prefill_wait_s)
                except asyncio.TimeoutError:
                    await _sse(resp, {"error": "KV transfer from P timed out"})
                    return resp
                late = None
                for i in range(resumed_len(body), budget):
                    if aborted.is_set():
                        late = k.rld_abort_lag_tokens if late is None else late - 1
                        if late <= 0:
                            break
                    if leg in k.rld_fail_after and i - resumed_len(body) >= k.rld_fail_after[leg]:
                        request.transport.close()
                        return resp
                    if k.rld_before_token is not None:
                        await k.rld_before_token(leg, i - resumed_len(body))
                    await asyncio.sleep(k.rld_token_delay_s)
                    finish = {"type": "length", "length": budget} if i == budget - 1 else None
                    await _sse(resp, {"output_ids": tokens[:i + 1], "meta_info": _pad({
                        "finish_reason": finish, **fake_logprobs(body, prompt, tokens[:i + 1])},
                        k.rld_pad_bytes if i - resumed_len(body) >= 2 else 0)})
                    if i == resumed_len(body):
                        self._record("rld", "first_token", {"rid": rid})
                    if finish is not None:
                        await _done(resp)
                        return resp
                await _sse(resp, {"output_ids": tokens[:i], "meta_info": {
                    "finish_reason": {"type": "abort", "message": "aborted"}, **fake_logprobs(body, prompt, tokens[:i])}})
                await _done(resp)
                return resp
            finally:
                self.rld_active -= 1

        async def abort_request(request: web.Request) -> web.Response:
            body = await request.json()
            self._record("rld", "abort", body)
            self.rld_aborted.setdefault(body["rid"], asyncio.Event()).set()
            return web.Response(text="")

        app.router.add_post("/generate", generate)
        app.router.add_post("/abort_request", abort_request)
        return app

    # ------------------------------------------------------------------ MD
    def _md_app(self) -> web.Application:
        app = web.Application(middlewares=self._signing(ROLE_MD))
        self._add_health(app, "md")

        async def register(request: web.Request) -> web.Response:
            req = await _message(request, protocol_messages.RegisterRequest)
            self._record("md", "register", req.to_json())
            k = self.knobs
            if k.md_register_delay_s:
                await asyncio.sleep(k.md_register_delay_s)
            if k.md_register == "error500":
                return web.json_response({"error": "scheduler busy"}, status=500)
            if k.md_register == "text500":
                return web.Response(status=500, text="500 Internal Server Error")
            self.rooms[req.room] = {"ids": list(req.token_ids), "released": False, "final": False}
            cached = k.md_cached_tokens if req.use_cache else 0
            self._record("md", "registered", {"room": req.room, "cached_tokens": cached})
            return web.json_response(RegisterReply(
                req.room, cached, prompt_tokens=len(req.token_ids), wan_peer="127.0.0.1:1",
                tp_size=k.md_tp_size, kv_bytes_per_token=k.md_kv_bytes_per_token).to_json())

        async def ready(request: web.Request, room: int) -> web.Response:
            timeout_s = float(request.query.get("timeout_s", "10"))
            self._record("md", "ready", {"room": room, "timeout_s": timeout_s})
            k = self.knobs
            if room not in self.rooms:
                return web.json_response(ReadyReply(room, "failed", "unknown room").to_json())
            if k.md_ready == "never":
                await asyncio.sleep(timeout_s)
                return web.json_response(ReadyReply(room, "pending", "").to_json())
            # As for real: MD's KV can land only once P has prefilled the room.
            try:
                await asyncio.wait_for(self.prefilled.setdefault(room, asyncio.Event()).wait(), timeout_s)
                if room in self.wan_expected:  # P sends nothing before it knows the destination
                    await asyncio.wait_for(self.destinations.setdefault(room, asyncio.Event()).wait(), timeout_s)
            except asyncio.TimeoutError:
                return web.json_response(ReadyReply(room, "pending", "").to_json())
            await asyncio.sleep(k.md_ready_delay_s)
            if k.md_before_ready is not None:
                await k.md_before_ready(room)
            if k.md_ready == "failed":
                return web.json_response(ReadyReply(room, "failed", "KV transfer failed (injected)").to_json())
            resp = web.json_response(ReadyReply(room, "ready", "").to_json())
            resp["pdd_bad_sig"] = k.md_bad_ready_sig
            return resp

        async def handoff(request: web.Request, room: int) -> web.StreamResponse:
            # the protocol's type, looked up when called: a field added to it reaches the records
            body = (await _message(request, protocol_messages.HandoffRequest)).to_json()
            k = self.knobs
            state = self.rooms.get(room)
            if body.get("warmup"):
                self._record("md", "warmup", {"room": room, **body})
                if k.md_before_warmup is not None:
                    await k.md_before_warmup(len(body["token_ids"]))
                if state is None or state["released"] or state["final"]:
                    return web.json_response({"error": f"stale room {room}"}, status=409)
                if k.md_warmup_status != 200:
                    return web.json_response({"error": "warmup failed (injected)"}, status=k.md_warmup_status)
                return web.json_response({"room": room, "extended": len(body["token_ids"])})
            self._record("md", "handoff", {"room": room, **body})
            if state is None or state["released"]:
                return web.json_response({"error": f"stale room {room}"}, status=409)
            if state["final"]:
                return web.json_response({"error": f"duplicate handoff for room {room}"}, status=409)
            state["final"] = True
            if k.md_handoff_status != 200:
                return web.json_response({"error": "handoff refused (injected)"}, status=k.md_handoff_status)
            rid = body["rid"]
            aborted = self.md_aborted.setdefault(rid, asyncio.Event())
            # The resume contract: MD continues the request (eager tokens are output already
            # produced, max_new_tokens is the total budget) and reports from position 0.
            eager = list(body["token_ids"])
            total = int(body["sampling_params"]["max_new_tokens"])
            budget = total - len(eager)
            k0 = len(eager)
            tokens = eager + continuation(state["ids"] + eager, budget)
            if k.md_restarts:
                tokens, k0 = tokens[len(eager):], 0
            sent = {**body, "input_ids": state["ids"] + eager,
                    "sampling_params": {**body["sampling_params"], "custom_params": {
                        **(body["sampling_params"].get("custom_params") or {}), **resume_marker(len(eager))}}}
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            _sign_stream(resp, request)
            resp["pdd_bad_sig"] = k.md_bad_event_sig
            await resp.prepare(request)
            if k.md_handoff_drop:
                request.transport.close()
                return resp
            self.md_active += 1
            try:
                if k.md_burst:
                    await asyncio.sleep(k.md_token_delay_s)
                    await _sse(resp, {"output_ids": tokens, "meta_info": {
                        "finish_reason": {"type": "length", "length": total},
                        **fake_logprobs(sent, state["ids"], tokens)}})
                    await _done(resp)
                    return resp
                for i in range(budget):
                    if aborted.is_set():
                        await _sse(resp, {"output_ids": tokens[:k0 + i], "meta_info": {"finish_reason": {"type": "abort"}}})
                        await _done(resp)
                        return resp
                    if k.md_die_after is not None and i >= k.md_die_after:
                        request.transport.close()
                        return resp
                    if k.md_before_token is not None:
                        await k.md_before_token(i, budget)
                    if i == k.md_trickle_from:
                        await _trickle(resp, k.md_trickle_every_s, k.md_trickle_s, aborted)
                    await asyncio.sleep(k.md_token_delay_s)
                    finish = {"type": "length", "length": total} if i == budget - 1 else None
                    await _sse(resp, {"output_ids": tokens[:k0 + i + 1], "meta_info": _pad({
                        "finish_reason": finish, **fake_logprobs(sent, state["ids"], tokens[:k0 + i + 1])},
                        k.md_pad_bytes)})
                await _done(resp)
                return resp
            finally:
                self.md_active -= 1

        async def release(request: web.Request, room: int) -> web.Response:
            req = ReleaseRequest.from_query(room, request.query_string)
            self._record("md", "release", {"room": room, "keep_kv": req.keep_kv})
            if room in self.rooms:
                self.rooms[room]["released"] = True
            return web.json_response(ReleaseReply(room in self.rooms).to_json())

        async def abort_request(request: web.Request) -> web.Response:
            body = await request.json()
            self._record("md", "abort", body)
            self.md_aborted.setdefault(body["rid"], asyncio.Event()).set()
            return web.Response(text="")

        async def stats(request: web.Request) -> web.Response:
            if self.knobs.md_stats is None:
                return web.json_response({"error": "not found"}, status=404)
            return web.json_response(self.knobs.md_stats)

        async def kv_senders(request: web.Request) -> web.Response:
            req = await _message(request, KvSendersRequest)
            self._record("md", "kv_senders", {"sources": list(req.sources)})
            return web.json_response(KvSendersReply(len(req.sources)).to_json())

        app.router.add_post("/abort_request", abort_request)
        serve_routes(app, RouteTable({api.MD_REGISTER: register, api.MD_READY: ready, api.MD_HANDOFF: handoff,
                                      api.MD_RELEASE: release, api.STATS: stats, api.MD_KV_SENDERS: kv_senders}))
        return app


async def _trickle(resp: web.StreamResponse, every_s: float, for_s: float, aborted: asyncio.Event) -> None:
    """Bytes that carry no event (blank lines) every ``every_s``, for ``for_s`` or until aborted."""
    end = asyncio.get_running_loop().time() + for_s
    while not aborted.is_set() and asyncio.get_running_loop().time() < end:
        await resp.write(b"\n")
        await asyncio.sleep(every_s)


async def _sse(resp: web.StreamResponse, event: dict) -> None:
    await _event(resp, orjson.dumps(event))  # compact, as SGLang writes its stream events


async def _done(resp: web.StreamResponse) -> None:
    await _event(resp, b"[DONE]")
    await resp.write_eof()


def _sign_stream(resp: web.StreamResponse, request: web.Request) -> None:
    """The stream answers a signed control call: each event gets its signature line."""
    if request.get("pdd_signer") is not None:
        resp["pdd_signer"], resp["pdd_events"] = request["pdd_signer"], 0


async def _event(resp: web.StreamResponse, data: bytes) -> None:
    signer = resp.get("pdd_signer")
    if signer is None:
        await resp.write(b"data: " + data + b"\n\n")
        return
    verifier, request_sig = signer
    index = resp["pdd_events"]
    resp["pdd_events"] = index + 1
    signed_index = index + 1 if resp.get("pdd_bad_sig") else index
    await resp.write(b"data: " + data + b"\n" + EVENT_SIG + verifier.sign_event(request_sig, signed_index, data)
                     + b"\n\n")


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0, poll_s: float = 0.005) -> None:
    """Polls ``predicate`` (for hooks that gate a fake on the flow's state)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("wait_until: condition not met in time")
        await asyncio.sleep(poll_s)


@contextlib.asynccontextmanager
async def serve_app(app: web.Application, ssl_context=None) -> AsyncIterator[str]:
    """``app`` on a loopback port as the router's main() serves it (a client that goes away
    cancels its handler); yields the base URL."""
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"{'https' if ssl_context else 'http'}://{host}:{port}"
    finally:
        await runner.cleanup()
