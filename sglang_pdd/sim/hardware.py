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
import re
import warnings
from dataclasses import asdict, dataclass, fields, replace
from typing import Iterable, List, Optional, Sequence


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
    # Host (DRAM) tier behind the prefix cache, as SGLang's HiCache: blocks evicted from HBM
    # stay here; a hit here is loaded back to HBM at `host_load_s_per_token`. 0: no tier.
    host_cache_tokens: int = 0
    host_load_s_per_token: float = 0.0
    # KV read per sequence per step whatever its length (memory side of the roofline): a
    # sparse model's top-k compressed entries and sliding window. 0 for dense attention.
    decode_read_s_per_seq: float = 0.0

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
                self.decode_weights_s + kv_tokens * self.decode_step_s_per_kv_token
                + batch * self.decode_read_s_per_seq)
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
        """A hand-given or measured profile; warns (ProfileWarning) if it looks implausible.
        A calibration file's own samples (`_samples`, benchmarks/calibrate_profile.py) are
        checked against it too."""
        with open(path) as f:
            d = json.load(f)
        prof = cls.from_dict(d)
        samples = d.get("_samples") or {}
        check_profile(prof, samples.get("decode", ()), samples.get("prefill", ()), source=path)
        return prof


@dataclass(frozen=True)
class LinkProfile:
    """A network link. The WAN is shared by all transfers in flight (fair sharing, like
    long TCP flows); the same-DC RDMA fabric is modelled as uncontended."""

    name: str
    gbps: float  # math.inf = instantaneous
    one_way_latency_s: float
    jitter_s: float = 0.0  # extra latency, uniform in [0, jitter_s], per transfer
    price_per_hour: float = 0.0  # leased capacity, flat
    price_per_gb: float = 0.0  # egress
    price_per_gbps_hour: float = 0.0  # leased capacity, per Gbps of the link's rate

    @property
    def lease_per_hour(self) -> float:
        """What the link costs an hour whether it carries anything or not."""
        return self.price_per_hour + (0.0 if math.isinf(self.gbps) else self.gbps * self.price_per_gbps_hour)

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
    # Fused MLA decode attention (FlashMLA), fraction of the bf16 peak it reaches when compute
    # bound; sources beside each chip below.
    mla_decode_attn_eff: float = 0.67


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
    # MLA: decode attention runs FlashMLA (per-chip efficiency) on a KV cache each DP rank
    # holds for its own requests (SGLang's DP attention), so one request's KV is on one chip.
    mla: bool = False
    # Sparse attention (DeepSeek-V4): work per token that does not grow with the context.
    # KV a request holds whatever its length (sliding window, compression state), bytes:
    kv_bytes_per_request: int = 0
    # attention FLOPs per new token over its bounded set (top-k entries + window), prefill and decode:
    attn_flops_per_token_bounded: float = 0.0
    # KV bytes one decode step reads per sequence from that bounded set:
    decode_read_bytes_per_seq: float = 0.0


# Chip figures: vendor datasheets, dense (no sparsity) tensor-core peaks.
# MLA decode efficiency: deepseek-ai/FlashMLA README: dense MLA decoding reaches 660 TFLOPS
# compute bound on H800 SXM5 (0.67 of 989, the H100/H200 tensor cores) and 3000 GB/s memory
# bound (0.90 of 3.35 TB/s); FlashMLA issue #30: 120-130 TFLOPS on H20 (0.81-0.88 of 148; b=128,
# 8k context); issue #19: ~2.8 TB/s on H100 SXM (0.84 of 3.35 TB/s).
# H100 SXM5: NVIDIA H100 Tensor Core GPU datasheet: 80 GB HBM3, 3.35 TB/s, BF16 989 / FP8 1979 TFLOPS.
H100 = Chip("h100", hbm_gb=80, hbm_tb_s=3.35, bf16_tflops=989, fp8_tflops=1979, price_per_chip_hour=3.00,
            mla_decode_attn_eff=0.67)
# H200 SXM: NVIDIA H200 datasheet: 141 GB HBM3e, 4.8 TB/s, same tensor cores as H100 SXM5.
H200 = Chip("h200", hbm_gb=141, hbm_tb_s=4.8, bf16_tflops=989, fp8_tflops=1979, price_per_chip_hour=3.75,
            mla_decode_attn_eff=0.67)
