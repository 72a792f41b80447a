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

    .venv/bin/python -m benchmarks.bench_md_ingest                       # ~3-4 min on 2 cores
    .venv/bin/python -m benchmarks.bench_md_ingest --room-tokens 100000 --rooms 2
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from benchmarks.common import greedy, timed_events
from sglang_pdd.kv_channel.handshake import load_key
from sglang_pdd.kv_channel.layout import KvPoolLayout
from sglang_pdd.kv_channel.contract import RoomState
from sglang_pdd.kv_channel.wan_sender import WanKvSender
from sglang_pdd.launcher.cluster import default_model_path
from sglang_pdd.launcher.http import call_json, get_json, post_json
from sglang_pdd.launcher.processes import ProcessGroup
from sglang_pdd.launcher.topology import CPU_ENV, ServerSpec, free_port, server_argv, write_wan_key
from sglang_pdd.protocol import ReadyReply, ReadyRequest, RegisterReply, RegisterRequest, ReleaseRequest
from sglang_pdd.protocol import routes as api


def stream_decode(url: str, max_new: int, events: list, started: threading.Event) -> None:
    """The victim: one greedy streaming decode; records (arrival time, tokens so far) per event."""
    body = {"input_ids": list(range(100, 132)), "stream": True, "sampling_params": greedy(max_new)}
    for t, event in timed_events(f"{url}/generate", body, timeout=900):
        events.append((t, len(event["output_ids"])))
        started.set()


def land_room(md: ServerSpec, sender: WanKvSender, room: int, tokens: int, rate_bps: float, rng,
              key: bytes) -> tuple:
    """Register a room, send its KV paced at ``rate_bps`` (a WAN, not loopback speed), wait
    until MD says ready (MD's control calls signed with the shared ``key``). Returns
    (registration sent, ready) times and the KV bytes."""
    ids = rng.integers(1000, 30000, tokens).tolist()
    t_reg = time.perf_counter()  # the room's life on MD starts with its registration
    body = RegisterRequest(room, ids, use_cache=False).to_json()
    reg = RegisterReply.from_json(post_json(f"{md.control_url}{api.MD_REGISTER.path()}", body, timeout=120, key=key))
    layout = KvPoolLayout.from_dict(reg.kv_layout).wire()
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
    ready = ReadyReply.from_json(get_json(f"{md.control_url}{api.ready_target(room, 300)}", timeout=320, key=key))
    t1 = time.perf_counter()
    if ready.status != "ready":
        raise RuntimeError(f"room {room} not ready on MD: {ready}")
    sender.release(room)
    call_json("DELETE", f"{md.control_url}{api.MD_RELEASE.path(room=room)}", timeout=60, key=key)
    return t_reg, t1, xfer.plan.total_bytes


def decode_metrics(events: list, windows: list, baseline_end: float) -> dict:
    """Tokens/s and the longest gap between streamed tokens, before any room and while rooms
    land (a window runs from a room's registration to its ready, plus the next token)."""
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
        key = load_key(str(key_file))
        sender = WanKvSender(("127.0.0.1", md.wan_listen_port), key, name="bench-p", num_streams=4,
                             transfer_timeout=300)
        rng = np.random.default_rng(0)
        windows = []
        try:
            for i in range(args.rooms):
                windows.append(land_room(md, sender, 1000 + i, args.room_tokens, args.wan_mbps * 1e6 / 8, rng, key))
                bar.update(1)
                time.sleep(args.gap_s)
        finally:
            sender.close()
        stats = get_json(f"{md.control_url}{api.STATS.path()}", key=key)
        victim.join(900)
    return {"mode": mode, **decode_metrics(events, windows, baseline_end),
            "md_complete_ms_max": stats.get("complete_ms_max"), "md_register_ms_max": stats.get("register_ms_max"),
            "room_s": [round(b - a, 2) for a, b, _ in windows], "room_mb": windows[0][2] / 1e6}


