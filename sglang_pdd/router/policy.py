"""Path choice for one request: P->MD, P->RLD->MD, or (outliers only) P->RLD.

Pure functions over plain dataclasses, no I/O: the real router and the simulator
(`sglang_pdd.sim`) both call `decide_path`, so what the simulator predicts is what the
router does.

The decision follows the knobs peers expose (Dynamo, llm-d, PrfaaS): it looks at the
*uncached tokens* (what Main Decode lacks after its prefix-cache hit, i.e. what must cross
the WAN) and the *WAN time P->MD makes the user wait* for them, and compares that time with a
budget: the TTFT SLO left after P's queue and prefill, times a share that RLD's load sets.
When P->MD's first token comes through RLD (the router's flow), the WAN wait lands in the
gap before MD's first token instead, so the budget is capped by the gap SLO
(`p_md_wan_budget_ms`). The path mode (`PathMode`) says how the share follows RLD's load:

- FIT (default): P->MD whenever P's queue + prefill + the WAN fit `p_md_share_idle` of the
  slack while RLD idles, rising to the whole slack as RLD fills. High-hit requests (a small
  suffix) go P->MD even when RLD is idle; RLD hides the WAN for the low-hit rest.
- RELAY_FIRST: an idle RLD takes every request (share 0 up to `rld_idle_at`); P->MD only once
  RLD is busy. Relay capacity is paid for whether used or not, so this buys TTFT with RLD
  work and handoffs.

- WAN time fits the budget -> P_MD: the user waits for the WAN, nothing is handed over.
- Does not fit             -> P_RLD_MD: Relay Decode (same DC as P, KV over RDMA) starts
  decoding at once and hides the WAN transfer; MD takes over when its KV has landed.
- Outlier filter           -> P_RLD_ONLY: very long input with a very short expected
  output would spend seconds on the WAN for a handful of tokens, so it finishes on RLD
  and no WAN transfer is made. This is the only way to get P_RLD_ONLY.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Iterable, Optional

from sglang_pdd.protocol.kv_size import KvSize
from sglang_pdd.router.backends.wan_in_flight import competing_wan_bytes


# The router's RLD admission (--rld-max-running): the requests in flight one RLD counts as
# full when the load-aware WAN budget reads its load (every request routed through that RLD,
# P->MD ones included, until it ends). Not RLD's batch cap (the server's
# --max-running-requests): it sets how soon P->MD takes over from a relay that still has room.
# 256 from the simulator's sweep on the Mooncake trace at 4x (one 8xH200 RLD with a 512 batch
# cap): the best SLA attainment (90.4%) with the handoff stall's p99 at 106 ms; at 4-64 the
# requests in flight crossed the busy mark early and 71-87% went P->MD, whose users then
# waited for the WAN (stall p99 ~4 s, SLA 82.5%). The report-like agentic trace gave no choice
# (open loop, every value collapsed). About half the RLD's batch cap; scale it with a smaller
# RLD (docs/sim-notebook.md, "RLD admission"). Measured with the relay-first rule; in fit mode
# it only moves the share between p_md_share_idle and 1.
RLD_MAX_RUNNING_DEFAULT = 256


class PathMode(str, enum.Enum):
    """How RLD's load sets the share of the TTFT slack P->MD's WAN wait may use."""
    FIT = "fit"  # p_md_share_idle while RLD idles, up to the whole slack as it fills
    RELAY_FIRST = "relay_first"  # 0 while RLD idles: an idle RLD takes everything


class Path(str, enum.Enum):
    P_MD = "p_md"
    P_RLD_MD = "p_rld_md"
    P_RLD_ONLY = "p_rld_only"


@dataclass(frozen=True)
class PathPolicyConfig:
    wan_gbps: float = 10.0
    wan_rtt_ms: float = 40.0
    kv_bytes_per_token: int = 46_000
    # A sliding-window model (SGLang's SWAKVPool): kv_bytes_per_token is then its
    # full-attention layers' only, and its sliding layers cost kv_window_bytes_per_token for each
    # of the last kv_window_tokens tokens MD lacks: P sends their window, not the prompt (KvSize).
    kv_window_tokens: int = 0
    kv_window_bytes_per_token: int = 0
    ttft_slo_ms: float = 2000.0
    mode: PathMode = PathMode.FIT
    # FIT: the share of the TTFT slack P->MD may use while RLD idles. Below 1 so that an idle
    # RLD still hides the WAN for requests that would spend most of the SLO waiting on it.
    p_md_share_idle: float = 0.5
    # P's prefill speed, to turn P's queue and this request's prefill (tokens) into time. The
    # router measures it (router/backends/loads.py, P's /v1/loads) and starts from this default; never 0.
    p_prefill_tokens_per_s: float = 10_000.0
    # P's attention term: seconds per new token per token of context (the prompt's cached
    # prefix, and the new tokens before it), as sim/hardware.py's prefill_s_per_token_ctx. 0:
    # a linear estimate, which misses most of a long context's prefill.
    p_prefill_s_per_token_ctx: float = 0.0
    # A fixed WAN budget (--max-wan-transfer-ms): when set, it replaces the load-aware one.
    max_wan_transfer_ms: Optional[float] = None
    # Caches hit in whole pages, so a partial page is always uncached. SGLang's default, 1; the
    # router's --page-size and the simulator (its block size) pass theirs.
    page_size: int = 1
    enable_outlier_filter: bool = True
    outlier_min_input_tokens: int = 32_768
    outlier_max_output_tokens: int = 16
    # Load-aware budget: RLD utilisation at or below `rld_idle_at` -> the idle share (FIT:
    # p_md_share_idle; RELAY_FIRST: 0); at or above `rld_busy_at` -> the whole TTFT slack;
    # linear in between.
    rld_idle_at: float = 0.5
    rld_busy_at: float = 0.9
    # Share of the TTFT SLO kept back for what the estimate misses (MD's queue, jitter).
    ttft_safety_fraction: float = 0.1
    # P->MD registers on MD before P starts: a WAN round trip in TTFT. The router does so only
    # with --p-md-registers-first or for a P without a control API (router/flow/pdd_flow.py); otherwise
    # MD registers beside P's prefill, as for P->RLD->MD.
    p_md_registers_first: bool = True
    # P->MD's first token comes from P through RLD's one-token leg (router/flow/pdd_flow.py): the WAN
    # wait for the KV then falls in the gap between that token and MD's first, so its budget
    # is capped by `gap_slo_ms`, and TTFT pays only the registration. False (or no gap SLO):
    # the user waits for the whole WAN before its first token, judged against the TTFT SLO.
    first_token_via_rld: bool = False
    gap_slo_ms: Optional[float] = None

    def __post_init__(self) -> None:
        if self.wan_gbps <= 0:
            raise ValueError("wan_gbps must be > 0")
        if self.page_size <= 0:
            raise ValueError("page_size must be > 0")
        KvSize(self.kv_bytes_per_token, self.kv_window_tokens, self.kv_window_bytes_per_token)  # raises if invalid
        if not 0.0 <= self.rld_idle_at < self.rld_busy_at:
            raise ValueError("need 0 <= rld_idle_at < rld_busy_at")
        if not 0.0 <= self.ttft_safety_fraction < 1.0:
            raise ValueError("ttft_safety_fraction must be in [0, 1)")
        if not 0.0 <= self.p_md_share_idle <= 1.0:
            raise ValueError("p_md_share_idle must be in [0, 1]")
        if not self.p_prefill_tokens_per_s > 0:
            raise ValueError("p_prefill_tokens_per_s must be > 0")
        if self.p_prefill_s_per_token_ctx < 0:
            raise ValueError("p_prefill_s_per_token_ctx must be >= 0")
        if self.gap_slo_ms is not None and not self.gap_slo_ms > 0:
            raise ValueError("gap_slo_ms must be > 0 (or None: no gap SLO)")
        object.__setattr__(self, "mode", PathMode(self.mode))

    @property
    def kv_size(self) -> KvSize:
        return KvSize(self.kv_bytes_per_token, self.kv_window_tokens, self.kv_window_bytes_per_token)

    def with_kv_size(self, size: KvSize) -> "PathPolicyConfig":
        """This configuration with MD's KV size as MD reported it."""
        return dataclasses.replace(self, kv_bytes_per_token=size.per_token, kv_window_tokens=size.window_tokens,
                                   kv_window_bytes_per_token=size.window_bytes_per_token)

    @property
    def budgets_the_gap(self) -> bool:
        """P->MD's WAN wait lands between token 1 (through RLD) and MD's first token."""
        return self.first_token_via_rld and self.gap_slo_ms is not None


