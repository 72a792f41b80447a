"""One request through PDD: path choice, P + RLD + MD legs, handoff, fallbacks (async I/O).

Decisions are delegated to pure modules (router/policy.py, handoff/policy.py,
handoff/stitcher.py); this module only moves bytes and reacts to events, all of which go
through one queue so the order of events is the order of decisions:

    ("rld", cumulative_ids, finish)   RLD's stream (eager tokens)
    ("ready", status, fallback)       MD's room: its KV has landed, or not (``fallback``: the
                                      tag recorded, e.g. "wan_failed: ...", "md_unavailable: ...")
    ("md", cumulative_ids, finish)    MD's stream after a handoff
    ("md_error", message)             MD refused or died
    ("rld_error", message)            RLD (or P) failed

MD's room registration (``POST /pdd/rooms`` on MD, which answers MD's exact cached prefix):
without a control URL for P it is awaited before P and RLD start, and P learns its WAN
destination from the request itself (``custom_params`` pdd_room / pdd_wan_peer /
pdd_md_prefix_len). With one (``PrefillBackend.control_url``), a P->RLD->MD request is routed
on the router's *estimate* of MD's prefix, P and RLD start at once (``pdd_wan_expected``) and
the registration runs concurrently; MD's answer is then posted to P's control API
(``PrefillControl``), so the registration round trip is off the time to first token. If MD or
P's API fails, the destination is withdrawn on P and RLD finishes the request.

Guarantees (tested end to end): the client gets each output position exactly once and in
order; a WAN or MD failure falls back to relay decoding in datacenter A; every backend request
is aborted and MD's room released when the request ends, for whatever reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

import aiohttp

from sglang_pdd.handoff.policy import HandoffConfig, HandoffMode, RldLoad, choose_mode, next_catch_up_batch
from sglang_pdd.handoff.stitcher import Source, StreamStitcher
from sglang_pdd.router.backends import (BackendError, MainControl, PrefillControl, abort, generate_once,
                                        generate_stream)
from sglang_pdd.router.policy import Path, PathDecision, PathPolicyConfig, RequestFacts, choose_path

logger = logging.getLogger("sglang_pdd.router")


@dataclass
class MainBackend:
    url: str
    control_url: str
    wan_peer: str  # HOST:PORT that P dials for this MD (through the WAN emulator in the demo)
    # KV bytes per token as MD last reported them at a registration (None before the first):
    # the WAN estimate of a path chosen before MD answers.
    kv_bytes_per_token: Optional[int] = None


@dataclass
class PrefillBackend:
    url: str
    bootstrap_port: int
    host: str = "127.0.0.1"
    # P's WAN-destination API (``--pdd-control-listen`` on P). Set: the router need not wait
    # for MD's registration before starting P and RLD (see PddFlow).
    control_url: Optional[str] = None


@dataclass
class FlowConfig:
    path: PathPolicyConfig = field(default_factory=PathPolicyConfig)
    handoff: HandoffConfig = field(default_factory=HandoffConfig)
    wan_timeout_s: float = 30.0
    rld_max_running: int = 16
    request_timeout_s: float = 600.0  # a bounded end to every request, whatever hangs
    default_max_new_tokens: int = 128


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
    handoff_at: Optional[int] = None
    handoff_mode: Optional[str] = None
    handoff_stall_s: Optional[float] = None
    handoff_payload_bytes: Optional[int] = None
    catch_up_batches: list = field(default_factory=list)
    rld_tokens: int = 0  # output tokens the client got from RLD (eager + any fallback)
    md_tokens: int = 0  # output tokens the client got from MD
    fallbacks: list = field(default_factory=list)
    finish_reason: Optional[dict] = None
    ttft_s: Optional[float] = None


def new_room() -> int:
    return random.randint(0, 2**63 - 1)


class PddFlow:
    """Runs one request; ``events()`` yields lists of newly emitted token ids."""

    def __init__(self, session: aiohttp.ClientSession, cfg: FlowConfig, prefill: PrefillBackend,
                 relay_url: str, main: Optional[MainBackend], input_ids: list[int], sampling: dict,
                 rid: Optional[str] = None, rld_inflight: int = 0, force_path: Optional[Path] = None,
                 use_drc: bool = True, md_cached_estimate: int = 0):
        self.session, self.cfg = session, cfg
        self.prefill, self.relay_url, self.main = prefill, relay_url, main
        self.ids = list(input_ids)
        self.sampling = dict(sampling)
        self.max_new = int(self.sampling.get("max_new_tokens", cfg.default_max_new_tokens))
        self.result = FlowResult(rid=rid or uuid.uuid4().hex, prompt_tokens=len(self.ids),
                                 md_cached_estimate=max(0, int(md_cached_estimate)) if use_drc else 0)
        self.stitcher = StreamStitcher()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks: set[asyncio.Task] = set()
        self._must_finish: set[asyncio.Task] = set()  # aborts / releases: awaited, never cancelled
        self.rld_inflight = rld_inflight
        self.room: Optional[int] = None
        self.control = MainControl(session, main.control_url) if main else None
        self.p_control = PrefillControl(session, prefill.control_url) if prefill.control_url else None
        # Late WAN destination (P control API): None (not used), then "pending" ->
        # "delivered" | "dropped". While pending, the end of the request withdraws it on P.
        self._destination: Optional[str] = None
        self._p_room: Optional[int] = None  # bootstrap room of the P leg that awaits it
        self.leg = 0  # relay legs started (a recovery starts a new one)
        self.live_rids: dict[str, str] = {}  # rid -> server url, aborted at the end
        self.force_path = force_path
        self.use_drc = use_drc
        self._ready_status = "pending"  # MD's room: pending -> ready | failed
        self._planned_wan = (0, 0)  # (bytes to send, bytes MD already has) for this request
        self._handoff_after_first_token = False  # MD was ready before any token reached us
        self._offset = 0  # output position where the current relay leg's own output starts
        self.t0 = time.perf_counter()

    # ------------------------------------------------------------------ entry point
    async def events(self) -> AsyncIterator[list[int]]:
        try:
            async for tokens in self._run():
                if tokens:
                    if self.result.ttft_s is None:
                        self.result.ttft_s = time.perf_counter() - self.t0
                    yield tokens
        finally:
            await self._cleanup()

    async def _run(self) -> AsyncIterator[list[int]]:
        path = await self._choose_path()
        rld_budget = self.max_new if path is not Path.P_MD else 1
        self._start_relay_leg(self.ids, rld_budget, wan=path is not Path.P_RLD_ONLY)
        if self._destination == "pending":
            self._spawn(self._register_and_deliver())  # P and RLD are on their way already
        elif path is not Path.P_RLD_ONLY:
            self._spawn(self._watch_ready())
        relay_done = False
        deadline = self.t0 + self.cfg.request_timeout_s
        while True:
            try:
                kind, *payload = await asyncio.wait_for(self.queue.get(), deadline - time.perf_counter())
            except asyncio.TimeoutError:
                raise BackendError(f"request not finished within {self.cfg.request_timeout_s:.0f}s "
                                   f"(--request-timeout-s); every leg is aborted") from None
            if kind == "rld":
                leg, ids, finish = payload
                if leg != self.leg or self.stitcher.source is Source.MAIN:
                    continue  # superseded relay leg, or MD owns the stream (RLD is being aborted)
                yield self.stitcher.on_rld_tokens(ids[len(self.stitcher.rld_tokens) - self._offset:])
                if self._handoff_after_first_token and self.stitcher.emitted and (
                        finish is None or not self._relay_finished_request(finish)):
                    self._handoff_after_first_token = False
                    self._spawn(self._handoff())
                if finish is None:
                    continue
                relay_done = True
                if self._relay_finished_request(finish):
                    self.result.finish_reason = finish
                    if self.stitcher.source is Source.HANDING_OFF:
                        yield self.stitcher.handoff_failed()  # RLD finished first: its tokens stand
                    return
                if self._ready_status == "failed" and self.stitcher.source is Source.RELAY:
                    relay_done = await self._recover("wan_failed_after_rld")
            elif kind == "rld_error":
                if self.stitcher.source is not Source.MAIN:
                    raise BackendError(f"relay leg failed: {payload[0]}")
            elif kind == "ready":
                status, fallback = payload
                self._ready_status = status
                if status == "ready":
                    self.result.wan_bytes, self.result.wan_bytes_saved = self._planned_wan
                    if self.stitcher.emitted or relay_done:
                        self._spawn(self._handoff())
                    else:  # P's first token is on its way through RLD: TTFT stays same-DC
                        self._handoff_after_first_token = True
                    continue
                self.result.fallbacks.append(fallback)
                logger.warning("rid %s: MD room not ready (%s); RLD finishes", self.result.rid, fallback)
                if relay_done:
                    relay_done = await self._recover("wan_failed_after_rld")
            elif kind == "md":
                start, ids, finish = payload
                new = ids[len(self.stitcher.emitted) - start:]
                if self.stitcher.source is Source.RELAY:
                    continue  # a late MD event after a failed handoff
                if self.stitcher.source is Source.HANDING_OFF:
                    if not new:
                        continue
                    self._on_md_first_token()  # commits the handoff: RLD is aborted
                self.result.md_tokens += len(new)
                yield self.stitcher.on_md_tokens(len(self.stitcher.emitted), new)
                if finish is not None:
                    self.result.finish_reason = finish
                    return
            elif kind == "md_error":
                self.result.fallbacks.append(f"md_failed: {payload[0]}")
                logger.warning("rid %s: MD failed (%s)", self.result.rid, payload[0])
                if self.stitcher.source is Source.HANDING_OFF:
                    yield self.stitcher.handoff_failed()
                if self.stitcher.source is Source.MAIN:
                    relay_done = await self._recover("md_failed_mid_stream")
                elif relay_done:
                    relay_done = await self._recover("md_failed")

    def _relay_finished_request(self, finish: dict) -> bool:
        """RLD's leg ended: is the whole request done (budget used, or EOS / stop / abort)?"""
        return len(self.stitcher.rld_tokens) >= self.max_new or finish.get("type") != "length"

    # ------------------------------------------------------------------ path choice
    async def _choose_path(self) -> Path:
        if self.main is not None and self.p_control is not None:
            return await self._choose_path_on_estimate()
        return await self._register_and_choose_path()

    def _decide(self, md_cached: int) -> PathDecision:
        decision = choose_path(RequestFacts(input_tokens=len(self.ids), md_cached_tokens=md_cached,
                                            expected_output_tokens=self.max_new), self.cfg.path)
        if self.force_path is not None and self.force_path is not decision.path:
            decision = dataclasses.replace(decision, path=self.force_path, reason=f"forced by request ({decision.reason})")
        return decision

    async def _choose_path_on_estimate(self) -> Path:
        """P has a control API: decide on the router's estimate of MD's prefix, without a WAN
        round trip. P->RLD->MD starts P and RLD at once and registers on MD concurrently
        (``_register_and_deliver``). P->MD still registers first (MD's first token is the
        TTFT anyway, so the round trip is hidden) and then decides on MD's exact answer, as
        without a control API. P->RLD only (outlier; decided on the prompt length and
        max_new_tokens, not on MD's prefix) registers nothing."""
        if self.main.kv_bytes_per_token:  # MD's KV size as it last reported it
            self.cfg = dataclasses.replace(self.cfg, path=dataclasses.replace(
                self.cfg.path, kv_bytes_per_token=self.main.kv_bytes_per_token))
        decision = self._decide(self.result.md_cached_estimate)
        if decision.path is Path.P_MD:
            return await self._register_and_choose_path()
        self.result.path, self.result.reason = decision.path.value, decision.reason
        if decision.path is Path.P_RLD_MD:
            self.room = self._p_room = new_room()
            self._destination = "pending"
            self.result.md_registration = "concurrent"
        return decision.path

    async def _register_and_choose_path(self) -> Path:
        """MD's room first (one round trip to MD), then the path on MD's exact prefix."""
        cached = 0
        if self.main is not None:
            self.result.md_registration = "before_legs"
            self.room = new_room()
            try:
                reg = await self.control.register(self.room, self.ids, use_cache=self.use_drc)
                cached = self._on_registered(reg)
            except (BackendError, aiohttp.ClientError, asyncio.TimeoutError, KeyError) as e:
                self.result.fallbacks.append(f"md_unavailable: {e}")
                logger.warning("rid %s: MD unavailable (%r); serving on RLD only", self.result.rid, e)
                self.room = None
        if self.room is None:
            self.result.path, self.result.reason = Path.P_RLD_ONLY.value, "no MD available"
            return Path.P_RLD_ONLY
        decision = self._decide(cached)
        self.result.path, self.result.reason = decision.path.value, decision.reason
        if decision.path is Path.P_RLD_ONLY:
            self._spawn(self.control.release(self.room))  # outlier: no WAN transfer; don't wait on it
            self.room = None
        return decision.path

    def _on_registered(self, reg: dict) -> int:
        """MD's registration answer: its exact cached prefix (returned) and KV size."""
        cached = int(reg["cached_tokens"])
        per_token = int(reg.get("kv_bytes_per_token") or 0)
        self.result.md_cached_tokens = cached
        # Counted once MD confirms the KV landed (a cancelled transfer is not "sent").
        self._planned_wan = ((len(self.ids) - cached) * per_token, cached * per_token)
        if per_token:  # MD knows its KV size exactly
            self.main.kv_bytes_per_token = per_token
            self.cfg = dataclasses.replace(self.cfg, path=dataclasses.replace(
                self.cfg.path, kv_bytes_per_token=per_token))
        return cached

    async def _register_and_deliver(self) -> None:
        """P and RLD run already: register the room on MD, tell P the destination (MD's exact
        prefix), then wait for MD's KV as usual. Any failure withdraws the destination on P
        and ends in a failed "ready", so RLD finishes the request."""
        room = self.room
        try:
            reg = await self.control.register(room, self.ids, use_cache=self.use_drc)
            cached = self._on_registered(reg)
        except (BackendError, aiohttp.ClientError, asyncio.TimeoutError, KeyError, TypeError, ValueError) as e:
            self.room = None  # MD holds no room for it
            await self._no_destination(f"md_unavailable: {e}")
            return
        if cached != self.result.md_cached_estimate:
            logger.info("rid %s: MD holds %d prompt tokens, the router estimated %d (path %s kept)",
                        self.result.rid, cached, self.result.md_cached_estimate, self.result.path)
        try:
            await self.p_control.set_wan_destination(self._p_room, room, self.main.wan_peer, cached)
        except (BackendError, aiohttp.ClientError, asyncio.TimeoutError) as e:
            self._spawn(self.control.release(room), must_finish=True)  # unlock MD's prefix now
            self.room = None
            await self._no_destination(f"wan_destination_failed: {e}")
            return
        self._destination = "delivered"
        await self._watch_ready()

    async def _no_destination(self, fallback: str) -> None:
        self._destination = "dropped"
        self._spawn(self.p_control.drop_wan_destination(self._p_room), must_finish=True)
        await self.queue.put(("ready", "failed", fallback))

    # ------------------------------------------------------------------ legs
    def _start_relay_leg(self, input_ids: list[int], max_new: int, wan: bool) -> None:
        """P prefills (and fans out to MD if ``wan``); RLD decodes, streaming eager tokens."""
        self.leg += 1
        self._offset = len(input_ids) - len(self.ids)
        rid = f"{self.result.rid}-r{self.leg}"
        room = self.room if (wan and self.leg == 1) else new_room()
        sampling = {**self.sampling, "max_new_tokens": max_new}
        if wan and self.leg == 1 and self._destination is not None:  # P learns it later
            sampling["custom_params"] = {**(self.sampling.get("custom_params") or {}),
                                         "pdd_room": self.room, "pdd_wan_expected": True}
        elif wan and self.leg == 1:
            sampling["custom_params"] = {**(self.sampling.get("custom_params") or {}),
                                         "pdd_room": self.room, "pdd_wan_peer": self.main.wan_peer,
                                         "pdd_md_prefix_len": self.result.md_cached_tokens}
        body = {"input_ids": input_ids, "sampling_params": sampling, "rid": rid,
                "bootstrap_host": self.prefill.host, "bootstrap_port": self.prefill.bootstrap_port,
                "bootstrap_room": room}
        self.live_rids[rid] = self.relay_url
        self._spawn(self._prefill_leg(body))
        self._spawn(self._relay_leg(self.leg, body))

    async def _prefill_leg(self, body: dict) -> None:
        try:
            reply = await generate_once(self.session, self.prefill.url, body)
            if self.leg == 1:
                self.result.p_cached_tokens = int(reply.get("meta_info", {}).get("cached_tokens") or 0)
        except (BackendError, aiohttp.ClientError, asyncio.TimeoutError) as e:
            await self.queue.put(("rld_error", f"prefill: {e}"))

    async def _relay_leg(self, leg: int, body: dict) -> None:
        try:
            finished = False
            async for event in generate_stream(self.session, self.relay_url, body):
                finish = event.get("meta_info", {}).get("finish_reason")
                finished = finish is not None
                await self.queue.put(("rld", leg, event.get("output_ids", []), finish))
            if not finished:
                raise BackendError("relay stream ended without a finish reason")
        except (BackendError, aiohttp.ClientError, asyncio.TimeoutError) as e:
            if leg == self.leg:
                await self.queue.put(("rld_error", str(e)))

    async def _watch_ready(self) -> None:
        try:
            reply = await self.control.wait_ready(self.room, self.cfg.wan_timeout_s)
            status, reason = reply.get("status"), reply.get("reason", "")
            if status == "pending":
                status, reason = "failed", f"not ready within {self.cfg.wan_timeout_s:.0f}s"
        except (BackendError, aiohttp.ClientError, asyncio.TimeoutError) as e:
            status, reason = "failed", f"control API: {e!r}"
        await self.queue.put(("ready", status, f"wan_failed: {reason}"))

    async def _handoff(self) -> None:
        """Catch-up rounds (optional), then the final cut and MD's continuation stream."""
        load = RldLoad(self.rld_inflight, self.cfg.rld_max_running)
        mode = choose_mode(load, self.cfg.handoff)
        self.result.handoff_mode = mode.value
        handed = 0
        try:
            if mode is HandoffMode.CATCH_UP:
                for round_index in range(self.cfg.handoff.max_catch_up_rounds):
                    backlog = len(self.stitcher.emitted) - handed
                    step = next_catch_up_batch(backlog, round_index, self.cfg.handoff)
                    if step.final or self.stitcher.source is not Source.RELAY:
                        break
                    # Warm MD's radix cache with the next batch (one extend); RLD keeps decoding.
                    handed += step.tokens
                    self.result.catch_up_batches.append(step.tokens)
                    await self.control.handoff(self.room, {
                        "token_ids": self.stitcher.emitted[:handed], "warmup": True,
                        "sampling_params": self._md_sampling(), "rid": f"{self.result.rid}-c{round_index}"})
            if self.stitcher.source is not Source.RELAY or len(self.stitcher.emitted) >= self.max_new:
                return
            eager = self.stitcher.begin_handoff()
            if mode is HandoffMode.CATCH_UP:
                self.result.catch_up_batches.append(len(eager) - handed)
            self._handoff_t = time.perf_counter()
            rid = f"{self.result.rid}-m"
            self.live_rids[rid] = self.main.url
            body = {"token_ids": eager, "rid": rid,
                    "sampling_params": {**self._md_sampling(), "max_new_tokens": self.max_new - len(eager)}}
            self.result.handoff_payload_bytes = len(json.dumps(body))
            finished = False
            async for event in self.control.handoff_stream(self.room, body):
                finish = event.get("meta_info", {}).get("finish_reason")
                finished = finish is not None
                await self.queue.put(("md", len(eager), event.get("output_ids", []), finish))
            if not finished:
                raise BackendError("MD stream ended without a finish reason")
        except (BackendError, aiohttp.ClientError, asyncio.TimeoutError) as e:
            await self.queue.put(("md_error", str(e)))

    def _md_sampling(self) -> dict:
        sampling = {k: v for k, v in self.sampling.items() if k != "custom_params"}
        return sampling

    def _on_md_first_token(self) -> None:
        self.result.handoff_stall_s = time.perf_counter() - self._handoff_t
        self.result.handoff_at = self.stitcher.cut
        # MD owns the request now: stop RLD (frees its KV) and let MD's cache keep the prompt.
        for rid, url in list(self.live_rids.items()):
            if url == self.relay_url:
                self._spawn(abort(self.session, url, rid), must_finish=True)
                del self.live_rids[rid]
        if self.room is not None:
            self._spawn(self.control.release(self.room), must_finish=True)
            self.room = None

    async def _recover(self, why: str) -> bool:
        """MD cannot finish: a new P->RLD leg continues from what the client already has."""
        self.result.fallbacks.append(f"recovered_on_relay: {why}")
        logger.warning("rid %s: %s; continuing on RLD from position %d", self.result.rid, why,
                       len(self.stitcher.emitted))
        for rid, url in list(self.live_rids.items()):
            self._spawn(abort(self.session, url, rid), must_finish=True)
            del self.live_rids[rid]
        self.stitcher.resume_relay()
        self.result.finish_reason = None
        self._start_relay_leg(self.ids + self.stitcher.emitted, self.max_new - len(self.stitcher.emitted),
                              wan=False)
        return False  # the new relay leg is running

    # ------------------------------------------------------------------ plumbing
    def _spawn(self, coro, must_finish: bool = False) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        if must_finish:
            self._must_finish.add(task)
            task.add_done_callback(self._must_finish.discard)

    async def _cleanup(self) -> None:
        pending = list(self.tasks)
        for task in pending:
            if task not in self._must_finish:  # an abort / release already sent must still land
                task.cancel()
        cleanup = [abort(self.session, url, rid) for rid, url in self.live_rids.items()]
        if self.room is not None and self.control is not None:
            # KV still in flight is kept on MD: the session's next turn will hit it (DRC)
            cleanup.append(self.control.release(self.room, keep_kv=True))
        if self._destination == "pending":  # ended before P got a destination: P stops waiting
            self._destination = "dropped"
            cleanup.append(self.p_control.drop_wan_destination(self._p_room))
        self.live_rids.clear()
        self.room = None
        if cleanup:
            await asyncio.gather(*cleanup, return_exceptions=True)
        if pending:  # no task outlives the request
            await asyncio.gather(*pending, return_exceptions=True)
        self.result.rld_tokens = len(self.stitcher.emitted) - self.result.md_tokens

