"""A hybrid KV pool as groups of buffers, the way SGLang's own PD moves it. Pure.

SGLang describes every pool it disaggregates by three lists of buffers, each buffer an array of
equal items (``data_ptrs, data_lens, item_lens``):

* ``pages`` (``get_contiguous_buf_infos``): addressed by the request's full-pool KV page; for
  an ``SWAKVPool`` the full-attention layers only, for DeepSeek-V4 its compressed (C4/C128) KV
  and indexer keys. Only the pages MD lacks cross: ``[decode_prefix_len, seq_len)``;
* ``window`` (``get_state_buf_infos``, ``StateType.SWA``): addressed by the sliding-window
  pool's own pages; only the request's window crosses, ``[max(decode_prefix_len, seq_len -
  window), seq_len)`` rounded down to a page (``disaggregation/prefill.py`` ``_swa_payload``);
* ``request`` (``get_request_state_buf_infos``, DeepSeek-V4's ``DSV4_REQUEST_STATE``): items
  addressed by the request's slot (its C128 raw-token ring), sent whole.

P and MD compare their ``GroupedPoolLayout`` before any byte moves; a mismatch names the group,
the buffer and both values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from sglang_pdd.kv_channel.layout import KvLayoutMismatch, align_down, num_pages

PAGES, WINDOW, REQUEST = "pages", "window", "request"
GROUP_NAMES = (PAGES, WINDOW, REQUEST)


@dataclass(frozen=True)
class BufferGroup:
    """One group's buffers: ``item_bytes[i]`` is the size of one item (one page, or one request
    slot) of buffer ``i``."""

    name: str
    item_bytes: tuple[int, ...]

    def __post_init__(self):
        if self.name not in GROUP_NAMES:
            raise ValueError(f"buffer group must be one of {GROUP_NAMES}, got {self.name!r}")
        if not self.item_bytes or any(b <= 0 for b in self.item_bytes):
            raise ValueError(f"group {self.name}: item sizes must be positive, got {self.item_bytes}")

    @property
    def bytes_per_item(self) -> int:
        """One item across every buffer of the group."""
        return sum(self.item_bytes)


@dataclass(frozen=True)
class GroupedPoolLayout:
    """A pool as P and MD compare it: SGLang's pool class, the page size, the sliding window
    (0: none) and its buffer groups in GROUP_NAMES order."""

    pool_type: str
    page_size: int
    window: int
    groups: tuple[BufferGroup, ...]

    def __post_init__(self):
        if self.page_size <= 0 or self.window < 0:
            raise ValueError(f"invalid pool layout {self}")
        names = [g.name for g in self.groups]
        ordered = names == sorted(names, key=GROUP_NAMES.index) and len(set(names)) == len(names)
        if PAGES not in names or not ordered:
            raise ValueError(f"pool layout groups must include {PAGES!r}, once each, in order {GROUP_NAMES}; "
                             f"got {names}")
        if (WINDOW in names) != (self.window > 0):
            raise ValueError(f"a {WINDOW!r} group goes with a sliding window > 0 (window {self.window}, "
                             f"groups {names})")

    def group(self, name: str) -> Optional[BufferGroup]:
        return next((g for g in self.groups if g.name == name), None)

    def describe(self) -> str:
        parts = ", ".join(f"{g.name}: {len(g.item_bytes)} x {sorted(set(g.item_bytes))} B" for g in self.groups)
        return f"{self.pool_type} page_size={self.page_size} window={self.window} [{parts}]"

    def differences(self, other: "GroupedPoolLayout") -> list[str]:
        diffs = [f"{f} {getattr(self, f)} vs {getattr(other, f)}" for f in ("pool_type", "page_size", "window")
                 if getattr(self, f) != getattr(other, f)]
        for name in GROUP_NAMES:
            mine, theirs = self.group(name), other.group(name)
            if mine is None and theirs is None:
                continue
            if mine is None or theirs is None:
                diffs.append(f"group {name} {'absent' if mine is None else 'present'} vs "
                             f"{'absent' if theirs is None else 'present'}")
                continue
            if len(mine.item_bytes) != len(theirs.item_bytes):
                diffs.append(f"group {name}: {len(mine.item_bytes)} vs {len(theirs.item_bytes)} buffers")
                continue
            diffs += [f"group {name} buffer {i}: item {a} vs {b} bytes"
                      for i, (a, b) in enumerate(zip(mine.item_bytes, theirs.item_bytes)) if a != b]
        return diffs

    def check_same(self, other: "GroupedPoolLayout", mine: str, theirs: str) -> None:
        diffs = self.differences(other)
        if diffs:
            raise KvLayoutMismatch(f"KV pool layout mismatch ({mine} vs {theirs}): {'; '.join(diffs)}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GroupedPoolLayout":
        return cls(d["pool_type"], int(d["page_size"]), int(d["window"]),
                   tuple(BufferGroup(g["name"], tuple(int(b) for b in g["item_bytes"])) for g in d["groups"]))


def window_start(seq_len: int, decode_prefix_len: int, window: int, page_size: int) -> int:
    """First token of the window the receiver needs (SGLang's ``_swa_payload``): the sliding
    layers' KV of tokens it lacks that the next token can still see, from a page boundary."""
    return align_down(max(decode_prefix_len, seq_len - window), page_size)


@dataclass(frozen=True)
class RequestKvPlan:
    """What one request sends of a grouped pool: full pages ``[first_page, end_page)``, the
    window's tokens ``[window_from, seq_len)`` (by page), and the request's state items."""

    layout: GroupedPoolLayout
    seq_len: int
    decode_prefix_len: int

    def __post_init__(self):
        if self.seq_len <= 0 or not 0 <= self.decode_prefix_len <= self.seq_len:
            raise ValueError(f"decode_prefix_len {self.decode_prefix_len} not in [0, {self.seq_len}]")
        if self.decode_prefix_len % self.layout.page_size:
            raise ValueError(f"decode_prefix_len {self.decode_prefix_len} is not a multiple of page_size "
                             f"{self.layout.page_size}")

    @property
    def first_page(self) -> int:
        return self.decode_prefix_len // self.layout.page_size

    @property
    def end_page(self) -> int:
        return num_pages(self.seq_len, self.layout.page_size)

    @property
    def window_from(self) -> int:
        """First token of the window sent (seq_len when the pool has no window group)."""
        if self.layout.group(WINDOW) is None:
            return self.seq_len
        return window_start(self.seq_len, self.decode_prefix_len, self.layout.window, self.layout.page_size)

    @property
    def window_pages(self) -> int:
        return num_pages(self.seq_len, self.layout.page_size) - self.window_from // self.layout.page_size

    def group_bytes(self, request_items: int = 0) -> dict[str, int]:
        """Bytes each group sends (``request_items``: items of the request group, per buffer)."""
        out = {PAGES: (self.end_page - self.first_page) * self.layout.group(PAGES).bytes_per_item}
        if self.layout.group(WINDOW) is not None:
            out[WINDOW] = self.window_pages * self.layout.group(WINDOW).bytes_per_item
        if self.layout.group(REQUEST) is not None:
            out[REQUEST] = request_items * self.layout.group(REQUEST).bytes_per_item
        return out

    def bytes_without_window(self) -> int:
        """What the sliding layers would cost sent like full layers (every page MD lacks)."""
        window = self.layout.group(WINDOW)
        pages = self.end_page - self.first_page
        return pages * (self.layout.group(PAGES).bytes_per_item + (window.bytes_per_item if window else 0))
