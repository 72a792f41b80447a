"""Model classes of the presets: DeepSeek-V3's KV dtype, DeepSeek-V4-Pro's compressed KV and
bounded sparse attention, and how small an instance (an RLD slice) each model can be."""

import pytest

from sglang_pdd.sim.hardware import (DEEPSEEK_V3, DEEPSEEK_V4_PRO, V4_CSA_LAYERS, V4_CSA_RATIO, V4_ENTRY_B,
                                     V4_HCA_LAYERS, V4_HCA_RATIO, instance_chips, preset, reference_preset,
                                     request_kv_bytes, smallest_group, with_kv_dtype, CHIPS, profile_problems)


def test_fp8_kv_is_flashmlas_656_bytes_a_layer_and_scales_pools_host_tier_and_kv_read():
    fp8 = with_kv_dtype("deepseek-v3", "fp8")
    assert fp8.kv_bytes_per_token == 656 * 61 == 40_016
    assert with_kv_dtype("deepseek-v3", "bf16") is DEEPSEEK_V3 and DEEPSEEK_V3.kv_bytes_per_token == 70_272
    bf, f8 = preset("deepseek-v3", "h200"), preset("deepseek-v3", "h200", kv_dtype="fp8")
    ratio = bf.kv_bytes_per_token / f8.kv_bytes_per_token
    assert f8.kv_capacity_tokens / bf.kv_capacity_tokens == pytest.approx(ratio, rel=1e-3)
    assert f8.host_cache_tokens / bf.host_cache_tokens == pytest.approx(ratio, rel=1e-3)
    assert bf.decode_step_s_per_kv_token / f8.decode_step_s_per_kv_token == pytest.approx(ratio)
    assert bf.host_load_s_per_token / f8.host_load_s_per_token == pytest.approx(ratio)
    # FlashMLA dequantises: attention compute is the bf16 model's
    assert f8.decode_attn_s_per_kv_token == bf.decode_attn_s_per_kv_token
    assert f8.name == "deepseek-v3-fp8kv@8xh200" and reference_preset(f8.name) == f8
    with pytest.raises(ValueError, match="deepseek-v3 only"):
        with_kv_dtype("llama3-70b", "fp8")
    with pytest.raises(ValueError, match="kv_dtype"):
        with_kv_dtype("deepseek-v3", "int4")


def test_v4_pro_kv_of_80_concurrent_64k_requests_against_the_reports_23_gb():
    # The report: 80 concurrent 64K requests hold ~23 GB of KV. Its compressed entries alone
    # (CSA 1 per 4 tokens, HCA 1 per 128, 584 B each) give that to within 5%; SGLang's pool
    # also holds CSA's fp4 indexer keys and each request's window and compression state,
    # which the figure leaves out: ~28 GB in all.
    n, ctx = 80, 65_536
    entries = n * ctx * (V4_CSA_LAYERS * V4_ENTRY_B / V4_CSA_RATIO + V4_HCA_LAYERS * V4_ENTRY_B / V4_HCA_RATIO)
    assert entries / 1e9 == pytest.approx(23.0, rel=0.05)
    total = n * request_kv_bytes(DEEPSEEK_V4_PRO, ctx)
    assert 1.0 < total / 23e9 < 1.3
    # the window and compression state do not grow with the context
    assert (request_kv_bytes(DEEPSEEK_V4_PRO, 2 * ctx) - request_kv_bytes(DEEPSEEK_V4_PRO, ctx)
            == ctx * DEEPSEEK_V4_PRO.kv_bytes_per_token)
    # ~14x less KV a token than DeepSeek-V3 in bf16, ~8x less than its fp8
    assert 12 < DEEPSEEK_V3.kv_bytes_per_token / DEEPSEEK_V4_PRO.kv_bytes_per_token < 16


def test_v4_pro_decode_attention_is_bounded_where_v3s_grows_with_the_context():
    v3, v4 = preset("deepseek-v3", "h200", kv_dtype="fp8"), preset("deepseek-v4-pro", "h200")
    b = 64

    def growth(hw):  # a step at 128K contexts over one at 8K
        return hw.decode_step_s(b, b * 131_072) / hw.decode_step_s(b, b * 8192)
    # (at batch 64 the weights' read is most of either step; what the context adds differs ~10x)
    assert growth(v3) > 1.25
    assert growth(v4) - 1 < 0.15 * (growth(v3) - 1)
    # the bounded part (top-k entries + windows) is a per-sequence cost, not zero
    assert v4.decode_read_s_per_seq > 0 and v4.decode_step_s(b, 0) > v4.decode_step_s(1, 0)
    assert profile_problems(v4) == [] and profile_problems(preset("deepseek-v4-pro", "h20")) == []


def test_v4_pro_instances_and_why_an_rld_cannot_be_a_slice_of_one():
    # ~872 GB of weights (mxfp4 experts, fp8 rest): 8 H200 hold them with room for KV; 16 H20
    assert 850 < DEEPSEEK_V4_PRO.weight_bytes_gb < 900
    assert instance_chips(DEEPSEEK_V4_PRO, CHIPS["h200"]) == 8
    assert instance_chips(DEEPSEEK_V4_PRO, CHIPS["h20"]) == 16
    assert smallest_group("deepseek-v4-pro", "h200") == 8 and smallest_group("deepseek-v3", "h200") == 8
    # neither model's weights fit half an 8-GPU H200 instance: an RLD is a whole one
    for model in ("deepseek-v3", "deepseek-v4-pro"):
        with pytest.raises(ValueError, match="does not fit"):
            preset(model, "h200", chips=4)
    # where the weights fit a slice, it is priced pro rata by chip (llama3-70b on 3 of 4 H100)
    whole, part = preset("llama3-70b", "h100"), preset("llama3-70b", "h100", chips=3)
    assert part.price_per_hour == pytest.approx(whole.price_per_hour * 3 / whole.chips_per_instance)
