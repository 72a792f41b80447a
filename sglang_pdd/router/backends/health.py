"""What the router knows of each backend's health: a circuit breaker per server and per pair
(pure logic; the router feeds it events and asks it which servers it may pick).

Per server (P, RLD, MD) and per P-RLD pair (two healthy servers can still fail together, e.g.
over a broken link between them), one state machine:

    CLOSED ──failure_threshold consecutive failures──▶ OPEN (not picked)
    OPEN ──cooldown_s passed──▶ HALF_OPEN (picked again: a trial)
    HALF_OPEN ──a success (request or /health probe)──▶ CLOSED
    HALF_OPEN ──a failure──▶ OPEN (cooldown again)

A passing /health probe proves less than failing requests: within ``failure_window_s`` of a
request that failed on the server, a probe's success neither resets the failures counted nor
closes the breaker (a relay that stalls MD's streams while MD's /health answers would
otherwise keep the breaker closed forever); a request that completes on it does.

A failure is a leg that broke on the backend (connection refused or reset, 5xx, a stream cut
short, a stream it took that stalled or missed its first-token deadline) or a failed /health probe; a client that went away, a timeout the client chose and a
request refused as bad input count as neither. A failed probe of a server never seen up since
the router started does not count: a router started beside its backends would otherwise
open their breakers while they load their weights (requests that fail on it still count). Draining is the operator's, not the
breaker's: a draining server gets no new requests and finishes the ones it has.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, replace
from typing import Hashable, Iterable, Optional

from sglang_pdd.machine import IllegalTransition, table_machine


class BreakerPhase(str, enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class HealthConfig:
    failure_threshold: int = 3  # consecutive failures that open the breaker
    cooldown_s: float = 10.0  # how long an open breaker keeps the server out
    failure_window_s: float = 60.0  # a request's failure outweighs /health successes this long

    def __post_init__(self):
        if self.failure_threshold < 1 or not self.cooldown_s >= 0 or not self.failure_window_s >= 0:
            raise ValueError("failure_threshold must be >= 1, cooldown_s and failure_window_s >= 0")


@dataclass(frozen=True)
class BreakerState:
    breaker: BreakerPhase = BreakerPhase.CLOSED
    failures: int = 0  # consecutive, while CLOSED
    opened_at: float = 0.0
    draining: bool = False
    last_error: str = ""
    seen_up: bool = False  # a success (request or probe) since the router started
    request_failed_at: Optional[float] = None  # the last request's failure that counted


# ---------------------------------------------------------------------------------- events
@dataclass(frozen=True)
class BackendFailed:
    now: float
    error: str = ""
    probe: bool = False  # a failed /health probe (not a request's leg)


@dataclass(frozen=True)
class BackendSucceeded:
    now: float
    probe: bool = False  # a passing /health probe (not a request that completed)


@dataclass(frozen=True)
class Drain:
    draining: bool


Event = BackendFailed | BackendSucceeded | Drain
Result = tuple[BreakerState, list]


class IllegalBreakerEvent(IllegalTransition):
    """An event the breaker does not know."""


def settle(state: BreakerState, now: float, cfg: HealthConfig) -> BreakerState:
    """An OPEN breaker whose cooldown has passed is HALF_OPEN (time is an input, not a timer)."""
    if state.breaker is BreakerPhase.OPEN and now - state.opened_at >= cfg.cooldown_s:
        return replace(state, breaker=BreakerPhase.HALF_OPEN)
    return state


def counts(state: BreakerState, event: BackendFailed) -> bool:
    """A failure counts against a server, except a failed probe of one not seen up yet (still
    starting, as far as the router knows)."""
    return not (event.probe and not state.seen_up)


def _drain(state: BreakerState, event: Drain, cfg: HealthConfig) -> Result:
    return replace(state, draining=event.draining), []


def _succeeded(state: BreakerState, event: BackendSucceeded, cfg: HealthConfig) -> Result:
    state = settle(state, event.now, cfg)
    if event.probe and state.request_failed_at is not None \
            and event.now - state.request_failed_at < cfg.failure_window_s:
        return replace(state, seen_up=True), []  # requests failed on it lately: they decide
    return replace(state, breaker=BreakerPhase.CLOSED, failures=0, seen_up=True, request_failed_at=None), []


def _failed(state: BreakerState, event: BackendFailed, cfg: HealthConfig) -> Result:
    state = settle(state, event.now, cfg)
    if not counts(state, event):
        return replace(state, last_error=event.error), []
    if not event.probe:
        state = replace(state, request_failed_at=event.now)
    if state.breaker is BreakerPhase.OPEN:  # already out: a further failure does not extend the cooldown
        return replace(state, last_error=event.error or state.last_error), []
    failures = state.failures + 1
    if state.breaker is BreakerPhase.HALF_OPEN or failures >= cfg.failure_threshold:
        return replace(state, breaker=BreakerPhase.OPEN, failures=0, opened_at=event.now, last_error=event.error), []
    return replace(state, failures=failures, last_error=event.error), []


# No terminal state: a breaker cycles for as long as the router runs. No actions either: the
# board's readers (pick, /health, metrics) read the state.
transition = table_machine({Drain: _drain, BackendSucceeded: _succeeded, BackendFailed: _failed}, error=IllegalBreakerEvent,
                           status="breaker", noun="breaker")
transition.__doc__ = """``transition(state, event, cfg) -> (state, [])``; IllegalBreakerEvent for an unknown event."""


def pickable(state: BreakerState, now: float, cfg: HealthConfig) -> bool:
    return not state.draining and settle(state, now, cfg).breaker is not BreakerPhase.OPEN


class HealthBoard:
    """Every backend's and pair's health, keyed by ("prefill" | "relay" | "main", url) or
    ("pair", p_url, other_url)."""

    def __init__(self, cfg: HealthConfig = HealthConfig()):
        self.cfg = cfg
        self.states: dict[Hashable, BreakerState] = {}
        # failures that counted, by (key, "request" | "probe"): what the metrics export
        self.failures: Counter = Counter()

    def record(self, key: Hashable, event: Event) -> BreakerState:
        before = self.states.get(key, BreakerState())
        if isinstance(event, BackendFailed) and counts(before, event):
            self.failures[(key, "probe" if event.probe else "request")] += 1
        state, _ = transition(before, event, self.cfg)
        self.states[key] = state
        return state

    def pickable(self, key: Hashable, now: float) -> bool:
        state = self.states.get(key)
        return state is None or pickable(state, now, self.cfg)

    def usable(self, keys: Iterable[Hashable], now: float) -> bool:
        return all(self.pickable(k, now) for k in keys)

    def view(self, key: Hashable, now: float) -> BreakerState:
        return settle(self.states.get(key, BreakerState()), now, self.cfg)
