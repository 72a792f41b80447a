"""Per-request records and the run summary: latency percentiles, SLA goodput, WAN use,
RLD share, cost and BCR (SLA-good requests per dollar of hardware)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Dict

import numpy as np


@dataclass(frozen=True)
class Sla:
    ttft_s: float = 2.0
    tpot_s: float = 0.06
    # Longest inter-token gap allowed (the handoff stall is the one that exceeds TPOT);
    # None = not part of the SLA.
    max_itl_s: "float | None" = None


class TimeAverage:
    """Time-integral of a piecewise-constant count (for Little's law checks)."""

    def __init__(self) -> None:
        self.value = 0
        self.area = 0.0
        self._t = None

    def change(self, now: float, delta: int) -> None:
        if self._t is not None:
            self.area += self.value * (now - self._t)
        self._t = now
        self.value += delta


class GapSamples:
    """Inter-token gaps as (value s, weight tokens) pairs; equal neighbours are merged."""

    def __init__(self) -> None:
        self.values = array("d")
        self.weights = array("d")

    def add(self, value: float, weight: float) -> None:
        if self.values and self.values[-1] == value:
            self.weights[-1] += weight
        else:
            self.values.append(value)
            self.weights.append(weight)

    def arrays(self):
        return np.frombuffer(self.values, dtype=np.float64), np.frombuffer(self.weights, dtype=np.float64)

    def total(self) -> float:
        return float(sum(self.weights))


class RequestLog:
    """Compact columns of finished requests (memory ~70 B per request), and the inter-token
    gaps of every decoded token (`gaps`, one pair per decode batch change, sim/steps.py)."""

    def __init__(self) -> None:
        self.arrival = array("d")
        self.ttft = array("d")
        self.tpot = array("d")  # NaN for single-token outputs
        self.e2e = array("d")
        self.output = array("l")
        self.rld_tokens = array("l")
        self.path = array("b")  # index into PATH_CODES
        self.stall = array("d")  # gap at the switch to MD's tokens; NaN: no switch
        self.max_gap = array("d")  # longest inter-token gap, stall included; NaN: one token
        self.gaps = GapSamples()  # decode-step gaps; the stalls are in `stall`

    def __len__(self) -> int:
        return len(self.ttft)


@dataclass
class Summary:
    scenario: str
    requests: int
    duration_s: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    tpot_p50: float
    tpot_p90: float
    tpot_p99: float
    sla_attainment: float
    goodput_rps: float  # SLA-meeting requests per second
    throughput_tok_s: float  # all output tokens per second
    wan_gb: float
    wan_util: float
    rld_token_share: float
    cost_per_hour: float  # $/h: hardware, and the WAN's lease for a cross-datacenter design
    wan_cost: float  # $ for the run (leased capacity + egress)
    bcr: float  # SLA-meeting requests per $ (cost_per_hour over the run)
    paths: Dict[str, int] = field(default_factory=dict)
    mean_md_hit: float = 0.0  # token-weighted prefix hit on MD (DRC), where MD exists
    offered_rps: float = 0.0  # arrivals per second over the arrival span
    switches: int = 0  # requests whose tokens moved to MD mid-stream (handoff or P->MD via RLD)
    stall_p50: float = float("nan")  # gap at that switch, over those requests (s)
    stall_p99: float = float("nan")
    itl_p50: float = float("nan")  # inter-token gaps, token-weighted (s), see itl_samples
    itl_p99: float = float("nan")
    # Each request's longest gap (what Sla.max_itl_s checks), over the requests with 2+ tokens.
    max_itl_p50: float = float("nan")
    max_itl_p99: float = float("nan")
    md_refused: int = 0  # registrations MD refused (staging budget full): kept on RLD
    kv_wan_s_mean: float = float("nan")  # mean time from a WAN transfer's start to its landing
    kv_landed: int = 0  # WAN transfers that landed on MD (the others were cancelled)
    wan_cancelled_gb: float = 0.0  # KV not sent because its request had ended
    wan_landed_gb: float = 0.0  # KV that landed on MD (its hits' source)
    kv_kept: int = 0  # transfers whose request ended on RLD first, left to land in MD's DRC
    kv_kept_landed: int = 0  # ... of those, landed by the run's end
    kv_cancelled: int = 0  # transfers cancelled as their request ended on RLD first
    kv_kept_dropped: int = 0  # kept transfers cancelled to make room for one a request waits on
    # SLA attainment of the last tenth of arrivals: a backlog that builds up late in the run
    # shows here while the whole run's percentage still looks fine.
    tail_sla_attainment: float = 0.0
    hw_cost_per_hour: float = 0.0  # hardware only; cost_per_hour adds the WAN's lease
    wan_lease_per_hour: float = 0.0  # the WAN's lease, in cost_per_hour and so in BCR
    gpus: int = 0  # chips in the fleet
    md_waited: int = 0  # WAN transfers that waited for MD's staging budget (no RLD to fall back on)
    rld_cost_share: float = 0.0  # RLD's share of cost_per_hour
    p_host_tokens: int = 0  # prompt tokens P loaded back from its host (DRAM) tier instead of computing
    md_host_tokens: int = 0  # prompt tokens MD loaded back from its host tier instead of receiving
    staging_gb: float = 0.0  # MD's staging budget per MD
    rld_max_running: int = 0  # the router's RLD admission in the run (0: no RLD)


def percentile(a: np.ndarray, q: float) -> float:
    a = a[~np.isnan(a)]
    return float(np.percentile(a, q)) if a.size else float("nan")


def itl_samples(log: RequestLog):
    """Every inter-token gap of the run as (values, weights): the decode steps each token
    waited for (sim/steps.py), and each switch's stall once."""
    v, w = log.gaps.arrays()
    stall = np.frombuffer(log.stall, dtype=np.float64)
    stall = stall[~np.isnan(stall)]
    return np.concatenate([v, stall]), np.concatenate([w, np.ones(stall.size)])


def itl_ok(log: RequestLog, sla: Sla) -> np.ndarray:
    """Per request: its longest gap within `sla.max_itl_s` (True where the SLA has none)."""
    gap = np.frombuffer(log.max_gap, dtype=np.float64)
    if sla.max_itl_s is None:
        return np.ones(gap.size, dtype=bool)
    return np.isnan(gap) | (gap <= sla.max_itl_s)


def weighted_percentile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    if values.size == 0:
        return float("nan")
    order = np.argsort(values)
    cw = np.cumsum(weights[order])
    i = int(np.searchsorted(cw, q / 100.0 * cw[-1]))
    return float(values[order][min(i, values.size - 1)])


def summarise(name: str, log: RequestLog, sla: Sla, cost_per_hour: float, wan_bytes: float,
              wan_bytes_per_s: float, wan_price_per_hour: float, wan_price_per_gb: float,
              path_names, mean_md_hit: float = 0.0, wan_span_s: float = 0.0, md_refused: int = 0,
              kv_wan_s_mean: float = float("nan"), wan_cancelled_gb: float = 0.0, kv_landed: int = 0,
              extra: "dict | None" = None) -> Summary:
    """wan_span_s: how long the WAN was in use, if longer than the requests' span (KV of
    finished requests still landing in MD's cache)."""
    ttft = np.frombuffer(log.ttft, dtype=np.float64)
    tpot = np.frombuffer(log.tpot, dtype=np.float64)
    arrival = np.frombuffer(log.arrival, dtype=np.float64)
    e2e = np.frombuffer(log.e2e, dtype=np.float64)
    out = np.array(log.output, dtype=np.int64)
    rld = np.array(log.rld_tokens, dtype=np.int64)
    n = len(ttft)
    duration = float((arrival + e2e).max() - arrival.min()) if n else 0.0
    stall = np.frombuffer(log.stall, dtype=np.float64)
    ok = (ttft <= sla.ttft_s) & (np.isnan(tpot) | (tpot <= sla.tpot_s)) & itl_ok(log, sla)
    itl_v, itl_w = itl_samples(log)
    max_gap = np.frombuffer(log.max_gap, dtype=np.float64)
    good = int(ok.sum())
    tail = ok[np.argsort(arrival, kind="stable")[n - max(1, n // 10):]] if n else ok
    switched = stall[~np.isnan(stall)]
    arrival_span = float(arrival.max() - arrival.min()) if n else 0.0
    hours = duration / 3600.0
    hw_cost = cost_per_hour * hours
    wan_gb = wan_bytes / 1e9
    paths = np.array(log.path, dtype=np.int64)
    return Summary(
        scenario=name,
        requests=n,
        duration_s=duration,
        ttft_p50=percentile(ttft, 50), ttft_p90=percentile(ttft, 90), ttft_p99=percentile(ttft, 99),
        tpot_p50=percentile(tpot, 50), tpot_p90=percentile(tpot, 90), tpot_p99=percentile(tpot, 99),
        sla_attainment=good / n if n else 0.0,
        goodput_rps=good / duration if duration > 0 else 0.0,
        throughput_tok_s=float(out.sum()) / duration if duration > 0 else 0.0,
        wan_gb=wan_gb,
        wan_util=(wan_bytes / (wan_bytes_per_s * max(duration, wan_span_s)))
        if duration > 0 and wan_bytes_per_s > 0 else 0.0,
        rld_token_share=float(rld.sum()) / float(out.sum()) if out.sum() else 0.0,
        cost_per_hour=cost_per_hour,
        wan_cost=wan_price_per_hour * hours + wan_price_per_gb * wan_gb,
        bcr=good / hw_cost if hw_cost > 0 else 0.0,
        paths={name_: int((paths == i).sum()) for i, name_ in enumerate(path_names) if (paths == i).any()},
        mean_md_hit=mean_md_hit,
        offered_rps=(n - 1) / arrival_span if arrival_span > 0 else 0.0,
        switches=int(switched.size),
        stall_p50=percentile(switched, 50), stall_p99=percentile(switched, 99),
        itl_p50=weighted_percentile(itl_v, itl_w, 50), itl_p99=weighted_percentile(itl_v, itl_w, 99),
        max_itl_p50=percentile(max_gap, 50), max_itl_p99=percentile(max_gap, 99),
        md_refused=md_refused, kv_wan_s_mean=kv_wan_s_mean, wan_cancelled_gb=wan_cancelled_gb, kv_landed=kv_landed,
        tail_sla_attainment=float(tail.mean()) if tail.size else 0.0,
        **(extra or {}),
    )
