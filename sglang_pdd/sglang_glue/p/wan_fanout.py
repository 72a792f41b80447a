"""P's second KV path: the pages MD lacks, over the WAN, chunk by chunk as prefill makes them.

Used by the ``pdd`` transfer backend (transfer_backend.py) beside its intra-DC path to RLD.
The scheduler thread never waits on the network::

    scheduler thread   PddKVSender.send(pages) -> offer(): remember the pool page ids
    copy thread        copies each page group that is complete (one chunk per layer) out of
                       the pool into host memory, as soon as prefill has produced it
    send thread        hands the copies to the share's KvSender (kv_channel/contract.py;
                       blocks only on its window), then TRANSFER_END after the last group;
                       rooms someone waits for first, rooms kept only for MD's cache
                       (``keep_only``) after them, rooms of a kind in turns
                       (kv_channel/send_order.py, as the senders order them)

With MD on ``--tp b`` (the destination's ``md_tp``) a room is a set of *shares*, one per MD
rank this P rank feeds (tp_relayout.sender_parts: every MD holder of a head gets it over the
WAN): each share has its own sender (MD rank r listens on the peer's port + r), transfer (its
row slice) and gather (this rank's bytes for that MD rank); the room fails if any share fails.

P keeps a request's pages only until the copy thread has them (the sender's poll() holds
Success until then), never until the WAN is done. Host copies are bounded by a staging
budget; a room that would exceed it, a WAN failure, or an abort on P fails that room's WAN
transfer: MD's room fails and RLD finishes the request. Nothing is lost either way.

A room's phase, the copy thread's hold on it and why it was dropped change only in
``WanFanout._machine.step``, through the pure state machine in sglang_glue/p/fanout_room.py.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import ssl
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence, Union

import numpy as np
import torch

from sglang_pdd.config import parse_host_port
from sglang_pdd.machine import Driver
from sglang_pdd.sglang_glue.p import fanout_room
from sglang_pdd.sglang_glue.p.fanout_room import CopyHold, DropReason, FanoutState
from sglang_pdd.kv_channel.layout import KvLayout, KvPoolLayout, RowSlice, TransferPlan
from sglang_pdd.kv_channel.contract import FailureReason, KvSender, KvTransfer, RoomState
from sglang_pdd.kv_channel.send_order import SendOrder
from sglang_pdd.kv_channel.tp_relayout import SenderPart, TpLayoutError, TpShard, sender_parts
from sglang_pdd.kv_channel.wan_sender import WanKvSender  # the contract's implementation, built in _new_sender only
from sglang_pdd.protocol import MAX_MD_TP, LegParams, check_md_tp
from sglang_pdd.sglang_glue.kv_pool_view import gather_buffer_pages, gather_pages, pool_layout

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WanDestination:
    """Where a request's KV goes over the WAN; the router puts it in the request's
    ``sampling_params.custom_params``: ``pdd_room``, ``pdd_wan_peer`` (HOST:PORT, MD rank 0's
    WAN receiver), ``pdd_md_prefix_len`` (tokens MD already holds) and ``pdd_md_tp`` (MD's TP
    size, default 1: MD rank r's receiver listens on the peer's port + r)."""

    md_room: int
    peer: tuple[str, int]
    md_prefix_len: int
    md_tp: int = 1

    def __post_init__(self):
        check_md_tp(self.md_tp)
        if self.peer[1] + self.md_tp - 1 > 65535:
            raise ValueError(f"MD's {self.md_tp} rank ports from {self.peer[1]} on pass 65535")

    def rank_peer(self, md_rank: int) -> tuple[str, int]:
        """MD rank ``md_rank``'s WAN receiver."""
        return self.peer[0], self.peer[1] + md_rank

    @classmethod
    def from_custom_params(cls, params) -> Optional["WanDestination"]:
        """None without ``pdd_wan_peer``; ValueError naming the field if malformed (the
        protocol's LegParams). The peer is NOT trusted here: WanFanout.open_room admits only
        P's --pdd-wan-peers."""
        leg = LegParams.from_custom_params(params)
        if leg is None:
            return None
        peer = parse_host_port(LegParams.wire_key("wan_peer"), leg.wan_peer)
        try:
            return cls(leg.room, peer, leg.md_prefix_len, leg.md_tp)
        except ValueError as e:
            raise ValueError(f"pdd_md_tp: {e}") from None


