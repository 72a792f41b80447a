"""Agentic workload against the real local PDD topology: WAN bytes with and without DRC,
hit rates on P and MD side by side, latency per path.

One LocalCluster (P + RLD in datacenter A, MD in datacenter B behind the emulated WAN,
the router) replays the SAME multi-turn workload twice in one run:

  pdd       default routing: DRC on, the router picks P->MD / P->RLD->MD / P->RLD only
  baseline  plain cross-DC PD: every request {"path": "p_md", "drc": false}, i.e. MD ignores
            its cache and the whole prompt crosses the WAN

Workload (deterministic, own generator: the library's ``generate_agentic_trace`` works in
512-token blocks, far too coarse for a 1k-vocab CPU model): sessions share one of a few
system prompts; turn k+1's prompt = turn k's prompt + turn k's *actual output ids* (from
the response) + a new tool-result block; outputs are short (tool calls); a few long-input
short-output outliers have unique content. Segments become token ids deterministically:
same segment key -> same tokens, ids in [3, 1024). Each variant uses its own token salt, so
neither variant's P or MD cache holds anything of the other's prompts (the baseline's
``drc: false`` ignores MD's cache anyway; the salt also keeps P's cache fair). ``ignore_eos``
makes every request produce exactly the requested number of tokens (checked).

``--target-hit`` (default 0.9) scales the per-turn appended blocks so the trace's *ideal* MD
hit rate (token-weighted over the non-outlier requests: what a cache holding every prior
prompt + output would hit) is that value; the measured rate is reported next to it.

Latency: requests are streamed, timed client-side. In this router every path's first token
comes from RLD (P->MD asks RLD for exactly one token, then MD continues), so TTFT is
same-datacenter for every path, baseline included. The time to the first token *MD*
produced ("TTFMD") is what a plain cross-DC PD client would see as its TTFT (prefill + the
whole prompt's KV over the WAN + one MD step), so it is reported too, with end-to-end.

    .venv/bin/python -m benchmarks.bench_agentic            # ~5-8 min
    .venv/bin/python -m benchmarks.bench_agentic --sessions 3 --turns 3 4    # smoke run

Prints tables and writes results.json, requests.jsonl and bench_agentic.png under --out.
"""

from __future__ import annotations

import argparse
import json
import logging
import queue
import random
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
from tqdm import tqdm

from benchmarks.common import greedy, timed_events
from sglang_pdd.launcher.http import get_json
from sglang_pdd.protocol import STATS

VOCAB = 1024
FIRST_TOKEN_ID = 3  # 0..2 are bos / eos / pad in the tiny model
PATHS = ("p_md", "p_rld_md", "p_rld_only")


# ----------------------------------------------------------------------------- workload
@dataclass
class WorkloadConfig:
    sessions: int = 8
    turns: tuple = (6, 8)  # turns per session, inclusive range
    system_prompts: int = 2
    system_tokens: int = 256
    first_user_tokens: tuple = (32, 128)
    tool_tokens: tuple = (32, 128)  # new block appended per turn (tool result / user)
    output_tokens: tuple = (8, 32)
    outliers: int = 2
    outlier_input_tokens: tuple = (1200, 2000)
    outlier_output_tokens: tuple = (1, 4)
    block_scale: float = 1.0  # multiplies first_user / tool block sizes (set by --target-hit)
    seed: int = 0


@dataclass
class Turn:
    new_block: int  # tokens appended before this turn (first user block on turn 0)
    output: int  # max_new_tokens (ignore_eos: exactly this many)


@dataclass
class Job:
    """One session (sequential turns) or one outlier (a single request)."""
    kind: str  # "session" | "outlier"
    index: int
    system: int = -1
    turns: list = field(default_factory=list)
    outlier_input: int = 0


def _draw(rng: random.Random, lo_hi: tuple, scale: float = 1.0) -> int:
    lo, hi = lo_hi
    return max(1, round((lo + rng.random() * (hi - lo)) * scale))


