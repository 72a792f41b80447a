"""The ``pdd`` transfer backend on CUDA: P + RLD + MD + WAN emulator + router on one GPU machine,
with a small real-architecture model built locally (no downloads), checked against a plain
single server and timed.

What it does (skips with a clear message, exit code 0, when no CUDA device is visible):
1. builds a small model deterministically under --model-dir: ``llama`` (GQA MHA: 4 layers,
   hidden 512, 8 heads / 4 KV heads, bf16) or ``deepseek_v2`` (MLA: kv_lora_rank 128, rope dim
   32, 4 layers), with the tokenizer of scripts/build_tiny_model.py;
2. starts SGLang servers on the GPU (default attention backend, CUDA graphs on, ``--page-size``
   as given, 16 by default), all sharing the one GPU with small ``--mem-fraction-static``;
3. sends the same greedy prompts through the router on P->MD and P->RLD->MD and to the single
   server: output_ids must be equal (exit code 1 otherwise), and prints per path the time to
   first token and total latency, MD's DRC stats and P's WAN fan-out counters.

    .venv/bin/python -m benchmarks.gpu_pdd_backend                       # llama, page size 16
    .venv/bin/python -m benchmarks.gpu_pdd_backend --arch deepseek_v2 --page-size 64

Each server holds its own copy of the model (tiny) and a KV pool of --mem-fraction-static of
the GPU, so four servers fit on one 24+ GB device at the default 0.12.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.common import REPO, load_module, timed_events

PROMPTS = ["def fibonacci(n):", "import collections\n\nclass LRUCache:\n    def __init__(self, capacity):",
           "The quick brown fox jumps over the lazy dog. " * 20, "for i in range(10):\n    print(i)" * 8]
# The CPU launcher's flags that a GPU run must not pass.
_CPU_ONLY = {"--device": 1, "--attention-backend": 1, "--disable-cuda-graph": 0, "--mem-fraction-static": 1,
             "--max-total-tokens": 1, "--page-size": 1}


def cuda_available() -> tuple[bool, str]:
    try:
        import torch
    except ImportError as e:
        return False, f"torch is not installed ({e})"
    if not torch.cuda.is_available():
        return False, "no CUDA device visible (torch.cuda.is_available() is False)"
    return True, torch.cuda.get_device_name(0)


def build_model(out: Path, arch: str) -> str:
    import torch

    tiny = load_module(REPO / "scripts" / "build_tiny_model.py")

    if (out / "config.json").exists():
        return str(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny.build_tokenizer(out)
    torch.manual_seed(tiny.SEED)
    common = dict(vocab_size=tiny.VOCAB_SIZE, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                  num_attention_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, torch_dtype="bfloat16")
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(num_key_value_heads=4, head_dim=64, **common))
    else:
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        model = DeepseekV2ForCausalLM(DeepseekV2Config(
            num_key_value_heads=8, kv_lora_rank=128, q_lora_rank=None, qk_rope_head_dim=32,
            qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            first_k_dense_replace=4,
            moe_intermediate_size=256, **common))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
        model.lm_head.weight[tokenizer.eos_token_id].zero_()  # outputs run to max_new_tokens
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    return str(out)


def gpu_argv(argv: list[str], page_size: int, mem_fraction: float) -> list[str]:
    out, skip = [], 0
    for a in argv:
        if skip:
            skip -= 1
            continue
        if a in _CPU_ONLY:
            skip = _CPU_ONLY[a]
            continue
        out.append(a)
    return out + ["--page-size", str(page_size), "--mem-fraction-static", str(mem_fraction)]


def stream_timed(url: str, body: dict) -> tuple[list[int], float, float]:
    t0 = time.perf_counter()
    first, ids = None, []
    for t, event in timed_events(f"{url}/generate", {**body, "stream": True}):
        first = first or t
        ids = event["output_ids"]
    return ids, (first - t0) * 1000, (time.perf_counter() - t0) * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=("llama", "deepseek_v2"), default="llama")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--mem-fraction-static", type=float, default=0.12)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--model-dir", type=Path, default=None, help="default artifacts/gpu-<arch>")
    ap.add_argument("--out", type=Path, default=Path("artifacts/gpu_pdd_backend"))
    args = ap.parse_args()

    ok, device = cuda_available()
    if not ok:
        print(f"SKIPPED: {device}; this script needs a CUDA GPU (it runs P, RLD and MD on one).")
        return 0
    from sglang_pdd.launcher.http import get_json, post_json
    from sglang_pdd.protocol import STATS
    from sglang_pdd.launcher.processes import ProcessGroup
    from sglang_pdd.launcher.topology import (CPU_ENV, ServerSpec, Topology, free_port, router_argv,
                                              server_argv, wan_emulator_argv, write_wan_key)

    model = build_model(args.model_dir or Path(f"artifacts/gpu-{args.arch}"), args.arch)
    env = {k: v for k, v in CPU_ENV.items() if k != "SGLANG_USE_CPU_ENGINE"}
    topo = Topology.on_free_ports()
    topo.wan.rate_gbps, topo.wan.latency_ms = 10.0, 5.0
    single = ServerSpec("single", None, free_port())
    args.out.mkdir(parents=True, exist_ok=True)
    key = write_wan_key(args.out / "wan.key")
    print(f"device: {device}; model {model} ({args.arch}), page size {args.page_size}")
    failures = 0
    with ProcessGroup(args.out / "logs") as procs:
        for spec in [*topo.servers, single]:
            argv = gpu_argv(server_argv(spec, model, str(key), topo.intra_dc_transport), args.page_size,
                            args.mem_fraction_static)
            procs.start(spec.name, argv, health_url=f"{spec.url}/health", env=env)
        procs.start("wan-emulator", wan_emulator_argv(topo), health_url=f"{topo.wan.control_url}/stats")
        procs.start("router", router_argv(topo, model), health_url=f"{topo.router_url}/health")
        procs.wait_healthy(timeout_s=900)
        sampling = {"max_new_tokens": args.max_new_tokens, "temperature": 0}
        for prompt in PROMPTS:
            want = post_json(f"{single.url}/generate", {"text": prompt, "sampling_params": sampling})["output_ids"]
            for path in ("p_md", "p_rld_md"):
                body = {"text": prompt, "sampling_params": sampling, "pdd_options": {"path": path}}
                ids, ttft, total = stream_timed(topo.router_url, body)
                same = ids == want
                failures += not same
                print(f"{path:9} prompt {len(prompt):4} chars: ttft {ttft:7.1f} ms, total {total:7.1f} ms, "
                      f"output_ids {'equal' if same else 'DIFFER'}")
        print("MD DRC:", json.dumps(get_json(f"{topo.main.control_url}{STATS.path()}")))
        print("P WAN fan-out:", json.dumps(get_json(f"{topo.prefill.control_url}{STATS.path()}")))
    print("PASS" if not failures else f"FAIL: {failures} outputs differ from the single server")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