@dataclass(frozen=True)
class RankShareSpec:
    """What this P rank sends of every room to one MD rank (for one MD TP size)."""

    md_rank: int
    layout: KvLayout  # that MD rank's whole-row layout: what BEGIN announces
    row: Optional[RowSlice]  # the slice of MD's rows on the wire; None: all of each row (one sender)
    src_row: Optional[tuple[int, int]]  # (offset, width) of P's rows to gather; None: all of each row

    @classmethod
    def of(cls, md_rank: int, part: SenderPart, local: KvPoolLayout) -> "RankShareSpec":
        whole_src = part.src_offset == 0 and part.row.width == local.token_bytes
        return cls(md_rank, dataclasses.replace(local, token_bytes=part.dst_row_bytes).wire(),
                   None if part.row.is_whole(part.dst_row_bytes) else part.row,
                   None if whole_src else (part.src_offset, part.row.width))


@dataclass(eq=False)
class RankShare:
    """One room's transfer to one MD rank (its own sender, plan and copy progress)."""

    spec: RankShareSpec
    peer: tuple[str, int]
    plan: TransferPlan
    sender: Optional[KvSender] = None
    transfer: Optional[KvTransfer] = None
    groups_copied: int = 0  # under WanFanout._lock

    @property
    def copy_done(self) -> bool:
        return self.groups_copied == self.plan.chunks_per_layer


@dataclass(eq=False)
class WanRoom:
    """One request's WAN transfer on P: one share per MD rank this P rank sends to. Shared by the
    scheduler thread and the fan-out threads (fields below ``shares`` only under
    ``WanFanout._lock``). It fails as a whole: a failed share aborts the others."""

    dest: WanDestination
    rid: str
    first_offered_page: int  # pool pages arrive from this page on (RLD's own cached prefix ends here)
    shares: list  # [RankShare]
    # Phase, copy hold, progress and drop reason (sglang_glue/p/fanout_room.py); replaced only
    # by WanFanout._machine.step.
    state: FanoutState
    pages: list = field(default_factory=list)  # (page ids, event) in arrival order
    payloads: list = field(default_factory=list)  # host copies, alive until the transfers end
    page_ids: list = field(default_factory=list)  # copy thread only: ``pages`` as host int64, so far
    staged_bytes: int = 0  # what ``payloads`` count against the staging budget

    @property
    def pages_available(self) -> int:
        return self.first_offered_page + self.state.pages_offered

    @property
    def copy_done(self) -> bool:
        return all(share.copy_done for share in self.shares)

    def shares_ready(self) -> list:
        """(share, first group, groups ready) for the shares with page groups left to copy."""
        return [(share, share.groups_copied, ready) for share in self.shares
                if (ready := share.plan.groups_ready(self.pages_available)) > share.groups_copied]


@dataclass(frozen=True, eq=False)
class SendChunk:
    """For the send thread: one chunk's host copy, to the share's sender."""
    room: WanRoom
    share: RankShare
    index: int
    data: torch.Tensor


@dataclass(frozen=True, eq=False)
class SendEnd:
    """For the send thread: the share's last chunk is queued; send TRANSFER_END."""
    room: WanRoom
    share: RankShare


