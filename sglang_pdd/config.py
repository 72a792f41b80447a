"""The --pdd-* server flags: their definition, parsing and validation (pure; no SGLang import).

SGLang's ServerArgs has no plugin fields, so the glue adds these flags to SGLang's parser and
keeps the parsed values on the ServerArgs record as ``_pdd_config`` (an underscore attribute
that survives pickling into scheduler subprocesses). Validation runs at start-up and names the
offending flag, so a misconfigured server never comes up half-PDD.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import NamedTuple, Optional

from sglang_pdd.admission import AdmissionLimits, parse_networks
from sglang_pdd.control.gate import name_authority
from sglang_pdd.protocol import check_md_tp

ROLES = ("prefill", "relay", "main")
TRANSFER_BACKEND = "pdd"  # --disaggregation-transfer-backend of P and RLD
INTRA_DC_TRANSPORTS = ("auto", "mooncake", "tcp")
MD_INGEST_MODES = ("pool", "staged")

# Which SGLang --disaggregation-mode each PDD role runs in. MD is a plain (non-disaggregated)
# server: its KV arrives into its decode-side radix cache over the WAN, and a handoff is an
# extend on top of that cache.
REQUIRED_DISAGG_MODE = {"prefill": "prefill", "relay": "decode", "main": "null"}
DISAGG_ROLES = tuple(role for role, mode in REQUIRED_DISAGG_MODE.items() if mode != "null")  # on the pdd backend


def role_rule() -> str:
    """REQUIRED_DISAGG_MODE in words, for --pdd-role's help (and so docs/flags.md)."""
    first, *rest = DISAGG_ROLES
    modes = [f"{first} needs --disaggregation-mode {REQUIRED_DISAGG_MODE[first]}",
             *(f"{role} --disaggregation-mode {REQUIRED_DISAGG_MODE[role]}" for role in rest)]
    plain = " and ".join(role for role in ROLES if role not in DISAGG_ROLES)
    together = "both" if len(DISAGG_ROLES) == 2 else "all"
    backend = f"--disaggregation-transfer-backend {TRANSFER_BACKEND}"
    return f"{', '.join(modes)} ({together} with {backend}), {plain} neither."


class PddConfigError(ValueError):
    """A --pdd-* flag is missing, malformed or inconsistent; the message names the flag."""


@dataclass(frozen=True)
class PddConfig:
    role: Optional[str] = None  # None: plugin inactive, the server is plain SGLang
    datacenter: str = ""
    wan_listen: Optional[str] = None  # main: HOST:PORT of the WAN KV receiver
    control_listen: Optional[str] = None  # main: MD's room/handoff API; prefill: late WAN destinations
    wan_key_file: Optional[str] = None  # prefill/main (and relay on TCP): shared HMAC key of KV peers
    wan_tls_cert: Optional[str] = None  # prefill/main: this side's certificate (PEM) for TLS on the WAN KV channel
    wan_tls_key: Optional[str] = None  # prefill/main: its private key (PEM, mode 0600)
    wan_tls_ca: Optional[str] = None  # prefill/main: CA that signed the peers' certificates
    control_tls_cert: Optional[str] = None  # prefill/main: the control API's certificate (HTTPS only with it)
    control_tls_key: Optional[str] = None  # prefill/main: its private key (PEM, mode 0600)
    control_tls_ca: Optional[str] = None  # prefill/main: CA that signed the router's client certificate
    control_trusted_sources: Optional[str] = None  # prefill/main: ADDR[/PREFIX],... of the router(s)
    control_names: Optional[str] = None  # prefill/main: further host names the router's CONTROL_URL may use
    wan_streams: int = 4  # prefill: parallel TCP streams per WAN peer
    wan_timeout_s: float = 30.0  # prefill/main: a WAN transfer older than this fails
    wan_staging_mb: int = 1024  # prefill: host copies of KV waiting for the WAN, at most
    intra_dc_transport: str = "auto"  # prefill/relay: engine of the P -> RLD path
    wan_destination_wait_ms: int = 2000  # prefill: how long P keeps KV for a promised late destination
    wan_peers: Optional[str] = None  # prefill: HOST:PORT,... of the MDs' WAN receivers P may send KV to
    max_md_tp: int = 8  # prefill: the largest MD TP size (WAN ports per MD) P sends to
    allow_wildcard_bind: bool = False  # main/prefill: permit 0.0.0.0 / :: in the *-listen flags
    md_staging_mb: int = 0  # main: KV of rooms in flight (reserved pool pages or host staging), at most; 0: a share of MD's KV pool
    md_ingest: str = "pool"  # main: "pool" (write into reserved pages as chunks land) or "staged"
    kv_trusted_sources: Optional[str] = None  # all roles: ADDR[/PREFIX],... of known KV peers (reserved slots)
    kv_max_handshakes_per_source: int = 16  # all roles: pre-auth KV connections from one unknown source
    kv_reserved_handshakes: int = 32  # all roles: of the 64 pre-auth slots, those only known peers may take

    @property
    def active(self) -> bool:
        return self.role is not None


