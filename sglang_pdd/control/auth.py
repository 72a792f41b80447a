"""Signed control-plane requests: an HMAC-SHA256 header on the shared key (pure, stdlib only).

The router signs every call to MD's and P's control APIs; the servers verify in one place
(control_gate.JsonRequestHandler) before any route runs::

    Authorization: PDD-HMAC-SHA256 v=2,ts=<unix seconds>,nonce=<32 hex>,body=<64 hex>,sig=<64 hex>
    body = SHA256(request body) hex
    sig  = HMAC-SHA256(control_key, "pdd-control-v2" \n METHOD \n TARGET \n HOST \n ts \n nonce
                                     \n Content-Length \n body)
    control_key = HKDF-SHA256(shared key, salt "sglang-pdd control plane v2", info "role:" ROLE)
    ROLE = "router->md" (MD's API) or "router->p" (P's API)

Everything the signature covers is in the request head, so a server authenticates the head
before it reads, reserves or waits for a byte of the body (``verify_head``), and checks the
body against the signed hash once it has read it (``check_body``): a head that anyone can
write without the key (the right shape, a fresh time) costs the server nothing. TARGET is
the request target as sent (path and query), so neither the route, the room id, the query
(``timeout_s``, ``keep_kv``) nor the body can be changed without the key. HOST is the Host
header (the authority of the URL the router dialled, lower case): a server accepts only its
own names (control_gate), so a call signed for one MD does not verify on another. The
timestamp bounds a replay to ``window_s``; within it each nonce is accepted once (bounded
cache); a nonce leaves the cache only with a timestamp no newer than which anything is
refused, so a wall clock stepped back does not re-admit it. The control key is derived from
the WAN key (domain separation: a control signature is never a valid WAN handshake proof,
nor the reverse), one per role, so a call signed for MD's API does not verify on P's and
the reverse. ``v=2`` names the format: a v1 header (no host, length nor body hash in the
head) is refused with a message saying which side to upgrade.

Replies are signed too, so a relay on the path cannot alter them (MD's registration reply
sets how many WAN ports P dials; its handoff stream is the user's output)::

    X-PDD-Reply-Signature: HMAC-SHA256(control_key, "pdd-control-reply-v1" \n request sig \n status \n SHA256(body) hex)

and each event of a streamed reply is followed by the SSE comment line
``:pdd-sig HMAC-SHA256(control_key, "pdd-control-event-v1" \n request sig \n index \n SHA256(data) hex)``,
index 0, 1, ... up to and including ``[DONE]``. Binding to the request's signature means a
reply (or event) recorded for one request does not verify for another.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional
from urllib.parse import urlsplit

from sglang_pdd.shared_key import MIN_KEY_BYTES

HEADER = "Authorization"
REPLY_HEADER = "X-PDD-Reply-Signature"
EVENT_SIG = b":pdd-sig "  # an SSE comment line after each data line of a signed stream
SCHEME = "PDD-HMAC-SHA256"
_SALT = b"sglang-pdd control plane v2"
ROLE_MD = "router->md"  # MD's room API
ROLE_P = "router->p"  # P's WAN-destination API
ROLES = (ROLE_MD, ROLE_P)
SIGNATURE_VERSION = 2
_HEADER_RE = re.compile(r"PDD-HMAC-SHA256 v=2,ts=([0-9]{1,12}),nonce=([0-9a-f]{32}),body=([0-9a-f]{64}),"
                        r"sig=([0-9a-f]{64})")
_V1_RE = re.compile(r"PDD-HMAC-SHA256 ts=[0-9]{1,12},nonce=[0-9a-f]{32},sig=[0-9a-f]{64}")


class AuthError(ValueError):
    """A request is not signed, or not validly (HTTP ``status``: 401, or 503 when the replay
    cache is full of fresh nonces)."""

    def __init__(self, message: str, status: int = 401):
        super().__init__(message)
        self.status = status


def derive_control_key(shared_key: bytes, role: str) -> bytes:
    """HKDF-SHA256 (RFC 5869, one output block) of the shared key for one role's API."""
    if len(shared_key) < MIN_KEY_BYTES:
        raise ValueError(f"control key must be at least {MIN_KEY_BYTES} bytes")
    if role not in ROLES:
        raise ValueError(f"control role must be one of {ROLES}, got {role!r}")
    prk = hmac.new(_SALT, shared_key, hashlib.sha256).digest()
    return hmac.new(prk, b"role:" + role.encode() + b"\x01", hashlib.sha256).digest()


