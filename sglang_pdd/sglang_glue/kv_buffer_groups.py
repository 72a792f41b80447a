"""Hybrid KV pools (sliding-window, DeepSeek-V4) as SGLang's own PD sees them: groups of byte
buffers of equal items (kv_channel/group_layout.py), read and written by item id.

The groups come from the pool's own PD descriptions (``get_contiguous_buf_infos``,
``get_state_buf_infos``, ``get_request_state_buf_infos``: pointer, length, item size per
buffer), so what moves is byte for byte what SGLang's Mooncake backend moves. Each pointer is
resolved to the pool tensor that holds it (a uint8 view of it, so writes land in the pool and
the pool's tensors stay the owners), on CPU and on GPU alike.

Which items a request sends (``request_item_ids``): its full pages the receiver lacks, the
sliding window's pages through the pool's full->SWA mapping, and its request-state items.

Pools sglang-pdd cannot move are refused by name (``refusal``): Mamba / linear-attention state
(``HybridLinearKVPool``, a ``MambaPool`` beside the request pool) has no page structure the
DRC could share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglang_pdd.kv_channel.group_layout import (PAGES, REQUEST, WINDOW, BufferGroup, GroupedPoolLayout,
                                                RequestKvPlan)
from sglang_pdd.sglang_glue.kv_pool_view import UnsupportedKvPool, page_ids_of_slots

# SGLang's method for each group's (data_ptrs, data_lens, item_lens).
GROUP_SOURCES = {PAGES: "get_contiguous_buf_infos", WINDOW: "get_state_buf_infos",
                 REQUEST: "get_request_state_buf_infos"}
HYBRID_POOL_TYPES = ("SWAKVPool", "DeepSeekV4TokenToKVPool")
STATE_POOL_TYPES = ("HybridLinearKVPool", "MambaPool", "HybridReqToTokenPool")


def pool_type(pool) -> str:
    return type(pool).__name__


def is_hybrid(pool) -> bool:
    return any(c.__name__ in HYBRID_POOL_TYPES for c in type(pool).__mro__)


def refusal(kv_pool, req_to_token_pool=None) -> Optional[str]:
    """Why sglang-pdd cannot move this model's KV (None if it can), naming the pool."""
    for pool in (kv_pool, req_to_token_pool):
        names = {c.__name__ for c in type(pool).__mro__} if pool is not None else set()
        hit = next((n for n in STATE_POOL_TYPES if n in names), None)
        if hit is not None or getattr(pool, "mamba_pool", None) is not None:
            return (f"sglang-pdd cannot move this model's KV: its {type(pool).__name__} holds Mamba / "
                    f"linear-attention state (a recurrent state per request, not KV pages a radix cache "
                    f"can share); serve it with plain SGLang PD")
    return None


