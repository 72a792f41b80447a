"""Known peers first: who may open one more unauthenticated connection now (pure, no sockets).

Shared by the servers an outsider can reach before proving the key: the KV channels'
acceptor (kv_channel/acceptor.py: the handshake) and the control APIs (control/gate.py: the
signed request head). Each calls ``admit`` when a connection arrives, ``release`` when it
leaves its unauthenticated phase (authenticated, failed or cut off) and ``authenticated``
when it proved the key.

  * one source that is not known (an IPv4 address, or an IPv6 /64: one host commonly holds
    a whole /64) may hold at most ``per_source`` unauthenticated connections;
  * all unknown sources together at most ``max_unauthenticated - reserved``: the
    ``reserved`` slots are for known peers (a P opens several streams, the router many calls);
  * one known source at most ``per_known_source`` (None: no cap of its own): on the control
    servers a source becomes known by one valid call, which a relay on the path could win a
    race to send, so no single known source may hold every slot;
  * known: in the allow-list (``trusted``, from configuration), named by an authenticated
    control call (``announce``: the router tells MD which P hosts send it KV), or (where
    ``known_on_authentication``: the KV acceptors, whose challenge-response handshake cannot
    be replayed) authenticated from that source in the last ``remember_s``. The control
    servers turn that off: a signed call can be replayed by whoever gets it there first.

A flood of keyless connections from a few hosts (or many) then cannot keep a known peer out.
"""

from __future__ import annotations

import collections
import ipaddress
from dataclasses import dataclass
from typing import Iterable, Optional, Union

IpNetwork = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]
MAX_ANNOUNCED = 1024  # networks one announcement may name
# The widest network an announcement may name, per IP version: a host's own (an IPv4 /24, the
# IPv6 /64 a source is counted as). Wider ones, and the unspecified address, would make whole
# swaths of addresses known peers on one key holder's word.
MIN_ANNOUNCED_PREFIX = {4: 24, 6: 64}


def parse_networks(value: Union[str, Iterable[str], None]) -> tuple[IpNetwork, ...]:
    """``"10.0.0.5,10.1.0.0/16,fd00::/8"`` (or a list of such) as networks; ValueError names
    the bad entry."""
    items = value.split(",") if isinstance(value, str) else list(value or ())
    nets = []
    for item in (i.strip() if isinstance(i, str) else i for i in items):
        if not isinstance(item, str):
            raise ValueError(f"not an IP address or network: {item!r}")
        if item:
            try:
                nets.append(ipaddress.ip_network(item, strict=False))
            except ValueError:
                raise ValueError(f"not an IP address or network: {item[:100]!r}") from None
    return tuple(nets)


def check_announced(networks: Iterable[IpNetwork]) -> tuple[IpNetwork, ...]:
    """``networks`` if each may be announced as known peers; ValueError naming the first that
    is a wildcard or wider than MIN_ANNOUNCED_PREFIX."""
    nets = tuple(networks)
    for net in nets:
        widest = MIN_ANNOUNCED_PREFIX[net.version]
        if net.network_address.is_unspecified or net.prefixlen < widest:
            raise ValueError(f"{net} is too wide to name P hosts (a wildcard, or a network wider than "
                             f"/{widest}): name the hosts")
    return nets


def source_of(host: str) -> Union[ipaddress.IPv4Address, ipaddress.IPv6Network]:
    """The unit a per-source limit counts: an IPv4 address (IPv4-mapped IPv6 included), or
    an IPv6 /64 (one host commonly holds a whole /64, so counting addresses would not bound it)."""
    ip = ipaddress.ip_address(host.split("%", 1)[0])
    if ip.version == 6:
        if ip.ipv4_mapped is not None:
            return ip.ipv4_mapped
        return ipaddress.ip_network(f"{ip}/64", strict=False)
    return ip


def _in(source, nets: Iterable[IpNetwork]) -> bool:
    """An IPv6 source (a /64) is in a listed network that overlaps it: one listed address
    of a P's /64 makes that /64 known, as the per-source count treats it as one host."""
    if isinstance(source, ipaddress.IPv6Network):
        return any(net.version == 6 and source.overlaps(net) for net in nets)
    return any(net.version == 4 and source in net for net in nets)


