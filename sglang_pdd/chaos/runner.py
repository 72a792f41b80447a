"""A chaos run on the local cluster (I/O): the cluster, the reference, scenarios and the soak.

``ChaosCluster`` starts P + RLD (datacenter A), MD (datacenter B, in a network namespace
when this process may make one, else behind the userspace WAN emulator) and the router, every
server in float32 (greedy outputs are then equal to one plain server's, token for token).
``reference_outputs`` asks one plain server for each request of the load's pool. ``run``
drives one scenario (or the soak): the load, the faults one after another, then the checks
(checks.evaluate), and returns its Row with what it found.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Union

from tqdm import tqdm

from sglang_pdd.chaos import probe
from sglang_pdd.chaos.checks import (CounterLedger, FiredFault, GapBounds, RequestRecord, Row, counted, evaluate,
                                     leaks)
from sglang_pdd.chaos.faults import FaultInjector
from sglang_pdd.chaos.load import LoadThread, request_body
from sglang_pdd.chaos.spec import MD_BUSY_WAIT_S, Fault, LoadSpec, Prompt, Scenario, Soak, arrivals, prompt_pool
from sglang_pdd.launcher.http import post_json

logger = logging.getLogger(__name__)

# Every server computes in float32: one extend pass and step-by-step decode then round alike,
# and greedy outputs equal one plain server's (tests/conftest.py's EXACT_ARGS).
EXACT_ARGS = ["--dtype", "float32"]
# The router as the chaos run needs it: probes every second and a breaker that opens after two
# failures and half-opens after 3 s (faults are noticed, and recoveries taken up, quickly); MD's
# KV waited for 6 s (a WAN fault then falls back soon); outliers are prompts >= 256 tokens with
# <= 4 new ones (the load's long prompts).
ROUTER_ARGS = ["--max-wan-transfer-ms", "100", "--wan-timeout-s", "6", "--health-check-interval-s", "1",
               "--breaker-failures", "2", "--breaker-cooldown-s", "3", "--outlier-min-input-tokens", "256",
               "--outlier-max-output-tokens", "4", "--request-timeout-s", "300"]
# After the load, what servers still hold must be gone within this: MD lets go of a room whose
# release never reached it when the room expires (2 x --pdd-wan-timeout-s, 60 s by default).
SETTLE_S = 90.0


def gap_bounds(router_args: list[str]) -> GapBounds:
    """The router's deadlines for MD as these flags set them (the router's defaults else)."""
    from sglang_pdd.router.flow.pdd_flow import FlowConfig

    flags = {}
    for i, arg in enumerate(router_args):  # "--flag value" and "--flag=value"
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            flags[name] = value if eq else (router_args[i + 1] if i + 1 < len(router_args) else "")

    def flag(name: str, default: float) -> float:
        return float(flags[name]) if name in flags else default

    cfg = FlowConfig()
    return GapBounds(first_token_s=flag("--md-first-token-timeout-s", cfg.md_first_token_timeout_s),
                     stall_s=flag("--md-stall-timeout-s", cfg.md_stall_timeout_s),
                     wan_timeout_s=flag("--wan-timeout-s", cfg.wan_timeout_s))
DEFAULT_WAN_MBPS = 2.0


@dataclass
class Outcome:
    """A scenario's row and what is behind it (for the report and a failing test's message)."""

    row: Row
    records: list[RequestRecord]
    fired: list[FiredFault]
    references: dict[str, list[int]]
    seconds: float = 0.0

    def problems(self, limit: int = 12) -> list[str]:
        """The requests behind a failed row (undocumented failures, unequal outputs)."""
        from sglang_pdd.chaos.checks import explained

        bad = [r for r in self.records
               if (r.completed and (r.breaks or list(r.received) != list(self.references[r.key]))) or
               (not r.completed and not explained(r, self.fired))]
        return [f"#{r.index} {r.key} status {r.status} at {r.sent_s:.1f}-{r.ended_s:.1f}s path {r.path or '?'} "
                f"fallbacks {list(r.fallbacks)} {r.message[:160]}" for r in bad[:limit]]


def reference_outputs(url: str, pool: list[Prompt], workers: int = 8) -> dict[str, list[int]]:
    """Each pool request's greedy output on one plain server."""
    def one(prompt: Prompt) -> tuple[str, list[int]]:
        body = {**request_body(prompt), "stream": False}
        return prompt.key, post_json(f"{url}/generate", body, timeout=600)["output_ids"]

    with ThreadPoolExecutor(workers) as ex:
        return dict(tqdm(ex.map(one, pool), total=len(pool), desc="reference outputs", unit="req", file=sys.stderr))


