"""The router's HTTP front (SGLang's API) on fake P / RLD / MD backends: no SGLang servers.

The fake model is deterministic (``truth``), so every output is checked against what the
backends must have produced; the serving layer (chat template, usage, stream chunks) is
SGLang's own, running in-process on the router's adapter.
"""

from __future__ import annotations

import json

import pytest

from sglang_pdd.router.front.app import OPERATOR_HEADER
from tests.support.fake_backends import Knobs, truth
from tests.support.router_front import TOKEN, front, run, sse


def test_generate_single_batch_and_n_match_the_model(router_sglang_state):
    tok = router_sglang_state[2]

    async def main():
        async with front(router_sglang_state) as (base, client, fakes, _):
            async with client.post(f"{base}/generate", json={
                    "input_ids": [11, 22, 33], "sampling_params": {"max_new_tokens": 6}}) as r:
                one = await r.json()
            assert one["output_ids"] == truth([11, 22, 33], 6)
            assert one["meta_info"]["completion_tokens"] == 6 and one["meta_info"]["prompt_tokens"] == 3
            assert "pdd" not in one["meta_info"]  # operator-only
            async with client.post(f"{base}/generate", json={
                    "text": ["hello", "world"], "sampling_params": {"max_new_tokens": 4}}) as r:
                batch = await r.json()
            assert [b["output_ids"] for b in batch] == [truth(tok.encode(t), 4) for t in ("hello", "world")]
            async with client.post(f"{base}/generate", json={
                    "text": ["hello", "world"], "sampling_params": {"max_new_tokens": 3, "n": 2}}) as r:
                fanned = await r.json()
            # SGLang's order: item i, sample j at i * n + j
            assert [b["output_ids"] for b in fanned] == [truth(tok.encode(t), 3) for t in ("hello", "hello", "world", "world")]
            # n never reaches a backend (it would fan out there too)
            assert all("n" not in r.body["sampling_params"] for r in fakes.records("rld", "generate"))
    run(main())


def test_generate_stream_is_cumulative_with_indices_and_one_finish(router_sglang_state):
    async def main():
        async with front(router_sglang_state) as (base, client, _, _r):
            async with client.post(f"{base}/generate", json={
                    "input_ids": [[5, 6], [7, 8]], "stream": True, "sampling_params": {"max_new_tokens": 5}}) as r:
                assert r.headers["Content-Type"].startswith("text/event-stream")
                events = await sse(r)
            for index, prompt in enumerate(([5, 6], [7, 8])):
                mine = [e for e in events if e["index"] == index]
                ids = [e["output_ids"] for e in mine]
                assert ids[-1] == truth(prompt, 5)
                assert all(ids[-1][:len(x)] == x for x in ids)  # cumulative
                assert [e["meta_info"]["finish_reason"] is not None for e in mine].count(True) == 1
                assert mine[-1]["meta_info"]["finish_reason"] is not None
    run(main())


