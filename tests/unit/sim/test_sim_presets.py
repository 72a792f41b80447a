"""Hardware presets: one model class per profile, numbers derived from spec sheets."""

import pytest

from sglang_pdd.sim.hardware import (CHIP_A, CHIP_B, DEEPSEEK_V3, H20, H100, H200, LLAMA3_70B, instance_chips,
                                     preset)


def test_kv_size_matches_the_model_architecture():
    assert LLAMA3_70B.kv_bytes_per_token == 327_680  # 80 layers x 8 KV heads x 128 x (K, V) x bf16
    assert DEEPSEEK_V3.kv_bytes_per_token == 70_272  # 61 layers x (512 + 64) MLA latent x bf16


def test_defaults_are_one_model_on_two_chips():
    assert CHIP_A.kv_bytes_per_token == CHIP_B.kv_bytes_per_token == LLAMA3_70B.kv_bytes_per_token
    assert "h100" in CHIP_A.name and "h20" in CHIP_B.name
    assert CHIP_B.price_per_hour < CHIP_A.price_per_hour


@pytest.mark.parametrize("model", [LLAMA3_70B, DEEPSEEK_V3])
@pytest.mark.parametrize("chip", [H100, H200, H20])
def test_every_preset_holds_weights_and_kv(model, chip):
    hw = preset(model, chip)
    n = instance_chips(model, chip)
    assert hw.chips_per_instance == n
    assert n * chip.hbm_gb * 0.9 >= 1.25 * model.weight_bytes_gb
    assert hw.kv_capacity_tokens * model.kv_bytes_per_token <= n * chip.hbm_gb * 1e9
    # Decode is memory bound at small batch: the weight read dominates one step.
    assert hw.decode_step_s(1, 1000) > hw.decode_step_s_per_seq * 10


def test_cheap_decode_chip_is_cheaper_per_decoded_token_and_slower_at_prefill():
    for model in (LLAMA3_70B, DEEPSEEK_V3):
        fast, cheap = preset(model, H100), preset(model, H20)
        assert cheap.prefill_s_per_token > 3 * fast.prefill_s_per_token
    # MLA model: the H20 decode instance beats H200 on tokens per $ at a realistic batch.
    h200, h20 = preset(DEEPSEEK_V3, H200), preset(DEEPSEEK_V3, H20)
    per_dollar = [256 / hw.decode_step_s(256, 256 * 4000) / hw.price_per_hour for hw in (h200, h20)]
    assert per_dollar[1] > 1.3 * per_dollar[0]


def test_a_model_that_does_not_fit_is_an_error():
    with pytest.raises(ValueError):
        preset(DEEPSEEK_V3, H20, chips=8)


def test_long_context_mla_decode_is_compute_bound_on_h20():
    # 16 H20s' KV pool filled with 64k-token contexts: attention on the MLA latent costs
    # 2 * 61 * 128 * (576 + 512) FLOPs per context token, ~1.1 TFLOP per sequence and step;
    # at FlashMLA's 0.84 of 16 x 148 TFLOPS (issue #30: 120-130 TFLOPS a chip) that is ~0.55 ms
    # per sequence, ~85 ms for the batch.
    hw = preset(DEEPSEEK_V3, H20)
    assert hw.chips_per_instance == 16 and H20.mla_decode_attn_eff == 0.84
    b = hw.kv_capacity_tokens // 65536
    step = hw.decode_step_s(b, b * 65536)
    flops = b * 65536 * DEEPSEEK_V3.decode_attn_flops_per_token_ctx
    assert step == pytest.approx(hw.decode_step_overhead_s + b * hw.decode_step_s_per_seq
                                 + flops / (16 * 148e12 * 0.84))
    assert 0.08 < step < 0.11
    memory_side = hw.decode_weights_s + b * 65536 * hw.decode_step_s_per_kv_token
    assert memory_side < step / 2  # bandwidth alone would have said ~35 ms
    # The same batch on 16 H100s (6.7x the compute at 0.67 instead of 0.84) is far faster.
    assert preset(DEEPSEEK_V3, H100).decode_step_s(b, b * 65536) < step / 2
    # Generic kernels (0.15 of peak, timed on an H200): the named sensitivity, 5.6x the attention.
    slow = preset(DEEPSEEK_V3, H20, mla_kernel="generic")
    assert slow.decode_attn_s_per_kv_token == pytest.approx(hw.decode_attn_s_per_kv_token * 0.84 / 0.15)
    assert slow.decode_step_s(b, b * 65536) > 4 * step
    # GQA decode does not use FlashMLA: the kernel choice does not move Llama-3-70B.
    assert preset(LLAMA3_70B, H20, mla_kernel="generic") == preset(LLAMA3_70B, H20)