def build_jobs(cfg: WorkloadConfig) -> list[Job]:
    """Job list in submission order; outliers are spread among the sessions."""
    rng = random.Random(cfg.seed)
    jobs = []
    for s in range(cfg.sessions):
        n_turns = rng.randint(*cfg.turns)
        turns = [Turn(_draw(rng, cfg.first_user_tokens if k == 0 else cfg.tool_tokens, cfg.block_scale),
                      _draw(rng, cfg.output_tokens)) for k in range(n_turns)]
        jobs.append(Job("session", s, system=rng.randrange(cfg.system_prompts), turns=turns))
    for o in range(cfg.outliers):
        n_in = _draw(rng, cfg.outlier_input_tokens)
        pos = round((o + 1) * len(jobs) / (cfg.outliers + 1))
        jobs.insert(pos, Job("outlier", o, turns=[Turn(0, _draw(rng, cfg.outlier_output_tokens))],
                             outlier_input=n_in))
    return jobs


def segment_tokens(salt: str, key: tuple, n: int) -> list[int]:
    """Deterministic token ids of one segment: the same (salt, key) -> the same tokens."""
    rng = random.Random(f"{salt}|{'/'.join(map(str, key))}")
    return [rng.randrange(FIRST_TOKEN_ID, VOCAB) for _ in range(n)]


def ideal_hits(jobs: list[Job], cfg: WorkloadConfig) -> dict:
    """Hit rates an unbounded cache would get, from lengths alone, in submission order.

    MD holds prompt + output[:-1] of every request it decoded (SGLang caches a finished
    request's tokens except the last, whose KV was never computed); P holds prompts only.
    Prompts are sequences of segments (key, length); distinct keys are distinct tokens."""
    md_held, p_held = [], []
    rows = []

    def lcp(a, b):
        n = 0
        for (ka, la), (kb, lb) in zip(a, b):
            if ka != kb:
                break
            n += min(la, lb)
            if la != lb:
                break
        return n

    for job in jobs:
        if job.kind == "outlier":
            prompt = [(("outlier", job.index), job.outlier_input)]
            rows.append(("outlier", sum(l for _, l in prompt), 0, 0))
            p_held.append(prompt)
            continue
        prompt = [(("sys", job.system), cfg.system_tokens)]
        for k, turn in enumerate(job.turns):
            prompt = prompt + [(("new", job.index, k), turn.new_block)]
            n = sum(l for _, l in prompt)
            md = max((lcp(prompt, h) for h in md_held), default=0)
            p = max((lcp(prompt, h) for h in p_held), default=0)
            rows.append(("session", n, md, p))
            md_held.append(prompt + [(("out", job.index, k), turn.output - 1)])
            p_held.append(prompt)
            prompt = prompt + [(("out", job.index, k), turn.output)]
    sess = [r for r in rows if r[0] == "session"]
    tot = sum(r[1] for r in sess)
    return {"requests": len(rows), "session_requests": len(sess),
            "prompt_tokens": sum(r[1] for r in rows),
            "max_prompt_tokens": max(r[1] for r in rows),
            "md_hit_token_weighted": sum(r[2] for r in sess) / tot,
            "md_hit_mean": float(np.mean([r[2] / r[1] for r in sess])),
            "p_hit_token_weighted": sum(r[3] for r in sess) / tot,
            "ideal_wan_ratio_sessions": tot / max(1, tot - sum(r[2] for r in sess))}


def fit_block_scale(cfg: WorkloadConfig, target: float) -> WorkloadConfig:
    """Bisect block_scale so the ideal token-weighted MD hit rate of the sessions ~= target."""
    from dataclasses import replace

    lo, hi = 0.02, 20.0
    for _ in range(40):
        mid = (lo * hi) ** 0.5
        hit = ideal_hits(build_jobs(replace(cfg, block_scale=mid)), cfg)["md_hit_token_weighted"]
        lo, hi = (mid, hi) if hit > target else (lo, mid)
    return replace(cfg, block_scale=(lo * hi) ** 0.5)


# ----------------------------------------------------------------------------- client
@dataclass
class Record:
    variant: str
    kind: str
    job: int
    turn: int
    prompt_tokens: int
    requested: int
    completion_tokens: int = 0
    path: str = ""
    reason: str = ""
    md_cached_tokens: int = 0
    md_registration: str = "none"  # as the router reports it: "none" if MD never saw the request
    p_cached_tokens: int = 0
    wan_bytes: Optional[int] = None
    wan_bytes_saved: int = 0
    ttft_s: Optional[float] = None  # client-side, first token of the stream
    router_ttft_s: Optional[float] = None  # the router's own measure (meta_info)
    ttfmd_s: Optional[float] = None  # client-side, first token produced by MD
    e2e_s: float = 0.0
    handoff_at: Optional[int] = None
    handoff_mode: Optional[str] = None
    rld_tokens: int = 0
    md_tokens: int = 0
    fallbacks: list = field(default_factory=list)
    error: Optional[str] = None


