"""MD placement by what a move costs (router/backends/placement.py's pick_main): a turn leaves the MD
holding its prefix only when that MD's excess flows cost more time than re-sending the prefix
over the WAN, both in seconds."""

import math

import pytest

from sglang_pdd.router.backends.placement import (EXPECTED_OUTPUT_TOKENS_DEFAULT, InstanceLoad, MdMoveCost,
                                         md_affinity_excess_flows, md_resend_s, pick_main)

L = InstanceLoad
# 1 GB/s link, 1 MB of KV per token: 1 ms per token re-sent; MD's steps grow 1 ms per flow
COST = MdMoveCost(kv_bytes_per_token=1e6, wan_bytes_per_s=1e9, flow_step_s=1e-3)


def test_resend_time_is_the_prefix_at_the_links_fair_share():
    assert md_resend_s(1000, 0, COST) == pytest.approx(1.0)
    assert md_resend_s(1000, 3, COST) == pytest.approx(4.0)  # a quarter of the link beside 3 others
    assert md_resend_s(0, 5, COST) == 0.0


@pytest.mark.parametrize("matched, out, transfers, bound", [
    (1000, 100, 0, 10.0),  # 1 s to re-send vs 0.1 s per excess flow
    (1000, 1000, 0, 1.0),  # a long answer: each excess flow costs it 1 s
    (1000, 100, 1, 20.0),  # half the link: re-sending takes twice as long
    (0, 100, 0, 0.0),  # nothing held: nothing to lose by moving
])
def test_the_bound_in_flows_is_resend_time_over_one_flows_cost(matched, out, transfers, bound):
    assert md_affinity_excess_flows(matched, out, transfers, COST) == pytest.approx(bound)


@pytest.mark.parametrize("loads, owner, expect", [
    ([L("a", 9), L("b", 0)], "a", "a"),  # 9 excess flows x 0.1 s < 1 s: stay
    ([L("a", 11), L("b", 0)], "a", "b"),  # 11 x 0.1 s > 1 s: move
    ([L("a", 5), L("b", 3)], None, "b"),  # nobody holds it: least loaded
    ([L("a", 3), L("b", 3)], None, "a"),  # tie: first
])
def test_pick_main_stays_until_the_queue_costs_more_than_the_resend(loads, owner, expect):
    assert pick_main(loads, owner, 1000, 100, 0, COST) == expect


def test_the_same_excess_keeps_a_long_prefix_and_moves_a_short_one():
    loads = [L("a", 6), L("b", 0)]
    assert pick_main(loads, "a", 1000, 100, 0, COST) == "a"  # 1 s to re-send, 0.6 s of queue
    assert pick_main(loads, "a", 100, 100, 0, COST) == "b"  # 0.1 s to re-send


def test_a_busy_link_makes_a_move_dearer_and_an_unknown_output_takes_the_default():
    loads = [L("a", 15), L("b", 0)]
    assert pick_main(loads, "a", 1000, 100, 0, COST) == "b"
    assert pick_main(loads, "a", 1000, 100, 1, COST) == "a"  # re-sending at half the link: 2 s
    bound = md_affinity_excess_flows(1000, EXPECTED_OUTPUT_TOKENS_DEFAULT, 0, COST)
    assert pick_main([L("a", math.floor(bound)), L("b", 0)], "a", 1000, None, 0, COST) == "a"
    assert pick_main([L("a", math.floor(bound) + 1), L("b", 0)], "a", 1000, None, 0, COST) == "b"


def test_no_step_growth_never_moves_and_bad_costs_are_refused():
    free = MdMoveCost(kv_bytes_per_token=1e6, wan_bytes_per_s=1e9, flow_step_s=0.0)
    assert md_affinity_excess_flows(1000, 100, 0, free) == math.inf
    assert pick_main([L("a", 1000), L("b", 0)], "a", 1000, 100, 0, free) == "a"
    for bad in (dict(wan_bytes_per_s=0), dict(flow_step_s=-1), dict(kv_bytes_per_token=-1)):
        with pytest.raises(ValueError):
            MdMoveCost(**{"kv_bytes_per_token": 1, "wan_bytes_per_s": 1, **bad})


def test_pools_weigh_the_owners_measured_step_growth_and_kv_size():
    """router/backends/pools.py places MD with pick_main: the owner MD's step growth as measured
    (router/backends/loads.py fills md_flow_step_s) and its KV size as it reported it."""
    from sglang_pdd.router.backends.servers import MainBackend, PrefillBackend
    from sglang_pdd.router.backends.pools import Pools
    from sglang_pdd.protocol import KvSize
    mds = [MainBackend(f"http://md{i}:1", f"http://md{i}:2", f"md{i}:3") for i in range(2)]
    pools = Pools([PrefillBackend("http://p:1", 8998)], ["http://rld:1"], mds, md_move=COST)
    prompt = list(range(1000, 1000 + 1000))
    pools.prefixes.record(mds[0].url, prompt)
    pools.md_inflight[mds[0].url] = 6  # 6 x 100 steps x 1 ms = 0.6 s < 1 s to re-send 1000 tokens
    assert pools.pick(prompt, now=0.0, max_new_tokens=100)[2] is mds[0]
    pools.md_flow_step_s[mds[0].url] = 2e-3  # measured: 1.2 s of longer steps
    assert pools.pick(prompt, now=0.0, max_new_tokens=100)[2] is mds[1]
    pools.learn_md_kv_size(mds[0].url, KvSize(2_000_000))  # MD's real KV: 2 s to re-send
    assert pools.pick(prompt, now=0.0, max_new_tokens=100)[2] is mds[0]
