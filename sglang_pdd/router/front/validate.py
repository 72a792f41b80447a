"""Strict validation of what clients send the router (pure; no I/O).

Every check raises ``ApiError`` with the HTTP status and a message naming the offending
field; the HTTP front turns it into a JSON error reply. Messages quote the client's own
values (truncated), never ``repr()`` of router internals.

What the router refuses beyond SGLang's own request contract:
- ``max_new_tokens`` / ``max_tokens`` that are not a non-negative int (``"abc"``, ``null``,
  ``true``, ``-1``) or exceed the operator's cap (``--max-new-tokens-cap``);
- ``input_ids`` that are not ints in ``[0, vocab_size)`` (bools are not ints here);
- ``sampling_params.custom_params`` keys starting with ``pdd_`` (the router's own markers to
  P and MD: a client must never choose where KV goes or what counts as output);
- request fields the PDD path cannot honour (images, embeddings, LoRA, sessions, ...);
- a client ``rid`` that is not a string (batches: a list of strings);
- JSON nested deeper than ``MAX_JSON_DEPTH`` (Python's parser would hit its recursion limit);
- more flows than ``--max-flows-per-request`` (batch items x ``n``), and a grammar
  (``json_schema`` / ``regex`` / ``ebnf`` / ``structural_tag``) over ``--max-grammar-bytes``:
  every item runs on P, RLD and MD, and each of them compiles the grammar;
- what one SGLang server refuses before scheduling (``SamplingParams.verify``, a regex or
  JSON schema that cannot compile, ``text`` with ``input_ids``): a PDD leg would fail on it
  after the others started (a 502, or an empty 200).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

import json
import re

RESERVED_CUSTOM_PARAM_PREFIX = "pdd_"

# GenerateReqInput fields the router cannot serve through a PDD flow: refused by name when
# set to anything but their neutral value, instead of being silently dropped.
UNSUPPORTED_GENERATE_FIELDS = (
    "image_data", "video_data", "audio_data", "input_embeds", "lora_path", "lora_id",
    "session_params", "return_hidden_states", "return_routed_experts", "custom_logit_processor",
    "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "data_parallel_rank",
    "routed_dp_rank", "return_sampling_mask", "return_indexer_topk", "conversation_id",
    "max_thinking_tokens",
)


@dataclass
class ApiError(Exception):
    status: int
    message: str

    def __str__(self) -> str:
        return self.message


def _show(value: Any, limit: int = 60) -> str:
    """The client's value for an error message, bounded (a 4 MiB string is not echoed)."""
    text = json.dumps(value) if not isinstance(value, str) else json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."


# Deeper bodies are refused: Python's JSON parser, pydantic and SGLang's own code recurse per
# level. A real request (a JSON schema in response_format included) stays far below.
MAX_JSON_DEPTH = 64

GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")


def json_depth(value: Any) -> int:
    """Containers nested in a parsed JSON value (a scalar: 0, ``[]``: 1), without recursion."""
    depth, level = 0, [value]
    while True:
        containers = [c for c in level if isinstance(c, (dict, list))]
        if not containers:
            return depth
        depth += 1
        level = [v for c in containers for v in (c.values() if isinstance(c, dict) else c)]


