"""How fast is the simulator? Prints requests simulated per second (one core).

    PYTHONPATH=. python benchmarks/bench_sim_speed.py --n 100000
"""

import argparse
import resource
import time

from sglang_pdd.sim.cluster import Simulation
from sglang_pdd.sim.scenarios import ClusterSpec, standard_scenarios
from sglang_pdd.workload import AgenticTraceConfig, generate_agentic_trace


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--scenario", default="pdd_drc_adaptive")
    ap.add_argument("--session-rate", type=float, default=0.5)
    a = ap.parse_args()
    cfg = {c.name: c for c in standard_scenarios(ClusterSpec())}[a.scenario]
    # The trace is generated lazily inside the run, as a user streaming a big trace would.
    trace = generate_agentic_trace(AgenticTraceConfig(num_requests=a.n, session_rate_per_s=a.session_rate))
    sim = Simulation(cfg)
    t0 = time.perf_counter()
    s = sim.run(trace)
    dt = time.perf_counter() - t0
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{a.scenario}: {s.requests} requests, {sim.loop.events_run} events in {dt:.1f} s "
          f"-> {s.requests / dt:,.0f} requests simulated/s (trace generation included); "
          f"peak RSS {rss_mb:.0f} MB; SLA {s.sla_attainment:.1%}")


if __name__ == "__main__":
    main()