def _mac(control_key: bytes, method: str, target: str, host: str, ts: str, nonce: str, length: int,
         body_sha256: str) -> str:
    msg = "\n".join(("pdd-control-v2", method.upper(), target, host, ts, nonce, str(int(length)), body_sha256))
    return hmac.new(control_key, msg.encode("utf-8", "surrogateescape"), hashlib.sha256).hexdigest()


def host_of(url: str) -> str:
    """The authority of ``url`` as the signer sends and signs it in the Host header."""
    return urlsplit(url).netloc.rpartition("@")[2].lower()


def target_of(url: str) -> str:
    """The request target of ``url`` (path and query), as sent and signed."""
    parts = urlsplit(url)
    return (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


def _reply_mac(control_key: bytes, request_sig: str, status: int, body: bytes) -> str:
    msg = "\n".join(("pdd-control-reply-v1", request_sig, str(int(status)), hashlib.sha256(body).hexdigest()))
    return hmac.new(control_key, msg.encode(), hashlib.sha256).hexdigest()


def _event_mac(control_key: bytes, request_sig: str, index: int, data: bytes) -> str:
    msg = "\n".join(("pdd-control-event-v1", request_sig, str(int(index)), hashlib.sha256(data).hexdigest()))
    return hmac.new(control_key, msg.encode(), hashlib.sha256).hexdigest()


def request_sig_of(header: str) -> str:
    """The ``sig`` of a request's signature header (what its reply is bound to)."""
    return header.rsplit("sig=", 1)[-1].strip()


class ControlSigner:
    """The router's side: the header for one request, and the checks of its reply. ``role``:
    whose API the calls go to (ROLE_MD or ROLE_P)."""

    def __init__(self, shared_key: bytes, clock: Callable[[], float] = time.time, *, role: str = ROLE_MD):
        self._key, self._clock, self.role = derive_control_key(shared_key, role), clock, role

    def header(self, method: str, target: str, body: bytes = b"", *, host: str) -> dict[str, str]:
        """The signature header of a request to ``host`` (the Host header it carries)."""
        ts, nonce, digest = str(int(self._clock())), secrets.token_hex(16), hashlib.sha256(body).hexdigest()
        sig = _mac(self._key, method, target, host.strip().lower(), ts, nonce, len(body), digest)
        return {HEADER: f"{SCHEME} v=2,ts={ts},nonce={nonce},body={digest},sig={sig}"}

    def headers(self, method: str, url: str, body: bytes = b"") -> dict[str, str]:
        """Host and the signature header of a request to ``url`` (send both as they are)."""
        host = host_of(url)
        return {"Host": host, **self.header(method, target_of(url), body, host=host)}

    def check_reply(self, request_header: str, status: int, body: bytes, reply_sig: Optional[str]) -> None:
        """AuthError unless ``reply_sig`` is the server's signature of this reply (status and
        body) to exactly this request (its signature: a reply cannot answer another request)."""
        if not reply_sig:
            raise AuthError(f"reply not signed (no {REPLY_HEADER})")
        if not hmac.compare_digest(reply_sig.strip(), _reply_mac(self._key, request_sig_of(request_header),
                                                                 status, body)):
            raise AuthError("bad reply signature (altered on the way, or not from the server)")

    def check_event(self, request_header: str, index: int, data: bytes, event_sig: bytes) -> None:
        """AuthError unless ``event_sig`` signs event ``index`` (0, 1, ...) of this request's
        stream: an event altered, dropped, reordered or taken from another stream fails."""
        want = _event_mac(self._key, request_sig_of(request_header), index, data)
        if not hmac.compare_digest(event_sig.strip(), want.encode()):
            raise AuthError(f"bad signature on stream event {index} (altered on the way, or not from the server)")


class ControlVerifier:
    """The servers' side (thread-safe). ``verify`` raises AuthError naming what is wrong.
    ``role``: the API this server serves (ROLE_MD or ROLE_P)."""

    def __init__(self, shared_key: bytes, window_s: float = 30.0, max_nonces: int = 1 << 16,
                 clock: Callable[[], float] = time.time, *, role: str = ROLE_MD):
        self._key, self._clock, self.role = derive_control_key(shared_key, role), clock, role
        self.window_s, self.max_nonces = window_s, max_nonces
        self._lock = threading.Lock()
        self._nonces: "OrderedDict[str, float]" = OrderedDict()  # nonce -> its request's ts, oldest first
        # The newest ts whose nonce was forgotten: anything that old or older is refused, so a
        # wall clock stepped back cannot bring a forgotten request into the window again.
        self._forgotten_ts = float("-inf")

    def verify_head(self, method: str, target: str, host: Optional[str], content_length: int,
                    header: Optional[str]) -> "SignedHead":
        """Everything but the body, before a byte of it is read: the header's presence, shape
        and time, then the MAC over the head (method, target, host, time, nonce, length and
        the body's announced hash), then the nonce. AuthError names what is wrong. Only a
        head signed with the key gets past it, so only the key's holder makes a server read,
        buffer or wait for a body; the returned head's ``body_sha256`` is what the body must
        hash to (``check_body``)."""
        if not header:
            raise AuthError(f"missing {HEADER} header: control requests must be signed ({SCHEME})")
        header = header.strip()
        m = _HEADER_RE.fullmatch(header)
        if m is None:
            if _V1_RE.fullmatch(header):
                raise AuthError("signature format v1 (host, length and body hash unsigned) is no longer "
                                "accepted: the router is older than this server; upgrade it")
            raise AuthError(f"malformed {HEADER} header: expected '{SCHEME} v=2,ts=...,nonce=<32 hex>,"
                            f"body=<64 hex>,sig=<64 hex>'")
        ts, nonce, body_sha256, sig = m.groups()
        now = self._clock()
        if abs(now - int(ts)) > self.window_s:
            raise AuthError(f"request timestamp outside the {self.window_s:g} s window (clock skew or replay)")
        want = _mac(self._key, method, target, (host or "").strip().lower(), ts, nonce, content_length, body_sha256)
        if not hmac.compare_digest(sig, want):
            raise AuthError("bad signature (wrong key, or the request was altered)")
        with self._lock:  # only validly signed heads reach the cache: an outsider cannot fill it
            self._expire(now)
            if int(ts) <= self._forgotten_ts:
                raise AuthError("request no newer than one the replay cache has forgotten (replay, or the "
                                "clock stepped back)")
            if nonce in self._nonces:
                raise AuthError("replayed request (nonce already used)")
            if len(self._nonces) >= self.max_nonces:
                raise AuthError(f"more than {self.max_nonces} signed requests within {self.window_s:g} s; "
                                f"retry shortly", status=503)
            self._nonces[nonce] = float(ts)
        return SignedHead(ts, nonce, body_sha256, sig)

    @staticmethod
    def check_body(head: "SignedHead", body_sha256: str) -> None:
        """AuthError unless the body read hashes to what the verified head announced."""
        if not hmac.compare_digest(head.body_sha256, body_sha256):
            raise AuthError("bad signature: the body is not the one signed (altered on the way)")

    def verify(self, method: str, target: str, host: Optional[str], header: Optional[str],
               body: bytes) -> "SignedHead":
        """``verify_head`` and ``check_body`` of a request whose body is at hand."""
        head = self.verify_head(method, target, host, len(body), header)
        self.check_body(head, hashlib.sha256(body).hexdigest())
        return head

    def sign_reply(self, request_sig: str, status: int, body: bytes) -> str:
        return _reply_mac(self._key, request_sig, status, body)

    def sign_event(self, request_sig: str, index: int, data: bytes) -> bytes:
        return _event_mac(self._key, request_sig, index, data).encode()

    def _expire(self, now: float) -> None:
        # Entries are in arrival order, their ts roughly so; a ts older than the window can no
        # longer be replayed (the window check refuses it), so its nonce may go.
        cutoff = now - self.window_s
        while self._nonces:
            nonce, ts = next(iter(self._nonces.items()))
            if ts >= cutoff:
                break
            del self._nonces[nonce]
            self._forgotten_ts = max(self._forgotten_ts, ts)


@dataclass(frozen=True)
class SignedHead:
    """A request head ``ControlVerifier.verify_head`` accepted."""

    ts: str
    nonce: str
    body_sha256: str  # what the body must hash to
    sig: str  # the request's signature: its reply is signed bound to it
