"""Framing codec, handshake proofs and the chunk plan of the WAN KV channel (no network)."""

import os
import socket
import struct

import msgpack
import pytest

from sglang_pdd.kv_channel.handshake import HandshakeError, client_handshake, server_handshake
from sglang_pdd.kv_channel.layout import KvLayout, TransferPlan
from sglang_pdd.kv_channel.contract import RoomState
from sglang_pdd.kv_channel.wire import (
    MAGIC,
    PREFIX,
    PREFIX_SIZE,
    VERSION,
    Ack,
    Chunk,
    FrameReader,
    Hello,
    MsgType,
    ProtocolError,
    TransferBegin,
    decode_frame,
    encode_frame,
    send_frame,
)


def _begin(**kw):
    fields = dict(room=2**63 - 1, request_id="req-1", num_tokens=1000, page_size=16, first_page=2, end_page=63,
                  num_layers=4, bytes_per_page=4096, dtype="bfloat16", num_chunks=8, token_digest=b"\x01" * 32)
    fields.update(kw)
    return TransferBegin(**fields)


def test_roundtrip_header_and_payload_without_copy():
    payload = bytearray(os.urandom(10_000))
    msg = Chunk(room=5, index=3, layer_start=1, layer_count=1, page_start=2, page_count=7)
    buf = encode_frame(msg, len(payload)) + payload
    decoded, view, used = decode_frame(buf)
    assert decoded == msg and used == len(buf)
    assert bytes(view) == bytes(payload) and isinstance(view, memoryview)
    for m in (_begin(), Ack(1, 42), Hello("p", b"s" * 16, 0, 4, b"n" * 32)):
        assert decode_frame(encode_frame(m))[0] == m


def test_kvpoll_numbering():
    # The SGLang glue maps states with KVPoll(int(state)); keep the numbers identical.
    assert [int(s) for s in (RoomState.FAILED, RoomState.BOOTSTRAPPING, RoomState.WAITING_FOR_INPUT,
                             RoomState.TRANSFERRING, RoomState.SUCCESS)] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    "prefix, match",
    [
        (PREFIX.pack(b"HTTP", VERSION, MsgType.ACK, 0, 4, 0), "bad magic"),
        (PREFIX.pack(MAGIC, 99, MsgType.ACK, 0, 4, 0), "unsupported protocol version 99"),
        (PREFIX.pack(MAGIC, VERSION, 200, 0, 4, 0), "unknown message type 200"),
        (PREFIX.pack(MAGIC, VERSION, MsgType.ACK, 0, 0, 0), "empty header"),
        (PREFIX.pack(MAGIC, VERSION, MsgType.ACK, 0, 10**9, 0), "header of 1000000000 bytes exceeds"),
        (PREFIX.pack(MAGIC, VERSION, MsgType.CHUNK, 0, 8, 2**40), "payload of 1099511627776 bytes exceeds"),
        (PREFIX.pack(MAGIC, VERSION, MsgType.ACK, 0, 8, 10), "unexpected payload"),
    ],
)
def test_bad_prefix_rejected_before_allocating(prefix, match):
    with pytest.raises(ProtocolError, match=match):
        decode_frame(prefix + b"\x00" * 64)


@pytest.mark.parametrize(
    "header, match",
    [
        (b"\xc1", "not valid msgpack"),
        (msgpack.packb([1, 2, 3]), "ACK: header has 3 fields, expected 2"),
        (msgpack.packb({"room": 1}), "header has dict fields, expected 2"),
        (msgpack.packb(["x", 5]), "ACK.room: expected int, got str"),
        (msgpack.packb([True, 5]), "ACK.room: expected int, got bool"),
        (msgpack.packb([-5, 5]), "out of range"),
    ],
)
def test_bad_header_rejected(header, match):
    frame = PREFIX.pack(MAGIC, VERSION, MsgType.ACK, 0, len(header), 0) + header
    with pytest.raises(ProtocolError, match=match):
        decode_frame(frame)


def test_truncated_frame():
    frame = encode_frame(Ack(1, 2))
    with pytest.raises(ProtocolError, match="truncated"):
        decode_frame(frame[:-1])
    with pytest.raises(ProtocolError, match="truncated frame prefix"):
        decode_frame(frame[: PREFIX_SIZE - 1])


def test_frame_reader_streams_payload_into_caller_buffer():
    a, b = socket.socketpair()
    with a, b:
        payload = os.urandom(200_000)
        msg = Chunk(1, 0, 0, 1, 0, 1)
        send_frame(a, msg, memoryview(payload))
        send_frame(a, Ack(1, 2))
        reader = FrameReader(b, max_payload_bytes=1 << 20)
        got, plen = reader.read_message()
        assert got == msg and plen == len(payload)
        dest = bytearray(plen)
        reader.read_payload_into(memoryview(dest))
        assert dest == payload
        assert reader.read_message() == (Ack(1, 2), 0)


def test_frame_reader_enforces_limits():
    a, b = socket.socketpair()
    with a, b:
        send_frame(a, Chunk(1, 0, 0, 1, 0, 1), memoryview(bytes(5000)))
        with pytest.raises(ProtocolError, match="payload of 5000 bytes exceeds limit 4096"):
            FrameReader(b, max_payload_bytes=4096).read_message()


def test_handshake_mutual_and_wrong_key():
    import threading

    def run(key_c, key_s):
        a, b = socket.socketpair()
        out = {}

        def server():
            try:
                out["hello"] = server_handshake(b, key_s, "md", FrameReader(b))
            except Exception as e:  # noqa: BLE001
                out["err"] = e

        t = threading.Thread(target=server)
        t.start()
        try:
            out["server_name"] = client_handshake(a, key_c, "p", b"s" * 16, 0, 1)
        except Exception as e:  # noqa: BLE001
            out["client_err"] = e
        a.close()
        t.join(5)
        b.close()
        return out

    ok = run(b"k" * 32, b"k" * 32)
    assert ok["server_name"].peer_name == "md" and ok["hello"].hello.peer_name == "p"
    bad = run(b"k" * 32, b"x" * 32)
    # The client refuses the server first (the server could not prove the key).
    assert isinstance(bad["client_err"], HandshakeError) and "failed to prove" in str(bad["client_err"])
    assert "hello" not in bad


def test_plan_sends_only_pages_past_decode_prefix():
    lay = KvLayout(num_layers=3, page_size=16, bytes_per_page=1000)
    plan = TransferPlan.build(lay, num_tokens=16 * 10 + 1, decode_prefix_len=16 * 4, max_chunk_bytes=3000)
    assert (plan.first_page, plan.end_page, plan.pages_per_chunk) == (4, 11, 3)
    assert plan.chunks_per_layer == 3 and plan.num_chunks == 9
    assert plan.total_bytes == 3 * 7 * 1000
    specs = [plan.chunk(i) for i in range(plan.num_chunks)]
    assert min(s.page_start for s in specs) == 4
    assert sum(s.nbytes for s in specs) == plan.total_bytes
    assert [(s.layer, s.page_start, s.page_count) for s in plan.chunks_of_layer(1)] == [(1, 4, 3), (1, 7, 3), (1, 10, 1)]
    with pytest.raises(ValueError, match="not a multiple of page_size"):
        TransferPlan.build(lay, 100, 17)
    with pytest.raises(ValueError, match="not in"):
        TransferPlan.build(lay, 100, 112)


def test_prefix_struct_size():
    assert PREFIX_SIZE == 20 and struct.calcsize("!4sBBHIQ") == 20
