"""MD's decode inter-token latency while a large room's KV lands: staged ingest vs pool ingest.

One real MD server (``--pdd-role main``) per ingest mode, started one after the other in the
same run with the same flags except ``--pdd-md-ingest``:

* ``staged`` (the earlier design): chunks land in a host buffer; at completion MD's scheduler
  thread allocates slots and copies the whole room into the KV pool, then inserts it;
* ``pool`` (now): the room's pool pages are reserved at registration, the WAN receiver's
  threads write each chunk into them as it lands; the scheduler thread only inserts.

On each MD a client streams a long greedy decode (the victim) and records each token's
arrival. While it runs, this script registers ``--rooms`` large rooms one after the other on
MD's control API and sends their KV (random bytes, MD's own layout) with the real
``WanKvSender`` over loopback, waiting for each to be ready. Reported per mode: ITL p50 before
any room, and p50 / p99 / max ITL while rooms land (from a room's first byte to its ready +
one token), then the ratios staged / pool side by side.

    .venv/bin/python benchmarks/bench_md_ingest.py                       # ~3-4 min on 2 cores
    .venv/bin/python benchmarks/bench_md_ingest.py --room-tokens 100000 --rooms 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
from tqdm import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from sglang_pdd.kv_channel.layout import KvPoolLayout  # noqa: E402
from sglang_pdd.kv_channel.states import RoomState  # noqa: E402
from sglang_pdd.kv_channel.wan_sender import WanKvSender  # noqa: E402
from sglang_pdd.launcher.cluster import default_model_path  # noqa: E402
from sglang_pdd.launcher.http import get_json, post_json  # noqa: E402
from sglang_pdd.launcher.processes import ProcessGroup  # noqa: E402
from sglang_pdd.launcher.topology import CPU_ENV, ServerSpec, free_port, server_argv, write_wan_key  # noqa: E402


def stream_decode(url: str, max_new: int, arrivals: list, started: threading.Event) -> None:
    """The victim: one greedy streaming decode; appends each chunk's arrival time."""
    body = {"input_ids": list(range(100, 132)), "stream": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    req = urllib.request.Request(f"{url}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as resp:
        for line in resp:
            if line.startswith(b"data:") and not line.startswith(b"data: [DONE]"):
                arrivals.append(time.perf_counter())
                started.set()


def land_room(md: ServerSpec, sender: WanKvSender, room: int, tokens: int, rng) -> tuple[float, float]:
    ids = rng.integers(1000, 30000, tokens).tolist()
    reg = post_json(f"{md.control_url}/pdd/rooms", {"room": room, "token_ids": ids, "use_cache": False}, timeout=120)
    layout = KvPoolLayout.from_dict(reg["kv_layout"]).wire()
    pages = -(-tokens // layout.page_size)
    kv = rng.integers(0, 256, (layout.num_layers, pages, layout.bytes_per_page), dtype=np.uint8)
    t0 = time.perf_counter()
    xfer = sender.begin_transfer(room, layout, tokens, 0, token_ids=ids, timeout=300)
    xfer.send_kv(kv)
    if sender.wait(room, 300) is not RoomState.SUCCESS:
        raise RuntimeError(f"room {room}: WAN transfer failed: {sender.failure(room)}")
    ready = get_json(f"{md.control_url}/pdd/rooms/{room}/ready?timeout_s=300", timeout=320)
    t1 = time.perf_counter()
    if ready["status"] != "ready":
        raise RuntimeError(f"room {room} not ready on MD: {ready}")
    sender.release(room)
    urllib.request.urlopen(urllib.request.Request(f"{md.control_url}/pdd/rooms/{room}", method="DELETE"),
                           timeout=60).read()
    return t0, t1


def run_mode(mode: str, args, model: str, key_file: Path, log_dir: Path, bar) -> dict:
    md = ServerSpec(f"md-{mode}", "main", free_port(), "dc-b", wan_listen_port=free_port(), control_port=free_port(),
                    extra_args=["--pdd-md-ingest", mode, "--max-total-tokens", str(args.pool_tokens),
                                "--pdd-md-staging-mb", str(args.staging_mb)])
    with ProcessGroup(log_dir / mode) as procs:
        procs.start(md.name, server_argv(md, model, wan_key_file=str(key_file)), health_url=f"{md.url}/health",
                    env=CPU_ENV)
        procs.wait_healthy(timeout_s=600)
        bar.set_postfix_str(f"{mode}: MD up")
        post_json(f"{md.url}/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}})  # warm
        arrivals: list = []
        started = threading.Event()
        victim = threading.Thread(target=stream_decode, args=(md.url, args.decode_tokens, arrivals, started),
                                  daemon=True)
        victim.start()
        started.wait(300)
        time.sleep(args.baseline_s)
        baseline_end = time.perf_counter()
        sender = WanKvSender(("127.0.0.1", md.wan_listen_port), key_file.read_bytes().strip(), name="bench-p",
                             num_streams=4, transfer_timeout=300)
        rng = np.random.default_rng(0)
        windows = []
        try:
            for i in range(args.rooms):
                windows.append(land_room(md, sender, 1000 + i, args.room_tokens, rng))
                bar.update(1)
                time.sleep(args.gap_s)
        finally:
            sender.close()
        landing_end = time.perf_counter()
        victim.join(900)
    t = np.asarray(arrivals)
    itl, at = np.diff(t) * 1000, t[1:]
    base = itl[at <= baseline_end]
    # ITLs that end inside a landing window: first byte sent -> ready, plus the next token
    mask = np.zeros(len(at), dtype=bool)
    for a, b in windows:
        mask[(at >= a) & (np.arange(len(at)) <= np.searchsorted(at, b))] = True
    during = itl[mask]
    if not len(during):
        raise RuntimeError("no decode token arrived while rooms landed: raise --decode-tokens")
    if at[-1] < landing_end:
        print(f"warning ({mode}): the decode stream ended before the last room landed", file=sys.stderr)
    return {"mode": mode, "tokens": int(len(t)), "baseline_p50_ms": float(np.median(base)) if len(base) else None,
            "landing_p50_ms": float(np.median(during)), "landing_p99_ms": float(np.percentile(during, 99)),
            "landing_max_ms": float(during.max()), "landing_tokens": int(len(during)),
            "room_s": [round(b - a, 3) for a, b in windows]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--room-tokens", type=int, default=120_000, help="prompt tokens of each landing room")
    ap.add_argument("--rooms", type=int, default=3)
    ap.add_argument("--pool-tokens", type=int, default=262_144, help="MD's --max-total-tokens")
    ap.add_argument("--staging-mb", type=int, default=4096)
    ap.add_argument("--decode-tokens", type=int, default=1500, help="victim decode length (must outlast the rooms)")
    ap.add_argument("--baseline-s", type=float, default=3.0)
    ap.add_argument("--gap-s", type=float, default=1.0)
    ap.add_argument("--out", type=Path, default=Path("artifacts/bench_md_ingest"))
    args = ap.parse_args()
    model = default_model_path()
    args.out.mkdir(parents=True, exist_ok=True)
    key_file = write_wan_key(Path(tempfile.mkdtemp()) / "wan.key")
    results = []
    with tqdm(total=2 * args.rooms, desc="rooms landed", unit="room") as bar:
        for mode in ("staged", "pool"):
            results.append(run_mode(mode, args, model, key_file, args.out / "logs", bar))
    (args.out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                       "results": results}, indent=2))
    staged, pool = results
    print(f"\nMD decode ITL while {args.rooms} rooms of {args.room_tokens} tokens land "
          f"(one at a time, loopback WAN), ms:")
    print(f"{'mode':8} {'base p50':>9} {'land p50':>9} {'land p99':>9} {'land max':>9} {'tokens':>7}  room s")
    for r in results:
        print(f"{r['mode']:8} {r['baseline_p50_ms'] or float('nan'):9.1f} {r['landing_p50_ms']:9.1f} "
              f"{r['landing_p99_ms']:9.1f} {r['landing_max_ms']:9.1f} {r['landing_tokens']:7d}  {r['room_s']}")
    for k in ("landing_p50_ms", "landing_p99_ms", "landing_max_ms"):
        print(f"ratio staged/pool {k[:-3]}: {staged[k] / pool[k]:.2f}x")


if __name__ == "__main__":
    main()
