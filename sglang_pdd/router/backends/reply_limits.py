"""How much the router reads from a backend, at most (pure).

SGLang streams ``/generate`` cumulatively: each event repeats the whole output so far, and with
``return_logprob`` every position's logprob entries (``top_logprobs_num`` of them with top
logprobs). The last event of a long request is therefore large (1,500 tokens with 20 top
logprobs: ~1 MB) but bounded by what the request asked for. The router reads each event whole,
so it caps an event at that bound, computed per leg from the leg's own body, instead of at a
library default (aiohttp's would cut such a stream off mid-request) or not at all (a backend,
or a relay on the path, could then grow the router without end).

The byte figures are upper bounds of SGLang's JSON (orjson) for one item, with room to spare:
an entry ``[-1.2345678901234567e-05, 151643, null]`` is ~45 bytes; a token's text is its UTF-8
bytes, each at most 6 bytes escaped.
"""

from __future__ import annotations

from typing import Optional

# Fields that do not grow with the output (meta_info's timings, ids, finish_reason with a
# matched stop string, weight version, ...).
EVENT_BASE_BYTES = 1 << 20
OUTPUT_ID_BYTES = 8  # one id in output_ids
TEXT_BYTES_PER_TOKEN = 96  # the cumulative "text" field, per output token
LOGPROB_ENTRY_BYTES = 64  # [logprob, token_id, text_or_null] (the router never asks for text)
SAFETY_FACTOR = 2

# A control API's JSON reply (register, ready, stats, info, a catch-up answer): small dicts.
MAX_CONTROL_REPLY_BYTES = 1 << 20
# An error reply read only to show its start in a message.
MAX_ERROR_BODY_BYTES = 64 << 10


def max_event_bytes(prompt_len: int, max_new_tokens: int, extras: Optional[dict] = None) -> int:
    """The largest ``/generate`` event (one SSE line, or a non-streamed reply) a backend may send
    for a leg of ``prompt_len`` prompt tokens and ``max_new_tokens`` output tokens with the
    logprob fields in ``extras`` (flow.EXTRA_FIELDS)."""
    extras = extras or {}
    per_output = OUTPUT_ID_BYTES + TEXT_BYTES_PER_TOKEN
    size = EVENT_BASE_BYTES + max(0, max_new_tokens) * per_output
    if extras.get("return_logprob"):
        entries = 1 + int(extras.get("top_logprobs_num") or 0) + len(extras.get("token_ids_logprob") or ())
        # every output position and, from logprob_start_len on, every prompt position
        positions = max(0, max_new_tokens) + max(0, prompt_len)
        size += positions * entries * LOGPROB_ENTRY_BYTES
    return SAFETY_FACTOR * size
