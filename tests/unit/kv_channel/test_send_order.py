"""P's WAN send order (kv_channel/send_order.py): waited rooms before kept ones, rooms of a kind
in turns, a room's own items in order."""

from sglang_pdd.kv_channel.send_order import SendOrder


def _drain(order):
    out = []
    while (nxt := order.pop()) is not None:
        out.append(nxt[:2])
    return out


def test_rooms_take_turns_item_by_item_and_keep_their_own_order():
    order = SendOrder()
    for i in range(3):
        order.push("big", f"b{i}", 10)
    order.push("small", "s0", 10)
    assert _drain(order) == [("big", "b0"), ("small", "s0"), ("big", "b1"), ("big", "b2")]
    assert order.queued_bytes == 0 and not order and len(order) == 0


def test_a_kept_room_goes_behind_a_waited_one_queued_after_it():
    """The kept room's whole KV was queued first: a FIFO sends all of it before the waited room's."""
    order = SendOrder()
    for i in range(4):
        order.push("kept", f"k{i}", 100)
    order.pop()  # one chunk already on the wire
    assert order.keep_only("kept") is True and order.keep_only("kept") is False
    order.push("waited", "w0", 10)
    order.push("waited", "w1", 10)
    order.push("kept", "k4", 100)  # later items of a kept room are kept too
    assert (order.waited_bytes, order.kept_bytes) == (20, 400)
    assert _drain(order) == [("waited", "w0"), ("waited", "w1"), ("kept", "k1"), ("kept", "k2"), ("kept", "k3"),
                             ("kept", "k4")]


def test_kept_before_any_item_and_urgent_first():
    order = SendOrder()
    order.keep_only("late")  # the router's mark may come before the room's first chunk
    order.push("late", "l0", 5)
    order.push("w", "w0", 5)
    order.push("w", "abort", urgent=True)
    assert order.is_kept("late") and not order.is_kept("w")
    assert _drain(order) == [("w", "abort"), ("w", "w0"), ("late", "l0")]


def test_forget_drops_a_rooms_items_and_its_mark():
    order = SendOrder()
    order.push("a", "a0", 7)
    order.push("b", "b0", 3)
    order.keep_only("b")
    assert order.forget("b") == ["b0"] and not order.is_kept("b")
    assert order.forget("nothing") == []
    assert (order.waited_bytes, order.kept_bytes) == (7, 0)
    assert _drain(order) == [("a", "a0")]
