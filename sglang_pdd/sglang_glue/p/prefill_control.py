"""P's control API: WAN destinations that arrive after the request (``--pdd-control-listen``).

Why: the router need not wait for MD's answer (one WAN round trip) before starting P and RLD.
It starts them at once, marking the request ``pdd_wan_expected``, registers the room on MD in
parallel, and then tells P where the KV goes and from which token on (``md_tp``: MD's TP
size, default 1; MD rank r's WAN receiver is ``wan_peer``'s port + r):

    POST   /pdd/wan_destinations                {bootstrap_room, md_room, wan_peer, md_prefix_len[, md_tp]}
    DELETE /pdd/wan_destinations/{bootstrap_room}   (no MD after all; withdraws one not yet claimed)
    POST   /pdd/wan_destinations/{bootstrap_room}/kept   (the request ended on RLD: its KV goes
                                                    behind the KV someone waits for)
    GET    /pdd/stats
    GET    /pdd/info                            {tp_rank, tp_size, sends_wan}

The destination may come before or after the sender asks for it; ``DestinationBoard`` pairs
the two. Runs in P's scheduler process (the KV manager starts it), on its own thread.

Tensor parallelism (``--tp N``): every TP rank runs its own scheduler, KV manager and so its
own control API, and each rank sends its own share of the KV heads, so each needs every
destination. Rank r listens on the configured ``--pdd-control-listen`` port + r (ports
port..port+N-1); the router learns N from rank 0's ``/pdd/info`` and posts to all N. What a
rank sends depends on the destination's MD TP size (``md_tp``), so P's ranks keep every
destination, and a rank whose heads other ranks send to that MD drops it when its request
claims it (transfer_backend). A server built with ``sends_wan=False`` checks each call as the
others do and answers it, but keeps nothing.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from sglang_pdd.config import PddConfigError, parse_host_port
from sglang_pdd.control.api import ControlApi, ControlServer
from sglang_pdd.control.auth import ControlVerifier
from sglang_pdd.control.gate import JsonRequestHandler
from sglang_pdd.protocol import routes as api
from sglang_pdd.protocol import (MAX_MD_TP, ControlError, DestinationReply, DropReply, HealthReply, InfoReply, KeptReply,
                                 RouteTable, WanDestinationRequest, bad_request)
from sglang_pdd.sglang_glue.injected_delays import P_DESTINATION_DELAY_ENV, InjectedDelay
from sglang_pdd.sglang_glue.p.wan_fanout import WanDestination

logger = logging.getLogger(__name__)

DROPPED = "dropped"  # what a waiter receives when the router withdraws the destination


@dataclass
class _Entry:
    value: object  # a WanDestination or DROPPED
    at: float


class DestinationBoard:
    """Pairs late WAN destinations with the senders waiting for them (thread-safe).

    A destination posted before its sender asks is kept for ``ttl_s`` (at most ``capacity``
    of them); a sender that asks first leaves a callback that the post fires.
    """

    def __init__(self, ttl_s: float = 60.0, capacity: int = 10000, clock: Callable[[], float] = time.monotonic):
        self.ttl_s, self.capacity, self.clock = ttl_s, capacity, clock
        self._lock = threading.Lock()
        self._posted: "OrderedDict[int, _Entry]" = OrderedDict()
        self._waiters: dict[int, Callable[[object], None]] = {}
        self._seen: "OrderedDict[int, None]" = OrderedDict()  # rooms already given (409 on repeat)
        self._gone: "OrderedDict[int, None]" = OrderedDict()  # senders that stopped waiting (410)
        self.counters = Counter()

    def post(self, room: int, value: object) -> None:
        """A destination (or DROPPED) for ``room``; raises ControlError (409, 410, 503) on a repeat.
        DROPPED for a destination no sender has claimed yet withdraws it."""
        with self._lock:
            self._expire()
            entry = self._posted.get(room)
            if value is DROPPED and entry is not None and entry.value is not DROPPED:
                # Withdrawn before its sender claimed it (with TP: another rank refused it).
                self._posted[room] = _Entry(DROPPED, entry.at)
                self.counters["withdrawn"] += 1
                return
            if room in self._seen:
                self.counters["duplicate"] += 1
                raise ControlError.of("conflict", f"room {room} already has a WAN destination")
            if room in self._gone:
                # Tell the router now, rather than let MD wait for KV that will never come.
                self.counters["gone"] += 1
                raise ControlError.of("gone", f"room {room}: P no longer holds this request's KV "
                                            f"(finished or gave up waiting for its destination)")
            self._remember(self._seen, room)
            waiter = self._waiters.pop(room, None)
            if waiter is None:
                if len(self._posted) >= self.capacity:
                    self.counters["refused_full"] += 1
                    raise ControlError.of("busy", f"{self.capacity} destinations already wait for their requests")
                self._posted[room] = _Entry(value, self.clock())
                self.counters["early"] += 1
                return
            self.counters["late"] += 1
        waiter(value)  # outside the lock: the sender takes its own

    def wait_for(self, room: int, callback: Callable[[object], None]) -> Optional[object]:
        """The destination if already posted (returned, callback unused), else None and
        ``callback(value)`` fires when it is posted."""
        with self._lock:
            self._expire()
            entry = self._posted.pop(room, None)
            if entry is not None:
                return entry.value
            self._waiters[room] = callback
            return None

    def forget(self, room: int) -> None:
        """The sender is done (or gave up): no callback any more, and a destination posted
        from now on is refused with 410."""
        with self._lock:
            self._waiters.pop(room, None)
            self._posted.pop(room, None)
            self._remember(self._gone, room)

    def stats(self) -> dict:
        with self._lock:
            return dict(self.counters, waiting_senders=len(self._waiters), waiting_destinations=len(self._posted))

    def _remember(self, rooms: "OrderedDict[int, None]", room: int) -> None:
        """Remember a room for the 409/410 answers, the oldest forgotten past a bound."""
        rooms[room] = None
        if len(rooms) > 4 * self.capacity:
            rooms.popitem(last=False)

    def _expire(self) -> None:
        cutoff = self.clock() - self.ttl_s
        while self._posted:
            room, entry = next(iter(self._posted.items()))
            if entry.at >= cutoff:
                break
            del self._posted[room]
            self.counters["expired"] += 1


def parse_destination(body) -> tuple[int, WanDestination]:
    """(bootstrap_room, destination) from a POST body (JSON bytes or the parsed object);
    ControlError(400) names the problem."""
    if isinstance(body, (bytes, bytearray)):
        try:
            body = json.loads(body or b"{}")
        except (ValueError, RecursionError) as e:  # RecursionError: "[[[[..." nested past Python's stack
            raise bad_request(f"body is not JSON: {str(e)[:200]}") from None
    req = WanDestinationRequest.from_json(body)
    try:
        peer = parse_host_port("wan_peer", req.wan_peer)
        return req.bootstrap_room, WanDestination(req.md_room, peer, req.md_prefix_len, req.md_tp)
    except PddConfigError as e:
        raise bad_request(str(e)) from None
    except ValueError as e:  # MD's rank ports would pass 65535
        raise bad_request(f"md_tp: {e}") from None


class PrefillControlApi(ControlApi):
    """P's routes (protocol.routes.P_ROUTES) in front of a DestinationBoard. Every route but
    /health needs the router's signature (``auth``); a destination whose ``wan_peer`` is not
    one P was configured with (``peer_allowed``) is refused with 403. ``sends_wan`` False: the
    destinations are checked and acknowledged but not stored (no sender here would claim them).
    ``keep_only``: the WAN fan-out's (a room's KV goes behind the waited rooms'; False if it is
    not sending that room)."""

    def __init__(self, board: DestinationBoard, *, auth: ControlVerifier,
                 peer_allowed: Callable[[tuple[str, int]], bool], stats: Callable[[], dict] = dict,
                 tp_rank: int = 0, tp_size: int = 1, sends_wan: bool = True, max_md_tp: int = MAX_MD_TP,
                 destination_delay: Optional[InjectedDelay] = None,
                 keep_only: Callable[[int], bool] = lambda room: False):
        self.board, self.auth, self.peer_allowed, self.extra_stats = board, auth, peer_allowed, stats
        self.keep_only = keep_only
        self.sends_wan, self.max_md_tp = sends_wan, max_md_tp
        self.info = InfoReply(int(tp_rank), int(tp_size), bool(sends_wan))
        # test-only (injected_delays.py): none unless set when the server starts
        self.delay = destination_delay or InjectedDelay.from_env(P_DESTINATION_DELAY_ENV)
        self.routes = RouteTable({api.HEALTH: self.health, api.P_DESTINATION: self.destination, api.P_DROP: self.drop,
                                  api.P_KEPT: self.kept, api.P_INFO: self.get_info, api.STATS: self.stats})

    def health(self, call: JsonRequestHandler, query: str) -> HealthReply:
        return HealthReply()

    def destination(self, call: JsonRequestHandler, query: str) -> DestinationReply:
        room, dest = parse_destination(call.body)
        if dest.md_tp > self.max_md_tp:
            raise bad_request(f"md_tp {dest.md_tp} is over this P's --pdd-max-md-tp "
                              f"{self.max_md_tp} (WAN ports it dials per MD)")
        if not self.peer_allowed(dest.peer):
            raise ControlError.of("forbidden", f"wan_peer {'%s:%d' % dest.peer!r} is not one of this P's "
                                               f"--pdd-wan-peers; P sends KV only to the MDs it was given")
        if not self.sends_wan:
            return DestinationReply(sends_wan=False)
        self.delay.wait()
        self.board.post(room, dest)
        return DestinationReply()

    def drop(self, call: JsonRequestHandler, query: str, bootstrap_room: int) -> DropReply:
        if not self.sends_wan:
            return DropReply(sends_wan=False)
        self.board.post(bootstrap_room, DROPPED)
        return DropReply()

    def kept(self, call: JsonRequestHandler, query: str, bootstrap_room: int) -> KeptReply:
        return KeptReply(bool(self.sends_wan and self.keep_only(bootstrap_room)))

    def get_info(self, call: JsonRequestHandler, query: str) -> InfoReply:
        return self.info

    def stats(self, call: JsonRequestHandler, query: str) -> dict:
        return {**self.board.stats(), **self.extra_stats(), **self.info.to_json(),
                "control_server": call.server.stats()}

    def refused(self, call: JsonRequestHandler, error: ControlError) -> None:
        if call.command == "POST":
            logger.warning("WAN destination refused: %s", error)


class PrefillControlServer(ControlServer):
    """P's control API (``PrefillControlApi``) on its own stdlib server: P's scheduler process
    has no event loop of ours. ``port``: the configured port + ``tp_rank`` (module docstring).
    ``ssl_context`` (``--pdd-control-tls-*``): HTTPS only, the router's client certificate
    required; ``trusted_sources``: the router's addresses; ``names``: the hosts its CONTROL_URL
    may name (as MD's)."""

    PATH = api.P_DESTINATION.template

    def __init__(self, board: DestinationBoard, host: str, port: int, *, auth: ControlVerifier,
                 peer_allowed: Callable[[tuple[str, int]], bool], stats: Callable[[], dict] = dict,
                 max_connections: int = 256, tp_rank: int = 0, tp_size: int = 1, sends_wan: bool = True,
                 max_md_tp: int = MAX_MD_TP, ssl_context=None, trusted_sources=(),
                 names: Optional[Iterable[str]] = None, destination_delay: Optional[InjectedDelay] = None,
                 keep_only: Callable[[int], bool] = lambda room: False):
        control = PrefillControlApi(board, auth=auth, peer_allowed=peer_allowed, stats=stats, tp_rank=tp_rank,
                                    tp_size=tp_size, sends_wan=sends_wan, max_md_tp=max_md_tp,
                                    destination_delay=destination_delay, keep_only=keep_only)
        # Bodies are at most 64 KiB: 4 MiB held by requests being read at once is plenty.
        super().__init__(control, (host, port), thread_name="pdd-prefill-control", max_connections=max_connections,
                         max_body_bytes_in_flight=4 << 20, ssl_context=ssl_context,
                         trusted_sources=trusted_sources, names=names)
        logger.info("P control API on %s://%s:%s%s (TP rank %d of %d%s)", "https" if ssl_context else "http",
                    *self.address, self.PATH,
                    tp_rank, tp_size, "" if sends_wan else ", sends no KV over the WAN")