def stream_generate(url: str, body: dict, timeout: float) -> tuple[list[dict], list[float], float]:
    """POST a streaming /generate; return (events, arrival times relative to send, e2e)."""
    events, times = [], []
    t0 = time.perf_counter()
    try:
        for t, event in timed_events(f"{url}/generate", {**body, "stream": True}, timeout=timeout):
            events.append(event)
            times.append(t - t0)
    except Exception as e:  # say how far the stream got (which leg stalled)
        last = events[-1]["meta_info"]["pdd"] if events else {}
        raise RuntimeError(f"{e!r} after {time.perf_counter() - t0:.0f}s, {len(events)} events; last pdd meta: "
                           f"{ {k: last.get(k) for k in ('path', 'md_cached_tokens', 'rld_tokens', 'md_tokens', 'handoff_mode', 'fallbacks')} }") from e
    return events, times, time.perf_counter() - t0


def run_request(router_url: str, variant: str, job: Job, turn: int, ids: list[int], max_new: int,
                options: Optional[dict], timeout: float) -> tuple[Record, list[int]]:
    rec = Record(variant, job.kind, job.index, turn, len(ids), max_new)
    body = {"input_ids": ids, "sampling_params": greedy(max_new)}
    if options:
        body["pdd_options"] = options
    try:
        events, times, rec.e2e_s = stream_generate(router_url, body, timeout)
    except Exception as e:  # one failed request is reported, the run goes on
        rec.error = repr(e)
        return rec, []
    if not events or "error" in events[-1]:
        rec.error = events[-1].get("error") if events else "empty stream"
        return rec, []
    final = events[-1]
    out = final["output_ids"]
    meta = final["meta_info"]
    pdd = meta["pdd"]
    rec.completion_tokens = meta["completion_tokens"]
    for k in ("path", "reason", "md_cached_tokens", "md_registration", "p_cached_tokens", "wan_bytes", "wan_bytes_saved",
              "handoff_at", "handoff_mode", "rld_tokens", "md_tokens", "fallbacks"):
        setattr(rec, k, pdd[k])
    rec.router_ttft_s = pdd["ttft_s"]
    rec.ttft_s = next((t for e, t in zip(events, times) if e.get("output_ids")), None)
    rec.ttfmd_s = next((t for e, t in zip(events, times)
                        if (e.get("meta_info", {}).get("pdd") or {}).get("md_tokens")), None)
    return rec, out


def replay(router_url: str, variant: str, jobs: list[Job], cfg: WorkloadConfig, salt: str,
           options: Optional[dict], concurrency: int, timeout: float) -> list[Record]:
    """Each worker takes the next job and runs its turns in order; turn k+1 is built from
    turn k's prompt + its actual output ids + the next new block."""
    todo: "queue.Queue[Job]" = queue.Queue()
    for job in jobs:
        todo.put(job)
    records, lock = [], threading.Lock()
    total = sum(len(j.turns) for j in jobs)
    bar = tqdm(total=total, desc=f"{variant:>8}", unit="req", file=sys.stderr)

    def worker():
        while True:
            try:
                job = todo.get_nowait()
            except queue.Empty:
                return
            if job.kind == "outlier":
                ids = segment_tokens(salt, ("outlier", job.index), job.outlier_input)
                rec, _ = run_request(router_url, variant, job, 0, ids, job.turns[0].output, options, timeout)
                with lock:
                    records.append(rec)
                bar.update(1)
                continue
            ids = segment_tokens(salt, ("sys", job.system), cfg.system_tokens)
            for k, turn in enumerate(job.turns):
                ids = ids + segment_tokens(salt, ("new", job.index, k), turn.new_block)
                rec, out = run_request(router_url, variant, job, k, ids, turn.output, options, timeout)
                with lock:
                    records.append(rec)
                bar.update(1)
                if rec.error:
                    bar.update(len(job.turns) - k - 1)
                    break  # the session cannot go on without this turn's output
                ids = ids + out

    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(worker) for _ in range(concurrency)]:
            f.result()
    bar.close()
    return records


