"""What PDD buys on real servers: SGLang's own PD, in one datacenter and across two, against
PDD, with datacenter B in a network namespace behind one shaped kernel link.

Designs (servers start once per design; the link's rate changes with ``tc qdisc change``):

  same_dc_pd         SGLang prefill + decode in A, KV over Mooncake (TCP on CPU), SGLang's own
                     PD router (``sglang_router.launch_router --pd-disaggregation``) in front
  cross_dc_pd        the same with the decode server in B: its KV, SGLang's bootstrap calls and
                     the router's requests to it cross the link
  cross_dc_pd_radix  cross_dc_pd with SGLang's experimental decode radix cache
                     (``--disaggregation-decode-enable-radix-cache``): prefill sends only what
                     the decode server lacks, SGLang's own counterpart of PDD's DRC
  pdd                P and RLD in A, MD in B, this project's router

Every design runs SGLang 0.5.23 with the same model, dtype (float32, as the tests: greedy
outputs are then comparable), page size and CPU flags; the baselines load no pdd code. The
router and the client run in A. The link has a rate but no delay (no netem in this kernel):
no design gets WAN latency, which flatters cross-datacenter PD more than PDD (its TTFT waits
on the link, PDD's does not; see docs/benchmarks.md).

Workload: multi-turn agent sessions (bench_agentic's generator: turn k+1 = turn k's prompt +
its actual output + a new block, sessions share one of a few system prompts, a few long-input
short-output outliers; the new blocks scaled so most turns hit >= 90% of their prompt in an
ideal cache). Requests are dispatched open loop: Poisson arrivals at the cell's rate, each
arrival taking the next turn of one of ``--lanes`` live sessions round robin (so consecutive
turns of a session are ``lanes`` arrivals apart); a turn whose previous turn has not finished
by its arrival waits for it (an agent cannot send before it has the answer) and is counted as
held. Each design sees the same arrivals and prompts per (link, rate) cell. Streaming
``/generate`` with ``input_ids``, greedy, ``ignore_eos`` (every request makes exactly its
output length).

Per design, link and rate: TTFT p50/p90/p99, TPOT p50/p90, the longest inter-token gap p99
(PDD's handoff stall shows here), SLA attainment and goodput (requests/s meeting both
TTFT <= --sla-ttft-ms and TPOT <= --sla-tpot-ms), errors, bytes across the link (the veth's
counters, both directions). Then the greedy outputs of the designs, compared request by
request. same_dc_pd does not use the link: it runs once per rate, shown in every link's panel.

    .venv/bin/python -m benchmarks.bench_real_pd_vs_pdd            # default size, <= 30 min on 2 cores
    .venv/bin/python -m benchmarks.bench_real_pd_vs_pdd --quick    # one link, one rate, a few sessions

Needs root for the namespace (without it: same_dc_pd and PDD over the userspace emulator only,
said so). Writes results.json, requests.jsonl and the plot (unless --plot names another path)
under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import calendar
import contextlib
import json
import logging
import math
import os
import random
import re
import secrets
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional

import numpy as np
from tqdm import tqdm

from benchmarks.bench_agentic import WorkloadConfig, build_jobs, fit_block_scale, segment_tokens
from benchmarks.common import astream_events, greedy

DESIGNS = ("same_dc_pd", "cross_dc_pd", "cross_dc_pd_radix", "pdd", "pdd_relay_first")  # the default set
OPTIONAL_DESIGNS = ("pdd_rld_only", "pdd_md_after_first")  # only where --designs names them
# The router's --path-mode per PDD design: fit (its default) and the relay-first rule.
PDD_PATH_MODES = {"pdd": "fit", "pdd_relay_first": "relay_first", "pdd_rld_only": "fit", "pdd_md_after_first": "fit"}
# PDD designs whose router runs with other flags than its defaults
PDD_ROUTER_FLAGS = {"pdd_md_after_first": ["--md-side-after-first-token"]}
# PDD designs whose every request is sent with an operator's path (pdd_options): PDD's own servers
# and router without the WAN leg, the relay path's cost apart from the WAN's
FORCED_PATHS = {"pdd_rld_only": "p_rld_only"}
LABELS = {"same_dc_pd": "same-DC PD (SGLang)", "cross_dc_pd": "cross-DC PD (SGLang)",
          "cross_dc_pd_radix": "cross-DC PD + decode radix (SGLang)", "pdd": "PDD",
          "pdd_relay_first": "PDD, relay-first paths", "pdd_rld_only": "PDD servers, P->RLD only (no WAN leg)",
          "pdd_md_after_first": "PDD, MD's side after the 1st token"}
COLORS = {"same_dc_pd": "tab:gray", "cross_dc_pd": "tab:red", "cross_dc_pd_radix": "tab:orange", "pdd": "tab:blue",
          "pdd_relay_first": "tab:cyan", "pdd_rld_only": "tab:purple", "pdd_md_after_first": "tab:green"}
EXACT_ARGS = ["--dtype", "float32"]  # as tests/conftest.py: greedy outputs comparable across designs
DEEPSEEK_V3_KV_BYTES_PER_TOKEN = 70_272  # MLA: 61 layers x 576 values x 2 bytes
# Assumed production prefill speed for the mapping to a real WAN (tokens/s of one prefill
# instance, cold prompt, DeepSeek-V3 on one 8-GPU node): the link whose KV transfer takes r
# times a prompt's prefill there is KV bytes/token x 8 x this / r.
PROD_PREFILL_TOKENS_PER_S = 33_000


# ----------------------------------------------------------------------------- trace (pure)
@dataclass(frozen=True)
class Slot:
    """One request of the trace, in dispatch order: a session's turn or an outlier."""
    job: int
    turn: int


def dispatch_order(jobs, lanes: int) -> list[Slot]:
    """Round robin over ``lanes`` live sessions, a finished session's lane taking the next one;
    an outlier takes one arrival and no lane. Consecutive turns of a session are about
    ``lanes`` arrivals apart."""
    todo, active, order = deque(range(len(jobs))), [], []
    while todo or active:
        while len(active) < lanes and todo:
            j = todo.popleft()
            if jobs[j].kind == "outlier":
                order.append(Slot(j, 0))
            else:
                active.append([j, 0])
        for lane in list(active):
            order.append(Slot(lane[0], lane[1]))
            lane[1] += 1
            if lane[1] == len(jobs[lane[0]].turns):
                active.remove(lane)
    return order


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the cell's start of ``n`` Poisson arrivals at ``rate`` per second."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def ideal_hit_per_request(jobs, cfg: WorkloadConfig) -> list[float]:
    """Each session turn's prefix hit in a cache holding every earlier prompt and output of its
    session and the shared system prompts (what a decode-side radix cache can hit at best);
    outliers 0."""
    seen_sys, hits = set(), []
    for job in jobs:
        if job.kind == "outlier":
            hits.append(0.0)
            continue
        held = cfg.system_tokens if job.system in seen_sys else 0
        seen_sys.add(job.system)
        context = cfg.system_tokens
        for turn in job.turns:
            prompt = context + turn.new_block
            hits.append(held / prompt)
            held = prompt + turn.output - 1  # SGLang caches a finished request less its last token
            context = prompt + turn.output
    return hits


# ----------------------------------------------------------------------------- metrics (pure)
@dataclass
class Record:
    design: str
    link_mbit: float
    rate: float
    cell: str
    slot: int
    kind: str
    job: int
    turn: int
    prompt_tokens: int
    requested: int
    scheduled_s: float = 0.0  # arrival, after the cell's start
    sent_at: float = 0.0  # wall clock (time.time()) when sent: matches the servers' own logs
    rid: str = ""
    held_s: float = 0.0  # how long the arrival waited for the session's previous turn
    ttft_s: Optional[float] = None
    tpot_s: Optional[float] = None  # (last token - first token) / (tokens - 1)
    max_gap_s: Optional[float] = None  # longest wait between two events that brought tokens
    e2e_s: Optional[float] = None
    completion_tokens: int = 0
    cached_tokens: Optional[int] = None  # the server's meta_info.cached_tokens
    path: str = ""  # PDD: meta_info.pdd
    md_cached_tokens: Optional[int] = None
    handoff_at: Optional[int] = None
    rld_tokens: Optional[int] = None  # PDD: output tokens RLD made (the router's log)
    router_ttft_s: Optional[float] = None
    router_marks: dict = field(default_factory=dict)  # PDD: FlowResult.marks (s from the router's start of the flow)
    path_reason: str = ""  # PDD: why the router chose the path
    fallbacks: list = field(default_factory=list)
    error: Optional[str] = None
    output_ids: list = field(default_factory=list)


def token_timing(times: list[float], counts: list[int], t_send: float) -> tuple[float, Optional[float], Optional[float]]:
    """(TTFT, TPOT, longest gap) from the arrival time of each stream event and the tokens it
    brought (events without tokens dropped by the caller)."""
    ttft = times[0] - t_send
    n = sum(counts)
    tpot = (times[-1] - times[0]) / (n - 1) if n > 1 else None
    gaps = [b - a for a, b in zip(times, times[1:])]
    return ttft, tpot, (max(gaps) if gaps else None)


def pct(values, q) -> Optional[float]:
    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if values else None


def meets_sla(r: Record, ttft_s: float, tpot_s: float) -> bool:
    return r.error is None and r.ttft_s is not None and r.ttft_s <= ttft_s and (r.tpot_s is None or r.tpot_s <= tpot_s)


def summarize_cell(records: list[Record], rate: float, sla_ttft_s: float, sla_tpot_s: float,
                   link_bytes: tuple[int, int], wall_s: float) -> dict:
    ok = [r for r in records if r.error is None]
    within = sum(meets_sla(r, sla_ttft_s, sla_tpot_s) for r in records)
    s = {"requests": len(records), "errors": len(records) - len(ok),
         "errors_detail": sorted({r.error for r in records if r.error})[:3],
         "held": sum(r.held_s > 0.001 for r in records),
         "completion_mismatch": sum(r.completion_tokens != r.requested for r in ok),
         "sla_attainment": within / len(records) if records else None,
         # requests meeting the SLA per second of offered load: attainment x rate
         "goodput_rps": rate * within / len(records) if records else None,
         "link_bytes_a_to_b": link_bytes[0], "link_bytes_b_to_a": link_bytes[1], "wall_s": wall_s}
    for name, key in (("ttft", "ttft_s"), ("tpot", "tpot_s"), ("gap", "max_gap_s"), ("e2e", "e2e_s")):
        for q in (50, 90, 99):
            s[f"{name}_p{q}"] = pct([getattr(r, key) for r in ok], q)
    s["paths"] = {p: sum(r.path == p for r in ok) for p in sorted({r.path for r in ok if r.path})}
    s["handoffs"] = sum(r.handoff_at is not None for r in ok)
    # PDD only: the shares the design is judged by, over the requests the router's log names
    logged = [r for r in ok if r.path]
    s["p_md_share"] = sum(r.path == "p_md" for r in logged) / len(logged) if logged else None
    made = sum(r.completion_tokens for r in logged if r.rld_tokens is not None)
    s["rld_token_share"] = sum(r.rld_tokens or 0 for r in logged) / made if made else None
    s["fallbacks"] = sum(bool(r.fallbacks) for r in ok)
    return s


