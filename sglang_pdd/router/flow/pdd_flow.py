"""One request through PDD: path choice, P + RLD + MD legs, handoff, fallbacks (async I/O shell).

The request's course is decided by one pure transition function (router/flow/lifecycle.py: typed
states, events and actions); path and handoff choices by router/policy.py and
handoff/policy.py; token bookkeeping by handoff/stitcher.py. This module turns backend replies
into lifecycle events, all through one queue (so the order of events is the order of
decisions), and performs the actions the transition function returns. The I/O with MD's
control API and P's WAN-destination API is the flow's ``MdSide`` (router/flow/md_side.py). The
events and who sends them:

    event (router/flow/lifecycle.py)         sent by
    PathChosen(path, late_destination,  _choose_path, before any leg starts
               p_room)
    RelayTokens(leg, produced, finish)  _relay_leg: each event of RLD's stream
    RelayFailed(leg, message)           _relay_leg / _prefill_leg: RLD or P failed
    RelayStalled(leg, message)          _relay_leg: no progress within the leg's bound (router/backends/stall.py)
    MdReady / MdNotReady(fallback)      MdSide.watch_ready (MD's KV landed, or not: WAN_FAILED),
                                        MdSide.register_and_deliver (MD_UNAVAILABLE,
                                        WAN_DESTINATION_FAILED)
    DestinationDelivered()              MdSide.register_and_deliver: P accepted MD's room
    CutReady()                          StartHandoff, and MdSide.catch_up after each catch-up batch
    MainTokens(produced, finish)        MdSide.final_handoff: each event of MD's stream
    MainFailed(message)                 MdSide.catch_up / final_handoff: MD refused or died
    Timeout()                           _run: --request-timeout-s passed
    Broken(message)                     _run: an event was illegal, or a backend's reply broke
                                        the stream's invariants (an action raised)
    ClientDisconnected()                events(): the consumer closed the generator early
    Ended()                             events(), last: the cleanup (abort, release, withdraw,
                                        or leave MD's registration to finish after the end)

PddFlow keeps no state of the request's course: that is ``self.state`` (lifecycle.RequestState),
changed only by ``_REQUEST`` (the kit's Driver: an action type -> the method performing it). What
it keeps are I/O handles (session, tasks, queue, stitcher, live backend rids, its MdSide with
MD's room id) and statistics for FlowResult.

The handoff continues the request on MD (the resume contract, docs/router.md): MD gets the
eager token ids, the client's TOTAL max_new_tokens and the logprob fields, and its stream
reports the whole output from position 0, the eager tokens included; the stitcher takes
MD's positions from the cut on. A recovery leg (a new P->RLD leg after MD failed) continues
from what the client has as ``FlowConfig.recovery`` says (RecoveryMode): RESUME (prompt +
emitted with the resume marker ``custom_params["pdd_resume_output_len"]`` and the total
budget, stitched the same way; needs P / RLD that resume in PD mode), REPLAY (the request
again, its first positions checked against the client's and dropped; the default for greedy
requests, exact) or CONTINUE (prompt + emitted as a new request: for sampled requests, whose
replay would diverge).

MD's room registration (``POST /pdd/rooms`` on MD, which answers MD's exact cached prefix):
without a control URL for P it is awaited before P and RLD start, and P learns its WAN
destination from the router's leg (``custom_params`` pdd_room / pdd_wan_peer /
pdd_md_prefix_len, set by the router only: a client's ``pdd_*`` custom params are dropped).
With one (``PrefillBackend.control_url``), a P->RLD->MD request is routed on the router's
*estimate* of MD's prefix, P and RLD start at once (``pdd_wan_expected``) and the
registration runs concurrently; MD's answer is then posted to P's control API
(``PrefillControl``), so the registration round trip is off the time to first token. If MD or
P's API fails, the destination is withdrawn on P and RLD finishes the request.

Backends never see the client's rid: each leg gets an internal rid (a random id per flow plus
the leg), so two clients with the same rid cannot abort each other's legs. Room ids are from a
CSPRNG.

Guarantees (tested end to end): the client gets each output position exactly once and in
order; a WAN or MD failure falls back to relay decoding in datacenter A; every backend request
is aborted and MD's room released when the request ends, for whatever reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Optional

import aiohttp

from sglang_pdd.handoff.policy import HandoffConfig, HandoffMode, RldLoad, choose_mode
from sglang_pdd.handoff.output_meta import OutputMeta
from sglang_pdd.handoff.stitcher import StitchError, StreamStitcher
from sglang_pdd.machine import Driver
from sglang_pdd.router.flow import lifecycle
from sglang_pdd.protocol import RESUME_KEY, KvSize, without_pdd_params
from sglang_pdd.router.flow.fallback import Fallback, Reason
from sglang_pdd.router.flow.lifecycle import RecoveryMode
from sglang_pdd.router.backends.clients import (BackendError, StreamStalled, abort, generate_once, generate_stream,
                                                server_at_fault, until_relay_stalled)
from sglang_pdd.router.flow.bodies import pd_leg_body
from sglang_pdd.router.flow.md_side import FlowIo, MdSide, new_room
from sglang_pdd.router.flow.request import FlowRequest
from sglang_pdd.router.flow.pick import FlowShared, ServerPick
from sglang_pdd.router.policy import RLD_MAX_RUNNING_DEFAULT, Path, PathDecision, PathPolicyConfig, decide_path
from sglang_pdd.router.backends.reply_limits import max_event_bytes
from sglang_pdd.router.backends.stall import RelayStallBounds
from sglang_pdd.log_text import client_text

logger = logging.getLogger("sglang_pdd.router")

STREAM_EVENTS_QUEUED = 1  # PddFlow._stream_slots: parsed backend stream events waiting per flow
# A cancelled leg ends at its next await (a socket read): the end of a request waits for its
# tasks that long at most, so a task that ignores its cancel cannot hold the client's reply.
CANCELLED_TASKS_GRACE_S = 10.0


@dataclass
class FlowConfig:
    # The router's own: its first token always comes through RLD's bridge, judged by the gap
    # SLO (--gap-slo-ms), and P->MD starts P at once where P has a control API (MD's room is
    # registered beside it). PathPolicyConfig's bare defaults are a design without either.
    path: PathPolicyConfig = field(default_factory=lambda: PathPolicyConfig(first_token_via_rld=True,
                                                                            gap_slo_ms=1000.0,
                                                                            p_md_registers_first=False))
    handoff: HandoffConfig = field(default_factory=HandoffConfig)
    wan_timeout_s: float = 30.0
    rld_max_running: int = RLD_MAX_RUNNING_DEFAULT  # the router's --rld-max-running
    request_timeout_s: float = 600.0  # a bounded end to every request, whatever hangs
    # No new token on MD's stream after the handoff this long (the WAN down, MD stopped; bytes
    # that carry no token do not count): MD failed, and the request goes on from what the client
    # has on a new P->RLD leg. A decode step or the handoff's extend takes far less; TCP alone
    # would wait minutes. 0: wait as long as TCP does.
    md_stall_timeout_s: float = 20.0
    # MD's first token after the final handoff not in this long (from the call on): MD failed,
    # as above. Until then the client waits for MD with RLD's tokens held back, and MD has one
    # extend pass to run (tens of ms on a GPU; up to ~2 s seen on a loaded 2-core CPU machine),
    # so this bound can be much tighter than the stall timeout's; RLD kept decoding, so giving
    # up costs the client nothing more. 0: only md_stall_timeout_s bounds it.
    md_first_token_timeout_s: float = 3.0
    # A relay leg (P prefills, RLD decodes) that gets no new token while its servers make no
    # progress at all (router/backends/stall.py: a stopped RLD or P, not a busy one) ends within these
    # instead of --request-timeout-s: MD goes on where it can, else the request fails (a retry
    # elsewhere before the first token). After the leg's first token / before it; 0: no bound.
    relay_stall_timeout_s: float = RelayStallBounds.stall_s
    relay_first_token_timeout_s: float = RelayStallBounds.first_s
    # How a recovery leg (a new P->RLD leg after MD failed) continues from what the client has
    # (lifecycle.RecoveryMode). "auto": REPLAY for greedy requests, CONTINUE otherwise.
    recovery: str = "auto"
    # P->RLD->MD with P's control API: MD's side (registration, P's destination) starts at the
    # client's first token instead of beside the legs (--md-side-after-first-token).
    md_side_after_first_token: bool = False


def is_greedy(sampling: dict) -> bool:
    temperature = sampling.get("temperature", 1.0)
    return (temperature is not None and float(temperature) == 0.0) or sampling.get("top_k") == 1


@dataclass
class FlowResult:
    """What the router reports in meta_info["pdd"] and the metrics."""

    rid: str
    path: str = ""
    reason: str = ""
    prompt_tokens: int = 0
    md_cached_tokens: int = 0  # MD's exact prefix hit, as MD answered the registration
    md_cached_estimate: int = 0  # the router's estimate before asking MD (prefix index)
    # When MD's room was registered: "before_legs" (awaited before P and RLD start),
    # "concurrent" (P and RLD started at once, P got its WAN destination later), "none".
    md_registration: str = "none"
    p_cached_tokens: int = 0  # P's radix hit, as P reported it
    p_cached_estimate: int = 0  # the router's estimate before sending (prefix index)
    wan_bytes: Optional[int] = None  # KV bytes that reached MD over the WAN (None: none landed)
    wan_bytes_saved: int = 0  # KV bytes MD already had (DRC hit)
    # Seconds from the router starting to wait for MD's KV (P has its WAN destination) to MD
    # reporting it landed; None unless it landed. Includes P's queueing and prefill, so it
    # bounds the WAN transfer time from above.
    wan_ready_s: Optional[float] = None
    handoff_at: Optional[int] = None
    handoff_mode: Optional[str] = None
    handoff_stall_s: Optional[float] = None
    handoff_payload_bytes: Optional[int] = None
    catch_up_batches: list = field(default_factory=list)
    rld_tokens: int = 0  # output tokens the client got from RLD (eager + any fallback)
    md_tokens: int = 0  # output tokens the client got from MD
    # The request ended on RLD with its KV still on its way to MD: MD's room released with
    # keep_kv, so the KV lands in MD's cache for the session's next turn.
    md_kv_kept: bool = False
    fallbacks: list = field(default_factory=list)  # router/flow/fallback.py's Fallback, in order
    finish_reason: Optional[dict] = None
    ttft_s: Optional[float] = None
    recovery_mode: Optional[str] = None  # how the last recovery leg continued (RecoveryMode)
    # Backends a leg broke on, as health keys (router/backends/health.py): ("prefill" | "relay" | "main",
    # url) when the server itself did not answer, ("pair", P url, url) for a failure between them.
    failed_backends: list = field(default_factory=list)
    # The P and MD this request was routed to (MD: None on a path without one); with several of
    # each, what shows an operator where prefix affinity and load balance sent it.
    prefill_url: Optional[str] = None
    main_url: Optional[str] = None
    # Seconds from the flow's start to each step of its way to the first token (router side):
    # path (chosen), legs (P and RLD sent), md_registered (MD answered the registration),
    # destination (P accepted MD's room), p_replied (P's leg answered), first_token, md_ready
    # (MD's KV landed). Where a request's time to first token went, beside the servers' stats.
    marks: dict = field(default_factory=dict)

    def mark(self, step: str, t0: float) -> None:
        """Step ``step`` happened now (first time only), ``t0`` the flow's start."""
        self.marks.setdefault(step, round(time.perf_counter() - t0, 4))


