"""The router's memory and CPU per long logprob stream, per path, before and after a change.

SGLang streams cumulatively: each event of a request with ``return_logprob`` and
``top_logprobs_num=K`` repeats every position's K+1 entries so far, so a stream of n tokens is
~n^2/2 x (K+1) entries (1,000 tokens at K=20: ~250 MB of JSON). This benchmark measures what
one such stream costs the router process itself: its peak RSS above its idle RSS, and its CPU
seconds, for n tokens at K top logprobs, 1 and C streams at once, on each path (P->MD,
P->RLD->MD catch-up and one-shot, P->RLD only).

Backends are ``tests/support/fake_backends.py``'s fakes in their own process (deterministic, no SGLang;
each event's logprobs in one walk of the sequence, written with orjson, so they keep ahead), streaming
as fast as they can (``--token-delay-ms 0``): a router that falls behind its backends shows
what it keeps meanwhile. The router runs as a real subprocess, one per source tree, talking to
the fakes unsigned (below): ``--baseline-src DIR`` (e.g. ``git archive main | tar -x -C DIR``)
runs the same streams on another tree's router, alternating per case, and the table gives
after/before ratios. A tree with ``--max-logprob-stream-entries`` gets it high enough for every
stream measured. Each client stream is hashed (every event, without the run-dependent
``meta_info.pdd`` timings and ``meta_info.id``), so the table also says whether both trees sent
the client the same final event and the same stream (which tokens share an event depends on
timing, e.g. where a one-shot handoff cuts, so a stream may be chunked differently). ``--diagnose DIR``: cProfile and tracemalloc in the router (slow).

    git archive main | tar -x -C /tmp/base
    .venv/bin/python -m benchmarks.bench_router_long_stream_memory --baseline-src /tmp/base

RSS: the router's RSS when the case starts (it keeps what earlier cases grew it to) and its peak
above that: VmHWM after resetting it (``/proc/PID/clear_refs``) before each case (polled RSS
where the reset is not allowed). CPU: user + system seconds of the router process.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from benchmarks.bench_router_cpu import cpu_seconds, wait_healthy
from benchmarks.common import REPO, greedy
from sglang_pdd.launcher.topology import free_port

PATHS = {
    "p_md": {"path": "p_md"},
    "catch_up": {"path": "p_rld_md", "handoff_mode": "catch_up", "catch_up_threshold": 16},
    "one_shot": {"path": "p_rld_md", "handoff_mode": "one_shot"},
    "rld_only": {"path": "p_rld_only"},
}
MAX_LINE = 1 << 30
RANDOM_ID = re.compile(rb'"id":"[^"]*"')


# ---------------------------------------------------------------------- fake backends process
def serve_fakes(token_delay_s: float) -> None:
    """The fakes until killed, their URLs printed as one JSON line."""
    from tests.support import fake_backends as fb

    async def main() -> None:
        fakes = await fb.Fakes(fb.Knobs(rld_token_delay_s=token_delay_s, md_token_delay_s=token_delay_s)).start()
        print(json.dumps({"p": fakes.p_url, "p_control": fakes.p_control_url, "rld": fakes.rld_url,
                          "md": fakes.md_url}), flush=True)
        while True:
            await asyncio.sleep(1.0)
            fakes.log.clear()
            fakes.rooms = {r: s for r, s in fakes.rooms.items() if not s["released"]}

    asyncio.run(main())


def start_fakes(token_delay_s: float) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_router_long_stream_memory", "--serve-fakes",
                             str(token_delay_s)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    return proc, json.loads(proc.stdout.readline())


# ---------------------------------------------------------------------- router
# The test fakes do not sign their control replies (the flow tests run the router's code without
# a control key): the router's --control-key-file is given (it is required with --main) and its
# key then dropped before any call, so the router talks to them unsigned. Signatures are not what
# this benchmark measures.
UNSIGNED_ROUTER = ("import runpy, sglang_pdd.router.backends.clients as b; use = b.use_control_key; "
                   "b.use_control_key = lambda key: use(None); "
                   "runpy.run_module('sglang_pdd.router', run_name='__main__', alter_sys=True)")

# --diagnose DIR: the router runs under cProfile and tracemalloc; at its exit it writes DIR/profile.txt
# (cumulative and own time) and DIR/tracemalloc.txt (where the memory was when the traced total
# was at its largest: the snapshot taken each time the total grew by a tenth).
DIAGNOSE_ROUTER = """
import atexit, cProfile, io, os, pstats, signal, threading, time, tracemalloc
out = os.environ['BENCH_DIAGNOSE']
prof = cProfile.Profile()
best = {'peak': 0, 'snap': None}
def watch():
    while True:
        cur, _ = tracemalloc.get_traced_memory()
        if cur > 1.1 * best['peak'] + (8 << 20):
            best['peak'], best['snap'] = cur, tracemalloc.take_snapshot()
        time.sleep(0.1)