# ----------------------------------------------------------------------------- metrics
def scrape_metrics(router_url: str) -> dict:
    """pdd:* samples of the router's Prometheus text, {name{labels}: value}."""
    with urllib.request.urlopen(f"{router_url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("pdd:") and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            if "_bucket" not in name and "_created" not in name:
                out[name] = float(value)
    return out


def delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if isinstance(v, (int, float))}


def wait_rooms_closed(control_url: str, key: bytes, timeout: float = 30.0) -> dict:
    deadline = time.time() + timeout
    stats = get_json(f"{control_url}{STATS.path()}", key=key)
    while stats.get("open_rooms") and time.time() < deadline:
        time.sleep(0.25)
        stats = get_json(f"{control_url}{STATS.path()}", key=key)
    return stats


def pct(values, q):
    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if values else None


def summarize(records: list[Record], md_delta: dict, metrics_delta: dict) -> dict:
    ok = [r for r in records if not r.error]
    md_served = [r for r in ok if r.path in ("p_md", "p_rld_md")]
    sess = [r for r in ok if r.kind == "session"]
    s = {"requests": len(records), "errors": len(records) - len(ok),
         "errors_detail": [r.error for r in records if r.error][:5],
         "completion_mismatch": sum(1 for r in ok if r.completion_tokens != r.requested),
         "fallbacks": sum(1 for r in ok if r.fallbacks),
         "paths": {p: sum(1 for r in ok if r.path == p) for p in PATHS},
         "outliers": sum(1 for r in ok if r.kind == "outlier"),
         "outliers_on_rld_only": sum(1 for r in ok if r.kind == "outlier" and r.path == "p_rld_only"),
         "non_outliers_on_rld_only": sum(1 for r in ok if r.kind != "outlier" and r.path == "p_rld_only"),
         "handoffs": sum(1 for r in ok if r.handoff_at is not None),
         "prompt_tokens": sum(r.prompt_tokens for r in ok),
         "wan_bytes": sum(r.wan_bytes or 0 for r in ok),
         "wan_bytes_saved": sum(r.wan_bytes_saved for r in md_served),
         "wan_bytes_sessions": sum(r.wan_bytes or 0 for r in sess),
         "wan_bytes_outliers": sum(r.wan_bytes or 0 for r in ok if r.kind == "outlier")}
    s["wan_bytes_if_no_drc"] = s["wan_bytes"] + s["wan_bytes_saved"]  # same run, counterfactual

    def hits(rs, field_):
        tot = sum(r.prompt_tokens for r in rs)
        return {"token_weighted": sum(min(getattr(r, field_), r.prompt_tokens) for r in rs) / tot if tot else None,
                "mean": float(np.mean([min(getattr(r, field_), r.prompt_tokens) / r.prompt_tokens for r in rs]))
                if rs else None}

    s["md_hit_sessions"] = hits(sess, "md_cached_tokens")
    s["p_hit_sessions"] = hits(sess, "p_cached_tokens")
    s["md_hit_all"] = hits(ok, "md_cached_tokens")
    s["p_hit_all"] = hits(ok, "p_cached_tokens")
    lat = {}
    for group, rs in [("all", ok)] + [(p, [r for r in ok if r.path == p]) for p in PATHS]:
        if not rs:
            continue
        lat[group] = {"n": len(rs)}
        for name in ("ttft_s", "router_ttft_s", "ttfmd_s", "e2e_s"):
            vals = [getattr(r, name) for r in rs]
            lat[group][name] = {f"p{q}": pct(vals, q) for q in (50, 90, 99)}
            lat[group][name]["n"] = sum(v is not None for v in vals)
    s["latency"] = lat
    # Cross-check against MD's own counters and the router's Prometheus counters.
    s["md_stats_delta"] = md_delta
    s["router_metrics_delta"] = {k: v for k, v in metrics_delta.items()
                                 if k.startswith(("pdd:wan_bytes", "pdd:requests_total", "pdd:outliers",
                                                  "pdd:fallbacks", "pdd:handoffs_total"))}
    # MD counts a request's prompt when its room is registered; an outlier decided on its
    # length alone goes P->RLD and never reaches MD.
    registered = [r for r in ok if r.md_registration != "none"]
    ready = [r for r in ok if r.path in ("p_md", "p_rld_md") and not any(
        f.startswith("wan_failed") for f in r.fallbacks)]
    s["crosscheck"] = {
        "md_prompt_tokens": (md_delta.get("prompt_tokens"), sum(r.prompt_tokens for r in registered)),
        "md_cached_tokens": (md_delta.get("cached_tokens"), sum(r.md_cached_tokens for r in registered)),
        "md_wan_bytes": (md_delta.get("wan_bytes"), sum(r.wan_bytes or 0 for r in ready)),
        "router_wan_bytes_total": (metrics_delta.get("pdd:wan_bytes_total"), s["wan_bytes"]),
        "router_wan_bytes_saved_total": (metrics_delta.get("pdd:wan_bytes_saved_total"),
                                         sum(r.wan_bytes_saved for r in ok)),
    }
    s["crosscheck_ok"] = all(a is not None and abs(a - b) < 0.5 for a, b in s["crosscheck"].values())
    return s


