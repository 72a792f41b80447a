"""MD's control API relays a handoff to MD's own /generate; a continuation whose reader (the
router) went away is aborted on MD, not decoded on for nobody. The router's own abort by rid can
reach MD before MD's front end passes the request on, and SGLang ignores a second abort of a rid."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from tests.support.control_fakes import KEY, MdControl
from tests.support.waiting import wait_until

from sglang_pdd.control.auth import ControlSigner
from sglang_pdd.protocol import HandoffRequest, RegisterRequest
from sglang_pdd.router.backends.clients import MainControl


def handoff_events(md: MdControl, room: int, rid: str, read: int) -> list[dict]:
    """A streamed handoff through the router's client, left after ``read`` events (0: all)."""
    async def run():
        async with aiohttp.ClientSession() as session:
            mc = MainControl(session, md.url, signer=ControlSigner(KEY))
            got = []
            stream = mc.handoff_stream(room, HandoffRequest([8], rid))
            async for event in stream:
                got.append(event)
                if len(got) == read:
                    break
            await stream.aclose()
            return got

    return asyncio.run(run())


def ready_room(md: MdControl, room: int) -> None:
    md.runtime.register(RegisterRequest(room, [5, 6, 7]))
    md.runtime.mark_ready(room)


def test_a_continuation_whose_reader_went_away_is_aborted_on_md():
    md = MdControl()
    try:
        md.generate.endless = True
        ready_room(md, 3)
        assert len(handoff_events(md, 3, "leg-m", read=2)) == 2
        assert wait_until(lambda: md.runtime.counters.get("handoffs_abandoned") == 1, 5), md.runtime.counters
        assert md.generate.aborted == ["leg-m"]
    finally:
        md.close()


@pytest.mark.parametrize("linger_s", [0.0, 1.0])
def test_a_continuation_read_to_its_end_is_not_aborted(linger_s):
    """Also when the router hangs up after the stream's end while MD has not closed its side
    yet (``linger_s``): the request is done, not abandoned."""
    md = MdControl()
    try:
        md.generate.linger_after_done_s = linger_s
        ready_room(md, 4)
        assert handoff_events(md, 4, "leg-m", read=0)[-1]["output_ids"] == [7, 8]
        time.sleep(linger_s)  # the relay's end, after MD closes
        assert md.generate.aborted == [] and "handoffs_abandoned" not in md.runtime.counters
    finally:
        md.close()


def test_a_reader_that_goes_before_the_first_event_gets_the_continuation_aborted_at_once():
    """The router's request ended (on RLD) right after it handed off: MD's control relay sees
    the hang-up while waiting for MD's first event and aborts the continuation before MD
    produces anything, not one or two decode steps later (MD would meanwhile run a request
    for nobody, and refuse a cache flush)."""
    md = MdControl()
    try:
        md.generate.endless, md.generate.first_event_delay_s = True, 10.0
        ready_room(md, 5)

        async def run():
            async with aiohttp.ClientSession() as session:
                mc = MainControl(session, md.url, signer=ControlSigner(KEY))
                reading = asyncio.ensure_future(mc.handoff_stream(5, HandoffRequest([8], "leg-m")).__anext__())
                while not md.generate.requests:  # MD runs the continuation
                    await asyncio.sleep(0.01)
                reading.cancel()  # the router goes; its connection closes
                await asyncio.gather(reading, return_exceptions=True)

        asyncio.run(run())
        assert wait_until(lambda: md.generate.aborted == ["leg-m"], 9), md.generate.aborted
        assert md.generate.events_before_abort == [0]
        assert wait_until(lambda: md.runtime.counters.get("handoffs_abandoned") == 1, 5)
    finally:
        md.generate.abort_arrived.set()
        md.close()
