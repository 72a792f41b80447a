"""benchmarks/bench_real_pd_vs_pdd.py at its --quick size (one link, one rate, two sessions and
an outlier) on real servers: SGLang's own PD in one datacenter and across the shaped link
(with and without its decode radix cache), and PDD with MD in datacenter B's namespace.
Checked: every request completes on every design, greedy outputs are equal request by
request, the link carries what crosses datacenters and nothing else, and nothing is left
behind. Not timing: that is the benchmark's to report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, _require_sglang
from sglang_pdd.launcher import netns
from benchmarks.bench_real_pd_vs_pdd import DESIGNS

pytestmark = [pytest.mark.e2e, pytest.mark.full, pytest.mark.own_cluster]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory, servers_under_test):
    _require_sglang()
    if netns.unavailable_reason():
        pytest.skip(netns.unavailable_reason())
    servers_under_test.stop()  # the designs start their own servers, one after another
    out = tmp_path_factory.mktemp("real_pd_vs_pdd")
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_real_pd_vs_pdd", "--quick", "--out", str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=1800)
    res = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else None
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()] if res else []
    return done, res, records, out


def test_every_design_completes_every_request(quick_run):
    done, res, records, _ = quick_run
    assert done.returncode == 0 and res is not None, done.stdout[-3000:] + done.stderr[-3000:]
    assert res["designs"] == list(DESIGNS)
    per_cell = res["workload"]["requests_per_cell"]
    assert len(res["cells"]) == len(DESIGNS)
    for key, cell in res["cells"].items():
        assert cell["requests"] == per_cell and cell["errors"] == 0 and cell["completion_mismatch"] == 0, (key, cell)
    for r in records:
        assert len(r["output_ids"]) == r["requested"] == r["completion_tokens"], r
    pdd = [r for r in records if r["design"] == "pdd"]
    assert {r["path"] for r in pdd if r["kind"] == "outlier"} == {"p_rld_only"}  # the outlier filter
    assert any(r["md_cached_tokens"] for r in pdd if r["turn"] > 0)  # later turns hit MD's cache


def test_greedy_outputs_equal_across_designs(quick_run):
    _, res, records, _ = quick_run
    eq = res["equality"]
    assert eq["mismatches"] == 0, eq
    assert eq["compared"] == res["workload"]["requests_per_cell"] and eq["designs_per_request"] == [len(DESIGNS)], eq
    outputs = {tuple(r["output_ids"]) for r in records if r["design"] == "pdd"}
    assert len(outputs) == len([r for r in records if r["design"] == "pdd"])  # prompts differ, outputs too


def test_link_carries_cross_datacenter_traffic_only(quick_run):
    _, res, records, _ = quick_run
    cells = {key.split("|")[0]: cell for key, cell in res["cells"].items()}
    total = {name: c["link_bytes_a_to_b"] + c["link_bytes_b_to_a"] for name, c in cells.items()}
    # same-DC PD: nothing of it crosses (only whatever else the kernel sends, e.g. IPv6 neighbour chatter)
    assert total["same_dc_pd"] < 20_000, total
    kv_per_token = res["links"][str(res["args"]["links"][0])]["kv_bytes_per_token"]
    prompt_kv = kv_per_token * sum(r["prompt_tokens"] for r in records if r["design"] == "cross_dc_pd")
    # cross-DC PD ships every prompt's KV across A -> B (plus bootstrap and the router's calls)
    assert cells["cross_dc_pd"]["link_bytes_a_to_b"] > prompt_kv, (cells["cross_dc_pd"], prompt_kv)
    # its decode radix cache and PDD's DRC send less: later turns' prefixes are on B already
    assert cells["cross_dc_pd_radix"]["link_bytes_a_to_b"] < cells["cross_dc_pd"]["link_bytes_a_to_b"]
    assert 0 < cells["pdd"]["link_bytes_a_to_b"] < cells["cross_dc_pd"]["link_bytes_a_to_b"]


def test_nothing_left_behind(quick_run):
    _, res, _, _ = quick_run
    ns = res["namespace"]
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert ns["name"] not in names and ns["veth"] not in links


# ----------------------------------------------------------------------------- the cold burst
@pytest.fixture(scope="module")
def burst_run(tmp_path_factory, servers_under_test):
    """``--burst --quick``: three sessions' cold first turns at once, then their second turns, on
    same-DC PD, cross-DC PD, PDD, PDD's servers with every request P->RLD only and PDD with
    --md-side-after-first-token (their servers up together), one link, one repeat; datacenter B's servers niced, one torch thread per server."""
    _require_sglang()
    if netns.unavailable_reason():
        pytest.skip(netns.unavailable_reason())
    servers_under_test.stop()
    out = tmp_path_factory.mktemp("real_pd_vs_pdd_burst")
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_real_pd_vs_pdd", "--burst", "3", "--quick",
                           "--designs", "same_dc_pd", "cross_dc_pd", "pdd", "pdd_rld_only", "pdd_md_after_first",
                           "--time-stats", "--dc-b-nice", "10", "--torch-threads", "1", "--out", str(out)], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=1800)
    res = json.loads((out / "burst.json").read_text()) if (out / "burst.json").exists() else None
    records = [json.loads(line) for line in (out / "burst_requests.jsonl").read_text().splitlines()] if res else []
    return done, res, records, out


