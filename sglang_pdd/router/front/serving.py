"""SGLang's serving layer on top of PDD flows: one adapter that quacks like SGLang's
``TokenizerManager`` where its HTTP entry points need it.

SGLang's ``/generate`` handler and its OpenAI classes (``OpenAIServingChat``,
``OpenAIServingCompletion``: chat templates, tool-call and reasoning parsers,
``response_format``, usage, streaming chunks) only call ``tokenizer_manager.generate_request(
GenerateReqInput, raw_request)`` and read SGLang output dicts (``{"text", "output_ids",
"meta_info", "index"}``), plus the tokenizer, model config and server args. ``PddTokenizerManager``
provides exactly that; its ``generate_request`` runs one ``PddFlow`` per item (batch x ``n``,
SGLang's ``GenerateReqInput`` normalization) and detokenizes incrementally
(router/front/detokenize.py). So templates, parsers and response formats are SGLang's own code.

The router process publishes a ``ServerArgs`` (role "tokenizer") built from the router's flags
(``--tokenizer-path``, ``--chat-template``, ``--tool-call-parser``, ...) so that SGLang's
``get_serving()`` / ``get_model()`` settings read here as on a plain server.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import uuid
from dataclasses import fields
from types import SimpleNamespace
from typing import AsyncIterator, Callable, Optional

from fastapi import HTTPException

from sglang_pdd.router.front.detokenize import IncrementalDetokenizer
from sglang_pdd.router.flow.fallback import Fallback
from sglang_pdd.router.flow.request import FlowRequest
from sglang_pdd.router.front.validate import settle_max_new_tokens
from sglang_pdd.router.front.scope import current_scope
from sglang_pdd.router.front.validate import (GRAMMAR_FIELDS, ApiError, LogprobLimits, check_custom_params, check_grammar_size,
                                        check_prompt_chars, check_sampling_as_sglang, check_token_ids,
                                        load_grammar_checker, text_chars)

logger = logging.getLogger("sglang_pdd.router")

LOGPROB_FIELDS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs",
                  "input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")


# Default --max-prompt-chars per --max-prompt-tokens: far above what real text takes per token
# (~4 characters), so only prompts that could never fit are refused before tokenizing.
PROMPT_CHARS_PER_TOKEN = 16
# Text up to this long is tokenized (or its stop strings and regex checked) inline: well under a
# millisecond, less than a hop to a worker thread costs. Longer text goes off the event loop.
INLINE_TEXT_CHARS = 4096


class UpstreamError(HTTPException):
    """A backend leg failed and the flow could not recover: HTTP 502 (SGLang's OpenAI classes
    turn an ``HTTPException`` into an error reply with this status)."""

    def __init__(self, message: str, status_code: int = 502, headers: Optional[dict] = None):
        super().__init__(status_code=status_code, detail=message, headers=headers)


class BackendsUnavailable(UpstreamError):
    """No backend of a needed role may take the request now (failing or draining): 503 with
    Retry-After, as an overloaded SGLang server answers; nothing was started."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message, 503, {"Retry-After": str(retry_after_s)})


class Aborted(Exception):
    """/abort_request named this request."""


