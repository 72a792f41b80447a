"""Service discovery's I/O: the Kubernetes API's pod list and watch, and MD's discovery file.

The decisions are router/discovery/pods.py's; this module feeds it. ``PodWatcher`` lists the pods
(paged), then watches from the list's resourceVersion (bookmarks on, each event's version kept);
a watch that ends is reopened from the last version, one answered 410 Gone (the version is
older than the API server keeps) re-lists, and an error backs off exponentially
(``BACKOFF_S`` doubling up to ``MAX_BACKOFF_S``, reset by a list that succeeds).

The API is spoken with aiohttp, the router's own client, rather than the official ``kubernetes``
package: that one's watch is a blocking urllib3 stream (a thread per watch in an asyncio
router), while the list/watch JSON is a few lines here and testable against a local server.
The official package is used, when installed (``pip install sglang-pdd[kubernetes]``), for what
it does best: reading a kubeconfig (contexts, client certificates, exec credential plugins).
In a pod, the service account's token and CA are read directly.

``FileWatcher`` reloads MD's list from a JSON or YAML file when it changes (cluster B's MD
written there by whatever syncs it: a Service per MD pod, exported names); a file that does not
parse is logged and the last good list kept.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional
from urllib.parse import urlencode

import aiohttp

from sglang_pdd.router.discovery.pods import (DiscoveredBackend, DiscoveryState, Update, backends_from_file_entries,
                                         file_changes)

logger = logging.getLogger(__name__)

SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
WATCH_TIMEOUT_S = 300  # the API server ends each watch after this; it is reopened from the last version
LIST_PAGE = 500
FILE_POLL_S = 1.0

OnUpdate = Callable[[Update], Awaitable[None]]


class Gone(Exception):
    """The watch's resourceVersion is too old (HTTP 410 or an ERROR event with code 410)."""


@dataclass
class ApiEndpoint:
    """Where a cluster's API server is and how to authenticate to it."""

    server: str  # https://HOST:PORT (http:// for a local test server)
    token_file: Optional[str] = None  # re-read at each call: projected tokens rotate
    token: Optional[str] = None
    ssl_context: Optional[ssl.SSLContext] = None
    refresh: Optional[Callable[[], Optional[str]]] = None  # kubeconfig exec/auth plugins: a fresh token
    default_namespace: Optional[str] = None

    def headers(self) -> dict[str, str]:
        token = self.token
        if self.refresh is not None:
            token = self.refresh() or token
        elif self.token_file:
            with open(self.token_file) as f:
                token = f.read().strip()
        return {"Authorization": f"Bearer {token}"} if token else {}


def in_cluster_endpoint() -> ApiEndpoint:
    """The API server of the cluster this pod runs in (its service account)."""
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise RuntimeError("not in a pod (KUBERNETES_SERVICE_HOST unset): pass --service-discovery-kubeconfig")
    ctx = ssl.create_default_context(cafile=os.path.join(SERVICE_ACCOUNT, "ca.crt"))
    host = f"[{host}]" if ":" in host else host
    try:
        with open(os.path.join(SERVICE_ACCOUNT, "namespace")) as f:
            namespace = f.read().strip()
    except OSError:
        namespace = None
    return ApiEndpoint(f"https://{host}:{port}", token_file=os.path.join(SERVICE_ACCOUNT, "token"),
                       ssl_context=ctx, default_namespace=namespace)


def kubeconfig_endpoint(path: Optional[str], context: Optional[str] = None) -> ApiEndpoint:
    """A kubeconfig's cluster (its current context, or ``context``), read by the official
    ``kubernetes`` package (optional: ``pip install sglang-pdd[kubernetes]``)."""
    try:
        from kubernetes import client as k8s_client
        from kubernetes import config as k8s_config
    except ImportError:
        raise RuntimeError("a kubeconfig needs the kubernetes package: pip install 'sglang-pdd[kubernetes]'") from None
    cfg = k8s_client.Configuration()
    k8s_config.load_kube_config(config_file=path, context=context, client_configuration=cfg)
    ctx = None
    if cfg.host.startswith("https"):
        ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert) if cfg.verify_ssl else ssl._create_unverified_context()
        if cfg.cert_file:
            ctx.load_cert_chain(cfg.cert_file, cfg.key_file)

    def token() -> Optional[str]:
        if cfg.refresh_api_key_hook is not None:
            cfg.refresh_api_key_hook(cfg)
        value = cfg.api_key.get("authorization") or cfg.api_key.get("BearerToken")
        return value.split(" ", 1)[1] if value and value.lower().startswith("bearer ") else value

    _, active = k8s_config.list_kube_config_contexts(config_file=path)
    chosen = active
    if context:
        chosen = next(c for c in k8s_config.list_kube_config_contexts(config_file=path)[0] if c["name"] == context)
    return ApiEndpoint(cfg.host.rstrip("/"), ssl_context=ctx, refresh=token,
                       default_namespace=(chosen or {}).get("context", {}).get("namespace"))


def endpoint_for(kubeconfig: Optional[str], context: Optional[str]) -> ApiEndpoint:
    """``--...-kubeconfig`` / ``--...-context`` if given, else in-cluster, else $KUBECONFIG."""
    if kubeconfig or context:
        return kubeconfig_endpoint(kubeconfig, context)
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return in_cluster_endpoint()
    return kubeconfig_endpoint(None, None)


def common_label_selector(state: DiscoveryState) -> str:
    """The label pairs every role's selector shares, as the API's labelSelector (the server
    filters by it; each role's own pairs are matched here). Empty: every pod is listed."""
    shared = set.intersection(*(set(sel.pairs) for sel in state.selectors.values()))
    return ",".join(f"{k}={v}" for k, v in sorted(shared))


