"""Choice of the intra-datacenter engine (P -> RLD) behind ``--pdd-intra-dc-transport``.

Mooncake's TransferEngine is the intra-DC path (RDMA in production, its TCP transport in
tests). When the ``mooncake`` package is not importable, ``auto`` falls back to the
``TcpTransferEngine`` of this package: the same one-sided writes into registered memory
over authenticated TCP, so SGLang's Mooncake protocol runs on top unchanged. P and RLD must
end up with the same engine; ``auto`` does on identical installs.
"""

import importlib.util
import logging

logger = logging.getLogger(__name__)

AUTO = "auto"
MOONCAKE = "mooncake"
TCP = "tcp"
CHOICES = (AUTO, MOONCAKE, TCP)


class TransportUnavailable(RuntimeError):
    pass


def mooncake_available() -> bool:
    try:
        return importlib.util.find_spec("mooncake.engine") is not None
    except (ImportError, ValueError):  # parent package missing or broken
        return False


def intra_dc_transport(requested: str = AUTO, mooncake_installed=None) -> str:
    """The engine to use: ``"mooncake"`` or ``"tcp"``.

    ``auto`` prefers Mooncake and falls back to TCP with a warning; ``mooncake`` without the
    package is an error (the operator asked for RDMA); ``tcp`` is always honoured.
    """
    if requested not in CHOICES:
        raise ValueError(f"intra-DC transport must be one of {CHOICES}, got {requested!r}")
    have = mooncake_available() if mooncake_installed is None else mooncake_installed
    if requested == TCP:
        return TCP
    if have:
        return MOONCAKE
    if requested == MOONCAKE:
        raise TransportUnavailable("--pdd-intra-dc-transport mooncake, but the mooncake package is not "
                                   "installed (pip install mooncake-transfer-engine, or use auto/tcp)")
    logger.warning("mooncake not installed: the intra-DC KV path falls back to the TCP engine")
    return TCP
