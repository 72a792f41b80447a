"""P's second KV path: the pages MD lacks, over the WAN, chunk by chunk as prefill makes them.

Used by the ``pdd`` transfer backend (transfer_backend.py) beside its intra-DC path to RLD.
The scheduler thread never waits on the network::

    scheduler thread   PddKVSender.send(pages) -> offer(): remember the pool page ids
    copy thread        copies each page group that is complete (one chunk per layer) out of
                       the pool into host memory, as soon as prefill has produced it
    send thread        hands the copies to WanKvSender (blocks only on its window), then
                       TRANSFER_END after the last group

P keeps a request's pages only until the copy thread has them (the sender's poll() holds
Success until then), never until the WAN is done. Host copies are bounded by a staging
budget; a room that would exceed it, a WAN failure, or an abort on P fails that room's WAN
transfer: MD's room fails and RLD finishes the request. Nothing is lost either way.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import ssl
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

import numpy as np
import torch

from sglang_pdd.config import parse_host_port
from sglang_pdd.kv_channel.layout import KvLayout, KvPoolLayout, TransferPlan
from sglang_pdd.kv_channel.states import FailureReason, RoomState
from sglang_pdd.kv_channel.tp_relayout import SenderPart, TpShard, sender_part
from sglang_pdd.kv_channel.wan_sender import Transfer, WanKvSender
from sglang_pdd.sglang_glue.kv_pool_view import gather_pages, pool_layout

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WanDestination:
    """Where a request's KV goes over the WAN; the router puts it in the request's
    ``sampling_params.custom_params``: ``pdd_room``, ``pdd_wan_peer`` (HOST:PORT) and
    ``pdd_md_prefix_len`` (tokens MD already holds)."""

    md_room: int
    peer: tuple[str, int]
    md_prefix_len: int

    @classmethod
    def from_custom_params(cls, params) -> Optional["WanDestination"]:
        """None without ``pdd_wan_peer``; ValueError naming the field if malformed. The peer
        is NOT trusted here: WanFanout.open_room admits only P's --pdd-wan-peers."""
        if not isinstance(params, dict) or "pdd_wan_peer" not in params:
            return None
        room, prefix = params.get("pdd_room"), params.get("pdd_md_prefix_len", 0)
        if not isinstance(room, int) or isinstance(room, bool) or not 0 <= room < 1 << 63:
            raise ValueError(f"pdd_room must be an integer in 0..2^63-1, got {repr(room)[:40]}")
        if not isinstance(prefix, int) or isinstance(prefix, bool) or not 0 <= prefix < 1 << 31:
            raise ValueError(f"pdd_md_prefix_len must be an integer in 0..2^31-1, got {repr(prefix)[:40]}")
        return cls(room, parse_host_port("pdd_wan_peer", str(params["pdd_wan_peer"])[:300]), prefix)


@dataclass(eq=False)
class WanRoom:
    """One request's WAN leg on P. Shared by the scheduler thread and the fan-out threads
    (fields below ``plan`` only under ``WanFanout._lock``)."""

    dest: WanDestination
    rid: str
    first_offered_page: int  # pool pages arrive from this page on (RLD's own cached prefix ends here)
    plan: TransferPlan
    sender: Optional[WanKvSender] = None
    transfer: Optional[Transfer] = None
    pages: list = field(default_factory=list)  # (page ids, event) in arrival order
    pages_offered: int = 0
    all_offered: bool = False
    groups_copied: int = 0
    copying: bool = False
    queued: bool = False  # waiting for the copy thread
    aborted: bool = False
    reason: str = ""
    payloads: list = field(default_factory=list)  # host copies, alive until the transfer ends
    page_ids: list = field(default_factory=list)  # copy thread only: ``pages`` as host int64, so far
    staged_bytes: int = 0

    @property
    def pages_available(self) -> int:
        return self.first_offered_page + self.pages_offered

    @property
    def copy_done(self) -> bool:
        return self.groups_copied == self.plan.chunks_per_layer


