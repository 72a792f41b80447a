"""The hardware profile plausibility check (sim/hardware.py, profile_problems / check_profile):
silent on every preset, a warning on the profiles that once made the calibration's TPOT
+1,300-4,100% off (a cold server, one noisy decode sample) and on other impossible ones."""

import itertools
import json
import warnings
from dataclasses import asdict, replace

import pytest

from benchmarks import bench_sim_calibration as bsc
from benchmarks import calibrate_profile as cp
from sglang_pdd.sim.hardware import (CHIP_A, CHIP_B, CHIPS, MODELS, TOY_A, TOY_B, HardwareProfile, ProfileWarning,
                                     check_profile, preset, profile_problems)

# What the calibration measured on the tiny model, warm (docs/sim-notebook.md): decode 4.5-6.6 ms at
# batch 1-8, prefill 17.3 ms + 26.8 us/token.
PREFILL = [(64, 0, 0.019), (256, 0, 0.024), (1024, 0, 0.045), (1536, 0, 0.058)]
WARM = [(1, 272, 0.0045), (2, 544, 0.0051), (4, 1088, 0.0060), (8, 2176, 0.0066)]
NOISY = [(1, 272, 0.0045), (2, 544, 0.0051), (4, 1088, 0.014), (8, 2176, 0.175)]  # one sample under load
COLD = [(1, 272, 0.150), (2, 544, 0.155), (4, 1088, 0.160), (8, 2176, 0.158)]  # first kernels at each shape


def fitted(decode):
    return cp.build_profile("tiny", 1, 1.0, 512, 65536, 16, cp.fit_prefill(PREFILL), cp.fit_decode_step(decode))


def on_roofline_template(profile):
    """A fit with a roofline preset's weight read and attention terms left in (15 ms a step)."""
    return replace(profile, decode_roofline=True, decode_weights_s=CHIP_A.decode_weights_s,
                   decode_attn_s_per_kv_token=CHIP_A.decode_attn_s_per_kv_token)


def test_a_fitted_profile_is_the_linear_fit_whatever_the_template():
    prof = fitted(WARM)
    assert not prof.decode_roofline and prof.decode_weights_s == 0 == prof.decode_attn_s_per_kv_token
    for batch, kv, seconds in WARM:
        assert abs(prof.decode_step_s(batch, kv) - seconds) < 0.001


def presets():
    return [preset(m, c) for m, c in itertools.product(MODELS, CHIPS)] + [CHIP_A, CHIP_B, TOY_A, TOY_B]


@pytest.mark.parametrize("hw", presets(), ids=lambda h: h.name)
def test_presets_are_plausible(hw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_profile(hw) == []


def test_a_warm_measured_profile_is_plausible():
    assert profile_problems(fitted(WARM), WARM, PREFILL) == []
    samples = {"prefill": PREFILL, "decode": WARM, "decode_runs": [WARM, [(b, kv, 1.3 * t) for b, kv, t in WARM]]}
    assert bsc.profile_warnings(fitted(WARM), samples) == []


def test_one_noisy_decode_sample_warns():
    prof = fitted(NOISY)
    assert prof.decode_step_s_per_kv_token > 3e-5  # the fit put the step on the KV term
    problems = profile_problems(prof, NOISY, PREFILL)
    assert any("prefill token" in p for p in problems)
    assert any("jump" in p and "batch 4" in p for p in problems)
    # without its samples, the profile alone still gives it away
    with pytest.warns(ProfileWarning, match="prefill token"):
        check_profile(prof)


def test_a_cold_server_warns():
    with pytest.warns(ProfileWarning) as caught:
        problems = check_profile(fitted(COLD))
    assert len(caught) == len(problems) and any("cold server" in p for p in problems)


def test_repeated_samples_that_disagree_warn():
    runs = [WARM, [(b, kv, t * (30 if b == 2 else 1)) for b, kv, t in WARM]]
    samples = {"prefill": PREFILL, "decode": bsc.min_steps(runs), "decode_runs": runs}
    with pytest.warns(ProfileWarning, match=r"decode samples at batch 2 spread 30x"):
        problems = bsc.profile_warnings(fitted(WARM), samples)
    assert len(problems) == 1


def test_samples_the_profile_does_not_describe_warn():
    # The template's 15 ms weight read added to every step: 4x what was measured.
    prof = on_roofline_template(fitted(WARM))
    assert prof.decode_step_s(1, 272) > 3 * 0.0045
    assert any("does not describe" in p for p in profile_problems(prof, WARM, PREFILL))


def test_far_from_the_named_presets_roofline_warns():
    hw = preset("llama3-70b", "h100")
    slow = replace(hw, decode_step_overhead_s=0.3)  # 300 ms a step for a 70B on 4 H100
    assert any("roofline" in p for p in profile_problems(slow))
    fast = replace(hw, decode_weights_s=hw.decode_weights_s / 10)  # reads its weights 10x faster than HBM
    assert any("roofline" in p for p in profile_problems(fast))
    # any name: the reference can be given
    assert any("roofline" in p for p in profile_problems(replace(slow, name="mine"), reference=hw))
    assert not any("roofline" in p for p in profile_problems(replace(slow, name="mine")))


def test_steps_that_fall_with_the_batch_warn():
    bad = replace(TOY_A, decode_step_s_per_seq=-5e-5)
    problems = profile_problems(bad)
    assert any("negative" in p for p in problems) and any("falls with batch" in p for p in problems)


def test_loading_a_profile_file_checks_it_with_its_samples(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({**asdict(fitted(WARM)), "_samples": {"prefill": PREFILL, "decode": WARM}}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert HardwareProfile.load(str(good)) == fitted(WARM)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**asdict(on_roofline_template(fitted(WARM))), "_samples": {"prefill": PREFILL,
                                                                                         "decode": WARM}}))
    with pytest.warns(ProfileWarning, match="bad.json.*does not describe"):
        HardwareProfile.load(str(bad))
