"""Strict validation of KV frames, and sender identities that cannot collide."""

import dataclasses
import os
import time

import numpy as np
import pytest

from tests.support.kv_raw_stream import RawStream
from sglang_pdd.kv_channel.layout import KvLayout
from sglang_pdd.kv_channel.contract import FailureReason, RoomState
from sglang_pdd.kv_channel.wan_receiver import WanKvReceiver
from sglang_pdd.kv_channel.wan_sender import WanKvSender
from sglang_pdd.kv_channel.wire import (
    Chunk,
    Error,
    MemCommit,
    MemWrite,
    ProtocolError,
    TransferBegin,
    TransferEnd,
    decode_frame,
    encode_frame,
)

KEY = b"validation-test-key-0123456789abcdef"
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def receiver():
    rx = WanKvReceiver(KEY, name="md", idle_timeout=5.0)
    yield rx
    rx.close()


def _sample(cls):
    ints = {f.name: 1 for f in dataclasses.fields(cls) if f.type == "int"}
    other = {f.name: ("" if f.type == "str" else b"") for f in dataclasses.fields(cls) if f.type != "int"}
    return cls(**ints, **other)


@pytest.mark.parametrize("cls", [Chunk, TransferBegin, TransferEnd, MemWrite, MemCommit])
def test_negative_integers_are_refused_by_the_decoder(cls):
    for field in [f.name for f in dataclasses.fields(cls) if f.type == "int"]:
        for bad in (-1, -(2**63)):  # msgpack cannot carry >= 2**64
            msg = dataclasses.replace(_sample(cls), **{field: bad})
            with pytest.raises(ProtocolError, match=rf"{cls.TYPE.name}\.{field}: integer .* out of range"):
                decode_frame(encode_frame(msg))
    assert decode_frame(encode_frame(Error(-1, "protocol", "x")))[0].room == -1  # "about the connection"


def test_negative_layer_start_is_refused_before_any_write(receiver):
    layout = KvLayout(2, 16, 1000)
    dest = np.zeros((2, 2, 1000), np.uint8)
    receiver.register_room(7, layout, 32, dest)
    evil = os.urandom(1000)
    with RawStream(receiver.address, KEY) as s:
        s.send(TransferBegin(7, "", 32, 16, 0, 2, 2, 1000, layout.dtype, 4, b""))
        # layer -1 used to pass validation and land in layer 1 of the destination, uncounted.
        s.send(Chunk(7, 0, -1, 1, 0, 1), evil)
        reply, _ = s.read_message()
        assert isinstance(reply, Error) and reply.reason == FailureReason.PROTOCOL
        assert "CHUNK.layer_start: integer -1 out of range" in reply.detail
    assert receiver.wait(7, 5) == RoomState.FAILED
    assert not dest.any()


def test_two_senders_with_the_same_name_do_not_end_each_others_sessions(receiver):
    """Two P hosts configured alike (same name, e.g. prefill-a-30000) send to one MD."""
    layout = KvLayout(2, 16, 1024)
    for room in (1, 2):
        receiver.register_room(room, layout, 32, bytearray(4096))
    first = WanKvSender(receiver.address, KEY, name="prefill-a-30000", num_streams=2, idle_timeout=5.0)
    second = WanKvSender(receiver.address, KEY, name="prefill-a-30000", num_streams=2, idle_timeout=5.0)
    try:
        assert first.identity != second.identity and first.identity.startswith("prefill-a-30000#")
        x1 = first.begin_transfer(1, layout, 32, 0)
        x1.send_layer(0, bytearray(2048))  # half done: its session is bound to room 1
        deadline = time.monotonic() + 5
        while receiver.poll(1) != RoomState.TRANSFERRING and time.monotonic() < deadline:
            time.sleep(0.01)
        assert second.begin_transfer(2, layout, 32, 0).send_kv(bytearray(4096))
        assert second.wait(2, 5) == RoomState.SUCCESS
        x1.send_layer(1, bytearray(2048))
        x1.finish()
        assert x1.wait(5) == RoomState.SUCCESS, x1.failure_detail
        assert receiver.poll(1) == receiver.poll(2) == RoomState.SUCCESS
        assert receiver.stats()["sessions"] == 2
    finally:
        first.close()
        second.close()
