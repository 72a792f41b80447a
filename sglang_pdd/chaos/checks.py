"""The checks of a chaos run over what it collected (pure: records in, verdicts out).

* Every request completes with output equal to one plain server's greedy output, or fails with
  a documented status while a fault that explains it was on (``STATUSES``: 503 + Retry-After
  only while no P or RLD could be picked, ...).
* No stream repeats or skips a token: each event's cumulative ``output_ids`` extends the
  previous event's, and what a client printing the new part of each event would have printed
  is aligned with the reference (tokens printed beyond it are duplicates, reference tokens
  missing before the point the stream reached are skips; a changed token counts as both).
* After the load nothing is held: every number a backend reports for requests, rooms, pool
  pages, staged KV and WAN destinations is 0, every flush answered 200, no leak warning in a
  server's log.
* The router's metrics counted each fault by its kind (``EVIDENCE``).
* Where a scenario bounds them (``Scenario.bound_gaps``), no client waited between two tokens
  longer than the router's deadlines for MD allow (``GapBounds``).
* Nothing is left behind: no process, namespace or veth of the run.
"""

from __future__ import annotations

import difflib
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Union

from sglang_pdd.chaos.spec import FaultKind


# ------------------------------------------------------------------------------ streams
class StreamTracker:
    """One streamed request's events (SGLang's /generate: cumulative ``output_ids``), seen as
    a client that prints each event's new part would see them."""

    def __init__(self) -> None:
        self.last: list[int] = []
        self.received: list[int] = []  # what that client printed, in order
        self.breaks = 0  # events whose output_ids did not extend the previous event's
        self.events = 0
        # The longest wait between two events that printed something (after the first: the
        # time to first token is no gap), when it began (``at`` of the event before it) and how
        # many tokens the client had printed by then.
        self.longest_gap_s = 0.0
        self.gap_began_s: Optional[float] = None
        self.gap_after = 0
        self._printed_at: Optional[float] = None

    def feed(self, output_ids: list[int], at: Optional[float] = None) -> None:
        """One event's cumulative output ids; ``at``: when it came (seconds on any clock)."""
        self.events += 1
        n = len(self.last)
        if output_ids[:n] != self.last:
            self.breaks += 1
        before = len(self.received)
        self.received.extend(output_ids[n:])
        self.last = list(output_ids)
        if at is None or len(self.received) == before:
            return
        if self._printed_at is not None and at - self._printed_at > self.longest_gap_s:
            self.longest_gap_s, self.gap_began_s, self.gap_after = at - self._printed_at, self._printed_at, before
        self._printed_at = at


def token_errors(received: list[int], reference: list[int], completed: bool) -> tuple[int, int]:
    """(duplicated, skipped) tokens of a stream against the reference: printed tokens that align
    with no reference position, and reference positions missing up to where the stream got
    (all of them for a completed stream)."""
    blocks = [b for b in difflib.SequenceMatcher(None, received, reference, autojunk=False).get_matching_blocks()
              if b.size]
    matched = sum(b.size for b in blocks)
    reached = len(reference) if completed else max((b.b + b.size for b in blocks), default=0)
    return len(received) - matched, reached - matched


# ------------------------------------------------------------------------------ statuses
@dataclass(frozen=True)
class StatusDoc:
    meaning: str
    during: tuple[FaultKind, ...]  # the faults that may cause it
    retry_after: bool = False  # the reply must carry Retry-After


# What a client of the router may get instead of a complete output, and when. Anything else
# (a stream cut short, a timeout, another status) is a failed check.
STATUSES: dict[str, StatusDoc] = {
    "503": StatusDoc("no P or no RLD could be picked (each killed, failing or draining), or the router held its "
                     "cap of requests (message 'overloaded', at any time): nothing was started; retry after "
                     "Retry-After seconds", (FaultKind.KILL_P, FaultKind.KILL_RLD), retry_after=True),
    "502": StatusDoc("the P or RLD running the request died before the client got a token, and the router's "
                     "one retry on other servers found none or failed too",
                     (FaultKind.KILL_P, FaultKind.KILL_RLD)),
    "stream_502": StatusDoc("the RLD streaming the request (or the P whose KV it waited for) died mid-stream and "
                            "nothing else held the request's state: an error event with code 502, then [DONE]",
                            (FaultKind.KILL_P, FaultKind.KILL_RLD)),
}
# The router's 503 when it holds its cap of requests (router/front/overload.py): shed at once, with
# Retry-After, whatever fault is on or none.
OVERLOADED = "overloaded"
# A fault explains a failure of a request that was in flight from when it fired until this
# long after it recovered (a recovered server is pickable again; the router has noticed it).
FAULT_GRACE_S = 3.0