@dataclass
class WatchStats:
    lists: int = 0
    watches: int = 0
    gone: int = 0
    errors: int = 0
    events: int = 0
    last_error: str = ""
    synced: asyncio.Event = field(default_factory=asyncio.Event)  # the first list applied


class PodWatcher:
    """List + watch of one cluster's pods, each change handed to ``on_update``."""

    def __init__(self, endpoint: ApiEndpoint, namespace: Optional[str], state: DiscoveryState,
                 on_update: OnUpdate, name: str = "pods"):
        self.endpoint, self.state, self.on_update, self.name = endpoint, state, on_update, name
        self.namespace = namespace
        self.selector = common_label_selector(state)
        self.stats = WatchStats()

    def _path(self) -> str:
        return f"/api/v1/namespaces/{self.namespace}/pods" if self.namespace else "/api/v1/pods"

    def _url(self, **query) -> str:
        query = {k: v for k, v in query.items() if v not in (None, "")}
        if self.selector:
            query["labelSelector"] = self.selector
        return f"{self.endpoint.server}{self._path()}?{urlencode(query)}"

    def _kwargs(self) -> dict:
        return {"headers": self.endpoint.headers(), **({"ssl": self.endpoint.ssl_context}
                                                       if self.endpoint.ssl_context else {})}

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Forever: list, watch until 410 Gone, list again; errors back off."""
        backoff = BACKOFF_S
        while True:
            try:
                version = await self._list(session)
                backoff = BACKOFF_S
                await self._watch(session, version)
            except Gone:
                self.stats.gone += 1
                logger.info("service discovery (%s): watch version too old (410 Gone): re-listing", self.name)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - any failure of the API: log, back off, list again
                self.stats.errors += 1
                self.stats.last_error = repr(e)[:300]
                logger.warning("service discovery (%s): %s; retrying in %.1f s", self.name, self.stats.last_error,
                               backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)

    async def _list(self, session: aiohttp.ClientSession) -> str:
        pods, token = [], None
        while True:
            async with session.get(self._url(limit=LIST_PAGE, **{"continue": token}), **self._kwargs(),
                                   timeout=aiohttp.ClientTimeout(total=60)) as resp:
                if resp.status == 410:  # a page's continue token expired: list from the start
                    raise Gone()
                if resp.status != 200:
                    raise RuntimeError(f"list {self._path()}: HTTP {resp.status} {(await resp.text())[:200]}")
                body = await resp.json(content_type=None)
            pods += body.get("items") or []
            meta = body.get("metadata") or {}
            token = meta.get("continue")
            if not token:
                break
        self.stats.lists += 1
        await self.on_update(self.state.relist(pods))
        self.stats.synced.set()
        return meta.get("resourceVersion", "")

    async def _watch(self, session: aiohttp.ClientSession, version: str) -> None:
        """Watches from ``version`` until 410 Gone (raised); a watch the server ends is reopened."""
        while True:
            url = self._url(watch="1", resourceVersion=version, allowWatchBookmarks="true",
                            timeoutSeconds=str(WATCH_TIMEOUT_S))
            self.stats.watches += 1
            async with session.get(url, **self._kwargs(),
                                   timeout=aiohttp.ClientTimeout(total=None, sock_connect=10,
                                                                 sock_read=WATCH_TIMEOUT_S + 30)) as resp:
                if resp.status == 410:
                    raise Gone()
                if resp.status != 200:
                    raise RuntimeError(f"watch {self._path()}: HTTP {resp.status} {(await resp.text())[:200]}")
                async for line in resp.content:
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    kind, obj = event.get("type"), event.get("object") or {}
                    if kind == "ERROR":
                        if obj.get("code") == 410:
                            raise Gone()
                        raise RuntimeError(f"watch error: {obj.get('message', obj)}")
                    version = (obj.get("metadata") or {}).get("resourceVersion") or version
                    self.stats.events += 1
                    await self.on_update(self.state.apply(kind, obj))


class FileWatcher:
    """MD's list from a JSON or YAML file, reloaded when it changes (polled: works on any
    filesystem, a ConfigMap volume's symlink swap included)."""

    def __init__(self, path: str, on_update: OnUpdate, poll_s: float = FILE_POLL_S):
        self.path, self.on_update, self.poll_s = path, on_update, poll_s
        self.backends: dict[str, DiscoveredBackend] = {}
        self._seen: Optional[tuple] = None
        self.synced = asyncio.Event()
        self.errors = 0

    def load(self) -> list[DiscoveredBackend]:
        with open(self.path, "rb") as f:
            raw = f.read()
        if self.path.endswith((".yaml", ".yml")):
            import yaml

            entries = yaml.safe_load(raw)
        else:
            entries = json.loads(raw)
        return backends_from_file_entries(entries, self.path)

    async def poll_once(self) -> None:
        try:
            st = os.stat(self.path)
            version = (st.st_mtime_ns, st.st_ino, st.st_size)
        except FileNotFoundError:
            version = None
        if version == self._seen:
            return
        self._seen = version
        if version is None:
            logger.warning("--main-discovery-file %s is missing: keeping the %d MD listed before", self.path,
                           len(self.backends))
            return
        try:
            now = self.load()
        except Exception as e:  # noqa: BLE001 - bad input: say so, keep what was known
            self.errors += 1
            logger.error("--main-discovery-file %s: %s; keeping the %d MD listed before", self.path, e,
                         len(self.backends))
            return
        changes = file_changes(self.backends, now)
        self.backends = {b.url: b for b in now}
        if changes:
            await self.on_update(Update(changes))
        self.synced.set()

    async def run(self, session=None) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.poll_s)