def start(*_):  # SIGUSR1 once the router serves: its imports are not what is measured
    tracemalloc.start(8)
    threading.Thread(target=watch, daemon=True).start()
    prof.enable()
signal.signal(signal.SIGUSR1, start)
def dump():
    prof.disable()
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats('cumulative').print_stats(60)
    st.sort_stats('tottime').print_stats(40)
    open(os.path.join(out, 'profile.txt'), 'w').write(s.getvalue())
    lines = [f"peak traced: {best['peak'] / 2**20:.1f} MiB"]
    if best['snap'] is not None:
        for stat in best['snap'].statistics('traceback')[:12]:
            lines.append(f"{stat.size / 2**20:.1f} MiB in {stat.count} blocks")
            lines += ['    ' + l for l in stat.traceback.format()]
    open(os.path.join(out, 'tracemalloc.txt'), 'w').write(chr(10).join(lines) + chr(10))
atexit.register(dump)
"""


def start_router(urls: dict, key_file: str, tokenizer: str, src: Path,
                 diagnose: str = "") -> tuple[subprocess.Popen, str]:
    """The router from source tree ``src``, one process, on a free port."""
    port = free_port()
    code = (DIAGNOSE_ROUTER if diagnose else "") + UNSIGNED_ROUTER
    argv = [sys.executable, "-c", code, "--port", str(port), "--tokenizer-path", tokenizer,
            "--prefill", f"{urls['p']},8998,{urls['p_control']}", "--relay", urls["rld"],
            "--main", f"{urls['md']},{urls['md']},127.0.0.1:1", "--control-key-file", key_file,
            "--every-client-is-operator"]  # pdd_options choose the path; replies say who streamed
    if "--max-logprob-stream-entries" in (src / "sglang_pdd" / "router" / "cli.py").read_text():
        argv += ["--max-logprob-stream-entries", str(1 << 40)]  # the streams measured, whatever their size
    env = {**os.environ, "PYTHONPATH": str(src)}
    if diagnose:
        os.makedirs(diagnose, exist_ok=True)
        env["BENCH_DIAGNOSE"] = diagnose
    proc = subprocess.Popen(argv, cwd=src, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def reset_peak(pid: int) -> bool:
    """VmHWM := VmRSS now (Linux's clear_refs 5); False where that is not allowed."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class PeakRss:
    """The router's peak RSS during a case, above its RSS at the start (KiB)."""

    def __init__(self, pid: int):
        self.pid, self.polled = pid, 0

    async def __aenter__(self):
        self.hwm_ok = reset_peak(self.pid)
        self.base = rss_kib(self.pid)
        self.polled = self.base
        self._task = asyncio.ensure_future(self._poll())
        return self

    async def _poll(self) -> None:
        while True:
            self.polled = max(self.polled, rss_kib(self.pid))
            await asyncio.sleep(0.02)

    async def __aexit__(self, *exc):
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.peak_kib = max(self.polled, rss_kib(self.pid, "VmHWM") if self.hwm_ok else 0)
        self.growth_kib = self.peak_kib - self.base


# ---------------------------------------------------------------------- client
def stream_digest_line(line: bytes) -> bytes:
    """An event line without its run-dependent parts: meta_info.pdd (timings, the last key) and
    meta_info.id (the request's random id)."""
    cut = line.rfind(b',"pdd":{')
    return RANDOM_ID.sub(b'"id":""', line[:cut] if cut >= 0 else line, count=1)


async def one_stream(session: aiohttp.ClientSession, url: str, prompt: list[int], max_new: int, top: int,
                     options: dict) -> dict:
    body = {"input_ids": prompt, "stream": True, "return_logprob": True, "top_logprobs_num": top,
            "sampling_params": greedy(max_new), "pdd_options": options}
    digest, events, total, longest, last = hashlib.sha256(), 0, 0, 0, None
    async with session.post(f"{url}/generate", json=body) as resp:
        if resp.status != 200:
            return {"error": f"HTTP {resp.status}: {(await resp.text())[:200]}"}
        while True:
            line = await resp.content.readuntil(b"\n", max_size=MAX_LINE) if hasattr(
                resp.content, "readuntil") else await resp.content.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            events, total, longest, last = events + 1, total + len(line), max(longest, len(line)), line
            digest.update(stream_digest_line(line))
    last_digest = hashlib.sha256(stream_digest_line(last)).hexdigest()[:16] if last else ""
    meta = json.loads(last[5:])["meta_info"] if last else {}
    if "error" in (json.loads(last[5:]) if last else {}):
        return {"error": str(json.loads(last[5:])["error"])[:200]}
    pdd = meta.get("pdd") or {}
    return {"events": events, "bytes": total, "longest": longest, "digest": digest.hexdigest()[:16],
            "last_digest": last_digest,
            "tokens": meta.get("completion_tokens"), "path": pdd.get("path"), "md_tokens": pdd.get("md_tokens"),
            "fallbacks": pdd.get("fallbacks")}


async def run_case(url: str, pid: int, path: str, max_new: int, top: int, concurrency: int, seed: int) -> dict:
    prompts = [[(seed * 7919 + i * 104729 + j * 31) % 997 + 1 for j in range(32)] for i in range(concurrency)]
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout, read_bufsize=1 << 20) as session:
        await one_stream(session, url, prompts[0][:8], 4, top, PATHS[path])  # warm the code paths
        cpu0, t0 = cpu_seconds(pid), time.perf_counter()
        async with PeakRss(pid) as peak:
            outs = await asyncio.gather(*(one_stream(session, url, p, max_new, top, PATHS[path]) for p in prompts))
        wall, cpu = time.perf_counter() - t0, cpu_seconds(pid) - cpu0
    errors = [o["error"] for o in outs if "error" in o]
    ok = [o for o in outs if "error" not in o]
    return {"path": path, "max_new": max_new, "top": top, "streams": concurrency,
            "peak_rss_mib": round(peak.growth_kib / 1024, 1), "rss_at_start_mib": round(peak.base / 1024, 1),
            "cpu_s": round(cpu, 2),
            "cpu_s_per_stream": round(cpu / concurrency, 2), "wall_s": round(wall, 2),
            "client_mb": round(sum(o["bytes"] for o in ok) / 1e6, 1),
            "longest_event_mb": round(max((o["longest"] for o in ok), default=0) / 1e6, 2),
            "digest": ",".join(o["digest"] for o in ok), "last_digest": ",".join(o["last_digest"] for o in ok),
            "events": sum(o["events"] for o in ok), "errors": errors,
            "wrong": [o for o in ok if o["tokens"] != max_new or o["path"] != PATHS[path]["path"] or o["fallbacks"]]}


