"""Where a room's KV lands on MD while it crosses the WAN, and how much may be in flight.

Two ways (``--pdd-md-ingest``):
* ``pool`` (default): the room's pool slots (whole pages) are reserved at registration, on the
  scheduler thread; the WAN receiver's threads write each chunk straight into those pages as it
  lands. At completion the scheduler thread only inserts the prompt into the radix tree.
* ``staged`` (the earlier design, kept for comparison in benchmarks/bench_md_ingest.py): chunks
  land in a host buffer; at completion the scheduler thread allocates slots and copies the
  whole room into the pool before the insert — a stall of MD's decode loop that grows with
  the room.

A hybrid sliding-window pool (``SWAKVPool``): the sliding layers' buffers receive only the
window's pages ``[window_first_page, end)`` (kv_channel/layout.py); the reservation holds a
sliding-pool slot only for those tokens (SglangTreeOps.reserve), and the tree gets the rest of
the prompt as sliding-window tombstones (full KV only), as SGLang's own SWA cache keeps them.

Either way the bytes of rooms in flight are bounded (``--pdd-md-staging-mb``): a room that
does not fit is refused at registration (the router keeps that request on RLD), never queued.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional

import torch

from sglang_pdd.kv_channel.layout import KvPoolLayout, num_pages, window_first_page
from sglang_pdd.radix_drc.rooms import RoomError
from sglang_pdd.sglang_glue.kv_pool_view import page_ids_of_slots, scatter_pages

class RoomRefused(RoomError):
    """MD cannot take this room's KV now (budget or pool full); the router keeps it on RLD."""


class InFlightBudget:
    """Bytes of KV that rooms in flight hold on MD (reserved pages or host staging). Pure."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self.used_bytes = 0
        self._lock = threading.Lock()

    def take(self, room: int, nbytes: int) -> None:
        with self._lock:
            if self.used_bytes + nbytes > self.limit_bytes:
                raise RoomRefused(
                    f"room {room} refused: its uncached suffix needs {nbytes} bytes of KV in flight on MD, "
                    f"{self.limit_bytes - self.used_bytes} of --pdd-md-staging-mb "
                    f"{self.limit_bytes >> 20} MiB free")
            self.used_bytes += nbytes

    def give_back(self, nbytes: int) -> None:
        with self._lock:
            self.used_bytes -= nbytes


@dataclass(eq=False)
class Landing:
    """One room's KV on its way in: pages ``[first_page, first_page + num_pages)`` of every
    buffer. ``slots`` are the pool token slots holding them (reserved up front in ``pool``
    mode; allocated at completion in ``staged`` mode), ``staged`` the host buffer (staged)."""

    layout: KvPoolLayout
    first_page: int
    num_pages: int
    window_first_page: int = 0  # the sliding buffers' first page (first_page without a window)
    pool: object = None
    slots: Optional[torch.Tensor] = None
    page_ids: Optional[torch.Tensor] = None
    staged: Optional[torch.Tensor] = None
    chunks_written: int = field(default=0)

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.layout.page_size

    @property
    def window_buffers(self) -> int:
        return self.layout.window_layers * self.layout.buffers_per_layer

    @property
    def window_tokens(self) -> int:
        """Tokens whose sliding-window KV lands (the last of ``num_tokens``); 0 without a window."""
        if not self.window_buffers:
            return 0
        return (self.first_page + self.num_pages - self.window_first_page) * self.layout.page_size

    @property
    def nbytes(self) -> int:
        full = self.layout.num_buffers - self.window_buffers
        return (full * self.num_tokens + self.window_buffers * self.window_tokens) * self.layout.token_bytes

    @classmethod
    def plan(cls, layout: KvPoolLayout, prompt_len: int, cached_len: int) -> "Landing":
        if cached_len % layout.page_size:
            raise ValueError(f"cached prefix {cached_len} is not page-aligned (page size {layout.page_size})")
        first = cached_len // layout.page_size
        window_first = (window_first_page(prompt_len, cached_len, layout.window, layout.page_size)
                        if layout.window_layers else first)
        return cls(layout, first, num_pages(prompt_len, layout.page_size) - first, window_first)

    def into_pool(self, pool, slots: torch.Tensor) -> None:
        """Pool mode: write chunks straight into these reserved slots."""
        if slots.numel() != self.num_tokens:
            raise ValueError(f"{slots.numel()} slots reserved for {self.num_tokens} tokens")
        self.pool, self.slots, self.page_ids = pool, slots, page_ids_of_slots(slots, self.layout.page_size)

    def into_host(self) -> None:
        """Staged mode: chunks land in host memory first."""
        self.staged = torch.empty((self.layout.num_buffers, self.num_pages, self.layout.page_bytes), dtype=torch.uint8)

    def write(self, layer_start: int, layer_count: int, page_start: int, page_count: int, payload,
              row: Optional[tuple[int, int]] = None) -> None:
        """The WAN receiver's write callback (its stream threads): one verified chunk; ``row``
        = (offset, width) when it holds only those bytes of each token row (P with TP > 1)."""
        rows = torch.frombuffer(payload, dtype=torch.uint8).view(layer_count, page_count, -1)
        lo = page_start - self.first_page
        if self.staged is not None:
            staged = self.staged[layer_start:layer_start + layer_count, lo:lo + page_count]
            if row is not None:
                staged = staged.view(layer_count, page_count, self.layout.page_size, -1)[..., row[0]:row[0] + row[1]]
                rows = rows.view(staged.shape)
            staged.copy_(rows)
        else:
            scatter_pages(self.pool, self.page_ids[lo:lo + page_count], self.layout.page_size, rows, layer_start, row)
        self.chunks_written += 1

    def flush_staged(self, pool, slots: torch.Tensor) -> None:
        """Staged mode, at completion (scheduler thread): copy the host buffer into ``slots``."""
        page_ids = page_ids_of_slots(slots, self.layout.page_size)
        full = self.layout.num_buffers - self.window_buffers
        scatter_pages(pool, page_ids, self.layout.page_size, self.staged[:full])
        if self.window_buffers:  # only the window's pages have sliding-window slots
            lo = self.window_first_page - self.first_page
            scatter_pages(pool, page_ids[lo:], self.layout.page_size, self.staged[full:, lo:], full)
        self.slots, self.staged = slots, None