# H20: NVIDIA HGX H20 spec as publicly reported (2024): 96 GB HBM3, 4.0 TB/s, BF16 148 / FP8 296 TFLOPS.
H20 = Chip("h20", hbm_gb=96, hbm_tb_s=4.0, bf16_tflops=148, fp8_tflops=296, price_per_chip_hour=1.30,
           mla_decode_attn_eff=0.84)
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
                         decode_attn_flops_per_token_ctx=2 * 61 * 128 * (576 + 512), mla=True)

# DeepSeek-V4-Pro. Architecture: the DeepSeek-V4 technical report as summarised publicly (61
# layers, hidden 7168, 128 query heads, head dim 512 of which 64 RoPE, one shared KV head
# (MQA); the first two layers HCA, then CSA and HCA alternate; CSA compresses 4 tokens into one
# entry and attends the top-k 1024 entries its lightning indexer (64 heads x 128 dims) picks;
# HCA compresses 128 tokens into one entry and attends all of them; every layer adds a 128-token
# sliding window; 384 routed experts of intermediate 3072; 1.6T parameters, 49B activated).
# So 30 CSA and 31 HCA layers. KV as SGLang 0.5.23 stores it (mem_cache/deepseek_v4_memory_pool
# .py's DeepSeekV4TokenToKVPool, sized by model_executor/pool_configurator.py):
# - one compressed entry = FlashMLA's V4 layout, 448 fp8 NoPE + 64 bf16 RoPE + 8 scale bytes
#   = 584 B (pool_configurator: qk_nope_head_dim + qk_rope_head_dim * 2 + 8);
# - CSA's indexer key per entry, fp4: 128 / 2 + 128 / 32 = 68 B (get_dsv4_indexer_bytes_per_token,
#   the low-ratio indexer pools are built fp4);
# - per request, whatever its length: the 128-token window of every layer (584 B a slot) and
#   the compression state rings, fp32 kv + score (deepseek_v4_compress_state.py): ratio 4
#   rings of 8 rows x 2 x 2 x 512 (plus the indexer's compressor, x 128 dims), ratio 128 rings
#   of 128 rows x 2 x 512.
V4_LAYERS, V4_CSA_LAYERS, V4_HCA_LAYERS = 61, 30, 31
V4_ENTRY_B, V4_INDEXER_B, V4_WINDOW = 584, 68, 128
V4_CSA_RATIO, V4_HCA_RATIO, V4_TOPK = 4, 128, 1024
V4_HEADS, V4_HEAD_DIM = 128, 512
V4_INDEX_HEADS, V4_INDEX_DIM = 64, 128
V4_KV_BYTES_PER_TOKEN = round(V4_CSA_LAYERS * (V4_ENTRY_B + V4_INDEXER_B) / V4_CSA_RATIO
                              + V4_HCA_LAYERS * V4_ENTRY_B / V4_HCA_RATIO)  # 5,031 B
V4_STATE_BYTES = (V4_CSA_LAYERS * 8 * 2 * 2 * (V4_HEAD_DIM + V4_INDEX_DIM) * 4
                  + V4_HCA_LAYERS * 128 * 2 * V4_HEAD_DIM * 4)
V4_KV_BYTES_PER_REQUEST = V4_LAYERS * V4_WINDOW * V4_ENTRY_B + V4_STATE_BYTES  # ~21.7 MB
# Attention FLOPs: every query head scores and sums a 512-dim entry, 2 * 128 * (512 + 512) a
# (token, entry); CSA's entries per token are bounded (top-k + window), HCA's and the
# indexer's grow with the context (one per 128 / per 4 tokens).
_V4_PER_ENTRY = 2 * V4_HEADS * (V4_HEAD_DIM + V4_HEAD_DIM)
_V4_BOUNDED_ENTRIES = V4_CSA_LAYERS * (V4_TOPK + V4_WINDOW) + V4_HCA_LAYERS * V4_WINDOW
_V4_FLOPS_PER_CTX = (V4_HCA_LAYERS * _V4_PER_ENTRY / V4_HCA_RATIO
                     + V4_CSA_LAYERS * 2 * V4_INDEX_HEADS * V4_INDEX_DIM / V4_CSA_RATIO)
