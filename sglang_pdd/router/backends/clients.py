"""Async clients for the router's backends: SGLang /generate streams and MD's control API."""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import weakref
from typing import AsyncIterator, Callable, Optional
from urllib.parse import urlsplit, urlunsplit

import aiohttp
from aiohttp.http_exceptions import LineTooLong

from sglang_pdd.control.auth import EVENT_SIG, HEADER, REPLY_HEADER, ROLE_MD, ROLE_P, AuthError, ControlSigner
from sglang_pdd.protocol import routes as api
from sglang_pdd.protocol import (ControlError, HandoffRequest, InfoReply, ReadyReply, RegisterReply,
                                 RegisterRequest, WanDestinationRequest, check_md_tp)
from sglang_pdd.router.backends.reply_limits import MAX_CONTROL_REPLY_BYTES, MAX_ERROR_BODY_BYTES, max_event_bytes
from sglang_pdd.router.backends.stall import BackendProgress, RelayStallBounds, wait_left
from sglang_pdd.router.backends.stream_decode import CumulativeDecoder, MalformedEvent, parse_whole

logger = logging.getLogger(__name__)

_control_signer: Optional[ControlSigner] = None  # MD's role
_prefill_signer: Optional[ControlSigner] = None  # P's role
_control_tls: Optional[ssl.SSLContext] = None  # --control-tls-*: client certificate, the servers' CA


def use_control_key(key: Optional[bytes]) -> None:
    """The router's --control-key-file: every MainControl / PrefillControl made afterwards in
    this process signs its calls with it (MD and P refuse unsigned control calls), each with
    its role's key (a call signed for MD does not verify on P)."""
    global _control_signer, _prefill_signer
    _control_signer = ControlSigner(key, role=ROLE_MD) if key is not None else None
    _prefill_signer = ControlSigner(key, role=ROLE_P) if key is not None else None


def use_control_tls(context: Optional[ssl.SSLContext]) -> None:
    """The router's --control-tls-*: every MainControl / PrefillControl made afterwards in this
    process dials its (https) control URL with this client context (None: aiohttp's default)."""
    global _control_tls
    _control_tls = context


def _control_request(signer: Optional[ControlSigner], method: str, url: str, body=None,
                     tls: Optional[ssl.SSLContext] = None) -> dict:
    """aiohttp request kwargs: the JSON body as bytes and, with a signer, the signature over
    exactly those bytes and the URL's host, path and query as sent; with ``tls``, the client TLS
    context (aiohttp checks the server's certificate names the URL's host)."""
    data = json.dumps(body).encode() if body is not None else b""
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if signer is not None:  # Host too: the signature binds the call to the server it is for
        headers.update(signer.headers(method, url, data))
    return {"data": data if body is not None else None, "headers": headers, **({"ssl": tls} if tls else {})}


def _check_reply(signer: Optional[ControlSigner], sent: dict, resp: aiohttp.ClientResponse, body: bytes,
                 what: str) -> None:
    """BackendError unless the reply carries the server's signature for this request (a relay
    on the path cannot alter or swap it); nothing to check for an unsigned call."""
    if signer is None:
        return
    try:
        signer.check_reply(sent["headers"][HEADER], resp.status, body, resp.headers.get(REPLY_HEADER))
    except AuthError as e:
        raise BadSignature(f"{what}: {e}") from None


class BackendError(RuntimeError):
    """A backend answered with an error status, a malformed stream, or not at all.
    ``status``: the HTTP status it answered with, if that was the error."""

    def __init__(self, message: str, status: Optional[int] = None):
        super().__init__(message)
        self.status = status


class UnverifiedReply(BackendError):
    """A 200 the router cannot take as it is: its signature does not verify (a relay altered
    the reply), or it is not the protocol's reply. The server may have acted on the request,
    so what it holds for it is to be released."""


class BadSignature(UnverifiedReply):
    """A control reply, or an event of a signed stream, that is not signed as the server signs
    it (missing, altered, reordered, a stream cut before its signed end): not the server's
    answer, which counts as the server failing (router/backends/health.py), as a dropped connection does."""


class StreamStalled(asyncio.TimeoutError):
    """A stream the server took that brought no new token within its bound (until_stalled):
    the server's path failing the request (a stopped server, or a relay holding the stream),
    not a deadline the client chose."""


