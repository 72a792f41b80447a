"""The control APIs' messages: one frozen dataclass each, one ``to_json`` / ``from_json``.

``from_json`` validates (ControlError(400) naming the field) and ignores keys it does not
know; ``to_json`` writes the fields in declaration order, leaving out the optional ones at
their "absent" value (``_omit``), so the bytes are what both sides have always sent. A field
added to a message here is sent by the router's client and reaches the server's handler
without any other change (tests/unit/protocol/test_protocol.py shows it for the handoff).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional
from urllib.parse import parse_qs

from sglang_pdd.admission import MAX_ANNOUNCED, check_announced, parse_networks
from sglang_pdd.protocol.errors import bad_request
from sglang_pdd.protocol.kv_size import KvSize
from sglang_pdd.protocol.routes import MAX_ROOM_ID

MAX_MD_TP = 64  # the largest MD TP size anyone accepts (one WAN leg, port and sender per MD rank)
MAX_TOKEN_ID = (1 << 31) - 1  # far above any vocabulary; keeps ids inside the radix key's int64
MAX_PREFIX_LEN = (1 << 31) - 1
MAX_P_TP = 4096
PARAM_PREFIX = "pdd_"  # custom params the router sets; a client's are dropped
RESUME_KEY = "pdd_resume_output_len"  # the resume contract's marker (md/resume.py)


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_md_tp(value, limit: int = MAX_MD_TP, name: str = "md_tp") -> int:
    """An MD TP size: an integer in 1..``limit`` (at most MAX_MD_TP), else ControlError(400)."""
    if not is_int(value) or not 1 <= value <= min(limit, MAX_MD_TP):
        raise bad_request(f"{name} must be an integer in 1..{min(limit, MAX_MD_TP)}, got {repr(value)[:60]}")
    return value


def without_pdd_params(custom: dict) -> dict:
    """``custom_params`` without the router's keys (a client must not set them)."""
    return {key: value for key, value in custom.items() if not str(key).startswith(PARAM_PREFIX)}


# ---- field checks: (value, wire name) -> value, ControlError(400) otherwise ------------------

def _int_in(lo: int, hi: int) -> Callable:
    """MD's wording: "'room' must be an integer in 0..N"."""
    def check(value, name):
        if not is_int(value) or not lo <= value <= hi:
            raise bad_request(f"'{name}' must be an integer in {lo}..{hi}")
        return value
    return check


def _int_field(lo: int, hi: int, bounds: str = "") -> Callable:
    """P's wording: the type first ("md_room must be int, got '1'"), then the bounds."""
    def check(value, name):
        if not is_int(value):
            raise bad_request(f"{name} must be int, got {repr(value)[:60]}")
        if not lo <= value <= hi:
            raise bad_request(f"{name} must be {bounds or f'in {lo}..{hi}'}")
        return value
    return check


def _bool(value, name):
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean")
    return value


def _str(value, name):
    if not isinstance(value, str):
        raise bad_request(f"{name} must be str, got {repr(value)[:60]}")
    return value


def _optional(check: Callable) -> Callable:
    return lambda value, name: None if value is None else check(value, name)


def _object(value, name):
    if value is not None and not isinstance(value, dict):
        raise bad_request(f"{name} must be an object")
    return {} if value is None else value


def _token_ids(nonempty: bool) -> Callable:
    def check(value, name):
        if not isinstance(value, list) or (nonempty and not value) or \
                not all(is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in value):
            raise bad_request(f"'{name}' must be a {'non-empty ' if nonempty else ''}list of non-negative ints "
                              f"(<= {MAX_TOKEN_ID})")
        return value
    return check


def _any(value, name):
    return value


def _md_tp(value, name):
    return check_md_tp(value, name=name)


def _tp_size(value, name):
    if not is_int(value) or not 1 <= value <= MAX_P_TP:
        raise bad_request(f"{name} must be a positive int, got {repr(value)[:60]}")
    return value


def wire(check: Callable = _any, *, omit: Optional[Callable[[Any], bool]] = None, key: Optional[str] = None,
         **kw):
    """A message field: ``check`` validates it in from_json, ``omit(value)`` leaves it out of
    to_json, ``key`` is its name on the wire (default: the field's)."""
    return field(metadata={"check": check, "omit": omit, "key": key}, **kw)