class WanFanout:
    """The WAN fan-out of one prefill KV manager (one SGLang scheduler process)."""

    def __init__(
        self,
        key: bytes,
        name: str,
        *,
        num_streams: int = 4,
        timeout_s: float = 30.0,
        staging_bytes: int = 1 << 30,
        sender_factory: Optional[Callable[[tuple[str, int]], WanKvSender]] = None,
        allowed_peers: Iterable[tuple[str, int]] = (),
        ssl_context: Optional[ssl.SSLContext] = None,  # --pdd-wan-tls-*: TLS to MD
    ):
        self.key, self.name = key, name
        # P's --pdd-wan-peers: the only MDs it sends KV to, so also the bound on its senders
        # (one per peer, each with its streams and watchdog).
        self.allowed_peers = frozenset(allowed_peers)
        self.ssl_context = ssl_context
        self.num_streams, self.timeout_s = num_streams, timeout_s
        self.staging_bytes = staging_bytes
        self._sender_factory = sender_factory or self._new_sender
        self._senders: dict[tuple[str, int], WanKvSender] = {}
        self._pool = None
        self._pool_layout: Optional[KvPoolLayout] = None
        self._layout: Optional[KvLayout] = None  # MD's pool (TP 1): what BEGIN announces
        self._part: Optional[SenderPart] = None  # this TP rank's bytes of each token row, if not all
        self.shard = TpShard()
        self._lock = threading.Condition()
        self._copy_queue: "collections.deque[WanRoom]" = collections.deque()
        self._send_queue: "queue.Queue" = queue.Queue()  # bounded in bytes by staging_bytes
        self._live: list[WanRoom] = []  # rooms whose copies are still referenced
        self._staged = 0
        self._closed = False
        self.counters = collections.Counter()
        self._threads = [
            threading.Thread(target=self._copy_loop, name="pdd-wan-copy", daemon=True),
            threading.Thread(target=self._send_loop, name="pdd-wan-send", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def allows(self, peer: tuple[str, int]) -> bool:
        return peer in self.allowed_peers

    # ------------------------------------------------------------------ scheduler thread

    @property
    def sends(self) -> bool:
        """False on a TP rank whose KV heads another rank sends (e.g. rank > 0 of an MLA model):
        its requests need no WAN leg. Known once the pool is attached."""
        return self._pool is None or self._layout is not None

    def attach_pool(self, pool, page_size: int, shard: TpShard = TpShard()) -> None:
        """The token pool to copy from (once; the first request brings it), and where it sits
        in P's TP group: with TP > 1 this rank sends its heads' bytes of each row (tp_relayout)."""
        if self._pool is None:
            local = pool_layout(pool, page_size)
            part = sender_part(local.kind, shard, local.token_bytes)
            self.shard, self._pool_layout = shard, local
            if part is None:
                self._layout, self._part = None, None
                logger.info("WAN fan-out: TP rank %d of %d holds replicas of KV heads another rank sends; "
                            "it sends nothing", shard.rank, shard.size)
            else:
                self._part = None if part.is_whole else part
                self._layout = dataclasses.replace(local, token_bytes=part.dst_row_bytes).wire()
                logger.info("WAN fan-out: KV pool %s%s", self._layout.describe(), "" if self._part is None else
                            f"; TP rank {shard.rank} of {shard.size} sends row bytes "
                            f"[{part.row.offset}, {part.row.offset + part.row.width}) as slice {part.row.index} "
                            f"of {part.row.count}")
            self._pool = pool

    def open_room(self, dest: WanDestination, *, rid: str, token_ids: Sequence[int],
                  first_offered_page: int) -> Optional[WanRoom]:
        """Start a request's WAN transfer (never blocks on the network). None if it cannot
        be served; MD's room then fails and RLD finishes the request."""
        if self._pool is None:
            raise RuntimeError("attach_pool() first")
        if self._layout is None:
            return None  # this rank sends nothing (callers check ``sends`` first)
        if not self.allows(dest.peer):
            self.counters["refused_peer"] += 1
            logger.warning("rid %s: WAN destination %s:%s is not one of P's --pdd-wan-peers; not sending KV "
                           "there, RLD finishes", rid, *dest.peer)
            return None
        prompt_len = len(token_ids)
        # MD extends at least the last token; both ends cut on the same page boundary (MD's
        # radix cache holds whole pages only), so P sends from the page MD's prefix ends on.
        start = self._pool_layout.align_down(min(dest.md_prefix_len, prompt_len - 1))
        room = WanRoom(dest, rid, first_offered_page, TransferPlan.build(self._layout, prompt_len, start))
        if room.plan.first_page < first_offered_page:
            # The pages in between stay on P but SGLang's sender never sees them (the RLD
            # already held them); copying from outside the sender's pages is not safe.
            self.counters["refused_rld_prefix"] += 1
            logger.warning("rid %s: MD needs KV from token %d but P sends from %d (RLD's cached prefix); "
                           "WAN transfer not started, RLD finishes", rid, start, first_offered_page)
            return None
        try:
            room.sender = self._sender(dest.peer)
            room.transfer = room.sender.begin_transfer(
                dest.md_room, self._layout, prompt_len, start, request_id=rid,
                token_ids=list(token_ids), timeout=self.timeout_s,
                row=None if self._part is None else self._part.row)
            room.plan = room.transfer.plan  # cut into chunks by the sender's chunk size
        except Exception as e:  # noqa: BLE001 — e.g. a duplicate room: refuse this one, keep serving
            self.counters["refused_begin"] += 1
            logger.warning("rid %s: WAN transfer to room %s at %s:%s not started: %s",
                           rid, dest.md_room, *dest.peer, e)
            return None
        self.counters["rooms"] += 1
        return room

    def offer(self, room: WanRoom, pages: np.ndarray, event=None, last: bool = False) -> None:
        """The next pool pages of the request (in order), produced by the forward that
        ``event`` (if any) marks. Cheap: the copy happens on the copy thread."""
        with self._lock:
            if room.aborted:
                return
            room.pages.append((pages, event))
            room.pages_offered += len(pages)
            room.all_offered = room.all_offered or last
            if not room.queued and not room.copying:
                room.queued = True
                self._copy_queue.append(room)
                self._lock.notify_all()

    def abort(self, room: WanRoom, reason: str) -> None:
        """Stop this room now (P is about to free its pages): later copies are discarded."""
        with self._lock:
            self._abort_locked(room, reason)

    def may_free_pages(self, room: WanRoom) -> bool:
        """Called once P's request is done with its pages (its sender is terminal): True once
        they may be freed — all copied, or the room dropped and no copy in progress. A room
        whose pages did not all arrive is dropped here (the request ended early)."""
        with self._lock:
            if not room.aborted and room.all_offered and room.copy_done:
                return True
            if not room.aborted and not room.all_offered:
                self._abort_locked(room, "P's request ended before all of its KV was produced")
            return room.aborted and not room.copying and not room.queued

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._send_queue.put(None)
        for s in self._senders.values():
            s.close()

    def stats(self) -> dict:
        with self._lock:
            return dict(self.counters, staged_bytes=self._staged, live_rooms=len(self._live))

    # ------------------------------------------------------------------ internals

    def _new_sender(self, peer: tuple[str, int]) -> WanKvSender:
        return WanKvSender(peer, self.key, name=self.name, num_streams=self.num_streams,
                           transfer_timeout=self.timeout_s, idle_timeout=min(10.0, self.timeout_s),
                           ssl_context=self.ssl_context)

    def _sender(self, peer: tuple[str, int]) -> WanKvSender:
        sender = self._senders.get(peer)
        if sender is None:
            sender = self._senders[peer] = self._sender_factory(peer)
        return sender

    def _abort_locked(self, room: WanRoom, reason: str) -> None:
        if room.aborted:
            return
        room.aborted, room.reason = True, reason
        self.counters["aborted"] += 1
        if room.transfer is not None:
            room.sender.abort(room.dest.md_room, reason)
            if room not in self._live:  # else the reaper forgets it once its copies are unused
                room.sender.release(room.dest.md_room)
        # A layout mismatch is a deployment error (P and MD disagree), not a WAN hiccup.
        level = logging.ERROR if FailureReason.LAYOUT_MISMATCH in reason else logging.INFO
        logger.log(level, "rid %s: WAN transfer to room %s dropped: %s", room.rid, room.dest.md_room, reason)

    def _copy_loop(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._copy_queue or self._closed)
                if self._closed:
                    return
                room = self._copy_queue.popleft()
                room.queued = False
                if room.aborted:
                    continue
                first = room.groups_copied
                ready = room.plan.groups_ready(room.pages_available)
                batches = list(room.pages)
                room.copying = ready > first
            if ready <= first:
                continue
            try:
                copies = self._copy_groups(room, batches, first, ready)
            except Exception as e:  # noqa: BLE001 — a failed copy drops this room only
                logger.exception("rid %s: copying KV for the WAN failed", room.rid)
                copies, err = None, f"copy failed: {e}"
            with self._lock:
                room.copying = False
                if copies is None or room.aborted:
                    # Aborted meanwhile: the pages may have been freed mid-copy; never send them.
                    self._abort_locked(room, room.reason or err)
                    continue
                nbytes = sum(c.numel() for _, c in copies)
                if self._staged + nbytes > self.staging_bytes:
                    self.counters["dropped_staging_budget"] += 1
                    self._abort_locked(room, f"staging budget of {self.staging_bytes} bytes exhausted")
                    continue
                self._staged += nbytes
                room.staged_bytes += nbytes
                room.payloads.extend(c for _, c in copies)
                if room not in self._live:
                    self._live.append(room)
                room.groups_copied = ready
                done = room.copy_done
                if room.plan.groups_ready(room.pages_available) > ready and not room.queued:
                    room.queued = True  # more pages arrived while copying
                    self._copy_queue.append(room)
            for index, data in copies:
                self._send_queue.put((room, index, data))
            if done:
                self._send_queue.put((room, None, None))

    def _copy_groups(self, room: WanRoom, batches, first: int, ready: int) -> list[tuple[int, torch.Tensor]]:
        for pages, event in batches[len(room.page_ids):]:  # each batch is converted once
            if event is not None:
                event.synchronize()  # the forward writing these pages (and their ids) has finished
            room.page_ids.append(np.asarray(pages.cpu() if isinstance(pages, torch.Tensor) else pages,
                                            dtype=np.int64))
        page_ids = torch.from_numpy(np.concatenate(room.page_ids)) if room.page_ids else torch.empty(0, dtype=torch.int64)
        out = []
        for group in range(first, ready):
            specs = room.plan.group_chunks(group)
            lo = specs[0].page_start - room.first_offered_page
            slots = page_ids[lo : lo + specs[0].page_count]
            src_row = None if self._part is None else (self._part.src_offset, self._part.row.width)
            rows = gather_pages(self._pool, slots, self._layout.page_size, src_row)  # one host copy per buffer
            out.extend((spec.index, rows[spec.layer].cpu()) for spec in specs)
        return out

    def _send_loop(self) -> None:
        while True:
            try:
                item = self._send_queue.get(timeout=0.2)
            except queue.Empty:
                item = ()
            self._reap()
            if item is None:
                return
            if not item:
                continue
            room, index, data = item
            if room.aborted or room.transfer is None:
                continue
            try:
                if index is None:
                    room.transfer.finish()
                    self.counters["finished"] += 1
                    self.counters["bytes"] += room.plan.total_bytes
                elif not room.transfer.send_chunk(index, data.numpy()):
                    with self._lock:
                        self._abort_locked(room, f"WAN transfer failed: {room.transfer.failure_reason} "
                                                 f"{room.transfer.failure_detail}".strip())
            except Exception as e:  # noqa: BLE001 — this thread serves every room: never let it die
                logger.exception("rid %s: WAN send failed", room.rid)
                with self._lock:
                    self._abort_locked(room, f"WAN send failed: {e}")

    def _reap(self) -> None:
        """Free the host copies of rooms whose WAN transfer ended (the sender no longer
        reads them), and forget the room on the sender."""
        with self._lock:
            keep = []
            for room in self._live:
                state = room.transfer.poll() if room.transfer is not None else None
                if state is not None and not state.is_terminal:
                    keep.append(room)
                    continue
                self._staged -= room.staged_bytes
                room.staged_bytes, room.payloads = 0, []
                if state is RoomState.FAILED and not room.aborted:
                    room.aborted, room.reason = True, room.transfer.failure_reason or FailureReason.ABORTED
                    self.counters["failed"] += 1
                    if room.reason == FailureReason.LAYOUT_MISMATCH:  # a deployment error, not a WAN hiccup
                        logger.error("rid %s: WAN transfer to room %s failed: %s: %s", room.rid, room.dest.md_room,
                                     room.reason, room.transfer.failure_detail)
                if room.sender is not None:
                    room.sender.release(room.dest.md_room)
            self._live = keep
