"""The simulator's H200 roofline against kernels timed on one H200.

`sglang_pdd.sim.hardware.preset` turns spec-sheet peaks into step times with three assumed
efficiencies (PREFILL_MFU, DECODE_MFU, DECODE_MBU). This benchmark times the same work with
plain PyTorch kernels on the GPU it finds and prints, side by side, the sim's time and the
measured one, per shape:

- **Llama-3-70B decode**, one chip of the preset's TP group (heads, KV heads and FFN split by
  TP; bf16), `--layers` layers timed and scaled to 80: QKV, GQA attention over a dense KV cache
  (SDPA), output projection, SwiGLU FFN. Compared with the preset's step time less its fixed
  overhead (3 ms of scheduler and launch, not a kernel cost). No all-reduce: TP's
  communication is not in either number.
- **DeepSeek-V3 MLA decode attention** as SGLang runs it with DP attention (each rank holds
  its own requests' latent KV and runs all 128 heads on it): absorbed query (576 dims) against
  the latent cache, softmax, sum over the 512-dim latent. Timed for one layer, scaled to 61,
  against the preset's attention terms (compute roof and KV read, whichever is longer).
  Plain `bmm` + `softmax` here materialises the scores; a fused kernel (FlashMLA) is faster,
  so this bounds the sim's assumption from the slow side.
- **Llama-3-70B prefill**, one chip, a pass of `--prefill-tokens` new tokens (causal SDPA):
  achieved TFLOP/s against the assumed PREFILL_MFU.

    python -m benchmarks.bench_gpu_roofline --json out.json     # on a CUDA machine
    python -m benchmarks.bench_gpu_roofline --smoke            # CPU, tiny shapes: runs the code only

Exit code 0 with a message when no CUDA device is visible (unless --smoke).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from sglang_pdd.sim import hardware as hw


@dataclass(frozen=True)
class LlamaShard:
    """One chip's share of a Llama-3-70B layer under tensor parallelism `tp`."""

    hidden: int = 8192
    heads: int = 64
    kv_heads: int = 8
    head_dim: int = 128
    ffn: int = 28672
    tp: int = 2

    @property
    def q_heads(self) -> int:
        return self.heads // self.tp

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.kv_heads // self.tp)

    @property
    def local_ffn(self) -> int:
        return self.ffn // self.tp

    def weight_bytes(self) -> int:
        qkv = self.hidden * (self.q_heads + 2 * self.local_kv_heads) * self.head_dim
        out = self.q_heads * self.head_dim * self.hidden
        mlp = 3 * self.hidden * self.local_ffn
        return 2 * (qkv + out + mlp)

    def kv_bytes_per_token(self) -> int:
        return 2 * self.local_kv_heads * self.head_dim * 2


@dataclass
class Row:
    kind: str
    batch: int
    ctx: int
    measured_ms: float
    sim_ms: float
    detail: str

    @property
    def ratio(self) -> float:
        return self.measured_ms / self.sim_ms if self.sim_ms > 0 else math.nan