def server_at_fault(error: BaseException) -> bool:
    """Whether a leg's failure is the server's own (its breaker counts it): it refused or
    dropped the connection, cut its reply short, answered 5xx (but 503: busy, not broken),
    stalled a stream it took (StreamStalled), or sent what the router refuses to take: a reply
    or event whose signature does not verify, or one over the bound the request allows."""
    status = getattr(error, "status", None)
    if isinstance(error, (BadSignature, ReplyTooLarge, StreamStalled)):
        return True
    return isinstance(error, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)) or \
        (status is not None and status >= 500 and status != 503)


async def generate_stream(session: aiohttp.ClientSession, url: str, body: dict,
                          max_line_bytes: int) -> AsyncIterator[dict]:
    """POST /generate with stream=true; yields each SSE data object (cumulative output_ids), as
    router/backends/stream_decode.py decodes it (what the router reads, each event's new logprob entries
    parsed only). An event over ``max_line_bytes`` (reply_limits.max_event_bytes of the leg)
    fails the stream."""
    async with session.post(f"{url}/generate", json={**body, "stream": True}) as resp:
        async for event in sse_events(resp, url, max_line_bytes, CumulativeDecoder()):
            yield event


class ReplyTooLarge(BackendError):
    """A backend's reply, or one event of its stream, is larger than the request can account
    for (reply_limits): the router stops reading it instead of buffering it."""


async def read_bounded(resp: aiohttp.ClientResponse, limit: int, what: str) -> bytes:
    """The reply's body, at most ``limit`` bytes (ReplyTooLarge beyond, before reading more
    when the reply announces its length)."""
    if resp.content_length is not None and resp.content_length > limit:
        raise ReplyTooLarge(f"{what}: a reply of {resp.content_length} bytes, over the {limit} this "
                            f"request allows", resp.status)
    body = bytearray()
    async for chunk in resp.content.iter_chunked(1 << 16):
        body += chunk
        if len(body) > limit:
            raise ReplyTooLarge(f"{what}: a reply over the {limit} bytes this request allows", resp.status)
    return bytes(body)


async def error_text(resp: aiohttp.ClientResponse) -> str:
    """The start of an error reply, for a message; never more than MAX_ERROR_BODY_BYTES read."""
    body = await resp.content.read(MAX_ERROR_BODY_BYTES)
    return body[:300].decode("utf-8", "replace")


async def read_lines(resp: aiohttp.ClientResponse, max_line_bytes: int, what: str) -> AsyncIterator[bytes]:
    """The reply's lines, each at most ``max_line_bytes`` (ReplyTooLarge beyond)."""
    while True:
        try:
            line = await resp.content.readuntil(b"\n", max_size=max_line_bytes)
        except LineTooLong:
            raise ReplyTooLarge(f"{what}: a stream event over the {max_line_bytes} bytes this request "
                                f"allows") from None
        if not line:
            return
        yield line


SSE_DONE = object()  # parse_sse_line's answer to "data: [DONE]"


def parse_sse_line(raw: bytes, source: str, decoder: Optional[CumulativeDecoder] = None):
    """One line of an SGLang stream: its event dict, SSE_DONE, or None (not a data line).
    Raises BackendError for a malformed event or an error event. ``decoder``: the stream's
    (router/backends/stream_decode.py), which parses only what a cumulative event adds."""
    line = raw.strip()
    if not line.startswith(b"data:"):
        return None
    data = line[5:].strip()
    if data == b"[DONE]":
        return SSE_DONE
    try:  # orjson: several times json's speed on every backend event; json for what it refuses
        event = parse_whole(data) if decoder is None else decoder.decode(data)
    except MalformedEvent as e:
        raise BackendError(f"{source}: malformed stream event {data[:100]!r}") from e
    if not isinstance(event, dict):
        raise BackendError(f"{source}: a stream event that is not an object: {data[:100]!r}")
    if "error" in event:
        raise BackendError(f"{source}: {event['error']}")
    return event


async def sse_events(resp: aiohttp.ClientResponse, url: str, max_line_bytes: int,
                     decoder: Optional[CumulativeDecoder] = None) -> AsyncIterator[dict]:
    if resp.status != 200:
        raise BackendError(f"{url} -> HTTP {resp.status}: {await error_text(resp)}", resp.status)
    async for raw in read_lines(resp, max_line_bytes, url):
        event = parse_sse_line(raw, url, decoder)
        if event is SSE_DONE:
            return
        if event is not None:
            yield event


