"""Request traces: the public KV-cache trace format (Mooncake) and a synthetic agentic generator.

One request per JSON line: ``timestamp`` (ms), ``input_length``, ``output_length`` (tokens)
and ``hash_ids``, one id per 512-token block of the prompt (the last one may be partial).
Ids chain over the prefix: the same id at the same position means the same prefix up to
and including that block, so a cache keyed by block id sees exactly the reuse a radix
cache would. Optional ``session_id`` / ``turn`` fields are kept when present.

What the gap between two turns of a session is: in a recorded trace, arrival to arrival,
so the previous answer's time is inside it; the generator here draws each gap as think time
alone (a tool's run, a user's typing), counted from the previous answer's end, and marks its
requests ``"gap_after_answer": true``. The simulator replays each kind as what it is.

Everything here is plain data and iterators so the simulator and the real-server
benchmarks read the same requests.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import random
from dataclasses import dataclass
from typing import Iterable, Iterator, List, Optional, Tuple

BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: Tuple[int, ...]
    session_id: Optional[int] = None
    turn: int = 0
    # The gap from this session's previous turn is think time counted from that turn's answer
    # (a generator's); False: a recorded arrival-to-arrival gap, the answer's time inside it.
    gap_after_answer: bool = False

    def to_json(self) -> str:
        d = {
            "timestamp": self.timestamp_ms,
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": list(self.hash_ids),
        }
        if self.session_id is not None:
            d["session_id"] = self.session_id
            d["turn"] = self.turn
            if self.gap_after_answer:
                d["gap_after_answer"] = True
        return json.dumps(d)


def parse_trace_line(line: str) -> TraceRequest:
    d = json.loads(line)
    return TraceRequest(
        timestamp_ms=float(d["timestamp"]),
        input_length=int(d["input_length"]),
        output_length=int(d["output_length"]),
        hash_ids=tuple(int(h) for h in d.get("hash_ids", ())),
        session_id=d.get("session_id"),
        turn=int(d.get("turn", 0)),
        gap_after_answer=bool(d.get("gap_after_answer", False)),
    )


def load_trace(path: str, limit: Optional[int] = None) -> Iterator[TraceRequest]:
    """Stream requests from a JSONL trace (blank lines skipped)."""
    with open(path) as f:
        lines = (ln for ln in f if ln.strip())
        for line in itertools.islice(lines, limit):
            yield parse_trace_line(line)


def save_trace(requests: Iterable[TraceRequest], path: str) -> int:
    n = 0
    with open(path, "w") as f:
        for r in requests:
            f.write(r.to_json() + "\n")
            n += 1
    return n


def blocks_for(tokens: int) -> int:
    return math.ceil(tokens / BLOCK_TOKENS)


def _ideal_hits(requests: Iterable[TraceRequest]):
    """(hit tokens, input tokens) per request with an infinite cache of whole blocks."""
    seen = set()
    for r in requests:
        full_blocks = r.input_length // BLOCK_TOKENS
        n = 0
        for h in r.hash_ids[:full_blocks]:
            if h not in seen:
                break
            n += 1
        seen.update(r.hash_ids[:full_blocks])
        yield n * BLOCK_TOKENS, r.input_length


def ideal_prefix_hit_rate(requests: Iterable[TraceRequest]) -> float:
    """Token-weighted prefix hit rate with an infinite cache of whole blocks: the most any
    cache can reuse in this trace. Used to place a trace on the hit-rate axis."""
    hit = total = 0
    for h, n in _ideal_hits(requests):
        hit += h
        total += n
    return hit / total if total else 0.0


def per_request_hit_rates(requests: Iterable[TraceRequest]) -> List[float]:
    """Each request's prefix hit (whole blocks) with an infinite cache: the distribution
    behind `ideal_prefix_hit_rate` (which is its token-weighted mean)."""
    return [h / n for h, n in _ideal_hits(requests)]


@dataclass(frozen=True)
class AgenticTraceConfig:
    num_requests: int = 10_000
    seed: int = 0
    session_rate_per_s: float = 0.5  # Poisson arrivals of new sessions (~8 requests/s)
    turns_min: int = 3
    turns_max: int = 30
    num_system_prompts: int = 8  # sessions share one of a few system prompts / tool specs
    system_prompt_tokens: int = 4096
    first_user_tokens: Tuple[int, int] = (500, 4000)
    tool_result_tokens: Tuple[int, int] = (200, 3000)  # new tokens appended per turn
    output_tokens: Tuple[int, int] = (20, 400)  # tool calls and short answers
    # mean think time between a turn's answer and the next turn (tool runtime etc.): the gap
    # between the two timestamps, counted from the answer when replayed (gap_after_answer)
    think_time_s: float = 4.0
    # Long-input short-output outliers (e.g. "classify this document"): own prefix, no reuse.
    outlier_fraction: float = 0.02
    outlier_input_tokens: Tuple[int, int] = (40_000, 120_000)
    outlier_output_tokens: Tuple[int, int] = (1, 8)
    # Context management: after a turn, with this probability (or always once the context
    # exceeds max_context_tokens) the agent compacts its history: the next prompt is the
    # system prompt plus a fresh summary of `reset_tokens`, so it misses every cache.
    context_reset_prob: float = 0.0
    max_context_tokens: Optional[int] = None
    reset_tokens: Tuple[int, int] = (2000, 8000)


def realistic_agentic_config(**overrides) -> AgenticTraceConfig:
    """Agent sessions whose per-request prefix hit averages ~0.75 (coding/tool agents: long
    tool outputs, compaction at a context limit and now and then before it), not the
    default generator's ~0.87 with a fifth of requests above 95%. See docs/sim.md."""
    cfg = dict(turns_min=3, turns_max=25, system_prompt_tokens=4096, num_system_prompts=8,
               first_user_tokens=(1000, 6000), tool_result_tokens=(1000, 8000), output_tokens=(50, 800),
               think_time_s=3.0, session_rate_per_s=0.3, outlier_fraction=0.02,
               context_reset_prob=0.12, max_context_tokens=64_000, reset_tokens=(2000, 8000))
    cfg.update(overrides)
    return AgenticTraceConfig(**cfg)


