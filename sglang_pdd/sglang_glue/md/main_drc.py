"""MD (``--pdd-role main``): WAN KV lands in SGLang's own radix cache, which is MD's DRC.

Runs inside MD's scheduler process. Three pieces:
* ``SglangTreeOps`` — DrcRoomTable' TreeOps on SGLang's radix cache (match, lock, reserve pool
  pages, ingest = insert the landed pages under the prompt's token ids, page-aligned);
* ``MainDrcRuntime`` — a façade over the WAN receiver, this rank's rooms (rooms.py; each
  room's course is radix_drc/room_state.py's state machine) and a command queue drained by the
  scheduler thread (driver.py; the only thread that touches the tree and the allocator; the
  receiver's threads write KV only into pages reserved for their room: ingest.py, pages.py,
  docs/data_path.md); with SGLang ``--tp N`` one per rank (own pool, receiver on port + rank),
  the ranks' room tables changed in lockstep (lockstep.py, tp_sync.py);
* ``MdControlApi`` — a small HTTP API for the router (rank 0 only): register a room (returns how many
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
import socket
from array import array
from typing import Iterable, Optional, Sequence

import torch

from sglang_pdd.config import PddConfig, admission_limits, control_names, parse_host_port
from sglang_pdd.kv_channel.layout import window_first_page
from sglang_pdd.kv_channel.tls import control_server_names, control_tls_context, wan_tls_context
from sglang_pdd.kv_channel.contract import KvReceiver
from sglang_pdd.kv_channel.wan_receiver import WanKvReceiver  # the contract's implementation, built here only
from sglang_pdd.control.auth import EVENT_SIG, ROLE_MD, ControlVerifier
from sglang_pdd.control.api import ControlApi, ControlServer
from sglang_pdd.control.gate import JsonRequestHandler
from sglang_pdd.protocol import messages as protocol_messages
from sglang_pdd.protocol import routes as api
from sglang_pdd.protocol import (ControlError, HandoffRequest, HealthReply, KvSendersReply, KvSendersRequest,
                                 ReadyReply, ReadyRequest, RegisterReply, RegisterRequest, ReleaseReply, ReleaseRequest,
                                 RouteTable)
from sglang_pdd.radix_drc.rooms import DrcFull, DrcRoomTable, RoomError, RoomsFull
from sglang_pdd.sglang_glue.md.hangup_watch import HangupWatch
from sglang_pdd.sglang_glue.md.idle_wake import IdleWake
from sglang_pdd.sglang_glue.injected_delays import MD_REGISTER_DELAY_ENV, InjectedDelay
from sglang_pdd.sglang_glue.kv_pool_view import pool_layout
from sglang_pdd.sglang_glue.md.loopback import LoopbackServer
from sglang_pdd.sglang_glue.md.driver import CommandQueue, LockstepDriver
from sglang_pdd.sglang_glue.md.evictions import count_evictions
from sglang_pdd.sglang_glue.md.queries import MdRoomQueries
from sglang_pdd.sglang_glue.md.rooms import RankRooms
from sglang_pdd.sglang_glue.md.tp_sync import TpSync, tp_sync_of

logger = logging.getLogger(__name__)

MAX_CONTROL_BODY = 16 * 1024 * 1024  # a prompt's token ids as JSON; refuse anything bigger

_RUNTIMES: dict[int, "MainDrcRuntime"] = {}  # by id(allocator): one per scheduler process


def held_kv_tokens(allocator) -> int:
    """Pool slots MD's rooms in flight hold outside the tree (for SGLang's leak check)."""
    runtime = _RUNTIMES.get(id(allocator))
    return runtime.held_tokens if runtime is not None else 0


def held_swa_kv_tokens(allocator) -> int:
    """Sliding-window pool slots MD's rooms in flight hold outside the tree (a hybrid pool)."""
    runtime = _RUNTIMES.get(id(allocator))
    return runtime.rank_rooms.pages.held_swa_tokens if runtime is not None else 0