# Weights as served: routed experts (3 x 7168 x 3072 each, 384 x 61 of them, ~1.55T) in mxfp4
# (0.5 B + one e8m0 scale per 32 values), the rest (~50B) fp8: ~870 GB. Hopper has no fp4
# tensor cores: the matmuls run fp8 (weights dequantised in the kernel).
_V4_EXPERT_PARAMS = 384 * V4_LAYERS * 3 * 7168 * 3072
DEEPSEEK_V4_PRO = ModelClass("deepseek-v4-pro", active_params_b=49.0,
                             weight_bytes_gb=(_V4_EXPERT_PARAMS * (0.5 + 1 / 32) + 50e9) / 1e9,
                             kv_bytes_per_token=V4_KV_BYTES_PER_TOKEN,
                             attn_flops_per_token_ctx=_V4_FLOPS_PER_CTX, fp8_compute=True,
                             decode_attn_flops_per_token_ctx=_V4_FLOPS_PER_CTX, mla=True,
                             kv_bytes_per_request=V4_KV_BYTES_PER_REQUEST,
                             attn_flops_per_token_bounded=_V4_BOUNDED_ENTRIES * _V4_PER_ENTRY,
                             decode_read_bytes_per_seq=_V4_BOUNDED_ENTRIES * V4_ENTRY_B)
MODELS = {m.name: m for m in (LLAMA3_70B, DEEPSEEK_V3, DEEPSEEK_V4_PRO)}

# KV dtypes of DeepSeek-V3 (--kv-dtype). bf16: the latent and RoPE dims as computed (576 x 2 B
# a layer). fp8: FlashMLA's fp8 KV format, what SGLang's fp8 MLA pools store and FlashMLA
# decodes: 512 fp8 NoPE + 4 fp32 scales + 64 bf16 RoPE = 656 B a layer (deepseek-ai/FlashMLA
# README; SGLang 0.5.23 layers/attention/dsa_backend.py: "an fp8 pool (656 B/token)"), 40,016 B
# a token, near the report's 4,649 KB per 100 tokens. Decode attention still computes in bf16
# (FlashMLA dequantises), so only the bytes change: pools, the host tier, the KV read, the WAN.
KV_DTYPES = ("bf16", "fp8")
_KV_BYTES_PER_LAYER = {"bf16": (512 + 64) * 2, "fp8": 512 + 4 * 4 + 64 * 2}
_KV_DTYPE_SUFFIX = "-fp8kv"


def with_kv_dtype(model: "ModelClass | str", kv_dtype: str = "bf16") -> ModelClass:
    """The model with its KV stored in `kv_dtype`; bf16 is every model's own. Only the
    MLA model has an fp8 layout here (DeepSeek-V4's own is fp8 already)."""
    m = MODELS[model] if isinstance(model, str) else model
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    if kv_dtype == "bf16":
        return m
    if m.name != DEEPSEEK_V3.name:
        raise ValueError(f"--kv-dtype fp8 is modelled for {DEEPSEEK_V3.name} only, not {m.name}")
    return replace(m, name=m.name + _KV_DTYPE_SUFFIX, kv_bytes_per_token=_KV_BYTES_PER_LAYER["fp8"] * 61)


def request_kv_bytes(model: "ModelClass | str", context_tokens: int) -> int:
    """KV one request of `context_tokens` holds: its per-token entries and, for sparse
    attention, the window and compression state it holds whatever its length."""
    m = MODELS[model] if isinstance(model, str) else model
    return context_tokens * m.kv_bytes_per_token + m.kv_bytes_per_request

