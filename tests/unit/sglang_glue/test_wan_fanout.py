"""P's WAN fan-out (sglang_glue/p/wan_fanout.py) against a real WanKvReceiver on loopback.

A fake MHA pool (k_buffer/v_buffer lists, like SGLang's) stands in for P's token pool; the
pages a request occupies are scattered over it, as in a real pool.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from tests.support.waiting import wait_until
import torch

from sglang_pdd.sglang_glue.p.fanout_room import DropReason, FanoutPhase
from sglang_pdd.kv_channel.contract import RoomState
from sglang_pdd.kv_channel.wan_receiver import WanKvReceiver
from sglang_pdd.kv_channel.wan_sender import WanKvSender
from sglang_pdd.sglang_glue.kv_pool_view import kv_layout_of
from sglang_pdd.sglang_glue.p.wan_fanout import WanDestination, WanFanout

KEY = b"k" * 32
LAYERS, HEADS, DIM, POOL_SLOTS = 2, 2, 4, 256


class FakePool:
    def __init__(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.k_buffer = [torch.randn(POOL_SLOTS, HEADS, DIM, generator=g).half() for _ in range(LAYERS)]
        self.v_buffer = [torch.randn(POOL_SLOTS, HEADS, DIM, generator=g).half() for _ in range(LAYERS)]

    def rows(self, slots) -> np.ndarray:
        """[2*LAYERS, len(slots), bytes per token] as MD should receive them."""
        idx = torch.as_tensor(np.asarray(slots, dtype=np.int64))
        return np.stack([b.index_select(0, idx).contiguous().view(torch.uint8).view(len(idx), -1).numpy()
                         for b in self.k_buffer + self.v_buffer])


@pytest.fixture
def receiver():
    r = WanKvReceiver(KEY, "md", idle_timeout=5.0)
    yield r
    r.close()


def make_fanout(receiver, *, chunk_bytes=64, staging_bytes=1 << 30, **kw):
    # Tiny chunks: a 40-token request is cut into several page groups, so pipelining shows.
    return WanFanout(KEY, "p", staging_bytes=staging_bytes, timeout_s=10.0, allowed_peers=[receiver.address],
                     sender_factory=lambda peer: WanKvSender(peer, KEY, "p", num_streams=2,
                                                             max_chunk_bytes=chunk_bytes, transfer_timeout=10.0),
                     **kw)


def expect_room(receiver, room, pool, prompt_len, md_prefix):
    layout = kv_layout_of(pool, 1)
    dest = np.zeros((layout.num_layers, prompt_len, layout.bytes_per_page), dtype=np.uint8)
    receiver.register_room(room, layout, prompt_len, dest, decode_prefix_len=md_prefix,
                           token_ids=list(range(prompt_len)), timeout=10.0)
    return dest


def wait_state(receiver, room, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = receiver.poll(room)
        if state.is_terminal:
            return state
        time.sleep(0.01)
    return receiver.poll(room)




def test_pages_md_lacks_arrive_exact_and_p_is_held_only_until_copied(receiver):
    pool, fanout = FakePool(), make_fanout(receiver)
    prompt_len, md_prefix = 40, 12
    slots = np.random.default_rng(1).permutation(POOL_SLOTS)[:prompt_len]  # scattered pages
    dest = expect_room(receiver, 7, pool, prompt_len, md_prefix)
    fanout.attach_pool(pool, 1)
    room = fanout.open_room(WanDestination(7, receiver.address, md_prefix), rid="r",
                            token_ids=list(range(prompt_len)), first_offered_page=0)
    for lo, hi in ((0, 16), (16, 32), (32, 40)):  # chunked prefill: three sends
        fanout.offer(room, slots[lo:hi], last=hi == prompt_len)
    assert wait_until(lambda: fanout.may_free_pages(room))
    assert wait_state(receiver, 7) is RoomState.SUCCESS
    want = pool.rows(slots)
    assert np.array_equal(dest[:, md_prefix:], want[:, md_prefix:])
    assert not dest[:, :md_prefix].any()  # MD's cached prefix never crossed the WAN
    assert wait_until(lambda: fanout.stats()["staged_bytes"] == 0)  # copies freed after the ACK
    fanout.close()


def test_first_groups_leave_while_prefill_is_still_running(receiver):
    pool, fanout = FakePool(), make_fanout(receiver)
    prompt_len = 40
    slots = np.arange(prompt_len)
    dest = expect_room(receiver, 8, pool, prompt_len, 0)
    want = pool.rows(slots)
    fanout.attach_pool(pool, 1)
    room = fanout.open_room(WanDestination(8, receiver.address, 0), rid="r",
                            token_ids=list(range(prompt_len)), first_offered_page=0)
    fanout.offer(room, slots[:20])  # first prefill chunk only
    plan = room.shares[0].plan
    ready = plan.groups_ready(20)
    first_pages = plan.group_chunks(ready - 1)[0]
    covered = first_pages.page_start + first_pages.page_count
    assert 0 < covered <= 20
    # The complete groups' bytes land on MD before the rest of the prompt even exists.
    assert wait_until(lambda: np.array_equal(dest[:, :covered], want[:, :covered]))
    assert not room.copy_done and receiver.poll(8) is not RoomState.SUCCESS
    fanout.offer(room, slots[20:], last=True)
    assert wait_state(receiver, 8) is RoomState.SUCCESS
    assert np.array_equal(dest, want)
    fanout.close()


def open_md_room(receiver, fanout, room_id, prompt_len=40):
    """MD expects a ``prompt_len``-token room with nothing cached; P's fan-out opens it."""
    pool = FakePool()
    expect_room(receiver, room_id, pool, prompt_len, 0)
    fanout.attach_pool(pool, 1)
    return fanout.open_room(WanDestination(room_id, receiver.address, 0), rid="r",
                            token_ids=list(range(prompt_len)), first_offered_page=0)


