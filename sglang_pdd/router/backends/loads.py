"""What the router measures of its servers' speed, from SGLang's own ``/v1/loads``: P's prefill
tokens per second and MD's decode step growth per running request.

Pure estimates here (``prefill_tokens_per_s``, ``flow_step_s``), the polling beside them
(``measure_forever``). SGLang's scheduler keeps cumulative counters in its load snapshot:
``total_prefill_uncached_tokens`` and ``total_prefill_busy_us`` (the tokens its prefill passes
computed and the time they took) and ``decode_moments``: ``[steps, sum b, sum t, sum b^2,
sum b*t, tokens]`` over decode steps of batch ``b`` taking ``t`` microseconds, the sums a
least-squares line of step time on batch size needs. Until a server has done enough work to
say, the router keeps its defaults (placement.MD_FLOW_STEP_S_DEFAULT, PathPolicyConfig's
p_prefill_tokens_per_s): never 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Optional, Sequence

import aiohttp

logger = logging.getLogger(__name__)

# Below this much work the counters say more about warm-up than about the server's speed.
MIN_PREFILL_TOKENS = 2048
MIN_DECODE_STEPS = 64
LOADS_POLL_S = 5.0
MAX_LOADS_REPLY_BYTES = 1 << 20


def prefill_tokens_per_s(load: dict) -> Optional[float]:
    """P's prefill speed from one ``/v1/loads`` entry; None until it has prefilled enough."""
    tokens, busy_us = load.get("total_prefill_uncached_tokens"), load.get("total_prefill_busy_us")
    if not isinstance(tokens, (int, float)) or not isinstance(busy_us, (int, float)):
        return None
    if tokens < MIN_PREFILL_TOKENS or busy_us <= 0:
        return None
    return tokens / (busy_us / 1e6)


def flow_step_s(load: dict) -> Optional[float]:
    """MD's decode step growth per running request (seconds), the slope of its step time on
    its batch size; None until it has decoded enough steps at more than one batch size, or
    when the slope is not positive (a line that says nothing about crowding)."""
    m = load.get("decode_moments")
    if not isinstance(m, (list, tuple)) or len(m) < 5 or not all(isinstance(v, (int, float)) for v in m[:5]):
        return None
    n, sb, st, sbb, sbt = m[:5]
    if n < MIN_DECODE_STEPS:
        return None
    var = n * sbb - sb * sb
    if var <= 1e-9 * n * n:  # every step at one batch size
        return None
    slope_us = (n * sbt - sb * st) / var
    return slope_us / 1e6 if slope_us > 0 else None


def merge_ranks(entries: Sequence[dict]) -> dict:
    """One server's entries (one per DP rank) as one: counters summed."""
    out: dict = {}
    for e in entries:
        for key in ("total_prefill_uncached_tokens", "total_prefill_busy_us"):
            if isinstance(e.get(key), (int, float)):
                out[key] = out.get(key, 0) + e[key]
        m = e.get("decode_moments")
        if isinstance(m, (list, tuple)):
            prev = out.get("decode_moments") or [0.0] * len(m)
            out["decode_moments"] = [a + b for a, b in zip(prev, m)]
    return out


async def read_loads_reply(session: aiohttp.ClientSession, url: str) -> Optional[dict]:
    """The server's ``/v1/loads?include=core`` reply (read up to MAX_LOADS_REPLY_BYTES); None
    when it does not answer with a JSON object."""
    try:
        async with session.get(f"{url}/v1/loads", params={"include": "core"},
                               timeout=aiohttp.ClientTimeout(total=10)) as resp:
            if resp.status != 200:
                return None
            body = await resp.content.read(MAX_LOADS_REPLY_BYTES)
        reply = json.loads(body)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None
    return reply if isinstance(reply, dict) else None


async def read_load(session: aiohttp.ClientSession, url: str) -> Optional[dict]:
    """The server's ``/v1/loads`` counters, its ranks merged; None when it does not answer."""
    reply = await read_loads_reply(session, url)
    entries = reply.get("loads") if reply is not None else None
    return merge_ranks([e for e in entries if isinstance(e, dict)]) if isinstance(entries, list) else None


async def measure_forever(session: aiohttp.ClientSession, prefill: Sequence, main: Sequence, md_flow_step_s: dict,
                          measure_prefill: bool, interval_s: float = LOADS_POLL_S) -> None:
    """Poll each P's and MD's ``/v1/loads`` every ``interval_s``: P's measured speed on its
    backend (``prefill_tokens_per_s``, when ``measure_prefill``: no --p-prefill-tokens-per-s),
    MD's step growth per flow into ``md_flow_step_s`` (the pools' table, by url)."""
    while True:
        if measure_prefill:
            for p in prefill:
                load = await read_load(session, p.url)
                rate = prefill_tokens_per_s(load) if load is not None else None
                if rate is not None:
                    p.prefill_tokens_per_s = rate
        for m in main:
            load = await read_load(session, m.url)
            step = flow_step_s(load) if load is not None else None
            if step is not None:
                md_flow_step_s[m.url] = step
        await asyncio.sleep(interval_s)
