"""The cluster model: one design (same-DC PD, cross-DC PD with or without DRC, or PDD) run
over a trace, every design under the same rules.

Routing and the request's course are the router's own functions, called at run time so that
a change to them changes the sim. For every design: P by `router.placement.pick_prefill` on
P's prefill tokens in flight and the router's prefix index (candidates rotated so equal ones
take turns), MD (and same-DC PD's D) by `placement.pick_main` on flows in flight: the MD
holding the prefix unless a move costs less time than its excess flows (`pick_p`, `pick_md`:
router/backends/pools.py's Pools.pick, checked against it in tests/unit/sim/test_sim_router_agreement.py). For PDD with an RLD also: RLD with the fewest flows in
flight (`pick_rld`); the path by `router.policy.decide_path` on the prefix index's estimate,
again on MD's exact prefix for P->MD (`choose_path`: pdd_flow.py with P's control API), RLD's
load being its flows over the router's admission (`rld_max_running`, --rld-max-running);
the handoff mode by `handoff.policy.choose_mode`; and every request's life by
`router.lifecycle.transition` (`_event`), fed the events the router's I/O shell would feed
(PathChosen, RLD's first and last tokens, MdReady / MD's refusal as MdNotReady, the cut, MD's
tokens), and does what the returned actions say through the kit's Driver, every action named
(`_lifecycle_actions`). What the sim models itself is time:
    P_MD:       KV of MD's uncached suffix over the WAN -> MD decodes everything;
    P_RLD_MD:   KV over RDMA to RLD, which decodes at once, and the same suffix over the WAN
                to MD; when it lands and MD can admit it, RLD hands its tokens over
                (one-shot or catch-up rounds, `handoff.policy.next_catch_up_batch`), MD
                extends them and decodes the rest. A request that ends on RLD first lets
                its transfer land in MD's DRC for the session's next turn, as the real
                router does (`keep_finished_kv` False: the what-if that cancels it);
    P_RLD_ONLY: outliers and MD refusals decode entirely on RLD, nothing crosses the WAN.
"pd" is P->D over RDMA in one datacenter with one chip type; "xdc" is P->MD over the WAN for
every request (with MD's DRC when `drc`), no RLD, MD learning of the request as P starts
(SGLang's PD: no round trip before P).

Message timing follows router/flow/pdd_flow.py: P->MD starts P at once and registers on MD beside it
(`p_md_late`; with --p-md-registers-first, `PathPolicyConfig.p_md_registers_first`, a WAN
round trip before P starts) and its first token comes from P through RLD's one-token leg in
datacenter A; MD's tokens reach the user one WAN trip
later. Each catch-up round is a one-way trip of token ids to MD, an extend pass that holds
MD (its running sequences stall), and the answer's trip back. MD's prefix hit (and so the
bytes shipped) is decided when the transfer starts, and the blocks it relies on are pinned
until it lands; a hit in MD's host tier is loaded back alongside the transfer.

MD's staging (`staging_bytes`, the real MD's --pdd-md-staging-mb, default a share of MD's
pool) is the same for every design that lands KV on MD and is charged when a transfer
starts: the bytes of transfers in flight to one MD may not exceed it. A transfer that does
not fit is refused if RLD decodes the request anyway (P_RLD_MD: it stays on RLD, the
router's fallback) and waits for room otherwise, first come first served; a room larger
than the whole budget goes alone. (The real MD checks at registration, before P starts;
docs/sim.md says what that changes.)

Omitted on purpose (see docs/sim.md): MD memory is not reserved during catch-up; RLD's
one-token leg of a P->MD request takes no RLD slot; decode context grows only at admission.
"""

from __future__ import annotations

import gc
import random
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterable, Optional

from sglang_pdd.handoff import policy as handoff_policy
from sglang_pdd.handoff.policy import CatchUpStep, HandoffConfig, HandoffMode, RldLoad, next_catch_up_batch
from sglang_pdd.machine import Driver, nothing
from sglang_pdd.router.flow import lifecycle as lc
from sglang_pdd.router.flow.fallback import Fallback, Reason
from sglang_pdd.config import md_staging_bytes
from sglang_pdd.router import policy
from sglang_pdd.router.backends import placement
from sglang_pdd.router.backends.placement import InstanceLoad, MdMoveCost, pick_instance, pick_main
from sglang_pdd.router.policy import RLD_MAX_RUNNING_DEFAULT, Path, PathDecision, PathMode, PathPolicyConfig
from sglang_pdd.router.backends.prefix_index import PrefixIndex
from sglang_pdd.router.backends.wan_in_flight import WanInFlight
from sglang_pdd.sim.workload import BLOCK_TOKENS, TraceRequest

from .cache import BlockCache
from .engine import EventLoop
from .hardware import CHIP_A, CHIP_B, RDMA_DEFAULT, WAN_DEFAULT, HardwareProfile, LinkProfile
from .metrics import RequestLog, Sla, Summary, TimeAverage, summarise
from .servers import DecodeInstance, PrefillInstance, SharedLink

PATH_CODES = (Path.P_MD, Path.P_RLD_MD, Path.P_RLD_ONLY)
PATH_NAMES = tuple(p.value for p in PATH_CODES)
TOKEN_ID_BYTES = 15  # what a handed-over token costs on the wire (id + framing)
_LENGTH = {"type": "length"}  # SGLang's finish_reason when the output budget is used up
FLOWS_RULE_EXCESS = 4  # the "flows" P what-if: the router's earlier bound, in flows in flight


KINDS = ("pd", "xdc", "pdd")
# How a trace's requests arrive (Simulation.run): "sessions" = session starts at their trace
# times, each next turn after the previous one finished (its recorded gap kept, or a
# generator's think time after the answer); "open" = every request at its trace time,
# answered or not (the old replay; the same for a trace without sessions).
ARRIVALS = ("sessions", "open")
P_PLACEMENTS = ("router", "flows", "backlog", "round_robin")


