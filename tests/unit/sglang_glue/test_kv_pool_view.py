"""P reads and MD writes KV pages in the same channel layout: on SGLang's own pools (MHA and MLA,
page sizes 1, 16, 64, built on CPU) a round trip over scattered pages is exact, byte for byte."""

from types import SimpleNamespace

import pytest
import torch

from tests.conftest import require_sglang_import
from sglang_pdd.kv_channel.layout import KvLayoutMismatch, KvPoolLayout
from sglang_pdd.sglang_glue.kv_pool_view import (
    UnsupportedKvPool,
    gather_pages,
    kv_layout_of,
    page_ids_of_slots,
    pool_layout,
    scatter_pages,
)

PAGES = 8


def mha_pool(page_size, layers=3, heads=2, dim=8, dtype=torch.bfloat16):
    require_sglang_import()
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(size=PAGES * page_size, page_size=page_size, dtype=dtype, head_num=heads,
                            head_dim=dim, layer_num=layers, device="cpu", enable_memory_saver=False)


def mla_pool(page_size, layers=3, rank=16, rope=8, dtype=torch.bfloat16):
    require_sglang_import()
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    return MLATokenToKVPool(size=PAGES * page_size, page_size=page_size, dtype=dtype, kv_lora_rank=rank,
                            qk_rope_head_dim=rope, layer_num=layers, device="cpu", enable_memory_saver=False)


def buffers(pool):
    return pool.k_buffer + pool.v_buffer if hasattr(pool, "k_buffer") and pool.k_buffer else pool.kv_buffer


def fill(pool, seed):
    g = torch.Generator().manual_seed(seed)
    for buf in buffers(pool):
        buf.copy_(torch.randn(buf.shape, generator=g).to(buf.dtype))


def token_rows(pool, page_ids, page_size):
    tokens = (page_ids[:, None] * page_size + torch.arange(page_size)).reshape(-1)
    return [buf[tokens].clone() for buf in buffers(pool)]


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("make,kind,buffers_per_layer,token_bytes", [
    (mha_pool, "mha", 2, 2 * 8 * 2),  # heads * head_dim * bf16
    (mla_pool, "mla", 1, (16 + 8) * 2),  # (kv_lora_rank + rope dim) * bf16
])
def test_layout_describes_the_pool(make, kind, buffers_per_layer, token_bytes, page_size):
    layout = pool_layout(make(page_size), page_size)
    assert layout == KvPoolLayout(kind=kind, layers=3, page_size=page_size, token_bytes=token_bytes, dtype="bfloat16")
    wire = layout.wire()
    assert (wire.kind, wire.num_layers, wire.page_size) == (kind, 3 * buffers_per_layer, page_size)
    assert wire.bytes_per_page == token_bytes * page_size
    assert layout.bytes_per_token == token_bytes * 3 * buffers_per_layer


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("make", [mha_pool, mla_pool])
@pytest.mark.parametrize("dst_pages", [[1, 6, 2], [3, 4, 5]], ids=["scattered", "contiguous"])
def test_pages_round_trip_exactly(make, page_size, dst_pages):
    src, dst = make(page_size), make(page_size)
    fill(src, 1)
    fill(dst, 2)
    src_pages, dst_pages = torch.tensor([5, 0, 3]), torch.tensor(dst_pages)
    untouched = [buf.clone() for buf in buffers(dst)]
    want = token_rows(src, src_pages, page_size)

    copies = gather_pages(src, src_pages, page_size)  # P: one host copy per buffer
    layout = kv_layout_of(src, page_size)
    assert [c.numel() for c in copies] == [len(src_pages) * layout.bytes_per_page] * layout.num_layers
    staged = torch.stack([c.view(len(src_pages), layout.bytes_per_page) for c in copies])
    # MD writes in two pieces (as chunks land: a buffer range at a time)
    half = layout.num_layers // 2 or 1
    scatter_pages(dst, dst_pages, page_size, staged[:half])
    scatter_pages(dst, dst_pages, page_size, staged[half:], first_buffer=half)

    got = token_rows(dst, dst_pages, page_size)
    for w, g in zip(want, got):
        assert torch.equal(w.view(torch.uint8), g.view(torch.uint8))
    others = torch.tensor([p for p in range(PAGES) if p not in dst_pages.tolist()])
    for before, buf in zip(untouched, buffers(dst)):
        tokens = (others[:, None] * page_size + torch.arange(page_size)).reshape(-1)
        assert torch.equal(buf[tokens], before[tokens])


