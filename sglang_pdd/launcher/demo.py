"""The main job: a local PDD topology across an emulated WAN, serving a short agent session.

    python -m sglang_pdd.launcher.demo [--run-dir runs/demo] [--wan-mbps 2] [--turns N]
                                       [--summary-json PATH] [--keep-running] [--netns]

P and RLD ("datacenter A") and MD ("datacenter B") are real SGLang servers; the WAN between P
and MD is the userspace emulator, slowed down so that the tiny model's KV (512 B/token) takes
about as long to cross as a real model's does on a busy datacenter interconnect. With
``--netns`` (root) datacenter B is a network namespace instead, joined to A by a veth pair
shaped to --wan-mbps both ways: every byte between the datacenters (WAN KV, the router's
control calls, MD's streams) crosses that kernel link, which has a rate but no delay.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
from pathlib import Path
from typing import Optional

from sglang_pdd.launcher.cluster import LocalCluster
from sglang_pdd.launcher.http import get_json, post_json
from sglang_pdd.launcher.netns import DatacenterLink, link_or_fallback
from sglang_pdd.launcher.topology import Topology
from sglang_pdd.protocol import STATS

# MD must take over while RLD still decodes, or the demo shows no handoff: on an idle machine
# RLD makes ~250-400 tokens/s on the short first turn, and MD is ready ~0.6 s after P replied
# (the KV at 2 Mbit/s plus MD's ingest), sometimes a second or more later. 512 tokens leave
# ~1.5 s, which a fast RLD still beats now and then on turn 1 (the row then says so). The
# second turn's KV takes ~1.4 s on the link, and RLD, on a longer context, had made ~64 tokens
# by then when measured: it hands off.
MAX_NEW_TOKENS = 512

SYSTEM = "You are a coding agent. Tools: read_file, run_tests.\n" * 3
TURNS = [
    "User: the LRU cache test fails.\nAgent:",
    "Tool(read_file): class LRUCache:\n    def get(self, key):\n        return self.data[key]\nAgent:",
    "Tool(run_tests): 1 failed, KeyError in get\nAgent:",
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", default="runs/demo", help="logs and the WAN key go here")
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    ap.add_argument("--wan-mbps", type=float, default=2.0, help="emulated WAN rate (Mbit/s)")
    ap.add_argument("--wan-latency-ms", type=float, default=20.0)
    ap.add_argument("--turns", type=int, default=len(TURNS), choices=range(1, len(TURNS) + 1),
                    help="how many of the session's turns to send")
    ap.add_argument("--summary-json", default=None,
                    help="also write each turn's meta_info.pdd and MD's DRC stats to this file")
    ap.add_argument("--keep-running", action="store_true", help="serve until Ctrl-C")
    ap.add_argument("--prefill-tp", type=int, default=1,
                    help="P's --tp (each rank sends its KV heads' share to MD; slow on a 2-core CPU)")
    ap.add_argument("--main-tp", type=int, default=1,
                    help="MD's --tp (P feeds each MD rank its KV heads over its own WAN link)")
    ap.add_argument("--netns", action="store_true",
                    help="datacenter B (MD) in a network namespace behind a veth shaped to --wan-mbps "
                         "(tbf, both ways, no delay): every byte between the datacenters crosses it. "
                         "Needs root; without, the emulator is used and the demo says so")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")

    topology = Topology.on_free_ports(prefill_tp=args.prefill_tp, main_tp=args.main_tp)
    topology.wan.rate_gbps, topology.wan.latency_ms = args.wan_mbps / 1000, args.wan_latency_ms
    router_args = ["--max-wan-transfer-ms", "100"]
    with contextlib.ExitStack() as stack:
        link = link_or_fallback(args.wan_mbps) if args.netns else None
        if link is not None:
            stack.callback(link.destroy)  # after the cluster's processes are stopped
            topology.place_datacenter_b(link.b_ip, link.namespace, args.wan_mbps / 1000)
            wan = (f"{args.wan_mbps} Mbit/s kernel link (veth {link.plan.veth_a} {link.a_ip} <-> "
                   f"namespace {link.namespace} {link.b_ip}; tbf both ways, no delay)")
        else:
            wan = f"{args.wan_mbps} Mbit/s, {args.wan_latency_ms} ms one way (userspace emulator, P's WAN KV only)"
        cluster = stack.enter_context(LocalCluster(Path(args.run_dir), topology=topology, router_args=router_args))
        run_demo(args, cluster, wan, link)
    return 0


def run_demo(args, cluster: LocalCluster, wan: str, link: Optional[DatacenterLink]) -> None:
    """The session through the router, a table row per turn, then MD's DRC summary (and with
    ``link``, the bytes that crossed the kernel link)."""
    topo = cluster.topology
    print(f"\nPDD demo up: router {topo.router_url}\n"
          f"  datacenter A: P {topo.prefill.url}, RLD {topo.relay.url}\n"
          f"  datacenter B: MD {topo.main.url} (control {topo.main.control_url})\n"
          f"  WAN: {wan}\n"
          f"  logs: {cluster.procs.log_dir}\n")
    link_before = link.counters() if link is not None else None
    print(f"{'turn':>4} {'path':>10} {'prompt':>6} {'MD hit':>6} {'WAN KB':>7} {'TTFT ms':>8} "
          f"{'handoff@':>8} {'RLD':>4} {'MD':>4}  text")
    # The demo is the router's operator: only operators see meta_info.pdd (what happened to
    # a request), and the launcher wrote the router's operator token for this run.
    headers = cluster.operator_headers
    context, turns = SYSTEM, []
    for i, turn in enumerate(TURNS[:args.turns], 1):
        context += turn
        out = post_json(f"{topo.router_url}/generate", {
            "text": context, "sampling_params": {"max_new_tokens": args.max_new_tokens, "temperature": 0}},
            headers=headers)
        pdd = out["meta_info"]["pdd"]
        turns.append(pdd)
        print(f"{i:>4} {pdd['path']:>10} {pdd['prompt_tokens']:>6} {pdd['md_cached_tokens']:>6} "
              f"{(pdd['wan_bytes'] or 0) / 1024:>7.1f} {1000 * (pdd['ttft_s'] or 0):>8.0f} "
              f"{str(pdd['handoff_at']):>8} {pdd['rld_tokens']:>4} {pdd['md_tokens']:>4}  "
              f"{out['text'][:30]!r}")
        if pdd["handoff_at"] is None and pdd["md_kv_kept"]:
            print("     RLD finished before MD's KV landed; the KV still went on to MD for the next turn")
        if pdd["fallbacks"]:
            print(f"     fallbacks: {pdd['fallbacks']}")
        context += out["text"] + "\n"
    stats = get_json(f"{topo.main.control_url}{STATS.path()}", key=cluster.control_key)
    print(f"\nMD's DRC: hit rate {stats['hit_rate']:.0%}, {stats['bytes_saved'] / 1024:.1f} KB not sent "
          f"over the WAN, {stats['wan_bytes'] / 1024:.1f} KB sent. Router metrics: {topo.router_url}/metrics")
    summary = {"turns": turns, "drc": stats}
    if link is not None:
        a_to_b, b_to_a = (now - then for now, then in zip(link.counters(), link_before))
        summary["link_bytes"] = {"a_to_b": a_to_b, "b_to_a": b_to_a, "namespace": link.namespace}
        print(f"Across the kernel link (veth counters, everything between the datacenters): "
              f"{a_to_b / 1024:.1f} KB A->B, {b_to_a / 1024:.1f} KB B->A")
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(summary, indent=1))
    if args.keep_running:
        print("serving; Ctrl-C to stop")
        try:
            while True:
                cluster.procs.check_alive()
                time.sleep(2)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    sys.exit(main())
