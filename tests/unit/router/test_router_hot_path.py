"""The router's per-event code paths give what their plain versions gave."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from sglang_pdd.router.backends.clients import SSE_DONE, BackendError, parse_sse_line
from sglang_pdd.router.flow.fallback import Fallback, Reason, Recovery
from sglang_pdd.router.flow.pdd_flow import FlowResult
from sglang_pdd.router.front.serving import Aborted, _until, result_dict


@pytest.mark.parametrize("line", [
    b'data: {"output_ids": [1, 2, 3], "meta_info": {"finish_reason": null, "x": 0.1}}\n',
    b'data: {"meta_info": {"output_token_logprobs": [[NaN, 5, null], [-Infinity, 6, null]]}}\n',
    b'data: {"text": "caf\\u00e9 \\ud83d\\ude00", "big": 123456}\n',
])
def test_sse_events_parse_as_json_reads_them(line):
    import json

    event = parse_sse_line(line, "rld")
    assert json.dumps(event) == json.dumps(json.loads(line[5:]))


def test_sse_done_other_lines_and_errors():
    assert parse_sse_line(b"data: [DONE]\n", "rld") is SSE_DONE
    assert parse_sse_line(b": keep-alive\n", "rld") is None
    with pytest.raises(BackendError, match="malformed"):
        parse_sse_line(b"data: {nope\n", "rld")
    with pytest.raises(BackendError, match="boom"):
        parse_sse_line(b'data: {"error": "boom"}\n', "rld")


def test_result_dict_is_asdict():
    r = FlowResult(rid="x", path="p_rld_md", catch_up_batches=[4, 2],
                   fallbacks=[Fallback(Reason.WAN_FAILED, "slow"), Fallback.recovered(Recovery.WAN_FAILED_AFTER_RLD)],
                   finish_reason={"type": "stop", "matched": 7}, ttft_s=0.5, wan_bytes=10)
    d = result_dict(r)
    # a fallback as clients see it: its text
    assert d["fallbacks"] == ["wan_failed: slow", "recovered_on_relay: wan_failed_after_rld"]
    assert d == {**dataclasses.asdict(r), "fallbacks": d["fallbacks"]} and list(d) == list(dataclasses.asdict(r))
    d["catch_up_batches"].append(1)
    d["finish_reason"]["type"] = "x"
    assert r.catch_up_batches == [4, 2] and r.finish_reason["type"] == "stop"  # copies, as asdict's


async def _ticks(n: int, gate: asyncio.Event = None):
    for i in range(n):
        if gate is not None and i == 2:
            await gate.wait()
        yield [i]


def test_until_passes_every_event_then_ends():
    async def main():
        return [x async for x in _until(_ticks(5), asyncio.Event())]

    assert asyncio.run(main()) == [[0], [1], [2], [3], [4]]


def test_until_abort_cancels_the_pending_step():
    async def main():
        abort, gate, got = asyncio.Event(), asyncio.Event(), []
        closed = asyncio.Event()

        async def source():
            try:
                async for x in _ticks(5, gate):
                    yield x
            finally:
                closed.set()

        async def consume():
            async for x in _until(source(), abort):
                got.append(x)
                if len(got) == 2:
                    asyncio.get_running_loop().call_soon(abort.set)

        with pytest.raises(Aborted):
            await asyncio.wait_for(consume(), 5)
        return got, closed.is_set()

    got, closed = asyncio.run(main())
    assert got == [[0], [1]] and closed


def test_until_outer_cancel_is_a_cancel_not_an_abort():
    async def main():
        abort, gate = asyncio.Event(), asyncio.Event()

        async def consume():
            async for _ in _until(_ticks(5, gate), abort):
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.05)
        abort.set()  # both at once: the task's own cancel wins
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
