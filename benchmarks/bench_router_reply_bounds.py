"""A backend's oversized reply against the router: memory and time, before and after bounds.

The proofs of concept of the third security review's "unbounded replies" and "long stream
event" findings, as a user would reproduce them. A fake MD (its own process, so its memory is
not counted) answers the router's registration call with 200 and a body of ``--reply-mib``
(chunked, as fast as loopback takes it), once without a reply signature and once with a
signature header of the right shape (a forger's: it does not verify). A fake SGLang server
answers a streamed ``/generate`` with one event line of ``--line-mib``. The router's own
client code (``sglang_pdd.router.backends.clients``) is run in a child process against each, and the
table gives the child's peak RSS growth, the time until it gave up, and the error it raised.

    python -m benchmarks.bench_router_reply_bounds                         # this tree
    python -m benchmarks.bench_router_reply_bounds --tree /path/to/old/checkout   # another tree's router code

``--tree`` puts another checkout's ``sglang_pdd`` first on the child's path (the same venv),
so the same attack runs on the code before and after a change, side by side in one run.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO

CHUNK = 1 << 20


def fake_server(port_file: str, reply_mib: int, line_mib: int) -> None:
    """Serve until killed: POST .../pdd/rooms -> 200 + a huge body (``?signed=1``: with a forged
    signature header); POST /generate -> one SSE event line of ``line_mib`` MiB."""
    import asyncio

    from aiohttp import web

    from sglang_pdd.control.auth import REPLY_HEADER

    async def rooms(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        if request.query.get("signed") or request.headers.get("X-Bench-Signed"):
            resp.headers[REPLY_HEADER] = "0" * 64
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        chunk = b" " * CHUNK
        try:
            for _ in range(reply_mib):
                await resp.write(chunk)
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        return resp

    async def generate(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            await resp.write(b'data: {"text": "' + b"x" * (line_mib * CHUNK) + b'"}\n\n')
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        return resp

    async def main() -> None:
        app = web.Application()
        app.router.add_route("*", "/pdd/rooms", rooms)
        app.router.add_post("/generate", generate)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        Path(port_file).write_text(str(site._server.sockets[0].getsockname()[1]))
        await asyncio.Event().wait()

    asyncio.run(main())


def attack(url: str, kind: str, timeout_s: float) -> dict:
    """In the child: one router client call against the fake server; peak RSS growth, time, error."""
    import asyncio
    import resource

    import aiohttp

    from sglang_pdd.router.backends import clients as backends
    def rss_mib() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    async def run() -> str:
        async with aiohttp.ClientSession(headers={"X-Bench-Signed": "1"} if kind == "signed" else None) as session:
            if kind in ("unsigned", "signed"):
                try:
                    signer = backends.ControlSigner(b"k" * 32, role=backends.ROLE_MD)
                except (AttributeError, TypeError):  # a tree whose signer has no roles
                    signer = backends.ControlSigner(b"k" * 32)
                await backends.MainControl(session, url, signer=signer).register(1, [1, 2, 3])
                return "answered"
            body = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 16}}
            try:  # the bound the router sets for this leg (a tree without bounds takes none)
                from sglang_pdd.router.backends.reply_limits import max_event_bytes
                stream = backends.generate_stream(session, url, body, max_event_bytes(3, 16))
            except ImportError:
                stream = backends.generate_stream(session, url, body)
            async for _ in stream:
                pass
            return "answered"

    before, t0 = rss_mib(), time.monotonic()
    try:
        outcome = asyncio.run(asyncio.wait_for(run(), timeout_s))
    except asyncio.TimeoutError:  # the call's own timeout, or --timeout-s
        outcome = "TimeoutError"
    except Exception as e:  # what the router's flow would see
        outcome = f"{type(e).__name__}: {' '.join(str(e).split())[:80]}"
    return {"rss_growth_mib": round(rss_mib() - before, 1), "seconds": round(time.monotonic() - t0, 2),
            "outcome": outcome, "code": backends.__file__}


def run_child(tree: Path, url: str, kind: str, timeout_s: float) -> dict:
    # The attack's own source, so that nothing but ``tree``'s sglang_pdd is imported from a tree
    # (and the child's working directory is neither tree: ``-c`` puts it first on the path).
    env = {**os.environ, "PYTHONPATH": str(tree)}
    code = (f"import json, time\n{inspect.getsource(attack)}\n"
            f"print(json.dumps(attack({url!r}, {kind!r}, {timeout_s})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=tempfile.gettempdir(), timeout=timeout_s + 120)
    if done.returncode != 0:
        return {"rss_growth_mib": None, "seconds": None, "outcome": f"child failed: {done.stderr[-200:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", default=[], help="another checkout to run the same attacks on")
    ap.add_argument("--reply-mib", type=int, default=2048)
    ap.add_argument("--line-mib", type=int, default=64)
    ap.add_argument("--timeout-s", type=float, default=60.0)
    a = ap.parse_args(argv)

    from tqdm import tqdm

    port_file = tempfile.mktemp()
    server = subprocess.Popen([sys.executable, "-c", "from benchmarks.bench_router_reply_bounds import fake_server; "
                               f"fake_server({port_file!r}, {a.reply_mib}, {a.line_mib})"], cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(port_file) or not Path(port_file).read_text():
            if time.monotonic() > deadline:
                raise SystemExit("fake server did not start")
            time.sleep(0.1)
        url = f"http://127.0.0.1:{Path(port_file).read_text()}"
        trees = [Path(t).resolve() for t in a.tree] + [REPO]
        kinds = [("unsigned", f"register: 200 + {a.reply_mib} MiB, no signature"),
                 ("signed", f"register: 200 + {a.reply_mib} MiB, forged signature header"),
                 ("stream", f"/generate: one {a.line_mib} MiB event line")]
        rows = []
        for tree in tqdm([(t, k) for t in trees for k in kinds], desc="attacks", unit="call"):
            rows.append((tree[0], tree[1][1], run_child(tree[0], url, tree[1][0], a.timeout_s)))
    finally:
        server.kill()
        server.wait()
    print(f"\n| tree | attack | router client RSS growth | time | outcome |\n|---|---|---:|---:|---|")
    for tree, what, r in rows:
        assert r.get("code", str(tree)).startswith(str(tree)), f"{tree}: ran {r.get('code')}"
        print(f"| {tree.name} | {what} | {r['rss_growth_mib']} MiB | {r['seconds']} s | {r['outcome']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
