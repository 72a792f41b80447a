"""Read and write one request's KV pages in SGLang's token pools, in the WAN channel's layout.

Two pool kinds, one description (``KvPoolLayout``):
* MHA (``MHATokenToKVPool``: ``k_buffer`` / ``v_buffer``, one tensor per layer each): the
  channel's "layers" are K of layers 0..L-1, then V of layers 0..L-1 (2L buffers);
* MLA (``MLATokenToKVPool``: ``kv_buffer``, one latent tensor per layer): L buffers.

Every buffer is token-major (row ``i`` is token slot ``i``); SGLang's paged allocators hand out
page ``p`` as the ``page_size`` consecutive rows ``[p * page_size, (p + 1) * page_size)``, so a
page of one buffer is one contiguous run of ``page_size * token_bytes`` bytes (the same
addressing as SGLang's Mooncake backend). P (read) and MD (write) both use this module, so the
two ends agree by construction; the WAN receiver also checks the sender's layout against its own.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang_pdd.kv_channel.layout import BUFFERS_PER_LAYER, KvLayout, KvPoolLayout, align_down


class UnsupportedKvPool(RuntimeError):
    pass


def _kind_and_buffers(pool) -> tuple[str, list[torch.Tensor]]:
    k, v = getattr(pool, "k_buffer", None), getattr(pool, "v_buffer", None)
    if isinstance(k, list) and isinstance(v, list) and k and len(k) == len(v):
        return "mha", list(k) + list(v)
    latent = getattr(pool, "kv_buffer", None)
    if isinstance(latent, list) and latent and k is None:
        return "mla", list(latent)
    raise UnsupportedKvPool(
        f"sglang-pdd moves KV of MHA pools (k_buffer/v_buffer lists) and MLA pools (kv_buffer list); "
        f"got {type(pool).__name__}")


def _buffers(pool) -> list[torch.Tensor]:
    return _kind_and_buffers(pool)[1]


def pool_layout(pool, page_size: int) -> KvPoolLayout:
    """The layout P and MD compare: kind, layers, page size, bytes per token per buffer, dtype."""
    kind, bufs = _kind_and_buffers(pool)
    if page_size <= 0:
        raise UnsupportedKvPool(f"page size must be positive, got {page_size}")
    row = bufs[0][0]
    token_bytes = row.numel() * row.element_size()
    for b in bufs:
        if b.dtype != bufs[0].dtype or b[0].numel() * b.element_size() != token_bytes or not b.is_contiguous():
            raise UnsupportedKvPool("sglang-pdd needs contiguous KV buffers of one dtype and row size "
                                    f"(got {[(tuple(x.shape), x.dtype) for x in bufs[:4]]}...)")
    return KvPoolLayout(kind=kind, layers=len(bufs) // BUFFERS_PER_LAYER[kind], page_size=page_size,
                        token_bytes=token_bytes, dtype=str(bufs[0].dtype).removeprefix("torch."))


def kv_layout_of(pool, page_size: int) -> KvLayout:
    """The channel layout (one "layer" per buffer, one page = ``page_size`` token rows)."""
    return pool_layout(pool, page_size).wire()


def _page_view(buf: torch.Tensor, page_size: int) -> torch.Tensor:
    """``buf`` as [pages, page bytes] uint8, a view (writes go to the pool)."""
    rows = align_down(buf.shape[0], page_size)
    return buf[:rows].view(torch.uint8).view(rows // page_size, -1)


def page_ids_of_slots(slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """Token slots of whole pages (as SGLang's paged allocator returns them) -> page ids."""
    slots = slots.to(torch.int64)
    if page_size == 1:
        return slots
    if slots.numel() % page_size or bool((slots[::page_size] % page_size).any()):
        raise ValueError(f"{slots.numel()} slots are not whole pages of {page_size}")
    return slots[::page_size] // page_size


Row = Optional[tuple[int, int]]  # (offset, width): bytes of each token row (P's TP slices); None = all


def _row_view(pages: torch.Tensor, page_size: int, row: Row) -> torch.Tensor:
    """[pages, page bytes] -> [pages, page_size * width] of the row slice (strided) or itself."""
    if row is None:
        return pages
    offset, width = row
    return pages.view(pages.shape[0], page_size, -1)[:, :, offset:offset + width]


def gather_pages(pool, page_ids: torch.Tensor, page_size: int, row: Row = None) -> list[torch.Tensor]:
    """Copies of pages ``page_ids`` of every buffer, each flattened to bytes (buffer-major);
    with ``row``, only those bytes of every token row (one strided copy per buffer)."""
    idx = page_ids.to(torch.int64)
    return [_row_view(_page_view(buf, page_size).index_select(0, idx.to(buf.device)), page_size, row)
            .contiguous().view(-1) for buf in _buffers(pool)]


def scatter_pages(pool, page_ids: torch.Tensor, page_size: int, data: torch.Tensor, first_buffer: int = 0,
                  row: Row = None) -> None:
    """Write ``data`` ([buffers, len(page_ids), page bytes] uint8; with ``row``, only those
    bytes of each token row) into pages ``page_ids`` of buffers ``first_buffer, ...``."""
    idx = page_ids.to(torch.int64)
    bufs = _buffers(pool)
    run = _contiguous_run(idx)
    for i in range(data.shape[0]):
        view = _page_view(bufs[first_buffer + i], page_size)
        src = data[i] if row is None else data[i].reshape(data.shape[1], page_size, row[1])
        if run is not None:  # freshly allocated pages usually are: one plain copy
            _row_view(view[run[0]:run[1]], page_size, row).copy_(src)
        else:
            _row_view(view, page_size, row).index_copy_(0, idx.to(view.device), src.to(view.device))


def _contiguous_run(idx: torch.Tensor) -> Optional[tuple[int, int]]:
    if idx.numel() == 0:
        return None
    lo, hi = int(idx[0]), int(idx[-1]) + 1
    if hi - lo == idx.numel() and (idx.numel() == 1 or bool((idx[1:] - idx[:-1] == 1).all())):
        return lo, hi
    return None
