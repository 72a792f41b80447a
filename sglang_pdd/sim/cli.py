"""Command line: `python -m sglang_pdd.sim {compare,size,bathtub,gen-trace} ...`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace
from typing import List, Optional

from tqdm import tqdm

from sglang_pdd.workload import BLOCK_TOKENS, AgenticTraceConfig, TraceRequest, generate_agentic_trace, load_trace, save_trace

from .bathtub import sweep
from .cluster import run_scenario
from .hardware import CHIP_A, CHIP_B, WAN_DEFAULT, HardwareProfile
from .metrics import Sla
from .plots import plot_bathtub, plot_comparison
from .report import format_table
from .scenarios import ClusterSpec, standard_scenarios
from .sizing import size_cluster


def _add_common(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", help="JSONL trace (timestamp, input_length, output_length, hash_ids)")
    src.add_argument("--agentic", type=int, metavar="N", help="generate N synthetic agentic requests")
    p.add_argument("--agentic-session-rate", type=float, default=0.5, help="new sessions per second")
    p.add_argument("--limit", type=int, help="use only the first N requests of --trace")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill", type=int, default=4)
    p.add_argument("--rld", type=int, default=1)
    p.add_argument("--md", type=int, default=3)
    p.add_argument("--profile-a", help="JSON hardware profile for datacenter A (P, RLD, PD's D)")
    p.add_argument("--profile-b", help="JSON hardware profile for datacenter B (MD)")
    p.add_argument("--wan-gbps", type=float, default=WAN_DEFAULT.gbps)
    p.add_argument("--wan-latency-ms", type=float, default=WAN_DEFAULT.one_way_latency_s * 1e3, help="one way")
    p.add_argument("--wan-jitter-ms", type=float, default=WAN_DEFAULT.jitter_s * 1e3)
    p.add_argument("--catch-up-threshold", type=int, default=64)
    p.add_argument("--ttft-slo", type=float, default=Sla().ttft_s, help="seconds")
    p.add_argument("--tpot-slo", type=float, default=Sla().tpot_s, help="seconds")
    p.add_argument("--out", default="artifacts/sim", help="output directory for PNG/JSON")


def _spec(a) -> ClusterSpec:
    chip_a = HardwareProfile.load(a.profile_a) if a.profile_a else CHIP_A
    chip_b = HardwareProfile.load(a.profile_b) if a.profile_b else CHIP_B
    wan = replace(WAN_DEFAULT, gbps=a.wan_gbps, one_way_latency_s=a.wan_latency_ms / 1e3,
                  jitter_s=a.wan_jitter_ms / 1e3)
    return ClusterSpec(n_prefill=a.prefill, n_rld=a.rld, n_md=a.md, chip_a=chip_a, chip_b=chip_b, wan=wan,
                       catch_up_threshold_tokens=a.catch_up_threshold, seed=a.seed)


def _trace(a) -> (str, List[TraceRequest]):
    if a.trace:
        return os.path.basename(a.trace), list(load_trace(a.trace, a.limit))
    n = a.agentic or 5000
    cfg = AgenticTraceConfig(num_requests=n, seed=a.seed, session_rate_per_s=a.agentic_session_rate)
    return f"agentic{n}", list(generate_agentic_trace(cfg))


def cmd_compare(a) -> int:
    label, trace = _trace(a)
    sla = Sla(a.ttft_slo, a.tpot_slo)
    scenarios = standard_scenarios(_spec(a))
    summaries = [run_scenario(cfg, trace, sla) for cfg in tqdm(scenarios, desc=f"simulating {label}", file=sys.stderr)]
    print(f"# {label}: {len(trace)} requests, SLA TTFT <= {sla.ttft_s}s, TPOT <= {sla.tpot_s * 1e3:.0f}ms")
    print(format_table(summaries))
    os.makedirs(a.out, exist_ok=True)
    png = plot_comparison(summaries, f"{label} ({len(trace)} requests)", os.path.join(a.out, f"compare_{label}.png"))
    with open(os.path.join(a.out, f"compare_{label}.json"), "w") as f:
        json.dump([asdict(s) for s in summaries], f, indent=1)
    print(f"wrote {png}")
    return 0


def cmd_size(a) -> int:
    label, trace = _trace(a)
    sla = Sla(a.ttft_slo, a.tpot_slo)
    by_name = {c.name: c for c in standard_scenarios(_spec(a))}
    base = by_name[a.scenario]
    lo_p, hi_p = (int(x) for x in a.prefill_range.split(":"))
    lo_r, hi_r = (int(x) for x in a.rld_range.split(":"))
    bar = tqdm(desc=f"sizing {a.scenario}", unit="sim", file=sys.stderr)
    best = size_cluster(base, trace, sla, a.target, range(lo_p, hi_p + 1), range(lo_r, hi_r + 1), a.md_max,
                        progress=lambda: bar.update())
    bar.close()
    if best is None:
        print(f"no mix within the ranges reaches {a.target:.0%} SLA attainment")
        return 1
    print(f"cheapest {a.scenario} meeting {a.target:.0%} SLA on {label}: prefill={best.n_prefill} "
          f"rld={best.n_rld} md/d={best.n_md} at ${best.cost_per_hour:.0f}/h")
    print(format_table([best.summary]))
    return 0


def cmd_bathtub(a) -> int:
    sla = Sla(a.ttft_slo, a.tpot_slo)
    names = a.scenarios.split(",")
    scenarios = [c for c in standard_scenarios(_spec(a)) if c.name in names]
    hits = [float(h) for h in a.hits.split(",")]
    bar = tqdm(total=len(hits) * len(scenarios), desc="bathtub", file=sys.stderr)
    points = sweep(scenarios, hits, a.n, sla, sessions=a.sessions, input_tokens=a.input_tokens,
                   output_tokens=a.output_tokens, progress=lambda: bar.update())
    bar.close()
    print(f"# closed loop: {a.sessions} sessions, {a.input_tokens} input / {a.output_tokens} output tokens, "
          f"hits in whole {BLOCK_TOKENS}-token blocks")
    print(f"{'scenario':<20} {'hit':>5} {'P hit':>6} {'MD hit':>7} {'req/s':>7} {'good r/s':>8} "
          f"{'P busy':>6} {'WAN util':>8}")
    for p in points:
        print(f"{p.scenario:<20} {p.target_hit:>5.3f} {p.mean_p_hit:>6.3f} {p.mean_md_hit:>7.3f} "
              f"{p.throughput_rps:>7.2f} {p.goodput_rps:>8.2f} {p.prefill_util:>6.2f} {p.wan_util:>8.2f}")
    png = plot_bathtub(points, os.path.join(a.out, "bathtub.png"))
    print(f"wrote {png}")
    return 0


def cmd_gen_trace(a) -> int:
    cfg = AgenticTraceConfig(num_requests=a.n, seed=a.seed, session_rate_per_s=a.session_rate)
    n = save_trace(generate_agentic_trace(cfg), a.output)
    print(f"wrote {n} requests to {a.output}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_pdd.sim", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("compare", help="PD vs naive cross-DC vs PDD variants on one trace")
    _add_common(p)
    p.set_defaults(fn=cmd_compare)
    p = sub.add_parser("size", help="cheapest instance mix meeting an SLA-attainment target")
    _add_common(p)
    p.add_argument("--scenario", default="pdd_drc_adaptive")
    p.add_argument("--target", type=float, default=0.9, help="fraction of requests within the SLA")
    p.add_argument("--prefill-range", default="1:6")
    p.add_argument("--rld-range", default="0:2")
    p.add_argument("--md-max", type=int, default=8)
    p.set_defaults(fn=cmd_size)
    p = sub.add_parser("bathtub", help="throughput vs mean prefix hit rate")
    _add_common(p)
    p.add_argument("--hits", default="0,0.25,0.5,0.7,0.8,0.85,0.9,0.92,0.94,0.95,0.96,0.97,0.98,0.99,0.995",
                   help="target hit rates; realised hits round down to whole 512-token blocks")
    p.add_argument("--n", type=int, default=4000, help="requests per point (>= ~5x --sessions)")
    p.add_argument("--sessions", type=int, default=640,
                   help="closed-loop clients (each sends its next turn when the last one ended); "
                        "enough to fill the default cluster's decode slots")
    p.add_argument("--input-tokens", type=int, default=16_384)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--scenarios", default="pd_same_dc,naive_xdc,pdd_drc_adaptive")
    p.set_defaults(fn=cmd_bathtub)
    p = sub.add_parser("gen-trace", help="write a synthetic agentic trace as JSONL")
    p.add_argument("--n", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--session-rate", type=float, default=0.5)
    p.add_argument("--output", required=True)
    p.set_defaults(fn=cmd_gen_trace)
    a = ap.parse_args(argv)
    return a.fn(a)
