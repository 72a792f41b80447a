"""Heterogeneous tensor parallelism on the WAN path (pure: which bytes go where, no I/O).

With TP, each rank has its own KV pool. SGLang shards KV heads like this (QKVParallelLinear):
with H KV heads and TP t, if H >= t rank r holds the contiguous heads [r*H/t, (r+1)*H/t);
if H < t each head is replicated on t/H ranks and rank r holds head r // (t/H). An MLA pool is
the degenerate case H = 1: every rank holds the same latent.

P runs TP a, MD TP b. The plan moves every KV head across the WAN exactly once (from one P rank
that holds it, to one MD rank that needs it) and fills MD's other replicas with local copies
inside MD's datacenter. So MLA sends one rank's latent, and MHA with P replicating heads sends
no duplicates. A slice is a run of heads that is contiguous on both ends, i.e. one contiguous
byte range of every token row in each pool (rows are [local heads, head_dim]).
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_pdd.protocol import MAX_MD_TP  # noqa: F401 — the largest MD TP size P accepts (one WAN leg per rank)

from .layout import RowSlice


class TpLayoutError(ValueError):
    """A KV head count SGLang cannot shard over the given TP size."""


def kv_heads_of_rank(total_kv_heads: int, tp_size: int, rank: int) -> range:
    """The global KV head ids rank ``rank`` of a TP ``tp_size`` group holds (SGLang's sharding)."""
    _check_shardable(total_kv_heads, tp_size)
    if not 0 <= rank < tp_size:
        raise TpLayoutError(f"rank {rank} out of range for TP {tp_size}")
    if total_kv_heads >= tp_size:
        per_rank = total_kv_heads // tp_size
        return range(rank * per_rank, (rank + 1) * per_rank)
    replicas = tp_size // total_kv_heads
    return range(rank // replicas, rank // replicas + 1)


def _check_shardable(total_kv_heads: int, tp_size: int) -> None:
    if total_kv_heads <= 0 or tp_size <= 0:
        raise TpLayoutError(f"KV heads and TP size must be positive, got {total_kv_heads} and {tp_size}")
    if total_kv_heads >= tp_size and total_kv_heads % tp_size:
        raise TpLayoutError(f"{total_kv_heads} KV heads do not divide over TP {tp_size}")
    if total_kv_heads < tp_size and tp_size % total_kv_heads:
        raise TpLayoutError(f"TP {tp_size} is not a multiple of {total_kv_heads} KV heads")


@dataclass(frozen=True)
class HeadSlice:
    """``num_heads`` heads from local head ``src_offset`` of ``src_rank`` to local head
    ``dst_offset`` of ``dst_rank`` (global heads ``first_head``..)."""

    src_rank: int
    dst_rank: int
    first_head: int
    num_heads: int
    src_offset: int
    dst_offset: int

    def src_bytes(self, head_bytes: int) -> tuple[int, int]:
        """Byte range [start, end) of the slice within one token row of the source pool."""
        return self.src_offset * head_bytes, (self.src_offset + self.num_heads) * head_bytes

    def dst_bytes(self, head_bytes: int) -> tuple[int, int]:
        return self.dst_offset * head_bytes, (self.dst_offset + self.num_heads) * head_bytes


@dataclass(frozen=True)
class TpRelayoutPlan:
    kind: str  # "mha" or "mla"
    total_kv_heads: int  # 1 for MLA (the latent)
    src_tp: int
    dst_tp: int
    wan: tuple[HeadSlice, ...]  # P rank -> MD rank, across the WAN
    local: tuple[HeadSlice, ...]  # MD rank -> MD rank replicas, inside MD (after the WAN slice landed)

    @property
    def senders(self) -> tuple[int, ...]:
        """P ranks that send anything (the others open no WAN stream)."""
        return tuple(sorted({s.src_rank for s in self.wan}))

    def wan_bytes_per_token(self, head_bytes: int) -> int:
        """Per layer and buffer: what crosses the WAN per token (each head once)."""
        return sum(s.num_heads for s in self.wan) * head_bytes


def plan_tp_relayout(kind: str, total_kv_heads: int, src_tp: int, dst_tp: int) -> TpRelayoutPlan:
    """Where each KV head of P (TP ``src_tp``) lands in MD (TP ``dst_tp``). MLA: pass
    ``total_kv_heads=1`` or anything (the latent is one replicated "head")."""
    if kind not in ("mha", "mla"):
        raise TpLayoutError(f"KV pool kind must be mha or mla, got {kind!r}")
    heads = 1 if kind == "mla" else total_kv_heads
    src_holders = _holders(heads, src_tp)
    dst_holders = _holders(heads, dst_tp)
    wan, local = [], []
    for head in range(heads):
        # spread the sending over P's replicas of a head; the first MD holder receives it
        src = src_holders[head][head % len(src_holders[head])]
        first_dst, *replicas = dst_holders[head]
        wan.append(_one_head(heads, head, (src, src_tp), (first_dst, dst_tp)))
        local += [_one_head(heads, head, (first_dst, dst_tp), (dst, dst_tp)) for dst in replicas]
    return TpRelayoutPlan(kind, heads, src_tp, dst_tp, _merge(wan), _merge(local))


def _holders(total_kv_heads: int, tp_size: int) -> list[list[int]]:
    holders: list[list[int]] = [[] for _ in range(total_kv_heads)]
    for rank in range(tp_size):
        for head in kv_heads_of_rank(total_kv_heads, tp_size, rank):
            holders[head].append(rank)
    return holders


def _one_head(heads: int, head: int, src: tuple[int, int], dst: tuple[int, int]) -> HeadSlice:
    """Global head ``head`` from (rank, tp) ``src`` to (rank, tp) ``dst``."""
    (src_rank, src_tp), (dst_rank, dst_tp) = src, dst
    return HeadSlice(src_rank, dst_rank, head, 1, head - kv_heads_of_rank(heads, src_tp, src_rank).start,
                     head - kv_heads_of_rank(heads, dst_tp, dst_rank).start)


def _merge(slices: list[HeadSlice]) -> tuple[HeadSlice, ...]:
    """Join runs of heads that are contiguous on both ranks (one byte range per token row)."""
    merged: list[HeadSlice] = []
    for s in sorted(slices, key=lambda s: (s.src_rank, s.dst_rank, s.first_head)):
        last = merged[-1] if merged else None
        if (last and (last.src_rank, last.dst_rank) == (s.src_rank, s.dst_rank)
                and last.first_head + last.num_heads == s.first_head
                and last.src_offset + last.num_heads == s.src_offset
                and last.dst_offset + last.num_heads == s.dst_offset):
            merged[-1] = HeadSlice(last.src_rank, last.dst_rank, last.first_head, last.num_heads + s.num_heads,
                                   last.src_offset, last.dst_offset)
        else:
            merged.append(s)
    return tuple(merged)


@dataclass(frozen=True)
class TpShard:
    """Where a server's pool sits in its TP group (from SGLang's KV args)."""

    rank: int = 0
    size: int = 1
    total_kv_heads: int = 1  # the model's KV heads; MLA: 1 (the latent)


@dataclass(frozen=True)
class SenderPart:
    """What one P rank moves of every room to one MD rank: bytes ``[src_offset, src_offset
    + row.width)`` of its own token rows, landing at ``row.offset`` of that MD rank's rows
    (``dst_row_bytes`` wide); ``row.count`` slices (from one or more P ranks) tile each room."""

    row: RowSlice
    src_offset: int
    dst_row_bytes: int

    @property
    def is_whole(self) -> bool:
        return self.row.is_whole(self.dst_row_bytes) and self.src_offset == 0


def plan_wan_to_every_holder(kind: str, total_kv_heads: int, src_tp: int, dst_tp: int) -> TpRelayoutPlan:
    """Like ``plan_tp_relayout`` but every MD rank holding a head receives it over the WAN (MD
    copies nothing between its ranks, so ``local`` is empty): what the WAN fan-out runs. P's
    replicas of a head take turns (round robin over the head's MD holders), so with P and MD
    replicating alike each P replica feeds its own MD replica."""
    if kind not in ("mha", "mla"):
        raise TpLayoutError(f"KV pool kind must be mha or mla, got {kind!r}")
    heads = 1 if kind == "mla" else total_kv_heads
    src_holders, dst_holders = _holders(heads, src_tp), _holders(heads, dst_tp)
    wan = []
    for head in range(heads):
        srcs = src_holders[head]
        for k, dst in enumerate(dst_holders[head]):
            # k = 0 picks what plan_tp_relayout picks: MD TP 1 plans are unchanged
            wan.append(_one_head(heads, head, (srcs[(head + k) % len(srcs)], src_tp), (dst, dst_tp)))
    return TpRelayoutPlan(kind, heads, src_tp, dst_tp, _merge(wan), ())


def sender_parts(kind: str, shard: TpShard, local_token_bytes: int, dst_tp: int = 1) -> list[tuple[int, SenderPart]]:
    """This P rank's slices of each room for an MD on TP ``dst_tp``: ``(md_rank, part)`` for every
    MD rank it sends to (empty if other P ranks send all its heads). Each MD rank's slices (from
    all P ranks) are numbered 0..count-1 by their offset in that rank's row and tile it exactly.
    ``local_token_bytes``: one token row of this rank's pool (its KV heads x head dim x dtype)."""
    plan = plan_wan_to_every_holder(kind, shard.total_kv_heads, shard.size, dst_tp)
    heads_here = len(kv_heads_of_rank(plan.total_kv_heads, shard.size, shard.rank))
    if local_token_bytes % heads_here:
        raise TpLayoutError(f"a {local_token_bytes}-byte token row does not hold {heads_here} KV heads")
    head_bytes = local_token_bytes // heads_here
    parts = []
    for md_rank in range(dst_tp):
        into = sorted((s for s in plan.wan if s.dst_rank == md_rank), key=lambda s: s.dst_offset)
        row_bytes = len(kv_heads_of_rank(plan.total_kv_heads, dst_tp, md_rank)) * head_bytes
        for index, s in enumerate(into):
            if s.src_rank == shard.rank:
                (src, _), (lo, hi) = s.src_bytes(head_bytes), s.dst_bytes(head_bytes)
                parts.append((md_rank, SenderPart(RowSlice(index, len(into), lo, hi - lo), src, row_bytes)))
    return parts
