import importlib.util
import json
import math
import pathlib

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from sglang_pdd.handoff.policy import HandoffMode
from sglang_pdd.router.front.metrics import (
    CONTENT_TYPE,
    FALLBACK_REASONS,
    HANDOFF_MODES,
    PATHS,
    RouterMetrics,
)
from sglang_pdd.router.policy import Path


def samples(m: RouterMetrics) -> dict:
    """render() parsed back: {(sample name, frozenset(labels)): value}."""
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(m, name, **labels):
    return samples(m)[(name, frozenset(labels.items()))]


def test_label_sets_follow_the_policies():
    assert PATHS == ("p_md", "p_rld_md", "p_rld_only")
    assert HANDOFF_MODES == ("one_shot", "catch_up")
    assert set(FALLBACK_REASONS) == {"wan_failed", "wan_timeout", "md_failed", "md_rejected", "retried_elsewhere",
                                     "relay_stalled"}


def test_own_registry_so_many_can_coexist():
    a, b = RouterMetrics(), RouterMetrics()  # the global registry would raise "Duplicated"
    a.fallback("wan_failed")
    assert a.snapshot()["pdd:fallbacks_total"]["wan_failed"] == 1
    assert b.snapshot()["pdd:fallbacks_total"]["wan_failed"] == 0
    reg = CollectorRegistry()
    assert RouterMetrics(reg).registry is reg


def test_all_series_exist_at_zero_before_any_event():
    s = samples(RouterMetrics())
    for p in PATHS:
        assert s[("pdd:requests_total", frozenset({("path", p)}))] == 0
        assert s[("pdd:ttft_seconds_count", frozenset({("path", p)}))] == 0
    for mode in HANDOFF_MODES:
        assert s[("pdd:handoffs_total", frozenset({("mode", mode)}))] == 0
    for r in FALLBACK_REASONS:
        assert s[("pdd:fallbacks_total", frozenset({("reason", r)}))] == 0
    for name in ("pdd:wan_bytes_total", "pdd:wan_bytes_saved_total", "pdd:rld_output_tokens_total",
                 "pdd:md_output_tokens_total", "pdd:outliers_total", "pdd:client_disconnects_total",
                 "pdd:num_transfer_failed_reqs_total", "pdd:handoff_payload_bytes_count",
                 "pdd:md_prefix_hit_ratio_count", "pdd:p_prefix_hit_ratio_count",
                 "pdd:e2e_latency_seconds_count", "pdd:tpot_seconds_count",
                 "pdd:handoff_stall_seconds_count", "pdd:kv_transfer_latency_ms_count",
                 "pdd:kv_transfer_speed_gb_s_count", "pdd:kv_transfer_total_mb_count"):
        assert any(k[0] == name and v == 0 for k, v in s.items()), name


def test_observe_request_appears_with_path_label():
    m = RouterMetrics()
    m.observe_request("p_md", 0.3, 0.02, 2.0, prompt_tokens=1000, md_cached_tokens=750,
                      p_cached_tokens=500, md_output_tokens=90)
    m.observe_request(Path.P_RLD_MD, 1.5, 0.03, 4.0, prompt_tokens=1000, md_cached_tokens=0,
                      rld_output_tokens=12, md_output_tokens=88)
    m.observe_request(Path.P_MD, 0.1, None, 0.1)  # one-token answer: no TPOT, no hit info
    assert value(m, "pdd:requests_total", path="p_md") == 2
    assert value(m, "pdd:requests_total", path="p_rld_md") == 1
    assert value(m, "pdd:requests_total", path="p_rld_only") == 0
    assert value(m, "pdd:ttft_seconds_count", path="p_md") == 2
    assert value(m, "pdd:ttft_seconds_sum", path="p_md") == pytest.approx(0.4)
    assert value(m, "pdd:ttft_seconds_sum", path="p_rld_md") == pytest.approx(1.5)
    assert value(m, "pdd:tpot_seconds_count", path="p_md") == 1
    assert value(m, "pdd:e2e_latency_seconds_sum", path="p_rld_md") == pytest.approx(4.0)
    assert value(m, "pdd:md_prefix_hit_ratio_count") == 2
    assert value(m, "pdd:md_prefix_hit_ratio_sum") == pytest.approx(0.75)
    assert value(m, "pdd:p_prefix_hit_ratio_count") == 1
    assert value(m, "pdd:p_prefix_hit_ratio_sum") == pytest.approx(0.5)
    assert value(m, "pdd:rld_output_tokens_total") == 12
    assert value(m, "pdd:md_output_tokens_total") == 178