def parse_json_object(raw: bytes) -> dict:
    too_deep = ApiError(400, f"malformed JSON body: nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"malformed JSON body: {e.msg if hasattr(e, 'msg') else 'not UTF-8'}") from None
    except RecursionError:
        raise too_deep from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    if json_depth(body) > MAX_JSON_DEPTH:
        raise too_deep
    return body


# A body larger than this is parsed (and checked) on a worker thread, not on the event loop
# that serves every other request. json's C parser holds the GIL while it runs, so what keeps
# the loop responsive is a body bounded before it is parsed (--max-body-bytes; a count of
# JSON values, as detokenize_ids_bound does), not the thread alone.
INLINE_PARSE_BYTES = 1 << 20


async def parse_json_body(raw: bytes, then=None):
    """``parse_json_object(raw)``, and ``then(body)`` on it if given (its result returned),
    inline for a small body, on a worker thread for one over INLINE_PARSE_BYTES."""
    def parse():
        body = parse_json_object(raw)
        return then(body) if then is not None else body

    if len(raw) <= INLINE_PARSE_BYTES:
        return parse()
    import asyncio

    return await asyncio.to_thread(parse)


def check_detokenize_size(raw: bytes, max_row_ids: int, max_total_ids: int, max_rows: int) -> None:
    """Refuse (400) a /v1/detokenize body that cannot hold at most ``max_total_ids`` token ids
    before parsing it: every id but a row's last is followed by a comma, so a body with more
    commas than ids and rows allow holds too many (1.9 M ids took 2.6 s of the router's loop)."""
    if raw.count(b",") > max_total_ids + max_rows:
        raise ApiError(400, f"too many token ids: at most {max_total_ids} in all, {max_row_ids} per row")


def check_detokenize_ids(rows: list, max_row_ids: int, max_total_ids: int) -> None:
    """Each row within ``max_row_ids`` ids, all rows within ``max_total_ids`` (400 naming which)."""
    total = 0
    for i, row in enumerate(rows):
        n = len(row) if isinstance(row, list) else 0
        if n > max_row_ids:
            raise ApiError(400, f"tokens[{i}] has {n} ids, more than {max_row_ids} (the longest sequence this "
                                f"router serves: --max-prompt-tokens plus its max new tokens)")
        total += n
    if total > max_total_ids:
        raise ApiError(400, f"the request has {total} token ids, more than {max_total_ids} in all")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_token_budget(value: Any, field: str, cap: int, allow_missing: bool = True) -> Optional[int]:
    """``max_new_tokens`` (or OpenAI's ``max_tokens``): a non-negative int up to ``cap``."""
    if value is None and allow_missing:
        return None
    if not is_int(value) or value < 0:
        raise ApiError(400, f"{field} must be a non-negative integer, got {_show(value)}")
    if value > cap:
        raise ApiError(400, f"{field} {value} exceeds this router's cap {cap} (--max-new-tokens-cap)")
    return value


def check_token_ids(ids: Any, field: str, vocab_size: int, allow_empty: bool = False) -> list[int]:
    if not isinstance(ids, list) or (not ids and not allow_empty):
        raise ApiError(400, f"{field} must be a non-empty list of token ids")
    for i, t in enumerate(ids):
        if not is_int(t) or not 0 <= t < vocab_size:
            raise ApiError(400, f"{field}[{i}] must be an integer token id in [0, {vocab_size}), got {_show(t)}")
    return ids


def check_custom_params(custom: Any, field: str) -> None:
    if custom is None:
        return
    if not isinstance(custom, dict):
        raise ApiError(400, f"{field} must be an object")
    reserved = sorted(k for k in custom if str(k).startswith(RESERVED_CUSTOM_PARAM_PREFIX))
    if reserved:
        raise ApiError(400, f"{field} keys starting with '{RESERVED_CUSTOM_PARAM_PREFIX}' are reserved for "
                            f"the PDD router: {', '.join(reserved)}")


def check_sampling_params(sp: Any, field: str, *, cap: int, vocab_size: int) -> None:
    """One sampling-params object (SGLang's names). Explicit ``null`` max_new_tokens is refused:
    SGLang would read it as "up to the context length", a budget no client should get by typo."""
    if sp is None:
        return
    if not isinstance(sp, dict):
        raise ApiError(400, f"{field} must be an object")
    if "max_new_tokens" in sp:
        check_token_budget(sp["max_new_tokens"], f"{field}.max_new_tokens", cap, allow_missing=False)
    if "min_new_tokens" in sp:
        check_token_budget(sp["min_new_tokens"], f"{field}.min_new_tokens", cap)
    if sp.get("stop_token_ids") is not None:
        check_token_ids(sp["stop_token_ids"], f"{field}.stop_token_ids", vocab_size, allow_empty=True)
    if "n" in sp and sp["n"] is not None and (not is_int(sp["n"]) or sp["n"] < 1):
        raise ApiError(400, f"{field}.n must be a positive integer, got {_show(sp['n'])}")
    check_custom_params(sp.get("custom_params"), f"{field}.custom_params")


def _items(value: Any) -> Iterable[tuple[str, Any]]:
    if isinstance(value, list):
        return ((f"[{i}]", v) for i, v in enumerate(value))
    return (("", value),)


def check_generate_body(body: dict, *, cap: int, vocab_size: int, max_n: int) -> None:
    """A native ``/generate`` body, after SGLang's own contract check (types of known fields)."""
    for name in UNSUPPORTED_GENERATE_FIELDS:
        if body.get(name) not in (None, False, [], {}):
            raise ApiError(400, f"{name} is not supported by the PDD router")
    ids = body.get("input_ids")
    if ids is not None:
        batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        for suffix, one in (_items(ids) if batch else (("", ids),)):
            check_token_ids(one, f"input_ids{suffix}", vocab_size)
        if body.get("text") is not None:  # SGLang's words
            raise ApiError(400, "text and input_ids cannot be provided at the same time")
    elif body.get("text") in (None, "", []):
        raise ApiError(400, "the body needs a non-empty 'text' or 'input_ids'")
    for suffix, sp in _items(body.get("sampling_params")):
        check_sampling_params(sp, f"sampling_params{suffix}", cap=cap, vocab_size=vocab_size)
        if isinstance(sp, dict) and is_int(sp.get("n")) and sp["n"] > max_n:
            raise ApiError(400, f"sampling_params{suffix}.n {sp['n']} exceeds this router's cap {max_n} (--max-n)")
    rid = body.get("rid")
    if rid is not None and not (isinstance(rid, str) or (isinstance(rid, list) and all(isinstance(r, str) for r in rid))):
        raise ApiError(400, "rid must be a string (a list of strings for a batch)")


def check_openai_body(body: dict, *, cap: int, max_n: int, max_prompt_chars: Optional[int] = None) -> None:
    """Router-specific limits on OpenAI bodies; types are checked by SGLang's pydantic models."""
    if max_prompt_chars is not None:
        if "messages" in body:  # one conversation is one prompt
            check_prompt_chars(text_chars(body["messages"]), "messages", max_prompt_chars)
        for suffix, prompt in _items(body.get("prompt")):  # a completions batch: per prompt
            if isinstance(prompt, str):
                check_prompt_chars(len(prompt), f"prompt{suffix}", max_prompt_chars)
    for field in ("max_tokens", "max_completion_tokens"):
        if field in body and body[field] is not None:
            check_token_budget(body[field], field, cap)
    if is_int(body.get("n")) and body["n"] > max_n:
        raise ApiError(400, f"n {body['n']} exceeds this router's cap {max_n} (--max-n)")
    check_custom_params(body.get("custom_params"), "custom_params")
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, (str, list)):
        raise ApiError(400, "rid must be a string")