def time_ms(fn, device: torch.device, iters: int, warmup: int = 3) -> float:
    """Median wall time of `fn` per call; CUDA events on a GPU."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t) * 1e3)
    samples.sort()
    return samples[len(samples) // 2]


class LlamaLayers:
    """`n` decoder layers of one TP shard with random bf16 weights (values do not change time)."""

    def __init__(self, shard: LlamaShard, n: int, device, dtype):
        s = shard
        g = torch.Generator(device="cpu").manual_seed(0)

        def w(*shape):
            return (torch.randn(*shape, generator=g, dtype=torch.float32) * 0.02).to(device=device, dtype=dtype)

        self.s, self.layers = s, [
            dict(qkv=w(s.hidden, (s.q_heads + 2 * s.local_kv_heads) * s.head_dim),
                 o=w(s.q_heads * s.head_dim, s.hidden),
                 gate_up=w(s.hidden, 2 * s.local_ffn), down=w(s.local_ffn, s.hidden))
            for _ in range(n)]

    def forward(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, causal: bool) -> torch.Tensor:
        """x: (batch, q_len, hidden); caches: (batch, kv_heads, ctx, head_dim), shared by the
        layers (each layer still reads all of it: the KV traffic is per layer)."""
        s = self.s
        b, q_len, _ = x.shape
        for lw in self.layers:
            qkv = x @ lw["qkv"]
            q = qkv[..., : s.q_heads * s.head_dim]
            if causal:
                q = q.view(b, q_len, s.q_heads, s.head_dim).transpose(1, 2)
                attn = F.scaled_dot_product_attention(q, k_cache, v_cache, is_causal=True, enable_gqa=True)
                attn = attn.transpose(1, 2).reshape(b, q_len, -1)
            else:
                # Decode: the query heads sharing a KV head attend as one group (what GQA decode
                # kernels do), so each KV head is read once, not once per query head.
                group = s.q_heads // s.local_kv_heads
                q = q.view(b, s.local_kv_heads, group, s.head_dim)
                attn = F.scaled_dot_product_attention(q, k_cache, v_cache).reshape(b, 1, -1)
            x = x + attn @ lw["o"]
            gate, up = (x @ lw["gate_up"]).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ lw["down"]
        return x


def llama_decode_rows(device, dtype, layers: int, points, iters: int, shard: LlamaShard) -> list[Row]:
    prof = hw.preset(hw.LLAMA3_70B, hw.H200)
    model = LlamaLayers(shard, layers, device, dtype)
    scale = 80 / layers
    rows = []
    for batch, ctx in points:
        k = torch.randn(batch, shard.local_kv_heads, ctx, shard.head_dim, device=device, dtype=dtype)
        v = torch.randn_like(k)
        x = torch.randn(batch, 1, shard.hidden, device=device, dtype=dtype)
        with torch.no_grad():
            ms = time_ms(lambda: model.forward(x, k, v, causal=False), device, iters) * scale
        sim_ms = (prof.decode_step_s(batch, batch * ctx) - prof.decode_step_overhead_s) * 1e3
        read = 80 * (shard.weight_bytes() + batch * ctx * shard.kv_bytes_per_token())
        achieved_tb_s = read / (ms * 1e-3) / 1e12
        rows.append(Row("llama3-70b decode", batch, ctx, ms, sim_ms,
                        f"{achieved_tb_s:.2f} TB/s = {achieved_tb_s / hw.H200.hbm_tb_s:.2f} of peak "
                        f"(sim assumes {hw.DECODE_MBU})"))
        del k, v, x
    return rows


def mla_decode_rows(device, dtype, points, iters: int, heads: int = 128) -> list[Row]:
    prof = hw.preset(hw.DEEPSEEK_V3, hw.H200)
    n = prof.chips_per_instance
    rows = []
    for batch, ctx in points:
        latent = torch.randn(batch, ctx, 576, device=device, dtype=dtype)
        q = torch.randn(batch, heads, 576, device=device, dtype=dtype)

        value = latent[..., :512].contiguous()  # a fused kernel reads it inside the latent

        def unfused():
            scores = torch.bmm(q, latent.transpose(1, 2)) * (1.0 / math.sqrt(192))
            return torch.bmm(torch.softmax(scores.float(), dim=-1).to(dtype), value)

        def fused():
            # All heads share the one latent "KV head": the 128 heads become the query length.
            return F.scaled_dot_product_attention(q.unsqueeze(1), latent.unsqueeze(1), value.unsqueeze(1),
                                                  scale=1.0 / math.sqrt(192))

        with torch.no_grad():
            timings = {"bmm+softmax": time_ms(unfused, device, iters) * 61}
            try:
                timings["sdpa"] = time_ms(fused, device, iters) * 61
            except RuntimeError as e:  # no SDPA kernel for these head sizes on this build
                print(f"sdpa MLA variant unavailable: {str(e)[:120]}")
        kernel, ms = min(timings.items(), key=lambda kv: kv[1])
        kv = batch * ctx
        # The preset's attention terms for one DP rank holding these requests: the instance's
        # figures are for n chips sharing the batch, so one chip is n times slower per token.
        compute_s = kv * prof.decode_attn_s_per_kv_token * n
        memory_s = kv * prof.decode_step_s_per_kv_token * n
        sim_ms = max(compute_s, memory_s) * 1e3
        flops = 61 * kv * 2 * heads * (576 + 512)
        achieved = flops / (ms * 1e-3) / 1e12
        rows.append(Row("deepseek-v3 MLA attention (1 DP rank)", batch, ctx, ms, sim_ms,
                        f"{kernel} (of {', '.join(f'{k} {v:.1f} ms' for k, v in timings.items())}): "
                        f"{achieved:.0f} TFLOP/s = {achieved / hw.H200.bf16_tflops:.2f} of bf16 peak "
                        f"(sim assumes {hw.DECODE_MFU}); sim bound: "
                        f"{'compute' if compute_s >= memory_s else 'memory'}"))
        del latent, q, value
    return rows


def llama_prefill_rows(device, dtype, layers: int, tokens: int, iters: int, shard: LlamaShard) -> list[Row]:
    prof = hw.preset(hw.LLAMA3_70B, hw.H200)
    model = LlamaLayers(shard, layers, device, dtype)
    x = torch.randn(1, tokens, shard.hidden, device=device, dtype=dtype)
    with torch.no_grad():
        def step():
            qkv_k = torch.empty(1, shard.local_kv_heads, tokens, shard.head_dim, device=device, dtype=dtype)
            return model.forward(x, qkv_k, qkv_k, causal=True)

        ms = time_ms(step, device, iters) * 80 / layers
    sim_ms = (prof.prefill_time_s(tokens, 0) - prof.prefill_overhead_s) * 1e3
    n = prof.chips_per_instance
    flops = (2 * hw.LLAMA3_70B.active_params_b * 1e9 * tokens
             + tokens * (tokens / 2) * hw.LLAMA3_70B.attn_flops_per_token_ctx) / n
    achieved = flops / (ms * 1e-3) / 1e12
    return [Row("llama3-70b prefill", 1, tokens, ms, sim_ms,
                f"{achieved:.0f} TFLOP/s = {achieved / hw.H200.bf16_tflops:.2f} of bf16 peak "
                f"(sim assumes {hw.PREFILL_MFU})")]


def print_rows(rows: list[Row]) -> None:
    print(f"{'kind':40s} {'batch':>5s} {'ctx':>6s} {'measured ms':>12s} {'sim ms':>9s} {'meas/sim':>8s}  detail")
    for r in rows:
        print(f"{r.kind:40s} {r.batch:5d} {r.ctx:6d} {r.measured_ms:12.2f} {r.sim_ms:9.2f} {r.ratio:8.2f}  {r.detail}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: checks the code runs")
    ap.add_argument("--layers", type=int, default=10, help="decoder layers timed (scaled to 80)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--prefill-tokens", type=int, default=8192)
    ap.add_argument("--parts", nargs="+", default=["llama", "mla", "prefill"], choices=["llama", "mla", "prefill"])
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)

    if args.smoke:
        device, dtype = torch.device("cpu"), torch.float32
        llama_points, mla_points, layers, tokens, iters = [(1, 16), (2, 32)], [(1, 64)], 1, 32, 2
        shard = LlamaShard(hidden=64, heads=8, kv_heads=2, head_dim=8, ffn=128)
    elif not torch.cuda.is_available():
        print("no CUDA device visible: nothing to time (use --smoke to run the code on CPU)")
        return 0
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
        llama_points = [(1, 1024), (16, 4096), (64, 4096), (64, 16384), (128, 8192), (256, 4096)]
        mla_points = [(16, 8192), (32, 32768), (64, 16384), (64, 65536)]
        layers, tokens, iters = args.layers, args.prefill_tokens, args.iters
        shard = LlamaShard(tp=hw.preset(hw.LLAMA3_70B, hw.H200).chips_per_instance)

    rows = []
    if "llama" in args.parts:
        rows += llama_decode_rows(device, dtype, layers, llama_points, iters, shard)
    if "mla" in args.parts:
        rows += mla_decode_rows(device, dtype, mla_points, iters, heads=8 if args.smoke else 128)
    if "prefill" in args.parts:
        rows += llama_prefill_rows(device, dtype, layers, tokens, iters, shard)
    print_rows(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(asdict(r), ratio=r.ratio) for r in rows], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
