"""A hybrid sliding-window layout on the WAN channel: the window buffers send only the window's
pages ``[max(decode_prefix_len, num_tokens - window) // page_size, end_page)``, over real
loopback sockets; the receiver checks the range and counts the bytes."""

import numpy as np
import pytest

from sglang_pdd.kv_channel.layout import KvLayout, KvLayoutMismatch, KvPoolLayout, TransferPlan, window_first_page
from sglang_pdd.kv_channel.contract import FailureReason, RoomState
from sglang_pdd.kv_channel.wan_receiver import WanKvReceiver
from sglang_pdd.kv_channel.wan_sender import WanKvSender

KEY = b"test-shared-key-0123456789abcdef"
pytestmark = pytest.mark.timeout(60)


def test_window_first_page_is_the_page_of_the_later_of_prefix_and_window_start():
    assert window_first_page(100, 0, 32, 1) == 68
    assert window_first_page(100, 80, 32, 1) == 80  # MD holds more than the window reaches back
    assert window_first_page(100, 0, 32, 16) == 4  # token 68 is on page 4: the page is sent whole
    assert window_first_page(20, 0, 32, 1) == 0  # a prompt shorter than the window


def test_at_page_size_16_the_window_also_reaches_back_from_the_last_page_boundary():
    """MD's tree takes whole pages: the sliding KV sent covers the window before the prompt's
    last page boundary as well as before its end (page 4 for 111 tokens, window 31: token 65;
    from the end alone, token 80, page 5)."""
    assert window_first_page(111, 0, 31, 16) == 4
    for page in (1, 16, 64):
        for tokens in range(1, 300):
            first = window_first_page(tokens, 0, 31, page) * page
            assert first <= max(0, tokens - 31) and first <= max(0, tokens - tokens % page - 31)
            assert first > tokens - tokens % page - 31 - page  # never a page more than that


@pytest.mark.parametrize("tokens, prefix, page_size, chunk_pages", [(200, 0, 1, 50), (200, 64, 16, 3),
                                                                    (37, 0, 1, 8), (200, 192, 16, 1)])
def test_plan_sends_every_full_page_and_only_the_window_of_window_buffers(tokens, prefix, page_size, chunk_pages):
    layout = KvLayout(6, page_size, 64 * page_size, "float32", "mha", window_buffers=2, window=32)
    plan = TransferPlan.build(layout, tokens, prefix, max_chunk_bytes=chunk_pages * layout.bytes_per_page)
    wfp = window_first_page(tokens, prefix, 32, page_size)
    covered = np.zeros((6, plan.end_page), dtype=int)
    for i in range(plan.num_chunks):
        spec = plan.chunk(i)
        assert spec.index == i
        covered[spec.layer, spec.page_start:spec.page_start + spec.page_count] += 1
    assert (covered[:4, plan.first_page:] == 1).all() and not covered[:4, :plan.first_page].any()
    assert (covered[4:, wfp:] == 1).all() and not covered[4:, :wfp].any()
    assert plan.total_bytes == covered.sum() * layout.bytes_per_page
    # every chunk is in exactly one page group, and a group is ready once its pages exist
    grouped = [s.index for g in range(plan.chunks_per_layer) for s in plan.group_chunks(g)]
    assert sorted(grouped) == list(range(plan.num_chunks))
    for g in range(plan.chunks_per_layer):
        assert all(s.page_start + s.page_count <= plan.first_page + (g + 1) * plan.pages_per_chunk
                   for s in plan.group_chunks(g))


def test_window_layout_fields_are_checked_and_named():
    plain = KvPoolLayout("mha", 4, 1, 256, "float32")
    hybrid = KvPoolLayout("mha", 4, 1, 256, "float32", window_layers=2, window=32)
    assert hybrid.wire().window_buffers == 4 and hybrid.wire().window == 32
    with pytest.raises(KvLayoutMismatch, match="window_layers 2 vs 0"):
        hybrid.check_same(plain, "md", "p")
    with pytest.raises(KvLayoutMismatch, match="window 32 vs 64"):
        hybrid.wire().check_same(KvLayout(8, 1, 256, "float32", "mha", 4, 64), "md", "p")
    with pytest.raises(ValueError, match="sliding-window"):
        KvLayout(4, 1, 256, window_buffers=2)  # a window buffer needs a window
    assert KvPoolLayout.from_dict(plain.to_dict()) == plain and KvPoolLayout.from_dict(hybrid.to_dict()) == hybrid


@pytest.mark.parametrize("tokens, prefix", [(150, 0), (150, 120), (20, 0)])
def test_window_transfer_over_loopback_lands_full_pages_and_the_window_only(tokens, prefix):
    layout = KvLayout(8, 1, 256, "float32", "mha", window_buffers=4, window=32)
    rng = np.random.default_rng(tokens + prefix)
    kv = rng.integers(0, 256, (8, tokens, 256), dtype=np.uint8)
    dest = np.zeros_like(kv)
    rx = WanKvReceiver(KEY, name="md", idle_timeout=2.0)
    tx = WanKvSender(rx.address, KEY, name="p", num_streams=2, idle_timeout=2.0, connect_timeout=2.0,
                     max_chunk_bytes=10 * 256)
    try:
        rx.register_room(5, layout, tokens, dest, decode_prefix_len=prefix)
        xfer = tx.begin_transfer(5, layout, tokens, prefix, request_id="r5")
        assert xfer.send_kv(kv)
        assert xfer.wait(20) == RoomState.SUCCESS, xfer.failure_detail
        assert rx.wait(5, 5) == RoomState.SUCCESS
        wfp = max(prefix, tokens - 32)
        assert np.array_equal(dest[:4, prefix:], kv[:4, prefix:]) and not dest[:4, :prefix].any()
        assert np.array_equal(dest[4:, wfp:], kv[4:, wfp:]) and not dest[4:, :wfp].any()
        assert xfer.plan.total_bytes == 256 * (4 * (tokens - prefix) + 4 * (tokens - wfp))
    finally:
        tx.close()
        rx.close()


def test_receiver_without_the_window_refuses_a_window_sender_naming_both():
    hybrid = KvLayout(8, 1, 256, "float32", "mha", window_buffers=4, window=32)
    plain = KvLayout(8, 1, 256, "float32", "mha")
    rx = WanKvReceiver(KEY, name="md", idle_timeout=2.0)
    tx = WanKvSender(rx.address, KEY, name="p", num_streams=1, idle_timeout=2.0, connect_timeout=2.0)
    try:
        rx.register_room(6, plain, 64, np.zeros((8, 64, 256), dtype=np.uint8), decode_prefix_len=0)
        xfer = tx.begin_transfer(6, hybrid, 64, 0, request_id="r6")
        xfer.send_kv(np.zeros((8, 64, 256), dtype=np.uint8))
        assert rx.wait(6, 10) == RoomState.FAILED
        assert xfer.wait(10) == RoomState.FAILED and xfer.failure_reason == FailureReason.LAYOUT_MISMATCH
        assert "window_buffers 0 vs 4" in xfer.failure_detail
    finally:
        tx.close()
        rx.close()
