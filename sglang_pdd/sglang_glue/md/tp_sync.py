"""The two collectives MD's room lifecycle needs when MD runs with SGLang ``--tp N``.

Every TP rank runs its own scheduler with its own KV pool, allocator and radix tree; SGLang
keeps them identical by running the same schedule on every rank. MD's room commands (reserve
pages, insert into the tree, free pages) must therefore change every rank in the same
scheduler iteration (main_drc.py): rank 0 decides what happens (``share`` its clock and room
commands), and a room is ready / its pages free only when every rank agrees (``all_min``).

``SingleRank`` (TP 1) does no collective at all: MD at TP 1 behaves and costs as before.
"""

from __future__ import annotations

import pickle
from typing import Protocol


class TpSync(Protocol):
    rank: int  # this scheduler's rank in MD's TP group
    size: int

    def share(self, now: float, commands: list) -> tuple[float, list]:
        """Rank 0's clock reading and room commands, on every rank (the others' are ignored)."""

    def all_min(self, values: list[int]) -> list[int]:
        """Element-wise minimum over the ranks; every rank passes a list of the same length."""


class SingleRank:
    rank = 0
    size = 1

    def share(self, now: float, commands: list) -> tuple[float, list]:
        return now, commands

    def all_min(self, values: list[int]) -> list[int]:
        return list(values)


class GroupTpSync:
    """Over a torch.distributed CPU (gloo) group: SGLang's own ``tp_cpu_group``, the one its
    scheduler broadcasts requests over. An iteration without room commands costs one broadcast
    of two numbers (as SGLang's own ``broadcast_pyobj`` of no request does); commands add one."""

    def __init__(self, rank: int, size: int, cpu_group, global_rank: int, global_src: int):
        self.rank, self.size = rank, size
        self._group, self._global_rank, self._global_src = cpu_group, global_rank, global_src

    @classmethod
    def of_sglang_group(cls, group) -> "GroupTpSync":
        """From SGLang's GroupCoordinator (``scheduler.tp_group``)."""
        return cls(group.rank_in_group, group.world_size, group.cpu_group, group.rank, group.ranks[0])

    def share(self, now: float, commands: list) -> tuple[float, list]:
        import torch
        import torch.distributed as dist

        payload = pickle.dumps(commands) if self.rank == 0 and commands else b""
        # float64 holds the clock and the size exactly; rank 0 uses the value it sent, too
        header = torch.tensor([now, len(payload)], dtype=torch.float64)
        dist.broadcast(header, src=self._global_src, group=self._group)
        now, size = header[0].item(), int(header[1].item())
        if not size:
            return now, []
        data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.rank == 0
                else torch.empty(size, dtype=torch.uint8))
        dist.broadcast(data, src=self._global_src, group=self._group)
        return now, (commands if self.rank == 0 else pickle.loads(data.numpy().tobytes()))

    def all_min(self, values: list[int]) -> list[int]:
        import torch
        import torch.distributed as dist

        if not values:
            return []
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._group)
        return t.tolist()


def tp_sync_of(scheduler) -> TpSync:
    """MD's TP group: SGLang's scheduler's TP group, or a single rank (TP 1, or no group)."""
    group = getattr(scheduler, "tp_group", None)
    if group is None or getattr(group, "world_size", 1) <= 1:
        return SingleRank()
    return GroupTpSync.of_sglang_group(group)