def test_gathered_pages_are_copies_not_views():
    pool = mha_pool(16)
    fill(pool, 3)
    copies = gather_pages(pool, torch.tensor([0, 1]), 16)
    before = copies[0].clone()
    pool.k_buffer[0].zero_()  # the pool slot is reused after RLD got its KV
    assert torch.equal(copies[0], before)


@pytest.mark.parametrize("page_size", [1, 16])
def test_page_ids_of_allocator_slots(page_size):
    require_sglang_import()
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator

    pool = mha_pool(page_size)
    if page_size == 1:
        alloc = TokenToKVPoolAllocator(PAGES, torch.bfloat16, "cpu", pool, need_sort=False)
    else:
        alloc = PagedTokenToKVPoolAllocator(PAGES * page_size, page_size, torch.bfloat16, "cpu", pool,
                                            need_sort=False)
    alloc.alloc(page_size)  # take one page so the next ones are not page 0
    slots = alloc.alloc(3 * page_size)
    pages = page_ids_of_slots(slots, page_size)
    assert len(pages) == 3
    assert torch.equal((pages[:, None] * page_size + torch.arange(page_size)).reshape(-1), slots)
    if page_size > 1:
        with pytest.raises(ValueError, match="not whole pages"):
            page_ids_of_slots(slots[1:], page_size)


@pytest.mark.parametrize("pool,match", [
    (SimpleNamespace(kv_buffer=None), "MHA pools .* and MLA pools"),
    (SimpleNamespace(k_buffer=[torch.zeros(4, 2, 2)], v_buffer=[]), "MHA pools"),
    (SimpleNamespace(k_buffer=[torch.zeros(4, 2, 2)], v_buffer=[torch.zeros(4, 2, 3)]), "one dtype and row size"),
])
def test_unsupported_pools_fail_clearly(pool, match):
    with pytest.raises(UnsupportedKvPool, match=match):
        pool_layout(pool, 1)


@pytest.mark.parametrize("p_pool,md_pool,named", [
    (lambda: mha_pool(16), lambda: mha_pool(1), "page_size 16 vs 1"),
    (lambda: mha_pool(16), lambda: mla_pool(16), "kind mha vs mla"),
    (lambda: mha_pool(1, dim=8), lambda: mha_pool(1, dim=4), "token_bytes 32 vs 16"),
    (lambda: mha_pool(1, dtype=torch.bfloat16), lambda: mha_pool(1, dtype=torch.float32), "dtype bfloat16 vs float32"),
])
def test_layout_mismatch_names_both_sides(p_pool, md_pool, named):
    p, md = p_pool(), md_pool()
    p_layout, md_layout = pool_layout(p, p.page_size), pool_layout(md, md.page_size)
    with pytest.raises(KvLayoutMismatch, match=named):
        p_layout.check_same(md_layout, "P", "MD")
    with pytest.raises(KvLayoutMismatch, match=r"\(P vs MD\)"):
        p_layout.wire().check_same(md_layout.wire(), "P", "MD")
    p_layout.check_same(KvPoolLayout.from_dict(p_layout.to_dict()), "P", "P again")  # equal: no error


def test_token_digest_is_sha256_of_int64_little_endian_ids():
    import hashlib

    from sglang_pdd.kv_channel.layout import token_digest

    ids = [0, 1, 70000, 2**40, 5]
    assert token_digest(ids) == hashlib.sha256(b"".join(t.to_bytes(8, "little", signed=True) for t in ids)).digest()
    assert token_digest(None) == b""
