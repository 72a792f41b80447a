"""PddKVSender.bind_request with MD's TP size known per request: a P rank holds a request's
pages for the WAN only if it feeds some rank of that request's MD (an MLA model on P TP 2: rank
1 sends nothing to an MD on TP 1, but feeds rank 1 of an MD on TP 2). Late destinations: every
rank waits for it, and one with nothing to send for its MD TP lets go at once."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.conftest import require_sglang_import
from sglang_pdd.sglang_glue.p.wan_binding import BindingPhase
from sglang_pdd.kv_channel.tp_relayout import TpShard
from sglang_pdd.sglang_glue.p.prefill_control import DestinationBoard
from sglang_pdd.sglang_glue.p.wan_fanout import WanDestination, WanFanout

PEER = ("127.0.0.1", 9000)


class MlaPool:
    def __init__(self):
        self.kv_buffer = [torch.zeros(16, 1, 8, dtype=torch.bfloat16) for _ in range(2)]


@pytest.fixture
def sender_on_rank():
    require_sglang_import()
    from sglang_pdd.sglang_glue.transfer_backend import PddKVSender

    made = []

    def make(rank: int, tp: int = 2):
        fanout = WanFanout(b"k" * 32, f"p-tp{rank}", allowed_peers=[PEER])
        made.append(fanout)
        mgr = SimpleNamespace(wan_fanout=fanout, wan_destinations=DestinationBoard(), tp_shard=TpShard(rank, tp, 1),
                              pdd_config=SimpleNamespace(wan_destination_wait_ms=1000))
        sender = object.__new__(PddKVSender)  # the scheduler's construction is not what is tested here
        sender.kv_mgr, sender.bootstrap_room = mgr, 11
        return sender

    yield make
    for f in made:
        f.close()


def request(**custom):
    return SimpleNamespace(rid="r", origin_input_ids=list(range(5)),
                           sampling_params=SimpleNamespace(custom_params={"pdd_room": 11, **custom}))


@pytest.mark.parametrize("rank,md_tp,holds", [(0, 1, True), (1, 1, False), (0, 2, True), (1, 2, True)])
def test_an_early_destination_holds_pages_only_on_ranks_that_feed_its_md(sender_on_rank, rank, md_tp, holds):
    sender = sender_on_rank(rank)
    sender.bind_request(request(pdd_wan_peer="%s:%d" % PEER, pdd_md_tp=md_tp), MlaPool(), 1)
    if holds:
        assert sender._binding.phase is BindingPhase.DESTINATION_KNOWN and sender._binding.dest == WanDestination(11, PEER, 0, md_tp)
    else:
        assert sender._binding is None  # no WAN leg on this rank


@pytest.mark.parametrize("md_tp,keeps", [(1, False), (2, True)])
def test_a_late_destination_is_awaited_on_every_rank_and_dropped_where_nothing_is_sent(sender_on_rank, md_tp, keeps):
    sender = sender_on_rank(1)
    sender.bind_request(request(pdd_wan_expected=True), MlaPool(), 1)
    # MD's TP size is not known yet: this rank may have to send
    assert sender._binding.phase is BindingPhase.AWAITING_DESTINATION
    sender.kv_mgr.wan_destinations.post(11, WanDestination(11, PEER, 0, md_tp))
    assert sender._binding.live is keeps
    assert (sender._binding.dest is not None) is keeps
    if not keeps:  # let go: the pages are P's again at the next poll, and a repeat is refused (410)
        assert sender.kv_mgr.wan_destinations.stats()["waiting_senders"] == 0
