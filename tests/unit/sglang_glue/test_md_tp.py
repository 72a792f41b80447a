"""MD with SGLang ``--tp N``: one MainDrcRuntime per TP rank, each on its own SGLang pool,
allocator and radix tree (CPU), in one process, driven in lockstep like SGLang's scheduler
ranks, over a fake TP group (threads + barrier; the real gloo collectives are tested at the end).
Each MD rank gets its own KV heads from P's real WAN fan-out on its own port (port + rank).

What must hold: every rank registers the same rooms and reserves the same pages, a room
completes only when every rank's receiver has its heads, a failure on one rank fails it on all,
pages go back on all ranks in the same iteration, and the pool-conservation identity holds on
each rank (SGLang's leak check)."""

import threading
from types import SimpleNamespace

import pytest
import torch

from sglang_pdd.protocol import (KvSendersRequest, ReadyReply, ReadyRequest, RegisterRequest,
                                 ReleaseRequest)
from tests.conftest import require_sglang_import
from tests.support.md_runtime import Prefill, make_pool, md_rows, shard_pool
from tests.support.md_tp import PAGE, MdTp

def status_values(cluster, room):
    return [None if s is None else s.value for s in cluster.statuses(room)]


@pytest.mark.parametrize("kind,kv_heads,tp", [
    ("mha", 2, 2),  # one KV head per rank
    ("mha", 4, 2),  # two per rank
    ("mha", 1, 2),  # the head replicated on both ranks: each receives its own copy
    ("mla", 1, 2),  # the latent on every rank: each receives it (N times over the WAN)
])
def test_room_completes_on_every_rank_only_when_every_rank_has_its_heads(kind, kv_heads, tp):
    from sglang_pdd.sglang_glue.plugin import _count_md_held_slots

    c = MdTp(kind, tp, kv_heads)
    try:
        md0, md1 = c.ranks
        assert md1.control is None and md0.control is not None  # the router talks to rank 0 only
        assert md1.receiver.address[1] == md0.receiver.address[1] + 1
        ids = list(range(700, 700 + 3 * PAGE + 5))
        free_before = md0.ops.allocator.available_size()
        reg = c.call(RegisterRequest(1, ids))
        assert reg.tp_size == 2 and reg.cached_tokens == 0
        assert reg.wan_peer == "%s:%d" % md0.receiver.address
        # the same pages reserved on every rank, counted by SGLang's leak check on each
        assert torch.equal(md0.rank_rooms.landings[1].slots, md1.rank_rooms.landings[1].slots)
        assert md0.held_tokens == md1.held_tokens == 4 * PAGE
        for md in c.ranks:
            checker = SimpleNamespace(token_to_kv_pool_allocator=md.ops.allocator)
            assert _count_md_held_slots(lambda ch, ps, uncached=0: uncached, checker, None) == 4 * PAGE
        pages = c.senders[0].pages_for(len(ids), seed=4)
        c.senders[0].send(1, ids, 0, pages)  # rank 0's heads only
        from sglang_pdd.kv_channel.contract import RoomState

        c.step_until(lambda: md0.receiver.poll(1) is RoomState.SUCCESS)
        for _ in range(20):  # rank 0 has all of its KV; rank 1 nothing yet: not ready anywhere
            c.step()
        assert status_values(c, 1) == ["pending", "pending"]
        c.senders[1].send(1, ids, 0, pages)
        c.step_until(lambda: status_values(c, 1)[0] != "pending")
        assert status_values(c, 1) == ["ready", "ready"]  # in the same iteration (step asserts alike)
        assert md0.wait_ready(ReadyRequest(1, 0)) == ReadyReply(1, "ready", "")
        insert_len = len(ids) // PAGE * PAGE
        for r, md in enumerate(c.ranks):  # each rank holds exactly its heads of every token
            want = Prefill.token_rows(SimpleNamespace(pool=shard_pool(c.full, kind, PAGE, c.heads[r]), page_size=PAGE),
                                      pages, 0, insert_len)
            for w, g in zip(want, md_rows(md, ids, 0, insert_len)):
                assert torch.equal(w.view(torch.uint8), g.view(torch.uint8))
        assert c.call(ReleaseRequest(1)).released is True
        c.settle()
        assert md0.ops.allocator.available_size() + md0.ops.tree.evictable_size() == free_before
        # a second turn: the same prefix is cached on every rank
        reg2 = c.call(RegisterRequest(2, ids[:2 * PAGE] + [1, 2, 3]))
        assert reg2.cached_tokens == 2 * PAGE and [md.table.rooms[2].cached_len for md in c.ranks] == [2 * PAGE] * 2
    finally:
        c.close()


