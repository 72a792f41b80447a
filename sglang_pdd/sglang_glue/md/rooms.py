"""One MD TP rank's rooms: the room table (radix_drc.rooms, whose state machine decides each
room's course), where each room's KV lands (ingest.py), the WAN receiver's side of it, and
the wake-ups of control threads waiting for a room. Scheduler thread only; every TP rank
calls the same operations in the same order (driver.py), so the ranks stay alike.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from sglang_pdd.admission import parse_networks
from sglang_pdd.config import PddConfig, md_staging_bytes
from sglang_pdd.kv_channel.contract import RoomState
from sglang_pdd.protocol import (KvSendersReply, KvSendersRequest, RegisterReply, RegisterRequest, ReleaseReply,
                                 ReleaseRequest)
from sglang_pdd.radix_drc.room_state import Failure, FailReason
from sglang_pdd.radix_drc.rooms import DrcRoom, DrcRoomTable, RoomReleased
from sglang_pdd.radix_drc.stats import DrcStats
from sglang_pdd.sglang_glue.md.ingest import InFlightBudget, Landing, RoomRefused
from sglang_pdd.sglang_glue.md.pages import PageReleases

logger = logging.getLogger(__name__)


class RankRooms:
    def __init__(self, cfg: PddConfig, ops, receiver, tp_size: int, page_size: int,
                 wake: Callable[[], None] = lambda: None):
        self.ops, self.receiver, self.tp_size = ops, receiver, tp_size
        self.wan_timeout_s = cfg.wan_timeout_s
        self.ingest_mode = cfg.md_ingest
        self.table = DrcRoomTable(ops, ttl_s=cfg.wan_timeout_s * 2, page_size=page_size)
        self.budget = InFlightBudget(md_staging_bytes(cfg.md_staging_mb, getattr(ops.pool, "size", 0),
                                                      ops.pool_layout.bytes_per_token))
        self.pages = PageReleases(receiver, ops.free, on_outcome=wake)
        self.landings: dict[int, Landing] = {}
        self.unregistered: dict[int, Landing] = {}  # pages of a registration only this rank refused
        self.ready_events: dict[int, threading.Event] = {}
        self.counters = {"rooms_registered": 0, "rooms_ready": 0, "rooms_failed": 0, "rooms_refused": 0}
        self.drc_stats = DrcStats()
        # what a request costs on the WAN: the router's estimate, and MD's counts of bytes landed
        self.kv_size = ops.pool_layout.wan_kv_size
        self.kv_bytes_per_token = self.kv_size.per_token

    # ---- commands (rank 0's control threads, applied on every rank; driver.MdCommand)
    def register(self, req: RegisterRequest, now: Optional[float] = None) -> RegisterReply:
        t0 = time.perf_counter()
        try:
            return self._register(req.room, req.token_ids, req.use_cache, time.monotonic() if now is None else now)
        finally:
            self._record_stall("register", time.perf_counter() - t0)

    def _register(self, room: int, token_ids: list[int], use_cache: bool, now: float) -> RegisterReply:
        try:
            entry = self.table.register(room, token_ids, now, use_cache=use_cache)
        except RoomReleased:
            self.counters["late_registrations_refused"] = self.counters.get("late_registrations_refused", 0) + 1
            raise
        landing = Landing.plan(self.ops.pool_layout, len(token_ids), entry.cached_len)
        try:
            self._take_budget(room, landing.nbytes)
        except RoomRefused:
            self.counters["rooms_refused"] += 1
            self.table.unregister(room)
            raise
        try:
            if self.ingest_mode == "staged":
                landing.into_host()
            else:
                slots = self.ops.reserve(landing.num_tokens, landing.window_tokens)
                if slots is None:
                    self.counters["rooms_refused"] += 1
                    window = f" ({landing.window_tokens} of them with sliding-window KV)" if landing.window_tokens else ""
                    raise RoomRefused(f"room {room} refused: MD's KV pool cannot hold {landing.num_tokens} more "
                                      f"tokens{window} now ({self.ops.allocator.available_size()} free after "
                                      f"eviction)")
                landing.into_pool(self.ops.pool, slots)
                self.pages.hold(landing.num_tokens, landing.window_tokens)
            self.receiver.register_room(room, self.ops.layout, len(token_ids), landing.write,
                                        decode_prefix_len=entry.cached_len, token_ids=token_ids,
                                        timeout=self.wan_timeout_s)
        except Exception:
            # Not registered in the receiver: nothing writes into the landing; free it now.
            self.budget.give_back(landing.nbytes)
            if landing.slots is not None:
                if self.tp_size == 1:
                    self.pages.free_now(landing)
                else:  # the other ranks may have made it: free with their undo, in step
                    self.unregistered[room] = landing
            self.table.unregister(room)
            raise
        self.landings[room] = landing
        self.ready_events[room] = threading.Event()
        self.counters["rooms_registered"] += 1
        self.drc_stats.record_lookup(len(token_ids), entry.cached_len)
        return RegisterReply(room, entry.cached_len, prompt_tokens=len(token_ids),
                             wan_peer="%s:%d" % self.receiver.address,  # rank r listens on its port + r
                             tp_size=self.tp_size, kv_bytes_per_token=self.kv_bytes_per_token,
                             kv_layout=self.ops.pool_layout.to_dict(), **self.window_report())

    def window_report(self) -> dict:
        """The sliding window's part of MD's KV size, for a pool that has one (KvSize)."""
        size = self.kv_size
        if not size.window_tokens:
            return {}
        return {"kv_window_tokens": size.window_tokens, "kv_window_bytes_per_token": size.window_bytes_per_token}

    def release(self, req: ReleaseRequest) -> ReleaseReply:
        return ReleaseReply(self._release(req.room, req.keep_kv))

    def _release(self, room: int, keep_kv: bool = False) -> bool:
        entry = self.table.rooms.get(room)
        if keep_kv and entry is not None and entry.state.phase.landing:
            # The request ended on RLD while its KV was still crossing the WAN: let it land
            # and enter the radix cache, so the session's next turn finds it on MD.
            self.counters["rooms_kept_in_flight"] = self.counters.get("rooms_kept_in_flight", 0) + 1
            return self.table.release(room, keep_pending_kv=True)
        if entry is not None and entry.state.phase.landing:  # its KV stops where it got to
            self._count("rooms_cancelled_landing", "kv_bytes_cancelled", entry)
        self.receiver.abort(room, "released by the router")  # no further writes into its landing
        self._forget_in_receiver(room)
        released = self.table.release(room)
        self._forget(room)
        return released

    def _take_budget(self, room: int, nbytes: int) -> None:
        """The staging budget for a room whose request waits for it. Rooms landing only to fill
        the cache (their request ended on RLD: released with keep_kv) come after it: they give
        theirs up, newest first (the oldest is nearest to landing), until the room fits. Every
        rank runs the same registrations on the same rooms, so every rank drops the same."""
        try:
            self.budget.take(room, nbytes)
            return
        except RoomRefused:
            kept = self.table.kept_for_cache()
            if not kept:
                raise
        for other in reversed(kept):
            self._release(other)
            self.counters["rooms_kept_dropped_for_room"] = self.counters.get("rooms_kept_dropped_for_room", 0) + 1
            if self.budget.used_bytes + nbytes <= self.budget.limit_bytes:
                break
        self.budget.take(room, nbytes)

    def _count(self, rooms: str, nbytes: str, entry: DrcRoom) -> None:
        """One more room in ``rooms``, its uncached suffix's KV bytes in ``nbytes``."""
        self.counters[rooms] = self.counters.get(rooms, 0) + 1
        suffix = self.kv_size.wan_bytes(len(entry.token_ids), entry.cached_len, self.ops.pool_layout.page_size)
        self.counters[nbytes] = self.counters.get(nbytes, 0) + suffix

    def drop_rooms_kept_for_cache(self) -> int:
        """A cache flush is coming: KV landing only to enter the cache (its request ended on
        RLD) is moot, so those rooms go now, as if released without keep_kv. Scheduler thread,
        every TP rank in the same iteration (SGLang hands the flush to every rank)."""
        kept = self.table.kept_for_cache()
        for room in kept:
            self._release(room)
        return len(kept)

    def announce_kv_senders(self, req: KvSendersRequest) -> KvSendersReply:
        """The router's P hosts: known peers of this rank's WAN receiver (admission.py)."""
        return KvSendersReply(self.receiver.announce_senders(parse_networks(req.sources)))

    # ---- registrations the TP group did not agree on
    def undo_registration(self, room: int) -> RoomRefused:
        """Made here, refused on another rank: undone here, its pages back with every rank's undo."""
        self.receiver.abort(room, "refused on another MD TP rank")
        landing = self.landings.pop(room, None)
        if landing is not None:
            self.budget.give_back(landing.nbytes)
        record = self.pages.queue(room, landing, always=True)
        self.pages.let_go_in_receiver(room, record)
        self.table.unregister(room)
        self._forget(room)
        self.counters["rooms_registered"] -= 1
        self.counters["rooms_refused"] += 1
        return RoomRefused(f"room {room} refused: another MD TP rank could not register it")

    def drop_refused(self, room: int) -> None:
        """Refused here (made elsewhere): pages it had reserved come back with the others' undo."""
        record = self.pages.queue(room, self.unregistered.pop(room, None), always=True)
        record.outcome = True  # this rank's receiver never had the room

    # ---- the group's decisions on rooms whose KV is landing
    def needs_iteration(self) -> bool:
        """Whether the next scheduler iteration has a decision to take now: a room this rank's
        receiver has settled (landed or failed) that the group has not completed yet (with TP,
        the other ranks' shares may still be landing), or pages whose receiver let go. KV that
        is still crossing the WAN is not such work: the receiver wakes the scheduler when a room
        settles (``on_settled``) and the release thread when pages are let go, so MD sleeps
        meanwhile instead of spinning a core for as long as the WAN takes."""
        return (any(self.poll(entry.room).is_terminal for entry in self.table.pending())
                or any(record.outcome is not None for record in self.pages.releasing))

    def poll(self, room: int) -> RoomState:
        try:
            return self.receiver.poll(room)
        except Exception:  # noqa: BLE001 — never skip the collective; this rank votes 'failed'
            logger.exception("room %s: polling the WAN receiver failed", room)
            return RoomState.FAILED

    def completed(self, room: int, now: float) -> None:
        t0 = time.perf_counter()
        self._finish(self._complete(room, now))
        self._record_stall("complete", time.perf_counter() - t0)

    def failed(self, room: int, local_state: RoomState) -> None:
        if local_state is RoomState.FAILED:
            failure = Failure.wan(*self.receiver.failure(room))
        else:
            failure = Failure(FailReason.TP_RANK)
        self._finish(self.table.fail(room, failure))

    def expired(self, room: int) -> None:
        if room in self.landings:  # expired in flight: stop the receiver's writes first
            self.receiver.abort(room, "expired on MD")
            self._forget_in_receiver(room)
        self._forget(room)

    def _complete(self, room: int, now: float) -> DrcRoom:
        """All of a room's KV is in (the receiver has no writer left): into the tree."""
        landing = self.landings.pop(room)
        self.budget.give_back(landing.nbytes)
        if landing.staged is not None:  # staged ingest: copy the room now, on this thread
            slots = self.ops.reserve(landing.num_tokens, landing.window_tokens)
            if slots is None:
                return self.table.fail(room, Failure(FailReason.DRC_FULL,
                                                     f"cannot allocate {landing.num_tokens} KV slots"))
            landing.flush_staged(self.ops.pool, slots)
        else:
            self.pages.hand_to_tree(landing)  # from here the tree (or ingest's frees) owns them
        return self.table.complete(room, landing.slots, now)

    def _finish(self, entry: DrcRoom) -> None:
        room = entry.room
        if entry.state.landed:
            self.counters["rooms_ready"] += 1
            received = len(entry.token_ids) - entry.cached_len
            nbytes = self.kv_size.wan_bytes(len(entry.token_ids), entry.cached_len, self.ops.pool_layout.page_size)
            self.drc_stats.record_ingest(received, nbytes, entry.cached_len, self.kv_bytes_per_token)
            if entry.state.phase.terminal:  # released with keep before it landed: it warmed the cache
                self._count("rooms_kept_landed", "kv_bytes_kept_landed", entry)
        else:
            self.counters["rooms_failed"] += 1
            logger.warning("room %s failed: %s", room, entry.reason)
        self._forget_in_receiver(room)
        if entry.state.phase.terminal:  # released by the router meanwhile: nobody waits for it
            self._forget(room)
        else:
            self.ready_events[room].set()

    def _forget_in_receiver(self, room: int) -> None:
        """Drop the receiver's record of a room off the scheduler thread: release_room waits
        for a chunk still being written (seconds on a slow WAN) and, past its timeout, cuts
        the streams that other rooms share. A landing still held (the room failed or was
        released in flight) goes with it: its slots are freed only once nothing writes there,
        on any rank."""
        landing = self.landings.pop(room, None)
        if landing is not None:
            self.budget.give_back(landing.nbytes)
        self.pages.let_go_in_receiver(room, self.pages.queue(room, landing))

    def _forget(self, room: int) -> None:
        event = self.ready_events.pop(room, None)
        if event is not None:
            event.set()

    def _record_stall(self, what: str, seconds: float) -> None:
        """Scheduler-thread time spent on a room (decode waits meanwhile): in /pdd/stats."""
        ms = seconds * 1000
        self.counters[f"{what}_ms_total"] = round(self.counters.get(f"{what}_ms_total", 0.0) + ms, 3)
        self.counters[f"{what}_ms_max"] = round(max(self.counters.get(f"{what}_ms_max", 0.0), ms), 3)
