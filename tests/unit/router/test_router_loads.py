"""What the router measures of its servers from SGLang's /v1/loads (router/backends/loads.py): P's
prefill speed and MD's decode step growth per running request; None until they can say."""

import pytest

from sglang_pdd.router.backends.loads import MIN_DECODE_STEPS, flow_step_s, merge_ranks, prefill_tokens_per_s


def moments(steps):
    """SGLang's decode_moments sums over (batch, step_us) samples."""
    n = len(steps)
    return [float(n), sum(b for b, _ in steps), sum(t for _, t in steps), sum(b * b for b, _ in steps),
            sum(b * t for b, t in steps), float(n)]


def test_prefill_speed_is_tokens_over_busy_time_once_there_is_enough():
    assert prefill_tokens_per_s({"total_prefill_uncached_tokens": 20_000, "total_prefill_busy_us": 2_000_000}) \
        == pytest.approx(10_000.0)
    assert prefill_tokens_per_s({"total_prefill_uncached_tokens": 100, "total_prefill_busy_us": 1000}) is None
    assert prefill_tokens_per_s({"total_prefill_uncached_tokens": 20_000, "total_prefill_busy_us": 0}) is None
    assert prefill_tokens_per_s({}) is None


def test_step_growth_is_the_slope_of_step_time_on_batch_size():
    # step = 5 ms + 0.2 ms per sequence, at batch sizes 1..8
    steps = [(b, 5000 + 200 * b) for b in range(1, 9)] * 10
    assert flow_step_s({"decode_moments": moments(steps)}) == pytest.approx(2e-4)
    assert flow_step_s({"decode_moments": moments([(4, 6000)] * 100)}) is None  # one batch size says nothing
    assert flow_step_s({"decode_moments": moments(steps[:MIN_DECODE_STEPS - 1])}) is None  # too few steps
    falling = [(b, 9000 - 100 * b) for b in range(1, 9)] * 10
    assert flow_step_s({"decode_moments": moments(falling)}) is None  # never a zero or negative cost
    assert flow_step_s({"decode_moments": None}) is None and flow_step_s({}) is None


def test_dp_ranks_are_summed():
    a = {"total_prefill_uncached_tokens": 3000, "total_prefill_busy_us": 1_000_000, "decode_moments": [1, 2, 3, 4, 5, 6]}
    b = {"total_prefill_uncached_tokens": 1000, "total_prefill_busy_us": 1_000_000, "decode_moments": [1, 1, 1, 1, 1, 1]}
    m = merge_ranks([a, b])
    assert m["total_prefill_uncached_tokens"] == 4000 and m["decode_moments"] == [2, 3, 4, 5, 6, 7]
    assert prefill_tokens_per_s(m) == pytest.approx(2000.0)