async def signed_sse_events(resp: aiohttp.ClientResponse, url: str, signer: ControlSigner,
                            request_header: str, max_line_bytes: int,
                            decoder: Optional[CumulativeDecoder] = None) -> AsyncIterator[dict]:
    """``sse_events`` of a control stream: each data line must be followed by its signature
    line (control_auth), in order, up to a signed ``[DONE]``; a stream cut short, or any event
    unsigned or altered, is a BackendError."""
    if resp.status != 200:
        raise BackendError(f"{url} -> HTTP {resp.status}: {await error_text(resp)}", resp.status)
    pending, index = None, 0
    async for raw in read_lines(resp, max_line_bytes, url):
        line = raw.strip()
        if line.startswith(b"data:"):
            if pending is not None:
                raise BadSignature(f"{url}: stream event {index} is not signed")
            pending = line
        elif line.startswith(EVENT_SIG.strip()):
            if pending is None:
                raise BadSignature(f"{url}: a signature without an event")
            try:
                signer.check_event(request_header, index, pending[5:].strip(), line[len(EVENT_SIG.strip()):])
            except AuthError as e:
                raise BadSignature(f"{url}: {e}") from None
            index += 1
            event, pending = parse_sse_line(pending, url, decoder), None
            if event is SSE_DONE:
                return
            yield event
    raise BadSignature(f"{url}: stream ended before its signed end ({index} events)")


def _json_of(resp: aiohttp.ClientResponse, body: bytes):
    """The reply's JSON; a body that is not JSON (e.g. the text page of a crashed handler) is a
    BackendError, which callers handle, instead of a JSONDecodeError, which they do not."""
    try:
        return json.loads(body)
    except ValueError:
        raise BackendError(f"{resp.url} -> HTTP {resp.status}: not JSON: "
                           f"{body[:300].decode('utf-8', 'replace')!r}", resp.status) from None


async def _call_json(session: aiohttp.ClientSession, method: str, url: str, what: str, *, timeout_s: float,
                     json=None, signer: Optional[ControlSigner] = None,
                     tls: Optional[ssl.SSLContext] = None) -> dict:
    """One control-API call, within ``timeout_s`` in all: the JSON reply of a 200, else
    BackendError naming ``what``. A signed call's 200 without the server's signature header is
    refused before its body is read; no reply is read past MAX_CONTROL_REPLY_BYTES."""
    sent = _control_request(signer, method, url, json, tls)
    async with session.request(method, url, timeout=aiohttp.ClientTimeout(total=timeout_s), **sent) as resp:
        if resp.status != 200:  # only its start is shown: read no more than that
            raise BackendError(f"{what}: HTTP {resp.status} {await error_text(resp)}", resp.status)
        if signer is not None and REPLY_HEADER not in resp.headers:
            raise BadSignature(f"{what}: reply not signed (no {REPLY_HEADER})")
        body = await read_bounded(resp, MAX_CONTROL_REPLY_BYTES, what)
        _check_reply(signer, sent, resp, body, what)  # the signature before anything is read from the reply
        return _json_of(resp, body)


async def generate_once(session: aiohttp.ClientSession, url: str, body: dict, max_reply_bytes: int) -> dict:
    async with session.post(f"{url}/generate", json={**body, "stream": False}) as resp:
        if resp.status != 200:
            raise BackendError(f"{url} /generate -> HTTP {resp.status}: {await error_text(resp)}", resp.status)
        return _json_of(resp, await read_bounded(resp, max_reply_bytes, f"{url} /generate"))


async def abort(session: aiohttp.ClientSession, url: str, rid: str) -> None:
    """Best effort: ask a server to drop a request (frees its KV)."""
    try:
        async with session.post(f"{url}/abort_request", json={"rid": rid},
                                timeout=aiohttp.ClientTimeout(total=5)) as resp:
            await error_text(resp)
    except (aiohttp.ClientError, TimeoutError) as e:
        logger.warning("abort of %s on %s failed: %r", rid, url, e)


