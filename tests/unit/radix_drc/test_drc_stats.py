import numpy as np
import pytest

from sglang_pdd.radix_drc.stats import DrcStats


def test_empty():
    s = DrcStats()
    assert s.hit_rate == 0.0
    assert s.request_hit_rate_mean == 0.0
    assert s.bytes_saved == 0 and s.bytes_received == 0
    assert s.bytes_saved_fraction == 0.0
    assert set(s.as_dict().values()) == {0}


@pytest.mark.parametrize(
    "lookups, hit_rate, request_mean",
    [
        ([(100, 0)], 0.0, 0.0),
        ([(100, 100)], 1.0, 1.0),
        ([(100, 50)], 0.5, 0.5),
        # Token-weighted vs per-request: one long fully-cached prompt, one short miss.
        ([(1000, 1000), (10, 0)], 1000 / 1010, 0.5),
        ([(1000, 0), (10, 10)], 10 / 1010, 0.5),
        ([(4, 1), (4, 2), (4, 3)], 6 / 12, 0.5),
        ([(3, 1), (1, 1)], 2 / 4, (1 / 3 + 1) / 2),
    ],
)
def test_hit_rates(lookups, hit_rate, request_mean):
    s = DrcStats()
    for prompt, cached in lookups:
        s.record_lookup(prompt, cached)
    assert s.lookups == len(lookups)
    assert s.prompt_tokens == sum(p for p, _ in lookups)
    assert s.cached_tokens == sum(c for _, c in lookups)
    assert s.hit_rate == pytest.approx(hit_rate)
    assert s.request_hit_rate_mean == pytest.approx(request_mean)


@pytest.mark.parametrize(
    "prompt, cached, error",
    [
        (10, 11, ValueError),   # sglang issue #25972: cached > prompt
        (0, 1, ValueError),
        (-1, 0, ValueError),
        (10, -1, ValueError),
        (0, 0, ValueError),     # no request has an empty prompt; its ratio is undefined
        (10.0, 5, TypeError),
        (10, True, TypeError),
        ("10", 5, TypeError),
    ],
)
def test_record_lookup_rejects_bad_input_and_records_nothing(prompt, cached, error):
    s = DrcStats()
    s.record_lookup(8, 4)
    before = s.as_dict()
    with pytest.raises(error):
        s.record_lookup(prompt, cached)
    assert s.as_dict() == before


def test_numpy_ints_accepted():
    s = DrcStats()
    s.record_lookup(np.int64(10), np.int32(5))
    s.record_ingest(np.int64(5), np.int64(50), np.int64(5), np.int64(10))
    assert s.hit_rate == 0.5 and s.bytes_saved == 50


@pytest.mark.parametrize(
    "ingests, received, skipped, bytes_received, bytes_saved",
    [
        ([(100, 100 * 46_000, 0, 46_000)], 100, 0, 4_600_000, 0),
        ([(10, 10 * 46_000, 990, 46_000)], 10, 990, 460_000, 990 * 46_000),
        # Bytes received are as reported (may include framing), not recomputed.
        ([(10, 12_345, 5, 1000), (0, 0, 20, 1000)], 10, 25, 12_345, 25_000),
        ([(0, 0, 0, 1)], 0, 0, 0, 0),
    ],
)
def test_record_ingest(ingests, received, skipped, bytes_received, bytes_saved):
    s = DrcStats()
    for args in ingests:
        s.record_ingest(*args)
    assert s.ingests == len(ingests)
    assert s.tokens_received == received
    assert s.tokens_skipped == skipped
    assert s.bytes_received == bytes_received
    assert s.bytes_saved == bytes_saved
    total = bytes_saved + bytes_received
    assert s.bytes_saved_fraction == pytest.approx(bytes_saved / total if total else 0.0)


@pytest.mark.parametrize(
    "args",
    [
        (-1, 0, 0, 1),
        (0, -1, 0, 1),
        (0, 0, -1, 1),
        (0, 0, 0, -1),
        (0, 0, 0, 0),     # bytes_per_token must be > 0
        (1, 1.5, 0, 1),
    ],
)
def test_record_ingest_rejects_bad_input_and_records_nothing(args):
    s = DrcStats()
    s.record_ingest(1, 10, 1, 10)
    before = s.as_dict()
    with pytest.raises((ValueError, TypeError)):
        s.record_ingest(*args)
    assert s.as_dict() == before


def test_record_eviction():
    s = DrcStats()
    for t in (512, 1024, 0):
        s.record_eviction(t)
    assert s.evictions == 3 and s.evicted_tokens == 1536
    with pytest.raises(ValueError):
        s.record_eviction(-1)
    assert s.evictions == 3 and s.evicted_tokens == 1536


def test_as_dict():
    s = DrcStats()
    s.record_lookup(1000, 750)
    s.record_lookup(1000, 250)
    s.record_ingest(1250, 1250 * 100, 750, 100)
    s.record_eviction(64)
    assert s.as_dict() == {
        "lookups": 2,
        "prompt_tokens": 2000,
        "cached_tokens": 1000,
        "hit_rate": 0.5,
        "request_hit_rate_mean": 0.5,
        "ingests": 1,
        "tokens_received": 1250,
        "tokens_skipped": 750,
        "bytes_received": 125_000,
        "bytes_saved": 75_000,
        "bytes_saved_fraction": 0.375,
        "evictions": 1,
        "evicted_tokens": 64,
    }
