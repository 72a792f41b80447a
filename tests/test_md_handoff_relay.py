"""MD's control API relays a handoff to MD's own /generate; a continuation whose reader (the
router) went away is aborted on MD, not decoded on for nobody. The router's own abort by rid can
reach MD before MD's front end passes the request on, and SGLang ignores a second abort of a rid."""

from __future__ import annotations

import asyncio

import aiohttp
from control_fakes import KEY, MdControl
from waiting import wait_until

from sglang_pdd.control_auth import ControlSigner
from sglang_pdd.protocol import HandoffRequest
from sglang_pdd.router.backends import MainControl


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
    md.runtime.call("register", room, [5, 6, 7])
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


def test_a_continuation_read_to_its_end_is_not_aborted():
    md = MdControl()
    try:
        ready_room(md, 4)
        assert handoff_events(md, 4, "leg-m", read=0)[-1]["output_ids"] == [7, 8]
        assert md.generate.aborted == [] and "handoffs_abandoned" not in md.runtime.counters
    finally:
        md.close()