@dataclass(frozen=True)
class LogprobLimits:
    """The router's caps on the logprob fields: each one multiplies what P, RLD and MD send
    back for every position (router/backends/reply_limits.py), so together with --max-new-tokens-cap
    they bound the largest reply the router has to read."""

    max_top_logprobs_num: int = 64
    max_token_ids_logprob: int = 64
    # The logprob entries of all of one request's stream events together (stream_logprob_entries):
    # SGLang's events are cumulative, so a request's logprob work grows with the square of its
    # max_new_tokens. 2**24 admits 1,000 tokens with 20 top logprobs (10.5 M entries, ~250 MB of
    # stream) with room for a scored prompt; the largest request a --max-new-tokens-cap of 32768
    # with 64 top logprobs would otherwise allow streams ~35 G entries (>1 TB).
    max_stream_logprob_entries: int = 1 << 24

    def check(self, top_logprobs_num: Any, token_ids_logprob: Any) -> None:
        if is_int(top_logprobs_num) and top_logprobs_num > self.max_top_logprobs_num:
            raise ApiError(400, f"top_logprobs_num {top_logprobs_num} exceeds this router's cap "
                                f"{self.max_top_logprobs_num} (--max-top-logprobs-num)")
        if isinstance(token_ids_logprob, list) and len(token_ids_logprob) > self.max_token_ids_logprob:
            raise ApiError(400, f"token_ids_logprob lists {len(token_ids_logprob)} tokens, more than this "
                                f"router's cap {self.max_token_ids_logprob} (--max-token-ids-logprob)")


    def check_stream(self, max_new_tokens: int, prompt_len: int, logprob_start_len: Any, top_logprobs_num: Any,
                     token_ids_logprob: Any) -> None:
        """A return_logprob request whose stream would carry more logprob entries in all than
        --max-logprob-stream-entries is refused (a client's request never buys unbounded work)."""
        entries = stream_logprob_entries(max_new_tokens, prompt_len, logprob_start_len, top_logprobs_num,
                                         token_ids_logprob)
        if entries > self.max_stream_logprob_entries:
            raise ApiError(400, f"return_logprob with max_new_tokens {max_new_tokens} and top_logprobs_num "
                                f"{top_logprobs_num or 0} streams ~{entries:,} logprob entries in all (each "
                                f"streamed event repeats every position so far), more than this router's cap "
                                f"{self.max_stream_logprob_entries:,} (--max-logprob-stream-entries); ask for "
                                f"fewer tokens or fewer top logprobs")