def test_mla_decode_efficiency_is_flashmlas_published_figure_per_chip():
    from sglang_pdd.sim.hardware import MLA_KV_MBU
    # FlashMLA README: 660 TFLOPS on H800 (H100/H200 tensor cores) of 989; issue #30: H20 120-130 of 148
    assert H100.mla_decode_attn_eff == H200.mla_decode_attn_eff == pytest.approx(660 / 989, abs=0.005)
    assert 120 / 148 <= H20.mla_decode_attn_eff <= 130 / 148
    # FlashMLA's KV read (~2.8 of 3.35 TB/s on H100) replaces the generic MBU on MLA's KV term
    h200 = preset(DEEPSEEK_V3, H200)
    assert h200.decode_step_s_per_kv_token == pytest.approx(DEEPSEEK_V3.kv_bytes_per_token / (8 * 4.8e12 * MLA_KV_MBU))


def test_host_tier_is_sized_from_the_preset():
    from sglang_pdd.sim.hardware import HICACHE_RATIO, HOST_KV_GB_PER_CHIP
    for model, chip in ((DEEPSEEK_V3, H200), (DEEPSEEK_V3, H20), (LLAMA3_70B, H100)):
        hw = preset(model, chip)
        want = min(HICACHE_RATIO * hw.kv_capacity_tokens,
                   hw.chips_per_instance * HOST_KV_GB_PER_CHIP * 1e9 / model.kv_bytes_per_token)
        assert hw.host_cache_tokens == pytest.approx(want, rel=1e-6)
        assert hw.host_cache_tokens > hw.cache_capacity_tokens  # more room than HBM's cache share
        # loading a block back costs far less than recomputing it (a prefill of one token)
        assert hw.host_load_s_per_token < hw.prefill_s_per_token
        assert preset(model, chip, host_cache=False).host_cache_tokens == 0


def test_gqa_decode_attention_is_bandwidth_bound():
    # Llama-3-70B reads 320 KB of KV per context token for 2.6 MFLOP of attention (8 FLOP/B),
    # under any of these chips' compute/bandwidth ratio: more context costs KV bandwidth.
    for chip in (H100, H200, H20):
        hw = preset(LLAMA3_70B, chip)
        assert LLAMA3_70B.decode_attn_flops_per_token_ctx / LLAMA3_70B.kv_bytes_per_token < 10
        assert hw.decode_attn_s_per_kv_token < hw.decode_step_s_per_kv_token
        one = hw.decode_step_s(1, 100_000)
        assert one == pytest.approx(hw.decode_step_overhead_s + hw.decode_weights_s
                                    + 100_000 * hw.decode_step_s_per_kv_token)


@pytest.mark.parametrize("model", [LLAMA3_70B, DEEPSEEK_V3])
def test_roofline_step_is_the_larger_of_compute_and_memory(model):
    hw = preset(model, H20)
    for b, kv in ((1, 1000), (64, 64 * 4000), (256, 256 * 16000)):
        compute = b * hw.decode_step_s_per_seq + kv * hw.decode_attn_s_per_kv_token
        memory = hw.decode_weights_s + kv * hw.decode_step_s_per_kv_token
        assert hw.decode_step_s(b, kv) == pytest.approx(hw.decode_step_overhead_s + max(compute, memory))
        # Never cheaper than either side alone, never more than both together.
        assert hw.decode_step_s(b, kv) <= hw.decode_step_overhead_s + compute + memory


def test_linear_profiles_keep_the_summed_model():
    # Fitted (calibrated) profiles are linear in batch and KV; the roofline must not change them.
    from sglang_pdd.sim.hardware import TOY_A
    assert not TOY_A.decode_roofline
    assert TOY_A.decode_step_s(10, 5000) == pytest.approx(
        TOY_A.decode_step_overhead_s + 10 * TOY_A.decode_step_s_per_seq + 5000 * TOY_A.decode_step_s_per_kv_token)