@pytest.mark.parametrize(
    "ttfts, le, expected",
    [
        ([0.01, 0.2, 0.3, 5.0, 100.0], "0.05", 1),
        ([0.01, 0.2, 0.3, 5.0, 100.0], "0.5", 3),
        ([0.01, 0.2, 0.3, 5.0, 100.0], "8.0", 4),
        ([0.01, 0.2, 0.3, 5.0, 100.0], "+Inf", 5),
        ([], "+Inf", 0),
    ],
)
def test_histogram_buckets_are_cumulative(ttfts, le, expected):
    m = RouterMetrics()
    for t in ttfts:
        m.observe_request("p_rld_md", t)
    assert value(m, "pdd:ttft_seconds_bucket", path="p_rld_md", le=le) == expected


@pytest.mark.parametrize(
    "cached, prompt, le, expected",
    [
        (0, 100, "0.0", 1),  # a cold miss lands in its own bucket
        (1, 100, "0.0", 0),
        (1, 100, "0.1", 1),
        (100, 100, "0.99", 0),
        (100, 100, "1.0", 1),
    ],
)
def test_hit_ratio_buckets(cached, prompt, le, expected):
    m = RouterMetrics()
    m.observe_request("p_md", prompt_tokens=prompt, md_cached_tokens=cached)
    assert value(m, "pdd:md_prefix_hit_ratio_bucket", le=le) == expected


def test_observe_handoff():
    m = RouterMetrics()
    m.observe_handoff("one_shot", 0.040, 2048)
    m.observe_handoff(HandoffMode.CATCH_UP, 0.010, 512)
    m.observe_handoff("catch_up", 0.020, 512)
    m.observe_handoff("one_shot", None, 100)  # MD never produced a token: no stall sample
    assert value(m, "pdd:handoffs_total", mode="one_shot") == 2
    assert value(m, "pdd:handoffs_total", mode="catch_up") == 2
    assert value(m, "pdd:handoff_stall_seconds_count", mode="one_shot") == 1
    assert value(m, "pdd:handoff_stall_seconds_sum", mode="catch_up") == pytest.approx(0.030)
    assert value(m, "pdd:handoff_stall_seconds_bucket", mode="catch_up", le="0.01") == 1
    assert value(m, "pdd:handoff_payload_bytes_count") == 4
    assert value(m, "pdd:handoff_payload_bytes_sum") == 2048 + 512 + 512 + 100
    assert value(m, "pdd:handoff_payload_bytes_bucket", le="1024.0") == 3


def test_counters():
    m = RouterMetrics()
    for r in ("wan_failed", "wan_failed", "md_rejected"):
        m.fallback(r)
    m.wan_transfer(1_000_000, bytes_saved=3_000_000)
    m.wan_transfer(500)
    m.transfer_failed()
    m.outlier()
    m.outlier()
    m.client_disconnect()
    assert value(m, "pdd:fallbacks_total", reason="wan_failed") == 2
    assert value(m, "pdd:fallbacks_total", reason="md_rejected") == 1
    assert value(m, "pdd:fallbacks_total", reason="wan_timeout") == 0
    assert value(m, "pdd:wan_bytes_total") == 1_000_500
    assert value(m, "pdd:wan_bytes_saved_total") == 3_000_000
    assert value(m, "pdd:num_transfer_failed_reqs_total") == 1
    assert value(m, "pdd:outliers_total") == 2
    assert value(m, "pdd:client_disconnects_total") == 1


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.observe_request("p_rld"),
        lambda m: m.observe_request("P_MD"),
        lambda m: m.observe_request(""),
        lambda m: m.observe_handoff("oneshot", 0.1, 10),
        lambda m: m.observe_handoff(Path.P_MD, 0.1, 10),  # an enum, but the wrong one
        lambda m: m.fallback("connection reset by peer"),
        lambda m: m.fallback(None),
    ],
)
def test_unknown_labels_rejected(call):
    m = RouterMetrics()
    before = samples(m)
    with pytest.raises(ValueError):
        call(m)
    assert samples(m).keys() == before.keys()  # no new series was created


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(ttft_s=-0.1),
        dict(tpot_s=-1.0),
        dict(e2e_s=-1.0),
        dict(rld_output_tokens=-1),
        dict(md_output_tokens=-1),
        dict(prompt_tokens=10, md_cached_tokens=11),  # cached > prompt (sglang #25972)
        dict(prompt_tokens=10, p_cached_tokens=-1),
        dict(prompt_tokens=0, md_cached_tokens=0),
        dict(md_cached_tokens=5),  # a ratio needs the prompt length
    ],
)
def test_bad_request_values_rejected_without_half_record(kwargs):
    m = RouterMetrics()
    with pytest.raises(ValueError):
        m.observe_request("p_md", **{"ttft_s": 0.1, **kwargs})
    snap = m.snapshot()
    assert snap["pdd:requests_total"]["p_md"] == 0
    assert snap["pdd:ttft_seconds"]["p_md"]["count"] == 0


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.observe_handoff("one_shot", -0.1, 10),
        lambda m: m.observe_handoff("one_shot", 0.1, -10),
        lambda m: m.wan_transfer(-1),
        lambda m: m.wan_transfer(1, bytes_saved=-1),
    ],
)
def test_negative_values_rejected(call):
    with pytest.raises(ValueError):
        call(RouterMetrics())