# ----------------------------------------------------------------------------- report
def fmt_ms(v):
    return "-" if v is None else f"{v * 1e3:8.0f}"


def matched_comparison(records: list[Record]) -> dict:
    """Both variants on exactly the same (job, turn) requests: a failed request ends its
    session, so the variants can run different request sets; compare only the shared ones."""
    ok = {(r.variant, r.kind, r.job, r.turn): r for r in records if not r.error}
    keys = [k[1:] for k in ok if k[0] == "pdd" and ("baseline", *k[1:]) in ok]
    pdd = [ok[("pdd", *k)] for k in keys]
    base = [ok[("baseline", *k)] for k in keys]
    sess = [i for i, k in enumerate(keys) if k[0] == "session"]
    tot = sum(pdd[i].prompt_tokens for i in sess)
    out = {"requests": len(keys), "session_requests": len(sess),
           "wan_bytes_pdd": sum(r.wan_bytes or 0 for r in pdd), "wan_bytes_baseline": sum(r.wan_bytes or 0 for r in base),
           "wan_bytes_pdd_sessions": sum(pdd[i].wan_bytes or 0 for i in sess),
           "wan_bytes_baseline_sessions": sum(base[i].wan_bytes or 0 for i in sess),
           "md_hit_token_weighted": sum(pdd[i].md_cached_tokens for i in sess) / tot if tot else None,
           "p_hit_token_weighted": sum(min(pdd[i].p_cached_tokens, pdd[i].prompt_tokens) for i in sess) / tot if tot else None}
    out["ratio"] = out["wan_bytes_baseline"] / max(1, out["wan_bytes_pdd"])
    out["ratio_sessions"] = out["wan_bytes_baseline_sessions"] / max(1, out["wan_bytes_pdd_sessions"])
    return out


