"""One generation's parameters, settled once before any leg starts (pure, no I/O).

SGLang's serving layer (router/front/serving.py) turns each item of a client's request into a
``FlowRequest``: the prompt's token ids, the sampling params with ``max_new_tokens`` settled
here and nowhere else, the logprob fields, and the HTTP request's scope (operator or not, its
``pdd_options``). The flow runner (router/front/flow_runner.py) picks the servers and starts a
``PddFlow`` from these values; nothing reads them back from the app.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sglang_pdd.router.front.validate import check_token_budget

# What a request that names no max_new_tokens gets (SGLang's own default).
DEFAULT_MAX_NEW_TOKENS = 128


def settle_max_new_tokens(sampling: dict, prompt_len: int, *, cap: int, context_len: int) -> int:
    """The output budget of a request: the client's ``max_new_tokens`` (checked against the
    router's cap; ApiError(400) otherwise), DEFAULT_MAX_NEW_TOKENS when it names none, and when
    it is None (SGLang's OpenAI classes leave it None when the client sets no max_tokens) what
    one server would decode, up to its context length, within the cap."""
    if "max_new_tokens" not in sampling:
        return DEFAULT_MAX_NEW_TOKENS
    asked = sampling["max_new_tokens"]
    if asked is None:
        return max(0, min(cap, int(context_len) - prompt_len))
    return check_token_budget(asked, "max_new_tokens", cap, allow_missing=False)


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