def test_request_ending_early_drops_the_room_and_md_fails(receiver):
    fanout = make_fanout(receiver)
    room = open_md_room(receiver, fanout, 9)
    fanout.offer(room, np.arange(10))
    # P's request failed before its last chunk: settling must not wait forever for pages.
    assert wait_until(lambda: fanout.may_free_pages(room))
    assert (room.state.phase, room.state.reason) == (FanoutPhase.CANCELLED, DropReason.INCOMPLETE)
    assert wait_state(receiver, 9) is RoomState.FAILED
    fanout.close()


def test_abort_discards_later_pages_and_fails_md(receiver):
    fanout = make_fanout(receiver)
    room = open_md_room(receiver, fanout, 10)
    fanout.offer(room, np.arange(20))
    fanout.abort(room, "request aborted on P")
    fanout.offer(room, np.arange(20, 40), last=True)  # ignored
    assert wait_state(receiver, 10) is RoomState.FAILED
    assert wait_until(lambda: fanout.may_free_pages(room))
    fanout.close()


def test_pages_after_the_last_fail_the_room_without_raising_on_the_scheduler(receiver):
    fanout = make_fanout(receiver)
    room = open_md_room(receiver, fanout, 12)
    fanout.offer(room, np.arange(40), last=True)
    fanout.offer(room, np.arange(40, 44))  # out of turn: the room fails, the caller goes on
    assert (room.state.phase, room.state.reason) == (FanoutPhase.FAILED, DropReason.SEND_FAILED)
    assert wait_until(lambda: fanout.may_free_pages(room))
    fanout.close()


def test_staging_budget_drops_the_room_instead_of_stalling_p(receiver):
    fanout = make_fanout(receiver, staging_bytes=1024)
    prompt_len = 40  # 40 tokens x 4 buffers x 16 B = 2560 B > 1024 B budget
    room = open_md_room(receiver, fanout, 11, prompt_len)
    fanout.offer(room, np.arange(prompt_len), last=True)
    assert wait_until(lambda: fanout.may_free_pages(room))
    assert (room.state.phase, room.state.reason) == (FanoutPhase.FAILED, DropReason.STAGING_BUDGET)
    assert fanout.stats()["dropped_staging_budget"] == 1
    assert wait_state(receiver, 11) is RoomState.FAILED
    fanout.close()


