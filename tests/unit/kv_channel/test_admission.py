"""Known peers first: per-source pre-auth limits and reserved handshake slots of the KV
channels' shared acceptor. The policy alone (no sockets), then the attack in miniature on
real loopback sockets (Linux routes all of 127/8 to lo, so clients bind 127.0.0.x as sources)."""

import ipaddress
import socket
import threading
import time

import pytest
from tests.support.waiting import wait_until

from sglang_pdd.kv_channel.acceptor import (Acceptor, AdmissionLimits, AdmissionPolicy, Slot, parse_networks,
                                            source_of)
from sglang_pdd.kv_channel.layout import KvLayout
from sglang_pdd.kv_channel.contract import RoomState
from sglang_pdd.kv_channel.wan_receiver import WanKvReceiver
from sglang_pdd.kv_channel.wan_sender import WanKvSender

KEY = b"admission-test-key-0123456789abcdef"
pytestmark = pytest.mark.timeout(90)


# ---------------------------------------------------------------------------- the policy


def test_unknown_source_is_capped_per_source_and_others_still_get_in():
    policy = AdmissionPolicy(AdmissionLimits(max_handshaking=10, per_source=2, reserved=0))
    a = [policy.admit("10.0.0.9", 0)[0] for _ in range(2)]
    assert all(a)
    ticket, why, counter = policy.admit("10.0.0.9", 0)
    assert ticket is None and counter == "refused_per_source" and "--pdd-kv-max-handshakes-per-source" in why
    assert policy.admit("10.0.0.10", 0)[0] is not None  # another source is not affected
    policy.release(a[0])
    assert policy.admit("10.0.0.9", 0)[0] is not None  # a finished handshake frees its source's slot


def test_reserved_slots_are_for_known_peers_only():
    limits = AdmissionLimits(max_handshaking=6, per_source=10, reserved=4, trusted=parse_networks("10.1.0.0/16"))
    policy = AdmissionPolicy(limits)
    assert policy.admit("10.0.0.1", 0)[0] and policy.admit("10.0.0.2", 0)[0]  # 6 - 4 = 2 for the unknown
    ticket, why, counter = policy.admit("10.0.0.3", 0)
    assert ticket is None and counter == "refused_unknown" and "--pdd-kv-trusted-sources" in why
    # a trusted source takes the reserved slots, with no per-source cap (P opens several streams)
    known = [policy.admit("10.1.2.3", 0)[0] for _ in range(4)]
    assert all(t is not None and t.known for t in known)
    ticket, _, counter = policy.admit("10.1.2.3", 0)  # the global cap holds for everyone
    assert ticket is None and counter == "refused"
    policy.release(known[0])
    assert policy.admit("10.0.0.3", 0)[0] is None  # a known peer's slot does not go to the unknown
    assert policy.stats()["handshaking_unknown"] == 2


def test_a_known_source_keeps_a_cap_of_its_own_when_one_is_set():
    """``per_known_source`` (the control servers set it): one known source cannot take every
    slot, so other known peers still get in; without it (the KV acceptor) none applies."""
    policy = AdmissionPolicy(AdmissionLimits(max_handshaking=8, per_source=2, reserved=4, per_known_source=3,
                                             trusted=parse_networks("10.1.0.0/16")))
    held = [policy.admit("10.1.0.9", 0)[0] for _ in range(3)]
    assert all(t is not None and t.known for t in held)
    ticket, why, counter = policy.admit("10.1.0.9", 0)
    assert ticket is None and counter == "refused_per_source" and "known source" in why
    assert policy.admit("10.1.0.8", 0)[0] is not None  # another known peer still gets in
    policy.release(held[0])
    assert policy.admit("10.1.0.9", 0)[0] is not None  # released, its slot is its own again
    with pytest.raises(ValueError, match="per_known_source"):
        AdmissionLimits(per_known_source=0)


def test_an_announcement_names_hosts_not_wildcards():
    policy = AdmissionPolicy(AdmissionLimits())
    for wide in ("0.0.0.0/0", "::/0", "0.0.0.0", "10.0.0.0/16", "2001:db8::/48"):
        with pytest.raises(ValueError, match="too wide"):
            policy.announce(parse_networks(["10.9.9.9", wide]))
    assert not policy.is_known(source_of("203.0.113.7"), 0)  # nothing of a refused one is taken
    assert policy.announce(parse_networks(["10.9.9.0/24", "2001:db8:1:2::/64"])) == 2


def test_a_source_that_authenticated_is_known_for_a_while():
    policy = AdmissionPolicy(AdmissionLimits(max_handshaking=4, per_source=1, reserved=2, remember_s=100))
    t = policy.admit("10.0.0.7", 0)[0]
    assert not t.known and policy.admit("10.0.0.7", 0)[0] is None  # per-source cap of 1
    policy.release(t)
    policy.authenticated(t, now=10)
    again = [policy.admit("10.0.0.7", 20)[0] for _ in range(3)]
    assert all(x is not None and x.known for x in again)  # uncapped, into the reserved slots
    for x in again:
        policy.release(x)
    assert policy.admit("10.0.0.7", 111)[0].known is False  # forgotten after remember_s