def build_sglang_state(argv: list[str]):
    """(server_args, model_config, tokenizer, template_manager) for the router process, as
    SGLang's tokenizer process builds them; ``argv`` are SGLang server flags."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.runtime_context import get_serving, publish
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils.hf_transformers_utils import get_tokenizer

    server_args = prepare_server_args(argv)
    publish(server_args, role="tokenizer")
    model_config = ModelConfig.from_server_args(server_args)
    serving = get_serving()
    tokenizer = get_tokenizer(serving.tokenizer_path, tokenizer_mode=serving.tokenizer_mode,
                              trust_remote_code=server_args.trust_remote_code)
    return server_args, model_config, tokenizer


class PddTokenizerManager:
    """The TokenizerManager surface SGLang's entry points use, serving requests by PDD flows.

    Each item's parameters are settled here once (``FlowRequest``: router/flow/request.py) and
    handed to ``flows`` (router/front/flow_runner.py's FlowRunner): ``flows.open(request)`` returns a
    started-on-iteration flow (``PddFlow``), ``flows.run(flow)`` is an async context manager
    that accounts for it (load, metrics), ``flows.retry(flow)`` starts a flow that failed
    before its first token over on other servers (or None).
    """

    def __init__(self, server_args, model_config, tokenizer, *, flows, max_prompt_tokens: int,
                 max_new_tokens_cap: int, report_cached_tokens: bool = False, max_prompt_chars: Optional[int] = None,
                 max_flows_per_request: int = 64, max_grammar_bytes: int = 16384,
                 logprob_limits: LogprobLimits = LogprobLimits()):
        self.server_args, self.model_config, self.tokenizer = server_args, model_config, tokenizer
        self.model_path = server_args.model_path
        self.served_model_name = server_args.served_model_name or server_args.model_path
        self.flows = flows
        self.max_prompt_tokens, self.max_new_tokens_cap = max_prompt_tokens, max_new_tokens_cap
        self.max_prompt_chars = max_prompt_chars if max_prompt_chars is not None else \
            max_prompt_tokens * PROMPT_CHARS_PER_TOKEN
        self.max_flows_per_request, self.max_grammar_bytes = max_flows_per_request, max_grammar_bytes
        self.logprob_limits = logprob_limits
        self.report_cached_tokens = report_cached_tokens
        load_grammar_checker()  # at start, not on the first request with a regex
        self.vocab_size = int(model_config.vocab_size)
        # SGLang's serving code asks whether to log request bodies: never here (router logs
        # one line per request itself).
        self.request_logger = SimpleNamespace(log_requests=False, log_requests_level=0)
        eos = getattr(model_config, "hf_eos_token_id", None) or set()
        self.eos_token_ids = set(eos) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
        # client rid -> abort events of its running items (duplicates in flight are refused)
        self.inflight: dict[str, list[asyncio.Event]] = {}

    # ---------------------------------------------------------------- SGLang's surface
    def config_value(self, name: str):
        if name in ("model_path", "served_model_name"):
            return getattr(self, name)
        from sglang.srt.runtime_context import get_context

        return get_context().config_leaf(name)

    def create_abort_task(self, obj):
        return None  # a client disconnect cancels the handler, whose flows abort their legs

    async def generate_request(self, obj, request=None) -> AsyncIterator:
        """SGLang's contract: a single request yields its output dicts (cumulative; one final
        dict unless streaming); a batch yields one list (non-streaming) or dicts tagged with
        ``index`` (streaming, in completion order). Item order is SGLang's: batch i, sample j
        at index i * n + j."""
        client_rids = [obj.rid] if isinstance(obj.rid, str) else list(obj.rid or [])
        if obj.text is not None and obj.input_ids is not None:  # SGLang's words
            raise ValueError("text and input_ids cannot be provided at the same time")
        obj.normalize_batch_and_arguments()
        n = obj.parallel_sample_num
        flows = 1 if obj.is_single else obj.batch_size * n
        if flows > self.max_flows_per_request:  # each flow is a P, an RLD and an MD leg
            raise ValueError(f"the request asks for {flows} generations (batch items x n), more than this "
                             f"router's cap {self.max_flows_per_request} (--max-flows-per-request)")
        items = []
        if obj.is_single:
            items.append((obj, obj.rid))
        else:
            for i in range(obj.batch_size):
                for _ in range(n):
                    sub = copy.copy(obj[i])
                    items.append((sub, obj[i].rid if n == 1 else uuid.uuid4().hex))
        for rid in client_rids:
            if rid in self.inflight:
                raise ValueError(f"rid {rid!r} is already in flight; request ids must be unique")
        prepared = [await self._prepare(item) for item, _ in items]  # every item valid before any starts
        aborts = [(rid, asyncio.Event()) for _, rid in items]
        for rid, event in aborts:  # registered now: a duplicate rid racing this one is refused
            self.inflight.setdefault(rid, []).append(event)
        try:
            runs = [self._run_item(item, rid, event, prep)
                    for (item, _), (rid, event), prep in zip(items, aborts, prepared)]
            if len(runs) == 1 and obj.is_single:
                async for out in runs[0]:
                    yield out
            elif not obj.stream:
                yield await _gather_all_or_none([self._last(run) for run in runs])
            else:
                async for out in _merge(runs):
                    yield out
        finally:
            for rid, event in aborts:
                left = self.inflight.get(rid, [])
                if event in left:
                    left.remove(event)
                if not left:
                    self.inflight.pop(rid, None)

    # ---------------------------------------------------------------- one item
    async def _prepare(self, item) -> FlowRequest:
        """The item's settled parameters; ValueError -> HTTP 400. Cheap checks first:
        tokenizing runs only for a request otherwise valid."""
        try:
            sampling = dict(item.sampling_params or {})
            sampling.pop("n", None)  # the router fans n out into flows; a backend must not
            check_grammar_size(sampling, "sampling_params", self.max_grammar_bytes)
            # SGLang's normalize tokenizes the stop strings
            await _off_loop_if_long(text_chars([sampling.get(k) for k in ("stop", *GRAMMAR_FIELDS)]),
                                    check_sampling_as_sglang, sampling, self.tokenizer, self.vocab_size)
            if item.input_ids is not None:
                ids = check_token_ids(list(item.input_ids), "input_ids", self.vocab_size)
            elif isinstance(item.text, str) and item.text:
                check_prompt_chars(len(item.text), "the prompt", self.max_prompt_chars)
                # a long prompt takes seconds (the Rust tokenizer drops the GIL meanwhile)
                ids = await _off_loop_if_long(len(item.text), self.tokenizer.encode, item.text)
            else:
                raise ApiError(400, "the request needs a non-empty 'text' or 'input_ids'")
            if len(ids) > self.max_prompt_tokens:
                raise ApiError(400, f"the prompt has {len(ids)} tokens, more than this router's "
                                    f"--max-prompt-tokens {self.max_prompt_tokens}")
            sampling["max_new_tokens"] = settle_max_new_tokens(sampling, len(ids), cap=self.max_new_tokens_cap,
                                                               context_len=self.model_config.context_len)
            check_custom_params(sampling.get("custom_params"), "custom_params")
        except ApiError as e:
            raise ValueError(e.message) from None
        extras = None
        if item.return_logprob:
            self._check_logprob_fields(item, len(ids), int(sampling["max_new_tokens"]))
            extras = {"return_logprob": True, "logprob_start_len": item.logprob_start_len,
                      "top_logprobs_num": item.top_logprobs_num, "token_ids_logprob": item.token_ids_logprob}
        scope = current_scope.get()  # the HTTP request's: set by the route SGLang's code runs in
        return FlowRequest(ids, sampling, extras, operator=scope.operator, options=scope.options)

    def _check_logprob_fields(self, item, prompt_len: int, max_new_tokens: int) -> None:
        """What one server refuses with a 400 (its scheduler or tokenizer manager), refused here
        before any leg starts: a backend would fail the leg, i.e. a 502. Then the router's own
        caps (a stream's logprob entries in all: --max-logprob-stream-entries)."""
        from sglang.srt.managers.tokenizer_manager import TokenizerManager

        try:
            self.logprob_limits.check(item.top_logprobs_num, item.token_ids_logprob)
            self.logprob_limits.check_stream(max_new_tokens, prompt_len, item.logprob_start_len,
                                             item.top_logprobs_num, item.token_ids_logprob)
        except ApiError as e:
            raise ValueError(e.message) from None
        start = item.logprob_start_len
        if start is not None and start > prompt_len:  # SGLang's scheduler message
            raise ValueError(f"logprob_start_len={start} is higher than the number of input tokens "
                             f"{prompt_len}. Please use a smaller logprob_start_len.")
        TokenizerManager._validate_token_ids_logprob(self, item)  # SGLang's own check (vocab range)

    async def _last(self, run: AsyncIterator) -> dict:
        out = None
        async for out in run:
            pass
        return out

    async def _run_item(self, item, rid: str, abort: asyncio.Event, req: FlowRequest):
        ids, sampling = req.input_ids, req.sampling
        flow = self.flows.open(req)
        detok = IncrementalDetokenizer(
            self.tokenizer, ids, skip_special_tokens=sampling.get("skip_special_tokens", True),
            spaces_between_special_tokens=sampling.get("spaces_between_special_tokens", True),
            no_stop_trim=bool(sampling.get("no_stop_trim", False)))
        stop = sampling.get("stop") or []
        stop_strs = [stop] if isinstance(stop, str) else list(stop)
        stop_ids = set(sampling.get("stop_token_ids") or [])
        if not sampling.get("ignore_eos"):
            stop_ids |= self.eos_token_ids
        output_ids: list[int] = []
        held: list[int] = []  # a stream step that may be the last one, until the flow says
        finish: Optional[dict] = None
        while True:
            try:
                async with self.flows.run(flow) as events:
                    async for new in _until(events, abort):
                        step = held + list(new)
                        if not item.stream or detok.may_finish_with(step, stop_strs, stop_ids):
                            held = step
                            continue
                        held = []
                        output_ids.extend(step)
                        detok.add(step)
                        yield self._output(flow, rid, ids, output_ids, detok.text, None, item)
                    finish = _finish_reason(flow) or {"type": "length", "length": len(output_ids) + len(held)}
                break
            except Aborted:
                finish = {"type": "abort", "message": "aborted by /abort_request"}
                break
            except UpstreamError:
                # Nothing reached the client yet: the request starts over on other servers, once.
                retry = None if output_ids or held else self.flows.retry(flow)
                if retry is None:
                    raise
                flow = retry
        output_ids.extend(held)
        detok.add(held, finish)
        yield self._output(flow, rid, ids, output_ids, detok.text, finish, item)

    def abort(self, rid: Optional[str] = None, abort_all: bool = False) -> int:
        events = [e for r, evs in self.inflight.items() if abort_all or r == rid for e in evs]
        for e in events:
            e.set()
        return len(events)

    def _output(self, flow, rid, prompt_ids, output_ids, text, finish, item) -> dict:
        meta_out = flow.output_meta
        r = flow.result
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(prompt_ids),
                "weight_version": self.config_value("weight_version"),
                "completion_tokens": len(output_ids), "reasoning_tokens": 0,
                # P's prefix hit; 0 unless --enable-cache-report (cross-tenant cache probing)
                "cached_tokens": min(r.p_cached_tokens, len(prompt_ids)) if self.report_cached_tokens else 0}
        if item.return_logprob:
            n = len(output_ids)
            for key in LOGPROB_FIELDS:
                if key in meta_out:
                    values = meta_out[key]
                    meta[key] = values[:n] if key.startswith("output") else values
            if "output_token_logprobs" in meta:  # SGLang's streaming OpenAI classes read it
                meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
            if item.return_text_in_logprobs:
                for key in ("output_token_logprobs", "input_token_logprobs"):
                    if meta.get(key):
                        meta[key] = self._with_text(meta[key])
                for key in ("output_top_logprobs", "input_top_logprobs", "output_token_ids_logprobs",
                            "input_token_ids_logprobs"):
                    if meta.get(key):
                        meta[key] = [self._with_text(row) if row else row for row in meta[key]]
        if flow.operator:
            meta["pdd"] = result_dict(r)
        return {"text": text, "output_ids": list(output_ids), "meta_info": meta}

    def _with_text(self, entries: list) -> list:
        """(logprob, token_id, None) -> (logprob, token_id, text), as SGLang's
        ``detokenize_logprob_tokens`` (each id decoded on its own)."""
        known = [e for e in entries if e is not None and e[1] is not None]
        if not known:
            return entries
        texts = iter(self.tokenizer.batch_decode([[e[1]] for e in known]))
        return [[e[0], e[1], next(texts)] if e is not None and e[1] is not None else e for e in entries]


