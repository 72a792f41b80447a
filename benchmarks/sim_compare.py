"""Comparison of PD, naive cross-DC PD and PDD variants on the Mooncake trace and on a
synthetic agentic trace; prints tables, writes PNG/JSON under --out.

    python -m benchmarks.sim_compare \
        --agentic 20000 --out artifacts/sim     # the Mooncake trace from ../shared/traces by default

The trace is the public Mooncake FAST'25 one (kvcache-ai/Mooncake, FAST25-release/traces/);
without it at ../shared/traces/mooncake_synthetic_trace.jsonl, pass --trace PATH.
"""

import argparse
import sys

from benchmarks.common import MOONCAKE_TRACE, require_trace
from sglang_pdd.sim.cli import main as sim_main


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default=MOONCAKE_TRACE)
    ap.add_argument("--agentic", type=int, default=20_000)
    ap.add_argument("--out", default="artifacts/sim")
    ap.add_argument("--bathtub", action="store_true", help="also run the throughput-vs-hit sweep")
    a, rest = ap.parse_known_args()
    require_trace(a.trace)
    rc = sim_main(["compare", "--trace", a.trace, "--out", a.out, *rest])
    rc |= sim_main(["compare", "--agentic", str(a.agentic), "--out", a.out, *rest])
    if a.bathtub:
        rc |= sim_main(["bathtub", "--out", a.out, *rest])
    return rc


if __name__ == "__main__":
    sys.exit(main())
