"""Heterogeneous TP re-layout plan: applied to pools sharded the way SGLang shards them, it
rebuilds exactly MD's shards, each head crosses the WAN once, MLA sends one rank's latent."""

import itertools

import numpy as np
import pytest

from sglang_pdd.kv_channel.layout import RowSlice
from sglang_pdd.kv_channel.tp_relayout import (
    TpLayoutError, TpShard, kv_heads_of_rank, plan_tp_relayout, sender_parts)

HEAD_DIM = 4
TOKENS = 5


def shard(full: np.ndarray, tp: int, rank: int) -> np.ndarray:
    """One rank's pool rows [tokens, local heads, head_dim], per SGLang's sharding."""
    return full[:, list(kv_heads_of_rank(full.shape[1], tp, rank))]


def apply(plan, src_pools: list[np.ndarray], dst_heads_per_rank: int) -> tuple[list[np.ndarray], int]:
    """Run the plan on real arrays: WAN slices first, then MD's local copies. Returns MD's pools
    and the number of head rows that crossed the WAN."""
    dst = [np.full((TOKENS, dst_heads_per_rank, HEAD_DIM), np.nan) for _ in range(plan.dst_tp)]
    crossed = 0
    for s in plan.wan:
        rows = src_pools[s.src_rank][:, s.src_offset:s.src_offset + s.num_heads]
        dst[s.dst_rank][:, s.dst_offset:s.dst_offset + s.num_heads] = rows
        crossed += s.num_heads
    for s in plan.local:
        dst[s.dst_rank][:, s.dst_offset:s.dst_offset + s.num_heads] = dst[s.src_rank][:, s.src_offset:s.src_offset + s.num_heads]
    return dst, crossed


SHAPES = [(heads, a, b) for heads, a, b in itertools.product([1, 2, 4, 8], [1, 2, 4, 8], [1, 2, 4, 8])
          if all((heads % t == 0) if heads >= t else (t % heads == 0) for t in (a, b))]


@pytest.mark.parametrize("heads,src_tp,dst_tp", SHAPES, ids=lambda v: str(v))
def test_mha_plan_rebuilds_md_shards_and_sends_each_head_once(heads, src_tp, dst_tp):
    full = np.random.default_rng(heads * 100 + src_tp * 10 + dst_tp).normal(size=(TOKENS, heads, HEAD_DIM))
    plan = plan_tp_relayout("mha", heads, src_tp, dst_tp)
    src = [shard(full, src_tp, r) for r in range(src_tp)]
    dst, crossed = apply(plan, src, len(kv_heads_of_rank(heads, dst_tp, 0)))
    for rank in range(dst_tp):
        np.testing.assert_array_equal(dst[rank], shard(full, dst_tp, rank))  # no NaN left: all filled
    assert crossed == heads  # each head once, even when P or MD replicate it
    assert sorted(h for s in plan.wan for h in range(s.first_head, s.first_head + s.num_heads)) == list(range(heads))
    assert plan.wan_bytes_per_token(head_bytes=64) == heads * 64


def test_equal_tp_is_rank_to_rank_one_range_each():
    plan = plan_tp_relayout("mha", 8, 4, 4)
    assert [(s.src_rank, s.dst_rank, s.num_heads, s.src_bytes(16), s.dst_bytes(16)) for s in plan.wan] == \
        [(r, r, 2, (0, 32), (0, 32)) for r in range(4)]
    assert plan.local == ()


def test_p_tp2_to_md_tp1_concatenates_p_ranks_halves():
    plan = plan_tp_relayout("mha", 4, 2, 1)
    assert [(s.src_rank, s.dst_rank, s.dst_bytes(10)) for s in plan.wan] == [(0, 0, (0, 20)), (1, 0, (20, 40))]


def test_p_tp1_to_md_tp2_splits_one_row():
    plan = plan_tp_relayout("mha", 4, 1, 2)
    assert [(s.src_rank, s.dst_rank, s.src_bytes(10), s.dst_bytes(10)) for s in plan.wan] == \
        [(0, 0, (0, 20), (0, 20)), (0, 1, (20, 40), (0, 20))]


def test_replicated_heads_on_p_are_sent_by_different_ranks_once():
    # 2 KV heads on TP 4: ranks 0,1 hold head 0 and ranks 2,3 head 1
    plan = plan_tp_relayout("mha", 2, 4, 1)
    assert [(s.src_rank, s.first_head) for s in plan.wan] == [(0, 0), (3, 1)]
    assert plan.senders == (0, 3)


@pytest.mark.parametrize("src_tp,dst_tp", [(1, 1), (2, 4), (8, 2), (4, 4)])
def test_mla_sends_one_latent_and_md_replicates_it(src_tp, dst_tp):
    plan = plan_tp_relayout("mla", 0, src_tp, dst_tp)
    assert plan.total_kv_heads == 1
    assert [(s.src_rank, s.dst_rank, s.src_bytes(160), s.dst_bytes(160)) for s in plan.wan] == [(0, 0, (0, 160), (0, 160))]
    assert sorted(s.dst_rank for s in plan.local) == list(range(1, dst_tp))
    assert all(s.src_rank == 0 for s in plan.local)
    assert plan.wan_bytes_per_token(160) == 160