# Estimated efficiencies (fractions of peak); docs/sim-notebook.md has the H200 kernel check.
PREFILL_MFU = 0.40
DECODE_MFU = 0.50  # decode matmuls, and GQA decode attention
DECODE_MBU = 0.70  # weight read, and the GQA KV read
MLA_KV_MBU = 0.84  # FlashMLA's KV read (issue #19, H100; the README's H800 figure is 0.90)
# MLA decode attention on generic kernels (PyTorch bmm + softmax), timed on one H200 by
# benchmarks/bench_gpu_roofline.py: 0.13-0.17 of the bf16 peak. A named sensitivity
# (`mla_kernel="generic"`, the CLI's --mla-kernel generic), not the default.
MLA_GENERIC_ATTN_EFF = 0.15
MLA_KERNELS = ("flashmla", "generic")
USABLE_HBM = 0.90  # the rest: activations, CUDA graphs, fragmentation
STEP_OVERHEAD_S = 0.003  # scheduler + launch per decode step, beyond the weight read
# Host tier (SGLang HiCache): the host pool is --hicache-ratio times the device KV pool, 2.0 by
# default (sglang 0.5.23, mem_cache/kv_cache_builder.py: "the standard HiCache default"),
# capped by the host memory a chip's share of its node has (estimate: 2 TB of DRAM per 8-GPU
# node, 80% of it for KV). Loading back crosses PCIe Gen5 x16 (64 GB/s a direction; ~50 GB/s
# achieved is an estimate) on every chip holding a shard of the request's KV: all of the TP
# group for GQA, one DP rank for MLA.
HICACHE_RATIO = 2.0
HOST_KV_GB_PER_CHIP = 2000 * 0.8 / 8
HOST_LOAD_GB_S_PER_CHIP = 50.0


# KV room an instance needs at least, in requests of a long context: with a quarter of the
# weights a dense-KV model holds far fewer than this; a sparse one (DeepSeek-V4-Pro: ~0.35 GB
# a 64K request) holds it in much less, so it need not double its chips for KV it cannot use.
ROOM_REQUESTS, ROOM_CONTEXT = 256, 65_536


def instance_chips(model: ModelClass, chip: Chip) -> int:
    """Smallest power-of-two TP group whose memory holds the weights with room for KV: 25% of
    the weights, or ROOM_REQUESTS requests of ROOM_CONTEXT tokens when that is less."""
    room = min(model.weight_bytes_gb * 0.25, ROOM_REQUESTS * request_kv_bytes(model, ROOM_CONTEXT) / 1e9)
    n = 1
    while n * chip.hbm_gb * USABLE_HBM < model.weight_bytes_gb + room:
        n *= 2
    return n


def smallest_group(model: "ModelClass | str", chip: "Chip | str") -> int:
    """The fewest chips of a TP group SGLang can run that hold the weights with some room
    for KV (10% of the weights): a power of two (tensor parallelism splits heads and, for
    DeepSeek-V3, 256 experts evenly). What an RLD, which holds few requests, needs at least."""
    m = MODELS[model] if isinstance(model, str) else model
    c = CHIPS[chip] if isinstance(chip, str) else chip
    n = 1
    while n * c.hbm_gb * USABLE_HBM < m.weight_bytes_gb * 1.1:
        n *= 2
    return n


def mla_attn_eff(chip: "Chip", mla_kernel: str = "flashmla") -> float:
    if mla_kernel not in MLA_KERNELS:
        raise ValueError(f"mla_kernel must be one of {MLA_KERNELS}, got {mla_kernel!r}")
    return chip.mla_decode_attn_eff if mla_kernel == "flashmla" else MLA_GENERIC_ATTN_EFF


