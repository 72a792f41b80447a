"""P's WAN fan-out into an MD running ``--tp b``: one real WanKvReceiver per MD rank (rank r on
rank 0's port + r), each registered with its own shard's layout, like MD rank r's pool.

P's pools are sharded from one "full" pool the way SGLang shards KV heads (tp_relayout's
kv_heads_of_rank; MLA: every rank the whole latent); what lands on each MD rank must equal that
rank's SGLang shard, byte for byte, with every MD holder of a head fed over the WAN.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from tests.support.waiting import wait_until
import torch

from sglang_pdd.sglang_glue.p.fanout_room import DropReason
from sglang_pdd.kv_channel.contract import FailureReason, RoomState
from sglang_pdd.kv_channel.tp_relayout import TpShard, kv_heads_of_rank
from sglang_pdd.kv_channel.wan_receiver import WanKvReceiver
from sglang_pdd.kv_channel.wan_sender import WanKvSender
from sglang_pdd.sglang_glue.kv_pool_view import kv_layout_of
from sglang_pdd.sglang_glue.p.wan_fanout import WanDestination, WanFanout
from tests.conftest import on_consecutive_ports

KEY = b"k" * 32
LAYERS, DIM, SLOTS = 2, 8, 128


class Pool:
    """SGLang's buffer lists: MHA k_buffer/v_buffer [slots, heads, dim], MLA kv_buffer [slots, 1, dim]."""

    def __init__(self, kind: str, buffers: list[torch.Tensor]):
        if kind == "mha":
            self.k_buffer, self.v_buffer = buffers[:LAYERS], buffers[LAYERS:]
        else:
            self.kv_buffer = buffers
        self.buffers = buffers

    @classmethod
    def full(cls, kind: str, heads: int, seed: int) -> "Pool":
        g = torch.Generator().manual_seed(seed)
        n = 2 * LAYERS if kind == "mha" else LAYERS
        return cls(kind, [torch.randn(SLOTS, heads, DIM, generator=g).bfloat16() for _ in range(n)])

    def shard(self, kind: str, heads: range) -> "Pool":
        """One TP rank's pool: KV heads ``heads`` (SGLang's sharding); MLA: the whole latent."""
        return Pool(kind, [b if kind == "mla" else b[:, heads.start:heads.stop].contiguous() for b in self.buffers])

    def rows(self, slots) -> np.ndarray:
        """[buffers, len(slots), row bytes]: what an MD rank with this pool should hold."""
        idx = torch.as_tensor(np.asarray(slots, dtype=np.int64))
        return np.stack([b.index_select(0, idx).contiguous().view(torch.uint8).view(len(idx), -1).numpy()
                         for b in self.buffers])


def md_ranks(n: int):
    """n WAN receivers on consecutive ports (MD rank r on rank 0's port + r)."""
    return on_consecutive_ports(n, lambda: WanKvReceiver(KEY, "md-tp0", idle_timeout=5.0),
                                lambda rank, port: WanKvReceiver(KEY, f"md-tp{rank}", port=port, idle_timeout=5.0),
                                lambda first: first.address[1])


def p_ranks(kind, heads, p_tp, full, peer, **kw):
    """P's TP ranks: each its own fan-out (its own sender name) and its shard of ``full``."""
    total = 1 if kind == "mla" else heads
    out = []
    for r in range(p_tp):
        fanout = WanFanout(KEY, f"p-tp{r}", timeout_s=10.0, allowed_peers=[peer],
                           sender_factory=lambda addr, r=r: WanKvSender(addr, KEY, f"p-tp{r}", num_streams=2,
                                                                        max_chunk_bytes=256, transfer_timeout=10.0),
                           **kw)
        fanout.attach_pool(full.shard(kind, kv_heads_of_rank(total, p_tp, r)), 1, TpShard(r, p_tp, total))
        out.append(fanout)
    return out


def register(md, kind, heads, full, room, prompt_len, md_prefix=0):
    """Each MD rank expects the room with its own shard's layout; returns their landing buffers."""
    total = 1 if kind == "mla" else heads
    dests = []
    for r, receiver in enumerate(md):
        layout = kv_layout_of(full.shard(kind, kv_heads_of_rank(total, len(md), r)), 1)
        dest = np.zeros((layout.num_layers, prompt_len, layout.bytes_per_page), dtype=np.uint8)
        receiver.register_room(room, layout, prompt_len, dest, decode_prefix_len=md_prefix,
                               token_ids=list(range(prompt_len)), timeout=10.0)
        dests.append(dest)
    return dests




CASES = [("mha", h, a, b) for h in (2, 4) for a in (1, 2) for b in (2, 4)] + \
    [("mla", 1, a, b) for a in (1, 2) for b in (2, 4)]


