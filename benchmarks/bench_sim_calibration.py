"""The simulator against the real cluster: TTFT, TPOT and handoff stall, measured and predicted.

One LocalCluster (real SGLang P + RLD + MD on the tiny model, the WAN emulator, the router):

1. measure a HardwareProfile of the tiny model on this CPU with benchmarks/calibrate_profile.py's
   functions, over HTTP on MD (a plain SGLang server; P and RLD are PD servers that take no
   direct /generate, and all three run the same model on the same CPU);
2. measure the serial service rate (requests one at a time through the router), the load unit;
3. at each offered load (a fraction of that rate) send an open-loop Poisson workload through
   the router (fixed seed; half the prompts start with a shared 512-token block, so MD's and
   P's prefix caches hit as the sim's 512-token blocks do) and read each request's TTFT, TPOT
   and handoff stall from the router's ``request {...}`` log line;
4. run the simulator (pdd, 1 P + 1 RLD + 1 MD, the measured profile on every instance, the
   emulated WAN's rate and latency, the router's path-policy settings) on the same requests:
   the same send times, prompt and output lengths, and prefix blocks;
5. print measured vs simulated per load and metric with the error sim/measured - 1, and write
   calibration.json and calibration.png under --out.

    .venv/bin/python -m benchmarks.bench_sim_calibration            # ~6 min on 2 cores
    .venv/bin/python -m benchmarks.bench_sim_calibration --n 10 --loads 0.5   # smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
from tqdm import tqdm

from benchmarks.common import greedy
from sglang_pdd.sim.hardware import check_profile
from sglang_pdd.sim.workload import BLOCK_TOKENS, TraceRequest

VOCAB = 1024
FIRST_TOKEN_ID = 3  # 0..2 are bos / eos / pad in the tiny model
SHARED_HASH_ID = 0  # the shared block's id in the sim's trace; unique blocks count from 1
METRICS = ("ttft_p50", "ttft_p90", "tpot_p50", "stall_p50")


# ----------------------------------------------------------------------------- workload
@dataclass(frozen=True)
class WorkloadSpec:
    n: int = 40
    unique_tokens: tuple = (128, 768)  # the part of a prompt no other request has
    output_tokens: tuple = (32, 96)
    shared_fraction: float = 0.5  # requests whose prompt starts with the shared block
    seed: int = 0


@dataclass(frozen=True)
class CalRequest:
    index: int
    arrival_s: float  # planned send time, from the first request
    unique_tokens: int
    output_tokens: int
    shared_prefix: bool

    @property
    def prompt_tokens(self) -> int:
        return self.unique_tokens + (BLOCK_TOKENS if self.shared_prefix else 0)


def build_workload(spec: WorkloadSpec, rate_rps: float) -> list[CalRequest]:
    """Poisson arrivals at ``rate_rps``; the lengths depend on the seed only, so every load
    replays the same request mix and only the arrival rate differs."""
    if rate_rps <= 0:
        raise ValueError("rate must be > 0")
    shapes = random.Random(spec.seed)
    gaps = random.Random(spec.seed + 1)
    out, t = [], 0.0
    for i in range(spec.n):
        if i:
            t += gaps.expovariate(rate_rps)
        out.append(CalRequest(i, t, shapes.randint(*spec.unique_tokens), shapes.randint(*spec.output_tokens),
                              shapes.random() < spec.shared_fraction))
    return out


def prompt_ids(req: CalRequest, salt: str) -> list[int]:
    """Token ids: the shared block (the same for every request of one salt), then ids no other
    request has. A new salt per load keeps one load's prompts out of the next one's caches."""
    def ids(key: str, n: int) -> list[int]:
        rng = random.Random(f"{salt}|{key}")
        return [rng.randrange(FIRST_TOKEN_ID, VOCAB) for _ in range(n)]

    shared = ids("shared", BLOCK_TOKENS) if req.shared_prefix else []
    return shared + ids(str(req.index), req.unique_tokens)


def to_trace(requests: Iterable[CalRequest], sent_s: Optional[list[float]] = None) -> list[TraceRequest]:
    """The sim's trace of the same requests: arrivals at the actual send times (``sent_s``,
    else the planned ones), one hash id per 512-token block, the shared block's id shared."""
    trace = []
    for k, r in enumerate(requests):
        t = sent_s[k] if sent_s is not None else r.arrival_s
        blocks = math.ceil(r.prompt_tokens / BLOCK_TOKENS)
        first_unique = 1 + r.index * 1000
        ids = [first_unique + j for j in range(blocks)]
        if r.shared_prefix:
            ids[0] = SHARED_HASH_ID
        trace.append(TraceRequest(timestamp_ms=t * 1e3, input_length=r.prompt_tokens,
                                  output_length=r.output_tokens, hash_ids=tuple(ids)))
    return trace


