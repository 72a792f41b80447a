"""The router is a drop-in SGLang endpoint: the same requests to the router (real P + RLD + MD
behind an emulated WAN) and to one plain SGLang server give the same answers (greedy), through
SGLang's native /generate, the `openai` client, and SGLang's own benchmark client."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from tests.support.pdd_requests import route_once_p_has_destination
from tests.support.waiting import wait_until

from sglang_pdd.control.auth import ROLE_P
from sglang_pdd.launcher.http import get_json, post_json, stream_events

pytestmark = pytest.mark.e2e

MAX_NEW = 16
PROMPTS = ["def fibonacci(n):", "The quick brown fox jumps over the lazy dog. " * 3]


def greedy(**extra) -> dict:
    return {"temperature": 0, "max_new_tokens": MAX_NEW, **extra}


def sse_events(url: str, body: dict) -> list[dict]:
    return list(stream_events(url, body))


def same_output(router: dict, single: dict) -> None:
    assert router["output_ids"] == single["output_ids"]
    assert router["text"] == single["text"]
    assert router["meta_info"]["finish_reason"] == single["meta_info"]["finish_reason"]
    for key in ("prompt_tokens", "completion_tokens"):
        assert router["meta_info"][key] == single["meta_info"][key], key


@pytest.fixture(scope="module")
def urls(pdd_cluster, single_server):
    return pdd_cluster.topology.router_url, single_server


def both(urls, path: str, body: dict):
    router, single = urls
    return post_json(f"{router}{path}", body), post_json(f"{single}{path}", body)


def test_generate_batch_and_n(urls):
    got, want = both(urls, "/generate", {"text": PROMPTS, "sampling_params": greedy()})
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        same_output(g, w)
    got, want = both(urls, "/generate", {"text": PROMPTS[0], "sampling_params": greedy(n=2)})
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        same_output(g, w)


def test_generate_stop_strings_and_stop_trim(urls):
    _, single = urls
    plain = post_json(f"{single}/generate", {"text": PROMPTS[1], "sampling_params": greedy()})
    stop = plain["text"][len(plain["text"]) // 2:][:3]  # a stop string the output reaches mid-way
    for extra in ({"stop": [stop]}, {"stop": [stop], "no_stop_trim": True}):
        got, want = both(urls, "/generate", {"text": PROMPTS[1], "sampling_params": greedy(**extra)})
        same_output(got, want)
        assert want["meta_info"]["finish_reason"]["type"] == "stop"


def test_generate_stream_final_event_equals_single_server(urls):
    router, single = urls
    body = {"text": PROMPTS[0], "stream": True, "sampling_params": greedy()}
    got, want = sse_events(f"{router}/generate", body), sse_events(f"{single}/generate", body)
    same_output(got[-1], want[-1])
    assert all(got[-1]["output_ids"][:len(e["output_ids"])] == e["output_ids"] for e in got)  # cumulative
    assert all(got[-1]["text"].startswith(e["text"]) for e in got)
    batch = {"text": PROMPTS, "stream": True, "sampling_params": greedy()}
    got, want = sse_events(f"{router}/generate", batch), sse_events(f"{single}/generate", batch)
    for index in (0, 1):
        same_output([e for e in got if e["index"] == index][-1], [e for e in want if e["index"] == index][-1])


def test_generate_logprobs(urls):
    body = {"text": PROMPTS[0], "sampling_params": greedy(), "return_logprob": True, "top_logprobs_num": 2,
            "return_text_in_logprobs": True}
    got, want = both(urls, "/generate", body)
    same_output(got, want)
    g, w = got["meta_info"]["output_token_logprobs"], want["meta_info"]["output_token_logprobs"]
    assert [x[1:] for x in g] == [x[1:] for x in w]  # token ids and their texts
    assert all(abs(a[0] - b[0]) < 1e-3 for a, b in zip(g, w))


def test_openai_completions(urls):
    import openai

    clients = [openai.OpenAI(base_url=f"{u}/v1", api_key="none") for u in urls]
    model = clients[1].models.list().data[0].id
    assert [m.id for m in clients[0].models.list().data] == [model]
    kwargs = dict(model=model, prompt=PROMPTS[0], max_tokens=MAX_NEW, temperature=0, stop=["\n\n\n"],
                  frequency_penalty=0.3, seed=7)
    got, want = (c.completions.create(**kwargs) for c in clients)
    assert got.choices[0].text == want.choices[0].text
    assert got.choices[0].finish_reason == want.choices[0].finish_reason
    assert got.usage.completion_tokens == want.usage.completion_tokens
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    streams = [list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
               for c in clients]
    texts = ["".join(ch.choices[0].text for ch in s if ch.choices) for s in streams]
    assert texts[0] == texts[1] == want.choices[0].text
    assert streams[0][-1].usage.completion_tokens == streams[1][-1].usage.completion_tokens


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.mark.parametrize("extra", [
    {},
    {"tools": TOOLS, "tool_choice": "auto"},
    {"tools": TOOLS, "tool_choice": "required"},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}},
], ids=["plain", "tools-auto", "tools-required", "json-schema"])
def test_openai_chat(urls, extra):
    import openai

    clients = [openai.OpenAI(base_url=f"{u}/v1", api_key="none") for u in urls]
    model = clients[1].models.list().data[0].id
    kwargs = dict(model=model, messages=[{"role": "user", "content": "Weather in Paris?"}],
                  max_tokens=48 if extra else MAX_NEW, temperature=0, **extra)
    got, want = (c.chat.completions.create(**kwargs) for c in clients)
    g, w = got.choices[0], want.choices[0]
    assert g.message.content == w.message.content
    assert g.finish_reason == w.finish_reason
    assert [(t.function.name, t.function.arguments) for t in g.message.tool_calls or []] == \
           [(t.function.name, t.function.arguments) for t in w.message.tool_calls or []]
    assert got.usage.completion_tokens == want.usage.completion_tokens
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    if not extra.get("tools"):
        streams = [list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
                   for c in clients]
        texts = ["".join(ch.choices[0].delta.content or "" for ch in s if ch.choices) for s in streams]
        assert texts[0] == texts[1]
        assert streams[0][-1].usage.total_tokens == streams[1][-1].usage.total_tokens


def _status(url: str, method: str = "GET", body: dict | None = None) -> tuple[int, dict | str]:
    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            raw = resp.read()
            code = resp.status
    except urllib.error.HTTPError as e:
        raw, code = e.read(), e.code
    try:
        return code, json.loads(raw)
    except ValueError:
        return code, raw.decode()


def test_other_endpoints_answer_like_sglang(urls, pdd_cluster):
    router, single = urls
    for path in ("/health", "/health_generate", "/ready"):
        assert _status(f"{router}{path}")[0] == _status(f"{single}{path}")[0] == 200
    assert _status(f"{router}/ready")[1] == _status(f"{single}/ready")[1] == ""  # SGLang's: no body
    got, want = get_json(f"{router}/get_model_info"), get_json(f"{single}/get_model_info")
    for key in ("model_path", "is_generation", "tool_call_parser", "architectures", "weight_version"):
        assert got[key] == want[key], key
    assert "internal_states" in get_json(f"{router}/get_server_info")
    for body in ({"prompt": PROMPTS[0]}, {"prompt": PROMPTS, "add_special_tokens": False},
                 {"messages": [{"role": "user", "content": "Weather in Paris?"}]}):
        got, want = both(urls, "/v1/tokenize", body)
        assert got == want and got["count"], body
    ids = want["tokens"]
    for body in ({"tokens": ids}, {"tokens": [ids, ids[:3]], "skip_special_tokens": False}):
        got, want = both(urls, "/v1/detokenize", body)
        assert got == want, body
    # right after the traffic above (tests run with --every-client-is-operator): the router's
    # flush reaches P, RLD and MD, and every one of them flushes
    code, flushed = _status(f"{router}/flush_cache", "POST")
    assert code == 200 and flushed["flushed"] is True, flushed
    assert sorted(flushed["backends"]) == sorted({pdd_cluster.topology.prefill.url, pdd_cluster.topology.relay.url,
                                                  pdd_cluster.topology.main.url})
    assert _status(f"{router}/abort_request", "POST", {"rid": "nobody"})[0] == 200


def test_an_idle_md_flushes_right_after_requests_that_ended_on_rld(pdd_cluster):
    """Requests that end on RLD while their KV still crosses the WAN leave MD a room each,
    kept so the KV enters the cache for the session's next turn. Nothing runs any more: MD's
    own /flush_cache drops those rooms (the flush empties the cache they would fill), waits
    for the receiver to let go of their pages, and flushes.

    Both conditions are made, not left to timing: the KV is held on the WAN (a stall) until
    the flush is done, so it cannot land first however long the requests take on a loaded
    machine, and each request ends only once P has its WAN destination
    (route_once_p_has_destination), since one that ends before leaves MD nothing to keep."""
    topo, key = pdd_cluster.topology, pdd_cluster.control_key
    stats_url = f"{topo.main.control_url}/pdd/stats"
    before = get_json(stats_url, key=key)
    pdd_cluster.wan_control("stall", seconds=300)
    try:
        for i in range(2):
            out = route_once_p_has_destination(pdd_cluster, {
                "input_ids": list(range(100 + i, 200 + i)), "sampling_params": {"temperature": 0, "max_new_tokens": 2},
                "pdd_options": {"path": "p_rld_md"}})
            pdd = out["meta_info"]["pdd"]
            assert pdd["md_tokens"] == 0 and pdd["md_registration"] == "concurrent", pdd  # ended on RLD
        held = get_json(stats_url, key=key)
        assert held.get("rooms_kept_in_flight", 0) - before.get("rooms_kept_in_flight", 0) == 2, held
        assert held["rooms_by_phase"].get("landing_kept", 0) >= 2 and held["held_kv_slots"] > 0, held
        code, text = _status(f"{topo.main.url}/flush_cache", "POST")
        assert code == 200, text
        after = get_json(stats_url, key=key)
        assert after["open_rooms"] == 0 and after["held_kv_slots"] == 0, after
        with urllib.request.urlopen(f"{topo.main.url}/health_generate", timeout=60) as resp:
            assert resp.status == 200  # MD generates on
    finally:
        pdd_cluster.wan_control("heal")
    # Before the next test: P ends the dropped rooms' transfers (MD answers their first frames
    # with the reason), and what they had queued on the emulated link drains.
    p_stats = f"{topo.prefill.control_url}/pdd/stats"
    assert wait_until(lambda: get_json(p_stats, key=key, role=ROLE_P)["live_rooms"] == 0, 30), \
        get_json(p_stats, key=key, role=ROLE_P)
    assert wait_until(lambda: _wan_bytes_settled(pdd_cluster), 30)


def _wan_bytes_settled(cluster, quiet_s: float = 0.5) -> bool:
    import time

    before = cluster.wan_control("stats")["bytes_up"]
    time.sleep(quiet_s)
    return cluster.wan_control("stats")["bytes_up"] == before


@pytest.mark.parametrize("backend", ["sglang", "sglang-oai", "sglang-oai-chat"])
def test_sglang_benchmark_client_runs_clean(urls, backend, pdd_cluster, tmp_path):
    router, _ = urls
    out = tmp_path / "bench.jsonl"
    cmd = [sys.executable, "-m", "sglang.benchmark.serving", "--backend", backend, "--base-url", router,
           "--model", pdd_cluster.model_path, "--tokenizer", pdd_cluster.model_path,
           "--dataset-name", "random-ids", "--num-prompts", "4", "--random-input-len", "32",
           "--random-output-len", "8", "--random-range-ratio", "1.0", "--max-concurrency", "2",
           "--output-file", str(out), "--disable-tqdm"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text().splitlines()[-1])
    assert result["completed"] == 4, result