def test_md_needing_pages_below_rlds_prefix_is_refused(receiver):
    pool, fanout = FakePool(), make_fanout(receiver)
    fanout.attach_pool(pool, 1)
    # RLD had 16 tokens cached, so SGLang's sender only ever sees pages from 16 on; MD has 4.
    room = fanout.open_room(WanDestination(12, receiver.address, 4), rid="r",
                            token_ids=list(range(40)), first_offered_page=16)
    assert room is None and fanout.stats()["refused_rld_prefix"] == 1
    fanout.close()


def test_unreachable_md_never_holds_p(receiver):
    pool, fanout = FakePool(), make_fanout(receiver)
    fanout.attach_pool(pool, 1)
    dead = receiver.address
    receiver.close()  # nobody listens there any more
    room = fanout.open_room(WanDestination(13, dead, 0), rid="r", token_ids=list(range(40)),
                            first_offered_page=0)
    fanout.offer(room, np.arange(40), last=True)
    assert wait_until(lambda: fanout.may_free_pages(room))  # copies done: P frees its pages
    assert wait_until(lambda: room.shares[0].transfer.poll() is RoomState.FAILED, timeout=10)
    assert wait_until(lambda: fanout.stats()["staged_bytes"] == 0)
    fanout.close()


def test_concurrent_rooms_each_land_intact(receiver):
    pool, fanout = FakePool(), make_fanout(receiver)
    fanout.attach_pool(pool, 1)
    rng = np.random.default_rng(2)
    rooms, dests, slot_sets = [], [], []
    for i in range(6):
        n = int(rng.integers(5, 60))
        slots = rng.permutation(POOL_SLOTS)[:n]
        dests.append(expect_room(receiver, 100 + i, pool, n, 0))
        slot_sets.append(slots)
        rooms.append(fanout.open_room(WanDestination(100 + i, receiver.address, 0), rid=f"r{i}",
                                      token_ids=list(range(n)), first_offered_page=0))

    def produce(room, slots):
        for lo in range(0, len(slots), 7):
            fanout.offer(room, slots[lo:lo + 7], last=lo + 7 >= len(slots))

    threads = [threading.Thread(target=produce, args=(r, s)) for r, s in zip(rooms, slot_sets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (dest, slots) in enumerate(zip(dests, slot_sets)):
        assert wait_state(receiver, 100 + i) is RoomState.SUCCESS
        assert np.array_equal(dest, pool.rows(slots))
    fanout.close()


def test_a_room_marked_kept_still_lands_and_its_senders_know_it(receiver):
    """The router released MD's room with keep: P's fan-out puts the room behind the waited ones
    (here and on its sender) and still sends all of it; an unknown room is answered False."""
    pool, fanout = FakePool(), make_fanout(receiver)
    prompt_len = 40
    slots = np.arange(prompt_len)
    dest = expect_room(receiver, 9, pool, prompt_len, 0)
    fanout.attach_pool(pool, 1)
    room = fanout.open_room(WanDestination(9, receiver.address, 0), rid="r",
                            token_ids=list(range(prompt_len)), first_offered_page=0)
    assert fanout.keep_only(9) is False  # nothing copied yet: not sending
    fanout.offer(room, slots[:20])
    assert wait_until(lambda: fanout.stats()["live_rooms"] == 1)
    assert fanout.keep_only(9) is True and fanout.keep_only(12345) is False
    assert room.shares[0].sender._rooms[9].kept
    fanout.offer(room, slots[20:], last=True)
    assert wait_state(receiver, 9) is RoomState.SUCCESS
    assert np.array_equal(dest, pool.rows(slots))
    assert fanout.stats()["kept_only"] == 1
    fanout.close()
