"""Differential end to end (issue 10, item 5): the same greedy /generate requests to the PDD
router and to one plain SGLang server must give the same output_ids, text and finish reason,
whatever the path (P->MD, P->RLD->MD one-shot and catch-up, P->RLD only), streaming or not,
with a handoff mid-stream and after a WAN partition (recovery on RLD), for every sampling
parameter that keeps state across the cut: stop strings, stop_token_ids, regex, json_schema,
penalties, min_new_tokens; and logprobs (PddFlow's ``output_meta``, stitched from RLD and MD)
equal within 1e-3. Penalties included: RLD and MD count penalized tokens on one server's clock
(sglang_glue/penalty_clock.py), so a handoff at any position changes nothing.

Handoffs mid-stream: the test WAN is slow (conftest: 0.5 Mbit/s) and each P->RLD->MD request
starts with the link stalled for a moment, so RLD has streamed eager tokens when MD's KV lands;
P->MD always hands off after RLD's first token. Needs MD to continue requests (the resume
contract, sglang_glue/resume.py).
"""

from __future__ import annotations

import asyncio
import json
import os

import aiohttp
import pytest

from sglang_pdd.launcher.http import post_json, stream_events

pytestmark = pytest.mark.e2e

MAX_NEW = 40
LOGPROB_TOL = 1e-3
STALL_S = 0.6  # the WAN holds MD's KV back this long: RLD streams eager tokens meanwhile

PROMPTS = [
    "import collections\n\nclass LRUCache:\n    def __init__(self, capacity):",
    "The history of the printing press begins",
]

# CI runs one prompt and streams on the two handoff-free/one-shot paths (the whole matrix takes
# ~45 min on a 2-core machine where four idle SGLang schedulers already fill both cores);
# PDD_E2E_FULL=1 runs every prompt and every (path, stream) pair.
FULL = bool(os.environ.get("PDD_E2E_FULL"))
DIFF_PROMPTS = PROMPTS if FULL else PROMPTS[1:]  # PROMPTS[1]: the recovery test's prompt

PATHS = {
    "p_md": {"path": "p_md"},
    "one_shot": {"path": "p_rld_md", "handoff_mode": "one_shot"},
    "catch_up": {"path": "p_rld_md", "handoff_mode": "catch_up", "catch_up_threshold": 2},
    "rld_only": {"path": "p_rld_only"},
}

# Greedy equality holds up to numerical ties: where the reference's best two tokens are within
# TIE_GAP in logprob, one bf16 rounding elsewhere (MD extends eager tokens in passes where one
# server decoded them one by one; other batch shapes) can pick the runner-up. Measured: the only
# differences in a full-matrix run were at positions where the reference's gap was 0.002 and
# the router took the runner-up; the penalty-clock bug (fixed) showed at gaps of 0.13-0.25.
# After such a swap the outputs are not comparable; the prefix before it must be equal.
TIE_GAP = 0.01
TIES: list[str] = []  # every swap accepted, for the report and the "ties are rare" checks

