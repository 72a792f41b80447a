"""P reads and MD writes KV rows in the same channel layout: a round trip is exact."""

from types import SimpleNamespace

import pytest
import torch

from sglang_pdd.sglang_glue.kv_pool_view import UnsupportedKvPool, gather_rows, kv_layout_of, scatter_rows


def fake_pool(layers=2, slots=32, heads=2, dim=4, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda: [torch.randn(slots, heads, dim, generator=g).to(dtype) for _ in range(layers)]  # noqa: E731
    return SimpleNamespace(k_buffer=make(), v_buffer=make())


def test_layout_counts_k_and_v_of_every_layer():
    layout = kv_layout_of(fake_pool(layers=3, heads=2, dim=4), page_size=1)
    assert layout.num_layers == 6 and layout.page_size == 1
    assert layout.bytes_per_page == 2 * 4 * 2  # heads * dim * bf16
    assert layout.dtype == "bfloat16"


def test_gather_then_scatter_moves_exactly_the_rows():
    src, dst = fake_pool(seed=1), fake_pool(seed=2)
    src_slots, dst_slots = torch.tensor([3, 7, 8, 20]), torch.tensor([30, 1, 2, 5])
    rows = gather_rows(src, src_slots)
    layout = kv_layout_of(src, 1)
    staged = torch.stack([r.view(len(src_slots), layout.bytes_per_page) for r in rows])
    untouched = dst.k_buffer[0][10].clone()
    scatter_rows(dst, dst_slots, staged)
    for s_buf, d_buf in zip(src.k_buffer + src.v_buffer, dst.k_buffer + dst.v_buffer):
        assert torch.equal(d_buf[dst_slots], s_buf[src_slots])
    assert torch.equal(dst.k_buffer[0][10], untouched)


def test_gathered_rows_are_copies_not_views():
    pool = fake_pool()
    rows = gather_rows(pool, torch.tensor([0, 1]))
    before = rows[0].clone()
    pool.k_buffer[0].zero_()  # the pool slot is reused after RLD got its KV
    assert torch.equal(rows[0], before)


@pytest.mark.parametrize("pool,page_size,match", [
    (SimpleNamespace(kv_buffer=[torch.zeros(4, 8)]), 1, "MHA pools"),
    (SimpleNamespace(k_buffer=[torch.zeros(4, 2, 2)], v_buffer=[]), 1, "MHA pools"),
    (fake_pool(), 16, "--page-size 1"),
])
def test_unsupported_pools_fail_clearly(pool, page_size, match):
    with pytest.raises(UnsupportedKvPool, match=match):
        kv_layout_of(pool, page_size)
