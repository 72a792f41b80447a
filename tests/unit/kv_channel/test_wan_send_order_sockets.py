"""P's WAN sender over real loopback sockets and an emulated slow link: a room queued behind a
large one is not held back by it (rooms take turns), and a kept room's bytes go behind a waited
room's (send_order.py)."""

import threading

import numpy as np
import pytest

from sglang_pdd.kv_channel.layout import KvLayout
from sglang_pdd.kv_channel.contract import RoomState
from sglang_pdd.kv_channel.wan_receiver import WanKvReceiver
from sglang_pdd.kv_channel.wan_sender import WanKvSender
from sglang_pdd.launcher.wan_emulator import WanEmulator
from tests.support.waiting import wait_until

KEY = b"test-shared-key-0123456789abcdef"
pytestmark = pytest.mark.timeout(60)
LAYOUT = KvLayout(4, 16, 256 * 1024)  # 4 MiB a 16-token page... x 4 layers: 1 MiB per page per layer


def _kv(pages: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (LAYOUT.num_layers, pages, LAYOUT.bytes_per_page),
                                                dtype=np.uint8)


@pytest.mark.parametrize("keep", [True, False], ids=["kept_behind", "turns"])
def test_a_small_room_queued_after_a_large_one_lands_first(keep):
    big_pages, small_pages = 8, 1  # 32 MiB (0.7 s at 0.4 Gbps) and 1 MiB
    big, small = _kv(big_pages, 1), _kv(small_pages, 2)
    rx = WanKvReceiver(KEY, name="md", idle_timeout=5.0)
    big_dest, small_dest = np.zeros_like(big), np.zeros_like(small)
    rx.register_room(1, LAYOUT, 16 * big_pages, big_dest)
    rx.register_room(2, LAYOUT, 16 * small_pages, small_dest)
    # small kernel buffers and emulator window: the order is the sender's, not the sockets'
    with WanEmulator(rx.address, rate_gbps=0.4, window_bytes=256 * 1024) as emu:
        tx = WanKvSender(emu.address, KEY, name="prefill", num_streams=2, max_chunk_bytes=256 * 1024,
                         socket_buffer_bytes=64 * 1024, idle_timeout=5.0)
        try:
            first = tx.begin_transfer(1, LAYOUT, 16 * big_pages, 0)
            sent = threading.Thread(target=first.send_kv, args=(big,), daemon=True)
            sent.start()
            sent.join(10)  # every chunk of the large room queued (the window holds them all)
            assert wait_until(lambda: rx.poll(1) == RoomState.TRANSFERRING, 5)  # the large room on the wire
            if keep:
                assert tx.keep_only(1) and not tx.keep_only(99)
            second = tx.begin_transfer(2, LAYOUT, 16 * small_pages, 0)
            assert second.send_kv(small)
            assert second.wait(20) == RoomState.SUCCESS, second.failure_detail
            # a FIFO would have sent all of the large room first
            assert first.poll() is not RoomState.SUCCESS
            assert first.wait(20) == RoomState.SUCCESS, first.failure_detail
            assert np.array_equal(big_dest, big) and np.array_equal(small_dest, small)
        finally:
            tx.close()
            rx.close()
