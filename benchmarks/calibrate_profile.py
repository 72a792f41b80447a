"""Measure a hardware profile for the simulator from running SGLang servers over HTTP.

    python -m benchmarks.calibrate_profile --prefill-url http://p:30000 --decode-url http://d:30001 \
        --name h200x8 --chips 8 --price-per-chip-hour 3.5 --out profiles/h200x8.json

Prefill: single requests with max_new_tokens=1 and random (uncacheable) prompts of several
lengths -> fit  t = overhead + n * s_per_token + n^2/2 * s_per_token_ctx.
Decode: B concurrent requests decoding T tokens vs 1 token -> per-step time at (B, kv);
fit  step = overhead + B * s_per_seq + kv * s_per_kv_token.
KV bytes per token and the vocabulary come from the served model's config.json (the
model_path the server reports, or --model-config; SGLang's HTTP API reports neither), and
memory from the server's max_total_num_tokens. Prompt ids stay inside the vocabulary. The fits are pure functions (unit-tested);
the HTTP part is deliberately small.
"""

from __future__ import annotations

import argparse
import json
import random
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from sglang_pdd.sim.hardware import CHIP_A, HardwareProfile

# ---- pure parts ------------------------------------------------------------------------


def fit_prefill(samples: Sequence[Tuple[int, int, float]]) -> Tuple[float, float, float]:
    """(new_tokens, ctx_tokens, seconds) -> (overhead_s, s_per_token, s_per_token_ctx),
    non-negative least squares by clipping (three coefficients, well conditioned)."""
    a = np.array([[1.0, n, n * (c + n / 2.0)] for n, c, _ in samples])
    y = np.array([t for _, _, t in samples])
    return _nonneg_lstsq(a, y)


def fit_decode_step(samples: Sequence[Tuple[int, int, float]]) -> Tuple[float, float, float]:
    """(batch, kv_tokens, step_seconds) -> (overhead_s, s_per_seq, s_per_kv_token)."""
    a = np.array([[1.0, b, kv] for b, kv, _ in samples])
    y = np.array([t for _, _, t in samples])
    return _nonneg_lstsq(a, y)


def _nonneg_lstsq(a: np.ndarray, y: np.ndarray) -> Tuple[float, ...]:
    if len(y) < a.shape[1]:
        raise ValueError(f"need at least {a.shape[1]} samples, got {len(y)}")
    active = list(range(a.shape[1]))
    while True:  # drop coefficients that come out negative (physically meaningless) and refit
        coef, *_ = np.linalg.lstsq(a[:, active], y, rcond=None)
        if (coef >= 0).all():
            break
        active.pop(int(np.argmin(coef)))
    out = [0.0] * a.shape[1]
    for i, c in zip(active, coef):
        out[i] = float(c)
    return tuple(out)


def step_time_from_runs(t_one_token_s: float, t_many_s: float, tokens: int) -> float:
    """Per decode step from a 1-token run and a `tokens`-token run of the same batch."""
    if tokens < 2:
        raise ValueError("tokens must be >= 2")
    return max(0.0, (t_many_s - t_one_token_s) / (tokens - 1))


_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "auto": 2}


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str = "bfloat16") -> int:
    """K and V for every layer (MHA/GQA layout)."""
    return 2 * num_layers * num_kv_heads * head_dim * _DTYPE_BYTES[dtype]


def build_profile(name: str, chips: int, price: float, kvb: int, kv_capacity_tokens: int,
                  max_running: int, prefill_fit, decode_fit, template: HardwareProfile = CHIP_A) -> HardwareProfile:
    """The fitted profile; ``template`` gives only what is not measured (chunk size, the extra
    request's cost). The decode step is the fitted linear sum: a roofline template's weight
    read and attention terms are the preset model's, not the measured one's, and are cleared."""
    return replace(
        template, name=name, chips_per_instance=chips, price_per_chip_hour=price, kv_bytes_per_token=kvb,
        kv_capacity_tokens=kv_capacity_tokens // 2, cache_capacity_tokens=kv_capacity_tokens // 2,
        max_running_requests=max_running,
        prefill_overhead_s=prefill_fit[0], prefill_s_per_token=prefill_fit[1], prefill_s_per_token_ctx=prefill_fit[2],
        decode_step_overhead_s=decode_fit[0], decode_step_s_per_seq=decode_fit[1],
        decode_step_s_per_kv_token=decode_fit[2],
        decode_roofline=False, decode_weights_s=0.0, decode_attn_s_per_kv_token=0.0)


# ---- HTTP ------------------------------------------------------------------------------


def _get(url: str) -> Dict:
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())


