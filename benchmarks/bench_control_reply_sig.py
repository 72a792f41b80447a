"""Cost of signing control replies (not a timed test): MD's real MdControlServer on loopback,
the router's MainControl calling it, with reply signatures (as shipped) and without, side by
side. Without: the server computes no signature, it sends a placeholder of a signature's length
in its place (the router refuses a reply without the header before reading its body, so the
bytes on the wire stay the same), and the router's check is patched out.

* ``stats``:    GET /pdd/stats, sequential calls (one connection each, as the router's do):
  requests/s and ms per call;
* ``register``: POST /pdd/rooms with a ``--prompt-tokens`` prompt (a larger signed request,
  a small reply);
* ``stream``:   one handoff stream of ``--events`` events (MD signs each, the router checks
  each): ms per stream and us per event.

Modes alternate per round and the median round is reported, so a machine shared with other
work skews both the same way.

    python -m benchmarks.bench_control_reply_sig              # ~20 s
    python -m benchmarks.bench_control_reply_sig --seconds 1 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import aiohttp

from sglang_pdd.control import gate as control_gate
from sglang_pdd.control.auth import REPLY_HEADER, ROLE_MD, ControlSigner, ControlVerifier
from sglang_pdd.protocol import HandoffRequest, RegisterReply
from sglang_pdd.protocol.routes import MD_REGISTER, STATS
from sglang_pdd.router.backends import clients as backends
from sglang_pdd.sglang_glue.md.main_drc import MdControlServer

KEY = b"bench-control-reply-signing-key-0123456789"
_PLACEHOLDER = "0" * len(ControlVerifier(KEY, role=ROLE_MD).sign_reply("sig", 200, b"{}"))


class _Generate:
    """MD's own /generate, streaming ``events`` small events."""

    def __init__(self, events: int):
        body = b"".join(b'data: {"output_ids": [%d], "meta_info": {"completion_tokens": %d}}\n\n' % (i, i + 1)
                        for i in range(events)) + b"data: [DONE]\n\n"

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


class _Runtime:
    """Just enough of MD's runtime for the routes measured (no rooms, no scheduler)."""

    def __init__(self, http_port: int):
        self.http_port = http_port
        self.rooms: dict[int, list] = {}

    def register(self, req):
        self.rooms[req.room] = req.token_ids
        return RegisterReply(req.room, 0, prompt_tokens=len(req.token_ids))

    def stats(self):
        return {"open_rooms": len(self.rooms), "ready": 0, "failed": 0}

    def handoff_request(self, room, req):
        return {"input_ids": self.rooms.get(room, []) + req.token_ids, "stream": True}, True


@contextlib.contextmanager
def reply_signing(on: bool):
    """Off: the server signs no reply (a placeholder header of a signature's length instead),
    sends no event signature lines, and the router checks none."""
    saved = (control_gate.JsonRequestHandler.reply_signature, ControlVerifier.sign_event, backends._check_reply,
             backends.signed_sse_events)
    if not on:
        control_gate.JsonRequestHandler.reply_signature = (
            lambda self, status, body: {REPLY_HEADER: _PLACEHOLDER} if self.request_sig is not None else {})
        ControlVerifier.sign_event = lambda self, request_sig, index, data: None  # no signature line
        backends._check_reply = lambda *args: None
        backends.signed_sse_events = (lambda resp, url, signer, header, limit, decoder=None:
                                      backends.sse_events(resp, url, limit, decoder))
    try:
        yield
    finally:
        (control_gate.JsonRequestHandler.reply_signature, ControlVerifier.sign_event, backends._check_reply,
         backends.signed_sse_events) = saved


async def _timed(fn, seconds: float) -> tuple[int, float]:
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        await fn()
        n += 1
    return n, time.perf_counter() - start