def awaiting(coro) -> list[str]:
    """``name:line`` of each coroutine in the chain ``coro`` awaits, outermost first."""
    chain = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
        name = getattr(coro, "__qualname__", type(coro).__name__)
        chain.append(f"{name}:{frame.f_lineno}" if frame is not None else name)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
    return chain


# SGLang's /generate fields that ride along on every leg (beside input_ids, sampling_params,
# stream, rid): the per-request logprob options.
EXTRA_FIELDS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob")


def client_sampling(sampling: dict) -> dict:
    """The client's sampling params without any ``pdd_*`` custom param: those are the router's
    own wire (WAN peer, rooms, resume marker), never a client's to set."""
    sampling = dict(sampling)
    custom = sampling.get("custom_params")
    if custom is None:
        sampling.pop("custom_params", None)
        return sampling
    if not isinstance(custom, dict):
        raise ValueError("sampling_params.custom_params must be an object")
    custom = without_pdd_params(custom)
    if custom:
        sampling["custom_params"] = custom
    else:
        sampling.pop("custom_params")
    return sampling


class PddFlow:
    """Runs one request; ``events()`` yields lists of newly emitted token ids.

    ``req.sampling``: the client's sampling params with ``max_new_tokens`` settled (the whole
    output budget: front/validate.py). ``req.extras``: SGLang's per-request logprob fields
    (``EXTRA_FIELDS``), sent on every leg.
    ``output_meta`` (read it while or after iterating): a dict for building SGLang responses,

    - ``output_token_logprobs``, ``output_top_logprobs``, ``output_token_ids_logprobs`` (only
      the ones the request asked for, i.e. ``return_logprob`` / ``top_logprobs_num`` /
      ``token_ids_logprob``): lists aligned with ALL emitted output positions, each entry in
      SGLang's format (e.g. ``[logprob, token_id, text_or_None]``), taken from the leg that
      emitted the position, spliced from another leg where that one gave none (MD cannot give
      the positions it resumed); ``None`` where no leg gave one;
    - ``input_token_logprobs``, ``input_top_logprobs``, ``input_token_ids_logprobs`` (when
      asked): P's reply to the first leg, as SGLang made them (``logprob_start_len`` honoured,
      first entry ``None``); every path's P prefills the prompt. ``events()`` yields nothing
      before they are in, and fails the request where P gave none;
    - ``finish_reason``: SGLang's dict from the leg that finished the request (incl.
      ``matched``), ``None`` while running; ``prompt_tokens``; ``completion_tokens``.

    ``req.rid`` is the client's id, kept for the client's response (``result.rid``); backends get
    internal ids (``internal_rid`` + leg suffix) only.

    A flow is opened with four things and nothing is set on it after: ``req`` (the settled
    request, flow/request.py; kept for a retry), ``pick`` (its servers and what the router knew
    of them when it picked them, frozen: flow/pick.py, built by front/flow_runner.py's
    ``FlowRunner.open``), ``cfg`` (the router's flow settings, with the request's operator
    overrides) and ``shared`` (what every flow of the router shares: the client session, the
    count of the WAN, where MD's KV size goes when a registration tells it; a flow writes no
    shared record itself).
    """

    def __init__(self, req: FlowRequest, pick: ServerPick, cfg: FlowConfig, shared: FlowShared):
        self.t0 = time.perf_counter()
        self.request, self.pick, self.cfg = req, pick, cfg  # the request is kept for a retry
        self.session = shared.session
        self.prefill, self.relay_url, self.main = pick.prefill, pick.relay_url, pick.main
        self.ids = list(req.input_ids)
        unknown = set(req.extras or {}) - set(EXTRA_FIELDS)
        if unknown:
            raise ValueError(f"unsupported request fields {sorted(unknown)}")
        self.sampling = client_sampling(req.sampling)
        self.max_new = int(self.sampling["max_new_tokens"])  # settled by the caller (front/validate.py)
        self.extras = {k: v for k, v in (req.extras or {}).items() if v is not None}
        self.internal_rid = secrets.token_hex(16)
        self.operator = req.operator  # an operator's request: its replies carry meta_info.pdd
        self.result = FlowResult(rid=req.rid or self.internal_rid, prompt_tokens=len(self.ids),
                                 md_cached_estimate=max(0, int(pick.md_cached_estimate)) if pick.use_drc else 0,
                                 p_cached_estimate=pick.p_cached_estimate, fallbacks=list(pick.fallbacks),
                                 prefill_url=pick.prefill.url, main_url=pick.main.url if pick.main is not None else None)
        # RLD's load when the request arrived sets the handoff mode; catch-up rounds are the lifecycle's.
        self.handoff_mode = choose_mode(RldLoad(pick.rld_inflight, cfg.rld_max_running), cfg.handoff)
        self.state = lifecycle.RequestState(max_new=self.max_new, recovery=self._recovery_mode(),
                                            md_side_after_first_token=cfg.md_side_after_first_token,
                                            catch_up=cfg.handoff if self.handoff_mode is HandoffMode.CATCH_UP else None)
        self.stitcher = StreamStitcher()
        self.queue: asyncio.Queue = asyncio.Queue()
        # Stream events (RLD's and MD's) the queue may hold that the flow has not taken yet. SGLang
        # streams cumulatively: each event holds the whole output and its logprobs so far, parsed
        # several times its JSON size. A leg reads its backend's next event only once the flow took
        # the last one, so a flow that falls behind (a slow client, a busy router) keeps a few
        # events, not the backlog (the backend's socket holds the rest; SGLang itself keeps only its
        # newest output for a stream that is not read).
        self._stream_slots = asyncio.Semaphore(STREAM_EVENTS_QUEUED)
        self.tasks: set[asyncio.Task] = set()
        self._must_finish: set[asyncio.Task] = set()  # aborts / releases: awaited, never cancelled
        self.wan_in_flight = shared.wan_in_flight
        self.live_rids: dict[str, str] = {}  # rid -> server url, aborted at the end
        # MD's control API and P's WAN-destination API (None: a request without an MD)
        self.md = None if pick.main is None else MdSide(
            FlowIo(shared.session, self.ids, self.sampling, self.extras, self.max_new, self.internal_rid, self.result,
                   self.t0, self.queue, self._put_stream_event, self._spawn, self.live_rids, self.wan_in_flight,
                   shared.learn_md_kv_size, shared.lingering),
            pick, wan_timeout_s=cfg.wan_timeout_s, stall_timeout_s=cfg.md_stall_timeout_s,
            first_token_timeout_s=cfg.md_first_token_timeout_s)
        self._out_meta = OutputMeta(self.extras)
        # P's reply to the first leg: the prompt's logprobs come from it (P prefills the prompt; a
        # PD decode server reports none). Asked for, the client's first output waits for it, as
        # SGLang's mini_lb reads P's reply before the decode server's.
        self._prefill_replied = asyncio.Event()
        self.p_load = pick.p_load  # the router's count of P's load: released at P's reply
        # when each server last made progress, as the router's flows saw it (the stall guard's)
        self.progress = shared.progress
        self._relay_stall = RelayStallBounds(cfg.relay_stall_timeout_s, cfg.relay_first_token_timeout_s)
        self._p_replied_legs: set[int] = set()
        self._prefill_failure: Optional[str] = None

    @property
    def completed(self) -> bool:
        """The request reached its end (not failed, not closed by the client)."""
        return self.state.phase is lifecycle.RequestPhase.DONE

    @property
    def output_meta(self) -> dict:
        return self._out_meta.as_dict(self.result.finish_reason, len(self.ids), len(self.stitcher.emitted))

    # ------------------------------------------------------------------ entry point
    async def events(self) -> AsyncIterator[list[int]]:
        try:
            async for tokens in self._run():
                if tokens:
                    await self._input_logprobs()
                    if self.result.ttft_s is None:
                        self.result.ttft_s = time.perf_counter() - self.t0
                        self.result.mark("first_token", self.t0)
                    yield tokens
            await self._input_logprobs()  # also a request without output tokens reports its prompt's
        finally:
            if not self.state.phase.terminal:  # the consumer stopped early: the client is gone
                _REQUEST.advance(self, lifecycle.ClientDisconnected())
            await self._cleanup()

    async def _input_logprobs(self) -> None:
        """The prompt's logprobs, when asked for, are in before the client gets anything: wait
        for P's reply to the first leg; a request P could not give them for fails (never less
        than one server returns)."""
        if not self._out_meta.input_keys:
            return
        if not self._prefill_replied.is_set():
            left = self.t0 + self.cfg.request_timeout_s - time.perf_counter()
            try:
                async with asyncio.timeout(max(0.0, left)):
                    await self._prefill_replied.wait()
            except asyncio.TimeoutError:
                raise BackendError("P's reply (the prompt's logprobs) did not come within "
                                   "--request-timeout-s") from None
        missing = self._out_meta.missing_input()
        if self._prefill_failure or missing:
            raise BackendError(f"the prompt's logprobs ({', '.join(self._out_meta.input_keys)}) are P's to give "
                               f"and P gave none: {self._prefill_failure or f'its reply lacks {missing}'}")

    async def _run(self) -> AsyncIterator[list[int]]:
        chosen = await self._choose_path()
        self.result.mark("path", self.t0)
        await self.queue.put((chosen, None))
        deadline = self.t0 + self.cfg.request_timeout_s
        while True:
            try:
                # asyncio.timeout, not wait_for: 3.11's wait_for drops a cancel (the client gone,
                # /abort_request) that meets an arriving event, and the flow would go on
                async with asyncio.timeout(deadline - time.perf_counter()):
                    event, payload = await self.queue.get()
            except asyncio.TimeoutError:
                logger.error("rid %s: not finished within --request-timeout-s; %s", client_text(self.result.rid),
                             self.stuck_report())
                event, payload = lifecycle.Timeout(
                    f"request not finished within {self.cfg.request_timeout_s:.0f}s "
                    f"(--request-timeout-s); every leg is aborted"), None
            if isinstance(event, (lifecycle.RelayTokens, lifecycle.MainTokens)):
                self._stream_slots.release()  # taken: its leg may read the next one
            try:
                actions = _REQUEST.advance(self, event)
            except lifecycle.IllegalRequestEvent as e:
                _REQUEST.advance(self, lifecycle.Broken(str(e)))
                raise BackendError(f"request broke off: {e}") from None
            for action in actions:
                try:
                    out = _REQUEST.perform(self, action, payload)
                except (StitchError, BackendError) as e:  # a backend broke the stream's invariants
                    _REQUEST.advance(self, lifecycle.Broken(str(e)))
                    if isinstance(e, BackendError):
                        raise
                    raise BackendError(f"request broke off: {e}") from None
                if out:
                    yield out
            if self.state.phase.terminal:
                return

    def stuck_report(self) -> str:
        """Where a request that did not end waits: its lifecycle state, the stream slot, events
        queued, and each of its tasks' innermost await (file:line), for the log of a timeout."""
        waits = [" > ".join(awaiting(task.get_coro())) for task in self.tasks]
        return (f"state {self.state}; stream slots {self._stream_slots!r}; queued {self.queue.qsize()}; "
                f"emitted {len(self.stitcher.emitted)} (RLD produced {len(self.stitcher.rld_tokens)}); "
                f"tasks [{', '.join(sorted(waits))}]")

    # ------------------------------------------------------------------ the lifecycle's actions
    # Each performs one action (``_REQUEST``'s table); ``payload``: the event's backend reply.
    # A method returns the tokens to emit, if any.
    def _start_md_side(self, action: lifecycle.StartMdSide, payload) -> None:
        if action.late_destination:
            self._spawn_leg(self.md.register_and_deliver(self.state.p_room),
                            lambda m: lifecycle.MdNotReady(Fallback(Reason.MD_UNAVAILABLE, m)))
        else:
            self._watch_md(action, payload)

    def _watch_md(self, action, payload) -> None:
        self._spawn_leg(self.md.watch_ready(), lambda m: lifecycle.MdNotReady(Fallback(Reason.WAN_FAILED, m)))

    def _withdraw_destination(self, action: lifecycle.WithdrawDestination, payload) -> None:
        self.md.withdraw_destination(action.p_room)

    def _emit_relay_output(self, action: lifecycle.EmitRelayOutput, payload) -> list[int]:
        leg, event = payload
        ids, offset, replayed = event.get("output_ids", []), action.offset, action.check_replay
        if replayed and ids[:replayed] != self.stitcher.emitted[:replayed]:
            raise BackendError(f"recovery leg {leg} diverged from the {replayed} tokens the client has "
                               f"(a sampled request replayed? recovery 'continue' suits those)")
        before = len(self.stitcher.emitted)
        self._out_meta.observe(("rld", leg), offset + len(ids), event.get("meta_info", {}))
        out = self.stitcher.on_rld_tokens(ids[len(self.stitcher.rld_tokens) - offset:])
        self._out_meta.emitted(("rld", leg), before, len(self.stitcher.emitted))
        return out

    def _start_handoff(self, action: lifecycle.StartHandoff, payload) -> None:
        self.result.handoff_mode = self.handoff_mode.value
        self.queue.put_nowait((lifecycle.CutReady(), None))

    def _send_catch_up_batch(self, action: lifecycle.SendCatchUpBatch, payload) -> None:
        self.result.catch_up_batches.append(action.tokens)
        self._spawn_leg(self.md.catch_up(self.stitcher.emitted[:action.upto], action.round), lifecycle.MainFailed)

    def _send_final_handoff(self, action: lifecycle.SendFinalHandoff, payload) -> None:
        eager = self.stitcher.begin_handoff()
        assert len(eager) == action.cut, (len(eager), action.cut)
        if action.catch_up_tail is not None:
            self.result.catch_up_batches.append(action.catch_up_tail)
        self._spawn_leg(self.md.final_handoff(eager), lifecycle.MainFailed)

    def _commit_handoff(self, action: lifecycle.CommitHandoff, payload) -> None:
        self.result.handoff_at = self.stitcher.cut
        # MD owns the request now: stop RLD (frees its KV) and let MD's cache keep the prompt.
        for rid, url in list(self.live_rids.items()):
            if url == self.relay_url:
                self._spawn(abort(self.session, url, rid), must_finish=True)
                del self.live_rids[rid]
        self.md.handoff_committed()

    def _abandon_handoff(self, action: lifecycle.AbandonHandoff, payload) -> list[int]:
        before = len(self.stitcher.emitted)
        out = self.stitcher.handoff_failed()
        self._out_meta.emitted(("rld", self.state.leg), before, len(self.stitcher.emitted))
        return out

    def _emit_main_output(self, action: lifecycle.EmitMainOutput, payload) -> list[int]:
        ids = payload.get("output_ids", [])
        before = len(self.stitcher.emitted)
        self._out_meta.observe(("md", 0), len(ids), payload.get("meta_info", {}))
        out = self.stitcher.on_md_output(ids)
        self._out_meta.emitted(("md", 0), before, len(self.stitcher.emitted))
        self.result.md_tokens += len(out)
        return out

    def _record_fallback(self, action: lifecycle.RecordFallback, payload) -> None:
        self.result.fallbacks.append(action.fallback)
        logger.warning("rid %s: %s", client_text(self.result.rid), action.fallback)

    def _abort_legs(self, action: lifecycle.AbortLegs, payload) -> None:
        for rid, url in list(self.live_rids.items()):
            self._spawn(abort(self.session, url, rid), must_finish=True)
            del self.live_rids[rid]
        self.stitcher.resume_relay()
        self.result.finish_reason = None

    def _finish(self, action: lifecycle.Finish, payload) -> None:
        self.result.finish_reason = action.finish_reason

    def _fail_request(self, action: lifecycle.FailRequest, payload) -> None:
        raise BackendError(action.message)

    # ------------------------------------------------------------------ path choice
    @property
    def p_prefill_tokens(self) -> int:
        """The tokens the router expects P to prefill: the prompt less what it expects P to hold
        (at least one: the pass that makes the first token)."""
        return max(1, len(self.ids) - self.result.p_cached_estimate)

    async def _choose_path(self) -> lifecycle.PathChosen:
        if self.md is not None and self.md.p_control is not None:
            return await self._choose_path_on_estimate()
        return lifecycle.PathChosen(await self._register_and_choose_path())

    def _decide(self, md_cached: int) -> PathDecision:
        # RLD's load and P's queue feed the load-aware WAN budget (an explicit
        # --max-wan-transfer-ms wins); the simulator decides through the same decide_path with
        # the same inputs.
        decision = decide_path(len(self.ids), md_cached, self.max_new, self.pick.rld_inflight,
                               self.cfg.rld_max_running, self.cfg.path, self.pick.p_queued_tokens,
                               self.p_prefill_tokens, self.wan_in_flight.sizes())
        if self.pick.force_path is not None and self.pick.force_path is not decision.path:
            decision = dataclasses.replace(decision, path=self.pick.force_path,
                                           reason=f"forced by request ({decision.reason})")
        return decision

    def _decide_with_kv_size(self, size: KvSize) -> None:
        """The WAN estimate of the path choice with MD's KV size as MD reported it."""
        self.cfg = dataclasses.replace(self.cfg, path=self.cfg.path.with_kv_size(size))

    async def _choose_path_on_estimate(self) -> lifecycle.PathChosen:
        """P has a control API: decide on the router's estimate of MD's prefix, without a WAN
        round trip. P->RLD->MD starts P and RLD at once and registers on MD concurrently
        (``MdSide.register_and_deliver``); so does P->MD (its first token comes through RLD's
        one-token leg, and MD's room and P's destination are ready long before P's prefill
        ends), its path kept whatever MD's exact prefix (a smaller one makes the transfer
        longer, not a failure). With ``p_md_registers_first`` (--p-md-registers-first) P->MD
        registers first, a WAN round trip before P starts, and decides again on MD's exact
        answer, as without a control API. P->RLD only (outlier; decided on the prompt length and
        max_new_tokens, not on MD's prefix) registers nothing."""
        if self.pick.md_kv_size is not None:  # MD's KV size as it last reported it (the pools')
            self._decide_with_kv_size(self.pick.md_kv_size)
        decision = self._decide(self.result.md_cached_estimate)
        if decision.path is Path.P_MD and self.cfg.path.p_md_registers_first:
            return lifecycle.PathChosen(await self._register_and_choose_path())
        self.result.path, self.result.reason = decision.path.value, decision.reason
        if decision.path is not Path.P_RLD_ONLY:  # MD's room is P's bootstrap room of leg 1
            return lifecycle.PathChosen(decision.path, late_destination=True, p_room=self.md.open_late_room())
        return lifecycle.PathChosen(decision.path)

    async def _register_and_choose_path(self) -> Path:
        """MD's room first (one round trip to MD), then the path on MD's exact prefix."""
        reg = await self.md.register() if self.md is not None else None
        if reg is None:
            self.result.path, self.result.reason = Path.P_RLD_ONLY.value, "no MD available"
            return Path.P_RLD_ONLY
        if reg.kv_size is not None:  # MD knows its KV size exactly
            self._decide_with_kv_size(reg.kv_size)
        decision = self._decide(reg.cached_tokens)
        self.result.path, self.result.reason = decision.path.value, decision.reason
        if decision.path is Path.P_RLD_ONLY:
            self.md.release(must_finish=False)  # outlier: no WAN transfer; don't wait on it
        else:
            self.md.count_wan_transfer()
        return decision.path

    # ------------------------------------------------------------------ legs
    def _recovery_mode(self) -> RecoveryMode:
        if self.cfg.recovery != "auto":
            return RecoveryMode(self.cfg.recovery)
        return RecoveryMode.REPLAY if is_greedy(self.sampling) else RecoveryMode.CONTINUE

    def _leg_rid(self, suffix: str) -> str:
        return f"{self.internal_rid}-{suffix}"

    def _start_relay_leg(self, leg: lifecycle.StartRelayLeg, payload=None) -> None:
        """P prefills (and fans out to MD if ``wan``); RLD decodes, streaming eager tokens. A
        recovery leg resumes: prompt + emitted tokens, the resume marker, the total budget."""
        resumed, mode = self.stitcher.emitted[:leg.resume_len], leg.mode
        if mode is not RecoveryMode.RESUME:
            self.result.recovery_mode = mode.value
        rid = self._leg_rid(f"r{leg.leg}")
        room = self.md.room if (leg.wan and leg.leg == 1) else new_room()
        sampling = dict(self.sampling)
        custom = dict(sampling.get("custom_params") or {})
        if leg.one_token:  # P->MD: RLD only bridges the time to the first token
            sampling["max_new_tokens"] = 1
            sampling["min_new_tokens"] = min(int(sampling.get("min_new_tokens") or 0), 1)
        if resumed and mode is RecoveryMode.RESUME:
            custom[RESUME_KEY] = len(resumed)
        elif mode is RecoveryMode.CONTINUE:
            sampling["max_new_tokens"] = self.max_new - len(resumed)
            sampling["min_new_tokens"] = max(0, int(sampling.get("min_new_tokens") or 0) - len(resumed))
        if leg.wan:  # P sends the prompt's KV to MD's room, to a destination it gets now or later
            custom.update(self.md.destination_params(late=leg.late_destination))
        if custom:
            sampling["custom_params"] = custom
        input_ids = self.ids if mode is RecoveryMode.REPLAY else self.ids + resumed
        extras = dict(self.extras)
        if leg.leg > 1 and "logprob_start_len" in extras:  # the prompt's logprobs are leg 1's P's
            extras["logprob_start_len"] = -1  # (so a recovery leg's P may use its prefix cache)
        body = pd_leg_body(input_ids, sampling, rid, self.prefill.host, self.prefill.bootstrap_port, room, extras)
        self.live_rids[rid] = self.relay_url
        if leg.leg == 1:
            self.result.mark("legs", self.t0)
        self._spawn_leg(self._prefill_leg(leg.leg, body), lambda m: self._prefill_failed(leg.leg, m))
        self._spawn_leg(self._relay_leg(leg, body), lambda m: lifecycle.RelayFailed(leg.leg, m))

    def _event_limit(self, body: dict) -> int:
        """The largest event a leg with this /generate body may send (reply_limits)."""
        return max_event_bytes(len(body["input_ids"]), int(body["sampling_params"]["max_new_tokens"]), self.extras)

    def _prefill_failed(self, leg: int, message: str) -> lifecycle.RelayFailed:
        if leg == 1:
            self._prefill_failure = f"prefill: {message}"
        return lifecycle.RelayFailed(leg, f"prefill: {message}")

    async def _prefill_leg(self, leg: int, body: dict) -> None:
        try:
            reply = await generate_once(self.session, self.prefill.url, body, self._event_limit(body))
            self.progress.note(self.prefill.url, asyncio.get_running_loop().time())
            self._p_replied_legs.add(leg)
            if leg == 1:
                meta = reply.get("meta_info", {}) if isinstance(reply, dict) else {}
                self.result.p_cached_tokens = int(meta.get("cached_tokens") or 0)
                finish = meta.get("finish_reason") or {}
                if finish.get("type") == "abort":  # SGLang empties an aborted request's input logprobs
                    self._prefill_failure = f"P aborted the request: {finish.get('message')}"
                else:
                    self._out_meta.observe_prefill(meta)
        except (BackendError, aiohttp.ClientError, asyncio.TimeoutError) as e:
            self._blame("prefill", self.prefill.url, e)
            await self.queue.put((self._prefill_failed(leg, str(e)), None))
        finally:
            if leg == 1:
                self.result.mark("p_replied", self.t0)
                self._prefill_replied.set()
                if self.p_load is not None:
                    self.p_load.release()

    async def _relay_leg(self, start: lifecycle.StartRelayLeg, body: dict) -> None:
        leg = start.leg
        try:
            finished = False
            events = generate_stream(self.session, self.relay_url, body, self._event_limit(body))
            if self._relay_stall.stall_s or self._relay_stall.first_s:
                events = until_relay_stalled(events, self._relay_stall, self.progress, self.relay_url,
                                             self.prefill.url, lambda: leg in self._p_replied_legs,
                                             f"RLD {self.relay_url}")
            async for event in events:
                finish = event.get("meta_info", {}).get("finish_reason")
                finished = finish is not None
                ids = event.get("output_ids", [])
                if len(ids) < start.replays:  # a replay still below what the client has
                    if finish is not None:
                        raise BackendError(f"recovery replay ended at {len(ids)} tokens, before the "
                                           f"{start.replays} the client has ({finish})")
                    continue
                produced = start.offset + len(ids)
                await self._put_stream_event(lifecycle.RelayTokens(leg, produced, finish), (leg, event))
            if not finished:
                raise BackendError("relay stream ended without a finish reason")
        except StreamStalled as e:
            if leg in self._p_replied_legs:  # P is done with it: RLD stopped
                self._blame("relay", self.relay_url, e)
            else:  # both were silent: either may be the one stopped
                self.result.failed_backends.append(("pair", self.prefill.url, self.relay_url))
            await self.queue.put((lifecycle.RelayStalled(leg, str(e)), None))
        except (BackendError, aiohttp.ClientError, asyncio.TimeoutError) as e:
            self._blame("relay", self.relay_url, e)
            await self.queue.put((lifecycle.RelayFailed(leg, str(e)), None))

    # ------------------------------------------------------------------ plumbing
    async def _put_stream_event(self, event, payload) -> None:
        """A backend stream's event into the queue once the flow took the ones before it
        (``_stream_slots``): the leg's next event stays unread until then."""
        await self._stream_slots.acquire()
        self.queue.put_nowait((event, payload))  # no await between: a cancelled leg holds no room

    def _blame(self, role: str, url: str, error: BaseException) -> None:
        """Note a leg's failure for the router's health board. A server at fault itself
        (backends.server_at_fault: a dropped connection, a 5xx, a reply whose signature does
        not verify or over its bound) counts against it. RLD's
        stream failing otherwise (e.g. P's KV never reached it) is the P-RLD pair's: each can be
        healthy and the two fail together. MD's failures are MdSide's to note."""
        if server_at_fault(error):
            self.result.failed_backends.append((role, url))
        elif role == "relay":
            self.result.failed_backends.append(("pair", self.prefill.url, url))

    def _spawn_leg(self, coro, failed: Callable[[str], object]) -> None:
        """A leg's task, watched: any exception its own handling did not turn into an event (a
        bug, or a reply no handler foresaw) becomes the leg's failure event ``failed(message)``
        in the lifecycle, with the fallback that implies, instead of a task that dies silently
        and leaves the request waiting for its deadline."""

        async def watched() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the watchdog's whole point
                logger.exception("rid %s: a leg task failed unexpectedly", client_text(self.result.rid))
                await self.queue.put((failed(f"{type(e).__name__}: {e}"), None))

        self._spawn(watched())

    def _spawn(self, coro, must_finish: bool = False) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        if must_finish:
            self._must_finish.add(task)
            task.add_done_callback(self._must_finish.discard)

    async def _cleanup(self) -> None:
        self.wan_in_flight.settled(self.internal_rid)  # the router no longer watches its transfer
        # P may have accepted its destination just before the end: then there is nothing to withdraw.
        while not self.queue.empty():
            event, _ = self.queue.get_nowait()
            if isinstance(event, lifecycle.DestinationDelivered):
                _REQUEST.advance(self, event)
        pending = list(self.tasks)
        for task in pending:
            if task not in self._must_finish:  # an abort / release already sent must still land
                task.cancel()
        _REQUEST.step(self, lifecycle.Ended(), None)
        self.result.rld_tokens = len(self.stitcher.emitted) - self.result.md_tokens
        if self._must_finish:  # the aborts, releases and withdrawals land before the request ends
            await asyncio.gather(*self._must_finish, return_exceptions=True)
        if pending:  # no task outlives the request
            _, stuck = await asyncio.wait(pending, timeout=CANCELLED_TASKS_GRACE_S)
            if stuck:  # a bug: the request still ends, and the log says where the tasks wait
                logger.error("rid %s: %d task(s) still running %.0f s after their cancel; %s", client_text(self.result.rid),
                             len(stuck), CANCELLED_TASKS_GRACE_S, self.stuck_report())

    def _release_all(self, action: lifecycle.ReleaseAll, payload) -> None:
        """Abort every backend request still live and release MD's room (a finished request's
        KV still in flight is kept on MD: the session's next turn will hit it, DRC)."""
        for rid, url in self.live_rids.items():
            self._spawn(abort(self.session, url, rid), must_finish=True)
        self.live_rids.clear()
        if self.md is not None and action.md_room:
            self.result.md_kv_kept = action.keep_md_kv and self.md.room is not None
            self.md.release(keep_kv=action.keep_md_kv)

    def _deliver_after_end(self, action: lifecycle.DeliverAfterEnd, payload) -> None:
        """MD's registration and P's destination land after the end; the router's prefix index
        counts MD's copy of the prompt now (the next turn's registration answers exactly)."""
        self.result.md_registration = "after_end"
        self.result.md_kv_kept = True
        self.md.deliver_after_end(action.p_room)