class PddFlag(NamedTuple):
    """One --pdd-* flag: ``roles`` says which servers take it (it heads the flag's --help and is
    the roles column of docs/flags.md); ``kwargs`` go to argparse's add_argument as they are."""
    flag: str
    dest: str
    roles: str
    kwargs: dict


# Kept as data so that the parser, validate() and docs/flags.md (scripts/gen_flags_doc.py) come
# from one table.
FLAGS = [
    PddFlag("--pdd-role", "pdd_role", "all roles", dict(choices=ROLES, default=None,
        help="PDD role of this server: prefill (P, DC A), relay (RLD, decode next to P) or main (MD, decode "
             "in DC B). Omit to run plain SGLang. " + role_rule())),
    PddFlag("--pdd-datacenter", "pdd_datacenter", "all roles", dict(default="", metavar="NAME",
        help="label of this server's datacenter, used in logs and metrics.")),
    PddFlag("--pdd-wan-listen", "pdd_wan_listen", "main (required)", dict(default=None, metavar="HOST:PORT",
        help="where MD accepts KV over the WAN (with --tp N, rank r listens on PORT + r).")),
    PddFlag("--pdd-control-listen", "pdd_control_listen", "main (required), prefill (optional)",
        dict(default=None, metavar="HOST:PORT",
        help="on MD, the control API that the router calls: register a room (returns MD's cached prefix "
             "and locks it), wait until its KV landed, compact handoff, release, DRC stats. On P, where "
             "the router posts a request's WAN destination after starting it, so MD's answer is off the "
             "TTFT path (with --tp N, P rank r listens on PORT + r).")),
    PddFlag("--pdd-wan-key-file", "pdd_wan_key_file",
        "prefill and main (required), relay (required with --pdd-intra-dc-transport tcp)",
        dict(default=None, metavar="PATH",
        help="file holding the shared key (at least 32 bytes, mode 0600: a looser file is refused) that KV "
             "peers authenticate with (HMAC-SHA256 challenge-response); others are refused and logged.")),
    PddFlag("--pdd-wan-tls-cert", "pdd_wan_tls_cert", "prefill and main", dict(default=None, metavar="PATH",
        help="this server's certificate (PEM) for mutual TLS on the WAN KV channel; give all three "
             "--pdd-wan-tls-* flags or none. MD's certificate must name the address P dials. The key "
             "handshake is then bound to the TLS 1.3 connection and TLS authenticates the frames "
             "(without TLS they carry AES-GMAC tags).")),
    PddFlag("--pdd-wan-tls-key", "pdd_wan_tls_key", "prefill and main", dict(default=None, metavar="PATH",
        help="the private key (PEM, not readable by group/others) of --pdd-wan-tls-cert.")),
    PddFlag("--pdd-wan-tls-ca", "pdd_wan_tls_ca", "prefill and main", dict(default=None, metavar="PATH",
        help="CA certificate(s) (PEM) that the WAN peer's certificate must be signed by.")),
    PddFlag("--pdd-control-tls-cert", "pdd_control_tls_cert", "prefill and main, with --pdd-control-listen",
        dict(default=None, metavar="PATH",
        help="certificate (PEM) of the control API (--pdd-control-listen), which then serves HTTPS only and "
             "requires the router's client certificate; give all three --pdd-control-tls-* flags or none. "
             "It must name the host of the router's CONTROL_URL.")),
    PddFlag("--pdd-control-tls-key", "pdd_control_tls_key", "prefill and main, with --pdd-control-listen",
        dict(default=None, metavar="PATH",
        help="the private key (PEM, not readable by group/others) of --pdd-control-tls-cert.")),
    PddFlag("--pdd-control-tls-ca", "pdd_control_tls_ca", "prefill and main, with --pdd-control-listen",
        dict(default=None, metavar="PATH",
        help="CA certificate(s) (PEM) that the router's client certificate must be signed by.")),
    PddFlag("--pdd-control-trusted-sources", "pdd_control_trusted_sources",
        "prefill and main, with --pdd-control-listen", dict(default=None, metavar="ADDR[/PREFIX],...",
        help="the router host(s) calling the control API. Only they take the connection slots reserved "
             "for the router (a quarter of the cap; one listed source at most half the cap), while any other "
             "source holds at most 16 unauthenticated connections, and they read bodies from the whole "
             "budget, so a flood of connections cannot keep them out. A validly signed request makes its "
             "source nothing more (a captured one can be replayed): list the router hosts.")),
    PddFlag("--pdd-control-names", "pdd_control_names", "prefill and main, with --pdd-control-listen",
        dict(default=None, metavar="HOST[:PORT],...",
        help="further names the router's CONTROL_URL may give this control API (a DNS name, a proxy's). A "
             "signed call is served only when its Host is one of this server's names: the "
             "--pdd-control-listen host, its TLS certificate's names, and these. A name without a port "
             "is taken at this server's own port; HOST:PORT names a TCP proxy or load balancer in "
             "front of it that listens on another port (it forwards the Host the router signed, "
             "which names the proxy).")),
    PddFlag("--pdd-wan-streams", "pdd_wan_streams", "prefill only", dict(type=int, default=4, metavar="N",
        help="parallel TCP streams per WAN peer (fills a long fat pipe), 1..64.")),
    PddFlag("--pdd-wan-timeout-s", "pdd_wan_timeout_s", "prefill and main",
        dict(type=float, default=30.0, metavar="S",
        help="a WAN KV transfer not finished within this many seconds fails (RLD then finishes the "
             "request itself).")),
    PddFlag("--pdd-wan-staging-mb", "pdd_wan_staging_mb", "prefill only", dict(type=int, default=1024, metavar="N",
        help="host memory (MB, at least 16) for KV copied out of the pool and waiting for the WAN; a request "
             "that would exceed it skips the WAN (RLD finishes it), P never stalls.")),
    PddFlag("--pdd-wan-destination-wait-ms", "pdd_wan_destination_wait_ms", "prefill only",
        dict(type=int, default=2000, metavar="MS",
        help="how long (0..60000) P keeps a finished request's KV for a WAN destination the router promised "
             "but has not posted yet (then RLD alone finishes it).")),
    PddFlag("--pdd-wan-peers", "pdd_wan_peers", "prefill only", dict(default=None, metavar="HOST:PORT,...",
        help="the MD WAN receivers (--pdd-wan-listen, as the router's --main WAN_ADDR names them) that P may "
             "send KV to. Any other destination, from a request or the control API (403 there), is refused "
             "and RLD finishes the request. Without it P sends no KV over the WAN.")),
    PddFlag("--pdd-max-md-tp", "pdd_max_md_tp", "prefill only", dict(type=int, default=8, metavar="N",
        help="the largest MD TP size P sends KV to (it dials one WAN port per MD rank), at most 64; a "
             "destination naming more is refused and RLD finishes the request.")),
    PddFlag("--pdd-allow-wildcard-bind", "pdd_allow_wildcard_bind", "main and prefill",
        dict(action="store_true", default=False,
        help="allow --pdd-control-listen / --pdd-wan-listen on a wildcard address (0.0.0.0, ::), i.e. on "
             "every interface. Refused without it: name the interface.")),
    PddFlag("--pdd-md-staging-mb", "pdd_md_staging_mb", "main only", dict(type=int, default=0, metavar="N",
        help="KV (MB) of rooms still crossing the WAN that MD holds (reserved pool pages, or host staging with "
             "--pdd-md-ingest staged), at most; a room that does not fit is refused at registration and the "
             "router keeps that request on RLD. Default 0: a quarter of MD's KV pool (the model's KV bytes "
             "per token times the pool's tokens), known once the pool exists.")),
    PddFlag("--pdd-md-ingest", "pdd_md_ingest", "main only", dict(choices=MD_INGEST_MODES, default="pool",
        help="pool (reserve the room's pool pages at registration and write KV into them as it lands, off "
             "the scheduler thread) or staged (host buffer, copied into the pool on the scheduler thread at "
             "completion; the earlier design, for comparison).")),
    PddFlag("--pdd-kv-trusted-sources", "pdd_kv_trusted_sources", "all roles",
        dict(default=None, metavar="ADDR[/PREFIX],...",
        help="the hosts that send this server KV (on MD: the P hosts; on RLD and P, for the TCP engine: the P "
             "and RLD hosts). They take the handshake slots reserved by --pdd-kv-reserved-handshakes, with no "
             "per-source cap, so keyless connection floods cannot keep them out. A source that authenticated "
             "in the last 24 h is treated the same way, and on MD so are the P hosts the router names (its "
             "--prefill URLs' addresses).")),
    PddFlag("--pdd-kv-max-handshakes-per-source", "pdd_kv_max_handshakes_per_source", "all roles",
        dict(type=int, default=16, metavar="N",
        help="most KV connections one source outside --pdd-kv-trusted-sources (an IPv4 address or an IPv6 /64) "
             "may hold before authenticating; more are refused (counted, logged at a rate limit). A new P "
             "opens --pdd-wan-streams connections per P rank at once: raise this, or list P in "
             "--pdd-kv-trusted-sources, when that is more.")),
    PddFlag("--pdd-kv-reserved-handshakes", "pdd_kv_reserved_handshakes", "all roles",
        dict(type=int, default=32, metavar="N",
        help="of the 64 KV connections that may be authenticating at once, how many only known peers "
             "(--pdd-kv-trusted-sources, or recently authenticated) may take (0..63).")),
    PddFlag("--pdd-intra-dc-transport", "pdd_intra_dc_transport", "prefill and relay",
        dict(choices=INTRA_DC_TRANSPORTS, default="auto",
        help="engine of the P -> RLD KV path: mooncake (RDMA; its TCP transport with MC_FORCE_TCP=1), tcp "
             "(sglang-pdd's authenticated TCP engine, host memory), or auto (mooncake if installed, else "
             "tcp). P and RLD must agree.")),
]


