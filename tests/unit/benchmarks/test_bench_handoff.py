"""Pure helpers of benchmarks/bench_handoff.py (statistics, link scaling, payload sizes)."""

import json

import pytest

from benchmarks import bench_handoff as bh


def test_summarize_known_values():
    s = bh.summarize([1.0, 2.0, 3.0, 4.0, None])
    assert s["n"] == 4 and s["mean"] == 2.5 and s["p50"] == 2.5 and s["max"] == 4.0 and s["min"] == 1.0
    assert s["p99"] == pytest.approx(3.97)  # linear interpolation between the two largest
    assert s["std"] == pytest.approx(1.2909944, rel=1e-6)  # sample std (ddof=1)


def test_summarize_degenerate():
    assert bh.summarize([]) == {"n": 0}
    assert bh.summarize([None]) == {"n": 0}
    one = bh.summarize([0.5])
    assert one["std"] == 0.0 and one["p50"] == one["p99"] == one["max"] == 0.5


def test_scaled_rate_keeps_kv_transfer_time():
    rate = bh.scaled_rate_gbps(1.0, 512, 46_000)
    tokens = 1000
    assert tokens * 512 * 8 / (rate * 1e9) == pytest.approx(tokens * 46_000 * 8 / 1e9)
    with pytest.raises(ValueError):
        bh.scaled_rate_gbps(1.0, 0)


def test_ideal_transfer_time():
    assert bh.ideal_transfer_s(4_600_000, 1.0, 20.0) == pytest.approx(0.020 + 0.0368)


def test_handoff_message_is_the_routers_body_and_sizes():
    from sglang_pdd.router.flow.bodies import handoff_body

    body = bh.handoff_message([5, 6, 7], "r-m", 9, {"temperature": 0.0})
    # the router's max_new_tokens is the whole budget: 3 eager tokens + 9 more
    assert body == handoff_body([5, 6, 7], "r-m", {"temperature": 0.0, "max_new_tokens": 12}).to_json()
    sizes = bh.payload_sizes(body)
    assert sizes["json"] == len(json.dumps(body))
    assert sizes["json_compact"] < sizes["json"]
    assert 0 < sizes["msgpack"] < sizes["json_compact"]


def test_parse_csv_floats():
    assert bh.parse_csv_floats("5, 50,200") == [5.0, 50.0, 200.0]
    with pytest.raises(ValueError):
        bh.parse_csv_floats(" , ")