@pytest.mark.parametrize("kind,heads,p_tp,md_tp", CASES, ids=lambda v: str(v))
def test_every_md_rank_gets_exactly_its_sglang_shard(kind, heads, p_tp, md_tp):
    full = Pool.full(kind, heads, seed=heads * 10 + p_tp + md_tp)
    prompt_len, md_prefix = 23, 5
    slots = np.random.default_rng(md_tp).permutation(SLOTS)[:prompt_len]  # P's ranks allocate alike
    total = 1 if kind == "mla" else heads
    with md_ranks(md_tp) as md:
        fanouts = p_ranks(kind, heads, p_tp, full, md[0].address)
        try:
            dests = register(md, kind, heads, full, 3, prompt_len, md_prefix)
            dest = WanDestination(3, md[0].address, md_prefix, md_tp)
            rooms = []
            for fanout in fanouts:
                if not fanout.sends_to(md_tp):
                    assert fanout.open_room(dest, rid="r", token_ids=range(prompt_len), first_offered_page=0) is None
                    continue
                room = fanout.open_room(dest, rid="r", token_ids=list(range(prompt_len)), first_offered_page=0)
                for lo in range(0, prompt_len, 10):  # chunked prefill
                    fanout.offer(room, slots[lo:lo + 10], last=lo + 10 >= prompt_len)
                rooms.append((fanout, room))
            # every MD rank is fed over the WAN (no copies between MD's ranks), each by one share per P rank
            fed = [share.spec.md_rank for _, room in rooms for share in room.shares]
            assert sorted(set(fed)) == list(range(md_tp))
            assert all(len({share.spec.md_rank for share in room.shares}) == len(room.shares) for _, room in rooms)
            for fanout, room in rooms:
                assert wait_until(lambda: fanout.may_free_pages(room))
            for r, receiver in enumerate(md):
                assert wait_until(lambda: receiver.poll(3).is_terminal) and receiver.poll(3) is RoomState.SUCCESS, r
                want = full.shard(kind, kv_heads_of_rank(total, md_tp, r)).rows(slots)
                assert np.array_equal(dests[r][:, md_prefix:], want[:, md_prefix:]), f"MD rank {r}"
                assert not dests[r][:, :md_prefix].any()  # MD's cached prefix never crossed the WAN
            for fanout, _ in rooms:
                assert wait_until(lambda: fanout.stats()["staged_bytes"] == 0)
                assert fanout.stats()["finished"] == 1
        finally:
            for f in fanouts:
                f.close()


def test_one_md_rank_failing_fails_the_room_on_p_and_every_other_rank():
    """MD rank 1 of 2 refuses the room (its layout differs): P's room fails as a whole, MD rank 0's
    room is aborted too (it would never be usable alone), and P frees its pages and copies."""
    kind, heads = "mha", 2
    full = Pool.full(kind, heads, seed=1)
    prompt_len = 40
    with md_ranks(2) as md:
        (fanout,) = p_ranks(kind, heads, 1, full, md[0].address)
        try:
            # rank 0 as MD TP 2 expects (one head); rank 1 registered with a wrong (two-head) row
            layout0 = kv_layout_of(full.shard(kind, range(0, 1)), 1)
            layout_bad = kv_layout_of(full, 1)
            dest0 = np.zeros((layout0.num_layers, prompt_len, layout0.bytes_per_page), dtype=np.uint8)
            dest1 = np.zeros((layout_bad.num_layers, prompt_len, layout_bad.bytes_per_page), dtype=np.uint8)
            md[0].register_room(4, layout0, prompt_len, dest0, token_ids=list(range(prompt_len)), timeout=10.0)
            md[1].register_room(4, layout_bad, prompt_len, dest1, token_ids=list(range(prompt_len)), timeout=10.0)
            room = fanout.open_room(WanDestination(4, md[0].address, 0, 2), rid="r",
                                    token_ids=list(range(prompt_len)), first_offered_page=0)
            assert [share.peer for share in room.shares] == [md[0].address, md[1].address]
            fanout.offer(room, np.arange(20))  # prefill still running when MD rank 1 says no
            assert wait_until(lambda: room.state.dropped)
            assert (room.state.reason, room.state.share_failure) == (DropReason.SHARE_FAILED,
                                                                   FailureReason.LAYOUT_MISMATCH)
            fanout.offer(room, np.arange(20, prompt_len), last=True)  # ignored
            assert wait_until(lambda: fanout.may_free_pages(room))  # P frees its pages at once
            for receiver in md:
                assert wait_until(lambda: receiver.poll(4).is_terminal) and receiver.poll(4) is RoomState.FAILED
            assert wait_until(lambda: fanout.stats()["staged_bytes"] == 0 and fanout.stats()["live_rooms"] == 0)
            assert fanout.stats()["failed"] == 1
        finally:
            fanout.close()


