"""MD's KV size: what it reports (registration answer, /pdd/stats) and what the router's WAN
estimate and byte counts make of it. Pure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional


@dataclass(frozen=True)
class KvSize:
    """What a request's KV costs on the WAN, as MD reports it (its registration answer and
    /pdd/stats: ``kv_bytes_per_token``, ``kv_window_tokens``, ``kv_window_bytes_per_token``).

    ``per_token``: every uncached token's KV; for a sliding-window pool (SGLang's SWAKVPool)
    the full-attention layers' only. Its sliding layers cost ``window_bytes_per_token`` for the
    window alone: the last ``window_tokens`` tokens MD lacks, from a page boundary, as P sends
    them (kv_channel/layout.py ``TransferPlan``, SGLang's ``_swa_payload``)."""

    per_token: int
    window_tokens: int = 0
    window_bytes_per_token: int = 0

    def __post_init__(self) -> None:
        if self.per_token < 0 or self.window_tokens < 0 or self.window_bytes_per_token < 0:
            raise ValueError(f"KV sizes must be >= 0, got {self}")
        if (self.window_tokens > 0) != (self.window_bytes_per_token > 0):
            raise ValueError(f"a sliding window needs both its tokens and its bytes per token, got {self}")

    @classmethod
    def reported(cls, report: Mapping) -> Optional["KvSize"]:
        """MD's report (its stats, or a registration answer's fields); None without a usable
        per-token size."""
        values = (report.get("kv_bytes_per_token"), report.get("kv_window_tokens") or 0,
                  report.get("kv_window_bytes_per_token") or 0)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values) or values[0] <= 0:
            return None
        try:
            return cls(*values)
        except ValueError:
            return None

    def wan_bytes(self, input_tokens: int, md_cached_tokens: int, page_size: int = 1) -> int:
        """The bytes P sends MD for a prompt of ``input_tokens`` of which MD holds
        ``md_cached_tokens`` (whole pages count): the full layers' KV of every token MD lacks,
        the sliding layers' KV of the window's. Exact at page size 1; at larger pages P sends
        the last page whole."""
        cached = min(max(0, md_cached_tokens), input_tokens)
        cached -= cached % page_size
        out = (input_tokens - cached) * self.per_token
        if self.window_tokens:  # kv_channel/layout.py window_first_page
            start = max(cached, input_tokens - input_tokens % page_size - self.window_tokens)
            out += (input_tokens - (start - start % page_size)) * self.window_bytes_per_token
        return out
