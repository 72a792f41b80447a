"""What the router reads from a control server is bounded in size and time, whatever the server
(or a relay on its path) sends: a huge or unsigned 200, an endless body, a reply that never
comes. Real sockets, a hostile fake server, the router's own clients (router/backends/clients.py)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from sglang_pdd.control.auth import REPLY_HEADER, ControlSigner
from sglang_pdd.protocol import HandoffRequest
from sglang_pdd.router.backends.clients import (BackendError, MainControl, PrefillControl, ReplyTooLarge, UnverifiedReply,
                                        generate_once)
from sglang_pdd.router.backends.reply_limits import MAX_CONTROL_REPLY_BYTES

from tests.support.fake_backends import serve_app

pytestmark = pytest.mark.timeout(60)

KEY = b"k" * 32
HUGE = 2 << 30  # what the review's fake MD announced: 2 GiB
CHUNK = b"x" * (1 << 20)


class Hostile:
    """A control server answering every call with ``mode``'s reply, counting the bytes it got to
    write before the client went away."""

    def __init__(self, mode: str):
        self.mode, self.written, self.done = mode, 0, asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        try:
            if self.mode == "never":
                await asyncio.sleep(3600)
            if self.mode == "error_stalls":  # a 500 whose body (1 MiB announced) stops after 128 KiB
                resp = web.StreamResponse(status=500, headers={"Content-Type": "application/json"})
                resp.content_length = MAX_CONTROL_REPLY_BYTES
                await resp.prepare(request)
                await resp.write(b'{"error": "' + b"x" * (128 << 10))
                self.written = 128 << 10
                self.done.set()
                await asyncio.sleep(3600)
            signed = self.mode in ("signed_huge", "signed_chunked")
            headers = {REPLY_HEADER: "0" * 64} if signed else {}
            resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json", **headers})
            if self.mode != "signed_chunked":
                resp.content_length = HUGE
            await resp.prepare(request)
            while self.written < HUGE:
                await resp.write(CHUNK)
                self.written += len(CHUNK)
            return resp
        except (ConnectionError, asyncio.CancelledError):
            raise
        finally:
            self.done.set()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app


def call_against(mode: str, call):
    """Runs ``call(session, base_url)`` against a Hostile server; returns (exception, bytes the
    server wrote before the router stopped reading)."""

    async def main():
        hostile = Hostile(mode)
        async with serve_app(hostile.app()) as base, aiohttp.ClientSession() as session:
            try:
                await call(session, base)
            except Exception as e:  # noqa: BLE001 - the test inspects it
                error = e
            else:
                error = None
            if mode != "never":
                await asyncio.wait_for(hostile.done.wait(), 30)
        return error, hostile.written

    return asyncio.run(main())


# Loopback socket buffers absorb a few MiB the router never reads; far below the reply.
WRITTEN_BOUND = 64 << 20


def test_an_unsigned_200_is_refused_before_its_body_is_read():
    signer = ControlSigner(KEY)
    error, written = call_against("unsigned_huge", lambda s, base: MainControl(s, base, signer).register(7, [1, 2]))
    assert isinstance(error, UnverifiedReply) and "not signed" in str(error)
    assert written < WRITTEN_BOUND


@pytest.mark.parametrize("mode", ["signed_huge", "signed_chunked"])
def test_a_reply_over_the_control_cap_is_cut_off(mode):
    """Announced (Content-Length: refused before reading) or not (chunked: cut at the cap)."""
    signer = ControlSigner(KEY)
    error, written = call_against(mode, lambda s, base: MainControl(s, base, signer).register(7, [1, 2]))
    assert isinstance(error, ReplyTooLarge) and str(MAX_CONTROL_REPLY_BYTES) in str(error)
    assert written < WRITTEN_BOUND


def test_ps_info_reply_is_bounded_too():
    error, written = call_against("signed_huge", lambda s, base: PrefillControl(s, base, ControlSigner(KEY)).tp_size())
    assert isinstance(error, ReplyTooLarge)
    assert written < WRITTEN_BOUND


@pytest.mark.parametrize("call", ["md_register", "p_info", "p_generate"])
def test_an_error_body_is_read_up_to_64_kib(call):
    """A non-200's body is only shown in a message: it is read up to MAX_ERROR_BODY_BYTES
    (64 KiB), not up to the 1 MiB of a control reply (or a /generate leg's event bound). Here
    the server stops after 128 KiB of a 1 MiB body: the router answers from what it read
    instead of waiting for the rest until its timeout."""
    signer = ControlSigner(KEY)
    calls = {"md_register": lambda s, base: MainControl(s, base, signer).register(7, [1, 2], timeout_s=3),
             "p_info": lambda s, base: PrefillControl(s, base, signer).tp_size(),
             "p_generate": lambda s, base: asyncio.wait_for(generate_once(
                 s, base, {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}, 4 << 20), 3)}
    error, written = call_against("error_stalls", calls[call])
    assert isinstance(error, BackendError) and error.status == 500, repr(error)
    assert "HTTP 500" in str(error) and len(str(error)) < 1000


def test_a_catch_up_batch_md_never_answers_times_out():
    signer = ControlSigner(KEY)
    error, _ = call_against("never", lambda s, base: MainControl(s, base, signer).handoff(
        7, HandoffRequest([1, 2], "rid", {"max_new_tokens": 4}, stream=False, warmup=True), timeout_s=0.5))
    assert isinstance(error, asyncio.TimeoutError)