@dataclass(frozen=True)
class ScenarioConfig:
    """One design on one fleet. Kinds: "pd" (P and D in one datacenter, KV over RDMA), "xdc"
    (cross-datacenter PD: every request P -> MD over the WAN; `drc` gives MD a decode-side
    cache), "pdd" (the PDD router: P -> MD, P -> RLD -> MD or P -> RLD)."""
    name: str
    kind: str
    n_prefill: int
    n_md: int  # decode instances (the D of "pd")
    n_rld: int = 0
    prefill_hw: HardwareProfile = CHIP_A
    rld_hw: HardwareProfile = CHIP_A
    md_hw: HardwareProfile = CHIP_B
    wan: LinkProfile = WAN_DEFAULT
    rdma: LinkProfile = RDMA_DEFAULT
    drc: bool = True
    handoff: HandoffConfig = field(default_factory=HandoffConfig)
    router: Optional[PathPolicyConfig] = None  # None: derived from wan, prefill_hw, the SLA and path_mode
    path_mode: PathMode = PathMode.FIT  # the router's --path-mode
    affinity_excess: float = 0.25  # the KV-load MD rule's bound (md_kv_load what-if)
    # The outlier filter needs an output estimate; the trace's true length stands in for a
    # client's max_tokens or a predictor. False = unknown (filter never fires).
    expected_output_from_trace: bool = True
    # KV of rooms in flight to one MD, at most, for every design that lands KV on MD (the
    # real MD's --pdd-md-staging-mb). None: the real MD's default, config.md_staging_bytes
    # (a share of MD's KV pool).
    md_staging_bytes: Optional[float] = None
    # The router's RLD admission (--rld-max-running): RLD's load in the path decision and the
    # handoff mode is its flows in flight over this. Not RLD's batch cap (rld_hw's
    # max_running_requests), which bounds what RLD decodes at once.
    rld_max_running: int = RLD_MAX_RUNNING_DEFAULT
    # A request that ended on RLD: True (the real router: released with keep_kv) lets its WAN
    # transfer land in MD's DRC for the session's next turn (router.md step 9), within MD's
    # staging budget; False cancels the rest of it (what-if: nothing more is sent for it).
    keep_finished_kv: bool = True
    # Such a kept transfer yields the WAN to the transfers a request waits on (strict
    # priority), as P's sender orders them (kv_channel/send_order.py: the router marks a room
    # kept on P when it releases it with keep). False: the what-if of one queue for both.
    kept_kv_background: bool = True
    # P placement, the same for every design. "router": router/backends/placement.py's pick_prefill
    # (prefill tokens in flight, prefix affinity within the held prefix; what the router and
    # the sim both run). What-ifs: "flows" (the router's earlier rule: flows in flight, excess
    # 4), "backlog" (affinity weighed against P's queue in seconds, the sim's earlier
    # stand-in for SGLang's cache-aware router), "round_robin".
    p_placement: str = "router"
    # MD (and D) placement, the same for every design. None: the router's (router/backends/pools.py:
    # placement.pick_main, flows in flight against the cost of re-sending the held prefix).
    # True: KV load + pending KV within `affinity_excess` (what-if).
    md_kv_load: Optional[bool] = None
    # What-if: MD placed by a fixed bound in flows in flight (the router's earlier rule: 4)
    # instead of placement.pick_main's cost of a move. None: the router's rule.
    md_affinity_excess_flows: Optional[float] = None
    # MD's decode step growth per flow in flight, what the router measures (router/backends/loads.py);
    # None: md_hw's at half its batch cap and a 30k-token context (`md_flow_step_s`).
    md_flow_step_s: Optional[float] = None
    # The router's default: P->MD starts P at once and registers on MD beside it (router/flow/pdd_flow.py
    # with P's control API). False: --p-md-registers-first (a WAN round trip before P starts,
    # then a second decision on MD's exact prefix). Used where `router` is None.
    p_md_late: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown scenario kind {self.kind!r} (one of {KINDS})")
        if self.n_prefill < 1 or self.n_md < 1 or self.n_rld < 0:
            raise ValueError("need >= 1 prefill and >= 1 decode instance")
        if self.kind != "pdd" and self.n_rld:
            raise ValueError("only pdd uses relay decode")
        if self.p_placement not in P_PLACEMENTS:
            raise ValueError(f"p_placement must be one of {P_PLACEMENTS}, got {self.p_placement!r}")
        if self.rld_max_running < 1:
            raise ValueError("rld_max_running must be >= 1")

    @property
    def md_remote(self) -> bool:
        return self.kind != "pd"

    @property
    def staging_bytes(self) -> float:
        """MD's staging budget: as given, or the real MD's default for md_hw's pool."""
        if self.md_staging_bytes is not None:
            return self.md_staging_bytes
        return float(md_staging_bytes(0, self.md_hw.kv_capacity_tokens, self.md_hw.kv_bytes_per_token))

    @property
    def hw_cost_per_hour(self) -> float:
        return (self.n_prefill * self.prefill_hw.price_per_hour + self.n_rld * self.rld_hw.price_per_hour
                + self.n_md * self.md_hw.price_per_hour)

    @property
    def wan_lease_per_hour(self) -> float:
        """The WAN's lease, paid by every cross-datacenter design whether it fills it or not."""
        return self.wan.lease_per_hour if self.md_remote else 0.0

    @property
    def cost_per_hour(self) -> float:
        return self.hw_cost_per_hour + self.wan_lease_per_hour

    @property
    def gpus(self) -> int:
        return (self.n_prefill * self.prefill_hw.chips_per_instance + self.n_rld * self.rld_hw.chips_per_instance
                + self.n_md * self.md_hw.chips_per_instance)

    def router_config(self, sla: Sla) -> PathPolicyConfig:
        if self.router is not None:
            return self.router
        # P's speed as the router knows it (measured, or --p-prefill-tokens-per-s) and its
        # attention term (--p-prefill-s-per-token-ctx): the profile's. P->MD's first token
        # comes through RLD (pdd_flow.py) where there is one, so its WAN wait is budgeted
        # against the gap SLO (--gap-slo-ms) when the SLA has one.
        return PathPolicyConfig(
            wan_gbps=self.wan.gbps, wan_rtt_ms=2e3 * self.wan.one_way_latency_s,
            kv_bytes_per_token=self.prefill_hw.kv_bytes_per_token, ttft_slo_ms=1e3 * sla.ttft_s,
            page_size=BLOCK_TOKENS, mode=self.path_mode,
            p_prefill_tokens_per_s=1.0 / self.prefill_hw.prefill_s_per_token,
            p_prefill_s_per_token_ctx=self.prefill_hw.prefill_s_per_token_ctx,
            first_token_via_rld=self.kind == "pdd" and self.n_rld > 0,
            gap_slo_ms=1e3 * sla.max_itl_s if sla.max_itl_s else None,
            p_md_registers_first=not self.p_md_late)

    @property
    def flow_step_s(self) -> float:
        """MD's decode step growth per flow (what the router measures from MD's /v1/loads):
        as given, or md_hw's marginal step at half its batch cap and a 30k-token context."""
        if self.md_flow_step_s is not None:
            return self.md_flow_step_s
        hw, b, ctx = self.md_hw, max(1, self.md_hw.max_running_requests // 2), 30_000
        return max(0.0, hw.decode_step_s(b + 1, (b + 1) * ctx) - hw.decode_step_s(b, b * ctx))


class SimRequest:
    __slots__ = ("tr", "arrival", "path", "p", "md", "rld", "p_cached", "md_cached", "kv_bytes",
                 "t_first", "t_done", "handed", "round", "mode", "done", "t_prefill_in", "md_pending",
                 "t_switch", "stall", "pinned", "staged", "t_kv_sent", "state", "rld_others", "wan",
                 "reg_first", "max_gap", "p_tok", "p_load_s", "md_load_s", "full", "kept")

    def __init__(self, tr: TraceRequest, arrival: float) -> None:
        self.tr = tr
        self.arrival = arrival
        self.t_first = None
        self.t_done = None
        self.handed = 0  # tokens RLD has handed to MD
        self.round = 0
        self.mode = None
        self.done = False
        self.md_pending = 0  # KV tokens counted on its MD before MD admits it
        self.t_switch = None  # when the user got its last token before MD's (RLD's or P's)
        self.stall = float("nan")  # gap at the switch to MD's tokens; NaN: no switch
        self.pinned = None  # MD cache blocks this request's WAN transfer relies on
        self.staged = 0.0  # bytes of MD's staging budget this request's room holds
        self.t_kv_sent = 0.0  # when its WAN transfer started
        # The router's request lifecycle (router/lifecycle.RequestState); None where no PDD router
        # with an RLD serves the request (baselines, PDD without RLD).
        self.state = None
        self.rld_others = 0  # other flows in flight on its RLD when it arrived (router's rld_inflight)
        self.wan = True  # P sends its KV to MD (the lifecycle's StartRelayLeg.wan)
        self.reg_first = False  # registered on MD (a WAN round trip) before P starts
        self.max_gap = 0.0  # longest decode gap so far (the stall is added at the end)
        self.kept = False  # ended on RLD with its transfer still landing on MD (released with keep)
        self.p_tok = 0  # prefill tokens the router counts on its P until the prefill is done
        self.p_load_s = 0.0  # loading P's host-tier hit back to HBM
        self.md_load_s = 0.0  # loading MD's host-tier hit back to HBM, after the KV lands


@contextmanager
def _collector_paused():
    """Python's cycle collector off while events run: the run allocates millions of small
    objects and almost no cycles (~440 objects in cycles over 50k requests), so the
    collector's passes over the growing heap are pure cost (~5% of a run's CPU time). The
    switch is process-wide: another thread's cyclic garbage waits for the run's end too."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


class Simulation:
    def __init__(self, cfg: ScenarioConfig, sla: Sla = Sla(), rate_scale: float = 1.0) -> None:
        if rate_scale <= 0:
            raise ValueError("rate_scale must be > 0")
        self.cfg, self.sla = cfg, sla
        self.rate_scale = rate_scale  # 2.0 = the trace's arrivals twice as fast
        self.loop = EventLoop()
        self.rng = random.Random(cfg.seed)
        self.route_cfg = cfg.router_config(sla)
        self.prefill = [PrefillInstance(self.loop, cfg.prefill_hw, self._prefill_done) for _ in range(cfg.n_prefill)]
        self.p_cache = [BlockCache(cfg.prefill_hw.cache_capacity_tokens, cfg.prefill_hw.host_cache_tokens)
                        for _ in range(cfg.n_prefill)]
        self.log = RequestLog()
        gaps = self.log.gaps  # every decode instance's inter-token gaps (sim/steps.py)
        self.md = [DecodeInstance(self.loop, cfg.md_hw, self._md_start, self._md_done, gaps) for _ in range(cfg.n_md)]
        # KV of requests already assigned to each MD but not yet submitted to it (prefill,
        # WAN, relay decode). Like the real router's in-flight count, it keeps a burst of
        # new sessions from all landing on the MD that happens to be idle right now.
        self.md_pending = [0] * cfg.n_md
        self.md_cache = [BlockCache(cfg.md_hw.cache_capacity_tokens if cfg.drc else 0, cfg.md_hw.host_cache_tokens)
                         for _ in range(cfg.n_md)]
        self.rld = [DecodeInstance(self.loop, cfg.rld_hw, self._rld_start, self._rld_done, gaps)
                    for _ in range(cfg.n_rld)]
        # The router's own prefix index (per instance, block hashes straight from the trace),
        # each instance's share bounded by its cache: n x capacity blocks in all.
        self.p_index = PrefixIndex(max(1, self.p_cache[0].capacity_blocks), block_tokens=BLOCK_TOKENS)
        self.md_index = PrefixIndex(max(1, self.md_cache[0].capacity_blocks), block_tokens=BLOCK_TOKENS)
        self._p_ids = list(range(cfg.n_prefill))
        self.p_placement = cfg.p_placement
        # pools.py's p_inflight and p_tokens: the requests placed on that P and their prefill
        # tokens (prompt less the index's estimate of P's prefix), until P's prefill is done.
        # Every design places P on the tokens (pick_p); "flows" places it on the count.
        self.p_flows = [0] * cfg.n_prefill
        self.p_tokens = [0] * cfg.n_prefill
        # Pools.pick rotates P's candidates by a counter before the stable sorts, so equal
        # ones take turns; one precomputed order per turn.
        self._p_turns = [self._p_ids[t:] + self._p_ids[:t] for t in range(cfg.n_prefill)]
        # The router's in-flight count per RLD (router/backends/pools.py's rld_inflight): every request
        # routed through that RLD, from arrival to its end, whatever its path (a P->MD request
        # decoding on MD counts too). It is RLD's load in the path decision.
        self.rld_flows = [0] * cfg.n_rld
        # pools.py's md_inflight: every request assigned to that MD, arrival to end. Every
        # design places MD (and D) on it, as the router does (md_kv_load: the KV-load what-if).
        self.md_flows = [0] * cfg.n_md
        # The router's own count (router/backends/wan_in_flight.py, keyed by request): the KV bytes it
        # has routed over the WAN (MD's uncached suffix at its answer) that someone waits for
        # and that have not landed or been dropped (a request's ends with the request).
        self.wan_waited = WanInFlight()
        # What leaving the MD that holds a prefix weighs (placement.pick_main)
        self.md_move = MdMoveCost(kv_bytes_per_token=cfg.md_hw.kv_bytes_per_token,
                                  wan_bytes_per_s=cfg.wan.bytes_per_s, flow_step_s=cfg.flow_step_s)
        self._request = Driver(lc.transition, self._lifecycle_actions())
        self._p_rr = 0
        self._md_ids = list(range(cfg.n_md))
        kv_link = cfg.wan if cfg.md_remote else cfg.rdma
        # Only the WAN is one shared bottleneck; same-DC RDMA transfers do not queue on each other.
        self.kv_link = SharedLink(self.loop, kv_link, self.rng, self._md_kv_landed, shared=cfg.md_remote)
        self.md_stream_latency = cfg.wan.one_way_latency_s if cfg.md_remote else 0.0
        self.in_system = TimeAverage()
        self.in_prefill = TimeAverage()
        self.prefill_sojourn_sum = 0.0
        self.sojourn_sum = 0.0
        self.arrived = 0
        self.finished = 0
        self.token_id_bytes = 0
        self.md_hit_tokens = 0
        self.md_input_tokens = 0
        self._trace = None
        self._t0 = None
        self._next_turn = {}  # id(turn) -> (next turn, gap in s): arrivals="sessions"
        # MD staging (every design that lands KV on MD): bytes of rooms in flight per MD,
        # transfers waiting for room (no RLD to fall back on), landed requests waiting for MD
        # to admit a handoff.
        self.staging_bytes = cfg.staging_bytes
        self.md_staged = [0.0] * cfg.n_md
        # Transfers of requests that ended on RLD, landing only to fill MD's cache, per MD in
        # the order they were kept: they give up their staging to a transfer a request waits on.
        self.md_kept = [dict() for _ in range(cfg.n_md)]
        self.kv_kept_dropped = 0
        self.md_send_wait = [deque() for _ in range(cfg.n_md)]
        self.md_handoff_wait = [deque() for _ in range(cfg.n_md)]
        self.md_refused = 0
        self.md_waited = 0  # transfers that waited for MD's staging budget
        self.kv_landed = 0
        self.kv_landed_bytes = 0.0
        self.kv_kept = 0  # transfers of requests that ended on RLD, left to land (keep_finished_kv)
        self.kv_kept_landed = 0  # ... and landed
        self.kv_cancelled = 0  # transfers cancelled as their request ended on RLD
        self.kv_wan_s_sum = 0.0
        self.p_host_tokens = 0  # prompt tokens P loaded back from its host tier
        self.md_host_tokens = 0  # prompt tokens MD loaded back from its host tier (not shipped)

    # ---- driving -------------------------------------------------------------------
    def run(self, requests: Iterable[TraceRequest], arrivals: str = "open",
            give_up_below: Optional[float] = None) -> Optional[Summary]:
        """arrivals (ARRIVALS): "open" replays every request at its trace time. "sessions":
        session starts (first turns, and requests without a session) keep their trace times,
        and no next turn arrives before the answer it extends, as an agent or a chat user
        waits for it. The gap between two turns' timestamps is kept as what it is: a recorded
        gap (arrival to arrival, the answer's time inside it) puts the next turn that gap
        after the previous turn's arrival, or at the answer's end if the answer came later; a
        generator's gap (`gap_after_answer`: think time alone) puts it that gap after the
        answer's end. A trace without sessions replays the same either way.

        give_up_below: stop, returning None, once so many requests have missed the TTFT SLO
        that the run's SLA attainment must end below this (a sizing probe that cannot pass
        need not run to its end). The loop runs in slices of simulated time to look, which
        changes no event's order."""
        if arrivals not in ARRIVALS:
            raise ValueError(f"arrivals must be one of {ARRIVALS}, got {arrivals!r}")
        if arrivals == "sessions":
            requests = list(requests)
            first = []
            last = {}
            for tr in requests:
                sid = tr.session_id
                if sid is None or sid not in last:
                    first.append(tr)
                else:
                    self._next_turn[id(last[sid])] = (tr, (tr.timestamp_ms - last[sid].timestamp_ms) / 1e3)
                if sid is not None:
                    last[sid] = tr
            requests = first
        if give_up_below is not None:
            requests = list(requests)
            n_total = len(requests) + len(self._next_turn)
        self._trace = iter(requests)
        self._schedule_next_arrival()
        with _collector_paused():
            if give_up_below is None:
                self.loop.run_until()
            elif self._hopeless_run(n_total, give_up_below):
                return None
        return self.summary()

    GIVE_UP_SLICE_S = 30.0  # simulated seconds between looks

    def _hopeless_run(self, n_total: int, give_up_below: float) -> bool:
        slo, ttft, seen, missed = self.sla.ttft_s, self.log.ttft, 0, 0
        t = self.loop.now
        while self.loop.pending():
            # the slice's end moves on by itself (the clock only moves with events) and skips
            # a quiet stretch to the next event
            t = max(t + self.GIVE_UP_SLICE_S, self.loop.next_time())
            self.loop.run_until(t)
            for i in range(seen, len(ttft)):
                missed += ttft[i] > slo
            seen = len(ttft)
            # the most that can still be served within the SLA is every request but these
            if (n_total - missed) / n_total < give_up_below:
                return True
        return False

    def _schedule_next_arrival(self) -> None:
        tr = next(self._trace, None)
        if tr is None:
            return
        if self._t0 is None:
            self._t0 = tr.timestamp_ms
        self.loop.at((tr.timestamp_ms - self._t0) / 1e3 / self.rate_scale, self._arrive, tr)

    def summary(self) -> Summary:
        c = self.cfg
        wan_bytes = self.kv_link.bytes_sent + self.token_id_bytes if c.md_remote else self.token_id_bytes
        return summarise(
            c.name, self.log, self.sla, c.cost_per_hour, wan_bytes, c.wan.bytes_per_s,
            c.wan_lease_per_hour, c.wan.price_per_gb if c.md_remote else 0.0, PATH_NAMES,
            mean_md_hit=self.md_hit_tokens / self.md_input_tokens if self.md_input_tokens else 0.0,
            wan_span_s=self.loop.now,  # arrivals start at 0; the last event may be a landing
            md_refused=self.md_refused,
            kv_wan_s_mean=self.kv_wan_s_sum / self.kv_landed if self.kv_landed else float("nan"),
            wan_cancelled_gb=self.kv_link.bytes_cancelled / 1e9 if c.md_remote else 0.0, kv_landed=self.kv_landed,
            extra=dict(wan_landed_gb=self.kv_landed_bytes / 1e9 if c.md_remote else 0.0, kv_kept=self.kv_kept,
                       kv_kept_landed=self.kv_kept_landed, kv_cancelled=self.kv_cancelled,
                       kv_kept_dropped=self.kv_kept_dropped,
                       hw_cost_per_hour=c.hw_cost_per_hour, wan_lease_per_hour=c.wan_lease_per_hour, gpus=c.gpus,
                       md_waited=self.md_waited, rld_cost_share=c.n_rld * c.rld_hw.price_per_hour / c.cost_per_hour,
                       p_host_tokens=self.p_host_tokens, md_host_tokens=self.md_host_tokens,
                       staging_gb=self.staging_bytes / 1e9 if c.md_remote else 0.0,
                       rld_max_running=c.rld_max_running if self.rld else 0))

    # ---- routing -------------------------------------------------------------------
    def _arrive(self, now: float, tr: TraceRequest) -> None:
        self._schedule_next_arrival()
        self._route(now, tr)

    def _route(self, now: float, tr: TraceRequest) -> None:
        c = self.cfg
        r = SimRequest(tr, now)
        self.arrived += 1
        self.in_system.change(now, +1)
        # The prompt's whole blocks (caches hit in whole blocks), used at every step
        full = r.full = tr.hash_ids[: tr.input_length // BLOCK_TOKENS]

        r.p = self._place_p(full)
        self.p_flows[r.p] += 1
        # app.py's count_on_p: the prompt less the index's estimate of what P holds
        r.p_tok = max(1, tr.input_length - self.p_index.match_blocks(r.p, full) * BLOCK_TOKENS)
        self.p_tokens[r.p] += r.p_tok
        # At least one token is always computed (it produces the first output token).
        pc = self.p_cache[r.p]
        r.p_cached = min(pc.match_prefix_blocks(full) * BLOCK_TOKENS, tr.input_length - 1)
        r.p_load_s = min(pc.host_hits * BLOCK_TOKENS, r.p_cached) * c.prefill_hw.host_load_s_per_token
        if pc.host_hits:
            self.p_host_tokens += min(pc.host_hits * BLOCK_TOKENS, r.p_cached)

        routed = c.kind == "pdd" and bool(self.rld)  # through the PDD router (pdd_flow.py, app.py)
        if self.cfg.md_kv_load:
            md_cap = c.md_hw.kv_capacity_tokens
            md_loads = [InstanceLoad(i, m.load() + self.md_pending[i] / md_cap) for i, m in enumerate(self.md)]
            md_affinity = self._affinity(self.md_index, self._md_ids, md_loads, full) if c.drc else None
            r.md = pick_instance(md_loads, md_affinity, c.affinity_excess)
        else:
            r.md = self.pick_md(full, tr.output_length if c.expected_output_from_trace else None)
        self.md_flows[r.md] += 1
        r.md_cached = self.md_cache[r.md].match_prefix_blocks(full, touch=False) * BLOCK_TOKENS if c.drc else 0

        if self.rld:
            r.rld = self.pick_rld()
            r.rld_others = self.rld_flows[r.rld]
            self.rld_flows[r.rld] += 1
        if routed:
            r.path = self.choose_path(r, full)
        else:
            r.path = Path.P_MD
            r.reg_first = c.kind == "pdd" and self.route_cfg.p_md_registers_first
        if routed:
            if r.path is not Path.P_RLD_ONLY:
                self.wan_waited.sending(r, (tr.input_length - r.md_cached) * self.route_cfg.kv_bytes_per_token)
            r.state = lc.RequestState(max_new=tr.output_length)
            self._event(now, r, lc.PathChosen(r.path, late_destination=not r.reg_first and r.path is not Path.P_RLD_ONLY))
        self._registered(now, r)

    def _place_p(self, full) -> int:
        rule = self.p_placement
        if rule == "router":
            return self.pick_p(full)
        if rule == "flows":
            return self.pick_p_by_flows(full)
        if rule == "backlog":
            c, slo = self.cfg, self.sla.ttft_s
            p_loads = [InstanceLoad(i, p.backlog_s() / slo) for i, p in enumerate(self.prefill)]
            p_aff = self._affinity(self.p_index, self._p_ids, p_loads, full)
            # Leaving the instance that holds our prefix costs recomputing it: only worth it
            # when the queue difference exceeds that cost (both in units of the TTFT SLO).
            recompute_s = 0.0
            if p_aff is not None:
                held = self.p_cache[p_aff].match_prefix_blocks(full, touch=False) * BLOCK_TOKENS
                recompute_s = c.prefill_hw.prefill_time_s(held, 0)
            return pick_instance(p_loads, p_aff, c.affinity_excess + recompute_s / slo)
        p = self._p_rr % self.cfg.n_prefill  # what-if: round robin
        self._p_rr += 1
        return p

    def choose_path(self, r: SimRequest, full) -> Path:
        """pdd_flow.py's _choose_path_on_estimate (P with a control API, as sglang_pdd's P): decide
        on the router's prefix-index estimate of MD's prefix. With p_md_registers_first P->MD
        registers on MD first (a WAN round trip before P) and decides again on MD's exact
        answer, which may turn it into P->RLD->MD (registered before the legs, so no late
        destination); by default it keeps its path and MD registers beside P."""
        tr = r.tr
        estimate = self.md_index.match_blocks(r.md, full) * BLOCK_TOKENS if self.cfg.drc else 0
        path = self.decide(r, estimate).path
        if path is Path.P_MD:
            r.reg_first = self.route_cfg.p_md_registers_first
            if r.reg_first and r.md_cached != estimate:  # (the same inputs give the same decision)
                path = self.decide(r, r.md_cached).path
        return path

    def pick_rld(self) -> int:
        """router/backends/pools.py's Pools.pick for RLD: the fewest flows in flight, first on ties."""
        flows = self.rld_flows
        return min(range(len(flows)), key=flows.__getitem__)

    def pick_p(self, full) -> int:
        """router/backends/pools.py's Pools.pick for P (every P healthy): the candidates rotated by a
        round-robin counter, then placement.pick_prefill over P's prefill tokens in flight:
        the P whose prefix index holds the longest prefix (least loaded first among equals,
        then rotated order) keeps it unless its tokens exceed the least loaded P's by more
        than that prefix."""
        order = self._p_turns[self._p_rr % len(self._p_turns)]
        self._p_rr += 1
        tokens = self.p_tokens
        inst, matched = self.p_index.best_blocks(sorted(order, key=tokens.__getitem__), full)
        least = min(order, key=tokens.__getitem__)  # first in rotated order among equals
        if not matched:
            return least
        # The least loaded and the owner are all pick_instance reads of the list (the same
        # answer as the whole rotated list, at a fraction of the cost with many P).
        return placement.pick_prefill((InstanceLoad(least, tokens[least]), InstanceLoad(inst, tokens[inst])), inst,
                                      matched * BLOCK_TOKENS)

    def pick_p_by_flows(self, full) -> int:
        """What-if: the router's earlier P rule (flows in flight, excess 4)."""
        order = self._p_turns[self._p_rr % len(self._p_turns)]
        self._p_rr += 1
        flows = self.p_flows
        inst, matched = self.p_index.best_blocks(sorted(order, key=flows.__getitem__), full)
        least = min(order, key=flows.__getitem__)
        if not matched:
            return least
        return pick_instance((InstanceLoad(least, flows[least]), InstanceLoad(inst, flows[inst])), inst,
                             max_affinity_excess=FLOWS_RULE_EXCESS)

    def pick_md(self, full, output_tokens: Optional[int] = None) -> int:
        """router/backends/pools.py's Pools.pick for MD: placement.pick_main over MD's flows in flight.
        The MD whose prefix index holds the longest prefix (least loaded first among equals)
        keeps the turn unless its excess flows cost more than re-sending that prefix over the
        WAN, at the share one more transfer gets beside the router's transfers in flight."""
        flows = self.md_flows
        loads = [InstanceLoad(i, f) for i, f in enumerate(flows)]
        owner, matched = None, 0
        if self.cfg.drc:
            owner, matched = self.md_index.best_blocks(sorted(self._md_ids, key=flows.__getitem__), full)
        if self.cfg.md_affinity_excess_flows is not None:  # the fixed-bound what-if
            return pick_instance(loads, owner if matched else None, self.cfg.md_affinity_excess_flows)
        return pick_main(loads, owner if matched else None, matched * BLOCK_TOKENS, output_tokens,
                         self.wan_waited.transfers, self.md_move)

    # ---- the router's request lifecycle ------------------------------------------------
    def _lifecycle_actions(self) -> dict:
        """What the sim does for each of the lifecycle's actions, every one named (the Driver
        refuses a table that misses one): the sim's own step, ``nothing`` where the sim
        accounts for the action in simulated time, or a refusal where the sim never models it."""
        return {
            lc.StartRelayLeg: self._act_relay_leg,
            lc.StartHandoff: self._act_start_handoff,
            lc.SendFinalHandoff: self._act_final_handoff,
            lc.Finish: self._act_finish,
            lc.StartMdSide: nothing,  # _registered: MD's room, in time
            lc.EmitRelayOutput: nothing,  # the decoders' steps time the stream
            lc.EmitMainOutput: nothing,
            lc.CommitHandoff: nothing,  # RLD stopped at the final handoff (_act_final_handoff)
            lc.RecordFallback: nothing,  # _refuse counts MD's refusals
            lc.WithdrawDestination: nothing,  # _refuse: nothing crosses the WAN
            lc.WatchMd: self._act_unmodelled,  # P's control API (DestinationDelivered) is not simulated
            lc.SendCatchUpBatch: self._act_unmodelled,  # catch-up rounds run in simulated time
            lc.AbandonHandoff: self._act_unmodelled,  # failures and recovery are not simulated
            lc.AbortLegs: self._act_unmodelled,
            lc.FailRequest: self._act_unmodelled,
            lc.ReleaseAll: self._act_unmodelled,  # _finish releases; the sim sends no Ended
            lc.DeliverAfterEnd: self._act_unmodelled,  # the same; a relayed transfer lands after RLD ends
        }

    def _event(self, now: float, r: SimRequest, event) -> None:
        """Feed one event to router/lifecycle.transition, the router's own state machine,
        and do what its actions say (the sim acts on these, it does not re-decide them)."""
        self._request.step(r, event, now, event)

    def _act_finish(self, r: SimRequest, a: lc.Finish, now: float, event) -> None:
        (self._md_finished if type(event) is lc.MainTokens else self._rld_finished)(now, r)

    def _act_relay_leg(self, r: SimRequest, a: lc.StartRelayLeg, now: float, event) -> None:
        r.wan = a.wan  # whether P also sends the KV to MD

    def _act_start_handoff(self, r: SimRequest, a: lc.StartHandoff, now: float, event) -> None:
        if r.path is Path.P_MD:  # the one-token bridge ended: MD continues after token 1
            self._event(now, r, lc.CutReady())
        elif self.rld[r.rld].is_running(r):
            self._try_handoff(now, r)
        else:  # RLD's first token, reported while RLD admits the request
            self.loop.after(0.0, self._try_handoff, r)

    def _act_unmodelled(self, r: SimRequest, a, now: float, event) -> None:
        raise RuntimeError(f"lifecycle action {a!r} after {event!r}: the sim does not model it")

    def decide(self, r: SimRequest, md_cached: int) -> PathDecision:
        """The router's decision with the router's inputs (router/flow/pdd_flow.py's _decide): MD's
        prefix (the index's estimate or MD's registration answer), the request's max_new_tokens (the trace's
        output length stands in), the other flows in flight on its RLD and the other prefill
        tokens in flight on its P (this request already counted on both, as front/flow_runner.py
        counts it after the decision), its own prefill tokens, and the WAN bytes the router
        has routed that have not landed. Not P's real backlog nor the link's: the router sees
        neither (docs/sim.md). Called through the module so that a change
        to router/policy.py (or a test's patch) changes the sim."""
        tr = r.tr
        return policy.decide_path(tr.input_length, md_cached,
                                  tr.output_length if self.cfg.expected_output_from_trace else None,
                                  self.rld_flows[r.rld] - 1, self.cfg.rld_max_running, self.route_cfg,
                                  self.p_tokens[r.p] - r.p_tok, r.p_tok, self.wan_waited.sizes())

    def _registered(self, now: float, r: SimRequest) -> None:
        tr, c = r.tr, self.cfg
        if r.path is not Path.P_RLD_ONLY:
            r.md_pending = tr.input_length + tr.output_length
            self.md_pending[r.md] += r.md_pending
        if r.reg_first and self._first_token_via_rld():
            # pdd_flow.py: P->MD registers on MD (a WAN round trip) before P starts.
            self.loop.after(2 * c.wan.one_way_latency_s, self._submit_prefill, r)
        else:
            self._submit_prefill(now, r)

    def _first_token_via_rld(self) -> bool:
        """PDD's P->MD streams P's first token through RLD's one-token leg (pdd_flow.py)."""
        return self.cfg.kind == "pdd" and bool(self.rld)

    def _submit_prefill(self, now: float, r: SimRequest) -> None:
        tr = r.tr
        self.in_prefill.change(now, +1)
        r.t_prefill_in = now
        self.prefill[r.p].submit(now, r, tr.input_length - r.p_cached, r.p_cached, r.p_load_s)

    @staticmethod
    def _affinity(index: PrefixIndex, ids: list, loads: list, full) -> Optional[int]:
        """The instance the index says holds the longest prefix of `full`; None if none does.

        Candidates go least loaded first (a stable sort: equal loads keep index order), so
        among instances holding equally long prefixes the least loaded one is the affinity.
        Ties are common: a shared system prompt is on every instance. Index order instead
        piled new sessions onto instance 0 (agentic trace, pdd_drc_adaptive: SLA 93.8%
        instead of 98.0%).
        """
        inst, matched = index.best_blocks(sorted(ids, key=lambda i: loads[i].load), full)
        return inst if matched else None

    # ---- prefill and transfers ------------------------------------------------------------
    def _prefill_done(self, now: float, r: SimRequest) -> None:
        c, tr = self.cfg, r.tr
        self.in_prefill.change(now, -1)
        self.p_flows[r.p] -= 1  # the router counts a request on P until P's leg replies
        self.p_tokens[r.p] -= r.p_tok
        self.prefill_sojourn_sum += now - r.t_prefill_in
        full = r.full
        self.p_cache[r.p].insert(full)
        if self.p_placement in ("router", "backlog"):  # Pools.prefill_replied: P holds the prompt
            self.p_index.record_blocks(r.p, full)
        rd = c.rdma
        rdma_s = rd.one_way_latency_s + rd.serialisation_s(tr.input_length * c.prefill_hw.kv_bytes_per_token)
        st = r.state
        if r.wan and (st is None or st.md is not lc.Md.FAILED):
            self._start_transfer(now, r, full)
        if st is not None and r.path is Path.P_MD:
            r.t_first = r.t_switch = now + rdma_s  # P's first token, relayed by RLD
            # RLD's one-token leg ends (its token lands rdma_s later, long before the KV on MD)
            self._event(now, r, lc.RelayTokens(1, 1, _LENGTH))
        if r.path is not Path.P_MD:
            self.loop.after(rdma_s, self._rld_kv_landed, r)

    def _start_transfer(self, now: float, r: SimRequest, full) -> None:
        """P's KV starts for MD. MD's hit is what its cache holds now (not at arrival), those
        blocks pinned until the KV has landed; MD's staging budget is charged now, the same
        for every design that lands KV on MD. A room that does not fit: refused if RLD
        decodes the request anyway (the router's fallback: RLD finishes it), else it waits,
        first come first served, for room (a room larger than the whole budget goes alone)."""
        c, tr = self.cfg, r.tr
        if c.drc:
            mc = self.md_cache[r.md]
            n = mc.match_prefix_blocks(full)
            r.md_cached = n * BLOCK_TOKENS
            r.md_load_s = min(mc.host_hits * BLOCK_TOKENS, r.md_cached) * c.md_hw.host_load_s_per_token
            r.pinned = full[:n]
            mc.pin(r.pinned)
        r.kv_bytes = (tr.input_length - r.md_cached) * c.prefill_hw.kv_bytes_per_token
        if c.md_remote:
            i = r.md
            if self.md_staged[i] + r.kv_bytes > self.staging_bytes and self.md_kept[i]:
                self._drop_kept(now, i, r.kv_bytes)
            if self.md_staged[i] + r.kv_bytes > self.staging_bytes and (self.md_staged[i] > 0 or self.md_send_wait[i]):
                if r.path is Path.P_RLD_MD:
                    self._refuse(now, r)
                    return
                self.md_waited += 1
                self.md_send_wait[i].append(r)
                return
            self.md_staged[i] += r.kv_bytes
            r.staged = r.kv_bytes
        self._send_kv(now, r)

    def _drop_kept(self, now: float, i: int, nbytes: float) -> None:
        """MD i's kept transfers (landing only to fill its cache) give up their staging to one a
        request waits on, newest first, until it fits (sglang_glue/md/rooms.py: RankRooms._take_budget)."""
        kept = self.md_kept[i]
        while kept and self.md_staged[i] + nbytes > self.staging_bytes:
            k, _ = kept.popitem()
            if not self.kv_link.in_flight(k):  # serialised, landing (or loading MD's host tier)
                continue
            self.kv_kept_dropped += 1
            self.kv_cancelled += 1
            self.kv_link.cancel(now, k)
            self._unpin(k)
            self._unstage(now, k)

    def _send_kv(self, now: float, r: SimRequest) -> None:
        self.md_hit_tokens += r.md_cached
        self.md_input_tokens += r.tr.input_length
        if r.md_load_s:
            self.md_host_tokens += int(r.md_load_s / self.cfg.md_hw.host_load_s_per_token + 0.5)
        r.t_kv_sent = now
        self.kv_link.send(now, r, r.kv_bytes)

    def _wan_settled(self, r: SimRequest) -> None:
        """The router's _watch_ready or cleanup: its transfer is off the router's count."""
        self.wan_waited.settled(r)

    def _refuse(self, now: float, r: SimRequest) -> None:
        """MD has no room for a P->RLD->MD request's KV: RLD finishes it, nothing crosses."""
        self._wan_settled(r)
        self.md_refused += 1
        self._unpin(r)
        self._md_unpend(r)
        r.path = Path.P_RLD_ONLY
        r.wan = False
        self._event(now, r, lc.MdNotReady(Fallback(Reason.MD_UNAVAILABLE, "staging full")))

    def _rld_kv_landed(self, now: float, r: SimRequest) -> None:
        if r.done:
            return
        self.rld[r.rld].submit(now, r, r.tr.output_length - 1, r.tr.input_length)

    def _unpin(self, r: SimRequest) -> None:
        if r.pinned is not None:
            self.md_cache[r.md].unpin(r.pinned)
            r.pinned = None

    def _unstage(self, now: float, r: SimRequest) -> None:
        """The room no longer holds MD's staging budget: let waiting transfers in."""
        if r.staged <= 0:
            return
        i = r.md
        self.md_staged[i] -= r.staged
        r.staged = 0.0
        if self.md_staged[i] < 1.0:
            self.md_staged[i] = 0.0  # no float drift across an empty budget
        wait = self.md_send_wait[i]
        while wait and (self.md_staged[i] + wait[0].kv_bytes <= self.staging_bytes or self.md_staged[i] <= 0):
            w = wait.popleft()
            if w.done:  # ended meanwhile (a one-token answer): nothing to send
                self._unpin(w)
                continue
            self.md_staged[i] += w.kv_bytes
            w.staged = w.kv_bytes
            self._send_kv(now, w)

    def _md_kv_landed(self, now: float, r: SimRequest) -> None:
        c, tr = self.cfg, r.tr
        self._wan_settled(r)
        if r.md_load_s:
            # MD's host-tier hit is loaded back to HBM alongside the transfer (HiCache): the
            # room is complete when both are.
            ready = r.t_kv_sent + r.md_load_s
            r.md_load_s = 0.0
            if ready > now:
                self.loop.at(ready, self._md_kv_landed, r)
                return
        self._unpin(r)
        self._unstage(now, r)
        if r.kept:
            self.md_kept[r.md].pop(r, None)
        self.kv_landed += 1
        self.kv_landed_bytes += r.kv_bytes
        self.kv_kept_landed += r.kept
        self.kv_wan_s_sum += now - r.t_kv_sent
        if c.drc:
            full = r.full
            self.md_cache[r.md].insert(full)
            self.md_index.record_blocks(r.md, full)
        if r.done:
            return
        if r.state is None:  # no PDD router: MD decodes it all
            self._md_submit(now, r, tr.output_length - 1, tr.input_length)
            return
        # The lifecycle hands over now, or (RLD has not streamed the first token yet) after it.
        self._event(now, r, lc.MdReady())

    def _try_handoff(self, now: float, r: SimRequest) -> None:
        """Hand over only when MD would admit the request now; else RLD keeps decoding and
        the handoff waits for MD to free a slot (handing over to a full MD would stop RLD
        and leave the user waiting in MD's queue)."""
        md = self.md[r.md]
        if not md.can_admit(r.tr.input_length + r.tr.output_length):
            self.md_handoff_wait[r.md].append(r)
            return
        # pdd_flow.py's _handoff: RLD's flows in flight when the request arrived, no hysteresis
        r.mode = handoff_policy.choose_mode(RldLoad(r.rld_others, self.cfg.rld_max_running),
                                            self.cfg.handoff)
        self._handoff_round(now, r)

    def _retry_handoffs(self, now: float, i: int) -> None:
        wait = self.md_handoff_wait[i]
        md = self.md[i]
        while wait:
            r = wait[0]
            if r.done:
                wait.popleft()
                continue
            if not md.can_admit(r.tr.input_length + r.tr.output_length):
                return
            wait.popleft()
            self._try_handoff(now, r)

    # ---- handoff -------------------------------------------------------------------
    def _handoff_round(self, now: float, r: SimRequest) -> None:
        rld = self.rld[r.rld]
        if r.done or not rld.is_running(r):
            return
        generated = 1 + rld.tokens_done(now, r)  # MD needs P's first token too (its KV is not in P's)
        backlog = generated - r.handed
        if r.mode is HandoffMode.ONE_SHOT:
            step = CatchUpStep(backlog, True)
        else:
            step = next_catch_up_batch(backlog, r.round, self.cfg.handoff)
        r.round += 1
        if step.final:  # the cut: the lifecycle freezes the stream where RLD has got to
            self._event(now, r, lc.RelayTokens(1, generated))
            self._event(now, r, lc.CutReady())
            return
        self._send_batch(now, r, step.tokens, False)

    def _send_batch(self, now: float, r: SimRequest, tokens: int, final: bool) -> None:
        extend_s = self.cfg.md_hw.prefill_time_s(tokens, r.tr.input_length + r.handed)
        r.handed += tokens
        self.token_id_bytes += tokens * TOKEN_ID_BYTES
        # The token ids cross the WAN to MD, which extends them in a pass of its own.
        self.loop.after(self.cfg.wan.one_way_latency_s, self._md_extend, (r, extend_s, final))

    def _act_final_handoff(self, r: SimRequest, a: lc.SendFinalHandoff, now: float, event) -> None:
        tr = r.tr
        if r.path is Path.P_MD:  # MD decodes all but P's first token (KV landed, no extend)
            self._md_submit(now, r, tr.output_length - 1, tr.input_length)
            return
        rld = self.rld[r.rld]
        decoded_on_rld = rld.stop(now, r)
        r.max_gap = max(r.max_gap, rld.pop_max_gap(r))
        assert 1 + decoded_on_rld == a.cut, (decoded_on_rld, a.cut)
        r.t_switch = now  # RLD's last token; the user waits for MD's first from here
        self._send_batch(now, r, a.cut - r.handed, True)

    def _md_extend(self, now: float, job) -> None:
        r, extend_s, final = job
        if r.done:
            return  # RLD finished the request while the batch was on its way
        end = self.md[r.md].occupy(now, extend_s)
        if final:
            self.loop.at(end, self._md_take_over, r)
        else:  # MD's answer crosses back before the router sends the next batch
            self.loop.at(end + self.cfg.wan.one_way_latency_s, self._handoff_round, r)

    def _md_take_over(self, now: float, r: SimRequest) -> None:
        tr = r.tr
        self._md_submit(now, r, tr.output_length - r.handed, tr.input_length + r.handed)

    def _md_submit(self, now: float, r: SimRequest, tokens: int, ctx: int) -> None:
        self._md_unpend(r)
        self.md[r.md].submit(now, r, tokens, ctx)

    def _md_unpend(self, r: SimRequest) -> None:
        self.md_pending[r.md] -= r.md_pending
        r.md_pending = 0

    # ---- decode ----------------------------------------------------------------------
    def _rld_start(self, now: float, r: SimRequest) -> None:
        if r.t_first is None:
            r.t_first = now
        st = r.state
        if st is not None and (st.md is lc.Md.PENDING or st.md is lc.Md.READY):
            # P's first token, streamed by RLD: the lifecycle may start the handoff now. A
            # request without MD (NONE, FAILED) decides nothing on it: skipped for speed.
            self._event(now, r, lc.RelayTokens(1, 1))

    def _md_start(self, now: float, r: SimRequest) -> None:
        if r.t_first is None:
            r.t_first = now + self.md_stream_latency
        elif r.t_switch is not None and r.tr.output_length > max(r.handed, 1):
            # MD's first own token: one decode step after admission (and after any extend
            # still holding MD), then the way back. That gap is this stall, not a step sample.
            md = self.md[r.md]
            r.stall = max(now, md.batch.paused_until) + md.step_s() + self.md_stream_latency - r.t_switch
            md.first_token_elsewhere()

    def _rld_done(self, now: float, r: SimRequest) -> None:
        r.max_gap = max(r.max_gap, self.rld[r.rld].pop_max_gap(r))
        if r.state is None:
            self._rld_finished(now, r)
        else:
            self._event(now, r, lc.RelayTokens(1, r.tr.output_length, _LENGTH))

    def _rld_finished(self, now: float, r: SimRequest) -> None:
        """The request ended on RLD (its last relay leg), or on RLD's one-token bridge."""
        if r.path is not Path.P_RLD_ONLY:
            # The router releases MD's room with keep: the rest lands in MD's DRC for the
            # session's next turn (docs/router.md, step 9), still within MD's staging budget.
            # Without a DRC it is useless, and the keep_finished_kv what-if cancels it.
            if self.kv_link.in_flight(r):
                if self.cfg.drc and self.cfg.keep_finished_kv:
                    r.kept = True
                    self.kv_kept += 1
                    self.md_kept[r.md][r] = None
                    if self.cfg.kept_kv_background:
                        self.kv_link.to_background(now, r)
                else:
                    self.kv_cancelled += 1
                    self.kv_link.cancel(now, r)
                    self._unpin(r)  # it will never land
                    self._unstage(now, r)
            self._md_unpend(r)
        # P produced the first token; RLD decoded the rest.
        self._finish(max(now, r.t_first), r, rld_tokens=r.tr.output_length - 1)

    def _md_done(self, now: float, r: SimRequest) -> None:
        r.max_gap = max(r.max_gap, self.md[r.md].pop_max_gap(r))
        if r.state is None:
            self._md_finished(now, r)
        else:
            self._event(now, r, lc.MainTokens(r.tr.output_length, _LENGTH))

    def _md_finished(self, now: float, r: SimRequest) -> None:
        rld_tokens = r.handed - 1 if r.handed > 0 else 0  # handed = P's first token + RLD's
        self._finish(now + self.md_stream_latency, r, rld_tokens)
        if self.md_handoff_wait[r.md]:
            self._retry_handoffs(now, r.md)

    def _finish(self, t_done: float, r: SimRequest, rld_tokens: int) -> None:
        assert not r.done, "request finished twice"
        self._wan_settled(r)
        if self.rld:
            self.rld_flows[r.rld] -= 1
        self.md_flows[r.md] -= 1
        if self.p_placement in ("router", "flows"):  # the router's record_prefixes (front/flow_runner.py): P's prompt, at request end
            self.p_index.record_blocks(r.p, r.full)
        r.done = True
        r.t_done = t_done
        self.finished += 1
        self.in_system.change(self.loop.now, -1)
        self.sojourn_sum += self.loop.now - r.arrival
        out = r.tr.output_length
        log = self.log
        log.arrival.append(r.arrival)
        log.ttft.append(r.t_first - r.arrival)
        log.tpot.append((t_done - r.t_first) / (out - 1) if out > 1 else float("nan"))
        log.e2e.append(t_done - r.arrival)
        log.output.append(out)
        log.rld_tokens.append(rld_tokens)
        log.path.append(PATH_CODES.index(r.path))
        log.stall.append(r.stall)
        gap = r.max_gap if r.stall != r.stall else max(r.max_gap, r.stall)  # stall NaN: no switch
        log.max_gap.append(gap if out > 1 else float("nan"))
        nxt = self._next_turn.pop(id(r.tr), None)
        if nxt is not None:  # arrivals="sessions": the session's next turn, never before this answer
            tr, gap_s = nxt
            self.loop.at(t_done + gap_s if tr.gap_after_answer else max(r.arrival + gap_s, t_done), self._route, tr)


def run_scenario(cfg: ScenarioConfig, requests: Iterable[TraceRequest], sla: Sla = Sla(),
                 rate_scale: float = 1.0, arrivals: str = "open",
                 give_up_below: Optional[float] = None) -> Optional[Summary]:
    """give_up_below: see Simulation.run (None: always a summary)."""
    return Simulation(cfg, sla, rate_scale).run(requests, arrivals, give_up_below)


__all__ = ["ARRIVALS", "ScenarioConfig", "Simulation", "run_scenario", "PATH_NAMES"]
