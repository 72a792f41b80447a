"""The one shape of the stdlib control servers: MD's rooms (sglang_glue/md/main_drc.py), P's WAN
destinations (sglang_glue/p/prefill_control.py) and the WAN emulator's faults
(launcher/wan_emulator.py).

A control API is an object (``ControlApi``) whose routes are its own bound methods, listed in
a ``RouteTable`` (protocol.routes). Each is called as ``method(call, query, **path_params)``:
``call`` is the request being served (control_gate.JsonRequestHandler: its ``body`` and
``json_body()``, the server's ``stats()``, and for a relayed stream its connection), ``query``
the URL's query string. It returns the 200 reply (a protocol message or a dict), or None when
it answered itself; a ControlError it raises is answered with its status.

``ControlServer`` serves one API behind control_gate's gate (connection admission, deadlines,
the signature, the body budget), on a thread of its own.
"""

from __future__ import annotations

from typing import Iterable, Optional

from sglang_pdd.admission import parse_networks
from sglang_pdd.control.auth import ControlVerifier
from sglang_pdd.control.gate import ControlHTTPServer, JsonRequestHandler, control_admission, serve_in_thread
from sglang_pdd.protocol import ControlError, RouteTable


class ControlApi:
    """Subclasses set ``routes`` (their bound methods) in ``__init__``."""

    routes: RouteTable
    auth: Optional[ControlVerifier] = None  # None: no signature asked (only the WAN emulator's, loopback only)
    max_body_bytes: int = 64 * 1024

    def body_cap(self, method: str, path: str) -> int:
        """The largest body a route takes (an API narrows it per route)."""
        return self.max_body_bytes

    def refused(self, call: JsonRequestHandler, error: ControlError) -> None:
        """A route refused its request (an API logs the ones worth a line)."""


class ApiRequestHandler(JsonRequestHandler):
    """Serves the API of the server it belongs to (``ControlServer``)."""

    @property
    def api(self) -> ControlApi:
        return self.server.api

    @property
    def auth(self) -> Optional[ControlVerifier]:
        return self.api.auth

    @property
    def routes(self) -> RouteTable:
        return self.api.routes

    def body_cap(self, method: str, path: str) -> int:
        return self.api.body_cap(method, path)

    def refused(self, error: ControlError) -> None:
        self.api.refused(self, error)


class ControlServer:
    """``api`` on ``address`` (control_gate.ControlHTTPServer: at most ``max_connections``,
    ``trusted_sources`` (the router's addresses) first;
    ``max_body_bytes_in_flight`` of bodies read at once; ``names``: the hosts a signed call may
    name, None: the bound address; ``ssl_context``: HTTPS only, client certificates required)."""

    def __init__(self, api: ControlApi, address: tuple[str, int], *, thread_name: str, max_connections: int = 128,
                 max_body_bytes_in_flight: int = 64 << 20, ssl_context=None, trusted_sources=(),
                 names: Optional[Iterable[str]] = None):
        self.api = api
        self.httpd = ControlHTTPServer(address, ApiRequestHandler, max_connections=max_connections,
                                       max_body_bytes_in_flight=max_body_bytes_in_flight, ssl_context=ssl_context,
                                       admission=control_admission(max_connections, parse_networks(trusted_sources)),
                                       names=names)
        self.httpd.api = api
        self.address = self.httpd.server_address[:2]
        self.thread = serve_in_thread(self.httpd, thread_name)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
