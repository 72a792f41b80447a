"""The WAN bytes in flight as the router counts them, and what of them a new transfer waits
behind (pure bookkeeping, no I/O)."""

from __future__ import annotations

from typing import Hashable, Iterable


def competing_wan_bytes(waited_sizes: Iterable[int], own_bytes: int) -> int:
    """Bytes that cross the link before a new transfer of ``own_bytes`` that someone waits for
    has landed: each transfer in flight that someone waits for, up to ``own_bytes``. P's WAN
    sender interleaves the rooms someone waits for chunk by chunk (kv_channel/send_order.py),
    so the link is shared fairly between them: one larger than ours is still sending when ours
    is done, having sent as much as ours; a smaller one has sent all of its bytes. Transfers
    only kept for MD's cache go behind every waited one and are not counted. The router
    (router/flow/pdd_flow.py) and the simulator both count through this function."""
    own = max(0, int(own_bytes))
    return sum(min(max(0, int(b)), own) for b in waited_sizes)


class WanInFlight:
    """KV bytes the router has had P send toward MD over the WAN that someone waits for and
    that have not landed (nor failed, nor been dropped with their request, nor been left to
    land for MD's cache only): what a new P->MD transfer shares the link with as far as the
    router can tell. The path policy counts them (``competing_wan_bytes``); without them every
    request alone fits a link that together they overrun."""

    def __init__(self) -> None:
        self._bytes: dict[Hashable, int] = {}
        self.total = 0

    def sending(self, key: Hashable, nbytes: int) -> None:
        self.settled(key)
        self._bytes[key] = nbytes
        self.total += nbytes

    @property
    def transfers(self) -> int:
        """Transfers in flight: those a new one shares the link with."""
        return len(self._bytes)

    def sizes(self) -> Iterable[int]:
        """Each transfer's bytes (a view: read it before the next change)."""
        return self._bytes.values()

    def competing(self, own_bytes: int) -> int:
        """``competing_wan_bytes`` over the transfers in flight."""
        return competing_wan_bytes(self._bytes.values(), own_bytes)

    def settled(self, key: Hashable) -> None:
        """The transfer landed, failed, was dropped or is now kept only (idempotent)."""
        self.total -= self._bytes.pop(key, 0)