# ---------------------------------------------------------------------- main
async def measure(args, trees: list[tuple[str, Path]], key_file: str) -> list[dict]:
    fakes, urls = start_fakes(args.token_delay_ms / 1000)
    routers = [start_router(urls, key_file, args.tokenizer_path, src,
                            os.path.join(args.diagnose, name) if args.diagnose else "") for name, src in trees]
    rows = []
    try:
        for proc, url in routers:
            await wait_healthy(url, proc)
            if args.diagnose:
                proc.send_signal(signal.SIGUSR1)
        sizes = [tuple(int(x) for x in case.split("x")) for case in args.cases] if args.cases else \
            [(n, c) for c in args.concurrency for n in args.lengths]
        cases = [(path, n, c) for n, c in sizes for path in args.paths]
        for i, (path, n, c) in enumerate(cases):
            for (name, _), (proc, url) in zip(trees, routers):
                r = await run_case(url, proc.pid, path, n, args.top, c, seed=i)
                r["tree"] = name
                rows.append(r)
                print(json.dumps(r), flush=True)
    finally:
        for proc, _ in routers:
            proc.send_signal(signal.SIGINT)
        fakes.terminate()
        for proc in [p for p, _ in routers] + [fakes]:
            try:
                proc.wait(120 if args.diagnose else 20)
            except subprocess.TimeoutExpired:
                proc.kill()
    return rows


