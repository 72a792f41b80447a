"""MD's DRC evictions, counted where SGLang's radix cache reports them.

SGLang's radix cache tells its metrics collector of every eviction pass that freed something
(``BasePrefixCache.update_eviction_metrics``: the tokens evicted and the pass's duration),
whoever asked for the room: SGLang's scheduler admitting or decoding a request, or MD's
ingest reserving pages for a room (main_drc.SglangTreeOps.reserve). ``count_evictions`` puts
an observer in the collector's slot that records each pass in MD's DrcStats and hands every
call on to the collector SGLang had (its Prometheus one with --enable-metrics), or drops it
where SGLang had none.
"""

from __future__ import annotations

from typing import Any, Callable


def _drop(*args: Any, **kwargs: Any) -> None:
    """A metric SGLang reports while it had no collector of its own."""


class EvictionObserver:
    """SGLang's radix-cache metrics collector, seen through: eviction passes go to ``record``
    (tokens evicted), then every call to ``inner`` (None: SGLang collected nothing)."""

    def __init__(self, inner: Any, record: Callable[[int], None]):
        self._inner, self._record = inner, record

    def increment_eviction_num_tokens(self, num_tokens: int) -> None:
        self._record(int(num_tokens))
        if self._inner is not None:
            self._inner.increment_eviction_num_tokens(num_tokens)

    def __getattr__(self, name: str) -> Any:
        return _drop if self._inner is None else getattr(self._inner, name)


def count_evictions(tree_cache: Any, record: Callable[[int], None]) -> EvictionObserver:
    """From now on, every eviction pass of ``tree_cache`` calls ``record(tokens)`` (on the
    thread that evicts: MD's scheduler thread)."""
    observer = EvictionObserver(getattr(tree_cache, "metrics_collector", None), record)
    tree_cache.metrics_collector = observer
    return observer
