"""Mutual TLS on the WAN KV channel, selected by --pdd-wan-tls-cert/-key/-ca.

Certificates are made at test time with the openssl CLI: a CA, a leaf for MD (naming
127.0.0.1) and one for P; and a second, unrelated CA whose leaf must be refused.
"""

import shutil
import ssl

import numpy as np
import pytest
from tests.support.pki import make_ca, make_leaf, needs_openssl
from tests.support.waiting import wait_until

from sglang_pdd.config import PddConfig, PddConfigError, validate
from sglang_pdd.kv_channel.layout import KvLayout
from sglang_pdd.kv_channel.contract import FailureReason, RoomState
from sglang_pdd.kv_channel.tls import TlsConfigError, wan_tls_context
from sglang_pdd.kv_channel.wan_receiver import WanKvReceiver
from sglang_pdd.kv_channel.wan_sender import WanKvSender

KEY = b"tls-test-key-0123456789abcdef-0123"
pytestmark = [pytest.mark.timeout(60), needs_openssl]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    make_ca(d, "ca")
    make_ca(d, "rogue-ca")
    return {
        "ca": str(d / "ca.pem"),
        "md": make_leaf(d, "md", "ca", "IP:127.0.0.1,DNS:localhost"),
        "p": make_leaf(d, "p", "ca", "DNS:prefill"),
        "rogue": make_leaf(d, "rogue", "rogue-ca", "DNS:prefill"),
        "rogue_ca": str(d / "rogue-ca.pem"),
    }


def _transfer(rx, tx, room):
    layout = KvLayout(2, 16, 4096)
    kv = np.random.default_rng(room).integers(0, 256, (2, 2, 4096), dtype=np.uint8)
    dest = np.zeros_like(kv)
    rx.register_room(room, layout, 32, dest)
    xfer = tx.begin_transfer(room, layout, 32, 0)
    xfer.send_kv(kv)
    return xfer, kv, dest


def test_mutual_tls_transfer_from_the_flags(pki):
    rx = WanKvReceiver(KEY, name="md", ssl_context=wan_tls_context(*pki["md"], pki["ca"], server_side=True))
    tx = WanKvSender(rx.address, KEY, name="p", num_streams=2,
                     ssl_context=wan_tls_context(*pki["p"], pki["ca"], server_side=False))
    try:
        xfer, kv, dest = _transfer(rx, tx, 1)
        assert xfer.wait(10) == RoomState.SUCCESS, xfer.failure_detail
        assert rx.wait(1, 5) == RoomState.SUCCESS and np.array_equal(dest, kv)
    finally:
        tx.close()
        rx.close()


def test_peer_with_a_certificate_from_another_ca_is_refused(pki):
    rx = WanKvReceiver(KEY, name="md", ssl_context=wan_tls_context(*pki["md"], pki["ca"], server_side=True))
    rogue = WanKvSender(rx.address, KEY, name="p", num_streams=1, connect_timeout=2,
                        ssl_context=wan_tls_context(*pki["rogue"], pki["ca"], server_side=False))
    plain = WanKvSender(rx.address, KEY, name="p2", num_streams=1, connect_timeout=2)  # no TLS at all
    try:
        for room, tx in ((2, rogue), (3, plain)):
            xfer, _, dest = _transfer(rx, tx, room)
            assert xfer.wait(10) == RoomState.FAILED
            assert xfer.failure_reason in (FailureReason.CONNECT_FAILED, FailureReason.AUTH)
            assert rx.poll(room) == RoomState.WAITING_FOR_INPUT and not dest.any()
        # The sender can see its failure before the receiver's handshake thread counts it.
        assert wait_until(lambda: rx.stats()["auth_failures"] >= 2), rx.stats()
    finally:
        rogue.close()
        plain.close()
        rx.close()


def test_sender_refuses_a_receiver_it_cannot_verify(pki):
    """P trusts only its CA: an MD with a rogue certificate gets nothing."""
    rx = WanKvReceiver(KEY, name="md",
                       ssl_context=wan_tls_context(*pki["rogue"], pki["rogue_ca"], server_side=True))
    tx = WanKvSender(rx.address, KEY, name="p", num_streams=1, connect_timeout=2,
                     ssl_context=wan_tls_context(*pki["p"], pki["ca"], server_side=False))
    try:
        xfer, _, _ = _transfer(rx, tx, 4)
        assert xfer.wait(10) == RoomState.FAILED and xfer.failure_reason == FailureReason.CONNECT_FAILED
        assert "CERTIFICATE_VERIFY_FAILED" in xfer.failure_detail
    finally:
        tx.close()
        rx.close()


