"""Build a tiny model + byte-level BPE tokenizer locally and deterministically (no downloads).

Random weights make the text meaningless, but greedy token IDs are deterministic, which is what
the end-to-end tests compare (PDD output_ids == single-server output_ids). Three architectures:
``llama`` (MHA KV pool), ``deepseek_v2`` (MLA: one latent KV buffer per layer) and ``mellum``
(hybrid sliding-window: SGLang gives it an SWAKVPool, full layers and a smaller window pool).

    python scripts/build_tiny_model.py --out artifacts/tiny-llama
    python scripts/build_tiny_model.py --arch deepseek_v2 --out artifacts/tiny-deepseek
    python scripts/build_tiny_model.py --arch mellum --out artifacts/tiny-mellum
"""

import argparse
import hashlib
import json
import sysconfig
from pathlib import Path

# Fixed corpus: these standard-library modules exist in every CPython 3.11.
CORPUS_MODULES = ["argparse", "collections/__init__", "dataclasses", "json/decoder",
                  "logging/__init__", "pathlib", "textwrap", "typing", "functools", "enum"]
VOCAB_SIZE = 1024
SEED = 1234
# Bumped whenever what is built changes: an older build on disk is then rebuilt, not reused.
BUILD_VERSION = "2"
# The unembedding's init std, 10x the other weights'. Scaling logits changes no argmax (greedy
# output is what it would be at 0.08) but widens the margin between the best two tokens, from
# ~0.001-0.01 in logprob to ~0.01-0.1: tests can then pick prompts whose greedy output no
# rounding difference can flip, and demand exact equality (tests/e2e/test_e2e_differential.py).
LM_HEAD_STD = 0.8


def corpus_lines():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in CORPUS_MODULES:
        yield from (stdlib / f"{name}.py").read_text(encoding="utf-8").splitlines()


def build_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(out)
    return fast


def _common_config(tokenizer) -> dict:
    return dict(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=8192, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, torch_dtype="float32",
    )


def llama_model(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(num_key_value_heads=2, head_dim=32, **_common_config(tokenizer)))


def deepseek_v2_model(tokenizer):
    """MLA attention (no q LoRA, kv_lora_rank 64, rope dim 16), dense MLPs only (no MoE layer)."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=64, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32,
        first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=64,
        # SGLang's CPU rope for MLA is DeepSeek's YaRN only (get_rope_cpu asserts rope_scaling),
        # as every real DeepSeek-V2/V3 config has; factor 1 keeps it a plain rope in effect.
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 1.0,
                         "original_max_position_embeddings": 8192, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
        n_group=1, topk_group=1, **_common_config(tokenizer),
    )
    # Fields of real DeepSeek-V2 config.json files that transformers' class lacks; SGLang reads them.
    config.moe_layer_freq, config.scoring_func = 1, "softmax"
    return DeepseekV2ForCausalLM(config)


# Smaller than the tests' prompts, so the sliding layers really drop tokens the full layers keep.
MELLUM_SLIDING_WINDOW = 32


def mellum_model(tokenizer):
    """Hybrid SWA: 4 layers sliding/full/sliding/full, window 32, dense MLPs only (no MoE)."""
    from transformers import MellumConfig, MellumForCausalLM

    common = _common_config(tokenizer)
    common["num_hidden_layers"] = 4
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    config = MellumConfig(
        num_key_value_heads=2, head_dim=32, sliding_window=MELLUM_SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2, mlp_layer_types=["dense"] * 4,
        rope_parameters={"full_attention": dict(rope), "sliding_attention": dict(rope)}, **common,
    )
    return MellumForCausalLM(config)


ARCHITECTURES = {"llama": llama_model, "deepseek_v2": deepseek_v2_model, "mellum": mellum_model}


def build_model(out: Path, tokenizer, arch: str = "llama"):
    import torch

    torch.manual_seed(SEED)
    model = ARCHITECTURES[arch](tokenizer)
    with torch.no_grad():
        # Wider-than-default init so greedy decoding wanders instead of repeating one token.
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
        model.lm_head.weight.normal_(0.0, LM_HEAD_STD)
        # Never emit EOS by argmax: outputs run to max_new_tokens, so lengths are comparable.
        model.lm_head.weight[tokenizer.eos_token_id].zero_()
    model.save_pretrained(out, safe_serialization=True)


def fingerprint(out: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(out.glob("*")):
        if f.name != "BUILD_FINGERPRINT":
            h.update(f.name.encode()); h.update(f.read_bytes())
    return h.hexdigest()[:16]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="artifacts/tiny-llama")
    ap.add_argument("--arch", choices=sorted(ARCHITECTURES), default="llama")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    stamp = out / "BUILD_FINGERPRINT"
    built = stamp.read_text().split() if stamp.exists() else []
    if built[1:] == [f"v{BUILD_VERSION}"] and not args.force:
        print(f"tiny model already at {out} ({' '.join(built)})")
        return
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    build_model(out, tok, args.arch)
    stamp.write_text(f"{fingerprint(out)} v{BUILD_VERSION}\n")
    print(f"built tiny model at {out}: {json.loads((out / 'config.json').read_text())['model_type']}, "
          f"fingerprint {stamp.read_text().split()[0]}")


if __name__ == "__main__":
    main()