class SglangTreeOps:
    """DrcRoomTable' TreeOps on SGLang's radix cache, plus slot reservation for arriving KV.
    Scheduler thread only. With page size > 1 the tree holds whole pages: matches are
    page-aligned, and a prompt enters the tree up to its last full page."""

    def __init__(self, tree_cache, page_size: int, window: int = 0):
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        self._types = (EvictParams, InsertParams, MatchPrefixParams, RadixKey)
        self.tree = tree_cache
        self.allocator = tree_cache.token_to_kv_pool_allocator
        self.pool = self.allocator.get_kvcache()
        self.pool_layout = pool_layout(self.pool, page_size, window)
        self.layout = self.pool_layout.wire()
        self.page_size = page_size
        # A hybrid sliding-window pool: slots of the sliding pool only for each prompt's window
        # (reserve), and the rest of the prompt enters the tree as SWA tombstones (ingest).
        self.window = self.pool_layout.window

    def _key(self, token_ids: Sequence[int]):
        return self._types[3](array("q", token_ids))

    def match(self, token_ids):
        result = self.tree.match_prefix(self._types[2](key=self._key(token_ids)))
        return result.device_prefix_len, result.last_device_node

    def lock(self, node):
        return self.tree.lock(node)

    def unlock(self, lock):
        self.tree.unlock(lock)

    def reserve(self, num_tokens: int, window_tokens: int = 0) -> Optional[torch.Tensor]:
        """Pool slots for ``num_tokens`` (whole pages), evicting unlocked cache if needed;
        None if the pool cannot hold them even then. A hybrid pool: sliding-window slots for
        the last ``window_tokens`` only (the tokens before them never get sliding KV here)."""
        if num_tokens == 0:
            return torch.empty(0, dtype=torch.int64)
        if self.window:
            return self._reserve_hybrid(num_tokens, window_tokens)
        short = num_tokens - self.allocator.available_size()
        if short > 0:
            self.tree.evict(self._types[0](num_tokens=short))
        return self.allocator.alloc(num_tokens)

    def _reserve_hybrid(self, num_tokens: int, window_tokens: int) -> Optional[torch.Tensor]:
        alloc = self.allocator
        if not 0 <= window_tokens <= num_tokens:
            raise ValueError(f"window of {window_tokens} tokens for a reservation of {num_tokens}")
        short_full = max(0, num_tokens - alloc.full_available_size())
        short_swa = max(0, window_tokens - alloc.swa_available_size())
        if short_full or short_swa:
            self.tree.evict(self._types[0](num_tokens=short_full, swa_num_tokens=short_swa))
        if num_tokens > alloc.full_available_size() or window_tokens > alloc.swa_available_size():
            return None
        full = alloc.full_attn_allocator.alloc(num_tokens)
        if full is None:
            return None
        if window_tokens:
            swa = alloc.swa_attn_allocator.alloc(window_tokens)
            if swa is None:
                alloc.full_attn_allocator.free(full)
                return None
            alloc.set_full_to_swa_mapping(full[num_tokens - window_tokens:], swa)
        return full

    def free(self, slots: Optional[torch.Tensor]) -> None:
        if slots is None or not slots.numel():
            return
        if not self.window:
            self.allocator.free(slots)
            return
        # a hybrid reservation: sliding-window slots only where it holds them
        mapped = self.allocator.full_to_swa_index_mapping[slots.to(torch.int64)] > 0
        if bool(mapped.any()):
            self.allocator.free_swa(slots[mapped])
        self.allocator.free_full(slots)

    def swa_held(self, slots: Optional[torch.Tensor]) -> int:
        """Sliding-window slots ``slots`` hold (0 without a window)."""
        if not self.window or slots is None or not slots.numel():
            return 0
        return int((self.allocator.full_to_swa_index_mapping[slots.to(torch.int64)] > 0).sum())

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
            params = InsertParams(key=self._key(token_ids[:insert_len]), value=value, prev_prefix_len=prefix_len)
            if self.window:
                from sglang.srt.mem_cache.unified_cache.components import ComponentType

                # tokens before the window came without sliding-window KV: tombstones in the
                # tree (full KV only), so a later match never ends where the window is missing
                params.set_evicted_seqlen(ComponentType.SWA, window_first_page(
                    len(token_ids), prefix_len, self.window, self.page_size) * self.page_size)
            self.tree.insert(params)
        full, prompt_node = self.match(token_ids)
        if full < insert_len:
            raise DrcFull(f"prompt of {len(token_ids)} tokens only {full} cached after insert")
        return prompt_node