@dataclass(frozen=True)
class FiredFault:
    """A fault as it happened: seconds after the load started."""
    kind: FaultKind
    started_s: float
    recovered_s: float


@dataclass(frozen=True)
class RequestRecord:
    index: int
    key: str  # the prompt pool's key: the reference output
    sent_s: float  # seconds after the load started
    ended_s: float
    status: str  # "200" (completed), an HTTP status, "stream_<code>", "cut", "timeout", "refused"
    received: tuple[int, ...] = ()
    breaks: int = 0
    retry_after: Optional[str] = None
    connect_retries: int = 0  # connections refused before the router took it (a restart)
    path: str = ""
    fallbacks: tuple[str, ...] = ()
    message: str = ""
    # The longest wait between two tokens (StreamTracker), when it began (seconds after the
    # load started) and the tokens the client had by then; from meta_info.pdd: the position
    # MD took over at (None: MD produced nothing the client got) and how long MD's KV took.
    longest_gap_s: float = 0.0
    gap_began_s: Optional[float] = None
    gap_after: int = 0
    handoff_at: Optional[int] = None
    wan_ready_s: Optional[float] = None

    @property
    def completed(self) -> bool:
        return self.status == "200"


def explained(record: RequestRecord, fired: Iterable[FiredFault]) -> bool:
    """A failed request's status is documented, carries what it must, and a fault that may
    cause it was on while the request was in flight."""
    doc = STATUSES.get(record.status)
    if doc is None or (doc.retry_after and not record.retry_after):
        return False
    if record.status == "503" and OVERLOADED in record.message:
        return True  # load shed at once (router/front/overload.py): documented with or without a fault
    return any(f.kind in doc.during and record.sent_s <= f.recovered_s + FAULT_GRACE_S
               and record.ended_s >= f.started_s for f in fired)


# ------------------------------------------------------------------------------ gaps
@dataclass(frozen=True)
class GapBounds:
    """The router's deadlines for MD (its flags, in seconds; 0: off), which bound how long a
    client waits between two tokens when MD goes quiet."""
    first_token_s: float = 3.0  # --md-first-token-timeout-s: MD's first token after the final handoff
    stall_s: float = 20.0  # --md-stall-timeout-s: no new token on MD's stream
    wan_timeout_s: float = 30.0  # --wan-timeout-s: MD's KV not landed

    @property
    def handoff_s(self) -> float:
        """The wait for MD's first token after the final handoff (the stall timeout without
        its own deadline)."""
        return self.first_token_s or self.stall_s or float("inf")


# What the bounds leave to the machine. A handoff MD missed its first token for: RLD's
# held-back tokens flow at once, or (P->MD, whose RLD leg gave one token) a new P->RLD leg
# replays one token: a prefill of <= 96 tokens and a decode step, well under a second on the
# 2-core machine, plus the router's and client's event handling under load. A stall of MD's
# committed stream: a new P->RLD leg replays what the client has (up to 48 tokens at tens of
# ms each on the chaos cluster) before the next token.
HANDOFF_SLACK_S = 2.0
RECOVERY_SLACK_S = 5.0


def gap_kind(r: RequestRecord) -> str:
    """Where a request's longest gap lies: ``md_stream`` inside MD's committed stream (or the
    recovery after it), ``p_md_bridge`` after the one token RLD bridges a P->MD request with
    (the wait for MD's KV, then the handoff), ``handoff`` anywhere else (the wait for MD's first
    token after the final handoff; RLD's own decoding)."""
    if r.handoff_at is not None and r.gap_after > r.handoff_at:
        return "md_stream"
    if r.path == "p_md" and r.gap_after <= 1:
        return "p_md_bridge"
    return "handoff"


def gap_bound(r: RequestRecord, bounds: GapBounds) -> float:
    """The longest gap the router's deadlines allow this request (its ``gap_kind``)."""
    kind = gap_kind(r)
    if kind == "md_stream":
        return (bounds.stall_s or float("inf")) + RECOVERY_SLACK_S
    if kind == "p_md_bridge":
        wan = r.wan_ready_s if r.wan_ready_s is not None else bounds.wan_timeout_s
        return wan + bounds.handoff_s + HANDOFF_SLACK_S
    return bounds.handoff_s + HANDOFF_SLACK_S


# ------------------------------------------------------------------------------ leaks
def leaks(held: Mapping[str, Mapping[str, int]], flushes: Mapping[str, int],
          warnings: Iterable[str] = ()) -> list[str]:
    """Everything still held after the load: ``held`` maps a server to its counters (each must
    be 0), ``flushes`` a server to its /flush_cache status (must be 200), ``warnings`` are leak
    lines from servers' logs."""
    found = [f"{server}: {name} = {value}" for server, counters in sorted(held.items())
             for name, value in sorted(counters.items()) if value]
    found += [f"{server}: /flush_cache answered {status}" for server, status in sorted(flushes.items())
              if status != 200]
    found += [f"log: {line}" for line in warnings]
    return found


