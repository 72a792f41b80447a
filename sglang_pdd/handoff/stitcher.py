"""One client stream out of two decoders (pure): RLD's eager tokens, then MD's continuation.

Positions are absolute output positions (0 = the first generated token). Invariants, which the
tests check on every transition: what has been emitted never changes, emitted positions are
contiguous, and every position is emitted exactly once, by RLD before the cut and by MD after it.

    RELAY ──begin_handoff()──▶ HANDING_OFF ──first MD token──▶ MAIN
      ▲                             │
      └──── handoff_failed() ───────┘      (RLD's tokens buffered meanwhile are released)

While HANDING_OFF, RLD keeps decoding (it is aborted only once MD has produced a token), so a
failed or slow MD costs latency, never tokens.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Source(str, enum.Enum):
    RELAY = "relay"
    HANDING_OFF = "handing_off"
    MAIN = "main"


class StitchError(RuntimeError):
    """A decoder reported tokens that contradict the stream (a bug or a stale message)."""


@dataclass
class StreamStitcher:
    emitted: list[int] = field(default_factory=list)
    source: Source = Source.RELAY
    cut: int = -1  # first position MD generates; -1 before any handoff
    rld_tokens: list[int] = field(default_factory=list)  # everything RLD produced, by position
    handoffs_failed: int = 0

    def on_rld_tokens(self, tokens: list[int]) -> list[int]:
        """RLD produced ``tokens`` (next positions). Returns what to emit now."""
        self.rld_tokens.extend(tokens)
        if self.source is Source.RELAY:
            return self._emit_from(self.rld_tokens)
        return []  # held back (HANDING_OFF) or dropped (MAIN: MD owns those positions)

    def begin_handoff(self) -> list[int]:
        """Freeze RLD's stream at the current position; returns the eager tokens MD needs."""
        if self.source is not Source.RELAY:
            raise StitchError(f"handoff already {self.source.value}")
        self.source = Source.HANDING_OFF
        self.cut = len(self.emitted)
        return list(self.emitted)

    def on_md_tokens(self, start: int, tokens: list[int]) -> list[int]:
        """MD produced ``tokens`` for positions ``start, start+1, ...``. Returns what to emit."""
        if self.source is Source.RELAY:
            raise StitchError("MD tokens before any handoff")
        if start < self.cut:
            raise StitchError(f"MD tokens start at {start}, before the cut at {self.cut}")
        if self.source is Source.HANDING_OFF:
            if start != self.cut:
                raise StitchError(f"MD's first token is at {start}, expected the cut {self.cut}")
            self.source = Source.MAIN
        if start != len(self.emitted):
            raise StitchError(f"MD tokens start at {start}, stream is at {len(self.emitted)}")
        self.emitted.extend(tokens)
        return list(tokens)

    def handoff_failed(self) -> list[int]:
        """MD could not take over before producing a token: RLD continues; release its backlog."""
        if self.source is not Source.HANDING_OFF:
            raise StitchError(f"no handoff in flight (source {self.source.value})")
        self.source = Source.RELAY
        self.cut = -1
        self.handoffs_failed += 1
        return self._emit_from(self.rld_tokens)

    def resume_relay(self) -> None:
        """A fresh relay stream continues from the current position (MD died mid-stream or its
        KV never arrived after RLD had stopped): its tokens count from ``len(emitted)`` on."""
        self.source = Source.RELAY
        self.cut = -1
        self.rld_tokens = list(self.emitted)

    def _emit_from(self, produced: list[int]) -> list[int]:
        new = produced[len(self.emitted):]
        self.emitted.extend(new)
        return new

    def on_md_output(self, output_ids: list[int]) -> list[int]:
        """MD's cumulative stream, which reports the whole output from position 0 (the resume
        contract: the eager tokens it was handed come first). Returns what to emit."""
        if self.source is Source.HANDING_OFF and len(output_ids) > self.cut:
            if output_ids[:self.cut] != self.emitted[:self.cut]:
                raise StitchError("MD's output does not start with the eager tokens it was handed")
        start = len(self.emitted)
        if self.source is Source.MAIN or len(output_ids) > self.cut:
            return self.on_md_tokens(start, output_ids[start:])
        return []