def test_snapshot_shape():
    m = RouterMetrics()
    m.observe_request("p_rld_only", 0.5, 0.01, 0.6, rld_output_tokens=4)
    m.outlier()
    m.observe_handoff("catch_up", 0.02, 300)
    m.wan_transfer(10, 20)
    snap = m.snapshot()
    assert snap["pdd:requests_total"] == {"p_md": 0, "p_rld_md": 0, "p_rld_only": 1}
    assert snap["pdd:ttft_seconds"]["p_rld_only"] == {"count": 1, "sum": 0.5}
    assert snap["pdd:handoffs_total"] == {"one_shot": 0, "catch_up": 1}
    assert snap["pdd:handoff_stall_seconds"]["catch_up"]["count"] == 1
    assert snap["pdd:handoff_payload_bytes"] == {"count": 1, "sum": 300}
    assert snap["pdd:wan_bytes_total"] == 10 and snap["pdd:wan_bytes_saved_total"] == 20
    assert snap["pdd:outliers_total"] == 1
    assert snap["pdd:rld_output_tokens_total"] == 4
    assert not any(k.endswith("_created") for k in snap)
    # Plain numbers all the way down.
    def leaves(x):
        return [v for y in x.values() for v in leaves(y)] if isinstance(x, dict) else [x]
    assert all(isinstance(v, float) and math.isfinite(v) for v in leaves(snap))


def test_render_is_exposition_text():
    m = RouterMetrics()
    m.observe_request("p_md", 0.2)
    text = m.render()
    assert isinstance(text, bytes)
    assert b"# TYPE pdd:requests_total counter" in text
    assert b"# TYPE pdd:ttft_seconds histogram" in text
    assert b'pdd:requests_total{path="p_md"} 1.0' in text
    assert b"sglang:" not in text  # SGLang's own prefix stays SGLang's
    assert CONTENT_TYPE.startswith("text/plain")


def test_kv_transfer_in_sglang_units():
    m = RouterMetrics()
    m.kv_transfer(0.5, 512 * 2**20)  # 512 MiB in 0.5 s: 1 GB/s in SGLang's units (MB/1024/s)
    m.kv_transfer(0.1, 0)  # a full DRC hit: latency and size, no speed
    assert value(m, "pdd:kv_transfer_latency_ms_count") == 2
    assert value(m, "pdd:kv_transfer_latency_ms_sum") == pytest.approx(600.0)
    assert value(m, "pdd:kv_transfer_latency_ms_bucket", le="100.0") == 1
    assert value(m, "pdd:kv_transfer_total_mb_sum") == pytest.approx(512.0)
    assert value(m, "pdd:kv_transfer_total_mb_bucket", le="1.0") == 1
    assert value(m, "pdd:kv_transfer_speed_gb_s_count") == 1
    assert value(m, "pdd:kv_transfer_speed_gb_s_sum") == pytest.approx(1.0)
    with pytest.raises(ValueError):
        m.kv_transfer(-0.1, 10)
    with pytest.raises(ValueError):
        m.kv_transfer(0.1, -10)