# ----------------------------------------------------------------------------- metrics
@dataclass(frozen=True)
class RequestMetrics:
    path: str
    ttft_s: Optional[float]
    tpot_s: Optional[float]  # mean gap after the first token (None: one token)
    stall_s: Optional[float]  # handoff stall (None: no handoff)
    output_tokens: int


def parse_request_line(line: str) -> Optional[dict]:
    """The JSON of a router ``request {...}`` log line, else None."""
    marker = " request {"
    i = line.find(marker)
    if i < 0:
        return None
    try:
        return json.loads(line[i + len(" request "):])
    except json.JSONDecodeError:
        return None


def from_router_record(d: dict) -> RequestMetrics:
    """TPOT as the router's metrics define it: (e2e - ttft) / (tokens - 1), stall included."""
    out, ttft, e2e = d["output_tokens"], d.get("ttft_s"), d["e2e_s"]
    tpot = (e2e - ttft) / (out - 1) if ttft is not None and out > 1 else None
    stall = d.get("stall_s") if d.get("handoff_at") is not None else None
    return RequestMetrics(d.get("path") or "", ttft, tpot, stall, out)


def from_sim_log(log, path_names) -> list[RequestMetrics]:
    """The simulator's RequestLog as the same records (NaN: absent)."""
    def opt(x: float) -> Optional[float]:
        return None if math.isnan(x) else float(x)

    return [RequestMetrics(path_names[log.path[i]], opt(log.ttft[i]), opt(log.tpot[i]), opt(log.stall[i]),
                           int(log.output[i])) for i in range(len(log))]


def percentile(values: Iterable[Optional[float]], q: float) -> Optional[float]:
    vals = [v for v in values if v is not None]
    return float(np.percentile(vals, q)) if vals else None


def summarise(records: list[RequestMetrics]) -> dict:
    """One side's metrics; the stall over the requests that handed off only."""
    paths: dict = {}
    for r in records:
        paths[r.path] = paths.get(r.path, 0) + 1
    return {"n": len(records), "paths": paths, "handoffs": sum(r.stall_s is not None for r in records),
            "ttft_p50": percentile((r.ttft_s for r in records), 50),
            "ttft_p90": percentile((r.ttft_s for r in records), 90),
            "tpot_p50": percentile((r.tpot_s for r in records), 50),
            "stall_p50": percentile((r.stall_s for r in records), 50)}


@dataclass(frozen=True)
class Row:
    load: str
    metric: str
    measured: Optional[float]
    sim: Optional[float]
    error: Optional[float]  # sim / measured - 1


def relative_error(measured: Optional[float], sim: Optional[float]) -> Optional[float]:
    if measured is None or sim is None or measured <= 0:
        return None
    return sim / measured - 1.0


def error_rows(load: str, measured: dict, sim: dict) -> list[Row]:
    return [Row(load, m, measured.get(m), sim.get(m), relative_error(measured.get(m), sim.get(m)))
            for m in METRICS]


def format_table(rows: list[Row]) -> str:
    def ms(v):
        return "-" if v is None else f"{v * 1e3:.1f}"

    lines = [f"{'load':>16s} {'metric':>10s} {'measured ms':>12s} {'sim ms':>10s} {'error':>8s}"]
    for r in rows:
        err = "-" if r.error is None else f"{r.error:+.0%}"
        lines.append(f"{r.load:>16s} {r.metric:>10s} {ms(r.measured):>12s} {ms(r.sim):>10s} {err:>8s}")
    return "\n".join(lines)


def markdown_table(rows: list[Row]) -> str:
    def ms(v):
        return "-" if v is None else f"{v * 1e3:.0f}"

    out = ["| load | metric | measured ms | sim ms | sim/measured - 1 |", "|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r.load} | {r.metric} | {ms(r.measured)} | {ms(r.sim)} | "
                   f"{'-' if r.error is None else f'{r.error:+.0%}'} |")
    return "\n".join(out)


