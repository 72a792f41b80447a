"""Router overhead next to direct SGLang, on the same requests, side by side in one run.

Starts one ``LocalCluster`` (real P, RLD, MD, WAN emulator, the router) and one plain SGLang
server (the "direct" reference, same model and flags), then sends the same streaming
``/generate`` requests (greedy, fixed prompts) to both, in alternating rounds so drift on the
shared machine hits both alike:

* **TTFT**: client-side time to the first event with a token; the table shows the median and
  p90 of each and the router's added TTFT (median difference) and ratio;
* **tokens/s**: output tokens / wall time of a round at ``--concurrency`` (what one router
  process streams, against what the direct server streams);
* **router CPU**: user + system CPU seconds of the router process (psutil) during its rounds,
  per 1 000 streamed tokens: the router's own cost (tokenize, flow, detokenize, SSE), next to
  the same for the direct server's front end (its HTTP / TokenizerManager process and its
  detokenizer process: the work the router does in their place), each less its idle CPU rate
  (measured on the same processes over an idle window first: SGLang's detokenizer polls) times
  the round's wall time;
* ``--py-spy FILE``: py-spy samples the router during the rounds (collapsed stacks), to see
  where its CPU goes (``.venv/bin/pip install py-spy`` first; sampling inflates the router's
  CPU, so compare shares, not totals);
* also through the OpenAI chat endpoint (SGLang's serving layer in the router), same numbers.

On the 2-core CPU box every server shares the cores with the client, so the router's wall-time
ratios include contention; the CPU per 1k tokens is the portable number.

    .venv/bin/python -m benchmarks.bench_router_overhead                  # ~4 min
    .venv/bin/python -m benchmarks.bench_router_overhead --requests 8 --rounds 1
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from tqdm import tqdm

from benchmarks.common import CPU_TICK_S, MIN_CPU_TICKS, REPO, enough_cpu, greedy, timed_events
from sglang_pdd.launcher.cluster import LocalCluster, default_model_path
from sglang_pdd.launcher.http import stream_events
from sglang_pdd.launcher.processes import ProcessGroup
from sglang_pdd.launcher.topology import CPU_ENV, ServerSpec, free_port, server_argv

SERVING = ["--chat-template", "chatml"]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def prompts(n: int) -> list[str]:
    return [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(40)) + f" #{i}" for i in range(n)]


def stream_generate(url: str, prompt: str, max_new: int) -> tuple[float, int]:
    """(TTFT seconds, output tokens) of one streaming /generate."""
    body = {"text": prompt, "stream": True, "sampling_params": greedy(max_new)}
    t0, ttft, tokens = time.perf_counter(), None, 0
    for t, event in timed_events(f"{url}/generate", body):
        tokens = len(event.get("output_ids") or [])
        if ttft is None and tokens:
            ttft = t - t0
    return ttft or float("nan"), tokens


def stream_chat(url: str, prompt: str, max_new: int) -> tuple[float, int]:
    body = {"model": "default", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_new,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0, ttft, tokens = time.perf_counter(), None, 0
    for chunk in stream_events(f"{url}/v1/chat/completions", body, timeout=600):
        if ttft is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
            ttft = time.perf_counter() - t0
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    return ttft or float("nan"), tokens


def one_round(send, url: str, batch: list[str], max_new: int, concurrency: int) -> tuple[list[float], int, float]:
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: send(url, p, max_new), batch))
    return [r[0] for r in results], sum(r[1] for r in results), time.perf_counter() - t0


def cpu_s(procs: list[psutil.Process]) -> float:
    return sum(t.user + t.system for t in (p.cpu_times() for p in procs))


def idle_cpu_rate(procs: list[psutil.Process], seconds: float) -> float:
    """CPU seconds per second these processes burn with no request in flight."""
    before, t0 = cpu_s(procs), time.perf_counter()
    time.sleep(seconds)
    return (cpu_s(procs) - before) / (time.perf_counter() - t0)


def frontend_procs(server_pid: int) -> list[psutil.Process]:
    """A plain SGLang server's front end: the main process (HTTP, TokenizerManager) and its
    detokenizer (setproctitle ``sglang::detokenizer``); not the scheduler."""
    main = psutil.Process(server_pid)
    return [main] + [c for c in main.children(recursive=True) if "detokenizer" in " ".join(c.cmdline())]


def measure(name, send, urls: dict, front_ends: dict, idle_rates: dict, args, bar) -> dict:
    """``front_ends``: target -> the processes whose CPU is that target's front-end cost;
    ``idle_rates``: target -> their idle CPU rate (subtracted)."""
    stats = {k: {"ttft": [], "tokens": 0, "wall": 0.0, "cpu": 0.0, "idle": 0.0} for k in urls}
    batch = prompts(args.requests)
    for _ in range(args.rounds):
        for target, url in urls.items():  # alternate: drift hits both alike
            before = cpu_s(front_ends[target])
            ttfts, tokens, wall = one_round(send, url, batch, args.max_new_tokens, args.concurrency)
            s = stats[target]
            s["cpu"] += cpu_s(front_ends[target]) - before
            s["idle"] += idle_rates[target] * wall
            s["ttft"] += ttfts
            s["tokens"] += tokens
            s["wall"] += wall
            bar.update(1)
    out = {"api": name}
    for target, s in stats.items():
        ttft = sorted(s["ttft"])
        out[target] = {"ttft_median_ms": 1000 * statistics.median(ttft),
                       "ttft_p90_ms": 1000 * ttft[int(0.9 * (len(ttft) - 1))],
                       "tokens": s["tokens"], "tokens_per_s": s["tokens"] / s["wall"],
                       "front_end_cpu_s": s["cpu"], "front_end_idle_cpu_s": s["idle"],
                       "front_end_cpu_s_per_1k_tokens": front_end_cpu_per_1k(s["cpu"], s["idle"], s["tokens"])}
    r, d = out["router"], out["direct"]
    out["added_ttft_ms"] = r["ttft_median_ms"] - d["ttft_median_ms"]
    out["ttft_ratio"] = r["ttft_median_ms"] / d["ttft_median_ms"]
    out["tokens_per_s_ratio"] = r["tokens_per_s"] / d["tokens_per_s"]
    rc, dc = r["front_end_cpu_s_per_1k_tokens"], d["front_end_cpu_s_per_1k_tokens"]
    out["cpu_ratio"] = rc / dc if rc is not None and dc is not None else None
    return out


def front_end_cpu_per_1k(cpu_s: float, idle_s: float, tokens: int) -> float | None:
    """CPU seconds per 1 000 tokens, less the idle share; None when too few clock ticks were
    measured for the subtraction to mean anything (one request gave a negative CPU)."""
    if not enough_cpu(cpu_s) or cpu_s <= idle_s or tokens <= 0:
        return None
    return 1000 * (cpu_s - idle_s) / tokens


def _fmt(value: float | None, width: int, digits: int) -> str:
    return f"{value:>{width}.{digits}f}" if value is not None else f"{'n/a':>{width}}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16, help="requests per round")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per target")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--out", default=str(REPO / "artifacts" / "bench_router_overhead"))
    ap.add_argument("--py-spy", default=None, help="write py-spy's collapsed stacks of the router here")
    args = ap.parse_args()
    model = default_model_path()
    run_dir = Path(tempfile.mkdtemp(prefix="bench-router-"))
    spec = ServerSpec("direct", None, free_port())
    with ProcessGroup(run_dir / "direct-logs") as direct, \
            LocalCluster(run_dir / "cluster", router_args=SERVING) as cluster:
        direct.start("direct", server_argv(spec, model) + SERVING, health_url=f"{spec.url}/health", env=CPU_ENV)
        direct.wait_healthy(timeout_s=600)
        router_pid = cluster.procs.procs["router"].popen.pid
        front_ends = {"direct": frontend_procs(direct.procs["direct"].popen.pid),
                      "router": [psutil.Process(router_pid)]}
        urls = {"direct": spec.url, "router": cluster.topology.router_url}
        for url in urls.values():  # warm both (first-request compile and cache effects)
            stream_generate(url, "warm up", 4)
        idle_rates = {target: idle_cpu_rate(procs, 20.0) for target, procs in front_ends.items()}  # 10 ms ticks: a long window
        spy = None
        if args.py_spy:
            spy = subprocess.Popen([str(Path(sys.executable).with_name("py-spy")), "record", "-p", str(router_pid),
                                    "-f", "raw", "-r", "250", "-o", args.py_spy], stdout=subprocess.DEVNULL)
        results = []
        with tqdm(total=2 * 2 * args.rounds, desc="rounds", file=sys.stderr) as bar:
            for name, send in (("/generate", stream_generate), ("/v1/chat/completions", stream_chat)):
                results.append(measure(name, send, urls, front_ends, idle_rates, args, bar))
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=60)
    print(f"\nrouter overhead: {args.requests} requests x {args.rounds} rounds per target, concurrency "
          f"{args.concurrency}, {args.max_new_tokens} tokens each (greedy, streaming)\n")
    print(f"{'api':<22}{'TTFT direct':>13}{'TTFT router':>13}{'added':>11}{'ratio':>7}"
          f"{'tok/s direct':>14}{'tok/s router':>14}{'ratio':>7}{'front-end CPU s/1k tok direct':>31}"
          f"{'router':>8}{'ratio':>7}")
    for r in results:
        d, rt = r["direct"], r["router"]
        print(f"{r['api']:<22}{d['ttft_median_ms']:>10.1f} ms{rt['ttft_median_ms']:>10.1f} ms"
              f"{r['added_ttft_ms']:>8.1f} ms{r['ttft_ratio']:>7.2f}{d['tokens_per_s']:>14.1f}"
              f"{rt['tokens_per_s']:>14.1f}{r['tokens_per_s_ratio']:>7.2f}"
              f"{_fmt(d['front_end_cpu_s_per_1k_tokens'], 31, 3)}{_fmt(rt['front_end_cpu_s_per_1k_tokens'], 8, 3)}"
              f"{_fmt(r['cpu_ratio'], 7, 2)}")
    if any(r["cpu_ratio"] is None for r in results):
        print(f"front-end CPU n/a: fewer than {MIN_CPU_TICKS} CPU ticks ({MIN_CPU_TICKS * CPU_TICK_S:.1f} s) measured, "
              f"or no more than the idle rate: too few for the idle subtraction; raise --requests, --rounds or "
              f"--max-new-tokens")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print("idle front-end CPU (subtracted): " + ", ".join(f"{t} {r:.3f} CPU s/s" for t, r in idle_rates.items()))
    (out / "results.json").write_text(json.dumps({"args": vars(args), "idle_cpu_rates": idle_rates,
                                                  "results": results}, indent=2))
    print(f"\nwrote {out / 'results.json'}")


if __name__ == "__main__":
    main()
