"""The PDD router's Prometheus metrics (`pdd:*`; `sglang:*` stays SGLang's own).

Where SGLang has a metric for the same quantity, ours takes its name, unit and buckets under
our prefix (`pdd:kv_transfer_latency_ms` as `sglang:kv_transfer_latency_ms`): dashboards line
them up, and a query summing `sglang:*` over all targets does not mix in the router's view.

Each `RouterMetrics` owns its `CollectorRegistry` instead of the process-global one, so
tests, benchmarks and several routers in one process can each have their own without
"Duplicated timeseries" errors. The router serves `render()` on /metrics.

Label values are closed sets (paths, handoff modes, fallback reasons) checked on every
call: a typo or a free-form string (an error message, a URL) would otherwise create a new
time series per value and blow up the cardinality. Backends are labelled by role and index
(their position in the router's --prefill / --relay / --main flags), not by URL: /metrics is
open as on SGLang (``--api-key`` exempts it) and should describe the router, not map the
deployment; the operator-only ``GET /pdd/backends`` gives each index's URL. Every allowed label value is created
at start-up with 0, so dashboards and `rate()` see the series before its first event.
No locks of its own: the router calls it from one asyncio loop (and prometheus_client's
metrics are thread-safe anyway).
"""

from __future__ import annotations

import enum
from typing import Callable, Dict, Iterable, Iterator, Mapping, Optional, Sequence, Tuple, Union

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from sglang_pdd.handoff.policy import HandoffMode
from sglang_pdd.router.flow.fallback import Reason
from sglang_pdd.router.policy import Path

# Closed label sets. Paths and modes come from the policies, so they cannot drift apart.
PATHS: Tuple[str, ...] = tuple(p.value for p in Path)
HANDOFF_MODES: Tuple[str, ...] = tuple(m.value for m in HandoffMode)
FALLBACK_REASONS: Tuple[str, ...] = (
    "wan_failed",  # the WAN KV transfer failed (connection lost, checksum, peer restart)
    "wan_timeout",  # the WAN KV transfer did not finish in time
    "md_failed",  # Main Decode errored or died while owning the request
    "md_rejected",  # Main Decode refused the request or the handoff (full, draining)
    "retried_elsewhere",  # P or RLD broke before the first token; started over on another
    "relay_stalled",  # RLD made no progress within its deadline; MD went on, or the request ended
)

# Each fallback reason (router/flow/fallback.py) -> its FALLBACK_REASONS label.
FLOW_FALLBACK_REASONS: Dict[Reason, str] = {
    Reason.WAN_FAILED: "wan_failed", Reason.MD_FAILED: "md_failed", Reason.MD_UNAVAILABLE: "md_rejected",
    Reason.RECOVERED_ON_RELAY: "md_failed",
    Reason.WAN_DESTINATION_FAILED: "wan_failed",  # P refused the late WAN destination
    Reason.RETRIED_ELSEWHERE: "retried_elsewhere",
    Reason.RELAY_STALLED: "relay_stalled",
}
# Backend roles in the per-backend series (the router's pools: RLD and MD).
BACKEND_ROLES: Tuple[str, ...] = ("prefill", "relay", "main")

CONTENT_TYPE = CONTENT_TYPE_LATEST  # the Content-Type header for render()'s bytes

# Bucket bounds sized for the cross-DC setting: TTFT includes a WAN transfer (up to
# seconds), handoff stalls should be tens of ms, hit ratios are in [0, 1] with an
# explicit 0 bucket (a cold miss is a very different request from a 5% hit).
_TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
_STALL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BYTES_BUCKETS = tuple(float(256 * 4**i) for i in range(12))  # 256 B .. 1 GiB
_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
# SGLang's own buckets (sglang/srt/observability/metrics_collector.py), so both line up.
_KV_LATENCY_MS_BUCKETS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)
_KV_SPEED_GB_S_BUCKETS = (0.1, 0.5, 1, 5, 10, 25, 50, 100, 200, 400)
_KV_TOTAL_MB_BUCKETS = (1, 5, 10, 50, 100, 500, 1000, 5000, 10000)

LabelValue = Union[str, enum.Enum]


