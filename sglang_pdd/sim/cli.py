"""Command line: `python -m sglang_pdd.sim {compare,size,sweep,rld-sweep,bathtub,gen-trace} ...`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace
from typing import List, Optional

from tqdm import tqdm

from sglang_pdd.sim.workload import (BLOCK_TOKENS, AgenticTraceConfig, TraceRequest, conversation_config,
                                  generate_agentic_trace, load_trace, realistic_agentic_config,
                                  report_agentic_config, report_scenario_config, save_trace)
from sglang_pdd.router.policy import PathMode

from .bathtub import sweep
from .cluster import ARRIVALS, P_PLACEMENTS, run_scenario
from .hardware import (CHIPS, KV_DTYPES, MLA_KERNELS, MODELS, WAN_DEFAULT, WAN_PRICE_PER_GBPS_HOUR, HardwareProfile, preset,
                       smallest_group)
from .loadsweep import load_sweep
from .metrics import Sla
from .plots import plot_bathtub, plot_comparison, plot_load_sweep
from .report import format_table
from .rldsweep import choose_default, rld_admission_sweep
from .scenarios import BASELINES, DESIGN_LABELS, ClusterSpec, standard_scenarios
from .sizing import offered_rps, size_cluster, size_designs, verdicts_over_seeds
from .traces import TILE_MODES, arrivals_label, effective_arrivals, tile_trace, tiling_label


def _add_common(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", help="JSONL trace (timestamp, input_length, output_length, hash_ids)")
    src.add_argument("--agentic", type=int, metavar="N",
                     help="generate N agentic requests (realistic hits: ~0.72 per request)")
    src.add_argument("--agentic-report", type=int, metavar="N",
                     help="generate N agentic requests with the report's hits (~80%% at >= 90%%)")
    src.add_argument("--report-scenario", type=int, metavar="N",
                     help="generate N requests of the report's scenario: ~64K tokens in all, ~1K output, "
                          "~77%% at >= 90%% prefix hit, agent sessions")
    src.add_argument("--conversation", type=int, metavar="N",
                     help="generate N conversation-like requests (~36%% reusable prefix)")
    p.add_argument("--agentic-session-rate", type=float, default=None,
                   help="new sessions per second of the generator (default: the generator's)")
    p.add_argument("--rate-scale", type=float, default=1.0,
                   help="replay arrivals this many times faster (2 = twice the offered load)")
    p.add_argument("--arrivals", choices=ARRIVALS, default="sessions",
                   help="sessions (default): session starts at their trace times, no next turn before the "
                        "previous turn's answer (a recorded gap kept, a generator's think time counted from the "
                        "answer); open: every request at its trace time, answered or not (a trace without sessions "
                        "replays the same either way)")
    p.add_argument("--limit", type=int, help="use only the first N requests of --trace")
    p.add_argument("--tile", type=int, default=1, metavar="K",
                   help="K copies of the trace side by side (other users: own prefixes and sessions), K times "
                        "the arrival rate with the same per-session timing; for fleets at scale")
    p.add_argument("--tile-mode", choices=TILE_MODES, default="spread",
                   help="where the copies sit in time: spread (default) = each copy rotated by k/K of the trace, "
                        "whole sessions at a time, so bursts do not coincide; lockstep = each copy a fraction of one "
                        "mean gap after the last, every burst K times at once (a what-if)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill", type=int, default=ClusterSpec.n_prefill)
    p.add_argument("--rld", type=int, default=ClusterSpec.n_rld)
    p.add_argument("--md", type=int, default=ClusterSpec.n_md)
    p.add_argument("--model", choices=sorted(MODELS), default="llama3-70b", help="model class of the presets")
    p.add_argument("--chip-a", choices=sorted(CHIPS), default="h100", help="preset chip of P, RLD and PD's D")
    p.add_argument("--chip-b", choices=sorted(CHIPS), default="h20", help="preset chip of MD")
    p.add_argument("--rld-chip", choices=sorted(CHIPS), default=None, help="preset chip of RLD (default: --chip-a)")
    p.add_argument("--rld-chips", type=int, default=0,
                   help="chips per RLD instance, any count (e.g. 3); 0 = the smallest power of two "
                        "that holds the weights with room for KV")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="bf16",
                   help="KV cache dtype of deepseek-v3: bf16 (576 x 2 B a layer, default) or fp8 (FlashMLA's "
                        "656 B a layer): pools, host tier, KV read and WAN bytes scale with it; deepseek-v4-pro's "
                        "KV is its own fp8 layout either way")
    p.add_argument("--mla-kernel", choices=MLA_KERNELS, default="flashmla",
                   help="MLA decode attention efficiency: flashmla = FlashMLA's published figures (default), "
                        "generic = 0.15 of peak, what PyTorch's generic kernels reached on an H200 (sensitivity)")
    p.add_argument("--decode-attn-scale", type=float, default=1.0,
                   help="multiply the presets' decode attention compute (a free-form sensitivity)")
    p.add_argument("--host-cache", choices=("on", "off", "p"), default="on",
                   help="host (DRAM) tier behind the prefix caches, as SGLang's HiCache: on P and MD (default), "
                        "off, or on P only")
    p.add_argument("--p-placement", choices=P_PLACEMENTS, default="router",
                   help="P placement of every design: router = router/backends/placement.py's pick_prefill (default); "
                        "what-ifs: flows (the router's earlier rule), backlog, round_robin")
    p.add_argument("--rld-max-running", type=int, default=ClusterSpec.rld_max_running,
                   help="the router's RLD admission (its --rld-max-running): RLD's load in the path decision "
                        "and handoff mode; not RLD's batch cap")
    p.add_argument("--path-mode", choices=[m.value for m in PathMode], default=ClusterSpec.path_mode.value,
                   help="the router's --path-mode: fit = P->MD whenever P's queue + prefill + the WAN fit the TTFT "
                        "budget, RLD for the rest; relay_first = an idle RLD takes every request")
    p.add_argument("--profile-a", help="JSON hardware profile for datacenter A (overrides --model/--chip-a)")
    p.add_argument("--profile-b", help="JSON hardware profile for datacenter B (overrides --model/--chip-b)")
    p.add_argument("--wan-gbps", type=float, default=WAN_DEFAULT.gbps)
    p.add_argument("--wan-latency-ms", type=float, default=WAN_DEFAULT.one_way_latency_s * 1e3, help="one way")
    p.add_argument("--wan-jitter-ms", type=float, default=WAN_DEFAULT.jitter_s * 1e3)
    p.add_argument("--wan-price-per-gbps-hour", type=float, default=WAN_PRICE_PER_GBPS_HOUR,
                   help="the WAN's lease, in every cross-datacenter design's cost (an estimate; use your quote)")
    p.add_argument("--catch-up-threshold", type=int, default=64)
    p.add_argument("--md-staging-mb", type=float, default=None,
                   help="KV of rooms in flight to one MD, at most (MD's --pdd-md-staging-mb), every design; "
                        "charged when a transfer starts; default: the real MD's, a quarter of MD's KV pool")
    p.add_argument("--keep-finished-kv", action=argparse.BooleanOptionalAction, default=True,
                   help="KV of a request that ended on RLD still lands in MD's DRC, as the real router "
                        "releases MD's room with keep_kv (--no-keep-finished-kv: the what-if that cancels it)")
    p.add_argument("--ttft-slo", type=float, default=Sla().ttft_s, help="seconds")
    p.add_argument("--tpot-slo", type=float, default=Sla().tpot_s, help="seconds")
    p.add_argument("--itl-slo", type=float, default=None,
                   help="seconds; longest inter-token gap allowed by the SLA (a handoff stall, a decode step, "
                        "a step held by an extend)")
    p.add_argument("--out", default="artifacts/sim", help="output directory for PNG/JSON")


def _preset(a, chip: str, chips: int = 0, host_cache: bool = True) -> HardwareProfile:
    kv_dtype = "bf16" if a.model == "deepseek-v4-pro" else a.kv_dtype
    hw = preset(a.model, chip, chips, mla_kernel=a.mla_kernel, host_cache=host_cache, kv_dtype=kv_dtype)
    return replace(hw, decode_attn_s_per_kv_token=hw.decode_attn_s_per_kv_token * a.decode_attn_scale)


def _spec(a) -> ClusterSpec:
    host = a.host_cache != "off"
    chip_a = HardwareProfile.load(a.profile_a) if a.profile_a else _preset(a, a.chip_a, host_cache=host)
    chip_b = (HardwareProfile.load(a.profile_b) if a.profile_b
              else _preset(a, a.chip_b, host_cache=a.host_cache == "on"))
    wan = replace(WAN_DEFAULT, gbps=a.wan_gbps, one_way_latency_s=a.wan_latency_ms / 1e3,
                  jitter_s=a.wan_jitter_ms / 1e3, price_per_gbps_hour=a.wan_price_per_gbps_hour)
    rld_hw = None
    if a.rld_chip or a.rld_chips:
        if a.profile_a:
            raise SystemExit("--rld-chip/--rld-chips derive RLD from the presets; not with --profile-a")
        rld_hw = _preset(a, a.rld_chip or a.chip_a, a.rld_chips, host_cache=host)
    return ClusterSpec(n_prefill=a.prefill, n_rld=a.rld, n_md=a.md, chip_a=chip_a, chip_b=chip_b, wan=wan,
                       rld_hw=rld_hw, p_placement=a.p_placement, rld_max_running=a.rld_max_running,
                       path_mode=PathMode(a.path_mode),
                       catch_up_threshold_tokens=a.catch_up_threshold, md_staging_mb=a.md_staging_mb,
                       keep_finished_kv=a.keep_finished_kv, seed=a.seed)


def _trace(a) -> (str, List[TraceRequest]):
    label, trace = _base_trace(a)
    if a.tile > 1:
        # a lockstep run's files never overwrite a spread run's
        tag = "" if a.tile_mode == "spread" else a.tile_mode
        # A generated trace is redrawn by its seed; a trace file's seed places the copies.
        seed = a.seed if a.trace else 0
        return f"{label}x{a.tile}{tag}", tile_trace(trace, a.tile, a.tile_mode, seed=seed)
    return label, trace


def _setup(a, label: str, trace) -> dict:
    """What the results were run on, in every JSON the commands write."""
    return dict(trace=label, requests=len(trace), tile=a.tile, tile_mode=a.tile_mode,
                arrivals=effective_arrivals(trace, a.arrivals), arrivals_requested=a.arrivals, rate_scale=a.rate_scale)


def _header(a, label: str, trace, rate: bool = True) -> str:
    """The trace line every command prints: the trace, its tiling and how it arrives."""
    scale = f" x{a.rate_scale:g} rate" if rate else ""
    return (f"{label}: {len(trace)} requests{scale}, {tiling_label(a.tile, a.tile_mode)}, "
            f"{arrivals_label(trace, a.arrivals)}")


def _base_trace(a) -> (str, List[TraceRequest]):
    if a.trace:
        return os.path.basename(a.trace), list(load_trace(a.trace, a.limit))
    rate = {} if a.agentic_session_rate is None else {"session_rate_per_s": a.agentic_session_rate}
    if a.conversation:
        cfg = conversation_config(num_requests=a.conversation, seed=a.seed, **rate)
        return f"conversation{a.conversation}", list(generate_agentic_trace(cfg))
    if a.report_scenario:
        cfg = report_scenario_config(num_requests=a.report_scenario, seed=a.seed, **rate)
        return f"report_scenario{a.report_scenario}", list(generate_agentic_trace(cfg))
    if a.agentic_report:
        cfg = report_agentic_config(num_requests=a.agentic_report, seed=a.seed, **rate)
        return f"agentic_report{a.agentic_report}", list(generate_agentic_trace(cfg))
    n = a.agentic or 5000
    cfg = realistic_agentic_config(num_requests=n, seed=a.seed, **rate)
    return f"agentic{n}", list(generate_agentic_trace(cfg))


def _sla(a) -> Sla:
    return Sla(a.ttft_slo, a.tpot_slo, a.itl_slo)


def cmd_compare(a) -> int:
    label, trace = _trace(a)
    sla = _sla(a)
    scenarios = standard_scenarios(_spec(a))
    summaries = [run_scenario(cfg, trace, sla, a.rate_scale, a.arrivals)
                 for cfg in tqdm(scenarios, desc=f"simulating {label}", file=sys.stderr)]
    print(f"# {_header(a, label, trace)}, SLA TTFT <= {sla.ttft_s}s, "
          f"TPOT <= {sla.tpot_s * 1e3:.0f}ms" + (f", ITL <= {sla.max_itl_s * 1e3:.0f}ms" if sla.max_itl_s else ""))
    print(format_table(summaries))
    os.makedirs(a.out, exist_ok=True)
    png = plot_comparison(summaries, f"{label} ({len(trace)} requests)", os.path.join(a.out, f"compare_{label}.png"))
    with open(os.path.join(a.out, f"compare_{label}.json"), "w") as f:
        json.dump([dict(asdict(s), setup=_setup(a, label, trace)) for s in summaries], f, indent=1)
    print(f"wrote {png}")
    return 0


def _print_edges(edges) -> None:
    for e in edges:
        print(f"warning: {e}; a wider range may hold a cheaper mix")


def _print_offered(a, trace, summaries) -> None:
    """With turns following answers a design's offered rate is its own; it matches the trace's
    only over many session lifetimes (a few long sessions are nearly a fixed population, and a
    slower design then gets less load). Printed so that a verdict resting on it shows."""
    if effective_arrivals(trace, a.arrivals) != "sessions" or not summaries:
        return
    print(f"offered r/s, turns after answers (the trace at its timestamps: {offered_rps(trace, a.rate_scale):.2f}): "
          + ", ".join(f"{s.scenario} {s.offered_rps:.2f}" for s in summaries))


def _mix(res) -> str:
    c = res.summary
    return (f"P={res.n_prefill} RLD={res.n_rld} MD/D={res.n_md} ({c.gpus} GPUs), ${res.cost_per_hour:.1f}/h "
            f"(WAN lease ${c.wan_lease_per_hour:.1f}/h), SLA {100 * c.sla_attainment:.1f}%, BCR {c.bcr:.0f}")


def _size_path_modes(a) -> None:
    """``sim size`` sizes PDD under ``--path-modes`` (default: every mode), or under the one
    ``--path-mode`` names; both at once would leave one of them unread, so that is refused."""
    if a.path_mode is not None and a.path_modes is not None:
        raise SystemExit(f"sim size: --path-mode {a.path_mode} and --path-modes {a.path_modes} conflict: give "
                         f"--path-mode to size PDD under one mode, or --path-modes for a list, not both")
    if a.path_mode is not None:
        a.path_modes = a.path_mode
    elif a.path_modes is None:
        a.path_modes = ",".join(m.value for m in PathMode)
    a.path_mode = a.path_mode or ClusterSpec.path_mode.value


def cmd_size(a) -> int:
    _size_path_modes(a)
    label, trace = _trace(a)
    sla = _sla(a)
    spec = _spec(a)
    by_name = {c.name: c for c in standard_scenarios(spec)}
    base = by_name[a.scenario]
    lo_p, hi_p = (int(x) for x in a.prefill_range.split(":"))
    lo_r, hi_r = (int(x) for x in a.rld_range.split(":"))
    bar = tqdm(desc=f"sizing {label}", unit="sim", file=sys.stderr)
    if base.kind == "pdd":
        return _size_pdd(a, label, trace, sla, spec, by_name, bar, (lo_p, hi_p), (lo_r, hi_r))
    best = size_cluster(base, trace, sla, a.target, range(lo_p, hi_p + 1), range(lo_r, hi_r + 1), a.md_max,
                        progress=lambda: bar.update(), rate_scale=a.rate_scale, arrivals=a.arrivals)
    bar.close()
    if best is None:
        print(f"# {_header(a, label, trace)}")
        print(f"no mix within the ranges reaches {a.target:.0%} SLA attainment")
        return 1
    print(f"# {_header(a, label, trace)}")
    print(f"cheapest {a.scenario} meeting {a.target:.0%} SLA on {label}: {_mix(best)}")
    _print_edges(best.edges)
    _print_offered(a, trace, [best.summary])
    print(format_table([best.summary]))
    return 0


def _size_pdd(a, label, trace, sla, spec, by_name, bar, p_range, r_range) -> int:
    """PDD under each path mode and every baseline, sized on each seed's trace; the verdicts
    over the seeds (a win on every seed, else a tie)."""
    modes = [PathMode(m) for m in a.path_modes.split(",")]
    seeds = [int(x) for x in a.seeds.split(",")] if a.seeds else [a.seed]
    hw = {"P": spec.chip_a, "RLD": spec.rld_hw or spec.chip_a, "MD": spec.chip_b}
    groups = ", ".join(f"{role} {h.name}" for role, h in hw.items())
    least = ""
    if not a.profile_a:
        least = f" (least a {a.model} group can be on {a.rld_chip or a.chip_a}: {smallest_group(a.model, a.rld_chip or a.chip_a)})"
    if a.trace and len(seeds) > 1:
        print(f"# seeds on a trace file: {seed_effect(a)}")
    sizings, found = [], False
    built = {a.seed: (label, trace, by_name)}  # the caller's, for --seed
    for seed in seeds:
        sa = a if seed == a.seed else _args_with(a, seed=seed)
        if seed not in built:
            built[seed] = (*_trace(sa), {c.name: c for c in standard_scenarios(_spec(sa))})
        label, trace, by_name = built[seed]
        # Never recommend PDD without sizing every baseline for the same SLA: name each.
        bases = {n: by_name[n] for n in BASELINES}
        bases[a.scenario] = by_name[a.scenario]
        v = size_designs(bases, a.scenario, trace, sla, a.target, range(p_range[0], p_range[1] + 1),
                         range(r_range[0], r_range[1] + 1), a.md_max, progress=lambda: bar.update(),
                         rate_scale=a.rate_scale, arrivals=a.arrivals, path_modes=modes)
        sizings.append(v)
        print(f"# seed {seed}: {_header(sa, label, trace)}, "
              f"target {a.target:.0%} SLA attainment; instances: {groups}{least}; WAN {spec.wan.gbps:g} Gbps, "
              f"lease ${spec.wan.lease_per_hour:.1f}/h")
        for mode, res in v.pdd_by_mode.items():
            print(f"cheapest {a.scenario} with --path-mode {mode}: "
                  + (_mix(res) if res is not None else "none in the searched ranges"))
        print(f"PDD stands as --path-mode {v.pdd_mode}" if v.pdd_mode else "PDD: no mode reaches the target")
        for name, res in v.results.items():
            tag = DESIGN_LABELS.get(name, name)
            print(f"cheapest {name} ({tag}): " + (_mix(res) if res is not None else "none in the searched ranges"))
        for vd in v.verdicts:
            print(f"verdict {vd.message}")
        _print_edges(v.warnings)
        _print_offered(sa, trace, [r.summary for r in v.results.values() if r is not None])
        shown = [r.summary for r in v.results.values() if r is not None]
        if shown:
            print(format_table(shown))
        found = found or any(r is not None for r in v.results.values())
    bar.close()
    if len(sizings) > 1:
        print(f"# over seeds {','.join(map(str, seeds))}: PDD stood as "
              + ", ".join(f"{s.pdd_mode}" for s in sizings))
        for vd in verdicts_over_seeds(sizings):
            print(f"verdict over seeds {vd.message}")
    return 0 if found else 1


def seed_effect(a) -> str:
    """What a seed changes when the trace is a file (a generated trace is redrawn by it)."""
    if a.tile > 1 and a.tile_mode == "spread":
        return (f"each seed draws where the {a.tile} copies of the trace sit (offsets in [k/K, (k+1)/K) of its "
                f"period; seed 0 the even ones) and the WAN's jitter; the requests are the file's")
    return (f"only the WAN's jitter (uniform in [0, {a.wan_jitter_ms:g} ms] a transfer) changes: the requests are "
            f"the file's{'' if a.tile <= 1 else ' and lockstep tiling draws nothing'}; tile it (--tile K, spread) "
            f"for seeds that place the copies differently")


def _args_with(a, **changes):
    """A copy of parsed arguments with some changed."""
    return argparse.Namespace(**{**vars(a), **changes})


def cmd_rld_sweep(a) -> int:
    label, trace = _trace(a)
    sla = _sla(a)
    cfg = {c.name: c for c in standard_scenarios(_spec(a))}[a.scenario]
    values = [int(x) for x in a.values.split(",")]
    bar = tqdm(total=len(values), desc=f"rld admission sweep {label}", file=sys.stderr)
    points = rld_admission_sweep(cfg, trace, sla, values, rate_scale=a.rate_scale, progress=lambda: bar.update(),
                                 arrivals=a.arrivals)
    bar.close()
    print(f"# {_header(a, label, trace)}, {cfg.n_prefill} P / {cfg.n_rld} RLD / {cfg.n_md} MD, "
          f"WAN {cfg.wan.gbps:g} Gbps; --rld-max-running swept (RLD's batch cap stays "
          f"{cfg.rld_hw.max_running_requests})")
    print(f"{'rld-max-running':>15} {'P->MD %':>8} {'via RLD %':>9} {'RLD tok %':>9} {'stall p50 ms':>12} "
          f"{'stall p99 ms':>12} {'TTFT p90':>8} {'SLA %':>6} {'refused':>7}")
    for p in points:
        s = p.summary
        print(f"{p.rld_max_running:>15d} {100 * p.p_md_share:>8.1f} {100 * p.via_rld_share:>9.1f} "
              f"{100 * s.rld_token_share:>9.1f} {1e3 * s.stall_p50:>12.0f} {1e3 * s.stall_p99:>12.0f} "
              f"{s.ttft_p90:>8.2f} {100 * s.sla_attainment:>6.1f} {s.md_refused:>7d}")
    pick = choose_default(points, a.max_stall_p99)
    print(f"choice: --rld-max-running {pick.rld_max_running} (the least RLD work with the stall's p99 <= "
          f"{a.max_stall_p99:g} s and SLA attainment within 0.5 points of the sweep's best)")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"rld_sweep_{label}.json"), "w") as f:
        json.dump([{"rld_max_running": p.rld_max_running, "summary": asdict(p.summary),
                    "setup": _setup(a, label, trace)} for p in points], f, indent=1)
    return 0


def cmd_sweep(a) -> int:
    label, trace = _trace(a)
    sla = _sla(a)
    names = a.scenarios.split(",")
    scenarios = [c for c in standard_scenarios(_spec(a)) if c.name in names]
    scales = [float(x) for x in a.scales.split(",")]
    # refined, the count of runs depends on where each knee falls
    bar = tqdm(total=None if a.knee_resolution > 0 else len(scales) * len(scenarios), desc=f"load sweep {label}",
               unit="sim", file=sys.stderr)
    knees = [load_sweep(cfg, trace, sla, scales, a.target, progress=lambda: bar.update(), arrivals=a.arrivals,
                        resolution=a.knee_resolution, floor=a.knee_floor) for cfg in scenarios]
    bar.close()
    print(f"# {_header(a, label, trace, rate=False)}; goodput vs offered load; "
          f"knee = highest rate with >= {a.target:.0%} SLA attainment")
    print(f"{'scenario':<20} {'x rate':>6} {'offered r/s':>11} {'good r/s':>8} {'SLA%':>6} {'TTFT p90':>8}")
    for k in knees:
        for p in k.points:
            mark = " <- knee" if p is k.knee else ""
            print(f"{k.scenario:<20} {p.rate_scale:>6.2f} {p.offered_rps:>11.2f} {p.goodput_rps:>8.2f} "
                  f"{100 * p.sla_attainment:>6.1f} {p.ttft_p90:>8.2f}{mark}")
    print(f"{'scenario':<20} {'$/h':>7} {'knee good r/s':>13} {'knee BCR':>9}")
    for k in knees:
        print(f"{k.scenario:<20} {k.cost_per_hour:>7.1f} {k.knee_goodput_rps:>13.2f} {k.knee_bcr:>9.1f}")
    os.makedirs(a.out, exist_ok=True)
    png = plot_load_sweep(knees, f"{label}: goodput vs offered load", os.path.join(a.out, f"sweep_{label}.png"))
    with open(os.path.join(a.out, f"sweep_{label}.json"), "w") as f:
        json.dump([{"scenario": k.scenario, "setup": _setup(a, label, trace), "cost_per_hour": k.cost_per_hour,
                    "knee_goodput_rps": k.knee_goodput_rps,
                    "knee_bcr": k.knee_bcr,
                    "points": [{"rate_scale": p.rate_scale, "offered_rps": p.offered_rps, "goodput_rps": p.goodput_rps,
                                "sla_attainment": p.sla_attainment, "summary": asdict(p.summary)} for p in k.points]}
                   for k in knees], f, indent=1)
    print(f"wrote {png}")
    return 0


def cmd_bathtub(a) -> int:
    sla = _sla(a)
    names = a.scenarios.split(",")
    scenarios = [c for c in standard_scenarios(_spec(a)) if c.name in names]
    hits = [float(h) for h in a.hits.split(",")]
    bar = tqdm(total=len(hits) * len(scenarios), desc="bathtub", file=sys.stderr)
    grid = [int(x) for x in a.sessions_grid.split(",")] if a.sessions_grid else None
    points = sweep(scenarios, hits, a.n, sla, sessions=a.sessions, input_tokens=a.input_tokens,
                   output_tokens=a.output_tokens, progress=lambda: bar.update(), sessions_grid=grid)
    bar.close()
    print(f"# closed loop: {a.sessions} sessions, {a.input_tokens} input / {a.output_tokens} output tokens, "
          f"hits in whole {BLOCK_TOKENS}-token blocks")
    print(f"{'scenario':<20} {'hit':>5} {'P hit':>6} {'MD hit':>7} {'good r/s':>8} {'@clients':>8} "
          f"{'sat. r/s':>8} {'P busy':>6} {'WAN util':>8}")
    for p in points:
        print(f"{p.scenario:<20} {p.target_hit:>5.3f} {p.mean_p_hit:>6.3f} {p.mean_md_hit:>7.3f} "
              f"{p.goodput_rps:>8.2f} {p.best_sessions:>8d} {p.throughput_rps:>8.2f} {p.prefill_util:>6.2f} "
              f"{p.wan_util:>8.2f}")
    png = plot_bathtub(points, os.path.join(a.out, "bathtub.png"))
    print(f"wrote {png}")
    return 0


def cmd_gen_trace(a) -> int:
    make = {"agentic": realistic_agentic_config, "agentic-report": report_agentic_config,
            "report-scenario": report_scenario_config, "conversation": conversation_config,
            "legacy-agentic": AgenticTraceConfig}[a.kind]
    rate = {} if a.session_rate is None else {"session_rate_per_s": a.session_rate}
    n = save_trace(generate_agentic_trace(make(num_requests=a.n, seed=a.seed, **rate)), a.output)
    print(f"wrote {n} requests to {a.output}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_pdd.sim", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("compare", help="same-DC PD vs cross-DC PD (with and without DRC) vs PDD variants on one trace")
    _add_common(p)
    p.set_defaults(fn=cmd_compare)
    p = sub.add_parser("size", help="cheapest instance mix of every design meeting an SLA-attainment target, "
                                    "and PDD's verdict against each baseline")
    _add_common(p)
    p.add_argument("--scenario", default="pdd_drc_adaptive")
    p.add_argument("--target", type=float, default=0.9, help="fraction of requests within the SLA")
    p.add_argument("--prefill-range", default="1:6")
    p.add_argument("--rld-range", default="0:2")
    p.add_argument("--md-max", type=int, default=8)
    p.add_argument("--path-modes", default=None,
                   help="PDD is sized under each of these router path modes (default: every mode, or the one "
                        "--path-mode names; not both); the cheapest stands for PDD")
    p.set_defaults(path_mode=None)  # read by _size_path_modes: given or not
    p.add_argument("--seeds", default=None,
                   help="comma-separated seeds (default: --seed): each seed's trace sized, then the verdicts "
                        "over them (a win on every seed, else a tie)")
    p.set_defaults(fn=cmd_size)
    p = sub.add_parser("sweep", help="goodput vs offered load (rate scale) and the knee")
    _add_common(p)
    p.add_argument("--scales", default="0.25,0.5,0.75,1,1.5,2,3,4")
    p.add_argument("--target", type=float, default=0.9, help="SLA attainment that defines the knee")
    p.add_argument("--scenarios", default="pd_same_dc,pdd_drc_adaptive")
    p.add_argument("--knee-resolution", type=float, default=0.0,
                   help="bisect each knee until the bracket (knee, first failing scale) is narrower than this "
                        "relative width (e.g. 0.05; the runs join the curve); 0: the grid's knee only")
    p.add_argument("--knee-floor", type=float, default=None,
                   help="with --knee-resolution: when even the lowest scale fails, look down to this scale")
    p.set_defaults(fn=cmd_sweep)
    p = sub.add_parser("rld-sweep", help="the router's RLD admission (--rld-max-running) swept: path mix, "
                                         "RLD share and handoff stall")
    _add_common(p)
    p.add_argument("--scenario", default="pdd_drc_adaptive")
    p.add_argument("--values", default="4,16,64,128,256,512")
    p.add_argument("--max-stall-p99", type=float, default=1.0,
                   help="the handoff stall's p99 bound (s) the printed choice keeps")
    p.set_defaults(fn=cmd_rld_sweep)
    p = sub.add_parser("bathtub", help="goodput within the SLA vs mean prefix hit rate")
    _add_common(p)
    p.add_argument("--hits", default="0,0.25,0.5,0.7,0.8,0.85,0.9,0.92,0.94,0.95,0.96,0.97,0.98,0.99,0.995",
                   help="target hit rates; realised hits round down to whole 512-token blocks")
    p.add_argument("--n", type=int, default=4000, help="requests per point (>= ~5x --sessions)")
    p.add_argument("--sessions", type=int, default=640,
                   help="closed-loop clients (each sends its next turn when the last one ended); "
                        "enough to fill the default cluster's decode slots")
    p.add_argument("--sessions-grid", default=None,
                   help="client counts tried per point (default: sessions/8, /4, /2, sessions); "
                        "goodput is the best of them, saturation throughput the largest")
    p.add_argument("--input-tokens", type=int, default=16_384)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--scenarios", default="pd_same_dc,xdc_pd,pdd_drc_adaptive")
    p.set_defaults(fn=cmd_bathtub)
    p = sub.add_parser("gen-trace", help="write a synthetic agentic trace as JSONL")
    p.add_argument("--n", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kind", choices=["agentic", "agentic-report", "report-scenario", "conversation", "legacy-agentic"], default="agentic")
    p.add_argument("--session-rate", type=float, default=None)
    p.add_argument("--output", required=True)
    p.set_defaults(fn=cmd_gen_trace)
    a = ap.parse_args(argv)
    return a.fn(a)