def compare_outputs(records: list[Record]) -> dict:
    """Greedy outputs of the designs on the same request (cell, job, turn): equal, or where they
    part. Only requests every compared design completed count."""
    by_key: dict = {}
    for r in records:
        if r.error is None:
            by_key.setdefault((r.cell, r.kind, r.job, r.turn), {})[r.design] = r.output_ids
    compared = mismatches = 0
    examples = []
    for key, outs in sorted(by_key.items()):
        if len(outs) < 2:
            continue
        compared += 1
        ref_design, ref = next(iter(outs.items()))
        for design, ids in outs.items():
            if ids != ref:
                mismatches += 1
                first = next((i for i, (a, b) in enumerate(zip(ids, ref)) if a != b), min(len(ids), len(ref)))
                if len(examples) < 5:
                    examples.append({"request": list(key), "designs": [ref_design, design], "first_difference": first})
                break
    return {"compared": compared, "mismatches": mismatches, "examples": examples,
            "designs_per_request": sorted({len(o) for o in by_key.values()})}


def parse_router_requests(lines) -> list[dict]:
    """PDD's router log: its one line per request (``[YYYY-mm-dd HH:MM:SS] request {json}``),
    written when the request ended; ``logged_at``: that time (epoch seconds, whole)."""
    out = []
    for line in lines:
        head, sep, rest = line.partition(" request {")
        if not sep:
            continue
        try:
            entry = json.loads("{" + rest)
            entry["logged_at"] = calendar.timegm(time.strptime(head.strip()[1:20], "%Y-%m-%d %H:%M:%S"))
        except ValueError:
            continue
        out.append(entry)
    return out


def annotate_from_router_log(records: list["Record"], entries: list[dict]) -> None:
    """What PDD did with each request (path, MD's prefix hit, handoff), from its router's log
    lines: the client is no operator, so its events carry no meta_info.pdd, and the router logs
    its own request id. A request is matched to the unused line with its prompt and output
    length logged nearest the time it ended (the log's clock is whole seconds, UTC)."""
    free = list(entries)
    for r in sorted((r for r in records if r.error is None and r.e2e_s is not None), key=lambda r: r.sent_at + r.e2e_s):
        end = r.sent_at + r.e2e_s
        cands = [e for e in free if e.get("prompt_tokens") == r.prompt_tokens
                 and e.get("output_tokens") == r.completion_tokens and -2 <= e["logged_at"] - end <= 2]
        if not cands:
            continue
        e = min(cands, key=lambda e: abs(e["logged_at"] - end))
        free.remove(e)
        r.path, r.md_cached_tokens, r.handoff_at = e.get("path", ""), e.get("md_cached"), e.get("handoff_at")
        r.rld_tokens = e.get("rld_tokens")
        r.router_ttft_s, r.fallbacks = e.get("ttft_s"), list(e.get("fallbacks") or [])
        r.router_marks, r.path_reason = dict(e.get("marks") or {}), e.get("reason", "")


# ----------------------------------------------------------------------------- CPU (I/O)
class CpuMeter:
    """Cores busy during a cell: this benchmark's (its process and every server it started) and
    everything else on the machine (other work sharing the cores), from /proc/stat and psutil."""

    def __init__(self):
        import psutil

        self._me = psutil.Process()
        self._start = self._sample()

    @staticmethod
    def _machine_busy_s() -> float:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    def _ours_s(self) -> float:
        import psutil

        total = 0.0
        for proc in [self._me, *self._me.children(recursive=True)]:
            try:
                t = proc.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    def _by_server_s(self) -> dict:
        """CPU seconds of each server this process started (with its own children), by role."""
        import psutil

        out: dict = {}
        for child in self._me.children():
            try:
                label = server_label(child.cmdline())
                procs = [child, *child.children(recursive=True)]
            except psutil.Error:
                continue
            for proc in procs:
                try:
                    t = proc.cpu_times()
                    out[label] = out.get(label, 0.0) + t.user + t.system
                except psutil.Error:
                    pass
        return out

    def _sample(self) -> tuple[float, float, float, dict]:
        return time.monotonic(), self._machine_busy_s(), self._ours_s(), self._by_server_s()

    def stop(self) -> dict:
        (t0, busy0, ours0, by0), (t1, busy1, ours1, by1) = self._start, self._sample()
        wall = max(1e-6, t1 - t0)
        ours = max(0.0, ours1 - ours0) / wall
        return {"ours_cores": ours, "others_cores": max(0.0, (busy1 - busy0) / wall - ours),
                "server_cores": {k: round(max(0.0, v - by0.get(k, 0.0)) / wall, 3) for k, v in sorted(by1.items())}}


def server_label(cmdline: list[str]) -> str:
    """A started process by what it serves: PDD's role (prefill, relay, main), SGLang PD's mode
    (pd_prefill, pd_decode), or the router."""
    def after(flag: str) -> Optional[str]:
        return cmdline[cmdline.index(flag) + 1] if flag in cmdline[:-1] else None

    if after("--pdd-role"):
        return after("--pdd-role")
    if after("--disaggregation-mode"):
        return f"pd_{after('--disaggregation-mode')}"
    joined = " ".join(cmdline)
    if "sglang_router" in joined:
        return "sglang_router"
    if "sglang_pdd.router" in joined:
        return "pdd_router"
    return "other"


# ----------------------------------------------------------------------------- TTFT breakdown (pure)
_TIME_STATS_RE = re.compile(r"ReqTimeStats\((?P<head>[^)]*)\): (?P<body>.*)$")
# Stages of one request's time to first token, from the client's send (the servers' own
# --enable-request-time-stats-logging lines of the prefill and decode / RLD server, joined on
# the bootstrap room): when prefill has it, prefill's bootstrap (waiting for the decode side's
# handshake), queue and forward (prefill + KV send), when the decode side has it, its bootstrap
# and memory wait, its wait for the KV, its queue; the rest is the first decode step and the
# stream back through the router.
STAGES = ("to_prefill", "p_bootstrap", "p_queue", "p_forward", "to_decode", "d_prealloc", "d_transfer", "d_queue",
          "after_ready")


TIME_STATS_ARGS = ["--enable-request-time-stats-logging"]  # the servers log the lines below


def parse_time_stats(lines) -> list[dict]:
    """SGLang's ReqTimeStats log lines: head fields (rid, bootstrap_room, input_len, type, ...)
    and durations (seconds), entry_time (wall clock)."""
    out = []
    for line in lines:
        m = _TIME_STATS_RE.search(line)
        if not m:
            continue
        row = {}
        for part in (m.group("head") + ", " + m.group("body")).split(", "):
            key, _, value = part.partition("=")
            value = value.strip()
            if value.endswith("ms"):
                row[key] = float(value[:-2]) / 1e3
            elif key in ("entry_time",):
                row[key] = float(value)
            elif key in ("bootstrap_room", "input_len", "cached_input_len", "output_len", "attempts"):
                row[key] = int(value) if value.lstrip("-").isdigit() else None
            else:
                row[key] = value
        out.append(row)
    return out


def _decode_prealloc(d: dict) -> float:
    return d.get("bootstrap_duration", 0.0) + d.get("alloc_wait_duration", d.get("prealloc_queue_duration", 0.0))


def _decode_ready_at(d: dict) -> float:
    """When a decode-side request could take its first decode step (wall clock)."""
    return d["entry_time"] + _decode_prealloc(d) + d.get("transfer_duration", 0.0) + d.get("queue_duration", 0.0)


def ttft_stages(records: list[Record], stats: list[dict]) -> list[dict]:
    """Each completed request's TTFT split into STAGES (seconds). A request is matched to the
    prefill server's line with its prompt length that entered soonest after it was sent, and
    that to the decode side's line with the same bootstrap room (where two decode it, the one
    ready first); unmatched ones are left out."""
    prefill = sorted((p for p in stats if p.get("type") == "prefill" and "entry_time" in p),
                     key=lambda p: p["entry_time"])
    # PDD's RLD and MD decode the same room (RLD bridges the first token, MD takes over): the
    # user's first token is the side ready first
    decode: dict = {}
    for d in stats:
        if d.get("type") == "decode" and d.get("bootstrap_room") is not None and "entry_time" in d:
            room = d["bootstrap_room"]
            if room not in decode or _decode_ready_at(d) < _decode_ready_at(decode[room]):
                decode[room] = d
    used, rows = set(), []
    for r in sorted((r for r in records if r.error is None and r.ttft_s is not None), key=lambda r: r.sent_at):
        cands = [i for i, p in enumerate(prefill) if i not in used and p.get("input_len") == r.prompt_tokens
                 and -0.05 <= p["entry_time"] - r.sent_at <= 10]
        if not cands:
            continue
        i = min(cands, key=lambda i: prefill[i]["entry_time"] - r.sent_at)
        used.add(i)
        p, d = prefill[i], decode.get(prefill[i].get("bootstrap_room"))
        if d is None:
            continue
        prealloc = _decode_prealloc(d)
        ready = _decode_ready_at(d) - r.sent_at
        rows.append({"design": r.design, "cell": r.cell, "path": r.path, "turn": r.turn, "ttft": r.ttft_s,
                     "to_prefill": p["entry_time"] - r.sent_at,
                     "p_bootstrap": p.get("bootstrap_duration", p.get("bootstrap_queue_duration", 0.0)),
                     "p_queue": p.get("queue_duration", 0.0), "p_forward": p.get("forward_duration", 0.0),
                     "to_decode": d["entry_time"] - r.sent_at, "d_prealloc": prealloc,
                     "d_transfer": d.get("transfer_duration", 0.0), "d_queue": d.get("queue_duration", 0.0),
                     "after_ready": r.ttft_s - ready})
    return rows


def stage_summary(rows: list[dict], tail_share: float = 0.25) -> dict:
    """Medians of each stage over all rows and over the slowest ``tail_share`` of them by TTFT:
    which stage a cell's tail spends its time in."""
    if not rows:
        return {"matched": 0, "tail_n": 0, "all": {}, "tail": {}}
    slow = sorted(rows, key=lambda r: r["ttft"], reverse=True)[:max(1, math.ceil(tail_share * len(rows)))]
    med = lambda rs: {k: float(np.median([r[k] for r in rs])) for k in ("ttft",) + STAGES}
    return {"matched": len(rows), "tail_n": len(slow), "all": med(rows), "tail": med(slow)}


# ----------------------------------------------------------------------------- designs (I/O)
@dataclass(frozen=True)
class Route:
    """Where a request goes: a design's router, the headers and body fields it takes; ``name``
    labels its records."""
    name: str
    url: str
    headers: dict = field(default_factory=dict)
    body_extra: dict = field(default_factory=dict)


class Design:
    """A running design: its router URL, the headers a request needs, and how it follows a
    change of the link's rate."""

    name: str = ""

    def __init__(self, run_dir: Path, model: str, link):
        self.run_dir, self.model, self.link = run_dir, model, link
        self.stack = contextlib.ExitStack()

    router_url: str = ""
    headers: dict = {}
    body_extra: dict = {}  # merged into every request (e.g. pdd_options)
    server_args: list = []  # more flags for every SGLang server

    def start(self) -> None:
        raise NotImplementedError

    def set_link(self, mbit: float) -> None:
        if self.link is not None:
            self.link.set_rate(mbit)

    def route(self) -> Route:
        return Route(self.name, self.router_url, dict(self.headers), dict(self.body_extra))

    def annotate(self, records: list[Record]) -> None:
        """What the design did with each request, where its router says (PDD)."""

    def stop(self) -> None:
        self.stack.close()


