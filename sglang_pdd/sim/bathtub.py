"""Goodput within the SLA vs mean prefix-hit rate (the "bathtub").

Every request has the same prompt and output length; a fraction `hit` of its prompt is the
previous turn of its session (same block ids), the rest is new. Block alignment matters:
the part of the hit that ends inside a 512-token block is a "tail chunk" that no cache can
reuse, so it is recomputed and shipped again; effective hits therefore move in steps of
one block and stop at 1 - 1/blocks.

The sweep is *closed loop*: `sessions` clients each send their next turn when the previous
one has finished, as a chat or agent client does (turn k+1 contains turn k's answer). An
open-loop trace above capacity cannot measure this: the next turn arrives before the
previous one has been prefilled, so the prefix is not cached yet and the hit rate the
trace promises never happens. Throughput is measured in the steady state (after the cold
first turns, before the drain at the end).

What counts is goodput within the SLA, not saturation throughput: a saturated closed loop
queues every client, so its requests miss the TTFT SLO. Each point therefore runs a few
client counts (`sessions_grid`) and reports the best steady-state *goodput* (SLA-meeting
completions per second); saturation throughput is kept beside it for reference.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import numpy as np

from sglang_pdd.sim.workload import BLOCK_TOKENS, TraceRequest, blocks_for

from .cluster import ScenarioConfig, Simulation
from .metrics import Sla, itl_ok


class FixedHitTurns:
    """Next turn of a session whose prompt keeps the whole blocks of `hit` of the previous one."""

    def __init__(self, hit: float, input_tokens: int = 16_384, output_tokens: int = 128) -> None:
        if not 0.0 <= hit < 1.0:
            raise ValueError("hit must be in [0, 1)")
        self.input_tokens, self.output_tokens = input_tokens, output_tokens
        # whole blocks only; the rest of the hit is the tail chunk
        self.shared_blocks = int(hit * input_tokens) // BLOCK_TOKENS
        self._next_id = 0
        self._last: Dict[int, tuple] = {}
        self._turn: Dict[int, int] = {}

    def next(self, sid: int, t_ms: float) -> TraceRequest:
        prev = self._last.get(sid)
        keep = list(prev[: self.shared_blocks]) if prev is not None else []
        new = blocks_for(self.input_tokens) - len(keep)
        ids = tuple(keep + list(range(self._next_id, self._next_id + new)))
        self._next_id += new
        self._last[sid] = ids
        turn = self._turn.get(sid, 0)
        self._turn[sid] = turn + 1
        return TraceRequest(round(t_ms, 3), self.input_tokens, self.output_tokens, ids, sid, turn)


def fixed_hit_trace(n: int, hit: float, input_tokens: int = 16_384, output_tokens: int = 128,
                    rate_per_s: float = 20.0, sessions: int = 64, seed: int = 0) -> Iterator[TraceRequest]:
    """Open-loop version (Poisson arrivals): a trace file for the other commands."""
    rng = random.Random(seed)
    turns = FixedHitTurns(hit, input_tokens, output_tokens)
    t = 0.0
    for _ in range(n):
        yield turns.next(rng.randrange(sessions), t * 1e3)
        t += rng.expovariate(rate_per_s)


class ClosedLoopSimulation(Simulation):
    """`sessions` clients; each sends its next turn `think_s` after its previous answer ended."""

    def __init__(self, cfg: ScenarioConfig, sla: Sla, turns: FixedHitTurns, n: int, sessions: int,
                 think_s: float = 0.0) -> None:
        super().__init__(cfg, sla)
        self.turns, self.n, self.sessions, self.think_s = turns, n, sessions, think_s
        self.issued = 0
        self.p_hit_tokens = 0
        self.p_input_tokens = 0

    def run_closed(self):
        for sid in range(min(self.sessions, self.n)):
            self._issue(sid, 1e-3 * sid)  # 1 ms apart: no artificial lock-step
        self.loop.run_until()
        return self.summary()

    def _issue(self, sid: int, t: float) -> None:
        self.issued += 1
        self.loop.at(t, self._arrive, self.turns.next(sid, 1e3 * t))

    def _schedule_next_arrival(self) -> None:  # arrivals come from finished turns only
        pass

    def _prefill_done(self, now: float, r) -> None:
        if r.tr.turn > 0:  # steady state: first turns are cold misses by construction
            self.p_hit_tokens += r.p_cached
            self.p_input_tokens += r.tr.input_length
        super()._prefill_done(now, r)

    def _finish(self, t_done: float, r, rld_tokens: int) -> None:
        super()._finish(t_done, r, rld_tokens)
        if self.issued < self.n:
            self._issue(r.tr.session_id, t_done + self.think_s)

    def _steady_window(self):
        done = np.frombuffer(self.log.arrival, dtype=np.float64) + np.frombuffer(self.log.e2e, dtype=np.float64)
        order = np.sort(done)
        lo, hi = 2 * self.sessions, len(order) - self.sessions - 1
        if hi - lo < max(10, self.sessions // 2):
            raise ValueError(f"n={len(order)} too small for {self.sessions} sessions (need n >= ~4x sessions)")
        return done, order[lo], order[hi]

    def steady_goodput_rps(self) -> float:
        """SLA-meeting completions per second in the steady window."""
        done, t0, t1 = self._steady_window()
        ttft = np.frombuffer(self.log.ttft, dtype=np.float64)
        tpot = np.frombuffer(self.log.tpot, dtype=np.float64)
        ok = (ttft <= self.sla.ttft_s) & (np.isnan(tpot) | (tpot <= self.sla.tpot_s)) & itl_ok(self.log, self.sla)
        inside = (done > t0) & (done <= t1)
        return float((ok & inside).sum()) / (t1 - t0)

    def steady_throughput_rps(self) -> float:
        """Completions per second between the end of the cold start (first `sessions` turns
        are full misses; skip 2x that) and the start of the drain (last `sessions`)."""
        done = np.sort(np.frombuffer(self.log.arrival, dtype=np.float64)
                       + np.frombuffer(self.log.e2e, dtype=np.float64))
        lo, hi = 2 * self.sessions, len(done) - self.sessions - 1
        if hi - lo < max(10, self.sessions // 2):
            raise ValueError(f"n={len(done)} too small for {self.sessions} sessions (need n >= ~4x sessions)")
        return (hi - lo) / (done[hi] - done[lo])


@dataclass(frozen=True)
class BathtubPoint:
    scenario: str
    target_hit: float
    mean_p_hit: float  # token-weighted hit on P (what was not recomputed)
    mean_md_hit: float  # token-weighted hit on MD's DRC (what was not shipped); 0 without DRC
    throughput_rps: float  # steady-state completions/s at the largest client count (saturation)
    goodput_rps: float  # best steady-state SLA-meeting completions/s over the client counts
    best_sessions: int  # the client count that gave it
    wan_util: float
    prefill_util: float  # busy fraction of the prefill fleet over the run


def sweep(scenarios: Sequence[ScenarioConfig], hits: Sequence[float], n: int, sla: Sla,
          sessions: Optional[int] = None, input_tokens: int = 16_384, output_tokens: int = 128,
          think_s: float = 0.0, progress: Optional[Callable[[], None]] = None,
          sessions_grid: Optional[Sequence[int]] = None) -> List[BathtubPoint]:
    """`sessions_grid` (default: sessions / 8, / 4, / 2, sessions): client counts tried per
    point; the largest gives saturation throughput, the best of all the goodput."""
    if sessions is None:  # enough clients to saturate the default cluster, n >= 5x sessions
        sessions = max(1, min(640, n // 5))
    grid = sorted(set(sessions_grid or [max(1, sessions // k) for k in (8, 4, 2, 1)]))
    points = []
    for hit in hits:
        for cfg in scenarios:
            best = None
            for m in grid:
                sim = ClosedLoopSimulation(cfg, sla, FixedHitTurns(hit, input_tokens, output_tokens), n, m, think_s)
                s = sim.run_closed()
                good = sim.steady_goodput_rps()
                if best is None or good > best[0]:
                    best = (good, m, sim, s)
                last = (sim, s)
            good, m, bsim, bs = best
            sim, s = last  # the largest client count: saturation
            busy = sum(p.busy_s for p in sim.prefill) / (len(sim.prefill) * s.duration_s)
            points.append(BathtubPoint(cfg.name, hit, sim.p_hit_tokens / max(1, sim.p_input_tokens),
                                       s.mean_md_hit, sim.steady_throughput_rps(), good, m, s.wan_util, busy))
            if progress:
                progress()
    return points
