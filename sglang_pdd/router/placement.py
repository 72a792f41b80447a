"""Which instance of a role gets a request: load-aware, with session (prefix) affinity.

Pure logic, shared by the real router and the simulator. Affinity matters on Main
Decode: the MD that holds a session's prefix in its decode radix cache (DRC) only needs
the uncached suffix over the WAN, so we keep sending the session there unless that MD is
overloaded beyond a bound, when paying for a bigger transfer is cheaper than queueing.
Which instance holds a session's prefix comes from `prefix_index.PrefixIndex`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Optional, Sequence


# The PDD router's MD choice (router/pools.py's Pools.pick): load = the MD's flows in flight,
# and a session stays on the MD holding its prefix unless that MD has this many more flows
# in flight than the least loaded one. The simulator places MD with the same rule
# (tests/unit/sim/test_sim_router_agreement.py checks it against Pools.pick).
MD_AFFINITY_EXCESS_FLOWS = 4


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



def pick_prefill(loads: Sequence[InstanceLoad], owner: Optional[Hashable], held_tokens: int) -> Hashable:
    """P for a request. `loads` are the prefill tokens each P has in flight (prompts sent to
    it, less the prefix the router expects it to hold, until its leg replies): its queue as
    the router sees it. The P holding the longest cached prefix of the prompt (`owner`,
    `held_tokens` of it) keeps the request unless its tokens in flight exceed the least
    loaded P's by more than that prefix: moving costs recomputing the prefix, staying costs
    waiting behind the queue, both counted in prefill tokens.

    SGLang's cache-aware rule weighs the same two costs; counted in flows in flight with a
    fixed bound (this router's earlier rule) two P with equal counts could hold seconds
    of different prefill work, and the simulator placed P better with tokens
    (docs/sim-notebook.md, "One P rule").
    """
    return pick_instance(loads, owner, max_affinity_excess=held_tokens)