def print_report(res: dict) -> None:
    pdd, base = res["variants"]["pdd"], res["variants"]["baseline"]
    ideal = res["workload"]["ideal"]
    print("\n== WAN KV bytes (same workload, same run) ==")
    print(f"  plain cross-DC PD (p_md, drc off), measured : {base['wan_bytes']:>12,d} B")
    print(f"  PDD, counterfactual without DRC (same run)  : {pdd['wan_bytes_if_no_drc']:>12,d} B")
    print(f"  PDD with DRC, measured                      : {pdd['wan_bytes']:>12,d} B")
    print(f"  ratio baseline / PDD (whole system)         : {res['ratio_total']:>12.2f}x")
    print(f"  ratio on session requests only (DRC alone)  : {res['ratio_sessions']:>12.2f}x "
          f"(ideal at this trace: {ideal['ideal_wan_ratio_sessions']:.2f}x)")
    m = res.get("matched")
    if m:
        print(f"  matched requests only ({m['requests']} ok in both variants): baseline {m['wan_bytes_baseline']:,d} B"
              f" / PDD {m['wan_bytes_pdd']:,d} B = {m['ratio']:.2f}x; sessions only {m['ratio_sessions']:.2f}x at MD hit "
              f"{m['md_hit_token_weighted']:.3f} (P {m['p_hit_token_weighted']:.3f})")
    print("\n== Prefix hit rates, PDD run (session requests; outliers have no reuse) ==")
    print(f"  {'':22s} {'token-weighted':>15s} {'per-request mean':>17s}")
    for name, key in (("MD (DRC)", "md_hit_sessions"), ("P (prefill radix)", "p_hit_sessions")):
        h = pdd[key]
        print(f"  {name:22s} {h['token_weighted']:15.3f} {h['mean']:17.3f}")
    print(f"  {'MD ideal (trace)':22s} {ideal['md_hit_token_weighted']:15.3f} {ideal['md_hit_mean']:17.3f}")
    print(f"  {'P ideal (trace)':22s} {ideal['p_hit_token_weighted']:15.3f}")
    h = base["p_hit_sessions"]
    print(f"  baseline: MD 0 by construction (drc off); P {h['token_weighted']:.3f} / {h['mean']:.3f}")
    print("\n== Latency per path (ms, client-side; TTFMD = first token produced by MD) ==")
    print(f"  {'variant':9s} {'path':11s} {'n':>4s} | {'TTFT p50':>8s} {'p90':>8s} {'p99':>8s} | "
          f"{'TTFMD p50':>9s} {'p90':>8s} {'p99':>8s} | {'e2e p50':>8s} {'p90':>8s} {'p99':>8s}")
    for vname in ("pdd", "baseline"):
        for group, d in res["variants"][vname]["latency"].items():
            t, m, e = d["ttft_s"], d["ttfmd_s"], d["e2e_s"]
            print(f"  {vname:9s} {group:11s} {d['n']:4d} | {fmt_ms(t['p50'])} {fmt_ms(t['p90'])} {fmt_ms(t['p99'])} | "
                  f"{fmt_ms(m['p50']):>9s} {fmt_ms(m['p90'])} {fmt_ms(m['p99'])} | "
                  f"{fmt_ms(e['p50'])} {fmt_ms(e['p90'])} {fmt_ms(e['p99'])}")
    print("\n== Counts and checks ==")
    for vname in ("pdd", "baseline"):
        v = res["variants"][vname]
        print(f"  {vname:9s} paths {v['paths']}  outliers on RLD only {v['outliers_on_rld_only']}/{v['outliers']}"
              f"  handoffs {v['handoffs']}  fallbacks {v['fallbacks']}  errors {v['errors']}"
              f"  completion!=requested {v['completion_mismatch']}  cross-check {'ok' if v['crosscheck_ok'] else 'MISMATCH'}")
        for k, (got, want) in v["crosscheck"].items():
            flag = "" if got is not None and abs(got - want) < 0.5 else "   <-- differs"
            print(f"      {k:30s} server {got!s:>12}  router/requests {want!s:>12}{flag}")


