"""How fast is the simulator? Prints requests simulated per CPU second (one core).

CPU time (time.process_time), not wall clock: on a shared machine wall time measures the
neighbours too.

    python -m benchmarks.bench_sim_speed --n 100000
    python -m benchmarks.bench_sim_speed --n 100000 --model deepseek-v3 --prefill 4 --md 1
"""

import argparse
import resource
import time

from sglang_pdd.sim.cluster import Simulation
from sglang_pdd.sim.hardware import preset
from sglang_pdd.sim.scenarios import ClusterSpec, standard_scenarios
from sglang_pdd.workload import generate_agentic_trace, realistic_agentic_config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--scenario", default="pdd_drc_adaptive")
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
    cfg = {c.name: c for c in standard_scenarios(spec)}[a.scenario]
    # The trace is generated lazily inside the run, as a user streaming a big trace would.
    trace = generate_agentic_trace(realistic_agentic_config(num_requests=a.n))
    sim = Simulation(cfg)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    s = sim.run(trace)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{a.scenario}: {s.requests} requests, {sim.loop.events_run} events in {cpu:.1f} CPU s "
          f"-> {s.requests / cpu:,.0f} requests simulated per CPU second (trace generation included; "
          f"wall {wall:.1f} s); peak RSS {rss_mb:.0f} MB; SLA {s.sla_attainment:.1%}")


if __name__ == "__main__":
    main()