# A catch-up batch is an extend of at most the catch-up threshold's tokens on MD: longer than
# this and MD is not keeping up, so RLD finishes the request.
WARMUP_TIMEOUT_S = 60.0

def new_output(event: dict, produced: int) -> Optional[int]:
    """How many output ids a cumulative stream event reports, if more than ``produced`` (else
    None: the event carries no new token)."""
    n = len(event.get("output_ids") or ())
    return n if n > produced else None


async def until_stalled(events: AsyncIterator[dict], stall_s: Optional[float], what: str,
                        first_s: Optional[float] = None, first_past: int = 0) -> AsyncIterator[dict]:
    """``events`` as they come, or StreamStalled once ``stall_s`` of waiting for them passed
    without one carrying a new token: progress is a token, not a byte (a stream kept alive by
    bytes alone is stalled). Time the consumer spends between events does not count.
    ``first_s``: until an event carries more than ``first_past`` output ids (MD's first own
    token after those it was handed), the wait is bounded by ``first_s`` instead, and events
    repeating the handed ones are no progress. None: no bound."""
    loop = asyncio.get_running_loop()
    waited, produced, first = 0.0, 0, bool(first_s)
    source = events.__aiter__()
    try:
        while True:
            started = loop.time()
            limit = first_s if first else stall_s
            try:
                # asyncio.timeout, not wait_for: 3.11's wait_for drops a cancel of this task that
                # meets an arriving event, and a leg cancelled at the request's end went on reading
                async with asyncio.timeout(limit - waited if limit else None):
                    event = await source.__anext__()
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                if first:
                    raise StreamStalled(f"{what}: no first token past the {first_past} handed over "
                                        f"within {first_s:g} s") from None
                raise StreamStalled(f"{what}: no new token within {stall_s:g} s") from None
            grown = new_output(event, produced)
            if grown is None or (first and grown <= first_past):
                waited += loop.time() - started
                produced = grown or produced
            else:
                waited, produced, first = 0.0, grown, False
            yield event
    finally:
        await source.aclose()  # its stream closed with this one, not whenever the GC gets to it


async def until_relay_stalled(events: AsyncIterator[dict], bounds: RelayStallBounds, progress: BackendProgress,
                              rld_url: str, p_url: str, p_replied: Callable[[], bool],
                              what: str) -> AsyncIterator[dict]:
    """A relay leg's ``events`` as they come, or StreamStalled once router/backends/stall.py's rule says
    the leg is stalled (no new token within its bound while RLD, and P while it owes the leg its
    reply, made no progress the router saw). Each new token is RLD's progress (``progress``);
    ``p_replied()``: P replied to this leg. The read in flight is cancelled only when the leg is
    stalled: a check that finds the servers progressing sets the next one."""
    loop = asyncio.get_running_loop()
    waited, produced = 0.0, 0
    source = events.__aiter__()
    try:
        while True:
            started, stalled, check_at = loop.time(), False, None

            def check() -> None:
                nonlocal stalled, check_at
                now = loop.time()
                first = produced == 0
                p_idle = progress.idle_s(p_url, now) if first and not p_replied() else None
                left = wait_left(bounds, waited + now - started, first, progress.idle_s(rld_url, now), p_idle)
                if left is None:
                    check_at = None
                elif left <= 0:
                    stalled, check_at = True, None
                    bound.reschedule(now)  # expires now: the read is cancelled
                else:
                    check_at = loop.call_later(left, check)

            try:
                async with asyncio.timeout(None) as bound:
                    check()
                    try:
                        event = await source.__anext__()
                    finally:
                        if check_at is not None:
                            check_at.cancel()
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                if not stalled:
                    raise
                own = bounds.first_s if produced == 0 else bounds.stall_s
                raise StreamStalled(f"{what}: no {'first' if produced == 0 else 'new'} token within {own:g} s "
                                    f"while its servers made no progress (--relay-"
                                    f"{'first-token' if produced == 0 else 'stall'}-timeout-s)") from None
            grown = new_output(event, produced)
            if grown is None:
                waited += loop.time() - started
            else:
                waited, produced = 0.0, grown
                progress.note(rld_url, loop.time())
            yield event
    finally:
        await source.aclose()  # its stream closed with this one, not whenever the GC gets to it


_max_md_tp = 8  # the router's --max-md-tp