def plot(res: dict, records: list[Record], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pdd, base = res["variants"]["pdd"], res["variants"]["baseline"]
    fig, ax = plt.subplots(1, 3, figsize=(17, 4.8))
    bars = [("plain PD\n(measured)", base["wan_bytes"]), ("PDD w/o DRC\n(counterfactual)", pdd["wan_bytes_if_no_drc"]),
            ("PDD + DRC\n(measured)", pdd["wan_bytes"])]
    ax[0].bar([b[0] for b in bars], [b[1] / 1e6 for b in bars], color=["tab:gray", "tab:olive", "tab:blue"])
    ax[0].set_ylabel("WAN KV MB")
    ax[0].set_title(f"WAN bytes: {res['ratio_total']:.1f}x fewer with PDD "
                    f"(MD hit {pdd['md_hit_sessions']['token_weighted']:.0%})")

    sess = [r for r in records if r.variant == "pdd" and r.kind == "session" and not r.error]
    turns = sorted({r.turn for r in sess})
    for field_, label, color in (("md_cached_tokens", "MD (DRC)", "tab:blue"), ("p_cached_tokens", "P", "tab:orange")):
        ax[1].plot(turns, [np.mean([getattr(r, field_) / r.prompt_tokens for r in sess if r.turn == t]) for t in turns],
                   "o-", label=label, color=color)
    ax[1].set_xlabel("turn")
    ax[1].set_ylabel("prefix hit rate (mean over sessions)")
    ax[1].set_ylim(0, 1.02)
    ax[1].legend()
    ax[1].set_title("Hit rate per turn, PDD run")

    labels, groups = [], []
    for vname in ("pdd", "baseline"):
        for path, d in res["variants"][vname]["latency"].items():
            if path == "all":
                continue
            for metric in ("ttft_s", "ttfmd_s"):
                if d[metric]["n"]:
                    labels.append(f"{vname}\n{path}\n{'TTFT' if metric == 'ttft_s' else 'TTFMD'}")
                    groups.append([d[metric][f"p{q}"] * 1e3 for q in (50, 90, 99)])
    x = np.arange(len(labels))
    for i, q in enumerate((50, 90, 99)):
        ax[2].bar(x + (i - 1) * 0.27, [g[i] for g in groups], 0.27, label=f"p{q}")
    ax[2].set_xticks(x, labels, fontsize=7)
    ax[2].set_ylabel("ms")
    ax[2].legend()
    ax[2].set_title("TTFT (first token) and TTFMD (first MD token)")
    fig.tight_layout()
    fig.savefig(out / "bench_agentic.png", dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    w = ap.add_argument_group("workload")
    w.add_argument("--sessions", type=int, default=8)
    w.add_argument("--turns", type=int, nargs=2, default=[6, 8], metavar=("MIN", "MAX"))
    w.add_argument("--system-prompts", type=int, default=2)
    w.add_argument("--system-tokens", type=int, default=256)
    w.add_argument("--tool-tokens", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"),
                   help="new block per turn before --target-hit scaling (first user block too)")
    w.add_argument("--output-tokens", type=int, nargs=2, default=[8, 32], metavar=("MIN", "MAX"))
    w.add_argument("--outliers", type=int, default=2)
    w.add_argument("--outlier-input-tokens", type=int, nargs=2, default=[1200, 2000], metavar=("MIN", "MAX"))
    w.add_argument("--outlier-output-tokens", type=int, nargs=2, default=[1, 4], metavar=("MIN", "MAX"))
    w.add_argument("--target-hit", type=float, default=0.9,
                   help="scale the new blocks so the ideal token-weighted MD hit rate is this (0: no scaling)")
    w.add_argument("--seed", type=int, default=0)
    c = ap.add_argument_group("cluster and router")
    c.add_argument("--wan-gbps", type=float, default=0.004,
                   help="emulated link rate (0.004 = 4 Mbit/s: ~1 ms per token of the tiny model's 512 B KV)")
    c.add_argument("--wan-latency-ms", type=float, default=20.0, help="one way")
    c.add_argument("--max-wan-transfer-ms", type=float, default=120.0,
                   help="router: P->MD when the uncached suffix crosses within this (else P->RLD->MD)")
    c.add_argument("--outlier-min-input-tokens", type=int, default=1024)
    c.add_argument("--outlier-max-output-tokens", type=int, default=4)
    c.add_argument("--concurrency", type=int, default=1,
                   help="sessions replayed in parallel (2 hit stalled requests here: see docs/benchmarks.md)")
    c.add_argument("--request-timeout", type=float, default=30.0,
                   help="client read timeout; a request stalled longer is reported as an error and ends its session")
    c.add_argument("--order", choices=["pdd-first", "baseline-first"], default="pdd-first")
    ap.add_argument("--out", default="artifacts/bench_agentic")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    cfg = WorkloadConfig(sessions=args.sessions, turns=tuple(args.turns), system_prompts=args.system_prompts,
                         system_tokens=args.system_tokens, first_user_tokens=tuple(args.tool_tokens),
                         tool_tokens=tuple(args.tool_tokens), output_tokens=tuple(args.output_tokens),
                         outliers=args.outliers, outlier_input_tokens=tuple(args.outlier_input_tokens),
                         outlier_output_tokens=tuple(args.outlier_output_tokens), seed=args.seed)
    if args.target_hit > 0:
        cfg = fit_block_scale(cfg, args.target_hit)
    jobs = build_jobs(cfg)
    ideal = ideal_hits(jobs, cfg)
    print(f"workload: {len(jobs)} jobs, {ideal['requests']} requests, {ideal['prompt_tokens']} prompt tokens, "
          f"longest prompt {ideal['max_prompt_tokens']}, block scale {cfg.block_scale:.3f}, ideal MD hit "
          f"{ideal['md_hit_token_weighted']:.3f} (token-weighted) / {ideal['md_hit_mean']:.3f} (mean)", file=sys.stderr)
    longest_session = max(sum(t.new_block + t.output for t in j.turns) + cfg.system_tokens
                          for j in jobs if j.kind == "session")
    if min(cfg.output_tokens) <= args.outlier_max_output_tokens and longest_session >= args.outlier_min_input_tokens:
        print("warning: some session turns may match the outlier filter", file=sys.stderr)

    from sglang_pdd.launcher.cluster import LocalCluster
    from sglang_pdd.launcher.topology import Topology

    topology = Topology.on_free_ports()
    topology.wan.rate_gbps, topology.wan.latency_ms = args.wan_gbps, args.wan_latency_ms
    router_args = ["--max-wan-transfer-ms", str(args.max_wan_transfer_ms),  # link args: from topology
                   "--outlier-min-input-tokens", str(args.outlier_min_input_tokens),
                   "--outlier-max-output-tokens", str(args.outlier_max_output_tokens),
                   "--wan-timeout-s", "30",
                   "--every-client-is-operator"]  # the baseline variant uses pdd_options (operator-only)
    variants = {"pdd": None, "baseline": {"path": "p_md", "drc": False}}
    order = ["pdd", "baseline"] if args.order == "pdd-first" else ["baseline", "pdd"]
    all_records: list[Record] = []
    res = {"args": vars(args), "workload": {"config": asdict(cfg), "ideal": ideal}, "router_args": router_args,
           "variants": {}}
    t_start = time.time()
    with LocalCluster(out / "cluster", topology=topology, router_args=router_args) as cluster:
        router, control = topology.router_url, topology.main.control_url
        # Warm-up (own salt, discarded): first requests on each path pay one-off costs.
        warm_job = Job("session", 10_000, system=0, turns=[Turn(0, 8)])
        for opts in ({"path": "p_md"}, {"path": "p_rld_md"}, {"path": "p_rld_only"}):
            run_request(router, "warmup", warm_job, 0, segment_tokens("warmup", (opts["path"],), 200), 8,
                        opts, args.request_timeout)
        for vname in order:
            md_before = wait_rooms_closed(control, cluster.control_key)
            m_before = scrape_metrics(router)
            t0 = time.time()
            recs = replay(router, vname, jobs, cfg, salt=f"{vname}-{args.seed}", options=variants[vname],
                          concurrency=args.concurrency, timeout=args.request_timeout)
            wall = time.time() - t0
            md_after = wait_rooms_closed(control, cluster.control_key)
            m_after = scrape_metrics(router)
            md_delta = delta(md_after, md_before)
            res["variants"][vname] = summarize(recs, md_delta, delta(m_after, m_before))
            res["variants"][vname]["wall_s"] = wall
            all_records += recs
    res["wall_s"] = time.time() - t_start
    pdd, base = res["variants"]["pdd"], res["variants"]["baseline"]
    res["ratio_total"] = base["wan_bytes"] / max(1, pdd["wan_bytes"])
    res["ratio_sessions"] = base["wan_bytes_sessions"] / max(1, pdd["wan_bytes_sessions"])
    res["matched"] = matched_comparison(all_records)
    res["goal"] = {"target_hit": args.target_hit,
                   "achieved_md_hit_token_weighted": pdd["md_hit_sessions"]["token_weighted"],
                   "achieved_md_hit_mean": pdd["md_hit_sessions"]["mean"],
                   "ratio_total": res["ratio_total"], "met_8x": res["ratio_total"] >= 8.0}
    (out / "results.json").write_text(json.dumps(res, indent=2))
    with open(out / "requests.jsonl", "w") as f:
        for r in all_records:
            f.write(json.dumps(asdict(r)) + "\n")
    print_report(res)
    plot(res, all_records, out)
    if any(v["errors"] for v in res["variants"].values()):
        print("\nWARNING: some requests failed (see requests.jsonl 'error'); each failure ends its session, so the "
              "variants ran different request sets: read the 'matched' line, not the totals.")
    print(f"\nwall {res['wall_s']:.0f} s; wrote {out / 'results.json'}, {out / 'requests.jsonl'}, "
          f"{out / 'bench_agentic.png'}")
    bad = any(v["errors"] or v["completion_mismatch"] for v in res["variants"].values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