# ------------------------------------------------------------------------------ metrics
MetricKey = tuple[str, frozenset]  # (sample name, its labels)


def counters(samples: Iterable[tuple[str, Mapping[str, str], float]]) -> dict[MetricKey, float]:
    """The samples of a scrape that only go up while a router lives, keyed by name and labels:
    counters (``*_total``) and histograms' cumulative ``*_count`` and ``*_bucket``."""
    return {(name, frozenset(labels.items())): value for name, labels, value in samples
            if name.endswith(("_total", "_count", "_bucket"))}


class CounterLedger:
    """Counter totals over a run in which the router may restart: a scrape where a counter went
    down starts a new router's segment (its counters count from 0)."""

    def __init__(self) -> None:
        self.totals: Counter = Counter()
        self.restarts = 0
        self._last: Optional[dict[MetricKey, float]] = None

    def observe(self, scrape: dict[MetricKey, float]) -> None:
        if self._last is not None:
            restarted = any(value < self._last[key] for key, value in scrape.items() if key in self._last)
            base = {} if restarted else self._last
            self.restarts += restarted
            for key, value in scrape.items():
                self.totals[key] += value - base.get(key, 0.0)
        self._last = dict(scrape)

    def snapshot(self) -> dict[MetricKey, float]:
        return dict(self.totals)


@dataclass(frozen=True)
class Slower:
    """A histogram's observations above ``bound`` (its ``_count`` less its ``le=bound`` bucket,
    summed over its other labels): what counts a fault that slows requests and fails none."""
    histogram: str
    bound: float

    def total(self, snapshot: Mapping[MetricKey, float]) -> float:
        n = 0.0
        for (name, labels), value in snapshot.items():
            if name == f"{self.histogram}_count":
                n += value
            elif name == f"{self.histogram}_bucket" and float(dict(labels).get("le", "nan")) == self.bound:
                n -= value
        return n


# Requests whose KV took over a second to land on MD (it takes ~0.1-0.5 s on the chaos cluster's
# 2 Mbit/s link), and MD stalls over half a second after a handoff (tens of ms when MD runs).
SLOW_KV = Slower("pdd:kv_transfer_latency_ms", 1000.0)
SLOW_HANDOFF = Slower("pdd:handoff_stall_seconds", 0.5)
# Requests over the TPOT SLA (100 ms per token after the first; a median of ~50 ms on the chaos
# cluster): how a pause of MD's stream shorter than the stall timeout shows, as no counter
# sees it (MD's health probe waits 20 s for an answer, so a stopped MD fails none).
SLOW_TPOT = Slower("pdd:tpot_seconds", 0.1)

# The router's metrics that count each kind of fault: any of them going up while the fault was
# on (between the scrape when it fired and the one when the next fired, or the end) counts it.
# A restarted router counts as its counters starting over (CounterLedger.restarts).
EVIDENCE: dict[FaultKind, tuple[Union[tuple[str, dict], Slower], ...]] = {
    FaultKind.KILL_RLD: (("pdd:backend_failures_total", {"role": "relay"}),),
    FaultKind.KILL_P: (("pdd:backend_failures_total", {"role": "prefill"}),),
    FaultKind.KILL_MD: (("pdd:backend_failures_total", {"role": "main"}),),
    FaultKind.WAN_DOWN: (("pdd:fallbacks_total", {"reason": "wan_failed"}),
                         ("pdd:fallbacks_total", {"reason": "wan_timeout"}),
                         ("pdd:backend_failures_total", {"role": "main"})),
    FaultKind.WAN_SLOW: (("pdd:fallbacks_total", {"reason": "wan_timeout"}), SLOW_KV),
    FaultKind.MD_DRAIN: (("pdd:fallbacks_total", {"reason": "md_rejected"}),),
    FaultKind.MD_SLOW: (("pdd:fallbacks_total", {"reason": "wan_timeout"}),
                        ("pdd:fallbacks_total", {"reason": "md_rejected"}),
                        ("pdd:fallbacks_total", {"reason": "md_failed"}), SLOW_KV, SLOW_HANDOFF),
    FaultKind.MD_STOP: (("pdd:fallbacks_total", {"reason": "md_failed"}),
                        ("pdd:fallbacks_total", {"reason": "wan_timeout"}),
                        ("pdd:backend_failures_total", {"role": "main"}), SLOW_KV, SLOW_HANDOFF, SLOW_TPOT),
}


