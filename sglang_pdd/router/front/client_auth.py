"""The router's client port as a plain SGLang server's: ``--api-key`` and TLS.

Same flags, same meaning as ``sglang.launch_server`` (sglang/srt/utils/auth.py and its
server-args checks), so a client of SGLang works unchanged against the router:

  * ``--api-key KEY``: every request needs ``Authorization: Bearer KEY`` (scheme
    case-insensitive, constant-time compare), else 401 ``{"error": "Unauthorized"}``;
    exempt, as in SGLang: ``OPTIONS`` and paths starting with ``/health``, ``/ready`` or
    ``/metrics`` (probes and Prometheus without the secret), but ``/health_generate``, which
    runs a request on the backends (one token through P and RLD): SGLang's server exempts it
    too, the router guards it as any request.
  * ``--ssl-certfile`` / ``--ssl-keyfile`` (both or neither) [``--ssl-keyfile-password``]:
    HTTPS on the client port. Stricter than SGLang in one point: the key file must not be
    readable by group/others (as every key file of sglang-pdd).
  * ``--backend-api-key KEY``: the ``--api-key`` of the P, RLD and MD SGLang servers; the
    router sends ``Authorization: Bearer KEY`` on its calls to them (control calls keep
    their own signature header).
  * ``--api-key-file`` / ``--backend-api-key-file``: the same keys read from files that only
    their owner may access (as every key file of sglang-pdd), so that no secret is on the
    command line, which every local user can read (``ps``, ``/proc/PID/cmdline``). A key given
    on the command line still works, with a warning; ``--workers`` hands it (and
    ``--ssl-keyfile-password``) to its workers in their environment, never on their argv.
"""

from __future__ import annotations

import argparse
import hmac
import os
import ssl
from typing import Optional

from aiohttp import web

from sglang_pdd.kv_channel.handshake import KeyFileError, check_private_file, open_private

EXEMPT_PREFIXES = ("/health", "/ready", "/metrics")  # as SGLang's decide_request_auth
GUARDED_PATHS = frozenset({"/health_generate"})  # under an exempt prefix, but it makes the backends work

_backend_api_key: Optional[str] = None
_backend_ssl: Optional[ssl.SSLContext] = None  # --backend-ca-file


def add_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("client port security, as on a plain SGLang server (docs/security.md)")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help="as SGLang's --api-key: clients must send 'Authorization: Bearer KEY' (else 401); "
                        "/health*, /ready* and /metrics* are exempt, as on SGLang, but /health_generate (it runs "
                        "a request on the backends)")
    g.add_argument("--ssl-certfile", default=None, metavar="PATH",
                   help="as SGLang's: certificate (PEM) for HTTPS on --port")
    g.add_argument("--ssl-keyfile", default=None, metavar="PATH",
                   help="as SGLang's: private key (PEM) of --ssl-certfile; must not be readable by group/others")
    g.add_argument("--ssl-keyfile-password", default=None, metavar="PASSWORD",
                   help="as SGLang's: password of an encrypted --ssl-keyfile")
    g.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="file holding --api-key (mode 0600 or tighter): keeps the key off the command line")
    g.add_argument("--backend-api-key", default=None, metavar="KEY",
                   help="the --api-key of the P, RLD and MD servers: sent to them as 'Authorization: Bearer KEY'")
    g.add_argument("--backend-api-key-file", default=None, metavar="PATH",
                   help="file holding --backend-api-key (mode 0600 or tighter): keeps the key off the command line")
    g.add_argument("--backend-ca-file", default=None, metavar="PATH",
                   help="CA certificate(s) (PEM) that https:// P, RLD and MD URLs (SGLang's --ssl-certfile) must be "
                        "signed by, each naming the host dialled; default: the system's trust store")


# Secrets a supervisor (--workers) hands its workers in their environment, never on their argv.
SECRET_ENV = {"api_key": "SGLANG_PDD_ROUTER_API_KEY", "backend_api_key": "SGLANG_PDD_ROUTER_BACKEND_API_KEY",
              "ssl_keyfile_password": "SGLANG_PDD_ROUTER_SSL_KEYFILE_PASSWORD"}
_KEY_FILES = {"api_key": "--api-key-file", "backend_api_key": "--backend-api-key-file"}


def read_secret_file(path: str, flag: str) -> str:
    """The secret in ``path``, refused (SystemExit naming ``flag`` and the file) unless only
    its owner may access it, or if it is empty."""
    try:
        fd = open_private(path)
    except KeyFileError as e:
        raise SystemExit(f"sglang_pdd.router: error: {flag}: {e}") from None
    with os.fdopen(fd, encoding="utf-8", errors="strict") as f:
        try:
            secret = f.read(1 << 16).strip()
        except UnicodeDecodeError:
            raise SystemExit(f"sglang_pdd.router: error: {flag} {path}: not UTF-8 text") from None
    if not secret:
        raise SystemExit(f"sglang_pdd.router: error: {flag} {path} is empty")
    return secret