def in_process_md(mode: str, pool_tokens: int, staging_mb: int, key: bytes, page_size: int = 1):
    """MD's real runtime (MainDrcRuntime: WAN receiver, rooms, ingest) on SGLang's real radix
    cache, allocator and an MHA pool shaped like the tiny model's, without a server."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from tests.support.md_runtime import runtime_on_pool

    pool = MHATokenToKVPool(size=pool_tokens, page_size=page_size, dtype=torch.bfloat16, head_num=2, head_dim=32,
                            layer_num=2, device="cpu", enable_memory_saver=False)
    return runtime_on_pool(pool, page_size, key, wan_key_file="unused", wan_timeout_s=300.0, md_staging_mb=staging_mb,
                           md_ingest=mode)


def run_mode_in_process(mode: str, args, bar) -> dict:
    """The scheduler loop is this thread: a synthetic decode step (a fixed matmul, ~ a small
    model's step on CPU) then MD's per-iteration hook, as SGLang runs it. Rooms are registered
    through MD's command queue from a feeder thread and their KV sent over loopback."""
    import torch

    key = b"bench-md-ingest-key-0123456789abcdef"
    md = in_process_md(mode, args.pool_tokens, args.staging_mb, key, args.page_size)
    torch.set_num_threads(1)  # one core for the "model", like one of the server's threads; the rest is shared
    a, b = torch.randn(128, 512), torch.randn(512, 512)
    steps: list = []
    windows: list = []
    done = threading.Event()

    def feeder():
        sender = WanKvSender(md.receiver.address, key, name="bench-p", num_streams=4, transfer_timeout=300)
        rng = np.random.default_rng(0)
        try:
            time.sleep(args.baseline_s)
            for i in range(args.rooms):
                room, ids = 1000 + i, rng.integers(1000, 30000, args.room_tokens).tolist()
                t_reg = time.perf_counter()
                md.register(RegisterRequest(room, ids, use_cache=False), timeout=120)
                layout = md.ops.layout
                pages = -(-args.room_tokens // layout.page_size)
                kv = rng.integers(0, 256, (layout.num_layers, pages, layout.bytes_per_page), dtype=np.uint8)
                xfer = sender.begin_transfer(room, layout, args.room_tokens, 0, token_ids=ids, timeout=300)
                t0, sent, rate = time.perf_counter(), 0, args.wan_mbps * 1e6 / 8
                for index in range(xfer.plan.num_chunks):
                    c = xfer.plan.chunk(index)
                    xfer.send_chunk(index, kv[c.layer, c.page_start:c.page_start + c.page_count])
                    sent += c.nbytes
                    time.sleep(max(0.0, sent / rate - (time.perf_counter() - t0)))
                xfer.finish()
                if md.wait_ready(ReadyRequest(room, 300)).status != "ready":
                    raise RuntimeError(f"room {room} did not land")
                windows.append((t_reg, time.perf_counter(), xfer.plan.total_bytes))
                sender.release(room)
                md.release(ReleaseRequest(room), timeout=60)
                bar.update(1)
                time.sleep(args.gap_s)
        finally:
            sender.close()
            done.set()

    t = threading.Thread(target=feeder, daemon=True)
    t.start()
    tokens = 0
    while not done.is_set():
        torch.mm(a, b)  # the decode step
        md.on_scheduler_iteration()
        tokens += 1
        steps.append((time.perf_counter(), tokens))
    t.join()
    md.receiver.close()
    md.control.httpd.shutdown()
    baseline_end = windows[0][0] if windows else steps[-1][0]
    return {"mode": mode, **decode_metrics(steps, windows, baseline_end),
            "md_complete_ms_max": md.counters.get("complete_ms_max"),
            "md_register_ms_max": md.counters.get("register_ms_max"),
            "room_s": [round(y - x, 2) for x, y, _ in windows], "room_mb": windows[0][2] / 1e6}


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
    ap.add_argument("--page-size", type=int, default=1,
                    help="MD's --page-size (--in-process only): pool, radix cache and the KV's layout")
    ap.add_argument("--in-process", action="store_true",
                    help="no server: MD's runtime on SGLang's cache and pool in this process, a synthetic decode step")
    args = ap.parse_args()
    if args.page_size != 1 and not args.in_process:
        ap.error("--page-size is for --in-process (a server's page size is its own --page-size)")
    model = None if args.in_process else default_model_path()
    args.out.mkdir(parents=True, exist_ok=True)
    key_file = write_wan_key(Path(tempfile.mkdtemp()) / "wan.key")
    results = []
    with tqdm(total=2 * args.rooms, desc="rooms landed", unit="room") as bar:
        for mode in ("staged", "pool"):
            if args.in_process:
                results.append(run_mode_in_process(mode, args, bar))
            else:
                results.append(run_mode(mode, args, model, key_file, args.out / "logs", bar))
    (args.out / ("results-in-process.json" if args.in_process else "results.json")).write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                       "results": results}, indent=2))
    staged, pool = results
    print(f"\nMD decode while {args.rooms} rooms of {args.room_tokens} tokens "
          f"({results[0]['room_mb']:.0f} MB of KV each, page size {args.page_size}) land one at a time "
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
