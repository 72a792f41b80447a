"""MD's ingest on SGLang's own radix cache, allocator and pools (CPU), fed by P's real WAN fan-out
over loopback: page sizes 1/16/64, MHA and MLA, DRC prefixes cut on page boundaries, pages
reserved at registration and written as chunks land, admission (refused rooms hold nothing),
and every reserved page accounted for."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from sglang_pdd.protocol import RegisterRequest, ReleaseRequest
from tests.support.md_runtime import (KEY, POOL_PAGES, Prefill, build_md, close, conserved, drive_until, make_pool,
                                     md_rows, settle, shard_pool)
from tests.support.waiting import wait_until

@pytest.mark.parametrize("kind,page_size,prompt_len", [
    ("mha", 1, 37), ("mha", 16, 50), ("mha", 16, 48), ("mla", 16, 50), ("mha", 64, 150), ("mla", 64, 70),
])
@pytest.mark.parametrize("ingest", ["pool", "staged"])
def test_kv_lands_in_the_tree_exactly(kind, page_size, prompt_len, ingest):
    md = build_md(page_size, kind, ingest=ingest)
    p = Prefill(kind, page_size, md)
    try:
        ids = list(range(1000, 1000 + prompt_len))
        free_before = md.ops.allocator.available_size()
        reg = md.rank_rooms.register(RegisterRequest(1, ids))
        assert reg.cached_tokens == 0 and reg.kv_layout["kind"] == kind
        assert reg.kv_layout["page_size"] == page_size
        sent_pages = -(-prompt_len // page_size)
        if ingest == "pool":  # the room's pages are reserved up front, and counted
            assert md.held_tokens == sent_pages * page_size
            assert md.ops.allocator.available_size() == free_before - sent_pages * page_size
        assert conserved(md)
        pages = p.pages_for(prompt_len, seed=1)
        p.send(1, ids, reg.cached_tokens, pages)
        drive_until(md, 1)
        insert_len = prompt_len // page_size * page_size  # the tree holds whole pages only
        cached, _ = md.ops.match(ids)
        assert cached == insert_len
        for want, got in zip(p.token_rows(pages, 0, insert_len), md_rows(md, ids, 0, insert_len)):
            assert torch.equal(want.view(torch.uint8), got.view(torch.uint8))
        settle(md)
        assert md.held_tokens == 0 and conserved(md)
        # the partial last page went back to the allocator; the prompt's pages are locked
        assert md.ops.allocator.available_size() == free_before - insert_len
        md.rank_rooms.release(ReleaseRequest(1))
        assert md.ops.tree.protected_size() == 0 and conserved(md)
    finally:
        close(md, p)


def test_a_closed_runtime_leaves_no_thread_of_its_own():
    """MD's runtime is closed as a whole: its receiver, control server and the thread that
    lets rooms go in the receiver (which would otherwise keep the receiver alive)."""
    before = set(threading.enumerate())
    md = build_md(16, "mha", ingest="pool")
    reg = md.rank_rooms.register(RegisterRequest(1, list(range(40))))
    assert reg.cached_tokens == 0
    md.rank_rooms.release(ReleaseRequest(1))  # queues the room's release on that thread
    md.close()
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert "pdd-md-room-release" not in left
    assert md.rank_rooms.pages._to_receiver.empty()  # the queued release ran before it stopped


@pytest.mark.parametrize("page_size", [1, 16])
def test_cached_prefix_is_page_aligned_and_p_sends_from_it(page_size):
    md = build_md(page_size)
    p = Prefill("mha", page_size, md)
    try:
        first = list(range(2000, 2040))
        reg = md.rank_rooms.register(RegisterRequest(1, first))
        pages1 = p.pages_for(len(first), seed=2)
        p.send(1, first, reg.cached_tokens, pages1)
        drive_until(md, 1)
        md.rank_rooms.release(ReleaseRequest(1))
        # a second turn shares 35 tokens: MD holds them up to the last whole page
        second = first[:35] + list(range(3000, 3030))
        reg = md.rank_rooms.register(RegisterRequest(2, second))
        shared = 35 // page_size * page_size
        assert reg.cached_tokens == shared
        # P's copy of the second prompt: the shared pages plus new ones
        pages2 = p.pages_for(len(second), seed=3)
        p.send(2, second, reg.cached_tokens, pages2)
        drive_until(md, 2)
        insert_len = len(second) // page_size * page_size
        assert md.ops.match(second)[0] == insert_len
        for want, got in zip(p.token_rows(pages2, shared, insert_len), md_rows(md, second, shared, insert_len)):
            assert torch.equal(want.view(torch.uint8), got.view(torch.uint8))
        for want, got in zip(p.token_rows(pages1, 0, shared), md_rows(md, second, 0, shared)):
            assert torch.equal(want.view(torch.uint8), got.view(torch.uint8))  # the prefix is turn 1's KV
        settle(md)
        assert md.held_tokens == 0 and conserved(md)
        assert md.stats()["wan_tokens"] == len(first) + len(second) - shared
    finally:
        close(md, p)


@pytest.mark.parametrize("ingest", ["pool", "staged"])
def test_room_over_the_budget_is_refused_and_holds_nothing(ingest):
    from sglang_pdd.sglang_glue.md.ingest import RoomRefused

    md = build_md(16, ingest=ingest)
    try:
        per_page = md.ops.pool_layout.page_bytes * md.ops.pool_layout.num_buffers
        md.rank_rooms.budget.limit_bytes = 3 * per_page  # three pages in flight at most
        free_before = md.ops.allocator.available_size()
        md.rank_rooms.register(RegisterRequest(1, list(range(20))))  # two pages: fits
        with pytest.raises(RoomRefused, match=rf"needs {2 * per_page} bytes of KV in flight on MD, {per_page} of"):
            md.rank_rooms.register(RegisterRequest(2, list(range(100, 120))))
        assert md.counters["rooms_refused"] == 1 and 2 not in md.table.rooms
        assert md.rank_rooms.budget.used_bytes == 2 * per_page and conserved(md)
        md.rank_rooms.register(RegisterRequest(3, list(range(200, 210))))  # one page still fits
        for room in (1, 3):
            md.rank_rooms.release(ReleaseRequest(room))
        settle(md)
        assert md.ops.allocator.available_size() == free_before and md.rank_rooms.budget.used_bytes == 0
    finally:
        close(md)


def test_room_larger_than_the_pool_is_refused_at_registration():
    from sglang_pdd.sglang_glue.md.ingest import RoomRefused

    md = build_md(16)
    try:
        free_before = md.ops.allocator.available_size()
        with pytest.raises(RoomRefused, match="KV pool cannot hold"):
            md.rank_rooms.register(RegisterRequest(1, list(range(16 * POOL_PAGES + 5))))
        assert md.table.rooms == {} and md.held_tokens == 0 and md.rank_rooms.budget.used_bytes == 0
        assert md.ops.allocator.available_size() == free_before and conserved(md)
        assert md.counters["rooms_refused"] == 1
    finally:
        close(md)


def test_refused_registration_answers_400_with_the_reason():
    """Through MD's control API (the router treats any non-200 as 'RLD finishes')."""
    import threading

    md = build_md(16, tmp_budget_mb=1)
    stop = threading.Event()

    def scheduler():
        while not stop.is_set():
            md.on_scheduler_iteration()
            time.sleep(0.005)

    t = threading.Thread(target=scheduler, daemon=True)
    t.start()
    try:
        from sglang_pdd.launcher.http import call_json

        url = "http://%s:%d/pdd/rooms" % md.control.httpd.server_address[:2]
        status, reply = call_json("POST", url, {"room": 5, "token_ids": list(range(16 * POOL_PAGES + 1))}, key=KEY)
        assert status == 400
        assert "refused" in reply["error"]
    finally:
        stop.set()
        t.join()
        close(md)


