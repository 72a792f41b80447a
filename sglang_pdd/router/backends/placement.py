"""Which instance of a role gets a request: load-aware, with session (prefix) affinity.

Pure logic, shared by the real router and the simulator. Affinity matters on Main
Decode: the MD that holds a session's prefix in its decode radix cache (DRC) only needs
the uncached suffix over the WAN, so we keep sending the session there unless that MD is
so busy that its longer decode steps cost the turn more than re-sending the prefix would
(`pick_main`: both costs in seconds).
Which instance holds a session's prefix comes from `prefix_index.PrefixIndex`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Optional, Sequence


# MD's decode step grows by about this much per flow in flight, until the router has measured
# it (router/backends/loads.py: the slope of MD's step time on its batch size, SGLang's /v1/loads
# decode moments). 1 ms: the simulator's default MD (sim/hardware.py's CHIP_B) at a 30k-token
# context, 0.22 ms per sequence plus 0.66 ms of KV read.
MD_FLOW_STEP_S_DEFAULT = 1e-3
# A request's decode steps when it does not say (no max_new_tokens): what a moved turn's extra
# step time is multiplied by.
EXPECTED_OUTPUT_TOKENS_DEFAULT = 256


@dataclass(frozen=True)
class MdMoveCost:
    """What moving a turn off the MD that holds its prefix weighs, in seconds: re-sending the
    prefix over the WAN (``kv_bytes_per_token`` at the link's fair share of
    ``wan_bytes_per_s``) against the longer decode steps of a busier MD (``flow_step_s`` per
    flow in flight, each of the turn's output tokens)."""
    kv_bytes_per_token: float
    wan_bytes_per_s: float
    flow_step_s: float = MD_FLOW_STEP_S_DEFAULT

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token < 0 or self.wan_bytes_per_s <= 0 or self.flow_step_s < 0:
            raise ValueError("need kv_bytes_per_token >= 0, wan_bytes_per_s > 0 and flow_step_s >= 0")


def md_resend_s(matched_tokens: int, wan_transfers: int, cost: MdMoveCost) -> float:
    """Seconds to send the held prefix again over the WAN, at the share one more transfer
    gets beside the ``wan_transfers`` already in flight."""
    return max(0, matched_tokens) * cost.kv_bytes_per_token * (1 + max(0, wan_transfers)) / cost.wan_bytes_per_s


def md_affinity_excess_flows(matched_tokens: int, output_tokens: int, wan_transfers: int,
                             cost: MdMoveCost) -> float:
    """Flows in flight beyond the least loaded MD's that the MD holding ``matched_tokens`` of
    the prompt may have before a move pays: each excess flow costs the turn ``flow_step_s`` on
    each of its ``output_tokens`` steps; moving costs ``md_resend_s``. Both in seconds."""
    per_flow_s = cost.flow_step_s * max(1, output_tokens)
    resend_s = md_resend_s(matched_tokens, wan_transfers, cost)
    return resend_s / per_flow_s if per_flow_s > 0 else math.inf


def pick_main(loads: Sequence["InstanceLoad"], owner: Optional[Hashable], matched_tokens: int,
              output_tokens: Optional[int], wan_transfers: int, cost: MdMoveCost) -> Hashable:
    """MD for a request. ``loads``: each MD's flows in flight (the router's count). The MD
    holding the longest cached prefix (``owner``, ``matched_tokens`` of the prompt) keeps the
    turn unless its excess flows over the least loaded MD cost more time than re-sending
    that prefix over the WAN (``md_affinity_excess_flows``). The router (router/backends/pools.py)
    and the simulator (sim/cluster.py's pick_md) both place MD here."""
    out = EXPECTED_OUTPUT_TOKENS_DEFAULT if output_tokens is None else output_tokens
    bound = md_affinity_excess_flows(matched_tokens, out, wan_transfers, cost) if owner is not None else 0.0
    return pick_instance(loads, owner, max_affinity_excess=bound)


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
