"""The main job: a local PDD topology across an emulated WAN, serving a few requests.

    python -m sglang_pdd.launcher.demo [--run-dir runs/demo] [--keep-running]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from sglang_pdd.launcher.cluster import LocalCluster
from sglang_pdd.launcher.http import post_json

DEMO_PROMPTS = [
    "def fibonacci(n):",
    "import collections\n\nclass LRUCache:",
    "import collections\n\nclass Counter:",
    "The quick brown fox",
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", default="runs/demo", help="logs and the WAN key go here")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--keep-running", action="store_true", help="serve until Ctrl-C")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    with LocalCluster(Path(args.run_dir)) as cluster:
        topo = cluster.topology
        print(f"\nPDD demo up. router {topo.router_url}\n"
              f"  datacenter A: P {topo.prefill.url} (bootstrap {topo.prefill.bootstrap_port}),"
              f" RLD {topo.relay.url}\n  datacenter B: MD {topo.main.url}\n"
              f"  logs: {cluster.procs.log_dir}\n")
        for prompt in DEMO_PROMPTS:
            t0 = time.perf_counter()
            out = post_json(f"{topo.router_url}/generate", {
                "text": prompt, "sampling_params": {"max_new_tokens": args.max_new_tokens,
                                                    "temperature": 0}})
            dt = time.perf_counter() - t0
            meta = out.get("meta_info", {})
            print(f"{prompt!r:45.45} -> {len(out.get('output_ids', []))} tokens in {dt:.2f}s "
                  f"(prompt {meta.get('prompt_tokens')}, cached {meta.get('cached_tokens')})")
        if args.keep_running:
            print("serving; Ctrl-C to stop")
            try:
                while True:
                    cluster.procs.check_alive()
                    time.sleep(2)
            except KeyboardInterrupt:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