@dataclass(frozen=True)
class RequestFacts:
    input_tokens: int
    md_cached_tokens: int = 0  # prefix already in the chosen MD's decode radix cache (DRC)
    p_cached_tokens: int = 0  # prefix already in P's radix cache (prefill cost, not path)
    expected_output_tokens: Optional[int] = None  # None = unknown (outlier filter stays off)
    # Bytes of other transfers that cross the WAN before this one has landed
    # (router/backends/wan_in_flight.competing_wan_bytes: the waited ones, each up to ours).
    wan_competing_bytes: int = 0
    # Inputs of the load-aware budget. RLD's utilisation = running requests / max running of
    # the RLD this request would use (> 1 when requests already wait for it; 0: idle).
    rld_utilisation: float = 0.0
    # P's expected wait before this request's prefill starts, and its own prefill time.
    p_queue_ms: float = 0.0
    p_prefill_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.input_tokens <= 0:
            raise ValueError("input_tokens must be > 0")
        if self.md_cached_tokens < 0 or self.p_cached_tokens < 0 or self.wan_competing_bytes < 0:
            raise ValueError("cached tokens and competing bytes must be >= 0")
        if self.rld_utilisation < 0 or self.p_queue_ms < 0 or self.p_prefill_ms < 0:
            raise ValueError("rld_utilisation, p_queue_ms and p_prefill_ms must be >= 0")


