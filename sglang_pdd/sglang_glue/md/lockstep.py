"""What MD's TP ranks vote on each scheduler iteration, and how a vote becomes the group's decision.

Each vote is a small frozen dataclass of yes/no fields; ``agree`` sends the votes of one
iteration through one element-wise MIN over the ranks (tp_sync.TpSync.all_min), so a field
comes back true only if it is true on every rank. Every rank passes the same kinds of vote in
the same order (they are derived from state every rank shares), so the flattened lists line up.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields
from typing import Sequence, TypeVar

from sglang_pdd.kv_channel.contract import RoomState
from sglang_pdd.sglang_glue.md.tp_sync import TpSync


@dataclass(frozen=True)
class RegistrationVote:
    """This rank registered the room (its receiver may refuse a room id it is still letting go of)."""
    made: bool


@dataclass(frozen=True)
class RoomVote:
    """This rank's receiver on a room whose KV is landing."""
    landed: bool  # every chunk of this rank's slice is in
    alive: bool  # not failed (still landing, or landed)

    @classmethod
    def of(cls, state: RoomState) -> "RoomVote":
        return cls(landed=state is RoomState.SUCCESS, alive=state is not RoomState.FAILED)


@dataclass(frozen=True)
class ReleaseVote:
    """This rank's release thread on a room's reserved pages."""
    let_go: bool  # the receiver's release of the room has finished (either way)
    ok: bool  # ...without an error (nothing can still write into the pages)

    @classmethod
    def of(cls, outcome) -> "ReleaseVote":
        """``outcome``: None while the release runs, then True (released) or False (failed)."""
        return cls(let_go=outcome is not None, ok=outcome is not False)


V = TypeVar("V")


def agree(tp: TpSync, votes: Sequence[V]) -> list[V]:
    """The group's decision on each vote: every field the minimum over the ranks. One collective
    for the whole list; none when it is empty (then on every rank)."""
    flat = [int(v) for vote in votes for v in astuple(vote)]
    if not flat:
        return []
    agreed = iter(tp.all_min(flat))
    return [type(vote)(*(bool(next(agreed)) for _ in fields(vote))) for vote in votes]
