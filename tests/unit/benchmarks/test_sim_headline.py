"""The headline table compares TTFTs only between runs that kept up: against a collapsed
baseline (hours of backlog) the ratio says nothing about the design."""

import json

from benchmarks.sim_headline import headline_filename, headline_markdown, main
from tests.conftest import REPO_ROOT

HEADLINE = REPO_ROOT / "docs" / "img" / "sim_headline_20g.json"


def _run(ttft, sla, wan_gb=100.0):
    return dict(ttft_p90=ttft, sla_attainment=sla, requests=100, rld_cost_share=0.1, rld_token_share=0.02,
                paths={"p_md": 10, "p_rld_md": 90}, wan_gb=wan_gb, stall_p50=0.07, stall_p99=0.1)


def _table(same_fleet):
    return dict(trace="t", requests=100, model="m", wan_gbps=50.0, mla_kernel="flashmla", fleet={}, target=0.9,
                same_fleet=same_fleet, knees={}, sized={}, verdicts=[])


def _ttft_row(md):
    return next(ln for ln in md.splitlines() if ln.startswith("| TTFT p90"))


def test_ttft_is_compared_between_runs_that_kept_up():
    row = _ttft_row(headline_markdown(_table(dict(pdd_drc_adaptive=_run(0.4, 0.99), xdc_pd=_run(0.8, 0.95, 1000.0),
                                                  xdc_pd_drc=_run(0.5, 0.97)))))
    assert "| -50% (+DRC: -20%) |" in row and "SLA 99.0%, 95.0%, 97.0%" in row


def test_a_collapsed_baseline_gets_no_ratio():
    row = _ttft_row(headline_markdown(_table(dict(pdd_drc_adaptive=_run(0.4, 0.99), xdc_pd=_run(9000.0, 0.01, 1000.0),
                                                  xdc_pd_drc=_run(0.5, 0.97)))))
    assert "| n/a (SLA under target) (+DRC: -20%) |" in row


def test_the_recorded_20_gbps_headline_shows_no_ratio():
    with open(HEADLINE) as f:
        row = _ttft_row(headline_markdown(json.load(f)))
    assert "-100%" not in row and row.count("n/a (SLA under target)") == 2


def _knee(scale, good):
    return dict(knee_scale=scale, knee_goodput_rps=good)


def test_the_rps_row_names_each_knee_and_how_it_was_found():
    t = _table(dict(pdd_drc_adaptive=_run(0.4, 0.99), xdc_pd=_run(9000.0, 0.01), xdc_pd_drc=_run(0.5, 0.97)))
    t.update(scales="1,1.5,2", knee_resolution=0.05,
             knees=dict(pdd_drc_adaptive=_knee(1.22, 13.8), xdc_pd=_knee(None, 0.0), xdc_pd_drc=_knee(1.26, 15.0),
                        pd_same_dc=_knee(2.0, 12.0)))
    row = next(ln for ln in headline_markdown(t).splitlines() if ln.startswith("| RPS within SLA"))
    # no cross-DC knee: no ratio; against +DRC PDD loses 8%; a knee at the grid's top is a lower bound
    assert "| - (+DRC: -8%) |" in row and "knees refined to 5%" in row
    assert "PDD 13.80 (x1.22)" in row and "xDC 0.00 (none)" in row and "same-DC PD 12.00 (>=x2)" in row


def _headline_args(monkeypatch, *argv):
    seen = []
    monkeypatch.setattr("benchmarks.sim_headline.headline", lambda a: seen.append(a) or 0)
    assert main(["headline", *argv]) == 0
    return seen[0]


def test_headline_files_name_the_tile_only_when_it_is_not_8(monkeypatch):
    # The tile-8 results keep their names; another tile never overwrites them. The earlier,
    # lockstep-tiled results keep theirs: spread tiling (the default) is named.
    assert (headline_filename(_headline_args(monkeypatch, "--wan-gbps", "20", "--tile-mode", "lockstep"))
            == "sim_headline_20g_sessions_knee5pct.json")
    assert (headline_filename(_headline_args(monkeypatch, "--wan-gbps", "20"))
            == "sim_headline_20g_sessions_spread_knee5pct.json")
    assert (headline_filename(_headline_args(monkeypatch, "--wan-gbps", "50", "--tile", "16", "--seed", "1"))
            == "sim_headline_50g_sessions_tile16_spread_knee5pct_seed1.json")


def test_the_headline_names_its_tiling():
    t = _table({})
    assert "not tiled" not in headline_markdown(t) and "tiled 8x lockstep" in headline_markdown(t)
    t.update(tile=16, tile_mode="spread")
    assert "tiled 16x spread" in headline_markdown(t)


