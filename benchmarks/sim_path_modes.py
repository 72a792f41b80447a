"""The router's two path modes side by side in the simulator, beside the PD baselines, over seeds.

    python -m benchmarks.sim_path_modes                      # both traces, 1x and 4x, seeds 0-2
    python -m benchmarks.sim_path_modes --quick              # one seed, 1x, the report-like trace only

On one fixed fleet (DeepSeek-V3, P and RLD on H200, MD on H20; --prefill/--rld/--md), per trace,
load (arrivals replayed --scales times faster) and seed: same-DC PD, cross-DC PD + DRC, and PDD
in `fit` mode (P->MD whatever fits the TTFT budget) and `relay_first` mode (an idle RLD takes
every request). Printed per row: the P->MD share, RLD's share of output tokens, SLA attainment,
TTFT p90, the handoff stall's p99, goodput, BCR; then fit's ratios to relay_first and to
cross-DC PD + DRC with their spread over seeds (a difference inside the spread is a tie).
Traces: the report-like agentic generator (sessions; `seed` draws the trace) and the public
Mooncake trace (no session ids: replayed open loop, whatever the seed). Results: JSON under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace

import numpy as np
from tqdm import tqdm

from benchmarks.common import MOONCAKE_TRACE, require_trace
from sglang_pdd.router.policy import PathMode
from sglang_pdd.sim.cluster import run_scenario
from sglang_pdd.sim.hardware import WAN_DEFAULT, preset
from sglang_pdd.sim.metrics import Sla
from sglang_pdd.sim.scenarios import ClusterSpec, standard_scenarios
from sglang_pdd.sim.workload import generate_agentic_trace, load_trace, report_agentic_config

PDD = "pdd_drc_adaptive"
ROWS = (("pd_same_dc", None), ("xdc_pd_drc", None), (PDD, PathMode.FIT), (PDD, PathMode.RELAY_FIRST))


def row_name(design: str, mode) -> str:
    return design if mode is None else f"pdd_{mode.value}"


def traces(names, n: int, seed: int):
    """(label, requests, arrivals) per trace name."""
    for name in names:
        if name == "agentic":
            yield name, list(generate_agentic_trace(report_agentic_config(num_requests=n, seed=seed))), "sessions"
        else:
            yield name, list(load_trace(require_trace(MOONCAKE_TRACE, None))), "open"  # no session ids: open loop


def run(args) -> list[dict]:
    spec = ClusterSpec(n_prefill=args.prefill, n_rld=args.rld, n_md=args.md, chip_a=preset("deepseek-v3", "h200"),
                       chip_b=preset("deepseek-v3", "h20"), wan=replace(WAN_DEFAULT, gbps=args.wan_gbps))
    sla = Sla()
    cells = [(s, sc) for s in args.seeds for sc in args.scales]
    out = []
    bar = tqdm(total=len(cells) * len(args.traces) * len(ROWS), desc="sim runs", file=sys.stderr)
    for seed, scale in cells:
        designs = {c.name: c for c in standard_scenarios(replace(spec, seed=seed))}
        for label, trace, arrivals in traces(args.traces, args.n, seed):
            for design, mode in ROWS:
                cfg = designs[design] if mode is None else replace(designs[design], path_mode=mode)
                s = run_scenario(cfg, trace, sla, rate_scale=scale, arrivals=arrivals)
                out.append(dict(trace=label, arrivals=arrivals, seed=seed, scale=scale, row=row_name(design, mode),
                                p_md_share=s.paths.get("p_md", 0) / s.requests if s.requests else 0.0,
                                summary=asdict(s)))
                bar.update()
    bar.close()
    return out


def print_table(results: list[dict]) -> None:
    print(f"{'trace':<9} {'load':>4} {'seed':>4} {'design':<18} {'P->MD':>6} {'RLD tok':>7} {'SLA':>6} "
          f"{'TTFT p90':>8} {'stall p99':>9} {'goodput':>8} {'BCR':>8}")
    for r in results:
        s = r["summary"]
        print(f"{r['trace']:<9} {r['scale']:>4g} {r['seed']:>4} {r['row']:<18} {100 * r['p_md_share']:>5.1f}% "
              f"{100 * s['rld_token_share']:>6.1f}% {100 * s['sla_attainment']:>5.1f}% {s['ttft_p90']:>7.2f}s "
              f"{s['stall_p99']:>8.2f}s {s['goodput_rps']:>7.2f}/s {s['bcr']:>8.1f}")
    print("\nfit vs relay_first and vs cross-DC PD + DRC, over seeds (mean [min, max]):")
    keys = sorted({(r["trace"], r["scale"]) for r in results})
    for trace, scale in keys:
        by = {}
        for r in results:
            if (r["trace"], r["scale"]) == (trace, scale):
                by.setdefault(r["seed"], {})[r["row"]] = r["summary"]
        for metric in ("goodput_rps", "bcr", "ttft_p90", "rld_token_share"):
            for base in ("pdd_relay_first", "xdc_pd_drc"):
                ratios = [row["pdd_fit"][metric] / row[base][metric] for row in by.values()
                          if row[base][metric] > 0 and np.isfinite(row[base][metric])]
                if ratios:
                    print(f"  {trace:<9} load {scale:g}: {metric:<16} fit / {base:<16} "
                          f"{np.mean(ratios):6.2f} [{min(ratios):.2f}, {max(ratios):.2f}]")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="seed 0, load 1x, the agentic trace only")
    ap.add_argument("--traces", nargs="+", choices=("agentic", "mooncake"), default=["agentic", "mooncake"])
    ap.add_argument("--n", type=int, default=3000, help="requests of the agentic trace")
    ap.add_argument("--scales", type=float, nargs="+", default=[1.0, 4.0], help="arrivals this many times faster")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--prefill", type=int, default=4)
    ap.add_argument("--rld", type=int, default=1)
    ap.add_argument("--md", type=int, default=2)
    ap.add_argument("--wan-gbps", type=float, default=20.0)
    ap.add_argument("--out", default="artifacts/sim_path_modes")
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.scales, args.traces = [0], [1.0], ["agentic"]
    results = run(args)
    print_table(results)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "sim_path_modes.json")
    with open(path, "w") as f:
        json.dump(dict(args=vars(args), results=results), f, indent=1)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
