"""Service discovery's changes applied to the router's pools (router/backends/pools.py).

- ``Join``: the backend is probed (GET /health, as the router's own health checks) until it
  answers 200, then added to its role's pool: picked from then on. A backend that leaves
  before it passes is never added.
- ``Drain`` / ``Leave``: the backend is drained at once (the health board's Drain: no new
  request picks it; router/backends/health.py) and dropped from its pool once the requests in flight on
  it have ended. A join of the same URL before then undrains it (after its health check).

Only drains this module set are lifted by it: an operator's drain (POST /pdd/backends/drain)
of a backend discovery keeps is left alone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

import aiohttp

from sglang_pdd.router.discovery.pods import DiscoveredBackend, Join, Update
from sglang_pdd.router.backends.servers import MainBackend, PrefillBackend
from sglang_pdd.router.backends.health import BackendSucceeded, Drain
from sglang_pdd.router.backends.pools import Pools

logger = logging.getLogger(__name__)

JOIN_RETRY_S = 1.0
HEALTH_TIMEOUT_S = 20.0  # SGLang's /health decodes one token (its own HEALTH_CHECK_TIMEOUT)
IDLE_POLL_S = 0.05


@dataclass(frozen=True)
class MembershipEvent:
    """What happened to a backend, when (time.monotonic()): for logs, /metrics and tests."""

    at: float
    kind: str  # "seen" (discovery said join), "joined" (health passed, pickable), "draining", "removed"
    role: str
    url: str


def pool_entry(backend: DiscoveredBackend):
    """What the pools hold for a discovered backend: the objects --prefill / --relay / --main make."""
    if backend.role == "prefill":
        host = backend.url.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
        return PrefillBackend(backend.url, backend.bootstrap_port, host, control_url=backend.control_url)
    if backend.role == "main":
        return MainBackend(backend.url, backend.control_url, backend.wan_addr)
    return backend.url


class Membership:
    """Applies discovery updates to ``pools``. ``session()``: the router's backend session;
    ``track(role, url)``: the metrics' index for a new backend; ``joined(role, entry)``: after a
    backend joined (MD's KV size, the P hosts announced to MD)."""

    def __init__(self, pools: Pools, session: Callable[[], aiohttp.ClientSession],
                 track: Callable[[str, str], None] = lambda role, url: None,
                 joined: Callable[[str, object], None] = lambda role, entry: None,
                 join_retry_s: float = JOIN_RETRY_S, https_control_only: bool = False):
        self.pools, self.session, self.track, self.joined = pools, session, track, joined
        self.https_control_only = https_control_only  # --control-tls-*: a plain control URL is refused
        self.join_retry_s = join_retry_s
        self._joining: dict[tuple[str, str], asyncio.Task] = {}
        self._leaving: dict[tuple[str, str], asyncio.Task] = {}
        self._drained: set[tuple[str, str]] = set()
        self.events: list[MembershipEvent] = []

    def _note(self, kind: str, role: str, url: str) -> None:
        self.events.append(MembershipEvent(time.monotonic(), kind, role, url))
        del self.events[:-10000]

    async def apply(self, update: Update) -> None:
        for change in update.changes:
            b = change.backend
            if isinstance(change, Join) and self.https_control_only and b.control_url and \
                    not b.control_url.startswith("https://"):
                logger.error("service discovery: %s %s (%s) refused: with --control-tls-* its control URL must be "
                             "https (annotation pdd.sglang.ai/control-scheme: https), got %s", b.role, b.url, b.pod,
                             b.control_url)
                self._leave(b)
            elif isinstance(change, Join):
                self._note("seen", b.role, b.url)
                logger.info("service discovery: %s %s (%s) found; joining after its health check", b.role, b.url, b.pod)
                self._join(b)
            else:
                logger.info("service discovery: %s %s (%s) leaves: %s", b.role, b.url, b.pod, change.why)
                self._leave(b)

    def _join(self, b: DiscoveredBackend) -> None:
        key = (b.role, b.url)
        reaper = self._leaving.pop(key, None)
        if reaper is not None:
            reaper.cancel()
        pending = self._joining.pop(key, None)
        if pending is not None:
            pending.cancel()
        task = self._joining[key] = asyncio.ensure_future(self._admit_when_healthy(b))
        task.add_done_callback(lambda t, key=key: self._joining.pop(key, None) if self._joining.get(key) is t else None)

    async def _admit_when_healthy(self, b: DiscoveredBackend) -> None:
        while not await self._healthy(b.url):
            await asyncio.sleep(self.join_retry_s)
        key, entry = (b.role, b.url), pool_entry(b)
        pool = {"prefill": self.pools.prefill, "relay": self.pools.relay, "main": self.pools.main}[b.role]
        urls = self.pools.roles()[b.role]
        if b.url in urls:  # back before it was dropped, or its ports changed: the new entry
            pool[urls.index(b.url)] = entry
        else:
            self.track(b.role, b.url)
            self.pools.add(b.role, entry)
        now = time.monotonic()
        self.pools.health.record(key, BackendSucceeded(now))
        if key in self._drained:
            self._drained.discard(key)
            self.pools.health.record(key, Drain(False))
        self._note("joined", b.role, b.url)
        logger.info("service discovery: %s %s joined", b.role, b.url)
        try:
            self.joined(b.role, entry)
        except Exception:  # noqa: BLE001 - a hook's failure does not undo the join
            logger.exception("service discovery: after %s %s joined", b.role, b.url)

    async def _healthy(self, url: str) -> bool:
        try:
            async with self.session().get(f"{url}/health",
                                          timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            logger.debug("service discovery: %s/health: %r", url, e)
            return False

    def _leave(self, b: DiscoveredBackend) -> None:
        key = (b.role, b.url)
        pending = self._joining.pop(key, None)
        if pending is not None:
            pending.cancel()
        if b.url not in self.pools.roles()[b.role] or key in self._leaving:
            return
        if not self.pools.health.view(key, time.monotonic()).draining:
            self.pools.health.record(key, Drain(True))
            self._drained.add(key)
        self._note("draining", b.role, b.url)
        task = self._leaving[key] = asyncio.ensure_future(self._remove_when_idle(key))
        task.add_done_callback(lambda t, key=key: self._leaving.pop(key, None) if self._leaving.get(key) is t else None)

    async def _remove_when_idle(self, key: tuple[str, str]) -> None:
        role, url = key
        while self.pools.inflight()[role].get(url, 0) > 0:
            await asyncio.sleep(IDLE_POLL_S)
        self.pools.remove(role, url)
        # a later pod at this address starts with a clean board (no drain, no breaker history)
        self.pools.health.states.pop(key, None)
        self._drained.discard(key)
        self._note("removed", role, url)
        logger.info("service discovery: %s %s removed (nothing in flight on it)", role, url)

    def close(self) -> None:
        for task in [*self._joining.values(), *self._leaving.values()]:
            task.cancel()


class Discovery:
    """The router's discovery tasks (a pod watch per cluster, MD's file) and their membership,
    started with the router's app and stopped with it."""

    def __init__(self, membership: Membership, watchers: list):
        self.membership, self.watchers = membership, watchers
        self._tasks: list[asyncio.Task] = []
        self._session: Optional[aiohttp.ClientSession] = None

    async def start(self, app=None) -> None:
        # its own session: a watch is a long-lived stream, apart from the backends' pool
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        for w in self.watchers:
            self._tasks.append(asyncio.ensure_future(w.run(self._session)))

    async def close(self, app=None) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.membership.close()
        if self._session is not None:
            await self._session.close()