def test_the_headline_names_pdds_path_mode_and_shows_the_other_mode_on_the_same_fleet():
    fit = dict(_run(0.45, 0.99), paths={"p_md": 80, "p_rld_md": 20}, bcr=120.0)
    relay = dict(_run(0.40, 0.99), bcr=110.0)
    t = _table({"pdd_drc_adaptive": fit, "pdd_drc_adaptive@relay_first": relay})
    t.update(pdd_mode="fit", sized_pdd_by_mode={
        "fit": dict(n_prefill=4, n_rld=1, n_md=2, cost_per_hour=100.0),
        "relay_first": None})
    md = headline_markdown(t)
    assert "PDD's path mode fit" in md.splitlines()[0]
    rows = [ln for ln in md.splitlines() if ln.startswith("| fit |") or ln.startswith("| relay_first |")]
    assert rows[0].startswith("| fit | $100/h (P4/R1/M2) | 80% |")
    assert rows[1].startswith("| relay_first | none | 10% |")
    # a result from before the modes was routed relay-first and shows no mode table
    old = headline_markdown(_table({"pdd_drc_adaptive": relay}))
    assert "PDD's path mode relay_first" in old and "| mode |" not in old


def test_the_wan_row_says_how_much_of_the_trace_the_link_can_carry():
    # 100 requests of cross-DC PD + DRC moved 50 GB: 0.5 GB each; at the trace's 10 r/s that
    # is 40 Gbps, so a 20 Gbps link carries at most half of the requests' KV.
    xdcd = dict(_run(0.5, 0.97, wan_gb=50.0), mean_md_hit=0.9)
    t = _table(dict(pdd_drc_adaptive=_run(0.4, 0.99), xdc_pd=_run(9.0, 0.01, 500.0), xdc_pd_drc=xdcd,
                    pd_same_dc=dict(_run(0.3, 1.0, wan_gb=0.0), offered_rps=10.0)))
    t["wan_gbps"] = 20.0
    row = next(ln for ln in headline_markdown(t).splitlines() if ln.startswith("| WAN for every"))
    assert "40.0 Gbps on a 20 Gbps link: at most 50% of requests' KV can cross" in row
    assert "500 MB per request (MD hit 0.90) at the trace's 10.0 r/s" in row
    # a link wider than the need carries every request: the share stops at 100%
    t["wan_gbps"] = 100.0
    assert "at most 100% of requests' KV" in headline_markdown(t)
    # no same-DC PD run (the trace's own rate unknown): no row rather than a guess
    del t["same_fleet"]["pd_same_dc"]
    assert "| WAN for every" not in headline_markdown(t)


def test_headline_files_name_the_model_kv_dtype_and_scenario_when_not_the_defaults(monkeypatch):
    a = _headline_args(monkeypatch, "--tile", "16", "--kv-dtype", "fp8", "--scenario", "report")
    assert headline_filename(a) == "sim_headline_kvfp8_report_20g_sessions_tile16_spread_knee5pct.json"
    assert a.ttft_slo == 5.0  # the scenario's cold 40-64K prefills take 2.3-4.0 s alone
    assert _headline_args(monkeypatch).ttft_slo == 2.0
    assert _headline_args(monkeypatch, "--scenario", "report", "--ttft-slo", "3").ttft_slo == 3.0
    a = _headline_args(monkeypatch, "--model", "deepseek-v4-pro", "--scenario", "report", "--wan-gbps", "50")
    assert headline_filename(a) == "sim_headline_deepseek-v4-pro_report_50g_sessions_spread_knee5pct.json"


def test_headline_runs_the_reports_scenario_on_deepseek_v4_pro_at_its_smallest(tmp_path, capsys):
    assert main(["headline", "--scenario", "report", "--model", "deepseek-v4-pro", "--n", "60", "--tile", "1",
                 "--prefill-range", "1:2", "--rld-max", "0", "--md-max", "1", "--scales", "1",
                 "--knee-resolution", "0", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "report_scenario60x1" in out and "deepseek-v4-pro (KV fp8)" in out and "SLA TTFT <= 5 s" in out
    d = json.load(open(tmp_path / "sim_headline_deepseek-v4-pro_report_20g_sessions_tile1.json"))
    assert d["scenario"] == "report" and d["kv_dtype"] == "fp8" and d["requests"] == 60
    # the table of several seeds' files (here one) beside the report's numbers
    assert main(["table", str(tmp_path / "sim_headline_deepseek-v4-pro_report_20g_sessions_tile1.json")]) == 0
    out = capsys.readouterr().out
    assert "deepseek-v4-pro (KV fp8), report scenario" in out and "seeds 0" in out
    assert "| BCR vs same-DC PD (sized, same SLA) | +32-37.5% |" in out and "| P->MD share" in out