@pytest.mark.parametrize("kind,heads,src_tp,dst_tp,match", [
    ("mha", 6, 4, 1, "6 KV heads do not divide over TP 4"),
    ("mha", 4, 1, 6, "TP 6 is not a multiple of 4 KV heads"),
    ("mha", 0, 1, 1, "must be positive"),
    ("gqa", 4, 1, 1, "kind must be mha or mla"),
])
def test_unshardable_layouts_are_refused_by_name(kind, heads, src_tp, dst_tp, match):
    with pytest.raises(TpLayoutError, match=match):
        plan_tp_relayout(kind, heads, src_tp, dst_tp)


def test_rank_out_of_range():
    with pytest.raises(TpLayoutError, match="rank 2 out of range for TP 2"):
        kv_heads_of_rank(4, 2, 2)


# ---- every MD holder over the WAN (what P's fan-out runs: MD copies nothing between ranks)

KINDS_SHAPES = [("mha", h, a, b) for h, a, b in SHAPES] + \
    [("mla", 1, a, b) for a, b in itertools.product([1, 2, 4, 8], repeat=2)]


@pytest.mark.parametrize("kind,heads,src_tp,dst_tp", KINDS_SHAPES, ids=lambda v: str(v))
def test_sender_parts_tile_every_md_rank_with_its_direct_shard(kind, heads, src_tp, dst_tp):
    """Each P rank's slices, applied byte-wise to its own SGLang shard, rebuild every MD rank's
    shard exactly; each MD rank's slices are numbered 0..count-1 and tile its row, no overlap."""
    full = np.random.default_rng(heads * 100 + src_tp * 10 + dst_tp).integers(
        0, 1 << 16, size=(TOKENS, heads, HEAD_DIM), dtype=np.uint16)
    src_rows = [shard(full, src_tp, r).reshape(TOKENS, -1).view(np.uint8) for r in range(src_tp)]
    want = [shard(full, dst_tp, r).reshape(TOKENS, -1).view(np.uint8) for r in range(dst_tp)]
    got = [np.zeros_like(w) for w in want]
    covered = [np.zeros(w.shape[1], dtype=int) for w in want]
    slices = [[] for _ in range(dst_tp)]  # (index, count) per MD rank
    for p in range(src_tp):
        parts = sender_parts(kind, TpShard(p, src_tp, heads), src_rows[p].shape[1], dst_tp)
        assert len({md for md, _ in parts}) == len(parts)  # one leg per MD rank
        for md, part in parts:
            row = part.row
            assert part.dst_row_bytes == want[md].shape[1]
            assert 0 <= part.src_offset and part.src_offset + row.width <= src_rows[p].shape[1]
            assert row.problem(part.dst_row_bytes) == ""
            got[md][:, row.offset:row.offset + row.width] = src_rows[p][:, part.src_offset:part.src_offset + row.width]
            covered[md][row.offset:row.offset + row.width] += 1
            slices[md].append((row.index, row.count, row.offset))
    for md in range(dst_tp):
        assert (covered[md] == 1).all()  # tiles the row: every byte exactly once
        counts = {c for _, c, _ in slices[md]}
        assert counts == {len(slices[md])}
        assert [i for i, _, _ in sorted(slices[md], key=lambda s: s[2])] == list(range(len(slices[md])))
        np.testing.assert_array_equal(got[md], want[md])


def test_replicas_on_both_sides_pair_up_so_p_ranks_share_the_sending():
    # MLA (or 1 KV head) on P TP 2 and MD TP 2: P rank 0 feeds MD rank 0, P rank 1 MD rank 1
    assert [(md, p.row) for md, p in sender_parts("mla", TpShard(0, 2, 1), 64, 2)] == [(0, RowSlice(0, 1, 0, 64))]
    assert [(md, p.row) for md, p in sender_parts("mla", TpShard(1, 2, 1), 64, 2)] == [(1, RowSlice(0, 1, 0, 64))]
    # P TP 1 to MD TP 4 with 2 heads: each MD rank gets its one head, whole row, from rank 0
    parts = sender_parts("mha", TpShard(0, 1, 2), 32, 4)
    assert [(md, p.src_offset, p.row, p.dst_row_bytes) for md, p in parts] == \
        [(0, 0, RowSlice(0, 1, 0, 16), 16), (1, 0, RowSlice(0, 1, 0, 16), 16),
         (2, 16, RowSlice(0, 1, 0, 16), 16), (3, 16, RowSlice(0, 1, 0, 16), 16)]


def test_md_tp1_parts_are_unchanged():
    # the single-MD-rank plan is plan_tp_relayout's WAN half, slice for slice
    for heads, a in [(2, 4), (4, 2), (8, 8), (1, 2)]:
        plan = plan_tp_relayout("mha", heads, a, 1)
        for r in range(a):
            parts = [p for _, p in sender_parts("mha", TpShard(r, a, heads), 16 * len(kv_heads_of_rank(heads, a, r)))]
            assert len(parts) <= 1  # to one MD rank, a P rank's heads are one contiguous run
            part = parts[0] if parts else None
            mine = [(i, s) for i, s in enumerate(plan.wan) if s.src_rank == r]
            assert (part is None) == (not mine)
            if mine:
                (i, s), = mine
                assert (part.row.index, part.row.count, part.row.offset, part.src_offset) == \
                    (i, len(plan.wan), s.dst_bytes(16)[0], s.src_bytes(16)[0])