def test_a_failure_on_one_rank_fails_the_room_on_every_rank():
    c = MdTp("mha", 2, 2)
    wrong = Prefill("mha", PAGE, c.ranks[1], make_pool("mha", PAGE, seed=3, head_num=2))  # both heads: not rank 1's row
    try:
        md0, md1 = c.ranks
        ids = list(range(40))
        c.call(RegisterRequest(5, ids))
        pages = c.senders[0].pages_for(len(ids), seed=1)
        c.senders[0].send(5, ids, 0, pages)  # rank 0 gets its heads
        wrong.send(5, ids, 0, pages)  # rank 1's sender has the wrong layout: rank 1's receiver fails
        c.step_until(lambda: status_values(c, 5)[0] != "pending")
        assert status_values(c, 5) == ["failed", "failed"]
        assert "layout_mismatch" in md1.table.rooms[5].reason
        assert "a TP rank's WAN slice failed" in md0.table.rooms[5].reason
        assert md0.wait_ready(ReadyRequest(5, 0)).status == "failed"
        assert md0.counters["rooms_failed"] == md1.counters["rooms_failed"] == 1
        c.settle()  # rank 0's received pages go back too, on both ranks together (step asserts alike)
        assert md0.ops.tree.evictable_size() == 0 and md0.ops.match(ids)[0] == 0
    finally:
        wrong.fanout.close()
        c.close()


def test_pages_go_back_only_when_every_ranks_receiver_let_go():
    c = MdTp("mha", 2, 2)
    md0, md1 = c.ranks
    gate = threading.Event()
    slow_release = md1.receiver.release_room

    def release_room(room, timeout=2.0):  # rank 1's receiver still has a writer in the room
        gate.wait(30)
        slow_release(room, timeout)

    md1.receiver.release_room = release_room
    try:
        free_before = md0.ops.allocator.available_size()
        c.call(RegisterRequest(7, list(range(50))))
        held = md0.held_tokens
        assert c.call(ReleaseRequest(7)).released is True  # the router gave up before any KV came
        for _ in range(20):
            c.step()
        assert md0.rank_rooms.pages.releasing[0].outcome is True and md1.rank_rooms.pages.releasing[0].outcome is None
        assert md0.held_tokens == md1.held_tokens == held  # rank 0 let go, rank 1 not: held on both
        gate.set()
        c.settle()
        assert md0.ops.allocator.available_size() == free_before
        assert md0.rank_rooms.pages.releasing == md1.rank_rooms.pages.releasing == []
    finally:
        gate.set()
        c.close()


def test_a_failed_receiver_release_keeps_the_pages_held_on_every_rank():
    c = MdTp("mha", 2, 2)
    md0, md1 = c.ranks

    def release_room(room, timeout=2.0):
        raise RuntimeError("stuck writer")

    md1.receiver.release_room = release_room
    try:
        c.call(RegisterRequest(8, list(range(50))))
        held = md0.held_tokens
        c.call(ReleaseRequest(8))
        c.step_until(lambda: not md0.rank_rooms.pages.releasing)
        for _ in range(5):
            c.step()
        assert md0.held_tokens == md1.held_tokens == held > 0  # lost capacity, allocators still alike
    finally:
        c.close()


