"""End-to-end: a relay leg whose server stops progressing ends within the router's stall
deadline, with every token the server sent once, and the stopped server's request freed.

A server is stopped with SGLang's own ``/pause_generation`` (in place: it keeps its requests and
connections, decodes nothing), as a frozen VM or a wedged scheduler would look to the router.
The request runs through ``PddFlow`` in this process on the cluster's real P and RLD, with
deadlines of a few seconds (the router's flags are --relay-stall-timeout-s and
--relay-first-token-timeout-s). Without the guard the request waited for --request-timeout-s.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

import aiohttp
import pytest

from sglang_pdd.launcher.http import get_json, post_json
from tests.support.pdd_requests import paused
from tests.support.waiting import wait_until

pytestmark = pytest.mark.e2e

STALL_S = 3.0
# The deadline plus a decode step or two, the check's timer and the cleanup's aborts, on a
# loaded 2-core machine; far below the request's own run time (LONG) and its timeout.
ENDS_WITHIN_S = STALL_S + 7.0
LONG = 3000  # left alone, many seconds of decoding here
IDS = list(range(100, 148))  # a prompt of token ids (no BOS/EOS/PAD), greedy with ignore_eos


def queued(server_url: str) -> int:
    loads = get_json(f"{server_url}/v1/loads?include=core")["loads"]
    return sum(int(load.get("core", load).get("num_running_reqs", 0)) + int(load.get("core", load).get("num_waiting_reqs", 0))
               for load in loads)


def idle(cluster) -> bool:
    topo = cluster.topology
    return queued(topo.prefill.url) == 0 and queued(topo.relay.url) == 0


@pytest.fixture
def cluster(pdd_cluster):
    assert wait_until(lambda: idle(pdd_cluster), 60)
    return pdd_cluster


def stalled_flow(cluster, ids: list[int], pause_url: str, pause_after: int):
    """A P->RLD request of LONG tokens; ``pause_url`` paused once the client has ``pause_after``
    tokens (0: before the request starts). Returns (tokens, error, seconds from the pause to the
    end, the flow's result)."""
    from sglang_pdd.router.backends.servers import PrefillBackend
    from sglang_pdd.router.flow.pdd_flow import FlowConfig, PddFlow
    from sglang_pdd.router.flow.pick import FlowShared, ServerPick
    from sglang_pdd.router.flow.request import FlowRequest
    from sglang_pdd.router.policy import Path

    topo = cluster.topology
    p = topo.prefill
    cfg = dataclasses.replace(FlowConfig(), relay_stall_timeout_s=STALL_S, relay_first_token_timeout_s=STALL_S,
                              request_timeout_s=120.0)

    async def run():
        got, error, paused_at = [], None, None
        stack = contextlib.ExitStack()
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession() as session:
            pick = ServerPick(PrefillBackend(p.url, p.bootstrap_port), topo.relay.url, None, force_path=Path.P_RLD_ONLY)
            req = FlowRequest(ids, {"max_new_tokens": LONG, "temperature": 0, "ignore_eos": True})
            flow = PddFlow(req, pick, cfg, FlowShared(session))
            try:
                if pause_after == 0:
                    await loop.run_in_executor(None, stack.enter_context, paused(pause_url))
                    paused_at = time.monotonic()
                try:
                    async for new in flow.events():
                        got.extend(new)
                        if paused_at is None and len(got) >= pause_after:
                            await loop.run_in_executor(None, stack.enter_context, paused(pause_url))
                            paused_at = time.monotonic()
                except Exception as e:  # noqa: BLE001 - what the client gets is the point
                    error = e
                ended = time.monotonic()
            finally:
                await loop.run_in_executor(None, stack.close)
        return got, error, ended - paused_at, flow.result

    return asyncio.run(run())


def reference(cluster, ids: list[int], n: int) -> list[int]:
    return post_json(f"{cluster.topology.router_url}/generate", {
        "input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
        "pdd_options": {"path": "p_rld_only"}})["output_ids"]


def test_rld_paused_mid_stream_ends_the_request_within_the_deadline(cluster):
    ids = IDS
    got, error, took, result = stalled_flow(cluster, ids, cluster.topology.relay.url, pause_after=8)
    assert error is not None and "stalled" in str(error) and "--relay-stall-timeout-s" in str(error), error
    assert took < ENDS_WITHIN_S, f"the client waited {took:.1f} s after RLD stopped"
    assert 8 <= len(got) < LONG
    assert got == reference(cluster, ids, len(got))  # every token RLD sent, once, in order
    assert ("relay", cluster.topology.relay.url) in result.failed_backends
    assert wait_until(lambda: idle(cluster), 30), "RLD still holds the stalled request"


@pytest.mark.full
def test_p_paused_before_the_first_token_ends_the_request_within_the_deadline(cluster):
    ids = IDS
    got, error, took, result = stalled_flow(cluster, ids, cluster.topology.prefill.url, pause_after=0)
    assert error is not None and "no first token" in str(error), error
    assert got == []
    assert took < ENDS_WITHIN_S, f"the client waited {took:.1f} s for P"
    assert wait_until(lambda: idle(cluster), 30), "P or RLD still holds the stalled request"
