"""DeepSeek-V4's KV pools moved request by request the way sglang-pdd's hybrid plumbing moves them
(sglang_glue/kv_buffer_groups.py), on a GPU: two SGLang ``DeepSeekV4TokenToKVPool``s shaped like
a tiny DeepSeek-V4-style model (4 layers, compression ratios [0, 4, 128, 4], window 128, SGLang's
fixed DSV4 head geometry: nope 448, rope 64, indexer 128; page 256), every request's full pages
past a DRC-style cached prefix, its window's state pages and its C128 request ring gathered
from one pool and scattered into the other at different slots, checked byte for byte and timed.

It prints, per request, the bytes each group moves, what the window saves against sending the
sliding layers like full layers, and gather+scatter time; exit code 1 on any byte mismatch.
Without CUDA it says so and exits 0, unless ``--device cpu`` asks for the CPU run (the tests'
smallest size). The pool level only: SGLang's DeepSeek-V4 model path needs its CUDA kernels, and
PDD's WAN channel does not move hybrid pools yet (docs/data_path.md, "Hybrid pools").

    .venv/bin/python -m benchmarks.gpu_dsv4_pool_transfer                    # CUDA, 32 requests
    .venv/bin/python -m benchmarks.gpu_dsv4_pool_transfer --device cpu --requests 1 --seq-len 700
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

PAGE = 256
WINDOW = 128
RATIOS = [0, 4, 128, 4]


def dsv4_pool(device: str, full_tokens: int, swa_tokens: int, max_reqs: int):
    import torch
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import (DeepSeekV4TokenToKVPool,
                                                              resolve_compress_state_ring_size)

    pool = DeepSeekV4TokenToKVPool(
        max_num_reqs=max_reqs, swa_size=swa_tokens, c4_size=full_tokens // 4, c128_size=full_tokens // 128 * 32,
        c4_state_pool_size=swa_tokens // PAGE * resolve_compress_state_ring_size(4), c128_state_pool_size=0,
        page_size=PAGE, swa_page_size=PAGE, dtype=torch.float8_e4m3fn, c4_state_dtype=torch.float32,
        c128_state_dtype=torch.float32, qk_nope_head_dim=448, qk_rope_head_dim=64, indexer_head_dim=128,
        layer_num=len(RATIOS), device=device, enable_memory_saver=False, compression_ratios=list(RATIOS),
        full_size=full_tokens)
    mapping = torch.zeros(full_tokens + 1, dtype=torch.int64, device=device)
    mapping[-1] = -1
    pool.register_mapping(mapping)
    return pool, mapping


def map_window(mapping, full_pages, swa_pages) -> None:
    """As SGLang's SWA allocator would: the window's full pages get SWA pages."""
    import torch

    for f, s in zip(full_pages, swa_pages):
        mapping[f * PAGE:(f + 1) * PAGE] = torch.arange(s * PAGE, (s + 1) * PAGE, device=mapping.device)


def slots_of(pages, device):
    import torch

    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages]).to(device)


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(args) -> list[dict]:
    import torch
    from sglang.test.test_utils import published_topology
    from tqdm import tqdm

    from sglang_pdd.kv_channel.group_layout import RequestKvPlan
    from sglang_pdd.sglang_glue.kv_buffer_groups import GroupedPool

    rng = random.Random(args.seed)
    pages_per_req = -(-args.seq_len // PAGE)
    full_pages = max(4 * pages_per_req, 8)
    full_tokens, swa_tokens = full_pages * PAGE, max(4, -(-WINDOW // PAGE) + 2) * PAGE
    rows = []
    with published_topology(device=args.device):
        (src_pool, src_map), (dst_pool, dst_map) = (dsv4_pool(args.device, full_tokens, swa_tokens, 4) for _ in "ab")
        src, dst = GroupedPool(src_pool, PAGE, WINDOW), GroupedPool(dst_pool, PAGE, WINDOW)
        dst.layout.check_same(src.layout, "MD", "P")
        g = torch.Generator(device=args.device).manual_seed(args.seed)
        for group in src.groups.values():
            for v in group.views:
                v.copy_(torch.randint(0, 256, v.shape, generator=g, dtype=torch.uint8, device=args.device))
        for i in tqdm(range(args.requests), desc="requests", disable=args.requests < 4):
            prefix = PAGE * rng.randrange(0, min(args.max_prefix_pages, pages_per_req - 1) + 1)
            plan = RequestKvPlan(src.layout, args.seq_len, prefix)
            sides = []
            for pool_map in (src_map, dst_map):
                pages = rng.sample(range(1, full_pages), pages_per_req)
                window_full = pages[plan.window_from // PAGE:]
                map_window(pool_map, window_full, rng.sample(range(1, swa_tokens // PAGE), len(window_full)))
                sides.append(slots_of(pages, args.device))
            src_ids = src.request_item_ids(plan, sides[0], req_pool_idx=1 + i % 3)
            dst_ids = dst.request_item_ids(plan, sides[1], req_pool_idx=1 + (i + 1) % 3)
            sync(args.device)
            t0 = time.perf_counter()
            dst.scatter(dst_ids, src.gather(src_ids))
            sync(args.device)
            seconds = time.perf_counter() - t0
            equal = all(torch.equal(d[dst_ids[n]], s[src_ids[n]]) for n, grp in dst.groups.items()
                        for d, s in zip(grp.views, src.groups[n].views))
            sent = plan.group_bytes(request_items=len(src_ids.get("request", ())))
            rows.append(dict(request=i, seq_len=args.seq_len, prefix=prefix, equal=equal, bytes=sent,
                             total_bytes=sum(sent.values()),
                             without_window_bytes=plan.bytes_without_window() + sent.get("request", 0),
                             seconds=seconds))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=4000, help="tokens per request")
    ap.add_argument("--max-prefix-pages", type=int, default=4,
                    help="DRC-style cached prefix, in pages, drawn per request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device visible: nothing run (use --device cpu for the CPU run)")
            return 0
        print(f"device: {torch.cuda.get_device_name(0)}")
    rows = run(args)
    for r in rows:
        print(f"request {r['request']}: seq {r['seq_len']} prefix {r['prefix']}: {r['total_bytes']} B "
              f"({', '.join(f'{k} {v}' for k, v in r['bytes'].items())}) vs {r['without_window_bytes']} B without "
              f"the window; {r['seconds'] * 1e3:.2f} ms, {'equal' if r['equal'] else 'MISMATCH'}")
    if rows:
        secs = sorted(r["seconds"] for r in rows)
        gbps = sum(r["total_bytes"] for r in rows) / sum(secs) / 1e9
        print(f"{len(rows)} requests: median {secs[len(secs) // 2] * 1e3:.2f} ms, {gbps:.2f} GB/s gather+scatter")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