def add_pdd_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("PDD (sglang-pdd plugin)")
    for f in FLAGS:
        group.add_argument(f.flag, dest=f.dest, **{**f.kwargs, "help": f"{f.roles}: {f.kwargs['help']}"})


def parse_host_port(flag: str, value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PddConfigError(f"{flag} must be HOST:PORT with a port in 1..65535, got {value!r}")
    return host, int(port)


WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "*", "")


def parse_listen(flag: str, value: str, allow_wildcard: bool = False) -> tuple[str, int]:
    """HOST:PORT to bind; a wildcard host only with --pdd-allow-wildcard-bind."""
    host, port = parse_host_port(flag, value)
    if host in WILDCARD_HOSTS and not allow_wildcard:
        raise PddConfigError(f"{flag} {value} binds every interface; name one (e.g. 10.0.0.5:{port}) or "
                             f"pass --pdd-allow-wildcard-bind")
    return host, port


def parse_peer_list(flag: str, value: str) -> frozenset[tuple[str, int]]:
    """``HOST:PORT,HOST:PORT,...`` as a set of (host, port)."""
    peers = [p.strip() for p in (value or "").split(",") if p.strip()]
    if not peers:
        raise PddConfigError(f"{flag} must list at least one HOST:PORT, got {value!r}")
    return frozenset(parse_host_port(flag, p) for p in peers)


