"""MD's calls to its own SGLang HTTP server on loopback (the handoff's /generate, its abort).

SGLang serves HTTPS when started with ``--ssl-certfile``; the relay then speaks HTTPS too. The
server is verified against its own certificate, pinned: the certificate(s) in
``--ssl-certfile`` are the only trust anchors (a leaf signed by a CA verifies by itself), and
no host name is checked, because that certificate names the server's public name, not
127.0.0.1, and the pin already says which server this must be: a local process that took the
port first has no certificate those anchors accept (it lacks their keys). The file is read again
when it changes (SGLang's ``--enable-ssl-refresh`` reloads it in place).
"""

from __future__ import annotations

import http.client
import os
import ssl
import threading
from dataclasses import dataclass
from typing import Optional

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class LoopbackServer:
    """MD's own SGLang HTTP API as MD reaches it: its port, ``--api-key``, ``--ssl-certfile``."""

    port: int
    api_key: Optional[str] = None
    certfile: Optional[str] = None

    def connection(self, timeout: float) -> http.client.HTTPConnection:
        if not self.certfile:
            return http.client.HTTPConnection(LOOPBACK, self.port, timeout=timeout)
        return http.client.HTTPSConnection(LOOPBACK, self.port, timeout=timeout, context=pinned_context(self.certfile))

    def headers(self) -> dict:
        """JSON, and the server's --api-key if it has one (it guards /generate and /abort_request)."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers


_contexts: dict[str, tuple[tuple, ssl.SSLContext]] = {}
_lock = threading.Lock()


def pinned_context(certfile: str) -> ssl.SSLContext:
    """A client context trusting exactly the certificate(s) in ``certfile`` (cached per file,
    rebuilt when its size or modification time changes)."""
    st = os.stat(certfile)
    stamp = (st.st_mtime_ns, st.st_size)
    with _lock:
        cached = _contexts.get(certfile)
        if cached is not None and cached[0] == stamp:
            return cached[1]
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False  # see the module docstring: the pinned certificate is the identity
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    ctx.load_verify_locations(cafile=certfile)
    with _lock:
        _contexts[certfile] = (stamp, ctx)
    return ctx
