"""MD's runtime on SGLang's own pools, allocator and radix cache (CPU) in this process, fed by
a P stand-in over the real WAN fan-out: building it, driving its rooms, and the checks every
MD test makes (pool conservation, the rows that landed)."""

import time
from types import SimpleNamespace

import numpy as np
import torch

from tests.conftest import require_sglang_import

KEY = b"k" * 32
POOL_PAGES = 32


def pool_pages(page_size):
    return 256 if page_size == 1 else POOL_PAGES


def build_md(page_size, kind="mha", tmp_budget_mb=64, ingest="pool", head_num=2):
    require_sglang_import()
    pool = make_pool(kind, page_size, seed=None, head_num=head_num)
    return runtime_on_pool(pool, page_size, KEY, wan_timeout_s=10.0, md_staging_mb=tmp_budget_mb, md_ingest=ingest)


def runtime_on_pool(pool, page_size: int, key: bytes, idle_sleeper=None, **config):
    """MD's real runtime (WAN receiver, rooms, ingest, control API on free loopback ports) over
    ``pool`` with SGLang's allocator (paged unless ``page_size`` is 1) and radix cache, without a
    server; ``idle_sleeper``: the scheduler's (SGLang's --sleep-on-idle), if any; ``config``: the
    rest of its PddConfig."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache

    from sglang_pdd.config import PddConfig
    from sglang_pdd.launcher.topology import free_port
    from sglang_pdd.sglang_glue.md.main_drc import MainDrcRuntime

    if page_size == 1:
        alloc = TokenToKVPoolAllocator(pool.size, pool.dtype, "cpu", pool, need_sort=False)
    else:
        alloc = PagedTokenToKVPoolAllocator(pool.size, page_size, pool.dtype, "cpu", pool, need_sort=False)
    tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
                                      page_size=page_size))
    cfg = PddConfig(role="main", wan_listen=f"127.0.0.1:{free_port()}", control_listen=f"127.0.0.1:{free_port()}",
                    **config)
    sched = SimpleNamespace(server_args=SimpleNamespace(port=1), tree_cache=tree, page_size=page_size,
                            idle_sleeper=idle_sleeper)
    return MainDrcRuntime(sched, cfg, key)


def make_pool(kind, page_size, seed, head_num=2):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    common = dict(size=pool_pages(page_size) * page_size, page_size=page_size, dtype=torch.bfloat16, layer_num=2,
                  device="cpu", enable_memory_saver=False)
    pool = (MHATokenToKVPool(head_num=head_num, head_dim=8, **common) if kind == "mha"
            else MLATokenToKVPool(kv_lora_rank=16, qk_rope_head_dim=8, **common))
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for buf in bufs(pool):
            buf.copy_(torch.randn(buf.shape, generator=g).to(buf.dtype))
    return pool


def bufs(pool):
    return pool.k_buffer + pool.v_buffer if getattr(pool, "k_buffer", None) else pool.kv_buffer


class Prefill:
    """P: a pool holding prompts on scattered pages, and the real WAN fan-out."""

    def __init__(self, kind, page_size, md, pool=None, shard=None, num_streams=2):
        from sglang_pdd.kv_channel.tp_relayout import TpShard
        from sglang_pdd.sglang_glue.p.wan_fanout import WanFanout

        shard = shard or TpShard()
        self.page_size, self.md = page_size, md
        self.pool = make_pool(kind, page_size, seed=7) if pool is None else pool
        self.fanout = WanFanout(KEY, f"p-test-tp{shard.rank}", num_streams=num_streams, timeout_s=10.0,
                                allowed_peers=[tuple(md.receiver.address)])
        self.fanout.attach_pool(self.pool, page_size, shard)

    def pages_for(self, prompt_len, seed):
        n = -(-prompt_len // self.page_size)
        return np.random.default_rng(seed).permutation(pool_pages(self.page_size))[:n].astype(np.int64)

    def send(self, room, token_ids, md_prefix_len, pages):
        from sglang_pdd.sglang_glue.p.wan_fanout import WanDestination

        dest = WanDestination(room, self.md.receiver.address, md_prefix_len)
        wan_room = self.fanout.open_room(dest, rid=f"r{room}", token_ids=token_ids, first_offered_page=0)
        assert wan_room is not None
        self.fanout.offer(wan_room, pages[:1], last=len(pages) == 1)  # as chunked prefill would
        if len(pages) > 1:
            self.fanout.offer(wan_room, pages[1:], last=True)

    def token_rows(self, pages, start, end):
        tokens = (torch.from_numpy(pages)[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)
        return [b[tokens[start:end]] for b in bufs(self.pool)]


def drive_until(md, room, status="ready", timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        md.on_scheduler_iteration()
        entry = md.table.rooms.get(room)
        if entry is not None and entry.status.value == status:
            return entry
        time.sleep(0.01)
    raise AssertionError(f"room {room} not {status}: {md.table.rooms.get(room)}")


def settle(md, timeout=10.0):
    """Let the release thread hand back reserved pages; the scheduler thread frees them."""
    deadline = time.monotonic() + timeout
    while md.held_tokens and time.monotonic() < deadline:
        md.on_scheduler_iteration()
        time.sleep(0.01)


def conserved(md):
    """SGLang's invariant: every pool slot is free, cached, locked in the tree, or held by MD."""
    tree, alloc = md.ops.tree, md.ops.allocator
    return alloc.available_size() + tree.evictable_size() + tree.protected_size() + md.held_tokens == alloc.size


def md_rows(md, token_ids, start, end):
    _, node = md.ops.match(token_ids)
    slots = md.ops.tree.path_device_indices(node)[start:end].to(torch.int64)
    return [b[slots] for b in bufs(md.ops.pool)]


def close(md, p=None):
    if p is not None:
        p.fanout.close()
    md.close()


def shard_pool(full, kind, page_size, heads):
    """One TP rank's pool: KV heads ``heads`` of ``full`` (SGLang's sharding); MLA: all of it."""
    rank = make_pool(kind, page_size, seed=None, head_num=len(heads))
    for mine, whole in zip(bufs(rank), bufs(full)):
        mine.copy_(whole if kind == "mla" else whole[:, heads.start:heads.stop])
    return rank
