"""Which pods are the router's backends (pure logic: pod objects in, backend-set changes out).

The router watches pods (router/discovery/watch.py) and feeds each watch event here, as the
Kubernetes API returns it (plain dicts). A pod is a backend when:

- its labels match exactly one role's selector (``--prefill-selector`` / ``--relay-selector`` /
  ``--main-selector``, ``k=v`` pairs, every pair equal: SMG's matching). A pod matching two
  roles is refused with a log line naming both: one pod, one role;
- it has condition ``Ready=True``, a pod IP and no deletion timestamp (a pod being deleted
  drains before its containers stop);
- its role's ports are in its annotations (``ANNOTATIONS``): P's bootstrap port (SMG's
  ``sglang.ai/bootstrap-port``), MD's control and WAN ports.

What comes out is a list of changes: ``Join`` (a new backend, or a changed one's new address),
``Drain`` (the pod is still there but no longer serves: not Ready, being deleted, relabelled
away) and ``Leave`` (the pod is gone). The router treats Drain and Leave alike (no new
requests; the backend is dropped from its pools once its requests in flight have ended) and
health-checks a joining backend before it picks it (router/discovery/apply.py).

A re-list (at start, and after the watch's 410 Gone) is ``relist``: pods absent from the new
list leave, the others are applied as MODIFIED.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Union

logger = logging.getLogger(__name__)

ROLES = ("prefill", "relay", "main")

# Annotations read from a pod. Bootstrap port: SMG's key; the others are PDD's own.
BOOTSTRAP_PORT = "sglang.ai/bootstrap-port"
HTTP_PORT = "pdd.sglang.ai/http-port"  # the SGLang HTTP port; default: --service-discovery-port
CONTROL_PORT = "pdd.sglang.ai/control-port"  # --pdd-control-listen (MD: required; P: optional)
CONTROL_SCHEME = "pdd.sglang.ai/control-scheme"  # http (default) or https (--control-tls-*)
WAN_PORT = "pdd.sglang.ai/wan-port"  # MD's --pdd-wan-listen, as P dials it
# The host the router and P dial instead of the pod IP (MD in another cluster, reached through a
# Service per pod): a template with {pod} and {namespace}, e.g. "{pod}.md.{namespace}.svc.clusterset.local".
ADVERTISE_HOST = "pdd.sglang.ai/advertise-host"
ANNOTATIONS = (BOOTSTRAP_PORT, HTTP_PORT, CONTROL_PORT, CONTROL_SCHEME, WAN_PORT, ADVERTISE_HOST)


class SelectorError(ValueError):
    """A selector flag that is not ``k=v`` pairs."""


@dataclass(frozen=True)
class Selector:
    """Label pairs a pod must all carry (SMG's matching: equality on every pair)."""

    pairs: tuple[tuple[str, str], ...]

    @classmethod
    def parse(cls, items: Union[str, Iterable[str]]) -> "Selector":
        """``["app=sglang", "pdd.sglang.ai/role=prefill"]`` or one comma-separated string."""
        if isinstance(items, str):
            items = [items]
        pairs = []
        for item in items:
            for part in item.split(","):
                key, eq, value = part.strip().partition("=")
                if not eq or not key.strip():
                    raise SelectorError(f"a selector is k=v pairs, got {part.strip()!r}")
                pairs.append((key.strip(), value.strip()))
        if not pairs:
            raise SelectorError("an empty selector would match every pod")
        return cls(tuple(sorted(set(pairs))))

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.pairs)

    def __str__(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.pairs)


@dataclass(frozen=True)
class DiscoveredBackend:
    """One backend as a pod describes it: what the router's --prefill / --relay / --main says."""

    role: str
    pod: str  # namespace/name (or, from a discovery file, the entry's url)
    url: str
    bootstrap_port: Optional[int] = None  # P
    control_url: Optional[str] = None  # P (optional), MD
    wan_addr: Optional[str] = None  # MD: HOST:PORT as P dials it


@dataclass(frozen=True)
class Join:
    backend: DiscoveredBackend


@dataclass(frozen=True)
class Drain:
    backend: DiscoveredBackend
    why: str


