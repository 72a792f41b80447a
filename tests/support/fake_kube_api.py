"""A loopback HTTP server that speaks the Kubernetes API's pod list and watch JSON, for tests of
the router's service discovery without a cluster.

What it mimics (the API's documented behaviour, "Efficient detection of changes"):
- GET /api/v1/pods and /api/v1/namespaces/{ns}/pods: a PodList with metadata.resourceVersion,
  paged by ``limit`` / ``continue``; ``labelSelector`` with k=v pairs (all equal).
- the same with ``watch=1&resourceVersion=RV``: newline-delimited {"type", "object"} events after
  RV, then every change as it happens; ``allowWatchBookmarks`` gives a BOOKMARK when the watch
  opens; ``timeoutSeconds`` ends it. A watch from a version older than the kept history
  (``compact()``) gets ``{"type": "ERROR", "object": Status code 410}``, as a real server
  sends once its etcd history was compacted; ``expire_watches()`` sends that to the open ones.
- ``fail_next(n, status)``: the next n requests answer that HTTP status.
"""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Optional

from aiohttp import web


def matches(labels: dict, selector: str) -> bool:
    pairs = [p.split("=", 1) for p in selector.split(",") if p]
    return all(labels.get(k) == v for k, v in pairs)


class FakeKubeApi:
    def __init__(self):
        self.pods: dict[tuple[str, str], dict] = {}
        self.version = 100
        self.history: list[tuple[int, str, dict]] = []  # (version, type, pod)
        self.oldest = self.version  # versions before this are compacted away
        self.changed = asyncio.Condition()
        self.requests: list[dict] = []  # query of each request, in order
        self.authorization: list[Optional[str]] = []
        self._fail: list[int] = []
        self._expire = 0  # bumped by expire_watches()

    # ------------------------------------------------------------------ changes
    async def _emit(self, kind: str, pod: dict) -> None:
        self.version += 1
        pod = copy.deepcopy(pod)
        pod["metadata"]["resourceVersion"] = str(self.version)
        key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
        if kind == "DELETED":
            self.pods.pop(key, None)
        else:
            self.pods[key] = pod
        self.history.append((self.version, kind, pod))
        async with self.changed:
            self.changed.notify_all()

    async def put(self, pod: dict) -> None:
        key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
        await self._emit("MODIFIED" if key in self.pods else "ADDED", pod)

    async def delete(self, namespace: str, name: str) -> None:
        await self._emit("DELETED", self.pods[(namespace, name)])

    def compact(self) -> None:
        """Forget the history: a watch from an older version is answered 410."""
        self.oldest = self.version + 1
        self.history.clear()

    async def expire_watches(self) -> None:
        self.compact()
        self._expire += 1
        async with self.changed:
            self.changed.notify_all()

    def fail_next(self, n: int, status: int = 500) -> None:
        self._fail += [status] * n

    def watches(self) -> list[dict]:
        return [q for q in self.requests if q.get("watch")]

    def lists(self) -> list[dict]:
        return [q for q in self.requests if not q.get("watch")]

    # ------------------------------------------------------------------ HTTP
    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api/v1/pods", self._pods)
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._pods)
        return app

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        q = dict(request.query)
        self.requests.append(q)
        self.authorization.append(request.headers.get("Authorization"))
        if self._fail:
            status = self._fail.pop(0)
            return web.json_response({"kind": "Status", "code": status, "message": "injected"}, status=status)
        ns = request.match_info.get("ns")
        selector = q.get("labelSelector", "")

        def visible(pod: dict) -> bool:
            return (ns is None or pod["metadata"]["namespace"] == ns) and \
                matches(pod["metadata"].get("labels") or {}, selector)

        if q.get("watch") in ("1", "true"):
            return await self._watch(request, q, visible)
        items = sorted((p for p in self.pods.values() if visible(p)), key=lambda p: p["metadata"]["name"])
        limit, start = int(q.get("limit", 0) or 0), int(q.get("continue", 0) or 0)
        page = items[start:start + limit] if limit else items
        meta = {"resourceVersion": str(self.version)}
        if limit and start + limit < len(items):
            meta["continue"] = str(start + limit)
        return web.json_response({"kind": "PodList", "apiVersion": "v1", "metadata": meta,
                                  "items": copy.deepcopy(page)})

    async def _watch(self, request: web.Request, q: dict, visible) -> web.StreamResponse:
        since = int(q.get("resourceVersion") or self.version)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)

        async def send(kind: str, obj: dict) -> None:
            await resp.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

        if since < self.oldest - 1:
            await send("ERROR", {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410,
                                 "reason": "Expired", "message": f"too old resource version: {since}"})
            return resp
        if q.get("allowWatchBookmarks") == "true":
            await send("BOOKMARK", {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": str(since)}})
        loop = asyncio.get_running_loop()
        deadline = loop.time() + float(q.get("timeoutSeconds") or 3600)
        expire = self._expire
        while True:
            for version, kind, pod in list(self.history):
                if version > since:
                    since = version
                    if visible(pod):
                        await send(kind, pod)
            if self._expire != expire:
                await send("ERROR", {"kind": "Status", "code": 410, "reason": "Expired", "message": "expired"})
                return resp
            left = deadline - loop.time()
            if left <= 0:
                return resp
            async with self.changed:
                try:
                    await asyncio.wait_for(self.changed.wait(), min(left, 1.0))
                except asyncio.TimeoutError:
                    pass


def pod(name: str, role: str, ip: str, *, ready: bool = True, http_port: Optional[int] = None, ns: str = "pdd",
        annotations: Optional[dict] = None, labels: Optional[dict] = None) -> dict:
    """A Pod as the API returns it, labelled for PDD's role ``role``."""
    notes = dict(annotations or {})
    if http_port is not None:
        notes["pdd.sglang.ai/http-port"] = str(http_port)
    return {"metadata": {"name": name, "namespace": ns, "uid": f"uid-{name}",
                         "labels": labels if labels is not None else {"app": "sglang", "pdd.sglang.ai/role": role},
                         "annotations": notes},
            "spec": {"containers": [{"name": "sglang", "image": "sglang"}]},
            "status": {"phase": "Running", "podIP": ip,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}