@pytest.mark.parametrize("ingest", ["pool", "staged"])
def test_room_released_in_flight_frees_its_pages_after_the_receiver(ingest):
    md = build_md(16, ingest=ingest)
    try:
        free_before = md.ops.allocator.available_size()
        md.rank_rooms.register(RegisterRequest(1, list(range(100))))
        assert md.rank_rooms.budget.used_bytes > 0
        md.rank_rooms.release(ReleaseRequest(1))  # the router gave up before any KV came
        settle(md)
        assert md.held_tokens == 0 and md.rank_rooms.budget.used_bytes == 0 and md.table.rooms == {}
        assert md.ops.allocator.available_size() == free_before and conserved(md)
    finally:
        close(md)


def test_layout_mismatch_fails_the_room_naming_both_sides(caplog):
    md = build_md(16)  # MD: page size 16
    # P: page size 1, one stream: its TRANSFER_BEGIN (which names P's layout) comes before any
    # chunk; on two, a chunk can overtake it and fail the room on its page range alone
    p = Prefill("mha", 1, md, num_streams=1)
    try:
        ids = list(range(32))
        reg = md.rank_rooms.register(RegisterRequest(1, ids))
        p.send(1, ids, reg.cached_tokens, p.pages_for(32, seed=4))
        entry = drive_until(md, 1, status="failed")
        assert "layout_mismatch" in entry.reason and "page_size 16 vs 1" in entry.reason, entry.reason
        def p_said_so():  # P hears it too (NACK), and says so as an error
            return any(r.levelname == "ERROR" and "page_size 16 vs 1" in r.getMessage() for r in caplog.records)

        assert wait_until(p_said_so)
        settle(md)
        assert md.held_tokens == 0 and conserved(md)
    finally:
        close(md, p)


