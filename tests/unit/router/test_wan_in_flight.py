"""What of the WAN's traffic a new transfer waits behind: the router's and the simulator's one
count (router/backends/wan_in_flight.py) and the path rule's use of it."""

import pytest

from sglang_pdd.router.policy import Path, PathPolicyConfig, decide_path
from sglang_pdd.router.backends.wan_in_flight import WanInFlight, competing_wan_bytes

GB = 10**9


def test_each_waited_transfer_counts_up_to_the_new_ones_size():
    assert competing_wan_bytes([], 100) == 0
    assert competing_wan_bytes([30, 70], 100) == 100  # both smaller: all of their bytes
    assert competing_wan_bytes([10 * GB], 100) == 100  # larger: as much as ours, then ours has landed
    assert competing_wan_bytes([10 * GB, 50, 10 * GB], 100) == 250
    assert competing_wan_bytes([5, 5], 0) == 0


def test_the_count_follows_sending_and_settling():
    w = WanInFlight()
    w.sending("a", 10 * GB)
    w.sending("b", 40)
    w.sending("b", 60)  # sent again: replaces, not adds
    assert (w.total, w.transfers, w.competing(100)) == (10 * GB + 60, 2, 160)
    w.settled("a")  # landed, failed, or kept for MD's cache only: behind every waited transfer
    w.settled("a")
    assert (w.total, w.transfers, w.competing(100)) == (60, 1, 60)


# 20 Gbps, DeepSeek-V3's fp8 KV: a turn with a 3.4k-token suffix (136 MB, ~55 ms on the link)
CFG = PathPolicyConfig(wan_gbps=20.0, wan_rtt_ms=40.0, kv_bytes_per_token=40_016, ttft_slo_ms=5000.0,
                       page_size=1, first_token_via_rld=True, gap_slo_ms=1000.0)


def _decide(waited):
    return decide_path(34_400, 31_000, 1000, 10, 256, CFG, p_prefill_tokens=3_400, wan_waited_sizes=waited)


def test_a_small_suffix_beside_cold_transfers_goes_p_md():
    """Two cold turns' whole contexts (2.6 GB each) are in flight: the old estimate counted all
    5.2 GB as ahead of the suffix (2.1 s on the link) and relayed it; they share the link with
    it, so it lands after ~3x its own bytes."""
    cold = [65_000 * 40_016] * 2
    d = _decide(cold)
    assert d.path is Path.P_MD, d.reason
    own = 3_400 * 40_016
    assert d.est_wan_transfer_ms == pytest.approx(_decide([]).est_wan_transfer_ms + 2 * own * 8 / 20e9 * 1e3)


def test_many_waited_transfers_still_relay():
    """Forty waited transfers at least as large as the suffix: the link's share left is a 40th."""
    d = _decide([3_400 * 40_016] * 40)
    assert d.path is Path.P_RLD_MD, d.reason
