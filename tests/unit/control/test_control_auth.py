"""control_auth: the signature covers method, target, host, time, nonce, length and the body's
hash, all in the head; replays and stale or altered requests are refused (pure, no sockets)."""

import hashlib
import hmac
import re

import pytest

from sglang_pdd.control.auth import (HEADER, ROLE_MD, ROLE_P, AuthError, ControlSigner, ControlVerifier,
                                     derive_control_key)

KEY = b"k" * 32
HOST = "md:18001"


class Clock:
    def __init__(self, t=1_700_000_000.0):
        self.t = t

    def __call__(self):
        return self.t


def signed(method="POST", target="/pdd/rooms", body=b'{"room": 1}', key=KEY, clock=None, host=HOST):
    return ControlSigner(key, clock or Clock()).header(method, target, body, host=host)[HEADER]


def test_a_signed_request_verifies_once():
    clock = Clock()
    v = ControlVerifier(KEY, clock=clock)
    h = signed(clock=clock)
    v.verify("POST", "/pdd/rooms", HOST, h, b'{"room": 1}')
    with pytest.raises(AuthError, match="replayed"):
        v.verify("POST", "/pdd/rooms", HOST, h, b'{"room": 1}')


@pytest.mark.parametrize("method,target,host,body", [
    ("DELETE", "/pdd/rooms", HOST, b'{"room": 1}'),  # another verb
    ("POST", "/pdd/rooms/2/handoff", HOST, b'{"room": 1}'),  # another route / room
    ("POST", "/pdd/rooms?x=1", HOST, b'{"room": 1}'),  # a query added
    ("POST", "/pdd/rooms", "md2:18001", b'{"room": 1}'),  # another server
    ("POST", "/pdd/rooms", HOST, b'{"room": 2}'),  # another body (its hash is in the head)
    ("POST", "/pdd/rooms", HOST, b'{"room": 1} '),  # another length
])
def test_any_change_to_the_request_breaks_the_signature(method, target, host, body):
    clock = Clock()
    with pytest.raises(AuthError, match="bad signature"):
        ControlVerifier(KEY, clock=clock).verify(method, target, host, signed(clock=clock), body)


def test_the_head_is_verified_before_the_body_and_the_body_after():
    """Everything the MAC covers is in the head: a server verifies it with the announced
    length before reading the body, then checks the body against the signed hash."""
    clock = Clock()
    v = ControlVerifier(KEY, clock=clock)
    body = b'{"room": 1}'
    head = v.verify_head("POST", "/pdd/rooms", HOST, len(body), signed(clock=clock))
    assert head.body_sha256 == hashlib.sha256(body).hexdigest()
    v.check_body(head, hashlib.sha256(body).hexdigest())
    with pytest.raises(AuthError, match="not the one signed"):
        v.check_body(head, hashlib.sha256(b'{"room": 2}').hexdigest())
    with pytest.raises(AuthError, match="bad signature"):  # a head announcing another length
        v.verify_head("POST", "/pdd/rooms", HOST, 1 << 24, signed(clock=clock))


def test_the_host_is_compared_in_lower_case():
    clock = Clock()
    ControlVerifier(KEY, clock=clock).verify("GET", "/pdd/stats", "MD:18001", signed("GET", "/pdd/stats", b"",
                                                                                     clock=clock), b"")


def test_wrong_key_and_the_raw_shared_key_are_refused():
    clock = Clock()
    v = ControlVerifier(KEY, clock=clock)
    with pytest.raises(AuthError, match="bad signature"):
        v.verify("POST", "/pdd/rooms", HOST, signed(key=b"x" * 32, clock=clock), b'{"room": 1}')
    # A MAC made with the shared key itself (e.g. lifted from another protocol) is no control signature.
    ts, nonce, digest = "1700000000", "ab" * 16, hashlib.sha256(b"").hexdigest()
    msg = "\n".join(("pdd-control-v2", "GET", "/pdd/stats", HOST, ts, nonce, "0", digest))
    raw = hmac.new(KEY, msg.encode(), hashlib.sha256).hexdigest()
    with pytest.raises(AuthError, match="bad signature"):
        v.verify("GET", "/pdd/stats", HOST, f"PDD-HMAC-SHA256 v=2,ts={ts},nonce={nonce},body={digest},sig={raw}", b"")


def test_a_v1_signature_is_refused_naming_the_side_to_upgrade():
    """v1 left Host, length and the body's hash out of the head: a server could not verify
    anything before reading the body. A router still sending it is told to upgrade."""
    header = "PDD-HMAC-SHA256 ts=1700000000,nonce=" + "a" * 32 + ",sig=" + "0" * 64
    with pytest.raises(AuthError, match="v1.*upgrade"):
        ControlVerifier(KEY, clock=Clock()).verify("GET", "/pdd/stats", HOST, header, b"")


def test_stale_or_future_timestamps_are_refused():
    clock = Clock()
    v = ControlVerifier(KEY, window_s=30, clock=clock)
    h = signed(clock=Clock(clock.t - 31))
    with pytest.raises(AuthError, match="window"):
        v.verify("POST", "/pdd/rooms", HOST, h, b'{"room": 1}')
    with pytest.raises(AuthError, match="window"):
        v.verify("POST", "/pdd/rooms", HOST, signed(clock=Clock(clock.t + 31)), b'{"room": 1}')
    v.verify("POST", "/pdd/rooms", HOST, signed(clock=Clock(clock.t - 29)), b'{"room": 1}')