def test_sglang_leak_check_counts_pages_held_in_flight():
    from sglang_pdd.sglang_glue.plugin import _count_md_held_slots

    md = build_md(16)
    try:
        md.rank_rooms.register(RegisterRequest(1, list(range(40))))
        checker = SimpleNamespace(token_to_kv_pool_allocator=md.ops.allocator)
        seen = _count_md_held_slots(lambda c, ps, uncached=0: uncached, checker, None, uncached=5)
        assert seen == 5 + 48 == 5 + md.held_tokens
        other = SimpleNamespace(token_to_kv_pool_allocator=object())  # another scheduler's pool
        assert _count_md_held_slots(lambda c, ps, uncached=0: uncached, other, None) == 0
    finally:
        close(md)


@pytest.mark.parametrize("kind,heads,tp,page_size,ingest", [
    ("mha", 2, 2, 1, "pool"),  # one KV head per rank
    ("mha", 4, 2, 16, "staged"),  # two per rank, staged ingest (strided host writes)
    ("mha", 2, 4, 16, "pool"),  # heads replicated on two ranks each: two of four ranks send
    ("mla", 1, 2, 16, "pool"),  # the latent is on every rank: rank 0 sends it, rank 1 nothing
])
def test_p_tp_ranks_each_send_their_heads_into_mds_one_pool(kind, heads, tp, page_size, ingest):
    from sglang_pdd.kv_channel.tp_relayout import TpShard, kv_heads_of_rank

    md = build_md(page_size, kind, ingest=ingest, head_num=heads)
    full = make_pool(kind, page_size, seed=11, head_num=heads)
    ranks = [Prefill(kind, page_size, md, shard_pool(full, kind, page_size, kv_heads_of_rank(
        1 if kind == "mla" else heads, tp, r)), TpShard(r, tp, 1 if kind == "mla" else heads)) for r in range(tp)]
    try:
        prompt_len = 3 * page_size + 5
        ids = list(range(500, 500 + prompt_len))
        reg = md.rank_rooms.register(RegisterRequest(1, ids))
        pages = ranks[0].pages_for(prompt_len, seed=2)  # SGLang's ranks allocate alike
        senders = [p for p in ranks if p.fanout.sends]
        assert len(senders) == (1 if kind == "mla" else min(heads, tp))
        for p in ranks:
            if p.fanout.sends:
                p.send(1, ids, reg.cached_tokens, pages)
            else:  # a replica rank opens no room
                assert p.fanout.open_room(WanDest(1, md), rid="r", token_ids=ids, first_offered_page=0) is None
        drive_until(md, 1)
        insert_len = prompt_len // page_size * page_size
        whole = Prefill.token_rows(SimpleNamespace(pool=full, page_size=page_size), pages, 0, insert_len)
        for want, got in zip(whole, md_rows(md, ids, 0, insert_len)):
            assert torch.equal(want.view(torch.uint8), got.view(torch.uint8))
        settle(md)
        assert md.held_tokens == 0 and conserved(md)
    finally:
        for p in ranks:
            p.fanout.close()
        close(md)


def WanDest(room, md):
    from sglang_pdd.sglang_glue.p.wan_fanout import WanDestination

    return WanDestination(room, md.receiver.address, 0)


def test_a_missing_tp_slice_leaves_the_room_waiting():
    """MD's room is ready only when the ranks' slices tile the row: one rank of two alone
    leaves it waiting (until its deadline fails it and RLD finishes the request)."""
    from sglang_pdd.kv_channel.tp_relayout import TpShard, kv_heads_of_rank

    md = build_md(1, "mha", head_num=2)
    full = make_pool("mha", 1, seed=5, head_num=2)
    rank0 = Prefill("mha", 1, md, shard_pool(full, "mha", 1, kv_heads_of_rank(2, 2, 0)), TpShard(0, 2, 2))
    try:
        ids = list(range(40))
        reg = md.rank_rooms.register(RegisterRequest(1, ids))
        rank0.send(1, ids, reg.cached_tokens, rank0.pages_for(40, seed=3))
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            md.on_scheduler_iteration()
            time.sleep(0.02)
        assert md.table.rooms[1].status.value == "pending"  # half of every row landed: not ready
        assert wait_until(lambda: md.receiver.stats()["connections"] > 0)
    finally:
        rank0.fanout.close()
        close(md)


