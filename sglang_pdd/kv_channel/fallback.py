"""Choice of the intra-datacenter transport (P -> RLD).

Mooncake TransferEngine is the intra-DC path (RDMA in production, TCP in tests). When
the ``mooncake`` package is not importable, the same WAN channel (``WanKvSender`` /
``WanKvReceiver``) carries P -> RLD too: nothing in it is WAN-specific, it is a TCP
transport with auth, checksums and clean failure. A wrapper picks one with
:func:`intra_dc_transport` at start-up and logs the choice.
"""

import importlib.util
import logging

logger = logging.getLogger(__name__)

MOONCAKE = "mooncake"
TCP = "tcp"


def mooncake_available() -> bool:
    try:
        return importlib.util.find_spec("mooncake.engine") is not None
    except (ImportError, ValueError):  # parent package missing or broken
        return False


def intra_dc_transport(preferred: str = MOONCAKE) -> str:
    """``"mooncake"`` if preferred and importable, else ``"tcp"`` (the WAN channel)."""
    if preferred == MOONCAKE and mooncake_available():
        return MOONCAKE
    if preferred == MOONCAKE:
        logger.warning("mooncake not installed: the intra-DC KV path falls back to the TCP channel")
    return TCP