async def _off_loop_if_long(chars: int, fn: Callable, *args):
    """``fn(*args)`` for work on ``chars`` characters of text: inline when short, else in a
    worker thread so the event loop keeps serving other requests."""
    if chars <= INLINE_TEXT_CHARS:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


def _finish_reason(flow) -> Optional[dict]:
    meta = flow.output_meta
    return meta.get("finish_reason") or flow.result.finish_reason


def result_dict(result) -> dict:
    """``dataclasses.asdict`` of a FlowResult (scalars, lists of scalars, the finish-reason
    dict), for a fraction of its cost: an operator's stream carries it in every event. A
    fallback (router/flow/fallback.py) is reported as its text, "reason: detail"."""
    out = {}
    for name in _result_fields(type(result)):
        value = getattr(result, name)
        if isinstance(value, list):
            value = [copy.deepcopy(v) if isinstance(v, (list, dict)) else str(v) if isinstance(v, Fallback) else v
                     for v in value]
        elif isinstance(value, dict):
            value = copy.deepcopy(value)
        out[name] = value
    return out


_RESULT_FIELDS: dict[type, tuple[str, ...]] = {}


def _result_fields(cls: type) -> tuple[str, ...]:
    names = _RESULT_FIELDS.get(cls)
    if names is None:
        names = _RESULT_FIELDS[cls] = tuple(f.name for f in fields(cls))
    return names