def test_mds_stats_count_the_radix_caches_real_evictions():
    """A prompt landed and released stays in MD's cache, unlocked; when a larger room needs its
    pages, the reservation evicts it through SGLang's own evict, and so does SGLang's
    scheduler asking the cache for room: MD's stats count both passes and their tokens."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    page_size = 16
    md = build_md(page_size)
    p = Prefill("mha", page_size, md)
    try:
        assert md.stats()["evictions"] == 0
        for room, base in ((1, 1000), (2, 3000)):
            ids = list(range(base, base + 200))
            p.send(room, ids, md.rank_rooms.register(RegisterRequest(room, ids)).cached_tokens,
                   p.pages_for(200, seed=room))
            drive_until(md, room)
            settle(md)
            md.rank_rooms.release(ReleaseRequest(room))
        cached = md.ops.tree.evictable_size()
        assert cached == 2 * 192 and md.stats()["evictions"] == 0  # 12 whole pages each, unlocked
        # a room of 19 pages: more than the pool has free, so its reservation evicts (one prompt)
        free = md.ops.allocator.available_size()
        ids = list(range(5000, 5300))
        md.rank_rooms.register(RegisterRequest(3, ids))
        first = md.stats()
        assert first["evictions"] == 1 and first["evicted_tokens"] >= 304 - free
        assert first["evicted_tokens"] == cached - md.ops.tree.evictable_size()
        # SGLang's scheduler evicting for its own batch goes through the same report
        left = md.ops.tree.evictable_size()
        result = md.ops.tree.evict(EvictParams(num_tokens=left))
        after = md.stats()
        assert result.num_tokens_evicted == left > 0
        assert after["evictions"] == 2 and after["evicted_tokens"] == first["evicted_tokens"] + left
        md.rank_rooms.release(ReleaseRequest(3))
        settle(md)
        assert conserved(md)
    finally:
        close(md, p)


def test_kv_of_a_request_released_with_keep_still_lands_in_the_tree_and_is_counted():
    """The request ended on RLD before its KV crossed (the router releases MD's room with
    keep_kv): P goes on sending, MD lands the pages in its radix cache, where the session's
    next turn finds them; MD counts the room kept and landed. A room released without keep
    while landing is counted cancelled, with its suffix's bytes."""
    md = build_md(16, "mha")
    p = Prefill("mha", 16, md)
    try:
        ids = list(range(5000, 5048))
        reg = md.rank_rooms.register(RegisterRequest(1, ids))
        assert md.rank_rooms.release(ReleaseRequest(1, keep_kv=True)).released is True  # before any KV came
        assert md.table.rooms[1].state.phase.value == "landing_kept"
        p.send(1, ids, reg.cached_tokens, p.pages_for(len(ids), seed=3))
        deadline = time.monotonic() + 20
        while 1 in md.table.rooms and time.monotonic() < deadline:
            md.on_scheduler_iteration()
            time.sleep(0.01)
        assert 1 not in md.table.rooms  # landed, cached and gone
        assert md.ops.match(ids)[0] == 48  # the next turn's prefix is on MD
        counters, per_token = md.rank_rooms.counters, md.rank_rooms.kv_bytes_per_token
        assert counters["rooms_kept_in_flight"] == 1 and counters["rooms_kept_landed"] == 1
        assert counters["kv_bytes_kept_landed"] == 48 * per_token
        assert counters.get("rooms_cancelled_landing", 0) == 0
        other = list(range(6000, 6040))
        md.rank_rooms.register(RegisterRequest(2, other))
        md.rank_rooms.release(ReleaseRequest(2))  # no keep: its KV will not land
        assert counters["rooms_cancelled_landing"] == 1 and counters["kv_bytes_cancelled"] == 40 * per_token
        settle(md)
        assert conserved(md)
    finally:
        close(md, p)


def test_a_room_kept_only_for_the_cache_gives_its_staging_budget_to_a_room_a_request_waits_for():
    """Kept KV comes after the KV a request waits on: a registration that does not fit MD's
    staging budget drops rooms kept only to fill the cache (released with keep_kv) instead of
    being refused; with none to drop it is refused as before."""
    from sglang_pdd.sglang_glue.md.ingest import RoomRefused
    md = build_md(16, "mha")
    try:
        md.rank_rooms.budget.limit_bytes = 8000  # one 3-page room of 128-byte tokens (6144 bytes)
        md.rank_rooms.register(RegisterRequest(1, list(range(7000, 7048))))
        md.rank_rooms.release(ReleaseRequest(1, keep_kv=True))
        reg = md.rank_rooms.register(RegisterRequest(2, list(range(8000, 8040))))  # would not fit beside room 1
        assert reg.room == 2 and 1 not in md.table.rooms
        counters = md.rank_rooms.counters
        assert counters["rooms_kept_dropped_for_room"] == 1 and counters["rooms_cancelled_landing"] == 1
        with pytest.raises(RoomRefused):  # room 2's request still waits for it: nothing to drop
            md.rank_rooms.register(RegisterRequest(3, list(range(9000, 9040))))
        assert counters["rooms_refused"] == 1
        md.rank_rooms.release(ReleaseRequest(2))
        settle(md)
        assert conserved(md)
    finally:
        close(md)
