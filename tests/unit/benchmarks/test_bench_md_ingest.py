"""The MD-ingest benchmark's decode metrics (pure)."""

import pytest

from benchmarks.bench_md_ingest import decode_metrics


def test_a_stall_during_a_landing_shows_as_gap_and_lower_rate():
    events = [(i * 0.01, i) for i in range(100)]  # 100 tok/s
    events += [(1.5, 101)] + [(1.5 + i * 0.01, 101 + i) for i in range(1, 50)]  # a 0.51 s stall at 1.5 s
    m = decode_metrics(events, [(1.2, 1.6, 0)], baseline_end=0.5)
    assert m["baseline_tok_s"] == pytest.approx(100)
    assert m["baseline_max_gap_ms"] == pytest.approx(10)
    assert m["landing_max_gap_ms"] == pytest.approx(510)
    assert m["landing_tok_s"] < 25


def test_stream_that_misses_the_landings_is_an_error():
    with pytest.raises(RuntimeError, match="raise --decode-tokens"):
        decode_metrics([(i * 0.01, i) for i in range(10)], [(5.0, 6.0, 0)], baseline_end=0.05)
