"""The per-request scope the router's handlers set and SGLang's serving code reads back.

Its own module so that app.py (which sets it) and openai_front.py (which sets it for the
OpenAI routes) both import it from below rather than from each other.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Optional


@dataclass
class RequestScope:
    """Per HTTP request, read where SGLang's serving code calls back into the router."""

    operator: bool = False
    options: Optional[dict] = None


current_scope: contextvars.ContextVar[RequestScope] = contextvars.ContextVar("pdd_request_scope",
                                                                              default=RequestScope())
