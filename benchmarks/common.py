"""What several benchmarks share: the repository's root, greedy sampling, timed streams
(blocking and asyncio).

Request bodies the router itself builds come from the control protocol's types
(``sglang_pdd.protocol``: MD registration, handoff, routes) and ``sglang_pdd.router.flow.bodies``
(P/RLD legs), not from here: a benchmark sends what the router sends.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import AsyncIterator, Iterator, Optional

from sglang_pdd.launcher.http import stream_events

REPO = Path(__file__).resolve().parents[1]
# The public Mooncake FAST'25 request trace, beside the repository (../shared/traces).
MOONCAKE_TRACE = str(REPO.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl")
MOONCAKE_TRACE_SOURCE = ("https://github.com/kvcache-ai/Mooncake, FAST25-release/traces/"
                         "mooncake_synthetic_trace.jsonl (Apache-2.0)")


def require_trace(path: str, flag: Optional[str] = "--trace") -> str:
    """``path`` when it is a file; else SystemExit naming it and where the Mooncake trace comes
    from (``flag``: the option that names another file, if the script has one)."""
    if not Path(path).is_file():
        raise SystemExit(f"trace not found: {path}\n  the Mooncake trace is {MOONCAKE_TRACE_SOURCE}; download it "
                         f"to {MOONCAKE_TRACE}" + (f" or pass {flag} PATH" if flag else ""))
    return path


# Process CPU times count in clock ticks (10 ms on Linux): a figure from fewer than
# MIN_CPU_TICKS of them (or a difference of two such) is noise, and a benchmark prints n/a.
CPU_TICK_S = 1 / os.sysconf("SC_CLK_TCK")
MIN_CPU_TICKS = 50


def enough_cpu(cpu_s: float) -> bool:
    """Whether ``cpu_s`` CPU seconds are enough clock ticks to divide into a per-unit figure."""
    return cpu_s >= MIN_CPU_TICKS * CPU_TICK_S


def load_module(path: Path) -> ModuleType:
    """A module of scripts/ (a folder of scripts, no package), loaded from its file. Test helpers
    are a package: ``from tests.support import ...``."""
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


async def astream_events(session, url: str, body: dict, headers: Optional[dict] = None,
                         timeout_s: float = 600.0) -> AsyncIterator[tuple[float, dict]]:
    """The asyncio twin of ``timed_events`` (an aiohttp ``session``): (perf_counter when it
    arrived, event) per event of SGLang's SSE stream, for clients with many requests in flight."""
    import aiohttp

    async with session.post(url, json=body, headers=headers or {},
                            timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.strip()
            if line == b"data: [DONE]":
                return
            if line.startswith(b"data:"):
                yield time.perf_counter(), json.loads(line[len(b"data:"):])
