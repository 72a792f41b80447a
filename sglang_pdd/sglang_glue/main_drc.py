"""MD (``--pdd-role main``): WAN KV lands in SGLang's own radix cache, which is MD's DRC.

Runs inside MD's scheduler process. Three pieces:
* ``SglangTreeOps`` — DrcRooms' TreeOps on SGLang's radix cache (match, lock, reserve pool
  pages, ingest = insert the landed pages under the prompt's token ids, page-aligned);
* ``MainDrcRuntime`` — the WAN receiver, the room table, and a command queue drained by the
  scheduler thread (the only thread that touches the tree and the allocator; the receiver's
  threads write KV only into pages reserved for their room: md_ingest.py, docs/data_path.md);
  with SGLang ``--tp N`` one per rank (own pool, receiver on port + rank), the ranks' room
  tables changed in lockstep (md_tp_sync.py);
* ``ControlServer`` — a small HTTP API for the router (rank 0 only): register a room (returns how many
  prompt tokens MD already holds, i.e. decode_prefix_len for P), wait until it is ready,
  release it, DRC stats.

A handoff is then a plain SGLang /generate on MD with input_ids = prompt + eager tokens, the
eager ones marked as output already produced (resume.py): the radix match covers the prompt,
one extend pass recomputes the eager tokens' KV, and the request continues where RLD was.
"""

from __future__ import annotations

import http.client
import json
import logging
import queue
import threading
import time
from array import array
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from sglang_pdd.config import PddConfig, admission_limits, parse_host_port
from sglang_pdd.kv_channel.states import RoomState
from sglang_pdd.kv_channel.tls import control_tls_context, wan_tls_context
from sglang_pdd.kv_channel.wan_receiver import WanKvReceiver
from sglang_pdd.control_auth import EVENT_SIG, ROLE_MD, ControlVerifier
from sglang_pdd.json_http import ControlHTTPServer, JsonRequestHandler, serve_in_thread
from sglang_pdd.protocol import messages as protocol_messages
from sglang_pdd.protocol import routes as api
from sglang_pdd.protocol import (ControlError, ReadyReply, ReadyRequest, RegisterReply, ReleaseReply, ReleaseRequest,
                                 RouteTable)
from sglang_pdd.radix_drc.rooms import DrcFull, DrcRooms, RoomError, RoomsFull, RoomStatus
from sglang_pdd.radix_drc.stats import DrcStats
from sglang_pdd.sglang_glue.kv_pool_view import pool_layout
from sglang_pdd.sglang_glue.loopback import LoopbackServer
from sglang_pdd.sglang_glue.md_ingest import InFlightBudget, Landing, RoomRefused
from sglang_pdd.sglang_glue.md_tp_sync import TpSync, tp_sync_of
from sglang_pdd.sglang_glue.resume import handoff_generate_body

logger = logging.getLogger(__name__)

MAX_CONTROL_BODY = 16 * 1024 * 1024  # a prompt's token ids as JSON; refuse anything bigger

_RUNTIMES: dict[int, "MainDrcRuntime"] = {}  # by id(allocator): one per scheduler process


def held_kv_tokens(allocator) -> int:
    """Pool slots MD's rooms in flight hold outside the tree (for SGLang's leak check)."""
    runtime = _RUNTIMES.get(id(allocator))
    return runtime.held_tokens if runtime is not None else 0


