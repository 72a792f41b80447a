import dataclasses

import pytest

from sglang_pdd.protocol import KvSize
from sglang_pdd.router.backends.placement import InstanceLoad, pick_instance
from sglang_pdd.router.policy import (
    Path,
    PathMode,
    PathPolicyConfig,
    RequestFacts,
    choose_path,
    decide_path,
    estimate_wan_transfer_ms,
    uncached_tokens,
)

# 10 Gbps, 0 RTT, 1250 bytes/token -> 1 ms per 1000 tokens; budget 100 ms = 100k tokens.
CFG = PathPolicyConfig(wan_gbps=10.0, wan_rtt_ms=0.0, kv_bytes_per_token=1250,
                       max_wan_transfer_ms=100.0, page_size=512,
                       outlier_min_input_tokens=32_768, outlier_max_output_tokens=16)


@pytest.mark.parametrize(
    "facts, path, uncached",
    [
        # Small uncached suffix fits the WAN budget -> straight to MD.
        (RequestFacts(input_tokens=50_000), Path.P_MD, 50_000),
        # Just over the budget -> hide the WAN behind RLD.
        (RequestFacts(input_tokens=100_001), Path.P_RLD_MD, 100_001),
        # Same long input but MD's DRC holds most of it -> tiny transfer, P->MD.
        (RequestFacts(input_tokens=150_000, md_cached_tokens=140_000), Path.P_MD, 150_000 - 139_776),
        # P's cache does not change what crosses the WAN.
        (RequestFacts(input_tokens=150_000, p_cached_tokens=149_000), Path.P_RLD_MD, 150_000),
        # Outlier: long input, tiny expected output -> finish on RLD.
        (RequestFacts(input_tokens=40_000, expected_output_tokens=4), Path.P_RLD_ONLY, 40_000),
        # Output just above the outlier bound -> normal choice.
        (RequestFacts(input_tokens=40_000, expected_output_tokens=17), Path.P_MD, 40_000),
        # Unknown output never triggers the outlier filter.
        (RequestFacts(input_tokens=200_000), Path.P_RLD_MD, 200_000),
        # Input below the outlier bound with tiny output -> normal choice.
        (RequestFacts(input_tokens=32_767, expected_output_tokens=1), Path.P_MD, 32_767),
        # Competing traffic on the link pushes an otherwise fitting transfer over budget.
        (RequestFacts(input_tokens=50_000, wan_competing_bytes=80_000 * 1250), Path.P_RLD_MD, 50_000),
    ],
)
def test_choose_path_table(facts, path, uncached):
    d = choose_path(facts, CFG)
    assert d.path is path, d.reason
    assert d.uncached_tokens == uncached
    assert d.reason


def test_outlier_filter_can_be_disabled():
    cfg = PathPolicyConfig(**{**CFG.__dict__, "enable_outlier_filter": False})
    d = choose_path(RequestFacts(input_tokens=40_000, expected_output_tokens=4), cfg)
    assert d.path is Path.P_MD


