"""The control plane's gate: the stdlib HTTP server every control API runs behind (MD's rooms
and P's WAN destinations, inside SGLang scheduler processes, which have no event loop of ours,
and the WAN emulator's), and the one request handler that admits, verifies and reads a call
before a route sees it (JSON in, JSON out). Each API is a control_api.ControlApi, served by
control_api.ControlServer on this module's server.

Nothing is reserved, buffered or waited on for a peer that has not proved the key:

  * a connection is admitted only within the server's caps (``ControlHTTPServer``): at most
    ``max_connections`` in all, and allow-listed sources first (sglang_pdd.admission: a
    source outside ``--pdd-control-trusted-sources`` holds at most ``per_source``
    unauthenticated connections, and all such sources together leave ``reserved`` slots to
    the allow-listed ones, each of which holds at most half of them). A valid call makes its
    source nothing more: a captured call replayed by whoever gets it here first verifies
    just as the router's own would;
  * its TLS handshake, then each request head (request line and headers), must arrive within
    a total deadline and a byte cap, however slowly it trickles;
  * every request passes one gate before a route runs (``parse_request``): a valid
    Content-Length under the route's cap (411/413/400); the head's signature, which covers the
    method, target, Host, time, nonce, Content-Length and the body's hash (control_auth; 401),
    and a Host that is one of this server's names; only then is the body's length reserved
    from the server's budget of bytes being read at once, within a share per source (503),
    and the body read, within its own deadline, and checked against the signed hash (401).

Errors are JSON with a clear message; internals (reprs, tracebacks) go to the log only.

With an ``ssl_context`` (``--pdd-control-tls-*``) a server speaks HTTPS only: each connection's
TLS handshake runs on its handler thread (a slow client cannot stall the accept loop), a
client without a certificate from the context's CA, or one speaking plain HTTP, is cut off
before a byte of HTTP is read. The signature gate stays as it is (defence in depth).
"""

from __future__ import annotations

import hashlib
import io
import ipaddress
import json
import logging
import math
import select
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterable, Optional
from urllib.parse import urlsplit

from sglang_pdd.admission import AdmissionLimits, AdmissionPolicy, source_of
from sglang_pdd.control.auth import HEADER, REPLY_HEADER, AuthError, ControlVerifier, SignedHead
from sglang_pdd.protocol import ControlError, Message, RouteTable

logger = logging.getLogger(__name__)

_CHUNK = 64 * 1024
_DRAIN_BYTES = 64 * 1024  # at most this much of a refused request's body is read (and dropped)


class ByteBudget:
    """Bytes of request bodies all of a server's connections may be reading at once: a
    request reserves its Content-Length before reading, or is refused (503). One source may
    hold at most ``per_source`` of them (None: no share of its own), unless ``capped`` is
    False for it (an allow-listed router)."""

    def __init__(self, limit: int, per_source: Optional[int] = None):
        self.limit, self.per_source, self.held = limit, per_source, 0
        self._by_source: dict = {}
        self._lock = threading.Lock()

    def take(self, n: int, source=None, capped: bool = True) -> bool:
        with self._lock:
            if self.held + n > self.limit:
                return False
            mine = self._by_source.get(source, 0)
            if capped and self.per_source is not None and mine + n > self.per_source:
                return False
            self.held += n
            self._by_source[source] = mine + n
            return True

    def give(self, n: int, source=None) -> None:
        with self._lock:
            self.held -= n
            left = self._by_source.get(source, 0) - n
            if left > 0:
                self._by_source[source] = left
            else:
                self._by_source.pop(source, None)


class HeadTooLarge(ConnectionError):
    """A request head past ``max_head_bytes``: answered with 431 and the connection closed."""


