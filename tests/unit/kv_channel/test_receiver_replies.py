"""The receiver's replies (NACK / ERROR / ACK) are sent outside its lock.

MD's scheduler thread calls register_room / abort / poll, which take that lock; a sender
that stops reading its replies must not stall it (it used to, for 2 s per reply).
"""

import threading
import time

import pytest

from tests.support.kv_raw_stream import RawStream
from sglang_pdd.kv_channel.layout import KvLayout
from sglang_pdd.kv_channel.wan_receiver import WanKvReceiver
from sglang_pdd.kv_channel.wire import TransferBegin

KEY = b"replies-test-key-0123456789abcdef"
pytestmark = pytest.mark.timeout(60)


def test_peer_that_never_reads_does_not_stall_the_owner():
    rx = WanKvReceiver(KEY, name="md", idle_timeout=5.0, socket_buffer_bytes=4096)
    layout = KvLayout(1, 16, 1024)
    peer = RawStream(rx.address, KEY, rcvbuf=4096)  # authenticates, then never reads again
    stop = threading.Event()

    def flood():  # BEGINs for unregistered rooms: one NACK each, ~10x what the buffers hold
        try:
            for room in range(10_000, 15_000):
                if stop.is_set():
                    return
                peer.send(TransferBegin(room, "", 16, 16, 0, 1, 1, 1024, layout.dtype, 1, b""))
        except OSError:
            pass  # the receiver gave up on us: expected

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    worst = 0.0
    try:
        deadline = time.monotonic() + 4.0  # covers at least one 2 s send timeout of the old code
        room = 0
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            rx.register_room(room, layout, 16, bytearray(1024))  # what MD's scheduler does per request
            rx.poll(room)
            rx.abort(room)
            rx.release_room(room)
            worst = max(worst, time.monotonic() - t0)
            room += 1
            time.sleep(0.01)
        stats = rx.stats()
        assert stats["unknown_room"] > 100, stats  # replies piled up unread (the buffers hold ~200)
        assert worst < 1.0, f"owner call blocked for {worst:.2f}s behind a peer that does not read"
    finally:
        stop.set()
        peer.close()
        rx.close()
        flooder.join(5)


def test_late_frames_of_a_released_room_get_no_unknown_room_reply():
    """A released room's sender was told ``aborted``; its frames still on other streams must
    not draw an ``unknown_room`` NACK that could reach the sender first and hide the reason."""
    from tests.support.kv_raw_stream import RawStream
    from tests.support.waiting import wait_until

    from sglang_pdd.kv_channel.layout import KvLayout
    from sglang_pdd.kv_channel.wan_receiver import WanKvReceiver
    from sglang_pdd.kv_channel.wire import Chunk, Nack, TransferBegin

    key = b"late-frames-test-key-0123456789ab"
    rx = WanKvReceiver(key, name="md", idle_timeout=5.0)
    layout = KvLayout(1, 16, 1000)
    rx.register_room(61, layout, 32, bytearray(2000))
    try:
        with RawStream(rx.address, key, "p") as stream:
            stream.send(TransferBegin(61, "", 32, 16, 0, 2, 1, 1000, layout.dtype, 2, b""))
            stream.send(Chunk(61, 0, 0, 1, 0, 1), bytes(1000))
            assert wait_until(lambda: rx.bytes_received(61) == 1000)  # the room is bound to this sender
            rx.release_room(61)  # e.g. RLD already finished the request
            first = stream.read_message()[0]
            assert isinstance(first, Nack) and first.room == 61 and first.reason == "aborted", first
            stream.send(Chunk(61, 1, 0, 1, 1, 1), bytes(1000))  # late: the room is gone
            stream.send(Chunk(62, 0, 0, 1, 0, 1), bytes(1000))  # never registered
            reply = stream.read_message()[0]
            assert isinstance(reply, Nack) and (reply.room, reply.reason) == (62, "unknown_room"), reply
    finally:
        rx.close()


@pytest.mark.parametrize("forgotten", [False, True], ids=["aborted", "aborted_and_released"])
def test_a_room_dropped_before_its_first_frame_tells_its_sender_why(forgotten):
    """MD drops a room whose KV has not reached it yet (the request ended; a cache flush; the
    WAN is slow or queued): no sender had a frame in it, so none was told. The first frame
    that then comes is answered with the reason, once, so P ends the transfer now instead of
    holding its KV until its idle timeout; later frames are dropped as for any released room."""
    from tests.support.kv_raw_stream import RawStream

    from sglang_pdd.kv_channel.wire import Chunk, Nack

    key = b"untold-room-test-key-0123456789ab"
    rx = WanKvReceiver(key, name="md", idle_timeout=5.0)
    layout = KvLayout(1, 16, 1000)
    rx.register_room(71, layout, 32, bytearray(2000))
    try:
        with RawStream(rx.address, key, "p") as stream:
            rx.abort(71, "released by the router")  # before any frame of the room arrived
            if forgotten:
                rx.release_room(71)
            stream.send(TransferBegin(71, "", 32, 16, 0, 2, 1, 1000, layout.dtype, 2, b""))
            stream.send(Chunk(71, 0, 0, 1, 0, 1), bytes(1000))  # late: the sender was told already
            stream.send(Chunk(72, 0, 0, 1, 0, 1), bytes(1000))  # never registered
            first = stream.read_message()[0]
            assert isinstance(first, Nack) and (first.room, first.reason) == (71, "aborted"), first
            assert "released by the router" in first.detail, first
            second = stream.read_message()[0]
            assert isinstance(second, Nack) and (second.room, second.reason) == (72, "unknown_room"), second
    finally:
        rx.close()
