"""Prefix-block cache: LRU over 512-token blocks keyed by trace hash ids, with an optional
host (DRAM) tier behind it.

Block ids chain over the prefix, so "longest run of cached ids from the start" is exactly
what a radix cache would match. Like SGLang's radix cache we evict least-recently-used
blocks. Blocks a transfer in flight relies on (MD's hit, decided when the transfer
starts) are pinned until it lands, as SGLang locks a matched radix node; blocks of running
requests otherwise live in the instance's separate running pool (hardware.HardwareProfile).

The host tier is SGLang's HiCache: a block evicted from HBM is written back to host memory
(its own LRU, `host_capacity_tokens`); a prefix match runs over both tiers, and the host
part of a hit is loaded back into HBM, which costs the caller its transfer time
(`host_hits` after each match says how many blocks came from the host).
"""

from __future__ import annotations

from collections import OrderedDict, _count_elements, deque
from itertools import compress, islice, takewhile
from operator import not_
from typing import Sequence

from sglang_pdd.router.backends.prefix_index import touch_chain
from sglang_pdd.sim.workload import BLOCK_TOKENS


# Pinned blocks an eviction walk passes one by one before it scans the rest in C (a walk
# through an MD cache full of blocks pinned by transfers in flight passed them all, on
# every insert).
_LONG_WALK = 32


class BlockCache:
    def __init__(self, capacity_tokens: int, host_capacity_tokens: int = 0) -> None:
        self.capacity_blocks = max(0, capacity_tokens // BLOCK_TOKENS)
        self.host_capacity_blocks = max(0, host_capacity_tokens // BLOCK_TOKENS) if self.capacity_blocks else 0
        self._blocks: "OrderedDict[int, None]" = OrderedDict()
        self._host: "OrderedDict[int, None]" = OrderedDict()
        self._pins: dict = {}  # block id -> number of transfers relying on it
        self.host_hits = 0  # blocks of the last match that came from the host tier

    def __len__(self) -> int:
        return len(self._blocks)

    def lru_order(self) -> tuple:
        """(HBM blocks, host blocks), each least recently used first."""
        return list(self._blocks), list(self._host)

    def match_prefix_blocks(self, hash_ids: Sequence[int], touch: bool = True) -> int:
        """Number of leading blocks present in either tier (and mark them recently used;
        host blocks of the match are loaded back into HBM). `host_hits` is set to how many
        of them were on the host."""
        blocks = self._blocks
        # The leading run of HBM blocks, counted in C (a prompt is ~60 blocks).
        n = len(list(takewhile(blocks.__contains__, hash_ids)))
        self.host_hits = 0
        host = self._host
        loaded = None
        if host:
            loaded = []
            for h in hash_ids[n:]:  # the match goes on through host blocks (and HBM ones after them)
                if h in host:
                    loaded.append(h)
                elif h not in blocks:
                    break
                n += 1
            self.host_hits = len(loaded)
        if touch:
            if loaded:
                for h in loaded:
                    del host[h]
                self._touch(hash_ids[:n])
                self._evict()
            else:  # every matched block is in HBM: move each to the end, deepest first
                move_to_end = blocks.move_to_end
                for h in reversed(hash_ids[:n]):
                    move_to_end(h)
        return n

    def _touch(self, hash_ids: Sequence[int]) -> None:
        touch_chain(self._blocks, hash_ids)  # leaf first, root last, as the router's index

    def pin(self, hash_ids: Sequence[int]) -> None:
        _count_elements(self._pins, hash_ids)  # pins[h] += 1 for each, in C (Counter's helper)

    def unpin(self, hash_ids: Sequence[int]) -> None:
        pins = self._pins
        for h in hash_ids:
            left = pins[h] - 1
            if left:
                pins[h] = left
            else:
                del pins[h]

    def is_pinned(self, h: int) -> bool:
        return h in self._pins

    def in_host(self, h: int) -> bool:
        return h in self._host

    def insert(self, hash_ids: Sequence[int]) -> None:
        if self.capacity_blocks == 0:
            return
        host = self._host
        if host:
            blocks = self._blocks
            for h in hash_ids:  # a block written to HBM again leaves the host copy behind
                if h not in blocks and h in host:
                    del host[h]
        self._touch(hash_ids)
        self._evict()

    def _evict(self) -> None:
        blocks, pins = self._blocks, self._pins
        excess = len(blocks) - self.capacity_blocks
        if excess <= 0:
            return
        host_cap = self.host_capacity_blocks
        popitem = blocks.popitem
        if not pins:  # the common case (P's caches are never pinned): evict in one loop
            if not host_cap:
                for _ in range(excess):
                    popitem(last=False)
                return
            self._to_host([popitem(last=False)[0] for _ in range(excess)])
            return
        # Evict least recent unpinned blocks (to the host tier, if any); pinned ones move to
        # the recent end. If only pinned blocks are left the cache runs over its size until
        # they are released.
        evicted: list = []
        skipped = 0
        while len(blocks) > self.capacity_blocks and skipped < len(blocks):
            if skipped == _LONG_WALK:
                self._evict_past_pins(len(blocks) - self.capacity_blocks, skipped, evicted)
                return
            h, _ = popitem(last=False)
            if h in pins:
                blocks[h] = None
                skipped += 1
            else:
                evicted.append(h)
        if host_cap and evicted:
            self._to_host(evicted)

    def _evict_past_pins(self, excess: int, moved: int, evicted: list) -> None:
        """Finishes `_evict`'s walk (so far: `evicted` gone, `moved` pinned blocks sent to
        the recent end) without walking. The walk would go on over the `total` blocks
        before those, moving each pinned one to the end, until it had evicted `excess` more
        or passed them all. So a scan in C finds the first `excess` unpinned ones, which go;
        the pinned ones before the last of those belong behind all the rest, in their
        order: either they move to the end or the rest moves to the front, whichever is
        fewer."""
        blocks, pins = self._blocks, self._pins
        total = len(blocks) - moved
        order: list = []
        pinned: list = []
        free: list = []  # positions in `order` of unpinned blocks
        oldest_first = islice(blocks, total)
        size = 2 * excess + 16
        while len(free) < excess:
            chunk = list(islice(oldest_first, size))
            if not chunk:
                break
            flags = list(map(pins.__contains__, chunk))
            free += compress(range(len(order), len(order) + len(chunk)), map(not_, flags))
            order += chunk
            pinned += flags
            size *= 4
        if len(free) >= excess:
            free = free[:excess]
            walked = free[-1] + 1
        else:
            walked = total
        gone = list(map(order.__getitem__, free))
        deque(map(blocks.__delitem__, gone), 0)
        evicted += gone
        passed = walked - len(gone)  # pinned blocks the walk moves to the end
        rest = len(blocks) - passed  # the blocks they belong behind
        if passed and rest:
            move_to_end = blocks.move_to_end
            if passed <= rest:
                for h in compress(order[:walked], pinned[:walked]):
                    move_to_end(h)
            else:
                for h in reversed(list(islice(blocks, passed, None))):
                    move_to_end(h, last=False)
        if self.host_capacity_blocks and evicted:
            self._to_host(evicted)

    def _to_host(self, evicted: list) -> None:
        """HBM's evicted blocks, oldest first, are written back to the host tier, whose
        oldest blocks it cannot hold are dropped."""
        host = self._host
        for h in evicted:
            host[h] = None  # a block already there keeps its place
        drop = len(host) - self.host_capacity_blocks
        if drop > 0:
            host_pop = host.popitem
            for _ in range(drop):
                host_pop(last=False)