JSON_SCHEMA = json.dumps({"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}}, "required": ["name", "age"]})


def first_new_token(ids: list[int], at_least: int) -> tuple[int, int]:
    """(position, id) of the first token at or after ``at_least`` not seen before it."""
    for j in range(at_least, len(ids)):
        if ids[j] not in ids[:j]:
            return j, ids[j]
    raise AssertionError(f"no new token after {at_least} in {ids}")


def cases(plain: dict) -> dict[str, dict]:
    """Sampling params per case, chosen on the plain reference output so each one bites after
    the first few tokens (i.e. on MD's side of a handoff)."""
    text, ids = plain["text"], plain["output_ids"]
    at = int(len(text) * 0.6)
    _, late_id = first_new_token(ids, MAX_NEW // 2)
    _, early_id = first_new_token(ids, 2)
    return {
        "plain": {},
        "stop_string": {"stop": [text[at:at + 4]]},
        "stop_token_ids": {"stop_token_ids": [late_id]},
        "min_new_tokens": {"stop_token_ids": [early_id], "min_new_tokens": MAX_NEW // 2},
        "regex": {"regex": r"(yes|no), because [a-z ]{4,60}\."},
        "json_schema": {"json_schema": JSON_SCHEMA},
        "freq_presence": {"frequency_penalty": 0.8, "presence_penalty": 0.6},
        "repetition": {"repetition_penalty": 1.4},
    }


def body(prompt: str, sampling: dict, **extra) -> dict:
    return {"text": prompt, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, **sampling}, **extra}


@pytest.fixture(scope="module")
def references(single_server):
    """prompt -> case -> the single server's answer (with its top-2 logprobs: tie_swap)."""
    out = {}
    for prompt in DIFF_PROMPTS:
        plain = post_json(f"{single_server}/generate", body(prompt, {}))
        out[prompt] = {name: (sampling, post_json(f"{single_server}/generate",
                                                  body(prompt, sampling, return_logprob=True, top_logprobs_num=2)))
                       for name, sampling in cases(plain).items()}
    return out


def stream_final(url: str, payload: dict) -> dict:
    """The last event of a cumulative SGLang stream (checked to be cumulative on the way)."""
    events = list(stream_events(f"{url}/generate", {**payload, "stream": True}))
    assert events and "error" not in events[-1], events[-1:]
    for shorter, longer in zip(events, events[1:]):
        assert longer["output_ids"][:len(shorter["output_ids"])] == shorter["output_ids"]
    return events[-1]


def route(cluster, prompt: str, sampling: dict, options: dict, stream: bool) -> dict:
    if options.get("path") == "p_rld_md":
        cluster.wan_control("stall", seconds=STALL_S)
    payload = body(prompt, sampling, pdd_options=options)
    if stream:
        return stream_final(cluster.topology.router_url, payload)
    return post_json(f"{cluster.topology.router_url}/generate", payload)


def tie_swap(got_ids: list[int], want: dict):
    """The position of a numerical-tie swap that explains ``got_ids != want``, else None: equal up
    to position i, the reference's top two there within TIE_GAP, and the router took the runner-up."""
    ref = want["output_ids"]
    i = next((j for j, (a, b) in enumerate(zip(got_ids, ref)) if a != b), None)
    top = want["meta_info"].get("output_top_logprobs") or []
    if i is None or i >= len(top) or len(top[i]) < 2:
        return None
    (best, _, _), (second, second_id, _) = top[i][:2]
    return i if best - second <= TIE_GAP and got_ids[i] == second_id else None


def differences(got: dict, want: dict, where: str) -> list[str]:
    """What differs between the router's answer and the single server's (empty: equal, or equal
    up to a numerical tie, recorded in TIES)."""
    out = []
    if got["output_ids"] != want["output_ids"]:
        tie = tie_swap(got["output_ids"], want)
        if tie is not None:
            TIES.append(f"{where}: tie swap at position {tie}")
            return []
        out.append(f"{where}: output_ids {got['output_ids']} != {want['output_ids']} "
                   f"(pdd {got['meta_info'].get('pdd')})")
    for key in ("finish_reason", "completion_tokens"):
        if got["meta_info"][key] != want["meta_info"][key]:
            out.append(f"{where}: {key} {got['meta_info'][key]} != {want['meta_info'][key]}")
    return out


# A fallback on the path asked for is a bug (MD refused, failed, streamed wrong), except MD's KV
# not landing within the router's --wan-timeout-s (6 s in these tests) on this loaded 2-core
# machine: measured once, on the first p_md request after the cluster started. The request is
# then finished on a relay leg (output still compared); such timeouts are reported and must stay
# rare, like ties.
LATE_WAN = "wan_failed: not ready within"
LATE: list[str] = []


def path_problems(pdd: dict, where: str) -> list[str]:
    """Fallbacks that are not a late WAN (recorded in LATE); empty if the path held."""
    fallbacks = pdd["fallbacks"]
    if not fallbacks:
        return []
    if fallbacks[0].startswith(LATE_WAN) and all(f.startswith(("recovered_on_relay", LATE_WAN)) for f in fallbacks):
        LATE.append(f"{where}: {fallbacks}")
        return []
    return [f"{where}: fell back: {fallbacks}"]


def assert_ties_rare(ties_before: int, compared: int) -> None:
    """A tie excuses one comparison; if they were common the suite would test little."""
    new = TIES[ties_before:]
    print("\n".join(new))
    assert len(new) * 4 <= compared, new


def assert_same(got: dict, want: dict, where: str) -> None:
    diff = differences(got, want, where)
    assert not diff, diff


@pytest.mark.parametrize("path,stream", [
    pytest.param(path, stream, id=f"{path}-{'stream' if stream else 'once'}")
    for stream in (False, True) for path in PATHS
    if FULL or not stream or path in ("p_md", "one_shot")])
def test_router_equals_single_server(pdd_cluster, references, path, stream):
    handoffs, bad, ties_before, compared = [], [], len(TIES), 0
    late_before = len(LATE)
    for prompt in DIFF_PROMPTS:
        for name in references[prompt]:
            sampling, want = references[prompt][name]
            got = route(pdd_cluster, prompt, sampling, PATHS[path], stream)
            pdd = got["meta_info"]["pdd"]
            bad += differences(got, want, f"{path}/{name}/{prompt[:20]!r}")
            bad += path_problems(pdd, f"{path}/{name}/{prompt[:20]!r}")
            compared += 1
            if pdd["handoff_at"] is not None:
                handoffs.append(pdd["handoff_at"])
    assert not bad, "\n".join(bad)
    assert_ties_rare(ties_before, compared)
    print("\n".join(LATE[late_before:]))
    assert len(LATE[late_before:]) * 4 <= compared, LATE[late_before:]
    if path == "rld_only":
        assert not handoffs
    elif path == "p_md":
        assert handoffs and set(handoffs) == {1}
    else:  # mid-stream: MD took over after RLD had streamed several tokens
        assert any(h > 1 for h in handoffs), handoffs


@pytest.mark.parametrize("path", ["p_md", "one_shot"])
def test_router_text_equals_single_server(pdd_cluster, references, path):
    """text, incl. stop strings trimmed as SGLang trims them (the router's detokenization)."""
    bad, ties_before, compared = [], len(TIES), 0
    for prompt in DIFF_PROMPTS:
        for name in references[prompt]:
            sampling, want = references[prompt][name]
            got = route(pdd_cluster, prompt, sampling, PATHS[path], stream=False)
            compared += 1
            if got["output_ids"] != want["output_ids"]:
                bad += differences(got, want, f"{path}/{name}")  # a tie swap: the texts are not comparable
            elif got["text"] != want["text"]:
                bad.append(f"{path}/{name}: {got['text']!r} != {want['text']!r}")
    assert not bad, "\n".join(bad)
    assert_ties_rare(ties_before, compared)


def test_recovery_after_wan_partition_equals_single_server(pdd_cluster, references):
    """The WAN is down: P->MD recovers on a new relay leg after RLD's first token (a replay,
    for greedy requests), P->RLD->MD ends on RLD; outputs as on one server."""
    pdd_cluster.wan_control("partition")
    try:
        for name in ("plain", "stop_token_ids", "json_schema", "freq_presence", "min_new_tokens"):
            sampling, want = references[PROMPTS[1]][name]
            for options in (PATHS["p_md"], PATHS["one_shot"]):
                payload = body(PROMPTS[1], sampling, pdd_options=options)
                got = post_json(f"{pdd_cluster.topology.router_url}/generate", payload)
                pdd = got["meta_info"]["pdd"]
                assert_same(got, want, f"partition/{options['path']}/{name}")
                assert pdd["md_tokens"] == 0
                if options["path"] == "p_md" and want["meta_info"]["completion_tokens"] > 1:
                    assert any(f.startswith("recovered_on_relay") for f in pdd["fallbacks"]), pdd
    finally:
        pdd_cluster.wan_control("heal")


# ------------------------------------------------------------------ logprobs (PddFlow.output_meta)
def flow_output(cluster, prompt_ids: list[int], sampling: dict, extras: dict, path: str) -> tuple[list[int], dict]:
    """One request through PddFlow in this process, on the cluster's real P / RLD / MD."""
    from sglang_pdd.handoff.policy import HandoffConfig, HandoffMode
    from sglang_pdd.router.backends import use_control_key
    from sglang_pdd.router.flow import FlowConfig, MainBackend, PddFlow, PrefillBackend
    from sglang_pdd.router.policy import Path

    use_control_key(cluster.control_key)  # as the router's --control-key-file: MD and P need signed calls

    topo = cluster.topology
    p, m = topo.prefill, topo.main

    async def run():
        async with aiohttp.ClientSession() as session:
            cfg = FlowConfig(handoff=HandoffConfig(fixed_mode=HandoffMode.ONE_SHOT), wan_timeout_s=6.0)
            flow = PddFlow(session, cfg, PrefillBackend(p.url, p.bootstrap_port, control_url=p.control_url),
                           topo.relay.url, MainBackend(m.url, m.control_url, f"127.0.0.1:{topo.wan.listen_port}"),
                           prompt_ids, {"max_new_tokens": MAX_NEW, "temperature": 0, **sampling},
                           force_path=Path(path), extras=extras)
            ids = []
            async for new in flow.events():
                ids += new
            return ids, flow.output_meta, flow.result

    if path == "p_rld_md":
        cluster.wan_control("stall", seconds=STALL_S)
    return asyncio.run(run())


def assert_logprobs_close(got: list, want: list, where: str) -> None:
    assert len(got) == len(want), where
    for i, (g, w) in enumerate(zip(got, want)):
        assert g is not None, (where, i)
        assert g[1] == w[1] and abs(g[0] - w[0]) <= LOGPROB_TOL, (where, i, g, w)


@pytest.mark.parametrize("path", ["p_md", "p_rld_md"])
def test_flow_logprobs_equal_single_server(pdd_cluster, single_server, path):
    extras = {"return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": 0}
    handoffs = []
    for prompt in DIFF_PROMPTS:
        want = post_json(f"{single_server}/generate", body(prompt, {}, return_logprob=True, top_logprobs_num=3,
                                                           logprob_start_len=0))
        # the prompt as the server tokenized it (BOS included): its input logprobs name each id
        prompt_ids = [t for _, t, _ in want["meta_info"]["input_token_logprobs"]]
        ids, meta, result = flow_output(pdd_cluster, prompt_ids, {}, extras, path)
        assert ids == want["output_ids"], result
        assert meta["finish_reason"] == want["meta_info"]["finish_reason"]
        assert meta["completion_tokens"] == len(ids) and meta["prompt_tokens"] == len(prompt_ids)
        assert_logprobs_close(meta["output_token_logprobs"], want["meta_info"]["output_token_logprobs"], path)
        for g, w in zip(meta["output_top_logprobs"], want["meta_info"]["output_top_logprobs"]):
            assert_logprobs_close(g, w, f"{path} top")
        # the prompt's: P's reply (first entry None, as SGLang's)
        assert meta["input_token_logprobs"][0] == want["meta_info"]["input_token_logprobs"][0]
        assert_logprobs_close(meta["input_token_logprobs"][1:], want["meta_info"]["input_token_logprobs"][1:],
                              f"{path} input")
        if result.handoff_at is not None:
            handoffs.append(result.handoff_at)
    assert handoffs, "no handoff: MD's logprobs were never spliced"