@contextlib.contextmanager
def reference_server(run_dir: Path, model_path: str):
    """A plain SGLang server (no PD) in float32; yields its URL."""
    from sglang_pdd.launcher.processes import ProcessGroup
    from sglang_pdd.launcher.topology import CPU_ENV, ServerSpec, free_port, server_argv

    spec = ServerSpec("reference", None, free_port(), extra_args=list(EXACT_ARGS))
    with ProcessGroup(run_dir / "reference-logs") as procs:
        procs.start(spec.name, server_argv(spec, model_path), health_url=f"{spec.url}/health", env=CPU_ENV)
        procs.wait_healthy(timeout_s=600)
        yield spec.url


class ChaosCluster:
    """P, RLD, MD and the router, across the datacenter namespaces where this process may make
    them (``netns``), else across the emulated WAN; a context manager. ``pids``: every process
    it started, restarts included (for the leftovers check)."""

    def __init__(self, run_dir: Path, model_path: Optional[str] = None, wan_mbps: float = DEFAULT_WAN_MBPS,
                 netns: bool = True, log=lambda m: print(m, file=sys.stderr), router_args: Iterable[str] = ()):
        self.run_dir, self.wan_mbps, self.want_netns, self.log = Path(run_dir), wan_mbps, netns, log
        self.router_args = list(ROUTER_ARGS) + list(router_args)  # later flags win
        self.model_path = model_path
        self.link = None
        self.cluster = None
        self.injector: Optional[FaultInjector] = None
        self._stack = contextlib.ExitStack()
        self.namespace: Optional[str] = None
        self.veth: Optional[str] = None

    def __enter__(self) -> "ChaosCluster":
        from sglang_pdd.launcher.cluster import LocalCluster, default_model_path
        from sglang_pdd.launcher.netns import link_or_fallback
        from sglang_pdd.launcher.topology import Topology

        try:
            self.model_path = self.model_path or default_model_path()
            topo = Topology.on_free_ports()
            for spec in topo.servers:
                spec.extra_args += EXACT_ARGS
            # P keeps KV for a late WAN destination for up to 10 s: a loaded machine can take that
            # long between P's prefill and the router's POST.
            topo.prefill.extra_args += ["--pdd-wan-destination-wait-ms", "10000"]
            if self.want_netns:
                self.link = link_or_fallback(self.wan_mbps, log=self.log)
            if self.link is not None:
                self._stack.callback(self.link.destroy)  # after the cluster's processes are stopped
                self.namespace, self.veth = self.link.namespace, self.link.plan.veth_a
                topo.place_datacenter_b(self.link.b_ip, self.link.namespace, self.wan_mbps / 1000)
            else:
                topo.wan.rate_gbps, topo.wan.latency_ms = self.wan_mbps / 1000, 20.0
            self.cluster = LocalCluster(self.run_dir, model_path=self.model_path, topology=topo,
                                        router_args=list(self.router_args))
            self._stack.callback(self.cluster.stop)
            self._pids = PidLog(self.cluster.procs)
            self.cluster.start()
            self.injector = FaultInjector(self.cluster, self.link)
            self._stack.callback(self.injector.cleanup)
            self.log(f"chaos cluster up: router {topo.router_url}; WAN: {self.injector.describe_wan()}")
            self._warm_up()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    @property
    def pids(self) -> list[int]:
        return self._pids.pids()

    def leftovers(self) -> list[str]:
        """After exit: processes, namespace and veth of this cluster still there."""
        return probe.leftovers(self.pids, self.namespace, self.veth)

    def _warm_up(self) -> None:
        """One request on each path first: the first request after a start pays one-time costs."""
        topo = self.cluster.topology
        for options in ({"path": "p_rld_md"}, {"path": "p_md"}, {"path": "p_rld_only"}):
            post_json(f"{topo.router_url}/generate", {
                "input_ids": [5, 6, 7, 8, 9, 10, 11, 12], "pdd_options": options,
                "sampling_params": {"max_new_tokens": 8, "temperature": 0}}, timeout=300,
                headers=self.cluster.operator_headers)


class PidLog:
    """Every pid a ProcessGroup starts (the group's own ``start`` wrapped), so that the leftovers
    check covers processes started again after a fault too."""

    def __init__(self, procs):
        self._seen: list[int] = []
        start = procs.start

        def logged(*args, **kwargs):
            proc = start(*args, **kwargs)
            self._seen.append(proc.popen.pid)
            return proc

        procs.start = logged

    def pids(self) -> list[int]:
        return list(self._seen)


