"""Hardware and link profiles: what one instance of a chip type costs and how fast it is.

An instance is one serving engine (a TP group of `chips_per_instance` chips). Times are
linear models that a calibration run (benchmarks/calibrate_profile.py) can fit:

- prefill forward of `n` new tokens after `ctx` tokens already in KV:
      prefill_overhead_s + n * prefill_s_per_token + n * (ctx + n/2) * prefill_s_per_token_ctx
  (the last term is attention over the context; it is why long cached prefixes still cost);
  a pass that packs k requests adds (k - 1) * prefill_s_per_extra_request: the per-request
  work a batched pass cannot share (scheduler bookkeeping, radix match/insert, KV page
  allocation, result processing, the KV sender's per-request submission). The first
  request's share is inside prefill_overhead_s, which is what a one-request pass measures
  (benchmarks/calibrate_profile.py), so calibrated profiles do not count it twice;
- one decode step of a batch of `b` sequences holding `kv` tokens in all:
      decode_step_overhead_s + b * decode_step_s_per_seq + kv * decode_step_s_per_kv_token.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    chips_per_instance: int
    price_per_chip_hour: float  # $ per chip-hour
    kv_bytes_per_token: int
    kv_capacity_tokens: int  # KV pool for running requests
    cache_capacity_tokens: int  # radix/prefix cache kept beside the running pool
    max_running_requests: int
    prefill_overhead_s: float
    prefill_s_per_token: float
    prefill_s_per_token_ctx: float
    prefill_chunk_tokens: int
    decode_step_overhead_s: float
    decode_step_s_per_seq: float
    decode_step_s_per_kv_token: float
    # Added by each request beyond the first in one prefill pass (see the module docstring).
    # 0 for profiles written before it existed (their overhead was fitted on 1-request passes).
    prefill_s_per_extra_request: float = 0.0

    @property
    def price_per_hour(self) -> float:
        return self.chips_per_instance * self.price_per_chip_hour

    def prefill_time_s(self, new_tokens: int, ctx_tokens: int) -> float:
        """One request alone in a pass."""
        return (
            self.prefill_overhead_s
            + new_tokens * self.prefill_s_per_token
            + new_tokens * (ctx_tokens + new_tokens / 2.0) * self.prefill_s_per_token_ctx
        )

    def decode_step_s(self, batch: int, kv_tokens: int) -> float:
        return (
            self.decode_step_overhead_s
            + batch * self.decode_step_s_per_seq
            + kv_tokens * self.decode_step_s_per_kv_token
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_dict(cls, d: dict) -> "HardwareProfile":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def load(cls, path: str) -> "HardwareProfile":
        with open(path) as f:
            return cls.from_dict(json.load(f))


@dataclass(frozen=True)
class LinkProfile:
    """A network link. The WAN is shared by all transfers in flight (fair sharing, like
    long TCP flows); the same-DC RDMA fabric is modelled as uncontended."""

    name: str
    gbps: float  # math.inf = instantaneous
    one_way_latency_s: float
    jitter_s: float = 0.0  # extra latency, uniform in [0, jitter_s], per transfer
    price_per_hour: float = 0.0  # leased capacity
    price_per_gb: float = 0.0  # egress

    @property
    def bytes_per_s(self) -> float:
        return self.gbps * 1e9 / 8.0

    def serialisation_s(self, nbytes: float) -> float:
        return 0.0 if math.isinf(self.gbps) else nbytes / self.bytes_per_s


# Illustrative defaults, not measurements: a fast, pricey chip in datacenter A (prefill and
# relay decode) and a slower, cheaper chip type in datacenter B (main decode). Replace them
# with calibrated profiles (benchmarks/calibrate_profile.py) before trusting absolute numbers.
CHIP_A = HardwareProfile(
    name="chip_a",
    chips_per_instance=8,
    price_per_chip_hour=3.5,
    kv_bytes_per_token=46_000,
    kv_capacity_tokens=4_000_000,
    cache_capacity_tokens=4_000_000,
    max_running_requests=128,
    prefill_overhead_s=0.015,
    prefill_s_per_token=4.0e-5,
    prefill_s_per_token_ctx=1.2e-9,
    prefill_chunk_tokens=8192,
    decode_step_overhead_s=0.010,
    decode_step_s_per_seq=1.5e-4,
    decode_step_s_per_kv_token=1.5e-8,
    # ~1 ms per extra request in a pass: SGLang's scheduler does per-request Python work on
    # every prefill batch (PrefillAdder, prepare_for_extend, req_to_token writes, radix
    # insert and output handling after the forward) and a disaggregated prefill server
    # submits each request's KV transfer separately; a few hundred us to ~2 ms per request
    # is the usual range. Illustrative, like the rest: calibrate with k-request passes.
    prefill_s_per_extra_request=1.0e-3,
)

CHIP_B = replace(
    CHIP_A,
    name="chip_b",
    price_per_chip_hour=1.6,
    kv_capacity_tokens=2_500_000,
    cache_capacity_tokens=2_500_000,
    prefill_overhead_s=0.02,
    prefill_s_per_token=7.0e-5,
    prefill_s_per_token_ctx=2.0e-9,
    decode_step_overhead_s=0.014,
    decode_step_s_per_seq=2.2e-4,
    decode_step_s_per_kv_token=2.2e-8,
)

WAN_DEFAULT = LinkProfile("wan", gbps=25.0, one_way_latency_s=0.020, jitter_s=0.005,
                          price_per_hour=10.0, price_per_gb=0.0)
RDMA_DEFAULT = LinkProfile("rdma", gbps=400.0, one_way_latency_s=0.000_05)
