"""Approximate, bounded index of which token prefixes each backend instance has cached.

The router uses it to estimate, without asking anyone, how much of a prompt an instance
(typically a Prefill server, keyed by its URL) already holds in its radix cache. Main
Decode's exact hit comes from MD itself; this is only a cheap guess, modelled on llm-d's
prefix-cache scorer and SGLang's cache-aware router. The simulator (`sglang_pdd.sim`)
uses the same index for its P and MD affinity, fed with the trace's block hashes through
the `*_blocks` methods, so the simulated router matches prefixes like the real one.

How: a prompt is cut into fixed blocks of `block_tokens` token ids (a trailing partial
block is ignored, as caches hit in whole pages) and the blocks are chain-hashed, so the
hash of block i stands for the whole prefix of blocks 0..i. An instance "has" a prefix of
k blocks when the index holds the hashes of blocks 0..k-1 for it; matching walks from
block 0 and stops at the first missing hash.

Why approximate: the index only sees what the router sent (not the backend's own
evictions), it rounds down to whole blocks, and its own LRU bound may forget prefixes
that are still cached. A wrong guess only costs a less good path choice, never
correctness.

Not thread-safe: the router runs on one asyncio loop, so no locks.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from typing import Dict, Hashable, List, Sequence, Tuple

DEFAULT_BLOCK_TOKENS = 64

# Chain seed for block 0. Fixed bytes, so hashes agree across processes and restarts
# (Python's hash() is salted per process and would not).
_ROOT = b"\x00" * 8


def block_hashes(token_ids: Sequence[int], block_tokens: int = DEFAULT_BLOCK_TOKENS) -> List[int]:
    """Chained 64-bit hashes of the full `block_tokens`-sized blocks of `token_ids`.

    hash[i] = blake2b(hash[i-1] || block_i), so equal hashes at position i mean equal
    prefixes up to and including block i (up to a 2**-64 collision chance).
    """
    if block_tokens <= 0:
        raise ValueError("block_tokens must be > 0")
    pack = struct.Struct(f"<{block_tokens}Q").pack
    out: List[int] = []
    prev = _ROOT
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        try:
            payload = pack(*token_ids[start:start + block_tokens])
        except struct.error as e:
            raise ValueError(f"token ids must be ints in [0, 2**64): {e}") from None
        prev = hashlib.blake2b(prev + payload, digest_size=8).digest()
        out.append(int.from_bytes(prev, "little"))
    return out


def touch_chain(lru: "OrderedDict[Hashable, None]", hashes: Sequence[Hashable]) -> None:
    """Make a prompt's chained block hashes the most recently used in `lru` (adding those it
    lacks): the deepest block first and block 0 last, so block 0 is the most recent and the
    LRU evicts chain tails before their roots, as a radix cache evicts leaves (evicting a root
    first would leave its whole tail unmatchable while it still used memory). The simulator's
    block caches touch the same way. A plain loop: OrderedDict.update and map(move_to_end)
    measured 2x slower on CPython 3.11."""
    move_to_end = lru.move_to_end
    for h in reversed(hashes):
        if h in lru:
            move_to_end(h)
        else:
            lru[h] = None  # a new key lands at the recent end already


class PrefixIndex:
    """Per-instance LRU set of block hashes, at most `capacity_blocks_per_instance` each.

    The core works on sequences of chained block hashes (`record_blocks`, `match_blocks`,
    `best_blocks`): the simulator feeds it the Mooncake trace's `hash_ids` directly. The
    router's token-id methods (`record`, `match`, `best`) hash with `block_hashes` and call
    them. Any hashable works as a block hash, as long as equal hashes at position i mean
    equal prefixes up to block i.

    Memory is bounded by capacity_blocks_per_instance * number of instances; call
    `forget` for an instance that restarted (its cache is empty) or left.
    """

    def __init__(self, capacity_blocks_per_instance: int, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> None:
        if capacity_blocks_per_instance <= 0:
            raise ValueError("capacity_blocks_per_instance must be > 0")
        if block_tokens <= 0:
            raise ValueError("block_tokens must be > 0")
        self.capacity_blocks_per_instance = capacity_blocks_per_instance
        self.block_tokens = block_tokens
        # instance -> block hashes, least recently used first (values unused).
        self._blocks: Dict[Hashable, "OrderedDict[Hashable, None]"] = {}
        self._evicted_blocks = 0
        self._records = 0

    # ---- block-hash core -----------------------------------------------------------------

    def record_blocks(self, instance: Hashable, hashes: Sequence[Hashable]) -> None:
        """The instance now holds the prefix whose chained block hashes are `hashes`."""
        self._records += 1
        if not hashes:
            return
        lru = self._blocks.get(instance)
        if lru is None:
            lru = self._blocks[instance] = OrderedDict()
        touch_chain(lru, hashes)
        excess = len(lru) - self.capacity_blocks_per_instance
        if excess > 0:
            popitem = lru.popitem
            for _ in range(excess):
                popitem(last=False)
            self._evicted_blocks += excess

    def match_blocks(self, instance: Hashable, hashes: Sequence[Hashable]) -> int:
        """Leading blocks of `hashes` that `instance` holds (stops at the first missing one).

        A pure query: it does not refresh LRU order; `record_blocks` does once the request
        is sent.
        """
        lru = self._blocks.get(instance)
        if not lru:
            return 0
        matched = 0
        for h in hashes:
            if h not in lru:
                break  # chain broken: longer prefixes through this block are not cached
            matched += 1
        return matched

    def best_blocks(self, instances: Sequence[Hashable], hashes: Sequence[Hashable]) -> Tuple[Hashable, int]:
        """The instance holding the longest prefix of `hashes`, and that prefix in blocks.

        Ties (including no hit anywhere) go to the earliest in `instances`, so the result
        is deterministic; the caller orders `instances` by its own preference (e.g. load).
        """
        if not instances:
            raise ValueError("no instances to choose from")
        blocks = self._blocks
        n = len(hashes)
        best_instance, best = instances[0], 0
        for inst in instances:
            if best >= n:
                break  # nobody can beat a whole-prompt match; earlier instances win ties
            lru = blocks.get(inst)
            # To beat `best` an instance must hold block `best` (and all before it): one
            # lookup rules most instances out before walking the chain.
            if not lru or hashes[best] not in lru:
                continue
            matched = 0
            for h in hashes:
                if h not in lru:
                    break
                matched += 1
            if matched > best:
                best_instance, best = inst, matched
        return best_instance, best

    # ---- token-id wrappers (the router) ----------------------------------------------------

    def record(self, instance: Hashable, token_ids: Sequence[int]) -> None:
        """The instance now holds this prompt's prefix (it was just sent there)."""
        self.record_blocks(instance, block_hashes(token_ids, self.block_tokens))

    def match(self, instance: Hashable, token_ids: Sequence[int]) -> int:
        """Estimated cached tokens of `token_ids` on `instance` (a multiple of block_tokens).

        A pure query: it does not refresh LRU order; `record` does once the request is sent.
        """
        return self.match_blocks(instance, block_hashes(token_ids, self.block_tokens)) * self.block_tokens

    def best(self, instances: Sequence[Hashable], token_ids: Sequence[int]) -> Tuple[Hashable, int]:
        """The instance with the longest estimated cached prefix, and that prefix in tokens.

        Ties (including no hit anywhere) go to the earliest in `instances`, so the result
        is deterministic; the caller orders `instances` by its own preference (e.g. load).
        """
        if not instances:
            raise ValueError("no instances to choose from")
        hashes = block_hashes(token_ids, self.block_tokens)  # hashed once for all instances
        inst, blocks = self.best_blocks(instances, hashes)
        return inst, blocks * self.block_tokens

    # ---- bookkeeping -------------------------------------------------------------------

    def forget(self, instance: Hashable) -> int:
        """Drop everything known about `instance` (restarted or gone); returns blocks dropped."""
        lru = self._blocks.pop(instance, None)
        return len(lru) if lru is not None else 0

    def lru_orders(self) -> Dict[Hashable, List[Hashable]]:
        """Each instance's block hashes, least recently used first."""
        return {inst: list(lru) for inst, lru in self._blocks.items()}

    def stats(self) -> dict:
        per_instance = {inst: len(lru) for inst, lru in self._blocks.items()}
        return {
            "block_tokens": self.block_tokens,
            "capacity_blocks_per_instance": self.capacity_blocks_per_instance,
            "instances": len(per_instance),
            "blocks": sum(per_instance.values()),
            "blocks_per_instance": per_instance,
            "records": self._records,
            "evicted_blocks": self._evicted_blocks,
        }