# ----------------------------------------------------------------------------- simulator
def sim_config(profile, wan_gbps: float, wan_latency_ms: float, router_rld_max_running: Optional[int] = None,
               rld_batch_cap: int = 16):
    """PDD as the local cluster runs it: 1 P + 1 RLD + 1 MD on one profile, the emulated WAN,
    and the router's path policy (page size 1, the measured KV bytes per token). RLD decodes
    at most ``rld_batch_cap`` at once (the launcher's servers run --max-running-requests 16);
    the router counts RLD full at ``router_rld_max_running`` flows (its --rld-max-running,
    the router's default unless given)."""
    from sglang_pdd.handoff.policy import HandoffConfig
    from sglang_pdd.router.policy import RLD_MAX_RUNNING_DEFAULT, PathPolicyConfig
    from sglang_pdd.sim.cluster import ScenarioConfig
    from sglang_pdd.sim.hardware import WAN_DEFAULT

    wan = replace(WAN_DEFAULT, gbps=wan_gbps, one_way_latency_s=wan_latency_ms / 1e3, jitter_s=0.0)
    router = PathPolicyConfig(wan_gbps=wan_gbps, wan_rtt_ms=2 * wan_latency_ms,
                              kv_bytes_per_token=profile.kv_bytes_per_token, page_size=1)
    rld = replace(profile, max_running_requests=rld_batch_cap)
    return ScenarioConfig(name="pdd_local", kind="pdd", n_prefill=1, n_rld=1, n_md=1, prefill_hw=profile,
                          rld_hw=rld, md_hw=profile, wan=wan, drc=True, handoff=HandoffConfig(), router=router,
                          rld_max_running=router_rld_max_running or RLD_MAX_RUNNING_DEFAULT)


def simulate(cfg, trace: list[TraceRequest]) -> list[RequestMetrics]:
    from sglang_pdd.sim.cluster import PATH_NAMES, Simulation

    sim = Simulation(cfg)
    sim.run(trace)
    return from_sim_log(sim.log, PATH_NAMES)


# ----------------------------------------------------------------------------- cluster I/O
class RouterLog:
    """The router's request lines written since ``mark()``."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0

    def mark(self) -> None:
        self.offset = self.path.stat().st_size

    def records(self) -> list[dict]:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            text = f.read().decode(errors="replace")
        return [d for d in map(parse_request_line, text.splitlines()) if d is not None]


def wait_for_records(log: RouterLog, n: int, timeout_s: float = 30.0) -> list[dict]:
    """The router logs a request after its reply is sent: give the last ones a moment."""
    deadline = time.time() + timeout_s
    recs = log.records()
    while len(recs) < n and time.time() < deadline:
        time.sleep(0.2)
        recs = log.records()
    return recs


def send(router_url: str, ids: list[int], output_tokens: int, timeout_s: float) -> Optional[str]:
    from sglang_pdd.launcher.http import post_json

    try:
        reply = post_json(f"{router_url}/generate", {"input_ids": ids, "sampling_params": greedy(output_tokens)},
                          timeout=timeout_s)
    except Exception as e:  # one failed request is reported, the run goes on
        return repr(e)
    got = len(reply.get("output_ids") or [])
    return None if got == output_tokens else f"{got} tokens, asked {output_tokens}"


def drive_open_loop(router_url: str, requests: list[CalRequest], salt: str, timeout_s: float,
                    desc: str) -> tuple[list[float], list[Optional[str]]]:
    """Send each request at its planned time whatever the others do (open loop); returns the
    actual send times (from the first) and each request's error (None: ok)."""
    sent: list[float] = [0.0] * len(requests)
    errors: list[Optional[str]] = [None] * len(requests)
    bar = tqdm(total=len(requests), desc=desc, unit="req", file=sys.stderr)
    lock = threading.Lock()
    t0 = time.perf_counter()

    def one(k: int, r: CalRequest) -> None:
        ids = prompt_ids(r, salt)  # built before the wait: no client work at send time
        time.sleep(max(0.0, t0 + r.arrival_s - time.perf_counter()))
        sent[k] = time.perf_counter() - t0
        errors[k] = send(router_url, ids, r.output_tokens, timeout_s)
        with lock:
            bar.update(1)

    with ThreadPoolExecutor(len(requests)) as pool:
        for f in [pool.submit(one, k, r) for k, r in enumerate(requests)]:
            f.result()
    bar.close()
    return sent, errors


