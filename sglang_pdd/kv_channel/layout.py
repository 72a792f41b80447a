"""Shape of one request's KV and how it is cut into chunks.

A request of ``num_tokens`` tokens occupies ``ceil(num_tokens / page_size)`` pages in
each of ``num_layers`` layers; one page of one layer is ``bytes_per_page`` bytes.
("Layer" is whatever unit the KV pool stores separately: an SGLang MHA pool has 2 * model
layers buffers for K and V, an MLA pool one latent buffer per model layer; ``KvPoolLayout``
describes a pool and derives the channel's ``KvLayout`` from it.)

MD already holds the first ``decode_prefix_len`` tokens (its radix cache), so only pages
``[decode_prefix_len // page_size, total_pages)`` are sent. decode_prefix_len must be
page-aligned: a partially cached page is sent whole.

Chunks are one layer x up to ``pages_per_chunk`` pages, numbered layer-major, so a
producer can send layer 0 while layer 1 is still being computed (pipelining), and
every chunk is contiguous both in a per-layer source buffer and in the destination.

A hybrid sliding-window pool (SGLang's ``SWAKVPool``) adds a second page range: its last
``window_buffers`` buffers (the sliding layers' K and V) carry only the request's window,
pages ``[window_first_page, end_page)`` with ``window_first_page`` the page of
``max(decode_prefix_len, num_tokens - window)`` (SGLang's own PD, ``_swa_payload``); the
attention never reads a sliding layer's KV further back. Those buffers' chunks keep the page
groups of the full buffers (a group's chunks are ready together), cut to the window.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from sglang_pdd.protocol.kv_size import KvSize

DEFAULT_MAX_CHUNK_BYTES = 4 * 1024 * 1024


def num_pages(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def align_down(num_tokens: int, page_size: int) -> int:
    """The page boundary at or below ``num_tokens`` (SGLang's radix cache holds whole pages)."""
    return num_tokens // page_size * page_size


def token_digest(token_ids: Optional[Sequence[int]]) -> bytes:
    """sha256 of the prompt's token ids (so MD can check it got the prompt it expects)."""
    if token_ids is None:
        return b""
    # Each id as 8 little-endian signed bytes, hashed in one call: 120k ids cost ~1 ms instead
    # of ~200 ms of a Python loop, on the scheduler threads of P and MD that call this.
    return hashlib.sha256(np.asarray(token_ids, dtype="<i8").tobytes()).digest()


KV_KINDS = ("mha", "mla")
BUFFERS_PER_LAYER = {"mha": 2, "mla": 1}  # K and V, or MLA's one latent


class KvLayoutMismatch(ValueError):
    """P's and MD's KV layouts differ; the message names both sides' values."""


def _differences(mine, theirs, fields: Sequence[str]) -> list[str]:
    return [f"{f} {getattr(mine, f)} vs {getattr(theirs, f)}" for f in fields if getattr(mine, f) != getattr(theirs, f)]


@dataclass(frozen=True)
class KvLayout:
    """The channel's unit of transfer: ``num_layers`` separate buffers of pages."""

    num_layers: int
    page_size: int  # tokens per page
    bytes_per_page: int  # bytes of one page of one layer
    dtype: str = "bfloat16"  # both sides must agree
    kind: str = "mha"  # what the buffers hold (KV_KINDS); both sides must agree
    window_buffers: int = 0  # the last buffers hold sliding-window layers: only the window is sent
    window: int = 0  # the sliding window in tokens (0 iff window_buffers is 0)

    def __post_init__(self):
        if self.num_layers <= 0 or self.page_size <= 0 or self.bytes_per_page <= 0 or self.kind not in KV_KINDS:
            raise ValueError(f"invalid KV layout {self}")
        if not 0 <= self.window_buffers < self.num_layers or self.window < 0 or (self.window > 0) != (self.window_buffers > 0):
            raise ValueError(f"invalid sliding-window part of KV layout {self}: window_buffers must be in "
                             f"[0, num_layers) and come with a window > 0")

    def is_window_buffer(self, layer: int) -> bool:
        return layer >= self.num_layers - self.window_buffers

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's row in one buffer."""
        return self.bytes_per_page // self.page_size

    def of_slice(self, row: "RowSlice") -> "KvLayout":
        """The layout of one row slice's bytes (what its chunks carry): ``row.width`` of each row."""
        return dataclasses.replace(self, bytes_per_page=self.page_size * row.width)

    def describe(self) -> str:
        window = f" window_buffers={self.window_buffers} window={self.window}" if self.window_buffers else ""
        return (f"kind={self.kind} buffers={self.num_layers} page_size={self.page_size} "
                f"bytes_per_page={self.bytes_per_page} dtype={self.dtype}{window}")

    def check_same(self, other: "KvLayout", mine: str, theirs: str) -> None:
        """Raise KvLayoutMismatch naming both sides unless ``other`` equals this layout."""
        diffs = _differences(self, other, ("kind", "num_layers", "page_size", "bytes_per_page", "dtype",
                                           "window_buffers", "window"))
        if diffs:
            raise KvLayoutMismatch(f"KV layout mismatch ({mine} vs {theirs}): {'; '.join(diffs)} "
                                   f"[{mine}: {self.describe()}; {theirs}: {other.describe()}]")


MAX_ROW_SLICES = 64  # senders of one room (P's TP ranks); more is a malformed frame


@dataclass(frozen=True)
class RowSlice:
    """Bytes ``[offset, offset + width)`` of every token row: what one of ``count`` senders
    moves of a room when P's TP ranks each hold some of the KV heads (tp_relayout.py). Every
    page of every buffer is cut the same way; the ``count`` slices of a room tile the row."""

    index: int
    count: int
    offset: int
    width: int

    @classmethod
    def whole(cls, token_bytes: int) -> "RowSlice":
        return cls(0, 1, 0, token_bytes)

    def is_whole(self, token_bytes: int) -> bool:
        return self.count == 1 and self.offset == 0 and self.width == token_bytes

    def problem(self, token_bytes: int) -> str:
        """Why this slice does not fit rows of ``token_bytes`` bytes ("" if it does)."""
        if not 1 <= self.count <= MAX_ROW_SLICES or not 0 <= self.index < self.count:
            return f"row slice {self.index} of {self.count} invalid (at most {MAX_ROW_SLICES} slices)"
        if self.width <= 0 or self.offset < 0 or self.offset + self.width > token_bytes:
            return f"row bytes [{self.offset}, {self.offset + self.width}) outside a {token_bytes}-byte token row"
        return ""


@dataclass(frozen=True)
class KvPoolLayout:
    """One KV pool, as P and MD compare it: MHA pools hold a K and a V buffer per model layer,
    MLA pools one latent (compressed KV + rope) buffer per layer; every buffer stores
    ``token_bytes`` bytes per token, ``page_size`` tokens per page."""

    kind: str  # "mha" | "mla"
    layers: int  # model layers in this pool
    page_size: int
    token_bytes: int  # bytes per token, per layer, per buffer
    dtype: str
    # A hybrid sliding-window pool (SGLang's SWAKVPool): the last ``window_layers`` of ``layers``
    # are sliding-window layers (their buffers come last), ``window`` tokens wide.
    window_layers: int = 0
    window: int = 0

    def __post_init__(self):
        if self.kind not in KV_KINDS:
            raise ValueError(f"KV pool kind must be one of {KV_KINDS}, got {self.kind!r}")
        if self.layers <= 0 or self.page_size <= 0 or self.token_bytes <= 0:
            raise ValueError(f"invalid KV pool layout {self}")
        if not 0 <= self.window_layers < self.layers or (self.window > 0) != (self.window_layers > 0):
            raise ValueError(f"invalid sliding-window part of KV pool layout {self}")

    @property
    def buffers_per_layer(self) -> int:
        return BUFFERS_PER_LAYER[self.kind]

    @property
    def num_buffers(self) -> int:
        return self.layers * self.buffers_per_layer

    @property
    def page_bytes(self) -> int:
        """One page of one buffer."""
        return self.token_bytes * self.page_size

    @property
    def bytes_per_token(self) -> int:
        """One token across every layer and buffer (what a token holds in the pools)."""
        return self.token_bytes * self.num_buffers

    @property
    def wan_kv_size(self) -> KvSize:
        """What a request costs on the WAN (what MD reports to the router): the full layers per
        token MD lacks, the sliding layers only for the window (TransferPlan.total_bytes)."""
        window = self.token_bytes * self.window_layers * self.buffers_per_layer
        return KvSize(self.bytes_per_token - window, self.window if window else 0, window)

    def wire(self) -> KvLayout:
        return KvLayout(self.num_buffers, self.page_size, self.page_bytes, self.dtype, self.kind,
                        self.window_layers * self.buffers_per_layer, self.window)

    def align_down(self, tokens: int) -> int:
        return align_down(tokens, self.page_size)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "KvPoolLayout":
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})

    def check_same(self, other: "KvPoolLayout", mine: str, theirs: str) -> None:
        diffs = _differences(self, other, ("kind", "page_size", "layers", "token_bytes", "dtype", "window_layers",
                                           "window"))
        if diffs:
            raise KvLayoutMismatch(f"KV pool layout mismatch ({mine} vs {theirs}): {'; '.join(diffs)}")