def test_a_registration_one_rank_refuses_is_undone_on_every_rank():
    from sglang_pdd.sglang_glue.md.ingest import RoomRefused

    c = MdTp("mha", 2, 2)
    md0, md1 = c.ranks
    try:
        free_before = md0.ops.allocator.available_size()
        # rank 1's receiver still holds room 9 (e.g. an earlier room of that id it is letting go of)
        md1.receiver.register_room(9, md1.ops.layout, 16, lambda *chunk, **kw: None)
        with pytest.raises(RoomRefused, match="another MD TP rank could not register it"):
            c.call(RegisterRequest(9, list(range(30))))
        assert status_values(c, 9) == [None, None]
        c.settle()
        assert md0.ops.allocator.available_size() == free_before
        assert md0.rank_rooms.budget.used_bytes == md1.rank_rooms.budget.used_bytes == 0
        assert md0.counters["rooms_refused"] == 1 and md0.counters["rooms_registered"] == 0
        reg = c.call(RegisterRequest(10, list(range(30))))  # the next one goes through on both
        assert reg.tp_size == 2 and torch.equal(md0.rank_rooms.landings[10].slots, md1.rank_rooms.landings[10].slots)
    finally:
        c.close()


def test_the_p_hosts_the_router_names_reach_every_ranks_receiver():
    """Each MD rank has its own WAN receiver (port + rank): the router's P hosts, posted to rank
    0's control API, become known peers of every one of them."""
    from sglang_pdd.admission import source_of

    c = MdTp("mha", 2, 2)
    try:
        assert c.call(KvSendersRequest(("10.3.0.7", "fd00:1:2:3::9"))).known == 2
        for md in c.ranks:
            policy = md.receiver._acceptor.policy
            assert policy.is_known(source_of("10.3.0.7"), 0) and policy.is_known(source_of("fd00:1:2:3::1"), 0)
            assert not policy.is_known(source_of("10.3.0.8"), 0)
    finally:
        c.close()


def test_expiry_is_rank_zeros_decision_taken_on_every_rank():
    c = MdTp("mha", 2, 2)
    md0, md1 = c.ranks
    try:
        free_before = md0.ops.allocator.available_size()
        for md in c.ranks:
            md.table.ttl_s = 0.3
        c.call(RegisterRequest(11, list(range(50))))
        c.step_until(lambda: 11 not in md0.table.rooms)
        assert 11 not in md1.table.rooms
        c.settle()
        assert md0.ops.allocator.available_size() == free_before
    finally:
        c.close()


def test_single_rank_has_no_collectives():
    from sglang_pdd.sglang_glue.md.tp_sync import SingleRank, tp_sync_of

    assert isinstance(tp_sync_of(SimpleNamespace()), SingleRank)
    assert isinstance(tp_sync_of(SimpleNamespace(tp_group=SimpleNamespace(world_size=1))), SingleRank)
    one = SingleRank()
    assert one.share(1.5, [ReleaseRequest(1)]) == (1.5, [ReleaseRequest(1)])
    assert one.all_min([3, 1]) == [3, 1]


def _gloo_rank(rank, port, out):
    import torch.distributed as dist

    from sglang_pdd.sglang_glue.md.tp_sync import GroupTpSync

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        sync = GroupTpSync(rank, 2, dist.group.WORLD, rank, 0)
        now = 1234.5678901 if rank == 0 else 9.0  # rank 0's clock wins
        out.put((rank, sync.share(now, [RegisterRequest(rank, [1, 2])] if rank == 0 else []),
                 sync.share(now + 1, []), sync.all_min([rank, 5 - rank, 7]), sync.all_min([])))
    finally:
        dist.destroy_process_group()


def test_group_tp_sync_over_real_gloo():
    """The real collectives (rank 0's clock and commands broadcast, a MIN all-reduce) between two
    gloo processes."""
    require_sglang_import()
    import torch.multiprocessing as mp

    from sglang_pdd.launcher.topology import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_gloo_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict((r, rest) for r, *rest in (out.get(timeout=120) for _ in procs))
    finally:
        for p in procs:
            p.join(60)
    for r in range(2):
        assert got[r] == [(1234.5678901, [RegisterRequest(0, [1, 2])]), (1234.5678901 + 1, []), [0, 4, 7], []]