@pytest.mark.parametrize("body,field", [
    ({"text": "x", "sampling_params": {"max_new_tokens": "abc"}}, "max_new_tokens"),
    ({"text": "x", "sampling_params": {"max_new_tokens": None}}, "max_new_tokens"),
    ({"text": "x", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"text": "x", "sampling_params": {"max_new_tokens": 10**6}}, "--max-new-tokens-cap"),
    ({"input_ids": [True]}, "input_ids[0]"),
    ({"input_ids": [10**40]}, "input_ids[0]"),
    ({"input_ids": [1, 999999]}, "input_ids[1]"),
    ({"text": "x", "sampling_params": {"custom_params": {"pdd_wan_peer": "10.0.0.1:9"}}}, "pdd_wan_peer"),
    ({"text": "x", "image_data": "http://x/y.png"}, "image_data"),
    ({"text": "x", "no_such_field": 1}, "no_such_field"),
    ({"sampling_params": {}}, "'text' or 'input_ids'"),
    # one server refuses these too (400), a backend leg would fail on them (502)
    ({"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 4}, "logprob_start_len"),
    ({"input_ids": [1, 2], "return_logprob": True, "token_ids_logprob": [10**6]}, "token_ids_logprob"),
    # each multiplies every event's size (router/backends/reply_limits.py): capped by the router
    ({"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": 65}, "--max-top-logprobs-num"),
    ({"input_ids": [1, 2], "return_logprob": True, "token_ids_logprob": list(range(65))}, "--max-token-ids-logprob"),
    # SGLang's own checks, with its words (a leg would fail: 502; or compile nothing: empty 200)
    ({"text": "x", "sampling_params": {"temperature": -1}}, "temperature must be a non-negative finite number"),
    ({"text": "x", "sampling_params": {"top_p": 0}}, "top_p must be in (0, 1]"),
    ({"text": "x", "input_ids": [1, 2]}, "text and input_ids cannot be provided at the same time"),
    ({"text": "x", "sampling_params": {"regex": "("}}, "Failed to compile regex grammar"),
    ({"text": "x", "sampling_params": {"json_schema": "{nope"}}, "Failed to compile json grammar"),
    ({"text": "x", "sampling_params": {"regex": "a", "ebnf": "root ::= \"a\""}}, "Only one of json_schema"),
])
def test_generate_refuses_bad_input_with_400_naming_the_field(router_sglang_state, body, field):
    async def main():
        async with front(router_sglang_state) as (base, client, fakes, _):
            async with client.post(f"{base}/generate", json=body) as r:
                assert r.status == 400, await r.text()
                got = await r.json()
            assert field in got["message"]
            assert "Traceback" not in got["message"] and "object at 0x" not in got["message"]
            assert not fakes.records("rld", "generate")  # nothing reached a backend
    run(main())


def test_malformed_json_oversized_body_and_openai_types(router_sglang_state):
    async def main():
        async with front(router_sglang_state, max_body_bytes=4096) as (base, client, _, _r):
            async with client.post(f"{base}/generate", data=b"{oops") as r:
                assert r.status == 400 and "malformed JSON" in (await r.json())["message"]
            async with client.post(f"{base}/generate", json={"text": "x" * 10_000}) as r:
                assert r.status == 413
            async with client.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": "abc"}) as r:
                assert r.status == 400 and "max_tokens" in (await r.json())["message"]
            async with client.post(f"{base}/v1/chat/completions", json={"messages": "nope"}) as r:
                assert r.status == 400 and "messages" in (await r.json())["message"]
            async with client.post(f"{base}/v1/completions", json={"model": "gpt-9", "prompt": "hi"}) as r:
                assert r.status == 404 and "unknown model" in (await r.json())["message"]
            for model in ("default", "tiny"):  # SGLang's default name and the served one
                async with client.post(f"{base}/v1/completions", json={"model": model, "prompt": "hi",
                                                                       "max_tokens": 2}) as r:
                    assert r.status == 200, await r.text()
    run(main())


def test_pdd_options_and_pdd_meta_are_operator_only(router_sglang_state):
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3}, "pdd_options": {"path": "p_rld_only"}}

    async def main():
        async with front(router_sglang_state) as (base, client, fakes, _):
            async with client.post(f"{base}/generate", json=body) as r:
                assert r.status == 403 and OPERATOR_HEADER in (await r.json())["message"]
            async with client.post(f"{base}/generate", json=body, headers={OPERATOR_HEADER: "wrong"}) as r:
                assert r.status == 403
            async with client.post(f"{base}/generate", json=body, headers={OPERATOR_HEADER: TOKEN}) as r:
                got = await r.json()
            assert got["meta_info"]["pdd"]["path"] == "p_rld_only"
            assert got["output_ids"] == truth([1, 2, 3], 3)
            async with client.post(f"{base}/flush_cache") as r:
                assert r.status == 403
    run(main())


def test_client_rid_stays_at_the_front_and_duplicates_in_flight_are_refused(router_sglang_state):
    async def main():
        async with front(router_sglang_state, Knobs(rld_token_delay_s=0.05)) as (base, client, fakes, _):
            body = {"input_ids": [4, 5], "rid": "victim-1", "stream": True, "sampling_params": {"max_new_tokens": 20}}
            async with client.post(f"{base}/generate", json=body) as first:
                await first.content.readline()  # the first request is in flight
                async with client.post(f"{base}/generate", json={**body, "stream": False}) as dup:
                    assert dup.status == 400 and "already in flight" in (await dup.json())["message"]
                events = await sse(first)
            assert events[-1]["meta_info"]["id"] == "victim-1"
            backend_rids = [r.body["rid"] for r in fakes.records("rld", "generate")]
            assert backend_rids and not any("victim" in rid for rid in backend_rids)
    run(main())


def test_abort_request_ends_a_stream_with_abort(router_sglang_state):
    async def main():
        async with front(router_sglang_state, Knobs(rld_token_delay_s=0.05)) as (base, client, fakes, router):
            body = {"input_ids": [4, 5], "rid": "mine", "stream": True, "sampling_params": {"max_new_tokens": 60}}
            async with client.post(f"{base}/generate", json=body) as r:
                await r.content.readline()
                async with client.post(f"{base}/abort_request", json={"rid": "mine"}) as a:
                    assert (await a.json())["aborted"] == 1
                events = await sse(r)
            assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
            assert len(events[-1]["output_ids"]) < 60
            assert router.manager.inflight == {}
            async with client.post(f"{base}/abort_request", json={"abort_all": True}) as a:
                assert a.status == 403
    run(main())


