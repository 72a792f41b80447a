"""The per-trace PD vs PDD report of docs/sim-notebook.md (2026-12-03, superseded by benchmarks/sim_headline.py): for each trace and model class, the
cheapest PD and PDD mixes meeting the SLA (sizing says which wins), then goodput vs offered
load at both mixes (the knee and BCR at the knee). Writes JSON and PNGs.

    python -m benchmarks.sim_report --model llama3-70b --out docs/img
    python -m benchmarks.sim_report --model deepseek-v3 --out docs/img

Slow (minutes per trace: every mix is a full run); tqdm shows progress.
"""

import argparse
import json
import os
import sys
from dataclasses import asdict, replace

from tqdm import tqdm

from benchmarks.common import MOONCAKE_TRACE, require_trace

from sglang_pdd.sim.hardware import WAN_DEFAULT, preset
from sglang_pdd.sim.loadsweep import load_sweep
from sglang_pdd.sim.metrics import Sla
from sglang_pdd.sim.plots import plot_load_sweep
from sglang_pdd.sim.report import format_table
from sglang_pdd.sim.scenarios import ClusterSpec, standard_scenarios, with_counts
from sglang_pdd.sim.sizing import compare_designs
from sglang_pdd.sim.workload import (conversation_config, generate_agentic_trace, ideal_prefix_hit_rate, load_trace,
                                 per_request_hit_rates, realistic_agentic_config)

CHIPS = {"llama3-70b": ("h100", "h20"), "deepseek-v3": ("h200", "h20")}


def traces(a):
    out = []
    if "mooncake" in a.traces:
        out.append(("mooncake", list(load_trace(require_trace(a.mooncake, "--mooncake"), a.n)), False))
    if "agentic" in a.traces:
        out.append(("agentic", list(generate_agentic_trace(realistic_agentic_config(num_requests=a.n, seed=a.seed))),
                    True))
    if "conversation" in a.traces:
        out.append(("conversation", list(generate_agentic_trace(conversation_config(num_requests=a.n, seed=a.seed))),
                    True))
    return out


def markdown(paths) -> str:
    """The docs/sim-notebook.md table from the JSON files this script wrote."""
    lines = ["| trace | model, WAN | mean hit / reusable | cheapest PD (P/D, $/h) | cheapest PDD (P/RLD/MD, $/h) | "
             "verdict | knee good r/s PD / PDD | knee BCR PD / PDD | PDD WAN util, MD hit, RLD tok% |",
             "|---|---|---|---|---|---|---|---|---|"]
    for path in paths:
        with open(path) as f:
            rows = json.load(f)
        for r in rows:
            pd, pdd = r.get("pd_same_dc"), r.get("pdd_drc_adaptive")
            fmt_pd = f"{pd['n_prefill']}/{pd['n_md']}, {pd['cost_per_hour']:.0f}" if pd else "none"
            fmt_pdd = (f"{pdd['n_prefill']}/{pdd['n_rld']}/{pdd['n_md']}, {pdd['cost_per_hour']:.1f}"
                       if pdd else "none")
            top = 3.0 * r.get("rate_scale", 1.0)  # the sweep's highest scale (default --scales)

            def knee(d, key, f):
                if not d:
                    return "-"
                beyond = ">=" if d.get("knee_scale") is not None and d["knee_scale"] >= top else ""
                return beyond + format(d[key], f)
            kg = f"{knee(pd, 'knee_goodput_rps', '.2f')} / {knee(pdd, 'knee_goodput_rps', '.2f')}"
            kb = f"{knee(pd, 'knee_bcr', '.0f')} / {knee(pdd, 'knee_bcr', '.0f')}"
            extra = "-"
            if pdd:
                s = pdd["summary"]
                extra = f"{s['wan_util']:.2f}, {s['mean_md_hit']:.2f}, {100 * s['rld_token_share']:.1f}"
            verdict = {"pd": "**PD wins**", "none": "neither meets it"}.get(r["winner"]) or (
                "**PDD wins** (no RLD: xDC PD + DRC)" if pdd["n_rld"] == 0 else "**PDD wins**")
            x = r.get("rate_scale", 1.0)
            lines.append(f"| {r['trace']}{f' x{x:g}' if x != 1 else ''} | {r['model']}, {r['wan_gbps']:g} Gbps | {r['mean_hit']:.2f} / {r['reusable']:.2f} | {fmt_pd} | "
                         f"{fmt_pdd} | {verdict} | {kg} | {kb} | {extra} |")
    return "\n".join(lines)


