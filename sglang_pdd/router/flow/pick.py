"""What a flow is opened with besides its request (flow/request.py): where it goes, and what
the router's flows share (plain records, no I/O).

``FlowRunner.open`` (router/front/flow_runner.py) picks the servers and writes down what the
router knew of them at that moment in one frozen ``ServerPick``; a ``PddFlow`` reads its facts
from there and never from the pools. ``FlowShared`` is the same for every flow of one router.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from sglang_pdd.router.backends.servers import MainBackend, PrefillBackend
from sglang_pdd.router.backends.stall import BackendProgress
from sglang_pdd.router.backends.wan_in_flight import WanInFlight
from sglang_pdd.router.flow.fallback import Fallback
from sglang_pdd.router.flow.lingering import Lingering
from sglang_pdd.protocol import KvSize
from sglang_pdd.router.policy import Path


@dataclass(frozen=True)
class ServerPick:
    """One request's servers and the router's facts about them when it picked them."""

    prefill: PrefillBackend
    relay_url: str
    main: Optional[MainBackend] = None  # None: a request without an MD (P and RLD only)
    rld_inflight: int = 0  # RLD's flows in flight when the request arrived: the handoff mode
    p_queued_tokens: int = 0  # P's prefill tokens in flight before this request
    md_cached_estimate: int = 0  # the router's prefix index: what MD holds of the prompt
    p_cached_estimate: int = 0  # ... and what P holds
    md_kv_size: Optional[KvSize] = None  # MD's KV size as the pools last learned it
    force_path: Optional[Path] = None  # an operator's pdd_options path
    use_drc: bool = True  # False (pdd_options drc): MD ignores its cache, plain cross-DC PD
    fallbacks: tuple[Fallback, ...] = ()  # the fallbacks before this flow (a retry's)
    retry: bool = False  # it starts over for a flow that broke before its first token
    p_load: Any = None  # the router's count of P's load (front/flow_runner.PrefillLoad), released at P's reply


@dataclass(frozen=True)
class FlowShared:
    """What every flow of one router shares."""

    session: Any  # the aiohttp client session to the backends (None in tests that start no leg)
    wan_in_flight: WanInFlight = field(default_factory=WanInFlight)  # the router's count of the link
    # Where MD's KV size goes when a registration answer tells it: (MD url, KvSize) -> the pools
    # (backends/pools.py), for the next flows' routes.
    learn_md_kv_size: Optional[Callable[[str, KvSize], None]] = None
    # When each server last made progress, as the router's flows saw it (the relay stall guard's)
    progress: BackendProgress = field(default_factory=BackendProgress)
    # Work a flow leaves behind when it ends (MD's registration answered after a finished request)
    lingering: Lingering = field(default_factory=Lingering)
