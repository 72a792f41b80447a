"""The per-request scope the router's handlers set and its serving layer reads when it settles
each item of the request (router/front/serving.py's FlowRequest).

Its own module so that front/app.py (which sets it) and front/openai_front.py (which sets it for the
OpenAI routes) both import it from below rather than from each other.
"""

from __future__ import annotations

import contextvars
import math
from dataclasses import dataclass
from typing import Optional


@dataclass
class RequestScope:
    """Per HTTP request: SGLang's entry points cannot carry it to the serving layer."""

    operator: bool = False
    options: Optional[dict] = None
    # The event loop's time by which the request ends (--request-timeout-s from its start), also
    # when its client stops reading the reply (openai_front.sse_reply).
    deadline: float = math.inf


current_scope: contextvars.ContextVar[RequestScope] = contextvars.ContextVar("pdd_request_scope",
                                                                              default=RequestScope())
