"""Mutual TLS contexts: the WAN KV channel (``--pdd-wan-tls-cert/--pdd-wan-tls-key/--pdd-wan-tls-ca``)
and the control plane (``--pdd-control-tls-*`` on P and MD, ``--control-tls-*`` on the router).

Mutual TLS: MD (receiver) and P (sender) each present a certificate signed by the CA in
``ca`` and require the peer's. P also checks that MD's certificate names the address it
dials (IP or DNS subjectAltName). TLS adds confidentiality; integrity and peer
authentication hold without it too (HMAC handshake and per-frame MACs, handshake.py).
With TLS 1.3 the handshake is bound to the TLS connection and frames drop their own MAC
tags, so TLS replaces their cost instead of adding to it (handshake.py, "TLS-bound streams").
"""

from __future__ import annotations

import ssl
from typing import Optional

from .handshake import KeyFileError, check_private_file


class TlsConfigError(ValueError):
    """A certificate, key or CA file that cannot be used; the message names it."""


def _context(purpose: int, cert: str, key: str, ca: str) -> ssl.SSLContext:
    try:
        check_private_file(key)
    except KeyFileError as e:
        raise TlsConfigError(f"TLS key: {e}") from None
    ctx = ssl.SSLContext(purpose)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = ssl.CERT_REQUIRED
    for what, load in (("certificate/key", lambda: ctx.load_cert_chain(cert, key)),
                       ("CA", lambda: ctx.load_verify_locations(cafile=ca))):
        try:
            load()
        except (OSError, ssl.SSLError) as e:
            files = f"{cert}, {key}" if what != "CA" else ca
            raise TlsConfigError(f"TLS {what} ({files}) cannot be loaded: {e}") from None
    return ctx


def server_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    """MD's side: presents ``cert``, requires a client certificate signed by ``ca``."""
    return _context(ssl.PROTOCOL_TLS_SERVER, cert, key, ca)


def client_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    """P's side: presents ``cert``, requires MD's certificate signed by ``ca`` and naming
    the dialled host (``check_hostname``)."""
    ctx = _context(ssl.PROTOCOL_TLS_CLIENT, cert, key, ca)
    ctx.check_hostname = True
    return ctx


def mutual_tls_context(cert: Optional[str], key: Optional[str], ca: Optional[str], *, server_side: bool,
                       flags: str) -> Optional[ssl.SSLContext]:
    """The context of a set of three TLS flags named ``flags`` (e.g. ``--pdd-wan-tls-*``):
    None when all three are unset, TlsConfigError naming them when only some are."""
    if not (cert or key or ca):
        return None
    if not (cert and key and ca):
        raise TlsConfigError(f"mutual TLS needs a certificate, its key and a CA (all three {flags} flags)")
    return server_context(cert, key, ca) if server_side else client_context(cert, key, ca)


def wan_tls_context(cert: Optional[str], key: Optional[str], ca: Optional[str], *,
                    server_side: bool) -> Optional[ssl.SSLContext]:
    """The context for ``--pdd-wan-tls-*`` (None when TLS is off: all three unset)."""
    return mutual_tls_context(cert, key, ca, server_side=server_side, flags="--pdd-wan-tls-*")


def control_tls_context(cert: Optional[str], key: Optional[str], ca: Optional[str], *,
                        server_side: bool) -> Optional[ssl.SSLContext]:
    """The control plane's: P's and MD's control servers (``--pdd-control-tls-*``, server side:
    a client certificate from ``ca`` required) and the router's client (``--control-tls-*``:
    verifies the server against ``ca`` and that its certificate names the host dialled)."""
    return mutual_tls_context(cert, key, ca, server_side=server_side,
                              flags="--pdd-control-tls-*" if server_side else "--control-tls-*")


def certificate_names(cert: Optional[str]) -> tuple[str, ...]:
    """The DNS names and IP addresses a PEM certificate's subjectAltName lists (the names a
    client that verified it may have dialled); () without a certificate."""
    if not cert:
        return ()
    from cryptography import x509

    try:
        with open(cert, "rb") as f:
            leaf = x509.load_pem_x509_certificate(f.read())
        san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (OSError, ValueError, x509.ExtensionNotFound):
        return ()
    return tuple(n.lower() for n in san.get_values_for_type(x509.DNSName)) + \
        tuple(str(ip) for ip in san.get_values_for_type(x509.IPAddress))


def control_server_names(listen_host: str, extra=(), cert: Optional[str] = None) -> tuple[str, ...]:
    """The names a control server answers to: the --pdd-control-listen host (unless a
    wildcard), its TLS certificate's names (the router verified one of them) and ``extra``
    (--pdd-control-names). Empty: any host (a wildcard bind with none given)."""
    own = () if listen_host in ("", "0.0.0.0", "::") else (listen_host.lower(),)
    return own + tuple(extra) + certificate_names(cert)