def _absent(value) -> bool:
    return value is None


class Message:
    """to_json / from_json over the dataclass's fields (see ``wire``)."""

    @classmethod
    def wire_key(cls, name: str) -> str:
        """Field ``name``'s key on the wire (for messages naming a field)."""
        f = next(f for f in dataclasses.fields(cls) if f.name == name)
        return f.metadata.get("key") or f.name

    def to_json(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            omit = f.metadata.get("omit")
            if omit is not None and omit(value):
                continue
            out[f.metadata.get("key") or f.name] = value
        return out

    @classmethod
    def from_json(cls, body):
        if not isinstance(body, dict):
            raise bad_request("body must be a JSON object")
        values = {}
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            key = f.metadata.get("key") or f.name
            if key in body:
                values[f.name] = f.metadata.get("check", _any)(body[key], key)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                f.metadata.get("check", _any)(None, key)  # the field's own message for "missing"
                raise bad_request(f"{key} is required")
        return cls(**values)


# ---- MD: rooms --------------------------------------------------------------------------------

def _use_cache(value, name):
    if not isinstance(value, bool):
        raise bad_request("'use_cache' must be true or false")
    return value


@dataclass(frozen=True)
class RegisterRequest(Message):
    """``POST /pdd/rooms``: match the prompt in MD's cache (unless ``use_cache`` is off) and
    hold a room for its KV."""

    room: int = wire(_int_in(0, MAX_ROOM_ID))
    token_ids: list = wire(_token_ids(nonempty=True))
    use_cache: bool = wire(_use_cache, default=True)


@dataclass(frozen=True)
class RegisterReply(Message):
    """MD's answer: the prompt tokens it already holds (P sends the rest), where its WAN
    receiver listens (rank r at the port + r), its TP size (absent: 1) and KV size."""

    room: int = wire(_int_in(0, MAX_ROOM_ID))
    cached_tokens: int = wire(_int_in(0, MAX_PREFIX_LEN))
    prompt_tokens: Optional[int] = wire(_optional(_int_in(0, MAX_PREFIX_LEN)), omit=_absent, default=None)
    wan_peer: Optional[str] = wire(_optional(_str), omit=_absent, default=None)
    tp_size: Optional[int] = wire(_optional(lambda v, n: check_md_tp(v, name="tp_size")), omit=_absent, default=None)
    kv_bytes_per_token: Optional[int] = wire(_optional(_int_in(0, 1 << 40)), omit=_absent, default=None)
    kv_layout: Optional[dict] = wire(_optional(_object), omit=_absent, default=None)
    # a sliding-window pool: kv_bytes_per_token is the full layers', the window's here (KvSize)
    kv_window_tokens: Optional[int] = wire(_optional(_int_in(0, MAX_PREFIX_LEN)), omit=_absent, default=None)
    kv_window_bytes_per_token: Optional[int] = wire(_optional(_int_in(0, 1 << 40)), omit=_absent, default=None)

    @property
    def md_tp(self) -> int:
        return 1 if self.tp_size is None else self.tp_size

    @property
    def kv_size(self) -> Optional[KvSize]:
        """MD's KV size (None when it did not say)."""
        return KvSize.reported(dataclasses.asdict(self))


READY_STATES = ("ready", "failed", "pending")


def _ready_status(value, name):
    if value not in READY_STATES:
        raise bad_request(f"{name} must be one of {READY_STATES}, got {repr(value)[:60]}")
    return value


@dataclass(frozen=True)
class ReadyRequest:
    """``GET /pdd/rooms/{room}/ready?timeout_s=``: wait up to ``timeout_s`` (capped) for
    the room's KV."""

    room: int
    timeout_s: float = 10.0
    MAX_TIMEOUT_S: ClassVar[float] = 600.0

    @classmethod
    def from_query(cls, room: int, query: str) -> "ReadyRequest":
        return cls(room, min(_query_float(query, "timeout_s", default=10.0), cls.MAX_TIMEOUT_S))


@dataclass(frozen=True)
class ReadyReply(Message):
    room: int = wire(_int_in(0, MAX_ROOM_ID))
    status: str = wire(_ready_status)
    reason: Optional[str] = wire(_optional(_str), default=None)


@dataclass(frozen=True)
class ReleaseRequest:
    """``DELETE /pdd/rooms/{room}?keep_kv=0|1``: ``keep_kv``: the request is over, but KV
    still crossing the WAN may land and be cached (the session's next turn)."""

    room: int
    keep_kv: bool = False

    @classmethod
    def from_query(cls, room: int, query: str) -> "ReleaseRequest":
        keep = parse_qs(query).get("keep_kv", ["0"])
        if keep not in (["0"], ["1"]):
            raise bad_request("keep_kv must be 0 or 1")
        return cls(room, keep == ["1"])


@dataclass(frozen=True)
class ReleaseReply(Message):
    released: bool = wire(_any)


# ---- MD: the handoff ---------------------------------------------------------------------------

HANDOFF_LOGPROB_FIELDS = ("return_logprob", "top_logprobs_num", "logprob_start_len", "token_ids_logprob")


@dataclass(frozen=True)
class HandoffRequest(Message):
    """``POST /pdd/rooms/{room}/handoff``: MD continues the request after the ``token_ids``
    (eager tokens, output already produced) and, unless ``warmup``, streams it from position 0;
    ``max_new_tokens`` in ``sampling_params`` is the whole budget, eager tokens included. A
    warmup (catch-up batch) only extends MD's cache by the tokens and may repeat."""

    token_ids: list = wire(_token_ids(nonempty=False))
    rid: Optional[str] = wire(_optional(_str), default=None)
    sampling_params: dict = wire(_object, default_factory=dict)
    stream: bool = wire(_bool, default=True)
    warmup: bool = wire(_bool, default=False)
    # SGLang's logprob fields, sent only when asked for
    return_logprob: Any = wire(omit=_absent, default=None)
    top_logprobs_num: Any = wire(omit=_absent, default=None)
    logprob_start_len: Any = wire(omit=_absent, default=None)
    token_ids_logprob: Any = wire(omit=_absent, default=None)


def _sources(value, name):
    if not isinstance(value, list) or len(value) > MAX_ANNOUNCED or not all(isinstance(v, str) for v in value):
        raise bad_request(f"{name} must be a list of at most {MAX_ANNOUNCED} addresses or networks")
    try:
        check_announced(parse_networks(value))
    except ValueError as e:
        raise bad_request(f"{name}: {e}") from None
    return tuple(value)


@dataclass(frozen=True)
class KvSendersRequest(Message):
    """``POST /pdd/kv_senders``: the addresses (or networks) of the P hosts that send this MD
    KV, as the router knows them: known peers of MD's WAN receiver from now on, in place of
    the last ones (a keyless flood cannot keep them out of the handshake slots)."""

    sources: tuple = wire(_sources)


@dataclass(frozen=True)
class KvSendersReply(Message):
    known: int = wire(_int_in(0, MAX_ANNOUNCED))


@dataclass(frozen=True)
class HealthReply(Message):
    """``GET /health`` on P's and MD's control APIs (unsigned, as SGLang's own /health): the
    same body on both, SGLang's shape."""

    status: str = wire(_str, default="ok")


# ---- P: WAN destinations -----------------------------------------------------------------------

@dataclass(frozen=True)
class WanDestinationRequest(Message):
    """``POST /pdd/wan_destinations``: P sends request ``bootstrap_room``'s KV from token
    ``md_prefix_len`` on to MD's ``md_room`` at ``wan_peer`` (HOST:PORT of MD rank 0's WAN
    receiver; MD on TP ``md_tp``: rank r at the port + r)."""

    bootstrap_room: int = wire(_int_field(0, MAX_ROOM_ID))
    md_room: int = wire(_int_field(0, MAX_ROOM_ID))
    wan_peer: str = wire(_str)
    md_prefix_len: int = wire(_int_field(0, MAX_PREFIX_LEN, ">= 0 and < 2^31"))
    md_tp: int = wire(_md_tp, omit=lambda v: v == 1, default=1)


@dataclass(frozen=True)
class DestinationReply(Message):
    accepted: bool = wire(_any, default=True)
    sends_wan: Optional[bool] = wire(_optional(_bool), omit=_absent, default=None)  # False: a rank that keeps none


@dataclass(frozen=True)
class DropReply(Message):
    """``DELETE /pdd/wan_destinations/{bootstrap_room}``'s answer."""

    dropped: bool = wire(_any, default=True)
    sends_wan: Optional[bool] = wire(_optional(_bool), omit=_absent, default=None)


@dataclass(frozen=True)
class KeptReply(Message):
    """``POST /pdd/wan_destinations/{bootstrap_room}/kept``'s answer: whether this P rank was
    sending that room (False: it never did, or it has ended)."""

    kept: bool = wire(_bool, default=True)


@dataclass(frozen=True)
class InfoReply(Message):
    """``GET /pdd/info``: this P rank and how many there are (each serves its own API)."""

    tp_rank: int = wire(_int_in(0, MAX_P_TP))
    tp_size: int = wire(_tp_size)
    sends_wan: bool = wire(_bool)


# ---- the router's legs: custom_params on P's and RLD's /generate -------------------------------

@dataclass(frozen=True)
class LegParams(Message):
    """Where P sends a leg's KV over the WAN, in ``sampling_params.custom_params``: MD's room,
    MD rank 0's WAN receiver and the prompt tokens MD already holds; or, with ``wan_expected``,
    only the room: P waits for the destination on its control API (WanDestinationRequest)."""

    room: int = wire(lambda v, n: _leg_int(v, n, MAX_ROOM_ID, "0..2^63-1"), key="pdd_room")
    wan_peer: Optional[str] = wire(_optional(lambda v, n: str(v)[:300]), omit=_absent, default=None,
                                   key="pdd_wan_peer")
    md_prefix_len: Optional[int] = wire(_optional(lambda v, n: _leg_int(v, n, MAX_PREFIX_LEN, "0..2^31-1")),
                                        omit=_absent, default=None, key="pdd_md_prefix_len")
    md_tp: int = wire(_md_tp, omit=lambda v: v == 1, default=1, key="pdd_md_tp")
    wan_expected: bool = wire(lambda v, n: bool(v), omit=lambda v: not v, default=False, key="pdd_wan_expected")

    @classmethod
    def destination(cls, room: int, wan_peer: str, md_prefix_len: int, md_tp: int = 1) -> "LegParams":
        return cls(room, wan_peer, md_prefix_len, md_tp)

    @classmethod
    def late(cls, room: int) -> "LegParams":
        """P learns the destination later (its control API)."""
        return cls(room, wan_expected=True)

    @classmethod
    def from_custom_params(cls, params) -> Optional["LegParams"]:
        """The destination a leg carries (None without ``pdd_wan_peer``); ControlError(400)
        naming the field if malformed. A late destination is ``expects_destination``'s."""
        if not isinstance(params, dict) or "pdd_wan_peer" not in params:
            return None
        leg = cls.from_json(params)
        return dataclasses.replace(leg, md_prefix_len=0) if leg.md_prefix_len is None else leg

    @staticmethod
    def expects_destination(params) -> bool:
        """The leg's P waits for its destination on its control API."""
        return isinstance(params, dict) and bool(params.get("pdd_wan_expected"))


def _leg_int(value, name, hi, text):
    if not is_int(value) or not 0 <= value <= hi:
        raise bad_request(f"{name} must be an integer in {text}, got {repr(value)[:40]}")
    return value


def resume_marker(output_len: int) -> dict:
    """The custom param marking the last ``output_len`` input ids as output already produced."""
    return {RESUME_KEY: output_len}


# ---- queries ------------------------------------------------------------------------------------

def _query_float(query: str, name: str, *, default: float) -> float:
    """A finite non-negative number from the query, else ControlError(400)."""
    values = parse_qs(query).get(name)
    if not values:
        return default
    try:
        value = float(values[-1])
    except ValueError:
        raise bad_request(f"{name} must be a number") from None
    if not 0 <= value < math.inf:  # also refuses nan
        raise bad_request(f"{name} must be a finite number >= 0")
    return value