@dataclass(frozen=True)
class PathDecision:
    path: Path
    uncached_tokens: int
    est_wan_transfer_ms: float  # WAN time P->MD makes the user wait (estimate_p_md_wan_ms)
    reason: str
    budget_ms: float = 0.0


def uncached_tokens(facts: RequestFacts, cfg: PathPolicyConfig) -> int:
    """Tokens whose KV Main Decode lacks: the input minus MD's whole-page prefix hit."""
    cached = min(facts.md_cached_tokens, facts.input_tokens)
    cached -= cached % cfg.page_size
    return facts.input_tokens - cached


def request_wan_bytes(facts: RequestFacts, cfg: PathPolicyConfig) -> int:
    """The KV bytes P sends MD for this request (KvSize.wan_bytes at MD's size)."""
    return cfg.kv_size.wan_bytes(facts.input_tokens, facts.md_cached_tokens, cfg.page_size)


def wan_transfer_ms(kv_bytes: int, cfg: PathPolicyConfig, competing_bytes: int = 0) -> float:
    """Until ``kv_bytes`` have landed on MD: one-way latency plus serialisation of them and
    the bytes sharing the link."""
    return cfg.wan_rtt_ms / 2.0 + (kv_bytes + competing_bytes) * 8.0 / (cfg.wan_gbps * 1e9) * 1e3


def estimate_wan_transfer_ms(
    kv_tokens: int, cfg: PathPolicyConfig, competing_bytes: int = 0
) -> float:
    """``wan_transfer_ms`` for ``kv_tokens`` tokens of ``cfg.kv_bytes_per_token`` each."""
    return wan_transfer_ms(kv_tokens * cfg.kv_bytes_per_token, cfg, competing_bytes)


# One-way WAN trips a P->MD user waits for, from the path's message sequence in
# router/flow/pdd_flow.py (router and user in datacenter A, MD in B):
#   1. router -> MD: registration;  2. MD -> router: its prefix answer.
#      flow/pdd_flow.py sends these *before* starting P on P->MD, so both are in TTFT
#      (P->RLD->MD registers concurrently with P and RLD and pays neither);
#   -  P's first token reaches the user through RLD's one-token leg (same DC, no WAN);
#   3. P -> MD: the KV pages (plus their serialisation);
#   4. MD -> router: MD's first token, i.e. the user's 2nd token.
# So 2 one-way trips in TTFT and 2 more (with the serialisation) before the 2nd token.
P_MD_REGISTRATION_ONE_WAY_TRIPS = 2
P_MD_AFTER_PREFILL_ONE_WAY_TRIPS = 2