def resolve_secrets(args: argparse.Namespace, environ=os.environ) -> list[str]:
    """Fills ``args.api_key`` / ``backend_api_key`` / ``ssl_keyfile_password`` from their key
    files, or (a worker) from the supervisor's environment, which it then forgets; returns
    warnings for secrets given on the command line. SystemExit for a key given twice or a
    key file that is not private."""
    warnings = []
    for dest, env in SECRET_ENV.items():
        inherited = environ.pop(env, None)
        if inherited is not None and getattr(args, dest) is None:
            setattr(args, dest, inherited)
        elif getattr(args, dest) is not None:
            flag = "--" + dest.replace("_", "-")
            instead = f"; use {_KEY_FILES[dest]}" if dest in _KEY_FILES else ""
            warnings.append(f"{flag} on the command line is readable by every local user (ps, /proc){instead}")
    for dest, flag in _KEY_FILES.items():
        path = getattr(args, f"{dest}_file", None)
        if path:
            if getattr(args, dest) is not None:
                raise SystemExit(f"sglang_pdd.router: error: give --{dest.replace('_', '-')} or {flag}, not both")
            setattr(args, dest, read_secret_file(path, flag))
    return warnings


def secrets_for_workers(args: argparse.Namespace) -> dict[str, str]:
    """The environment that hands a supervisor's resolved secrets to its workers: those not
    read from a key file (a worker reads that file itself)."""
    return {env: getattr(args, dest) for dest, env in SECRET_ENV.items()
            if getattr(args, dest) is not None and not getattr(args, f"{dest}_file", None)}


def check_bearer(header: Optional[str], key: str) -> bool:
    """SGLang's check: ``Bearer <key>``, scheme in any case, compared in constant time
    (as bytes, so a non-ASCII header is a mismatch, not an error)."""
    scheme, _, given = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        return False
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), key.encode())


def api_key_middleware(key: str):
    @web.middleware
    async def require_api_key(request: web.Request, handler):
        if request.method == "OPTIONS" or (request.path.startswith(EXEMPT_PREFIXES)
                                           and request.path not in GUARDED_PATHS):
            return await handler(request)
        if not check_bearer(request.headers.get("Authorization"), key):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return require_api_key


def install(app: web.Application, api_key: Optional[str]) -> web.Application:
    """Guard ``app`` (before anything else runs) when an API key is set."""
    if api_key:
        app.middlewares.insert(0, api_key_middleware(api_key))
    return app


def ssl_context(args: argparse.Namespace) -> Optional[ssl.SSLContext]:
    """The server context of ``--ssl-certfile/--ssl-keyfile`` (None: plain HTTP), checked as
    SGLang checks them; SystemExit names the flag or file."""
    cert, key, password = args.ssl_certfile, args.ssl_keyfile, args.ssl_keyfile_password
    if bool(cert) != bool(key):
        have, need = ("--ssl-keyfile", "--ssl-certfile") if key else ("--ssl-certfile", "--ssl-keyfile")
        raise SystemExit(f"sglang_pdd.router: error: {have} requires {need} to be specified as well.")
    if not cert:
        if password:
            raise SystemExit("sglang_pdd.router: error: --ssl-keyfile-password has no effect without "
                             "--ssl-certfile and --ssl-keyfile.")
        return None
    for flag, path in (("--ssl-certfile", cert), ("--ssl-keyfile", key)):
        if not os.path.isfile(path):
            raise SystemExit(f"sglang_pdd.router: error: {flag}: file not found: {path!r}")
    try:
        check_private_file(key)
    except KeyFileError as e:
        raise SystemExit(f"sglang_pdd.router: error: --ssl-keyfile: {e}") from None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key, password=password)
    except (OSError, ssl.SSLError) as e:
        raise SystemExit(f"sglang_pdd.router: error: --ssl-certfile/--ssl-keyfile ({cert}, {key}): {e}") from None
    return ctx


def use_backend_api_key(key: Optional[str]) -> None:
    """--backend-api-key: backend sessions made afterwards in this process send it."""
    global _backend_api_key
    _backend_api_key = key or None


def use_backend_ca(path: Optional[str]) -> None:
    """--backend-ca-file: backend sessions made afterwards in this process verify https:// P,
    RLD and MD servers against it (MD across the WAN: the router's aborts, probes and flushes
    reach MD's own port, not only its signed control API). SystemExit naming the file if unusable."""
    global _backend_ssl
    if not path:
        _backend_ssl = None
        return
    try:
        _backend_ssl = ssl.create_default_context(cafile=path)
    except (OSError, ssl.SSLError) as e:
        raise SystemExit(f"sglang_pdd.router: error: --backend-ca-file {path}: {e}") from None
    _backend_ssl.minimum_version = ssl.TLSVersion.TLSv1_2


def backend_ssl() -> Optional[ssl.SSLContext]:
    """The TLS context for https:// backends (None: aiohttp's default, the system's CAs)."""
    return _backend_ssl


def backend_headers() -> dict:
    """Default headers of the router's backend session (a request's own Authorization, e.g.
    a control-plane signature, replaces this one)."""
    return {"Authorization": f"Bearer {_backend_api_key}"} if _backend_api_key else {}
