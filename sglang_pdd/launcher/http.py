"""Tiny blocking HTTP helpers for the demo, tests and benchmarks (stdlib only).

``key``: the shared key; the request is then signed for MD's and P's control APIs
(control_auth), as the router signs its own calls."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Iterator, Optional
from urllib.parse import urlsplit


def control_role(path: str) -> str:
    """Whose control API a path is (each has its own signing key): P's WAN-destination routes
    and /pdd/info are P's, the rest MD's. /pdd/stats is on both: pass ``role`` for P's."""
    from sglang_pdd.control.auth import ROLE_MD, ROLE_P
    from sglang_pdd.protocol import is_p_path

    return ROLE_P if is_p_path(path) else ROLE_MD


def signed_headers(method: str, url: str, body: bytes, key: Optional[bytes], role: Optional[str] = None) -> dict:
    if key is None:
        return {}
    from sglang_pdd.control.auth import ControlSigner

    return ControlSigner(key, role=role or control_role(urlsplit(url).path)).headers(method, url, body)


def _request(method: str, url: str, data: Optional[bytes], key: Optional[bytes],
             headers: Optional[dict] = None, role: Optional[str] = None) -> urllib.request.Request:
    headers = {**({"Content-Type": "application/json"} if data is not None else {}), **(headers or {})}
    headers.update(signed_headers(method, url, data or b"", key, role))
    return urllib.request.Request(url, data=data, method=method, headers=headers)


def post_json(url: str, body: dict, timeout: float = 120.0, key: Optional[bytes] = None,
              headers: Optional[dict] = None, role: Optional[str] = None) -> dict:
    """``headers``: extra request headers (e.g. the router's operator token); ``role``: the
    control API's (control_auth.ROLE_*; default: by the path, see ``control_role``)."""
    with urllib.request.urlopen(_request("POST", url, json.dumps(body).encode(), key, headers, role),
                                timeout=timeout) as resp:
        return json.loads(resp.read())


def get_json(url: str, timeout: float = 10.0, key: Optional[bytes] = None, role: Optional[str] = None) -> dict:
    with urllib.request.urlopen(_request("GET", url, None, key, role=role), timeout=timeout) as resp:
        return json.loads(resp.read())


def call_json(method: str, url: str, body=None, timeout: float = 30.0,
              key: Optional[bytes] = None, role: Optional[str] = None) -> tuple[int, dict]:
    """(status, JSON reply) for any status; ``body``: a dict (sent as JSON), bytes, or None."""
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(_request(method, url, data, key, role=role), timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def stream_events(url: str, body: dict, timeout: float = 300.0) -> Iterator[dict]:
    """The JSON events of an SGLang-style SSE reply (``data: {...}`` lines, ``data: [DONE]`` ends
    it), yielded as they arrive."""
    with urllib.request.urlopen(_request("POST", url, json.dumps(body).encode(), None), timeout=timeout) as resp:
        for raw in resp:
            line = raw.strip()
            if line == b"data: [DONE]":
                return
            if line.startswith(b"data:"):
                yield json.loads(line[len(b"data:"):])