def test_rld_only_only_through_outlier_filter():
    cfg = PathPolicyConfig(**{**CFG.__dict__, "enable_outlier_filter": False})
    for n in (1, 511, 512, 10_000, 100_000, 1_000_000):
        for cached in (0, n // 2, n):
            for out in (None, 1, 10_000):
                d = choose_path(RequestFacts(n, md_cached_tokens=cached, expected_output_tokens=out), cfg)
                assert d.path is not Path.P_RLD_ONLY


@pytest.mark.parametrize("inp, cached, expect", [(1000, 0, 1000), (1000, 511, 1000), (1000, 512, 488),
                                                  (1024, 1024, 0), (1000, 5000, 488)])
def test_uncached_counts_whole_pages(inp, cached, expect):
    assert uncached_tokens(RequestFacts(inp, md_cached_tokens=cached), CFG) == expect


def test_transfer_estimate_scales_with_bytes_and_rtt():
    cfg = PathPolicyConfig(wan_gbps=8.0, wan_rtt_ms=40.0, kv_bytes_per_token=1000)
    # 1000 tokens * 1000 B * 8 bit / 8e9 = 1 ms, plus one-way latency 20 ms
    assert estimate_wan_transfer_ms(1000, cfg) == pytest.approx(21.0)
    assert estimate_wan_transfer_ms(0, cfg) == pytest.approx(20.0)
    assert estimate_wan_transfer_ms(1000, cfg, competing_bytes=1_000_000) == pytest.approx(22.0)


def test_a_fixed_budget_replaces_the_load_aware_one():
    from sglang_pdd.router.policy import p_md_wan_budget_ms
    busy, idle = RequestFacts(1000, rld_utilisation=1.0), RequestFacts(1000, rld_utilisation=0.0)
    fixed = PathPolicyConfig(ttft_slo_ms=2000, max_wan_transfer_ms=123)
    assert p_md_wan_budget_ms(busy, fixed) == p_md_wan_budget_ms(idle, fixed) == 123
    aware = PathPolicyConfig(ttft_slo_ms=2000)
    assert p_md_wan_budget_ms(busy, aware) == pytest.approx(1800) and p_md_wan_budget_ms(idle, aware) == pytest.approx(900)


@pytest.mark.parametrize("bad", [dict(wan_gbps=0), dict(page_size=0)])
def test_config_validation(bad):
    with pytest.raises(ValueError):
        PathPolicyConfig(**bad)


def test_facts_validation():
    with pytest.raises(ValueError):
        RequestFacts(input_tokens=0)
    with pytest.raises(ValueError):
        RequestFacts(input_tokens=10, md_cached_tokens=-1)


L = InstanceLoad


@pytest.mark.parametrize(
    "loads, affinity, expect",
    [
        ([L("a", 0.5), L("b", 0.1)], None, "b"),
        ([L("a", 0.3), L("b", 0.3)], None, "a"),  # tie -> first
        ([L("a", 0.3), L("b", 0.1)], "a", "a"),  # within the bound -> keep the session's MD
        ([L("a", 0.36), L("b", 0.1)], "a", "b"),  # beyond the bound -> move
        ([L("a", 0.3), L("b", 0.1)], "zz", "b"),  # unknown affinity -> least loaded
    ],
)
def test_pick_instance(loads, affinity, expect):
    assert pick_instance(loads, affinity, max_affinity_excess=0.25) == expect


def test_pick_instance_max_load_overrides_affinity():
    loads = [L("a", 0.95), L("b", 0.9)]
    assert pick_instance(loads, "a", max_affinity_excess=0.25) == "a"
    assert pick_instance(loads, "a", max_affinity_excess=0.25, max_load=0.9) == "b"
    with pytest.raises(ValueError):
        pick_instance([], None)



# ---- the WAN time P->MD makes the user wait, and the load-aware budget ----------------

def test_p_md_pays_each_one_way_trip_of_its_message_sequence():
    from sglang_pdd.router.policy import estimate_p_md_wan_ms
    cfg = PathPolicyConfig(wan_gbps=8.0, wan_rtt_ms=40.0, kv_bytes_per_token=1000)
    # registration there and back (in TTFT) + KV there + MD's first token back: 4 x 20 ms,
    # plus 1 ms of serialisation. The old estimate counted one 20 ms trip.
    assert estimate_p_md_wan_ms(1000, cfg) == pytest.approx(81.0)
    no_reg = PathPolicyConfig(wan_gbps=8.0, wan_rtt_ms=40.0, kv_bytes_per_token=1000, p_md_registers_first=False)
    assert estimate_p_md_wan_ms(1000, no_reg) == pytest.approx(41.0)
    d = choose_path(RequestFacts(input_tokens=1000), cfg)
    assert d.est_wan_transfer_ms == pytest.approx(81.0)


def test_latency_alone_can_push_a_small_transfer_over_a_fixed_budget():
    # 70 ms budget: one trip (21 ms) fitted it, the real four trips (81 ms) do not.
    cfg = PathPolicyConfig(wan_gbps=8.0, wan_rtt_ms=40.0, kv_bytes_per_token=1000, max_wan_transfer_ms=70.0)
    assert choose_path(RequestFacts(input_tokens=1000), cfg).path is Path.P_RLD_MD


# The relay-first mode: the budget moves from 0 (RLD idle) to the whole slack (RLD busy).
LOAD_CFG = PathPolicyConfig(wan_gbps=10.0, wan_rtt_ms=40.0, kv_bytes_per_token=1250, ttft_slo_ms=2000.0,
                            rld_idle_at=0.5, rld_busy_at=0.9, ttft_safety_fraction=0.1,
                            mode=PathMode.RELAY_FIRST)
FIT_CFG = dataclasses.replace(LOAD_CFG, mode=PathMode.FIT, p_md_share_idle=0.5)


def test_relay_first_idle_rld_keeps_requests_off_the_wan():
    # A tiny transfer (81 ms) would fit a 500 ms budget, but RLD idles: in relay-first
    # mode the user never waits for the WAN while RLD can hide it.
    small = dict(input_tokens=1000, p_prefill_ms=100.0)
    fixed = dataclasses.replace(LOAD_CFG, max_wan_transfer_ms=500.0)
    assert choose_path(RequestFacts(**small), fixed).path is Path.P_MD  # --max-wan-transfer-ms: RLD's load aside
    for util in (0.0, 0.3, 0.5):
        d = choose_path(RequestFacts(**small, rld_utilisation=util), LOAD_CFG)
        assert d.path is Path.P_RLD_MD, d.reason
        assert d.budget_ms == 0.0


def test_fit_idle_rld_leaves_high_hit_requests_on_p_md():
    # The same tiny transfer in fit mode: an idle RLD does not pull it off P->MD.
    for util in (0.0, 0.3, 0.5):
        d = choose_path(RequestFacts(input_tokens=1000, p_prefill_ms=100.0, rld_utilisation=util), FIT_CFG)
        assert d.path is Path.P_MD, d.reason
        assert d.budget_ms == pytest.approx(0.5 * (1800.0 - 100.0))


def test_fit_idle_rld_still_takes_a_long_uncached_suffix():
    # 2M uncached tokens: 2 s on this link, beyond half the slack (900 ms) -> RLD hides it.
    d = choose_path(RequestFacts(input_tokens=2_000_000, rld_utilisation=0.0), FIT_CFG)
    assert d.path is Path.P_RLD_MD, d.reason
    # MD's cache holds all but a page: the suffix crosses in no time -> P->MD.
    hit = choose_path(RequestFacts(input_tokens=2_000_000, md_cached_tokens=1_999_872, rld_utilisation=0.0),
                      FIT_CFG)
    assert hit.path is Path.P_MD, hit.reason


@pytest.mark.parametrize("util, share", [(0.0, 0.5), (0.5, 0.5), (0.7, 0.75), (0.9, 1.0), (3.0, 1.0)])
def test_fit_share_rises_with_rlds_load(util, share):
    from sglang_pdd.router.policy import p_md_share
    assert p_md_share(util, FIT_CFG) == pytest.approx(share)
    # relay-first at the same load: 0 up to idle, then the same ramp from 0
    assert p_md_share(util, LOAD_CFG) == pytest.approx(min(1.0, max(0.0, (util - 0.5) / 0.4)))


def test_fit_counts_ps_queue_and_prefill_from_its_tokens():
    # The router knows P's prefill tokens in flight and this request's own; at a known P speed
    # they become time that eats the budget: 1000 tokens -> 81 ms of WAN wait.
    cfg = dataclasses.replace(FIT_CFG, p_prefill_tokens_per_s=10_000.0)
    quiet = decide_path(1000, 0, None, 0, 16, cfg, p_queued_tokens=0, p_prefill_tokens=1000)  # 100 ms
    assert quiet.path is Path.P_MD and quiet.budget_ms == pytest.approx(0.5 * 1700.0)
    queued = decide_path(1000, 0, None, 0, 16, cfg, p_queued_tokens=16_000, p_prefill_tokens=1000)  # +1600 ms
    assert queued.path is Path.P_RLD_MD and queued.budget_ms == pytest.approx(50.0)
    # P's speed not given: the policy's default, never 0 (P's queue always costs time)
    default = decide_path(1000, 0, None, 0, 16, FIT_CFG, p_queued_tokens=16_000, p_prefill_tokens=1000)
    assert PathPolicyConfig().p_prefill_tokens_per_s > 0
    assert default.budget_ms < 0.5 * 1800.0


def test_busy_rld_sends_whatever_meets_the_slo_straight_to_md():
    # RLD full: the budget is the whole TTFT slack (1800 - queue - prefill), far beyond 25%.
    facts = RequestFacts(input_tokens=1_000_000, p_prefill_ms=300.0, rld_utilisation=1.0)  # 1000 ms + 80 ms
    d = choose_path(facts, LOAD_CFG)
    assert d.path is Path.P_MD, d.reason
    assert d.budget_ms == pytest.approx(1500.0)
    # Half-way between idle and busy: half the slack.
    half = choose_path(RequestFacts(input_tokens=1000, p_prefill_ms=300.0, rld_utilisation=0.7), LOAD_CFG)
    assert half.budget_ms == pytest.approx(750.0)


def test_p_queue_eats_the_wan_budget():
    base = dict(input_tokens=1_000_000, p_prefill_ms=300.0, rld_utilisation=1.0)
    assert choose_path(RequestFacts(**base, p_queue_ms=400.0), LOAD_CFG).path is Path.P_MD
    d = choose_path(RequestFacts(**base, p_queue_ms=600.0), LOAD_CFG)  # 1080 > 900
    assert d.path is Path.P_RLD_MD and d.budget_ms == pytest.approx(900.0)
    # P already past the SLO: no budget at all.
    assert choose_path(RequestFacts(**base, p_queue_ms=5000.0), LOAD_CFG).budget_ms == 0.0


def test_explicit_max_wan_transfer_overrides_the_load_budget():
    cfg = PathPolicyConfig(**{**LOAD_CFG.__dict__, "max_wan_transfer_ms": 1e9})
    assert choose_path(RequestFacts(input_tokens=1000, rld_utilisation=0.0), cfg).path is Path.P_MD


@pytest.mark.parametrize("bad", [dict(rld_utilisation=-0.1), dict(p_queue_ms=-1.0), dict(p_prefill_ms=-1.0)])
def test_load_facts_validation(bad):
    with pytest.raises(ValueError):
        RequestFacts(input_tokens=10, **bad)


@pytest.mark.parametrize("bad", [dict(rld_idle_at=0.9, rld_busy_at=0.9), dict(ttft_safety_fraction=1.0),
                                 dict(p_md_share_idle=1.5), dict(p_prefill_tokens_per_s=0.0), dict(mode="nope")])
def test_load_config_validation(bad):
    with pytest.raises(ValueError):
        PathPolicyConfig(**bad)


# ---- the gap P->MD creates, P's prefill with its context term, one page size ----------

GAP_CFG = dataclasses.replace(FIT_CFG, first_token_via_rld=True, gap_slo_ms=1000.0)


def test_first_token_through_rld_caps_the_wan_wait_by_the_gap_slo():
    # P->MD's first token comes through RLD: the KV's wait falls in the gap before MD's first
    # token, so the budget (the TTFT slack's share, the registration's 40 ms off it too) is
    # capped by the gap SLO less the safety share (900 ms).
    big = RequestFacts(input_tokens=1_000_000, p_prefill_ms=100.0, rld_utilisation=0.0)  # 1000 + 40 ms
    d = choose_path(big, GAP_CFG)
    assert d.path is Path.P_RLD_MD and d.budget_ms == pytest.approx(0.5 * (1800.0 - 100.0 - 40.0))
    assert d.est_wan_transfer_ms == pytest.approx(1040.0)  # the registration is in TTFT, not in the gap
    small = RequestFacts(input_tokens=300_000, p_prefill_ms=100.0, rld_utilisation=0.0)  # 300 + 40 ms
    assert choose_path(small, GAP_CFG).path is Path.P_MD
    # RLD busy: the whole TTFT slack (1660 ms) would let a 1 s wait into the gap; the cap does not
    busy = RequestFacts(input_tokens=1_000_000, p_prefill_ms=100.0, rld_utilisation=1.0)
    capped = choose_path(busy, GAP_CFG)
    assert capped.path is Path.P_RLD_MD and capped.budget_ms == pytest.approx(900.0)
    uncapped = choose_path(busy, FIT_CFG)  # the first token after the WAN: the TTFT rule
    assert uncapped.path is Path.P_MD and uncapped.budget_ms == pytest.approx(1700.0)
    # no gap SLO: the TTFT rule, whatever the first token's way
    assert dataclasses.replace(GAP_CFG, gap_slo_ms=None).budgets_the_gap is False
    assert dataclasses.replace(GAP_CFG, gap_slo_ms=300.0).budgets_the_gap
    assert choose_path(small, dataclasses.replace(GAP_CFG, gap_slo_ms=300.0)).path is Path.P_RLD_MD  # 340 > 270


def test_gap_budget_is_none_when_ps_queue_prefill_and_registration_use_up_the_ttft():
    # P's queue + prefill + the registration (40 ms) beyond the TTFT slack (1800 ms): P->MD would
    # only add its registration to a first token already late.
    late = RequestFacts(input_tokens=1000, p_queue_ms=1700.0, p_prefill_ms=80.0, rld_utilisation=1.0)
    assert choose_path(late, GAP_CFG).budget_ms == 0.0
    ok = RequestFacts(input_tokens=1000, p_queue_ms=1700.0, p_prefill_ms=50.0, rld_utilisation=1.0)
    assert choose_path(ok, GAP_CFG).budget_ms == pytest.approx(10.0)


def test_ps_prefill_counts_its_context_term():
    from sglang_pdd.router.policy import prefill_ms
    cfg = dataclasses.replace(FIT_CFG, p_prefill_tokens_per_s=20_000.0, p_prefill_s_per_token_ctx=2e-9)
    # 3.4k new tokens after a 31k prefix: 170 ms linear + 3400 x (31k + 1.7k) x 2 ns = 222 ms more
    assert prefill_ms(3_400, 31_000, cfg) == pytest.approx(170.0 + 3400 * 32_700 * 2e-6)
    assert prefill_ms(3_400, 31_000, dataclasses.replace(cfg, p_prefill_s_per_token_ctx=0.0)) == pytest.approx(170.0)
    # decide_path gives the request's own prefill its context: the prompt less its prefill tokens
    d = decide_path(34_400, 0, None, 0, 16, cfg, p_prefill_tokens=3_400)
    lin = decide_path(34_400, 0, None, 0, 16, dataclasses.replace(cfg, p_prefill_s_per_token_ctx=0.0),
                      p_prefill_tokens=3_400)
    assert lin.budget_ms - d.budget_ms == pytest.approx(0.5 * 3400 * 32_700 * 2e-6)


def test_policy_and_router_cli_share_one_page_size_default():
    from sglang_pdd.router.front.cli import flow_config, parse_args
    args = parse_args(["--prefill", "http://p:1,8998", "--relay", "http://r:1", "--tokenizer-path", "x"])
    assert args.page_size == PathPolicyConfig().page_size == 1
    path = flow_config(args).path
    assert path.page_size == 1 and path.budgets_the_gap and path.gap_slo_ms == 1000.0
    assert path.p_prefill_tokens_per_s == PathPolicyConfig().p_prefill_tokens_per_s > 0  # never 0


def test_the_wan_budget_has_one_name_and_one_rule():
    from sglang_pdd.router import policy
    assert not hasattr(PathPolicyConfig, "wan_budget_ms") and not hasattr(policy, "wan_budget_ms")
    assert not hasattr(PathPolicyConfig, "fixed_wan_budget_ms")  # one budget: load-aware, or --max-wan-transfer-ms
    assert policy.p_md_wan_budget_ms(RequestFacts(1000), PathPolicyConfig(ttft_slo_ms=2000)) == pytest.approx(900)


# ------------------------------------------------------------ a sliding-window model's KV size
def tiny_mellum_layout():
    """MD's pool as tests/e2e/test_e2e_swa.py's MD reports it (artifacts/tiny-mellum): 2 full
    + 2 sliding layers, K and V of 2 heads x 32 x fp32 each, SGLang's window 31."""
    from sglang_pdd.kv_channel.layout import KvPoolLayout

    return KvPoolLayout("mha", layers=4, page_size=1, token_bytes=256, dtype="float32", window_layers=2, window=31)


@pytest.mark.parametrize("prompt, cached", [(1, 0), (20, 0), (31, 0), (32, 0), (106, 0), (1000, 0), (1000, 980),
                                            (1000, 969), (1000, 900), (1000, 999), (1000, 1000), (200, 500)])
def test_the_estimate_of_a_sliding_window_request_is_the_bytes_p_sends(prompt, cached):
    """The router's WAN estimate at MD's reported size (full layers per token, the sliding
    layers for the window) equals what P's channel sends for that request
    (kv_channel TransferPlan), whatever the prefix MD holds; the sliding layers counted per
    token, as before, over-estimate a long prompt about twice."""
    from sglang_pdd.kv_channel.layout import TransferPlan
    from sglang_pdd.router.policy import p_md_wan_ms, request_wan_bytes, router_facts, wan_transfer_ms

    layout = tiny_mellum_layout()
    size = layout.wan_kv_size
    assert size == KvSize(2 * 2 * 256, 31, 2 * 2 * 256)
    cfg = PathPolicyConfig(wan_gbps=0.0005, wan_rtt_ms=40.0, page_size=1).with_kv_size(size)
    facts = router_facts(prompt, cached, 8, 0, 4, cfg)
    plan = TransferPlan.build(layout.wire(), prompt, min(cached, prompt))
    assert request_wan_bytes(facts, cfg) == plan.total_bytes
    assert choose_path(facts, cfg).est_wan_transfer_ms == pytest.approx(p_md_wan_ms(plan.total_bytes, cfg))
    assert wan_transfer_ms(plan.total_bytes, cfg) > wan_transfer_ms(plan.total_bytes - 1, cfg)
    if prompt - cached > 2 * 31:
        assert plan.total_bytes < (prompt - cached) * layout.bytes_per_token * 0.8


def test_a_sliding_window_size_is_reported_whole_or_not_at_all():
    assert KvSize.reported({"kv_bytes_per_token": 512}) == KvSize(512)
    assert KvSize.reported({"kv_bytes_per_token": 512, "kv_window_tokens": 31,
                            "kv_window_bytes_per_token": 512}) == KvSize(512, 31, 512)
    for bad in ({}, {"kv_bytes_per_token": 0}, {"kv_bytes_per_token": True},
                {"kv_bytes_per_token": 512, "kv_window_tokens": 31},  # a window without its bytes
                {"kv_bytes_per_token": 512, "kv_window_tokens": "31", "kv_window_bytes_per_token": 512}):
        assert KvSize.reported(bad) is None, bad
    with pytest.raises(ValueError):
        PathPolicyConfig(kv_window_tokens=31)