class SglangTreeOps:
    """DrcRooms' TreeOps on SGLang's radix cache, plus slot reservation for arriving KV.
    Scheduler thread only. With page size > 1 the tree holds whole pages: matches are
    page-aligned, and a prompt enters the tree up to its last full page."""

    def __init__(self, tree_cache, page_size: int):
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        self._types = (EvictParams, InsertParams, MatchPrefixParams, RadixKey)
        self.tree = tree_cache
        self.allocator = tree_cache.token_to_kv_pool_allocator
        self.pool = self.allocator.get_kvcache()
        self.pool_layout = pool_layout(self.pool, page_size)
        self.layout = self.pool_layout.wire()
        self.page_size = page_size

    def _key(self, token_ids: Sequence[int]):
        return self._types[3](array("q", token_ids))

    def match(self, token_ids):
        result = self.tree.match_prefix(self._types[2](key=self._key(token_ids)))
        return result.device_prefix_len, result.last_device_node

    def lock(self, node):
        return self.tree.lock(node)

    def unlock(self, lock):
        self.tree.unlock(lock)

    def reserve(self, num_tokens: int) -> Optional[torch.Tensor]:
        """Pool slots for ``num_tokens`` (whole pages), evicting unlocked cache if needed;
        None if the pool cannot hold them even then."""
        if num_tokens == 0:
            return torch.empty(0, dtype=torch.int64)
        short = num_tokens - self.allocator.available_size()
        if short > 0:
            self.tree.evict(self._types[0](num_tokens=short))
        return self.allocator.alloc(num_tokens)

    def free(self, slots: Optional[torch.Tensor]) -> None:
        if slots is not None and slots.numel():
            self.allocator.free(slots)

    def ingest(self, token_ids, prefix_len, prefix_node, slots):
        """Insert the prompt into the tree with ``slots`` (KV of tokens [prefix_len, ...),
        whole pages, already written) after the locked prefix. Takes ownership of ``slots``:
        the ones the tree does not keep (a partial last page, pages a concurrent insert
        already added) are freed here."""
        _, InsertParams, _, _ = self._types
        # Re-match: the prefix is locked, so at least prefix_len tokens still match.
        cached, node = self.match(token_ids[:prefix_len]) if prefix_len else (0, None)
        if cached < prefix_len:
            self.free(slots)
            raise DrcFull(f"locked prefix shrank from {prefix_len} to {cached}")
        insert_len = max(prefix_len, self.pool_layout.align_down(len(token_ids)))
        ours, tail = slots[: insert_len - prefix_len], slots[insert_len - prefix_len:]
        self.free(tail)  # the last, partial page: the tree holds whole pages only
        if insert_len > prefix_len:
            value = ours.to(torch.int64)
            if prefix_len:
                prefix_idx = self.tree.path_device_indices(node)[:prefix_len].to(torch.int64)
                value = torch.cat([prefix_idx.to(value.device), value])
            # prev_prefix_len: slots before it are the tree's own; any of ours that duplicate a
            # concurrent insert are freed by the tree itself (MD's cache frees them: freeing
            # them here too was a double free that SGLang's idle leak check caught).
            self.tree.insert(InsertParams(key=self._key(token_ids[:insert_len]), value=value,
                                          prev_prefix_len=prefix_len))
        full, prompt_node = self.match(token_ids)
        if full < insert_len:
            raise DrcFull(f"prompt of {len(token_ids)} tokens only {full} cached after insert")
        return prompt_node