def test_kv_transfer_buckets_are_sglangs():
    """Same bounds as SGLang's own histograms, so both line up on one panel."""
    # Read from the installed SGLang's source (importing it pulls in torch).
    spec = importlib.util.find_spec("sglang")
    src = (pathlib.Path(spec.origin).parent / "srt/observability/metrics_collector.py").read_text()
    sglang_buckets = {}
    for name in ("kv_transfer_latency_ms", "kv_transfer_speed_gb_s", "kv_transfer_total_mb"):
        tail = src[src.index(f'name="sglang:{name}"'):]
        tail = tail[tail.index("buckets=(") + len("buckets=("):]
        sglang_buckets[name] = [float(b) for b in tail[:tail.index(")")].split(",") if b.strip()]
    s = samples(RouterMetrics())
    for name, bounds in sglang_buckets.items():
        ours = sorted(float(dict(k[1])["le"]) for k in s if k[0] == f"pdd:{name}_bucket")
        assert ours == bounds + [math.inf], name


def test_backends_inflight_read_at_scrape_time():
    rld, md = {"http://rld:1": 0}, {"http://md:1": 0, "http://md:2": 0}
    m = RouterMetrics()
    m.track_backends({"relay": rld, "main": md})
    assert value(m, "pdd:backend_inflight_requests", role="main", index="1") == 0
    rld["http://rld:1"], md["http://md:2"] = 3, 1  # the router's own counts change
    assert value(m, "pdd:backend_inflight_requests", role="relay", index="0") == 3
    assert value(m, "pdd:backend_inflight_requests", role="main", index="1") == 1
    assert value(m, "pdd:backend_fallbacks_total", role="main", index="0") == 0
    m.backend_fallback("main", "http://md:1")
    assert value(m, "pdd:backend_fallbacks_total", role="main", index="0") == 1
    assert m.snapshot()["pdd:backend_inflight_requests"][("relay", "0")] == 3
    for call in (lambda: m.backend_fallback("main", "http://elsewhere:1"),
                 lambda: m.backend_fallback("prefill", "http://md:1"),
                 lambda: m.track_backends({"main": md})):
        with pytest.raises(ValueError):
            call()
    with pytest.raises(ValueError):
        RouterMetrics().track_backends({"decode": md})


def test_observe_flow_from_flow_results():
    from sglang_pdd.router.flow.fallback import Fallback, Reason
    from sglang_pdd.router.flow.pdd_flow import FlowResult
    m = RouterMetrics()
    md_url = "http://md:1"
    m.track_backends({"relay": {"http://rld:1": 0}, "main": {md_url: 0}})
    handed = FlowResult(rid="a", path="p_rld_md", prompt_tokens=100, md_cached_tokens=60, p_cached_tokens=120,
                        wan_bytes=40 * 2**20, wan_bytes_saved=60 * 2**20, wan_ready_s=0.25, handoff_at=8,
                        handoff_mode="one_shot", handoff_stall_s=0.03, handoff_payload_bytes=900,
                        rld_tokens=8, md_tokens=24, ttft_s=0.2)
    m.observe_flow(handed, e2e_s=1.75, output_tokens=32, main_url=md_url)
    failed = FlowResult(rid="b", path="p_rld_md", prompt_tokens=10, rld_tokens=5, ttft_s=0.1,
                        fallbacks=[Fallback(Reason.WAN_FAILED, "not ready within 30s")])
    m.observe_flow(failed, e2e_s=0.5, output_tokens=5, main_url=md_url)
    slow = FlowResult(rid="e", path="p_md", prompt_tokens=4, rld_tokens=1, ttft_s=0.1,
                      fallbacks=[Fallback(Reason.WAN_FAILED, "not ready within 30s", timed_out=True)])
    m.observe_flow(slow, e2e_s=0.2, output_tokens=1, main_url=md_url)
    m.observe_flow(FlowResult(rid="c", prompt_tokens=4, fallbacks=[Fallback(Reason.MD_UNAVAILABLE, "refused")]), e2e_s=0.1, output_tokens=0)
    retried = FlowResult(rid="d", path="p_rld_md", prompt_tokens=4, rld_tokens=2, ttft_s=0.1,
                         fallbacks=[Fallback(Reason.RETRIED_ELSEWHERE, "http://p:1")])
    m.observe_flow(retried, e2e_s=0.2, output_tokens=2, main_url=md_url)
    assert value(m, "pdd:requests_total", path="p_rld_md") == 3
    assert value(m, "pdd:requests_total", path="p_rld_only") == 1  # no path: MD never came in
    assert value(m, "pdd:tpot_seconds_sum", path="p_rld_md") == pytest.approx(1.55 / 31 + 0.4 / 4 + 0.1 / 1)
    assert value(m, "pdd:p_prefix_hit_ratio_sum") == pytest.approx(1.0 + 0.0 + 0.0)  # P's 120 capped at 100
    assert value(m, "pdd:wan_bytes_total") == 40 * 2**20
    assert value(m, "pdd:kv_transfer_latency_ms_sum") == pytest.approx(250.0)
    assert value(m, "pdd:kv_transfer_speed_gb_s_sum") == pytest.approx(40 / 1024 / 0.25)
    assert value(m, "pdd:handoff_stall_seconds_count", mode="one_shot") == 1
    assert value(m, "pdd:fallbacks_total", reason="wan_failed") == 1
    assert value(m, "pdd:fallbacks_total", reason="wan_timeout") == 1  # "e": the router's wait ran out
    assert value(m, "pdd:fallbacks_total", reason="md_rejected") == 1  # no MD took "c"
    assert value(m, "pdd:fallbacks_total", reason="md_failed") == 0
    assert value(m, "pdd:fallbacks_total", reason="retried_elsewhere") == 1
    assert value(m, "pdd:num_transfer_failed_reqs_total") == 2  # "b" and "e"
    # "b" and "e" against their MD; "c" had no MD; "d" broke on P, not on its MD
    assert value(m, "pdd:backend_fallbacks_total", role="main", index="0") == 2
    assert value(m, "pdd:rld_output_tokens_total") == 16
    assert value(m, "pdd:md_output_tokens_total") == 24