def same_stream_no(before: dict, after: dict) -> str:
    """Streams whose final events agree may still be chunked differently: how many events each had."""
    return f"NO ({before.get('events')} vs {after.get('events')} events)"


def table(rows: list[dict], names: list[str]) -> str:
    cases: dict[tuple, dict] = {}
    for r in rows:
        cases.setdefault((r["path"], r["max_new"], r["streams"]), {})[r["tree"]] = r
    head = "| path | tokens x top | streams | client MB | longest event MB |"
    for n in names:
        head += f" {n} RSS MiB: start + peak growth | {n} CPU s/stream |"
    if len(names) == 2:
        head += " RSS after/before | CPU after/before | same last event | same stream |"
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for (path, n, c), by in cases.items():
        any_row = next(iter(by.values()))
        line = f"| {path} | {n} x {any_row['top']} | {c} | {any_row['client_mb']} | {any_row['longest_event_mb']} |"
        for name in names:
            r = by.get(name, {})
            bad = " (!)" if r.get("errors") or r.get("wrong") else ""
            line += f" {r.get('rss_at_start_mib')} + {r.get('peak_rss_mib')}{bad} | {r.get('cpu_s_per_stream')} |"
        if len(names) == 2 and all(n in by for n in names):
            b, a = by[names[0]], by[names[1]]
            line += (f" {a['peak_rss_mib'] / max(b['peak_rss_mib'], 0.1):.2g} |"
                     f" {a['cpu_s_per_stream'] / max(b['cpu_s_per_stream'], 0.01):.2g} |"
                     f" {'yes' if a.get('last_digest') == b.get('last_digest') else 'NO'} |"
                     f" {'yes' if a['digest'] == b['digest'] else same_stream_no(b, a)} |")
        out.append(line)
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--serve-fakes", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    ap.add_argument("--lengths", nargs="+", type=int, default=[1000], help="max_new_tokens per stream")
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1], help="streams at once")
    ap.add_argument("--cases", nargs="+", default=None, metavar="TOKENSxSTREAMS",
                    help="these sizes instead of --lengths x --concurrency, e.g. 1000x1 2000x1 1000x4 (the old "
                         "router keeps ~2.7 GB per 1,000 tokens of a 20-top-logprob stream: mind the machine)")
    ap.add_argument("--top", type=int, default=20, help="top_logprobs_num")
    ap.add_argument("--token-delay-ms", type=float, default=0.0, help="per stream, as a decode step")
    ap.add_argument("--baseline-src", default=None, metavar="DIR", help="also run this tree's router (before)")
    ap.add_argument("--diagnose", default="", metavar="DIR",
                    help="run each router under cProfile + tracemalloc (slow); reports in DIR/<tree>/")
    ap.add_argument("--tokenizer-path", default=str(REPO / "artifacts" / "tiny-llama"))
    ap.add_argument("--out", default=str(REPO / "artifacts" / "bench_router_long_stream_memory" / "results.json"))
    args = ap.parse_args()
    if args.serve_fakes is not None:
        serve_fakes(args.serve_fakes)
        return
    trees = ([("before", Path(args.baseline_src).resolve())] if args.baseline_src else []) + [("after", REPO)]
    with tempfile.TemporaryDirectory() as tmp:
        key_file = os.path.join(tmp, "control.key")
        with open(os.open(key_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(secrets.token_hex(32))
        rows = asyncio.run(measure(args, trees, key_file))
    names = [n for n, _ in trees]
    print(table(rows, names))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "args": {k: v for k, v in vars(args).items()
                                                                 if k != "serve_fakes"}}, indent=2))


if __name__ == "__main__":
    main()
