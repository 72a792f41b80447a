"""Cost of mutual TLS on the control plane (not a timed test): MD's real MdControlServer on
loopback twice, plain (as without flags) and with ``--pdd-control-tls-*``'s context, the
router's MainControl calling each over one aiohttp session built as the router builds its
own (keep-alive connections, retired after 2 s idle), side by side in one run.

* ``stats``:    GET /pdd/stats, sequential calls: requests/s and ms per call;
* ``register``: POST /pdd/rooms with a ``--prompt-tokens`` prompt (the largest request);
* ``stream``:   one handoff stream of ``--events`` events: ms per stream and us per event;
* ``connect``:  GET /pdd/stats on a new connection each time (what a call pays when no
  kept-alive connection is there: the TCP, and with TLS the key exchange and both
  certificate checks).

Over TLS the server keeps connections alive (HTTP/1.1); plain, it answers HTTP/1.0 and each
call opens its own connection, as it always has. Both are measured as the router meets them.
Requests and replies are signed in both modes. Modes alternate per round and the median
round is reported, so a machine shared with other work skews both the same way. The
certificates (EC P-256) are made with openssl in a temporary directory.

    python -m benchmarks.bench_control_tls              # ~40 s
    python -m benchmarks.bench_control_tls --seconds 1 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from benchmarks.bench_control_reply_sig import KEY, _Generate, _Runtime, _timed, add_call_args, measure_calls
from sglang_pdd.control.auth import ROLE_MD, ControlSigner
from sglang_pdd.kv_channel.tls import control_tls_context
from sglang_pdd.protocol.routes import MD_REGISTER, STATS
from sglang_pdd.router.backends import clients as backends
from sglang_pdd.router.front.app import backend_session
from sglang_pdd.sglang_glue.md.main_drc import MdControlServer

MODES = ("tls", "plain")


def _certificates(d: Path) -> dict:
    from tests.support import pki

    pki.make_ca(d, "ca")
    return {"ca": str(d / "ca.pem"), "md": pki.make_leaf(d, "md", "ca", "IP:127.0.0.1"),
            "router": pki.make_leaf(d, "router", "ca", "DNS:router")}


async def run(args, certs: dict) -> dict:
    gen = _Generate(args.events)
    runtime = _Runtime(gen.port)
    servers = {"plain": MdControlServer(("127.0.0.1", 0), runtime, key=KEY),
               "tls": MdControlServer(("127.0.0.1", 0), runtime, key=KEY,
                                    ssl_context=control_tls_context(*certs["md"], certs["ca"], server_side=True))}
    urls = {mode: ("https" if mode == "tls" else "http") + "://%s:%s" % s.address for mode, s in servers.items()}
    tls = {"plain": None, "tls": control_tls_context(*certs["router"], certs["ca"], server_side=False)}
    signer = ControlSigner(KEY, role=ROLE_MD)
    ids = list(range(1000, 1000 + args.prompt_tokens))
    results = {mode: {"stats": [], "register": [], "stream": [], "connect": []} for mode in MODES}
    room = iter(range(1, 1 << 62))

    async def fresh_connection(mode):
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as one:
            assert await backends.MainControl(one, urls[mode], signer=signer, tls=tls[mode]).stats() is not None

    async with backend_session() as session:
        for _ in range(args.rounds):
            for mode in MODES:
                mc = backends.MainControl(session, urls[mode], signer=signer, tls=tls[mode])
                await measure_calls(mc, runtime, ids, room, args, results[mode])
                n, t = await _timed(lambda: fresh_connection(mode), args.seconds)
                results[mode]["connect"].append(t / n)
    for server in servers.values():
        server.close()
    gen.httpd.shutdown()
    return {mode: {k: statistics.median(v) for k, v in per.items()} for mode, per in results.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_call_args(ap)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-control-tls-") as d:
        res = asyncio.run(run(args, _certificates(Path(d))))
    s, u = res["tls"], res["plain"]
    print(f"{'call':<38}{'TLS':>12}{'plain':>12}{'TLS/plain':>11}")
    register = f"POST {MD_REGISTER.path()} ({args.prompt_tokens} ids)"
    for key, label in (("stats", f"GET {STATS.path()}"), ("register", register),
                       ("connect", f"GET {STATS.path()}, new connection")):
        print(f"{label + ' ms/call':<38}{s[key] * 1e3:>12.3f}{u[key] * 1e3:>12.3f}{s[key] / u[key]:>11.3f}")
        print(f"{label + ' req/s':<38}{1 / s[key]:>12.0f}{1 / u[key]:>12.0f}{u[key] / s[key]:>11.3f}")
    print(f"{f'handoff stream ({args.events} ev) ms':<38}{s['stream'] * 1e3:>12.3f}{u['stream'] * 1e3:>12.3f}"
          f"{s['stream'] / u['stream']:>11.3f}")
    print(f"{'  us/event':<38}{s['stream'] / args.events * 1e6:>12.1f}{u['stream'] / args.events * 1e6:>12.1f}")
    print(json.dumps({"args": vars(args), **res, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}))


if __name__ == "__main__":
    main()
