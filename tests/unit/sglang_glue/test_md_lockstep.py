"""MD's TP votes (md/lockstep.py) and its command queue (md/driver.py), without SGLang or sockets."""

from __future__ import annotations

import queue
import threading

import pytest

from sglang_pdd.kv_channel.contract import RoomState
from sglang_pdd.protocol import ReleaseReply, ReleaseRequest
from sglang_pdd.sglang_glue.md.driver import CommandQueue
from sglang_pdd.sglang_glue.md.lockstep import RegistrationVote, ReleaseVote, RoomVote, agree
from sglang_pdd.sglang_glue.md.tp_sync import SingleRank


class OtherRank:
    """Rank 0 of two; the other rank's flattened votes are given. Records what went on the wire."""
    rank, size = 0, 2

    def __init__(self, theirs):
        self.theirs, self.sent = theirs, []

    def all_min(self, values):
        assert len(values) == len(self.theirs), "the ranks' vote lists must line up"
        self.sent.append(list(values))
        return [min(a, b) for a, b in zip(values, self.theirs)]


def test_room_and_release_votes_read_the_receiver_and_the_release_thread():
    assert RoomVote.of(RoomState.SUCCESS) == RoomVote(landed=True, alive=True)
    assert RoomVote.of(RoomState.TRANSFERRING) == RoomVote(landed=False, alive=True)
    assert RoomVote.of(RoomState.FAILED) == RoomVote(landed=False, alive=False)
    assert ReleaseVote.of(None) == ReleaseVote(let_go=False, ok=True)
    assert ReleaseVote.of(True) == ReleaseVote(let_go=True, ok=True)
    assert ReleaseVote.of(False) == ReleaseVote(let_go=True, ok=False)


def test_one_rank_agrees_with_itself_without_a_collective():
    votes = [RoomVote(True, True), ReleaseVote(False, True), RegistrationVote(False)]
    assert agree(SingleRank(), votes) == votes


def test_a_field_holds_only_if_every_rank_says_so_in_one_collective():
    mine = [RoomVote(landed=True, alive=True), RoomVote(landed=True, alive=True), ReleaseVote(let_go=True, ok=True)]
    # the other rank: room 1 landed too, room 2 failed there, its release still running
    tp = OtherRank([1, 1, 0, 0, 0, 1])
    agreed = agree(tp, mine)
    assert agreed == [RoomVote(True, True), RoomVote(False, False), ReleaseVote(False, True)]
    assert tp.sent == [[1, 1, 1, 1, 1, 1]]  # fields in declaration order, votes in list order


def test_no_votes_no_collective():
    tp = OtherRank([])
    assert agree(tp, []) == [] and tp.sent == []


def test_a_registration_stands_only_where_every_rank_made_it():
    tp = OtherRank([1, 0])
    assert agree(tp, [RegistrationVote(True), RegistrationVote(True)]) == [RegistrationVote(True),
                                                                            RegistrationVote(False)]


def test_commands_reach_the_scheduler_thread_in_order_and_answer_the_caller():
    commands = CommandQueue()
    answers = []
    caller = threading.Thread(target=lambda: answers.append(commands.call(ReleaseRequest(7, keep_kv=True), timeout=5)))
    caller.start()
    taken, futures = [], []
    while not taken:
        taken, futures = commands.take()
    assert taken == [ReleaseRequest(7, keep_kv=True)]
    futures[0].set_result(ReleaseReply(True))
    caller.join(5)
    assert answers == [ReleaseReply(True)] and commands.take() == ([], [])


def test_a_full_queue_refuses_in_time():
    commands = CommandQueue(maxsize=1)
    commands.submit(ReleaseRequest(1))
    with pytest.raises(queue.Full):
        commands.submit(ReleaseRequest(2), timeout=0.05)