def test_openai_chat_and_completions_through_sglang_serving(router_sglang_state):
    import openai

    tok = router_sglang_state[2]

    async def main():
        async with front(router_sglang_state) as (base, _, fakes, _r):
            client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none")
            models = await client.models.list()
            assert [m.id for m in models.data] == ["tiny"]
            comp = await client.completions.create(model="tiny", prompt="hello", max_tokens=5, temperature=0,
                                                   frequency_penalty=0.5, stop=["zzz"], seed=3)
            assert comp.usage.completion_tokens == 5 and comp.usage.prompt_tokens == len(tok.encode("hello"))
            sp = fakes.records("rld", "generate")[-1].body["sampling_params"]
            assert sp["frequency_penalty"] == 0.5 and sp["stop"] == ["zzz"] and sp["max_new_tokens"] == 5
            schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
            chat = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
            assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 4
            sp = fakes.records("rld", "generate")[-1].body["sampling_params"]
            assert json.loads(sp["json_schema"]) == schema  # SGLang's conversion, passed to the legs
            prompt_ids = fakes.records("rld", "generate")[-1].body["input_ids"]
            assert "<|im_start|>user\nhi<|im_end|>" in tok.decode(prompt_ids)  # SGLang's chatml template
            stream = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
                stream_options={"include_usage": True})
            chunks = [c async for c in stream]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == chat.choices[0].message.content
            assert chunks[-1].usage.completion_tokens == 4
            await client.close()
    run(main())