@dataclass(frozen=True)
class ChunkSpec:
    index: int
    layer: int
    page_start: int
    page_count: int
    nbytes: int


def window_first_page(num_tokens: int, decode_prefix_len: int, window: int, page_size: int) -> int:
    """First page of the sliding window the receiver needs: the sliding layers' KV of tokens it
    lacks that the next token can still see (SGLang's ``_swa_payload``), and at page size > 1
    a whole window before the prompt's last page boundary too. MD's radix cache takes the
    prompt's whole pages only, and SGLang's SWA-aware match counts a prefix only where the
    window before its end is cached: from the prompt's end alone, a prompt ending one token
    short of a window's page multiple (111 tokens, window 31, page 16) entered the tree with
    too short a window and matched nothing. The same as SGLang's at page size 1."""
    return align_down(max(decode_prefix_len, align_down(num_tokens, page_size) - window), page_size) // page_size


@dataclass(frozen=True)
class TransferPlan:
    layout: KvLayout
    num_tokens: int
    decode_prefix_len: int
    first_page: int  # first page sent
    end_page: int  # one past the last page sent (= total pages of the request)
    pages_per_chunk: int

    @classmethod
    def build(
        cls,
        layout: KvLayout,
        num_tokens: int,
        decode_prefix_len: int,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    ) -> "TransferPlan":
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {num_tokens}")
        if not 0 <= decode_prefix_len <= num_tokens:
            raise ValueError(f"decode_prefix_len {decode_prefix_len} not in [0, {num_tokens}]")
        if decode_prefix_len % layout.page_size:
            raise ValueError(f"decode_prefix_len {decode_prefix_len} is not a multiple of page_size {layout.page_size}")
        pages_per_chunk = max(1, max_chunk_bytes // layout.bytes_per_page)
        return cls(
            layout,
            num_tokens,
            decode_prefix_len,
            decode_prefix_len // layout.page_size,
            num_pages(num_tokens, layout.page_size),
            pages_per_chunk,
        )

    @property
    def window_first_page(self) -> int:
        """First page the window buffers send (``first_page`` when the layout has none)."""
        if not self.layout.window_buffers:
            return self.first_page
        return window_first_page(self.num_tokens, self.decode_prefix_len, self.layout.window, self.layout.page_size)

    def layer_first_page(self, layer: int) -> int:
        return self.window_first_page if self.layout.is_window_buffer(layer) else self.first_page

    @property
    def pages_sent(self) -> int:
        """Pages each full (non-window) buffer sends."""
        return self.end_page - self.first_page

    @property
    def chunks_per_layer(self) -> int:
        """Page groups: a full buffer has one chunk in each, a window buffer only in those that
        reach its window."""
        return -(-self.pages_sent // self.pages_per_chunk)

    def _group_pages(self, layer: int, group: int) -> tuple[int, int]:
        """Pages ``[start, end)`` of page group ``group`` that ``layer`` sends (empty: none)."""
        start = self.first_page + group * self.pages_per_chunk
        end = min(start + self.pages_per_chunk, self.end_page)
        return max(start, self.layer_first_page(layer)), end

    @functools.cached_property
    def _chunks(self) -> tuple[ChunkSpec, ...]:
        out = []
        bpp = self.layout.bytes_per_page
        for layer in range(self.layout.num_layers):
            for group in range(self.chunks_per_layer):
                start, end = self._group_pages(layer, group)
                if end > start:
                    out.append(ChunkSpec(len(out), layer, start, end - start, (end - start) * bpp))
        return tuple(out)

    @functools.cached_property
    def _group_index(self) -> dict:
        groups: dict[int, list[ChunkSpec]] = {}
        for spec in self._chunks:
            groups.setdefault((spec.page_start - self.first_page) // self.pages_per_chunk, []).append(spec)
        return groups

    @property
    def num_chunks(self) -> int:
        return len(self._chunks)

    def layer_pages(self, layer: int) -> int:
        """Pages buffer ``layer`` sends."""
        return self.end_page - self.layer_first_page(layer) if self.pages_sent else 0

    @property
    def layer_bytes(self) -> int:
        """Bytes sent per full (non-window) layer."""
        return self.pages_sent * self.layout.bytes_per_page

    def bytes_of_layer(self, layer: int) -> int:
        return self.layer_pages(layer) * self.layout.bytes_per_page

    @property
    def total_bytes(self) -> int:
        full = self.layout.num_layers - self.layout.window_buffers
        return (self.layer_bytes * full
                + self.layout.window_buffers * (self.end_page - self.window_first_page) * self.layout.bytes_per_page
                if self.pages_sent else 0)

    def chunk(self, index: int) -> ChunkSpec:
        if not 0 <= index < self.num_chunks:
            raise IndexError(f"chunk index {index} out of range [0, {self.num_chunks})")
        return self._chunks[index]

    def groups_ready(self, pages_available: int) -> int:
        """How many leading page groups (one chunk per layer each) are complete once pages
        ``[0, pages_available)`` exist: lets a producer send while prefill still runs."""
        if pages_available >= self.end_page:
            return self.chunks_per_layer
        return max(0, pages_available - self.first_page) // self.pages_per_chunk

    def group_chunks(self, group: int) -> list[ChunkSpec]:
        """The chunks of page group ``group``: one per layer that sends pages in it."""
        n = self.chunks_per_layer
        if not 0 <= group < n:
            raise IndexError(f"page group {group} out of range [0, {n})")
        return list(self._group_index.get(group, ()))

    def chunks_of_layer(self, layer: int) -> list[ChunkSpec]:
        return [spec for spec in self._chunks if spec.layer == layer]
