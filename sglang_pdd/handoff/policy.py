"""Relay Decode -> Main Decode handoff planning: which mode, and how to batch the tokens.

Pure logic, shared by the RLD/MD servers and the simulator.

- ONE_SHOT: when MD's KV has landed, RLD stops and hands all its eager tokens at once.
  RLD is freed soonest; the user sees one stall while MD extends all of them.
- CATCH_UP: RLD keeps decoding while MD extends batches of at most
  `catch_up_threshold_tokens`; the last batch is handed when the backlog fits one batch,
  so the user's stall is at most one small extend. Costs RLD time.

The mode follows RLD's load: a busy RLD should be freed (one-shot), an idle one can buy a
smaller MD stall (catch-up). Between the two thresholds the previous mode is kept
(hysteresis) so the mode does not flap.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Optional, Tuple


class HandoffMode(str, enum.Enum):
    ONE_SHOT = "one_shot"
    CATCH_UP = "catch_up"


@dataclass(frozen=True)
class RldLoad:
    running_requests: int
    max_running_requests: int

    @property
    def utilisation(self) -> float:
        if self.max_running_requests <= 0:
            return 1.0
        return self.running_requests / self.max_running_requests


@dataclass(frozen=True)
class HandoffConfig:
    catch_up_threshold_tokens: int = 64
    # RLD load at/above which we go one-shot, and at/below which we go catch-up.
    one_shot_at_load: float = 0.75
    catch_up_at_load: float = 0.5
    # A catch-up that does not converge (RLD faster than MD extends) ends after this many
    # rounds with one final batch of whatever is left.
    max_catch_up_rounds: int = 8
    # Fixed mode (None = follow RLD load).
    fixed_mode: Optional[HandoffMode] = None

    def __post_init__(self) -> None:
        if self.catch_up_threshold_tokens <= 0:
            raise ValueError("catch_up_threshold_tokens must be > 0")
        if self.catch_up_at_load > self.one_shot_at_load:
            raise ValueError("catch_up_at_load must be <= one_shot_at_load")
        if self.max_catch_up_rounds < 1:
            raise ValueError("max_catch_up_rounds must be >= 1")


def choose_mode(
    rld_load: "float | RldLoad",
    cfg: HandoffConfig,
    previous: Optional[HandoffMode] = None,
) -> HandoffMode:
    if cfg.fixed_mode is not None:
        return cfg.fixed_mode
    load = rld_load.utilisation if isinstance(rld_load, RldLoad) else float(rld_load)
    if load >= cfg.one_shot_at_load:
        return HandoffMode.ONE_SHOT
    if load <= cfg.catch_up_at_load:
        return HandoffMode.CATCH_UP
    return previous if previous is not None else HandoffMode.ONE_SHOT


@dataclass(frozen=True)
class CatchUpStep:
    tokens: int
    final: bool  # after this batch RLD stops and MD owns the request


def next_catch_up_batch(backlog_tokens: int, round_index: int, cfg: HandoffConfig) -> CatchUpStep:
    """One catch-up round: hand at most the threshold; the round that can hand the whole
    backlog (or the last allowed round) is final. The RLD server calls this each round
    with the tokens generated but not yet handed."""
    if backlog_tokens < 0:
        raise ValueError("backlog_tokens must be >= 0")
    if backlog_tokens <= cfg.catch_up_threshold_tokens or round_index + 1 >= cfg.max_catch_up_rounds:
        return CatchUpStep(backlog_tokens, True)
    return CatchUpStep(cfg.catch_up_threshold_tokens, False)


@dataclass(frozen=True)
class CatchUpPlan:
    batches: Tuple[int, ...]
    duration_s: float  # from the first batch handed until MD has extended the last one
    converged: bool  # False if it was cut at max_catch_up_rounds

    @property
    def total_tokens(self) -> int:
        return sum(self.batches)


def plan_catch_up(
    eager_tokens_so_far: int,
    rld_tokens_per_s: float,
    md_extend_tokens_per_s: float,
    cfg: HandoffConfig,
    md_extend_overhead_s: float = 0.0,
    max_total_tokens: Optional[int] = None,
) -> CatchUpPlan:
    """Predict the catch-up batches at fixed rates.

    While MD extends a batch, RLD keeps generating (up to `max_total_tokens`, the request's
    output budget); those tokens join the backlog. Invariant: the batches sum to exactly the
    tokens RLD generated, each non-final batch equals the threshold and the final one is
    <= threshold unless the plan was cut at `max_catch_up_rounds`.
    """
    if md_extend_tokens_per_s <= 0 or rld_tokens_per_s < 0:
        raise ValueError("rates must be positive")
    cap = math.inf if max_total_tokens is None else max_total_tokens
    generated = min(eager_tokens_so_far, cap)
    handed = 0
    batches = []
    duration = 0.0
    for round_index in range(cfg.max_catch_up_rounds):
        step = next_catch_up_batch(int(generated - handed), round_index, cfg)
        batches.append(step.tokens)
        handed += step.tokens
        extend_s = md_extend_overhead_s + step.tokens / md_extend_tokens_per_s
        duration += extend_s
        if step.final:
            return CatchUpPlan(tuple(batches), duration, converged=step.tokens <= cfg.catch_up_threshold_tokens)
        # RLD keeps decoding while MD extends this batch.
        generated = min(generated + math.floor(rld_tokens_per_s * extend_s), cap)
    raise AssertionError("unreachable: the last round is always final")
