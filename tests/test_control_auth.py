"""control_auth: the signature covers method, target, time, nonce and body; replays and stale
or altered requests are refused (pure, no sockets)."""

import hashlib
import hmac
import re

import pytest

from sglang_pdd.control_auth import HEADER, ROLE_MD, ROLE_P, AuthError, ControlSigner, ControlVerifier, derive_control_key

KEY = b"k" * 32


class Clock:
    def __init__(self, t=1_700_000_000.0):
        self.t = t

    def __call__(self):
        return self.t


def signed(method="POST", target="/pdd/rooms", body=b'{"room": 1}', key=KEY, clock=None):
    return ControlSigner(key, clock or Clock()).header(method, target, body)[HEADER]


def test_a_signed_request_verifies_once():
    clock = Clock()
    v = ControlVerifier(KEY, clock=clock)
    h = signed(clock=clock)
    v.verify("POST", "/pdd/rooms", h, b'{"room": 1}')
    with pytest.raises(AuthError, match="replayed"):
        v.verify("POST", "/pdd/rooms", h, b'{"room": 1}')


@pytest.mark.parametrize("method,target,body", [
    ("DELETE", "/pdd/rooms", b'{"room": 1}'),  # another verb
    ("POST", "/pdd/rooms/2/handoff", b'{"room": 1}'),  # another route / room
    ("POST", "/pdd/rooms?x=1", b'{"room": 1}'),  # a query added
    ("POST", "/pdd/rooms", b'{"room": 2}'),  # another body
])
def test_any_change_to_the_request_breaks_the_signature(method, target, body):
    clock = Clock()
    with pytest.raises(AuthError, match="bad signature"):
        ControlVerifier(KEY, clock=clock).verify(method, target, signed(clock=clock), body)


def test_wrong_key_and_the_raw_shared_key_are_refused():
    clock = Clock()
    v = ControlVerifier(KEY, clock=clock)
    with pytest.raises(AuthError, match="bad signature"):
        v.verify("POST", "/pdd/rooms", signed(key=b"x" * 32, clock=clock), b'{"room": 1}')
    # A MAC made with the shared key itself (e.g. lifted from another protocol) is no control signature.
    ts, nonce = "1700000000", "ab" * 16
    msg = "\n".join(("pdd-control-v1", "GET", "/pdd/stats", ts, nonce, hashlib.sha256(b"").hexdigest()))
    raw = hmac.new(KEY, msg.encode(), hashlib.sha256).hexdigest()
    with pytest.raises(AuthError, match="bad signature"):
        v.verify("GET", "/pdd/stats", f"PDD-HMAC-SHA256 ts={ts},nonce={nonce},sig={raw}", b"")


def test_stale_or_future_timestamps_are_refused():
    clock = Clock()
    v = ControlVerifier(KEY, window_s=30, clock=clock)
    h = signed(clock=Clock(clock.t - 31))
    with pytest.raises(AuthError, match="window"):
        v.verify("POST", "/pdd/rooms", h, b'{"room": 1}')
    with pytest.raises(AuthError, match="window"):
        v.verify("POST", "/pdd/rooms", signed(clock=Clock(clock.t + 31)), b'{"room": 1}')
    v.verify("POST", "/pdd/rooms", signed(clock=Clock(clock.t - 29)), b'{"room": 1}')


@pytest.mark.parametrize("header", [None, "", "Bearer x", "PDD-HMAC-SHA256 ts=1,nonce=zz,sig=00",
                                    "PDD-HMAC-SHA256 ts=-5,nonce=" + "a" * 32 + ",sig=" + "0" * 64,
                                    "PDD-HMAC-SHA256 ts=1700000000,nonce=" + "a" * 32 + ",sig=" + "0" * 64 + "x"])
def test_missing_or_malformed_headers_say_so(header):
    with pytest.raises(AuthError, match="missing|malformed") as e:
        ControlVerifier(KEY, clock=Clock()).verify("GET", "/pdd/stats", header, b"")
    assert e.value.status == 401


def test_nonce_cache_is_bounded_and_forgets_only_what_the_window_refuses_anyway():
    clock = Clock()
    v = ControlVerifier(KEY, window_s=10, max_nonces=3, clock=clock)
    signer = ControlSigner(KEY, clock)
    for _ in range(3):
        v.verify("GET", "/pdd/stats", signer.header("GET", "/pdd/stats")[HEADER], b"")
    with pytest.raises(AuthError, match="retry") as e:  # full of fresh nonces: refuse, never forget one
        v.verify("GET", "/pdd/stats", signer.header("GET", "/pdd/stats")[HEADER], b"")
    assert e.value.status == 503
    old = signer.header("GET", "/pdd/stats")[HEADER]
    clock.t += 11  # the first three left the window
    v.verify("GET", "/pdd/stats", signer.header("GET", "/pdd/stats")[HEADER], b"")
    with pytest.raises(AuthError, match="window"):  # and what they signed cannot come back
        v.verify("GET", "/pdd/stats", old, b"")


def test_signer_header_format_and_fresh_nonces():
    signer = ControlSigner(KEY)
    a, b = signer.header("GET", "/x")[HEADER], signer.header("GET", "/x")[HEADER]
    assert re.fullmatch(r"PDD-HMAC-SHA256 ts=\d+,nonce=[0-9a-f]{32},sig=[0-9a-f]{64}", a)
    assert a.split("nonce=")[1][:32] != b.split("nonce=")[1][:32]


def test_short_keys_are_refused():
    # Key files are loaded by kv_channel.handshake.load_key (tests/kv_channel/test_key_file.py).
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
        h = ControlSigner(KEY, clock, role=signer_role).header("GET", "/pdd/stats", b"")[HEADER]
        with pytest.raises(AuthError, match="bad signature"):
            ControlVerifier(KEY, clock=clock, role=verifier_role).verify("GET", "/pdd/stats", h, b"")
        ControlVerifier(KEY, clock=clock, role=signer_role).verify("GET", "/pdd/stats", h, b"")
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
    v.verify("POST", "/pdd/rooms", first, b'{"room": 1}')
    clock.t = 1_031.0  # past the window: the next request forgets the first's nonce
    v.verify("POST", "/pdd/rooms", signed(clock=clock), b'{"room": 1}')
    clock.t = 1_000.0  # NTP steps the wall clock back: the first is inside the window again
    with pytest.raises(AuthError, match="forgotten"):
        v.verify("POST", "/pdd/rooms", first, b'{"room": 1}')
    clock.t = 1_032.0
    v.verify("POST", "/pdd/rooms", signed(clock=clock), b'{"room": 1}')  # fresh requests still pass