def config_from_namespace(ns: argparse.Namespace) -> PddConfig:
    return PddConfig(**{f.name: getattr(ns, f"pdd_{f.name}") for f in dataclasses.fields(PddConfig)
                        if hasattr(ns, f"pdd_{f.name}")})


def get_pdd_config(server_args) -> PddConfig:
    """The PddConfig a server was started with (inactive default when the flags were not used).
    Here rather than in the glue so that plugin.py and transfer_backend.py both read it from below."""
    return getattr(server_args, "_pdd_config", None) or PddConfig()


def validate(cfg: PddConfig, disaggregation_mode: str, transfer_backend: str = TRANSFER_BACKEND,
             tp_size: int = 1) -> PddConfig:
    """Raise PddConfigError naming the first offending flag; return cfg unchanged if consistent."""
    defaults = PddConfig()
    uses_backend = (disaggregation_mode or "null") != "null" and transfer_backend == TRANSFER_BACKEND
    if uses_backend and cfg.role not in DISAGG_ROLES:
        raise PddConfigError(f"--disaggregation-transfer-backend {TRANSFER_BACKEND} needs --pdd-role prefill (P) "
                             f"or relay (RLD)")
    if not cfg.active:
        for f in FLAGS[1:]:
            name = f.dest[len("pdd_"):]
            if getattr(cfg, name) != getattr(defaults, name):
                raise PddConfigError(f"{f.flag} was given without --pdd-role; set --pdd-role or drop it")
        return cfg
    want_mode = REQUIRED_DISAGG_MODE[cfg.role]
    if (disaggregation_mode or "null") != want_mode:
        need = "no --disaggregation-mode" if want_mode == "null" else f"--disaggregation-mode {want_mode}"
        raise PddConfigError(
            f"--pdd-role {cfg.role} needs {need} (got --disaggregation-mode {disaggregation_mode})")
    if cfg.role in DISAGG_ROLES and not uses_backend:
        raise PddConfigError(f"--pdd-role {cfg.role} needs --disaggregation-transfer-backend {TRANSFER_BACKEND} "
                             f"(got {transfer_backend})")
    if cfg.role == "main":
        if not cfg.wan_listen:
            raise PddConfigError("--pdd-role main needs --pdd-wan-listen HOST:PORT")
        _, wan_port = parse_listen("--pdd-wan-listen", cfg.wan_listen, cfg.allow_wildcard_bind)
        if wan_port + tp_size - 1 > 65535:  # with --tp N, rank r's WAN receiver listens on port + r
            raise PddConfigError(f"--pdd-wan-listen port {wan_port} + {tp_size - 1} (one port per TP rank) "
                                 f"exceeds 65535")
        if not cfg.control_listen:
            raise PddConfigError("--pdd-role main needs --pdd-control-listen HOST:PORT")
        parse_listen("--pdd-control-listen", cfg.control_listen, cfg.allow_wildcard_bind)
    else:
        if cfg.wan_listen:
            raise PddConfigError(f"--pdd-wan-listen applies only to --pdd-role main, not {cfg.role}")
        if cfg.control_listen and cfg.role != "prefill":
            raise PddConfigError(f"--pdd-control-listen applies only to roles main and prefill, not {cfg.role}")
        if cfg.control_listen:
            parse_listen("--pdd-control-listen", cfg.control_listen, cfg.allow_wildcard_bind)
    if cfg.role in ("prefill", "main") and not cfg.wan_key_file:
        raise PddConfigError(f"--pdd-role {cfg.role} needs --pdd-wan-key-file (WAN peers must authenticate)")
    tls = {"--pdd-wan-tls-cert": cfg.wan_tls_cert, "--pdd-wan-tls-key": cfg.wan_tls_key,
           "--pdd-wan-tls-ca": cfg.wan_tls_ca}
    if any(tls.values()):
        if cfg.role not in ("prefill", "main"):
            raise PddConfigError(f"--pdd-wan-tls-* apply only to roles prefill and main, not {cfg.role}")
        missing = [flag for flag, value in tls.items() if not value]
        if missing:
            raise PddConfigError(f"mutual TLS needs all of --pdd-wan-tls-cert/-key/-ca; missing {', '.join(missing)}")
    control_tls = {"--pdd-control-tls-cert": cfg.control_tls_cert, "--pdd-control-tls-key": cfg.control_tls_key,
                   "--pdd-control-tls-ca": cfg.control_tls_ca}
    if any(control_tls.values()):
        if cfg.role not in ("prefill", "main"):
            raise PddConfigError(f"--pdd-control-tls-* apply only to roles prefill and main, not {cfg.role}")
        if not cfg.control_listen:
            raise PddConfigError("--pdd-control-tls-* need --pdd-control-listen (the API they protect)")
        missing = [flag for flag, value in control_tls.items() if not value]
        if missing:
            raise PddConfigError(f"mutual TLS on the control API needs all of --pdd-control-tls-cert/-key/-ca; "
                                 f"missing {', '.join(missing)}")
    for flag, value in (("--pdd-control-trusted-sources", cfg.control_trusted_sources),
                        ("--pdd-control-names", cfg.control_names)):
        if value is not None and not cfg.control_listen:
            raise PddConfigError(f"{flag} needs --pdd-control-listen (the API it configures)")
    try:
        parse_networks(cfg.control_trusted_sources)
    except ValueError as e:
        raise PddConfigError(f"--pdd-control-trusted-sources: {e}") from None
    for name in control_names(cfg):
        if name_authority(name, 1) is None:
            raise PddConfigError(f"--pdd-control-names: {name!r} is not a host name or address, "
                                 f"optionally with a :port (a proxy's)")
    if cfg.role == "relay" and cfg.intra_dc_transport == "tcp" and not cfg.wan_key_file:
        raise PddConfigError("--pdd-intra-dc-transport tcp needs --pdd-wan-key-file (P and RLD authenticate)")
    if cfg.wan_peers is not None:
        parse_peer_list("--pdd-wan-peers", cfg.wan_peers)
    for flag, name in (("--pdd-wan-peers", "wan_peers"), ("--pdd-wan-streams", "wan_streams"),
                       ("--pdd-max-md-tp", "max_md_tp"),
                       ("--pdd-wan-staging-mb", "wan_staging_mb"),
                       ("--pdd-wan-destination-wait-ms", "wan_destination_wait_ms")):
        if cfg.role != "prefill" and getattr(cfg, name) != getattr(defaults, name):
            raise PddConfigError(f"{flag} applies only to --pdd-role prefill, not {cfg.role}")
    for flag, name in (("--pdd-md-staging-mb", "md_staging_mb"), ("--pdd-md-ingest", "md_ingest")):
        if cfg.role != "main" and getattr(cfg, name) != getattr(defaults, name):
            raise PddConfigError(f"{flag} applies only to --pdd-role main, not {cfg.role}")
    if cfg.kv_max_handshakes_per_source < 1:
        raise PddConfigError(f"--pdd-kv-max-handshakes-per-source must be >= 1, got {cfg.kv_max_handshakes_per_source}")
    if not 0 <= cfg.kv_reserved_handshakes <= 63:  # of the acceptor's 64 pre-auth slots
        raise PddConfigError(f"--pdd-kv-reserved-handshakes must be in 0..63, got {cfg.kv_reserved_handshakes}")
    try:
        admission_limits(cfg)
    except ValueError as e:
        raise PddConfigError(f"--pdd-kv-trusted-sources: {e}") from None
    if cfg.md_staging_mb < 0:
        raise PddConfigError(f"--pdd-md-staging-mb must be >= 1 (or 0: a share of MD's KV pool), got {cfg.md_staging_mb}")
    if cfg.md_ingest not in MD_INGEST_MODES:
        raise PddConfigError(f"--pdd-md-ingest must be one of {MD_INGEST_MODES}, got {cfg.md_ingest!r}")
    if cfg.role == "main" and cfg.intra_dc_transport != defaults.intra_dc_transport:
        raise PddConfigError("--pdd-intra-dc-transport applies only to roles prefill and relay, not main")
    if cfg.intra_dc_transport not in INTRA_DC_TRANSPORTS:
        raise PddConfigError(f"--pdd-intra-dc-transport must be one of {INTRA_DC_TRANSPORTS}")
    if not 0 <= cfg.wan_destination_wait_ms <= 60000:
        raise PddConfigError(f"--pdd-wan-destination-wait-ms must be in 0..60000, got {cfg.wan_destination_wait_ms}")
    if cfg.wan_staging_mb < 16:
        raise PddConfigError(f"--pdd-wan-staging-mb must be >= 16, got {cfg.wan_staging_mb}")
    try:
        check_md_tp(cfg.max_md_tp, name="--pdd-max-md-tp")
    except ValueError as e:
        raise PddConfigError(str(e)) from None
    if not 1 <= cfg.wan_streams <= 64:
        raise PddConfigError(f"--pdd-wan-streams must be in 1..64, got {cfg.wan_streams}")
    if not cfg.wan_timeout_s > 0:
        raise PddConfigError(f"--pdd-wan-timeout-s must be > 0, got {cfg.wan_timeout_s}")
    return cfg


