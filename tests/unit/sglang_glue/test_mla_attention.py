"""MLA layers on SGLang's torch_native backend take the absorbed MLA path (mla_attention.py);
the MLA model itself runs end to end in tests/e2e/test_e2e_mla.py."""

import pytest

from tests.conftest import require_sglang_import


@pytest.fixture
def registry():
    require_sglang_import()
    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry

    saved = dict(AttentionBackendRegistry._handlers)
    AttentionBackendRegistry._handlers.pop("torch_native", None)  # as SGLang 0.5.23 ships it
    yield AttentionBackendRegistry
    AttentionBackendRegistry._handlers.clear()
    AttentionBackendRegistry._handlers.update(saved)


def test_torch_native_falls_back_to_triton_until_registered(registry):
    from sglang_pdd.sglang_glue.mla_attention import absorbed_mla_only, register_torch_native_mla_dispatch

    triton = registry.get_handler("triton")
    assert registry.get_handler("torch_native") is triton  # the MHA-for-prefill dispatch
    others = {name: registry.get_handler(name) for name in ("fa3", "flashinfer", "triton")}
    assert register_torch_native_mla_dispatch() is True
    assert registry.get_handler("torch_native") is absorbed_mla_only
    assert {name: registry.get_handler(name) for name in others} == others
    assert register_torch_native_mla_dispatch() is False  # once per process


def test_absorbed_path_for_prefill_and_decode(registry):
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    from sglang_pdd.sglang_glue.mla_attention import register_torch_native_mla_dispatch

    register_torch_native_mla_dispatch()
    handler = registry.get_handler("torch_native")
    # the handler ignores the batch: a prefix-less prefill (where triton's picks MHA) and a decode
    for batch in (object(), None):
        assert handler(object(), batch) is AttnForwardMethod.MLA


def test_an_existing_torch_native_entry_is_kept(registry):
    from sglang_pdd.sglang_glue.mla_attention import register_torch_native_mla_dispatch

    def upstream(attn, forward_batch):
        return None

    registry.register("torch_native", upstream)
    assert register_torch_native_mla_dispatch() is False
    assert registry.get_handler("torch_native") is upstream