class SglangPdDesign(Design):
    def __init__(self, name: str, run_dir: Path, model: str, link, cross_dc: bool, radix: bool):
        super().__init__(run_dir, model, link)
        self.name, self.cross_dc, self.radix = name, cross_dc, radix

    def start(self) -> None:
        from sglang_pdd.launcher.sglang_pd import SglangPdCluster, SglangPdTopology

        topo = SglangPdTopology.on_free_ports(decode_radix_cache=self.radix)
        topo.extra_args = EXACT_ARGS + list(self.server_args)
        if self.cross_dc:
            topo.place_decode_in_datacenter_b(self.link.a_ip, self.link.b_ip, self.link.namespace)
        self.cluster = self.stack.enter_context(SglangPdCluster(self.run_dir / self.name, self.model, topo))
        self.router_url = topo.router_url

    def front_with_pdd_router(self, router_args: list[str]) -> None:
        """This project's router in front of the same servers (prefill as P, decode as RLD, no
        MD: every request P->RLD only, i.e. plain PD), instead of SGLang's."""
        from sglang_pdd.launcher.topology import LOOPBACK, free_port

        topo, port = self.cluster.topology, free_port()
        self.cluster.procs.start("pdd-router", [sys.executable, "-m", "sglang_pdd.router", "--host", LOOPBACK,
                                                "--port", str(port), "--tokenizer-path", self.model, "--prefill",
                                                f"{topo.prefill.url},{topo.bootstrap_port}", "--relay",
                                                topo.decode.url, *router_args],
                                 health_url=f"http://{LOOPBACK}:{port}/health")
        self.cluster.procs.wait_healthy(["pdd-router"], timeout_s=120)
        self.router_url = f"http://{LOOPBACK}:{port}"


class PddDesign(Design):
    name = "pdd"

    def __init__(self, run_dir: Path, model: str, link, router_args: list[str], emulated_mbit: float,
                 name: str = "pdd", forced_path: Optional[str] = None):
        super().__init__(run_dir, model, link)
        self.name = name
        self.router_args, self.emulated_mbit = router_args, emulated_mbit
        self.forced_path = forced_path  # every request's path, as an operator sets it (pdd_options)
        self.cluster = None

    def start(self) -> None:
        from sglang_pdd.launcher.cluster import LocalCluster
        from sglang_pdd.launcher.topology import Topology

        topo = Topology.on_free_ports()
        for spec in topo.servers:
            spec.extra_args += EXACT_ARGS + list(self.server_args)
        if self.link is not None:
            topo.place_datacenter_b(self.link.b_ip, self.link.namespace, self.link.rate_mbit / 1000)
        else:  # the userspace emulator, P's WAN KV only, no delay either
            topo.wan.rate_gbps, topo.wan.latency_ms, topo.wan.jitter_ms = self.emulated_mbit / 1000, 0.0, 0.0
        self.cluster = self.stack.enter_context(LocalCluster(self.run_dir / self.name, self.model, topo, self.router_args))
        self.router_url = topo.router_url

    def route(self) -> Route:
        return super().route() if self.forced_path is None else self.route_on_path(self.forced_path, self.name)

    def route_on_path(self, path: str, name: str) -> Route:
        """Requests sent with ``path`` as an operator sets it (pdd_options is operator-only)."""
        return Route(name, self.router_url, self.cluster.operator_headers, {"pdd_options": {"path": path}})

    def annotate(self, records: list[Record]) -> None:
        log = self.cluster.procs.log_dir / "router.log"
        annotate_from_router_log(records, parse_router_requests(log.read_text(errors="replace").splitlines()))

    def set_link(self, mbit: float) -> None:
        """The link, and a router that knows it (its WAN estimate picks P->MD or P->RLD->MD)."""
        super().set_link(mbit)
        self.cluster.topology.wan.rate_gbps = mbit / 1000
        if self.link is None:
            self.cluster.wan_control("link", rate_gbps=mbit / 1000)
        self.cluster.restart_router(self.router_args)


def make_design(name: str, run_dir: Path, model: str, link, args, prefill_s_per_token=None) -> Design:
    if name in PDD_PATH_MODES:
        router_args = pdd_router_args(args) + ["--path-mode", PDD_PATH_MODES[name], *PDD_ROUTER_FLAGS.get(name, [])]
        if prefill_s_per_token:  # P's speed as measured on same-DC PD: the router counts P's queue
            router_args += ["--p-prefill-tokens-per-s", f"{1 / prefill_s_per_token:.1f}"]
        return PddDesign(run_dir, model, link, router_args, args.links[0], name, FORCED_PATHS.get(name))
    return SglangPdDesign(name, run_dir, model, link, cross_dc=name != "same_dc_pd", radix=name == "cross_dc_pd_radix")


def pdd_router_args(args) -> list[str]:
    """The router's defaults, with the SLA's TTFT as its SLO and the outlier filter scaled to this
    trace (long input >= 1024 tokens, output <= 4: the trace's outliers, no session turn). The
    client is no operator (no meta_info.pdd in its events): what happened to each request is
    read from the router's log."""
    return ["--ttft-slo-ms", str(args.sla_ttft_ms), "--outlier-min-input-tokens", "1024",
            "--outlier-max-output-tokens", "4"]


# ----------------------------------------------------------------------------- client (I/O)
async def run_cell(routes: list[Route], jobs, cfg: WorkloadConfig, order: list[Slot], arrivals: list[float],
                   cell: str, link_mbit: float, rate: float, timeout_s: float, bar) -> list[Record]:
    """Every slot of the trace at its arrival; a session's turn waits for the previous one's
    output (its prompt extends it). Job j's requests take ``routes[j % len(routes)]`` (several:
    variants compared side by side under the same load)."""
    import aiohttp

    outputs: dict = {}  # (job, turn) -> future of the output ids (None: failed)
    for slot in order:
        outputs[(slot.job, slot.turn)] = asyncio.get_running_loop().create_future()
    records: list[Record] = []
    t0 = time.perf_counter()

    async def one(i: int, slot: Slot, session) -> None:
        job = jobs[slot.job]
        await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
        scheduled = time.perf_counter()
        if job.kind == "outlier":
            ids = segment_tokens(cell, ("outlier", job.index), job.outlier_input)
        else:
            ids = segment_tokens(cell, ("sys", job.system), cfg.system_tokens)
            for k in range(slot.turn + 1):
                if k:
                    prev = await outputs[(slot.job, k - 1)]
                    if prev is None:  # the session broke off: this turn is never sent
                        outputs[(slot.job, slot.turn)].set_result(None)
                        bar.update(1)
                        return
                    ids = ids + prev
                ids = ids + segment_tokens(cell, ("new", job.index, k), job.turns[k].new_block)
        n_out = job.turns[slot.turn].output
        route = routes[slot.job % len(routes)]
        rec = Record(route.name, link_mbit, rate, cell, i, job.kind, job.index, slot.turn, len(ids), n_out,
                     scheduled_s=arrivals[i])
        t_send, rec.sent_at = time.perf_counter(), time.time()
        rec.held_s = t_send - scheduled
        rec.rid = f"{cell}-{route.name}-{i}-{secrets.token_hex(4)}"
        body = {"input_ids": ids, "sampling_params": greedy(n_out), "stream": True, "rid": rec.rid,
                **route.body_extra}
        times, counts, last, seen = [], [], None, 0
        try:
            async for t, event in astream_events(session, f"{route.url}/generate", body, route.headers, timeout_s):
                if "error" in event:
                    raise RuntimeError(f"error event: {str(event['error'])[:200]}")
                n = len(event.get("output_ids") or [])
                if n > seen:
                    times.append(t)
                    counts.append(n - seen)
                    seen = n
                last = event
            if last is None or not times:
                raise RuntimeError("stream without tokens")
            rec.e2e_s = time.perf_counter() - t_send
            rec.ttft_s, rec.tpot_s, rec.max_gap_s = token_timing(times, counts, t_send)
            meta = last.get("meta_info", {})
            rec.output_ids = list(last["output_ids"])
            rec.completion_tokens = int(meta.get("completion_tokens", len(rec.output_ids)))
            rec.cached_tokens = meta.get("cached_tokens")
            outputs[(slot.job, slot.turn)].set_result(rec.output_ids)
        except Exception as e:  # reported per request; the session stops here
            rec.error = f"{type(e).__name__}: {e}"[:300]
            outputs[(slot.job, slot.turn)].set_result(None)
        records.append(rec)
        bar.update(1)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(one(i, slot, session) for i, slot in enumerate(order)))
    return records


def warm_up(design: Design, timeout_s: float) -> None:
    """A few requests (own tokens, discarded): the first ones on a fresh server pay one-off costs."""
    cfg = WorkloadConfig(sessions=2, turns=(2, 2), outliers=1, outlier_input_tokens=(1100, 1100), seed=99)
    jobs = build_jobs(cfg)
    order = dispatch_order(jobs, lanes=2)
    bar = tqdm(total=len(order), desc=f"warm-up {design.name}", unit="req", file=sys.stderr, leave=False)
    recs = asyncio.run(run_cell([design.route()], jobs, cfg, order, [0.3 * i for i in range(len(order))],
                                f"warmup-{secrets.token_hex(2)}", 0, 0, timeout_s, bar))
    bar.close()
    failed = [r.error for r in recs if r.error]
    if len(failed) == len(recs):
        raise RuntimeError(f"{design.name} serves nothing after it started: {failed[0]}")


# ----------------------------------------------------------------------------- report
def fmt_ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:.0f}"


def fmt_pct(v) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def print_table(res: dict) -> None:
    cells, args = res["cells"], res["args"]
    print(f"\nSLA: TTFT <= {args['sla_ttft_ms']:.0f} ms and TPOT <= {args['sla_tpot_ms']:.0f} ms. "
          f"Times in ms; link MB = both directions, from the veth counters.")
    for link in args["links"]:
        info = res["links"].get(str(link), {})
        print(f"\n== link {link:g} Mbit/s: KV transfer / cold prefill r = {info.get('r', float('nan')):.2f} "
              f"(DeepSeek-V3 at {info.get('deepseek_v3_gbps', float('nan')):.1f} Gbit/s)")
        print(f"{'rate':>5} {'design':<36} {'TTFT p50':>8} {'p90':>6} {'p99':>6} | {'TPOT p50':>8} {'p90':>5} | "
              f"{'gap p99':>7} | {'SLA %':>5} {'goodput':>7} | {'err':>3} {'held':>4} | {'link MB':>7} | "
              f"{'cores ours':>10} {'others':>6} | {'P->MD':>5} {'RLD tok':>7}  paths")
        for rate in args["rates"]:
            for design in res["designs"]:
                c = cells.get(cell_key(design, link, rate)) or (cells.get(cell_key(design, args["links"][0], rate))
                                                                if design == "same_dc_pd" else None)
                if c is None:
                    continue
                mb = (c["link_bytes_a_to_b"] + c["link_bytes_b_to_a"]) / 1e6
                print(f"{rate:>5g} {LABELS[design]:<36} {fmt_ms(c['ttft_p50']):>8} {fmt_ms(c['ttft_p90']):>6} "
                      f"{fmt_ms(c['ttft_p99']):>6} | {fmt_ms(c['tpot_p50']):>8} {fmt_ms(c['tpot_p90']):>5} | "
                      f"{fmt_ms(c['gap_p99']):>7} | {100 * c['sla_attainment']:>5.0f} {c['goodput_rps']:>7.2f} | "
                      f"{c['errors']:>3} {c['held']:>4} | {mb:>7.2f} | {c.get('ours_cores', 0):>10.2f} "
                      f"{c.get('others_cores', 0):>6.2f} | {fmt_pct(c.get('p_md_share')):>5} "
                      f"{fmt_pct(c.get('rld_token_share')):>7}  "
                      f"{' '.join(f'{k}:{v}' for k, v in c['paths'].items())}")
    eq = res["equality"]
    print(f"\nGreedy outputs, request by request across designs: {eq['compared']} requests compared, "
          f"{eq['mismatches']} differ" + (f" (first: {eq['examples'][0]})" if eq["examples"] else ""))


