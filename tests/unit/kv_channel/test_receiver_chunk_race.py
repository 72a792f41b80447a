"""A room's completion check must never see a chunk's writer gone but its bytes uncounted.

Two chunks of one room arrive on two streams of one sender session, END on a third. The
receiver's lock is wrapped so that the first stream's thread, right after it lets the lock
go once its payload is written, waits until the second stream's chunk is fully handled:
exactly the interleaving in which the room was once failed with "received N bytes,
expected 2N" though every byte had arrived.
"""

import os
import threading

import numpy as np
import pytest

from tests.support.kv_raw_stream import RawStream
from sglang_pdd.kv_channel.layout import KvLayout
from sglang_pdd.kv_channel.contract import RoomState
from sglang_pdd.kv_channel.wan_receiver import WanKvReceiver
from sglang_pdd.kv_channel.wire import Chunk, TransferBegin, TransferEnd

KEY = b"chunk-race-test-key-0123456789abc"
pytestmark = pytest.mark.timeout(60)
WAIT_S = 10.0  # a bound for a broken run; a passing one never waits this long


class _HookedCondition(threading.Condition):
    """The receiver's condition (same lock): ``after_release`` runs in a thread marked in
    ``armed`` the first time that thread lets the lock go."""

    def __init__(self, lock):
        super().__init__(lock)
        self.armed: dict = {}

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        hook = self.armed.pop(threading.get_ident(), None)
        if hook is not None:
            hook()
        return result


def test_completion_waits_for_every_chunks_byte_count():
    rx = WanKvReceiver(KEY, name="md", idle_timeout=5.0)
    original = rx._cv  # the receiver's own threads wait on it: close() must notify it
    cv = rx._cv = _HookedCondition(original._lock)
    end_seen, first_released, second_done = threading.Event(), threading.Event(), threading.Event()

    def first_waits_for_second():
        first_released.set()
        second_done.wait(WAIT_S)

    receive_payload, on_chunk, on_end = rx._receive_payload, rx._on_chunk, rx._on_end

    def paced_receive(entry, part, reader, msg):
        assert end_seen.wait(WAIT_S)  # both chunks are written once END is in
        if msg.index == 1:
            assert first_released.wait(WAIT_S)
        receive_payload(entry, part, reader, msg)
        if msg.index == 0:
            cv.armed[threading.get_ident()] = first_waits_for_second

    def tracked_chunk(conn, reader, msg, plen):
        try:
            on_chunk(conn, reader, msg, plen)
        finally:
            if msg.index == 1:
                second_done.set()

    def tracked_end(conn, msg):
        on_end(conn, msg)
        end_seen.set()

    rx._receive_payload, rx._on_chunk, rx._on_end = paced_receive, tracked_chunk, tracked_end
    layout = KvLayout(1, 16, 1000)
    dest = np.zeros((1, 2, 1000), np.uint8)
    rx.register_room(5, layout, 32, dest)
    pages = [os.urandom(1000), os.urandom(1000)]
    session = os.urandom(16)
    streams = [RawStream(rx.address, KEY, "p", session_id=session, stream_index=i, num_streams=3) for i in range(3)]
    try:
        streams[0].send(TransferBegin(5, "", 32, 16, 0, 2, 1, 1000, layout.dtype, 2, b""))
        for i, page in enumerate(pages):
            streams[i].send(Chunk(5, i, 0, 1, i, 1), page)
        streams[2].send(TransferEnd(5, 2, 2000))
        assert rx.wait(5, WAIT_S) == RoomState.SUCCESS, rx.failure(5)
        assert bytes(dest[0, 0]) == pages[0] and bytes(dest[0, 1]) == pages[1]
        assert first_released.is_set() and second_done.is_set()  # the interleaving did happen
    finally:
        for s in streams:
            s.close()
        rx._cv = original
        rx.close()