def test_generate_logprobs_with_text_in_sglang_format(router_sglang_state):
    from tests.support.fake_backends import fake_logprob

    tok = router_sglang_state[2]
    prompt = [11, 22, 33]

    async def main():
        async with front(router_sglang_state) as (base, client, _, _r):
            async with client.post(f"{base}/generate", json={
                    "input_ids": prompt, "return_logprob": True, "return_text_in_logprobs": True,
                    "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 6}}) as r:
                got = await r.json()
            want_ids = truth(prompt, 6)
            rows = got["meta_info"]["output_token_logprobs"]
            assert [row[1] for row in rows] == want_ids
            assert [row[2] for row in rows] == [tok.decode([t]) for t in want_ids]
            seq = prompt + want_ids
            assert rows[0][0] == pytest.approx(fake_logprob(seq[:3], want_ids[0]))
            # the prompt's (P's reply), first entry without a logprob, text per token as SGLang
            assert got["meta_info"]["input_token_logprobs"] == [
                [fake_logprob(prompt[:j], t) if j else None, t, tok.decode([t])] for j, t in enumerate(prompt)]
            async with client.post(f"{base}/generate", json={  # top logprobs asked, none given: no 500
                    "input_ids": prompt, "return_logprob": True, "return_text_in_logprobs": True,
                    "top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 3}}) as r:
                assert r.status == 200, await r.text()
                assert [row[1] for row in (await r.json())["meta_info"]["output_token_logprobs"]] == want_ids[:3]
    run(main())


def test_openai_streams_with_logprobs_and_echo_carry_the_prompts_logprobs_first(router_sglang_state):
    """SGLang's streaming OpenAI classes read ``output_token_logprobs_length`` and take the
    prompt's logprobs (echo) from the first chunk only."""
    from tests.support.fake_backends import fake_logprob

    tok = router_sglang_state[2]
    prompt = tok.encode("hello there")
    out = truth(prompt, 4)
    seq = prompt + out
    want = [None] + [pytest.approx(fake_logprob(seq[:j], seq[j])) for j in range(1, len(seq))]

    async def main():
        async with front(router_sglang_state) as (base, client, _, _r):
            async with client.post(f"{base}/v1/completions", json={
                    "prompt": "hello there", "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 1,
                    "stream": True}) as r:
                assert r.status == 200, await r.text()
                chunks = [c for c in await sse(r) if c.get("choices")]
            first = chunks[0]["choices"][0]["logprobs"]["token_logprobs"]
            assert len(first) > len(prompt)  # the prompt's and the first output token's
            got = [lp for c in chunks for lp in (c["choices"][0]["logprobs"] or {}).get("token_logprobs", [])]
            assert got == want
            async with client.post(f"{base}/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": True,
                    "top_logprobs": 1, "stream": True}) as r:
                assert r.status == 200, await r.text()
                chunks = [c for c in await sse(r) if c.get("choices") and c["choices"][0].get("logprobs")]
            # (SGLang's chat stream drops a token whose text is still empty with its logprob: <= 4)
            assert 0 < sum(len(c["choices"][0]["logprobs"]["content"]) for c in chunks) <= 4
    run(main())


def test_streaming_request_refused_before_the_stream_starts(router_sglang_state):
    async def main():
        async with front(router_sglang_state) as (base, client, fakes, _):
            async with client.post(f"{base}/generate", json={
                    "input_ids": [5] * 1001, "stream": True, "sampling_params": {"max_new_tokens": 2}}) as r:
                assert r.status == 400 and "--max-prompt-tokens" in (await r.json())["message"]
            assert not fakes.records("rld", "generate")
    run(main())


def test_chat_without_max_tokens_decodes_up_to_the_cap(router_sglang_state):
    async def main():
        async with front(router_sglang_state) as (base, client, fakes, _):
            async with client.post(f"{base}/v1/chat/completions",
                                   json={"messages": [{"role": "user", "content": "hi"}]}) as r:
                assert r.status == 200, await r.text()
                got = await r.json()
            assert got["usage"]["completion_tokens"] == 64  # the test router's --max-new-tokens-cap
            assert fakes.records("rld", "generate")[0].body["sampling_params"]["max_new_tokens"] == 64
    run(main())


def test_deeply_nested_json_is_a_400_on_every_endpoint(router_sglang_state):
    deep = b"[" * 1000 + b"]" * 1000  # past Python's recursion limit
    bodies = {"/generate": b'{"text": %s}', "/v1/completions": b'{"prompt": %s}',
              "/v1/chat/completions": b'{"messages": %s}'}

    async def main():
        async with front(router_sglang_state) as (base, client, fakes, _):
            for path, body in bodies.items():
                for nested in (deep, b"[" * 100 + b"]" * 100):  # parses, but deeper than the cap
                    async with client.post(f"{base}{path}", data=body % nested) as r:
                        assert r.status == 400, (path, await r.text())
                        assert "nested deeper than" in (await r.json())["message"]
            assert not fakes.records("rld", "generate")
    run(main())


def test_max_n_holds_on_every_endpoint(router_sglang_state):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    async def main():
        async with front(router_sglang_state, max_n=2) as (base, client, fakes, _):
            for path, body in (("/generate", {"text": "hi", "sampling_params": {"n": 3, "max_new_tokens": 2}}),
                               ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": 3}),
                               ("/v1/chat/completions", {**chat, "n": 3})):
                async with client.post(f"{base}{path}", json=body) as r:
                    assert r.status == 400, (path, await r.text())
                    assert "--max-n" in (await r.json())["message"]
            assert not fakes.records("rld", "generate")
            async with client.post(f"{base}/v1/chat/completions", json={**chat, "n": 2}) as r:
                assert r.status == 200, await r.text()
                assert len((await r.json())["choices"]) == 2
    run(main())


def test_flows_per_request_and_grammar_size_are_capped(router_sglang_state):
    schema = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(100)}}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    async def main():
        async with front(router_sglang_state, max_flows_per_request=4, max_grammar_bytes=1024) as (
                base, client, fakes, _):
            for path, body in (
                    ("/generate", {"text": ["a", "b", "c"], "sampling_params": {"n": 2, "max_new_tokens": 2}}),
                    ("/generate", {"input_ids": [[1]] * 5, "sampling_params": {"max_new_tokens": 2}}),
                    ("/v1/completions", {"prompt": ["a", "b", "c"], "max_tokens": 2, "n": 2})):
                async with client.post(f"{base}{path}", json=body) as r:
                    assert r.status == 400, (path, await r.text())
                    assert "--max-flows-per-request" in (await r.json())["message"]
            for path, body in (
                    ("/generate", {"text": "a", "sampling_params": {"regex": "a" * 1025}}),
                    ("/v1/chat/completions", {**chat, "response_format": {
                        "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})):
                async with client.post(f"{base}{path}", json=body) as r:
                    assert r.status == 400, (path, await r.text())
                    assert "--max-grammar-bytes" in (await r.json())["message"]
            assert not fakes.records("rld", "generate")
            async with client.post(f"{base}/generate", json={
                    "text": ["a", "b"], "sampling_params": {"n": 2, "max_new_tokens": 2, "regex": "a+"}}) as r:
                assert r.status == 200, await r.text()
                assert len(await r.json()) == 4
    run(main())


def test_long_prompts_are_refused_before_tokenizing_and_tokenized_off_the_loop(router_sglang_state, monkeypatch):
    import threading

    tok = router_sglang_state[2]
    calls = []
    encode = tok.encode

    def spy(text, *a, **kw):
        calls.append((len(text), threading.current_thread() is threading.main_thread()))
        return encode(text, *a, **kw)

    monkeypatch.setattr(tok, "encode", spy)
    long = "a" * 16_001  # the test router: --max-prompt-tokens 1000, 16 characters a token

    async def main():
        async with front(router_sglang_state) as (base, client, fakes, router):
            assert router.manager.max_prompt_chars == 16_000
            for path, body in (("/generate", {"text": long}), ("/v1/completions", {"prompt": long}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": long}]})):
                async with client.post(f"{base}{path}", json=body) as r:
                    assert r.status == 400, (path, await r.text())
                    assert "--max-prompt-chars" in (await r.json())["message"]
            assert not [c for c in calls if c[0] > 16_000]  # never tokenized
            from sglang_pdd.router.front.serving import INLINE_TEXT_CHARS

            tokenized = "a" * (INLINE_TEXT_CHARS + 1)  # under the character cap: tokenized, then too many tokens
            async with client.post(f"{base}/generate", json={"text": tokenized}) as r:
                assert r.status == 400 and "--max-prompt-tokens" in (await r.json())["message"]
            async with client.post(f"{base}/generate",
                                   json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}) as r:
                assert r.status == 200, await r.text()
            assert (len(tokenized), False) in calls  # in a worker thread, not the event loop's
            assert (len("hi"), True) in calls  # a short one inline: a thread hop would cost more
    run(main())


def test_openai_sampling_checked_as_one_server_before_any_leg(router_sglang_state):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    async def main():
        async with front(router_sglang_state) as (base, client, fakes, _):
            for path, body, words in (
                    ("/v1/chat/completions", {**chat, "temperature": -1}, "temperature must be a non-negative"),
                    ("/v1/chat/completions", {**chat, "stream": True, "temperature": -1}, "temperature must be"),
                    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "regex": "("},
                     "Failed to compile regex grammar")):
                async with client.post(f"{base}{path}", json=body) as r:
                    assert r.status == 400, (path, await r.text())
                    assert words in (await r.json())["message"]
            assert not fakes.records("rld", "generate")
    run(main())


def test_operator_token_file_must_be_private(tmp_path):
    import os

    from sglang_pdd.router.front.cli import read_operator_token

    path = tmp_path / "operator-token"
    path.write_text(TOKEN + "\n")
    os.chmod(path, 0o644)
    with pytest.raises(SystemExit, match="mode 0644"):
        read_operator_token(str(path))
    os.chmod(path, 0o600)
    assert read_operator_token(str(path)) == TOKEN


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_a_client_that_stops_reading_ends_at_the_request_timeout(router_sglang_state, path):
    """A streaming client that stops reading (its socket's buffers full) held its request past
    --request-timeout-s: the router's write waited on it, so the flow never reached its own
    deadline, its legs ran on and its in-flight counts stayed (steering path choice, blocking
    /flush_cache). Now the write waits no longer than the request's deadline: the request
    ends, its legs are aborted and its counts released."""
    import asyncio
    import dataclasses
    import socket
    from urllib.parse import urlsplit

    from sglang_pdd.router.front.app import Router, build_app
    from sglang_pdd.router.backends.servers import PrefillBackend
    from sglang_pdd.router.backends.pools import Pools
    from tests.support.fake_backends import Fakes, serve_app, wait_until
    from tests.support.flow_scenarios import PROMPT, flow_config

    from aiohttp import web

    body = ({"input_ids": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}
            if path == "/generate" else
            {"prompt": PROMPT, "stream": True, "max_tokens": 1000, "ignore_eos": True})
    data = json.dumps(body).encode()

    @web.middleware
    async def small_send_buffer(request, handler):  # the kernel then buffers a few KiB, not MiBs
        request.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        return await handler(request)

    async def main():
        fakes = await Fakes(Knobs(rld_token_delay_s=0.0)).start()
        pools = Pools([PrefillBackend(fakes.p_url, 8998)], [fakes.rld_url], [])
        cfg = dataclasses.replace(flow_config(), request_timeout_s=1.5)
        router = Router(pools, cfg, None, max_prompt_tokens=1000, served_model="tiny", sglang_state=router_sglang_state,
                        max_new_tokens_cap=1000)
        app = build_app(router)
        app.middlewares.insert(0, small_send_buffer)
        loop = asyncio.get_running_loop()
        try:
            async with serve_app(app) as base:
                u = urlsplit(base)
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                s.setblocking(False)
                await loop.sock_connect(s, (u.hostname, u.port))
                await loop.sock_sendall(s, b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                        b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(data), data))
                try:  # the client reads nothing from here on
                    await wait_until(lambda: router.running_requests() == 1, timeout_s=5)
                    t0 = loop.time()
                    await wait_until(lambda: router.running_requests() == 0, timeout_s=8)
                    assert loop.time() - t0 < 4
                    await wait_until(lambda: fakes.rld_active == 0, timeout_s=5)
                    assert fakes.records("rld", "abort")  # its leg aborted, not left to run out
                finally:
                    s.close()
        finally:
            await fakes.stop()
    run(main())


@pytest.mark.parametrize("leg", ["prefill", "relay", "main"])
def test_a_leg_failing_unforeseen_answers_the_client_and_frees_its_counts(router_sglang_state, monkeypatch, leg):
    """A leg task that raises what no handler foresaw (here a RuntimeError from the backend
    client) fails that leg through the lifecycle: the client gets its answer (an error, or the
    whole output where RLD can finish after MD's leg broke) and every in-flight count is 0
    again, instead of a request left waiting for --request-timeout-s while its count steers
    placement."""
    from sglang_pdd.router.backends import clients as backends
    from sglang_pdd.router.flow import pdd_flow as flow_module
    def broken_after(real, events: int):
        async def gen(*args, **kwargs):
            n = 0
            async for event in real(*args, **kwargs):
                if n == events:
                    raise RuntimeError("unforeseen")
                n += 1
                yield event
        return gen

    if leg == "prefill":
        async def broken_once(*args, **kwargs):
            raise RuntimeError("unforeseen")
        monkeypatch.setattr(flow_module, "generate_once", broken_once)
    elif leg == "relay":
        monkeypatch.setattr(flow_module, "generate_stream", broken_after(flow_module.generate_stream, 2))
    else:
        monkeypatch.setattr(backends.MainControl, "handoff_stream",
                            broken_after(backends.MainControl.handoff_stream, 1))

    async def main():
        # RLD's leg owns the stream while MD's KV has not landed: its failure is the request's
        knobs = Knobs(rld_token_delay_s=0.01, md_ready="never" if leg == "relay" else "ready")
        async with front(router_sglang_state, knobs) as (base, client, fakes, router):
            body = {"input_ids": [11, 22, 33], "sampling_params": {"max_new_tokens": 24}, "stream": True}
            async with client.post(f"{base}/generate", json=body) as r:
                # before the first byte a failure is the reply's status; after it, the last event
                answer = await sse(r) if r.status == 200 else [await r.json()]
            if leg == "main":  # MD broke after the handoff: a recovery leg on RLD finishes it
                assert r.status == 200
                assert answer[-1]["output_ids"] == truth([11, 22, 33], 24)
                assert answer[-1]["meta_info"]["finish_reason"]["type"] == "length"
            else:
                assert r.status in (200, 502) and "RuntimeError: unforeseen" in json.dumps(answer[-1]), answer[-1]
            pools = router.pools
            assert pools.inflight() == {"prefill": {fakes.p_url: 0}, "relay": {fakes.rld_url: 0},
                                        "main": {fakes.md_url: 0}}
            assert fakes.rld_active == 0 and fakes.md_active == 0
    run(main())


def test_ready_answers_as_one_sglang_server(router_sglang_state):
    """SGLang's /ready: 200 with no body while requests are taken, else 503."""
    op = {OPERATOR_HEADER: TOKEN}

    async def main():
        async with front(router_sglang_state) as (base, client, fakes, _):
            async with client.get(f"{base}/ready") as r:
                assert r.status == 200 and await r.read() == b""
            async with client.post(f"{base}/pdd/backends/drain", json={"url": fakes.rld_url}, headers=op) as r:
                assert r.status == 200
            async with client.get(f"{base}/ready") as r:
                assert r.status == 503  # no RLD may be picked: nothing can be served
            async with client.post(f"{base}/pdd/backends/drain", json={"url": fakes.rld_url, "draining": False},
                                   headers=op) as r:
                assert r.status == 200
            async with client.get(f"{base}/ready") as r:
                assert r.status == 200
    run(main())


def test_tokenize_and_detokenize_answer_as_sglangs_serving_classes(router_sglang_state):
    """One server's shapes: {"tokens", "count", "max_model_len"} and {"text"}; chat messages
    through the chat template give the ids a chat completion sends to the legs."""
    tok, model_config = router_sglang_state[2], router_sglang_state[1]
    messages = [{"role": "user", "content": "Weather in Paris?"}]

    async def main():
        async with front(router_sglang_state) as (base, client, fakes, _):
            for path in ("/v1/tokenize", "/tokenize"):
                async with client.post(f"{base}{path}", json={"prompt": "hello world"}) as r:
                    got = await r.json()
                assert r.status == 200 and got == {"tokens": tok.encode("hello world"), "count": len(got["tokens"]),
                                                   "max_model_len": model_config.context_len}
            async with client.post(f"{base}/v1/tokenize", json={"prompt": ["a b", "c"], "add_special_tokens": False}) as r:
                got = await r.json()
            assert got["tokens"] == [tok.encode("a b", add_special_tokens=False), tok.encode("c", add_special_tokens=False)]
            assert got["count"] == [len(t) for t in got["tokens"]]
            async with client.post(f"{base}/v1/tokenize", json={"messages": messages}) as r:
                chat_ids = (await r.json())["tokens"]
            async with client.post(f"{base}/v1/chat/completions", json={"messages": messages, "max_tokens": 2}) as r:
                assert (await r.json())["usage"]["prompt_tokens"] == len(chat_ids)
            assert fakes.records("p", "generate")[-1].body["input_ids"] == chat_ids
            ids = tok.encode("hello world")
            for path in ("/v1/detokenize", "/detokenize"):
                async with client.post(f"{base}{path}", json={"tokens": ids}) as r:
                    assert r.status == 200 and await r.json() == {"text": tok.decode(ids, skip_special_tokens=True)}
            async with client.post(f"{base}/v1/detokenize", json={"tokens": [ids, ids[:1], []]}) as r:
                assert (await r.json())["text"] == [tok.decode(ids), tok.decode(ids[:1]), ""]
            async with client.post(f"{base}/v1/detokenize", json={"tokens": []}) as r:
                assert await r.json() == {"text": ""}
    run(main())


@pytest.mark.parametrize("path,body,words", [
    ("/v1/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "Exactly one of"),
    ("/v1/tokenize", {}, "Exactly one of"),
    ("/v1/tokenize", {"prompt": 7}, "prompt"),
    ("/v1/tokenize", {"prompt": ["ok", "a" * 16_001]}, "prompt[1] has 16001 characters"),
    ("/v1/detokenize", {"tokens": "abc"}, "tokens"),
    ("/v1/detokenize", {}, "tokens"),
    # one server decodes an id past the vocabulary to nothing and answers a negative or huge one
    # with a 500 (the tokenizer's overflow): the router refuses them all with a 400, as on /generate
    ("/v1/detokenize", {"tokens": [1, 10**6]}, "tokens[1] must be an integer token id"),
    ("/v1/detokenize", {"tokens": [[1], [-1]]}, "tokens[1][0] must be an integer token id"),
])
def test_tokenize_and_detokenize_refuse_bad_input_with_400(router_sglang_state, path, body, words):
    async def main():
        async with front(router_sglang_state) as (base, client, _, _r):
            async with client.post(f"{base}{path}", json=body) as r:
                got = await r.json()
            assert r.status == 400 and words in got["message"], got
            assert got["object"] == "error" and got["code"] == 400
    run(main())


def test_a_tokenize_list_is_capped_in_count_and_characters_before_tokenizing(router_sglang_state, monkeypatch):
    """/v1/tokenize capped each prompt of a list but not the list: a 4 MiB body of prompts each
    under --max-prompt-chars took 1.16 s of tokenizing (4 at once 16.5 s). A list now holds at
    most --max-flows-per-request prompts (as /generate's batch), whose characters together are
    within --max-prompt-chars: 400 naming the flag, nothing tokenized; /v1/detokenize's list of
    lists holds at most as many rows."""
    tok = router_sglang_state[2]
    calls, encode = [], tok.encode

    def spy(text, *a, **kw):
        calls.append(len(text))
        return encode(text, *a, **kw)

    monkeypatch.setattr(tok, "encode", spy)

    async def main():
        async with front(router_sglang_state) as (base, client, _, router):
            assert router.manager.max_flows_per_request == 64 and router.manager.max_prompt_chars == 16_000
            calls.clear()  # the front's own start
            for body, words in (({"prompt": ["a"] * 65}, "65 prompts, more than this router's cap 64 "
                                                          "(--max-flows-per-request)"),
                                ({"prompt": ["a" * 9_000, "b" * 9_000]}, "the list of prompts has 18000 characters")):
                async with client.post(f"{base}/v1/tokenize", json=body) as r:
                    got = await r.json()
                assert r.status == 400 and words in got["message"], got
            assert calls == []  # nothing tokenized
            async with client.post(f"{base}/v1/tokenize", json={"prompt": ["a b"] * 64}) as r:
                assert r.status == 200 and len((await r.json())["tokens"]) == 64
            async with client.post(f"{base}/v1/detokenize", json={"tokens": [[1]] * 65}) as r:
                got = await r.json()
            assert r.status == 400 and "--max-flows-per-request" in got["message"], got
    run(main())


def test_detokenize_caps_ids_per_row_and_in_total_before_decoding(router_sglang_state, monkeypatch):
    """/v1/detokenize capped rows (64) but not ids: 1.9 M ids took 2.58 s of the router's loop
    (4 at once 15.6 s, /ready stalled 7 s). A row now holds at most the longest sequence the
    router serves (--max-prompt-tokens + max new tokens), all rows twice that; a body whose
    commas alone exceed that is refused before it is parsed. 400s, nothing decoded."""
    tok = router_sglang_state[2]
    decoded, decode = [], tok.decode
    monkeypatch.setattr(tok, "decode", lambda ids, *a, **kw: decoded.append(len(ids)) or decode(ids, *a, **kw))

    async def main():
        async with front(router_sglang_state, max_body_bytes=4 << 20) as (base, client, _, router):
            per_row = router.manager.max_prompt_tokens + router.manager.max_new_tokens_cap
            decoded.clear()
            review = b'{"tokens":[' + b"1," * 1_899_999 + b"1]}"  # 3.8 MB: within the default --max-body-bytes
            for body, words in (({"tokens": [1] * (per_row + 1)}, f"tokens[0] has {per_row + 1} ids, more than {per_row}"),
                                ({"tokens": [[1] * per_row] * 2 + [[1] * 10]},
                                 f"{2 * per_row + 10} token ids, more than {2 * per_row} in all"),
                                (review, f"at most {2 * per_row} in all")):
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                async with client.post(f"{base}/v1/detokenize", data=data,
                                       headers={"Content-Type": "application/json"}) as r:
                    got = await r.json()
                assert r.status == 400 and words in got["message"], got["message"][:300]
            assert decoded == []
            async with client.post(f"{base}/v1/detokenize", json={"tokens": [[1] * per_row] * 2}) as r:
                assert r.status == 200 and len((await r.json())["text"]) == 2
    run(main())


def test_a_body_over_a_mebibyte_is_parsed_off_the_loop(router_sglang_state, monkeypatch):
    import threading

    from sglang_pdd.router.front import validate
    threads, parse = [], validate.parse_json_object

    def spy(raw):
        threads.append((len(raw), threading.current_thread() is threading.main_thread()))
        return parse(raw)

    monkeypatch.setattr(validate, "parse_json_object", spy)

    async def main():
        async with front(router_sglang_state, max_body_bytes=4 << 20) as (base, client, _, _r):
            for path, field in (("/generate", "text"), ("/v1/completions", "prompt"), ("/v1/tokenize", "prompt")):
                threads.clear()
                body = {field: "a" * (1 << 20)}
                async with client.post(f"{base}{path}", json=body) as r:
                    assert r.status == 400  # over --max-prompt-chars, once parsed
                assert threads and all(size > validate.INLINE_PARSE_BYTES and not on_loop for size, on_loop in threads), \
                    (path, threads)
    run(main())


def test_long_text_is_tokenized_off_the_loop(router_sglang_state, monkeypatch):
    import threading

    from sglang_pdd.router.front.serving import INLINE_TEXT_CHARS

    tok = router_sglang_state[2]
    calls, encode = [], tok.encode

    def spy(text, *a, **kw):
        calls.append((len(text), threading.current_thread() is threading.main_thread()))
        return encode(text, *a, **kw)

    monkeypatch.setattr(tok, "encode", spy)
    long = "ab " * (INLINE_TEXT_CHARS // 3 + 1)

    async def main():
        async with front(router_sglang_state) as (base, client, _, _r):
            async with client.post(f"{base}/v1/tokenize", json={"prompt": long}) as r:
                assert (await r.json())["tokens"] == encode(long)
            async with client.post(f"{base}/v1/tokenize", json={"prompt": "hi"}) as r:
                assert r.status == 200
    run(main())
    assert (len(long), False) in calls and (2, True) in calls


def test_flush_cache_reaches_every_backend_and_answers_as_sglang(router_sglang_state):
    op = {OPERATOR_HEADER: TOKEN}

    async def main():
        async with front(router_sglang_state) as (base, client, fakes, _):
            for method in ("POST", "GET"):  # SGLang serves both
                async with client.request(method, f"{base}/flush_cache", headers=op) as r:
                    got = await r.json()
                assert r.status == 200 and got["flushed"] is True and got["refused"] == {}
                assert got["backends"] == {fakes.p_url: 200, fakes.rld_url: 200, fakes.md_url: 200}
            # backends get time to end the legs the router aborted (SGLang's deferred flush)
            assert {r.body["timeout"] for r in fakes.log if r.kind == "flush"} == {"5"}
            async with client.post(f"{base}/flush_cache?timeout=-1", headers=op) as r:
                assert r.status == 400 and "timeout" in (await r.json())["message"]
            async with client.post(f"{base}/flush_cache?timeout=nan", headers=op) as r:
                assert r.status == 400
    run(main())


def test_flush_cache_is_refused_while_the_router_runs_requests_or_waits_for_them(router_sglang_state):
    op = {OPERATOR_HEADER: TOKEN}

    async def main():
        async with front(router_sglang_state, Knobs(rld_token_delay_s=0.05)) as (base, client, fakes, _):
            body = {"input_ids": [4, 5], "stream": True, "sampling_params": {"max_new_tokens": 20}}
            async with client.post(f"{base}/generate", json=body) as stream:
                await stream.content.readline()  # in flight
                async with client.post(f"{base}/flush_cache", headers=op) as r:
                    got = await r.json()
                assert r.status == 400 and "the router runs 1 request" in got["message"]
                assert not [rec for rec in fakes.log if rec.kind == "flush"]  # nothing reached a backend
                async with client.post(f"{base}/flush_cache?timeout=30", headers=op) as r:
                    got = await r.json()  # waits for the request to end, then flushes
                assert r.status == 200 and got["flushed"] is True
                events = await sse(stream)
            assert len(events[-1]["output_ids"]) == 20  # the request ran to its end untouched
    run(main())


def test_flush_cache_names_the_backend_that_refused_and_why_md_did(router_sglang_state):
    op = {OPERATOR_HEADER: TOKEN}
    stats = {"open_rooms": 2, "rooms_by_phase": {"ready": 1, "landing": 1}, "held_kv_slots": 80}

    async def main():
        knobs = Knobs(flush_status={"md": 400}, md_stats=stats)
        async with front(router_sglang_state, knobs) as (base, client, fakes, _):
            async with client.post(f"{base}/flush_cache", headers=op) as r:
                got = await r.json()
            assert r.status == 400 and got["flushed"] is False
            assert got["backends"] == {fakes.p_url: 200, fakes.rld_url: 200, fakes.md_url: 400}
            assert got["refused"] == {fakes.md_url: "main: Flush cache failed. [MD has 2 PDD rooms open "
                                                     "(landing 1, ready 1), 80 KV slots held for the WAN]"}
            assert fakes.md_url in got["message"]
            knobs.flush_status = {"rld": 500}
            async with client.post(f"{base}/flush_cache", headers=op) as r:
                assert r.status == 503 and list((await r.json())["refused"]) == [fakes.rld_url]
    run(main())


def test_flush_cache_with_a_backend_down_is_503(router_sglang_state):
    from tests.support.fake_backends import closed_port

    async def main():
        async with front(router_sglang_state) as (base, client, fakes, router):
            router.pools.relay.append(f"http://127.0.0.1:{closed_port()}")
            router.pools.rld_inflight[router.pools.relay[-1]] = 0
            async with client.post(f"{base}/flush_cache", headers={OPERATOR_HEADER: TOKEN}) as r:
                got = await r.json()
            assert r.status == 503 and "no answer" in got["refused"][router.pools.relay[-1]]
    run(main())