async def measure_calls(mc, runtime: "_Runtime", ids: list[int], room, args, into: dict) -> None:
    """One round of the router's calls on ``mc`` (stats, a registration of ``ids``, a handoff
    stream of ``args.events`` events), each repeated for ``args.seconds``: seconds per call
    appended to ``into[call]``. ``room``: an iterator of fresh room ids."""
    assert (await mc.stats()) is not None  # the mode works end to end
    n, t = await _timed(mc.stats, args.seconds)
    into["stats"].append(t / n)
    n, t = await _timed(lambda: mc.register(next(room), ids), args.seconds)
    into["register"].append(t / n)
    runtime.rooms.clear()

    async def handoff_stream():
        events = [e async for e in mc.handoff_stream(next(room), HandoffRequest([1]))]
        assert len(events) == args.events, len(events)

    n, t = await _timed(handoff_stream, args.seconds)
    into["stream"].append(t / n)


def add_call_args(ap: argparse.ArgumentParser) -> None:
    """The flags of measure_calls' rounds."""
    ap.add_argument("--seconds", type=float, default=0.5, help="per measurement")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--events", type=int, default=256)


async def run(args) -> dict:
    gen = _Generate(args.events)
    runtime = _Runtime(gen.port)
    server = MdControlServer(("127.0.0.1", 0), runtime, key=KEY)
    url = "http://%s:%s" % server.address
    ids = list(range(1000, 1000 + args.prompt_tokens))
    results = {mode: {"stats": [], "register": [], "stream": []} for mode in ("signed", "unsigned")}
    room = iter(range(1, 1 << 62))

    async with aiohttp.ClientSession() as session:
        mc = backends.MainControl(session, url, signer=ControlSigner(KEY, role=ROLE_MD))
        for _ in range(args.rounds):
            for mode in ("signed", "unsigned"):
                with reply_signing(mode == "signed"):
                    await measure_calls(mc, runtime, ids, room, args, results[mode])
    server.close()
    gen.httpd.shutdown()
    return {mode: {k: statistics.median(v) for k, v in per.items()} for mode, per in results.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_call_args(ap)
    args = ap.parse_args()
    res = asyncio.run(run(args))
    s, u = res["signed"], res["unsigned"]
    print(f"{'call':<34}{'signed':>14}{'unsigned':>14}{'ratio':>8}")
    register = f"POST {MD_REGISTER.path()} ({args.prompt_tokens} ids)"
    for key, label in (("stats", f"GET {STATS.path()}"), ("register", register)):
        print(f"{label + ' ms/call':<34}{s[key] * 1e3:>14.3f}{u[key] * 1e3:>14.3f}{s[key] / u[key]:>8.3f}")
        print(f"{label + ' req/s':<34}{1 / s[key]:>14.0f}{1 / u[key]:>14.0f}{u[key] / s[key]:>8.3f}")
    print(f"{f'handoff stream ({args.events} ev) ms':<34}{s['stream'] * 1e3:>14.3f}{u['stream'] * 1e3:>14.3f}"
          f"{s['stream'] / u['stream']:>8.3f}")
    print(f"{'  us/event':<34}{s['stream'] / args.events * 1e6:>14.1f}{u['stream'] / args.events * 1e6:>14.1f}")
    print(f"{'HMAC alone, sign + check: reply':<34}{_hmac_us('reply'):>12.1f} us")
    print(f"{'HMAC alone, sign + check: event':<34}{_hmac_us('event'):>12.1f} us")
    print(json.dumps({"args": vars(args), **res}))


def _hmac_us(what: str, n: int = 20000) -> float:
    """The signatures' own cost (server signs, router checks), without HTTP around them."""
    signer, verifier = ControlSigner(KEY, role=ROLE_MD), ControlVerifier(KEY, role=ROLE_MD)
    header = signer.header("GET", STATS.path(), host="127.0.0.1:1")["Authorization"]
    sig = header.rsplit("sig=", 1)[1]
    body = json.dumps({"room": 1, "cached_tokens": 0, "prompt_tokens": 4096, "tp_size": 1}).encode()
    start = time.perf_counter()
    for i in range(n):
        if what == "reply":
            signer.check_reply(header, 200, body, verifier.sign_reply(sig, 200, body))
        else:
            signer.check_event(header, i, body, verifier.sign_event(sig, i, body))
    return (time.perf_counter() - start) / n * 1e6


if __name__ == "__main__":
    main()