def add_stages(res: dict, design: str, records: list[Record], stats: list[dict]) -> None:
    """Each of ``design``'s cells gets the stage split of its requests (ttft_stages)."""
    rows = ttft_stages(records, stats)
    key_of = {r.cell: cell_key(design, r.link_mbit, r.rate) for r in records}
    for cell, key in key_of.items():
        if key in res["cells"]:
            res["cells"][key]["stages"] = stage_summary([r for r in rows if r["cell"] == cell])


def print_stages(res: dict) -> None:
    print("\n== Where the time to first token goes (medians in ms, over the slowest quarter of each cell / over "
          "all; the decode side is the one that gave the first token: PDD's RLD)")
    head = " ".join(f"{k:>11}" for k in STAGES)
    print(f"{'link':>5} {'rate':>5} {'design':<36} {'matched':>7} {'TTFT':>9} {head}")
    for key, c in res["cells"].items():
        st = c.get("stages")
        if not st or not st["matched"]:
            continue
        design, link, rate = key.split("|")
        both = lambda k: f"{fmt_ms(st['tail'][k])}/{fmt_ms(st['all'][k])}"
        print(f"{link:>5} {rate:>5} {LABELS[design]:<36} {st['matched']:>7} {both('ttft'):>9} "
              + " ".join(f"{both(k):>11}" for k in STAGES))


