"""The PDD router's Prometheus metrics (`pdd:*`; `sglang:*` stays SGLang's own).

Each `RouterMetrics` owns its `CollectorRegistry` instead of the process-global one, so
tests, benchmarks and several routers in one process can each have their own without
"Duplicated timeseries" errors. The router serves `render()` on /metrics.

Label values are closed sets (paths, handoff modes, fallback reasons) checked on every
call: a typo or a free-form string (an error message, a URL) would otherwise create a new
time series per value and blow up the cardinality. Every allowed label value is created
at start-up with 0, so dashboards and `rate()` see the series before its first event.
No locks of its own: the router calls it from one asyncio loop (and prometheus_client's
metrics are thread-safe anyway).
"""

from __future__ import annotations

import enum
from typing import Dict, Optional, Sequence, Tuple, Union

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from sglang_pdd.handoff.policy import HandoffMode
from sglang_pdd.router.policy import Path

# Closed label sets. Paths and modes come from the policies, so they cannot drift apart.
PATHS: Tuple[str, ...] = tuple(p.value for p in Path)
HANDOFF_MODES: Tuple[str, ...] = tuple(m.value for m in HandoffMode)
FALLBACK_REASONS: Tuple[str, ...] = (
    "wan_failed",  # the WAN KV transfer failed (connection lost, checksum, peer restart)
    "wan_timeout",  # the WAN KV transfer did not finish in time
    "md_failed",  # Main Decode errored or died while owning the request
    "md_rejected",  # Main Decode refused the request or the handoff (full, draining)
)

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
        self._md_hit = histogram("pdd:md_prefix_hit_ratio",
                                 "Per request: MD cached prefix tokens / prompt tokens.", _RATIO_BUCKETS)
        self._p_hit = histogram("pdd:p_prefix_hit_ratio",
                                "Per request: P cached prefix tokens / prompt tokens.", _RATIO_BUCKETS)
        self._rld_out = counter("pdd:rld_output_tokens", "Output tokens decoded on Relay Decode.")
        self._md_out = counter("pdd:md_output_tokens", "Output tokens decoded on Main Decode.")
        self._outliers = counter("pdd:outliers", "Requests the outlier filter kept on RLD.")
        self._disconnects = counter("pdd:client_disconnects", "Clients gone before the response ended.")
        self._transfer_failed = counter(
            "pdd:num_transfer_failed_reqs",
            "Requests whose KV transfer failed (as SGLang's num_transfer_failed_reqs).")

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

    def outlier(self) -> None:
        self._outliers.inc()

    def client_disconnect(self) -> None:
        self._disconnects.inc()

    # ---- reading ---------------------------------------------------------------------

    def render(self) -> bytes:
        """Prometheus text exposition; serve with Content-Type `CONTENT_TYPE`."""
        return generate_latest(self.registry)

    def snapshot(self) -> Dict[str, object]:
        """Plain numbers for benchmarks and tests, keyed by the exposed names.

        Counter -> value, histogram -> {"count", "sum"}; a labelled metric maps each label
        value to that, e.g. snap["pdd:requests_total"]["p_md"],
        snap["pdd:ttft_seconds"]["p_md"]["count"], snap["pdd:wan_bytes_total"].
        """
        snap: Dict[str, object] = {}
        for family in self.registry.collect():
            for s in family.samples:
                if s.name.endswith("_created") or s.name.endswith("_bucket"):
                    continue
                label = next(iter(s.labels.values()), None)  # each metric has <= 1 label
                if family.type == "counter":
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