def test_tls_key_readable_by_others_is_refused(pki, tmp_path):
    cert, key = pki["md"]
    loose = tmp_path / "loose.key"
    shutil.copy(key, loose)
    loose.chmod(0o644)
    with pytest.raises(TlsConfigError, match="loose.key has mode 0644"):
        wan_tls_context(cert, str(loose), pki["ca"], server_side=True)
    with pytest.raises(TlsConfigError, match="all three"):
        wan_tls_context(cert, None, None, server_side=True)
    assert wan_tls_context(None, None, None, server_side=True) is None


def test_tls_flags_go_together_and_only_on_wan_roles():
    main = dict(role="main", wan_listen="h:1", control_listen="h:2", wan_key_file="k")
    validate(PddConfig(**main, wan_tls_cert="c", wan_tls_key="k", wan_tls_ca="a"), "null")
    with pytest.raises(PddConfigError, match="missing --pdd-wan-tls-key, --pdd-wan-tls-ca"):
        validate(PddConfig(**main, wan_tls_cert="c"), "null")
    with pytest.raises(PddConfigError, match="apply only to roles prefill and main, not relay"):
        validate(PddConfig(role="relay", wan_tls_cert="c", wan_tls_key="k", wan_tls_ca="a"), "decode", "pdd")
    with pytest.raises(PddConfigError, match="--pdd-wan-tls-ca was given without --pdd-role"):
        validate(PddConfig(wan_tls_ca="a"), "null")


def _contexts(pki, max_version=None):
    server = wan_tls_context(*pki["md"], pki["ca"], server_side=True)
    client = wan_tls_context(*pki["p"], pki["ca"], server_side=False)
    if max_version is not None:
        client.maximum_version = max_version
    return server, client


@pytest.mark.parametrize("version", ["TLSv1.3", "TLSv1.2"])
def test_tls13_streams_are_bound_and_drop_frame_tags_tls12_keeps_them(pki, version):
    """TLS 1.3: the handshake is bound to the TLS connection and frames go untagged (TLS
    authenticates them); TLS 1.2: no binding, frames keep their GMAC tags. Both move KV."""
    import ssl

    server, client = _contexts(pki, None if version == "TLSv1.3" else ssl.TLSVersion.TLSv1_2)
    rx = WanKvReceiver(KEY, name="md", ssl_context=server)
    tx = WanKvSender(rx.address, KEY, name="p", num_streams=2, ssl_context=client)
    try:
        xfer, kv, dest = _transfer(rx, tx, 5)
        assert xfer.wait(10) == RoomState.SUCCESS, xfer.failure_detail
        assert rx.wait(5, 5) == RoomState.SUCCESS and np.array_equal(dest, kv)
        streams = tx._session.streams
        assert all(s.sock.version() == version for s in streams)
        assert all(s.secure.tls_bound == (version == "TLSv1.3") for s in streams)
        assert all((s.secure.send_mac is None) == (version == "TLSv1.3") for s in streams)
    finally:
        tx.close()
        rx.close()


def test_handshake_proofs_do_not_pass_to_another_tls_connection(pki, monkeypatch):
    """A relay that terminates TLS towards each side (with a certificate from the CA) has two
    TLS connections with different bindings: the proofs it relays fail, so it never gets a
    stream whose frames go untagged. Emulated by making the client see another binding."""
    from sglang_pdd.kv_channel import handshake

    real = handshake.tls_binding
    monkeypatch.setattr(handshake, "tls_binding",
                        lambda sock: real(sock) + (b"" if sock.server_side else b"other connection"))
    server, client = _contexts(pki)
    rx = WanKvReceiver(KEY, name="md", ssl_context=server)
    tx = WanKvSender(rx.address, KEY, name="p", num_streams=1, connect_timeout=2, ssl_context=client)
    try:
        xfer, _, dest = _transfer(rx, tx, 6)
        assert xfer.wait(10) == RoomState.FAILED and xfer.failure_reason == FailureReason.AUTH
        assert "failed to prove the shared key on this TLS connection" in xfer.failure_detail
        assert rx.poll(6) == RoomState.WAITING_FOR_INPUT and not dest.any()
    finally:
        tx.close()
        rx.close()


def test_the_tls13_binding_is_the_one_pythons_ssl_offers():
    """RFC 9266 defines ``tls-exporter`` for TLS 1.3 (``tls-unique`` is undefined there). The
    stream binding uses ``tls-unique`` because Python's ssl offers nothing else: no channel
    binding type but it, no keying-material exporter (handshake.tls_binding says why the
    first Finished still binds one TLS 1.3 connection). When this fails, Python offers the
    exporter: switch the binding to it."""
    assert ssl.CHANNEL_BINDING_TYPES == ["tls-unique"]
    assert not any("export" in name or "keying" in name for name in dir(ssl.SSLSocket))
