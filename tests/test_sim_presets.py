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
