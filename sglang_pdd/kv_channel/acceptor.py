"""Accepting authenticated TCP streams, bounded: the shared front door of the KV channels.

``WanKvReceiver`` (WAN, MD) and ``TcpTransferEngine`` (intra-DC) both serve one thread per
connection behind a handshake. What an outsider can do to such a server before it has
authenticated is limited here, once for both:

  * at most ``max_connections`` connections, of which at most ``max_handshaking`` are still
    in their handshake; excess connections are closed at once and logged (rate-limited);
  * known peers first (``sglang_pdd.admission.AdmissionPolicy``): one source address (an
    IPv6 /64) that is not known may hold at most ``per_source`` handshakes, and all unknown
    sources together at most ``max_handshaking - reserved``; the ``reserved`` slots are for
    known peers, i.e. sources in the allow-list (``trusted``), announced by an authenticated
    control call (``announce``: on MD, the router's P hosts) or that authenticated recently.
    A flood of keyless sockets from a few hosts (or many) then cannot keep a known P out;
  * the handshake has a TOTAL deadline (``handshake_deadline`` seconds from accept): a peer
    that trickles bytes (slowloris) is cut off then, whatever its per-recv timing;
  * a thread that cannot be started (thread exhaustion) costs that one connection, never
    the accept loop: it is refused, logged, and the loop backs off briefly and goes on.

The owner's ``serve(slot)`` runs on the connection's thread; it calls
``slot.authenticated()`` once the handshake passed (and sets ``slot.sock`` if it wraps the
socket, e.g. TLS, so the deadline can still cut it off). The socket is closed when
``serve`` returns.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Callable, Iterable, Optional

from sglang_pdd.admission import (AdmissionLimits, AdmissionPolicy, IpNetwork, Ticket,  # noqa: F401 (re-exported)
                                  parse_networks, source_of)
from sglang_pdd.machine import Driver

from . import handshake_slot
from .handshake_slot import SlotPhase

logger = logging.getLogger(__name__)

_POLL_S = 0.2  # how often the accept loop checks handshake deadlines
_BACKOFF_S = 0.05  # after a failed thread start
_LOG_EVERY_S = 5.0  # refusals are logged at most this often (a flood must not flood the log)
_PASSED, _SERVE_ENDED = handshake_slot.HandshakePassed(), handshake_slot.ServeEnded()


class Slot:
    """One accepted connection: ``handshake`` -> ``authenticated``, or -> ``expired`` (the
    deadline cut it off) or ``failed`` (``serve`` returned without authenticating); the course
    is handshake_slot.py's machine."""

    def __init__(self, sock: socket.socket, addr, deadline: float,
                 on_leave: Optional[Callable[["Slot", bool], None]] = None, ticket: Optional[Ticket] = None):
        self.sock = sock
        self.addr = addr
        self.peer = f"{addr[0]}:{addr[1]}"
        self.deadline = deadline
        self.slot_state = handshake_slot.SlotState(deadline)  # changed only by _step
        self.ticket = ticket
        self._on_leave = on_leave  # the acceptor's: frees the handshake slot, once
        self._lock = threading.Lock()

    @property
    def state(self) -> str:
        return self.slot_state.phase.value

    @property
    def handshaking(self) -> bool:
        return self.slot_state.phase is SlotPhase.HANDSHAKE

    def _step(self, event: handshake_slot.Event) -> bool:
        """The slot's one way to change: the transition under the slot's lock, its action
        outside it; True when it left its handshake now."""
        with self._lock:
            actions = _SLOT.advance(self, event)
        for action in actions:  # at most one LeaveHandshake, ever
            _SLOT.perform(self, action)
        return bool(actions)

    def _leave_handshake(self, action: handshake_slot.LeaveHandshake) -> None:
        if self._on_leave is not None:
            self._on_leave(self, action.authenticated)

    def authenticated(self) -> bool:
        """The handshake passed: no longer subject to its deadline. False if the deadline
        already cut the connection off (the caller should then stop)."""
        self._step(_PASSED)
        return self.slot_state.phase is SlotPhase.AUTHENTICATED

    @property
    def expired(self) -> bool:
        """The handshake deadline cut this connection off."""
        return self.slot_state.phase is SlotPhase.EXPIRED

    def _expire(self, now: float) -> bool:
        return self._step(handshake_slot.DeadlineChecked(now))  # authenticated() now answers False

    def _failed(self) -> bool:
        return self._step(_SERVE_ENDED)

    def shutdown(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


# A slot's one way to change: its machine, and Slot's method for its one action.
_SLOT = Driver(handshake_slot.transition, {handshake_slot.LeaveHandshake: Slot._leave_handshake}, state="slot_state")


class Acceptor:
    def __init__(
        self,
        listener: socket.socket,
        serve: Callable[[Slot], None],
        *,
        name: str,
        max_connections: int = 256,
        admission: AdmissionLimits = AdmissionLimits(),
        handshake_deadline: float = 5.0,
        start_thread: Callable[[threading.Thread], None] = threading.Thread.start,
    ):
        if max_connections < 1 or handshake_deadline <= 0:
            raise ValueError("max_connections and handshake_deadline must be positive")
        self.listener = listener
        self.serve = serve
        self.name = name
        self.max_connections = max_connections
        self.policy = AdmissionPolicy(admission)  # guarded by self._lock
        self.handshake_deadline = handshake_deadline
        self._start_thread = start_thread  # a seam for tests of thread exhaustion
        self._lock = threading.Lock()
        self._slots: set[Slot] = set()
        self._threads: set[threading.Thread] = set()
        self._closed = False
        self._last_log = 0.0
        self.counters = {"accepted": 0, "refused": 0, "refused_per_source": 0, "refused_unknown": 0,
                         "handshake_timeouts": 0, "thread_start_failures": 0}
        listener.settimeout(_POLL_S)
        self._thread = threading.Thread(target=self._loop, name=f"kv-accept-{name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ owner API

    def stats(self) -> dict:
        with self._lock:
            return {
                **self.counters,
                "connections": len(self._slots),
                "handshaking": sum(s.handshaking for s in self._slots),
                "threads_alive": sum(t.is_alive() for t in self._threads),
                **self.policy.stats(),
            }

    def announce(self, networks: Iterable[IpNetwork]) -> int:
        """Known peers from an authenticated control call (in place of the last ones)."""
        with self._lock:
            return self.policy.announce(networks)

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting, cut every connection, join every thread (within ``timeout``)."""
        with self._lock:
            self._closed = True
            slots = list(self._slots)
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        for slot in slots:
            slot.shutdown()
        deadline = time.monotonic() + timeout
        self._thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------ internals

    def _loop(self) -> None:
        while True:
            self._reap(time.monotonic())
            try:
                sock, addr = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return  # listener closed
            self._admit(sock, addr)

    def _refuse(self, sock: socket.socket, addr, why: str, counter: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.counters[counter] += 1
            if counter != "refused":
                self.counters["refused"] += 1
            total = self.counters["refused"]
            quiet = now - self._last_log < _LOG_EVERY_S
            if not quiet:
                self._last_log = now
        if not quiet:
            logger.warning("%s: refusing %s:%s: %s (%d refused so far)", self.name, addr[0], addr[1], why, total)
        sock.close()  # last: whoever sees the close also sees the count and the log

    def _admit(self, sock: socket.socket, addr) -> None:
        now = time.monotonic()
        with self._lock:
            if self._closed:
                sock.close()
                return
            full = len(self._slots) >= self.max_connections
            ticket, why, counter = (None, f"{self.max_connections} connections already", "refused") if full \
                else self.policy.admit(addr[0], now)
        if ticket is None:
            return self._refuse(sock, addr, why, counter)
        sock.settimeout(None)  # accepted sockets inherit the listener's poll timeout
        slot = Slot(sock, addr, now + self.handshake_deadline, self._left_handshake, ticket)
        thread = threading.Thread(target=self._run, args=(slot,), daemon=True, name=f"kv-{self.name}-{slot.peer}")
        with self._lock:
            self._slots.add(slot)
            self._threads = {t for t in self._threads if t.is_alive()}
            self._threads.add(thread)
            self.counters["accepted"] += 1
        try:
            self._start_thread(thread)
        except RuntimeError as e:  # "can't start new thread": keep accepting, just not this one
            slot._failed()
            with self._lock:
                self._slots.discard(slot)
                self._threads.discard(thread)
            self._refuse(sock, addr, f"cannot start a thread ({e})", "thread_start_failures")
            time.sleep(_BACKOFF_S)

    def _left_handshake(self, slot: Slot, authenticated: bool) -> None:
        with self._lock:
            self.policy.release(slot.ticket)
            if authenticated:
                self.policy.authenticated(slot.ticket, time.monotonic())

    def _run(self, slot: Slot) -> None:
        try:
            self.serve(slot)
        except Exception:  # the owner's serve should not raise; never let it go unnoticed
            logger.exception("%s: error serving %s", self.name, slot.peer)
        finally:
            slot._failed()  # serve returned still in its handshake (refused peer)
            with self._lock:
                self._slots.discard(slot)
            try:
                slot.sock.close()
            except OSError:
                pass

    def _reap(self, now: float) -> None:
        with self._lock:
            slots = list(self._slots)
        expired = [s for s in slots if s._expire(now)]
        if expired:
            with self._lock:
                self.counters["handshake_timeouts"] += len(expired)
            for slot in expired:
                slot.shutdown()  # wakes the serving thread's recv
            logger.warning("%s: cut off %d peer(s) still in their handshake after %.1fs: %s", self.name,
                           len(expired), self.handshake_deadline, ", ".join(s.peer for s in expired[:5]))