class MainDrcRuntime:
    """Owned by MD's scheduler; ``on_scheduler_iteration`` runs on the scheduler thread. A
    façade over its parts: this rank's rooms (rooms.RankRooms, with their page accounting,
    pages), the command queue and the lockstep iteration (driver), and the control
    threads' queries (queries.MdRoomQueries)."""

    def __init__(self, scheduler, cfg: PddConfig, key: bytes, tp_sync: Optional[TpSync] = None):
        self.cfg = cfg
        # MD's TP group (SGLang --tp N): every rank runs one of these, in lockstep (driver);
        # TP 1 has no collectives at all.
        self.tp = tp_sync if tp_sync is not None else tp_sync_of(scheduler)
        self.http_port = scheduler.server_args.port  # MD's own SGLang HTTP API, for handoffs
        self.http_api_key = getattr(scheduler.server_args, "api_key", None)  # its --api-key guards /generate
        self.http_ssl_certfile = getattr(scheduler.server_args, "ssl_certfile", None)  # then it serves HTTPS
        self.ops = SglangTreeOps(scheduler.tree_cache, scheduler.page_size,
                                 int(getattr(scheduler, "sliding_window_size", None) or 0))
        host, port = parse_host_port("--pdd-wan-listen", cfg.wan_listen)
        port = port + self.tp.rank if port else port  # rank r's KV heads arrive on port + r
        self.idle_wake = IdleWake(scheduler)  # MD sleeps on idle like P and RLD (idle_wake.py)
        self.receiver: KvReceiver = WanKvReceiver(
            key, name=f"md-{cfg.datacenter or 'main'}", host=host, port=port, idle_timeout=cfg.wan_timeout_s,
            admission=admission_limits(cfg),
            ssl_context=wan_tls_context(cfg.wan_tls_cert, cfg.wan_tls_key, cfg.wan_tls_ca, server_side=True),
            on_settled=lambda room: self.idle_wake.wake())
        self.rank_rooms = RankRooms(cfg, self.ops, self.receiver, self.tp.size, scheduler.page_size,
                                    wake=self.idle_wake.wake)
        # MD's stats count the cache's real evictions, by SGLang's scheduler or MD's ingest
        count_evictions(scheduler.tree_cache, self.rank_rooms.drc_stats.record_eviction)
        self.commands = CommandQueue(on_submit=self.idle_wake.wake)
        self.driver = LockstepDriver(self.tp, self.rank_rooms, self.commands)
        self.queries = MdRoomQueries(self.rank_rooms)
        _RUNTIMES[id(self.ops.allocator)] = self
        chost, cport = parse_host_port("--pdd-control-listen", cfg.control_listen)
        # The router talks to rank 0 only; rank 0 drives the other ranks' room tables.
        self.control = MdControlServer(
            (chost, cport), self, key, ssl_context=control_tls_context(
                cfg.control_tls_cert, cfg.control_tls_key, cfg.control_tls_ca, server_side=True),
            trusted_sources=cfg.control_trusted_sources,
            names=control_server_names(chost, control_names(cfg), cfg.control_tls_cert) or None,
        ) if self.tp.rank == 0 else None
        logger.info("MD DRC runtime (TP rank %d of %d): WAN KV on %s:%s, control %s, KV pool %s, ingest %s, "
                    "in flight <= %d MiB", self.tp.rank, self.tp.size, *self.receiver.address,
                    f"on {chost}:{cport}" if self.control else "on rank 0", self.layout_description(),
                    self.rank_rooms.ingest_mode, self.rank_rooms.budget.limit_bytes >> 20)

    # ---- what the control server, the plugin's hooks and the tests read of this rank's rooms
    @property
    def table(self) -> DrcRoomTable:
        return self.rank_rooms.table

    @property
    def counters(self) -> dict:
        return self.rank_rooms.counters

    @property
    def kv_bytes_per_token(self) -> int:
        return self.rank_rooms.kv_bytes_per_token

    @property
    def held_tokens(self) -> int:
        """Pool slots held by rooms in flight (reserved, or waiting to be freed until the
        receiver has stopped writing): SGLang's leak check counts them (plugin.py hook)."""
        return self.queries.held_tokens

    def close(self) -> None:
        self.rank_rooms.pages.close()  # before the receiver: its queued releases run on it
        self.receiver.close()
        if self.control is not None:
            self.control.close()
        self.idle_wake.close()

    def layout_description(self) -> str:
        return self.ops.layout.describe()

    # ---- control threads (rank 0's): room commands, run on the scheduler thread (driver)
    def register(self, req: RegisterRequest, timeout: float = 30.0) -> RegisterReply:
        return self.commands.call(req, timeout=timeout)

    def release(self, req: ReleaseRequest, timeout: float = 30.0) -> ReleaseReply:
        return self.commands.call(req, timeout=timeout)

    def announce_kv_senders(self, req: KvSendersRequest, timeout: float = 30.0) -> KvSendersReply:
        return self.commands.call(req, timeout=timeout)

    # ---- control threads: answered from this rank's rooms at once (queries)
    def wait_ready(self, req: ReadyRequest) -> ReadyReply:
        return self.queries.wait_ready(req)

    def handoff_request(self, room: int, req: HandoffRequest) -> tuple[dict, bool]:
        return self.queries.handoff_request(room, req)

    def flush_blocker(self) -> Optional[str]:
        return self.queries.flush_blocker()

    def flush_waits_only_for_pages(self) -> bool:
        return self.queries.flush_waits_only_for_pages()

    def stats(self) -> dict:
        return self.queries.stats()

    def before_flush(self) -> int:
        """A cache flush came in (scheduler thread, every TP rank): rooms kept only to fill the
        cache go (rooms.RankRooms.drop_rooms_kept_for_cache); returns how many."""
        return self.rank_rooms.drop_rooms_kept_for_cache()

    def on_scheduler_iteration(self) -> None:
        """One scheduler iteration, on every TP rank in lockstep (driver.LockstepDriver)."""
        self.idle_wake.drain()
        changed = self.driver.iterate()
        # A settled room or released pages wait for the group's decision, and what this
        # iteration changed is for SGLang's next one to see (a deferred flush now idle); KV
        # still landing does not keep MD awake (the receiver wakes it when a room settles).
        self.idle_wake.keep_awake(changed or self.rank_rooms.needs_iteration())


