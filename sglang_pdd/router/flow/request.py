"""One generation's parameters, settled once before any leg starts (pure, no I/O).

SGLang's serving layer (router/front/serving.py) turns each item of a client's request into a
``FlowRequest``: the prompt's token ids, the sampling params with ``max_new_tokens`` settled
(front/validate.py's ``settle_max_new_tokens``, and nowhere else), the logprob fields, and the
HTTP request's scope (operator or not, its ``pdd_options``). The flow runner
(router/front/flow_runner.py) picks the servers and opens a ``PddFlow`` on these values;
nothing reads them back from the app.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

@dataclass(frozen=True)
class FlowRequest:
    """What a flow needs of one generation, as values. ``sampling["max_new_tokens"]`` is
    settled (``settle_max_new_tokens``); ``extras``: SGLang's logprob fields (None: none asked);
    ``operator`` / ``options``: the HTTP request's scope (router/front/scope.py); ``rid``: an id for
    the flow's result (None: its internal one)."""

    input_ids: list
    sampling: dict
    extras: Optional[dict] = None
    operator: bool = False
    options: Optional[dict] = None
    rid: Optional[str] = None

    @property
    def max_new_tokens(self) -> int:
        return self.sampling["max_new_tokens"]
