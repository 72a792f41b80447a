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

    def feed(self, output_ids: list[int]) -> None:
        self.events += 1
        n = len(self.last)
        if output_ids[:n] != self.last:
            self.breaks += 1
        self.received.extend(output_ids[n:])
        self.last = list(output_ids)


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
    "503": StatusDoc("no P or no RLD could be picked (each killed, failing or draining): nothing was started; "
                     "retry after Retry-After seconds", (FaultKind.KILL_P, FaultKind.KILL_RLD), retry_after=True),
    "502": StatusDoc("the P or RLD running the request died before the client got a token, and the router's "
                     "one retry on other servers found none or failed too",
                     (FaultKind.KILL_P, FaultKind.KILL_RLD)),
    "stream_502": StatusDoc("the RLD streaming the request (or the P whose KV it waited for) died mid-stream and "
                            "nothing else held the request's state: an error event with code 502, then [DONE]",
                            (FaultKind.KILL_P, FaultKind.KILL_RLD)),
}
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

    @property
    def completed(self) -> bool:
        return self.status == "200"


def explained(record: RequestRecord, fired: Iterable[FiredFault]) -> bool:
    """A failed request's status is documented, carries what it must, and a fault that may
    cause it was on while the request was in flight."""
    doc = STATUSES.get(record.status)
    if doc is None or (doc.retry_after and not record.retry_after):
        return False
    return any(f.kind in doc.during and record.sent_s <= f.recovered_s + FAULT_GRACE_S
               and record.ended_s >= f.started_s for f in fired)


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

    @property
    def passed(self) -> bool:
        return not (self.completed_unequal or self.undocumented or self.duplicated or self.skipped or self.breaks
                    or self.uncounted or self.leaks or self.leftovers)


def evaluate(name: str, records: list[RequestRecord], references: Mapping[str, list[int]],
             fired: list[FiredFault], uncounted: Iterable[str] = (), leaked: Iterable[str] = (),
             leftovers: Iterable[str] = ()) -> Row:
    equal = unequal = dup = skip = breaks = retries = 0
    failed: Counter = Counter()
    undocumented: Counter = Counter()
    paths: Counter = Counter()
    for r in records:
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
               retries, dict(paths))


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
    verdict = "ok" if row.passed else "FAIL" + (f" ({'; '.join(problems)})" if problems else "")
    return (row.name, str(row.requests), str(row.completed_equal), failed, str(row.duplicated), str(row.skipped),
            str(len(row.leaks)), faults, verdict)


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table (docs/faults.md prints it)."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(cells(r)) + " |" for r in rows]
    return "\n".join(lines)