def preset(model: "ModelClass | str", chip: "Chip | str", chips: int = 0, mla_kernel: str = "flashmla",
           host_cache: bool = True, kv_dtype: str = "bf16") -> HardwareProfile:
    """A HardwareProfile derived from the model's size and the chip's spec sheet. mla_kernel:
    "flashmla" (the published efficiency, the default) or "generic" (the sensitivity);
    kv_dtype: see with_kv_dtype. `chips` may be any count (an RLD slice, priced pro rata by
    chip) as long as the weights fit it with room for KV."""
    m = with_kv_dtype(model, kv_dtype)
    c = CHIPS[chip] if isinstance(chip, str) else chip
    n = chips or instance_chips(m, c)
    flops = 2.0 * m.active_params_b * 1e9
    peak = (c.fp8_tflops if m.fp8_compute else c.bf16_tflops) * 1e12 * n
    bw = c.hbm_tb_s * 1e12 * n * DECODE_MBU
    free_bytes = n * c.hbm_gb * 1e9 * USABLE_HBM - m.weight_bytes_gb * 1e9
    if free_bytes < 0.1 * m.weight_bytes_gb * 1e9:  # no room for a useful KV pool
        raise ValueError(f"{m.name} does not fit {n} x {c.name} with room for KV")
    # SGLang sizes a sparse model's window and compression state for every request slot up
    # front (DeepSeekV4TokenToKVPool: per req_pool_idx), so they come off the token pool.
    free_bytes -= 512 * m.kv_bytes_per_request
    kv_tokens = int(free_bytes / m.kv_bytes_per_token)
    if m.mla:
        attn_eff, kv_bw = mla_attn_eff(c, mla_kernel), c.hbm_tb_s * 1e12 * n * MLA_KV_MBU
    else:
        attn_eff, kv_bw = DECODE_MFU, bw
    host_tokens = 0
    if host_cache:
        host_bytes = min(HICACHE_RATIO * kv_tokens * m.kv_bytes_per_token, n * HOST_KV_GB_PER_CHIP * 1e9)
        host_tokens = int(host_bytes / m.kv_bytes_per_token)
    load_chips = 1 if m.mla else n
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
        prefill_s_per_token=(flops / peak + m.attn_flops_per_token_bounded / (c.bf16_tflops * 1e12 * n))
        / PREFILL_MFU,
        prefill_s_per_token_ctx=m.attn_flops_per_token_ctx / (c.bf16_tflops * 1e12 * n * PREFILL_MFU),
        prefill_chunk_tokens=8192,
        decode_step_overhead_s=STEP_OVERHEAD_S,
        decode_step_s_per_seq=(flops / (peak * DECODE_MFU)
                               + m.attn_flops_per_token_bounded / (c.bf16_tflops * 1e12 * n * attn_eff)),
        decode_step_s_per_kv_token=m.kv_bytes_per_token / kv_bw,
        prefill_s_per_extra_request=1.0e-3,
        decode_roofline=True,
        decode_weights_s=m.weight_bytes_gb * 1e9 / bw,
        decode_attn_s_per_kv_token=m.decode_attn_flops_per_token_ctx / (c.bf16_tflops * 1e12 * n * attn_eff),
        host_cache_tokens=host_tokens,
        host_load_s_per_token=m.kv_bytes_per_token / (load_chips * HOST_LOAD_GB_S_PER_CHIP * 1e9),
        decode_read_s_per_seq=m.decode_read_bytes_per_seq / kv_bw,
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

# A leased WAN wave costs by its rate. Estimate: ~$15k a month for 100 Gbps between two
# regions, i.e. ~$0.2 per Gbps-hour; replace with your quote (--wan-price-per-gbps-hour).
WAN_PRICE_PER_GBPS_HOUR = 0.2
WAN_DEFAULT = LinkProfile("wan", gbps=25.0, one_way_latency_s=0.020, jitter_s=0.005,
                          price_per_gbps_hour=WAN_PRICE_PER_GBPS_HOUR)
RDMA_DEFAULT = LinkProfile("rdma", gbps=400.0, one_way_latency_s=0.000_05)


# ---- plausibility of a measured or hand-given profile ------------------------------------
# The sim trusts its profile completely: a cold server or one noisy decode sample once made
# the calibration's TPOT +1,300-4,100% off (docs/sim-notebook.md, "calibration against the e2e
# cluster") without a word. These checks say so. Thresholds are loose on purpose: every
# preset passes with a wide margin, the failures seen were off by 10x or more.
REF_CTX = 1024  # context per sequence at which the per-token comparisons are made
# One more sequence in a step vs one more prefill token: <= 0.4x on the presets, ~40x for the
# tiny model on a CPU (Python work per sequence), ~2,400x for the noisy fit the calibration got.
MAX_DECODE_VS_PREFILL_TOKEN = 100.0
MAX_STEP_VS_SHORT_PREFILL = 5.0  # a one-sequence step vs a 256-token prefill pass
ROOFLINE_BAND = (0.5, 4.0)  # a named preset's step time, as a fraction of its roofline's
MAX_SAMPLE_SPREAD = 3.0  # repeated measurements of the same shape, slowest / fastest
MAX_SAMPLE_MISFIT = 2.0  # a sample vs what the profile predicts for it, either way