def cell_key(design: str, link: float, rate: float) -> str:
    return f"{design}|{link:g}|{rate:g}"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links, rates, cells = res["args"]["links"], res["args"]["rates"], res["cells"]
    fig, ax = plt.subplots(2, len(links), figsize=(4.6 * len(links), 7), squeeze=False, sharex=True)
    for col, link in enumerate(links):
        info = res["links"].get(str(link), {})
        for design in res["designs"]:
            src = links[0] if design == "same_dc_pd" else link
            pts = [(rate, cells.get(cell_key(design, src, rate))) for rate in rates]
            pts = [(rate, c) for rate, c in pts if c]
            if not pts:
                continue
            style = dict(marker="o", color=COLORS[design], label=LABELS[design],
                         linestyle="--" if design == "same_dc_pd" else "-")
            ax[0][col].plot([p[0] for p in pts], [1e3 * (p[1]["ttft_p90"] or np.nan) for p in pts], **style)
            ax[1][col].plot([p[0] for p in pts], [p[1]["goodput_rps"] for p in pts], **style)
        ax[0][col].set_title(f"link {link:g} Mbit/s (r = {info.get('r', float('nan')):.2f}; "
                             f"~{info.get('deepseek_v3_gbps', float('nan')):.0f} Gbit/s for DeepSeek-V3)", fontsize=9)
        ax[0][col].axhline(res["args"]["sla_ttft_ms"], color="k", linewidth=0.6, linestyle=":")
        ax[0][col].set_yscale("log")
        ax[1][col].plot(rates, rates, color="k", linewidth=0.6, linestyle=":", label="offered")
        ax[1][col].set_xlabel("request rate (req/s, Poisson)")
    ax[0][0].set_ylabel("TTFT p90 (ms, log)")
    ax[1][0].set_ylabel(f"goodput (req/s within TTFT<={res['args']['sla_ttft_ms']:.0f} ms, "
                        f"TPOT<={res['args']['sla_tpot_ms']:.0f} ms)", fontsize=8)
    ax[1][0].legend(fontsize=7)
    fig.suptitle("PDD vs SGLang's own PD, real servers, datacenter B behind one shaped link (tiny model, 2 CPU cores)",
                 fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def spread_by_seed(runs: list[dict], link: float) -> dict:
    """TTFT p90 of every run's cell on ``link``: {seed: {design: {rate: [p90 s, one per run]}}}."""
    out: dict = {}
    for res in runs:
        seed = res["args"].get("seed", 0)
        for key, c in res["cells"].items():
            design, cell_link, rate = key.split("|")
            if float(cell_link) == link and c.get("ttft_p90") is not None:
                out.setdefault(seed, {}).setdefault(design, {}).setdefault(float(rate), []).append(c["ttft_p90"])
    return out


def plot_spread(runs: list[dict], link: float, path: Path) -> None:
    """One panel per seed: each run's TTFT p90 per design and rate as a dot, the median of the
    runs as a line, so a difference is read against the spread between runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spread = spread_by_seed(runs, link)
    seeds = sorted(spread)
    fig, ax = plt.subplots(1, len(seeds), figsize=(4.4 * len(seeds), 3.8), squeeze=False, sharey=True)
    for col, seed in enumerate(seeds):
        a = ax[0][col]
        for design, by_rate in spread[seed].items():
            rates = sorted(by_rate)
            for rate in rates:
                a.scatter([rate] * len(by_rate[rate]), [1e3 * v for v in by_rate[rate]], color=COLORS[design], s=14,
                          alpha=0.6)
            a.plot(rates, [1e3 * float(np.median(by_rate[r])) for r in rates], color=COLORS[design],
                   label=LABELS[design], marker="o" if design in PDD_PATH_MODES else None)
        runs_here = max(len(v) for d in spread[seed].values() for v in d.values())
        a.set_title(f"seed {seed}: {runs_here} runs, dots = runs, line = median", fontsize=9)
        a.set_yscale("log")
        a.set_xlabel("request rate (req/s, Poisson)")
        a.axhline(runs[0]["args"]["sla_ttft_ms"], color="k", linewidth=0.6, linestyle=":")
    ax[0][0].set_ylabel("TTFT p90 (ms, log)")
    ax[0][0].legend(fontsize=7)
    fig.suptitle(f"TTFT p90 across reruns, real servers, {link:g} Mbit/s link (tiny model, 2 CPU cores)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- TTFT breakdown (I/O)
BREAKDOWN_LABELS = {
    "same_dc_pd": "SGLang PD servers, SGLang's router",
    "sglang_pd_pdd_router": "SGLang PD servers, PDD's router",
    "pdd": "PDD, routing as it does",
    "pdd_rld_only": "PDD servers, P->RLD only (MD idle)",
    "pdd_rld_only_md_stopped": "PDD servers, P->RLD only, MD stopped",
}


def server_logs(design: Design) -> list[str]:
    lines = []
    for log in sorted((design.run_dir / design.name / "logs").glob("*.log")):
        lines += log.read_text(errors="replace").splitlines()
    return lines


def run_breakdown(args, link, model: str, out: Path) -> dict:
    """Where the time to first token goes, same-datacenter PD against PDD, at the first rate and
    link, each stage from the servers' own time stats (STAGES). Paired where the servers allow:
    SGLang's PD servers behind SGLang's router and behind PDD's router at once (sessions
    alternate between them), PDD's servers routing as usual and keeping every request on
    P->RLD at once (MD idle for those); then P->RLD with MD stopped. The servers see the main
    comparison's rate; variants that share them get twice the sessions, half each."""
    rate, link_mbit = args.rates[0], args.links[0]
    double = argparse.Namespace(**{**vars(args), "sessions": 2 * args.sessions, "lanes": 2 * args.lanes,
                                   "outliers": 2 * args.outliers})
    cfg2, jobs2 = workload(double)
    order2 = dispatch_order(jobs2, double.lanes)
    cfg1, jobs1 = workload(args)
    order1 = dispatch_order(jobs1, args.lanes)
    records: list[Record] = []
    stats: list[dict] = []
    bar = tqdm(total=2 * len(order2) + len(order1), desc="TTFT breakdown", unit="req", file=sys.stderr)

    def cell(routes: list[Route], design: Design, cfg, jobs, order, salt: str) -> None:
        bar.set_postfix_str(" + ".join(r.name for r in routes))
        recs = asyncio.run(run_cell(routes, jobs, cfg, order, poisson_arrivals(len(order), rate, 7),
                                    f"bd-{salt}", link_mbit, rate, args.request_timeout_s, bar))
        design.annotate(recs)
        records.extend(recs)

    sglang = SglangPdDesign("same_dc_pd", out / "breakdown", model, link, cross_dc=False, radix=False)
    sglang.server_args = TIME_STATS_ARGS
    try:
        sglang.start()
        warm_up(sglang, args.request_timeout_s)
        rust = sglang.route()
        sglang.front_with_pdd_router(pdd_router_args(args))
        warm_up(sglang, args.request_timeout_s)
        cell([rust, replace(sglang.route(), name="sglang_pd_pdd_router")], sglang, cfg2, jobs2, order2, "a")
        stats += parse_time_stats(server_logs(sglang))
    finally:
        sglang.stop()
    pdd = PddDesign(out / "breakdown", model, link, pdd_router_args(args), link_mbit)
    pdd.server_args = TIME_STATS_ARGS
    try:
        pdd.start()
        pdd.set_link(link_mbit)
        warm_up(pdd, args.request_timeout_s)
        forced = pdd.route_on_path("p_rld_only", "pdd_rld_only")
        cell([pdd.route(), forced], pdd, cfg2, jobs2, order2, "b")
        pdd.cluster.procs.stop("main-0")
        cell([replace(forced, name="pdd_rld_only_md_stopped")], pdd, cfg1, jobs1, order1, "c")
        stats += parse_time_stats(server_logs(pdd))
    finally:
        pdd.stop()
    bar.close()
    rows = ttft_stages(records, stats)
    table = {}
    for name in BREAKDOWN_LABELS:
        mine = [r for r in rows if r["design"] == name]
        recs = [r for r in records if r.design == name and r.error is None]
        table[name] = {"requests": len([r for r in records if r.design == name]), "matched": len(mine),
                       "errors": len([r for r in records if r.design == name and r.error]),
                       "ttft_p50": pct([r.ttft_s for r in recs], 50), "ttft_p90": pct([r.ttft_s for r in recs], 90),
                       "tpot_p50": pct([r.tpot_s for r in recs], 50),
                       "matched_ttft_p50": pct([m["ttft"] for m in mine], 50),
                       **{f"{k}_p50": pct([m[k] for m in mine], 50) for k in STAGES}}
    with open(out / "breakdown_requests.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(asdict(r)) + "\n")
    return {"rate": rate, "link_mbit": link_mbit, "variants": table, "rows": rows}


def print_breakdown(bd: dict) -> None:
    print(f"\n== Where the time to first token goes ({bd['rate']:g} req/s, link {bd['link_mbit']:g} Mbit/s): "
          f"medians in ms over the requests matched to the servers' time stats")
    head = " ".join(f"{k:>11}" for k in STAGES)
    print(f"{'variant':<38} {'n':>3} {'TTFT p50':>8} {'p90':>5} {'TPOT p50':>8} | {'matched':>7} {'TTFT':>5} {head}")
    for name, v in bd["variants"].items():
        stages = " ".join(f"{fmt_ms(v[f'{k}_p50']):>11}" for k in STAGES)
        print(f"{BREAKDOWN_LABELS[name]:<38} {v['requests']:>3} {fmt_ms(v['ttft_p50']):>8} {fmt_ms(v['ttft_p90']):>5} "
              f"{fmt_ms(v['tpot_p50']):>8} | {v['matched']:>7} {fmt_ms(v['matched_ttft_p50']):>5} {stages}")
    print("(rows 1-2 ran at once on the same servers, sessions alternating between them; rows 3-4 too; row 5 after "
          "MD was stopped)")


# ----------------------------------------------------------------------------- cold burst (pure)
BURST_DESIGNS = ("same_dc_pd", "cross_dc_pd", "pdd")
BURST_PATHS = ("p_md", "p_rld_md", "p_rld_only")


def burst_workload(args) -> tuple[WorkloadConfig, list]:
    """``args.burst`` sessions, no outliers: the burst is the sessions' cold first turns, of
    about ``args.burst_prompt_tokens`` each (+-10%); later turns' new blocks scaled as
    ``--target-hit`` says."""
    cfg = WorkloadConfig(sessions=args.burst, turns=tuple(args.turns), outliers=0,
                         output_tokens=tuple(args.output_tokens), seed=args.seed)
    if args.target_hit > 0:
        cfg = fit_block_scale(cfg, args.target_hit)
    first = max(1, args.burst_prompt_tokens - cfg.system_tokens) / cfg.block_scale
    cfg = replace(cfg, first_user_tokens=(0.9 * first, 1.1 * first))
    return cfg, build_jobs(cfg)


def burst_arrivals(order: list[Slot]) -> list[float]:
    """Every slot arrives at the cell's start: the sessions' first turns go out together, and a
    later turn goes out the moment its session has the previous answer (run_cell holds it)."""
    return [0.0] * len(order)


def _ttft_cell(recs: list[Record]) -> dict:
    ttft = [r.ttft_s for r in recs]
    return {"n": len(recs), "ttft_p50": pct(ttft, 50), "ttft_p90": pct(ttft, 90), "ttft_max": pct(ttft, 100)}


def burst_summary(records: list[Record]) -> dict:
    """TTFT per design and link: over all requests, over the cold first turns and the later
    turns, per PDD path, and each repeat's p90 (the spread); errors counted apart. Keyed
    ``design|link``."""
    out: dict = {}
    for key in sorted({(r.design, r.link_mbit) for r in records}):
        mine = [r for r in records if (r.design, r.link_mbit) == key]
        ok = [r for r in mine if r.error is None and r.ttft_s is not None]
        cell = _ttft_cell(ok) | {"errors": len(mine) - len(ok),
                                 "first_turns": _ttft_cell([r for r in ok if r.turn == 0]),
                                 "later_turns": _ttft_cell([r for r in ok if r.turn > 0]),
                                 "paths": {p: _ttft_cell([r for r in ok if r.path == p])
                                           for p in BURST_PATHS if any(r.path == p for r in ok)},
                                 "p90_per_repeat": [pct([r.ttft_s for r in ok if r.cell == c], 90)
                                                    for c in sorted({r.cell for r in ok})]}
        if any(r.path for r in ok):
            cell["md_warmth"] = md_warmth(ok)
        out[f"{key[0]}|{key[1]:g}"] = cell
    return out


def md_warmth(records: list[Record]) -> dict:
    """Whether MD's cache keeps up with P's (PDD, from the router's log): the relayed requests,
    those that ended before MD had answered their registration (no ``md_registered`` mark:
    their KV reaches MD only if the registration outlives the request), how many of these a
    later turn of their session found whole in MD's cache (of those with a later turn), and the
    later turns' mean MD prefix hit (MD's cached prompt tokens / prompt tokens). The next turn
    alone says little: it often comes before the KV has crossed a slow link."""
    relayed = [r for r in records if r.path == "p_rld_md"]
    turns = {(r.cell, r.job, r.turn): r for r in records}
    ended_first = [r for r in relayed if "md_registered" not in r.router_marks]
    followed = [(r, [t for k, t in turns.items() if k[:2] == (r.cell, r.job) and k[2] > r.turn]) for r in ended_first]
    followed = [(r, later) for r, later in followed if later]
    later = [r for r in records if r.turn > 0 and r.md_cached_tokens is not None and r.prompt_tokens]
    return {"relayed": len(relayed), "relayed_ended_before_md_answered": len(ended_first),
            "ended_first_with_later_turns": len(followed),
            "ended_first_found_later_on_md": sum(any((t.md_cached_tokens or 0) >= r.prompt_tokens - 1 for t in ts)
                                                 for r, ts in followed),
            "later_turns": len(later),
            "later_md_hit_mean": float(np.mean([r.md_cached_tokens / r.prompt_tokens for r in later])) if later else None}


def burst_ratios(summary: dict, link: float) -> dict:
    """The goal's ratios on one link: PDD's TTFT p90 over cross-DC PD's and same-DC PD's, and
    its relayed requests' (P->RLD->MD) p90 over same-DC PD's; None where a side is missing."""
    get = lambda design: summary.get(f"{design}|{link:g}") or summary.get(f"{design}|0")
    pdd, cross, same = get("pdd"), get("cross_dc_pd"), get("same_dc_pd")
    ratio = lambda a, b: a / b if a is not None and b else None
    relayed = (pdd or {}).get("paths", {}).get("p_rld_md", {}).get("ttft_p90")
    return {"pdd_over_cross_dc": ratio(pdd and pdd["ttft_p90"], cross and cross["ttft_p90"]),
            "pdd_over_same_dc": ratio(pdd and pdd["ttft_p90"], same and same["ttft_p90"]),
            "relayed_over_same_dc": ratio(relayed, same and same["ttft_p90"])}


def _burst_of(r: Record) -> str:
    """The burst a request belongs to, the same for every design: its repeat (and, pooled, run)."""
    return r.cell.split("x", 1)[-1]


def same_turns_on(records: list[Record], design: str, like: list[Record]) -> list[Record]:
    """``design``'s records of the requests ``like`` holds (same repeat, session and turn; the
    link may differ: same-DC PD runs once, on the first link's prompts)."""
    want = {(_burst_of(r), r.job, r.turn) for r in like}
    return [r for r in records if r.design == design and r.error is None and (_burst_of(r), r.job, r.turn) in want]


def relayed_vs_same_dc(records: list[Record], link: float) -> dict:
    """PDD's relayed requests (P->RLD->MD) on ``link`` against same-DC PD serving the same turns:
    TTFT p90 of each and their ratio."""
    relayed = [r for r in records if r.design == "pdd" and r.link_mbit == link and r.path == "p_rld_md"
               and r.error is None]
    same = same_turns_on(records, "same_dc_pd", relayed)
    a, b = pct([r.ttft_s for r in relayed], 90), pct([r.ttft_s for r in same], 90)
    return {"n": len(relayed), "relayed_p90": a, "same_dc_same_turns_p90": b,
            "ratio": a / b if a is not None and b else None}


GOAL_RATIO = 1.1  # PDD's TTFT p90 within 1.1x same-DC PD's


def ratio_intervals(records: list[Record], link: float, resamples: int = 2000, level: float = 0.9,
                    seed: int = 0) -> dict:
    """How sure the goal's p90 ratios on ``link`` are: the bursts are resampled with replacement
    (one burst holds the same prompts on every design, and its requests share their fate: a
    batch split or a busy second slows all of them, so the burst is the unit, not the
    request), each ratio recomputed on each resample. Per ratio: the central ``level``
    interval and the share of resamples at or below GOAL_RATIO; None where a side is empty."""
    ok = [r for r in records if r.error is None and r.ttft_s is not None]
    pdd = [r for r in ok if r.design == "pdd" and r.link_mbit == link]
    same = [r for r in ok if r.design == "same_dc_pd"]
    relayed = [r for r in pdd if r.path == "p_rld_md"]
    same_turns = same_turns_on(same, "same_dc_pd", relayed)
    sides = {"pdd_over_same_dc": (pdd, same), "relayed_over_same_dc": (relayed, same),
             "relayed_over_same_turns": (relayed, same_turns)}
    # With pdd_rld_only run beside: the relayed turns without their WAN leg (PDD's router, P and
    # RLD alone) against same-DC PD, and what the WAN leg adds to them.
    without_wan = same_turns_on([r for r in ok if r.link_mbit == link], "pdd_rld_only", relayed)
    if without_wan:
        sides |= {"without_wan_over_same_turns": (without_wan, same_turns), "relayed_over_without_wan": (relayed, without_wan)}
    # With pdd_md_after_first run beside: the same ratios when MD's side waits for the first token.
    after_first = [r for r in ok if r.design == "pdd_md_after_first" and r.link_mbit == link]
    if after_first:
        late_relayed = [r for r in after_first if r.path == "p_rld_md"]
        sides |= {"md_after_first_over_same_dc": (after_first, same),
                  "md_after_first_relayed_over_same_dc": (late_relayed, same),
                  "md_after_first_over_pdd": (after_first, pdd),
                  "md_after_first_relayed_over_relayed": (late_relayed, relayed)}
    bursts = sorted({_burst_of(r) for r in pdd} & {_burst_of(r) for r in same})
    index = {b: i for i, b in enumerate(bursts)}
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(bursts), size=(resamples, len(bursts))) if bursts else []

    def by_burst(recs: list[Record]) -> list[np.ndarray]:
        ttfts: list[list] = [[] for _ in bursts]
        for r in recs:
            if _burst_of(r) in index:
                ttfts[index[_burst_of(r)]].append(r.ttft_s)
        return [np.array(t) for t in ttfts]

    out: dict = {"bursts": len(bursts), "level": level}
    for name, (num, den) in sides.items():
        a, b = by_burst(num), by_burst(den)
        ratios = []
        for pick in picks:
            x, y = np.concatenate([a[i] for i in pick]), np.concatenate([b[i] for i in pick])
            if len(x) and len(y):
                ratios.append(np.percentile(x, 90) / np.percentile(y, 90))
        if not ratios:
            out[name] = None
            continue
        tail = (1 - level) / 2 * 100
        out[name] = {"low": float(np.percentile(ratios, tail)), "high": float(np.percentile(ratios, 100 - tail)),
                     "within_goal": float(np.mean(np.array(ratios) <= GOAL_RATIO))}
    return out


