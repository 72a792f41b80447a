"""The control APIs' routes: one ``Route`` per (method, path template), the paths both sides
build from it, and the table every control server dispatches through.

MD (``--pdd-role main``, rank 0)::

    POST   /pdd/rooms                        RegisterRequest -> RegisterReply
    GET    /pdd/rooms/{room}/ready?timeout_s -> ReadyReply (long poll)
    POST   /pdd/rooms/{room}/handoff         HandoffRequest -> MD's /generate reply (SSE when streamed)
    DELETE /pdd/rooms/{room}?keep_kv=0|1     -> {"released": bool}
    POST   /pdd/kv_senders                   KvSendersRequest -> KvSendersReply
    GET    /pdd/stats

P (``--pdd-control-listen``, every TP rank at port + rank)::

    POST   /pdd/wan_destinations                   WanDestinationRequest -> DestinationReply
    DELETE /pdd/wan_destinations/{bootstrap_room}  -> DropReply
    POST   /pdd/wan_destinations/{bootstrap_room}/kept  -> KeptReply (nobody waits for its KV now)
    GET    /pdd/info                               -> InfoReply
    GET    /pdd/stats
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional
from urllib.parse import urlsplit

from sglang_pdd.protocol.errors import ControlError, bad_request

MAX_ROOM_ID = (1 << 63) - 1


def parse_room_id(text: str, what: str = "room id") -> int:
    """A room id from a URL path: ASCII decimal in 0..2^63-1, else ControlError(400)."""
    if not (text.isascii() and text.isdigit() and len(text) <= 19) or int(text) > MAX_ROOM_ID:
        raise bad_request(f"{what} must be a decimal integer in 0..{MAX_ROOM_ID}, got {text[:40]!r}")
    return int(text)


@dataclass(frozen=True)
class Route:
    """``template``: a path whose ``{name}`` segments are room ids (decimal, 0..2^63-1)."""

    method: str
    template: str

    @property
    def _segments(self) -> tuple[str, ...]:
        return tuple(self.template.split("/"))

    def path(self, **params: int) -> str:
        """The path for these parameters, e.g. ``MD_HANDOFF.path(room=7)``."""
        return "/".join(str(int(params[s[1:-1]])) if s.startswith("{") else s for s in self._segments)

    def match(self, path: str) -> Optional[dict]:
        """The parameters if ``path`` (without its query) is this route's, else None;
        ControlError(400) for a parameter that is not a room id."""
        parts, segments = path.split("/"), self._segments
        if len(parts) != len(segments):
            return None
        params = {}
        for part, segment in zip(parts, segments):
            if segment.startswith("{"):
                params[segment[1:-1]] = part  # checked once the literal segments all match
            elif part != segment:
                return None
        return {name: parse_room_id(text, "bootstrap_room" if name == "bootstrap_room" else "room id")
                for name, text in params.items()}


HEALTH = Route("GET", "/health")
MD_REGISTER = Route("POST", "/pdd/rooms")
MD_READY = Route("GET", "/pdd/rooms/{room}/ready")
MD_HANDOFF = Route("POST", "/pdd/rooms/{room}/handoff")
MD_RELEASE = Route("DELETE", "/pdd/rooms/{room}")
MD_KV_SENDERS = Route("POST", "/pdd/kv_senders")  # the router's P hosts: known peers of MD's WAN receiver
STATS = Route("GET", "/pdd/stats")  # MD's and P's
P_DESTINATION = Route("POST", "/pdd/wan_destinations")
P_DROP = Route("DELETE", "/pdd/wan_destinations/{bootstrap_room}")
P_INFO = Route("GET", "/pdd/info")
# The request ended on RLD and MD keeps what lands (released with keep): P sends the room's KV
# behind the KV someone waits for (kv_channel/send_order.py). The WAN room is MD's room, which
# is also the bootstrap room of the request's P leg.
P_KEPT = Route("POST", "/pdd/wan_destinations/{bootstrap_room}/kept")

MD_ROUTES = (HEALTH, MD_REGISTER, MD_READY, MD_HANDOFF, MD_RELEASE, MD_KV_SENDERS, STATS)
P_ROUTES = (HEALTH, P_DESTINATION, P_DROP, P_KEPT, P_INFO, STATS)


def ready_target(room: int, timeout_s: float) -> str:
    return f"{MD_READY.path(room=room)}?timeout_s={float(timeout_s)}"


def release_target(room: int, keep_kv: bool) -> str:
    return f"{MD_RELEASE.path(room=room)}?keep_kv={'1' if keep_kv else '0'}"


def is_p_path(path: str) -> bool:
    """A path of P's API only (/pdd/stats is on both)."""
    path = urlsplit(path).path
    return P_DESTINATION.template == path or path.startswith(P_DESTINATION.template + "/") \
        or path == P_INFO.template


Handler = Callable[..., object]


class RouteTable:
    """(method, path template) -> handler. ``resolve`` finds a request's handler and its path
    parameters; a control server calls ``handler(request, query, **params)``."""

    def __init__(self, handlers: Mapping[Route, Handler]):
        self.handlers = dict(handlers)

    def resolve(self, method: str, path: str) -> tuple[Handler, dict]:
        """ControlError(404) when no route has this method and path, (400) for a malformed
        room id in a path that is otherwise a route's."""
        for route, handler in self.handlers.items():
            if route.method == method:
                params = route.match(path)
                if params is not None:
                    return handler, params
        raise ControlError.of("not_found", f"no route {method} {path[:200]}")

    def methods(self) -> set[str]:
        return {route.method for route in self.handlers}