def p_md_wan_ms(kv_bytes: int, cfg: PathPolicyConfig, competing_bytes: int = 0) -> float:
    """WAN time the user of a P->MD request whose KV is ``kv_bytes`` waits for until MD's
    first token, beyond a same-DC request: the one-way trips above plus the serialisation.
    When the policy budgets the gap (`cfg.budgets_the_gap`), the trips after P's prefill only:
    the registration is in TTFT (`registration_ms`), before the first token."""
    one_way = cfg.wan_rtt_ms / 2.0
    trips = P_MD_AFTER_PREFILL_ONE_WAY_TRIPS
    if cfg.p_md_registers_first and not cfg.budgets_the_gap:
        trips += P_MD_REGISTRATION_ONE_WAY_TRIPS
    # wan_transfer_ms holds one of the trips (trip 3)
    return wan_transfer_ms(kv_bytes, cfg, competing_bytes) + (trips - 1) * one_way


def estimate_p_md_wan_ms(
    kv_tokens: int, cfg: PathPolicyConfig, competing_bytes: int = 0
) -> float:
    """``p_md_wan_ms`` for ``kv_tokens`` tokens of ``cfg.kv_bytes_per_token`` each."""
    return p_md_wan_ms(kv_tokens * cfg.kv_bytes_per_token, cfg, competing_bytes)


def registration_ms(cfg: PathPolicyConfig) -> float:
    """What P->MD's registration on MD adds to TTFT (0 when it does not register first)."""
    return P_MD_REGISTRATION_ONE_WAY_TRIPS * cfg.wan_rtt_ms / 2.0 if cfg.p_md_registers_first else 0.0


def prefill_ms(new_tokens: int, ctx_tokens: int, cfg: PathPolicyConfig) -> float:
    """P's prefill of ``new_tokens`` after ``ctx_tokens`` it holds: the linear term at P's
    speed plus the attention term (each new token reads the context and the new tokens
    before it), as sim/hardware.py's prefill_time_s."""
    new, ctx = max(0, new_tokens), max(0, ctx_tokens)
    return 1e3 * (new / cfg.p_prefill_tokens_per_s + new * (ctx + new / 2.0) * cfg.p_prefill_s_per_token_ctx)


def p_md_share(rld_utilisation: float, cfg: PathPolicyConfig) -> float:
    """The share of the TTFT slack P->MD's WAN wait may use at this RLD load."""
    busy = (rld_utilisation - cfg.rld_idle_at) / (cfg.rld_busy_at - cfg.rld_idle_at)
    busy = min(1.0, max(0.0, busy))
    idle = cfg.p_md_share_idle if cfg.mode is PathMode.FIT else 0.0
    return idle + (1.0 - idle) * busy


def p_md_wan_budget_ms(facts: RequestFacts, cfg: PathPolicyConfig) -> float:
    """How much WAN time P->MD may make this request's user wait.

    An explicit `max_wan_transfer_ms` wins. Otherwise the TTFT SLO left after a safety share,
    P's queue and P's prefill, times the share RLD's load sets (`p_md_share`). With the first token through RLD
    (`cfg.budgets_the_gap`) the registration's round trip comes off that slack too (it is in
    TTFT), and the wait, which lands in the gap before MD's first token, is capped by the gap
    SLO less the safety share.
    """
    if cfg.max_wan_transfer_ms is not None:
        return cfg.max_wan_transfer_ms
    slack = cfg.ttft_slo_ms * (1.0 - cfg.ttft_safety_fraction) - facts.p_queue_ms - facts.p_prefill_ms
    share = p_md_share(facts.rld_utilisation, cfg)
    if cfg.budgets_the_gap:
        slack -= registration_ms(cfg)
        return min(max(0.0, slack) * share, cfg.gap_slo_ms * (1.0 - cfg.ttft_safety_fraction))
    return max(0.0, slack) * share