class MainDrcRuntime:
    """Owned by MD's scheduler; ``on_scheduler_iteration`` runs on the scheduler thread."""

    def __init__(self, scheduler, cfg: PddConfig, key: bytes, tp_sync: Optional[TpSync] = None):
        self.cfg = cfg
        # MD's TP group (SGLang --tp N): every rank runs one of these, in lockstep (see
        # on_scheduler_iteration); TP 1 has no collectives at all.
        self.tp = tp_sync if tp_sync is not None else tp_sync_of(scheduler)
        self.http_port = scheduler.server_args.port  # MD's own SGLang HTTP API, for handoffs
        self.http_api_key = getattr(scheduler.server_args, "api_key", None)  # its --api-key guards /generate
        self.http_ssl_certfile = getattr(scheduler.server_args, "ssl_certfile", None)  # then it serves HTTPS
        self._handoff_lock = threading.Lock()  # control threads: one final handoff per room
        self.ops = SglangTreeOps(scheduler.tree_cache, scheduler.page_size)
        self.rooms = DrcRooms(self.ops, ttl_s=cfg.wan_timeout_s * 2, page_size=scheduler.page_size)
        self.ingest_mode = cfg.md_ingest
        self.budget = InFlightBudget(cfg.md_staging_mb << 20)
        self.landings: dict[int, Landing] = {}
        # Pool slots held by rooms in flight (reserved, or waiting to be freed until the
        # receiver has stopped writing): SGLang's leak check counts them (plugin.py hook).
        self.held_tokens = 0
        # Landings of rooms the receiver is letting go of, in the order every rank forgot them:
        # their pages go back only once every rank's receiver has stopped writing there.
        self._releasing: list[_PagesRelease] = []
        self._unregistered: dict[int, Landing] = {}  # pages of a registration only this rank refused
        self.ready_events: dict[int, threading.Event] = {}
        self.commands: "queue.Queue[tuple[str, tuple, Future]]" = queue.Queue(maxsize=1024)
        self.counters = {"rooms_registered": 0, "rooms_ready": 0, "rooms_failed": 0, "rooms_refused": 0}
        self.drc_stats = DrcStats()
        self.kv_bytes_per_token = self.ops.pool_layout.bytes_per_token
        host, port = parse_host_port("--pdd-wan-listen", cfg.wan_listen)
        port = port + self.tp.rank if port else port  # rank r's KV heads arrive on port + r
        self.receiver = WanKvReceiver(key, name=f"md-{cfg.datacenter or 'main'}", host=host, port=port,
                                      idle_timeout=cfg.wan_timeout_s, admission=admission_limits(cfg),
                                      ssl_context=wan_tls_context(cfg.wan_tls_cert, cfg.wan_tls_key, cfg.wan_tls_ca,
                                                                  server_side=True))
        self._receiver_releases: "queue.Queue[tuple[int, Optional[_PagesRelease]]]" = queue.Queue()
        threading.Thread(target=self._release_rooms_in_receiver, name="pdd-md-room-release", daemon=True).start()
        _RUNTIMES[id(self.ops.allocator)] = self
        chost, cport = parse_host_port("--pdd-control-listen", cfg.control_listen)
        # The router talks to rank 0 only; rank 0 drives the other ranks' room tables.
        self.control = ControlServer((chost, cport), self, key, ssl_context=control_tls_context(
            cfg.control_tls_cert, cfg.control_tls_key, cfg.control_tls_ca, server_side=True)) if self.tp.rank == 0 else None
        logger.info("MD DRC runtime (TP rank %d of %d): WAN KV on %s:%s, control %s, KV pool %s, ingest %s, "
                    "in flight <= %d MiB", self.tp.rank, self.tp.size, *self.receiver.address,
                    f"on {chost}:{cport}" if self.control else "on rank 0", self.layout_description(),
                    self.ingest_mode, self.budget.limit_bytes >> 20)

    def close(self) -> None:
        self.receiver.close()
        if self.control is not None:
            self.control.close()

    def layout_description(self) -> str:
        return self.ops.layout.describe()

    # ---- called from control threads (rank 0's): hand work to the scheduler thread and wait
    def call(self, op: str, *args, timeout: float = 30.0):
        fut: Future = Future()
        self.commands.put((op, args, fut), timeout=timeout)
        return fut.result(timeout=timeout)

    # ---- scheduler thread
    def on_scheduler_iteration(self) -> None:
        """One scheduler iteration, on every TP rank in lockstep. Rank 0 drains the commands
        and reads the clock, every rank applies them in the same order; a room completes, fails
        and gives its pages back only as every rank's receiver agrees (one all-min). The
        collectives run on every rank every iteration, whatever fails in between: a rank that
        skipped one would hang the group."""
        futures: list[Future] = []
        ops = self._take_commands(futures) if self.tp.rank == 0 else []
        now, ops = self.tp.share(time.monotonic(), ops)
        results = [self._apply(op, args, now) for op, args in ops]
        try:
            if any(op == "register" for op, _ in ops):  # the same on every rank: ops are rank 0's
                self._agree_on_registrations(ops, results)
            self._agree_on_rooms_and_releases(now)
            for entry in self.rooms.expire(now):  # rank 0's clock: the same rooms everywhere
                self._guarded("expiry", entry.room, lambda room=entry.room: self._expired(room))
        finally:
            for fut, (ok, value) in zip(futures, results):
                fut.set_result(value) if ok else fut.set_exception(value)

    def _take_commands(self, futures: list[Future]) -> list[tuple[str, tuple]]:
        ops = []
        while True:
            try:
                op, args, fut = self.commands.get_nowait()
            except queue.Empty:
                return ops
            ops.append((op, args))
            futures.append(fut)

    def _apply(self, op: str, args: tuple, now: float) -> tuple[bool, object]:
        try:
            fn = getattr(self, f"_do_{op}")
            return True, (fn(*args, now=now) if op == "register" else fn(*args))
        except Exception as e:  # the caller gets the error; the scheduler goes on
            return False, e

    def _agree_on_registrations(self, ops, results) -> None:
        """A registration stands only if every rank made it (a rank's receiver may refuse a
        room id it is still letting go of); otherwise it is undone everywhere, and the pages
        any rank reserved for it come back on all ranks together."""
        regs = [i for i, (op, _) in enumerate(ops) if op == "register"]
        agreed = self.tp.all_min([1 if results[i][0] else 0 for i in regs])
        for i, everywhere in zip(regs, agreed):
            if everywhere:
                continue
            room = ops[i][1][0]
            if results[i][0]:  # made here, refused on another rank: undo it here
                self.receiver.abort(room, "refused on another MD TP rank")
                landing = self.landings.pop(room, None)
                if landing is not None:
                    self.budget.give_back(landing.nbytes)
                record = self._pages_release(room, landing, always=True)
                self._receiver_releases.put((room, record))
                self.rooms.release(room)
                self._forget(room)
                self.counters["rooms_registered"] -= 1
                self.counters["rooms_refused"] += 1
                results[i] = (False, RoomRefused(f"room {room} refused: another MD TP rank could not register it"))
            else:  # refused here: pages it had reserved come back with the other ranks' undo
                record = self._pages_release(room, self._unregistered.pop(room, None), always=True)
                record.outcome = True  # this rank's receiver never had the room

    def _agree_on_rooms_and_releases(self, now: float) -> None:
        pending = self.rooms.pending()  # the same rooms, in the same order, on every rank
        releasing = list(self._releasing)
        states = [self._poll(entry.room) for entry in pending]
        local = [flag for state in states for flag in (int(state is RoomState.SUCCESS),
                                                      int(state is not RoomState.FAILED))]
        local += [flag for r in releasing for flag in (int(r.outcome is not None), int(r.outcome is not False))]
        if not local:
            return
        agreed = self.tp.all_min(local)
        base = 2 * len(pending)
        for k, record in enumerate(releasing):  # pages first: a staged completion may need them
            if agreed[base + 2 * k]:
                self._releasing.remove(record)
                self._guarded("page release", record.room,
                              lambda r=record, ok=agreed[base + 2 * k + 1]: self._free_pages(r, ok))
        for k, (entry, state) in enumerate(zip(pending, states)):
            success, not_failed = agreed[2 * k], agreed[2 * k + 1]
            if success:
                self._guarded("completion", entry.room, lambda room=entry.room: self._completed(room, now))
            elif not not_failed:
                self._guarded("failure", entry.room, lambda room=entry.room, st=state: self._failed(room, st))

    def _poll(self, room: int):
        try:
            return self.receiver.poll(room)
        except Exception:  # noqa: BLE001 — never skip the collective; this rank votes 'failed'
            logger.exception("room %s: polling the WAN receiver failed", room)
            return RoomState.FAILED

    def _completed(self, room: int, now: float) -> None:
        t0 = time.perf_counter()
        self._finish(self._complete(room, now))
        self._record_stall("complete", time.perf_counter() - t0)

    def _failed(self, room: int, local_state) -> None:
        if local_state is RoomState.FAILED:
            reason, detail = self.receiver.failure(room)
            why = f"{reason}: {detail}"
        else:
            why = "a TP rank's WAN slice failed (see that rank's log)"
        self._finish(self.rooms.fail(room, why))

    def _expired(self, room: int) -> None:
        if room in self.landings:  # expired in flight: stop the receiver's writes first
            self.receiver.abort(room, "expired on MD")
            self._forget_in_receiver(room)
        self._forget(room)

    def _guarded(self, what: str, room: int, fn) -> None:
        """A decision every rank takes: an error is logged, never raised past the collectives."""
        try:
            fn()
        except Exception:  # noqa: BLE001
            logger.exception("room %s: %s failed on MD TP rank %d", room, what, self.tp.rank)

    def _complete(self, room: int, now: float):
        """All of a room's KV is in (the receiver has no writer left): into the tree."""
        landing = self.landings.pop(room)
        self.budget.give_back(landing.nbytes)
        if landing.staged is not None:  # the earlier design: copy the room now, on this thread
            slots = self.ops.reserve(landing.num_tokens)
            if slots is None:
                return self.rooms.fail(room, f"drc_full: cannot allocate {landing.num_tokens} KV slots")
            landing.flush_staged(self.ops.pool, slots)
        else:
            self.held_tokens -= landing.num_tokens  # from here the tree (or ingest's frees) owns them
        return self.rooms.complete(room, landing.slots, now)

    def _record_stall(self, what: str, seconds: float) -> None:
        """Scheduler-thread time spent on a room (decode waits meanwhile): in /pdd/stats."""
        ms = seconds * 1000
        self.counters[f"{what}_ms_total"] = round(self.counters.get(f"{what}_ms_total", 0.0) + ms, 3)
        self.counters[f"{what}_ms_max"] = round(max(self.counters.get(f"{what}_ms_max", 0.0), ms), 3)

    def _do_register(self, room: int, token_ids: list[int], use_cache: bool = True,
                     now: Optional[float] = None) -> dict:
        t0 = time.perf_counter()
        try:
            return self._register(room, token_ids, use_cache, time.monotonic() if now is None else now)
        finally:
            self._record_stall("register", time.perf_counter() - t0)

    def _register(self, room: int, token_ids: list[int], use_cache: bool, now: float) -> dict:
        entry = self.rooms.register(room, token_ids, now, use_cache=use_cache)
        landing = Landing.plan(self.ops.pool_layout, len(token_ids), entry.cached_len)
        try:
            self.budget.take(room, landing.nbytes)
        except RoomRefused:
            self.counters["rooms_refused"] += 1
            self.rooms.release(room)
            raise
        try:
            if self.ingest_mode == "staged":
                landing.into_host()
            else:
                slots = self.ops.reserve(landing.num_tokens)
                if slots is None:
                    self.counters["rooms_refused"] += 1
                    raise RoomRefused(f"room {room} refused: MD's KV pool cannot hold {landing.num_tokens} more "
                                      f"tokens now ({self.ops.allocator.available_size()} free after eviction)")
                landing.into_pool(self.ops.pool, slots)
                self.held_tokens += landing.num_tokens
            self.receiver.register_room(room, self.ops.layout, len(token_ids), landing.write,
                                        decode_prefix_len=entry.cached_len, token_ids=token_ids,
                                        timeout=self.cfg.wan_timeout_s)
        except Exception:
            # Not registered in the receiver: nothing writes into the landing; free it now.
            self.budget.give_back(landing.nbytes)
            if landing.slots is not None:
                if self.tp.size == 1:
                    self.ops.free(landing.slots)
                    self.held_tokens -= landing.num_tokens
                else:  # the other ranks may have made it: free with their undo, in step
                    self._unregistered[room] = landing
            self.rooms.release(room)
            raise
        self.landings[room] = landing
        self.ready_events[room] = threading.Event()
        self.counters["rooms_registered"] += 1
        self.drc_stats.record_lookup(len(token_ids), entry.cached_len)
        return {"room": room, "cached_tokens": entry.cached_len, "prompt_tokens": len(token_ids),
                "wan_peer": "%s:%d" % self.receiver.address,  # rank r listens on its port + r
                "tp_size": self.tp.size,
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "kv_layout": self.ops.pool_layout.to_dict()}

    def _do_release(self, room: int, keep_kv: bool = False) -> bool:
        entry = self.rooms.rooms.get(room)
        if keep_kv and entry is not None and entry.status is RoomStatus.PENDING:
            # The request ended on RLD while its KV was still crossing the WAN: let it land
            # and enter the radix cache, so the session's next turn finds it on MD.
            self.counters["rooms_kept_in_flight"] = self.counters.get("rooms_kept_in_flight", 0) + 1
            return self.rooms.release(room, keep_pending_kv=True)
        self.receiver.abort(room, "released by the router")  # no further writes into its landing
        self._forget_in_receiver(room)
        released = self.rooms.release(room)
        self._forget(room)
        return released

    def _finish(self, entry) -> None:
        room = entry.room
        if entry.status is RoomStatus.READY:
            self.counters["rooms_ready"] += 1
            received = len(entry.token_ids) - entry.cached_len
            self.drc_stats.record_ingest(received, received * self.kv_bytes_per_token, entry.cached_len,
                                         self.kv_bytes_per_token)
        else:
            self.counters["rooms_failed"] += 1
            logger.warning("room %s failed: %s", room, entry.reason)
        self._forget_in_receiver(room)
        if entry.release_when_done:  # released by the router meanwhile: nobody waits for it
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
        self._receiver_releases.put((room, self._pages_release(room, landing)))

    def _pages_release(self, room: int, landing: Optional[Landing], always: bool = False) -> Optional["_PagesRelease"]:
        """Queue ``landing``'s pages (if any) to go back once every rank's receiver let go.
        Only in decisions every rank takes, so the queue is the same list on every rank."""
        if landing is None or landing.slots is None:
            if not always:
                return None
            landing = None
        record = _PagesRelease(room, landing)
        self._releasing.append(record)
        return record

    def _release_rooms_in_receiver(self) -> None:
        while True:
            room, record = self._receiver_releases.get()
            try:
                self.receiver.release_room(room, timeout=60.0)
                ok = True
            except Exception:  # noqa: BLE001 — bookkeeping only; keep the thread alive
                logger.exception("room %s: receiver release failed", room)
                ok = False
            if record is not None:
                record.outcome = ok

    def _free_pages(self, record: "_PagesRelease", released_everywhere: int) -> None:
        landing = record.landing
        if landing is None:
            return
        if not released_everywhere:
            # A writer may still hold the room's pages on some rank: keep them on every rank
            # (lost capacity, never corrupted KV, allocators still alike) rather than free them.
            logger.error("room %s: a receiver release failed; its %d reserved slots stay held", record.room,
                         landing.num_tokens)
            return
        self.ops.free(landing.slots)
        self.held_tokens -= landing.num_tokens

    def _forget(self, room: int) -> None:
        event = self.ready_events.pop(room, None)
        if event is not None:
            event.set()

    # ---- control threads (read-only snapshots)
    def wait_ready(self, room: int, timeout: float) -> dict:
        event = self.ready_events.get(room)
        if event is None:
            raise RoomError(f"unknown room {room}")
        event.wait(timeout)
        entry = self.rooms.rooms.get(room)
        if entry is None:
            return {"room": room, "status": "failed", "reason": "released or expired"}
        return {"room": room, "status": entry.status.value, "reason": entry.reason}

    def handoff_request(self, room: int, body: dict) -> tuple[dict, bool]:
        """Turn a compact handoff (eager token ids) into MD's own /generate request.

        Only the eager tokens cross the WAN; the prompt's ids are the ones MD registered.
        Returns (generate body, stream?). Stale (unknown / not ready) and duplicate final
        handoffs are refused with RoomError, and logged."""
        entry = self.rooms.rooms.get(room)
        if entry is None or entry.status is not RoomStatus.READY:
            logger.warning("stale handoff for room %s (%s) ignored", room,
                           "unknown" if entry is None else entry.status.value)
            raise RoomError(f"stale handoff: room {room} is {'unknown' if entry is None else entry.status.value}")
        eager = body.get("token_ids")
        if not isinstance(eager, list) or not all(isinstance(t, int) and t >= 0 for t in eager):
            raise RoomError("handoff needs 'token_ids': [non-negative int, ...]")
        # MD continues the request: the eager tokens are output already produced (resume.py)
        gen, stream = handoff_generate_body(entry.token_ids, eager, body)
        if not body.get("warmup"):  # a warmup (catch-up batch) only extends, it may repeat
            with self._handoff_lock:
                if entry.handed_off:
                    logger.warning("duplicate handoff for room %s ignored", room)
                    raise RoomError(f"duplicate handoff for room {room}")
                entry.handed_off = True
                self.counters["handoffs"] = self.counters.get("handoffs", 0) + 1
        return gen, stream

    def flush_blocker(self) -> Optional[str]:
        """Why SGLang's flush_cache must not run now, or None. A flush resets the radix tree
        and the pool allocator under MD's rooms: the prefixes they locked and the pages they
        reserved for KV still landing would be handed out again."""
        if self.rooms.rooms or self.held_tokens:
            return f"{len(self.rooms.rooms)} PDD rooms open, {self.held_tokens} KV slots held for the WAN"
        return None

    def stats(self) -> dict:
        """DRC hit rate and WAN bytes (radix_drc.stats), room counts, receiver counters."""
        drc = self.drc_stats.as_dict()
        return {**drc, **self.counters, "wan_tokens": drc["tokens_received"], "wan_bytes": drc["bytes_received"],
                "open_rooms": len(self.rooms.rooms), "tp_size": self.tp.size,
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "wan_receiver": self.receiver.stats()}  # its counters, incl. the acceptor's refusals by kind


