"""The Grafana dashboard (docs/grafana/sglang-pdd.json) names only metrics the router exports.

The exported names come from the router's own /metrics answer after it recorded a few
finished requests (FlowResults of each path, a handoff, a WAN transfer, fallbacks), so a
renamed or dropped metric fails here, not on an operator's blank panel.
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sglang_pdd.router.front.app import Router
from sglang_pdd.router.flow.fallback import Fallback, Reason
from sglang_pdd.router.flow.pdd_flow import FlowConfig
from sglang_pdd.router.backends.servers import MainBackend, PrefillBackend
from sglang_pdd.router.flow.request import FlowRequest
from sglang_pdd.router.backends.pools import Pools
from tests.conftest import REPO_ROOT

DASHBOARD = REPO_ROOT / "docs" / "grafana" / "sglang-pdd.json"

# ---------------------------------------------------------------------- PromQL names

_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
             "group_left", "group_right", "inf", "nan", "atan2"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+")
_LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"(?<![\w.:])[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions or
    aggregations (followed by "("), keywords, label names (in {...}, by/without/on/ignoring
    lists), strings, durations or Grafana variables."""
    s = _STRING.sub(" ", expr)  # first: a label value may hold anything, braces included
    s = _VARIABLE.sub(" ", s)
    s = _MATCHERS.sub(" ", s)
    s = _RANGE.sub(" ", s)
    s = _LABEL_LIST.sub(" ", s)
    names = set()
    for m in _IDENT.finditer(s):
        if re.match(r"\s*\(", s[m.end():]) or m.group().lower() in _KEYWORDS:
            continue
        names.add(m.group())
    return names


@pytest.mark.parametrize("expr, expected", [
    ('histogram_quantile(0.99, sum by (le, path) (rate(pdd:ttft_seconds_bucket{instance=~"$instance"}'
     '[$__rate_interval])))', {"pdd:ttft_seconds_bucket"}),
    ('sum(rate(a_total{x="b_total", y=~"{c}"}[5m])) by (le) / on (job) group_left (url) b',
     {"a_total", "b"}),
    ("sum without (instance) (rate(x[1h] offset 1d)) > bool 0 and y unless z", {"x", "y", "z"}),
    ("label_values(pdd:requests_total, instance)", {"pdd:requests_total", "instance"}),
    ("max_over_time(m[5m:1m]) * 1e3 + ${var} - $__interval_ms", {"m"}),
])
def test_extractor(expr, expected):
    assert metric_names(expr) == expected


