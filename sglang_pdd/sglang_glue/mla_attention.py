"""MLA models (DeepSeek-V2/V3 style) on SGLang's ``torch_native`` attention backend.

SGLang picks an MLA layer's forward method per attention backend through
``AttentionBackendRegistry``; ``torch_native`` has no entry there and falls back to the triton
handler, which sends a prefix-less prefill down the "MHA" path (decompress the latent into
per-head K/V and call ``attn_mha(q, k, v, save_kv_cache=False)``). ``torch_native`` ignores the
k/v it is handed and attends over the KV pool instead, which for an MLA pool holds the latent
(``kv_lora_rank + qk_rope_head_dim`` wide), not per-head K/V: the prefill fails or reads the
wrong tensor. The absorbed "MLA" path (q projected into the latent space, attention over the
latent pool, one KV head) is exactly what ``torch_native`` computes correctly, prefill and
decode. So for ``torch_native`` every MLA forward takes that path.

This registers that choice in SGLang's own registry (no patch); backends that have an entry
are untouched. The registry is imported by SGLang's model registry in every scheduler process
anyway, so doing it at Scheduler start costs nothing extra.
"""

from __future__ import annotations

TORCH_NATIVE = "torch_native"


def absorbed_mla_only(attn, forward_batch):
    """The forward method for an MLA layer under ``torch_native``: always the absorbed path."""
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    return AttnForwardMethod.MLA


def register_torch_native_mla_dispatch() -> bool:
    """Give ``torch_native`` its MLA dispatch entry unless SGLang (or someone) already did.
    Returns whether this call registered it."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry

    # an unknown name resolves to the triton handler: anything else means an entry exists
    if AttentionBackendRegistry.get_handler(TORCH_NATIVE) is not AttentionBackendRegistry.get_handler("triton"):
        return False
    AttentionBackendRegistry.register(TORCH_NATIVE, absorbed_mla_only)
    return True
