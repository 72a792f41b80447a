"""Which instance of a role gets a request: load-aware, with session (prefix) affinity.

Pure logic, shared by the real router and the simulator. Affinity matters on Main
Decode: the MD that holds a session's prefix in its decode radix cache (DRC) only needs
the uncached suffix over the WAN, so we keep sending the session there unless that MD is
overloaded beyond a bound, when paying for a bigger transfer is cheaper than queueing.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Optional, Sequence


@dataclass(frozen=True)
class InstanceLoad:
    instance_id: Hashable
    load: float  # any monotone load measure, e.g. used KV fraction or queued tokens / capacity


def pick_instance(
    loads: Sequence[InstanceLoad],
    affinity_id: Optional[Hashable] = None,
    max_affinity_excess: float = 0.25,
    max_load: Optional[float] = None,
) -> Hashable:
    """Least-loaded instance, except that `affinity_id` wins while its load is within
    `max_affinity_excess` of the least load (and under `max_load` when given).

    Ties go to the earliest instance in `loads`, so the result is deterministic. A good
    bound is the cost of losing the cache, in load units (e.g. the time to recompute or
    re-transfer the prefix the affine instance holds): moving pays off only beyond it.
    """
    if not loads:
        raise ValueError("no instances to pick from")
    least = min(loads, key=lambda x: x.load)  # min() keeps the first of equal loads
    if affinity_id is None:
        return least.instance_id
    for inst in loads:
        if inst.instance_id == affinity_id:
            overloaded = inst.load > least.load + max_affinity_excess or (
                max_load is not None and inst.load > max_load
            )
            return least.instance_id if overloaded else inst.instance_id
    return least.instance_id


class PrefixOwnerIndex:
    """Approximate global prefix index: block hash -> the instance that last cached it.

    Block hashes chain over the whole prefix (as in the Mooncake trace format and in
    SGLang's radix cache pages), so the owner of the deepest known block of a request is
    the instance most likely to hold its longest prefix. Bounded by LRU eviction.
    """

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError("capacity_blocks must be > 0")
        self.capacity_blocks = capacity_blocks
        self._owner: "OrderedDict[Hashable, Hashable]" = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def owner_of_prefix(self, block_hashes: Sequence[Hashable]) -> Optional[Hashable]:
        owner = None
        for h in block_hashes:
            o = self._owner.get(h)
            if o is None:
                break
            owner = o
        return owner

    def record(self, block_hashes: Sequence[Hashable], instance_id: Hashable) -> None:
        owners = self._owner
        move_to_end = owners.move_to_end
        for h in block_hashes:
            known = h in owners
            owners[h] = instance_id
            if known:
                move_to_end(h)
        while len(owners) > self.capacity_blocks:
            owners.popitem(last=False)