class ProfileWarning(UserWarning):
    """A hardware profile whose numbers look implausible (see profile_problems)."""


_PRESET_NAME = re.compile(r"^([\w.-]+)@(\d+)x([\w.-]+)$")


def reference_preset(name: str) -> Optional[HardwareProfile]:
    """The spec-sheet preset a profile's name ("model@Nxchip") refers to, if any."""
    m = _PRESET_NAME.match(name)
    if not m:
        return None
    model, kv_dtype = m.group(1), "bf16"
    if model.endswith(_KV_DTYPE_SUFFIX):
        model, kv_dtype = model[: -len(_KV_DTYPE_SUFFIX)], "fp8"
    if model not in MODELS or m.group(3) not in CHIPS:
        return None
    try:
        return preset(model, m.group(3), int(m.group(2)), kv_dtype=kv_dtype)
    except ValueError:
        return None


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g} ms"


def profile_problems(hw: HardwareProfile, decode_samples: Iterable[Sequence[float]] = (),
                     prefill_samples: Iterable[Sequence[float]] = (),
                     reference: Optional[HardwareProfile] = None) -> List[str]:
    """What looks wrong with `hw`, one sentence each (empty: nothing found).

    decode_samples: measured (batch, kv_tokens, step_s); prefill_samples: (new_tokens,
    ctx_tokens, seconds), repeats of one shape allowed (benchmarks/calibrate_profile.py's
    format). reference: the roofline to compare with; default: the preset the name names.
    """
    out: List[str] = []
    coeffs = ("prefill_overhead_s", "prefill_s_per_token", "prefill_s_per_token_ctx", "decode_step_overhead_s",
              "decode_step_s_per_seq", "decode_step_s_per_kv_token", "decode_weights_s", "decode_attn_s_per_kv_token")
    for c in coeffs:
        if getattr(hw, c) < 0:
            out.append(f"{c} is negative ({getattr(hw, c):.3g}): time cannot fall as work grows; a fit to "
                       f"noisy or too few samples")
    steps = [(b, hw.decode_step_s(b, b * REF_CTX)) for b in _batches(hw.max_running_requests)]
    if steps[0][1] <= 0:
        out.append(f"a decode step of one sequence takes {_ms(steps[0][1])}")
    for (b1, s1), (b2, s2) in zip(steps, steps[1:]):
        if s2 < s1 * (1 - 1e-9):
            out.append(f"decode step falls with batch: {_ms(s1)} at {b1} x {REF_CTX} tokens, {_ms(s2)} at {b2}")
            break
    pre_tok = hw.prefill_s_per_token + (REF_CTX + 0.5) * hw.prefill_s_per_token_ctx
    dec_tok = hw.decode_step_s(2, 2 * REF_CTX) - hw.decode_step_s(1, REF_CTX)
    if pre_tok > 0 and dec_tok > MAX_DECODE_VS_PREFILL_TOKEN * pre_tok:
        out.append(f"one more sequence in a decode step costs {_ms(dec_tok)}, {dec_tok / pre_tok:.0f}x a prefill "
                   f"token ({_ms(pre_tok)}) at {REF_CTX} tokens of context: both run the same matmuls for "
                   f"one token; noisy decode samples, or a fit that put the step on the KV term")
    # Both read every weight once; the presets' prefill leaves that read out, so a big MoE's
    # step is up to 2.2x such a pass (deepseek-v3@8xh200), a cold server's 6x and more.
    short_pass = hw.prefill_time_s(256, REF_CTX)
    one_step = hw.decode_step_s(1, REF_CTX)
    if short_pass > 0 and one_step > MAX_STEP_VS_SHORT_PREFILL * short_pass:
        out.append(f"a one-sequence decode step ({_ms(one_step)}) is {one_step / short_pass:.0f}x a 256-token "
                   f"prefill pass ({_ms(short_pass)}), which reads the same weights: a cold server "
                   f"(first kernels at each shape) or a loaded host in the decode samples")
    ref = reference if reference is not None else reference_preset(hw.name)
    if ref is not None:
        lo, hi = ROOFLINE_BAND
        for b, ctx in ((1, REF_CTX), (16, 4096), (128, 4096)):
            got, want = hw.decode_step_s(b, b * ctx), ref.decode_step_s(b, b * ctx)
            if want > 0 and not lo <= got / want <= hi:
                out.append(f"decode step at batch {b} x {ctx} tokens is {_ms(got)}, {got / want:.2g}x the "
                           f"{ref.name} roofline's {_ms(want)} (plausible: {lo}-{hi}x)")
                break
        got, want = hw.prefill_time_s(4096, 0), ref.prefill_time_s(4096, 0)
        if want > 0 and not lo <= got / want <= hi:
            out.append(f"a 4096-token prefill takes {_ms(got)}, {got / want:.2g}x the {ref.name} estimate's "
                       f"{_ms(want)} (plausible: {lo}-{hi}x)")
    out += _sample_problems("decode", [(int(b), kv, t) for b, kv, t in decode_samples],
                            lambda b, kv: hw.decode_step_s(b, int(kv)), "batch")
    out += _sample_problems("prefill", [(int(n), ctx, t) for n, ctx, t in prefill_samples],
                            lambda n, ctx: hw.prefill_time_s(n, int(ctx)), "tokens")
    if decode_samples:
        best = {}
        for b, kv, t in decode_samples:
            if b not in best or t < best[b][1]:
                best[b] = (kv, t)
        shapes = sorted(best.items())
        for (b1, (kv1, t1)), (b2, (kv2, t2)) in zip(shapes, shapes[1:]):
            # A step is linear in batch and KV at most: twice the work, at most twice the time.
            grow = max(1.0, b2 / b1, kv2 / kv1 if kv1 > 0 else 1.0)
            if t2 > 1.5 * grow * t1:
                out.append(f"decode samples jump {t2 / t1:.0f}x from batch {b1} ({_ms(t1)}) to {b2} ({_ms(t2)}) "
                           f"for {grow:.2g}x the work: a noisy sample")
            elif t1 > 1.5 * t2:
                out.append(f"decode samples fall with batch: {_ms(t1)} at batch {b1}, {_ms(t2)} at {b2}: a "
                           f"noisy sample")
    return out