async def _until(events: AsyncIterator, abort: asyncio.Event) -> AsyncIterator:
    """The flow's events until it ends or /abort_request sets ``abort`` (raises Aborted). A
    pending step is cancelled and awaited on any exit, so the flow can be closed right after.
    The abort cancels the pending step from a callback, so a step costs one task, not an
    ``asyncio.wait`` over two (this runs once per streamed event)."""
    aborted = asyncio.ensure_future(abort.wait())
    nxt = None

    def stop(_) -> None:
        if nxt is not None:
            nxt.cancel()

    aborted.add_done_callback(stop)
    try:
        while True:
            if aborted.done():
                raise Aborted()
            nxt = asyncio.ensure_future(events.__anext__())
            try:
                new = await nxt
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if aborted.done() and not asyncio.current_task().cancelling():
                    raise Aborted() from None
                raise
            yield new
    finally:
        aborted.remove_done_callback(stop)
        aborted.cancel()
        if nxt is not None and not nxt.done():
            nxt.cancel()
            await asyncio.gather(nxt, return_exceptions=True)


async def _gather_all_or_none(coros: list) -> list:
    """Every item's result, or the first failure with the other items' flows stopped (their
    legs aborted) rather than left running for a reply nobody will read."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _merge(runs: list) -> AsyncIterator[dict]:
    """Streams of a batch, interleaved as they come, each output tagged with its item index."""
    tasks = {asyncio.ensure_future(run.__anext__()): (i, run) for i, run in enumerate(runs)}
    try:
        while tasks:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i, run = tasks.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                out["index"] = i
                yield out
                tasks[asyncio.ensure_future(run.__anext__())] = (i, run)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(run.aclose() for run in runs), return_exceptions=True)