@dataclass(eq=False)
class _PagesRelease:
    """A room's reserved pages, waiting for the receiver (release thread) to let go of it."""
    room: int
    landing: Optional[Landing]
    outcome: Optional[bool] = None  # set by the release thread: True released, False failed


class ControlServer:
    """MD's control API for the router, on the interface ``--pdd-control-listen`` names.
    Every route but /health needs the router's signature (control_auth, on the shared key).
    ``ssl_context`` (``--pdd-control-tls-*``): HTTPS only, the router's client certificate required."""

    def __init__(self, address: tuple[str, int], runtime: MainDrcRuntime, key: bytes,
                 max_connections: int = 1024, max_body_bytes_in_flight: int = 4 * MAX_CONTROL_BODY,
                 ssl_context=None):
        # One connection per in-flight request's ready long-poll: the cap is well above that.
        handler = type("Handler", (_ControlHandler,), {"runtime": runtime, "auth": ControlVerifier(key, role=ROLE_MD)})
        self.httpd = ControlHTTPServer(address, handler, max_connections=max_connections,
                                       max_body_bytes_in_flight=max_body_bytes_in_flight, ssl_context=ssl_context)
        self.address = self.httpd.server_address[:2]
        self.thread = serve_in_thread(self.httpd, "pdd-md-control")

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _ControlHandler(JsonRequestHandler):
    """MD's routes (protocol.routes.MD_ROUTES), each parsing its request with the protocol's
    type and answering with its reply type; a refusal is a ControlError carrying its status."""

    runtime: MainDrcRuntime
    max_body_bytes = MAX_CONTROL_BODY

    def body_cap(self, method: str, path: str) -> int:
        # Only POSTs carry a body (register: the prompt's ids; handoff: eager tokens and
        # sampling params); the other routes take none worth more than a few bytes.
        return self.max_body_bytes if method == "POST" else 4096

    def _health(self, query: str) -> dict:
        return {"status": "ok"}

    def _stats(self, query: str) -> dict:
        return _guard(self.runtime.stats)

    def _register(self, query: str) -> dict:
        req = protocol_messages.RegisterRequest.from_json(self.json_body())
        return RegisterReply.from_json(_guard(lambda: self.runtime.call("register", req.room, req.token_ids,
                                                                         req.use_cache))).to_json()

    def _ready(self, query: str, room: int) -> ReadyReply:
        req = ReadyRequest.from_query(room, query)
        return ReadyReply.from_json(_guard(lambda: self.runtime.wait_ready(req.room, req.timeout_s)))

    def _release(self, query: str, room: int) -> ReleaseReply:
        req = ReleaseRequest.from_query(room, query)
        return ReleaseReply(_guard(lambda: self.runtime.call("release", req.room, req.keep_kv)))

    def _handoff(self, query: str, room: int) -> None:
        req = protocol_messages.HandoffRequest.from_json(self.json_body())
        try:
            gen, stream = self.runtime.handoff_request(room, req.to_json())
        except (RoomError, ValueError) as e:
            raise _handoff_refusal(e) from None
        # Relay MD's own /generate (loopback) back to the router, streaming as it comes; the
        # reply, or each event of a stream, signed for this request (control_auth).
        server = self._loopback()
        conn = server.connection(timeout=600)
        try:
            conn.request("POST", "/generate", body=json.dumps(gen), headers=server.headers())
            resp = conn.getresponse()
            if not stream or resp.status != 200:
                return self._relay_whole(resp)
            self.send_response(200)
            self.send_header("Content-Type", resp.getheader("Content-Type", "text/event-stream"))
            self.send_header("Connection", "close")
            self.end_headers()
            self._replied = True
            index = 0
            while line := resp.readline():
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                sig = self.auth.sign_event(self.request_sig, index, data) if self.request_sig else None
                self.wfile.write(b"data: " + data + b"\n" + (EVENT_SIG + sig + b"\n" if sig else b"") + b"\n")
                self.wfile.flush()
                index += 1
        except (OSError, http.client.HTTPException) as e:
            # Mostly the router gone (its client went away): MD must not decode on for nobody.
            # The router's own abort may have reached MD before this request did, so abort here.
            logger.warning("handoff for room %s: relay of MD's generate ended: %r; aborting it", room, e)
            self._abort_generate(gen.get("rid"))
            counters = self.runtime.counters
            counters["handoffs_abandoned"] = counters.get("handoffs_abandoned", 0) + 1
        finally:
            conn.close()
            self.close_connection = True

    def _loopback(self) -> LoopbackServer:
        """MD's own SGLang API: HTTPS when it has --ssl-certfile, its --api-key if it has one."""
        return LoopbackServer(self.runtime.http_port, getattr(self.runtime, "http_api_key", None),
                              getattr(self.runtime, "http_ssl_certfile", None))

    def _abort_generate(self, rid) -> None:
        if not isinstance(rid, str):
            return
        server = self._loopback()
        conn = server.connection(timeout=10)
        try:
            conn.request("POST", "/abort_request", body=json.dumps({"rid": rid}), headers=server.headers())
            conn.getresponse().read()
        except (OSError, http.client.HTTPException) as e:
            logger.warning("abort of MD request %s failed: %r", rid, e)
        finally:
            conn.close()

    def _relay_whole(self, resp) -> None:
        body = resp.read()
        self._replied = True
        self.send_response(resp.status)
        self.send_header("Content-Type", resp.getheader("Content-Type", "application/json"))
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        for name, value in self.reply_signature(resp.status, body).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    routes = RouteTable({api.HEALTH: _health, api.STATS: _stats, api.MD_REGISTER: _register,
                         api.MD_READY: _ready, api.MD_HANDOFF: _handoff, api.MD_RELEASE: _release})


