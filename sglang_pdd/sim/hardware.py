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
- one decode step of a batch of `b` sequences holding `kv` tokens in all, either linear (what
  a calibration fits; `decode_roofline` False):
      decode_step_overhead_s + b * decode_step_s_per_seq + kv * decode_step_s_per_kv_token
  or a roofline (the presets; `decode_roofline` True): the step takes the longer of its compute
  and its memory traffic, since the GPU overlaps the two:
      decode_step_overhead_s + max(b * decode_step_s_per_seq + kv * decode_attn_s_per_kv_token,
                                   decode_weights_s + kv * decode_step_s_per_kv_token).
  Attention compute grows with the context like the KV read does, but for MLA it is ~30x
  larger per KV byte than for GQA, so a long-context MLA decode is compute bound: counting
  bandwidth only made a 64k-context DeepSeek-V3 batch on 16 H20s look ~4x faster than it is.
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
    # Roofline decode (see the module docstring); False keeps the linear model fitted profiles use.
    decode_roofline: bool = False
    decode_weights_s: float = 0.0  # weight read per step (memory side of the roofline)
    decode_attn_s_per_kv_token: float = 0.0  # attention compute per KV token per step

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
        if self.decode_roofline:
            return self.decode_step_overhead_s + max(
                batch * self.decode_step_s_per_seq + kv_tokens * self.decode_attn_s_per_kv_token,
                self.decode_weights_s + kv_tokens * self.decode_step_s_per_kv_token)
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


# ---- coherent presets: one model class on one chip type ---------------------------------
# Every number and its source is in docs/sim.md ("Hardware presets"). Spec-sheet numbers
# are public figures; efficiencies and prices are estimates (marked there), so calibrate
# (benchmarks/calibrate_profile.py) before trusting absolute numbers.


@dataclass(frozen=True)
class Chip:
    name: str
    hbm_gb: float  # per chip
    hbm_tb_s: float  # memory bandwidth per chip
    bf16_tflops: float  # dense
    fp8_tflops: float  # dense
    price_per_chip_hour: float  # estimate, see docs/sim.md


@dataclass(frozen=True)
class ModelClass:
    name: str
    active_params_b: float  # parameters touched per token (MoE: activated), billions
    weight_bytes_gb: float  # weights as served (bf16 for the GQA model, fp8 for the MLA one)
    kv_bytes_per_token: int
    attn_flops_per_token_ctx: float  # prefill attention FLOPs per (new token, context token)
    fp8_compute: bool  # prefill matmuls in fp8
    # Decode attention FLOPs per (new token, context token), bf16; MLA decodes on the latent.
    decode_attn_flops_per_token_ctx: float = 0.0


# Chip figures: vendor datasheets, dense (no sparsity) tensor-core peaks.
# H100 SXM5: NVIDIA H100 Tensor Core GPU datasheet: 80 GB HBM3, 3.35 TB/s, BF16 989 / FP8 1979 TFLOPS.
H100 = Chip("h100", hbm_gb=80, hbm_tb_s=3.35, bf16_tflops=989, fp8_tflops=1979, price_per_chip_hour=3.00)
# H200 SXM: NVIDIA H200 datasheet: 141 GB HBM3e, 4.8 TB/s, same tensor cores as H100 SXM5.
H200 = Chip("h200", hbm_gb=141, hbm_tb_s=4.8, bf16_tflops=989, fp8_tflops=1979, price_per_chip_hour=3.75)
# H20: NVIDIA HGX H20 spec as publicly reported (2024): 96 GB HBM3, 4.0 TB/s, BF16 148 / FP8 296 TFLOPS.
H20 = Chip("h20", hbm_gb=96, hbm_tb_s=4.0, bf16_tflops=148, fp8_tflops=296, price_per_chip_hour=1.30)
CHIPS = {c.name: c for c in (H100, H200, H20)}

# Llama-3-70B (meta-llama/Meta-Llama-3-70B config.json: 80 layers, hidden 8192, 64 attention
# heads, 8 KV heads, so head dim 128), GQA, bf16 KV: 2 (K, V) * 80 * 8 * 128 * 2 B per token.
# Attention, prefill and decode alike: every one of the 64 query heads does QK^T and AV over
# 128 dims per context token, 2 FLOPs per multiply-add: 4 * 80 * 64 * 128 per (token, context token).
LLAMA3_70B = ModelClass("llama3-70b", active_params_b=70.6, weight_bytes_gb=141.0,
                        kv_bytes_per_token=2 * 80 * 8 * 128 * 2,
                        attn_flops_per_token_ctx=4 * 80 * 64 * 128, fp8_compute=False,
                        decode_attn_flops_per_token_ctx=4 * 80 * 64 * 128)
# DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json: 61 layers, 128 heads, kv_lora_rank 512,
# qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128; arXiv:2412.19437: 671B
# parameters, 37B activated, fp8 weights). MLA caches the 512 latent + 64 rope dims per token
# and layer, bf16: 576 * 61 * 2 B. Prefill attention runs per head on decompressed K/V:
# 128 heads x (192 qk + 128 v). Decode absorbs the up-projections (FlashMLA, SGLang's MLA
# decode): each of the 128 heads scores the 576-dim latent and sums the 512-dim latent per
# context token, 2 * 128 * (576 + 512) FLOPs per layer, bf16.
DEEPSEEK_V3 = ModelClass("deepseek-v3", active_params_b=37.0, weight_bytes_gb=690.0,
                         kv_bytes_per_token=(512 + 64) * 61 * 2,
                         attn_flops_per_token_ctx=2 * 61 * 128 * (192 + 128), fp8_compute=True,
                         decode_attn_flops_per_token_ctx=2 * 61 * 128 * (576 + 512))
