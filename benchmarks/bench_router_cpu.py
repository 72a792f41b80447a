"""The router's own CPU cost, without SGLang: fake P, RLD and MD, the real router process.

Starts ``tests/support/fake_backends.py``'s fake P, P control API, RLD and MD (a deterministic "model",
SGLang's SSE stream format, one token every ``--token-delay-ms`` per stream) in their own
process, then the router as a real subprocess (``python -m sglang_pdd.router`` on the tiny
model's tokenizer, pointed at the fakes), and sends streaming ``/generate`` requests at a
concurrency. Two phases:

* **long** (``--max-new`` tokens per request): router CPU seconds per 1 000 streamed tokens;
* **short** (``--short-new`` tokens): router CPU milliseconds per request, i.e. the fixed
  cost (tokenize, path choice, MD room registration, P's WAN destination, P and RLD legs,
  ready wait, handoff, releases);

and from both the marginal CPU per 1k tokens (long minus short, per extra token). Router CPU
is user + system of the router process and its children (psutil, /proc), over the phase.
``--workers N`` runs the router with N worker processes. Side by side, in alternating rounds
against the same fakes (drift on a shared machine hits both alike): ``--baseline-src DIR``
runs the router from another source tree (before / after), ``--compare-workers N`` 1 and N
workers at 1 ms per token (16 streams want 16 000 tokens/s: the router is the bottleneck,
and MD still takes over the requests as it does at real decode rates) and prints the
throughput ratio. Prints a table and JSON (also to ``--out``).

    .venv/bin/python -m benchmarks.bench_router_cpu                       # ~30 s
    .venv/bin/python -m benchmarks.bench_router_cpu --compare-workers 2
    git archive BASE | tar -x -C /tmp/base && .venv/bin/python -m benchmarks.bench_router_cpu --baseline-src /tmp/base
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil
from tqdm import tqdm

from benchmarks.common import CPU_TICK_S, MIN_CPU_TICKS, REPO, enough_cpu, greedy
from sglang_pdd.launcher.topology import free_port


# ---------------------------------------------------------------------- fake backends process
def serve_fakes(token_delay_s: float, key_file: str) -> None:
    """Runs the fakes until killed; prints their URLs as one JSON line. They sign their control
    replies with the router's control key, as MD and P do (else the router has no MD)."""
    from sglang_pdd.kv_channel.handshake import load_key
    from tests.support.fake_backends import Fakes, Knobs

    async def main() -> None:
        fakes = await Fakes(Knobs(rld_token_delay_s=token_delay_s, md_token_delay_s=token_delay_s),
                            control_key=load_key(key_file)).start()
        print(json.dumps({"p": fakes.p_url, "p_control": fakes.p_control_url, "rld": fakes.rld_url,
                          "md": fakes.md_url}), flush=True)
        while True:  # the fakes keep a request log: drop it, the benchmark reads nothing from it
            await asyncio.sleep(1.0)
            fakes.log.clear()
            fakes.rooms = {r: s for r, s in fakes.rooms.items() if not s["released"]}

    asyncio.run(main())


def start_fakes(token_delay_s: float, key_file: str) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_router_cpu", "--serve-fakes", str(token_delay_s),
                             "--fakes-key-file", key_file],
                            cwd=REPO, stdout=subprocess.PIPE, text=True)
    return proc, json.loads(proc.stdout.readline())


