"""Read and write one request's KV pages in SGLang's token pools, in the WAN channel's layout.

Two pool kinds, one description (``KvPoolLayout``):
* MHA (``MHATokenToKVPool``: ``k_buffer`` / ``v_buffer``, one tensor per layer each): the
  channel's "layers" are K of layers 0..L-1, then V of layers 0..L-1 (2L buffers);
* MLA (``MLATokenToKVPool``: ``kv_buffer``, one latent tensor per layer): L buffers.

A hybrid sliding-window pool (``SWAKVPool`` of two MHA pools: the full-attention layers in
one, the sliding layers in a smaller one reached through ``full_to_swa_index_mapping``) is
the buffers of its full pool, then those of its sliding pool (``window_layers``); a page of a
sliding buffer is addressed by the request's full-pool page, translated to the sliding pool's
on each side (SGLang's own PD does the same: ``translate_swa_indices_for_transfer``).

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


def _mha_or_mla(pool) -> tuple[str, list[torch.Tensor]]:
    k, v = getattr(pool, "k_buffer", None), getattr(pool, "v_buffer", None)
    if isinstance(k, list) and isinstance(v, list) and k and len(k) == len(v):
        return "mha", list(k) + list(v)
    latent = getattr(pool, "kv_buffer", None)
    if isinstance(latent, list) and latent and k is None:
        return "mla", list(latent)
    raise UnsupportedKvPool(
        f"sglang-pdd moves KV of MHA pools (k_buffer/v_buffer lists) and MLA pools (kv_buffer list), and "
        f"SWAKVPools of two MHA pools; got {type(pool).__name__}")


def is_swa_pool(pool) -> bool:
    return any(c.__name__ == "SWAKVPool" for c in type(pool).__mro__)


def _window_buffers(pool) -> int:
    """Buffers of the sliding layers (they come last in ``_buffers``); 0 for a plain pool."""
    return len(_mha_or_mla(pool.swa_kv_pool)[1]) if is_swa_pool(pool) else 0


def _kind_and_buffers(pool) -> tuple[str, list[torch.Tensor]]:
    if not is_swa_pool(pool):
        return _mha_or_mla(pool)
    kinds = [_mha_or_mla(sub) for sub in (pool.full_kv_pool, pool.swa_kv_pool)]
    if any(kind != "mha" for kind, _ in kinds):
        raise UnsupportedKvPool(f"sglang-pdd moves an SWAKVPool of two MHA pools; this one holds "
                                f"{type(pool.full_kv_pool).__name__} and {type(pool.swa_kv_pool).__name__}")
    return "mha", kinds[0][1] + kinds[1][1]


def _buffers(pool) -> list[torch.Tensor]:
    return _kind_and_buffers(pool)[1]


def pool_layout(pool, page_size: int, window: int = 0) -> KvPoolLayout:
    """The layout P and MD compare: kind, layers, page size, bytes per token per buffer, dtype
    (and for an SWAKVPool its sliding layers and ``window``, the model's sliding window)."""
    kind, bufs = _kind_and_buffers(pool)
    if page_size <= 0:
        raise UnsupportedKvPool(f"page size must be positive, got {page_size}")
    window_buffers = _window_buffers(pool)
    if window_buffers and window <= 0:
        raise UnsupportedKvPool(f"{type(pool).__name__} has sliding-window layers but no sliding window size "
                                f"was given")
    if window_buffers == len(bufs):
        raise UnsupportedKvPool(f"{type(pool).__name__} has no full-attention layer (a pure sliding-window "
                                f"model): sglang-pdd does not move it")
    row = bufs[0][0]
    token_bytes = row.numel() * row.element_size()
    for b in bufs:
        if b.dtype != bufs[0].dtype or b[0].numel() * b.element_size() != token_bytes or not b.is_contiguous():
            raise UnsupportedKvPool("sglang-pdd needs contiguous KV buffers of one dtype and row size "
                                    f"(got {[(tuple(x.shape), x.dtype) for x in bufs[:4]]}...)")
    per_layer = BUFFERS_PER_LAYER[kind]
    return KvPoolLayout(kind=kind, layers=len(bufs) // per_layer, page_size=page_size,
                        token_bytes=token_bytes, dtype=str(bufs[0].dtype).removeprefix("torch."),
                        window_layers=window_buffers // per_layer, window=window if window_buffers else 0)


def kv_layout_of(pool, page_size: int, window: int = 0) -> KvLayout:
    """The channel layout (one "layer" per buffer, one page = ``page_size`` token rows)."""
    return pool_layout(pool, page_size, window).wire()


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


def window_page_ids(pool, page_ids: torch.Tensor, page_size: int) -> torch.Tensor:
    """Full-pool pages -> the sliding pool's pages holding the same tokens (an SWAKVPool's own
    mapping; SGLang's paged SWA allocator maps whole pages). A page whose sliding KV was freed
    (out of the window) has none: ValueError, never a read or write of another page."""
    idx = page_ids.to(torch.int64)
    slots = idx * page_size if page_size > 1 else idx
    swa = pool.translate_loc_from_full_to_swa(slots.to(pool.full_to_swa_index_mapping.device)).to(torch.int64)
    if swa.numel() and bool((swa <= 0).any()):  # -1: freed; 0: SGLang's padding slot, never a token's
        raise ValueError(f"{int((swa <= 0).sum())} of {swa.numel()} pages have no sliding-window KV (freed?)")
    return swa // page_size if page_size > 1 else swa


def _ids_for(pool, buffer: int, num_buffers: int, idx: torch.Tensor, page_size: int, cache: dict) -> torch.Tensor:
    """Page ids of buffer ``buffer``: ``idx`` itself, or translated for a sliding buffer."""
    if buffer < num_buffers - _window_buffers(pool):
        return idx
    if "swa" not in cache:
        cache["swa"] = window_page_ids(pool, idx, page_size)
    return cache["swa"]


def gather_pages(pool, page_ids: torch.Tensor, page_size: int, row: Row = None) -> list[torch.Tensor]:
    """Copies of pages ``page_ids`` (full-pool pages) of every buffer, each flattened to bytes
    (buffer-major); with ``row``, only those bytes of every token row (one strided copy per
    buffer)."""
    bufs = _buffers(pool)
    return [gather_buffer_pages(pool, i, page_ids, page_size, row) for i in range(len(bufs))]


def gather_buffer_pages(pool, buffer: int, page_ids: torch.Tensor, page_size: int, row: Row = None,
                        _cache: Optional[dict] = None) -> torch.Tensor:
    """One buffer's copy of pages ``page_ids`` (full-pool pages; a sliding buffer's are
    translated), flattened to bytes."""
    bufs = _buffers(pool)
    idx = _ids_for(pool, buffer, len(bufs), page_ids.to(torch.int64), page_size, {} if _cache is None else _cache)
    buf = bufs[buffer]
    return _row_view(_page_view(buf, page_size).index_select(0, idx.to(buf.device)), page_size, row).contiguous().view(-1)


def scatter_pages(pool, page_ids: torch.Tensor, page_size: int, data: torch.Tensor, first_buffer: int = 0,
                  row: Row = None) -> None:
    """Write ``data`` ([buffers, len(page_ids), page bytes] uint8; with ``row``, only those
    bytes of each token row) into pages ``page_ids`` (full-pool pages; a sliding buffer's are
    translated) of buffers ``first_buffer, ...``."""
    full_idx = page_ids.to(torch.int64)
    bufs = _buffers(pool)
    cache: dict = {}
    for i in range(data.shape[0]):
        idx = _ids_for(pool, first_buffer + i, len(bufs), full_idx, page_size, cache)
        run = _contiguous_run(idx)
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