def _pool_tensors(obj, depth: int = 0, seen: Optional[set] = None) -> list[torch.Tensor]:
    """Every tensor reachable from ``obj``'s attributes (a few levels: pools nest sub-pools)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 5:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        items = obj
    elif isinstance(obj, dict):
        items = list(obj.values())
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(("sglang", "sglang_pdd", "types")):
        items = list(vars(obj).values())
    else:
        return []
    return [t for item in items for t in _pool_tensors(item, depth + 1, seen)]


def _byte_view(tensors: list[torch.Tensor], ptr: int, nbytes: int) -> torch.Tensor:
    """The ``nbytes`` bytes at ``ptr`` as a uint8 view of the pool tensor that holds them."""
    for t in tensors:
        start = t.data_ptr()
        if t.is_contiguous() and start <= ptr and ptr + nbytes <= start + t.numel() * t.element_size():
            flat = t.view(-1).view(torch.uint8) if t.dtype != torch.uint8 else t.view(-1)
            return flat[ptr - start:ptr - start + nbytes]
    raise UnsupportedKvPool(f"a KV buffer SGLang describes ({nbytes} B at {ptr:#x}) is in none of the "
                            f"pool's contiguous tensors")


@dataclass
class GroupBuffers:
    """One group's buffers as [items, item bytes] uint8 views into the pool."""

    name: str
    views: list[torch.Tensor]

    @property
    def layout(self) -> BufferGroup:
        return BufferGroup(self.name, tuple(int(v.shape[1]) for v in self.views))

    def gather(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """Copies of items ``ids`` of every buffer, each [len(ids), item bytes]."""
        return [v.index_select(0, ids.to(torch.int64).to(v.device)) for v in self.views]

    def scatter(self, ids: torch.Tensor, data: list[torch.Tensor]) -> None:
        if len(data) != len(self.views):
            raise ValueError(f"group {self.name}: {len(data)} buffers of data for {len(self.views)} buffers")
        for view, rows in zip(self.views, data):
            view.index_copy_(0, ids.to(torch.int64).to(view.device), rows.to(view.device))


class GroupedPool:
    """A hybrid pool's buffer groups and its layout (what P and MD compare)."""

    def __init__(self, pool, page_size: int, window: int):
        if not is_hybrid(pool):
            raise UnsupportedKvPool(f"{pool_type(pool)} is not a hybrid sliding-window pool "
                                    f"({', '.join(HYBRID_POOL_TYPES)}); its KV moves by kv_pool_view")
        self.pool, self.page_size, self.window = pool, page_size, int(window)
        tensors = _pool_tensors(pool)
        self.groups: dict[str, GroupBuffers] = {}
        for name, method in GROUP_SOURCES.items():
            if not hasattr(pool, method):
                continue
            ptrs, lens, items = getattr(pool, method)()
            if not ptrs:
                continue
            views = []
            for ptr, nbytes, item in zip(ptrs, lens, items):
                # item i is at ptr + i * item, as SGLang's transfer engines address it; a tail
                # shorter than an item (a buffer's padding) is no item
                count = nbytes // item
                views.append(_byte_view(tensors, ptr, count * item).view(count, item))
            self.groups[name] = GroupBuffers(name, views)
        if WINDOW in self.groups and self.window <= 0:
            raise UnsupportedKvPool(f"{pool_type(pool)} has sliding-window state but no window size was given")
        self.layout = GroupedPoolLayout(pool_type(pool), page_size, self.window if WINDOW in self.groups else 0,
                                        tuple(g.layout for g in self.groups.values()))

    def window_page_ids(self, full_slots: torch.Tensor) -> torch.Tensor:
        """The sliding window's pool pages holding ``full_slots`` (whole pages, full-pool ids)."""
        swa_slots = self.pool.translate_loc_from_full_to_swa(full_slots.to(torch.int64))
        return page_ids_of_slots(swa_slots, self.page_size)

    def request_item_ids(self, plan: RequestKvPlan, full_slots: torch.Tensor,
                         req_pool_idx: Optional[int] = None) -> dict[str, torch.Tensor]:
        """Item ids per group of what ``plan`` sends (or receives): ``full_slots`` are the
        request's full-pool slots of tokens ``[0, seq_len)`` rounded up to whole pages
        (``req_to_token``'s row)."""
        ps = self.page_size
        ids = {PAGES: page_ids_of_slots(full_slots[plan.first_page * ps:plan.end_page * ps], ps)}
        if WINDOW in self.groups:
            ids[WINDOW] = self.window_page_ids(full_slots[plan.window_from:plan.end_page * ps])
        if REQUEST in self.groups:
            if req_pool_idx is None:
                raise ValueError(f"{pool_type(self.pool)} has request state: the request's slot is needed")
            ids[REQUEST] = torch.as_tensor(self.pool.request_state_transfer_indices(req_pool_idx, plan.seq_len),
                                           dtype=torch.int64)
        return ids

    def gather(self, ids: dict[str, torch.Tensor]) -> dict[str, list[torch.Tensor]]:
        return {name: self.groups[name].gather(i) for name, i in ids.items()}

    def scatter(self, ids: dict[str, torch.Tensor], data: dict[str, list[torch.Tensor]]) -> None:
        for name, i in ids.items():
            self.groups[name].scatter(i, data[name])
