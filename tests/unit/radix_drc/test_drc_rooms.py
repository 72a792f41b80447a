"""DrcRoomTable on a fake tree: locks held exactly while needed, failures and expiry free them."""

import pytest

from sglang_pdd.radix_drc.rooms import DrcFull, DrcRoomTable, RoomError, RoomStatus


class FakeTree:
    """Prefix store keyed by token tuples; counts live locks per node."""

    def __init__(self, cached=(), full=False):
        self.prefixes = {tuple(cached[:i]) for i in range(len(cached) + 1)}
        self.locks = {}
        self.full = full
        self.ingested = []

    def match(self, ids):
        n = max(i for i in range(len(ids) + 1) if tuple(ids[:i]) in self.prefixes)
        return n, tuple(ids[:n])

    def lock(self, node):
        self.locks[node] = self.locks.get(node, 0) + 1
        return node

    def unlock(self, node):
        assert self.locks.get(node, 0) > 0, "unlock without lock"
        self.locks[node] -= 1

    def ingest(self, ids, prefix_len, prefix_node, staged):
        if self.full:
            raise DrcFull("no slots")
        self.ingested.append((tuple(ids), prefix_len, staged))
        self.prefixes |= {tuple(ids[:i]) for i in range(len(ids) + 1)}
        return tuple(ids)

    def live_locks(self):
        return {n: c for n, c in self.locks.items() if c}


def test_register_locks_matched_prefix_and_reports_cached_len():
    tree = FakeTree(cached=[1, 2, 3, 4])
    rooms = DrcRoomTable(tree)
    entry = rooms.register(7, [1, 2, 3, 9, 9], now=0)
    assert entry.cached_len == 3 and entry.status is RoomStatus.PENDING
    assert tree.live_locks() == {(1, 2, 3): 1}


def test_fully_cached_prompt_still_sends_last_token():
    tree = FakeTree(cached=[1, 2, 3])
    assert DrcRoomTable(tree).register(1, [1, 2, 3], now=0).cached_len == 2


def test_complete_moves_lock_from_prefix_to_whole_prompt():
    tree = FakeTree(cached=[1, 2])
    rooms = DrcRoomTable(tree, ttl_s=10)
    rooms.register(1, [1, 2, 5, 6], now=0)
    entry = rooms.complete(1, kv="kv", now=3)
    assert entry.status is RoomStatus.READY and entry.deadline == 13
    assert tree.ingested == [((1, 2, 5, 6), 2, "kv")]
    assert tree.live_locks() == {(1, 2, 5, 6): 1}
    assert rooms.release(1) and tree.live_locks() == {}
    assert not rooms.release(1)


def test_drc_full_fails_the_room_and_frees_locks():
    tree = FakeTree(cached=[1], full=True)
    rooms = DrcRoomTable(tree)
    rooms.register(1, [1, 2, 3], now=0)
    entry = rooms.complete(1, kv=None, now=1)
    assert entry.status is RoomStatus.FAILED and entry.reason.startswith("drc_full")
    assert tree.live_locks() == {}


def test_wan_failure_frees_prefix_lock():
    tree = FakeTree(cached=[1, 2])
    rooms = DrcRoomTable(tree)
    rooms.register(1, [1, 2, 3], now=0)
    assert rooms.fail(1, "checksum").reason == "checksum"
    assert tree.live_locks() == {}
    with pytest.raises(RoomError, match="failed, not pending"):
        rooms.complete(1, kv=None, now=1)


def test_expiry_releases_pending_and_ready_rooms():
    tree = FakeTree(cached=[1])
    rooms = DrcRoomTable(tree, ttl_s=5)
    rooms.register(1, [1, 2], now=0)
    rooms.register(2, [1, 3], now=0)
    rooms.complete(2, kv=None, now=4)  # ready until 9
    expired = rooms.expire(now=6)
    assert [e.room for e in expired] == [1] and expired[0].reason == "timeout"
    assert tree.live_locks() == {(1, 3): 1}
    assert [e.room for e in rooms.expire(now=9)] == [2]
    assert tree.live_locks() == {} and rooms.rooms == {}


@pytest.mark.parametrize("call,match", [
    (lambda r: r.complete(99, None, 0), "unknown room 99"),
    (lambda r: r.fail(99, "x"), "unknown room 99"),
    (lambda r: r.register(1, [4], 0), "already registered"),
    (lambda r: r.register(5, [], 0), "empty prompt"),
])
def test_bad_calls_raise_and_change_nothing(call, match):
    tree = FakeTree()
    rooms = DrcRoomTable(tree)
    rooms.register(1, [1, 2], now=0)
    before = dict(tree.locks)
    with pytest.raises(RoomError, match=match):
        call(rooms)
    assert tree.locks == before and set(rooms.rooms) == {1}


def test_room_limit_bounds_memory():
    rooms = DrcRoomTable(FakeTree(), max_rooms=2)
    rooms.register(1, [1], 0)
    rooms.register(2, [2], 0)
    with pytest.raises(RoomError, match="too many open rooms"):
        rooms.register(3, [3], 0)


