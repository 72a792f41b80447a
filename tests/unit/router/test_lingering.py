"""The router's tasks that outlive their request (router/flow/lingering.py)."""

import asyncio
import logging

from sglang_pdd.router.flow.lingering import Lingering


def test_settle_waits_for_tasks_and_those_they_start_then_cancels_the_rest():
    async def main():
        lingering, done = Lingering(), []

        async def step(name, then=None):
            await asyncio.sleep(0.05)
            done.append(name)
            if then is not None:
                lingering.spawn(then)

        lingering.spawn(step("first", step("second")))
        forever = lingering.spawn(asyncio.sleep(3600))
        assert len(lingering) == 2
        cancelled = await lingering.settle(0.5)
        return done, cancelled, forever, len(lingering)

    done, cancelled, forever, left = asyncio.run(main())
    assert done == ["first", "second"] and cancelled == 1 and forever.cancelled() and left == 0


def test_a_failing_task_is_logged_and_leaves_the_others(caplog):
    async def main():
        lingering = Lingering()

        async def boom():
            raise RuntimeError("a bug")

        lingering.spawn(boom())
        ok = lingering.spawn(asyncio.sleep(0.01, result="landed"))
        assert await lingering.settle(1.0) == 0
        return ok.result()

    with caplog.at_level(logging.ERROR, logger="sglang_pdd.router"):
        assert asyncio.run(main()) == "landed"
    assert "a task left by an ended request failed" in caplog.text and "a bug" in caplog.text
