"""What several benchmarks share: the repository's root, greedy sampling, timed streams.

Request bodies the router itself builds come from the control protocol's types
(``sglang_pdd.protocol``: MD registration, handoff, routes) and ``sglang_pdd.router.bodies``
(P/RLD legs), not from here: a benchmark sends what the router sends.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Iterator

from sglang_pdd.launcher.http import stream_events

REPO = Path(__file__).resolve().parents[1]


def load_module(path: Path) -> ModuleType:
    """A module of a folder that is no package (tests/, scripts/), loaded from its file; a
    package name for them (``tests.x``) could resolve to another project's ``tests``."""
    if path.stem in sys.modules:
        return sys.modules[path.stem]
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = sys.modules[path.stem] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
    spec.loader.exec_module(module)
    return module


def greedy(max_new_tokens: int) -> dict:
    """Sampling params of a greedy request that runs its whole budget (no early EOS), so runs
    compare the same number of tokens."""
    return {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}


def timed_events(url: str, body: dict, timeout: float = 600.0) -> Iterator[tuple[float, dict]]:
    """(perf_counter when it arrived, event) for each event of a streamed POST to ``url``
    (SGLang's SSE format); ``body`` asks for the stream itself (``"stream": True``)."""
    for event in stream_events(url, body, timeout=timeout):
        yield time.perf_counter(), event