def test_an_unreachable_md_rank_fails_the_whole_room():
    """P (TP 1) feeds both MD ranks; rank 1 is gone: the room fails on P and on MD rank 0."""
    kind, heads = "mha", 4
    full = Pool.full(kind, heads, seed=3)
    with md_ranks(2) as md:
        (fanout,) = p_ranks(kind, heads, 1, full, md[0].address)
        try:
            register(md, kind, heads, full, 5, 30)
            md[1].close()  # MD rank 1's receiver is gone
            room = fanout.open_room(WanDestination(5, md[0].address, 0, 2), rid="r", token_ids=list(range(30)),
                                    first_offered_page=0)
            fanout.offer(room, np.arange(30), last=True)
            assert wait_until(lambda: fanout.may_free_pages(room))  # copies done: P frees its pages
            assert wait_until(lambda: room.state.dropped, timeout=15), fanout.stats()
            assert (room.state.reason, room.state.share_failure) == (DropReason.SHARE_FAILED, FailureReason.CONNECT_FAILED)
            assert fanout.stats()["failed"] == 1
            assert wait_until(lambda: md[0].poll(5).is_terminal) and md[0].poll(5) is RoomState.FAILED
            assert wait_until(lambda: fanout.stats()["staged_bytes"] == 0 and fanout.stats()["live_rooms"] == 0)
        finally:
            fanout.close()


def test_md_tp_1_keeps_one_whole_row_share():
    full = Pool.full("mha", 2, seed=4)
    with md_ranks(1) as md:
        (fanout,) = p_ranks("mha", 2, 1, full, md[0].address)
        try:
            register(md, "mha", 2, full, 6, 10)
            room = fanout.open_room(WanDestination(6, md[0].address, 0), rid="r", token_ids=list(range(10)),
                                    first_offered_page=0)
            (share,) = room.shares
            assert share.spec.row is None and share.spec.src_row is None and share.peer == md[0].address
        finally:
            fanout.close()


def test_md_tp_that_the_heads_do_not_shard_over_is_refused_by_name(caplog):
    full = Pool.full("mha", 4, seed=5)
    with md_ranks(1) as md:
        (fanout,) = p_ranks("mha", 4, 1, full, md[0].address)
        try:
            assert fanout.sends_to(3)  # so the sender asks, and open_room says why not
            assert fanout.open_room(WanDestination(7, md[0].address, 0, 3), rid="r", token_ids=list(range(10)),
                                    first_offered_page=0) is None
            assert fanout.stats()["refused_md_tp"] == 1
            assert any("TP 3" in r.getMessage() for r in caplog.records)
        finally:
            fanout.close()


def test_md_tp_over_ps_own_bound_is_refused_without_dialing(caplog):
    """--pdd-max-md-tp: a destination naming more MD ranks than P was configured for dials none."""
    full = Pool.full("mha", 4, seed=5)
    with md_ranks(1) as md:
        (fanout,) = p_ranks("mha", 4, 1, full, md[0].address, max_md_tp=2)
        try:
            assert fanout.open_room(WanDestination(7, md[0].address, 0, 4), rid="r", token_ids=list(range(10)),
                                    first_offered_page=0) is None
            assert fanout.stats()["refused_md_tp"] == 1 and fanout._senders == {}
            assert any("--pdd-max-md-tp 2" in r.getMessage() for r in caplog.records)
        finally:
            fanout.close()


@pytest.mark.parametrize("params,match", [
    ({"pdd_md_tp": 0}, "pdd_md_tp must be an integer in 1..64"),
    ({"pdd_md_tp": 65}, "pdd_md_tp must be an integer in 1..64"),
    ({"pdd_md_tp": True}, "pdd_md_tp must be an integer"),
    ({"pdd_md_tp": "2"}, "pdd_md_tp must be an integer"),
    ({"pdd_wan_peer": "127.0.0.1:65535", "pdd_md_tp": 2}, "pdd_md_tp: .*pass 65535"),
])
def test_bad_md_tp_in_custom_params_names_the_field(params, match):
    base = {"pdd_room": 1, "pdd_wan_peer": "127.0.0.1:9000"}
    with pytest.raises(ValueError, match=match):
        WanDestination.from_custom_params({**base, **params})


def test_md_tp_from_custom_params_and_rank_peers():
    dest = WanDestination.from_custom_params({"pdd_room": 1, "pdd_wan_peer": "127.0.0.1:9000", "pdd_md_tp": 4})
    assert dest.md_tp == 4 and [dest.rank_peer(r) for r in range(4)] == [("127.0.0.1", 9000 + r) for r in range(4)]
    assert WanDestination.from_custom_params({"pdd_room": 1, "pdd_wan_peer": "127.0.0.1:9000"}).md_tp == 1
