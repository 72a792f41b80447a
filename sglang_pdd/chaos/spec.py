"""What a chaos run does (pure): the faults, the scenarios, the soak's schedule, the load.

A scenario is a load and a sequence of faults. Each fault fires ``after_s`` seconds after the
previous one has recovered (the first: after the load started), lasts ``hold_s`` and then
recovers (a killed server is started again, a link comes back, a drain ends); the load runs
until the last fault has recovered and ``tail_s`` more. Faults never overlap: a check can then
tell which fault a failed request met.

The load is open loop (arrivals do not wait for answers, as real users' do not): Poisson
arrivals at ``rate_per_s``, each a greedy streamed request on a prompt drawn from a fixed pool,
so that its output can be compared with one plain server's. Prompts come back often (MD's
cache then holds them: P->MD), new ones cross the WAN (P->RLD->MD), and long prompts with a
short output take the outlier path (P->RLD only).
"""

from __future__ import annotations

import dataclasses
import enum
import random
from dataclasses import dataclass, field
from typing import Iterator


class FaultKind(str, enum.Enum):
    KILL_RLD = "kill_rld"  # kill -9 of the relay decode server; started again after hold_s
    KILL_MD = "kill_md"  # kill -9 of main decode (datacenter B); started again after hold_s
    KILL_P = "kill_p"  # kill -9 of the prefill server; started again after hold_s
    WAN_DOWN = "wan_down"  # the link between the datacenters down for hold_s
    WAN_SLOW = "wan_slow"  # the link's rate cut 10x for hold_s
    ROUTER_RESTART = "router_restart"  # the router stopped (SIGTERM: it drains) and started again
    MD_DRAIN = "md_drain"  # MD drained (POST /pdd/backends/drain) for hold_s, then undrained
    MD_SLOW = "md_slow"  # MD's processes stopped most of the time (SIGSTOP/SIGCONT) for hold_s
    MD_STOP = "md_stop"  # MD's processes stopped (SIGSTOP) for the whole hold_s, then continued

    @property
    def kills(self) -> bool:
        return self in (FaultKind.KILL_RLD, FaultKind.KILL_MD, FaultKind.KILL_P)


ALL_KINDS: tuple[FaultKind, ...] = tuple(FaultKind)
MD_BUSY_WAIT_S = 20.0  # Fault.when_md_busy: the longest wait for MD's requests
WAN_SLOWDOWN = 10.0  # WAN_SLOW divides the link's rate by this
# MD_SLOW: of every MD_SLOW_PERIOD_S, MD's processes are stopped for this share (a noisy
# neighbour taking most of MD's CPU): MD runs at about a quarter of its speed.
MD_SLOW_PERIOD_S = 0.4
MD_SLOW_STOPPED_SHARE = 0.75


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    after_s: float  # after the previous fault recovered (the first: after the load started)
    hold_s: float = 0.0  # how long it lasts before it recovers (a killed server: dead before its restart)
    # Fire only once the router counts this many requests in flight on MD (or MD_BUSY_WAIT_S
    # after after_s, whichever comes first): a fault meant for streams MD carries meets some.
    when_md_busy: int = 0

    def __post_init__(self):
        if self.after_s < 0 or self.hold_s < 0 or self.when_md_busy < 0:
            raise ValueError(f"{self.kind.value}: after_s, hold_s and when_md_busy must be >= 0")


@dataclass(frozen=True)
class LoadSpec:
    rate_per_s: float = 2.0  # Poisson arrivals
    seed: int = 0
    prompts: int = 16  # distinct normal prompts, each asked with every max_new in max_new_choices
    prompt_tokens: tuple[int, int] = (24, 96)  # their length range
    max_new_choices: tuple[int, ...] = (16, 48)
    long_prompts: int = 4  # outliers: long input, short output (the router keeps them on RLD)
    long_prompt_tokens: int = 320
    long_max_new: int = 4
    vocab: tuple[int, int] = (3, 1000)  # token ids drawn from [low, high): no BOS/EOS/PAD
    # An overload burst: this many more requests all sent at ``burst_at_s`` into the load, beside
    # the Poisson ones (more than the router's shedding cap: the excess must get 503 at once).
    burst: int = 0
    burst_at_s: float = 8.0

    def __post_init__(self):
        if self.rate_per_s <= 0 or self.prompts < 1 or not self.max_new_choices:
            raise ValueError("the load needs rate_per_s > 0, prompts >= 1 and a max_new choice")
        if self.burst < 0 or self.burst_at_s < 0:
            raise ValueError("burst and burst_at_s must be >= 0")


