"""Build a tiny Llama model + byte-level BPE tokenizer locally and deterministically (no downloads).

Random weights make the text meaningless, but greedy token IDs are deterministic, which is what
the end-to-end tests compare (PDD output_ids == single-server output_ids).

    python scripts/build_tiny_model.py --out artifacts/tiny-llama
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


def build_model(out: Path, tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Wider-than-default init so greedy decoding wanders instead of repeating one token.
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
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
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    stamp = out / "BUILD_FINGERPRINT"
    if stamp.exists() and not args.force:
        print(f"tiny model already at {out} ({stamp.read_text().strip()})")
        return
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    build_model(out, tok)
    stamp.write_text(fingerprint(out) + "\n")
    print(f"built tiny model at {out}: {json.loads((out / 'config.json').read_text())['model_type']}, "
          f"fingerprint {stamp.read_text().strip()}")


if __name__ == "__main__":
    main()
