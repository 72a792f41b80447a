"""backends.until_stalled, the deadline on MD's handoff stream: a cancel of the reading leg is
never lost, even when it meets an event that just arrived.

Python 3.11's asyncio.wait_for returns the inner result when the outer task is cancelled in
the same loop iteration as that result arrives, dropping the cancel: the flow's cleanup
cancelled MD's leg as RLD finished the request, the leg went on reading MD's stream, blocked
on the flow's stream slot that nobody would free, and the cleanup waited on it until the
client gave up (a request whose every token had been produced, held to its timeout)."""

import asyncio

import pytest

from sglang_pdd.router.backends.clients import until_stalled


async def _leg_cancelled_as_an_event_arrives(first_s):
    gate, got = asyncio.Event(), []

    async def md_stream():
        await gate.wait()
        yield {"output_ids": [1, 2]}
        await asyncio.sleep(3600)

    async def leg():
        async for event in until_stalled(md_stream(), 10.0, "MD", first_s=first_s, first_past=1):
            got.append(event)
            await asyncio.sleep(3600)  # the leg going on after its cancel

    task = asyncio.ensure_future(leg())
    await asyncio.sleep(0.01)  # the leg waits for MD's next event
    gate.set()
    await asyncio.sleep(0)  # the event arrives: MD's stream yields it in this iteration...
    task.cancel()  # ...and the cleanup cancels the leg in the same one
    await asyncio.wait([task], timeout=2)
    still_running = not task.done()
    task.cancel()
    return still_running, task, got


@pytest.mark.parametrize("first_s", [None, 3.0])
def test_a_cancel_meeting_an_event_cancels_the_leg(first_s):
    still_running, task, got = asyncio.run(_leg_cancelled_as_an_event_arrives(first_s))
    assert not still_running, f"the leg went on after its cancel, with {got}"
    assert task.cancelled()


def test_no_token_within_the_deadline_is_a_timeout_and_closes_the_stream():
    closed = []

    async def silent():
        try:
            yield {"output_ids": [1]}
            await asyncio.sleep(3600)
        finally:
            closed.append(True)

    async def read():
        return [e async for e in until_stalled(silent(), 0.05, "MD")]

    with pytest.raises(asyncio.TimeoutError, match="no new token within"):
        asyncio.run(read())
    assert closed == [True]


def test_bytes_without_a_token_are_no_progress():
    async def trickle():
        yield {"output_ids": [1]}
        for _ in range(100):
            await asyncio.sleep(0.01)
            yield {"output_ids": [1]}  # a keep-alive: the same output again

    async def read():
        return [e async for e in until_stalled(trickle(), 0.2, "MD")]

    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(read())