def set_max_md_tp(limit: int) -> None:
    """The router's --max-md-tp: the largest MD TP size a registration reply may report."""
    global _max_md_tp
    try:
        _max_md_tp = check_md_tp(limit, name="--max-md-tp")
    except ControlError as e:
        raise ValueError(str(e)) from None


def md_tp_of(registration, max_md_tp: Optional[int] = None) -> int:
    """MD's TP size from its registration answer (a RegisterReply, or its JSON; ``tp_size``
    absent: TP 1): P sends each MD rank its KV heads, rank r's WAN receiver on MD's WAN port +
    r. Bounded by what the router was configured with (``--max-md-tp``), not by what the
    reply says."""
    limit = _max_md_tp if max_md_tp is None else max_md_tp
    size = registration.md_tp if isinstance(registration, RegisterReply) else registration.get("tp_size", 1)
    try:
        return check_md_tp(size, limit, name="tp_size")
    except ControlError as e:
        raise BackendError(f"MD registration: {e} (--max-md-tp)") from None


def _parse(kind, payload, what: str):
    """``kind.from_json(payload)`` of a 200; a malformed one is an UnverifiedReply naming ``what``."""
    try:
        return kind.from_json(payload)
    except ControlError as e:
        raise UnverifiedReply(f"{what}: malformed reply: {e}") from None


class MainControl:
    """MD's control API (served by the sglang-pdd plugin inside MD's scheduler); every call is
    signed with the router's control key (``signer``, default: ``use_control_key``'s) and, with
    ``tls`` (default: ``use_control_tls``'s), made over mutual TLS."""

    def __init__(self, session: aiohttp.ClientSession, control_url: str, signer: Optional[ControlSigner] = None,
                 tls: Optional[ssl.SSLContext] = None):
        self.session, self.url = session, control_url
        self.signer = signer or _control_signer
        self.tls = tls or _control_tls

    async def register(self, room: int, token_ids: list[int], timeout_s: float = 10.0,
                       use_cache: bool = True) -> RegisterReply:
        """MD's room for the prompt; its TP size checked against ``--max-md-tp``."""
        what = f"MD register room {room}"
        payload = await _call_json(self.session, "POST", f"{self.url}{api.MD_REGISTER.path()}", what,
                                   json=RegisterRequest(room, token_ids, use_cache).to_json(), timeout_s=timeout_s,
                                   signer=self.signer, tls=self.tls)
        reply = _parse(RegisterReply, payload, what)
        try:
            md_tp_of(reply)
        except BackendError as e:  # MD holds the room: the caller releases it
            raise UnverifiedReply(str(e)) from None
        return reply

    async def wait_ready(self, room: int, timeout_s: float) -> ReadyReply:
        what = f"MD ready room {room}"
        payload = await _call_json(self.session, "GET", f"{self.url}{api.ready_target(room, timeout_s)}", what,
                                   timeout_s=timeout_s + 10, signer=self.signer, tls=self.tls)
        return _parse(ReadyReply, payload, what)

    async def handoff(self, room: int, body: HandoffRequest, timeout_s: float = WARMUP_TIMEOUT_S) -> dict:
        """A catch-up batch (warmup): MD extends the prompt + these eager tokens, nothing more."""
        return await _call_json(self.session, "POST", f"{self.url}{api.MD_HANDOFF.path(room=room)}",
                                f"MD handoff room {room}", json=body.to_json(), timeout_s=timeout_s,
                                signer=self.signer, tls=self.tls)

    def handoff_stream(self, room: int, body: HandoffRequest, max_line_bytes: Optional[int] = None,
                       stall_timeout_s: Optional[float] = None,
                       first_token_timeout_s: Optional[float] = None) -> AsyncIterator[dict]:
        """The final handoff: MD continues the request; yields its stream events, each at most
        ``max_line_bytes`` (default: what the handoff's own fields allow for a prompt of 0 tokens;
        the router passes the bound of the whole request). ``stall_timeout_s``: no new token
        from MD for that long (from the call on, its headers included) is a TimeoutError;
        bytes that carry none (a relay trickling them) do not count. ``first_token_timeout_s``:
        the same for MD's first token past the handed ``token_ids`` (from the call on)."""
        events = self._handoff_events(room, body, max_line_bytes)
        if not (stall_timeout_s or first_token_timeout_s):
            return events
        return until_stalled(events, stall_timeout_s, f"MD room {room} handoff", first_s=first_token_timeout_s,
                             first_past=len(body.token_ids))

    async def _handoff_events(self, room: int, body: HandoffRequest,
                              max_line_bytes: Optional[int]) -> AsyncIterator[dict]:
        url = f"{self.url}{api.MD_HANDOFF.path(room=room)}"
        sent = _control_request(self.signer, "POST", url, body.to_json(), self.tls)
        if max_line_bytes is None:
            max_line_bytes = max_event_bytes(0, int(body.sampling_params.get("max_new_tokens") or 0),
                                             body.to_json())
        async with self.session.post(url, **sent) as resp:
            what = f"MD room {room} handoff"
            decoder = CumulativeDecoder()  # as generate_stream's
            events = (sse_events(resp, what, max_line_bytes, decoder) if self.signer is None else
                      signed_sse_events(resp, what, self.signer, sent["headers"][HEADER], max_line_bytes, decoder))
            async for event in events:
                yield event

    async def release(self, room: int, keep_kv: bool = False) -> None:
        """Best effort. ``keep_kv``: the request is over, but if its KV is still crossing the
        WAN, MD lets it land and caches it (for the session's next turn) instead of aborting."""
        url = f"{self.url}{api.release_target(room, keep_kv)}"
        try:
            async with self.session.delete(url, timeout=aiohttp.ClientTimeout(total=5),
                                           **_control_request(self.signer, "DELETE", url, tls=self.tls)) as resp:
                await error_text(resp)
        except (aiohttp.ClientError, TimeoutError) as e:
            logger.warning("release of room %s on %s failed: %r", room, self.url, e)

    async def stats(self) -> Optional[dict]:
        url = f"{self.url}{api.STATS.path()}"
        try:
            return await _call_json(self.session, "GET", url, "MD stats", timeout_s=5, signer=self.signer,
                                    tls=self.tls)
        except (BackendError, aiohttp.ClientError, TimeoutError):
            return None


