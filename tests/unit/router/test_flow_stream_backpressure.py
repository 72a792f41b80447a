"""A flow that falls behind its backends keeps a bounded number of their stream events.

SGLang streams cumulatively (each event repeats the whole output and its logprobs so far), so
every event a flow keeps unread is as large as the stream so far. While the client does not
read, RLD's and MD's events must stay in their sockets, not pile up parsed in the router: at
most one taken-but-unprocessed event per flow (the output is still every position once)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.support.fake_backends import Fakes, Knobs, fake_logprob, truth, wait_until
from sglang_pdd.handoff.stitcher import Source
from sglang_pdd.router.flow import lifecycle
from sglang_pdd.router.flow.pdd_flow import PddFlow
from sglang_pdd.router.flow.request import FlowRequest
from sglang_pdd.router.flow.pick import FlowShared, ServerPick
from sglang_pdd.router.backends.servers import MainBackend, PrefillBackend
from sglang_pdd.router.policy import Path
from tests.support.flow_scenarios import PROMPT, flow_config, p_md_cfg

pytestmark = pytest.mark.timeout(60)

MAX_NEW = 60
LOGPROBS = {"return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": 0}


def stream_events_queued(flow: PddFlow) -> int:
    return sum(isinstance(event, (lifecycle.RelayTokens, lifecycle.MainTokens)) for event, _ in flow.queue._queue)


async def slow_client(knobs: Knobs, cfg, force_path, stall_when, backend_done) -> tuple[PddFlow, list, int]:
    """Runs a flow whose client stops reading once ``stall_when(flow)`` until the backend it
    waits for has written its whole stream (``backend_done(fakes)``); (flow, output, most
    stream events queued at any time)."""
    fakes = await Fakes(knobs).start()
    session = aiohttp.ClientSession()
    out, most, stalled = [], 0, False
    try:
        pick = ServerPick(PrefillBackend(fakes.p_url, 8998), fakes.rld_url,
                      MainBackend(fakes.md_url, fakes.md_url, "127.0.0.1:1"), force_path=force_path)
        flow = PddFlow(FlowRequest(PROMPT, {"max_new_tokens": MAX_NEW, "temperature": 0.0}, extras=LOGPROBS), pick,
                       cfg, FlowShared(session))
        async for tokens in flow.events():
            out.extend(tokens)
            most = max(most, stream_events_queued(flow))
            if not stalled and stall_when(flow):
                stalled = True
                await wait_until(lambda: backend_done(fakes), timeout_s=10)
                await asyncio.sleep(0.05)  # what the router's legs read meanwhile
                most = max(most, stream_events_queued(flow))
        assert stalled
        return flow, out, most
    finally:
        await session.close()
        await fakes.stop()


CASES = {
    # RLD writes its whole stream while the client reads nothing after the first token
    "rld_only": (lambda: flow_config(), Path.P_RLD_ONLY, lambda flow: True, lambda fakes: fakes.rld_active == 0),
    # MD writes its whole continuation while the client reads nothing after MD's first token
    "p_md": (p_md_cfg, None, lambda flow: flow.stitcher.source is Source.MAIN, lambda fakes: fakes.md_active == 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_client_that_stops_reading_leaves_backend_events_unread_not_queued(case):
    cfg, force_path, stall_when, backend_done = CASES[case]
    knobs = Knobs(rld_token_delay_s=0, md_token_delay_s=0)
    flow, out, most = asyncio.run(slow_client(knobs, cfg(), force_path, stall_when, backend_done))
    assert most <= 1, f"{most} stream events were queued in the flow at once"
    want = truth(PROMPT, MAX_NEW)
    assert out == want
    meta = flow.output_meta
    assert meta["output_token_logprobs"] == [[fake_logprob(PROMPT + want[:i], want[i]), want[i], None]
                                             for i in range(MAX_NEW)]
    assert meta["finish_reason"] == {"type": "length", "length": MAX_NEW}
    if case == "p_md":
        assert flow.result.md_tokens == MAX_NEW - 1 and flow.result.path == "p_md"
