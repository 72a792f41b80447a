"""MD (``--pdd-role main``): WAN KV lands in SGLang's own radix cache, which is MD's DRC.

Runs inside MD's scheduler process. Three pieces:
* ``SglangTreeOps`` — DrcRooms' TreeOps on SGLang's radix cache (match, lock, ingest = alloc
  slots + write KV + insert under the prompt's token ids);
* ``MainDrcRuntime`` — the WAN receiver, the room table, and a command queue drained by the
  scheduler thread (the only thread that may touch the tree and the KV pool);
* ``ControlServer`` — a small HTTP API for the router: register a room (returns how many
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
from http.server import ThreadingHTTPServer
from typing import Any, Optional, Sequence
from urllib.parse import parse_qs, urlparse

import torch

from sglang_pdd.config import PddConfig, parse_host_port
from sglang_pdd.kv_channel.states import RoomState
from sglang_pdd.kv_channel.wan_receiver import WanKvReceiver
from sglang_pdd.radix_drc.rooms import DrcFull, DrcRooms, RoomError, RoomStatus
from sglang_pdd.radix_drc.stats import DrcStats
from sglang_pdd.json_http import JsonRequestHandler
from sglang_pdd.sglang_glue.kv_pool_view import kv_layout_of, scatter_rows
from sglang_pdd.sglang_glue.resume import handoff_generate_body

logger = logging.getLogger(__name__)

MAX_CONTROL_BODY = 16 * 1024 * 1024  # a prompt's token ids as JSON; refuse anything bigger


class SglangTreeOps:
    def __init__(self, tree_cache, page_size: int):
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        self._types = (EvictParams, InsertParams, MatchPrefixParams, RadixKey)
        self.tree = tree_cache
        self.allocator = tree_cache.token_to_kv_pool_allocator
        self.pool = self.allocator.get_kvcache()
        self.layout = kv_layout_of(self.pool, page_size)

    def _key(self, token_ids: Sequence[int]):
        return self._types[3](array("q", token_ids))

    def match(self, token_ids):
        result = self.tree.match_prefix(self._types[2](key=self._key(token_ids)))
        return result.device_prefix_len, result.last_device_node

    def lock(self, node):
        return self.tree.lock(node)

    def unlock(self, lock):
        self.tree.unlock(lock)

    def ingest(self, token_ids, prefix_len, prefix_node, staged):
        EvictParams, InsertParams, _, _ = self._types
        # Re-match: the prefix is locked, so at least prefix_len tokens still match.
        cached, node = self.match(token_ids[:prefix_len]) if prefix_len else (0, None)
        if cached < prefix_len:
            raise DrcFull(f"locked prefix shrank from {prefix_len} to {cached}")
        need = len(token_ids) - prefix_len
        short = need - self.allocator.available_size()
        if short > 0:
            self.tree.evict(EvictParams(num_tokens=short))
        slots = self.allocator.alloc(need)
        if slots is None:
            raise DrcFull(f"cannot allocate {need} KV slots")
        scatter_rows(self.pool, slots, staged)
        value = slots.to(torch.int64)
        if prefix_len:
            prefix_idx = self.tree.path_device_indices(node)[:prefix_len].to(torch.int64)
            value = torch.cat([prefix_idx.to(slots.device), value])
        # prev_prefix_len: slots before it are the tree's own; any of ours that duplicate a
        # concurrent insert are freed by the tree itself.
        self.tree.insert(InsertParams(key=self._key(token_ids), value=value, prev_prefix_len=prefix_len))
        full, prompt_node = self.match(token_ids)
        if full < len(token_ids):
            raise DrcFull(f"prompt of {len(token_ids)} tokens only {full} cached after insert")
        return prompt_node


class MainDrcRuntime:
    """Owned by MD's scheduler; ``on_scheduler_iteration`` runs on the scheduler thread."""

    def __init__(self, scheduler, cfg: PddConfig, key: bytes):
        self.cfg = cfg
        self.http_port = scheduler.server_args.port  # MD's own SGLang HTTP API, for handoffs
        self.handed_off: set[int] = set()
        self.ops = SglangTreeOps(scheduler.tree_cache, scheduler.page_size)
        self.rooms = DrcRooms(self.ops, ttl_s=cfg.wan_timeout_s * 2)
        self.staged: dict[int, torch.Tensor] = {}
        self.ready_events: dict[int, threading.Event] = {}
        self.commands: "queue.Queue[tuple[str, tuple, Future]]" = queue.Queue(maxsize=1024)
        self.counters = {"rooms_registered": 0, "rooms_ready": 0, "rooms_failed": 0}
        self.drc_stats = DrcStats()
        self.kv_bytes_per_token = self.ops.layout.num_layers * self.ops.layout.bytes_per_page
        host, port = parse_host_port("--pdd-wan-listen", cfg.wan_listen)
        self.receiver = WanKvReceiver(key, name=f"md-{cfg.datacenter or 'main'}", host=host, port=port,
                                      idle_timeout=cfg.wan_timeout_s)
        self._receiver_releases: "queue.Queue[int]" = queue.Queue()
        threading.Thread(target=self._release_rooms_in_receiver, name="pdd-md-room-release", daemon=True).start()
        chost, cport = parse_host_port("--pdd-control-listen", cfg.control_listen)
        self.control = ControlServer((chost, cport), self)
        logger.info("MD DRC runtime: WAN KV on %s:%s, control on %s:%s, layout %s",
                    *self.receiver.address, chost, cport, self.ops.layout)

    # ---- called from control threads: hand work to the scheduler thread and wait
    def call(self, op: str, *args, timeout: float = 30.0):
        fut: Future = Future()
        self.commands.put((op, args, fut), timeout=timeout)
        return fut.result(timeout=timeout)

    # ---- scheduler thread
    def on_scheduler_iteration(self) -> None:
        while True:
            try:
                op, args, fut = self.commands.get_nowait()
            except queue.Empty:
                break
            try:
                fut.set_result(getattr(self, f"_do_{op}")(*args))
            except Exception as e:  # the caller gets the error; the scheduler goes on
                fut.set_exception(e)
        now = time.monotonic()
        for entry in self.rooms.pending():
            state = self.receiver.poll(entry.room)
            if state is RoomState.SUCCESS:
                self._finish(self.rooms.complete(entry.room, self.staged.pop(entry.room), now))
            elif state is RoomState.FAILED:
                reason, detail = self.receiver.failure(entry.room)
                self._finish(self.rooms.fail(entry.room, f"{reason}: {detail}"))
        for entry in self.rooms.expire(now):
            self._forget(entry.room)

    def _do_register(self, room: int, token_ids: list[int], use_cache: bool = True) -> dict:
        entry = self.rooms.register(room, token_ids, time.monotonic(), use_cache=use_cache)
        layout = self.ops.layout
        sent = len(token_ids) - entry.cached_len
        staged = torch.empty((layout.num_layers, sent, layout.bytes_per_page), dtype=torch.uint8)

        def write(layer_start, layer_count, page_start, page_count, payload, first=entry.cached_len):
            rows = torch.frombuffer(payload, dtype=torch.uint8).view(layer_count, page_count, -1)
            staged[layer_start:layer_start + layer_count, page_start - first:page_start - first + page_count] = rows

        try:
            self.receiver.register_room(room, layout, len(token_ids), write,
                                        decode_prefix_len=entry.cached_len, token_ids=token_ids,
                                        timeout=self.cfg.wan_timeout_s)
        except Exception:
            self.rooms.release(room)
            raise
        self.staged[room] = staged
        self.ready_events[room] = threading.Event()
        self.counters["rooms_registered"] += 1
        self.drc_stats.record_lookup(len(token_ids), entry.cached_len)
        return {"room": room, "cached_tokens": entry.cached_len, "prompt_tokens": len(token_ids),
                "wan_peer": "%s:%d" % self.receiver.address,
                "kv_bytes_per_token": self.kv_bytes_per_token}

    def _do_release(self, room: int, keep_kv: bool = False) -> bool:
        entry = self.rooms.rooms.get(room)
        if keep_kv and entry is not None and entry.status is RoomStatus.PENDING:
            # The request ended on RLD while its KV was still crossing the WAN: let it land
            # and enter the radix cache, so the session's next turn finds it on MD.
            self.counters["rooms_kept_in_flight"] = self.counters.get("rooms_kept_in_flight", 0) + 1
            return self.rooms.release(room, keep_pending_kv=True)
        self.receiver.abort(room, "released by the router")  # no further writes into staging
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
        for a chunk still being read (seconds on a slow WAN) and, past its timeout, cuts the
        streams that other rooms share. Staging is Python-owned, so a late write is harmless."""
        self._receiver_releases.put(room)

    def _release_rooms_in_receiver(self) -> None:
        while True:
            room = self._receiver_releases.get()
            try:
                self.receiver.release_room(room, timeout=60.0)
            except Exception:  # noqa: BLE001 — bookkeeping only; keep the thread alive
                logger.exception("room %s: receiver release failed", room)

    def _forget(self, room: int) -> None:
        self.staged.pop(room, None)
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
            if room in self.handed_off:
                logger.warning("duplicate handoff for room %s ignored", room)
                raise RoomError(f"duplicate handoff for room {room}")
            self.handed_off.add(room)
        return gen, stream

    def stats(self) -> dict:
        """DRC hit rate and WAN bytes (radix_drc.stats), room counts, receiver counters."""
        drc = self.drc_stats.as_dict()
        return {**drc, **self.counters, "wan_tokens": drc["tokens_received"], "wan_bytes": drc["bytes_received"],
                "open_rooms": len(self.rooms.rooms), "wan_receiver": dict(self.receiver.counters)}


class ControlServer:
    def __init__(self, address: tuple[str, int], runtime: MainDrcRuntime):
        handler = type("Handler", (_ControlHandler,), {"runtime": runtime})
        self.httpd = ThreadingHTTPServer(address, handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="pdd-md-control", daemon=True)
        self.thread.start()


class _ControlHandler(JsonRequestHandler):
    runtime: MainDrcRuntime

    def _body(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_CONTROL_BODY:
            raise RoomError(f"body of {length} bytes exceeds {MAX_CONTROL_BODY}")
        body = json.loads(self.rfile.read(length) or b"{}")
        if not isinstance(body, dict):
            raise RoomError("body must be a JSON object")
        return body

    def _guard(self, fn) -> None:
        try:
            self._reply(200, fn())
        except (RoomError, ValueError, KeyError, TypeError) as e:
            self._reply(400, {"error": str(e)})
        except Exception as e:  # noqa: BLE001 — report, never kill the control thread
            logger.exception("control request failed")
            self._reply(500, {"error": repr(e)})

    def do_GET(self):
        url = urlparse(self.path)
        q = parse_qs(url.query)
        if url.path == "/health":
            return self._reply(200, {"status": "ok"})
        if url.path == "/pdd/stats":
            return self._guard(self.runtime.stats)
        if url.path.startswith("/pdd/rooms/") and url.path.endswith("/ready"):
            room = int(url.path.split("/")[3])
            timeout = min(float(q.get("timeout_s", ["10"])[0]), 600.0)
            return self._guard(lambda: self.runtime.wait_ready(room, timeout))
        self._reply(404, {"error": f"no route {url.path}"})

    def do_POST(self):
        path = urlparse(self.path).path
        if path.startswith("/pdd/rooms/") and path.endswith("/handoff"):
            return self._handoff(int(path.split("/")[3]))
        if path != "/pdd/rooms":
            return self._reply(404, {"error": f"no route {self.path}"})

        def register():
            body = self._body()
            room, ids = body.get("room"), body.get("token_ids")
            if not isinstance(room, int) or not isinstance(ids, list) or \
                    not all(isinstance(t, int) and t >= 0 for t in ids):
                raise RoomError("need {'room': int, 'token_ids': [non-negative int, ...]}")
            return self.runtime.call("register", room, ids, bool(body.get("use_cache", True)))

        self._guard(register)

    def _handoff(self, room: int) -> None:
        try:
            gen, stream = self.runtime.handoff_request(room, self._body())
        except (RoomError, ValueError) as e:
            return self._reply(409 if "stale" in str(e) or "duplicate" in str(e) else 400, {"error": str(e)})
        # Relay MD's own /generate (loopback) back to the router, streaming as it comes.
        conn = http.client.HTTPConnection("127.0.0.1", self.runtime.http_port, timeout=600)
        try:
            conn.request("POST", "/generate", body=json.dumps(gen), headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            self.send_response(resp.status)
            self.send_header("Content-Type", resp.getheader("Content-Type", "application/json"))
            self.send_header("Connection", "close")
            self.end_headers()
            while True:
                chunk = resp.read1(65536) if stream else resp.read()
                if not chunk:
                    break
                self.wfile.write(chunk)
                self.wfile.flush()
                if not stream:
                    break
        except (OSError, http.client.HTTPException) as e:
            logger.warning("handoff for room %s: MD generate failed: %r", room, e)
        finally:
            conn.close()
            self.close_connection = True

    def do_DELETE(self):
        path = urlparse(self.path).path
        if not path.startswith("/pdd/rooms/"):
            return self._reply(404, {"error": f"no route {path}"})
        keep_kv = parse_qs(urlparse(self.path).query).get("keep_kv", ["0"])[0] == "1"
        self._guard(lambda: {"released": self.runtime.call("release", int(path.split("/")[3]), keep_kv)})
