"""MD's side of one request: the I/O a flow does with MD's control API and P's WAN-destination
API (async I/O shell, no decisions).

A ``PddFlow`` (router/flow/pdd_flow.py) runs the request; its ``MdSide`` registers MD's room, delivers
that room to P when P learns it late, waits for MD's KV, sends the catch-up rounds and the
final handoff, reads MD's stream and releases the room. It holds that I/O's handles and state
(MD's and P's control clients, the room id, MD's TP size, the WAN bytes planned, when the final
handoff was sent) and tells the flow what happened only as lifecycle events on the flow's
queue (MD's stream events through the flow's stream slot, as every backend stream's), besides
the statistics it writes into the flow's FlowResult:

    event (router/flow/lifecycle.py)       sent by
    DestinationDelivered()            register_and_deliver: P accepted MD's room
    MdNotReady(fallback)              register_and_deliver (MD_UNAVAILABLE, WAN_DESTINATION_FAILED),
                                      watch_ready (WAN_FAILED: not landed, or not in time)
    MdReady()                         watch_ready: MD's KV landed
    CutReady()                        catch_up: MD extended its cache by the batch
    MainTokens(produced, finish)      final_handoff: each event of MD's stream
    MainFailed(message)               catch_up / final_handoff: MD refused or died

Before the legs start (path choice, no event loop yet) ``register`` answers the flow directly:
the path is chosen on MD's answer. The flow runs each coroutine here as one of its leg tasks;
the releases and withdrawals sent here go through the flow's ``spawn`` as tasks that must
finish, so that the request ends only once they landed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Coroutine, Optional

import aiohttp

from sglang_pdd.protocol import KvSize, RegisterReply
from sglang_pdd.router.flow import lifecycle
from sglang_pdd.router.backends.clients import (BackendError, MainControl, PrefillControl, UnverifiedReply,
                                        server_at_fault)
from sglang_pdd.router.flow.bodies import handoff_body, late_destination_params, wan_destination_params, warmup_body
from sglang_pdd.router.flow.fallback import Fallback, Reason
from sglang_pdd.router.flow.lingering import Lingering
from sglang_pdd.router.flow.pick import ServerPick
from sglang_pdd.router.backends.reply_limits import max_event_bytes
from sglang_pdd.router.backends.wan_in_flight import WanInFlight
from sglang_pdd.log_text import client_text

logger = logging.getLogger("sglang_pdd.router")


def new_room() -> int:
    """A bootstrap / MD room id nobody can guess (a CSPRNG, not ``random``)."""
    return secrets.randbelow(2**63)


@dataclass(frozen=True)
class _Delivery:
    """How MD's registration and P's late destination went: ``fallback`` None once P has MD's
    ``room``; else why not, and whether MD may hold the room all the same (it answered, or its
    answer could not be verified), so it must be released."""

    room: int
    fallback: Optional[Fallback] = None
    md_holds_room: bool = True


@dataclass(frozen=True)
class FlowIo:
    """What a flow hands its MD side: the request's values, and the flow's parts that MD's side
    writes to (its result, its event queue and stream slot, its tasks, its backend rids), with
    the router's shared WAN count and where MD's KV size goes."""

    session: Any
    ids: list
    sampling: dict
    extras: dict
    max_new: int
    internal_rid: str
    result: Any  # the flow's FlowResult
    t0: float  # the flow's start: result.marks are seconds from it
    queue: asyncio.Queue
    put_stream_event: Callable[[object, object], Awaitable[None]]
    spawn: Callable[..., None]
    live_rids: dict
    wan_in_flight: WanInFlight
    learn_md_kv_size: Optional[Callable[[str, KvSize], None]] = None
    lingering: Lingering = field(default_factory=Lingering)


class MdSide:
    """MD's side of one flow, built whole by ``PddFlow.__init__`` for a request with an MD.

    ``room`` is MD's room id while MD holds one for the request (None before registration,
    after a failed one and once released); the flow gives it to P's first leg as its bootstrap
    room. ``md_tp``: MD's TP size, from its registration answer. ``p_control``: P's
    WAN-destination API, where P has one (then P may learn MD's room after its leg started).

    ``io`` is the flow's side of it (``FlowIo``): the request's values, and where MD's side
    leaves what happened: MD's handoff rid joins the backend rids the flow aborts at the end
    (``live_rids``), the events go to its queue, the tasks to its task set, the statistics to
    its FlowResult, the planned WAN bytes to the router's count of the link, MD's KV size to
    the router's pools. ``pick`` says which MD and P (flow/pick.py).
    """

    def __init__(self, io: FlowIo, pick: ServerPick, *, wan_timeout_s: float, stall_timeout_s: float,
                 first_token_timeout_s: float):
        main = pick.main
        self.main_url, self.wan_peer = main.url, main.wan_peer
        self.control = MainControl(io.session, main.control_url)
        p_control_url = pick.prefill.control_url
        self.p_control = PrefillControl(io.session, p_control_url) if p_control_url else None
        self.ids, self.sampling, self.extras, self.max_new = io.ids, io.sampling, io.extras, io.max_new
        self.use_drc, self.internal_rid = pick.use_drc, io.internal_rid
        self.wan_timeout_s = wan_timeout_s
        # After the final handoff (0: as long as TCP waits): no new token this long, no first token this long.
        self.stall_timeout_s, self.first_token_timeout_s = stall_timeout_s, first_token_timeout_s
        self.result, self.queue, self._put_stream_event = io.result, io.queue, io.put_stream_event
        self.t0 = io.t0  # the flow's start: result.marks are seconds from it
        self._spawn, self.live_rids, self.wan_in_flight = io.spawn, io.live_rids, io.wan_in_flight
        self._learn_kv_size = io.learn_md_kv_size  # MD's KV size from a registration, for the router
        self.room: Optional[int] = None
        self.md_tp = 1
        self._lingering = io.lingering  # the router's tasks that outlive their request
        self._delivery: Optional[asyncio.Future[_Delivery]] = None  # registration + P's late destination
        self._withdrawn = False  # P was told to stop waiting for its destination
        self._planned_wan = (0, 0)  # statistics: (bytes to send, bytes MD already has)
        self._handoff_sent_t = 0.0  # statistics: when the final handoff was sent

    # ------------------------------------------------------------------ registration
    async def register(self) -> Optional[RegisterReply]:
        """MD's room before P and RLD start: MD's answer (its exact cached prefix and KV size),
        or None where MD is unavailable (the fallback recorded: the request goes on RLD only)."""
        self.result.md_registration = "before_legs"
        self.room, reg = new_room(), None
        try:
            reg = await self.control.register(self.room, self.ids, use_cache=self.use_drc)
            self.result.mark("md_registered", self.t0)
            self._on_registered(reg)
        except (BackendError, aiohttp.ClientError, asyncio.TimeoutError, KeyError) as e:
            self._registration_failed(self.room, reg, e)
            self.result.fallbacks.append(Fallback(Reason.MD_UNAVAILABLE, str(e)))
            logger.warning("rid %s: MD unavailable (%r); serving on RLD only", client_text(self.result.rid), e)
            return None
        return reg

    def _registration_failed(self, room: int, reg: Optional[RegisterReply], error: BaseException) -> None:
        """MD holds no room for the request from now on: ``room``, which it may hold (it
        answered, or its answer could not be verified), is released at once, so its prefix is
        not locked."""
        self._blame(error)
        if reg is not None or isinstance(error, UnverifiedReply):
            self._spawn(self.control.release(room), must_finish=True)
        self.room = None

    def open_late_room(self) -> int:
        """The room of a request whose P and RLD start before MD registers it: also P's
        bootstrap room of leg 1 (returned); ``register_and_deliver`` registers it on MD."""
        self.room = new_room()
        self.result.md_registration = "concurrent"
        return self.room

    def _on_registered(self, reg: RegisterReply) -> int:
        """MD's registration answer: its exact cached prefix (returned) and KV size."""
        cached = reg.cached_tokens
        size = reg.kv_size or KvSize(0)
        self.md_tp = reg.md_tp  # P feeds each of MD's TP ranks (their WAN ports: wan_peer's + r)
        self.result.md_cached_tokens = cached
        # Counted once MD confirms the KV landed (a cancelled transfer is not "sent").
        self._planned_wan = (size.wan_bytes(len(self.ids), cached), cached * size.per_token)
        if reg.kv_size is not None and self._learn_kv_size is not None:  # MD knows its KV size exactly
            self._learn_kv_size(self.main_url, reg.kv_size)  # the router's pools, for the next flows' routes
        return cached

    def count_wan_transfer(self) -> None:
        """P will send the prompt's KV to MD: the router counts its bytes on the link until
        they land or fail (``watch_ready``) or the request ends."""
        self.wan_in_flight.sending(self.internal_rid, self._planned_wan[0])

    def destination_params(self, late: bool) -> dict:
        """P's ``custom_params`` for leg 1: where its KV goes over the WAN (MD's room, WAN
        address, cached prefix and TP size), or, ``late``, that P learns it later."""
        if late:
            return late_destination_params(self.room)
        return wan_destination_params(self.room, self.wan_peer, self.result.md_cached_tokens, self.md_tp)

    def register_and_deliver(self, p_room: int) -> Coroutine[Any, Any, None]:
        """P and RLD run already: register the room on MD, tell P (``p_room``) the destination
        (MD's exact prefix), then wait for MD's KV as usual. Any failure withdraws the
        destination on P and ends in a failed "ready", so RLD finishes the request.

        The registration and P's destination start now as their own task, which the returned
        coroutine (the flow's leg) reports on: a request that ends before that task is done
        leaves it to ``deliver_after_end`` or ``release``."""
        self._delivery = asyncio.ensure_future(self._deliver(p_room))
        return self._report_delivery(self._delivery)

    async def _report_delivery(self, delivery_task: "asyncio.Future[_Delivery]") -> None:
        delivery = await asyncio.shield(delivery_task)  # the flow's cancel leaves the delivery running
        if delivery.fallback is not None:
            if delivery.md_holds_room:
                self._spawn(self.control.release(delivery.room), must_finish=True)  # unlock MD's prefix now
            await self._not_ready(delivery.fallback)
            return
        self.count_wan_transfer()
        await self.queue.put((lifecycle.DestinationDelivered(), None))

    async def _deliver(self, p_room: int) -> "_Delivery":
        """Register ``self.room`` on MD, then post it to P as ``p_room``'s WAN destination."""
        room, reg = self.room, None
        try:
            reg = await self.control.register(room, self.ids, use_cache=self.use_drc)
            self.result.mark("md_registered", self.t0)
            cached = self._on_registered(reg)
        except (BackendError, aiohttp.ClientError, asyncio.TimeoutError, KeyError, TypeError, ValueError) as e:
            self._blame(e)
            self.room = None
            return _Delivery(room, Fallback(Reason.MD_UNAVAILABLE, str(e)),
                             md_holds_room=reg is not None or isinstance(e, UnverifiedReply))
        if cached != self.result.md_cached_estimate:
            logger.info("rid %s: MD holds %d prompt tokens, the router estimated %d (path %s kept)",
                        client_text(self.result.rid), cached, self.result.md_cached_estimate, self.result.path)
        if self._withdrawn:  # the request failed or closed meanwhile: P must not get it
            self.room = None
            return _Delivery(room, Fallback(Reason.WAN_DESTINATION_FAILED, "withdrawn: the request ended"))
        try:
            await self.p_control.set_wan_destination(p_room, room, self.wan_peer, cached, md_tp=self.md_tp)
        except (BackendError, aiohttp.ClientError, asyncio.TimeoutError) as e:
            self.room = None
            return _Delivery(room, Fallback(Reason.WAN_DESTINATION_FAILED, str(e)), md_holds_room=True)
        self.result.mark("destination", self.t0)
        return _Delivery(room)

    def deliver_after_end(self, p_room: Optional[int]) -> None:
        """The request finished while MD's registration or P's destination was still on its way:
        both finish after the end (the client does not wait), then MD's room is released keeping
        the KV P sends it, for the session's next turn. Where MD or P failed, the destination is
        withdrawn on P and MD's room freed. Not counted on the router's WAN: nobody waits for
        this KV, and P sends it behind the KV someone does."""
        if self._delivery is not None:
            self.room = None  # from here on the room is the lingering task's
            self._lingering.spawn(self._after_end(self._delivery, p_room))

    async def _after_end(self, delivery_task: "asyncio.Future[_Delivery]", p_room: Optional[int]) -> None:
        delivery = await delivery_task
        counters = self._lingering.counters
        if delivery.fallback is None:
            await self.control.release(delivery.room, keep_kv=True)
            await self.p_control.keep_only_wan(delivery.room)
            counters["delivered_after_end"] += 1
            logger.info("rid %s: P got its WAN destination after the request ended; MD keeps the KV",
                        client_text(self.result.rid))
            return
        counters["failed_after_end"] += 1
        logger.info("rid %s: after the request ended: %s; MD keeps nothing", client_text(self.result.rid),
                    delivery.fallback)
        if delivery.md_holds_room:
            await self.control.release(delivery.room)
        await self.p_control.drop_wan_destination(p_room)

    def withdraw_destination(self, p_room: Optional[int]) -> None:
        """Tell P (``p_room``) to stop waiting for its WAN destination (a registration still on
        its way then stops short of P)."""
        self._withdrawn = True
        self._spawn(self.p_control.drop_wan_destination(p_room), must_finish=True)

    # ------------------------------------------------------------------ MD's KV
    async def watch_ready(self) -> None:
        """Wait for MD's KV to land: MdReady, or MdNotReady (WAN_FAILED)."""
        started, timed_out = time.perf_counter(), False
        try:
            reply = await self.control.wait_ready(self.room, self.wan_timeout_s)
            status, reason = reply.status, reply.reason or ""
            if status == "pending":
                status, reason = "failed", f"not ready within {self.wan_timeout_s:.0f}s"
                timed_out = True
        except (BackendError, aiohttp.ClientError, asyncio.TimeoutError) as e:
            status, reason = "failed", f"control API: {e!r}"
            self._blame(e)  # MD's own fault (a bad signature, a drop) counts
        finally:  # landed, failed or given up on: off the link as far as the router knows
            self.wan_in_flight.settled(self.internal_rid)
        if status == "ready":
            self.result.mark("md_ready", self.t0)
            self.result.wan_ready_s = time.perf_counter() - started
            self.result.wan_bytes, self.result.wan_bytes_saved = self._planned_wan
            await self.queue.put((lifecycle.MdReady(), None))
        else:  # MD answered "failed" or not in time: the WAN's, not MD's; the next request tries again
            await self._not_ready(Fallback(Reason.WAN_FAILED, reason, timed_out=timed_out))

    async def _not_ready(self, fallback: Fallback) -> None:
        await self.queue.put((lifecycle.MdNotReady(fallback), None))

    # ------------------------------------------------------------------ handoff
    async def catch_up(self, handed: list[int], round_no: int) -> None:
        """One catch-up round: MD extends its cache by the ``handed`` eager tokens while RLD
        keeps decoding; then CutReady, and the lifecycle decides the next step."""
        try:
            await self.control.handoff(self.room, warmup_body(handed, self._rid(f"c{round_no}"), self.sampling))
        except (BackendError, aiohttp.ClientError, asyncio.TimeoutError) as e:
            self._blame(e)
            await self.queue.put((lifecycle.MainFailed(str(e)), None))
            return
        await self.queue.put((lifecycle.CutReady(), None))

    async def final_handoff(self, eager: list[int]) -> None:
        """The cut: MD continues the request (total budget) and streams it from position 0."""
        self._handoff_sent_t = time.perf_counter()
        rid = self._rid("m")
        body = handoff_body(eager, rid, self.sampling, self.extras)
        self.result.handoff_payload_bytes = len(json.dumps(body.to_json()))
        try:
            finished, checked = False, False
            limit = max_event_bytes(len(self.ids) + len(eager), self.max_new, self.extras)
            async for event in self.control.handoff_stream(
                    self.room, body, limit, stall_timeout_s=max(self.stall_timeout_s, 0) or None,
                    first_token_timeout_s=max(self.first_token_timeout_s, 0) or None):
                # Aborted by rid only once MD runs it: an abort that reaches MD's front end while
                # the request waits there (SGLang then ignores any later abort of that rid) would
                # be lost. Before that, closing the handoff stream is the abort (MD's control
                # API aborts a continuation whose reader went away).
                self.live_rids.setdefault(rid, self.main_url)
                finish = event.get("meta_info", {}).get("finish_reason")
                finished = finish is not None
                ids = event.get("output_ids", [])
                if not checked and len(ids) > len(eager):  # MD continues the request, it does not restart it
                    checked = True
                    if ids[:len(eager)] != eager:
                        raise BackendError("MD's output does not start with the eager tokens it was handed "
                                           "(an MD without the resume contract?)")
                await self._put_stream_event(lifecycle.MainTokens(len(ids), finish), event)
            if not finished:
                raise BackendError("MD stream ended without a finish reason")
        except (BackendError, aiohttp.ClientError, asyncio.TimeoutError) as e:
            self._blame(e)
            await self.queue.put((lifecycle.MainFailed(str(e)), None))

    def handoff_committed(self) -> None:
        """MD produced past the cut and owns the request: how long the client waited for it,
        and MD's room released (MD's cache keeps the prompt)."""
        self.result.handoff_stall_s = time.perf_counter() - self._handoff_sent_t
        self.release()

    # ------------------------------------------------------------------ the end
    def release(self, keep_kv: bool = False, must_finish: bool = True) -> None:
        """Release MD's room, if MD holds one. ``keep_kv``: the request finished, so KV still
        in flight is kept on MD (the session's next turn hits it). ``must_finish``: the request
        ends only once the release landed. With ``keep_kv`` P is told too (where it has a control
        API): nobody waits for the KV now, so P sends it behind the KV other requests wait for.
        While MD's registration is on its way, the room is released once MD answered it,
        without the request waiting for that."""
        if self._delivery is not None and not self._delivery.done():
            self._lingering.spawn(self._release_after_delivery(self._delivery, keep_kv))
            self.room = None
            return
        if self.room is not None:
            self._spawn(self.control.release(self.room, keep_kv=keep_kv), must_finish=must_finish)
            if keep_kv and self.p_control is not None:
                self._spawn(self.p_control.keep_only_wan(self.room), must_finish=must_finish)
            self.room = None

    async def _release_after_delivery(self, delivery_task: "asyncio.Future[_Delivery]", keep_kv: bool) -> None:
        delivery = await delivery_task
        if delivery.md_holds_room:
            await self.control.release(delivery.room, keep_kv=keep_kv and delivery.fallback is None)

    # ------------------------------------------------------------------ plumbing
    def _rid(self, suffix: str) -> str:
        return f"{self.internal_rid}-{suffix}"

    def _blame(self, error: BaseException) -> None:
        """MD's own failure (backends.server_at_fault) counts against MD's breaker; any other
        falls back to RLD and counts against nothing."""
        if server_at_fault(error):
            self.result.failed_backends.append(("main", self.main_url))