def served_model_config(model_path: str, override: Optional[str] = None) -> Dict:
    """The served model's config (its text part for a multimodal one): ``override`` (a
    config.json or a model directory), else the server's model_path, read here (a directory)
    or through transformers (a hub id in the local cache). SystemExit naming --model-config
    when neither works: a guessed vocabulary sends ids the model does not have."""
    path = Path(override or model_path)
    file = path if path.is_file() else path / "config.json"
    try:
        if file.is_file():
            cfg = json.loads(file.read_text())
        else:
            from transformers import AutoConfig
            cfg = AutoConfig.from_pretrained(str(path)).to_dict()
    except Exception as e:  # noqa: BLE001 (any failure: the same advice)
        raise SystemExit(f"calibrate_profile: cannot read the config of the served model {str(path)!r} ({e}); "
                         f"pass --model-config PATH (its config.json or model directory)") from None
    cfg = {**cfg, **(cfg.get("text_config") or {})}
    if not cfg.get("vocab_size"):
        raise SystemExit(f"calibrate_profile: {str(path)!r} names no vocab_size; pass --model-config")
    return cfg


def kv_dtype(info: Dict, cfg: Dict) -> str:
    """The KV cache's dtype: the server's --kv-cache-dtype, or its model dtype when "auto"."""
    for value in (info.get("kv_cache_dtype"), info.get("dtype"), cfg.get("torch_dtype"), cfg.get("dtype")):
        if value and value != "auto":
            return value
    return "bfloat16"


def _generate(url: str, input_ids: List[int], max_new_tokens: int) -> float:
    body = json.dumps({"input_ids": input_ids,
                       "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 0}})
    req = urllib.request.Request(url + "/generate", body.encode(), {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()
    return time.perf_counter() - t0


def _random_ids(n: int, vocab: int, rng: random.Random) -> List[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]  # fresh ids: no prefix-cache hits


def measure_prefill(url: str, lengths: Sequence[int], vocab: int, rng: random.Random, repeats: int = 2):
    return [(n, 0, min(_generate(url, _random_ids(n, vocab, rng), 1) for _ in range(repeats))) for n in lengths]


def measure_decode(url: str, batches: Sequence[int], prompt: int, tokens: int, vocab: int, rng: random.Random):
    samples = []
    for b in batches:
        with ThreadPoolExecutor(b) as ex:
            t1 = max(ex.map(lambda _: _generate(url, _random_ids(prompt, vocab, rng), 1), range(b)))
            tn = max(ex.map(lambda _: _generate(url, _random_ids(prompt, vocab, rng), tokens), range(b)))
        samples.append((b, b * (prompt + tokens // 2), step_time_from_runs(t1, tn, tokens)))
    return samples


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill-url", required=True)
    ap.add_argument("--decode-url", help="defaults to --prefill-url")
    ap.add_argument("--name", required=True)
    ap.add_argument("--chips", type=int, default=1)
    ap.add_argument("--price-per-chip-hour", type=float, required=True)
    ap.add_argument("--prefill-lengths", default="256,1024,4096,8192")
    ap.add_argument("--decode-batches", default="1,4,16")
    ap.add_argument("--decode-prompt", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--model-config", help="the served model's config.json or directory (default: the "
                    "model_path the server reports, when readable here)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rng = random.Random(0)
    info = _get(a.prefill_url + "/server_info")
    model = _get(a.prefill_url + "/model_info")
    hf = served_model_config(model["model_path"], a.model_config)
    vocab = int(hf["vocab_size"])
    layers = hf["num_hidden_layers"]
    kv_heads = hf.get("num_key_value_heads", hf["num_attention_heads"])
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    kvb = kv_bytes_per_token(layers, kv_heads, head_dim, kv_dtype(info, hf))
    capacity = int(info.get("max_total_num_tokens", 0)) or CHIP_A.kv_capacity_tokens
    pre = measure_prefill(a.prefill_url, [int(x) for x in a.prefill_lengths.split(",")], vocab, rng)
    dec = measure_decode(a.decode_url or a.prefill_url, [int(x) for x in a.decode_batches.split(",")],
                         a.decode_prompt, a.decode_tokens, vocab, rng)
    prof = build_profile(a.name, a.chips, a.price_per_chip_hour, kvb, capacity,
                         int(info.get("max_running_requests") or 128), fit_prefill(pre), fit_decode_step(dec))
    with open(a.out, "w") as f:
        json.dump({**asdict(prof), "_samples": {"prefill": pre, "decode": dec}}, f, indent=2)
    print(prof.to_json())


if __name__ == "__main__":
    main()
