"""The JSON side of the small stdlib HTTP control APIs: MD's rooms and P's WAN destinations
(inside SGLang scheduler processes, which have no event loop of ours) and the WAN emulator's.

Every request passes one gate before a route runs (``parse_request``): the body is read only
with a valid Content-Length under the route's cap (411/413/400), only after the signature
header's shape and time check out (control_auth; 401), and only within the server's budget of
bytes being read at once (503); its MAC is then checked over the body as read (401). Errors are JSON with a
clear message; internals (reprs, tracebacks) go to the log only.

With an ``ssl_context`` (``--pdd-control-tls-*``) a server speaks HTTPS only: each connection's
TLS handshake runs on its handler thread (a slow client cannot stall the accept loop), a
client without a certificate from the context's CA, or one speaking plain HTTP, is cut off
before a byte of HTTP is read. The signature gate stays as it is (defence in depth).
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional
from urllib.parse import urlsplit

from sglang_pdd.control_auth import HEADER, REPLY_HEADER, AuthError, ControlVerifier
from sglang_pdd.protocol import ControlError, Message, RouteTable

logger = logging.getLogger(__name__)

_CHUNK = 64 * 1024
_DRAIN_BYTES = 64 * 1024  # at most this much of a refused request's body is read (and dropped)


class ByteBudget:
    """Bytes of request bodies all of a server's connections may be reading at once: a
    request reserves its Content-Length before reading, or is refused (503)."""

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self.held + n > self.limit:
                return False
            self.held += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.held -= n


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
    body_deadline_s = 30.0  # seconds for a whole body, however it trickles in
    server_version = "sglang-pdd"
    sys_version = ""  # no Python version in the Server header
    body: bytes = b""
    request_sig: Optional[str] = None  # the verified request's signature
    _replied = False

    def parse_request(self) -> bool:
        """http.server's parse, then the body and the signature: the single gate every
        request passes before any do_* route runs. Everything that can be refused without the
        body is refused before a byte of it is read (length, the route's cap, the signature
        header's presence, shape and time); the body is then read in chunks, within the
        server's budget of bytes held by all requests being read, hashed as it comes, and the
        MAC checked over that hash."""
        if not super().parse_request():
            return False
        self._replied, self._body_read, self._reserved, self.request_sig = False, True, 0, None
        try:
            length = self._content_length()
            cap = self.body_cap(self.command, urlsplit(self.path).path)
            if length > cap:
                raise ControlError.of("too_large", f"body of {length} bytes exceeds this API's limit of {cap}")
            parsed = self._precheck()
            self._reserve(length)
            self.body, digest = self._read_body(length)
            self._authenticate(parsed, digest)
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

    # The server's routes (protocol.RouteTable): each handler is called as
    # ``handler(self, query, **path_params)`` and returns the 200 reply (a protocol message or
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
            self.connection.settimeout(self.keepalive_idle_s)
        self._served_one = True
        try:
            super().handle_one_request()
        except ControlError as e:  # a route refused the request (e.g. a malformed room id)
            self.close_connection = True
            if not self._replied:
                self._reply(e.status, e.to_json(), headers=e.headers)
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

    def _precheck(self):
        if not self._needs_auth():
            return None
        try:
            return self.auth.precheck(self.headers.get(HEADER))
        except AuthError as e:
            self._refused(e)

    def _reserve(self, length: int) -> None:
        budget = getattr(self.server, "body_budget", None)
        if budget is None or length == 0:
            return
        if not budget.take(length):
            raise ControlError.of("busy", f"too many control request bodies being read at once (over "
                                 f"{budget.limit} bytes); retry shortly", headers={"Retry-After": "1"})
        self._reserved = length

    def _unreserve(self) -> None:
        if getattr(self, "_reserved", 0):
            self.server.body_budget.give(self._reserved)
            self._reserved = 0

    def _read_body(self, length: int) -> tuple[bytes, str]:
        """The body, read in chunks (memory grows with what arrived, not with what was
        announced) within ``body_deadline_s`` in all, and its SHA-256 (hex)."""
        digest, parts, got = hashlib.sha256(), [], 0
        self._body_read = length == 0
        deadline = time.monotonic() + self.body_deadline_s
        sock = self.connection
        try:
            while got < length:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ControlError.of("timeout", f"body not received within {self.body_deadline_s:g} s")
                sock.settimeout(min(left, self.timeout or left))
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
            sock.settimeout(self.timeout)
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

    def _authenticate(self, parsed, digest: str) -> None:
        if parsed is None:
            return
        try:
            self.auth.verify_digest(self.command, self.path, parsed, digest)
        except AuthError as e:
            self._refused(e)
        self.request_sig = parsed[2]  # its reply is signed, bound to it

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


class ControlHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with at most ``max_connections`` handler threads: past that a
    connection gets an immediate 503 and is closed, instead of one more thread each.

    ``ssl_context`` (a server context requiring client certificates): HTTPS only, the
    handshake on the connection's handler thread within ``handshake_timeout_s`` per read.
    Connections are then kept alive (HTTP/1.1): a handshake per call would add a key exchange
    and, across the WAN, a round trip to every control call. Without TLS the server answers
    HTTP/1.0, one connection per call, as it always has."""

    daemon_threads = True
    handshake_timeout_s = 10.0

    def __init__(self, address, handler, max_connections: int = 128, max_body_bytes_in_flight: int = 64 << 20,
                 ssl_context: Optional[ssl.SSLContext] = None):
        if ssl_context is not None:
            # TCP_NODELAY: a reply is written as headers then body; on a kept-alive connection
            # Nagle holds the body back for the client's delayed ACK (measured: 44 ms a call).
            handler = type(handler.__name__, (handler,), {"protocol_version": "HTTP/1.1",
                                                          "disable_nagle_algorithm": True})
        super().__init__(address, handler)
        self.ssl_context = ssl_context
        self.tls_refused = 0  # connections whose TLS handshake failed (plain HTTP, unknown CA, ...)
        self.max_connections = max_connections
        self.body_budget = ByteBudget(max_body_bytes_in_flight)
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Lock()
        self.in_use = 0  # connections holding a handler thread now
        self.refused_busy = 0

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            self.refused_busy += 1
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
            self._count(-1)
            self._slots.release()
            self.shutdown_request(request)
            logger.exception("control server could not start a handler thread")

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._count(-1)
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
        sock.settimeout(self.handshake_timeout_s)
        try:
            return self.ssl_context.wrap_socket(sock, server_side=True)
        except (ssl.SSLError, OSError) as e:  # incl. socket.timeout
            with self._lock:
                self.tls_refused += 1
            _refusals.warn("control TLS handshake from %s refused: %s", client_address[0], e)
            sock.close()
            return None

    def _count(self, delta: int) -> None:
        with self._lock:
            self.in_use += delta


def serve_in_thread(server: ControlHTTPServer, name: str) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, name=name, daemon=True)
    thread.start()
    return thread