def report_agentic_config(**overrides) -> AgenticTraceConfig:
    """Long agent sessions with the hit distribution of the PDD report: over 70% of requests
    high-hit (~80% of requests at >= 90% prefix hit, ~45% above 95%, mean ~0.92). Sessions
    run 20-60 turns on an 8k-token system prompt / tool spec; each turn appends a short
    output and a 0.2-2.5k-token tool result to a ~30k-token context, so a turn's new tokens
    are a few percent of its prompt; compaction only at 128k tokens or with 2% chance a
    turn. `realistic_agentic_config` (mean ~0.72, 13% of requests at >= 90%) is the
    pessimistic case."""
    cfg = dict(turns_min=20, turns_max=60, system_prompt_tokens=8192, num_system_prompts=8,
               first_user_tokens=(1000, 4000), tool_result_tokens=(200, 2500), output_tokens=(30, 400),
               think_time_s=3.0, session_rate_per_s=0.05, outlier_fraction=0.01,
               context_reset_prob=0.02, max_context_tokens=128_000, reset_tokens=(4000, 12000))
    cfg.update(overrides)
    return AgenticTraceConfig(**cfg)


def report_scenario_config(**overrides) -> AgenticTraceConfig:
    """The PDD report's own scenario: requests of ~64K tokens in all with ~1K output, 70-80% of
    them at >= 90% prefix hit, in agent sessions. A session opens on an 8k system prompt plus a
    40-56k task (a repository, documents: the cold turn), then 3-7 turns each append the answer
    (500-1500 tokens) and a 0.3-3k tool result; at 72k tokens the agent compacts to a new
    40-56k summary (cold again). The cold turns (first and compacted, ~20-25% of requests) are
    the misses. `report_agentic_config` is the report-like mix of short answers on ~34k
    contexts; this one is the report's lengths, where decode is a large part of the work."""
    cfg = dict(turns_min=3, turns_max=7, system_prompt_tokens=8192, num_system_prompts=8,
               first_user_tokens=(40_000, 56_000), tool_result_tokens=(300, 3000), output_tokens=(500, 1500),
               think_time_s=3.0, session_rate_per_s=0.08, outlier_fraction=0.01,
               outlier_input_tokens=(48_000, 64_000), outlier_output_tokens=(1, 8),
               context_reset_prob=0.0, max_context_tokens=72_000, reset_tokens=(40_000, 56_000))
    cfg.update(overrides)
    return AgenticTraceConfig(**cfg)


def conversation_config(**overrides) -> AgenticTraceConfig:
    """Chat-like traffic with little reuse: ~12k-token prompts (a document or a long paste
    plus a question), one to two turns, a short shared system prompt; ~35-40% of prompt
    tokens are a reusable prefix (token-weighted `ideal_prefix_hit_rate`)."""
    cfg = dict(turns_min=1, turns_max=2, system_prompt_tokens=1024, num_system_prompts=32,
               first_user_tokens=(3000, 17000), tool_result_tokens=(300, 3000), output_tokens=(100, 600),
               think_time_s=30.0, session_rate_per_s=1.0, outlier_fraction=0.0)
    cfg.update(overrides)
    return AgenticTraceConfig(**cfg)


