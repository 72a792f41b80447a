"""The block cache's eviction against the plain walk it stands for.

`BlockCache._evict` walks from the oldest block, moving each pinned block it passes to the
recent end, until it has evicted enough or passed every block; a long walk is finished by a
scan in C. The reference below is that walk, block by block, on an OrderedDict; both run the
same random session-like operations and must agree on every match, the HBM order, the host
order and the pins after every step.
"""

import random
from collections import OrderedDict

import pytest

from sglang_pdd.sim import cache as cache_mod
from sglang_pdd.sim.cache import BlockCache
from sglang_pdd.sim.workload import BLOCK_TOKENS


class WalkingCache:
    """The reference: an eager LRU evicting block by block."""

    def __init__(self, capacity_blocks: int, host_blocks: int) -> None:
        self.cap, self.host_cap = capacity_blocks, host_blocks
        self.blocks: OrderedDict = OrderedDict()
        self.host: OrderedDict = OrderedDict()
        self.pins: dict = {}

    def match(self, ids, touch=True) -> int:
        n = 0
        loaded = []
        for h in ids:
            if h in self.blocks:
                pass
            elif self.host_cap and h in self.host:
                loaded.append(h)
            else:
                break
            n += 1
        if touch and n:
            for h in loaded:
                del self.host[h]
            self._touch(ids[:n])
            if loaded:
                self._evict()
        return n

    def insert(self, ids) -> None:
        for h in ids:
            if h not in self.blocks and h in self.host:
                del self.host[h]
        self._touch(ids)
        self._evict()

    def _touch(self, ids) -> None:
        for h in reversed(ids):
            if h in self.blocks:
                self.blocks.move_to_end(h)
            else:
                self.blocks[h] = None

    def _evict(self) -> None:
        skipped = 0
        while len(self.blocks) > self.cap and skipped < len(self.blocks):
            h, _ = self.blocks.popitem(last=False)
            if h in self.pins:
                self.blocks[h] = None
                skipped += 1
            elif self.host_cap:
                self.host[h] = None
                if len(self.host) > self.host_cap:
                    self.host.popitem(last=False)

    def pin(self, ids) -> None:
        for h in ids:
            self.pins[h] = self.pins.get(h, 0) + 1

    def unpin(self, ids) -> None:
        for h in ids:
            self.pins[h] -= 1
            if not self.pins[h]:
                del self.pins[h]


def _prompts(rng: random.Random, n: int):
    """Chained prompts: sessions that grow, share a system prompt, and sometimes reset."""
    next_id = iter(range(10_000, 10**9))
    system = [next(next_id) for _ in range(3)]
    sessions = [list(system) for _ in range(12)]
    for _ in range(n):
        s = rng.randrange(len(sessions))
        if rng.random() < 0.08:
            sessions[s] = list(system)
        sessions[s] += [next(next_id) for _ in range(rng.randrange(1, 9))]
        yield list(sessions[s])


@pytest.mark.parametrize("long_walk", [0, 1, 3, 32])
@pytest.mark.parametrize("host_blocks", [0, 40])
@pytest.mark.parametrize("seed", range(4))
def test_eviction_equals_the_block_by_block_walk(monkeypatch, long_walk, host_blocks, seed):
    monkeypatch.setattr(cache_mod, "_LONG_WALK", long_walk)
    rng = random.Random(seed)
    cap = 48
    cache = BlockCache(cap * BLOCK_TOKENS, host_blocks * BLOCK_TOKENS)
    ref = WalkingCache(cap, host_blocks if cap else 0)
    in_flight = []  # pinned prefixes, as transfers in flight hold them
    long_scans = 0
    for ids in _prompts(rng, 600):
        touch = rng.random() < 0.7
        assert cache.match_prefix_blocks(ids, touch=touch) == ref.match(ids, touch=touch)
        if rng.random() < 0.6:  # a transfer starts: its hit stays pinned until it lands
            n = ref.match(ids, touch=False)
            cache.pin(ids[:n])
            ref.pin(ids[:n])
            in_flight.append(ids[:n])
        while in_flight and rng.random() < 0.35:
            done = in_flight.pop(rng.randrange(len(in_flight)))
            cache.unpin(done)
            ref.unpin(done)
        pinned_present = sum(h in ref.pins for h in ref.blocks)
        long_scans += pinned_present > long_walk
        cache.insert(ids)
        ref.insert(ids)
        blocks, host = cache.lru_order()
        assert blocks == list(ref.blocks)
        assert host == list(ref.host)
        assert cache._pins == ref.pins
    assert long_scans > 50  # the scan, not only the walk, was exercised


def test_a_cache_of_only_pinned_blocks_keeps_them_in_order_and_evicts_nothing_else():
    cache = BlockCache(4 * BLOCK_TOKENS)
    cache.insert([1, 2, 3, 4])
    cache.pin([1, 2, 3, 4])
    cache.insert([5, 6])  # 6 blocks, 4 pinned: only the two new ones can go
    blocks, _ = cache.lru_order()
    assert sorted(blocks) == [1, 2, 3, 4]
    assert blocks == [4, 3, 2, 1]  # passed by the walk, each moved to the end in turn