SendItem = Union[SendChunk, SendEnd]


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
        sender_factory: Optional[Callable[[tuple[str, int]], KvSender]] = None,
        allowed_peers: Iterable[tuple[str, int]] = (),
        ssl_context: Optional[ssl.SSLContext] = None,  # --pdd-wan-tls-*: TLS to MD
        max_md_tp: int = MAX_MD_TP,  # --pdd-max-md-tp: MD ranks (WAN ports) one destination may name
    ):
        self.max_md_tp = max_md_tp
        self.key, self.name = key, name
        # P's --pdd-wan-peers: the only MDs it sends KV to (rank 0's address; MD rank r's is
        # port + r), so also the bound on its senders (one per MD rank, each with its streams).
        self.allowed_peers = frozenset(allowed_peers)
        self.ssl_context = ssl_context
        self.num_streams, self.timeout_s = num_streams, timeout_s
        self.staging_bytes = staging_bytes
        self._sender_factory = sender_factory or self._new_sender
        self._senders: dict[tuple[str, int], KvSender] = {}
        self._pool = None
        self._pool_layout: Optional[KvPoolLayout] = None
        self._shares_by_md_tp: dict[int, object] = {}  # md_tp -> [RankShareSpec] or the TpLayoutError
        self.shard = TpShard()
        self._lock = threading.Condition()
        self._copy_queue: "collections.deque[WanRoom]" = collections.deque()
        # For the send thread, under _lock, by MD room: bounded in bytes by staging_bytes
        self._send_order: SendOrder[SendItem] = SendOrder()
        self._live: list[WanRoom] = []  # rooms whose copies are still referenced
        # Under _lock: the only way a room's state changes (step(room, event[, failed share])).
        self._machine = Driver(fanout_room.transition, {fanout_room.QueueCopy: self._queue_copy,
                                                        fanout_room.AbortSendRooms: self._abort_shares,
                                                        fanout_room.CountSent: self._count_sent})
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
        """Whether ``peer`` (MD rank 0's WAN address) is one of P's --pdd-wan-peers; its other
        ranks' addresses (port + r, r < md_tp) are derived from it, never taken from a request."""
        return peer in self.allowed_peers

    # ------------------------------------------------------------------ scheduler thread

    @property
    def sends(self) -> bool:
        """To an MD on TP 1 (see ``sends_to``)."""
        return self.sends_to(1)

    def sends_to(self, md_tp: int) -> bool:
        """False on a TP rank whose KV heads other P ranks send to an MD on TP ``md_tp`` (e.g.
        rank > 0 of an MLA model for MD TP 1): its requests to such an MD need no WAN share. Known
        once the pool is attached (True before; also True for an MD TP the heads do not shard
        over, so that ``open_room`` refuses it by name)."""
        shares = self._shares(md_tp)
        return shares is None or not isinstance(shares, list) or bool(shares)

    def attach_pool(self, pool, page_size: int, shard: TpShard = TpShard(), window: int = 0) -> None:
        """The token pool to copy from (once; the first request brings it), and where it sits
        in P's TP group: with TP > 1 this rank sends its heads' bytes of each row (tp_relayout).
        ``window``: the model's sliding window (an SWAKVPool's sliding layers send only it)."""
        if self._pool is None:
            self.shard, self._pool_layout = shard, pool_layout(pool, page_size, window)
            shares = self._shares(1)
            if isinstance(shares, TpLayoutError):  # P's own pool does not shard as SGLang says: a bug
                self._pool_layout = None
                raise shares
            self._pool = pool
            if not shares:
                logger.info("WAN fan-out: TP rank %d of %d holds replicas of KV heads another rank sends "
                            "to an MD on TP 1", shard.rank, shard.size)
            else:
                row = shares[0].row
                logger.info("WAN fan-out: KV pool %s%s", shares[0].layout.describe(), "" if row is None
                            else f"; TP rank {shard.rank} of {shard.size} sends row bytes [{row.offset}, "
                                 f"{row.offset + row.width}) as slice {row.index} of {row.count} to an MD on TP 1")

    def _shares(self, md_tp: int):
        """This rank's RankShareSpecs to an MD on TP ``md_tp`` (cached), the TpLayoutError if its heads
        do not shard over ``md_tp``, or None before the pool is attached."""
        if self._pool_layout is None:
            return None
        shares = self._shares_by_md_tp.get(md_tp)
        if shares is None:
            local = self._pool_layout
            try:
                parts = sender_parts(local.kind, self.shard, local.token_bytes, md_tp)
            except TpLayoutError as e:
                shares = e
            else:
                shares = [RankShareSpec.of(md_rank, part, local) for md_rank, part in parts]
            self._shares_by_md_tp[md_tp] = shares
        return shares

    def open_room(self, dest: WanDestination, *, rid: str, token_ids: Sequence[int],
                  first_offered_page: int) -> Optional[WanRoom]:
        """Start a request's WAN transfer (never blocks on the network). None if it cannot
        be served; MD's room then fails and RLD finishes the request."""
        if self._pool is None:
            raise RuntimeError("attach_pool() first")
        if dest.md_tp > self.max_md_tp:
            self.counters["refused_md_tp"] += 1
            logger.warning("rid %s: MD's TP %d is over P's --pdd-max-md-tp %d; not sending KV, RLD finishes",
                           rid, dest.md_tp, self.max_md_tp)
            return None
        specs = self._shares(dest.md_tp)
        if isinstance(specs, TpLayoutError):
            self.counters["refused_md_tp"] += 1
            logger.warning("rid %s: MD's TP %d does not fit this model's KV heads (%s); not sending KV, RLD "
                           "finishes", rid, dest.md_tp, specs)
            return None
        if not specs:
            return None  # other P ranks send all of this rank's heads (callers check ``sends_to`` first)
        if not self.allows(dest.peer):
            self.counters["refused_peer"] += 1
            logger.warning("rid %s: WAN destination %s:%s is not one of P's --pdd-wan-peers; not sending KV "
                           "there, RLD finishes", rid, *dest.peer)
            return None
        prompt_len = len(token_ids)
        # MD extends at least the last token; both ends cut on the same page boundary (MD's
        # radix cache holds whole pages only), so P sends from the page MD's prefix ends on.
        start = self._pool_layout.align_down(min(dest.md_prefix_len, prompt_len - 1))
        if start // self._pool_layout.page_size < first_offered_page:
            # The pages in between stay on P but SGLang's sender never sees them (the RLD
            # already held them); copying from outside the sender's pages is not safe.
            self.counters["refused_rld_prefix"] += 1
            logger.warning("rid %s: MD needs KV from token %d but P sends from %d (RLD's cached prefix); "
                           "WAN transfer not started, RLD finishes", rid, start, first_offered_page)
            return None
        shares, md_rank = [], 0
        try:
            for spec in specs:
                md_rank, peer = spec.md_rank, dest.rank_peer(spec.md_rank)
                share = RankShare(spec, peer, TransferPlan.build(spec.layout, prompt_len, start), self._sender(peer))
                shares.append(share)
                share.transfer = share.sender.begin_transfer(
                    dest.md_room, spec.layout, prompt_len, start, request_id=rid,
                    token_ids=list(token_ids), timeout=self.timeout_s,
                    row=spec.row)
                share.plan = share.transfer.plan  # cut into chunks by the sender's chunk size
        except Exception as e:  # noqa: BLE001 — e.g. a duplicate room: refuse this one, keep serving
            for share in shares:
                if share.transfer is not None:
                    share.sender.release(dest.md_room)
            self.counters["refused_begin"] += 1
            logger.warning("rid %s: WAN transfer to room %s at %s:%s (MD rank %d of %d) not started: %s",
                           rid, dest.md_room, *dest.rank_peer(md_rank), md_rank, dest.md_tp, e)
            return None
        self.counters["rooms"] += 1
        return WanRoom(dest, rid, first_offered_page, shares, FanoutState(len(shares)))

    def offer(self, room: WanRoom, pages: np.ndarray, event=None, last: bool = False) -> None:
        """The next pool pages of the request (in order), produced by the forward that
        ``event`` (if any) marks. Cheap: the copy happens on the copy thread."""
        with self._lock:
            if room.state.dropped:
                return
            try:
                self._machine.step(room, fanout_room.PagesOffered(len(pages), last))
            except fanout_room.IllegalFanoutEvent as e:
                # Pages out of turn are a producer bug; this runs on SGLang's scheduler thread,
                # which must not die of it: the room fails and RLD finishes the request.
                logger.error("rid %s: WAN room %s: %s", room.rid, room.dest.md_room, e)
                self._machine.step(room, fanout_room.FanoutFailed(DropReason.SEND_FAILED, str(e)))
                return
            room.pages.append((pages, event))

    def abort(self, room: WanRoom, detail: str) -> None:
        """Stop this room now (P is about to free its pages): later copies are discarded.
        ``detail``: why, in words, for the log."""
        with self._lock:
            self._machine.step(room, fanout_room.Cancel(detail))

    def may_free_pages(self, room: WanRoom) -> bool:
        """Called once P's request is done with its pages (its sender is terminal): True once
        they may be freed — all copied, or the room dropped and no copy in progress. A room
        whose pages did not all arrive is dropped here (the request ended early)."""
        with self._lock:
            self._machine.step(room, fanout_room.RequestEnded())
            return room.state.may_free_pages(room.copy_done)

    def keep_only(self, md_room: int) -> bool:
        """Nobody waits for MD room ``md_room``'s KV any more (its request ended on RLD; the
        router released MD's room with keep): its chunks go behind every waited room's, here
        and on each MD rank's sender. False if no room of that id is sending here."""
        with self._lock:
            room = next((r for r in self._live if r.dest.md_room == md_room and not r.state.dropped), None)
            if room is None:
                return False
            self._send_order.keep_only(md_room)
            shares = [share for share in room.shares if share.transfer is not None]
        for share in shares:
            share.sender.keep_only(md_room)
        self.counters["kept_only"] += 1
        return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        for s in self._senders.values():
            s.close()

    def stats(self) -> dict:
        with self._lock:
            return dict(self.counters, staged_bytes=self._staged, live_rooms=len(self._live))

    # ------------------------------------------------------------------ internals

    def _new_sender(self, peer: tuple[str, int]) -> KvSender:
        return WanKvSender(peer, self.key, name=self.name, num_streams=self.num_streams,
                           transfer_timeout=self.timeout_s, idle_timeout=min(10.0, self.timeout_s),
                           ssl_context=self.ssl_context)

    def _sender(self, peer: tuple[str, int]) -> KvSender:
        sender = self._senders.get(peer)
        if sender is None:
            sender = self._senders[peer] = self._sender_factory(peer)
        return sender

    def _queue_copy(self, room: WanRoom, action: fanout_room.QueueCopy) -> None:
        self._copy_queue.append(room)
        self._lock.notify_all()

    def _count_sent(self, room: WanRoom, action: fanout_room.CountSent) -> None:
        self.counters["finished"] += 1

    def _abort_shares(self, room: WanRoom, action: fanout_room.AbortSendRooms,
                      failed_share: Optional[RankShare] = None) -> None:
        """``failed_share``: the share whose failure dropped the room, if one did."""
        state = room.state
        self.counters["failed" if state.reason is DropReason.SHARE_FAILED else "aborted"] += 1
        for share in room.shares:  # every MD rank's room fails: none is ready without the others
            if share.transfer is not None:
                share.sender.abort(room.dest.md_room, state.summary)
                if room not in self._live:  # else the reaper forgets it once its copies are unused
                    share.sender.release(room.dest.md_room)
        # A layout mismatch is a deployment error (P and MD disagree), not a WAN hiccup.
        level = logging.ERROR if state.share_failure == FailureReason.LAYOUT_MISMATCH else logging.INFO
        if failed_share is not None:
            logger.log(level, "rid %s: WAN transfer to room %s failed at MD rank %d of %d: %s: %s", room.rid,
                       room.dest.md_room, failed_share.spec.md_rank, room.dest.md_tp, state.share_failure,
                       state.detail)
        else:
            logger.log(level, "rid %s: WAN transfer to room %s dropped: %s", room.rid, room.dest.md_room,
                       state.summary)

    def _fail_share(self, room: WanRoom, share: RankShare) -> None:
        """(under _lock) ``share``'s transfer failed: the room fails (the other MD ranks' too)."""
        failed = fanout_room.FanoutFailed(DropReason.SHARE_FAILED, share.transfer.failure_detail,
                                          share.transfer.failure_reason or FailureReason.ABORTED)
        self._machine.step(room, failed, share)

    def _copy_loop(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._copy_queue or self._closed)
                if self._closed:
                    return
                room = self._copy_queue.popleft()
                work = [] if room.state.dropped else room.shares_ready()
                self._machine.step(room, fanout_room.CopyTaken(bool(work)))
                if room.state.copy is not CopyHold.COPYING:
                    continue
                batches = list(room.pages)
            try:
                copies = self._copy_groups(room, batches, work)
            except Exception as e:  # noqa: BLE001 — a failed copy drops this room only
                logger.exception("rid %s: copying KV for the WAN failed", room.rid)
                copies, err = None, f"copy failed: {e}"
            with self._lock:
                if copies is None or room.state.dropped:
                    # Dropped meanwhile: the pages may have been freed mid-copy; never send them.
                    self._machine.step(room, fanout_room.CopyEnded(more_ready=False))
                    if copies is None:
                        self._machine.step(room, fanout_room.FanoutFailed(DropReason.COPY_FAILED, err))
                    continue
                nbytes = sum(c.numel() for _, _, c in copies)
                if self._staged + nbytes > self.staging_bytes:
                    self.counters["dropped_staging_budget"] += 1
                    self._machine.step(room, fanout_room.CopyEnded(more_ready=False))
                    self._machine.step(room, fanout_room.FanoutFailed(DropReason.STAGING_BUDGET,
                                                                      f"staging budget of {self.staging_bytes} bytes exhausted"))
                    continue
                self._staged += nbytes
                room.staged_bytes += nbytes
                room.payloads.extend(c for _, _, c in copies)
                if room not in self._live:
                    self._live.append(room)
                for share, _, ready in work:
                    share.groups_copied = ready
                finished = [share for share, _, _ in work if share.copy_done]
                # more pages arrived while copying: another round
                self._machine.step(room, fanout_room.CopyEnded(more_ready=bool(room.shares_ready())))
                md_room = room.dest.md_room
                for share, index, data in copies:
                    self._send_order.push(md_room, SendChunk(room, share, index, data), data.numel())
                for share in finished:
                    self._send_order.push(md_room, SendEnd(room, share))
                self._lock.notify_all()

    def _copy_groups(self, room: WanRoom, batches, work) -> list[tuple[RankShare, int, torch.Tensor]]:
        for pages, event in batches[len(room.page_ids):]:  # each batch is converted once
            if event is not None:
                event.synchronize()  # the forward writing these pages (and their ids) has finished
            room.page_ids.append(np.asarray(pages.cpu() if isinstance(pages, torch.Tensor) else pages,
                                            dtype=np.int64))
        page_ids = torch.from_numpy(np.concatenate(room.page_ids)) if room.page_ids else torch.empty(0, dtype=torch.int64)
        out = []
        for share, first, ready in work:
            for group in range(first, ready):
                specs = share.plan.group_chunks(group)
                page_size = share.plan.layout.page_size
                if share.plan.layout.window_buffers:
                    # a window buffer's chunk may start later in the group (its own page range);
                    # the sliding pool's page ids are translated once per range
                    translated: dict = {}
                    for spec in specs:
                        lo = spec.page_start - room.first_offered_page
                        out.append((share, spec.index, gather_buffer_pages(
                            self._pool, spec.layer, page_ids[lo : lo + spec.page_count], page_size,
                            share.spec.src_row, translated.setdefault((lo, spec.page_count), {})).cpu()))
                    continue
                lo = specs[0].page_start - room.first_offered_page
                slots = page_ids[lo : lo + specs[0].page_count]
                # one host copy per buffer: the share's bytes of every token row (strided), or all
                rows = gather_pages(self._pool, slots, page_size, share.spec.src_row)
                out.extend((share, spec.index, rows[spec.layer].cpu()) for spec in specs)
        return out

    def _send_loop(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._send_order or self._closed, timeout=0.2)
                if self._closed:
                    return
                nxt = self._send_order.pop()
            item: Optional[SendItem] = None if nxt is None else nxt[1]  # None: nothing to send, only reap
            self._reap()
            if item is None or item.room.state.dropped or item.share.transfer is None:
                continue
            room, share = item.room, item.share
            try:
                if isinstance(item, SendEnd):
                    share.transfer.finish()
                    self.counters["bytes"] += share.plan.total_bytes
                    with self._lock:
                        self._machine.step(room, fanout_room.ShareEnded())
                elif not share.transfer.send_chunk(item.index, item.data.numpy()):
                    with self._lock:  # the share failed (as the reaper would find): the room fails
                        self._fail_share(room, share)
            except Exception as e:  # noqa: BLE001 — this thread serves every room: never let it die
                logger.exception("rid %s: WAN send failed", room.rid)
                with self._lock:
                    self._machine.step(room, fanout_room.FanoutFailed(DropReason.SEND_FAILED, f"WAN send failed: {e}"))

    def _reap(self) -> None:
        """Fail a room whose share failed (MD's other ranks wait for nothing then), and free the
        host copies of rooms whose shares all ended (the senders no longer read them), forgetting
        the room on each sender."""
        with self._lock:
            keep = []
            for room in self._live:
                states = [share.transfer.poll() if share.transfer is not None else None for share in room.shares]
                failed = next((share for share, state in zip(room.shares, states) if state is RoomState.FAILED), None)
                if failed is not None and not room.state.dropped:  # the other MD ranks' rooms fail too
                    self._fail_share(room, failed)
                    states = [share.transfer.poll() if share.transfer is not None else None for share in room.shares]
                if any(state is not None and not state.is_terminal for state in states):
                    keep.append(room)
                    continue
                self._staged -= room.staged_bytes
                room.staged_bytes, room.payloads = 0, []
                self._send_order.forget(room.dest.md_room)
                for share in room.shares:
                    if share.sender is not None:
                        share.sender.release(room.dest.md_room)
            self._live = keep