def stream_logprob_entries(max_new_tokens: int, prompt_len: int, logprob_start_len: Any, top_logprobs_num: Any,
                           token_ids_logprob: Any) -> int:
    """Logprob entries in all of a return_logprob request's stream events, at most: SGLang's
    events are cumulative, so event i (of max_new_tokens) carries i output positions and the
    scored prompt positions (from logprob_start_len on; none by default), each with 1 +
    top_logprobs_num + len(token_ids_logprob) entries. A request that is not streamed to the
    client still costs the router the output part: its legs on RLD and MD are streamed."""
    n = max(0, int(max_new_tokens))
    per_position = 1 + (top_logprobs_num if is_int(top_logprobs_num) and top_logprobs_num > 0 else 0) + \
        (len(token_ids_logprob) if isinstance(token_ids_logprob, list) else 0)
    scored = max(0, prompt_len - logprob_start_len) if is_int(logprob_start_len) and logprob_start_len >= 0 else 0
    return per_position * (n * (n + 1) // 2 + n * scored)


def check_grammar_size(sampling: dict, field: str, max_bytes: int) -> None:
    """P, RLD and MD each compile a request's grammar: its size bounds their work."""
    for name in GRAMMAR_FIELDS:
        grammar = sampling.get(name)
        if grammar is None:
            continue
        size = len(grammar.encode("utf-8", "replace")) if isinstance(grammar, str) else len(json.dumps(grammar))
        if size > max_bytes:
            raise ApiError(400, f"{field}.{name} has {size} bytes, more than this router's cap {max_bytes} "
                                f"(--max-grammar-bytes)")


def text_chars(value: Any) -> int:
    """Characters in every string of a parsed JSON value (a prompt, chat messages), iteratively."""
    total, todo = 0, [value]
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)
    return total


def check_prompt_chars(chars: int, field: str, max_chars: int) -> None:
    """Before tokenizing: a prompt this long cannot fit --max-prompt-tokens anyway, and
    tokenizing it would hold the router for seconds."""
    if chars > max_chars:
        raise ApiError(400, f"{field} has {chars} characters, more than this router's limit {max_chars} "
                            f"(--max-prompt-chars)")


_XGRAMMAR_ERROR_PREFIX = re.compile(r"^\[[^\]]*\] [^:]*:\d+: ")


def load_grammar_checker():
    """xgrammar, SGLang's default grammar backend (None if not installed); importing it takes
    seconds the first time, so the router does it at start."""
    try:
        import xgrammar
    except ImportError:
        return None
    return xgrammar


def _regex_error(regex: str) -> Optional[str]:
    """Why ``regex`` does not compile, as SGLang's default grammar backend (xgrammar) says;
    Python's ``re`` where xgrammar is not installed."""
    xgrammar = load_grammar_checker()
    if xgrammar is None:
        try:
            re.compile(regex)
        except re.error as e:
            return str(e)
        return None
    try:
        xgrammar.Grammar.from_regex(regex)  # the regex -> grammar conversion only: milliseconds
    except RuntimeError as e:
        return _XGRAMMAR_ERROR_PREFIX.sub("", str(e).strip())  # no C++ source location
    return None


def check_sampling_as_sglang(sampling: dict, tokenizer, vocab_size: int) -> None:
    """What one SGLang server refuses with a 400 before scheduling a request, with its words:
    ``SamplingParams`` normalize + verify (temperature, top_p, penalties, stop strings, one
    grammar at most, ...), and grammars that cannot compile (SGLang's scheduler would end the
    request with an empty output instead). Raises ApiError."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    try:
        params = SamplingParams(**sampling)
        params.normalize(tokenizer)
        params.verify(vocab_size)
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    except TypeError as e:  # a wrong type SGLang's own checks do not expect (e.g. "temperature": "x")
        raise ApiError(400, f"bad sampling_params: {e}") from None
    if params.regex is not None:
        problem = _regex_error(params.regex) if isinstance(params.regex, str) else "not a string"
        if problem:
            raise ApiError(400, f"Failed to compile regex grammar: {problem}")
    if params.json_schema is not None and params.json_schema != "$$ANY$$":
        try:
            json.loads(params.json_schema)
        except (TypeError, ValueError) as e:
            raise ApiError(400, f"Failed to compile json grammar: {e}") from None
        except RecursionError:
            raise ApiError(400, "Failed to compile json grammar: nested too deeply") from None


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