def test_burst_completes_on_every_design_with_equal_outputs(burst_run):
    done, res, records, out = burst_run
    assert done.returncode == 0 and res is not None, done.stdout[-3000:] + done.stderr[-3000:]
    assert res["designs"] == ["same_dc_pd", "cross_dc_pd", "pdd", "pdd_rld_only", "pdd_md_after_first"]
    n = res["workload"]["requests_per_cell"]
    assert n == 6  # 3 sessions x 2 turns
    for key, cell in res["summary"].items():
        assert cell["errors"] == 0 and cell["n"] == n, (key, cell)
    eq = res["equality"]
    assert eq["mismatches"] == 0 and eq["compared"] == n and eq["designs_per_request"] == [5], eq
    # the burst: every session's first turn was sent before any answer came back
    for design in res["designs"]:
        firsts = [r for r in records if r["design"] == design and r["turn"] == 0]
        assert max(r["sent_at"] for r in firsts) < min(r["sent_at"] + r["ttft_s"] for r in firsts), design
    assert (out / "real_pd_vs_pdd_burst.png").exists()
    assert "namespace" in res
    # PDD's MD and cross-DC PD's decode server: a front end, a scheduler, a detokenizer each, and their threads
    assert res["dc_b_threads_reniced"] >= 6, res.get("dc_b_threads_reniced")
    assert "datacenter B's servers at nice 10" in done.stdout
    assert "every server's torch threads: 1" in done.stdout and res["args"]["torch_threads"] == 1
    assert "pdd_md_after_first: MD's cache:" in done.stdout and "once the link was quiet" in done.stdout


def test_burst_reports_pdds_paths_stages_and_router_marks(burst_run):
    _, res, records, _ = burst_run
    link = f"{res['args']['links'][0]:g}"
    pdd = [r for r in records if r["design"] == "pdd"]
    assert all(r["path"] in ("p_md", "p_rld_md") for r in pdd), [r["path"] for r in pdd]
    # the operator's path reached the router: no request of pdd_rld_only had an MD leg
    assert {r["path"] for r in records if r["design"] == "pdd_rld_only"} == {"p_rld_only"}
    assert "relayed_over_without_wan" in res["ratios"][link]["intervals"] or not any(
        r["path"] == "p_rld_md" for r in pdd)
    # --md-side-after-first-token: MD heard of a relayed request only after its first token
    late = [r for r in records if r["design"] == "pdd_md_after_first" and r["path"] == "p_rld_md"]
    assert all(r["router_marks"].get("md_registered", float("inf")) > r["router_marks"]["first_token"] for r in late)
    assert "md_after_first_over_pdd" in res["ratios"][link]["intervals"]
    assert sum(res["summary"][f"pdd|{link}"]["paths"][p]["n"] for p in res["summary"][f"pdd|{link}"]["paths"]) == 6
    assert all({"path", "legs", "first_token"} <= set(r["router_marks"]) for r in pdd)
    stages = res["stages"][link]
    assert any(name.startswith("pdd:") for name in stages) and "same_dc_pd" in stages
    cores = [c["server_cores"] for key, c in res["cells"].items() if key.startswith("pdd|")]
    assert cores and all({"prefill", "relay", "main"} <= set(c) for c in cores)


def test_burst_leaves_no_namespace_behind(burst_run):
    _, res, _, _ = burst_run
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert res["namespace"]["name"] not in names and res["namespace"]["veth"] not in links


# ----------------------------------------------------------------------------- the TTFT breakdown
def test_ttft_breakdown_runs_every_variant_and_forces_p_rld_only(tmp_path, servers_under_test):
    """The documented ``--ttft-breakdown --links 200 --rates 2.5``, at two sessions: every
    variant answers, its rows carry their stages, and the forced variants went P->RLD only."""
    _require_sglang()
    if netns.unavailable_reason():
        pytest.skip(netns.unavailable_reason())
    servers_under_test.stop()
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_real_pd_vs_pdd", "--ttft-breakdown", "--links", "200",
                           "--rates", "2.5", "--sessions", "2", "--turns", "2", "2", "--outliers", "0",
                           "--out", str(tmp_path)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    res = json.loads((tmp_path / "breakdown.json").read_text())
    assert list(res["variants"]) == ["same_dc_pd", "sglang_pd_pdd_router", "pdd", "pdd_rld_only", "pdd_rld_only_md_stopped"]
    assert all(v["errors"] == 0 and v["matched"] > 0 for v in res["variants"].values()), res["variants"]
    rows = res["rows"]
    assert {r["design"] for r in rows} == set(res["variants"])
    assert {r["path"] for r in rows if r["design"].startswith("pdd_rld_only")} == {"p_rld_only"}
    assert all(r["ttft"] > 0 and r["p_forward"] >= 0 for r in rows)