def test_use_cache_false_ignores_the_cached_prefix_and_locks_nothing():
    tree = FakeTree(cached=[1, 2, 3])
    rooms = DrcRoomTable(tree)
    entry = rooms.register(1, [1, 2, 3, 4], now=0, use_cache=False)
    assert entry.cached_len == 0 and tree.live_locks() == {}
    rooms.complete(1, kv="kv", now=1)
    assert tree.ingested == [((1, 2, 3, 4), 0, "kv")]


def test_release_while_kv_in_flight_can_keep_it_for_the_next_turn():
    tree = FakeTree(cached=[1, 2])
    rooms = DrcRoomTable(tree, ttl_s=10)
    rooms.register(1, [1, 2, 5, 6], now=0)
    assert rooms.release(1, keep_pending_kv=True)  # the request ended on RLD first
    assert tree.live_locks() == {(1, 2): 1}  # the matched prefix stays locked until the KV lands
    entry = rooms.complete(1, kv="kv", now=1)
    assert entry.status is RoomStatus.READY and tree.ingested == [((1, 2, 5, 6), 2, "kv")]
    assert tree.live_locks() == {} and 1 not in rooms.rooms  # cached, evictable, room gone
    assert rooms.register(2, [1, 2, 5, 6, 7], now=2).cached_len == 4  # the next turn hits it


def test_kept_room_that_fails_or_expires_goes_away_unlocked():
    tree = FakeTree(cached=[1])
    rooms = DrcRoomTable(tree, ttl_s=10)
    rooms.register(1, [1, 3], now=0)
    rooms.register(2, [1, 4], now=0)
    rooms.release(1, keep_pending_kv=True)
    rooms.release(2, keep_pending_kv=True)
    assert rooms.fail(1, "checksum").status is RoomStatus.FAILED and 1 not in rooms.rooms
    assert [e.room for e in rooms.expire(now=11)] == [2]
    assert tree.live_locks() == {} and rooms.rooms == {}


def test_keep_pending_kv_does_not_hold_a_ready_room():
    tree = FakeTree()
    rooms = DrcRoomTable(tree, ttl_s=10)
    rooms.register(1, [4, 5], now=0)
    rooms.complete(1, kv="kv", now=1)
    assert rooms.release(1, keep_pending_kv=True) and rooms.rooms == {} and tree.live_locks() == {}


def test_final_handoff_is_taken_once_and_only_for_a_ready_room():
    rooms = DrcRoomTable(FakeTree(), ttl_s=10)
    rooms.register(1, [4, 5], now=0)
    with pytest.raises(RoomError, match="stale handoff: room 1 is pending"):
        rooms.hand_off(1)
    rooms.complete(1, kv="kv", now=1)
    assert rooms.hand_off(1).handed_off and rooms.rooms[1].status is RoomStatus.READY
    with pytest.raises(RoomError, match="duplicate handoff for room 1"):
        rooms.hand_off(1)
    with pytest.raises(RoomError, match="stale handoff: room 2 is unknown"):
        rooms.hand_off(2)


def test_wan_outcome_for_a_landed_room_is_refused_and_changes_nothing():
    tree = FakeTree()
    rooms = DrcRoomTable(tree, ttl_s=10)
    rooms.register(1, [4, 5], now=0)
    rooms.complete(1, kv="kv", now=1)
    locks = dict(tree.locks)
    with pytest.raises(RoomError, match="Failed in phase ready"):
        rooms.fail(1, "late")
    with pytest.raises(RoomError, match="ready, not pending"):
        rooms.complete(1, kv="kv", now=2)
    assert rooms.rooms[1].status is RoomStatus.READY and tree.locks == locks and len(tree.ingested) == 1


def test_a_released_room_is_never_opened_again_but_a_refused_registration_may_retry():
    from sglang_pdd.radix_drc.rooms import RoomReleased

    tree = FakeTree(cached=[1, 2])
    rooms = DrcRoomTable(tree, remember_released=2)
    assert rooms.release(5) is False  # the router gave up before the registration came in
    with pytest.raises(RoomReleased):
        rooms.register(5, [1, 2, 3], now=0)
    assert rooms.rooms == {} and tree.live_locks() == {}
    rooms.register(6, [1, 2, 3], now=0)
    assert rooms.unregister(6) is True and tree.live_locks() == {}  # refused further on: undone
    rooms.register(6, [1, 2, 3], now=0)  # and may come again
    rooms.release(6)
    rooms.release(7)
    rooms.release(8)  # only the newest two are remembered
    rooms.register(5, [1, 2, 3], now=0)
    with pytest.raises(RoomReleased):
        rooms.register(8, [1, 2, 3], now=0)


def test_rooms_kept_for_the_cache_are_listed_for_a_flush():
    rooms = DrcRoomTable(FakeTree())
    for room in (1, 2, 3):
        rooms.register(room, [4, 5, 6], now=0)
    rooms.release(1, keep_pending_kv=True)
    rooms.complete(2, kv="kv", now=1)
    rooms.release(2, keep_pending_kv=True)  # landed already: cached and gone
    assert rooms.kept_for_cache() == [1]
