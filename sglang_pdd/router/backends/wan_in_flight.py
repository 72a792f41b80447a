"""The WAN bytes in flight as the router counts them (pure bookkeeping, no I/O)."""

from __future__ import annotations


class WanInFlight:
    """KV bytes the router has had P send toward MD over the WAN that have not landed (nor
    failed, nor been dropped with their request): what the link still carries as far as the
    router can tell. The path policy counts them as traffic a new P->MD transfer queues
    behind; without them every request alone fits a link that together they overrun."""

    def __init__(self) -> None:
        self._bytes: dict[str, int] = {}
        self.total = 0

    def sending(self, key: str, nbytes: int) -> None:
        self.settled(key)
        self._bytes[key] = nbytes
        self.total += nbytes

    @property
    def transfers(self) -> int:
        """Transfers in flight: those a new one shares the link with."""
        return len(self._bytes)

    def settled(self, key: str) -> None:
        """The transfer landed, failed or was dropped (idempotent)."""
        self.total -= self._bytes.pop(key, 0)