def is_outlier(facts: RequestFacts, cfg: PathPolicyConfig) -> bool:
    return (
        cfg.enable_outlier_filter
        and facts.expected_output_tokens is not None
        and facts.input_tokens >= cfg.outlier_min_input_tokens
        and facts.expected_output_tokens <= cfg.outlier_max_output_tokens
    )


def router_facts(input_tokens: int, md_cached_tokens: int, max_new_tokens: Optional[int],
                 rld_running: int, rld_max_running: int, cfg: PathPolicyConfig,
                 p_queued_tokens: int = 0, p_prefill_tokens: int = 0,
                 wan_waited_sizes: Iterable[int] = ()) -> RequestFacts:
    """The facts the real router has when it chooses a path, and only those: the prompt, MD's
    prefix (the index's estimate, or MD's registration answer), the request's
    max_new_tokens, the chosen RLD's requests in flight against its max running, and the
    chosen P's prefill tokens in flight (its queue as the router counts it) and this
    request's own (the prompt less what the router expects P to hold), and the size of each
    transfer it has had P send over the WAN that someone waits for and that has not landed
    (router/backends/wan_in_flight.py): those cross before this one, each up to this one's bytes
    (``competing_wan_bytes``: P's sender interleaves them and puts kept ones behind). P's
    queue becomes time at `cfg.p_prefill_tokens_per_s` (linear: the router does not know the
    queued prompts' contexts), this request's with its attention term over the prompt
    (`prefill_ms`: its prefill tokens after the prefix P is expected to hold). router/flow/pdd_flow.py
    and the simulator both build their facts here, so the simulator cannot decide on what the
    router does not see."""
    util = rld_running / rld_max_running if rld_max_running > 0 else 1.0
    own_bytes = cfg.kv_size.wan_bytes(input_tokens, md_cached_tokens, cfg.page_size)
    return RequestFacts(input_tokens=input_tokens, md_cached_tokens=md_cached_tokens,
                        expected_output_tokens=max_new_tokens, rld_utilisation=util,
                        p_queue_ms=1e3 * max(0, p_queued_tokens) / cfg.p_prefill_tokens_per_s,
                        p_prefill_ms=prefill_ms(p_prefill_tokens, input_tokens - p_prefill_tokens, cfg),
                        wan_competing_bytes=competing_wan_bytes(wan_waited_sizes, own_bytes))


def decide_path(input_tokens: int, md_cached_tokens: int, max_new_tokens: Optional[int],
                rld_running: int, rld_max_running: int, cfg: PathPolicyConfig,
                p_queued_tokens: int = 0, p_prefill_tokens: int = 0,
                wan_waited_sizes: Iterable[int] = ()) -> PathDecision:
    """The router's path decision (router/flow/pdd_flow.py and the simulator call this)."""
    return choose_path(router_facts(input_tokens, md_cached_tokens, max_new_tokens, rld_running,
                                    rld_max_running, cfg, p_queued_tokens, p_prefill_tokens,
                                    wan_waited_sizes), cfg)


def choose_path(facts: RequestFacts, cfg: PathPolicyConfig) -> PathDecision:
    uncached = uncached_tokens(facts, cfg)
    est_ms = p_md_wan_ms(request_wan_bytes(facts, cfg), cfg, facts.wan_competing_bytes)
    if is_outlier(facts, cfg):
        return PathDecision(
            Path.P_RLD_ONLY,
            uncached,
            est_ms,
            f"outlier: input {facts.input_tokens} >= {cfg.outlier_min_input_tokens} and "
            f"expected output {facts.expected_output_tokens} <= {cfg.outlier_max_output_tokens}",
        )
    budget = p_md_wan_budget_ms(facts, cfg)
    if est_ms <= budget:
        return PathDecision(
            Path.P_MD, uncached, est_ms,
            f"wan {est_ms:.1f} ms <= budget {budget:.1f} ms for {uncached} uncached tokens", budget,
        )
    return PathDecision(
        Path.P_RLD_MD, uncached, est_ms,
        f"wan {est_ms:.1f} ms > budget {budget:.1f} ms for {uncached} uncached tokens", budget,
    )