@dataclass(frozen=True)
class Leave:
    backend: DiscoveredBackend
    why: str


Change = Union[Join, Drain, Leave]


@dataclass
class Update:
    changes: list = field(default_factory=list)
    refused: list = field(default_factory=list)  # (pod, why): pods that match a role but cannot serve it


def pod_key(pod: Mapping) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def is_ready(pod: Mapping) -> bool:
    """Condition Ready=True, a pod IP, no deletion timestamp."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") or not status.get("podIP"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())


def _port(annotations: Mapping, key: str, pod: str, required: bool) -> Optional[int]:
    raw = annotations.get(key)
    if raw is None:
        if required:
            raise ValueError(f"pod {pod} has no annotation {key}")
        return None
    try:
        port = int(str(raw).strip())
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        raise ValueError(f"pod {pod}: annotation {key}={raw!r} is not a port")
    return port


def _host(pod: Mapping, annotations: Mapping, key: str) -> str:
    template = annotations.get(ADVERTISE_HOST)
    if template:
        meta = pod.get("metadata") or {}
        try:
            return str(template).format(pod=meta.get("name", ""), namespace=meta.get("namespace", ""))
        except (KeyError, IndexError, ValueError):
            raise ValueError(f"pod {key}: annotation {ADVERTISE_HOST}={template!r} may use only {{pod}} and "
                             f"{{namespace}}") from None
    ip = pod["status"]["podIP"]
    return f"[{ip}]" if ":" in ip else ip


def backend_of(pod: Mapping, role: str, default_http_port: int) -> DiscoveredBackend:
    """The backend a Ready pod of ``role`` is (ValueError naming the pod and annotation when one
    its role needs is missing or malformed)."""
    key = pod_key(pod)
    notes = (pod.get("metadata") or {}).get("annotations") or {}
    host = _host(pod, notes, key)
    http_port = _port(notes, HTTP_PORT, key, required=False) or default_http_port
    url = f"http://{host}:{http_port}"
    scheme = str(notes.get(CONTROL_SCHEME, "http"))
    if scheme not in ("http", "https"):
        raise ValueError(f"pod {key}: annotation {CONTROL_SCHEME}={scheme!r} is not http or https")
    if role == "prefill":
        control = _port(notes, CONTROL_PORT, key, required=False)
        return DiscoveredBackend(role, key, url, bootstrap_port=_port(notes, BOOTSTRAP_PORT, key, required=True),
                                 control_url=f"{scheme}://{host}:{control}" if control else None)
    if role == "main":
        control = _port(notes, CONTROL_PORT, key, required=True)
        wan = _port(notes, WAN_PORT, key, required=True)
        return DiscoveredBackend(role, key, url, control_url=f"{scheme}://{host}:{control}", wan_addr=f"{host}:{wan}")
    return DiscoveredBackend(role, key, url)


class DiscoveryState:
    """The backends the watched pods make, and the changes each event makes to that set.

    ``selectors``: role -> Selector, for the roles this watch discovers (a watch of cluster B
    may discover MD only)."""

    def __init__(self, selectors: Mapping[str, Selector], default_http_port: int = 30000):
        unknown = set(selectors) - set(ROLES)
        if unknown or not selectors:
            raise ValueError(f"selectors are for the roles {ROLES}, got {sorted(selectors)}")
        self.selectors = dict(selectors)
        self.default_http_port = default_http_port
        self.backends: dict[str, DiscoveredBackend] = {}  # pod key -> the backend it is now
        self._refused: dict[str, str] = {}  # pod key -> why, logged once per reason

    def roles_of(self, pod: Mapping) -> list[str]:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        return [role for role, sel in self.selectors.items() if sel.matches(labels)]

    def apply(self, event_type: str, pod: Mapping) -> Update:
        """One watch event (ADDED, MODIFIED, DELETED; BOOKMARK changes nothing)."""
        if event_type == "BOOKMARK":
            return Update()
        if event_type not in ("ADDED", "MODIFIED", "DELETED"):
            raise ValueError(f"unknown watch event type {event_type!r}")
        key = pod_key(pod)
        before = self.backends.get(key)
        if event_type == "DELETED":
            self._refused.pop(key, None)
            return self._set(key, before, None, "pod deleted", gone=True)
        update = Update()
        roles = self.roles_of(pod)
        now: Optional[DiscoveredBackend] = None
        why = ""
        if len(roles) > 1:
            why = f"its labels match the selectors of {' and '.join(roles)}: one pod serves one role"
            self._refuse(key, why, update)
        elif not roles:
            why = "labels no longer match a role's selector"
            self._refused.pop(key, None)
        elif not is_ready(pod):
            why = "being deleted" if (pod.get("metadata") or {}).get("deletionTimestamp") else "not Ready"
        else:
            try:
                now = backend_of(pod, roles[0], self.default_http_port)
                self._refused.pop(key, None)
            except ValueError as e:
                why = str(e)
                self._refuse(key, why, update)
        changed = self._set(key, before, now, why, gone=False)
        changed.refused = update.refused
        return changed

    def relist(self, pods: Iterable[Mapping]) -> Update:
        """The full list (at start, after 410 Gone): pods absent from it left while unwatched."""
        pods = list(pods)
        listed = {pod_key(p) for p in pods}
        update = Update()
        for key in [k for k in self.backends if k not in listed]:
            update.changes += self._set(key, self.backends[key], None, "gone from the re-list", gone=True).changes
        for key in [k for k in self._refused if k not in listed]:
            del self._refused[key]
        for pod in pods:
            one = self.apply("MODIFIED", pod)
            update.changes += one.changes
            update.refused += one.refused
        return update

    def _refuse(self, key: str, why: str, update: Update) -> None:
        if self._refused.get(key) != why:
            self._refused[key] = why
            logger.error("service discovery: pod %s refused: %s", key, why)
            update.refused.append((key, why))

    def _set(self, key: str, before: Optional[DiscoveredBackend], now: Optional[DiscoveredBackend],
             why: str, gone: bool) -> Update:
        if before == now:
            return Update()
        changes: list = []
        if before is not None:
            reason = why if now is None else f"its address changed to {now.url}"
            changes.append(Leave(before, reason) if gone else Drain(before, reason))
            del self.backends[key]
        if now is not None:
            self.backends[key] = now
            changes.append(Join(now))
        return Update(changes)


# ------------------------------------------------------------------ MD from a watched file
def backends_from_file_entries(entries, source: str) -> list[DiscoveredBackend]:
    """MD backends from a discovery file's list: each entry ``{"url", "control_url", "wan"}``
    (what --main's URL,CONTROL_URL,WAN_ADDR says). ValueError naming the entry otherwise."""
    if not isinstance(entries, list):
        raise ValueError(f"{source}: a list of MD entries, got {type(entries).__name__}")
    found: dict[str, DiscoveredBackend] = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or set(entry) - {"url", "control_url", "wan"} or \
                not all(isinstance(entry.get(k), str) and entry.get(k) for k in ("url", "control_url", "wan")):
            raise ValueError(f"{source}: entry {i} must be {{\"url\", \"control_url\", \"wan\"}} strings, got {entry!r}")
        host, colon, port = entry["wan"].rpartition(":")
        if not colon or not host or not port.isdigit():
            raise ValueError(f"{source}: entry {i}: wan must be HOST:PORT, got {entry['wan']!r}")
        if entry["url"] in found:
            raise ValueError(f"{source}: entry {i}: url {entry['url']!r} listed twice")
        found[entry["url"]] = DiscoveredBackend("main", entry["url"], entry["url"], control_url=entry["control_url"],
                                                wan_addr=entry["wan"])
    return list(found.values())


def file_changes(before: Mapping[str, DiscoveredBackend], now: list[DiscoveredBackend]) -> list:
    """The changes from one version of the discovery file to the next (keyed by url)."""
    after = {b.url: b for b in now}
    changes: list = [Leave(b, "gone from the discovery file") for url, b in before.items() if after.get(url) != b]
    changes += [Join(b) for url, b in after.items() if before.get(url) != b]
    return changes
