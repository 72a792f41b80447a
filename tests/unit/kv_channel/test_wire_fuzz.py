"""Property-based fuzzing of the KV wire decoder and the handshake (hypothesis).

Whatever bytes a peer sends: only the module's own errors come out (ProtocolError and its
IntegrityError, ConnectionClosed, HandshakeError), nothing is allocated beyond the frame caps,
and what is encoded decodes to the same message (tagged or not). Runs in a few seconds.
"""

import dataclasses
import os
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_pdd.kv_channel import wire
from sglang_pdd.kv_channel.handshake import HandshakeError, client_handshake, server_handshake
from sglang_pdd.kv_channel.wire import (
    MAGIC,
    PREFIX,
    PREFIX_SIZE,
    VERSION,
    ConnectionClosed,
    FrameMac,
    FrameReader,
    MsgType,
    ProtocolError,
    decode_frame,
    decode_prefix,
    encode_frame,
)

FUZZ = settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
OWN_ERRORS = (ProtocolError, ConnectionClosed, HandshakeError)
KEY = b"fuzz-key-0123456789abcdef-012345"  # 32 bytes: an AES-256 frame key
SMALL_HEADER, SMALL_PAYLOAD = 1024, 4096


class FakeSock:
    """A socket whose peer sends ``data`` then closes; records what we send."""

    def __init__(self, data: bytes):
        self.data, self.pos, self.sent = data, 0, bytearray()

    def recv_into(self, view, n=0):
        n = min(n or len(view), len(view), len(self.data) - self.pos)
        view[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n

    def sendall(self, b):
        self.sent += bytes(b)


# ----------------------------------------------------------------------------- strategies

_INT = st.integers(min_value=0, max_value=2**64 - 1)
_STR = st.text(max_size=40)
_BYTES = st.binary(max_size=64)


def _message(cls):
    fields = dataclasses.fields(cls)
    kinds = {"int": _INT, "str": _STR, "bytes": _BYTES}
    return st.builds(cls, **{f.name: kinds[f.type] for f in fields})


MESSAGES = st.one_of(*[_message(cls) for cls in wire._BY_TYPE.values()])

# Frames that get past the magic/version check, so the deeper paths are fuzzed too.
PLAUSIBLE = st.builds(
    lambda t, hlen, plen, rest: PREFIX.pack(MAGIC, VERSION, t, 0, hlen, plen) + rest,
    st.sampled_from([int(t) for t in MsgType]),
    st.one_of(st.integers(0, 64), st.integers(0, 2**32 - 1)),
    st.one_of(st.integers(0, 64), st.integers(0, 2**64 - 1)),
    st.binary(max_size=200),
)
ANY_BYTES = st.one_of(st.binary(max_size=300), PLAUSIBLE)


# ----------------------------------------------------------------------------- decoder


@FUZZ
@given(ANY_BYTES)
def test_decode_frame_raises_only_protocol_errors(data):
    try:
        decode_frame(data, SMALL_HEADER, SMALL_PAYLOAD)
    except ProtocolError:
        pass


@FUZZ
@given(st.binary(min_size=PREFIX_SIZE, max_size=PREFIX_SIZE))
def test_prefix_lengths_never_exceed_the_caps(prefix):
    try:
        _, hlen, plen = decode_prefix(prefix, SMALL_HEADER, SMALL_PAYLOAD)
    except ProtocolError:
        return
    assert hlen <= SMALL_HEADER and plen <= SMALL_PAYLOAD


@FUZZ
@given(ANY_BYTES, st.booleans())
def test_reader_on_arbitrary_bytes_stays_within_caps(data, tagged):
    reader = FrameReader(FakeSock(data), SMALL_HEADER, SMALL_PAYLOAD)
    if tagged:
        reader.mac = FrameMac(KEY)
    tracemalloc.start()
    try:
        for _ in range(10):
            _, plen = reader.read_message()
            if plen:
                reader.read_payload()
    except OWN_ERRORS:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    # A prefix may claim 2**64 bytes: nothing near it is ever allocated.
    assert peak < SMALL_HEADER + SMALL_PAYLOAD + 64 * 1024


@FUZZ
@given(MESSAGES, st.binary(max_size=3000))
def test_round_trip_plain_and_tagged(msg, payload):
    payload = payload if msg.TYPE in wire._WITH_PAYLOAD else b""
    frame = encode_frame(msg, len(payload)) + payload
    decoded, view, used = decode_frame(frame)
    assert decoded == msg and bytes(view) == payload and used == len(frame)

    send, recv = FrameMac(KEY), FrameMac(KEY)
    out = bytearray()
    for _ in range(2):  # two frames: the sequence numbers advance on both sides alike
        head = encode_frame(msg, len(payload))
        tag_h, tag_p = send.seal(head, payload or None)
        out += head + tag_h + payload + tag_p
    reader = FrameReader(FakeSock(bytes(out)))
    reader.mac = recv
    for _ in range(2):
        got, plen = reader.read_message()
        assert got == msg and plen == len(payload)
        if plen:
            assert bytes(reader.read_payload()) == payload
    with pytest.raises(ConnectionClosed):
        reader.read_message()


@FUZZ
@given(MESSAGES, st.binary(min_size=1, max_size=500), st.data())
def test_any_altered_bit_of_a_tagged_frame_is_caught(msg, payload, data):
    payload = payload if msg.TYPE in wire._WITH_PAYLOAD else b""
    head = encode_frame(msg, len(payload))
    tag_h, tag_p = FrameMac(KEY).seal(head, payload or None)
    frame = bytearray(head + tag_h + payload + tag_p)
    bit = data.draw(st.integers(0, len(frame) * 8 - 1))
    frame[bit // 8] ^= 1 << (bit % 8)
    reader = FrameReader(FakeSock(bytes(frame)))
    reader.mac = FrameMac(KEY)
    with pytest.raises((ProtocolError, ConnectionClosed)):
        _, plen = reader.read_message()
        if plen:
            reader.read_payload()


# ----------------------------------------------------------------------------- handshake


@FUZZ
@given(st.one_of(ANY_BYTES, st.builds(lambda m, rest: encode_frame(m) + rest, MESSAGES, st.binary(max_size=100))))
def test_server_handshake_on_arbitrary_input(data):
    sock = FakeSock(data)
    try:
        server_handshake(sock, KEY, "md", FrameReader(sock))
    except OWN_ERRORS:
        pass
    else:
        raise AssertionError("a handshake passed without the key")


@FUZZ
@given(st.one_of(ANY_BYTES, st.builds(lambda m, rest: encode_frame(m) + rest, MESSAGES, st.binary(max_size=100))))
def test_client_handshake_on_arbitrary_replies(data):
    try:
        client_handshake(FakeSock(data), KEY, "p", os.urandom(16), 0, 1)
    except OWN_ERRORS:
        pass
    else:
        raise AssertionError("a server without the key was accepted")
