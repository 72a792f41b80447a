"""Why a request left its planned path: typed fallback records (pure).

A request records one ``Fallback`` each time MD cannot serve it as planned (router/flow/lifecycle.py
decides most of them, router/flow/pdd_flow.py and router/front/app.py the ones before any leg starts). The
reason is a closed set, so code branches on it (metrics labels, tests) and never parses text;
the detail is for people only (an error message, a URL). Clients see ``str(fallback)``,
"reason: detail", in meta_info.pdd and the request log line.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Reason(str, enum.Enum):
    WAN_FAILED = "wan_failed"  # MD's KV did not land (transfer failed, timed out, control API down)
    WAN_DESTINATION_FAILED = "wan_destination_failed"  # P refused the late WAN destination
    MD_UNAVAILABLE = "md_unavailable"  # no MD took the request (refused, failing, draining)
    MD_FAILED = "md_failed"  # MD refused the handoff or died while owning the stream
    RECOVERED_ON_RELAY = "recovered_on_relay"  # a new P->RLD leg continues the request
    RETRIED_ELSEWHERE = "retried_elsewhere"  # P or RLD broke before the first token: started over
    RELAY_STALLED = "relay_stalled"  # RLD made no progress (router/backends/stall.py): MD goes on, or the request ends


class Recovery(str, enum.Enum):
    """What made the lifecycle start a recovery leg (the detail of RECOVERED_ON_RELAY)."""
    WAN_FAILED_AFTER_RLD = "wan_failed_after_rld"  # RLD's bridge ended and MD's KV never landed
    MD_FAILED = "md_failed"  # MD failed before its first token, RLD's leg had already ended
    MD_FAILED_MID_STREAM = "md_failed_mid_stream"  # MD failed while it owned the stream


@dataclass(frozen=True)
class Fallback:
    reason: Reason
    detail: str = ""
    # WAN_FAILED because the router's wait for MD's KV ran out (a slow WAN, not a broken one):
    # the metrics count it as wan_timeout; clients see the same reason.
    timed_out: bool = False

    def __str__(self) -> str:
        return f"{self.reason.value}: {self.detail}"

    @classmethod
    def recovered(cls, why: Recovery) -> "Fallback":
        return cls(Reason.RECOVERED_ON_RELAY, why.value)
