"""Prefix-block cache: LRU over 512-token blocks keyed by trace hash ids.

Block ids chain over the prefix, so "longest run of cached ids from the start" is exactly
what a radix cache would match. Like SGLang's radix cache we evict least-recently-used
blocks. Blocks a transfer in flight relies on (MD's hit, decided when the transfer
starts) are pinned until it lands, as SGLang locks a matched radix node; blocks of running
requests otherwise live in the instance's separate running pool (hardware.HardwareProfile).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from sglang_pdd.workload import BLOCK_TOKENS


class BlockCache:
    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_blocks = max(0, capacity_tokens // BLOCK_TOKENS)
        self._blocks: "OrderedDict[int, None]" = OrderedDict()
        self._pins: dict = {}  # block id -> number of transfers relying on it

    def __len__(self) -> int:
        return len(self._blocks)

    def match_prefix_blocks(self, hash_ids: Sequence[int], touch: bool = True) -> int:
        """Number of leading blocks present (and mark them recently used)."""
        blocks = self._blocks
        n = 0
        for h in hash_ids:
            if h not in blocks:
                break
            n += 1
        if touch:
            self._touch(hash_ids[:n])
        return n

    def _touch(self, hash_ids: Sequence[int]) -> None:
        # Leaf first, root last: the root ends most recent, so like a radix tree we evict
        # leaves before the prefixes they hang from.
        blocks = self._blocks
        move_to_end = blocks.move_to_end
        for h in reversed(hash_ids):
            if h in blocks:
                move_to_end(h)
            else:
                blocks[h] = None  # a new key lands at the recent end already

    def pin(self, hash_ids: Sequence[int]) -> None:
        pins = self._pins
        for h in hash_ids:
            pins[h] = pins.get(h, 0) + 1

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

    def insert(self, hash_ids: Sequence[int]) -> None:
        if self.capacity_blocks == 0:
            return
        self._touch(hash_ids)
        blocks, pins = self._blocks, self._pins
        excess = len(blocks) - self.capacity_blocks
        if excess <= 0:
            return
        if not pins:  # the common case (P's caches are never pinned): evict in one loop
            popitem = blocks.popitem
            for _ in range(excess):
                popitem(last=False)
            return
        skipped = 0
        # Evict least recent unpinned blocks; pinned ones move to the recent end. If only
        # pinned blocks are left the cache runs over its size until they are released.
        while len(blocks) > self.capacity_blocks and skipped < len(blocks):
            h, _ = blocks.popitem(last=False)
            if h in pins:
                blocks[h] = None
                skipped += 1