def test_the_memory_of_authenticated_sources_is_bounded():
    policy = AdmissionPolicy(AdmissionLimits(max_remembered=3))
    for i in range(5):
        t = policy.admit(f"10.0.0.{i}", 0)[0]
        policy.release(t)
        policy.authenticated(t, 0)
    assert policy.stats()["known_sources_remembered"] == 3
    assert not policy.is_known(source_of("10.0.0.0"), 1) and policy.is_known(source_of("10.0.0.4"), 1)


def test_sources_are_ipv4_addresses_or_ipv6_64s():
    assert source_of("::ffff:10.0.0.1") == ipaddress.ip_address("10.0.0.1")
    assert source_of("2001:db8:1:2::1") == source_of("2001:db8:1:2:ffff::9")  # one host's /64
    assert source_of("2001:db8:1:2::1") != source_of("2001:db8:1:3::1")
    policy = AdmissionPolicy(AdmissionLimits(per_source=1, trusted=parse_networks("2001:db8:9::/48")))
    assert policy.admit("2001:db8:1:2::1", 0)[0] and policy.admit("2001:db8:1:2::2", 0)[0] is None
    assert policy.admit("2001:db8:9:1::1", 0)[0].known and policy.admit("2001:db8:9:1::2", 0)[0].known


def test_limits_and_networks_are_validated():
    assert parse_networks(" 10.0.0.5, 10.1.0.0/16 ,,fd00::/8") == (
        ipaddress.ip_network("10.0.0.5/32"), ipaddress.ip_network("10.1.0.0/16"), ipaddress.ip_network("fd00::/8"))
    with pytest.raises(ValueError, match="'10.0.0.300'"):
        parse_networks("10.0.0.300")
    with pytest.raises(ValueError, match="reserved"):
        AdmissionLimits(max_handshaking=8, reserved=8)
    with pytest.raises(ValueError):
        AdmissionLimits(per_source=0)


# ---------------------------------------------------------------------------- real sockets


class Flood:
    """Keyless sockets from the given source addresses that never send a byte and reconnect
    as soon as the server cuts them (refused, or the handshake deadline)."""

    def __init__(self, address, sources, per_source):
        self.address, self.stop = address, threading.Event()
        self.connects = 0
        self.threads = [threading.Thread(target=self._one, args=(src,), daemon=True)
                        for src in sources for _ in range(per_source)]
        for t in self.threads:
            t.start()

    def _one(self, source):
        while not self.stop.is_set():
            try:
                sock = socket.create_connection(self.address, timeout=5, source_address=(source, 0))
            except OSError:
                time.sleep(0.01)
                continue
            self.connects += 1
            sock.settimeout(0.1)
            while not self.stop.is_set():
                try:
                    if sock.recv(100) == b"":
                        break
                except socket.timeout:
                    continue
                except OSError:
                    break
            sock.close()

    def close(self):
        self.stop.set()
        for t in self.threads:
            t.join(5)


ATTACKERS = [f"127.0.0.{i}" for i in range(2, 8)]  # 6 sources x 4 sockets = 24 keyless sockets


def transfer(rx, room, name="p", streams=4, timeout=10):
    layout = KvLayout(2, 16, 1024)
    tx = WanKvSender(rx.address, KEY, name=name, num_streams=streams)
    try:
        rx.register_room(room, layout, 64, bytearray(2 * 4 * 1024))
        handle = tx.begin_transfer(room, layout, 64, 0)
        handle.send_kv(bytearray(2 * 4 * 1024))
        return handle.wait(timeout)
    finally:
        tx.close()


def test_reconnecting_keyless_flood_does_not_keep_a_trusted_p_out():
    """The attack shape: keyless sockets from a few hosts that reconnect when cut. Without
    the policy (one pool, no per-source cap) they hold every handshake slot and P is
    refused; with it each source holds at most ``per_source``, the unknown together at most
    ``max_handshaking - reserved``, and P (allow-listed) authenticates and delivers its KV."""
    flat = AdmissionLimits(max_handshaking=16, per_source=16, reserved=0)
    rx = WanKvReceiver(KEY, name="md-flat", handshake_timeout=30, admission=flat)
    flood = Flood(rx.address, ATTACKERS, 4)
    try:
        assert wait_until(lambda: rx._acceptor.stats()["handshaking"] == 16, timeout=20)
        assert transfer(rx, 1, timeout=5) == RoomState.FAILED  # the outage this guards against
    finally:
        flood.close()
        rx.close()

    limits = AdmissionLimits(max_handshaking=16, per_source=2, reserved=8, trusted=parse_networks("127.0.0.1"))
    rx = WanKvReceiver(KEY, name="md", handshake_timeout=1.0, admission=limits)
    flood = Flood(rx.address, ATTACKERS, 4)
    try:
        assert wait_until(lambda: rx.stats()["refused_per_source"] > 0 and rx.stats()["refused_unknown"] > 0,
                          timeout=20)
        time.sleep(1.5)  # past one handshake deadline: the flood has been cut off and reconnected
        front = rx._acceptor.stats()
        assert front["handshaking_unknown"] <= 8 and front["handshake_timeouts"] > 0
        for room in (2, 3):
            assert transfer(rx, room) == RoomState.SUCCESS
        stats = rx.stats()
        assert stats["refused"] >= stats["refused_per_source"] + stats["refused_unknown"] > 0
        assert rx._acceptor.stats()["handshaking_unknown"] <= 8
    finally:
        flood.close()
        rx.close()