def control_names(cfg: PddConfig) -> tuple[str, ...]:
    """``--pdd-control-names`` as a tuple of host names (lower case)."""
    return tuple(n.strip().lower() for n in (cfg.control_names or "").split(",") if n.strip())


# MD's staging default: the share of its KV pool that rooms in flight may hold. A fixed size
# could not fit every model (4 GiB held one 61k-token DeepSeek-V3 prompt, or 13k tokens of
# Llama-3-70B's 320 KB/token KV); a share scales with the model's KV size and MD's pool, and a
# quarter left MD's refusals near zero in the simulator's sweep of it without taking the
# pool from running requests (docs/sim-notebook.md, "MD staging").
MD_STAGING_POOL_SHARE = 0.25


def md_staging_bytes(staging_mb: int, pool_tokens: int, kv_bytes_per_token: int) -> int:
    """MD's staging budget in bytes: --pdd-md-staging-mb if given, else its share of the pool
    (at least 1 MiB, so a pool-less test double still admits a tiny room)."""
    if staging_mb > 0:
        return staging_mb << 20
    return max(1 << 20, int(MD_STAGING_POOL_SHARE * pool_tokens * kv_bytes_per_token))


def admission_limits(cfg: PddConfig):
    """The KV acceptor's pre-auth limits (sglang_pdd.admission.AdmissionLimits) from the flags."""
    return AdmissionLimits(per_source=cfg.kv_max_handshakes_per_source, reserved=cfg.kv_reserved_handshakes,
                           trusted=parse_networks(cfg.kv_trusted_sources))