def _guard(fn):
    """``fn()``'s result; MD's own errors as the ControlError the router is answered with."""
    try:
        return fn()
    except ControlError:
        raise
    except RoomsFull as e:
        logger.warning("control: %s", e)
        raise ControlError.of("busy", str(e), headers={"Retry-After": "1"}) from None
    except (queue.Full, TimeoutError):
        logger.warning("control: MD's scheduler did not take the request in time")
        raise ControlError.of("busy", "MD is busy (its scheduler did not take the request in time); retry",
                              headers={"Retry-After": "1"}) from None
    except (RoomError, ValueError, KeyError, TypeError) as e:
        raise ControlError.of("bad_request", str(e)) from None
    except Exception:  # noqa: BLE001 — log the details, never send them; keep the control thread
        logger.exception("control request failed")
        raise ControlError.of("internal", "internal error; details are in MD's log") from None


def _handoff_refusal(e: Exception) -> ControlError:
    """A handoff MainDrcRuntime.handoff_request refused: 409 for a stale (room not ready) or
    duplicate final handoff, 400 for a malformed one. handoff_request raises plain RoomError
    for all three, so the two 409s are told apart here, by their message, in this one place."""
    conflict = str(e).startswith(("stale handoff", "duplicate handoff"))
    return ControlError.of("conflict" if conflict else "bad_request", str(e))
