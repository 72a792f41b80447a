"""PDD roles refuse at start, by name, what they cannot move (sglang_glue/servable.py)."""

import types

import pytest
import torch

pytest.importorskip("sglang")


def mha_pool():
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(64, page_size=1, dtype=torch.float32, head_num=2, head_dim=8, layer_num=1, device="cpu",
                            enable_memory_saver=False)


def swa_pool(page_size=1):
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    return SWAKVPool(size=64, size_swa=32, page_size=page_size, dtype=torch.float32, head_num=2, head_dim=8,
                     swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu", enable_memory_saver=False)


class SinkAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.sinks = torch.nn.Parameter(torch.zeros(4), requires_grad=False)


def test_plain_and_sliding_window_pools_serve_what_the_wan_path_cannot_move_is_refused_naming_it():
    from sglang_pdd.sglang_glue.servable import why_not_servable

    assert why_not_servable(mha_pool(), None, "torch_native") is None
    assert why_not_servable(swa_pool(), None, "torch_native", window=32) is None
    assert why_not_servable(swa_pool(16), None, "torch_native", page_size=16, window=32) is None
    reason = why_not_servable(swa_pool(), None, "torch_native", window=0)
    assert "SWAKVPool has sliding-window layers but no sliding window size was given" in reason
    assert "plain SGLang PD" in reason


def test_mamba_state_is_refused_naming_the_pool():
    from sglang_pdd.sglang_glue.servable import why_not_servable

    class HybridReqToTokenPool:  # SGLang's request pool of Mamba/linear-attention models, by name
        mamba_pool = object()

    reason = why_not_servable(mha_pool(), HybridReqToTokenPool(), "torch_native")
    assert "HybridReqToTokenPool holds Mamba / linear-attention state" in reason


def test_attention_sinks_are_refused_on_torch_native_only():
    from sglang_pdd.sglang_glue.servable import why_not_servable

    model = torch.nn.ModuleDict({"layer0": SinkAttention(), "layer1": SinkAttention(), "mlp": torch.nn.Linear(2, 2)})
    reason = why_not_servable(mha_pool(), None, "torch_native", model.named_modules())
    assert "attention takes sinks (layer0 and 1 more)" in reason and "torch_native" in reason
    assert why_not_servable(mha_pool(), None, "fa3", model.named_modules()) is None


def test_the_scheduler_check_raises_with_the_reason():
    from sglang_pdd.sglang_glue.servable import NotServable, check_scheduler

    def scheduler(pool, page_size=1, window=None):
        return types.SimpleNamespace(
            tp_worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(model=torch.nn.Linear(2, 2))),
            token_to_kv_pool_allocator=types.SimpleNamespace(get_kvcache=lambda: pool, page_size=page_size),
            req_to_token_pool=None, server_args=types.SimpleNamespace(attention_backend="torch_native"),
            sliding_window_size=window)

    check_scheduler(scheduler(mha_pool()))
    check_scheduler(scheduler(swa_pool(), window=32))  # the scheduler's sliding window reaches the check
    check_scheduler(scheduler(swa_pool(16), page_size=16, window=32))
    with pytest.raises(NotServable, match="^sglang-pdd cannot move .*SWAKVPool has sliding-window layers but no "):
        check_scheduler(scheduler(swa_pool(16), page_size=16, window=None))