def start_router(urls: dict, workers: int, key_file: str, tokenizer: str,
                 src: Path = REPO) -> tuple[subprocess.Popen, str]:
    """The router from source tree ``src`` (another checkout: a baseline), on a free port."""
    port = free_port()
    argv = [sys.executable, "-m", "sglang_pdd.router", "--port", str(port), "--tokenizer-path", tokenizer,
            "--prefill", f"{urls['p']},8998,{urls['p_control']}", "--relay", urls["rld"],
            "--main", f"{urls['md']},{urls['md']},127.0.0.1:1", "--control-key-file", key_file,
            "--every-client-is-operator"]  # replies carry meta_info.pdd: who streamed the tokens
    if workers > 1:
        argv += ["--workers", str(workers)]
    env = {**os.environ, "PYTHONPATH": str(src)}
    proc = subprocess.Popen(argv, cwd=src, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


async def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"router exited with {proc.returncode}")
            try:
                async with s.get(f"{url}/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise SystemExit("router not healthy in time")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` and its live children (the workers)."""
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


# ---------------------------------------------------------------------- client
async def one_request(session: aiohttp.ClientSession, url: str, prompt: list[int], max_new: int) -> tuple[int, bool]:
    """(output tokens, whether MD streamed any of them)."""
    body = {"input_ids": prompt, "stream": True, "sampling_params": greedy(max_new)}
    last = None
    async with session.post(f"{url}/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:  # only the last event is parsed: the client's CPU is not the subject
            if raw.startswith(b"data:") and not raw.startswith(b"data: [DONE]"):
                last = raw
    meta = json.loads(last[5:])["meta_info"]
    return meta["completion_tokens"], bool(meta.get("pdd", {}).get("md_tokens"))


async def run_phase(url: str, pid: int, requests: int, concurrency: int, max_new: int, prompt_len: int,
                    label: str) -> dict:
    rng = random.Random(max_new)
    prompts = [[rng.randrange(1, 1000) for _ in range(prompt_len)] for _ in range(requests)]
    sem = asyncio.Semaphore(concurrency)
    bar = tqdm(total=requests, desc=label, leave=False)
    tokens = on_md = 0
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def go(prompt):
            nonlocal tokens, on_md
            async with sem:
                got, md = await one_request(session, url, prompt, max_new)
                tokens, on_md = tokens + got, on_md + md
            bar.update(1)

        await one_request(session, url, prompts[0], 2)  # warm connections and code paths
        cpu0, t0 = cpu_seconds(pid), time.perf_counter()
        await asyncio.gather(*(go(p) for p in prompts))
        wall, cpu = time.perf_counter() - t0, cpu_seconds(pid) - cpu0
    bar.close()
    return {"requests": requests, "max_new": max_new, "tokens": tokens, "wall_s": round(wall, 3),
            "router_cpu_s": round(cpu, 3), "cpu_s_per_1k_tokens": round(1000 * cpu / max(tokens, 1), 4),
            "cpu_ms_per_request": round(1000 * cpu / requests, 2), "tokens_per_s": round(tokens / wall, 1), "handed_to_md": on_md}


def summarize(name: str, workers: int, phases: list[dict]) -> dict:
    """One router's rounds summed: per phase (long, short) and the marginal CPU per 1k tokens."""
    out = {"router": name, "workers": workers}
    for kind in ("long", "short"):
        ps = [p for p in phases if p["kind"] == kind]
        tokens, wall, cpu = (sum(p[k] for p in ps) for k in ("tokens", "wall_s", "router_cpu_s"))
        requests = sum(p["requests"] for p in ps)
        ok = enough_cpu(cpu)  # else too few clock ticks to divide: None (printed n/a)
        out[kind] = {"requests": requests, "max_new": ps[0]["max_new"], "tokens": tokens, "wall_s": round(wall, 3),
                     "router_cpu_s": round(cpu, 3),
                     "cpu_s_per_1k_tokens": round(1000 * cpu / max(tokens, 1), 4) if ok else None,
                     "cpu_ms_per_request": round(1000 * cpu / requests, 2) if ok else None,
                     "tokens_per_s": round(tokens / wall, 1), "handed_to_md": sum(p["handed_to_md"] for p in ps),
                     "router_cores_busy": round(cpu / wall, 2)}
    extra = out["long"]["tokens"] - out["short"]["tokens"]
    difference = out["long"]["router_cpu_s"] - out["short"]["router_cpu_s"]
    out["marginal_cpu_s_per_1k_tokens"] = (round(1000 * difference / extra, 4)
                                           if extra > 0 and enough_cpu(abs(difference)) else None)
    return out


def _fmt(value, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


async def measure(args, routers: list[tuple[str, int, Path]], token_delay_s: float, key_file: str) -> list[dict]:
    """Routers (name, workers, source tree) side by side against the same fakes, in alternating
    rounds, so drift on a shared machine hits each alike."""
    fakes, urls = start_fakes(token_delay_s, key_file)
    started = [start_router(urls, workers, key_file, args.tokenizer_path, src) for _, workers, src in routers]
    spy = None
    phases: list[list[dict]] = [[] for _ in routers]
    try:
        for proc, url in started:
            await wait_healthy(url, proc)
        if args.py_spy:  # sampling costs the router CPU too: compare shares, not totals
            spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid",
                                    str(started[-1][0].pid), "--format", "raw", "-o", args.py_spy,
                                    "--subprocesses", "--nonblocking"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for rnd in range(args.rounds):
            for i, ((name, workers, _), (proc, url)) in enumerate(zip(routers, started)):
                for kind, max_new in (("long", args.max_new), ("short", args.short_new)):
                    p = await run_phase(url, proc.pid, args.requests, args.concurrency, max_new, args.prompt_len,
                                        f"round {rnd + 1} {name} {kind}")
                    phases[i].append({**p, "kind": kind})
    finally:
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(30)
        for proc, _ in started:
            proc.send_signal(signal.SIGINT)
        fakes.terminate()
        for proc in [p for p, _ in started] + [fakes]:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
    return [{**summarize(name, workers, ph), "token_delay_ms": token_delay_s * 1000}
            for (name, workers, _), ph in zip(routers, phases)]


def show(r: dict) -> None:
    print(f"{r['router']} ({r['workers']} worker(s)), token delay {r['token_delay_ms']:.1f} ms:")
    for name in ("long", "short"):
        p = r[name]
        print(f"  {name:5s} {p['requests']} req x {p['max_new']} tok: {p['tokens_per_s']:8.0f} tok/s  "
              f"CPU {_fmt(p['cpu_s_per_1k_tokens'], 3)} s/1k tok  {_fmt(p['cpu_ms_per_request'], 1)} ms/req  "
              f"router {p['router_cores_busy']:.2f} cores busy  "
              f"({p['handed_to_md']} handed to MD)")
    print(f"  marginal CPU per 1k tokens (long - short): {_fmt(r['marginal_cpu_s_per_1k_tokens'], 3)} s")
    if None in (r["long"]["cpu_s_per_1k_tokens"], r["short"]["cpu_s_per_1k_tokens"], r["marginal_cpu_s_per_1k_tokens"]):
        print(f"  n/a: fewer than {MIN_CPU_TICKS} CPU clock ticks ({MIN_CPU_TICKS * CPU_TICK_S:.1f} s) in the phase or "
              f"the difference; raise --requests or --rounds")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--serve-fakes", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--fakes-key-file", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--short-new", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--token-delay-ms", type=float, default=5.0, help="per stream, as a decode step")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per router")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--baseline-src", default=None, metavar="DIR",
                    help="also run the router from this source tree (e.g. `git archive` of an older commit), "
                         "side by side")
    ap.add_argument("--compare-workers", type=int, default=None, metavar="N",
                    help="1 worker, then N, at 1 ms per token (throughput ratio)")
    ap.add_argument("--py-spy", default=None, metavar="FILE", help="py-spy samples the router (collapsed stacks)")
    ap.add_argument("--tokenizer-path", default=str(REPO / "artifacts" / "tiny-llama"))
    ap.add_argument("--out", default=str(REPO / "artifacts" / "bench_router_cpu" / "results.json"))
    args = ap.parse_args()
    if args.serve_fakes is not None:
        serve_fakes(args.serve_fakes, args.fakes_key_file)
        return
    with tempfile.TemporaryDirectory() as tmp:
        key_file = os.path.join(tmp, "control.key")
        with open(os.open(key_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(secrets.token_hex(32))
        if args.compare_workers:
            runs = asyncio.run(measure(args, [("1 worker", 1, REPO), (f"{args.compare_workers} workers",
                                                                      args.compare_workers, REPO)], 0.001, key_file))
        elif args.baseline_src:
            runs = asyncio.run(measure(args, [("baseline", args.workers, Path(args.baseline_src).resolve()),
                                              ("this tree", args.workers, REPO)], args.token_delay_ms / 1000,
                                       key_file))
        else:
            runs = asyncio.run(measure(args, [("this tree", args.workers, REPO)], args.token_delay_ms / 1000,
                                       key_file))
    for r in runs:
        show(r)
    result = {"runs": runs, "args": {k: v for k, v in vars(args).items() if k not in ("serve_fakes", "fakes_key_file")}}
    if args.baseline_src:
        base, new = runs
        for key in ("cpu_s_per_1k_tokens", "cpu_ms_per_request"):
            for kind in ("long", "short"):
                n, b = new[kind][key], base[kind][key]
                result[f"{kind}_{key}_ratio"] = round(n / b, 3) if n is not None and b else None
        print(f"this tree / baseline: CPU per 1k tokens {_fmt(result['long_cpu_s_per_1k_tokens_ratio'], 2)}x (long), "
              f"CPU per request {_fmt(result['short_cpu_ms_per_request_ratio'], 2)}x (short)")
    if args.compare_workers:
        ratio = runs[1]["long"]["tokens_per_s"] / runs[0]["long"]["tokens_per_s"]
        result["throughput_ratio"] = round(ratio, 3)
        print(f"throughput {args.compare_workers} workers / 1 worker (long phase): {ratio:.2f}x (os.cpu_count() = "
              f"{os.cpu_count()}, fakes and client on the same cores)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
