"""The receiver's replies (NACK / ERROR / ACK) are sent outside its lock (issue 11).

MD's scheduler thread calls register_room / abort / poll, which take that lock; a sender
that stops reading its replies must not stall it (it used to, for 2 s per reply).
"""

import threading
import time

import pytest

from kv_raw_stream import RawStream
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
