"""MD on SGLang ``--tp N`` in one process: one MainDrcRuntime per TP rank, each on its own
pool, allocator and radix tree, driven in lockstep over a fake TP group (threads and a
barrier), fed per rank by P's real WAN fan-out (port + rank)."""

import copy
import threading
import time
from types import SimpleNamespace

from tests.conftest import require_sglang_import
from tests.support.md_runtime import KEY, Prefill, conserved, make_pool, pool_pages, shard_pool

PAGE = 16


class FakeTpGroup:
    """The collectives of a TP group for ranks that are threads of one process."""

    def __init__(self, size):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=30)
        self.slots = [None] * size
        self.collectives = 0  # how many all-mins ran (rank 0 counts)
        self.errors = []

    def sync(self, rank):
        return FakeTpSync(self, rank)


class FakeTpSync:
    def __init__(self, group, rank):
        self.group, self.rank, self.size = group, rank, group.size

    def share(self, now, ops):
        g = self.group
        if self.rank == 0:
            g.slots[0] = (now, ops)
        g.barrier.wait()
        out = copy.deepcopy(g.slots[0])  # what pickling over the wire would give
        g.barrier.wait()
        return out

    def all_min(self, values):
        g = self.group
        g.slots[self.rank] = list(values)
        g.barrier.wait()
        if len({len(v) for v in g.slots}) != 1:  # real gloo would hang or fail here
            g.errors.append(f"all_min lengths differ: {g.slots}")
        out = [min(col) for col in zip(*g.slots)]
        if self.rank == 0:
            g.collectives += 1
        g.barrier.wait()
        return out


def build_rank(kind, sync, wan_port, control_port, heads):
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache

    from sglang_pdd.config import PddConfig
    from sglang_pdd.sglang_glue.md.main_drc import MainDrcRuntime

    pool = make_pool(kind, PAGE, seed=None, head_num=heads)
    alloc = PagedTokenToKVPoolAllocator(pool_pages(PAGE) * PAGE, PAGE, pool.dtype, "cpu", pool, need_sort=False)
    tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
                                      page_size=PAGE))
    cfg = PddConfig(role="main", wan_listen=f"127.0.0.1:{wan_port}", control_listen=f"127.0.0.1:{control_port}",
                    wan_timeout_s=10.0, md_staging_mb=64, md_ingest="pool")
    sched = SimpleNamespace(server_args=SimpleNamespace(port=1), tree_cache=tree, page_size=PAGE)
    return MainDrcRuntime(sched, cfg, KEY, tp_sync=sync)


class MdTp:
    """MD's TP ranks, and P's senders: one per MD rank, holding that rank's heads (as P's rank r
    of the same TP would), over the real WAN fan-out into that rank's receiver."""

    def __init__(self, kind="mha", tp=2, kv_heads=2):
        require_sglang_import()
        from sglang_pdd.kv_channel.tp_relayout import kv_heads_of_rank
        from sglang_pdd.launcher.topology import free_port

        self.kind, self.tp = kind, tp
        self.group = FakeTpGroup(tp)
        wan_port = free_port()
        while any(not _port_free(wan_port + r) for r in range(tp)):
            wan_port = free_port()
        control = free_port()
        self.full = make_pool(kind, PAGE, seed=13, head_num=kv_heads)
        self.heads = [kv_heads_of_rank(1 if kind == "mla" else kv_heads, tp, r) for r in range(tp)]
        self.ranks, self.senders = [], []
        try:
            for r in range(tp):
                self.ranks.append(build_rank(kind, self.group.sync(r), wan_port, control, len(self.heads[r])))
            for r in range(tp):
                self.senders.append(Prefill(kind, PAGE, self.ranks[r],
                                            shard_pool(self.full, kind, PAGE, self.heads[r])))
        except BaseException:
            self.close()
            raise

    def step(self):
        """One scheduler iteration on every rank, concurrently (a collective waits for all)."""
        errors = []

        def run(md):
            try:
                md.on_scheduler_iteration()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                self.group.barrier.abort()

        threads = [threading.Thread(target=run, args=(md,)) for md in self.ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and not self.group.errors, (errors, self.group.errors)
        self.assert_alike()

    def assert_alike(self):
        """What SGLang needs after every iteration: the ranks' allocators, trees and rooms alike."""
        first = self.ranks[0]
        for md in self.ranks[1:]:
            assert md.ops.allocator.available_size() == first.ops.allocator.available_size()
            assert md.held_tokens == first.held_tokens
            assert md.ops.tree.evictable_size() == first.ops.tree.evictable_size()
            assert md.ops.tree.protected_size() == first.ops.tree.protected_size()
            assert {k: e.status for k, e in md.table.rooms.items()} == \
                {k: e.status for k, e in first.table.rooms.items()}
        for md in self.ranks:
            assert conserved(md)

    def call(self, command):
        """A control-API command on rank 0, answered within one lockstep iteration."""
        fut = self.ranks[0].commands.submit(command)
        self.step()
        assert fut.done()
        return fut.result(timeout=0)

    def step_until(self, predicate, timeout=20.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.step()
            if predicate():
                return
            time.sleep(0.01)
        raise AssertionError("timed out")

    def statuses(self, room):
        return [getattr(md.table.rooms.get(room), "status", None) for md in self.ranks]

    def settle(self):
        self.step_until(lambda: all(md.held_tokens == 0 for md in self.ranks))

    def close(self):
        for p in self.senders:
            p.fanout.close()
        for md in self.ranks:
            md.close()


def _port_free(port):
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
