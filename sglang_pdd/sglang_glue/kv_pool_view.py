"""Read and write one request's KV rows in SGLang's MHA token pool, in the WAN channel's layout.

The channel's "layers" are the pool's separate buffers: K of layers 0..L-1, then V of layers
0..L-1 (2L in all); a "page" is one token slot (page_size 1) and ``bytes_per_page`` is one
token's K (or V) for all KV heads. Both P (read) and MD (write) use this, so the two ends agree
on the layout by construction; the WAN receiver also checks it against the sender's.
"""

from __future__ import annotations

import torch

from sglang_pdd.kv_channel.layout import KvLayout


class UnsupportedKvPool(RuntimeError):
    pass


def _buffers(pool) -> list[torch.Tensor]:
    k, v = getattr(pool, "k_buffer", None), getattr(pool, "v_buffer", None)
    if not isinstance(k, list) or not isinstance(v, list) or len(k) != len(v) or not k:
        raise UnsupportedKvPool(
            f"sglang-pdd moves KV of MHA pools (k_buffer/v_buffer lists); got {type(pool).__name__}")
    return list(k) + list(v)


def kv_layout_of(pool, page_size: int) -> KvLayout:
    if page_size != 1:
        raise UnsupportedKvPool(f"sglang-pdd's WAN path needs --page-size 1 for now, got {page_size}")
    bufs = _buffers(pool)
    row = bufs[0][0]
    return KvLayout(num_layers=len(bufs), page_size=1, bytes_per_page=row.numel() * row.element_size(),
                    dtype=str(bufs[0].dtype).removeprefix("torch."))


def gather_rows(pool, slots: torch.Tensor) -> list[torch.Tensor]:
    """Copies of the rows ``slots`` of every buffer, each flattened to bytes (layer-major)."""
    idx = slots.to(torch.int64)
    return [buf.index_select(0, idx).contiguous().view(-1).view(torch.uint8) for buf in _buffers(pool)]


def scatter_rows(pool, slots: torch.Tensor, staged: torch.Tensor) -> None:
    """Write ``staged`` ([num_layers, len(slots), bytes_per_page] uint8) into the rows ``slots``."""
    idx = slots.to(torch.int64)
    for layer, buf in enumerate(_buffers(pool)):
        rows = staged[layer].view(buf.dtype).view(len(idx), *buf.shape[1:])
        buf.index_copy_(0, idx, rows.to(buf.device))