class Server:
    """An Acceptor whose serve() authenticates peers from ``good`` sources and holds the
    others, silent, until the handshake deadline."""

    def __init__(self, good, **kw):
        self.good, self.release = good, threading.Event()
        self.acceptor = Acceptor(socket.create_server(("127.0.0.1", 0)), self._serve, name="test", **kw)
        self.address = self.acceptor.listener.getsockname()[:2]

    def _serve(self, slot: Slot) -> None:
        if slot.addr[0] in self.good and slot.authenticated():
            slot.sock.sendall(b"ok")
        self.release.wait(30)

    def close(self):
        self.release.set()
        self.acceptor.close()


def test_a_peer_that_authenticated_before_gets_a_reserved_slot_during_a_flood():
    """No allow-list: the P at 127.0.0.9 authenticates once before the flood; during it, the
    unknown pool is full, and P's reconnection still gets in."""
    limits = AdmissionLimits(max_handshaking=8, per_source=2, reserved=4)
    server = Server({"127.0.0.9"}, admission=limits, handshake_deadline=30)
    flood = None
    try:
        first = socket.create_connection(server.address, timeout=5, source_address=("127.0.0.9", 0))
        assert first.recv(2) == b"ok"
        first.close()
        flood = Flood(server.address, ATTACKERS, 3)
        assert wait_until(lambda: server.acceptor.stats()["refused_unknown"] > 0, timeout=20)
        newcomer = socket.create_connection(server.address, timeout=5, source_address=("127.0.0.20", 0))
        newcomer.settimeout(5)
        assert newcomer.recv(2) == b""  # unknown and the unknown pool is full: cut at once
        again = [socket.create_connection(server.address, timeout=5, source_address=("127.0.0.9", 0))
                 for _ in range(3)]
        for s in again:
            s.settimeout(5)
            assert s.recv(2) == b"ok"
            s.close()
    finally:
        if flood:
            flood.close()
        server.close()


def test_a_p_the_router_named_is_never_locked_out():
    """The review's attack with the default limits: two attacker addresses hold 16 keyless
    sockets each and fill the 64 - 32 slots left to unknown sources; a P neither allow-listed
    nor authenticated lately (MD just restarted) is refused. Once an authenticated control
    call names P's host (the router tells MD its P hosts), P takes a reserved slot."""
    server = Server({"127.0.0.9"}, admission=AdmissionLimits(), handshake_deadline=30)
    flood = Flood(server.address, ["127.0.0.2", "127.0.0.3"], 17)
    try:
        assert wait_until(lambda: server.acceptor.stats()["handshaking_unknown"] == 32
                          and server.acceptor.stats()["refused_per_source"] > 0, timeout=20)

        def p_gets_in() -> bool:
            with socket.create_connection(server.address, timeout=5, source_address=("127.0.0.9", 0)) as s:
                s.settimeout(5)
                return s.recv(2) == b"ok"

        assert not p_gets_in()  # locked out: the outage this guards against
        assert server.acceptor.announce(parse_networks("127.0.0.9")) == 1
        assert all(p_gets_in() for _ in range(4))
        assert server.acceptor.stats()["handshaking_unknown"] == 32  # the flood keeps what it had, no more
    finally:
        flood.close()
        server.close()


def test_the_router_names_md_the_p_hosts_on_its_receiver():
    """The WAN receiver's side of the announcement: a P named (IPv4 host, IPv6 /64) is known,
    a new announcement replaces the last, and the count shows in MD's stats."""
    rx = WanKvReceiver(KEY, name="md")
    try:
        assert rx.announce_senders(parse_networks("127.0.0.9,2001:db8:1:2::7")) == 2
        policy = rx._acceptor.policy
        assert policy.is_known(source_of("127.0.0.9"), 0) and policy.is_known(source_of("2001:db8:1:2::99"), 0)
        assert rx.stats()["known_sources_announced"] == 2
        rx.announce_senders(parse_networks("10.0.0.1"))
        assert not policy.is_known(source_of("127.0.0.9"), 0) and policy.is_known(source_of("10.0.0.1"), 0)
    finally:
        rx.close()
