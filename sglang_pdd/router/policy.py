"""Path choice for one request: P->MD, P->RLD->MD, or (outliers only) P->RLD.

Pure functions over plain dataclasses, no I/O: the real router and the simulator
(`sglang_pdd.sim`) both call `choose_path`, so what the simulator predicts is what the
router does.

The decision follows the knobs peers expose (Dynamo, llm-d, PrfaaS): it looks at the
*uncached tokens* (what Main Decode lacks after its prefix-cache hit, i.e. what must cross
the WAN) and the *estimated WAN transfer time* for them, and compares that time with a
budget carved out of the TTFT SLO.

- Transfer fits the budget -> P_MD: the user waits for the WAN once, nothing is recomputed.
- Transfer does not fit    -> P_RLD_MD: Relay Decode (same DC as P, KV over RDMA) starts
  decoding at once and hides the WAN transfer; MD takes over when its KV has landed.
- Outlier filter           -> P_RLD_ONLY: very long input with a very short expected
  output would spend seconds on the WAN for a handful of tokens, so it finishes on RLD
  and no WAN transfer is made. This is the only way to get P_RLD_ONLY.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional


class Path(str, enum.Enum):
    P_MD = "p_md"
    P_RLD_MD = "p_rld_md"
    P_RLD_ONLY = "p_rld_only"


@dataclass(frozen=True)
class PathPolicyConfig:
    wan_gbps: float = 10.0
    wan_rtt_ms: float = 40.0
    kv_bytes_per_token: int = 46_000
    ttft_slo_ms: float = 2000.0
    # The WAN may use at most this much of the TTFT budget; the rest is for queueing and
    # prefill. `max_wan_transfer_ms`, when set, overrides the fraction.
    wan_budget_fraction: float = 0.25
    max_wan_transfer_ms: Optional[float] = None
    # Caches hit in whole pages, so a partial page is always uncached.
    page_size: int = 512
    enable_outlier_filter: bool = True
    outlier_min_input_tokens: int = 32_768
    outlier_max_output_tokens: int = 16

    def __post_init__(self) -> None:
        if self.wan_gbps <= 0:
            raise ValueError("wan_gbps must be > 0")
        if self.page_size <= 0:
            raise ValueError("page_size must be > 0")
        if not 0.0 < self.wan_budget_fraction <= 1.0:
            raise ValueError("wan_budget_fraction must be in (0, 1]")

    @property
    def wan_budget_ms(self) -> float:
        if self.max_wan_transfer_ms is not None:
            return self.max_wan_transfer_ms
        return self.ttft_slo_ms * self.wan_budget_fraction


@dataclass(frozen=True)
class RequestFacts:
    input_tokens: int
    md_cached_tokens: int = 0  # prefix already in the chosen MD's decode radix cache (DRC)
    p_cached_tokens: int = 0  # prefix already in P's radix cache (prefill cost, not path)
    expected_output_tokens: Optional[int] = None  # None = unknown (outlier filter stays off)
    # Bytes of other transfers that will share the WAN with this one before it completes
    # (under fair sharing: sum over in-flight flows of min(their remaining, ours)).
    wan_competing_bytes: int = 0

    def __post_init__(self) -> None:
        if self.input_tokens <= 0:
            raise ValueError("input_tokens must be > 0")
        if self.md_cached_tokens < 0 or self.p_cached_tokens < 0 or self.wan_competing_bytes < 0:
            raise ValueError("cached tokens and competing bytes must be >= 0")


@dataclass(frozen=True)
class PathDecision:
    path: Path
    uncached_tokens: int
    est_wan_transfer_ms: float
    reason: str


def uncached_tokens(facts: RequestFacts, cfg: PathPolicyConfig) -> int:
    """Tokens whose KV Main Decode lacks: the input minus MD's whole-page prefix hit."""
    cached = min(facts.md_cached_tokens, facts.input_tokens)
    cached -= cached % cfg.page_size
    return facts.input_tokens - cached


def estimate_wan_transfer_ms(
    kv_tokens: int, cfg: PathPolicyConfig, competing_bytes: int = 0
) -> float:
    """One-way latency plus serialisation of our bytes and the bytes sharing the link."""
    total_bytes = kv_tokens * cfg.kv_bytes_per_token + competing_bytes
    return cfg.wan_rtt_ms / 2.0 + total_bytes * 8.0 / (cfg.wan_gbps * 1e9) * 1e3


def is_outlier(facts: RequestFacts, cfg: PathPolicyConfig) -> bool:
    return (
        cfg.enable_outlier_filter
        and facts.expected_output_tokens is not None
        and facts.input_tokens >= cfg.outlier_min_input_tokens
        and facts.expected_output_tokens <= cfg.outlier_max_output_tokens
    )


def choose_path(facts: RequestFacts, cfg: PathPolicyConfig) -> PathDecision:
    uncached = uncached_tokens(facts, cfg)
    est_ms = estimate_wan_transfer_ms(uncached, cfg, facts.wan_competing_bytes)
    if is_outlier(facts, cfg):
        return PathDecision(
            Path.P_RLD_ONLY,
            uncached,
            est_ms,
            f"outlier: input {facts.input_tokens} >= {cfg.outlier_min_input_tokens} and "
            f"expected output {facts.expected_output_tokens} <= {cfg.outlier_max_output_tokens}",
        )
    budget = cfg.wan_budget_ms
    if est_ms <= budget:
        return PathDecision(
            Path.P_MD, uncached, est_ms,
            f"wan {est_ms:.1f} ms <= budget {budget:.1f} ms for {uncached} uncached tokens",
        )
    return PathDecision(
        Path.P_RLD_MD, uncached, est_ms,
        f"wan {est_ms:.1f} ms > budget {budget:.1f} ms for {uncached} uncached tokens",
    )