@dataclass(frozen=True)
class Scenario:
    name: str
    faults: tuple[Fault, ...]
    load: LoadSpec = field(default_factory=LoadSpec)
    tail_s: float = 10.0  # load after the last fault recovered
    min_load_s: float = 30.0  # the load runs at least this long
    # Check each request's longest pause between tokens against the router's deadlines for
    # MD (checks.GapBounds): a scenario about how long a client waits, not only whether it
    # gets every token.
    bound_gaps: bool = False


@dataclass(frozen=True)
class Prompt:
    key: str  # names the (prompt, max_new) pair: the reference output is per key
    ids: tuple[int, ...]
    max_new: int


def prompt_pool(load: LoadSpec) -> list[Prompt]:
    """The fixed pool of requests the load draws from (a function of ``load`` only)."""
    rng = random.Random(load.seed * 7919 + 1)
    low, high = load.vocab
    pool = []
    for i in range(load.prompts):
        ids = tuple(rng.randrange(low, high) for _ in range(rng.randint(*load.prompt_tokens)))
        pool += [Prompt(f"p{i}-n{n}", ids, n) for n in load.max_new_choices]
    for i in range(load.long_prompts):
        ids = tuple(rng.randrange(low, high) for _ in range(load.long_prompt_tokens))
        pool.append(Prompt(f"long{i}-n{load.long_max_new}", ids, load.long_max_new))
    return pool


def arrivals(load: LoadSpec, pool: list[Prompt]) -> Iterator[tuple[float, Prompt]]:
    """(seconds after the load started, request) forever, in time order: Poisson arrivals,
    prompts uniform, and ``load.burst`` more at once at ``load.burst_at_s``."""
    rng = random.Random(load.seed * 104729 + 2)
    burst_rng = random.Random(load.seed * 104729 + 3)  # the Poisson stream is the same with or without it
    t, burst_left = 0.0, load.burst
    while True:
        t += rng.expovariate(load.rate_per_s)
        while burst_left and load.burst_at_s <= t:
            burst_left -= 1
            yield load.burst_at_s, pool[burst_rng.randrange(len(pool))]
        yield t, pool[rng.randrange(len(pool))]


# One scenario per fault kind: the fault after a few seconds of load, held long enough for the
# router to notice (its probes run every second in the chaos cluster) and for requests to
# meet it; then a tail of load on the recovered cluster.
_HOLD_S = {FaultKind.KILL_RLD: 5.0, FaultKind.KILL_MD: 5.0, FaultKind.KILL_P: 5.0, FaultKind.WAN_DOWN: 10.0,
           FaultKind.WAN_SLOW: 15.0, FaultKind.ROUTER_RESTART: 0.0, FaultKind.MD_DRAIN: 15.0,
           FaultKind.MD_SLOW: 15.0, FaultKind.MD_STOP: 6.0}
FIRST_FAULT_AFTER_S = 8.0

SCENARIOS: dict[str, Scenario] = {"baseline": Scenario("baseline", ())}
SCENARIOS.update({kind.value: Scenario(kind.value, (Fault(kind, FIRST_FAULT_AFTER_S, _HOLD_S[kind]),))
                  for kind in ALL_KINDS})
# Two faults of datacenter B in one short run (the CI tier's scenario): MD killed mid-stream,
# then, with MD back, the whole WAN down; requests in flight through each must still finish.
SCENARIOS["kill_md_wan_down"] = Scenario("kill_md_wan_down", (
    Fault(FaultKind.KILL_MD, FIRST_FAULT_AFTER_S, _HOLD_S[FaultKind.KILL_MD]),
    Fault(FaultKind.WAN_DOWN, 5.0, _HOLD_S[FaultKind.WAN_DOWN])), tail_s=8.0)