class _IdAllocator:
    def __init__(self, start: int = 0) -> None:
        self._next = start

    def take(self, n: int) -> List[int]:
        ids = list(range(self._next, self._next + n))
        self._next += n
        return ids


def generate_agentic_trace(cfg: AgenticTraceConfig) -> Iterator[TraceRequest]:
    """Deterministic multi-turn agent sessions, yielded in timestamp order.

    Turn k+1's prompt is turn k's prompt + its output + a new tool result, so full blocks
    carry over with the same ids; the last, partial block changes content and gets a fresh
    id (the "tail chunk" no cache can reuse). Sessions are generated lazily from a heap, so
    memory is bounded by the number of live sessions, not the trace length.

    Turn k+1's timestamp is turn k's plus a think time: the generator knows no answer time,
    so the gap is think time alone and every request says so (``gap_after_answer``): a
    replay with turns following answers counts it from the answer's end.
    """
    rng = random.Random(cfg.seed)
    ids = _IdAllocator()
    sys_blocks = cfg.system_prompt_tokens // BLOCK_TOKENS
    system_prompts = [ids.take(sys_blocks) for _ in range(cfg.num_system_prompts)]

    # heap of (timestamp_ms, tiebreak, session_state or None for an outlier)
    heap: list = []
    tiebreak = itertools.count()
    next_session_ms = 0.0
    session_ids = itertools.count()
    emitted = 0

    def new_session(t_ms: float) -> None:
        sid = next(session_ids)
        if rng.random() < cfg.outlier_fraction:
            heapq.heappush(heap, (t_ms, next(tiebreak), ("outlier", sid)))
            return
        sp = rng.randrange(cfg.num_system_prompts)
        state = {
            "sid": sid,
            "turn": 0,
            "turns": rng.randint(cfg.turns_min, cfg.turns_max),
            "full_ids": list(system_prompts[sp]),  # ids of full blocks of the context
            "tokens": sys_blocks * BLOCK_TOKENS,
            "new": rng.randint(*cfg.first_user_tokens),
        }
        heapq.heappush(heap, (t_ms, next(tiebreak), state))

    while emitted < cfg.num_requests:
        # Admit every session that starts before the earliest pending turn.
        while not heap or next_session_ms <= heap[0][0]:
            new_session(next_session_ms)
            next_session_ms += rng.expovariate(cfg.session_rate_per_s) * 1000.0
        t_ms, _, state = heapq.heappop(heap)
        if isinstance(state, tuple):  # outlier
            n_in = rng.randint(*cfg.outlier_input_tokens)
            yield TraceRequest(round(t_ms, 3), n_in, rng.randint(*cfg.outlier_output_tokens),
                               tuple(ids.take(blocks_for(n_in))), state[1], 0, gap_after_answer=True)
            emitted += 1
            continue
        n_in = state["tokens"] + state["new"]
        full = n_in // BLOCK_TOKENS
        kept = state["full_ids"]
        full_ids = kept + ids.take(full - len(kept))
        partial = ids.take(1) if n_in % BLOCK_TOKENS else []
        n_out = rng.randint(*cfg.output_tokens)
        yield TraceRequest(round(t_ms, 3), n_in, n_out, tuple(full_ids + partial), state["sid"], state["turn"],
                           gap_after_answer=True)
        emitted += 1
        state["turn"] += 1
        if state["turn"] < state["turns"]:
            too_long = cfg.max_context_tokens is not None and n_in + n_out >= cfg.max_context_tokens
            if too_long or (cfg.context_reset_prob > 0 and rng.random() < cfg.context_reset_prob):
                # Compaction: system prompt + a new summary; nothing after the system prompt is reused.
                state["tokens"] = sys_blocks * BLOCK_TOKENS
                state["full_ids"] = list(full_ids[:sys_blocks])
                state["new"] = rng.randint(*cfg.reset_tokens)
            else:
                # Next prompt = this prompt + our output + a tool result. Only full blocks of
                # this prompt stay identical; the partial one is rewritten.
                state["tokens"] = n_in + n_out
                state["full_ids"] = full_ids[: state["tokens"] // BLOCK_TOKENS]
                state["new"] = rng.randint(*cfg.tool_result_tokens)
            gap_ms = rng.expovariate(1.0 / cfg.think_time_s) * 1000.0 if cfg.think_time_s > 0 else 0.0
            heapq.heappush(heap, (t_ms + gap_ms, next(tiebreak), state))
