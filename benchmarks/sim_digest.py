"""A digest of the simulator's results, to prove a speed change changes none of them.

Runs every design of sim/scenarios.standard_scenarios on both model presets with both
arrival modes (28 runs of a few thousand requests of the realistic agentic trace) and
prints, per run and over all, a hash of: the summary, every per-request log column, the
inter-token gap samples, the number of events run, and the final state of every LRU (P's
and MD's block caches, both tiers, and the router's prefix indexes, in LRU order). Run it
before and after a change: the last line must be identical.

    python -m benchmarks.sim_digest            # 3000 requests per run
    python -m benchmarks.sim_digest --n 1000   # quicker, weaker
"""

import argparse
import dataclasses
import hashlib
import time

from sglang_pdd.sim.cluster import ARRIVALS, Simulation
from sglang_pdd.sim.hardware import preset
from sglang_pdd.sim.scenarios import ClusterSpec, standard_scenarios
from sglang_pdd.sim.workload import generate_agentic_trace, realistic_agentic_config

MODELS = (("llama3-70b", "h100"), ("deepseek-v3", "h200"))


def run_digest(sim: Simulation, summary) -> str:
    h = hashlib.sha256()
    h.update(repr(dataclasses.asdict(summary)).encode())
    log = sim.log
    for col in (log.arrival, log.ttft, log.tpot, log.e2e, log.output, log.rld_tokens, log.path, log.stall,
                log.max_gap, log.gaps.values, log.gaps.weights):
        h.update(col.tobytes())
    h.update(repr(sim.loop.events_run).encode())
    for cache in sim.p_cache + sim.md_cache:
        blocks, host = cache.lru_order()
        h.update(repr((blocks, host, sorted(cache._pins.items()))).encode())
    for index in (sim.p_index, sim.md_index):
        h.update(repr(sorted(index.lru_orders().items())).encode())
        h.update(repr((index._records, index._evicted_blocks)).encode())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=3000, help="requests per run")
    a = ap.parse_args()
    total = hashlib.sha256()
    cpu0 = time.process_time()
    for model, chip in MODELS:
        spec = ClusterSpec(n_prefill=8, n_rld=1, n_md=3, chip_a=preset(model, chip), chip_b=preset(model, "h20"))
        for cfg in standard_scenarios(spec):
            for arrivals in ARRIVALS:
                trace = list(generate_agentic_trace(realistic_agentic_config(num_requests=a.n)))
                sim = Simulation(cfg)
                s = sim.run(trace, arrivals)
                d = run_digest(sim, s)
                total.update(d.encode())
                print(f"{model:12s} {cfg.name:18s} {arrivals:8s} {s.requests:6d} req "
                      f"{sim.loop.events_run:8d} events  SLA {s.sla_attainment:6.1%}  {d[:16]}")
    print(f"# {time.process_time() - cpu0:.1f} CPU s")
    print(f"digest {total.hexdigest()}")


if __name__ == "__main__":
    main()
