"""The chaos run's client (asyncio I/O): open-loop streamed /generate requests, as a real client.

A request is sent when its arrival comes, whatever the earlier ones are doing. Its events are
fed to a StreamTracker (checks.py); it ends as one RequestRecord: completed ("200"), refused
with a status (a non-200 reply: its status and Retry-After), failed in its stream (an error
event: "stream_<code>"), cut (the stream ended without [DONE]) or timed out. A connection the
router refuses or drops before answering (it is restarting) is retried, with a short backoff,
for up to CONNECT_RETRY_S: nothing reached the client, and a greedy request gives the same
tokens again; the retries are counted.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Callable, Iterator, Optional

from sglang_pdd.chaos.checks import RequestRecord, StreamTracker
from sglang_pdd.chaos.spec import Prompt

CONNECT_RETRY_S = 180.0  # the router restarting: SIGTERM drains its streams, a new one starts
REQUEST_TIMEOUT_S = 300.0
RETRY_BACKOFF_S = (0.1, 2.0)  # first and largest pause between connection attempts


def request_body(prompt: Prompt) -> dict:
    return {"input_ids": list(prompt.ids), "stream": True,
            "sampling_params": {"max_new_tokens": prompt.max_new, "temperature": 0, "ignore_eos": True}}


async def one_request(session, url: str, headers: dict, index: int, prompt: Prompt, t0: float) -> RequestRecord:
    import aiohttp

    sent = time.monotonic() - t0
    retries, pause = 0, RETRY_BACKOFF_S[0]
    tracker = StreamTracker()

    def record(status: str, **kw) -> RequestRecord:
        gap_began = None if tracker.gap_began_s is None else tracker.gap_began_s - t0
        return RequestRecord(index, prompt.key, sent, time.monotonic() - t0, status, tuple(tracker.received),
                             tracker.breaks, connect_retries=retries, longest_gap_s=tracker.longest_gap_s,
                             gap_began_s=gap_began, gap_after=tracker.gap_after, **kw)

    while True:
        answered = False
        try:
            async with session.post(f"{url}/generate", json=request_body(prompt), headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as resp:
                answered = True
                if resp.status != 200:
                    text = (await resp.text())[:300]
                    return record(str(resp.status), retry_after=resp.headers.get("Retry-After"), message=text)
                status, message, last = "cut", "", {}
                async for raw in resp.content:
                    line = raw.strip()
                    if line == b"data: [DONE]":
                        status = status if status.startswith("stream_") else "200"
                        break
                    if not line.startswith(b"data:"):
                        continue
                    event = json.loads(line[len(b"data:"):])
                    if "error" in event:
                        error = event["error"]
                        status, message = f"stream_{error.get('code')}", str(error.get("message"))[:300]
                        continue
                    tracker.feed(event.get("output_ids", []), time.monotonic())
                    last = event
                pdd = (last.get("meta_info") or {}).get("pdd") or {}
                return record(status, message=message, path=pdd.get("path", ""),
                              fallbacks=tuple(pdd.get("fallbacks") or ()), handoff_at=pdd.get("handoff_at"),
                              wan_ready_s=pdd.get("wan_ready_s"))
        except asyncio.TimeoutError:
            return record("timeout")
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError) as e:
            if answered:
                return record("cut", message=repr(e)[:300])
            # refused, or dropped before any answer: nothing reached the client
            if time.monotonic() - t0 - sent > CONNECT_RETRY_S:
                return record("refused", message=repr(e)[:300])
            retries += 1
            await asyncio.sleep(pause)
            pause = min(pause * 2, RETRY_BACKOFF_S[1])
        except (ValueError, KeyError, TypeError) as e:  # a reply no SGLang server sends: a failed check
            return record("bad_reply", message=repr(e)[:300])


async def run_load(url: str, headers: dict, arrivals: Iterator[tuple[float, Prompt]], stop: threading.Event,
                   t0: float, on_record: Callable[[RequestRecord], None]) -> None:
    """Sends each arrival at its time (seconds after ``t0``) until ``stop`` is set; then waits
    for the requests in flight. Fresh connection per request: a keep-alive connection the
    router closes while it restarts would otherwise fail a request in a way no client sees."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        tasks: set[asyncio.Task] = set()
        for index, (at, prompt) in enumerate(arrivals):
            while not stop.is_set() and time.monotonic() - t0 < at:
                await asyncio.sleep(min(0.05, max(0.0, at - (time.monotonic() - t0))))
            if stop.is_set():
                break
            task = asyncio.ensure_future(one_request(session, url, headers, index, prompt, t0))
            task.add_done_callback(lambda t: on_record(t.result()))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


class LoadThread:
    """``run_load`` on an asyncio loop of its own, beside the fault injection (blocking)."""

    def __init__(self, url: str, headers: dict, arrivals: Iterator[tuple[float, Prompt]]):
        self.records: list[RequestRecord] = []
        self.stop = threading.Event()
        self.t0 = time.monotonic()
        self._lock = threading.Lock()
        self._error: Optional[BaseException] = None

        def add(record: RequestRecord) -> None:
            with self._lock:
                self.records.append(record)

        def main() -> None:
            try:
                asyncio.run(run_load(url, headers, arrivals, self.stop, self.t0, add))
            except BaseException as e:  # noqa: BLE001 - reported by join()
                self._error = e

        self._thread = threading.Thread(target=main, name="chaos-load", daemon=True)
        self._thread.start()

    def now(self) -> float:
        """Seconds since the load started."""
        return time.monotonic() - self.t0

    def finish(self, timeout_s: float = REQUEST_TIMEOUT_S + CONNECT_RETRY_S + 60) -> list[RequestRecord]:
        """No new request; waits for those in flight; every record, by index."""
        self.stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError("the load did not end: a request outlived its own timeout")
        if self._error is not None:
            raise self._error
        return sorted(self.records, key=lambda r: r.index)