def _batches(max_running: int) -> List[int]:
    out, b = [], 1
    while b < max_running:
        out.append(b)
        b *= 2
    return out + [max(1, max_running)]


def _sample_problems(kind: str, samples, predict, unit: str) -> List[str]:
    out: List[str] = []
    by_shape: dict = {}
    for n, x, t in samples:
        by_shape.setdefault((n, x), []).append(t)
    for (n, x), ts in sorted(by_shape.items()):
        lo, hi = min(ts), max(ts)
        if lo > 0 and hi / lo > MAX_SAMPLE_SPREAD:
            out.append(f"{kind} samples at {unit} {n} spread {hi / lo:.0f}x ({_ms(lo)} - {_ms(hi)}): a cold "
                       f"server or a loaded host; the fastest is the closest to the hardware")
    for (n, x), ts in sorted(by_shape.items()):
        want, got = predict(n, x), min(ts)
        if want > 0 and got > 0 and not 1 / MAX_SAMPLE_MISFIT <= got / want <= MAX_SAMPLE_MISFIT:
            out.append(f"{kind} sample at {unit} {n} ({_ms(got)}) is {got / want:.2g}x what the profile "
                       f"predicts ({_ms(want)}): the fit does not describe its samples")
    return out


def check_profile(hw: HardwareProfile, decode_samples: Iterable[Sequence[float]] = (),
                  prefill_samples: Iterable[Sequence[float]] = (), reference: Optional[HardwareProfile] = None,
                  source: str = "") -> List[str]:
    """profile_problems, each also issued as a ProfileWarning; returns them."""
    problems = profile_problems(hw, list(decode_samples), list(prefill_samples), reference)
    for p in problems:
        warnings.warn(f"hardware profile {hw.name!r}{f' ({source})' if source else ''}: {p}", ProfileWarning,
                      stacklevel=2)
    return problems