# P's TP size per router session and control URL, asked once (a PrefillControl lives for one
# request): the asking task, which concurrent first callers share.
_prefill_tp_sizes: "weakref.WeakKeyDictionary[aiohttp.ClientSession, dict[str, asyncio.Task]]" = \
    weakref.WeakKeyDictionary()


def prefill_rank_url(control_url: str, rank: int) -> str:
    """TP rank ``rank``'s control API: rank 0's scheme and host, its port + ``rank``
    (the convention of sglang_glue/p/prefill_control)."""
    if rank == 0:
        return control_url
    parts = urlsplit(control_url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return urlunsplit(parts._replace(netloc=f"{host}:{port + rank}"))


class PrefillControl:
    """P's WAN-destination API (``--pdd-control-listen`` on a prefill server; served by the
    sglang-pdd plugin inside P's scheduler). Lets the router start P and RLD before MD has
    answered the room registration and tell P afterwards where the request's KV goes. With
    ``--tp N`` on P every rank serves its own API (port + rank) and each gets every call."""

    def __init__(self, session: aiohttp.ClientSession, control_url: str, signer: Optional[ControlSigner] = None,
                 tls: Optional[ssl.SSLContext] = None):
        self.session, self.url = session, control_url.rstrip("/")
        self.signer = signer or _prefill_signer
        self.tls = tls or _control_tls  # as MainControl's

    async def tp_size(self) -> int:
        """P's TP ranks (GET /pdd/info on rank 0, a signed reply), asked once per session. A
        failed ask is asked again by the next call."""
        asking = _prefill_tp_sizes.setdefault(self.session, {})
        task = asking.get(self.url)
        if task is None:
            task = asking[self.url] = asyncio.ensure_future(self._ask_tp_size())

            def forget_failure(done: asyncio.Task, url=self.url) -> None:
                if (done.cancelled() or done.exception() is not None) and asking.get(url) is done:
                    del asking[url]

            task.add_done_callback(forget_failure)
        return await asyncio.shield(task)  # one caller giving up does not cancel the others' ask

    async def _ask_tp_size(self) -> int:
        url = f"{self.url}{api.P_INFO.path()}"
        payload = await _call_json(self.session, "GET", url, f"P info {url}", timeout_s=5, signer=self.signer,
                                   tls=self.tls)
        size = _parse(InfoReply, payload, f"P info {url}").tp_size
        logger.info("P control %s: %d TP rank(s)", self.url, size)
        return size

    async def _rank_urls(self) -> list[str]:
        return [prefill_rank_url(self.url, rank) for rank in range(await self.tp_size())]

    async def set_wan_destination(self, bootstrap_room: int, md_room: int, wan_peer: str, md_prefix_len: int,
                                  timeout_s: float = 10.0, md_tp: int = 1) -> dict:
        """P sends the request's KV from token ``md_prefix_len`` on to ``wan_peer`` for MD's
        ``md_room`` (MD on TP ``md_tp``: rank r at ``wan_peer``'s port + r). Raises BackendError
        unless every TP rank answers 200 (400 malformed, 409 the room already has a destination
        or was dropped); the ranks that did accept then have it withdrawn (best effort). Returns
        rank 0's answer."""
        body = WanDestinationRequest(int(bootstrap_room), int(md_room), wan_peer, int(md_prefix_len),
                                     int(md_tp)).to_json()
        urls = await self._rank_urls()
        replies = await asyncio.gather(*(
            _call_json(self.session, "POST", f"{url}{api.P_DESTINATION.path()}",
                       f"P WAN destination for room {bootstrap_room}" + (f" (TP rank {rank})" if rank else ""),
                       json=body, timeout_s=timeout_s, signer=self.signer, tls=self.tls)
            for rank, url in enumerate(urls)), return_exceptions=True)
        failures = [r for r in replies if isinstance(r, BaseException)]
        if failures:
            accepted = [url for url, r in zip(urls, replies) if not isinstance(r, BaseException)]
            await asyncio.gather(*(self._drop(url, bootstrap_room) for url in accepted))
            raise failures[0]
        return replies[0]

    async def drop_wan_destination(self, bootstrap_room: int) -> None:
        """Best effort: no MD for this request after all; P stops holding its pages for the WAN."""
        try:
            urls = await self._rank_urls()
        except (BackendError, aiohttp.ClientError, TimeoutError) as e:
            logger.warning("P control %s: TP size unknown (%r); dropping on rank 0 only", self.url, e)
            urls = [self.url]
        await asyncio.gather(*(self._drop(url, bootstrap_room) for url in urls))

    async def keep_only_wan(self, bootstrap_room: int) -> None:
        """Best effort: the request ended on RLD and MD keeps what lands for its cache, so every
        P rank sends the room's KV behind the KV other requests wait for (P_KEPT)."""
        try:
            urls = await self._rank_urls()
        except (BackendError, aiohttp.ClientError, TimeoutError) as e:
            logger.info("P control %s: TP size unknown (%r); marking room %s kept on rank 0 only", self.url, e,
                        bootstrap_room)
            urls = [self.url]
        await asyncio.gather(*(self._kept(url, bootstrap_room) for url in urls))

    async def _kept(self, base_url: str, bootstrap_room: int) -> None:
        url = f"{base_url}{api.P_KEPT.path(bootstrap_room=bootstrap_room)}"
        try:
            await _call_json(self.session, "POST", url, f"P kept room {bootstrap_room}", json={}, timeout_s=5,
                             signer=self.signer, tls=self.tls)
        except (BackendError, aiohttp.ClientError, TimeoutError) as e:  # only the order of P's sends is at stake
            logger.info("marking WAN room %s kept on %s failed: %r", bootstrap_room, base_url, e)

    async def _drop(self, base_url: str, bootstrap_room: int) -> None:
        url = f"{base_url}{api.P_DROP.path(bootstrap_room=bootstrap_room)}"
        try:
            async with self.session.delete(url, timeout=aiohttp.ClientTimeout(total=5),
                                           **_control_request(self.signer, "DELETE", url, tls=self.tls)) as resp:
                text = await error_text(resp)
                if resp.status != 200:
                    logger.info("drop of WAN destination %s on %s: HTTP %s %s", bootstrap_room, base_url,
                                resp.status, text[:200])
        except (aiohttp.ClientError, TimeoutError) as e:
            logger.warning("drop of WAN destination %s on %s failed: %r", bootstrap_room, base_url, e)
