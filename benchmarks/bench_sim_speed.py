"""How fast is the simulator? Requests (and prompt blocks) simulated per CPU second, one core.

CPU time (time.process_time), not wall clock: on a shared machine wall time measures the
neighbours too. Identical runs on the shared 2-core machine still vary by +-10-15%, so
compare versions alternated in one session, several runs each.

    python -m benchmarks.bench_sim_speed --n 50000                      # the synthetic agentic trace
    python -m benchmarks.bench_sim_speed --trace mooncake               # the public trace (3,993 requests)
    python -m benchmarks.bench_sim_speed --designs all --arrivals open  # every design, the older replay
    python -m benchmarks.bench_sim_speed --n 50000 --model deepseek-v3 --prefill 4 --md 1

`--designs` defaults to the one PDD design on the default fleet (the number the notebook
tracks); `all` runs the four designs `sim size` compares, one row each. Arrivals default to
sessions, as every `sim` command does. The synthetic trace's prompts are ~49 blocks of 512
tokens, the Mooncake trace's ~31, and the caches' work grows with blocks, so blocks per CPU
second are printed beside requests.
"""

import argparse
import resource
import time

from benchmarks.common import MOONCAKE_TRACE, require_trace

from sglang_pdd.sim.cluster import ARRIVALS, Simulation
from sglang_pdd.sim.hardware import preset
from sglang_pdd.sim.scenarios import BASELINES, ClusterSpec, standard_scenarios
from sglang_pdd.sim.workload import generate_agentic_trace, load_trace, realistic_agentic_config

PDD = "pdd_drc_adaptive"


def _counting_blocks(trace, total: list):
    for r in trace:
        total[0] += len(r.hash_ids)
        yield r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100_000, help="requests of the synthetic trace")
    ap.add_argument("--trace", default="synthetic",
                    help="'synthetic' (the realistic agentic generator, --n requests), 'mooncake' "
                         f"({MOONCAKE_TRACE}), or a JSONL trace's path")
    ap.add_argument("--arrivals", default="sessions", choices=ARRIVALS)
    ap.add_argument("--designs", default=PDD, help="a design name, comma-separated names, or 'all' "
                                                   "(same-DC PD, both cross-DC PD, PDD)")
    ap.add_argument("--prefill", type=int, default=8)
    ap.add_argument("--rld", type=int, default=1)
    ap.add_argument("--md", type=int, default=3)
    ap.add_argument("--model", default=None, choices=("llama3-70b", "deepseek-v3"),
                    help="presets (P and RLD on H200 for deepseek-v3, H100 for llama3-70b; MD on H20); "
                         "default: ClusterSpec's (Llama-3-70B on H100 / H20)")
    a = ap.parse_args()
    spec = ClusterSpec(n_prefill=a.prefill, n_rld=a.rld, n_md=a.md)
    if a.model:
        chip_a = "h200" if a.model == "deepseek-v3" else "h100"
        spec = ClusterSpec(n_prefill=a.prefill, n_rld=a.rld, n_md=a.md, chip_a=preset(a.model, chip_a),
                           chip_b=preset(a.model, "h20"))
    designs = {c.name: c for c in standard_scenarios(spec)}
    names = list(BASELINES) + [PDD] if a.designs == "all" else a.designs.split(",")
    for name in names:
        cfg = designs[name]
        if a.trace == "synthetic":
            # Generated lazily inside the run, as a user streaming a big trace would (with
            # sessions the run lists it first, to find each session's next turn).
            trace = generate_agentic_trace(realistic_agentic_config(num_requests=a.n))
        else:
            trace = load_trace(require_trace(MOONCAKE_TRACE if a.trace == "mooncake" else a.trace))
        counted = [0]
        trace = _counting_blocks(trace, counted)
        sim = Simulation(cfg)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        s = sim.run(trace, a.arrivals)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        blocks = counted[0]
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"{name}: {s.requests} requests ({blocks / s.requests:.0f} blocks each), {sim.loop.events_run} events "
              f"in {cpu:.1f} CPU s -> {s.requests / cpu:,.0f} requests simulated per CPU second, "
              f"{blocks / cpu:,.0f} blocks (trace reading included; wall {wall:.1f} s); peak RSS {rss_mb:.0f} MB; "
              f"SLA {s.sla_attainment:.1%} ({a.arrivals})", flush=True)


if __name__ == "__main__":
    main()