class DeadlineReader(io.RawIOBase):
    """The connection as a handler reads it. Each phase (a request head, a body) has a total
    deadline, and a head a byte cap: every recv waits at most for what is left of the phase
    (and at most ``per_read_s``), so a peer trickling a byte at a time is cut off at the
    phase's deadline, not only when it pauses for a whole read timeout."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.deadline, self.per_read_s, self.left = math.inf, None, None
        self.timed_out = False

    def phase(self, seconds: float, per_read_s: Optional[float] = None, max_bytes: Optional[int] = None) -> None:
        self.deadline, self.per_read_s, self.left = time.monotonic() + seconds, per_read_s, max_bytes

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left_s = self.deadline - time.monotonic()
        if left_s <= 0:
            self.timed_out = True
            raise socket.timeout("past the deadline")
        view = memoryview(buffer)
        if self.left is not None:
            if self.left <= 0:
                raise HeadTooLarge("request head too large")
            view = view[:self.left]
        self.sock.settimeout(min(left_s, self.per_read_s) if self.per_read_s else left_s)
        try:
            n = self.sock.recv_into(view)
        except socket.timeout:
            self.timed_out = time.monotonic() >= self.deadline
            raise
        if self.left is not None:
            self.left -= n
        return n


class _RefusalLog:
    """At most ``burst`` refusal warnings per ``period_s``, then one line with the count, so
    an outsider's flood of unsigned calls cannot flood the server's log."""

    def __init__(self, burst: int = 20, period_s: float = 10.0, clock=time.monotonic):
        self.burst, self.period_s, self.clock = burst, period_s, clock
        self._lock = threading.Lock()
        self._start, self._count = -period_s, 0

    def warn(self, fmt: str, *args) -> None:
        with self._lock:
            now = self.clock()
            if now - self._start >= self.period_s:
                if self._count > self.burst:
                    logger.warning("control: %d more refused requests not logged", self._count - self.burst)
                self._start, self._count = now, 0
            self._count += 1
            if self._count > self.burst:
                return
        logger.warning(fmt, *args)


_refusals = _RefusalLog()


class JsonRequestHandler(BaseHTTPRequestHandler):
    auth: Optional[ControlVerifier] = None  # None: unauthenticated (only the WAN emulator's test endpoint)
    open_paths = frozenset({"/health"})  # answered without a signature
    max_body_bytes = 64 * 1024
    timeout = 30  # seconds a read may stall before the connection is dropped
    # Over TLS the server keeps connections alive (HTTP/1.1, see ControlHTTPServer): how long
    # one may sit idle between requests. Above the router's 2 s (BACKEND_KEEPALIVE_S), so the
    # router retires an idle connection before the server cuts it under a request.
    keepalive_idle_s = 5.0
    head_deadline_s = 10.0  # seconds for a whole request head (line and headers), however it trickles in
    max_head_bytes = 64 * 1024  # a request head past this is refused (431): the router's are under 1 KiB
    body_deadline_s = 30.0  # seconds for a whole body, however it trickles in
    server_version = "sglang-pdd"
    sys_version = ""  # no Python version in the Server header
    body: bytes = b""
    request_sig: Optional[str] = None  # the verified request's signature
    _replied = False

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the plain file object over the socket: reads go through the deadlines
        self._reader = DeadlineReader(self.connection)
        self.rfile = io.BufferedReader(self._reader)

    def parse_request(self) -> bool:
        """http.server's parse, then the signature and the body: the single gate every
        request passes before any do_* route runs. Everything that can be refused without the
        body is refused before a byte of it is read, reserved or waited for: the length and
        the route's cap, then the signed head (which covers the length and the body's hash)
        and this server's name in it. Only a head signed with the key gets its body read,
        within the server's budget of bytes held by all requests being read (and a share per
        source), hashed as it comes and checked against the signed hash."""
        if not super().parse_request():
            return False
        self._replied, self._body_read, self._reserved, self.request_sig = False, True, 0, None
        try:
            length = self._content_length()
            cap = self.body_cap(self.command, urlsplit(self.path).path)
            if length > cap:
                raise ControlError.of("too_large", f"body of {length} bytes exceeds this API's limit of {cap}")
            head = self._authenticate_head(length)
            self._reserve(length)
            self.body, digest = self._read_body(length)
            if head is not None:
                self._check_body(head, digest)
        except ControlError as e:
            self.close_connection = True  # the rest of the stream is not trusted
            self._reply(e.status, e.to_json(), headers=e.headers)
            self._drain_unread()
            self._unreserve()
            return False
        return True

    def body_cap(self, method: str, path: str) -> int:
        """The largest body this route takes (subclasses narrow it per route)."""
        return self.max_body_bytes

    # The server's routes (protocol.RouteTable; control_api.ControlApi's bound methods): each
    # handler is called as ``handler(self, query, **path_params)`` and returns the 200 reply (a protocol message or
    # a dict), or None when it answered itself (a relayed stream); a ControlError it raises is
    # answered with its status. None: the subclass serves its own do_* methods.
    routes: Optional[RouteTable] = None

    def do_GET(self):  # noqa: N802 — http.server's naming
        self.dispatch()

    def do_POST(self):  # noqa: N802
        self.dispatch()

    def do_DELETE(self):  # noqa: N802
        self.dispatch()

    def dispatch(self) -> None:
        url = urlsplit(self.path)
        if self.routes is None:
            raise ControlError.of("not_found", f"no route {self.command} {url.path[:200]}")
        try:
            handler, params = self.routes.resolve(self.command, url.path)
        except ControlError as e:
            if e.status != 404:
                raise  # a malformed room id: the connection is not trusted further
            return self._reply(e.status, e.to_json())
        try:
            result = handler(self, url.query, **params)
        except ControlError as e:
            self.refused(e)
            return self._reply(e.status, e.to_json(), headers=e.headers)
        if result is not None:
            self._reply(200, result.to_json() if isinstance(result, Message) else result)

    def refused(self, error: ControlError) -> None:
        """A route refused its request (subclasses log the ones worth a line)."""

    def handle_one_request(self):
        if getattr(self, "_served_one", False):  # a kept-alive connection waits for its next request
            self._reader.phase(self.keepalive_idle_s + self.head_deadline_s, self.keepalive_idle_s,
                               self.max_head_bytes)
        else:
            self._reader.phase(self.head_deadline_s, self.timeout, self.max_head_bytes)
        self._served_one = True
        try:
            super().handle_one_request()
        except ControlError as e:  # a route refused the request (e.g. a malformed room id)
            self.close_connection = True
            if not self._replied:
                self._reply(e.status, e.to_json(), headers=e.headers)
        except HeadTooLarge:
            self.close_connection = True
            _refusals.warn("control request head from %s over %d bytes refused", self.client_address[0],
                           self.max_head_bytes)
            self._raw_reply(_HEAD_TOO_LARGE)
        except (ConnectionError, socket.timeout):
            self.close_connection = True
        except Exception:  # noqa: BLE001 — a route's bug: log it, answer without internals
            logger.exception("control request %s %s failed", self.command, (self.path or "")[:200])
            self.close_connection = True
            if not self._replied:
                self._reply(500, {"error": "internal error; details are in the server's log"})
        finally:
            self.body = b""
            self._unreserve()
            if self._reader.timed_out and not self._replied:
                self._reader.timed_out = False
                count = getattr(self.server, "count", None)
                if count is not None:
                    count("head_timeouts")

    def _raw_reply(self, data: bytes) -> None:
        try:
            self.wfile.write(data)
            self.wfile.flush()
        except OSError:
            pass

    def _content_length(self) -> int:
        if self.headers.get("Transfer-Encoding"):
            raise ControlError.of("length_required",
                                  "Transfer-Encoding is not supported; send the body with a Content-Length")
        values = self.headers.get_all("Content-Length") or []
        if not values:
            if self.command in ("POST", "PUT", "PATCH"):
                raise ControlError.of("length_required", "Content-Length is required")
            return 0
        raw = values[0].strip()
        if any(v.strip() != raw for v in values[1:]):
            raise ControlError.of("bad_request", "conflicting Content-Length headers")
        if not (raw.isascii() and raw.isdigit()) or len(raw) > 15:
            raise ControlError.of("bad_request", "Content-Length must be a non-negative decimal integer")
        return int(raw)

    def _needs_auth(self) -> bool:
        return self.auth is not None and urlsplit(self.path).path not in self.open_paths

    def _authenticate_head(self, length: int) -> Optional[SignedHead]:
        """The signed head (control_auth.verify_head) and this server's name in it; a
        connection whose head verified no longer counts as unauthenticated (admission)."""
        if not self._needs_auth():
            return None
        host = self.headers.get("Host")
        serves = getattr(self.server, "serves_host", None)
        try:
            if serves is not None and not serves(host):
                raise AuthError(f"request for another server: Host {str(host)[:100]!r} is not one of this "
                                f"server's names (its listen address, its TLS certificate's names, "
                                f"--pdd-control-names)")
            head = self.auth.verify_head(self.command, self.path, host, length, self.headers.get(HEADER))
        except AuthError as e:
            self._refused(e)
        self.request_sig = head.sig  # its reply is signed, bound to it
        head_verified = getattr(self.server, "head_verified", None)
        if head_verified is not None:
            head_verified(self.client_address)
        return head

    def _check_body(self, head: SignedHead, digest: str) -> None:
        try:
            self.auth.check_body(head, digest)
        except AuthError as e:
            self.request_sig = None  # nothing of this request is answered as if it were signed
            self._refused(e)

    def _reserve(self, length: int) -> None:
        budget = getattr(self.server, "body_budget", None)
        if budget is None or length == 0:
            return
        source, capped = self.server.budget_source(self.client_address)
        if not budget.take(length, source, capped):
            raise ControlError.of("busy", f"too many control request bodies being read at once (over "
                                 f"{budget.limit} bytes, or this source's share); retry shortly",
                                 headers={"Retry-After": "1"})
        self._reserved, self._reserved_source = length, source

    def _unreserve(self) -> None:
        if getattr(self, "_reserved", 0):
            self.server.body_budget.give(self._reserved, self._reserved_source)
            self._reserved = 0

    def _read_body(self, length: int) -> tuple[bytes, str]:
        """The body, read in chunks (memory grows with what arrived, not with what was
        announced) within ``body_deadline_s`` in all, and its SHA-256 (hex)."""
        digest, parts, got = hashlib.sha256(), [], 0
        self._body_read = length == 0
        self._reader.phase(self.body_deadline_s, self.timeout)
        try:
            while got < length:
                try:
                    chunk = self.rfile.read1(min(_CHUNK, length - got))
                except socket.timeout:
                    raise ControlError.of("timeout", f"body not received within {self.body_deadline_s:g} s") from None
                if not chunk:
                    raise ControlError.of("bad_request", f"body ended after {got} of {length} bytes")
                digest.update(chunk)
                parts.append(chunk)
                got += len(chunk)
        finally:
            self._reader.timed_out = False  # answered (408), not a silent cut
            self._reader.phase(math.inf)
            self.connection.settimeout(self.timeout)  # for the reply's writes
        self._body_read = True
        return b"".join(parts), digest.hexdigest()

    def _drain_unread(self) -> None:
        """After a refusal with the body unread: a short, bounded drain (discarded) so that a
        client still sending a small body reads the answer instead of a reset."""
        if self._body_read:
            return
        try:
            self.wfile.flush()
            self.connection.settimeout(0.2)
            left = _DRAIN_BYTES
            while left > 0 and (chunk := self.connection.recv(min(left, _CHUNK))):
                left -= len(chunk)
        except OSError:
            pass

    def reply_signature(self, status: int, body: bytes) -> dict:
        """The header signing this reply, for a request that was signed (else none)."""
        if self.request_sig is None:
            return {}
        return {REPLY_HEADER: self.auth.sign_reply(self.request_sig, status, body)}

    def _refused(self, e: AuthError):
        _refusals.warn("control %s %s from %s refused: %s", self.command, self.path[:200],
                       self.client_address[0], e)
        raise ControlError(e.status, "unauthorized" if e.status == 401 else "busy", str(e)) from None

    def json_body(self) -> dict:
        """The body as a JSON object (an empty body is ``{}``); ControlError(400) otherwise."""
        try:
            body = json.loads(self.body or b"{}")
        except (ValueError, RecursionError):  # RecursionError: "[[[[..." nested past Python's stack
            raise ControlError.of("bad_request", "body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ControlError.of("bad_request", "body must be a JSON object")
        return body

    def reply_bytes(self, status: int, content_type: str, body: bytes) -> None:
        """Answer with ``body`` as it is (a relayed reply), signed, and close the connection."""
        self._replied = True
        self.close_connection = True
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        for name, value in self.reply_signature(status, body).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def begin_stream(self, content_type: str) -> None:
        """A 200 whose body the route then writes to ``wfile`` until it closes the connection
        (a relayed event stream: each event signed on its own, control_auth.sign_event)."""
        self._replied = True
        self.close_connection = True
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Connection", "close")
        self.end_headers()

    def _reply(self, status: int, body: dict, headers: Optional[dict] = None) -> None:
        data = json.dumps(body).encode()
        self._replied = True
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in {**(headers or {}), **self.reply_signature(status, data)}.items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, fmt, *args):  # access logs at debug level: the server log stays readable
        logger.debug("control %s " + fmt, self.client_address[0], *args)


_BUSY_BODY = b'{"error": "too many open control connections; retry shortly"}'
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
         b"Retry-After: 1\r\nContent-Length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY))
_HEAD_BODY = b'{"error": "request head too large"}'
_HEAD_TOO_LARGE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Type: application/json\r\n"
                   b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_HEAD_BODY), _HEAD_BODY))
_WILDCARDS = ("", "0.0.0.0", "::")


def control_admission(max_connections: int, trusted=(), per_source: int = 16,
                      reserved: Optional[int] = None) -> AdmissionLimits:
    """Allow-listed sources first on a control server (sglang_pdd.admission): of
    ``max_connections``, a source outside ``trusted`` (the router's addresses,
    ``--pdd-control-trusted-sources``) holds at most ``per_source`` unauthenticated ones, and
    ``reserved`` (default: a quarter) are left to the allow-listed; one allow-listed source
    holds at most half of them (a flood from behind the router's own address).

    A valid signed call makes its source nothing more (``known_on_authentication=False``):
    unlike the KV handshake's challenge, a signed call can be replayed, and a relay on the
    path that sends a captured call before the router's own copy verifies as the router
    would. Only the allow-list takes the reserved slots, so no number of such addresses,
    with any flood beside them, can keep the router out."""
    reserved = max_connections // 4 if reserved is None else reserved
    return AdmissionLimits(max_handshaking=max_connections, per_source=min(per_source, max_connections),
                           reserved=reserved, per_known_source=max(1, max_connections // 2), trusted=tuple(trusted),
                           known_on_authentication=False,
                           per_source_flag="the control server's per-source cap",
                           trusted_flag="--pdd-control-trusted-sources", what="unauthenticated connections")


def parse_authority(value: Optional[str], default_port: int) -> Optional[tuple[str, int]]:
    """(host, port) of a Host header value (lower case, IPv6 without brackets, the scheme's
    port when none is given); None when it is not one."""
    if not value or not value.isascii() or any(c in value for c in "/?#@ \t"):
        return None
    try:
        parts = urlsplit("//" + value.strip())
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    return (host.rstrip("."), default_port if port is None else port) if host else None


def name_authority(name: str, port: int) -> Optional[tuple[str, int]]:
    """(host, port) that a server name stands for: a host (an IPv6 address bare or bracketed)
    at the server's own ``port``, or ``host:port``: a proxy in front of the server that
    listens on another port (a TCP proxy forwards the Host the router signed, which names the
    proxy). None when it is not a name, or its port is not 1-65535."""
    name = name.strip()
    try:
        if ipaddress.ip_address(name).version == 6:
            name = f"[{name}]"
    except ValueError:
        pass
    authority = parse_authority(name, port)
    return authority if authority is not None and 0 < authority[1] < 65536 else None


class ControlHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with bounded connections: at most ``max_connections`` handler
    threads, and of the connections that have not sent a validly signed request yet,
    allow-listed sources first (``admission``, see control_admission). A connection past either gets an
    immediate 503 and is closed (a TLS one is closed: it could not read a plain-text 503),
    instead of one more thread each.

    ``names``: the host names and addresses this server answers to; a signed request whose
    Host is not one of them (at this server's port) is refused (401): a call signed for one
    MD does not verify on another. Default: the address it is bound to (any host, on a
    wildcard bind).

    ``ssl_context`` (a server context requiring client certificates): HTTPS only, the
    handshake on the connection's handler thread within ``handshake_timeout_s`` in total.
    Connections are then kept alive (HTTP/1.1): a handshake per call would add a key exchange
    and, across the WAN, a round trip to every control call. Without TLS the server answers
    HTTP/1.0, one connection per call, as it always has."""

    daemon_threads = True
    handshake_timeout_s = 10.0
    request_queue_size = 128  # the listen backlog: accepted connections waiting for the accept loop

    def __init__(self, address, handler, max_connections: int = 128, max_body_bytes_in_flight: int = 64 << 20,
                 ssl_context: Optional[ssl.SSLContext] = None, admission: Optional[AdmissionLimits] = None,
                 names: Optional[Iterable[str]] = None, body_share_per_source: Optional[int] = None):
        if ssl_context is not None:
            # TCP_NODELAY: a reply is written as headers then body; on a kept-alive connection
            # Nagle holds the body back for the client's delayed ACK (measured: 44 ms a call).
            handler = type(handler.__name__, (handler,), {"protocol_version": "HTTP/1.1",
                                                          "disable_nagle_algorithm": True})
        super().__init__(address, handler)
        self.ssl_context = ssl_context
        self.max_connections = max_connections
        # A source's share of the bodies being read (an allow-listed one has none of its own).
        share = max_body_bytes_in_flight // 2 if body_share_per_source is None else body_share_per_source
        self.body_budget = ByteBudget(max_body_bytes_in_flight, share)
        self.policy = AdmissionPolicy(admission or control_admission(max_connections))
        self._tickets: dict = {}  # client address -> its admission Ticket, until it authenticates or leaves
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Lock()
        self.in_use = 0  # connections holding a handler thread now
        self.counters = {"refused_busy": 0, "refused_per_source": 0, "refused_unknown": 0, "tls_refused": 0,
                         "head_timeouts": 0}
        port = self.server_address[1]
        bound = self.server_address[0]
        hosts = set(names or ()) | ({bound} if bound not in _WILDCARDS else set())
        if names is None and bound in _WILDCARDS:
            self._names = None  # a wildcard bind with no names given: any host, this port
        else:
            self._names = {h for h in (name_authority(n, port) for n in hosts) if h}

    # the counters that readers name as attributes
    @property
    def tls_refused(self) -> int:
        return self.counters["tls_refused"]

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def stats(self) -> dict:
        with self._lock:
            return {**self.counters, "connections": self.in_use, **self.policy.stats()}

    def serves_host(self, host: Optional[str]) -> bool:
        """Whether a request's Host header names this server (at its port)."""
        port = self.server_address[1]
        authority = parse_authority(host, 443 if self.ssl_context is not None else 80)
        if authority is None:
            return False
        if self._names is None:
            return authority[1] == port
        return authority in self._names

    def budget_source(self, client_address) -> tuple[object, bool]:
        """(the unit a body share counts, whether the share applies): allow-listed sources
        have no share of their own, only the whole budget."""
        try:
            source = source_of(client_address[0])
        except ValueError:
            return client_address[0], True
        trusted = self.policy.limits.trusted
        addr = source.network_address if isinstance(source, ipaddress.IPv6Network) else source
        return source, not any(addr.version == net.version and addr in net for net in trusted)

    def head_verified(self, client_address) -> None:
        """The connection sent a validly signed request head: it no longer counts as
        unauthenticated (its source stays what it was: see control_admission)."""
        with self._lock:
            ticket = self._tickets.pop(client_address, None)
            if ticket is not None:
                self.policy.release(ticket)

    def process_request(self, request, client_address):
        why = None
        if not self._slots.acquire(blocking=False):
            why, counter = f"{self.max_connections} connections already", "refused_busy"
        else:
            with self._lock:
                ticket, why, counter = self.policy.admit(client_address[0], time.monotonic())
                if ticket is not None:
                    self._tickets[client_address] = ticket
            if ticket is None:
                self._slots.release()
                counter = "refused_busy" if counter == "refused" else counter
        if why:
            self.count(counter)
            _refusals.warn("control connection from %s refused: %s", client_address[0], why)
            try:
                if self.ssl_context is None:  # a TLS client could not read a plain-text 503
                    request.sendall(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        self._count(+1)
        try:
            super().process_request(request, client_address)
        except BaseException:  # the thread did not start: give its slot back
            self._leave(client_address)
            self.shutdown_request(request)
            logger.exception("control server could not start a handler thread")

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._leave(client_address)

    def _leave(self, client_address) -> None:
        with self._lock:
            ticket = self._tickets.pop(client_address, None)
            if ticket is not None:
                self.policy.release(ticket)
            self.in_use -= 1
        self._slots.release()

    def finish_request(self, request, client_address):
        if self.ssl_context is None:
            return super().finish_request(request, client_address)
        tls = self._handshake(request, client_address)
        if tls is None:
            return
        try:
            super().finish_request(tls, client_address)
        finally:
            # wrap_socket took the descriptor over from ``request``: socketserver's own
            # shutdown_request closes only the emptied shell, this closes the connection.
            try:
                tls.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            tls.close()

    def _handshake(self, sock: socket.socket, client_address) -> Optional[ssl.SSLSocket]:
        """The TLS handshake within ``handshake_timeout_s`` in total from here, however the
        peer spaces its bytes: non-blocking steps, each waiting at most for what is left."""
        deadline = time.monotonic() + self.handshake_timeout_s
        tls = None
        try:
            sock.setblocking(False)
            tls = self.ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            while True:
                try:
                    tls.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    wait = ([tls], [])
                except ssl.SSLWantWriteError:
                    wait = ([], [tls])
                left = deadline - time.monotonic()
                if left <= 0 or not any(select.select(*wait, [], left)[:2]):
                    raise socket.timeout(f"TLS handshake not done within {self.handshake_timeout_s:g} s")
            tls.setblocking(True)
            return tls
        except (ssl.SSLError, OSError) as e:  # incl. socket.timeout
            self.count("tls_refused")
            _refusals.warn("control TLS handshake from %s refused: %s", client_address[0], e)
            (tls or sock).close()
            return None

    def _count(self, delta: int) -> None:
        with self._lock:
            self.in_use += delta


def serve_in_thread(server: ControlHTTPServer, name: str) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, name=name, daemon=True)
    thread.start()
    return thread
