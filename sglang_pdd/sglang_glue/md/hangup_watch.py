"""Notice at once that the peer of a connection hung up, while this thread blocks elsewhere.

MD's control server relays a handoff's stream from MD's own /generate to the router, blocked
reading MD's next event. When the router goes (its request ended on RLD meanwhile), a write
would notice only at the next event or the one after, and MD would decode on for nobody
until then (and refuse a cache flush, having a request running). A watcher thread sees the
hang-up as it happens and calls ``on_hangup`` (which cuts the relay short).

Plain TCP only: a TLS connection cannot be peeked at without reading it, which must not race
the thread writing to it; there the relay notices at its next write, as before.
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
from typing import Callable

POLL_S = 0.2  # how often the watcher looks whether it should stop


class HangupWatch:
    """``with HangupWatch(sock, on_hangup) as watch: ...``; ``watch.hung_up`` afterwards."""

    def __init__(self, sock, on_hangup: Callable[[], None]):
        self.sock, self.on_hangup = sock, on_hangup
        self.hung_up = False
        self._stop = threading.Event()
        self._thread = None
        if isinstance(sock, socket.socket) and not isinstance(sock, ssl.SSLSocket):
            self._thread = threading.Thread(target=self._watch, name="pdd-hangup-watch", daemon=True)

    def __enter__(self) -> "HangupWatch":
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                readable, _, _ = select.select([self.sock], [], [], POLL_S)
                if not readable:
                    continue
                closed = self.sock.recv(1, socket.MSG_PEEK) == b""
            except (OSError, ValueError):  # reset, or the socket closed under us
                closed = not self._stop.is_set()
            if closed:
                self.hung_up = True
                self.on_hangup()
            return  # closed, or the peer sent bytes it should not have: nothing more to watch
