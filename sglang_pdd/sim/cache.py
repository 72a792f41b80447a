"""Prefix-block cache: LRU over 512-token blocks keyed by trace hash ids.

Block ids chain over the prefix, so "longest run of cached ids from the start" is exactly
what a radix cache would match. Like SGLang's radix cache we evict least-recently-used
blocks; unlike it we do not pin blocks of running requests (their KV lives in the
separate running pool of the instance, see hardware.HardwareProfile).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from sglang_pdd.workload import BLOCK_TOKENS


class BlockCache:
    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_blocks = max(0, capacity_tokens // BLOCK_TOKENS)
        self._blocks: "OrderedDict[int, None]" = OrderedDict()

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

    def insert(self, hash_ids: Sequence[int]) -> None:
        if self.capacity_blocks == 0:
            return
        self._touch(hash_ids)
        blocks = self._blocks
        while len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)
