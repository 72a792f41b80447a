"""MD's decode inter-token latency while a large room's KV lands: staged ingest vs pool ingest.

One real MD server (``--pdd-role main``) per ingest mode, started one after the other in the
same run with the same flags except ``--pdd-md-ingest``:

* ``staged`` (the earlier design): chunks land in a host buffer; at completion MD's scheduler
  thread allocates slots and copies the whole room into the KV pool, then inserts it;
* ``pool`` (now): the room's pool pages are reserved at registration, the WAN receiver's
  threads write each chunk into them as it lands; the scheduler thread only inserts.

On each MD a client streams a long greedy decode (the victim) and records when each streamed
event arrives and how many tokens it carries. While it runs, this script registers ``--rooms``
large rooms one after the other on MD's control API and sends their KV (random bytes, MD's own
layout) with the real ``WanKvSender``, paced at ``--wan-mbps`` like a WAN, waiting for each to
be ready. Reported per mode: decode tokens/s and the longest gap between streamed tokens, before
any room and while rooms land, and MD's own scheduler-thread time per room (``/pdd/stats``:
``complete_ms_max`` = the completion step, ``register_ms_max``); then staged / pool ratios.

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


def stream_decode(url: str, max_new: int, events: list, started: threading.Event) -> None:
    """The victim: one greedy streaming decode; records (arrival time, tokens so far) per event."""
    body = {"input_ids": list(range(100, 132)), "stream": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    req = urllib.request.Request(f"{url}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as resp:
        for line in resp:
            if line.startswith(b"data:") and not line.startswith(b"data: [DONE]"):
                events.append((time.perf_counter(), len(json.loads(line[5:])["output_ids"])))
                started.set()


def land_room(md: ServerSpec, sender: WanKvSender, room: int, tokens: int, rate_bps: float, rng) -> tuple:
    """Register a room, send its KV paced at ``rate_bps`` (a WAN, not loopback speed), wait
    until MD says ready. Returns (first byte sent, ready) times."""
    ids = rng.integers(1000, 30000, tokens).tolist()
    reg = post_json(f"{md.control_url}/pdd/rooms", {"room": room, "token_ids": ids, "use_cache": False}, timeout=120)
    layout = KvPoolLayout.from_dict(reg["kv_layout"]).wire()
    pages = -(-tokens // layout.page_size)
    kv = rng.integers(0, 256, (layout.num_layers, pages, layout.bytes_per_page), dtype=np.uint8)
    xfer = sender.begin_transfer(room, layout, tokens, 0, token_ids=ids, timeout=300)
    t0 = time.perf_counter()
    sent = 0
    for index in range(xfer.plan.num_chunks):
        c = xfer.plan.chunk(index)
        if not xfer.send_chunk(index, kv[c.layer, c.page_start:c.page_start + c.page_count]):
            raise RuntimeError(f"room {room}: WAN transfer failed: {sender.failure(room)}")
        sent += c.nbytes
        ahead = sent / rate_bps - (time.perf_counter() - t0)
        if ahead > 0:
            time.sleep(ahead)
    xfer.finish()
    if sender.wait(room, 300) is not RoomState.SUCCESS:
        raise RuntimeError(f"room {room}: WAN transfer failed: {sender.failure(room)}")
    ready = get_json(f"{md.control_url}/pdd/rooms/{room}/ready?timeout_s=300", timeout=320)
    t1 = time.perf_counter()
    if ready["status"] != "ready":
        raise RuntimeError(f"room {room} not ready on MD: {ready}")
    sender.release(room)
    urllib.request.urlopen(urllib.request.Request(f"{md.control_url}/pdd/rooms/{room}", method="DELETE"),
                           timeout=60).read()
    return t0, t1, xfer.plan.total_bytes


def decode_metrics(events: list, windows: list, baseline_end: float) -> dict:
    """Tokens/s and the longest gap between streamed tokens, before any room and while rooms
    land (a window runs from a room's first byte to its ready, plus the next token)."""
    t = np.asarray([e[0] for e in events])
    n = np.asarray([e[1] for e in events], dtype=float)
    gaps, at = np.diff(t) * 1000, t[1:]
    made = np.diff(n)
    base = at <= baseline_end
    land = np.zeros(len(at), dtype=bool)
    for a, b, _ in windows:
        land[(at >= a) & (np.arange(len(at)) <= np.searchsorted(at, b))] = True
    if not land.any() or not base.any():
        raise RuntimeError("the decode stream did not cover the baseline and the landings: raise --decode-tokens")
    span = lambda m: float(np.sum(gaps[m])) / 1000  # noqa: E731
    return {"baseline_tok_s": float(made[base].sum() / span(base)), "landing_tok_s": float(made[land].sum() / span(land)),
            "baseline_max_gap_ms": float(gaps[base].max()), "landing_max_gap_ms": float(gaps[land].max()),
            "landing_p99_gap_ms": float(np.percentile(gaps[land], 99)), "landing_tokens": int(made[land].sum())}


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
        events: list = []
        started = threading.Event()
        victim = threading.Thread(target=stream_decode, args=(md.url, args.decode_tokens, events, started),
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
                windows.append(land_room(md, sender, 1000 + i, args.room_tokens, args.wan_mbps * 1e6 / 8, rng))
                bar.update(1)
                time.sleep(args.gap_s)
        finally:
            sender.close()
        stats = get_json(f"{md.control_url}/pdd/stats")
        victim.join(900)
    return {"mode": mode, **decode_metrics(events, windows, baseline_end),
            "md_complete_ms_max": stats.get("complete_ms_max"), "md_register_ms_max": stats.get("register_ms_max"),
            "room_s": [round(b - a, 2) for a, b, _ in windows], "room_mb": windows[0][2] / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--room-tokens", type=int, default=120_000, help="prompt tokens of each landing room")
    ap.add_argument("--rooms", type=int, default=3)
    ap.add_argument("--pool-tokens", type=int, default=262_144, help="MD's --max-total-tokens")
    ap.add_argument("--staging-mb", type=int, default=4096)
    ap.add_argument("--decode-tokens", type=int, default=3000, help="victim decode length (must outlast the rooms)")
    ap.add_argument("--baseline-s", type=float, default=3.0)
    ap.add_argument("--gap-s", type=float, default=1.0)
    ap.add_argument("--wan-mbps", type=float, default=400.0, help="pace of the KV sender (a WAN, not loopback)")
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
    print(f"\nMD decode while {args.rooms} rooms of {args.room_tokens} tokens "
          f"({results[0]['room_mb']:.0f} MB of KV each) land one at a time "
          f"at {args.wan_mbps} Mbit/s:")
    cols = ["baseline_tok_s", "landing_tok_s", "baseline_max_gap_ms", "landing_max_gap_ms", "landing_p99_gap_ms",
            "md_complete_ms_max", "md_register_ms_max"]
    print(f"{'mode':7} " + " ".join(f"{c:>20}" for c in cols) + "  room s")
    for r in results:
        print(f"{r['mode']:7} " + " ".join(f"{r[c]:20.1f}" for c in cols) + f"  {r['room_s']}")
    for c in ("landing_max_gap_ms", "landing_p99_gap_ms", "md_complete_ms_max"):
        print(f"ratio staged/pool {c}: {staged[c] / pool[c]:.2f}x")
    slow = [r["baseline_tok_s"] / r["landing_tok_s"] for r in results]
    print(f"decode slowdown while landing (baseline tok/s / landing tok/s): staged {slow[0]:.2f}x, pool {slow[1]:.2f}x")


if __name__ == "__main__":
    main()