def counted(kind: FaultKind, before: Mapping[MetricKey, float], after: Mapping[MetricKey, float],
            restarts: int = 0) -> bool:
    """Did the router's metrics count a fault of ``kind`` between two ledger snapshots?"""
    if kind is FaultKind.ROUTER_RESTART:
        return restarts > 0
    for evidence in EVIDENCE[kind]:
        if isinstance(evidence, Slower):
            if evidence.total(after) > evidence.total(before):
                return True
            continue
        name, labels = evidence
        for key, value in after.items():
            if key[0] == name and set(labels.items()) <= key[1] and value > before.get(key, 0.0):
                return True
    return False


# ------------------------------------------------------------------------------ the row
@dataclass(frozen=True)
class Row:
    name: str
    requests: int
    completed_equal: int
    completed_unequal: int
    failed: dict = field(default_factory=dict)  # documented status -> requests
    undocumented: dict = field(default_factory=dict)  # any other status (or unexplained) -> requests
    duplicated: int = 0
    skipped: int = 0
    breaks: int = 0
    faults: dict = field(default_factory=dict)  # kind -> fired
    uncounted: tuple[str, ...] = ()  # faults the router's metrics did not count
    leaks: tuple[str, ...] = ()
    leftovers: tuple[str, ...] = ()
    connect_retries: int = 0
    paths: dict = field(default_factory=dict)  # path -> completed requests
    gaps: dict = field(default_factory=dict)  # gap_kind -> the longest gap of that kind (s)
    over_bound: tuple[str, ...] = ()  # requests whose longest gap exceeded gap_bound

    @property
    def passed(self) -> bool:
        return not (self.completed_unequal or self.undocumented or self.duplicated or self.skipped or self.breaks
                    or self.uncounted or self.leaks or self.leftovers or self.over_bound)


def evaluate(name: str, records: list[RequestRecord], references: Mapping[str, list[int]],
             fired: list[FiredFault], uncounted: Iterable[str] = (), leaked: Iterable[str] = (),
             leftovers: Iterable[str] = (), gap_bounds: Optional[GapBounds] = None) -> Row:
    """The row of a scenario; ``gap_bounds``: also check each request's longest gap (gap_bound)."""
    equal = unequal = dup = skip = breaks = retries = 0
    failed: Counter = Counter()
    undocumented: Counter = Counter()
    paths: Counter = Counter()
    gaps: dict = {}
    over: list[str] = []
    for r in records:
        if r.gap_began_s is not None:
            kind = gap_kind(r)
            gaps[kind] = round(max(gaps.get(kind, 0.0), r.longest_gap_s), 2)
            if gap_bounds is not None and r.longest_gap_s > gap_bound(r, gap_bounds):
                over.append(f"#{r.index} {r.key} waited {r.longest_gap_s:.1f}s after token {r.gap_after} "
                            f"({kind}, bound {gap_bound(r, gap_bounds):.1f}s) from {r.gap_began_s:.1f}s")
        ref = list(references[r.key])
        d, s = token_errors(list(r.received), ref, r.completed)
        dup, skip, breaks, retries = dup + d, skip + s, breaks + r.breaks, retries + r.connect_retries
        if r.completed:
            if list(r.received) == ref and not r.breaks:
                equal += 1
                paths[r.path or "?"] += 1
            else:
                unequal += 1
        elif explained(r, fired):
            failed[r.status] += 1
        else:
            undocumented[r.status] += 1
    return Row(name, len(records), equal, unequal, dict(failed), dict(undocumented), dup, skip, breaks,
               dict(Counter(f.kind.value for f in fired)), tuple(uncounted), tuple(leaked), tuple(leftovers),
               retries, dict(paths), gaps, tuple(over))


HEADER = ("scenario", "requests", "completed equal", "failed with status", "duplicated", "skipped", "leaks",
          "faults", "verdict")


def cells(row: Row) -> tuple[str, ...]:
    failed = ", ".join(f"{n} x {status}" for status, n in sorted(row.failed.items())) or "0"
    if row.undocumented:
        failed += "; UNDOCUMENTED " + ", ".join(f"{n} x {status}" for status, n in sorted(row.undocumented.items()))
    if row.completed_unequal:
        failed += f"; {row.completed_unequal} completed UNEQUAL"
    faults = ", ".join(f"{k} x{n}" for k, n in sorted(row.faults.items())) or "-"
    problems = [*(f"not counted: {u}" for u in row.uncounted), *row.leftovers]
    if row.breaks:
        problems.append(f"{row.breaks} stream breaks")
    if row.over_bound:
        problems.append(f"{len(row.over_bound)} waited past the bound")
    verdict = "ok" if row.passed else "FAIL" + (f" ({'; '.join(problems)})" if problems else "")
    return (row.name, str(row.requests), str(row.completed_equal), failed, str(row.duplicated), str(row.skipped),
            str(len(row.leaks)), faults, verdict)


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table (docs/faults.md prints it)."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(cells(r)) + " |" for r in rows]
    return "\n".join(lines)