# The request's one way to change: its machine, and PddFlow's method for each action.
_REQUEST = Driver(lifecycle.transition, {
    lifecycle.StartRelayLeg: PddFlow._start_relay_leg,
    lifecycle.StartMdSide: PddFlow._start_md_side,
    lifecycle.WatchMd: PddFlow._watch_md,
    lifecycle.WithdrawDestination: PddFlow._withdraw_destination,
    lifecycle.EmitRelayOutput: PddFlow._emit_relay_output,
    lifecycle.StartHandoff: PddFlow._start_handoff,
    lifecycle.SendCatchUpBatch: PddFlow._send_catch_up_batch,
    lifecycle.SendFinalHandoff: PddFlow._send_final_handoff,
    lifecycle.CommitHandoff: PddFlow._commit_handoff,
    lifecycle.AbandonHandoff: PddFlow._abandon_handoff,
    lifecycle.EmitMainOutput: PddFlow._emit_main_output,
    lifecycle.RecordFallback: PddFlow._record_fallback,
    lifecycle.AbortLegs: PddFlow._abort_legs,
    lifecycle.Finish: PddFlow._finish,
    lifecycle.FailRequest: PddFlow._fail_request,
    lifecycle.ReleaseAll: PddFlow._release_all,
    lifecycle.DeliverAfterEnd: PddFlow._deliver_after_end,
})