# How long a client waits when MD goes quiet for a few seconds, shorter than the router's
# --md-stall-timeout-s (20 s): the WAN down twice for WAN_BLIP_S while the load hands streams to
# MD (TCP's retransmission backoff can add about as much again before MD's bytes move), and MD
# stopped three times for MD_STOP_S, so that handoffs sent just before or during a stop wait
# for MD's first token. Each pause outlasts the router's --md-first-token-timeout-s (3 s) and
# the checks' slack, so a client waiting for MD's first token for the whole pause fails the row.
WAN_BLIP_S = 6.0
MD_STOP_S = _HOLD_S[FaultKind.MD_STOP]
# Each fires once MD has MD_BUSY requests in flight (streams it carries, handoffs on their way).
MD_BUSY = 2
SCENARIOS["wan_blip"] = Scenario("wan_blip", (
    Fault(FaultKind.WAN_DOWN, FIRST_FAULT_AFTER_S, WAN_BLIP_S, MD_BUSY),
    Fault(FaultKind.WAN_DOWN, 4.0, WAN_BLIP_S, MD_BUSY)), bound_gaps=True)
SCENARIOS["md_late_first_token"] = Scenario("md_late_first_token", (
    Fault(FaultKind.MD_STOP, FIRST_FAULT_AFTER_S, MD_STOP_S, MD_BUSY), Fault(FaultKind.MD_STOP, 3.0, MD_STOP_S, MD_BUSY),
    Fault(FaultKind.MD_STOP, 3.0, MD_STOP_S, MD_BUSY)), bound_gaps=True)
SCENARIOS["md_stop"] = dataclasses.replace(SCENARIOS["md_stop"], bound_gaps=True)


def scenario(name: str) -> Scenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}") from None


# The soak: every kind in turn (shuffled per round, so each comes as often), a random gap
# before each and a random hold within the kind's range.
SOAK_HOLD_RANGE_S = {FaultKind.KILL_RLD: (2.0, 8.0), FaultKind.KILL_MD: (2.0, 8.0), FaultKind.KILL_P: (2.0, 8.0),
                     FaultKind.WAN_DOWN: (3.0, 15.0), FaultKind.WAN_SLOW: (5.0, 20.0),
                     FaultKind.ROUTER_RESTART: (0.0, 0.0), FaultKind.MD_DRAIN: (5.0, 20.0),
                     FaultKind.MD_SLOW: (5.0, 20.0), FaultKind.MD_STOP: (1.0, 8.0)}
SOAK_GAP_RANGE_S = (3.0, 12.0)


def soak_faults(seed: int, kinds: tuple[FaultKind, ...] = ALL_KINDS) -> Iterator[Fault]:
    """The soak's faults, forever (the runner stops drawing when its time is up)."""
    if not kinds:
        raise ValueError("the soak needs at least one fault kind")
    rng = random.Random(seed * 15485863 + 3)
    while True:
        order = list(kinds)
        rng.shuffle(order)
        for kind in order:
            low, high = SOAK_HOLD_RANGE_S[kind]
            yield Fault(kind, round(rng.uniform(*SOAK_GAP_RANGE_S), 2), round(rng.uniform(low, high), 2))


def soak(seconds: float, seed: int = 0, load: LoadSpec = LoadSpec()) -> "Soak":
    return Soak(seconds, seed, load)


@dataclass(frozen=True)
class Soak:
    """Faults from ``soak_faults`` for ``seconds`` of load (no new fault after that)."""

    seconds: float
    seed: int = 0
    load: LoadSpec = field(default_factory=LoadSpec)
    tail_s: float = 10.0

    @property
    def name(self) -> str:
        return f"soak {self.seconds / 60:g} min"

    def faults(self) -> Iterator[Fault]:
        return soak_faults(self.seed)
