"""OpenAI endpoints of the router: SGLang's own serving classes behind aiohttp.

``OpenAIServingChat`` / ``OpenAIServingCompletion`` (templates, tool-call and reasoning
parsers, ``response_format``, usage, stream chunks) run unchanged on the router's
``PddTokenizerManager``; this module parses bodies with SGLang's pydantic models, applies the
router's own limits (router/front/validate.py) and turns the Starlette responses SGLang returns into
aiohttp ones (a JSON body, or its SSE stream written as it comes).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from typing import AsyncIterator, Callable

import orjson
from aiohttp import web
from pydantic import BaseModel, ValidationError

from sglang_pdd.router.front.scope import current_scope
from sglang_pdd.router.front.serving import INLINE_TEXT_CHARS, UpstreamError
from sglang_pdd.router.front.validate import (ApiError, check_detokenize_ids, check_detokenize_size, check_openai_body,
                                        check_prompt_chars, check_token_ids, parse_json_body, text_chars)

logger = logging.getLogger("sglang_pdd.router")


def dumps_bytes(obj) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS)


def _dumps(obj) -> str:
    return dumps_bytes(obj).decode()


def _error(status: int, message: str, err_type: str = "BadRequestError", param=None) -> web.Response:
    """OpenAI's error envelope as SGLang writes it (ErrorResponse)."""
    return web.json_response({"object": "error", "message": message, "type": err_type, "param": param,
                              "code": status}, status=status)


def _pydantic_message(e: ValidationError) -> str:
    """Field path and reason of each error; never the whole input echoed back."""
    parts = []
    for err in e.errors()[:5]:
        where = ".".join(str(p) for p in err.get("loc", ())) or "body"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts)


class WriteDeadline:
    """A client that stops reading cannot hold its request past the request's deadline: a
    write still waiting for the client then (its socket's buffers full) cuts the connection,
    and so does one that starts waiting after it. A write that does not wait costs a flag."""

    def __init__(self, request: web.Request, deadline: float):
        self.request, self.writing, self.expired, self.cut = request, False, False, False
        self._timer = None if math.isinf(deadline) else asyncio.get_running_loop().call_at(deadline, self._expire)

    def _expire(self) -> None:
        self.expired = True
        if self.writing:
            self._cut()

    def _cut(self) -> None:
        if not self.cut:
            self.cut = True
            logger.warning("client of %s stopped reading its reply: connection closed at the request's deadline "
                           "(--request-timeout-s)", self.request.path)
            transport = self.request.transport
            if transport is not None:
                transport.abort()  # the blocked write returns; the request's legs are aborted as it unwinds

    async def write(self, out: web.StreamResponse, data: bytes) -> bool:
        """``data`` written, or False: the connection was cut at the deadline."""
        if self.cut:
            return False
        self.writing = True
        try:
            if self.expired:  # past the deadline already: the write may wait a moment, no longer
                try:
                    async with asyncio.timeout(WRITE_GRACE_S):
                        await out.write(data)
                except asyncio.TimeoutError:
                    self._cut()
            else:
                await out.write(data)
        finally:
            self.writing = False
        return not self.cut

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


WRITE_GRACE_S = 1.0  # past the request's deadline, how long one write (the error event) may wait


