"""The router's record of each P and MD server it sends requests to (plain data)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class MainBackend:
    url: str
    control_url: str
    wan_peer: str  # HOST:PORT that P dials for this MD (through the WAN emulator in the demo)


@dataclass
class PrefillBackend:
    url: str
    bootstrap_port: int
    host: str = "127.0.0.1"
    # P's WAN-destination API (``--pdd-control-listen`` on P). Set: the router need not wait
    # for MD's registration before starting P and RLD (see PddFlow).
    control_url: Optional[str] = None
    # P's prefill speed as the router measured it (router/backends/loads.py); None: not yet, the path
    # policy's default (or --p-prefill-tokens-per-s) stands.
    prefill_tokens_per_s: Optional[float] = None
