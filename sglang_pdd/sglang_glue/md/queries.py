"""What MD's control threads ask of its rooms without queueing a command: wait until a room is
ready, turn a handoff into MD's own /generate, whether a cache flush is safe now, DRC stats.

Built over one rank's rooms (rooms.RankRooms: the DrcRoomTable table, the ready events, the
counters, ...): reads of the scheduler thread's state, plus the one change a control thread
makes itself, the final handoff, which goes through the room's state machine.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

from sglang_pdd.protocol import ControlError, HandoffRequest, ReadyReply, ReadyRequest
from sglang_pdd.radix_drc.room_state import DrcPhase
from sglang_pdd.radix_drc.rooms import RoomError, RoomStatus
from sglang_pdd.sglang_glue.md.rooms import RankRooms
from sglang_pdd.sglang_glue.md.resume import handoff_generate_body

logger = logging.getLogger(__name__)


class MdRoomQueries:
    """The control threads' reads of ``rank_rooms`` (owned by the scheduler thread)."""

    def __init__(self, rank_rooms: RankRooms):
        self.rank_rooms = rank_rooms
        self._handoff_lock = threading.Lock()  # control threads: one final handoff per room

    @property
    def held_tokens(self) -> int:
        """Pool slots held by rooms in flight (reserved, or waiting for the receiver to let go)."""
        return self.rank_rooms.pages.held_tokens

    def wait_ready(self, req: ReadyRequest) -> ReadyReply:
        event = self.rank_rooms.ready_events.get(req.room)
        if event is None:
            raise RoomError(f"unknown room {req.room}")
        event.wait(req.timeout_s)
        entry = self.rank_rooms.table.rooms.get(req.room)
        if entry is None:
            return ReadyReply(req.room, "failed", "released or expired")
        return ReadyReply(req.room, **entry.report())

    def handoff_request(self, room: int, req: HandoffRequest) -> tuple[dict, bool]:
        """Turn a compact handoff (eager token ids) into MD's own /generate request.

        Only the eager tokens cross the WAN; the prompt's ids are the ones MD registered.
        Returns (generate body, stream?). Stale (unknown / not ready) and duplicate final
        handoffs are refused as conflicts (ControlError 409)."""
        entry = self.rank_rooms.table.rooms.get(room)
        if entry is None or entry.status is not RoomStatus.READY:
            logger.warning("stale handoff for room %s (%s) ignored", room,
                           "unknown" if entry is None else entry.status.value)
            raise ControlError.of("conflict",
                                  f"stale handoff: room {room} is {'unknown' if entry is None else entry.status.value}")
        # MD continues the request: the eager tokens are output already produced (resume.py)
        gen, stream = handoff_generate_body(entry.token_ids, req)
        if not req.warmup:  # a warmup (catch-up batch) only extends, it may repeat
            with self._handoff_lock:
                try:
                    self.rank_rooms.table.hand_off(room)
                except RoomError as e:  # a duplicate, or the room ended meanwhile
                    logger.warning("%s ignored", e)
                    raise ControlError.of("conflict", str(e)) from None
                counters = self.rank_rooms.counters
                counters["handoffs"] = counters.get("handoffs", 0) + 1
        return gen, stream

    def flush_blocker(self) -> Optional[str]:
        """Why SGLang's flush_cache must not run now, or None. A flush resets the radix tree
        and the pool allocator under MD's rooms: the prefixes they locked and the pages they
        reserved for KV still landing would be handed out again. A failed room holds neither
        (it waits only to tell the router why)."""
        holding = {phase: n for phase, n in self.rooms_by_phase().items() if DrcPhase(phase).holds_kv}
        held = self.held_tokens
        if not holding and not held:
            return None
        parts = []
        if holding:
            rooms = sum(holding.values())
            phases = ", ".join(f"{phase} {n}" for phase, n in sorted(holding.items()))
            parts.append(f"MD holds {rooms} PDD room{'s' if rooms != 1 else ''} of requests in flight ({phases})")
        if held:
            parts.append(f"{held} KV slots are held for the WAN" + ("" if holding else
                         " (rooms that ended, until the WAN receiver lets go of them)"))
        return "; ".join(parts)

    def flush_waits_only_for_pages(self) -> bool:
        """No room holds anything, only pages of rooms that ended are on their way back: a
        flush may wait that out (moments: the receiver finishes the chunk it is reading)."""
        return self.held_tokens > 0 and not any(DrcPhase(p).holds_kv for p in self.rooms_by_phase())

    def rooms_by_phase(self) -> dict:
        """How many open rooms are in each phase (radix_drc.room_state.DrcPhase), e.g. {"ready": 2}."""
        counts: dict = {}
        for entry in list(self.rank_rooms.table.rooms.values()):  # a control thread: copy, the table may change
            phase = entry.state.phase.value
            counts[phase] = counts.get(phase, 0) + 1
        return counts

    def stats(self) -> dict:
        """DRC hit rate and WAN bytes (radix_drc.stats), room counts, receiver counters."""
        rooms = self.rank_rooms
        drc = rooms.drc_stats.as_dict()
        return {**drc, **rooms.counters, "wan_tokens": drc["tokens_received"], "wan_bytes": drc["bytes_received"],
                "open_rooms": len(rooms.table.rooms), "rooms_by_phase": self.rooms_by_phase(),
                "held_kv_slots": self.held_tokens, "tp_size": rooms.tp_size,
                "kv_bytes_per_token": rooms.kv_bytes_per_token, **rooms.window_report(),
                "wan_receiver": rooms.receiver.stats()}  # its counters, incl. the acceptor's refusals by kind