async def sse_reply(request: web.Request, chunks: AsyncIterator) -> web.StreamResponse:
    """Writes an SSE stream of ready-made chunks (str or bytes); a backend failure mid-stream
    becomes an error event and [DONE], as SGLang ends a failed stream. A client that stops
    reading is cut off at the request's deadline (``WriteDeadline``)."""
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await out.prepare(request)
    writes = WriteDeadline(request, current_scope.get().deadline)
    try:
        async for chunk in chunks:
            if not await writes.write(out, chunk.encode() if isinstance(chunk, str) else chunk):
                return out
    except UpstreamError as e:
        err = {"error": {"message": e.detail, "type": "BackendError", "code": e.status_code}}
        if not await writes.write(out, b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n"):
            return out
    finally:
        writes.cancel()
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()
    await out.write_eof()
    return out


async def to_aiohttp(request: web.Request, result) -> web.StreamResponse:
    """A Starlette response (or pydantic model) from SGLang's serving code -> aiohttp."""
    from starlette.responses import StreamingResponse

    if isinstance(result, BaseModel):
        return web.Response(body=result.model_dump_json(by_alias=True).encode(), content_type="application/json")
    if isinstance(result, StreamingResponse):
        if result.status_code != 200:
            chunks = [c async for c in result.body_iterator]
            return web.Response(status=result.status_code, body="".join(
                c.decode() if isinstance(c, bytes) else c for c in chunks).encode())
        return await sse_reply(request, result.body_iterator)
    return web.Response(status=result.status_code, body=result.body,
                        content_type=(result.media_type or "application/json").split(";")[0])


class OpenAIFront:
    def __init__(self, manager, served_model: str, max_n: int = 16):
        from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
        from sglang.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion
        from sglang.srt.parser.template_manager import TemplateManager
        from sglang.srt.runtime_context import get_serving

        self.manager, self.served_model, self.max_n = manager, served_model, max_n
        self.templates = TemplateManager()
        manager.processor = None  # read by TemplateManager (multimodal processors: none here)
        self.templates.initialize_templates(tokenizer_manager=manager, model_path=manager.model_path,
                                            chat_template=get_serving().chat_template,
                                            completion_template=get_serving().completion_template)
        self.chat = OpenAIServingChat(manager, self.templates)
        self.completion = OpenAIServingCompletion(manager, self.templates)
        from sglang.srt.entrypoints.openai.serving_tokenize import OpenAIServingDetokenize, OpenAIServingTokenize

        self.tokenizing = OpenAIServingTokenize(manager, self.templates)
        self.detokenizing = OpenAIServingDetokenize(manager)

    async def handle(self, request: web.Request, kind: str, scope_of: Callable) -> web.StreamResponse:
        from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

        try:
            body = await parse_json_body(await request.read())
            scope = scope_of(request, body.pop("pdd_options", None))
            check_openai_body(body, cap=self.manager.max_new_tokens_cap, max_n=self.max_n,
                              max_prompt_chars=self.manager.max_prompt_chars)
            model = body.get("model")
            # "default" is what SGLang's request models fill in when a client names no model
            if model not in (None, "default", self.served_model):
                return _error(404, f"unknown model {json.dumps(model)[:80]}; this router serves "
                                   f"{json.dumps(self.served_model)}", "NotFoundError", "model")
            model_cls = ChatCompletionRequest if kind == "chat" else CompletionRequest
            try:
                parsed = model_cls.model_validate(body)
            except ValidationError as e:
                raise ApiError(400, _pydantic_message(e)) from None
        except ApiError as e:
            return _error(e.status, e.message)
        current_scope.set(scope)
        serving = self.chat if kind == "chat" else self.completion
        try:
            result = await serving.handle_request(parsed, request)
        except UpstreamError as e:
            reply = _error(e.status_code, e.detail, "ServiceUnavailable" if e.status_code == 503 else "BackendError")
            reply.headers.update(e.headers or {})
            return reply
        return await to_aiohttp(request, result)

    async def tokens(self, request: web.Request, kind: str) -> web.StreamResponse:
        """SGLang's /v1/tokenize (``kind`` "tokenize": a prompt, a list of them, or chat
        messages through the chat template) and /v1/detokenize, by SGLang's own serving classes.
        The router's limits first: a prompt over --max-prompt-chars, a token id outside the
        vocabulary (one server answers that with a 500) are 400s; long work runs off the loop."""
        from sglang.srt.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest

        def validated(body: dict):
            try:
                parsed = (TokenizeRequest if kind == "tokenize" else DetokenizeRequest).model_validate(body)
            except ValidationError as e:
                raise ApiError(400, _pydantic_message(e)) from None
            return parsed, self._check_tokenize(parsed) if kind == "tokenize" else self._check_detokenize(parsed)

        try:
            raw = await request.read()
            if kind == "detokenize":
                check_detokenize_size(raw, *self._detokenize_caps(), self.manager.max_flows_per_request)
            parsed, work = await parse_json_body(raw, validated)
        except ApiError as e:
            return _error(e.status, e.message)
        serving = self.tokenizing if kind == "tokenize" else self.detokenizing
        if work <= INLINE_TEXT_CHARS:
            result = await serving.handle_request(parsed, request)
        else:  # SGLang's handler tokenizes on the calling loop: give it a loop of its own
            result = await asyncio.to_thread(asyncio.run, serving.handle_request(parsed, None))
        return await to_aiohttp(request, result)

    def _check_tokenize(self, parsed) -> int:
        """Characters to tokenize, each prompt (or the conversation) within --max-prompt-chars.
        A list is a batch: at most --max-flows-per-request prompts, whose characters together
        are within --max-prompt-chars too (else one request tokenizes a whole body's worth)."""
        limit = self.manager.max_prompt_chars
        if parsed.messages is not None:
            chars = text_chars(parsed.model_dump(include={"messages", "tools"}))
            check_prompt_chars(chars, "the conversation", limit)
            return chars
        if isinstance(parsed.prompt, str):
            check_prompt_chars(len(parsed.prompt), "the prompt", limit)
            return len(parsed.prompt)
        self._check_list_len(len(parsed.prompt), "prompts")
        for i, prompt in enumerate(parsed.prompt):
            check_prompt_chars(len(prompt), f"prompt[{i}]", limit)
        chars = sum(len(p) for p in parsed.prompt)
        check_prompt_chars(chars, "the list of prompts", limit)
        return chars

    def _check_list_len(self, n: int, what: str) -> None:
        cap = self.manager.max_flows_per_request
        if n > cap:
            raise ApiError(400, f"the request has {n} {what}, more than this router's cap {cap} "
                                f"(--max-flows-per-request)")

    def _detokenize_caps(self) -> tuple[int, int]:
        """(ids per row, ids in all) /v1/detokenize takes: a row at most the longest sequence
        this router serves (a prompt and its output), all rows at most two such."""
        per_row = self.manager.max_prompt_tokens + self.manager.max_new_tokens_cap
        return per_row, 2 * per_row

    def _check_detokenize(self, parsed) -> int:
        """Token ids to decode, each in the vocabulary, within _detokenize_caps; a list of
        lists holds at most --max-flows-per-request rows."""
        vocab = self.manager.vocab_size
        tokens = parsed.tokens
        rows = tokens if tokens and isinstance(tokens[0], list) else [tokens]
        if rows is tokens:
            self._check_list_len(len(tokens), "rows of tokens")
        check_detokenize_ids(rows, *self._detokenize_caps())
        if rows is tokens:
            for i, row in enumerate(tokens):
                check_token_ids(row, f"tokens[{i}]", vocab, allow_empty=True)
            return sum(len(row) for row in tokens)
        check_token_ids(tokens, "tokens", vocab, allow_empty=True)
        return len(tokens)

    async def models(self) -> web.Response:
        from sglang.srt.entrypoints.openai.protocol import ModelCard, ModelList

        card = ModelCard(id=self.served_model, root=self.served_model,
                         max_model_len=self.manager.model_config.context_len)
        return web.Response(body=ModelList(data=[card]).model_dump_json().encode(), content_type="application/json")

    def model_info(self) -> dict:
        """The fields of SGLang's /model_info for this router's model."""
        mc, m = self.manager.model_config, self.manager
        from sglang.srt.runtime_context import get_serving

        return {"model_path": m.model_path, "served_model_name": self.served_model,
                "tokenizer_path": get_serving().tokenizer_path, "is_generation": True,
                "preferred_sampling_params": get_serving().preferred_sampling_params,
                "weight_version": m.config_value("weight_version"), "load_format": m.config_value("load_format"),
                "reasoning_parser": m.config_value("reasoning_parser"),
                "tool_call_parser": m.config_value("tool_call_parser"), "disaggregation_mode": "null",
                "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": getattr(mc.hf_config, "model_type", None),
                "architectures": getattr(mc.hf_config, "architectures", None)}
