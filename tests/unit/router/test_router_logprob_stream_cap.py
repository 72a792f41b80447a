"""--max-logprob-stream-entries: a return_logprob request whose cumulative stream would carry
more logprob entries in all than the cap is refused with a 400 naming the flag, before any
backend sees it; the default admits the long streams the product promises (1,000 tokens with
20 top logprobs)."""

from __future__ import annotations

import pytest

from sglang_pdd.router.front.validate import ApiError, LogprobLimits, stream_logprob_entries
from tests.support.router_front import front, run


def test_entries_count_every_position_of_every_cumulative_event():
    # 3 events of 1, 2, 3 positions, each 1 + 2 top + 1 token-id entries
    assert stream_logprob_entries(3, 10, None, 2, [7]) == 4 * (1 + 2 + 3)
    # the scored prompt (from logprob_start_len on) is in every event too
    assert stream_logprob_entries(3, 10, 4, 0, None) == 1 * (6 + 3 * 6)
    assert stream_logprob_entries(3, 10, -1, 0, None) == 6  # -1: no prompt position scored
    assert stream_logprob_entries(0, 10, 0, 20, None) == 0


@pytest.mark.parametrize("max_new,top,admitted", [
    (1000, 20, True),  # the product's long stream (tests/test_e2e_long_stream.py runs 500 x 40)
    (500, 40, True),
    (4000, 0, True),  # plain return_logprob: 8 M entries
    (2000, 20, False),  # 42 M entries (~1 GB of stream)
    (32768, 64, False),
])
def test_default_cap_admits_the_long_streams_and_refuses_quadratic_ones(max_new, top, admitted):
    limits = LogprobLimits()
    if admitted:
        limits.check_stream(max_new, 32, None, top, None)
    else:
        with pytest.raises(ApiError) as e:
            limits.check_stream(max_new, 32, None, top, None)
        assert e.value.status == 400 and "--max-logprob-stream-entries" in e.value.message


def test_router_refuses_over_the_cap_with_400_and_serves_under_it(router_sglang_state):
    limits = LogprobLimits(max_stream_logprob_entries=1000)

    async def main():
        async with front(router_sglang_state, logprob_limits=limits) as (base, client, fakes, _):
            over = {"input_ids": [11, 22, 33], "return_logprob": True, "top_logprobs_num": 2,
                    "sampling_params": {"max_new_tokens": 32}}  # 3 x 528 = 1584 entries
            for stream in (False, True):
                async with client.post(f"{base}/generate", json={**over, "stream": stream}) as r:
                    assert r.status == 400, await r.text()
                    assert "--max-logprob-stream-entries" in (await r.json())["message"]
            async with client.post(f"{base}/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 32, "logprobs": True,
                    "top_logprobs": 2}) as r:
                assert r.status == 400, await r.text()
                assert "--max-logprob-stream-entries" in await r.text()
            assert not fakes.records("rld", "generate")  # nothing reached a backend
            under = {**over, "sampling_params": {"max_new_tokens": 16}}  # 3 x 136 = 408 entries
            async with client.post(f"{base}/generate", json=under) as r:
                assert r.status == 200, await r.text()
                assert len((await r.json())["meta_info"]["output_top_logprobs"]) == 16
            async with client.post(f"{base}/generate", json={**over, "return_logprob": False}) as r:
                assert r.status == 200, await r.text()  # no logprobs asked: nothing to count
    run(main())