def serial_rate(router_url: str, spec: WorkloadSpec, n: int = 4) -> float:
    """Requests per second one at a time (the mean shape of the workload): the load unit."""
    shape = WorkloadSpec(n=n, unique_tokens=spec.unique_tokens, output_tokens=spec.output_tokens,
                         shared_fraction=0.0, seed=spec.seed + 7)
    for r in build_workload(shape, 1.0)[:2]:  # warm-up: the first requests pay one-off costs
        send(router_url, prompt_ids(r, "warmup"), r.output_tokens, 120)
    t0 = time.perf_counter()
    for r in build_workload(shape, 1.0):
        err = send(router_url, prompt_ids(r, "serial"), r.output_tokens, 120)
        if err:
            raise RuntimeError(f"serial request failed: {err}")
    return n / (time.perf_counter() - t0)


def min_steps(runs: Iterable[list]) -> list:
    """Per batch size, the fastest of several decode runs (batch, kv, step): the other jobs on a
    shared CPU only ever add time, as calibrate_profile's prefill takes the minimum too."""
    best: dict = {}
    for run in runs:
        for b, kv, step in run:
            if b not in best or step < best[b][2]:
                best[b] = (b, kv, step)
    return [best[b] for b in sorted(best)]


def kv_bytes_of_model(model_dir: str, kv_dtype: str = "auto") -> int:
    """KV bytes per token from the model's config.json (the server's /get_model_info carries no
    layer and head counts). ``auto``: SGLang serves a float32 checkpoint in 16 bits (the MD log
    says ``KV Cache is allocated. dtype: torch.float16``), so 2 bytes."""
    from benchmarks import calibrate_profile as cp

    hf = json.loads((Path(model_dir) / "config.json").read_text())
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    dtype = "bfloat16" if kv_dtype == "auto" else kv_dtype
    return cp.kv_bytes_per_token(hf["num_hidden_layers"], hf.get("num_key_value_heads", heads), head_dim, dtype)


def measure_profile(url: str, name: str, model_dir: str):
    """calibrate_profile's measurement, sized for the tiny model and a few CPU minutes."""
    from benchmarks import calibrate_profile as cp
    from sglang_pdd.launcher.http import get_json

    rng = random.Random(0)
    info = get_json(f"{url}/get_server_info", timeout=60)
    kvb = kv_bytes_of_model(model_dir, str(info.get("kv_cache_dtype") or "auto"))
    # A server started with --skip-server-warmup pays its one-off costs (lazy initialisation,
    # first kernels at each shape) on its first requests: measured cold, a decode step came
    # out at 140 ms instead of ~15. One discarded round first.
    cp.measure_prefill(url, [64, 1536], VOCAB, rng, repeats=1)
    cp.measure_decode(url, [1, 8], 256, 8, VOCAB, rng)
    pre = cp.measure_prefill(url, [64, 256, 1024, 1536], VOCAB, rng, repeats=3)
    runs = [cp.measure_decode(url, [1, 2, 4, 8], 256, 32, VOCAB, rng) for _ in range(3)]
    dec = min_steps(runs)
    capacity = int(info.get("max_total_num_tokens", 0)) or 65536
    prof = cp.build_profile(name, 1, 1.0, kvb, capacity, int(info.get("max_running_requests") or 16),
                            cp.fit_prefill(pre), cp.fit_decode_step(dec))
    return prof, {"prefill": pre, "decode": dec, "decode_runs": runs}


