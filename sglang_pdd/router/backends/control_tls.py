"""The router's side of mutual TLS on the control plane: ``--control-tls-cert/-key/-ca``.

With them the router calls P's and MD's control APIs (servers started with
``--pdd-control-tls-*``) over HTTPS only, presenting its certificate and verifying each
server's against the CA and against the host of the CONTROL_URL it dials, as P verifies MD on
the WAN (kv_channel/tls.py). Every control URL must then be ``https://``: a plain one would send
prompts in clear beside the encrypted ones, so the router refuses to start instead. The
request and reply signatures (control_auth) stay: TLS adds secrecy, it does not replace them.
"""

from __future__ import annotations

import argparse
import ssl
from typing import Iterable, Optional
from urllib.parse import urlsplit

from sglang_pdd.kv_channel.tls import TlsConfigError, control_tls_context


def add_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("control plane TLS (docs/security.md)")
    g.add_argument("--control-tls-cert", default=None, metavar="PATH",
                   help="the router's client certificate (PEM) for mutual TLS to P's and MD's control APIs "
                        "(servers with --pdd-control-tls-*); give all three --control-tls-* flags or none; "
                        "every CONTROL_URL must then be https://")
    g.add_argument("--control-tls-key", default=None, metavar="PATH",
                   help="the private key (PEM, not readable by group/others) of --control-tls-cert")
    g.add_argument("--control-tls-ca", default=None, metavar="PATH",
                   help="CA certificate(s) (PEM) the control servers' certificates must be signed by; each "
                        "must name the host of its CONTROL_URL")


def control_client_context(args: argparse.Namespace, control_urls: Iterable[str]) -> Optional[ssl.SSLContext]:
    """The client context of ``--control-tls-*`` (None: none of them given), after checking
    that every control URL is https; SystemExit naming the flag, file or URL otherwise."""
    given = {"--control-tls-cert": args.control_tls_cert, "--control-tls-key": args.control_tls_key,
             "--control-tls-ca": args.control_tls_ca}
    missing = [flag for flag, value in given.items() if not value]
    if 0 < len(missing) < len(given):
        raise SystemExit(f"sglang_pdd.router: error: mutual TLS on the control plane needs all of "
                         f"--control-tls-cert/-key/-ca; missing {', '.join(missing)}")
    try:
        ctx = control_tls_context(args.control_tls_cert, args.control_tls_key, args.control_tls_ca,
                                  server_side=False)
    except TlsConfigError as e:
        raise SystemExit(f"sglang_pdd.router: error: {e}") from None
    if ctx is not None:
        plain = [url for url in control_urls if urlsplit(url).scheme != "https"]
        if plain:
            raise SystemExit(f"sglang_pdd.router: error: with --control-tls-* every CONTROL_URL must be https://, "
                             f"got {', '.join(plain)}")
    return ctx