def test_metrics_name_backends_by_role_and_index_never_by_url():
    """/metrics is open (as on SGLang, --api-key exempts it): it used to carry every P, RLD and
    MD URL as a label. Backends are now their role and their index in the router's flags;
    the operator-only GET /pdd/backends maps each index to its URL."""
    import asyncio

    from sglang_pdd.router.front.app import Router
    from sglang_pdd.router.flow.pdd_flow import FlowConfig
    from sglang_pdd.router.backends.servers import MainBackend, PrefillBackend
    from sglang_pdd.router.backends.pools import Pools

    pools = Pools([PrefillBackend("http://p0.internal:30000", 1), PrefillBackend("http://p1.internal:30000", 1)],
                  ["http://rld.internal:30001"], [MainBackend("http://md.internal:30002", "http://md.internal:31002",
                                                              "10.9.0.1:18000")])
    router = Router(pools, FlowConfig(), None, max_prompt_tokens=100, served_model="m", operator_token="t" * 16)
    router.metrics.backend_fallback("main", "http://md.internal:30002")
    text = asyncio.run(router.metrics_route(None)).body.decode()
    assert "internal" not in text and "10.9.0.1" not in text
    assert 'pdd:backend_up{index="1",role="prefill"} 1.0' in text
    assert 'pdd:backend_fallbacks_total{index="0",role="main"} 1.0' in text

    class Request:
        headers = {"X-PDD-Operator-Token": "t" * 16}

    rows = json.loads(asyncio.run(router.backends(Request())).body)["backends"]
    assert {(r["role"], r["index"]): r["url"] for r in rows} == {
        ("prefill", 0): "http://p0.internal:30000", ("prefill", 1): "http://p1.internal:30000",
        ("relay", 0): "http://rld.internal:30001", ("main", 0): "http://md.internal:30002"}


def test_backend_failures_read_at_scrape_time_by_role_index_and_source():
    failures = {("relay", "http://rld:1", "probe"): 0}
    m = RouterMetrics()
    m.track_backends({"relay": {"http://rld:1": 0}})
    m.track_failures(lambda: [(role, url, source, n) for (role, url, source), n in failures.items()])
    assert value(m, "pdd:backend_failures_total", role="relay", index="0", source="probe") == 0
    failures[("relay", "http://rld:1", "probe")] = 2  # the health board counted two failed probes
    assert value(m, "pdd:backend_failures_total", role="relay", index="0", source="probe") == 2
    assert "# TYPE pdd:backend_failures_total counter" in m.render().decode()
    failures[("relay", "http://other:1", "probe")] = 1  # not a backend the router was started with
    with pytest.raises(ValueError):
        m.render()


def test_md_kv_after_end_read_from_the_routers_lingering_counters_at_scrape_time():
    from sglang_pdd.router.flow.lingering import Lingering
    lingering, m = Lingering(), RouterMetrics()
    m.track_after_end(lingering.counters)
    assert value(m, "pdd:md_kv_after_end_total", outcome="delivered") == 0
    lingering.counters["delivered_after_end"] += 2  # as MdSide counts them
    lingering.counters["failed_after_end"] += 1
    assert value(m, "pdd:md_kv_after_end_total", outcome="delivered") == 2
    assert value(m, "pdd:md_kv_after_end_total", outcome="failed") == 1