def summary_plot(paths, out_png: str) -> str:
    """Cost of the cheapest PD and PDD mix meeting the SLA, per trace and model class."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = []
    for path in paths:
        with open(path) as f:
            rows += json.load(f)
    labels = [f"{r['trace']}{' x%g' % r['rate_scale'] if r.get('rate_scale', 1) != 1 else ''}\n{r['model']}"
              f"\n{r['wan_gbps']:g} Gbps" for r in rows]
    pd = [r["pd_same_dc"]["cost_per_hour"] if r.get("pd_same_dc") else 0 for r in rows]
    pdd = [r["pdd_drc_adaptive"]["cost_per_hour"] if r.get("pdd_drc_adaptive") else 0 for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(rows)), 4.8))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], pd, 0.4, label="cheapest PD meeting the SLA")
    ax.bar([i + 0.2 for i in x], pdd, 0.4, label="cheapest PDD meeting the SLA (0 = none)")
    for i, r in enumerate(rows):
        ax.text(i, max(pd[i], pdd[i]) * 1.02 + 1, {"pd": "PD", "pdd": "PDD", "none": "-"}[r["winner"]],
                ha="center", fontweight="bold")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("$/h of hardware")
    ax.set_title("Who wins on cost at the same SLA (90% attainment)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--markdown":
        print(markdown(sys.argv[2:]))
        return 0
    if len(sys.argv) > 2 and sys.argv[1] == "--summary-plot":
        print(summary_plot(sys.argv[3:], sys.argv[2]))
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(CHIPS), default="llama3-70b")
    ap.add_argument("--traces", default="mooncake,agentic,conversation")
    ap.add_argument("--mooncake", default=MOONCAKE_TRACE)
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wan-gbps", type=float, default=WAN_DEFAULT.gbps)
    ap.add_argument("--prefill-min", type=int, default=1)
    ap.add_argument("--prefill-max", type=int, default=12)
    ap.add_argument("--rld-max", type=int, default=2)
    ap.add_argument("--md-max", type=int, default=12)
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--ttft-slo", type=float, default=2.0)
    ap.add_argument("--tpot-slo", type=float, default=0.06)
    ap.add_argument("--itl-slo", type=float, default=1.0)
    ap.add_argument("--scales", default="0.5,0.75,1,1.25,1.5,2,2.5,3", help="load sweep, relative to --rate-scale")
    ap.add_argument("--rate-scale", type=float, default=1.0, help="size for the trace replayed this much faster")
    ap.add_argument("--out", default="artifacts/sim_report", help="docs/img to replace the docs' figures")
    a = ap.parse_args()
    chip_a, chip_b = CHIPS[a.model]
    spec = ClusterSpec(chip_a=preset(a.model, chip_a), chip_b=preset(a.model, chip_b),
                       wan=replace(WAN_DEFAULT, gbps=a.wan_gbps))
    by = {c.name: c for c in standard_scenarios(spec)}
    sla = Sla(a.ttft_slo, a.tpot_slo, a.itl_slo)
    os.makedirs(a.out, exist_ok=True)
    tag = f"{a.model}_{a.wan_gbps:g}g" + (f"_x{a.rate_scale:g}" if a.rate_scale != 1 else "")
    results = []
    for label, trace, closed in traces(a):
        arrivals = "sessions" if closed else "open"
        hits = per_request_hit_rates(trace)
        print(f"## {label} ({a.model}, P/RLD {chip_a}, MD {chip_b}, WAN {a.wan_gbps:g} Gbps): {len(trace)} requests, "
              f"mean input {sum(r.input_length for r in trace) / len(trace):.0f}, per-request hit "
              f"{sum(hits) / len(hits):.2f}, reusable prefix {ideal_prefix_hit_rate(trace):.2f}", flush=True)
        bar = tqdm(desc=f"sizing {label}", unit="sim", file=sys.stderr)
        v = compare_designs(by["pd_same_dc"], by["pdd_drc_adaptive"], trace, sla, a.target,
                            range(a.prefill_min, a.prefill_max + 1), range(0, a.rld_max + 1), a.md_max,
                            progress=lambda: bar.update(), rate_scale=a.rate_scale)
        bar.close()
        print(v.message, flush=True)
        for w in v.warnings:
            print(f"warning: {w}", flush=True)
        row = {"trace": label, "model": a.model, "wan_gbps": a.wan_gbps, "rate_scale": a.rate_scale, "winner": v.winner, "message": v.message,
               "requests": len(trace), "mean_hit": sum(hits) / len(hits), "reusable": ideal_prefix_hit_rate(trace)}
        knees = []
        for name, res in (("pd_same_dc", v.pd), ("pdd_drc_adaptive", v.pdd)):
            if res is None:
                continue
            row[name] = {"n_prefill": res.n_prefill, "n_rld": res.n_rld, "n_md": res.n_md,
                         "cost_per_hour": res.cost_per_hour, "summary": asdict(res.summary)}
            cfg = with_counts(by[name], res.n_prefill, res.n_rld, res.n_md)
            cfg = replace(cfg, name=f"{name} {res.n_prefill}P/{res.n_rld}R/{res.n_md}D")
            scales = [a.rate_scale * float(x) for x in a.scales.split(",")]
            bar = tqdm(total=len(scales), desc=f"load sweep {label} {name}", file=sys.stderr)
            k = load_sweep(cfg, trace, sla, scales, a.target, progress=lambda: bar.update(), arrivals=arrivals)
            bar.close()
            knees.append(k)
            row[name].update(knee_goodput_rps=k.knee_goodput_rps, knee_bcr=k.knee_bcr,
                             knee_scale=k.knee.rate_scale if k.knee else None)
            # Handoff modes at the sized PDD mix: where stalls differ.
        if v.pdd is not None:
            modes = [with_counts(by[n], v.pdd.n_prefill, v.pdd.n_rld, v.pdd.n_md)
                     for n in ("pdd_drc_oneshot", "pdd_drc_catchup", "pdd_drc_adaptive")]
            from sglang_pdd.sim.cluster import run_scenario
            sums = [run_scenario(c, trace, sla, rate_scale=a.rate_scale, arrivals=arrivals) for c in modes]
            if v.pd is not None:
                sums.insert(0, v.pd.summary)
            print(format_table(sums), flush=True)
            row["modes"] = [asdict(s) for s in sums]
        if knees:
            png = plot_load_sweep(knees, f"{label}, {a.model}, WAN {a.wan_gbps:g} Gbps, sized at x{a.rate_scale:g}",
                                  os.path.join(a.out, f"sim_sweep_{label}_{tag}.png"))
            print(f"wrote {png}")
        for k in knees:
            print(f"{k.scenario}: ${k.cost_per_hour:.1f}/h, knee goodput {k.knee_goodput_rps:.2f} r/s "
                  f"(x{k.knee.rate_scale if k.knee else 0:g}), knee BCR {k.knee_bcr:.0f}", flush=True)
        results.append(row)
        with open(os.path.join(a.out, f"sim_report_{tag}.json"), "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
