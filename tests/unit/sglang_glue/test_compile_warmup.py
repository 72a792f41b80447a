"""P, RLD and MD compile SGLang's torch.compile'd sampling kernels before serving, so the first
request with repetition_penalty does not stall a scheduler while MD's KV and the router's WAN
timeout wait (that stall made a P->MD request fall back to RLD)."""

import types

import pytest
import torch

from sglang_pdd.config import PddConfig
from sglang_pdd.sglang_glue.compile_warmup import warm_dtypes, warm_sampling_kernels

pytest.importorskip("sglang")


def test_logits_dtypes_are_float32_and_the_models():
    assert warm_dtypes(torch.float32) == (torch.float32,)
    assert warm_dtypes(torch.bfloat16) == (torch.float32, torch.bfloat16)


def compiles_during(fn) -> int:
    from torch._dynamo.utils import counters

    before = counters["frames"]["ok"]
    fn()
    return counters["frames"]["ok"] - before


def test_after_the_warm_up_no_request_shape_compiles_again():
    from sglang.srt.sampling.penaltylib.repetition_penalty import apply_scaling_penalties

    torch._dynamo.reset()  # as in a fresh scheduler process
    vocab = 96
    assert compiles_during(lambda: warm_sampling_kernels("cpu", vocab, torch.float32)) >= 2

    def serve():
        for batch in (1, 3, 7, 1, 2, 64):
            logits = torch.randn(batch, vocab)
            want = torch.where(logits < 0, logits * 1.5, logits / 1.5)
            apply_scaling_penalties(logits, torch.full((batch, vocab), 1.5))
            assert torch.allclose(logits, want)

    assert compiles_during(serve) == 0


def test_only_servers_with_a_pdd_role_warm_up(monkeypatch):
    from sglang_pdd.sglang_glue import compile_warmup, plugin, servable

    calls, checked = [], []
    monkeypatch.setattr(compile_warmup, "warm_sampling_kernels", lambda *a: calls.append(a) or 0.0)
    monkeypatch.setattr(servable, "check_scheduler", checked.append)  # its own test: test_servable.py
    model = types.SimpleNamespace(vocab_size=64, dtype=torch.bfloat16)
    for role, want in ((None, 0), ("prefill", 1), ("relay", 2)):
        args = types.SimpleNamespace(_pdd_config=PddConfig(role=role) if role else None)
        plugin._start_role_runtime(None, types.SimpleNamespace(server_args=args, device="cpu", model_config=model))
        assert len(calls) == len(checked) == want
    assert calls[0] == ("cpu", 64, torch.bfloat16)
