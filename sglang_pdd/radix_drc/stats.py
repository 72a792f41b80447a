"""Accounting for Main Decode's decode-side radix cache (DRC): hits, WAN bytes, evictions.

Pure counters, no I/O and no SGLang import: MD's glue calls the `record_*` methods and
exports `as_dict()` (to logs, /metrics, benchmarks). Not thread-safe: MD's scheduler
calls it from its one event loop thread.

Definitions (all in tokens unless named bytes):
- lookup: MD matched a new request's prompt against the DRC and found `cached_tokens`.
- hit_rate: token-weighted, sum(cached) / sum(prompt). What the WAN actually saves.
- request_hit_rate_mean: mean over requests of cached / prompt. Tells whether hits are
  spread over all requests or concentrated in a few long ones.
- ingest: KV for a request arrived over the WAN; `tokens_skipped` is the prefix MD already
  had, so bytes_saved = tokens_skipped * bytes_per_token were not sent.
"""

from __future__ import annotations

import operator
from typing import Dict


def _count(name: str, value: int) -> int:
    """A non-negative int (numpy ints welcome; bools and floats are caller bugs)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got a bool")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if v < 0:
        raise ValueError(f"{name} must be >= 0, got {v}")
    return v


class DrcStats:
    def __init__(self) -> None:
        self.lookups = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self._request_hit_rate_sum = 0.0
        self.ingests = 0
        self.tokens_received = 0
        self.tokens_skipped = 0
        self.bytes_received = 0
        self.bytes_saved = 0
        self.evictions = 0
        self.evicted_tokens = 0

    def record_lookup(self, prompt_tokens: int, cached_tokens: int) -> None:
        prompt = _count("prompt_tokens", prompt_tokens)
        cached = _count("cached_tokens", cached_tokens)
        # SGLang has reported cached > prompt (sglang issue #25972); such a number would
        # push hit rates above 1 and hide the bug, so refuse it loudly instead.
        if cached > prompt:
            raise ValueError(f"cached_tokens {cached} > prompt_tokens {prompt}")
        if prompt == 0:
            raise ValueError("prompt_tokens must be > 0 (a request has at least one token)")
        self.lookups += 1
        self.prompt_tokens += prompt
        self.cached_tokens += cached
        self._request_hit_rate_sum += cached / prompt

    def record_ingest(
        self, tokens_received: int, bytes_received: int, tokens_skipped: int, bytes_per_token: int
    ) -> None:
        """KV of one request landed on MD; `tokens_skipped` is the prefix MD already had."""
        received = _count("tokens_received", tokens_received)
        nbytes = _count("bytes_received", bytes_received)
        skipped = _count("tokens_skipped", tokens_skipped)
        per_token = _count("bytes_per_token", bytes_per_token)
        if per_token == 0:
            raise ValueError("bytes_per_token must be > 0")
        self.ingests += 1
        self.tokens_received += received
        self.bytes_received += nbytes
        self.tokens_skipped += skipped
        self.bytes_saved += skipped * per_token

    def record_eviction(self, tokens: int) -> None:
        self.evicted_tokens += _count("tokens", tokens)
        self.evictions += 1

    @property
    def hit_rate(self) -> float:
        """sum(cached) / sum(prompt) over all lookups; 0.0 before the first."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def request_hit_rate_mean(self) -> float:
        """Mean per-request cached/prompt; 0.0 before the first lookup."""
        return self._request_hit_rate_sum / self.lookups if self.lookups else 0.0

    @property
    def bytes_saved_fraction(self) -> float:
        """Share of the KV bytes MD needed that it did not have to receive."""
        total = self.bytes_saved + self.bytes_received
        return self.bytes_saved / total if total else 0.0

    def as_dict(self) -> Dict[str, float]:
        return {
            "lookups": self.lookups,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_rate": self.hit_rate,
            "request_hit_rate_mean": self.request_hit_rate_mean,
            "ingests": self.ingests,
            "tokens_received": self.tokens_received,
            "tokens_skipped": self.tokens_skipped,
            "bytes_received": self.bytes_received,
            "bytes_saved": self.bytes_saved,
            "bytes_saved_fraction": self.bytes_saved_fraction,
            "evictions": self.evictions,
            "evicted_tokens": self.evicted_tokens,
        }
