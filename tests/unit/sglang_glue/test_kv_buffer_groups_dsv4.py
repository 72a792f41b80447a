"""DeepSeek-V4's own pool (SGLang's DeepSeekV4TokenToKVPool on CPU tensors, a 4-layer
[0, 4, 128, 4] config, page 256) moved request by request through sglang_glue/kv_buffer_groups:
its per-page compressed KV and indexer keys, the sliding window's state pages and the request's
C128 ring, into a second pool whose slots differ; byte for byte, including a DRC-style partial
prefix the receiver already holds (those pages are neither sent nor touched)."""

import pytest
import torch

from sglang_pdd.kv_channel.group_layout import PAGES, REQUEST, WINDOW, RequestKvPlan

pytest.importorskip("sglang")

PAGE = 256
FULL_SIZE = 2048


@pytest.fixture(scope="module")
def published():
    from sglang.test.test_utils import published_topology

    with published_topology(device="cpu"):
        yield


def dsv4_pool(full_to_swa_pages: dict[int, int]):
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import (DeepSeekV4TokenToKVPool,
                                                              resolve_compress_state_ring_size)

    # sized as SGLang's configurator does: C4 compress states by SWA page x ring; C128 request-scoped
    pool = DeepSeekV4TokenToKVPool(
        max_num_reqs=4, swa_size=2048, c4_size=1024, c128_size=512,
        c4_state_pool_size=2048 // PAGE * resolve_compress_state_ring_size(4),
        c128_state_pool_size=0,
        page_size=PAGE, swa_page_size=PAGE, dtype=torch.float8_e4m3fn, c4_state_dtype=torch.float32,
        c128_state_dtype=torch.float32, qk_nope_head_dim=448, qk_rope_head_dim=64, indexer_head_dim=128,
        layer_num=4, device="cpu", enable_memory_saver=False, compression_ratios=[0, 4, 128, 4],
        full_size=FULL_SIZE)
    # the SWA allocator's mapping, page-aligned (its -1 sentinel last)
    mapping = torch.zeros(FULL_SIZE + 1, dtype=torch.int64)
    mapping[-1] = -1
    for full_page, swa_page in full_to_swa_pages.items():
        mapping[full_page * PAGE:(full_page + 1) * PAGE] = torch.arange(swa_page * PAGE, (swa_page + 1) * PAGE)
    pool.register_mapping(mapping)
    return pool


def slots_of(pages):
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def randomize(grouped, seed):
    g = torch.Generator().manual_seed(seed)
    for group in grouped.groups.values():
        for v in group.views:
            v.copy_(torch.randint(0, 256, v.shape, generator=g, dtype=torch.uint8))


def test_dsv4_pool_round_trip_with_a_cached_prefix(published):
    from sglang_pdd.sglang_glue.kv_buffer_groups import GroupedPool

    seq_len, prefix = 700, 256  # 3 pages; the receiver holds the first (a DRC hit)
    src_pages, dst_pages = [3, 1, 4], [2, 5, 6]
    src = GroupedPool(dsv4_pool({3: 0, 1: 6, 4: 2}), PAGE, 128)
    dst = GroupedPool(dsv4_pool({2: 1, 5: 4, 6: 7}), PAGE, 128)
    dst.layout.check_same(src.layout, "MD", "P")
    assert [g.name for g in src.layout.groups] == [PAGES, WINDOW, REQUEST]
    # pages: C4 KV x2, C4 indexer K x2, C128 KV; window: SWA KV x4, C4 compress states; request: C128 ring
    assert [len(g.item_bytes) for g in src.layout.groups] == [5, 8, 1]
    randomize(src, 1)
    randomize(dst, 2)
    before = {n: [v.clone() for v in g.views] for n, g in dst.groups.items()}

    plan = RequestKvPlan(src.layout, seq_len, prefix)
    assert (plan.first_page, plan.end_page, plan.window_from) == (1, 3, 512)
    src_ids = src.request_item_ids(plan, slots_of(src_pages), req_pool_idx=1)
    dst_ids = dst.request_item_ids(plan, slots_of(dst_pages), req_pool_idx=2)
    assert src_ids[PAGES].tolist() == [1, 4] and dst_ids[PAGES].tolist() == [5, 6]
    assert src_ids[WINDOW].tolist() == [2] and dst_ids[WINDOW].tolist() == [7]  # the last page only, translated
    assert len(src_ids[REQUEST]) == len(dst_ids[REQUEST]) == 1  # the ring page holding 700 % 128 pending tokens
    dst.scatter(dst_ids, src.gather(src_ids))

    for name, group in dst.groups.items():
        for i, (d, s, old) in enumerate(zip(group.views, src.groups[name].views, before[name])):
            assert torch.equal(d[dst_ids[name]], s[src_ids[name]]), f"{name} buffer {i}"
            untouched = torch.ones(d.shape[0], dtype=torch.bool)
            untouched[dst_ids[name]] = False
            assert torch.equal(d[untouched], old[untouched]), f"{name} buffer {i}: bytes outside the request changed"
    # the receiver's cached prefix page (2) kept its own bytes
    assert 2 not in dst_ids[PAGES].tolist()
    sent = plan.group_bytes(request_items=1)
    assert sent[PAGES] == 2 * sum(src.layout.group(PAGES).item_bytes)
    assert sent[WINDOW] == sum(src.layout.group(WINDOW).item_bytes)


def test_pdd_roles_refuse_the_dsv4_pool_at_start_naming_it(published):
    from sglang_pdd.sglang_glue.servable import why_not_servable

    reason = why_not_servable(dsv4_pool({}), None, "dsv4")
    assert "its DeepSeekV4TokenToKVPool is a hybrid pool (full-attention pages plus sliding-window state, " \
           "plus request state)" in reason