@dataclass(frozen=True)
class AdmissionLimits:
    """Limits on one server's unauthenticated connections (defaults: the KV acceptor's; the
    flag names are those its refusals point the operator to)."""

    max_handshaking: int = 64  # unauthenticated connections, all sources
    per_source: int = 16  # of those, from one unknown source
    reserved: int = 32  # of those, only for known sources
    per_known_source: Optional[int] = None  # of those, from one known source (None: no cap)
    trusted: tuple[IpNetwork, ...] = ()  # allow-list: always known
    # A source that authenticated becomes known (for remember_s): only where authenticating
    # proves the key live (a challenge), not where a captured message could be replayed.
    known_on_authentication: bool = True
    remember_s: float = 24 * 3600.0  # a source that authenticated stays known this long
    max_remembered: int = 4096
    per_source_flag: str = "--pdd-kv-max-handshakes-per-source"
    trusted_flag: str = "--pdd-kv-trusted-sources"
    what: str = "handshakes"

    def __post_init__(self):
        if self.max_handshaking < 1 or self.per_source < 1:
            raise ValueError("max_handshaking and per_source must be >= 1")
        if not 0 <= self.reserved < self.max_handshaking:
            raise ValueError(f"reserved must be in 0..{self.max_handshaking - 1}, got {self.reserved}")
        if self.per_known_source is not None and self.per_known_source < 1:
            raise ValueError(f"per_known_source must be >= 1 (or None), got {self.per_known_source}")


@dataclass(frozen=True)
class Ticket:
    """One admitted connection; handed back to ``AdmissionPolicy.release`` exactly once."""

    source: object
    known: bool


class AdmissionPolicy:
    """Who may start an unauthenticated connection now. Pure (no sockets, no clock of its
    own, no lock: the owner calls it under its own)."""

    def __init__(self, limits: AdmissionLimits = AdmissionLimits()):
        self.limits = limits
        self._in_flight: collections.Counter = collections.Counter()  # unknown source -> connections
        self._known_in_flight: collections.Counter = collections.Counter()  # known source -> connections
        self._unknown = 0  # connections of unknown sources
        self._total = 0
        self._recent: collections.OrderedDict = collections.OrderedDict()  # source -> last auth time
        self._announced: tuple[IpNetwork, ...] = ()

    def announce(self, networks: Iterable[IpNetwork]) -> int:
        """Known from now on, in place of the previous announcement: the sources an
        authenticated control call named (the router's P hosts, on MD). Returns how many."""
        nets = check_announced(networks)
        if len(nets) > MAX_ANNOUNCED:
            raise ValueError(f"at most {MAX_ANNOUNCED} networks, got {len(nets)}")
        self._announced = nets
        return len(nets)

    def is_known(self, source, now: float) -> bool:
        seen = self._recent.get(source)
        if seen is not None:
            if now - seen <= self.limits.remember_s:
                return True
            del self._recent[source]
        if not isinstance(source, (ipaddress.IPv4Address, ipaddress.IPv6Network)):
            return False
        return _in(source, self.limits.trusted) or _in(source, self._announced)

    def admit(self, host: str, now: float) -> tuple[Optional[Ticket], str, str]:
        """(ticket, "", "") if admitted, else (None, why, counter)."""
        lim = self.limits
        try:
            source = source_of(host)
        except ValueError:  # not an IP (e.g. a Unix socket): one source of its own
            source = host
        known = self.is_known(source, now)
        if self._total >= lim.max_handshaking:
            return None, f"{self._total} {lim.what} already in progress", "refused"
        if known:
            if lim.per_known_source is not None and self._known_in_flight[source] >= lim.per_known_source:
                return None, (f"{self._known_in_flight[source]} {lim.what} already in progress from this known "
                              f"source (at most {lim.per_known_source} each)"), "refused_per_source"
            self._known_in_flight[source] += 1
        else:
            if self._in_flight[source] >= lim.per_source:
                return None, (f"{self._in_flight[source]} {lim.what} already in progress from this unknown "
                              f"source ({lim.per_source_flag})"), "refused_per_source"
            if self._unknown >= lim.max_handshaking - lim.reserved:
                return None, (f"{self._unknown} {lim.what} of unknown sources in progress; the other "
                              f"{lim.reserved} are reserved for known peers ({lim.trusted_flag})"), \
                    "refused_unknown"
            self._in_flight[source] += 1
            self._unknown += 1
        self._total += 1
        return Ticket(source, known), "", ""

    def release(self, ticket: Ticket) -> None:
        self._total -= 1
        if not ticket.known:
            self._unknown -= 1
        counts = self._known_in_flight if ticket.known else self._in_flight
        counts[ticket.source] -= 1
        if counts[ticket.source] <= 0:
            del counts[ticket.source]

    def authenticated(self, ticket: Ticket, now: float) -> None:
        """The source proved the key: known from now on (for ``remember_s``), where the
        limits make it so."""
        if not self.limits.known_on_authentication:
            return
        self._recent[ticket.source] = now
        self._recent.move_to_end(ticket.source)
        while len(self._recent) > self.limits.max_remembered:
            self._recent.popitem(last=False)

    def stats(self) -> dict:
        return {"handshaking_unknown": self._unknown, "unknown_sources": len(self._in_flight),
                "known_sources_remembered": len(self._recent), "known_sources_announced": len(self._announced)}