class RouterMetrics:
    def __init__(self, registry: Optional[CollectorRegistry] = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry

        def counter(name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
            return Counter(name, doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets, labels: Sequence[str] = ()) -> Histogram:
            return Histogram(name, doc, labels, registry=r, buckets=buckets)

        # prometheus_client appends `_total` to counter names itself.
        self._requests = counter("pdd:requests", "Requests finished, by path.", ["path"])
        self._ttft = histogram("pdd:ttft_seconds", "Time to first token.", _TTFT_BUCKETS, ["path"])
        self._tpot = histogram("pdd:tpot_seconds", "Time per output token after the first.",
                               _TPOT_BUCKETS, ["path"])
        self._e2e = histogram("pdd:e2e_latency_seconds", "End-to-end request latency.",
                              _E2E_BUCKETS, ["path"])
        self._handoffs = counter("pdd:handoffs", "RLD -> MD handoffs, by mode.", ["mode"])
        self._handoff_stall = histogram(
            "pdd:handoff_stall_seconds",
            "MD stall: from handoff sent to MD's first new token.", _STALL_BUCKETS, ["mode"])
        self._handoff_payload = histogram(
            "pdd:handoff_payload_bytes", "Bytes of one handoff message.", _BYTES_BUCKETS)
        self._fallbacks = counter("pdd:fallbacks", "Requests that fell back, by reason.", ["reason"])
        self._wan_bytes = counter("pdd:wan_bytes", "KV bytes sent over the WAN.")
        self._wan_bytes_saved = counter(
            "pdd:wan_bytes_saved", "KV bytes not sent over the WAN because MD's DRC had them.")
        self._md_kv_kept = counter(
            "pdd:md_kv_kept", "Requests that ended on RLD with their KV still crossing: MD's room released "
                              "with keep_kv, the KV landing in MD's cache for the next turn (MD's /pdd/stats: "
                              "rooms_kept_landed, kv_bytes_kept_landed vs rooms_cancelled_landing).")
        self._md_hit = histogram("pdd:md_prefix_hit_ratio",
                                 "Per request: MD cached prefix tokens / prompt tokens.", _RATIO_BUCKETS)
        self._p_hit = histogram("pdd:p_prefix_hit_ratio",
                                "Per request: P cached prefix tokens / prompt tokens.", _RATIO_BUCKETS)
        self._rld_out = counter("pdd:rld_output_tokens", "Output tokens decoded on Relay Decode.")
        self._md_out = counter("pdd:md_output_tokens", "Output tokens decoded on Main Decode.")
        self._outliers = counter("pdd:outliers", "Requests the outlier filter kept on RLD.")
        self._disconnects = counter("pdd:client_disconnects", "Clients gone before the response ended.")
        self._overload_refused = counter("pdd:overload_refused",
                                         "Requests refused at once (503) because the router held its cap of them.")
        self._transfer_failed = counter(
            "pdd:num_transfer_failed_reqs",
            "Requests whose KV transfer failed (as SGLang's num_transfer_failed_reqs).")
        # SGLang measures on P from the transfer queue to the last chunk; the router sees
        # from arming MD's wait to MD's "ready", P's queueing and prefill included.
        self._kv_latency = histogram(
            "pdd:kv_transfer_latency_ms",
            "WAN KV transfer latency in ms as the router sees it (P's prefill included).",
            _KV_LATENCY_MS_BUCKETS)
        self._kv_speed = histogram(
            "pdd:kv_transfer_speed_gb_s",
            "WAN KV transfer speed in GB/s (SGLang's GB: MB/1024), bytes over the router's latency.",
            _KV_SPEED_GB_S_BUCKETS)
        self._kv_total = histogram(
            "pdd:kv_transfer_total_mb", "KV MB one request sent over the WAN.", _KV_TOTAL_MB_BUCKETS)
        self._backend_fallbacks = counter(
            "pdd:backend_fallbacks",
            "Requests that fell back while routed to this backend (MD-side fallbacks on MDs).",
            ["role", "index"])
        self._backends: Dict[str, Mapping[str, int]] = {}
        self._index: Dict[str, Dict[str, str]] = {}  # role -> url -> its index label

        for family, allowed in ((self._requests, PATHS), (self._ttft, PATHS), (self._tpot, PATHS),
                                (self._e2e, PATHS), (self._handoffs, HANDOFF_MODES),
                                (self._handoff_stall, HANDOFF_MODES),
                                (self._fallbacks, FALLBACK_REASONS)):
            for value in allowed:
                family.labels(value)

    # ---- recording -------------------------------------------------------------------

    def observe_request(
        self,
        path: LabelValue,
        ttft_s: Optional[float] = None,
        tpot_s: Optional[float] = None,
        e2e_s: Optional[float] = None,
        *,
        prompt_tokens: Optional[int] = None,
        md_cached_tokens: Optional[int] = None,
        p_cached_tokens: Optional[int] = None,
        rld_output_tokens: int = 0,
        md_output_tokens: int = 0,
    ) -> None:
        """One finished request. None = not measured (no TPOT for a one-token answer, no
        MD hit on P->RLD-only); hit ratios need `prompt_tokens`."""
        p = _label(path, PATHS, "path")
        for name, value in (("ttft_s", ttft_s), ("tpot_s", tpot_s), ("e2e_s", e2e_s)):
            if value is not None:
                _check_non_negative(name, value)
        _check_non_negative("rld_output_tokens", rld_output_tokens)
        _check_non_negative("md_output_tokens", md_output_tokens)
        md_ratio = _hit_ratio("md_cached_tokens", md_cached_tokens, prompt_tokens)
        p_ratio = _hit_ratio("p_cached_tokens", p_cached_tokens, prompt_tokens)
        # Validate everything before recording anything, so a bad call leaves no half-record.
        self._requests.labels(p).inc()
        if ttft_s is not None:
            self._ttft.labels(p).observe(ttft_s)
        if tpot_s is not None:
            self._tpot.labels(p).observe(tpot_s)
        if e2e_s is not None:
            self._e2e.labels(p).observe(e2e_s)
        if md_ratio is not None:
            self._md_hit.observe(md_ratio)
        if p_ratio is not None:
            self._p_hit.observe(p_ratio)
        self._rld_out.inc(rld_output_tokens)
        self._md_out.inc(md_output_tokens)

    def observe_handoff(self, mode: LabelValue, stall_s: Optional[float], payload_bytes: int) -> None:
        """One RLD -> MD handoff; `stall_s` None when MD never produced a token after it."""
        m = _label(mode, HANDOFF_MODES, "handoff mode")
        if stall_s is not None:
            _check_non_negative("stall_s", stall_s)
        _check_non_negative("payload_bytes", payload_bytes)
        self._handoffs.labels(m).inc()
        if stall_s is not None:
            self._handoff_stall.labels(m).observe(stall_s)
        self._handoff_payload.observe(payload_bytes)

    def fallback(self, reason: LabelValue) -> None:
        self._fallbacks.labels(_label(reason, FALLBACK_REASONS, "fallback reason")).inc()

    def wan_transfer(self, bytes_sent: int, bytes_saved: int = 0) -> None:
        """KV bytes one request sent over the WAN, and those MD's DRC spared it."""
        _check_non_negative("bytes_sent", bytes_sent)
        _check_non_negative("bytes_saved", bytes_saved)
        self._wan_bytes.inc(bytes_sent)
        self._wan_bytes_saved.inc(bytes_saved)

    def transfer_failed(self) -> None:
        self._transfer_failed.inc()

    def kv_transfer(self, latency_s: float, bytes_sent: int) -> None:
        """One request's KV landed on MD: `latency_s` as the router saw it, `bytes_sent` over
        the WAN. SGLang's units (ms, MB = 2**20 B, GB/s = MB/1024/s); no speed for 0 bytes
        (a full DRC hit moved nothing, a speed of 0 would read as a stalled link)."""
        _check_non_negative("latency_s", latency_s)
        _check_non_negative("bytes_sent", bytes_sent)
        total_mb = bytes_sent / (1024 * 1024)
        self._kv_latency.observe(latency_s * 1000)
        self._kv_total.observe(total_mb)
        if latency_s > 0 and bytes_sent > 0:
            self._kv_speed.observe(total_mb / 1024 / latency_s)

    def track_backends(self, inflight: Mapping[str, Mapping[str, int]]) -> None:
        """The router's live in-flight counts, role -> {url: requests} (in the order of the
        router's flags); read at each scrape as `pdd:backend_inflight_requests{role, index}`.
        The backends become the closed label set of `pdd:backend_fallbacks_total`
        (configured backends, not request data)."""
        if self._backends:
            raise ValueError("backends are tracked already")
        for role, counts in inflight.items():
            _label(role, BACKEND_ROLES, "backend role")
            self._index[role] = {url: str(i) for i, url in enumerate(counts)}
            for index in self._index[role].values():
                self._backend_fallbacks.labels(role, index)
        self._backends = dict(inflight)
        self.registry.register(_InflightCollector(self._backends, self._index))

    def track_backend(self, role: str, url: str) -> None:
        """A backend that joined after start (service discovery) gets the next index of its role;
        one seen before keeps its index (a label names one backend for the router's life)."""
        index = self._index.setdefault(_label(role, BACKEND_ROLES, "backend role"), {})
        if url not in index:
            index[url] = str(len(index))
            self._backend_fallbacks.labels(role, index[url])

    def track_health(self, read: Callable[[], Iterable[tuple[str, str, bool, bool]]]) -> None:
        """``read()``: (role, url, up, draining) per backend, at each scrape."""
        self.registry.register(_HealthCollector(read, self.index_of))

    def index_of(self, role: str, url: str) -> str:
        """A tracked backend's index label (ValueError for one the router was not started with)."""
        try:
            return self._index[_label(role, BACKEND_ROLES, "backend role")][url]
        except KeyError:
            raise ValueError(f"unknown {role} backend {url!r}") from None

    def track_failures(self, read: Callable[[], Iterable[tuple[str, str, str, int]]]) -> None:
        """``read()``: (role, url, source, failures so far) per backend and source ("request": a
        leg broke on it; "probe": its /health failed), at each scrape."""
        self.registry.register(_FailuresCollector(read, self.index_of))

    def track_after_end(self, counts: Mapping[str, int]) -> None:
        """``counts``: how MD's registrations that outlived their finished request went
        (router/flow/lingering.py's counters, "delivered_after_end" / "failed_after_end")."""
        self.registry.register(_AfterEndCollector(counts))

    def backend_fallback(self, role: str, url: str) -> None:
        self._backend_fallbacks.labels(role, self.index_of(role, url)).inc()

    def observe_flow(self, r, e2e_s: float, output_tokens: int, main_url: Optional[str] = None) -> None:
        """Everything one finished request's FlowResult (router/flow/pdd_flow.py) tells the metrics;
        `main_url`: the MD it was routed to (its fallbacks count against that MD)."""
        tpot = (e2e_s - r.ttft_s) / (output_tokens - 1) if r.ttft_s is not None and output_tokens > 1 else None
        self.observe_request(r.path or "p_rld_only", ttft_s=r.ttft_s, tpot_s=tpot, e2e_s=e2e_s,
                             prompt_tokens=r.prompt_tokens, md_cached_tokens=r.md_cached_tokens,
                             p_cached_tokens=min(r.p_cached_tokens, r.prompt_tokens),
                             rld_output_tokens=r.rld_tokens, md_output_tokens=r.md_tokens)
        if r.md_kv_kept:
            self._md_kv_kept.inc()
        if r.wan_bytes is not None:
            self.wan_transfer(r.wan_bytes, r.wan_bytes_saved)
            if r.wan_ready_s is not None:
                self.kv_transfer(r.wan_ready_s, r.wan_bytes)
        if r.handoff_mode and r.handoff_at is not None:
            self.observe_handoff(r.handoff_mode, r.handoff_stall_s, r.handoff_payload_bytes or 0)
        for fb in r.fallbacks:
            if fb.reason is Reason.WAN_FAILED:
                self.transfer_failed()
            self.fallback("wan_timeout" if fb.timed_out else FLOW_FALLBACK_REASONS[fb.reason])
            if fb.reason in (Reason.RETRIED_ELSEWHERE, Reason.RELAY_STALLED):
                continue  # P's or RLD's failure, not the MD's
            if main_url is not None and main_url in self._backends.get("main", {}):
                self.backend_fallback("main", main_url)

    def outlier(self) -> None:
        self._outliers.inc()

    def client_disconnect(self) -> None:
        self._disconnects.inc()

    def overload_refused(self) -> None:
        self._overload_refused.inc()

    # ---- reading ---------------------------------------------------------------------

    def render(self) -> bytes:
        """Prometheus text exposition; serve with Content-Type `CONTENT_TYPE`."""
        return generate_latest(self.registry)

    def snapshot(self) -> Dict[str, object]:
        """Plain numbers for benchmarks and tests, keyed by the exposed names.

        Counter or gauge -> value, histogram -> {"count", "sum"}; a labelled metric maps each
        label value (a tuple of them for several labels) to that, e.g.
        snap["pdd:requests_total"]["p_md"], snap["pdd:ttft_seconds"]["p_md"]["count"],
        snap["pdd:wan_bytes_total"], snap["pdd:backend_inflight_requests"][("main", url)].
        """
        snap: Dict[str, object] = {}
        for family in self.registry.collect():
            for s in family.samples:
                if s.name.endswith("_created") or s.name.endswith("_bucket"):
                    continue
                values = tuple(s.labels.values())
                label = values[0] if len(values) == 1 else (values or None)
                if family.type in ("counter", "gauge"):
                    key, field = s.name, None
                else:  # histogram: _count / _sum
                    key, field = family.name, s.name[len(family.name) + 1:]
                slot = snap
                if label is not None:
                    slot = snap.setdefault(key, {})
                    key = label
                if field is None:
                    slot[key] = s.value
                else:
                    slot.setdefault(key, {})[field] = s.value
        return snap


class _HealthCollector:
    """`pdd:backend_up` (1: the router may pick it) and `pdd:backend_draining`, per backend, from
    the router's health board (router/backends/health.py) at scrape time."""

    def __init__(self, read: Callable[[], Iterable[tuple[str, str, bool, bool]]],
                 index_of: Callable[[str, str], str]) -> None:
        self._read, self._index_of = read, index_of

    def collect(self) -> Iterator[GaugeMetricFamily]:
        up = GaugeMetricFamily("pdd:backend_up", "1 if the router may pick this backend now (breaker not "
                               "open, not draining), else 0.", labels=["role", "index"])
        draining = GaugeMetricFamily("pdd:backend_draining", "1 while an operator drains this backend.",
                                     labels=["role", "index"])
        for role, url, is_up, is_draining in self._read():
            index = self._index_of(role, url)
            up.add_metric([role, index], int(is_up))
            draining.add_metric([role, index], int(is_draining))
        yield up
        yield draining


FAILURE_SOURCES: Tuple[str, ...] = ("request", "probe")


class _FailuresCollector:
    """`pdd:backend_failures_total`: the failures the router's health board counted against each
    backend (a killed or unreachable server shows here, by role and index), read at scrape time."""

    def __init__(self, read: Callable[[], Iterable[tuple[str, str, str, int]]],
                 index_of: Callable[[str, str], str]) -> None:
        self._read, self._index_of = read, index_of

    def collect(self) -> Iterator[CounterMetricFamily]:
        c = CounterMetricFamily("pdd:backend_failures", "Failures counted against this backend by the router's "
                                "breakers: legs that broke on it (source=request), failed /health probes "
                                "(source=probe).", labels=["role", "index", "source"])
        for role, url, source, n in self._read():
            c.add_metric([role, self._index_of(role, url), _label(source, FAILURE_SOURCES, "failure source")], n)
        yield c


AFTER_END_OUTCOMES: Tuple[str, ...] = ("delivered", "failed")


class _AfterEndCollector:
    """`pdd:md_kv_after_end_total`: requests that finished on RLD before MD answered their
    registration, whose registration and WAN destination then landed after the end (MD keeps
    the KV for the next turn) or failed (MD keeps nothing), read at scrape time."""

    def __init__(self, counts: Mapping[str, int]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        c = CounterMetricFamily("pdd:md_kv_after_end", "Requests finished before MD answered their registration: "
                                "the registration and P's WAN destination landed after the end (outcome=delivered, "
                                "MD keeps the KV) or failed (outcome=failed).", labels=["outcome"])
        for outcome in AFTER_END_OUTCOMES:
            c.add_metric([outcome], self._counts.get(f"{outcome}_after_end", 0))
        yield c


class _InflightCollector:
    """`pdd:backend_inflight_requests`, read from the router's own counts at scrape time."""

    def __init__(self, backends: Mapping[str, Mapping[str, int]], index: Mapping[str, Mapping[str, str]]) -> None:
        self._backends, self._index = backends, index

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily("pdd:backend_inflight_requests",
                              "Requests in flight on this backend, as the router counts them.",
                              labels=["role", "index"])
        for role, counts in self._backends.items():
            for url, n in counts.items():
                g.add_metric([role, self._index[role][url]], n)
        yield g


def _label(value: LabelValue, allowed: Tuple[str, ...], kind: str) -> str:
    v = value.value if isinstance(value, enum.Enum) else value
    if v not in allowed:
        raise ValueError(f"unknown {kind} {value!r}; expected one of {allowed}")
    return v


def _check_non_negative(name: str, value: float) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def _hit_ratio(name: str, cached: Optional[int], prompt: Optional[int]) -> Optional[float]:
    if cached is None:
        return None
    if prompt is None:
        raise ValueError(f"{name} needs prompt_tokens")
    # Same guard as DrcStats: SGLang has reported cached > prompt (sglang issue #25972).
    if prompt <= 0 or not 0 <= cached <= prompt:
        raise ValueError(f"need 0 <= {name} <= prompt_tokens and prompt_tokens > 0, "
                         f"got {cached} / {prompt}")
    return cached / prompt