def pool_bursts(out_dirs: list[Path]) -> dict:
    """Several --burst runs' requests as one sample: each run's cells tagged with the run
    (``cell@i``, so the same turns still match within a run only), then summarised as one run
    is, plus each run's own p90 per design and link."""
    records: list[Record] = []
    per_run: dict = {}
    for i, out in enumerate(out_dirs):
        path = out / "burst_requests.jsonl"
        if not path.exists():
            raise SystemExit(f"--pool-bursts: {path} does not exist (not a --burst run's --out?)")
        mine = [Record(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
        for r in mine:
            r.cell = f"{r.cell}@{i}"
        for key, cell in burst_summary(mine).items():
            per_run.setdefault(key, []).append(cell["ttft_p90"])
        records += mine
    summary = burst_summary(records)
    links = sorted({r.link_mbit for r in records if r.link_mbit})
    return {"runs": len(out_dirs), "summary": summary, "p90_per_run": per_run,
            "ratios": {f"{m:g}": burst_ratios(summary, m) | {"relayed_same_turns": relayed_vs_same_dc(records, m),
                                                             "intervals": ratio_intervals(records, m)}
                       for m in links}}


def print_pooled_bursts(pooled: dict, names: list[str]) -> None:
    fr = lambda v: "-" if v is None else f"{v:.2f}"
    print(f"== {pooled['runs']} burst runs pooled ({', '.join(names)}); TTFT in ms")
    print(f"{'design|link':<22} {'n':>4} {'err':>3} {'p50':>6} {'p90':>6} | p90 per run")
    for key, c in pooled["summary"].items():
        runs = " ".join(fmt_ms(v) for v in pooled["p90_per_run"].get(key, []))
        print(f"{key:<22} {c['n']:>4} {c['errors']:>3} {fmt_ms(c['ttft_p50']):>6} {fmt_ms(c['ttft_p90']):>6} | {runs}")
        for path, v in c["paths"].items():
            print(f"  {path:<20} {v['n']:>4}     {fmt_ms(v['ttft_p50']):>6} {fmt_ms(v['ttft_p90']):>6}")
        print_md_warmth(f"  {key}", c.get("md_warmth"))
    for link, r in pooled["ratios"].items():
        same = r["relayed_same_turns"]
        print(f"link {link} Mbit/s, pooled p90s: PDD / cross-DC PD {fr(r['pdd_over_cross_dc'])} (goal <= 1), "
              f"/ same-DC PD {fr(r['pdd_over_same_dc'])} (<= 1.1); relayed / same-DC PD "
              f"{fr(r['relayed_over_same_dc'])} (<= 1.1), on the same turns {fr(same['ratio'])} (n {same['n']})")
        print_intervals(r["intervals"])


def print_md_warmth(name: str, w: Optional[dict]) -> None:
    if not w:
        return
    hit = "-" if w["later_md_hit_mean"] is None else f"{w['later_md_hit_mean']:.3f}"
    print(f"{name}: MD's cache: {w['relayed_ended_before_md_answered']} of {w['relayed']} relayed requests ended "
          f"before MD answered their registration; a later turn found {w['ended_first_found_later_on_md']} of "
          f"{w['ended_first_with_later_turns']} of those prompts whole on MD; later turns' MD hit mean {hit} "
          f"({w['later_turns']} turns)")


def print_intervals(iv: dict) -> None:
    spans = [f"{name} {v['low']:.2f}-{v['high']:.2f} ({100 * v['within_goal']:.0f}% <= {GOAL_RATIO})"
             for name, v in iv.items() if isinstance(v, dict)]
    if spans:
        print(f"  {100 * iv['level']:.0f}% intervals, {iv['bursts']} bursts resampled: " + "; ".join(spans))


ROUTER_MARKS = ("path", "legs", "md_registered", "destination", "p_replied", "first_token", "md_ready")


def router_marks_table(records: list[Record]) -> dict:
    """Medians of the router's marks (s from the flow's start) per PDD design, link and path."""
    groups: dict = {}
    for r in records:
        if r.router_marks and r.error is None:
            groups.setdefault(f"{r.design}|{r.link_mbit:g}|{r.path}", []).append(r.router_marks)
    return {key: {"n": len(ms), **{m: pct([x.get(m) for x in ms], 50) for m in ROUTER_MARKS}}
            for key, ms in sorted(groups.items())}


def burst_stage_table(rows: list[dict]) -> dict:
    """Medians of each TTFT stage per design and PDD path (``design`` or ``design:path``)."""
    groups: dict = {}
    for row in rows:
        groups.setdefault(row["design"] + (f":{row['path']}" if row.get("path") else ""), []).append(row)
    return {name: {"matched": len(rs), **{k: float(np.median([r[k] for r in rs])) for k in ("ttft",) + STAGES}}
            for name, rs in sorted(groups.items())}


# A burst cell starts once the link is quiet: a PDD design's P may still send KV to MD after its
# burst's answers are out (seconds on a slow link), and that KV and P's work sending it could
# fall on the next design's burst, always the same one (the rotation keeps who follows whom).
# Quiet: under QUIET_SHARE of the link's rate over QUIET_WINDOW_S (the router's probes
# and load polls cross it all the time).
QUIET_SHARE = 0.02
QUIET_WINDOW_S = 0.5
SETTLE_TIMEOUT_S = 60.0


def link_quiet(moved_bytes: int, window_s: float, rate_mbit: float) -> bool:
    return moved_bytes * 8 / window_s < QUIET_SHARE * rate_mbit * 1e6


def settle_link(link, rate_mbit: float, window_s: float = QUIET_WINDOW_S, timeout_s: float = SETTLE_TIMEOUT_S) -> float:
    """Wait until the link is quiet (or ``timeout_s``); the seconds waited."""
    t0 = time.monotonic()
    last = sum(link.counters())
    while time.monotonic() - t0 < timeout_s:
        time.sleep(window_s)
        now = sum(link.counters())
        if link_quiet(now - last, window_s, rate_mbit):
            break
        last = now
    return time.monotonic() - t0


# ----------------------------------------------------------------------------- cold burst (I/O)
def run_burst(args, link, model: str, out: Path) -> dict:
    """The cold burst: every design's servers up at once (idle ones sleep), then per link and
    repeat the same burst on each design in turn, the order rotated per repeat, so that the
    machine's load falls on all designs alike, each cell once the link is quiet
    (settle_link). Each repeat's prompts are new (cold everywhere) and the same for every
    design."""
    cfg, jobs = burst_workload(args)
    order = dispatch_order(jobs, lanes=args.burst)
    names = [d for d in args.designs if d in BURST_DESIGNS or d in PDD_PATH_MODES]
    if link is None:
        names = [d for d in names if d == "same_dc_pd" or d in PDD_PATH_MODES]
    records: list[Record] = []
    stats: list[dict] = []
    meta: dict = {"loadavg_before": os.getloadavg(), "cells": {}}
    started: dict = {}
    n_cells = sum(len(args.links) if d != "same_dc_pd" else 1 for d in names) * args.repeats
    bar = tqdm(total=n_cells * len(order), desc="burst", unit="req", file=sys.stderr)
    try:
        prefill_s_per_token = None
        for name in [n for n in names if n == "same_dc_pd"] + [n for n in names if n != "same_dc_pd"]:
            bar.set_postfix_str(f"{name}: starting servers")
            design = make_design(name, out / "servers", model, link, args, prefill_s_per_token)
            if args.time_stats:
                design.server_args = TIME_STATS_ARGS
            started[name] = design
            design.start()
            warm_up(design, args.request_timeout_s)
            if name == "same_dc_pd":
                prefill_s_per_token = measure_prefill_s_per_token(design)
                meta["prefill_s_per_token"] = prefill_s_per_token
        if args.dc_b_nice and link is not None:
            from sglang_pdd.launcher.netns import renice_namespace

            meta["dc_b_threads_reniced"] = renice_namespace(link.namespace, args.dc_b_nice)
        for li, link_mbit in enumerate(args.links):
            for name, design in started.items():
                if name != "same_dc_pd":
                    design.set_link(link_mbit)
                    if name in PDD_PATH_MODES:
                        warm_up(design, args.request_timeout_s)
            for rep in range(args.repeats):
                turn = list(started.items())
                turn = turn[rep % len(turn):] + turn[:rep % len(turn)]
                for name, design in turn:
                    if name == "same_dc_pd" and li > 0:
                        continue  # no link in its path: once is enough
                    cell = f"b{li}x{rep}s{args.seed}"
                    bar.set_postfix_str(f"{name}, {link_mbit:g} Mbit/s, repeat {rep + 1}")
                    settle_s = settle_link(link, link_mbit) if link is not None else 0.0
                    before = link.counters() if link is not None else (0, 0)
                    t0, cpu, load = time.time(), CpuMeter(), os.getloadavg()[0]
                    recs = asyncio.run(run_cell([design.route()], jobs, cfg, order, burst_arrivals(order), cell,
                                                0 if name == "same_dc_pd" else link_mbit, 0, args.request_timeout_s,
                                                bar))
                    after = link.counters() if link is not None else (0, 0)
                    design.annotate(recs)
                    meta["cells"][f"{name}|{cell}"] = {"wall_s": time.time() - t0, "loadavg_1m": load, "settle_s": settle_s,
                                                       "link_bytes": (after[0] - before[0]) + (after[1] - before[1])
                                                       } | cpu.stop()
                    records += recs
    finally:
        bar.close()
        for name, design in started.items():
            if args.time_stats:
                with contextlib.suppress(OSError):
                    stats += parse_time_stats(server_logs(design))
            design.stop()
    summary = burst_summary(records)
    res = {"args": vars(args), "designs": list(started), "workload": {"config": asdict(cfg),
           "requests_per_cell": len(order), "first_turn_tokens": [r.prompt_tokens for r in records
                                                                  if r.turn == 0 and r.design == names[0]][:args.burst]},
           "summary": summary, "ratios": {f"{m:g}": burst_ratios(summary, m) | {
               "relayed_same_turns": relayed_vs_same_dc(records, m), "intervals": ratio_intervals(records, m)}
               for m in args.links},
           "equality": compare_outputs(records), "router_marks": router_marks_table(records), **meta}
    if args.time_stats:
        res["stages"] = burst_stages_per_link(records, stats, args.links)
    with open(out / "burst_requests.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(asdict(r)) + "\n")
    return res


def burst_stages_per_link(records: list[Record], stats: list[dict], links: list[float]) -> dict:
    """The stage table of each link's cells (same-DC PD's cells, which have no link, in each)."""
    rows = ttft_stages(records, stats)
    link_of = {(r.design, r.cell): r.link_mbit for r in records}
    return {f"{m:g}": burst_stage_table([row for row in rows if link_of.get((row["design"], row["cell"])) in (m, 0)])
            for m in links}


def print_burst(res: dict) -> None:
    a = res["args"]
    print(f"\n== Cold burst: {a['burst']} sessions' first turns at once, later turns as answers come "
          f"({res['workload']['requests_per_cell']} requests per cell, {a['repeats']} repeat(s)); TTFT in ms")
    if a.get("torch_threads"):
        print(f"every server's torch threads: {a['torch_threads']} (OMP_NUM_THREADS)")
    if a.get("dc_b_nice"):
        print(f"datacenter B's servers at nice {a['dc_b_nice']} ({res.get('dc_b_threads_reniced', 0)} threads): "
              f"B's work takes only the cycles A's leaves")
    for link in a["links"]:
        print(f"\n-- link {link:g} Mbit/s")
        print(f"{'design':<26} {'n':>3} {'err':>3} {'p50':>6} {'p90':>6} {'max':>6} | {'1st p50':>7} {'p90':>6} | "
              f"{'later p50':>9} {'p90':>6} | {'p90 per repeat':<22} | paths: n p50/p90")
        for design in res["designs"]:
            c = res["summary"].get(f"{design}|{link:g}") or (res["summary"].get(f"{design}|0")
                                                            if design == "same_dc_pd" else None)
            if c is None:
                continue
            f, l = c["first_turns"], c["later_turns"]
            paths = "  ".join(f"{p}: {v['n']} {fmt_ms(v['ttft_p50'])}/{fmt_ms(v['ttft_p90'])}"
                              for p, v in c["paths"].items())
            reps = " ".join(fmt_ms(v) for v in c["p90_per_repeat"])
            print(f"{LABELS[design]:<26} {c['n']:>3} {c['errors']:>3} {fmt_ms(c['ttft_p50']):>6} "
                  f"{fmt_ms(c['ttft_p90']):>6} {fmt_ms(c['ttft_max']):>6} | {fmt_ms(f['ttft_p50']):>7} "
                  f"{fmt_ms(f['ttft_p90']):>6} | {fmt_ms(l['ttft_p50']):>9} {fmt_ms(l['ttft_p90']):>6} | "
                  f"{reps:<22} | {paths}")
        for design in res["designs"]:
            print_md_warmth(design, (res["summary"].get(f"{design}|{link:g}") or {}).get("md_warmth"))
        r = res["ratios"][f"{link:g}"]
        fr = lambda v: "-" if v is None else f"{v:.2f}"
        print(f"PDD TTFT p90 / cross-DC PD's {fr(r['pdd_over_cross_dc'])} (goal <= 1), / same-DC PD's "
              f"{fr(r['pdd_over_same_dc'])} (<= 1.1); relayed (P->RLD->MD) p90 / same-DC PD's "
              f"{fr(r['relayed_over_same_dc'])} (<= 1.1)")
        same = r.get("relayed_same_turns") or {}
        if same.get("n"):
            print(f"relayed requests ({same['n']}): TTFT p90 {fmt_ms(same['relayed_p90'])} ms; same-DC PD on the same "
                  f"turns {fmt_ms(same['same_dc_same_turns_p90'])} ms (ratio {fr(same['ratio'])})")
        print_intervals(r["intervals"])
        for design in res["designs"]:
            cores = burst_server_cores(res["cells"], design, 0 if design == "same_dc_pd" else link, res["args"])
            if cores:
                print(f"cores while {design}'s bursts ran (mean): "
                      + " ".join(f"{k} {v:.2f}" for k, v in cores.items() if v >= 0.01))
        marks = {k: v for k, v in res.get("router_marks", {}).items() if k.split("|")[1] == f"{link:g}"}
        if marks:
            print("router's marks (medians, ms from the flow's start): " + " ".join(ROUTER_MARKS))
            for key, v in marks.items():
                print(f"  {key:<24} {v['n']:>3} " + " ".join(f"{fmt_ms(v[m]):>8}" for m in ROUTER_MARKS))
        st = res.get("stages", {}).get(f"{link:g}")
        if st:
            print("stages (medians, ms):")
            print(f"  {'design[:path]':<24} {'n':>3} {'TTFT':>6} " + " ".join(f"{k:>11}" for k in STAGES))
            for name, v in st.items():
                print(f"  {name:<24} {v['matched']:>3} {fmt_ms(v['ttft']):>6} "
                      + " ".join(f"{fmt_ms(v[k]):>11}" for k in STAGES))
    eq = res["equality"]
    loads = [c["loadavg_1m"] for c in res["cells"].values()]
    print(f"\nGreedy outputs across designs: {eq['compared']} requests compared, {eq['mismatches']} differ; "
          f"load average (1 min) at the cells' starts {min(loads):.1f}-{max(loads):.1f}" if loads else "")
    settles = [c["settle_s"] for c in res["cells"].values() if "settle_s" in c]
    if settles:
        print(f"each cell started once the link was quiet: waited {np.median(settles):.1f} s at the median, "
              f"{max(settles):.1f} s at most ({sum(s >= SETTLE_TIMEOUT_S for s in settles)} cells gave up waiting)")


def burst_server_cores(cells: dict, design: str, link: float, args: dict) -> dict:
    """Mean cores of each server (by role), the benchmark's total and everything else's, over
    ``design``'s burst cells on ``link`` (0: same-DC PD's, which run on the first link)."""
    li = 0 if not link else args["links"].index(link)
    mine = [c for key, c in cells.items() if key.startswith(f"{design}|b{li}x")]
    if not mine:
        return {}
    labels = sorted({k for c in mine for k in c.get("server_cores", {})})
    out = {k: float(np.mean([c.get("server_cores", {}).get(k, 0.0) for c in mine])) for k in labels}
    out["all ours"] = float(np.mean([c["ours_cores"] for c in mine]))
    out["others"] = float(np.mean([c["others_cores"] for c in mine]))
    return out


def plot_intervals(pooled: dict, path: Path) -> None:
    """Pooled bursts: each goal ratio's p90 interval per link, the goal's 1.1x as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(link, name, v) for link, r in pooled["ratios"].items()
            for name, v in r["intervals"].items() if isinstance(v, dict)]
    fig, ax = plt.subplots(figsize=(7.5, 0.45 * len(rows) + 1.4))
    for y, (link, name, v) in enumerate(rows):
        ax.plot([v["low"], v["high"]], [y, y], lw=5, color="tab:blue" if v["within_goal"] >= 0.5 else "tab:red")
        ax.text(v["high"] + 0.02, y, f"{100 * v['within_goal']:.0f}% <= {GOAL_RATIO}", va="center", fontsize=8)
    ax.axvline(GOAL_RATIO, color="gray", ls="--")
    ax.axvline(1.0, color="lightgray")
    ax.set_yticks(range(len(rows)), [f"{link} Mbit/s: {name}" for link, name, _ in rows], fontsize=8)
    ax.invert_yaxis()
    level = next(iter(pooled["ratios"].values()))["intervals"]["level"] if pooled["ratios"] else 0.9
    ax.set_xlabel(f"TTFT p90 ratio, {100 * level:.0f}% interval (whole bursts resampled)")
    ax.set_title(f"{pooled['runs']} burst runs pooled", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_burst(res: dict, path: Path) -> None:
    """TTFT p90 per design and link, PDD's split by path, each repeat a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = res["args"]["links"]
    fig, ax = plt.subplots(1, len(links), figsize=(4.8 * len(links), 3.8), squeeze=False, sharey=True)
    for col, link in enumerate(links):
        a, bars = ax[0][col], []
        for design in res["designs"]:
            c = res["summary"].get(f"{design}|{link:g}") or (res["summary"].get(f"{design}|0")
                                                            if design == "same_dc_pd" else None)
            if c is None:
                continue
            bars.append((LABELS[design], c["ttft_p90"], COLORS[design], c["p90_per_repeat"]))
            for p, v in c["paths"].items():
                bars.append((f"{LABELS[design]} {p}", v["ttft_p90"], COLORS[design], []))
        for i, (label, p90, color, reps) in enumerate(bars):
            a.bar(i, 1e3 * (p90 or 0), color=color, alpha=0.5 if " p_" in label else 0.9)
            a.scatter([i] * len(reps), [1e3 * v for v in reps if v is not None], color="k", s=10, zorder=3)
        a.set_xticks(range(len(bars)), [b[0] for b in bars], rotation=30, ha="right", fontsize=7)
        a.set_title(f"link {link:g} Mbit/s", fontsize=9)
    ax[0][0].set_ylabel("TTFT p90 (ms); dots: each repeat")
    fig.suptitle(f"Cold burst of {res['args']['burst']} sessions, real servers (tiny model, 2 CPU cores)",
                 fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one link, one rate, a few sessions (the e2e test's size)")
    ap.add_argument("--ttft-breakdown", action="store_true",
                    help="instead of the comparison: where same-DC PD's and PDD's time to first token goes, at the "
                         "first rate and link (servers log their own time stats)")
    ap.add_argument("--spread-of", nargs="+", metavar="RESULTS_JSON",
                    help="instead of running: draw the TTFT p90 of these runs' cells on the first --links rate, a "
                         "panel per seed, to --plot")
    ap.add_argument("--pool-bursts", nargs="+", metavar="OUT_DIR",
                    help="instead of running: the requests of these --burst runs (their burst_requests.jsonl) "
                         "pooled: TTFT p50/p90 per design and link over all runs, each run's p90 beside it, "
                         "and the goal's ratios on the pooled p90s")
    ap.add_argument("--time-stats", action="store_true",
                    help="servers log their time stats; each cell's TTFT is split into stages, over all requests "
                         "and over the slowest quarter")
    ap.add_argument("--burst", type=int, default=0, metavar="N",
                    help="instead of the comparison: a cold burst of N sessions (first turns at once, each later "
                         "turn as soon as its session has the answer) on same-DC PD, cross-DC PD and PDD, their "
                         "servers up together, designs taking turns per repeat; TTFT per design and PDD path "
                         "(links default 8 and 40 Mbit/s)")
    ap.add_argument("--burst-prompt-tokens", type=int, default=680,
                    help="--burst: the cold first turns' prompt length (+-10%%; later turns grow from it)")
    ap.add_argument("--repeats", type=int, default=2, help="--burst: bursts per design and link (new prompts each)")
    ap.add_argument("--torch-threads", type=int, default=0, metavar="N",
                    help="every server's torch (OpenMP) threads (OMP_NUM_THREADS); 0: torch's own choice, one per "
                         "core in every server, which oversubscribes a small machine once three servers compute")
    ap.add_argument("--dc-b-nice", type=int, default=0, metavar="N",
                    help="--burst: every thread in datacenter B's namespace (PDD's MD, cross-DC PD's decode "
                         "server) at nice N (1-19) once the servers are up, so B's work takes only the cycles A's "
                         "leaves, as B's own chips would; 0: all servers share the cores alike")
    ap.add_argument("--designs", nargs="+", choices=DESIGNS + OPTIONAL_DESIGNS, default=None,
                    help="default: all but pdd_rld_only (--burst: same_dc_pd cross_dc_pd pdd); pdd_rld_only: "
                         "PDD's servers and router with every request sent P->RLD only (an operator's path), "
                         "beside pdd: what the WAN leg adds to a relayed request; pdd_md_after_first: PDD with "
                         "--md-side-after-first-token (MD's registration and P's destination after the client's "
                         "first token)")
    ap.add_argument("--links", type=float, nargs="+", default=None, metavar="MBIT",
                    help="link rates, Mbit/s each way (the tiny model's KV, 1 KB/token in float32, over its cold "
                         "prefill: r ~0.3-5 on this machine); default 200 40 10 (--burst: 8 40)")
    ap.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.5, 5.0], metavar="RPS",
                    help="request rates, Poisson (the last near saturation on 2 shared cores)")
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--turns", type=int, nargs=2, default=[5, 7], metavar=("MIN", "MAX"))
    ap.add_argument("--lanes", type=int, default=6, help="sessions live at once (turns round robin over them)")
    ap.add_argument("--outliers", type=int, default=2)
    ap.add_argument("--output-tokens", type=int, nargs=2, default=[16, 48], metavar=("MIN", "MAX"))
    ap.add_argument("--target-hit", type=float, default=0.9, help="ideal token-weighted prefix hit of session turns")
    ap.add_argument("--sla-ttft-ms", type=float, default=500.0)
    ap.add_argument("--sla-tpot-ms", type=float, default=100.0)
    ap.add_argument("--request-timeout-s", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="artifacts/bench_real_pd_vs_pdd")
    ap.add_argument("--plot", default=None, help="PNG path (default: real_pd_vs_pdd.png under --out; the docs' "
                                                  "figure is docs/img/real_pd_vs_pdd.png, name it to replace it); "
                                                  "with --pool-bursts: the ratios' intervals")
    args = ap.parse_args(argv)
    if args.designs is None:
        args.designs = list(BURST_DESIGNS if args.burst else DESIGNS)
    if args.links is None:
        args.links = [8.0, 40.0] if args.burst else [200.0, 40.0, 10.0]
    if args.burst and args.burst < 2:
        ap.error("--burst needs at least 2 sessions")
    if args.torch_threads < 0:
        ap.error(f"--torch-threads takes N >= 0, got {args.torch_threads}")
    if not 0 <= args.dc_b_nice <= 19:
        ap.error(f"--dc-b-nice takes 0-19, got {args.dc_b_nice}")
    if args.dc_b_nice and not args.burst:
        ap.error("--dc-b-nice is a --burst option")
    if args.quick and args.burst:  # the e2e test's size: the smallest burst that still is one
        args.links, args.repeats, args.burst, args.turns = args.links[:1], 1, 3, [2, 2]
    elif args.quick:
        args.links, args.rates = args.links[1:2], [1.5]
        args.sessions, args.turns, args.lanes, args.outliers = 2, [3, 3], 2, 1
    return args


def workload(args) -> tuple[WorkloadConfig, list]:
    cfg = WorkloadConfig(sessions=args.sessions, turns=tuple(args.turns), outliers=args.outliers,
                         output_tokens=tuple(args.output_tokens), outlier_output_tokens=(1, 4), seed=args.seed)
    if args.target_hit > 0:
        cfg = fit_block_scale(cfg, args.target_hit)
    return cfg, build_jobs(cfg)


def kv_bytes_per_token(model: str, dtype_bytes: int = 4) -> int:
    c = json.loads((Path(model) / "config.json").read_text())
    heads = c.get("num_key_value_heads", c["num_attention_heads"])
    head_dim = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    return 2 * c["num_hidden_layers"] * heads * head_dim * dtype_bytes


def measure_prefill_s_per_token(design: Design, tokens: int = 2000, n: int = 3) -> float:
    """Cold prefill time per token: the TTFT of fresh ``tokens``-token prompts asking one token on
    same-DC PD, less that of a 16-token prompt (the fixed costs); the median of ``n``."""
    from sglang_pdd.launcher.http import post_json

    def ttft(n_tokens: int, salt: str) -> float:
        t0 = time.perf_counter()
        post_json(f"{design.router_url}/generate", {"input_ids": segment_tokens("prefill-speed", (salt,), n_tokens),
                                                    "sampling_params": greedy(1)})
        return time.perf_counter() - t0

    small = float(np.median([ttft(16, f"s{i}") for i in range(n)]))
    large = float(np.median([ttft(tokens, f"l{i}") for i in range(n)]))
    return max(1e-7, (large - small) / tokens)


def measure_on_same_dc_pd(run_dir: Path, model: str, link, args) -> float:
    """P's cold prefill time per token, on a same-DC PD started for that alone."""
    print("measuring P's prefill speed on same-DC PD (not compared in this run) for PDD's router", file=sys.stderr)
    probe = make_design("same_dc_pd", run_dir, model, link, args)
    try:
        probe.start()
        warm_up(probe, args.request_timeout_s)
        return measure_prefill_s_per_token(probe)
    finally:
        probe.stop()


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    from sglang_pdd.launcher.cluster import default_model_path
    from sglang_pdd.launcher.netns import link_or_fallback

    if args.pool_bursts:
        pooled = pool_bursts([Path(d) for d in args.pool_bursts])
        print_pooled_bursts(pooled, args.pool_bursts)
        if args.plot:
            plot_intervals(pooled, Path(args.plot))
            print(f"wrote {args.plot}")
        return 0
    if args.spread_of:
        if not args.plot:
            raise SystemExit("--spread-of draws to --plot PNG")
        plot_spread([json.loads(Path(p).read_text()) for p in args.spread_of], args.links[0], Path(args.plot))
        print(f"wrote {args.plot}")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.torch_threads:  # the servers inherit this process's environment
        os.environ["OMP_NUM_THREADS"] = str(args.torch_threads)
    if args.burst:
        return main_burst(args, out)
    plot_path = Path(args.plot) if args.plot else out / "real_pd_vs_pdd.png"
    model = default_model_path()
    cfg, jobs = workload(args)
    order = dispatch_order(jobs, args.lanes)
    flat_hits = ideal_hit_per_request(jobs, cfg)
    print(f"workload: {len(order)} requests per cell ({args.sessions} sessions, {args.outliers} outliers), "
          f"block scale {cfg.block_scale:.2f}, {np.mean([h >= 0.9 for h in flat_hits]):.0%} of requests at >= 90% "
          f"ideal prefix hit (mean {np.mean(flat_hits):.2f}); designs {', '.join(args.designs)}", file=sys.stderr)

    res = {"args": vars(args), "designs": [], "cells": {}, "links": {},
           "workload": {"config": asdict(cfg), "requests_per_cell": len(order),
                        "share_at_90pct_hit": float(np.mean([h >= 0.9 for h in flat_hits])),
                        "mean_ideal_hit": float(np.mean(flat_hits))}}
    records: list[Record] = []
    t_start = time.time()
    with contextlib.ExitStack() as stack:
        link = link_or_fallback(args.links[0])
        designs = list(args.designs)
        if link is None:
            designs = [d for d in designs if d == "same_dc_pd" or d in PDD_PATH_MODES]
            print("without the namespace the cross-DC baselines cannot run: same-DC PD and PDD (over the "
                  "userspace emulator, P's WAN KV only) only", file=sys.stderr)
        else:
            stack.callback(link.destroy)
            res["namespace"] = {"name": link.namespace, "veth": link.plan.veth_a, "a_ip": link.a_ip, "b_ip": link.b_ip}
        res["designs"] = designs
        if args.ttft_breakdown:
            if link is None:
                raise SystemExit("the TTFT breakdown needs the namespace (root)")
            bd = run_breakdown(args, link, model, out)
            (out / "breakdown.json").write_text(json.dumps(bd, indent=1))
            print_breakdown(bd)
            return 0
        if "same_dc_pd" not in designs and any(d in PDD_PATH_MODES for d in designs):
            # PDD's router counts P's queue and prefill against the TTFT budget at P's speed as
            # measured on same-DC PD; without it the router counts the WAN alone (another rule)
            res["prefill_s_per_token"] = measure_on_same_dc_pd(out / "servers", model, link, args)
        n_cells = sum(len(args.rates) * (1 if d == "same_dc_pd" else len(args.links)) for d in designs)
        bar = tqdm(total=n_cells * len(order), desc="requests", unit="req", file=sys.stderr)
        for name in designs:
            design = make_design(name, out / "servers", model, link, args, res.get("prefill_s_per_token"))
            if args.time_stats:
                design.server_args = TIME_STATS_ARGS
            bar.set_postfix_str(f"{name}: starting servers")
            try:
                design.start()
                warm_up(design, args.request_timeout_s)
                if name == "same_dc_pd" and "prefill_s_per_token" not in res:
                    res["prefill_s_per_token"] = measure_prefill_s_per_token(design)
                for li, link_mbit in enumerate(args.links if name != "same_dc_pd" else args.links[:1]):
                    if name != "same_dc_pd":
                        design.set_link(link_mbit)
                        if name in PDD_PATH_MODES:
                            warm_up(design, args.request_timeout_s)
                    for ri, rate in enumerate(args.rates):
                        cell = f"l{li}r{ri}s{args.seed}"
                        bar.set_postfix_str(f"{name}, {link_mbit:g} Mbit/s, {rate:g} req/s")
                        before = link.counters() if link is not None else (0, 0)
                        t0, cpu = time.time(), CpuMeter()
                        recs = asyncio.run(run_cell([design.route()], jobs, cfg, order,
                                                    poisson_arrivals(len(order), rate, 1000 * args.seed + 10 * li + ri),
                                                    cell, link_mbit, rate, args.request_timeout_s, bar))
                        wall, cores = time.time() - t0, cpu.stop()
                        after = link.counters() if link is not None else (0, 0)
                        design.annotate(recs)
                        res["cells"][cell_key(name, link_mbit, rate)] = summarize_cell(
                            recs, rate, args.sla_ttft_ms / 1e3, args.sla_tpot_ms / 1e3,
                            (after[0] - before[0], after[1] - before[1]), wall) | cores
                        records += recs
            finally:
                bar.set_postfix_str(f"{name}: stopping")
                design.stop()
            if args.time_stats:
                add_stages(res, name, [r for r in records if r.design == name], parse_time_stats(server_logs(design)))
        bar.close()
    res["wall_s"] = time.time() - t_start
    kv = kv_bytes_per_token(model)
    per_token = res.get("prefill_s_per_token")
    for link_mbit in args.links:
        info = {"kv_bytes_per_token": kv}
        if per_token:
            r = kv * 8 / (link_mbit * 1e6) / per_token
            info.update(r=r, deepseek_v3_gbps=DEEPSEEK_V3_KV_BYTES_PER_TOKEN * 8 * PROD_PREFILL_TOKENS_PER_S / r / 1e9)
        res["links"][str(link_mbit)] = info
    res["equality"] = compare_outputs(records)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    with open(out / "requests.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(asdict(r)) + "\n")
    print_table(res)
    if args.time_stats:
        print_stages(res)
    plot(res, plot_path)
    print(f"\nwall {res['wall_s'] / 60:.1f} min; wrote {out / 'results.json'}, {out / 'requests.jsonl'}, {plot_path}")
    bad = res["equality"]["mismatches"] or any(c["errors"] or c["completion_mismatch"] for c in res["cells"].values())
    return 1 if bad else 0


def main_burst(args, out: Path) -> int:
    """--burst: results to --out (burst.json, burst_requests.jsonl), the plot to --plot or --out."""
    from sglang_pdd.launcher.cluster import default_model_path
    from sglang_pdd.launcher.netns import link_or_fallback

    plot_path = Path(args.plot) if args.plot else out / "real_pd_vs_pdd_burst.png"
    t0 = time.time()
    with contextlib.ExitStack() as stack:
        link = link_or_fallback(args.links[0])
        if link is None:
            print("without the namespace the cross-DC baseline cannot run: same-DC PD and PDD (over the userspace "
                  "emulator, P's WAN KV only) only", file=sys.stderr)
        else:
            stack.callback(link.destroy)
        res = run_burst(args, link, default_model_path(), out)
        if link is not None:
            res["namespace"] = {"name": link.namespace, "veth": link.plan.veth_a}
    res["wall_s"] = time.time() - t0
    (out / "burst.json").write_text(json.dumps(res, indent=1))
    print_burst(res)
    plot_burst(res, plot_path)
    print(f"\nwall {res['wall_s'] / 60:.1f} min; wrote {out / 'burst.json'}, {out / 'burst_requests.jsonl'}, "
          f"{plot_path}")
    bad = res["equality"]["mismatches"] or any(c["errors"] for c in res["summary"].values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
