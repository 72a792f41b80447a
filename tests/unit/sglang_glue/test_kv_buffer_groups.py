"""Hybrid pools moved group by group (sglang_glue/kv_buffer_groups.py) between two real SGLang
pools on CPU tensors: full pages the receiver lacks, the sliding window's pages through each
side's own full->SWA mapping, the request-state items; byte for byte, nothing else touched."""

import pytest
import torch

from sglang_pdd.kv_channel.group_layout import PAGES, REQUEST, WINDOW, RequestKvPlan
from sglang_pdd.kv_channel.layout import KvLayoutMismatch

pytest.importorskip("sglang")

WINDOW_TOKENS = 32


def swa_pool_and_allocator(size: int, size_swa: int, head_dim: int = 32):
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    pool = SWAKVPool(size=size, size_swa=size_swa, page_size=1, dtype=torch.float32, head_num=2, head_dim=head_dim,
                     swa_attention_layer_ids=[0, 2], full_attention_layer_ids=[1, 3], device="cpu",
                     enable_memory_saver=False)
    allocator = SWATokenToKVPoolAllocator(size, size_swa, 1, torch.float32, "cpu", pool, need_sort=False)
    return pool, allocator


def fill(tensors, seed: int):
    g = torch.Generator().manual_seed(seed)
    for t in tensors:
        t.copy_(torch.randn(t.shape, generator=g))


def swa_buffers(pool):
    return [*pool.swa_kv_pool.k_buffer, *pool.swa_kv_pool.v_buffer]


def full_buffers(pool):
    return [*pool.full_kv_pool.k_buffer, *pool.full_kv_pool.v_buffer]


@pytest.mark.parametrize("prefix", [0, 40], ids=["cold", "drc-prefix-40"])
def test_sliding_window_pool_moves_missing_pages_and_only_the_window(prefix):
    from sglang_pdd.sglang_glue.kv_buffer_groups import GroupedPool

    src, src_alloc = swa_pool_and_allocator(512, 256)
    dst, dst_alloc = swa_pool_and_allocator(1024, 128)
    seq_len = 100
    # the two sides' slots differ, as on two servers, and neither's SWA slots equal its full ones
    src_alloc.alloc(7)
    src_alloc.swa_attn_allocator.alloc(13)
    dst_alloc.swa_attn_allocator.alloc(5)
    src_slots = src_alloc.alloc(seq_len)
    dst_slots = dst_alloc.alloc(seq_len)
    fill(full_buffers(src) + swa_buffers(src), seed=1)
    before_swa = [b.clone() for b in swa_buffers(dst)]

    a, b = GroupedPool(src, 1, WINDOW_TOKENS), GroupedPool(dst, 1, WINDOW_TOKENS)
    b.layout.check_same(a.layout, "MD", "P")
    assert [g.name for g in a.layout.groups] == [PAGES, WINDOW]
    plan = RequestKvPlan(a.layout, seq_len, prefix)
    assert plan.window_from == max(prefix, seq_len - WINDOW_TOKENS)
    b.scatter(b.request_item_ids(plan, dst_slots), a.gather(a.request_item_ids(plan, src_slots)))

    sent = torch.arange(prefix, seq_len)
    for s, d in zip(full_buffers(src), full_buffers(dst)):
        assert torch.equal(d[dst_slots[sent]], s[src_slots[sent]])
        if prefix:  # the receiver's own prefix pages are not written
            assert not d[dst_slots[:prefix]].any()
    window = torch.arange(plan.window_from, seq_len)
    src_swa, dst_swa = (p.translate_loc_from_full_to_swa(s) for p, s in ((src, src_slots), (dst, dst_slots)))
    assert not torch.equal(src_swa, src_slots) and not torch.equal(dst_swa, dst_slots)
    for s, d, before in zip(swa_buffers(src), swa_buffers(dst), before_swa):
        assert torch.equal(d[dst_swa[window]], s[src_swa[window]])
        untouched = torch.ones(d.shape[0], dtype=torch.bool)
        untouched[dst_swa[window]] = False
        assert torch.equal(d[untouched], before[untouched])  # nothing outside the window lands

    bytes_ = plan.group_bytes()
    token_bytes = 2 * 32 * 4  # 2 KV heads x head_dim 32 x fp32, per buffer
    assert bytes_ == {PAGES: (seq_len - prefix) * 4 * token_bytes,
                      WINDOW: (seq_len - plan.window_from) * 4 * token_bytes}
    assert plan.bytes_without_window() == (seq_len - prefix) * 8 * token_bytes


def test_layout_check_names_the_group_and_buffer_that_differ():
    from sglang_pdd.sglang_glue.kv_buffer_groups import GroupedPool

    a = GroupedPool(swa_pool_and_allocator(64, 32)[0], 1, WINDOW_TOKENS).layout
    b = GroupedPool(swa_pool_and_allocator(64, 32, head_dim=16)[0], 1, WINDOW_TOKENS).layout
    with pytest.raises(KvLayoutMismatch, match=r"group pages buffer 0: item 256 vs 128 bytes; .*group window buffer 0"):
        a.check_same(b, "P", "MD")
    c = GroupedPool(swa_pool_and_allocator(64, 32)[0], 1, 64).layout
    with pytest.raises(KvLayoutMismatch, match=r"window 32 vs 64"):
        a.check_same(c, "P", "MD")


def test_plain_pools_are_not_grouped_and_state_pools_are_refused_by_name():
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from sglang_pdd.sglang_glue.kv_buffer_groups import GroupedPool, refusal
    from sglang_pdd.sglang_glue.kv_pool_view import UnsupportedKvPool

    mha = MHATokenToKVPool(64, page_size=1, dtype=torch.float32, head_num=2, head_dim=8, layer_num=1, device="cpu",
                           enable_memory_saver=False)
    with pytest.raises(UnsupportedKvPool, match="not a hybrid sliding-window pool"):
        GroupedPool(mha, 1, 0)
    assert refusal(mha) is None

    class HybridLinearKVPool:  # SGLang's Mamba/linear-attention pool, by its class name
        pass

    assert "HybridLinearKVPool holds Mamba / linear-attention state" in refusal(HybridLinearKVPool())