def run(ctx: ChaosCluster, plan: Union[Scenario, Soak], references: dict[str, list[int]],
        log=lambda m: print(m, file=sys.stderr)) -> Outcome:
    """One scenario (or the soak) on a running ChaosCluster; its Outcome."""
    cluster, injector = ctx.cluster, ctx.injector
    topo, headers = cluster.topology, cluster.operator_headers
    load_spec: LoadSpec = plan.load
    pool = prompt_pool(load_spec)
    missing = [p.key for p in pool if p.key not in references]
    if missing:
        raise ValueError(f"no reference output for {missing[:5]}")
    soak_s = plan.seconds if isinstance(plan, Soak) else None
    faults: Iterable[Fault] = plan.faults() if isinstance(plan, Soak) else plan.faults
    log_dir = cluster.procs.log_dir
    offsets = probe.log_offsets(log_dir)
    ledger = CounterLedger()
    ledger.observe(probe.scrape(topo.router_url))
    started = time.monotonic()
    load = LoadThread(topo.router_url, headers, arrivals(load_spec, pool))
    fired: list[FiredFault] = []
    windows: list[tuple[Fault, dict, int]] = []
    bar = tqdm(total=int(soak_s) if soak_s else None, desc=plan.name, unit="s", file=sys.stderr,
               disable=soak_s is None)
    try:
        last_recovered = 0.0
        for fault in faults:
            if soak_s is not None and load.now() + fault.after_s >= soak_s:
                break
            _sleep_until(load, last_recovered + fault.after_s, bar)
            if fault.when_md_busy:
                _wait_md_busy(ctx, fault.when_md_busy, load.now() + MD_BUSY_WAIT_S, load)
            ledger.observe(probe.scrape(topo.router_url))
            windows.append((fault, ledger.snapshot(), ledger.restarts))
            begin = load.now()
            log(f"[{begin:6.1f}s] {fault.kind.value} (hold {fault.hold_s:g}s)")
            injector.fire(fault)
            _sleep_until(load, load.now() + fault.hold_s, bar)
            injector.recover(fault)
            last_recovered = load.now()
            ledger.observe(probe.scrape(topo.router_url))
            fired.append(FiredFault(fault.kind, begin, last_recovered))
            log(f"[{last_recovered:6.1f}s] {fault.kind.value} recovered")
        end = max(last_recovered + plan.tail_s, soak_s or getattr(plan, "min_load_s", 0.0))
        _sleep_until(load, end, bar)
    finally:
        injector.cleanup()
        records = load.finish()
        bar.close()
    ledger.observe(probe.scrape(topo.router_url))
    uncounted = []
    for i, (fault, before, restarts) in enumerate(windows):
        after, restarts_after = ((windows[i + 1][1], windows[i + 1][2]) if i + 1 < len(windows)
                                 else (ledger.snapshot(), ledger.restarts))
        if not counted(fault.kind, before, after, restarts_after - restarts):
            uncounted.append(f"{fault.kind.value} at {fired[i].started_s:.0f}s")
    leaked = settle_and_flush(cluster, offsets)
    bounds = gap_bounds(ctx.router_args) if getattr(plan, "bound_gaps", False) else None
    row = evaluate(plan.name, records, references, fired, uncounted, leaked, gap_bounds=bounds)
    return Outcome(row, records, fired, references, time.monotonic() - started)


def _wait_md_busy(ctx: ChaosCluster, n: int, until_s: float, load: LoadThread) -> None:
    """Until the router counts ``n`` requests in flight on MD (its /pdd/backends), or ``until_s``."""
    topo = ctx.cluster.topology
    while load.now() < until_s:
        with contextlib.suppress(OSError, KeyError, TypeError):
            row = probe.backend_view(topo.router_url, ctx.cluster.operator_headers, topo.main.url)
            if row is not None and row["inflight"] >= n:
                return
        time.sleep(0.05)


def _sleep_until(load: LoadThread, at_s: float, bar) -> None:
    while load.now() < at_s:
        time.sleep(min(0.5, at_s - load.now()))
        if bar is not None and not bar.disable:
            bar.n = min(int(load.now()), bar.total or int(load.now()))
            bar.refresh()


def settle_and_flush(cluster, offsets: dict[str, int], settle_s: float = SETTLE_S) -> list[str]:
    """After the load: wait (up to ``settle_s``) until no server holds anything, then flush
    every cache through the router and read the pools; what is still held or refused, and the
    leak lines SGLang's own checks logged meanwhile."""
    deadline = time.monotonic() + settle_s
    held = probe.held(cluster)
    while leaks(held, {}) and time.monotonic() < deadline:
        time.sleep(0.5)
        held = probe.held(cluster)
        if not leaks(held, {}):  # twice: a request between a server's front end and scheduler is in no queue
            time.sleep(0.2)
            held = probe.held(cluster)
    names = {spec.url: spec.name for spec in cluster.topology.servers}
    flushes = {names.get(url, url): code for url, code in
               probe.flush(cluster.topology.router_url, cluster.operator_headers).items()}
    pools = probe.pool_pages(cluster)
    deadline = time.monotonic() + 10  # SGLang publishes its load snapshot periodically
    while leaks(pools, {}) and time.monotonic() < deadline:
        time.sleep(0.5)
        pools = probe.pool_pages(cluster)
    merged = {name: {**held.get(name, {}), **pools.get(name, {})} for name in {*held, *pools}}
    return leaks(merged, flushes, probe.leak_warnings(cluster.procs.log_dir, offsets))