class MdControlServer(ControlServer):
    """MD's control API for the router (``MdControlApi``), on the interface
    ``--pdd-control-listen`` names. ``ssl_context`` (``--pdd-control-tls-*``): HTTPS only, the
    router's client certificate required; ``trusted_sources``: the router's addresses
    (--pdd-control-trusted-sources); ``names``: the hosts its CONTROL_URL may name (None: the
    bound address)."""

    def __init__(self, address: tuple[str, int], runtime: MainDrcRuntime, key: bytes,
                 max_connections: int = 1024, max_body_bytes_in_flight: int = 4 * MAX_CONTROL_BODY,
                 ssl_context=None, trusted_sources=(), names: Optional[Iterable[str]] = None):
        # One connection per in-flight request's ready long-poll: the cap is well above that.
        super().__init__(MdControlApi(runtime, key), address, thread_name="pdd-md-control",
                         max_connections=max_connections, max_body_bytes_in_flight=max_body_bytes_in_flight,
                         ssl_context=ssl_context, trusted_sources=trusted_sources, names=names)


class MdControlApi(ControlApi):
    """MD's routes (protocol.routes.MD_ROUTES), each parsing its request with the protocol's
    type, handing it to the runtime and answering with the reply type the runtime returns; a
    refusal is a ControlError carrying its status. Every route but /health needs the router's
    signature (control_auth, on the shared key)."""

    max_body_bytes = MAX_CONTROL_BODY

    def __init__(self, runtime: MainDrcRuntime, key: bytes):
        self.runtime = runtime
        self.auth = ControlVerifier(key, role=ROLE_MD)
        self.register_delay = InjectedDelay.from_env(MD_REGISTER_DELAY_ENV)  # test-only: none unless set at start
        self.routes = RouteTable({api.HEALTH: self.health, api.STATS: self.stats, api.MD_REGISTER: self.register,
                                  api.MD_READY: self.ready, api.MD_HANDOFF: self.handoff, api.MD_RELEASE: self.release,
                                  api.MD_KV_SENDERS: self.kv_senders})

    def body_cap(self, method: str, path: str) -> int:
        # Only POSTs carry a body (register: the prompt's ids; handoff: eager tokens and
        # sampling params); the other routes take none worth more than a few bytes.
        return self.max_body_bytes if method == "POST" else 4096

    def health(self, call: JsonRequestHandler, query: str) -> HealthReply:
        return HealthReply()

    def stats(self, call: JsonRequestHandler, query: str) -> dict:
        # control_server: its connections and refusals by kind (control_gate.ControlHTTPServer)
        return {**_guard(self.runtime.stats), "control_server": call.server.stats()}

    def register(self, call: JsonRequestHandler, query: str) -> RegisterReply:
        req = protocol_messages.RegisterRequest.from_json(call.json_body())
        self.register_delay.wait()
        return _guard(lambda: self.runtime.register(req))

    def kv_senders(self, call: JsonRequestHandler, query: str) -> KvSendersReply:
        req = KvSendersRequest.from_json(call.json_body())
        return _guard(lambda: self.runtime.announce_kv_senders(req))

    def ready(self, call: JsonRequestHandler, query: str, room: int) -> ReadyReply:
        return _guard(lambda: self.runtime.wait_ready(ReadyRequest.from_query(room, query)))

    def release(self, call: JsonRequestHandler, query: str, room: int) -> ReleaseReply:
        req = ReleaseRequest.from_query(room, query)
        return _guard(lambda: self.runtime.release(req))

    def handoff(self, call: JsonRequestHandler, query: str, room: int) -> None:
        # looked up at call time: a field added to the protocol's type reaches the runtime
        req = protocol_messages.HandoffRequest.from_json(call.json_body())
        gen, stream = _guard(lambda: self.runtime.handoff_request(room, req))
        # Relay MD's own /generate (loopback) back to the router, streaming as it comes; the
        # reply, or each event of a stream, signed for this request (control_auth).
        server = self._loopback()
        conn = server.connection(timeout=600)
        try:
            conn.request("POST", "/generate", body=json.dumps(gen), headers=server.headers())
            loopback = conn.sock  # the response reads it even after ``conn`` lets go (Connection: close)
            resp = conn.getresponse()
            if not stream or resp.status != 200:
                return call.reply_bytes(resp.status, resp.getheader("Content-Type", "application/json"), resp.read())
            call.begin_stream(resp.getheader("Content-Type", "text/event-stream"))
            index, ended = 0, False
            # The router gone, MD's next event may be a decode step away: cut the relay now.
            with HangupWatch(call.connection, lambda: _shut(loopback)) as watch:
                while not ended and (line := resp.readline()):
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    sig = self.auth.sign_event(call.request_sig, index, data) if call.request_sig else None
                    call.wfile.write(b"data: " + data + b"\n" + (EVENT_SIG + sig + b"\n" if sig else b"") + b"\n")
                    call.wfile.flush()
                    index += 1
                    # The stream's end relayed: the router may hang up now, the request is done
                    # (waiting for MD to close its side would race that hang-up).
                    ended = data == b"[DONE]"
            if watch.hung_up and not ended:
                raise ConnectionResetError("the router hung up")
        except (OSError, http.client.HTTPException) as e:
            # Mostly the router gone (its client went away): MD must not decode on for nobody.
            # The router's own abort may have reached MD before this request did, so abort here.
            logger.warning("handoff for room %s: relay of MD's generate ended: %r; aborting it", room, e)
            self._abort_generate(gen.get("rid"))
            counters = self.runtime.counters
            counters["handoffs_abandoned"] = counters.get("handoffs_abandoned", 0) + 1
        finally:
            conn.close()
            call.close_connection = True

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


def _shut(sock) -> None:
    """End a relay's read of MD's own stream from another thread (its reader sees the end)."""
    if sock is not None:
        try:  # the plain socket's shutdown, also under TLS: the TLS object stays the reader's alone
            socket.socket.shutdown(sock, socket.SHUT_RDWR)
        except OSError:
            pass


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