def dashboard_queries(dash: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target (rows' nested panels too) and query variable."""
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                if t.get("expr"):
                    out.append((f"panel {p.get('title')!r}", t["expr"]))
            walk(p.get("panels", []))

    walk(dash["panels"])
    for v in dash.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            # label_values(metric, label): only its first argument is a metric
            m = re.fullmatch(r"\s*label_values\(\s*([^,()]+?)\s*(?:,\s*\w+\s*)?\)\s*", query)
            out.append((f"variable {v['name']!r}", m.group(1) if m else query))
    return out


# ---------------------------------------------------------------------- what the router exports

def router_exposition() -> dict[str, tuple[str, str]]:
    """Sample name -> (family, type), from the router's /metrics after a few finished requests."""
    prefill = [PrefillBackend("http://p:30000", 8998)]
    mains = [MainBackend("http://md:30002", "http://md:31002", "127.0.0.1:1")]
    pools = Pools(prefill, ["http://rld:30001"], mains)
    router = Router(pools, FlowConfig(), None, max_prompt_tokens=4096, served_model="m")
    prompt = list(range(1, 65))

    def finish(rid, tokens, **fields):
        flow = router.flows.open(FlowRequest(prompt, {"max_new_tokens": len(tokens)}, rid=rid))
        router.flows.admit(flow, +1)
        flow.t0 -= 2.0  # the request ran 2 s (its TTFT below is within that)
        for k, v in fields.items():
            setattr(flow.result, k, v)
        router.flows.admit(flow, -1)
        router.flows.observe(flow, tokens)

    out = list(range(100, 132))
    finish("handed-off", out, path="p_rld_md", md_cached_tokens=16, p_cached_tokens=32, wan_bytes=4800,
           wan_bytes_saved=1600, wan_ready_s=0.2, handoff_at=8, handoff_mode="catch_up", handoff_stall_s=0.02,
           handoff_payload_bytes=700, rld_tokens=8, md_tokens=24, ttft_s=0.15)
    finish("p-md", out, path="p_md", md_cached_tokens=60, wan_bytes=400, wan_bytes_saved=6000, wan_ready_s=0.05,
           handoff_at=1, handoff_mode="one_shot", handoff_stall_s=0.01, handoff_payload_bytes=300,
           rld_tokens=1, md_tokens=31, ttft_s=0.1)
    finish("wan-failed", out[:5], path="p_rld_md", rld_tokens=5, ttft_s=0.1,
           fallbacks=[Fallback(Reason.WAN_FAILED, "KV transfer failed")])
    finish("outlier", out[:3], path="p_rld_only", rld_tokens=3, ttft_s=0.05)
    held = router.flows.open(FlowRequest(prompt, {"max_new_tokens": 4}, rid="running"))
    router.flows.admit(held, +1)  # one still in flight when scraped

    body = asyncio.run(router.metrics_route(None)).body
    families = list(text_string_to_metric_families(body.decode()))
    snap = router.metrics.snapshot()  # the requests above were really recorded
    assert snap["pdd:requests_total"] == {"p_md": 1, "p_rld_md": 2, "p_rld_only": 1}
    assert snap["pdd:kv_transfer_latency_ms"]["count"] == 2
    assert snap["pdd:backend_inflight_requests"][("main", "0")] == 1
    return {s.name: (f.name, f.type) for f in families for s in f.samples}


@pytest.fixture(scope="module")
def exported() -> dict[str, tuple[str, str]]:
    return router_exposition()


def unknown_names(queries: list[tuple[str, str]], exported: dict[str, tuple[str, str]]) -> list[str]:
    """Each name a query uses must be a series the router exports: a counter as `<name>_total`,
    a histogram as `_bucket` / `_sum` / `_count` of an exported histogram, a gauge as is."""
    bad = []
    for where, expr in queries:
        for name in sorted(metric_names(expr)):
            family, kind = exported.get(name, (None, None))
            suffix = name[len(family):] if family is not None else None
            ok = (kind == "histogram" and suffix in ("_bucket", "_sum", "_count")) or \
                 (kind == "counter" and suffix == "_total") or (kind == "gauge" and suffix == "")
            if not ok:
                bad.append(f"{where}: {name}")
    return bad


def test_every_dashboard_metric_is_exported(exported):
    dash = json.loads(DASHBOARD.read_text())
    queries = dashboard_queries(dash)
    panels = {f"panel {p['title']!r}" for p in dash["panels"] if p["type"] != "row"}
    assert panels <= {where for where, _ in queries}  # every panel's queries were read
    assert unknown_names(queries, exported) == []


def test_dashboard_covers_what_the_operator_needs(exported):
    """Each area the dashboard is for has a panel on the router's series for it."""
    used = {exported[n][0] for _, e in dashboard_queries(json.loads(DASHBOARD.read_text()))
            for n in metric_names(e) if n in exported}
    for family in ("pdd:ttft_seconds", "pdd:tpot_seconds", "pdd:handoff_stall_seconds", "pdd:wan_bytes",
                   "pdd:wan_bytes_saved", "pdd:rld_output_tokens", "pdd:md_output_tokens", "pdd:fallbacks",
                   "pdd:kv_transfer_latency_ms", "pdd:kv_transfer_speed_gb_s", "pdd:num_transfer_failed_reqs",
                   "pdd:backend_inflight_requests"):
        assert family in used, family


def test_a_bogus_metric_is_caught(exported):
    queries = [("panel 'bogus'", 'sum(rate(pdd:no_such_metric_total{path="p_md"}[5m]))'),
               ("panel 'bare histogram'", "rate(pdd:ttft_seconds[5m])"),  # no such series
               ("panel 'counter without _total'", "rate(pdd:requests[5m])"),
               ("panel 'fine'", "sum by (le) (rate(pdd:ttft_seconds_bucket[5m]))")]
    assert unknown_names(queries, exported) == ["panel 'bogus': pdd:no_such_metric_total",
                                                "panel 'bare histogram': pdd:ttft_seconds",
                                                "panel 'counter without _total': pdd:requests"]
    # The dashboard with one more panel naming it fails the check.
    dash = json.loads(DASHBOARD.read_text())
    dash["panels"][-1]["targets"].append({"refId": "Z", "expr": queries[0][1]})
    assert unknown_names(dashboard_queries(dash), exported) == [
        f"panel {dash['panels'][-1]['title']!r}: pdd:no_such_metric_total"]


def test_dashboard_shape():
    """What Grafana's import needs: a Prometheus datasource variable every query uses,
    unique panel ids, panels inside the 24-column grid."""
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert p["targets"] and all(t["datasource"] == p["datasource"] for t in p["targets"]), p["title"]