MODELS = {m.name: m for m in (LLAMA3_70B, DEEPSEEK_V3)}

# Estimated efficiencies (fractions of peak); see docs/sim.md for the sanity checks.
PREFILL_MFU = 0.40
DECODE_MFU = 0.50
DECODE_MBU = 0.70
USABLE_HBM = 0.90  # the rest: activations, CUDA graphs, fragmentation
STEP_OVERHEAD_S = 0.003  # scheduler + launch per decode step, beyond the weight read


def instance_chips(model: ModelClass, chip: Chip) -> int:
    """Smallest power-of-two TP group whose memory holds the weights with >= 25% left for KV."""
    n = 1
    while n * chip.hbm_gb * USABLE_HBM < model.weight_bytes_gb * 1.25:
        n *= 2
    return n


def preset(model: "ModelClass | str", chip: "Chip | str", chips: int = 0) -> HardwareProfile:
    """A HardwareProfile derived from the model's size and the chip's spec sheet."""
    m = MODELS[model] if isinstance(model, str) else model
    c = CHIPS[chip] if isinstance(chip, str) else chip
    n = chips or instance_chips(m, c)
    flops = 2.0 * m.active_params_b * 1e9
    peak = (c.fp8_tflops if m.fp8_compute else c.bf16_tflops) * 1e12 * n
    bw = c.hbm_tb_s * 1e12 * n * DECODE_MBU
    free_bytes = n * c.hbm_gb * 1e9 * USABLE_HBM - m.weight_bytes_gb * 1e9
    if free_bytes < 0.1 * m.weight_bytes_gb * 1e9:  # no room for a useful KV pool
        raise ValueError(f"{m.name} does not fit {n} x {c.name} with room for KV")
    kv_tokens = int(free_bytes / m.kv_bytes_per_token)
    return HardwareProfile(
        name=f"{m.name}@{n}x{c.name}",
        chips_per_instance=n,
        price_per_chip_hour=c.price_per_chip_hour,
        kv_bytes_per_token=m.kv_bytes_per_token,
        kv_capacity_tokens=kv_tokens,
        # SGLang's radix cache lives in the same pool; half of it is a fair share when busy.
        cache_capacity_tokens=kv_tokens // 2,
        max_running_requests=512,
        prefill_overhead_s=0.010,
        prefill_s_per_token=flops / (peak * PREFILL_MFU),
        prefill_s_per_token_ctx=m.attn_flops_per_token_ctx / (c.bf16_tflops * 1e12 * n * PREFILL_MFU),
        prefill_chunk_tokens=8192,
        decode_step_overhead_s=STEP_OVERHEAD_S,
        decode_step_s_per_seq=flops / (peak * DECODE_MFU),
        decode_step_s_per_kv_token=m.kv_bytes_per_token / bw,
        prefill_s_per_extra_request=1.0e-3,
        decode_roofline=True,
        decode_weights_s=m.weight_bytes_gb * 1e9 / bw,
        decode_attn_s_per_kv_token=m.decode_attn_flops_per_token_ctx / (c.bf16_tflops * 1e12 * n * DECODE_MFU),
    )


# Defaults: a Llama-3-70B-class model; P, RLD and PD's decode on H100, MD on the cheaper
# decode chip (H20: more bandwidth per $, little compute). The old CHIP_A/CHIP_B mixed an
# MLA-sized KV (46 KB/token) with 70B-class compute; these are one model on each chip.
CHIP_A = preset(LLAMA3_70B, H100)
CHIP_B = preset(LLAMA3_70B, H20)

# A small, fast pair for unit tests of mechanisms only (the pre-issue-12 defaults): its KV
# size is MLA-like beside 70B-class compute, i.e. no real model. Do not report with it.
TOY_A = HardwareProfile(
    name="toy_a", chips_per_instance=8, price_per_chip_hour=3.5, kv_bytes_per_token=46_000,
    kv_capacity_tokens=4_000_000, cache_capacity_tokens=4_000_000, max_running_requests=128,
    prefill_overhead_s=0.015, prefill_s_per_token=4.0e-5, prefill_s_per_token_ctx=1.2e-9,
    prefill_chunk_tokens=8192, decode_step_overhead_s=0.010, decode_step_s_per_seq=1.5e-4,
    decode_step_s_per_kv_token=1.5e-8, prefill_s_per_extra_request=1.0e-3)
TOY_B = replace(
    TOY_A, name="toy_b", price_per_chip_hour=1.6, kv_capacity_tokens=2_500_000, cache_capacity_tokens=2_500_000,
    prefill_overhead_s=0.02, prefill_s_per_token=7.0e-5, prefill_s_per_token_ctx=2.0e-9,
    decode_step_overhead_s=0.014, decode_step_s_per_seq=2.2e-4, decode_step_s_per_kv_token=2.2e-8)

WAN_DEFAULT = LinkProfile("wan", gbps=25.0, one_way_latency_s=0.020, jitter_s=0.005,
                          price_per_hour=10.0, price_per_gb=0.0)
RDMA_DEFAULT = LinkProfile("rdma", gbps=400.0, one_way_latency_s=0.000_05)