_TAIL = ",nonce=" + "a" * 32 + ",body=" + "0" * 64 + ",sig=" + "0" * 64


@pytest.mark.parametrize("header", [None, "", "Bearer x", "PDD-HMAC-SHA256 v=2,ts=1,nonce=zz,body=00,sig=00",
                                    "PDD-HMAC-SHA256 v=2,ts=-5" + _TAIL, "PDD-HMAC-SHA256 v=3,ts=1700000000" + _TAIL,
                                    "PDD-HMAC-SHA256 v=2,ts=1700000000" + _TAIL + "x"])
def test_missing_or_malformed_headers_say_so(header):
    with pytest.raises(AuthError, match="missing|malformed") as e:
        ControlVerifier(KEY, clock=Clock()).verify("GET", "/pdd/stats", HOST, header, b"")
    assert e.value.status == 401


def test_nonce_cache_is_bounded_and_forgets_only_what_the_window_refuses_anyway():
    clock = Clock()
    v = ControlVerifier(KEY, window_s=10, max_nonces=3, clock=clock)
    signer = ControlSigner(KEY, clock)
    stats = lambda: signer.header("GET", "/pdd/stats", host=HOST)[HEADER]  # noqa: E731
    for _ in range(3):
        v.verify("GET", "/pdd/stats", HOST, stats(), b"")
    with pytest.raises(AuthError, match="retry") as e:  # full of fresh nonces: refuse, never forget one
        v.verify("GET", "/pdd/stats", HOST, stats(), b"")
    assert e.value.status == 503
    old = stats()
    clock.t += 11  # the first three left the window
    v.verify("GET", "/pdd/stats", HOST, stats(), b"")
    with pytest.raises(AuthError, match="window"):  # and what they signed cannot come back
        v.verify("GET", "/pdd/stats", HOST, old, b"")


def test_signer_header_format_and_fresh_nonces():
    signer = ControlSigner(KEY)
    a, b = signer.header("GET", "/x", host=HOST)[HEADER], signer.header("GET", "/x", host=HOST)[HEADER]
    assert re.fullmatch(r"PDD-HMAC-SHA256 v=2,ts=\d+,nonce=[0-9a-f]{32},body=[0-9a-f]{64},sig=[0-9a-f]{64}", a)
    assert a.split("nonce=")[1][:32] != b.split("nonce=")[1][:32]
    # a URL's form: the Host it is sent with is the one signed
    headers = signer.headers("POST", "http://User@MD.example:18001/pdd/rooms?x=1", b"{}")
    assert headers["Host"] == "md.example:18001"
    ControlVerifier(KEY).verify("POST", "/pdd/rooms?x=1", "md.example:18001", headers[HEADER], b"{}")


def test_short_keys_are_refused():
    # Key files are loaded by kv_channel.handshake.load_key (tests/unit/kv_channel/test_key_file.py).
    with pytest.raises(ValueError, match="32"):
        ControlSigner(b"short")
    with pytest.raises(ValueError, match="32"):
        ControlSigner(b"k" * 16)


def test_a_call_signed_for_one_role_does_not_verify_on_the_other():
    """MD's and P's APIs have their own keys (HKDF of the shared key with the role as label):
    a call MD received (or the router signed for MD) cannot be replayed to P, nor the reverse."""
    assert derive_control_key(KEY, ROLE_MD) != derive_control_key(KEY, ROLE_P)
    clock = Clock()
    for signer_role, verifier_role in ((ROLE_MD, ROLE_P), (ROLE_P, ROLE_MD)):
        h = ControlSigner(KEY, clock, role=signer_role).header("GET", "/pdd/stats", b"", host=HOST)[HEADER]
        with pytest.raises(AuthError, match="bad signature"):
            ControlVerifier(KEY, clock=clock, role=verifier_role).verify("GET", "/pdd/stats", HOST, h, b"")
        ControlVerifier(KEY, clock=clock, role=signer_role).verify("GET", "/pdd/stats", HOST, h, b"")
    with pytest.raises(ValueError, match="role"):
        ControlSigner(KEY, role="router->rld")


def test_the_role_keys_are_hkdf_of_the_shared_key():
    """RFC 5869 HKDF-SHA256, salt and info as documented in control_auth (one block)."""
    prk = hmac.new(b"sglang-pdd control plane v2", KEY, hashlib.sha256).digest()
    assert derive_control_key(KEY, ROLE_P) == hmac.new(prk, b"role:router->p\x01", hashlib.sha256).digest()


def test_a_clock_stepped_back_does_not_readmit_a_forgotten_request():
    clock = Clock(1_000.0)
    v = ControlVerifier(KEY, window_s=30, clock=clock)
    first = signed(clock=clock)
    v.verify("POST", "/pdd/rooms", HOST, first, b'{"room": 1}')
    clock.t = 1_031.0  # past the window: the next request forgets the first's nonce
    v.verify("POST", "/pdd/rooms", HOST, signed(clock=clock), b'{"room": 1}')
    clock.t = 1_000.0  # NTP steps the wall clock back: the first is inside the window again
    with pytest.raises(AuthError, match="forgotten"):
        v.verify("POST", "/pdd/rooms", HOST, first, b'{"room": 1}')
    clock.t = 1_032.0
    v.verify("POST", "/pdd/rooms", HOST, signed(clock=clock), b'{"room": 1}')  # fresh requests still pass
