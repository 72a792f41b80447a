"""``python -m sglang_pdd.chaos``: scenarios and a soak on the local cluster, a row each.

    python -m sglang_pdd.chaos --list
    python -m sglang_pdd.chaos --scenarios all                   # one scenario per fault kind
    python -m sglang_pdd.chaos --scenarios kill_md,wan_down --soak-minutes 10 \\
        --json runs/chaos/result.json --plot docs/img/chaos_soak.png

Datacenter B runs in a network namespace when this process may make one (root); else the
userspace WAN emulator stands in and the run says so. Exit status 0 only if every row passed
and nothing (process, namespace, veth) was left behind.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path

from sglang_pdd.chaos.spec import SCENARIOS, LoadSpec, Soak, prompt_pool, scenario


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m sglang_pdd.chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="list the scenarios and exit")
    ap.add_argument("--scenarios", "--scenario", default="all", help="comma-separated names, 'all', or 'none'")
    ap.add_argument("--soak-minutes", type=float, default=0.0, help="then a soak mixing every fault for this long")
    ap.add_argument("--rate", type=float, default=LoadSpec.rate_per_s, help="requests per second (Poisson)")
    ap.add_argument("--burst", type=int, default=0,
                    help="an overload burst: this many more requests at once, 8 s into each scenario's load")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wan-mbps", type=float, default=2.0, help="the link between the datacenters")
    ap.add_argument("--no-netns", action="store_true", help="the WAN emulator even where namespaces are possible")
    ap.add_argument("--reference-url", default=None,
                    help="a plain SGLang server in float32 to take reference outputs from (default: start one)")
    ap.add_argument("--run-dir", default="runs/chaos", help="logs and keys go here")
    ap.add_argument("--json", default=None, help="write the rows and fired faults here")
    ap.add_argument("--markdown", default=None, help="write the table here")
    ap.add_argument("--plot", default=None, help="the soak's timeline as a PNG")
    ap.add_argument("--router-arg", action="append", default=[], metavar="FLAG[=VALUE]",
                    help="one more router flag (repeat it), after the chaos cluster's own: e.g. "
                         "--router-arg=--md-first-token-timeout-s=0 to measure the router without that deadline")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        for name, sc in SCENARIOS.items():
            faults = ", ".join(f"{f.kind.value} after {f.after_s:g}s for {f.hold_s:g}s" for f in sc.faults)
            print(f"{name:16s} {faults or 'no fault'}")
        return 0
    names = list(SCENARIOS) if args.scenarios == "all" else [] if args.scenarios == "none" else \
        [n for n in args.scenarios.split(",") if n]
    load = LoadSpec(rate_per_s=args.rate, seed=args.seed, burst=args.burst)
    plans: list = [dataclasses.replace(sc, load=load) for sc in map(scenario, names)]
    if args.soak_minutes > 0:
        plans.append(Soak(args.soak_minutes * 60, args.seed, load))
    if not plans:
        raise SystemExit("nothing to run: name scenarios or give --soak-minutes")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")

    from sglang_pdd.chaos.checks import table
    from sglang_pdd.chaos.runner import ChaosCluster, reference_outputs, reference_server, run

    run_dir = Path(args.run_dir)
    pool = prompt_pool(load)
    with contextlib.ExitStack() as stack:
        from sglang_pdd.launcher.cluster import default_model_path

        url = args.reference_url or stack.enter_context(reference_server(run_dir, default_model_path()))
        references = reference_outputs(url, pool)  # the reference stops before the cluster starts
    outcomes = []
    with ChaosCluster(run_dir / "cluster", wan_mbps=args.wan_mbps, netns=not args.no_netns,
                      router_args=args.router_arg) as ctx:
        for plan in plans:
            outcome = run(ctx, plan, references)
            outcomes.append(outcome)
            print(table([outcome.row]).splitlines()[-1], flush=True)
            for line in outcome.problems():
                print(f"    {line}", flush=True)
            for leak in outcome.row.leaks:
                print(f"    leak: {leak}", flush=True)
            if outcome.row.gaps:
                print("    longest gap between tokens: " + ", ".join(
                    f"{kind} {s:.2f}s" for kind, s in sorted(outcome.row.gaps.items())), flush=True)
            for line in outcome.row.over_bound[:12]:
                print(f"    over the bound: {line}", flush=True)
        wan = ctx.injector.describe_wan()
    leftovers = ctx.leftovers()
    rows = [o.row for o in outcomes]
    print(f"\nWAN: {wan}\n{table(rows)}")
    print("left behind: " + ("; ".join(leftovers) if leftovers else "nothing (no process, namespace or veth)"))
    if args.markdown:
        Path(args.markdown).write_text(table(rows) + "\n")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "wan": wan, "leftovers": leftovers, "rate_per_s": args.rate, "seed": args.seed,
            "router_args": ctx.router_args,
            "rows": [{**asdict(o.row), "passed": o.row.passed, "seconds": round(o.seconds, 1),
                      "fired": [{"kind": f.kind.value, "started_s": round(f.started_s, 2),
                                 "recovered_s": round(f.recovered_s, 2)} for f in o.fired],
                      "requests": [{"index": r.index, "key": r.key, "sent_s": round(r.sent_s, 2),
                                    "ended_s": round(r.ended_s, 2), "status": r.status, "path": r.path,
                                    "fallbacks": list(r.fallbacks), "connect_retries": r.connect_retries,
                                    "message": r.message[:160], "longest_gap_s": round(r.longest_gap_s, 3),
                                    "gap_began_s": None if r.gap_began_s is None else round(r.gap_began_s, 2),
                                    "gap_after": r.gap_after, "handoff_at": r.handoff_at,
                                    "wan_ready_s": r.wan_ready_s} for r in o.records]} for o in outcomes]},
            indent=1))
    soaks = [o for o, plan in zip(outcomes, plans) if isinstance(plan, Soak)]
    if args.plot and soaks:
        from sglang_pdd.chaos.plot import timeline

        timeline(soaks[-1], Path(args.plot))
    return 0 if all(r.passed for r in rows) and not leftovers else 1
