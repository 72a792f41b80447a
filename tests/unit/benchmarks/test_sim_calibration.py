import json

import pytest

from benchmarks import calibrate_profile as cal
from sglang_pdd.sim.hardware import TOY_A, HardwareProfile


@pytest.mark.parametrize("true", [(0.01, 4e-5, 1.2e-9), (0.002, 1e-4, 0.0)])
def test_fit_prefill_recovers_coefficients(true):
    samples = [(n, c, true[0] + n * true[1] + n * (c + n / 2) * true[2])
               for n in (256, 1024, 4096, 8192) for c in (0, 8192)]
    fit = cal.fit_prefill(samples)
    assert fit == pytest.approx(true, rel=1e-6, abs=1e-12)
    # The fitted profile predicts what was measured.
    prof = cal.build_profile("x", 8, 1.0, 1000, 1000, 64, fit, (0.01, 0.0, 0.0))
    for n, c, t in samples:
        assert prof.prefill_time_s(n, c) == pytest.approx(t, rel=1e-6)


def test_fit_decode_step_and_negative_coefficients_are_dropped():
    true = (0.012, 2e-4, 1.5e-8)
    samples = [(b, kv, true[0] + b * true[1] + kv * true[2]) for b in (1, 4, 16, 64) for kv in (1e4, 1e6)]
    assert cal.fit_decode_step(samples) == pytest.approx(true, rel=1e-6)
    # Step time that falls with batch size is noise: the per-seq term is clamped to 0.
    noisy = [(1, 1e4, 0.02), (4, 1e4, 0.019), (16, 1e4, 0.018), (16, 1e6, 0.03)]
    fit = cal.fit_decode_step(noisy)
    assert fit[1] == 0.0 and fit[0] > 0 and fit[2] > 0
    with pytest.raises(ValueError):
        cal.fit_decode_step(noisy[:2])


@pytest.mark.parametrize("t1, tn, tokens, expect", [(0.1, 1.1, 11, 0.1), (0.5, 0.4, 3, 0.0)])
def test_step_time_from_runs(t1, tn, tokens, expect):
    assert cal.step_time_from_runs(t1, tn, tokens) == pytest.approx(expect)


def test_kv_bytes_per_token():
    # Llama-3-8B: 32 layers, 8 KV heads, head dim 128, bf16 -> 128 KiB per token.
    assert cal.kv_bytes_per_token(32, 8, 128, "bfloat16") == 131072
    assert cal.kv_bytes_per_token(32, 8, 128, "fp8") == 65536


def test_profile_json_roundtrip(tmp_path):
    p = tmp_path / "prof.json"
    p.write_text(json.dumps({**json.loads(TOY_A.to_json()), "_samples": {"prefill": []}}))
    assert HardwareProfile.load(str(p)) == TOY_A