def profile_warnings(profile, samples: dict) -> list[str]:
    """The sim's plausibility check on the measured profile, with every repeated sample."""
    decode = [s for run in samples.get("decode_runs", [samples.get("decode", [])]) for s in run]
    return check_profile(profile, decode, samples.get("prefill", []), source="measured")


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ----------------------------------------------------------------------------- report
def plot(rows: list[Row], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = list(dict.fromkeys(r.load for r in rows))
    fig, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 3.6))
    x = np.arange(len(loads))
    for ax, metric in zip(axes, METRICS):
        got = {r.load: r for r in rows if r.metric == metric}
        meas = [(got[l].measured or 0) * 1e3 for l in loads]
        sim = [(got[l].sim or 0) * 1e3 for l in loads]
        ax.bar(x - 0.2, meas, 0.4, label="measured")
        ax.bar(x + 0.2, sim, 0.4, label="sim")
        for i, l in enumerate(loads):
            if got[l].error is not None:
                ax.annotate(f"{got[l].error:+.0%}", (i, max(meas[i], sim[i])), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(x, loads, fontsize=8)
        ax.set_title(metric)
        ax.set_ylabel("ms")
    axes[0].legend()
    fig.suptitle("simulator vs real cluster (tiny model, CPU)")
    fig.tight_layout()
    path = out / "calibration.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=40, help="requests per load")
    ap.add_argument("--loads", default="0.3,0.6,0.9", help="offered loads, as fractions of the serial rate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wan-gbps", type=float, default=0.004,
                    help="emulated link (0.004: the tiny model's KV takes ~1-2 ms a token, so RLD streams "
                         "eager tokens before the handoff)")
    ap.add_argument("--wan-latency-ms", type=float, default=20.0, help="one way")
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--out", default="artifacts/bench_sim_calibration")
    return ap.parse_args(argv)


def run_load(cluster, log: RouterLog, spec: WorkloadSpec, frac: float, rate: float, cfg, timeout_s: float) -> dict:
    requests = build_workload(spec, rate)
    label = f"{frac:.0%} ({rate:.2f} r/s)"
    load_before = load_average()
    log.mark()
    sent, errors = drive_open_loop(cluster.topology.router_url, requests, f"load{frac}-{spec.seed}", timeout_s, label)
    raw = wait_for_records(log, sum(e is None for e in errors))
    measured = [from_router_record(d) for d in raw]
    simulated = simulate(cfg, to_trace(requests, sent))
    return {"label": label, "fraction": frac, "rate_rps": rate, "load_average_before": load_before,
            "load_average_after": load_average(), "errors": [e for e in errors if e],
            "measured": summarise(measured), "sim": summarise(simulated),
            "measured_records": [asdict(r) for r in measured]}


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from sglang_pdd.launcher.cluster import LocalCluster
    from sglang_pdd.launcher.topology import Topology

    topology = Topology.on_free_ports()
    topology.wan.rate_gbps, topology.wan.latency_ms = args.wan_gbps, args.wan_latency_ms
    spec = WorkloadSpec(n=args.n, seed=args.seed)
    res = {"args": vars(args), "workload": asdict(spec), "cpus": os.cpu_count(), "load_average_start": load_average(),
           "loads": []}
    print(f"load average at start: {res['load_average_start']} on {os.cpu_count()} CPUs", file=sys.stderr)
    t_start = time.time()
    router_args = ["--health-check-interval-s", "0",  # no probe requests in the measured windows
                   "--wan-timeout-s", "30"]
    with LocalCluster(out / "cluster", topology=topology, router_args=router_args) as cluster:
        profile, samples = measure_profile(topology.main.url, "tiny-llama-cpu", cluster.model_path)
        res["profile"], res["profile_samples"] = asdict(profile), samples
        res["profile_warnings"] = profile_warnings(profile, samples)  # also printed, as warnings
        # The router's path estimate must use the real KV size (its default is a large model's).
        cluster.restart_router(router_args + ["--kv-bytes-per-token", str(profile.kv_bytes_per_token)])
        rate1 = serial_rate(topology.router_url, spec)
        res["serial_rate_rps"] = rate1
        print(f"profile: prefill {profile.prefill_overhead_s * 1e3:.1f} ms + {profile.prefill_s_per_token * 1e6:.1f} "
              f"us/token; decode step {profile.decode_step_overhead_s * 1e3:.1f} ms + "
              f"{profile.decode_step_s_per_seq * 1e3:.2f} ms/seq; KV {profile.kv_bytes_per_token} B/token; "
              f"serial rate {rate1:.2f} r/s; samples {samples}", file=sys.stderr)
        cfg = sim_config(profile, args.wan_gbps, args.wan_latency_ms)
        log = RouterLog(out / "cluster" / "logs" / "router.log")
        for frac in (float(x) for x in args.loads.split(",")):
            res["loads"].append(run_load(cluster, log, spec, frac, frac * rate1, cfg, args.request_timeout))
    res["wall_s"] = time.time() - t_start
    rows = [row for ld in res["loads"] for row in error_rows(ld["label"], ld["measured"], ld["sim"])]
    res["table"] = [asdict(r) for r in rows]
    (out / "calibration.json").write_text(json.dumps(res, indent=2))
    print(format_table(rows))
    for ld in res["loads"]:
        m, s = ld["measured"], ld["sim"]
        print(f"{ld['label']}: measured paths {m['paths']} handoffs {m['handoffs']}; sim paths {s['paths']} handoffs "
              f"{s['handoffs']}; errors {len(ld['errors'])}; load average {ld['load_average_before']} -> "
              f"{ld['load_average_after']}")
    print(f"\n{markdown_table(rows)}\n")
    print(f"wall {res['wall_s']:.0f} s; wrote {out / 'calibration.json'}, {plot(rows, out)}")
    return 1 if any(ld["errors"] for ld in res["loads"]) else 0


if __name__ == "__main__":
    sys.exit(main())
